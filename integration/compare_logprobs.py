#!/usr/bin/env python3
"""Line up the prompt logprobs and greedy completions that serve_check.py and reference_logprobs.py
recorded, as a markdown table.

    python integration/compare_logprobs.py RESULTS_DIR [RESULTS_DIR ...] [--md out.md]

Files are matched by the names integration/e2e.sh gives them: ``MODEL-ours-modelopt``,
``MODEL-ours-ct``, ``MODEL-ours-modelopt-reference``, ``MODEL-builtin-modelopt``, ``MODEL-bf16`` (served)
and ``MODEL-ref`` / ``MODEL-bf16-ref`` (reference_logprobs.py on the ModelOpt checkpoint / the bf16
model). Every served run of a quantized checkpoint is compared with MODEL-ref and with the engine's
built-in path; the served bf16 model with MODEL-bf16-ref shows how far the engine's bf16 arithmetic
alone moves logprobs (the noise floor that justifies the tolerance).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

VARIANTS = ("ours-modelopt", "ours-ct", "ours-modelopt-reference", "builtin-modelopt", "bf16")


def load(dirs) -> dict[str, dict]:
    out = {}
    for d in dirs:
        for p in sorted(Path(d).glob("*.json")):
            try:
                r = json.loads(p.read_text())
            except json.JSONDecodeError:
                continue
            if isinstance(r, dict) and r.get("prompt_logprobs"):
                label = r.get("engine", "")
                out[f"{label.split()[0]}:{p.stem}" if label and not label.startswith("reference") else p.stem] = r
    return out


def diff(a: list[float], b: list[float]) -> tuple[float, float] | None:
    if len(a) != len(b):
        return None
    d = [abs(x - y) for x, y in zip(a, b)]
    return max(d), sum(d) / len(d)


def rows(results: dict[str, dict]):
    for key, r in sorted(results.items()):
        if ":" not in key:
            continue
        engine, stem = key.split(":", 1)
        variant = next((v for v in VARIANTS if stem.endswith("-" + v)), None)
        if variant is None:
            continue
        model = stem[: -len(variant) - 1]
        ref = results.get(f"{model}-bf16-ref" if variant == "bf16" else f"{model}-ref")
        builtin = results.get(f"{engine}:{model}-builtin-modelopt")
        cells = [engine, model, variant]
        for other in (ref, builtin if variant not in ("builtin-modelopt", "bf16") else None):
            d = diff(r["prompt_logprobs"], other["prompt_logprobs"]) if other else None
            cells.append("n/a" if d is None else f"{d[0]:.4f} / {d[1]:.4f}")
        cells.append("yes" if ref and r.get("completion") == ref.get("completion") else ("no" if ref else "n/a"))
        cells.append(str(r.get("batch1_tok_per_s", "")))
        yield cells


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--md", help="also write the table here")
    args = ap.parse_args()
    header = ["engine", "model", "served", "vs CPU reference: max / mean abs dlogprob",
              "vs built-in modelopt_fp4: max / mean", "greedy = reference", "batch-1 tok/s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c) + " |" for c in rows(load(args.dirs))]
    text = "\n".join(lines)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
