"""The CUDA kernels' shared numerics, run on the CPU and compared byte for byte with the reference.

csrc/tests/host_numerics.cu is built with nvcc as a host program from the same headers the kernels
use (software E2M1 twin, scale recipes, correctly rounded division, fixed SiLU, swizzle). These
tests need nvcc, not a GPU; they skip when nvcc is missing.
"""

from __future__ import annotations

import math
import struct
import subprocess

import pytest
import torch

from nvfp4_plugin import numerics as nx
from nvfp4_plugin import reference as ref

from .test_csrc_compile import HOST_DRIVER_SOURCE, build_host_driver, find_nvcc

pytestmark = pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found (CUDA toolkit needed to build csrc)")

DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return build_host_driver(tmp_path_factory.mktemp("host_numerics"))


def run(driver, tmp_path, mode, data: bytes, *args) -> bytes:
    src, dst = tmp_path / f"{mode}.in", tmp_path / f"{mode}.out"
    src.write_bytes(data)
    subprocess.run([str(driver), mode, str(src), str(dst), *map(str, args)], check=True)
    return dst.read_bytes()


def f32_hex(v: float) -> str:
    return format(struct.unpack("<I", struct.pack("<f", v))[0], "x")


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def u8(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def f32(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.float32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def edge_values() -> torch.Tensor:
    """E2M1 boundaries, their fp32 neighbours, signed zeros, subnormals, huge values, infinities."""
    base = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 7.5, 8.0, 12.0,
            1e-45, 1e-40, 1.17549435e-38, 1e-10, 100.0, 1e30, 3.4028234663852886e38]
    t = torch.tensor(base, dtype=torch.float32)
    up = torch.nextafter(t, torch.full_like(t, math.inf))
    down = torch.nextafter(t, torch.zeros_like(t))
    v = torch.cat([t, up, down, torch.tensor([math.inf])])
    return torch.cat([v, -v])


def test_e2m1_software_twin_matches_numerics(driver, tmp_path):
    g = torch.Generator().manual_seed(0)
    rnd = torch.cat([torch.rand(20000, generator=g) * 8, torch.randn(20000, generator=g) * 3,
                     torch.randint(0, 2**32, (20000,), generator=g, dtype=torch.int64).to(torch.int32).view(
                         torch.float32)])
    vals = torch.cat([edge_values(), rnd])
    vals = vals[~torch.isnan(vals)]
    want = nx.e2m1_encode(vals)
    # path 1 (finite) and 2 (any) take every non-NaN value
    for path in (1, 2):
        got = u8(run(driver, tmp_path, "e2m1", raw(vals), path))
        assert torch.equal(got, want), f"path {path}"
    # path 0 (the fast encoder, fed the products times its scale by the driver) is only used when |y| < 7
    small = vals[vals.abs() < 7]
    assert torch.equal(u8(run(driver, tmp_path, "e2m1", raw(small), 0)), nx.e2m1_encode(small))
    # NaN -> code 0 on the NaN-aware path
    nans = torch.tensor([math.nan, -math.nan, 1.0, math.nan, -2.0, math.nan, 0.3, math.nan])
    assert u8(run(driver, tmp_path, "e2m1", raw(nans), 2)).tolist() == nx.e2m1_encode(nans).tolist()


def test_e4m3_conversion_and_decode(driver, tmp_path):
    g = torch.Generator().manual_seed(1)
    vals = torch.cat([edge_values(), torch.randn(50000, generator=g) * 200, torch.rand(5000, generator=g) * 2e-3,
                      torch.tensor([464.0, 463.99, 480.0, 1e9, -1e9, math.nan])])
    out = u8(run(driver, tmp_path, "e4m3", raw(vals)))
    n = vals.numel()
    want = nx.e4m3_saturate(vals).view(torch.uint8)
    assert torch.equal(out[:n], want)  # satfinite alone ...
    assert torch.equal(out[n:], want)  # ... equals satfinite after the clamp to +-448
    dec = f32(run(driver, tmp_path, "e4m3dec", b""))
    want_dec = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    assert same_bits(dec[~torch.isnan(want_dec)], want_dec[~torch.isnan(want_dec)])
    assert torch.isnan(dec[torch.isnan(want_dec)]).all()


def test_division_is_correctly_rounded(driver, tmp_path):
    g = torch.Generator().manual_seed(2)
    bits = torch.randint(0, 2**32, (400000,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    normal = torch.randn(200000, generator=g) * torch.exp(torch.randn(200000, generator=g) * 20)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, 1e-45, 3e-39, 3.4e38, 448.0, 2.0**-126,
                            2.0**127, 6.0, 1.0 / 3])
    a = torch.cat([bits[:200000], normal[:100000], special.repeat_interleave(len(special))])
    b = torch.cat([bits[200000:], normal[100000:], special.repeat(len(special))])
    got = f32(run(driver, tmp_path, "div", raw(torch.stack([a, b], 1))))
    want = a / b  # tensor / tensor on the CPU: IEEE division
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert same_bits(got[~nan], want[~nan])


def test_exp_and_silu(driver, tmp_path):
    g = torch.Generator().manual_seed(3)
    y = torch.cat([torch.randn(100000, generator=g) * 30, torch.linspace(-100, 100, 20001),
                   torch.tensor([88.5, 88.50001, -87.3, -87.31, math.inf, -math.inf, 0.0, -0.0, 1e-40])])
    got = f32(run(driver, tmp_path, "exp", raw(y)))
    assert same_bits(got, nx.exp_fp32(y))
    for dtype, code in DTYPES.items():
        x = (torch.randn(2, 20000, generator=g) * 4).to(dtype)
        x[0, :8] = torch.tensor([0.0, -0.0, math.inf, -math.inf, 1e4, -1e4, 90.0, -90.0]).to(dtype)
        got = torch.frombuffer(bytearray(run(driver, tmp_path, "silu", raw(x), code, x.shape[1])), dtype=dtype)
        want = nx.silu_and_mul_fp32(torch.cat([x[0], x[1]]))
        # NaN payloads differ between torch's CPU casts and CUDA's conversions (torch on CUDA uses CUDA's)
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan), dtype
        assert torch.equal(got[~nan].view(torch.uint8), want[~nan].view(torch.uint8)), dtype


def nvfp4_case(driver, tmp_path, x: torch.Tensor, gs: float, scale_format: str):
    m, k = x.shape
    out = u8(run(driver, tmp_path, "nvfp4", raw(x), DTYPES[x.dtype], m, k, int(scale_format == "ue8m0"), f32_hex(gs)))
    q_ref, s_ref = ref.scaled_fp4_quant(x, torch.tensor([gs]), swizzle=False, scale_format=scale_format)
    q, s = out[: m * k // 2].reshape(m, k // 2), out[m * k // 2:].reshape(m, k // 16)
    s_ref = s_ref.view(torch.uint8).clone()
    if scale_format == "e4m3":
        # a NaN scale (gs = 0 times an infinite amax): x86 makes that NaN negative (0xFF), CUDA positive
        # (0x7F), in torch's reference as in the kernels; compare it as NaN
        s_ref[s_ref == 0xFF] = 0x7F
    assert torch.equal(s, s_ref), (x.dtype, gs, scale_format)
    assert torch.equal(q, q_ref), (x.dtype, gs, scale_format)


def special_activations(m: int, k: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g) * 2)
    flat = x.view(-1)
    n = flat.numel()
    idx = torch.randperm(n, generator=g)
    flat[idx[: n // 50]] = math.nan
    flat[idx[n // 50: n // 40]] = math.inf
    flat[idx[n // 40: n // 30]] = -math.inf
    flat[idx[n // 30: n // 20]] = 0.0
    flat[idx[n // 20: n // 15]] = -0.0
    flat[idx[n // 15: n // 12]] *= 1e30
    flat[idx[n // 12: n // 10]] *= 1e-30
    x[0] = 0.0  # an all-zero row
    x[1, :16] = math.nan  # an all-NaN block
    return x.to(dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("scale_format", ["e4m3", "ue8m0"])
def test_nvfp4_block_recipe_matches_reference(driver, tmp_path, dtype, scale_format):
    for seed, (m, k) in enumerate([(7, 64), (33, 2048), (5, 48)]):
        x = special_activations(m, k, dtype, seed)
        clean = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
        for data in (x, clean):
            amax = data.float().abs().nan_to_num(0.0, posinf=0.0, neginf=0.0).amax().item() or 1.0
            for gs in (448 * 6 / amax, 1.0, 0.0, -3.0, 1e-30, 1e30, math.inf, 2.0**-140):
                nvfp4_case(driver, tmp_path, data, gs, scale_format)


def group_recipe(x: torch.Tensor, group: int, eps: float, ue8m0: bool):
    """The sgl-kernel per-token-group recipe with an IEEE division for 448 / a (numerics docstring)."""
    m, k = x.shape
    grp = x.reshape(m, k // group, group).float()
    a = nx.nan_ignoring_amax(grp, dim=-1, inf_as_max=True).clamp(min=eps)
    if ue8m0:
        e = nx.ceil_log2_exponent(a * nx._ONE_OVER_448_F32)
        mult, bits = nx.exp2_int(-e), (e + 127).to(torch.uint8).to(torch.int64)
    else:
        mult = torch.full_like(a, nx.E4M3_MAX) / a
        bits = (a * nx._ONE_OVER_448_F32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    q = nx.e4m3_saturate(grp * mult[..., None]).reshape(m, k)
    return q, bits.reshape(-1)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fp8_group_and_token_recipes(driver, tmp_path, dtype):
    x = special_activations(9, 512, dtype, 11)
    x[x.float().isnan()] = 1.0  # NaN elements: torch's CPU cast keeps a negative NaN's sign, CUDA's does not
    for ue8m0 in (False, True):
        out = run(driver, tmp_path, "fp8group", raw(x), DTYPES[dtype], 9, 512, 128, f32_hex(1e-10), int(ue8m0))
        q_want, s_want = group_recipe(x, 128, 1e-10, ue8m0)
        q, s = u8(out[: 9 * 512]), torch.frombuffer(bytearray(out[9 * 512:]), dtype=torch.int32).to(torch.int64)
        assert torch.equal(q, q_want.view(torch.uint8).reshape(-1)), ue8m0
        assert torch.equal(s & 0xFFFFFFFF, s_want), ue8m0
        # the reference agrees on the scales (its 448 / a is reciprocal(a) * 448: see the report)
        q_ref, s_ref = ref.per_token_group_quant_fp8(x, column_major_scales=ue8m0, scale_ue8m0=ue8m0)
        if not ue8m0:
            assert torch.equal(s_ref.reshape(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF, s_want)
    out = run(driver, tmp_path, "fp8token", raw(x), DTYPES[dtype], 9, 512)
    q_ref, s_ref = ref.per_token_quant_fp8(x)  # CPU: amax / 448 is an IEEE division
    assert torch.equal(u8(out[: 9 * 512]), q_ref.view(torch.uint8).reshape(-1))
    assert same_bits(f32(out[9 * 512:]), s_ref.reshape(-1))


def test_swizzle_offsets(driver, tmp_path):
    for kb in (1, 3, 4, 13, 448):
        kt = nx.ceil_div(kb, 4)
        mm, kk = torch.meshgrid(torch.arange(300), torch.arange(nx.round_up(kb, 4)), indexing="ij")
        pairs = torch.stack([mm.reshape(-1), kk.reshape(-1)], 1).to(torch.int32)
        got = torch.frombuffer(bytearray(run(driver, tmp_path, "swizzle", raw(pairs), kt)), dtype=torch.int32)
        want = nx.swizzled_offset(pairs[:, 0].long(), pairs[:, 1].long(), kb)
        assert torch.equal(got.long(), want)


@pytest.mark.parametrize("rows, trows, cols, tcols, steps, resident", [
    (8192, 1, 256, 256, 8, 792),          # 8192 x 4096: one column tile, 8-step runs, tapered
    (32768 + 37, 2, 128, 128, 8, 792),    # 32768 x 2048 plus a ragged end: 2 rows per step
    (65536, 1, 448, 224, 32, 660),        # experts, two column tiles, 32-row runs
    (5000, 1, 256, 256, 8, 792),          # too few rows to taper: equal runs
    (1, 1, 256, 256, 8, 792),
    (70_000_000, 1, 256, 256, 8, 792),    # grid.y over 65535: the runs double
])
def test_chunk_plan_covers_every_row_step_once(driver, tmp_path, rows, trows, cols, tcols, steps, resident):
    """csrc chunk_grid / chunk_run: the CTA rows' runs tile [0, row steps) in order, back to back, with no gap
    or overlap past the end; where the rows fill more than two waves, the last wave (and the remainder) of CTA
    rows takes quarter runs and the wave before it half runs, else every run is equal."""
    out = torch.frombuffer(bytearray(run(driver, tmp_path, "chunks", b"", rows, trows, cols, tcols, steps, resident)),
                           dtype=torch.int32).long()
    gx, gy, s = out[:3].tolist()
    runs = out[3:].reshape(-1, 2)
    row_steps = nx.ceil_div(rows, trows)
    assert gx == nx.ceil_div(cols, tcols) and runs.shape[0] == gy <= 65535 and s >= steps
    begins, lengths = runs[:, 0], runs[:, 1]
    assert begins[0] == 0 and torch.equal(begins[1:], begins[:-1] + lengths[:-1])  # back to back
    assert begins[-1] < row_steps <= begins[-1] + lengths[-1]  # the last run reaches the end, none starts past it
    wave = max(resident // gx, 1)
    if row_steps > wave * (s // 2 + s // 4):
        n_full, n_half, n_quarter = [int((lengths == v).sum()) for v in (s, s // 2, s // 4)]
        assert n_full + n_half + n_quarter == gy and n_half == wave  # full runs, one wave of halves, ...
        assert wave <= n_quarter < wave + 4  # ... then at least a wave of quarters (the remainder's too)
        assert (lengths[:-1] >= lengths[1:]).all()  # in that order
    else:
        assert (lengths == s).all()


def test_driver_source_is_in_tree():
    assert HOST_DRIVER_SOURCE.is_file()
