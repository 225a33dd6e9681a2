#!/usr/bin/env python3
"""Line up the prompt logprobs and greedy completions that serve_check.py and reference_logprobs.py
recorded, as a markdown table.

    python integration/compare_logprobs.py RESULTS_DIR [RESULTS_DIR ...] [--md out.md]

Files are matched by the names integration/e2e.sh gives them: ``MODEL-ours-modelopt``,
``MODEL-ours-ct``, ``MODEL-ours-modelopt-reference``, ``MODEL-builtin-modelopt``, ``MODEL-bf16`` (served)
and ``MODEL-ref`` / ``MODEL-bf16-ref`` / ``MODEL-ref-bf16`` (reference_logprobs.py on the ModelOpt
checkpoint / on the bf16 model / on the ModelOpt checkpoint in bf16). Every served run of a quantized
checkpoint is compared with MODEL-ref and with the engine's built-in path; the served bf16 model with
MODEL-bf16-ref. The tolerance is the bf16 floor: MODEL-ref-bf16 against MODEL-ref, how far bf16 arithmetic
alone moves the logprobs of the same weights. Ours and the built-in both dequantize exactly and accumulate
in fp32, differing only in where they round to bf16: ours is "within the floor" when its max and mean
difference from the built-in are both at most the floor's. A greedy completion that leaves the reference's
is named with the token where it does and the reference's margin there (its top logprob over the
runner-up's): a margin inside the floor is a near tie, not a wrong answer.
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


def divergence(served: dict, ref: dict) -> str:
    """"yes" when the greedy completions are equal; else the reference's token where the served text leaves
    it (1-based) and the reference's margin there, when the reference recorded them."""
    a, b = served.get("completion") or "", ref.get("completion") or ""
    if a == b:
        return "yes"
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    offsets, margins = ref.get("completion_offsets") or [], ref.get("completion_margins") or []
    k = next((i for i, end in enumerate(offsets) if end > at), None)
    if k is None or k >= len(margins):
        return "no"
    return f"no: token {k + 1}, reference margin {margins[k]:.4f}"


def within_floor(d: tuple[float, float] | None, floor: tuple[float, float] | None) -> str:
    if d is None or floor is None:
        return "n/a"
    return f"{'yes' if d[0] <= floor[0] and d[1] <= floor[1] else 'no'} ({floor[0]:.4f} / {floor[1]:.4f})"


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
        if variant in ("builtin-modelopt", "bf16"):
            builtin = None
        qref, bf16_ref = results.get(f"{model}-ref"), results.get(f"{model}-ref-bf16")
        floor = diff(bf16_ref["prompt_logprobs"], qref["prompt_logprobs"]) if qref and bf16_ref else None
        vs_ref, vs_builtin = (diff(r["prompt_logprobs"], o["prompt_logprobs"]) if o else None for o in (ref, builtin))
        cells = [engine, model, variant]
        cells += ["n/a" if d is None else f"{d[0]:.4f} / {d[1]:.4f}" for d in (vs_ref, vs_builtin)]
        cells.append(within_floor(vs_builtin, floor))
        cells.append(divergence(r, ref) if ref else "n/a")
        cells.append(str(r.get("batch1_tok_per_s", "")))
        yield cells


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--md", help="also write the table here")
    args = ap.parse_args()
    header = ["engine", "model", "served", "vs CPU reference: max / mean abs dlogprob",
              "vs built-in modelopt_fp4: max / mean", "vs built-in within the bf16 floor (floor)",
              "greedy = reference", "batch-1 tok/s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c) + " |" for c in rows(load(args.dirs))]
    text = "\n".join(lines)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
