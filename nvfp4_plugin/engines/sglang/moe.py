"""SGLang fused-MoE method: SGLang's FusedMoE weight loader, our engine-neutral Nvfp4FusedMoE.

The class name deliberately does not contain "ModelOpt" and the class is no
``ModelOptNvFp4FusedMoEMethod``: FusedMoE's loader would then switch to ModelOpt's name-based special
cases and its FlashInfer paths. Instead every scale parameter carries the ``quant_method`` attribute
the generic loader dispatches on (block scales: BLOCK, per-expert global scales: TENSOR).

What SGLang 0.5.17's dispatchers hand the method (``apply``), by ``--moe-a2a-backend``:

* ``none`` (TP, and ``--ep N`` without all-to-all): the standard format, every token ``[T, H]`` with
  top-k ids that the StandardDispatcher already mapped to local experts, -1 for other ranks' experts
  (never computed by our layer);
* ``deepep`` (needs deep_ep): low-latency dispatch, ``hidden_states [E_local, max_m, H]`` + ``masked_m``,
  runs our masked path and returns the combine input DeepEP's combine weights and sums; normal dispatch
  (prefill with ``--deepep-mode auto``), the received tokens ``[T_recv, H]`` with local ids (-1
  elsewhere), runs the standard path. Dispatch must be bf16: we ask the dispatcher for it.

Other all-to-all backends (mooncake dispatches FP8 only; nixl, mori, pplx, flashinfer) and the
FlashInfer/Triton MoE runner backends are refused at start-up.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoeWeightScaleSupported
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase

from ..common import layer_prefix, log_moe_path
from ..methods import Nvfp4FusedMoEMethod

#: ``--moe-a2a-backend`` values whose dispatch formats the method takes.
A2A_BACKENDS = ("none", "deepep")


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
        if a2a.value not in A2A_BACKENDS:
            raise NotImplementedError(f"{prefix}: --quantization nvfp4 takes --moe-a2a-backend "
                                      f"{' or '.join(A2A_BACKENDS)} (got {a2a.value!r}); or expert parallelism "
                                      "without all-to-all (--ep N alone)")
        self.moe_runner_config = moe_runner_config
        if a2a.is_deepep():
            log_moe_path("SGLang", prefix, "expert parallel through DeepEP: low-latency dispatch [E_local, max_m, H] + "
                                           "masked_m consumed by the masked layout (Nvfp4FusedMoE.forward_masked); "
                                           "normal dispatch [T_recv, H] + local ids by the standard path")
        elif layer.moe_ep_size > 1:
            log_moe_path("SGLang", prefix, "expert parallel without all-to-all (--ep, StandardDispatcher): standard "
                                           "format [T, H], other ranks' experts as id -1, never computed")

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        super().process_weights_after_loading(layer)
        from sglang.srt.layers.moe.utils import get_deepep_mode, get_moe_a2a_backend

        if get_moe_a2a_backend().is_deepep():
            why = layer.nvfp4_core.masked_unsupported_reason()
            if why is not None and get_deepep_mode().enable_low_latency():
                # fail at load, not at the first low-latency decode step
                raise NotImplementedError(f"{layer_prefix(layer)}: DeepEP's low-latency dispatch hands the masked "
                                          f"layout, and {why}; use --deepep-mode normal, or a backend with a masked "
                                          "path (hopper_triton on Hopper, flashinfer_cutlass_moe with "
                                          "nvidia-cutlass-dsl on Blackwell)")
            # DeepEP's dispatcher quantizes to FP8 by default (our layer takes bf16 and quantizes itself),
            # and SGLang's DeepEPMoE sends only the methods it knows through the quant method's apply
            layer.dispatcher.set_quant_config({"dispatcher_output_dtype": "bf16"})
            if hasattr(layer, "deprecate_flag"):
                layer.deprecate_flag = True

    def apply(self, layer: torch.nn.Module, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
        from sglang.srt.layers.moe.token_dispatcher.deepep import DeepEPLLCombineInput, DeepEPNormalCombineInput
        from sglang.srt.layers.moe.topk import TopKOutputChecker

        fmt = dispatch_output.format
        if fmt.is_deepep_ll():
            out = layer.nvfp4_core.forward_masked(_bf16(layer, dispatch_output), _int32(dispatch_output.masked_m))
            return DeepEPLLCombineInput(hidden_states=self._scaled(layer, out), topk_ids=dispatch_output.topk_ids,
                                        topk_weights=dispatch_output.topk_weights)
        if fmt.is_deepep_normal():
            out = layer.nvfp4_core(_bf16(layer, dispatch_output), dispatch_output.topk_weights,
                                   dispatch_output.topk_ids)
            return DeepEPNormalCombineInput(hidden_states=self._scaled(layer, out),
                                            topk_ids=dispatch_output.topk_ids,
                                            topk_weights=dispatch_output.topk_weights)
        topk_output = getattr(dispatch_output, "topk_output", None)
        if not fmt.is_standard() or not TopKOutputChecker.format_is_standard(topk_output):
            raise NotImplementedError(f"{layer_prefix(layer)}: nvfp4 MoE takes SGLang's standard and DeepEP "
                                      f"dispatch outputs with standard top-k outputs, got {fmt!r} / "
                                      f"{getattr(topk_output, 'format', None)!r}")
        # with --ep the StandardDispatcher has mapped other ranks' experts to -1: our layer skips them
        out = layer.nvfp4_core(dispatch_output.hidden_states, topk_output.topk_weights, topk_output.topk_ids)
        return StandardCombineInput(hidden_states=self._scaled(layer, out))

    def _scaled(self, layer, out: torch.Tensor) -> torch.Tensor:
        # like SGLang's Triton runner: the routed scaling factor is applied by the experts unless top-k
        # already folded it into the weights
        rsf = self.moe_runner_config.routed_scaling_factor
        if rsf is not None and rsf != 1.0 and not layer.should_fuse_routed_scaling_factor_in_topk:
            out = out * rsf
        return out


def _bf16(layer, dispatch_output) -> torch.Tensor:
    """DeepEP's dispatched tokens, refused if they arrive quantized (hidden_states_scale set)."""
    if dispatch_output.hidden_states_scale is not None:
        raise NotImplementedError(f"{layer_prefix(layer)}: nvfp4 MoE takes DeepEP's bf16 dispatch (it quantizes "
                                  f"itself), got {dispatch_output.hidden_states.dtype} tokens with scales; leave "
                                  "--deepep-dispatcher-output-dtype at auto or set it to bf16")
    return dispatch_output.hidden_states


def _int32(counts: torch.Tensor) -> torch.Tensor:
    return counts if counts.dtype == torch.int32 else counts.to(torch.int32)
