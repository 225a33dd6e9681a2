// The only file of csrc/ that sees torch: registers the quantization kernels as torch ops
// (namespace nvfp4_plugin) and gives the module nvfp4_plugin._C its BUILT_ARCHS attribute.
//
// Ops write into outputs the Python wrappers (nvfp4_plugin/_cuda_ops.py) allocate and validate;
// here only cheap shape/dtype/device checks guard the memory the kernels touch. Fake (meta)
// implementations for torch.compile are registered from Python (the ops return nothing).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <sstream>
#include <string>
#include <vector>

#include "quant/launch.h"

// setup.py passes -DNVFP4_BUILT_ARCHS=sm_90a+sm_100a+... (tokens, shell- and nvcc-safe).
#define NVQ_STR2(x) #x
#define NVQ_STR(x) NVQ_STR2(x)
#ifdef NVFP4_BUILT_ARCHS
#define NVQ_BUILT_ARCHS NVQ_STR(NVFP4_BUILT_ARCHS)
#else
#define NVQ_BUILT_ARCHS ""
#endif

namespace {

nvq::ActDType act_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kBFloat16:
      return nvq::ActDType::kBF16;
    case at::kHalf:
      return nvq::ActDType::kF16;
    case at::kFloat:
      return nvq::ActDType::kF32;
    default:
      TORCH_CHECK(false, name, ": expected dtype bfloat16, float16 or float32, got ", t.scalar_type());
  }
}

void expect(const at::Tensor& t, const char* name, const at::Tensor& like, c10::optional<at::ScalarType> dtype = {},
            bool contiguous = true) {
  TORCH_CHECK(t.device() == like.device(), name, ": expected device ", like.device(), ", got ", t.device());
  if (dtype) TORCH_CHECK(t.scalar_type() == *dtype, name, ": expected dtype ", *dtype, ", got ", t.scalar_type());
  if (contiguous) TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

void expect_numel(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.numel() == n, name, ": expected ", n, " elements, got ", t.numel());
}

void check(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "nvfp4_plugin.", op, ": ", cudaGetErrorString(err));
}

// SM count per device, queried once (no synchronization, safe during graph capture).
int num_sms(const at::Tensor& t) {
  static std::array<std::atomic<int>, 64> cache{};
  const int dev = t.get_device();
  if (dev < 0 || dev >= int(cache.size())) return 132;
  int n = cache[dev].load(std::memory_order_relaxed);
  if (n == 0) {
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) n = 132;
    cache[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

uint8_t* u8(at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

void scaled_fp4_quant(const at::Tensor& input, const at::Tensor& global_scale, at::Tensor& output,
                      at::Tensor& output_scale, bool swizzle, bool ue8m0) {
  TORCH_CHECK(input.is_cuda() && input.dim() == 2, "input: expected a 2-D CUDA tensor");
  expect(input, "input", input);
  expect(global_scale, "global_scale", input, at::kFloat);
  expect_numel(global_scale, "global_scale", 1);
  const int64_t m = input.size(0), k = input.size(1);
  TORCH_CHECK(k % 16 == 0, "input: last dim must be a multiple of 16, got ", k);
  expect(output, "output", input);
  expect_numel(output, "output", m * k / 2);
  expect(output_scale, "output_scale", input);
  const int64_t kb = k / 16;
  expect_numel(output_scale, "output_scale", swizzle ? (m + 127) / 128 * 128 * ((kb + 3) / 4 * 4) : m * kb);
  const c10::cuda::CUDAGuard guard(input.device());
  check(nvq::nvfp4_quant(act_dtype(input, "input"), input.data_ptr(), global_scale.data_ptr<float>(), u8(output),
                         u8(output_scale), m, k, swizzle, ue8m0, num_sms(input),
                         current_stream()),
        "scaled_fp4_quant");
}

void scaled_fp4_experts_quant(const at::Tensor& input, const at::Tensor& global_scale,
                              const at::Tensor& expert_offsets, const at::Tensor& blockscale_offsets,
                              at::Tensor& output, at::Tensor& output_scale) {
  TORCH_CHECK(input.is_cuda() && input.dim() == 2, "input: expected a 2-D CUDA tensor");
  expect(input, "input", input);
  const int64_t m = input.size(0), k = input.size(1), e = global_scale.numel();
  TORCH_CHECK(k % 16 == 0, "input: last dim must be a multiple of 16, got ", k);
  expect(global_scale, "global_scale", input, at::kFloat);
  expect(expert_offsets, "expert_offsets", input, at::kInt);
  expect(blockscale_offsets, "blockscale_offsets", input, at::kInt);
  expect_numel(expert_offsets, "expert_offsets", e + 1);
  expect_numel(blockscale_offsets, "blockscale_offsets", e + 1);
  expect(output, "output", input);
  expect_numel(output, "output", m * k / 2);
  expect(output_scale, "output_scale", input);
  const int64_t kb_pad = (k / 16 + 3) / 4 * 4;
  TORCH_CHECK(output_scale.numel() % kb_pad == 0, "output_scale: expected rows of ", kb_pad, " bytes");
  const int64_t rows = output_scale.numel() / kb_pad;
  const c10::cuda::CUDAGuard guard(input.device());
  check(nvq::nvfp4_quant_experts(act_dtype(input, "input"), input.data_ptr(), global_scale.data_ptr<float>(),
                                 expert_offsets.data_ptr<int32_t>(), blockscale_offsets.data_ptr<int32_t>(),
                                 u8(output), u8(output_scale), m, k, int(e), rows, num_sms(input),
                                 current_stream()),
        "scaled_fp4_experts_quant");
}

void silu_and_mul_scaled_fp4_experts_quant(const at::Tensor& input, const at::Tensor& global_scale,
                                           const at::Tensor& mask, bool use_silu_and_mul, bool zero_fill,
                                           at::Tensor& output, at::Tensor& output_scale) {
  TORCH_CHECK(input.is_cuda() && input.dim() == 3, "input: expected a 3-D CUDA tensor");
  expect(input, "input", input);
  const int64_t e = input.size(0), max_m = input.size(1), width = input.size(2);
  const int64_t k = use_silu_and_mul ? width / 2 : width;
  TORCH_CHECK(k % 16 == 0 && (!use_silu_and_mul || width % 2 == 0), "input: bad last dim ", width);
  expect(global_scale, "global_scale", input, at::kFloat);
  expect_numel(global_scale, "global_scale", e);
  expect(mask, "mask", input, at::kInt);
  expect_numel(mask, "mask", e);
  expect(output, "output", input, at::kByte);
  expect_numel(output, "output", e * max_m * k / 2);
  expect(output_scale, "output_scale", input);
  expect_numel(output_scale, "output_scale", e * ((max_m + 127) / 128 * 128) * ((k / 16 + 3) / 4 * 4));
  const c10::cuda::CUDAGuard guard(input.device());
  check(nvq::nvfp4_quant_masked(act_dtype(input, "input"), input.data_ptr(), global_scale.data_ptr<float>(),
                                mask.data_ptr<int32_t>(), u8(output), u8(output_scale), int(e), max_m, k,
                                use_silu_and_mul, zero_fill, num_sms(input), current_stream()),
        "silu_and_mul_scaled_fp4_experts_quant");
}

void silu_and_mul(const at::Tensor& input, at::Tensor& output, int64_t table) {
  TORCH_CHECK(input.is_cuda() && input.dim() >= 1, "input: expected a CUDA tensor");
  expect(input, "input", input);
  const int64_t width = input.size(-1);
  TORCH_CHECK(width % 2 == 0, "input: last dim must be even, got ", width);
  expect(output, "output", input, input.scalar_type());
  expect_numel(output, "output", input.numel() / 2);
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t rows = width ? input.numel() / width : 0;
  check(nvq::silu_and_mul(act_dtype(input, "input"), input.data_ptr(), output.data_ptr(), rows, width / 2,
                          table < 0 ? -1 : (table > 0 ? 1 : 0), num_sms(input), current_stream()),
        "silu_and_mul");
}

void scaled_fp8_quant_static(const at::Tensor& input, const at::Tensor& scale, at::Tensor& output) {
  TORCH_CHECK(input.is_cuda(), "input: expected a CUDA tensor");
  expect(input, "input", input);
  expect(scale, "scale", input, at::kFloat);
  expect_numel(scale, "scale", 1);
  expect(output, "output", input);
  expect_numel(output, "output", input.numel());
  const c10::cuda::CUDAGuard guard(input.device());
  check(nvq::fp8_quant_static(act_dtype(input, "input"), input.data_ptr(), scale.data_ptr<float>(), u8(output),
                              input.numel(), num_sms(input), current_stream()),
        "scaled_fp8_quant");
}

void scaled_fp8_quant_dynamic(const at::Tensor& input, at::Tensor& output, at::Tensor& scale) {
  TORCH_CHECK(input.is_cuda(), "input: expected a CUDA tensor");
  expect(input, "input", input);
  expect(scale, "scale", input, at::kFloat);
  expect_numel(scale, "scale", 1);
  expect(output, "output", input);
  expect_numel(output, "output", input.numel());
  const c10::cuda::CUDAGuard guard(input.device());
  check(nvq::fp8_quant_dynamic(act_dtype(input, "input"), input.data_ptr(), scale.data_ptr<float>(), u8(output),
                               input.numel(), num_sms(input), current_stream()),
        "scaled_fp8_quant");
}

void per_token_quant_fp8(const at::Tensor& input, at::Tensor& output, at::Tensor& scale) {
  TORCH_CHECK(input.is_cuda() && input.dim() == 2, "input: expected a 2-D CUDA tensor");
  expect(input, "input", input);
  expect(output, "output", input);
  expect_numel(output, "output", input.numel());
  expect(scale, "scale", input, at::kFloat);
  expect_numel(scale, "scale", input.size(0));
  const c10::cuda::CUDAGuard guard(input.device());
  check(nvq::fp8_quant_per_token(act_dtype(input, "input"), input.data_ptr(), scale.data_ptr<float>(), u8(output),
                                 input.size(0), input.size(1), num_sms(input), current_stream()),
        "per_token_quant_fp8");
}

void per_token_group_quant_fp8(const at::Tensor& input, at::Tensor& output, at::Tensor& scale, int64_t group_size,
                               double eps, bool column_major, bool ue8m0) {
  TORCH_CHECK(input.is_cuda() && input.dim() == 2, "input: expected a 2-D CUDA tensor");
  expect(input, "input", input);
  expect(output, "output", input);
  expect_numel(output, "output", input.numel());
  // the kernel reads and writes whole 16-value units (16-byte vectors)
  TORCH_CHECK(reinterpret_cast<uintptr_t>(input.data_ptr()) % 16 == 0, "input: expected a 16-byte aligned start");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(output.data_ptr()) % 16 == 0, "output: expected a 16-byte aligned start");
  const int64_t m = input.size(0), k = input.size(1);
  TORCH_CHECK(group_size > 0 && k % group_size == 0, "group_size: must divide ", k);
  const int64_t groups = k / group_size;
  nvq::GroupScaleLayout layout = nvq::GroupScaleLayout::kRowMajorF32;
  int64_t stride = 0;
  expect(scale, "scale", input, ue8m0 ? at::kInt : at::kFloat, /*contiguous=*/!column_major);
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == m, "scale: expected ", m, " rows");
  if (m == 0) return;  // nothing to write; empty tensors carry no meaningful strides
  if (column_major) {
    stride = scale.stride(1);
    TORCH_CHECK(scale.stride(0) == 1 && stride >= m && stride % 4 == 0 && scale.storage_offset() == 0,
                "scale: expected column-major storage with M padded to 4");
    const int64_t cols = ue8m0 ? (groups + 3) / 4 : groups;
    TORCH_CHECK(scale.size(1) == cols, "scale: expected ", cols, " columns, got ", scale.size(1));
    TORCH_CHECK(scale.storage().nbytes() >= size_t(cols * stride * 4), "scale: storage too small");
    layout = ue8m0 ? nvq::GroupScaleLayout::kColMajorUE8M0 : nvq::GroupScaleLayout::kColMajorF32;
  } else {
    TORCH_CHECK(!ue8m0, "scale_ue8m0 needs column-major scales");
    TORCH_CHECK(scale.size(1) == groups, "scale: expected ", groups, " columns, got ", scale.size(1));
  }
  const c10::cuda::CUDAGuard guard(input.device());
  check(nvq::fp8_quant_per_token_group(act_dtype(input, "input"), input.data_ptr(), scale.data_ptr(), u8(output), m,
                                       k, int(group_size), float(eps), layout, stride, num_sms(input),
                                       current_stream()),
        "per_token_group_quant_fp8");
}

std::vector<std::string> built_archs() {
  std::vector<std::string> out;
  std::stringstream ss(NVQ_BUILT_ARCHS);
  std::string item;
  while (std::getline(ss, item, '+')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nvfp4_plugin, m) {
  m.def("scaled_fp4_quant(Tensor input, Tensor global_scale, Tensor(a!) output, Tensor(b!) output_scale, "
        "bool swizzle, bool ue8m0) -> ()");
  m.def("scaled_fp4_experts_quant(Tensor input, Tensor global_scale, Tensor expert_offsets, "
        "Tensor blockscale_offsets, Tensor(a!) output, Tensor(b!) output_scale) -> ()");
  m.def("silu_and_mul_scaled_fp4_experts_quant(Tensor input, Tensor global_scale, Tensor mask, "
        "bool use_silu_and_mul, bool zero_fill, Tensor(a!) output, Tensor(b!) output_scale) -> ()");
  m.def("silu_and_mul(Tensor input, Tensor(a!) output, int table=-1) -> ()");
  m.def("scaled_fp8_quant_static(Tensor input, Tensor scale, Tensor(a!) output) -> ()");
  m.def("scaled_fp8_quant_dynamic(Tensor input, Tensor(a!) output, Tensor(b!) scale) -> ()");
  m.def("per_token_quant_fp8(Tensor input, Tensor(a!) output, Tensor(b!) scale) -> ()");
  m.def("per_token_group_quant_fp8(Tensor input, Tensor(a!) output, Tensor(b!) scale, int group_size, float eps, "
        "bool column_major, bool ue8m0) -> ()");
}

TORCH_LIBRARY_IMPL(nvfp4_plugin, CUDA, m) {
  m.impl("scaled_fp4_quant", &scaled_fp4_quant);
  m.impl("scaled_fp4_experts_quant", &scaled_fp4_experts_quant);
  m.impl("silu_and_mul_scaled_fp4_experts_quant", &silu_and_mul_scaled_fp4_experts_quant);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("scaled_fp8_quant_static", &scaled_fp8_quant_static);
  m.impl("scaled_fp8_quant_dynamic", &scaled_fp8_quant_dynamic);
  m.impl("per_token_quant_fp8", &per_token_quant_fp8);
  m.impl("per_token_group_quant_fp8", &per_token_group_quant_fp8);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  pybind11::tuple archs(built_archs().size());
  size_t i = 0;
  for (const auto& a : built_archs()) archs[i++] = pybind11::str(a);
  mod.attr("BUILT_ARCHS") = archs;
  mod.attr("__doc__") = "nvfp4-plugin CUDA quantization kernels (torch ops under torch.ops.nvfp4_plugin)";
}
