"""vLLM fused-MoE method: vLLM's RoutedExperts weight loader, our engine-neutral Nvfp4FusedMoE.

The class name deliberately does not contain "ModelOpt": vLLM's MoE loader would then switch to
name-based special cases. Instead every scale parameter carries the ``quant_method`` attribute the
generic loader dispatches on (block scales: BLOCK, per-expert global scales: TENSOR).

Expert parallelism (``--enable-expert-parallel``), by what vLLM 0.26 hands the method:

* no all-to-all (TP+EP; DP+EP over the default ``--all2all-backend allgather_reducescatter``, whose
  gather and reduce-scatter vLLM's runner does around a method like ours): every token ``[T, H]`` with
  global top-k ids and ``layer.expert_map``; :meth:`apply` maps the ids to local experts, other ranks'
  experts become -1 and are never computed;
* all-to-all kernels (DeepEP, NIXL EP, MoRI, FlashInfer NVLink; ``use_all2all_kernels``): the method holds
  vLLM's modular kernel of that prepare/finalize and our experts (:mod:`.experts`), the masked path
  for the batched formats.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import FusedMoeWeightScaleSupported

from ..common import layer_prefix, local_expert_ids, log_moe_path
from ..methods import Nvfp4FusedMoEMethod
from . import experts as ep


def all2all_prepare_finalize(moe_config, layer):
    """vLLM's prepare/finalize for an all-to-all backend (bf16 dispatch), or None where vLLM runs no
    all-to-all kernel for a method like ours (no expert parallelism, TP+EP, allgather_reducescatter)."""
    pc = moe_config.moe_parallel_config
    if not pc.use_all2all_kernels or pc.use_ag_rs_all2all_kernels:
        return None
    from vllm.model_executor.layers.fused_moe.all2all_utils import maybe_make_prepare_finalize
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

    return maybe_make_prepare_finalize(moe_config, FUSED_MOE_UNQUANTIZED_CONFIG,
                                       routing_tables=layer._expert_routing_tables(), allow_new_interface=True)


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

    def maybe_roundup_sizes(self, hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config):
        # vLLM pads the hidden size for some all-to-all kernels (DeepEP's compiled sizes); our weights keep
        # the checkpoint's shapes and the prepare/finalize gets unpadded bf16 tokens
        return hidden_size, intermediate_size_per_partition

    def maybe_make_prepare_finalize(self, routing_tables=None):
        # vLLM's legacy hook (a modular kernel around the method, reading layer.w13_weight, which we do not
        # keep): all-to-all kernels are set up in process_weights_after_loading instead, as vLLM's own
        # methods do, and without them experts run where the tokens are
        return None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        super().process_weights_after_loading(layer)
        prefix = layer_prefix(layer)
        pf = all2all_prepare_finalize(self.moe, layer)
        if pf is not None:
            self.moe_kernel, self.nvfp4_kernel_weights = ep.make_moe_kernel(pf, layer.nvfp4_core, self.moe)
            log_moe_path("vLLM", prefix, ep.describe(pf))
        elif layer.expert_map is not None:
            how = ("DP+EP, allgather_reducescatter done by vLLM's runner" if self.moe.moe_parallel_config.dp_size > 1
                   else "TP+EP, no all-to-all")
            log_moe_path("vLLM", prefix, f"expert parallel ({how}): standard format [T, H] + global top-k ids "
                                         "mapped to local experts through expert_map (other ranks' experts never "
                                         "computed)")

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        if self.moe_kernel is not None:
            w1, w2 = self.nvfp4_kernel_weights
            return self.moe_kernel.apply(x, w1, w2, topk_weights, topk_ids, activation=layer.activation,
                                         global_num_experts=layer.global_num_experts, expert_map=layer.expert_map,
                                         apply_router_weight_on_input=layer.apply_router_weight_on_input,
                                         shared_experts=shared_experts, shared_experts_input=shared_experts_input)
        return layer.nvfp4_core(x, topk_weights, local_expert_ids(topk_ids, layer.expert_map))
