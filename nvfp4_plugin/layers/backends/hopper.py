"""Hopper backend: our Triton / Gluon FP4-weight GEMMs (:mod:`nvfp4_plugin.gemm`), weights repacked once
at load time into the kernel layout. sm_90 only (H100 / H200): its kernels use Hopper's wgmma, and
Triton 3.6 cannot build them for Blackwell (sm_100 / sm_103), which falls back to another backend."""

from __future__ import annotations

import torch

from ...weights import Nvfp4Weight
from ..base import Backend


def _triton_reason() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the install
        return f"triton not importable ({exc})"
    return None


def _device_table(spec, dev_key, sms):
    """The tuned-config table and SM count to plan with: the named ones, else the spec's device's."""
    from ...gemm import select

    if dev_key is None:
        dev_key, sms_here = select._device_args(spec.device)
        sms = sms or sms_here
    return dev_key, sms or 132


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
    """What the Hopper linear and MoE backends share: the name, sm_90 CUDA, bf16/fp16 activations, and
    the packed weights of the last forward's tensors (see :meth:`_weights`)."""

    name = "hopper_triton"
    archs = ((9, 0),)
    _bound: tuple | None = None

    def _weights(self, t: dict, *prefixed_layouts) -> tuple:
        """The ``PackedW4Weight`` of each ``(prefix, layout)`` over the layer's tensors ``t``, built again
        only when ``t`` is another dict than the last call's: a layer replaces its dict (``use_tensors``),
        it never edits one. Saves rebuilding them on every forward, host time of every eager step."""
        b = self._bound
        if b is None or b[0] is not t:
            b = self._bound = (t, tuple(_unpacked(p, lay, t) for p, lay in prefixed_layouts))
        return b[1]

    @classmethod
    def unsupported_reason(cls, device, capability=None):
        return super().unsupported_reason(device, capability) or _triton_reason()

    @classmethod
    def cannot_implement(cls, spec):
        return _dtype_reason(spec)


class HopperLinear(_Hopper):
    @classmethod
    def families(cls, spec, max_tokens, *, dev_key=None, sms=None, **kw):
        from ...gemm import plan

        dev_key, sms = _device_table(spec, dev_key, sms)
        return plan.families(plan.linear_variants(spec.n, spec.k, max_tokens, dev_key=dev_key, sms=sms,
                                                  act_dtype=spec.act_dtype))

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
        (w,) = self._weights(t, ("w_", layout))
        return w4_linear(x, w, bias, mode=mode, input_global_scale=t.get("input_global_scale"))

    def warmup_sizes(self, t, meta, max_tokens, **kw):
        from ...gemm import warmup_sizes_linear

        return warmup_sizes_linear(_unpacked("w_", meta[0], t), max_tokens)


class HopperMoe(_Hopper):
    @classmethod
    def families(cls, spec, max_tokens, *, top_k=1, dev_key=None, sms=None, **kw):
        from ...gemm import plan

        dev_key, sms = _device_table(spec, dev_key, sms)
        return plan.families(plan.fused_moe_variants(spec.num_experts, spec.hidden, spec.intermediate, top_k,
                                                     max_tokens, dev_key=dev_key, sms=sms))

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
        w13, w2 = self._weights(t, ("w13_", l13), ("w2_", l2))
        return w4_fused_moe(x, w13, w2, topk_weights, topk_ids, mode=mode, a13_global_scale=t.get("a13_global_scale"),
                            a2_global_scale=t.get("a2_global_scale"))

    def apply_masked(self, t, meta, x, mask, out):
        """The masked layout (expert-parallel low-latency dispatch), numerics of :meth:`apply` row for row:
        ``w4_masked`` for W13 (in w4a4 it quantizes each expert's valid rows with our masked NVFP4
        quantization, ``silu_and_mul_scaled_fp4_experts_quant`` without SiLU), SiLU-and-mul, ``w4_masked``
        for W2 into ``out``. Rows at or past ``mask[e]`` of ``out`` are not written.

        The SiLU-and-mul runs over all ``max_m`` rows of every expert (those past the mask hold whatever
        the first GEMM left there and are never read again): no shape depends on the mask."""
        from ...gemm import w4_masked
        from ...gemm.moe_glue import silu_and_mul

        l13, l2, mode = meta
        num_e, max_m, _ = x.shape
        w13, w2 = self._weights(t, ("w13_", l13), ("w2_", l2))
        kw13 = dict(mode=mode, input_global_scale=t["a13_global_scale"]) if mode == "w4a4" else {}
        hmid = w4_masked(x, w13, mask, **kw13)
        act = silu_and_mul(hmid.view(num_e * max_m, l13.n)).view(num_e, max_m, l13.n // 2)
        kw2 = dict(mode=mode, input_global_scale=t["a2_global_scale"]) if mode == "w4a4" else {}
        w4_masked(act, w2, mask, out=out, **kw2)

    def warmup_sizes(self, t, meta, max_tokens, *, top_k: int, **kw):
        from ...gemm import warmup_sizes_fused_moe

        l13, l2, _ = meta
        return warmup_sizes_fused_moe(_unpacked("w13_", l13, t), _unpacked("w2_", l2, t), top_k, max_tokens)
