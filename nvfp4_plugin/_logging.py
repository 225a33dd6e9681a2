"""Logging set-up for engine processes: our records go to stderr beside the engine's own.

Library code only logs to ``logging.getLogger("nvfp4_plugin")``. The vLLM adapter calls
:func:`configure_for_engine` at registration so that a served model's log names the method and the
backend chosen; ``NVFP4_PLUGIN_LOG_LEVEL`` (default ``INFO``) sets the level there. The SGLang adapter
does not: SGLang configures the root logger of its processes, and our records go through it, at
SGLang's ``--log-level`` (at ``error`` the plugin's warnings, e.g. a kernel compiled after start-up,
are hidden).
"""

from __future__ import annotations

import logging
import sys

from . import envs

ENV_LOG_LEVEL = envs.LOG_LEVEL


def configure_for_engine() -> None:
    logger = logging.getLogger("nvfp4_plugin")
    if any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(envs.log_level())
    logger.propagate = False
