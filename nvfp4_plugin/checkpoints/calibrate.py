"""Activation calibration for ``quantize``: per-linear input amax from a forward pass of the bf16 model.

The model is built by transformers from ``config.json`` directly on the target device and filled
from the safetensors files one tensor at a time (``pread``, no memory map), so host memory stays at
one tensor even for large models; names the hub and transformers disagree on (Mixtral's
``block_sparse_moe`` -> ``mlp``; per-expert tensors -> transformers 5's fused ``experts.gate_up_proj``
/ ``experts.down_proj``) are mapped here. If a model has parameters this mapping does not cover,
``from_pretrained`` loads it instead (with a warning: it maps whole files and uses more host memory).

Forward pre-hooks record ``max |x|`` (finite values) of the input of every ``nn.Linear`` to be
quantized. Fused expert modules get one hook that splits the tokens by routed expert and records,
per expert, the amax of its input and of ``act(gate) * up`` (the down projection's input). Experts
that receive no calibration token are left out; the quantizer gives them their layer's largest
value.

On request the same pass also collects, per dense module, the mean squared input per column
(``quantize --method mse``'s weights) and, per distinct module input (:func:`naming.shared_input_key`:
q/k/v share one, gate/up one, each expert's gate/up one), the Hessian ``X^T X / tokens`` in fp32
``[K, K]`` on the calibration device (``--method gptq``; memory ``K^2 * 4`` bytes per distinct input,
e.g. 0.35 GB per layer of Qwen2.5-1.5B, whose down projection has K = 8960, ~1 GB per layer of an 8B
model). :class:`Calibrator` keeps the model loaded so that ``quantize`` can collect the Hessians in
several passes within a memory budget (``--gptq-hessian-memory``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from pathlib import Path

import torch

from . import corpus, naming
from .errors import CheckpointError, problem, require
from .safetensors_io import CheckpointFiles, ReadAhead

logger = logging.getLogger("nvfp4_plugin")


class _MappingIncomplete(Exception):
    pass


def _finite_amax(x: torch.Tensor) -> torch.Tensor:
    a = x.detach().abs().float()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax() if a.numel() else a.new_zeros(())


def _model_dtype(config, files: CheckpointFiles) -> torch.dtype:
    from .safetensors_io import DTYPES

    counts: dict[str, int] = defaultdict(int)
    for info in files.tensors.values():
        counts[info.dtype] += info.nbytes
    common = max(counts, key=counts.get)
    return DTYPES.get(common, torch.bfloat16) if common in ("BF16", "F16", "F32") else torch.bfloat16


def _expert_param(state: dict, model_prefix: str, role: str):
    """(parameter, rows slice or None, transposed) for a transformers 5 fused-experts tensor."""
    if role in ("gate", "up"):
        p = state.get(model_prefix + ".gate_up_proj")
        if p is None:
            return None
        return p, role
    p = state.get(model_prefix + ".down_proj")
    return None if p is None else (p, role)


def _copy_expert(param: torch.Tensor, role: str, e: int, t: torch.Tensor) -> bool:
    """Copy one hub expert tensor ``[out, in]`` into a fused ``[E, 2I, H]`` / ``[E, H, I]`` parameter
    (or the transposed ``[E, H, 2I]`` / ``[E, I, H]`` layout). False if the shapes do not fit."""
    dst = param[e]
    out_f, in_f = t.shape
    if role == "down":
        if tuple(dst.shape) == (out_f, in_f):
            dst.copy_(t)
            return True
        if tuple(dst.shape) == (in_f, out_f):
            dst.copy_(t.t())
            return True
        return False
    off = 0 if role == "gate" else out_f
    if dst.shape[0] == 2 * out_f and dst.shape[1] == in_f:
        dst[off:off + out_f].copy_(t)
        return True
    if dst.shape[1] == 2 * out_f and dst.shape[0] == in_f:
        dst[:, off:off + out_f].copy_(t.t())
        return True
    return False


def load_model(src: Path, files: CheckpointFiles, device: torch.device, dtype: torch.dtype | None = None):
    """The bf16 model on ``device`` and a map ``model module name -> hub module name`` (plus, for fused
    expert modules, ``model module name -> hub experts prefix``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src)
    dtype = dtype or _model_dtype(config, files)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.eval()
        names = _load_streaming(model, files, device)
    except _MappingIncomplete as exc:
        logger.warning("nvfp4_plugin: calibration: %s; loading with transformers' from_pretrained instead "
                       "(maps whole files: host memory grows with the model)", exc)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, device_map=str(device))
        model.eval()
        names = _names_by_convention(model, files)
    return model, names


def _load_streaming(model, files: CheckpointFiles, device) -> dict[str, str]:
    state = model.state_dict()
    assigned: set[str] = set()
    expert_writes: dict[str, int] = defaultdict(int)
    module_map: dict[str, str] = {}
    unmapped = []
    order = [i.name for i in sorted(files.tensors.values(), key=lambda i: (i.file, i.begin))]
    with torch.no_grad(), ReadAhead(order, files.read) as tensors:
        for name, t in tensors:
            target = name if name in state else naming.hub_to_transformers(name)
            if target in state:
                if tuple(t.shape) != tuple(state[target].shape):
                    raise _MappingIncomplete(f"{name}: shape {list(t.shape)} does not fit {target} "
                                             f"{list(state[target].shape)}")
                state[target].copy_(t.to(device))
                assigned.add(target)
                module_map[target.rsplit(".", 1)[0]] = name.rsplit(".", 1)[0]
                continue
            module, _, suffix = name.rpartition(".")
            ex = naming.parse_expert(module)
            if ex is not None and suffix == "weight":
                mp = naming.hub_to_transformers(ex.prefix)
                found = _expert_param(state, mp, ex.role)
                if found is not None:
                    t = t.to(device)
                    if not _copy_expert(found[0], ex.role, ex.expert, t):
                        raise _MappingIncomplete(f"{name}: shape {list(t.shape)} does not fit fused experts "
                                                 f"{list(found[0].shape)}")
                    key = mp + (".down_proj" if ex.role == "down" else ".gate_up_proj")
                    expert_writes[key] += 1
                    module_map[mp] = ex.prefix
                    continue
            unmapped.append(name)
    if unmapped:
        raise _MappingIncomplete(f"{len(unmapped)} checkpoint tensors have no place in the transformers model "
                                 f"(first: {unmapped[0]})")
    missing = []
    for pname, p in model.named_parameters():
        if pname in assigned:
            continue
        if pname in expert_writes:
            need = p.shape[0] * (2 if pname.endswith("gate_up_proj") else 1)
            if expert_writes[pname] == need:
                continue
        missing.append(pname)
    if missing:
        raise _MappingIncomplete(f"{len(missing)} model parameters are not in the checkpoint (first: {missing[0]})")
    return module_map


def _names_by_convention(model, files: CheckpointFiles) -> dict[str, str]:
    hub_modules = {n.rsplit(".", 1)[0] for n in files.tensors}
    out = {}
    for hub in hub_modules:
        ex = naming.parse_expert(hub)
        if ex is not None:
            out[naming.hub_to_transformers(ex.prefix)] = ex.prefix
        else:
            out[naming.hub_to_transformers(hub)] = hub
    return out


def calibration_batches(src: Path, texts: list[str] | None, samples: int, seq_len: int) -> torch.Tensor:
    """``[n, seq_len]`` token ids: the texts joined, tokenized with the checkpoint's tokenizer, chunked."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(src)
    except Exception as exc:  # noqa: BLE001 - any tokenizer failure means the same thing here
        raise CheckpointError(problem(src, None, f"calibration needs the checkpoint's tokenizer, which failed to load "
                                                 f"({exc}); use --no-calibration for weight-only NVFP4")) from exc
    text = "\n\n".join(texts if texts is not None else corpus.texts())
    ids = tok(text, add_special_tokens=True)["input_ids"]
    if len(ids) < 2:
        raise CheckpointError(problem(None, None, "calibration text is empty"))
    seq_len = min(seq_len, len(ids))
    n = max(1, min(samples, len(ids) // seq_len))
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).reshape(n, seq_len)


def read_calibration_file(path) -> list[str]:
    """Paragraphs (blank-line separated) of a UTF-8 text file; a JSONL file's "text" fields."""
    p = Path(path)
    raw = p.read_text(encoding="utf-8")
    if p.suffix == ".jsonl":
        import json

        return [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
    parts = [x.strip() for x in raw.split("\n\n")]
    return [x for x in parts if x]


def calibrate_input_amax(src, files: CheckpointFiles, modules, *, device, texts: list[str] | None = None,
                         samples: int = 16, seq_len: int = 512, batch_size: int = 4,
                         second_moments: dict[str, torch.Tensor] | None = None,
                         hessians: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
    """``{hub module name: input amax}`` for the requested (to-be-quantized) hub modules. With
    ``second_moments`` (a dict, filled in place): each dense module's mean squared input per column
    (fp32 ``[K]``, on the CPU), the weights of ``quantize --method mse``'s block error. With
    ``hessians`` (a dict, filled in place): ``{naming.shared_input_key(module): X^T X / tokens}``, fp32
    ``[K, K]`` on ``device``, for every requested module whose input the pass saw (GPTQ's Hessians).
    One forward pass of a :class:`Calibrator`, which is what to keep when more passes follow."""
    cal = Calibrator(src, files, modules, device=device, texts=texts, samples=samples, seq_len=seq_len,
                     batch_size=batch_size)
    try:
        return cal.collect(second_moments=second_moments, hessians=hessians)
    finally:
        cal.close()


class Calibrator:
    """The bf16 model and the calibration token batches, loaded once; each :meth:`collect` is one
    forward pass over all batches with the requested recorders hooked. ``quantize --method gptq``
    keeps one open to collect the Hessians in several passes, a few layers' worth each, instead of
    holding every Hessian of the model at once."""

    def __init__(self, src, files: CheckpointFiles, modules, *, device, texts: list[str] | None = None,
                 samples: int = 16, seq_len: int = 512, batch_size: int = 4):
        require("transformers", "calibration", "; or pass --no-calibration for weight-only NVFP4")
        self.src = Path(src)
        self.device = torch.device(device)
        self.wanted = set(modules)
        self.batch_size = batch_size
        t0 = time.time()
        self.batches = calibration_batches(self.src, texts, samples, seq_len)
        self.model, self.module_map = load_model(self.src, files, self.device)
        self.t_load = time.time() - t0
        self.passes = 0

    def close(self) -> None:
        if self.model is None:
            return
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def collect(self, *, second_moments: dict[str, torch.Tensor] | None = None,
                hessians: dict[str, torch.Tensor] | None = None,
                hessian_keys: set[str] | None = None) -> dict[str, float]:
        """One pass: input amax of every requested module (returned); ``second_moments`` and
        ``hessians`` as in :func:`calibrate_input_amax`, the Hessians only of ``hessian_keys``
        (``naming.shared_input_key`` values) when given."""
        if self.model is None:
            raise RuntimeError("Calibrator.collect after close()")
        wanted, model, module_map, device = self.wanted, self.model, self.module_map, self.device
        stats: dict[str, torch.Tensor] = {}

        def record(key: str, value: torch.Tensor) -> None:
            prev = stats.get(key)
            stats[key] = value if prev is None else torch.maximum(prev, value)

        sums: dict[str, list] = {}

        def record_moment(key: str, x: torch.Tensor) -> None:
            x2 = x.reshape(-1, x.shape[-1]).float()
            sq = torch.nan_to_num(x2 * x2, nan=0.0, posinf=0.0).sum(0)
            prev = sums.get(key)
            sums[key] = [sq, x2.shape[0]] if prev is None else [prev[0] + sq, prev[1] + x2.shape[0]]

        gram: dict[str, list] = {}

        def record_hessian(key: str, x: torch.Tensor) -> None:
            if hessian_keys is not None and key not in hessian_keys:
                return
            x2 = torch.nan_to_num(x.reshape(-1, x.shape[-1]).float(), nan=0.0, posinf=0.0, neginf=0.0)
            prev = gram.get(key)
            if prev is None:
                prev = gram[key] = [torch.zeros((x2.shape[1], x2.shape[1]), dtype=torch.float32, device=x2.device),
                                    0]
            prev[0].addmm_(x2.t(), x2)
            prev[1] += x2.shape[0]

        hooks = []
        expert_prefixes = {}
        for hub_prefix in {naming.parse_expert(m).prefix for m in wanted if naming.parse_expert(m)}:
            per_expert: dict[int, dict[str, str]] = defaultdict(dict)
            for m in wanted:
                ex = naming.parse_expert(m)
                if ex is not None and ex.prefix == hub_prefix:
                    per_expert[ex.expert][ex.role] = m
            expert_prefixes[hub_prefix] = per_expert

        hessian_hooked: set[str] = set()
        for mname, mod in model.named_modules():
            hub = module_map.get(mname)
            if hub is None:
                continue
            if isinstance(mod, torch.nn.Linear) and hub in wanted:
                hooks.append(mod.register_forward_pre_hook(
                    lambda _m, args, _hub=hub: record(_hub, _finite_amax(args[0]))))
                if second_moments is not None:
                    hooks.append(mod.register_forward_pre_hook(
                        lambda _m, args, _hub=hub: record_moment(_hub, args[0])))
                key = naming.shared_input_key(hub)
                if hessians is not None and key not in hessian_hooked and (hessian_keys is None or key in hessian_keys):
                    hessian_hooked.add(key)   # the other members of the group read the same tensor
                    hooks.append(mod.register_forward_pre_hook(
                        lambda _m, args, _key=key: record_hessian(_key, args[0])))
            elif hub in expert_prefixes and hasattr(mod, "gate_up_proj") and hasattr(mod, "down_proj"):
                hooks.append(mod.register_forward_pre_hook(
                    _expert_hook(expert_prefixes[hub], record, record_hessian if hessians is not None else None),
                    with_kwargs=True))
        t1 = time.time()
        try:
            with torch.inference_mode():
                for i in range(0, self.batches.shape[0], self.batch_size):
                    model(input_ids=self.batches[i:i + self.batch_size].to(device), use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        self.passes += 1
        out = {k: float(v.item()) for k, v in stats.items()}
        if second_moments is not None:
            second_moments.update({k: (sq / max(n, 1)).cpu() for k, (sq, n) in sums.items()})
        if hessians is not None:
            for k in list(gram):
                h, n = gram.pop(k)
                hessians[k] = h / max(n, 1)   # one Hessian at a time in two copies, not all of them
                del h
        logger.info("nvfp4_plugin: calibration pass %d: %d sequences x %d tokens, model load %.1fs, forward %.1fs, "
                    "%d modules, Hessians of %s inputs", self.passes, self.batches.shape[0], self.batches.shape[1],
                    self.t_load, time.time() - t1, len(out),
                    "no" if hessians is None else "all" if hessian_keys is None else len(hessian_keys))
        return out


def _expert_hook(per_expert: dict[int, dict[str, str]], record, record_hessian=None):
    def hook(mod, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
        x = x.reshape(-1, x.shape[-1])
        idx = idx.reshape(x.shape[0], -1)
        act = getattr(mod, "act_fn", torch.nn.functional.silu)
        for e, roles in per_expert.items():
            rows = (idx == e).any(dim=-1)
            if not bool(rows.any()):
                continue
            xe = x[rows]
            a_in = _finite_amax(xe)
            for r in ("gate", "up"):
                if r in roles:
                    record(roles[r], a_in)
            if record_hessian is not None and ("gate" in roles or "up" in roles):
                record_hessian(naming.shared_input_key(roles.get("gate") or roles["up"]), xe)
            if "down" in roles:
                w = mod.gate_up_proj[e]
                gu = xe @ (w.t() if w.shape[-1] == xe.shape[-1] else w)
                gate, up = gu.chunk(2, dim=-1)
                down_in = act(gate) * up
                record(roles["down"], _finite_amax(down_in))
                if record_hessian is not None:
                    record_hessian(roles["down"], down_in)
    return hook


def fill_missing_experts(amax: dict[str, float], modules) -> list[str]:
    """Experts no calibration token reached get the largest amax of their layer and role (in place).
    Returns the modules filled this way."""
    by_layer: dict[tuple[str, str], list[str]] = defaultdict(list)
    for m in modules:
        ex = naming.parse_expert(m)
        if ex is not None:
            by_layer[(ex.prefix, "down" if ex.role == "down" else "in")].append(m)
    filled = []
    for mods in by_layer.values():
        seen = [amax[m] for m in mods if m in amax and math.isfinite(amax[m])]
        if not seen:
            continue
        top = max(seen)
        for m in mods:
            if m not in amax:
                amax[m] = top
                filled.append(m)
    return filled
