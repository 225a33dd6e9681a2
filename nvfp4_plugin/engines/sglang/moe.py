"""SGLang fused-MoE method: SGLang's FusedMoE weight loader, our engine-neutral Nvfp4FusedMoE.

The class name deliberately does not contain "ModelOpt" and the class is no
``ModelOptNvFp4FusedMoEMethod``: FusedMoE's loader would then switch to ModelOpt's name-based special
cases and its FlashInfer paths. Instead every scale parameter carries the ``quant_method`` attribute
the generic loader dispatches on (block scales: BLOCK, per-expert global scales: TENSOR).

The experts run where the tokens are (SGLang's standard dispatcher, TP and plain EP); all-to-all
dispatch (DeepEP, Mooncake, ...) and the FlashInfer/Triton MoE runner backends are not ours.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoeWeightScaleSupported
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase

from ..common import layer_prefix
from ..methods import Nvfp4FusedMoEMethod


class Nvfp4SglangFusedMoEMethod(Nvfp4FusedMoEMethod, FusedMoEMethodBase):
    scale_kinds = FusedMoeWeightScaleSupported

    def unsupported_settings(self, layer, extra_weight_attrs) -> dict:
        rc = layer.moe_runner_config
        return {"activation": (rc.activation, "silu"), "is_gated": (rc.is_gated, True),
                "with_bias": (extra_weight_attrs.get("with_bias", False), False),
                "gemm1_alpha": (rc.gemm1_alpha, None), "gemm1_clamp_limit": (rc.gemm1_clamp_limit, None),
                "swiglu_limit": (rc.swiglu_limit, None),
                "apply_router_weight_on_input": (rc.apply_router_weight_on_input, False),
                "no_combine": (rc.no_combine, False)}

    def full_sizes(self, layer) -> tuple[int, int]:
        return layer.hidden_size, layer.intermediate_size_per_partition * layer.moe_tp_size

    def top_k(self, layer) -> int:
        return self.moe_runner_config.top_k

    def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config) -> None:
        from sglang.srt.layers.moe.utils import get_moe_a2a_backend, get_moe_runner_backend

        prefix = layer_prefix(layer)
        runner, a2a = get_moe_runner_backend(), get_moe_a2a_backend()
        if not (runner.is_auto() or runner.is_triton()):
            raise NotImplementedError(f"{prefix}: --quantization nvfp4 runs its own MoE kernels; leave "
                                      f"--moe-runner-backend at auto (got {runner.value!r})")
        if not a2a.is_none():
            raise NotImplementedError(f"{prefix}: --quantization nvfp4 does not support --moe-a2a-backend "
                                      f"{a2a.value!r} yet (DeepEP/all-to-all dispatch); use tensor or expert "
                                      "parallelism without it")
        self.moe_runner_config = moe_runner_config

    def apply(self, layer: torch.nn.Module, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
        from sglang.srt.layers.moe.topk import TopKOutputChecker

        topk_output = getattr(dispatch_output, "topk_output", None)
        if not dispatch_output.format.is_standard() or not TopKOutputChecker.format_is_standard(topk_output):
            raise NotImplementedError(f"{layer_prefix(layer)}: nvfp4 MoE takes SGLang's standard "
                                      f"dispatch and top-k outputs, got {dispatch_output.format!r} / "
                                      f"{getattr(topk_output, 'format', None)!r}")
        topk_weights, topk_ids = topk_output.topk_weights, topk_output.topk_ids
        if layer.moe_ep_size > 1:
            # the standard dispatcher maps experts of other ranks to -1: they contribute nothing here
            local = topk_ids >= 0
            topk_weights = torch.where(local, topk_weights, torch.zeros_like(topk_weights))
            topk_ids = topk_ids.clamp(min=0)
        out = layer.nvfp4_core(dispatch_output.hidden_states, topk_weights, topk_ids)
        # like SGLang's Triton runner: the routed scaling factor is applied by the experts unless top-k
        # already folded it into the weights
        rsf = self.moe_runner_config.routed_scaling_factor
        if rsf is not None and rsf != 1.0 and not layer.should_fuse_routed_scaling_factor_in_topk:
            out = out * rsf
        return StandardCombineInput(hidden_states=out)
