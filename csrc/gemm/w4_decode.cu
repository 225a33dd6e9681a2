// CUDA FP4-weight GEMM for 1..16 tokens (decode): weight streaming with mma.sync.
//
// Why CUDA here (nvfp4_plugin/gemm/NOTES.md): the Triton decode kernels reach about half of DRAM
// bandwidth on the H200, with few bytes in flight per warp. This kernel runs a `stages`-deep cp.async
// ring of 64-wide K steps per CTA (each step: 3 KB of weights and scales, 1-2 KB of activations), so an
// SM keeps well over 100 KB in flight, and spends its issue slots on decode and mma only.
//
// Layout (HopperW4Layout, shared with the Triton kernels; see nvfp4_plugin/gemm/layout.py):
// a CTA of 4 warps owns one 64-row atom; warp w owns rows 16w .. 16w+15, and thread (g = lane/4,
// c = lane%4) copies, per 64-wide K step, the 16-byte word vector of row pair (16w+g, 16w+g+8) at
// K offsets 16j + {2c, 2c+1, 2c+8, 2c+9}, j = 0..3: exactly the A fragments of four m16n8k16 mma.sync,
// and the 8 bytes of its row pair's four scale pairs. Each thread reads back only what it copied.
// The activation tile of the step (8 or 16 token rows x 64 K, zero rows past M) is copied by the CTA
// into a padded shared tile and read as mma B fragments with ldmatrix, so one barrier per step guards
// the ring.
//
// Decode (BIT_PLANS of layout.py): four bf16x2 (fp16x2) registers from one word with shifts and
// masks, times the expanded block scale (exact: e2m1 * s * 2**-8 has <= 6 significant bits), so the
// tensor core forms exact products accumulated in fp32. One PRMT + one integer op expand the scale
// pair of rows (g, g+8) into one register; the multiplies pick its halves. The epilogue multiplies by
// alpha[n] (and the activation scale), adds the bias and rounds once.
//
// K splits: CTAs of one atom write fp32 partials; the last to finish (per-atom counter) sums them in
// split order (deterministic), writes y and resets its counter.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "gemm/w4_gemm.h"

namespace nvq::gemm {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kAtomRows = 64;
constexpr int kStepK = 64;
// Dynamic shared memory a CTA may ask for (sm_90 / sm_100: 227 KB, less the static s_last).
constexpr int64_t kMaxSmemBytes = 227 * 1024 - 16;

__device__ __forceinline__ uint32_t rotr(uint32_t x, int r) { return __funnelshift_r(x, x, r); }

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
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

// a * {h.half, h.half}, packed bf16x2 / fp16x2 (HI: the high half). The duplication is meant to fold
// into the multiply's operand select (.H0_H0 / .H1_H1 in SASS).
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
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// Four 8x8 b16 matrices from shared memory: register q of thread (g, c) = row g, columns 2c, 2c+1 of
// matrix q; thread t gives the address of row t%8 of matrix t/8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
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

template <int DT>
__device__ __forceinline__ void store_out(const W4DecodeArgs& a, int n, int tok, float acc) {
  if (n >= a.n || tok >= a.m) return;
  float v = __fmul_rn(acc, a.alpha[n]);
  if (a.act_scale != nullptr) v = __fmul_rn(v, a.act_scale[0]);
  if (a.bias_type != BiasType::kNone) v = __fadd_rn(v, to_float<DT>(a.bias, n, a.bias_type));
  static_cast<uint16_t*>(a.y)[int64_t(tok) * a.stride_ym + n] = round_out<DT>(v);
}

// Shared memory: the ring, STAGES x (weights [SUB][threads] x 16 B, scales [threads] x SUB*8 B), each
// thread's own slots; then the CTA's activations, m rows of its whole K range plus one zero row (row m,
// read for the token rows past M), each row padded by 8 values so the 8 rows an ldmatrix phase reads
// fall on distinct banks.
template <int SUB>
struct Ring {
  static constexpr int kW = SUB * kThreads * 16;
  static constexpr int kS = kThreads * SUB * 8;
  static constexpr int kStage = kW + kS;
};

__host__ __device__ constexpr int x_row_elems(int steps_per_split) { return steps_per_split * kStepK + 8; }

template <int SUB, int STAGES>
__host__ __device__ constexpr int64_t smem_bytes(int m, int steps_per_split) {
  return int64_t(STAGES) * Ring<SUB>::kStage + int64_t(m + 1) * x_row_elems(steps_per_split) * 2;
}

template <int DT, int NT, int SUB, int STAGES>
__global__ void __launch_bounds__(kThreads, 4) w4_decode_kernel(const W4DecodeArgs a) {
  using R = Ring<SUB>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int s_last;

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, c = lane & 3;
  const int atom = blockIdx.x;
  const int split = blockIdx.y;
  const int k_steps = a.k_pad / kStepK;
  const int s0 = split * a.steps_per_split;              // a multiple of SUB (host-checked)
  const int nsteps = min(a.steps_per_split, k_steps - s0);
  const int nmacro = (nsteps + SUB - 1) / SUB;           // the last split's tail is zero-filled
  const int xrow = x_row_elems(a.steps_per_split);
  const uint32_t ring = smem_addr(smem);
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(smem + STAGES * R::kStage);

  // 1. The CTA's activations (K range [64 s0, 64 (s0 + SUB * nmacro)), zero past K: the zero-filled weight
  // tail meets zeros, never stale shared memory) and the zero row.
  const int per_row = nmacro * SUB * (kStepK / 8);   // 16-byte pieces per row
  {
    const uint16_t* xsrc = static_cast<const uint16_t*>(a.x) + int64_t(s0) * kStepK;
    const int x_cols = a.k - s0 * kStepK;
    for (int p = tid; p < a.m * per_row; p += kThreads) {
      const int row = p / per_row, col = (p % per_row) * 8;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(
                       ring + STAGES * R::kStage + (row * xrow + col) * 2),
                   "l"(xsrc + int64_t(row) * a.stride_xm + col), "r"(col < x_cols ? 16 : 0));
    }
    uint4* zero = reinterpret_cast<uint4*>(smem + STAGES * R::kStage + int64_t(a.m) * xrow * 2);
    for (int i = tid; i < per_row; i += kThreads) zero[i] = make_uint4(0, 0, 0, 0);
  }

  // 2. The weight ring: each thread copies (and later reads) only its own slots, so after the one barrier
  // below the loop needs none.
  const int pair_row = atom * (kAtomRows / 2) + warp * 8 + g;   // row pair (n, n+8)
  const int32_t* wsrc = a.words + int64_t(pair_row) * a.stride_wn + 4 * c + int64_t(s0) * 16;
  const uint16_t* ssrc = a.scales + int64_t(pair_row) * a.stride_sn + int64_t(s0) * 4;
  // Copy macro step `q` (SUB 64-wide K steps) into ring slot `slot`; sub-steps past the CTA's range are
  // zero-filled (src-size 0) and add exact zeros.
  auto issue = [&](int slot, int q) {
    const uint32_t st = ring + slot * R::kStage;
#pragma unroll
    for (int u = 0; u < SUB; ++u) {
      const int i = q * SUB + u;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(st + (u * kThreads + tid) * 16),
                   "l"(wsrc + i * 16), "r"(i < nsteps ? 16 : 0));
    }
    if constexpr (SUB == 1) {
      asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(st + R::kW + tid * 8), "l"(ssrc + q * 4));
    } else {
#pragma unroll
      for (int h = 0; h < SUB / 2; ++h)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(st + R::kW + tid * SUB * 8 + h * 16),
                     "l"(ssrc + q * SUB * 4 + h * 8), "r"(q * SUB + 2 * h < nsteps ? 16 : 0));
    }
  };

#pragma unroll
  for (int q = 0; q < STAGES - 1; ++q) {
    if (q < nmacro) issue(q, q);
    cp_commit();   // group 0 also holds the activations
  }
  cp_wait<STAGES - 2>();
  __syncthreads();   // every thread's activation pieces (and the zero row) are visible to all

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;

  // ldmatrix rows: lane t gives row t%8 of matrix t/8 (K 8 (t/8) .. +7 of a 32-wide half step); token
  // rows past M read the zero row
  const uint16_t* xl[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int row = nt * 8 + (lane & 7);
    xl[nt] = xs + (row < a.m ? row : a.m) * xrow + (lane >> 3) * 8;
  }

  // Unrolled by the ring depth so every slot address is a constant offset.
  for (int q0 = 0; q0 < nmacro; q0 += STAGES) {
#pragma unroll
    for (int v = 0; v < STAGES; ++v) {
      const int q = q0 + v;
      if (q >= nmacro) break;
      cp_wait<STAGES - 2>();   // this thread's copies of macro step q landed
      // slot (v - 1) was read by this thread in the previous iteration only: refill it
      if (q + STAGES - 1 < nmacro) issue((v + STAGES - 1) % STAGES, q + STAGES - 1);
      cp_commit();

      const unsigned char* st = smem + v * R::kStage;
      uint32_t sw[SUB * 2];   // scale pair words: step u's pairs j = 0,1 in sw[2u], j = 2,3 in sw[2u+1]
      if constexpr (SUB == 1) {
        const uint2 t = *reinterpret_cast<const uint2*>(st + R::kW + tid * 8);
        sw[0] = t.x; sw[1] = t.y;
      } else {
#pragma unroll
        for (int h = 0; h < SUB / 2; ++h) {
          const uint4 t = *reinterpret_cast<const uint4*>(st + R::kW + tid * SUB * 8 + h * 16);
          sw[4 * h] = t.x; sw[4 * h + 1] = t.y; sw[4 * h + 2] = t.z; sw[4 * h + 3] = t.w;
        }
      }
#pragma unroll
      for (int u = 0; u < SUB; ++u) {
        const uint4 wv = *reinterpret_cast<const uint4*>(st + (u * kThreads + tid) * 16);
        const int kofs = (q * SUB + u) * kStepK;
        uint32_t xb[NT][8];   // B fragments: xb[nt][2j + kh] = token nt*8+g, K 16j + 8kh + 2c of sub-step u
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          uint32_t r[4];
          ldmatrix_x4(r, xl[nt] + kofs);
          xb[nt][0] = r[0]; xb[nt][1] = r[1]; xb[nt][2] = r[2]; xb[nt][3] = r[3];
          ldmatrix_x4(r, xl[nt] + kofs + 32);
          xb[nt][4] = r[0]; xb[nt][5] = r[1]; xb[nt][6] = r[2]; xb[nt][7] = r[3];
        }
        const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          // scale pairs: j even in the low 16 bits, odd in the high 16 bits
          const uint32_t h = expand_scales<DT>(sw[2 * u + (j >> 1)], (j & 1) ? 0x4342u : 0x4140u);
          uint32_t af[4];
          decode<DT>(words[j], h, af);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) mma<DT>(acc[nt], af, xb[nt][2 * j], xb[nt][2 * j + 1]);
        }
      }
    }
  }
  cp_wait<0>();

  // acc[nt][r]: row n = base + (r >= 2 ? 8 : 0), token nt*8 + 2c + (r & 1)
  const int n_base = atom * kAtomRows + warp * 16 + g;
  const int split_k = gridDim.y;
  if (split_k == 1) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) store_out<DT>(a, n_base + (r >> 1) * 8, nt * 8 + 2 * c + (r & 1), acc[nt][r]);
    return;
  }

  float* ws = a.workspace;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int tok = nt * 8 + 2 * c + (r & 1);
      if (tok < a.m) ws[(int64_t(split) * a.m + tok) * a.n_pad + n_base + (r >> 1) * 8] = acc[nt][r];
    }
  __threadfence();
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(&a.counters[atom], 1) == split_k - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int tok = nt * 8 + 2 * c + (r & 1);
      const int n = n_base + (r >> 1) * 8;
      if (tok >= a.m) continue;
      float sum = 0.f;
      for (int s = 0; s < split_k; ++s) sum = __fadd_rn(sum, __ldcg(ws + (int64_t(s) * a.m + tok) * a.n_pad + n));
      store_out<DT>(a, n, tok, sum);
    }
  if (tid == 0) a.counters[atom] = 0;
}

template <int DT, int NT, int SUB, int STAGES>
cudaError_t launch_one(const W4DecodeArgs& a, dim3 grid, cudaStream_t stream) {
  const int64_t bytes = smem_bytes<SUB, STAGES>(a.m, a.steps_per_split);
  if (bytes > kMaxSmemBytes) return cudaErrorInvalidValue;
  auto* kernel = w4_decode_kernel<DT, NT, SUB, STAGES>;
  if (bytes > 48 * 1024) {
    // above the default dynamic shared-memory limit: opt in (host-side attribute, no synchronization)
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    if (e != cudaSuccess) return e;
  }
  kernel<<<grid, kThreads, bytes, stream>>>(a);
  return cudaGetLastError();
}

// (K per ring stage, ring depth) pairs the kernel is compiled for: W4Config.bk / num_stages of the
// Python side (nvfp4_plugin.gemm.select.CUDA_RINGS).
template <int DT, int NT>
cudaError_t launch_ring(const W4DecodeArgs& a, dim3 grid, cudaStream_t stream) {
  const int sub = a.sub_steps;
  if (sub == 1 && a.stages == 4) return launch_one<DT, NT, 1, 4>(a, grid, stream);
  if (sub == 1 && a.stages == 8) return launch_one<DT, NT, 1, 8>(a, grid, stream);
  if (sub == 2 && a.stages == 4) return launch_one<DT, NT, 2, 4>(a, grid, stream);
  if (sub == 4 && a.stages == 2) return launch_one<DT, NT, 4, 2>(a, grid, stream);
  if (sub == 4 && a.stages == 3) return launch_one<DT, NT, 4, 3>(a, grid, stream);
  return cudaErrorInvalidValue;
}

template <int DT>
cudaError_t launch_dt(const W4DecodeArgs& a, dim3 grid, cudaStream_t stream) {
  return a.m <= 8 ? launch_ring<DT, 1>(a, grid, stream) : launch_ring<DT, 2>(a, grid, stream);
}

}  // namespace

cudaError_t w4_decode_gemm(const W4DecodeArgs& a, cudaStream_t stream) {
  if (a.m < 1 || a.m > kMaxDecodeM || a.n < 1 || a.k < 16 || a.k % 16 || a.n_pad % kAtomRows || a.n_pad < a.n ||
      a.k_pad % kStepK || a.k_pad < a.k || a.steps_per_split < 1 || a.sub_steps < 1 ||
      a.steps_per_split % a.sub_steps || a.stride_xm % 8 ||
      reinterpret_cast<uintptr_t>(a.x) % 16 ||
      (a.act_dtype != 0 && a.act_dtype != 1))
    return cudaErrorInvalidValue;
  const int k_steps = a.k_pad / kStepK;
  const int split_k = (k_steps + a.steps_per_split - 1) / a.steps_per_split;
  if (split_k > 1 && (a.workspace == nullptr || a.counters == nullptr)) return cudaErrorInvalidValue;
  if (split_k > 65535) return cudaErrorInvalidValue;
  const dim3 grid(a.n_pad / kAtomRows, split_k);
  return a.act_dtype == 0 ? launch_dt<0>(a, grid, stream) : launch_dt<1>(a, grid, stream);
}

}  // namespace nvq::gemm
