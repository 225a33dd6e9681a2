"""Shared by the Hopper FP4-weight GEMM tests (test_gemm_*.py): configs of every kernel family,
weights and activations, the fp64 references (dense, grouped by expert offsets), routing, and the
error measure.

Reference = dequantize (fp32), then a float64 matmul (``nvfp4_plugin.reference``); the kernels must
match to bf16/fp16 rounding: max abs error <= 2 ulps of the output scale (``ulp(max |y_ref|)``).
Observed errors are recorded in ``MAX_ULP_SEEN`` and printed at the end of each module (``pytest -s``)
by the autouse fixture ``report_max_ulps``, which the test modules import.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET``
before anything imports triton).
"""

import math

import pytest
import torch

from nvfp4_plugin import reference as ref
from nvfp4_plugin.gemm import DequantMmConfig, TritonMmaConfig, TritonWgmmaConfig
from nvfp4_plugin.weights import Nvfp4Weight

ON_GPU = torch.cuda.is_available()
DEV = torch.device("cuda" if ON_GPU else "cpu")
MAX_ULP_SEEN: dict = {}

V2_8 = TritonMmaConfig(bn=64, bm=8, bk=64)
V3_16 = TritonWgmmaConfig(bn=64, bm=16, bk=128)
BN128 = TritonWgmmaConfig(bn=128, bm=32, bk=64, num_warps=8)
SPLIT = TritonMmaConfig(bn=64, bm=8, bk=64, split_k=3)
BK256 = TritonWgmmaConfig(bn=64, bm=16, bk=256, split_k=2)
V2_16 = TritonMmaConfig(bn=64, bm=16, bk=64)
BN32 = TritonMmaConfig(bn=32, bm=8, bk=128, num_warps=2)
SS64 = TritonWgmmaConfig(bn=64, bm=64, bk=64, ss=True)

CONFIGS = {"v2_bm8": V2_8, "v3_bm16": V3_16, "bn128": BN128, "splitk3": SPLIT, "bk256_split2": BK256,
           "v2_bm16": V2_16, "bn32": BN32, "dequant_mm": DequantMmConfig()}


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
def report_max_ulps():
    yield
    seen = {k: round(v, 3) for k, v in sorted(MAX_ULP_SEEN.items()) if not k.startswith("_")}
    MAX_ULP_SEEN.clear()
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
