"""Reference backend: weights stay NVFP4 in device memory; each forward dequantizes them and runs a
plain bf16/fp16 matmul (a dense layer on a CPU dequantizes once, at load) (MoE: ``torch._grouped_mm`` over tokens sorted by expert, no host sync).

Slow but simple and exact to the numerics contract; every faster backend is compared with it.
Pure torch ops only, so it traces under torch.compile and replays in CUDA graphs (constants such
as the E2M1 table are created at load time, never during a forward).
"""

from __future__ import annotations

import torch

from ... import numerics as nx
from ... import reference
from ...weights import Nvfp4Weight
from ..base import Backend


def _e2m1_table(device) -> torch.Tensor:
    return torch.tensor(nx.E2M1_VALUES, dtype=torch.float32, device=device)


def dequantize(packed, block_scale, global_scale, table, dtype: torch.dtype) -> torch.Tensor:
    """``(e2m1 * s) / gs`` per row, in fp32, rounded to ``dtype`` (the math of reference.dequantize_fp4)."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    vals = table[codes.long()].unflatten(-1, (-1, nx.NVFP4_BLOCK_SIZE)) * block_scale.float()[..., None]
    return (vals.flatten(-2) / global_scale[..., None]).to(dtype)


def fake_quant_rows(x: torch.Tensor, gs_rows: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """NVFP4 quantize + dequantize each row of ``x`` with its own encode global scale (W4A4)."""
    packed, scales = reference._nvfp4_quantize(x, gs_rows[..., None])
    vals = table[nx.unpack_fp4(packed).long()].unflatten(-1, (-1, nx.NVFP4_BLOCK_SIZE))
    return ((vals * scales.float()[..., None]).flatten(-2) / gs_rows[..., None]).to(x.dtype)


def _weight_tensors(prefix: str, w: Nvfp4Weight) -> dict[str, torch.Tensor]:
    return {f"{prefix}packed": w.packed, f"{prefix}block_scale": w.block_scale, f"{prefix}global_scale": w.global_scale}


class ReferenceLinear(Backend):
    name = "reference"
    family = "dequantize + torch matmul"

    def prepare(self, spec, weight: Nvfp4Weight, input_global_scale: torch.Tensor | None):
        mode = spec.mode
        t = _weight_tensors("w_", weight)
        t["e2m1_table"] = _e2m1_table(weight.packed.device)
        if weight.packed.device.type == "cpu":
            # On a CPU this backend is the one that runs (CPU engines, the demo): the weight is dequantized
            # once here instead of at every forward; the same values either way. GPUs keep the NVFP4 bytes only.
            t["w_dequantized"] = dequantize(weight.packed, weight.block_scale, weight.global_scale, t["e2m1_table"],
                                            spec.act_dtype)
        if mode == "w4a4":
            t["input_global_scale"] = input_global_scale.reshape(())
        return t, mode

    def apply(self, t: dict, mode: str, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if mode == "w4a4":
            x = fake_quant_rows(x, t["input_global_scale"].expand(x.shape[:-1]), t["e2m1_table"])
        w = t.get("w_dequantized")
        if w is None or w.dtype != x.dtype:
            w = dequantize(t["w_packed"], t["w_block_scale"], t["w_global_scale"], t["e2m1_table"], x.dtype)
        return torch.nn.functional.linear(x, w, bias)


class ReferenceMoe(Backend):
    name = "reference"
    family = "dequantize + torch._grouped_mm"

    def prepare(self, spec, w13: Nvfp4Weight, w2: Nvfp4Weight, a13_global_scale, a2_global_scale):
        mode = spec.mode
        t = {**_weight_tensors("w13_", w13), **_weight_tensors("w2_", w2)}
        t["e2m1_table"] = _e2m1_table(w13.packed.device)
        if mode == "w4a4":
            t["a13_global_scale"], t["a2_global_scale"] = a13_global_scale, a2_global_scale
        return t, mode

    def apply(self, t: dict, mode: str, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        num_experts = t["w13_packed"].shape[0]
        num_tokens, top_k = topk_ids.shape
        flat = topk_ids.reshape(-1).to(torch.int64)
        order = torch.argsort(flat, stable=True)
        token = order // top_k
        # counts per expert without torch.bincount, which reads the max on the host (a sync)
        counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        offs = counts.cumsum(0).to(torch.int32)
        xs = x[token]
        if mode == "w4a4":
            xs = fake_quant_rows(xs, t["a13_global_scale"][flat[order]], t["e2m1_table"])
        w13 = dequantize(t["w13_packed"], t["w13_block_scale"], t["w13_global_scale"], t["e2m1_table"], x.dtype)
        h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
        a = nx.silu_and_mul_fp32(h)
        if mode == "w4a4":
            a = fake_quant_rows(a, t["a2_global_scale"][flat[order]], t["e2m1_table"])
        w2 = dequantize(t["w2_packed"], t["w2_block_scale"], t["w2_global_scale"], t["e2m1_table"], x.dtype)
        y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
        y = y.float() * topk_weights.reshape(-1)[order].float()[:, None]
        out = torch.zeros((num_tokens, x.shape[1]), dtype=torch.float32, device=x.device)
        return out.index_add_(0, token, y).to(x.dtype)
