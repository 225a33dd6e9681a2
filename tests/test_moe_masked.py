"""The masked layout of the fused-MoE layer (expert-parallel low-latency dispatch: ``x [E, max_m, H]``
plus ``mask[E]``): ``Nvfp4FusedMoE.forward_masked`` on the reference backend and on hopper_triton (its
Triton kernels in the interpreter on the CPU, tests/conftest.py), against the standard layout.

What is pinned: each valid row of the masked forward is bit-for-bit the row the standard forward
computes for that token routed to that expert alone with weight 1, on both backends; rows past the mask
are never written; ids outside ``[0, E)`` in the standard layout (other ranks' experts) contribute
nothing; Hopper against the reference within the bound its offsets path meets."""

import logging

import pytest
import torch

from nvfp4_plugin import reference as ref
from nvfp4_plugin.layers import Nvfp4FusedMoE
from nvfp4_plugin.layers.backends.hopper import HopperMoe
from nvfp4_plugin.layers.base import ENV_ACT_MODE, ENV_MOE_BACKEND
from nvfp4_plugin.weights import Nvfp4Weight

from .gemm_cases import DEV, graph_replay, report_max_ulps, ulp_error  # noqa: F401  (autouse fixture)

E, H, INTER, MAX_M = 4, 64, 32, 6
SENTINEL = 7.0
#: empty, full, partial, above max_m (acts as max_m)
MASK = [0, MAX_M, 3, 100]


def weights(seed=1, e=E, h=H, inter=INTER):
    g = torch.Generator().manual_seed(seed)
    w13 = Nvfp4Weight.quantize(torch.randn(e, 2 * inter, h, generator=g)).to(DEV)
    w2 = Nvfp4Weight.quantize(torch.randn(e, h, inter, generator=g) * 0.2).to(DEV)
    # different activation scales per expert: a row quantized with another expert's scale shows
    a13 = torch.tensor([400.0, 300.0, 500.0, 450.0, 350.0, 420.0, 380.0, 460.0])[:e]
    a2 = torch.tensor([1500.0, 1200.0, 1800.0, 1000.0, 1100.0, 1300.0, 1700.0, 1400.0])[:e]
    return w13, w2, a13.to(DEV), a2.to(DEV)


def on_backend(backend, monkeypatch, *args, **kw):
    """An Nvfp4FusedMoE on ``backend``: chosen by name on a GPU (hopper_triton: sm_90); on the CPU the
    Hopper backend is prepared by hand and its kernels run in Triton's interpreter."""
    interpreted = backend == "hopper_triton" and DEV.type == "cpu"
    monkeypatch.setenv(ENV_MOE_BACKEND, "reference" if interpreted else backend)
    moe = Nvfp4FusedMoE(*args, **kw)
    if interpreted:
        moe.backend = HopperMoe()
        moe.tensors, moe.meta = moe.backend.prepare(moe.spec, *args[:4])
    assert moe.backend.name == backend
    return moe


def layer(mode, monkeypatch, backend="reference", seed=1, dtype=torch.bfloat16):
    monkeypatch.setenv(ENV_ACT_MODE, mode)
    moe = on_backend(backend, monkeypatch, *weights(seed), act_dtype=dtype)
    assert moe.mode == mode
    return moe


def masked_input(seed=3, dtype=torch.bfloat16, max_m=MAX_M):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, max_m, H, generator=g).to(dtype).to(DEV), torch.tensor(MASK, dtype=torch.int32).to(DEV)


def valid_rows(mask, max_m=MAX_M):
    return [min(int(v), max_m) for v in mask]


@pytest.mark.parametrize("backend", ["reference", "hopper_triton"])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_masked_rows_equal_the_standard_forward_per_expert(backend, mode, monkeypatch):
    """Row r < mask[e] of the masked output is the standard forward of token x[e, r] routed to expert
    e alone with weight 1, bit for bit (same weights, activation quantization, SiLU); rows past the
    mask keep what the output buffer held."""
    moe = layer(mode, monkeypatch, backend)
    x, mask = masked_input()
    out = torch.full_like(x, SENTINEL)
    assert moe.forward_masked(x, mask, out=out) is out
    for e, v in enumerate(valid_rows(mask)):
        assert (out[e, v:] == SENTINEL).all(), f"expert {e}: rows past mask[e]={v} were written"
        if v:
            ids = torch.full((v, 1), e, dtype=torch.int32, device=DEV)
            y = moe(x[e, :v].contiguous(), torch.ones(v, 1, device=DEV), ids)
            assert torch.equal(out[e, :v], y), f"expert {e} ({backend}, {mode})"


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_reference_masked_matches_the_fp32_reference(mode, monkeypatch):
    """Against reference.nvfp4_fused_moe (fp32 operands) per expert: bf16 rounding of the dequantized
    operands apart, the same math (the layer test's bound)."""
    moe = layer(mode, monkeypatch)
    w13, w2, a13, a2 = (t.to("cpu") for t in weights())
    x, mask = masked_input()
    out = moe.forward_masked(x, mask).cpu()
    x = x.cpu()
    kw = dict(mode=mode, a13_global_scale=a13, a2_global_scale=a2) if mode == "w4a4" else {}
    for e, v in enumerate(valid_rows(mask)):
        if not v:
            continue
        ids = torch.full((v, 1), e, dtype=torch.int32)
        expect = ref.nvfp4_fused_moe(x[e, :v], w13.packed, w13.block_scale, w13.global_scale, w2.packed,
                                     w2.block_scale, w2.global_scale, torch.ones(v, 1), ids, **kw).double()
        err = (out[e, :v].double() - expect).norm() / expect.norm()
        assert err < (1e-2 if mode == "w4a16" else 3e-2), (e, err)


def dispatch(x, topk_ids, num_experts, max_m):
    """What an expert-parallel dispatch hands the experts: each routed (token, slot) pair's token in the
    next free row of its expert, ``x_m [E, max_m, H]`` and ``mask[E]``; ``where[t, k]`` = that row."""
    x_m = torch.full((num_experts, max_m, x.shape[1]), float("nan"), dtype=x.dtype, device=x.device)  # garbage
    mask = torch.zeros(num_experts, dtype=torch.int32)
    where = torch.zeros_like(topk_ids, dtype=torch.int64)
    for t in range(topk_ids.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            where[t, k] = int(mask[e])
            x_m[e, where[t, k]] = x[t]
            mask[e] += 1
    return x_m, mask.to(x.device), where.to(x.device)


def combine(y_m, topk_weights, topk_ids, where):
    """The engine's combine: ``sum_k w[t, k] * y`` in fp32, rounded once."""
    acc = torch.zeros(topk_ids.shape[0], y_m.shape[2], dtype=torch.float32, device=y_m.device)
    for k in range(topk_ids.shape[1]):
        acc = acc + y_m[topk_ids[:, k].long(), where[:, k]].float() * topk_weights[:, k, None].float()
    return acc.to(y_m.dtype)


@pytest.mark.parametrize("backend", ["reference", "hopper_triton"])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_dispatch_masked_combine_equals_the_standard_forward(backend, mode, monkeypatch):
    """Dispatch -> forward_masked -> combine gives the bytes of the standard forward (top-2: the fp32
    sum of two terms does not depend on their order). On the data of test_gemm_grouped.py's
    test_fused_moe_matches_reference, so Hopper's masked path also meets the bound its offsets path
    meets there: 4 ulps of the output scale of the fp32 reference (reference.nvfp4_fused_moe)."""
    from .gemm_cases import act, make_weight

    monkeypatch.setenv(ENV_ACT_MODE, mode)
    num_e, h, inter, tokens, top_k = 4, 64, 32, 6, 2
    w13, w2 = make_weight((num_e,), 2 * inter, h, seed=81), make_weight((num_e,), h, inter, seed=82)
    x = act((tokens, h), torch.bfloat16, seed=83)
    logits = torch.randn(tokens, num_e, generator=torch.Generator().manual_seed(84))
    logits[:, 3] = -9                                   # one expert never routed: mask 0
    tw, ti = (t.to(DEV) for t in ref.route_topk(logits, top_k))
    a13, a2 = torch.tensor([30.0, 40.0, 50.0, 60.0], device=DEV), torch.tensor([300.0, 400.0, 500.0, 600.0], device=DEV)
    moe = on_backend(backend, monkeypatch, w13, w2, a13, a2)
    x_m, mask, where = dispatch(x, ti.cpu(), num_e, max_m=tokens + 1)
    y = combine(moe.forward_masked(x_m, mask), tw, ti, where)
    assert torch.equal(y, moe(x, tw, ti))
    if backend == "hopper_triton":
        kw = dict(mode=mode, a13_global_scale=a13.cpu(), a2_global_scale=a2.cpu()) if mode == "w4a4" else {}
        y_ref = ref.nvfp4_fused_moe(x.cpu(), w13.packed.cpu(), w13.block_scale.cpu(), w13.global_scale.cpu(),
                                    w2.packed.cpu(), w2.block_scale.cpu(), w2.global_scale.cpu(), tw.cpu(), ti.cpu(),
                                    **kw)
        assert ulp_error(y.cpu(), y_ref.double(), torch.bfloat16, f"masked_hopper_{mode}") <= 4


@pytest.mark.parametrize("backend", ["reference", "hopper_triton"])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_ids_outside_the_local_experts_contribute_nothing(backend, mode, monkeypatch):
    """Expert parallelism without all-to-all hands the layer every token with ids of other ranks' experts
    mapped to -1 (SGLang) or mapped by us (vLLM): such pairs must be skipped, not computed with weight 0
    by some local expert. Same bytes as the routing where those pairs carry weight 0 on a real expert
    (adding +-0 to the fp32 combine changes nothing), and no NaN when a skipped pair's token is NaN."""
    moe = layer(mode, monkeypatch, backend)
    g = torch.Generator().manual_seed(5)
    t, top_k = 7, 3
    x = torch.randn(t, H, generator=g).to(torch.bfloat16).to(DEV)
    tw, ti = (v.to(DEV) for v in ref.route_topk(torch.randn(t, E, generator=g), top_k))
    ti = ti.to(torch.int32)
    drop = torch.zeros_like(ti, dtype=torch.bool)
    drop[::2, 1] = True
    drop[3, :] = True                      # a token with no local expert at all
    drop[5, 0] = True
    skipped = torch.where(drop, torch.where(torch.arange(t, device=DEV)[:, None] % 2 == 0, -1, E), ti)  # -1 and E
    zeroed = torch.where(drop, torch.zeros_like(tw), tw)
    y = moe(x, tw, skipped)
    assert torch.equal(y, moe(x, zeroed, ti))
    assert (y[3] == 0).all()
    x_nan = x.clone()
    x_nan[3] = float("nan")                # token 3 is routed to no local expert: never computed
    y_nan = moe(x_nan, tw, skipped)
    assert not y_nan.isnan().any() and torch.equal(y_nan, y)


@pytest.mark.parametrize("backend", ["reference", "hopper_triton"])
def test_masked_edge_cases(backend, monkeypatch):
    moe = layer("w4a16", monkeypatch, backend)
    x, _ = masked_input()
    none = torch.zeros(E, dtype=torch.int32, device=DEV)
    out = torch.full_like(x, SENTINEL)
    moe.forward_masked(x, none, out=out)
    assert (out == SENTINEL).all()                      # mask 0 everywhere: nothing written
    empty = moe.forward_masked(x[:, :0], none)            # max_m = 0
    assert empty.shape == (E, 0, H)
    full = moe.forward_masked(x, torch.full((E,), MAX_M, dtype=torch.int32, device=DEV))
    assert torch.equal(full, moe.forward_masked(x, torch.full((E,), 1 << 30, dtype=torch.int32, device=DEV)))


def test_masked_argument_errors(monkeypatch):
    moe = layer("w4a16", monkeypatch)
    x, mask = masked_input()
    with pytest.raises(ValueError, match=r"x: expected \[E=4, max_m, H=64\], got \(3, 6, 64\)"):
        moe.forward_masked(x[:3], mask)
    with pytest.raises(TypeError, match="x: expected dtype torch.bfloat16"):
        moe.forward_masked(x.half(), mask)
    with pytest.raises(ValueError, match=r"mask: expected int32 \[4\] on .*, got torch.int64 \[4\]"):
        moe.forward_masked(x, mask.long())
    with pytest.raises(ValueError, match=r"out: expected torch.bfloat16 \[4, 6, 64\]"):
        moe.forward_masked(x, mask, out=torch.empty(4, 5, 64, dtype=torch.bfloat16, device=DEV))

    class NoMasked:                                     # a backend without apply_masked
        name = "flashinfer_cutlass_moe"

    moe.backend = NoMasked()
    assert not moe.supports_masked
    with pytest.raises(NotImplementedError, match="'flashinfer_cutlass_moe' has no masked-layout path"):
        moe.forward_masked(x, mask)


def test_masked_op_traces_and_logs_once(monkeypatch, caplog):
    """torch.compile traces the masked op (it mutates the engine's buffer: a functionalized custom op)
    and the first forward of a layer shape logs the masked path from inside the op."""
    from nvfp4_plugin.layers import registry

    moe = layer("w4a16", monkeypatch)
    x, mask = masked_input()
    monkeypatch.setattr(registry, "_MASKED_LOGGED", set())
    with caplog.at_level(logging.INFO, logger="nvfp4_plugin"):
        eager = moe.forward_masked(x, mask, out=torch.full_like(x, SENTINEL))
        moe.forward_masked(x, mask)

    def f(t, m):
        out = torch.full_like(t, SENTINEL)
        return moe.forward_masked(t, m, out=out) * 2

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, mask), eager * 2)
    lines = [r.getMessage() for r in caplog.records if "masked layout" in r.getMessage()]
    assert lines == ["nvfp4_plugin: fused MoE E=4 H=64 I=32 (w4a16): masked layout x[E, max_m=6, H] + mask[E] "
                     "(expert-parallel dispatch) on backend reference"]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("max_m", [16, 128, 512])
def test_gpu_hopper_masked_shapes_and_cuda_graph(mode, max_m, monkeypatch):
    """Hopper's masked path at DeepEP-like sizes (its Gluon kernels from 128 rows per expert on, the
    masked configs of gemm/select.py): within 4 ulps of the fp32 reference per expert, rows past the
    mask untouched, and a CUDA graph replay equal to the eager forward."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("hopper_triton runs on sm_90")
    num_e, h, inter = 8, 1024, 512
    monkeypatch.setenv(ENV_ACT_MODE, mode)
    w13, w2, a13, a2 = weights(seed=max_m, e=num_e, h=h, inter=inter)
    moe = on_backend("hopper_triton", monkeypatch, w13, w2, a13, a2)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(num_e, max_m, h, generator=g).to(torch.bfloat16).to(DEV)
    mask = torch.tensor([0, max_m, 1, max_m // 2, 3, max_m, 7, 2 * max_m], dtype=torch.int32, device=DEV)
    out = torch.full_like(x, SENTINEL)
    moe.forward_masked(x, mask, out=out)
    kw = dict(mode=mode, a13_global_scale=a13.cpu(), a2_global_scale=a2.cpu()) if mode == "w4a4" else {}
    for e in range(num_e):
        v = min(int(mask[e]), max_m)
        assert (out[e, v:] == SENTINEL).all()
        if v:
            ids = torch.full((v, 1), e, dtype=torch.int32)
            expect = ref.nvfp4_fused_moe(x[e, :v].cpu(), w13.packed.cpu(), w13.block_scale.cpu(),
                                         w13.global_scale.cpu(), w2.packed.cpu(), w2.block_scale.cpu(),
                                         w2.global_scale.cpu(), torch.ones(v, 1), ids, **kw)
            assert ulp_error(out[e, :v].cpu(), expect.double(), torch.bfloat16, f"gpu_masked_{mode}") <= 4
    graph_out = torch.full_like(x, SENTINEL)
    replayed = graph_replay(lambda: moe.forward_masked(x, mask, out=graph_out))
    assert torch.equal(replayed, out)
