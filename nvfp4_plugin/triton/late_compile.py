"""Kernels compiled after the start-up warm-up, logged.

Layers launch every kernel they can select while the engine starts (``_Layer._warm``, inside
:func:`warming_up`), so that no request waits for a compile. :class:`.fast_launch.FastLaunch` times the first
launch of each kernel specialization; one outside the warm-up that takes :data:`LATE_COMPILE_S` or longer
compiled (or read Triton's disk cache) and is logged as a warning naming the kernel: a launch shape the warm-up
missed, met while the engine captures its CUDA graphs or serves a request. No Triton import here (the layers
import this module).
"""

from __future__ import annotations

import contextlib
import logging

logger = logging.getLogger("nvfp4_plugin")

#: A first launch outside the warm-up that takes this long compiled (or loaded from disk) a kernel.
LATE_COMPILE_S = 0.1
_warming = 0


@contextlib.contextmanager
def warming_up():
    """Launches inside are a layer's start-up warm-up: their first launches are expected to compile."""
    global _warming
    _warming += 1
    try:
        yield
    finally:
        _warming -= 1


def note_first_launch(fn, seconds: float) -> bool:
    """Log the first launch of a kernel specialization outside the warm-up that took ``seconds`` if that is
    long enough to have compiled; returns whether it was logged."""
    if _warming or seconds < LATE_COMPILE_S:
        return False
    logger.warning("nvfp4_plugin: kernel %s compiled outside the start-up warm-up (%.2f s for its first launch "
                   "with these argument types, alignments and constants): the layers' warm-up missed this launch "
                   "shape", getattr(fn, "__name__", fn), seconds)
    return True
