"""Tensor names and scale conventions of the two NVFP4 checkpoint formats, in one place.

Per quantized linear ``M`` (N output rows, K input columns), as read from the exporters and loaders
(ModelOpt ``modelopt/torch/quantization/qtensor/nvfp4_tensor.py`` and ``export/unified_export_hf.py``;
compressed-tensors ``compressors/quantized_compressors/fp4_quantized.py`` and
``quantization/lifecycle/initialize.py``; vLLM ``quantization/modelopt.py`` and
``compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4.py``; SGLang ``modelopt_quant.py``):

==================  ===============================  ==============================================
role                ModelOpt                         compressed-tensors (``nvfp4-pack-quantized``)
==================  ===============================  ==============================================
packed codes        ``M.weight`` U8 [N, K/2]         ``M.weight_packed`` U8 [N, K/2]
block scales        ``M.weight_scale`` F8_E4M3       ``M.weight_scale`` F8_E4M3 [N, K/16]
                    [N, K/16]
weight global       ``M.weight_scale_2`` F32 ``[]``  ``M.weight_global_scale`` F32 ``[1]``
scale               = amax/2688 (DECODE multiplier)  = 2688/amax (ENCODE multiplier)
activation scale    ``M.input_scale`` F32 ``[]``     ``M.input_global_scale`` F32 ``[1]``
                    = amax/2688 (decode)             = 2688/amax (encode)
==================  ===============================  ==============================================

Both pack element 2i in the low nibble of byte i and store the block scales in the linear
(unswizzled) row-major layout, as real ``float8_e4m3fn`` (never a uint8 view). Exporters differ on
all-zero blocks (ModelOpt writes scale 1.0, compressed-tensors 0.125, our recipe 0); the codes of
such blocks are zero either way, so any non-negative scale decodes to zeros.

Canonical form (:class:`~nvfp4_plugin.weights.Nvfp4Weight`): *encode* global scales, so a ModelOpt
``weight_scale_2`` loads as ``fp32(1 / weight_scale_2)``. fp32 ``1/(1/g)`` is not ``g`` for every
``g``, so our quantizer picks every global scale as a fixed point of that round trip
(:func:`global_scale_from_amax_exact`): then ModelOpt and compressed-tensors files of the same
weights load to bit-identical canonical tensors. A ModelOpt checkpoint made elsewhere may load with
a global scale 1 ulp away from ``2688/amax``; that is inherent to storing the reciprocal, harmless
(far below the FP4/E4M3 rounding), and not an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import numerics as nx

MODELOPT = "modelopt"
COMPRESSED_TENSORS = "compressed-tensors"
FORMATS = (MODELOPT, COMPRESSED_TENSORS)

#: quant_algo values: W4A4 (weights and activations NVFP4) and weight-only.
ALGO_W4A4 = "NVFP4"
ALGO_W4A16 = "W4A16_NVFP4"
QUANT_ALGOS = (ALGO_W4A4, ALGO_W4A16)

CT_FORMAT = "nvfp4-pack-quantized"

ROLE_WEIGHT = "weight"
ROLE_BLOCK_SCALE = "block_scale"
ROLE_GLOBAL_SCALE = "global_scale"
ROLE_INPUT_SCALE = "input_scale"
ROLES = (ROLE_WEIGHT, ROLE_BLOCK_SCALE, ROLE_GLOBAL_SCALE, ROLE_INPUT_SCALE)


@dataclass(frozen=True)
class FormatSpec:
    """Tensor-name suffixes and conventions of one format."""

    name: str
    suffixes: dict  # role -> suffix
    global_scale_is_encode: bool
    input_scale_is_encode: bool
    scalar_shape: tuple  # the shape the exporter writes for global / input scales

    def suffix(self, role: str) -> str:
        return self.suffixes[role]

    def role_of_suffix(self, suffix: str) -> str | None:
        for role, s in self.suffixes.items():
            if s == suffix:
                return role
        return None


SPECS = {
    MODELOPT: FormatSpec(MODELOPT, {ROLE_WEIGHT: "weight", ROLE_BLOCK_SCALE: "weight_scale",
                                    ROLE_GLOBAL_SCALE: "weight_scale_2", ROLE_INPUT_SCALE: "input_scale"},
                         global_scale_is_encode=False, input_scale_is_encode=False, scalar_shape=()),
    COMPRESSED_TENSORS: FormatSpec(COMPRESSED_TENSORS,
                                   {ROLE_WEIGHT: "weight_packed", ROLE_BLOCK_SCALE: "weight_scale",
                                    ROLE_GLOBAL_SCALE: "weight_global_scale",
                                    ROLE_INPUT_SCALE: "input_global_scale"},
                                   global_scale_is_encode=True, input_scale_is_encode=True, scalar_shape=(1,)),
}

#: Suffixes that belong to quantization schemes we do not support (AWQ pre-scales, zero points, ...).
UNSUPPORTED_SUFFIXES = ("pre_quant_scale", "weight_zero_point", "weight_g_idx", "input_zero_point",
                        "weight_shape")
#: Suffixes of the *other* format, to say "this looks like format X" instead of "unknown tensor".
ALL_SCALE_SUFFIXES = {s for spec in SPECS.values() for r, s in spec.suffixes.items() if r != ROLE_WEIGHT}


def spec(fmt: str) -> FormatSpec:
    try:
        return SPECS[fmt]
    except KeyError:
        raise ValueError(f"format: expected one of {FORMATS}, got {fmt!r}") from None


# ----------------------------------------------------------------------------------------------
# Global scales
# ----------------------------------------------------------------------------------------------

#: Our quantizer keeps encode global scales in [2**-100, 2**100]: both the scale and its reciprocal
#: are normal fp32 numbers, so every conversion between the two conventions is finite and exact.
GLOBAL_SCALE_MIN = 2.0 ** -100
GLOBAL_SCALE_MAX = 2.0 ** 100
_MAX_ROUND_TRIPS = 8


def reciprocal_fp32(x: torch.Tensor) -> torch.Tensor:
    """IEEE fp32 ``1/x`` (on the CPU, so the rounding never depends on a device's division).

    Written as a tensor-by-tensor division on purpose: torch evaluates ``scalar / tensor`` as
    ``scalar * reciprocal(tensor)``, which rounds twice.
    """
    x = x.detach().to("cpu", torch.float32)
    return torch.ones_like(x) / x


def reciprocal_fixed_point(g: torch.Tensor) -> torch.Tensor:
    """The nearest value ``g*`` reachable from ``g`` with ``fp32(1/fp32(1/g*)) == g*``.

    One round trip already lands on a fixed point for every fp32 we have tried (a rounded reciprocal
    survives the round trip); the loop just makes that a checked property rather than an assumption.
    """
    g = g.detach().to("cpu", torch.float32)
    for _ in range(_MAX_ROUND_TRIPS):
        nxt = reciprocal_fp32(reciprocal_fp32(g))
        if torch.equal(nxt, g):
            return g
        g = nxt
    raise ArithmeticError(f"fp32 reciprocal round trip did not settle for {g.tolist()}")


def global_scale_from_amax_exact(amax) -> torch.Tensor:
    """Encode global scale for ``amax``: ``2688/amax`` (1.0 for amax 0 or non-finite), clamped to
    [GLOBAL_SCALE_MIN, GLOBAL_SCALE_MAX], moved to the reciprocal fixed point. fp32, on the CPU.

    Using this value for both the quantization and the file makes ModelOpt (stores ``1/g``) and
    compressed-tensors (stores ``g``) checkpoints of the same weights load identically.
    """
    a = torch.as_tensor(amax, dtype=torch.float32).detach().to("cpu")
    ok = (a > 0) & torch.isfinite(a)
    safe = torch.where(ok, a, torch.ones_like(a))
    # One IEEE division (``numerics.global_scale_from_amax`` writes ``2688 / amax`` with a Python
    # scalar numerator, which torch computes as ``2688 * (1/amax)``: two roundings).
    g = torch.where(ok, torch.full_like(safe, nx.NVFP4_GLOBAL_SCALE_NUMERATOR) / safe, torch.ones_like(a))
    return reciprocal_fixed_point(g.clamp(GLOBAL_SCALE_MIN, GLOBAL_SCALE_MAX))


def checkpoint_global_from_encode(gs: torch.Tensor, fmt: str) -> torch.Tensor:
    """Encode global scale(s) -> the value(s) this format stores (fp32, CPU; a single value gets the
    format's scalar shape: ModelOpt ``[]``, compressed-tensors ``[1]``)."""
    s = spec(fmt)
    g = gs.detach().to("cpu", torch.float32)
    out = g if s.global_scale_is_encode else reciprocal_fp32(g)
    return out.reshape(s.scalar_shape) if out.numel() == 1 else out


def checkpoint_input_from_encode(gs: torch.Tensor, fmt: str) -> torch.Tensor:
    s = spec(fmt)
    g = gs.detach().to("cpu", torch.float32)
    out = g if s.input_scale_is_encode else reciprocal_fp32(g)
    return out.reshape(s.scalar_shape) if out.numel() == 1 else out


def encode_from_checkpoint_global(value: torch.Tensor, fmt: str) -> torch.Tensor:
    """Stored weight global scale (any shape) -> encode global scale (fp32, same shape, CPU)."""
    v = value.detach().to("cpu", torch.float32)
    return v if spec(fmt).global_scale_is_encode else reciprocal_fp32(v)


def encode_from_checkpoint_input(value: torch.Tensor, fmt: str) -> torch.Tensor:
    v = value.detach().to("cpu", torch.float32)
    return v if spec(fmt).input_scale_is_encode else reciprocal_fp32(v)
