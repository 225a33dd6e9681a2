#!/usr/bin/env python3
"""Offline quantizer benchmark: make-model (8B shape, ~16 GB bf16), then ``nvfp4-plugin quantize``.

Each step runs as its own process (``python -m nvfp4_plugin.cli ...``), so its wall time and host
memory are its own. Host memory: peak RSS from the kernel (``ru_maxrss`` of the waited child, i.e.
VmHWM), plus a 20 ms poll of ``/proc/PID/status`` splitting RSS into anonymous memory and mapped
file pages. Targets (issue 6): quantize < 3 minutes on the H200, peak RSS < 2x the largest input shard.

    python -m benchmarks.bench_quantize --out /tmp/quantize.md   (then fold its table into benchmarks/results/)

Options: ``--arch`` (llama | qwen2 | qwen3 | qwen3_moe | mixtral), ``--size``, ``--device``,
``--weight-only-too`` (also time ``--no-calibration``), ``--methods mse gptq`` (also time each
method, calibrated, written as W4A16: ``--method M --weights-only``; reported, not held to the
targets), ``--workdir`` (default: the system temp dir; needs ~16 GB + ~6 GB per output), ``--keep``
(keep the folders).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUANT_TIME_TARGET_S = 180.0
#: the phases of quantize's summary line
PHASES = re.compile(r"calibration ([\d.]+)s, quantization ([\d.]+)s")
RSS_TARGET_SHARDS = 2.0


def _status_kb(pid: int) -> dict:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(rest.split()[0])
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass
    return out


def run_measured(cmd: list[str], env: dict) -> dict:
    """Run ``cmd``; wall time, exit code, output, and host-memory peaks (bytes)."""
    t0 = time.time()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    peaks = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0}
    done = threading.Event()

    def poll():
        while not done.is_set():
            st = _status_kb(p.pid)
            for k in peaks:
                peaks[k] = max(peaks[k], st.get(k, 0))
            time.sleep(0.02)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    lines = []
    assert p.stdout is not None
    for line in p.stdout:  # stream the child's output through, keep it for parsing
        sys.stdout.write(line)
        lines.append(line)
    _, status, rusage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    th.join()
    return {"cmd": cmd, "rc": p.returncode, "wall_s": time.time() - t0, "output": "".join(lines),
            "peak_rss": rusage.ru_maxrss * 1024, "peak_anon": peaks["RssAnon"] * 1024,
            "peak_file": peaks["RssFile"] * 1024}


def _gpu_name() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
        return f"no GPU (torch {torch.__version__})"
    except Exception as exc:  # noqa: BLE001
        return f"unknown ({exc})"


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--size", default="8b-shape")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--weight-only-too", action="store_true")
    ap.add_argument("--methods", nargs="*", default=[], choices=("rtn", "mse", "gptq"),
                    help="also time `quantize --method M --weights-only` for each (reported, no target)")
    ap.add_argument("--out", default=None, help="write the markdown report here too")
    args = ap.parse_args()

    env = dict(os.environ)
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    work = Path(tempfile.mkdtemp(prefix="bench-quantize-", dir=args.workdir))
    src, dst, dst_wo = work / "src", work / "nvfp4", work / "nvfp4-w4a16"
    cli = [sys.executable, "-m", "nvfp4_plugin.cli"]
    rows = []
    reported_only = set()   # rows timed for the record, not held to the targets
    ok = True
    try:
        mk = run_measured(cli + ["make-model", str(src), "--arch", args.arch, "--size", args.size,
                                 "--device", "auto" if args.device.startswith("cuda") else "cpu", "--quiet"], env)
        if mk["rc"] != 0:
            print(f"make-model failed (rc {mk['rc']})")
            return 1
        shards = sorted(src.glob("*.safetensors"))
        largest = max(p.stat().st_size for p in shards)
        total = sum(p.stat().st_size for p in shards)
        rows.append(("make-model", mk, None))
        q = run_measured(cli + ["quantize", str(src), str(dst), "--device", args.device, "--quiet",
                                "--method", "rtn"], env)
        rows.append(("quantize --method rtn (calibrated, NVFP4 W4A4)", q, largest))
        if q["rc"] == 0:
            chk = run_measured(cli + ["check", str(dst)], env)
            rows.append(("check output (our loader, all scales)", chk, None))
        if args.weight_only_too:
            qw = run_measured(cli + ["quantize", str(src), str(dst_wo), "--device", args.device, "--quiet",
                                     "--method", "rtn", "--no-calibration"], env)
            rows.append(("quantize --method rtn --no-calibration (W4A16)", qw, largest))
        for method in args.methods:
            qm = run_measured(cli + ["quantize", str(src), str(work / f"nvfp4-{method}"), "--device", args.device,
                                     "--quiet", "--method", method, "--weights-only"], env)
            rows.append((f"quantize --method {method} --weights-only (calibrated W4A16)", qm, largest))
            reported_only.add(rows[-1][0])
            shutil.rmtree(work / f"nvfp4-{method}", ignore_errors=True)
        out_bytes = sum(p.stat().st_size for p in dst.glob("*.safetensors")) if dst.exists() else 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    phases = PHASES.search(q["output"])
    lines = [
        f"# Offline quantizer benchmark ({args.arch} {args.size})",
        "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}, host {platform.node()}, "
        f"{os.cpu_count()} CPUs",
        f"- device: {_gpu_name()}",
        f"- command: `PYTHONPATH=. python3 benchmarks/bench_quantize.py {' '.join(sys.argv[1:])}`",
        f"- input: {len(shards)} bf16 shards, {_gb(total)} GB, largest shard {_gb(largest)} GB; "
        f"NVFP4 output {_gb(out_bytes)} GB",
        "",
        "| step | rc | wall s | peak RSS GB | peak anon GB | peak file-mapped GB | peak RSS / largest shard |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r, shard in rows:
        ratio = f"{r['peak_rss'] / shard:.2f}" if shard else "-"
        lines.append(f"| {name} | {r['rc']} | {r['wall_s']:.1f} | {_gb(r['peak_rss'])} | {_gb(r['peak_anon'])} | "
                     f"{_gb(r['peak_file'])} | {ratio} |")
    lines.append("")
    if phases:
        lines.append(f"quantize phases (from its summary): calibration {phases[1]} s, quantization + write "
                     f"{phases[2]} s; the rest is process start-up, imports and CUDA initialization.")
    for name, r, _ in rows:
        m = PHASES.search(r["output"]) if name in reported_only else None
        if m:
            lines.append(f"- {name}: calibration {m[1]} s, quantization + write {m[2]} s")
    for name, r, shard in rows:
        if shard and name not in reported_only:
            t_ok = r["rc"] == 0 and r["wall_s"] < QUANT_TIME_TARGET_S
            m_ok = r["peak_rss"] < RSS_TARGET_SHARDS * shard
            ok &= t_ok and m_ok
            lines.append(f"- {name}: time {'PASS' if t_ok else 'FAIL'} ({r['wall_s']:.1f} s vs < "
                         f"{QUANT_TIME_TARGET_S:.0f} s), host memory {'PASS' if m_ok else 'FAIL'} "
                         f"({_gb(r['peak_rss'])} GB vs < {RSS_TARGET_SHARDS:.0f} x {_gb(shard)} GB)")
    report = "\n".join(lines) + "\n"
    print("\n" + report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
