"""Engine-neutral helpers of the engine adapter tests: checkpoint tensors of one module in either
format, what the checkpoint says the weight is, the dense reference, error bounds, and loading
through a layer's own weight loaders (the same in vLLM and SGLang)."""

from __future__ import annotations

import torch

from nvfp4_plugin import reference as ref
from nvfp4_plugin.weights import Nvfp4Weight

#: quantization_config of a calibrated (W4A4) checkpoint in each format
MODELOPT = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["lm_head"]}
CT = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
      "config_groups": {"group_0": {"targets": ["Linear"],
                                    "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                "group_size": 16},
                                    "input_activations": {"num_bits": 4, "type": "float",
                                                          "strategy": "tensor_group", "group_size": 16,
                                                          "dynamic": "local"}}}}



def checkpoint_tensors(fmt, w: torch.Tensor, act_amax: float):
    """One module's tensors as the checkpoint format stores them (quantized with its own global scale)."""
    return module_tensors(fmt, Nvfp4Weight.quantize(w), act_amax)


def module_tensors(fmt, q: Nvfp4Weight, act_amax: float | None = 5.0):
    gs = q.global_scale[0]
    igs = None if act_amax is None else torch.tensor(2688.0 / act_amax)
    if fmt == "modelopt":
        t = {"weight": q.packed, "weight_scale": q.block_scale, "weight_scale_2": 1.0 / gs}
        if igs is not None:
            t["input_scale"] = 1.0 / igs
        return t
    t = {"weight_packed": q.packed, "weight_scale": q.block_scale, "weight_global_scale": gs.reshape(1)}
    if igs is not None:
        t["input_global_scale"] = igs.reshape(1)
    return t


def canonical(fmt, t):
    """What the checkpoint says the weight is (ModelOpt's decode scales inverted, as the loader does)."""
    if fmt == "modelopt":
        return t["weight"], t["weight_scale"], (1.0 / t["weight_scale_2"]).reshape(1)
    return t["weight_packed"], t["weight_scale"], t["weight_global_scale"].reshape(1)


def input_encode_scale(fmt, t) -> torch.Tensor:
    return ((1.0 / t["input_scale"]) if fmt == "modelopt" else t["input_global_scale"]).reshape(())


def dequantized(fmt, t) -> torch.Tensor:
    p, s, g = canonical(fmt, t)
    return ref.dequantize_fp4(p, s, g, swizzled=False, m=p.shape[0], k=p.shape[1] * 2)


def dense_reference(fmt, shards, x, mode, input_scale: torch.Tensor | None = None):
    """Reference output of a fused layer: each shard with its own global scale; in w4a4 one input
    scale for the shared input (``input_scale``, default: the smallest of the shards')."""
    if mode == "w4a4" and input_scale is None:
        input_scale = torch.stack([input_encode_scale(fmt, t) for t in shards]).min()
    outs = []
    for t in shards:
        p, s, g = canonical(fmt, t)
        kw = dict(mode="w4a4", input_global_scale=input_scale.reshape(1)) if mode == "w4a4" else {}
        outs.append(ref.nvfp4_linear(x, p, s, g.expand(p.shape[0]).contiguous(), **kw))
    return torch.cat(outs, dim=-1)


def error_bound(x, deq_shards):
    """Elementwise bound for bf16 activations times the dequantized weight: the engine rounds the
    dequantized weight and the product to bf16, the reference computes in fp32 (3 bf16 ulps)."""
    return 3 * 2 ** -8 * (x.double().abs() @ torch.cat(deq_shards).abs().double().t()) + 1e-6


def load_linear(layer, tensors_by_shard):
    """Feed checkpoint tensors through each parameter's weight loader, as SGLang's model loaders do."""
    for shard_id, tensors in tensors_by_shard:
        for name, t in tensors.items():
            param = getattr(layer, name)
            if shard_id is None:
                param.weight_loader(param, t)
            else:
                param.weight_loader(param, t, shard_id)
    layer.quant_method.process_weights_after_loading(layer)


def expert_checkpoint(fmt, gates, ups, downs, act_amax=5.0, names=("gate_proj", "up_proj", "down_proj")):
    """Per-expert checkpoint tensors ``[(f"{e}.{proj}.{suffix}", tensor)]``."""
    out = []
    for e, qs in enumerate(zip(gates, ups, downs)):
        for name, q in zip(names, qs):
            out += [(f"{e}.{name}.{k}", v) for k, v in module_tensors(fmt, q, act_amax).items()]
    return out


def assert_bad_gate_up_tensors_are_named(gate_up, engine: str):
    """``gate_up()``: a fresh ModelOpt-quantized MergedColumnParallelLinear(64, [32, 32]) of ``engine``
    at ``model.layers.1.mlp.gate_up_proj`` (TP 1). Each broken checkpoint tensor fails by its
    checkpoint name (the shard's module), with what was expected and what came."""
    import pytest

    ck = [checkpoint_tensors("modelopt", torch.randn(32, 64), 2.0) for _ in range(2)]
    layer = gate_up()
    assert layer.nvfp4_prefix == "model.layers.1.mlp.gate_up_proj"
    bad = dict(ck[1], weight_scale=ck[1]["weight_scale"].view(torch.uint8))
    with pytest.raises(ValueError, match=r"tensor 'model.layers.1.mlp.up_proj.weight_scale': dtype: expected "
                                         r"float8_e4m3fn block scales, got uint8"):
        load_linear(layer, [(0, ck[0]), (1, bad)])
    partial = {k: v for k, v in ck[1].items() if k != "weight"}
    with pytest.raises(ValueError, match=r"tensor 'model.layers.1.mlp.up_proj.weight': missing in the checkpoint"):
        load_linear(gate_up(), [(0, ck[0]), (1, partial)])
    too_wide = checkpoint_tensors("modelopt", torch.randn(32, 128), 2.0)
    with pytest.raises(ValueError, match=rf"tensor 'model.layers.1.mlp.up_proj.weight': shape: expected \[32, 32\] "
                                         rf"for {engine}'s MergedColumnParallelLinear .*got \[32, 64\]"):
        load_linear(gate_up(), [(0, ck[0]), (1, too_wide)])
    no_scale = {k: v for k, v in ck[1].items() if k != "weight_scale_2"}
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.gate_up_proj.weight_scale_2': missing in the "
                                         r"checkpoint for shard\(s\)/expert\(s\) \[\[1\]\]"):
        load_linear(gate_up(), [(0, ck[0]), (1, no_scale)])
    nan_blocks = dict(ck[1], weight_scale=torch.full_like(ck[1]["weight_scale"], float("nan")))
    with pytest.raises(ValueError, match=r"gate_up_proj.weight_scale': 128 block scale\(s\) are NaN "
                                         r"\(first at index \[32, 0\]\)"):
        load_linear(gate_up(), [(0, ck[0]), (1, nan_blocks)])
