"""The nvfp4 fused-MoE method inside SGLang 0.5.17's FusedMoE layer, loaded through SGLang's own MoE
weight loader from per-expert checkpoint tensors (both formats), with simulated TP=2 and EP=2.

SGLang's router needs its CUDA kernels, so routing comes from reference.route_topk and enters the
layer as SGLang's StandardTopKOutput; FusedMoE.forward then runs its standard dispatcher, our
method and the combine, as in a server."""

from unittest import mock

import pytest
import torch

from tests._require import require

sglang = require("sglang")

from nvfp4_plugin.engines import common as engines_common  # noqa: E402
from nvfp4_plugin import reference as ref  # noqa: E402
from nvfp4_plugin.weights import Nvfp4Weight  # noqa: E402

from .sglang_harness import (FORMATS, MODELOPT, expert_checkpoint, load_experts, module_tensors,  # noqa: E402
                             simulated_tp, start, topk_output, unique_layer)

start()

from sglang.srt.layers.moe.fused_moe_triton import FusedMoE  # noqa: E402
from sglang.srt.layers.moe.utils import MoeRunnerBackend, get_flags  # noqa: E402

from nvfp4_plugin.engines.sglang.config import Nvfp4SglangConfig  # noqa: E402
from nvfp4_plugin.engines.sglang.moe import Nvfp4SglangFusedMoEMethod  # noqa: E402

E, H, INTER, T, TOPK = 4, 64, 64, 7, 2


def experts(seed=2, e=E, h=H, inter=INTER):
    g = torch.Generator().manual_seed(seed)
    gates = [Nvfp4Weight.quantize(torch.randn(inter, h, generator=g) * (1 + ex)) for ex in range(e)]
    ups = [Nvfp4Weight.quantize(torch.randn(inter, h, generator=g) * 0.1) for _ in range(e)]  # w1 != w3 scales
    downs = [Nvfp4Weight.quantize(torch.randn(h, inter, generator=g)) for _ in range(e)]
    x = torch.randn(T, h, generator=g).to(torch.bfloat16)
    tw, ti = ref.route_topk(torch.randn(T, e, generator=g), TOPK)
    return gates, ups, downs, x, tw, ti


def make_moe(quant_config, e=E, h=H, inter=INTER, **kw):
    return FusedMoE(num_experts=e, hidden_size=h, intermediate_size=inter, layer_id=0, top_k=TOPK,
                    params_dtype=torch.bfloat16, quant_config=quant_config, prefix=unique_layer(), **kw)


def reference(fmt, gates, ups, downs, x, tw, ti, mode, a13=None, a2=None):
    def g(q):  # the encode scales the loader ends up with (ModelOpt stores the reciprocal)
        return 1.0 / (1.0 / q.global_scale) if fmt == "modelopt" else q.global_scale

    w13 = torch.stack([torch.cat([a.packed, b.packed]) for a, b in zip(gates, ups)])
    w13s = torch.stack([torch.cat([a.block_scale, b.block_scale]) for a, b in zip(gates, ups)])
    w13g = torch.stack([torch.cat([g(a), g(b)]) for a, b in zip(gates, ups)])
    w2 = torch.stack([d.packed for d in downs])
    w2s = torch.stack([d.block_scale for d in downs])
    w2g = torch.stack([g(d) for d in downs])
    kw = {}
    if mode == "w4a4":
        kw = dict(mode="w4a4", a13_global_scale=a13, a2_global_scale=a2)
    return ref.nvfp4_fused_moe(x, w13, w13s, w13g, w2, w2s, w2g, tw, ti, **kw).double()


def act_scale(fmt, amax, e=E):
    a = torch.full((e,), 2688.0 / amax)
    return 1.0 / (1.0 / a) if fmt == "modelopt" else a


@pytest.mark.parametrize("fmt,cfg", FORMATS)
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2)])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_moe_load_and_forward(fmt, cfg, tp, ep, mode, monkeypatch):
    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", mode)
    gates, ups, downs, x, tw, ti = experts()
    ckpt = expert_checkpoint(fmt, gates, ups, downs)
    quant_config = Nvfp4SglangConfig.from_config(cfg)
    total = 0
    # with EP the standard dispatcher builds its expert map on get_device(): cpu here
    with mock.patch("sglang.srt.layers.moe.token_dispatcher.standard.get_device", return_value="cpu"):
        for rank in range(tp):
            with simulated_tp(tp, rank, ep_size=ep):
                moe = make_moe(quant_config)
                assert isinstance(moe.quant_method, Nvfp4SglangFusedMoEMethod)
                assert moe.num_local_experts == E // ep and moe.intermediate_size_per_partition == INTER * ep // tp
                loaded = load_experts(moe, ckpt)
                suffixes = {k.split(".", 2)[2] for k, _ in ckpt}
                assert loaded == {f"experts.{w}_{s}" for w in ("w13", "w2") for s in suffixes}
                assert moe.nvfp4_core.mode == mode
                assert not any(n.startswith("w13_weight") for n, _ in moe.named_parameters())
                total = total + moe(x, topk_output(tw, ti)).double()  # partial sums: the all-reduce
    a = act_scale(fmt, 5.0)
    exp = reference(fmt, gates, ups, downs, x, tw, ti, mode, a, a)
    err = (total - exp).norm() / exp.norm()
    assert err < (1e-2 if mode == "w4a16" else 4e-2), err


def test_modelopt_gate_and_up_input_scales_are_kept_apart(monkeypatch):
    """SGLang's loader keeps one ModelOpt input_scale per expert (the last of gate/up); we keep both
    and use the safe one (the smaller encode scale), whatever order they arrive in."""
    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", "w4a4")
    gates, ups, downs, x, tw, ti = experts(seed=4)
    ckpt = []
    for e, (gq, uq, dq) in enumerate(zip(gates, ups, downs)):
        for name, q, amax in (("up_proj", uq, 2.0 + e), ("gate_proj", gq, 7.0), ("down_proj", dq, 3.0)):
            ckpt += [(f"{e}.{name}.{k}", v) for k, v in module_tensors("modelopt", q, amax).items()]
    moe = make_moe(Nvfp4SglangConfig.from_config(MODELOPT))
    load_experts(moe, ckpt)
    want = torch.minimum(act_scale("modelopt", 7.0), torch.stack([act_scale("modelopt", 2.0 + e)[0] for e in range(E)]))
    assert torch.equal(moe.nvfp4_a13_global_scale, want)
    exp = reference("modelopt", gates, ups, downs, x, tw, ti, "w4a4", want, act_scale("modelopt", 3.0))
    assert (moe(x, topk_output(tw, ti)).double() - exp).norm() / exp.norm() < 4e-2


def test_routed_scaling_factor_and_empty_batch(monkeypatch):
    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", "w4a16")
    gates, ups, downs, x, tw, ti = experts(seed=5)
    moe = make_moe(Nvfp4SglangConfig.from_config(MODELOPT), routed_scaling_factor=2.5)
    load_experts(moe, expert_checkpoint("modelopt", gates, ups, downs))
    assert not moe.should_fuse_routed_scaling_factor_in_topk
    exp = 2.5 * reference("modelopt", gates, ups, downs, x, tw, ti, "w4a16")
    assert (moe(x, topk_output(tw, ti)).double() - exp).norm() / exp.norm() < 1e-2
    out = moe(x[:0], topk_output(tw[:0], ti[:0]))  # idle batches (DP attention) reach the experts empty
    assert out.shape == (0, H)


def test_mixtral_names_and_missing_input_scale_for_w2_only():
    moe = make_moe(Nvfp4SglangConfig.from_config(MODELOPT), e=2, h=32, inter=32)
    g = torch.Generator().manual_seed(6)
    qs = [[Nvfp4Weight.quantize(torch.randn(32, 32, generator=g)) for _ in range(3)] for _ in range(2)]
    ckpt = expert_checkpoint("modelopt", *zip(*qs), names=("w1", "w3", "w2"))
    ckpt = [(k, v) for k, v in ckpt if not (k.endswith("w2.input_scale"))]
    with pytest.raises(ValueError, match="input scales present for only one of w13/w2"):
        load_experts(moe, ckpt, ckpt_names=("w1", "w3", "w2"))


def test_corrupt_expert_scale_names_expert_and_tensor():
    moe = make_moe(Nvfp4SglangConfig.from_config(MODELOPT), e=2, h=32, inter=32)
    prefix = moe.layer_name
    g = torch.Generator().manual_seed(7)
    qs = [[Nvfp4Weight.quantize(torch.randn(32, 32, generator=g)) for _ in range(3)] for _ in range(2)]
    ckpt = expert_checkpoint("modelopt", *zip(*qs))
    ckpt = [(k, torch.tensor(-1.0) if k == "1.up_proj.weight_scale_2" else v) for k, v in ckpt]
    with pytest.raises(ValueError, match=rf"expert 1 up projection: tensor '{prefix}.1.w3.weight_scale_2': "
                                         r"weight_scale_2 must be finite and > 0, got -1.0"):
        load_experts(moe, ckpt)


def test_unsupported_runner_backend_and_activation_are_refused():
    quant_config = Nvfp4SglangConfig.from_config(MODELOPT)
    with pytest.raises(NotImplementedError, match="SiLU-and-mul experts .*'activation': 'gelu'"):
        make_moe(quant_config, activation="gelu")
    with get_flags().moe.override(runner_backend=MoeRunnerBackend.FLASHINFER_CUTLASS):
        with pytest.raises(NotImplementedError, match="leave --moe-runner-backend at auto"):
            make_moe(quant_config)


def test_excluded_moe_layer_falls_back_to_sglang_unquantized():
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

    cfg = Nvfp4SglangConfig.from_config({**MODELOPT, "ignore": ["lm_head", "model.layers.*.mlp.experts*"]})
    assert isinstance(make_moe(cfg).quant_method, UnquantizedFusedMoEMethod)


def test_max_of_gate_up_scales_would_fail_the_moe_test(monkeypatch):
    """Mutation check: one global scale per expert for gate and up (the max, as the built-in loaders
    keep it) must break the tolerance test_moe_load_and_forward asserts."""
    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", "w4a16")
    real_build = engines_common.build_weight

    def build_with_max_of_shards(prefix, fmt, packed, block_scale, shard_globals, sizes):
        return real_build(prefix, fmt, packed, block_scale,
                          shard_globals.amax(-1, keepdim=True).expand_as(shard_globals).clone(), sizes)

    monkeypatch.setattr(engines_common, "build_weight", build_with_max_of_shards)
    gates, ups, downs, x, tw, ti = experts()
    moe = make_moe(Nvfp4SglangConfig.from_config(MODELOPT))
    load_experts(moe, expert_checkpoint("modelopt", gates, ups, downs))
    exp = reference("modelopt", gates, ups, downs, x, tw, ti, "w4a16")
    assert (moe(x, topk_output(tw, ti)).double() - exp).norm() / exp.norm() > 1e-2


def test_expert_tensor_of_the_wrong_size_is_refused_by_name():
    """FusedMoE would copy a smaller expert tensor into the leading rows without complaint."""
    moe = make_moe(Nvfp4SglangConfig.from_config(MODELOPT), e=2, h=32, inter=64)
    g = torch.Generator().manual_seed(9)
    qs = [[Nvfp4Weight.quantize(torch.randn(*s, generator=g)) for s in ((32, 32), (32, 32), (32, 32))]
          for _ in range(2)]
    with pytest.raises(ValueError, match=rf"expert 0 gate projection: tensor '{moe.layer_name}.0.w1.weight': "
                                         r"shape: expected \[64, 16\] for SGLang's FusedMoE .*intermediate 64 "
                                         r".*got \[32, 16\]"):
        load_experts(moe, expert_checkpoint("modelopt", *zip(*qs)))
