"""The Blackwell weight-only linear backend (flashinfer.prepare_bf16_fp4_weights at load, mm_bf16_fp4 per
forward) on the CPU, against an emulator of those functions' documented contract
(tests/emulators/flashinfer_bf16_fp4.py). No Blackwell GPU needed."""

import pytest
import torch

from nvfp4_plugin.layers import LINEAR_BACKENDS
from nvfp4_plugin.layers import base
from nvfp4_plugin.layers.backends import flashinfer_fp4 as fb
from nvfp4_plugin.layers.backends import sgl_kernel_fp4 as sb
from nvfp4_plugin.layers.base import LinearSpec, choose_backend

from .emulators import flashinfer_bf16_fp4 as emu
from .emulators import flashinfer_mm_fp4 as emu_mm
from .test_flashinfer_backend import _weight


class _FlashInfer:
    mm_fp4 = staticmethod(emu_mm.mm_fp4)
    mm_bf16_fp4 = staticmethod(emu.mm_bf16_fp4)
    prepare_bf16_fp4_weights = staticmethod(emu.prepare_bf16_fp4_weights)


@pytest.fixture
def flashinfer(monkeypatch):
    monkeypatch.setattr(fb, "flashinfer_module", lambda: _FlashInfer)
    monkeypatch.setattr(sb, "sgl_kernel_module", lambda: None)         # sgl-kernel: tests/test_sgl_kernel_backend.py
    monkeypatch.setenv(fb.ENV_W4A16_BACKEND, "cudnn")
    real_missing = fb.w4a16_backend_missing
    monkeypatch.setattr(fb, "w4a16_backend_missing", lambda be: None)   # no cuDNN / nvidia-cutlass-dsl on the CPU
    _FlashInfer.real_missing = staticmethod(real_missing)
    monkeypatch.delenv(base.ENV_LINEAR_BACKEND, raising=False)
    emu.calls.clear()
    emu.prepared.clear()
    return _FlashInfer


@pytest.mark.parametrize("be", ["cudnn", "cute-dsl"])
@pytest.mark.parametrize("shards", [(256,), (128, 64, 64), (96, 40), (200,)])
def test_weight_only_linear_through_mm_bf16_fp4_equals_the_reference(flashinfer, monkeypatch, shards, be):
    """cute-dsl tiles N by 64: each run of rows is padded with zero rows there and its output columns sliced."""
    monkeypatch.setenv(fb.ENV_W4A16_BACKEND, be)
    k, m = 512, 37
    w = _weight(shards, k)
    n = w.n
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    spec = LinearSpec(n, k, torch.bfloat16, "w4a16", torch.device("cpu"))
    lin = fb.FlashInferW4A16Linear()
    t, meta = lin.prepare(spec, w, None)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).bfloat16()
    truth0 = x.double() @ w.dequantize(torch.float64).T                  # bf16 activations as they are
    for b in (None, bias):
        y = lin.apply(t, meta, x, b)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        truth = truth0 + (b.double() if b is not None else 0)
        assert (y.double() - truth).abs().max().item() <= 2 * 2.0 ** -8 * truth.abs().max().item()
    # at load: one prepare per run of rows with one global scale, handed the canonical form
    runs = fb.row_runs(w.global_scale)
    preps = [c for c in emu.calls if c["fn"] == "prepare"]
    assert len(preps) == len(runs) == len(set(w.global_scale.tolist()))
    for call, (a0, a1) in zip(preps, runs):
        rows = a1 - a0
        pad = -rows % 64 if be == "cute-dsl" else 0
        assert call["b"].shape == (rows + pad, k // 2)
        assert torch.equal(call["b"][:rows], w.packed[a0:a1])                        # [n, K/2] codes
        assert not call["b"][rows:].any()                                            # padding: zero codes
        lin = emu_mm._unswizzle(call["b_descale"], rows + pad, k // 16)              # 128x4-swizzled scales
        assert torch.equal(lin[:rows], w.block_scale[a0:a1].view(torch.uint8)) and not lin[rows:].any()
        assert call["alpha"].dtype == torch.float32 and call["alpha"].shape == (1,)
        assert call["alpha"].item() == pytest.approx(1.0 / w.global_scale[a0].item(), rel=1e-7)
        assert call["backend"] == be
    # per forward: one GEMM per run, on the prepared tensors, with the same backend
    mms = [c for c in emu.calls if c["fn"] == "mm"]
    assert len(mms) == 2 * len(runs) and all(c["a"].dtype == torch.bfloat16 for c in mms)


def test_selection_of_weight_only_layers_on_blackwell(flashinfer, monkeypatch):
    spec16 = LinearSpec(4096, 4096, torch.bfloat16, "w4a16", torch.device("cuda"))
    cls, skipped = choose_backend("linear", LINEAR_BACKENDS, spec16, base.ENV_LINEAR_BACKEND, (10, 0))
    assert cls is fb.FlashInferW4A16Linear and "weight-only checkpoint" in dict(skipped)["flashinfer_fp4"]
    cls, _ = choose_backend("linear", LINEAR_BACKENDS, spec16, base.ENV_LINEAR_BACKEND, (10, 3))
    assert cls is fb.FlashInferW4A16Linear
    assert cls.families(spec16, 256) == [(1, 256, "flashinfer mm_bf16_fp4 (cudnn)")]
    cls, _ = choose_backend("linear", LINEAR_BACKENDS, spec16, base.ENV_LINEAR_BACKEND, (9, 0))
    assert cls.name == "hopper_triton"                                   # Hopper unchanged
    spec4 = LinearSpec(4096, 4096, torch.bfloat16, "w4a4", torch.device("cuda"))
    cls, _ = choose_backend("linear", LINEAR_BACKENDS, spec4, base.ENV_LINEAR_BACKEND, (10, 0))
    assert cls is fb.FlashInferLinear                                    # activation scales: the W4A4 GEMM
    fp16 = LinearSpec(4096, 4096, torch.float16, "w4a16", torch.device("cuda"))
    cls, skipped = choose_backend("linear", LINEAR_BACKENDS, fp16, base.ENV_LINEAR_BACKEND, (10, 0))
    assert cls.name == "reference" and "bf16 activations only" in dict(skipped)["flashinfer_w4a16"]
    odd = LinearSpec(4100, 4096, torch.bfloat16, "w4a16", torch.device("cuda"))
    cls, skipped = choose_backend("linear", LINEAR_BACKENDS, odd, base.ENV_LINEAR_BACKEND, (10, 0))
    assert cls.name == "reference" and "N % 8" in dict(skipped)["flashinfer_w4a16"]
    # cute-dsl (the default) without nvidia-cutlass-dsl, cudnn without a usable cuDNN: refused with the reason
    monkeypatch.setattr(fb, "w4a16_backend_missing", flashinfer.real_missing)
    cls, skipped = choose_backend("linear", LINEAR_BACKENDS, spec16, base.ENV_LINEAR_BACKEND, (10, 0))
    assert cls.name == "reference" and "cudnn backend needs" in dict(skipped)["flashinfer_w4a16"]
    monkeypatch.setenv(fb.ENV_W4A16_BACKEND, "cute-dsl")
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cutlass" else object())
    cls, skipped = choose_backend("linear", LINEAR_BACKENDS, spec16, base.ENV_LINEAR_BACKEND, (10, 0))
    assert cls.name == "reference"
    assert "NVFP4_PLUGIN_FLASHINFER_W4A16_BACKEND=cudnn" in dict(skipped)["flashinfer_w4a16"]
    monkeypatch.setenv(fb.ENV_W4A16_BACKEND, "marlin")
    with pytest.raises(ValueError, match="NVFP4_PLUGIN_FLASHINFER_W4A16_BACKEND='marlin'"):
        fb.w4a16_backend()


def test_the_emulator_refuses_what_the_contract_refuses(flashinfer):
    b = torch.zeros(64, 32, dtype=torch.uint8)
    sf = torch.zeros(128 * 4, dtype=torch.uint8)
    with pytest.raises(TypeError, match="uint8"):
        emu.prepare_bf16_fp4_weights(b.to(torch.int32), sf, backend="cudnn")
    with pytest.raises(ValueError, match="requires"):
        emu.prepare_bf16_fp4_weights(b, sf[:100], backend="cudnn")
    with pytest.raises(TypeError, match="float32"):
        emu.prepare_bf16_fp4_weights(b, sf, torch.ones(1, dtype=torch.float64), backend="cudnn")
    w, s, _ = emu.prepare_bf16_fp4_weights(b, sf, backend="cudnn")
    with pytest.raises(TypeError, match="fp16 support is not implemented"):
        emu.mm_bf16_fp4(torch.zeros(2, 64, dtype=torch.float16), w, s, backend="cudnn")
    with pytest.raises(ValueError, match="prepared for backend 'cudnn'"):
        emu.mm_bf16_fp4(torch.zeros(2, 64, dtype=torch.bfloat16), w, s, backend="cute-dsl")
    with pytest.raises(ValueError, match="not returned by prepare"):
        emu.mm_bf16_fp4(torch.zeros(2, 64, dtype=torch.bfloat16), b, s, backend="cudnn")



def test_strided_and_empty_inputs(flashinfer):
    """A row-strided activation view is made compact (the kernels take its pointer); 0 tokens launch nothing."""
    w = _weight((128,), 256)
    be = fb.FlashInferW4A16Linear()
    t, meta = be.prepare(LinearSpec(128, 256, torch.bfloat16, "w4a16", torch.device("cpu")), w, None)
    buf = torch.randn(6, 512, generator=torch.Generator().manual_seed(4)).bfloat16()
    x = buf[:, :256]
    assert not x.is_contiguous()
    assert torch.equal(be.apply(t, meta, x), be.apply(t, meta, x.contiguous()))
    emu.calls.clear()
    y = be.apply(t, meta, buf[:0, :256], torch.ones(128).bfloat16())
    assert y.shape == (0, 128) and emu.calls == []
