"""The MoE steps around the two grouped GEMMs, one kernel each: routing, row gather, SiLU-and-mul, top-k combine.

Done with torch ops they were about 40 small kernels per layer (the fixed fp32 exp of the SiLU
alone is twenty elementwise passes, each with an fp32 temporary): on the H200 they took more GPU
time per decode step than the GEMMs themselves, and at prefill sizes their fp32 temporaries moved
gigabytes per layer. Numerics are those of :mod:`nvfp4_plugin.numerics` (``silu_and_mul_fp32``: the
same IEEE fp32 operations in the same order) and of :func:`nvfp4_plugin.reference.nvfp4_fused_moe`.

* :func:`moe_routing`: (token, slot) pairs sorted by expert, stable (the order of
  ``torch.argsort(stable=True)``), with the expert offsets; one program for up to
  :data:`ROUTE_KERNEL_MAX_ROWS` pairs (every decode step), a per-block counting sort beyond.
* :func:`gather_rows`: the routed rows copied into expert order (the Gluon GEMM loads x by TMA, which
  cannot gather on Hopper).
* :func:`silu_and_mul`: ``silu(gate) * up`` of the w13 output, rounded once.
* :func:`moe_combine`: ``sum_k w[t, k] * y[t, k]`` in fp32 in slot order, rounded once; a pair whose
  expert id is outside ``[0, E)`` contributes nothing (its row of ``y`` is never written).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import numerics as nx
from .._checks import check_shape, check_tensor
from ..triton import _runtime as rt
from ..triton.fast_launch import fast
from ..triton._jit_numerics import bits_f32, load_f32, store_f32

#: Routed pairs up to which one program sorts them (decode steps up to 32 tokens at top-8: one launch); beyond,
#: blocks of pairs each place their own (three launches: histograms, a scan per expert over the blocks,
#: placement). A program sorts its pairs' (expert, index) keys at once (``tl.sort``), so a pair's slot is its
#: expert's first slot for the block plus its rank in the sorted keys past the block's earlier experts: no
#: loop over the pairs. Blocks hold ROUTE_BLOCK_SMALL pairs up to ROUTE_BLOCK_SPLIT pairs and ROUTE_BLOCK
#: above (``benchmarks/bench_moe.py --glue-shapes``; moe_h200.md).
ROUTE_KERNEL_MAX_ROWS = 256
ROUTE_BLOCK_SMALL = 128
ROUTE_BLOCK_SPLIT = 32768
ROUTE_BLOCK = 512
#: smallest block a benchmark may ask for, and the blocks the scan reads per step
ROUTE_MIN_BLOCK = 64
ROUTE_SCAN_TILE = 256


def route_class(rows: int) -> int:
    """Which routing kernels ``rows`` routed pairs launch (0: one program; 1: small blocks; 2: large blocks):
    each class is compiled apart (the warm-up runs one count of each)."""
    return 0 if rows <= ROUTE_KERNEL_MAX_ROWS else (1 if rows <= ROUTE_BLOCK_SPLIT else 2)


@triton.jit
def _route_keys(ids_ptr, lo, R, E, lane):
    """Expert ids of pairs ``lo + lane`` (bin E for ids outside [0, E)), and which of them exist."""
    ok = lo + lane < R
    ids = tl.load(ids_ptr + lo + lane, mask=ok, other=0)      # (range test before narrowing int64 ids)
    return tl.where(ok & (ids >= 0) & (ids < E), ids, E).to(tl.int32), ok


@triton.jit
def _route_place(gather_ptr, scatter_ptr, pos_ptr, ids, ok, hist, cur, lo, R, TOP_K,
                 E_BINS: tl.constexpr, BLK: tl.constexpr, LOG_BLK: tl.constexpr):
    """Place pairs ``lo + lane`` (``ids``, ``ok``: :func:`_route_keys`; ``hist``: their expert histogram) from
    ``cur``, the first slot of each expert for them: the sorted keys ``id * BLK + lane`` put the pairs in
    (expert, index) order, a stable sort; sorted key s lands at ``cur[id] + s - (pairs of smaller ids)``."""
    lane = tl.arange(0, BLK)
    srt = tl.sort(tl.where(ok, ids, E_BINS - 1) * BLK + lane)          # missing pairs last
    sid = srt >> LOG_BLK
    pair = lo + (srt & (BLK - 1))
    pos = tl.gather(cur - (tl.cumsum(hist, 0) - hist), sid, 0) + lane
    m = pair < R
    tl.store(gather_ptr + pos, pair // TOP_K, mask=m)
    tl.store(scatter_ptr + pos, pair, mask=m)
    tl.store(pos_ptr + pair, pos, mask=m)


# Row and token counts change from call to call: not specialized on (see warm-up in nvfp4_plugin.layers).
@triton.jit(do_not_specialize=["R"])
def _route_kernel(ids_ptr, offsets_ptr, gather_ptr, scatter_ptr, pos_ptr, R, TOP_K, E,
                  E_BINS: tl.constexpr, BLK: tl.constexpr, LOG_BLK: tl.constexpr):
    """One program, ``R <= BLK``: expert histogram -> offsets, then every pair placed (:func:`_route_place`).
    Bin E collects ids outside [0, E): they land after every expert's rows (offsets[E] excludes them)."""
    bins = tl.arange(0, E_BINS)
    ids, ok = _route_keys(ids_ptr, 0, R, E, tl.arange(0, BLK))
    hist = tl.histogram(ids, E_BINS, mask=ok)
    starts = tl.cumsum(hist, 0) - hist
    tl.store(offsets_ptr + bins, starts, mask=bins <= E)
    _route_place(gather_ptr, scatter_ptr, pos_ptr, ids, ok, hist, starts, 0, R, TOP_K, E_BINS, BLK, LOG_BLK)


@triton.jit(do_not_specialize=["R"])
def _route_hist_kernel(ids_ptr, counts_ptr, R, E, E_BINS: tl.constexpr, BLK: tl.constexpr):
    """Program b: the expert histogram of pairs ``[b * BLK, (b + 1) * BLK)`` into ``counts[b]``."""
    b = tl.program_id(0)
    ids, ok = _route_keys(ids_ptr, b * BLK, R, E, tl.arange(0, BLK))
    tl.store(counts_ptr + b * E_BINS + tl.arange(0, E_BINS), tl.histogram(ids, E_BINS, mask=ok))


@triton.jit(do_not_specialize=["NB"])
def _route_scan_kernel(counts_ptr, NB, E_BINS: tl.constexpr, SB: tl.constexpr):
    """Program e: expert e's pairs in the blocks before each block (an exclusive scan down column e of the
    blocks' histograms, written over it), and its total into row NB."""
    e = tl.program_id(0)
    blk = tl.arange(0, SB)
    run = tl.full([], 0, tl.int32)
    for b0 in range(0, NB, SB):
        m = b0 + blk < NB
        p = counts_ptr + (b0 + blk) * E_BINS + e
        c = tl.load(p, mask=m, other=0)
        tl.store(p, run + tl.cumsum(c, 0) - c, mask=m)
        run += tl.sum(c, 0)
    tl.store(counts_ptr + NB * E_BINS + e, run)


@triton.jit(do_not_specialize=["R", "NB"])
def _route_block_place_kernel(ids_ptr, offsets_ptr, gather_ptr, scatter_ptr, pos_ptr, counts_ptr, R, NB, TOP_K, E,
                              E_BINS: tl.constexpr, BLK: tl.constexpr, LOG_BLK: tl.constexpr):
    """Program b places pairs ``[b * BLK, (b + 1) * BLK)``: the experts' offsets from the totals (row NB, program
    0 stores them), plus the same expert's pairs in earlier blocks (row b, scanned)."""
    b = tl.program_id(0)
    bins = tl.arange(0, E_BINS)
    total = tl.load(counts_ptr + NB * E_BINS + bins)
    starts = tl.cumsum(total, 0) - total
    tl.store(offsets_ptr + bins, starts, mask=(bins <= E) & (b == 0))
    ids, ok = _route_keys(ids_ptr, b * BLK, R, E, tl.arange(0, BLK))
    cur = starts + tl.load(counts_ptr + b * E_BINS + bins)
    _route_place(gather_ptr, scatter_ptr, pos_ptr, ids, ok, tl.histogram(ids, E_BINS, mask=ok), cur, b * BLK, R,
                 TOP_K, E_BINS, BLK, LOG_BLK)


def _routing_torch(flat: torch.Tensor, num_experts: int, top_k: int) -> dict[str, torch.Tensor]:
    """The definition (``torch.argsort(stable=True)`` of the expert ids, ids outside [0, E) last): the CPU path
    and the tests' reference."""
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, key, torch.ones_like(key))          # (bincount would read max() on the host)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    offsets[1:] = torch.cumsum(counts[:num_experts], 0).to(torch.int32)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=flat.device)
    return {"expert_offsets": offsets, "gather_idx": (order // top_k).to(torch.int32),
            "scatter_idx": order.to(torch.int32), "pair_pos": pos.to(torch.int32)}


def moe_routing(topk_ids: torch.Tensor, num_experts: int, *, block: int | None = None) -> dict[str, torch.Tensor]:
    """Sort routed (token, slot) pairs by expert on the device, stable, no host sync.

    Returns ``expert_offsets`` int32 ``[E+1]``, ``gather_idx`` int32 (token of each sorted pair),
    ``scatter_idx`` int32 (pair id ``token * top_k + slot`` of each sorted pair) and ``pair_pos`` int32
    (the sorted position of each pair: ``scatter_idx[pair_pos[p]] == p``). Pairs whose id is outside
    ``[0, E)`` come last, past ``expert_offsets[E]`` (the grouped GEMMs ignore those rows). Up to
    :data:`ROUTE_KERNEL_MAX_ROWS` pairs one kernel does it all; beyond, three (per-block histograms, a
    scan, per-block placement; :func:`route_class`) over blocks of ``block`` pairs (a power of two >=
    ROUTE_MIN_BLOCK; default by the class; for benchmarks).
    """
    check_tensor("topk_ids", topk_ids, dtypes=(torch.int32, torch.int64), ndim=2)
    if num_experts < 1:
        raise ValueError(f"num_experts: expected >= 1, got {num_experts}")
    if block is not None and (block < ROUTE_MIN_BLOCK or block & (block - 1)):
        raise ValueError(f"block: expected a power of two >= {ROUTE_MIN_BLOCK}, got {block}")
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    rows = flat.numel()
    dev = flat.device
    if rows == 0 or not (flat.is_cuda or rt.interpreting()):
        return _routing_torch(flat.to(torch.int64), num_experts, max(top_k, 1))
    if not flat.is_contiguous():
        flat = flat.contiguous()
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=dev)
    gather = torch.empty(rows, dtype=torch.int32, device=dev)
    scatter = torch.empty(rows, dtype=torch.int32, device=dev)
    pos = torch.empty(rows, dtype=torch.int32, device=dev)
    bins = triton.next_power_of_2(num_experts + 1)
    if rows <= ROUTE_KERNEL_MAX_ROWS and block is None:
        blk = ROUTE_KERNEL_MAX_ROWS
        fast(_route_kernel)[(1,)](flat, offsets, gather, scatter, pos, rows, top_k, num_experts, E_BINS=bins,
                                  BLK=blk, LOG_BLK=blk.bit_length() - 1, num_warps=4)
    else:
        blk = block or (ROUTE_BLOCK_SMALL if route_class(rows) == 1 else ROUTE_BLOCK)
        nb = triton.cdiv(rows, blk)
        warps = 4 if blk <= 1024 else 8
        counts = torch.empty((nb + 1, bins), dtype=torch.int32, device=dev)
        fast(_route_hist_kernel)[(nb,)](flat, counts, rows, num_experts, E_BINS=bins, BLK=blk, num_warps=warps)
        fast(_route_scan_kernel)[(bins,)](counts, nb, E_BINS=bins, SB=ROUTE_SCAN_TILE, num_warps=4)
        fast(_route_block_place_kernel)[(nb,)](flat, offsets, gather, scatter, pos, counts, rows, nb, top_k,
                                               num_experts, E_BINS=bins, BLK=blk, LOG_BLK=blk.bit_length() - 1,
                                               num_warps=warps)
    return {"expert_offsets": offsets, "gather_idx": gather, "scatter_idx": scatter, "pair_pos": pos}


# ------------------------------------------------------------------------------------------------
# row gather (the routed rows in expert order, for the Gluon GEMM's TMA loads)
# ------------------------------------------------------------------------------------------------

#: rows per program, columns per pass and warps of :func:`gather_rows` (``bench_moe --glue-shapes``: every
#: shape tried ran within 2% of the others at 2048 and 16384 tokens; moe_h200.md, "Row gather and SiLU-mul")
GATHER_BR = 8
GATHER_BH = 1024
GATHER_WARPS = 4


@triton.jit(do_not_specialize=["R"])
def _gather_rows_kernel(x_ptr, idx_ptr, out_ptr, R, H, stride_x, stride_o, BR: tl.constexpr, BH: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = rows < R
    src = tl.load(idx_ptr + rows, mask=ok, other=0).to(tl.int64)
    dst = rows.to(tl.int64)
    for h0 in range(0, H, BH):
        cols = h0 + tl.arange(0, BH)
        m = ok[:, None] & (cols < H)[None, :]
        # each token's row is read by its top-k pairs: keep x in L2, stream the copy out
        v = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=m, eviction_policy="evict_last")
        tl.store(out_ptr + dst[:, None] * stride_o + cols[None, :], v, mask=m, eviction_policy="evict_first")


#: element types the gather kernel copies (as 16-bit words for the 2-byte ones); others take index_select
_GATHER_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _copy_out(x: torch.Tensor, rows: int, out: torch.Tensor | None) -> torch.Tensor:
    """The row copies' output: ``out`` checked (``[rows, H]`` of x's dtype), or allocated."""
    if out is None:
        return torch.empty((rows, x.shape[1]), dtype=x.dtype, device=x.device)
    check_tensor("out", out, dtypes=(x.dtype,), device=x.device)
    check_shape("out", out, (rows, x.shape[1]))
    return out


def _copy_operands(x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(x, out)`` as the row-copy kernels take them (2-byte types as 16-bit words: the interpreter has no bf16),
    or None where torch copies instead (no GPU or interpreter, other dtypes, strided rows)."""
    if not (x.is_cuda or rt.interpreting()) or x.dtype not in _GATHER_DTYPES or x.stride(1) != 1 \
            or out.stride(1) != 1:
        return None
    return (x.view(torch.int16), out.view(torch.int16)) if x.element_size() == 2 else (x, out)


def gather_rows(x: torch.Tensor, idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[r] = x[idx[r]]`` for int32 ``idx [R]`` (a copy: bit-exact), the same as ``x.index_select(0, idx)``;
    on the GPU one kernel of 16-byte loads and stores. Values of ``idx`` must lie in ``[0, x.shape[0])``: they
    are not read on the host (no sync), and the kernel does not check them."""
    check_tensor("x", x, ndim=2)
    check_tensor("idx", idx, dtypes=(torch.int32,), ndim=1, device=x.device)
    r, h = idx.shape[0], x.shape[1]
    out = _copy_out(x, r, out)
    if r == 0 or h == 0:
        return out
    if x.shape[0] == 0:
        raise ValueError(f"x: no rows to gather from, but idx has {r} entries")
    ops = _copy_operands(x, out)
    if ops is None:
        return torch.index_select(x, 0, idx, out=out)
    idx = idx.contiguous()       # the kernel indexes it as a contiguous vector (a no-op when it is one)
    fast(_gather_rows_kernel)[(triton.cdiv(r, GATHER_BR),)](ops[0], idx, ops[1], r, h, x.stride(0), out.stride(0),
                                                          BR=GATHER_BR, BH=GATHER_BH, num_warps=GATHER_WARPS)
    return out


#: tokens per program, columns per pass and warps of :func:`spread_rows` (``bench_moe --glue-shapes``, Qwen3's top-8
#: rows of H=2048: 22.7 / 170.5 µs at 2048 / 16384 tokens against the gather's 24.1 / 233.6; moe_h200.md)
SPREAD_BT = 2
SPREAD_BH = 2048
SPREAD_WARPS = 4


@triton.jit(do_not_specialize=["T"])
def _spread_rows_kernel(x_ptr, pos_ptr, out_ptr, T, H, stride_x, stride_o, TOP_K: tl.constexpr, BT: tl.constexpr,
                        BH: tl.constexpr):
    toks = tl.program_id(0) * BT + tl.arange(0, BT)
    ok = toks < T
    src = toks.to(tl.int64)
    for h0 in range(0, H, BH):
        cols = h0 + tl.arange(0, BH)
        m = ok[:, None] & (cols < H)[None, :]
        v = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=m, eviction_policy="evict_first")
        for k in tl.static_range(TOP_K):
            dst = tl.load(pos_ptr + src * TOP_K + k, mask=ok, other=0).to(tl.int64)
            tl.store(out_ptr + dst[:, None] * stride_o + cols[None, :], v, mask=m, eviction_policy="evict_first")


def spread_rows(x: torch.Tensor, pair_pos: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[pair_pos[t * k + j]] = x[t]`` for ``x [T, H]`` and int32 ``pair_pos [T * k]`` (each token's row read
    once and written to its ``k`` routed rows): with ``pair_pos`` a permutation of ``[0, T * k)`` (routing's),
    the same rows as :func:`gather_rows` with the inverse index. Values are not checked on the device."""
    check_tensor("x", x, ndim=2)
    check_tensor("pair_pos", pair_pos, dtypes=(torch.int32,), ndim=1, device=x.device)
    t, h = x.shape
    r = pair_pos.shape[0]
    if (t == 0 and r) or (t and r % t):
        raise ValueError(f"pair_pos: expected a multiple of x's {t} rows (tokens x top_k), got {r}")
    top_k = r // t if t else 0
    out = _copy_out(x, r, out)
    if r == 0 or h == 0:
        return out
    ops = _copy_operands(x, out)
    if ops is None:
        return out.index_copy_(0, pair_pos.long(), x.repeat_interleave(top_k, 0))
    pair_pos = pair_pos.contiguous()
    fast(_spread_rows_kernel)[(triton.cdiv(t, SPREAD_BT),)](ops[0], pair_pos, ops[1], t, h, x.stride(0),
                                                           out.stride(0), TOP_K=top_k, BT=SPREAD_BT, BH=SPREAD_BH,
                                                           num_warps=SPREAD_WARPS)
    return out


# ------------------------------------------------------------------------------------------------
# SiLU-and-mul
# ------------------------------------------------------------------------------------------------

_EXP_LO = tl.constexpr(nx._f32(nx.SILU_EXP_LO))
_EXP_HI = tl.constexpr(nx.SILU_EXP_HI)
_LOG2E = tl.constexpr(nx.LOG2E_F32)
_LN2_HI = tl.constexpr(nx.LN2_HI_F32)
_LN2_LO = tl.constexpr(nx.LN2_LO_F32)
_C0, _C1, _C2, _C3, _C4, _C5, _C6 = (tl.constexpr(c) for c in nx.EXP_POLY_F32)
_ROUND_MAGIC = tl.constexpr(1.5 * 2.0**23)        # (v + M) - M rounds |v| < 2**22 half to even


@triton.jit
def _exp_fp32(y):
    """numerics.exp_fp32, op for op (launched without FMA contraction)."""
    yc = tl.minimum(tl.maximum(y, _EXP_LO), _EXP_HI)
    n = (yc * _LOG2E + _ROUND_MAGIC) - _ROUND_MAGIC
    r = (yc - n * _LN2_HI) - n * _LN2_LO
    p = r * _C6 + _C5
    p = p * r + _C4
    p = p * r + _C3
    p = p * r + _C2
    p = p * r + _C1
    p = p * r + _C0
    ni = tl.where(yc == yc, n, 0.0).to(tl.int32)     # (a NaN input keeps its NaN below)
    half = ni >> 1                                    # floor(ni / 2)
    out = (p * bits_f32(((ni - half + 127) << 23).to(tl.uint32))) * bits_f32(((half + 127) << 23).to(tl.uint32))
    out = tl.where(y > _EXP_HI, float("inf"), out)
    return tl.where(y != y, y, out)


@triton.jit(do_not_specialize=["R"])
def _silu_mul_kernel(x_ptr, out_ptr, R, I, stride_x, stride_o, BR: tl.constexpr, BI: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    mask = (rows < R)[:, None] & (cols < I)[None, :]
    base = x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :]
    g = load_f32(base, mask)
    u = load_f32(base + I, mask)
    s = tl.math.div_rn(g, 1.0 + _exp_fp32(-g))
    store_f32(out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :], s * u, mask)


@functools.lru_cache(maxsize=None)
def _compiled_kernels_run_on(device: torch.device) -> bool:
    from .. import _ext

    return _ext.extension_runs_on(device) is None


def _chunked(t: torch.Tensor) -> bool:
    """Contiguous rows of whole 16-byte chunks at a 16-byte aligned address (the compiled kernels' loads)."""
    return t.is_contiguous() and (t.shape[-1] * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` of ``x [R, 2I]`` (bf16/fp16), bit-equal to
    :func:`nvfp4_plugin.numerics.silu_and_mul_fp32`. Where the compiled extension runs, its kernel (bf16: the
    SiLU of every bf16 gate from a lookup table once the call is large enough; 164 against the Triton kernel's
    184 µs at 16384 Qwen3 tokens, moe_h200.md); else one Triton kernel."""
    check_tensor("x", x, dtypes=(torch.bfloat16, torch.float16), ndim=2)
    r, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"x: expected an even last dim (gate and up halves), got {two_i}")
    i = two_i // 2
    if out is None:
        out = torch.empty((r, i), dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, dtypes=(x.dtype,), device=x.device)
        check_shape("out", out, (r, i))
    if r == 0 or i == 0:
        return out
    if not (x.is_cuda or rt.interpreting()):
        return out.copy_(nx.silu_and_mul_fp32(x))
    if x.is_cuda and i % 16 == 0 and _chunked(x) and _chunked(out) and _compiled_kernels_run_on(x.device):
        from .._cuda_ops import silu_and_mul_into

        return silu_and_mul_into(x, out)
    if x.stride(1) != 1:
        x = x.contiguous()
    bi = min(triton.next_power_of_2(i), 256)
    # 8 rows of 256 at the MoE's I: 6% faster than 16 rows at 16384 tokens (moe_h200.md, "Row gather and SiLU-mul")
    br = max(1, 2048 // bi)
    grid = (triton.cdiv(r, br), triton.cdiv(i, bi))
    fast(_silu_mul_kernel)[grid](rt.as_kernel_tensor(x), rt.as_kernel_tensor(out), r, i, x.stride(0), out.stride(0),
                           BR=br, BI=bi, num_warps=4, **rt.LAUNCH_OPTIONS)
    return out


# ------------------------------------------------------------------------------------------------
# top-k combine
# ------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["T"])
def _combine_kernel(y_ptr, w_ptr, ids_ptr, out_ptr, T, H, E, stride_wt, stride_wk, stride_it, stride_ik, stride_o,
                    TOP_K: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    toks = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    t_ok = toks < T
    mask = t_ok[:, None] & (cols < H)[None, :]
    acc = tl.zeros([BT, BH], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + toks * stride_it + k * stride_ik, mask=t_ok, other=-1)
        w = tl.load(w_ptr + toks * stride_wt + k * stride_wk, mask=t_ok, other=0.0).to(tl.float32)
        m = mask & ((e >= 0) & (e < E))[:, None]
        y = load_f32(y_ptr + (toks.to(tl.int64) * TOP_K + k)[:, None] * H + cols[None, :], m)
        acc = acc + tl.where(m, y * w[:, None], 0.0)
    store_f32(out_ptr + toks.to(tl.int64)[:, None] * stride_o + cols[None, :], acc, mask)


def moe_combine(y: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_k topk_weights[t, k] * y[t * top_k + k]`` in fp32 (slot order), rounded once to
    ``y.dtype``; pairs with an expert id outside ``[0, num_experts)`` are skipped (``y`` may hold
    anything there)."""
    check_tensor("y", y, dtypes=(torch.bfloat16, torch.float16), ndim=2)
    t, top_k = topk_ids.shape
    h = y.shape[1]
    check_shape("y", y, (t * top_k, h))
    check_shape("topk_weights", topk_weights, (t, top_k))
    if out is None:
        out = torch.empty((t, h), dtype=y.dtype, device=y.device)
    if t == 0 or h == 0:
        return out
    if not (y.is_cuda or rt.interpreting()):
        valid = ((topk_ids >= 0) & (topk_ids < num_experts))[..., None]
        yk = torch.where(valid, y.view(t, top_k, h).float() * topk_weights.float()[..., None], 0.0)
        acc = torch.zeros((t, h), dtype=torch.float32, device=y.device)
        for k in range(top_k):
            acc = acc + yk[:, k]
        return out.copy_(acc)
    y = y.contiguous()
    bh = min(triton.next_power_of_2(h), 512)
    bt = max(1, 2048 // bh)
    grid = (triton.cdiv(t, bt), triton.cdiv(h, bh))
    fast(_combine_kernel)[grid](rt.as_kernel_tensor(y), topk_weights, topk_ids, rt.as_kernel_tensor(out), t, h,
                                num_experts, *topk_weights.stride(), *topk_ids.stride(), out.stride(0), TOP_K=top_k,
                                BT=bt, BH=bh, num_warps=4, **rt.LAUNCH_OPTIONS)
    return out
