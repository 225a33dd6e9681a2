"""``nvfp4-plugin quantize``: a bf16/fp16 Hugging Face safetensors checkpoint -> an NVFP4 checkpoint.

Output (ModelOpt by default, or compressed-tensors): sharded safetensors with an index, the
format's quantization config (ModelOpt: ``hf_quant_config.json`` *and* ``quantization_config`` in
``config.json``, as ModelOpt itself writes them), and every other file of the source folder
(tokenizer, generation config, chat template, ...).

What gets quantized: every 2-D floating-point ``*.weight`` whose module is not excluded (default
excludes: lm_head, embeddings, MoE routers, norms, vision towers; see ``naming.DEFAULT_EXCLUDES``)
and whose K is a multiple of 16. Fused groups (q/k/v, gate/up, each expert's gate/up, DeepSeek's
q_a/kv_a) are quantized or excluded together and share one global scale (the group's amax), as
ModelOpt does: the engines' built-in loaders keep one scale per fused layer, so shared scales are
what makes the file exact for them too (``--per-shard-global-scales`` keeps one per tensor, which
our loader handles exactly and the built-in ones do not).

Numerics: the reference recipe (:mod:`nvfp4_plugin.numerics`) through ``ops.scaled_fp4_quant`` (the
fastest backend on the device, byte-identical to the reference). Global scales are
``2688/amax`` moved to the fp32 reciprocal fixed point (:func:`formats.global_scale_from_amax_exact`)
so both formats load to identical canonical tensors.

Block scales and codes (``--method``): ``rtn`` as above; ``mse`` searches each block's E4M3 scale for the
least squared error (:mod:`.scale_search`, each column weighted by its mean squared calibration input
when calibrating); ``gptq`` (:mod:`.gptq`) rounds column by column with second-order error
compensation from each input's calibration Hessian, block scales by the ``mse`` search on the updated
weights. All three write the same format under the same global scales.

Activation scales: with calibration (default), ``input_scale`` per linear from the input amax seen
while running the bf16 model on a small built-in text (or ``--calib-file``), quant_algo NVFP4 (W4A4);
fused shards share their input, so they get the same value. ``--no-calibration`` writes weight-only
``W4A16_NVFP4`` (compressed-tensors: the NVFP4A16 preset): no activation-scale tensors at all, so no
engine can mistake an invented scale for a measured one.

Streaming and atomicity: tensors are read one fused group at a time with ``pread`` (a background
thread reads ahead by two groups), quantized on the device and appended to the output shards whose
headers were planned up front; peak host memory is a few tensors. Everything is written into
``DST.tmp-XXXX`` next to DST, validated with our loader (headers and scales), and renamed to DST at the
end; any failure or Ctrl-C removes the temporary folder, so DST is either complete or absent.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import formats as F
from . import naming
from .config import (CONFIG_JSON, HF_QUANT_CONFIG, compressed_tensors_quantization_config,
                     modelopt_hf_quant_config, modelopt_quantization_config)
from .errors import CheckpointError, problem
from .safetensors_io import (CheckpointFiles, ReadAhead, ShardedWriter, TensorSpec, copy_side_files, parse_size,
                             staged_output_dir)

logger = logging.getLogger("nvfp4_plugin")

_SOURCE_DTYPES = ("BF16", "F16", "F32")


METHODS = ("rtn", "mse", "gptq")


@dataclass
class QuantizeOptions:
    format: str = F.MODELOPT
    exclude: tuple[str, ...] = ()             # added to the defaults
    default_excludes: bool = True
    device: str = "auto"
    calibration: bool = True
    calib_texts: list[str] | None = None      # None: the built-in text
    calib_samples: int = 16
    calib_seq_len: int = 512
    calib_batch_size: int = 4
    per_shard_global_scales: bool = False
    #: Block scales: "rtn" (from each block's maximum, ModelOpt's default), "mse" (searched among the
    #: E4M3 values near it for the least squared error, checkpoints/scale_search.py) or "gptq" (error
    #: compensation with the calibration Hessian, mse block scales; checkpoints/gptq.py). Same format.
    #: Default mse: on the real models it loses least (benchmarks/results/quantizer_accuracy.md) and
    #: quantizes the 8B shape in 44 s on an H200 (gptq: 10 min, and no better there).
    method: str = "mse"
    #: Calibrate (mse: weight each column's error by its mean squared input; gptq: its Hessian) but
    #: write a W4A16 checkpoint, without activation scales.
    weights_only: bool = False
    #: gptq: damping as a fraction of mean diag(H); columns per lazy update; visit columns by
    #: decreasing diag(H) (block scales then fixed up front from the original weights).
    gptq_damping: float = 0.01
    gptq_block_size: int = 128
    gptq_act_order: bool = False
    #: gptq: the most memory (GB, on the calibration device) the Hessians waiting to be used may take;
    #: beyond it they are collected in several calibration passes, in the order the layers are quantized.
    #: None: a quarter of the device's memory (GPU) or of the host's (CPU).
    gptq_hessian_memory_gb: float | None = None
    max_shard_size: int | str = "5GB"
    overwrite: bool = False
    progress: bool = True


@dataclass
class QuantGroup:
    """Modules quantized together with one global scale (one module unless fused)."""

    key: str
    modules: list[str]

    def weights(self) -> list[str]:
        return [m + ".weight" for m in self.modules]


@dataclass
class QuantPlan:
    items: list  # ("copy", tensor name) | ("quant", QuantGroup), in output order
    quantized: dict[str, tuple[int, int]]  # module -> (N, K)
    excluded: dict[str, str]                # module -> reason
    exclude_list: list[str]                 # written to the config
    specs: list[TensorSpec] = field(default_factory=list)

    @property
    def modules(self) -> list[str]:
        return list(self.quantized)


@dataclass
class QuantizeReport:
    dst: str
    format: str
    quant_algo: str
    modules_quantized: int
    modules_excluded: dict[str, str]
    files: list[str]
    bytes_in: int
    bytes_out: int
    seconds_calibration: float
    seconds_quantize: float
    seconds_total: float
    device: str
    filled_experts: list[str] = field(default_factory=list)
    method: str = "rtn"

    def summary(self) -> str:
        return (f"wrote {self.dst}: {self.format} {self.quant_algo} ({self.method} block scales), "
                f"{self.modules_quantized} modules quantized, "
                f"{len(self.modules_excluded)} left in high precision, {len(self.files)} file(s), "
                f"{self.bytes_in / 1e9:.2f} GB -> {self.bytes_out / 1e9:.2f} GB; "
                f"calibration {self.seconds_calibration:.1f}s, quantization {self.seconds_quantize:.1f}s, "
                f"total {self.seconds_total:.1f}s on {self.device}")


# ----------------------------------------------------------------------------------------------
# Planning (pure: headers in, plan out)
# ----------------------------------------------------------------------------------------------

def plan_quantization(files: CheckpointFiles, options: QuantizeOptions, quant_algo: str) -> QuantPlan:
    patterns = (naming.DEFAULT_EXCLUDES if options.default_excludes else ()) + tuple(options.exclude)
    candidates: dict[str, tuple[int, int]] = {}
    excluded: dict[str, str] = {}
    for name, info in files.tensors.items():
        if not name.endswith(".weight") or len(info.shape) != 2 or info.dtype not in _SOURCE_DTYPES:
            continue
        module = name[: -len(".weight")]
        n, k = info.shape
        p = naming.matches_any(module, patterns)
        if naming.is_embedding(module):
            excluded[module] = "embedding"
        elif p is not None:
            excluded[module] = f"--exclude {p!r}" if p in options.exclude else f"default exclude {p!r}"
        elif k % 16:
            excluded[module] = f"K = {k} is not a multiple of 16"
        candidates[module] = (n, k)
    # Fused groups and MoE layers are all quantized or all excluded (engines cannot mix them).
    groups: dict[str, list[str]] = defaultdict(list)
    for m in candidates:
        g = naming.fused_group(m)
        if g is not None:
            groups[g[0]].append(m)
        ex = naming.parse_expert(m)
        if ex is not None:
            groups["moe:" + ex.prefix].append(m)
    for key, members in groups.items():
        why = [f"{m} ({excluded[m]})" for m in members if m in excluded]
        if why:
            for m in members:
                excluded.setdefault(m, f"fused with excluded {why[0]}" if not key.startswith("moe:")
                                    else f"same MoE layer as excluded {why[0]}")
    quantized = {m: nk for m, nk in candidates.items() if m not in excluded}
    ks = defaultdict(set)
    for m in quantized:
        g = naming.fused_group(m)
        if g is not None:
            ks[g[0]].add(quantized[m][1])
    for key, kset in ks.items():
        if len(kset) > 1:
            raise CheckpointError(problem(None, key, f"fused group members have different K {sorted(kset)}"))

    # Output order: source order; a quantized group is emitted where its first member's weight is.
    items = []
    emitted = set()
    order = sorted(files.tensors.values(), key=lambda i: (i.file, i.begin))
    for info in order:
        module = info.name[: -len(".weight")] if info.name.endswith(".weight") else None
        if module in quantized:
            g = naming.fused_group(module) if not options.per_shard_global_scales else None
            key = g[0] if g is not None else module
            if key in emitted:
                continue
            emitted.add(key)
            members = [m for m in g[2] if m in quantized] if g is not None else [module]
            items.append(("quant", QuantGroup(key, members)))
        else:
            items.append(("copy", info.name))

    spec = F.spec(options.format)
    specs = []
    for kind, x in items:
        if kind == "copy":
            info = files.info(x)
            specs.append(TensorSpec(x, info.dtype, info.shape))
            continue
        for m in x.modules:
            n, k = quantized[m]
            specs += [TensorSpec(f"{m}.{spec.suffix(F.ROLE_WEIGHT)}", "U8", (n, k // 2)),
                      TensorSpec(f"{m}.{spec.suffix(F.ROLE_BLOCK_SCALE)}", "F8_E4M3", (n, k // 16)),
                      TensorSpec(f"{m}.{spec.suffix(F.ROLE_GLOBAL_SCALE)}", "F32", spec.scalar_shape)]
            if quant_algo == F.ALGO_W4A4:
                specs.append(TensorSpec(f"{m}.{spec.suffix(F.ROLE_INPUT_SCALE)}", "F32", spec.scalar_shape))

    # The exclude list engines see: every high-precision linear-like module (exact names, which
    # vLLM's wildcards, SGLang's substring match and compressed-tensors' names all read the same way),
    # lm_head always (tied heads have no tensor but are still a linear layer), and whole MoE layers.
    exclude_list = {m for m in excluded if not naming.is_embedding(m)}
    if "lm_head" not in quantized:
        exclude_list.add("lm_head")
    for m in list(exclude_list):
        ex = naming.parse_expert(m)
        if ex is not None:
            exclude_list.add(ex.prefix)
    return QuantPlan(items, quantized, excluded, sorted(exclude_list), specs)


# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------

def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is visible to torch")
    return d


def _input_amax_for(plan: QuantPlan, amax: dict[str, float]) -> tuple[dict[str, float], list[str]]:
    from .calibrate import fill_missing_experts

    amax = dict(amax)
    filled = fill_missing_experts(amax, plan.modules)
    missing = [m for m in plan.modules if m not in amax]
    if missing:
        raise CheckpointError([problem(None, m, "calibration saw no input for this module (the model's forward "
                                                "never called it); use --no-calibration, or --exclude it")
                               for m in missing], "calibration")
    return amax, filled


class _Quantizer:
    """``ops.scaled_fp4_quant`` (fastest backend on the device), checked once against the reference.

    The first tensor of a run is also quantized with the pure-torch reference on the same device; if
    the bytes differ, the run continues on the reference (slower, correct) and says so.
    """

    def __init__(self):
        self.fn = None

    def __call__(self, x: torch.Tensor, gs: torch.Tensor):
        from .. import ops, reference

        if self.fn is None:
            fast = ops.scaled_fp4_quant(x, gs, swizzle=False)
            ref = reference.scaled_fp4_quant(x, gs, swizzle=False)
            same = torch.equal(fast[0], ref[0]) and torch.equal(fast[1].view(torch.uint8), ref[1].view(torch.uint8))
            if not same:
                logger.warning("nvfp4_plugin: quantize: the fast scaled_fp4_quant backend disagrees with the "
                               "reference on %s; using the reference for this run", x.device)
            self.fn = ops.scaled_fp4_quant if same else reference.scaled_fp4_quant
            return ref
        return self.fn(x, gs, swizzle=False)


class _MseQuantizer:
    """``--method mse``: the Triton search on CUDA tensors (checked once against the torch search on the
    first rows of the first tensor of a run: on a mismatch the run goes on with the torch search and
    says so), the torch search elsewhere."""

    CHECK_ROWS = 256

    def __init__(self):
        self.fast: bool | None = None

    def __call__(self, x: torch.Tensor, gs: torch.Tensor, col_weight: torch.Tensor | None):
        from .scale_search import quantize_with_scales, search_block_scales

        scales = None
        if x.is_cuda and self.fast is not False:
            try:
                from ..triton.scale_search import search_block_scales as fast
            except ImportError as exc:             # no Triton: the torch search (slow on large models)
                logger.warning("nvfp4_plugin: quantize: Triton unavailable (%s); mse uses the torch search", exc)
                self.fast = False
            else:
                scales = fast(x, gs, col_weight=col_weight)
                if self.fast is None:
                    n = min(self.CHECK_ROWS, x.shape[0])
                    ref = search_block_scales(x[:n].float(), gs, col_weight=col_weight)
                    self.fast = torch.equal(scales[:n].view(torch.uint8), ref.view(torch.uint8))
                    if not self.fast:
                        logger.warning("nvfp4_plugin: quantize: the Triton mse scale search disagrees with the "
                                       "torch search on %s; using the torch search for this run", x.device)
                        scales = None
        if scales is None:
            scales = search_block_scales(x.float(), gs, col_weight=col_weight)
        return quantize_with_scales(x, gs, scales)


def _default_hessian_budget(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 4
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 8 << 30


class _HessianStream:
    """GPTQ's Hessians for the quantization loop, which asks for them (``pop``) in plan order: each
    calibration pass collects the next inputs' Hessians up to ``budget`` bytes (``K^2 * 4`` each; at least
    one per pass), so at most one pass's worth waits in memory. The first pass's come from the main
    calibration run (``first``); the calibration model stays loaded until the last pass."""

    def __init__(self, calibrator, order: list[tuple[str, int]], budget: int, first: dict[str, torch.Tensor],
                 first_keys: set[str]):
        self.cal = calibrator
        self.order = order
        self.index = {k: i for i, (k, _) in enumerate(order)}
        self.budget = budget
        self.ready = first
        self.covered = set(first_keys)
        self.seconds = 0.0          # the later passes' calibration time (the quantization loop waits on it)
        if self.covered >= set(self.index):
            self.close()

    @staticmethod
    def chunk(order: list[tuple[str, int]], start: int, budget: int, skip=frozenset()) -> list[str]:
        """Keys from ``order[start]`` on (less ``skip``, those collected already) up to ``budget`` bytes, at least
        one."""
        keys, total = [], 0
        for key, nbytes in order[start:]:
            if key in skip:
                continue
            if keys and total + nbytes > budget:
                break
            keys.append(key)
            total += nbytes
        return keys

    def pop(self, key: str, default=None):
        if key in self.ready:
            return self.ready.pop(key)
        if key in self.covered or key not in self.index:
            return default              # its pass ran and never saw this input (an expert no token reached)
        keys = self.chunk(self.order, self.index[key], self.budget, self.covered)
        self.covered.update(keys)
        t = time.time()
        self.cal.collect(hessians=self.ready, hessian_keys=set(keys))
        self.seconds += time.time() - t
        if self.covered >= set(self.index):
            self.close()
        return self.ready.pop(key, default)

    def close(self) -> None:
        self.cal.close()


def _hessian_order(plan: QuantPlan) -> list[tuple[str, int]]:
    """``(naming.shared_input_key, K^2 * 4 bytes)`` of every distinct quantized input, in plan order."""
    order, seen = [], set()
    for kind, x in plan.items:
        if kind != "quant":
            continue
        for m in x.modules:
            key = naming.shared_input_key(m)
            if key not in seen:
                seen.add(key)
                k = plan.quantized[m][1]
                order.append((key, k * k * 4))
    return order


class _GptqQuantizer:
    """``--method gptq``: one Hessian factorisation per distinct module input (fused shards share it,
    also when ``--per-shard-global-scales`` quantizes them one by one), each Hessian released once
    factorised and each factor after the last module reading that input. A module whose input
    calibration never saw (an expert no token reached) gets the unweighted ``mse`` search instead,
    counted in ``fallbacks``."""

    def __init__(self, hessians: dict[str, torch.Tensor], modules, settings):
        self.hessians = hessians
        self.settings = settings
        self.users: dict[str, int] = defaultdict(int)
        for m in modules:
            self.users[naming.shared_input_key(m)] += 1
        self.factors: dict[str, object] = {}
        self.fallbacks: list[str] = []

    def __call__(self, modules: list[str], xs: list[torch.Tensor], gs: torch.Tensor, mse_quantizer):
        """``[(packed, block scales)]`` for ``xs`` (one fused group's shards, or one module) under ``gs``."""
        from .gptq import factor_hessian, gptq_quantize

        key = naming.shared_input_key(modules[0])
        if key not in self.factors:
            h = self.hessians.pop(key, None)
            try:
                self.factors[key] = None if h is None else factor_hessian(h.to(xs[0].device), self.settings, name=key)
            except ValueError as exc:
                raise CheckpointError(problem(None, key, str(exc))) from None
        factor = self.factors[key]
        self.users[key] -= len(modules)
        if self.users[key] <= 0:
            del self.factors[key]
        if factor is None:
            self.fallbacks += modules
            return [mse_quantizer(x, gs, None) for x in xs]
        # rows are independent given H: the shards of a group go through one column loop
        res = gptq_quantize(torch.cat(xs) if len(xs) > 1 else xs[0], gs, factor, self.settings)
        out, r0 = [], 0
        for x in xs:
            r1 = r0 + x.shape[0]
            out.append((res.packed[r0:r1], res.block_scale[r0:r1]))
            r0 = r1
        return out


def _quantize_group(group: QuantGroup, tensors, files: CheckpointFiles, device, options: QuantizeOptions,
                    quant_algo: str, input_amax: dict[str, float], writer: ShardedWriter, quantizer,
                    moments: dict[str, torch.Tensor] | None = None, mse_quantizer=None,
                    gptq_quantizer: _GptqQuantizer | None = None) -> None:
    spec = F.spec(options.format)
    xs = []
    amaxes = []
    for m, t in zip(group.modules, tensors):
        x = t.to(device)
        if not bool(torch.isfinite(x).all()):
            raise CheckpointError(problem(files.relname(m + ".weight"), m + ".weight",
                                          "source weight contains NaN or Inf; refusing to quantize it"))
        xs.append(x)
        amaxes.append(x.abs().amax().float())
    if options.per_shard_global_scales:
        scales = [F.global_scale_from_amax_exact(a) for a in amaxes]
    else:
        shared = F.global_scale_from_amax_exact(torch.stack(amaxes).amax())
        scales = [shared] * len(xs)
    in_gs = None
    if quant_algo == F.ALGO_W4A4:
        in_gs = F.global_scale_from_amax_exact(max(input_amax[m] for m in group.modules))
    gptq_out = None
    if options.method == "gptq":
        # one global scale for the whole group unless --per-shard-global-scales (then one module per group)
        gptq_out = gptq_quantizer(group.modules, xs, scales[0].to(device), mse_quantizer)
    for i, (m, x, gs) in enumerate(zip(group.modules, xs, scales)):
        if gptq_out is not None:
            packed, block = gptq_out[i]
        elif options.method == "mse":
            w = moments.get(m) if moments else None
            packed, block = mse_quantizer(x, gs.to(device), None if w is None else w.to(device))
        else:
            packed, block = quantizer(x, gs.reshape(1).to(device))
        writer.write(f"{m}.{spec.suffix(F.ROLE_WEIGHT)}", packed.cpu())
        writer.write(f"{m}.{spec.suffix(F.ROLE_BLOCK_SCALE)}", block.cpu())
        writer.write(f"{m}.{spec.suffix(F.ROLE_GLOBAL_SCALE)}", F.checkpoint_global_from_encode(gs, options.format))
        if in_gs is not None:
            writer.write(f"{m}.{spec.suffix(F.ROLE_INPUT_SCALE)}",
                         F.checkpoint_input_from_encode(in_gs, options.format))


def _write_configs(src_config: dict, dst: Path, fmt: str, quant_algo: str, exclude_list) -> None:
    cfg = dict(src_config)
    if fmt == F.MODELOPT:
        (dst / HF_QUANT_CONFIG).write_text(json.dumps(modelopt_hf_quant_config(quant_algo, exclude_list), indent=4)
                                           + "\n")
        cfg["quantization_config"] = modelopt_quantization_config(quant_algo, exclude_list)
    else:
        cfg["quantization_config"] = compressed_tensors_quantization_config(quant_algo, exclude_list)
    (dst / CONFIG_JSON).write_text(json.dumps(cfg, indent=2) + "\n")


def quantize_checkpoint(src, dst, options: QuantizeOptions | None = None, **kwargs) -> QuantizeReport:
    """Quantize the checkpoint folder ``src`` into ``dst`` (see the module docstring)."""
    options = options or QuantizeOptions(**kwargs)
    if options.format not in F.FORMATS:
        raise ValueError(f"format: expected one of {F.FORMATS}, got {options.format!r}")
    if options.method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {options.method!r}")
    if options.method == "gptq" and not options.calibration:
        raise CheckpointError(problem(None, None, "--method gptq needs calibration (its Hessians come from running "
                                                  "the model); --no-calibration allows --method rtn or mse only "
                                                  "(for a weight-only gptq checkpoint use --weights-only)"))
    if options.gptq_hessian_memory_gb is not None and not 0 < options.gptq_hessian_memory_gb < math.inf:
        raise CheckpointError(problem(None, None, f"--gptq-hessian-memory: expected a positive, finite number of GB, "
                                                  f"got {options.gptq_hessian_memory_gb}"))
    gptq_settings = None
    if options.method == "gptq":
        from .gptq import GptqSettings

        try:
            gptq_settings = GptqSettings(options.gptq_damping, options.gptq_block_size, options.gptq_act_order)
        except ValueError as exc:
            raise CheckpointError(problem(None, None, str(exc))) from None
    t_start = time.time()
    src, dst = Path(src), Path(dst)
    if dst.exists() and not options.overwrite:
        raise FileExistsError(f"{dst} exists (pass --overwrite to replace it)")
    if dst.resolve() == src.resolve():
        raise ValueError("DST must differ from SRC")
    cfg_path = src / CONFIG_JSON
    if not cfg_path.exists():
        raise CheckpointError(problem(src, None, f"no {CONFIG_JSON}: not a Hugging Face model folder"))
    src_config = json.loads(cfg_path.read_text())
    if src_config.get("quantization_config") or (src / HF_QUANT_CONFIG).exists():
        how = (src_config.get("quantization_config") or {}).get("quant_method", HF_QUANT_CONFIG)
        raise CheckpointError(problem(CONFIG_JSON, None, f"the source is already quantized ({how}); "
                                                         "quantize a bf16/fp16 checkpoint"))
    device = _resolve_device(options.device)
    if options.method == "mse" and device.type == "cpu":
        logger.info("nvfp4_plugin: quantize: the mse block-scale search runs on the CPU (no GPU here): several times "
                    "rtn's time (a GPU takes seconds); --method rtn is the fastest")
    files = CheckpointFiles(src)
    quant_algo = F.ALGO_W4A4 if options.calibration and not options.weights_only else F.ALGO_W4A16
    plan = plan_quantization(files, options, quant_algo)
    if not plan.quantized:
        raise CheckpointError(problem(src, None, "nothing to quantize: every linear weight is excluded"))

    input_amax: dict[str, float] = {}
    moments: dict[str, torch.Tensor] | None = {} if options.method == "mse" else None
    hessians: dict[str, torch.Tensor] | _HessianStream | None = {} if options.method == "gptq" else None
    filled: list[str] = []
    t_cal = time.time()
    if options.calibration and (quant_algo == F.ALGO_W4A4 or moments is not None or hessians is not None):
        from .calibrate import Calibrator

        cal = Calibrator(src, files, plan.modules, device=device, texts=options.calib_texts,
                         samples=options.calib_samples, seq_len=options.calib_seq_len,
                         batch_size=options.calib_batch_size)
        try:
            first_keys = None
            if hessians is not None:
                order = _hessian_order(plan)
                budget = (int(options.gptq_hessian_memory_gb * 1e9) if options.gptq_hessian_memory_gb is not None
                          else _default_hessian_budget(device))
                first_keys = set(_HessianStream.chunk(order, 0, budget))
            raw = cal.collect(second_moments=moments, hessians=hessians,
                              hessian_keys=None if first_keys is None or len(first_keys) == len(order) else first_keys)
            if hessians is not None:
                hessians = _HessianStream(cal, order, budget, hessians, first_keys)
                if len(first_keys) < len(order):
                    logger.info("nvfp4_plugin: gptq: Hessians of %d inputs (%.1f GB) in passes of at most %.1f GB",
                                len(order), sum(b for _, b in order) / 1e9, budget / 1e9)
            else:
                cal.close()
            if quant_algo == F.ALGO_W4A4:
                input_amax, filled = _input_amax_for(plan, raw)
        except BaseException:
            cal.close()       # the model kept for later Hessian passes too
            raise
        if filled:
            logger.warning("nvfp4_plugin: %d experts received no calibration tokens; they use their layer's "
                           "largest input amax", len(filled))
    t_cal = time.time() - t_cal

    writer = None
    reader = None
    bar = None
    t_q = time.time()
    try:
        with staged_output_dir(dst) as tmp:
            try:
                copy_side_files(src, tmp, dst, skip_names=(CONFIG_JSON, HF_QUANT_CONFIG))
                _write_configs(src_config, tmp, options.format, quant_algo, plan.exclude_list)
                writer = ShardedWriter(tmp, plan.specs, parse_size(options.max_shard_size),
                                       metadata={"format": "pt", "producer": "nvfp4-plugin"})
                if options.progress:
                    from tqdm import tqdm
                    bar = tqdm(total=sum(i.nbytes for i in files.tensors.values()), unit="B", unit_scale=True,
                               desc=f"quantize ({device.type})")
                quantizer = _Quantizer()
                mse_quantizer = _MseQuantizer()
                gptq_quantizer = (_GptqQuantizer(hessians, plan.modules, gptq_settings)
                                  if hessians is not None else None)
                # Read each group's source tensors two groups ahead, on a background thread.
                reader = ReadAhead(plan.items,
                                   lambda it: [files.read(w) for w in it[1].weights()] if it[0] == "quant" else None)
                for (kind, x), data in reader:
                    if kind == "copy":
                        writer.write_raw(x, files.file_of(x), x)
                        done = files.info(x).nbytes
                    else:
                        _quantize_group(x, data, files, device, options, quant_algo, input_amax, writer, quantizer,
                                        moments, mse_quantizer, gptq_quantizer)
                        done = sum(t.numel() * t.element_size() for t in data)
                    if bar is not None:
                        bar.update(done)
                writer.close()
                if bar is not None:
                    bar.close()
                    bar = None
                if gptq_quantizer is not None and gptq_quantizer.fallbacks:
                    logger.warning("nvfp4_plugin: gptq: %d modules had no calibration input (first: %s); they use "
                                   "the unweighted mse search", len(gptq_quantizer.fallbacks),
                                   gptq_quantizer.fallbacks[0])
                # Our own loader must accept the result (headers, shapes, config, scalar scale values).
                from .loader import validate_checkpoint
                validate_checkpoint(tmp, check_block_scales=False)
                out_files = list(writer.names)
                bytes_out = sum((tmp / f).stat().st_size for f in out_files)
                t_q = time.time() - t_q
                if isinstance(hessians, _HessianStream):     # its later passes are calibration, not quantization
                    t_cal, t_q = t_cal + hessians.seconds, t_q - hessians.seconds
            except BaseException:  # close what holds files in tmp before it is deleted
                if reader is not None:
                    reader.close()
                if writer is not None:
                    writer.abort()
                if bar is not None:
                    bar.close()
                raise
    finally:
        if isinstance(hessians, _HessianStream):
            hessians.close()      # the calibration model, if a pass was still to come
        files.close()
    if reader is not None:
        reader.close()
    return QuantizeReport(str(dst), options.format, quant_algo, len(plan.quantized), dict(plan.excluded), out_files,
                          sum(i.nbytes for i in files.tensors.values()), bytes_out, t_cal, t_q,
                          time.time() - t_start, str(device), filled, options.method)
