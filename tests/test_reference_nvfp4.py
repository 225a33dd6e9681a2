"""reference.scaled_fp4_quant / dequantize_fp4: the peers' recipe, boundaries, special values, layouts."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nvfp4_plugin import numerics as nx
from nvfp4_plugin import reference as ref

from .helpers import brute_e2m1, brute_e4m3_byte, peer_ref_nvfp4_quant, values_to_codes

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def quant_linear(x, gs, **kw):
    return ref.scaled_fp4_quant(x, gs, swizzle=False, **kw)


def assert_same_as_peer(x, gs):
    """Our bytes vs the peers' recipe: identical scales; identical E2M1 magnitudes; our sign rule."""
    packed, scales = quant_linear(x, gs)
    pv, ps = peer_ref_nvfp4_quant(x, gs)
    assert torch.equal(scales.view(torch.uint8), ps.view(torch.uint8))
    codes = nx.unpack_fp4(packed)
    pcodes = values_to_codes(pv)
    assert torch.equal(codes & 7, pcodes & 7)
    # sign: always the input's sign bit (signed zeros included); equals the peer's wherever the
    # peer's value is nonzero (the peer returns floats, where -0 and +0 compare equal)
    assert torch.equal(codes >> 3, torch.signbit(x.float()).to(torch.uint8))
    nz = pv != 0
    assert torch.equal((codes >> 3)[nz], (pcodes >> 3)[nz])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(1, 16), (3, 48), (17, 64), (128, 80), (130, 2048), (256, 7168)])
def test_random_inputs_match_peer_recipe(dtype, m, k):
    g = torch.Generator().manual_seed(m * 7919 + k)
    x = (torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g) * 3)).to(dtype)
    for gs in (nx.tensor_global_scale(x).reshape(1), torch.tensor([1.0]), torch.tensor([0.0371]),
               torch.tensor([6.2e4])):
        assert_same_as_peer(x, gs)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, width=32), min_size=16, max_size=16),
       st.floats(0.0009765625, 1048576.0, width=32))
def test_hypothesis_blocks_match_peer_recipe(block, gs):
    x = torch.tensor([block], dtype=torch.float32)
    x = torch.where(x == 0, torch.zeros_like(x), x)  # canonical +0 (the peer cannot express -0)
    assert_same_as_peer(x, torch.tensor([gs], dtype=torch.float32))


# Scales S exactly representable in e4m3 (normal and subnormal) with gs = 1: the block max 6*S maps
# to s == S, out_scale == 1/S, and x * out_scale is exact, so element values hit each boundary exactly.
@pytest.mark.parametrize("S", [1.0, 0.5, 1.5, 0.875, 2.0 ** -6, 3 * 2.0 ** -9, 2.0 ** -9, 64.0, 448.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_boundary_and_its_neighbours(S, dtype):
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    vals = []
    for mval in mids:
        t = torch.tensor(mval * S, dtype=dtype)
        lo = torch.nextafter(t, torch.tensor(-math.inf, dtype=dtype)) if dtype == torch.float32 else \
            (t.float() - t.float() * 2 ** -8).to(dtype)
        hi = torch.nextafter(t, torch.tensor(math.inf, dtype=dtype)) if dtype == torch.float32 else \
            (t.float() + t.float() * 2 ** -8).to(dtype)
        vals += [t, lo, hi]
    vals = torch.stack(vals).float()
    n = nx.round_up(vals.numel(), 15)
    blocks = torch.zeros(n // 15, 16)
    blocks[:, 0] = 6 * S
    blocks[:, 1:].reshape(-1)[:vals.numel()] = vals
    x = torch.cat([blocks, -blocks]).to(dtype)
    gs = torch.tensor([1.0])
    packed, scales = quant_linear(x, gs)
    s_expect = brute_e4m3_byte(S)
    assert (scales.view(torch.uint8) == s_expect).all()
    out_scale = 1.0 / (scales.float()[0, 0].item() * 1.0)
    codes = nx.unpack_fp4(packed).reshape(-1).tolist()
    expect = [brute_e2m1(min(max(v * out_scale, -6.0), 6.0)) for v in x.float().reshape(-1).tolist()]
    assert codes == expect
    assert_same_as_peer(x, gs)


def test_special_values_policy():
    base = torch.linspace(-3, 3, 16)
    x = base.repeat(6, 1)
    x[1, 3] = math.nan                       # NaN: does not change the scale, encodes as 0
    x[2, :] = math.nan                       # all NaN: scale 0, codes 0
    x[3, 5] = math.inf                       # +Inf: scale saturates at 448, element at +6
    x[4, 7] = -math.inf
    x[5, :] = 0.0                            # all zero: scale 0, codes 0
    gs = torch.tensor([100.0])
    packed, scales = quant_linear(x, gs)
    codes = nx.unpack_fp4(packed)
    sb = scales.view(torch.uint8)[:, 0]
    assert sb[1] == sb[0]
    assert codes[1, 3] == 0
    assert torch.equal(codes[1, :3], codes[0, :3]) and torch.equal(codes[1, 4:], codes[0, 4:])
    assert sb[2] == 0 and (codes[2] == 0).all()
    assert scales[3, 0].float() == 448 and codes[3, 5] == 7
    assert scales[4, 0].float() == 448 and codes[4, 7] == 15
    assert sb[5] == 0 and (codes[5] == 0).all()
    # values other than the Inf in the saturated block scale by 448/gs
    out_scale = 1 / (448 * (1 / 100.0))
    assert codes[3, 0].item() == brute_e2m1(max(-6.0, -3 * out_scale))


def test_negative_values_that_round_to_zero_keep_the_sign():
    x = torch.zeros(1, 16)
    x[0, 0] = 6.0
    x[0, 1] = -0.1
    x[0, 2] = -0.0
    codes = nx.unpack_fp4(quant_linear(x, torch.tensor([1.0]))[0])[0]
    assert codes[:4].tolist() == [7, 8, 8, 0]


def test_tiny_blocks_get_subnormal_or_zero_scales():
    gs = torch.tensor([1.0])
    for vmax, byte in [(6 * 2.0 ** -9, 0x01), (6 * 3 * 2.0 ** -9, 0x03), (6 * 2.0 ** -10, 0x00), (6 * 1e-5, 0x00)]:
        x = torch.full((1, 16), vmax)
        x[0, 1:] = -vmax / 2
        packed, scales = quant_linear(x, gs)
        assert scales.view(torch.uint8)[0, 0] == byte
        codes = nx.unpack_fp4(packed)[0]
        if byte == 0:  # zero scale: everything quantizes to (signed) zero
            assert codes[0] == 0 and (codes[1:] == 8).all()
        else:
            assert codes[0] == 7


@pytest.mark.parametrize("m,k", [(1, 16), (5, 48), (130, 80), (300, 1024)])
def test_swizzled_output_is_swizzle_of_linear(m, k):
    x = torch.randn(m, k, dtype=torch.bfloat16)
    gs = nx.tensor_global_scale(x).reshape(1)
    p1, s1 = ref.scaled_fp4_quant(x, gs, swizzle=True)
    p2, s2 = ref.scaled_fp4_quant(x, gs, swizzle=False)
    assert torch.equal(p1, p2)
    assert s1.shape == (nx.round_up(m, 128), nx.round_up(k // 16, 4)) and s2.shape == (m, k // 16)
    assert torch.equal(s1.view(torch.uint8), nx.swizzle_blockscale(s2).view(torch.uint8))
    # padding rows and columns are zero
    lin_full = nx.unswizzle_blockscale(s1, s1.shape[0], s1.shape[1]).view(torch.uint8)
    assert (lin_full[m:] == 0).all() and (lin_full[:, k // 16:] == 0).all()


@pytest.mark.parametrize("swizzle", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_is_exact(swizzle, dtype):
    m, k = 37, 96
    x = torch.randn(m, k).to(dtype)
    gs = nx.tensor_global_scale(x).reshape(1)
    packed, scales = ref.scaled_fp4_quant(x, gs, swizzle=swizzle)
    got = ref.dequantize_fp4(packed, scales, gs, swizzled=swizzle, m=m, k=k)
    lin = scales if not swizzle else nx.unswizzle_blockscale(scales, m, k // 16)
    expect = (nx.e2m1_decode(nx.unpack_fp4(packed)).reshape(m, k // 16, 16) * lin.float()[..., None]) / gs
    assert torch.equal(got, expect.reshape(m, k))
    # and the quantization error is what NVFP4 gives on Gaussian data (~10% relative RMS)
    err = (got - x.float()).norm() / x.float().norm()
    assert 0.05 < err < 0.15


def test_dequantize_per_expert_global_scale():
    w = torch.randn(3, 32, 64)
    gs = torch.stack([nx.tensor_global_scale(w[e]) for e in range(3)])
    parts = [ref.scaled_fp4_quant(w[e], gs[e:e + 1], swizzle=False) for e in range(3)]
    packed = torch.stack([p for p, _ in parts])
    scales = torch.stack([s for _, s in parts])
    got = ref.dequantize_fp4(packed, scales, gs, swizzled=False, m=32, k=64)
    for e in range(3):
        assert torch.equal(got[e], ref.dequantize_fp4(parts[e][0], parts[e][1], gs[e:e + 1], swizzled=False, m=32, k=64))


def test_ue8m0_scales_are_ceil_powers_of_two_and_never_saturate():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=g) * torch.exp(torch.randn(64, 1, generator=g) * 4)
    gs = nx.tensor_global_scale(x).reshape(1)
    packed, scales = quant_linear(x, gs, scale_format="ue8m0")
    assert scales.dtype == torch.uint8
    vmax = x.abs().reshape(64, 16, 16).amax(-1)
    raw = gs * (vmax * nx._ONE_SIXTH_F32)
    e = scales.to(torch.int32) - 127
    assert (torch.ldexp(torch.ones_like(raw), e) >= raw).all()
    assert (torch.ldexp(torch.ones_like(raw), e - 1) < raw).all()
    deq = ref.dequantize_fp4(packed, scales, gs, swizzled=False, m=64, k=256)
    # no element saturates: every error is at most half the local grid spacing (2 * 2^e / gs at most)
    step = torch.ldexp(torch.ones_like(raw), e).repeat_interleave(16, dim=1) / gs
    assert ((deq - x).abs() <= step + 1e-30).all()


def test_fake_quant_nvfp4_matches_quant_dequant():
    x = torch.randn(4, 8, 64, dtype=torch.bfloat16)
    gs = nx.tensor_global_scale(x).reshape(1)
    got = ref.fake_quant_nvfp4(x)
    packed, scales = ref.scaled_fp4_quant(x.reshape(32, 64), gs, swizzle=False)
    expect = ref.dequantize_fp4(packed, scales, gs, swizzled=False, m=32, k=64, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got.reshape(32, 64), expect)


def test_global_scale_from_amax():
    assert nx.tensor_global_scale(torch.tensor([[1.0, -4.0, math.nan, math.inf]])).item() == pytest.approx(672.0)
    assert nx.tensor_global_scale(torch.zeros(2, 16)).item() == 1.0


@pytest.mark.parametrize("bad,err", [
    (lambda: ref.scaled_fp4_quant(torch.randn(4, 24), torch.tensor([1.0])), "multiple of 16, got 24"),
    (lambda: ref.scaled_fp4_quant(torch.randn(4, 32).to(torch.int32), torch.tensor([1.0])), "dtype"),
    (lambda: ref.scaled_fp4_quant(torch.randn(4, 32), torch.tensor([1.0, 2.0])), "input_global_scale"),
    (lambda: ref.scaled_fp4_quant(torch.randn(4, 32), torch.tensor([1.0], dtype=torch.float64)),
     "input_global_scale: expected dtype float32, got float64"),
    (lambda: ref.scaled_fp4_quant(torch.randn(2, 4, 32), torch.tensor([1.0])), "input: expected 2 dims"),
])
def test_errors_name_the_argument(bad, err):
    with pytest.raises((ValueError, TypeError), match=err):
        bad()
