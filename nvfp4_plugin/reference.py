"""Pure-torch reference implementations of every op in the project (ground truth for tests).

Device-agnostic (CPU or CUDA), written for clarity rather than speed, and following
:mod:`nvfp4_plugin.numerics` step by step. Public ops in :mod:`nvfp4_plugin.ops` have the same
signatures; every kernel is tested byte-for-byte against these functions.

Global scales are *encode* scales everywhere (``gs = 2688 / amax``): quantize multiplies by them,
dequantize divides by them.

Each op's arguments are checked by its validator in :mod:`nvfp4_plugin._checks` (``check_<op>``),
attached with :func:`~nvfp4_plugin._checks.validated_by`: a direct call checks them, and the public
op, which has checked them already, calls ``<op>.unchecked``.
"""

from __future__ import annotations

import torch

from . import _checks as ck
from . import numerics as nx
from ._checks import FLOAT_ACT_DTYPES, as_global_scale, check_choice, check_shape, check_tensor, validated_by
from ._checks import MEGA_MOE_HIDDEN_MULTIPLE  # noqa: F401  (re-exported: the staging's hidden-size multiple)

# ----------------------------------------------------------------------------------------------
# Rounding helpers
# ----------------------------------------------------------------------------------------------


def _generator(device: torch.device, seed: int | None) -> torch.Generator:
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g


def stochastic_round_to_grid(v: torch.Tensor, fmt: str, generator: torch.Generator) -> torch.Tensor:
    """Round fp32 ``v`` to a neighbouring point of ``fmt``'s grid (``"e2m1"``, ``"e4m3"``, ``"e5m2"``).

    Between neighbours ``lo < |v| < hi`` the result is ``hi`` with probability
    ``(|v| - lo) / (hi - lo)``: unbiased. Saturates at the format max; NaN stays NaN; grid points
    are returned unchanged. The result holds grid values as fp32.
    """
    grid = nx.fp8_grid(fmt).to(v.device)
    a = v.float().abs().clamp(max=grid[-1].item())
    idx = torch.searchsorted(grid, torch.where(torch.isnan(a), torch.zeros_like(a), a), right=True) - 1
    idx = idx.clamp(0, grid.numel() - 1)
    lo = grid[idx]
    hi = grid[(idx + 1).clamp(max=grid.numel() - 1)]
    gap = hi - lo
    p = torch.where(gap > 0, (a - lo) / torch.where(gap > 0, gap, torch.ones_like(gap)), torch.zeros_like(a))
    u = torch.rand(a.shape, generator=generator, device=a.device, dtype=torch.float32)
    mag = torch.where(u < p, hi, lo)
    mag = torch.where(torch.isnan(v), v.float(), mag)
    return torch.where(torch.signbit(v), -mag, mag)


def _encode_elements(scaled: torch.Tensor, fmt: str, generator=None) -> torch.Tensor:
    """Scaled fp32 values -> E2M1 codes (uint8) or FP8 tensor, deterministic or stochastic."""
    if generator is not None:
        scaled = stochastic_round_to_grid(scaled, fmt, generator)
    if fmt == "e2m1":
        return nx.e2m1_encode(scaled)
    return nx.fp8_saturate(scaled, fmt)


def _decode_elements(elems: torch.Tensor, fmt: str) -> torch.Tensor:
    return nx.e2m1_decode(elems) if fmt == "e2m1" else elems.float()


# ----------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------


def _nvfp4_quantize(x: torch.Tensor, gs: torch.Tensor, scale_format: str = "e4m3", generator=None):
    """Core NVFP4 recipe over the last dim. ``gs`` broadcasts against ``x.shape[:-1] + (K/16,)``.

    Returns (packed uint8 ``[..., K/2]``, linear stored scales ``[..., K/16]``).
    """
    *lead, k = x.shape
    blocks = x.reshape(*lead, k // nx.NVFP4_BLOCK_SIZE, nx.NVFP4_BLOCK_SIZE)
    vmax = nx.nan_ignoring_amax(blocks, dim=-1)
    stored, _, out_scale = nx.nvfp4_block_scales(vmax, gs, scale_format)
    scaled = (blocks.float() * out_scale[..., None]).clamp(-nx.E2M1_MAX, nx.E2M1_MAX)
    codes = _encode_elements(scaled, "e2m1", generator)
    return nx.pack_fp4(codes.reshape(*lead, k)), stored


#: Activation check (the Triton kernel modules use it by this name).
_check_act = ck.check_activation


@validated_by(ck.check_scaled_fp4_quant)
def scaled_fp4_quant(input: torch.Tensor, input_global_scale: torch.Tensor, *, swizzle: bool = True,
                     scale_format: str = "e4m3"):
    """Quantize ``input[M, K]`` to NVFP4.

    Returns ``(uint8 [M, K/2], scales)``; scales are ``[round_up(M,128), round_up(K/16,4)]``
    (zero padded) if ``swizzle`` else ``[M, K/16]``, float8_e4m3fn (or uint8 exponent bytes for
    ``scale_format="ue8m0"``).
    """
    gs = as_global_scale(input_global_scale, input.device).reshape(())
    packed, scales = _nvfp4_quantize(input, gs, scale_format)
    return packed, (nx.swizzle_blockscale(scales) if swizzle else scales)


@validated_by(ck.check_dequantize_fp4)
def dequantize_fp4(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, *, swizzled: bool,
                   m: int, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NVFP4 ``[..., m, k/2]`` (+ block scales, linear or swizzled) -> ``[..., m, k]`` of ``dtype``.

    ``x_hat = (e2m1(q) * fp32(s)) / global_scale``; ``global_scale`` is a single value, one per
    leading index (e.g. per expert for ``[E, N, K/2]`` weights, shape ``[E]``), or one per row
    (shape ``[..., m]``, the :class:`~nvfp4_plugin.weights.Nvfp4Weight` convention).
    """
    lead = tuple(packed.shape[:-2])
    kb = k // nx.NVFP4_BLOCK_SIZE
    if swizzled:
        scales = nx.unswizzle_blockscale(scales, m, kb)
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device)
    if gs.numel() == 1:
        gs = gs.reshape(())
    elif tuple(gs.shape) == (*lead, m):
        gs = gs.reshape(*lead, m, 1, 1)
    else:  # one per leading index (the validator allows nothing else)
        gs = gs.reshape(*lead, 1, 1, 1)
    vals = nx.e2m1_decode(nx.unpack_fp4(packed)).reshape(*lead, m, kb, nx.NVFP4_BLOCK_SIZE)
    out = (vals * nx.nvfp4_scale_to_float(scales)[..., None]) / gs
    return out.reshape(*lead, m, k).to(dtype)


def _expert_of_rows(expert_offsets: torch.Tensor, m: int) -> torch.Tensor:
    """Expert index of each of ``m`` rows (``E`` for rows past ``expert_offsets[E]``)."""
    rows = torch.arange(m, device=expert_offsets.device, dtype=torch.int64)
    return torch.searchsorted(expert_offsets[1:].to(torch.int64).contiguous(), rows, right=True)


@validated_by(ck.check_scaled_fp4_experts_quant)
def scaled_fp4_experts_quant(input: torch.Tensor, input_global_scale: torch.Tensor, expert_offsets: torch.Tensor,
                             blockscale_offsets: torch.Tensor):
    """Quantize rows grouped by expert, each expert with its own global scale.

    ``input[M, K]``: rows ``expert_offsets[e]:expert_offsets[e+1]`` belong to expert e.
    Returns ``(uint8 [M, K/2], float8_e4m3fn [max_blockscale_rows(M, E), round_up(K/16, 4)])``:
    expert e's scales are swizzled in the rows starting at ``blockscale_offsets[e]`` (a multiple of
    128). Rows past ``expert_offsets[E]`` belong to no expert and stay zero.
    """
    m, k = input.shape
    e = expert_offsets.shape[0] - 1
    gs = input_global_scale
    kb = k // nx.NVFP4_BLOCK_SIZE
    expert = _expert_of_rows(expert_offsets, m)
    valid = expert < e
    ex = expert.clamp(max=e - 1)
    packed, scales = _nvfp4_quantize(input, gs[ex][:, None])
    packed = torch.where(valid[:, None], packed, torch.zeros_like(packed))

    rows_total = nx.max_blockscale_rows(m, e)
    kp = nx.round_up(kb, 4)
    dest = blockscale_offsets.to(torch.int64)[ex] + (torch.arange(m, device=input.device) - expert_offsets.to(torch.int64)[ex])
    # rows of no expert go to a spare last row that is dropped: no boolean indexing, so no host sync
    # (this reference is the fallback inside CUDA-graph-captured MoE forwards on machines without
    # the compiled kernels)
    dest = torch.where(valid, dest, torch.full_like(dest, rows_total))
    src = torch.zeros((m, kp), dtype=torch.uint8, device=input.device)
    src[:, :kb] = scales.view(torch.uint8)
    linear = torch.zeros((rows_total + 1, kp), dtype=torch.uint8, device=input.device).index_copy_(0, dest, src)
    return packed, nx.swizzle_blockscale(linear[:rows_total].view(torch.float8_e4m3fn))


@validated_by(ck.check_silu_and_mul)
def silu_and_mul(input: torch.Tensor) -> torch.Tensor:
    """``silu(input[..., :I]) * input[..., I:]`` in fp32 (fixed op sequence), rounded to input dtype."""
    return nx.silu_and_mul_fp32(input)


def masked_quant_shapes(input: torch.Tensor, use_silu_and_mul: bool):
    """Shapes of silu_and_mul_scaled_fp4_experts_quant for a checked ``input [E, max_m, width]``:
    (E, max_m, K quantized, swizzled scale shape ``[E, round_up(max_m,128), round_up(K/16,4)]``)."""
    e, max_m, width = input.shape
    k = width // 2 if use_silu_and_mul else width
    return e, max_m, k, (e, *nx.swizzled_scale_shape(max_m, k // nx.NVFP4_BLOCK_SIZE))


@validated_by(ck.check_silu_and_mul_scaled_fp4_experts_quant)
def silu_and_mul_scaled_fp4_experts_quant(input: torch.Tensor, input_global_scale: torch.Tensor, mask: torch.Tensor,
                                          *, use_silu_and_mul: bool = True, output: torch.Tensor | None = None,
                                          output_scale: torch.Tensor | None = None):
    """Masked-layout quantization (DeepEP low-latency), optionally fused with SiLU-and-mul.

    ``input[E, max_m, 2I]`` (or ``[E, max_m, K]`` without SiLU), ``mask[E]`` valid rows per expert
    (values above ``max_m`` act as ``max_m``). Returns ``(uint8 [E, max_m, I/2], float8_e4m3fn
    [E, round_up(max_m,128), round_up(I/16,4)])`` swizzled per expert. Rows at or past ``mask[e]``
    are left untouched: as given in ``output``/``output_scale``, else zero.
    """
    e, max_m, k, sw_shape = masked_quant_shapes(input, use_silu_and_mul)
    gs = input_global_scale
    kb = k // nx.NVFP4_BLOCK_SIZE
    if output is None:
        output = torch.zeros((e, max_m, k // 2), dtype=torch.uint8, device=input.device)
    if output_scale is None:
        output_scale = torch.zeros(sw_shape, dtype=torch.float8_e4m3fn, device=input.device)

    x = nx.silu_and_mul_fp32(input) if use_silu_and_mul else input
    packed, scales = _nvfp4_quantize(x, gs[:, None, None])
    valid = torch.arange(max_m, device=input.device)[None, :] < mask.to(torch.int64)[:, None]  # [E, max_m]
    out = torch.where(valid[..., None], packed, output)
    lin = nx.unswizzle_blockscale(output_scale, sw_shape[1], sw_shape[2]).view(torch.uint8).clone()
    lin[:, :max_m, :kb] = torch.where(valid[..., None], scales.view(torch.uint8), lin[:, :max_m, :kb])
    return out, nx.swizzle_blockscale(lin).view(torch.float8_e4m3fn)


@validated_by(ck.check_fake_quant_nvfp4)
def fake_quant_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | None = None, stochastic_rounding: bool = False, *,
                     seed: int | None = None) -> torch.Tensor:
    """NVFP4 quantize + dequantize over the last dim (any leading shape), same dtype out.

    ``global_scale`` defaults to the tensor's dynamic scale :func:`numerics.tensor_global_scale`.
    """
    gs = nx.tensor_global_scale(x) if global_scale is None else as_global_scale(global_scale, x.device).reshape(())
    gen = _generator(x.device, seed) if stochastic_rounding else None
    packed, scales = _nvfp4_quantize(x, gs, generator=gen)
    lead, k = x.shape[:-1], x.shape[-1]
    flat = dequantize_fp4.unchecked(packed.reshape(-1, k // 2), scales.reshape(-1, k // 16), gs, swizzled=False,
                                    m=packed.numel() // max(k // 2, 1), k=k)
    return flat.reshape(*lead, k).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# MX formats
# ----------------------------------------------------------------------------------------------


def mx_scale_exponent(amax: torch.Tensor, fmt: str, scale_recipe: str = nx.DEFAULT_MX_SCALE_RECIPE) -> torch.Tensor:
    """Unbiased E8M0 exponent per block from its fp32 amax (see the numerics docstring), int32."""
    check_choice("format", fmt, nx.MX_ELEMENT_FORMATS)
    check_choice("scale_recipe", scale_recipe, nx.MX_SCALE_RECIPES)
    return _mx_scale_exponent(amax, fmt, scale_recipe)


def _mx_scale_exponent(amax: torch.Tensor, fmt: str, scale_recipe: str) -> torch.Tensor:
    emax = {"e2m1": nx.E2M1_EMAX, "e4m3": nx.E4M3_EMAX, "e5m2": nx.E5M2_EMAX}[fmt]
    fmax = {"e2m1": nx.E2M1_MAX, "e4m3": nx.E4M3_MAX, "e5m2": nx.E5M2_MAX}[fmt]
    pos = amax > 0
    safe = torch.where(pos, amax, torch.ones_like(amax))
    if scale_recipe == "floor":
        e = nx.floor_log2_exponent(safe) - emax
    else:
        q = safe / torch.full_like(safe, fmax)  # tensor/tensor: IEEE division on CUDA as well
        e = nx.ceil_log2_exponent(torch.where(q > 0, q, torch.ones_like(q)))
        e = torch.where(q > 0, e, torch.full_like(e, -nx.E8M0_BIAS))
    e = torch.where(pos, e, torch.full_like(e, -nx.E8M0_BIAS))
    return e.clamp(-nx.E8M0_BIAS, nx.E8M0_BIAS)


def mx_quantize(x: torch.Tensor, fmt: str, *, scale_recipe: str = nx.DEFAULT_MX_SCALE_RECIPE,
                stochastic_rounding: bool = False, seed: int | None = None):
    """MX quantize over the last dim (blocks of 32): ``(elements, E8M0 scale bytes [..., K/32])``.

    Elements are uint8 E2M1 codes ``[..., K]`` (unpacked) for ``"e2m1"`` and float8 for FP8.
    """
    ck.check_activation("x", x, ndim=None, block=nx.MX_BLOCK_SIZE)
    check_choice("format", fmt, nx.MX_ELEMENT_FORMATS)
    check_choice("scale_recipe", scale_recipe, nx.MX_SCALE_RECIPES)
    ck.check_seed(seed, stochastic_rounding)
    return _mx_quantize(x, fmt, scale_recipe=scale_recipe, stochastic_rounding=stochastic_rounding, seed=seed)


def _mx_quantize(x: torch.Tensor, fmt: str, *, scale_recipe: str, stochastic_rounding: bool, seed: int | None):
    *lead, k = x.shape
    blocks = x.reshape(*lead, k // nx.MX_BLOCK_SIZE, nx.MX_BLOCK_SIZE).float()
    e = _mx_scale_exponent(nx.nan_ignoring_amax(blocks, dim=-1, inf_as_max=True), fmt, scale_recipe)
    scaled = blocks * nx.exp2_int(-e)[..., None]
    gen = _generator(x.device, seed) if stochastic_rounding else None
    elems = _encode_elements(scaled, fmt, gen)
    return elems.reshape(*lead, k), (e + nx.E8M0_BIAS).to(torch.uint8)


def mx_dequantize(elements: torch.Tensor, scales: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32):
    """Inverse of :func:`mx_quantize` (elements unpacked), ``[..., K]`` of ``dtype``."""
    *lead, k = elements.shape
    vals = _decode_elements(elements, fmt).reshape(*lead, k // nx.MX_BLOCK_SIZE, nx.MX_BLOCK_SIZE)
    return (vals * nx.ue8m0_to_float(scales)[..., None]).reshape(*lead, k).to(dtype)


@validated_by(ck.check_mxfp4_quantize)
def mxfp4_quantize(x: torch.Tensor, *, scale_recipe: str = nx.DEFAULT_MX_SCALE_RECIPE,
                   stochastic_rounding: bool = False, seed: int | None = None):
    """MXFP4: ``(packed uint8 [..., K/2], E8M0 bytes [..., K/32])``."""
    codes, scales = _mx_quantize(x, "e2m1", scale_recipe=scale_recipe, stochastic_rounding=stochastic_rounding,
                                 seed=seed)
    return nx.pack_fp4(codes), scales


@validated_by(ck.check_mxfp8_quantize)
def mxfp8_quantize(x: torch.Tensor, format: str = "e4m3", *, scale_recipe: str = nx.DEFAULT_MX_SCALE_RECIPE,
                   stochastic_rounding: bool = False, seed: int | None = None):
    """MXFP8 (``"e4m3"`` or ``"e5m2"``): ``(float8 [..., K], E8M0 bytes [..., K/32])``."""
    return _mx_quantize(x, format, scale_recipe=scale_recipe, stochastic_rounding=stochastic_rounding, seed=seed)


@validated_by(ck.check_fake_quant_mxfp4)
def fake_quant_mxfp4(x: torch.Tensor, stochastic_rounding: bool = False, *,
                     scale_recipe: str = nx.DEFAULT_MX_SCALE_RECIPE, seed: int | None = None) -> torch.Tensor:
    """MXFP4 quantize + dequantize over the last dim (a multiple of 32), same dtype out."""
    codes, scales = _mx_quantize(x, "e2m1", scale_recipe=scale_recipe, stochastic_rounding=stochastic_rounding,
                                 seed=seed)
    return mx_dequantize(codes, scales, "e2m1", x.dtype)


@validated_by(ck.check_fake_quant_mxfp8)
def fake_quant_mxfp8(x: torch.Tensor, format: str = "e4m3", stochastic_rounding: bool = False, *,
                     scale_recipe: str = nx.DEFAULT_MX_SCALE_RECIPE, seed: int | None = None) -> torch.Tensor:
    """MXFP8 (``"e4m3"`` or ``"e5m2"``) quantize + dequantize over the last dim, same dtype out."""
    elems, scales = _mx_quantize(x, format, scale_recipe=scale_recipe, stochastic_rounding=stochastic_rounding,
                                 seed=seed)
    return mx_dequantize(elems, scales, format, x.dtype)


# ----------------------------------------------------------------------------------------------
# FP8 activation quantizers (sgl-kernel recipes)
# ----------------------------------------------------------------------------------------------


def _inverse_or_zero(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s == 0, torch.zeros_like(s), 1.0 / torch.where(s == 0, torch.ones_like(s), s))


@validated_by(ck.check_scaled_fp8_quant)
def scaled_fp8_quant(input: torch.Tensor, scale: torch.Tensor | None = None):
    """Per-tensor FP8 E4M3: static with ``scale`` (decode scale, fp32) or dynamic (``amax / 448``).

    Returns ``(float8_e4m3fn [M, K], scale [1])``.
    """
    if scale is None:
        amax = nx.nan_ignoring_amax(input.reshape(-1), dim=0, inf_as_max=True) if input.numel() else \
            torch.zeros((), device=input.device)
        scale = (amax / torch.full_like(amax, nx.E4M3_MAX)).reshape(1)  # tensor/tensor: IEEE on CUDA too
    else:
        scale = as_global_scale(scale, input.device).reshape(1)
    return nx.e4m3_saturate(input.float() * _inverse_or_zero(scale)), scale


@validated_by(ck.check_per_token_quant_fp8)
def per_token_quant_fp8(input: torch.Tensor):
    """Per-token dynamic FP8 E4M3: ``s_row = amax_row / 448``; returns ``(q [M, K], s [M, 1])``."""
    if input.shape[1]:
        amax = nx.nan_ignoring_amax(input, dim=-1, inf_as_max=True)[:, None]
        s = amax / torch.full_like(amax, nx.E4M3_MAX)  # tensor/tensor: CUDA turns t / 448.0 into t * (1/448)
    else:
        s = torch.zeros((input.shape[0], 1), device=input.device)
    return nx.e4m3_saturate(input.float() * _inverse_or_zero(s)), s


def fp8_group_scale_shape(m: int, k: int, group_size: int = nx.FP8_GROUP_SIZE, *, scale_ue8m0: bool = False):
    """Logical shape of per-token-group scales: ``[m, k/group]`` fp32, or ``[m, ceil(k/group/4)]`` int32
    (four UE8M0 bytes per word) for ``scale_ue8m0``."""
    groups = k // group_size
    return (m, nx.ceil_div(groups, 4)) if scale_ue8m0 else (m, groups)


def alloc_fp8_group_scales(m: int, k: int, group_size: int, *, column_major: bool, scale_ue8m0: bool,
                           device) -> torch.Tensor:
    """Scale tensor in the layout DeepGEMM wants: column-major storage with M padded to 4 (16 bytes)."""
    rows, cols = fp8_group_scale_shape(m, k, group_size, scale_ue8m0=scale_ue8m0)
    dtype = torch.int32 if scale_ue8m0 else torch.float32
    if not column_major:
        return torch.zeros((rows, cols), dtype=dtype, device=device)
    return torch.zeros((cols, nx.round_up(rows, 4)), dtype=dtype, device=device).t()[:rows]


@validated_by(ck.check_per_token_group_quant_fp8)
def per_token_group_quant_fp8(input: torch.Tensor, group_size: int = nx.FP8_GROUP_SIZE, *,
                              column_major_scales: bool = False, scale_ue8m0: bool = False,
                              eps: float = nx.FP8_GROUP_EPS):
    """Per-token-group FP8 E4M3 (DeepSeek-style, group 128) with the sgl-kernel recipe.

    Returns ``(q [M, K], scales)``. Scales are fp32 ``[M, K/group]`` (row-major, or column-major
    storage with M padded to 4 if ``column_major_scales``), or with ``scale_ue8m0`` int32
    ``[M, ceil(K/group/4)]`` holding 4 UE8M0 bytes per word (group g in byte g % 4), column-major.
    """
    m, k = input.shape
    groups = input.reshape(m, k // group_size, group_size).float()
    a = nx.nan_ignoring_amax(groups, dim=-1, inf_as_max=True).clamp(min=eps)
    if scale_ue8m0:
        e = nx.ceil_log2_exponent(a * nx._ONE_OVER_448_F32)
        mult = nx.exp2_int(-e)
        stored = (e + nx.E8M0_BIAS).to(torch.uint8)
    else:
        mult = nx.fp32_div(nx.E4M3_MAX, a)
        stored = a * nx._ONE_OVER_448_F32
    q = nx.e4m3_saturate(groups * mult[..., None]).reshape(m, k)
    out_s = alloc_fp8_group_scales(m, k, group_size, column_major=column_major_scales, scale_ue8m0=scale_ue8m0,
                                   device=input.device)
    if scale_ue8m0:
        words = out_s.shape[1]
        padded = torch.zeros((m, words * 4), dtype=torch.uint8, device=input.device)
        padded[:, :stored.shape[1]] = stored
        out_s.copy_(padded.view(torch.int32))
    else:
        out_s.copy_(stored)
    return q, out_s


# ----------------------------------------------------------------------------------------------
# Linear and fused MoE (ground truth for the GEMM backends)
# ----------------------------------------------------------------------------------------------

LINEAR_MODES = ("w4a16", "w4a4")


def nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_global_scale: torch.Tensor, bias: torch.Tensor | None = None, *, mode: str = "w4a16",
                 input_global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ dequant(W)^T + bias`` with an NVFP4 weight ``[N, K/2]`` (linear scales ``[N, K/16]``,
    ``weight_global_scale`` one value or one per output row).

    ``w4a16``: activations used as they are. ``w4a4``: activations first go through
    :func:`scaled_fp4_quant` with ``input_global_scale`` and back (what the Blackwell path computes).
    Math in fp32, result rounded to ``x.dtype``. ``x`` may have any leading dims.
    """
    check_choice("mode", mode, LINEAR_MODES)
    check_tensor("x", x, dtypes=FLOAT_ACT_DTYPES, min_ndim=1)
    check_tensor("weight", weight, dtypes=(torch.uint8,), ndim=2)
    n, k = weight.shape[0], weight.shape[1] * 2
    if x.shape[-1] != k:
        raise ValueError(f"x: expected last dim {k} (weight is [{n}, {k // 2}] packed), got {x.shape[-1]}")
    w = dequantize_fp4(weight, weight_scale, weight_global_scale, swizzled=False, m=n, k=k)
    x2 = x.reshape(-1, k)
    if mode == "w4a4":
        if input_global_scale is None:
            raise ValueError("input_global_scale: required for mode='w4a4'")
        q, s = scaled_fp4_quant(x2, input_global_scale, swizzle=False)
        xf = dequantize_fp4(q, s, input_global_scale, swizzled=False, m=x2.shape[0], k=k)
    else:
        xf = x2.float()
    y = xf @ w.t()
    if bias is not None:
        check_shape("bias", bias, (n,))
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def route_topk(router_logits: torch.Tensor, top_k: int, *, renormalize: bool = True):
    """Softmax (fp32) over experts, then top-k: ``(topk_weights fp32 [T, k], topk_ids int32 [T, k])``."""
    check_tensor("router_logits", router_logits, dtypes=FLOAT_ACT_DTYPES, ndim=2)
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k: expected 1..{router_logits.shape[1]}, got {top_k}")
    probs = torch.softmax(router_logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids.to(torch.int32)


def _expert_gs(gs: torch.Tensor, ex: int) -> torch.Tensor:
    return gs[ex] if gs.dim() == 2 else gs[ex:ex + 1]


def nvfp4_fused_moe(hidden_states: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                    w13_global_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                    w2_global_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                    mode: str = "w4a16", a13_global_scale: torch.Tensor | None = None,
                    a2_global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Reference NVFP4 fused MoE with SiLU-and-mul.

    ``w13 [E, 2I, H/2]`` (gate rows first, then up), ``w2 [E, H, I/2]``, linear block scales,
    encode global scales per expert ``[E]`` or per expert row ``[E, 2I]`` / ``[E, H]``. Per routed
    (token, expert) pair:
    ``h = x @ W13[e]^T`` (rounded to the activation dtype), ``a = silu_and_mul(h)``,
    ``y = a @ W2[e]^T`` (rounded), and the output is ``sum_k topk_weights[k] * y_k`` in fp32,
    rounded. ``w4a4`` quantizes x with ``a13_global_scale[e]`` and ``a`` with ``a2_global_scale[e]``.
    """
    check_choice("mode", mode, LINEAR_MODES)
    check_tensor("hidden_states", hidden_states, dtypes=FLOAT_ACT_DTYPES, ndim=2)
    check_tensor("w13", w13, dtypes=(torch.uint8,), ndim=3)
    check_tensor("w2", w2, dtypes=(torch.uint8,), ndim=3)
    t, h = hidden_states.shape
    e, two_i = w13.shape[0], w13.shape[1]
    check_shape("w13", w13, (e, two_i, h // 2))
    check_shape("w2", w2, (e, h, two_i // 4))
    check_tensor("topk_ids", topk_ids, dtypes=(torch.int32, torch.int64), ndim=2)
    check_shape("topk_weights", topk_weights, tuple(topk_ids.shape))
    if topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids: expected {t} rows (one per token), got {topk_ids.shape[0]}")
    if mode == "w4a4" and (a13_global_scale is None or a2_global_scale is None):
        raise ValueError("a13_global_scale / a2_global_scale: required for mode='w4a4'")
    dtype = hidden_states.dtype
    out = torch.zeros((t, h), dtype=torch.float32, device=hidden_states.device)
    ids = topk_ids.to(torch.int64)
    for ex in range(e):
        tok, slot = torch.nonzero(ids == ex, as_tuple=True)
        if tok.numel() == 0:
            continue
        kw = {}
        if mode == "w4a4":
            kw = dict(mode="w4a4", input_global_scale=a13_global_scale[ex:ex + 1])
        hid = nvfp4_linear(hidden_states[tok], w13[ex], w13_scale[ex], _expert_gs(w13_global_scale, ex), **kw)
        act = nx.silu_and_mul_fp32(hid)
        if mode == "w4a4":
            kw = dict(mode="w4a4", input_global_scale=a2_global_scale[ex:ex + 1])
        y = nvfp4_linear(act, w2[ex], w2_scale[ex], _expert_gs(w2_global_scale, ex), **kw)
        out.index_add_(0, tok, y.float() * topk_weights[tok, slot].float()[:, None])
    return out.to(dtype)


# ----------------------------------------------------------------------------------------------
# DeepSeek-V4 MegaMoE input staging (seed file 004). Appended with the Triton kernels (issue 4);
# the byte-exact Triton twin is nvfp4_plugin.triton.staging.
# ----------------------------------------------------------------------------------------------

#: Encode global scale of the staging. The MegaMoE GEMM consumes the UE4M3 block scales as they are
#: and has no per-tensor factor (seed 004 computes ``amax / 6`` directly), so the NVFP4 recipe runs
#: with ``gs = 1``: ``s = e4m3(vmax * fp32(1/6))``, ``q = E2M1(x / s)``, ``x_hat = e2m1(q) * s``.
MEGA_MOE_GLOBAL_SCALE = 1.0


#: Validation of the staging (the Triton staging uses it by this name; metadata only, no host sync).
check_mega_moe_staging_args = ck.check_stage_deepseek_v4_mega_moe_inputs


def pack_mega_moe_scales(scales: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales ``[M, K/16]`` -> int32 ``[M, K/64]``, group g in byte ``g % 4`` of word ``g // 4``."""
    b = scales.view(torch.uint8).to(torch.int64).reshape(*scales.shape[:-1], -1, 4)
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_mega_moe_scales(x_sf: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_mega_moe_scales`: int32 ``[M, K/64]`` -> float8_e4m3fn ``[M, K/16]``."""
    w = x_sf.to(torch.int64) & 0xFFFFFFFF
    b = torch.stack([(w >> (8 * j)) & 0xFF for j in range(4)], dim=-1).to(torch.uint8)
    return b.reshape(*x_sf.shape[:-1], -1).view(torch.float8_e4m3fn)


@validated_by(ck.check_stage_deepseek_v4_mega_moe_inputs)
def stage_deepseek_v4_mega_moe_inputs(hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                                      topk_ids: torch.Tensor, x_fp4: torch.Tensor, x_sf: torch.Tensor,
                                      topk_idx_out: torch.Tensor, topk_weights_out: torch.Tensor) -> None:
    """Stage MegaMoE inputs in place: ``x_fp4`` (E2M1 ``[M, K/2]``), ``x_sf`` (UE4M3 per 16, packed four
    per int32 ``[M, K/64]``), ``topk_idx_out = topk_ids`` as int64, ``topk_weights_out = topk_weights``.

    ``K`` must be a multiple of 128; arguments are validated for any M, and ``M == 0`` writes nothing.
    The quantization is the NVFP4 recipe of :mod:`nvfp4_plugin.numerics` with
    :data:`MEGA_MOE_GLOBAL_SCALE` (1): the same bytes as ``scaled_fp4_quant(hidden_states, 1.0,
    swizzle=False)``. Without a global scale, a block whose amax is at most ``6 * 2**-10`` gets scale
    0 (every value becomes a signed zero) and blocks below ``6 * 2**-6`` get subnormal (coarser)
    scales; scale ``hidden_states`` beforehand if that matters (the consumer has no per-tensor factor).

    Differences from the seed kernel's rounding (ours follows DESIGN 3.1/3.2):
      * E2M1 ties go to even: 0.25 -> 0, 1.25 -> 1, 2.5 -> 2, 5 -> 4 (the seed's ``<`` thresholds
        send these four up; 0.75, 1.75 and 3.5 agree);
      * the E4M3 scale is rounded to nearest even (the seed adds the round bit: ties up), saturates at
        448 (the seed's exponent clamp can produce 0x7F, a NaN), and subnormal scales are correct
        (the seed clamps the exponent to 0 but keeps the normal mantissa bits, so every block with
        ``amax < 0.09375`` gets a wrong scale, often 0 followed by saturated elements);
      * an all-zero block has scale 0 (the seed floors amax at 1e-4); NaN never raises a scale and
        encodes as code 0;
      * elements are multiplied by the IEEE reciprocal ``1 / s`` (the seed divides with Triton's
        approximate ``/``), and ``-0.0`` encodes as 0x8 (the seed's ``scaled < 0`` test gives +0).
    """
    if hidden_states.shape[0] == 0:
        return
    gs = torch.full((), MEGA_MOE_GLOBAL_SCALE, dtype=torch.float32, device=hidden_states.device)
    packed, scales = _nvfp4_quantize(hidden_states, gs)
    x_fp4.copy_(packed)
    x_sf.copy_(pack_mega_moe_scales(scales))
    topk_idx_out.copy_(topk_ids.to(torch.int64))
    topk_weights_out.copy_(topk_weights)
