"""vLLM linear method: vLLM's parameter classes and loaders, our engine-neutral Nvfp4Linear."""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.parameter import ModelWeightParameter, PerTensorScaleParameter

from ..common import finish_linear, layer_tensor_names


def max_batched_tokens() -> int | None:
    """The most tokens one forward of this engine carries (None outside a vLLM config context)."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    return getattr(getattr(cfg, "scheduler_config", None), "max_num_batched_tokens", None)


class Nvfp4VllmLinearMethod(LinearMethodBase):
    def __init__(self, quant_config):
        self.quant_config = quant_config
        self.fmt = quant_config.spec.format
        self.names = layer_tensor_names(self.fmt)

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        if input_size_per_partition % 16:
            raise ValueError(f"{layer.__class__.__name__}: NVFP4 needs the input size per partition to be a multiple "
                             f"of 16, got {input_size_per_partition}")
        n = sum(output_partition_sizes)
        k = input_size_per_partition
        loader = extra_weight_attrs["weight_loader"]
        layer.logical_widths = list(output_partition_sizes)
        layer.nvfp4_act_dtype = params_dtype
        nm = self.names
        layer.register_parameter(nm.weight, ModelWeightParameter(
            data=torch.empty(n, k // 2, dtype=torch.uint8), input_dim=1, output_dim=0, weight_loader=loader))
        layer.register_parameter(nm.block_scale, ModelWeightParameter(
            data=torch.empty(n, k // 16, dtype=torch.float8_e4m3fn), input_dim=1, output_dim=0, weight_loader=loader))
        # one scalar per fused shard; NaN marks "not in the checkpoint" (weight-only checkpoints)
        for name in (nm.weight_global, nm.input_global):
            layer.register_parameter(name, PerTensorScaleParameter(
                data=torch.full((len(output_partition_sizes),), float("nan"), dtype=torch.float32),
                weight_loader=loader))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        finish_linear(layer, getattr(layer, "prefix", layer.__class__.__name__), self.fmt, layer.logical_widths,
                      layer.nvfp4_act_dtype, warmup_tokens=max_batched_tokens())

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return layer.nvfp4_core(x, bias)
