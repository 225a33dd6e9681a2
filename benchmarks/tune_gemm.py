"""Tune the Hopper FP4-weight GEMM configs on this GPU and write them into the repository.

One command on the H200 (about 5-7 minutes; ``--budget-s`` caps the timing phase)::

    python benchmarks/tune_gemm.py --out benchmarks/results/tune_h200

For every (kind, shape, size bucket) of the issue's benchmark (dense: 5 shapes x M buckets; grouped:
Qwen3-30B-A3B-like and DeepSeek-V3-like up/down x routed-row buckets; masked: the same x max_m) it
sweeps a config space chosen for that size, checks each candidate against an fp32 reference
(max abs error <= 2 bf16 ulps of the output scale, NaN-free) BEFORE timing it, times the correct
ones (CUDA graph of calls cycling through weight copies / routings beyond L2, median), and writes
the winners to ``nvfp4_plugin/gemm/configs/<device>.json`` (merged with the entries already there;
``--write`` to choose another file). Every candidate's time and any rejection go to
``<out>/tune_log.json``; a summary table is printed last.

Compilation of all variants happens first, in parallel worker processes (Triton's on-disk cache).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import bench_gemm as bg  # noqa: E402
from benchmarks.common import time_calls  # noqa: E402

from nvfp4_plugin.gemm import (DequantMmConfig, HopperW4Layout, TritonMmaConfig, TritonWgmmaConfig,  # noqa: E402
                               W4Config, w4_dequantize, w4_grouped, w4_linear, w4_masked)
from nvfp4_plugin.gemm import select as gsel  # noqa: E402

DENSE_BUCKETS = [1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
#: Routed rows = tokens * top_k are the bucket keys, and a bucket covers every size up to its key. The largest
#: is 2048 tokens (128 rows per expert at top-8): from 192 rows per expert select.heuristic's 256-row tiles with
#: the short last rows split off win (GLUON_BM256_EXPERT_ROWS; bench_moe --sustained times those tail configs),
#: and a bucket tuned at 4096 tokens would hand its pick down to 1025 tokens, where it loses.
GROUPED_TOKENS = [t for t in bg.MOE_TOKENS if t < 2048] + [2048]
MASKED_MAX_M = bg.MASKED_MAX_M


# ----------------------------------------------------------------------------------------------
# candidate spaces (reasoning: small M is weight-streaming bound -> vary split-K / tile width /
# pipeline depth; large M is tensor-core bound -> vary the token tile, K step and depth)
# ----------------------------------------------------------------------------------------------

def _splits(n_tiles: int, k: int, bk: int, sms: int = 132) -> list[int]:
    iters = math.ceil(k / bk)
    out = []
    for s in (1, 2, 3, 4, 6, 8, 12, 16):
        if s > 1 and iters / s < 2:
            continue
        progs = n_tiles * s
        if progs < 0.6 * sms and s < 16 and n_tiles * 16 >= 0.6 * sms:
            continue
        if progs > 10 * sms and s > 1:
            continue
        out.append(s)
    # keep the 3 closest to ~3 programs per SM
    out.sort(key=lambda s: abs(math.log((n_tiles * s) / (3 * sms))))
    return sorted(out[:3]) or [1]


def _streaming_space(bm: int, v2_choices, n_tiles_of, k: int, split: bool, m_split=(0,)):
    cands = []
    for v2 in v2_choices:
        widths = [(32, 2), (64, 4), (128, 8)] if v2 else [(64, 4), (128, 8)]
        for bn, warps in widths:
            for bk in (128, 256):
                if k % 64:
                    continue
                for stages in ((3, 5) if bk == 128 else (3, 4)):
                    splits = _splits(n_tiles_of(bn), k, bk) if split else [1]
                    for sk in splits:
                        for ms in m_split:
                            family = TritonMmaConfig if v2 else TritonWgmmaConfig
                            cands.append(family(bn=bn, bm=bm, bk=bk, split_k=sk, num_warps=warps,
                                                num_stages=stages, m_split=ms))
    return cands


def dense_candidates(m: int, n: int, k: int) -> list[W4Config]:
    if m <= 8:
        return _streaming_space(8, (True,), lambda bn: math.ceil(n / bn), k, True)
    if m <= 16:
        return _streaming_space(16, (False, True), lambda bn: math.ceil(n / bn), k, True) + gluon_candidates(m, n, k)
    cands = []
    if m <= 64:
        for bm in (32, 64):
            if bm > 2 * m:
                continue
            for bn, warps in ((64, 4), (128, 8)):
                for bk in (64, 128):
                    for stages in (3, 4):
                        for sk in (1, 2):
                            cands.append(TritonWgmmaConfig(bn=bn, bm=bm, bk=bk, split_k=sk, num_warps=warps,
                                                  num_stages=stages))
        return cands + gluon_candidates(m, n, k)
    if m <= 256:
        for bm in (64, 128):
            for bn, warps in ((128, 4), (128, 8)):
                for bk in (64, 128):
                    for stages in (3, 4):
                        cands.append(TritonWgmmaConfig(bn=bn, bm=bm, bk=bk, num_warps=warps, num_stages=stages))
        # (the shared-memory wgmma candidates lost every dense problem they were offered before the Gluon
        # kernel came; they stay in the grouped / masked spaces)
        return cands + [DequantMmConfig()] + gluon_candidates(m, n, k)
    cands += gluon_candidates(m, n, k)
    for bm in (128, 256):
        for bk in (64, 128):
            for stages in (3, 4):
                if bm == 256 and bk == 128 and stages == 4:
                    continue       # shared memory
                cands.append(TritonWgmmaConfig(bn=128, bm=bm, bk=bk, num_warps=8, num_stages=stages))
    cands.append(DequantMmConfig())
    return cands


def gluon_candidates(m: int, n: int, k: int, sms: int = 132) -> list[W4Config]:
    """The Gluon kernel (dense, more than 8 rows): 1 or 2 warpgroups, 16- to 256-token tiles, K steps of
    64 or 128 with as many x buffers as fit, weights loaded 2 or 4 K steps ahead, the two split-K factors
    that bring the program count closest to 1-2 per SM (narrow N with long K has few output tiles), and
    where the tiles end in a partial wave, split K of that wave's tiles only (split_tail); every split config
    both with the reduce launch and with the partials summed by each tile's last program (fixup). 64-token
    tiles only at 17-64 rows (offered at 128-256 rows on the H200 they won nothing, 2026-11-25); 16- and
    32-token tiles at 9-16 and 17-32 rows, where the Triton configs have no decode / wgmma overlap."""
    if m <= 8:
        return []
    bms = (16,) if m <= 16 else (32, 64) if m <= 32 else (64,) if m <= 64 else (128, 256)
    cands = []
    for bn in (64, 128):
        for bm in bms:
            for bk in (64, 128):
                tiles = math.ceil(m / bm) * math.ceil(n / bn)
                steps = math.ceil(k / bk)
                opts = [s for s in (1, 2, 4, 8) if s == 1 or (steps // s >= 4 and tiles * s <= 4 * sms)]
                opts.sort(key=lambda s: abs(math.log(tiles * s / (1.5 * sms))))
                for sk in sorted(opts[:2]):
                    for pf in (2, 4):
                        for fx in ((False, True) if sk > 1 else (False,)):
                            cands.append(gsel.gluon_config(bn, bm, bk, split_k=sk, prefetch=pf, fixup=fx))
                if tiles > sms and tiles % sms:      # a partial last wave: split only its tiles
                    for sk in (2, 4):
                        if steps // sk >= 4:
                            for fx in (False, True):
                                cands.append(gsel.gluon_config(bn, bm, bk, split_k=sk, prefetch=4, split_tail=True,
                                                               fixup=fx))
    return cands


def ss_candidates(n: int, bms, m_split=(0,)) -> list[W4Config]:
    """Shared-memory wgmma tiles (tokens as M, decoded weights stored as the B operand); configs that
    do not fit in shared memory fail to compile and are rejected by the tuner. bn=256 only where the
    padded N is a multiple of 256 (the kernel's weight loads are unmasked along N), and not with
    bm=256 (a 256x256 fp32 accumulator does not fit in registers)."""
    cands = []
    wide = HopperW4Layout(torch.bfloat16, n, 64).n_pad % 256 == 0
    for bm in bms:
        for bn in (128, 256) if wide and bm < 256 else (128,):
            for bk in (64, 128):
                for stages in (3, 4):
                    for ms in m_split:
                        cands.append(TritonWgmmaConfig(bn=bn, bm=bm, bk=bk, num_warps=8, num_stages=stages,
                                                       m_split=ms, ss=True))
    return cands


def grouped_candidates(rows: int, e: int, n: int, k: int) -> list[W4Config]:
    per = rows / max(1, min(e, rows))
    if per <= 4:
        return _streaming_space(8, (True,), None, k, False)
    if per <= 24:
        return (_streaming_space(8, (True,), None, k, False, m_split=(1, 2))
                + _streaming_space(16, (False,), None, k, False))
    cands = []
    bms = (32, 64) if per <= 96 else (64, 128)
    for bm in bms:
        for bn, warps in ((64, 4), (128, 8)):
            for bk in (64, 128):
                for stages in (3, 4):
                    for ms in (1, 2, 4):
                        cands.append(TritonWgmmaConfig(bn=bn, bm=bm, bk=bk, num_warps=warps, num_stages=stages,
                                                       m_split=ms))
    if per > 96:
        cands += ss_candidates(n, (64, 128), m_split=(1, 2)) + grouped_gluon_candidates((128,))
    return cands


def grouped_gluon_candidates(bms) -> list[W4Config]:
    """The Gluon kernel over experts (sorted rows, masked): M splits from the heuristic (m_split=0),
    weights loaded 2 or 4 K steps ahead."""
    cands = []
    for bn in (64, 128):
        for bm in bms:
            for bk in (64, 128):
                for pf in (2, 4):
                    cands.append(gsel.gluon_config(bn, bm, bk, prefetch=pf))
    return cands


def masked_candidates(max_m: int, e: int, n: int, k: int) -> list[W4Config]:
    if max_m <= 8:
        return _streaming_space(8, (True,), None, k, False)
    cands = []
    for bm in (16, 32, 64) if max_m <= 64 else (64, 128):
        for bn, warps in ((64, 4), (128, 8)):
            for bk in (64, 128):
                for stages in (3, 4):
                    for ms in ((1,) if max_m <= 64 else (1, 2)):
                        cands.append(TritonWgmmaConfig(bn=bn, bm=bm, bk=bk, num_warps=warps, num_stages=stages,
                                                       m_split=ms))
    if max_m > 64:
        cands += ss_candidates(n, (64, 128), m_split=(1, 2)) + grouped_gluon_candidates((128, 256))
    return cands


# ----------------------------------------------------------------------------------------------
# problems and references
# ----------------------------------------------------------------------------------------------

def ulp_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0
    if not torch.isfinite(y).all():
        return float("inf")
    scale = ref.abs().max().item()
    ulp = 2.0 ** (math.floor(math.log2(scale)) - 7) if scale > 0 else 1e-30
    return (y.float() - ref).abs().max().item() / ulp


def dense_problem(n, k, m):
    p0 = bg.random_packed((), n, k, seed=n + k)
    copies = [p0] + [bg.random_packed((), n, k, seed=n + k + i) for i in range(1, bg.copies_for(bg.packed_bytes(p0)))]
    x = torch.randn(m, k, device=bg.DEVICE, dtype=torch.bfloat16)
    wd = w4_dequantize(p0).float() * p0.alpha[0, :n, None]
    ref = x.float() @ wd.t()
    del wd

    def run(cfg, p=p0):
        return w4_linear(x, p, config=cfg)
    return run, copies, ref


def grouped_problem(e, n, k, tokens, top_k):
    p = bg.random_packed((e,), n, k, seed=n)
    n_rot = bg.rotations(tokens)
    routs = [bg.routing(tokens, e, top_k, seed=1000 * tokens + i) for i in range(n_rot)]
    rows = tokens * top_k
    x = torch.randn(rows, k, device=bg.DEVICE, dtype=torch.bfloat16)
    offs = routs[0]["offsets"].cpu().tolist()
    ref = torch.zeros(rows, n, device=bg.DEVICE)
    for ex in range(e):
        lo, hi = offs[ex], offs[ex + 1]
        if hi > lo:
            pe = p.expert(ex)
            wd = w4_dequantize(pe).float() * pe.alpha[0, :n, None]
            ref[lo:hi] = x[lo:hi].float() @ wd.t()

    def run(cfg, r=routs[0]):
        return w4_grouped(x, p, r["offsets"], config=cfg)
    return run, routs, ref


def masked_problem(e, n, k, max_m):
    p = bg.random_packed((e,), n, k, seed=n + 1)
    x = torch.randn(e, max_m, k, device=bg.DEVICE, dtype=torch.bfloat16)
    g = torch.Generator(device=bg.DEVICE).manual_seed(max_m)
    mask = torch.randint(0, max_m + 1, (e,), generator=g, device=bg.DEVICE, dtype=torch.int32)
    ml = mask.cpu().tolist()
    out = torch.zeros(e, max_m, n, device=bg.DEVICE, dtype=torch.bfloat16)
    ref = torch.zeros(e, max_m, n, device=bg.DEVICE)
    for ex in range(e):
        if ml[ex]:
            pe = p.expert(ex)
            wd = w4_dequantize(pe).float() * pe.alpha[0, :n, None]
            ref[ex, :ml[ex]] = x[ex, :ml[ex]].float() @ wd.t()

    def run(cfg, fresh=True):
        if fresh:             # rows past the mask must stay as they were: check against zeros
            out.zero_()
        w4_masked(x, p, mask, out=out, config=cfg)
        return out
    return run, None, ref


# ----------------------------------------------------------------------------------------------
# main loop
# ----------------------------------------------------------------------------------------------

def problems(kinds, smoke: bool = False, dense_shapes=None):
    """The issue's sizes first (so a cut-off run has tuned what the benchmark reports), extras last."""
    first, extra = [], []
    shapes, buckets, targets = dense_shapes or bg.DENSE_SHAPES, DENSE_BUCKETS, bg.DENSE_M
    models, tokens_list, max_ms = bg.MOE_MODELS, GROUPED_TOKENS, MASKED_MAX_M
    if smoke:
        shapes, buckets, targets = bg.SMOKE["dense_shapes"], bg.SMOKE["dense_m"], bg.SMOKE["dense_m"]
        models, tokens_list, max_ms = bg.SMOKE["models"], bg.SMOKE["tokens"], bg.SMOKE["max_m"]
    if "dense" in kinds:
        for n, k in shapes:
            for m in buckets:
                (first if m in targets else extra).append(("dense", dict(n=n, k=k, m=m),
                                                           dense_candidates(m, n, k)))
    for model, c in models.items():
        for proj, n, k in bg.moe_projections(model):
            if "grouped" in kinds:
                for t in tokens_list:
                    rows = t * c["top_k"]
                    first.append(("grouped", dict(model=model, proj=proj, e=c["E"], n=n, k=k, tokens=t,
                                                  top_k=c["top_k"], m=rows), grouped_candidates(rows, c["E"], n, k)))
            if "masked" in kinds:
                for mm in max_ms:
                    first.append(("masked", dict(model=model, proj=proj, e=c["E"], n=n, k=k, m=mm),
                                  masked_candidates(mm, c["E"], n, k)))
    return first + extra


def tune_one(kind, spec, cands, deadline, log):
    t0 = time.time()
    if kind == "dense":
        run, copies, ref = dense_problem(spec["n"], spec["k"], spec["m"])
    elif kind == "grouped":
        run, copies, ref = grouped_problem(spec["e"], spec["n"], spec["k"], spec["tokens"], spec["top_k"])
    else:
        run, copies, ref = masked_problem(spec["e"], spec["n"], spec["k"], spec["m"])
    heur = gsel.heuristic(kind, spec["m"], spec["n"], spec["k"], spec.get("e", 1))
    if heur not in cands:
        cands = [heur] + cands
    results = []
    best = None
    for cfg in cands:
        if time.time() > deadline:
            results.append(dict(config=cfg.to_json(), skipped="budget"))
            continue
        rec = dict(config=cfg.to_json())
        if bg._compile_key(bg.Job.make(kind, spec["n"], spec["k"], spec.get("e", 1), spec["m"], cfg)) in bg.FAILED_KEYS:
            rec["rejected"] = "failed in the pre-compilation worker"
            results.append(rec)
            continue
        try:
            y = run(cfg)
            bg._sync()
            err = ulp_err(y, ref)
            rec["ulp_err"] = err
            if not err <= 2.0:
                rec["rejected"] = f"error {err:.2f} ulps > 2"
                results.append(rec)
                continue
            if kind == "dense":
                calls = [lambda p=p, c=cfg: run(c, p) for p in copies]
            elif kind == "grouped":
                calls = [lambda r=r, c=cfg: run(c, r) for r in copies]
            else:
                calls = [lambda c=cfg: run(c, False)]
            t = time_calls(calls, fill_ms=2, min_ms=6)
            rec["us"] = t * 1e6
            if best is None or t < best[0]:
                best = (t, cfg)
        except Exception as exc:
            rec["rejected"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        results.append(rec)
    heur_us = next((r.get("us") for r in results if r["config"] == heur.to_json()), None)
    entry = dict(kind=kind, spec=spec, seconds=time.time() - t0, candidates=results,
                 best=(best[1].to_json() if best else None), best_us=(best[0] * 1e6 if best else None),
                 heuristic_us=heur_us)
    log.append(entry)
    return entry


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/tune")
    ap.add_argument("--write", default=None, help="config JSON to update (default: the package's file for this GPU)")
    ap.add_argument("--kinds", default="dense,grouped,masked")
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget for the whole run")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--max-m", type=int, default=None,
                    help="only problems of at most this many rows (dense M, routed rows, max_m); others keep their entries")
    ap.add_argument("--min-m", type=int, default=None,
                    help="only problems of at least this many rows; others keep their entries")
    ap.add_argument("--dense-shapes", default=None, metavar="NxK,...",
                    help="dense shapes to tune instead of the benchmark's (e.g. a served model's projections: "
                         "6144x4096,4096x4096)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, 3 candidates each, results to --out only (checks the script; CPU ok)")
    args = ap.parse_args(argv)
    if args.smoke:
        bg.DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
        bg.MOE_MODELS.update(bg.SMOKE["models"])
    elif not torch.cuda.is_available():
        print("tune_gemm: needs a CUDA GPU (or --smoke)")
        return 2
    t_start = time.time()
    deadline = t_start + args.budget_s
    kinds = set(args.kinds.split(","))
    torch.backends.cuda.matmul.allow_tf32 = False
    dense_shapes = ([tuple(int(v) for v in sh.split("x")) for sh in args.dense_shapes.split(",")]
                    if args.dense_shapes else None)
    probs = problems(kinds, args.smoke, dense_shapes)
    if args.max_m is not None:
        probs = [p for p in probs if p[1]["m"] <= args.max_m]
    if args.min_m is not None:
        probs = [p for p in probs if p[1]["m"] >= args.min_m]
    if args.smoke:
        probs = [(kind, spec, cands[:3]) for kind, spec, cands in probs]
    jobs = []
    for kind, spec, cands in probs:
        heur = gsel.heuristic(kind, spec["m"], spec["n"], spec["k"], spec.get("e", 1))
        for cfg in [heur] + cands:
            if not cfg.dequant_mm:
                jobs.append(bg.Job.make(kind, spec["n"], spec["k"], spec.get("e", 1), spec["m"], cfg))
    print(f"[tune] {len(probs)} problems, {sum(len(c) for _, _, c in probs)} candidates", flush=True)
    cap = max(60.0, 0.5 * args.budget_s)
    compile_errors = bg.precompile(jobs, args.workers, time_cap_s=cap) if bg.DEVICE == "cuda" else []
    for e in compile_errors[:20]:
        print("[tune] compile error:", e)

    log = []
    dev = gsel.device_key()
    path = args.write or os.path.join(os.environ.get(gsel.ENV_CONFIG_DIR) or gsel.CONFIG_DIR, f"{dev}.json")
    if args.smoke and not args.write:
        path = os.path.join(args.out, f"{dev}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    table = json.load(open(path)) if os.path.exists(path) else {}
    table.setdefault("device", torch.cuda.get_device_name() if bg.DEVICE == "cuda" else "cpu")
    import triton
    table["triton"] = triton.__version__
    table["torch"] = torch.__version__
    summary = []
    for kind, spec, cands in probs:
        if time.time() > deadline:
            print(f"[tune] budget exhausted; {kind} {spec} keeps its previous entry / heuristic")
            continue
        ent = tune_one(kind, spec, cands, deadline, log)
        rej = [c for c in ent["candidates"] if "rejected" in c]
        if ent["best"] is not None:
            key = gsel.shape_key(kind, spec["n"], spec["k"], spec.get("e", 1))
            table.setdefault(kind, {}).setdefault(key, {})[str(spec["m"])] = ent["best"]
        summary.append((kind, spec, ent["best_us"], ent["heuristic_us"], ent["best"], len(rej)))
        hu = f"{ent['heuristic_us']:.1f}" if ent["heuristic_us"] else "-"
        bu = f"{ent['best_us']:.1f}" if ent["best_us"] else "-"
        print(f"[tune] {kind:7s} N={spec['n']:6d} K={spec['k']:6d} m={spec['m']:6d} E={spec.get('e', 1):4d}: "
              f"best {bu} us (heuristic {hu}) {ent['best']} rejected={len(rej)} ({ent['seconds']:.1f}s)", flush=True)
        # write as we go: a cut-off run still leaves its results
        with open(path, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_log.json"), "w") as f:
        json.dump(dict(device=table["device"], seconds=time.time() - t_start,
                       compile_errors=compile_errors, problems=log), f, indent=1)
    n_rej = sum(s[5] for s in summary)
    print(f"\n[tune] done in {time.time() - t_start:.0f}s: {len(summary)} problems tuned, {n_rej} candidates "
          f"rejected (see {args.out}/tune_log.json), configs written to {path}")
    print("| kind | N | K | E | m | best us | heuristic us | best config |\n|---|---|---|---|---|---|---|---|")
    for kind, spec, bu, hu, best, _ in summary:
        print(f"| {kind} | {spec['n']} | {spec['k']} | {spec.get('e', 1)} | {spec['m']} | "
              f"{bu if bu is None else round(bu, 1)} | {hu if hu is None else round(hu, 1)} | {best} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
