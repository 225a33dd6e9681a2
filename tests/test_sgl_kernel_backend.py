"""The Blackwell linear backend on sgl-kernel (our scaled_fp4_quant + sgl_kernel.cutlass_scaled_fp4_mm) on the
CPU, against an emulator of that function's contract (tests/emulators/sgl_kernel_fp4_mm.py). No Blackwell GPU
needed."""

import pytest
import torch

from nvfp4_plugin import reference
from nvfp4_plugin.layers import LINEAR_BACKENDS
from nvfp4_plugin.layers import base
from nvfp4_plugin.layers.backends import flashinfer_fp4 as fb
from nvfp4_plugin.layers.backends import sgl_kernel_fp4 as sb
from nvfp4_plugin.layers.base import LinearSpec, choose_backend

from .emulators import sgl_kernel_fp4_mm as emu
from .test_flashinfer_backend import SHARDS, _weight, run_w4a4_case


class _SglKernel:
    cutlass_scaled_fp4_mm = staticmethod(emu.cutlass_scaled_fp4_mm)


@pytest.fixture
def sgl_kernel(monkeypatch):
    monkeypatch.setattr(sb, "sgl_kernel_module", lambda: _SglKernel)
    monkeypatch.setattr(fb, "flashinfer_module", lambda: None)          # FlashInfer absent: sgl-kernel's turn
    monkeypatch.setattr(fb, "flashinfer_w4a16_module", lambda: None)
    monkeypatch.delenv(base.ENV_LINEAR_BACKEND, raising=False)
    emu.calls.clear()
    return _SglKernel


@pytest.mark.parametrize("shards", SHARDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_through_cutlass_scaled_fp4_mm_equals_the_reference(sgl_kernel, shards, dtype):
    w, x2, in_gs = run_w4a4_case(sb.SglKernelLinear(), shards, dtype, lead=(2, 37))
    k = x2.shape[1]
    # one GEMM per run of rows with one global scale, each with its own alpha; runs padded to 32 rows
    runs = fb.row_runs(w.global_scale)
    assert len(emu.calls) == 2 * len(runs) and len(runs) == len(set(w.global_scale.tolist()))
    # bit-exact on what is handed over: our quantizer's bytes, the weight's own codes and scales, zero padding
    q_ref, s_ref = reference.scaled_fp4_quant(x2, in_gs.reshape(1), swizzle=True)
    for call, (a0, a1) in zip(emu.calls, runs):
        assert torch.equal(call["a"], q_ref) and torch.equal(call["block_scale_a"].view(torch.uint8),
                                                              s_ref.view(torch.uint8))
        rows = call["b"].shape[0]
        assert rows % 32 == 0 and rows - (a1 - a0) < 32
        assert torch.equal(call["b"][:a1 - a0], w.packed[a0:a1]) and not call["b"][a1 - a0:].any()
        lin = emu._unswizzle(call["block_scale_b"], rows, k // 16)
        assert torch.equal(lin[:a1 - a0], w.block_scale[a0:a1].view(torch.uint8)) and not lin[a1 - a0:].any()
        assert call["alpha"].item() == pytest.approx(1.0 / (in_gs.item() * w.global_scale[a0].item()), rel=1e-6)
        assert call["out_dtype"] == dtype


def test_no_tokens_launch_nothing(sgl_kernel):
    w = _weight((64,), 256)
    spec = LinearSpec(64, 256, torch.bfloat16, "w4a4", torch.device("cpu"))
    be = sb.SglKernelLinear()
    t, meta = be.prepare(spec, w, torch.tensor(50.0))
    y = be.apply(t, meta, torch.zeros(0, 256, dtype=torch.bfloat16))
    assert y.shape == (0, 64) and not emu.calls


def test_selection_on_blackwell_without_flashinfer(sgl_kernel, monkeypatch):
    spec4 = LinearSpec(4096, 4096, torch.bfloat16, "w4a4", torch.device("cuda"))
    cls, skipped = choose_backend("linear", LINEAR_BACKENDS, spec4, base.ENV_LINEAR_BACKEND, (10, 0))
    assert cls is sb.SglKernelLinear and "not importable" in dict(skipped)["flashinfer_fp4"]
    cls, skipped = choose_backend("linear", LINEAR_BACKENDS, spec4, base.ENV_LINEAR_BACKEND, (10, 3))
    assert cls.name == "reference" and dict(skipped)["sgl_kernel_fp4"] == "runs on sm_100 only, the GPU is sm_103"
    cls, _ = choose_backend("linear", LINEAR_BACKENDS, spec4, base.ENV_LINEAR_BACKEND, (9, 0))
    assert cls.name == "hopper_triton"                                # Hopper unchanged
    cls, skipped = choose_backend("linear", LINEAR_BACKENDS, spec4, base.ENV_LINEAR_BACKEND, (12, 0))
    assert cls.name == "reference" and "runs on sm_100 only" in dict(skipped)["sgl_kernel_fp4"]
    spec16 = LinearSpec(4096, 4096, torch.bfloat16, "w4a16", torch.device("cuda"))
    cls, skipped = choose_backend("linear", LINEAR_BACKENDS, spec16, base.ENV_LINEAR_BACKEND, (10, 0))
    assert cls.name == "reference" and "weight-only checkpoint" in dict(skipped)["sgl_kernel_fp4"]
    odd_k = LinearSpec(4096, 4112, torch.bfloat16, "w4a4", torch.device("cuda"))
    cls, skipped = choose_backend("linear", LINEAR_BACKENDS, odd_k, base.ENV_LINEAR_BACKEND, (10, 0))
    assert cls.name == "reference" and "K % 32" in dict(skipped)["sgl_kernel_fp4"]
    # FlashInfer first where both are installed
    monkeypatch.setattr(fb, "flashinfer_module", lambda: object())
    cls, _ = choose_backend("linear", LINEAR_BACKENDS, spec4, base.ENV_LINEAR_BACKEND, (10, 0))
    assert cls is fb.FlashInferLinear
    monkeypatch.setattr(sb, "sgl_kernel_module", lambda: None)
    monkeypatch.setattr(fb, "flashinfer_module", lambda: None)
    cls, skipped = choose_backend("linear", LINEAR_BACKENDS, spec4, base.ENV_LINEAR_BACKEND, (10, 0))
    assert cls.name == "reference" and "sgl_kernel (with cutlass_scaled_fp4_mm) is not importable" in \
        dict(skipped)["sgl_kernel_fp4"]


def test_the_emulator_refuses_what_the_contract_refuses():
    a = torch.zeros(4, 16, dtype=torch.uint8)
    b = torch.zeros(32, 16, dtype=torch.uint8)
    sa = torch.zeros(128, 4, dtype=torch.float8_e4m3fn)
    sb_ = torch.zeros(128, 4, dtype=torch.float8_e4m3fn)
    one = torch.ones(1)
    assert emu.cutlass_scaled_fp4_mm(a, b, sa, sb_, one, torch.bfloat16).shape == (4, 32)
    with pytest.raises(RuntimeError, match="n to be divisible by 32"):
        emu.cutlass_scaled_fp4_mm(a, b[:24], sa, sb_, one, torch.bfloat16)
    with pytest.raises(RuntimeError, match="contiguous"):
        emu.cutlass_scaled_fp4_mm(a, torch.zeros(16, 32, dtype=torch.uint8).T, sa, sb_, one, torch.bfloat16)
    with pytest.raises(RuntimeError, match="scale_a"):
        emu.cutlass_scaled_fp4_mm(a, b, sa.view(torch.uint8), sb_, one, torch.bfloat16)
    with pytest.raises(RuntimeError, match="padded and swizzled"):
        emu.cutlass_scaled_fp4_mm(a, b, sa[:, :2].contiguous(), sb_, one, torch.bfloat16)
    with pytest.raises(RuntimeError, match="alpha"):
        emu.cutlass_scaled_fp4_mm(a, b, sa, sb_, torch.ones(1, dtype=torch.float64), torch.bfloat16)


@pytest.mark.gpu
def test_installed_sgl_kernel_has_the_signature_we_call():
    """Where an sgl-kernel with cutlass_scaled_fp4_mm imports (it needs a CUDA driver), the function takes the
    arguments the backend and the emulator pass, in that order (checked by hand on sgl-kernel 0.3.21's wheel:
    (a, b, block_scale_a, block_scale_b, alpha, out_dtype)). The SGLang bundle's sglang-kernel 0.4.5 has none."""
    import inspect

    from ._require import require

    sgl_kernel = require("sgl_kernel")
    if not hasattr(sgl_kernel, "cutlass_scaled_fp4_mm"):
        assert sb.sgl_kernel_module() is None                   # never selected where the function is missing
        pytest.skip("this sgl_kernel has no cutlass_scaled_fp4_mm (sglang-kernel 0.4 dropped its FP4 GEMMs)")
    params = list(inspect.signature(sgl_kernel.cutlass_scaled_fp4_mm).parameters)
    assert params == list(inspect.signature(emu.cutlass_scaled_fp4_mm).parameters)
    assert sb.sgl_kernel_module() is sgl_kernel
