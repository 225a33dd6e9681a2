// NVFP4 activation quantization: dense, grouped by expert (expert / blockscale offsets), masked
// with fused SiLU-and-mul; and plain SiLU-and-mul. Framework-free; host launchers in launch.h.
//
// One thread quantizes one 16-value block (32 bytes of bf16/fp16, 64 of fp32): its amax, scale and
// codes need no communication. Threads are tiled rows x block-columns (see Tile): a warp reads 32
// consecutive blocks of a row (1 KB), each thread walks down its column with constant address steps
// (the dense kernel through every gridDim.y-th row step, the others through the CTA's slice of rows).
// The grid fills the GPU once (or less for small problems), so every SM streams; small problems
// spread their rows over as many CTAs as they have.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "bulk_ring.cuh"
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

// The out_scale table of the expert that a CTA step works on, for the 8-row-group kernels (every row
// of a step lies in one 128-row scale tile, so in one expert: the expert is CTA-uniform). use() rebuilds
// the table between two barriers when the expert changes; every thread of the CTA must call it.
struct ExpertOutScales {
  float* table;  // [kOutScaleTab] shared memory (OutScaleTable)
  int expert;
  __device__ __forceinline__ void use(int e, float inv_gs) {
    if (e == expert) return;
    __syncthreads();  // the previous expert's last reads
    for (int b = threadIdx.x; b < 256; b += blockDim.x) fill_out_scale_table<false>(table, b, inv_gs);
    __syncthreads();
    expert = e;
  }
};

// Column part and row part of the swizzled offset (their sum is swizzled_offset(row, col, kt)).
__device__ __forceinline__ uint32_t swz_col(uint32_t col) { return (col >> 2) * 512 + (col & 3); }
__device__ __forceinline__ uint32_t swz_row(uint32_t row, uint32_t kt) {
  return (row >> 7) * kt * 512 + (row & 31) * 16 + ((row >> 5) & 3) * 4;
}

// ------------------------------------------------------------------------------------------------
// Dense: rows [0, m_pad) x block columns [0, kb_pad); padding rows / columns write a zero scale.
// ------------------------------------------------------------------------------------------------
// Dense tile of the GROUPS kernel (swizzled scales only): 32 block columns x one 8-row group per CTA step.
constexpr int32_t kDenseGroupRows = 8;

// The 8-row groups (GROUPS kernels): group grp is rows 2s, 2s+1, 2s+32, 2s+33, 2s+64, 2s+65, 2s+96,
// 2s+97 of 128-row scale tile grp / 16 (s = grp % 16), whose scale bytes of 4 consecutive columns fill
// one 32-byte sector; warp ty of a CTA step takes row 2s + group_sub(ty) of the tile.
__device__ __forceinline__ uint32_t group_sub(int32_t ty) { return (uint32_t(ty) & 1u) + 32u * (uint32_t(ty) >> 1); }
__device__ __forceinline__ uint32_t group_row_in_tile(uint32_t grp, uint32_t sub) { return 2u * (grp & 15u) + sub; }

// L2 size of the current device (bytes; 50 MB if the query fails). Host-side attribute query, no sync.
inline int64_t l2_cache_bytes() {
  int dev = 0, bytes = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&bytes, cudaDevAttrL2CacheSize, dev) != cudaSuccess ||
      bytes <= 0) {
    return int64_t(50) << 20;
  }
  return bytes;
}

// NVFP4_PLUGIN_QUANT_TILING=rows|groups|chunks forces one tiling of the compiled NVFP4 kernels wherever it
// applies: `rows` the one-wave row-block kernels (dense, experts, masked), `groups` the 8-row groups (dense and
// masked, swizzled scales with >= 32 block columns), `chunks` the many-wave kernels whose CTAs each take a short
// run of consecutive row steps (dense, experts). Unset or "auto" keeps the measured choice. For benchmarks and
// tests; read once per process.
enum class TilingChoice { kAuto, kRows, kGroups, kChunks };
inline TilingChoice tiling_choice() {
  static const TilingChoice c = [] {
    const char* v = std::getenv("NVFP4_PLUGIN_QUANT_TILING");
    if (v != nullptr && std::strcmp(v, "rows") == 0) return TilingChoice::kRows;
    if (v != nullptr && std::strcmp(v, "groups") == 0) return TilingChoice::kGroups;
    if (v != nullptr && std::strcmp(v, "chunks") == 0) return TilingChoice::kChunks;
    return TilingChoice::kAuto;
  }();
  return c;
}

// The tiling of one launch: the forced one where it applies to this launch, else the measured choice.
inline TilingChoice pick_tiling(TilingChoice measured, bool groups_ok, bool chunks_ok) {
  const TilingChoice c = tiling_choice();
  const bool ok = c == TilingChoice::kRows || (c == TilingChoice::kGroups && groups_ok) ||
                  (c == TilingChoice::kChunks && chunks_ok);
  return ok ? c : measured;
}

// Dense tiling (swizzled or linear scales); each threshold measured on the H200 (PERF_NOTES.md, "Work
// distribution"):
// - 8-row groups (swizzled, >= 32 block columns) for up to 1024 rows, where the 32-column tile's extra CTAs
//   cut latency;
// - chunks (many waves of CTAs that each take 7 consecutive row steps, 16 from 128 row steps per resident CTA;
//   the last two waves half and quarter runs, ChunkPlan) from 6 row steps per resident CTA up, 5 with swizzled
//   scales (sector lanes). A one-wave grid that sweeps its rows in a fixed order falls behind itself on long
//   inputs (CTAs drift apart, and with them the rows of each 32-byte scale sector); the block scheduler keeps a
//   many-wave grid in order;
// - else the one-wave row-block tile in the grid-wide row order (nvfp4_dense_kernel), faster than the groups at
//   8192-32768 rows (neighbouring CTAs write the rows of one scale sector close together in time there).
// `chunk_ctas`: resident CTAs of the whole GPU for the chunks kernel. Returns the tiling and, for chunks,
// the row steps per CTA.
inline TilingChoice dense_tiling(bool swizzle, int64_t m_pad, int32_t kb_pad, const Tile& rows_tile,
                                 uint64_t chunk_ctas, int32_t& steps) {
  const uint64_t gx = uint64_t((kb_pad + rows_tile.cols - 1) / rows_tile.cols);
  const uint64_t units = gx * uint64_t((m_pad + rows_tile.rows - 1) / rows_tile.rows);  // CTA row steps
  steps = units >= 128 * chunk_ctas ? 16 : 7;
  const bool groups_ok = swizzle && kb_pad >= 32;
  const uint64_t chunks_from = uint64_t(swizzle ? 5 : 6) * chunk_ctas;
  const TilingChoice measured = groups_ok && m_pad <= 1024 ? TilingChoice::kGroups
                                : units >= chunks_from     ? TilingChoice::kChunks
                                                           : TilingChoice::kRows;
  return pick_tiling(measured, groups_ok, true);
}

// Experts: the chunks kernel (nvfp4_experts_chunks_kernel) where the input is >= 4x the L2 size (measured on the
// H200: PERF_NOTES.md, "Experts"). Fewer rows leave most scale rows as per-expert padding, which the row-block
// kernel's phase 2 zeroes 16 bytes at a time.
template <typename T>
TilingChoice experts_tiling(int64_t m, int64_t k) {
  static const int64_t l2 = l2_cache_bytes();
  const bool big = m * k * int64_t(sizeof(T)) >= 4 * l2;
  return pick_tiling(big ? TilingChoice::kChunks : TilingChoice::kRows, false, true);
}

// The masked kernel takes the 8-row groups where its input (gate and up: 2 x K values per row) is
// >= 16x the L2 size; below it the row slices are short enough that the scale sectors stay in L2 anyway
// (measured on the H200: PERF_NOTES.md, "Masked SiLU-mul").
template <typename T>
bool masked_uses_groups(uint64_t rows, int64_t in_row, int32_t kb_pad) {
  static const int64_t l2 = l2_cache_bytes();
  const bool ok = kb_pad >= 32;
  const bool big = int64_t(rows) * in_row * int64_t(sizeof(T)) >= 16 * l2;
  return pick_tiling(ok && big ? TilingChoice::kGroups : TilingChoice::kRows, ok, false) == TilingChoice::kGroups;
}

// Row order: CTA y of the one-wave grid takes the row steps (rows, or 8-row groups) y, y + gridDim.y, ...,
// so the whole grid sweeps the input front to back together rather than each CTA streaming its own
// contiguous slice (faster on the H200, PERF_NOTES.md; the row-block tile then writes whole scale sectors too).
template <typename T, bool SWIZZLE, bool UE8M0, bool GROUPS>
__global__ void __launch_bounds__(kThreads) nvfp4_dense_kernel(const T* __restrict__ in, const float* __restrict__ gsp,
                                                               uint8_t* __restrict__ out, uint8_t* __restrict__ sf,
                                                               int32_t m, int32_t m_pad, int32_t k, int32_t kb,
                                                               int32_t kb_pad, Tile tile) {
  pdl_enter();
  __shared__ float table[kOutScaleTab];
  const float gs = __ldg(gsp);
  const float inv_gs = rcp_or_zero(gs);
  for (int b = threadIdx.x; b < 256; b += blockDim.x) fill_out_scale_table<UE8M0>(table, b, inv_gs);
  __syncthreads();

  const int32_t ty = int32_t(threadIdx.x) / tile.cols;
  const int32_t col = int32_t(blockIdx.x) * tile.cols + (int32_t(threadIdx.x) - ty * tile.cols);
  if (ty >= tile.rows || col >= kb_pad) return;  // the CTA has kThreads threads, the tile may use fewer
  const OutScaleTable os(table);
  const uint32_t kt = uint32_t(kb_pad) >> 2;
  const uint32_t colpart = swz_col(uint32_t(col));
  if constexpr (GROUPS) {
    // Row groups (dense_tiling; tile = 32 columns x 8 rows): warp ty of a CTA step quantizes one row of
    // an 8-row group, rows 2s, 2s+1, 2s+32, 2s+33, 2s+64, 2s+65, 2s+96, 2s+97 of a 128-row tile, whose scale
    // bytes of 4 consecutive columns fill one 32-byte sector, written whole within one step. m_pad is a
    // multiple of 128: every group row exists.
    static_assert(SWIZZLE, "row groups only matter for the swizzled scale layout");
    const uint32_t sub = group_sub(ty);
    for (uint32_t grp = blockIdx.y; grp < uint32_t(m_pad) / kDenseGroupRows; grp += gridDim.y) {
      const uint32_t r = 128u * (grp >> 4) + group_row_in_tile(grp, sub);
      uint8_t s = 0;
      if (r < uint32_t(m) && col < kb) {
        s = quant_block_at<T, UE8M0>(in + int64_t(r) * k + col * 16, out + int64_t(r) * (k / 2) + col * 8, gs, os);
      }
      sf[swz_row(r, kt) + colpart] = s;
    }
    return;
  }
  const uint32_t r0 = blockIdx.y * uint32_t(tile.rows) + ty, rstep = gridDim.y * uint32_t(tile.rows);
  const auto store_sf = [&](uint32_t r, uint8_t s) {
    if (SWIZZLE) {
      sf[swz_row(r, kt) + colpart] = s;
    } else {
      sf[int64_t(r) * kb + col] = s;
    }
  };
  uint32_t r = r0;
  if (col < kb) {
    // No software prefetch and no cp.async ring here: both measured slower on the H200 (PERF_NOTES.md,
    // "Bytes in flight").
    const int64_t step_in = int64_t(rstep) * k, step_out = int64_t(rstep) * (k / 2);
    const T* p = in + int64_t(r0) * k + col * 16;
    uint8_t* q = out + int64_t(r0) * (k / 2) + col * 8;
    for (; r < uint32_t(m); r += rstep, p += step_in, q += step_out) store_sf(r, quant_block_at<T, UE8M0>(p, q, gs, os));
  }
  for (; r < uint32_t(m_pad); r += rstep) store_sf(r, 0);  // padding rows and padding columns of the swizzled layout
}

// Dense in chunks (dense_tiling): CTA y of a many-wave grid takes a run of consecutive row steps (ChunkPlan: `steps`
// long, shorter in the last two waves), so the block scheduler keeps the sweep over the input in order. The CTA's first block is loaded
// before the out_scale table is built. Built for 6 resident CTAs per SM with 16-bit inputs and e4m3 scales (40
// registers, measured faster than 48); UE8M0 scales and fp32 inputs would spill there and take no bound.
// A kernel of its own: folded into nvfp4_dense_kernel as a third row order, it took that kernel's one-wave
// paths from 47-48 to 60-72 registers. Swizzled, a row step is an 8-row group in sector lanes (below), 2-3 points
// faster than the row tile, whose warp stores touched 8 scale sectors with 4 bytes each (PERF_NOTES.md, "Scale
// stores").
template <typename T, bool SWIZZLE, bool UE8M0>
__global__ void __launch_bounds__(kThreads, kIs16Bit<T> && !UE8M0 ? 6 : 1)
    nvfp4_dense_chunks_kernel(const T* __restrict__ in, const float* __restrict__ gsp, uint8_t* __restrict__ out,
                              uint8_t* __restrict__ sf, int32_t m, int32_t m_pad, int32_t k, int32_t kb,
                              int32_t kb_pad, Tile tile, ChunkPlan plan) {
  pdl_enter();
  __shared__ float table[kOutScaleTab];
  // Row step st of the grid: swizzled, 8-row group st (32 block columns x kDenseGroupRows rows per CTA step),
  // where warp w of the CTA takes block columns 4w .. 4w + 3 of all 8 rows, whose scale bytes fill one 32-byte
  // sector: each warp's scale store writes a whole sector. Linear, thread (ty, tx) of the tile takes row
  // st * tile.rows + ty.
  int32_t col;
  uint32_t ro;  // the thread's row within a row step
  if constexpr (SWIZZLE) {
    const uint32_t lane = threadIdx.x & 31u;
    col = int32_t(blockIdx.x) * 32 + int32_t((threadIdx.x >> 5) * 4u + (lane & 3u));
    ro = group_sub(int32_t(lane >> 2));
  } else {
    ro = threadIdx.x / uint32_t(tile.cols);
    col = int32_t(blockIdx.x) * tile.cols + int32_t(threadIdx.x - ro * uint32_t(tile.cols));
  }
  // the CTA has kThreads threads, the tile may use fewer (swizzled: whole warps, as kb_pad % 4 == 0)
  const bool active = (SWIZZLE || ro < uint32_t(tile.rows)) && col < kb_pad;
  uint32_t n_steps;
  const uint32_t s0 = chunk_run(plan, blockIdx.y, n_steps);
  const uint32_t step_rows = uint32_t(SWIZZLE ? kDenseGroupRows : tile.rows);
  const uint32_t s_end = min((uint32_t(m_pad) + step_rows - 1) / step_rows, s0 + n_steps);
  const uint32_t kt = uint32_t(kb_pad) >> 2;
  // The thread's row and its input, output and scale pointers at row step st. Swizzled, the loop moves them on
  // from step to step: 4 fewer instructions per block, 1-2 points faster (PERF_NOTES.md, "Scale stores"). Linear
  // recomputes them: moving them on there spilled 8 bytes.
  uint32_t r;
  const T* p;
  uint8_t* q;
  uint8_t* g;
  const auto at_step = [&](uint32_t st) {
    r = SWIZZLE ? 128u * (st >> 4) + group_row_in_tile(st, ro) : st * uint32_t(tile.rows) + ro;
    p = in + int64_t(r) * k + col * 16;
    q = out + int64_t(r) * (k / 2) + col * 8;
    g = sf + (SWIZZLE ? int64_t(swz_row(r, kt) + swz_col(uint32_t(col))) : int64_t(r) * kb + col);
  };
  at_step(s0);
  uint4 c[kChunksPerBlock16<T>];
  if (active && col < kb && r < uint32_t(m)) load_block16<T>(p, c);
  const float gs = __ldg(gsp);
  const float inv_gs = rcp_or_zero(gs);
  for (int b = threadIdx.x; b < 256; b += blockDim.x) fill_out_scale_table<UE8M0>(table, b, inv_gs);
  __syncthreads();
  if (!active) return;
  const OutScaleTable os(table);
  for (uint32_t st = s0; st < s_end; ++st) {
    if constexpr (!SWIZZLE) {
      at_step(st);
      if (r >= uint32_t(m_pad)) break;  // the last step's rows past m (swizzled: m_pad % 128 == 0)
    }
    uint8_t s = 0;
    if (r < uint32_t(m) && col < kb) {
      if (st != s0) load_block16<T>(p, c);
      uint32_t lo, hi;
      s = nvfp4_quant_block16<T, UE8M0>(c, gs, os, lo, hi);
      st8(q, make_uint2(lo, hi));
    }
    *g = s;
    if constexpr (SWIZZLE) {
      // 2 rows on within a 128-row tile (its scale rows 32 bytes on); from group 15 to group 0 of the next tile
      // 98 rows on, the scale rows 30 * 16 bytes back in the next tile.
      const bool wrap = (st & 15u) == 15u;
      const uint32_t dr = wrap ? 98u : 2u;
      r += dr;
      p += int64_t(dr) * k;
      q += int64_t(dr) * (k / 2);
      g += wrap ? kt * 512u - 480u : 32u;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Grouped by expert. Phase 1: rows [0, m) x block columns [0, kb); rows outside
// [expert_offsets[0], expert_offsets[E]) write zero codes. Phase 2 (all threads, 1D): zero every
// 16-byte chunk of the scale tensor that no expert row owns. Offsets live in shared memory; each
// thread caches the expert of its last row (its rows ascend).
// ------------------------------------------------------------------------------------------------
constexpr int kMaxOutTabs = 8;  // per-CTA out_scale tables (one per expert of the CTA's row slice)
// Shared memory of the experts kernels for up to 1023 experts (offsets staged twice, and the out_scale tables):
// what their occupancy queries assume, cached once per process. More experts only make the estimate high
// (grid sizing, the chunks' tapered waves), never the result wrong.
constexpr size_t kExpertsSmemBound = 2048 * sizeof(int32_t) + kMaxOutTabs * kOutScaleTab * sizeof(float);

// The out_scale tables of the experts that own rows [a, b) of a CTA, one 256-entry table per expert from
// e_first (CTA-uniform; every thread must call it, whole warps; no barrier). Returns the number of tables, 0 when
// the rows span more than kMaxOutTabs experts (the caller then computes out_scale per block) or none.
__device__ __forceinline__ int build_expert_out_tables(const int32_t* eo, int num_experts,
                                                       const float* __restrict__ gsp, int32_t a, int32_t b,
                                                       float* otab, int& e_first) {
  int n_tab = 0;
  e_first = 0;
  if (a < b) {
    e_first = count_le_warp(eo, num_experts, a) - 1;  // find_segment(eo, num_experts, a)
    n_tab = count_le_warp(eo, num_experts, b - 1) - e_first;
    if (n_tab > kMaxOutTabs) n_tab = 0;
  }
  for (int i = threadIdx.x; i < n_tab * 256; i += blockDim.x) {
    fill_out_scale_table<false>(otab + (i >> 8) * kOutScaleTab, i & 255, rcp_or_zero(__ldg(gsp + e_first + (i >> 8))));
  }
  return n_tab;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    nvfp4_experts_kernel(const T* __restrict__ in, const float* __restrict__ gsp, const int32_t* __restrict__ eo_g,
                         const int32_t* __restrict__ bo_g, uint8_t* __restrict__ out, uint8_t* __restrict__ sf,
                         int32_t m, int32_t k, int32_t kb, int32_t kb_pad, int num_experts, int32_t sf_rows,
                         Tile tile, uint32_t chunks, FastDiv kt_div, int use_tabs) {
  pdl_enter();
  extern __shared__ int32_t smem[];
  int32_t* eo = smem;
  int32_t* bo = smem + num_experts + 1;
  float* otab = reinterpret_cast<float*>(smem + 2 * (num_experts + 1));  // [kMaxOutTabs][kOutScaleTab] with use_tabs
  stage_to_smem(eo, eo_g, num_experts + 1);
  stage_to_smem(bo, bo_g, num_experts + 1);
  __syncthreads();
  const int32_t first = eo[0], last = eo[num_experts];
  const uint32_t kt = uint32_t(kb_pad) >> 2;
  const Slice rs = row_slice(uint32_t(m), uint32_t(tile.rows));

  // out_scale tables of the experts that own this CTA's rows (CTA-uniform decision), built once:
  // the per-block correctly rounded reciprocal becomes one shared-memory load.
  int e_first = 0, n_tab = 0;
  if (use_tabs) {
    n_tab = build_expert_out_tables(eo, num_experts, gsp, max(int32_t(rs.begin), first),
                                    min(int32_t(rs.end), last), otab, e_first);
    if (n_tab > 0) __syncthreads();
  }

  const int32_t ty = int32_t(threadIdx.x) / tile.cols;
  const int32_t col = int32_t(blockIdx.x) * tile.cols + (int32_t(threadIdx.x) - ty * tile.cols);
  if (ty < tile.rows && col < kb && rs.begin + ty < rs.end) {
    const uint32_t colpart = swz_col(uint32_t(col));
    const bool last_col = col == kb - 1;
    const T* pin = in + col * 16;
    auto phase1 = [&](auto tab_tag) {
      constexpr bool kTab = decltype(tab_tag)::value;
      int32_t lo = 0, hi = 0, base = 0;  // cached expert: rows [lo, hi) -> scale rows base + (row - lo)
      float gs = 0.0f, inv_gs = 0.0f;
      OutScaleTable tab(otab);
      uint32_t ur = rs.begin + ty;
      uint4 c[kChunksPerBlock16<T>];
      load_block16<T>(pin + int64_t(ur) * k, c);  // every row < m has input, expert or not
      for (; ur < rs.end; ur += tile.rows) {
        // prefetch the next row's block (clamped to the last row: no branch, one spare load)
        uint4 cn[kChunksPerBlock16<T>];
        load_block16<T>(pin + int64_t(min(ur + tile.rows, rs.end - 1)) * k, cn);
        const int32_t row = int32_t(ur);
        uint8_t* q = out + int64_t(row) * (k / 2) + col * 8;
        if (row < first || row >= last) {
          st8(q, make_uint2(0, 0));
        } else {
          if (row < lo || row >= hi) {
            const int e = find_segment(eo, num_experts, row);
            lo = eo[e];
            hi = eo[e + 1];
            base = bo[e];
            gs = __ldg(gsp + e);
            if (kTab) {
              tab = OutScaleTable(otab + (e - e_first) * kOutScaleTab);
            } else {
              inv_gs = rcp_or_zero(gs);
            }
          }
          uint32_t qlo, qhi;
          uint8_t s;
          if (kTab) {
            s = nvfp4_quant_block16<T, false>(c, gs, tab, qlo, qhi);
          } else {
            s = nvfp4_quant_block16<T, false>(c, gs, OutScaleDirect<false>{inv_gs}, qlo, qhi);
          }
          st8(q, make_uint2(qlo, qhi));
          const int32_t srow = base + (row - lo);
          if (srow >= 0 && srow < sf_rows) {
            uint8_t* p = sf + swz_row(uint32_t(srow), kt) + colpart;
            *p = s;
            if (last_col) {  // zero the padding columns of this row's last 4-column group
              for (int32_t cc = kb; cc < kb_pad; ++cc) p[cc - col] = 0;
            }
          }
        }
#pragma unroll
        for (int i = 0; i < kChunksPerBlock16<T>; ++i) c[i] = cn[i];
      }
    };
    if (n_tab > 0) {
      phase1(std::true_type{});
    } else {
      phase1(std::false_type{});
    }
  }

  // Phase 2: scale bytes of rows that no expert row owns (per-expert padding rows, the tail). The
  // expert of the last searched scale row is cached: chunks ascend, so a search per expert change.
  const int32_t b_first = bo[0], b_last = bo[num_experts];
  int32_t sb_lo = 0, sb_hi = 0, s_cnt = 0;  // cached expert: scale rows [sb_lo, sb_hi), s_cnt valid
  const Slice zs = cta_slice(chunks);
  for (uint32_t c = zs.begin + threadIdx.x; c < zs.end; c += blockDim.x) {
    zero_scale_chunk(sf, c, kt_div, [&](uint32_t r) {
      const int32_t row = int32_t(r);
      if (row < b_first || row >= b_last) return false;
      if (row < sb_lo || row >= sb_hi) {
        const int e = find_segment(bo, num_experts, row);
        sb_lo = bo[e];
        sb_hi = bo[e + 1];
        s_cnt = eo[e + 1] - eo[e];
      }
      return row - sb_lo < s_cnt;
    });
  }
}

// Zero the scale rows [a, b) (every column) with all threads of the grid, 16-byte chunks in order (a warp's stores
// cover 512 contiguous bytes; the chunks of the first and last 128-row tiles keep their rows outside [a, b)).
// kt: 4-column groups per row (scale tensors stay below 2**31 bytes, so the chunk indices fit 32 bits).
__device__ __forceinline__ void zero_scale_rows(uint8_t* __restrict__ sf, int32_t a, int32_t b, const FastDiv& kt) {
  if (a >= b) return;
  const uint32_t c_end = ((uint32_t(b) + 127) >> 7) * kt.d * 32;
  const uint32_t nthreads = gridDim.x * gridDim.y * blockDim.x;
  for (uint32_t c = (uint32_t(a) >> 7) * kt.d * 32 + flat_cta() * blockDim.x + threadIdx.x; c < c_end; c += nthreads) {
    zero_scale_chunk(sf, c, kt, [&](uint32_t r) { return r < uint32_t(a) || r >= uint32_t(b); });
  }
}

// Zero the scale rows [a, b) in the 4-column groups [g0, g0 + ng) with the threads t = 0 .. n - 1 of a CTA, 16-byte
// chunks in order (zero_scale_rows).
__device__ __forceinline__ void zero_scale_rows_cta(uint8_t* __restrict__ sf, int32_t a, int32_t b, uint32_t g0,
                                                    uint32_t ng, uint32_t kt, uint32_t t, uint32_t n) {
  for (uint32_t blk = uint32_t(max(a, 0)) >> 7; int64_t(blk) * 128 < int64_t(b); ++blk) {
    for (uint32_t w = t; w < ng * 32; w += n) {
      zero_scale_run(sf + ((blk * kt + g0) * 32 + w) * 16, blk * 128 + (w & 31),
                     [&](uint32_t r) { return r < uint32_t(a) || r >= uint32_t(b); });
    }
  }
}

// Grouped by expert, in chunks (experts_tiling): nvfp4_dense_chunks_kernel's order over the input rows. CTA y takes
// a run of consecutive row steps (32 rows; the last two waves half and quarter runs, ChunkPlan), so the many-wave
// grid sweeps the input in order and each CTA meets one or two experts. A row r of expert e writes its scales at
// scale row bo[e] + (r - eo[e]). Per CTA: the offsets are staged in shared memory, and the out_scale tables of the
// experts of its rows are built once (more than kMaxOutTabs experts: out_scale per block). The CTA that
// holds an expert's last row (clamped to [0, m)) zeroes that expert's padding scale rows
// [bo[e] + rows, bo[e+1]) in its columns, right after the expert's last scale sector was written; the scale
// rows before bo[0] and from bo[E] are zeroed by the whole grid; rows of no expert get zero codes. Both zeroings
// store 16-byte chunks in order, whole 32-byte sectors per warp (zero_scale_rows): the one-byte stores per row
// and the word stores 512 bytes apart they replace cost a constant ~37 us at E = 256 (PERF_NOTES.md, "Scale stores").
// Built for 5 resident CTAs per SM with 16-bit inputs (48 registers; 64 measured much slower; fp16 spills 16 bytes
// there). RING: the input streams through a bulk-copy ring (bulk_ring.cuh; a producer warp after the tile's
// threads, 4 resident CTAs, 56 registers), which pays here and not in the dense kernels (PERF_NOTES.md, "Bytes in
// flight").
template <typename T, bool RING>
__global__ void __launch_bounds__(kThreads + (RING ? kRingThreads : 0), kIs16Bit<T> ? (RING ? 4 : 5) : 1)
    nvfp4_experts_chunks_kernel(const T* __restrict__ in, const float* __restrict__ gsp,
                                const int32_t* __restrict__ eo_g, const int32_t* __restrict__ bo_g,
                                uint8_t* __restrict__ out, uint8_t* __restrict__ sf, int32_t m, int32_t k, int32_t kb,
                                int32_t kb_pad, int num_experts, int32_t sf_rows, Tile tile, ChunkPlan plan,
                                FastDiv kt_div) {
  pdl_enter();
  extern __shared__ __align__(128) uint8_t dyn_smem[];  // [RING: ring_smem_bytes<T>()] eo, bo, out_scale tables
  int32_t* eo = reinterpret_cast<int32_t*>(dyn_smem + (RING ? ring_smem_bytes<T>() : 0));
  int32_t* bo = eo + num_experts + 1;
  float* otab = reinterpret_cast<float*>(eo + 2 * (num_experts + 1));  // [kMaxOutTabs][kOutScaleTab]
  const int32_t ty = int32_t(threadIdx.x) / tile.cols;
  const int32_t col = int32_t(blockIdx.x) * tile.cols + (int32_t(threadIdx.x) - ty * tile.cols);
  const bool producer = RING && threadIdx.x >= blockDim.x - kRingThreads;
  // the CTA has kThreads threads (RING: and the producer warp), the tile may use fewer; RING (tile.cols a
  // multiple of 32): whole warps consume, the lanes past kb_pad idle in the loops
  const bool active = !producer && ty < tile.rows && (RING ? col - int32_t(threadIdx.x & 31u) : col) < kb_pad;
  const bool sf_col = !RING || col < kb_pad;
  uint32_t n_steps;
  const int32_t R0 = int32_t(chunk_run(plan, blockIdx.y, n_steps)) * tile.rows;
  const int32_t R1 = min(m, R0 + int32_t(n_steps) * tile.rows);
  const int32_t r0 = R0 + ty;
  uint4 c[kChunksPerBlock16<T>];
  // RING: load j is row step j of the CTA tile (every row of [R0, R1), the rows of no expert too)
  const int32_t cta_c0 = int32_t(blockIdx.x) * tile.cols;
  const uint32_t warps = uint32_t(tile.rows) * ((min(tile.cols, kb_pad - cta_c0) + 31) / 32);  // consumer warps
  const Ring<T> ring{dyn_smem, 32u * (warps + 1u)};
  const uint32_t seg = uint32_t(min(kb - cta_c0, tile.cols));  // blocks per row of the CTA tile
  const auto src_of = [&](uint32_t j) { return in + (int64_t(R0) + int64_t(j) * tile.rows) * k + cta_c0 * 16; };
  const auto bytes_of = [&](uint32_t j) {
    return uint32_t(min(tile.rows, R1 - (R0 + int32_t(j) * tile.rows))) * seg * 16u * uint32_t(sizeof(T));
  };
  const uint32_t loads = R0 < R1 ? uint32_t(R1 - R0 + tile.rows - 1) / uint32_t(tile.rows) : 0u;
  if constexpr (RING) {
    if (producer) ring.start(loads, src_of, bytes_of);
  } else {
    if (active && col < kb && r0 < R1) load_block16<T>(in + int64_t(r0) * k + col * 16, c);  // before the setup
  }
  stage_to_smem(eo, eo_g, num_experts + 1);
  stage_to_smem(bo, bo_g, num_experts + 1);
  __syncthreads();
  const int32_t first = eo[0], last = eo[num_experts];
  int e_first = 0;
  const int n_tab = build_expert_out_tables(eo, num_experts, gsp, max(R0, first), min(R1, last), otab, e_first);
  // the experts whose last row (clamped to [0, m)) lies in [R0, R1): [ea, eb), ea the smallest e with
  // eo[e + 1] > R0 (0 for the first CTA), eb that of R1 (E for the last); counted by whole warps
  const int ea = R0 == 0 ? 0 : count_le_warp(eo + 1, num_experts, R0);
  const int eb = R1 >= m ? num_experts : count_le_warp(eo + 1, num_experts, R1);
  __syncthreads();
  const uint32_t kt = uint32_t(kb_pad) >> 2;
  if (producer) {
    ring.produce(loads, src_of, bytes_of);
  } else if (active) {
    const uint32_t colpart = swz_col(uint32_t(col));
    const T* p = in + int64_t(r0) * k + col * 16;
    uint8_t* q = out + int64_t(r0) * (k / 2) + col * 8;
    const int64_t step_in = int64_t(tile.rows) * k, step_out = int64_t(tile.rows) * (k / 2);
    const uint32_t off = (uint32_t(ty) * seg + uint32_t(col - cta_c0)) * 16u * uint32_t(sizeof(T));  // in a slot
    uint32_t i = 0;  // RING: the next load
    int32_t r = r0;
    for (const int32_t z = min(R1, first); r < z; r += tile.rows, p += step_in, q += step_out) {
      if constexpr (RING) ring.skip(i++);  // a row of no expert: its slot is released unread
      if (col < kb) st8(q, make_uint2(0, 0));  // rows before the first expert
    }
    // One run of rows per expert, each a loop like the dense kernel's (the expert's global scale, out_scale
    // table and scale-row offset fixed): rows ascend, so the expert of the CTA's first row (e_first; a search
    // only if this thread's first row lies past it), then a linear advance.
    int e = -1;
    const int32_t r_last = min(R1, last);
    while (r < r_last) {
      if (e < 0) {
        e = eo[e_first + 1] > r ? e_first : find_segment(eo, num_experts, r);
      } else {
        do ++e;
        while (eo[e + 1] <= r);
      }
      const int32_t run_end = min(eo[e + 1], r_last);
      const int32_t to_scale_row = bo[e] - eo[e];
      const float gs = __ldg(gsp + e);
      const auto run = [&](const auto& os) {
        for (; r < run_end; r += tile.rows, p += step_in, q += step_out) {
          uint8_t sc = 0;
          if constexpr (RING) ring.next(i, c, off, col < kb ? p : nullptr);
          if (col < kb) {
            if (!RING && r != r0) load_block16<T>(p, c);
            uint32_t qlo, qhi;
            sc = nvfp4_quant_block16<T, false>(c, gs, os, qlo, qhi);
            st8(q, make_uint2(qlo, qhi));
          }
          if constexpr (RING) ring.release(i++);  // after lane 0's block was quantized (Ring::release)
          const int32_t srow = r + to_scale_row;
          if (sf_col && uint32_t(srow) < uint32_t(sf_rows)) sf[swz_row(uint32_t(srow), kt) + colpart] = sc;
        }
      };
      if (n_tab > 0) {
        run(OutScaleTable(otab + (e - e_first) * kOutScaleTab));
      } else {
        run(OutScaleDirect<false>{rcp_or_zero(gs)});
      }
    }
    for (; r < R1; r += tile.rows, p += step_in, q += step_out) {
      if constexpr (RING) ring.skip(i++);
      if (col < kb) st8(q, make_uint2(0, 0));  // rows from the last expert's end
    }
  }
  // the padding scale rows of the experts [ea, eb), and those of rows past m that an offset names, in the CTA's
  // 4-column groups (tile.cols and its first column are multiples of 4), by all its tile threads
  if (!producer && int32_t(threadIdx.x) < tile.rows * tile.cols) {
    const uint32_t g0 = uint32_t(cta_c0) >> 2, ng = uint32_t(min(tile.cols, kb_pad - cta_c0)) >> 2;
    for (int x = ea; x < eb; ++x) {
      const int32_t written = max(min(eo[x + 1], m) - eo[x], 0);  // scale rows of the expert's rows below m
      const int32_t pa = max(bo[x] + written, 0), pb = min(bo[x + 1], sf_rows);
      if (pa < pb) zero_scale_rows_cta(sf, pa, pb, g0, ng, kt, threadIdx.x, uint32_t(tile.rows * tile.cols));
    }
  }
  zero_scale_rows(sf, 0, min(max(bo[0], 0), sf_rows), kt_div);
  zero_scale_rows(sf, max(bo[num_experts], 0), sf_rows, kt_div);
}

// ------------------------------------------------------------------------------------------------
// Masked layout, optionally fused with SiLU-and-mul. Valid rows are compacted with an in-kernel
// prefix sum over the mask, so the work (and the threads) split evenly over the valid rows of all
// experts whatever the mask, with no host synchronization. With zero_fill, phase 2 zeroes the code
// bytes of rows past the mask and phase 3 every scale byte that no valid row writes.
// ------------------------------------------------------------------------------------------------
// Raw chunks of a block: gate (or the plain input) and, with SILU, up.
template <typename T, bool SILU>
struct MaskedRaw {
  uint4 g[kChunksPerBlock16<T>];
  uint4 u[SILU ? kChunksPerBlock16<T> : 1];
};

template <typename T, bool SILU>
__device__ __forceinline__ void load_masked_raw(const T* __restrict__ p, int32_t k, MaskedRaw<T, SILU>& raw) {
  load_block16<T>(p, raw.g);
  if constexpr (SILU) load_block16<T>(p + k, raw.u);
}

template <typename T, bool SILU>
__device__ __forceinline__ void masked_block16(const MaskedRaw<T, SILU>& raw, uint4 (&c)[kChunksPerBlock16<T>]) {
  if constexpr (!SILU) {
#pragma unroll
    for (int i = 0; i < kChunksPerBlock16<T>; ++i) c[i] = raw.g[i];
  } else {
    constexpr int kE = Chunk<T>::kElems;
    const uint4 (&gc)[kChunksPerBlock16<T>] = raw.g;
    const uint4 (&uc)[kChunksPerBlock16<T>] = raw.u;
    // One per-thread test whether every division may take div_rn's fp32 fast path
    // (silu_div_guard, a function of g alone): the common case runs no per-element branch.
    float g[16], up[16];
#pragma unroll
    for (int i = 0; i < kChunksPerBlock16<T>; ++i) {
      chunk_to_float(gc[i], static_cast<const T*>(nullptr), g + i * kE);
      chunk_to_float(uc[i], static_cast<const T*>(nullptr), up + i * kE);
    }
    bool fast = true;
#pragma unroll
    for (int j = 0; j < 16; ++j) fast &= silu_div_guard(g[j]);
    float v[16];
    if (fast) {
#pragma unroll
      for (int j = 0; j < 16; ++j) v[j] = mul_rn(silu_fp32_guarded(g[j]), up[j]);
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) v[j] = mul_rn(div_rn(g[j], silu_den(g[j])), up[j]);
    }
#pragma unroll
    for (int i = 0; i < kChunksPerBlock16<T>; ++i) c[i] = float_to_chunk<T>(v + i * kE);
  }
}

// bf16 SiLU table: silu_fp32(g) for the 8192 bf16 g with 2**-25 <= |g| < 128 (magnitude bits
// 0x3300..0x42FF; positive at [0, 4096), negative at [4096, 8192)). silu_tab_off(x) maps the
// pre-biased x = 4 * bits - 0xCC00 of a bf16 to its byte offset; every x of a block is in range iff
// (OR of the x) & 0xFFFDC000 == 0 (bits 14-16 and 18-31 clear; bit 17 is the sign).
constexpr int kSiluTab = 8192;
constexpr uint32_t kSiluTabBias = 0x3300u * 4u;
constexpr uint32_t kSiluTabOut = 0xFFFDC000u;
NVQ_HD float silu_tab_input(int i) {
  return u2f((uint32_t(i >> 12) << 31) | ((uint32_t(i & 0xFFF) + 0x3300u) << 16));
}
NVQ_HD uint32_t silu_tab_off(uint32_t x) { return (x & 0x3FFFu) | ((x >> 3) & 0x4000u); }

// Fill the table (every thread of the CTA takes part; no barrier here). Entries with
// 2**-95 <= |g| < 65 take silu_fp32_guarded, which is silu_fp32 bit for bit there (PERF_NOTES.md, "Bit-exactness
// evidence": exhaustive) at about half the instructions; the others (|g| >= 65) the general silu_fp32.
__device__ __forceinline__ void silu_tab_fill(float* tab) {
  for (int i = threadIdx.x; i < kSiluTab; i += blockDim.x) {
    const float g = silu_tab_input(i);
    tab[i] = silu_div_guard(g) ? silu_fp32_guarded(g) : silu_fp32(g);
  }
}

template <typename T, bool SILU, bool TABLE>
__device__ __forceinline__ void masked_block16_tab(const MaskedRaw<T, SILU>& raw, uint4 (&c)[kChunksPerBlock16<T>],
                                                   const float* tab) {
  if constexpr (!TABLE) {
    masked_block16<T, SILU>(raw, c);
  } else {
    static_assert(std::is_same<T, __nv_bfloat16>::value && SILU, "table path: bf16 SiLU only");
    const uint4 (&gc)[2] = raw.g;
    const uint4 (&uc)[2] = raw.u;
    const uint32_t gw[8] = {gc[0].x, gc[0].y, gc[0].z, gc[0].w, gc[1].x, gc[1].y, gc[1].z, gc[1].w};
    uint32_t x[16], any = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      x[2 * i] = (gw[i] & 0xFFFFu) * 4u - kSiluTabBias;
      x[2 * i + 1] = (gw[i] >> 16) * 4u - kSiluTabBias;
      any |= x[2 * i] | x[2 * i + 1];
    }
    float up[16], v[16];
    chunk_to_float(uc[0], static_cast<const T*>(nullptr), up);
    chunk_to_float(uc[1], static_cast<const T*>(nullptr), up + 8);
    if ((any & kSiluTabOut) == 0) {
      const char* tb = reinterpret_cast<const char*>(tab);
#pragma unroll
      for (int j = 0; j < 16; ++j) v[j] = mul_rn(*reinterpret_cast<const float*>(tb + silu_tab_off(x[j])), up[j]);
    } else {  // a value outside the table: the computed SiLU for the block
      float g[16];
      chunk_to_float(gc[0], static_cast<const T*>(nullptr), g);
      chunk_to_float(gc[1], static_cast<const T*>(nullptr), g + 8);
#pragma unroll
      for (int j = 0; j < 16; ++j) v[j] = mul_rn(silu_fp32(g[j]), up[j]);
    }
    c[0] = float_to_chunk<T>(v);
    c[1] = float_to_chunk<T>(v + 8);
  }
}

// With zero_fill, phases 2 and 3 of the masked kernels (all threads of the grid, 1-D): the code bytes
// of rows past the mask, and every scale byte that no valid row writes (padding rows included).
// `prefix` holds the valid rows before each expert (masked_prefix).
__device__ __forceinline__ void masked_zero_fill(uint8_t* __restrict__ out, uint8_t* __restrict__ sf,
                                                 const int32_t* prefix, int num_experts, int32_t max_m, int32_t k,
                                                 int64_t sf_expert, FastDiv k16_div, FastDiv kt_div,
                                                 FastDiv expert_chunks_div) {
  const int32_t valid_rows = prefix[num_experts];
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

template <typename T, bool SILU, bool ZERO_FILL, bool TABLE = false>
__global__ void __launch_bounds__(kThreads)
    nvfp4_masked_kernel(const T* __restrict__ in, const float* __restrict__ gsp, const int32_t* __restrict__ mask,
                        uint8_t* __restrict__ out, uint8_t* __restrict__ sf, int num_experts, int32_t max_m,
                        int32_t m_pad, int32_t k, int32_t kb, int32_t kb_pad, Tile tile, FastDiv k16_div,
                        FastDiv kt_div, FastDiv expert_chunks_div) {
  pdl_enter();
  extern __shared__ int32_t smem[];
  float* silu_tab = reinterpret_cast<float*>(smem);  // [kSiluTab] with TABLE
  int32_t* prefix = smem + (TABLE ? kSiluTab : 0);   // [E + 1] valid rows before expert e
  int32_t* warp_sums = prefix + num_experts + 1;     // [32]
  if constexpr (TABLE) silu_tab_fill(silu_tab);
  masked_prefix(mask, num_experts, max_m, prefix, warp_sums);  // ends with __syncthreads()
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
    // input row of compacted row v (segment cache of the prefetch: nlo/nhi/nex)
    int32_t nlo = 0, nhi = 0, nex = 0;
    auto in_row_of = [&](int32_t v) -> int64_t {
      if (v < nlo || v >= nhi) {
        nex = find_segment(prefix, num_experts, v);
        nlo = prefix[nex];
        nhi = prefix[nex + 1];
      }
      return int64_t(nex) * max_m + (v - nlo);
    };
    const T* pin = in + col * 16;
    MaskedRaw<T, SILU> raw;
    if (rs.begin + ty < rs.end) load_masked_raw<T, SILU>(pin + in_row_of(int32_t(rs.begin + ty)) * in_row, k, raw);
    for (uint32_t uv = rs.begin + ty; uv < rs.end; uv += tile.rows) {
      const int32_t v = int32_t(uv);
      // prefetch the next row's raw block (the last row re-reads itself)
      MaskedRaw<T, SILU> nraw;
      load_masked_raw<T, SILU>(pin + in_row_of(int32_t(min(uv + tile.rows, rs.end - 1))) * in_row, k, nraw);
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
      masked_block16_tab<T, SILU, TABLE>(raw, c, silu_tab);
      uint32_t qlo, qhi;
      const uint8_t s = nvfp4_quant_block16<T, false>(c, gs, OutScaleDirect<false>{inv_gs}, qlo, qhi);
      st8(out + row * (k / 2) + col * 8, make_uint2(qlo, qhi));
      uint8_t* p = sf + ex * sf_expert + swz_row(uint32_t(r), kt) + colpart;
      *p = s;
      if (ZERO_FILL && last_col) {
        for (int32_t cc = kb; cc < kb_pad; ++cc) p[cc - col] = 0;
      }
      raw = nraw;
    }
  }
  if constexpr (ZERO_FILL) {
    masked_zero_fill(out, sf, prefix, num_experts, max_m, k, sf_expert, k16_div, kt_div, expert_chunks_div);
  }
}

// Masked, in 8-row groups of the scale rows (masked_uses_groups): the dense GROUPS tiling over each
// expert's valid 128-row scale tiles, compacted across experts (tile prefix over ceil(valid / 128)) so
// the threads split evenly whatever the mask. A CTA step quantizes 32 block columns x one 8-row group
// (rows 2s, 2s+1, 2s+32, ... of a tile): each 4-column scale sector of valid rows is written whole
// within one step. Rows past the mask in a partly valid tile are skipped (zero_fill: phases 2 and 3).
template <typename T, bool SILU, bool ZERO_FILL, bool TABLE = false>
__global__ void __launch_bounds__(kThreads)
    nvfp4_masked_groups_kernel(const T* __restrict__ in, const float* __restrict__ gsp,
                               const int32_t* __restrict__ mask, uint8_t* __restrict__ out, uint8_t* __restrict__ sf,
                               int num_experts, int32_t max_m, int32_t m_pad, int32_t k, int32_t kb, int32_t kb_pad,
                               FastDiv k16_div, FastDiv kt_div, FastDiv expert_chunks_div) {
  pdl_enter();
  extern __shared__ int32_t smem[];
  float* silu_tab = reinterpret_cast<float*>(smem);  // [kSiluTab] with TABLE
  int32_t* prefix = smem + (TABLE ? kSiluTab : 0);   // [E + 1] valid rows before expert e
  int32_t* tiles = prefix + num_experts + 1;          // [E + 1] valid 128-row tiles before expert e
  int32_t* warp_sums = tiles + num_experts + 1;       // [32]
  masked_prefix(mask, num_experts, max_m, prefix, warp_sums);
  masked_prefix<128>(mask, num_experts, max_m, tiles, warp_sums);  // ends with __syncthreads()
  const uint32_t kt = uint32_t(kb_pad) >> 2;
  const int64_t sf_expert = int64_t(m_pad) * kb_pad;
  const int64_t in_row = SILU ? 2 * int64_t(k) : int64_t(k);
  const int32_t ty = int32_t(threadIdx.x) >> 5;  // tile: 32 block columns x kDenseGroupRows rows
  const int32_t col = int32_t(blockIdx.x) * 32 + (int32_t(threadIdx.x) & 31);
  {
    __shared__ float os_table[kOutScaleTab];
    ExpertOutScales os{os_table, -1};
    const OutScaleTable tab(os_table);
    const uint32_t colpart = swz_col(uint32_t(col));
    const Slice grp_rows = row_slice(uint32_t(tiles[num_experts]) * 16u, 1);
    const uint32_t sub = group_sub(ty);
    int32_t tlo = 0, thi = 0, ex = 0, valid = 0;  // cached expert: compacted tiles [tlo, thi), valid rows
    float gs = 0.0f, inv_gs = 0.0f;
    // The row of group grp handled by this thread (after moving the cached expert to the group's tile).
    const auto row_of = [&](uint32_t grp) {
      const int32_t t = int32_t(grp >> 4);
      if (t < tlo || t >= thi) {
        ex = find_segment(tiles, num_experts, t);
        tlo = tiles[ex];
        thi = tiles[ex + 1];
        valid = prefix[ex + 1] - prefix[ex];
        gs = __ldg(gsp + ex);
        inv_gs = rcp_or_zero(gs);
      }
      return int32_t(128u * uint32_t(t - tlo) + group_row_in_tile(grp, sub));
    };
    // Every CTA starts with the SiLU table fill, during which no memory traffic would flow: the
    // blocks of the first two steps are prefetched into L2 first (registers stay free for the fill).
    for (uint32_t grp = grp_rows.begin; grp < min(grp_rows.end, grp_rows.begin + 2); ++grp) {
      const int32_t r = row_of(grp);
      if (r < valid && col < kb) {
        const T* p = in + (int64_t(ex) * max_m + r) * in_row + col * 16;
        prefetch_l2(p);
        if constexpr (SILU) prefetch_l2(p + k);
      }
    }
    if constexpr (TABLE) {
      silu_tab_fill(silu_tab);
      __syncthreads();
    }
    for (uint32_t grp = grp_rows.begin; grp < grp_rows.end; ++grp) {  // the same steps in every thread
      const int32_t r = row_of(grp);
      os.use(ex, inv_gs);
      if (r >= valid || col >= kb_pad) continue;  // past the mask: untouched, or zeroed by phases 2 and 3
      uint8_t* p = sf + ex * sf_expert + swz_row(uint32_t(r), kt) + colpart;
      if (col >= kb) {  // padding columns of a valid row
        if (ZERO_FILL) *p = 0;
        continue;
      }
      const int64_t row = int64_t(ex) * max_m + r;
      MaskedRaw<T, SILU> raw;
      load_masked_raw<T, SILU>(in + row * in_row + col * 16, k, raw);
      uint4 c[kChunksPerBlock16<T>];
      masked_block16_tab<T, SILU, TABLE>(raw, c, silu_tab);
      uint32_t qlo, qhi;
      *p = nvfp4_quant_block16<T, false>(c, gs, tab, qlo, qhi);
      st8(out + row * (k / 2) + col * 8, make_uint2(qlo, qhi));
    }
  }
  if constexpr (ZERO_FILL) {
    masked_zero_fill(out, sf, prefix, num_experts, max_m, k, sf_expert, k16_div, kt_div, expert_chunks_div);
  }
}

// ------------------------------------------------------------------------------------------------
// Masked, small problems without zero-fill (decode): one thread per (row of [E, max_m], block
// column). The mask, the global scale and the input are loaded together at the start (invalid rows
// read in-bounds input and drop it), so one memory latency instead of mask -> prefix scan ->
// barrier -> gs -> input; smaller CTAs spread the SiLU work over more SMs.
// ------------------------------------------------------------------------------------------------
constexpr int kDirectThreads = 128;

template <typename T, bool SILU>
__global__ void __launch_bounds__(kDirectThreads)
    nvfp4_masked_direct_kernel(const T* __restrict__ in, const float* __restrict__ gsp,
                               const int32_t* __restrict__ mask, uint8_t* __restrict__ out,
                               uint8_t* __restrict__ sf, int32_t max_m, int32_t m_pad, int32_t k, int32_t kb,
                               int32_t kb_pad, uint32_t units, FastDiv kb_div, FastDiv max_m_div) {
  pdl_enter();
  const uint32_t u = blockIdx.x * blockDim.x + threadIdx.x;
  if (u >= units) return;
  const uint32_t row = fdiv(kb_div, u);
  const int32_t col = int32_t(u - row * uint32_t(kb));
  const int32_t ex = int32_t(fdiv(max_m_div, row));
  const int32_t r = int32_t(row) - ex * max_m;
  const int64_t in_row = SILU ? 2 * int64_t(k) : int64_t(k);
  const int32_t valid = __ldg(mask + ex);
  const float gs = __ldg(gsp + ex);
  MaskedRaw<T, SILU> raw;
  load_masked_raw<T, SILU>(in + int64_t(row) * in_row + col * 16, k, raw);
  if (r >= min(max(valid, 0), max_m)) return;
  uint4 c[kChunksPerBlock16<T>];
  masked_block16<T, SILU>(raw, c);
  uint32_t qlo, qhi;
  const uint8_t s = nvfp4_quant_block16<T, false>(c, gs, OutScaleDirect<false>{rcp_or_zero(gs)}, qlo, qhi);
  st8(out + int64_t(row) * (k / 2) + col * 8, make_uint2(qlo, qhi));
  uint8_t* p = sf + int64_t(ex) * m_pad * kb_pad + swz_row(uint32_t(r), uint32_t(kb_pad) >> 2) + swz_col(uint32_t(col));
  *p = s;
}

// ------------------------------------------------------------------------------------------------
// SiLU-and-mul alone: one unit per 16-byte chunk of the output.
// ------------------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kThreads) silu_and_mul_kernel(const T* __restrict__ in, T* __restrict__ out,
                                                                int32_t inner, uint32_t units, FastDiv chunks_div) {
  pdl_enter();
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

// SiLU-and-mul alone, 16 values per unit (inner % 16 == 0): the masked kernels' block routine, so the
// bf16 table and the guarded SiLU are the same code as there (PERF_NOTES.md, "SiLU-and-mul alone").
struct SiluUnit {
  int64_t in, out;  // element offsets of the unit's gate and of its output
};
__device__ __forceinline__ SiluUnit silu_unit(uint32_t u, int32_t inner, FastDiv blocks_div) {
  const int32_t row = int32_t(fdiv(blocks_div, u));
  const int64_t col = int64_t(int32_t(u) - row * (inner / 16)) * 16;
  return SiluUnit{int64_t(row) * 2 * inner + col, int64_t(row) * inner + col};
}

template <typename T, bool TABLE>
__global__ void __launch_bounds__(kThreads) silu_and_mul16_kernel(const T* __restrict__ in, T* __restrict__ out,
                                                                  int32_t inner, uint32_t units, FastDiv blocks_div) {
  pdl_enter();
  extern __shared__ float silu_smem[];  // [kSiluTab] with TABLE
  const Slice sl = cta_slice(units);
  if constexpr (TABLE) {
    // no memory traffic flows during the fill: each thread's first two units go to L2 first
    for (uint32_t u = sl.begin + threadIdx.x; u < min(sl.end, sl.begin + 2 * blockDim.x); u += blockDim.x) {
      const T* p = in + silu_unit(u, inner, blocks_div).in;
      prefetch_l2(p);
      prefetch_l2(p + inner);
    }
    silu_tab_fill(silu_smem);
    __syncthreads();
  }
  for (uint32_t u = sl.begin + threadIdx.x; u < sl.end; u += blockDim.x) {
    const SiluUnit su = silu_unit(u, inner, blocks_div);
    MaskedRaw<T, true> raw;
    load_masked_raw<T, true>(in + su.in, inner, raw);
    uint4 c[kChunksPerBlock16<T>];
    masked_block16_tab<T, true, TABLE>(raw, c, silu_smem);
#pragma unroll
    for (int i = 0; i < kChunksPerBlock16<T>; ++i) st16(out + su.out + i * Chunk<T>::kElems, c[i]);
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
  auto stride = nvfp4_dense_kernel<T, SWIZZLE, UE8M0, false>;
  auto chunks = nvfp4_dense_chunks_kernel<T, SWIZZLE, UE8M0>;
  static const int per_sm_stride = resident_ctas(stride);
  static const int per_sm_chunks = resident_ctas(chunks);
  Tile tile = make_tile(kb_pad);
  int32_t steps = 0;
  const TilingChoice tiling = dense_tiling(SWIZZLE, m_pad, kb_pad, tile, gpu_ctas(num_sms, per_sm_chunks), steps);
  const T* in = static_cast<const T*>(input);
  if (tiling == TilingChoice::kChunks) {
    if (SWIZZLE) tile = Tile{32, kDenseGroupRows};  // the 8-row groups in sector lanes (nvfp4_dense_chunks_kernel)
    ChunkPlan plan;
    const dim3 grid = chunk_grid(tile, kb_pad, uint64_t(m_pad), steps, gpu_ctas(num_sms, per_sm_chunks), plan);
    return launch_kernel(chunks, grid, tile_threads(tile), 0, stream, true, in, gs, out, sf, int32_t(m), int32_t(m_pad),
                         int32_t(k), kb, kb_pad, tile, plan);
  }
  auto kernel = stride;
  int per_sm = per_sm_stride;
  if constexpr (SWIZZLE) {
    if (tiling == TilingChoice::kGroups) {
      kernel = nvfp4_dense_kernel<T, true, UE8M0, true>;
      static const int per_sm_groups = resident_ctas(kernel);
      tile = Tile{32, kDenseGroupRows};
      per_sm = per_sm_groups;
    }
  }
  const dim3 grid = tile_grid(tile, kb_pad, uint64_t(m_pad), 0, num_sms, per_sm);
  return launch_kernel(kernel, grid, tile_threads(tile), 0, stream, true, in, gs, out, sf, int32_t(m), int32_t(m_pad),
                       int32_t(k), kb, kb_pad, tile);
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

// Opt a kernel in to more than 48 KB of dynamic shared memory when it needs it.
// (The default cap is 48 KB of static plus dynamic shared memory: kernels with a static table count it.)
template <class Kernel>
cudaError_t allow_smem(Kernel kernel, size_t smem) {
  if (smem <= 40 * 1024) return cudaSuccess;  // no kernel here has 8 KB of static shared memory
  cudaFuncAttributes a{};
  const cudaError_t err = cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(kernel));
  if (err != cudaSuccess) return err;
  if (smem <= size_t(a.maxDynamicSharedSizeBytes)) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
}

// The experts chunks kernel streams its input through a bulk-copy ring (bulk_ring.cuh) where the CTA's warps each
// read consecutive blocks of one row (tile.cols a multiple of 32), a row step is one contiguous copy (one row, or
// whole rows) and its bytes fit 32 bits.
// NVFP4_PLUGIN_QUANT_BULK=0 turns the rings off (direct loads), for benchmarks and tests; read once per process.
template <typename T>
bool ring_fits(const Tile& tile, int64_t k) {
  static const bool on = env_switch_on("NVFP4_PLUGIN_QUANT_BULK");
  return on && tile.cols % 32 == 0 && (tile.rows == 1 || int64_t(tile.cols) * 16 >= k) &&
         int64_t(tile.rows) * k * int64_t(sizeof(T)) < (int64_t(1) << 31);
}

// Resident CTAs per SM of a ring kernel (its dynamic shared memory opted in first), 0 if it cannot launch.
template <class Kernel>
int ring_resident_ctas(Kernel kernel, size_t smem) {
  return allow_smem(kernel, smem) == cudaSuccess ? resident_ctas(kernel, smem, kThreads + kRingThreads) : 0;
}

template <typename T>
cudaError_t launch_experts(const void* input, const float* gs, const int32_t* eo, const int32_t* bo, uint8_t* out,
                           uint8_t* sf, int64_t m, int64_t k, int num_experts, int64_t sf_rows, int num_sms,
                           cudaStream_t stream) {
  const int32_t kb = int32_t(k / 16);
  const int32_t kb_pad = (kb + 3) / 4 * 4;
  const uint64_t chunks = uint64_t(sf_rows) * uint64_t(kb_pad) / 16;
  // scale tensors below 2**31 bytes: 32-bit swizzled offsets and zero_scale_rows' fast division
  if (uint64_t(m) * uint64_t(kb) > kMaxUnits || uint64_t(sf_rows) * uint64_t(kb_pad) > kMaxUnits ||
      sf_rows % 128 != 0) {
    return cudaErrorInvalidValue;
  }
  const Tile tile0 = make_tile(kb);
  // out_scale tables when a thread has several rows to amortize the table build over
  const int use_tabs = uint64_t(m) >= uint64_t(4) * uint64_t(tile0.rows) * (gpu_ctas(num_sms, 4) / uint64_t((kb + tile0.cols - 1) / tile0.cols)) ? 1 : 0;
  const size_t smem = size_t(2) * (num_experts + 1) * sizeof(int32_t) + (use_tabs ? kMaxOutTabs * kOutScaleTab * sizeof(float) : 0);
  if (experts_tiling<T>(m, k) == TilingChoice::kChunks) {
    const Tile ctile = make_tile(kb_pad);
    static const int per_sm_plain = resident_ctas(nvfp4_experts_chunks_kernel<T, false>, kExpertsSmemBound);
    static const int per_sm_ring =
        ring_resident_ctas(nvfp4_experts_chunks_kernel<T, true>, ring_smem_bytes<T>() + kExpertsSmemBound);
    const bool ring = per_sm_ring > 0 && ring_fits<T>(ctile, k);
    auto ckernel = ring ? nvfp4_experts_chunks_kernel<T, true> : nvfp4_experts_chunks_kernel<T, false>;
    const size_t csmem = (ring ? ring_smem_bytes<T>() : 0) + size_t(2) * (num_experts + 1) * sizeof(int32_t) +
                         kMaxOutTabs * kOutScaleTab * sizeof(float);
    const cudaError_t err = allow_smem(ckernel, csmem);
    if (err != cudaSuccess) return err;
    // 32 rows per CTA, the fastest of 8-64 on the H200 (PERF_NOTES.md, "Experts")
    // resident CTAs for the plan's tapered waves (csmem depends on num_experts: a fixed bound, queried once)
    const int per_sm_chunks = ring ? per_sm_ring : per_sm_plain;
    ChunkPlan plan;
    const dim3 grid = chunk_grid(ctile, kb_pad, uint64_t(m), (32 + ctile.rows - 1) / ctile.rows,
                                 gpu_ctas(num_sms, per_sm_chunks), plan);
    const int threads = tile_threads(ctile) + (ring ? kRingThreads : 0);
    return launch_kernel(ckernel, grid, threads, csmem, stream, true, static_cast<const T*>(input), gs, eo, bo, out, sf,
                         int32_t(m), int32_t(k), kb, kb_pad, num_experts, int32_t(sf_rows), ctile, plan,
                         make_fastdiv(uint32_t(kb_pad / 4)));
  }
  auto kernel = nvfp4_experts_kernel<T>;
  const cudaError_t err = allow_smem(kernel, smem);
  if (err != cudaSuccess) return err;
  static const int per_sm = resident_ctas(kernel, kExpertsSmemBound);
  const Tile tile = tile0;
  const dim3 grid = tile_grid(tile, kb, uint64_t(m), chunks, num_sms, per_sm);
  return launch_kernel(kernel, grid, tile_threads(tile), smem, stream, true, static_cast<const T*>(input), gs, eo, bo,
                       out, sf, int32_t(m), int32_t(k), kb, kb_pad, num_experts, int32_t(sf_rows), tile,
                       uint32_t(chunks), make_fastdiv(uint32_t(kb_pad / 4)), use_tabs);
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
  // bf16 SiLU: the table variant once each thread has >= 16 blocks to amortize its share of the
  // 8192-entry table fill (32 SiLUs per thread); small problems keep the computed SiLU.
  // Small problems without zero-fill: the direct kernel (at most ~one thread per SM lane).
  if (!ZERO_FILL && all_rows * uint64_t(kb) <= uint64_t(kDirectThreads) * gpu_ctas(num_sms, 4)) {
    const uint32_t units = uint32_t(all_rows * uint64_t(kb));
    return launch_kernel(nvfp4_masked_direct_kernel<T, SILU>, (units + kDirectThreads - 1) / kDirectThreads,
                         kDirectThreads, 0, stream, true, static_cast<const T*>(input), gs, mask, out, sf,
                         int32_t(max_m), int32_t(m_pad), int32_t(k), kb, kb_pad, units, make_fastdiv(uint32_t(kb)),
                         make_fastdiv(uint32_t(max_m)));
  }
  constexpr bool kTabOk = SILU && std::is_same<T, __nv_bfloat16>::value;
  const bool use_tab = kTabOk && all_rows * uint64_t(kb) >= uint64_t(16) * kThreads * gpu_ctas(num_sms, 4);
  const bool groups = masked_uses_groups<T>(all_rows, SILU ? 2 * k : k, kb_pad);
  const size_t smem = size_t((groups ? 2 : 1) * (num_experts + 1) + 32) * sizeof(int32_t) +
                      (use_tab ? kSiluTab * sizeof(float) : 0);
  // resident CTAs: cached for up to 256 experts (shared memory of 256 experts), else asked per launch
  constexpr size_t kTab = kSiluTab * sizeof(float);
  const bool many = num_experts > 256;
  // Sized for the whole [E, max_m] space: the mask is not known on the host.
  const uint64_t extra = ZERO_FILL ? (chunks > all_rows * (k / 16) ? chunks : all_rows * (k / 16)) : 0;
  const FastDiv k16_div = make_fastdiv(uint32_t(k / 16)), kt_div = make_fastdiv(uint32_t(kb_pad / 4));
  const FastDiv chunks_div = make_fastdiv(uint32_t(uint64_t(m_pad) * uint64_t(kb_pad) / 16));
  const T* in = static_cast<const T*>(input);
  if (groups) {
    auto kernel = use_tab ? nvfp4_masked_groups_kernel<T, SILU, ZERO_FILL, kTabOk>
                          : nvfp4_masked_groups_kernel<T, SILU, ZERO_FILL, false>;
    auto plain = nvfp4_masked_groups_kernel<T, SILU, ZERO_FILL, false>;
    auto tab = nvfp4_masked_groups_kernel<T, SILU, ZERO_FILL, kTabOk>;
    static const int per_sm[2] = {resident_ctas(plain, 2304), resident_ctas(tab, 2304 + kTab)};
    const cudaError_t err = allow_smem(kernel, smem);
    if (err != cudaSuccess) return err;
    const Tile tile{32, kDenseGroupRows};
    const dim3 grid = tile_grid(tile, kb_pad, uint64_t(num_experts) * uint64_t(m_pad), extra, num_sms,
                                many ? resident_ctas(kernel, smem) : per_sm[use_tab]);
    return launch_kernel(kernel, grid, tile_threads(tile), smem, stream, true, in, gs, mask, out, sf, num_experts,
                         int32_t(max_m), int32_t(m_pad), int32_t(k), kb, kb_pad, k16_div, kt_div, chunks_div);
  }
  auto kernel = use_tab ? nvfp4_masked_kernel<T, SILU, ZERO_FILL, kTabOk> : nvfp4_masked_kernel<T, SILU, ZERO_FILL, false>;
  auto plain = nvfp4_masked_kernel<T, SILU, ZERO_FILL, false>;
  auto tab = nvfp4_masked_kernel<T, SILU, ZERO_FILL, kTabOk>;
  static const int per_sm[2] = {resident_ctas(plain, 1160), resident_ctas(tab, 1160 + kTab)};
  const cudaError_t err = allow_smem(kernel, smem);
  if (err != cudaSuccess) return err;
  const Tile tile = make_tile(kb);
  const dim3 grid = tile_grid(tile, kb, all_rows, extra, num_sms, many ? resident_ctas(kernel, smem) : per_sm[use_tab]);
  return launch_kernel(kernel, grid, tile_threads(tile), smem, stream, true, in, gs, mask, out, sf, num_experts,
                       int32_t(max_m), int32_t(m_pad), int32_t(k), kb, kb_pad, tile, k16_div, kt_div, chunks_div);
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

// The bf16 SiLU table once each thread has kSiluTabUnits units to amortize its share of the fill
// (32 SiLUs per thread); `table` < 0 decides so, 0 never takes it, > 0 whenever the dtype has one.
constexpr uint64_t kSiluTabUnits = 4;

template <typename T>
cudaError_t launch_silu16(const T* in, T* out, int64_t rows, int64_t inner, int table, int num_sms,
                          cudaStream_t stream) {
  const uint64_t units = uint64_t(rows) * uint64_t(inner / 16);
  if (units > kMaxUnits) return cudaErrorInvalidValue;
  constexpr bool kTabOk = std::is_same<T, __nv_bfloat16>::value;
  constexpr size_t kTab = kSiluTab * sizeof(float);
  auto plain = silu_and_mul16_kernel<T, false>;
  auto tab = silu_and_mul16_kernel<T, kTabOk>;
  static const int per_sm[2] = {resident_ctas(plain), kTabOk ? resident_ctas(tab, kTab) : 1};
  const bool use_tab =
      kTabOk && (table > 0 || (table < 0 && units >= kSiluTabUnits * kThreads * gpu_ctas(num_sms, per_sm[1])));
  return launch_kernel(use_tab ? tab : plain, grid_for(units, num_sms, per_sm[use_tab]), kThreads,
                       use_tab ? kTab : 0, stream, true, in, out, int32_t(inner), uint32_t(units),
                       make_fastdiv(uint32_t(inner / 16)));
}

template <typename T>
cudaError_t launch_silu(const void* input, void* out, int64_t rows, int64_t inner, int table, int num_sms,
                        cudaStream_t stream) {
  if (inner % 16 == 0)
    return launch_silu16<T>(static_cast<const T*>(input), static_cast<T*>(out), rows, inner, table, num_sms, stream);
  constexpr int kE = Chunk<T>::kElems;
  const uint64_t units = uint64_t(rows) * uint64_t(inner / kE);
  if (units > kMaxUnits || inner % kE != 0) return cudaErrorInvalidValue;
  auto kernel = silu_and_mul_kernel<T>;
  static const int per_sm = resident_ctas(kernel);
  return launch_kernel(kernel, grid_for(units, num_sms, per_sm), kThreads, 0, stream, true,
                       static_cast<const T*>(input), static_cast<T*>(out), int32_t(inner), uint32_t(units),
                       make_fastdiv(uint32_t(inner / kE)));
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

cudaError_t silu_and_mul(ActDType dt, const void* input, void* out, int64_t rows, int64_t inner, int table,
                         int num_sms, cudaStream_t stream) {
  if (rows < 0 || inner < 0) return cudaErrorInvalidValue;
  if (rows == 0 || inner == 0) return cudaSuccess;
  NVQ_DISPATCH_ACT(dt, T, launch_silu<T>(input, out, rows, inner, table, num_sms, stream));
}

}  // namespace nvq
