"""Argument checks shared by the reference and the public ops.

Every error names the argument, what was expected and what was given. Checks only look at
metadata (shape, dtype, device); none of them reads tensor values, so none synchronizes the host.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

FLOAT_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HALF_ACT_DTYPES = (torch.bfloat16, torch.float16)


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t, *, dtypes=None, ndim=None, min_ndim=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in tuple(dtypes):
        raise TypeError(f"{name}: expected dtype {_names(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got {t.dim()} (shape {tuple(t.shape)})")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dims, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device} (same as the input), got {t.device}")


def check_shape(name: str, t: torch.Tensor, expected: tuple) -> None:
    """``expected`` may contain None for "any size" in that dim."""
    ok = t.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, t.shape))
    if not ok:
        shown = "(" + ", ".join("*" if e is None else str(e) for e in expected) + ("," if len(expected) == 1 else "") + ")"
        raise ValueError(f"{name}: expected shape {shown}, got {tuple(t.shape)}")


def check_multiple(name: str, value: int, multiple: int, what: str = "size") -> None:
    if value % multiple:
        raise ValueError(f"{name}: {what} must be a multiple of {multiple}, got {value}")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {tuple(choices)}, got {value!r}")


def check_global_scale(name: str, gs, device, count: int | None = None) -> torch.Tensor:
    """A float32 global scale: a scalar tensor/[1] (count None) or a [count] vector (per expert)."""
    if isinstance(gs, (int, float)):
        gs = torch.tensor([float(gs)], dtype=torch.float32, device=device)
    check_tensor(name, gs, dtypes=(torch.float32,), device=device)
    if count is None:
        if gs.numel() != 1:
            raise ValueError(f"{name}: expected a single fp32 value (shape [] or [1]), got shape {tuple(gs.shape)}")
    elif tuple(gs.shape) != (count,):
        raise ValueError(f"{name}: expected shape ({count},) (one per expert), got {tuple(gs.shape)}")
    return gs
