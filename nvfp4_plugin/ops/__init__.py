"""Public ops: validate, allocate, dispatch to the fastest backend that runs on the input's device.

Each function has the signature of its twin in :mod:`nvfp4_plugin.reference` (the ground truth).
Which backend runs is decided once per (op, device) by :mod:`nvfp4_plugin.ops._registry` and logged;
``nvfp4-plugin info`` shows the choice and the reasons other backends were skipped.
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch

from .. import reference
from ._registry import OpBackend, implementation, register

#: Ops with a public entry point, each first given its always-available reference backend.
PUBLIC_OPS = (
    "scaled_fp4_quant",
    "scaled_fp4_experts_quant",
    "silu_and_mul_scaled_fp4_experts_quant",
    "silu_and_mul",
    "dequantize_fp4",
    "fake_quant_nvfp4",
    "fake_quant_mxfp4",
    "fake_quant_mxfp8",
    "mxfp4_quantize",
    "mxfp8_quantize",
    "scaled_fp8_quant",
    "per_token_quant_fp8",
    "per_token_group_quant_fp8",
    "stage_deepseek_v4_mega_moe_inputs",
)

for _op in PUBLIC_OPS:
    register(_op, OpBackend("reference", lambda device: None, functools.partial(getattr, reference, _op)))


#: Modules that register faster backends (Triton, compiled CUDA) ahead of the reference. Each is
#: optional: a missing module is skipped, and a backend whose requirements are not met on a device
#: says why through its ``unavailable_reason``.
BACKEND_MODULES = ("nvfp4_plugin.triton._register", "nvfp4_plugin._cuda_register")

for _mod in BACKEND_MODULES:
    try:
        importlib.import_module(_mod)
    except ModuleNotFoundError as _exc:
        if _exc.name != _mod and not _mod.startswith(f"{_exc.name}."):
            logging.getLogger("nvfp4_plugin").warning("nvfp4_plugin: backends in %s not loaded: %s", _mod, _exc)


def _first_tensor(args, kwargs) -> torch.Tensor:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    raise TypeError("expected at least one tensor argument")


def _make(op: str):
    ref = getattr(reference, op)

    @functools.wraps(ref)
    def fn(*args, **kwargs):
        return implementation(op, _first_tensor(args, kwargs).device)(*args, **kwargs)

    return fn


for _op in PUBLIC_OPS:
    globals()[_op] = _make(_op)

__all__ = list(PUBLIC_OPS)
