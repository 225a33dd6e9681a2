"""MX formats in Triton (OCP MX v1.0, blocks of 32, E8M0 scales): MXFP4 (E2M1) and MXFP8 (E4M3/E5M2).

``mxfp4_forward`` / ``mxfp8_forward`` fake-quantize (same dtype out); ``mxfp4_quantize`` returns
packed E2M1 bytes + E8M0 bytes, ``mxfp8_quantize`` FP8 elements + E8M0 bytes. Scale recipes
``"floor"`` (OCP, default) and ``"rceil"``; deterministic rounding is byte-identical to
:mod:`nvfp4_plugin.reference`, stochastic rounding picks one of the two grid neighbours, unbiased,
from a Philox stream keyed by ``seed`` (scales stay deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import numerics as nx
from .. import reference as ref
from .._checks import check_choice
from . import _jit_numerics as jn
from . import _runtime as rt

# format -> (FMT id, element max, emax, mantissa bits, exponent bias, smallest normal exponent field)
_FORMATS = {
    "e2m1": (0, nx.E2M1_MAX, nx.E2M1_EMAX, 1, 1, 127),
    "e4m3": (1, nx.E4M3_MAX, nx.E4M3_EMAX, 3, 7, 121),
    "e5m2": (2, nx.E5M2_MAX, nx.E5M2_EMAX, 2, 15, 113),
}


@triton.jit(do_not_specialize=["seed"])
def _mx_kernel(x_ptr, out_ptr, scale_ptr, M, K, stride_xm, stride_om, stride_sm, seed,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
               FMT: tl.constexpr, FMAX: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
               EMIN_FIELD: tl.constexpr, RCEIL: tl.constexpr, FAKE: tl.constexpr, STOCHASTIC: tl.constexpr,
               N_ROUNDS: tl.constexpr, HW_FP8: tl.constexpr, COMPILED: tl.constexpr, K_FAST: tl.constexpr,
               VEC: tl.constexpr):
    NB: tl.constexpr = BLOCK_K // 32
    pid_m, pid_k = jn.tile_ids(K_FAST)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    cols = jn.block_cols(pid_k * BLOCK_K, NB, 4, VEC)
    x = jn.load_block_tile(x_ptr, rows64, row_ok, cols, K, stride_xm, 1, 4)  # [NB, BM, 4, 8]: block, row, quarter, element

    amax = tl.minimum(jn.block_amax(x, COMPILED), jn.FLT_MAX)  # NaN ignored, Inf counts as FLT_MAX
    e = jn.mx_exponent(amax, FMAX, EMAX, RCEIL)  # [NB, BM]
    v = x * jn.exp2i(-e)[:, :, None, None]  # exact; NaN exactly where x is NaN
    if STOCHASTIC:
        u = jn.uniform_blocks(seed, rows64, pid_k * BLOCK_K, K, NB, 4, N_ROUNDS, COMPILED)
    else:
        u = 0.0

    if FMT == 0:  # E2M1 has no NaN: code 0 (+0)
        if FAKE:
            a, sbit = jn.e2m1_magnitude(v, COMPILED)
            if STOCHASTIC:
                r = jn.grid_round_stochastic(a, u, MBITS, EMIN_FIELD, COMPILED)
            else:
                r = jn.grid_round(a, MBITS, EMIN_FIELD)
            y = jn.bits_f32(jn.f32_bits(r) | sbit) * jn.exp2i(e)[:, :, None, None]
        else:
            jn.store_words(out_ptr, jn.e2m1_words(v, u, STOCHASTIC, COMPILED), rows64, row_ok,
                           pid_k * (BLOCK_K // 8), K, stride_om, 1, 4, True)
    else:
        nan = v != v
        vsign = jn.f32_bits(v) & 0x80000000
        a = tl.minimum(tl.abs(v), FMAX)  # NaN lanes are overwritten below
        if STOCHASTIC:
            r = jn.grid_round_stochastic(a, u, MBITS, EMIN_FIELD, COMPILED)
        elif HW_FP8:
            r = a  # rounded by the hardware conversion below
        else:
            r = jn.grid_round(a, MBITS, EMIN_FIELD)
        signed_r = jn.bits_f32(jn.f32_bits(r) | vsign)
        if HW_FP8:
            if FMT == 1:
                q = signed_r.to(tl.float8e4nv)
            else:
                q = signed_r.to(tl.float8e5)
            qbyte = q.to(tl.uint8, bitcast=True).to(tl.uint32)
            qval = q.to(tl.float32)
        else:
            qbyte = jn.fp8_byte_of_grid(r, MBITS, BIAS) | (vsign >> 24)
            qval = signed_r
        if FAKE:
            y = tl.where(nan, v, qval) * jn.exp2i(e)[:, :, None, None]
        else:
            qbyte = tl.where(nan, 0x7F | (vsign >> 24), qbyte)  # NaN stays NaN, sign kept (as torch's cast)
            q8 = tl.reshape(qbyte.to(tl.uint8), [NB, BLOCK_M, 32 // VEC, VEC])
            tl.store(out_ptr + rows64[None, :, None, None] * stride_om + cols, q8,
                     mask=row_ok[None, :, None, None] & (cols < K))

    if FAKE:
        jn.store_block_tile(out_ptr, y, rows64, row_ok, pid_k * BLOCK_K, K, stride_om, 4)
    else:
        kb = pid_k * NB + tl.arange(0, NB)[:, None]  # [NB, 1]
        sbyte = (e + 127).to(tl.uint8)
        tl.store(scale_ptr + rows64[None, :] * stride_sm + kb, sbyte, mask=row_ok[None, :] & (kb < K // 32))


def _run(x: torch.Tensor, fmt: str, *, fake: bool, scale_recipe: str, stochastic_rounding: bool, seed):
    ref._check_act("x", x, ndim=None, block=nx.MX_BLOCK_SIZE)
    check_choice("format", fmt, nx.MX_ELEMENT_FORMATS)
    check_choice("scale_recipe", scale_recipe, nx.MX_SCALE_RECIPES)
    rt.check_device("x", x)
    seed = rt.resolve_seed(seed) if stochastic_rounding else 0
    x2 = rt.rows_view(x)
    m, k = x2.shape
    lead = tuple(x.shape[:-1])
    if fake:
        out = torch.empty((m, k), dtype=x.dtype, device=x.device)
        scales = None
    else:
        out_dtype = torch.uint8 if fmt == "e2m1" else nx.FP8_FORMATS[fmt][0]
        out = torch.empty((m, k // 2 if fmt == "e2m1" else k), dtype=out_dtype, device=x.device)
        scales = torch.empty((m, k // nx.MX_BLOCK_SIZE), dtype=torch.uint8, device=x.device)
    if m and k:
        fid, fmax, emax, mbits, bias, emin_field = _FORMATS[fmt]
        bm, bk, warps = rt.tile("mx", k, nx.MX_BLOCK_SIZE)
        kout = rt.as_kernel_tensor(out) if fake else out.view(torch.uint8)
        grid, _, _, k_fast = rt.tile_grid(m, k, bm, bk, "mx")
        _mx_kernel[grid](
            rt.as_kernel_tensor(x2), kout, kout if scales is None else scales, m, k, x2.stride(0), kout.stride(0),
            0 if scales is None else scales.stride(0), seed,
            BLOCK_M=bm, BLOCK_K=bk, FMT=fid, FMAX=fmax, EMAX=emax, MBITS=mbits, BIAS=bias, EMIN_FIELD=emin_field,
            RCEIL=scale_recipe == "rceil", FAKE=fake, STOCHASTIC=bool(stochastic_rounding),
            N_ROUNDS=rt.philox_rounds(), HW_FP8=rt.hw_fp8(x.device), COMPILED=not rt.interpreting(), K_FAST=k_fast,
            VEC=rt.vector_elems(x2), num_warps=warps, **rt.LAUNCH_OPTIONS)
    if fake:
        return out.reshape(x.shape)
    return out.reshape(*lead, out.shape[-1]), scales.reshape(*lead, k // nx.MX_BLOCK_SIZE)


def mxfp4_forward(x: torch.Tensor, stochastic_rounding: bool = False, *,
                  scale_recipe: str = nx.DEFAULT_MX_SCALE_RECIPE, seed: int | None = None) -> torch.Tensor:
    """MXFP4 fake quantization over the last dim (a multiple of 32); same dtype out."""
    return _run(x, "e2m1", fake=True, scale_recipe=scale_recipe, stochastic_rounding=stochastic_rounding, seed=seed)


def mxfp8_forward(x: torch.Tensor, format: str = "e4m3", stochastic_rounding: bool = False, *,
                  scale_recipe: str = nx.DEFAULT_MX_SCALE_RECIPE, seed: int | None = None) -> torch.Tensor:
    """MXFP8 (``"e4m3"`` or ``"e5m2"``) fake quantization over the last dim; same dtype out."""
    check_choice("format", format, ("e4m3", "e5m2"))
    return _run(x, format, fake=True, scale_recipe=scale_recipe, stochastic_rounding=stochastic_rounding, seed=seed)


def mxfp4_quantize(x: torch.Tensor, *, scale_recipe: str = nx.DEFAULT_MX_SCALE_RECIPE,
                   stochastic_rounding: bool = False, seed: int | None = None):
    """MXFP4: ``(packed uint8 [..., K/2], E8M0 bytes [..., K/32])`` (twin of ``reference.mxfp4_quantize``)."""
    return _run(x, "e2m1", fake=False, scale_recipe=scale_recipe, stochastic_rounding=stochastic_rounding, seed=seed)


def mxfp8_quantize(x: torch.Tensor, format: str = "e4m3", *, scale_recipe: str = nx.DEFAULT_MX_SCALE_RECIPE,
                   stochastic_rounding: bool = False, seed: int | None = None):
    """MXFP8: ``(float8 [..., K], E8M0 bytes [..., K/32])`` (twin of ``reference.mxfp8_quantize``)."""
    check_choice("format", format, ("e4m3", "e5m2"))
    return _run(x, format, fake=False, scale_recipe=scale_recipe, stochastic_rounding=stochastic_rounding, seed=seed)


def fake_quant_mxfp4(x: torch.Tensor, stochastic_rounding: bool = False, *,
                     scale_recipe: str = nx.DEFAULT_MX_SCALE_RECIPE, seed: int | None = None) -> torch.Tensor:
    """:func:`mxfp4_forward` on CUDA tensors, :func:`nvfp4_plugin.reference.fake_quant_mxfp4` elsewhere."""
    if isinstance(x, torch.Tensor) and x.is_cuda:
        return mxfp4_forward(x, stochastic_rounding, scale_recipe=scale_recipe, seed=seed)
    return ref.fake_quant_mxfp4(x, stochastic_rounding, scale_recipe=scale_recipe, seed=seed)


def fake_quant_mxfp8(x: torch.Tensor, format: str = "e4m3", stochastic_rounding: bool = False, *,
                     scale_recipe: str = nx.DEFAULT_MX_SCALE_RECIPE, seed: int | None = None) -> torch.Tensor:
    """:func:`mxfp8_forward` on CUDA tensors, :func:`nvfp4_plugin.reference.fake_quant_mxfp8` elsewhere."""
    if isinstance(x, torch.Tensor) and x.is_cuda:
        return mxfp8_forward(x, format, stochastic_rounding, scale_recipe=scale_recipe, seed=seed)
    return ref.fake_quant_mxfp8(x, format, stochastic_rounding, scale_recipe=scale_recipe, seed=seed)
