// FP8 E4M3 activation quantizers (numerics.py, "FP8 E4M3 activation quantizers"): per-tensor static
// and dynamic, per-token, per-token-group. Framework-free; host launchers in launch.h.
//
// Conversions use the hardware F2FP instruction through __nv_cvt_float2_to_fp8x2 (two values per
// instruction), never c10::Float8_e4m3fn (a software routine, seed file 003). Scales that need a
// division use nvq::div_rn (correctly rounded, no subroutine call).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernel_utils.cuh"
#include "launch.h"
#include "numerics.cuh"
#include "vec.cuh"

namespace nvq {
namespace {

// kE values of one chunk times `mult` -> kE e4m3 bytes (kE = 8: 8 bytes, kE = 4: 4 bytes).
template <int kE>
__device__ __forceinline__ void quant_chunk(const float* x, float mult, uint32_t* q) {
#pragma unroll
  for (int i = 0; i < kE / 4; ++i) {
    const uint32_t lo = e4m3x2_satfinite(mul_rn(x[4 * i], mult), mul_rn(x[4 * i + 1], mult));
    const uint32_t hi = e4m3x2_satfinite(mul_rn(x[4 * i + 2], mult), mul_rn(x[4 * i + 3], mult));
    q[i] = lo | (hi << 16);
  }
}

template <int kE>
__device__ __forceinline__ void store_q(uint8_t* p, const uint32_t* q) {
  if (kE == 8) {
    st8(p, make_uint2(q[0], q[1]));
  } else {
    *reinterpret_cast<uint32_t*>(p) = q[0];
  }
}

// fmaxf over aligned groups of `width` lanes (a power of two <= 32); only those lanes take part.
__device__ __forceinline__ float group_max(float v, int width) {
  const uint32_t lane = threadIdx.x & 31;
  const uint32_t mask = width == 32 ? 0xFFFFFFFFu : ((1u << width) - 1) << (lane & ~uint32_t(width - 1));
  for (int o = width >> 1; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(mask, v, o, width));
  return v;
}

__device__ __forceinline__ float warp_max(float v) { return group_max(v, 32); }

// The scale of `group` (row-major index over [m, groups_per_row]) into its layout; the last row's
// writer also fills the storage padding (column-major rows m..scale_stride-1, unused UE8M0 bytes).
template <GroupScaleLayout LAYOUT>
__device__ __forceinline__ void store_group_scale(void* scales, uint32_t bits, uint32_t group, int32_t m,
                                                  int32_t groups_per_row, int32_t scale_stride, FastDiv gpr_div) {
  if (LAYOUT == GroupScaleLayout::kRowMajorF32) {
    static_cast<float*>(scales)[group] = u2f(bits);
    return;
  }
  const int32_t row = int32_t(fdiv(gpr_div, group));
  const int32_t g = int32_t(group) - row * groups_per_row;
  if (LAYOUT == GroupScaleLayout::kColMajorF32) {
    float* s = static_cast<float*>(scales);
    s[int64_t(g) * scale_stride + row] = u2f(bits);
    if (row == m - 1) {  // storage padding rows
      for (int32_t r = m; r < scale_stride; ++r) s[int64_t(g) * scale_stride + r] = 0.0f;
    }
  } else {
    uint8_t* s = static_cast<uint8_t*>(scales);
    const int64_t word = int64_t(g >> 2) * scale_stride;
    s[(word + row) * 4 + (g & 3)] = uint8_t(bits);
    const int32_t g_end = g == groups_per_row - 1 ? ((g >> 2) + 1) * 4 : g + 1;  // unused bytes of the word
    for (int32_t gg = g + 1; gg < g_end; ++gg) s[(word + row) * 4 + (gg & 3)] = 0;
    if (row == m - 1) {
      for (int32_t r = m; r < scale_stride; ++r) {
        for (int32_t gg = g; gg < g_end; ++gg) s[(word + r) * 4 + (gg & 3)] = 0;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Per-token-group: one thread per unit of 16 consecutive values (one 16-byte store of codes); tpg =
// group_size / 16 consecutive lanes share a group, whose amax is a shuffle reduction over them.
// One unit per thread in small CTAs (kGroupThreads): more units per thread or 256-thread CTAs measured
// slower on the H200 (csrc/quant/PERF_NOTES.md, "Bytes in flight"). kTpg = 8 is
// group 128 with an unrolled reduction; 0 takes tpg from tpg_log2.
// ------------------------------------------------------------------------------------------------
constexpr int kGroupThreads = 128;

template <int kTpg>
__device__ __forceinline__ float group_amax(float v, int32_t tpg_log2) {
  if constexpr (kTpg > 0) {
    static_assert(kTpg < 32, "a group's lanes, not the whole warp: the last warp may be partial");
    const uint32_t mask = ((1u << kTpg) - 1) << ((threadIdx.x & 31) & ~uint32_t(kTpg - 1));
#pragma unroll
    for (int o = kTpg >> 1; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(mask, v, o, kTpg));
    return v;
  } else {
    return group_max(v, 1 << tpg_log2);
  }
}

template <typename T, GroupScaleLayout LAYOUT, int kTpg>
__global__ void __launch_bounds__(kGroupThreads)
    fp8_group_kernel(const T* __restrict__ in, uint8_t* __restrict__ out, void* __restrict__ scales, int32_t m,
                     int32_t groups_per_row, int32_t tpg_log2, float eps, int32_t scale_stride, uint32_t units,
                     FastDiv gpr_div) {
  pdl_enter();
  constexpr int kE = Chunk<T>::kElems;
  constexpr int kNC = 16 / kE;
  const uint32_t t = blockIdx.x * uint32_t(kGroupThreads) + threadIdx.x;
  if (t >= units) return;  // units is a multiple of tpg: the lanes of a group agree
  uint4 raw[kNC];
#pragma unroll
  for (int j = 0; j < kNC; ++j) raw[j] = ld_nc16(in + int64_t(t) * 16 + j * kE);
  float x[16];
#pragma unroll
  for (int j = 0; j < kNC; ++j) chunk_to_float(raw[j], static_cast<const T*>(nullptr), x + j * kE);
  float a[8];  // a max tree (depth 4, not a chain of 16): the same NaN-ignoring amax, shorter latency
#pragma unroll
  for (int i = 0; i < 8; ++i) a[i] = fmaxf(fabsf(x[2 * i]), fabsf(x[2 * i + 1]));
#pragma unroll
  for (int w = 4; w > 0; w >>= 1) {
#pragma unroll
    for (int i = 0; i < w; ++i) a[i] = fmaxf(a[i], a[i + w]);
  }
  const float amax = inf_as_max(group_amax<kTpg>(fmaxf(0.0f, a[0]), tpg_log2));
  const GroupScale gsc = fp8_group_scale<LAYOUT == GroupScaleLayout::kColMajorUE8M0>(amax, eps);
  uint32_t w[4];
  quant_chunk<16>(x, gsc.mult, w);
  st16(out + int64_t(t) * 16, make_uint4(w[0], w[1], w[2], w[3]));
  if ((t & ((1u << tpg_log2) - 1)) == 0) {
    store_group_scale<LAYOUT>(scales, gsc.bits, t >> tpg_log2, m, groups_per_row, scale_stride, gpr_div);
  }
}

// ------------------------------------------------------------------------------------------------
// Per-token: a row group of `tpr` threads (a warp, or several warps of one CTA) holds its row in
// registers (up to kMaxChunks 16-byte chunks per thread), reduces the amax, then quantizes. Rows
// too long for the registers are re-read (second pass from L2).
// ------------------------------------------------------------------------------------------------
constexpr int kMaxChunks = 8;

template <typename T>
__global__ void __launch_bounds__(1024)
    fp8_token_kernel(const T* __restrict__ in, uint8_t* __restrict__ out, float* __restrict__ scales, int32_t m,
                     int32_t k, int32_t tpr) {
  pdl_enter();
  constexpr int kE = Chunk<T>::kElems;
  __shared__ float partial[32];
  const int32_t rows_per_cta = int32_t(blockDim.x) / tpr;
  const int32_t local_row = int32_t(threadIdx.x) / tpr;
  const int32_t lane = int32_t(threadIdx.x) - local_row * tpr;
  const int32_t row = int32_t(blockIdx.x) * rows_per_cta + local_row;
  const bool active = row < m;
  const int32_t chunks = k / kE;
  const T* p = in + int64_t(active ? row : 0) * k;

  uint4 raw[kMaxChunks];  // the row stays in registers as raw chunks (widened twice, cheap)
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxChunks; ++j) {
    const int32_t c = j * tpr + lane;
    raw[j] = make_uint4(0, 0, 0, 0);
    if (active && c < chunks) raw[j] = ld_nc16(p + int64_t(c) * kE);
  }
#pragma unroll
  for (int j = 0; j < kMaxChunks; ++j) {
    float x[kE];
    chunk_to_float(raw[j], static_cast<const T*>(nullptr), x);
#pragma unroll
    for (int i = 0; i < kE; ++i) amax = fmaxf(amax, fabsf(x[i]));
  }
  for (int32_t c = kMaxChunks * tpr + lane; active && c < chunks; c += tpr) {  // very long rows
    float y[kE];
    chunk_to_float(ld_nc16(p + int64_t(c) * kE), static_cast<const T*>(nullptr), y);
#pragma unroll
    for (int i = 0; i < kE; ++i) amax = fmaxf(amax, fabsf(y[i]));
  }
  amax = warp_max(amax);
  if (tpr > 32) {  // several warps per row: combine this row's warps
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = amax;
    __syncthreads();
    const int wpr = tpr >> 5, w0 = local_row * wpr;
    amax = 0.0f;
    for (int w = w0; w < w0 + wpr; ++w) amax = fmaxf(amax, partial[w]);
  }
  if (!active) return;
  const float s = div_rn(inf_as_max(amax), kE4M3Max);
  const float inv = rcp_or_zero(s);
  if (lane == 0) scales[row] = s;
  uint8_t* q = out + int64_t(row) * k;
#pragma unroll
  for (int j = 0; j < kMaxChunks; ++j) {
    const int32_t c = j * tpr + lane;
    if (c < chunks) {
      float x[kE];
      uint32_t w[kE / 4];
      chunk_to_float(raw[j], static_cast<const T*>(nullptr), x);
      quant_chunk<kE>(x, inv, w);
      store_q<kE>(q + int64_t(c) * kE, w);
    }
  }
  for (int32_t c = kMaxChunks * tpr + lane; c < chunks; c += tpr) {
    float y[kE];
    uint32_t w[kE / 4];
    chunk_to_float(ld_nc16(p + int64_t(c) * kE), static_cast<const T*>(nullptr), y);
    quant_chunk<kE>(y, inv, w);
    store_q<kE>(q + int64_t(c) * kE, w);
  }
}

// ------------------------------------------------------------------------------------------------
// Per-tensor. Elementwise over 16-byte chunks, with a scalar tail for numel % kE.
// ------------------------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ float load_scalar(const T* p) {
  if constexpr (std::is_same<T, float>::value) {
    return __ldg(p);
  } else {
    const uint32_t bits = *reinterpret_cast<const unsigned short*>(p);
    return std::is_same<T, __half>::value ? half_bits_to_float(bits) : u2f(bits << 16);
  }
}

template <typename T>
__device__ __forceinline__ void quant_range(const T* __restrict__ in, uint8_t* __restrict__ out, int64_t numel,
                                            float inv, uint32_t first, uint32_t stride) {
  constexpr int kE = Chunk<T>::kElems;
  const uint32_t chunks = uint32_t(numel / kE);
  for (uint32_t c = first; c < chunks; c += stride) {
    float x[kE];
    uint32_t q[kE / 4];
    chunk_to_float(ld_nc16(in + int64_t(c) * kE), static_cast<const T*>(nullptr), x);
    quant_chunk<kE>(x, inv, q);
    store_q<kE>(out + int64_t(c) * kE, q);
  }
  const int64_t tail = int64_t(chunks) * kE + first;
  if (first < uint32_t(kE) && tail < numel) {
    out[tail] = e4m3_satfinite(mul_rn(load_scalar(in + tail), inv));
  }
}

template <typename T>
__device__ __forceinline__ float amax_range(const T* __restrict__ in, int64_t numel, uint32_t first,
                                            uint32_t stride) {
  constexpr int kE = Chunk<T>::kElems;
  const uint32_t chunks = uint32_t(numel / kE);
  float amax = 0.0f;
  for (uint32_t c = first; c < chunks; c += stride) {
    float x[kE];
    chunk_to_float(ld_nc16(in + int64_t(c) * kE), static_cast<const T*>(nullptr), x);
#pragma unroll
    for (int i = 0; i < kE; ++i) amax = fmaxf(amax, fabsf(x[i]));
  }
  const int64_t tail = int64_t(chunks) * kE + first;
  if (first < uint32_t(kE) && tail < numel) amax = fmaxf(amax, fabsf(load_scalar(in + tail)));
  return amax;
}

__device__ __forceinline__ float block_max(float v, float* partial) {
  v = warp_max(v);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = 0.0f;
  for (int w = 0; w < int(blockDim.x >> 5); ++w) r = fmaxf(r, partial[w]);
  __syncthreads();
  return r;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) fp8_static_kernel(const T* __restrict__ in, const float* __restrict__ scale,
                                                              uint8_t* __restrict__ out, int64_t numel) {
  pdl_enter();
  const float inv = rcp_or_zero(__ldg(scale));
  quant_range<T>(in, out, numel, inv, blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x);
}

// Small tensors: one CTA computes the amax, the scale and the codes (second read hits L1/L2).
template <typename T>
__global__ void __launch_bounds__(1024) fp8_dynamic_fused_kernel(const T* __restrict__ in, float* __restrict__ scale,
                                                                 uint8_t* __restrict__ out, int64_t numel) {
  pdl_enter();
  __shared__ float partial[32];
  const float amax = block_max(amax_range<T>(in, numel, threadIdx.x, blockDim.x), partial);
  const float s = div_rn(inf_as_max(amax), kE4M3Max);
  if (threadIdx.x == 0) scale[0] = s;
  quant_range<T>(in, out, numel, rcp_or_zero(s), threadIdx.x, blockDim.x);
}

// Large tensors, pass 1: per-CTA amax / 448 folded into scale[0] with an integer atomicMax (the
// values are non-negative, so their bit patterns order like the floats; division by 448 is
// monotonic, so the max of the quotients is the quotient of the max). scale[0] starts at 0.
template <typename T>
__global__ void __launch_bounds__(kThreads) fp8_amax_kernel(const T* __restrict__ in, float* __restrict__ scale,
                                                            int64_t numel) {
  pdl_enter();
  __shared__ float partial[32];
  const float amax =
      block_max(amax_range<T>(in, numel, blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x), partial);
  if (threadIdx.x == 0) {
    atomicMax(reinterpret_cast<int*>(scale), int(f2u(div_rn(inf_as_max(amax), kE4M3Max))));
  }
}

// ------------------------------------------------------------------------------------------------
// Launchers
// ------------------------------------------------------------------------------------------------
constexpr uint64_t kMaxUnits = (uint64_t(1) << 31) - 1;

template <typename T, GroupScaleLayout L>
cudaError_t launch_group(const void* input, void* scales, uint8_t* out, int64_t m, int64_t k, int group_size,
                         float eps, int64_t scale_stride, cudaStream_t stream) {
  const uint64_t units = uint64_t(m) * uint64_t(k) / 16;
  if (units > kMaxUnits) return cudaErrorInvalidValue;
  int tpg_log2 = 0;
  while ((16 << tpg_log2) < group_size) ++tpg_log2;
  auto kernel = group_size == 128 ? fp8_group_kernel<T, L, 8> : fp8_group_kernel<T, L, 0>;
  return launch_kernel(kernel, unsigned((units + kGroupThreads - 1) / kGroupThreads), kGroupThreads, 0, stream, true,
                       static_cast<const T*>(input), out, scales, int32_t(m), int32_t(k / group_size), tpg_log2, eps,
                       int32_t(scale_stride), uint32_t(units), make_fastdiv(uint32_t(k / group_size)));
}

template <typename T>
cudaError_t launch_group_dispatch(const void* input, void* scales, uint8_t* out, int64_t m, int64_t k, int group_size,
                                  float eps, GroupScaleLayout layout, int64_t scale_stride, cudaStream_t stream) {
  switch (layout) {
    case GroupScaleLayout::kRowMajorF32:
      return launch_group<T, GroupScaleLayout::kRowMajorF32>(input, scales, out, m, k, group_size, eps, scale_stride,
                                                              stream);
    case GroupScaleLayout::kColMajorF32:
      return launch_group<T, GroupScaleLayout::kColMajorF32>(input, scales, out, m, k, group_size, eps, scale_stride,
                                                              stream);
    case GroupScaleLayout::kColMajorUE8M0:
      return launch_group<T, GroupScaleLayout::kColMajorUE8M0>(input, scales, out, m, k, group_size, eps,
                                                                scale_stride, stream);
  }
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t launch_token(const void* input, float* scales, uint8_t* out, int64_t m, int64_t k, cudaStream_t stream) {
  constexpr int kE = Chunk<T>::kElems;
  if (k % kE != 0 || m > INT32_MAX || k > INT32_MAX) return cudaErrorInvalidValue;
  const int64_t chunks = k / kE;
  // threads per row: enough for the row to fit kMaxChunks chunks per thread, a warp at least
  int64_t tpr = 32;
  while (tpr < 1024 && tpr * kMaxChunks < chunks) tpr *= 2;
  const int block = tpr >= kThreads ? int(tpr) : kThreads;
  const int64_t rows_per_cta = block / tpr;
  const int64_t grid = (m + rows_per_cta - 1) / rows_per_cta;
  if (grid > INT32_MAX) return cudaErrorInvalidValue;
  return launch_kernel(fp8_token_kernel<T>, unsigned(grid), block, 0, stream, true, static_cast<const T*>(input), out,
                       scales, int32_t(m), int32_t(k), int32_t(tpr));
}

template <typename T>
cudaError_t launch_static(const void* input, const float* scale, uint8_t* out, int64_t numel, int num_sms,
                          cudaStream_t stream, bool pdl = true) {
  constexpr int kE = Chunk<T>::kElems;
  if (uint64_t(numel / kE) > kMaxUnits) return cudaErrorInvalidValue;
  auto kernel = fp8_static_kernel<T>;
  static const int per_sm = resident_ctas(kernel);
  return launch_kernel(kernel, grid_for(uint64_t(numel / kE) + 1, num_sms, per_sm), kThreads, 0, stream, pdl,
                       static_cast<const T*>(input), scale, out, numel);
}

constexpr int64_t kFusedDynamicMax = 1 << 16;  // elements handled by the single-CTA dynamic kernel

template <typename T>
cudaError_t launch_dynamic(const void* input, float* scale, uint8_t* out, int64_t numel, int num_sms,
                           cudaStream_t stream) {
  constexpr int kE = Chunk<T>::kElems;
  if (uint64_t(numel / kE) > kMaxUnits) return cudaErrorInvalidValue;
  const T* in = static_cast<const T*>(input);
  if (numel <= kFusedDynamicMax) {
    return launch_kernel(fp8_dynamic_fused_kernel<T>, 1, 1024, 0, stream, true, in, scale, out, numel);
  }
  cudaError_t err = cudaMemsetAsync(scale, 0, sizeof(float), stream);
  if (err != cudaSuccess) return err;
  auto amax_kernel = fp8_amax_kernel<T>;
  static const int per_sm_a = resident_ctas(amax_kernel);
  // Plain stream order for both passes: the amax follows the memset (PDL orders kernel after kernel), and an
  // early quant pass measured slower (PERF_NOTES.md, "Programmatic dependent launch").
  err = launch_kernel(amax_kernel, grid_for(uint64_t(numel / kE) + 1, num_sms, per_sm_a), kThreads, 0, stream, false,
                      in, scale, numel);
  if (err != cudaSuccess) return err;
  return launch_static<T>(input, scale, out, numel, num_sms, stream, false);
}

}  // namespace

cudaError_t fp8_quant_static(ActDType dt, const void* input, const float* scale, uint8_t* out, int64_t numel,
                             int num_sms, cudaStream_t stream) {
  if (numel < 0) return cudaErrorInvalidValue;
  if (numel == 0) return cudaSuccess;
  NVQ_DISPATCH_ACT(dt, T, launch_static<T>(input, scale, out, numel, num_sms, stream));
}

cudaError_t fp8_quant_dynamic(ActDType dt, const void* input, float* scale, uint8_t* out, int64_t numel, int num_sms,
                              cudaStream_t stream) {
  if (numel < 0) return cudaErrorInvalidValue;
  if (numel == 0) return cudaMemsetAsync(scale, 0, sizeof(float), stream);
  NVQ_DISPATCH_ACT(dt, T, launch_dynamic<T>(input, scale, out, numel, num_sms, stream));
}

cudaError_t fp8_quant_per_token(ActDType dt, const void* input, float* scale, uint8_t* out, int64_t m, int64_t k,
                                int num_sms, cudaStream_t stream) {
  (void)num_sms;
  if (m < 0 || k < 0) return cudaErrorInvalidValue;
  if (m == 0) return cudaSuccess;
  if (k == 0) return cudaMemsetAsync(scale, 0, sizeof(float) * size_t(m), stream);
  NVQ_DISPATCH_ACT(dt, T, launch_token<T>(input, scale, out, m, k, stream));
}

cudaError_t fp8_quant_per_token_group(ActDType dt, const void* input, void* scales, uint8_t* out, int64_t m,
                                      int64_t k, int group_size, float eps, GroupScaleLayout layout,
                                      int64_t scale_stride, int num_sms, cudaStream_t stream) {
  (void)num_sms;  // one unit per thread: the grid follows the work
  const bool pow2 = group_size >= 16 && group_size <= 512 && (group_size & (group_size - 1)) == 0;
  if (!pow2 || m < 0 || k < 0 || k % group_size != 0) return cudaErrorInvalidValue;
  if (m == 0 || k == 0) return cudaSuccess;
  NVQ_DISPATCH_ACT(dt, T,
                   launch_group_dispatch<T>(input, scales, out, m, k, group_size, eps, layout, scale_stride, stream));
}

}  // namespace nvq
