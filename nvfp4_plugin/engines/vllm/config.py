"""vLLM quantization config ``nvfp4``: parses ModelOpt and compressed-tensors NVFP4 checkpoints."""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from ..common import Nvfp4ConfigMethods, Nvfp4QuantConfig, validate_model_dir


class Nvfp4VllmConfig(Nvfp4ConfigMethods, QuantizationConfig):
    engine = "vLLM"

    def __init__(self, spec: Nvfp4QuantConfig):
        super().__init__()
        self.spec = spec

    @staticmethod
    def max_tokens() -> int | None:
        from vllm.config import get_current_vllm_config_or_none

        cfg = get_current_vllm_config_or_none()  # None outside a vLLM config context
        return getattr(getattr(cfg, "scheduler_config", None), "max_num_batched_tokens", None)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Nvfp4VllmConfig:
        return cls(cls.parse_spec(config))

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        self.map_excluded_names(hf_to_vllm_mapper)

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None) -> None:
        validate_model_dir(model_name)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

        from .linear import Nvfp4VllmLinearMethod
        from .moe import Nvfp4VllmFusedMoEMethod

        kind = ("linear" if isinstance(layer, (LinearBase, ParallelLMHead)) else
                "moe" if isinstance(layer, RoutedExperts) else None)  # attention: KV-cache quantization is not ours
        return self.quant_method_for(layer, prefix, kind, linear=lambda: Nvfp4VllmLinearMethod(self),
                                     moe=lambda: Nvfp4VllmFusedMoEMethod(self, layer.moe_config),
                                     unquantized_linear=UnquantizedLinearMethod)
