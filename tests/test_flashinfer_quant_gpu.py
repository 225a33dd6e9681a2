"""On a Blackwell GPU: FlashInfer's ``fp4_quantize`` against our ``scaled_fp4_quant``, byte for byte, on the layout
our Blackwell backend hands to ``mm_fp4`` (E2M1 codes ``[M, K/2]``, E4M3 block scales in the 128x4-swizzled layout,
encode-convention global scale). Needs flashinfer-python on the path (the vLLM bundle carries 0.6.14, the SGLang
bundle 0.6.15.post1; its JIT build needs nvcc).

Not on Hopper: FlashInfer's quantization kernels (``nv_internal/tensorrt_llm/kernels/quantization*.cuh``) compile
their bodies only for ``__CUDA_ARCH__ >= 1000`` (the E2M1 conversion is ``cvt.rn.satfinite.e2m1x2``). On the H200
(2026-11-27, flashinfer 0.6.15.post1) ``fp4_quantize`` built and returned, but its outputs were never written
(code bytes of the input's bf16 pattern, 9444 of 9472 bytes different at 37x512), so there is nothing to compare
below sm_100: the byte contract is checked on the CPU against the emulation of FlashInfer's documented layout
(tests/test_flashinfer_backend.py)."""

import pytest
import torch

from nvfp4_plugin import numerics as nx
from nvfp4_plugin import ops

pytestmark = pytest.mark.gpu

SHAPES = [(1, 64), (37, 512), (128, 4096), (300, 7168), (1000, 2048)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_fp4_quantize_equals_ours(dtype):
    fi = pytest.importorskip("flashinfer")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    if torch.cuda.get_device_capability() < (10, 0):
        pytest.skip("FlashInfer's fp4_quantize computes nothing below sm_100 (its kernel bodies are sm_100+ only)")
    g = torch.Generator(device="cuda").manual_seed(0)
    report = []
    for m, k in SHAPES:
        for scale in (1.0, 1e-3, 300.0):
            x = (torch.randn(m, k, device="cuda", generator=g) * scale).to(dtype)
            x[0, :16] = 0
            gs = nx.tensor_global_scale(x.float()).reshape(1)
            q_fi, s_fi = fi.fp4_quantize(x, gs, 16, False, True)
            q, s = ops.scaled_fp4_quant(x, gs, swizzle=True)
            q_fi = q_fi.view(torch.uint8).reshape(q.shape)
            s_fi = s_fi.view(torch.uint8).reshape(-1)[: s.numel()].reshape(s.shape)
            dq = int((q_fi != q).sum())
            ds = int((s_fi != s.view(torch.uint8)).sum())
            report.append(f"{m}x{k} scale {scale}: {dq} of {q.numel()} code bytes, {ds} of {s.numel()} scale bytes differ")
    print("\n".join(report))
    assert all(" 0 of " in r.split(":")[1].split(",")[0] and ", 0 of " in r for r in report), "\n".join(report)
