"""Engine-neutral layers on the reference backend: equal to the reference linear / MoE (and the Hopper
backend's per-forward state, interpreted on the CPU)."""

import pytest
import torch

from nvfp4_plugin import reference as ref
from nvfp4_plugin.layers import Nvfp4FusedMoE, Nvfp4Linear
from nvfp4_plugin.layers.base import ENV_ACT_MODE, ENV_LINEAR_BACKEND
from nvfp4_plugin.weights import Nvfp4Weight


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_linear_matches_reference(mode, monkeypatch):
    monkeypatch.setenv(ENV_ACT_MODE, mode)
    g = torch.Generator().manual_seed(0)
    w = Nvfp4Weight.from_shards(*(lambda q: (q.packed, q.block_scale))(Nvfp4Weight.quantize(torch.randn(96, 128, generator=g))),
                                [50.0, 3.0, 900.0], [32, 32, 32])
    x = torch.randn(5, 128, generator=g).to(torch.bfloat16)
    bias = torch.randn(96, generator=g).to(torch.bfloat16)
    igs = torch.tensor([700.0])
    layer = Nvfp4Linear(w, igs)
    assert layer.mode == mode and layer.backend.name == "reference"
    y = layer(x, bias)
    # equal to the fp32 reference up to bf16 rounding of the dequantized operands and the output:
    # each product carries at most ~2 bf16 half-ulps of relative error
    expect = ref.nvfp4_linear(x, w.packed, w.block_scale, w.global_scale, bias, mode=mode, input_global_scale=igs)
    bound = 3 * 2 ** -8 * (x.double().abs() @ w.dequantize(torch.float64).abs().t() + bias.double().abs())
    assert ((y.double() - expect.double()).abs() <= bound + 1e-6).all()


def test_w4a4_without_input_scale_falls_back(monkeypatch):
    monkeypatch.setenv(ENV_ACT_MODE, "w4a4")
    layer = Nvfp4Linear(Nvfp4Weight.quantize(torch.randn(16, 32)), None)
    assert layer.mode == "w4a16"


def test_forced_unknown_backend_errors(monkeypatch):
    monkeypatch.setenv(ENV_LINEAR_BACKEND, "nope")
    with pytest.raises(ValueError, match="NVFP4_PLUGIN_LINEAR_BACKEND='nope': unknown linear backend"):
        Nvfp4Linear(Nvfp4Weight.quantize(torch.randn(16, 32)))


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_moe_matches_reference(mode, monkeypatch):
    monkeypatch.setenv(ENV_ACT_MODE, mode)
    g = torch.Generator().manual_seed(1)
    e, h, inter, t = 4, 64, 32, 9
    w13 = Nvfp4Weight.quantize(torch.randn(e, 2 * inter, h, generator=g))
    w2 = Nvfp4Weight.quantize(torch.randn(e, h, inter, generator=g) * 0.2)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    tw, ti = ref.route_topk(torch.randn(t, e, generator=g), 2)
    ti[:, :] = torch.where(ti == 3, torch.zeros_like(ti), ti)  # expert 3 gets no tokens
    tw[0, 1], ti[0, 1] = tw[0, 1], (ti[0, 0] + 1) % 3
    a13, a2 = torch.full((e,), 400.0), torch.full((e,), 1500.0)
    layer = Nvfp4FusedMoE(w13, w2, a13, a2)
    y = layer(x, tw, ti)
    expect = ref.nvfp4_fused_moe(x, w13.packed, w13.block_scale, w13.global_scale, w2.packed, w2.block_scale,
                                 w2.global_scale, tw, ti, mode=mode, a13_global_scale=a13, a2_global_scale=a2)
    err = (y.double() - expect.double()).norm() / expect.double().norm()
    # bf16 operands vs the fp32 reference; in w4a4 a slightly different intermediate can also flip an
    # activation's FP4 code (one grid step), hence the looser bound
    assert err < (1e-2 if mode == "w4a16" else 3e-2)
    with pytest.raises(ValueError, match="w2: expected"):
        Nvfp4FusedMoE(w13, Nvfp4Weight.quantize(torch.randn(e, h, 2 * inter)))


def test_forward_ops_take_the_layer_handle_not_its_tensors():
    """A compiled graph must not depend on which backend prepared a layer (engines cache graphs on
    disk keyed without our backend choice): the custom op's arguments are x, bias and the handle."""
    import torch.library  # noqa: F401

    schema = str(torch.ops.nvfp4_layers.linear.default._schema)
    assert schema.startswith("nvfp4_layers::linear(Tensor x, Tensor? bias, Tensor handle)"), schema
    assert str(torch.ops.nvfp4_layers.fused_moe.default._schema).startswith(
        "nvfp4_layers::fused_moe(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor handle)")
    w = Nvfp4Weight.quantize(torch.randn(16, 32))
    layer = Nvfp4Linear(w)
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    y = layer(x)
    params = {k: torch.nn.Parameter(v.clone(), requires_grad=False) for k, v in layer.tensors.items()}
    layer.use_tensors(params)
    assert torch.equal(layer(x), y)
    with pytest.raises(ValueError, match="tensors: expected keys"):
        layer.use_tensors({})


def test_hopper_backend_rebuilds_its_packed_weights_only_for_another_tensor_dict():
    # the forward keeps the PackedW4Weight of the last call's tensor dict (host time of every eager step);
    # a layer that swaps in other tensors (use_tensors: a new dict) gets them used at its next forward
    from nvfp4_plugin.layers.backends.hopper import HopperLinear
    from nvfp4_plugin.layers.base import LinearSpec

    # (the kernels run on the GPU where there is one: outside the interpreter they cannot read CPU tensors)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(5)
    backend = HopperLinear()
    t, meta = backend.prepare(LinearSpec(32, 64, torch.bfloat16, "w4a16", dev),
                              Nvfp4Weight.quantize(torch.randn(32, 64, generator=g).to(dev)), None)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16).to(dev)
    y = backend.apply(t, meta, x)
    (w,) = backend._weights(t, ("w_", meta[0]))
    assert backend._weights(t, ("w_", meta[0]))[0] is w and w.words is t["w_words"]
    t2 = {k: v.clone() for k, v in t.items()}
    t2["w_alpha"] = t2["w_alpha"] * 2          # a power of two: the output doubles exactly
    assert torch.equal(backend.apply(t2, meta, x), y * 2)
    assert backend._weights(t2, ("w_", meta[0]))[0].words is t2["w_words"]
