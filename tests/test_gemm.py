"""Hopper FP4-weight GEMMs (dense, grouped by expert offsets, masked) against the reference.

Reference = dequantize (fp32), then fp32 matmul (``nvfp4_plugin.reference``); the kernels must match
to bf16/fp16 rounding: max abs error <= 2 ulps of the output scale (``ulp(max |y_ref|)``). Observed
errors are recorded in ``MAX_ULP_SEEN`` and printed at the end of the module (``pytest -s``).

Without a GPU the kernels run in Triton's interpreter (nvfp4_plugin.gemm picks it at import when
CUDA is unavailable; nothing here changes the environment of other test modules). The same tests at
larger sizes, plus CUDA-graph capture and split-K determinism, are marked ``gpu``.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton's CPU interpreter; must be set before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nvfp4_plugin import numerics as nx  # noqa: E402
from nvfp4_plugin import reference as ref  # noqa: E402
from nvfp4_plugin.gemm import (W4Config, prepack, select_config, w4_dequantize, w4_grouped, w4_linear,  # noqa: E402
                               w4_masked)
from nvfp4_plugin.gemm import select as gsel  # noqa: E402
from nvfp4_plugin.gemm import triton_w4  # noqa: E402
from nvfp4_plugin.weights import Nvfp4Weight  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEV = torch.device("cuda" if ON_GPU else "cpu")
MAX_ULP_SEEN: dict = {}

V2_8 = W4Config(bn=64, bm=8, bk=64, v2=True)
V3_16 = W4Config(bn=64, bm=16, bk=128)
BN128 = W4Config(bn=128, bm=32, bk=64, num_warps=8)
SPLIT = W4Config(bn=64, bm=8, bk=64, v2=True, split_k=3)
BK256 = W4Config(bn=64, bm=16, bk=256, split_k=2)
V2_16 = W4Config(bn=64, bm=16, bk=64, v2=True)
BN32 = W4Config(bn=32, bm=8, bk=128, v2=True, num_warps=2)
CONFIGS = {"v2_bm8": V2_8, "v3_bm16": V3_16, "bn128": BN128, "splitk3": SPLIT, "bk256_split2": BK256,
           "v2_bm16": V2_16, "bn32": BN32, "dequant_mm": W4Config(dequant_mm=True)}


def ulp_error(y: torch.Tensor, y_ref: torch.Tensor, dtype: torch.dtype, tag: str) -> float:
    """max |y - y_ref| in ulps of the output scale max |y_ref| (bf16: 8 significant bits, fp16: 11)."""
    if y_ref.numel() == 0:
        return 0.0
    assert not torch.isnan(y).any()
    scale = y_ref.abs().max().item()
    if scale == 0:
        return float(y.abs().max().item() != 0) * 1e9
    ulp = 2.0 ** (math.floor(math.log2(scale)) - (7 if dtype == torch.bfloat16 else 10))
    err = (y.double() - y_ref.double()).abs().max().item() / ulp
    MAX_ULP_SEEN[tag] = max(MAX_ULP_SEEN.get(tag, 0.0), err)
    return err


def graph_replay(fn, replays: int = 1):
    """Capture ``fn()`` in a CUDA graph, replay it, and return the captured output tensor."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    for _ in range(replays):
        g.replay()
    torch.cuda.synchronize()
    return out


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    seen = {k: round(v, 3) for k, v in sorted(MAX_ULP_SEEN.items()) if not k.startswith("_")}
    if seen:
        print("\nmax error in ulps of the output scale:", seen)


def make_weight(lead, n, k, seed, device=DEV):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*lead, n, k, generator=g) * (torch.rand(*lead, n, 1, generator=g) + 0.1)
    return Nvfp4Weight.quantize(w).to(device)


def act(shape, dtype, seed, device=DEV):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def dense_ref(x, w: Nvfp4Weight, bias=None, mode="w4a16", gs=None):
    """fp32 reference before output rounding: dequantize (fp32), fp32 matmul."""
    k = w.k
    x2 = x.reshape(-1, k)
    if mode == "w4a4":
        q, s = ref.scaled_fp4_quant(x2.cpu(), gs.cpu(), swizzle=False)
        xf = ref.dequantize_fp4(q, s, gs.cpu(), swizzled=False, m=x2.shape[0], k=k).to(x.device)
    else:
        xf = x2.float()
    y = xf.double() @ w.dequantize(torch.float64).t()
    if bias is not None:
        y = y + bias.double()
    return y.reshape(*x.shape[:-1], w.n)


# ----------------------------------------------------------------------------------------------
# dense
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (5, 100, 208), (17, 130, 96)])
def test_dense_configs(cfg_name, m, n, k):
    dtype = torch.bfloat16 if (m + len(cfg_name)) % 2 else torch.float16
    w = make_weight((), n, k, seed=m * 7 + n)
    p = prepack(w, dtype)
    x = act((m, k), dtype, seed=k)
    y = w4_linear(x, p, config=CONFIGS[cfg_name])
    assert y.shape == (m, n) and y.dtype == dtype
    assert ulp_error(y, dense_ref(x, w), dtype, f"dense/{dtype}") <= 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_bias_leading_dims_and_heuristic_config(dtype):
    w = make_weight((), 48, 80, seed=3)
    p = prepack(w, dtype)
    x = act((2, 3, 80), dtype, seed=4)
    bias = act((48,), dtype, seed=5)
    y = w4_linear(x, p, bias)
    assert y.shape == (2, 3, 48)
    assert ulp_error(y, dense_ref(x, w, bias), dtype, f"dense/{dtype}") <= 2
    # matches the reference op's rounding too
    yr = ref.nvfp4_linear(x.cpu(), w.packed.cpu(), w.block_scale.cpu(), w.global_scale.cpu(), bias.cpu())
    assert ulp_error(y.cpu(), yr.double(), dtype, "dense_vs_ref_op") <= 2


def test_dense_m0_and_k_not_multiple_of_tile():
    w = make_weight((), 64, 48, seed=9)
    p = prepack(w, torch.bfloat16)
    y = w4_linear(torch.empty(0, 48, dtype=torch.bfloat16, device=DEV), p)
    assert y.shape == (0, 64)
    x = act((3, 48), torch.bfloat16, seed=1)
    for cfg in (V2_8, W4Config(bn=64, bm=16, bk=256, split_k=1)):
        assert ulp_error(w4_linear(x, p, config=cfg), dense_ref(x, w), torch.bfloat16, "dense/k48") <= 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", [V2_8, V3_16, SPLIT])
def test_dense_w4a4(dtype, cfg):
    w = make_weight((), 64, 96, seed=11)
    p = prepack(w, dtype)
    x = act((6, 96), dtype, seed=12)
    gs = nx.tensor_global_scale(x.float()).reshape(1).to(DEV)
    bias = act((64,), torch.float32, seed=2)
    y = w4_linear(x, p, bias, mode="w4a4", input_global_scale=gs, config=cfg)
    y_ref = dense_ref(x, w, bias, mode="w4a4", gs=gs)
    assert ulp_error(y, y_ref, dtype, f"dense_w4a4/{dtype}") <= 2
    # the activation quantization is really applied
    assert ulp_error(w4_linear(x, p, bias, config=cfg), y_ref, dtype, "_w4a16_vs_w4a4") > 2


def test_dense_argument_errors():
    w = make_weight((), 32, 64, seed=0)
    p = prepack(w, torch.bfloat16)
    with pytest.raises(TypeError, match="x: expected dtype"):
        w4_linear(act((2, 64), torch.float16, 0), p)
    with pytest.raises(ValueError, match="x: expected last dim K=64"):
        w4_linear(act((2, 32), torch.bfloat16, 0), p)
    with pytest.raises(ValueError, match="input_global_scale"):
        w4_linear(act((2, 64), torch.bfloat16, 0), p, mode="w4a4")
    with pytest.raises(ValueError, match="bias"):
        w4_linear(act((2, 64), torch.bfloat16, 0), p, act((31,), torch.bfloat16, 0))
    with pytest.raises(ValueError, match="bm=8"):
        W4Config(bm=8)


def test_dequantize_kernel_is_exact():
    w = make_weight((2,), 70, 208, seed=21)
    for dtype in (torch.bfloat16, torch.float16):
        p = prepack(w, dtype)
        d = w4_dequantize(p).double()
        exact = nx.e2m1_decode(nx.unpack_fp4(w.packed)).double().reshape(2, 70, 13, 16) \
            * w.block_scale.double()[..., None] / 256
        assert torch.equal(d, exact.reshape(2, 70, 208))
        # with the global scale applied: one rounding of the reference dequantization
        full = w4_dequantize(p, apply_alpha=True, dtype=torch.float32)
        assert torch.allclose(full.cpu(), w.dequantize().cpu(), rtol=2**-22, atol=0)


SS64 = W4Config(bn=64, bm=64, bk=64, ss=True)
FUZZ_CONFIGS = [V2_8, V3_16, BN128, SPLIT, BK256, V2_16, BN32, W4Config(bn=128, bm=64, bk=128, num_warps=8, split_k=2),
                SS64]


@settings(max_examples=12, deadline=None, derandomize=True)
@given(m=st.sampled_from([0, 1, 2, 3, 7, 8, 9, 16, 31, 33]), n=st.integers(1, 140),
       kb=st.integers(1, 20), cfg=st.sampled_from(FUZZ_CONFIGS), fp16=st.booleans(), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_dense_fuzz(m, n, kb, cfg, fp16, bias, seed):
    dtype = torch.float16 if fp16 else torch.bfloat16
    k = 16 * kb
    w = make_weight((), n, k, seed=seed)
    p = prepack(w, dtype)
    x = act((m, k), dtype, seed=seed + 1)
    b = act((n,), dtype, seed=seed + 2) if bias else None
    y = w4_linear(x, p, b, config=cfg)
    assert y.shape == (m, n)
    assert ulp_error(y, dense_ref(x, w, b), dtype, f"dense_fuzz/{dtype}") <= 2


# ----------------------------------------------------------------------------------------------
# grouped by expert offsets
# ----------------------------------------------------------------------------------------------

def routing(num_tokens, num_experts, top_k, seed, device=DEV):
    """Top-k routing as an MoE layer sorts it: pair order, expert offsets [E+1], token per pair."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    scores[:, 1] = -1  # expert 1 never chosen: an expert with zero rows
    topk_w, topk_ids = torch.topk(scores.softmax(-1), top_k, dim=-1)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(counts, 0)
    return (order.to(torch.int32).to(device), offsets.to(device), (order // top_k).to(torch.int32).to(device),
            topk_w.reshape(-1).float().to(device))


def grouped_ref(x, w: Nvfp4Weight, offsets, gather=None, scatter=None, row_scale=None, n_out=None,
                mode="w4a16", gs=None):
    """fp64 reference, one batched matmul per expert (on x's device); returns a CPU tensor."""
    wd = w.dequantize(torch.float64).to(x.device)
    offs = offsets.cpu().tolist()
    rows = gather.shape[0] if gather is not None else x.shape[0]
    out = torch.zeros((n_out or rows, w.n), dtype=torch.float64, device=x.device)
    for e in range(w.packed.shape[0]):
        lo, hi = offs[e], offs[e + 1]
        if hi <= lo:
            continue
        r = torch.arange(lo, hi, device=x.device)
        src = gather.to(x.device).long()[r] if gather is not None else r
        xr = x[src]
        if mode == "w4a4":
            q, s = ref.scaled_fp4_quant(xr, gs[e:e + 1], swizzle=False)
            xr = ref.dequantize_fp4(q, s, gs[e:e + 1], swizzled=False, m=hi - lo, k=w.k)
        y = xr.double() @ wd[e].t()
        d = scatter.to(x.device).long()[r] if scatter is not None else r
        if row_scale is not None:
            y = y * row_scale.to(x.device).double()[d][:, None]
        out[d] = y
    return out.cpu()


@pytest.mark.parametrize("cfg", [None, V2_8, W4Config(bn=64, bm=16, bk=64, m_split=2), BN128, BN32, SS64])
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


@pytest.mark.parametrize("cfg", [V2_8, W4Config(bn=64, bm=16, bk=128, m_split=3)])
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


@pytest.mark.parametrize("cfg", [None, V2_8, W4Config(bn=64, bm=16, bk=64, m_split=2)])
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
       cfg=st.sampled_from([None, V2_8, V3_16, W4Config(bn=64, bm=16, bk=64, m_split=3)]), gather=st.booleans(),
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


# ----------------------------------------------------------------------------------------------
# masked
# ----------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------
# config selection
# ----------------------------------------------------------------------------------------------

def test_config_selection_from_json(tmp_path, monkeypatch):
    table = {"device": "x", "dense": {"N=256,K=512": {"4": {"bm": 8, "v2": True, "split_k": 4},
                                                      "64": {"bm": 64, "bn": 128, "num_warps": 8}}}}
    (tmp_path / f"{gsel.device_key()}.json").write_text(__import__("json").dumps(table))
    monkeypatch.setenv(gsel.ENV_CONFIG_DIR, str(tmp_path))
    gsel.clear_cache()
    try:
        assert select_config("dense", 1, 256, 512) == W4Config(bm=8, v2=True, split_k=4)
        assert select_config("dense", 4, 256, 512).split_k == 4
        assert select_config("dense", 5, 256, 512).bm == 64
        # beyond the largest tuned bucket the heuristic decides (a table tuned for decode sizes only
        # must not send prefill through its decode tiles)
        assert select_config("dense", 64, 256, 512).bm == 64
        assert select_config("dense", 65, 256, 512) == gsel.heuristic("dense", 65, 256, 512)
        assert select_config("dense", 5000, 256, 512) == gsel.heuristic("dense", 5000, 256, 512)
        assert select_config("dense", 5, 256, 1024) == gsel.heuristic("dense", 5, 256, 1024)
    finally:
        monkeypatch.delenv(gsel.ENV_CONFIG_DIR)
        gsel.clear_cache()


def test_heuristics_are_valid_for_the_target_shapes():
    for m in (1, 4, 16, 64, 256, 1024, 4096):
        for n, k in [(6144, 4096), (28672, 4096), (4096, 14336), (7168, 2048), (2048, 7168)]:
            c = gsel.heuristic("dense", m, n, k)
            assert c.bm >= min(m, 8) or c.bm == 8
            assert c.split_k >= 1
        for e, n, k in [(128, 1536, 2048), (128, 2048, 768), (256, 4096, 7168), (256, 7168, 2048)]:
            gsel.heuristic("grouped", m * 8, n, k, e)
            gsel.heuristic("masked", min(m, 256), n, k, e)
    for kind, entries in gsel.load_table(gsel.device_key()).items() if gsel.load_table(gsel.device_key()) else []:
        assert kind in gsel.KINDS


def test_shipped_config_files_parse():
    import json
    for path in gsel.CONFIG_DIR.glob("*.json"):
        table = json.loads(path.read_text())
        for kind in gsel.KINDS:
            for shape, buckets in table.get(kind, {}).items():
                for b, c in buckets.items():
                    W4Config.from_json(c)
                    int(b)


# ----------------------------------------------------------------------------------------------
# GPU: larger shapes, CUDA graphs, determinism
# ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 16, 37, 64, 256, 1000])
@pytest.mark.parametrize("n,k", [(1024, 2048), (4096, 1024), (1000, 4112)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_dense_shapes(m, n, k, dtype):
    w = make_weight((), n, k, seed=m + n)
    p = prepack(w, dtype)
    x = act((m, k), dtype, seed=k)
    y_ref = dense_ref(x, w)
    assert ulp_error(w4_linear(x, p), y_ref, dtype, f"gpu_dense/{dtype}") <= 2
    # every kind of config selection can hand out
    for cfg in (V2_8, V2_16, V3_16, BN128, W4Config(bn=128, bm=128, bk=64, num_warps=8, num_stages=4),
                W4Config(bn=64, bm=8, bk=256, v2=True, split_k=8), W4Config(dequant_mm=True), SS64,
                W4Config(bn=128, bm=128, bk=64, num_warps=8, num_stages=4, ss=True),
                W4Config(bn=256, bm=128, bk=64, num_warps=8, num_stages=3, ss=True)):
        assert ulp_error(w4_linear(x, p, config=cfg), y_ref, dtype, f"gpu_dense/{dtype}") <= 2, cfg


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shards", [False, True], ids=["one_gs", "shard_gs"])
@pytest.mark.parametrize("bias_dtype", [None, "act", torch.float32])
def test_gpu_dequant_mm_epilogues(dtype, shards, bias_dtype):
    """Every epilogue of the cuBLAS large-M path: one global scale (alpha and bias in the GEMM) or
    per-shard scales (fp32 product, one scaling pass), with no / activation-dtype / fp32 bias, and w4a4."""
    n, k, m = 384, 512, 600
    w = make_weight((), n, k, seed=11)
    if shards:
        w = Nvfp4Weight.from_shards(w.packed, w.block_scale, [w.global_scale[0].item() * f for f in (1.0, 0.3, 3.0)],
                                    [128, 192, 64])
    p = prepack(w, dtype)
    assert (p.layout.alpha_const is None) == shards
    x = act((m, k), dtype, seed=12)
    bias = None if bias_dtype is None else act((n,), dtype, seed=13).to(dtype if bias_dtype == "act" else bias_dtype)
    cfg = W4Config(dequant_mm=True)
    y = w4_linear(x, p, bias, config=cfg)
    assert y.dtype == dtype and y.shape == (m, n)
    assert ulp_error(y, dense_ref(x, w, bias), dtype, f"dequant_mm/{dtype}") <= 2
    gs = nx.tensor_global_scale(x.float()).reshape(1)
    y4 = w4_linear(x, p, bias, mode="w4a4", input_global_scale=gs, config=cfg)
    assert ulp_error(y4, dense_ref(x, w, bias, mode="w4a4", gs=gs), dtype, f"dequant_mm_w4a4/{dtype}") <= 2


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [W4Config(bn=128, bm=128, bk=64, num_warps=8, num_stages=4),
                                 W4Config(bn=128, bm=128, bk=64, num_warps=8, num_stages=3),
                                 W4Config(bn=128, bm=256, bk=64, num_warps=8, num_stages=3),
                                 W4Config(bn=128, bm=128, bk=64, num_warps=8, num_stages=4, ss=True),
                                 W4Config(bn=128, bm=256, bk=64, num_warps=8, num_stages=3, ss=True)],
                         ids=["bm128s4", "bm128s3", "bm256s3", "ss_bm128s4", "ss_bm256s3"])
def test_gpu_large_token_tiles(cfg):
    """The multi-wave shapes on which bm>=128 wgmma programs raced before the fix (select.MAX_SAFE_BM)."""
    assert cfg.bm <= gsel.MAX_SAFE_BM
    w = make_weight((), 4096, 4096, seed=4096)
    for dtype in (torch.bfloat16, torch.float16):
        p = prepack(w, dtype)
        for m in (1000, 1024, 2048):
            x = act((m, 4096), dtype, seed=m)
            for _ in range(3):  # the race varied from run to run
                assert ulp_error(w4_linear(x, p, config=cfg), dense_ref(x, w), dtype, f"bm{cfg.bm}") <= 2


def test_selection_stays_within_max_safe_bm(monkeypatch):
    for kind, m, n, k, e in (("dense", 1000, 4096, 1024, 1), ("dense", 4096, 28672, 4096, 1),
                             ("grouped", 32768, 4096, 7168, 256), ("masked", 256, 4096, 7168, 256)):
        cfg = select_config(kind, m, n, k, e, device=torch.device("cpu"))
        assert cfg.dequant_mm or cfg.bm <= gsel.MAX_SAFE_BM, (kind, m, n, k, cfg)
    assert gsel.safe(W4Config(bm=256)).bm == min(256, gsel.MAX_SAFE_BM)
    monkeypatch.setattr(gsel, "MAX_SAFE_BM", 64)  # the clamp, should a Triton upgrade bring the race back
    assert gsel.safe(W4Config(bm=128)).bm == 64
    assert gsel.safe(W4Config(dequant_mm=True)).dequant_mm
    assert gsel.safe(W4Config(bm=128, ss=True)).bm == 128  # shared-memory operands: no register race


def test_ss_config_validation():
    assert W4Config(bn=256, bm=128, ss=True, num_warps=8).bn == 256
    with pytest.raises(ValueError, match="ss .*needs v2=False and bm >= 64"):
        W4Config(bm=32, ss=True)
    with pytest.raises(ValueError, match="W4Config.bn"):
        W4Config(bn=256, bm=128)
    assert W4Config.from_json(W4Config(bm=64, ss=True).to_json()) == W4Config(bm=64, ss=True)
    # a 256-wide tile must divide the padded N (its weight loads are unmasked along N)
    wide = W4Config(bn=256, bm=64, bk=64, num_warps=8, ss=True)
    for n in (72, 384):
        p = prepack(make_weight((), n, 64, seed=n), torch.bfloat16)
        with pytest.raises(ValueError, match=f"bn=256 needs the padded N \\({p.layout.n_pad}\\)"):
            w4_linear(act((3, 64), torch.bfloat16, seed=1), p, config=wide)
    w = make_weight((), 500, 64, seed=5)  # padded to 512: fine
    x = act((65, 64), torch.bfloat16, seed=6)
    assert ulp_error(w4_linear(x, prepack(w, torch.bfloat16), config=wide), dense_ref(x, w), torch.bfloat16, "ss256") <= 2


GLUON_CFGS = [W4Config(bn=64, bm=128, bk=64, num_warps=4, num_stages=4, gluon=True),
               W4Config(bn=64, bm=256, bk=64, num_warps=4, num_stages=3, gluon=True, split_k=3),
               W4Config(bn=128, bm=128, bk=128, num_warps=8, num_stages=3, gluon=True),
               W4Config(bn=128, bm=256, bk=128, num_warps=8, num_stages=2, gluon=True, split_k=2),
               W4Config(bn=64, bm=64, bk=128, num_warps=4, num_stages=2, gluon=True, split_k=8),
               # weights 4 K steps ahead: K steps per split 1, 17, 65 and 32 (11 / 11 / 10 with split 3)
               # leave 0-3 steps after the unrolled loop
               W4Config(bn=64, bm=128, bk=64, num_warps=4, num_stages=4, gluon=True, prefetch=4),
               W4Config(bn=128, bm=256, bk=64, num_warps=8, num_stages=2, gluon=True, split_k=3, prefetch=4),
               # split only the tiles past the last whole wave: at 1030 x 4100 (585 tiles of 128 rows x 64 on 132
               # SMs) 522 tiles over all of K and 63 split 2 ways (N columns 3712-4099, the last one ragged),
               # at 333 x 1000 (48 tiles) all split
               W4Config(bn=64, bm=128, bk=64, num_warps=4, num_stages=4, gluon=True, split_k=2, prefetch=4,
                        split_tail=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GLUON_CFGS, ids=["bn64bm128", "bn64bm256split3", "bn128bm128bk128",
                                                  "bn128bm256split2", "bn64bm64split8", "bn64bm128pf4",
                                                  "bn128bm256split3pf4", "bn64bm128splittail"])
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


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [GLUON_CFGS[0], GLUON_CFGS[2], W4Config(bn=64, bm=128, bk=128, num_warps=4,
                                                                         num_stages=3, gluon=True, m_split=2),
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


def test_gluon_config_validation_and_selection():
    with pytest.raises(ValueError, match="gluon needs bn 64 or 128 with bn/16 warps"):
        W4Config(bn=128, bm=128, num_warps=4, gluon=True)
    with pytest.raises(ValueError, match="gluon excludes"):
        W4Config(bn=64, bm=128, v2=True, gluon=True)
    with pytest.raises(ValueError, match="does not fit"):
        W4Config(bn=64, bm=256, bk=128, num_warps=4, num_stages=4, gluon=True)
    assert W4Config.from_json(GLUON_CFGS[1].to_json()) == GLUON_CFGS[1]
    with pytest.raises(ValueError, match="gluon options"):
        W4Config(bn=64, bm=128, split_k=2, split_tail=True)
    with pytest.raises(ValueError, match="needs split_k >= 2"):
        W4Config(bn=64, bm=128, num_warps=4, gluon=True, split_tail=True)
    with pytest.raises(ValueError, match="prefetch"):
        W4Config(bn=64, bm=128, num_warps=4, gluon=True, prefetch=3)
    # split_tail: whole waves of one tile per SM over all of K, rounded down to whole N columns of tiles
    from nvfp4_plugin.gemm import gluon_w4
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
        assert gsel.heuristic("dense", 70, 130, 96).prefetch == 4
        assert torch.equal(w4_linear(x, prepack(w, torch.bfloat16)), y)
        we = make_weight((3,), 72, 96, seed=3)
        offsets = torch.tensor([0, 5, 5, 9], dtype=torch.int32)
        xg = act((9, 96), torch.bfloat16, seed=4)
        yg = w4_grouped(xg, prepack(we, torch.bfloat16), offsets, config=GLUON_CFGS[0])
        assert ulp_error(yg, grouped_ref(xg, we, offsets), torch.bfloat16, "gluon_fallback") <= 2


@pytest.mark.gpu
def test_gpu_split_k_deterministic_and_graph_capturable():
    w = make_weight((), 2048, 4096, seed=1)
    p = prepack(w, torch.bfloat16)
    x = act((4, 4096), torch.bfloat16, seed=2)
    cfg = W4Config(bn=64, bm=8, bk=256, v2=True, split_k=8)
    y1 = w4_linear(x, p, config=cfg)
    y2 = w4_linear(x, p, config=cfg)
    assert torch.equal(y1, y2)
    yg = graph_replay(lambda: w4_linear(x, p, config=cfg), replays=3)
    assert torch.equal(yg, y1)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 64, 300])
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


@pytest.mark.gpu
def test_gpu_uses_compiled_kernels():
    assert not triton_w4.INTERPRET


# ----------------------------------------------------------------------------------------------
# the whole MoE from the grouped GEMM, against reference.nvfp4_fused_moe
# ----------------------------------------------------------------------------------------------

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


@pytest.mark.parametrize("m", [1, 64, 65, 200])
def test_dense_ss_tiles(m):
    """Shared-memory wgmma tiles (tokens as M) give the reference on ragged M, N and K."""
    dtype = torch.bfloat16
    w = make_weight((), 72, 208, seed=m)
    p = prepack(w, dtype)
    x = act((m, 208), dtype, seed=m + 1)
    for cfg in (SS64, W4Config(bn=128, bm=128, bk=128, num_warps=8, ss=True)):
        assert ulp_error(w4_linear(x, p, config=cfg), dense_ref(x, w), dtype, "dense_ss") <= 2, cfg
