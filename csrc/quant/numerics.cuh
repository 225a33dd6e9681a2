// Scalar numerics of the quantization kernels: E2M1 / E4M3 / UE8M0 rounding, the NVFP4 block-scale
// recipe, correctly rounded division, the fixed fp32 SiLU, the 128x4 scale swizzle.
//
// The contract is the module docstring of nvfp4_plugin/numerics.py; every function here must give
// the same bits as its Python twin. Everything is __host__ __device__ so that the host test driver
// (csrc/tests/host_numerics.cu, run by tests/test_cuda_host_numerics.py on the CPU machine) checks
// the very code the kernels run. No framework headers.
//
// Rules that make device and host agree bit for bit:
//   * no FMA contraction: products and sums go through mul_rn / add_rn (__fmul_rn / __fadd_rn on the
//     device; the build also passes -fmad=false), so x*s+m is never fused;
//   * no approximate division: div_rn() is correctly rounded and never calls a slow-path
//     subroutine (the SASS check forbids CALL);
//   * denormals are kept (no -ftz, no --use_fast_math).
//
// Blackwell vs Hopper twins: only the E2M1 encoders (e2m1x8_finite, e2m1x8_fast) and the fast path's
// product scale kFastScale differ. On sm_100a / sm_103a the encoders are the hardware
// cvt.rn.satfinite.e2m1x2.f32 and kFastScale is 1; elsewhere (sm_90a, host) software encoders with the
// same semantics (the fast one on products scaled by 2**-6, converted with the hardware e4m3 cvt).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <cmath>

#if defined(__CUDACC__)
#define NVQ_HD __host__ __device__ __forceinline__
#else
#define NVQ_HD inline
#endif

// The hardware FP4 conversion exists on the arch-specific Blackwell targets.
#if defined(__CUDA_ARCH__) && (defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM103_ALL))
#define NVQ_HW_E2M1 1
#else
#define NVQ_HW_E2M1 0
#endif

namespace nvq {

// ------------------------------------------------------------------------------------------------
// Constants (bit-exact copies of the fp32 values in numerics.py)
// ------------------------------------------------------------------------------------------------
constexpr float kE2M1Max = 6.0f;
constexpr float kE4M3Max = 448.0f;
constexpr float kOneSixth = 0x1.555556p-3f;      // fp32(1/6)
constexpr float kOneOver448 = 0x1.24924ap-9f;    // fp32(1/448)
constexpr float kFltMax = 3.40282346638528859812e+38f;
constexpr int kE8M0Bias = 127;

constexpr float kSiluExpLo = -0x1.5d3334p+6f;    // fp32(-87.3)
constexpr float kSiluExpHi = 88.5f;
constexpr float kLog2e = 0x1.715476p+0f;
constexpr float kLn2Hi = 0x1.62e4p-1f;            // 15 significant bits: n * kLn2Hi is exact
constexpr float kLn2Lo = 0x1.7f7d1cp-20f;
constexpr float kExpC2 = 0.5f;
constexpr float kExpC3 = 0x1.555556p-3f;
constexpr float kExpC4 = 0x1.555556p-5f;
constexpr float kExpC5 = 0x1.111112p-7f;
constexpr float kExpC6 = 0x1.6c16c2p-10f;

// ------------------------------------------------------------------------------------------------
// Bit casts and IEEE operations without contraction
// ------------------------------------------------------------------------------------------------
NVQ_HD uint32_t f2u(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

NVQ_HD float u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

NVQ_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  volatile float r = a * b;  // the host driver is built with -ffp-contract=off as well
  return r;
#endif
}

NVQ_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  volatile float r = a + b;
  return r;
#endif
}

NVQ_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  volatile float r = a - b;
  return r;
#endif
}

NVQ_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fmaf(a, b, c);
#endif
}

NVQ_HD double dfma_rn(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
  return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

NVQ_HD bool is_nan(float x) { return (f2u(x) & 0x7FFFFFFFu) > 0x7F800000u; }

// max(a, b) that propagates NaN (PTX max.NaN): lets a block's amax detect NaN for free.
NVQ_HD float max_nan(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  if (is_nan(a) || is_nan(b)) return u2f(0x7FFFFFFFu);
  return a > b ? a : b;
#endif
}

// fmaxf semantics (NaN ignored), identical on host and device.
NVQ_HD float max_ign(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fmaxf(a, b);
#else
  if (is_nan(a)) return b;
  if (is_nan(b)) return a;
  return a > b ? a : b;
#endif
}

// ------------------------------------------------------------------------------------------------
// Correctly rounded division without subroutine calls
// ------------------------------------------------------------------------------------------------
// Approximate reciprocals: the hardware MUFU units on the device; on the host a deliberately
// perturbed value (a few ulp off) so that the host tests exercise the refinement steps.
NVQ_HD float rcp_approx_f32(float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
  return r;
#else
  float r = 1.0f / b;
  uint32_t u = f2u(r);
  if ((u & 0x7F800000u) != 0 && (u & 0x7F800000u) != 0x7F800000u) {
    uint32_t h = f2u(b) * 2654435761u;
    u += (h >> 29) - 3;  // -3 .. +4 ulp
  }
  return u2f(u);
#endif
}

NVQ_HD double rcp_approx_f64(double b) {
#if defined(__CUDA_ARCH__)
  double r;
  asm("rcp.approx.ftz.f64 %0, %1;" : "=d"(r) : "d"(b));
  return r;
#else
  double r = 1.0 / b;
  uint64_t u;
  std::memcpy(&u, &r, 8);
  u ^= (u >> 7) & 0x3FFFFFFull;  // perturb the low 26 mantissa bits: about 2^-26 relative error
  std::memcpy(&r, &u, 8);
  return r;
#endif
}

// a / b for finite non-zero a, b, evaluated in fp64 (every float and every quotient of two floats
// is a normal double) and rounded once to fp32. Two Newton steps and one residual correction give a
// double within 2^-100 of the quotient before the final rounding of the product; the nearest float
// midpoint is never closer than 2^-50 relative unless the quotient is exactly representable, so the
// conversion to fp32 rounds correctly (subnormal and overflowing results included).
NVQ_HD float div_rn_f64(float a, float b) {
  const double ad = a, bd = b;
  double r = rcp_approx_f64(bd);
  r = dfma_rn(dfma_rn(-bd, r, 1.0), r, r);
  r = dfma_rn(dfma_rn(-bd, r, 1.0), r, r);
  double q = ad * r;
  q = dfma_rn(dfma_rn(-bd, q, ad), r, q);
  return (float)q;  // cvt.rn.f32.f64
}

// IEEE a / b (round to nearest even), all inputs. The fp32 fast path is the classic
// reciprocal + Newton + residual sequence, exact when no intermediate leaves the normal range;
// the exponent test below keeps it to that range, and everything else goes through fp64.
// div_rn's fp32 fast path (valid where div_rn's `fast` test holds); the fused SiLU kernels call it directly.
NVQ_HD float div_rn_fastpath(float a, float b) {
  float r = rcp_approx_f32(b);
  r = fma_rn(fma_rn(-b, r, 1.0f), r, r);
  float q = mul_rn(a, r);
  const float rem = fma_rn(-b, q, a);
  return fma_rn(rem, r, q);
}

NVQ_HD float div_rn(float a, float b) {
  const uint32_t ua = f2u(a), ub = f2u(b);
  const uint32_t ea = (ua >> 23) & 0xFFu, eb = (ub >> 23) & 0xFFu;
  // both normal with biased exponents in [32, 221] and the quotient within 2**+-101
  const bool fast = (ea - 32u < 190u) && (eb - 32u < 190u) && (ea - eb + 100u <= 200u);
  if (fast) return div_rn_fastpath(a, b);
  const bool a_nan = is_nan(a), b_nan = is_nan(b);
  const bool a_inf = (ua & 0x7FFFFFFFu) == 0x7F800000u, b_inf = (ub & 0x7FFFFFFFu) == 0x7F800000u;
  const bool a_zero = (ua & 0x7FFFFFFFu) == 0, b_zero = (ub & 0x7FFFFFFFu) == 0;
  const uint32_t sign = (ua ^ ub) & 0x80000000u;
  if (a_nan || b_nan || (a_inf && b_inf) || (a_zero && b_zero)) return u2f(0x7FFFFFFFu);
  if (a_inf || b_zero) return u2f(sign | 0x7F800000u);
  if (a_zero || b_inf) return u2f(sign);
  return div_rn_f64(a, b);
}

// IEEE 1 / b.
NVQ_HD float rcp_rn(float b) { return div_rn(1.0f, b); }

// 1 / b, or 0 where b == 0 (the reference's _inverse_or_zero / "1/gs unless gs == 0").
NVQ_HD float rcp_or_zero(float b) { return b == 0.0f ? 0.0f : rcp_rn(b); }

// ------------------------------------------------------------------------------------------------
// Powers of two and exponents (exact, subnormals included)
// ------------------------------------------------------------------------------------------------
// 2**e as fp32 for any integer e: 0 below 2**-149 (2**-150 rounds to 0), +inf above 2**127.
NVQ_HD float exp2_int(int e) {
  if (e > 127) return u2f(0x7F800000u);
  if (e >= -126) return u2f(uint32_t(e + 127) << 23);
  if (e >= -149) return u2f(1u << (e + 149));
  return 0.0f;
}

NVQ_HD int clz32(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __clz(x);
#else
  return x ? __builtin_clz(x) : 32;
#endif
}

// Smallest e with 2**e >= x, for finite x > 0 (torch.frexp semantics); 0 for x == 0.
NVQ_HD int ceil_log2(float x) {
  const uint32_t u = f2u(x) & 0x7FFFFFFFu;
  if (u == 0) return 0;
  const uint32_t ex = u >> 23, man = u & 0x7FFFFFu;
  if (ex != 0) return int(ex) - 127 + (man != 0);
  const int fl = (31 - clz32(man)) - 149;  // floor(log2(x)) of a subnormal
  return fl + ((man & (man - 1)) != 0);
}

// ------------------------------------------------------------------------------------------------
// FP8 E4M3
// ------------------------------------------------------------------------------------------------
// fp32 -> e4m3 byte: round to nearest even, saturating at +-448, NaN kept (0x7F).
NVQ_HD uint8_t e4m3_satfinite(float x) {
  return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

// The same byte in a 32-bit register whose upper bits the compiler knows to be zero (an index with no
// masking; the device conversion writes a 16-bit pair with a zero high byte, widened).
NVQ_HD uint32_t e4m3_satfinite_u32(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t r;
  asm("{\n.reg .b16 h, z;\ncvt.rn.satfinite.e4m3x2.f32 h, 0f00000000, %1;\nmov.b16 z, 0;\nmov.b32 %0, {h, z};\n}"
      : "=r"(r)
      : "f"(x));
  return r;
#else
  return e4m3_satfinite(x);
#endif
}

// Two values in one conversion: low byte from lo, high byte from hi.
NVQ_HD uint16_t e4m3x2_satfinite(float lo, float hi) {
  float2 v;
  v.x = lo;
  v.y = hi;
  return (uint16_t)__nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, __NV_E4M3);
}

// e4m3 byte -> fp32, exact. Device: the hardware fp8 -> fp16 conversion. Host: the 7 magnitude bits
// placed in an fp32 exponent/mantissa field and rescaled by 2**120 (subnormals stay exact).
NVQ_HD float e4m3_to_float(uint8_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3)));
#else
  const uint32_t mag = b & 0x7Fu;
  if (mag == 0x7Fu) return u2f(0x7FFFFFFFu);
  const float v = mul_rn(u2f(mag << 20), 0x1p120f);
  return u2f(f2u(v) | (uint32_t(b & 0x80u) << 24));
#endif
}

// clamp to [-448, 448] keeping NaN (torch.clamp semantics). Converting with __NV_SATFINITE after
// this clamp gives the same byte as converting without it (satfinite already maps |x| > 448 and
// +-inf to +-448 and keeps NaN); the kernels rely on that and skip the clamp (tested on the host).
NVQ_HD float clamp448(float x) { return x > kE4M3Max ? kE4M3Max : (x < -kE4M3Max ? -kE4M3Max : x); }

// ------------------------------------------------------------------------------------------------
// E2M1 (FP4): the innermost conversion and its twins
// ------------------------------------------------------------------------------------------------
// Software E2M1 magnitude (3-bit code) of one fp32 value that is never NaN (the sign is handled by
// the caller). a = min(|y|, 6) is rounded to the E2M1 grid of its binade with one float addition:
// the magic number m = 2**(22 + k) (k = 0 for a < 2, 1 for [2, 4), 2 for [4, 6]) has ulp = the grid
// step, so a + m rounds a to nearest even on that grid and the low mantissa bits of the sum are the
// grid index; the code is that index plus 2k, and 2k = (m >> 22) - 298.
NVQ_HD uint32_t e2m1_mag_sw(float y) {
  const float a = fminf(fabsf(y), kE2M1Max);
  const uint32_t t = (f2u(a) & 0x7F800000u) + 0x0B000000u;
  const uint32_t m = t > 0x4A800000u ? t : 0x4A800000u;
  const uint32_t r = f2u(add_rn(a, u2f(m)));
  return r + (m >> 22) - m - 298u;
}

// Sign bits of eight fp32 values placed at the E2M1 nibble sign positions (bit 4i + 3).
NVQ_HD uint32_t nibble_signs_f32(const float (&y)[8]) {
  uint32_t s = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) s |= (f2u(y[i]) >> 31) << (4 * i + 3);
  return s;
}

// THE INNERMOST CONVERSION (the only code that differs between the twins), in two contracts.
// Eight fp32 values -> eight E2M1 codes packed little-endian (element i in nibble i), round to
// nearest even, saturating at +-6, sign kept (also for zero). `signs` must hold the sign bits of y
// at the nibble sign positions (nibble_signs_f32(y)); callers usually have them cheaper from the raw
// activations. The hardware twin ignores it (cvt takes the sign from y).
//   e2m1x8_finite: y never NaN.
NVQ_HD uint32_t e2m1x8_hw(const float (&y)[8]) {
#if NVQ_HW_E2M1
  uint32_t out;
  // cvt packs (a, b) with a in the HIGH nibble: pass (y[2i+1], y[2i]).
  asm("{\n"
      ".reg .b8 q0, q1, q2, q3;\n"
      "cvt.rn.satfinite.e2m1x2.f32 q0, %2, %1;\n"
      "cvt.rn.satfinite.e2m1x2.f32 q1, %4, %3;\n"
      "cvt.rn.satfinite.e2m1x2.f32 q2, %6, %5;\n"
      "cvt.rn.satfinite.e2m1x2.f32 q3, %8, %7;\n"
      "mov.b32 %0, {q0, q1, q2, q3};\n"
      "}"
      : "=r"(out)
      : "f"(y[0]), "f"(y[1]), "f"(y[2]), "f"(y[3]), "f"(y[4]), "f"(y[5]), "f"(y[6]), "f"(y[7]));
  return out;
#else
  (void)y;
  return 0;
#endif
}

NVQ_HD uint32_t e2m1x8_finite(const float (&y)[8], uint32_t signs) {
#if NVQ_HW_E2M1
  (void)signs;
  return e2m1x8_hw(y);
#else
  uint32_t out = signs;
#pragma unroll
  for (int i = 0; i < 8; ++i) out += e2m1_mag_sw(y[i]) << (4 * i);
  return out;
#endif
}

// The fast path's products are taken times kFastScale: 2**-6 in the software twin, where an E2M1 value
// v times 2**-6 is an E4M3 value whose byte is (code of v) << 2 (E2M1's subnormal 0.5 lands on E4M3's
// subnormal 2**-7, 1..6 on its binades -6..-4 with the same mantissa bit), so the hardware e4m3
// conversion packs two codes per instruction; 1 in the hardware twin. Exact as long as the scaled
// out_scale stays normal: nvfp4_fast_out_scale sends every other block to the exact path.
#if NVQ_HW_E2M1
constexpr float kFastScale = 1.0f;
constexpr float kMinFastOutScale = 0.0f;
#else
constexpr float kFastScale = 0x1p-6f;
constexpr float kMinFastOutScale = 0x1p-120f;  // out_scale * 2**-6 >= 2**-126 is exact
#endif

//   e2m1x8_fast: y = products times kFastScale, never NaN, |y| < 7 * kFastScale (no clamp needed, and no
//                product reaches the rounding to 8 past the largest code). A block's largest product is
//                6 * (1 +- 2**-4) unless its scale byte saturates or is subnormal.
NVQ_HD uint32_t e2m1x8_fast(const float (&y)[8], uint32_t signs) {
#if NVQ_HW_E2M1
  (void)signs;
  return e2m1x8_hw(y);
#else
  // |y| rounded to the E2M1 grid (times 2**-6) with e2m1_mag_sw's magic addition, then taken back out:
  // v = (|y| + m) - m is exact, and e4m3(v) = code << 2.
  float v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t t = (f2u(y[i]) & 0x7F800000u) + 0x0B000000u;
    const float m = u2f(t > 0x47800000u ? t : 0x47800000u);
    v[i] = sub_rn(add_rn(fabsf(y[i]), m), m);
  }
  // bytes [c0 c2 c4 c6] and [c1 c3 c5 c7], each code << 2 (<= 0x1C: no bit crosses a byte below)
  const uint32_t even = uint32_t(e4m3x2_satfinite(v[0], v[2])) | (uint32_t(e4m3x2_satfinite(v[4], v[6])) << 16);
  const uint32_t odd = uint32_t(e4m3x2_satfinite(v[1], v[3])) | (uint32_t(e4m3x2_satfinite(v[5], v[7])) << 16);
  return (even >> 2) | (odd << 2) | signs;
#endif
}

// Same with NaN allowed (NaN -> code 0, sign cleared): shared by both twins, the NaN is replaced
// by +0 before the innermost conversion (the hardware alone would turn it into +6).
NVQ_HD uint32_t e2m1x8_any(const float (&y)[8]) {
  float s[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = is_nan(y[i]) ? 0.0f : y[i];
  return e2m1x8_finite(s, nibble_signs_f32(s));
}

// ------------------------------------------------------------------------------------------------
// NVFP4 block scale (steps 2-3 of the recipe)
// ------------------------------------------------------------------------------------------------
// Step 2: the stored scale byte of a block from its NaN-ignoring fp32 amax `vmax` (in a 32-bit integer:
// kernels index the out_scale tables with it).
// e4m3: RN satfinite of gs * (vmax * fp32(1/6)) (== after the clamp to +-448, see clamp448).
// UE8M0: biased exponent of the smallest power of two >= that value, clamped to [-127, 127];
// zero, negative (finite) or NaN values give byte 0, +-inf byte 254.
template <bool UE8M0>
NVQ_HD uint32_t nvfp4_scale_byte(float vmax, float gs) {
  const float raw = mul_rn(gs, mul_rn(vmax, kOneSixth));
  if (UE8M0) {
    int e = -kE8M0Bias;
    if ((f2u(raw) & 0x7FFFFFFFu) == 0x7F800000u) {
      e = kE8M0Bias;  // +-inf (the reference tests isinf before the sign)
    } else if (raw > 0.0f) {
      e = ceil_log2(raw);
      e = e > kE8M0Bias ? kE8M0Bias : (e < -kE8M0Bias ? -kE8M0Bias : e);
    }
    return uint32_t(e + kE8M0Bias);
  }
  return e4m3_satfinite_u32(raw);
}

// Step 3: out_scale = 0 if s == 0 else 1 / (s * (1 / gs)), with s the value of the stored byte.
// A function of the byte alone (for a given gs), so kernels with one global scale tabulate it.
template <bool UE8M0>
NVQ_HD float nvfp4_out_scale(uint8_t stored, float inv_gs) {
  const float s = UE8M0 ? exp2_int(int(stored) - kE8M0Bias) : e4m3_to_float(stored);
  return (s == 0.0f) ? 0.0f : rcp_rn(mul_rn(s, inv_gs));
}

// Whether every product x * out_scale of a block is free of NaN and carries the sign of x, from the
// block's NaN-propagating amax: no NaN value, and a finite, non-negative out_scale that is not 0
// against an infinite amax (inf * 0).
NVQ_HD bool nvfp4_products_signed(float vmax_nan, float out_scale) {
  if (!(out_scale >= 0.0f && out_scale <= kFltMax)) return false;
  return !is_nan(mul_rn(vmax_nan, out_scale));
}

// The out_scale the fast path multiplies by, from the recipe's out_scale: out_scale * kFastScale where
// that is exact and out_scale is 0 or finite and >= kMinFastOutScale; NaN otherwise, which fails the fast
// path's test for every block of that scale byte (they take the exact path).
NVQ_HD float nvfp4_fast_out_scale(float out_scale) {
  const bool ok = out_scale == 0.0f || (out_scale >= kMinFastOutScale && out_scale <= kFltMax);
  return ok ? mul_rn(out_scale, kFastScale) : u2f(0x7FFFFFFFu);
}

// ------------------------------------------------------------------------------------------------
// 128x4 swizzled scale layout
// ------------------------------------------------------------------------------------------------
// Byte offset of scale (m, k) with k_tiles = ceil(K/64) = (padded scale columns) / 4. The kernels
// keep every scale tensor below 2**31 bytes, so 32-bit arithmetic is enough.
NVQ_HD uint32_t swizzled_offset(uint32_t m, uint32_t k, uint32_t k_tiles) {
  return ((m >> 7) * k_tiles + (k >> 2)) * 512 + (m & 31) * 16 + ((m >> 5) & 3) * 4 + (k & 3);
}

// ------------------------------------------------------------------------------------------------
// SiLU in fp32, op by op (numerics.exp_fp32 / silu_fp32)
// ------------------------------------------------------------------------------------------------
// rint and the int conversion use the 1.5 * 2**23 magic addition (round to nearest even, exact for
// |t| < 2**22; here |t| <= 128), the powers 2**(n - half), 2**half (|.| <= 64) are built from their
// exponent bits: all full-rate fp32 / integer instructions, same bits as rintf / ldexp.
// The shared core of the exp_fp32 family: nb = bits of 1.5 * 2**23 + rint(y * log2e) (so
// n = nb - 0x4B400000) and the degree-6 polynomial p ~= exp(y - n * ln2), y already in range.
NVQ_HD float exp_core(float y, uint32_t& nb) {
  const float t = mul_rn(y, kLog2e);
  nb = f2u(add_rn(t, 12582912.0f));
  const float n = sub_rn(u2f(nb), 12582912.0f);
  const float r = sub_rn(sub_rn(y, mul_rn(n, kLn2Hi)), mul_rn(n, kLn2Lo));
  float p = kExpC6;
  p = add_rn(mul_rn(p, r), kExpC5);
  p = add_rn(mul_rn(p, r), kExpC4);
  p = add_rn(mul_rn(p, r), kExpC3);
  p = add_rn(mul_rn(p, r), kExpC2);
  p = add_rn(mul_rn(p, r), 1.0f);
  p = add_rn(mul_rn(p, r), 1.0f);
  return p;
}

NVQ_HD float exp_fp32(float y) {
  const float yc = fminf(fmaxf(y, kSiluExpLo), kSiluExpHi);  // NaN handled below
  uint32_t nb;
  const float p = exp_core(yc, nb);                            // nb: 1.5 * 2**23 + rint(yc * log2e)
  const int ni = int(nb - 0x4B400000u);
  const int half = ni >> 1;  // floor division by 2
  const float res = mul_rn(mul_rn(p, u2f(uint32_t(ni - half + 127) << 23)), u2f(uint32_t(half + 127) << 23));
  if (is_nan(y)) return y;
  return y > kSiluExpHi ? u2f(0x7F800000u) : res;
}

NVQ_HD float silu_fp32(float g) { return div_rn(g, add_rn(1.0f, exp_fp32(-g))); }

// ---- Cheaper, bit-identical SiLU pieces for the fused kernels (perf rewrite) --------------------

// exp_fp32(y) for every non-NaN y (same bits); a finite value for NaN y (silu_fp32_nonan lets the
// division propagate the NaN). p * 2**n as one exponent-field addition: n in [-126, 128],
// p in [0.70, 1.42], and p >= 1 where n == -126 (r > 0.036 there), so the sum is exact and normal;
// exponents past 254 (only n == 128, p >= 1) saturate to +inf, as the two-step multiply overflows.
// nb << 23 == n << 23 (mod 2**32): the magic 0x4B400000 has its low 22 bits clear.
NVQ_HD float exp_fp32_nonan(float y) {
  const float yc = fminf(fmaxf(y, kSiluExpLo), kSiluExpHi);  // NaN -> kSiluExpLo
  uint32_t nb;
  const float p = exp_core(yc, nb);
  uint32_t rb = f2u(p) + (nb << 23);
  rb = rb < 0x7F800000u ? rb : 0x7F800000u;
  return y > kSiluExpHi ? u2f(0x7F800000u) : u2f(rb);
}

// exp_fp32(y) for |y| < 65 (same bits): no clamp is active there, n = rint(y * log2e) lies in
// [-94, 94], so p * 2**n is one exact exponent-field addition (nb << 23 == n << 23 mod 2**32).
NVQ_HD float exp_fp32_inrange(float y) {
  uint32_t nb;
  const float p = exp_core(y, nb);
  return u2f(f2u(p) + (nb << 23));
}

// silu_fp32(g) where silu_div_guard(g) holds (2**-95 <= |g| < 65): same bits.
NVQ_HD float silu_fp32_guarded(float g) {
  return div_rn_fastpath(g, add_rn(1.0f, exp_fp32_inrange(-g)));
}

// The SiLU denominator 1 + exp(-g); the NaN of a NaN g is restored by the division.
NVQ_HD float silu_den(float g) { return add_rn(1.0f, exp_fp32_nonan(-g)); }

// Sufficient for div_rn(g, silu_den(g)) to take its fp32 fast path (checked exhaustively over all
// 2**32 g by csrc/tests/silu_fast_check.cu): 2**-95 <= |g| < 65.
NVQ_HD bool silu_div_guard(float g) { return fabsf(g) >= 0x1p-95f && fabsf(g) < 65.0f; }

// silu_fp32(g), same bits for every g (NaN: div_rn's canonical NaN in both).
NVQ_HD float silu_fp32_v2(float g) {
  const float d = silu_den(g);
  return silu_div_guard(g) ? div_rn_fastpath(g, d) : div_rn(g, d);
}

// silu(g) * u in fp32 (the caller rounds to the activation dtype).
NVQ_HD float silu_mul_fp32(float g, float u) { return mul_rn(silu_fp32(g), u); }

// ------------------------------------------------------------------------------------------------
// FP8 activation-quantizer scales (sgl-kernel recipes)
// ------------------------------------------------------------------------------------------------
// A NaN-ignoring amax (accumulated with fmaxf from 0) with +-inf counted as the largest finite
// value (numerics.nan_ignoring_amax(..., inf_as_max=True)).
NVQ_HD float inf_as_max(float amax) { return fminf(amax, kFltMax); }

struct GroupScale {
  float mult;     // multiplier applied to the elements
  uint32_t bits;  // stored scale: fp32 bits, or the UE8M0 byte
};

// Per-token-group: a = max(amax, eps); fp32: s = a * fp32(1/448), mult = 448 / a;
// UE8M0: e = ceil_log2(a * fp32(1/448)), mult = 2**-e, byte e + 127 (wrapping like torch's uint8 cast).
template <bool UE8M0>
NVQ_HD GroupScale fp8_group_scale(float amax, float eps) {
  const float a = max_ign(amax, eps);
  GroupScale g;
  if (UE8M0) {
    const int e = ceil_log2(mul_rn(a, kOneOver448));
    g.mult = exp2_int(-e);
    g.bits = uint32_t(e + kE8M0Bias) & 0xFFu;
  } else {
    g.mult = div_rn(kE4M3Max, a);
    g.bits = f2u(mul_rn(a, kOneOver448));
  }
  return g;
}

}  // namespace nvq
