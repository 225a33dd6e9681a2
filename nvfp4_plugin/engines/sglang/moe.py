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
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase

from ..common import finish_moe, layer_tensor_names
from .linear import max_forward_tokens
from .loading import e4m3_bytes, expert_loader


class Nvfp4SglangFusedMoEMethod(FusedMoEMethodBase):
    def __init__(self, quant_config):
        super().__init__()
        self.quant_config = quant_config
        self.fmt = quant_config.spec.format
        self.names = layer_tensor_names(self.fmt)

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs):
        from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoeWeightScaleSupported
        from sglang.srt.utils import set_weight_attrs

        prefix = getattr(layer, "layer_name", "experts")
        rc = layer.moe_runner_config
        unsupported = {"activation": (rc.activation, "silu"), "is_gated": (rc.is_gated, True),
                       "with_bias": (extra_weight_attrs.get("with_bias", False), False),
                       "gemm1_alpha": (rc.gemm1_alpha, None), "gemm1_clamp_limit": (rc.gemm1_clamp_limit, None),
                       "swiglu_limit": (rc.swiglu_limit, None),
                       "apply_router_weight_on_input": (rc.apply_router_weight_on_input, False),
                       "no_combine": (rc.no_combine, False)}
        bad = {k: got for k, (got, want) in unsupported.items() if got != want}
        if bad:
            raise NotImplementedError(f"{prefix}: nvfp4 MoE supports SiLU-and-mul experts without bias, clamping or "
                                      f"router weights on the input; this layer has {bad}")
        h, i = hidden_size, intermediate_size_per_partition
        if h % 16 or i % 16:
            raise ValueError(f"{prefix}: nvfp4 MoE needs the hidden size ({h}) and the intermediate size per partition "
                             f"({i}) to be multiples of 16")
        nm, spec = self.names, self.quant_config.spec
        layer.nvfp4_act_dtype = params_dtype
        load = extra_weight_attrs["weight_loader"]

        def add(name, shape, dtype, fill, quant_method=None, views=None):
            data = e4m3_bytes(shape, 0x7F) if dtype == torch.float8_e4m3fn else torch.full(shape, fill, dtype=dtype)
            p = torch.nn.Parameter(data, requires_grad=False)
            layer.register_parameter(name, p)
            set_weight_attrs(p, {"weight_loader": expert_loader(layer, load, spec, name.split("_", 1)[1], views)})
            if quant_method is not None:
                set_weight_attrs(p, {"quant_method": quant_method.value})
            return p

        block, tensor = FusedMoeWeightScaleSupported.BLOCK, FusedMoeWeightScaleSupported.TENSOR
        nan = float("nan")
        add(f"w13_{nm.weight}", (num_experts, 2 * i, h // 2), torch.uint8, 0)
        add(f"w2_{nm.weight}", (num_experts, h, i // 2), torch.uint8, 0)
        add(f"w13_{nm.block_scale}", (num_experts, 2 * i, h // 16), torch.float8_e4m3fn, nan, block)
        add(f"w2_{nm.block_scale}", (num_experts, h, i // 16), torch.float8_e4m3fn, nan, block)
        add(f"w13_{nm.weight_global}", (num_experts, 2), torch.float32, nan, tensor)
        add(f"w2_{nm.weight_global}", (num_experts,), torch.float32, nan, tensor)
        # One activation scale per expert and shard. compressed-tensors' "input_global_scale" takes
        # FusedMoE's per-tensor path (gate -> [:, 0], up -> [:, 1]); ModelOpt's "input_scale" takes
        # its one-value-per-expert path, so gate and up are given views of their own column.
        a13 = torch.full((num_experts, 2), nan, dtype=torch.float32)
        views = None
        if "input_scale" in nm.input_global:
            views = {s: torch.nn.Parameter(a13[:, j], requires_grad=False) for j, s in enumerate(("w1", "w3"))}
        p13 = add(f"w13_{nm.input_global}", (num_experts, 2), torch.float32, nan, tensor, views)
        p13.data = a13
        add(f"w2_{nm.input_global}", (num_experts,), torch.float32, nan, tensor)

    def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config) -> None:
        from sglang.srt.layers.moe.utils import get_moe_a2a_backend, get_moe_runner_backend

        prefix = getattr(layer, "layer_name", "experts")
        runner, a2a = get_moe_runner_backend(), get_moe_a2a_backend()
        if not (runner.is_auto() or runner.is_triton()):
            raise NotImplementedError(f"{prefix}: --quantization nvfp4 runs its own MoE kernels; leave "
                                      f"--moe-runner-backend at auto (got {runner.value!r})")
        if not a2a.is_none():
            raise NotImplementedError(f"{prefix}: --quantization nvfp4 does not support --moe-a2a-backend "
                                      f"{a2a.value!r} yet (DeepEP/all-to-all dispatch); use tensor or expert "
                                      "parallelism without it")
        self.moe_runner_config = moe_runner_config

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        finish_moe(layer, getattr(layer, "layer_name", "experts"), self.fmt, layer.nvfp4_act_dtype,
                   self.moe_runner_config.top_k, warmup_tokens=max_forward_tokens())

    def apply(self, layer: torch.nn.Module, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
        from sglang.srt.layers.moe.topk import TopKOutputChecker

        topk_output = getattr(dispatch_output, "topk_output", None)
        if not dispatch_output.format.is_standard() or not TopKOutputChecker.format_is_standard(topk_output):
            raise NotImplementedError(f"{getattr(layer, 'layer_name', 'experts')}: nvfp4 MoE takes SGLang's standard "
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
