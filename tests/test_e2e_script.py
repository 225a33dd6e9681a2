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


def _function(text: str, name: str) -> str:
    """A shell function of the script, from its first line to the closing brace at column 0."""
    m = re.search(rf"^{name}\(\) {{.*?^}}\n", text, re.M | re.S)
    assert m, f"no function {name} in e2e.sh"
    return m.group(0)


def test_variants_pick_the_servers_a_model_step_starts():
    """VARIANTS="ours-modelopt builtin-modelopt": llama / moe / smol start only those servers (each takes 1-3
    minutes of a 30-minute hold); unset, all of them."""
    import os
    import subprocess
    text = SCRIPT.read_text()
    prog = (_function(text, "wanted") + _function(text, "serve_all")
            + 'serve() { echo "$1"; }\nM=/m\nserve_all llama with-bf16\nserve_all qwen3_moe\n')

    def started(variants):
        env = {k: v for k, v in os.environ.items() if k != "VARIANTS"}
        if variants is not None:
            env["VARIANTS"] = variants
        out = subprocess.run(["bash", "-uc", prog], env=env, capture_output=True, text=True, check=True)
        return out.stdout.split()

    assert started(None) == ["llama-ours-modelopt", "llama-ours-ct", "llama-ours-modelopt-reference",
                             "llama-builtin-modelopt", "llama-bf16", "qwen3_moe-ours-modelopt", "qwen3_moe-ours-ct",
                             "qwen3_moe-ours-modelopt-reference", "qwen3_moe-builtin-modelopt"]
    assert started("ours-modelopt builtin-modelopt") == ["llama-ours-modelopt", "llama-builtin-modelopt",
                                                         "qwen3_moe-ours-modelopt", "qwen3_moe-builtin-modelopt"]
    assert started("bf16") == ["llama-bf16"]
