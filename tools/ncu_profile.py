"""Nsight Compute profiles of the hot kernels at the shapes where a target is missed, summarized.

One command on the GPU machine (ncu is on its PATH):

    python3 tools/ncu_profile.py --out /tmp/session/ncu

For each case it runs this same file as a driver under ``ncu`` (``--clock-control none``: the clocks
the benchmarks see), profiles one launch of the kernel after warm-up calls, and then writes
``summary.md``: duration, DRAM / SM throughput as % of peak, issue-slot use, occupancy, registers,
and the top warp-stall reasons per issued instruction. These are the numbers behind the "why"
of a missed target: DRAM near peak means the kernel is bandwidth-bound (more bytes moved than
necessary, or a low ceiling); low DRAM with high issue means it is instruction-bound; low both
with long-scoreboard stalls means too few bytes are in flight (latency-bound).

Cases are ``gemm:N:K:M`` (dense FP4-weight GEMM, selected config; ``gemm:N:K:M:ss`` for the tuner's best
shared-memory wgmma candidate, or ``gemm:N:K:M:gluon=1,bm=128,...`` for a given :class:`W4Config`),
``moe:MODEL:PROJ:TOKENS`` (the grouped GEMM of a ``bench_gemm.py`` MoE projection, e.g.
``moe:qwen3-30b-a3b:up:1``), ``triton:OP:M:K`` (Triton quantization kernels: ``fp4``, ``mxfp4``, ``mxfp4fwd``)
and ``quant:OP:M:K`` (compiled quantizers: ``dense`` on M rows, ``experts`` on M tokens x top-8 rows over 256
experts, ``quant:experts:M:K:E`` over E experts, ``masked`` SiLU-mul over 32 experts of M x 8 / 32 rows,
``fp8group`` / ``fp8token`` per-token-group / per-token FP8, all as ``bench_quant.py``) and
``sgl:fp8group:M:K`` (sgl-kernel's per-token-group FP8 on the same input, with the SGLang bundle on
``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys

#: the issue-5 goals that the committed kernels miss (benchmarks/results/gemm_h200.md), with the selected configs
DEFAULT_CASES = ["gemm:28672:4096:1", "gemm:6144:4096:1", "gemm:4096:14336:4", "gemm:28672:4096:16",
                 "gemm:6144:4096:256", "gemm:2048:7168:256", "gemm:7168:2048:256", "gemm:4096:14336:256",
                 "moe:qwen3-30b-a3b:up:1"]
KERNEL = {"gemm": "regex:w4_gemm|w4_wgmma|w4_dequant", "moe": "regex:w4_gemm|w4_wgmma",
          "triton": "regex:_nvfp4_kernel|_mx_kernel", "quant": "regex:nvfp4_(experts|dense|masked)|fp8_(group|token)",
          "sgl": "regex:per_token_group"}
WARMUP = 3
SECTIONS = ["SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats", "SchedulerStats", "WarpStateStats"]
STALLS = "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio"
#: DRAM traffic of the launch, to compare with the bytes the kernel must move (read-modify-writes show up here),
#: and the warp instructions it issued (what the kernel costs in issue slots)
BYTES = "dram__bytes_read.sum,dram__bytes_write.sum,smsp__inst_executed.sum"
#: details-page metric names kept in the summary (section "Metric Name" column)
KEEP = ["Duration", "DRAM Throughput", "Memory Throughput", "Compute (SM) Throughput", "Issue Slots Busy",
        "Issued Warp Per Scheduler", "Achieved Occupancy", "Theoretical Occupancy", "Registers Per Thread",
        "Grid Size", "Block Size", "Warp Cycles Per Issued Instruction", "L2 Hit Rate"]


def drive(case: str) -> None:
    """Run the case's kernel WARMUP + 1 times (ncu skips the warm-up launches)."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repository root
    kind, *rest = case.split(":")
    if kind == "gemm":
        from benchmarks import bench_gemm as bg
        from nvfp4_plugin.gemm import TritonWgmmaConfig, W4Config, w4_linear

        n, k, m = (int(v) for v in rest[:3])
        p = bg.random_packed((), n, k, seed=1)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cfg = None
        if rest[3:] == ["ss"]:
            cfg = TritonWgmmaConfig(bn=256 if n % 256 == 0 else 128, bm=128 if m <= 1024 else 256, bk=64, num_warps=8,
                           num_stages=3, ss=True)
        elif rest[3:]:  # gemm:N:K:M:field=value,... (W4Config fields; bools as 0/1)
            cfg = W4Config.from_json({f: int(v) for f, v in (kv.split("=") for kv in rest[3].split(","))})
        for _ in range(WARMUP + 1):
            w4_linear(x, p, config=cfg)
    elif kind == "moe":  # moe:MODEL:PROJ:TOKENS, as bench_gemm.py's grouped table (selected config)
        from benchmarks import bench_gemm as bg
        from nvfp4_plugin.gemm import w4_grouped

        model, proj, tokens = rest[0], rest[1], int(rest[2])
        c = bg.MOE_MODELS[model]
        n, k = dict((pj, (pn, pk)) for pj, pn, pk in bg.moe_projections(model))[proj]
        p = bg.random_packed((c["E"],), n, k, seed=n)
        r = bg.routing(tokens, c["E"], c["top_k"], 0)
        x = torch.randn(r["token"].shape[0], k, device="cuda", dtype=torch.bfloat16)
        for _ in range(WARMUP + 1):
            w4_grouped(x, p, r["offsets"])
    elif kind == "triton":
        from nvfp4_plugin.triton import mx, nvfp4

        op, m, k = rest[0], int(rest[1]), int(rest[2])
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        gs = torch.ones(1, device="cuda")
        fn = {"fp4": lambda: nvfp4.scaled_fp4_quant(x, gs), "mxfp4": lambda: mx.mxfp4_quantize(x),
              "mxfp4fwd": lambda: mx.mxfp4_forward(x)}[op]
        for _ in range(WARMUP + 1):
            fn()
    elif kind == "quant":  # compiled quantizers: quant:dense:M:K, quant:experts:TOKENS:K (E=256, top-8, as bench_quant)
        from nvfp4_plugin import _cuda_ops as c
        from nvfp4_plugin import numerics as nx

        op, m, k = rest[0], int(rest[1]), int(rest[2])
        if op == "dense":
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            gs = torch.ones(1, device="cuda")
            fn = lambda: c.scaled_fp4_quant(x, gs)  # noqa: E731
        elif op == "fp8group":
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            fn = lambda: c.per_token_group_quant_fp8(x)  # noqa: E731
        elif op == "fp8token":
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            fn = lambda: c.per_token_quant_fp8(x)  # noqa: E731
        elif op == "masked":
            max_m = max(1, m * 8 // 32)
            x = torch.randn(32, max_m, 2 * k, device="cuda", dtype=torch.bfloat16)
            mask = torch.randint(max_m // 2, max_m + 1, (32,), device="cuda", dtype=torch.int32)
            out = torch.empty((32, max_m, k // 2), dtype=torch.uint8, device="cuda")
            sf = torch.empty((32, *nx.swizzled_scale_shape(max_m, k // 16)), dtype=torch.float8_e4m3fn, device="cuda")
            gs = torch.ones(32, device="cuda")
            fn = lambda: c.silu_and_mul_scaled_fp4_experts_quant(x, gs, mask, output=out, output_scale=sf)  # noqa: E731
        else:
            rows, e = m * 8, int(rest[3]) if len(rest) > 3 else 256
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            g = torch.Generator(device="cuda").manual_seed(0)
            counts = torch.bincount(torch.randint(0, e, (rows,), device="cuda", generator=g), minlength=e)
            eo = torch.zeros(e + 1, dtype=torch.int32, device="cuda")
            eo[1:] = torch.cumsum(counts, 0)
            bo = nx.blockscale_offsets_from_expert_offsets(eo)
            gs = torch.ones(e, device="cuda")
            fn = lambda: c.scaled_fp4_experts_quant(x, gs, eo, bo)  # noqa: E731
        for _ in range(WARMUP + 1):
            fn()
    elif kind == "sgl":  # sgl:fp8group:M:K, as bench_quant's sgl-kernel peer
        from benchmarks import bench_quant as bq

        m, k = int(rest[1]), int(rest[2])
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        peer = bq.load_peers()["peers"]["sgl_kernel.fp8_group"]
        fn = lambda: peer(x)  # noqa: E731
        for _ in range(WARMUP + 1):
            fn()
    else:
        raise SystemExit(f"unknown case kind {kind!r} in {case!r}")
    torch.cuda.synchronize()


def run_ncu(case: str, out_dir: str) -> tuple[str, str]:
    kind = case.split(":")[0]
    tag = case.replace(":", "_")
    base = ["ncu", "--target-processes", "all", "--clock-control", "none", "--kernel-name", KERNEL[kind],
            "--launch-skip", str(WARMUP), "--launch-count", "1", "--csv"]
    me = [sys.executable, os.path.abspath(__file__), "--drive", case]
    details = subprocess.run(base + [a for s in SECTIONS for a in ("--section", s)] + ["--page", "details"] + me,
                             capture_output=True, text=True)
    stalls = subprocess.run(base + ["--metrics", STALLS + "," + BYTES, "--page", "raw"] + me, capture_output=True,
                            text=True)
    for name, r in (("details", details), ("stalls", stalls)):
        with open(os.path.join(out_dir, f"{tag}.{name}.csv"), "w") as f:
            f.write(r.stdout)
        with open(os.path.join(out_dir, f"{tag}.{name}.err"), "w") as f:
            f.write(r.stderr[-20000:])
    return details.stdout, stalls.stdout


def _csv_rows(text: str) -> list[list[str]]:
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    return list(csv.reader(io.StringIO("\n".join(lines))))


def parse_details(text: str) -> dict[str, str]:
    rows = _csv_rows(text)
    if not rows:
        return {}
    head = rows[0]
    try:
        i_name, i_unit, i_val = head.index("Metric Name"), head.index("Metric Unit"), head.index("Metric Value")
    except ValueError:
        return {}
    out = {}
    for r in rows[1:]:
        if len(r) > i_val and r[i_name] in KEEP and r[i_name] not in out:
            out[r[i_name]] = f"{r[i_val]} {r[i_unit]}".strip()
    return out


def parse_bytes(text: str) -> str:
    """'read R MB, write W MB' of the raw page (units as ncu prints them)."""
    rows = _csv_rows(text)
    if len(rows) < 3:
        return "-"
    head, units, vals = rows[0], rows[1], rows[-1]
    got = []
    for name, what in (("dram__bytes_read.sum", "read"), ("dram__bytes_write.sum", "write"),
                       ("smsp__inst_executed.sum", "instructions")):
        if name in head:
            i = head.index(name)
            got.append(f"{what} {vals[i]} {units[i]}".strip())
    return ", ".join(got) or "-"


def parse_stalls(text: str, top: int = 4) -> str:
    rows = _csv_rows(text)
    if len(rows) < 3:
        return "-"
    head, vals = rows[0], rows[-1]
    found = []
    for h, v in zip(head, vals):
        if h.startswith("smsp__average_warps_issue_stalled_"):
            try:
                found.append((float(v.replace(",", "")), h[len("smsp__average_warps_issue_stalled_"):].split("_per_")[0]))
            except ValueError:
                pass
    found.sort(reverse=True)
    return ", ".join(f"{name} {val:.2f}" for val, name in found[:top]) or "-"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/session/ncu")
    ap.add_argument("--cases", nargs="*", default=DEFAULT_CASES)
    ap.add_argument("--drive", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.drive:
        drive(args.drive)
        return 0
    os.makedirs(args.out, exist_ok=True)
    cols = ["Duration", "DRAM Throughput", "Compute (SM) Throughput", "Issue Slots Busy", "Achieved Occupancy",
            "Registers Per Thread", "Grid Size", "Warp Cycles Per Issued Instruction"]
    lines = ["| case | " + " | ".join(cols) + " | DRAM bytes, warp instructions | top stalls (warps per issue) |",
             "|---|" + "---|" * (len(cols) + 2)]
    for case in args.cases:
        d, s = run_ncu(case, args.out)
        m = parse_details(d)
        lines.append(f"| {case} | " + " | ".join(m.get(c, "-") for c in cols) + f" | {parse_bytes(s)} | {parse_stalls(s)} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
