"""vLLM fused-MoE method: vLLM's RoutedExperts weight loader, our engine-neutral Nvfp4FusedMoE.

The class name deliberately does not contain "ModelOpt": vLLM's MoE loader would then switch to
name-based special cases. Instead every scale parameter carries the ``quant_method`` attribute the
generic loader dispatches on (block scales: BLOCK, per-expert global scales: TENSOR).
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import FusedMoeWeightScaleSupported
from vllm.model_executor.utils import set_weight_attrs

from ..common import finish_moe, layer_tensor_names
from .linear import max_batched_tokens


class Nvfp4VllmFusedMoEMethod(FusedMoEMethodBase):
    def __init__(self, quant_config, moe_config):
        super().__init__(moe_config)
        self.quant_config = quant_config
        self.fmt = quant_config.spec.format
        self.names = layer_tensor_names(self.fmt)

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        activation = getattr(self.moe.activation, "value", self.moe.activation)
        if not self.moe.is_act_and_mul or activation != "silu":
            raise ValueError(f"nvfp4 MoE: only SiLU-and-mul experts are supported, got activation={activation!r}, "
                             f"act_and_mul={self.moe.is_act_and_mul}")
        h, i = hidden_size, intermediate_size_per_partition
        if h % 16 or i % 16:
            raise ValueError(f"nvfp4 MoE: hidden size ({h}) and intermediate size per partition ({i}) must be "
                             "multiples of 16")
        nm = self.names
        layer.nvfp4_act_dtype = params_dtype

        def add(name, shape, dtype, fill=None, quant_method=None):
            data = torch.empty(shape, dtype=dtype) if fill is None else torch.full(shape, fill, dtype=dtype)
            p = torch.nn.Parameter(data, requires_grad=False)
            layer.register_parameter(name, p)
            set_weight_attrs(p, extra_weight_attrs)
            if quant_method is not None:
                set_weight_attrs(p, {"quant_method": quant_method.value})

        block, tensor = FusedMoeWeightScaleSupported.BLOCK, FusedMoeWeightScaleSupported.TENSOR
        add(f"w13_{nm.weight}", (num_experts, 2 * i, h // 2), torch.uint8)
        add(f"w2_{nm.weight}", (num_experts, h, i // 2), torch.uint8)
        add(f"w13_{nm.block_scale}", (num_experts, 2 * i, h // 16), torch.float8_e4m3fn, quant_method=block)
        add(f"w2_{nm.block_scale}", (num_experts, h, i // 16), torch.float8_e4m3fn, quant_method=block)
        nan = float("nan")
        add(f"w13_{nm.weight_global}", (num_experts, 2), torch.float32, nan, quant_method=tensor)
        add(f"w2_{nm.weight_global}", (num_experts,), torch.float32, nan, quant_method=tensor)
        # ModelOpt's "input_scale" goes through the loader's single-value path (one per expert);
        # compressed-tensors' "input_global_scale" through the per-tensor path (one per w1/w3 shard)
        a13_shape = (num_experts,) if "input_scale" in nm.input_global else (num_experts, 2)
        add(f"w13_{nm.input_global}", a13_shape, torch.float32, nan, quant_method=tensor)
        add(f"w2_{nm.input_global}", (num_experts,), torch.float32, nan, quant_method=tensor)

    def process_weights_after_loading(self, layer) -> None:
        finish_moe(layer, getattr(layer, "layer_name", "experts"), self.fmt, layer.nvfp4_act_dtype,
                   self.moe.experts_per_token, warmup_tokens=max_batched_tokens())

    def get_fused_moe_quant_config(self, layer):
        return None

    def maybe_make_prepare_finalize(self, routing_tables=None):
        return None  # no all-to-all expert parallelism yet: experts run where the tokens are

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        if layer.apply_router_weight_on_input:
            raise NotImplementedError("nvfp4 MoE: apply_router_weight_on_input is not supported")
        expert_map = getattr(layer, "expert_map", None)
        if expert_map is not None:  # expert parallel without all-to-all: keep the local experts only
            local = expert_map[topk_ids.long()]
            topk_weights = torch.where(local >= 0, topk_weights, torch.zeros_like(topk_weights))
            topk_ids = local.clamp(min=0)
        return layer.nvfp4_core(x, topk_weights, topk_ids)
