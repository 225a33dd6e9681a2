// Host entry point of the CUDA FP4-weight GEMM for few tokens (decode): raw pointers, sizes and a
// stream, no framework types (csrc/bindings.cpp validates the torch tensors and calls it).
//
// The weight is nvfp4_plugin.gemm.layout's HopperW4Layout ("hopper_w4_swapab_v1"): the same bytes the
// Triton kernels read, so one packed copy serves both. y[m, n] = (sum_k x[m, k] * w[n, k]) * alpha[n]
// (* act_scale[0]) (+ bias[n]), w = e2m1 * s * 2**-8 decoded exactly, products exact, fp32 accumulation,
// rounded once to the activation dtype.
//
// Asynchronous, allocation-free, no host synchronization: CUDA-graph capturable.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace nvq::gemm {

// Bias element type (kNone: no bias).
enum class BiasType : int { kNone = 0, kAct = 1, kF32 = 2 };

struct W4DecodeArgs {
  int act_dtype;               // 0 bf16, 1 fp16 (the dtype the weight was packed for)
  const void* x;               // [m, k] activations, row stride stride_xm elements (a multiple of 8), 16-byte aligned
  int64_t stride_xm;
  const int32_t* words;        // [n_pad/2, k_pad/4] int32 (one expert), row stride stride_wn int32s
  int64_t stride_wn;
  const uint16_t* scales;      // [n_pad/2, scale_cols] re-encoded scale pairs, row stride stride_sn
  int64_t stride_sn;
  const float* alpha;          // [n_pad] fp32: 2**8 / global_scale per output row
  const float* act_scale;      // nullptr, or [1] fp32 multiplier (w4a4: 1 / activation encode scale)
  const void* bias;            // nullptr, or [n] of bias_type
  BiasType bias_type;
  void* y;                     // [m, n] output, row stride stride_ym elements
  int64_t stride_ym;
  float* workspace;            // K split > 1: fp32 [split, m, n_pad]
  int32_t* counters;           // K split > 1: int32 [n_pad/16], zero between calls (reset by the kernel)
  int m;                       // 1 .. kMaxDecodeM
  int n, k, n_pad, k_pad;
  int atoms_per_split;         // 64-wide K atoms per CTA (even); K split = ceil((k_pad/64) / atoms_per_split)
  int warps;                   // consumer warps per CTA, each decoding its share of every chunk: 4, 8 or 16
  int chunk_atoms;             // 64-wide K atoms per ring stage (even; a tile's K range is 1+ chunks)
  int stages;                  // chunks in flight per CTA (bulk-copy ring): 1 .. 8, within shared memory
  int ctas;                    // CTAs along N (each loops over 16-row tiles); 0: as many as are resident at once
};

constexpr int kMaxDecodeM = 16;

// Dynamic shared memory of one CTA: the activations of its K range in mma fragment order, the per-warp
// partial sums of two 16-row tiles, and the weight ring (`stages` chunks of 16 rows x `chunk_atoms`
// atoms, two mbarriers each). At most 227 KB (kMaxDecodeSmem).
int64_t w4_decode_smem_bytes(int m, int atoms_per_split, int chunk_atoms, int warps, int stages);

constexpr int64_t kMaxDecodeSmem = 227 * 1024;

// Launches the kernel. cudaErrorInvalidValue for unsupported arguments.
cudaError_t w4_decode_gemm(const W4DecodeArgs& args, cudaStream_t stream);

}  // namespace nvq::gemm
