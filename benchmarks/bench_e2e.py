#!/usr/bin/env python3
"""End-to-end served throughput: our NVFP4 layers against the engines' built-in NVFP4 and bf16.

    python -m benchmarks.bench_e2e run --out DIR                 # models, every engine config, report
    python -m benchmarks.bench_e2e run --out DIR --engines vllm --models dense --configs ours marlin
    python -m benchmarks.bench_e2e run --out DIR --models moe --configs ours marlin --tp 2 --ep   # expert parallel
    python -m benchmarks.bench_e2e run --out DIR --models moe --gpus 0 1     # two engines at a time, one per GPU
    python -m benchmarks.bench_e2e run --out DIR --engines vllm sglang --site vllm=/tmp/site \
        --site sglang=/tmp/site_sg --gpus 0 1 2 3 --serve                    # everything, four engines at a time
    python -m benchmarks.bench_e2e report DIR                    # table + plot from DIR's JSON results
    python -m benchmarks.bench_e2e prebuild-sglang-jit           # SGLang's nvcc JIT kernels, ahead of `run`
    nvfp4-plugin bench e2e --out DIR ...                         # the same as `run`

On the GPU machine, with the vLLM bundle (and, for `--engines sglang`, the SGLang bundle) on
``PYTHONPATH``, or each named with ``--site``. `run` builds two random-weight checkpoints with
``nvfp4-plugin make-model`` (the Llama-3-8B shape, "dense"; the Qwen3-30B-A3B shape with 12 layers, "moe", or
``--moe-layers N`` of its 48)
and quantizes each with our quantizer (calibrated ModelOpt NVFP4). Then every engine configuration runs in
its own process, started as a user starts it (``vllm.LLM`` with vLLM's default start method, ``sglang.Engine``):

    vllm:   bf16 | marlin (built-in modelopt_fp4, default backend) | humming (the same, Humming
            kernels) | ours (--quantization nvfp4)
    sglang: bf16 | builtin (modelopt_fp4) | ours
    both, only when named in --configs: ours-triton-launch (ours with NVFP4_PLUGIN_FAST_LAUNCH=0: every
            kernel launch through Triton's launch path, the A/B of the plugin's direct launches)

Each first answers the engine process's first request (one 16-token prompt, 8 generated tokens, then the same
again: what the engine pays once per process, recorded apart from the shapes' first runs), then measures decode
throughput at every batch size of ``--batches`` (``--prompt-len`` prompt tokens,
``--gen-len`` generated tokens with ``ignore_eos``; output tokens per second of wall time, prefill included),
with fresh random prompts each run: a warm-up run (recorded: the first request of a shape must be as fast as
later ones), then ``--repeats`` runs whose median is the number (all recorded: a small model's decode step is
~1 ms of GPU work, so the engine's host overhead makes single runs vary by up to ±30%; over the measured runs
each batch also records the CPU time per decode step of the busiest processes of the engine's process tree,
the host loop those steps wait on). Prefill: ``--prefill`` prompts (64 x 896 by default) generating one token,
prompt tokens per second, the median of ``--prefill-repeats`` runs after a warm-up run (7 by default: single
prefill runs of vLLM's offline engine spread by 20-25%). With ``--profile-batches``, the engine's torch profiler
(vLLM's; SGLang's by stage) records decode steps of every configuration at those batch sizes, and full prefill
steps (vLLM's ``max_num_batched_tokens``, SGLang's ``chunked_prefill_size`` prompt tokens each): kernels by time
per step and share, plus the host side
(CUDA-graph and eager kernel launches per step, the share of the step the GPU was busy). With ``--serve``, each engine's OpenAI server (``vllm serve``,
``sglang.launch_server``) of ours and of that engine's best built-in answers one first request once it reports
ready (recorded: what a user's first request meets), then streaming completions from ``--concurrency``
clients: tokens/s, time to first token and inter-token latency (p50 / p99). vLLM runs also record the
worker's torch allocator counters over one extra prefill run (cudaMalloc retries synchronise the device: wall
time the kernel profile does not show).

After its sweep each configuration records the prompt logprobs of four fixed 64-token prompts (the same ids
in every process); the report compares ours with the built-ins on the same checkpoint (vLLM's two built-in
backends' own difference as the tolerance) and with bf16.

With ``--gpus``, engine processes run side by side, one per ``--tp`` GPUs of the list, sharing the host's
CPUs (each decode run records how busy the machine was outside its engine); the ``--serve`` servers too, each
engine's once its own sweeps have ended (beside the other engine's), each on its slot's GPU and port (``--port``
+ the slot's place); the two servers of an engine and model start together and, once both are up, measure in
turn (each phase of one while the other waits: :class:`ServeTurns`), so neither is measured beside the other's
start-up. With ``--site ENGINE=DIR`` for each engine, one run takes both: each engine's processes
get their own bundle first on ``PYTHONPATH`` and never the other's, and SGLang's JIT prebuild runs in SGLang's
environment while vLLM's configurations run (SGLang's wait for it). Before the engines of a ``--gpus`` run start,
each GPU runs the same power-capped bf16 GEMM loop at once (``gpu-check``; ``--no-gpu-check`` skips it): GPUs
of one host at their power caps need not be equal, and the report puts their TFLOP/s beside the placement.

Results: one JSON per configuration in DIR, ``e2e.md`` (tables, ratios, the floors of the
end-to-end issue) and ``e2e.png`` (tokens/s against batch size).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import gzip
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODELS = {"dense": ("llama", "Llama-3-8B shape"), "moe": ("qwen3_moe", "Qwen3-30B-A3B shape, 12 layers")}
#: engine -> config -> (checkpoint kind, --quantization, extra engine arguments)
CONFIGS = {
    "vllm": {
        "bf16": ("bf16", None, {}),
        "marlin": ("nvfp4", None, {}),
        "humming": ("nvfp4", None, {"linear_backend": "humming", "moe_backend": "humming"}),
        "ours": ("nvfp4", "nvfp4", {}),
    },
    "sglang": {
        "bf16": ("bf16", None, {}),
        "builtin": ("nvfp4", None, {}),
        "ours": ("nvfp4", "nvfp4", {}),
    },
}
#: A/B configurations, run only when named in --configs: ours with environment variables set in its process
CONFIG_ENV = {"ours-triton-launch": {"NVFP4_PLUGIN_FAST_LAUNCH": "0"}}
for _engine in CONFIGS.values():
    _engine.update({name: _engine["ours"] for name in CONFIG_ENV})
BUILTIN = {"vllm": ("marlin", "humming"), "sglang": ("builtin",)}
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
#: further prefill shapes (prompts x tokens), ms per run of each: one chunk of 16384 tokens, half of one, four; and
#: the sweep's prompts alone, one and eight of them (what a served request's time to first token waits for)
PREFILL_SHAPES = ("16x1024", "8x1024", "64x1024", "1x128", "8x128")
#: the engine's first request (:func:`engine_first_request`): a prompt length no sweep shape uses, and a few tokens
ENGINE_FIRST_PROMPT = 16
ENGINE_FIRST_GEN = 8


def default_configs(engine: str) -> list[str]:
    """The configurations a run without --configs measures: all but the A/B ones."""
    return [c for c in CONFIGS[engine] if c not in CONFIG_ENV]


def config_env(env: dict, config: str) -> dict:
    """The environment of a configuration's engine process."""
    extra = CONFIG_ENV.get(config)
    return {**env, **extra} if extra else env


def parallel_tag(tp: int, ep: bool) -> str:
    """``tp1`` (one GPU), ``tp2``, ``tp2-ep`` (expert parallel over the tensor-parallel ranks)."""
    return f"tp{tp}" + ("-ep" if ep else "")


def parallel_kwargs(engine: str, tp: int, ep: bool) -> dict:
    """Engine arguments of tensor / expert parallelism on these machines (no NVLink multicast).

    vLLM: its custom all-reduce and the fused all-reduce + RMSNorm pass need multicast (a TP=2 engine dies at
    its profiling run without these; integration/e2e.sh's ``tp`` step), so NCCL all-reduce; with ``ep`` the
    MoE layers take vLLM's default all-to-all for expert parallelism, allgather_reducescatter (global
    expert ids mapped to this rank's experts). SGLang: ``ep_size`` equal to ``tp_size``, NCCL all-reduce
    (its custom all-reduce off, as in vLLM, and the FlashInfer all-reduce fusion it turns on by itself for
    Qwen3-MoE and Llama at TP > 1: its kernels JIT-compiled for 4.5 minutes at a TP=2 server's first start)."""
    if tp < 1 or (ep and tp < 2):
        raise ValueError(f"--tp must be >= 1 and >= 2 with --ep, got tp={tp}, ep={ep}")
    if tp == 1:
        return {}
    if engine == "vllm":
        kw = {"tensor_parallel_size": tp, "disable_custom_all_reduce": True,
              "compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}}
        if ep:
            kw["enable_expert_parallel"] = True
        return kw
    kw = {"tp_size": tp, "disable_custom_all_reduce": True, "enforce_disable_flashinfer_allreduce_fusion": True}
    if ep:
        kw["ep_size"] = tp
    return kw


# ------------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------------

#: decoder layers of the "moe" checkpoint by default (of Qwen3-30B-A3B's 48; ~16 GB in bf16)
MOE_LAYERS = 12


def model_stem(name: str, moe_layers: int = MOE_LAYERS) -> str:
    """The checkpoint folders' prefix: ``moe`` at the default depth, ``moe-L24`` at another."""
    return name if name != "moe" or moe_layers == MOE_LAYERS else f"{name}-L{moe_layers}"


def model_label(model: str, layers: int | None = None) -> str:
    """The report's name of a model, with the MoE depth its results were measured at."""
    if model == "moe" and layers:
        return f"Qwen3-30B-A3B shape, {layers} layers"
    return MODELS[model][1]


def build_models(model_dir: Path, models, moe_layers: int = MOE_LAYERS) -> dict[str, dict[str, Path]]:
    """``{model: {"bf16": dir, "nvfp4": dir}}``, made with our CLI where missing (``moe_layers``: the MoE
    checkpoint's depth; a deeper one is a larger share of GPU work per decode step against the engine's host
    loop, as the 48-layer model has)."""
    out = {}
    for name in models:
        arch = MODELS[name][0]
        stem = model_stem(name, moe_layers)
        bf16, q = model_dir / f"{stem}-bf16", model_dir / f"{stem}-nvfp4"
        cli = [sys.executable, "-m", "nvfp4_plugin.cli"]
        if not (bf16 / "config.json").exists():
            depth = ["--layers", str(moe_layers)] if name == "moe" and moe_layers != MOE_LAYERS else []
            subprocess.run([*cli, "make-model", str(bf16), "--arch", arch, "--size", "8b-shape", *depth], check=True,
                           cwd=ROOT)
        if not (q / "config.json").exists():
            subprocess.run([*cli, "quantize", str(bf16), str(q), "--format", "modelopt"], check=True, cwd=ROOT)
        out[name] = {"bf16": bf16, "nvfp4": q}
    return out


SGLANG_JIT_CACHE = os.environ.get("TVM_FFI_CACHE_DIR") or os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                                       "tvm-ffi-cache")
#: SGLang 0.5.17's JIT modules of its built-in NVFP4 path on Hopper (Marlin, W4A16): (module, builder, arguments)
SGLANG_MARLIN_JIT = (
    ("sglang.kernels.ops.quantization.gptq_marlin", "_jit_gptq_marlin_module", ("bfloat16",)),
    ("sglang.kernels.ops.quantization.gptq_marlin_repack", "_jit_gptq_marlin_repack_module", ()),
    ("sglang.kernels.ops.moe.moe_wna16_marlin", "_jit_moe_wna16_marlin_module", ("bfloat16", False, False)),
)
#: SGLang 0.5.17's nvcc JIT modules that every configuration first needs at its first request, after start-up:
#: the decode positions' clamp (``forward_batch_info.init_new``; 7.4 s of nvcc on the H200, 2026-11-27). The
#: cache is shared by every engine process of the machine, so without this the first configuration of a run
#: pays it in its first-request number and the later ones do not.
SGLANG_FIRST_USE_JIT = (
    ("sglang.kernels.ops.attention.clamp_position", "_jit_clamp_position_module", ("int64",)),
)


def prebuild_sglang_jit(marlin: bool = True) -> list[str]:
    """Build SGLang's nvcc JIT modules into the cache the engine processes use, in parallel: the ones every
    configuration meets at its first request (:data:`SGLANG_FIRST_USE_JIT`), and with ``marlin`` the built-in
    NVFP4 path's (:data:`SGLANG_MARLIN_JIT`).

    SGLang compiles them with nvcc on first use, which for the built-in NVFP4 path on Hopper is inside the
    engine's CUDA-graph capture at start-up: on the H200 (2026-11-27) the built-in dense configuration was
    still compiling at the first captured size after 420 s (the MoE module alone took 376 s of nvcc, the
    repack module 27 s). Built here once, each engine start finds them.
    Returns one line per module (built or cached, seconds, or the error)."""
    import importlib
    from concurrent.futures import ThreadPoolExecutor

    import torch

    os.environ.setdefault("TVM_FFI_CACHE_DIR", SGLANG_JIT_CACHE)
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")

    # imported here, one after the other: importing them from the build threads deadlocked on the package
    # import locks (H200, 2026-11-27); the builds themselves (nvcc, minutes each) then run in parallel
    specs = SGLANG_FIRST_USE_JIT + (SGLANG_MARLIN_JIT if marlin else ())
    builders = {}
    for mod, fn, _ in specs:
        try:
            builders[mod, fn] = getattr(importlib.import_module(mod), fn)
        except Exception as exc:  # noqa: BLE001 - a later SGLang may have moved them; the engine then builds its own
            builders[mod, fn] = exc

    def build(spec) -> str:
        mod, fn, args = spec
        t = time.perf_counter()
        try:
            if isinstance(builders[mod, fn], Exception):
                raise builders[mod, fn]
            builders[mod, fn](*(getattr(torch, x) if isinstance(x, str) else x for x in args))
            return f"{mod}.{fn}{args}: ready after {time.perf_counter() - t:.0f} s"
        except Exception as exc:  # noqa: BLE001
            return f"{mod}.{fn}{args}: not built ({type(exc).__name__}: {exc})"

    with ThreadPoolExecutor(len(specs)) as pool:
        lines = list(pool.map(build, specs))
    for line in lines:
        print(f"sglang jit: {line}", flush=True)
    return lines


def plugin_env() -> dict:
    """Environment of the engine processes: the source tree importable and its entry points visible
    (a dist-info folder, as ``pip install`` would write) unless the package is installed."""
    env = dict(os.environ)
    env.pop("VLLM_WORKER_MULTIPROC_METHOD", None)        # vLLM's default start method, as users get it
    env["PYTHONUNBUFFERED"] = "1"
    # SGLang JIT-compiles its bf16 kernels: nvcc (CUDA_HOME), ninja and a cache folder
    # (../shared/tools/sglang-bundle/README.md)
    env.setdefault("CUDA_HOME", "/usr/local/cuda")
    env.setdefault("TVM_FFI_CACHE_DIR", SGLANG_JIT_CACHE)
    try:
        import ninja
        env["PATH"] = os.pathsep.join([ninja.BIN_DIR, env.get("PATH", "")])
    except ImportError:
        pass
    from importlib.metadata import entry_points

    if not any(ep.name == "nvfp4" for ep in entry_points(group="vllm.general_plugins")):
        ep_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "nvfp4-e2e-ep"
        subprocess.run([sys.executable, str(ROOT / "integration" / "entry_points.py"), str(ep_dir)], check=True,
                       capture_output=True)
        env["PYTHONPATH"] = os.pathsep.join([str(ep_dir), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


NINJA_BIN = os.path.join("ninja", "data", "bin")


def engine_env(env: dict, engine: str, sites: dict[str, str]) -> dict:
    """``env`` for one engine's processes: its ``--site`` folder first on PYTHONPATH (its ``bin`` first on PATH)
    and every entry inside another engine's ``--site`` taken off both (but a ninja's bin), so each engine imports
    only its own bundle."""
    if not sites:
        return env
    others = [os.path.realpath(d) for e, d in sites.items() if e != engine]

    def keep(entries: str) -> list[str]:
        # off: anything inside another engine's bundle, but a ninja (a build tool SGLang's JIT needs on PATH and
        # plugin_env found wherever this process imports it from: the same binary for either engine)
        return [x for x in entries.split(os.pathsep) if x and (x.rstrip(os.sep).endswith(NINJA_BIN) or not any(
            os.path.commonpath([os.path.realpath(x), o]) == o for o in others))]

    py, path = keep(env.get("PYTHONPATH", "")), keep(env.get("PATH", ""))
    own = sites.get(engine)

    def first(entries: list[str], x: str) -> list[str]:
        return [x] + [y for y in entries if os.path.realpath(y) != os.path.realpath(x)]

    if own:
        py = first(py, own)
        # its scripts, and the ninja its JIT builds run (plugin_env found the parent's, which may be the other's)
        for sub in (NINJA_BIN.split(os.sep), ("bin",)):
            if Path(own, *sub).is_dir():
                path = first(path, str(Path(own, *sub)))
    return {**env, "PYTHONPATH": os.pathsep.join(py), "PATH": os.pathsep.join(path)}


#: the longest the background SGLang JIT prebuild may take (8 minutes on the H200; it once deadlocked on import locks)
PREBUILD_TIMEOUT_S = 1800


class SglangPrebuild:
    """SGLang's JIT prebuild (``prebuild-sglang-jit``) in a process of SGLang's environment, in the background:
    vLLM's configurations run meanwhile, SGLang's call :meth:`wait`, which returns once it has ended (built or
    not, or killed after ``PREBUILD_TIMEOUT_S``: an engine then builds what is missing itself). :meth:`stop`
    ends the process when the run ends first, so no nvcc keeps writing the shared cache behind a rerun."""

    def __init__(self, env: dict, out: Path, marlin: bool):
        self.done = threading.Event()
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        cmd = [sys.executable, "-m", "benchmarks.bench_e2e", "prebuild-sglang-jit"] + ([] if marlin else ["--no-marlin"])
        threading.Thread(target=self._build, args=(cmd, env, out / "prebuild-sglang-jit.log"), daemon=True).start()

    def _build(self, cmd, env, log_path) -> None:
        t = time.time()
        try:
            with open(log_path, "w") as log, self.lock:
                self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                rc = self.proc.wait(timeout=PREBUILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.stop()
                rc = f"killed after {PREBUILD_TIMEOUT_S} s"
            print(f"=== sglang jit prebuild: exit {rc} after {time.time() - t:.0f} s ({log_path.name})", flush=True)
        except Exception as exc:  # noqa: BLE001 - the engines then build what they miss themselves
            print(f"=== sglang jit prebuild: {type(exc).__name__}: {exc}", flush=True)
        finally:
            self.done.set()

    def wait(self) -> None:
        self.done.wait()

    def stop(self) -> None:
        with self.lock:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


class _Ready:
    """The prebuild of a run without SGLang: nothing to wait for."""

    def wait(self) -> None:
        pass

    def stop(self) -> None:
        pass


# ------------------------------------------------------------------------------------------------
# worker: one engine configuration in this process
# ------------------------------------------------------------------------------------------------

def tokenizer_vocab(model_path) -> int:
    """Token ids a prompt may use: the checkpoint's tokenizer vocabulary (engines refuse ids past it)."""
    tok = json.loads((Path(model_path) / "tokenizer.json").read_text())
    return 1 + max([*tok["model"]["vocab"].values(), *(t["id"] for t in tok.get("added_tokens", []))])


class Prompts:
    """Fresh random token ids for every run (no prefix-cache hits between runs)."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng = vocab, random.Random(seed)

    def __call__(self, n: int, length: int) -> list[list[int]]:
        return [[self.rng.randrange(10, self.vocab) for _ in range(length)] for _ in range(n)]


#: Prompts whose per-token prompt logprobs every configuration records after its sweep: the same token ids in
#: every process of an engine (their own seed), so ours, the built-ins and bf16 compare position by position on
#: the same checkpoint (issue 37: served answers stay right)
LOGPROB_PROMPTS = (4, 64)
LOGPROB_SEED = 1234
#: the least tolerance (max, mean |difference| in nats) of the logprob verdict (:func:`logprob_lines`)
LOGPROB_FLOOR = (0.01, 0.001)


def logprob_prompts(vocab: int) -> list[list[int]]:
    # ids below vocab - 1: SGLang's logprob output reports ids from vocab_size - 1 up as 0
    return Prompts(vocab - 1, seed=LOGPROB_SEED)(*LOGPROB_PROMPTS)


def vllm_prompt_logprobs(outs, ids: list[list[int]]) -> list[list[float]]:
    """Each prompt token's logprob from vLLM's outputs of ``prompt_logprobs=0`` (per position a dict that
    holds the prompt token; the first position None), positions 1.. of each prompt."""
    return [[e[t].logprob for e, t in zip(o.prompt_logprobs[1:], p[1:])] for o, p in zip(outs, ids)]


def sglang_prompt_logprobs(outs, ids: list[list[int]]) -> list[list[float]]:
    """The same from ``sglang.Engine.generate(..., return_logprob=True, logprob_start_len=0)``: per prompt
    position (logprob, token id, text), the first position's logprob None; the token ids must be the prompt's."""
    rows = []
    for o, p in zip(outs, ids):
        lp = o["meta_info"]["input_token_logprobs"]
        if [t[1] for t in lp] != p:
            raise ValueError(f"SGLang's input_token_logprobs cover tokens {[t[1] for t in lp][:4]}..., "
                             f"not the prompt's {p[:4]}...")
        rows.append([t[0] for t in lp[1:]])
    return rows


#: Host API calls that start GPU work: a step inside the engine's CUDA graphs launches graphs, not kernels.
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
KERNEL_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def kernel_table(trace_path: str, steps: int, top: int = 15) -> dict:
    """Kernels (and copies) of a torch-profiler chrome trace: total µs per step, share, calls per step, and
    all of them per step (a full-graph decode step runs its graph's nodes: the graph's size); plus the host
    side: CUDA-graph and eager kernel launches per step, the host µs spent in the graph launches per step (a
    launch's host cost grows with the graph and stalls when the launch queue is full), and how busy the GPU
    was between the first and the last kernel (below 1.0 the step waits on the host)."""
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        events = json.load(f)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    by_name: dict[str, list[float]] = {}
    graphs = eager = 0
    n_kernels = 0
    first, last = None, None
    gpu, host = [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            n_kernels += e.get("cat") == "kernel"
            dur = float(e.get("dur", 0.0))
            by_name.setdefault(e["name"], []).append(dur)
            ts = float(e.get("ts", 0.0))
            gpu.append((ts, ts + dur))
            first = ts if first is None else min(first, ts)
            last = ts + dur if last is None else max(last, ts + dur)
        elif e.get("cat") in ("cuda_runtime", "cuda_driver"):
            graphs += e.get("name") in GRAPH_LAUNCHES
            eager += e.get("name") in KERNEL_LAUNCHES
            host.append(e)
        elif e.get("cat") in ("cpu_op", "user_annotation"):
            host.append(e)
    total = sum(sum(v) for v in by_name.values())
    rows = sorted(((sum(v), len(v), k) for k, v in by_name.items()), reverse=True)
    host_by: dict[str, float] = {}
    for e in host:
        host_by[e["name"][:80]] = host_by.get(e["name"][:80], 0.0) + float(e.get("dur", 0.0))
    span = (last - first) if first is not None else 0.0
    return {"steps": steps, "gpu_us_per_step": total / steps,
            "graph_launches_per_step": graphs / steps, "kernel_launches_per_step": eager / steps,
            "kernels_per_step": n_kernels / steps,
            "graph_launch_us_per_step": round(sum(host_by.get(n, 0.0) for n in GRAPH_LAUNCHES) / steps, 1),
            # the host's busiest ops and runtime calls, µs per step (nested ones counted in each: a step's
            # annotation holds its ops): where a step that waits on the host spends it
            "host_top": [[k, round(v / steps, 1)] for k, v in sorted(host_by.items(), key=lambda kv: -kv[1])[:8]],
            "gpu_busy": round(total / span, 3) if span else None,
            "idle_gaps": idle_gaps(gpu, host),
            "kernels": [{"name": k[:120], "us_per_step": t / steps, "share": t / total if total else 0.0,
                         "calls_per_step": n / steps} for t, n, k in rows[:top]]}


def idle_gaps(gpu: list[tuple[float, float]], host: list[dict], min_us: float = 1000.0, top: int = 5) -> dict:
    """Stretches of ``min_us`` or more in which no kernel or copy ran (``gpu``: (start, end) µs), with the host
    events (CPU ops, CUDA runtime calls) that overlapped the longest one most: what the GPU waited for."""
    gaps, end = [], None
    for a, b in sorted(gpu):
        if end is not None and a - end >= min_us:
            gaps.append((end, a))
        end = b if end is None else max(end, b)
    out = {"count": len(gaps), "total_us": round(sum(b - a for a, b in gaps), 1)}
    if gaps:
        g0, g1 = max(gaps, key=lambda g: g[1] - g[0])
        over: dict[str, float] = {}
        for e in host:
            ts = float(e.get("ts", 0.0))
            ov = min(g1, ts + float(e.get("dur", 0.0))) - max(g0, ts)
            if ov > 0:
                over[e["name"][:80]] = over.get(e["name"][:80], 0.0) + ov
        out["max_us"] = round(g1 - g0, 1)
        out["host_during_max"] = [[k, round(v, 1)] for k, v in sorted(over.items(), key=lambda kv: -kv[1])[:top]]
    return out


def trace_dir(a) -> str:
    """The folder the engine's profiler writes this configuration's traces to (made if missing)."""
    d = str(Path(a.out).with_suffix("")) + "-traces"
    os.makedirs(d, exist_ok=True)
    return d


def traces(prof_dir: str) -> set[str]:
    return set(glob.glob(os.path.join(prof_dir, "*.json*")))


def record_profile(result: dict, key: str, prof_dir: str, before: set[str], steps: int, ending: str = "") -> bool:
    """``result["profile"][key]``: the kernel table of the newest trace (ending in ``ending``) that appeared in
    ``prof_dir`` since ``before``; False where none did."""
    new = sorted((f for f in traces(prof_dir) - before if f.endswith(ending)), key=os.path.getmtime)
    if not new:
        return False
    result["profile"][key] = dict(kernel_table(new[-1], steps), trace=os.path.basename(new[-1]))
    return True


#: torch caching-allocator counters read in the engine's worker around one prefill run: a cudaMalloc retry
#: (the allocator freeing its cache to satisfy a request) synchronises the device, which the kernel
#: profile does not show but wall time does (the MoE prefill's wall time exceeds its GPU time by more
#: than bf16's: issue 37)
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams",
                      "num_ooms")


def _worker_allocator_counters(worker) -> dict:
    import torch

    stats = torch.cuda.memory_stats()
    out = {k: stats.get(k, 0) for k in ALLOCATOR_COUNTERS}
    out["reserved_bytes"] = stats.get("reserved_bytes.all.current", 0)
    return out


def allocator_delta(before: list[dict], after: list[dict]) -> dict:
    """Counters of the first worker after minus before (reserved bytes: the value after)."""
    b, e = before[0], after[0]
    d = {k: e.get(k, 0) - b.get(k, 0) for k in ALLOCATOR_COUNTERS}
    d["reserved_gb"] = round(e.get("reserved_bytes", 0) / 1e9, 2)
    return d


def _vllm_worker(a, result: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    _, quant, extra = CONFIGS["vllm"][a.config]
    kw = dict(model=a.model_path, seed=0, gpu_memory_utilization=a.mem_fraction, max_model_len=a.max_model_len,
              **extra, **parallel_kwargs("vllm", a.tp, a.ep))
    if quant:
        kw["quantization"] = quant
    if a.tp > 1:   # vLLM's symmetric-memory all-reduce needs NVLink multicast too (see parallel_kwargs)
        os.environ["VLLM_ALLREDUCE_USE_SYMM_MEM"] = "0"
    prof_dir = None
    if a.profile_batches:
        prof_dir = trace_dir(a)
        kw["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": prof_dir, "torch_profiler_with_stack": False,
                                 "ignore_frontend": True, "delay_iterations": a.profile_delay,
                                 "max_iterations": a.profile_steps}
    # collective_rpc with a function (the allocator counters, read in the engine's worker): vLLM pickles one only
    # when allowed; set here, in this offline benchmark worker, not for the servers
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    t0 = time.perf_counter()
    llm = LLM(**kw)
    result["startup_s"] = round(time.perf_counter() - t0, 1)
    # vLLM switches to spawn (and says so in this variable) when the parent cannot fork safely
    result["start_method"] = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    vocab = min(len(llm.get_tokenizer()), llm.llm_engine.model_config.get_vocab_size())
    prompts = Prompts(vocab)

    def timed(n: int, length: int, gen: int, ps=None) -> tuple[int, float]:
        sp = SamplingParams(max_tokens=gen, ignore_eos=True, temperature=0.0, detokenize=False)
        ps = ps or [TokensPrompt(prompt_token_ids=p) for p in prompts(n, length)]
        t = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t

    def logprobs() -> list[list[float]]:
        ids = logprob_prompts(vocab)
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], sp, use_tqdm=False)
        return vllm_prompt_logprobs(outs, ids)

    run_sweep(result, timed, a, logprobs, lambda: llm.collective_rpc(_worker_allocator_counters)[0])
    try:   # one more prefill run, bracketed by the worker's allocator counters
        before = llm.collective_rpc(_worker_allocator_counters)
        n, dt = timed(a.prefill[0], a.prefill[1], 1)
        result["prefill_allocator"] = dict(allocator_delta(before, llm.collective_rpc(_worker_allocator_counters)),
                                           tok_s=round(a.prefill[0] * a.prefill[1] / dt, 1))
    except Exception as exc:  # noqa: BLE001 - a diagnostic: recorded, never fatal
        result["prefill_allocator"] = {"error": f"{type(exc).__name__}: {exc}"}
    print(f"[{a.engine} {a.model} {a.config}] prefill allocator: {result['prefill_allocator']}", flush=True)
    if not a.profile_batches:
        return

    def profiled(key: str, n: int, length: int, gen: int, run=None) -> None:
        before = traces(prof_dir)
        llm.start_profile()
        (run or timed)(n, length, gen)
        llm.stop_profile()
        # (vLLM names every trace after the first start's prefix: take the files this run added)
        record_profile(result, key, prof_dir, before, a.profile_steps)

    result["profile"] = {}
    for b in a.profile_batches:
        timed(b, a.prompt_len, a.profile_delay + a.profile_steps + 8)     # warm-up of this shape
        profiled(str(b), b, a.prompt_len, a.profile_delay + a.profile_steps + 8)
    # prefill: enough prompts of the prefill length that every profiled engine step is a full chunk
    # of max_num_batched_tokens prompt tokens (the steps vLLM skips first included)
    chunk = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    length = a.prefill[1]
    n = -(-(a.profile_delay + a.profile_steps + 2) * chunk // length)
    profiled("prefill", n, length, 1)
    if "prefill" in result["profile"]:
        result["profile"]["prefill"]["tokens_per_step"] = chunk
    # runs of one engine step each (the first --prefill-shapes shape, when it fits a chunk): the profile window
    # then spans whole runs and the GPU's idle time between them, where a cost per run shows
    if a.prefill_shapes:
        n1, len1 = parse_shape(a.prefill_shapes[0])
        if n1 * len1 <= chunk:
            # every run's prompts built first: inside the window the host does only what the engine does
            batches = [[TokensPrompt(prompt_token_ids=p) for p in prompts(n1, len1)]
                       for _ in range(a.profile_delay + a.profile_steps)]

            def several(n_, length_, gen_):
                for ps in batches:
                    timed(n_, length_, gen_, ps)

            profiled("prefill runs " + a.prefill_shapes[0], n1, len1, 1, run=several)


def _sglang_worker(a, result: dict) -> None:
    import sglang

    _, quant, extra = CONFIGS["sglang"][a.config]
    # log level "warning": SGLang's root logger carries the plugin's records in its processes, among them the
    # late-compile warning (a kernel of ours compiled after start-up) that the first-request numbers hinge on
    kw = dict(model_path=a.model_path, random_seed=0, mem_fraction_static=a.mem_fraction,
              context_length=a.max_model_len, attention_backend="triton", sampling_backend="pytorch",
              skip_tokenizer_init=True, log_level="warning", **extra, **parallel_kwargs("sglang", a.tp, a.ep))
    if quant:
        kw["quantization"] = quant
    t0 = time.perf_counter()
    engine = sglang.Engine(**kw)
    result["startup_s"] = round(time.perf_counter() - t0, 1)
    prompts = Prompts(tokenizer_vocab(a.model_path))

    def timed(n: int, length: int, gen: int) -> tuple[int, float]:
        sp = {"max_new_tokens": gen, "ignore_eos": True, "temperature": 0.0}
        ids = prompts(n, length)
        t = time.perf_counter()
        outs = engine.generate(input_ids=ids, sampling_params=sp)
        return sum(o["meta_info"]["completion_tokens"] for o in outs), time.perf_counter() - t

    def logprobs() -> list[list[float]]:
        ids = logprob_prompts(prompts.vocab)
        return sglang_prompt_logprobs(engine.generate(input_ids=ids, return_logprob=True, logprob_start_len=0,
                                                      sampling_params={"max_new_tokens": 1, "temperature": 0.0}), ids)

    try:
        run_sweep(result, timed, a, logprobs)
        if a.profile_batches:
            _sglang_profiles(engine, a, timed, result)
    finally:
        engine.shutdown()


def _sglang_profiles(engine, a, timed, result: dict) -> None:
    """SGLang's torch profiler by stage (its scheduler starts a trace at a run's first step of each stage and
    writes it after ``--profile-steps`` of them): decode steps at each ``--profile-batches`` size, and full
    prefill chunks (``chunked_prefill_size`` prompt tokens each), into ``result["profile"]`` as for vLLM."""
    prof_dir = trace_dir(a)
    steps = a.profile_steps

    def profiled(key: str, stage: str, n: int, length: int, gen: int) -> None:
        before = traces(prof_dir)
        engine.start_profile(output_dir=prof_dir, num_steps=steps, profile_by_stage=True, activities=["CPU", "GPU"],
                             with_stack=False, record_shapes=False, profile_id=f"p{len(before)}")
        timed(n, length, gen)
        if record_profile(result, key, prof_dir, before, steps, ending=f"-{stage}.trace.json.gz"):
            return
        # the run ended before the stage's steps did: close the trace (SGLang raises if none is open)
        try:
            engine.stop_profile()
        except RuntimeError as exc:
            print(f"[{a.engine} {a.model} {a.config}] profile {key}: {exc}", flush=True)
        print(f"[{a.engine} {a.model} {a.config}] profile {key}: no {stage} trace of {steps} steps", flush=True)

    result["profile"] = {}
    for b in a.profile_batches:
        timed(b, a.prompt_len, steps + 8)                       # warm-up of this shape
        profiled(str(b), "DECODE", b, a.prompt_len, steps + 8)
    sa = getattr(engine, "server_args", None)
    chunk = getattr(sa, "chunked_prefill_size", None) or -1
    if chunk <= 0:                   # chunking off: a prefill step takes up to max_prefill_tokens
        chunk = getattr(sa, "max_prefill_tokens", None) or 16384
    length = a.prefill[1]
    profiled("prefill", "EXTEND", -(-(steps + 2) * chunk // length), length, 1)
    if "prefill" in result["profile"]:
        result["profile"]["prefill"]["tokens_per_step"] = chunk


def host_cpus(cpu) -> dict:
    """CPUs busy on average over a :class:`~benchmarks.common.TreeCpuMeter` block: the engine's process tree,
    the whole machine (its difference: other work on this machine) and stolen by the hypervisor (where the
    machine is virtual): a host-bound decode step that slows in one run and not the next shows its cause."""
    w = cpu.wall_s
    if not w:
        return {}
    out = {"tree": round(sum(cpu.cpu_s.values()) / w, 2)}
    if getattr(cpu, "machine_busy_s", None) is not None:
        out.update(machine=round(cpu.machine_busy_s / w, 2), steal=round(cpu.steal_s / w, 3))
    return out


def engine_first_request(timed) -> dict:
    """The engine process's first request, then the same request again: one ``ENGINE_FIRST_PROMPT``-token prompt,
    ``ENGINE_FIRST_GEN`` generated tokens (a prefill step and decode steps at batch 1), what every user's first
    request does. What the engine pays once per process (its own lazy compiles and allocations: SGLang loads its
    Triton kernels at their first use in every process, bf16 too) is the first time less the second, reported
    for every configuration side by side; the sweep after it then asks the issue's question, whether the second
    request is as fast as the tenth: each shape's first run against its later ones."""
    first = timed(1, ENGINE_FIRST_PROMPT, ENGINE_FIRST_GEN)[1]
    again = timed(1, ENGINE_FIRST_PROMPT, ENGINE_FIRST_GEN)[1]
    return {"prompt_len": ENGINE_FIRST_PROMPT, "gen_len": ENGINE_FIRST_GEN, "first_s": round(first, 4),
            "again_s": round(again, 4)}


def run_sweep(result: dict, timed, a, logprobs=None, counters=None) -> None:
    """The engine's first request (:func:`engine_first_request`), decode at each batch size (warm-up run, then
    the measured runs) and prefill, into ``result``; then the prompt logprobs of :func:`logprob_prompts`
    (``logprobs()``: one list per prompt, positions 1..), recorded or their error. ``counters()`` (vLLM: the
    worker's allocator counters) is read around each batch's first run: the counters that moved are recorded
    (``first_allocs``), the device allocations a slow first run made."""
    result["engine_first_request"] = engine_first_request(timed)
    print(f"[{a.engine} {a.model} {a.config}] engine's first request: {result['engine_first_request']}", flush=True)
    result["decode"] = {}
    result["repeats"] = a.repeats
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.common import GpuClockSampler, TreeCpuMeter

    for b in a.batches:
        before = _read_counters(counters)
        first = timed(b, a.prompt_len, a.gen_len)
        allocs = moved_counters(before, _read_counters(counters))
        with TreeCpuMeter() as cpu:
            runs = [timed(b, a.prompt_len, a.gen_len) for _ in range(a.repeats)]
        rates = [n / dt for n, dt in runs]
        med = statistics.median(rates)
        steps = a.gen_len * a.repeats
        result["decode"][str(b)] = {"first_tok_s": round(first[0] / first[1], 1), "tok_s": round(med, 1),
                                    "runs_tok_s": [round(r, 1) for r in rates], "tokens": runs[0][0],
                                    "ms_per_step": round(1e3 * b / med, 3),
                                    # host CPU time per engine step of the busiest processes of the engine's tree
                                    "host_cpu_ms_per_step": {k: round(1e3 * v / steps, 3) for k, v in cpu.busiest()},
                                    "wall_ms_per_step": round(1e3 * cpu.wall_s / steps, 3),
                                    # CPUs busy on average: the engine's tree, the whole machine, stolen
                                    "host_cpus": host_cpus(cpu)}
        if allocs:
            result["decode"][str(b)]["first_allocs"] = allocs
        print(f"[{a.engine} {a.model} {a.config}] batch {b}: {result['decode'][str(b)]}", flush=True)
    n, length = a.prefill
    # prefill is power-bound: the clock it ran at is part of the result (sampled over the prefill runs and the
    # prefill-shape runs after them: a few seconds)
    with GpuClockSampler() as clocks:
        runs = [timed(n, length, 1) for _ in range(1 + a.prefill_repeats)]
        rates = [n * length / dt for _, dt in runs]
        result["prefill"] = {"first_tok_s": round(rates[0], 1), "tok_s": round(statistics.median(rates[1:]), 1),
                             "runs_tok_s": [round(r, 1) for r in rates[1:]], "prompts": n, "prompt_len": length}
        print(f"[{a.engine} {a.model} {a.config}] prefill: {result['prefill']}", flush=True)
        # the same at other shapes: ms per run against engine steps per run separates a per-step cost from a
        # per-run one (one full chunk of max_num_batched_tokens, several, a partial one)
        result["prefill_shapes"] = {}
        for shape in a.prefill_shapes:
            n, length = parse_shape(shape)
            runs = [timed(n, length, 1)[1] for _ in range(1 + a.prefill_repeats)]
            ms = 1e3 * statistics.median(runs[1:])
            result["prefill_shapes"][shape] = {"ms_per_run": round(ms, 2), "first_ms": round(1e3 * runs[0], 2),
                                               "tok_s": round(n * length / ms * 1e3, 1)}
    result["prefill"]["clocks"] = clocks.summary
    if result["prefill_shapes"]:
        print(f"[{a.engine} {a.model} {a.config}] prefill shapes: {result['prefill_shapes']}", flush=True)
    # the sweep's numbers on disk before what follows (logprobs, profiles): an engine that dies there (SGLang's
    # scheduler ends its parent with SIGQUIT when it crashes) leaves them, marked, instead of nothing
    save_partial(result, a.out)
    if logprobs is not None:
        try:
            result["prompt_logprobs"] = [[round(float(v), 6) for v in row] for row in logprobs()]
        except Exception as exc:  # noqa: BLE001 - recorded; the throughput numbers stand
            result["prompt_logprobs_error"] = f"{type(exc).__name__}: {exc}"
        save_partial(result, a.out)


def _read_counters(counters) -> dict | None:
    try:
        return counters() if counters else None
    except Exception:  # noqa: BLE001 - a diagnostic, never fatal
        return None


def moved_counters(before: dict | None, after: dict | None) -> dict:
    """The allocator counters (:data:`ALLOCATOR_COUNTERS`) that changed between two reads."""
    if not before or not after:
        return {}
    return {k: v for k, v in allocator_delta([before], [after]).items() if k in ALLOCATOR_COUNTERS and v}


def save_partial(result: dict, out: str) -> None:
    Path(out).write_text(json.dumps(dict(result, gpu=gpu_name() or "?",
                                         incomplete="the engine process ended after the sweep"), indent=1))


def read_json(path: Path) -> dict:
    try:
        r = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return r if isinstance(r, dict) else {}


def gpu_name() -> str | None:
    try:
        import torch
        return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        return None


def _shape_arg(shape: str) -> str:
    """argparse type of --prefill-shapes: checked when the command line is read, kept as given."""
    try:
        parse_shape(shape)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return shape


def wants_profile(engine: str, config: str, only: list[str] | None) -> bool:
    """Whether ``--profile-configs`` (entries ``CONFIG`` or ``ENGINE:CONFIG``; None: all) takes this one."""
    return only is None or config in only or f"{engine}:{config}" in only


def _site_arg(text: str) -> tuple[str, str]:
    engine, sep, path = text.partition("=")
    if not sep or engine not in CONFIGS or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: expected ENGINE=DIR with ENGINE one of {', '.join(CONFIGS)}")
    if not Path(path).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {path} is not a folder")
    return engine, path


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text}")
    return v


def parse_shape(shape: str) -> tuple[int, int]:
    """``"16x1024"`` -> (16 prompts, 1024 tokens each)."""
    try:
        n, length = (int(v) for v in shape.lower().split("x"))
    except ValueError:
        raise ValueError(f"--prefill-shapes: expected PROMPTSxLEN (e.g. 16x1024), got {shape!r}") from None
    if n < 1 or length < 1:
        raise ValueError(f"--prefill-shapes: expected positive PROMPTSxLEN, got {shape!r}")
    return n, length


def checkpoint_layers(model_path) -> int | None:
    """The decoder depth of a checkpoint folder (``num_hidden_layers`` of its config.json), None if unread."""
    try:
        return int(json.loads((Path(model_path) / "config.json").read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def worker(a) -> int:
    result = {"engine": a.engine, "model": a.model, "config": a.config, "model_path": a.model_path,
              "parallel": parallel_tag(a.tp, a.ep), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if (layers := checkpoint_layers(a.model_path)) is not None:
        result["layers"] = layers
    if a.side_by_side:
        result["gpus"] = a.side_by_side           # run beside other engines (--gpus), on these GPUs
    try:
        (_vllm_worker if a.engine == "vllm" else _sglang_worker)(a, result)
    except Exception as exc:  # noqa: BLE001 - recorded in the results, the run goes on
        import traceback
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
    if (gpu := gpu_name()) is not None:
        result["gpu"] = gpu
    Path(a.out).write_text(json.dumps(result, indent=1))
    # the engines leave non-daemon threads behind; the result is written
    sys.stdout.flush()
    os._exit(0 if "error" not in result else 1)


# ------------------------------------------------------------------------------------------------
# serving: streaming OpenAI clients against `vllm serve` / `sglang.launch_server`
# ------------------------------------------------------------------------------------------------

def stream_completion(port: int, prompt: list[int], max_tokens: int) -> dict:
    """One streaming completion: arrival time of each chunk and the completion token count."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    times, tokens = [], None
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices"):
                times.append(time.perf_counter() - t0)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"chunk_times": times, "tokens": tokens if tokens is not None else len(times)}


def latency_stats(results: list[dict], wall: float) -> dict:
    ttft = [r["chunk_times"][0] for r in results if r["chunk_times"]]
    itl = [b - a for r in results for a, b in zip(r["chunk_times"], r["chunk_times"][1:])]

    def pct(v, q):
        return round(1e3 * statistics.quantiles(v, n=100, method="inclusive")[q - 1], 2) if len(v) > 1 else None

    total = [r["chunk_times"][-1] for r in results if r["chunk_times"]]
    return {"tok_s": round(sum(r["tokens"] for r in results) / wall, 1), "requests": len(results),
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99), "itl_ms_p50": pct(itl, 50),
            "itl_ms_p99": pct(itl, 99), "request_ms_p50": pct(total, 50)}


def first_request(r: dict) -> dict:
    """The served engine's first request after it reported ready: TTFT and the whole request, ms."""
    t = r["chunk_times"]
    return {"ttft_ms": round(1e3 * t[0], 2) if t else None, "request_ms": round(1e3 * t[-1], 2) if t else None,
            "tokens": r["tokens"]}


class ServeTurns:
    """The servers of one engine and model (ours and the best built-in, side by side on their own GPUs) take
    turns once all of them are up: each phase of a server's measurement (its first request, then every
    concurrency's warm-up and measured requests) runs while the other servers of the group wait, phase by
    phase in the members' order. A server that is still starting (torch.compile, CUDA graph capture: ~10 of
    the host's CPUs for one to two minutes) slows the host-bound part of a server measured beside it (TTFT,
    the eager prefill steps, streaming): on 2026-11-28 ours' servers were measured while the built-in's were
    starting, in both runs of the day, and only ours' TTFT carried that. A member that ends (done, failed, or
    never started) leaves, and the others stop waiting for it; once ``abort()`` is true (the run is ending: a
    member's job may never start) nobody waits."""

    def __init__(self, members: list[str], abort=lambda: False):
        self.members = list(members)
        self._abort = abort
        self._cond = threading.Condition()
        self._ready: set[str] = set()
        self._gone: set[str] = set()
        self._done = dict.fromkeys(self.members, 0)

    def _wait(self, pred) -> None:
        while not (pred() or self._abort()):      # (abort is an outside event: looked at every second)
            self._cond.wait(timeout=1.0)

    def ready(self, who: str) -> None:
        """``who``'s server is up: wait until every member's is (or that member has left)."""
        with self._cond:
            self._ready.add(who)
            self._cond.notify_all()
            self._wait(lambda: all(m in self._ready or m in self._gone for m in self.members))

    @contextlib.contextmanager
    def turn(self, who: str):
        """``who``'s next phase, once every member before it has run its phase of the same number and every
        member after it the phase before."""
        me = self.members.index(who)
        with self._cond:
            k = self._done[who]
            self._wait(lambda: all(self._done[m] >= k + (i < me) for i, m in enumerate(self.members)
                                   if m != who and m not in self._gone))
        try:
            yield
        finally:
            with self._cond:
                self._done[who] += 1
                self._cond.notify_all()

    def leave(self, who: str) -> None:
        with self._cond:
            self._gone.add(who)
            self._cond.notify_all()


def serve_bench(a, engine: str, model: str, config: str, model_path: Path, env: dict, port: int | None = None,
                turns: tuple[ServeTurns, str] | None = None) -> dict:
    """``vllm serve`` / ``sglang.launch_server`` of ``config``: its first request after ready, then every
    ``--concurrency`` (a warm-up pass, then the measured one). ``turns``: the group and member name this server
    measures in turn with (:class:`ServeTurns`)."""
    gate, who = turns if turns is not None else (None, "")
    phase_turn = (lambda: gate.turn(who)) if gate is not None else contextlib.nullcontext
    sys.path.insert(0, str(ROOT / "integration"))
    from serve_check import healthy, server_command, stop_server

    _, quant, extra = CONFIGS[engine][config]
    port = a.port if port is None else port
    args = [x for k, v in extra.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    cmd = server_command(engine, str(model_path), port, quant, args, a.mem_fraction, a.max_model_len)
    res = {"engine": engine, "model": model, "config": config, "cmd": cmd, "concurrency": {}}
    log = open(Path(a.out) / f"serve-{engine}-{model}-{config}.log", "w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=config_env(env, config),
                            start_new_session=True)
    try:
        while not healthy(port):
            if proc.poll() is not None or time.time() - t0 > a.timeout:
                res["error"] = f"server not healthy (exit {proc.poll()}) after {time.time() - t0:.0f} s"
                return res
            time.sleep(2)
        res["startup_s"] = round(time.time() - t0, 1)
        if gate is not None:
            gate.ready(who)
        prompts = Prompts(tokenizer_vocab(model_path), seed=1)
        # what a user's first request meets once the server says it is ready (set against the requests of
        # concurrency 1's measured phase: the same shape)
        with phase_turn():
            res["first_request"] = first_request(stream_completion(port, prompts(1, a.prompt_len)[0], a.gen_len))
        for c in a.concurrency:
            for phase in ("warmup", "measure"):
                jobs = [prompts(1, a.prompt_len)[0] for _ in range(c * a.requests_per_client)]
                out, lock = [], threading.Lock()

                def client(i):
                    for p in jobs[i::c]:
                        r = stream_completion(port, p, a.gen_len)
                        with lock:
                            out.append(r)

                threads = [threading.Thread(target=client, args=(i,)) for i in range(c)]
                with phase_turn():
                    t = time.perf_counter()
                    for th in threads:
                        th.start()
                    for th in threads:
                        th.join()
                    wall = time.perf_counter() - t
                if phase == "measure":
                    res["concurrency"][str(c)] = latency_stats(out, wall)
                    print(f"[serve {engine} {config}] concurrency {c}: {res['concurrency'][str(c)]}", flush=True)
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if gate is not None:
            gate.leave(who)
        stop_server(proc)
        log.close()
    return res


# ------------------------------------------------------------------------------------------------
# run and report
# ------------------------------------------------------------------------------------------------

def run(a) -> int:
    out = Path(a.out)
    parallel_kwargs(a.engines[0], a.tp, a.ep)             # bad --tp / --ep: refused before any model is built
    if a.serve and a.tp > 1:
        raise SystemExit("bench_e2e: --serve runs on one GPU; drop --serve or --tp")
    slots = gpu_slots(a.gpus, a.tp, os.environ.get("CUDA_VISIBLE_DEVICES"))   # bad --gpus: refused first
    known = {c for e in CONFIGS for c in CONFIGS[e]} | {f"{e}:{c}" for e in CONFIGS for c in CONFIGS[e]}
    bad = sorted(set(a.profile_configs or []) - known)
    if bad:
        raise SystemExit(f"bench_e2e: --profile-configs {' '.join(bad)}: no such configuration (CONFIG or "
                         f"ENGINE:CONFIG, e.g. vllm:ours)")
    bad = sorted(set(a.serve_engines or []) - set(a.engines))
    if bad:
        raise SystemExit(f"bench_e2e: --serve-engines {' '.join(bad)}: not among --engines {' '.join(a.engines)}")
    sites = dict(a.site)
    if len(sites) < len(a.site):
        raise SystemExit("bench_e2e: --site: an engine named twice")
    for shape in a.prefill_shapes:   # each prompt plus its one generated token must fit the context
        if parse_shape(shape)[1] >= a.max_model_len:
            raise SystemExit(f"bench_e2e: --prefill-shapes {shape}: prompts must be shorter than --max-model-len "
                             f"{a.max_model_len}")
    out.mkdir(parents=True, exist_ok=True)
    check_depth(out, a.moe_layers)
    served = set(a.serve_models or []) if a.serve else set()
    paths = build_models(Path(a.model_dir), sorted(set(a.models) | served), a.moe_layers)
    env = plugin_env()
    envs = {engine: engine_env(env, engine, sites) for engine in a.engines}
    par = parallel_tag(a.tp, a.ep)
    suffix = "" if par == "tp1" else f"-{par}"
    prebuilt = _Ready()
    if "sglang" in a.engines:      # on the CPU, while the other engine's configurations run
        prebuilt = SglangPrebuild(envs["sglang"], out, "builtin" in (a.configs or default_configs("sglang")))

    def order(engine: str, rnd: int) -> list[str]:
        """The configurations of a round, rotated by one place each round: a machine whose host slows for a
        while (host-bound decode moves by up to 1.5x between runs) does not always hit the same one."""
        cfgs = list(dict.fromkeys(a.configs or default_configs(engine)))    # a name given twice runs once
        return cfgs[rnd % len(cfgs):] + cfgs[:rnd % len(cfgs)]

    def job(rnd: int, engine: str, model: str, config: str, slot: list[str] | None) -> None:
        tag = suffix + (f".round{rnd}" if rnd else "")
        res_path = out / f"{engine}-{model}-{config}{tag}.json"
        if res_path.exists() and not a.overwrite and "incomplete" not in read_json(res_path):
            print(f"=== {res_path.name}: already there", flush=True)
            return
        if rnd == 0:     # a new first round: later rounds of an earlier run are not this run's
            for stale in out.glob(f"{engine}-{model}-{config}{suffix}.round*.json"):
                stale.unlink()
        kind = CONFIGS[engine][config][0]
        cmd = [sys.executable, "-m", "benchmarks.bench_e2e", "worker", "--engine", engine, "--model", model,
               "--config", config, "--model-path", str(paths[model][kind]), "--out", str(res_path),
               "--batches", *map(str, a.batches), "--prompt-len", str(a.prompt_len),
               "--gen-len", str(a.gen_len), "--prefill", *map(str, a.prefill),
               "--prefill-shapes", *a.prefill_shapes,
               "--mem-fraction", str(a.mem_fraction), "--max-model-len", str(a.max_model_len),
               "--repeats", str(a.repeats), "--prefill-repeats", str(a.prefill_repeats),
               "--tp", str(a.tp)] + (["--ep"] if a.ep else [])
        if a.profile_batches and rnd == 0 and wants_profile(engine, config, a.profile_configs):
            cmd += ["--profile-batches", *map(str, a.profile_batches)]
        if len(slots) > 1:
            cmd += ["--side-by-side", ",".join(slot)]
        where = (f" round {rnd}" if rnd else "") + on_gpu(slot)
        if engine == "sglang":
            prebuilt.wait()
        print(f"=== {engine} {model} {config} {par}{where}", flush=True)
        t = time.time()
        penv = slot_env(config_env(envs[engine], config), slot)
        with open(out / f"{engine}-{model}-{config}{tag}.log", "w") as log:
            try:
                subprocess.run(cmd, cwd=ROOT, env=penv, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout)
            except subprocess.TimeoutExpired:
                # a worker that hangs after its sweep (profiling) keeps the sweep it wrote, marked
                res = read_json(res_path) if res_path.exists() else {}
                res = res if res.get("decode") else {"engine": engine, "model": model, "config": config,
                                                     "parallel": par}
                res_path.write_text(json.dumps(dict(res, error=f"timed out after {a.timeout} s"), indent=1))
        print(f"=== {engine} {model} {config} {par}{where}: {time.time() - t:.0f} s", flush=True)

    serve_engines = (a.serve_engines or a.engines) if a.serve else []
    left: dict[tuple[str, str], int] = {}     # the last round's sweeps of each (engine, model) not yet ended
    ended = threading.Condition()
    failed = threading.Event()

    # side by side (--gpus), the two servers of an engine and model measure in turn (ServeTurns); their two jobs
    # are adjacent in the job list, so the second one takes the next slot that frees
    turns = {key: ServeTurns(["ours", "best"], abort=failed.is_set) for key in
             ((e, m) for e in (a.serve_engines or a.engines) for m in (a.serve_models or a.models))} \
        if a.serve and len(slots) > 1 else {}

    def serve_job(engine: str, model: str, which: str, slot: list[str] | None) -> None:
        """ours' or the best built-in's server, once every sweep of its engine and model has ended (the best
        built-in is read from their results), on its slot's GPU and port, beside the jobs still running."""
        gate = turns.get((engine, model))
        try:
            with ended:
                ended.wait_for(lambda: left.get((engine, model), 0) <= 0)
            if failed.is_set():      # a job of another slot raised: the run ends, no server starts
                return
            config = "ours" if which == "ours" else best_builtin(load_results(out), engine, model)
            if config is None:
                print(f"=== serve {engine} {model}: no built-in result to serve", flush=True)
                return
            path = paths[model][CONFIGS[engine][config][0]]
            print(f"=== serve {engine} {model} {config}{on_gpu(slot)}", flush=True)
            kw = {"turns": (gate, which)} if gate is not None else {}
            res = serve_bench(a, engine, model, config, path, slot_env(envs[engine], slot),
                              port=a.port + slots.index(slot), **kw)
        finally:                     # whichever way this job ends, the other server of its pair stops waiting
            if gate is not None:
                gate.leave(which)
        res["layers"] = checkpoint_layers(path)
        (out / f"serve-{engine}-{model}-{config}.json").write_text(json.dumps(res, indent=1))

    def task(kind: str, *args) -> None:
        if kind == "serve":
            return serve_job(*args)
        rnd, engine, model, config, slot = args
        try:
            job(rnd, engine, model, config, slot)
        except BaseException:
            failed.set()          # before the servers waiting on this sweep wake up
            raise
        finally:
            if rnd == a.rounds - 1:
                with ended:
                    left[engine, model] -= 1
                    ended.notify_all()

    if len(slots) > 1 and a.gpu_check:
        gpu_check(out, [g for slot in slots for g in slot], env)
    # rounds after the first: the same configurations again, each in a fresh engine process, after all of the
    # previous round (host-bound decode varies by up to ±30% between processes); the servers in the last round,
    # each engine's after its sweeps (its serve jobs wait for them), beside the other engine's sweeps
    for rnd in range(a.rounds):
        jobs = []
        for engine in a.engines:
            sweeps = [("sweep", rnd, engine, model, config) for model in a.models
                      for config in order(engine, rnd) if config in CONFIGS[engine]]
            jobs += sweeps
            if rnd == a.rounds - 1:
                for _, _, e, m, _ in sweeps:
                    left[e, m] = left.get((e, m), 0) + 1
                if engine in serve_engines:
                    jobs += [("serve", engine, model, which) for model in a.serve_models or a.models
                             for which in ("ours", "best")]
        try:
            run_side_by_side(jobs, slots, task, failed)
        finally:
            if failed.is_set() or rnd == a.rounds - 1:
                prebuilt.stop()
    report(out)
    return 0


def gpu_slots(gpus: list[str] | None, tp: int, visible: str | None = None) -> list[list[str] | None]:
    """``--gpus``: the GPU groups engines run on side by side, ``tp`` GPUs each, in the order given, as
    ``CUDA_VISIBLE_DEVICES`` values: indices into ``visible`` (this process's ``CUDA_VISIBLE_DEVICES``) when
    that is set, so a run never leaves the GPUs it was given; without ``--gpus`` one slot that leaves
    ``CUDA_VISIBLE_DEVICES`` as it is (one engine at a time)."""
    if not gpus:
        return [None]
    if len(set(gpus)) != len(gpus):
        raise SystemExit(f"bench_e2e: --gpus {' '.join(gpus)}: a GPU named twice")
    if len(gpus) % tp:
        raise SystemExit(f"bench_e2e: --gpus: {len(gpus)} GPUs do not split into engines of --tp {tp} GPUs each")
    if visible:
        given = [v.strip() for v in visible.split(",") if v.strip()]
        bad = [g for g in gpus if not g.isdigit() or int(g) >= len(given)]
        if bad:
            raise SystemExit(f"bench_e2e: --gpus {' '.join(bad)}: this process sees {len(given)} GPU(s) "
                             f"(CUDA_VISIBLE_DEVICES={visible}); --gpus numbers them from 0")
        gpus = [given[int(g)] for g in gpus]
    return [gpus[i:i + tp] for i in range(0, len(gpus), tp)]


#: the GPU check of a side-by-side run: one bf16 GEMM of this size in a loop on every GPU at once, before the
#: engines start (seconds of warm-up, seconds measured): at their power caps GPUs of one host need not be equal,
#: and each configuration runs on one of them
GPU_CHECK_N = 8192
GPU_CHECK_SECONDS = (5.0, 10.0)


def gpu_check_worker(out: Path, warm_s: float, measure_s: float) -> int:
    """TFLOP/s of :data:`GPU_CHECK_N`-cubed bf16 GEMMs back to back on the first visible GPU, after ``warm_s``
    seconds of the same (the GPU at its power cap), with its clock and power over the measured seconds."""
    import torch

    from benchmarks.common import GpuClockSampler

    n = GPU_CHECK_N
    res = {"gpu": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    try:
        a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))

        def loop(seconds: float) -> float:
            calls = 0
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                for _ in range(10):
                    torch.mm(a, b)
                torch.cuda.synchronize()
                calls += 10
            return calls * 2 * n ** 3 / (time.perf_counter() - t0) / 1e12

        loop(warm_s)
        with GpuClockSampler() as clocks:
            res["tflops"] = round(loop(measure_s), 1)
        res.update(name=torch.cuda.get_device_name(), uuid=str(torch.cuda.get_device_properties(0).uuid),
                   clocks=clocks.summary)
    except Exception as exc:  # noqa: BLE001 - the run goes on; the report names what failed
        res["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    out.write_text(json.dumps(res, indent=1))
    return 0 if "tflops" in res else 1


def gpu_check(out: Path, gpus: list[str], env: dict, timeout: float = 180) -> None:
    """:func:`gpu_check_worker` on each of ``gpus`` at once, one process each (``gpu-check-<GPU>.json``; an earlier
    check's files in ``out`` go first: the report names this run's GPUs only)."""
    for stale in out.glob("gpu-check-*.json"):
        stale.unlink()
    warm, measure = GPU_CHECK_SECONDS
    print(f"=== GPU check on GPU {' '.join(gpus)}: {GPU_CHECK_N}^3 bf16 GEMMs, {warm:.0f} s + {measure:.0f} s",
          flush=True)

    def one(gpu: str) -> None:
        path = out / f"gpu-check-{gpu}.json"
        cmd = [sys.executable, "-m", "benchmarks.bench_e2e", "gpu-check", "--out", str(path)]
        try:
            subprocess.run(cmd, cwd=ROOT, env={**env, "CUDA_VISIBLE_DEVICES": gpu}, timeout=timeout,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            path.write_text(json.dumps({"gpu": gpu, "error": f"timed out after {timeout:.0f} s"}))

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(gpus)) as pool:
        list(pool.map(one, gpus))


def gpu_check_table(out: Path) -> list[str]:
    """The GPU check's results (:func:`gpu_check`) as a table, with the fastest over the slowest GPU."""
    got = sorted((read_json(p) for p in out.glob("gpu-check-*.json")), key=lambda r: str(r.get("gpu")))
    if not got:
        return []
    warm, measure = GPU_CHECK_SECONDS
    md = ["## GPU check", "", f"Before the engines, the same loop of {GPU_CHECK_N}^3 bf16 GEMMs (torch.mm) on every "
          f"GPU of the run at once, {measure:.0f} s measured after {warm:.0f} s: each configuration above ran on "
          "one of these GPUs (its line \"side by side\").", "",
          "| GPU | TFLOP/s | SM MHz median | power W median | samples at the power cap |", "|---|---:|---:|---:|---:|"]
    for r in got:
        if "tflops" not in r:
            md.append(f"| {r.get('gpu')} | failed: {r.get('error', 'no result')} | | | |")
            continue
        c = r.get("clocks") or {}
        md.append(f"| {r['gpu']} | {r['tflops']} | {c.get('sm_mhz_median', '-')} | {c.get('power_w_median', '-')} | "
                  + (f"{c['power_capped_share']:.0%} |" if "power_capped_share" in c else "- |"))
    tf = [r["tflops"] for r in got if "tflops" in r]
    if len(tf) > 1:
        md += ["", f"Fastest over slowest GPU: {max(tf) / min(tf):.3f}x."]
    return md + [""]


def slot_env(env: dict, slot: list[str] | None) -> dict:
    """``env`` for a process of a ``--gpus`` slot: its GPUs as ``CUDA_VISIBLE_DEVICES`` (no slot: as it is)."""
    return {**env, "CUDA_VISIBLE_DEVICES": ",".join(slot)} if slot else env


def on_gpu(slot: list[str] | None) -> str:
    return f" on GPU {','.join(slot)}" if slot else ""


def run_side_by_side(jobs: list[tuple], slots: list, job, failed: threading.Event | None = None) -> None:
    """Run ``job(*j, slot)`` for every job, as many at once as there are slots, each slot taking the next job
    in order when its last one ends; returns when all have ended. An exception in any slot (or Ctrl-C) stops
    the slots from taking more jobs and sets ``failed`` (running jobs that wait may look at it); the running
    ones end, then the first exception is raised."""
    todo = list(jobs)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def take():
        with lock:
            return todo.pop(0) if todo and not errors else None

    def drain(slot):
        try:
            while (j := take()) is not None:
                job(*j, slot)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller after every slot has ended
            with lock:
                errors.append(exc)
                todo.clear()
            if failed is not None:
                failed.set()

    threads = [threading.Thread(target=drain, args=(slot,)) for slot in slots[1:]]
    for th in threads:
        th.start()
    try:
        drain(slots[0])
    finally:
        for th in threads:
            th.join()
    if errors:
        raise errors[0]


def check_depth(out: Path, moe_layers: int) -> None:
    """Refuse a ``--moe-layers`` other than the one of the MoE results already in ``out`` (one depth per
    folder: the result files do not name it, and a finished configuration is not run again)."""
    for f in sorted(out.glob("*moe*.json")):
        r = read_json(f)
        if r.get("model") == "moe" and (r.get("layers") or MOE_LAYERS) != moe_layers:
            raise SystemExit(f"bench_e2e: --moe-layers {moe_layers}, but {f.name} in --out {out} holds MoE results at "
                             f"{r.get('layers') or MOE_LAYERS} layers: one depth per --out folder, use another")


def load_results(out: Path) -> list[dict]:
    """Every configuration's result in ``out``; a configuration run in several rounds (``--rounds``) is one
    result whose decode and prefill tokens/s are the medians over its rounds (:func:`merge_rounds`)."""
    res, rounds = [], {}
    for p in sorted(Path(out).glob("*.json")):
        try:
            r = json.loads(p.read_text())
        except json.JSONDecodeError:
            continue
        base, dot, rnd = p.stem.rpartition(".round")
        if dot and rnd.isdigit():
            rounds.setdefault(base, []).append((int(rnd), r))
        else:
            res.append((p.stem, r))
    return [merge_rounds(r, [x for _, x in sorted(rounds.get(stem, []), key=lambda kv: kv[0])]) for stem, r in res]


def merge_rounds(first: dict, later: list[dict]) -> dict:
    """``first`` with decode and prefill tokens/s replaced by their medians over ``first`` and the ``later``
    rounds (each round's value kept in ``rounds_tok_s``); profiles and everything else from ``first``."""
    later = [r for r in later if r.get("decode")]
    if not later or not first.get("decode"):
        return first
    out = dict(first, rounds=1 + len(later), decode={})
    for b, d in first["decode"].items():
        vals = [d["tok_s"]] + [r["decode"][b]["tok_s"] for r in later if b in r["decode"]]
        med = statistics.median(vals)
        per_round = [d] + [r["decode"].get(b) or {} for r in later]
        out["decode"][b] = dict(d, tok_s=round(med, 1), rounds_tok_s=vals, round0_tok_s=d["tok_s"],
                                ms_per_step=round(1e3 * int(b) / med, 3) if med else d.get("ms_per_step"),
                                rounds_host_cpu=[host_cpu_summary(x) for x in per_round],
                                rounds_host_cpus=[x.get("host_cpus") for x in per_round])
    if first.get("prefill"):
        vals = [first["prefill"]["tok_s"]] + [r["prefill"]["tok_s"] for r in later if r.get("prefill")]
        out["prefill"] = dict(first["prefill"], tok_s=round(statistics.median(vals), 1), rounds_tok_s=vals)
    return out


def host_cpu_summary(d: dict) -> str | None:
    """"busiest process: CPU ms / wall ms per step" of a decode result (None without the measurement)."""
    cpu = d.get("host_cpu_ms_per_step")
    if not cpu or d.get("wall_ms_per_step") is None:
        return None
    name, ms = max(cpu.items(), key=lambda kv: kv[1])
    return f"{name.split('[')[0]} {ms:.2f} / {d['wall_ms_per_step']:.2f} ms"


def _decode(r: dict, b) -> float | None:
    d = (r.get("decode") or {}).get(str(b))
    return d["tok_s"] if d else None


def best_builtin(results: list[dict], engine: str, model: str) -> str | None:
    """The built-in NVFP4 configuration with the most decode tokens/s summed over the batch sizes."""
    cands = [r for r in results if r.get("engine") == engine and r.get("model") == model
             and r.get("config") in BUILTIN[engine] and r.get("decode") and r.get("parallel", "tp1") == "tp1"]
    if not cands:
        return None
    return max(cands, key=lambda r: sum(d["tok_s"] for d in r["decode"].values()))["config"]


def logprob_diff(x, y) -> tuple[float, float] | None:
    """Max and mean |x - y| over two configurations' prompt logprobs, position by position (None when either
    is missing or they cover different prompts)."""
    if not x or not y or len(x) != len(y) or any(len(a) != len(b) for a, b in zip(x, y)):
        return None
    d = [abs(u - v) for a, b in zip(x, y) for u, v in zip(a, b) if u is not None and v is not None]
    return (max(d), sum(d) / len(d)) if d else None


def logprob_lines(rows: list[dict], engine: str) -> list[str]:
    """Ours' prompt logprobs against the built-ins' and bf16's on the same checkpoint. Ours and the built-ins
    are all W4A16 on the same exactly dequantized weights; they differ in accumulation order and where
    activations round to bf16. With two built-in backends (vLLM: Marlin, Humming) their own difference is the
    tolerance: ours passes when its mean and its max difference from each are at most 1.5x the built-ins' from
    each other (and at least :data:`LOGPROB_FLOOR` of each: two built-ins that happen to agree exactly do not
    make every difference a miss)."""
    lp = {r["config"]: r["prompt_logprobs"] for r in rows if r.get("prompt_logprobs")}
    lines = [f"prompt logprobs of {r['config']}: {r['prompt_logprobs_error']}" for r in rows
             if r.get("prompt_logprobs_error")]
    ours = lp.get("ours")
    if not ours:
        return lines
    diffs = {c: logprob_diff(ours, lp[c]) for c in (*BUILTIN[engine], "bf16") if c in lp}
    diffs = {c: d for c, d in diffs.items() if d}
    if not diffs:
        return lines
    line = (f"prompt logprobs ({len(ours)} prompts x {len(ours[0]) + 1} tokens, the same ids in every process), "
            "max / mean |ours - X|: " + "; ".join(f"{c} {d[0]:.4f} / {d[1]:.4f}" for c, d in diffs.items()))
    bis = [c for c in BUILTIN[engine] if c in lp and c in diffs]
    yard = logprob_diff(lp[bis[0]], lp[bis[1]]) if len(bis) >= 2 else None
    if yard:
        tol = [max(1.5 * y, f) for y, f in zip(yard, LOGPROB_FLOOR)]
        ok = all(d <= t for c in bis for d, t in zip(diffs[c], tol))
        line += (f"; {bis[0]} - {bis[1]} {yard[0]:.4f} / {yard[1]:.4f}: ours within 1.5x the built-ins' own "
                 f"difference (max and mean): {'PASS' if ok else 'MISS'}")
    return lines + [line]


def checks(results: list[dict], engine: str, model: str) -> list[str]:
    """The end-to-end issue's floors and consistency lines, one verdict each."""
    by = {r["config"]: r for r in results if r.get("engine") == engine and r.get("model") == model and "config" in r}
    ours = by.get("ours")
    lines = []
    if not ours or not ours.get("decode"):
        return [f"ours: no result ({(ours or {}).get('error', 'not run')})"]
    batches = sorted(int(b) for b in ours["decode"])
    builtins = [by[c] for c in BUILTIN[engine] if c in by and by[c].get("decode")]
    for b in batches:
        o = _decode(ours, b)
        best = max((_decode(r, b) or 0.0 for r in builtins), default=None)
        bf = _decode(by["bf16"], b) if "bf16" in by else None
        if not best and not bf:   # nothing of this run to hold ours against: no verdict
            lines.append(f"decode batch {b}: ours {o:.0f}; no built-in or bf16 result in this run")
            continue
        verdict = "PASS" if (not best or o >= best) and (not bf or o >= bf) else "MISS"
        vs_best = f"best built-in {best:.0f} ({o / best:.2f}x)" if best else "no built-in result"
        vs_bf = f"bf16 {bf:.0f} ({o / bf:.2f}x)" if bf else "no bf16 result"
        lines.append(f"decode batch {b}: ours {o:.0f} vs {vs_best}, {vs_bf}: {verdict}")
    for c in BUILTIN[engine]:
        if c in by and not by[c].get("decode"):
            lines.append(f"built-in {c}: no result ({by[c].get('error', 'no decode numbers')})")
    if ours.get("prefill") and "bf16" in by and by["bf16"].get("prefill"):
        o, bf = ours["prefill"]["tok_s"], by["bf16"]["prefill"]["tok_s"]
        need = 0.95 if model == "dense" else 1.0
        lines.append(f"prefill: ours {o:.0f} vs bf16 {bf:.0f} ({o / bf:.2f}x, floor {need}x): "
                     f"{'PASS' if o >= need * bf else 'MISS'}")
    drops = [(b0, b1) for b0, b1 in zip(batches, batches[1:]) if _decode(ours, b1) < 0.95 * _decode(ours, b0)]
    lines.append("tokens/s never falls by more than 5% to the next larger batch: "
                 + ("PASS" if not drops else "MISS at " + ", ".join(f"{x}->{y}" for x, y in drops)))
    def second(d):         # the runs after the first of the same engine process (its first round's)
        return d.get("round0_tok_s", d["tok_s"])

    slow_first = [b for b in batches if ours["decode"][str(b)]["first_tok_s"] < 0.95 * second(ours["decode"][str(b)])]

    def first_ratios(b):   # the same first-run ratio of every configuration: what the engine itself costs
        return ", ".join(f"{c} {d['first_tok_s'] / second(d):.2f}" for c, r in sorted(by.items())
                         if (d := (r.get("decode") or {}).get(str(b))) and second(d))
    def allocs(b):         # device allocations during a slow first run, per configuration (vLLM)
        moved = [f"{c} " + ", ".join(f"{k} {v}" for k, v in d["first_allocs"].items()) for c, r in sorted(by.items())
                 if (d := (r.get("decode") or {}).get(str(b))) and d.get("first_allocs")]
        return f"; allocator counters that moved in the first run: {'; '.join(moved)}" if moved else ""

    lines.append("first run of each shape within 5% of the second: "
                 + ("PASS" if not slow_first else "MISS at batch " + "; ".join(
                     f"{b} (first / measured: {first_ratios(b)}{allocs(b)})" for b in slow_first)))
    cells = [f"{c} {e['first_s']:.2f} / {e['again_s']:.2f}" for c, r in sorted(by.items())
             if (e := r.get("engine_first_request"))]
    if cells:   # what every configuration's engine pays once per process, before the shapes' first runs
        lines.append(f"the engine's first request ({ENGINE_FIRST_PROMPT}-token prompt, {ENGINE_FIRST_GEN} tokens), s, "
                     "first / again: " + ", ".join(cells))
    if engine == "vllm":
        lines.append(f"start method: {ours.get('start_method', '?')}")
    # the engine's host loop at the smallest batches, where steps wait on it (per round where there are rounds)
    for b in [b for b in batches if b <= 2]:
        cells = []
        for c, r in sorted(by.items()):
            d = (r.get("decode") or {}).get(str(b)) or {}
            per = [x for x in d.get("rounds_host_cpu") or [host_cpu_summary(d)] if x]
            if per:
                cells.append(f"{c} {'; '.join(per)}")
        if cells:
            lines.append(f"host CPU per decode step at batch {b} (busiest process of the engine, CPU / wall): "
                         + ", ".join(cells))
    # other work on the machine and the hypervisor's steal during the decode runs: the most of any batch or round
    cells = []
    for c, r in sorted(by.items()):
        hc = [h for d in (r.get("decode") or {}).values()
              for h in d.get("rounds_host_cpus") or [d.get("host_cpus")] if h and "machine" in h]
        if hc:
            cells.append(f"{c} {max(h['machine'] - h['tree'] for h in hc):.2f} / {max(h['steal'] for h in hc):.2f}")
    if cells:
        lines.append("CPUs busy outside the engine's processes / stolen by the hypervisor during the decode runs "
                     "(the most of any batch or round, each maximum on its own): " + ", ".join(cells))
    for c, r in sorted(by.items()):
        if r.get("rounds", 1) > 1:
            lines.append(f"{c}: the median of {r['rounds']} rounds (fresh engine processes); tokens/s per round: "
                         + "; ".join(f"b={b} " + " / ".join(f"{v:.0f}" for v in d["rounds_tok_s"])
                                     for b, d in sorted(r["decode"].items(), key=lambda kv: int(kv[0])))
                         + ("; prefill " + " / ".join(f"{v:.0f}" for v in r["prefill"]["rounds_tok_s"])
                            if (r.get("prefill") or {}).get("rounds_tok_s") else ""))
    return lines


def served_first_line(r: dict) -> list[str]:
    """The served first request against concurrency 1's measured requests of the same shape (within 5%: PASS)."""
    first, one = r.get("first_request"), (r.get("concurrency") or {}).get("1")
    if not first or not first.get("request_ms") or not one or not one.get("request_ms_p50"):
        return []
    ratio = one["request_ms_p50"] / first["request_ms"]
    return [f"{r.get('engine', 'vllm')} {r.get('model')} {r['config']}: first request after ready {first['request_ms']} ms "
            f"(TTFT {first['ttft_ms']} ms) against {one['request_ms_p50']} ms at concurrency 1 "
            f"({ratio:.2f} of its speed): {'PASS' if ratio >= 0.95 else 'MISS'}"]


def idle_gap_line(gaps: dict | None, steps: int) -> list[str]:
    """The GPU's idle stretches of 1 ms or more in a profile window, and what the host did in the longest."""
    if not gaps or not gaps.get("count"):
        return []
    host = "; ".join(f"`{n}` {us / 1e3:.1f} ms" for n, us in gaps.get("host_during_max", [])) or "nothing recorded"
    return [f"GPU idle for 1 ms or more: {gaps['count']} times over {steps} steps, {gaps['total_us'] / 1e3:.1f} ms "
            f"in all, the longest {gaps['max_us'] / 1e3:.1f} ms; the host meanwhile: {host}", ""]


def profile_summary(rows: list[dict]) -> list[str]:
    """One line per profiled (config, batch): GPU work and wall time per decode step, how busy the GPU
    was, the launches per step (a decode step inside the engine's full CUDA graph is one graph
    launch plus the sampler's few eager kernels), the kernels a step ran and the host time of its graph
    launches."""
    lines = []
    for r in rows:
        for b, prof in (r.get("profile") or {}).items():
            busy = prof.get("gpu_busy")
            lines.append(f"| {r['config']} | {b} | {prof['gpu_us_per_step']:.0f} | "
                         f"{(r.get('decode', {}).get(b) or {}).get('ms_per_step', '-')} | "
                         f"{'-' if busy is None else f'{100 * busy:.0f}%'} | "
                         f"{prof.get('graph_launches_per_step', float('nan')):.1f} | "
                         f"{prof.get('kernel_launches_per_step', float('nan')):.1f} | "
                         f"{_num(prof.get('kernels_per_step'), '.0f')} | "
                         f"{_num(prof.get('graph_launch_us_per_step'), '.0f')} |")
    if not lines:
        return []
    return (["| config | batch | GPU µs / step | wall ms / step | GPU busy | graph launches / step | "
             "kernel launches / step | kernels / step | graph launch host µs / step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"] + lines + [""])


def _num(v, fmt: str) -> str:
    """``v`` formatted, or "-" where an older result lacks the field."""
    return "-" if v is None else format(v, fmt)


def prefill_shape_summary(rows: list[dict]) -> list[str]:
    """ms per prefill run at each ``--prefill-shapes`` shape, per configuration (where recorded)."""
    shapes = sorted({s for r in rows for s in (r.get("prefill_shapes") or {})}, key=parse_shape)
    if not shapes:
        return []
    md = ["Prefill runs by shape (prompts x tokens), ms per run (median; first run in brackets):", "",
          "| config | " + " | ".join(shapes) + " |", "|---|" + "---:|" * len(shapes)]
    for r in rows:
        got = r.get("prefill_shapes") or {}
        md.append(f"| {r['config']} | " + " | ".join(
            f"{got[s]['ms_per_run']:.1f} ({got[s]['first_ms']:.1f})" if s in got else "-" for s in shapes) + " |")
    return md + [""]


def clock_table(rows: list[dict]) -> list[str]:
    """The GPU's SM clock and power over each configuration's prefill runs (where sampled)."""
    have = [r for r in rows if (r.get("prefill") or {}).get("clocks")]
    if not have:
        return []
    md = ["GPU clock and power over the prefill and prefill-shape runs (nvidia-smi every 100 ms, the first round; "
          "an H200 at its power cap runs below its 1980 MHz boost):", "",
          "| config | prefill tok/s | SM MHz median | SM MHz min | power W median | samples at the power cap |",
          "|---|---:|---:|---:|---:|---:|"]
    for r in have:
        c = r["prefill"]["clocks"]
        if not c.get("samples"):
            md.append(f"| {r['config']} | {r['prefill']['tok_s']} | no samples: {c.get('error', 'none read')} | | | |")
            continue
        md.append(f"| {r['config']} | {r['prefill']['tok_s']} | {c['sm_mhz_median']:.0f} | {c['sm_mhz_min']:.0f} | "
                  f"{c['power_w_median']} | {c['power_capped_share']:.0%} |")
    return md + [""]


def allocator_summary(rows: list[dict]) -> list[str]:
    """The worker's allocator counters over one extra prefill run, per configuration (where recorded)."""
    have = [r for r in rows if r.get("prefill_allocator") and "error" not in r["prefill_allocator"]]
    if not have:
        return []
    md = ["Allocator counters of the engine's worker over one more prefill run (a retry frees the cache and "
          "synchronises the device):", "",
          "| config | prefill tok/s | " + " | ".join(ALLOCATOR_COUNTERS) + " | reserved GB |",
          "|---|---:|" + "---:|" * (len(ALLOCATOR_COUNTERS) + 1)]
    for r in have:
        d = r["prefill_allocator"]
        cells = " | ".join(str(d.get(k, "-")) for k in ALLOCATOR_COUNTERS)
        md.append(f"| {r['config']} | {d.get('tok_s', '-')} | {cells} | {d.get('reserved_gb', '-')} |")
    return md + [""]


def report(out: Path) -> str:
    out = Path(out)
    results = load_results(out)
    runs = [r for r in results if "decode" in r or ("error" in r and "concurrency" not in r)]
    md = ["# End-to-end throughput", "",
          f"Command: `python -m benchmarks.bench_e2e run --out {out.name} ...` "
          f"({', '.join(sorted({r.get('gpu', '?') for r in runs}))}, {max((r.get('date', '') for r in runs), default='')}). "
          "Decode: output tokens/s (128-token prompts, 256 generated, ignore_eos; prefill included), the median of "
          "the measured runs after a warm-up run, fresh prompts each run. Prefill: prompt tokens/s.", ""]
    groups = [(e, m, p) for e in ("vllm", "sglang") for m in MODELS
              for p in sorted({r.get("parallel", "tp1") for r in runs}, key=lambda p: (p != "tp1", p))]
    for engine, model, par in groups:
        rows = [r for r in runs if r.get("engine") == engine and r.get("model") == model
                and r.get("parallel", "tp1") == par]
        if not rows:
            continue
        batches = sorted({int(b) for r in rows for b in (r.get("decode") or {})})
        where = "" if par == "tp1" else f", {par}"
        depth = next((r["layers"] for r in rows if r.get("layers")), None)
        md += [f"## {engine}, {model} ({model_label(model, depth)}){where}", "",
               "| config | run | start s | " + " | ".join(f"b={b}" for b in batches) + " | prefill |",
               "|---|---|---:|" + "---:|" * (len(batches) + 1)]
        for r in sorted(rows, key=lambda r: list(CONFIGS[engine]).index(r["config"])
                        if r.get("config") in CONFIGS[engine] else 99):
            if "error" in r and not r.get("decode"):
                md.append(f"| {r.get('config')} | {r.get('run', '')} | - | error: {r['error'][:200]} |")
                continue
            cells = [f"{_decode(r, b):.0f}" if _decode(r, b) else "-" for b in batches]
            pre = r.get("prefill", {}).get("tok_s")
            md.append(f"| {r['config']} | {r.get('run', '')} | {r.get('startup_s', '-')} | " + " | ".join(cells)
                      + (f" | {pre:.0f} |" if pre else " | - |"))
        md += [""] + [f"- {line}" for line in checks(rows, engine, model) + logprob_lines(rows, engine)]
        md += [f"- {r['config']}: {r['incomplete']} (no profiles; its sweep above stands)"
               for r in rows if r.get("incomplete")]
        side = sorted({(r["gpus"], r["config"]) for r in rows if r.get("gpus")})
        if len({g for g, _ in side}) > 1:          # --gpus: engines ran side by side on these GPUs
            md.append("- side by side, one engine per GPU group (`--gpus`): "
                      + "; ".join(f"{c} on {g}" for g, c in side)
                      + " (the engines shared the host's CPUs: a host-bound batch was measured beside another "
                        "engine's host loop)")
        md += [""]
        md += allocator_summary(rows)
        md += prefill_shape_summary(rows)
        md += clock_table(rows)
        md += profile_summary(rows)
        for r in rows:
            for b, prof in (r.get("profile") or {}).items():
                if b == "prefill":
                    what = (f"prefill, {prof.get('tokens_per_step')} prompt tokens per step "
                            f"({prof['gpu_us_per_step']:.0f} µs of GPU work per step)")
                elif b.startswith("prefill runs"):
                    what = f"{b} of one engine step each ({prof['gpu_us_per_step']:.0f} µs of GPU work per run)"
                else:
                    what = (f"batch {b} ({prof['gpu_us_per_step']:.0f} µs of GPU work per decode step, "
                            f"{(r['decode'].get(b) or {}).get('ms_per_step', '?')} ms wall per step)")
                md += [f"### profile: {engine} {model} {r['config']}{where}, {what}", "",
                       "| kernel | µs / step | share | calls / step |", "|---|---:|---:|---:|"]
                md += [f"| `{k['name']}` | {k['us_per_step']:.1f} | {100 * k['share']:.1f}% | "
                       f"{k['calls_per_step']:.1f} |" for k in prof["kernels"]]
                if prof.get("host_top"):
                    md += ["", "Host, µs per step (nested ops counted in each): "
                           + "; ".join(f"`{n}` {us:.0f}" for n, us in prof["host_top"])]
                md += ["", *idle_gap_line(prof.get("idle_gaps"), prof.get("steps", 1))]
    serves = [r for r in results if "concurrency" in r]
    if serves:
        md += ["## Served (`vllm serve`, `sglang.launch_server`), streaming clients", "",
               "| engine | model | config | concurrency | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | request p50 ms |",
               "|---|---|---|---:|---:|---:|---:|---:|"]
        firsts = []
        for r in serves:
            eng = r.get("engine", "vllm")
            mod = r.get("model") if r.get("model") != "moe" or not r.get("layers") else f"moe, {r['layers']} layers"
            if r.get("error"):
                md.append(f"| {eng} | {mod} | {r['config']} | - | error: {r['error'][:200]} | | | |")
            for c, s in r["concurrency"].items():
                md.append(f"| {eng} | {mod} | {r['config']} | {c} | {s['tok_s']:.0f} | {s['ttft_ms_p50']} / "
                          f"{s['ttft_ms_p99']} | {s['itl_ms_p50']} / {s['itl_ms_p99']} | {s.get('request_ms_p50', '-')} |")
            firsts += served_first_line(r)
        md += [""] + [f"- {line}" for line in firsts] + ([""] if firsts else [])
    md += gpu_check_table(out)
    text = "\n".join(md)
    (out / "e2e.md").write_text(text)
    plot(runs, out / "e2e.png")
    print(text)
    return text


def plot(runs: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return False
    panels = [(e, m) for e in ("vllm", "sglang") for m in MODELS
              if any(r.get("engine") == e and r.get("model") == m and r.get("decode") for r in runs)]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (engine, model) in zip(axes[0], panels):
        for r in runs:
            if r.get("engine") == engine and r.get("model") == model and r.get("decode"):
                bs = sorted(int(b) for b in r["decode"])
                par = r.get("parallel", "tp1")
                ax.plot(bs, [_decode(r, b) for b in bs], marker="o",
                        label=r["config"] + ("" if par == "tp1" else f" {par}"),
                        linewidth=2.5 if r["config"] == "ours" else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size (concurrent requests)")
        ax.set_ylabel("output tokens/s")
        depth = next((r["layers"] for r in runs if r.get("model") == model and r.get("layers")), None)
        ax.set_title(f"{engine}: {model_label(model, depth)}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


MOE_LAYERS_HELP = (f"decoder layers of the MoE checkpoint (default {MOE_LAYERS} of Qwen3-30B-A3B's 48; another depth is "
                   "built beside it as moe-L<N>-bf16 / -nvfp4, ~1.25 GB of bf16 and ~0.4 GB of NVFP4 per layer); one "
                   "depth per --out folder")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_e2e", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("--batches", type=int, nargs="+", default=list(DEFAULT_BATCHES))
        p.add_argument("--prompt-len", type=int, default=128)
        p.add_argument("--gen-len", type=int, default=256)
        p.add_argument("--prefill", type=int, nargs=2, default=[64, 896], metavar=("PROMPTS", "LEN"))
        p.add_argument("--prefill-shapes", nargs="*", default=list(PREFILL_SHAPES), metavar="PROMPTSxLEN", type=_shape_arg,
                       help="further prefill runs, ms per run each (per-step against per-run costs)")
        p.add_argument("--mem-fraction", type=float, default=0.85)
        p.add_argument("--max-model-len", type=int, default=2048)
        p.add_argument("--repeats", type=int, default=3,
                       help="measured decode runs per batch size after the warm-up run (the median is reported)")
        p.add_argument("--prefill-repeats", type=_positive_int, default=7,
                       help="measured runs of the prefill and of each prefill shape after the warm-up run: a "
                            "prefill run is a fraction of a second, and single runs of vLLM's offline engine "
                            "spread by 20-25%%")
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs per engine)")
        p.add_argument("--ep", action="store_true", help="expert parallel over the --tp ranks (MoE layers)")

    r = sub.add_parser("run", help="models, every engine configuration in its own process, report")
    r.add_argument("--out", required=True)
    r.add_argument("--model-dir", default="/tmp/e2e-models")
    r.add_argument("--engines", nargs="+", default=["vllm"], choices=list(CONFIGS))
    r.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    r.add_argument("--moe-layers", type=_positive_int, default=MOE_LAYERS, help=MOE_LAYERS_HELP)
    r.add_argument("--configs", nargs="+", default=None, help="subset of each engine's configurations")
    r.add_argument("--profile-batches", type=int, nargs="*", default=[1, 8, 64])
    r.add_argument("--profile-configs", nargs="+", default=None, metavar="[ENGINE:]CONFIG",
                   help="profile only these configurations (e.g. vllm:ours vllm:humming; default: every one)")
    r.add_argument("--serve", action="store_true",
                   help="also each engine's OpenAI server (vllm serve, sglang.launch_server) with streaming clients: "
                        "ours and the engine's best built-in, the first request after ready recorded")
    r.add_argument("--serve-models", nargs="+", default=None, choices=list(MODELS), help="default: --models")
    r.add_argument("--serve-engines", nargs="+", default=None, choices=list(CONFIGS), help="default: --engines")
    r.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    r.add_argument("--requests-per-client", type=int, default=2)
    r.add_argument("--port", type=int, default=8321)
    r.add_argument("--timeout", type=float, default=1200, help="seconds per engine process")
    r.add_argument("--overwrite", action="store_true", help="rerun configurations whose JSON is already in --out")
    r.add_argument("--gpus", nargs="+", default=None, metavar="ID",
                   help="run the configurations side by side, one engine process per --tp GPUs of these (e.g. "
                        "--gpus 0 1: two at a time), each taking the next configuration when its last one ends; "
                        "each round still starts after the previous one ends; default: one at a time on the "
                        "visible GPUs")
    r.add_argument("--site", action="append", default=[], metavar="ENGINE=DIR", type=_site_arg,
                   help="an engine's bundle (its unpacked site-packages folder): that engine's processes get DIR "
                        "first on PYTHONPATH (DIR/bin first on PATH) and no other engine's --site, so one run "
                        "takes both engines (e.g. --site vllm=/tmp/site --site sglang=/tmp/site_sg)")
    r.add_argument("--no-gpu-check", dest="gpu_check", action="store_false",
                   help="with --gpus, skip the GPU check (the same bf16 GEMM loop on every GPU at once, ~20 s, "
                        "before the engines start; reported as a table)")
    r.add_argument("--rounds", type=_positive_int, default=1,
                   help="run every configuration this many times, each in a fresh engine process, round after "
                        "round (each round's order rotated by one place); the report takes the median of the "
                        "rounds (profiles: the first round only)")
    common(r)
    w = sub.add_parser("worker", help="(internal) one engine configuration")
    w.add_argument("--engine", required=True, choices=list(CONFIGS))
    w.add_argument("--model", required=True, choices=list(MODELS))
    w.add_argument("--config", required=True)
    w.add_argument("--model-path", required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--profile-batches", type=int, nargs="*", default=[])
    w.add_argument("--profile-delay", type=int, default=4, help="engine steps skipped before profiling (prefill)")
    w.add_argument("--profile-steps", type=int, default=16)
    w.add_argument("--side-by-side", default=None, metavar="GPUS",
                   help="(from run --gpus) this engine ran beside others, on these GPUs: recorded in the result")
    common(w)
    m = sub.add_parser("models", help="only build the checkpoints")
    m.add_argument("--model-dir", default="/tmp/e2e-models")
    m.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    m.add_argument("--moe-layers", type=_positive_int, default=MOE_LAYERS, help=MOE_LAYERS_HELP)
    pb = sub.add_parser("prebuild-sglang-jit", help="build SGLang's nvcc JIT kernels (its built-in NVFP4 on Hopper's "
                        "Marlin, the first request's position clamp) into the cache the engine processes use; `run` "
                        "does it too")
    pb.add_argument("--no-marlin", action="store_true", help="only the modules every configuration needs")
    g = sub.add_parser("gpu-check", help="(internal, from run --gpus) the GEMM loop on the first visible GPU")
    g.add_argument("--out", required=True)
    g.add_argument("--warm", type=float, default=GPU_CHECK_SECONDS[0])
    g.add_argument("--seconds", type=float, default=GPU_CHECK_SECONDS[1])
    p = sub.add_parser("report", help="tables and plot from a results folder")
    p.add_argument("out")
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.cmd == "worker":
        return worker(a)
    if a.cmd == "models":
        build_models(Path(a.model_dir), a.models, a.moe_layers)
        return 0
    if a.cmd == "report":
        report(Path(a.out))
        return 0
    if a.cmd == "gpu-check":
        return gpu_check_worker(Path(a.out), a.warm, a.seconds)
    if a.cmd == "prebuild-sglang-jit":
        return 0 if all("ready" in line for line in prebuild_sglang_jit(marlin=not a.no_marlin)) else 1
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
