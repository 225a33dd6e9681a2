"""Hopper FP4-weight dense GEMM (Triton kernel: mma.sync, register- and shared-memory wgmma tiles,
split K, the dequantize + cuBLAS path) against the fp64 reference; the same at larger sizes, with
CUDA graphs and split-K determinism, marked ``gpu``. Shared cases: tests/gemm_cases.py.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nvfp4_plugin import numerics as nx
from nvfp4_plugin import reference as ref
from nvfp4_plugin.gemm import (DequantMmConfig, TritonMmaConfig, TritonWgmmaConfig, W4Config, prepack, w4_dequantize,
                               w4_linear)
from nvfp4_plugin.gemm import select as gsel
from nvfp4_plugin.gemm import triton_w4
from nvfp4_plugin.weights import Nvfp4Weight

from .gemm_cases import (BK256, BN32, BN128, CONFIGS, DEV, SPLIT, SS64, V2_8, V2_16, V3_16, act, dense_ref,
                         graph_replay, make_weight, report_max_ulps, ulp_error)  # noqa: F401  (autouse fixture)


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
    for cfg in (V2_8, TritonWgmmaConfig(bn=64, bm=16, bk=256, split_k=1)):
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
        TritonWgmmaConfig(bm=8)


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


FUZZ_CONFIGS = [V2_8, V3_16, BN128, SPLIT, BK256, V2_16, BN32,
                TritonWgmmaConfig(bn=128, bm=64, bk=128, num_warps=8, split_k=2),
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


@pytest.mark.parametrize("m", [1, 64, 65, 200])
def test_dense_ss_tiles(m):
    """Shared-memory wgmma tiles (tokens as M) give the reference on ragged M, N and K."""
    dtype = torch.bfloat16
    w = make_weight((), 72, 208, seed=m)
    p = prepack(w, dtype)
    x = act((m, 208), dtype, seed=m + 1)
    for cfg in (SS64, TritonWgmmaConfig(bn=128, bm=128, bk=128, num_warps=8, ss=True)):
        assert ulp_error(w4_linear(x, p, config=cfg), dense_ref(x, w), dtype, "dense_ss") <= 2, cfg


def test_ss_config_validation():
    assert TritonWgmmaConfig(bn=256, bm=128, ss=True, num_warps=8).bn == 256
    with pytest.raises(ValueError, match="ss .*needs bm >= 64"):
        TritonWgmmaConfig(bm=32, ss=True)
    with pytest.raises(ValueError, match=r"TritonWgmmaConfig.bn: expected 64 or 128 \(256 with ss\)"):
        TritonWgmmaConfig(bn=256, bm=128)
    assert W4Config.from_json(TritonWgmmaConfig(bm=64, ss=True).to_json()) == TritonWgmmaConfig(bm=64, ss=True)
    # a 256-wide tile must divide the padded N (its weight loads are unmasked along N)
    wide = TritonWgmmaConfig(bn=256, bm=64, bk=64, num_warps=8, ss=True)
    for n in (72, 384):
        p = prepack(make_weight((), n, 64, seed=n), torch.bfloat16)
        with pytest.raises(ValueError, match=f"bn=256 needs the padded N \\({p.layout.n_pad}\\)"):
            w4_linear(act((3, 64), torch.bfloat16, seed=1), p, config=wide)
    w = make_weight((), 500, 64, seed=5)  # padded to 512: fine
    x = act((65, 64), torch.bfloat16, seed=6)
    assert ulp_error(w4_linear(x, prepack(w, torch.bfloat16), config=wide), dense_ref(x, w), torch.bfloat16, "ss256") <= 2


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
    for cfg in (V2_8, V2_16, V3_16, BN128, TritonWgmmaConfig(bn=128, bm=128, bk=64, num_warps=8, num_stages=4),
                TritonMmaConfig(bn=64, bm=8, bk=256, split_k=8), DequantMmConfig(), SS64,
                TritonWgmmaConfig(bn=128, bm=128, bk=64, num_warps=8, num_stages=4, ss=True),
                TritonWgmmaConfig(bn=256, bm=128, bk=64, num_warps=8, num_stages=3, ss=True)):
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
    cfg = DequantMmConfig()
    y = w4_linear(x, p, bias, config=cfg)
    assert y.dtype == dtype and y.shape == (m, n)
    assert ulp_error(y, dense_ref(x, w, bias), dtype, f"dequant_mm/{dtype}") <= 2
    gs = nx.tensor_global_scale(x.float()).reshape(1)
    y4 = w4_linear(x, p, bias, mode="w4a4", input_global_scale=gs, config=cfg)
    assert ulp_error(y4, dense_ref(x, w, bias, mode="w4a4", gs=gs), dtype, f"dequant_mm_w4a4/{dtype}") <= 2


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [TritonWgmmaConfig(bn=128, bm=128, bk=64, num_warps=8, num_stages=4),
                                 TritonWgmmaConfig(bn=128, bm=128, bk=64, num_warps=8, num_stages=3),
                                 TritonWgmmaConfig(bn=128, bm=256, bk=64, num_warps=8, num_stages=3),
                                 TritonWgmmaConfig(bn=128, bm=128, bk=64, num_warps=8, num_stages=4, ss=True),
                                 TritonWgmmaConfig(bn=128, bm=256, bk=64, num_warps=8, num_stages=3, ss=True)],
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


@pytest.mark.gpu
def test_gpu_split_k_deterministic_and_graph_capturable():
    w = make_weight((), 2048, 4096, seed=1)
    p = prepack(w, torch.bfloat16)
    x = act((4, 4096), torch.bfloat16, seed=2)
    cfg = TritonMmaConfig(bn=64, bm=8, bk=256, split_k=8)
    y1 = w4_linear(x, p, config=cfg)
    y2 = w4_linear(x, p, config=cfg)
    assert torch.equal(y1, y2)
    yg = graph_replay(lambda: w4_linear(x, p, config=cfg), replays=3)
    assert torch.equal(yg, y1)


@pytest.mark.gpu
def test_gpu_uses_compiled_kernels():
    assert not triton_w4.INTERPRET
