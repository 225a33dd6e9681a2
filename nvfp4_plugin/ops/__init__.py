"""Public ops: validate once, then dispatch to the fastest backend that runs on the input's device.

Each op has the signature of its twin in :mod:`nvfp4_plugin.reference` (the ground truth, whose
docstring gives the full contract). It checks its arguments with its validator in
:mod:`nvfp4_plugin._checks` (errors name the argument, the expected and the actual value; metadata
only, so no host synchronization and nothing that stops a CUDA graph capture), then calls the
chosen backend's implementation, which checks only what is specific to it.

Which backend runs is decided once per (op, device) by :mod:`nvfp4_plugin.ops._registry` and
logged; ``nvfp4-plugin info`` shows the choice and the reasons other backends were skipped.

Backends, in priority order: the modules of :data:`BACKEND_MODULES`, each with one table of the ops
it implements (``OPS``), then the reference for every op here. Adding an op: its reference twin, its
validator (``_checks.check_<op>``), its function here and a line in each backend table that has it.
"""

from __future__ import annotations

import importlib
import logging

import torch

from .. import _checks as ck
from .. import numerics as nx
from .. import reference
from ._registry import OpBackend, implementation, register

__all__ = [
    "scaled_fp4_quant",
    "scaled_fp4_experts_quant",
    "silu_and_mul_scaled_fp4_experts_quant",
    "silu_and_mul",
    "dequantize_fp4",
    "fake_quant_nvfp4",
    "fake_quant_mxfp4",
    "fake_quant_mxfp8",
    "mxfp4_quantize",
    "mxfp8_quantize",
    "scaled_fp8_quant",
    "per_token_quant_fp8",
    "per_token_group_quant_fp8",
    "stage_deepseek_v4_mega_moe_inputs",
]

#: The public ops, each with a function below and a reference backend.
PUBLIC_OPS = tuple(__all__)


# ------------------------------------------------------------------------------------------------
# NVFP4
# ------------------------------------------------------------------------------------------------

def scaled_fp4_quant(input: torch.Tensor, input_global_scale: torch.Tensor, *, swizzle: bool = True,
                     scale_format: str = "e4m3"):
    """Quantize activations ``input [M, K]`` (bf16/fp16/fp32, K a multiple of 16) to NVFP4 with the
    encode global scale ``input_global_scale`` (one fp32 value).

    Returns ``(codes uint8 [M, K/2], block scales)``: scales float8_e4m3fn (uint8 exponent bytes for
    ``scale_format="ue8m0"``), ``[round_up(M, 128), round_up(K/16, 4)]`` in the 128x4 swizzled layout
    with zero padding if ``swizzle``, else ``[M, K/16]``. See :func:`nvfp4_plugin.reference.scaled_fp4_quant`.
    """
    ck.check_scaled_fp4_quant(input, input_global_scale, swizzle=swizzle, scale_format=scale_format)
    return implementation("scaled_fp4_quant", input.device)(input, input_global_scale, swizzle=swizzle,
                                                          scale_format=scale_format)


def scaled_fp4_experts_quant(input: torch.Tensor, input_global_scale: torch.Tensor, expert_offsets: torch.Tensor,
                             blockscale_offsets: torch.Tensor):
    """Quantize rows grouped by expert to NVFP4, expert e with its own global scale
    ``input_global_scale[e]``: rows ``expert_offsets[e]:expert_offsets[e+1]`` of ``input [M, K]``.

    Returns ``(codes uint8 [M, K/2], float8_e4m3fn scales)``; expert e's scales are swizzled in the
    rows from ``blockscale_offsets[e]`` (a multiple of 128). See
    :func:`nvfp4_plugin.reference.scaled_fp4_experts_quant`.
    """
    ck.check_scaled_fp4_experts_quant(input, input_global_scale, expert_offsets, blockscale_offsets)
    return implementation("scaled_fp4_experts_quant", input.device)(input, input_global_scale, expert_offsets,
                                                                  blockscale_offsets)


def silu_and_mul_scaled_fp4_experts_quant(input: torch.Tensor, input_global_scale: torch.Tensor, mask: torch.Tensor,
                                          *, use_silu_and_mul: bool = True, output: torch.Tensor | None = None,
                                          output_scale: torch.Tensor | None = None):
    """Masked-layout NVFP4 quantization (DeepEP low latency), optionally fused with SiLU-and-mul:
    ``input [E, max_m, 2I]`` (``[E, max_m, K]`` without SiLU), ``mask[E]`` valid rows per expert.

    Returns ``(codes uint8 [E, max_m, I/2], float8_e4m3fn scales [E, round_up(max_m, 128),
    round_up(I/16, 4)])``, swizzled per expert; written into ``output`` / ``output_scale`` when given.
    See :func:`nvfp4_plugin.reference.silu_and_mul_scaled_fp4_experts_quant`.
    """
    ck.check_silu_and_mul_scaled_fp4_experts_quant(input, input_global_scale, mask, use_silu_and_mul=use_silu_and_mul,
                                                   output=output, output_scale=output_scale)
    return implementation("silu_and_mul_scaled_fp4_experts_quant", input.device)(
        input, input_global_scale, mask, use_silu_and_mul=use_silu_and_mul, output=output, output_scale=output_scale)


def silu_and_mul(input: torch.Tensor) -> torch.Tensor:
    """``silu(input[..., :I]) * input[..., I:]`` computed in fp32, rounded to ``input``'s dtype.
    See :func:`nvfp4_plugin.reference.silu_and_mul`."""
    ck.check_silu_and_mul(input)
    return implementation("silu_and_mul", input.device)(input)


def dequantize_fp4(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, *, swizzled: bool,
                   m: int, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NVFP4 codes ``[..., m, k/2]`` and block scales (swizzled or linear) back to ``[..., m, k]`` of
    ``dtype``, divided by ``global_scale`` (one value, one per leading index or one per row).
    See :func:`nvfp4_plugin.reference.dequantize_fp4`."""
    ck.check_dequantize_fp4(packed, scales, global_scale, swizzled=swizzled, m=m, k=k, dtype=dtype)
    return implementation("dequantize_fp4", packed.device)(packed, scales, global_scale, swizzled=swizzled, m=m, k=k,
                                                         dtype=dtype)


def fake_quant_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | None = None, stochastic_rounding: bool = False, *,
                     seed: int | None = None) -> torch.Tensor:
    """NVFP4 quantize then dequantize over the last dim (a multiple of 16), same shape and dtype out;
    ``global_scale`` defaults to the tensor's dynamic scale. See
    :func:`nvfp4_plugin.reference.fake_quant_nvfp4`."""
    ck.check_fake_quant_nvfp4(x, global_scale, stochastic_rounding, seed=seed)
    return implementation("fake_quant_nvfp4", x.device)(x, global_scale, stochastic_rounding, seed=seed)


# ------------------------------------------------------------------------------------------------
# MX formats
# ------------------------------------------------------------------------------------------------

def fake_quant_mxfp4(x: torch.Tensor, stochastic_rounding: bool = False, *,
                     scale_recipe: str = nx.DEFAULT_MX_SCALE_RECIPE, seed: int | None = None) -> torch.Tensor:
    """MXFP4 quantize then dequantize over the last dim (a multiple of 32), same dtype out.
    See :func:`nvfp4_plugin.reference.fake_quant_mxfp4`."""
    ck.check_fake_quant_mxfp4(x, stochastic_rounding, scale_recipe=scale_recipe, seed=seed)
    return implementation("fake_quant_mxfp4", x.device)(x, stochastic_rounding, scale_recipe=scale_recipe, seed=seed)


def fake_quant_mxfp8(x: torch.Tensor, format: str = "e4m3", stochastic_rounding: bool = False, *,
                     scale_recipe: str = nx.DEFAULT_MX_SCALE_RECIPE, seed: int | None = None) -> torch.Tensor:
    """MXFP8 (``"e4m3"`` or ``"e5m2"``) quantize then dequantize over the last dim, same dtype out.
    See :func:`nvfp4_plugin.reference.fake_quant_mxfp8`."""
    ck.check_fake_quant_mxfp8(x, format, stochastic_rounding, scale_recipe=scale_recipe, seed=seed)
    return implementation("fake_quant_mxfp8", x.device)(x, format, stochastic_rounding, scale_recipe=scale_recipe,
                                                       seed=seed)


def mxfp4_quantize(x: torch.Tensor, *, scale_recipe: str = nx.DEFAULT_MX_SCALE_RECIPE,
                   stochastic_rounding: bool = False, seed: int | None = None):
    """MXFP4 over the last dim (a multiple of 32): ``(packed E2M1 uint8 [..., K/2], E8M0 scale bytes
    [..., K/32])``. See :func:`nvfp4_plugin.reference.mxfp4_quantize`."""
    ck.check_mxfp4_quantize(x, scale_recipe=scale_recipe, stochastic_rounding=stochastic_rounding, seed=seed)
    return implementation("mxfp4_quantize", x.device)(x, scale_recipe=scale_recipe,
                                                     stochastic_rounding=stochastic_rounding, seed=seed)


def mxfp8_quantize(x: torch.Tensor, format: str = "e4m3", *, scale_recipe: str = nx.DEFAULT_MX_SCALE_RECIPE,
                   stochastic_rounding: bool = False, seed: int | None = None):
    """MXFP8 (``"e4m3"`` or ``"e5m2"``) over the last dim: ``(float8 [..., K], E8M0 scale bytes
    [..., K/32])``. See :func:`nvfp4_plugin.reference.mxfp8_quantize`."""
    ck.check_mxfp8_quantize(x, format, scale_recipe=scale_recipe, stochastic_rounding=stochastic_rounding, seed=seed)
    return implementation("mxfp8_quantize", x.device)(x, format, scale_recipe=scale_recipe,
                                                     stochastic_rounding=stochastic_rounding, seed=seed)


# ------------------------------------------------------------------------------------------------
# FP8 E4M3 activations
# ------------------------------------------------------------------------------------------------

def scaled_fp8_quant(input: torch.Tensor, scale: torch.Tensor | None = None):
    """Per-tensor FP8 E4M3 of ``input [M, K]``: static with ``scale`` (decode scale, one fp32 value) or
    dynamic (``amax / 448``, computed on the device). Returns ``(float8_e4m3fn [M, K], scale [1])``.
    See :func:`nvfp4_plugin.reference.scaled_fp8_quant`."""
    ck.check_scaled_fp8_quant(input, scale)
    return implementation("scaled_fp8_quant", input.device)(input, scale)


def per_token_quant_fp8(input: torch.Tensor):
    """Per-token dynamic FP8 E4M3 of ``input [M, K]``: ``(q [M, K], amax_row / 448 as fp32 [M, 1])``.
    See :func:`nvfp4_plugin.reference.per_token_quant_fp8`."""
    ck.check_per_token_quant_fp8(input)
    return implementation("per_token_quant_fp8", input.device)(input)


def per_token_group_quant_fp8(input: torch.Tensor, group_size: int = nx.FP8_GROUP_SIZE, *,
                              column_major_scales: bool = False, scale_ue8m0: bool = False,
                              eps: float = nx.FP8_GROUP_EPS):
    """Per-token-group FP8 E4M3 of ``input [M, K]`` (DeepSeek style, groups of ``group_size``):
    ``(q [M, K], scales)``, fp32 ``[M, K/group]`` (row- or column-major) or, with ``scale_ue8m0``,
    four UE8M0 bytes per int32 column-major. See :func:`nvfp4_plugin.reference.per_token_group_quant_fp8`."""
    ck.check_per_token_group_quant_fp8(input, group_size, column_major_scales=column_major_scales,
                                       scale_ue8m0=scale_ue8m0, eps=eps)
    return implementation("per_token_group_quant_fp8", input.device)(
        input, group_size, column_major_scales=column_major_scales, scale_ue8m0=scale_ue8m0, eps=eps)


# ------------------------------------------------------------------------------------------------
# DeepSeek-V4 MegaMoE staging
# ------------------------------------------------------------------------------------------------

def stage_deepseek_v4_mega_moe_inputs(hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                                      topk_ids: torch.Tensor, x_fp4: torch.Tensor, x_sf: torch.Tensor,
                                      topk_idx_out: torch.Tensor, topk_weights_out: torch.Tensor) -> None:
    """Stage MegaMoE inputs in place: ``hidden_states [M, K]`` (K a multiple of 128) to E2M1 codes in
    ``x_fp4 [M, K/2]`` and UE4M3 block scales packed four per int32 in ``x_sf [M, K/64]``; the top-k
    ids copied as int64 to ``topk_idx_out`` and the weights to ``topk_weights_out``.
    See :func:`nvfp4_plugin.reference.stage_deepseek_v4_mega_moe_inputs`."""
    ck.check_stage_deepseek_v4_mega_moe_inputs(hidden_states, topk_weights, topk_ids, x_fp4, x_sf, topk_idx_out,
                                               topk_weights_out)
    return implementation("stage_deepseek_v4_mega_moe_inputs", hidden_states.device)(
        hidden_states, topk_weights, topk_ids, x_fp4, x_sf, topk_idx_out, topk_weights_out)


# ------------------------------------------------------------------------------------------------
# Backends
# ------------------------------------------------------------------------------------------------

#: Modules of the faster backends, in priority order (ahead of the reference). Each has ``NAME``,
#: ``OPS`` (the ops it implements), ``unavailable_reason(device)`` and ``load(op)`` (the implementation,
#: for checked arguments) and imports nothing of this package. Each is optional: a missing module is
#: skipped, and a backend that cannot run on a device says why through its ``unavailable_reason``.
BACKEND_MODULES = ("nvfp4_plugin._cuda_register", "nvfp4_plugin.triton._register")


def _reference_loader(op: str):
    return lambda: ck.unchecked(getattr(reference, op))


def _backend_loader(module, op: str):
    return lambda: module.load(op)


def _register_backends() -> None:
    for op in PUBLIC_OPS:
        register(op, OpBackend("reference", lambda device: None, _reference_loader(op)))
    for name in BACKEND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name and not name.startswith(f"{exc.name}."):
                logging.getLogger("nvfp4_plugin").warning("nvfp4_plugin: backends in %s not loaded: %s", name, exc)
            continue
        for op in mod.OPS:
            register(op, OpBackend(mod.NAME, mod.unavailable_reason, _backend_loader(mod, op)))


_register_backends()
