"""Compile the GEMM kernel for sm_90a without a GPU and summarize its SASS (CI and tuning aid).

    NVFP4_PLUGIN_GEMM_COMPILE_ONLY=1 python -m nvfp4_plugin.gemm.inspect_sass --bm 8 --v2 --bk 256
    NVFP4_PLUGIN_GEMM_COMPILE_ONLY=1 python -m nvfp4_plugin.gemm.inspect_sass --gluon --bn 64 --bm 256 --bk 64

Prints registers / shared memory / spills and the instruction mix of the main loop: the decode must
show as LOP3/SHF/HMUL2 feeding HGMMA (wgmma) or HMMA (mma.sync) with no STS/LDS round trip of
decoded values (except ``--ss``, which stores them with STSM as the shared B operand) and no local
memory (LDL/STL).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import subprocess
import tempfile

from .. import envs

envs.default_gemm_compile_only()

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from . import triton_w4 as tk  # noqa: E402
from .select import GluonConfig, TritonMmaConfig, TritonWgmmaConfig, W4Config  # noqa: E402

_SIG = {"x_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*i16", "alpha_ptr": "*fp32", "bias_ptr": "*bf16",
        "y_ptr": "*bf16", "aux_ptr": "*i32", "gather_ptr": "*i32", "scatter_ptr": "*i32", "rowscale_ptr": "*fp32",
        "actscale_ptr": "*fp32", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
        "K_pad": "i32", "NUM_E": "i32", "stride_xm": "i32", "stride_xe": "i32", "stride_qe": "i32", "stride_qn": "i32",
        "stride_se": "i32", "stride_sn": "i32", "stride_ae": "i32", "stride_ym": "i32", "stride_ye": "i32",
        "SPLIT_K": "i32", "M_SPLIT": "i32", "GROUP_M": "i32"}
_DIV16 = {"N", "K", "K_pad", "stride_xm", "stride_xe", "stride_qe", "stride_qn", "stride_se", "stride_sn",
          "stride_ae", "stride_ym", "stride_ye"}


def compile_config(cfg: W4Config, *, mode: int = 0, fp16: bool = False, even_k: bool = True, arch: int = 90,
                   **flags):
    if tk.INTERPRET:
        raise RuntimeError("set NVFP4_PLUGIN_GEMM_COMPILE_ONLY=1 before importing nvfp4_plugin.gemm")
    fn = tk.w4_gemm_kernel
    sig = dict(_SIG)
    if fp16:
        for k in ("x_ptr", "bias_ptr", "y_ptr"):
            sig[k] = "*fp16"
    const = dict(MODE=mode, DT=int(fp16), BN=cfg.bn, BM=cfg.bm, BK=cfg.bk, IS_SPLIT=int(cfg.split_k > 1),
                 V2=int(cfg.v2), USE_ASM=1, EVEN_K=int(even_k), SS=int(cfg.ss),
                 HAS_BIAS=0, HAS_GATHER=0, HAS_SCATTER=0, HAS_ROWSCALE=0, ACT_SCALE=0, COMPACT=0, E_P2=1)
    const.update(flags)
    for k in const:
        sig[k] = "constexpr"
    names = fn.arg_names
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*") or n in _DIV16}
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    with envs.triton_mma_v2() if cfg.v2 and cfg.bm >= 16 else contextlib.nullcontext():
        return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def compile_gluon(cfg: GluonConfig, *, fp16: bool = False, split: bool = False, mode: int = 0, m: int = 256,
                  k: int = 4096, arch: int = 90, tail: int = 0, bm_main: int = 0):
    """The Gluon kernel (:mod:`.gluon_w4`) of a ``gluon=True`` config, compiled for ``sm_{arch}a`` (``mode``
    0 dense, 1 grouped with scatter and row scale, 2 masked; ``tail`` 1 / 2: grouped, the launch of an
    expert's tiles of ``cfg.bm`` rows / of its last rows after tiles of ``bm_main`` rows, in tiles of
    ``cfg.bm``)."""
    import torch
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from . import gluon_w4

    desc = gluon_w4._x_desc(torch.empty(m, k, dtype=torch.float16 if fp16 else torch.bfloat16), cfg.bm, cfg.bk)
    act = "*fp16" if fp16 else "*bf16"
    sig = {"x_desc": mangle_type(desc), "q_ptr": "*i32", "s_ptr": "*i16", "alpha_ptr": "*fp32", "bias_ptr": act,
           "y_ptr": act, "ws_ptr": "*fp32", "cnt_ptr": "*i32", "actscale_ptr": "*fp32", "aux_ptr": "*i32",
           "scatter_ptr": "*i32", "rowscale_ptr": "*fp32", "M": "i32", "N": "i32", "K_pad": "i32",
           "stride_qe": "i32", "stride_qn": "i32", "stride_se": "i32", "stride_sn": "i32", "stride_ae": "i32",
           "stride_ym": "i32", "SPLIT_K": "i32", "M_SPLIT": "i32", "DP_TILES": "i32"}
    const = dict(MODE=mode, BN=cfg.bn, BM=cfg.bm, BK=cfg.bk, STAGES=cfg.num_stages, DT=int(fp16), HAS_BIAS=0,
                 ACT_SCALE=0, IS_SPLIT=int(split and mode == 0), HAS_SCATTER=int(mode == 1),
                 HAS_ROWSCALE=int(mode == 1), PF=cfg.prefetch, TAIL=tail, BM_MAIN=bm_main or cfg.bm,
                 FIXUP=int(split and mode == 0 and cfg.fixup), num_warps=cfg.num_warps)
    for key in const:
        sig[key] = "constexpr"
    fn = gluon_w4.w4_wgmma_kernel
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or n in ("N", "K_pad", "stride_qe", "stride_qn", "stride_se", "stride_sn",
                                                "stride_ae", "stride_ym")}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": cfg.num_warps})


def compile_dequant(*, fp16: bool = False, arch: int = 90):
    """The weight dequantization kernel of the large-M ``dequant_mm`` path, compiled for ``sm_{arch}a``."""
    fn = tk.w4_dequant_kernel
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(q_ptr="*i32", s_ptr="*i16", out_ptr="*fp16" if fp16 else "*bf16", alpha_ptr="*fp32",
               actscale_ptr="*fp32")
    const = dict(BN=64, BK=128, DT=int(fp16), USE_ASM=1, APPLY_ALPHA=0, ACT_SCALE=0)
    for key in const:
        sig[key] = "constexpr"
    src = ASTSource(fn=fn, signature=sig, constexprs=const)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})


def sass_text(compiled) -> str:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def _instructions(sass: str):
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            out.append((int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2).strip())))
    return out


def loops(sass: str):
    """[(n_instructions, Counter of opcodes)] for each backward branch (innermost loops first by size)."""
    ins = _instructions(sass)
    res = []
    for addr, text in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            body = [t for a, t in ins if lo <= a <= addr]
            res.append((len(body), collections.Counter(t.split()[0].split(".")[0] for t in body)))
    return sorted(res, key=lambda r: r[0])


# Opcodes whose first operand is not a register they write.
_NO_DEST = ("HGMMA", "WARPGROUP", "BAR", "DEPBAR", "LDGSTS", "LDGDEPBAR", "BRA", "ST", "STS", "STG", "RED", "ATOM",
            "EXIT", "NOP", "WARPSYNC", "MEMBAR", "FENCE", "CCTL", "ARRIVES", "SYNCS")


def _written_regs(text: str) -> set[int]:
    t = re.sub(r"^@!?U?P\w+\s+", "", text)
    op = t.split()[0]
    if op.split(".")[0] in _NO_DEST or op.startswith(("ISETP", "FSETP", "HSETP", "U")):
        return set()  # predicates and uniform registers are not A operands
    m = re.match(r"R(\d+)\b", t[len(op):].strip())
    if m is None:
        return set()
    parts = op.split(".")
    if op.startswith("LDSM"):  # LDSM.16.M88.4: the last field counts registers
        width = int(parts[-1]) if parts[-1].isdigit() else 1
    elif ".128" in op:
        width = 4
    elif ".64" in op or op.startswith(("IMAD.WIDE", "MOV.64")) or (parts[0] == "CS2R" and ".32" not in op):
        width = 2
    else:
        width = 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def _wgmma_loop_body(sass: str, with_rest: bool = False):
    """(address, instruction) of the innermost loop (a backward branch) that issues wgmmas, or None;
    ``with_rest``: also the instructions after it (the peeled steps and the epilogue), as a pair."""
    ins = _instructions(sass)
    loop = None
    for addr, text in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            span = [t for a, t in ins if lo <= a <= addr]
            # an EXIT inside the span: not a loop but an out-of-line stub (an mbarrier wait retried
            # after the kernel's end) jumping back into the body
            if any(t.startswith("EXIT") for t in span):
                continue
            if any(t.startswith("HGMMA") for t in span) and (loop is None or addr - lo < loop[1] - loop[0]):
                loop = (lo, addr)
    if loop is None:
        return None
    body = [(a, t) for a, t in ins if loop[0] <= a <= loop[1]]
    if with_rest:
        return body, [(a, t) for a, t in ins if a > loop[1]]
    return body


def rs_wgmma_hazards(sass: str) -> list[str] | None:
    """Instructions of the wgmma main loop that write a register which an issued wgmma reads as its A
    operand and may still be reading: in flight are the wgmma groups (closed by ``gsb0``) that no
    ``WARPGROUP.DEPBAR.LE gsb0, N`` has retired yet, across the loop's back edge too (the body is
    walked twice, the second walk from the state the first left), then on into the code after the
    loop (steps peeled off it, the epilogue). Any such write is undefined behaviour (the register race
    of triton-lang/triton#9433). Returns None when the SASS has no loop with register-A wgmmas."""
    found = _wgmma_loop_body(sass, with_rest=True)
    if found is None:
        return None
    body, rest = found

    def a_regs(t: str) -> set[int]:
        m = re.match(r"R(\d+)$", t.split(",")[1].strip())  # A operand: registers, or gdesc (shared memory)
        return set(range(int(m.group(1)), int(m.group(1)) + 4)) if m else set()

    if not any(a_regs(t) for _, t in body if t.startswith("HGMMA")):
        return None
    groups: list[set[int]] = []  # closed groups in flight, oldest first
    cur: set[int] = set()        # wgmmas issued since the last gsb0
    hits = []
    for walk, part in ((0, body), (1, body), (1, rest)):
        for a, t in part:
            if t.startswith("HGMMA"):
                cur |= a_regs(t)
                if "gsb0" in t:
                    groups.append(cur)
                    cur = set()
            elif t.startswith("WARPGROUP.DEPBAR"):
                keep = int(t.split(",")[-1], 16)
                del groups[:max(0, len(groups) - keep)]
            elif walk == 1 and _written_regs(t) & cur.union(*groups):
                hits.append(f"/*{a:04x}*/ {t}")
    return hits


def ss_store_hazards(sass: str) -> list[str] | None:
    """Shared-memory stores (STS/STSM: the decoded B tile of the ``ss`` variant) issued while a wgmma
    of the main loop may still be reading shared memory, i.e. before a ``WARPGROUP.DEPBAR.LE gsb0, 0x0``
    retired every wgmma group, across the back edge too. The single decoded-tile buffer is rewritten
    each K step, so such a store would race with the wgmma reading it. Returns None when the loop has
    no wgmma reading shared memory for both operands, else the offending instructions."""
    body = _wgmma_loop_body(sass)
    if body is None:
        return None
    if not any(t.startswith("HGMMA") and "gdesc" in t.split(",")[1] for _, t in body):
        return None
    inflight, hits = False, []
    for walk in (0, 1):
        for a, t in body:
            if t.startswith("HGMMA"):
                inflight = True
            elif t.startswith("WARPGROUP.DEPBAR") and int(t.split(",")[-1], 16) == 0:
                inflight = False
            elif walk == 1 and inflight and re.match(r"STS(M)?\b", t):
                hits.append(f"/*{a:04x}*/ {t}")
    return hits


def summary(compiled) -> dict:
    sass = sass_text(compiled)
    ops = collections.Counter(t.split()[0].split(".")[0] for _, t in _instructions(sass))
    md = compiled.metadata
    return {"shared": md.shared, "spills": getattr(compiled, "n_spills", None), "regs": getattr(compiled, "n_regs", None),
            "local": ops.get("LDL", 0) + ops.get("STL", 0), "hgmma": ops.get("HGMMA", 0), "hmma": ops.get("HMMA", 0),
            "loops": loops(sass), "rs_wgmma_hazards": rs_wgmma_hazards(sass), "ss_store_hazards": ss_store_hazards(sass)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bn", type=int, default=64)
    ap.add_argument("--bm", type=int, default=16)
    ap.add_argument("--bk", type=int, default=128)
    ap.add_argument("--split-k", type=int, default=1)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--v2", action="store_true")
    ap.add_argument("--ss", action="store_true", help="shared-memory wgmma (tokens as M, bm >= 64)")
    ap.add_argument("--gluon", action="store_true", help="the Gluon kernel (bn/16 warps; --mode 0/1/2 as for the "
                                                          "Triton kernel; --split-k > 1: its split-K epilogue)")
    ap.add_argument("--mode", type=int, default=0)
    ap.add_argument("--prefetch", type=int, default=2, help="gluon: K steps the weights are loaded ahead (2 or 4)")
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--dump", help="write the SASS here")
    a = ap.parse_args(argv)
    if sum((a.v2, a.gluon, a.ss)) > 1 or (a.prefetch != 2 and not a.gluon):
        ap.error("--v2, --gluon and --ss pick one kernel family; --prefetch is a --gluon option")
    common = dict(bn=a.bn, bm=a.bm, bk=a.bk, split_k=a.split_k, num_stages=a.stages)
    if a.gluon:
        cfg = GluonConfig(**common, num_warps=a.bn // 16, prefetch=a.prefetch)
    elif a.v2:
        cfg = TritonMmaConfig(**common, num_warps=a.warps)
    else:
        cfg = TritonWgmmaConfig(**common, num_warps=a.warps, ss=a.ss)
    if a.gluon:
        ck = compile_gluon(cfg, fp16=a.fp16, split=a.split_k > 1, mode=a.mode)
    else:
        ck = compile_config(cfg, mode=a.mode, fp16=a.fp16)
    s = summary(ck)
    if a.dump:
        with open(a.dump, "w") as f:
            f.write(sass_text(ck))
    print(f"{cfg}\nshared={s['shared']} local_mem_instrs={s['local']} HGMMA={s['hgmma']} HMMA={s['hmma']} "
          f"register-A wgmma hazards={s['rs_wgmma_hazards']} shared-B store hazards={s['ss_store_hazards']}")
    for n, c in s["loops"]:
        print(f"  loop: {n} instrs: " + ", ".join(f"{k}={v}" for k, v in c.most_common(14)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
