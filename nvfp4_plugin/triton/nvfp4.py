"""NVFP4 in Triton: ``scaled_fp4_quant`` (packed + e4m3/ue8m0 scales, linear or swizzled 128x4) and
``nvfp4_forward`` / ``fake_quant_nvfp4`` (quantize + dequantize, optionally stochastic).

One kernel, specialised by constexprs, covers both. Each program quantizes ``BLOCK_M`` rows x
``BLOCK_K`` columns as a block tile (``_jit_numerics.block_cols``: each thread holds whole 16-blocks):
load (16-byte vectors), per-block amax in the thread, block scale (E4M3 rounding by
``cvt.rn.satfinite`` on sm_89+, in software elsewhere; IEEE divisions), then E2M1 codes packed 8 per
32-bit word by the inline-PTX encoder (``_jit_numerics.e2m1_words``) + scale bytes, or the
dequantized values. For the swizzled layout the grid also covers the padding rows (up to a multiple
of 128) and scale columns (up to a multiple of 4) and writes their zeros, so the output needs no
separate memset and is fully defined (one launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import numerics as nx
from .. import reference as ref
from .._checks import check_choice, check_global_scale
from . import _jit_numerics as jn
from . import _runtime as rt


@triton.jit(do_not_specialize=["seed"])
def _nvfp4_kernel(x_ptr, out_ptr, scale_ptr, gs_ptr, M, K, stride_xm, stride_om, stride_sm, m_cover, kb_cover,
                  k_tiles, seed, K_FAST: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, FAKE: tl.constexpr, SWIZZLE: tl.constexpr,
                  UE8M0: tl.constexpr, STOCHASTIC: tl.constexpr, N_ROUNDS: tl.constexpr, HW_FP8: tl.constexpr,
                  COMPILED: tl.constexpr, VEC: tl.constexpr):
    NB: tl.constexpr = BLOCK_K // 16
    pid_m, pid_k = jn.tile_ids(K_FAST)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    cols = jn.block_cols(pid_k * BLOCK_K, NB, 2, VEC)
    x = jn.load_block_tile(x_ptr, rows64, row_ok, cols, K, stride_xm, 1, 2)  # [NB, BM, 2, 8]: block, row, half, element
    gs = tl.load(gs_ptr)
    inv_gs = jn.inverse_or_zero(gs)

    vmax = jn.block_amax(x, COMPILED)  # [NB, BM]; a NaN never raises a scale
    byte, s, out_scale = jn.nvfp4_block_scales(vmax, gs, inv_gs, UE8M0, HW_FP8)
    v = x * out_scale[:, :, None, None]  # NaN (from x, or Inf * 0) encodes as +0, as in the reference
    if STOCHASTIC:
        u = jn.uniform_blocks(seed, rows64, pid_k * BLOCK_K, K, NB, 2, N_ROUNDS, COMPILED)
    else:
        u = 0.0

    if FAKE:
        a, sbit = jn.e2m1_magnitude(v, COMPILED)
        if STOCHASTIC:
            r = jn.grid_round_stochastic(a, u, 1, 127, COMPILED)
        else:
            r = jn.grid_round(a, 1, 127)
        jn.store_block_tile(out_ptr, jn.nvfp4_dequant(r, sbit, s, gs), rows64, row_ok, pid_k * BLOCK_K, K, stride_om, 2)
    else:
        jn.store_words(out_ptr, jn.e2m1_words(v, u, STOCHASTIC, COMPILED), rows64, row_ok, pid_k * (BLOCK_K // 8), K,
                       stride_om, 1, 2, True)

        kb = pid_k * NB + tl.arange(0, NB)[:, None]  # [NB, 1]
        valid = row_ok[None, :] & (kb < K // 16)
        if SWIZZLE:  # the grid covers the padding rows and columns: write their zeros
            m = rows64[None, :]
            soff = (((m // 128) * k_tiles + kb // 4) * 512 + (m % 32) * 16 + ((m // 32) % 4) * 4 + kb % 4)
            smask = (rows < m_cover)[None, :] & (kb < kb_cover)
            tl.store(scale_ptr + soff, tl.where(valid, byte, 0).to(tl.uint8), mask=smask)
        else:
            tl.store(scale_ptr + rows64[None, :] * stride_sm + kb, byte.to(tl.uint8), mask=valid)


@triton.jit
def _finite_amax_kernel(x_ptr, amax_ptr, M, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """``max |x|`` over finite elements, into an int32 word (fp32 bits order like the values: all >= 0)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = jn.load_f32(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask)
    a = tl.abs(x)
    a = tl.where(a < jn.INF, a, 0.0)  # NaN and Inf do not count
    tl.atomic_max(amax_ptr, tl.max(a).to(tl.int32, bitcast=True))


def _launch(x2: torch.Tensor, out: torch.Tensor, scales: torch.Tensor | None, gs_buf: torch.Tensor, *,
            fake: bool, swizzle: bool = False, ue8m0: bool = False, stochastic: bool = False, seed: int = 0,
            m_cover: int | None = None, kb_cover: int | None = None) -> None:
    """One launch over ``x2[M, K]``; with ``swizzle`` the grid covers ``m_cover`` rows and ``kb_cover``
    scale columns (the padded scale shape) so that the padding is written too."""
    assert fake or not stochastic, "stochastic rounding is offered for fake quantization only"
    m, k = x2.shape
    bm, bk, warps = rt.tile("nvfp4", k, nx.NVFP4_BLOCK_SIZE)
    m_cover = m if m_cover is None else m_cover
    kb_cover = k // 16 if kb_cover is None else kb_cover
    grid, _, _, k_fast = rt.tile_grid(m_cover, max(k, kb_cover * 16), bm, bk, "nvfp4")
    _nvfp4_kernel[grid](
        rt.as_kernel_tensor(x2), out, out if scales is None else scales, gs_buf,
        m, k, x2.stride(0), out.stride(0), 0 if scales is None or swizzle else scales.stride(0), m_cover, kb_cover,
        triton.cdiv(kb_cover, 4), seed, K_FAST=k_fast,
        BLOCK_M=bm, BLOCK_K=bk, FAKE=fake, SWIZZLE=swizzle, UE8M0=ue8m0, STOCHASTIC=stochastic,
        N_ROUNDS=rt.philox_rounds(), HW_FP8=rt.hw_fp8(x2.device), COMPILED=not rt.interpreting(),
        VEC=rt.vector_elems(x2), num_warps=warps,
        **rt.LAUNCH_OPTIONS)


def _dynamic_global_scale(x2: torch.Tensor) -> torch.Tensor:
    """``numerics.global_scale_from_amax`` of the largest finite |x|, fp32 [1] on the device (no sync).

    One Triton pass for the amax; the scale itself comes from the numerics helper, so the dynamic
    global scale has exactly one definition in the project.
    """
    amax = torch.zeros(1, dtype=torch.int32, device=x2.device)
    m, k = x2.shape
    bm, bk, warps = rt.tile("amax", k, nx.NVFP4_BLOCK_SIZE)
    bm *= 2
    _finite_amax_kernel[rt.grid2(m, k, bm, bk)](rt.as_kernel_tensor(x2), amax, m, k, x2.stride(0), BLOCK_M=bm,
                                                 BLOCK_K=bk, num_warps=warps, **rt.LAUNCH_OPTIONS)
    return nx.global_scale_from_amax(amax.view(torch.float32)).contiguous()


def scaled_fp4_quant(input: torch.Tensor, input_global_scale: torch.Tensor, *, swizzle: bool = True,
                     scale_format: str = "e4m3"):
    """Triton twin of :func:`nvfp4_plugin.reference.scaled_fp4_quant` (same bytes, padding zeroed)."""
    ref._check_act("input", input)
    check_choice("scale_format", scale_format, nx.NVFP4_SCALE_FORMATS)
    rt.check_device("input", input)
    gs = check_global_scale("input_global_scale", input_global_scale, input.device).reshape(1)
    m, k = input.shape
    kb = k // nx.NVFP4_BLOCK_SIZE
    packed = torch.empty((m, k // 2), dtype=torch.uint8, device=input.device)
    mp, kp = nx.swizzled_scale_shape(m, kb) if swizzle else (m, kb)
    sdtype = torch.float8_e4m3fn if scale_format == "e4m3" else torch.uint8
    scales = torch.empty((mp, kp), dtype=sdtype, device=input.device)
    if mp == 0 or kp == 0:
        return packed, scales
    _launch(rt.rows_view(input), packed, scales.view(torch.uint8), gs.contiguous(), fake=False,
            swizzle=swizzle, ue8m0=scale_format == "ue8m0", m_cover=mp, kb_cover=kp)
    return packed, scales


def nvfp4_forward(x: torch.Tensor, global_scale: torch.Tensor | None = None, stochastic_rounding: bool = False, *,
                  seed: int | None = None) -> torch.Tensor:
    """NVFP4 fake quantization over the last dim (Triton twin of ``reference.fake_quant_nvfp4``).

    ``global_scale`` (encode scale, fp32) defaults to the tensor's dynamic scale
    :func:`numerics.tensor_global_scale`, computed on the device after a first pass (no host sync).
    With ``stochastic_rounding`` each value goes to one of its two E2M1 neighbours, unbiased,
    reproducibly for a given ``seed``.
    """
    ref._check_act("x", x, ndim=None)
    rt.check_device("x", x)
    if global_scale is not None:
        gs_buf = check_global_scale("global_scale", global_scale, x.device).reshape(1).contiguous()
    seed = rt.resolve_seed(seed) if stochastic_rounding else 0
    x2 = rt.rows_view(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.numel() == 0:
        return out.reshape(x.shape)
    if global_scale is None:
        gs_buf = _dynamic_global_scale(x2)
    _launch(x2, rt.as_kernel_tensor(out), None, gs_buf, fake=True, stochastic=bool(stochastic_rounding), seed=seed)
    return out.reshape(x.shape)


def fake_quant_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | None = None, stochastic_rounding: bool = False,
                     *, seed: int | None = None) -> torch.Tensor:
    """:func:`nvfp4_forward` on CUDA tensors, :func:`nvfp4_plugin.reference.fake_quant_nvfp4` elsewhere."""
    if isinstance(x, torch.Tensor) and x.is_cuda:
        return nvfp4_forward(x, global_scale, stochastic_rounding, seed=seed)
    return ref.fake_quant_nvfp4(x, global_scale, stochastic_rounding, seed=seed)
