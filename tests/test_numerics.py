"""The format definitions themselves: E2M1, E4M3, E8M0, packing, swizzle, MoE offsets, SiLU."""

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nvfp4_plugin import numerics as nx

from .helpers import brute_e2m1, brute_e4m3_byte, loop_swizzle


def f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def next_up(v: float) -> float:
    return torch.nextafter(torch.tensor(v, dtype=torch.float32), torch.tensor(math.inf)).item()


def next_down(v: float) -> float:
    return torch.nextafter(torch.tensor(v, dtype=torch.float32), torch.tensor(-math.inf)).item()


# ---------------------------------------------------------------------------------------- E2M1

def test_e2m1_all_16_codes_decode_and_roundtrip():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = nx.e2m1_decode(codes)
    assert vals.tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.signbit(vals[8])  # code 8 is negative zero
    assert torch.equal(nx.e2m1_encode(vals), codes)


@pytest.mark.parametrize("mid,expected", [
    (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)])
def test_e2m1_ties_go_to_even_code(mid, expected):
    x = torch.tensor([mid, -mid])
    assert nx.e2m1_encode(x).tolist() == [expected, expected | 8]
    # one ulp either side of the midpoint rounds to the nearer neighbour
    below, above = next_down(mid), next_up(mid)
    lo_code = [i for i, m in enumerate(nx.E2M1_MAGNITUDES) if m < mid][-1]
    hi_code = lo_code + 1
    assert nx.e2m1_encode(torch.tensor([below, above])).tolist() == [lo_code, hi_code]


def test_e2m1_saturation_sign_of_zero_nan():
    x = torch.tensor([6.0, 6.5, 1e30, math.inf, -math.inf, -0.1, -0.0, 0.0, math.nan, -math.nan, 5.0000005])
    assert nx.e2m1_encode(x).tolist() == [7, 7, 7, 7, 15, 8, 8, 0, 0, 0, 7]


@settings(max_examples=400, deadline=None)
@given(st.floats(width=32, allow_nan=True, allow_infinity=True))
def test_e2m1_matches_brute_force_nearest(v):
    assert nx.e2m1_encode(torch.tensor([v], dtype=torch.float32)).item() == brute_e2m1(v)


def test_e2m1_dense_sweep_matches_brute_force():
    xs = torch.linspace(-7, 7, 20001)
    xs = torch.cat([xs, torch.tensor([m + d for m in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0) for d in (-1e-7, 0, 1e-7)])])
    got = nx.e2m1_encode(xs).tolist()
    assert got == [brute_e2m1(v) for v in xs.tolist()]


def test_pack_nibble_order():
    codes = torch.tensor([[1, 2, 0xF, 0x8]], dtype=torch.uint8)
    packed = nx.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x8F]]  # element 0 low nibble, element 1 high nibble
    assert torch.equal(nx.unpack_fp4(packed), codes)


@given(st.lists(st.integers(0, 15), min_size=2, max_size=64).filter(lambda l: len(l) % 2 == 0))
def test_pack_unpack_roundtrip(codes):
    c = torch.tensor(codes, dtype=torch.uint8)
    assert torch.equal(nx.unpack_fp4(nx.pack_fp4(c)), c)


# ---------------------------------------------------------------------------------------- E4M3

def test_e4m3_all_codes_roundtrip():
    b = torch.arange(256, dtype=torch.uint8)
    b = b[(b & 0x7F) != 0x7F]  # skip NaNs
    vals = b.view(torch.float8_e4m3fn).float()
    assert torch.equal(nx.e4m3_saturate(vals).view(torch.uint8), b)


@pytest.mark.parametrize("v,byte", [
    (448.0, 0x7E), (464.0, 0x7E), (1e9, 0x7E), (math.inf, 0x7E), (-math.inf, 0xFE),  # saturate
    (2.0 ** -9, 0x01),                        # smallest subnormal
    (2.0 ** -10, 0x00),                       # tie between 0 and 2^-9 -> even (0)
    (3 * 2.0 ** -10, 0x02),                   # tie between 2^-9 and 2^-8 -> even (2^-8)
    (7 * 2.0 ** -9, 0x07), (2.0 ** -6, 0x08),  # largest subnormal, smallest normal
    (1.0625, 0x38),                           # tie 1 / 1.125 -> even mantissa (1.0)
    (1.1875, 0x3A),                           # tie 1.125 / 1.25 -> 1.25
    (-0.0, 0x80), (math.nan, 0x7F), (-math.nan, 0x7F)])  # NaN: canonical +NaN, whatever its sign
def test_e4m3_rounding_cases(v, byte):
    got = nx.e4m3_saturate(torch.tensor([v])).view(torch.uint8).item()
    assert got == byte == brute_e4m3_byte(v)


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=-1000, max_value=1000, width=32))
def test_e4m3_matches_brute_force(v):
    assert nx.e4m3_saturate(torch.tensor([v])).view(torch.uint8).item() == brute_e4m3_byte(v)


# ---------------------------------------------------------------------------------------- E8M0 / log2

@pytest.mark.parametrize("x", [2.0 ** -149, 2.0 ** -140, 3 * 2.0 ** -140, 2.0 ** -127, 2.0 ** -126, 0.75, 1.0,
                               1.0000001, 3.0, 2.0 ** 127, 3.4e38])
def test_log2_exponents_exact(x):
    t = torch.tensor([x], dtype=torch.float32)
    xv = t.item()
    floor = math.floor(math.log2(xv)) if xv > 0 else None
    ceil = math.ceil(math.log2(xv))
    # guard against log2 rounding at exact powers of two
    m, e = math.frexp(xv)
    floor, ceil = e - 1, (e - 1 if m == 0.5 else e)
    assert nx.floor_log2_exponent(t).item() == floor
    assert nx.ceil_log2_exponent(t).item() == ceil
    assert 2.0 ** ceil >= xv > 2.0 ** (ceil - 1)


def test_ue8m0_decode():
    b = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    v = nx.ue8m0_to_float(b)
    assert v[:6].tolist() == [2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0, 2.0 ** 127]
    assert math.isnan(v[6].item())


# ---------------------------------------------------------------------------------------- swizzle

@pytest.mark.parametrize("m,kb", [(1, 1), (7, 3), (128, 4), (130, 5), (257, 12), (64, 448 // 16)])
def test_swizzle_matches_offset_formula_and_pads_zero(m, kb):
    lin = torch.randint(1, 256, (m, kb), dtype=torch.uint8)  # nonzero, so padding is distinguishable
    sw = nx.swizzle_blockscale(lin)
    assert sw.shape == nx.swizzled_scale_shape(m, kb) == (nx.round_up(m, 128), nx.round_up(kb, 4))
    assert torch.equal(sw, loop_swizzle(lin))
    flat = sw.reshape(-1)
    written = torch.zeros_like(flat, dtype=torch.bool)
    mi, ki = torch.meshgrid(torch.arange(m), torch.arange(kb), indexing="ij")
    written[nx.swizzled_offset(mi, ki, kb).reshape(-1)] = True
    assert written.sum() == m * kb            # the formula is a bijection onto m*kb bytes
    assert (flat[~written] == 0).all()         # and everything else is zero padding
    assert torch.equal(nx.unswizzle_blockscale(sw, m, kb), lin)


def test_swizzle_known_offsets():
    # row 33, col 5 of a 2-tile-wide matrix: tile (0, 1), (m%32)*16 = 16, ((m//32)%4)*4 = 4, k%4 = 1
    assert nx.swizzled_offset(33, 5, 8) == 512 + 16 + 4 + 1
    assert nx.swizzled_offset(128, 0, 8) == 2 * 512  # next row tile skips both column tiles


def test_swizzle_keeps_fp8_dtype_and_leading_dims():
    lin = torch.randn(3, 5, 6).to(torch.float8_e4m3fn)
    sw = nx.swizzle_blockscale(lin)
    assert sw.dtype == torch.float8_e4m3fn and sw.shape == (3, 128, 8)
    for e in range(3):
        assert torch.equal(sw[e].view(torch.uint8), nx.swizzle_blockscale(lin[e]).view(torch.uint8))
    assert torch.equal(nx.unswizzle_blockscale(sw, 5, 6).view(torch.uint8), lin.view(torch.uint8))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(1, 20))
def test_swizzle_roundtrip_property(m, kb):
    lin = torch.randint(0, 256, (m, kb), dtype=torch.uint8)
    sw = nx.swizzle_blockscale(lin)
    i, j = m - 1, kb - 1
    assert sw.reshape(-1)[nx.swizzled_offset(i, j, kb)] == lin[i, j]
    assert torch.equal(nx.unswizzle_blockscale(sw, m, kb), lin)


# ---------------------------------------------------------------------------------------- MoE offsets

def test_blockscale_offsets_round_each_expert_to_128():
    expert_offsets = torch.tensor([0, 0, 5, 5, 133, 389], dtype=torch.int32)  # experts 0 and 2 empty
    got = nx.blockscale_offsets_from_expert_offsets(expert_offsets)
    assert got.dtype == torch.int32
    assert got.tolist() == [0, 0, 128, 128, 256, 512]
    assert got[-1] <= nx.max_blockscale_rows(389, 5)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=40))
def test_max_blockscale_rows_is_an_upper_bound(counts):
    offs = torch.tensor([0] + counts).cumsum(0)
    bs = nx.blockscale_offsets_from_expert_offsets(offs)
    assert bs[-1].item() <= nx.max_blockscale_rows(sum(counts), len(counts))
    assert all(b % 128 == 0 for b in bs.tolist())


def test_max_blockscale_rows_is_reached_and_tight_for_few_rows():
    # a decode step: 8 rows over 256 experts, at most 8 experts with rows, each padded to 128
    assert nx.max_blockscale_rows(8, 256) == 1024
    worst = torch.tensor([0] + [1] * 8 + [0] * 248).cumsum(0)
    assert nx.blockscale_offsets_from_expert_offsets(worst)[-1].item() == 1024
    # more rows than experts: every expert can carry 127 padding rows
    assert nx.max_blockscale_rows(4096, 8) == 4096 + 8 * 128
    assert nx.max_blockscale_rows(0, 8) == 0


# ---------------------------------------------------------------------------------------- SiLU

def test_exp_fp32_accuracy_and_limits():
    y = torch.linspace(-87.3, 88.5, 400001)
    got = nx.exp_fp32(y).double()
    ref = torch.exp(y.double())
    assert (((got - ref) / ref).abs() * 2 ** 23).max() < 3  # within 3 ulp
    assert nx.exp_fp32(torch.tensor([89.0])).item() == math.inf
    assert math.isnan(nx.exp_fp32(torch.tensor([math.nan])).item())


def test_silu_fp32_values():
    g = torch.tensor([0.0, 1.0, -1.0, 20.0, -20.0, 100.0, -100.0, math.inf])
    got = nx.silu_fp32(g)
    ref = g.double() / (1 + torch.exp(-g.double()))
    assert torch.allclose(got[:6].double(), ref[:6], rtol=3e-7, atol=0)
    # exp(100) overflows fp32, so silu(-100) = -100 / inf = -0 (true value -3.7e-42, below bf16 use)
    assert got[6].item() == 0.0 and torch.signbit(got[6])
    assert got[7].item() == math.inf


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_rounds_once_to_input_dtype(dtype):
    x = (torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    got = nx.silu_and_mul_fp32(x)
    assert got.dtype == dtype
    gate, up = x[:, :128].double(), x[:, 128:].double()
    exact = gate / (1 + torch.exp(-gate)) * up
    # fp32 evaluation then one rounding: at most one unit in the last place of dtype away from exact
    ulp = torch.finfo(dtype).eps * exact.abs().clamp(min=torch.finfo(dtype).tiny)
    assert ((got.double() - exact).abs() <= ulp * 1.0001).all()


def test_fp32_div_is_one_rounding():
    a = torch.rand(100000, generator=torch.Generator().manual_seed(0)) * 100 + 0.01
    expect = torch.tensor([2688.0 / v for v in a.double().tolist()], dtype=torch.float64).float()
    assert torch.equal(nx.fp32_div(2688.0, a), expect)  # double division rounded once is correctly rounded
    assert torch.equal(nx.global_scale_from_amax(a), expect)
