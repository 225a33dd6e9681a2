#!/usr/bin/env python3
"""One fused-MoE layer forward: ours (``w4_fused_moe``, w4a16) against vLLM's bf16 ``fused_experts``, by stage.

    python3 -m benchmarks.bench_moe --out FILE.md                   # GPU machine (vLLM bundle: the bf16 peer)
    python3 -m benchmarks.bench_moe --out FILE.md --tokens 8192 16384 --model deepseek-v3
    nvfp4-plugin bench moe --out FILE.md

The served MoE model's prefill is slower than bf16's in vLLM (issue 37) while our grouped GEMMs alone
match the bf16 kernel: the difference is in what runs around them. Per token count, on the same random
top-k routing for both:

* ``ours µs`` / ``vLLM bf16 µs``: device time of the whole layer per call (CUDA graph of calls over
  rotated routings, so the experts touched exceed the L2; :func:`common.time_calls`);
* ``routing`` / ``up`` / ``SiLU-mul`` / ``down`` / ``combine``: each of our stages alone, timed the same
  way (``up`` includes the copy of the routed rows into expert order that the Gluon kernel's TMA
  loads need);
* ``eager µs``: wall time per call of back-to-back eager calls (one sync at the end): above the device
  time when the host path is the bottleneck;
* ``host µs``: the host's time per call alone, the GPU kept busy by a spin kernel queued first
  (:func:`common.host_us_per_call`), with the plugin's direct launches of compiled kernels and with every
  launch through Triton's ``kernel[grid]`` (``NVFP4_PLUGIN_FAST_LAUNCH=0``); vLLM runs prefill steps
  eagerly, and where this exceeds the device time the GPU waits for the host.

``--trace T`` records ``T`` tokens under the torch profiler instead, eager calls and one CUDA graph of the
same calls: device µs per kernel in each, the GPU's idle time between kernels of the eager calls, and
the CUDA runtime calls that held the host longest (a sync, an allocation, a copy) -- where eager time
beyond the device time goes.

``--host-profile T`` shows where the host's time of an eager call of ``T`` tokens goes: host µs with and
without the direct kernel launches and a cProfile of the calls (top functions by own and cumulative time).

``--sustained T`` times ``T`` tokens after seconds of load instead, when the GPU runs at its power cap:
the layer (ours; vLLM's and SGLang's bf16 fused MoE where importable), the up projection of the routed tokens
(the rows copied into expert order, then the GEMM), and the two grouped GEMMs under the selected config and a few
other Gluon tiles, beside ``torch._grouped_mm`` on the same weights in bf16; burst
(about 30 ms of replays on a rested GPU) and sustained (after 1.5 s of load) µs per call. Short CUDA-graph
timings rank kernels at boost clock; served prefill runs at the cap.

``--glue-shapes`` times the routing under several block sizes, the row gather (ours against
``torch.index_select``) and the row spread (each token's row read once, written to its top-k rows) under
several launch shapes, and SiLU-mul (the Triton kernel's launch shapes; the compiled kernel with its bf16
SiLU table forced off, on, and by its size rule) at each ``--tokens`` count instead (``triton.testing.do_bench``,
outputs checked bit-equal), beside a plain copy of the SiLU-mul's bytes: how the glue's shapes were chosen.

The peer is vLLM's Triton ``fused_experts`` on the same weights dequantized to bf16 (what ``--dtype bf16``
serves); without vLLM its columns say why. ``--smoke`` runs a tiny shape without the peer, on the GPU or,
without one, through the interpreter (the table's form, not numbers to quote).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_gemm as BG  # noqa: E402
from benchmarks.common import (cprofile_calls, launch_paths_us, time_calls, time_sustained,  # noqa: E402
                               wall_us_per_call, warm_up)
from nvfp4_plugin.gemm import moe_routing, w4_fused_moe, w4_grouped  # noqa: E402
from nvfp4_plugin.gemm.select import GluonConfig, select_config  # noqa: E402
from nvfp4_plugin.gemm.moe_glue import moe_combine, silu_and_mul  # noqa: E402

DEFAULT_TOKENS = (1, 8, 64, 512, 2048, 8192, 16384)
SMOKE_MODEL = dict(E=4, top_k=2, H=128, I=64)
STAGES = ("routing", "up", "silu_mul", "down", "combine")


def _routings(tokens: int, e: int, top_k: int, n: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` random top-k routings (ids int32 ``[T, k]``, renormalised fp32 weights)."""
    out = []
    for seed in range(n):
        g = torch.Generator(device=device).manual_seed(1000 + seed)
        w, ids = torch.topk(torch.rand(tokens, e, generator=g, device=device), top_k, dim=-1)
        out.append((ids.to(torch.int32), (w / w.sum(-1, keepdim=True)).float()))
    return out


def _weights(model: dict, device) -> tuple:
    """Random packed w13 ``[E, 2I, H]`` and w2 ``[E, H, I]`` of ``model`` (the same seeds in every study)."""
    e, h, inter = model["E"], model["H"], model["I"]
    return (BG.random_packed((e,), 2 * inter, h, device=device, seed=1),
            BG.random_packed((e,), h, inter, device=device, seed=2))


def _rotating(layer, x, w13, w2, routs):
    """``fn(i)``: ``layer(x, w13, w2, weights, ids)`` on routing ``i`` of ``routs`` (round robin)."""
    def fn(i):
        ids, w = routs[i % len(routs)]
        return layer(x, w13, w2, w, ids)
    return fn


def _vllm_bf16():
    """vLLM's bf16 ``fused_experts`` (the Triton ``fused_moe_kernel`` path), or the reason it is missing."""
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
    except Exception as exc:  # noqa: BLE001 - a missing peer is reported, not fatal
        return None, f"vLLM not importable ({type(exc).__name__}: {str(exc)[:80]})"
    return fused_experts, None


def _arg_names(fn) -> set[str]:
    """Parameter names of a function or of a registered torch custom op (its schema's arguments)."""
    op = getattr(fn, "default", None)
    if op is not None and hasattr(op, "_schema"):
        return {a.name for a in op._schema.arguments}
    return set(inspect.signature(fn).parameters)


def _sglang_default_config() -> None:
    """SGLang's kernels read the server's config (``get_exec()``: deterministic inference, the fused
    all-reduce of the MoE sum) from a process-wide context that only a server publishes; outside one,
    publish SGLang's own default ``ServerArgs`` (its test override), unless a config is already there."""
    from sglang.srt.runtime_context import get_context, get_exec
    try:
        get_exec()
    except ValueError:
        get_context().override_server_args().install()


def _sglang_bf16():
    """SGLang's bf16 Triton fused MoE as ``peer(x, w13, w2, topk_weights, topk_ids)``, or the reason it is
    missing: ``inplace_fused_experts``, what its bf16 server runs on Hopper (the MoE runner's default is in
    place), on a copy of ``x`` in a buffer kept per input (the copy, ~1% of the layer at prefill sizes, is
    timed with it). w13 is ``[gate; up]`` (not interleaved), as in the checkpoints."""
    try:
        from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import inplace_fused_experts
    except Exception as exc:  # noqa: BLE001 - a missing peer is reported, not fatal
        return None, f"SGLang not importable ({type(exc).__name__}: {str(exc)[:80]})"
    kw = {"gate_up_interleaved": False} if "gate_up_interleaved" in _arg_names(inplace_fused_experts) else {}
    _sglang_default_config()
    bufs: dict = {}

    def peer(x, w13, w2, topk_weights, topk_ids):
        buf = bufs.get((x.data_ptr(), x.shape))
        if buf is None:
            buf = bufs[(x.data_ptr(), x.shape)] = torch.empty_like(x)
        buf.copy_(x)
        inplace_fused_experts(buf, w13, w2, topk_weights, topk_ids, **kw)
        return buf
    return peer, None


def measure(model: dict, tokens_list, device, with_vllm: bool = True) -> tuple[list[dict], str | None]:
    e, top_k, h = model["E"], model["top_k"], model["H"]
    cuda = device == "cuda"
    p13, p2 = _weights(model, device)
    peer, reason = _vllm_bf16() if (with_vllm and cuda) else (None, "not run (no GPU)" if not cuda else "off")
    w13_16 = BG.bf16_weights(p13) if peer else None
    w2_16 = BG.bf16_weights(p2) if peer else None
    rows = []
    for t in tokens_list:
        g = torch.Generator(device=device).manual_seed(t)
        x = (torch.randn(t, h, generator=g, device=device) * 0.5).to(torch.bfloat16)
        routs = _routings(t, e, top_k, BG.rotations(t), device)
        row = dict(tokens=t, routed_rows=t * top_k)
        row["ours_us"] = time_calls([lambda r=r: w4_fused_moe(x, p13, p2, r[1], r[0]) for r in routs]) * 1e6
        # the stages on their own, on the inputs the layer gives them
        plan = []
        for ids, w in routs:
            rt = moe_routing(ids, e)
            hmid = w4_grouped(x, p13, rt["expert_offsets"], gather_idx=rt["gather_idx"], gather_pos=rt["pair_pos"])
            act = silu_and_mul(hmid)
            y = torch.empty((t * top_k, h), dtype=x.dtype, device=device)
            w4_grouped(act, p2, rt["expert_offsets"], scatter_idx=rt["scatter_idx"], out=y)
            plan.append((ids, w, rt, hmid, act, y))
        stage_calls = {
            "routing": [lambda s=s: moe_routing(s[0], e) for s in plan],
            # as the layer calls it: with routing's inverse index (each token's row copied once, Gluon tiles)
            "up": [lambda s=s: w4_grouped(x, p13, s[2]["expert_offsets"], gather_idx=s[2]["gather_idx"],
                                          gather_pos=s[2]["pair_pos"], out=s[3]) for s in plan],
            "silu_mul": [lambda s=s: silu_and_mul(s[3], out=s[4]) for s in plan],
            "down": [lambda s=s: w4_grouped(s[4], p2, s[2]["expert_offsets"], scatter_idx=s[2]["scatter_idx"],
                                            out=s[5]) for s in plan],
            "combine": [lambda s=s: moe_combine(s[5], s[1], s[0], e) for s in plan],
        }
        for name, calls in stage_calls.items():
            row[f"{name}_us"] = time_calls(calls) * 1e6
        row["ours_eager_us"] = wall_us_per_call(_rotating(w4_fused_moe, x, p13, p2, routs), 20 if cuda else 1, cuda)
        row["ours_host_us"], row["ours_host_triton_us"] = launch_paths_us(
            _rotating(w4_fused_moe, x, p13, p2, routs), 30 if cuda else 1, cuda, rounds=5 if cuda else 1)
        if peer is not None:
            bf16 = _rotating(peer, x, w13_16, w2_16, routs)
            try:
                row["vllm_bf16_us"] = time_calls([lambda i=i: bf16(i) for i in range(len(routs))]) * 1e6
                row["vllm_bf16_eager_us"] = wall_us_per_call(bf16, 20, cuda)
                row["speedup"] = row["vllm_bf16_us"] / row["ours_us"]
            except Exception as exc:  # noqa: BLE001 - the peer failing at one size is reported in the table
                reason = f"vLLM fused_experts failed: {type(exc).__name__}: {str(exc)[:80]}"
        rows.append(row)
        print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        del plan, stage_calls
    return rows, reason


TRACE_CALLS = 5
#: CUDA runtime calls that can hold the host (the harness ends each profiled stretch with one
#: cudaEventSynchronize of its own, which trace_summary leaves out)
RUNTIME_SYNCS = ("Synchronize", "Malloc", "Free", "Memcpy", "Memset", "EventQuery", "HostAlloc")


def _profile(fn, calls: int, graph: bool):
    """Torch-profiler events of ``calls`` calls of ``fn(i)``: eager, or one CUDA graph of them replayed once."""
    from torch.profiler import ProfilerActivity, profile
    g = None
    if graph:
        warm_up([lambda: fn(0)])
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(calls):
                fn(i)
    fn(0)
    torch.cuda.synchronize()
    done = torch.cuda.Event()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        if g is not None:
            g.replay()
        else:
            for i in range(calls):
                fn(i)
        done.record()
        done.synchronize()        # the harness's own wait: cudaEventSynchronize, left out by trace_summary
        wall = (time.perf_counter() - t0) * 1e6
    return prof.events(), wall


def trace_summary(events, wall_us: float, calls: int) -> dict:
    """Per kernel name: µs per call of the layer; the GPU's idle time between consecutive kernels; and the
    CUDA runtime calls (syncs, allocations, copies) that held the host, from profiler ``events``."""
    kernels = sorted((e for e in events if e.device_type.name == "CUDA" and e.device_time_total > 0),
                     key=lambda e: e.time_range.start)
    per = {}
    for e in kernels:
        name = e.name if len(e.name) <= 60 else e.name[:57] + "..."
        per[name] = per.get(name, 0.0) + e.time_range.elapsed_us() / calls
    idle, gaps = 0.0, []
    end, last = None, None
    for k in kernels:          # against the latest end so far: kernels may overlap
        if end is not None and k.time_range.start > end:
            gap = k.time_range.start - end
            idle += gap
            gaps.append((gap, last.name[:40], k.name[:40]))
        if end is None or k.time_range.end > end:
            end, last = k.time_range.end, k
    host = [e for e in events if e.device_type.name == "CPU" and any(k in e.name for k in RUNTIME_SYNCS)]
    waits = [e for e in host if e.name == "cudaEventSynchronize"]
    if waits:                  # the harness's final wait (see _profile) is not the layer's
        host.remove(max(waits, key=lambda e: e.time_range.start))
    runtime = {}
    for e in host:
        c, us = runtime.get(e.name, (0, 0.0))
        runtime[e.name] = (c + 1, us + e.time_range.elapsed_us())
    busy = sum(per.values())
    return dict(wall_us=wall_us / calls, kernel_us=busy, idle_us=idle / calls, per_kernel=per,
                top_gaps=sorted(gaps, reverse=True)[:5], runtime=runtime)


def trace(model: dict, tokens: int, with_vllm: bool) -> str:
    e, top_k, h = model["E"], model["top_k"], model["H"]
    p13, p2 = _weights(model, "cuda")
    x = (torch.randn(tokens, h, device="cuda") * 0.5).to(torch.bfloat16)
    routs = _routings(tokens, e, top_k, max(2, BG.rotations(tokens)), "cuda")
    fns = {"ours": _rotating(w4_fused_moe, x, p13, p2, routs)}
    peer, _ = _vllm_bf16() if with_vllm else (None, None)
    if peer is not None:
        fns["vLLM bf16"] = _rotating(peer, x, BG.bf16_weights(p13), BG.bf16_weights(p2), routs)
    md = [f"Trace of {tokens} tokens, {TRACE_CALLS} calls (µs per call):", ""]
    for name, fn in fns.items():
        res = {mode: trace_summary(*_profile(fn, TRACE_CALLS, mode == "graph"), TRACE_CALLS)
               for mode in ("eager", "graph")}
        ea, gr = res["eager"], res["graph"]
        md += [f"### {name}", "",
               f"eager: wall {ea['wall_us']:.1f}, kernels {ea['kernel_us']:.1f}, GPU idle between kernels "
               f"{ea['idle_us']:.1f}; graph: wall {gr['wall_us']:.1f}, kernels {gr['kernel_us']:.1f}", "",
               "| kernel | eager µs | graph µs |", "|---|---:|---:|"]
        for k in sorted(set(ea["per_kernel"]) | set(gr["per_kernel"]), key=lambda k: -ea["per_kernel"].get(k, 0)):
            md.append(f"| `{k}` | {ea['per_kernel'].get(k, 0):.1f} | {gr['per_kernel'].get(k, 0):.1f} |")
        md += ["", "Longest GPU idle gaps (eager): " + "; ".join(f"{g:.0f} µs {a} -> {b}"
                                                              for g, a, b in ea["top_gaps"]),
               "", "CUDA runtime calls (eager, over all calls): " + "; ".join(
                   f"{k} x{c} {us:.0f} µs" for k, (c, us) in sorted(ea["runtime"].items(), key=lambda kv: -kv[1][1])),
               ""]
    return "\n".join(md) + "\n"


#: Gluon tiles compared under sustained load (--sustained), beside the selected one.
SUSTAINED_CONFIGS = {"bn64 bm128": GluonConfig(bn=64, bm=128, bk=64, num_warps=4, num_stages=4),
                     "bn64 bm256": GluonConfig(bn=64, bm=256, bk=64, num_warps=4, num_stages=3),
                     "bn128 bm128": GluonConfig(bn=128, bm=128, bk=64, num_warps=8, num_stages=4),
                     "bn128 bm256": GluonConfig(bn=128, bm=256, bk=64, num_warps=8, num_stages=2),
                     "bn64 bm128 prefetch 4": GluonConfig(bn=64, bm=128, bk=64, num_warps=4, num_stages=4, prefetch=4),
                     # each expert's short last rows in a second launch of shorter tiles (GluonConfig.tail_bm)
                     "bn64 bm256 tail 128": GluonConfig(bn=64, bm=256, bk=64, num_warps=4, num_stages=3, tail_bm=128),
                     "bn64 bm256 tail 64": GluonConfig(bn=64, bm=256, bk=64, num_warps=4, num_stages=3, tail_bm=64),
                     "bn64 bm128 tail 64": GluonConfig(bn=64, bm=128, bk=64, num_warps=4, num_stages=4, tail_bm=64)}


@contextlib.contextmanager
def gluon_tail(rows: int):
    """Selection with ``select.GLUON_TAIL_BM = rows`` inside (0: the 256-row grouped tiles in one launch); the
    lookup cache is cleared on the way in and out, so the layer selects again."""
    from nvfp4_plugin.gemm import select as S
    old = S.GLUON_TAIL_BM
    S.GLUON_TAIL_BM = rows
    S.clear_cache()
    try:
        yield
    finally:
        S.GLUON_TAIL_BM = old
        S.clear_cache()


def sustained(model: dict, tokens: int, with_vllm: bool) -> str:
    e, top_k, h, inter = model["E"], model["top_k"], model["H"], model["I"]
    p13, p2 = _weights(model, "cuda")
    x = (torch.randn(tokens, h, device="cuda") * 0.5).to(torch.bfloat16)
    (ids, w), = _routings(tokens, e, top_k, 1, "cuda")
    rt = moe_routing(ids, e)
    xs = x.index_select(0, rt["gather_idx"].long())
    act = (torch.randn(tokens * top_k, inter, device="cuda") * 0.5).to(torch.bfloat16)
    rows = tokens * top_k
    md = [f"Sustained load, {tokens} tokens ({rows} routed rows), µs per call: burst (about 30 ms of replays on a "
          "rested GPU) / sustained (after 1.5 s of replays)", "", "| what | config | burst | sustained |",
          "|---|---|---:|---:|"]

    def add(what, cfg, fn):
        try:
            sus, burst = time_sustained(fn)
            md.append(f"| {what} | {cfg} | {burst:.1f} | {sus:.1f} |")
        except Exception as exc:  # noqa: BLE001 - one failing config is reported in the table
            md.append(f"| {what} | {cfg} | failed: {type(exc).__name__}: {str(exc)[:60]} | |")
        print(md[-1], flush=True)

    add("layer, ours", "selected", lambda: w4_fused_moe(x, p13, p2, w, ids))

    def one_launch():
        with gluon_tail(0):
            return w4_fused_moe(x, p13, p2, w, ids)
    add("layer, ours", "short last tiles not split off (GLUON_TAIL_BM 0)", one_launch)
    add("up projection of the routed tokens", "rows copied into expert order, then the GEMM",
        lambda: w4_grouped(x, p13, rt["expert_offsets"], gather_idx=rt["gather_idx"], gather_pos=rt["pair_pos"]))
    peer, reason = _vllm_bf16() if with_vllm else (None, "off")
    w13_16, w2_16 = BG.bf16_weights(p13), BG.bf16_weights(p2)
    if peer is not None:
        add("layer, vLLM bf16", "fused_experts", lambda: peer(x, w13_16, w2_16, w, ids))
    else:
        md.append(f"| layer, vLLM bf16 | {reason} | | |")
    sg, sg_reason = _sglang_bf16() if with_vllm else (None, "off")
    if sg is not None:
        add("layer, SGLang bf16", "inplace_fused_experts", lambda: sg(x, w13_16, w2_16, w, ids))
    else:
        md.append(f"| layer, SGLang bf16 | {sg_reason} | | |")
    ends = rt["expert_offsets"][1:]
    for proj, p, inp, wb in (("up", p13, xs, w13_16), ("down", p2, act, w2_16)):
        sel = select_config("grouped", rows, p.layout.n, p.layout.k, e, device=x.device)
        add(f"{proj} GEMM (rows in expert order)", f"selected: {sel.label} bn{sel.bn} bm{sel.bm}",
            lambda p=p, inp=inp: w4_grouped(inp, p, rt["expert_offsets"]))
        for name, cfg in SUSTAINED_CONFIGS.items():
            add(f"{proj} GEMM", f"gluon {name}", lambda p=p, inp=inp, cfg=cfg: w4_grouped(inp, p, rt["expert_offsets"],
                                                                                          config=cfg))
        add(f"{proj} GEMM", "bf16 torch._grouped_mm", lambda inp=inp, wb=wb: torch._grouped_mm(inp, wb.transpose(1, 2),
                                                                                                offs=ends))
    return "\n".join(md) + "\n"


def host_profile(model: dict, tokens: int, device, calls: int = 30, top: int = 25) -> str:
    """Where the host's time per eager layer call goes: host µs per call with direct kernel launches and
    through Triton's launch path, then cProfile over ``calls`` calls (the GPU kept busy by a spin kernel
    queued first, so no call waits for it), the ``top`` functions by own time and by cumulative time."""
    cuda = device == "cuda"
    p13, p2 = _weights(model, device)
    x = (torch.randn(tokens, model["H"], device=device) * 0.5).to(torch.bfloat16)
    routs = _routings(tokens, model["E"], model["top_k"], 1, device)
    fn = _rotating(w4_fused_moe, x, p13, p2, routs)
    direct, triton_path = launch_paths_us(fn, calls, cuda, rounds=5 if cuda else 1)
    md = [f"Host time per eager layer call at {tokens} tokens: {direct:.1f} µs with direct kernel launches, "
          f"{triton_path:.1f} µs through Triton's launch path (medians of five alternations, {calls} calls each).", ""]
    return "\n".join(md + cprofile_calls(fn, calls, cuda, top))


#: (rows per program, columns per pass, warps) of the row gather, and (rows, columns, warps) of the SiLU-mul
#: kernel, that --glue-shapes times
GATHER_SHAPES = tuple((br, bh, nw) for br in (4, 8, 16) for bh in (512, 1024, 2048) for nw in (4, 8))
#: (tokens per program, columns per pass, warps) of the row spread, and the routing block sizes, that --glue-shapes
#: times
SPREAD_SHAPES = tuple((bt, bh, nw) for bt in (1, 2, 4, 8) for bh in (1024, 2048) for nw in (4, 8))
ROUTE_BLOCKS = (64, 128, 256, 512, 1024, 2048)
SILU_SHAPES = ((16, 256, 4), (32, 256, 4), (32, 256, 8), (8, 256, 4), (8, 512, 4), (16, 512, 8), (4, 1024, 4),
               (8, 1024, 8), (64, 128, 8), (32, 128, 4), (16, 128, 4))


def glue_shapes(model: dict, tokens: list[int], device: str = "cuda") -> str:
    """µs per call of the row gather and the SiLU-mul kernel under each launch shape (GPU only)."""
    import triton
    from triton.testing import do_bench

    from nvfp4_plugin.gemm import moe_glue as MG
    from nvfp4_plugin.triton import _runtime as rt

    e, h, inter, k = model["E"], model["H"], model["I"], model["top_k"]
    md = [f"Row gather of the routed rows (top-{k}, H={h}) and SiLU-mul (I={inter}), µs per call "
          "(`triton.testing.do_bench`, L2 flushed between calls); TB/s of bytes read plus written:", "",
          "| tokens | kernel | launch shape | µs | TB/s |", "|---:|---|---|---:|---:|"]

    def row(t, what, shape, fn, nbytes):
        us = do_bench(fn, warmup=10, rep=60) * 1e3
        md.append(f"| {t} | {what} | {shape} | {us:.1f} | {nbytes / us / 1e6:.2f} |")
        print(md[-1], flush=True)

    for t in tokens:
        r = t * k
        x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
        ids = torch.topk(torch.rand(t, e, device=device), k, dim=-1)[1].to(torch.int32)
        idx = moe_routing(ids, e)["gather_idx"]
        want = x.index_select(0, idx)
        out = torch.empty_like(want)
        gbytes = 2 * r * h * x.element_size()
        xk, ok = x.view(torch.int16), out.view(torch.int16)
        for blk in ROUTE_BLOCKS:
            cur = blk == (MG.ROUTE_BLOCK_SMALL if MG.route_class(r) == 1 else MG.ROUTE_BLOCK)
            got, sel = moe_routing(ids, e, block=blk), moe_routing(ids, e)
            if any(not torch.equal(got[n], sel[n]) for n in sel):
                raise AssertionError(f"routing block={blk}: not the selected routing's result")
            # a CUDA graph of the call (its launches take longer on the host than its kernels on the GPU)
            us = time_calls([lambda blk=blk: moe_routing(ids, e, block=blk)]) * 1e6
            md.append(f"| {t} | routing | blocks of {blk} pairs"
                      f"{' (selected)' if cur and r > MG.ROUTE_KERNEL_MAX_ROWS else ''} (CUDA graph) | {us:.1f} | - |")
            print(md[-1], flush=True)
        if r <= MG.ROUTE_KERNEL_MAX_ROWS:
            us = time_calls([lambda: moe_routing(ids, e)]) * 1e6
            md.append(f"| {t} | routing | one program (selected) (CUDA graph) | {us:.1f} | - |")
            print(md[-1], flush=True)
        row(t, "gather", "torch.index_select", lambda: torch.index_select(x, 0, idx, out=out), gbytes)
        pos = moe_routing(ids, e)["pair_pos"]
        out.zero_()
        MG.spread_rows(x, pos, out=out)
        if not torch.equal(out.view(torch.int16), want.view(torch.int16)):
            raise AssertionError("spread_rows: not index_select's rows")
        for bt, bh, nw in SPREAD_SHAPES:
            def spread(bt=bt, bh=bh, nw=nw):
                MG._spread_rows_kernel[(triton.cdiv(t, bt),)](xk, pos, ok, t, h, x.stride(0), out.stride(0), TOP_K=k,
                                                              BT=bt, BH=bh, num_warps=nw)
            cur = " (selected)" if (bt, bh, nw) == (MG.SPREAD_BT, MG.SPREAD_BH, MG.SPREAD_WARPS) else ""
            row(t, "spread", f"BT={bt} BH={bh} num_warps={nw}{cur}", spread, (r + t) * h * x.element_size())
        for br, bh, nw in GATHER_SHAPES:
            def gather(br=br, bh=bh, nw=nw):
                MG._gather_rows_kernel[(triton.cdiv(r, br),)](xk, idx, ok, r, h, x.stride(0), out.stride(0), BR=br,
                                                              BH=bh, num_warps=nw)
            out.zero_()
            gather()
            if not torch.equal(out.view(torch.int16), want.view(torch.int16)):
                raise AssertionError(f"gather BR={br} BH={bh} num_warps={nw}: not index_select's rows")
            cur = " (gather_rows)" if (br, bh, nw) == (MG.GATHER_BR, MG.GATHER_BH, MG.GATHER_WARPS) else ""
            row(t, "gather", f"BR={br} BH={bh} num_warps={nw}{cur}", gather, gbytes)
        hm = torch.randn(r, 2 * inter, device=device, dtype=torch.bfloat16)
        ref = silu_and_mul(hm)
        so = torch.empty_like(ref)
        sbytes = r * 3 * inter * hm.element_size()
        row(t, "silu_mul", "silu_and_mul (selected)", lambda: silu_and_mul(hm, out=so), sbytes)
        from nvfp4_plugin import _cuda_ops
        compiled = ((0, "computed SiLU"), (1, "bf16 SiLU table"), (-1, "table by the size rule")) \
            if MG._compiled_kernels_run_on(hm.device) else ()
        for tab, what in compiled:
            so.zero_()
            _cuda_ops.silu_and_mul_into(hm, so, tab)
            if not torch.equal(so.view(torch.int16), ref.view(torch.int16)):
                raise AssertionError(f"compiled silu_mul table={tab}: not silu_and_mul's bits")
            row(t, "silu_mul", f"compiled, {what}", lambda tab=tab: _cuda_ops.silu_and_mul_into(hm, so, tab), sbytes)
        for br, bi, nw in SILU_SHAPES:
            def silu(br=br, bi=bi, nw=nw):
                MG._silu_mul_kernel[(triton.cdiv(r, br), triton.cdiv(inter, bi))](
                    rt.as_kernel_tensor(hm), rt.as_kernel_tensor(so), r, inter, hm.stride(0), so.stride(0), BR=br,
                    BI=bi, num_warps=nw, **rt.LAUNCH_OPTIONS)
            so.zero_()
            silu()
            if not torch.equal(so.view(torch.int16), ref.view(torch.int16)):
                raise AssertionError(f"silu_mul BR={br} BI={bi} num_warps={nw}: not silu_and_mul's bits")
            row(t, "silu_mul", f"BR={br} BI={bi} num_warps={nw}", silu, sbytes)
        src = torch.empty(sbytes // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        row(t, "copy", "the SiLU-mul's bytes, torch copy_", lambda: dst.copy_(src), sbytes)
    return "\n".join(md) + "\n"


def table(rows: list[dict], model_name: str, model: dict, reason: str | None) -> str:
    def f(v):
        return "-" if v is None else f"{v:.1f}"

    md = [f"Fused MoE layer, {model_name} (E={model['E']}, top-{model['top_k']}, H={model['H']}, I={model['I']}), "
          "w4a16, µs per call:", "",
          "| tokens | ours | vLLM bf16 | bf16 / ours | " + " | ".join(STAGES) + " | ours eager | vLLM bf16 eager | "
          "ours host | ours host, Triton launches |",
          "|---:|---:|---:|---:|" + "---:|" * len(STAGES) + "---:|---:|---:|---:|"]
    for r in rows:
        sp = r.get("speedup")
        md.append(f"| {r['tokens']} | {f(r['ours_us'])} | {f(r.get('vllm_bf16_us'))} | "
                  f"{'-' if sp is None else f'{sp:.2f}x'} | "
                  + " | ".join(f(r.get(f"{s}_us")) for s in STAGES)
                  + f" | {f(r.get('ours_eager_us'))} | {f(r.get('vllm_bf16_eager_us'))} | {f(r.get('ours_host_us'))} | "
                  f"{f(r.get('ours_host_triton_us'))} |")
    if reason:
        md += ["", f"vLLM bf16: {reason}"]
    return "\n".join(md) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="markdown file for the table")
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(BG.MOE_MODELS))
    ap.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS))
    ap.add_argument("--no-vllm", action="store_true",
                    help="skip the engines' bf16 MoE kernels (vLLM's fused_experts; SGLang's with --sustained)")
    ap.add_argument("--trace", type=int, metavar="TOKENS",
                    help="profile TOKENS tokens (eager and CUDA graph) instead of the table; GPU only")
    ap.add_argument("--sustained", type=int, metavar="TOKENS",
                    help="time TOKENS tokens after seconds of load (power-capped clocks) instead; GPU only")
    ap.add_argument("--host-profile", type=int, metavar="TOKENS",
                    help="host time per eager call of TOKENS tokens and a cProfile of it, instead of the table")
    ap.add_argument("--glue-shapes", action="store_true",
                    help="time the row gather and SiLU-mul launch shapes at each --tokens count instead; GPU only")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shape, no peer (the GPU if there is one, else the CPU interpreter): checks the script")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not a.smoke:
        print("bench_moe: needs a CUDA GPU (or --smoke, which --trace, --sustained and --glue-shapes do not take)")
        return 2
    device = "cuda" if cuda else "cpu"
    BG.DEVICE = device
    model_name, model = ("smoke", SMOKE_MODEL) if a.smoke else (a.model, BG.MOE_MODELS[a.model])
    tokens = [t for t in a.tokens if t >= 1] if not a.smoke else [t for t in a.tokens if t <= 64] or [1, 8]
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
    if a.smoke and (a.trace or a.sustained or a.glue_shapes):
        print("bench_moe: --trace, --sustained and --glue-shapes time a real shape on a GPU; not with --smoke")
        return 2
    if a.host_profile:
        text = host_profile(model, a.host_profile if not a.smoke else min(a.host_profile, 8), device,
                            calls=30 if cuda else 2)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
        print(text)
        return 0
    if a.trace or a.sustained or a.glue_shapes:
        text = (glue_shapes(model, tokens) if a.glue_shapes
                else trace(model, a.trace, with_vllm=not a.no_vllm) if a.trace
                else sustained(model, a.sustained, with_vllm=not a.no_vllm))
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
        print(text)
        return 0
    rows, reason = measure(model, tokens, device, with_vllm=not (a.no_vllm or a.smoke))
    gpu = (torch.cuda.get_device_name() if cuda else "CPU") + (" (smoke run)" if a.smoke else "")
    head = (f"# One fused-MoE layer forward ({gpu}, {time.strftime('%Y-%m-%d')})\n\n"
            f"    python3 -m benchmarks.bench_moe {' '.join(argv if argv is not None else sys.argv[1:])}\n\n")
    text = head + table(rows, model_name, model, reason)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
