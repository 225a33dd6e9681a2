"""SGLang quantization config ``nvfp4``: parses ModelOpt and compressed-tensors NVFP4 checkpoints.

SGLang builds it with :meth:`Nvfp4SglangConfig.from_config` from ``config.json``'s
``quantization_config`` (plus the keys ``packed_modules_mapping`` and ``hf_config`` it adds) or, for
ModelOpt checkpoints that carry only ``hf_quant_config.json``, from that file.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.quantization.base_config import QuantizationConfig

from ..common import Nvfp4ConfigMethods, Nvfp4QuantConfig, validate_model_dir


def _model_dir(hf_config) -> str | None:
    return getattr(hf_config, "_name_or_path", None) or getattr(hf_config, "name_or_path", None)


class Nvfp4SglangConfig(Nvfp4ConfigMethods, QuantizationConfig):
    engine = "SGLang"

    def __init__(self, spec: Nvfp4QuantConfig, packed_modules_mapping: dict | None = None):
        super().__init__()
        self.spec = spec
        self.packed_modules_mapping = dict(packed_modules_mapping or {})

    @staticmethod
    def max_tokens() -> int | None:
        """Prefill chunk or limit, or decode batch: the largest."""
        from sglang.srt.server_args import get_global_server_args

        try:
            args = get_global_server_args()
        except (AttributeError, AssertionError, ValueError):
            return None
        sizes = [getattr(args, a, None) for a in ("chunked_prefill_size", "max_prefill_tokens", "cuda_graph_max_bs")]
        sizes = [s for s in sizes if isinstance(s, int) and s > 0]
        return max(sizes) if sizes else None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Nvfp4SglangConfig:
        config = dict(config)
        mapping = config.pop("packed_modules_mapping", None)
        hf_config = config.pop("hf_config", None)
        spec = cls.parse_spec(config)
        validate_model_dir(_model_dir(hf_config))  # SGLang has no later hook with the model folder
        return cls(spec, mapping if isinstance(mapping, dict) else None)

    def apply_weight_name_mapper(self, hf_to_sglang_mapper) -> None:
        self.map_excluded_names(hf_to_sglang_mapper)

    def get_scaled_act_names(self) -> list[str]:
        return []

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from sglang.srt.layers.linear import LinearBase
        from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
        from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
        from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

        from .linear import Nvfp4SglangLinearMethod
        from .moe import Nvfp4SglangFusedMoEMethod

        kind = ("linear" if isinstance(layer, (LinearBase, ParallelLMHead)) else
                "moe" if isinstance(layer, FusedMoE) else None)  # embeddings, attention: SGLang's
        return self.quant_method_for(layer, prefix, kind, linear=lambda: Nvfp4SglangLinearMethod(self),
                                     moe=lambda: Nvfp4SglangFusedMoEMethod(self),
                                     unquantized_linear=UnquantizedLinearMethod)
