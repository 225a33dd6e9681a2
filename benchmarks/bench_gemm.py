"""Hopper FP4-weight GEMMs vs bf16 cuBLAS / torch._grouped_mm (and vLLM's Marlin and Humming FP4 if importable).

One command on the H200 (about 3-5 minutes)::

    python benchmarks/bench_gemm.py --out benchmarks/results/gemm_h200

Tables (printed, and written as markdown + JSON under ``--out``):
  * dense: (N, K) in the five issue shapes x M in {1, 4, 16, 64, 256, 1024, 4096}: our time, cuBLAS
    bf16 ``torch.mm`` on the same (dequantized) weights, speedup, and our achieved weight bandwidth
    (packed bytes read / time) as a fraction of the measured device-to-device copy bandwidth; with vLLM on
    the path (its bundle) also vLLM's Marlin and Humming NVFP4 GEMMs on the same weight (each checked against
    ours first: ``*_rel_err_vs_ours``);
  * grouped: Qwen3-30B-A3B-like (E=128, top-8, H=2048, I=768) and DeepSeek-V3-like (E=256, top-8,
    H=7168, I=2048) up (gate+up, N=2I) and down projections, tokens in {1, 4, ..., 4096}, same
    routing for both, vs ``torch._grouped_mm`` bf16 (``offs`` = int32 cumulative row ends,
    ``mat2`` = ``[E, K, N]`` view of the ``[E, N, K]`` weights);
  * masked: the same projections in the DeepEP low-latency layout ``[E, max_m, K]``, max_m in
    {8, 64, 256}, every expert full (the baseline has no mask: ``torch._grouped_mm`` 3-D x 3-D),
    plus our time with random per-expert counts.

Method: every timing is a CUDA graph of many calls (launch overhead out, as when an engine replays
decode graphs), replayed several times, median per call. Successive calls cycle through enough
weight copies (dense) or routings (grouped) that the bytes touched exceed 3x the 60 MB L2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import device_copy_bandwidth, time_calls  # noqa: E402
from nvfp4_plugin.gemm import W4Config, select_config, w4_dequantize, w4_grouped, w4_linear, w4_masked  # noqa: E402
from nvfp4_plugin.gemm.layout import HopperW4Layout, PackedW4Weight  # noqa: E402

DENSE_SHAPES = [(6144, 4096), (28672, 4096), (4096, 14336), (7168, 2048), (2048, 7168)]
DENSE_M = [1, 4, 16, 64, 256, 1024, 4096]
MOE_MODELS = {"qwen3-30b-a3b": dict(E=128, top_k=8, H=2048, I=768),
              "deepseek-v3": dict(E=256, top_k=8, H=7168, I=2048)}
MOE_TOKENS = [1, 4, 16, 64, 256, 1024, 4096]
MASKED_MAX_M = [8, 64, 256]
L2_BYTES = 60 * 2**20
ROTATE_BYTES = 3 * L2_BYTES
#: "cuda" normally; ``--smoke`` on a machine without a GPU runs tiny shapes on the CPU (interpreter,
#: wall-clock timing) to check that the script itself works.
DEVICE = "cuda"

SMOKE = dict(dense_shapes=[(256, 256), (96, 208)], dense_m=[1, 16, 40], tokens=[1, 8], max_m=[8, 24],
             models={"tiny-moe": dict(E=4, top_k=2, H=128, I=64)})


# ----------------------------------------------------------------------------------------------
# problems
# ----------------------------------------------------------------------------------------------

def random_packed(lead: tuple, n: int, k: int, dtype=torch.bfloat16, device=None, seed=0) -> PackedW4Weight:
    """A packed weight with random codes and realistic scales, built directly in the kernel layout:
    one global scale per tensor (per expert), as checkpoints have (fused shards share it too)."""
    device = device or DEVICE
    g = torch.Generator(device=device).manual_seed(seed)
    lay = HopperW4Layout(dtype, n, k, lead)
    e = max(1, lay.num_experts)
    words = torch.randint(-2**31, 2**31 - 1, (e, lay.n_pad // 2, lay.k_pad // 4), generator=g, device=device,
                          dtype=torch.int64).to(torch.int32)
    lo = torch.randint(168, 239, (e, lay.n_pad // 2, lay.scale_cols), generator=g, device=device)
    hi = torch.randint(168, 239, (e, lay.n_pad // 2, lay.scale_cols), generator=g, device=device)
    pair = lo | (hi << 8)
    scales = torch.where(pair >= 2**15, pair - 2**16, pair).to(torch.int16)
    gs = (torch.rand((e, 1), generator=g, device=device) * 100 + 1000).expand(e, n).contiguous()
    alpha = torch.zeros((e, lay.n_pad), device=device)
    alpha[:, :n] = 256.0 / gs
    if not lead:
        lay = dataclasses.replace(lay, alpha_const=float(alpha[0, 0]))
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return PackedW4Weight(lay, words, scales, alpha, gs, empty, torch.zeros((0, 8), dtype=torch.uint8, device=device))


def packed_bytes(p: PackedW4Weight, experts: int | None = None) -> int:
    e = p.words.shape[0]
    per = (p.words.numel() * 4 + p.scales.numel() * 2 + p.alpha.numel() * 4) / e
    return int(per * (e if experts is None else experts))


def bf16_weights(p: PackedW4Weight) -> torch.Tensor:
    """The same weights, dequantized to bf16 ``[E, N, K]`` (baseline operand)."""
    w = w4_dequantize(p)
    w = w.reshape(-1, p.layout.n, p.layout.k)
    w.mul_(p.alpha[:, :p.layout.n, None].to(w.dtype))
    return w


def routing(tokens: int, num_experts: int, top_k: int, seed: int, device=None):
    """Random top-k routing sorted by expert: (expert_offsets [E+1] int32, token of each pair int32,
    pair id of each sorted row int32, topk weights flat fp32, offs for torch._grouped_mm)."""
    device = device or DEVICE
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(tokens, num_experts, generator=g, device=device)
    w, ids = torch.topk(scores, top_k, dim=-1)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
    offsets[1:] = torch.cumsum(counts, 0)
    return dict(offsets=offsets, token=(order // top_k).to(torch.int32), pair=order.to(torch.int32),
                topk_w=(w / w.sum(-1, keepdim=True)).reshape(-1).float(), offs=offsets[1:].contiguous(),
                active=int((counts > 0).sum()))


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------

def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def copies_for(nbytes: int, cap: int = 64) -> int:
    if DEVICE != "cuda":
        return 2
    return max(2, min(cap, math.ceil(ROTATE_BYTES / max(nbytes, 1))))


def rotations(tokens: int) -> int:
    """Routings to cycle through so the experts touched exceed the L2 (few tokens touch few experts)."""
    if DEVICE != "cuda":
        return 2
    return 16 if tokens <= 16 else (4 if tokens <= 256 else 1)


# ----------------------------------------------------------------------------------------------
# optional baseline: vLLM Marlin FP4 (the engine's shipped Hopper path)
# ----------------------------------------------------------------------------------------------

class _MarlinDense:
    """vLLM's NVFP4 Marlin GEMM on a canonical weight (``prepare_fp4_layer_for_marlin`` +
    ``apply_fp4_marlin_linear``); raises if vLLM (or that API) is not importable."""

    def __init__(self, packed_canonical, block_scale, global_scale_decode, n, k):
        from vllm.model_executor.layers.quantization.utils import marlin_utils_fp4 as mu

        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(packed_canonical, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(block_scale, requires_grad=False)
        layer.weight_global_scale = torch.nn.Parameter(global_scale_decode, requires_grad=False)
        layer.output_size_per_partition = n
        layer.input_size_per_partition = k
        layer.params_dtype = torch.bfloat16
        layer.bias = None
        mu.prepare_fp4_layer_for_marlin(layer)
        self.layer, self.mu, self.n, self.k = layer, mu, n, k

    def __call__(self, x):
        l = self.layer
        return self.mu.apply_fp4_marlin_linear(input=x, weight=l.weight, weight_scale=l.weight_scale,
                                               weight_global_scale=l.weight_global_scale, workspace=l.workspace,
                                               size_n=self.n, size_k=self.k, bias=None)


class _HummingDense:
    """vLLM's NVFP4 Humming GEMM (``--linear-backend humming``, the fastest built-in dense backend on the H200 at
    most batch sizes) on a canonical weight, set up as vLLM's NVFP4 linear schemes hand it over: packed codes as
    ``weight``, linear e4m3 block scales, the decode global scale ``1 / global_scale`` (0-dim); then the kernel
    class's own ``process_weights_after_loading`` and ``apply_weights``. Raises if vLLM (with its ``humming``
    package) or that API is not importable."""

    def __init__(self, packed_canonical, block_scale, global_scale_decode, n, k):
        from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig
        from vllm.model_executor.kernels.linear.nvfp4.humming import HummingNvFp4LinearKernel

        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(packed_canonical, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(block_scale, requires_grad=False)
        layer.weight_global_scale = torch.nn.Parameter(global_scale_decode.reshape(()), requires_grad=False)
        layer.input_size = layer.input_size_per_partition = k
        layer.output_size_per_partition = n
        layer.output_partition_sizes = [n]
        layer.params_dtype = torch.bfloat16
        layer.has_bias = False
        self.kernel = HummingNvFp4LinearKernel(NvFp4LinearLayerConfig())
        self.kernel.process_weights_after_loading(layer)
        self.layer = layer

    def __call__(self, x):
        return self.kernel.apply_weights(self.layer, x)


def _peer_or_reason(cls, p: PackedW4Weight):
    try:
        from nvfp4_plugin.gemm.layout import unpack
        w = unpack(p)
        gs_dec = (1.0 / w.global_scale.reshape(-1)[:1]).to(torch.float32)  # one tensor scale (the peers' model)
        return cls(w.packed.reshape(p.layout.n, -1), w.block_scale.reshape(p.layout.n, -1), gs_dec,
                   p.layout.n, p.layout.k), None
    except Exception as exc:  # vLLM absent or API drift: skip cleanly
        return None, f"{type(exc).__name__}: {str(exc)[:120]}"


def marlin_or_reason(p: PackedW4Weight):
    return _peer_or_reason(_MarlinDense, p)


def humming_or_reason(p: PackedW4Weight):
    return _peer_or_reason(_HummingDense, p)


# ----------------------------------------------------------------------------------------------
# parallel pre-compilation (the Triton cache is shared through the file system)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    kind: str
    n: int
    k: int
    e: int
    m: int
    cfg: tuple | None = None      # sorted items of a W4Config JSON dict (hashable)
    gather: bool = False

    @staticmethod
    def make(kind, n, k, e, m, cfg: W4Config | None, gather=False) -> "Job":
        return Job(kind, n, k, e, m, tuple(sorted(cfg.to_json().items())) if cfg is not None else None, gather)


def _run_job(job: Job) -> str:
    """Launch one variant on a small problem with the same compile-time specialization (dtypes,
    16-divisibility of N, K and strides, constexprs): fills the shared Triton cache."""
    try:
        cfg = W4Config.from_json(dict(job.cfg)) if job.cfg is not None else None
        e = min(job.e, 2)
        if job.kind == "dense":
            p = random_packed((), job.n, job.k)
            x = torch.randn(min(max(job.m, 1), 64), job.k, device=DEVICE, dtype=torch.bfloat16)
            w4_linear(x, p, config=cfg)
        elif job.kind == "grouped":
            p = random_packed((e,), job.n, job.k)
            r = routing(4, e, 1, 0)
            x = torch.randn(r["token"].shape[0], job.k, device=DEVICE, dtype=torch.bfloat16)
            w4_grouped(x, p, r["offsets"], gather_idx=r["token"] if job.gather else None, config=cfg)
        else:
            p = random_packed((e,), job.n, job.k)
            x = torch.randn(e, job.m, job.k, device=DEVICE, dtype=torch.bfloat16)
            mask = torch.full((e,), job.m, dtype=torch.int32, device=DEVICE)
            w4_masked(x, p, mask, config=cfg)
        _sync()
        return ""
    except Exception as exc:
        return f"{job}: {type(exc).__name__}: {exc}"[:400]


def _worker(jobs):
    torch.cuda.init()
    out = []
    for j in jobs:
        err = _run_job(j)
        out.append((_compile_key(j), err) if err else None)
        if err and "CUDA error" in err:      # a poisoned context fails everything after it: stop here
            out.extend((_compile_key(r), "not compiled: an earlier variant broke this worker's CUDA context")
                       for r in jobs[len(out):])
            break
    return out


def _compile_key(job: Job):
    """What decides a distinct compiled kernel (runtime ints like M, split_k, m_split do not)."""
    cfg = W4Config.from_json(dict(job.cfg)) if job.cfg is not None else None
    if cfg is None:
        return (job.kind, job.n, job.k, job.e, job.m, job.gather)
    if cfg.dequant_mm:
        return ("dequant", job.k % 128 == 0)
    return (job.kind, job.gather, cfg.bn, cfg.bm, cfg.bk, cfg.v2, cfg.ss, cfg.gluon, cfg.split_k > 1, cfg.num_warps,
            cfg.num_stages, cfg.prefetch, job.k % cfg.bk == 0, job.n % 16 == 0, job.k % 16 == 0)


def _dedupe(jobs: list[Job]) -> list[Job]:
    seen = {}
    for j in jobs:
        seen.setdefault(_compile_key(j), j)
    return list(seen.values())


FAILED_KEYS: set = set()


def precompile(jobs: list[Job], workers: int = 0, time_cap_s: float = 240.0) -> list[str]:
    """Compile every distinct kernel variant in ``workers`` processes; returns error strings and
    records the failing variants in :data:`FAILED_KEYS` (callers skip them rather than risk a crash).
    Stops waiting after ``time_cap_s`` (what is left compiles lazily, in the main process)."""
    jobs = _dedupe(jobs)
    if not jobs:
        return []
    workers = workers or max(1, min(16, (os.cpu_count() or 2) - 1, len(jobs)))
    chunks = [jobs[i::workers] for i in range(workers)]
    t = time.time()
    ctx = mp.get_context("spawn")
    pool = ctx.Pool(workers)
    try:
        res = pool.map_async(_worker, chunks).get(timeout=time_cap_s)
        failed = [e for r in res for e in r if e]
        FAILED_KEYS.update(k for k, _ in failed)
        errs = [m for _, m in failed]
        pool.close()
    except mp.TimeoutError:
        errs = [f"precompile stopped after {time_cap_s:.0f}s; remaining variants compile on first use"]
        pool.terminate()
    pool.join()
    print(f"[precompile] {len(jobs)} variants in {workers} processes: {time.time() - t:.1f}s, {len(errs)} errors",
          flush=True)
    return errs


# ----------------------------------------------------------------------------------------------
# the three tables
# ----------------------------------------------------------------------------------------------

def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bench_dense(copy_bw: float, with_peers: bool, ms=DENSE_M, shapes=DENSE_SHAPES):
    rows = []
    for (n, k) in shapes:
        p0 = random_packed((), n, k, seed=n + k)
        nbytes = packed_bytes(p0)
        r4 = copies_for(nbytes)
        packs = [p0] + [random_packed((), n, k, seed=n + k + i) for i in range(1, r4)]
        w16 = bf16_weights(p0)[0]
        r16 = copies_for(w16.numel() * 2, cap=8)
        w16s = [w16] + [w16.clone() for _ in range(1, r16)]
        peers = {name: (make(p0) if with_peers else (None, "not requested"))
                 for name, make in (("marlin", marlin_or_reason), ("humming", humming_or_reason))}
        for m in ms:
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            cfg = select_config("dense", m, n, k)
            ours = [lambda p=p: w4_linear(x, p) for p in packs]
            base = [lambda w=w: torch.mm(x, w.t()) for w in w16s]
            err = rel_err(w4_linear(x, p0), torch.mm(x, w16.t()))
            t_ours = time_calls(ours, fill_ms=4)
            t_base = time_calls(base, fill_ms=4)
            row = dict(N=n, K=k, M=m, ours_us=t_ours * 1e6, cublas_us=t_base * 1e6, speedup=t_base / t_ours,
                       weight_TBps=nbytes / t_ours / 1e12, frac_copy_bw=nbytes / t_ours / copy_bw,
                       rel_err_vs_bf16=err, config=cfg.to_json(),
                       kernel="cuBLAS" if cfg.dequant_mm else ("gluon" if cfg.gluon else "triton"))
            for name, (peer, why) in peers.items():
                if peer is not None:
                    try:
                        # the same weight as ours' first copy: a peer set up wrong shows as an error, not a time
                        perr = rel_err(peer(x), w4_linear(x, p0))
                        t_p = time_calls([lambda peer=peer: peer(x)], fill_ms=4)
                        row.update({f"{name}_us": t_p * 1e6, f"speedup_vs_{name}": t_p / t_ours,
                                    f"{name}_rel_err_vs_ours": perr})
                    except Exception as exc:
                        row[f"{name}_error"] = str(exc)[:120]
                elif with_peers:
                    row[f"{name}_skipped"] = why
            rows.append(row)
            peer_us = "".join(f"  {name} {row[f'{name}_us']:9.1f} us" for name in peers if f"{name}_us" in row)
            print(f"dense N={n:6d} K={k:6d} M={m:5d}: ours {t_ours * 1e6:9.1f} us  cuBLAS {t_base * 1e6:9.1f} us  "
                  f"x{t_base / t_ours:5.2f}  {row['frac_copy_bw']:.2f} of copy BW  err {err:.1e}{peer_us}", flush=True)
        del packs, w16s, w16
        torch.cuda.empty_cache()
    return rows


def moe_projections(model: str):
    c = MOE_MODELS[model]
    return [("up", 2 * c["I"], c["H"]), ("down", c["H"], c["I"])]


def bench_grouped(copy_bw: float, tokens_list=MOE_TOKENS, models=tuple(MOE_MODELS)):
    rows = []
    for model in models:
        c = MOE_MODELS[model]
        e, top_k = c["E"], c["top_k"]
        for proj, n, k in moe_projections(model):
            p = random_packed((e,), n, k, seed=n)
            w16 = bf16_weights(p)
            w16t = w16.transpose(1, 2)
            per_expert = packed_bytes(p, 1)
            for t in tokens_list:
                n_rot = rotations(t)
                routs = [routing(t, e, top_k, seed=1000 * t + i) for i in range(n_rot)]
                rows_total = t * top_k
                xs = torch.randn(rows_total, k, device=DEVICE, dtype=torch.bfloat16)
                cfg = select_config("grouped", rows_total, n, k, e)
                ours = [lambda r=r: w4_grouped(xs, p, r["offsets"]) for r in routs]
                base = [lambda r=r: torch._grouped_mm(xs, w16t, offs=r["offs"]) for r in routs]
                err = rel_err(w4_grouped(xs, p, routs[0]["offsets"]), torch._grouped_mm(xs, w16t, offs=routs[0]["offs"]))
                t_ours = time_calls(ours, fill_ms=4)
                t_base = time_calls(base, fill_ms=4)
                active = statistics.mean(r["active"] for r in routs)
                nbytes = per_expert * active
                row = dict(model=model, proj=proj, E=e, N=n, K=k, tokens=t, rows=rows_total, active_experts=active,
                           ours_us=t_ours * 1e6, grouped_mm_us=t_base * 1e6, speedup=t_base / t_ours,
                           weight_TBps=nbytes / t_ours / 1e12, frac_copy_bw=nbytes / t_ours / copy_bw,
                           rel_err_vs_bf16=err, config=cfg.to_json())
                # production use: the up projection reading tokens through the gather index
                if proj == "up":
                    xt = torch.randn(t, k, device=DEVICE, dtype=torch.bfloat16)
                    fused = [lambda r=r: w4_grouped(xt, p, r["offsets"], gather_idx=r["token"]) for r in routs]
                    row["ours_gather_us"] = time_calls(fused, fill_ms=4) * 1e6
                rows.append(row)
                print(f"grouped {model:14s} {proj:4s} T={t:5d}: ours {t_ours * 1e6:9.1f} us  grouped_mm "
                      f"{t_base * 1e6:9.1f} us  x{t_base / t_ours:5.2f}  {row['frac_copy_bw']:.2f} of copy BW  "
                      f"err {err:.1e}", flush=True)
            del p, w16, w16t
            torch.cuda.empty_cache()
    return rows


def bench_masked(copy_bw: float, max_ms=MASKED_MAX_M, models=tuple(MOE_MODELS)):
    rows = []
    for model in models:
        c = MOE_MODELS[model]
        e = c["E"]
        for proj, n, k in moe_projections(model):
            p = random_packed((e,), n, k, seed=n + 1)
            w16t = bf16_weights(p).transpose(1, 2)
            for mm in max_ms:
                x = torch.randn(e, mm, k, device=DEVICE, dtype=torch.bfloat16)
                full = torch.full((e,), mm, dtype=torch.int32, device=DEVICE)
                g = torch.Generator(device=DEVICE).manual_seed(mm)
                rand = torch.randint(0, mm + 1, (e,), generator=g, device=DEVICE, dtype=torch.int32)
                cfg = select_config("masked", mm, n, k, e)
                out = torch.empty(e, mm, n, device=DEVICE, dtype=torch.bfloat16)
                err = rel_err(w4_masked(x, p, full), torch._grouped_mm(x, w16t))
                t_ours = time_calls([lambda: w4_masked(x, p, full, out=out)], fill_ms=4)
                t_rand = time_calls([lambda: w4_masked(x, p, rand, out=out)], fill_ms=4)
                t_base = time_calls([lambda: torch._grouped_mm(x, w16t)], fill_ms=4)
                nbytes = packed_bytes(p)
                rows.append(dict(model=model, proj=proj, E=e, N=n, K=k, max_m=mm, ours_us=t_ours * 1e6,
                                 ours_random_mask_us=t_rand * 1e6, grouped_mm_us=t_base * 1e6,
                                 speedup=t_base / t_ours, weight_TBps=nbytes / t_ours / 1e12,
                                 frac_copy_bw=nbytes / t_ours / copy_bw, rel_err_vs_bf16=err, config=cfg.to_json()))
                print(f"masked  {model:14s} {proj:4s} max_m={mm:4d}: ours {t_ours * 1e6:9.1f} us (random mask "
                      f"{t_rand * 1e6:8.1f})  grouped_mm {t_base * 1e6:9.1f} us  x{t_base / t_ours:5.2f}  err {err:.1e}",
                      flush=True)
            del p, w16t
            torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------

def _md_table(rows, cols):
    head = "| " + " | ".join(c for c, _ in cols) + " |\n|" + "---|" * len(cols) + "\n"
    body = ""
    for r in rows:
        cells = []
        for _, key in cols:
            v = r.get(key, "")
            cells.append(f"{v:.2f}" if isinstance(v, float) else str(v))
        body += "| " + " | ".join(cells) + " |\n"
    return head + body


def markdown(meta, dense, grouped, masked) -> str:
    s = f"# FP4-weight GEMMs on {meta['device']}\n\n"
    s += (f"torch {meta['torch']}, triton {meta['triton']}, measured device copy bandwidth "
          f"{meta['copy_TBps']:.2f} TB/s; command `{meta['command']}`; {meta['date']}.\n"
          "Times are CUDA-graph medians per call, weights rotated beyond L2.\n\n")
    if dense:
        s += "## Dense (vs torch.mm bf16, cuBLAS)\n\n" + _md_table(dense, [
            ("N", "N"), ("K", "K"), ("M", "M"), ("ours us", "ours_us"), ("cuBLAS us", "cublas_us"),
            ("speedup", "speedup"), ("weight TB/s", "weight_TBps"), ("of copy BW", "frac_copy_bw"),
            ("kernel", "kernel"), ("Marlin us", "marlin_us"), ("vs Marlin", "speedup_vs_marlin"),
            ("Humming us", "humming_us"), ("vs Humming", "speedup_vs_humming")]) + "\n"
    if grouped:
        s += "## Grouped by expert offsets (vs torch._grouped_mm bf16, same routing)\n\n" + _md_table(grouped, [
            ("model", "model"), ("proj", "proj"), ("N", "N"), ("K", "K"), ("tokens", "tokens"),
            ("active experts", "active_experts"), ("ours us", "ours_us"), ("ours+gather us", "ours_gather_us"),
            ("grouped_mm us", "grouped_mm_us"), ("speedup", "speedup"), ("of copy BW", "frac_copy_bw")]) + "\n"
    if masked:
        s += "## Masked layout (vs torch._grouped_mm bf16 3-D, all rows)\n\n" + _md_table(masked, [
            ("model", "model"), ("proj", "proj"), ("N", "N"), ("K", "K"), ("max_m", "max_m"), ("ours us", "ours_us"),
            ("ours random-mask us", "ours_random_mask_us"), ("grouped_mm us", "grouped_mm_us"),
            ("speedup", "speedup"), ("of copy BW", "frac_copy_bw")]) + "\n"
    return s


def configs_in_use(plan) -> list[Job]:
    jobs = []
    for n, k in plan["dense_shapes"]:
        for m in plan["dense_m"]:
            cfg = select_config("dense", m, n, k)
            if not cfg.dequant_mm:
                jobs.append(Job.make("dense", n, k, 1, m, cfg))
    for model in plan["models"]:
        c = MOE_MODELS[model]
        for proj, n, k in moe_projections(model):
            for t in plan["tokens"]:
                cfg = select_config("grouped", t * c["top_k"], n, k, c["E"])
                jobs.append(Job.make("grouped", n, k, c["E"], t * c["top_k"], cfg))
                if proj == "up":
                    jobs.append(Job.make("grouped", n, k, c["E"], t * c["top_k"], cfg, gather=True))
            for mm in plan["max_m"]:
                jobs.append(Job.make("masked", n, k, c["E"], mm, select_config("masked", mm, n, k, c["E"])))
    return jobs


def make_plan(args) -> dict:
    global DEVICE
    if args.smoke:
        DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
        MOE_MODELS.update(SMOKE["models"])
        plan = dict(dense_shapes=SMOKE["dense_shapes"], dense_m=SMOKE["dense_m"], models=list(SMOKE["models"]),
                    tokens=SMOKE["tokens"], max_m=SMOKE["max_m"])
    else:
        plan = dict(dense_shapes=DENSE_SHAPES, dense_m=DENSE_M, models=list(MOE_MODELS), tokens=MOE_TOKENS,
                    max_m=MASKED_MAX_M)
    if args.dense_m:
        plan["dense_m"] = [int(v) for v in args.dense_m.split(",")]
    if args.dense_shapes:
        try:
            plan["dense_shapes"] = [(int(n), int(k)) for n, k in (v.split("x") for v in args.dense_shapes.split(","))]
        except ValueError:          # not a number, or not two of them
            raise SystemExit(f"bench_gemm: --dense-shapes {args.dense_shapes}: expected NxK[,NxK...], e.g. 6144x4096")
    if args.tokens:
        plan["tokens"] = [int(v) for v in args.tokens.split(",")]
    if args.skip_dense:
        plan["dense_shapes"] = []
    if args.skip_grouped:
        plan["tokens"] = []
    if args.skip_masked:
        plan["max_m"] = []
    return plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/gemm")
    ap.add_argument("--skip-dense", action="store_true")
    ap.add_argument("--skip-grouped", action="store_true")
    ap.add_argument("--skip-masked", action="store_true")
    ap.add_argument("--no-marlin", action="store_true", help="skip the vLLM peers (Marlin and Humming)")
    ap.add_argument("--dense-m", default=None, help="comma-separated dense M values (default: the issue's)")
    ap.add_argument("--dense-shapes", default=None, metavar="NxK,...",
                    help="dense weight shapes, e.g. 6144x4096,4096x4096,28672x4096,4096x14336 (Llama-3-8B's; "
                         "default: the issue's five)")
    ap.add_argument("--tokens", default=None, help="comma-separated grouped token counts (default: the issue's)")
    ap.add_argument("--no-precompile", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (runs on the CPU interpreter too): checks the script")
    args = ap.parse_args(argv)
    plan = make_plan(args)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("bench_gemm: needs a CUDA GPU (or --smoke)")
        return 2
    t_start = time.time()
    if not args.no_precompile and DEVICE == "cuda":
        for err in precompile(configs_in_use(plan)):
            print("[precompile] error:", err)
    torch.backends.cuda.matmul.allow_tf32 = False
    copy_bw = device_copy_bandwidth()[0]
    print(f"device copy bandwidth: {copy_bw / 1e12:.2f} TB/s", flush=True)
    import triton
    meta = dict(device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", torch=torch.__version__,
                triton=triton.__version__, copy_TBps=copy_bw / 1e12, command="python " + " ".join(sys.argv),
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    dense = bench_dense(copy_bw, not args.no_marlin and not args.smoke, plan["dense_m"], plan["dense_shapes"]) \
        if plan["dense_shapes"] else []
    grouped = bench_grouped(copy_bw, plan["tokens"], plan["models"]) if plan["tokens"] else []
    masked = bench_masked(copy_bw, plan["max_m"], plan["models"]) if plan["max_m"] else []
    meta["seconds"] = time.time() - t_start
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(dict(meta=meta, dense=dense, grouped=grouped, masked=masked), f, indent=1)
    md = markdown(meta, dense, grouped, masked)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md)
    print("\n" + md)
    print(f"total {meta['seconds']:.0f}s; wrote {args.out}/results.md and results.json")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
