"""Effective bandwidth of the Triton quantization kernels next to device copy and the torch reference.

One command on the GPU (H200 here):

    python -m benchmarks.bench_triton_quant --out /tmp/triton_quant.md   (then fold its table into benchmarks/results/)

For every kernel at M x K (default 8192 x 7168, bf16 in) it reports the median time over rotating
inputs (three copies, 3 x 117 MB, so nothing is served from the 60 MB L2), the effective bandwidth
(bytes read + bytes written, each counted once), that bandwidth as a share of measured device copy
(``benchmarks/common.device_copy_bandwidth``, read + write), the pure-torch reference's time on the same
GPU, and whether the outputs are byte-identical to that reference (deterministic kernels). A small
sweep over tile configurations (elements per program, warps) runs in the same process; the table
shows the default and the best. Writes a Markdown table to ``--out`` and all numbers to the same
path with ``.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import device_copy_bandwidth, time_any, time_eager  # noqa: E402
from nvfp4_plugin import numerics as nx  # noqa: E402
from nvfp4_plugin import reference as ref  # noqa: E402

#: (name, launch overrides); the first is the shipped default (see triton/_runtime.py). The Philox
#: variant (10 rounds, as tl.rand; the shipped stream uses 7) applies to stochastic kernels only (it is
#: another random stream; a what-if, not an option).
#: Program order "k" (K tiles of a row block fastest; the default is "m", row blocks fastest) and wider
#: K tiles (max_block_k) are swept too.
CONFIGS = [("4096/4w", dict(elems=4096, num_warps=4)), ("4096/4w order-k", dict(elems=4096, num_warps=4, order="k")),
           ("2048/4w", dict(elems=2048, num_warps=4)), ("8192/8w", dict(elems=8192, num_warps=8)),
           ("8192/8w bk1024", dict(elems=8192, num_warps=8, max_block_k=1024)),
           ("8192/8w order-k bk1024", dict(elems=8192, num_warps=8, max_block_k=1024, order="k")),
           ("16384/8w order-k bk1024", dict(elems=16384, num_warps=8, max_block_k=1024, order="k")),
           ("4096/4w philox-10", dict(elems=4096, num_warps=4, philox_rounds=10))]
TARGET_DET, TARGET_SR = 0.70, 0.50
DEVICE = "cuda"  # "cpu" only for --smoke-cpu (Triton interpreter, tiny shapes, wall-clock timing)


def median_ms(fn, inputs, iters: int, warmup: int = 3, graph: bool = True) -> float:
    """Per-call time in ms of ``fn`` cycling through ``inputs`` (twice per round).

    GPU: the device time of a CUDA graph of the calls (``benchmarks/common.time_any``), as an engine
    that replays graphs sees it. Timing eager calls also counts the Python launch path whenever it is
    longer than the kernel (the queue runs dry), which made 60 us kernels read as 100-190 us.
    ``graph=False`` (or an op that cannot be captured) times ``iters`` eager calls back to back.
    """
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    if DEVICE == "cpu":
        times = []
        for i in range(iters):
            t0 = time.perf_counter()
            fn(inputs[i % len(inputs)])
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    args = [(x,) for x in inputs] * 2
    if not graph:
        return time_eager(fn, args, iters=iters) * 1e3
    sec, how = time_any(fn, args)
    if how != "graph":
        print("  (not capturable: timed eager calls)", flush=True)
    return sec * 1e3


def same_bytes(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return all(same_bytes(x, y) for x, y in zip(a, b))
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() and a.element_size() > 1:
        na, nb = torch.isnan(a), torch.isnan(b)
        ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
        return bool(torch.equal(na, nb) and torch.equal(a.view(ints)[~na], b.view(ints)[~nb]))
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def kernels(m: int, k: int):
    """(name, triton fn, reference fn or None, bytes moved, target share, note)."""
    from nvfp4_plugin import triton as T
    from nvfp4_plugin.triton import staging

    gs = torch.tensor([nx.NVFP4_GLOBAL_SCALE_NUMERATOR / 8.0], device=DEVICE)
    x_in = m * k * 2
    fp4 = m * k // 2
    sf16, sf32 = m * k // 16, m * k // 32
    swz = nx.round_up(m, 128) * nx.round_up(k // 16, 4)
    top_k, experts = 8, 256
    ids = torch.randint(0, experts, (m, top_k), device=DEVICE, dtype=torch.int32)
    w = torch.rand(m, top_k, device=DEVICE)
    stage_out = (torch.empty(m, k // 2, dtype=torch.uint8, device=DEVICE),
                 torch.empty(m, k // 64, dtype=torch.int32, device=DEVICE),
                 torch.empty(m, top_k, dtype=torch.int64, device=DEVICE),
                 torch.empty(m, top_k, dtype=torch.float32, device=DEVICE))
    stage_ref_out = tuple(torch.empty_like(t) for t in stage_out)
    stage_bytes = x_in + fp4 + sf16 + m * top_k * (4 + 4 + 8 + 4)

    def stage(x, out=stage_out, fn=staging.stage_deepseek_v4_mega_moe_inputs):
        fn(x, w, ids, *out)
        return out

    def stage_ref(x):
        return stage(x, stage_ref_out, ref.stage_deepseek_v4_mega_moe_inputs)

    det, sr = TARGET_DET, TARGET_SR
    return [
        ("scaled_fp4_quant (swizzled e4m3)", lambda x: T.scaled_fp4_quant(x, gs),
         lambda x: ref.scaled_fp4_quant(x, gs), x_in + fp4 + swz, det, ""),
        ("scaled_fp4_quant (linear e4m3)", lambda x: T.scaled_fp4_quant(x, gs, swizzle=False),
         lambda x: ref.scaled_fp4_quant(x, gs, swizzle=False), x_in + fp4 + sf16, det, ""),
        ("nvfp4_forward (given gs)", lambda x: T.nvfp4_forward(x, gs),
         lambda x: ref.fake_quant_nvfp4(x, gs), 2 * x_in, det, ""),
        ("nvfp4_forward (dynamic gs)", lambda x: T.nvfp4_forward(x), lambda x: ref.fake_quant_nvfp4(x), 2 * x_in,
         None, "two passes over x by design (amax, then quantize); bytes counted once"),
        ("nvfp4_forward stochastic", lambda x: T.nvfp4_forward(x, gs, True, seed=1), None, 2 * x_in, sr, ""),
        ("mxfp4_quantize", lambda x: T.mxfp4_quantize(x), lambda x: ref.mxfp4_quantize(x), x_in + fp4 + sf32,
         det, ""),
        ("mxfp4_quantize stochastic", lambda x: T.mxfp4_quantize(x, stochastic_rounding=True, seed=1), None,
         x_in + fp4 + sf32, sr, ""),
        ("mxfp4_forward", lambda x: T.mxfp4_forward(x), lambda x: ref.fake_quant_mxfp4(x), 2 * x_in, det, ""),
        ("mxfp4_forward stochastic", lambda x: T.mxfp4_forward(x, True, seed=1), None, 2 * x_in, sr, ""),
        ("mxfp8_quantize e4m3", lambda x: T.mxfp8_quantize(x), lambda x: ref.mxfp8_quantize(x),
         x_in + m * k + sf32, det, ""),
        ("mxfp8_quantize e4m3 stochastic", lambda x: T.mxfp8_quantize(x, stochastic_rounding=True, seed=1), None,
         x_in + m * k + sf32, sr, ""),
        ("mxfp8_forward e4m3", lambda x: T.mxfp8_forward(x), lambda x: ref.fake_quant_mxfp8(x), 2 * x_in, det, ""),
        ("mxfp8_forward e5m2 stochastic", lambda x: T.mxfp8_forward(x, "e5m2", True, seed=1), None, 2 * x_in, sr,
         ""),
        ("stage_deepseek_v4_mega_moe_inputs", stage, stage_ref, stage_bytes, det,
         f"top-k {top_k}: ids int32 -> int64, fp32 weights copied"),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--ref-iters", type=int, default=3)
    ap.add_argument("--no-sweep", action="store_true", help="time only the default tile configuration")
    ap.add_argument("--no-reference", action="store_true", help="skip the (slow) torch reference timings")
    ap.add_argument("--smoke-cpu", action="store_true", help=argparse.SUPPRESS)  # CI check of this script
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "triton_quant_h200.md"))
    args = ap.parse_args(argv)
    global DEVICE
    if args.smoke_cpu:
        os.environ["TRITON_INTERPRET"] = "1"
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("bench_triton_quant: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    from nvfp4_plugin.triton import _runtime as rt

    t_start = time.time()
    torch.manual_seed(0)
    m, k = args.m, args.k
    copy_bw = device_copy_bandwidth()[0]
    print(f"device copy: {copy_bw / 1e12:.3f} TB/s (read + write)", flush=True)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    inputs = [(torch.randn(m, k, device=DEVICE, generator=gen) * 2.0 ** (i - 1)).to(torch.bfloat16) for i in range(3)]
    configs = CONFIGS[:1] if args.no_sweep else CONFIGS
    rows = []
    for name, fn, ref_fn, nbytes, target, note in kernels(m, k):
        row = {"kernel": name, "bytes": nbytes, "target": target, "note": note, "configs": {}}
        for cname, cfg in configs:
            if "philox_rounds" in cfg and "stochastic" not in name:
                continue
            with rt.tile_override("*", **cfg):
                ms = median_ms(fn, inputs, args.iters)
            row["configs"][cname] = {"ms": ms, "tbps": nbytes / (ms * 1e-3) / 1e12}
        default = row["configs"][configs[0][0]]
        best_name = min(row["configs"], key=lambda c: row["configs"][c]["ms"])
        row.update(ms=default["ms"], tbps=default["tbps"], share=default["tbps"] * 1e12 / copy_bw, best=best_name,
                   best_share=row["configs"][best_name]["tbps"] * 1e12 / copy_bw)
        if ref_fn is not None and not args.no_reference:
            x = inputs[0]
            out_t = fn(x)
            out_t = tuple(t.clone() for t in out_t) if isinstance(out_t, tuple) else out_t.clone()
            out_r = ref_fn(x)
            row["bytes_equal_reference"] = same_bytes(out_t, out_r)
            row["ref_ms"] = median_ms(ref_fn, inputs, args.ref_iters, warmup=1, graph=False)
            del out_t, out_r
        rows.append(row)
        tgt = "" if target is None else f" (target {target:.0%}: {'ok' if row['best_share'] >= target else 'MISS'})"
        print(f"{name:36s} {row['ms'] * 1e3:8.1f} us {row['tbps']:6.3f} TB/s {row['share']:6.1%} of copy; best "
              f"{best_name} {row['best_share']:6.1%}{tgt}"
              + (f"; reference {row['ref_ms']:.2f} ms, bytes equal: {row['bytes_equal_reference']}"
                 if "ref_ms" in row else ""), flush=True)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (Triton interpreter smoke run)"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "python3 " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:]))
    lines = [
        f"# Triton quantization kernels, {gpu}",
        "",
        f"`{cmd}` on {when}; torch {torch.__version__}, triton {triton.__version__}, python "
        f"{platform.python_version()}. M={m}, K={k}, bf16 input; CUDA-graph replays (at least 30 ms) of 6 calls over 3 rotating "
        f"inputs (3 x {m * k * 2 / 1e6:.0f} MB > 60 MB L2). Effective bandwidth = bytes read + written, each once. "
        f"Device copy (1 GiB, read + write): **{copy_bw / 1e12:.3f} TB/s**.",
        "",
        "| kernel | MB moved | Triton us (default tile) | TB/s | % of copy | best tile | best % | target | "
        "reference ms | speedup vs reference | bytes == reference |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tgt = "-" if r["target"] is None else f"{r['target']:.0%} {'ok' if r['best_share'] >= r['target'] else 'MISS'}"
        ref_ms = f"{r['ref_ms']:.2f}" if "ref_ms" in r else "-"
        speed = f"{r['ref_ms'] / r['ms']:.1f}x" if "ref_ms" in r else "-"
        eq = {True: "yes", False: "NO"}.get(r.get("bytes_equal_reference"), "-")
        lines.append(f"| {r['kernel']} | {r['bytes'] / 1e6:.1f} | {r['ms'] * 1e3:.1f} | {r['tbps']:.3f} | "
                     f"{r['share']:.1%} | {r['best']} | {r['best_share']:.1%} | {tgt} | {ref_ms} | {speed} | {eq} |")
    notes = [f"- {r['kernel']}: {r['note']}" for r in rows if r["note"]]
    sweep = ["", "Sweep (elements per program / warps; program order; widest K tile; Philox rounds for stochastic kernels), TB/s:", "",
             "| kernel | " + " | ".join(c[0] for c in configs) + " |", "|---|" + "---|" * len(configs)]
    for r in rows:
        cells = [f"{r['configs'][c[0]]['tbps']:.3f}" if c[0] in r["configs"] else "-" for c in configs]
        sweep.append(f"| {r['kernel']} | " + " | ".join(cells) + " |")
    lines += [""] + notes + sweep + ["", f"Total benchmark time {time.time() - t_start:.0f} s."]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump({"gpu": gpu, "date": when, "command": cmd, "m": m, "k": k, "copy_tbps": copy_bw / 1e12,
                   "torch": torch.__version__, "triton": triton.__version__, "kernels": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
