"""Start-up compilation: a layer's warm-up runs one forward per kernel variant it can launch, so that
no request later waits for a compiler (the first batch of 64 once ran at half the speed of the second)."""

import pytest
import torch

from nvfp4_plugin.gemm import api, moe_glue, prepack, warmup_sizes_fused_moe, warmup_sizes_linear
from nvfp4_plugin.gemm.select import config_fn, first_sizes
from nvfp4_plugin.layers import Nvfp4FusedMoE, Nvfp4Linear
from nvfp4_plugin.weights import Nvfp4Weight


def test_first_sizes_keeps_the_smallest_size_of_each_key():
    assert first_sizes(lambda m: m // 10, 35) == [1, 10, 20, 30]
    assert first_sizes(lambda m: m > 3, 3) == [1]
    assert first_sizes(lambda m: 0, 0) == [1]


def _packed(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return prepack(Nvfp4Weight.quantize(torch.randn(*shape, generator=g)), act_dtype=torch.bfloat16)


def test_linear_warmup_sizes_reach_every_variant():
    p = _packed((256, 1024))
    sizes = warmup_sizes_linear(p, 9000)
    lay, sel = p.layout, config_fn("dense", 256, 1024)
    variant = lambda m: api._dense_variant(m, lay, sel(m), 132)  # noqa: E731
    assert sizes == sorted(sizes) and sizes[0] == 1
    assert {variant(m) for m in sizes} == {variant(m) for m in range(1, 9001)}
    assert len(set(map(variant, sizes))) == len(sizes)             # one forward per variant, no more
    assert any(variant(m)[0] == "dequant_mm" for m in sizes) and any(variant(m)[0] != "dequant_mm" for m in sizes)
    assert max(warmup_sizes_linear(p, 40)) <= 40


def test_moe_warmup_sizes_reach_every_variant():
    e, top_k = 16, 4
    w13, w2 = _packed((e, 128, 256), 1), _packed((e, 256, 64), 2)
    sizes = warmup_sizes_fused_moe(w13, w2, top_k, 20000)
    s13, s2 = config_fn("grouped", 128, 256, e), config_fn("grouped", 256, 64, e)
    # what each count launches, as w4_grouped decides it (and `info`'s plan reports it): the config after the
    # Gluon fallback, and whether decode's compact expert slots are on
    variant = lambda t: (moe_glue.route_class(t * top_k),  # noqa: E731
                         api._grouped_variant(t * top_k, e, s13(t * top_k)),
                         api._grouped_variant(t * top_k, e, s2(t * top_k)))
    assert {variant(t) for t in sizes} == {variant(t) for t in range(1, 20001)}
    assert len(sizes) == len({variant(t) for t in sizes})             # no count launches nothing new
    assert sizes[0] == 1 and sizes[1] == 4                          # 4 tokens x top-4 = 16 rows: no longer compact
    # the routing's per-block kernels are compiled at start-up too (first count past the one-program kernel)
    assert moe_glue.ROUTE_KERNEL_MAX_ROWS // top_k + 1 in sizes and moe_glue.ROUTE_BLOCK_SPLIT // top_k + 1 in sizes


class _Recorder:
    def __init__(self, layer, sizes):
        self.calls = []
        layer.backend.warmup_sizes = lambda t, meta, max_tokens, **kw: list(sizes)
        real = layer.backend.apply

        def apply(t, meta, x, *args):
            self.calls.append((x.shape[0], *(a.shape if isinstance(a, torch.Tensor) else a for a in args)))
            return real(t, meta, x, *args)

        layer.backend.apply = apply


def test_linear_warmup_runs_each_size_once_per_shape():
    w = Nvfp4Weight.quantize(torch.randn(48, 64))
    a, b = Nvfp4Linear(w), Nvfp4Linear(w)
    rec_a, rec_b = _Recorder(a, [1, 7, 300]), _Recorder(b, [1, 7, 300])
    a.warmup(1000)
    assert [c[0] for c in rec_a.calls] == [1, 7, 300] and all(c[1] is None for c in rec_a.calls)
    b.warmup(1000)                                   # same shape and bias: already compiled in this process
    assert rec_b.calls == []
    b.warmup(1000, torch.zeros(48, dtype=torch.bfloat16))
    assert [(c[0], tuple(c[1])) for c in rec_b.calls] == [(1, (48,)), (7, (48,)), (300, (48,))]


def test_moe_warmup_routes_distinct_experts_per_token():
    g = torch.Generator().manual_seed(3)
    layer = Nvfp4FusedMoE(Nvfp4Weight.quantize(torch.randn(6, 32, 64, generator=g)),
                          Nvfp4Weight.quantize(torch.randn(6, 64, 16, generator=g)))
    seen = []
    layer.backend.warmup_sizes = lambda t, meta, max_tokens, top_k: [1, 5]
    real = layer.backend.apply
    layer.backend.apply = lambda t, meta, x, tw, ti: (seen.append(ti.clone()), real(t, meta, x, tw, ti))[1]
    with pytest.raises(ValueError, match="top_k: expected 1..6"):
        layer.warmup(64, 7)
    layer.warmup(64, 3)
    assert [s.shape for s in seen] == [(1, 3), (5, 3)]
    for ids in seen:
        assert all(len(set(row.tolist())) == 3 for row in ids) and int(ids.max()) < 6


# ------------------------------------------------------------------------------------------------
# GPU: after the warm-up, forwards of any size compile nothing
# ------------------------------------------------------------------------------------------------

def _compiled_kernels() -> int:
    from nvfp4_plugin.gemm import gluon_w4, moe_glue, triton_w4

    fns = [triton_w4.w4_gemm_kernel, triton_w4.w4_dequant_kernel, triton_w4.fp4_act_decode_kernel,
           gluon_w4.w4_wgmma_kernel, gluon_w4.w4_splitk_reduce_kernel, moe_glue._route_kernel,
           moe_glue._route_hist_kernel, moe_glue._route_scan_kernel, moe_glue._route_block_place_kernel,
           moe_glue._silu_mul_kernel, moe_glue._combine_kernel, moe_glue._gather_rows_kernel,
           moe_glue._spread_rows_kernel]
    return sum(len(c[0]) for f in fns for c in f.device_caches.values())


@pytest.mark.gpu
def test_gpu_linear_compiles_nothing_after_warmup(caplog):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    # a tuned H200 shape (Llama-3-8B qkv): Triton mma.sync / wgmma, Gluon and dequant + cuBLAS configs
    w = Nvfp4Weight.quantize(torch.randn(6144, 4096, device=dev, generator=g))
    layer = Nvfp4Linear(w)
    assert layer.backend.name == "hopper_triton"
    caplog.set_level("WARNING", logger="nvfp4_plugin")
    layer.warmup(4096)
    before = _compiled_kernels()
    x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    for m in [*range(1, 80), 100, 127, 128, 129, 200, 255, 256, 257, 300, 511, 512, 513, 777, 1024, 2047, 4096]:
        layer(x[:m])
    torch.cuda.synchronize()
    assert _compiled_kernels() == before
    assert not [r for r in caplog.records if "compiled outside the start-up warm-up" in r.getMessage()]


@pytest.mark.gpu
def test_gpu_moe_compiles_nothing_after_warmup(caplog):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    e, h, inter, top_k = 128, 2048, 768, 8                   # Qwen3-30B-A3B experts (tuned H200 shapes)
    layer = Nvfp4FusedMoE(Nvfp4Weight.quantize(torch.randn(e, 2 * inter, h, device=dev, generator=g)),
                          Nvfp4Weight.quantize(torch.randn(e, h, inter, device=dev, generator=g)))
    caplog.set_level("WARNING", logger="nvfp4_plugin")
    layer.warmup(8192, top_k)
    before = _compiled_kernels()
    x = torch.randn(8192, h, device=dev, dtype=torch.bfloat16)
    # (every routing class too: one program up to 256 pairs, blocks of 256 up to 32768, of 1024 beyond)
    for t in [1, 2, 3, 8, 15, 16, 17, 32, 33, 64, 100, 128, 255, 256, 300, 512, 1000, 2048, 4096, 4097, 8192]:
        ids = torch.randint(0, e, (t, top_k), device=dev, generator=g, dtype=torch.int32)
        layer(x[:t], torch.full((t, top_k), 1.0 / top_k, device=dev), ids)
    torch.cuda.synchronize()
    assert _compiled_kernels() == before
    assert not [r for r in caplog.records if "compiled outside the start-up warm-up" in r.getMessage()]
