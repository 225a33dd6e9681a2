"""Reference NVFP4 linear (W4A16 / W4A4) and fused MoE, against independent formulations."""

import pytest
import torch

from nvfp4_plugin import numerics as nx
from nvfp4_plugin import reference as ref


def quantize_weight(w):
    gs = nx.tensor_global_scale(w).reshape(1)
    p, s = ref.scaled_fp4_quant(w, gs, swizzle=False)
    return p, s, gs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_w4a16_and_w4a4(dtype):
    g = torch.Generator().manual_seed(0)
    n, k = 48, 96
    w = torch.randn(n, k, generator=g)
    x = torch.randn(2, 3, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    p, s, gs = quantize_weight(w)
    wd = ref.dequantize_fp4(p, s, gs, swizzled=False, m=n, k=k, dtype=torch.float64)
    y = ref.nvfp4_linear(x, p, s, gs, bias)
    assert y.shape == (2, 3, n) and y.dtype == dtype
    exact = x.double() @ wd.t() + bias.double()
    assert torch.allclose(y.double(), exact, rtol=2 ** -7, atol=1e-2)
    ags = nx.tensor_global_scale(x).reshape(1)
    y4 = ref.nvfp4_linear(x, p, s, gs, bias, mode="w4a4", input_global_scale=ags)
    qx, sx = ref.scaled_fp4_quant(x.reshape(6, k), ags, swizzle=False)
    xd = ref.dequantize_fp4(qx, sx, ags, swizzled=False, m=6, k=k, dtype=torch.float64)
    exact4 = (xd @ wd.t() + bias.double()).reshape(2, 3, n)
    assert torch.allclose(y4.double(), exact4, rtol=2 ** -7, atol=1e-2)
    assert not torch.allclose(y4, y)  # activation quantization is visible
    with pytest.raises(ValueError, match="input_global_scale"):
        ref.nvfp4_linear(x, p, s, gs, mode="w4a4")
    with pytest.raises(ValueError, match="x: expected last dim 96"):
        ref.nvfp4_linear(torch.randn(2, 64), p, s, gs)


def test_route_topk():
    logits = torch.randn(5, 8)
    w, ids = ref.route_topk(logits, 3)
    assert ids.dtype == torch.int32 and torch.allclose(w.sum(-1), torch.ones(5))
    assert torch.equal(ids[:, 0].long(), logits.argmax(-1))


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_fused_moe_against_per_token_loop(mode):
    g = torch.Generator().manual_seed(1)
    t, h, inter, e, topk = 7, 64, 32, 4, 2
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    w13 = torch.randn(e, 2 * inter, h, generator=g)
    w2 = torch.randn(e, h, inter, generator=g) * 0.1
    q13 = [quantize_weight(w13[i]) for i in range(e)]
    q2 = [quantize_weight(w2[i]) for i in range(e)]
    st = lambda qs, j: torch.stack([q[j] for q in qs])  # noqa: E731
    w13p, w13s, w13g = st(q13, 0), st(q13, 1), torch.cat([q[2] for q in q13])
    w2p, w2s, w2g = st(q2, 0), st(q2, 1), torch.cat([q[2] for q in q2])
    topk_w, topk_ids = ref.route_topk(torch.randn(t, e, generator=g), topk)
    topk_ids[0] = torch.tensor([3, 3 - 1], dtype=torch.int32)
    kw = {}
    if mode == "w4a4":
        kw = dict(a13_global_scale=torch.full((e,), 300.0), a2_global_scale=torch.full((e,), 900.0))
    out = ref.nvfp4_fused_moe(x, w13p, w13s, w13g, w2p, w2s, w2g, topk_w, topk_ids, mode=mode, **kw)
    assert out.shape == (t, h) and out.dtype == torch.bfloat16
    for tok in range(t):
        acc = torch.zeros(h)
        for j in range(topk):
            ex = topk_ids[tok, j].item()
            xi = x[tok:tok + 1]
            if mode == "w4a4":
                q, s = ref.scaled_fp4_quant(xi, kw["a13_global_scale"][ex:ex + 1], swizzle=False)
                xi = ref.dequantize_fp4(q, s, kw["a13_global_scale"][ex:ex + 1], swizzled=False, m=1, k=h)
            w1 = ref.dequantize_fp4(w13p[ex], w13s[ex], w13g[ex:ex + 1], swizzled=False, m=2 * inter, k=h)
            hid = (xi.float() @ w1.t()).to(torch.bfloat16)
            act = nx.silu_and_mul_fp32(hid)
            if mode == "w4a4":
                q, s = ref.scaled_fp4_quant(act, kw["a2_global_scale"][ex:ex + 1], swizzle=False)
                act = ref.dequantize_fp4(q, s, kw["a2_global_scale"][ex:ex + 1], swizzled=False, m=1, k=inter)
            wd = ref.dequantize_fp4(w2p[ex], w2s[ex], w2g[ex:ex + 1], swizzled=False, m=h, k=inter)
            y = (act.float() @ wd.t()).to(torch.bfloat16)
            acc += topk_w[tok, j] * y[0].float()
        assert torch.allclose(out[tok].float(), acc.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2), tok


def test_nvfp4_weight_shards_stay_exact_with_different_global_scales():
    from nvfp4_plugin.weights import Nvfp4Weight

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(n, 64, generator=g) * sc for n, sc in ((32, 1.0), (16, 30.0), (16, 0.01)))
    shards = [Nvfp4Weight.quantize(t) for t in (q, k, v)]
    fused = Nvfp4Weight.from_shards(torch.cat([s.packed for s in shards]), torch.cat([s.block_scale for s in shards]),
                                    [s.global_scale[0].item() for s in shards], [32, 16, 16])
    assert fused.global_scale.shape == (64,)
    assert torch.equal(fused.dequantize(), torch.cat([s.dequantize() for s in shards]))
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    y = ref.nvfp4_linear(x, fused.packed, fused.block_scale, fused.global_scale)
    parts = [ref.nvfp4_linear(x, s.packed, s.block_scale, s.global_scale) for s in shards]
    assert torch.equal(y, torch.cat(parts, dim=-1))
    with pytest.raises(ValueError, match="shard_sizes: expected to sum to N=64"):
        Nvfp4Weight.from_shards(fused.packed, fused.block_scale, [1.0, 2.0, 3.0], [32, 16, 8])
    with pytest.raises(ValueError, match=r"global_scale: expected shape \(64,\)"):
        Nvfp4Weight(fused.packed, fused.block_scale, torch.ones(3))


def test_moe_accepts_per_row_expert_scales():
    from nvfp4_plugin.weights import Nvfp4Weight

    e, h, inter = 2, 32, 16
    w13 = Nvfp4Weight.quantize(torch.randn(e, 2 * inter, h))
    w2 = Nvfp4Weight.quantize(torch.randn(e, h, inter))
    x = torch.randn(4, h, dtype=torch.bfloat16)
    tw, ti = ref.route_topk(torch.randn(4, e), 1)
    a = ref.nvfp4_fused_moe(x, w13.packed, w13.block_scale, w13.global_scale, w2.packed, w2.block_scale,
                            w2.global_scale, tw, ti)
    b = ref.nvfp4_fused_moe(x, w13.packed, w13.block_scale, w13.global_scale[:, 0], w2.packed, w2.block_scale,
                            w2.global_scale[:, 0], tw, ti)
    assert torch.equal(a, b)
