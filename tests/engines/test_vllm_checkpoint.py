"""vLLM layers loaded from real `nvfp4-plugin quantize` output (make-model Qwen3-MoE, both formats),
with simulated TP=2: attention q/k/v, the MoE experts, and the dense reference on the same tensors."""

import json

import pytest
import torch

from tests._require import require

vllm = require("vllm")
safetensors = require("safetensors.torch")

from nvfp4_plugin import reference as ref  # noqa: E402
from nvfp4_plugin.checkpoints import make_model, quantize_checkpoint  # noqa: E402

from .ckpt_helpers import canonical, dense_reference  # noqa: E402
from .ckpt_helpers import error_bound as bound  # noqa: E402
from .ckpt_helpers import load_linear as load  # noqa: E402
from .vllm_harness import simulated_tp, start, unique_layer  # noqa: E402

start()

from vllm.model_executor.layers.fused_moe import FusedMoE  # noqa: E402
from vllm.model_executor.layers.linear import QKVParallelLinear  # noqa: E402

from nvfp4_plugin.engines.vllm.config import Nvfp4VllmConfig  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    make_model(root / "src", arch="qwen3_moe", size="tiny", seed=3, device="cpu")
    out = {}
    for fmt in ("modelopt", "compressed-tensors"):
        quantize_checkpoint(root / "src", root / fmt, format=fmt, device="cpu")
        tensors = {}
        for f in sorted((root / fmt).glob("*.safetensors")):
            tensors.update(safetensors.load_file(str(f)))
        out[fmt] = (root / fmt, tensors)
    return json.loads((root / "src" / "config.json").read_text()), out


def module(tensors, prefix):
    return {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_attention_and_experts_from_quantize_output(checkpoints, fmt, mode, monkeypatch):
    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", mode)
    cfg, out = checkpoints
    path, tensors = out[fmt]
    quant_config = Nvfp4VllmConfig.from_config(json.loads((path / "config.json").read_text())["quantization_config"])
    assert quant_config.spec.format == fmt and quant_config.spec.activations_quantized
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, h, generator=g) * 0.5).to(torch.bfloat16)
    attn = "model.layers.0.self_attn"
    shards = [module(tensors, f"{attn}.{p}_proj") for p in "qkv"]
    tp = 2
    parts = []
    for rank in range(tp):
        with simulated_tp(tp, rank):
            layer = QKVParallelLinear(h, hd, heads, kv, bias=False, quant_config=quant_config,
                                      prefix=f"{attn}.qkv_proj", params_dtype=torch.bfloat16)
            load(layer, list(zip("qkv", shards)))
            parts.append(layer(x)[0])
    # fewer kv heads than ranks: vLLM replicates them, each rank holds one
    nq, nk = heads * hd // tp, max(1, kv // tp) * hd
    kv_ranks = range(0, tp, max(1, tp // kv))
    got = torch.cat([torch.cat([parts[r][:, :nq] for r in range(tp)], -1),
                     torch.cat([parts[r][:, nq:nq + nk] for r in kv_ranks], -1),
                     torch.cat([parts[r][:, nq + nk:] for r in kv_ranks], -1)], -1)
    expect = dense_reference(fmt, shards, x, mode)
    if mode == "w4a16":
        deq = [ref.dequantize_fp4(*canonical(fmt, s)[:2], canonical(fmt, s)[2], swizzled=False,
                                  m=canonical(fmt, s)[0].shape[0], k=h) for s in shards]
        assert ((got.double() - expect.double()).abs() <= bound(x, deq) + 1e-6).all()
    else:
        assert (got.double() - expect.double()).norm() / expect.double().norm() < 3e-2

    # the MoE layer of the same block, through vLLM's MoE loader
    e = cfg.get("num_experts", cfg.get("num_local_experts"))
    inter, topk = cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    exp_prefix = "model.layers.0.mlp.experts"
    expert_ckpt = [(k, v) for k, v in module(tensors, exp_prefix).items()]
    tw, ti = ref.route_topk(torch.randn(3, e, generator=g), topk)
    total = 0
    for rank in range(tp):
        with simulated_tp(tp, rank):
            moe = FusedMoE(num_experts=e, top_k=topk, hidden_size=h, intermediate_size=inter,
                           params_dtype=torch.bfloat16, quant_config=quant_config, tp_size=tp, prefix=unique_layer())
            experts = moe.routed_experts
            list(experts.load_weights(expert_ckpt))
            experts.quant_method.process_weights_after_loading(experts)
            total = total + experts.forward_modular(x, tw, ti).double()
    cw = {n: [canonical(fmt, module(tensors, f"{exp_prefix}.{i}.{n}")) for i in range(e)]
          for n in ("gate_proj", "up_proj", "down_proj")}
    w13 = torch.stack([torch.cat([a[0], b[0]]) for a, b in zip(cw["gate_proj"], cw["up_proj"])])
    w13s = torch.stack([torch.cat([a[1], b[1]]) for a, b in zip(cw["gate_proj"], cw["up_proj"])])
    w13g = torch.stack([torch.cat([a[2].expand(inter), b[2].expand(inter)]) for a, b in zip(cw["gate_proj"], cw["up_proj"])])
    w2 = torch.stack([d[0] for d in cw["down_proj"]])
    w2s = torch.stack([d[1] for d in cw["down_proj"]])
    w2g = torch.stack([d[2].expand(h) for d in cw["down_proj"]])
    kw = {}
    if mode == "w4a4":
        def igs(name):
            vals = []
            for i in range(e):
                t = module(tensors, f"{exp_prefix}.{i}.{name}")
                vals.append((1.0 / t["input_scale"]) if fmt == "modelopt" else t["input_global_scale"].reshape(()))
            return torch.stack(vals)
        kw = dict(mode="w4a4", a13_global_scale=torch.minimum(igs("gate_proj"), igs("up_proj")),
                  a2_global_scale=igs("down_proj"))
    exp = ref.nvfp4_fused_moe(x, w13, w13s, w13g, w2, w2s, w2g, tw, ti, **kw).double()
    assert (total - exp).norm() / exp.norm() < (1e-2 if mode == "w4a16" else 4e-2)
