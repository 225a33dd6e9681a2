// The NVFP4 quantization of one block of 16 activations (numerics.py, "NVFP4 quantization"), shared
// by every NVFP4 kernel and by the host test driver. Only e2m1x8_finite() differs between the
// sm_100a/sm_103a and the sm_90a/host builds.
#pragma once

#include <cstdint>
#include <type_traits>

#include "numerics.cuh"
#include "vec.cuh"

namespace nvq {

template <typename T>
constexpr int kChunksPerBlock16 = 16 / Chunk<T>::kElems;

// c: the block's raw activations (16 values of T in 16-byte chunks). gs: encode global scale;
// out_scale_of(byte) -> out_scale (nvfp4_out_scale, or a table of it). Returns the stored scale
// byte; lo/hi receive the codes of values 0-7 and 8-15, element 2i in the low nibble of byte i.
//
// Fast paths (see EncodePath): no NaN in the block and a finite, non-negative out_scale. Then no
// product x * out_scale is NaN and its sign is the sign of x, so the signs come straight from the
// raw bits. Otherwise the block is redone with the NaN-ignoring amax and the NaN-aware encoder.
template <typename T, bool UE8M0, class OutScaleOf>
NVQ_HD uint8_t nvfp4_quant_block16(const uint4 (&c)[kChunksPerBlock16<T>], float gs, const OutScaleOf& out_scale_of,
                                   uint32_t& lo, uint32_t& hi) {
  constexpr int kE = Chunk<T>::kElems;
  float x[16];
#pragma unroll
  for (int i = 0; i < kChunksPerBlock16<T>; ++i) chunk_to_float(c[i], static_cast<const T*>(nullptr), x + i * kE);

  const float vn = absmax_nan16<T>(c, x);
  float vmax = vn;
  if (is_nan(vn)) {  // rare: the amax ignores NaN values
    vmax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) vmax = max_ign(vmax, fabsf(x[i]));
  }
  const uint8_t stored = nvfp4_scale_byte<UE8M0>(vmax, gs);
  const float os = out_scale_of(stored);
  float y0[8], y1[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    y0[i] = mul_rn(x[i], os);
    y1[i] = mul_rn(x[8 + i], os);
  }
  const EncodePath path = nvfp4_encode_path(vn, os);
  if (path != EncodePath::kAny) {
    uint32_t s_lo, s_hi;
    block_signs16<T>(c, x, s_lo, s_hi);
    if (path == EncodePath::kSmall) {
      lo = e2m1x8_small(y0, s_lo);
      hi = e2m1x8_small(y1, s_hi);
    } else {
      lo = e2m1x8_finite(y0, s_lo);
      hi = e2m1x8_finite(y1, s_hi);
    }
  } else {
    lo = e2m1x8_any(y0);
    hi = e2m1x8_any(y1);
  }
  return stored;
}

// out_scale computed per block (kernels whose global scale changes from row to row).
template <bool UE8M0>
struct OutScaleDirect {
  float inv_gs;
  NVQ_HD float operator()(uint8_t b) const { return nvfp4_out_scale<UE8M0>(b, inv_gs); }
};

}  // namespace nvq
