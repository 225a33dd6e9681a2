"""reference.scaled_fp4_experts_quant and silu_and_mul_scaled_fp4_experts_quant layouts."""

import pytest
import torch

from nvfp4_plugin import numerics as nx
from nvfp4_plugin import reference as ref


def make_offsets(counts):
    return torch.tensor([0] + list(counts)).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("counts,k", [([5, 0, 130, 1, 0], 64), ([0, 0, 3], 48), ([128], 2048), ([1] * 9, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_experts_quant_equals_per_expert_dense_quant(counts, k, dtype):
    m, e = sum(counts), len(counts)
    g = torch.Generator().manual_seed(m + k)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    gs = torch.rand(e, generator=g) * 500 + 1
    eo = make_offsets(counts)
    bo = nx.blockscale_offsets_from_expert_offsets(eo)
    packed, scales = ref.scaled_fp4_experts_quant(x, gs, eo, bo)
    kb = k // 16
    assert packed.shape == (m, k // 2)
    assert scales.shape == (nx.max_blockscale_rows(m, e), nx.round_up(kb, 4)) and scales.dtype == torch.float8_e4m3fn
    lin = nx.unswizzle_blockscale(scales, scales.shape[0], scales.shape[1]).view(torch.uint8)
    used = torch.zeros(scales.shape[0], dtype=torch.bool)
    for ex in range(e):
        lo, hi = eo[ex].item(), eo[ex + 1].item()
        p, s = ref.scaled_fp4_quant(x[lo:hi], gs[ex:ex + 1], swizzle=False)
        assert torch.equal(packed[lo:hi], p)
        b = bo[ex].item()
        assert b % 128 == 0
        assert torch.equal(lin[b:b + hi - lo, :kb], s.view(torch.uint8))
        # each expert's block is its own swizzled matrix
        blk = scales.view(torch.uint8)[b:b + nx.round_up(hi - lo, 128)]
        assert torch.equal(blk, nx.swizzle_blockscale(s).view(torch.uint8)) if hi > lo else True
        used[b:b + hi - lo] = True
    assert (lin[~used] == 0).all() and (lin[:, kb:] == 0).all()


def test_experts_quant_rows_past_last_offset_stay_zero():
    x = torch.randn(10, 32)
    eo = torch.tensor([0, 4, 7], dtype=torch.int32)  # rows 7..9 belong to no expert
    packed, _ = ref.scaled_fp4_experts_quant(x, torch.tensor([1.0, 2.0]), eo, nx.blockscale_offsets_from_expert_offsets(eo))
    assert (packed[7:] == 0).all() and (packed[:7] != 0).any()


def test_experts_quant_argument_errors():
    x = torch.randn(8, 32)
    eo = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"input_global_scale: expected shape \(1,\)"):
        ref.scaled_fp4_experts_quant(x, torch.tensor([1.0, 2.0]), eo, eo)
    with pytest.raises(ValueError, match=r"blockscale_offsets: expected shape \(2,\)"):
        ref.scaled_fp4_experts_quant(x, torch.tensor([1.0]), eo, torch.tensor([0, 128, 256], dtype=torch.int32))
    with pytest.raises(TypeError, match="expert_offsets: expected dtype int32 or int64, got float32"):
        ref.scaled_fp4_experts_quant(x, torch.tensor([1.0]), eo.float(), eo)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("max_m,i", [(8, 64), (130, 48), (256, 256)])
def test_masked_silu_quant(dtype, max_m, i):
    e = 4
    g = torch.Generator().manual_seed(max_m * i)
    x = (torch.randn(e, max_m, 2 * i, generator=g) * 2).to(dtype)
    gs = torch.rand(e, generator=g) * 100 + 1
    mask = torch.tensor([0, 1, max_m // 2 + 1, max_m + 5], dtype=torch.int32)  # empty, one, partial, over-full
    sentinel_out = torch.full((e, max_m, i // 2), 0xAB, dtype=torch.uint8)
    kb = i // 16
    sw_shape = (e, *nx.swizzled_scale_shape(max_m, kb))
    sentinel_scale = torch.full(sw_shape, 0x3C, dtype=torch.uint8).view(torch.float8_e4m3fn)
    out, scales = ref.silu_and_mul_scaled_fp4_experts_quant(x, gs, mask, output=sentinel_out.clone(),
                                                            output_scale=sentinel_scale.clone())
    act = nx.silu_and_mul_fp32(x)
    lin = nx.unswizzle_blockscale(scales, sw_shape[1], sw_shape[2]).view(torch.uint8)
    for ex in range(e):
        valid = min(mask[ex].item(), max_m)
        p, s = ref.scaled_fp4_quant(act[ex, :valid], gs[ex:ex + 1], swizzle=False) if valid else (None, None)
        if valid:
            assert torch.equal(out[ex, :valid], p)
            assert torch.equal(lin[ex, :valid, :kb], s.view(torch.uint8))
        assert (out[ex, valid:] == 0xAB).all()            # rows past the mask are untouched
        assert (lin[ex, valid:] == 0x3C).all()
        assert (lin[ex, :, kb:] == 0x3C).all()
    # with fresh outputs, the untouched parts are zero
    out0, scales0 = ref.silu_and_mul_scaled_fp4_experts_quant(x, gs, mask)
    assert (out0[0] == 0).all() and (scales0[0].view(torch.uint8) == 0).all()
    assert torch.equal(out0[3], out[3])


def test_masked_without_silu_is_plain_per_expert_quant():
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    gs = torch.tensor([3.0, 40.0])
    mask = torch.tensor([16, 16], dtype=torch.int32)
    out, scales = ref.silu_and_mul_scaled_fp4_experts_quant(x, gs, mask, use_silu_and_mul=False)
    for ex in range(2):
        p, s = ref.scaled_fp4_quant(x[ex], gs[ex:ex + 1])
        assert torch.equal(out[ex], p) and torch.equal(scales[ex].view(torch.uint8), s.view(torch.uint8))


def test_silu_and_mul_reference_op():
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(ref.silu_and_mul(x), nx.silu_and_mul_fp32(x))
    with pytest.raises(ValueError, match="input: last dim"):
        ref.silu_and_mul(torch.randn(3, 63))
