"""Detecting and parsing NVFP4 quantization configs (ModelOpt and compressed-tensors), and writing them.

Accepted inputs (what engines hand to a quantization config's ``from_config``, or what is on disk):

* ModelOpt ``hf_quant_config.json`` (nested): ``{"producer": {...}, "quantization": {"quant_algo":
  "NVFP4" | "W4A16_NVFP4", "kv_cache_quant_algo": null | "FP8", "group_size": 16,
  "exclude_modules": [...]}}``. ``exclude_modules`` are fnmatch wildcards (``"lm_head"``,
  ``"model.layers.*.mlp.gate"``, ``"model.visual*"``).
* ModelOpt flat ``config.json`` ``quantization_config``: ``{"quant_method": "modelopt", "quant_algo":
  ..., "ignore": [...], "config_groups": {...}, "kv_cache_scheme": ..., "producer": ...}``
  (``ignore`` plays the part of ``exclude_modules``; group size 16 unless ``group_size`` says so).
* compressed-tensors ``quantization_config``: ``{"quant_method": "compressed-tensors", "format":
  "nvfp4-pack-quantized", "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits":
  4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": true, "dynamic":
  false}, "input_activations": null | {... "dynamic": "local"}}}, "ignore": [names or "re:regex"]}``.
  A group may also be a preset name mapping to targets (``{"NVFP4": ["Linear"]}``, ``"NVFP4A16"``).
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from . import formats as F
from .errors import CheckpointError, ProblemCollector, problem

HF_QUANT_CONFIG = "hf_quant_config.json"
CONFIG_JSON = "config.json"
PRODUCER = {"name": "nvfp4-plugin", "version": __version__}

_CT_WEIGHTS = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
               "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax",
               "observer_kwargs": {}}
_CT_INPUTS = dict(_CT_WEIGHTS, dynamic="local")
_CT_PRESETS = {"NVFP4": True, "NVFP4A16": False}  # preset name -> activations quantized


@dataclass(frozen=True)
class Nvfp4QuantConfig:
    """A parsed NVFP4 quantization config, whatever file and format it came from."""

    format: str                       # "modelopt" | "compressed-tensors"
    quant_algo: str                   # "NVFP4" (W4A4) | "W4A16_NVFP4" (weight-only)
    group_size: int
    exclude_modules: tuple[str, ...]  # as written (ModelOpt wildcards; compressed-tensors names / "re:...")
    kv_cache_quant_algo: str | None = None
    targets: tuple[str, ...] = ("Linear",)
    source: str = ""
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def activations_quantized(self) -> bool:
        return self.quant_algo == F.ALGO_W4A4

    @property
    def spec(self) -> F.FormatSpec:
        return F.spec(self.format)

    def exclusion_pattern(self, module: str) -> str | None:
        """The exclude entry that makes ``module`` unquantized, or None if it is quantized."""
        names = [module]
        if module.startswith("language_model."):
            names.append(module[len("language_model."):])
        for name in names:
            for p in self.exclude_modules:
                if self._matches(name, p):
                    return p
        if self.format == F.COMPRESSED_TENSORS and "Linear" not in self.targets:
            if not any(self._matches(module, t) for t in self.targets):
                return "(not in config_groups targets)"
        return None

    def is_excluded(self, module: str) -> bool:
        return self.exclusion_pattern(module) is not None

    def is_fused_excluded(self, fused_prefix: str, shard_modules) -> bool:
        """Exclusion of an engine's fused layer (``qkv_proj`` from q/k/v): all shards or none.

        Raises CheckpointError when only some shards are excluded (no engine can load that).
        """
        shard_modules = list(shard_modules)
        if not shard_modules:
            return self.is_excluded(fused_prefix)
        flags = [self.is_excluded(m) for m in shard_modules]
        if any(flags) and not all(flags):
            raise CheckpointError(problem(self.source or None, fused_prefix,
                                          f"exclude list covers only some shards of a fused layer: excluded "
                                          f"{[m for m, f in zip(shard_modules, flags) if f]}, quantized "
                                          f"{[m for m, f in zip(shard_modules, flags) if not f]}"))
        return all(flags)

    def _matches(self, module: str, pattern: str) -> bool:
        if self.format == F.COMPRESSED_TENSORS:
            if pattern.startswith("re:"):
                return re.match(pattern[3:], module) is not None
            return module == pattern or ("." not in pattern and module.endswith("." + pattern))
        if module == pattern or fnmatch.fnmatchcase(module, pattern):
            return True
        if pattern.endswith("*") and not pattern.endswith(".*"):  # "a.b*" also means "a.b" itself
            return module == pattern[:-1]
        if not any(c in pattern for c in "*?["):
            # Wildcard-free entries name a module or a whole subtree ("model.visual", "lm_head"), and
            # older exporters wrote bare leaf paths ("mlp.gate"): match on dotted boundaries only, so
            # "mlp.gate" never swallows "mlp.gate_proj".
            return module.startswith(pattern + ".") or module.endswith("." + pattern)
        return False


def _ci_get(d: dict, key: str):
    return d.get(key) if key in d else d.get(key.lower())


def is_nvfp4_config(cfg) -> bool:
    """True if ``cfg`` (a quantization config dict) describes an NVFP4 checkpoint of either format."""
    try:
        parse_quant_config(cfg)
        return True
    except (CheckpointError, TypeError, AttributeError):
        return False


def parse_quant_config(cfg: dict, source: str = "") -> Nvfp4QuantConfig:
    """Parse a ModelOpt (nested or flat) or compressed-tensors NVFP4 config; CheckpointError if unusable."""
    if not isinstance(cfg, dict):
        raise CheckpointError(problem(source or None, None, f"quantization config: expected a JSON object, "
                                                            f"got {type(cfg).__name__}"))
    method = str(cfg.get("quant_method", "")).lower()
    if "quantization" in cfg and isinstance(cfg.get("quantization"), dict):
        return _parse_modelopt(cfg["quantization"], cfg, source, nested=True)
    if method.startswith("modelopt"):
        return _parse_modelopt(cfg, cfg, source, nested=False)
    if method == "compressed-tensors" or "config_groups" in cfg and "format" in cfg:
        return _parse_compressed_tensors(cfg, source)
    raise CheckpointError(problem(source or None, None,
                                  f"quantization config: not an NVFP4 config (quant_method={cfg.get('quant_method')!r};"
                                  " expected ModelOpt {'quantization': {'quant_algo': 'NVFP4'}} or quant_method "
                                  "'modelopt' / 'compressed-tensors')"))


def _parse_modelopt(q: dict, raw: dict, source: str, nested: bool) -> Nvfp4QuantConfig:
    bad = ProblemCollector("ModelOpt quantization config")
    where = source or (HF_QUANT_CONFIG if nested else "quantization_config")
    algo = q.get("quant_algo")
    if not algo:
        bad.add(where, None, "field 'quant_algo' is missing")
        bad.raise_if_any()
    algo = str(algo).upper()
    if algo not in F.QUANT_ALGOS:
        bad.add(where, None, f"field 'quant_algo': expected one of {list(F.QUANT_ALGOS)}, got {q.get('quant_algo')!r}")
    group = q.get("group_size", 16)
    try:
        group = int(group)
    except (TypeError, ValueError):
        bad.add(where, None, f"field 'group_size': expected 16, got {group!r}")
        group = -1
    if group != 16 and group != -1:
        bad.add(where, None, f"field 'group_size': expected 16 (NVFP4 blocks), got {group}")
    key = "exclude_modules" if nested else "ignore"
    exclude = q.get(key, q.get("exclude_modules", [])) or []
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        bad.add(where, None, f"field '{key}': expected a list of module name patterns, got {exclude!r}")
        exclude = []
    if nested:
        kv = q.get("kv_cache_quant_algo")
    else:
        scheme = q.get("kv_cache_scheme")
        kv = ("FP8" if isinstance(scheme, dict) and scheme.get("num_bits") == 8 else
              scheme.upper() if isinstance(scheme, str) else None)
    if kv is not None and not isinstance(kv, str):
        bad.add(where, None, f"field 'kv_cache_quant_algo': expected null or a string, got {kv!r}")
    bad.raise_if_any()
    return Nvfp4QuantConfig(F.MODELOPT, algo, group, tuple(exclude), kv.upper() if kv else None, ("Linear",),
                            where, raw)


def _check_ct_args(bad: ProblemCollector, where: str, what: str, args: dict, activations: bool) -> None:
    exp = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
    for k, v in exp.items():
        if args.get(k) != v:
            bad.add(where, None, f"config_groups.{what}.{k}: expected {v!r}, got {args.get(k)!r}")
    if args.get("symmetric", True) is not True:
        bad.add(where, None, f"config_groups.{what}.symmetric: expected true, got {args.get('symmetric')!r}")
    dyn = args.get("dynamic", False)
    if activations and dyn not in ("local", True, False):
        bad.add(where, None, f"config_groups.{what}.dynamic: expected 'local', got {dyn!r}")
    if not activations and dyn not in (False, None):
        bad.add(where, None, f"config_groups.{what}.dynamic: expected false (static weights), got {dyn!r}")


def _parse_compressed_tensors(cfg: dict, source: str) -> Nvfp4QuantConfig:
    where = source or "quantization_config"
    bad = ProblemCollector("compressed-tensors quantization config")
    top_format = cfg.get("format")
    groups = cfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        bad.add(where, None, "field 'config_groups': expected a non-empty object")
        bad.raise_if_any()
    status = cfg.get("quantization_status", "compressed")
    if status != "compressed":
        bad.add(where, None, f"field 'quantization_status': expected 'compressed' (packed FP4 on disk), got {status!r}")
    if cfg.get("sparsity_config"):
        bad.add(where, None, "field 'sparsity_config': sparse checkpoints are not supported")
    if cfg.get("transform_config"):
        bad.add(where, None, "field 'transform_config': rotated/transformed checkpoints are not supported")
    acts: set[bool] = set()
    targets: list[str] = []
    for gname, g in groups.items():
        if isinstance(g, list):  # preset: {"NVFP4": ["Linear"]}
            if gname.upper() not in _CT_PRESETS:
                bad.add(where, None, f"config_groups.{gname}: preset {gname!r} is not an NVFP4 preset "
                                     f"(expected one of {sorted(_CT_PRESETS)})")
                continue
            acts.add(_CT_PRESETS[gname.upper()])
            targets += [str(t) for t in g]
            continue
        if not isinstance(g, dict):
            bad.add(where, None, f"config_groups.{gname}: expected an object, got {g!r}")
            continue
        fmt = g.get("format") or top_format
        if fmt != F.CT_FORMAT:
            bad.add(where, None, f"config_groups.{gname}.format: expected {F.CT_FORMAT!r}, got {fmt!r}")
        w = g.get("weights")
        if not isinstance(w, dict):
            bad.add(where, None, f"config_groups.{gname}.weights: expected NVFP4 weight args, got {w!r}")
        else:
            _check_ct_args(bad, where, f"{gname}.weights", w, activations=False)
        a = g.get("input_activations")
        if a is not None:
            if not isinstance(a, dict):
                bad.add(where, None, f"config_groups.{gname}.input_activations: expected an object, got {a!r}")
            else:
                _check_ct_args(bad, where, f"{gname}.input_activations", a, activations=True)
        acts.add(a is not None)
        targets += [str(t) for t in (g.get("targets") or [])]
    if len(acts) > 1:
        bad.add(where, None, "config_groups: some groups quantize activations and others do not "
                             "(mixed W4A4/W4A16 is not supported)")
    ignore = cfg.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(e, str) for e in ignore):
        bad.add(where, None, f"field 'ignore': expected a list of names, got {ignore!r}")
        ignore = []
    bad.raise_if_any()
    kv = cfg.get("kv_cache_scheme")
    kv_algo = "FP8" if isinstance(kv, dict) and kv.get("num_bits") == 8 else None
    algo = F.ALGO_W4A4 if acts == {True} else F.ALGO_W4A16
    return Nvfp4QuantConfig(F.COMPRESSED_TENSORS, algo, 16, tuple(ignore), kv_algo, tuple(targets) or ("Linear",),
                            where, cfg)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(problem(path.name, None, f"cannot parse JSON: {exc}")) from exc


def load_quant_config(model_dir) -> Nvfp4QuantConfig:
    """The NVFP4 config of a checkpoint folder: ``hf_quant_config.json`` if present (what vLLM and SGLang
    read first), else ``config.json``'s ``quantization_config``; both must agree when both exist."""
    d = Path(model_dir)
    hf = d / HF_QUANT_CONFIG
    cj = d / CONFIG_JSON
    flat = None
    if cj.exists():
        qc = _read_json(cj).get("quantization_config")
        if qc is not None:
            flat = parse_quant_config(qc, f"{CONFIG_JSON}:quantization_config")
    if hf.exists():
        nested = parse_quant_config(_read_json(hf), HF_QUANT_CONFIG)
        if flat is not None:
            diffs = [f"{f}: {getattr(nested, f)!r} vs {getattr(flat, f)!r}" for f in ("format", "quant_algo")
                     if getattr(flat, f) != getattr(nested, f)]
            if set(flat.exclude_modules) != set(nested.exclude_modules):
                diffs.append(f"exclude_modules vs ignore: {sorted(nested.exclude_modules)} vs "
                             f"{sorted(flat.exclude_modules)}")
            if diffs:
                raise CheckpointError(problem(HF_QUANT_CONFIG, None, f"disagrees with {CONFIG_JSON} "
                                                                     f"quantization_config: {'; '.join(diffs)}"))
        return nested
    if flat is None:
        raise CheckpointError(problem(d, None, f"no NVFP4 quantization config: neither {HF_QUANT_CONFIG} nor "
                                               f"a quantization_config in {CONFIG_JSON}"))
    return flat


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------

def modelopt_hf_quant_config(quant_algo: str, exclude_modules) -> dict:
    """``hf_quant_config.json`` as ModelOpt writes it (every field vLLM/SGLang require is present)."""
    return {"producer": dict(PRODUCER),
            "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": None, "group_size": 16,
                             "exclude_modules": sorted(exclude_modules)}}


def modelopt_quantization_config(quant_algo: str, exclude_modules) -> dict:
    """The flat ``config.json`` ``quantization_config`` ModelOpt writes next to ``hf_quant_config.json``."""
    group = {"weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}, "targets": ["Linear"]}
    if quant_algo == F.ALGO_W4A4:
        group = {"input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}, **group}
    return {"config_groups": {"group_0": group}, "ignore": sorted(exclude_modules), "quant_algo": quant_algo,
            "producer": dict(PRODUCER), "quant_method": "modelopt"}


def compressed_tensors_quantization_config(quant_algo: str, ignore) -> dict:
    """``quantization_config`` as llm-compressor writes it for its NVFP4 / NVFP4A16 presets."""
    group = {"format": F.CT_FORMAT, "input_activations": dict(_CT_INPUTS) if quant_algo == F.ALGO_W4A4 else None,
             "output_activations": None, "targets": ["Linear"], "weights": dict(_CT_WEIGHTS)}
    return {"config_groups": {"group_0": group}, "format": F.CT_FORMAT, "global_compression_ratio": None,
            "ignore": sorted(ignore), "kv_cache_scheme": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {}}
