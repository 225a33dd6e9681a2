"""The backend interface of the engine-neutral layers (one file per backend in ``backends/``).

A layer never knows which kernel runs: it asks :func:`select_backend` once per layer shape, which
walks the registered backends in priority order and keeps the first that is supported on the device
and can implement the shape, recording why each other one was skipped (logged once per process).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .. import envs

logger = logging.getLogger("nvfp4_plugin")

ENV_LINEAR_BACKEND = envs.LINEAR_BACKEND
ENV_MOE_BACKEND = envs.MOE_BACKEND
#: ``w4a16`` (activations stay bf16/fp16) or ``w4a4`` (activations quantized to NVFP4 with the
#: checkpoint's input scale). Default: ``w4a4`` on Blackwell (sm_100+: its FP4 tensor cores multiply
#: NVFP4 activations) and ``w4a16`` elsewhere (Hopper). Checkpoints without input scales always run
#: ``w4a16``.
ENV_ACT_MODE = envs.ACT_MODE
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


#: A CUDA compute capability (major, minor); None for a device that is not a CUDA GPU.
Capability = tuple[int, int] | None


def device_capability(device: torch.device) -> Capability:
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))


def sm(capability: Capability) -> str:
    return "no CUDA GPU" if capability is None else f"sm_{capability[0]}{capability[1]}"


class Backend:
    """One implementation of a layer. Subclasses set ``name`` and override the hooks.

    ``archs``: the exact compute capabilities whose kernels this backend ships and has compiled (None:
    any device, CPU included). A GPU of another architecture never selects it, even a newer one: a
    kernel written for one architecture's instructions need not compile for the next.
    ``family``: the kernel family that runs, for logs and ``nvfp4-plugin info`` (see :meth:`families`).
    """

    name: ClassVar[str] = "?"
    archs: ClassVar[tuple[tuple[int, int], ...] | None] = None
    family: ClassVar[str] = "?"

    @classmethod
    def unsupported_reason(cls, device: torch.device, capability: Capability = None) -> str | None:
        """None if this backend can run on ``device`` (of compute ``capability``) at all, else why not."""
        if cls.archs is None:
            return None
        want = ", ".join(sm(a) for a in cls.archs)
        if device.type != "cuda":
            return f"runs on CUDA GPUs ({want}), got a {device.type} device"
        if capability not in cls.archs:
            return f"runs on {want} only, the GPU is {sm(capability)}"
        return None

    @classmethod
    def families(cls, spec, max_tokens: int, **kw) -> list[tuple[int, int, str]]:
        """``(first, last, kernel family)`` token-count ranges covering ``1..max_tokens`` for ``spec``."""
        return [(1, max_tokens, cls.family)]

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


def choose_backend(kind: str, registry: list[type[Backend]], spec, env_var: str,
                   capability: Capability) -> tuple[type[Backend], list[tuple[str, str]]]:
    """The first backend class of ``registry`` (priority order) that runs ``spec`` on a GPU of compute
    ``capability`` (``env_var`` forces one), and (name, reason) of each one skipped before it."""
    forced = envs.forced_layer_backend(env_var)
    names = [b.name for b in registry]
    if forced and forced not in names:
        raise ValueError(f"{env_var}={forced!r}: unknown {kind} backend; choose from {names}")
    skipped = []
    for cls in registry:
        reason = cls.unsupported_reason(spec.device, capability) or cls.cannot_implement(spec)
        if reason is None and forced and cls.name != forced:
            reason = f"{env_var}={forced}"
        if reason is None:
            return cls, skipped
        skipped.append((cls.name, reason))
        if forced and cls.name == forced:
            raise RuntimeError(f"{env_var}={forced}: backend cannot run this {kind} layer: {reason}")
    raise RuntimeError(f"no {kind} backend can run {spec}: " + "; ".join(f"{n}: {r}" for n, r in skipped))


def describe_families(ranges: list[tuple[int, int, str]]) -> str:
    return "; ".join(f"{lo}-{hi}: {fam}" if lo != hi else f"{lo}: {fam}" for lo, hi, fam in ranges)


def select_backend(kind: str, registry: list[type[Backend]], spec, env_var: str) -> Backend:
    """First backend of ``registry`` (priority order) that runs ``spec`` on its device; env var forces
    one. Logged once per process and choice: the backend, why the ones before it were skipped, and
    the kernel family each token-count range runs (up to 16384 tokens)."""
    cls, skipped = choose_backend(kind, registry, spec, env_var, device_capability(spec.device))
    key = (kind, cls.name, tuple(skipped))
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("nvfp4_plugin: %s backend %r%s", kind, cls.name,
                    "".join(f"; skipped {n}: {r}" for n, r in skipped))
    fam_key = (kind, cls.name, spec)
    if fam_key not in _LOGGED:
        _LOGGED.add(fam_key)
        try:
            logger.info("nvfp4_plugin: %s %s on %s runs, by %s: %s", kind, _spec_text(spec), cls.name,
                        "token count" if isinstance(spec, LinearSpec) else "routed rows (tokens x top_k)",
                        describe_families(cls.families(spec, 16384)))
        except Exception as exc:  # noqa: BLE001 - a log line must never stop a model from loading
            logger.debug("nvfp4_plugin: kernel families of %s unknown (%s)", spec, exc)
    return cls()


def _spec_text(spec) -> str:
    if isinstance(spec, LinearSpec):
        return f"N={spec.n} K={spec.k}"
    return f"E={spec.num_experts} H={spec.hidden} I={spec.intermediate}"


def default_mode(capability: Capability) -> str:
    return "w4a4" if capability is not None and capability[0] >= 10 else "w4a16"


def resolve_mode(has_input_scale: bool, device: torch.device | None = None) -> str:
    default = default_mode(device_capability(device) if device is not None else None)
    mode = envs.act_mode(default)
    if mode not in MODES:
        raise ValueError(f"{ENV_ACT_MODE}={mode!r}: expected one of {MODES}")
    if mode == "w4a4" and not has_input_scale:
        logger.warning("nvfp4_plugin: %s=w4a4 but the checkpoint has no input scales; running w4a16", ENV_ACT_MODE)
        return "w4a16"
    return mode
