#!/usr/bin/env python3
"""Quantizer accuracy: perplexity of real models, bf16 against NVFP4 by method, on a held-out text.

    python -m benchmarks.bench_accuracy --model smollm2=/tmp/real/smollm2 --model gemma3=/tmp/real/gemma3 \\
        --out /tmp/acc [--text benchmarks/data/heldout_en.txt] [--device cpu]

Models come from ``../shared/tools/real-lm/fetch NAME DIR`` (trained models as bf16 folders). For each
model it quantizes with every variant below (``nvfp4-plugin quantize``) and evaluates all of them and the
bf16 folder with ``nvfp4-plugin eval-ppl``; the table goes to ``OUT/accuracy.md``:

    rtn  W4A16   --no-calibration --method rtn      (ModelOpt's default recipe, weights only)
    mse  W4A16   --no-calibration --method mse      (block scales searched by error, no model run)
    mse+act W4A16  --weights-only --method mse      (errors weighted by the calibration inputs' mean squares)
    rtn  W4A4    --method rtn                       (calibrated activation scales; activations quantized)
    mse  W4A4    --method mse
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "rtn W4A16": ["--no-calibration", "--method", "rtn"],
    "mse W4A16": ["--no-calibration", "--method", "mse"],
    "mse+act W4A16": ["--weights-only", "--method", "mse"],
    "rtn W4A4": ["--method", "rtn"],
    "mse W4A4": ["--method", "mse"],
}


def cli(*args) -> str:
    r = subprocess.run([sys.executable, "-m", "nvfp4_plugin.cli", *args], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"nvfp4-plugin {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, metavar="NAME=DIR")
    ap.add_argument("--text", default=str(ROOT / "benchmarks" / "data" / "heldout_en.txt"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu", help="quantization and evaluation device")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in a.model:
        name, src = spec.split("=", 1)
        ppl = {}
        line = cli("eval-ppl", src, "--text", a.text, "--device", a.device)
        ppl["bf16"] = float(re.search(r"perplexity ([0-9.]+)", line).group(1))
        secs = {}
        for v in a.variants:
            dst = out / f"{name}-{v.replace(' ', '-').replace('+', '')}"
            t = time.time()
            cli("quantize", src, str(dst), *VARIANTS[v], "--device", a.device, "--quiet", "--overwrite")
            secs[v] = time.time() - t
            line = cli("eval-ppl", str(dst), "--text", a.text, "--device", a.device)
            ppl[v] = float(re.search(r"perplexity ([0-9.]+)", line).group(1))
            print(f"[{name}] {v}: ppl {ppl[v]:.3f} (bf16 {ppl['bf16']:.3f}), quantize {secs[v]:.0f} s", flush=True)
        rows.append((name, ppl, secs))
    md = ["| model | bf16 | " + " | ".join(a.variants) + " |", "|---|---:|" + "---:|" * len(a.variants)]
    for name, ppl, _ in rows:
        cells = [f"{ppl[v]:.2f} ({100 * (ppl[v] / ppl['bf16'] - 1):+.1f}%)" for v in a.variants]
        md.append(f"| {name} | {ppl['bf16']:.2f} | " + " | ".join(cells) + " |")
    md += ["", "quantize seconds (" + a.device + "): " + "; ".join(
        f"{name}: " + ", ".join(f"{v} {secs[v]:.0f}" for v in a.variants) for name, _, secs in rows)]
    (out / "accuracy.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
