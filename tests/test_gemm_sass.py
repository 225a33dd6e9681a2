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

from tests._require import required_here

CASES = [
    # (config, expected tensor-core op, max instructions per weight element in the main loop)
    (dict(bn=64, bm=8, bk=256, v2=True, num_warps=4, num_stages=4), "HMMA", 3.3),
    (dict(bn=64, bm=16, bk=256, num_warps=4, num_stages=3), "HGMMA", 4.0),
    (dict(bn=128, bm=64, bk=128, num_warps=8, num_stages=3), "HGMMA", 4.5),
    # 64 FSEL of the wait that keeps the register A operand safe (see test_no_register_race) on top
    (dict(bn=128, bm=128, bk=64, num_warps=8, num_stages=4), "HGMMA", 7.0),
    (dict(bn=128, bm=256, bk=64, num_warps=8, num_stages=3), "HGMMA", 9.5),
    # shared-memory wgmma (tokens as M): the decoded tile is stored with STSM, no FSEL-forced wait
    (dict(bn=128, bm=128, bk=64, num_warps=8, num_stages=4, ss=True), "HGMMA", 5.5),
    (dict(bn=256, bm=128, bk=64, num_warps=8, num_stages=3, ss=True), "HGMMA", 4.5),
]

SCRIPT = r"""
import json, sys
from nvfp4_plugin.gemm import W4Config
from nvfp4_plugin.gemm import inspect_sass as I
cfg = W4Config.from_json(json.loads(sys.argv[1]))
s = I.summary(I.compile_config(cfg, mode=int(sys.argv[2])))
inner = s["loops"][-1] if int(sys.argv[2]) == 0 else max(s["loops"], key=lambda l: l[1].get("HMMA", 0) + l[1].get("HGMMA", 0))
print(json.dumps(dict(local=s["local"], hgmma=s["hgmma"], hmma=s["hmma"], loop_n=inner[0], loop_ops=dict(inner[1]),
                      hazards=s["rs_wgmma_hazards"], ss_hazards=s["ss_store_hazards"])))
"""


def _triton_has_ptxas() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


def _compile_in_subprocess(script: str, *args: str) -> dict:
    """Run a compile-only script (sm_90a, no GPU) in a fresh interpreter; its last stdout line is JSON."""
    if not _triton_has_ptxas():
        if "triton" in required_here():
            pytest.fail("NVFP4_TEST_REQUIRE=triton but triton has no bundled ptxas", pytrace=False)
        pytest.skip("needs triton with its bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["NVFP4_PLUGIN_GEMM_COMPILE_ONLY"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, cwd=root,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cfg,op,budget", CASES, ids=["v2_bm8", "v3_bm16", "v3_bm64", "v3_bm128", "v3_bm256",
                                                          "ss_bm128", "ss_bn256"])
@pytest.mark.parametrize("mode", [0, 1], ids=["dense", "grouped"])
def test_sm90_sass(cfg, op, budget, mode):
    r = _compile_in_subprocess(SCRIPT, json.dumps(cfg), str(mode))
    assert r["local"] == 0, r                                   # no spills / local arrays
    assert r["hmma" if op == "HMMA" else "hgmma"] > 0, r
    assert r["loop_ops"].get("HMMA" if op == "HMMA" else "HGMMA", 0) > 0, r
    if cfg.get("ss"):
        assert r["loop_ops"].get("STSM", 0) > 0, r              # decoded weights: the B operand in smem
        assert r["loop_ops"].get("FSEL", 0) == 0, r             # no forced wait (register-A path: 64 FSEL)
        # the decoded tile's buffer is rewritten each step: never while a wgmma may still read it
        assert r["ss_hazards"] == [], r["ss_hazards"]
    else:
        assert r["loop_ops"].get("STS", 0) == 0 and r["loop_ops"].get("STSM", 0) == 0, r  # registers only
    assert r["loop_ops"].get("HMUL2", 0) > 0, r                 # the scale multiply is packed bf16x2
    elems_per_thread = cfg["bn"] * cfg["bk"] / (32 * cfg["num_warps"])
    assert r["loop_n"] / elems_per_thread <= budget, r
    # no write to the register A operand of a wgmma that may still run (triton-lang/triton#9433)
    assert r["hazards"] == ([] if op == "HGMMA" and not cfg.get("ss") else None), r["hazards"]


# The shape of Triton 3.6's pipelined register-A wgmma loop (abridged from the kernel's own SASS before
# the fix): three of four wgmma groups (A registers R88..R99) stay in flight across the back edge, and
# the next decode overwrites R96 and R88 before the first wait.
_RACY = """
        /*1770*/                   IMAD R96, R113, 0x800, R11 ;
        /*1780*/                   LDS.64 R100, [R96+0x13000] ;
        /*1790*/                   LOP3.LUT R88, R5, 0xf, RZ, 0xc0, !PT ;
        /*17a0*/                   WARPGROUP.ARRIVE ;
        /*17b0*/                   HGMMA.64x128x16.F32.BF16 R24, R100, gdesc[UR12], R24, gsb0 ;
        /*17c0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x3 ;
        /*17d0*/                   HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR12], R24, gsb0 ;
        /*17e0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x3 ;
        /*17f0*/                   HGMMA.64x128x16.F32.BF16 R24, R92, gdesc[UR12], R24, gsb0 ;
        /*1800*/                   WARPGROUP.DEPBAR.LE gsb0, 0x3 ;
        /*1810*/                   HGMMA.64x128x16.F32.BF16 R24, R96, gdesc[UR12], R24, gsb0 ;
        /*1820*/                   WARPGROUP.DEPBAR.LE gsb0, 0x3 ;
        /*1830*/              @!P0 BRA 0x1770 ;
"""


def test_register_race_scanner():
    from nvfp4_plugin.gemm.inspect_sass import rs_wgmma_hazards

    hits = rs_wgmma_hazards(_RACY)
    assert hits == ["/*1770*/ IMAD R96, R113, 0x800, R11", "/*1790*/ LOP3.LUT R88, R5, 0xf, RZ, 0xc0, !PT"]
    safe = _RACY.replace("gsb0, 0x3", "gsb0, 0x0")  # every wgmma waited for before the loop goes on
    assert rs_wgmma_hazards(safe) == []
    # a write after the first wait still races with the groups that wait leaves running
    late = _RACY.replace("        /*17d0*/", "        /*17c8*/                   LOP3.LUT R93, R5, 0xf, RZ, 0xc0, !PT ;\n"
                                             "        /*17d0*/")
    assert "/*17c8*/ LOP3.LUT R93, R5, 0xf, RZ, 0xc0, !PT" in rs_wgmma_hazards(late)
    # register widths: a 4-register LDSM and a 64-bit CS2R reach into the in-flight A registers
    wide = _RACY.replace("LOP3.LUT R88, R5, 0xf, RZ, 0xc0, !PT", "LDSM.16.M88.4 R86, [R3]") \
        .replace("IMAD R96, R113, 0x800, R11", "CS2R R98, SRZ")
    assert rs_wgmma_hazards(wide) == ["/*1770*/ CS2R R98, SRZ", "/*1790*/ LDSM.16.M88.4 R86, [R3]"]
    shared_a = _RACY.replace("R24, R88,", "R24, gdesc[UR4],").replace("R24, R92,", "R24, gdesc[UR4],") \
        .replace("R24, R96,", "R24, gdesc[UR4],").replace("R24, R100,", "R24, gdesc[UR4],")
    assert rs_wgmma_hazards(shared_a) is None  # A from shared memory: no register operand to race on


_SS_LOOP = """
        /*1bf0*/                   STSM.16.M88.4 [R109], R12 ;
        /*1f00*/                   MEMBAR.ALL.CTA ;
        /*1f30*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*2040*/                   WARPGROUP.ARRIVE ;
        /*2050*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24 ;
        /*2110*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24, gsb0 ;
        /*2120*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*21c0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*22c0*/              @!P0 BRA 0x1bf0 ;
"""


def test_shared_b_store_hazard_scanner():
    """The ss loop (abridged from its sm_90a SASS) retires its wgmmas before the next STSM of the
    decoded tile; without that wait, or with one that leaves a group running, the store races."""
    from nvfp4_plugin.gemm.inspect_sass import ss_store_hazards

    assert ss_store_hazards(_SS_LOOP) == []
    assert ss_store_hazards(_SS_LOOP.replace("gsb0, 0x0", "gsb0, 0x1")) == ["/*1bf0*/ STSM.16.M88.4 [R109], R12"]
    assert ss_store_hazards(_SS_LOOP.replace("gdesc[UR12]", "R88").replace("gdesc[UR8]", "R92")) is None


GLUON_SCRIPT = r"""
import collections, json, sys
from nvfp4_plugin.gemm import W4Config
from nvfp4_plugin.gemm import inspect_sass as I
cfg = W4Config.from_json(json.loads(sys.argv[1]))
ck = I.compile_gluon(cfg, fp16=sys.argv[2] == "1", split=cfg.split_k > 1, mode=int(sys.argv[3]),
                     tail=int(sys.argv[4]), bm_main=int(sys.argv[5]))
s = I.summary(ck)
sass = I.sass_text(ck)
body = I._wgmma_loop_body(sass)   # the innermost loop that issues wgmmas
ops = collections.Counter(t.split()[0].split(".")[0] for _, t in body)
atoms = sum(1 for line in sass.splitlines() if "ATOMG" in line)
print(json.dumps(dict(local=s["local"], hgmma=s["hgmma"], loop_ops=ops, hazards=s["rs_wgmma_hazards"], atoms=atoms)))
"""

GLUON_CASES = [(dict(bn=64, bm=128, bk=64, num_warps=4, num_stages=4, gluon=True), 0, 0, 0),
               (dict(bn=64, bm=256, bk=64, num_warps=4, num_stages=3, gluon=True), 0, 0, 0),
               (dict(bn=128, bm=256, bk=128, num_warps=8, num_stages=2, gluon=True, split_k=2), 0, 0, 0),
               (dict(bn=64, bm=128, bk=64, num_warps=4, num_stages=4, gluon=True), 1, 0, 0),
               (dict(bn=64, bm=128, bk=128, num_warps=4, num_stages=3, gluon=True), 2, 0, 0),
               (dict(bn=64, bm=128, bk=64, num_warps=4, num_stages=4, gluon=True, prefetch=4), 0, 0, 0),
               (dict(bn=128, bm=256, bk=64, num_warps=8, num_stages=2, gluon=True, split_k=2, prefetch=4), 0, 0, 0),
               (dict(bn=64, bm=128, bk=64, num_warps=4, num_stages=4, gluon=True, prefetch=4), 1, 0, 0),
               # the small-batch tiles the tuner offers at 9-32 rows
               (dict(bn=64, bm=32, bk=64, num_warps=4, num_stages=4, gluon=True, split_k=4, prefetch=4), 0, 0, 0),
               (dict(bn=128, bm=16, bk=128, num_warps=8, num_stages=4, gluon=True, split_k=2), 0, 0, 0),
               # split-K partials summed by each tile's last program (an atomic counter per tile)
               (dict(bn=64, bm=32, bk=64, num_warps=4, num_stages=4, gluon=True, split_k=4, prefetch=4, fixup=True),
                0, 0, 0),
               # grouped with an expert's short last tile split off: the 256-row launch, then the 128-row tiles
               (dict(bn=64, bm=256, bk=64, num_warps=4, num_stages=3, gluon=True, tail_bm=128), 1, 1, 0),
               (dict(bn=64, bm=128, bk=64, num_warps=4, num_stages=4, gluon=True), 1, 2, 256)]


@pytest.mark.parametrize("cfg,mode,tail,bm_main", GLUON_CASES,
                         ids=["bn64bm128", "bn64bm256", "bn128bm256bk128split", "grouped_bn64bm128",
                              "masked_bn64bm128bk128", "bn64bm128pf4", "bn128bm256split_pf4", "grouped_bn64bm128pf4",
                              "bn64bm32split_pf4", "bn128bm16bk128split", "bn64bm32split_fixup",
                              "grouped_bn64bm256_tail1", "grouped_bn64bm128_tail2"])
@pytest.mark.parametrize("fp16", [False, True], ids=["bf16", "fp16"])
def test_sm90_sass_gluon(cfg, mode, tail, bm_main, fp16):
    """The Gluon kernel (dense, grouped with scatter and row scale, masked; weights loaded 2 or 4 K steps
    ahead; grouped launches with an expert's short last tile split off; split K summed in the kernel):
    register-A wgmmas that no instruction overwrites while they may still read them, in the loop or the peeled
    last steps; the decode and scale multiply in registers (no shared-memory store in the loop); no local
    memory; atomics only where the config sums its split-K partials itself, and never in the K loop."""
    r = _compile_in_subprocess(GLUON_SCRIPT, json.dumps(cfg), str(int(fp16)), str(mode), str(tail), str(bm_main))
    assert r["loop_ops"].get("LDL", 0) == 0 and r["loop_ops"].get("STL", 0) == 0, r
    if not (mode == 1 and cfg["bm"] == 256):
        # 256-row grouped tiles (the layer's prefill tiles) spill a few values around their K loop (tile set-up,
        # the scatter and row-scale epilogue), never in it
        assert r["local"] == 0, r
    assert r["hgmma"] > 0 and r["loop_ops"].get("HGMMA", 0) > 0, r
    assert r["loop_ops"].get("HMUL2", 0) > 0, r
    assert r["loop_ops"].get("STS", 0) == 0 and r["loop_ops"].get("STSM", 0) == 0, r
    assert r["hazards"] == [], r["hazards"]
    # fixup: one counter increment and one reset per tile, outside the K loop; no atomics otherwise
    assert r["atoms"] == (2 if cfg.get("fixup") else 0), r
    assert r["loop_ops"].get("ATOMG", 0) == 0, r
