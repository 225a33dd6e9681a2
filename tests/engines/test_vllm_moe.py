"""The nvfp4 fused-MoE method inside vLLM 0.26's FusedMoE layer, loaded through vLLM's own MoE
weight loader from per-expert checkpoint tensors (both formats), with simulated TP=2.

vLLM's router needs its compiled kernels, so routing comes from reference.route_topk and the
routed experts are run through RoutedExperts.forward_modular (what the runner calls)."""

import pytest
import torch

from tests._require import require

vllm = require("vllm")

from nvfp4_plugin import reference as ref  # noqa: E402
from nvfp4_plugin.weights import Nvfp4Weight  # noqa: E402

from .ckpt_helpers import module_tensors  # noqa: E402
from .test_vllm_linear import CT, MODELOPT  # noqa: E402
from .vllm_harness import simulated_tp, start, unique_layer  # noqa: E402

start()

from vllm.model_executor.layers.fused_moe import FusedMoE  # noqa: E402

from nvfp4_plugin.engines.vllm.config import Nvfp4VllmConfig  # noqa: E402
from nvfp4_plugin.engines.vllm.moe import Nvfp4VllmFusedMoEMethod  # noqa: E402


expert_tensors = module_tensors


def loaded_gs(fmt, q):
    return (1.0 / (1.0 / q.global_scale)) if fmt == "modelopt" else q.global_scale


@pytest.mark.parametrize("fmt,cfg", [("modelopt", MODELOPT), ("compressed-tensors", CT)])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_moe_load_and_apply(fmt, cfg, tp, mode, monkeypatch):
    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", mode)
    g = torch.Generator().manual_seed(2)
    e, h, inter, t, topk = 4, 64, 64, 7, 2
    gates = [Nvfp4Weight.quantize(torch.randn(inter, h, generator=g) * (1 + ex)) for ex in range(e)]
    ups = [Nvfp4Weight.quantize(torch.randn(inter, h, generator=g) * 0.1) for _ in range(e)]  # w1 != w3 scales
    downs = [Nvfp4Weight.quantize(torch.randn(h, inter, generator=g)) for _ in range(e)]
    ckpt = []
    for ex in range(e):
        for name, q in (("gate_proj", gates[ex]), ("up_proj", ups[ex]), ("down_proj", downs[ex])):
            ckpt += [(f"{ex}.{name}.{k}", v) for k, v in expert_tensors(fmt, q).items()]
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    tw, ti = ref.route_topk(torch.randn(t, e, generator=g), topk)
    quant_config = Nvfp4VllmConfig.from_config(cfg)
    total = 0
    for rank in range(tp):
        with simulated_tp(tp, rank):
            moe = FusedMoE(num_experts=e, top_k=topk, hidden_size=h, intermediate_size=inter,
                           params_dtype=torch.bfloat16, quant_config=quant_config, tp_size=tp,
                           prefix=unique_layer())
            experts = moe.routed_experts
            assert isinstance(experts.quant_method, Nvfp4VllmFusedMoEMethod)
            loaded = set(experts.load_weights(ckpt))
            assert {"w13_" + k.split(".")[-1] for k, _ in ckpt} <= loaded | {"w13_input_scale", "w13_input_global_scale"}
            experts.quant_method.process_weights_after_loading(experts)
            assert experts.nvfp4_core.mode == mode
            total = total + experts.forward_modular(x, tw, ti).double()  # TP partial sums (all-reduce)
    w13 = torch.stack([torch.cat([a.packed, b.packed]) for a, b in zip(gates, ups)])
    w13s = torch.stack([torch.cat([a.block_scale, b.block_scale]) for a, b in zip(gates, ups)])
    w13g = torch.stack([torch.cat([loaded_gs(fmt, a), loaded_gs(fmt, b)]) for a, b in zip(gates, ups)])
    w2 = torch.stack([d.packed for d in downs])
    w2s = torch.stack([d.block_scale for d in downs])
    w2g = torch.stack([loaded_gs(fmt, d) for d in downs])
    kw = {}
    if mode == "w4a4":
        a = torch.full((e,), 2688.0 / 5.0)
        a = 1.0 / (1.0 / a) if fmt == "modelopt" else a
        kw = dict(mode="w4a4", a13_global_scale=a, a2_global_scale=a)
    exp = ref.nvfp4_fused_moe(x, w13, w13s, w13g, w2, w2s, w2g, tw, ti, **kw).double()
    err = (total - exp).norm() / exp.norm()
    assert err < (1e-2 if mode == "w4a16" else 4e-2), err


def test_moe_missing_input_scale_for_w2_only_is_an_error():
    quant_config = Nvfp4VllmConfig.from_config(MODELOPT)
    moe = FusedMoE(num_experts=2, top_k=1, hidden_size=32, intermediate_size=32, params_dtype=torch.bfloat16,
                   quant_config=quant_config, prefix=unique_layer())
    experts = moe.routed_experts
    ckpt = []
    for ex in range(2):
        for name in ("gate_proj", "up_proj", "down_proj"):
            q = Nvfp4Weight.quantize(torch.randn(32, 32))
            t = expert_tensors("modelopt", q)
            if name == "down_proj":
                del t["input_scale"]
            ckpt += [(f"{ex}.{name}.{k}", v) for k, v in t.items()]
    list(experts.load_weights(ckpt))
    with pytest.raises(ValueError, match="input scales present for only one of w13/w2"):
        experts.quant_method.process_weights_after_loading(experts)


def moe_layer(quant_config, e=2, h=32, inter=32):
    moe = FusedMoE(num_experts=e, top_k=1, hidden_size=h, intermediate_size=inter, params_dtype=torch.bfloat16,
                   quant_config=quant_config, prefix=unique_layer())
    return moe.routed_experts


def test_modelopt_gate_and_up_input_scales_are_kept_apart(monkeypatch):
    """vLLM's loader keeps one ModelOpt input_scale per expert (the last of gate/up); we keep both
    and use the safe one (the smaller encode scale), whatever order they arrive in."""
    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", "w4a4")
    g = torch.Generator().manual_seed(4)
    experts = moe_layer(Nvfp4VllmConfig.from_config(MODELOPT))
    assert experts.nvfp4_prefix == experts.layer_name
    ckpt = []
    for ex in range(2):
        order = (("up_proj", 2.0 + ex), ("gate_proj", 7.0)) if ex == 0 else (("gate_proj", 7.0), ("up_proj", 2.0 + ex))
        for name, amax in (*order, ("down_proj", 3.0)):
            q = Nvfp4Weight.quantize(torch.randn(32, 32, generator=g))
            ckpt += [(f"{ex}.{name}.{k}", v) for k, v in expert_tensors("modelopt", q, amax).items()]
    list(experts.load_weights(ckpt))
    experts.quant_method.process_weights_after_loading(experts)
    encode = lambda amax: 1.0 / (1.0 / torch.tensor(2688.0 / amax))  # noqa: E731  (ModelOpt stores the reciprocal)
    want = torch.stack([torch.minimum(encode(7.0), encode(2.0 + ex)) for ex in range(2)])
    assert torch.equal(experts.nvfp4_a13_global_scale, want)


def test_expert_tensor_of_the_wrong_size_is_refused_by_name():
    """vLLM's loader would copy a smaller expert tensor into the leading rows without complaint."""
    experts = moe_layer(Nvfp4VllmConfig.from_config(MODELOPT), inter=64)
    q = Nvfp4Weight.quantize(torch.randn(32, 32))
    ckpt = [(f"0.gate_proj.{k}", v) for k, v in expert_tensors("modelopt", q).items()]
    with pytest.raises(ValueError, match=rf"expert 0 gate projection: tensor '{experts.layer_name}.0.w1.weight': "
                                         r"shape: expected \[64, 16\] for vLLM's RoutedExperts .*intermediate 64 "
                                         r".*got \[32, 16\]"):
        list(experts.load_weights(ckpt))


def test_corrupt_expert_scale_names_expert_and_tensor():
    experts = moe_layer(Nvfp4VllmConfig.from_config(MODELOPT))
    t = expert_tensors("modelopt", Nvfp4Weight.quantize(torch.randn(32, 32)))
    t["weight_scale_2"] = torch.tensor(-1.0)
    with pytest.raises(ValueError, match=rf"expert 1 up projection: tensor '{experts.layer_name}.1.w3.weight_scale_2': "
                                         r"weight_scale_2 must be finite and > 0, got -1.0"):
        list(experts.load_weights([(f"1.up_proj.{k}", v) for k, v in t.items()]))


def test_missing_expert_fails_by_name_after_loading():
    """Block scales start NaN: an expert the checkpoint lacks is named, not served as zeros."""
    experts = moe_layer(Nvfp4VllmConfig.from_config(MODELOPT))
    ckpt = []
    for name in ("gate_proj", "up_proj", "down_proj"):
        q = Nvfp4Weight.quantize(torch.randn(32, 32))
        ckpt += [(f"0.{name}.{k}", v) for k, v in expert_tensors("modelopt", q).items()]
    list(experts.load_weights(ckpt))
    with pytest.raises(ValueError, match=rf"{experts.layer_name}.w13.*weight_scale_2': missing in the checkpoint "
                                         r"for shard\(s\)/expert\(s\) \[\[1, 0\], \[1, 1\]\]"):
        experts.quant_method.process_weights_after_loading(experts)
