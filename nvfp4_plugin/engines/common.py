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


#: Token count the layers compile their kernels for when the engine's own limit is unknown.
DEFAULT_WARMUP_TOKENS = 16384


def finish_linear(module: torch.nn.Module, prefix: str, fmt: str, shard_sizes, act_dtype: torch.dtype,
                  warmup_tokens: int | None = None) -> None:
    """After loading: the module's checkpoint parameters (names of ``fmt``) -> Nvfp4Linear, attached
    to the module; the checkpoint parameters are removed. Then the layer's kernels are compiled for
    forwards of up to ``warmup_tokens`` tokens (the engine's batch limit), with and without the
    module's bias (engines pass it on some ranks only)."""
    from ..layers import Nvfp4Linear

    nm = layer_tensor_names(fmt)
    weight = build_weight(prefix, fmt, getattr(module, nm.weight).data, getattr(module, nm.block_scale).data,
                          getattr(module, nm.weight_global).data, shard_sizes)
    # one activation scale for the fused input: the smallest encode scale (largest amax) never saturates
    input_gs = input_scales(prefix, fmt, getattr(module, nm.input_global).data, num_shards=len(shard_sizes))
    if input_gs is not None:
        input_gs = input_gs.reshape(1).to(weight.packed.device)
    core = Nvfp4Linear(weight, input_gs, act_dtype=act_dtype)
    for name in (nm.weight, nm.block_scale, nm.weight_global, nm.input_global):
        delattr(module, name)
    register_prepared(module, core)
    bias = getattr(module, "bias", None)
    for b in (None, bias) if isinstance(bias, torch.Tensor) else (None,):
        core.warmup(warmup_tokens or DEFAULT_WARMUP_TOKENS, b)


def finish_moe(module: torch.nn.Module, prefix: str, fmt: str, act_dtype: torch.dtype, top_k: int,
               warmup_tokens: int | None = None) -> None:
    """After loading: ``w13_*`` / ``w2_*`` checkpoint parameters -> Nvfp4FusedMoE on the module, its
    kernels compiled for up to ``warmup_tokens`` tokens routed to ``top_k`` experts each.

    w13 global scales are per expert and shard ``[E, 2]``; activation scales per expert (``[E]``) or
    per expert and shard (``[E, 2]``: gate and up read the same input, so the smallest encode
    scale is used)."""
    from ..layers import Nvfp4FusedMoE

    nm = layer_tensor_names(fmt)
    get = lambda part, name: getattr(module, f"{part}_{name}").data  # noqa: E731
    i2 = get("w13", nm.weight).shape[1]
    w13 = build_weight(f"{prefix}.w13", fmt, get("w13", nm.weight), get("w13", nm.block_scale),
                       get("w13", nm.weight_global), [i2 // 2, i2 // 2])
    w2 = build_weight(f"{prefix}.w2", fmt, get("w2", nm.weight), get("w2", nm.block_scale),
                      get("w2", nm.weight_global)[:, None], [w13.k])
    a13_loaded = get("w13", nm.input_global)
    a13 = input_scales(f"{prefix}.w13", fmt, a13_loaded, num_shards=2 if a13_loaded.dim() == 2 else None)
    a2 = input_scales(f"{prefix}.w2", fmt, get("w2", nm.input_global))
    if (a13 is None) != (a2 is None):
        raise CheckpointError(problem(None, prefix, "input scales present for only one of w13/w2 "
                                                     f"(w13: {a13 is not None}, w2: {a2 is not None})"))
    if a13 is not None:
        a13, a2 = a13.to(w13.packed.device), a2.to(w13.packed.device)
    core = Nvfp4FusedMoE(w13, w2, a13, a2, act_dtype=act_dtype)
    for part in ("w13", "w2"):
        for name in (nm.weight, nm.block_scale, nm.weight_global, nm.input_global):
            delattr(module, f"{part}_{name}")
    register_prepared(module, core)
    core.warmup(warmup_tokens or DEFAULT_WARMUP_TOKENS, top_k)


def override_for(engine_flag: str, name: str, hf_quant_cfg) -> str | None:
    """The engines' override hook: ``name`` when the user asked for it and the checkpoint is NVFP4,
    None when the user asked for something else; a clear error for a non-NVFP4 checkpoint."""
    if engine_flag != name:
        return None
    if hf_quant_cfg is None:
        raise ValueError(f"--quantization {name}: the checkpoint has no quantization_config / hf_quant_config.json; "
                         "quantize it first with `nvfp4-plugin quantize SRC DST`")
    try:
        parse_quant_config(hf_quant_cfg)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--quantization {name}: the checkpoint is not an NVFP4 checkpoint we can load: {exc}") from exc
    return name
