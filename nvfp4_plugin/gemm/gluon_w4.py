"""Gluon (Triton's explicit-layout dialect) kernel: dense FP4-weight GEMM for 128-1024 rows on Hopper.

Same numerics and weight layout as :mod:`.triton_w4` (swap AB: ``acc[n, m] = W_tile @ x_tile^T``, the
decoded weight is wgmma's register A operand), but the pipeline is written out instead of left to
Triton's pipeliner, which on Triton 3.6 either races on the register operand or (with the
workaround in ``triton_w4._mma_tile``) retires every K step's wgmma before the next decode:

* x tiles arrive by TMA into a ring of ``STAGES`` shared-memory buffers (one mbarrier each);
* the weight words and scale pairs are loaded ``PF`` (2 or 4, ``GluonConfig.prefetch``) K steps ahead into
  registers;
* step k's wgmma is issued asynchronously and waited for (``warpgroup_mma_wait(1)``) right after step
  k+1's is issued, so step k+1's decode overlaps it; then the x buffer it read is refilled;
* the K loop is unrolled by PF (plus up to PF-1 peeled last steps): consecutive steps decode into different
  registers, so no instruction writes the A operand of the wgmma still in flight. (The ``deps`` of
  ``warpgroup_mma_wait`` do not ensure this for register operands: ptxas does not see them.)
  tests/test_gemm_sass.py checks the SASS for such writes.

Split K (narrow N with long K has few output tiles; or, with ``GluonConfig.split_tail``, only the tiles past
the last whole wave) writes fp32 partials that :func:`w4_splitk_reduce_kernel` adds in split order
(deterministic), or with ``GluonConfig.fixup`` the last program of each tile to arrive (the same order, no
second launch).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..triton.fast_launch import fast
from . import triton_w4 as tk
from .triton_w4 import _PTX2_BF16, _PTX2_FP16

#: the CTA-wide barrier: ``thread_barrier`` in Triton 3.6, ``barrier`` in 3.8 (the B200 image's Triton)
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _g_weight_tile(q, sp, BN: gl.constexpr, BK: gl.constexpr, DT: gl.constexpr):
    """Words ``[BK/64, BN/2, 16]`` + scale pairs -> decoded ``[BN, BK]`` (the wgmma A fragment order)."""
    KA: gl.constexpr = BK // 64
    if DT == 0:
        o0, o1, o2, o3 = gl.inline_asm_elementwise(_PTX2_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [q, sp],
                                                   dtype=(gl.uint32, gl.uint32, gl.uint32, gl.uint32),
                                                   is_pure=True, pack=2)
    else:
        o0, o1, o2, o3 = gl.inline_asm_elementwise(_PTX2_FP16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [q, sp],
                                                   dtype=(gl.uint32, gl.uint32, gl.uint32, gl.uint32),
                                                   is_pure=True, pack=2)
    # (the Triton kernel's helper: Gluon compiles it, with the layouts its inputs carry)
    t = gl.join(gl.join(tk._halves(o0, DT), tk._halves(o1, DT)), gl.join(tk._halves(o2, DT), tk._halves(o3, DT)))
    t = gl.reshape(t, [KA, BN // 16, 8, 4, 4, 2, 2, 2])          # ka, w, g, c, j, e, h, kh
    t = gl.permute(t, [1, 6, 2, 0, 4, 7, 3, 5])                  # w, h, g | ka, j, kh, c, e
    return gl.reshape(t, [BN, BK])


@gluon.jit
def _g_step(kk, it0, num_k, acc, q, sp, q_tile, s_tile, x_desc, x_smem, bars, off_m, k0, a_layout: gl.constexpr,
            BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, DT: gl.constexpr, PF: gl.constexpr,
            num_warps: gl.constexpr):
    """One K step (``kk`` of this tile; ``it0 + kk`` counts the steps of the program, for the x ring's
    buffer and phase): load step kk+PF's words, decode step kk's, issue its wgmma, retire step kk-1's
    wgmma, refill the x buffer that step kk-1 read with step kk+STAGES-1."""
    nk = kk + PF
    more = nk < num_k
    q_n = gl.load(q_tile + nk * (BK // 4), mask=more, other=0)
    s_n = gl.load(s_tile + nk * (BK // 16), mask=more, other=0)
    w = _g_weight_tile(q.to(gl.uint32, bitcast=True), sp.to(gl.uint16, bitcast=True), BN, BK, DT)
    a = gl.convert_layout(w, a_layout, assert_trivial=True)
    g = it0 + kk
    st = g % STAGES
    mbarrier.wait(bars.index(st), (g // STAGES) & 1)
    acc = warpgroup_mma(a, x_smem.index(st).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(1, deps=(acc, ))
    if num_warps > 4:
        _cta_barrier()      # the other warpgroup's wgmma of step kk-1 is done too
    nl = kk + STAGES - 1
    ls = (it0 + nl) % STAGES
    ok = nl < num_k
    mbarrier.expect(bars.index(ls), x_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(x_desc, [off_m, k0 + nl * BK], bars.index(ls), x_smem.index(ls), pred=ok)
    return acc, q_n, s_n


@gluon.jit
def _g_tile(it0, num_k, q_tile, s_tile, x_desc, x_smem, bars, off_m, k0, mma: gl.constexpr, a_layout: gl.constexpr,
            BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, DT: gl.constexpr,
            PF: gl.constexpr, num_warps: gl.constexpr):
    """``acc[BN, BM]`` of one output tile over ``num_k`` K steps (x rows from ``off_m``, K from ``k0``).
    Every buffer of the x ring is free on entry (the previous tile ended with all wgmmas retired)."""
    for i in gl.static_range(STAGES - 1):
        ok = i < num_k
        st = (it0 + i) % STAGES
        mbarrier.expect(bars.index(st), x_desc.block_type.nbytes, pred=ok)
        tma.async_copy_global_to_shared(x_desc, [off_m, k0 + i * BK], bars.index(st), x_smem.index(st), pred=ok)
    # Words and scale pairs are loaded PF (2 or 4) K steps ahead into registers: q0/s0 serve steps 0, PF,
    # 2 PF, ..., q1/s1 steps 1, PF + 1, ... (PF sets: deeper prefetch hides more of the load latency).
    q0 = gl.load(q_tile)
    s0 = gl.load(s_tile)
    q1 = gl.load(q_tile + BK // 4, mask=num_k > 1, other=0)
    s1 = gl.load(s_tile + BK // 16, mask=num_k > 1, other=0)
    if PF == 4:
        q2 = gl.load(q_tile + 2 * (BK // 4), mask=num_k > 2, other=0)
        s2 = gl.load(s_tile + 2 * (BK // 16), mask=num_k > 2, other=0)
        q3 = gl.load(q_tile + 3 * (BK // 4), mask=num_k > 3, other=0)
        s3 = gl.load(s_tile + 3 * (BK // 16), mask=num_k > 3, other=0)
    acc = gl.zeros([BN, BM], gl.float32, mma)
    # PF K steps per trip: consecutive steps have their own A registers, so the step that decodes never
    # writes the registers of the wgmma still in flight (the one before it); that one is retired by the
    # wait that follows the next wgmma (warpgroup_mma_wait(1)), before its registers are written again.
    for kk in range(0, num_k - (PF - 1), PF):
        acc, q0, s0 = _g_step(kk, it0, num_k, acc, q0, s0, q_tile, s_tile, x_desc, x_smem, bars, off_m, k0, a_layout,
                              BN, BK, STAGES, DT, PF, num_warps)
        acc, q1, s1 = _g_step(kk + 1, it0, num_k, acc, q1, s1, q_tile, s_tile, x_desc, x_smem, bars, off_m, k0,
                              a_layout, BN, BK, STAGES, DT, PF, num_warps)
        if PF == 4:
            acc, q2, s2 = _g_step(kk + 2, it0, num_k, acc, q2, s2, q_tile, s_tile, x_desc, x_smem, bars, off_m, k0,
                                  a_layout, BN, BK, STAGES, DT, PF, num_warps)
            acc, q3, s3 = _g_step(kk + 3, it0, num_k, acc, q3, s3, q_tile, s_tile, x_desc, x_smem, bars, off_m, k0,
                                  a_layout, BN, BK, STAGES, DT, PF, num_warps)
    # the last num_k % PF steps, peeled (their words are in q0, q1, q2 in that order)
    rest = num_k % PF
    kr = num_k - rest
    if rest >= 1:
        acc, q0, s0 = _g_step(kr, it0, num_k, acc, q0, s0, q_tile, s_tile, x_desc, x_smem, bars, off_m, k0, a_layout,
                              BN, BK, STAGES, DT, PF, num_warps)
    if PF == 4:
        if rest >= 2:
            acc, q1, s1 = _g_step(kr + 1, it0, num_k, acc, q1, s1, q_tile, s_tile, x_desc, x_smem, bars, off_m, k0,
                                  a_layout, BN, BK, STAGES, DT, PF, num_warps)
        if rest >= 3:
            acc, q2, s2 = _g_step(kr + 2, it0, num_k, acc, q2, s2, q_tile, s_tile, x_desc, x_smem, bars, off_m, k0,
                                  a_layout, BN, BK, STAGES, DT, PF, num_warps)
    return warpgroup_mma_wait(0, deps=(acc, ))


@gluon.jit
def _g_dst(scatter_ptr, off_m, hi, layout: gl.constexpr, BM: gl.constexpr, HAS_SCATTER: gl.constexpr):
    """Output rows of the tile's rows ``off_m + [0, BM)`` (through the scatter index) and which are valid."""
    rows = off_m + gl.arange(0, BM, layout=layout)
    ok = rows < hi
    if HAS_SCATTER:
        return gl.load(scatter_ptr + rows, mask=ok, other=0), ok
    return rows, ok


@gluon.jit
def _g_store_y(out, y_ptr, bias_ptr, offs_m, offs_n, n_ok, mask, stride_ym, st_l: gl.constexpr,
               HAS_BIAS: gl.constexpr):
    """Dense epilogue: ``y[m, n] = out[n, m] (+ bias[n])``, rounded once, stored from ``st_l``."""
    res = gl.convert_layout(out, st_l)
    if HAS_BIAS:
        res = res + gl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(gl.float32)[:, None]
    ptrs = y_ptr + offs_m[None, :].to(gl.int64) * stride_ym + offs_n[:, None]
    gl.store(ptrs, res.to(y_ptr.dtype.element_ty), mask=mask)


# Sizes that vary from call to call are not specialized on (value 1, multiple of 16): the kernels a
# layer warms up at start-up are then the ones every later call finds compiled.
@gluon.jit(do_not_specialize=["M", "SPLIT_K", "M_SPLIT", "DP_TILES"])
def w4_wgmma_kernel(x_desc, q_ptr, s_ptr, alpha_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr, actscale_ptr, aux_ptr,
                    scatter_ptr, rowscale_ptr, M, N, K_pad, stride_qe, stride_qn, stride_se, stride_sn, stride_ae,
                    stride_ym, SPLIT_K, M_SPLIT, DP_TILES,
                    MODE: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                    DT: gl.constexpr, HAS_BIAS: gl.constexpr, ACT_SCALE: gl.constexpr, IS_SPLIT: gl.constexpr,
                    HAS_SCATTER: gl.constexpr, HAS_ROWSCALE: gl.constexpr, PF: gl.constexpr,
                    TAIL: gl.constexpr, BM_MAIN: gl.constexpr, FIXUP: gl.constexpr, num_warps: gl.constexpr):
    """MODE 0: dense ``x[M, K]``, one output tile per program: programs ``[0, DP_TILES)`` take tiles
    ``0 .. DP_TILES-1`` over all of K, the others the remaining tiles split ``SPLIT_K`` ways along K
    (program -> split, tile; tiles are M-fastest, so ``DP_TILES``, a multiple of the M tiles, leaves
    whole N columns to the split part). A split program writes its fp32 partial to ``ws``; with FIXUP the
    last of a tile's programs to arrive (a counter per split tile in ``cnt``, zero between calls) sums them in
    split order and stores y, else :func:`w4_splitk_reduce_kernel` does.
    MODE 1: grouped, rows ``aux[e]:aux[e+1]`` of x use expert e; MODE 2: masked, x is ``[E * M, K]``
    (M = max_m) and expert e's rows are ``e*M : e*M + min(aux[e], M)``. In both, program (N tile,
    e * M_SPLIT + split) takes the expert's M tiles split, split + M_SPLIT, ...; rows past the
    expert's end are computed from whatever x holds there and not stored. Output rows go through
    ``scatter`` and are multiplied by ``rowscale[dst]`` when given (grouped).
    TAIL (grouped): 0 every M tile of each expert; 1 its tiles of BM rows and a partial last one only where
    more than BM/2 of its rows are the expert's; 2 (tiles of BM < BM_MAIN rows) the rows that TAIL 1 with
    BM_MAIN left out: an expert's last at most BM_MAIN/2 rows. A tile computes all its rows whether the
    expert has them or not, so a short last tile of 256 rows costs as much as a full one."""
    KA: gl.constexpr = BK // 64
    R: gl.constexpr = BN // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    wl: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[1, 8, 4],
                                        warps_per_cta=[1, num_warps, 1], order=[2, 1, 0])
    # Stores from a layout with 8 consecutive n per thread (16-byte vectors, few 64-bit addresses)
    # instead of the wgmma fragment (2 values per thread per row pair: spills at bm=256).
    st_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[8, 4], warps_per_cta=[1, num_warps],
                                          order=[0, 1])
    steps = K_pad // BK
    if MODE == 0:
        pid = gl.program_id(0)
        m_tiles = gl.cdiv(M, BM)
        rest = m_tiles * gl.cdiv(N, BN) - DP_TILES
        is_split = pid >= DP_TILES
        r = gl.maximum(pid - DP_TILES, 0)
        sp = is_split.to(gl.int32)
        pid_k = r // gl.maximum(rest, 1)
        t = pid + sp * (r % gl.maximum(rest, 1) - r)
        pid_m = t % m_tiles
        pid_n = t // m_tiles
        # split K: program pid_k takes K steps [step0, step0 + num_k) of the K_pad / BK steps
        per = steps + sp * (gl.cdiv(steps, SPLIT_K) - steps)
        step0 = pid_k * per
        num_k = gl.minimum(per, steps - step0)
        e = 0
    else:
        pid_n = gl.program_id(0)
        pe = gl.program_id(1)
        e = pe // M_SPLIT
        step0 = 0
        num_k = steps

    ka = gl.arange(0, KA, layout=gl.SliceLayout(1, gl.SliceLayout(2, wl)))
    ri = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(2, wl)))
    bb = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, wl)))
    wrows = (pid_n * R + ri).to(gl.int64)
    e64 = gl.to_tensor(e).to(gl.int64)
    q_tile = (q_ptr + e64 * stride_qe + step0 * (BK // 4) + wrows[None, :, None] * stride_qn
              + (ka * 16)[:, None, None] + bb[None, None, :])
    s_tile = (s_ptr + e64 * stride_se + step0 * (BK // 16) + wrows[None, :, None] * stride_sn
              + (ka * 4)[:, None, None] + (bb % 4)[None, None, :])
    alpha = gl.load(alpha_ptr + e64 * stride_ae + pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma)))
    offs_n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, st_l))
    n_ok = offs_n < N

    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    if MODE == 0:
        off_m = pid_m * BM
        acc = _g_tile(0, num_k, q_tile, s_tile, x_desc, x_smem, bars, off_m, step0 * BK, mma, a_layout, BN, BM, BK,
                      STAGES, DT, PF, num_warps)
        out = acc * alpha[:, None]
        if ACT_SCALE == 1:
            out = out * gl.load(actscale_ptr)
        offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(0, st_l))
        mask = n_ok[:, None] & (offs_m < M)[None, :]
        if IS_SPLIT:
            if is_split:
                # fp32 partial sums ws[pid_k, m, n - n0] of the split columns [n0, N), added in split
                # order by the tile's last program (FIXUP) or by w4_splitk_reduce_kernel
                n0 = (DP_TILES // m_tiles) * BN
                ws0 = ws_ptr + offs_m[None, :].to(gl.int64) * (N - n0) + (offs_n - n0)[:, None]
                gl.store(ws0 + (pid_k * M).to(gl.int64) * (N - n0), gl.convert_layout(out, st_l), mask=mask)
                if FIXUP:
                    _cta_barrier()      # every warp's partial is written before the release below
                    # one counter per split tile: slots [0, tiles - DP_TILES)
                    arrived = gl.atomic_add(cnt_ptr + (t - DP_TILES), 1, sem="acq_rel", scope="gpu")
                    if arrived == SPLIT_K - 1:
                        tot = gl.zeros([BN, BM], gl.float32, st_l)
                        for si in range(0, SPLIT_K):
                            tot += gl.load(ws0 + (si * M).to(gl.int64) * (N - n0), mask=mask, other=0.0,
                                           cache_modifier=".cg")
                        _g_store_y(tot, y_ptr, bias_ptr, offs_m, offs_n, n_ok, mask, stride_ym, st_l, HAS_BIAS)
                        # zero again for the next call (the kernel's end orders it before that call)
                        gl.atomic_xchg(cnt_ptr + (t - DP_TILES), 0, sem="relaxed", scope="gpu")
            else:
                _g_store_y(out, y_ptr, bias_ptr, offs_m, offs_n, n_ok, mask, stride_ym, st_l, HAS_BIAS)
        else:
            _g_store_y(out, y_ptr, bias_ptr, offs_m, offs_n, n_ok, mask, stride_ym, st_l, HAS_BIAS)
    else:
        if MODE == 1:
            lo = gl.load(aux_ptr + e)
            hi = gl.load(aux_ptr + e + 1)
            if TAIL == 1:
                rem = (hi - lo) % BM
                hi = hi - rem * (rem <= BM // 2).to(gl.int32)
            if TAIL == 2:
                rem = (hi - lo) % BM_MAIN
                lo = hi - rem * (rem <= BM_MAIN // 2).to(gl.int32)
        else:
            lo = e * M
            hi = lo + gl.minimum(gl.load(aux_ptr + e), M)
        it = 0
        for mt in range(pe % M_SPLIT, gl.cdiv(hi - lo, BM), M_SPLIT):
            off_m = lo + mt * BM
            acc = _g_tile(it, num_k, q_tile, s_tile, x_desc, x_smem, bars, off_m, 0, mma, a_layout, BN, BM, BK,
                          STAGES, DT, PF, num_warps)
            it += num_k
            out = acc * alpha[:, None]
            if ACT_SCALE == 2:
                out = out * gl.load(actscale_ptr + e)
            if HAS_ROWSCALE:
                dst_a, ok_a = _g_dst(scatter_ptr, off_m, hi, gl.SliceLayout(0, mma), BM, HAS_SCATTER)
                out = out * gl.load(rowscale_ptr + dst_a, mask=ok_a, other=0.0)[None, :]
            # rounded first: the x ring stays allocated across tiles, so the layout change's shared
            # memory comes on top of it (half as much in 16-bit)
            res = gl.convert_layout(out.to(y_ptr.dtype.element_ty), st_l)
            dst, row_ok = _g_dst(scatter_ptr, off_m, hi, gl.SliceLayout(0, st_l), BM, HAS_SCATTER)
            ptrs = y_ptr + dst[None, :].to(gl.int64) * stride_ym + offs_n[:, None]
            gl.store(ptrs, res, mask=n_ok[:, None] & row_ok[None, :])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


@triton.jit(do_not_specialize=["M", "N0", "SPLIT_K"])
def w4_splitk_reduce_kernel(ws_ptr, bias_ptr, y_ptr, M, N, N0, stride_ym, SPLIT_K, HAS_BIAS: tl.constexpr,
                            BLOCK: tl.constexpr):
    """``y[m, N0 + n] = sum_s ws[s, m, n] (+ bias[N0 + n])`` for n < N - N0, s in order (deterministic)."""
    m = tl.program_id(1)
    nr = N - N0
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < nr
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(0, SPLIT_K):
        acc += tl.load(ws_ptr + (s * M + m).to(tl.int64) * nr + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + N0 + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + N0 + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def splits(k_pad: int, bk: int, split_k: int) -> int:
    """The split count actually launched: every split gets at least one K step."""
    steps = k_pad // bk
    per = -(-steps // max(1, min(split_k, steps)))
    return -(-steps // per)


@functools.lru_cache(maxsize=None)
def _x_layout(bm: int, bk: int, dtype: torch.dtype):
    # built once per tile shape: get_default_for runs Gluon's constexpr functions (~50 µs a call)
    return gl.NVMMASharedLayout.get_default_for([bm, bk], _GL_DTYPES[dtype])


def _x_desc(x2: torch.Tensor, bm: int, bk: int) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(x2, [bm, bk], _x_layout(bm, bk, x2.dtype))


def _bk(lay, cfg) -> int:
    return cfg.bk if lay.k_pad % cfg.bk == 0 else 64      # k_pad is a multiple of 64


def dp_tiles(m_tiles: int, n_tiles: int, sms: int, split_tail: bool) -> int:
    """Tiles computed over all of K ahead of the split ones, for a split launch: none without ``split_tail``
    (every tile is split); with it, the whole waves of one tile per SM, rounded down to whole N columns of
    tiles (the tiles left over, fewer than one per SM, are then split along K, so every SM gets about the
    same work)."""
    tiles = m_tiles * n_tiles
    if not split_tail:
        return 0
    return (tiles // sms) * sms // m_tiles * m_tiles


def dense_plan(m: int, lay, cfg, sms: int) -> tuple[int, int, int, int]:
    """``(splits, dp_tiles, tiles, m_tiles)`` of a dense launch of ``m`` rows (splits 1: no split pass)."""
    bk = _bk(lay, cfg)
    sk = splits(lay.k_pad, bk, cfg.split_k)
    m_tiles, n_tiles = -(-m // cfg.bm), -(-lay.n // cfg.bn)
    tiles = m_tiles * n_tiles
    dp = dp_tiles(m_tiles, n_tiles, sms, cfg.split_tail) if sk > 1 else tiles
    if dp == tiles:
        sk = 1
    return sk, dp, tiles, m_tiles


def launch_dense(x2: torch.Tensor, w, y: torch.Tensor, cfg, dummy: torch.Tensor, bias=None, act_scale=None,
                 sms: int = 132, counters=None) -> None:
    """``y = x2 @ dequant(w)^T * alpha (* act_scale) (+ bias)`` with :func:`w4_wgmma_kernel`.

    ``x2``: ``[M, K]`` rows with a 16-byte aligned base and row stride (TMA); ``cfg``: a
    :class:`~.select.GluonConfig`. Split K (of every tile, or with ``cfg.split_tail``
    of the tiles past the last whole wave of ``sms`` tiles) writes fp32 partials to a workspace that
    :func:`w4_splitk_reduce_kernel` sums in split order (deterministic); with ``cfg.fixup`` the last program
    of each split tile does, counting arrivals in ``counters(device, size)``: an int32 vector of at least ``size``
    zeros that the kernel leaves zero (one per stream: calls on one stream never share a slot at once).
    ``dummy``: a device tensor for the pointer arguments a variant never reads."""
    lay = w.layout
    m = x2.shape[0]
    bm, bn, bk = cfg.bm, cfg.bn, _bk(lay, cfg)
    sk, dp, tiles, m_tiles = dense_plan(m, lay, cfg, sms)
    n0 = dp // m_tiles * bn
    d = dummy
    ws = torch.empty((sk, m, lay.n - n0), dtype=torch.float32, device=x2.device) if sk > 1 else d
    fixup = sk > 1 and cfg.fixup
    if fixup and counters is None:
        raise ValueError("launch_dense: a fixup config (cfg.fixup) needs counters, got None")
    cnt = counters(x2.device, tiles - dp) if fixup else d
    b = bias if bias is not None else d
    fast(w4_wgmma_kernel)[(dp + (tiles - dp) * sk,)](
        _x_desc(x2, bm, bk), w.words, w.scales, w.alpha, b, y, ws, cnt, act_scale if act_scale is not None else d,
        d, d, d, m, lay.n, lay.k_pad, 0, w.words.stride(1), 0, w.scales.stride(1), 0, y.stride(0), sk, 1, dp,
        MODE=0, BN=bn, BM=bm, BK=bk, STAGES=cfg.num_stages, DT=0 if x2.dtype == torch.bfloat16 else 1,
        HAS_BIAS=int(bias is not None), ACT_SCALE=int(act_scale is not None), IS_SPLIT=int(sk > 1),
        HAS_SCATTER=0, HAS_ROWSCALE=0, PF=cfg.prefetch, TAIL=0, BM_MAIN=bm, FIXUP=int(fixup), num_warps=bn // 16)
    if sk > 1 and not fixup:
        block = 1024
        fast(w4_splitk_reduce_kernel)[(-(-(lay.n - n0) // block), m)](
            ws, b, y, m, lay.n, n0, y.stride(0), sk, HAS_BIAS=int(bias is not None), BLOCK=block)


def launch_grouped(mode: int, x2: torch.Tensor, w, y2: torch.Tensor, cfg, aux: torch.Tensor, dummy: torch.Tensor, *,
                   m: int, m_split: int, scatter=None, row_scale=None, act_scale=None, tail_cfg=None) -> None:
    """Grouped (``mode`` 1: ``aux`` = expert offsets, x2 ``[R, K]``) or masked (2: ``aux`` = mask, x2 the
    ``[E * m, K]`` view of ``[E, m, K]``, ``m`` = max_m) launch of :func:`w4_wgmma_kernel`: a static grid of
    (N tiles, experts x ``m_split``), y2 row-major 2-D (``[E * m, N]`` for masked). ``tail_cfg`` (grouped):
    a config of shorter tiles that a second launch computes each expert's last at most ``cfg.bm / 2`` rows
    with, which the first then leaves out (its grid: N tiles, experts x enough programs for those rows)."""
    lay = w.layout
    num_e = w.words.shape[0]
    if tail_cfg is not None and mode != 1:
        raise ValueError(f"launch_grouped: tail_cfg is for grouped launches (mode 1), got mode {mode}")
    parts = [(cfg, m_split, 1 if tail_cfg is not None else 0)]
    if tail_cfg is not None:
        parts.append((tail_cfg, -(-(cfg.bm // 2) // tail_cfg.bm), 2))
    d = dummy
    for c, ms, tail in parts:
        bm, bn, bk = c.bm, c.bn, _bk(lay, c)
        fast(w4_wgmma_kernel)[(-(-lay.n // bn), num_e * ms)](
            _x_desc(x2, bm, bk), w.words, w.scales, w.alpha, d, y2, d, d, act_scale if act_scale is not None else d,
            aux, scatter if scatter is not None else d, row_scale if row_scale is not None else d,
            m, lay.n, lay.k_pad, w.words.stride(0), w.words.stride(1), w.scales.stride(0), w.scales.stride(1),
            w.alpha.stride(0), y2.stride(0), 1, ms, 0,
            MODE=mode, BN=bn, BM=bm, BK=bk, STAGES=c.num_stages, DT=0 if x2.dtype == torch.bfloat16 else 1,
            HAS_BIAS=0, ACT_SCALE=2 if act_scale is not None else 0, IS_SPLIT=0,
            HAS_SCATTER=int(scatter is not None), HAS_ROWSCALE=int(row_scale is not None), PF=c.prefetch,
            TAIL=tail, BM_MAIN=cfg.bm, FIXUP=0, num_warps=bn // 16)
