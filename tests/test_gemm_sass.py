"""The GEMM kernel compiled for sm_90a on this (GPU-less) machine: the SASS must show the design.

Decoded weights stay in registers as the tensor-core A operand (no shared-memory store in the main
loop), the tensor-core instruction is the intended one (mma.sync HMMA for 8-token tiles, wgmma HGMMA
for larger ones), nothing spills to local memory, and the main loop stays within its instruction
budget (what decides whether weight streaming can reach device bandwidth at decode sizes).
"""

import json
import os
import subprocess
import sys

import pytest

CASES = [
    # (config, expected tensor-core op, max instructions per weight element in the main loop)
    (dict(bn=64, bm=8, bk=256, v2=True, num_warps=4, num_stages=4), "HMMA", 3.3),
    (dict(bn=64, bm=16, bk=256, num_warps=4, num_stages=3), "HGMMA", 4.0),
    (dict(bn=128, bm=128, bk=64, num_warps=8, num_stages=4), "HGMMA", 6.0),
]

SCRIPT = r"""
import json, sys
from nvfp4_plugin.gemm import W4Config
from nvfp4_plugin.gemm import inspect_sass as I
cfg = W4Config(**json.loads(sys.argv[1]))
s = I.summary(I.compile_config(cfg, mode=int(sys.argv[2])))
inner = s["loops"][-1] if int(sys.argv[2]) == 0 else max(s["loops"], key=lambda l: l[1].get("HMMA", 0) + l[1].get("HGMMA", 0))
print(json.dumps(dict(local=s["local"], hgmma=s["hgmma"], hmma=s["hmma"], loop_n=inner[0], loop_ops=dict(inner[1]))))
"""


def _triton_has_ptxas() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


@pytest.mark.skipif(not _triton_has_ptxas(), reason="needs triton with its bundled ptxas")
@pytest.mark.parametrize("cfg,op,budget", CASES, ids=["v2_bm8", "v3_bm16", "v3_bm128"])
@pytest.mark.parametrize("mode", [0, 1], ids=["dense", "grouped"])
def test_sm90_sass(cfg, op, budget, mode):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["NVFP4_PLUGIN_GEMM_COMPILE_ONLY"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cfg), str(mode)], capture_output=True, text=True,
                         env=env, cwd=root, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["local"] == 0, r                                   # no spills / local arrays
    assert r["hmma" if op == "HMMA" else "hgmma"] > 0, r
    assert r["loop_ops"].get("HMMA" if op == "HMMA" else "HGMMA", 0) > 0, r
    assert r["loop_ops"].get("STS", 0) == 0, r                  # decoded weights never go through smem
    assert r["loop_ops"].get("HMUL2", 0) > 0, r                 # the scale multiply is packed bf16x2
    elems_per_thread = cfg["bn"] * cfg["bk"] / (32 * cfg["num_warps"])
    assert r["loop_n"] / elems_per_thread <= budget, r
