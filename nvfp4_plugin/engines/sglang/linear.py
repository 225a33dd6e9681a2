"""SGLang linear method: SGLang's parameter classes and (v2) loaders, our engine-neutral Nvfp4Linear.

Works for every SGLang linear layer (ReplicatedLinear, Column/Row/MergedColumn/QKVParallelLinear)
and for a quantized ParallelLMHead. Fused layers (q/k/v, gate/up) keep one global scale per shard
(Nvfp4Weight per-row scales): shards quantized with different global scales stay exact.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.parameter import ModelWeightParameter, PerTensorScaleParameter
from sglang.srt.layers.quantization.base_config import LinearMethodBase

from ..common import finish_linear, layer_tensor_names
from .loading import check_all_loaded, e4m3_bytes, linear_loader


def max_forward_tokens() -> int | None:
    """The most tokens one SGLang forward carries (prefill chunk or limit, decode batch), None if unknown."""
    from sglang.srt.server_args import get_global_server_args

    try:
        args = get_global_server_args()
    except (AttributeError, AssertionError, ValueError):
        return None
    sizes = [getattr(args, a, None) for a in ("chunked_prefill_size", "max_prefill_tokens", "cuda_graph_max_bs")]
    sizes = [s for s in sizes if isinstance(s, int) and s > 0]
    return max(sizes) if sizes else None


class Nvfp4SglangLinearMethod(LinearMethodBase):
    def __init__(self, quant_config):
        self.quant_config = quant_config
        self.fmt = quant_config.spec.format
        self.names = layer_tensor_names(self.fmt)

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        prefix = getattr(layer, "nvfp4_prefix", type(layer).__name__)
        if input_size_per_partition % 16:
            raise ValueError(f"{prefix}: NVFP4 needs the input size per partition to be a multiple of 16, got "
                             f"{input_size_per_partition}")
        n, k = sum(output_partition_sizes), input_size_per_partition
        num_shards = len(output_partition_sizes)
        layer.logical_widths = list(output_partition_sizes)
        layer.nvfp4_act_dtype = params_dtype
        layer.nvfp4_loaded = set()
        nm, cfg = self.names, self.quant_config

        def loader(suffix):
            return linear_loader(layer, extra_weight_attrs["weight_loader"], cfg.spec, cfg.packed_modules_mapping,
                                 suffix, num_shards)

        # zeros, not empty: rows SGLang never writes (the vocab padding of an lm_head) must decode to 0
        layer.register_parameter(nm.weight, ModelWeightParameter(
            data=torch.zeros(n, k // 2, dtype=torch.uint8), input_dim=1, output_dim=0,
            weight_loader=loader(nm.weight)))
        layer.register_parameter(nm.block_scale, ModelWeightParameter(
            data=e4m3_bytes((n, k // 16), 0x00), input_dim=1, output_dim=0,
            weight_loader=loader(nm.block_scale)))
        # one scalar per fused shard; NaN marks "not in the checkpoint" (weight-only checkpoints)
        for name in (nm.weight_global, nm.input_global):
            layer.register_parameter(name, PerTensorScaleParameter(
                data=torch.full((num_shards,), float("nan"), dtype=torch.float32), weight_loader=loader(name)))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        nm = self.names
        prefix = getattr(layer, "nvfp4_prefix", type(layer).__name__)
        widths = layer.logical_widths
        check_all_loaded(layer, (nm.weight, nm.block_scale), len(widths), self.quant_config.packed_modules_mapping)
        finish_linear(layer, prefix, self.fmt, widths, layer.nvfp4_act_dtype, warmup_tokens=max_forward_tokens())
        del layer.nvfp4_loaded

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return layer.nvfp4_core(x, bias)
