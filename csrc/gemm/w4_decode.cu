// CUDA FP4-weight GEMM for 1..16 tokens (decode): bulk-copied weight tiles, mma.sync.
//
// Why CUDA here (nvfp4_plugin/gemm/NOTES.md): the Triton decode kernels keep too few bytes in flight
// to pass ~55% of DRAM bandwidth on the H200 (per-thread cp.async tops out near 2 TB/s, and loads into
// registers cannot hold enough). This kernel streams each CTA's weight tiles with the copy engine
// (cp.async.bulk, completion on an mbarrier) through a ring of up to 8 stages of up to ~36 KB, so an SM
// keeps 100-200 KB of weights in flight with one instruction per row pair, and its warps spend their
// issue slots on decode and mma only:
//   * a CTA owns 16-row tiles blockIdx.x, + gridDim.x, ... and a K range (K splits across CTAs only when
//     the activations of the whole K do not fit in shared memory next to the ring, or to fill the GPU);
//   * its warps split the K range of each tile and reduce through shared memory in a fixed order
//     (deterministic), one CTA barrier per tile, which also frees the tile's ring stage;
//   * the CTA's activations are staged in shared memory once, already in mma B-fragment order (two
//     16-byte reads per atom per lane, only M rows; lanes of tokens past M read row M-1 and their
//     output columns are dropped).
//
// Layout (HopperW4Layout, shared with the Triton kernels; see nvfp4_plugin/gemm/layout.py): the 16-row
// tile t is the 8 word rows 8t .. 8t+7 (row pair (16t+g, 16t+g+8) in row 8t+g); thread (g = lane/4,
// c = lane%4) reads, per 64-wide atom, 16 bytes at word column 16*atom + 4c: the A fragments of four
// m16n8k16 mma.sync (K offsets 16j + {2c, 2c+1, 2c+8, 2c+9}, j = 0..3), and the 8 bytes of its row
// pair's four scale pairs.
//
// Decode (BIT_PLANS of layout.py): four bf16x2 (fp16x2) registers from one word with shifts and
// masks, times the expanded block scale (exact: e2m1 * s * 2**-8 has <= 6 significant bits), so the
// tensor core forms exact products accumulated in fp32. The epilogue multiplies by alpha[n] (and the
// activation scale), adds the bias and rounds once.
//
// K splits: each CTA writes its fp32 partials; after its last tile, one fence and one counter increment
// per tile; the last CTA of a tile sums the partials in split order (deterministic), writes y and resets
// the counter.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "gemm/w4_gemm.h"

namespace nvq::gemm {
namespace {

constexpr int kTileRows = 16;
constexpr int kAtomK = 64;
constexpr int kAtomBytes = 128;   // activations of one token row for one atom, in fragment order
constexpr int kMaxStages = 8;
// Dynamic shared memory a CTA may ask for (sm_90 / sm_100: 227 KB).
constexpr int64_t kMaxSmemBytes = 227 * 1024;

__host__ __device__ constexpr int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

__host__ __device__ constexpr int token_tiles(int m) { return m > 8 ? 2 : 1; }

// Shared-memory geometry of one CTA (the same in every CTA of a launch): the activations of its K range,
// the consumer warps' partial sums of two tiles, and the ring of `stages` chunks (16 rows x `chunk` atoms,
// with a full and an empty mbarrier each). Chunk rows are padded so the 8 row pairs a warp reads at once
// fall on distinct banks: word rows an odd multiple of 64 bytes, scale rows 16 bytes past a multiple of 128.
struct Geometry {
  int64_t x_bytes, red_bytes, word_row, scale_row, stage_bytes;
  __host__ __device__ constexpr Geometry(int m, int atoms_per_split, int chunk, int warps)
      : x_bytes(int64_t(atoms_per_split) * m * kAtomBytes),
        red_bytes(int64_t(2) * warps * token_tiles(m) * 8 * kTileRows * 4),
        word_row(round_up(int64_t(chunk) * 64, 128) + 64),
        scale_row(round_up(int64_t(chunk) * 8, 128) + 16),
        stage_bytes(round_up(8 * (word_row + scale_row), 128)) {}
  __host__ __device__ constexpr int64_t bytes(int stages) const {
    return x_bytes + red_bytes + stages * stage_bytes + stages * 16;
  }
};

__device__ __forceinline__ uint32_t rotr(uint32_t x, int r) { return __funnelshift_r(x, x, r); }

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

__device__ __forceinline__ uint4 lds16(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// Expanded scales of one pair (rows g, g+8; layout.expand_scale_code): bf16 s * 2**118, fp16 s * 2**6,
// row g in the low half, row g+8 in the high half. `sel` moves the pair's two code bytes to bytes 0, 2.
template <int DT>
__device__ __forceinline__ uint32_t expand_scales(uint32_t pair_word, uint32_t sel) {
  const uint32_t c = prmt(pair_word, 0u, sel);
  if constexpr (DT == 0) {
    return c * 16u + 0x70007000u;
  } else {
    return c << 7;
  }
}

// a * {h.half, h.half}, packed bf16x2 / fp16x2 (HI: the high half). The duplication folds into the
// multiply's operand select (.H0_H0 / .H1_H1 in SASS).
template <int DT, bool HI>
__device__ __forceinline__ uint32_t mul_half(uint32_t a, uint32_t h) {
  uint32_t d;
  if constexpr (DT == 0 && !HI) {
    asm("{ .reg .b16 l, u; .reg .b32 t; mov.b32 {l, u}, %2; mov.b32 t, {l, l}; mul.rn.bf16x2 %0, %1, t; }"
        : "=r"(d) : "r"(a), "r"(h));
  } else if constexpr (DT == 0) {
    asm("{ .reg .b16 l, u; .reg .b32 t; mov.b32 {l, u}, %2; mov.b32 t, {u, u}; mul.rn.bf16x2 %0, %1, t; }"
        : "=r"(d) : "r"(a), "r"(h));
  } else if constexpr (!HI) {
    asm("{ .reg .b16 l, u; .reg .b32 t; mov.b32 {l, u}, %2; mov.b32 t, {l, l}; mul.rn.f16x2 %0, %1, t; }"
        : "=r"(d) : "r"(a), "r"(h));
  } else {
    asm("{ .reg .b16 l, u; .reg .b32 t; mov.b32 {l, u}, %2; mov.b32 t, {u, u}; mul.rn.f16x2 %0, %1, t; }"
        : "=r"(d) : "r"(a), "r"(h));
  }
  return d;
}

// One word (8 codes) and the expanded scale pair of rows g (low half) and g+8 (high half) -> the 4 A
// registers (a0: row g, K 2c; a1: row g+8, K 2c; a2: row g, K 2c+8; a3: row g+8, K 2c+8).
template <int DT>
__device__ __forceinline__ void decode(uint32_t q, uint32_t h, uint32_t (&a)[4]) {
  uint32_t o0, o1, o2, o3;
  if constexpr (DT == 0) {
    o0 = q & 0x81C081C0u;
    o1 = rotr(q, 4) & 0x81C081C0u;
    o2 = rotr(q, 10) & 0x81C081C0u;
    o3 = (rotr(q, 30) & 0x80C080C0u) | (rotr(q, 6) & 0x01000100u);
  } else {
    const uint32_t t2 = rotr(q, 2);
    o0 = q & 0x8E008E00u;
    o1 = (t2 & 0x04000400u) | (rotr(q, 5) & 0x8A008A00u);
    o2 = (t2 & 0x08000800u) | (rotr(q, 9) & 0x86008600u);
    o3 = (t2 & 0x80008000u) | (rotr(q, 12) & 0x0E000E00u);
  }
  a[0] = mul_half<DT, false>(o0, h);
  a[1] = mul_half<DT, true>(o1, h);
  a[2] = mul_half<DT, false>(o2, h);
  a[3] = mul_half<DT, true>(o3, h);
}

template <int DT>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (DT == 0) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <int DT>
__device__ __forceinline__ float to_float(const void* p, int64_t i, BiasType bt) {
  if (bt == BiasType::kF32) return static_cast<const float*>(p)[i];
  const uint16_t bits = static_cast<const uint16_t*>(p)[i];
  if constexpr (DT == 0) {
    return __uint_as_float(uint32_t(bits) << 16);
  } else {
    return __half2float(__ushort_as_half(bits));
  }
}

template <int DT>
__device__ __forceinline__ uint16_t round_out(float v) {
  if constexpr (DT == 0) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  } else {
    return __half_as_ushort(__float2half_rn(v));
  }
}

// Output row n's epilogue operands, read a tile ahead (their load latency stays off the tile loop).
struct RowEpilogue {
  float alpha = 0.f, bias = 0.f;
};

template <int DT>
__device__ __forceinline__ RowEpilogue fetch_epilogue(const W4DecodeArgs& a, int n) {
  RowEpilogue e;
  if (n < a.n) {
    e.alpha = a.alpha[n];
    if (a.bias_type != BiasType::kNone) e.bias = to_float<DT>(a.bias, n, a.bias_type);
  }
  return e;
}

// (acc * alpha) * act_scale + bias, rounded once (the Triton kernels' order).
template <int DT>
__device__ __forceinline__ void store_out(const W4DecodeArgs& a, int n, int tok, float acc, const RowEpilogue& e,
                                          float act_scale) {
  float v = __fmul_rn(acc, e.alpha);
  if (a.act_scale != nullptr) v = __fmul_rn(v, act_scale);
  if (a.bias_type != BiasType::kNone) v = __fadd_rn(v, e.bias);
  static_cast<uint16_t*>(a.y)[int64_t(tok) * a.stride_ym + n] = round_out<DT>(v);
}

__device__ __forceinline__ uint2 lds8(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// The one arrival of a stage's barrier, announcing the bytes its bulk copies will complete.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// Copy engine: `bytes` (a multiple of 16, 16-byte aligned both sides) global -> shared, completing on `bar`.
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Barrier 1 among the W consumer warps only (the producer warp never waits on it).
__device__ __forceinline__ void consumers_sync(int threads) {
  asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory");
}

// Shared memory (Geometry): activations xf[atom][token row][c][8 words] (word 2j + h of lane c: K 16j + 8h
// + 2c, +1 of the atom) of the CTA's K range, zero past K; the partial sums red[2][W][token][16 rows] fp32
// of two consecutive tiles (after the tile loop: the K-split flags); the ring, `stages` x (8 word rows,
// 8 scale rows of one chunk); a full and an empty mbarrier per stage.
//
// Warps 0..W-1 consume: per chunk, warp w decodes atoms [w*cw, (w+1)*cw) of it, then arrives on the
// stage's empty barrier; at the end of a tile they reduce their partials. Warp W produces: its lane 0
// waits for a stage to be empty and refills it with the bulk copies of the next chunk (no CTA barrier in
// the loop).
// CTAs per SM the register budget is sized for: (W + 1) warps each, ~24-27 warps per SM.
template <int W>
constexpr int kMinBlocks = W == 4 ? 5 : (W == 8 ? 3 : 1);

template <int DT, int NT, int W>
__global__ void __launch_bounds__((W + 1) * 32, kMinBlocks<W>) w4_decode_kernel(const W4DecodeArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kConsumers = W * 32;
  constexpr int kRedSlot = W * NT * 8 * kTileRows;   // floats per partial-sum slot

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, c = lane & 3;
  const int m = a.m;
  const int k_atoms = a.k_pad / kAtomK;
  const int split = blockIdx.y, n_split = gridDim.y;
  const int a0 = split * a.atoms_per_split;                      // first atom of this CTA
  const int na = min(a.atoms_per_split, k_atoms - a0);           // atoms of this CTA
  const int chunk = a.chunk_atoms;
  const int chunks = (na + chunk - 1) / chunk;                   // chunks per tile
  const int stages = a.stages;
  const Geometry geo(m, a.atoms_per_split, chunk, W);
  float* red = reinterpret_cast<float*>(smem + geo.x_bytes);
  const uint32_t ring = smem_addr(smem) + uint32_t(geo.x_bytes + geo.red_bytes);
  const uint32_t full = ring + uint32_t(stages * geo.stage_bytes), empty = full + 8 * stages;

  const int n_tiles = a.n_pad / kTileRows;
  const int my_tiles = (n_tiles - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x);
  const int items = my_tiles * chunks;

  if (tid == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, W);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }

  // 1. Activations of the CTA's K range, in fragment order (16-byte chunk q of a row: K 8q .. 8q+7 =
  // atom q/8, j = (q%8)/2, h = q%2, the 4 words c = 0..3 go to the 4 lanes c). Zero past K.
  {
    const uint16_t* xsrc = static_cast<const uint16_t*>(a.x) + int64_t(a0) * kAtomK;
    const int pieces = na * 8;
    uint32_t* xw = reinterpret_cast<uint32_t*>(smem);
    for (int p = tid; p < m * pieces; p += (W + 1) * 32) {
      const int row = p / pieces, q = p - row * pieces;
      const int atom = q >> 3;
      uint4 v = make_uint4(0, 0, 0, 0);
      if ((a0 + atom) * kAtomK + (q & 7) * 8 < a.k)
        v = *reinterpret_cast<const uint4*>(xsrc + int64_t(row) * a.stride_xm + q * 8);
      uint32_t* dst = xw + ((atom * m + row) * 4) * 8 + (q & 7);
      dst[0] = v.x;
      dst[8] = v.y;
      dst[16] = v.z;
      dst[24] = v.w;
    }
  }
  __syncthreads();   // activations staged, barriers initialized

  if (warp == W) {
    // 2a. Producer: chunk `it` (tile it / chunks, chunk it % chunks) into stage it % stages, once the W
    // consumer warps have released the stage's previous chunk.
    if (lane == 0) {
      for (int it = 0; it < items; ++it) {
        const int s = it % stages;
        if (it >= stages) mbar_wait(empty + 8 * s, ((it / stages) - 1) & 1);
        const int i = it / chunks, q = it - i * chunks;
        const int cnt = min(chunk, na - q * chunk);
        const uint32_t wb = uint32_t(cnt) * 64, sb = uint32_t(round_up(int64_t(cnt) * 8, 16));
        const uint32_t st = ring + uint32_t(s * geo.stage_bytes), bar = full + 8 * s;
        mbar_expect_tx(bar, 8 * (wb + sb));
        const int64_t pair_row = int64_t(blockIdx.x + i * gridDim.x) * 8;
        const int64_t at = a0 + q * chunk;
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          bulk_copy(st + uint32_t(r * geo.word_row), a.words + (pair_row + r) * a.stride_wn + at * 16, wb, bar);
          bulk_copy(st + uint32_t(8 * geo.word_row + r * geo.scale_row), a.scales + (pair_row + r) * a.stride_sn + at * 4,
                    sb, bar);
        }
      }
    }
    return;
  }

  // 2b. Consumers. Lane addresses: token row min(8nt + g, m - 1) of each atom (rows past M repeat row
  // M-1: their output columns are never stored).
  const uint32_t xs_base = smem_addr(smem);
  uint32_t xs_lane[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) xs_lane[nt] = xs_base + (min(nt * 8 + g, m - 1) * 4 + c) * 32;
  const uint32_t x_atom_stride = m * kAtomBytes;
  const int cw = (chunk + W - 1) / W;                            // atoms per warp per chunk

  // Epilogue: thread tid sums partial (tid % W) of output (tid / W) (+ 2 tokens per further pass); its
  // output row (tid / W) % 16 is fixed, so its alpha and bias are read a tile ahead.
  const float act_scale = a.act_scale != nullptr ? a.act_scale[0] : 1.f;
  const int ep_row = (tid / W) % kTileRows, ep_part = tid % W;
  RowEpilogue ep;
  if (n_split == 1) ep = fetch_epilogue<DT>(a, int(blockIdx.x) * kTileRows + ep_row);

  // Two accumulators per token tile (even / odd K steps): two independent mma chains.
  float acc[2][NT][4];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[h][nt][0] = acc[h][nt][1] = acc[h][nt][2] = acc[h][nt][3] = 0.f;

  for (int it = 0; it < items; ++it) {
    const int s = it % stages;
    const int i = it / chunks, q = it - i * chunks;
    const uint32_t st = ring + uint32_t(s * geo.stage_bytes);
    const int lo = warp * cw, hi = min(min(chunk, na - q * chunk), lo + cw);   // chunk-relative atoms
    const uint32_t wl = st + uint32_t(g * geo.word_row) + 16 * c;                // + 64 per atom
    const uint32_t sl = st + uint32_t(8 * geo.word_row + g * geo.scale_row);     // + 8 per atom
    mbar_wait(full + 8 * s, (it / stages) & 1);
#pragma unroll 2
    for (int at = lo; at < hi; ++at) {
      const uint4 wv = lds16(wl + 64 * at);
      const uint2 sv = lds8(sl + 8 * at);
      uint32_t xb[NT][8];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint32_t ad = xs_lane[nt] + (q * chunk + at) * x_atom_stride;
        const uint4 x0 = lds16(ad), x1 = lds16(ad + 16);
        xb[nt][0] = x0.x; xb[nt][1] = x0.y; xb[nt][2] = x0.z; xb[nt][3] = x0.w;
        xb[nt][4] = x1.x; xb[nt][5] = x1.y; xb[nt][6] = x1.z; xb[nt][7] = x1.w;
      }
      const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {   // scale pairs j = 0,1 in sv.x, 2,3 in sv.y
        const uint32_t h = expand_scales<DT>(j < 2 ? sv.x : sv.y, (j & 1) ? 0x4342u : 0x4140u);
        uint32_t af[4];
        decode<DT>(words[j], h, af);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma<DT>(acc[j & 1][nt], af, xb[nt][2 * j], xb[nt][2 * j + 1]);
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + 8 * s);   // this warp's reads of the stage are done
    if (q != chunks - 1) continue;

    // End of tile i: the warps' partials to shared memory, then a fixed-order sum: W lanes per output,
    // a shuffle tree over them.
    float* r = red + (i & 1) * kRedSlot;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = nt * 8 + 2 * c + (e & 1), row = g + (e >> 1) * 8;
        r[(warp * NT * 8 + tok) * kTileRows + row] = __fadd_rn(acc[0][nt][e], acc[1][nt][e]);
        acc[0][nt][e] = acc[1][nt][e] = 0.f;
      }
    }
    consumers_sync(kConsumers);
    const int n = (int(blockIdx.x) + i * int(gridDim.x)) * kTileRows + ep_row;
    for (int v = tid; v < kTileRows * m * W; v += kConsumers) {   // whole warps (16 W m is a multiple of 32)
      const int tok = v / (W * kTileRows);
      float sum = r[(ep_part * NT * 8 + tok) * kTileRows + ep_row];
#pragma unroll
      for (int o = 1; o < W; o <<= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, o));
      if (ep_part != 0) continue;
      if (n_split > 1) {
        a.workspace[(int64_t(split) * m + tok) * a.n_pad + n] = sum;   // combined after the tile loop
      } else if (n < a.n) {
        store_out<DT>(a, n, tok, sum, ep, act_scale);
      }
    }
    if (n_split == 1 && i + 1 < my_tiles) ep = fetch_epilogue<DT>(a, n + int(gridDim.x) * kTileRows);
  }
  if (n_split == 1) return;

  // 3. K split: every partial of this CTA is written; one fence, then one counter increment per tile (all
  // in flight together). The last CTA of a tile sums the partials in split order, stores y and resets
  // the counter. The flags reuse the partial-sum slots.
  __threadfence();
  consumers_sync(kConsumers);
  int* last = reinterpret_cast<int*>(red);
  const int cap = 2 * kRedSlot;
  const int row = tid % kTileRows;
  for (int base = 0; base < my_tiles; base += cap) {
    const int cnt = min(cap, my_tiles - base);
    for (int t = tid; t < cnt; t += kConsumers) {
      const int tile = blockIdx.x + (base + t) * gridDim.x;
      last[t] = atomicAdd(&a.counters[tile], 1) == n_split - 1;
    }
    consumers_sync(kConsumers);
    __threadfence();
    for (int t = 0; t < cnt; ++t) {
      if (!last[t]) continue;
      const int tile = blockIdx.x + (base + t) * gridDim.x;
      const int n = tile * kTileRows + row;
      if (n < a.n) {
        const RowEpilogue e = fetch_epilogue<DT>(a, n);
        for (int tok = tid / kTileRows; tok < m; tok += kConsumers / kTileRows) {
          float sum = 0.f;
          for (int sp = 0; sp < n_split; ++sp)
            sum = __fadd_rn(sum, __ldcg(a.workspace + (int64_t(sp) * m + tok) * a.n_pad + n));
          store_out<DT>(a, n, tok, sum, e, act_scale);
        }
      }
      if (tid == 0) a.counters[tile] = 0;
    }
    consumers_sync(kConsumers);
  }
}

template <int DT, int NT, int W>
cudaError_t launch_one(const W4DecodeArgs& a, cudaStream_t stream) {
  const int64_t bytes = Geometry(a.m, a.atoms_per_split, a.chunk_atoms, W).bytes(a.stages);
  if (bytes > kMaxSmemBytes) return cudaErrorInvalidValue;
  auto* kernel = w4_decode_kernel<DT, NT, W>;
  if (bytes > 48 * 1024) {
    // above the default dynamic shared-memory limit: opt in (host-side attribute, no synchronization)
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    if (e != cudaSuccess) return e;
  }
  const int n_tiles = a.n_pad / kTileRows;
  const int split = (a.k_pad / kAtomK + a.atoms_per_split - 1) / a.atoms_per_split;
  int ctas = a.ctas;
  if (ctas <= 0) {
    int dev = 0, sms = 0, per_sm = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (e == cudaSuccess)
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, (W + 1) * 32, size_t(bytes));
    if (e != cudaSuccess) return e;
    ctas = (sms * (per_sm > 0 ? per_sm : 1) + split - 1) / split;
  }
  const dim3 grid(ctas < n_tiles ? ctas : n_tiles, split);
  kernel<<<grid, (W + 1) * 32, bytes, stream>>>(a);
  return cudaGetLastError();
}

template <int DT, int NT>
cudaError_t launch_warps(const W4DecodeArgs& a, cudaStream_t stream) {
  if (a.warps == 4) return launch_one<DT, NT, 4>(a, stream);
  if (a.warps == 8) return launch_one<DT, NT, 8>(a, stream);
  if (a.warps == 16) return launch_one<DT, NT, 16>(a, stream);
  return cudaErrorInvalidValue;
}

template <int DT>
cudaError_t launch_dt(const W4DecodeArgs& a, cudaStream_t stream) {
  return a.m <= 8 ? launch_warps<DT, 1>(a, stream) : launch_warps<DT, 2>(a, stream);
}

}  // namespace

int64_t w4_decode_smem_bytes(int m, int atoms_per_split, int chunk_atoms, int warps, int stages) {
  return Geometry(m, atoms_per_split, chunk_atoms, warps).bytes(stages);
}

cudaError_t w4_decode_gemm(const W4DecodeArgs& a, cudaStream_t stream) {
  if (a.m < 1 || a.m > kMaxDecodeM || a.n < 1 || a.k < 16 || a.k % 16 || a.n_pad % kTileRows || a.n_pad < a.n ||
      a.k_pad % kAtomK || a.k_pad < a.k || a.atoms_per_split < 2 || a.atoms_per_split % 2 || a.stride_xm % 8 ||
      reinterpret_cast<uintptr_t>(a.x) % 16 || (a.act_dtype != 0 && a.act_dtype != 1) || a.ctas < 0 ||
      a.stages < 1 || a.stages > kMaxStages || a.chunk_atoms < 2 || a.chunk_atoms % 2 || a.stride_wn % 4 ||
      a.stride_sn % 8 ||
      reinterpret_cast<uintptr_t>(a.words) % 16 || reinterpret_cast<uintptr_t>(a.scales) % 16)
    return cudaErrorInvalidValue;
  const int split = (a.k_pad / kAtomK + a.atoms_per_split - 1) / a.atoms_per_split;
  if (split > 1 && (a.workspace == nullptr || a.counters == nullptr)) return cudaErrorInvalidValue;
  if (split > 65535) return cudaErrorInvalidValue;
  return a.act_dtype == 0 ? launch_dt<0>(a, stream) : launch_dt<1>(a, stream);
}

}  // namespace nvq::gemm
