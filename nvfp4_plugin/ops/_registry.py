"""Backend registry for the public ops: each op lists its implementations in priority order.

A backend says whether it can run on a given device and, if not, why; :func:`select` walks the list
and returns the first that can, with the reasons the others were skipped (``nvfp4-plugin info``
prints them). The pure-torch reference is always last and always available, so an op never fails
for lack of a kernel; it is just slow.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import envs

logger = logging.getLogger("nvfp4_plugin")

#: Force one backend for every op (e.g. ``reference``), for debugging and A/B comparisons.
ENV_FORCE_BACKEND = envs.OP_BACKEND


@dataclass(frozen=True)
class OpBackend:
    name: str
    #: device -> None if usable there, else the reason it is not.
    unavailable_reason: Callable[[torch.device], str | None]
    #: the implementation, same signature as the reference; imported lazily.
    load: Callable[[], Callable]


_OPS: dict[str, list[OpBackend]] = {}
_CHOSEN: dict[tuple[str, str], Callable] = {}


def register(op: str, backend: OpBackend, *, before: str | None = None) -> None:
    """Add ``backend`` to ``op`` (ahead of ``before`` if given, else just before the reference)."""
    lst = _OPS.setdefault(op, [])
    names = [b.name for b in lst]
    if backend.name in names:
        return
    anchor = before if before in names else ("reference" if "reference" in names else None)
    lst.insert(names.index(anchor) if anchor else len(lst), backend)
    _CHOSEN.clear()


def ops() -> list[str]:
    return sorted(_OPS)


def select(op: str, device: torch.device) -> tuple[OpBackend, list[tuple[str, str]]]:
    """First usable backend for ``op`` on ``device`` and the (name, reason) of each one skipped."""
    forced = envs.forced_op_backend()
    skipped = []
    for b in _OPS[op]:
        reason = b.unavailable_reason(device)
        if reason is None and forced and b.name != forced:
            reason = f"{ENV_FORCE_BACKEND}={forced}"
        if reason is None:
            return b, skipped
        skipped.append((b.name, reason))
    raise RuntimeError(f"{op}: no backend can run on {device}: " + "; ".join(f"{n}: {r}" for n, r in skipped))


def implementation(op: str, device: torch.device) -> Callable:
    key = (op, str(device))
    fn = _CHOSEN.get(key)
    if fn is None:
        backend, skipped = select(op, device)
        fn = backend.load()
        _CHOSEN[key] = fn
        logger.info("nvfp4_plugin: %s on %s uses backend %r%s", op, device, backend.name,
                    "".join(f"; skipped {n} ({r})" for n, r in skipped))
    return fn
