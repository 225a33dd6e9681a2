"""Builders for hand-made NVFP4 checkpoint folders, shared by the checkpoint tests (no tests here).

They write files with ``safetensors.torch.save_file`` and compute scale conventions themselves, so
the loader under test is checked against an independent writer.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from nvfp4_plugin.weights import Nvfp4Weight

MODELOPT = "modelopt"
CT = "compressed-tensors"


def fixed_point_gs(amax) -> torch.Tensor:
    """Encode global scale 2688/amax moved to the fp32 reciprocal fixed point (independent copy)."""
    g = torch.tensor(2688.0, dtype=torch.float32) / torch.as_tensor(amax, dtype=torch.float32)
    for _ in range(8):
        nxt = torch.tensor(1.0, dtype=torch.float32) / (torch.tensor(1.0, dtype=torch.float32) / g)
        if torch.equal(nxt, g):
            return g
        g = nxt
    raise AssertionError("no fixed point")


def rand_weight(n, k, seed, scale=0.02) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * scale).to(torch.bfloat16)


def module_tensors(module: str, w: torch.Tensor, fmt: str, gs=None, input_gs=None) -> dict:
    """File tensors of one quantized module (weight quantized with the reference recipe)."""
    gs = fixed_point_gs(w.float().abs().amax()) if gs is None else torch.as_tensor(gs, dtype=torch.float32)
    q = Nvfp4Weight.quantize(w, global_scale=gs)
    one = torch.tensor(1.0, dtype=torch.float32)
    if fmt == MODELOPT:
        out = {f"{module}.weight": q.packed, f"{module}.weight_scale": q.block_scale,
               f"{module}.weight_scale_2": (one / gs).reshape(())}
        if input_gs is not None:
            out[f"{module}.input_scale"] = (one / torch.as_tensor(input_gs, dtype=torch.float32)).reshape(())
    else:
        out = {f"{module}.weight_packed": q.packed, f"{module}.weight_scale": q.block_scale,
               f"{module}.weight_global_scale": gs.reshape(1)}
        if input_gs is not None:
            out[f"{module}.input_global_scale"] = torch.as_tensor(input_gs, dtype=torch.float32).reshape(1)
    return out


def quant_config(fmt: str, quant_algo: str = "NVFP4", exclude=("lm_head",)) -> tuple[dict | None, dict]:
    """(hf_quant_config.json or None, config.json quantization_config)."""
    if fmt == MODELOPT:
        nested = {"producer": {"name": "test", "version": "0"},
                  "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": None, "group_size": 16,
                                   "exclude_modules": list(exclude)}}
        flat = {"quant_method": "modelopt", "quant_algo": quant_algo, "ignore": list(exclude),
                "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}}}}
        return nested, flat
    args = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
            "dynamic": False}
    group = {"targets": ["Linear"], "weights": args,
             "input_activations": dict(args, dynamic="local") if quant_algo == "NVFP4" else None}
    return None, {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                  "config_groups": {"group_0": group}, "ignore": list(exclude), "quantization_status": "compressed"}


def write_checkpoint(directory, tensors: dict, fmt: str, quant_algo: str = "NVFP4", exclude=("lm_head",),
                     model_type: str = "llama", nested=None, flat=None) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
    n, f = quant_config(fmt, quant_algo, exclude)
    nested = n if nested is None else nested
    flat = f if flat is None else flat
    (d / "config.json").write_text(json.dumps({"model_type": model_type, "quantization_config": flat}))
    if nested is not None:
        (d / "hf_quant_config.json").write_text(json.dumps(nested))
    return d


H, KV, I_DENSE, I_MOE, VOCAB, E = 64, 32, 128, 32, 128, 2


def small_model(fmt: str, quant_algo: str = "NVFP4", seed: int = 0) -> tuple[dict, dict]:
    """A two-layer model: layer 0 dense (q/k/v/o, gate/up/down), layer 1 MoE with 2 experts + bf16 router.

    Returns (file tensors, original bf16 weights of the quantized modules).
    """
    w = {}
    t = {"model.embed_tokens.weight": rand_weight(VOCAB, H, seed), "lm_head.weight": rand_weight(VOCAB, H, seed + 1),
         "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}
    shapes = {"model.layers.0.self_attn.q_proj": (H, H), "model.layers.0.self_attn.k_proj": (KV, H),
              "model.layers.0.self_attn.v_proj": (KV, H), "model.layers.0.self_attn.o_proj": (H, H),
              "model.layers.0.mlp.gate_proj": (I_DENSE, H), "model.layers.0.mlp.up_proj": (I_DENSE, H),
              "model.layers.0.mlp.down_proj": (H, I_DENSE),
              "model.layers.1.self_attn.q_proj": (H, H), "model.layers.1.self_attn.k_proj": (KV, H),
              "model.layers.1.self_attn.v_proj": (KV, H), "model.layers.1.self_attn.o_proj": (H, H)}
    for e in range(E):
        p = f"model.layers.1.mlp.experts.{e}"
        shapes.update({f"{p}.gate_proj": (I_MOE, H), f"{p}.up_proj": (I_MOE, H), f"{p}.down_proj": (H, I_MOE)})
    for i, (m, (n, k)) in enumerate(sorted(shapes.items())):
        w[m] = rand_weight(n, k, seed + 10 + i)
        input_gs = fixed_point_gs(3.0 + i) if quant_algo == "NVFP4" else None
        t.update(module_tensors(m, w[m], fmt, input_gs=input_gs))
    t["model.layers.1.mlp.gate.weight"] = rand_weight(E, H, seed + 99)
    for i in range(2):
        t[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    return t, w


SMALL_EXCLUDE = ("lm_head", "model.layers.1.mlp.gate")
