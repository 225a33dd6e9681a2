"""Which backend and kernel family each layer kind uses on a GPU of a given compute capability, and
whether every kernel it could launch compiles for that GPU: ``nvfp4-plugin info --capability X.Y
[--compile]``. No such GPU is needed (the deployment check before renting one, and CI's).

The layer shapes are a served model's projections (the Llama-3-8B shape and the Qwen3-30B-A3B shape
by default, ``--linear`` / ``--moe`` for others); token counts 1..``max_tokens``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from . import LINEAR_BACKENDS, MOE_BACKENDS
from .base import (ENV_LINEAR_BACKEND, ENV_MOE_BACKEND, LinearSpec, MoeSpec, choose_backend, describe_families,
                   sm)

#: Llama-3-8B (q/k/v, o, gate/up, down) and the attention of Qwen3-30B-A3B.
DEFAULT_LINEAR = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (5120, 2048), (2048, 4096))
#: Qwen3-30B-A3B experts: E, hidden, intermediate, top_k.
DEFAULT_MOE = ((128, 2048, 768, 8),)


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    compiled: int = 0
    failures: list[str] = field(default_factory=list)


def _variant_ranges(cls, spec, max_tokens: int, top_k: int, dev_key: str, sms: int):
    """``(first, last, variant)`` token ranges of what a ``hopper_triton`` layer of ``spec`` launches (MoE:
    ``(up, down)`` pairs); [] for backends whose kernels are torch operations or an external library."""
    if cls.name != "hopper_triton":
        return []
    from ..gemm import plan

    if isinstance(spec, LinearSpec):
        return plan.linear_variants(spec.n, spec.k, max_tokens, dev_key=dev_key, sms=sms, act_dtype=spec.act_dtype)
    return plan.fused_moe_variants(spec.num_experts, spec.hidden, spec.intermediate, top_k, max_tokens,
                                   dev_key=dev_key, sms=sms)


def _families(cls, spec, ranges, max_tokens: int, top_k: int, dev_key: str, sms: int):
    """Kernel-family ranges: from the variant ranges where there are some (one scan of the token counts)."""
    if ranges:
        from ..gemm import plan

        return plan.families(ranges)
    return cls.families(spec, max_tokens, top_k=top_k, dev_key=dev_key, sms=sms)


def plan(capability: tuple[int, int], *, device_name: str | None = None, max_tokens: int = 16384,
         linear=DEFAULT_LINEAR, moe=DEFAULT_MOE, act_dtype: torch.dtype = torch.bfloat16, sms: int = 132,
         compile: bool = False, mode: str | None = None) -> Report:
    """The report of ``nvfp4-plugin info --capability``: per layer shape, the backend chosen on a GPU of
    ``capability`` (and why the ones before it were skipped) and the kernel family of each token
    range; with ``compile``, every distinct kernel variant compiled for ``sm_XYa``."""
    rep = Report()
    from .base import default_mode

    mode = mode or default_mode(capability)
    dev_key = (device_name or "").replace(" ", "_").replace("/", "_") or "none"
    from ..gemm import select

    tuned = bool(select.load_table(dev_key)) if device_name else False
    rep.lines.append(f"GPU: {sm(capability)}a{f' ({device_name})' if device_name else ''}; GEMM configs: "
                     + (f"tuned table {dev_key}.json" if tuned else "heuristics (no tuned table named)")
                     + f"; checkpoint {'with activation scales (w4a4)' if mode == 'w4a4' else 'weight-only or w4a16'}")
    device = torch.device("cuda")
    todo: dict = {}
    for n, k in linear:
        spec = LinearSpec(n, k, act_dtype, mode, device)
        cls, skipped = choose_backend("linear", LINEAR_BACKENDS, spec, ENV_LINEAR_BACKEND, capability)
        ranges = _variant_ranges(cls, spec, max_tokens, 1, dev_key, sms)
        rep.lines.append(f"linear N={n} K={k}: backend {cls.name}"
                         + "".join(f" (skipped {name}: {why})" for name, why in skipped))
        fams = _families(cls, spec, ranges, max_tokens, 1, dev_key, sms)
        rep.lines.append(f"  tokens {describe_families(fams)}")
        for _, _, v in ranges:
            todo.setdefault((v, None, 1), f"linear N={n} K={k}")
    for e, h, i, top_k in moe:
        spec = MoeSpec(e, h, i, act_dtype, mode, device)
        cls, skipped = choose_backend("moe", MOE_BACKENDS, spec, ENV_MOE_BACKEND, capability)
        ranges = _variant_ranges(cls, spec, max_tokens, top_k, dev_key, sms)
        fams = _families(cls, spec, ranges, max_tokens, top_k, dev_key, sms)
        rep.lines.append(f"fused MoE E={e} H={h} I={i} top_k={top_k}: backend {cls.name}"
                         + "".join(f" (skipped {name}: {why})" for name, why in skipped))
        rep.lines.append(f"  tokens {describe_families(fams)}")
        for _, _, (up, down) in ranges:
            todo.setdefault((up, "up", e), f"fused MoE E={e} H={h} I={i} (up)")
            todo.setdefault((down, "down", e), f"fused MoE E={e} H={h} I={i} (down)")
    if not compile:
        return rep
    if not todo:
        rep.lines.append(f"compile: nothing to compile for {sm(capability)}a (the chosen backends run torch "
                         "operations or the kernels FlashInfer and sgl-kernel build or ship themselves)")
        return rep
    from ..gemm import plan as gplan

    t0 = time.perf_counter()
    items = list(todo.items())
    results = compile_isolated([(v, proj, e) for (v, proj, e), _ in items], capability)
    for ((v, proj, e), where), err in zip(items, results):
        if err is None:
            rep.compiled += 1
        else:
            cfg = v[1].to_json() if len(v) > 1 else ""
            rep.failures.append(f"{where}: {gplan.family(v)} {cfg}: {err}"[:400])
    rep.lines.append(f"compile: {rep.compiled} of {len(todo)} kernel variants compiled for {sm(capability)}a in "
                     f"{time.perf_counter() - t0:.1f} s" + (f"; {len(rep.failures)} FAILED" if rep.failures else ""))
    rep.lines += [f"  FAILED {f}" for f in rep.failures]
    return rep


def _encode(item) -> dict:
    v, proj, e = item
    return {"kind": v[0], "cfg": v[1].to_json() if len(v) > 1 else None, "flag": v[2] if len(v) > 2 else None,
            "proj": proj, "e": e}


def _decode(d: dict) -> tuple:
    from ..gemm import W4Config

    v = (d["kind"],) if d["cfg"] is None else (d["kind"], W4Config.from_json(d["cfg"]))
    if d["flag"] is not None:
        v = (*v, d["flag"])
    return v, d["proj"], d["e"]


def compile_isolated(items: list[tuple], capability: tuple[int, int]) -> list[str | None]:
    """Compile each (variant, moe projection, experts) for ``capability`` in a child process: an error
    message per item, or None. A compiler that aborts the process (LLVM's "Cannot select" does) fails
    only the item it was compiling; a fresh child goes on with the rest."""
    import json
    import subprocess
    import sys

    from .. import envs

    env = envs.compile_worker_env()  # compile for the GPU, never for the CPU interpreter
    results: list[str | None] = [None] * len(items)
    start = 0
    while start < len(items):
        payload = json.dumps({"capability": list(capability), "items": [_encode(it) for it in items[start:]]})
        proc = subprocess.run([sys.executable, "-m", "nvfp4_plugin.layers.deploy"], input=payload, env=env,
                              capture_output=True, text=True)
        done = start
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                rec = json.loads(line[7:])
                results[start + rec["i"]] = rec["error"]
                done = start + rec["i"] + 1
        if done < len(items) and proc.returncode != 0:
            tail = [t for t in (proc.stderr or "").strip().splitlines() if t.strip()]
            results[done] = f"the compiler aborted the process (exit {proc.returncode}): {tail[-1] if tail else ''}"
            done += 1
        start = max(done, start + 1)
    return results


def _worker() -> int:
    """Child of :func:`compile_isolated`: items as JSON on stdin, one ``RESULT {...}`` line per item."""
    import json
    import sys

    from ..gemm import plan as gplan

    job = json.loads(sys.stdin.read())
    cap = tuple(job["capability"])
    for i, d in enumerate(job["items"]):
        v, proj, e = _decode(d)
        try:
            gplan.compile_variant(v, cap, moe_proj=proj, num_experts=e)
            err = None
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            msg = [t for t in str(exc).strip().splitlines() if t.strip()]
            err = f"{type(exc).__name__}: {msg[-1] if msg else ''}"
        print("RESULT " + json.dumps({"i": i, "error": err}), flush=True)
    return 0


if __name__ == "__main__":
    import sys

    from .. import envs

    envs.default_gemm_compile_only()
    sys.exit(_worker())
