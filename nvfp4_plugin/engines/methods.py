"""The engine-neutral halves of both engines' linear and fused-MoE quant methods (no engine imports).

An engine's method class lists one of these first among its bases, then the engine's own base
class, and supplies what differs: its parameter classes, the MoE settings it refuses, its MoE sizes
and the MoE ``apply``; the engine's name and batch limit come from its config
(:class:`.common.Nvfp4ConfigMethods`). Creating the parameters (the tables of :mod:`.common`),
wrapping the engine's loaders in the checked ones of :mod:`.loading` and building the
engine-neutral layer after loading happen here, once for both engines.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..checkpoints import formats as F
from .common import (check_linear_sizes, check_moe_sizes, finish_linear, finish_moe, layer_prefix, layer_tensor_names,
                     linear_parameters, moe_parameters, refuse_unsupported)
from .loading import check_all_loaded, expert_loader, linear_loader


class _Method:
    def __init__(self, quant_config, *engine_args):
        super().__init__(*engine_args)
        self.quant_config = quant_config
        self.fmt = quant_config.spec.format
        self.names = layer_tensor_names(self.fmt)
        self.engine = quant_config.engine


class Nvfp4LinearMethod(_Method):
    """``weight_param`` / ``scale_param``: the engine's parameter classes for the packed weight and its
    block scales (``ModelWeightParameter``) and for the per-shard scalars (``PerTensorScaleParameter``)."""

    weight_param: ClassVar[type]
    scale_param: ClassVar[type]

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        check_linear_sizes(layer_prefix(layer), input_size_per_partition)
        n, k = sum(output_partition_sizes), input_size_per_partition
        num_shards = len(output_partition_sizes)
        layer.logical_widths = list(output_partition_sizes)
        layer.nvfp4_act_dtype = params_dtype
        layer.nvfp4_loaded = set()
        cfg = self.quant_config
        for p in linear_parameters(self.names, n, k, num_shards):
            loader = linear_loader(layer, extra_weight_attrs["weight_loader"], cfg.spec, self.names, cfg.fused_shards(),
                                   p.name, num_shards, self.engine)
            if p.role in (F.ROLE_WEIGHT, F.ROLE_BLOCK_SCALE):
                param = self.weight_param(data=p.data, input_dim=1, output_dim=0, weight_loader=loader)
            else:
                param = self.scale_param(data=p.data, weight_loader=loader)
            layer.register_parameter(p.name, param)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        nm, widths = self.names, layer.logical_widths
        check_all_loaded(layer, (nm.weight, nm.block_scale), len(widths), self.quant_config.fused_shards())
        finish_linear(layer, layer_prefix(layer), self.fmt, widths, layer.nvfp4_act_dtype,
                      warmup_tokens=self.quant_config.max_tokens())
        del layer.nvfp4_loaded

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return layer.nvfp4_core(x, bias)


class Nvfp4FusedMoEMethod(_Method):
    """``scale_kinds``: the engine's ``FusedMoeWeightScaleSupported`` (its loader dispatches scale
    parameters on their ``quant_method`` attribute: block scales BLOCK, per-expert scalars TENSOR)."""

    scale_kinds: ClassVar[type]

    def unsupported_settings(self, layer: torch.nn.Module, extra_weight_attrs: dict) -> dict:
        """Setting name -> (the layer's value, the one value nvfp4 MoE supports)."""
        raise NotImplementedError

    def full_sizes(self, layer: torch.nn.Module) -> tuple[int, int]:
        """The layer's hidden and intermediate sizes before TP sharding."""
        raise NotImplementedError

    def top_k(self, layer: torch.nn.Module) -> int:
        raise NotImplementedError

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs):
        prefix = layer_prefix(layer)
        refuse_unsupported(prefix, self.unsupported_settings(layer, extra_weight_attrs))
        check_moe_sizes(prefix, hidden_size, intermediate_size_per_partition)
        layer.nvfp4_act_dtype = params_dtype
        load, spec = extra_weight_attrs["weight_loader"], self.quant_config.spec
        kinds = {F.ROLE_BLOCK_SCALE: self.scale_kinds.BLOCK.value, F.ROLE_GLOBAL_SCALE: self.scale_kinds.TENSOR.value,
                 F.ROLE_INPUT_SCALE: self.scale_kinds.TENSOR.value}
        for p in moe_parameters(self.names, num_experts, hidden_size, intermediate_size_per_partition):
            param = torch.nn.Parameter(p.data, requires_grad=False)
            layer.register_parameter(p.name, param)
            # the attributes the engines' set_weight_attrs would set (their TPU-only extras aside)
            param.weight_loader = expert_loader(layer, load, spec, self.names, p.suffix, self.engine,
                                                lambda: self.full_sizes(layer), p.shard_views)
            if p.role in kinds:
                param.quant_method = kinds[p.role]

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        finish_moe(layer, layer_prefix(layer), self.fmt, layer.nvfp4_act_dtype, self.top_k(layer),
                   warmup_tokens=self.quant_config.max_tokens())
