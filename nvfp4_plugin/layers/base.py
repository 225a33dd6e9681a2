"""The backend interface of the engine-neutral layers (one file per backend in ``backends/``).

A layer never knows which kernel runs: it asks :func:`select_backend` once per layer shape, which
walks the registered backends in priority order and keeps the first that is supported on the device
and can implement the shape, recording why each other one was skipped (logged once per process).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

logger = logging.getLogger("nvfp4_plugin")

ENV_LINEAR_BACKEND = "NVFP4_PLUGIN_LINEAR_BACKEND"
ENV_MOE_BACKEND = "NVFP4_PLUGIN_MOE_BACKEND"
#: ``w4a16`` (activations stay bf16/fp16: the Hopper default) or ``w4a4`` (activations quantized
#: to NVFP4 with the checkpoint's input scale, as Blackwell computes). Checkpoints without input
#: scales always run ``w4a16``.
ENV_ACT_MODE = "NVFP4_PLUGIN_ACT_MODE"
MODES = ("w4a16", "w4a4")


@dataclass(frozen=True)
class LinearSpec:
    n: int
    k: int
    act_dtype: torch.dtype
    mode: str
    device: torch.device


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    hidden: int          # H (K of w13, N of w2)
    intermediate: int    # I (w13 has 2I rows)
    act_dtype: torch.dtype
    mode: str
    device: torch.device


class Backend:
    """One implementation of a layer. Subclasses set ``name`` and override the hooks."""

    name: ClassVar[str] = "?"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        """None if this backend can run on ``device`` at all, else why not."""
        return None

    @classmethod
    def cannot_implement(cls, spec) -> str | None:
        """None if this backend handles ``spec`` (shape, dtype, mode), else why not."""
        return None

    def prepare(self, spec, *args, **kwargs) -> tuple[dict[str, torch.Tensor], Any]:
        """Load time, once: repack weights for ``spec``; returns (tensors by name, static metadata)."""
        raise NotImplementedError

    def apply(self, tensors: dict[str, torch.Tensor], meta: Any, *args, **kwargs) -> torch.Tensor:
        """Forward: no host syncs, no allocation of constants, CUDA-graph safe."""
        raise NotImplementedError

    def warmup_sizes(self, tensors: dict[str, torch.Tensor], meta: Any, max_tokens: int, **kw) -> list[int]:
        """Token counts whose forwards compile everything a forward of up to ``max_tokens`` tokens can
        launch (start-up, once per layer shape); none for backends that compile nothing."""
        return []


_LOGGED: set = set()


def select_backend(kind: str, registry: list[type[Backend]], spec, env_var: str) -> Backend:
    """First backend of ``registry`` (priority order) that runs ``spec``; env var forces one."""
    forced = os.environ.get(env_var)
    names = [b.name for b in registry]
    if forced and forced not in names:
        raise ValueError(f"{env_var}={forced!r}: unknown {kind} backend; choose from {names}")
    skipped = []
    for cls in registry:
        reason = cls.unsupported_reason(spec.device) or cls.cannot_implement(spec)
        if reason is None and forced and cls.name != forced:
            reason = f"{env_var}={forced}"
        if reason is None:
            key = (kind, cls.name, tuple(skipped))
            if key not in _LOGGED:
                _LOGGED.add(key)
                logger.info("nvfp4_plugin: %s backend %r%s", kind, cls.name,
                            "".join(f"; skipped {n}: {r}" for n, r in skipped))
            return cls()
        skipped.append((cls.name, reason))
        if forced and cls.name == forced:
            raise RuntimeError(f"{env_var}={forced}: backend cannot run this {kind} layer: {reason}")
    raise RuntimeError(f"no {kind} backend can run {spec}: " + "; ".join(f"{n}: {r}" for n, r in skipped))


def resolve_mode(has_input_scale: bool) -> str:
    mode = os.environ.get(ENV_ACT_MODE, "w4a16")
    if mode not in MODES:
        raise ValueError(f"{ENV_ACT_MODE}={mode!r}: expected one of {MODES}")
    if mode == "w4a4" and not has_input_scale:
        logger.warning("nvfp4_plugin: %s=w4a4 but the checkpoint has no input scales; running w4a16", ENV_ACT_MODE)
        return "w4a16"
    return mode
