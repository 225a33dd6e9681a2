"""The Blackwell fused-MoE backend (FlashInfer's cutlass_fused_moe, fed by our scaled_fp4_quant) on the CPU,
against an emulator of that function's NVFP4 contract (tests/emulators/flashinfer_cutlass_moe.py), with the
device mocked as sm_100 where selection is concerned. No Blackwell GPU needed.

What is bit-exact: everything handed to cutlass_fused_moe (weight codes in FlashInfer's [up; gate] order,
block scales after un-swizzling, alphas, activation scales, our quantized input), and each stage's
quantized bytes against our reference quantizer. What is not: the GEMM1/GEMM2 outputs (exact products
in fp32 here, bf16-rounded operands in the reference), the SiLU (a different exp), and what follows from
those (an intermediate FP4 code can flip); each stage is bounded separately, then the layer output."""

import logging
import math

import pytest
import torch

from nvfp4_plugin import numerics as nx
from nvfp4_plugin import reference
from nvfp4_plugin.layers import MOE_BACKENDS, Nvfp4FusedMoE
from nvfp4_plugin.layers import api, base
from nvfp4_plugin.layers.backends import flashinfer_moe as fm
from nvfp4_plugin.layers.backends.reference import ReferenceMoe
from nvfp4_plugin.layers.base import MoeSpec, choose_backend
from nvfp4_plugin.weights import Nvfp4Weight

from .emulators import flashinfer_cutlass_moe as emu

E, H, I = 6, 128, 64
CPU = torch.device("cpu")


class _FusedMoe:
    cutlass_fused_moe = staticmethod(emu.cutlass_fused_moe)


@pytest.fixture
def flashinfer(monkeypatch):
    monkeypatch.setattr(fm, "flashinfer_module", lambda: _FusedMoe)
    monkeypatch.delenv(base.ENV_MOE_BACKEND, raising=False)
    monkeypatch.delenv(base.ENV_ACT_MODE, raising=False)
    emu.calls.clear()
    return _FusedMoe


def _pow2(gs: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(gs)))


def _weights(seed, *, pow2=False, gate_up_ratio=None):
    """w13 ``[E, 2I, H]`` (gate rows, then up) and w2 ``[E, H, I]``, one encode scale per expert (gate and up
    apart when ``gate_up_ratio`` is set)."""
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(E, I, H, generator=g) * 0.05 * torch.linspace(0.5, 2, E)[:, None, None]
    up = torch.randn(E, I, H, generator=g) * 0.05
    down = torch.randn(E, H, I, generator=g) * 0.05

    def q(w, ratio=1.0):
        gs = torch.stack([nx.tensor_global_scale(w[e]) for e in range(E)]) * ratio
        return Nvfp4Weight.quantize(w, _pow2(gs) if pow2 else gs)

    if gate_up_ratio is None:
        w13 = q(torch.cat((gate, up), dim=1))
    else:
        wg, wu = q(gate), q(up, gate_up_ratio)
        w13 = Nvfp4Weight(torch.cat((wg.packed, wu.packed), 1), torch.cat((wg.block_scale, wu.block_scale), 1),
                          torch.cat((wg.global_scale, wu.global_scale), 1).contiguous())
    return w13, q(down)


def _inputs(seed, dtype, w13, *, per_expert_a13, pow2=False, m=37, top_k=2):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, H, generator=g) * 2).to(dtype)
    tw, ti = reference.route_topk(torch.randn(m, E, generator=g), top_k)
    ti = torch.where(ti == E - 1, torch.zeros_like(ti), ti)          # the last expert gets no tokens
    gs = nx.tensor_global_scale(x.float())
    a13 = gs * (torch.linspace(0.4, 1.0, E) if per_expert_a13 else torch.ones(E))
    # a2 from the amax of each expert's SwiGLU output (as calibration would), varied per expert
    h = x.float() @ w13.dequantize(torch.float32).transpose(1, 2)                        # [E, m, 2I]
    act = torch.nn.functional.silu(h[..., :I]) * h[..., I:]
    a2 = 2688.0 / act.abs().amax(dim=(1, 2)) * torch.linspace(0.6, 1.0, E)
    if pow2:
        a13, a2 = _pow2(a13), _pow2(a2)
    return x, tw, ti, a13.float().contiguous(), a2.float().contiguous()


def _half_ulp(dtype) -> float:
    """Rounding to ``dtype`` moves a value by at most this times its magnitude (normal range)."""
    return 2.0 ** (-8 if dtype == torch.bfloat16 else -11)


def _tiny(dtype) -> float:
    """Half the smallest subnormal step of ``dtype`` (absolute rounding error below the normal range)."""
    return 2.0 ** (-134 if dtype == torch.bfloat16 else -25)


def _unswizzled(sf_int32, rows, cols):
    """Per-expert int32 views of 128x4-swizzled E4M3 bytes -> linear bytes ``[E, rows, cols]``."""
    b = sf_int32.contiguous().view(torch.uint8)
    return torch.stack([emu._unswizzle(b[e], rows, cols) for e in range(b.shape[0])])


def _run(dtype, per_expert_a13, pow2=False, seed=0):
    w13, w2 = _weights(seed, pow2=pow2)
    x, tw, ti, a13, a2 = _inputs(seed + 1, dtype, w13, per_expert_a13=per_expert_a13, pow2=pow2)
    spec = MoeSpec(E, H, I, dtype, "w4a4", CPU)
    be = fm.FlashInferCutlassMoe()
    t, meta = be.prepare(spec, w13, w2, a13, a2)
    y = be.apply(t, meta, x, tw, ti)
    ref_be = ReferenceMoe()
    rt, rmeta = ref_be.prepare(spec, w13, w2, a13, a2)
    y_ref = ref_be.apply(rt, rmeta, x, tw, ti)
    return dict(w13=w13, w2=w2, x=x, tw=tw, ti=ti, a13=a13, a2=a2, t=t, meta=meta, y=y, y_ref=y_ref)


@pytest.mark.parametrize("per_expert_a13", [False, True], ids=["shared_a13", "per_expert_a13"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_moe_through_cutlass_fused_moe_equals_the_reference(flashinfer, dtype, per_expert_a13):
    r = _run(dtype, per_expert_a13)
    w13, w2, x, tw, ti, a13, a2 = (r[k] for k in ("w13", "w2", "x", "tw", "ti", "a13", "a2"))
    (c,) = emu.calls
    assert r["meta"].path == (fm.PATH_KERNEL_QUANT if per_expert_a13 else fm.PATH_OUR_QUANT)
    assert r["y"].shape == x.shape and r["y"].dtype == dtype

    # --- bit-exact: what is handed over ---------------------------------------------------------------------
    fc1 = c["fc1_expert_weights"].view(torch.uint8)
    assert fc1.shape == (E, 2 * I, H // 2)
    assert torch.equal(fc1[:, :I], w13.packed[:, I:]) and torch.equal(fc1[:, I:], w13.packed[:, :I])  # [up; gate]
    assert torch.equal(c["fc2_expert_weights"].view(torch.uint8), w2.packed)
    fc1_act, fc1_sf, fc1_alpha, fc2_act, fc2_sf, fc2_alpha = c["quant_scales"]
    up_gate = torch.cat((w13.block_scale[:, I:], w13.block_scale[:, :I]), 1).view(torch.uint8)
    assert torch.equal(_unswizzled(fc1_sf, 2 * I, H // 16), up_gate)
    assert torch.equal(_unswizzled(fc2_sf, H, I // 16), w2.block_scale.view(torch.uint8))
    g13, g2 = w13.global_scale[:, 0].double(), w2.global_scale[:, 0].double()
    for alpha, a, g in ((fc1_alpha, a13, g13), (fc2_alpha, a2, g2)):
        exact = 1.0 / (a.double() * g)
        assert alpha.dtype == torch.float32 and ((alpha.double() - exact).abs() <= 2 ** -23 * exact).all()
    assert torch.equal(fc2_act, a2)
    assert torch.equal(c["token_selected_experts"], ti.to(torch.int32))
    assert torch.equal(c["token_final_scales"], tw.float())
    assert c["output_dtype"] == dtype and c["output"] is r["y"]
    if per_expert_a13:
        assert torch.equal(fc1_act, a13) and c["input"] is x and c["input_sf"] is None
    else:
        q, s = reference.scaled_fp4_quant(x, a13[:1], swizzle=True)
        assert fc1_act.dim() == 0 and fc1_act.item() == a13[0].item()
        assert torch.equal(c["input"], q) and torch.equal(c["input_sf"].view(torch.uint8), s.view(torch.uint8))

    # --- each stage inside the kernel, against our numerics -------------------------------------------------
    expert = c["expert"]
    token = torch.arange(ti.numel()) // ti.shape[1]
    # GEMM1 input of each routed row: our quantizer with that expert's a13, byte for byte (the kernel's
    # quantizer in the per-expert case, our bytes copied otherwise)
    q_rows, s_rows = reference._nvfp4_quantize(x[token], a13[expert][:, None])
    assert torch.equal(nx.pack_fp4(c["fc1_input_codes"]), q_rows)
    assert torch.equal(c["fc1_input_scales"].view(torch.uint8), s_rows.view(torch.uint8))
    # GEMM1: the exact product of the dequantized operands, rounded once to the activation dtype
    x_hat = _dequant_rows(q_rows, s_rows, a13[expert])
    w13_hat = w13.dequantize(torch.float64)[expert]
    swap = lambda t: torch.cat((t[:, I:], t[:, :I]), 1)                                      # noqa: E731
    truth1 = swap(torch.einsum("rk,rnk->rn", x_hat, w13_hat))                       # [up; gate], as FlashInfer
    mag1 = swap(torch.einsum("rk,rnk->rn", x_hat.abs(), w13_hat.abs()))
    half, tiny = _half_ulp(dtype), _tiny(dtype)
    h1 = c["gemm1_out"].double()
    assert ((h1 - truth1).abs() <= (half + 2 ** -21) * truth1.abs() + 2 ** -40 * mag1 + tiny).all()
    # SwiGLU: our silu_and_mul on the kernel's own GEMM1 output, up to one ulp (a different exp)
    ours = nx.silu_and_mul_fp32(swap(c["gemm1_out"])).double()
    act = c["act"].double()
    assert ((act - ours).abs() <= 2 * half * ours.abs() + 2 * tiny).all()
    # GEMM2 input: our quantizer on the kernel's SwiGLU output with that expert's a2, byte for byte
    q2, s2 = reference._nvfp4_quantize(c["act"], a2[expert][:, None])
    assert torch.equal(nx.pack_fp4(c["fc2_input_codes"]), q2)
    assert torch.equal(c["fc2_input_scales"].view(torch.uint8), s2.view(torch.uint8))
    # GEMM2 and the combine: exact products rounded to the activation dtype, then an fp32 weighted sum
    a_hat, w2_hat = _dequant_rows(q2, s2, a2[expert]), w2.dequantize(torch.float64)[expert]
    truth2 = torch.einsum("rk,rnk->rn", a_hat, w2_hat)
    mag2 = torch.einsum("rk,rnk->rn", a_hat.abs(), w2_hat.abs())
    h2 = c["gemm2_out"].double()
    assert ((h2 - truth2).abs() <= (half + 2 ** -21) * truth2.abs() + 2 ** -40 * mag2 + tiny).all()
    terms = (tw.double().reshape(-1)[:, None] * h2).reshape(ti.shape[0], ti.shape[1], H)
    comb = terms.sum(1)
    assert ((r["y"].double() - comb).abs() <= half * comb.abs() + 2 ** -22 * terms.abs().sum(1) + tiny).all()

    # --- the layer output against the reference backend -----------------------------------------------------
    # The reference rounds its dequantized GEMM operands (e2m1 x scale / global scale) to the activation dtype,
    # so about half its GEMM1 outputs differ by an ulp and ~1% of the intermediate FP4 codes by one step (bf16):
    # bounded in norm, as test_layers bounds the reference against fp32. With power-of-two global scales that
    # rounding vanishes and so does the difference (test_power_of_two_scales_...).
    err = (r["y"].double() - r["y_ref"].double()).norm() / r["y_ref"].double().norm()
    assert err < 3e-2, err


def _dequant_rows(packed, scales, gs_rows):
    """fp64 values of NVFP4 rows (linear scales), each row with its own encode global scale."""
    vals = nx.e2m1_decode(nx.unpack_fp4(packed)).double().unflatten(-1, (-1, 16)) * scales.double()[..., None]
    return vals.flatten(-2) / gs_rows.double()[:, None]


@pytest.mark.parametrize("per_expert_a13", [False, True], ids=["shared_a13", "per_expert_a13"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_power_of_two_scales_match_the_reference_to_accumulation_rounding(flashinfer, dtype, per_expert_a13):
    """With power-of-two global scales the reference's dequantized operands are exact in the activation dtype
    too, so the reference layer and the emulated kernel may differ only by fp32 accumulation order and the exp
    inside SiLU. Every output element is within that (here: the outputs are equal)."""
    r = _run(dtype, per_expert_a13, pow2=True, seed=3)
    y, y_ref = r["y"].double(), r["y_ref"].double()
    (c,) = emu.calls
    mag = (r["tw"].double().reshape(-1)[:, None] * c["gemm2_out"].double().abs()).reshape(-1, 2, H).sum(1)
    assert ((y - y_ref).abs() <= _half_ulp(dtype) * y_ref.abs() + 2 ** -22 * mag + _tiny(dtype)).all()


def test_fused_gate_up_with_different_global_scales_runs_the_reference(flashinfer, caplog):
    """One alpha per expert cannot carry a gate scale and an up scale exactly: that layer runs the reference
    backend (logged, bit-equal to it), FlashInfer is never called."""
    w13, w2 = _weights(4, gate_up_ratio=0.5)
    x, tw, ti, a13, a2 = _inputs(5, torch.bfloat16, w13, per_expert_a13=False)
    spec = MoeSpec(E, H, I, torch.bfloat16, "w4a4", CPU)
    be = fm.FlashInferCutlassMoe()
    with caplog.at_level(logging.WARNING, logger="nvfp4_plugin"):
        t, meta = be.prepare(spec, w13, w2, a13, a2)
    assert meta.path == fm.PATH_REFERENCE
    assert f"w13: the rows of {E} expert(s) carry different encode global scales (expert 0: gate" in caplog.text
    assert "runs the reference backend" in caplog.text
    y = be.apply(t, meta, x, tw, ti)
    rt, rmeta = ReferenceMoe().prepare(spec, w13, w2, a13, a2)
    assert torch.equal(y, ReferenceMoe().apply(rt, rmeta, x, tw, ti)) and not emu.calls
    assert be.warmup_sizes(t, meta, 256, top_k=2) == []
    # w2 rows of one expert with two scales: the same
    w13, w2 = _weights(6)
    gs2 = w2.global_scale.clone()
    gs2[3, :5] *= 2
    w2b = Nvfp4Weight(w2.packed, w2.block_scale, gs2)
    _, meta = be.prepare(spec, w13, w2b, a13, a2)
    assert meta.path == fm.PATH_REFERENCE


def test_layer_forward_through_the_custom_op(flashinfer, monkeypatch):
    """Nvfp4FusedMoE with this backend (selection mocked: the device here is a CPU) runs its forward op."""
    monkeypatch.setenv(base.ENV_ACT_MODE, "w4a4")
    monkeypatch.setattr(api, "select_backend", lambda kind, reg, spec, env: fm.FlashInferCutlassMoe())
    w13, w2 = _weights(7)
    x, tw, ti, a13, a2 = _inputs(8, torch.bfloat16, w13, per_expert_a13=False, m=5)
    layer = Nvfp4FusedMoE(w13, w2, a13, a2)
    assert layer.backend.name == "flashinfer_cutlass_moe" and layer.mode == "w4a4"
    y = layer(x, tw, ti)
    (c,) = emu.calls
    assert c["output"] is y and y.shape == x.shape
    assert layer.backend.warmup_sizes(layer.tensors, layer.meta, 8192, top_k=2) == [1]
    assert layer(x[:0], tw[:0], ti[:0]).shape == (0, H) and len(emu.calls) == 1     # no call for no tokens


def test_selection_on_blackwell(flashinfer, monkeypatch):
    cuda = torch.device("cuda")
    spec = MoeSpec(128, 2048, 768, torch.bfloat16, "w4a4", cuda)
    order = [b.name for b in MOE_BACKENDS]
    assert order.index("hopper_triton") < order.index("flashinfer_cutlass_moe") < order.index("reference")
    for cap in ((10, 0), (10, 3)):
        cls, skipped = choose_backend("moe", MOE_BACKENDS, spec, base.ENV_MOE_BACKEND, cap)
        assert cls is fm.FlashInferCutlassMoe and skipped[0][0] == "hopper_triton"
    assert fm.FlashInferCutlassMoe.families(spec, 16384, top_k=8) == [(1, 16384, "flashinfer cutlass_fused_moe")]
    cls, _ = choose_backend("moe", MOE_BACKENDS, spec, base.ENV_MOE_BACKEND, (9, 0))
    assert cls.name == "hopper_triton"                                               # Hopper unchanged
    for cap in ((9, 0), (12, 0), (8, 0)):
        assert fm.FlashInferCutlassMoe.unsupported_reason(cuda, cap) == \
            f"runs on sm_100, sm_103 only, the GPU is sm_{cap[0]}{cap[1]}"
    w4a16 = MoeSpec(128, 2048, 768, torch.bfloat16, "w4a16", cuda)
    cls, skipped = choose_backend("moe", MOE_BACKENDS, w4a16, base.ENV_MOE_BACKEND, (10, 0))
    assert cls.name == "reference" and "weight-only checkpoint" in dict(skipped)["flashinfer_cutlass_moe"]
    odd = MoeSpec(8, 2048, 96, torch.bfloat16, "w4a4", cuda)
    cls, skipped = choose_backend("moe", MOE_BACKENDS, odd, base.ENV_MOE_BACKEND, (10, 0))
    assert cls.name == "reference" and "I % 64 == 0" in dict(skipped)["flashinfer_cutlass_moe"]
    fp32 = MoeSpec(8, 2048, 768, torch.float32, "w4a4", cuda)
    assert "bf16 or fp16" in fm.FlashInferCutlassMoe.cannot_implement(fp32)
    monkeypatch.setattr(fm, "flashinfer_module", lambda: None)
    cls, skipped = choose_backend("moe", MOE_BACKENDS, spec, base.ENV_MOE_BACKEND, (10, 0))
    assert cls.name == "reference" and "not importable" in dict(skipped)["flashinfer_cutlass_moe"]


def test_layer_without_input_scales_never_selects_it(flashinfer):
    """A weight-only checkpoint resolves to w4a16, which this backend refuses."""
    w13, w2 = _weights(9)
    layer = Nvfp4FusedMoE(w13, w2, None, None)
    assert layer.mode == "w4a16" and layer.backend.name == "reference"
    spec = MoeSpec(E, H, I, torch.bfloat16, layer.mode, torch.device("cuda"))
    assert "weight-only" in fm.FlashInferCutlassMoe.cannot_implement(spec)


def test_emulated_quantizer_is_our_recipe():
    """FlashInfer's cvt_warp_fp16_to_fp4 as emulated (correctly rounded reciprocals) gives our bytes, ties and
    saturation included; a block whose E4M3 scale underflows gets other codes with the same value, 0."""
    g = torch.Generator().manual_seed(11)
    blocks = torch.randn(64, 16, generator=g) * torch.logspace(-3, 3, 64)[:, None]
    grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, -0.25, -2.5, -5.0, 0.0, -0.0, 0.1, -0.1])
    ties = grid[None, :] * torch.tensor([1.0, 0.5, 2.0, 4.0])[:, None]        # vmax 7 x {1,.5,2,4}: exact ties
    x = torch.cat((blocks, ties)).reshape(-1, 32).to(torch.bfloat16)
    for gs in (torch.tensor(448 * 6 / 7.0), torch.tensor(1.0), torch.tensor(2688 / 300.0)):
        codes, sf = emu.quantize_rows(x, gs.expand(x.shape[0]))
        q, s = reference._nvfp4_quantize(x, gs.reshape(1, 1))
        assert torch.equal(sf.view(torch.uint8), s.view(torch.uint8))
        live = (sf.float() != 0).repeat_interleave(16, dim=1)          # blocks whose scale did not underflow
        assert torch.equal(codes[live], nx.unpack_fp4(q)[live])
        n_live = int(live.sum())
        assert n_live > 0.5 * live.numel()
    tiny = torch.full((1, 16), 1e-6).to(torch.bfloat16)
    codes, sf = emu.quantize_rows(tiny, torch.tensor([1.0]))
    q, s = reference._nvfp4_quantize(tiny, torch.tensor([[1.0]]))
    assert sf.float().item() == 0 and s.float().item() == 0
    assert (codes == 7).all() and (nx.unpack_fp4(q) == 0).all()                  # 6 x 0 == 0 x 0


def test_the_emulator_refuses_what_the_contract_refuses(flashinfer):
    w13, w2 = _weights(12)
    x, tw, ti, a13, a2 = _inputs(13, torch.bfloat16, w13, per_expert_a13=True, m=4)
    t, meta = fm.FlashInferCutlassMoe().prepare(MoeSpec(E, H, I, torch.bfloat16, "w4a4", CPU), w13, w2, a13, a2)
    qs = [t["fc1_act_scale"], t["fc1_weight_sf"], t["fc1_alpha"], t["fc2_act_scale"], t["fc2_weight_sf"],
          t["fc2_alpha"]]
    ids, wts = ti.to(torch.int32), tw.float()
    q, s = reference.scaled_fp4_quant(x, a13[:1], swizzle=True)
    with pytest.raises(ValueError, match="per-expert act scale for pre-quantized"):
        emu.cutlass_fused_moe(q, ids, wts, t["fc1_weight"], t["fc2_weight"], torch.bfloat16, qs, input_sf=s)
    with pytest.raises(ValueError, match="int64"):
        emu.cutlass_fused_moe(x, ids, wts, t["fc1_weight"].view(torch.uint8), t["fc2_weight"], torch.bfloat16, qs)
    with pytest.raises(ValueError, match="int32"):
        emu.cutlass_fused_moe(x, ti.long(), wts, t["fc1_weight"], t["fc2_weight"], torch.bfloat16, qs)
    bad = list(qs)
    bad[1] = t["fc1_weight_sf"][:, :I]
    with pytest.raises(ValueError, match="fc1 weight block size"):
        emu.cutlass_fused_moe(x, ids, wts, t["fc1_weight"], t["fc2_weight"], torch.bfloat16, bad)
    with pytest.raises(ValueError, match="Expecting 6 quant scales"):
        emu.cutlass_fused_moe(x, ids, wts, t["fc1_weight"], t["fc2_weight"], torch.bfloat16, qs[:4])
    with pytest.raises(NotImplementedError):
        emu.cutlass_fused_moe(x, ids, wts, t["fc1_weight"], t["fc2_weight"], torch.bfloat16, qs, ep_size=2)
    out = emu.cutlass_fused_moe(x, ids, wts, t["fc1_weight"], t["fc2_weight"], torch.bfloat16, qs)
    assert isinstance(out, list) and out[0].shape == (4, H)                         # a list, output first
    assert math.isfinite(out[0].float().abs().max().item())


# --- B200 only (skipped elsewhere): what the CPU cannot prove --------------------------------------------------

@pytest.mark.sm100
@pytest.mark.parametrize("per_expert_a13", [False, True], ids=["shared_a13", "per_expert_a13"])
def test_b200_real_kernel_against_the_emulator_and_the_reference(monkeypatch, per_expert_a13):
    """The layer as selected on the GPU runs FlashInfer's real cutlass_fused_moe; the emulator on the same
    prepared tensors (CPU copies) and the reference backend give the same layer output up to what differs
    inside the kernel (rcp.approx in its quantizer, a fast exp, accumulation order, atomic combine). The
    bounds are first estimates from the CPU analysis: a failure here is a finding to read, not noise."""
    pytest.importorskip("flashinfer.fused_moe")
    monkeypatch.delenv(base.ENV_MOE_BACKEND, raising=False)
    monkeypatch.delenv(base.ENV_ACT_MODE, raising=False)
    dev = torch.device("cuda")
    w13, w2 = _weights(20)
    x, tw, ti, a13, a2 = _inputs(21, torch.bfloat16, w13, per_expert_a13=per_expert_a13, m=300, top_k=2)
    layer = Nvfp4FusedMoE(w13.to(dev), w2.to(dev), a13.to(dev), a2.to(dev))
    assert layer.backend.name == "flashinfer_cutlass_moe" and layer.mode == "w4a4"
    assert layer.meta.path == (fm.PATH_KERNEL_QUANT if per_expert_a13 else fm.PATH_OUR_QUANT)
    y = layer(x.to(dev), tw.to(dev), ti.to(dev)).cpu().double()
    spec = MoeSpec(E, H, I, torch.bfloat16, "w4a4", dev)
    rt, rm = ReferenceMoe().prepare(spec, w13.to(dev), w2.to(dev), a13.to(dev), a2.to(dev))
    y_ref = ReferenceMoe().apply(rt, rm, x.to(dev), tw.to(dev), ti.to(dev)).cpu().double()
    monkeypatch.setattr(fm, "flashinfer_module", lambda: _FusedMoe)
    emu.calls.clear()
    y_emu = fm.FlashInferCutlassMoe().apply({k: v.cpu() for k, v in layer.tensors.items()}, layer.meta, x, tw,
                                            ti).double()
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    near = ((y - y_emu).abs() <= 4 * _half_ulp(torch.bfloat16) * y_emu.abs().amax(1, True)).float().mean().item()
    print(f"B200 cutlass_fused_moe: vs emulator rel {rel(y, y_emu):.2e} ({near:.4f} within 2 ulps of the row max), "
          f"vs reference rel {rel(y, y_ref):.2e}")
    assert rel(y, y_emu) < 1e-2 and near > 0.99
    assert rel(y, y_ref) < 3e-2


@pytest.mark.sm100
def test_b200_forward_replays_in_a_cuda_graph(monkeypatch):
    """apply() makes no host sync and no data-dependent allocation: it captures in a CUDA graph, and a replay
    with new inputs in the same buffers equals an eager forward."""
    pytest.importorskip("flashinfer.fused_moe")
    monkeypatch.delenv(base.ENV_MOE_BACKEND, raising=False)
    monkeypatch.delenv(base.ENV_ACT_MODE, raising=False)
    dev = torch.device("cuda")
    w13, w2 = _weights(22)
    x, tw, ti, a13, a2 = _inputs(23, torch.bfloat16, w13, per_expert_a13=False, m=64, top_k=2)
    layer = Nvfp4FusedMoE(w13.to(dev), w2.to(dev), a13.to(dev), a2.to(dev))
    assert layer.backend.name == "flashinfer_cutlass_moe"
    xs, ws, ids = x.to(dev), tw.to(dev), ti.to(dev)
    layer.warmup(64, top_k=2)
    layer(xs, ws, ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(xs, ws, ids)
    x2, tw2, ti2, _, _ = _inputs(24, torch.bfloat16, w13, per_expert_a13=False, m=64, top_k=2)
    xs.copy_(x2), ws.copy_(tw2), ids.copy_(ti2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, layer(xs, ws, ids)) or \
        ((out.double() - layer(xs, ws, ids).double()).norm() / out.double().norm()).item() < 1e-3


# ------------------------------------------------------------------------------------------------
# The masked layout (expert-parallel low-latency dispatch) through FlashInfer's CuTe-DSL masked GEMM
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def masked_gemm(monkeypatch):
    """The masked kernel replaced by the bridge's emulation of its contract (rounded to the output dtype); the
    environment check (nvidia-cutlass-dsl, FlashInfer's kernel module) satisfied."""
    from nvfp4_plugin import cute_bridge as cb

    calls = []

    def run(operands, *, out=None, **kw):
        cb.check_masked_operands(operands)
        calls.append(operands)
        y = cb.reference_grouped_gemm(operands).to(operands.out_dtype)
        return y if out is None else out.copy_(y)

    monkeypatch.setattr(cb, "run_grouped_gemm", run)
    monkeypatch.setattr(fm, "masked_gemm_missing", lambda: None)
    return calls


@pytest.mark.parametrize("per_expert_a13", [False, True], ids=["shared_a13", "per_expert_a13"])
def test_masked_layout_through_the_cute_dsl_masked_gemm(flashinfer, masked_gemm, per_expert_a13):
    from nvfp4_plugin import cute_bridge as cb

    dtype, max_m = torch.bfloat16, 9
    w13, w2 = _weights(3)
    _, _, _, a13, a2 = _inputs(4, dtype, w13, per_expert_a13=per_expert_a13)
    x = (torch.randn(E, max_m, H, generator=torch.Generator().manual_seed(5)) * 2).to(dtype)
    mask = torch.tensor([0, 1, 9, 4, 12, 7], dtype=torch.int32)           # 12: more than max_m acts as max_m
    spec = MoeSpec(E, H, I, dtype, "w4a4", CPU)
    be = fm.FlashInferCutlassMoe()
    t, meta = be.prepare(spec, w13, w2, a13, a2)
    assert be.masked_unsupported(meta) is None
    out = torch.full_like(x, 7.0)
    be.apply_masked(t, meta, x, mask, out)
    ref_be = ReferenceMoe()
    rt, rmeta = ref_be.prepare(spec, w13, w2, a13, a2)
    out_ref = torch.full_like(x, 7.0)
    ref_be.apply_masked(rt, rmeta, x, mask, out_ref)
    rows = mask.clamp(max=max_m).tolist()
    valid = torch.arange(max_m)[None, :] < torch.tensor(rows)[:, None]
    assert (out[~valid] == 7.0).all()                                      # rows past the mask left as they were
    assert not emu.calls                                                   # cutlass_fused_moe is not involved

    # --- bit-exact: what the two GEMMs are handed ----------------------------------------------------------------
    g1, g2 = masked_gemm
    assert g1.b.data_ptr() == t["fc1_weight"].data_ptr() and g2.b.data_ptr() == t["fc2_weight"].data_ptr()
    assert g1.sfb.data_ptr() == t["fc1_weight_sf"].data_ptr() and g2.sfb.data_ptr() == t["fc2_weight_sf"].data_ptr()
    assert torch.equal(g1.alpha, t["fc1_alpha"]) and torch.equal(g2.alpha, t["fc2_alpha"])
    clamped = mask.clamp(max=max_m)                                        # the kernel never schedules past max_m
    assert torch.equal(g1.masked_m, clamped) and torch.equal(g2.masked_m, clamped)
    h = cb.reference_grouped_gemm(g1).to(dtype)                            # [E, max_m, 2I], FlashInfer's [up | gate]
    for e, m in enumerate(rows):
        if not m:
            continue
        for g, src, gs in ((g1, x[e, :m], a13[e]),
                           (g2, nx.silu_and_mul_fp32(torch.cat((h[e, :m, I:], h[e, :m, :I]), -1)), a2[e])):
            q, s = reference.scaled_fp4_quant(src, gs.reshape(1), swizzle=False)
            k = src.shape[1]
            assert torch.equal(cb.as_packed_bytes(g.a).permute(2, 0, 1)[e, :m], q)
            lin = nx.unswizzle_blockscale(g.sfa[e], max_m, k // 16)[:m]
            assert torch.equal(lin.view(torch.uint8), s.view(torch.uint8))

    # --- the layer output against the reference backend's masked path (GEMM rounding apart, as above) --------------
    err = (out[valid].double() - out_ref[valid].double()).norm() / out_ref[valid].double().norm()
    assert err < 3e-2, err


def test_masked_layout_availability(flashinfer, monkeypatch):
    """The layer takes the masked layout only where its GEMM can run, and says why not; a layer whose weights sent it
    to the reference path keeps the reference's masked path."""
    monkeypatch.setenv(base.ENV_ACT_MODE, "w4a4")
    monkeypatch.setattr(api, "select_backend", lambda kind, reg, spec, env: fm.FlashInferCutlassMoe())
    w13, w2 = _weights(7)
    _, _, _, a13, a2 = _inputs(8, torch.bfloat16, w13, per_expert_a13=False, m=5)
    layer = Nvfp4FusedMoE(w13, w2, a13, a2)
    monkeypatch.setattr(fm, "masked_gemm_missing", lambda: "its GEMM needs nvidia-cutlass-dsl")
    assert not layer.supports_masked
    x = torch.zeros(E, 4, H, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="flashinfer_cutlass_moe': its GEMM needs nvidia-cutlass-dsl"):
        layer.forward_masked(x, torch.ones(E, dtype=torch.int32))
    monkeypatch.setattr(fm, "masked_gemm_missing", lambda: None)
    assert layer.supports_masked
    w13d, w2d = _weights(7, gate_up_ratio=2.0)                              # not exact with one alpha: reference path
    ref_layer = Nvfp4FusedMoE(w13d, w2d, a13, a2)
    monkeypatch.setattr(fm, "masked_gemm_missing", lambda: "no DSL")
    assert ref_layer.meta.path == fm.PATH_REFERENCE and ref_layer.supports_masked
    out = ref_layer.forward_masked(torch.randn(E, 4, H).bfloat16(), torch.full((E,), 2, dtype=torch.int32))
    assert out.shape == (E, 4, H)
    # without the DSL installed, the real check names it (this CPU machine has no nvidia-cutlass-dsl)
    import importlib.util
    if importlib.util.find_spec("cutlass") is None:
        monkeypatch.undo()
        assert "nvidia-cutlass-dsl" in fm.masked_gemm_missing()


@pytest.mark.sm100
def test_b200_masked_layout_against_the_reference_and_in_a_cuda_graph(monkeypatch):
    """The masked layout on the real CuTe-DSL kernel: the layer output against the reference backend's masked path
    (bounds as for the standard path), rows past the mask untouched, and a CUDA-graph replay equal to eager."""
    pytest.importorskip("cutlass")
    pytest.importorskip("flashinfer.gemm.kernels.grouped_gemm_masked_blackwell")
    monkeypatch.delenv(base.ENV_MOE_BACKEND, raising=False)
    monkeypatch.delenv(base.ENV_ACT_MODE, raising=False)
    dev = torch.device("cuda")
    w13, w2 = _weights(30)
    _, _, _, a13, a2 = _inputs(31, torch.bfloat16, w13, per_expert_a13=True)
    layer = Nvfp4FusedMoE(w13.to(dev), w2.to(dev), a13.to(dev), a2.to(dev))
    assert layer.backend.name == "flashinfer_cutlass_moe" and layer.supports_masked
    max_m = 128
    x = (torch.randn(E, max_m, H) * 2).bfloat16().to(dev)
    mask = torch.tensor([0, 1, 17, 64, 128, 100], dtype=torch.int32, device=dev)
    out = torch.full_like(x, 7.0)
    layer.forward_masked(x, mask, out=out)
    spec = MoeSpec(E, H, I, torch.bfloat16, "w4a4", dev)
    rt, rm = ReferenceMoe().prepare(spec, w13.to(dev), w2.to(dev), a13.to(dev), a2.to(dev))
    ref = torch.full_like(x, 7.0)
    ReferenceMoe().apply_masked(rt, rm, x, mask, ref)
    valid = torch.arange(max_m, device=dev)[None, :] < mask.long()[:, None]
    assert (out[~valid] == 7.0).all()
    rel = ((out[valid].double() - ref[valid].double()).norm() / ref[valid].double().norm()).item()
    print(f"B200 masked layout: vs reference rel {rel:.2e}")
    assert rel < 3e-2
    static = torch.full_like(x, 7.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.forward_masked(x, mask, out=static)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static[valid], out[valid])
