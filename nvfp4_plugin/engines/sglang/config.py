"""SGLang quantization config ``nvfp4``: parses ModelOpt and compressed-tensors NVFP4 checkpoints.

SGLang builds it with :meth:`Nvfp4SglangConfig.from_config` from ``config.json``'s
``quantization_config`` (plus the keys ``packed_modules_mapping`` and ``hf_config`` it adds) or, for
ModelOpt checkpoints that carry only ``hf_quant_config.json``, from that file.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch
from sglang.srt.layers.quantization.base_config import QuantizationConfig

from ...checkpoints import validate_checkpoint
from ..common import Nvfp4QuantConfig, is_layer_excluded, override_for, parse_quant_config
from . import NAME

logger = logging.getLogger("nvfp4_plugin")

#: SGLang's fused modules and their checkpoint shards, for models that declare no mapping (Llama):
#: an exclude entry naming a shard (``...q_proj``) must exclude the fused layer (``...qkv_proj``).
DEFAULT_PACKED_MODULES = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
    "fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"],
}

_VALIDATED: set[str] = set()


def _model_dir(hf_config) -> str | None:
    path = getattr(hf_config, "_name_or_path", None) or getattr(hf_config, "name_or_path", None)
    return path if isinstance(path, str) and os.path.isdir(path) else None


class Nvfp4SglangConfig(QuantizationConfig):
    def __init__(self, spec: Nvfp4QuantConfig, packed_modules_mapping: dict | None = None):
        super().__init__()
        self.spec = spec
        self.packed_modules_mapping = {**DEFAULT_PACKED_MODULES, **(packed_modules_mapping or {})}

    def update_packed_modules_mapping(self, mapping: dict) -> None:
        self.packed_modules_mapping = {**DEFAULT_PACKED_MODULES, **(mapping or {})}

    @classmethod
    def get_name(cls) -> str:
        return NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 90  # Hopper: our FP4-weight kernels; other GPUs: the reference backend (nvfp4-plugin info --capability)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["hf_quant_config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Nvfp4SglangConfig:
        config = dict(config)
        mapping = config.pop("packed_modules_mapping", None)
        hf_config = config.pop("hf_config", None)
        spec = parse_quant_config(config)
        model_dir = _model_dir(hf_config)
        if model_dir is not None and model_dir not in _VALIDATED:
            # Headers, dtypes, shapes and every scalar scale of a local checkpoint, on the CPU, before
            # any GPU allocation: a broken file fails with a message naming the file and tensor.
            # Block-scale values are checked per layer when they are loaded.
            validate_checkpoint(model_dir, check_block_scales=False)
            _VALIDATED.add(model_dir)
        if spec.kv_cache_quant_algo:
            logger.warning("nvfp4_plugin: the checkpoint declares a %s KV cache; nvfp4 does not quantize the KV "
                           "cache (its k/v scales are not loaded); choose one with --kv-cache-dtype",
                           spec.kv_cache_quant_algo)
        logger.info("nvfp4_plugin: SGLang quantization %r: %s checkpoint, %s, %d excluded module pattern(s)",
                    NAME, spec.format, spec.quant_algo, len(spec.exclude_modules))
        return cls(spec, mapping if isinstance(mapping, dict) else None)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant) -> str | None:
        # Without this, ModelOpt's override turns "--quantization nvfp4" into "modelopt_fp4". We only
        # claim a checkpoint when asked to: without the flag SGLang keeps its built-in path.
        return override_for(user_quant, NAME, hf_quant_cfg)

    def apply_weight_name_mapper(self, hf_to_sglang_mapper) -> None:
        # Keep the checkpoint's own names too: wildcard patterns do not always survive a name mapper.
        mapped = hf_to_sglang_mapper.apply_list(list(self.spec.exclude_modules))
        merged = tuple(dict.fromkeys([*self.spec.exclude_modules, *mapped]))
        self.spec = dataclasses.replace(self.spec, exclude_modules=merged)

    def get_scaled_act_names(self) -> list[str]:
        return []

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from sglang.srt.layers.linear import LinearBase
        from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
        from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
        from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

        from .linear import Nvfp4SglangLinearMethod
        from .moe import Nvfp4SglangFusedMoEMethod

        if isinstance(layer, (LinearBase, ParallelLMHead)):
            if is_layer_excluded(self.spec, prefix, self.packed_modules_mapping):
                return UnquantizedLinearMethod()
            layer.nvfp4_prefix = prefix or type(layer).__name__  # names the layer in error messages
            return Nvfp4SglangLinearMethod(self)
        if isinstance(layer, FusedMoE):
            if is_layer_excluded(self.spec, prefix, self.packed_modules_mapping):
                return None  # SGLang's unquantized MoE
            return Nvfp4SglangFusedMoEMethod(self)
        return None  # embeddings, attention (KV-cache quantization is not ours)
