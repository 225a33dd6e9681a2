"""What the vLLM and SGLang adapters do alike (no engine imports here).

Parameter names per checkpoint format and the tables of parameters a layer creates, the one layer
attribute that names a layer in messages, the checks both adapters run (model folder when the
config is read, layer sizes when weights are created), module exclusion, the config methods both
engines ask for, and turning loaded parameters into the engine-neutral layer after loading
(validation and format conventions live in :mod:`nvfp4_plugin.checkpoints`).

An engine's classes are its own base class plus a mixin from here or :mod:`.methods`; the adapter
keeps only what differs between the engines (parameter classes, layer types, batch limits, apply).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from ..checkpoints import (CheckpointError, Nvfp4QuantConfig, normalize_input_scale, normalize_linear,
                           parse_quant_config, validate_checkpoint)
from ..checkpoints import formats as F
from ..checkpoints.errors import problem
from ..weights import Nvfp4Weight

__all__ = ["CheckpointError", "DEFAULT_PACKED_MODULES", "NAME", "Nvfp4ConfigMethods", "Nvfp4QuantConfig", "ParamSpec",
           "TensorNames", "build_weight", "check_linear_sizes", "check_moe_sizes", "finish_linear", "finish_moe",
           "input_scales", "is_layer_excluded", "layer_prefix", "layer_tensor_names", "linear_parameters",
           "local_expert_ids", "log_moe_path", "moe_parameters", "override_for", "parse_quant_config",
           "refuse_unsupported", "register_prepared", "validate_model_dir"]

logger = logging.getLogger("nvfp4_plugin")

#: The ``--quantization`` name in both engines.
NAME = "nvfp4"

#: Fused modules and their checkpoint shards, for models that declare no mapping (Llama in SGLang):
#: an exclude entry naming a shard (``...q_proj``) must exclude the fused layer (``...qkv_proj``).
#: A model's own mapping wins per key.
DEFAULT_PACKED_MODULES = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
    "fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"],
}

#: The layer attribute holding the checkpoint prefix (``model.layers.0.self_attn.qkv_proj``) that
#: messages and loaders name a layer by; set when the engine asks for the layer's quant method.
PREFIX_ATTR = "nvfp4_prefix"


def layer_prefix(layer: torch.nn.Module) -> str:
    return getattr(layer, PREFIX_ATTR, None) or type(layer).__name__


# -- names and parameter tables --------------------------------------------------------------------

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


@dataclass
class ParamSpec:
    """One parameter a layer creates before loading: its name, initial data and checkpoint role
    (``checkpoints.formats.ROLE_*``: the engines pick their parameter class or loader path by it).

    ``suffix`` is the checkpoint tensor name it receives (``name`` less the ``w13_``/``w2_`` prefix
    of MoE parameters); ``shard_views`` maps an MoE shard id to a view of the data (see
    :func:`moe_parameters`)."""

    name: str
    data: torch.Tensor
    role: str
    suffix: str
    shard_views: dict | None = None


def e4m3_bytes(shape, byte: int) -> torch.Tensor:
    """float8_e4m3fn tensor of one repeated bit pattern (0x00: zero, 0x7F: NaN = "not loaded"), made
    through uint8 so no float8 fill kernel is needed on the device."""
    return torch.full(shape, byte, dtype=torch.uint8).view(torch.float8_e4m3fn)


def _nan(shape) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.float32)


def linear_parameters(names: TensorNames, n: int, k: int, num_shards: int) -> list[ParamSpec]:
    """A linear layer of ``num_shards`` fused shards, ``n`` rows in all, input size ``k``.

    Weights and block scales start at zero: rows an engine never writes (the vocabulary padding of
    an lm_head) must decode to 0; the loaders record which shards arrived. One scalar per shard for
    the global scales, NaN until loaded (weight-only checkpoints have no input scales)."""
    return [ParamSpec(names.weight, torch.zeros(n, k // 2, dtype=torch.uint8), F.ROLE_WEIGHT, names.weight),
            ParamSpec(names.block_scale, e4m3_bytes((n, k // 16), 0x00), F.ROLE_BLOCK_SCALE, names.block_scale),
            ParamSpec(names.weight_global, _nan((num_shards,)), F.ROLE_GLOBAL_SCALE, names.weight_global),
            ParamSpec(names.input_global, _nan((num_shards,)), F.ROLE_INPUT_SCALE, names.input_global)]


def moe_parameters(names: TensorNames, num_experts: int, hidden: int, intermediate: int) -> list[ParamSpec]:
    """``w13_*`` (gate and up stacked, ``2 * intermediate`` rows) and ``w2_*`` of ``num_experts`` experts.

    Block scales start NaN (0x7F) so an expert the checkpoint lacks fails by name after loading.
    One activation scale per expert and shard for w13: compressed-tensors' ``input_global_scale``
    takes the engines' per-tensor path (gate -> ``[:, 0]``, up -> ``[:, 1]``); ModelOpt's
    ``input_scale`` takes their one-value-per-expert path, where the last of gate/up would win, so
    gate (``w1``) and up (``w3``) are given views of their own column."""
    e, h, i = num_experts, hidden, intermediate
    a13 = _nan((e, 2))
    views = None
    if "input_scale" in names.input_global:
        views = {s: torch.nn.Parameter(a13[:, j], requires_grad=False) for j, s in enumerate(("w1", "w3"))}
    table = [(names.weight, F.ROLE_WEIGHT, torch.zeros(e, 2 * i, h // 2, dtype=torch.uint8),
              torch.zeros(e, h, i // 2, dtype=torch.uint8)),
             (names.block_scale, F.ROLE_BLOCK_SCALE, e4m3_bytes((e, 2 * i, h // 16), 0x7F),
              e4m3_bytes((e, h, i // 16), 0x7F)),
             (names.weight_global, F.ROLE_GLOBAL_SCALE, _nan((e, 2)), _nan((e,))),
             (names.input_global, F.ROLE_INPUT_SCALE, a13, _nan((e,)))]
    out = []
    for suffix, role, w13, w2 in table:
        out.append(ParamSpec(f"w13_{suffix}", w13, role, suffix, views if w13 is a13 else None))
        out.append(ParamSpec(f"w2_{suffix}", w2, role, suffix))
    return out


# -- checks ----------------------------------------------------------------------------------------

_VALIDATED: set[str] = set()


def validate_model_dir(path) -> None:
    """Check a local checkpoint folder on the CPU when the engine reads its config, before any GPU
    allocation: headers, dtypes, shapes and every scalar scale, so a broken file fails naming the
    file and tensor. Block-scale values are checked per layer as they are loaded. Once per folder
    and process; anything that is not a local folder (a hub id) is left to the loaders."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        return
    key = os.path.realpath(path)
    if key not in _VALIDATED:
        validate_checkpoint(path, check_block_scales=False)
        _VALIDATED.add(key)


def check_linear_sizes(prefix: str, input_size_per_partition: int) -> None:
    if input_size_per_partition % 16:
        raise ValueError(f"{prefix}: NVFP4 needs the input size per partition to be a multiple of 16, got "
                         f"{input_size_per_partition}")


def check_moe_sizes(prefix: str, hidden: int, intermediate_per_partition: int) -> None:
    if hidden % 16 or intermediate_per_partition % 16:
        raise ValueError(f"{prefix}: nvfp4 MoE needs the hidden size ({hidden}) and the intermediate size per "
                         f"partition ({intermediate_per_partition}) to be multiples of 16")


def refuse_unsupported(prefix: str, settings: dict) -> None:
    """``settings``: name -> (the layer's value, the one value we support)."""
    bad = {k: got for k, (got, want) in settings.items() if got != want}
    if bad:
        raise NotImplementedError(f"{prefix}: nvfp4 MoE supports SiLU-and-mul experts without bias, clamping or "
                                  f"router weights on the input; this layer has {bad}")


def is_layer_excluded(cfg: Nvfp4QuantConfig, prefix: str, packed_modules_mapping=None) -> bool:
    """Exclusion of an engine module; fused modules (qkv_proj, gate_up_proj) follow their shards."""
    proj = prefix.split(".")[-1]
    shards = (packed_modules_mapping or {}).get(proj)
    if not shards or cfg.is_excluded(prefix):
        return cfg.is_excluded(prefix)
    return cfg.is_fused_excluded(prefix, [prefix[: -len(proj)] + s for s in shards])


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
        raise ValueError(f"--quantization {name}: the checkpoint is not an NVFP4 checkpoint we can load: "
                         f"{exc}") from exc
    return name


# -- the config methods both engines ask for ---------------------------------------------------------

class Nvfp4ConfigMethods:
    """The engine-neutral half of both engines' ``QuantizationConfig`` subclasses (list it first
    among the bases). The engine half sets ``spec`` and ``packed_modules_mapping`` and answers
    ``get_quant_method`` through :meth:`quant_method_for`."""

    #: The engine's name, in messages.
    engine: str = "?"
    spec: Nvfp4QuantConfig
    packed_modules_mapping: dict

    @staticmethod
    def max_tokens() -> int | None:
        """The most tokens one forward of the engine carries (None: unknown); the layers compile
        their kernels for that many after loading."""
        return None

    @classmethod
    def get_name(cls) -> str:
        return NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 90  # Hopper: our FP4-weight kernels; other GPUs: the reference backend (nvfp4-plugin info --capability)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["hf_quant_config.json"]

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        # Without this, the engine's ModelOpt override turns "--quantization nvfp4" into "modelopt_fp4".
        # We only claim a checkpoint when asked to: without the flag the engine keeps its built-in path.
        return override_for(user_quant, NAME, hf_quant_cfg)

    @classmethod
    def parse_spec(cls, config: dict) -> Nvfp4QuantConfig:
        spec = parse_quant_config(config)
        if spec.kv_cache_quant_algo:
            logger.warning("nvfp4_plugin: the checkpoint declares a %s KV cache; nvfp4 does not quantize the KV "
                           "cache (its k/v scales are not loaded); choose one with --kv-cache-dtype",
                           spec.kv_cache_quant_algo)
        logger.info("nvfp4_plugin: %s quantization %r: %s checkpoint, %s, %d excluded module pattern(s)",
                    cls.engine, NAME, spec.format, spec.quant_algo, len(spec.exclude_modules))
        return spec

    def fused_shards(self) -> dict:
        """Fused module -> its checkpoint shards: the model's mapping over :data:`DEFAULT_PACKED_MODULES`
        (read at each call: engines fill the model's mapping in after building the config)."""
        return {**DEFAULT_PACKED_MODULES, **(self.packed_modules_mapping or {})}

    def is_layer_excluded(self, prefix: str) -> bool:
        return is_layer_excluded(self.spec, prefix, self.fused_shards())

    def map_excluded_names(self, hf_to_engine_mapper) -> None:
        """Exclude patterns in the engine's module names too. The checkpoint's own names stay:
        wildcard patterns do not always survive a name mapper."""
        mapped = hf_to_engine_mapper.apply_list(list(self.spec.exclude_modules))
        merged = tuple(dict.fromkeys([*self.spec.exclude_modules, *mapped]))
        self.spec = dataclasses.replace(self.spec, exclude_modules=merged)

    def quant_method_for(self, layer: torch.nn.Module, prefix: str, kind: str | None, *, linear, moe,
                         unquantized_linear):
        """``kind``: "linear", "moe" or None (attention, embeddings: the engine's default).
        ``linear`` / ``moe`` / ``unquantized_linear``: factories of the engine's methods."""
        if kind is None:
            return None
        if self.is_layer_excluded(prefix):
            return unquantized_linear() if kind == "linear" else None  # None: the engine's unquantized MoE
        setattr(layer, PREFIX_ATTR, prefix)
        return linear() if kind == "linear" else moe()


# -- after loading: the engine-neutral layer -----------------------------------------------------------

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


# ------------------------------------------------------------------------------------------------
# Expert parallelism: what the engines hand the MoE method, in the layer's vocabulary
# ------------------------------------------------------------------------------------------------

def local_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Global top-k expert ids -> this rank's expert ids through ``expert_map`` (``[E_global]``, the local
    id of each expert or -1 where another rank holds it); experts of other ranks and ids that are already
    -1 (dropped padding) become -1, which :class:`~nvfp4_plugin.layers.Nvfp4FusedMoE` never computes.
    ``expert_map`` None: the ids are already local. On the device, no host sync."""
    if expert_map is None:
        return topk_ids
    local = expert_map[topk_ids.clamp(min=0).long()]          # (a raw -1 would index the last expert)
    return torch.where(topk_ids >= 0, local, torch.full_like(local, -1))


_PATHS_LOGGED: set = set()


def log_moe_path(engine: str, prefix: str, path: str) -> None:
    """One INFO line per process and (engine, path): which expert-parallel format the engine hands our
    MoE method and which of our paths consumes it (``prefix``: the first layer that took it)."""
    if (engine, path) in _PATHS_LOGGED:
        return
    _PATHS_LOGGED.add((engine, path))
    logger.info("nvfp4_plugin: %s MoE %s (first layer: %s)", engine, path, prefix)
