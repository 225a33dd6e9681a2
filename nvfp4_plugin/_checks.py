"""Argument checks: the generic ones, and one validator per public op (``check_<op>``).

Every error names the argument, what was expected and what was given. Checks only look at
metadata (shape, dtype, device, Python values); none of them reads tensor values, so none
synchronizes the host and all of them run unchanged while a CUDA graph is captured.

Where each check runs: a public op of :mod:`nvfp4_plugin.ops` calls its validator once, then the
chosen backend's *unchecked* implementation. Backend functions that are also called directly
(tests, benchmarks, the layers) are wrapped by :func:`validated_by`, which runs the same validator
when they are; the public op calls the function's ``unchecked`` attribute. A backend checks only
what is specific to it (a CUDA device, shapes its kernels do not cover).

Every validator has the signature of its op (the twin in :mod:`nvfp4_plugin.reference`), so one
call passes the op's arguments through unchanged.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable

import torch

from . import numerics as nx

FLOAT_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HALF_ACT_DTYPES = (torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
MXFP8_FORMATS = ("e4m3", "e5m2")
#: MegaMoE staging: the hidden size is a multiple of 128 (four scale bytes per int32 word, 16 each).
MEGA_MOE_HIDDEN_MULTIPLE = 128


# ------------------------------------------------------------------------------------------------
# Generic checks
# ------------------------------------------------------------------------------------------------

def _names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t, *, dtypes=None, ndim=None, min_ndim=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in tuple(dtypes):
        raise TypeError(f"{name}: expected dtype {_names(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got {t.dim()} (shape {tuple(t.shape)})")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dims, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device} (same as the input), got {t.device}")


def check_shape(name: str, t: torch.Tensor, expected: tuple) -> None:
    """``expected`` may contain None for "any size" in that dim."""
    ok = t.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, t.shape))
    if not ok:
        shown = "(" + ", ".join("*" if e is None else str(e) for e in expected) + ("," if len(expected) == 1 else "") + ")"
        raise ValueError(f"{name}: expected shape {shown}, got {tuple(t.shape)}")


def check_multiple(name: str, value: int, multiple: int, what: str = "size") -> None:
    if value % multiple:
        raise ValueError(f"{name}: {what} must be a multiple of {multiple}, got {value}")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {tuple(choices)}, got {value!r}")


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def check_seed(seed, stochastic_rounding) -> None:
    """A seed is an int (or None: a fresh one); only looked at when rounding stochastically."""
    if stochastic_rounding and seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed: expected an int or None, got {type(seed).__name__}")


def check_activation(name: str, x, *, ndim: int | None = 2, block: int = nx.NVFP4_BLOCK_SIZE,
                     dtypes=FLOAT_ACT_DTYPES) -> None:
    """A float activation of ``ndim`` dims (any number >= 1 if None) whose last dim is a multiple of
    ``block``."""
    check_tensor(name, x, dtypes=dtypes, ndim=ndim, min_ndim=None if ndim else 1)
    check_multiple(name, x.shape[-1], block, "last dim (K)")


def check_global_scale_arg(name: str, gs, device, count: int | None = None) -> None:
    """A float32 global scale: a Python number, a scalar tensor or [1] (count None), or a [count]
    vector (one per expert), on ``device``."""
    if isinstance(gs, (int, float)):
        if count is not None:
            raise ValueError(f"{name}: expected shape ({count},) (one per expert), got (1,)")
        return
    check_tensor(name, gs, dtypes=(torch.float32,), device=device)
    if count is None:
        if gs.numel() != 1:
            raise ValueError(f"{name}: expected a single fp32 value (shape [] or [1]), got shape {tuple(gs.shape)}")
    elif tuple(gs.shape) != (count,):
        raise ValueError(f"{name}: expected shape ({count},) (one per expert), got {tuple(gs.shape)}")


def as_global_scale(gs, device) -> torch.Tensor:
    """A checked global scale as a tensor (a Python number becomes fp32 ``[1]`` on ``device``)."""
    if isinstance(gs, (int, float)):
        return torch.tensor([float(gs)], dtype=torch.float32, device=device)
    return gs


def check_global_scale(name: str, gs, device, count: int | None = None) -> torch.Tensor:
    """:func:`check_global_scale_arg`, then the scale as a tensor (:func:`as_global_scale`)."""
    check_global_scale_arg(name, gs, device, count)
    return as_global_scale(gs, device)


def validated_by(check: Callable) -> Callable[[Callable], Callable]:
    """Decorator for a backend's implementation of a public op: a direct call runs ``check`` (the
    op's validator, same signature) first; ``fn.unchecked`` is the implementation alone, which the
    public op calls after validating once itself."""

    def wrap(impl: Callable) -> Callable:
        @functools.wraps(impl)
        def checked(*args, **kwargs):
            check(*args, **kwargs)
            return impl(*args, **kwargs)

        checked.unchecked = impl
        return checked

    return wrap


def unchecked(fn: Callable) -> Callable:
    """The implementation behind ``fn`` without its validator (``fn`` itself if it has none)."""
    return getattr(fn, "unchecked", fn)


# ------------------------------------------------------------------------------------------------
# One validator per public op (signature of the op)
# ------------------------------------------------------------------------------------------------

def check_scaled_fp4_quant(input, input_global_scale, *, swizzle=True, scale_format="e4m3") -> None:
    check_activation("input", input)
    check_choice("scale_format", scale_format, nx.NVFP4_SCALE_FORMATS)
    check_global_scale_arg("input_global_scale", input_global_scale, input.device)


def check_scaled_fp4_experts_quant(input, input_global_scale, expert_offsets, blockscale_offsets) -> None:
    check_activation("input", input)
    check_tensor("expert_offsets", expert_offsets, dtypes=INDEX_DTYPES, ndim=1, device=input.device)
    e = expert_offsets.shape[0] - 1
    if e < 1:
        raise ValueError(f"expert_offsets: expected shape (E+1,) with E >= 1, got {tuple(expert_offsets.shape)}")
    check_tensor("blockscale_offsets", blockscale_offsets, dtypes=INDEX_DTYPES, device=input.device)
    check_shape("blockscale_offsets", blockscale_offsets, (e + 1,))
    check_global_scale_arg("input_global_scale", input_global_scale, input.device, count=e)


def check_silu_and_mul_scaled_fp4_experts_quant(input, input_global_scale, mask, *, use_silu_and_mul=True,
                                                output=None, output_scale=None) -> None:
    check_tensor("input", input, dtypes=FLOAT_ACT_DTYPES, ndim=3)
    e, max_m, width = input.shape
    if use_silu_and_mul:
        check_multiple("input", width, 2 * nx.NVFP4_BLOCK_SIZE, "last dim (2*I)")
    else:
        check_multiple("input", width, nx.NVFP4_BLOCK_SIZE, "last dim (K)")
    k = width // 2 if use_silu_and_mul else width
    check_tensor("mask", mask, dtypes=INDEX_DTYPES, device=input.device)
    check_shape("mask", mask, (e,))
    check_global_scale_arg("input_global_scale", input_global_scale, input.device, count=e)
    sw_shape = (e, *nx.swizzled_scale_shape(max_m, k // nx.NVFP4_BLOCK_SIZE))
    for name, t, shape, dtype in (("output", output, (e, max_m, k // 2), torch.uint8),
                                  ("output_scale", output_scale, sw_shape, torch.float8_e4m3fn)):
        if t is not None:
            check_tensor(name, t, dtypes=(dtype,), device=input.device)
            check_shape(name, t, shape)


def check_silu_and_mul(input) -> None:
    check_tensor("input", input, dtypes=FLOAT_ACT_DTYPES, min_ndim=1)
    check_multiple("input", input.shape[-1], 2, "last dim (2*I)")


def check_dequantize_fp4(packed, scales, global_scale, *, swizzled, m, k, dtype=torch.float32) -> None:
    check_tensor("packed", packed, dtypes=(torch.uint8,), min_ndim=2)
    check_tensor("scales", scales, dtypes=(torch.float8_e4m3fn, torch.uint8), min_ndim=2)
    check_multiple("k", k, nx.NVFP4_BLOCK_SIZE)
    lead = tuple(packed.shape[:-2])
    check_shape("packed", packed, (*lead, m, k // 2))
    kb = k // nx.NVFP4_BLOCK_SIZE
    check_shape("scales", scales, (*lead, *(nx.swizzled_scale_shape(m, kb) if swizzled else (m, kb))))
    shape = tuple(global_scale.shape) if isinstance(global_scale, torch.Tensor) else \
        tuple(torch.as_tensor(global_scale).shape)
    if not (math.prod(shape) == 1 or shape in (lead, (*lead, m))):
        raise ValueError(f"global_scale: expected one value, shape {lead} (per leading index) or "
                         f"{(*lead, m)} (per row), got {shape}")


def check_fake_quant_nvfp4(x, global_scale=None, stochastic_rounding=False, *, seed=None) -> None:
    check_activation("x", x, ndim=None)
    if global_scale is not None:
        check_global_scale_arg("global_scale", global_scale, x.device)
    check_seed(seed, stochastic_rounding)


def check_mxfp4_quantize(x, *, scale_recipe=nx.DEFAULT_MX_SCALE_RECIPE, stochastic_rounding=False,
                         seed=None) -> None:
    check_activation("x", x, ndim=None, block=nx.MX_BLOCK_SIZE)
    check_choice("scale_recipe", scale_recipe, nx.MX_SCALE_RECIPES)
    check_seed(seed, stochastic_rounding)


def check_mxfp8_quantize(x, format="e4m3", *, scale_recipe=nx.DEFAULT_MX_SCALE_RECIPE, stochastic_rounding=False,
                         seed=None) -> None:
    check_choice("format", format, MXFP8_FORMATS)
    check_mxfp4_quantize(x, scale_recipe=scale_recipe, stochastic_rounding=stochastic_rounding, seed=seed)


def check_fake_quant_mxfp4(x, stochastic_rounding=False, *, scale_recipe=nx.DEFAULT_MX_SCALE_RECIPE,
                           seed=None) -> None:
    check_mxfp4_quantize(x, scale_recipe=scale_recipe, stochastic_rounding=stochastic_rounding, seed=seed)


def check_fake_quant_mxfp8(x, format="e4m3", stochastic_rounding=False, *, scale_recipe=nx.DEFAULT_MX_SCALE_RECIPE,
                           seed=None) -> None:
    check_mxfp8_quantize(x, format, scale_recipe=scale_recipe, stochastic_rounding=stochastic_rounding, seed=seed)


def check_scaled_fp8_quant(input, scale=None) -> None:
    check_activation("input", input, block=1)
    if scale is not None:
        check_global_scale_arg("scale", scale, input.device)


def check_per_token_quant_fp8(input) -> None:
    check_activation("input", input, block=1)


def check_per_token_group_quant_fp8(input, group_size=nx.FP8_GROUP_SIZE, *, column_major_scales=False,
                                    scale_ue8m0=False, eps=nx.FP8_GROUP_EPS) -> None:
    check_positive_int("group_size", group_size)
    check_activation("input", input, block=group_size)
    if scale_ue8m0 and not column_major_scales:
        raise ValueError("scale_ue8m0=True needs column_major_scales=True (the packed DeepGEMM layout)")


def check_stage_deepseek_v4_mega_moe_inputs(hidden_states, topk_weights, topk_ids, x_fp4, x_sf, topk_idx_out,
                                            topk_weights_out) -> None:
    check_tensor("hidden_states", hidden_states, dtypes=FLOAT_ACT_DTYPES, ndim=2)
    m, k = hidden_states.shape
    dev = hidden_states.device
    check_multiple("hidden_states", k, MEGA_MOE_HIDDEN_MULTIPLE, "last dim (hidden_size)")
    check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES, ndim=2, device=dev)
    if topk_ids.shape[0] != m:
        raise ValueError(f"topk_ids: expected {m} rows (one per token of hidden_states), got shape "
                         f"{tuple(topk_ids.shape)}")
    top = tuple(topk_ids.shape)
    check_tensor("topk_weights", topk_weights, dtypes=FLOAT_ACT_DTYPES, device=dev)
    check_shape("topk_weights", topk_weights, top)
    check_tensor("x_fp4", x_fp4, dtypes=(torch.uint8,), device=dev)
    check_shape("x_fp4", x_fp4, (m, k // 2))
    check_tensor("x_sf", x_sf, dtypes=(torch.int32,), device=dev)
    check_shape("x_sf", x_sf, (m, k // 64))
    check_tensor("topk_idx_out", topk_idx_out, dtypes=(torch.int64,), device=dev)
    check_shape("topk_idx_out", topk_idx_out, top)
    check_tensor("topk_weights_out", topk_weights_out, dtypes=FLOAT_ACT_DTYPES, device=dev)
    check_shape("topk_weights_out", topk_weights_out, top)
