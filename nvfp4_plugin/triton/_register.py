"""Registers the Triton kernels as the ``"triton"`` backend of the public ops.

Imported by :mod:`nvfp4_plugin.ops`. Imports neither Triton nor the kernel modules: availability is
checked when an op is first used on a device, and the kernel module is loaded only then.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

from .. import reference
from ..ops._registry import OpBackend, register

#: op name -> module of nvfp4_plugin.triton that implements it (same signature as the reference).
TRITON_OPS = {
    "fake_quant_nvfp4": "nvfp4",
    "scaled_fp4_quant": "nvfp4",
    "fake_quant_mxfp4": "mx",
    "fake_quant_mxfp8": "mx",
    "mxfp4_quantize": "mx",
    "mxfp8_quantize": "mx",
    "stage_deepseek_v4_mega_moe_inputs": "staging",
}

#: Reference backends for ops that nvfp4_plugin.ops does not list (yet); registering an existing
#: name again is a no-op, so this is harmless once ops.PUBLIC_OPS includes them.
EXTRA_REFERENCE_OPS = ("stage_deepseek_v4_mega_moe_inputs",)

#: nvfp4_forward etc. are named after the seed; the public ops use the reference's names.
_IMPL_NAMES = {"fake_quant_nvfp4": "nvfp4_forward", "fake_quant_mxfp4": "mxfp4_forward",
               "fake_quant_mxfp8": "mxfp8_forward"}


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


def _loader(op: str, module: str):
    def load():
        mod = importlib.import_module(f"nvfp4_plugin.triton.{module}")
        return getattr(mod, _IMPL_NAMES.get(op, op))

    return load


for _op in EXTRA_REFERENCE_OPS:
    register(_op, OpBackend("reference", lambda device: None, functools.partial(getattr, reference, _op)))

for _op, _mod in TRITON_OPS.items():
    register(_op, OpBackend("triton", unavailable_reason, _loader(_op, _mod)))
