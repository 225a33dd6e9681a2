"""Loading of the optional compiled CUDA extension ``nvfp4_plugin._C``.

The package installs and works without it (the ops fall back to Triton or the reference); its
absence is reported by ``nvfp4-plugin info`` and logged once, never fatal.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass, field

logger = logging.getLogger("nvfp4_plugin")


@dataclass(frozen=True)
class ExtensionStatus:
    loaded: bool
    archs: tuple[str, ...] = field(default_factory=tuple)
    error: str = ""


@functools.lru_cache(maxsize=1)
def extension_status() -> ExtensionStatus:
    # torch first: _C links against libc10 / libtorch, which the dynamic loader finds only once torch has
    # loaded them (without it the import fails with "libc10.so: cannot open shared object file", and the
    # cached status would keep the extension off for the whole process). Importing torch starts no CUDA.
    import torch  # noqa: F401

    try:
        mod = importlib.import_module("nvfp4_plugin._C")
    except Exception as exc:  # ImportError, or an OSError from a CUDA library mismatch
        logger.info("nvfp4_plugin: compiled extension not loaded (%s)", exc)
        return ExtensionStatus(False, (), f"{type(exc).__name__}: {exc}")
    archs = tuple(getattr(mod, "BUILT_ARCHS", ()))
    return ExtensionStatus(True, archs, "")


def extension_runs_on(device) -> str | None:
    """None if the extension has kernels for ``device``'s architecture, else the reason not."""
    import torch

    st = extension_status()
    if not st.loaded:
        return "compiled extension not built or not loadable"
    if device.type != "cuda":
        return f"device is {device.type}, not cuda"
    major, minor = torch.cuda.get_device_capability(device)
    arch = f"sm_{major}{minor}a"
    if arch not in st.archs:
        return f"extension built for {', '.join(st.archs) or 'no arch'}, GPU is {arch}"
    return None
