#!/usr/bin/env python3
"""Compare two serve_check.py results of one checkpoint, e.g. TP=1 against --tensor-parallel-size 2.

    python integration/compare_tp.py RESULT_A.json RESULT_B.json [--md out.md]

Exit 0 when both servers answered and their greedy completion and chat texts (16 tokens each) are
identical; exit 1 otherwise. Also reported, not gated: whether the 128-token greedy decode matches
(and where it first differs: random-weight models have near-ties that a different reduction order
can flip), the prompt-logprob difference max / mean, and batch-1 decode tokens/s of each.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def first_difference(a: str, b: str) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(a: dict, b: dict) -> tuple[bool, list[str]]:
    lines = []
    missing = [k for k in ("completion", "chat", "prompt_logprobs") for r in (a, b) if k not in r]
    if missing:
        errors = [r.get("error") or f"exit {r.get('exit_code')}" for r in (a, b)]
        return False, [f"a server did not answer (missing {sorted(set(missing))}; {errors})"]
    ok = True
    for key in ("completion", "chat", "decode_text"):
        if key not in a or key not in b:
            lines.append(f"| {key} | not recorded | |")
            continue
        pos = first_difference(a[key], b[key])
        same = pos is None
        if key != "decode_text":
            ok &= same
        where = "identical" if same else f"differs at character {pos}: {a[key][pos:pos + 20]!r} vs {b[key][pos:pos + 20]!r}"
        lines.append(f"| {key} ({len(a[key])} chars) | {where} | {'gated' if key != 'decode_text' else 'reported'} |")
    la, lb = a["prompt_logprobs"], b["prompt_logprobs"]
    if len(la) == len(lb) and la:
        d = [abs(x - y) for x, y in zip(la, lb)]
        lines.append(f"| prompt logprobs ({len(d)} tokens) | max {max(d):.4f}, mean {sum(d) / len(d):.4f} | reported |")
    else:
        ok = False
        lines.append(f"| prompt logprobs | lengths differ: {len(la)} vs {len(lb)} | gated |")
    lines.append(f"| batch-1 decode tok/s | {a.get('batch1_tok_per_s')} vs {b.get('batch1_tok_per_s')} | reported |")
    return ok, lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    a, b = (json.loads(Path(p).read_text()) if Path(p).exists() else {"error": f"{p} not found"}
            for p in (args.a, args.b))
    ok, lines = compare(a, b)
    text = "\n".join([f"{Path(args.a).stem} vs {Path(args.b).stem}: {'MATCH' if ok else 'MISMATCH'}", "",
                      "| what | result | |", "|---|---|---|", *lines])
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
