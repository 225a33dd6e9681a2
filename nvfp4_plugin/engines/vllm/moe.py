"""vLLM fused-MoE method: vLLM's RoutedExperts weight loader, our engine-neutral Nvfp4FusedMoE.

The class name deliberately does not contain "ModelOpt": vLLM's MoE loader would then switch to
name-based special cases. Instead every scale parameter carries the ``quant_method`` attribute the
generic loader dispatches on (block scales: BLOCK, per-expert global scales: TENSOR).
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import FusedMoeWeightScaleSupported

from ..methods import Nvfp4FusedMoEMethod


class Nvfp4VllmFusedMoEMethod(Nvfp4FusedMoEMethod, FusedMoEMethodBase):
    scale_kinds = FusedMoeWeightScaleSupported

    def unsupported_settings(self, layer, extra_weight_attrs) -> dict:
        moe = self.moe
        return {"activation": (getattr(moe.activation, "value", moe.activation), "silu"),
                "is_act_and_mul": (moe.is_act_and_mul, True), "has_bias": (moe.has_bias, False),
                "swiglu_limit": (moe.swiglu_limit, None),
                "apply_router_weight_on_input": (layer.apply_router_weight_on_input, False)}

    def full_sizes(self, layer) -> tuple[int, int]:
        return layer.hidden_size, layer.intermediate_size_per_partition * self.moe.moe_parallel_config.tp_size

    def top_k(self, layer) -> int:
        return self.moe.experts_per_token

    def get_fused_moe_quant_config(self, layer):
        return None

    def maybe_make_prepare_finalize(self, routing_tables=None):
        return None  # no all-to-all expert parallelism yet: experts run where the tokens are

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        expert_map = getattr(layer, "expert_map", None)
        if expert_map is not None:  # expert parallel without all-to-all: keep the local experts only
            local = expert_map[topk_ids.long()]
            topk_weights = torch.where(local >= 0, topk_weights, torch.zeros_like(topk_weights))
            topk_ids = local.clamp(min=0)
        return layer.nvfp4_core(x, topk_weights, topk_ids)
