"""Hopper FP4-weight layout: prepack / unpack is exact, scale re-encoding and decode are exact."""

import pytest
import torch

from nvfp4_plugin import numerics as nx
from nvfp4_plugin.gemm import layout as L
from nvfp4_plugin.weights import Nvfp4Weight

E2M1_NONZERO = [v for v in nx.E2M1_MAGNITUDES if v]
ALL_E4M3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn)   # +0 .. 448


def random_canonical(lead, n, k, gen, zero_scale_frac=0.1):
    """Arbitrary canonical weight: random bytes, random valid scales (all e4m3 values), some zero scales."""
    packed = torch.randint(0, 256, (*lead, n, k // 2), generator=gen, dtype=torch.int64).to(torch.uint8)
    idx = torch.randint(0, 127, (*lead, n, k // 16), generator=gen)
    idx = torch.where(torch.rand(idx.shape, generator=gen) < zero_scale_frac, torch.zeros_like(idx), idx)
    scales = ALL_E4M3[idx]
    gs = torch.rand((*lead, n), generator=gen) * 100 + 0.01
    return Nvfp4Weight(packed, scales, gs)


@pytest.mark.parametrize("act_dtype", L.ACT_DTYPES)
def test_bit_plan_uses_each_word_bit_once(act_dtype):
    src = L._source_bits(act_dtype)
    assert sorted(b for o in src for h in o for b in h) == list(range(32))


@pytest.mark.parametrize("act_dtype", L.ACT_DTYPES)
@pytest.mark.parametrize("lead,n,k", [((), 1, 16), ((), 7, 48), ((), 64, 64), ((), 130, 208), ((3,), 70, 96),
                                      ((2,), 128, 256)])
def test_prepack_unpack_exact(act_dtype, lead, n, k):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = random_canonical(lead, n, k, gen)
    p = L.prepack(w, act_dtype)
    assert p.layout.n == n and p.layout.k == k and p.layout.lead_shape == lead
    assert p.words.shape == (max(1, p.layout.num_experts), p.layout.n_pad // 2, p.layout.k_pad // 4)
    assert p.scales.stride(1) * 2 % 16 == 0  # rows of scale pairs start on 16 bytes
    u = L.unpack(p)
    assert torch.equal(u.packed, w.packed)
    assert torch.equal(u.block_scale.view(torch.uint8), w.block_scale.view(torch.uint8))
    assert torch.equal(u.global_scale, w.global_scale)
    # round trip through the tensor dict too (what a layer registers as buffers)
    p2 = L.PackedW4Weight.from_tensors(p.layout, p.tensors())
    assert torch.equal(L.unpack(p2).packed, w.packed)


def test_prepack_of_quantized_weight_and_expert_view():
    gen = torch.Generator().manual_seed(1)
    w = Nvfp4Weight.quantize(torch.randn(3, 40, 80, generator=gen))
    p = L.prepack(w)
    for e in range(3):
        pe = p.expert(e)
        ue = L.unpack(pe)
        assert torch.equal(ue.packed, w.packed[e]) and torch.equal(ue.global_scale, w.global_scale[e])


def test_alpha_const_only_for_one_global_scale():
    """The cuBLAS large-M path takes ``layout.alpha_const`` as its scalar alpha: set exactly when
    every row of a dense weight shares the global scale, to the value of ``alpha``."""
    gen = torch.Generator().manual_seed(2)
    w = Nvfp4Weight.quantize(torch.randn(40, 64, generator=gen))
    p = L.prepack(w)
    assert p.layout.alpha_const == float(p.alpha[0, 0]) == float(2 ** L.SCALE_SHIFT / w.global_scale[0])
    assert torch.all(p.alpha[0, :40] == p.layout.alpha_const)
    shards = Nvfp4Weight.from_shards(w.packed, w.block_scale, [100.0, 300.0], [24, 16])
    assert L.prepack(shards).layout.alpha_const is None
    experts = L.prepack(Nvfp4Weight.quantize(torch.randn(2, 40, 64, generator=gen)))
    assert experts.layout.alpha_const is None and experts.expert(0).layout.alpha_const is None


def test_scale_codes_cover_every_e4m3_value():
    codes = L.encode_scale_codes(ALL_E4M3)
    assert torch.equal(L.decode_scale_codes(codes).view(torch.uint8), ALL_E4M3.view(torch.uint8))
    assert int(codes[0]) == 0 and int(codes[1:].min()) > 0 and int(codes.max()) < 256
    nz = ALL_E4M3[1:].float()
    assert torch.equal(L.expand_scale_code(codes[1:], torch.bfloat16).float(), nz * 2.0 ** 118)
    assert torch.equal(L.expand_scale_code(codes, torch.float16).float(), ALL_E4M3.float() * 2.0 ** 6)


@pytest.mark.parametrize("act_dtype", L.ACT_DTYPES)
def test_decoded_products_are_exact(act_dtype):
    """Every e2m1 * s * 2**-8 is exactly representable in the activation dtype (the kernel's A operand)."""
    s = ALL_E4M3.float()[:, None]
    v = torch.tensor(E2M1_NONZERO)[None, :]
    p = v * s * 2.0 ** -L.SCALE_SHIFT
    assert torch.equal(p.to(act_dtype).float(), p)
    # and the bit trick: code bits placed per the plan times the expanded scale gives the same
    mag, sign, _ = L.BIT_PLANS[act_dtype]
    bias = 126 if act_dtype == torch.bfloat16 else 14
    for code in range(16):
        bits = (((code >> 3) & 1) << sign) | sum(((code >> b) & 1) << mag[b] for b in range(3))
        val = torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(act_dtype).double() * 2.0 ** bias
        assert val.item() == nx.E2M1_VALUES[code] or (code == 8 and val.item() == 0.0)


def test_prepack_rejects_bad_scales():
    w = Nvfp4Weight.quantize(torch.randn(16, 32))
    bad = w.block_scale.clone()
    bad.view(torch.uint8)[0, 0] = 0x85  # negative
    with pytest.raises(ValueError, match="block_scale"):
        L.prepack(Nvfp4Weight(w.packed, bad, w.global_scale))
    with pytest.raises(ValueError, match="act_dtype"):
        L.prepack(w, torch.float32)


@pytest.mark.parametrize("act_dtype", L.ACT_DTYPES)
def test_zero_scale_blocks_are_zeroed_and_restored(act_dtype):
    w = Nvfp4Weight.quantize(torch.randn(64, 64))
    bs = w.block_scale.clone()
    bs[3, 1] = 0
    bs[60, 3] = 0
    w0 = Nvfp4Weight(w.packed, bs, w.global_scale)
    p = L.prepack(w0, act_dtype)
    assert p.zero_blocks.numel() == 2
    codes = L._words_to_codes(p.words, act_dtype)[0]
    assert not codes[3, 16:32].any() and not codes[60, 48:64].any()
    assert torch.equal(L.unpack(p).packed, w.packed)


@pytest.mark.parametrize("act_dtype", L.ACT_DTYPES)
@pytest.mark.parametrize("chunk_experts", [1, 2, 3])
def test_prepack_in_expert_groups_equals_one_group(monkeypatch, act_dtype, chunk_experts):
    """Experts are converted a group at a time (PREPACK_CHUNK_CODES): every group size, a last group
    shorter than the others, and zero-scale blocks in later groups (their flat indices carry the group's
    offset) give the bytes of one group of all experts."""
    gen = torch.Generator().manual_seed(7)
    w = random_canonical((5,), 70, 96, gen, zero_scale_frac=0.3)
    one = L.prepack(w, act_dtype)
    lay = one.layout
    monkeypatch.setattr(L, "PREPACK_CHUNK_CODES", chunk_experts * lay.n_pad * lay.k_pad)
    grouped = L.prepack(w, act_dtype)
    assert (one.zero_blocks // (70 * 96 // 16)).unique().numel() == 5   # zero blocks in every expert
    for name in ("words", "scales", "alpha", "global_scale", "zero_blocks", "zero_codes"):
        assert torch.equal(getattr(grouped, name), getattr(one, name)), name
    assert torch.equal(L.unpack(grouped).packed, w.packed)


def test_layout_is_hashable_metadata():
    lay = L.HopperW4Layout(torch.bfloat16, 100, 208, (4,))
    assert lay.n_pad == 128 and lay.k_pad == 256 and lay.num_experts == 4
    assert hash(lay) == hash(L.HopperW4Layout(torch.bfloat16, 100, 208, (4,)))
    assert {lay: 1}[L.HopperW4Layout(torch.bfloat16, 100, 208, (4,))] == 1


def test_words_layout_matches_the_documented_fragment():
    """Spot-check the docstring's address formula: row pair i, column 16*(k//64) + 4*c + j."""
    n, k = 128, 128
    codes = torch.zeros((1, n, k), dtype=torch.uint8)
    for r, kk, val in [(0, 0, 1), (8, 0, 2), (17, 9, 3), (64 + 25, 64 + 16 * 2 + 8 + 2 * 3 + 1, 5)]:
        codes[0, r, kk] = val
    words = L._codes_to_words(codes, torch.bfloat16)
    back = L._words_to_codes(words, torch.bfloat16)
    assert torch.equal(back, codes)
    # row 64+25 -> na=1, w=1, h=1, g=1 -> i = 32 + 8 + 1; k -> ka=1, j=2, kh=1, c=3, e=1 -> col 16+12+2
    nz = torch.nonzero(words[0]).tolist()
    # rows 0 and 8 share row pair 0 (word [0, 0]); row 17, k 9 -> i = 8*1 + 1, col 0
    assert sorted(nz) == [[0, 0], [9, 0], [41, 30]]
