"""The ``mse`` block-scale search of :mod:`nvfp4_plugin.checkpoints.scale_search` as one Triton kernel.

The torch version materializes every candidate's quantized block (33 candidates x 16 values x ~20
elementwise ops per weight): memory-bound, hours for an 8B model on a GPU. Here each program keeps
its blocks in registers and walks the candidates, so the search costs a few hundred fp32 operations
per weight. Same bytes as the torch version: the same fp32 operation sequence per element (the
numerics helpers of :mod:`._jit_numerics`), each block's squared errors summed in fp64 (exact
enough that the order of the 16 terms does not matter), the first minimum in the candidate order
0, -1, +1, ..., -16, +16 steps from the round-to-nearest scale. ``checkpoints.quantize`` runs it on
CUDA tensors and compares it with the torch version on the first tensor of a run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checkpoints.scale_search import WINDOW
from . import _runtime as rt
from ._jit_numerics import e2m1_code, e2m1_magnitude, f32_bits, bits_f32, inverse_or_zero, nvfp4_block_scales

BLOCKS_PER_PROGRAM = 64


@triton.jit
def _e4m3_value(byte):
    """fp32 value of a positive finite E4M3 byte (uint32 in 1..0x7E)."""
    e = byte >> 3
    m = byte & 7
    normal = bits_f32(((e + 120) << 23) | (m << 20))
    sub = m.to(tl.float32) * 0.001953125          # m * 2**-9
    return tl.where(e > 0, normal, sub)


@triton.jit
def _e2m1_value(code):
    """fp32 magnitude of an E2M1 magnitude code (uint32 0..7): 0, .5, 1, 1.5, 2, 3, 4, 6."""
    e = code >> 1
    frac = (code & 1).to(tl.float32) * 0.5
    return tl.where(e == 0, frac, bits_f32((e + 126) << 23) * (1.0 + frac))


@triton.jit
def _mse_scale_kernel(x_ptr, w_ptr, out_ptr, gs_ptr, n_blocks, nb_row, HAS_W: tl.constexpr,
                      WINDOW: tl.constexpr, BLOCKS: tl.constexpr, COMPILED: tl.constexpr, HW_FP8: tl.constexpr):
    pid = tl.program_id(0)
    b = pid.to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    ok = b < n_blocks
    j = tl.arange(0, 16)
    x = tl.load(x_ptr + b[:, None] * 16 + j[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    gs = tl.load(gs_ptr)
    inv_gs = inverse_or_zero(gs)
    vmax = tl.max(tl.abs(x), axis=1)
    byte0, s0, _ = nvfp4_block_scales(vmax, gs, inv_gs, False, HW_FP8)
    idx0 = tl.maximum(byte0.to(tl.int32) - 1, 0)
    if HAS_W:
        wv = tl.load(w_ptr + (b % nb_row)[:, None] * 16 + j[None, :], mask=ok[:, None], other=0.0)
    best_err = tl.full([BLOCKS], float("inf"), tl.float64)
    best = byte0.to(tl.int32)
    for t in tl.static_range(2 * WINDOW + 1):
        # candidate offsets 0, -1, +1, -2, +2, ...: one plain expression of the unrolled t (Triton's code generator
        # rejects a tl.constexpr assigned twice, which the unrolled loop does; the interpreter does not)
        d = ((t + 1) // 2) * (1 - 2 * (t % 2))
        idx = tl.minimum(tl.maximum(idx0 + d, 0), 125)
        byte = idx + 1
        s = _e4m3_value(byte.to(tl.uint32))
        out_scale = tl.math.div_rn(1.0, s * inv_gs)
        v = x * out_scale[:, None]
        a, sbit = e2m1_magnitude(v, COMPILED)
        mag = _e2m1_value(e2m1_code(a))
        val = bits_f32(f32_bits(mag) | sbit)
        deq = (val * s[:, None]) * inv_gs
        e = deq - x
        e = e * e
        if HAS_W:
            e = e * wv
        err = tl.sum(e.to(tl.float64), axis=1)
        better = err < best_err
        best_err = tl.where(better, err, best_err)
        best = tl.where(better, byte, best)
    res = tl.where(s0 == 0, byte0.to(tl.int32), best)
    tl.store(out_ptr + b, res.to(tl.uint8), mask=ok)


def search_block_scales(x: torch.Tensor, global_scale: torch.Tensor, *, col_weight: torch.Tensor | None = None,
                        window: int = WINDOW) -> torch.Tensor:
    """float8_e4m3fn block scales ``[..., K/16]`` of :func:`nvfp4_plugin.checkpoints.scale_search.search_block_scales`."""
    rt.check_device("x", x)
    *lead, k = x.shape
    if k % 16:
        raise ValueError(f"x: last dim must be a multiple of 16, got {k}")
    nb = k // 16
    x2 = x.contiguous()
    if x2.dtype != torch.float32:
        x2 = x2.float()
    n_blocks = x2.numel() // 16
    out = torch.empty(n_blocks, dtype=torch.uint8, device=x.device)
    gs = global_scale.float().reshape(1).to(x.device)
    w = col_weight.float().contiguous().to(x.device) if col_weight is not None else gs
    if col_weight is not None and col_weight.numel() != k:
        raise ValueError(f"col_weight: expected {k} values (one per input column), got {col_weight.numel()}")
    if n_blocks:
        grid = (triton.cdiv(n_blocks, BLOCKS_PER_PROGRAM),)
        _mse_scale_kernel[grid](x2, w, out, gs, n_blocks, nb, HAS_W=col_weight is not None, WINDOW=window,
                                BLOCKS=BLOCKS_PER_PROGRAM, COMPILED=not rt.interpreting(), HW_FP8=rt.hw_fp8(x.device),
                                num_warps=4, **rt.LAUNCH_OPTIONS)
    return out.view(torch.float8_e4m3fn).reshape(*lead, nb)
