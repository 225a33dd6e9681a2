"""Reference backend: weights stay NVFP4 in device memory; each forward dequantizes them and runs a
plain bf16/fp16 matmul (a dense layer on a CPU dequantizes once, at load). MoE: ``torch._grouped_mm``
over tokens sorted by expert, no host sync; the masked layout of expert-parallel dispatch runs the
same ``torch._grouped_mm`` over every expert's ``max_m`` rows.

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


def write_valid_rows(out: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> None:
    """The masked layout's output: ``out[e, r] = y[e, r]`` for ``r < mask[e]``, the other rows of ``out`` left as
    they are; on the device, no shape depends on the mask (CUDA-graph safe)."""
    rows = torch.arange(out.shape[1], device=out.device)
    valid = rows[None, :] < mask.to(torch.int64)[:, None]                    # [E, max_m]
    out.copy_(torch.where(valid[..., None], y, out))


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
        # ids outside [0, E) (experts of other expert-parallel ranks) sort last, past offs[E-1]: the
        # grouped GEMMs never compute them and the combine skips them
        valid = (flat >= 0) & (flat < num_experts)
        key = torch.where(valid, flat, torch.full_like(flat, num_experts))
        order = torch.argsort(key, stable=True)
        token = order // top_k
        # counts per expert without torch.bincount, which reads the max on the host (a sync)
        counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=x.device).scatter_add_(0, key,
                                                                                               torch.ones_like(key))
        offs = counts[:num_experts].cumsum(0).to(torch.int32)
        expert = key[order].clamp(max=num_experts - 1)
        xs = x[token]
        if mode == "w4a4":
            xs = fake_quant_rows(xs, t["a13_global_scale"][expert], t["e2m1_table"])
        a = nx.silu_and_mul_fp32(self._gemm(t, "w13_", xs, offs))
        if mode == "w4a4":
            a = fake_quant_rows(a, t["a2_global_scale"][expert], t["e2m1_table"])
        y = self._gemm(t, "w2_", a, offs)
        # rows of ids outside [0, E) hold whatever torch._grouped_mm left there: selected away, not multiplied
        y = torch.where(valid[order][:, None], y.float() * topk_weights.reshape(-1)[order].float()[:, None], 0.0)
        out = torch.zeros((num_tokens, x.shape[1]), dtype=torch.float32, device=x.device)
        return out.index_add_(0, token, y).to(x.dtype)

    def apply_masked(self, t: dict, mode: str, x: torch.Tensor, mask: torch.Tensor, out: torch.Tensor) -> None:
        """The masked layout (expert-parallel low-latency dispatch): ``out[e, r] = W2[e] silu_mul(W13[e] x[e, r])``
        for ``r < mask[e]``, no routing weights (the engine's combine applies them); rows at or past
        ``mask[e]`` of ``out`` are left as they are.

        The math of :meth:`apply` row for row (the same dequantized weights, ``torch._grouped_mm``,
        activation quantization and fp32 SiLU), over all ``max_m`` rows of every expert: no shape
        depends on the mask, so nothing reads it on the host."""
        num_experts, max_m, hidden = x.shape
        offs = (torch.arange(1, num_experts + 1, device=x.device) * max_m).to(torch.int32)
        xs = x.reshape(num_experts * max_m, hidden)
        if mode == "w4a4":
            xs = fake_quant_rows(xs, t["a13_global_scale"].repeat_interleave(max_m), t["e2m1_table"])
        a = nx.silu_and_mul_fp32(self._gemm(t, "w13_", xs, offs))
        if mode == "w4a4":
            a = fake_quant_rows(a, t["a2_global_scale"].repeat_interleave(max_m), t["e2m1_table"])
        write_valid_rows(out, self._gemm(t, "w2_", a, offs).view(num_experts, max_m, hidden), mask)

    @staticmethod
    def _gemm(t: dict, prefix: str, xs: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """``xs @ dequant(W[e])^T`` for the rows of expert e (``offs``: cumulative row ends)."""
        w = dequantize(t[f"{prefix}packed"], t[f"{prefix}block_scale"], t[f"{prefix}global_scale"], t["e2m1_table"],
                       xs.dtype)
        return torch._grouped_mm(xs, w.transpose(1, 2), offs=offs)
