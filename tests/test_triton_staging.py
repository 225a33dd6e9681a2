"""DeepSeek-V4 MegaMoE input staging: Triton kernel vs the reference twin, layouts, validation.

CPU: Triton interpreter on small shapes; GPU: the fuzzed sizes of the issue (M 0/1/1000, K 128/7168,
top-k 1/6/8).
"""

import math

import pytest
import torch

from tests._require import require_triton_kernels

require_triton_kernels()

from nvfp4_plugin import numerics as nx  # noqa: E402
from nvfp4_plugin import reference as ref  # noqa: E402
from nvfp4_plugin.triton import staging  # noqa: E402

from .test_triton_nvfp4 import DEV, GPU, same_bits, special_input  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def make_inputs(m, k, top_k, *, dtype=torch.bfloat16, ids_dtype=torch.int32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = special_input(m, k, torch.float32, seed=seed).to(dtype) if m else torch.empty(0, k, dtype=dtype)
    w = torch.rand(m, top_k, generator=g)
    ids = torch.randint(0, 256, (m, top_k), generator=g, dtype=torch.int64).to(ids_dtype)
    return h, w, ids


def outputs(m, k, top_k, device, w_dtype=torch.float32):
    """Output buffers filled with garbage, so that every byte the op must write is checked."""
    return (torch.full((m, k // 2), 0xA5, dtype=torch.uint8, device=device),
            torch.full((m, k // 64), -1234567, dtype=torch.int32, device=device),
            torch.full((m, top_k), -7, dtype=torch.int64, device=device),
            torch.full((m, top_k), math.nan, dtype=w_dtype, device=device))


def stage_both(h, w, ids, w_out_dtype=torch.float32):
    m, k = h.shape
    top_k = ids.shape[1]
    out_t = outputs(m, k, top_k, DEV, w_out_dtype)
    staging.stage_deepseek_v4_mega_moe_inputs(h.to(DEV), w.to(DEV), ids.to(DEV), *out_t)
    out_r = outputs(m, k, top_k, "cpu", w_out_dtype)
    ref.stage_deepseek_v4_mega_moe_inputs(h, w, ids, *out_r)
    return [t.cpu() for t in out_t], out_r


def dequant(x_fp4, x_sf):
    """Unpack the staged tensors and dequantize: e2m1(q) * s (global scale 1)."""
    m, kh = x_fp4.shape
    s = ref.unpack_mega_moe_scales(x_sf)
    return ref.dequantize_fp4(x_fp4, s, torch.tensor(ref.MEGA_MOE_GLOBAL_SCALE), swizzled=False, m=m, k=kh * 2)


FUZZ = [(m, k, t) for m in (0, 1, 37) for k in (128, 384) for t in (1, 6, 8)] + \
       [pytest.param(m, k, t, marks=GPU) for m in (0, 1, 1000) for k in (128, 7168) for t in (1, 6, 8)]


@pytest.mark.parametrize("m,k,top_k", FUZZ)
def test_staging_matches_reference_and_dequantizes_like_it(m, k, top_k):
    h, w, ids = make_inputs(m, k, top_k, seed=m * 31 + k + top_k)
    (xq, xsf, idx, wo), (xq_r, xsf_r, idx_r, wo_r) = stage_both(h, w, ids)
    assert same_bits(xq, xq_r) and same_bits(xsf, xsf_r)
    assert same_bits(idx, idx_r) and same_bits(wo, wo_r)
    assert torch.equal(idx, ids.to(torch.int64)) and torch.equal(wo, w)
    if m:
        # unpacked and dequantized: equal to the reference NVFP4 dequantization of the same input
        q, s = ref.scaled_fp4_quant(h, torch.tensor([1.0]), swizzle=False)
        expect = ref.dequantize_fp4(q, s, torch.tensor([1.0]), swizzled=False, m=m, k=k)
        assert same_bits(dequant(xq, xsf), expect)


def test_scale_words_are_little_endian_groups():
    h = torch.zeros(2, 128)
    for g in range(8):
        h[:, g * 16] = 6.0 * (g + 1)  # group g gets scale g + 1 (exact in E4M3)
    h[1] *= 2.0 ** -8                  # second row: subnormal scales (g + 1) * 2**-8 ... and so on
    _, w, ids = make_inputs(2, 128, 2)
    (xq, xsf, _, _), (_, xsf_r, _, _) = stage_both(h, w, ids)
    assert same_bits(xsf, xsf_r)
    b = xsf.view(torch.uint8).reshape(2, 8)  # little-endian bytes of the two words per row
    assert torch.equal(b[0].view(torch.float8_e4m3fn).float(), torch.arange(1, 9).float())
    assert torch.equal(ref.unpack_mega_moe_scales(xsf), ref.scaled_fp4_quant(h, torch.tensor([1.0]),
                                                                            swizzle=False)[1])


def test_rounding_differs_from_the_seed_where_documented():
    """Ties go to even, -0.0 keeps its sign, a zero block has scale 0."""
    h = torch.zeros(2, 128)
    h[0, :8] = torch.tensor([6.0, 0.25, 1.25, 2.5, 5.0, 0.75, -0.1, -0.0])  # block scale 1
    _, w, ids = make_inputs(2, 128, 1)
    (xq, xsf, _, _), _ = stage_both(h, w, ids)
    codes = nx.unpack_fp4(xq)
    assert codes[0, :8].tolist() == [7, 0, 2, 4, 6, 2, 8, 8]  # the seed: [7, 1, 3, 5, 7, 2, 8, 0]
    assert (xsf[1] == 0).all() and (codes[1] == 0).all()     # the seed: amax floored at 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtypes_and_strided_outputs(dtype):
    h, w, ids = make_inputs(5, 256, 4, dtype=dtype, ids_dtype=torch.int64, seed=2)
    (xq, xsf, idx, wo), (xq_r, xsf_r, idx_r, wo_r) = stage_both(h, w, ids, w_out_dtype=torch.bfloat16)
    assert same_bits(xq, xq_r) and same_bits(xsf, xsf_r) and same_bits(wo, wo_r)
    # outputs that are views into bigger buffers (row strides larger than the row)
    big_q = torch.zeros(5, 256, dtype=torch.uint8, device=DEV)
    big_sf = torch.zeros(5, 8, dtype=torch.int32, device=DEV)
    big_i = torch.zeros(5, 8, dtype=torch.int64, device=DEV)
    big_w = torch.zeros(5, 8, dtype=torch.float32, device=DEV)
    staging.stage_deepseek_v4_mega_moe_inputs(h.to(DEV), w.to(DEV), ids.to(DEV), big_q[:, :128], big_sf[:, :4],
                                              big_i[:, :4], big_w[:, :4])
    assert same_bits(big_q[:, :128], xq_r) and same_bits(big_sf[:, :4], xsf_r)
    assert (big_q[:, 128:] == 0).all() and (big_sf[:, 4:] == 0).all()
    assert torch.equal(big_i[:, :4].cpu(), ids) and torch.equal(big_w[:, :4].cpu(), w)


def test_validation_errors_name_argument_expected_and_actual():
    h, w, ids = make_inputs(4, 128, 2)
    h, w, ids = h.to(DEV), w.to(DEV), ids.to(DEV)
    good = outputs(4, 128, 2, DEV)
    stage = staging.stage_deepseek_v4_mega_moe_inputs
    with pytest.raises(ValueError, match=r"hidden_states: last dim \(hidden_size\) must be a multiple of 128, got 96"):
        stage(h[:, :96], w, ids, *outputs(4, 96, 2, DEV))
    with pytest.raises(ValueError, match=r"topk_weights: expected shape \(4, 2\), got \(4, 3\)"):
        stage(h, torch.rand(4, 3, device=DEV), ids, *good)
    with pytest.raises(ValueError, match=r"topk_ids: expected 3 rows \(one per token of hidden_states\), got shape"):
        stage(h[:3], w[:3], ids, *outputs(3, 128, 2, DEV))
    with pytest.raises(ValueError, match=r"x_sf: expected shape \(4, 2\), got \(4, 4\)"):
        stage(h, w, ids, good[0], torch.zeros(4, 4, dtype=torch.int32, device=DEV), good[2], good[3])
    with pytest.raises(TypeError, match="x_fp4: expected dtype uint8, got int8"):
        stage(h, w, ids, good[0].view(torch.int8), *good[1:])
    with pytest.raises(TypeError, match="topk_idx_out: expected dtype int64, got int32"):
        stage(h, w, ids, good[0], good[1], good[2].to(torch.int32), good[3])
    with pytest.raises(TypeError, match="topk_ids: expected dtype int32 or int64, got float32"):
        stage(h, w, w, *good)
    # the reference raises the same errors
    with pytest.raises(ValueError, match=r"hidden_states: last dim \(hidden_size\) must be a multiple of 128"):
        ref.stage_deepseek_v4_mega_moe_inputs(h[:, :96].cpu(), w.cpu(), ids.cpu(), *outputs(4, 96, 2, "cpu"))


def test_empty_batch_is_a_no_op():
    """M == 0 (an idle rank) writes nothing: the zero-row outputs are views into garbage-filled buffers
    whose bytes must stay as they were; the arguments are still validated."""
    h, w, ids = make_inputs(0, 256, 6)
    for stage, device in ((staging.stage_deepseek_v4_mega_moe_inputs, DEV),
                          (ref.stage_deepseek_v4_mega_moe_inputs, "cpu")):
        h_d, w_d, ids_d = h.to(device), w.to(device), ids.to(device)
        buffers = outputs(3, 256, 6, device)
        before = [t.clone() for t in buffers]
        assert stage(h_d, w_d, ids_d, *(t[1:1] for t in buffers)) is None
        for got, want in zip(buffers, before):
            assert same_bits(got.cpu(), want.cpu()), (stage.__module__, got.dtype)
        with pytest.raises(ValueError, match=r"x_sf: expected shape \(0, 4\), got \(0, 2\)"):
            stage(h_d, w_d, ids_d, buffers[0][:0], buffers[1][:0, :2], buffers[2][:0], buffers[3][:0])


@GPU
def test_staging_in_a_cuda_graph():
    h, w, ids = make_inputs(64, 7168, 8, seed=4)
    h, w, ids = h.cuda(), w.cuda(), ids.cuda()
    outs = outputs(64, 7168, 8, "cuda")
    staging.stage_deepseek_v4_mega_moe_inputs(h, w, ids, *outs)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        staging.stage_deepseek_v4_mega_moe_inputs(h, w, ids, *outs)
    h2, w2, ids2 = make_inputs(64, 7168, 8, seed=5)
    h.copy_(h2.cuda()), w.copy_(w2.cuda()), ids.copy_(ids2.cuda())
    g.replay()
    out_r = outputs(64, 7168, 8, "cpu")
    ref.stage_deepseek_v4_mega_moe_inputs(h2, w2, ids2, *out_r)
    assert all(same_bits(a, b) for a, b in zip(outs, out_r))
