"""Registers the compiled kernels (``nvfp4_plugin._C``) as the ``"cuda"`` backend of the public ops.

Imported by :mod:`nvfp4_plugin.ops`. Imports neither the extension nor the wrappers: whether the
extension runs on a device is decided when an op is first used there
(:func:`nvfp4_plugin._ext.extension_runs_on` gives the reason it cannot, e.g. "compiled extension
not built or not loadable" on a CPU machine), and :mod:`nvfp4_plugin._cuda_ops` is loaded only then.
The compiled backend goes first: ahead of Triton, which goes ahead of the reference.
"""

from __future__ import annotations

import importlib

import torch

from . import _ext
from .ops._registry import OpBackend, register

#: Ops with a compiled kernel (nvfp4_plugin._cuda_ops implements each).
CUDA_OPS = (
    "scaled_fp4_quant",
    "scaled_fp4_experts_quant",
    "silu_and_mul_scaled_fp4_experts_quant",
    "silu_and_mul",
    "scaled_fp8_quant",
    "per_token_quant_fp8",
    "per_token_group_quant_fp8",
)


def unavailable_reason(device) -> str | None:
    return _ext.extension_runs_on(torch.device(device))


def _loader(op: str):
    def load():
        return getattr(importlib.import_module("nvfp4_plugin._cuda_ops"), op)

    return load


for _op in CUDA_OPS:
    register(_op, OpBackend("cuda", unavailable_reason, _loader(_op)), before="triton")
