// NVFP4 activation quantization: dense, grouped by expert (expert / blockscale offsets), masked
// with fused SiLU-and-mul; and plain SiLU-and-mul. Framework-free; host launchers in launch.h.
//
// One thread quantizes one 16-value block (32 bytes of bf16/fp16, 64 of fp32): its amax, scale and
// codes need no communication. Threads are tiled rows x block-columns (see Tile): a warp reads 32
// consecutive blocks of a row (1 KB), each thread walks down its column through the CTA's slice of
// rows with constant address steps. The grid fills the GPU once (or less for small problems), so
// every SM streams; small problems spread their rows over as many CTAs as they have.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernel_utils.cuh"
#include "launch.h"
#include "numerics.cuh"
#include "nvfp4_block.cuh"
#include "vec.cuh"

namespace nvq {
namespace {

template <typename T, bool UE8M0, class OutScaleOf>
__device__ __forceinline__ uint8_t quant_block_at(const T* __restrict__ p, uint8_t* __restrict__ q, float gs,
                                                  const OutScaleOf& out_scale_of) {
  uint4 c[kChunksPerBlock16<T>];
  load_block16<T>(p, c);
  uint32_t lo, hi;
  const uint8_t s = nvfp4_quant_block16<T, UE8M0>(c, gs, out_scale_of, lo, hi);
  st8(q, make_uint2(lo, hi));
  return s;
}

// out_scale as a function of the scale byte, tabulated once per CTA (one global scale).
struct OutScaleTable {
  const float* table;
  __device__ __forceinline__ float operator()(uint8_t b) const { return table[b]; }
};

// Column part and row part of the swizzled offset (their sum is swizzled_offset(row, col, kt)).
__device__ __forceinline__ uint32_t swz_col(uint32_t col) { return (col >> 2) * 512 + (col & 3); }
__device__ __forceinline__ uint32_t swz_row(uint32_t row, uint32_t kt) {
  return (row >> 7) * kt * 512 + (row & 31) * 16 + ((row >> 5) & 3) * 4;
}

// ------------------------------------------------------------------------------------------------
// Dense: rows [0, m_pad) x block columns [0, kb_pad); padding rows / columns write a zero scale.
// ------------------------------------------------------------------------------------------------
template <typename T, bool SWIZZLE, bool UE8M0>
__global__ void __launch_bounds__(kThreads) nvfp4_dense_kernel(const T* __restrict__ in, const float* __restrict__ gsp,
                                                               uint8_t* __restrict__ out, uint8_t* __restrict__ sf,
                                                               int32_t m, int32_t m_pad, int32_t k, int32_t kb,
                                                               int32_t kb_pad, Tile tile) {
  __shared__ float table[256];
  const float gs = __ldg(gsp);
  const float inv_gs = rcp_or_zero(gs);
  for (int b = threadIdx.x; b < 256; b += blockDim.x) table[b] = nvfp4_out_scale<UE8M0>(uint8_t(b), inv_gs);
  __syncthreads();

  const int32_t ty = int32_t(threadIdx.x) / tile.cols;
  const int32_t col = int32_t(blockIdx.x) * tile.cols + (int32_t(threadIdx.x) - ty * tile.cols);
  if (ty >= tile.rows || col >= kb_pad) return;  // the CTA has kThreads threads, the tile may use fewer
  const OutScaleTable os{table};
  const uint32_t kt = uint32_t(kb_pad) >> 2;
  const uint32_t colpart = swz_col(uint32_t(col));
  const Slice rs = row_slice(uint32_t(m_pad), uint32_t(tile.rows));
  const uint32_t r0 = rs.begin + ty;
  const uint32_t r_in = min(rs.end, uint32_t(m));  // rows with input
  const int64_t step_in = int64_t(tile.rows) * k, step_out = int64_t(tile.rows) * (k / 2);
  const T* p = in + int64_t(r0) * k + col * 16;
  uint8_t* q = out + int64_t(r0) * (k / 2) + col * 8;
  uint32_t r = r0;
  if (col < kb) {
    for (; r < r_in; r += tile.rows, p += step_in, q += step_out) {
      const uint8_t s = quant_block_at<T, UE8M0>(p, q, gs, os);
      if (SWIZZLE) {
        sf[swz_row(r, kt) + colpart] = s;
      } else {
        sf[int64_t(r) * kb + col] = s;
      }
    }
  }
  for (; r < rs.end; r += tile.rows) {  // padding rows and padding columns of the swizzled layout
    if (SWIZZLE) {
      sf[swz_row(r, kt) + colpart] = 0;
    } else {
      sf[int64_t(r) * kb + col] = 0;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Grouped by expert. Phase 1: rows [0, m) x block columns [0, kb); rows outside
// [expert_offsets[0], expert_offsets[E]) write zero codes. Phase 2 (all threads, 1D): zero every
// 16-byte chunk of the scale tensor that no expert row owns. Offsets live in shared memory; each
// thread caches the expert of its last row (its rows ascend).
// ------------------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kThreads)
    nvfp4_experts_kernel(const T* __restrict__ in, const float* __restrict__ gsp, const int32_t* __restrict__ eo_g,
                         const int32_t* __restrict__ bo_g, uint8_t* __restrict__ out, uint8_t* __restrict__ sf,
                         int32_t m, int32_t k, int32_t kb, int32_t kb_pad, int num_experts, int32_t sf_rows,
                         Tile tile, uint32_t chunks, FastDiv kt_div) {
  extern __shared__ int32_t smem[];
  int32_t* eo = smem;
  int32_t* bo = smem + num_experts + 1;
  stage_to_smem(eo, eo_g, num_experts + 1);
  stage_to_smem(bo, bo_g, num_experts + 1);
  __syncthreads();
  const int32_t first = eo[0], last = eo[num_experts];
  const uint32_t kt = uint32_t(kb_pad) >> 2;

  const int32_t ty = int32_t(threadIdx.x) / tile.cols;
  const int32_t col = int32_t(blockIdx.x) * tile.cols + (int32_t(threadIdx.x) - ty * tile.cols);
  if (ty < tile.rows && col < kb) {
    const Slice rs = row_slice(uint32_t(m), uint32_t(tile.rows));
    const uint32_t colpart = swz_col(uint32_t(col));
    const bool last_col = col == kb - 1;
    int32_t lo = 0, hi = 0, base = 0;  // cached expert: rows [lo, hi) -> scale rows base + (row - lo)
    float gs = 0.0f, inv_gs = 0.0f;
    for (uint32_t ur = rs.begin + ty; ur < rs.end; ur += tile.rows) {
      const int32_t row = int32_t(ur);
      uint8_t* q = out + int64_t(row) * (k / 2) + col * 8;
      if (row < first || row >= last) {
        st8(q, make_uint2(0, 0));
        continue;
      }
      if (row < lo || row >= hi) {
        const int e = find_segment(eo, num_experts, row);
        lo = eo[e];
        hi = eo[e + 1];
        base = bo[e];
        gs = __ldg(gsp + e);
        inv_gs = rcp_or_zero(gs);
      }
      const uint8_t s = quant_block_at<T, false>(in + int64_t(row) * k + col * 16, q, gs, OutScaleDirect<false>{inv_gs});
      const int32_t srow = base + (row - lo);
      if (srow >= 0 && srow < sf_rows) {
        uint8_t* p = sf + swz_row(uint32_t(srow), kt) + colpart;
        *p = s;
        if (last_col) {  // zero the padding columns of this row's last 4-column group
          for (int32_t c = kb; c < kb_pad; ++c) p[c - col] = 0;
        }
      }
    }
  }

  // Phase 2: scale bytes of rows that no expert row owns (per-expert padding rows, the tail).
  const Slice zs = cta_slice(chunks);
  for (uint32_t c = zs.begin + threadIdx.x; c < zs.end; c += blockDim.x) {
    zero_scale_chunk(sf, c, kt_div, [&](uint32_t r) {
      const int32_t row = int32_t(r);
      if (row < bo[0] || row >= bo[num_experts]) return false;
      const int e = find_segment(bo, num_experts, row);
      return row - bo[e] < eo[e + 1] - eo[e];
    });
  }
}

// ------------------------------------------------------------------------------------------------
// Masked layout, optionally fused with SiLU-and-mul. Valid rows are compacted with an in-kernel
// prefix sum over the mask, so the work (and the threads) split evenly over the valid rows of all
// experts whatever the mask, with no host synchronization. With zero_fill, phase 2 zeroes the code
// bytes of rows past the mask and phase 3 every scale byte that no valid row writes.
// ------------------------------------------------------------------------------------------------
template <typename T, bool SILU>
__device__ __forceinline__ void load_masked_block16(const T* __restrict__ p, int32_t k,
                                                    uint4 (&c)[kChunksPerBlock16<T>]) {
  if (!SILU) {
    load_block16<T>(p, c);
  } else {
    constexpr int kE = Chunk<T>::kElems;
    uint4 gc[kChunksPerBlock16<T>], uc[kChunksPerBlock16<T>];
    load_block16<T>(p, gc);
    load_block16<T>(p + k, uc);
#pragma unroll
    for (int i = 0; i < kChunksPerBlock16<T>; ++i) {
      float g[kE], up[kE], v[kE];
      chunk_to_float(gc[i], static_cast<const T*>(nullptr), g);
      chunk_to_float(uc[i], static_cast<const T*>(nullptr), up);
#pragma unroll
      for (int j = 0; j < kE; ++j) v[j] = silu_mul_fp32(g[j], up[j]);
      c[i] = float_to_chunk<T>(v);  // rounded to the activation dtype, as silu_and_mul stores it
    }
  }
}

template <typename T, bool SILU, bool ZERO_FILL>
__global__ void __launch_bounds__(kThreads)
    nvfp4_masked_kernel(const T* __restrict__ in, const float* __restrict__ gsp, const int32_t* __restrict__ mask,
                        uint8_t* __restrict__ out, uint8_t* __restrict__ sf, int num_experts, int32_t max_m,
                        int32_t m_pad, int32_t k, int32_t kb, int32_t kb_pad, Tile tile, FastDiv k16_div,
                        FastDiv kt_div, FastDiv expert_chunks_div) {
  extern __shared__ int32_t smem[];
  int32_t* prefix = smem;                       // [E + 1] valid rows before expert e
  int32_t* warp_sums = smem + num_experts + 1;  // [32]
  masked_prefix(mask, num_experts, max_m, prefix, warp_sums);
  const int32_t valid_rows = prefix[num_experts];
  const uint32_t kt = uint32_t(kb_pad) >> 2;
  const int64_t sf_expert = int64_t(m_pad) * kb_pad;
  const int64_t in_row = SILU ? 2 * int64_t(k) : int64_t(k);

  // Phase 1: valid blocks, rows taken in compacted order v -> (expert, r).
  const int32_t ty = int32_t(threadIdx.x) / tile.cols;
  const int32_t col = int32_t(blockIdx.x) * tile.cols + (int32_t(threadIdx.x) - ty * tile.cols);
  if (ty < tile.rows && col < kb) {
    const Slice rs = row_slice(uint32_t(valid_rows), uint32_t(tile.rows));
    const uint32_t colpart = swz_col(uint32_t(col));
    const bool last_col = col == kb - 1;
    int32_t lo = 0, hi = 0, ex = 0;
    float gs = 0.0f, inv_gs = 0.0f;
    for (uint32_t uv = rs.begin + ty; uv < rs.end; uv += tile.rows) {
      const int32_t v = int32_t(uv);
      if (v < lo || v >= hi) {
        ex = find_segment(prefix, num_experts, v);
        lo = prefix[ex];
        hi = prefix[ex + 1];
        gs = __ldg(gsp + ex);
        inv_gs = rcp_or_zero(gs);
      }
      const int32_t r = v - lo;
      const int64_t row = int64_t(ex) * max_m + r;
      uint4 c[kChunksPerBlock16<T>];
      load_masked_block16<T, SILU>(in + row * in_row + col * 16, k, c);
      uint32_t qlo, qhi;
      const uint8_t s = nvfp4_quant_block16<T, false>(c, gs, OutScaleDirect<false>{inv_gs}, qlo, qhi);
      st8(out + row * (k / 2) + col * 8, make_uint2(qlo, qhi));
      uint8_t* p = sf + ex * sf_expert + swz_row(uint32_t(r), kt) + colpart;
      *p = s;
      if (ZERO_FILL && last_col) {
        for (int32_t cc = kb; cc < kb_pad; ++cc) p[cc - col] = 0;
      }
    }
  }
  if (!ZERO_FILL) return;

  // Phase 2: code bytes of rows past the mask, 8 bytes per unit. The invalid rows before expert e,
  // e * max_m - prefix[e], are non-decreasing in e, so a segment search finds a row's expert.
  const uint32_t k16 = uint32_t(k) / 16;
  const uint32_t invalid_rows = uint32_t(num_experts) * uint32_t(max_m) - uint32_t(valid_rows);
  const Slice zs = cta_slice(invalid_rows * k16);
  int32_t lo = 0, hi = 0, ex = 0;
  for (uint32_t u = zs.begin + threadIdx.x; u < zs.end; u += blockDim.x) {
    const int32_t v = int32_t(fdiv(k16_div, u));
    const int32_t w = int32_t(u) - v * int32_t(k16);
    if (v < lo || v >= hi) {
      int a = 0, b = num_experts;  // largest e with e * max_m - prefix[e] <= v
      while (b - a > 1) {
        const int mid = (a + b) >> 1;
        if (mid * max_m - prefix[mid] <= v) {
          a = mid;
        } else {
          b = mid;
        }
      }
      ex = a;
      lo = ex * max_m - prefix[ex];
      hi = (ex + 1) * max_m - prefix[ex + 1];
    }
    const int32_t r = (prefix[ex + 1] - prefix[ex]) + (v - lo);
    st8(out + (int64_t(ex) * max_m + r) * (k / 2) + int64_t(w) * 8, make_uint2(0, 0));
  }

  // Phase 3: scale bytes of rows past the mask (padding rows included), per expert region.
  const uint32_t per_expert = uint32_t(sf_expert / 16);
  const Slice cs = cta_slice(per_expert * uint32_t(num_experts));
  for (uint32_t c = cs.begin + threadIdx.x; c < cs.end; c += blockDim.x) {
    const int32_t e = int32_t(fdiv(expert_chunks_div, c));
    const int32_t rows_e = prefix[e + 1] - prefix[e];
    zero_scale_chunk(sf + e * sf_expert, c - uint32_t(e) * per_expert, kt_div,
                     [&](uint32_t r) { return int32_t(r) < rows_e; });
  }
}

// ------------------------------------------------------------------------------------------------
// SiLU-and-mul alone: one unit per 16-byte chunk of the output.
// ------------------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kThreads) silu_and_mul_kernel(const T* __restrict__ in, T* __restrict__ out,
                                                                int32_t inner, uint32_t units, FastDiv chunks_div) {
  constexpr int kE = Chunk<T>::kElems;
  const Slice sl = cta_slice(units);
  for (uint32_t u = sl.begin + threadIdx.x; u < sl.end; u += blockDim.x) {
    const int32_t row = int32_t(fdiv(chunks_div, u));
    const int32_t c = int32_t(u) - row * (inner / kE);
    const T* p = in + int64_t(row) * 2 * inner + int64_t(c) * kE;
    float g[kE], up[kE], v[kE];
    chunk_to_float(ld_nc16(p), static_cast<const T*>(nullptr), g);
    chunk_to_float(ld_nc16(p + inner), static_cast<const T*>(nullptr), up);
#pragma unroll
    for (int j = 0; j < kE; ++j) v[j] = silu_mul_fp32(g[j], up[j]);
    st16(out + int64_t(row) * inner + int64_t(c) * kE, float_to_chunk<T>(v));
  }
}

// ------------------------------------------------------------------------------------------------
// Launchers
// ------------------------------------------------------------------------------------------------
constexpr uint64_t kMaxUnits = (uint64_t(1) << 31) - 1;

template <typename T, bool SWIZZLE, bool UE8M0>
cudaError_t launch_dense(const void* input, const float* gs, uint8_t* out, uint8_t* sf, int64_t m, int64_t k,
                         int num_sms, cudaStream_t stream) {
  const int32_t kb = int32_t(k / 16);
  const int32_t kb_pad = SWIZZLE ? (kb + 3) / 4 * 4 : kb;
  const int64_t m_pad = SWIZZLE ? (m + 127) / 128 * 128 : m;
  if (uint64_t(m_pad) * uint64_t(kb_pad) > kMaxUnits) return cudaErrorInvalidValue;
  auto kernel = nvfp4_dense_kernel<T, SWIZZLE, UE8M0>;
  static const int per_sm = resident_ctas(kernel);
  const Tile tile = make_tile(kb_pad);
  const dim3 grid = tile_grid(tile, kb_pad, uint64_t(m_pad), 0, num_sms, per_sm);
  kernel<<<grid, tile_threads(tile), 0, stream>>>(static_cast<const T*>(input), gs, out, sf, int32_t(m),
                                                      int32_t(m_pad), int32_t(k), kb, kb_pad, tile);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_dense_dispatch(const void* input, const float* gs, uint8_t* out, uint8_t* sf, int64_t m,
                                  int64_t k, bool swizzle, bool ue8m0, int num_sms, cudaStream_t stream) {
  if (swizzle) {
    return ue8m0 ? launch_dense<T, true, true>(input, gs, out, sf, m, k, num_sms, stream)
                 : launch_dense<T, true, false>(input, gs, out, sf, m, k, num_sms, stream);
  }
  return ue8m0 ? launch_dense<T, false, true>(input, gs, out, sf, m, k, num_sms, stream)
               : launch_dense<T, false, false>(input, gs, out, sf, m, k, num_sms, stream);
}

template <typename T>
cudaError_t launch_experts(const void* input, const float* gs, const int32_t* eo, const int32_t* bo, uint8_t* out,
                           uint8_t* sf, int64_t m, int64_t k, int num_experts, int64_t sf_rows, int num_sms,
                           cudaStream_t stream) {
  const int32_t kb = int32_t(k / 16);
  const int32_t kb_pad = (kb + 3) / 4 * 4;
  const uint64_t chunks = uint64_t(sf_rows) * uint64_t(kb_pad) / 16;
  if (uint64_t(m) * uint64_t(kb) > kMaxUnits || chunks > kMaxUnits || sf_rows % 128 != 0) {
    return cudaErrorInvalidValue;
  }
  const size_t smem = size_t(2) * (num_experts + 1) * sizeof(int32_t);
  auto kernel = nvfp4_experts_kernel<T>;
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) return err;
  }
  static const int per_sm = resident_ctas(kernel, 2048 * sizeof(int32_t));
  const Tile tile = make_tile(kb);
  const dim3 grid = tile_grid(tile, kb, uint64_t(m), chunks, num_sms, per_sm);
  kernel<<<grid, tile_threads(tile), smem, stream>>>(static_cast<const T*>(input), gs, eo, bo, out, sf,
                                                         int32_t(m), int32_t(k), kb, kb_pad, num_experts,
                                                         int32_t(sf_rows), tile, uint32_t(chunks),
                                                         make_fastdiv(uint32_t(kb_pad / 4)));
  return cudaGetLastError();
}

template <typename T, bool SILU, bool ZERO_FILL>
cudaError_t launch_masked(const void* input, const float* gs, const int32_t* mask, uint8_t* out, uint8_t* sf,
                          int num_experts, int64_t max_m, int64_t k, int num_sms, cudaStream_t stream) {
  const int32_t kb = int32_t(k / 16);
  const int32_t kb_pad = (kb + 3) / 4 * 4;
  const int64_t m_pad = (max_m + 127) / 128 * 128;
  const uint64_t all_rows = uint64_t(num_experts) * uint64_t(max_m);
  const uint64_t chunks = uint64_t(num_experts) * uint64_t(m_pad) * uint64_t(kb_pad) / 16;
  if (all_rows * uint64_t(kb) > kMaxUnits || chunks > kMaxUnits) return cudaErrorInvalidValue;
  const size_t smem = size_t(num_experts + 1 + 32) * sizeof(int32_t);
  auto kernel = nvfp4_masked_kernel<T, SILU, ZERO_FILL>;
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) return err;
  }
  static const int per_sm = resident_ctas(kernel, 2048 * sizeof(int32_t));
  const Tile tile = make_tile(kb);
  // Sized for the whole [E, max_m] space: the mask is not known on the host.
  const uint64_t extra = ZERO_FILL ? (chunks > all_rows * (k / 16) ? chunks : all_rows * (k / 16)) : 0;
  const dim3 grid = tile_grid(tile, kb, all_rows, extra, num_sms, per_sm);
  kernel<<<grid, tile_threads(tile), smem, stream>>>(
      static_cast<const T*>(input), gs, mask, out, sf, num_experts, int32_t(max_m), int32_t(m_pad), int32_t(k), kb,
      kb_pad, tile, make_fastdiv(uint32_t(k / 16)), make_fastdiv(uint32_t(kb_pad / 4)),
      make_fastdiv(uint32_t(uint64_t(m_pad) * uint64_t(kb_pad) / 16)));
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_masked_dispatch(const void* input, const float* gs, const int32_t* mask, uint8_t* out,
                                   uint8_t* sf, int num_experts, int64_t max_m, int64_t k, bool silu, bool zero_fill,
                                   int num_sms, cudaStream_t stream) {
  if (silu) {
    return zero_fill ? launch_masked<T, true, true>(input, gs, mask, out, sf, num_experts, max_m, k, num_sms, stream)
                     : launch_masked<T, true, false>(input, gs, mask, out, sf, num_experts, max_m, k, num_sms, stream);
  }
  return zero_fill ? launch_masked<T, false, true>(input, gs, mask, out, sf, num_experts, max_m, k, num_sms, stream)
                   : launch_masked<T, false, false>(input, gs, mask, out, sf, num_experts, max_m, k, num_sms, stream);
}

template <typename T>
cudaError_t launch_silu(const void* input, void* out, int64_t rows, int64_t inner, int num_sms, cudaStream_t stream) {
  constexpr int kE = Chunk<T>::kElems;
  const uint64_t units = uint64_t(rows) * uint64_t(inner / kE);
  if (units > kMaxUnits || inner % kE != 0) return cudaErrorInvalidValue;
  auto kernel = silu_and_mul_kernel<T>;
  static const int per_sm = resident_ctas(kernel);
  kernel<<<grid_for(units, num_sms, per_sm), kThreads, 0, stream>>>(
      static_cast<const T*>(input), static_cast<T*>(out), int32_t(inner), uint32_t(units),
      make_fastdiv(uint32_t(inner / kE)));
  return cudaGetLastError();
}

}  // namespace

cudaError_t nvfp4_quant(ActDType dt, const void* input, const float* global_scale, uint8_t* out, uint8_t* scales,
                        int64_t m, int64_t k, bool swizzle, bool ue8m0, int num_sms, cudaStream_t stream) {
  if (k % 16 != 0 || m < 0 || k < 0) return cudaErrorInvalidValue;
  if (m == 0 || k == 0) return cudaSuccess;
  NVQ_DISPATCH_ACT(dt, T,
                   launch_dense_dispatch<T>(input, global_scale, out, scales, m, k, swizzle, ue8m0, num_sms, stream));
}

cudaError_t nvfp4_quant_experts(ActDType dt, const void* input, const float* global_scale,
                                const int32_t* expert_offsets, const int32_t* blockscale_offsets, uint8_t* out,
                                uint8_t* scales, int64_t m, int64_t k, int num_experts, int64_t scale_rows,
                                int num_sms, cudaStream_t stream) {
  if (k % 16 != 0 || m < 0 || k < 0 || num_experts < 1 || num_experts > kMaxExperts) return cudaErrorInvalidValue;
  if (m == 0 || k == 0) return cudaSuccess;
  NVQ_DISPATCH_ACT(dt, T,
                   launch_experts<T>(input, global_scale, expert_offsets, blockscale_offsets, out, scales, m, k,
                                     num_experts, scale_rows, num_sms, stream));
}

cudaError_t nvfp4_quant_masked(ActDType dt, const void* input, const float* global_scale, const int32_t* mask,
                               uint8_t* out, uint8_t* scales, int num_experts, int64_t max_m, int64_t k,
                               bool silu, bool zero_fill, int num_sms, cudaStream_t stream) {
  if (k % 16 != 0 || max_m < 0 || k < 0 || num_experts < 1 || num_experts > kMaxExperts) {
    return cudaErrorInvalidValue;
  }
  if (max_m == 0 || k == 0) return cudaSuccess;
  NVQ_DISPATCH_ACT(dt, T,
                   launch_masked_dispatch<T>(input, global_scale, mask, out, scales, num_experts, max_m, k, silu,
                                             zero_fill, num_sms, stream));
}

cudaError_t silu_and_mul(ActDType dt, const void* input, void* out, int64_t rows, int64_t inner, int num_sms,
                         cudaStream_t stream) {
  if (rows < 0 || inner < 0) return cudaErrorInvalidValue;
  if (rows == 0 || inner == 0) return cudaSuccess;
  NVQ_DISPATCH_ACT(dt, T, launch_silu<T>(input, out, rows, inner, num_sms, stream));
}

}  // namespace nvq
