#!/usr/bin/env python3
"""Quantizer accuracy: perplexity of real models, bf16 against NVFP4 by method, on a held-out text.

    python -m benchmarks.bench_accuracy --model smollm2=/tmp/real/smollm2 --model gemma3=/tmp/real/gemma3 \\
        --out /tmp/acc [--text nvfp4_plugin/data/heldout_en.txt] [--device cpu]

Models come from ``../shared/tools/real-lm/fetch NAME DIR`` (trained models as bf16 folders). For each
model it quantizes with every variant below (``nvfp4-plugin quantize``) and evaluates all of them and the
bf16 folder with ``nvfp4-plugin eval-ppl``; the table goes to ``OUT/accuracy.md``:

    rtn  W4A16   --no-calibration --method rtn      (ModelOpt's default recipe, weights only)
    mse  W4A16   --no-calibration --method mse      (block scales searched by error, no model run)
    mse+act W4A16  --weights-only --method mse      (errors weighted by the calibration inputs' mean squares)
    gptq W4A16   --weights-only --method gptq       (error compensation with the calibration Hessians)
    rtn  W4A4    --method rtn                       (calibrated activation scales; activations quantized)
    mse  W4A4    --method mse
    gptq W4A4    --method gptq

    gptq-d0.1 W4A16 / W4A4  the same with --gptq-damping 0.1

``--variants`` picks some (e.g. ``--variants "gptq W4A16" "gptq W4A4"``); bf16 is always evaluated. The notes
under the table give each quantize run's wall time and its calibration / quantization split.

``--layer-errors 0,10,20`` measures instead, for those decoder layers, each linear's output error
``tr((W - Wq) H (W - Wq)^T)`` relative to rtn's, with ``H = X^T X / tokens`` from the bf16 model's inputs on the
calibration text (what gptq minimises) and on the held-out text (what generalises), per weight method: a
measure of the quantizers free of the perplexity's noise on a short text (``OUT/layer_errors.md``).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

from nvfp4_plugin.demo import HELDOUT_TEXT  # the package's held-out text, shared with the demo

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "rtn W4A16": ["--no-calibration", "--method", "rtn"],
    "mse W4A16": ["--no-calibration", "--method", "mse"],
    "mse+act W4A16": ["--weights-only", "--method", "mse"],
    "gptq W4A16": ["--weights-only", "--method", "gptq"],
    "rtn W4A4": ["--method", "rtn"],
    "mse W4A4": ["--method", "mse"],
    "gptq W4A4": ["--method", "gptq"],
    "gptq-d0.1 W4A16": ["--weights-only", "--method", "gptq", "--gptq-damping", "0.1"],
    "gptq-d0.1 W4A4": ["--method", "gptq", "--gptq-damping", "0.1"],
}
DEFAULT_VARIANTS = [v for v in VARIANTS if not v.startswith("gptq-d0.1")]
#: Weight methods compared by --layer-errors: (name, method, gptq settings).
LAYER_METHODS = (("rtn", "rtn", None), ("mse", "mse", None), ("mse+act", "mse+act", None),
                 ("gptq", "gptq", {}), ("gptq damping 0.1", "gptq", {"damping": 0.1}),
                 ("gptq act order", "gptq", {"act_order": True}))


def cli(*args) -> str:
    r = subprocess.run([sys.executable, "-m", "nvfp4_plugin.cli", *args], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"nvfp4-plugin {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def layer_errors(name: str, src: str, layers: list[int], text: str) -> list[str]:
    """Markdown rows: per decoder layer and distinct input, each method's output error relative to rtn's."""
    import torch

    from nvfp4_plugin import reference
    from nvfp4_plugin.checkpoints import formats, naming
    from nvfp4_plugin.checkpoints import gptq as G
    from nvfp4_plugin.checkpoints import scale_search as ss
    from nvfp4_plugin.checkpoints.calibrate import calibrate_input_amax
    from nvfp4_plugin.checkpoints.quantize import QuantizeOptions, plan_quantization
    from nvfp4_plugin.checkpoints.safetensors_io import CheckpointFiles

    files = CheckpointFiles(src)
    plan = plan_quantization(files, QuantizeOptions(), formats.ALGO_W4A16)
    mods = [m for m in plan.modules if any(f".layers.{i}." in m for i in layers)]
    h_cal, h_held = {}, {}
    calibrate_input_amax(src, files, mods, device="cpu", hessians=h_cal)
    calibrate_input_amax(src, files, mods, device="cpu", hessians=h_held, texts=[Path(text).read_text()])
    groups: dict[str, list[str]] = {}
    for m in mods:
        groups.setdefault(naming.shared_input_key(m), []).append(m)
    rows, sums = [], {n: [0.0, 0.0] for n, _, _ in LAYER_METHODS}
    for key in sorted(groups, key=lambda k: (int(k.split(".layers.")[1].split(".")[0]), k)):
        members = sorted(groups[key], key=lambda m: naming.fused_group(m)[1] if naming.fused_group(m) else 0)
        w = torch.cat([files.read(m + ".weight").float() for m in members])
        gs = formats.global_scale_from_amax_exact(w.abs().amax())       # the fused group's, as quantize uses
        hc, hh = h_cal[key], h_held[key]

        def deq(packed, scales):
            return reference.dequantize_fp4(packed, scales, gs, swizzled=False, m=w.shape[0], k=w.shape[1])

        def err(wq, h):
            d = w - wq
            return float(((d @ h) * d).sum())

        cells = []
        for mname, method, kw in LAYER_METHODS:
            if method == "rtn":
                wq = deq(*reference.scaled_fp4_quant(w, gs.reshape(1), swizzle=False))
                base = (err(wq, hc), err(wq, hh))
            elif method == "mse":
                wq = deq(*ss.quantize_mse(w, gs))
            elif method == "mse+act":
                wq = deq(*ss.quantize_mse(w, gs, col_weight=hc.diagonal()))
            else:
                st = G.GptqSettings(**kw)
                wq = G.gptq_quantize(w, gs, G.factor_hessian(hc, st), st).dequantized
            rel = (err(wq, hc) / base[0], err(wq, hh) / base[1])
            sums[mname][0] += rel[0]
            sums[mname][1] += rel[1]
            cells.append(f"{rel[0]:.3f} / {rel[1]:.3f}")
        rows.append(f"| {name} | {key.split('.layers.')[1]} ({w.shape[1]}) | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    files.close()
    n = len(groups)
    rows.append(f"| {name} | **mean of {n}** | " + " | ".join(f"**{a / n:.3f} / {b / n:.3f}**"
                                                           for a, b in sums.values()) + " |")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, metavar="NAME=DIR")
    ap.add_argument("--text", default=str(HELDOUT_TEXT))
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu", help="quantization and evaluation device")
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    ap.add_argument("--layer-errors", metavar="I,J,...", help="per-layer output errors of these decoder layers "
                                                              "instead of perplexities (CPU)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.layer_errors:
        layers = [int(i) for i in a.layer_errors.split(",")]
        md = ["| model | layer.input (K) | " + " | ".join(n for n, _, _ in LAYER_METHODS) + " |",
              "|---|---|" + "---:|" * len(LAYER_METHODS)]
        for spec in a.model:
            name, src = spec.split("=", 1)
            md += layer_errors(name, src, layers, a.text)
        md += ["", "each cell: output error relative to rtn's, on calibration-text inputs / on held-out-text inputs"]
        (out / "layer_errors.md").write_text("\n".join(md) + "\n")
        print("\n".join(md))
        return 0
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
            summary = cli("quantize", src, str(dst), *VARIANTS[v], "--device", a.device, "--quiet", "--overwrite")
            split = re.search(r"calibration ([0-9.]+)s, quantization ([0-9.]+)s", summary)
            secs[v] = (time.time() - t, float(split.group(1)), float(split.group(2)))
            line = cli("eval-ppl", str(dst), "--text", a.text, "--device", a.device)
            ppl[v] = float(re.search(r"perplexity ([0-9.]+)", line).group(1))
            print(f"[{name}] {v}: ppl {ppl[v]:.3f} (bf16 {ppl['bf16']:.3f}), quantize {secs[v][0]:.0f} s "
                  f"(calibration {secs[v][1]:.0f} s, quantization {secs[v][2]:.0f} s)", flush=True)
        rows.append((name, ppl, secs))
    md = ["| model | bf16 | " + " | ".join(a.variants) + " |", "|---|---:|" + "---:|" * len(a.variants)]
    for name, ppl, _ in rows:
        cells = [f"{ppl[v]:.2f} ({100 * (ppl[v] / ppl['bf16'] - 1):+.1f}%)" for v in a.variants]
        md.append(f"| {name} | {ppl['bf16']:.2f} | " + " | ".join(cells) + " |")
    md += ["", "quantize seconds on " + a.device + ", wall (calibration + quantization): " + "; ".join(
        f"{name}: " + ", ".join(f"{v} {secs[v][0]:.0f} ({secs[v][1]:.0f} + {secs[v][2]:.0f})" for v in a.variants)
        for name, _, secs in rows)]
    (out / "accuracy.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
