"""Python side of the compiled quantization kernels (``nvfp4_plugin._C``, sources in ``csrc/``).

Each public function has the signature of its twin in :mod:`nvfp4_plugin.reference`: it allocates
the outputs and calls the torch ops ``torch.ops.nvfp4_plugin.<name>`` listed in :data:`CUDA_OPS`.
Arguments are validated by the op's validator in :mod:`nvfp4_plugin._checks`: once by the public op
in :mod:`nvfp4_plugin.ops`, which then calls ``<op>.unchecked`` here, or by the
:func:`~nvfp4_plugin._checks.validated_by` wrapper when a function here is called directly (tests,
benchmarks). The wrappers check only what is specific to the kernels (a CUDA device, contiguous
outputs written in place). The ops write into the outputs they are
given (their schemas mark them mutated), so the wrappers trace under ``torch.compile`` and replay
in CUDA graphs: no host synchronization, allocations only through torch's allocator.

Shapes the kernels do not cover fall back to the reference explicitly (and log it once):
more than 8192 experts, a per-token-group size other than 16..512 (power of two), per-token or
SiLU rows whose byte length is not a multiple of 16. Non-contiguous or misaligned inputs are copied.

Differences from the reference, by design:
* ``silu_and_mul_scaled_fp4_experts_quant`` writes into ``output`` / ``output_scale`` when they are
  given (the point of passing them: DeepEP buffers) and returns them; rows at or past the mask are
  left untouched there, as in the reference's result.
* Scale rows that no expert owns in ``scaled_fp4_experts_quant`` are zeroed by the kernel, which
  assumes consistent offsets (``expert_offsets[0] == 0``, non-decreasing, and
  ``blockscale_offsets[e+1] - blockscale_offsets[e] >= expert_offsets[e+1] - expert_offsets[e]``),
  as every engine builds them.
"""

from __future__ import annotations

import functools
import logging

import torch

from . import _checks as ck
from . import _ext
from . import numerics as nx
from . import reference
from ._checks import as_global_scale, validated_by

logger = logging.getLogger("nvfp4_plugin")

#: The table of this backend: each public op with a compiled kernel, and the torch ops (schemas of
#: ``csrc/``) its wrapper here launches. :mod:`nvfp4_plugin._cuda_register` registers the keys.
CUDA_OPS = {
    "scaled_fp4_quant": ("scaled_fp4_quant",),
    "scaled_fp4_experts_quant": ("scaled_fp4_experts_quant",),
    "silu_and_mul_scaled_fp4_experts_quant": ("silu_and_mul_scaled_fp4_experts_quant",),
    "silu_and_mul": ("silu_and_mul",),
    "scaled_fp8_quant": ("scaled_fp8_quant_static", "scaled_fp8_quant_dynamic"),
    "per_token_quant_fp8": ("per_token_quant_fp8",),
    "per_token_group_quant_fp8": ("per_token_group_quant_fp8",),
}

MAX_EXPERTS = 8192  # csrc/quant/launch.h kMaxExperts
GROUP_SIZES = (16, 32, 64, 128, 256, 512)


# ------------------------------------------------------------------------------------------------
# Loading and fake (meta) implementations
# ------------------------------------------------------------------------------------------------

_OPS = None


def _ops():
    """torch.ops.nvfp4_plugin after loading the extension and registering the fake implementations."""
    global _OPS
    if _OPS is None:
        st = _ext.extension_status()
        if not st.loaded:
            raise RuntimeError(f"nvfp4_plugin._C is not loaded: {st.error}")
        _register_fakes()
        _OPS = torch.ops.nvfp4_plugin
    return _OPS


def _register_fakes() -> None:
    # The ops only mutate their outputs: the fake implementations check nothing and return None.
    def noop(*args, **kwargs):
        return None

    for name in sorted({t for torch_ops in CUDA_OPS.values() for t in torch_ops}):
        qualname = f"nvfp4_plugin::{name}"
        try:
            torch.library.register_fake(qualname)(noop)
        except RuntimeError as exc:  # already registered (module reloaded)
            if "already" not in str(exc):
                raise


@functools.lru_cache(maxsize=None)
def _log_fallback(op: str, why: str) -> None:
    logger.info("nvfp4_plugin: %s: compiled kernel does not cover %s, using the reference", op, why)


def _fallback(op: str, why: str):
    _log_fallback(op, why)
    return getattr(reference, op).unchecked  # arguments already checked


def _dense(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (the kernels use 16-byte vector loads)."""
    if torch.compiler.is_compiling():  # no data pointers while tracing; compiled graphs allocate aligned
        return t.contiguous()
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _check_cuda(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor for the compiled kernels, got device {t.device}")


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous() if t.dtype != torch.int32 or not t.is_contiguous() else t


def _row_bytes_ok(x: torch.Tensor, elems: int) -> bool:
    return (elems * x.element_size()) % 16 == 0


# ------------------------------------------------------------------------------------------------
# NVFP4
# ------------------------------------------------------------------------------------------------

@validated_by(ck.check_scaled_fp4_quant)
def scaled_fp4_quant(input: torch.Tensor, input_global_scale: torch.Tensor, *, swizzle: bool = True,
                     scale_format: str = "e4m3"):
    """Compiled twin of :func:`nvfp4_plugin.reference.scaled_fp4_quant`."""
    _check_cuda("input", input)
    gs = as_global_scale(input_global_scale, input.device).reshape(1).contiguous()
    x = _dense(input)
    m, k = x.shape
    kb = k // nx.NVFP4_BLOCK_SIZE
    ue8m0 = scale_format == "ue8m0"
    out = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    shape = nx.swizzled_scale_shape(m, kb) if swizzle else (m, kb)
    scales = torch.empty(shape, dtype=torch.uint8 if ue8m0 else torch.float8_e4m3fn, device=x.device)
    _ops().scaled_fp4_quant(x, gs, out, scales, swizzle, ue8m0)
    return out, scales


@validated_by(ck.check_scaled_fp4_experts_quant)
def scaled_fp4_experts_quant(input: torch.Tensor, input_global_scale: torch.Tensor, expert_offsets: torch.Tensor,
                             blockscale_offsets: torch.Tensor):
    """Compiled twin of :func:`nvfp4_plugin.reference.scaled_fp4_experts_quant`."""
    _check_cuda("input", input)
    m, k = input.shape
    e = expert_offsets.shape[0] - 1
    gs = input_global_scale.contiguous()
    if e > MAX_EXPERTS:
        return _fallback("scaled_fp4_experts_quant", f"E = {e} > {MAX_EXPERTS}")(
            input, input_global_scale, expert_offsets, blockscale_offsets)
    x = _dense(input)
    kb = k // nx.NVFP4_BLOCK_SIZE
    out = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((nx.max_blockscale_rows(m, e), nx.round_up(kb, 4)), dtype=torch.float8_e4m3fn,
                         device=x.device)
    _ops().scaled_fp4_experts_quant(x, gs, _int32(expert_offsets), _int32(blockscale_offsets), out, scales)
    return out, scales


@validated_by(ck.check_silu_and_mul_scaled_fp4_experts_quant)
def silu_and_mul_scaled_fp4_experts_quant(input: torch.Tensor, input_global_scale: torch.Tensor, mask: torch.Tensor,
                                          *, use_silu_and_mul: bool = True, output: torch.Tensor | None = None,
                                          output_scale: torch.Tensor | None = None):
    """Compiled twin of :func:`nvfp4_plugin.reference.silu_and_mul_scaled_fp4_experts_quant` (writes into
    ``output`` / ``output_scale`` when given)."""
    _check_cuda("input", input)
    e, max_m, k, sw_shape = reference.masked_quant_shapes(input, use_silu_and_mul)
    gs = input_global_scale.contiguous()
    for name, t in (("output", output), ("output_scale", output_scale)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor (written in place), got strides {t.stride()}")
    if e > MAX_EXPERTS:
        return _fallback("silu_and_mul_scaled_fp4_experts_quant", f"E = {e} > {MAX_EXPERTS}")(
            input, input_global_scale, mask, use_silu_and_mul=use_silu_and_mul, output=output,
            output_scale=output_scale)
    x = _dense(input)
    zero_fill = output is None and output_scale is None
    if output is None:
        output = torch.empty if zero_fill else torch.zeros
        output = output((e, max_m, k // 2), dtype=torch.uint8, device=x.device)
    if output_scale is None:
        output_scale = (torch.empty if zero_fill else torch.zeros)(sw_shape, dtype=torch.float8_e4m3fn,
                                                                    device=x.device)
    _ops().silu_and_mul_scaled_fp4_experts_quant(x, gs, _int32(mask), use_silu_and_mul, zero_fill, output,
                                                 output_scale)
    return output, output_scale


@validated_by(ck.check_silu_and_mul)
def silu_and_mul(input: torch.Tensor) -> torch.Tensor:
    """Compiled twin of :func:`nvfp4_plugin.reference.silu_and_mul`."""
    _check_cuda("input", input)
    inner = input.shape[-1] // 2
    if not _row_bytes_ok(input, inner):
        return _fallback("silu_and_mul", f"I = {inner} (rows of 16-byte chunks)")(input)
    x = _dense(input)
    out = torch.empty((*x.shape[:-1], inner), dtype=x.dtype, device=x.device)
    _ops().silu_and_mul(x, out)
    return out


def silu_and_mul_into(x: torch.Tensor, out: torch.Tensor, table: int = -1) -> torch.Tensor:
    """:func:`silu_and_mul` of a contiguous, 16-byte aligned CUDA ``x [R, 2I]`` into a contiguous ``out [R, I]``
    of its dtype, for callers that checked both (the MoE glue) and whose rows are whole 16-byte chunks. ``table``:
    the bf16 SiLU lookup table where it pays (-1), never (0), always (1): the same bits either way."""
    _ops().silu_and_mul(x, out, table)
    return out


# ------------------------------------------------------------------------------------------------
# FP8 E4M3
# ------------------------------------------------------------------------------------------------

@validated_by(ck.check_scaled_fp8_quant)
def scaled_fp8_quant(input: torch.Tensor, scale: torch.Tensor | None = None):
    """Compiled twin of :func:`nvfp4_plugin.reference.scaled_fp8_quant`."""
    _check_cuda("input", input)
    x = _dense(input)
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    if scale is None:
        scale = torch.empty((1,), dtype=torch.float32, device=x.device)
        _ops().scaled_fp8_quant_dynamic(x, out, scale)
        return out, scale
    scale = as_global_scale(scale, input.device).reshape(1)
    _ops().scaled_fp8_quant_static(x, scale.contiguous(), out)
    return out, scale


@validated_by(ck.check_per_token_quant_fp8)
def per_token_quant_fp8(input: torch.Tensor):
    """Compiled twin of :func:`nvfp4_plugin.reference.per_token_quant_fp8`."""
    _check_cuda("input", input)
    m, k = input.shape
    if not _row_bytes_ok(input, k):
        return _fallback("per_token_quant_fp8", f"K = {k} (rows of 16-byte chunks)")(input)
    x = _dense(input)
    out = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    _ops().per_token_quant_fp8(x, out, scale)
    return out, scale


@validated_by(ck.check_per_token_group_quant_fp8)
def per_token_group_quant_fp8(input: torch.Tensor, group_size: int = nx.FP8_GROUP_SIZE, *,
                              column_major_scales: bool = False, scale_ue8m0: bool = False,
                              eps: float = nx.FP8_GROUP_EPS):
    """Compiled twin of :func:`nvfp4_plugin.reference.per_token_group_quant_fp8`."""
    _check_cuda("input", input)
    if group_size not in GROUP_SIZES:
        return _fallback("per_token_group_quant_fp8", f"group_size = {group_size}")(
            input, group_size, column_major_scales=column_major_scales, scale_ue8m0=scale_ue8m0, eps=eps)
    x = _dense(input)
    m, k = x.shape
    out = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    rows, cols = reference.fp8_group_scale_shape(m, k, group_size, scale_ue8m0=scale_ue8m0)
    dtype = torch.int32 if scale_ue8m0 else torch.float32
    if column_major_scales:  # DeepGEMM layout: column-major storage, M padded to 4 (the kernel fills the padding)
        scales = torch.empty((cols, nx.round_up(rows, 4)), dtype=dtype, device=x.device).t()[:rows]
    else:
        scales = torch.empty((rows, cols), dtype=dtype, device=x.device)
    _ops().per_token_group_quant_fp8(x, out, scales, group_size, float(eps), column_major_scales, scale_ue8m0)
    return out, scales


__all__ = list(CUDA_OPS)
