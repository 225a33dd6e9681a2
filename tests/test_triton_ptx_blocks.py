"""The hand-written PTX blocks of the Triton kernels, executed by a small PTX interpreter on the CPU.

``_jit_numerics`` compiles three inline-PTX blocks on the GPU path only (the Triton interpreter runs
their pure-Triton twins): the packed E2M1 encoder (deterministic and stochastic), the Philox4x32
generator and the uniform's bit merge. A wrong byte selector or constant in them cannot show up in
the interpreter tests, so this module runs the PTX text itself, instruction by instruction, with
exact semantics for the few instructions used, and compares it with the reference numerics and with
an independent Philox4x32 (Salmon et al., SC'11; the constants of ``tl.randint4x``). The same blocks
are checked byte-exactly on the GPU by the kernel tests.
"""

from fractions import Fraction

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from nvfp4_plugin.numerics import e2m1_encode  # noqa: E402
from nvfp4_plugin.triton import _jit_numerics as jn  # noqa: E402

M32 = 0xFFFFFFFF


def _bits(x) -> int:
    return int(np.float32(x).view(np.uint32))


def _f32(b: int) -> np.float32:
    return np.uint32(b & M32).view(np.float32)


def _rz(fr: Fraction) -> np.float32:
    """An exact value rounded toward zero to fp32 (finite, in the normal range here)."""
    f = np.float32(float(fr))
    if abs(Fraction(float(f))) > abs(fr):
        f = np.nextafter(f, np.float32(0))
    return f


def _rn(fr: Fraction) -> np.float32:
    """Exact value to fp32, round to nearest even (the products here fit a double exactly)."""
    return np.float32(float(fr))


def run_ptx(asm: str, operands: dict) -> dict:
    """Execute ``asm`` (one ``{ ... }`` block) on ``operands`` (``"$i"`` -> int bits or np.float32)."""
    regs = dict(operands)

    def val(tok):
        tok = tok.strip()
        if tok.startswith("0f"):
            return int(tok[2:], 16)
        if tok in regs:
            v = regs[tok]
            return _bits(v) if isinstance(v, np.floating) else v
        return int(tok, 0) & M32

    def fval(tok):
        return _f32(val(tok))

    for stmt in asm.replace("\n", " ").split(";"):
        stmt = stmt.strip().strip("{}").strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        if op == "mov.b64":  # {lo, hi}, p
            lohi, src = rest.rsplit(",", 1)
            lo, hi = (t.strip() for t in lohi.strip(" {}").split(","))
            regs[lo], regs[hi] = regs[src.strip()] & M32, regs[src.strip()] >> 32
            continue
        args = [a.strip() for a in rest.split(",")]
        d, src = args[0], args[1:]
        if op == "abs.f32":
            r = _bits(np.abs(fval(src[0])))
        elif op == "mul.sat.f32":
            p = fval(src[0]) * fval(src[1])
            r = _bits(0.0 if np.isnan(p) else min(max(float(p), 0.0), 1.0))
        elif op in ("fma.rn.f32", "fma.rz.f32"):
            fr = Fraction(float(fval(src[0]))) * Fraction(float(fval(src[1]))) + Fraction(float(fval(src[2])))
            r = _bits(_rn(fr) if op == "fma.rn.f32" else _rz(fr))
        elif op == "add.rz.f32":
            r = _bits(_rz(Fraction(float(fval(src[0]))) + Fraction(float(fval(src[1])))))
        elif op == "min.f32":  # no NaN reaches these (mul.sat removed it)
            r = _bits(min(fval(src[0]), fval(src[1])))
        elif op == "mov.b32":
            r = val(src[0])
        elif op == "add.u32":
            r = (val(src[0]) + val(src[1])) & M32
        elif op == "mad.lo.u32":
            r = (val(src[0]) * val(src[1]) + val(src[2])) & M32
        elif op == "mul.wide.u32":
            r = val(src[0]) * val(src[1])
        elif op == "prmt.b32":
            a, b, sel = val(src[0]), val(src[1]), val(src[2])
            by = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
            r = 0
            for i in range(4):
                n = (sel >> 4 * i) & 0xF
                byte = by[n & 7]
                if n & 8:  # replicate the byte's sign bit
                    byte = 0xFF if byte & 0x80 else 0
                r |= byte << 8 * i
        elif op == "lop3.b32":
            a, b, c, lut = (val(t) for t in src)
            r = 0
            for bit in range(32):
                idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
                r |= ((lut >> idx) & 1) << bit
        else:
            raise AssertionError(f"instruction not emulated: {op}")
        regs[d] = r
    return regs


def e2m1_word_ptx(v, u1=None) -> int:
    """The packed word of 8 values: operands $8..$15 are their bits, or (stochastic) 64-bit pairs with
    u1's bits in the high half, as ``_jit_numerics.e2m1_words`` passes them."""
    if u1 is None:
        return run_ptx(jn.E2M1_WORD_ASM.value, {f"${i + 8}": _bits(x) for i, x in enumerate(v)})["$0"]
    ops = {f"${i + 8}": _bits(x) | (_bits(u) << 32) for i, (x, u) in enumerate(zip(v, u1))}
    return run_ptx(jn.E2M1_WORD_SR_ASM.value, ops)["$0"]


def word_of(codes) -> int:
    return sum(int(c) << 4 * j for j, c in enumerate(codes))


def test_e2m1_word_matches_the_reference_encoder():
    rng = np.random.default_rng(0)
    vecs = [(rng.standard_normal(8) * s).astype(np.float32) for s in (0.2, 1.0, 3.0, 10.0) for _ in range(150)]
    # every rounding boundary, one ulp either side, both signs, and the specials
    edges = []
    for b in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 8.0):
        f = np.float32(b)
        edges += [f, np.nextafter(f, np.float32(0)), np.nextafter(f, np.float32(10))]
    edges += [0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-45, 6.0, 5.9999995]
    edges = np.array(edges, dtype=np.float32)
    edges = np.concatenate([edges, -edges])
    edges[np.isnan(edges)] = np.float32(np.nan)  # GPU arithmetic makes only the canonical NaN (sign clear)
    edges = np.concatenate([edges, np.zeros(-len(edges) % 8, np.float32)])
    vecs += list(edges.reshape(-1, 8))
    for v in vecs:
        want = word_of(e2m1_encode(torch.from_numpy(v.copy())).numpy())
        assert e2m1_word_ptx(v) == want, v


def test_e2m1_word_stochastic_is_floor_of_the_grid_index_plus_u():
    """floor(a / spacing + u) on the E2M1 grid (u = u1 - 1), saturating, sign kept, NaN -> +0."""
    rng = np.random.default_rng(1)

    def expect(v, u1):
        codes = []
        for x, u in zip(v, u1):
            if np.isnan(x):
                codes.append(0)
                continue
            a = Fraction(float(min(abs(x), np.float32(6.0))))
            q = 2 * a if a < 2 else (a + 2 if a < 4 else a / 2 + 4)
            c = min(int(q + Fraction(float(u)) - 1), 7)
            codes.append(c | (8 if np.signbit(x) else 0))
        return word_of(codes)

    for _ in range(600):
        v = (rng.standard_normal(8) * rng.choice([0.3, 1.0, 3.0, 10.0])).astype(np.float32)
        u1 = (1 + (rng.integers(0, 65536, 8) + 0.5) / 65536).astype(np.float32)
        assert e2m1_word_ptx(v, u1) == expect(v, u1)
    # grid points never move, whatever u
    v = np.array([0.5, -1.0, 1.5, 2.0, -3.0, 4.0, 6.0, 0.0], np.float32)
    for u1 in (np.full(8, 1 + 0.5 / 65536, np.float32), np.full(8, 1 + 65535.5 / 65536, np.float32)):
        assert e2m1_word_ptx(v, u1) == word_of(e2m1_encode(torch.from_numpy(v)).numpy())


def philox4x32_reference(c0: int, c1: int, k0: int, k1: int, rounds: int):
    c = [c0, c1, 0, 0]
    for i in range(rounds):
        p0, p2 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p2 >> 32) ^ c[1] ^ k0, p2 & M32, (p0 >> 32) ^ c[3] ^ k1, p0 & M32]
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c


@pytest.mark.parametrize("rounds", [10, 7])
def test_philox_block_is_philox4x32(rounds):
    asm = (jn.PHILOX_10_ASM if rounds == 10 else jn.PHILOX_7_ASM).value
    rng = np.random.default_rng(rounds)
    for _ in range(50):
        c0, c1, k0, k1 = (int(x) for x in rng.integers(0, 2**32, 4, dtype=np.uint64))
        regs = run_ptx(asm, {"$4": c0, "$5": c1, "$6": k0, "$7": k1})
        assert [regs[f"${i}"] for i in range(4)] == philox4x32_reference(c0, c1, k0, k1, rounds)
    # the published known-answer vector of Philox4x32-10 (Random123 kat_vectors: counter 0, key 0)
    if rounds == 10:
        regs = run_ptx(asm, {"$4": 0, "$5": 0, "$6": 0, "$7": 0})
        assert [regs[f"${i}"] for i in range(4)] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


def test_uniform_merge_block_puts_16_random_bits_under_the_exponent_of_one():
    asm = jn.UNIFORM_MERGE_ASM.value
    for w in (0, M32, 0x12345678, 0x80000001):
        out = run_ptx(asm, {"$1": w, "$2": 0x3F800040})["$0"]
        assert out == (w & 0x7FFF80) | 0x3F800040
        assert 1.0 < float(_f32(out)) < 2.0
