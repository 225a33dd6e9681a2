"""Triton kernels: FP4-weight GEMMs for Hopper (dense, grouped by expert offsets, masked).

One kernel body, ``y[m, n] = sum_k x[m, k] * (e2m1 * s)[n, k] * alpha[n]``, computed "swap AB":
``acc[n, m] = W_tile @ x_tile^T`` so the decoded weight is the tensor-core *A* operand and stays in
registers (layout: :mod:`.layout`); the ``SS`` variant for large token tiles instead stores the decoded
tile to shared memory as the B operand of ``x_tile @ W_tile^T`` (see ``_mma_tile``). x goes through shared memory (cp.async, pipelined by Triton with
``num_stages``); the weight words and scale pairs too, then each thread decodes its own 16-byte
vector in registers with 9 (bf16) / 11 (fp16) shift-and-mask instructions plus 4 multiplies per
8 values (``_decode_asm``), into exactly the mma / wgmma A fragment.

Tensor-core instruction:
  * ``V2=0``: Hopper wgmma (MMAv3), used for ``BM >= 16`` token tiles;
  * ``V2=1``: mma.sync (MMAv2), what Triton picks for 8-token tiles (decode). Its register fragment
    wants 4 consecutive K per thread, so the kernel relabels K inside each 16-wide step (weights and
    x consistently; the sum over K is unchanged) instead of moving data.

Modes (``MODE``): 0 dense ``x[M, K]``; 1 grouped, rows ``expert_offsets[e]:expert_offsets[e+1]``
of x (optionally read through ``gather`` and written through ``scatter`` times ``row_scale``);
2 masked, ``x[E, max_m, K]`` with ``mask[e]`` valid rows. Grouped kernels launch a static grid
(experts x N tiles x M splits) and programs with no rows exit at once: no host synchronization,
CUDA-graph safe. Dense small-M calls split K over programs; the last program of each tile sums
the partials in a fixed order (deterministic) and resets its semaphore for the next call.

On a machine without CUDA (or with ``TRITON_INTERPRET=1``) the same kernels run in Triton's
interpreter, with the shift-and-mask decode written in Triton ops (``USE_ASM=0``) instead of PTX.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import envs
from .layout import BF16_SCALE_BIAS, BIT_PLANS


#: Set to 1 to get compiled (not interpreted) kernels on a machine without a GPU, for ahead-of-time
#: compilation and SASS inspection (:mod:`.inspect_sass`).
ENV_COMPILE_ONLY = envs.GEMM_COMPILE_ONLY


def interpreting() -> bool:
    if envs.triton_interpret():
        return True
    return not torch.cuda.is_available() and not envs.gemm_compile_only()


INTERPRET = interpreting()


def _fix_interpreter_index() -> None:
    """Triton 3.6's interpreter turns loop bounds into ints with ``int(array)``, which numpy >= 2.3
    refuses for the shape-(1,) arrays that ``tl.program_id`` returns; wrap it to take the one
    element. Interpreter only (CPU tests); a no-op for compiled kernels."""
    from triton.runtime import interpreter as _itp

    if getattr(_itp, "_nvfp4_index_fix", False):
        return
    orig = _itp._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _itp._patch_lang_tensor = patched
    _itp._nvfp4_index_fix = True


if INTERPRET:
    _fix_interpreter_index()


def _jit(fn=None, **kwargs):
    """``triton.jit``, or the interpreter when there is no GPU (decided once, at import)."""
    def wrap(f):
        if INTERPRET:
            from triton.runtime.interpreter import InterpretedFunction
            return InterpretedFunction(f, **kwargs)
        return triton.jit(f, **kwargs)
    return wrap(fn) if fn is not None else wrap


# ----------------------------------------------------------------------------------------------
# Decode: PTX (GPU) and Triton ops (interpreter); both compute the same bits.
# ----------------------------------------------------------------------------------------------

def _decode_ptx(act_dtype: torch.dtype) -> str:
    """Inline PTX for two words: word e (8 codes) and its scale pair -> the four scaled bf16x2/f16x2 A
    registers of word e (output k of word e is ``$(2 * k + e)``).

    ``$8``/``$9`` = the words, ``$10`` = both scale pairs in one 32-bit register (word 0's in the low half),
    so no 16-bit extraction is needed: the byte permute that spreads a pair into the two halves selects
    the pair's bytes directly. (Both the Triton and the Gluon kernels decode two words per block: five to
    six percent fewer loop instructions than one word per block.)"""
    _, _, outputs = BIT_PLANS[act_dtype]
    mul = "mul.rn.bf16x2" if act_dtype == torch.bfloat16 else "mul.rn.f16x2"
    if act_dtype == torch.bfloat16:
        expand = f"mad.lo.u32 c, c, 16, {BF16_SCALE_BIAS * 0x10001:#x};"
    else:
        expand = "shl.b32 c, c, 7;"
    lines = [".reg .b32 c, h0, h1, ta, tb;", ".reg .b16 cl, ch;"]
    for e in range(2):
        word = f"${8 + e}"
        lines.append(f"prmt.b32 c, $10, 0, {0x4140 + 0x202 * e:#x};")
        lines += [expand, "mov.b32 {cl, ch}, c;", "mov.b32 h0, {cl, cl};", "mov.b32 h1, {ch, ch};"]
        for k, pieces in enumerate(outputs):
            for i, (r, m) in enumerate(pieces):
                dst = "ta" if i == 0 else "tb"
                src = word
                if r:
                    bits = [b for b in range(32) if (m >> b) & 1]
                    if all(b + r < 32 for b in bits):        # no wrapped bit survives the mask: plain shift
                        lines.append(f"shr.b32 {dst}, {word}, {r};")
                    elif all(b + r >= 32 for b in bits):
                        lines.append(f"shl.b32 {dst}, {word}, {32 - r};")
                    else:
                        lines.append(f"shf.r.wrap.b32 {dst}, {word}, {word}, {r};")
                    src = dst
                lines.append(f"and.b32 {dst}, {src}, {m:#x};")
                if i:
                    lines.append("or.b32 ta, ta, tb;")
            lines.append(f"{mul} ${2 * k + e}, ta, {'h0' if k % 2 == 0 else 'h1'};")
    return "{\n" + "\n".join(lines) + "\n}"


_PTX2_BF16 = tl.constexpr(_decode_ptx(torch.bfloat16))
_PTX2_FP16 = tl.constexpr(_decode_ptx(torch.float16))


@_jit
def _decode_asm(q, sp, DT: tl.constexpr):
    # two words per asm block: their two 16-bit scale pairs arrive as one 32-bit register
    if DT == 0:
        return tl.inline_asm_elementwise(asm=_PTX2_BF16, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r,r",
                                         args=[q, sp], dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
                                         is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(asm=_PTX2_FP16, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r,r",
                                         args=[q, sp], dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
                                         is_pure=True, pack=2)


@_jit
def _cdiv(a, b):
    # (not tl.cdiv: library helpers are compiled for the interpreter only when TRITON_INTERPRET is set at import)
    return (a + b - 1) // b


@_jit
def _rotr(q, r: tl.constexpr):
    return (q >> r) | (q << (32 - r))


@_jit
def _halves(o, DT: tl.constexpr):
    """uint32 (two 16-bit floats) -> [..., 2] bf16/fp16, low half first."""
    lo = (o & 0xFFFF).to(tl.uint16)
    hi = (o >> 16).to(tl.uint16)
    if DT == 0:
        return tl.join(lo.to(tl.bfloat16, bitcast=True), hi.to(tl.bfloat16, bitcast=True))
    else:
        return tl.join(lo.to(tl.float16, bitcast=True), hi.to(tl.float16, bitcast=True))


@_jit
def _halves_f32(o, DT: tl.constexpr):
    """uint32 holding two bf16/fp16 bit patterns -> [..., 2] fp32 values (exact, subnormals kept)."""
    if DT == 0:
        lo = (o << 16).to(tl.float32, bitcast=True)
        hi = (o & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        lo = (o & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (o >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.join(lo, hi)


@_jit
def _decode_ops(q, sp, DT: tl.constexpr, F32_OUT: tl.constexpr):
    """Triton-ops twin of :func:`_decode_asm` for the interpreter: words ``[KA, R, 16]`` -> the four
    scaled ``[KA, R, 16, 2]`` halves. The products are formed in fp32 (exact, and the interpreter's
    16-bit float arithmetic and subnormal conversions are not to be trusted), then rounded (exactly)."""
    x = sp.to(tl.uint32)
    pair = (x & 0xFF) | ((x & 0xFF00) << 8)
    if DT == 0:
        c = pair * 16 + 0x70007000
        o0 = q & 0x81C081C0
        o1 = _rotr(q, 4) & 0x81C081C0
        o2 = _rotr(q, 10) & 0x81C081C0
        o3 = (_rotr(q, 30) & 0x80C080C0) | (_rotr(q, 6) & 0x01000100)
        out_ty = tl.bfloat16
    else:
        c = pair << 7
        t2 = _rotr(q, 2)
        o0 = q & 0x8E008E00
        o1 = (t2 & 0x04000400) | (_rotr(q, 5) & 0x8A008A00)
        o2 = (t2 & 0x08000800) | (_rotr(q, 9) & 0x86008600)
        o3 = (t2 & 0x80008000) | (_rotr(q, 12) & 0x0E000E00)
        out_ty = tl.float16
    c0, c1 = tl.split(_halves_f32(c, DT))
    a0 = _halves_f32(o0, DT) * c0[:, :, :, None]
    a1 = _halves_f32(o1, DT) * c1[:, :, :, None]
    a2 = _halves_f32(o2, DT) * c0[:, :, :, None]
    a3 = _halves_f32(o3, DT) * c1[:, :, :, None]
    if F32_OUT:
        return a0, a1, a2, a3
    else:
        return a0.to(out_ty), a1.to(out_ty), a2.to(out_ty), a3.to(out_ty)


@_jit
def _weight_tile(q, sp, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, V2: tl.constexpr,
                 USE_ASM: tl.constexpr, F32_OUT: tl.constexpr = False):
    """Words ``[BK/64, BN/2, 16]`` + scale pairs (same shape) -> decoded weight tile ``[BN, BK]``
    (in the activation dtype; fp32 with ``F32_OUT``, ops path only)."""
    KA: tl.constexpr = BK // 64
    if USE_ASM:
        o0, o1, o2, o3 = _decode_asm(q, sp, DT)
        a0 = _halves(o0, DT)
        a1 = _halves(o1, DT)
        a2 = _halves(o2, DT)
        a3 = _halves(o3, DT)
    else:
        a0, a1, a2, a3 = _decode_ops(q, sp, DT, F32_OUT)
    t = tl.join(tl.join(a0, a1), tl.join(a2, a3))               # ka, i, (c j), e, h, kh
    t = tl.reshape(t, [KA, BN // 16, 8, 4, 4, 2, 2, 2])         # ka, w, g, c, j, e, h, kh
    if V2:
        t = tl.permute(t, [1, 6, 2, 0, 4, 3, 7, 5])             # w, h, g | ka, j, c, kh, e
    else:
        t = tl.permute(t, [1, 6, 2, 0, 4, 7, 3, 5])             # w, h, g | ka, j, kh, c, e
    return tl.reshape(t, [BN, BK])


@_jit
def _mma_tile(x_ptr, stride_xm, src_rows, row_ok, q_tile, s_tile, k_lo, k_hi, K, K_pad,
              BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, V2: tl.constexpr,
              USE_ASM: tl.constexpr, EVEN_K: tl.constexpr, SS: tl.constexpr = False):
    """``acc[BN, BM] = W[n-tile, k_lo:k_hi] @ x[rows, k_lo:k_hi]^T`` (fp32).

    ``SS`` (large token tiles): the tokens are the wgmma M side, ``acc^T[BM, BN] = x @ W^T``, with both
    operands in shared memory (the decoded tile is stored there with STSM as the B operand); transposed
    once at the end. There is no register operand to race on, so no forced wait (the register-A path's
    64 FSEL per step); Triton 3.6 still retires each step's wgmmas (``WARPGROUP.DEPBAR gsb0, 0``) before
    the next decode, so overlap comes from the other warps and CTAs of the SM, as before.
    """
    KA: tl.constexpr = BK // 64
    ka = tl.arange(0, KA)
    offs_k = tl.arange(0, BK)
    x_rows = x_ptr + src_rows[:, None].to(tl.int64) * stride_xm
    if SS:
        acc = tl.full([BM, BN], 0.0, tl.float32)
    else:
        acc = tl.full([BN, BM], 0.0, tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        if EVEN_K:
            q = tl.load(q_tile + k0 // 4)
            sp = tl.load(s_tile + k0 // 16)
            x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=row_ok[:, None], other=0.0)
        else:
            atom_ok = (k0 + ka * 64 < K_pad)[:, None, None]
            q = tl.load(q_tile + k0 // 4, mask=atom_ok, other=0)
            sp = tl.load(s_tile + k0 // 16, mask=atom_ok, other=0)
            x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=row_ok[:, None] & ((k0 + offs_k) < K)[None, :],
                        other=0.0)
        w = _weight_tile(q.to(tl.uint32, bitcast=True), sp.to(tl.uint16, bitcast=True), BN, BK, DT, V2, USE_ASM,
                         not USE_ASM)
        if V2:
            xr = tl.reshape(x, [BM, BK // 16, 2, 4, 2])                  # m, j, kh, c, e
            x = tl.reshape(tl.permute(xr, [0, 1, 3, 2, 4]), [BM, BK])  # m, j, c, kh, e
        if SS:
            if USE_ASM:
                acc = tl.dot(x, tl.trans(w), acc)
            else:
                acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
        elif USE_ASM:
            acc = tl.dot(w, tl.trans(x), acc)
            if not V2:
                # wgmma with the decoded weights as its register A operand: Triton 3.6 splits the dot
                # into async wgmmas and lets the next iteration's decode overwrite their A registers
                # while they may still be reading them (undefined behaviour: wrong tiles under load;
                # triton-lang/triton#9433). A non-dot use of acc (always true) makes the pipeliner
                # wait for the dot here; the SASS test checks that no such write is left.
                acc = tl.where(k0 >= k_lo, acc, 0.0)
        else:
            # interpreter: 16-bit float dots are not emulated faithfully there; fp32 is exact here
            acc = tl.dot(w, tl.trans(x).to(tl.float32), acc, input_precision="ieee")
    if SS:
        res = tl.trans(acc)
    else:
        res = acc
    return res


@_jit
def _epilogue(acc, y_ptr, stride_ym, offs_n, n_ok, dst_rows, row_ok, alpha_ptr, bias_ptr, actscale_ptr, e,
              rowscale_ptr, HAS_BIAS: tl.constexpr, ACT_SCALE: tl.constexpr, HAS_ROWSCALE: tl.constexpr):
    out = acc * tl.load(alpha_ptr + offs_n)[:, None]
    if ACT_SCALE == 1:
        out = out * tl.load(actscale_ptr)
    if ACT_SCALE == 2:
        out = out * tl.load(actscale_ptr + e)
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if HAS_ROWSCALE:
        out = out * tl.load(rowscale_ptr + dst_rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    ptrs = y_ptr + dst_rows[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    tl.store(ptrs, out.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & row_ok[None, :])


@_jit(do_not_specialize=["M", "SPLIT_K", "M_SPLIT", "GROUP_M", "NUM_E"])
def w4_gemm_kernel(
        x_ptr, q_ptr, s_ptr, alpha_ptr, bias_ptr, y_ptr,
        aux_ptr, gather_ptr, scatter_ptr, rowscale_ptr, actscale_ptr, ws_ptr, cnt_ptr,
        M, N, K, K_pad, NUM_E,
        stride_xm, stride_xe, stride_qe, stride_qn, stride_se, stride_sn, stride_ae, stride_ym, stride_ye,
        SPLIT_K, M_SPLIT, GROUP_M,
        MODE: tl.constexpr, DT: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
        IS_SPLIT: tl.constexpr, V2: tl.constexpr,
        USE_ASM: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GATHER: tl.constexpr,
        HAS_SCATTER: tl.constexpr, HAS_ROWSCALE: tl.constexpr, ACT_SCALE: tl.constexpr, SS: tl.constexpr = 0,
        COMPACT: tl.constexpr = 0, E_P2: tl.constexpr = 1):
    R: tl.constexpr = BN // 2
    KA: tl.constexpr = BK // 64
    n_tiles = _cdiv(N, BN)
    e64 = tl.full([], 0, tl.int64)
    if MODE == 0:
        pid = tl.program_id(0)
        m_tiles = _cdiv(M, BM)
        tiles = n_tiles * m_tiles
        pid_k = pid // tiles
        t = pid % tiles
        group = GROUP_M * n_tiles
        first_m = (t // group) * GROUP_M
        gm = tl.minimum(m_tiles - first_m, GROUP_M)
        pid_m = first_m + (t % group) % gm
        pid_n = (t % group) // gm
        e = 0
    else:
        pid_n = tl.program_id(0)
        pe = tl.program_id(1)
        e = pe // M_SPLIT
        e_ok = True
        if COMPACT:
            # MODE 1 with fewer rows than experts: program slot e serves the (e+1)-th expert that has rows
            # (a grid of min(E, rows) slots instead of E, most of which would find no rows).
            ie = tl.arange(0, E_P2)
            lo_e = tl.load(aux_ptr + ie, mask=ie < NUM_E, other=0)
            hi_e = tl.load(aux_ptr + ie + 1, mask=ie < NUM_E, other=0)
            seen = tl.cumsum((hi_e > lo_e).to(tl.int32), 0)
            e = tl.sum((seen <= e).to(tl.int32), 0)
            e_ok = e < NUM_E
            e = tl.where(e_ok, e, 0)
        e64 = e.to(tl.int64)
        pid_k = 0
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    ri = pid_n * R + tl.arange(0, R)
    bb = tl.arange(0, 16)
    ka = tl.arange(0, KA)
    q_tile = (q_ptr + e64 * stride_qe + ri[None, :, None].to(tl.int64) * stride_qn + (ka * 16)[:, None, None]
              + bb[None, None, :])
    s_tile = (s_ptr + e64 * stride_se + ri[None, :, None].to(tl.int64) * stride_sn + (ka * 4)[:, None, None]
              + (bb % 4)[None, None, :])
    alpha_e = alpha_ptr + e64 * stride_ae
    offs_m = tl.arange(0, BM)

    if MODE == 0:
        rows = pid_m * BM + offs_m
        row_ok = rows < M
        iters = _cdiv(K, BK)
        per = _cdiv(iters, SPLIT_K)
        k_lo = pid_k * per * BK
        k_hi = tl.minimum(K, (pid_k + 1) * per * BK)
        acc = _mma_tile(x_ptr, stride_xm, rows, row_ok, q_tile, s_tile, k_lo, k_hi, K, K_pad, BN, BM, BK, DT, V2,
                        USE_ASM, EVEN_K, SS)
        if not IS_SPLIT:
            _epilogue(acc, y_ptr, stride_ym, offs_n, n_ok, rows, row_ok, alpha_e, bias_ptr, actscale_ptr, 0,
                      rowscale_ptr, HAS_BIAS, ACT_SCALE, False)
        else:
            # Partial sums: ws[split, m, n] (n over the padded width n_tiles*BN).
            wn = n_tiles * BN
            ws_tile = ws_ptr + rows[None, :].to(tl.int64) * wn + offs_n[:, None]
            wmask = row_ok[None, :] & (offs_n < wn)[:, None]
            tl.store(ws_tile + pid_k.to(tl.int64) * M * wn, acc, mask=wmask)
            tl.debug_barrier()
            tile_id = pid_m * n_tiles + pid_n
            arrived = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                tot = tl.full([BN, BM], 0.0, tl.float32)
                for s in range(0, SPLIT_K):
                    part = ws_tile + (s * wn).to(tl.int64) * M
                    tot += tl.load(part, mask=wmask, other=0.0, cache_modifier=".cg")
                _epilogue(tot, y_ptr, stride_ym, offs_n, n_ok, rows, row_ok, alpha_e, bias_ptr, actscale_ptr, 0,
                          rowscale_ptr, HAS_BIAS, ACT_SCALE, False)
                tl.atomic_xchg(cnt_ptr + tile_id, 0)
    else:
        split = pe % M_SPLIT
        if MODE == 1:
            row_lo = tl.load(aux_ptr + e)
            row_hi = tl.where(e_ok, tl.load(aux_ptr + e + 1), row_lo)
            x_e = x_ptr
            y_e = y_ptr
        else:
            row_lo = 0
            row_hi = tl.minimum(tl.load(aux_ptr + e), M)
            x_e = x_ptr + e64 * stride_xe
            y_e = y_ptr + e64 * stride_ye
        n_m = _cdiv(row_hi - row_lo, BM)
        for mt in range(split, n_m, M_SPLIT):
            rows = row_lo + mt * BM + offs_m
            row_ok = rows < row_hi
            if HAS_GATHER:
                src = tl.load(gather_ptr + rows, mask=row_ok, other=0)
            else:
                src = rows
            if HAS_SCATTER:
                dst = tl.load(scatter_ptr + rows, mask=row_ok, other=0)
            else:
                dst = rows
            acc = _mma_tile(x_e, stride_xm, src, row_ok, q_tile, s_tile, 0, K, K, K_pad, BN, BM, BK, DT, V2,
                            USE_ASM, EVEN_K, SS)
            _epilogue(acc, y_e, stride_ym, offs_n, n_ok, dst, row_ok, alpha_e, bias_ptr, actscale_ptr, e,
                      rowscale_ptr, HAS_BIAS, ACT_SCALE, HAS_ROWSCALE)


# ----------------------------------------------------------------------------------------------
# W4A4 activation staging: NVFP4 codes + E4M3 scales -> e2m1 * s (exact in bf16/fp16).
# ----------------------------------------------------------------------------------------------

@_jit(do_not_specialize=["R"])
def fp4_act_decode_kernel(q_ptr, s_ptr, srow_ptr, out_ptr, R, K, stride_q, stride_s, stride_o, k_tiles,
                          SWIZZLED: tl.constexpr, HAS_SROW: tl.constexpr, BR: tl.constexpr, BKB: tl.constexpr):
    """``out[r, k] = e2m1(q[r, k]) * s[srow(r), k // 16]`` (the global scale goes to the GEMM epilogue)."""
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_r * BR + tl.arange(0, BR)
    kb = pid_k * BKB + tl.arange(0, BKB)            # 16-wide blocks
    r_ok = rows < R
    kb_ok = kb < K // 16
    ok = r_ok[:, None] & kb_ok[None, :]
    if HAS_SROW:
        srow = tl.load(srow_ptr + rows, mask=r_ok, other=0)
    else:
        srow = rows
    if SWIZZLED:
        # the 128x4 swizzle of numerics.swizzled_offset
        row_part = (srow % 32) * 16 + ((srow // 32) % 4) * 4
        off = (((srow // 128) * k_tiles)[:, None] + (kb // 4)[None, :]) * 512 + row_part[:, None] + (kb % 4)[None, :]
    else:
        off = srow[:, None].to(tl.int64) * stride_s + kb[None, :]
    b = tl.load(s_ptr + off, mask=ok, other=0).to(tl.int32)
    se = (b >> 3) & 0xF
    sm = b & 7
    s_norm = ((se + 120) << 23) | (sm << 20)
    s = tl.where(se == 0, sm.to(tl.float32) * 0.001953125, s_norm.to(tl.float32, bitcast=True))
    j = tl.arange(0, 8)
    byt = tl.load(q_ptr + rows[:, None, None].to(tl.int64) * stride_q + (kb * 8)[None, :, None] + j[None, None, :],
                  mask=ok[:, :, None], other=0).to(tl.int32)
    codes = tl.join(byt & 0xF, byt >> 4)            # [BR, BKB, 8, 2]: element 2j, 2j+1
    mag = codes & 7
    ex = mag >> 1
    mb = mag & 1
    v_norm = ((ex + 126) << 23) | (mb << 22) | ((codes & 8) << 28)
    v_sub = tl.where((codes & 8) != 0, -0.5, 0.5) * mb.to(tl.float32)
    v = tl.where(ex == 0, v_sub, v_norm.to(tl.float32, bitcast=True))
    val = v * s[:, :, None, None]
    val = tl.reshape(val, [BR, BKB * 16])
    kk = pid_k * BKB * 16 + tl.arange(0, BKB * 16)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + kk[None, :], val.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & (kk < K)[None, :])


# ----------------------------------------------------------------------------------------------
# Dequantize the packed weight to ``e2m1 * s * 2**-8`` (exact in bf16/fp16): the large-M path that
# hands the product to cuBLAS, and a debugging aid.
# ----------------------------------------------------------------------------------------------

@_jit
def w4_dequant_kernel(q_ptr, s_ptr, out_ptr, alpha_ptr, actscale_ptr, N, K, stride_qe, stride_qn, stride_se,
                      stride_sn, stride_oe, stride_on, stride_ae, BN: tl.constexpr, BK: tl.constexpr,
                      DT: tl.constexpr, USE_ASM: tl.constexpr, APPLY_ALPHA: tl.constexpr, ACT_SCALE: tl.constexpr):
    """``out[e, n, k] = e2m1 * s * 2**-8`` (exact), or with ``APPLY_ALPHA`` the dequantized weight
    ``e2m1 * s / gs[n]`` (times the activation scale with ``ACT_SCALE``), rounded once."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    R: tl.constexpr = BN // 2
    KA: tl.constexpr = BK // 64
    ri = pid_n * R + tl.arange(0, R)
    bb = tl.arange(0, 16)
    ka = tl.arange(0, KA)
    k0 = pid_k * BK
    atom_ok = (k0 + ka * 64 < K)[:, None, None]
    q = tl.load(q_ptr + e * stride_qe + ri[None, :, None].to(tl.int64) * stride_qn + (k0 // 4 + ka * 16)[:, None, None]
                + bb[None, None, :], mask=atom_ok, other=0)
    sp = tl.load(s_ptr + e * stride_se + ri[None, :, None].to(tl.int64) * stride_sn + (k0 // 16 + ka * 4)[:, None, None]
                 + (bb % 4)[None, None, :], mask=atom_ok, other=0)
    w = _weight_tile(q.to(tl.uint32, bitcast=True), sp.to(tl.uint16, bitcast=True), BN, BK, DT, 0, USE_ASM,
                     not USE_ASM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = k0 + tl.arange(0, BK)
    if APPLY_ALPHA:
        a = tl.load(alpha_ptr + e * stride_ae + offs_n)
        if ACT_SCALE:
            a = a * tl.load(actscale_ptr)
        w = w.to(tl.float32) * a[:, None]
    tl.store(out_ptr + e * stride_oe + offs_n[:, None].to(tl.int64) * stride_on + offs_k[None, :],
             w.to(out_ptr.dtype.element_ty), mask=(offs_n < N)[:, None] & (offs_k < K)[None, :])
