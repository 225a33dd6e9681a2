"""The Triton kernels as the ``"triton"`` backend of the public ops.

:mod:`nvfp4_plugin.ops` reads this module (it imports nothing of ``ops``: no import cycle) and
registers :data:`TRITON_OPS` after the compiled backend and before the reference. Imports neither
Triton nor the kernel modules: availability is checked when an op is first used on a device, and
the kernel module is loaded only then.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable

import torch

from .._checks import unchecked

NAME = "triton"

#: The table of this backend: public op -> (module of nvfp4_plugin.triton, function) implementing it
#: with the reference's signature (nvfp4_forward etc. keep the seed's names).
TRITON_OPS = {
    "fake_quant_nvfp4": ("nvfp4", "nvfp4_forward"),
    "scaled_fp4_quant": ("nvfp4", "scaled_fp4_quant"),
    "fake_quant_mxfp4": ("mx", "mxfp4_forward"),
    "fake_quant_mxfp8": ("mx", "mxfp8_forward"),
    "mxfp4_quantize": ("mx", "mxfp4_quantize"),
    "mxfp8_quantize": ("mx", "mxfp8_quantize"),
    "stage_deepseek_v4_mega_moe_inputs": ("staging", "stage_deepseek_v4_mega_moe_inputs"),
}
OPS = tuple(TRITON_OPS)


@functools.lru_cache(maxsize=1)
def _triton_import_error() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    try:
        importlib.import_module("triton.language")
    except Exception as exc:  # a broken install must not break the package
        return f"triton does not import ({type(exc).__name__}: {exc})"
    return None


def unavailable_reason(device: torch.device) -> str | None:
    device = torch.device(device)
    if device.type != "cuda":
        return f"device is {device.type}, not cuda"
    return _triton_import_error()


def load(op: str) -> Callable:
    """The implementation of ``op`` (imports its kernel module). The kernel functions still check
    their arguments themselves (they are called directly too); a function that comes to wear
    :func:`nvfp4_plugin._checks.validated_by` is used without its checks here."""
    module, name = TRITON_OPS[op]
    return unchecked(getattr(importlib.import_module(f"nvfp4_plugin.triton.{module}"), name))
