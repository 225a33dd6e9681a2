// Host entry points of the quantization kernels: raw pointers, sizes and a stream, no framework
// types. The torch binding (csrc/bindings.cpp) validates tensors and calls these; each returns the
// launch status (cudaSuccess, or cudaErrorInvalidValue for a shape it does not support).
//
// Every launcher is asynchronous, allocation-free and never synchronizes the host, so all of them
// can be captured in a CUDA graph. Kernels launch with programmatic dependent launch unless
// NVFP4_PLUGIN_PDL=0 (kernel_utils.cuh: pdl_enter, launch_kernel).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace nvq {

// Activation dtype of `input` (bf16, fp16 or fp32).
enum class ActDType : int { kBF16 = 0, kF16 = 1, kF32 = 2 };

// Largest expert count whose offsets / masks are staged in shared memory (larger E: unsupported,
// the Python wrapper falls back to the reference).
constexpr int kMaxExperts = 8192;

// ---- NVFP4 --------------------------------------------------------------------------------------
// input [M, K] (K % 16 == 0), global_scale [1] (encode scale). out uint8 [M, K/2].
// swizzle: scales [round_up(M,128), round_up(K/16,4)] in the 128x4 layout, padding written as zero;
// else [M, K/16] linear. ue8m0: UE8M0 exponent bytes instead of e4m3.
cudaError_t nvfp4_quant(ActDType dt, const void* input, const float* global_scale, uint8_t* out, uint8_t* scales,
                        int64_t m, int64_t k, bool swizzle, bool ue8m0, int num_sms, cudaStream_t stream);

// Rows grouped by expert: rows expert_offsets[e] .. expert_offsets[e+1] use global_scale[e] and write
// their scales (swizzled) at scale row blockscale_offsets[e] + (row - expert_offsets[e]).
// scales has scale_rows = max_blockscale_rows(M, E) rows of round_up(K/16, 4) bytes; every byte
// that no expert row writes is set to zero. Rows at or past expert_offsets[E] quantize to zeros.
// Offsets are int32, non-decreasing, expert_offsets[0] == 0.
cudaError_t nvfp4_quant_experts(ActDType dt, const void* input, const float* global_scale,
                                const int32_t* expert_offsets, const int32_t* blockscale_offsets, uint8_t* out,
                                uint8_t* scales, int64_t m, int64_t k, int num_experts, int64_t scale_rows,
                                int num_sms, cudaStream_t stream);

// Masked layout: input [E, max_m, W] with W = 2K (silu: silu(gate) * up, gate first) or W = K.
// Rows r < clamp(mask[e], 0, max_m) of expert e are quantized with global_scale[e] into
// out [E, max_m, K/2] and scales [E, round_up(max_m,128), round_up(K/16,4)] (swizzled per expert).
// zero_fill: every other byte of out/scales is written as zero; else it is left untouched.
cudaError_t nvfp4_quant_masked(ActDType dt, const void* input, const float* global_scale, const int32_t* mask,
                               uint8_t* out, uint8_t* scales, int num_experts, int64_t max_m, int64_t k,
                               bool silu_and_mul, bool zero_fill, int num_sms, cudaStream_t stream);

// silu(x[..., :I]) * x[..., I:] rounded to the input dtype: input [rows, 2I], out [rows, I]. `table`: the bf16
// SiLU lookup table (I % 16 == 0) when < 0 at sizes that amortize its fill, 0 never, > 0 always (tests, benchmarks).
cudaError_t silu_and_mul(ActDType dt, const void* input, void* out, int64_t rows, int64_t inner, int table,
                         int num_sms, cudaStream_t stream);

// ---- FP8 E4M3 -----------------------------------------------------------------------------------
// Per-tensor with a given decode scale [1]: q = e4m3(x * (1/scale)) (0 where scale == 0).
cudaError_t fp8_quant_static(ActDType dt, const void* input, const float* scale, uint8_t* out, int64_t numel,
                             int num_sms, cudaStream_t stream);

// Per-tensor dynamic: scale[0] = amax / 448 (written here), then q = e4m3(x * (1/scale)).
// Small inputs: one fused single-CTA kernel; larger: memset + amax kernel (atomicMax) + quant kernel.
cudaError_t fp8_quant_dynamic(ActDType dt, const void* input, float* scale, uint8_t* out, int64_t numel,
                              int num_sms, cudaStream_t stream);

// Per-token: scale[m] = amax(row m) / 448, q = e4m3(x * (1/scale)). scale is [M] fp32.
cudaError_t fp8_quant_per_token(ActDType dt, const void* input, float* scale, uint8_t* out, int64_t m, int64_t k,
                                int num_sms, cudaStream_t stream);

// Per-token-group (group_size in {16, 32, 64, 128, 256, 512}), sgl-kernel recipe.
// Scales: fp32 [M, G] row-major (scale_stride ignored), fp32 column-major (element (m, g) at
// g * scale_stride + m, scale_stride = round_up(M, 4)), or UE8M0 bytes packed four per int32 word,
// column-major (byte g % 4 of word (g / 4) * scale_stride + m). Column-major storage padding
// (rows M .. scale_stride, and the unused bytes of the last UE8M0 word) is written as zero.
enum class GroupScaleLayout : int { kRowMajorF32 = 0, kColMajorF32 = 1, kColMajorUE8M0 = 2 };
cudaError_t fp8_quant_per_token_group(ActDType dt, const void* input, void* scales, uint8_t* out, int64_t m,
                                      int64_t k, int group_size, float eps, GroupScaleLayout layout,
                                      int64_t scale_stride, int num_sms, cudaStream_t stream);

}  // namespace nvq
