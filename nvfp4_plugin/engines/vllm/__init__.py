"""vLLM adapter: ``vllm serve <ckpt> --quantization nvfp4``.

vLLM calls :func:`register` (entry point group ``vllm.general_plugins``) in every process it starts;
it must be cheap and re-entrant.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("nvfp4_plugin")
_REGISTERED = False


def register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from vllm.model_executor.layers.linear import register_weight_loader_v2_supported_method
    from vllm.model_executor.layers.quantization import register_quantization_config

    from ..._logging import configure_for_engine
    from ..common import NAME
    from .config import Nvfp4VllmConfig
    from .linear import Nvfp4VllmLinearMethod

    configure_for_engine()
    register_quantization_config(NAME)(Nvfp4VllmConfig)
    register_weight_loader_v2_supported_method(Nvfp4VllmLinearMethod)
    _REGISTERED = True
    logger.info("nvfp4_plugin: registered quantization method %r with vLLM", NAME)
