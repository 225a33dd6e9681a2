"""GPU tests of the compiled quantization kernels (nvfp4_plugin._C): byte-identical to the reference.

Run on the GPU machine after building the extension in place (see benchmarks/gpu_build.sh):
    NVFP4_PLUGIN_REQUIRE_EXT=1 python3 -m pytest -q -m gpu tests/test_cuda_quant.py
Without a built extension these tests skip (or fail with NVFP4_PLUGIN_REQUIRE_EXT=1).

References: the NVFP4 ops and SiLU are compared with the reference on the same GPU. The FP8
per-tensor-dynamic and per-token references are run on the CPU: on CUDA, torch computes
``tensor / 448.0`` as ``tensor * fp32(1/448)`` (a CPU-scalar optimization), which is not the IEEE
division of the sgl-kernel recipe; on the CPU it is. Per-token-group is compared with the recipe
of the numerics docstring (``448 / a`` an IEEE division), see fp8_group_recipe.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from nvfp4_plugin import _ext
from nvfp4_plugin import numerics as nx
from nvfp4_plugin import reference as ref

pytestmark = pytest.mark.gpu

M_SIZES = (0, 1, 7, 128, 1000, 4099)
K_SIZES = (16, 48, 64, 2048, 7168)
DTYPES = (torch.bfloat16, torch.float16)


@pytest.fixture(scope="module")
def cuda_ops():
    dev = torch.device("cuda")
    why = _ext.extension_runs_on(dev)
    if why is not None:
        if os.environ.get("NVFP4_PLUGIN_REQUIRE_EXT"):
            pytest.fail(f"nvfp4_plugin._C does not run here: {why}")
        pytest.skip(f"nvfp4_plugin._C does not run here: {why}")
    from nvfp4_plugin import _cuda_ops

    return _cuda_ops


def activations(m: int, k: int, dtype, seed: int, device="cuda", specials: bool = True) -> torch.Tensor:
    """Random activations with outlier rows and (optionally) NaN, +-inf, signed zeros, huge and tiny values."""
    # drawn on the target device: the 16 x L2 cases hold ~10^9 values, whose CPU randperm took minutes
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device) * torch.exp(torch.randn(m, 1, generator=g, device=device) * 2)
    if specials and x.numel():
        flat = x.view(-1)
        n = flat.numel()
        idx = torch.randperm(n, generator=g, device=device)
        cuts = [n // 97, n // 89, n // 83, n // 61, n // 59, n // 53, n // 47]
        flat[idx[:cuts[0]]] = math.nan
        flat[idx[cuts[0]:cuts[1]]] = math.inf
        flat[idx[cuts[1]:cuts[2]]] = -math.inf
        flat[idx[cuts[2]:cuts[3]]] = 0.0
        flat[idx[cuts[3]:cuts[4]]] = -0.0
        flat[idx[cuts[4]:cuts[5]]] *= 1e30
        flat[idx[cuts[5]:cuts[6]]] *= 1e-30
        if m > 1:
            x[m // 2] = 0.0
        x[0, : min(16, k)] = math.nan
    return x.to(dtype).to(device)


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    # copy into fresh default-strided tensors: .contiguous() keeps odd strides on size-1 dims
    a = torch.empty(got.shape, dtype=got.dtype).copy_(got.detach().cpu()).view(torch.uint8)
    b = torch.empty(want.shape, dtype=want.dtype).copy_(want.detach().cpu()).view(torch.uint8)
    bad = (a != b).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} bytes differ, first at {bad[0].tolist()}: {a[tuple(bad[0])]} != " \
                             f"{b[tuple(bad[0])]}"


def assert_same_values_nan_aware(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"{what}: NaN positions differ"
    assert_same_bytes(got[~nan], want[~nan], what)


# ------------------------------------------------------------------------------------------------
# NVFP4
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("swizzle,scale_format", [(True, "e4m3"), (False, "e4m3"), (True, "ue8m0"), (False, "ue8m0")])
def test_scaled_fp4_quant_fuzz(cuda_ops, dtype, swizzle, scale_format):
    for i, m in enumerate(M_SIZES):
        for j, k in enumerate(K_SIZES):
            x = activations(m, k, dtype, seed=100 * i + j)
            gs = nx.tensor_global_scale(x).reshape(1)
            q, s = cuda_ops.scaled_fp4_quant(x, gs, swizzle=swizzle, scale_format=scale_format)
            q_ref, s_ref = ref.scaled_fp4_quant(x, gs, swizzle=swizzle, scale_format=scale_format)
            what = f"scaled_fp4_quant m={m} k={k} {dtype} swizzle={swizzle} {scale_format}"
            assert_same_bytes(q, q_ref, what + " codes")
            assert_same_bytes(s, s_ref, what + " scales")


@pytest.mark.parametrize("gs", [1.0, 0.0, -2.0, 1e-30, 1e30, math.inf, 2.0**-140, math.nan])
@pytest.mark.parametrize("scale_format", ["e4m3", "ue8m0"])
def test_scaled_fp4_quant_degenerate_global_scales(cuda_ops, gs, scale_format):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = activations(37, 96, dtype, seed=7)
        g = torch.tensor([gs], device="cuda")
        q, s = cuda_ops.scaled_fp4_quant(x, g, scale_format=scale_format)
        q_ref, s_ref = ref.scaled_fp4_quant(x, g, scale_format=scale_format)
        assert_same_bytes(q, q_ref, f"codes gs={gs} {dtype} {scale_format}")
        assert_same_bytes(s, s_ref, f"scales gs={gs} {dtype} {scale_format}")


def _row_group_rows(k: int, elem: int, l2_times: int = 3) -> int:
    """A row count (not a multiple of 128) whose input is past an ``l2_times`` x L2 threshold of csrc
    (experts_tiling: 4, masked_uses_groups: 16; dense: 3, many row steps per CTA)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size or 50 << 20
    return (l2_times * l2) // (k * elem) + 128 + 37


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_fp4_quant_large_m(cuda_ops, dtype):
    """Larger inputs (csrc dense_tiling): same bytes as the reference, padding rows zeroed, both scale formats
    and layouts. 2213 x 2048: the one-wave row-block tile in the grid-wide row order (128 block columns, 2 rows
    per CTA step; too few rows for six waves of chunks); K=2048 at 3 L2 sizes and K=1040 at 6 L2 sizes (padding
    columns): the many-wave chunks kernel with its tapered last waves."""
    elem = torch.empty((), dtype=dtype).element_size()
    for k, m in ((2048, 2213), (2048, _row_group_rows(2048, elem, 3)), (1040, _row_group_rows(1040, elem, 6))):
        x = activations(m, k, dtype, seed=k)
        gs = nx.tensor_global_scale(x).reshape(1)
        for fmt, swizzle in (("e4m3", True), ("ue8m0", True), ("e4m3", False)):
            q, s = cuda_ops.scaled_fp4_quant(x, gs, swizzle=swizzle, scale_format=fmt)
            q_ref, s_ref = ref.scaled_fp4_quant(x, gs, swizzle=swizzle, scale_format=fmt)
            what = f"m={m} k={k} {dtype} {fmt} swizzle={swizzle}"
            assert_same_bytes(q, q_ref, f"codes {what}")
            assert_same_bytes(s, s_ref, f"scales {what}")
            del q, s, q_ref, s_ref
        del x
        torch.cuda.empty_cache()


def test_scaled_fp4_quant_fp32_and_noncontiguous(cuda_ops):
    x = activations(300, 2048 + 64, torch.float32, seed=3)
    gs = nx.tensor_global_scale(x).reshape(1)
    for inp in (x, x[:, 64:], x[1:]):  # fp32, a strided view, a 16-byte-misaligned view
        q, s = cuda_ops.scaled_fp4_quant(inp, gs)
        q_ref, s_ref = ref.scaled_fp4_quant(inp, gs)
        assert_same_bytes(q, q_ref, "codes")
        assert_same_bytes(s, s_ref, "scales")


def routing(m: int, e: int, seed: int, tail: int = 0):
    """expert_offsets for m rows over e experts (some empty) plus `tail` rows owned by no expert."""
    g = torch.Generator().manual_seed(seed)
    rows = m - tail
    weights = torch.rand(e, generator=g) * (torch.rand(e, generator=g) > 0.3)
    if weights.sum() == 0:
        weights[0] = 1.0
    counts = torch.zeros(e, dtype=torch.int64)
    if rows > 0:
        counts = torch.bincount(torch.multinomial(weights, rows, replacement=True, generator=g), minlength=e)
    eo = torch.zeros(e + 1, dtype=torch.int64)
    eo[1:] = torch.cumsum(counts, 0)
    return eo.to(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_fp4_experts_quant_fuzz(cuda_ops, dtype):
    case = 0
    for e in (1, 3, 8, 64, 256):
        for m in M_SIZES:
            for k in (16, 48, 2048, 7168):
                if m * k > 1000 * 7168 and e < 64:
                    continue
                case += 1
                tail = 3 if m > 7 and case % 3 == 0 else 0
                eo = routing(m, e, seed=case, tail=tail).cuda()
                bo = nx.blockscale_offsets_from_expert_offsets(eo)
                if case % 2:
                    eo, bo = eo.long(), bo.long()
                x = activations(m, k, dtype, seed=case, specials=case % 4 != 0)
                gs = (torch.rand(e, device="cuda") * 500 + 1e-3)
                q, s = cuda_ops.scaled_fp4_experts_quant(x, gs, eo, bo)
                q_ref, s_ref = ref.scaled_fp4_experts_quant(x, gs, eo, bo)
                what = f"experts e={e} m={m} k={k} {dtype}"
                assert_same_bytes(q, q_ref, what + " codes")
                assert_same_bytes(s, s_ref, what + " scales")


def _large_experts_case(cuda_ops, dtype, seed: int, shift_offsets: int = 0, k: int = 1040) -> None:
    """6 x L2 of input over 64 experts (the experts chunks kernel, csrc experts_tiling): empty experts, rows
    past the last offset, the scale tail, padding columns (K=1040; K=2048 streams through the bulk-copy ring,
    csrc bulk_ring.cuh). shift_offsets moves every expert but the first that many scale rows down."""
    m = _row_group_rows(k, torch.empty((), dtype=dtype).element_size(), l2_times=6)
    eo = routing(m, 64, seed=seed, tail=5).cuda()
    bo = nx.blockscale_offsets_from_expert_offsets(eo).clone()
    bo[1:] += shift_offsets
    assert int(bo[-1]) <= nx.max_blockscale_rows(m, 64)
    x = activations(m, k, dtype, seed=seed + 1)
    gs = torch.rand(64, device="cuda") * 500 + 1e-3
    q, s = cuda_ops.scaled_fp4_experts_quant(x, gs, eo, bo)
    q_ref, s_ref = ref.scaled_fp4_experts_quant(x, gs, eo, bo)
    what = f"m={m} {dtype} offsets shifted by {shift_offsets}"
    assert_same_bytes(q, q_ref, f"experts codes {what}")
    assert_same_bytes(s, s_ref, f"experts scales {what}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_fp4_experts_quant_large_row_groups(cuda_ops, dtype):
    _large_experts_case(cuda_ops, dtype, seed=11)


def test_scaled_fp4_experts_quant_large_bulk_ring(cuda_ops):
    _large_experts_case(cuda_ops, torch.bfloat16, seed=17, k=2048)


def test_scaled_fp4_experts_quant_large_unaligned_blockscale_offsets(cuda_ops):
    """Blockscale offsets that are not multiples of 128 (outside the documented contract, and not
    checkable without a host sync) still give the reference's bytes on the chunks path (every scale row
    that no expert row writes is zeroed, wherever the offsets put it)."""
    _large_experts_case(cuda_ops, torch.bfloat16, seed=13, shift_offsets=64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_silu_and_mul", [True, False])
@pytest.mark.parametrize("given_outputs", [False, True])
def test_masked_quant_fuzz(cuda_ops, dtype, use_silu_and_mul, given_outputs):
    case = 0
    for e, max_m, k in ((1, 1, 16), (3, 7, 48), (8, 128, 2048), (64, 33, 64), (4, 1000, 256), (8, 130, 7168),
                        (256, 5, 128)):
        for mask_kind in ("zero", "partial", "full"):
            case += 1
            g = torch.Generator().manual_seed(case)
            if mask_kind == "zero":
                mask = torch.zeros(e, dtype=torch.int32)
            elif mask_kind == "full":
                mask = torch.full((e,), max_m, dtype=torch.int32)
                mask[0] = max_m + 5  # values above max_m act as max_m
            else:
                mask = torch.randint(0, max_m + 1, (e,), generator=g, dtype=torch.int32)
            mask = mask.cuda() if case % 2 else mask.long().cuda()
            width = 2 * k if use_silu_and_mul else k
            x = activations(e * max_m, width, dtype, seed=case).reshape(e, max_m, width)
            gs = torch.rand(e, device="cuda") * 100 + 1e-2
            kb = k // 16
            sw = (e, *nx.swizzled_scale_shape(max_m, kb))
            kw = {}
            if given_outputs:
                out0 = torch.randint(0, 256, (e, max_m, k // 2), dtype=torch.uint8, device="cuda")
                sf0 = torch.randint(0, 256, sw, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
                kw_ref = dict(output=out0.clone(), output_scale=sf0.clone())
                kw = dict(output=out0, output_scale=sf0)
            else:
                kw_ref = {}
            q, s = cuda_ops.silu_and_mul_scaled_fp4_experts_quant(x, gs, mask, use_silu_and_mul=use_silu_and_mul, **kw)
            q_ref, s_ref = ref.silu_and_mul_scaled_fp4_experts_quant(x, gs, mask, use_silu_and_mul=use_silu_and_mul,
                                                                       **kw_ref)
            what = f"masked e={e} max_m={max_m} k={k} {mask_kind} {dtype} silu={use_silu_and_mul}"
            assert_same_bytes(q, q_ref, what + " codes")
            assert_same_bytes(s, s_ref, what + " scales")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_silu_and_mul", [True, False])
def test_masked_quant_large_row_groups(cuda_ops, dtype, use_silu_and_mul):
    """Inputs of 16 x L2 take the masked kernel's 8-row groups over each expert's valid scale tiles (csrc
    masked_uses_groups; bf16 SiLU with the table): masks 0, 1, 127, 128, 129, full, above max_m and
    partial; padding columns (K=1040); outputs allocated (zero-filled) and given (rows past the mask
    untouched)."""
    e, k = 8, 1040
    width = 2 * k if use_silu_and_mul else k
    max_m = _row_group_rows(width, torch.empty((), dtype=dtype).element_size(), l2_times=16) // e + 1
    mask = torch.tensor([0, 1, 127, 128, 129, max_m, max_m + 5, max_m // 2 + 3], dtype=torch.int32).cuda()
    x = activations(e * max_m, width, dtype, seed=21).reshape(e, max_m, width)
    gs = torch.rand(e, device="cuda") * 100 + 1e-2
    sw = (e, *nx.swizzled_scale_shape(max_m, k // 16))
    for given in (False, True):
        kw, kw_ref = {}, {}
        if given:
            out0 = torch.randint(0, 256, (e, max_m, k // 2), dtype=torch.uint8, device="cuda")
            sf0 = torch.randint(0, 256, sw, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
            kw, kw_ref = dict(output=out0, output_scale=sf0), dict(output=out0.clone(), output_scale=sf0.clone())
        q, s = cuda_ops.silu_and_mul_scaled_fp4_experts_quant(x, gs, mask, use_silu_and_mul=use_silu_and_mul, **kw)
        q_ref, s_ref = ref.silu_and_mul_scaled_fp4_experts_quant(x, gs, mask, use_silu_and_mul=use_silu_and_mul,
                                                                   **kw_ref)
        what = f"masked groups max_m={max_m} {dtype} silu={use_silu_and_mul} given={given}"
        assert_same_bytes(q, q_ref, what + " codes")
        assert_same_bytes(s, s_ref, what + " scales")
        del q, s, q_ref, s_ref, kw, kw_ref


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_silu_and_mul(cuda_ops, dtype):
    for rows, inner in ((1, 8), (7, 64), (300, 2048), (4099, 7168 // 2)):
        x = activations(rows, 2 * inner, dtype, seed=rows)
        assert_same_values_nan_aware(cuda_ops.silu_and_mul(x), ref.silu_and_mul(x), f"silu {rows}x{inner} {dtype}")


# ------------------------------------------------------------------------------------------------
# FP8
# ------------------------------------------------------------------------------------------------

def fp8_group_recipe(x: torch.Tensor, group: int, *, column_major_scales: bool, scale_ue8m0: bool,
                     eps: float = nx.FP8_GROUP_EPS):
    """numerics docstring recipe (sgl-kernel): mult = 448 / a as an IEEE division (torch's
    ``448.0 / tensor`` is reciprocal(tensor) * 448), scales laid out like the reference."""
    m, k = x.shape
    grp = x.reshape(m, k // group, group).float()
    a = nx.nan_ignoring_amax(grp, dim=-1, inf_as_max=True).clamp(min=eps)
    if scale_ue8m0:
        e = nx.ceil_log2_exponent(a * nx._ONE_OVER_448_F32)
        mult, stored = nx.exp2_int(-e), (e + nx.E8M0_BIAS).to(torch.uint8)
    else:
        mult, stored = torch.full_like(a, nx.E4M3_MAX) / a, a * nx._ONE_OVER_448_F32
    q = nx.e4m3_saturate(grp * mult[..., None]).reshape(m, k)
    out_s = ref.alloc_fp8_group_scales(m, k, group, column_major=column_major_scales, scale_ue8m0=scale_ue8m0,
                                       device=x.device)
    if scale_ue8m0:
        padded = torch.zeros((m, out_s.shape[1] * 4), dtype=torch.uint8, device=x.device)
        padded[:, :stored.shape[1]] = stored
        out_s.copy_(padded.view(torch.int32))
    else:
        out_s.copy_(stored)
    return q, out_s


def fp8_inputs(m, k, dtype, seed):
    x = activations(m, k, dtype, seed)
    # the CPU reference keeps a NaN's sign through casts, CUDA does not: use positive NaNs only
    return torch.where(torch.isnan(x), torch.full_like(x, math.nan), x)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
@pytest.mark.parametrize("layout", ["row", "col", "col_ue8m0"])
def test_per_token_group_quant_fp8_fuzz(cuda_ops, dtype, layout):
    cm, ue = layout != "row", layout == "col_ue8m0"
    for i, m in enumerate(M_SIZES):
        for group, k in ((128, 128), (128, 2048), (128, 7168), (64, 192), (16, 48), (256, 1024), (128, 640)):
            x = fp8_inputs(m, k, dtype, seed=10 * i + k)
            q, s = cuda_ops.per_token_group_quant_fp8(x, group, column_major_scales=cm, scale_ue8m0=ue)
            q_want, s_want = fp8_group_recipe(x.cpu(), group, column_major_scales=cm, scale_ue8m0=ue)
            what = f"group m={m} k={k} g={group} {dtype} {layout}"
            assert s.shape == s_want.shape and s.stride() == s_want.stride(), what
            assert_same_bytes(q, q_want, what + " q")
            assert_same_bytes(s.contiguous(), s_want.contiguous(), what + " scales")
            _, s_ref = ref.per_token_group_quant_fp8(x, group, column_major_scales=cm, scale_ue8m0=ue)
            assert_same_bytes(s.contiguous(), s_ref.contiguous(), what + " scales vs reference")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_per_token_quant_fp8_fuzz(cuda_ops, dtype):
    for i, m in enumerate(M_SIZES):
        for k in (8, 16, 64, 2048, 7168, 70000):
            if m * k > 4099 * 7168:
                continue
            x = fp8_inputs(m, k, dtype, seed=i * 31 + k)
            q, s = cuda_ops.per_token_quant_fp8(x)
            q_ref, s_ref = ref.per_token_quant_fp8(x.cpu())
            assert_same_bytes(q, q_ref, f"per-token m={m} k={k} {dtype} q")
            assert_same_bytes(s, s_ref, f"per-token m={m} k={k} {dtype} s")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_scaled_fp8_quant(cuda_ops, dtype):
    for m, k in ((1, 16), (7, 48), (128, 2048), (1000, 7168), (3, 5), (4099, 2048)):
        x = fp8_inputs(m, k, dtype, seed=m + k)
        q, s = cuda_ops.scaled_fp8_quant(x)
        q_ref, s_ref = ref.scaled_fp8_quant(x.cpu())
        assert_same_bytes(q, q_ref, f"dynamic m={m} k={k} {dtype} q")
        assert_same_bytes(s, s_ref, f"dynamic m={m} k={k} {dtype} s")
        for sv in (0.37, 0.0, 1e-20):
            st = torch.tensor([sv], device="cuda")
            q, s = cuda_ops.scaled_fp8_quant(x, st)
            q_ref, s_ref = ref.scaled_fp8_quant(x.cpu(), st.cpu())
            assert_same_bytes(q, q_ref, f"static {sv} m={m} k={k} {dtype}")
            assert s.data_ptr() == st.data_ptr()


# ------------------------------------------------------------------------------------------------
# Dispatch, errors, CUDA graphs, torch.compile
# ------------------------------------------------------------------------------------------------

def test_public_ops_pick_the_cuda_backend(cuda_ops):
    from nvfp4_plugin.ops import _registry

    for op in cuda_ops.CUDA_OPS:
        backend, skipped = _registry.select(op, torch.device("cuda"))
        assert backend.name == "cuda", (op, skipped)


def test_errors_name_the_argument(cuda_ops):
    x = torch.randn(4, 32, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="input"):
        cuda_ops.scaled_fp4_quant(x[:, :24], torch.ones(1, device="cuda"))
    with pytest.raises(ValueError, match="expert_offsets"):
        cuda_ops.scaled_fp4_experts_quant(x, torch.ones(3, device="cuda"), torch.zeros(1, dtype=torch.int32,
                                                                                          device="cuda"),
                                          torch.zeros(1, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="mask"):
        cuda_ops.silu_and_mul_scaled_fp4_experts_quant(x.reshape(2, 2, 32), torch.ones(2, device="cuda"),
                                                       torch.zeros(3, dtype=torch.int32, device="cuda"))
    with pytest.raises(TypeError, match="input_global_scale"):
        cuda_ops.scaled_fp4_quant(x, torch.ones(1, device="cuda", dtype=torch.float16))


def graph_cases(cuda_ops):
    x = activations(256, 2048, torch.bfloat16, seed=5, specials=False)
    gs = nx.tensor_global_scale(x).reshape(1)
    eo = routing(256, 8, seed=5).cuda()
    bo = nx.blockscale_offsets_from_expert_offsets(eo)
    xm = activations(8 * 64, 512, torch.bfloat16, seed=6, specials=False).reshape(8, 64, 512)
    mask = torch.randint(0, 65, (8,), dtype=torch.int32, device="cuda")
    gse = torch.rand(8, device="cuda") + 0.5
    return {
        "scaled_fp4_quant": lambda: cuda_ops.scaled_fp4_quant(x, gs),
        "scaled_fp4_experts_quant": lambda: cuda_ops.scaled_fp4_experts_quant(x, gse, eo, bo),
        "silu_and_mul_scaled_fp4_experts_quant": lambda: cuda_ops.silu_and_mul_scaled_fp4_experts_quant(xm, gse, mask),
        "silu_and_mul": lambda: (cuda_ops.silu_and_mul(x),),
        "scaled_fp8_quant": lambda: cuda_ops.scaled_fp8_quant(x),
        "scaled_fp8_quant_large": lambda: cuda_ops.scaled_fp8_quant(torch.cat([x] * 40)),
        "per_token_quant_fp8": lambda: cuda_ops.per_token_quant_fp8(x),
        "per_token_group_quant_fp8": lambda: cuda_ops.per_token_group_quant_fp8(x, column_major_scales=True,
                                                                                  scale_ue8m0=True),
    }


def capture(fn):
    """One call of ``fn`` captured in a CUDA graph, after a warm-up call on a side stream (lazy loading and
    occupancy queries stay outside the capture): (graph, the outputs the graph writes)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    return graph, outs


def replay_zeroed(graph, outs) -> None:
    """Zero the graph's outputs, replay it and wait: every byte compared afterwards was written by the replay."""
    for t in outs:
        t.zero_()
    graph.replay()
    torch.cuda.synchronize()


def test_cuda_graph_capture_and_replay(cuda_ops):
    for name, fn in graph_cases(cuda_ops).items():
        eager = [t.clone() for t in fn()]
        graph, outs = capture(fn)
        replay_zeroed(graph, outs)
        for i, (a, b) in enumerate(zip(outs, eager)):
            assert_same_bytes(a, b, f"{name} output {i} after graph replay")


@pytest.mark.parametrize("m", [64, 8192])
def test_dependent_kernels_back_to_back(cuda_ops, m):
    """Each kernel reads what the kernel before it wrote, eagerly and in one CUDA graph. With programmatic
    dependent launch (NVFP4_PLUGIN_PDL, on unless 0) a kernel may start while the one before it still runs and
    waits for it on the GPU (pdl_enter): the bytes must match the same ops run one at a time with a host sync
    after each. At 64 rows SiLU leaves most SMs free, so its dependents start at once and only their wait
    orders them; at 8192 rows they fill the SMs as SiLU's CTAs end."""
    inner = 2048
    xs = [activations(m, 2 * inner, torch.bfloat16, seed=70 + i, specials=False) for i in range(3)]
    gs = torch.tensor([0.37], device="cuda")
    eo = routing(m, 64, seed=7).cuda()
    bo = nx.blockscale_offsets_from_expert_offsets(eo)
    gse = torch.rand(64, device="cuda") + 0.5

    consumers = (lambda y: cuda_ops.scaled_fp4_quant(y, gs),
                 lambda y: cuda_ops.scaled_fp4_experts_quant(y, gse, eo, bo),
                 lambda y: cuda_ops.per_token_group_quant_fp8(y),
                 lambda y: cuda_ops.scaled_fp8_quant(y))

    def chain():
        y = cuda_ops.silu_and_mul(x)
        return [y, *[t for f in consumers for t in f(y)]]

    def one_at_a_time(xi):
        torch.cuda.synchronize()
        y = cuda_ops.silu_and_mul(xi)
        outs = [y]
        for f in consumers:
            torch.cuda.synchronize()
            outs.extend(f(y))
        torch.cuda.synchronize()
        return outs

    names = ("silu", "fp4 codes", "fp4 scales", "experts codes", "experts scales", "fp8 group codes",
             "fp8 group scales", "fp8 dynamic codes", "fp8 dynamic scale")
    wrong = []

    def check(got, phase):
        for name, a, b in zip(names, got, one_at_a_time(x)):
            try:
                assert_same_bytes(a, b, f"{phase}: {name}")
            except AssertionError as e:
                wrong.append(str(e).splitlines()[0])

    x = xs[0].clone()
    for i, xi in enumerate(xs):
        x.copy_(xi)
        check([t.clone() for t in chain()], f"eager, input {i}")
    graph, outs = capture(chain)
    for i, xi in enumerate(xs):
        x.copy_(xi)
        replay_zeroed(graph, outs)
        check(outs, f"graph, input {i}")
    assert not wrong, "\n".join(wrong)


def test_torch_compile_traces_the_ops(cuda_ops):
    """The ops have fake implementations: the wrappers trace into one graph (auto-functionalized)."""
    x = activations(64, 256, torch.bfloat16, seed=9, specials=False)
    gs = nx.tensor_global_scale(x).reshape(1)
    xm = activations(4 * 16, 128, torch.bfloat16, seed=10, specials=False).reshape(4, 16, 128)
    mask = torch.tensor([0, 3, 16, 9], dtype=torch.int32, device="cuda")

    def f(x, gs, xm, mask):
        q, s = cuda_ops.scaled_fp4_quant(x, gs)
        q8, s8 = cuda_ops.per_token_group_quant_fp8(x)
        qm, sm = cuda_ops.silu_and_mul_scaled_fp4_experts_quant(xm, gs.expand(4).contiguous(), mask)
        return q, s, q8, s8, qm, sm

    eager = f(x, gs, xm, mask)
    compiled = torch.compile(f, fullgraph=True)
    for a, b in zip(compiled(x, gs, xm, mask), eager):
        assert_same_bytes(a, b, "torch.compile")
