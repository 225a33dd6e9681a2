"""Validation and normalization of NVFP4 checkpoint tensors into :class:`~nvfp4_plugin.weights.Nvfp4Weight`.

Two ways in:

* Engine adapters receive tensors one at a time through the engine's weight loaders (possibly
  TP-sharded, shards of fused layers stacked into one parameter). They call
  :func:`check_checkpoint_tensor` on each incoming tensor, then :func:`normalize_linear` /
  :func:`normalize_input_scale` once per layer after loading. Calling :func:`validate_checkpoint`
  on the model folder when the quantization config is parsed (CPU only: headers and scale tensors)
  makes every problem of the files fail before any GPU work.
* Offline tools (tests, the quantizer's round trip, converters) use :func:`open_checkpoint`, which
  validates the whole folder first and then loads canonical weights per module or per MoE layer.

Every problem names the file, the tensor, what was expected and what was found.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import numerics as nx
from .._threads import torch_single_threaded
from ..weights import Nvfp4Weight
from . import formats as F
from . import naming
from .config import Nvfp4QuantConfig, load_quant_config
from .errors import CheckpointError, ProblemCollector, problem
from .safetensors_io import CheckpointFiles, TensorInfo

logger = logging.getLogger("nvfp4_plugin")

_FLOAT_DTYPES = ("BF16", "F16", "F32")


# ----------------------------------------------------------------------------------------------
# Value checks (shared by the offline loader and the engine-facing functions)
# ----------------------------------------------------------------------------------------------

def _first_index(mask: torch.Tensor) -> list[int]:
    idx = mask.nonzero()
    return idx[0].tolist() if idx.numel() else []


def block_scale_problems(scales: torch.Tensor) -> list[str]:
    """Problems in e4m3 block-scale values: NaN, or negative (sign bit set on a non-zero)."""
    b = scales.detach().reshape(scales.shape).view(torch.uint8)
    out = []
    nan = (b & 0x7F) == 0x7F
    if bool(nan.any()):
        out.append(f"{int(nan.sum())} block scale(s) are NaN (first at index {_first_index(nan)})")
    neg = ((b & 0x80) != 0) & (b != 0x80) & ~nan
    if bool(neg.any()):
        first = _first_index(neg)
        val = scales[tuple(first)].float().item() if first else float("nan")
        out.append(f"{int(neg.sum())} block scale(s) are negative (first at index {first}: {val})")
    return out


def scalar_scale_problems(values: torch.Tensor, what: str, reciprocal_stored: bool) -> list[str]:
    """Problems in global/input scale values: must be finite and > 0 (and invertible in fp32)."""
    v = values.detach().to("cpu", torch.float32).reshape(-1)
    out = []
    bad = ~torch.isfinite(v) | (v <= 0)
    if bool(bad.any()):
        shown = v[bad][:4].tolist()
        out.append(f"{what} must be finite and > 0, got {shown[0] if v.numel() == 1 else shown}")
    elif reciprocal_stored and not bool(torch.isfinite(F.reciprocal_fp32(v)).all()):
        out.append(f"{what} {v.tolist()} is too small: its fp32 reciprocal (the encode scale) overflows")
    return out


# ----------------------------------------------------------------------------------------------
# Engine-facing: per tensor, per layer
# ----------------------------------------------------------------------------------------------

def split_tensor_name(name: str) -> tuple[str, str]:
    """``"model.layers.0.mlp.down_proj.weight_scale"`` -> ``("model.layers.0.mlp.down_proj", "weight_scale")``."""
    if "." not in name:
        return "", name
    module, suffix = name.rsplit(".", 1)
    return module, suffix


def check_checkpoint_tensor(name: str, tensor: torch.Tensor, config: Nvfp4QuantConfig, *, file: str | None = None,
                            check_values: bool = True) -> None:
    """Check one tensor as it arrives through an engine's weight loader (dtype, rank, scale values).

    Shapes are checked per layer by :func:`normalize_linear`, once the shards are assembled.
    Raises :class:`CheckpointError` naming the tensor.
    """
    module, suffix = split_tensor_name(name)
    spec = config.spec
    role = spec.role_of_suffix(suffix)
    bad = ProblemCollector()
    excluded = config.is_excluded(module)
    if suffix in F.UNSUPPORTED_SUFFIXES:
        bad.add(file, name, f"'{suffix}' tensors belong to a quantization scheme this NVFP4 loader does not support")
    elif role is None and suffix in F.ALL_SCALE_SUFFIXES:
        other = [s.name for s in F.SPECS.values() if s.role_of_suffix(suffix)]
        bad.add(file, name, f"'{suffix}' is a {other[0]} tensor name, but the config says {config.format}")
    elif role == F.ROLE_WEIGHT and excluded and tensor.dtype == torch.uint8 and naming.is_linear_like(module):
        bad.add(file, name, f"stored as packed NVFP4 (uint8) but the config excludes the module "
                            f"(pattern {config.exclusion_pattern(module)!r})")
    elif role == F.ROLE_WEIGHT and not excluded and naming.is_linear_like(module):
        if tensor.dtype != torch.uint8:
            bad.add(file, name, f"dtype: expected uint8 (packed FP4 pairs, module is not excluded), got "
                                f"{str(tensor.dtype).replace('torch.', '')}")
        elif tensor.dim() < 2:
            bad.add(file, name, f"shape: expected [N, K/2], got {list(tensor.shape)}")
    elif role == F.ROLE_BLOCK_SCALE:
        if tensor.dtype != torch.float8_e4m3fn:
            bad.add(file, name, "dtype: expected float8_e4m3fn block scales, got "
                                f"{str(tensor.dtype).replace('torch.', '')}")
        elif tensor.dim() < 2:
            bad.add(file, name, f"shape: expected [N, K/16], got {list(tensor.shape)}")
        elif check_values:
            for msg in block_scale_problems(tensor):
                bad.add(file, name, msg)
    elif role in (F.ROLE_GLOBAL_SCALE, F.ROLE_INPUT_SCALE):
        if tensor.dtype != torch.float32:
            bad.add(file, name, f"dtype: expected float32, got {str(tensor.dtype).replace('torch.', '')}")
        elif tensor.numel() != 1:
            bad.add(file, name, f"shape: expected a per-tensor scalar [] or [1], got {list(tensor.shape)}")
        elif check_values:
            stored_reciprocal = not (spec.global_scale_is_encode if role == F.ROLE_GLOBAL_SCALE
                                     else spec.input_scale_is_encode)
            for msg in scalar_scale_problems(tensor, suffix, stored_reciprocal):
                bad.add(file, name, msg)
    bad.raise_if_any()


def normalize_linear(packed: torch.Tensor, block_scale: torch.Tensor, global_scale, *, format: str,
                     shard_sizes=None, name: str = "weight", check_values: bool = True) -> Nvfp4Weight:
    """Checkpoint tensors of one (possibly fused, possibly stacked-expert) layer -> :class:`Nvfp4Weight`.

    packed:       uint8 ``[..., N, K/2]`` (leading dims: experts)
    block_scale:  float8_e4m3fn ``[..., N, K/16]``
    global_scale: the stored weight global scales in ``format``'s convention (ModelOpt
                  ``weight_scale_2`` decode values, compressed-tensors ``weight_global_scale`` encode
                  values): one per shard, shape ``[..., len(shard_sizes)]`` (``[]``/``[1]`` for one shard).
    shard_sizes:  output rows of each shard in order (``layer.logical_widths``; per expert ``[I, I]``
                  for w13); None for a single shard.

    The result keeps each shard's own global scale on its rows, so fused layers whose shards were
    quantized with different scales stay exact (no rescaling of block scales, no max).
    """
    spec = F.spec(format)
    bad = ProblemCollector(f"NVFP4 layer '{name}'")
    if packed.dtype != torch.uint8:
        bad.add(None, f"{name}.{spec.suffix(F.ROLE_WEIGHT)}", f"dtype: expected uint8, got {packed.dtype}")
    if block_scale.dtype != torch.float8_e4m3fn:
        bad.add(None, f"{name}.{spec.suffix(F.ROLE_BLOCK_SCALE)}",
                f"dtype: expected float8_e4m3fn, got {block_scale.dtype}")
    bad.raise_if_any()
    *lead, n, k2 = packed.shape
    k = 2 * k2
    if k % nx.NVFP4_BLOCK_SIZE:
        bad.add(None, f"{name}.{spec.suffix(F.ROLE_WEIGHT)}", f"K = {k} is not a multiple of 16")
    exp_bs = (*lead, n, k // nx.NVFP4_BLOCK_SIZE)
    if tuple(block_scale.shape) != exp_bs:
        bad.add(None, f"{name}.{spec.suffix(F.ROLE_BLOCK_SCALE)}",
                f"shape: expected [..., N, K/16] = {list(exp_bs)} for packed weight {list(packed.shape)}, "
                f"got {list(block_scale.shape)}")
    sizes = [n] if shard_sizes is None else [int(s) for s in shard_sizes]
    if sum(sizes) != n:
        bad.add(None, name, f"shard sizes {sizes} sum to {sum(sizes)}, weight has N = {n} rows")
    gs = torch.as_tensor(global_scale)
    if gs.dtype != torch.float32:
        bad.add(None, f"{name}.{spec.suffix(F.ROLE_GLOBAL_SCALE)}", f"dtype: expected float32, got {gs.dtype}")
    bad.raise_if_any()
    gs = gs.detach().to("cpu")
    want = (*lead, len(sizes))
    if tuple(gs.shape) != want:
        if gs.numel() == torch.Size(want).numel():
            gs = gs.reshape(want)
        else:
            bad.add(None, f"{name}.{spec.suffix(F.ROLE_GLOBAL_SCALE)}",
                    f"shape: expected one value per shard {list(want)}, got {list(gs.shape)}")
            bad.raise_if_any()
    if check_values:
        for msg in scalar_scale_problems(gs, spec.suffix(F.ROLE_GLOBAL_SCALE), not spec.global_scale_is_encode):
            bad.add(None, f"{name}.{spec.suffix(F.ROLE_GLOBAL_SCALE)}", msg)
        for msg in block_scale_problems(block_scale):
            bad.add(None, f"{name}.{spec.suffix(F.ROLE_BLOCK_SCALE)}", msg)
        bad.raise_if_any()
    enc = F.encode_from_checkpoint_global(gs, format)
    if len(sizes) > 1 and not bool((enc == enc[..., :1]).all()):
        logger.info("nvfp4_plugin: %s: shards have different global scales; kept exact per row", name)
    return Nvfp4Weight.from_shards(packed, block_scale, enc.to(packed.device), sizes)


def normalize_input_scale(input_scale, *, format: str, num_shards: int | None = None, name: str = "input_scale",
                          check_values: bool = True) -> torch.Tensor:
    """Stored activation scale(s) -> encode scale (``2688/amax``), fp32 on the CPU.

    With ``num_shards`` the last dim holds one value per shard of a fused layer; they share one input,
    so the shards are reduced to the smallest encode scale (= the largest amax, nothing saturates).
    """
    spec = F.spec(format)
    v = torch.as_tensor(input_scale).detach().to("cpu")
    if v.dtype != torch.float32:
        raise CheckpointError(problem(None, name, f"dtype: expected float32, got {v.dtype}"))
    if check_values:
        msgs = scalar_scale_problems(v, name, not spec.input_scale_is_encode)
        if msgs:
            raise CheckpointError([problem(None, name, m) for m in msgs])
    enc = F.encode_from_checkpoint_input(v, format)
    if num_shards is not None:
        if enc.dim() == 0 or enc.shape[-1] != num_shards:
            enc = enc.reshape(*enc.shape[:-1], num_shards) if enc.numel() % num_shards == 0 else enc
        if enc.dim() and enc.shape[-1] == num_shards:
            enc = enc.amin(dim=-1)
    elif enc.numel() == 1:
        enc = enc.reshape(())
    return enc


def to_checkpoint_tensors(module: str, weight: Nvfp4Weight, input_scale=None, *, format: str) -> dict:
    """The inverse of normalization for one module: ``{tensor name: tensor}`` as ``format`` stores it.

    ``weight`` must be 2-D with one global scale for all rows (files store one per tensor; split
    fused weights per shard first). ``input_scale`` is an encode scale or None (weight-only).
    """
    spec = F.spec(format)
    gs = weight.global_scale.detach().to("cpu")
    if weight.packed.dim() != 2 or not bool((gs == gs[:1]).all()):
        raise ValueError(f"{module}: expected a 2-D weight with one global scale, got packed "
                         f"{list(weight.packed.shape)} with {int(torch.unique(gs).numel())} distinct global scales")
    out = {f"{module}.{spec.suffix(F.ROLE_WEIGHT)}": weight.packed.cpu(),
           f"{module}.{spec.suffix(F.ROLE_BLOCK_SCALE)}": weight.block_scale.cpu(),
           f"{module}.{spec.suffix(F.ROLE_GLOBAL_SCALE)}": F.checkpoint_global_from_encode(gs[0], format)}
    if input_scale is not None:
        out[f"{module}.{spec.suffix(F.ROLE_INPUT_SCALE)}"] = F.checkpoint_input_from_encode(
            torch.as_tensor(input_scale, dtype=torch.float32), format)
    return out


def fuse_rows(weights) -> Nvfp4Weight:
    """Stack weights along N (q, k, v -> qkv): exact, because global scales are per row."""
    weights = list(weights)
    return Nvfp4Weight(torch.cat([w.packed for w in weights], dim=-2),
                       torch.cat([w.block_scale for w in weights], dim=-2),
                       torch.cat([w.global_scale for w in weights], dim=-1))


# ----------------------------------------------------------------------------------------------
# Offline: a whole checkpoint folder
# ----------------------------------------------------------------------------------------------

@dataclass
class QuantModule:
    """A quantized module in the checkpoint: its tensors by role."""

    name: str
    tensors: dict[str, TensorInfo]  # role -> info
    expert: naming.ExpertName | None = None

    @property
    def n(self) -> int:
        return self.tensors[F.ROLE_WEIGHT].shape[0]

    @property
    def k(self) -> int:
        return self.tensors[F.ROLE_WEIGHT].shape[1] * 2


@dataclass
class MoELayer:
    """Experts of one MoE layer (``prefix`` = ``"model.layers.3.mlp.experts"``)."""

    prefix: str
    experts: list[dict[str, str]] = field(default_factory=list)  # per expert: role -> module name

    @property
    def num_experts(self) -> int:
        return len(self.experts)


@dataclass(frozen=True)
class CanonicalLinear:
    name: str
    weight: Nvfp4Weight
    input_scale: torch.Tensor | None  # encode scale (fp32 []), None for weight-only checkpoints


@dataclass(frozen=True)
class CanonicalExperts:
    prefix: str
    w13: Nvfp4Weight                      # [E, 2I, H/2], gate rows then up rows per expert
    w2: Nvfp4Weight                       # [E, H, I/2]
    w13_input_scale: torch.Tensor | None  # [E] encode scales
    w2_input_scale: torch.Tensor | None   # [E]


class Nvfp4Checkpoint:
    """An NVFP4 checkpoint folder, validated on open; canonical weights loaded per module on request."""

    def __init__(self, path, *, validate: bool = True, check_block_scales: bool = True):
        self.path = Path(path)
        self.config = load_quant_config(self.path)
        self.files = CheckpointFiles(self.path)
        self.modules: dict[str, QuantModule] = {}
        self.moe_layers: dict[str, MoELayer] = {}
        self.linears: list[str] = []
        self.passthrough: list[str] = []
        bad = ProblemCollector(f"NVFP4 checkpoint {self.path}")
        self._analyze(bad)
        bad.raise_if_any()
        if validate:
            self._check_values(bad, check_block_scales)
            bad.raise_if_any()

    # -- structure ------------------------------------------------------------------------------
    def _analyze(self, bad: ProblemCollector) -> None:
        cfg, spec = self.config, self.config.spec
        by_module: dict[str, dict[str, TensorInfo]] = defaultdict(dict)
        for name, info in self.files.tensors.items():
            module, suffix = split_tensor_name(name)
            by_module[module][suffix] = info
        self._by_module = by_module
        self._stored_quantized: set[str] = set()  # includes modules whose tensors have problems
        role_suffix = {r: spec.suffix(r) for r in F.ROLES}
        scale_roles = (F.ROLE_BLOCK_SCALE, F.ROLE_GLOBAL_SCALE, F.ROLE_INPUT_SCALE)
        for module, tensors in by_module.items():
            claimed = set()
            for suffix, info in tensors.items():
                fname = Path(info.file).name
                if suffix in F.UNSUPPORTED_SUFFIXES:
                    bad.add(fname, info.name, f"'{suffix}' tensors belong to a quantization scheme this loader "
                                              "does not support (NVFP4 only)")
                    claimed.add(suffix)
                elif suffix in F.ALL_SCALE_SUFFIXES and spec.role_of_suffix(suffix) is None:
                    other = [s.name for s in F.SPECS.values() if s.role_of_suffix(suffix)][0]
                    bad.add(fname, info.name, f"'{suffix}' is a {other} tensor name, but the config says "
                                              f"{cfg.format}")
                    claimed.add(suffix)
            packed = tensors.get(role_suffix[F.ROLE_WEIGHT])
            plain = tensors.get("weight")
            scales = {r: tensors[role_suffix[r]] for r in scale_roles if role_suffix[r] in tensors}
            excluded_by = cfg.exclusion_pattern(module)
            # A float weight next to scale tensors is an unquantized module with stray scales; any other
            # non-U8 weight next to scales is a packed weight stored with the wrong dtype.
            is_quant = packed is not None and (packed.dtype == "U8"
                                               or (bool(scales) and packed.dtype not in _FLOAT_DTYPES))
            if cfg.format == F.COMPRESSED_TENSORS and packed is not None and plain is not None:
                bad.add(Path(plain.file).name, plain.name, f"module has both '{plain.name}' and '{packed.name}'")
            if is_quant:
                qm = QuantModule(module, {F.ROLE_WEIGHT: packed, **scales}, naming.parse_expert(module))
                ok = self._check_module_headers(qm, bad)
                self._stored_quantized.add(module)
                if excluded_by is not None:
                    bad.add(Path(packed.file).name, packed.name,
                            f"stored as NVFP4 but the config excludes the module (pattern {excluded_by!r}); "
                            "engines would read the packed bytes as unquantized weights")
                if ok:
                    self.modules[module] = qm
                claimed |= {role_suffix[F.ROLE_WEIGHT], *(role_suffix[r] for r in scales)}
            elif scales:
                for r, info in scales.items():
                    what = ("no weight tensor" if packed is None and plain is None else
                            f"weight '{(plain or packed).name}' is {(plain or packed).describe()}, not packed "
                            "uint8 NVFP4")
                    bad.add(Path(info.file).name, info.name, f"extra scale tensor: {what}")
                claimed |= {role_suffix[r] for r in scales}
            elif plain is not None and len(plain.shape) == 2 and plain.dtype in _FLOAT_DTYPES \
                    and naming.is_linear_like(module) and excluded_by is None:
                bad.add(Path(plain.file).name, plain.name,
                        f"stored unquantized ({plain.describe()}) but the config does not exclude the module; "
                        f"engines would expect NVFP4 tensors here (add it to "
                        f"{'exclude_modules' if cfg.format == F.MODELOPT else 'ignore'})")
            for suffix, info in tensors.items():
                if suffix not in claimed:
                    self.passthrough.append(info.name)
        self._group_experts(bad)
        self._check_fused_groups(bad)
        self.linears = sorted(m for m, qm in self.modules.items() if qm.expert is None)

    def _check_module_headers(self, qm: QuantModule, bad: ProblemCollector) -> bool:
        cfg, spec = self.config, self.config.spec
        w = qm.tensors[F.ROLE_WEIGHT]
        fname = Path(w.file).name
        ok = True
        if w.dtype != "U8":
            bad.add(fname, w.name, f"dtype: expected U8 (packed FP4 pairs), got {w.dtype}")
            ok = False
        if len(w.shape) != 2:
            bad.add(fname, w.name, f"shape: expected [N, K/2] (one module per tensor), got {list(w.shape)}")
            return False
        n, k = w.shape[0], w.shape[1] * 2
        if k % nx.NVFP4_BLOCK_SIZE:
            bad.add(fname, w.name, f"shape {list(w.shape)} means K = {k}, which is not a multiple of 16")
            ok = False
        exp_bs = [n, k // nx.NVFP4_BLOCK_SIZE]
        bs = qm.tensors.get(F.ROLE_BLOCK_SCALE)
        want = f"'{qm.name}.{spec.suffix(F.ROLE_BLOCK_SCALE)}'"
        if bs is None:
            bad.add(fname, w.name, f"missing block scales: expected tensor {want} F8_E4M3 {exp_bs}")
            ok = False
        else:
            bfile = Path(bs.file).name
            if bs.dtype != "F8_E4M3":
                bad.add(bfile, bs.name, f"dtype: expected F8_E4M3 (float8_e4m3fn block scales), got {bs.dtype}")
                ok = False
            if list(bs.shape) != exp_bs:
                if len(bs.shape) == 2 and bs.shape[0] == n:
                    bad.add(bfile, bs.name, f"K/16 mismatch: '{w.name}' {list(w.shape)} means K = {k}, so "
                                            f"expected [N, K/16] = {exp_bs}, got {list(bs.shape)}")
                else:
                    bad.add(bfile, bs.name, f"shape: expected [N, K/16] = {exp_bs} to match '{w.name}' "
                                            f"{list(w.shape)}, got {list(bs.shape)}")
                ok = False
        roles = [(F.ROLE_GLOBAL_SCALE, "weight global scale", True),
                 (F.ROLE_INPUT_SCALE, "activation (input) scale", cfg.activations_quantized)]
        for role, what, required in roles:
            t = qm.tensors.get(role)
            name = f"{qm.name}.{spec.suffix(role)}"
            if t is None:
                if required:
                    why = f" (quant_algo {cfg.quant_algo} quantizes activations)" if role == F.ROLE_INPUT_SCALE else ""
                    bad.add(fname, w.name, f"missing {what}: expected tensor '{name}' F32 "
                                           f"{list(spec.scalar_shape)}{why}")
                    ok = False
                continue
            tfile = Path(t.file).name
            if t.dtype != "F32":
                bad.add(tfile, t.name, f"dtype: expected F32, got {t.dtype}")
                ok = False
            if t.numel != 1:
                bad.add(tfile, t.name, f"shape: expected a per-tensor scalar [] or [1], got {list(t.shape)}")
                ok = False
        return ok

    def _group_experts(self, bad: ProblemCollector) -> None:
        layers: dict[str, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
        for m, qm in self.modules.items():
            if qm.expert is not None:
                layers[qm.expert.prefix][qm.expert.expert][qm.expert.role] = m
        # A layer with some experts quantized and others stored unquantized cannot be served.
        for name in self.files.tensors:
            module, suffix = split_tensor_name(name)
            ex = naming.parse_expert(module)
            if ex is not None and ex.prefix in layers and module not in self._stored_quantized and suffix == "weight":
                info = self.files.info(name)
                bad.add(Path(info.file).name, name, f"expert is stored unquantized ({info.describe()}) while other "
                                                    f"experts of {ex.prefix} are NVFP4")
        broken = {naming.parse_expert(m).prefix for m in self._stored_quantized - set(self.modules)
                  if naming.parse_expert(m) is not None}
        for prefix, experts in sorted(layers.items()):
            if prefix in broken:  # its bad tensors are reported already; structure checks would only echo them
                continue
            num = max(experts) + 1
            missing = [e for e in range(num) if e not in experts]
            if missing:
                bad.add(None, f"{prefix}.{missing[0]}", f"MoE layer {prefix}: experts {missing} are missing "
                                                        f"(found {len(experts)} of 0..{num - 1})")
                continue
            layer = MoELayer(prefix)
            ref = None
            for e in range(num):
                roles = experts[e]
                lacking = [r for r in naming.EXPERT_ROLES if r not in roles]
                if lacking:
                    bad.add(None, f"{prefix}.{e}", f"expert {e} of {prefix} lacks its {lacking} projection(s)")
                    continue
                shapes = {r: (self.modules[roles[r]].n, self.modules[roles[r]].k) for r in naming.EXPERT_ROLES}
                i_dim, h_dim = shapes["gate"]
                expect = {"gate": (i_dim, h_dim), "up": (i_dim, h_dim), "down": (h_dim, i_dim)}
                for r in naming.EXPERT_ROLES:
                    if shapes[r] != expect[r] or (ref is not None and shapes[r] != ref[r]):
                        want = ref[r] if ref is not None else expect[r]
                        w = self.modules[roles[r]].tensors[F.ROLE_WEIGHT]
                        bad.add(Path(w.file).name, w.name, f"expert shape: expected [N, K] = {list(want)} like the "
                                                           f"other experts of {prefix}, got {list(shapes[r])}")
                ref = ref or shapes
                layer.experts.append(dict(roles))
            self.moe_layers[prefix] = layer

    def _check_fused_groups(self, bad: ProblemCollector) -> None:
        seen = set()
        for m in list(self.modules):
            g = naming.fused_group(m)
            if g is None or g[0] in seen or naming.parse_expert(m) is not None:
                continue
            seen.add(g[0])
            present = [x for x in g[2] if x in self._by_module]
            quant = [x for x in present if x in self._stored_quantized]
            if quant and len(quant) != len(present):
                plain = [x for x in present if x not in self._stored_quantized]
                bad.add(None, g[0], f"fused layer mixes NVFP4 shards {quant} with unquantized shards {plain}")
            ks = {self.modules[x].k for x in quant if x in self.modules}
            if len(ks) > 1:
                bad.add(None, g[0], f"fused layer shards have different K: "
                                    f"{[(x, self.modules[x].k) for x in quant if x in self.modules]}")

    # -- values ---------------------------------------------------------------------------------
    def _check_values(self, bad: ProblemCollector, check_block_scales: bool) -> None:
        spec = self.config.spec
        for m, qm in self.modules.items():
            for role in (F.ROLE_GLOBAL_SCALE, F.ROLE_INPUT_SCALE):
                info = qm.tensors.get(role)
                if info is None:
                    continue
                encode = spec.global_scale_is_encode if role == F.ROLE_GLOBAL_SCALE else spec.input_scale_is_encode
                for msg in scalar_scale_problems(self.files.read(info.name), spec.suffix(role), not encode):
                    bad.add(Path(info.file).name, info.name, msg)
            if check_block_scales:
                info = qm.tensors[F.ROLE_BLOCK_SCALE]
                for msg in block_scale_problems(self.files.read(info.name)):
                    bad.add(Path(info.file).name, info.name, msg)

    # -- loading --------------------------------------------------------------------------------
    def read_tensor(self, name: str) -> torch.Tensor:
        return self.files.read(name)

    def load_linear(self, module: str, device="cpu") -> CanonicalLinear:
        """Canonical weight (and activation encode scale) of one quantized module."""
        qm = self.modules.get(module)
        if qm is None:
            raise KeyError(f"{module!r} is not a quantized module of {self.path}")
        fmt = self.config.format
        packed = self.files.read(qm.tensors[F.ROLE_WEIGHT].name)
        bs = self.files.read(qm.tensors[F.ROLE_BLOCK_SCALE].name)
        gs = self.files.read(qm.tensors[F.ROLE_GLOBAL_SCALE].name)
        w = normalize_linear(packed, bs, gs, format=fmt, name=module)
        inp = self.load_input_scale(module)
        return CanonicalLinear(module, w.to(device), None if inp is None else inp.to(device))

    def load_input_scale(self, module: str) -> torch.Tensor | None:
        """The activation encode scale (fp32 ``[]``) of one quantized module; None for weight-only files.
        Reads that one tensor only."""
        qm = self.modules.get(module)
        if qm is None:
            raise KeyError(f"{module!r} is not a quantized module of {self.path}")
        if not self.config.activations_quantized:
            return None
        name = qm.tensors[F.ROLE_INPUT_SCALE].name
        return normalize_input_scale(self.files.read(name), format=self.config.format, name=name)

    def load_fused(self, modules, device="cpu") -> CanonicalLinear:
        """Several modules fused along N (e.g. q/k/v), as an engine stores them. Exact per-row scales."""
        parts = [self.load_linear(m) for m in modules]
        w = fuse_rows([p.weight for p in parts])
        inp = None
        if parts[0].input_scale is not None:
            inp = torch.stack([p.input_scale for p in parts]).amin()
        return CanonicalLinear("+".join(modules), w.to(device), None if inp is None else inp.to(device))

    def load_experts(self, prefix: str, device="cpu") -> CanonicalExperts:
        """One MoE layer: w13 ``[E, 2I, H/2]`` (gate rows first, then up) and w2 ``[E, H, I/2]``."""
        layer = self.moe_layers[prefix]
        w13, w2, in13, in2 = [], [], [], []
        for roles in layer.experts:
            g, u, d = (self.load_linear(roles[r]) for r in naming.EXPERT_ROLES)
            w13.append(fuse_rows([g.weight, u.weight]))
            w2.append(d.weight)
            if g.input_scale is not None:
                in13.append(torch.minimum(g.input_scale, u.input_scale))
                in2.append(d.input_scale)

        def stack(ws):
            return Nvfp4Weight(torch.stack([w.packed for w in ws]), torch.stack([w.block_scale for w in ws]),
                               torch.stack([w.global_scale for w in ws]))

        return CanonicalExperts(prefix, stack(w13).to(device), stack(w2).to(device),
                                torch.stack(in13).to(device) if in13 else None,
                                torch.stack(in2).to(device) if in2 else None)

    def iter_canonical(self, device="cpu"):
        """Yield ``("linear", name, CanonicalLinear)`` for non-expert modules, then
        ``("experts", prefix, CanonicalExperts)`` per MoE layer."""
        for m in self.linears:
            yield "linear", m, self.load_linear(m, device)
        for p in sorted(self.moe_layers):
            yield "experts", p, self.load_experts(p, device)

    def close(self) -> None:
        self.files.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_checkpoint(path, *, validate: bool = True, check_block_scales: bool = True) -> Nvfp4Checkpoint:
    """Open and validate an NVFP4 checkpoint folder (CPU only; raises :class:`CheckpointError`)."""
    return Nvfp4Checkpoint(path, validate=validate, check_block_scales=check_block_scales)


def validate_checkpoint(path, *, check_block_scales: bool = True) -> Nvfp4QuantConfig:
    """Check a checkpoint folder without loading weights: config, headers, shapes, dtypes, scale values.

    CPU only, reads headers plus the scale tensors (block scales are 1/8 of the packed weights; skip
    them with ``check_block_scales=False`` for a header-and-scalars check). Raises
    :class:`CheckpointError` listing every problem; returns the parsed config. Single-threaded: the
    engines call it in launcher processes that fork their workers afterwards (:mod:`nvfp4_plugin._threads`).
    """
    with torch_single_threaded(), Nvfp4Checkpoint(path, validate=True,
                                                  check_block_scales=check_block_scales) as ckpt:
        return ckpt.config
