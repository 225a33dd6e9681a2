"""Independent formulations used to cross-check the reference (brute force, per-element loops)."""

import math
from fractions import Fraction

import torch

from nvfp4_plugin import numerics as nx

E2M1_MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def brute_e2m1(v: float) -> int:
    """Nearest E2M1 magnitude by exhaustive search, ties to the even code; sign bit from the input."""
    if math.isnan(v):
        return 0
    a = Fraction(abs(v)) if math.isfinite(v) else Fraction(10**40)  # exact distances, no float ties
    best = min(range(8), key=lambda i: (abs(Fraction(E2M1_MAGS[i]) - a), i % 2))
    return best | (8 if math.copysign(1.0, v) < 0 else 0)


def e4m3_grid() -> list:
    return [torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item() for b in range(127)]


_E4M3 = None


def brute_e4m3_byte(v: float) -> int:
    """fp32 -> e4m3 byte by exhaustive nearest search (ties to even byte), saturating, sign kept."""
    global _E4M3
    if _E4M3 is None:
        _E4M3 = e4m3_grid()
    if math.isnan(v):
        return 0x7F
    a = Fraction(min(abs(v), 448.0))
    best = min(range(127), key=lambda b: (abs(Fraction(_E4M3[b]) - a), b % 2))
    return best | (0x80 if math.copysign(1.0, v) < 0 else 0)


def peer_ref_nvfp4_quant(x: torch.Tensor, global_scale: torch.Tensor):
    """The recipe of the vLLM / sgl-kernel test reference (ref_nvfp4_quant), written independently.

    Returns (fp32 values on the E2M1 grid times sign, e4m3 scales [M, K/16]) as those tests do.
    """
    m, k = x.shape
    xb = x.reshape(m, k // 16, 16)
    vmax = xb.abs().amax(dim=-1, keepdim=True).float()
    scale = global_scale * (vmax * (1.0 / 6.0))
    scale = scale.clamp(max=448.0).to(torch.float8_e4m3fn)
    inv_gs = torch.where(global_scale == 0, torch.zeros_like(global_scale), 1.0 / global_scale)
    denom = scale.float() * inv_gs
    out_scale = torch.where(denom == 0, torch.zeros_like(denom), 1.0 / denom)
    y = (xb.float() * out_scale).clamp(-6.0, 6.0).reshape(m, k)
    sign = torch.sign(y)
    a = y.abs()
    out = torch.empty_like(a)
    out[(a >= 0.0) & (a <= 0.25)] = 0.0
    out[(a > 0.25) & (a < 0.75)] = 0.5
    out[(a >= 0.75) & (a <= 1.25)] = 1.0
    out[(a > 1.25) & (a < 1.75)] = 1.5
    out[(a >= 1.75) & (a <= 2.5)] = 2.0
    out[(a > 2.5) & (a < 3.5)] = 3.0
    out[(a >= 3.5) & (a <= 5.0)] = 4.0
    out[a > 5.0] = 6.0
    return out * sign, scale.squeeze(-1)


def values_to_codes(vals: torch.Tensor) -> torch.Tensor:
    """E2M1 grid values (fp32, signed zeros meaningful) -> codes."""
    table = torch.tensor(E2M1_MAGS)
    idx = (vals.abs()[..., None] == table).float().argmax(-1).to(torch.uint8)
    return idx | (torch.signbit(vals).to(torch.uint8) << 3)


def loop_swizzle(lin: torch.Tensor) -> torch.Tensor:
    """Swizzle by scattering each element to the documented byte offset, one at a time."""
    m, kb = lin.shape
    mp, kp = nx.round_up(m, 128), nx.round_up(kb, 4)
    flat = torch.zeros(mp * kp, dtype=torch.uint8)
    src = lin.view(torch.uint8) if lin.element_size() == 1 else lin
    for i in range(m):
        for j in range(kb):
            flat[nx.swizzled_offset(i, j, kb)] = src[i, j]
    return flat.reshape(mp, kp)
