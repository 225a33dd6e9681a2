// Activation chunks (16 bytes: 8 bf16/fp16 or 4 fp32 values) and the memory helpers of the
// quantization kernels. Element helpers are __host__ __device__ so the host driver tests them too.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "numerics.cuh"

namespace nvq {

template <typename T>
struct Chunk {
  static constexpr int kElems = 16 / sizeof(T);
};

template <typename T>
constexpr bool kIs16Bit = sizeof(T) == 2;

#if defined(__CUDACC__)

// Ask L2 to fetch the line holding p (no register result, nothing to wait for).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Read-only 16-byte load through the non-coherent path (the input is never written by the kernel).
__device__ __forceinline__ uint4 ld_nc16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void st16(void* p, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ void st8(void* p, uint2 v) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}

#endif  // __CUDACC__

// ------------------------------------------------------------------------------------------------
// Chunk <-> fp32 (exact widening; narrowing rounds to nearest even)
// ------------------------------------------------------------------------------------------------
NVQ_HD float half_bits_to_float(uint32_t h) {
  __half_raw r;
  r.x = (unsigned short)h;
  return __half2float(__half(r));
}

NVQ_HD void chunk_to_float(const uint4& c, const __nv_bfloat16*, float* out) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = u2f(w[i] << 16);
    out[2 * i + 1] = u2f(w[i] & 0xFFFF0000u);
  }
}

NVQ_HD void chunk_to_float(const uint4& c, const __half*, float* out) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = half_bits_to_float(w[i] & 0xFFFFu);
    out[2 * i + 1] = half_bits_to_float(w[i] >> 16);
  }
}

NVQ_HD void chunk_to_float(const uint4& c, const float*, float* out) {
  out[0] = u2f(c.x);
  out[1] = u2f(c.y);
  out[2] = u2f(c.z);
  out[3] = u2f(c.w);
}

NVQ_HD uint32_t pack2(const __nv_bfloat16*, float lo, float hi) {
  __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &p, 4);
  return u;
}

NVQ_HD uint32_t pack2(const __half*, float lo, float hi) {
  __half2 p = __floats2half2_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &p, 4);
  return u;
}

template <typename T>
NVQ_HD uint4 float_to_chunk(const float* v) {
  if constexpr (kIs16Bit<T>) {
    const T* tag = nullptr;
    return make_uint4(pack2(tag, v[0], v[1]), pack2(tag, v[2], v[3]), pack2(tag, v[4], v[5]), pack2(tag, v[6], v[7]));
  } else {
    return make_uint4(f2u(v[0]), f2u(v[1]), f2u(v[2]), f2u(v[3]));
  }
}

// ------------------------------------------------------------------------------------------------
// Per-chunk helpers of the NVFP4 block routine
// ------------------------------------------------------------------------------------------------
// Sign bits of 8 consecutive 16-bit values (4 words) at the E2M1 nibble sign positions (bit 4i+3):
// gather the high bytes (sign in bit 7) of the even and of the odd elements with byte permutes.
NVQ_HD uint32_t nibble_signs16(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
#if defined(__CUDA_ARCH__)
  const uint32_t a = __byte_perm(w0, w1, 0x7351);  // [e0 e2 e1 e3] high bytes
  const uint32_t b = __byte_perm(w2, w3, 0x7351);  // [e4 e6 e5 e7]
  const uint32_t even = __byte_perm(a, b, 0x5410);  // [e0 e2 e4 e6]
  const uint32_t odd = __byte_perm(a, b, 0x7632);   // [e1 e3 e5 e7]
  return ((even & 0x80808080u) >> 4) | (odd & 0x80808080u);
#else
  const uint32_t w[4] = {w0, w1, w2, w3};
  uint32_t s = 0;
  for (int i = 0; i < 8; ++i) s |= ((w[i / 2] >> (16 * (i % 2) + 15)) & 1u) << (4 * i + 3);
  return s;
#endif
}

// max |x| over the 16 values of a block, NaN if any of them is NaN (`x`: the values widened to fp32).
// 16-bit inputs: the magnitude bit patterns compared as unsigned integers, two per instruction
// (non-negative floats order like their bits; every NaN pattern is above +inf) - exact, denormals
// included, one conversion at the end.
template <typename T>
NVQ_HD float absmax_nan16(const uint4* c, const float (&x)[16]) {
  if constexpr (kIs16Bit<T>) {
    (void)x;
    const uint32_t w[8] = {c[0].x, c[0].y, c[0].z, c[0].w, c[1].x, c[1].y, c[1].z, c[1].w};
    uint32_t m;
#if defined(__CUDA_ARCH__)
    // No per-word sign masking: as unsigned halves the raw patterns order the negative values by
    // magnitude (above every positive one), as signed halves the positive ones (above every negative
    // one), so the larger of the two maxima's magnitudes is the block's.
    uint32_t umax = w[0], smax = w[0];
#pragma unroll
    for (int i = 1; i < 8; ++i) {
      umax = __vmaxu2(umax, w[i]);
      smax = __vmaxs2(smax, w[i]);
    }
    const uint32_t acc = __vmaxs2(__vmaxs2(smax, umax & 0x7FFF7FFFu), 0u);  // per half: max magnitude
    m = __vmaxu2(acc, acc >> 16) & 0xFFFFu;
#else
    m = 0;
    for (int i = 0; i < 8; ++i) {
      const uint32_t lo = w[i] & 0x7FFFu, hi = (w[i] >> 16) & 0x7FFFu;
      m = lo > m ? lo : m;
      m = hi > m ? hi : m;
    }
#endif
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
      return u2f(m << 16);
    } else {
      return half_bits_to_float(m);
    }
  } else {
    (void)c;
    float vn = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) vn = max_nan(vn, fabsf(x[i]));
    return vn;
  }
}

// Nibble sign masks of the two halves (values 0-7, 8-15) of a 16-value block.
template <typename T>
NVQ_HD void block_signs16(const uint4* c, const float (&x)[16], uint32_t& s_lo, uint32_t& s_hi) {
  if constexpr (kIs16Bit<T>) {
    (void)x;
    s_lo = nibble_signs16(c[0].x, c[0].y, c[0].z, c[0].w);
    s_hi = nibble_signs16(c[1].x, c[1].y, c[1].z, c[1].w);
  } else {
    (void)c;
    const float lo[8] = {x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]};
    const float hi[8] = {x[8], x[9], x[10], x[11], x[12], x[13], x[14], x[15]};
    s_lo = nibble_signs_f32(lo);
    s_hi = nibble_signs_f32(hi);
  }
}

}  // namespace nvq
