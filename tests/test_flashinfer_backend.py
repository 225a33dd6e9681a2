"""The Blackwell linear backend (our scaled_fp4_quant + flashinfer.mm_fp4) on the CPU, against an emulator of
mm_fp4's documented contract (tests/emulators/flashinfer_mm_fp4.py). No Blackwell GPU needed."""

import pytest
import torch

from nvfp4_plugin import numerics as nx
from nvfp4_plugin import reference
from nvfp4_plugin.layers import LINEAR_BACKENDS
from nvfp4_plugin.layers import base
from nvfp4_plugin.layers.backends import flashinfer_fp4 as fb
from nvfp4_plugin.layers.backends import sgl_kernel_fp4 as sb
from nvfp4_plugin.layers.base import LinearSpec, choose_backend
from nvfp4_plugin.weights import Nvfp4Weight

from .emulators import flashinfer_mm_fp4 as emu


class _FlashInfer:
    mm_fp4 = staticmethod(emu.mm_fp4)


@pytest.fixture
def flashinfer(monkeypatch):
    monkeypatch.setattr(fb, "flashinfer_module", lambda: _FlashInfer)
    monkeypatch.setattr(fb, "flashinfer_w4a16_module", lambda: None)   # W4A16: tests/test_flashinfer_w4a16_backend.py
    monkeypatch.setattr(sb, "sgl_kernel_module", lambda: None)         # sgl-kernel: tests/test_sgl_kernel_backend.py
    monkeypatch.delenv(fb.ENV_MM_BACKEND, raising=False)
    monkeypatch.delenv(base.ENV_LINEAR_BACKEND, raising=False)
    emu.calls.clear()
    return _FlashInfer


def _weight(shards, k, seed=0):
    """Quantized fused shards (rows per shard), each with its own encode global scale."""
    g = torch.Generator().manual_seed(seed)
    packed, scales, gss = [], [], []
    for i, n in enumerate(shards):
        w = torch.randn(n, k, generator=g) * (0.02 * (i + 1))
        gs = nx.tensor_global_scale(w)
        p, s = reference.scaled_fp4_quant(w.bfloat16(), gs.reshape(1), swizzle=False)
        packed.append(p), scales.append(s), gss.append(gs.reshape(1).expand(n))
    return Nvfp4Weight(torch.cat(packed), torch.cat(scales), torch.cat(gss).float().contiguous())


def _truth(x, w: Nvfp4Weight, in_gs, bias=None):
    """fp64 product of the exactly fake-quantized activations and the exact dequantized weight."""
    q, s = reference.scaled_fp4_quant(x, in_gs.reshape(1), swizzle=False)
    xa = (nx.e2m1_decode(nx.unpack_fp4(q)).reshape(x.shape[0], -1, 16) * s.float()[..., None]).reshape(x.shape)
    xa = xa.double() / in_gs.double()
    y = xa @ w.dequantize(torch.float64).T
    return y + bias.double() if bias is not None else y


#: fused shards (rows each, each with its own global scale): one run, three runs, runs not a multiple of 64 / 32
SHARDS = [(256,), (128, 64, 64), (96, 40)]


def run_w4a4_case(be, shards, dtype, lead=(37,), k=512):
    """A W4A4 linear through backend ``be`` (prepare, then apply with and without bias) against the fp64
    truth, within 2 output ulps; returns ``(w, x2, in_gs)`` (``x2``: the input as ``[M, K]``)."""
    w = _weight(shards, k)
    n = w.n
    x = (torch.randn(*lead, k, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    x2 = x.reshape(-1, k)
    in_gs = nx.tensor_global_scale(x.float()).reshape(())
    t, meta = be.prepare(LinearSpec(n, k, dtype, "w4a4", torch.device("cpu")), w, in_gs)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(dtype)
    ulp = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)
    for b in (None, bias):
        y = be.apply(t, meta, x, b)
        assert y.shape == (*lead, n) and y.dtype == dtype
        truth = _truth(x2, w, in_gs, b)
        assert (y.reshape(-1, n).double() - truth).abs().max().item() <= 2 * ulp * truth.abs().max().item()
    return w, x2, in_gs


@pytest.mark.parametrize("shards", SHARDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_through_mm_fp4_equals_the_reference(flashinfer, shards, dtype):
    w, x, in_gs = run_w4a4_case(fb.FlashInferLinear(), shards, dtype)
    k = x.shape[1]
    # one GEMM per run of rows with one global scale, each with its own alpha
    runs = fb.row_runs(w.global_scale)
    assert len(emu.calls) == 2 * len(runs) and len(runs) == len(set(w.global_scale.tolist()))
    # bit-exact on what is handed over: our quantizer's bytes, the weight's own codes and scales
    q_ref, s_ref = reference.scaled_fp4_quant(x, in_gs.reshape(1), swizzle=True)
    for call, (a0, a1) in zip(emu.calls, runs):
        assert torch.equal(call["a"], q_ref) and torch.equal(call["a_descale"].view(torch.uint8), s_ref.view(torch.uint8))
        assert torch.equal(call["b"].T, w.packed[a0:a1])
        lin = emu._unswizzle(call["b_descale"].T, a1 - a0, k // 16)
        assert torch.equal(lin, w.block_scale[a0:a1].view(torch.uint8))
        assert call["alpha"].item() == pytest.approx(1.0 / (in_gs.item() * w.global_scale[a0].item()), rel=1e-6)
        assert call["backend"] == "cutlass" and call["out_dtype"] == dtype


def test_emulator_layout_agrees_with_the_swizzle_formula_of_the_reference(flashinfer):
    """The emulator's independent unswizzle inverts our swizzle (and, where vLLM is installed, vLLM's)."""
    s = torch.randint(0, 127, (300, 24), dtype=torch.uint8)
    assert torch.equal(emu._unswizzle(nx.swizzle_blockscale(s), 300, 24), s)
    try:
        from vllm.model_executor.layers.quantization.utils.nvfp4_utils import swizzle_blockscale as vllm_swizzle
    except Exception:
        return
    v = vllm_swizzle(s.view(torch.float8_e4m3fn).clone())
    assert torch.equal(emu._unswizzle(v.reshape(nx.swizzled_scale_shape(300, 24)), 300, 24), s)


def test_selection_on_blackwell(flashinfer, monkeypatch):
    spec4 = LinearSpec(4096, 4096, torch.bfloat16, "w4a4", torch.device("cuda"))
    cls, skipped = choose_backend("linear", LINEAR_BACKENDS, spec4, base.ENV_LINEAR_BACKEND, (10, 0))
    assert cls is fb.FlashInferLinear and skipped[0][0] == "hopper_triton"
    cls, _ = choose_backend("linear", LINEAR_BACKENDS, spec4, base.ENV_LINEAR_BACKEND, (10, 3))
    assert cls is fb.FlashInferLinear
    cls, _ = choose_backend("linear", LINEAR_BACKENDS, spec4, base.ENV_LINEAR_BACKEND, (9, 0))
    assert cls.name == "hopper_triton"                               # Hopper unchanged
    spec16 = LinearSpec(4096, 4096, torch.bfloat16, "w4a16", torch.device("cuda"))
    cls, skipped = choose_backend("linear", LINEAR_BACKENDS, spec16, base.ENV_LINEAR_BACKEND, (10, 0))
    assert cls.name == "reference" and "weight-only checkpoint" in dict(skipped)["flashinfer_fp4"]
    odd = LinearSpec(4100, 4096, torch.bfloat16, "w4a4", torch.device("cuda"))
    cls, skipped = choose_backend("linear", LINEAR_BACKENDS, odd, base.ENV_LINEAR_BACKEND, (10, 0))
    assert cls.name == "reference" and "N % 8" in dict(skipped)["flashinfer_fp4"]
    monkeypatch.setattr(fb, "flashinfer_module", lambda: None)
    cls, skipped = choose_backend("linear", LINEAR_BACKENDS, spec4, base.ENV_LINEAR_BACKEND, (10, 0))
    assert cls.name == "reference" and "not importable" in dict(skipped)["flashinfer_fp4"]
    monkeypatch.setenv(fb.ENV_MM_BACKEND, "trtllm")
    with pytest.raises(ValueError, match="NVFP4_PLUGIN_FLASHINFER_MM_BACKEND='trtllm'"):
        fb.mm_backend()


def test_the_emulator_refuses_what_the_contract_refuses():
    a = torch.zeros(4, 16, dtype=torch.uint8)
    b = torch.zeros(16, 8, dtype=torch.uint8)                  # row-major, not the .T of a [N, K/2] tensor
    sa = torch.zeros(128, 4, dtype=torch.uint8)
    sb = torch.zeros(128, 4, dtype=torch.uint8).T
    with pytest.raises(ValueError, match="column-major"):
        emu.mm_fp4(a, b, sa, sb, torch.ones(1))
    with pytest.raises(ValueError, match="alpha"):
        emu.mm_fp4(a, torch.zeros(8, 16, dtype=torch.uint8).T, sa, sb, torch.ones(1, dtype=torch.float64))
