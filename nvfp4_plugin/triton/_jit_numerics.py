"""The numerics of :mod:`nvfp4_plugin.numerics`, written as Triton device functions.

Every helper is a fixed sequence of IEEE fp32 operations and integer bit manipulation, so a kernel
gives the reference's bytes both compiled for the GPU (launched with fp fusion off and no
flush-to-zero, see ``_runtime.LAUNCH_OPTIONS``) and in Triton's CPU interpreter (numpy). Where the
two machines differ, a constexpr picks the branch (``COMPILED``: built for a GPU; ``HW_FP8``: sm_89+):

* NaN: the GPU's ``max.f32`` ignores a NaN operand and GPU arithmetic only produces the canonical
  NaN (sign clear); numpy propagates NaN through max and keeps NaN signs. Compiled code uses the
  former to drop NaN without compares (:func:`block_amax`, :func:`e2m1_magnitude`); the
  interpreter branch masks with ``where``.
* Rounding to a grid: integer arithmetic on the fp32 bit pattern or the add-and-subtract trick
  ``(a + C) - C`` (``C`` a power of two whose ulp is the grid spacing), IEEE round-to-nearest-even
  by construction. The interpreter's float->FP8/bf16 conversions truncate and are never used; the
  GPU's ``cvt.rn.satfinite`` (same bytes as torch after the clamp) is used where ``HW_FP8``.
* Division is ``tl.math.div_rn`` (``div.rn.f32``), never the approximate ``/``.
* Stochastic rounding needs ``floor(q + u)`` exactly: two round-toward-zero adds when compiled,
  float64 in the interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

FLT_MAX = tl.constexpr(3.4028234663852886e38)
INF = tl.constexpr(float("inf"))
ONE_SIXTH_F32 = tl.constexpr(0.1666666716337204)  # fp32(1/6), exactly (== numerics._ONE_SIXTH_F32)
TWO_POW_64 = tl.constexpr(2.0**64)
E2M1_MAX = tl.constexpr(6.0)
# Fast-path bounds of the NVFP4 dequantization (see nvfp4_dequant).
DQ_LO = tl.constexpr(2.0**-124)
DQ_HI = tl.constexpr(2.0**125)


@triton.jit
def f32_bits(x):
    return x.to(tl.uint32, bitcast=True)


@triton.jit
def bits_f32(b):
    return b.to(tl.float32, bitcast=True)


# ----------------------------------------------------------------------------------------------
# loads and stores of activations (bf16 as raw 16-bit words under the interpreter)
# ----------------------------------------------------------------------------------------------


@triton.jit
def load_f32(ptrs, mask):
    """Load fp32/fp16/bf16 and widen to fp32, exactly. bf16 may come as raw int16 words (interpreter)."""
    raw = tl.load(ptrs, mask=mask, other=0)
    if raw.dtype == tl.int16:
        x = (raw.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        x = raw.to(tl.float32)
    return x


@triton.jit
def f32_to_bf16_bits_rne(v):
    """fp32 -> bf16 bit pattern, round to nearest even (NaN stays a quiet NaN), as int16."""
    b = f32_bits(v)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where(v != v, (b >> 16) | 0x40, r)
    return r.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def store_f32(ptrs, v, mask):
    """Round fp32 ``v`` to the pointer's type (RNE) and store it; int16 pointers take bf16 words."""
    if ptrs.dtype.element_ty == tl.int16:
        val = f32_to_bf16_bits_rne(v)
    else:
        val = v.to(ptrs.dtype.element_ty)
    tl.store(ptrs, val, mask=mask)


@triton.jit
def tile_ids(K_FAST: tl.constexpr):
    """(row block, K tile) of this program in the 2-D grid of ``_runtime.tile_grid``: axis 0 is the
    fast one (K tiles when ``K_FAST``, else row blocks), so no integer division is needed."""
    if K_FAST:
        return tl.program_id(1), tl.program_id(0)
    else:
        return tl.program_id(0), tl.program_id(1)


@triton.jit
def block_cols(col0, NB: tl.constexpr, G: tl.constexpr, VEC: tl.constexpr):
    """Columns ``[NB, 1, G * 8 / VEC, VEC]`` of a block tile: block ``b`` (``G * 8`` elements from
    ``col0 + b * G * 8``), its ``VEC``-element slices (one 16-byte vector each: 8 of bf16/fp16, 4 of
    fp32). :func:`load_block_tile` loads through them and reshapes to ``[NB, BM, G, 8]``.

    The block axis comes first on purpose. When the rows are 16-byte aligned, Triton's coalescing gives
    the contiguous axis to each thread as one vector and then spreads the lanes over the
    lowest-numbered remaining axis: here the blocks, so each thread holds whole blocks (all their
    vectors; the rows of the tile come from the warps). The block amax is then a reduction within the
    thread (no shuffle), each block's scale is computed once (not once per thread that holds a piece
    of it), and a thread's 8 consecutive codes make one 32-bit word of packed output. Nothing depends
    on that layout for correctness (other inputs get other layouts, and Triton moves data as needed);
    it is what makes the common case fast.
    """
    b = tl.arange(0, NB)[:, None, None, None]
    g = tl.arange(0, G * 8 // VEC)[None, None, :, None]
    j = tl.arange(0, VEC)[None, None, None, :]
    return col0 + b * (G * 8) + g * VEC + j


@triton.jit
def load_block_tile(x_ptr, rows64, row_ok, cols, K, stride_xm, stride_xk, G: tl.constexpr):
    """The block tile ``[NB, BM, G, 8]`` (fp32) of rows ``rows64`` at columns ``cols`` (:func:`block_cols`);
    masked lanes read 0."""
    ptrs = x_ptr + rows64[None, :, None, None] * stride_xm + cols * stride_xk
    x = load_f32(ptrs, row_ok[None, :, None, None] & (cols < K))
    return tl.reshape(x, [cols.shape[0], rows64.shape[0], G, 8])


@triton.jit
def store_block_tile(out_ptr, y, rows64, row_ok, col0, K, stride_om, G: tl.constexpr):
    """Store a block tile ``y [NB, BM, G, 8]`` (same dtype as ``out_ptr``, RNE) at columns ``col0 + ...``.

    The pointers are built over ``[NB, BM, G * 8]`` so that Triton sees each block's ``G * 8`` contiguous
    elements and coalesces the store (consecutive lanes on consecutive 16-byte vectors), moving the
    values through shared memory. Stored in the tile's own layout instead, each warp store would
    write half or a quarter of every 32-byte sector it touches: that cost the fake-quant kernels,
    whose output is as large as their input, a quarter of their bandwidth.
    """
    NB: tl.constexpr = y.shape[0]
    c = col0 + tl.arange(0, NB)[:, None, None] * (G * 8) + tl.arange(0, G * 8)[None, None, :]
    y3 = tl.reshape(y, [NB, y.shape[1], G * 8])
    store_f32(out_ptr + rows64[None, :, None] * stride_om + c, y3, row_ok[None, :, None] & (c < K))


# ----------------------------------------------------------------------------------------------
# exponents
# ----------------------------------------------------------------------------------------------


@triton.jit
def exp2i(k):
    """``2**k`` as exact fp32 for int32 ``k`` in [-149, 127] (subnormal below -126)."""
    normal = (k + 127).to(tl.uint32) << 23
    sub_shift = tl.minimum(tl.maximum(k + 149, 0), 22).to(tl.uint32)
    sub = (sub_shift * 0 + 1) << sub_shift
    return bits_f32(tl.where(k >= -126, normal, sub))


@triton.jit
def log2_parts(a):
    """(``floor(log2(a))`` int32, ``a`` is a power of two) for finite fp32 ``a > 0``, subnormals exact."""
    b = f32_bits(a)
    sub = (b >> 23) == 0
    bn = tl.where(sub, f32_bits(a * TWO_POW_64), b)
    e = (bn >> 23).to(tl.int32) - tl.where(sub, 127 + 64, 127)
    return e, (bn & 0x7FFFFF) == 0


@triton.jit
def mx_exponent(amax, FMAX: tl.constexpr, EMAX: tl.constexpr, RCEIL: tl.constexpr):
    """Unbiased E8M0 exponent of an MX block from its (finite, non-NaN) fp32 amax; int32 in [-127, 127]."""
    pos = amax > 0
    safe = tl.where(pos, amax, 1.0)
    if RCEIL:
        q = tl.math.div_rn(safe, FMAX)
        qpos = q > 0
        fl, p2 = log2_parts(tl.where(qpos, q, 1.0))
        e = tl.where(qpos, fl + tl.where(p2, 0, 1), -127)
    else:
        fl, _ = log2_parts(safe)
        e = fl - EMAX
    e = tl.where(pos, e, -127)
    return tl.minimum(tl.maximum(e, -127), 127)


# ----------------------------------------------------------------------------------------------
# E4M3 block scales
# ----------------------------------------------------------------------------------------------


@triton.jit
def e4m3_encode(v):
    """fp32 -> (E4M3 byte as uint32, its fp32 value): RNE, sign kept, NaN -> 0x7F | sign.

    ``v`` must already be clamped to [-448, 448] (or NaN); same bytes as torch / CUDA satfinite.
    """
    b = f32_bits(v)
    sign = b & 0x80000000
    mb = b ^ sign
    a = bits_f32(mb)
    rb = mb + 0x7FFFF + ((mb >> 20) & 1)  # normal range: round the mantissa to 3 bits
    byte_n = (rb >> 20) - 960  # exponent rebias 127 -> 7
    val_n = bits_f32(rb & 0xFFF00000)
    t = a + 16384.0  # subnormal range: ulp(2**14) == 2**-9 == the E4M3 subnormal spacing
    byte_s = f32_bits(t) - 0x46800000
    val_s = t - 16384.0
    normal = a >= 0.015625
    byte = tl.where(normal, byte_n, byte_s)
    val = f32_bits(tl.where(normal, val_n, val_s)) | sign
    nan = v != v
    byte = tl.where(nan, 0x7F, byte) | (sign >> 24)
    return byte, tl.where(nan, v, bits_f32(val))


@triton.jit
def nvfp4_block_scales(vmax, gs, inv_gs, UE8M0: tl.constexpr, HW_FP8: tl.constexpr):
    """Steps 2-3 of the NVFP4 recipe per block: (stored byte uint32, fp32 scale s, fp32 out_scale).

    ``HW_FP8``: the E4M3 rounding by ``cvt.rn.satfinite.e4m3x2.f32`` (same bytes as the clamp and
    the software rounding, in one instruction per two blocks).
    """
    raw = gs * (vmax * ONE_SIXTH_F32)
    if UE8M0:
        pos = raw > 0
        fl, p2 = log2_parts(tl.where(pos & (raw < INF), raw, 1.0))
        e = tl.where(pos, fl + tl.where(p2, 0, 1), -127)
        e = tl.where((raw == INF) | (raw == -INF), 127, e)
        e = tl.minimum(tl.maximum(e, -127), 127)
        byte = (e + 127).to(tl.uint32)
        s = exp2i(e)
    elif HW_FP8:
        q = raw.to(tl.float8e4nv)
        byte = q.to(tl.uint8, bitcast=True).to(tl.uint32)
        s = q.to(tl.float32)
    else:
        c = tl.where(raw > 448.0, 448.0, tl.where(raw < -448.0, -448.0, raw))
        byte, s = e4m3_encode(c)
    denom = s * inv_gs
    out_scale = tl.where(s == 0, 0.0, tl.math.div_rn(1.0, denom))
    return byte, s, out_scale


@triton.jit
def inverse_or_zero(gs):
    return tl.where(gs == 0, 0.0, tl.math.div_rn(1.0, gs))


# ----------------------------------------------------------------------------------------------
# element grids (E2M1, E4M3, E5M2): magnitudes, NaN masked by the caller
# ----------------------------------------------------------------------------------------------


@triton.jit
def grid_round(a, MBITS: tl.constexpr, EMIN_FIELD: tl.constexpr):
    """Round magnitude ``a >= 0`` (not above the format max) to the grid, ties to even.

    The grid of a format with ``MBITS`` mantissa bits and smallest normal exponent field
    ``EMIN_FIELD`` (fp32 bias) has spacing ``2**(max(e, emin) - MBITS)``; adding and subtracting
    ``C = spacing * 2**23`` rounds to a multiple of the spacing in one IEEE add.
    """
    eb = f32_bits(a) >> 23
    c = bits_f32((tl.maximum(eb, EMIN_FIELD) + (23 - MBITS)) << 23)
    return (a + c) - c


@triton.jit
def two_pow_23_plus_floor_sum(q, u1, COMPILED: tl.constexpr):
    """``2**23 + floor(q + u1 - 1)`` exactly, for fp32 ``q`` in [0, 2**22) and ``u1 = 1 + u`` in (1, 2)
    (:func:`uniform_blocks` gives ``u1``, whose bit pattern is the random bits under a fixed exponent).

    Compiled: two round-toward-zero adds (RZ never carries ``q + u1`` past an integer, and
    ``RZ(s + 2**23 - 1)`` for ``s >= 1`` truncates ``s`` to an integer). Interpreter: the same in
    float64, exact.
    """
    if COMPILED:
        return libdevice.add_rz(libdevice.add_rz(q, u1), 8388607.0)
    else:
        return (tl.floor(q.to(tl.float64) + (u1.to(tl.float64) - 1.0)) + 8388608.0).to(tl.float32)


@triton.jit
def grid_round_stochastic(a, u1, MBITS: tl.constexpr, EMIN_FIELD: tl.constexpr, COMPILED: tl.constexpr):
    """Round magnitude ``a`` (grid max at most) down or up to a neighbouring grid point:
    ``floor(a / spacing + u) * spacing``, up with probability ``(a - lo) / (hi - lo)`` for ``u = u1 - 1``
    uniform in (0, 1). Grid points never move. All steps exact."""
    ge = tl.maximum(f32_bits(a) >> 23, EMIN_FIELD) - MBITS  # exponent field of the spacing
    q = a * bits_f32((254 - ge) << 23)  # a / spacing, exact
    idx = two_pow_23_plus_floor_sum(q, u1, COMPILED) - 8388608.0
    return idx * bits_f32(ge << 23)


@triton.jit
def e2m1_code(a):
    """E2M1 magnitude code (uint32, 0..7) of ``a`` in [0, 6] (not NaN), round to nearest even.

    With ``m = max(exponent field, 127)`` the spacing is ``2**(m - 128)``: adding ``C = spacing *
    2**23`` rounds ``a`` to the grid and leaves ``a / spacing`` in the low bits of ``C``'s pattern;
    the code is that index plus ``2 * (m - 127)``.
    """
    m = tl.maximum(f32_bits(a) >> 23, 127)
    c = (m + 22) << 23
    return f32_bits(a + bits_f32(c)) - c + (m << 1) - 254


@triton.jit
def e2m1_code_stochastic(a, u1, COMPILED: tl.constexpr):
    """E2M1 code of ``a`` in [0, 6] rounded like :func:`grid_round_stochastic` (same choices for the same ``u1``)."""
    m = tl.maximum(f32_bits(a) >> 23, 127)
    q = a * bits_f32((255 - m) << 23)  # a / spacing, exact (spacing 2**(m - 128))
    return f32_bits(two_pow_23_plus_floor_sum(q, u1, COMPILED)) - 0x4B000000 + (m << 1) - 254


@triton.jit
def block_amax(xb, COMPILED: tl.constexpr):
    """``max |x|`` per block of a block tile ``[NB, BM, G, 8]`` -> ``[NB, BM]``, NaN ignored (an all-NaN
    block gives 0). The GPU's ``max.f32`` ignores a NaN operand (PTX semantics; the final max with 0
    covers all-NaN blocks), the interpreter's ``np.maximum`` propagates it, so NaN is masked there."""
    if COMPILED:
        return tl.maximum(tl.max(tl.max(tl.abs(xb), axis=3), axis=2), 0.0)
    else:
        return tl.max(tl.max(tl.where(xb == xb, tl.abs(xb), 0.0), axis=3), axis=2)


@triton.jit
def e2m1_magnitude(v, COMPILED: tl.constexpr):
    """(``min(|v|, 6)``, sign bit of ``v``) with NaN -> (0, 0): the reference encodes NaN as +0.

    Compiled, this needs no compare: ``max.f32`` returns the non-NaN operand (PTX semantics), and
    GPU arithmetic only ever produces the canonical NaN 0x7FFFFFFF (sign clear; ``v`` comes out of
    a multiply). The interpreter (numpy) keeps NaN signs and propagates NaN through max, so it masks.
    """
    if COMPILED:
        a = tl.minimum(tl.maximum(tl.abs(v), 0.0), E2M1_MAX)
        sbit = f32_bits(v) & 0x80000000
    else:
        nan = v != v
        a = tl.where(nan, 0.0, tl.minimum(tl.abs(v), E2M1_MAX))
        sbit = tl.where(nan, 0, f32_bits(v) & 0x80000000)
    return a, sbit


@triton.jit
def e2m1_nibbles(v, u, STOCHASTIC: tl.constexpr, COMPILED: tl.constexpr):
    """4-bit E2M1 codes (sign in bit 3) of scaled values ``v``: saturating, RNE or stochastic (``u`` is
    ``u1`` of :func:`uniform_blocks`), NaN -> 0."""
    a, sbit = e2m1_magnitude(v, COMPILED)
    if STOCHASTIC:
        code = e2m1_code_stochastic(a, u, COMPILED)
    else:
        code = e2m1_code(a)
    return code | (sbit >> 28)


# E2M1 codes of 8 scaled values -> one 32-bit word (value 8i + j in nibble j), in one inline PTX block.
#
# Per value ``v``: ``a8 = sat(|v| / 8)`` (``mul.sat``: clamps to [0, 1] and turns NaN into +0, in one
# multiply), then with ``a = 8 * a8`` and ``M = 2**23`` the magnitude code is
#     min(RN(2a + M), RN(a + 2 + M), RN(a/2 + 4 + M), M + 7) - M
# (``fma.rn``: one rounding each, to an integer since ulp(M) = 1; the E2M1 index is the concave
# piecewise-linear min(2a, a + 2, a/2 + 4) of the magnitude, rounded to nearest even, and rounding
# commutes with min). Checked against ``numerics.e2m1_encode`` for every fp32 in [0, 9), both signs,
# and the specials. Stochastic: ``floor(f + u)`` instead, by ``fma.rz`` with ``u1 = 1 + u`` and
# ``add.rz`` of ``M - 1`` (see :func:`two_pow_23_plus_floor_sum`; the same choices as
# :func:`e2m1_code_stochastic` for the same ``u1``). Each code sits in the low 3 bits of its
# sum's bit pattern (0x4B00000c); ``mad.lo`` pairs them into bytes (the 0x4B.. high parts cancel out
# of the low bytes), ``prmt`` joins the bytes, and the 8 sign bits come from ``prmt``'s sign
# replication of the values' top bytes. Compared with integer exponent arithmetic this moves most of
# the work from the ALU pipe (the bottleneck of these kernels) to the FMA pipe.
_E2M1_HEAD = ".reg .f32 a, t1, t2, t3;\n.reg .b32 c0, c1, c2, c3, c4, c5, c6, c7, p0, p1, p2, p3, q0, q1, sa, sb, sc, sd, se, sf;\n"
_E2M1_ONE = ("abs.f32 a, {v};\nmul.sat.f32 a, a, 0f3E000000;\n"
             "fma.rn.f32 t1, a, 0f41800000, 0f4B000000;\nfma.rn.f32 t2, a, 0f41000000, 0f4B000002;\n"
             "fma.rn.f32 t3, a, 0f40800000, 0f4B000004;\n"
             "min.f32 t1, t1, t2;\nmin.f32 t1, t1, t3;\nmin.f32 t1, t1, 0f4B000007;\nmov.b32 {c}, t1;\n")
_E2M1_ONE_SR = ("abs.f32 a, {v};\nmul.sat.f32 a, a, 0f3E000000;\n"  # {u} is u1 = 1 + u: one less in each sum
                "fma.rz.f32 t1, a, 0f41800000, {u};\nadd.rz.f32 t1, t1, 0f4AFFFFFE;\n"
                "fma.rz.f32 t2, a, 0f41000000, {u};\nadd.rz.f32 t2, t2, 0f4B000001;\n"
                "fma.rz.f32 t3, a, 0f40800000, {u};\nadd.rz.f32 t3, t3, 0f4B000003;\n"
                "min.f32 t1, t1, t2;\nmin.f32 t1, t1, t3;\nmin.f32 t1, t1, 0f4B000007;\nmov.b32 {c}, t1;\n")
# One instance per word: outputs $0..$7 (the word in $0; the other seven are unused), inputs $8..$15
# the 8 values (fp32), or for the stochastic variant the 8 (value, uniform) pairs as 64-bit operands
# (low half the value's bits, high half u1's).
_E2M1_TAIL = ("mad.lo.u32 p0, c1, 16, c0;\nmad.lo.u32 p1, c3, 16, c2;\nmad.lo.u32 p2, c5, 16, c4;\n"
              "mad.lo.u32 p3, c7, 16, c6;\nmad.lo.u32 q0, p1, 256, p0;\nmad.lo.u32 q1, p3, 256, p2;\n"
              "prmt.b32 $0, q0, q1, 0x5410;\n"
              "prmt.b32 sa, v0, v2, 0xFB;\nprmt.b32 sb, v4, v6, 0xFB00;\nprmt.b32 sc, sa, sb, 0x7610;\n"
              "prmt.b32 sd, v1, v3, 0xFB;\nprmt.b32 se, v5, v7, 0xFB00;\nprmt.b32 sf, sd, se, 0x7610;\n"
              "lop3.b32 $0, $0, sc, 0x08080808, 0xF8;\nlop3.b32 $0, $0, sf, 0x80808080, 0xF8;\n")


def _e2m1_asm(one: str, stochastic: bool) -> str:
    regs = ".reg .b32 v0, v1, v2, v3, v4, v5, v6, v7, u0, u1, u2, u3, u4, u5, u6, u7;\n"
    if stochastic:
        unpack = "".join(f"mov.b64 {{v{i}, u{i}}}, ${i + 8};\n" for i in range(8))
    else:
        unpack = "".join(f"mov.b32 v{i}, ${i + 8};\n" for i in range(8))
    return ("{\n" + _E2M1_HEAD + regs + unpack + "".join(one.format(v=f"v{i}", u=f"u{i}", c=f"c{i}") for i in range(8))
            + _E2M1_TAIL + "}")


E2M1_WORD_ASM = tl.constexpr(_e2m1_asm(_E2M1_ONE, False))
E2M1_WORD_SR_ASM = tl.constexpr(_e2m1_asm(_E2M1_ONE_SR, True))
E2M1_WORD_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 8))
E2M1_WORD_SR_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["l"] * 8))


@triton.jit
def split8(t):
    """The 8 slices ``t[..., j]`` of a tensor whose last axis is 8 (held by one thread: no data moves)."""
    a, b = tl.split(tl.reshape(t, [t.shape[0], t.shape[1], t.shape[2], 4, 2]))  # even, odd j
    a0, a1 = tl.split(tl.reshape(a, [t.shape[0], t.shape[1], t.shape[2], 2, 2]))  # j % 4 == 0, 2
    b0, b1 = tl.split(tl.reshape(b, [t.shape[0], t.shape[1], t.shape[2], 2, 2]))  # j % 4 == 1, 3
    e0, e4 = tl.split(a0)
    e2, e6 = tl.split(a1)
    e1, e5 = tl.split(b0)
    e3, e7 = tl.split(b1)
    return e0, e1, e2, e3, e4, e5, e6, e7


@triton.jit
def e2m1_words(v, u, STOCHASTIC: tl.constexpr, COMPILED: tl.constexpr):
    """Packed E2M1 codes of scaled values ``v [NB, BM, G, 8]`` -> uint32 words ``[NB, BM, G]``: element ``j``
    of a word's 8 in nibble ``j`` (sign in bit 3), saturating, RNE or stochastic with ``u`` (``u1`` of
    :func:`uniform_blocks`), NaN -> +0. Bytes are those of :func:`e2m1_nibbles` packed two per byte,
    low nibble first. ``v`` must come out of GPU arithmetic (as ``x * scale`` does), whose only NaN is
    the canonical one with the sign clear: the sign bits are taken from ``v`` as they are."""
    if COMPILED:
        # the 8 values of a word go in as 8 operands of one instance (split8 picks registers; the
        # result does not depend on how Triton lays the tile out). Stochastic: each value travels
        # with its uniform in one 64-bit word, which keeps u in v's layout (a separate split of u
        # made Triton convert its layout through shared memory).
        if STOCHASTIC:
            vu = (u.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | v.to(tl.uint32, bitcast=True).to(tl.uint64)
            w0, w1, w2, w3, w4, w5, w6, w7 = split8(vu)
            w, _, _, _, _, _, _, _ = tl.inline_asm_elementwise(E2M1_WORD_SR_ASM, E2M1_WORD_SR_CONSTRAINTS,
                                                               [w0, w1, w2, w3, w4, w5, w6, w7],
                                                               dtype=(tl.int32,) * 8, is_pure=True, pack=1)
        else:
            b0, b1, b2, b3, b4, b5, b6, b7 = split8(v.to(tl.uint32, bitcast=True))
            w, _, _, _, _, _, _, _ = tl.inline_asm_elementwise(E2M1_WORD_ASM, E2M1_WORD_CONSTRAINTS,
                                                               [b0, b1, b2, b3, b4, b5, b6, b7],
                                                               dtype=(tl.int32,) * 8, is_pure=True, pack=1)
        return w.to(tl.uint32, bitcast=True)
    else:
        nib = e2m1_nibbles(v, u, STOCHASTIC, COMPILED)
        return tl.sum(nib << (tl.arange(0, 8) * 4).to(tl.uint32)[None, None, None, :], axis=3)


@triton.jit
def store_words(out_ptr, words, rows64, row_ok, wcol0, K, stride_om, stride_ok, G: tl.constexpr,
                WORDS: tl.constexpr):
    """Store the packed words ``[NB, BM, G]`` of a block tile (word ``wcol0 + b * G + g`` of each row, 4
    bytes). ``WORDS``: one 32-bit store per word (the caller checked byte stride 1 and 4-byte alignment
    of the base and the row stride); else 4 byte stores at ``stride_ok``."""
    b = tl.arange(0, words.shape[0])[:, None, None]
    g = tl.arange(0, G)[None, None, :]
    wcol = wcol0 + b * G + g
    ok = row_ok[None, :, None] & (wcol < K // 8)
    if WORDS:
        wptrs = out_ptr.to(tl.pointer_type(tl.uint32)) + rows64[None, :, None] * (stride_om // 4) + wcol
        tl.store(wptrs, words, mask=ok)
    else:
        j = tl.arange(0, 4)[None, None, None, :]
        by = ((words[:, :, :, None] >> (j * 8).to(tl.uint32)) & 0xFF).to(tl.uint8)
        bptrs = out_ptr + rows64[None, :, None, None] * stride_om + (wcol[:, :, :, None] * 4 + j) * stride_ok
        tl.store(bptrs, by, mask=ok[:, :, :, None])


@triton.jit
def fp8_byte_of_grid(r, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """FP8 magnitude byte of a grid value ``r >= 0`` (exactly representable)."""
    min_normal: tl.constexpr = 2.0 ** (1 - BIAS)
    c_sub: tl.constexpr = 2.0 ** (1 - BIAS - MBITS + 23)  # its ulp is the subnormal spacing
    c_sub_bits: tl.constexpr = (151 - BIAS - MBITS) << 23
    rb = f32_bits(r)
    byte_n = (rb >> (23 - MBITS)) - ((127 - BIAS) << MBITS)
    byte_s = f32_bits(r + c_sub) - c_sub_bits
    return tl.where(r >= min_normal, byte_n, byte_s)


# ----------------------------------------------------------------------------------------------
# stochastic rounding: Philox4x32, one call per 8 consecutive elements of a row
# ----------------------------------------------------------------------------------------------


@triton.jit
def uniform_blocks(seed, rows64, col0, K, NB: tl.constexpr, G: tl.constexpr, N_ROUNDS: tl.constexpr,
                   COMPILED: tl.constexpr):
    """``u1 = 1 + u``, ``u = (k + 1/2) / 2**16`` (k in [0, 65535]) uniform, per element of the block tile
    ``[NB, BM, G, 8]`` at columns ``col0 + ...`` (:func:`block_cols`) of rows ``rows64``.

    Philox4x32 (the generator of ``tl.randint4x``, ``N_ROUNDS`` rounds: ``_runtime.PHILOX_ROUNDS``) keyed by
    ``seed``; the counter is the index of the element's group of 8 in its row-major row
    (``row * K/8 + col/8``), so the stream is reproducible and independent of tiling and strides. The
    four 32-bit words of a group feed its 8 elements with 16 bits each: element ``col % 8`` takes word
    ``(col % 8) // 2``, bits 7..22 for even elements and the other 16 (bits 23..31 and 0..6, by a
    rotation) for odd ones, as the mantissa of ``u1`` under the exponent of 1 (one logic op, no
    shift or conversion for even elements; the rounding helpers take ``u1`` as it is). The chance of
    rounding up is then ``frac`` rounded to a multiple of 2**-16, centred (|bias| <= 2**-17). Philox
    runs once per group of 8, which one thread holds, and the lanes are picked statically.
    """
    groups = col0 // 8 + tl.arange(0, NB)[:, None, None, None] * G + tl.arange(0, G)[None, None, :, None]
    r0, r1, r2, r3 = philox4x32(seed, rows64[None, :, None, None] * (K // 8) + groups, N_ROUNDS, COMPILED)
    # the lane of each element is static (the 8 sit in one thread), so the selects fold away
    lane = tl.arange(0, 8)[None, None, None, :]
    w = tl.where(lane < 4, tl.where(lane < 2, r0, r1), tl.where(lane < 6, r2, r3))
    w = tl.where((lane & 1) == 1, (w << 16) | (w >> 16), w)  # odd lanes: the word rotated by 16
    if COMPILED:  # one lop3 with the exponent in a register (the compiler's and + or takes two)
        m = tl.inline_asm_elementwise(UNIFORM_MERGE_ASM, "=r,r,r",
                                      [w, tl.full(w.shape, 0x3F800040, tl.uint32)], dtype=tl.uint32,
                                      is_pure=True, pack=1)
    else:
        m = (w & 0x7FFF80) | 0x3F800040
    return bits_f32(m)


#: ``(w & 0x7FFF80) | $2`` in one lop3 (``$2`` holds 0x3F800040: exponent of 1, and the half-step).
UNIFORM_MERGE_ASM = tl.constexpr("{\nlop3.b32 $0, $1, 0x7FFF80, $2, 0xEA;\n}")


def _philox_asm(n_rounds: int) -> str:
    """Philox4x32-``n_rounds`` (the constants and round function of ``tl.randint4x``) on counter
    ($4, $5, 0, 0) and key ($6, $7), out $0..$3. ``mul.wide.u32`` gives each round's high and low
    products in one instruction, where the compiler's ``umulhi`` and ``mul`` take two."""
    lines = [".reg .b32 c0, c1, c2, c3, k0, k1, l0, h0, l2, h2;", ".reg .b64 p0, p2;",
             "mov.b32 c0, $4;", "mov.b32 c1, $5;", "mov.b32 c2, 0;", "mov.b32 c3, 0;", "mov.b32 k0, $6;",
             "mov.b32 k1, $7;"]
    for i in range(n_rounds):
        if i:
            lines += ["add.u32 k0, k0, 0x9E3779B9;", "add.u32 k1, k1, 0xBB67AE85;"]
        lines += ["mul.wide.u32 p0, c0, 0xD2511F53;", "mul.wide.u32 p2, c2, 0xCD9E8D57;",
                  "mov.b64 {l0, h0}, p0;", "mov.b64 {l2, h2}, p2;",
                  "lop3.b32 c0, h2, c1, k0, 0x96;", "lop3.b32 c2, h0, c3, k1, 0x96;",
                  "mov.b32 c1, l2;", "mov.b32 c3, l0;"]
    lines += ["mov.b32 $0, c0;", "mov.b32 $1, c1;", "mov.b32 $2, c2;", "mov.b32 $3, c3;"]
    return "{\n" + "\n".join(lines) + "\n}"


PHILOX_10_ASM = tl.constexpr(_philox_asm(10))
PHILOX_7_ASM = tl.constexpr(_philox_asm(7))


@triton.jit
def philox4x32(seed, offset, N_ROUNDS: tl.constexpr, COMPILED: tl.constexpr):
    """``tl.randint4x(seed, offset, N_ROUNDS)`` as four uint32 tensors (same bits): on the GPU by
    :func:`_philox_asm` (10 or 7 rounds), under the interpreter by Triton's own implementation."""
    if COMPILED:
        s = seed.to(tl.uint64)
        k0 = tl.full(offset.shape, 0, tl.uint32) + (s & 0xFFFFFFFF).to(tl.uint32)
        k1 = tl.full(offset.shape, 0, tl.uint32) + (s >> 32).to(tl.uint32)
        c0 = offset.to(tl.uint32)
        c1 = (offset >> 32).to(tl.uint32)
        tl.static_assert(N_ROUNDS == 10 or N_ROUNDS == 7, "philox4x32: 10 or 7 rounds")
        asm: tl.constexpr = PHILOX_10_ASM if N_ROUNDS == 10 else PHILOX_7_ASM
        r0, r1, r2, r3 = tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r,r,r,r", [c0, c1, k0, k1],
                                                   dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
                                                   is_pure=True, pack=1)
    else:
        r0, r1, r2, r3 = tl.randint4x(seed, offset, N_ROUNDS)
        r0 = r0.to(tl.uint32, bitcast=True)
        r1 = r1.to(tl.uint32, bitcast=True)
        r2 = r2.to(tl.uint32, bitcast=True)
        r3 = r3.to(tl.uint32, bitcast=True)
    return r0, r1, r2, r3


# ----------------------------------------------------------------------------------------------
# NVFP4 dequantization of a tile (fake quant)
# ----------------------------------------------------------------------------------------------


@triton.jit
def nvfp4_dequant(r, sbit, s, gs):
    """``(+-r * s) / gs`` per element: ``r`` an E2M1 magnitude, ``sbit`` its sign (bit 31), ``s`` the
    block scales ``[NB, BM]`` of a block tile ``[NB, BM, G, 8]``, ``gs`` the global scale.

    One IEEE division per element is the spec, and ~10 instructions. Because ``r`` is ``2**j`` or
    ``1.5 * 2**j`` (j in -1..2), ``r * s / gs == 2**j * RN(s / gs)`` or ``2**j * RN(1.5 * s / gs)``
    exactly whenever those quotients are normal with room for the ``2**j`` (bounds DQ_LO, DQ_HI):
    two divisions per block instead. A tile with any block outside the bounds (huge or tiny global
    scales) takes the per-element division.
    """
    d1 = tl.math.div_rn(s, gs)
    d15 = tl.math.div_rn(s * 1.5, gs)
    ad1 = tl.abs(d1)
    ad15 = tl.abs(d15)
    fast = (s == 0) | ((ad1 >= DQ_LO) & (ad1 <= DQ_HI) & (ad15 >= DQ_LO) & (ad15 <= DQ_HI))
    rb = f32_bits(r)
    if tl.min(fast.to(tl.int32)) == 1:
        mult = bits_f32((rb & 0xFFBFFFFF) | sbit)  # 1.5 -> 1, 3 -> 2, 6 -> 4, sign applied
        odd = (rb & 0x400000) != 0
        out = mult * tl.where(odd, d15[:, :, None, None], d1[:, :, None, None])
    else:
        out = tl.math.div_rn(bits_f32(rb | sbit) * s[:, :, None, None], gs)
    return out


@triton.jit
def _probe():
    pass


INTERPRETED = not isinstance(_probe, triton.runtime.JITFunction)
