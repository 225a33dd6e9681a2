// The NVFP4 quantization of one block of 16 activations (numerics.py, "NVFP4 quantization"), shared
// by every NVFP4 kernel and by the host test driver. Only the E2M1 encoders and kFastScale (numerics.cuh)
// differ between the sm_100a/sm_103a and the sm_90a/host builds.
#pragma once

#include <cstdint>
#include <type_traits>

#include "numerics.cuh"
#include "vec.cuh"

namespace nvq {

template <typename T>
constexpr int kChunksPerBlock16 = 16 / Chunk<T>::kElems;

// The exact path of a block: the recipe step by step (NaN-ignoring amax, scale byte, out_scale, products,
// NaN-aware encoder). Taken by the blocks the fast path below cannot encode; `vn` as computed there.
template <typename T, bool UE8M0, class OutScales>
NVQ_HD uint8_t nvfp4_quant_block16_exact(const uint4 (&c)[kChunksPerBlock16<T>], float vn, float gs,
                                         const OutScales& out_scales, uint32_t& lo, uint32_t& hi) {
  float x[16];
#pragma unroll
  for (int i = 0; i < kChunksPerBlock16<T>; ++i) {
    chunk_to_float(c[i], static_cast<const T*>(nullptr), x + i * Chunk<T>::kElems);
  }
  float vmax = vn;
  if (is_nan(vn)) {  // the amax ignores NaN values
    vmax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) vmax = max_ign(vmax, fabsf(x[i]));
  }
  const uint32_t stored = nvfp4_scale_byte<UE8M0>(vmax, gs);
  const float os = out_scales.exact(stored);
  float y0[8], y1[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    y0[i] = mul_rn(x[i], os);
    y1[i] = mul_rn(x[8 + i], os);
  }
  if (nvfp4_products_signed(vn, os)) {
    uint32_t s_lo, s_hi;
    block_signs16<T>(c, x, s_lo, s_hi);
    lo = e2m1x8_finite(y0, s_lo);
    hi = e2m1x8_finite(y1, s_hi);
  } else {
    lo = e2m1x8_any(y0);
    hi = e2m1x8_any(y1);
  }
  return stored;
}

// c: the block's raw activations (16 values of T in 16-byte chunks). gs: encode global scale;
// out_scales: exact(byte) -> the recipe's out_scale (nvfp4_out_scale with inv_gs = rcp_or_zero(gs)),
// fast(byte) -> nvfp4_fast_out_scale of it (OutScaleTable or OutScaleDirect). Returns the stored scale byte;
// lo/hi receive the codes of values 0-7 and 8-15, element 2i in the low nibble of byte i.
//
// Fast path, one test per block: amax * fast out_scale < 7 * kFastScale. It holds when no value is NaN
// (vn would be NaN, which fails the test whatever scale byte it gave), the fast out_scale is not NaN (it is
// exact and non-negative), and every product is below 7 in magnitude: then no product is NaN, its
// sign is the sign of x (the signs come straight from the raw bits), and e2m1x8_fast needs no clamp.
// Every other block (NaN, Inf, a degenerate global scale, a saturated or subnormal scale byte) is redone
// by the exact path.
template <typename T, bool UE8M0, class OutScales>
NVQ_HD uint8_t nvfp4_quant_block16(const uint4 (&c)[kChunksPerBlock16<T>], float gs, const OutScales& out_scales,
                                   uint32_t& lo, uint32_t& hi) {
  constexpr int kE = Chunk<T>::kElems;
  float x[16];
#pragma unroll
  for (int i = 0; i < kChunksPerBlock16<T>; ++i) chunk_to_float(c[i], static_cast<const T*>(nullptr), x + i * kE);

  const float vn = absmax_nan16<T>(c, x);
  const uint32_t stored = nvfp4_scale_byte<UE8M0>(vn, gs);
  const float fos = out_scales.fast(stored);
  if (mul_rn(vn, fos) < 7.0f * kFastScale) {
    uint32_t s_lo, s_hi;
    block_signs16<T>(c, x, s_lo, s_hi);
    float y0[8], y1[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      y0[i] = mul_rn(x[i], fos);
      y1[i] = mul_rn(x[8 + i], fos);
    }
    lo = e2m1x8_fast(y0, s_lo);
    hi = e2m1x8_fast(y1, s_hi);
    return stored;
  }
  return nvfp4_quant_block16_exact<T, UE8M0>(c, vn, gs, out_scales, lo, hi);
}

// Out scales computed per block (kernels whose global scale changes from row to row).
template <bool UE8M0>
struct OutScaleDirect {
  float inv_gs;
  NVQ_HD float exact(uint32_t b) const { return nvfp4_out_scale<UE8M0>(uint8_t(b), inv_gs); }
  NVQ_HD float fast(uint32_t b) const { return nvfp4_fast_out_scale(exact(b)); }
};

// Out scales tabulated per scale byte for one global scale (kOutScaleTab floats, usually shared memory):
// [0, 256) the fast ones, [256, 512) the exact ones (read by the exact path only).
constexpr int kOutScaleTab = 512;

struct OutScaleTable {
  const float* table;
#if defined(__CUDA_ARCH__)
  // The table's 32-bit shared-window address, made opaque so that the compiler keeps it in a register
  // instead of rebuilding it from the CTA's window base at every lookup (3 instructions).
  uint32_t base;
  __device__ __forceinline__ explicit OutScaleTable(const float* t) : table(t) {
    asm volatile("mov.u32 %0, %1;" : "=r"(base) : "r"(uint32_t(__cvta_generic_to_shared(t))));
  }
  __device__ __forceinline__ float fast(uint32_t b) const {  // b < 256
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(base + b * 4u));
    return v;
  }
#else
  explicit OutScaleTable(const float* t) : table(t) {}
  float fast(uint32_t b) const { return table[b]; }
#endif
  NVQ_HD float exact(uint32_t b) const { return table[256 + b]; }
};

// Entry b (0..255) of an OutScaleTable for inv_gs = rcp_or_zero(gs).
template <bool UE8M0>
NVQ_HD void fill_out_scale_table(float* table, int b, float inv_gs) {
  const float os = nvfp4_out_scale<UE8M0>(uint8_t(b), inv_gs);
  table[b] = nvfp4_fast_out_scale(os);
  table[256 + b] = os;
}

}  // namespace nvq
