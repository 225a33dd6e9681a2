"""vLLM quantization config ``nvfp4``: parses ModelOpt and compressed-tensors NVFP4 checkpoints."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from ...checkpoints import validate_checkpoint
from ..common import Nvfp4QuantConfig, is_layer_excluded, override_for, parse_quant_config

logger = logging.getLogger("nvfp4_plugin")

NAME = "nvfp4"


class Nvfp4VllmConfig(QuantizationConfig):
    def __init__(self, spec: Nvfp4QuantConfig):
        super().__init__()
        self.spec = spec

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 90  # Hopper: our FP4-weight kernels; other GPUs: the reference backend (nvfp4-plugin info --capability)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["hf_quant_config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Nvfp4VllmConfig:
        return cls(parse_quant_config(config))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        # Without this, vLLM's ModelOpt override turns "--quantization nvfp4" into "modelopt_fp4".
        return override_for(user_quant, NAME, hf_quant_cfg)

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        mapped = hf_to_vllm_mapper.apply_list(list(self.spec.exclude_modules))
        self.spec = dataclasses.replace(self.spec, exclude_modules=tuple(mapped))

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None) -> None:
        # Check every tensor of a local checkpoint on the CPU now, so a broken file fails with a
        # message naming the file and tensor before any GPU work.
        if os.path.isdir(model_name):
            validate_checkpoint(model_name)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

        from .linear import Nvfp4VllmLinearMethod
        from .moe import Nvfp4VllmFusedMoEMethod

        if isinstance(layer, (LinearBase, ParallelLMHead)):
            if is_layer_excluded(self.spec, prefix, self.packed_modules_mapping):
                return UnquantizedLinearMethod()
            layer.prefix = prefix
            return Nvfp4VllmLinearMethod(self)
        if isinstance(layer, RoutedExperts):
            if is_layer_excluded(self.spec, prefix, self.packed_modules_mapping):
                return None
            return Nvfp4VllmFusedMoEMethod(self, layer.moe_config)
        return None  # attention: vLLM's default (KV-cache quantization is not ours)
