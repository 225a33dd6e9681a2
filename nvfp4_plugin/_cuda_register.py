"""The compiled kernels (``nvfp4_plugin._C``) as the ``"cuda"`` backend of the public ops.

:mod:`nvfp4_plugin.ops` reads this module (it imports nothing of ``ops``: no import cycle) and
registers :data:`OPS` ahead of the Triton backend. The ops come from the table of
:mod:`nvfp4_plugin._cuda_ops`, whose import is cheap: the extension itself is loaded only when an op
first runs on a device where :func:`unavailable_reason` is None (it says why not otherwise, e.g.
"compiled extension not built or not loadable" on a CPU machine).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import _cuda_ops, _ext

NAME = "cuda"
#: Ops with a compiled kernel.
OPS = tuple(_cuda_ops.CUDA_OPS)


def unavailable_reason(device) -> str | None:
    return _ext.extension_runs_on(torch.device(device))


def load(op: str) -> Callable:
    """The implementation of ``op``, for arguments the public op has already checked."""
    return getattr(_cuda_ops, op).unchecked
