"""Triton kernels: MXFP4 / MXFP8 / NVFP4 quantization (fake and packed) and DeepSeek-V4 MegaMoE staging.

Every kernel reproduces :mod:`nvfp4_plugin.reference` byte for byte (deterministic rounding); the
numerics are those of :mod:`nvfp4_plugin.numerics`, written out in Triton in :mod:`._jit_numerics`.

Entry points (CUDA tensors; CPU tensors too when ``TRITON_INTERPRET=1``, for tests):

  ``mxfp4_forward`` / ``mxfp8_forward`` / ``nvfp4_forward``   fake quantization (quantize + dequantize)
  ``fake_quant_mxfp4`` / ``fake_quant_mxfp8`` / ``fake_quant_nvfp4``   the same on CUDA, reference elsewhere
  ``mxfp4_quantize`` / ``mxfp8_quantize``   packed E2M1 or FP8 elements + E8M0 scale bytes
  ``scaled_fp4_quant``   NVFP4 (the fallback when the compiled extension is missing)
  ``stage_deepseek_v4_mega_moe_inputs``   bf16 tokens -> E2M1 + UE4M3 scales packed in int32, top-k copied

Importing this package does not import Triton; the names above load their module on first use, so
``nvfp4_plugin.triton._register`` imports cleanly where Triton is not installed.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "mxfp4_forward": "mx",
    "mxfp8_forward": "mx",
    "mxfp4_quantize": "mx",
    "mxfp8_quantize": "mx",
    "fake_quant_mxfp4": "mx",
    "fake_quant_mxfp8": "mx",
    "nvfp4_forward": "nvfp4",
    "fake_quant_nvfp4": "nvfp4",
    "scaled_fp4_quant": "nvfp4",
    "stage_deepseek_v4_mega_moe_inputs": "staging",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'nvfp4_plugin.triton' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
