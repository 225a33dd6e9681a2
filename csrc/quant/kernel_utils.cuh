// Work distribution and layout helpers shared by the quantization kernels (device side).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "launch.h"
#include "numerics.cuh"
#include "nvfp4_block.cuh"
#include "vec.cuh"

namespace nvq {

constexpr int kThreads = 256;  // threads per CTA of every quantization kernel

// n / d for 0 <= n < 2**31 by a multiply and a shift (mul = ceil(2**(31+L) / d), 2**L >= d):
// the rounding error n * (mul*d - 2**(31+L)) / 2**(31+L) stays below 1/d, so the floor is exact.
struct FastDiv {
  uint32_t d;
  uint32_t mul;
  uint32_t shift;
};

inline FastDiv make_fastdiv(uint32_t d) {
  uint32_t l = 0;
  while ((uint64_t(1) << l) < d) ++l;
  FastDiv f;
  f.d = d;
  f.shift = 31 + l;
  f.mul = uint32_t(((uint64_t(1) << f.shift) + d - 1) / d);
  return f;
}

NVQ_HD uint32_t fdiv(const FastDiv& f, uint32_t n) { return uint32_t((uint64_t(n) * f.mul) >> f.shift); }

#if defined(__CUDACC__)

// This CTA's contiguous slice of [0, n) over a 1D grid of any shape (multiple of blockDim long, so
// that a warp's units stay consecutive and its memory accesses coalesced).
struct Slice {
  uint32_t begin, end;
};

__device__ __forceinline__ uint32_t flat_cta() { return blockIdx.y * gridDim.x + blockIdx.x; }

__device__ __forceinline__ Slice cta_slice(uint32_t n) {
  const uint32_t ctas = gridDim.x * gridDim.y;
  const uint32_t per_cta = (n + ctas - 1) / ctas;
  const uint32_t per = (per_cta + blockDim.x - 1) / blockDim.x * blockDim.x;
  const uint32_t b = min(n, flat_cta() * per);
  return Slice{b, min(n, b + per)};
}

// Row-block tiling of the NVFP4 kernels: a CTA (tile_threads(): rows * cols rounded up to whole
// warps, the extra threads idle in the tiled phase) is `rows` x `cols` threads; thread (ty, tx) owns the
// 16-value block column blockIdx.x * cols + tx and walks the rows ty, ty + rows, ... of the CTA's
// contiguous row slice (blockIdx.y; the dense kernel instead takes every gridDim.y-th row step).
// Addresses then advance by a constant per step, a warp reads consecutive blocks of a row (or whole
// short rows), and the per-thread expert cache stays warm.
struct Tile {
  int32_t cols;  // block columns per CTA
  int32_t rows;  // rows per CTA step; rows * cols <= kThreads
};

inline int tile_threads(const Tile& t) { return (t.rows * t.cols + 31) / 32 * 32; }

inline Tile make_tile(int32_t kb_cols) {
  Tile t;
  if (kb_cols >= kThreads) {
    const int32_t n = (kb_cols + kThreads - 1) / kThreads;
    t.cols = ((kb_cols + n - 1) / n + 31) / 32 * 32;
    t.rows = 1;
  } else {
    t.cols = kb_cols;
    t.rows = kThreads / kb_cols;
  }
  return t;
}

// Rows [begin, end) of this CTA's slice of [0, n) in steps of `step` rows.
__device__ __forceinline__ Slice row_slice(uint32_t n, uint32_t step) {
  const uint32_t per_cta = (n + gridDim.y - 1) / gridDim.y;
  const uint32_t per = (per_cta + step - 1) / step * step;
  const uint32_t b = min(n, blockIdx.y * per);
  return Slice{b, min(n, b + per)};
}

// Largest e in [0, n) with a[e] <= v, for a non-decreasing a[0..n] with a[0] <= v < a[n]
// (the expert that owns row v when a holds expert offsets; empty experts are skipped).
__device__ __forceinline__ int find_segment(const int32_t* a, int n, int32_t v) {
  int lo = 0, hi = n;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (a[mid] <= v) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Number of entries of the non-decreasing a[0..n) that are <= v, found by the whole warp: each level samples 32
// evenly spaced entries with one load per lane and keeps the chunk where the count ends (two levels for up to
// 1024 entries, against ten dependent steps of a binary search). Every lane of the warp must call it with the
// same arguments; every lane gets the count.
__device__ __forceinline__ int count_le_warp(const int32_t* a, int n, int64_t v) {
  const int lane = int(threadIdx.x & 31u);
  int lo = 0, len = n;  // the count is in [lo, lo + len]
  while (len > 0) {
    const int stride = (len + 31) >> 5;
    const int pos = lo + lane * stride;  // first entry of chunk `lane`
    const bool le = lane * stride < len && int64_t(a[pos]) <= v;
    const int k = __popc(__ballot_sync(0xFFFFFFFFu, le));  // chunks that start <= v: a prefix
    if (k == 0) return lo;
    lo += (k - 1) * stride + 1;                      // every entry before chunk k-1's second is <= v,
    len = min(stride - 1, len - (k - 1) * stride - 1);  // chunk k (if any) starts > v
  }
  return lo;
}

// Copy n int32 values to shared memory (16-byte loads where the source is aligned).
__device__ __forceinline__ void stage_to_smem(int32_t* dst, const int32_t* src, int n) {
  if ((reinterpret_cast<uintptr_t>(src) & 15) == 0) {
    const int n4 = n >> 2;
    for (int i = threadIdx.x; i < n4; i += blockDim.x) {
      const int4 v = __ldg(reinterpret_cast<const int4*>(src) + i);
      dst[4 * i] = v.x;
      dst[4 * i + 1] = v.y;
      dst[4 * i + 2] = v.z;
      dst[4 * i + 3] = v.w;
    }
    for (int i = (n4 << 2) + threadIdx.x; i < n; i += blockDim.x) dst[i] = __ldg(src + i);
  } else {
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = __ldg(src + i);
  }
}

// Exclusive prefix sums of per-expert counts ceil(clamp(mask[e], 0, max_m) / kUnit) into prefix[0..E]
// (prefix[E] = total): valid rows with kUnit = 1, 128-row scale tiles with kUnit = 128. Uses
// `warp_sums` (32 ints of shared memory). Ends with __syncthreads().
template <int kUnit = 1>
__device__ __forceinline__ int32_t masked_count(const int32_t* mask, int e, int32_t max_m) {
  return (min(max(__ldg(mask + e), 0), max_m) + kUnit - 1) / kUnit;
}

template <int kUnit = 1>
__device__ __forceinline__ void masked_prefix(const int32_t* mask, int num_experts, int32_t max_m, int32_t* prefix,
                                              int32_t* warp_sums) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int per = (num_experts + blockDim.x - 1) / blockDim.x;
  const int lo = min(num_experts, tid * per), hi = min(num_experts, lo + per);
  int32_t local = 0;
  for (int e = lo; e < hi; ++e) local += masked_count<kUnit>(mask, e, max_m);
  int32_t incl = local;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t v = __shfl_up_sync(0xFFFFFFFFu, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int32_t w = lane < nwarps ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t v = __shfl_up_sync(0xFFFFFFFFu, w, o);
      if (lane >= o) w += v;
    }
    if (lane < nwarps) warp_sums[lane] = w;  // inclusive per-warp totals
  }
  __syncthreads();
  int32_t run = incl - local + (warp > 0 ? warp_sums[warp - 1] : 0);
  for (int e = lo; e < hi; ++e) {
    prefix[e] = run;
    run += masked_count<kUnit>(mask, e, max_m);
  }
  if (tid == blockDim.x - 1) prefix[num_experts] = run;
  __syncthreads();
}

// Load the 16-byte chunks of one block of 16 activations.
template <typename T>
__device__ __forceinline__ void load_block16(const T* p, uint4 (&c)[kChunksPerBlock16<T>]) {
#pragma unroll
  for (int i = 0; i < kChunksPerBlock16<T>; ++i) c[i] = ld_nc16(p + i * Chunk<T>::kElems);
}

// Zero the 16-byte run `p` of a swizzled scale atom (rows row0, row0 + 32, row0 + 64, row0 + 96, four scale columns
// each), except the 4-byte row groups whose row `keep(row)` says the quantization units write: one 16-byte store
// when no row is kept.
template <class Keep>
__device__ __forceinline__ void zero_scale_run(uint8_t* p, uint32_t row0, Keep keep) {
  const bool k0 = keep(row0), k1 = keep(row0 + 32), k2 = keep(row0 + 64), k3 = keep(row0 + 96);
  if (!(k0 | k1 | k2 | k3)) {
    st16(p, make_uint4(0, 0, 0, 0));
  } else {
    if (!k0) *reinterpret_cast<uint32_t*>(p) = 0;
    if (!k1) *reinterpret_cast<uint32_t*>(p + 4) = 0;
    if (!k2) *reinterpret_cast<uint32_t*>(p + 8) = 0;
    if (!k3) *reinterpret_cast<uint32_t*>(p + 12) = 0;
  }
}

// Zero the 16-byte chunk `c` of a swizzled scale region (128-row tiles of k_tiles 512-byte tiles) but the kept rows
// (zero_scale_run). Chunk c holds rows (c/32 / k_tiles)*128 + c%32 + 32*i, i = 0..3, four scale columns each.
template <class Keep>
__device__ __forceinline__ void zero_scale_chunk(uint8_t* region, uint32_t c, const FastDiv& k_tiles, Keep keep) {
  zero_scale_run(region + uint64_t(c) * 16, fdiv(k_tiles, c >> 5) * 128 + (c & 31), keep);
}

// Programmatic dependent launch (PDL, sm_90 and up). Every quantization kernel starts with pdl_enter(), before its
// first global memory access: it waits until the grids it depends on have completed and their writes are visible
// (griddepcontrol.wait; immediate when the launch had no programmatic dependency), then lets the next kernel of
// the stream launch early (griddepcontrol.launch_dependents: once every CTA of this grid has run it, i.e. the last
// wave has started, the next grid's CTAs may take the SM slots this grid frees; their own wait still orders them
// after this grid). The SASS check (tests/test_csrc_compile.py) asserts the wait comes before any global access.
__device__ __forceinline__ void pdl_enter() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

#endif  // __CUDACC__

// CTAs that fill the GPU once at `per_sm` resident CTAs per SM.
inline uint64_t gpu_ctas(int num_sms, int per_sm) {
  return uint64_t(num_sms > 0 ? num_sms : 132) * uint64_t(per_sm > 0 ? per_sm : 1);
}

// Grid size for `units` work items of one thread each (at least one CTA, at most one GPU wave).
inline int grid_for(uint64_t units, int num_sms, int per_sm) {
  const uint64_t want = (units + kThreads - 1) / kThreads;
  const uint64_t cap = gpu_ctas(num_sms, per_sm);
  return int(want < 1 ? 1 : (want < cap ? want : cap));
}

// Grid of a tiled NVFP4 kernel: x = column tiles, y = row slices (or row-step residues); at most one
// GPU wave, and at least as many CTAs as `extra_units` 1D work items need (zero-fill phases).
inline dim3 tile_grid(const Tile& t, int32_t kb_cols, uint64_t rows, uint64_t extra_units, int num_sms, int per_sm) {
  const uint64_t gx = uint64_t((kb_cols + t.cols - 1) / t.cols);
  const uint64_t cap = gpu_ctas(num_sms, per_sm);
  const uint64_t threads = uint64_t(tile_threads(t));
  uint64_t gy = (rows + t.rows - 1) / t.rows;
  const uint64_t gy_extra = (extra_units + threads * gx - 1) / (threads * gx);
  if (gy_extra > gy) gy = gy_extra;
  const uint64_t gy_cap = cap / gx > 0 ? cap / gx : 1;
  if (gy > gy_cap) gy = gy_cap;
  if (gy < 1) gy = 1;
  return dim3(uint32_t(gx), uint32_t(gy > 65535 ? 65535 : gy), 1);
}

// The row-step runs of a chunks kernel's CTAs (many waves; the block scheduler starts them in order of
// blockIdx.y): CTA y takes `steps` consecutive row steps for y < y1, steps / 2 for y1 <= y < y2 and steps / 4
// from y2 on, back to back from row step 0. The shorter runs are the last waves (the tail): the GPU then does
// not idle while a few long CTAs finish. y1 = y2 = grid.y: every run `steps` long.
struct ChunkPlan {
  int32_t steps, y1, y2;
};

NVQ_HD uint32_t chunk_half(uint32_t s) { return s > 1 ? s / 2 : 1; }
NVQ_HD uint32_t chunk_quarter(uint32_t s) { return s > 3 ? s / 4 : 1; }

// First row step of CTA y's run, and its length in `n` (the last run may reach past the rows: clamp).
NVQ_HD uint32_t chunk_run(const ChunkPlan& p, uint32_t y, uint32_t& n) {
  const uint32_t s = uint32_t(p.steps), y1 = uint32_t(p.y1), y2 = uint32_t(p.y2);
  if (y < y1) {
    n = s;
    return y * s;
  }
  const uint32_t h = chunk_half(s);
  if (y < y2) {
    n = h;
    return y1 * s + (y - y1) * h;
  }
  n = chunk_quarter(s);
  return y1 * s + (y2 - y1) * h + (y - y2) * n;
}

// Grid and plan of a chunks kernel: x = column tiles, y = row-step runs of `steps` (doubled until grid.y fits
// its 65535 limit). The last wave of `resident` CTAs (the whole GPU) takes quarter runs and the wave before it
// half runs, where the rows fill more than those two waves; fewer rows take equal runs.
inline dim3 chunk_grid(const Tile& t, int32_t cols, uint64_t rows, int32_t steps, uint64_t resident,
                       ChunkPlan& plan) {
  const uint64_t gx = uint64_t((cols + t.cols - 1) / t.cols);
  const uint64_t row_steps = (rows + uint64_t(t.rows) - 1) / uint64_t(t.rows);
  for (;;) {
    const uint64_t s = uint64_t(steps), h = chunk_half(uint32_t(steps)), q = chunk_quarter(uint32_t(steps));
    const uint64_t wave = resident / gx > 0 ? resident / gx : 1;  // CTA rows resident at once
    uint64_t y1, y2, gy;
    if (row_steps > wave * (h + q)) {
      y1 = (row_steps - wave * (h + q)) / s;
      y2 = y1 + wave;
      gy = y2 + (row_steps - y1 * s - wave * h + q - 1) / q;
    } else {
      gy = (row_steps + s - 1) / s;
      y1 = y2 = gy;
    }
    if (gy <= 65535) {
      plan = ChunkPlan{steps, int32_t(y1), int32_t(y2)};
      return dim3(uint32_t(gx), uint32_t(gy > 0 ? gy : 1));
    }
    steps *= 2;
  }
}

// Instantiate a launcher for the activation dtype named by a host-side ActDType.
#define NVQ_DISPATCH_ACT(dt, T, ...) \
  switch (dt) {                      \
    case ActDType::kBF16: {          \
      using T = __nv_bfloat16;       \
      return __VA_ARGS__;            \
    }                                \
    case ActDType::kF16: {           \
      using T = __half;              \
      return __VA_ARGS__;            \
    }                                \
    case ActDType::kF32: {           \
      using T = float;               \
      return __VA_ARGS__;            \
    }                                \
  }                                  \
  return cudaErrorInvalidValue

// A switch that is on unless the environment variable `name` is "0" (callers cache it: read once per process).
inline bool env_switch_on(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr || std::strcmp(v, "0") != 0;
}

// NVFP4_PLUGIN_PDL=0 launches every kernel without the programmatic dependency (plain stream order); unset or
// anything else: kernels that follow another kernel in the stream may start before it ends (pdl_enter). Read once
// per process.
inline bool pdl_on() {
  static const bool on = env_switch_on("NVFP4_PLUGIN_PDL");
  return on;
}

// Launch `kernel` (which starts with pdl_enter()) with the programmatic-stream-serialization attribute when
// pdl_on() and `pdl`: pass pdl = false for a kernel that follows a memset or copy of its own launcher, where
// the dependency must stay a full one. Returns the launch status.
template <typename... KArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          bool pdl, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = (pdl && pdl_on()) ? 1 : 0;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

template <class Kernel>
inline int resident_ctas(Kernel kernel, size_t smem = 0, int threads = kThreads) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess || n < 1) n = 1;
  return n;
}

}  // namespace nvq
