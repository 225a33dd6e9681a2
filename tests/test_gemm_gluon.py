"""The explicitly pipelined Gluon GEMM (gemm/gluon_w4.py): dense, grouped and masked on the GPU against
the fp64 references; config validation, split-tail tiling and the heuristic's hand-over everywhere,
and the Triton kernel standing in for it where there is no compiled GPU path (the CPU interpreter).
Shared cases: tests/gemm_cases.py.
"""

import dataclasses

import pytest
import torch

from nvfp4_plugin import numerics as nx
from nvfp4_plugin.gemm import GluonConfig, TritonWgmmaConfig, W4Config, prepack, w4_grouped, w4_linear, w4_masked
from nvfp4_plugin.gemm import select as gsel

from .gemm_cases import (DEV, ON_GPU, act, dense_ref, graph_replay, grouped_ref, make_weight,
                         report_max_ulps, routing, ulp_error)  # noqa: F401  (autouse fixture)


GLUON_CFGS = [GluonConfig(bn=64, bm=128, bk=64, num_warps=4, num_stages=4),
               GluonConfig(bn=64, bm=256, bk=64, num_warps=4, num_stages=3, split_k=3),
               GluonConfig(bn=128, bm=128, bk=128, num_warps=8, num_stages=3),
               GluonConfig(bn=128, bm=256, bk=128, num_warps=8, num_stages=2, split_k=2),
               GluonConfig(bn=64, bm=64, bk=128, num_warps=4, num_stages=2, split_k=8),
               # weights 4 K steps ahead: K steps per split 1, 17, 65 and 32 (11 / 11 / 10 with split 3)
               # leave 0-3 steps after the unrolled loop
               GluonConfig(bn=64, bm=128, bk=64, num_warps=4, num_stages=4, prefetch=4),
               GluonConfig(bn=128, bm=256, bk=64, num_warps=8, num_stages=2, split_k=3, prefetch=4),
               # small-batch tiles (the tuner's 9-32 rows): 32 and 16 tokens, many M tiles at the larger M
               GluonConfig(bn=64, bm=32, bk=64, num_warps=4, num_stages=4, split_k=4, prefetch=4),
               GluonConfig(bn=128, bm=16, bk=128, num_warps=8, num_stages=4, split_k=2),
               # split only the tiles past the last whole wave: at 1030 x 4100 (585 tiles of 128 rows x 64 on 132
               # SMs) 522 tiles over all of K and 63 split 2 ways (N columns 3712-4099, the last one ragged),
               # at 333 x 1000 (48 tiles) all split
               GluonConfig(bn=64, bm=128, bk=64, num_warps=4, num_stages=4, split_k=2, prefetch=4,
                        split_tail=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GLUON_CFGS, ids=["bn64bm128", "bn64bm256split3", "bn128bm128bk128",
                                                  "bn128bm256split2", "bn64bm64split8", "bn64bm128pf4",
                                                  "bn128bm256split3pf4", "bn64bm32split4pf4", "bn128bm16bk128split2",
                                                  "bn64bm128splittail"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gluon_dense(cfg, dtype):
    """The explicitly pipelined Gluon kernel: odd M / N / K (K not a multiple of the K step), bias of
    both dtypes, w4a4, split K, more than one wave; deterministic and CUDA-graph capturable."""
    for (m, n, k) in ((1, 64, 64), (77, 200, 1040), (333, 1000, 4112), (1030, 4100, 2048)):
        w = make_weight((), n, k, seed=m + n + k)
        p = prepack(w, dtype)
        x = act((m, k), dtype, seed=m)
        y = w4_linear(x, p, config=cfg)
        assert y.shape == (m, n) and y.dtype == dtype
        assert ulp_error(y, dense_ref(x, w), dtype, f"gluon/{dtype}") <= 2, (m, n, k)
        for bias in (act((n,), dtype, seed=3), act((n,), dtype, seed=4).float()):
            assert ulp_error(w4_linear(x, p, bias, config=cfg), dense_ref(x, w, bias), dtype, f"gluon/{dtype}") <= 2
        assert torch.equal(w4_linear(x, p, config=cfg), y)
    gs = nx.tensor_global_scale(x.float()).reshape(1)
    y4 = w4_linear(x, p, mode="w4a4", input_global_scale=gs, config=cfg)
    assert ulp_error(y4, dense_ref(x, w, mode="w4a4", gs=gs), dtype, f"gluon_w4a4/{dtype}") <= 2
    # a base or a row stride that is not 16-byte aligned (TMA) is copied first
    xs = act((m * k + 8,), dtype, seed=9)[1:1 + m * k].reshape(m, k)
    xw = act((m, k + 4), dtype, seed=10)[:, :k]
    assert xs.data_ptr() % 16 and (xw.stride(0) * xw.element_size()) % 16
    for xm in (xs, xw):
        assert ulp_error(w4_linear(xm, p, config=cfg), dense_ref(xm, w), dtype, f"gluon/{dtype}") <= 2
    yg = graph_replay(lambda: w4_linear(x, p, config=cfg))
    assert torch.equal(yg, w4_linear(x, p, config=cfg))


# split-K partials summed by each tile's last program: every tile split (bm32 4 ways, bm16 2 ways, bm256 3 ways)
# and only the last partial wave's tiles split
FIXUP_CFGS = [GLUON_CFGS[7], GLUON_CFGS[8], GLUON_CFGS[6], GLUON_CFGS[-1]]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", FIXUP_CFGS, ids=["bm32split4", "bm16split2", "bm256split3", "splittail"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gluon_fixup_equals_reduce_launch(cfg, dtype):
    """``fixup``: the tile's last program to arrive adds the partials in split order, so the output equals the
    reduce launch's bit for bit (bias, w4a4, odd sizes, more than one wave; the first shape has one K step and
    does not split), call after call and replay after replay of a CUDA graph (a race between a tile's programs
    would show as a differing call); the counters are zero again after every call, so the next call (another
    shape, the same stream) starts clean."""
    from nvfp4_plugin.gemm import api

    fx = dataclasses.replace(cfg, fixup=True)
    for (m, n, k) in ((1, 64, 64), (30, 200, 1040), (333, 1000, 4112), (1030, 4100, 2048), (32, 28672, 4096)):
        w = make_weight((), n, k, seed=m + n)
        p = prepack(w, dtype)
        x = act((m, k), dtype, seed=m + 1)
        bias = act((n,), dtype, seed=5)
        for b in (None, bias):
            y = w4_linear(x, p, b, config=fx)
            assert torch.equal(y, w4_linear(x, p, b, config=cfg)), (m, n, k, b is not None)
            for _ in range(5):
                assert torch.equal(w4_linear(x, p, b, config=fx), y)
        gs = nx.tensor_global_scale(x.float()).reshape(1)
        assert torch.equal(w4_linear(x, p, mode="w4a4", input_global_scale=gs, config=fx),
                           w4_linear(x, p, mode="w4a4", input_global_scale=gs, config=cfg))
        assert ulp_error(y, dense_ref(x, w, bias), dtype, f"gluon_fixup/{dtype}") <= 2
        want = w4_linear(x, p, config=cfg)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            yg = w4_linear(x, p, config=fx)
        for _ in range(10):
            yg.zero_()
            g.replay()
            assert torch.equal(yg, want), (m, n, k)
        torch.cuda.synchronize()
        assert all(int(c.count_nonzero()) == 0 for c in api._COUNTERS.values())


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [GLUON_CFGS[0], GLUON_CFGS[2], GluonConfig(bn=64, bm=128, bk=128, num_warps=4,
                                                                         num_stages=3, m_split=2),
                                 GLUON_CFGS[5]],
                         ids=["bn64bm128", "bn128bm128bk128", "msplit2", "bn64bm128pf4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gluon_grouped_and_masked(cfg, dtype):
    """The Gluon kernel over experts: sorted rows with an empty expert and tiles that run past an
    expert's end, scatter with top-k weights, w4a4, rows past expert_offsets[E]; masked with mask 0,
    partial, full and above max_m (rows past the mask untouched); a gather index falls back to the
    Triton kernel. All within 2 ulps, deterministic, graph-capturable."""
    # K steps of 64: 17 (1040), 19 with prefetch=4 (1168: a 3-step tail after the 4-way unrolled loop)
    num_e, n, k, tokens, top_k = 6, 200, 1040 if cfg.prefetch == 2 else 1168, 300, 2
    w = make_weight((num_e,), n, k, seed=71)
    p = prepack(w, dtype)
    pair, offsets, token, topk_w = routing(tokens, num_e, top_k, seed=72)
    rows = tokens * top_k
    x = act((rows, k), dtype, seed=73)
    y = w4_grouped(x, p, offsets, config=cfg)
    assert ulp_error(y.cpu(), grouped_ref(x, w, offsets), dtype, f"gluon_grouped/{dtype}") <= 2
    assert torch.equal(w4_grouped(x, p, offsets, config=cfg), y)
    ys = w4_grouped(x, p, offsets, scatter_idx=pair, row_scale=topk_w, num_out_rows=rows, config=cfg)
    y_ref = grouped_ref(x, w, offsets, scatter=pair, row_scale=topk_w, n_out=rows)
    assert ulp_error(ys.cpu(), y_ref, dtype, f"gluon_grouped_scatter/{dtype}") <= 2
    xt = act((tokens, k), dtype, seed=74)
    yg = w4_grouped(xt, p, offsets, gather_idx=token, scatter_idx=pair, row_scale=topk_w, num_out_rows=rows, config=cfg)
    yg_ref = grouped_ref(xt, w, offsets, gather=token, scatter=pair, row_scale=topk_w, n_out=rows)
    assert ulp_error(yg.cpu(), yg_ref, dtype, f"gluon_grouped_gather/{dtype}") <= 2
    gs = torch.tensor([3.0, 50.0, 400.0, 7.0, 90.0, 1.0], device=DEV)
    y4 = w4_grouped(x, p, offsets, mode="w4a4", input_global_scale=gs, config=cfg)
    assert ulp_error(y4.cpu(), grouped_ref(x, w, offsets, mode="w4a4", gs=gs), dtype, f"gluon_grouped_w4a4/{dtype}") <= 2
    short = offsets.clone()
    short[-2:] = short[-3]               # the last two experts lose their rows: rows past offsets[E] ignored
    out = torch.full((rows, n), 7.0, dtype=dtype, device=DEV)
    w4_grouped(x, p, short, out=out, config=cfg)
    assert (out[int(short[-1]):] == 7).all()
    assert ulp_error(out[:int(short[-1])].cpu(), grouped_ref(x, w, short)[:int(short[-1])], dtype, "gluon_grouped") <= 2
    yc = graph_replay(lambda: w4_grouped(x, p, offsets, config=cfg))
    assert torch.equal(yc, y)
    # masked: [E, max_m, K]
    max_m = 300
    xm = act((num_e, max_m, k), dtype, seed=75)
    mask = torch.tensor([0, 1, 129, 300, 1000, 256], dtype=torch.int32, device=DEV)
    outm = torch.full((num_e, max_m, n), 5.0, dtype=dtype, device=DEV)
    w4_masked(xm, p, mask, out=outm, config=cfg)
    wd = w.dequantize(torch.float64).cpu()
    for e, valid in enumerate(min(v, max_m) for v in mask.tolist()):
        assert (outm[e, valid:] == 5).all()
        if valid:
            assert ulp_error(outm[e, :valid].cpu(), xm[e, :valid].cpu().double() @ wd[e].t(), dtype,
                             f"gluon_masked/{dtype}") <= 2


@pytest.mark.gpu
@pytest.mark.parametrize("tail_bm", [128, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gluon_grouped_tail_launch(tail_bm, dtype):
    """256-row grouped tiles with each expert's last at most 128 rows split off to a launch of shorter tiles
    (``tail_bm``): every row count around the tile edges (none, a few, exactly half a tile, one more, whole
    tiles and beyond), plain and scattered with row scales (the down projection), rows past
    expert_offsets[E] untouched, under a CUDA graph: the same bytes as one launch of the 256-row tiles,
    within 2 ulps of the fp64 reference."""
    counts = [0, 5, 128, 129, 256, 300, 384, 385, 612, 640, 1]
    num_e, n, k = len(counts), 200, 1040
    offsets = torch.zeros(num_e + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(torch.tensor(counts), 0)
    offsets = offsets.to(DEV)
    rows = int(offsets[-1])
    w = make_weight((num_e,), n, k, seed=81)
    p = prepack(w, dtype)
    x = act((rows + 40, k), dtype, seed=82)       # 40 rows past offsets[E]
    whole = GluonConfig(bn=64, bm=256, bk=64, num_warps=4, num_stages=3)
    split = GluonConfig(bn=64, bm=256, bk=64, num_warps=4, num_stages=3, tail_bm=tail_bm)
    y1 = w4_grouped(x, p, offsets, config=whole)
    out = torch.full((rows + 40, n), 7.0, dtype=dtype, device=DEV)
    y2 = w4_grouped(x, p, offsets, out=out, config=split)
    assert torch.equal(y2[:rows], y1[:rows])
    assert (y2[rows:] == 7).all()
    assert ulp_error(y2[:rows].cpu(), grouped_ref(x[:rows], w, offsets), dtype, f"gluon_grouped_tail/{dtype}") <= 2
    g = torch.Generator().manual_seed(83)
    pair = torch.randperm(rows, generator=g).to(torch.int32).to(DEV)
    scale = torch.rand(rows, generator=g).to(DEV)
    xr = x[:rows]
    ys1 = w4_grouped(xr, p, offsets, scatter_idx=pair, row_scale=scale, num_out_rows=rows, config=whole)
    ys2 = w4_grouped(xr, p, offsets, scatter_idx=pair, row_scale=scale, num_out_rows=rows, config=split)
    assert torch.equal(ys2, ys1)
    yc = graph_replay(lambda: w4_grouped(xr, p, offsets, scatter_idx=pair, row_scale=scale, num_out_rows=rows,
                                         config=split))
    assert torch.equal(yc, ys1)


def test_gluon_config_validation_and_selection():
    with pytest.raises(ValueError, match="GluonConfig: needs bn 64 or 128 with bn/16 warps"):
        GluonConfig(bn=128, bm=128, num_warps=4)
    with pytest.raises(ValueError, match="at most one of"):
        W4Config.from_json(dict(bn=64, bm=128, v2=True, gluon=True))
    with pytest.raises(ValueError, match="does not fit"):
        GluonConfig(bn=64, bm=256, bk=128, num_warps=4, num_stages=4)
    for bm in (8, 16, 32, 64, 128, 256):                           # every token tile (the wgmma's N)
        cfg = gsel.gluon_config(64, bm, 64)
        assert cfg.num_stages == 4 or bm > 64, cfg
        assert W4Config.from_json(cfg.to_json()) == cfg
    assert W4Config.from_json(GLUON_CFGS[1].to_json()) == GLUON_CFGS[1]
    with pytest.raises(TypeError, match="split_tail"):             # a Gluon-only field
        TritonWgmmaConfig(bn=64, bm=128, split_k=2, split_tail=True)
    with pytest.raises(ValueError, match="needs split_k >= 2"):
        GluonConfig(bn=64, bm=128, num_warps=4, split_tail=True)
    with pytest.raises(ValueError, match="GluonConfig.fixup: .*needs split_k >= 2"):
        GluonConfig(bn=64, bm=128, num_warps=4, fixup=True)
    with pytest.raises(TypeError, match="fixup"):                  # a Gluon-only field
        TritonWgmmaConfig(bn=64, bm=32, split_k=4, fixup=True)
    fx = gsel.gluon_config(64, 32, 64, split_k=4, prefetch=4, fixup=True)
    assert W4Config.from_json(fx.to_json()) == fx and fx.to_json()["fixup"] is True
    assert "fixup" not in GLUON_CFGS[7].to_json()                  # the tables' entries without it read as before
    with pytest.raises(ValueError, match="prefetch"):
        GluonConfig(bn=64, bm=128, num_warps=4, prefetch=3)
    for bad in (32, 96, 256):
        with pytest.raises(ValueError, match="tail_bm"):
            GluonConfig(bn=64, bm=256, bk=64, num_warps=4, tail_bm=bad)
    with pytest.raises(ValueError, match="tail_bm"):       # more than half the main tile
        GluonConfig(bn=64, bm=128, num_warps=4, tail_bm=128)
    tail = GluonConfig(bn=64, bm=256, bk=64, num_warps=4, num_stages=3, tail_bm=128)
    assert W4Config.from_json(tail.to_json()) == tail
    # the second launch's config: the tail's rows, the same weight tile and K step, its own x ring
    assert gsel.tail_config(tail) == GluonConfig(bn=64, bm=128, bk=64, num_warps=4, num_stages=4)
    assert gsel.tail_config(GLUON_CFGS[1]) is None
    with pytest.raises(TypeError, match="tail_bm"):        # a Gluon-only field
        TritonWgmmaConfig(bn=64, bm=128, tail_bm=64)
    import types
    from nvfp4_plugin.gemm import gluon_w4
    fake_w = types.SimpleNamespace(layout=None, words=torch.empty(2, 1))
    with pytest.raises(ValueError, match="tail_cfg is for grouped launches"):    # masked rows have no tail
        gluon_w4.launch_grouped(2, None, fake_w, None, tail, None, None, m=8, m_split=1, tail_cfg=GLUON_CFGS[0])
    fake_w = types.SimpleNamespace(layout=types.SimpleNamespace(n=256, k_pad=4096))
    with pytest.raises(ValueError, match="fixup config .* needs counters"):       # split 4 ways: needs its counters
        gluon_w4.launch_dense(torch.empty(32, 4096), fake_w, None, fx, None)
    # split_tail: whole waves of one tile per SM over all of K, rounded down to whole N columns of tiles
    assert gluon_w4.dp_tiles(9, 64, 132, True) == 522            # 528 rounded down to a multiple of 9
    assert gluon_w4.dp_tiles(3, 16, 132, True) == 0              # fewer tiles than SMs: all split
    assert gluon_w4.dp_tiles(2, 132, 132, True) == 264           # exact waves: nothing left to split
    assert gluon_w4.dp_tiles(9, 64, 132, False) == 0             # plain split K: every tile split
    # the heuristic hands rows between GLUON_MIN_M and DEQUANT_MM_MIN_M to Gluon, splitting K for narrow N
    for m, n, k in ((128, 2048, 7168), (256, 28672, 4096), (300, 4096, 14336)):
        cfg = gsel.heuristic("dense", m, n, k)
        assert cfg.gluon and cfg.bm >= 128, cfg
    assert gsel.heuristic("dense", 128, 2048, 7168).split_k == 8
    assert gsel.heuristic("dense", 256, 28672, 4096).split_k == 1
    assert not gsel.heuristic("dense", gsel.GLUON_MIN_M, 4096, 4096).gluon
    # grouped / masked: from GLUON_MIN_EXPERT_ROWS rows per active expert
    assert gsel.heuristic("grouped", 32768, 1536, 2048, 128).gluon
    # 256-row grouped tiles from GLUON_BM256_EXPERT_ROWS rows per expert hand each expert's short last rows to
    # a second launch: GLUON_TAIL_BM-row tiles where the mean leaves few rows past whole tiles, 128-row ones
    # where it leaves 49-160; 128-row tiles have no tail
    assert gsel.GLUON_TAIL_BM in (0, 64, 128) and gsel.GLUON_BM256_EXPERT_ROWS == 192
    few, mid_rows = gsel.GLUON_TAIL_BM, (305, 384, 416)            # remainders past 256-row tiles: 49, 128, 160
    cases = [(r, few) for r in (192, 256, 304, 417, 512, 1024)] + [(r, 128) for r in mid_rows]
    for rows_per_expert, tail in cases:
        big = gsel.heuristic("grouped", 128 * rows_per_expert, 1536, 2048, 128)
        assert (big.bm, big.tail_bm) == (256, tail), (rows_per_expert, big)
        assert gsel.grouped_tail_bm(rows_per_expert) == tail
    mid = gsel.heuristic("grouped", 128 * 191, 1536, 2048, 128)
    assert (mid.gluon, mid.bm, mid.tail_bm) == (True, 128, 0)
    assert not gsel.heuristic("grouped", 8192, 1536, 2048, 128).gluon
    assert gsel.heuristic("masked", 256, 4096, 7168, 256).gluon and not gsel.heuristic("masked", 64, 4096, 7168, 256).gluon
    assert gsel.heuristic("dense", gsel.DEQUANT_MM_MIN_M, 4096, 4096).dequant_mm
    # without a compiled GPU path (the interpreter here on CPU) w4_linear runs the Triton kernel instead
    if not ON_GPU:
        w = make_weight((), 130, 96, seed=1)
        x = act((70, 96), torch.bfloat16, seed=2)
        y = w4_linear(x, prepack(w, torch.bfloat16), config=GLUON_CFGS[0])
        assert ulp_error(y, dense_ref(x, w), torch.bfloat16, "gluon_fallback") <= 2
        # gluon-only options (the heuristic's prefetch=4, a tuned split_tail) do not reach the Triton kernel
        assert torch.equal(w4_linear(x, prepack(w, torch.bfloat16), config=GLUON_CFGS[-1]), y)
        # nor do 8-token tiles, which the wgmma stand-in does not have (it takes 16)
        y8 = w4_linear(x[:5], prepack(w, torch.bfloat16), config=gsel.gluon_config(64, 8, 64))
        assert ulp_error(y8, dense_ref(x[:5], w), torch.bfloat16, "gluon_fallback") <= 2
        assert gsel.heuristic("dense", 70, 130, 96).prefetch == 4
        assert torch.equal(w4_linear(x, prepack(w, torch.bfloat16)), y)
        we = make_weight((3,), 72, 96, seed=3)
        offsets = torch.tensor([0, 5, 5, 9], dtype=torch.int32)
        xg = act((9, 96), torch.bfloat16, seed=4)
        yg = w4_grouped(xg, prepack(we, torch.bfloat16), offsets, config=GLUON_CFGS[0])
        assert ulp_error(yg, grouped_ref(xg, we, offsets), torch.bfloat16, "gluon_fallback") <= 2


def test_gluon_launchers_bind_every_argument(monkeypatch):
    """``launch_dense`` / ``launch_grouped`` pass the kernel its arguments by position: each tensor must
    reach the parameter of its name (a slip when the signature grows binds, say, the activation scale as the
    split-K counters). Checked on the CPU by recording the launches instead of running them."""
    from nvfp4_plugin.gemm import gluon_w4

    calls = []

    class Record:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                bound = dict(zip(self.fn.arg_names, args), **kwargs)
                assert set(self.fn.arg_names) <= set(bound), sorted(set(self.fn.arg_names) - set(bound))
                calls.append((self.fn, grid, bound))
            return launch

    monkeypatch.setattr(gluon_w4, "fast", Record)
    cpu = torch.device("cpu")
    d = torch.zeros(16, dtype=torch.int32)
    m, n, k = 32, 256, 4096
    p = prepack(make_weight((), n, k, seed=1, device=cpu), torch.bfloat16)
    x = act((m, k), torch.bfloat16, seed=2, device=cpu)
    y = torch.empty(m, n, dtype=torch.bfloat16)
    bias, scale, cnt = torch.ones(n, dtype=torch.bfloat16), torch.ones(1), torch.zeros(64, dtype=torch.int32)
    sizes = []

    def counters(device, size):
        sizes.append(size)
        return cnt

    split = gsel.gluon_config(64, 32, 64, split_k=4, prefetch=4)
    for fixup in (True, False):
        calls.clear()
        cfg = dataclasses.replace(split, fixup=fixup)
        gluon_w4.launch_dense(x, p, y, cfg, d, bias=bias, act_scale=scale, sms=132, counters=counters)
        kern, grid, b = calls[0]
        assert kern is gluon_w4.w4_wgmma_kernel and grid == (4 * 4,)      # 4 N tiles x 4 splits, one M tile
        assert b["bias_ptr"] is bias and b["y_ptr"] is y and b["actscale_ptr"] is scale
        assert b["ws_ptr"].dtype == torch.float32 and b["ws_ptr"].shape == (4, m, n)
        assert (b["cnt_ptr"] is cnt) == fixup and (b["cnt_ptr"] is d) != fixup
        assert all(b[name] is d for name in ("aux_ptr", "scatter_ptr", "rowscale_ptr"))
        assert (b["M"], b["N"], b["K_pad"], b["SPLIT_K"], b["DP_TILES"]) == (m, n, k, 4, 0)
        assert (b["MODE"], b["IS_SPLIT"], b["FIXUP"], b["HAS_BIAS"], b["ACT_SCALE"]) == (0, 1, int(fixup), 1, 1)
        # the reduce launch only without the fixup, over the same workspace
        assert len(calls) == 1 + (not fixup)
        if not fixup:
            kr, _, br = calls[1]
            assert kr is gluon_w4.w4_splitk_reduce_kernel and br["ws_ptr"] is b["ws_ptr"] and br["y_ptr"] is y
            assert br["bias_ptr"] is bias and (br["M"], br["N"], br["N0"], br["SPLIT_K"]) == (m, n, 0, 4)
    assert sizes == [4]                                          # a counter per tile (4 N tiles), fixup only
    # split_tail: 3 tiles (one per "SM") over all of K, the fourth split 4 ways: counters for that tile alone
    calls.clear()
    tail = dataclasses.replace(split, fixup=True, split_tail=True)
    gluon_w4.launch_dense(x, p, y, tail, d, sms=3, counters=counters)
    (kern, grid, b), = calls
    assert grid == (3 + 4,) and b["DP_TILES"] == 3 and b["ws_ptr"].shape == (4, m, n - 3 * 64) and sizes[-1] == 1
    # grouped: expert offsets, scatter, row scale and activation scales reach their parameters
    num_e = 3
    pe = prepack(make_weight((num_e,), n, k, seed=3, device=cpu), torch.bfloat16)
    offsets = torch.tensor([0, 10, 10, m], dtype=torch.int32)
    scatter, rowscale, scales = torch.arange(m, dtype=torch.int32), torch.ones(m), torch.ones(num_e)
    calls.clear()
    gluon_w4.launch_grouped(1, x, pe, y, GLUON_CFGS[0], offsets, d, m=m, m_split=1, scatter=scatter,
                            row_scale=rowscale, act_scale=scales)
    (kern, grid, b), = calls
    assert kern is gluon_w4.w4_wgmma_kernel and grid == (n // 64, num_e)
    assert b["aux_ptr"] is offsets and b["scatter_ptr"] is scatter and b["rowscale_ptr"] is rowscale
    assert b["actscale_ptr"] is scales and b["y_ptr"] is y
    assert all(b[name] is d for name in ("bias_ptr", "ws_ptr", "cnt_ptr"))
    flags = ("MODE", "IS_SPLIT", "FIXUP", "HAS_SCATTER", "HAS_ROWSCALE", "ACT_SCALE")
    assert tuple(b[f] for f in flags) == (1, 0, 0, 1, 1, 2)
    assert b["stride_qe"] == pe.words.stride(0) and b["stride_ae"] == pe.alpha.stride(0)


def test_outgrown_counter_buffers_stay_alive():
    """A CUDA graph captured with a stream's split-K counters keeps their address: when a larger call needs a
    bigger buffer, the old one is kept (not returned to the allocator for reuse under the graph's atomics)."""
    from nvfp4_plugin.gemm import api

    cpu = torch.device("cpu")
    key = ("cpu", None, 0)
    saved = api._COUNTERS.pop(key, None)
    try:
        small = api._counters(cpu, 16)
        assert api._counters(cpu, 100) is small and int(small.count_nonzero()) == 0
        big = api._counters(cpu, small.numel() + 1)
        assert big is not small and big.numel() > small.numel()
        assert any(r is small for r in api._RETIRED_COUNTERS)
    finally:
        api._COUNTERS.pop(key, None)
        if saved is not None:
            api._COUNTERS[key] = saved
