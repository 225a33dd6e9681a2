"""The MoE glue kernels (routing, row gather, SiLU-and-mul, top-k combine): the same bytes as the torch
definitions they replace, on the CPU interpreter and on the GPU."""

import pytest
import torch

from nvfp4_plugin import numerics as nx
from nvfp4_plugin.gemm import moe_glue as G

from .test_cuda_quant import assert_same_values_nan_aware

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _ids(t, top_k, e, seed, invalid=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)]) if t else torch.zeros(0, top_k)
    ids = ids.to(torch.int64)
    if invalid and t:
        ids[0, 0], ids[-1, -1] = -1, e                       # outside [0, E): sorted last, skipped later
    return ids


@pytest.mark.parametrize("t,top_k,e,dtype,invalid", [
    (1, 8, 128, torch.int32, False), (3, 2, 8, torch.int64, False), (37, 4, 6, torch.int32, True),
    (150, 8, 16, torch.int64, True), (16, 1, 1, torch.int32, False)])
def test_routing_kernel_equals_stable_sort(t, top_k, e, dtype, invalid):
    ids = _ids(t, top_k, e, seed=t, invalid=invalid).to(dtype).to(DEV)
    got = G.moe_routing(ids, e)
    want = G._routing_torch(ids.reshape(-1).to(torch.int64), e, top_k)
    for name in ("expert_offsets", "gather_idx", "scatter_idx", "pair_pos"):
        assert torch.equal(got[name].cpu(), want[name].cpu()), name
    flat = ids.reshape(-1).cpu().long()
    counts = torch.stack([(flat == x).sum() for x in range(e)])
    assert torch.equal(want["expert_offsets"].cpu()[1:].long(), counts.cumsum(0))


@pytest.mark.parametrize("t,top_k,e,invalid,split", [
    (G.ROUTE_KERNEL_MAX_ROWS // 4 + 1, 4, 32, False, None),    # just past the one-program kernel
    (300, 8, 128, True, None),                                 # 2400 pairs: a partial last block
    (G.ROUTE_BLOCK_SMALL * 4, 6, 6, True, None),               # whole blocks, E + 1 not a power of two
    (300, 8, 128, True, 1024)])                                # large blocks (route_class 2; the split lowered
def test_routing_blocks_equal_stable_sort(t, top_k, e, invalid, split, monkeypatch):     # for the interpreter)
    """Beyond ROUTE_KERNEL_MAX_ROWS pairs the per-block counting sort (histograms, scan, placement): the
    same bytes as the stable sort, ids outside [0, E) last."""
    if split:
        monkeypatch.setattr(G, "ROUTE_BLOCK_SPLIT", split)
    assert t * top_k > G.ROUTE_KERNEL_MAX_ROWS
    assert G.route_class(t * top_k) == (2 if split else 1)
    ids = _ids(t, top_k, e, seed=t, invalid=invalid).to(DEV)
    if invalid:
        ids[t // 2, 1], ids[t // 3, 0] = -5, e + 3
    got = G.moe_routing(ids, e)
    want = G._routing_torch(ids.reshape(-1).to(torch.int64), e, top_k)
    for name in ("expert_offsets", "gather_idx", "scatter_idx", "pair_pos"):
        assert torch.equal(got[name].cpu(), want[name].cpu()), name
    valid = int(((ids >= 0) & (ids < e)).sum())
    assert int(got["expert_offsets"][-1]) == valid
    assert (valid < ids.numel()) == invalid


@pytest.mark.parametrize("block", [G.ROUTE_MIN_BLOCK, 512, 4096])
def test_routing_any_block_size_equals_stable_sort(block):
    # the benchmarks' block sizes: partial last blocks, a block wider than all pairs, scan tiles part-filled
    t, top_k, e = 333, 8, 128
    ids = _ids(t, top_k, e, seed=block, invalid=True).to(DEV)
    got = G.moe_routing(ids, e, block=block)
    want = G._routing_torch(ids.reshape(-1).to(torch.int64), e, top_k)
    for name in ("expert_offsets", "gather_idx", "scatter_idx", "pair_pos"):
        assert torch.equal(got[name].cpu(), want[name].cpu()), (block, name)
    assert torch.equal(want["scatter_idx"].long()[want["pair_pos"].long()], torch.arange(t * top_k, device=DEV))
    with pytest.raises(ValueError, match="block: expected a power of two >= 64, got 100"):
        G.moe_routing(ids, e, block=100)


def test_routing_reads_wide_int64_ids_as_invalid():
    # an int64 id that wraps to a valid expert when narrowed to int32 is still outside [0, E)
    ids = _ids(40, 4, 8, seed=3).to(DEV)
    ids[5, 2], ids[30, 0] = 2**32 + 1, -(2**32) + 3
    for t in (40, 300):                                       # one program; per-block kernels
        big = ids.repeat(t // 40 + 1, 1)[:t] if t > 40 else ids
        got = G.moe_routing(big, 8)
        want = G._routing_torch(big.reshape(-1), 8, 4)
        for name in ("expert_offsets", "gather_idx", "scatter_idx", "pair_pos"):
            assert torch.equal(got[name].cpu(), want[name].cpu()), (t, name)


@pytest.mark.gpu
@pytest.mark.parametrize("pairs", [257, 10_000, 40_000])
def test_gpu_routing_equals_stable_sort_every_class(pairs):
    # the compiled sort, scan and placement of every routing class on real hardware (the interpreter runs a
    # program's threads in lockstep): the same bytes as the stable sort, call after call
    g = torch.Generator().manual_seed(pairs)
    top_k, e = 8, 128
    t = -(-pairs // top_k)
    for rep in range(5):
        ids = torch.randint(-1, e + 1, (t, top_k), generator=g, dtype=torch.int32).cuda()
        got = G.moe_routing(ids, e)
        want = G._routing_torch(ids.reshape(-1).to(torch.int64), e, top_k)
        for name in ("expert_offsets", "gather_idx", "scatter_idx", "pair_pos"):
            assert torch.equal(got[name], want[name]), (pairs, rep, name)


def _special_values(dtype):
    vals = [0.0, -0.0, 1e-30, -1e-30, 1.0, -1.0, 0.5, 20.0, -20.0, 87.0, -87.0, 88.4, -88.4, 89.0, -89.0,
            100.0, -100.0, 1e4, -1e4, float("inf"), float("-inf"), float("nan")]
    tiny = torch.finfo(dtype).tiny
    vals += [tiny, -tiny, tiny / 4, -tiny / 4, torch.finfo(dtype).max, -torch.finfo(dtype).max]
    return torch.tensor(vals, dtype=torch.float32).to(dtype)


def _same_bytes(a, b):
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _assert_row_copy(copy, want):
    """``copy(out)`` gives ``want``'s bytes into a new tensor (``out=None``) and into a given one, which it returns."""
    assert _same_bytes(copy(None), want)
    out = torch.full_like(want, 7)
    assert copy(out) is out and _same_bytes(out, want)


@pytest.mark.parametrize("r,t,h,dtype", [(1, 1, 16, torch.bfloat16), (37, 5, 200, torch.bfloat16),
                                         (64, 9, 2048, torch.float16), (21, 4, 1100, torch.bfloat16),
                                         (19, 3, 40, torch.float32)])
def test_gather_rows_is_index_select(r, t, h, dtype):
    # rows of every pattern: repeated tokens, a partial last block of rows, two whole column passes
    # (h = 2 GATHER_BH) and a partial last one (1100), a width that is no multiple of 16
    g = torch.Generator().manual_seed(r)
    x = torch.randn(t, h, generator=g).to(dtype).to(DEV)
    x[0, 0] = float("nan")
    idx = torch.randint(0, t, (r,), generator=g, dtype=torch.int32).to(DEV)
    want = x.index_select(0, idx)
    _assert_row_copy(lambda out: G.gather_rows(x, idx, out=out), want)
    # a row-strided source (a view of wider rows) with a storage offset (from its second row on), and a
    # strided index (every other entry)
    wide = torch.randn(t + 1, h + 8, generator=g).to(dtype).to(DEV)
    src, sidx = wide[1:, :h], torch.stack([idx, idx], 1).reshape(-1)[::2]
    assert sidx.stride(0) == 2 and src.storage_offset() == h + 8
    assert _same_bytes(G.gather_rows(src, sidx), src.index_select(0, sidx))
    # the index_select fallbacks: a column-strided source, a column-strided out
    assert _same_bytes(G.gather_rows(x.t().contiguous().t(), idx), want)
    assert _same_bytes(G.gather_rows(x, idx, out=torch.empty((h, r), dtype=dtype, device=DEV).t()), want)


def test_gather_rows_checks_its_arguments():
    x = torch.zeros(4, 8, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(TypeError, match="idx: expected dtype int32"):
        G.gather_rows(x, torch.zeros(3, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match=r"out: expected shape \(3, 8\)"):
        G.gather_rows(x, torch.zeros(3, dtype=torch.int32, device=DEV), out=torch.empty(2, 8, dtype=torch.bfloat16,
                                                                                       device=DEV))
    assert G.gather_rows(x, torch.zeros(0, dtype=torch.int32, device=DEV)).shape == (0, 8)
    with pytest.raises(ValueError, match="x: no rows to gather from, but idx has 2 entries"):
        G.gather_rows(x[:0], torch.zeros(2, dtype=torch.int32, device=DEV))


@pytest.mark.parametrize("t,top_k,h,dtype", [(1, 8, 16, torch.bfloat16), (37, 4, 200, torch.bfloat16),
                                             (9, 8, 4096, torch.float16), (5, 3, 2100, torch.bfloat16),
                                             (6, 2, 40, torch.float32)])
def test_spread_rows_is_the_routed_gather(t, top_k, h, dtype):
    # each token's row to its top-k sorted positions: the rows gather_rows copies with routing's gather_idx
    # (a partial last token block, two whole column passes (h = 2 SPREAD_BH), a whole and a partial one, odd
    # widths; then the torch fallback for a column-strided out)
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=g).to(dtype).to(DEV)
    r = G.moe_routing(_ids(t, top_k, 16, seed=t).to(DEV), 16)
    want = G.gather_rows(x, r["gather_idx"])
    _assert_row_copy(lambda out: G.spread_rows(x, r["pair_pos"], out=out), want)
    strided = torch.empty((h, t * top_k), dtype=dtype, device=DEV).t()
    assert _same_bytes(G.spread_rows(x, r["pair_pos"], out=strided), want)


def test_spread_rows_checks_its_arguments():
    x = torch.zeros(3, 8, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="pair_pos: expected a multiple of x's 3 rows"):
        G.spread_rows(x, torch.zeros(4, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="out"):
        G.spread_rows(x, torch.zeros(6, dtype=torch.int32, device=DEV), out=torch.empty(5, 8, dtype=torch.bfloat16,
                                                                                      device=DEV))
    assert G.spread_rows(x[:0], torch.zeros(0, dtype=torch.int32, device=DEV)).shape == (0, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("table", [0, 1, -1])
def test_gpu_compiled_silu_and_mul_table_is_bit_exact(table):
    # the compiled kernel the MoE glue takes on the GPU, its bf16 lookup table forced on and off and left to
    # the size rule: every bf16 gate pattern (all 65536, NaN included) against every 16th up pattern, and a
    # prefill-sized call that takes the table by itself
    from nvfp4_plugin import _cuda_ops

    gates = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    ups = torch.arange(0, 65536, 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    i = 1024
    x = torch.cat([gates.view(-1, i), ups.repeat(16).view(-1, i)], 1)          # 64 rows of [gate | up]
    g = torch.Generator().manual_seed(2)
    big = (torch.randn(32768, 2 * 768, generator=g) * torch.logspace(-2, 1, 2 * 768)).to(torch.bfloat16)
    big[::97, 5] = _special_values(torch.bfloat16).repeat(16)[: big[::97].shape[0]]     # blocks off the table
    for inp in (x, big):
        got = _cuda_ops.silu_and_mul_into(inp.cuda(), torch.empty(inp.shape[0], inp.shape[1] // 2,
                                                                  dtype=inp.dtype, device="cuda"), table).cpu()
        assert_same_values_nan_aware(got, nx.silu_and_mul_fp32(inp), f"silu table={table} {tuple(inp.shape)}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("i", [72, 80])                     # 80: whole 16-value blocks (the compiled kernel on GPUs)
def test_silu_and_mul_is_bit_exact(dtype, i):
    g = torch.Generator().manual_seed(1)
    r = 37
    x = (torch.randn(r, 2 * i, generator=g) * torch.logspace(-3, 2, 2 * i)).to(dtype)
    sv = _special_values(dtype)
    x[0, : len(sv)] = sv                                    # gates
    x[1, i: i + len(sv)] = sv                               # ups
    x[2, : len(sv)] = sv
    x[2, i: i + len(sv)] = sv.flip(0)
    got = G.silu_and_mul(x.to(DEV)).cpu()
    assert_same_values_nan_aware(got, nx.silu_and_mul_fp32(x), f"silu {dtype} I={i}")


def test_silu_and_mul_checks_its_input():
    with pytest.raises(ValueError, match="even last dim"):
        G.silu_and_mul(torch.zeros(2, 3, dtype=torch.bfloat16, device=DEV))
    assert G.silu_and_mul(torch.zeros(0, 8, dtype=torch.bfloat16, device=DEV)).shape == (0, 4)


@pytest.mark.parametrize("t,top_k,h", [(1, 8, 96), (13, 4, 200), (64, 2, 2048)])
def test_combine_sums_in_slot_order(t, top_k, h):
    g = torch.Generator().manual_seed(t)
    e = 16
    ids = _ids(t, top_k, e, seed=t + 1, invalid=True).to(DEV)
    w = torch.rand(t, top_k, generator=g).to(DEV)
    y = torch.randn(t * top_k, h, generator=g).to(torch.bfloat16).to(DEV)
    y[0] = float("nan")                                     # the pair routed to expert -1: never read
    got = G.moe_combine(y, w, ids, e).cpu()
    acc = torch.zeros(t, h)
    for k in range(top_k):
        ok = ((ids[:, k] >= 0) & (ids[:, k] < e)).cpu()[:, None]
        acc = acc + torch.where(ok, y.view(t, top_k, h)[:, k].cpu().float() * w[:, k, None].cpu(), 0.0)
    assert torch.equal(got, acc.to(torch.bfloat16))


def test_combine_reads_strided_routing_tensors():
    g = torch.Generator().manual_seed(7)
    t, top_k, h, e = 5, 3, 64, 8
    ids = _ids(t, top_k, e, seed=9).to(DEV)
    w = torch.rand(t, top_k, generator=g).to(DEV)
    y = torch.randn(t * top_k, h, generator=g).to(torch.bfloat16).to(DEV)
    ids_t, w_t = ids.t().contiguous().t(), w.t().contiguous().t()       # column-major views
    assert ids_t.stride(1) != 1 and w_t.stride(1) != 1
    assert torch.equal(G.moe_combine(y, w_t, ids_t, e), G.moe_combine(y, w, ids, e))
