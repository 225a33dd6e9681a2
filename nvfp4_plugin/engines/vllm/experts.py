"""Our fused-MoE layer as the experts of vLLM 0.26's modular kernel, for its all-to-all expert parallelism.

vLLM splits an expert-parallel MoE into a prepare/finalize (dispatch and combine across ranks,
``fused_moe/prepare_finalize/``) and the experts (``FusedMoEExpertsModular``). Which prepare/finalize
runs is vLLM's choice (``--all2all-backend``, ``all2all_utils.maybe_make_prepare_finalize``); it hands the
experts one of two activation formats:

* ``Standard``: the tokens this rank received ``[T, H]`` with global top-k ids and the layer's
  ``expert_map`` (DeepEP high-throughput, DeepEP v2, MoRI, FlashInfer NVLink). We map the ids to local
  experts (others: -1, never computed) and apply the top-k weights and the top-k sum ourselves
  (``TopKWeightAndReduceNoOP``).
* ``BatchedExperts``: ``[E_local, max_m, H]`` plus ``expert_num_tokens[E_local]`` (DeepEP low-latency,
  NIXL EP; vLLM's reference ``BatchedPrepareAndFinalize``): our masked path,
  :meth:`~nvfp4_plugin.layers.Nvfp4FusedMoE.forward_masked`, writing vLLM's workspace in place; the
  combine applies the top-k weights (``TopKWeightAndReduceDelegate``).

Dispatch is bf16 (vLLM's unquantized quant config): in W4A4 our layer quantizes after dispatch with the
same kernels as everywhere else, so the numerics do not depend on the parallelism.
"""

from __future__ import annotations

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (TopKWeightAndReduceDelegate,
                                                                          TopKWeightAndReduceNoOP)

from ..common import local_expert_ids

MASKED_PATH = "masked layout (Nvfp4FusedMoE.forward_masked)"


class _Nvfp4Experts(mk.FusedMoEExpertsModular):
    """Our layer behind vLLM's experts interface: vLLM's ``w1``/``w2`` arguments carry only the shapes
    its kernel reads (see :func:`make_moe_kernel`); the weights are the layer's prepared tensors."""

    def __init__(self, core, moe_config, max_num_tokens: int | None = None, num_dispatchers: int | None = None):
        super().__init__(moe_config, FUSED_MOE_UNQUANTIZED_CONFIG, max_num_tokens=max_num_tokens,
                         num_dispatchers=num_dispatchers)
        self.core = core

    @staticmethod
    def _supports_current_device() -> bool:
        return True              # our layer selected its backend for this device when it was built

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return True              # NVFP4 weights, bf16 dispatch: our own scheme, not one of vLLM's keys

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config) -> bool:
        return True


class Nvfp4StandardExperts(_Nvfp4Experts):
    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                         activation):
        return (0,), (0,), (M, K)      # our layer allocates its own intermediates

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        output.copy_(self.core(hidden_states, topk_weights, local_expert_ids(topk_ids, expert_map)))


class Nvfp4BatchedExperts(_Nvfp4Experts):
    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.BatchedExperts

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceDelegate()      # the combine applies the top-k weights

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                         activation):
        return (0,), (0,), (local_num_experts, self.max_num_tokens * self.num_dispatchers, K)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        # DeepEP's counts are [E_local]; vLLM's BatchedPrepareAndFinalize allocates [E_global], local ones first
        counts = expert_tokens_meta.expert_num_tokens[: hidden_states.shape[0]]
        self.core.forward_masked(hidden_states, counts if counts.dtype == torch.int32 else counts.to(torch.int32),
                                 out=output)


def make_moe_kernel(prepare_finalize, core, moe_config) -> tuple[mk.FusedMoEKernel, tuple[torch.Tensor, ...]]:
    """vLLM's modular kernel of ``prepare_finalize`` and our experts for its activation format, and the
    (w1, w2) arguments its ``apply`` takes: zero-element ``[E_local, 2I, 0]`` / ``[E_local, H, 0]`` tensors,
    since vLLM reads only their leading sizes (expert count, intermediate width)."""
    s = core.spec
    if prepare_finalize.activation_format == mk.FusedMoEActivationFormat.BatchedExperts:
        why = core.masked_unsupported_reason()
        if why is not None:
            raise NotImplementedError(
                f"{type(prepare_finalize).__name__} hands the batched-experts (masked) layout, and {why}; use an "
                "--all2all-backend with the standard format (allgather_reducescatter, deepep_high_throughput) or a "
                "backend with a masked path (hopper_triton on Hopper, flashinfer_cutlass_moe with "
                "nvidia-cutlass-dsl on Blackwell)")
        experts = Nvfp4BatchedExperts(core, moe_config, max_num_tokens=prepare_finalize.max_num_tokens_per_rank(),
                                      num_dispatchers=prepare_finalize.num_dispatchers())
    else:
        experts = Nvfp4StandardExperts(core, moe_config)
    shapes = (torch.empty((s.num_experts, 2 * s.intermediate, 0), device=s.device),
              torch.empty((s.num_experts, s.hidden, 0), device=s.device))
    return mk.FusedMoEKernel(prepare_finalize, experts), shapes


def describe(prepare_finalize) -> str:
    """The log line's words for what ``prepare_finalize`` hands us and which path takes it."""
    name = type(prepare_finalize).__name__
    if prepare_finalize.activation_format == mk.FusedMoEActivationFormat.BatchedExperts:
        return (f"expert parallel through {name}: batched-experts format [E_local, max_m, H] + expert_num_tokens, "
                f"consumed by the {MASKED_PATH}")
    return (f"expert parallel through {name}: standard format [T, H] + global top-k ids mapped to local experts "
            "(other ranks' experts never computed)")
