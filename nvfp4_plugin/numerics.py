"""The one place the formats are defined: NVFP4, MXFP4/MXFP8, FP8, and their scale layouts.

Every implementation in this project (the pure-torch reference, Triton, CUDA sm90a, CUDA sm100a)
must produce the same bytes as the functions here. The rules, in one place:

E2M1 (FP4)
    4-bit code: bit 3 is the sign, bits 0-2 index ``E2M1_MAGNITUDES = [0, .5, 1, 1.5, 2, 3, 4, 6]``.
    Round to nearest, ties to even, saturating at +-6. In magnitude terms:
    ``<=0.25 -> 0, <0.75 -> 0.5, <=1.25 -> 1, <1.75 -> 1.5, <=2.5 -> 2, <3.5 -> 3, <=5 -> 4, else 6``.
    The sign bit is the input's sign bit, also when the magnitude rounds to zero (-0.1 -> 0x8), as
    PTX ``cvt.rn.satfinite.e2m1x2.f32`` does. NaN encodes as code 0 (+0). +-Inf saturates to +-6.
    Packing: element 2i in the low nibble, element 2i+1 in the high nibble of byte i.

NVFP4 quantization (identical to the vLLM / sgl-kernel test reference ``ref_nvfp4_quant``)
    Input ``x[M, K]``, ``K % 16 == 0``; ``gs`` is the *encode* global scale (fp32), typically
    ``448 * 6 / amax(|x|)``. For each 16-wide block along K, all arithmetic in IEEE fp32:
      1. ``vmax = max |x_i|`` (NaN elements are ignored; an all-NaN block has vmax 0);
      2. ``s = e4m3(clamp(gs * (vmax * fp32(1/6)), -448, 448))`` (round to nearest even);
      3. ``out_scale = 0 if s == 0 else 1 / (fp32(s) * (1 / gs))`` (IEEE division, no FTZ);
      4. ``q_i = E2M1(clamp(x_i * out_scale, -6, 6))``.
    Dequantization: ``x_hat_i = (e2m1(q_i) * fp32(s)) / gs``.
    Special values: NaN never changes its block's scale and encodes as code 0; +-Inf behaves like a
    huge finite value (the scale saturates at 448, the element at +-6); an all-zero block has scale 0
    and codes 0.
    UE8M0 variant (``scale_format="ue8m0"``): the scale is ``2**e`` with ``e`` the smallest integer
    such that ``2**e >= gs * (vmax * fp32(1/6))`` (so no element saturates), clamped to [-127, 127];
    ``s == 0`` gives byte 0. Stored as the biased exponent byte ``e + 127``.

Swizzled "128x4" scale layout (CUTLASS, cuBLAS, FlashInfer, sgl-kernel, vLLM)
    Shape ``[round_up(M, 128), round_up(K/16, 4)]``; the byte offset of (m, k) is
    ``((m // 128) * Ktiles + k // 4) * 512 + (m % 32) * 16 + ((m // 32) % 4) * 4 + k % 4`` with
    ``Ktiles = ceil(K/64)``. Padding bytes are always zero.
    Per-expert (MoE): expert e's scale rows start at ``blockscale_offsets[e]``, with
    ``blockscale_offsets[e+1] = blockscale_offsets[e] + round_up(tokens_e, 128)``.
    Masked layout: activations ``[E, max_m, K]`` with ``mask[E]`` valid rows per expert; scales
    ``[E, round_up(max_m, 128), round_up(K/16, 4)]`` swizzled per expert.

MX formats (OCP MX v1.0)
    Blocks of 32 along the last dim, one E8M0 scale (``2**(byte-127)``, byte 0xFF = NaN), no global
    scale. Elements: E2M1 (emax 2), E4M3 (max 448, emax 8), E5M2 (max 57344, emax 15), saturating.
    ``amax`` ignores NaN and treats +-Inf as the largest finite fp32. Scale recipes:
      * ``"floor"`` (OCP, the default): ``e = floor(log2(amax)) - emax_elem``;
      * ``"rceil"`` (cuBLAS / NVIDIA): ``e = ceil(log2(fp32(amax / max_elem)))``, no element saturates;
    both clamped to [-127, 127]; an all-zero block gets byte 0. Elements are ``x * 2**-e`` rounded to
    the element format (E2M1 as above; FP8 round-to-nearest-even after clamping to +-max, NaN stays
    NaN in FP8 and becomes code 0 in E2M1).
    Stochastic rounding: a value between two neighbouring grid points ``lo < v < hi`` rounds to
    ``hi`` with probability ``(v - lo) / (hi - lo)``, so the result is unbiased; the scale is always
    computed deterministically.

FP8 E4M3 activation quantizers (correctly rounded IEEE fp32 operations, no approximate reciprocals)
    per-tensor: ``q = e4m3sat(x * (1/s))`` with ``s`` given (static) or ``s = amax / 448`` (dynamic);
    per-token: ``s_row = amax_row / 448``, ``q = e4m3sat(x * (1/s_row))``;
    per-token-group (group 128): ``a = max(amax_group, 1e-10)``; fp32 scales ``s = a * fp32(1/448)``
    and ``q = e4m3sat(x * (448 / a))``; UE8M0 scales ``e = ceil_log2(a * fp32(1/448))`` and
    ``q = e4m3sat(x * 2**-e)``.
    Against the peers on the H200 (tests/test_cuda_peers.py), finite inputs: per-tensor dynamic is
    byte-identical to vLLM; per-token-group UE8M0 is byte-identical to sgl-kernel 0.4.5; per-token-group
    fp32 has sgl-kernel's scales exactly, and codes within one e4m3 step, because sgl-kernel is built
    with fast-math and multiplies by ``448 * rcp.approx(a)`` (about 0.07% of bf16 elements land within
    an ulp of a rounding midpoint). Per-token: sgl-kernel's scale is ``amax * fp32(1/448)`` and vLLM's
    is ``amax / 448``; the two peers disagree with each other, and we keep the correctly rounded
    division (vLLM's scales exactly; codes within one step of both, from their approximate
    reciprocals). Deliberate differences on degenerate inputs: a zero scale quantizes its row to zeros
    (sgl-kernel's small-batch per-token kernel: +448), amax treats +-Inf as the largest finite fp32,
    so an Inf saturates to +-448 like a huge finite value, and NaN elements stay NaN and never raise a
    scale (sgl-kernel clamps NaN to -448 in group and +448 in per-token quantization).

SiLU-and-mul (fused before the MoE down projection)
    ``silu(g) * u`` computed in fp32 with the fixed sequence of IEEE operations in :func:`silu_fp32`
    (no fused multiply-add), then rounded to the input dtype, then quantized. Fixing the exp
    approximation op by op is what lets torch, Triton and CUDA agree bit for bit.
"""

from __future__ import annotations

import math

import torch

# ----------------------------------------------------------------------------------------------
# Constants
# ----------------------------------------------------------------------------------------------

NVFP4_BLOCK_SIZE = 16
MX_BLOCK_SIZE = 32
FP8_GROUP_SIZE = 128

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
E2M1_EMAX = 2
E4M3_EMAX = 8
E5M2_EMAX = 15
E8M0_BIAS = 127
E8M0_NAN = 0xFF
#: The usual dynamic NVFP4 global scale numerator: ``gs = 448 * 6 / amax``.
NVFP4_GLOBAL_SCALE_NUMERATOR = E4M3_MAX * E2M1_MAX  # 2688
#: sgl-kernel's lower bound on a per-token-group amax.
FP8_GROUP_EPS = 1e-10

SWIZZLE_ROW_TILE = 128
SWIZZLE_COL_TILE = 4
SWIZZLE_TILE_BYTES = SWIZZLE_ROW_TILE * SWIZZLE_COL_TILE  # 512

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Decode table indexed by the 4-bit code (sign in bit 3).
E2M1_VALUES = E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES)
#: Upper bounds of the magnitude intervals, and whether each bound itself belongs to the lower
#: interval (True: ``a <= bound`` rounds down, the tie goes to the even code below).
E2M1_BOUNDARIES = ((0.25, True), (0.75, False), (1.25, True), (1.75, False),
                   (2.5, True), (3.5, False), (5.0, True))

FP8_FORMATS = {
    "e4m3": (torch.float8_e4m3fn, E4M3_MAX, E4M3_EMAX),
    "e5m2": (torch.float8_e5m2, E5M2_MAX, E5M2_EMAX),
}
MX_ELEMENT_FORMATS = ("e2m1", "e4m3", "e5m2")
MX_SCALE_RECIPES = ("floor", "rceil")
DEFAULT_MX_SCALE_RECIPE = "floor"
NVFP4_SCALE_FORMATS = ("e4m3", "ue8m0")

_FLT_MAX = torch.finfo(torch.float32).max
_ONE_SIXTH_F32 = torch.tensor(1.0 / 6.0, dtype=torch.float32).item()  # fp32(1/6), exactly
_ONE_OVER_448_F32 = torch.tensor(1.0 / 448.0, dtype=torch.float32).item()


def round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def ceil_div(x: int, d: int) -> int:
    return (x + d - 1) // d


# ----------------------------------------------------------------------------------------------
# E2M1
# ----------------------------------------------------------------------------------------------

def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to E2M1 codes (uint8 in [0, 15]), per the rules in the module docstring."""
    x = x.float()
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for bound, inclusive in E2M1_BOUNDARIES:
        code += (a > bound if inclusive else a >= bound).to(torch.uint8)
    nan = torch.isnan(x)
    sign = (torch.signbit(x) & ~nan).to(torch.uint8) << 3
    return torch.where(nan, torch.zeros_like(code), code | sign)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, low 4 bits) to fp32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[(codes & 0xF).long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` codes -> ``[..., K/2]`` bytes; element 2i in the low nibble of byte i."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim must be even, got {codes.shape[-1]}")
    c = codes.to(torch.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """``[..., K/2]`` bytes -> ``[..., K]`` codes (inverse of :func:`pack_fp4`)."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------------------------
# FP8 element and scale conversions
# ----------------------------------------------------------------------------------------------

def fp8_saturate(x: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """fp32 -> FP8 (``"e4m3"`` or ``"e5m2"``), round to nearest even, saturating at +-max; NaN -> +NaN.

    Same as CUDA ``__nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...)``.
    """
    dtype, fmax, _ = FP8_FORMATS[fmt]
    x = x.float()
    # NaN comes out as the canonical positive NaN (0x7F e4m3, 0x7F..0x7C e5m2 family), whatever its
    # sign: GPU arithmetic produces canonical NaNs, so the sign of a NaN carries no information
    x = torch.where(torch.isnan(x), torch.full_like(x, float("nan")).abs(), x)
    return x.clamp(-fmax, fmax).to(dtype)


def e4m3_saturate(x: torch.Tensor) -> torch.Tensor:
    return fp8_saturate(x, "e4m3")


def fp8_grid(fmt: str) -> torch.Tensor:
    """All finite non-negative values of an element format, ascending (fp32)."""
    if fmt == "e2m1":
        return torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    dtype, fmax, _ = FP8_FORMATS[fmt]
    vals = torch.arange(0, 128, dtype=torch.uint8).view(dtype).float()
    vals = vals[torch.isfinite(vals) & (vals <= fmax)]
    return torch.unique(vals)


def ceil_log2_exponent(x: torch.Tensor) -> torch.Tensor:
    """Smallest integer e with ``2**e >= x`` for finite x > 0 (exact, subnormals included), int32."""
    m, e = torch.frexp(x.float())  # x = m * 2**e, 0.5 <= m < 1
    return torch.where(m == 0.5, e - 1, e).to(torch.int32)


def floor_log2_exponent(x: torch.Tensor) -> torch.Tensor:
    """``floor(log2(x))`` for finite x > 0 (exact, subnormals included), int32."""
    _, e = torch.frexp(x.float())
    return (e - 1).to(torch.int32)


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """``2**e`` as exact fp32 for integer e in [-149, 127]."""
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=e.device), e.to(torch.int32))


def ue8m0_to_float(scale_bytes: torch.Tensor) -> torch.Tensor:
    """E8M0 biased exponent bytes -> fp32 scale values (0xFF -> NaN, byte 0 -> 2**-127)."""
    b = scale_bytes.to(torch.int32)
    val = exp2_int(b - E8M0_BIAS)
    return torch.where(b == E8M0_NAN, torch.full_like(val, float("nan")), val)


def nan_ignoring_amax(x: torch.Tensor, dim: int = -1, inf_as_max: bool = False) -> torch.Tensor:
    """``max |x|`` over ``dim`` in fp32, ignoring NaN (fmaxf semantics); optionally Inf -> FLT_MAX."""
    a = x.float().abs()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    if inf_as_max:
        a = a.clamp(max=_FLT_MAX)
    return a.amax(dim=dim)


def fp32_div(numerator: float, t: torch.Tensor) -> torch.Tensor:
    """IEEE fp32 ``numerator / t`` (one rounding; torch's ``scalar / tensor`` rounds twice)."""
    return torch.full_like(t, numerator, dtype=torch.float32) / t.float()


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Encode global scale ``2688 / amax`` (fp32 division); 1.0 where amax is 0 or not finite."""
    amax = amax.float()
    ok = (amax > 0) & torch.isfinite(amax)
    safe = torch.where(ok, amax, torch.ones_like(amax))
    # note: `python_scalar / tensor` in torch is reciprocal(tensor) * scalar (two roundings)
    return torch.where(ok, fp32_div(NVFP4_GLOBAL_SCALE_NUMERATOR, safe), torch.ones_like(amax))


def tensor_global_scale(x: torch.Tensor) -> torch.Tensor:
    """Dynamic NVFP4 encode global scale of a whole tensor (finite values only), shape ``[]``."""
    a = x.float().abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    return global_scale_from_amax(a.amax() if a.numel() else torch.zeros((), device=x.device))


# ----------------------------------------------------------------------------------------------
# NVFP4 block scales
# ----------------------------------------------------------------------------------------------

def nvfp4_block_scales(vmax: torch.Tensor, global_scale: torch.Tensor, scale_format: str = "e4m3"):
    """Steps 2-3 of the NVFP4 recipe: (stored scale tensor, fp32 scale value, fp32 out_scale).

    ``vmax`` is the fp32 per-block amax; ``global_scale`` broadcasts against it.
    The stored scale is ``float8_e4m3fn`` for ``"e4m3"`` and uint8 exponent bytes for ``"ue8m0"``.
    """
    gs = global_scale.float()
    raw = gs * (vmax.float() * _ONE_SIXTH_F32)
    if scale_format == "e4m3":
        stored = raw.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        s = stored.float()
    elif scale_format == "ue8m0":
        e = ceil_log2_exponent(torch.where(raw > 0, raw, torch.ones_like(raw)))
        e = torch.where(raw > 0, e, torch.full_like(e, -E8M0_BIAS))
        e = torch.where(torch.isinf(raw), torch.full_like(e, E8M0_BIAS), e).clamp(-E8M0_BIAS, E8M0_BIAS)
        stored = (e + E8M0_BIAS).to(torch.uint8)
        s = exp2_int(e)
    else:
        raise ValueError(f"scale_format must be one of {NVFP4_SCALE_FORMATS}, got {scale_format!r}")
    inv_gs = torch.where(gs == 0, torch.zeros_like(gs), 1.0 / gs)
    denom = s * inv_gs
    out_scale = torch.where(s == 0, torch.zeros_like(denom), 1.0 / denom)
    return stored, s, out_scale


def nvfp4_scale_to_float(stored: torch.Tensor) -> torch.Tensor:
    """Stored NVFP4 block scales (e4m3 or ue8m0 bytes) -> fp32 scale values."""
    if stored.dtype == torch.float8_e4m3fn:
        return stored.float()
    if stored.dtype == torch.uint8:
        return ue8m0_to_float(stored)
    raise TypeError(f"NVFP4 block scales must be float8_e4m3fn or uint8 (ue8m0), got {stored.dtype}")


# ----------------------------------------------------------------------------------------------
# Swizzled 128x4 scale layout
# ----------------------------------------------------------------------------------------------

def swizzled_scale_shape(m: int, k_blocks: int) -> tuple[int, int]:
    """Shape of the swizzled scale matrix for ``m`` rows and ``k_blocks = K/16`` scale columns."""
    return round_up(m, SWIZZLE_ROW_TILE), round_up(k_blocks, SWIZZLE_COL_TILE)


def swizzled_offset(m, k, k_blocks: int):
    """Byte offset of scale (m, k) in the swizzled layout (ints or integer tensors)."""
    k_tiles = ceil_div(k_blocks, SWIZZLE_COL_TILE)
    return (((m // 128) * k_tiles + k // 4) * SWIZZLE_TILE_BYTES + (m % 32) * 16
            + ((m // 32) % 4) * 4 + k % 4)


def swizzle_blockscale(scales: torch.Tensor) -> torch.Tensor:
    """Linear ``[..., M, K/16]`` scales -> swizzled ``[..., round_up(M,128), round_up(K/16,4)]``.

    Padding rows and columns are zero. Leading dims (e.g. experts) are swizzled independently.
    """
    *lead, m, kb = scales.shape
    mp, kp = swizzled_scale_shape(m, kb)
    raw = scales.view(torch.uint8) if scales.element_size() == 1 else scales
    padded = torch.zeros((*lead, mp, kp), dtype=raw.dtype, device=scales.device)
    padded[..., :m, :kb] = raw
    tiles = padded.reshape(*lead, mp // 128, 4, 32, kp // 4, 4)
    n = len(lead)
    perm = list(range(n)) + [n + 0, n + 3, n + 2, n + 1, n + 4]
    out = tiles.permute(*perm).contiguous().reshape(*lead, mp, kp)
    return out.view(scales.dtype) if scales.element_size() == 1 else out


def unswizzle_blockscale(swizzled: torch.Tensor, m: int, k_blocks: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_blockscale`, cropped to ``[..., m, k_blocks]``."""
    *lead, mp, kp = swizzled.shape
    if (mp, kp) != swizzled_scale_shape(m, k_blocks) and (mp < m or kp < k_blocks or mp % 128 or kp % 4):
        raise ValueError(f"swizzled scales of shape {(mp, kp)} cannot hold m={m}, k_blocks={k_blocks}")
    raw = swizzled.view(torch.uint8) if swizzled.element_size() == 1 else swizzled
    tiles = raw.reshape(*lead, mp // 128, kp // 4, 32, 4, 4)
    n = len(lead)
    perm = list(range(n)) + [n + 0, n + 3, n + 2, n + 1, n + 4]
    out = tiles.permute(*perm).reshape(*lead, mp, kp)[..., :m, :k_blocks].contiguous()
    return out.view(swizzled.dtype) if swizzled.element_size() == 1 else out


# ----------------------------------------------------------------------------------------------
# MoE layouts
# ----------------------------------------------------------------------------------------------

def blockscale_offsets_from_expert_offsets(expert_offsets: torch.Tensor) -> torch.Tensor:
    """``expert_offsets[E+1]`` -> ``blockscale_offsets[E+1]`` (each expert's rows rounded up to 128).

    Pure device arithmetic, no host synchronization.
    """
    counts = (expert_offsets[1:] - expert_offsets[:-1]).to(torch.int64)
    padded = (counts + (SWIZZLE_ROW_TILE - 1)) // SWIZZLE_ROW_TILE * SWIZZLE_ROW_TILE
    out = torch.zeros(expert_offsets.shape, dtype=torch.int64, device=expert_offsets.device)
    out[1:] = torch.cumsum(padded, 0)
    return out.to(expert_offsets.dtype)


def max_blockscale_rows(num_rows: int, num_experts: int) -> int:
    """Upper bound on ``blockscale_offsets[E]`` for ``num_rows`` rows over ``num_experts`` experts.

    Allocating this many scale rows needs no knowledge of the routing (no host sync). Each expert
    adds at most 127 padding rows, and only an expert that has rows adds any (``round_up(0, 128)``
    is 0): at most ``min(num_experts, num_rows)`` of them. For a decode step (8 rows over 256
    experts) that is 1024 rows, not the 32640 of ``num_rows + 127 * num_experts``, and the kernel
    zero-fills 32x fewer bytes.
    """
    if num_rows == 0:
        return 0
    return round_up(num_rows + min(num_experts, num_rows) * (SWIZZLE_ROW_TILE - 1), SWIZZLE_ROW_TILE)


# ----------------------------------------------------------------------------------------------
# SiLU in fp32, op by op
# ----------------------------------------------------------------------------------------------

# exp(y) for y in [-87.3, 88.5] via Cody-Waite reduction y = n*ln2 + r, |r| <= ln2/2, and a
# degree-6 Taylor polynomial in Horner form. Every step is one IEEE fp32 operation; implementations
# in CUDA must use __fmul_rn / __fadd_rn / __fsub_rn (no FMA contraction) and rintf (ties to even),
# Triton kernels must disable fp fusion. Accuracy: within 2 ulp of exp, which is far below the
# bf16/fp16 rounding that follows.
SILU_EXP_LO = -87.3
SILU_EXP_HI = 88.5
def _f32(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).item()


LOG2E_F32 = _f32(1.0 / math.log(2.0))
LN2_HI_F32 = 0.693145751953125                 # 0x3F317200, 15 significant bits: n * LN2_HI exact
LN2_LO_F32 = _f32(math.log(2.0) - LN2_HI_F32)
EXP_POLY_F32 = tuple(_f32(1.0 / math.factorial(i)) for i in range(7))  # c0 .. c6


def exp_fp32(y: torch.Tensor) -> torch.Tensor:
    """The project's fixed fp32 exp (see above); +inf above 88.5, ~0 below -87.3. fp32 in/out."""
    y = y.float()
    yc = y.clamp(SILU_EXP_LO, SILU_EXP_HI)
    n = torch.round(yc * LOG2E_F32)  # torch.round: ties to even
    r = (yc - n * LN2_HI_F32) - n * LN2_LO_F32
    p = torch.full_like(r, EXP_POLY_F32[6])
    for c in EXP_POLY_F32[5::-1]:
        p = p * r + c
    # p * 2**n as two power-of-two multiplies (the first is exact), since 2**128 overflows fp32.
    ni = n.to(torch.int32)
    half = torch.div(ni, 2, rounding_mode="floor")
    result = (p * exp2_int(ni - half)) * exp2_int(half)
    result = torch.where(y > SILU_EXP_HI, torch.full_like(result, float("inf")), result)
    return torch.where(torch.isnan(y), y, result)


def silu_fp32(g: torch.Tensor) -> torch.Tensor:
    """``g / (1 + exp_fp32(-g))`` in IEEE fp32."""
    g = g.float()
    return g / (1.0 + exp_fp32(-g))


def silu_and_mul_fp32(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` in fp32, rounded to ``x.dtype`` (the sgl-kernel order)."""
    d = x.shape[-1] // 2
    return (silu_fp32(x[..., :d]) * x[..., d:].float()).to(x.dtype)


__all__ = [name for name in dir() if not name.startswith("_") and name not in ("annotations", "math", "torch")]
