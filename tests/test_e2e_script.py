"""integration/e2e.sh: every step its header documents has a case arm (a rewrite once dropped three of
them, and the GPU run answered 'unknown step smol'), and no arm is undocumented."""

import re
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "integration" / "e2e.sh"


def _documented_steps(text: str) -> set[str]:
    header = text.split("\nset -")[0]
    body = header.split("# Steps:")[1]
    # a step line: "#   name  description" (continuation lines are indented further)
    return {m.group(1) for m in re.finditer(r"^#   ([a-z0-9]+)\s", body, re.M)}


def _case_arms(text: str) -> set[str]:
    loop = text.split('for s in "$@"; do')[1]
    arms = set()
    for m in re.finditer(r"^    ([a-z0-9|]+)\)", loop, re.M):
        arms.update(m.group(1).split("|"))
    return arms


def test_every_documented_step_is_handled():
    text = SCRIPT.read_text()
    documented, arms = _documented_steps(text), _case_arms(text)
    assert {"models", "llama", "moe", "smol", "ref", "compare"} <= documented
    assert documented - arms == set(), f"documented but not handled: {sorted(documented - arms)}"
    undocumented = arms - documented - {"tp1", "tp2", "ep2"}  # described under tp and ep
    assert undocumented == set(), f"handled but not documented: {sorted(undocumented)}"
