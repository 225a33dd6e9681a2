"""Hopper FP4-weight GEMMs over experts (Triton kernel): grouped by expert offsets (sorted rows,
gather / scatter with top-k weights, fewer rows than experts), masked ``[E, max_m, K]``, and the whole
fused MoE built from them, against the fp64 references; larger shapes and CUDA graphs marked ``gpu``.
Shared cases: tests/gemm_cases.py.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nvfp4_plugin import numerics as nx
from nvfp4_plugin import reference as ref
from nvfp4_plugin.gemm import TritonWgmmaConfig, prepack, w4_grouped, w4_masked

from .gemm_cases import (BN32, BN128, DEV, SS64, V2_8, V3_16, act, graph_replay, grouped_ref, make_weight,
                         report_max_ulps, routing, ulp_error)  # noqa: F401  (autouse fixture)


@pytest.mark.parametrize("cfg", [None, V2_8, TritonWgmmaConfig(bn=64, bm=16, bk=64, m_split=2), BN128, BN32, SS64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_sorted_rows(cfg, dtype):
    num_e, n, k, tokens, top_k = 4, 72, 96, 9, 2
    w = make_weight((num_e,), n, k, seed=31)
    p = prepack(w, dtype)
    pair, offsets, token, _ = routing(tokens, num_e, top_k, seed=32)
    x = act((tokens * top_k, k), dtype, seed=33)          # rows already sorted by expert
    y = w4_grouped(x, p, offsets, config=cfg)
    assert y.shape == (tokens * top_k, n)
    assert ulp_error(y.cpu(), grouped_ref(x, w, offsets), dtype, f"grouped/{dtype}") <= 2


@pytest.mark.parametrize("cfg", [V2_8, TritonWgmmaConfig(bn=64, bm=16, bk=128, m_split=3)])
def test_grouped_gather_scatter_topk_weights(cfg):
    """Up-projection reads tokens through the gather index; down-projection writes pair slots
    through the scatter index times the top-k weights, so the MoE needs no permute copies."""
    num_e, n, k, tokens, top_k = 5, 64, 80, 7, 3
    dtype = torch.bfloat16
    w = make_weight((num_e,), n, k, seed=41)
    p = prepack(w, dtype)
    pair, offsets, token, topk_w = routing(tokens, num_e, top_k, seed=42)
    x = act((tokens, k), dtype, seed=43)
    y = w4_grouped(x, p, offsets, gather_idx=token, scatter_idx=pair, row_scale=topk_w,
                   num_out_rows=tokens * top_k, config=cfg)
    y_ref = grouped_ref(x, w, offsets, gather=token, scatter=pair, row_scale=topk_w, n_out=tokens * top_k)
    assert ulp_error(y.cpu(), y_ref, dtype, "grouped_gather_scatter") <= 2
    # summing the top-k slots per token gives the MoE combine
    comb = y.float().reshape(tokens, top_k, n).sum(1)
    assert torch.allclose(comb.cpu().double(), y_ref.reshape(tokens, top_k, n).sum(1), rtol=0.02, atol=0.05)
    # the same indices and weights as strided views (every other entry of a doubled vector): the same output
    def strided(t):
        return torch.stack([t, t], 1).reshape(-1)[::2]

    y_s = w4_grouped(x, p, strided(offsets), gather_idx=strided(token), scatter_idx=strided(pair),
                     row_scale=strided(topk_w), num_out_rows=tokens * top_k, config=cfg)
    assert strided(token).stride(0) == 2 and torch.equal(y_s, y)


def test_grouped_w4a4_and_empty():
    num_e, n, k = 3, 64, 64
    dtype = torch.bfloat16
    w = make_weight((num_e,), n, k, seed=51)
    p = prepack(w, dtype)
    offsets = torch.tensor([0, 3, 3, 7], dtype=torch.int32, device=DEV)
    x = act((7, k), dtype, seed=52)
    gs = torch.tensor([3.0, 50.0, 400.0], device=DEV)
    y = w4_grouped(x, p, offsets, mode="w4a4", input_global_scale=gs, config=V2_8)
    y_ref = grouped_ref(x, w, offsets, mode="w4a4", gs=gs)
    assert ulp_error(y.cpu(), y_ref, dtype, "grouped_w4a4") <= 2
    # no rows at all, and rows past expert_offsets[E] are ignored
    zero = torch.zeros(num_e + 1, dtype=torch.int32, device=DEV)
    out = torch.full((7, n), 7.0, dtype=dtype, device=DEV)
    w4_grouped(x, p, zero, out=out)
    assert (out == 7).all()
    assert w4_grouped(x[:0], p, zero).shape == (0, n)


@pytest.mark.parametrize("cfg", [None, V2_8, TritonWgmmaConfig(bn=64, bm=16, bk=64, m_split=2)])
def test_grouped_fewer_rows_than_experts(cfg):
    """Decode-sized routing (rows < experts): the grid has one slot per possible active expert and each
    finds its expert from the offsets; empty experts between, rows past expert_offsets[E], gather and
    scatter, and offsets that give no expert any row."""
    num_e, n, k = 40, 48, 64
    dtype = torch.bfloat16
    w = make_weight((num_e,), n, k, seed=61)
    p = prepack(w, dtype)
    counts = torch.zeros(num_e, dtype=torch.int64)
    counts[[0, 17, 39]] = torch.tensor([2, 1, 3])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32).to(DEV)
    x = act((7, k), dtype, seed=62)  # 6 routed rows and one past expert_offsets[E]
    y = w4_grouped(x, p, offsets, config=cfg)
    y_ref = grouped_ref(x, w, offsets)
    assert ulp_error(y[:6].cpu(), y_ref[:6], dtype, "grouped_few_rows") <= 2
    order = torch.tensor([3, 0, 6, 1, 5, 2], dtype=torch.int32, device=DEV)
    y = w4_grouped(x, p, offsets, gather_idx=order, scatter_idx=order, num_out_rows=7, config=cfg)
    y_ref = grouped_ref(x, w, offsets, gather=order, scatter=order, n_out=7)
    assert ulp_error(y.cpu(), y_ref, dtype, "grouped_few_rows_gather_scatter") <= 2
    one = torch.zeros(num_e + 1, dtype=torch.int32, device=DEV)
    one[24:] = 2  # both rows in expert 23
    y = w4_grouped(x[:2], p, one, config=cfg)
    assert ulp_error(y.cpu(), grouped_ref(x[:2], w, one), dtype, "grouped_few_rows_one_expert") <= 2
    # as many slots as active experts, expert 0 empty: slot i must take the (i+1)-th expert with rows
    three = torch.zeros(num_e + 1, dtype=torch.int32, device=DEV)
    three[6:], three[21:], three[40:] = 1, 2, 3  # one row each in experts 5, 20 and 39
    y = w4_grouped(x[:3], p, three, config=cfg)
    assert ulp_error(y.cpu(), grouped_ref(x[:3], w, three), dtype, "grouped_few_rows_one_each") <= 2
    zero = torch.zeros(num_e + 1, dtype=torch.int32, device=DEV)
    out = torch.full((3, n), 7.0, dtype=dtype, device=DEV)
    w4_grouped(x[:3], p, zero, out=out, config=cfg)
    assert (out == 7).all()


@settings(max_examples=8, deadline=None, derandomize=True)
@given(counts=st.lists(st.integers(0, 11), min_size=1, max_size=5), nb=st.integers(1, 9), kb=st.integers(1, 9),
       cfg=st.sampled_from([None, V2_8, V3_16, TritonWgmmaConfig(bn=64, bm=16, bk=64, m_split=3)]),
       gather=st.booleans(),
       seed=st.integers(0, 2**16))
def test_grouped_fuzz(counts, nb, kb, cfg, gather, seed):
    num_e, n, k = len(counts), 16 * nb - 3, 16 * kb
    dtype = torch.bfloat16
    w = make_weight((num_e,), n, k, seed=seed)
    p = prepack(w, dtype)
    offsets = torch.zeros(num_e + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(torch.tensor(counts), 0)
    rows = int(offsets[-1])
    offsets = offsets.to(DEV)
    g = torch.Generator().manual_seed(seed)
    if gather:
        x = act((5, k), dtype, seed=seed + 1)
        gi = torch.randint(0, 5, (rows,), generator=g, dtype=torch.int32).to(DEV)
    else:
        x = act((rows + 2, k), dtype, seed=seed + 1)   # 2 trailing rows past expert_offsets[E]: ignored
        gi = None
    y = w4_grouped(x, p, offsets, gather_idx=gi, config=cfg)
    y_ref = grouped_ref(x, w, offsets, gather=gi)
    assert ulp_error(y[:rows].cpu(), y_ref[:rows], dtype, "grouped_fuzz") <= 2


@pytest.mark.parametrize("cfg", [None, V2_8, V3_16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_masked(cfg, dtype):
    num_e, max_m, n, k = 4, 19, 64, 96
    w = make_weight((num_e,), n, k, seed=61)
    p = prepack(w, dtype)
    x = act((num_e, max_m, k), dtype, seed=62)
    mask = torch.tensor([0, max_m, 5, 100], dtype=torch.int32, device=DEV)   # empty, full, partial, > max_m
    out = torch.full((num_e, max_m, n), 3.0, dtype=dtype, device=DEV)
    w4_masked(x, p, mask, out=out, config=cfg)
    wd = w.dequantize(torch.float64)
    for e, valid in enumerate([0, max_m, 5, max_m]):
        y_ref = x[e, :valid].cpu().double() @ wd[e].cpu().t()
        assert ulp_error(out[e, :valid].cpu(), y_ref, dtype, f"masked/{dtype}") <= 2
        assert (out[e, valid:] == 3).all()   # rows past the mask untouched
    # the mask as a strided view (every other entry of a doubled vector): the same output
    out2 = torch.full_like(out, 3.0)
    w4_masked(x, p, torch.stack([mask, mask], 1).reshape(-1)[::2], out=out2, config=cfg)
    assert torch.equal(out2, out)


def test_masked_w4a4():
    num_e, max_m, n, k = 2, 9, 64, 64
    dtype = torch.bfloat16
    w = make_weight((num_e,), n, k, seed=71)
    p = prepack(w, dtype)
    x = act((num_e, max_m, k), dtype, seed=72)
    mask = torch.tensor([9, 4], dtype=torch.int32, device=DEV)
    gs = torch.tensor([20.0, 700.0], device=DEV)
    y = w4_masked(x, p, mask, mode="w4a4", input_global_scale=gs, config=V2_8)
    wd = w.dequantize(torch.float64)
    for e, valid in enumerate([9, 4]):
        q, s = ref.scaled_fp4_quant(x[e, :valid].cpu(), gs[e:e + 1].cpu(), swizzle=False)
        xd = ref.dequantize_fp4(q, s, gs[e:e + 1].cpu(), swizzled=False, m=valid, k=k)
        assert ulp_error(y[e, :valid].cpu(), xd.double() @ wd[e].cpu().t(), dtype, "masked_w4a4") <= 2


def test_grouped_gather_pos_checks():
    num_e, n, k, tokens, top_k = 3, 64, 64, 5, 2
    p = prepack(make_weight((num_e,), n, k, seed=3), torch.bfloat16)
    pair, offsets, token, _ = routing(tokens, num_e, top_k, seed=4)
    x = act((tokens, k), torch.bfloat16, seed=5)
    pos = torch.empty_like(pair)
    pos[pair.long()] = torch.arange(pair.numel(), dtype=pair.dtype, device=pair.device)
    with pytest.raises(ValueError, match="gather_pos: given without gather_idx"):
        w4_grouped(x, p, offsets, gather_pos=pos)
    with pytest.raises(ValueError, match="gather_pos"):
        w4_grouped(x, p, offsets, gather_idx=token, gather_pos=pos[:-1])
    with pytest.raises(ValueError, match="a multiple of x's 3 rows"):
        w4_grouped(x[:3], p, offsets, gather_idx=token, gather_pos=pos)
    # the inverse index only changes how rows are copied: the same output
    assert torch.equal(w4_grouped(x, p, offsets, gather_idx=token, gather_pos=pos),
                       w4_grouped(x, p, offsets, gather_idx=token))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 64, 300, 1024])
def test_gpu_grouped_moe_shapes(tokens):
    num_e, top_k, h, inter = 16, 4, 1024, 384
    dtype = torch.bfloat16
    w13 = make_weight((num_e,), 2 * inter, h, seed=5)
    w2 = make_weight((num_e,), h, inter, seed=6)
    p13, p2 = prepack(w13, dtype), prepack(w2, dtype)
    pair, offsets, token, topk_w = routing(tokens, num_e, top_k, seed=tokens)
    x = act((tokens, h), dtype, seed=8)
    up = w4_grouped(x, p13, offsets, gather_idx=token)
    y_ref = grouped_ref(x, w13, offsets, gather=token)
    assert ulp_error(up.cpu(), y_ref, dtype, "gpu_grouped") <= 2
    a = nx.silu_and_mul_fp32(up)
    down = w4_grouped(a, p2, offsets, scatter_idx=pair, row_scale=topk_w, num_out_rows=tokens * top_k)
    y_ref2 = grouped_ref(a, w2, offsets, scatter=pair, row_scale=topk_w, n_out=tokens * top_k)
    assert ulp_error(down.cpu(), y_ref2, dtype, "gpu_grouped") <= 2
    up_g = graph_replay(lambda: w4_grouped(x, p13, offsets, gather_idx=token))
    assert torch.equal(up_g, up)
    # routing's inverse index (the Gluon tiles copy each token's row once to its top-k rows): the same bytes
    pos = torch.empty_like(pair)
    pos[pair.long()] = torch.arange(pair.numel(), dtype=pair.dtype, device=pair.device)
    assert torch.equal(graph_replay(lambda: w4_grouped(x, p13, offsets, gather_idx=token, gather_pos=pos)), up)


@pytest.mark.gpu
@pytest.mark.parametrize("max_m", [8, 64, 256])
def test_gpu_masked_shapes(max_m):
    num_e, n, k = 8, 1024, 2048
    dtype = torch.bfloat16
    w = make_weight((num_e,), n, k, seed=max_m)
    p = prepack(w, dtype)
    x = act((num_e, max_m, k), dtype, seed=1)
    mask = torch.tensor([0, max_m, 1, max_m // 2, 3, max_m, 7, 2 * max_m], dtype=torch.int32, device=DEV)
    out = torch.full((num_e, max_m, n), 5.0, dtype=dtype, device=DEV)
    w4_masked(x, p, mask, out=out)
    wd = w.dequantize(torch.float64)
    for e in range(num_e):
        v = min(int(mask[e]), max_m)
        assert ulp_error(out[e, :v], x[e, :v].double() @ wd[e].t(), dtype, "gpu_masked") <= 2
        assert (out[e, v:] == 5).all()


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_fused_moe_matches_reference(mode):
    from nvfp4_plugin.gemm import w4_fused_moe
    num_e, h, inter, tokens, top_k = 4, 64, 32, 6, 2
    dtype = torch.bfloat16
    w13 = make_weight((num_e,), 2 * inter, h, seed=81)
    w2 = make_weight((num_e,), h, inter, seed=82)
    x = act((tokens, h), dtype, seed=83)
    g = torch.Generator().manual_seed(84)
    logits = torch.randn(tokens, num_e, generator=g)
    logits[:, 3] = -9  # one expert never routed
    topk_w, topk_ids = ref.route_topk(logits, top_k)
    topk_w, topk_ids = topk_w.to(DEV), topk_ids.to(DEV)
    kw = {}
    if mode == "w4a4":
        kw = dict(a13_global_scale=torch.tensor([30.0, 40.0, 50.0, 60.0], device=DEV),
                  a2_global_scale=torch.tensor([300.0, 400.0, 500.0, 600.0], device=DEV))
    y = w4_fused_moe(x, prepack(w13, dtype), prepack(w2, dtype), topk_w, topk_ids, mode=mode, **kw)
    y_ref = ref.nvfp4_fused_moe(x.cpu(), w13.packed.cpu(), w13.block_scale.cpu(), w13.global_scale.cpu(),
                                w2.packed.cpu(), w2.block_scale.cpu(), w2.global_scale.cpu(), topk_w.cpu(),
                                topk_ids.cpu(), mode=mode, **{k: v.cpu() for k, v in kw.items()})
    # both round the intermediate activations: differences of one rounding can propagate, so compare
    # relative to the output scale with a few ulps
    assert ulp_error(y.cpu(), y_ref.double(), dtype, f"_fused_moe_{mode}") <= 4


@pytest.mark.gpu
def test_gpu_fused_moe_and_graph():
    from nvfp4_plugin.gemm import w4_fused_moe
    num_e, h, inter, tokens, top_k = 32, 1024, 512, 48, 4
    dtype = torch.bfloat16
    w13 = make_weight((num_e,), 2 * inter, h, seed=91)
    w2 = make_weight((num_e,), h, inter, seed=92)
    p13, p2 = prepack(w13, dtype), prepack(w2, dtype)
    x = act((tokens, h), dtype, seed=93)
    topk_w, topk_ids = ref.route_topk(torch.randn(tokens, num_e, device=DEV), top_k)
    y = w4_fused_moe(x, p13, p2, topk_w, topk_ids)
    y_ref = ref.nvfp4_fused_moe(x, w13.packed, w13.block_scale, w13.global_scale, w2.packed, w2.block_scale,
                                w2.global_scale, topk_w, topk_ids)
    assert ulp_error(y, y_ref.double(), dtype, "_gpu_fused_moe") <= 4
    yg = graph_replay(lambda: w4_fused_moe(x, p13, p2, topk_w, topk_ids))
    assert torch.equal(yg, y)
