"""Hopper backend: our Triton FP4-weight GEMMs (:mod:`nvfp4_plugin.gemm`), weights repacked once at
load time into the kernel layout. Runs on sm90+ (H100/H200; Blackwell too, until a tensor-core FP4
backend lands ahead of it)."""

from __future__ import annotations

import torch

from ...weights import Nvfp4Weight
from ..base import Backend


def _cuda_sm90_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"needs a CUDA device, got {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"needs compute capability >= 9.0, GPU is {major}.{minor}"
    try:
        import triton  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the install
        return f"triton not importable ({exc})"
    return None


def _dtype_reason(spec) -> str | None:
    if spec.act_dtype not in (torch.bfloat16, torch.float16):
        return f"activations must be bf16 or fp16, got {spec.act_dtype}"
    return None


def _packed(prefix: str, p) -> dict[str, torch.Tensor]:
    return {f"{prefix}{k}": v for k, v in p.tensors().items()}


def _unpacked(prefix: str, layout, t: dict):
    from ...gemm import PackedW4Weight

    return PackedW4Weight.from_tensors(layout, {k[len(prefix):]: v for k, v in t.items() if k.startswith(prefix)})


class _Hopper(Backend):
    """What the Hopper linear and MoE backends share: the name, sm90+ CUDA, bf16/fp16 activations."""

    name = "hopper_triton"

    @classmethod
    def unsupported_reason(cls, device):
        return _cuda_sm90_reason(device)

    @classmethod
    def cannot_implement(cls, spec):
        return _dtype_reason(spec)


class HopperLinear(_Hopper):
    def prepare(self, spec, weight: Nvfp4Weight, input_global_scale):
        from ...gemm import prepack

        p = prepack(weight, act_dtype=spec.act_dtype)
        t = _packed("w_", p)
        if spec.mode == "w4a4":
            t["input_global_scale"] = input_global_scale.reshape(1).float()
        return t, (p.layout, spec.mode)

    def apply(self, t, meta, x, bias=None):
        from ...gemm import w4_linear

        layout, mode = meta
        return w4_linear(x, _unpacked("w_", layout, t), bias, mode=mode, input_global_scale=t.get("input_global_scale"))

    def warmup_sizes(self, t, meta, max_tokens, **kw):
        from ...gemm import warmup_sizes_linear

        return warmup_sizes_linear(_unpacked("w_", meta[0], t), max_tokens)


class HopperMoe(_Hopper):
    def prepare(self, spec, w13: Nvfp4Weight, w2: Nvfp4Weight, a13_global_scale, a2_global_scale):
        from ...gemm import prepack

        p13, p2 = prepack(w13, act_dtype=spec.act_dtype), prepack(w2, act_dtype=spec.act_dtype)
        t = {**_packed("w13_", p13), **_packed("w2_", p2)}
        if spec.mode == "w4a4":
            t["a13_global_scale"], t["a2_global_scale"] = a13_global_scale.float(), a2_global_scale.float()
        return t, (p13.layout, p2.layout, spec.mode)

    def apply(self, t, meta, x, topk_weights, topk_ids):
        from ...gemm import w4_fused_moe

        l13, l2, mode = meta
        return w4_fused_moe(x, _unpacked("w13_", l13, t), _unpacked("w2_", l2, t), topk_weights, topk_ids, mode=mode,
                            a13_global_scale=t.get("a13_global_scale"), a2_global_scale=t.get("a2_global_scale"))

    def warmup_sizes(self, t, meta, max_tokens, *, top_k: int, **kw):
        from ...gemm import warmup_sizes_fused_moe

        l13, l2, _ = meta
        return warmup_sizes_fused_moe(_unpacked("w13_", l13, t), _unpacked("w2_", l2, t), top_k, max_tokens)
