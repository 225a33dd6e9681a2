"""Triton NVFP4 kernels (scaled_fp4_quant, nvfp4_forward) byte for byte against the reference.

On a CPU-only machine the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py
before any kernel module is imported) on small shapes; on a GPU the same tests run on CUDA, plus
the large shapes marked ``gpu``. The reference always runs on CPU copies (the ground truth).
"""

import math

import pytest
import torch

from tests._require import require_triton_kernels

require_triton_kernels()

from nvfp4_plugin import numerics as nx  # noqa: E402
from nvfp4_plugin import ops  # noqa: E402
from nvfp4_plugin import reference as ref  # noqa: E402
from nvfp4_plugin.ops import _registry  # noqa: E402
from nvfp4_plugin.triton import _register  # noqa: E402
from nvfp4_plugin.triton import nvfp4 as tn  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy inf/nan warnings (interpreter)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
GPU = pytest.mark.gpu


def special_input(m, k, dtype, seed=0):
    """Random rows over a wide dynamic range, with NaN, +-Inf, zero and tiny blocks and signed zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g) * 3)
    flat = x.view(-1)
    n = flat.numel()
    neg_nan = torch.tensor([0xFFC00001], dtype=torch.int64).to(torch.int32).view(torch.float32).item()
    for i, v in enumerate([math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-30, -1e-38, 3e38, neg_nan]):
        if n > 64:
            flat[(i * 7919 + 13) % n] = v
    if m > 2 and k >= 32:
        x[1, :16] = 0.0          # an all-zero block
        x[2, 16:32] = math.nan   # an all-NaN block
    if m > 3:
        x[3] *= 1e-6             # tiny blocks: subnormal and zero E4M3 scales
    return x.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Identical bytes, except that NaNs need only agree on being NaN (payload and sign of a NaN
    depend on the platform that made it: x86 keeps them, GPUs make the canonical +NaN)."""
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        na, nb = torch.isnan(a.float()), torch.isnan(b.float())
        if not torch.equal(na, nb):
            return False
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
        return torch.equal(a.view(ints)[~na], b.view(ints)[~nb])
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def rotating_cases(shapes, options, full_shape):
    """(option, dtype, shape) params: all dtypes on ``full_shape``, one rotating dtype elsewhere
    (every launch configuration is a separate compile on the GPU; the dtype only changes the load)."""
    cases = []
    for j, opt in enumerate(options):
        for i, (shape, gpu) in enumerate(shapes):
            dtypes = DTYPES if shape == full_shape else [DTYPES[(i + j) % 3]]
            for dt in dtypes:
                name = "-".join([*map(str, opt), str(dt)[6:], "x".join(map(str, shape))])
                cases.append(pytest.param(*opt, dt, shape, marks=[GPU] if gpu else [], id=name))
    return cases


# (shape, GPU only)
QUANT_SHAPES = [((1, 16), False), ((3, 48), False), ((37, 320), False), ((1000, 7168), True), ((129, 2064), True)]
BIG = 1 << 20  # elements: large inputs check one global scale (the small ones check the others, on the GPU too)


@pytest.mark.parametrize("swizzle,scale_format,dtype,shape",
                         rotating_cases(QUANT_SHAPES, [(True, "e4m3"), (False, "e4m3"), (True, "ue8m0")], (37, 320)))
def test_scaled_fp4_quant_matches_reference(swizzle, scale_format, dtype, shape):
    m, k = shape
    x = special_input(m, k, dtype, seed=m + k)
    scales = (nx.tensor_global_scale(x).reshape(1), torch.tensor([1.0]), torch.tensor([6.2e4]))
    for gs in scales[:1] if x.numel() > BIG else scales:
        p1, s1 = tn.scaled_fp4_quant(x.to(DEV), gs.to(DEV), swizzle=swizzle, scale_format=scale_format)
        p2, s2 = ref.scaled_fp4_quant(x, gs, swizzle=swizzle, scale_format=scale_format)
        assert p1.dtype == p2.dtype and s1.dtype == s2.dtype and s1.shape == s2.shape
        assert same_bits(p1, p2), (gs, "packed")
        assert same_bits(s1, s2), (gs, "scales (padding included)")


def test_swizzle_padding_is_zero_even_over_garbage_memory():
    # M = 5 and K/16 = 3: 123 padding rows and one padding column; the kernel writes them itself.
    x = special_input(5, 48, torch.bfloat16)
    gs = torch.tensor([3.0])
    for _ in range(2):
        filler = torch.full((1 << 16,), 0xAB, dtype=torch.uint8, device=DEV)  # dirty the allocator
        del filler
        _, s = tn.scaled_fp4_quant(x.to(DEV), gs.to(DEV))
        lin = nx.unswizzle_blockscale(s.cpu(), 128, 4).view(torch.uint8)
        assert (lin[5:] == 0).all() and (lin[:, 3] == 0).all()
        assert same_bits(s, ref.scaled_fp4_quant(x, gs)[1])


@pytest.mark.parametrize("gs", [0.0, math.inf, math.nan, 1e-30, 1e36, 2.0 ** -100, -3.0])
def test_extreme_and_degenerate_global_scales(gs):
    x = special_input(6, 64, torch.float32, seed=3)
    g = torch.tensor([gs])
    for sf in ("e4m3", "ue8m0"):
        p1, s1 = tn.scaled_fp4_quant(x.to(DEV), g.to(DEV), swizzle=False, scale_format=sf)
        # the reference on the same device: a NaN scale made by 0 * Inf is -NaN on x86 (byte 0xFF)
        # and the canonical +NaN on a GPU (0x7F); everything else is device-independent
        p2, s2 = ref.scaled_fp4_quant(x.to(DEV), g.to(DEV), swizzle=False, scale_format=sf)
        assert same_bits(p1, p2) and same_bits(s1, s2), sf
    if math.isfinite(gs) and gs != 0:
        assert same_bits(tn.nvfp4_forward(x.to(DEV), g.to(DEV)), ref.fake_quant_nvfp4(x, g))


@pytest.mark.parametrize("S", [1.0, 0.875, 2.0 ** -6, 3 * 2.0 ** -9, 2.0 ** -9, 448.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_e2m1_boundary_and_its_neighbours(S, dtype):
    """Scaled values exactly on each rounding boundary (ties to even) and one ulp either side."""
    vals = []
    for mid in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        t = torch.tensor(mid * S, dtype=dtype)
        vals += [t, torch.nextafter(t, torch.tensor(-math.inf, dtype=dtype)),
                 torch.nextafter(t, torch.tensor(math.inf, dtype=dtype))]
    vals = torch.stack(vals).float()
    blocks = torch.zeros(nx.ceil_div(vals.numel(), 15), 16)
    blocks[:, 0] = 6 * S
    blocks[:, 1:].reshape(-1)[:vals.numel()] = vals
    x = torch.cat([blocks, -blocks]).to(dtype)
    gs = torch.tensor([1.0])
    p1, s1 = tn.scaled_fp4_quant(x.to(DEV), gs.to(DEV), swizzle=False)
    p2, s2 = ref.scaled_fp4_quant(x, gs, swizzle=False)
    assert same_bits(p1, p2) and same_bits(s1, s2)
    assert same_bits(tn.nvfp4_forward(x.to(DEV), gs.to(DEV)), ref.fake_quant_nvfp4(x, gs))


def test_e4m3_scale_rounding_every_byte():
    """Block maxima that put the scale exactly on, and halfway between, every E4M3 value."""
    grid = nx.fp8_grid("e4m3")
    mids = (grid[:-1] + grid[1:]) / 2
    targets = torch.cat([grid, mids, torch.nextafter(mids, torch.tensor(0.0)),
                         torch.nextafter(mids, torch.tensor(1e9))])
    x = torch.zeros(targets.numel(), 16)
    x[:, 0] = targets * 6  # vmax / 6 == target exactly (times 6 is exact for these)
    x[:, 1] = -targets
    gs = torch.tensor([1.0])
    p1, s1 = tn.scaled_fp4_quant(x.to(DEV), gs.to(DEV), swizzle=False)
    p2, s2 = ref.scaled_fp4_quant(x, gs, swizzle=False)
    assert same_bits(s1, s2) and same_bits(p1, p2)


FAKE_SHAPES = [((2, 16), False), ((5, 3, 96), False), ((33, 320), False), ((1000, 7168), True), ((7, 64, 1040), True)]


@pytest.mark.parametrize("dtype,shape", rotating_cases(FAKE_SHAPES, [()], (33, 320)))
def test_nvfp4_forward_matches_reference(dtype, shape):
    x = special_input(math.prod(shape[:-1]), shape[-1], dtype, seed=sum(shape)).reshape(shape)
    scales = (None, torch.tensor([0.75]), torch.tensor([2.0 ** 100]), torch.tensor([2.0 ** -100]))
    for gs in scales[:2] if x.numel() > BIG else scales:
        y1 = tn.nvfp4_forward(x.to(DEV), None if gs is None else gs.to(DEV))
        y2 = ref.fake_quant_nvfp4(x, gs)
        assert y1.dtype == dtype and y1.shape == x.shape
        assert same_bits(y1, y2), gs


def test_dynamic_global_scale_ignores_nan_and_inf():
    x = special_input(4, 64, torch.float32)
    x[0, 0] = math.inf
    x[0, 1] = math.nan
    assert same_bits(tn._dynamic_global_scale(x.to(DEV)), nx.tensor_global_scale(x).reshape(1))
    z = torch.zeros(2, 32)
    assert tn._dynamic_global_scale(z.to(DEV)).item() == 1.0


def test_non_contiguous_and_empty_inputs():
    x = special_input(8, 128, torch.bfloat16).t().contiguous().t()  # column-major storage
    gs = torch.tensor([2.0])
    p1, s1 = tn.scaled_fp4_quant(x.to(DEV), gs.to(DEV))
    p2, s2 = ref.scaled_fp4_quant(x, gs)
    assert same_bits(p1, p2) and same_bits(s1, s2)
    p, s = tn.scaled_fp4_quant(torch.empty(0, 64, device=DEV), gs.to(DEV))
    assert p.shape == (0, 32) and s.shape == (0, 4)
    assert tn.nvfp4_forward(torch.empty(0, 3, 16, device=DEV)).shape == (0, 3, 16)


def test_errors_name_argument_expected_and_actual():
    with pytest.raises(ValueError, match=r"input: last dim \(K\) must be a multiple of 16, got 20"):
        tn.scaled_fp4_quant(torch.randn(2, 20, device=DEV), torch.tensor([1.0], device=DEV))
    with pytest.raises(TypeError, match="input: expected dtype bfloat16 or float16 or float32, got int32"):
        tn.scaled_fp4_quant(torch.ones(2, 16, dtype=torch.int32, device=DEV), torch.tensor([1.0], device=DEV))
    with pytest.raises(ValueError, match=r"input_global_scale: expected a single fp32 value"):
        tn.scaled_fp4_quant(torch.randn(2, 16, device=DEV), torch.ones(2, device=DEV))
    with pytest.raises(ValueError, match="scale_format: expected one of"):
        tn.scaled_fp4_quant(torch.randn(2, 16, device=DEV), torch.tensor([1.0], device=DEV), scale_format="e8m0")
    with pytest.raises(TypeError, match="seed: expected an int or None, got str"):
        tn.nvfp4_forward(torch.randn(2, 16, device=DEV), None, True, seed="7")


def test_registry_backend_and_reasons():
    assert _register.unavailable_reason(torch.device("cpu")) == "device is cpu, not cuda"
    for op in _register.TRITON_OPS:
        backend, skipped = _registry.select(op, torch.device("cpu"))
        assert backend.name == "reference"
        assert ("triton", "device is cpu, not cuda") in skipped
    assert _registry._OPS["stage_deepseek_v4_mega_moe_inputs"][-1].name == "reference"


@GPU
def test_public_ops_dispatch_to_triton_on_cuda():
    dev = torch.device("cuda")
    for op in _register.TRITON_OPS:
        backend, _ = _registry.select(op, dev)
        assert backend.name != "reference", (op, backend.name)  # triton, or a compiled backend ahead of it
    x = special_input(64, 256, torch.bfloat16).to(dev)
    gs = torch.tensor([2.5], device=dev)
    p1, s1 = ops.scaled_fp4_quant(x, gs)
    p2, s2 = ref.scaled_fp4_quant(x.cpu(), gs.cpu())
    assert same_bits(p1, p2) and same_bits(s1, s2)


@GPU
def test_cuda_graph_capture_no_host_sync():
    x = special_input(256, 512, torch.bfloat16).cuda()
    gs = torch.tensor([1.5], device="cuda")
    tn.scaled_fp4_quant(x, gs)
    tn.nvfp4_forward(x)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        p, s = tn.scaled_fp4_quant(x, gs)
        y = tn.nvfp4_forward(x)
    x.copy_(special_input(256, 512, torch.bfloat16, seed=9).cuda())
    g.replay()
    torch.cuda.synchronize()
    xc = x.cpu()
    assert same_bits(p, ref.scaled_fp4_quant(xc, gs.cpu())[0]) and same_bits(s, ref.scaled_fp4_quant(xc, gs.cpu())[1])
    assert same_bits(y, ref.fake_quant_nvfp4(xc))


@pytest.mark.parametrize("order", ["k", "m"])
def test_program_order_gives_the_same_bytes(order):
    """Both program orders of the 2-D grid (K tiles fastest, row blocks fastest) cover every tile once:
    several row blocks and K tiles, a ragged last row block, swizzled padding written, the reference's bytes."""
    from nvfp4_plugin.triton import _runtime as rt
    from nvfp4_plugin.triton import mx

    x = special_input(37, 512, torch.bfloat16, seed=5)
    gs = nx.tensor_global_scale(x.float())
    with rt.tile_override("*", elems=256, max_block_k=64, order=order):
        q, s = tn.scaled_fp4_quant(x.to(DEV), gs.to(DEV))
        mq, ms = mx.mxfp4_quantize(x.to(DEV))
    rq, rs = ref.scaled_fp4_quant(x, gs)
    assert same_bits(q, rq) and same_bits(s, rs)
    rmq, rms = ref.mxfp4_quantize(x)
    assert same_bits(mq, rmq) and same_bits(ms, rms)
    from nvfp4_plugin.triton import staging

    h = special_input(37, 256, torch.bfloat16, seed=6)
    ids = torch.randint(0, 64, (37, 2), dtype=torch.int32)
    wts = torch.rand(37, 2)

    def outputs(device):
        return (torch.empty(37, 128, dtype=torch.uint8, device=device), torch.empty(37, 4, dtype=torch.int32, device=device),
                torch.empty(37, 2, dtype=torch.int64, device=device), torch.empty(37, 2, device=device))

    got, want = outputs(DEV), outputs("cpu")
    with rt.tile_override("*", elems=256, max_block_k=128, order=order):
        staging.stage_deepseek_v4_mega_moe_inputs(h.to(DEV), wts.to(DEV), ids.to(DEV), *got)
    ref.stage_deepseek_v4_mega_moe_inputs(h, wts, ids, *want)
    assert all(same_bits(a, b) for a, b in zip(got, want))


def test_grid_puts_the_long_axis_first_when_axis_1_would_overflow():
    from nvfp4_plugin.triton import _runtime as rt

    assert rt.tile_grid(64, 4096, 8, 512) == ((8, 8), 8, 8, False)  # row blocks on axis 0 (order "m")
    with rt.tile_override("*", order="k"):
        assert rt.tile_grid(64, 4096, 8, 512) == ((8, 8), 8, 8, True)
        assert rt.tile_grid(8 * 70000, 512, 8, 512)[3] is False  # 70000 row blocks cannot go on axis 1
    grid, n_m, n_k, k_fast = rt.tile_grid(8, 16 * 70001, 8, 16)  # 70001 K tiles cannot either
    assert k_fast and grid == (70001, 1)
    with pytest.raises(ValueError, match="more than a grid holds"):
        rt.tile_grid(8 * 70000, 16 * 70001, 8, 16)


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rows_that_are_not_16_byte_aligned(dtype):
    """Row strides and base addresses that rule out 16-byte loads give Triton other tile layouts; the
    bytes must not change (the E2M1 encoder gets its 8 values as separate operands, whatever the layout)."""
    from nvfp4_plugin.triton import mx, staging

    big = special_input(64, 520, dtype, seed=9).to(DEV)
    flat = big.reshape(-1)
    views = {"row stride 520": big[:, :512], "base + 8 bytes": flat[4:4 + 64 * 512].view(64, 512)}
    for name, x in views.items():
        xc = x.cpu().contiguous()
        gs = nx.tensor_global_scale(xc).reshape(1)
        for swizzle in (True, False):
            p1, s1 = tn.scaled_fp4_quant(x, gs.to(DEV), swizzle=swizzle)
            p2, s2 = ref.scaled_fp4_quant(xc, gs, swizzle=swizzle)
            assert same_bits(p1, p2) and same_bits(s1, s2), name
        q1, e1 = mx.mxfp4_quantize(x)
        q2, e2 = ref.mxfp4_quantize(xc)
        assert same_bits(q1, q2) and same_bits(e1, e2), name
        # stochastic: the same draws as on a contiguous copy
        assert same_bits(mx.mxfp4_quantize(x, stochastic_rounding=True, seed=7)[0],
                         mx.mxfp4_quantize(xc.to(DEV), stochastic_rounding=True, seed=7)[0]), name
        ids = torch.zeros(64, 2, dtype=torch.int32)
        wts = torch.ones(64, 2)
        got = (torch.empty(64, 256, dtype=torch.uint8, device=DEV), torch.empty(64, 8, dtype=torch.int32, device=DEV),
               torch.empty(64, 2, dtype=torch.int64, device=DEV), torch.empty(64, 2, device=DEV))
        want = tuple(torch.empty(t.shape, dtype=t.dtype) for t in got)
        staging.stage_deepseek_v4_mega_moe_inputs(x, wts.to(DEV), ids.to(DEV), *got)
        ref.stage_deepseek_v4_mega_moe_inputs(xc, wts, ids, *want)
        assert all(same_bits(a, b) for a, b in zip(got, want)), name


def test_program_order_is_validated():
    from nvfp4_plugin.triton import _runtime as rt

    with rt.tile_override("*", order="x"), pytest.raises(ValueError, match="order: expected 'k' or 'm'"):
        tn.scaled_fp4_quant(torch.zeros(4, 32, dtype=torch.bfloat16, device=DEV), torch.ones(1, device=DEV))
