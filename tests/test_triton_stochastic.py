"""Stochastic rounding of the Triton MX / NVFP4 kernels: neighbours only, unbiased, seeded.

Test design (sound statistics, not a 16%-flaky "3 sigma for each of 64 elements"):
* inputs are built so that every element's scaled value sits at a known fraction ``p`` in
  [0.05, 0.95] of a grid interval (a few sit exactly on grid points), and each block's first
  element fixes the block scale exactly; so the exact null distribution of every output is known;
* N = 4096 independent draws per element: on a GPU literally 4096 seeds, under the CPU
  interpreter 4096 repeated rows with one seed (Philox counters differ per row, so the draws are
  as independent as different keys, and it is one launch instead of 4096);
* z_i = sign_i (mean_i - x_i) / se_i (in magnitude, so that a bias towards rounding up adds up over
  elements of both signs) with the exact standard error ``gap * sqrt(p (1-p) / N)`` (not the
  sample std). Checks: max |z_i| below the Bonferroni bound for a family-wise false alarm of 1e-3
  (about 4.4 sigma for 128 elements), and the aggregate ``sum z_i / sqrt(n)`` within 3.29 (false
  alarm 1e-3), which catches a common bias of 0.3 standard errors per element. "Every element
  within 3 SE" taken literally fails a correct implementation 1 - 0.9973**128 = 29% of the time.
* every output is exactly one of the two neighbours (with the input's sign), grid points never
  move, scales equal the deterministic ones, same seed -> same bytes, another seed -> different.
"""

import math
from statistics import NormalDist

import pytest
import torch

from tests._require import require_triton_kernels

require_triton_kernels()

from nvfp4_plugin import numerics as nx  # noqa: E402
from nvfp4_plugin import reference as ref  # noqa: E402
from nvfp4_plugin.triton import _runtime as rt  # noqa: E402
from nvfp4_plugin.triton import mx, nvfp4  # noqa: E402

from .test_triton_nvfp4 import DEV, GPU, same_bits  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

N_DRAWS = 4096
FMAX = {"e2m1": 6.0, "e4m3": 448.0, "e5m2": 57344.0}


def designed_input(kind: str, seed: int = 0):
    """``[1, 128]`` fp32 input with known grid positions, and per element (lo, hi, p) in scaled units
    plus the exact scale of its block."""
    fmt = "e2m1" if kind == "nvfp4" else kind
    block = 16 if kind == "nvfp4" else 32
    g = torch.Generator().manual_seed(seed)
    grid = nx.fp8_grid(fmt).double()
    n = 128
    nblocks = n // block
    exps = torch.tensor([-3, 0, 2, 5, -1, 1, 3, -2])[:nblocks]
    scale = (2.0 ** exps.double()).repeat_interleave(block)
    idx = torch.randint(0, grid.numel() - 1, (n,), generator=g)
    p = 0.05 + 0.9 * torch.rand(n, generator=g, dtype=torch.float64)
    p[5::17] = 0.0  # some elements exactly on a grid point
    mag = grid[idx] + p * (grid[idx + 1] - grid[idx])
    first = torch.arange(n) % block == 0
    mag[first] = FMAX[fmt]  # block max: fixes the scale to exactly 2**exp (MX floor recipe, NVFP4 gs=1)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    x = (sign * mag * scale).float()
    # recompute positions from the fp32 values actually used
    a = x.double().abs() / scale
    i = (torch.searchsorted(grid, a, right=True) - 1).clamp(0, grid.numel() - 2)
    lo, hi = grid[i], grid[i + 1]
    pos = (a - lo) / (hi - lo)
    on_grid = (pos == 0) | (pos == 1)
    return x[None, :], lo, hi, pos, scale, on_grid


def sr_fake(kind, x, seed):
    if kind == "nvfp4":
        return nvfp4.nvfp4_forward(x, torch.tensor([1.0], device=x.device), True, seed=seed)
    if kind == "e2m1":
        return mx.mxfp4_forward(x, True, seed=seed)
    return mx.mxfp8_forward(x, kind, True, seed=seed)


def draws(kind, x):
    """[N_DRAWS, n] fp32 outputs: 4096 seeds on a GPU, 4096 rows and one seed in the interpreter."""
    if DEV.type == "cuda":
        xd = x.to(DEV)
        return torch.cat([sr_fake(kind, xd, seed) for seed in range(1, N_DRAWS + 1)]).double().cpu()
    with rt.tile_override("*", elems=1 << 16):
        return sr_fake(kind, x.repeat(N_DRAWS, 1), 1234).double()


@pytest.mark.parametrize("kind", ["e2m1", "e4m3", "e5m2", "nvfp4"])
def test_stochastic_rounding_is_unbiased_and_stays_on_neighbours(kind):
    x, lo, hi, p, scale, on_grid = designed_input(kind, seed=len(kind))
    y = draws(kind, x)
    sign = torch.where(x[0] < 0, -1.0, 1.0).double()
    lo_v, hi_v = sign * lo * scale, sign * hi * scale
    assert ((y == lo_v) | (y == hi_v)).all(), "an output is not one of the two neighbours"
    assert (y[:, on_grid] == x[0, on_grid].double()).all(), "a grid point moved"
    assert torch.equal(torch.signbit(y), torch.signbit(x.double()).expand_as(y))
    rnd = ~on_grid
    n = int(rnd.sum())
    se = (hi - lo)[rnd] * scale[rnd] * torch.sqrt(p[rnd] * (1 - p[rnd]) / N_DRAWS)
    z = sign[rnd] * (y[:, rnd].mean(0) - x[0, rnd].double()) / se  # in magnitude: a bias away from zero adds up
    z_bonferroni = NormalDist().inv_cdf(1 - 1e-3 / (2 * n))
    assert z.abs().max() < z_bonferroni, (z.abs().max().item(), z_bonferroni)
    assert abs(z.sum().item()) / math.sqrt(n) < 3.29
    # the fraction rounded up matches p (a direct look at the same thing, more readable on failure)
    frac_up = (y[:, rnd].abs() == (hi * scale)[rnd]).double().mean(0)
    assert (frac_up - p[rnd]).abs().max() < z_bonferroni * math.sqrt(0.25 / N_DRAWS)


@pytest.mark.parametrize("kind", ["e2m1", "e4m3", "e5m2", "nvfp4"])
def test_seeds_reproduce_and_differ_and_scales_stay_deterministic(kind):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(8, 256, generator=g) * 3).to(torch.bfloat16).to(DEV)
    a = sr_fake(kind, x, 77)
    assert same_bits(a, sr_fake(kind, x, 77))
    assert not same_bits(a, sr_fake(kind, x, 78))
    assert not same_bits(a, sr_fake(kind, x, 77 + 2 ** 40))  # high key bits matter too
    det = {"nvfp4": lambda t: ref.fake_quant_nvfp4(t, torch.tensor([1.0])),
           "e2m1": ref.fake_quant_mxfp4}.get(kind, lambda t: ref.fake_quant_mxfp8(t, kind))(x.cpu())
    assert not same_bits(a, det)  # really stochastic
    if kind != "nvfp4":
        # the packed path makes exactly the same choices as the fake-quant path, with the
        # deterministic scales
        if kind == "e2m1":
            q, s = mx.mxfp4_quantize(x, stochastic_rounding=True, seed=77)
            q_det, s_det = ref.mxfp4_quantize(x.cpu())
            vals = nx.e2m1_decode(nx.unpack_fp4(q.cpu()))
        else:
            q, s = mx.mxfp8_quantize(x, kind, stochastic_rounding=True, seed=77)
            q_det, s_det = ref.mxfp8_quantize(x.cpu(), kind)
            vals = q.cpu().float()
        assert same_bits(s, s_det)
        deq = (vals.reshape(8, -1, 32) * nx.ue8m0_to_float(s.cpu())[..., None]).reshape(8, 256)
        assert same_bits(deq.to(torch.bfloat16), a)


@GPU
def test_seed_none_draws_fresh_keys():
    x = torch.randn(4, 128, device="cuda")
    assert not same_bits(mx.mxfp4_forward(x, True), mx.mxfp4_forward(x, True))
    torch.manual_seed(5)
    a = mx.mxfp4_forward(x, True)
    torch.manual_seed(5)
    assert same_bits(a, mx.mxfp4_forward(x, True))  # seed=None follows torch's CPU generator


@GPU
@pytest.mark.parametrize("rounds", [10, 7])
def test_philox_block_gives_the_bits_of_tl_randint4x(rounds):
    """The compiled generator (inline PTX) is Triton's own Philox4x32, bit for bit, on the GPU."""
    import triton
    import triton.language as tl

    from nvfp4_plugin.triton import _jit_numerics as jn

    @triton.jit
    def both(out_ptr, seed, N_ROUNDS: tl.constexpr):
        i = tl.arange(0, 1024)
        offs = i.to(tl.int64) * 2654435761 + (3 << 33)  # both 32-bit counter halves vary
        a0, a1, a2, a3 = jn.philox4x32(seed, offs, N_ROUNDS, True)
        b0, b1, b2, b3 = tl.randint4x(seed, offs, N_ROUNDS)
        tl.store(out_ptr + i, a0.to(tl.int32, bitcast=True))
        tl.store(out_ptr + 1024 + i, a1.to(tl.int32, bitcast=True))
        tl.store(out_ptr + 2048 + i, a2.to(tl.int32, bitcast=True))
        tl.store(out_ptr + 3072 + i, a3.to(tl.int32, bitcast=True))
        tl.store(out_ptr + 4096 + i, b0.to(tl.int32, bitcast=True))
        tl.store(out_ptr + 5120 + i, b1.to(tl.int32, bitcast=True))
        tl.store(out_ptr + 6144 + i, b2.to(tl.int32, bitcast=True))
        tl.store(out_ptr + 7168 + i, b3.to(tl.int32, bitcast=True))

    out = torch.empty(8192, dtype=torch.int32, device="cuda")
    for seed in (0, 12345, 2**40 + 7):
        both[(1,)](out, seed, N_ROUNDS=rounds)
        assert torch.equal(out[:4096], out[4096:])
        assert out[:4096].unique().numel() > 4000  # and the words are not degenerate
