"""Engine-neutral helpers shared by the vLLM and SGLang adapters (no engine imports here).

Tensor names per checkpoint format, conversion of the loaded per-shard scalars to the canonical
encode scales, validation with messages that name the layer and tensor, and registration of a
backend's prepared tensors as module parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..weights import Nvfp4Weight


@dataclass(frozen=True)
class TensorNames:
    weight: str
    block_scale: str
    weight_global: str
    input_global: str
    #: ModelOpt stores decode scales (amax/2688); compressed-tensors stores encode scales (2688/amax)
    global_is_decode: bool


_NAMES = {
    "modelopt": TensorNames("weight", "weight_scale", "weight_scale_2", "input_scale", True),
    "compressed-tensors": TensorNames("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale", False),
}


def layer_tensor_names(fmt: str) -> TensorNames:
    if fmt not in _NAMES:
        raise ValueError(f"checkpoint format: expected one of {sorted(_NAMES)}, got {fmt!r}")
    return _NAMES[fmt]


class CheckpointError(ValueError):
    """A checkpoint tensor is missing or invalid; the message names the layer and tensor."""


def scalar_scales(prefix: str, names: TensorNames, loaded: torch.Tensor, *, encode: bool = True,
                  optional: bool = False, which: str = "input") -> torch.Tensor | None:
    """Loaded per-shard global scales -> encode scales (fp32), validated.

    NaN entries were never loaded (the parameter is created NaN-filled). ``optional``: all-NaN
    means "absent" (weight-only checkpoints) and gives None.
    """
    name = names.input_global if which == "input" else names.weight_global
    vals = loaded.detach().float()
    missing = torch.isnan(vals)
    if missing.all() and optional:
        return None
    if missing.any():
        raise CheckpointError(f"{prefix}.{name}: missing for shard(s) {missing.nonzero().flatten().tolist()} "
                              f"of a fused layer (got {vals.tolist()})")
    if not torch.isfinite(vals).all() or (vals <= 0).any():
        raise CheckpointError(f"{prefix}.{name}: global scales must be finite and > 0, got {vals.flatten().tolist()}")
    if names.global_is_decode and encode:
        vals = 1.0 / vals
    return vals


def build_weight(prefix: str, names: TensorNames, packed: torch.Tensor, block_scale: torch.Tensor,
                 shard_globals: torch.Tensor, shard_sizes) -> Nvfp4Weight:
    """Validate loaded tensors and build the canonical weight (per-row encode global scales)."""
    if packed.dtype != torch.uint8:
        raise CheckpointError(f"{prefix}.{names.weight}: expected dtype uint8 (packed E2M1), got {packed.dtype}")
    if block_scale.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"{prefix}.{names.block_scale}: expected dtype float8_e4m3fn, got {block_scale.dtype}")
    bs = block_scale.view(torch.uint8)
    bad = ((bs & 0x7F) == 0x7F) | (((bs & 0x80) != 0) & (bs != 0x80))
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        raise CheckpointError(f"{prefix}.{names.block_scale}: block scales must be finite and >= 0, "
                              f"got {block_scale[tuple(idx)].float().item()} at {idx}")
    gs = scalar_scales(prefix, names, shard_globals, which="weight")
    return Nvfp4Weight.from_shards(packed, block_scale, gs, list(shard_sizes))


def register_prepared(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Attach a backend's prepared tensors to the engine's module as frozen parameters."""
    for key, t in tensors.items():
        module.register_parameter(f"nvfp4_{key}", torch.nn.Parameter(t, requires_grad=False))


def prepared_tensors(module: torch.nn.Module, template: dict) -> dict[str, torch.Tensor]:
    return {key: getattr(module, f"nvfp4_{key}") for key in template}


# ----------------------------------------------------------------------------------------------
# Quantization config parsing (the engine-facing view of a checkpoint's quantization_config)
# ----------------------------------------------------------------------------------------------

import fnmatch  # noqa: E402
import re  # noqa: E402
from collections.abc import Mapping  # noqa: E402


@dataclass(frozen=True)
class QuantSpec:
    format: str              # "modelopt" | "compressed-tensors"
    weight_only: bool        # W4A16_NVFP4 / no input_activations
    group_size: int
    exclude: tuple[str, ...]  # ModelOpt wildcards, or compressed-tensors names / "re:" regexes

    def with_excludes(self, exclude) -> QuantSpec:
        return QuantSpec(self.format, self.weight_only, self.group_size, tuple(exclude))

    def _match(self, name: str) -> bool:
        for pat in self.exclude:
            if pat.startswith("re:"):
                if re.match(pat[3:], name):
                    return True
            elif name == pat or fnmatch.fnmatchcase(name, pat):
                return True
        return False

    def is_excluded(self, prefix: str, packed_modules_mapping: Mapping[str, list[str]] | None = None) -> bool:
        """Whether the module at ``prefix`` stays unquantized; fused modules follow their shards."""
        proj = prefix.split(".")[-1]
        shards = (packed_modules_mapping or {}).get(proj)
        if not shards or self._match(prefix):
            return self._match(prefix)
        flags = {s: self._match(prefix[: -len(proj)] + s) for s in shards}
        if len(set(flags.values())) > 1:
            raise ValueError(f"{prefix}: the shards of a fused module must all be quantized or all excluded, "
                             f"got {flags}")
        return next(iter(flags.values()))


def is_nvfp4_quant_config(cfg: Mapping | None) -> bool:
    try:
        parse_quant_config(cfg)
        return True
    except (ValueError, TypeError, KeyError):
        return False


def parse_quant_config(cfg: Mapping | None) -> QuantSpec:
    """ModelOpt (``hf_quant_config.json`` nested, or ``quantization_config`` flat) or compressed-tensors
    ``nvfp4-pack-quantized`` -> :class:`QuantSpec`. Errors say which key is wrong."""
    if not isinstance(cfg, Mapping):
        raise TypeError(f"quantization config: expected a dict, got {type(cfg).__name__}")
    method = str(cfg.get("quant_method", "")).lower()
    if "quantization" in cfg or method.startswith("modelopt"):
        q = cfg.get("quantization", cfg)
        algo = str(q.get("quant_algo", "")).upper()
        if algo not in ("NVFP4", "W4A16_NVFP4"):
            raise ValueError(f"quant_algo: expected NVFP4 or W4A16_NVFP4, got {q.get('quant_algo')!r}")
        group = int(q.get("group_size", 16) or 16)
        exclude = q.get("exclude_modules", q.get("ignore", [])) or []
        spec = QuantSpec("modelopt", algo == "W4A16_NVFP4", group, tuple(exclude))
    elif method == "compressed-tensors":
        if cfg.get("format") != "nvfp4-pack-quantized":
            raise ValueError(f"format: expected 'nvfp4-pack-quantized', got {cfg.get('format')!r}")
        groups = cfg.get("config_groups") or {}
        if not groups:
            raise ValueError("config_groups: expected at least one group")
        weight_only = True
        for gname, g in groups.items():
            w = g.get("weights") or {}
            if (w.get("num_bits"), w.get("type"), w.get("strategy")) != (4, "float", "tensor_group"):
                raise ValueError(f"config_groups.{gname}.weights: expected num_bits 4, type float, strategy "
                                 f"tensor_group, got {w}")
            group = int(w.get("group_size", 16))
            weight_only = weight_only and not g.get("input_activations")
        spec = QuantSpec("compressed-tensors", weight_only, group, tuple(cfg.get("ignore", []) or []))
    else:
        raise ValueError(f"quant_method: expected 'modelopt' or 'compressed-tensors', got {cfg.get('quant_method')!r}")
    if spec.group_size != 16:
        raise ValueError(f"group_size: NVFP4 uses 16, got {spec.group_size}")
    return spec
