"""SGLang adapter: ``python -m sglang.launch_server --model-path <ckpt> --quantization nvfp4``.

SGLang's ``load_plugins()`` calls :func:`register` (entry point group ``sglang.srt.plugins``) in the
launcher and in every scheduler process, before the command line is parsed. It must be cheap and
re-entrant: every step below checks before it changes anything.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("nvfp4_plugin")
_LOGGED = False


def register() -> None:
    """Make ``--quantization nvfp4`` a CLI choice and SGLang's ``nvfp4`` quantization method."""
    global _LOGGED
    from sglang.srt.layers import linear as sgl_linear
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS
    from sglang.srt.server_args import QUANTIZATION_CHOICES, add_quantization_method_choices

    from ..common import NAME
    from .config import Nvfp4SglangConfig
    from .linear import Nvfp4SglangLinearMethod

    # ModelConfig._verify_quantization asks every registered config, in dict order, whether it
    # claims the checkpoint; ModelOpt's config claims every NVFP4 ModelOpt checkpoint whatever the
    # user asked for. Ours answers only when the user asked for "nvfp4", so it has to be asked first.
    if next(iter(QUANTIZATION_METHODS), None) != NAME or QUANTIZATION_METHODS[NAME] is not Nvfp4SglangConfig:
        others = [(k, v) for k, v in QUANTIZATION_METHODS.items() if k != NAME]
        QUANTIZATION_METHODS.clear()  # the same dict object: model_config.py imported it by name
        QUANTIZATION_METHODS[NAME] = Nvfp4SglangConfig
        QUANTIZATION_METHODS.update(others)
    if NAME not in QUANTIZATION_CHOICES:
        add_quantization_method_choices([NAME])
    # Linear layers pick their weight loader by the method's class name: the v2 loaders are the
    # ones that understand SGLang's parameter classes (shards of fused layers, per-shard scales).
    if Nvfp4SglangLinearMethod.__name__ not in sgl_linear.WEIGHT_LOADER_V2_SUPPORTED:
        sgl_linear.WEIGHT_LOADER_V2_SUPPORTED.append(Nvfp4SglangLinearMethod.__name__)
    if not _LOGGED:
        _LOGGED = True
        logger.info("nvfp4_plugin: registered quantization method %r with SGLang", NAME)


__all__ = ["register"]
