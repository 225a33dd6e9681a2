"""Engine-neutral helpers shared by the vLLM and SGLang adapters (no engine imports here).

Parameter names per checkpoint format, turning loaded parameters into the canonical weight and
encode scales (validation and format conventions live in :mod:`nvfp4_plugin.checkpoints`), module
exclusion for fused layers, and registration of a backend's prepared tensors as module parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checkpoints import CheckpointError, Nvfp4QuantConfig, normalize_input_scale, normalize_linear, parse_quant_config
from ..checkpoints import formats as F
from ..checkpoints.errors import problem
from ..weights import Nvfp4Weight

__all__ = ["CheckpointError", "Nvfp4QuantConfig", "TensorNames", "build_weight", "input_scales", "is_layer_excluded",
           "layer_tensor_names", "parse_quant_config", "register_prepared"]


@dataclass(frozen=True)
class TensorNames:
    """Parameter names of one checkpoint format (from :mod:`nvfp4_plugin.checkpoints.formats`)."""

    weight: str
    block_scale: str
    weight_global: str
    input_global: str


def layer_tensor_names(fmt: str) -> TensorNames:
    spec = F.spec(fmt)
    return TensorNames(*(spec.suffix(r) for r in (F.ROLE_WEIGHT, F.ROLE_BLOCK_SCALE, F.ROLE_GLOBAL_SCALE,
                                                   F.ROLE_INPUT_SCALE)))


def _loaded(prefix: str, name: str, vals: torch.Tensor, optional: bool) -> torch.Tensor | None:
    """Scale parameters are created NaN-filled: NaN means the checkpoint never provided the value."""
    missing = torch.isnan(vals.detach().float().cpu())
    if missing.all() and optional:
        return None
    if missing.any():
        raise CheckpointError(problem(None, f"{prefix}.{name}",
                                      f"missing in the checkpoint for shard(s)/expert(s) "
                                      f"{missing.nonzero().tolist()} of {tuple(vals.shape)}"))
    return vals


def input_scales(prefix: str, fmt: str, loaded: torch.Tensor, *, num_shards: int | None = None):
    """Loaded activation scales -> encode scales (validated), or None for weight-only checkpoints."""
    name = layer_tensor_names(fmt).input_global
    vals = _loaded(prefix, name, loaded, optional=True)
    if vals is None:
        return None
    return normalize_input_scale(vals, format=fmt, num_shards=num_shards, name=f"{prefix}.{name}")


def build_weight(prefix: str, fmt: str, packed: torch.Tensor, block_scale: torch.Tensor,
                 shard_globals: torch.Tensor, shard_sizes) -> Nvfp4Weight:
    """Validate loaded tensors and build the canonical weight (per-row encode global scales)."""
    _loaded(prefix, layer_tensor_names(fmt).weight_global, shard_globals, optional=False)
    return normalize_linear(packed, block_scale, shard_globals, format=fmt, shard_sizes=list(shard_sizes),
                            name=prefix)


def is_layer_excluded(cfg: Nvfp4QuantConfig, prefix: str, packed_modules_mapping=None) -> bool:
    """Exclusion of an engine module; fused modules (qkv_proj, gate_up_proj) follow their shards."""
    proj = prefix.split(".")[-1]
    shards = (packed_modules_mapping or {}).get(proj)
    if not shards or cfg.is_excluded(prefix):
        return cfg.is_excluded(prefix)
    return cfg.is_fused_excluded(prefix, [prefix[: -len(proj)] + s for s in shards])


def register_prepared(module: torch.nn.Module, core) -> None:
    """Attach a prepared layer's tensors to the engine's module as frozen parameters (memory
    accounting, device moves) and point the layer at those parameter objects."""
    params = {}
    for key, t in core.tensors.items():
        p = torch.nn.Parameter(t, requires_grad=False)
        module.register_parameter(f"nvfp4_{key}", p)
        params[key] = p
    core.use_tensors(params)
    module.nvfp4_core = core
