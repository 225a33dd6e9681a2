"""Block scales chosen by error instead of by maximum (``nvfp4-plugin quantize --method mse``).

Round to nearest (ModelOpt's default, vLLM's reference, :func:`nvfp4_plugin.reference.scaled_fp4_quant`)
stores each 16-value block's scale as ``e4m3(gs * amax / 6)``: the largest value lands on E2M1's 6 and
nothing clips. A smaller scale clips the largest value but gives the others a finer grid; a larger
one does the opposite. Per block we try every E4M3 scale within two octaves of the round-to-nearest
one (33 candidates) and keep the one with the least squared error of the dequantized block
(optionally weighted per input column, e.g. by the calibration activations' second moments), ties
going to the candidate nearest the round-to-nearest scale, then to the smaller. The format is
unchanged: any NVFP4 loader reads the result, at no runtime cost.

Why two octaves suffice: at the round-to-nearest scale no element errs by more than
``amax / 6`` (half of E2M1's widest step, 2, in units of ``amax / 6``), so the block's squared error
is at most ``16 (amax / 6)^2 = 0.44 amax^2``; a scale under a quarter of it clips the largest
element by more than ``0.75 amax``, already ``0.56 amax^2``. Above four times it every element
falls in E2M1's first steps ``{0, 0.5, 1, 1.5}`` of a grid four times coarser, which the
brute-force test over all 126 E4M3 scales (tests/test_scale_search.py) never found better.

The element codes for a chosen scale are computed exactly as the standard recipe computes them for
its own scale (:func:`nvfp4_plugin.numerics.nvfp4_block_scales`' ``out_scale``, then E2M1 round to
nearest even), so ``mse`` changes only which scale is stored.
"""

from __future__ import annotations

import functools

import torch

from .. import numerics as nx

#: Candidates each side of the round-to-nearest scale (E4M3 has 8 normal values per octave).
WINDOW = 16


@functools.lru_cache(maxsize=None)
def _e4m3_positive() -> torch.Tensor:
    """Every positive finite E4M3 value, ascending (126 values: codes 0x01..0x7E)."""
    return torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _order(window: int) -> torch.Tensor:
    """Candidate offsets in tie-break order: 0, -1, +1, -2, +2, ..."""
    offs = [0]
    for d in range(1, window + 1):
        offs += [-d, d]
    return torch.tensor(offs, dtype=torch.long)


def _inverse_or_zero(gs: torch.Tensor) -> torch.Tensor:
    return torch.where(gs == 0, torch.zeros_like(gs), 1.0 / gs)


def _encode(blocks: torch.Tensor, s: torch.Tensor, inv_gs: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of ``blocks [..., 16]`` under stored scale values ``s [...]``: the recipe's own
    ``out_scale`` (:func:`nvfp4_plugin.numerics.nvfp4_block_scales`), clamp, round to nearest even."""
    denom = s * inv_gs
    out_scale = torch.where(s == 0, torch.zeros_like(denom), 1.0 / denom)
    return nx.e2m1_encode((blocks * out_scale[..., None]).clamp(-nx.E2M1_MAX, nx.E2M1_MAX))


def _block_error(blocks: torch.Tensor, s: torch.Tensor, inv_gs: torch.Tensor, col_w) -> torch.Tensor:
    """Squared error of each block quantized with stored scale values ``s`` (broadcast over candidates)."""
    deq = nx.e2m1_decode(_encode(blocks, s, inv_gs)) * s[..., None] * inv_gs[..., None]
    err = deq - blocks
    err = err * err
    if col_w is not None:
        err = err * col_w
    # fp64 sum: exact enough that the order of the 16 terms never matters (the Triton twin sums in
    # another order and must pick the same scale)
    return err.double().sum(-1)


def search_block_scales(x: torch.Tensor, global_scale: torch.Tensor, *, col_weight: torch.Tensor | None = None,
                        window: int = WINDOW, candidates: torch.Tensor | None = None,
                        chunk_blocks: int = 1 << 16) -> torch.Tensor:
    """Stored E4M3 block scales ``[..., K/16]`` minimizing each block's (weighted) squared error.

    ``x``: ``[..., K]`` weights (K a multiple of 16); ``global_scale``: the encode global scale (one value);
    ``col_weight``: optional ``[K]`` non-negative weight per input column. ``candidates``: test hook,
    search these stored-scale values (ascending) instead of the window around round to nearest.
    """
    *lead, k = x.shape
    nb = k // nx.NVFP4_BLOCK_SIZE
    blocks = x.reshape(-1, nb, nx.NVFP4_BLOCK_SIZE).float()
    gs = global_scale.float().reshape(())
    inv_gs = _inverse_or_zero(gs)
    table = _e4m3_positive().to(x.device)
    cw = None if col_weight is None else col_weight.float().to(x.device).reshape(nb, nx.NVFP4_BLOCK_SIZE)
    rows = blocks.shape[0]
    out = torch.empty((rows, nb), dtype=torch.float8_e4m3fn, device=x.device)
    step = max(1, chunk_blocks // max(nb, 1))
    order = _order(window).to(x.device)
    for r0 in range(0, rows, step):
        b = blocks[r0:r0 + step]
        vmax = nx.nan_ignoring_amax(b, dim=-1)
        rtn, s0, _ = nx.nvfp4_block_scales(vmax, gs)
        if candidates is None:
            # index of the round-to-nearest scale in the table (0 for a zero scale: kept as is below)
            idx0 = torch.searchsorted(table, s0.clamp(min=table[0]))
            idx = (idx0[..., None] + order).clamp(0, table.numel() - 1)
            cand = table[idx]                                              # [r, nb, C]
        else:
            c = candidates.float().to(x.device)
            dist = (torch.searchsorted(c, s0.clamp(min=c[0]))[..., None] - torch.arange(c.numel(), device=x.device))
            # the same tie-break as the window: nearest to round to nearest, then the smaller
            key = dist.abs() * 2 + (dist > 0).long()
            cand = c[key.argsort(dim=-1, stable=True)]
        err = _block_error(b[:, :, None, :], cand, inv_gs, None if cw is None else cw[None, :, None, :])
        best = cand.gather(-1, err.argmin(dim=-1, keepdim=True)).squeeze(-1)
        out[r0:r0 + step] = torch.where(s0 == 0, rtn.float(), best).to(torch.float8_e4m3fn)
    return out.reshape(*lead, nb)


def quantize_with_scales(x: torch.Tensor, global_scale: torch.Tensor, stored: torch.Tensor):
    """``(packed uint8 [..., K/2], stored)``: ``x`` encoded under the given stored block scales, exactly
    as the round-to-nearest recipe encodes under its own."""
    *lead, k = x.shape
    blocks = x.reshape(*lead, k // nx.NVFP4_BLOCK_SIZE, nx.NVFP4_BLOCK_SIZE).float()
    codes = _encode(blocks, stored.float(), _inverse_or_zero(global_scale.float().reshape(())))
    return nx.pack_fp4(codes.reshape(*lead, k)), stored


def quantize_mse(x: torch.Tensor, global_scale: torch.Tensor, *, col_weight: torch.Tensor | None = None):
    """NVFP4 with searched block scales: ``(packed uint8 [..., K/2], float8_e4m3fn scales [..., K/16])``."""
    return quantize_with_scales(x, global_scale, search_block_scales(x, global_scale, col_weight=col_weight))
