"""Our Blackwell linear backends' calls against the installed flashinfer-python (the version vLLM 0.26.0's
bundle carries): the signatures of mm_fp4, prepare_bf16_fp4_weights and mm_bf16_fp4, and FlashInfer's own
argument checks run on exactly what our backends hand over. CPU only (FlashInfer's Python API imports without a GPU)."""

import inspect
import typing

import pytest
import torch

from tests._require import require

flashinfer = require("flashinfer")

from nvfp4_plugin import numerics as nx  # noqa: E402
from nvfp4_plugin import reference  # noqa: E402
from nvfp4_plugin.layers.backends import flashinfer_fp4 as fb  # noqa: E402
from nvfp4_plugin.layers.base import LinearSpec  # noqa: E402
from nvfp4_plugin.weights import Nvfp4Weight  # noqa: E402

from ..emulators import flashinfer_mm_fp4 as emu  # noqa: E402


def test_mm_fp4_signature_takes_our_call():
    assert flashinfer.__version__ == "0.6.14"
    sig = inspect.signature(flashinfer.mm_fp4)
    names = list(sig.parameters)
    # we pass a, b, a_descale, b_descale, alpha, out_dtype positionally and backend= by name
    assert names[:6] == ["a", "b", "a_descale", "b_descale", "alpha", "out_dtype"]
    allowed = typing.get_args(sig.parameters["backend"].annotation)
    assert set(fb.MM_BACKENDS) <= set(allowed), allowed
    # the emulator takes the same parameters, in the same order
    assert list(inspect.signature(emu.mm_fp4).parameters) == names


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_accepts_what_our_backend_hands_over(monkeypatch, dtype):
    from flashinfer.gemm import gemm_base

    n, k, m = 192, 512, 33
    w = torch.randn(n, k) * 0.02
    gs = nx.tensor_global_scale(w)
    p, s = reference.scaled_fp4_quant(w.bfloat16(), gs.reshape(1), swizzle=False)
    weight = Nvfp4Weight(p, s, gs.reshape(1).expand(n).float().contiguous())
    x = torch.randn(m, k).to(dtype)
    in_gs = nx.tensor_global_scale(x.float()).reshape(())

    class Emu:
        mm_fp4 = staticmethod(emu.mm_fp4)

    monkeypatch.setattr(fb, "flashinfer_module", lambda: Emu)
    emu.calls.clear()
    be = fb.FlashInferLinear()
    t, meta = be.prepare(LinearSpec(n, k, dtype, "w4a4", torch.device("cpu")), weight, in_gs)
    be.apply(t, meta, x)
    (c,) = emu.calls
    assert gemm_base._check_mm_fp4_problem_size(c["a"], c["b"], c["a_descale"], c["b_descale"], c["alpha"],
                                                c["out_dtype"], None, 16, False, c["backend"], True, True)
    # and FlashInfer refuses what the emulator refuses
    with pytest.raises(ValueError):
        gemm_base._check_mm_fp4_problem_size(c["a"], c["b"], c["a_descale"], c["b_descale"],
                                             c["alpha"].double(), c["out_dtype"])


# --- the Blackwell weight-only linear backend (flashinfer_w4a16) against prepare_bf16_fp4_weights / mm_bf16_fp4 ---

from ..emulators import flashinfer_bf16_fp4 as w16_emu  # noqa: E402
from ..test_flashinfer_backend import _weight  # noqa: E402


def test_bf16_fp4_signatures_take_our_calls():
    for fn, emulated in ((flashinfer.prepare_bf16_fp4_weights, w16_emu.prepare_bf16_fp4_weights),
                         (flashinfer.mm_bf16_fp4, w16_emu.mm_bf16_fp4)):
        sig = inspect.signature(fn)
        # we pass the tensors positionally, backend= (and out_dtype=) by name
        assert sig.parameters["backend"].kind == inspect.Parameter.KEYWORD_ONLY
        assert set(fb.W4A16_BACKENDS) <= set(typing.get_args(sig.parameters["backend"].annotation))
        assert list(inspect.signature(emulated).parameters) == list(sig.parameters)
    assert list(inspect.signature(flashinfer.prepare_bf16_fp4_weights).parameters)[:3] == ["b", "b_descale", "alpha"]
    assert list(inspect.signature(flashinfer.mm_bf16_fp4).parameters)[:4] == ["a", "b", "b_descale", "alpha"]


def _real_prepare(monkeypatch, *, mm, backend):
    """Our backends see FlashInfer's real prepare_bf16_fp4_weights, ``mm`` as mm_bf16_fp4, and ``backend``."""
    class Fi:
        prepare_bf16_fp4_weights = staticmethod(flashinfer.prepare_bf16_fp4_weights)
        mm_bf16_fp4 = staticmethod(mm)
        mm_fp4 = staticmethod(emu.mm_fp4)

    monkeypatch.setattr(fb, "flashinfer_module", lambda: Fi)
    monkeypatch.setenv(fb.ENV_W4A16_BACKEND, backend)


def test_flashinfer_w4a16_accepts_what_our_backend_hands_over(monkeypatch):
    """FlashInfer's own prepare_bf16_fp4_weights checks run on our load-time tensors (its cuDNN packing stubbed:
    it needs cuDNN), and its mm_bf16_fp4 problem-size check on our forward's arguments."""
    from flashinfer.gemm import gemm_bf16_fp4, gemm_bf16_fp4_cudnn

    handed = []

    def packing(b, b_descale, alpha, block_size):
        handed.append((b, b_descale, alpha))
        return w16_emu.prepare_bf16_fp4_weights(b, b_descale, alpha, backend="cudnn")

    monkeypatch.setattr(gemm_bf16_fp4_cudnn, "_prepare_cudnn", packing)

    _real_prepare(monkeypatch, mm=w16_emu.mm_bf16_fp4, backend="cudnn")
    n, k, m = 200, 512, 7
    weight = _weight((n,), k)
    p = weight.packed
    be = fb.FlashInferW4A16Linear()
    w16_emu.calls.clear()
    t, meta = be.prepare(LinearSpec(n, k, torch.bfloat16, "w4a16", torch.device("cpu")), weight, None)
    assert len(handed) == 1 and torch.equal(handed[0][0], p)
    be.apply(t, meta, torch.randn(m, k).bfloat16())
    c = [c for c in w16_emu.calls if c["fn"] == "mm"][-1]
    assert gemm_bf16_fp4._check_mm_bf16_fp4_problem_size(c["a"], c["b"], t["sf0"], c["alpha"], backend="cudnn",
                                                         out_dtype=c["out_dtype"])
    with pytest.raises(TypeError):       # and FlashInfer refuses fp16 activations, as the backend's selection does
        gemm_bf16_fp4._check_mm_bf16_fp4_problem_size(c["a"].half(), c["b"], t["sf0"], c["alpha"], backend="cudnn")


@pytest.mark.parametrize("shards", [(200,), (96, 40), (256,)])
def test_flashinfers_cute_dsl_prepare_takes_our_padded_runs(monkeypatch, shards):
    """FlashInfer's real cute-dsl weight preparation (pure torch, runs on the CPU) on what our backend hands it:
    every run of rows padded to its 64-row tiles, so N = 200 or fused shards of 96 + 40 rows load."""
    _real_prepare(monkeypatch, mm=flashinfer.mm_bf16_fp4, backend="cute-dsl")
    k = 512
    weight = _weight(shards, k)
    t, meta = fb.FlashInferW4A16Linear().prepare(LinearSpec(weight.n, k, torch.bfloat16, "w4a16",
                                                            torch.device("cpu")), weight, None)
    for i, n in enumerate(shards):
        n_pad = -(-n // 64) * 64
        assert t[f"w{i}"].dtype == torch.int32 and t[f"w{i}"].shape == (k // 16, 2 * n_pad)   # its repacked layout
        assert t[f"sf{i}"].shape == (k // 16, n_pad)


# --- the Blackwell fused-MoE backend (flashinfer_cutlass_moe) against flashinfer.fused_moe.cutlass_fused_moe ---

from nvfp4_plugin.layers.backends import flashinfer_moe as fm  # noqa: E402
from nvfp4_plugin.layers.backends.reference import ReferenceMoe  # noqa: E402
from nvfp4_plugin.layers.base import MoeSpec  # noqa: E402

from ..emulators import flashinfer_cutlass_moe as moe_emu  # noqa: E402

_E, _H, _I = 4, 128, 64


def _moe_layer(seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = Nvfp4Weight.quantize(torch.randn(_E, 2 * _I, _H, generator=g) * 0.05)
    w2 = Nvfp4Weight.quantize(torch.randn(_E, _H, _I, generator=g) * 0.05)
    x = torch.randn(9, _H, generator=g).to(torch.bfloat16)
    tw, ti = reference.route_topk(torch.randn(9, _E, generator=g), 2)
    a13 = nx.tensor_global_scale(x.float()).expand(_E).contiguous()
    a2 = torch.linspace(300.0, 600.0, _E)
    be = fm.FlashInferCutlassMoe()
    t, meta = be.prepare(MoeSpec(_E, _H, _I, torch.bfloat16, "w4a4", torch.device("cpu")), w13, w2, a13, a2)
    return w13, w2, x, tw, ti, a13, a2, be, t, meta


def test_cutlass_fused_moe_signature_takes_our_call():
    from flashinfer.fused_moe import ActivationType, cutlass_fused_moe

    sig = inspect.signature(cutlass_fused_moe)
    names = list(sig.parameters)
    # we pass the first seven positionally, input_sf= and output= by name, and rely on the Swiglu default
    assert names[:7] == ["input", "token_selected_experts", "token_final_scales", "fc1_expert_weights",
                         "fc2_expert_weights", "output_dtype", "quant_scales"]
    assert {"input_sf", "output", "swizzled_input_sf"} <= set(names)
    assert sig.parameters["activation_type"].default == ActivationType.Swiglu == moe_emu.SWIGLU
    assert sig.parameters["swizzled_input_sf"].default is True
    # the emulator takes the same parameters, in the same order
    assert list(inspect.signature(moe_emu.cutlass_fused_moe).parameters) == names


def test_our_moe_layout_is_vllms_flashinfer_cutlass_layout(monkeypatch):
    """vLLM 0.26 prepares NVFP4 experts for this kernel with reorder_w1w3_to_w3w1 + swizzle_blockscale
    (flashinfer_fp4_moe.py) and g1_alphas = weight_scale_2 x input_scale: our load-time conversion gives the
    same bytes and the same alphas."""
    require("vllm.model_executor.layers.fused_moe")   # first: vLLM's quantization utils import it circularly
    from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import reorder_w1w3_to_w3w1
    from vllm.model_executor.layers.quantization.utils.nvfp4_utils import swizzle_blockscale

    w13, w2, x, tw, ti, a13, a2, be, t, meta = _moe_layer()
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)   # its swizzle ends with .cuda()
    vw, vs = reorder_w1w3_to_w3w1(w13.packed.clone(), w13.block_scale.clone())
    assert torch.equal(t["fc1_weight"].view(torch.uint8), vw)
    assert torch.equal(t["fc1_weight_sf"].view(torch.uint8), swizzle_blockscale(vs).view(torch.uint8))
    assert torch.equal(t["fc2_weight_sf"].view(torch.uint8), swizzle_blockscale(w2.block_scale).view(torch.uint8))
    # vLLM's decode-convention scales: weight_scale_2 = 1 / encode scale, input_scale = 1 / encode scale
    g1 = (1.0 / w13.global_scale[:, 0]) * (1.0 / a13)
    assert torch.allclose(t["fc1_alpha"], g1, rtol=2 ** -22, atol=0)


def test_flashinfers_own_helpers_read_our_layout():
    """FlashInfer's CPU 128x4 un-swizzle gives back our block scales, expert by expert; FlashInfer's own
    reference of cutlass_fused_moe (trace/templates/moe.py: SwiGLU with the gate in the second half of fc1)
    on our prepared weights computes our layer (the reference backend, weight-only), and the halves the
    other way round do not."""
    from flashinfer.gemm.gemm_bf16_fp4 import _unswizzle_sf_128x4
    from flashinfer.trace.templates.moe import _cutlass_fused_moe_reference

    sw = torch.randint(0, 255, (256, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(moe_emu._unswizzle(sw, 200, 10), _unswizzle_sf_128x4(sw, 200, 10).reshape(200, 10))
    w13, w2, x, tw, ti, a13, a2, be, t, meta = _moe_layer(1)
    sf1 = t["fc1_weight_sf"].view(torch.uint8)
    sf2 = t["fc2_weight_sf"].view(torch.uint8)
    up_gate = torch.cat((w13.block_scale[:, _I:], w13.block_scale[:, :_I]), 1)
    for e in range(_E):
        assert torch.equal(_unswizzle_sf_128x4(sf1[e], 2 * _I, _H // 16).reshape(2 * _I, -1),
                           up_gate[e].view(torch.uint8))
        assert torch.equal(_unswizzle_sf_128x4(sf2[e], _H, _I // 16).reshape(_H, -1),
                           w2.block_scale[e].view(torch.uint8))

    def dequant(w64, sf, rows, k, gs):
        codes = nx.unpack_fp4(w64.view(torch.uint8).reshape(_E, rows, k // 2))
        scales = torch.stack([_unswizzle_sf_128x4(sf[e], rows, k // 16).reshape(rows, -1) for e in range(_E)])
        vals = nx.e2m1_decode(codes).unflatten(-1, (-1, 16)) * scales.view(torch.float8_e4m3fn).float()[..., None]
        return vals.flatten(-2) / gs[:, None, None]

    fc1 = dequant(t["fc1_weight"], sf1, 2 * _I, _H, w13.global_scale[:, 0])
    fc2 = dequant(t["fc2_weight"], sf2, _H, _I, w2.global_scale[:, 0])
    theirs = _cutlass_fused_moe_reference(x, ti, tw, fc1, fc2).double()
    spec = MoeSpec(_E, _H, _I, torch.bfloat16, "w4a16", torch.device("cpu"))
    rt, rm = ReferenceMoe().prepare(spec, w13, w2, None, None)
    ours = ReferenceMoe().apply(rt, rm, x, tw, ti).double()
    assert (theirs - ours).norm() / ours.norm() < 1e-2
    swapped = torch.cat((fc1[:, _I:], fc1[:, :_I]), 1)
    wrong = _cutlass_fused_moe_reference(x, ti, tw, swapped, fc2).double()
    assert (wrong - ours).norm() / ours.norm() > 0.3
