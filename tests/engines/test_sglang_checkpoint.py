"""Whole models loaded by SGLang's own model loader from real `nvfp4-plugin quantize` output
(make-model Llama and Qwen3-MoE, both formats), with simulated TP=2: every quantized layer of the
model gives the reference output computed from the checkpoint by our independent reader
(nvfp4_plugin.checkpoints.open_checkpoint)."""

import zlib

import pytest
import torch

from tests._require import require

sglang = require("sglang")

from nvfp4_plugin import reference as ref  # noqa: E402
from nvfp4_plugin.checkpoints import open_checkpoint  # noqa: E402

from .sglang_harness import (error_bound, load_model, quantized_checkpoint, simulated_tp, start,  # noqa: E402
                             topk_output)

start()

from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear  # noqa: E402
from sglang.srt.layers.moe.fused_moe_triton import FusedMoE  # noqa: E402

TP, T = 2, 3


def inputs(name: str, k: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return (torch.randn(T, k, generator=g) * 0.5).to(dtype), g


def column_rows(layer) -> list[torch.Tensor]:
    """Output rows of the full fused weight that this rank's layer holds, in its output order."""
    if isinstance(layer, QKVParallelLinear):
        hd, r = layer.head_size, layer.tp_rank
        nq_total = layer.total_num_heads * hd
        nk_total = layer.total_num_kv_heads * hd
        kv = r // layer.num_kv_head_replicas
        nq, nk = layer.num_heads * hd, layer.num_kv_heads * hd
        return [torch.arange(r * nq, (r + 1) * nq), nq_total + torch.arange(kv * nk, (kv + 1) * nk),
                nq_total + nk_total + torch.arange(kv * nk, (kv + 1) * nk)]
    rows, off = [], 0
    for size in layer.output_sizes:
        part = size // layer.tp_size
        rows.append(off + torch.arange(layer.tp_rank * part, (layer.tp_rank + 1) * part))
        off += size
    return rows


def linear_ref(cl, x, mode):
    kw = dict(mode="w4a4", input_global_scale=cl.input_scale.reshape(1)) if mode == "w4a4" else {}
    w = cl.weight
    return ref.nvfp4_linear(x, w.packed, w.block_scale, w.global_scale, **kw)


CASES = [(arch, fmt, mode) for arch in ("llama", "qwen3_moe") for fmt in ("modelopt", "compressed-tensors")
         for mode in ("w4a16", "w4a4")]
CASES += [("qwen2", "modelopt", "w4a16")]  # q/k/v biases


@pytest.mark.parametrize("arch,fmt,mode", CASES)
def test_model_loaded_by_sglang_matches_the_checkpoint(arch, fmt, mode, monkeypatch):
    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", mode)
    path = quantized_checkpoint(arch, fmt)
    ckpt = open_checkpoint(path)
    assert ckpt.config.format == fmt and ckpt.config.activations_quantized
    col, row, moe = {}, {}, {}  # layer name -> per-rank (got, reference) or partial sums
    per_shard_scales = False
    for rank in range(TP):
        with simulated_tp(TP, rank):
            model, model_config = load_model(path)
        assert model_config.quantization == "nvfp4"
        quantized = {n: m for n, m in model.named_modules() if hasattr(m, "nvfp4_core")}
        assert "lm_head" not in quantized and not hasattr(model.lm_head, "nvfp4_core")
        for name, layer in quantized.items():
            assert layer.nvfp4_core.mode == mode
            if isinstance(layer, FusedMoE):
                ce = ckpt.load_experts(name)
                x, g = inputs(name, ce.w13.k)
                tw, ti = ref.route_topk(torch.randn(T, ce.w13.lead_shape[0], generator=g), layer.top_k)
                got = layer(x, topk_output(tw, ti)).double()
                kw = dict(mode="w4a4", a13_global_scale=ce.w13_input_scale,
                          a2_global_scale=ce.w2_input_scale) if mode == "w4a4" else {}
                exp = ref.nvfp4_fused_moe(x, ce.w13.packed, ce.w13.block_scale, ce.w13.global_scale, ce.w2.packed,
                                          ce.w2.block_scale, ce.w2.global_scale, tw, ti, **kw).double()
                prev = moe.get(name, (0, exp))[0]
                moe[name] = (prev + got, exp)
            elif isinstance(layer, RowParallelLinear):
                cl = ckpt.load_linear(name)
                x, _ = inputs(name, cl.weight.k)
                k = cl.weight.k // TP
                got = layer(x[:, rank * k:(rank + 1) * k])[0].double()
                prev = row.get(name, (0, None))[0]
                row[name] = (prev + got, linear_ref(cl, x, mode).double())
            else:
                assert isinstance(layer, (QKVParallelLinear, MergedColumnParallelLinear)), type(layer)
                parts = name[: -len(name.rsplit(".", 1)[1])]
                shards = (["q_proj", "k_proj", "v_proj"] if name.endswith("qkv_proj") else ["gate_proj", "up_proj"])
                cl = ckpt.load_fused([parts + s for s in shards])
                x, _ = inputs(name, cl.weight.k)
                rows = torch.cat(column_rows(layer))
                w = cl.weight
                per_shard_scales |= len(torch.unique(w.global_scale)) > 1
                deq = ref.dequantize_fp4(w.packed[rows], w.block_scale[rows], w.global_scale[rows], swizzled=False,
                                         m=len(rows), k=w.k)
                exp = linear_ref(cl, x, mode)[:, rows].double()
                biases = [f"{parts}{s}.bias" for s in shards]
                if biases[0] in ckpt.files.tensors:  # Qwen2: q/k/v biases, unquantized
                    exp = exp + torch.cat([ckpt.read_tensor(b) for b in biases])[rows].to(torch.bfloat16).double()
                col.setdefault(name, []).append((layer(x)[0].double(), exp, error_bound(x, [deq])))
    # every quantized module of the checkpoint was loaded into some SGLang layer
    covered = set()
    for name in col:
        base = name.rsplit(".", 1)[0] + "."
        covered |= {base + s for s in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")}
    covered |= set(row) | {m for m in ckpt.modules if any(m.startswith(p + ".") for p in moe)}
    assert set(ckpt.modules) <= covered, sorted(set(ckpt.modules) - covered)
    assert col and row and (moe or arch in ("llama", "qwen2"))
    assert per_shard_scales, "the checkpoint should exercise fused shards with different global scales"

    lin_tol, moe_tol = (5e-3, 1e-2) if mode == "w4a16" else (3e-2, 4e-2)
    for name, per_rank in col.items():
        for got, exp, bound in per_rank:
            if mode == "w4a16":
                assert ((got - exp).abs() <= bound).all(), name
            else:
                assert (got - exp).norm() / exp.norm() < lin_tol, name
    for name, (got, exp) in row.items():
        assert (got - exp).norm() / exp.norm() < lin_tol, name
    for name, (got, exp) in moe.items():
        assert (got - exp).norm() / exp.norm() < moe_tol, name


def test_model_config_that_disagrees_with_the_checkpoint_is_refused_by_name():
    """make-model's tiny Mixtral has head_dim 128 != hidden/heads = 64; SGLang's Mixtral ignores
    head_dim and would narrow the q/k/v tensors to the rows it expects, silently. We refuse."""
    path = quantized_checkpoint("mixtral", "compressed-tensors")
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.self_attn.[qkv]_proj.weight_packed': shape: "
                                         r"expected \[(128|64), 64\] for SGLang's QKVParallelLinear "
                                         r"'model.layers.0.self_attn.qkv_proj' \(from the model config\), "
                                         r"got \[(256|128), 64\]"):
        load_model(path)
