"""Triton MXFP4 / MXFP8 kernels byte for byte against the reference (deterministic rounding).

CPU: Triton interpreter on small shapes (see test_triton_nvfp4.py); GPU: the same plus large shapes.
"""

import math

import pytest
import torch

from tests._require import require_triton_kernels

require_triton_kernels()

from nvfp4_plugin import numerics as nx  # noqa: E402
from nvfp4_plugin import reference as ref  # noqa: E402
from nvfp4_plugin import triton as T  # noqa: E402
from nvfp4_plugin.triton import mx  # noqa: E402

from .test_triton_nvfp4 import DEV, DTYPES, GPU, same_bits, special_input  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

# (shape, GPU only)
SHAPES = [((1, 32), False), ((4, 3, 96), False), ((33, 320), False), ((1000, 7168), True), ((3, 129, 1056), True)]


def mx_cases():
    """Every (format, recipe, dtype) and every (format, recipe, shape), without the full product:
    each launch configuration is a separate compile on the GPU."""
    cases = []
    for fmt in ("e2m1", "e4m3", "e5m2"):
        for recipe in ("floor", "rceil"):
            for i, (shape, gpu) in enumerate(SHAPES):
                dtypes = DTYPES if shape == (33, 320) else [DTYPES[(i + len(fmt) + len(recipe)) % 3]]
                for dt in dtypes:
                    cases.append(pytest.param(fmt, recipe, dt, shape, marks=[GPU] if gpu else [],
                                              id=f"{fmt}-{recipe}-{str(dt)[6:]}-{'x'.join(map(str, shape))}"))
    return cases


def run_both(x, fmt, recipe):
    """(triton, reference) results of quantize and fake-quantize for one format."""
    xd = x.to(DEV)
    if fmt == "e2m1":
        return ((mx.mxfp4_quantize(xd, scale_recipe=recipe), mx.mxfp4_forward(xd, scale_recipe=recipe)),
                (ref.mxfp4_quantize(x, scale_recipe=recipe), ref.fake_quant_mxfp4(x, scale_recipe=recipe)))
    return ((mx.mxfp8_quantize(xd, fmt, scale_recipe=recipe), mx.mxfp8_forward(xd, fmt, scale_recipe=recipe)),
            (ref.mxfp8_quantize(x, fmt, scale_recipe=recipe), ref.fake_quant_mxfp8(x, fmt, scale_recipe=recipe)))


@pytest.mark.parametrize("fmt,recipe,dtype,shape", mx_cases())
def test_mx_matches_reference(fmt, recipe, dtype, shape):
    x = special_input(math.prod(shape[:-1]), shape[-1], dtype, seed=sum(shape) + len(fmt)).reshape(shape)
    ((q1, s1), y1), ((q2, s2), y2) = run_both(x, fmt, recipe)
    assert q1.dtype == q2.dtype and q1.shape == q2.shape and s1.shape == s2.shape and y1.dtype == dtype
    assert same_bits(s1, s2), "scales"
    assert same_bits(q1, q2), "elements"
    assert same_bits(y1, y2), "fake quant"


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2"])
def test_scale_edge_cases(fmt):
    """amax exactly at powers of two and just off them (both recipes), fp32 subnormal and huge
    amax, Inf as FLT_MAX, blocks of NaN and zeros, and elements on every grid midpoint."""
    fmax = {"e2m1": 6.0, "e4m3": 448.0, "e5m2": 57344.0}[fmt]
    rows = []
    for e in (-140, -127, -100, -3, 0, 5, 100, 120):
        for amax in (2.0 ** e, 2.0 ** e * (1 + 2 ** -23), 2.0 ** e * (1 - 2 ** -24), fmax * 2.0 ** e):
            if amax > 3.4e38:
                continue
            r = torch.full((32,), amax / 3).float()
            r[7] = -amax
            rows.append(r)
    grid = nx.fp8_grid(fmt)
    mids = ((grid[:-1] + grid[1:]) / 2)
    for chunk in mids.split(31):
        r = torch.zeros(32)
        r[0] = fmax
        r[1:1 + chunk.numel()] = chunk * torch.where(torch.arange(chunk.numel()) % 2 == 0, 1.0, -1.0)
        rows.append(r)
    special = torch.tensor([math.inf] + [1.0] * 31)
    rows += [special, -special, torch.full((32,), math.nan), torch.zeros(32), torch.full((32,), 3.4e38)]
    x = torch.stack(rows)
    for recipe in ("floor", "rceil"):
        ((q1, s1), y1), ((q2, s2), y2) = run_both(x, fmt, recipe)
        assert same_bits(s1, s2) and same_bits(q1, q2) and same_bits(y1, y2), recipe


def test_seed_style_names_and_dispatch_helpers():
    x = special_input(4, 64, torch.bfloat16)
    assert same_bits(T.mxfp4_forward(x.to(DEV)), ref.fake_quant_mxfp4(x))
    assert same_bits(T.mxfp8_forward(x.to(DEV), format="e5m2"), ref.fake_quant_mxfp8(x, "e5m2"))
    assert same_bits(T.nvfp4_forward(x.to(DEV)), ref.fake_quant_nvfp4(x))
    # the fake_quant_* conveniences use the reference off CUDA
    assert same_bits(T.fake_quant_mxfp4(x), ref.fake_quant_mxfp4(x))
    assert same_bits(T.fake_quant_mxfp8(x, "e4m3"), ref.fake_quant_mxfp8(x, "e4m3"))
    assert same_bits(T.fake_quant_nvfp4(x), ref.fake_quant_nvfp4(x))


def test_mx_errors():
    with pytest.raises(ValueError, match=r"x: last dim \(K\) must be a multiple of 32, got 48"):
        mx.mxfp4_quantize(torch.randn(2, 48, device=DEV))
    with pytest.raises(ValueError, match="scale_recipe: expected one of"):
        mx.mxfp4_forward(torch.randn(2, 64, device=DEV), scale_recipe="round")
    with pytest.raises(ValueError, match="format: expected one of"):
        mx.mxfp8_quantize(torch.randn(2, 64, device=DEV), "e3m4")
