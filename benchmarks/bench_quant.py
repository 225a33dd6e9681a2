"""Quantization kernels on the GPU: effective bandwidth next to device copy, the pure-torch reference
and the peers' kernels (sgl-kernel, vLLM) when they import, all in one process.

    python3 benchmarks/bench_quant.py --out benchmarks/results            (about 2 minutes on an H200)
    python3 benchmarks/bench_quant.py --quick                            (fewer shapes)
    python3 benchmarks/bench_quant.py --ops nvfp4_dense --m-sizes 8192 32768 --k-sizes 4096   (chosen shapes)

Effective bandwidth = (bytes read + bytes written by the op, counted once) / kernel time. Inputs
rotate over enough copies that each replay reads more than 2 x 60 MB (beyond L2). Times come from
CUDA-graph replays of a chain of calls (no launch or Python overhead; M = 1 is thus the kernel time),
except the reference, which is timed eagerly. A graph holds --calls calls (default 32, cycling the
copies; fewer where they would move more than 4 GiB, never fewer than the copies): each graph launch
costs about 2 us on top of its kernels, which a graph of 2 calls of 20 us each would charge to the
op (H200, 2026-11-26, dense 8192 x 4096: 88.4% of copy in graphs of its 2 copies, 91.9% in graphs of
32 calls; a plain copy of the same bytes 89.0% in graphs of its 3 copies, 91.6% in graphs of 32).
`--calls 0` gives graphs of the copies only. The "same-size copy" column is a copy of the op's bytes
(half read, half written; Tensor.copy_ or torch.neg, the faster), timed the same way: the ceiling at
that size. The compiled kernels launch with programmatic dependent launch
unless NVFP4_PLUGIN_PDL=0, so each replayed call may start while the call before it ends (its wait
still orders it); run once with NVFP4_PLUGIN_PDL=0 for plain stream-order times.
Ops and shapes (M x K, K in {2048, 4096, 7168}):
  nvfp4_dense            scaled_fp4_quant, bf16 [M, K], swizzled e4m3 scales
  nvfp4_dense_linear     same with linear scales (whole 32-B scale sectors per row and CTA step: the
                         diagnostic of csrc/quant/PERF_NOTES.md, "Scale stores: whole 32-byte sectors": partial swizzled sector writes)
  nvfp4_experts          scaled_fp4_experts_quant, M tokens x top-8 rows over E = 256 experts
  nvfp4_masked_silu      silu_and_mul_scaled_fp4_experts_quant, 32 local experts, M x 8 / 32 rows
                         each (max_m), mask ~ 75% full on average, input [32, max_m, 2K], given outputs
  fp8_group              per_token_group_quant_fp8, group 128, fp32 row-major scales
  fp8_group_ue8m0        same, UE8M0 column-major (DeepGEMM) scales
  fp8_token              per_token_quant_fp8
  fp8_tensor_dynamic     scaled_fp8_quant without scale (reads the input twice for M*K > 65536)
Writes a markdown table and JSON (with GPU, torch and commit) to --out.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import COPY_METHODS, device_copy_bandwidth, time_any, time_eager, time_graph  # noqa: E402
from nvfp4_plugin import _ext  # noqa: E402
from nvfp4_plugin import numerics as nx  # noqa: E402
from nvfp4_plugin import reference as ref  # noqa: E402

M_SIZES = (1, 16, 128, 1024, 8192, 32768)
K_SIZES = (2048, 4096, 7168)
L2_BYTES = 60 * 2**20
CALLS = 32  # calls per CUDA graph (--calls)
GRAPH_BYTES = 4 * 2**30  # at most this many bytes moved per graph replay, beyond the copies
TOPK, E_EXPERTS, E_LOCAL = 8, 256, 32


# ------------------------------------------------------------------------------------------------
# Peers (optional)
# ------------------------------------------------------------------------------------------------

def _call_supported(fn, *args, **kwargs):
    params = inspect.signature(fn).parameters
    has_var_kw = any(p.kind == p.VAR_KEYWORD for p in params.values())
    return fn(*args, **{k: v for k, v in kwargs.items() if has_var_kw or k in params})


def load_peers() -> dict:
    """name -> callable(x) for the peers that import on this machine (and why the others do not)."""
    peers, missing = {}, {}
    try:
        import sgl_kernel

        group = getattr(sgl_kernel, "sgl_per_token_group_quant_8bit", None) or sgl_kernel.sgl_per_token_group_quant_fp8

        def sgl_group(x, ue8m0=False):
            m, k = x.shape
            q = torch.empty_like(x, dtype=torch.float8_e4m3fn)
            if ue8m0:
                s = ref.alloc_fp8_group_scales(m, k, 128, column_major=True, scale_ue8m0=True, device=x.device)
            else:
                s = torch.empty((m, k // 128), dtype=torch.float32, device=x.device)
            _call_supported(group, x, q, s, 128, 1e-10, -448.0, 448.0, scale_ue8m0=ue8m0, enable_v2=None)
            return q, s

        def sgl_token(x):
            q = torch.empty_like(x, dtype=torch.float8_e4m3fn)
            s = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
            sgl_kernel.sgl_per_token_quant_fp8(x, q, s)
            return q, s

        peers["sgl_kernel.fp8_group"] = sgl_group
        peers["sgl_kernel.fp8_group_ue8m0"] = lambda x: sgl_group(x, True)
        peers["sgl_kernel.fp8_token"] = sgl_token
    except Exception as exc:  # not installed, or no GPU build for this machine
        missing["sgl_kernel"] = f"{type(exc).__name__}: {exc}"
    try:
        from vllm import _custom_ops as vops

        peers["vllm.fp8_token"] = lambda x: vops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
        peers["vllm.fp8_tensor_dynamic"] = lambda x: vops.scaled_fp8_quant(x)
        try:
            from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

            peers["vllm.fp8_group"] = lambda x: per_token_group_quant_fp8(x, 128, use_ue8m0=False)
        except Exception as exc:
            missing["vllm.fp8_group"] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        missing["vllm"] = f"{type(exc).__name__}: {exc}"
    return {"peers": peers, "missing": missing}


# ------------------------------------------------------------------------------------------------
# Cases
# ------------------------------------------------------------------------------------------------

def make_case(op: str, m: int, k: int, seed: int):
    """(list of argument tuples to rotate over, bytes moved per call, description)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if op == "nvfp4_experts":
        rows = m * TOPK
        ids = torch.randint(0, E_EXPERTS, (rows,), generator=g, device="cuda")
        counts = torch.bincount(ids, minlength=E_EXPERTS)
        eo = torch.zeros(E_EXPERTS + 1, dtype=torch.int32, device="cuda")
        eo[1:] = torch.cumsum(counts, 0)
        bo = nx.blockscale_offsets_from_expert_offsets(eo)
        gs = torch.rand(E_EXPERTS, generator=g, device="cuda") * 100 + 1
        in_bytes = rows * k * 2
        sf_bytes = nx.max_blockscale_rows(rows, E_EXPERTS) * nx.round_up(k // 16, 4)
        moved = in_bytes + rows * k // 2 + sf_bytes
        n = copies(in_bytes)
        args = [(torch.randn(rows, k, generator=g, device="cuda", dtype=torch.bfloat16), gs, eo, bo) for _ in range(n)]
        return args, moved, f"{rows} rows, E={E_EXPERTS}"
    if op == "nvfp4_masked_silu":
        max_m = max(1, math.ceil(m * TOPK / E_LOCAL))
        mask = torch.randint(max_m // 2, max_m + 1, (E_LOCAL,), generator=g, device="cuda", dtype=torch.int32)
        valid = int(mask.sum())
        gs = torch.rand(E_LOCAL, generator=g, device="cuda") * 100 + 1
        out = torch.empty((E_LOCAL, max_m, k // 2), dtype=torch.uint8, device="cuda")
        sf = torch.empty((E_LOCAL, *nx.swizzled_scale_shape(max_m, k // 16)), dtype=torch.float8_e4m3fn, device="cuda")
        moved = valid * (2 * k * 2 + k // 2 + k // 16)
        n = copies(E_LOCAL * max_m * 2 * k * 2)
        args = [(torch.randn(E_LOCAL, max_m, 2 * k, generator=g, device="cuda", dtype=torch.bfloat16), gs, mask,
                 out, sf) for _ in range(n)]
        return args, moved, f"E={E_LOCAL} max_m={max_m} valid={valid}"
    x_bytes = m * k * 2
    n = copies(x_bytes)
    xs = [torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    if op in ("nvfp4_dense", "nvfp4_dense_linear"):
        gs = nx.tensor_global_scale(xs[0]).reshape(1)
        sf = nx.round_up(m, 128) * nx.round_up(k // 16, 4) if op == "nvfp4_dense" else m * (k // 16)
        return [(x, gs) for x in xs], x_bytes + m * k // 2 + sf, ""
    if op in ("fp8_group", "fp8_group_ue8m0"):
        sf = m * k // 128 * 4 if op == "fp8_group" else m * nx.ceil_div(k // 128, 4) * 4
        return [(x,) for x in xs], x_bytes + m * k + sf, ""
    if op == "fp8_token":
        return [(x,) for x in xs], x_bytes + m * k + 4 * m, ""
    if op == "fp8_tensor_dynamic":
        return [(x,) for x in xs], x_bytes + m * k + 4, "reads x twice above 65536 elements"
    raise ValueError(op)


def copies(nbytes: int) -> int:
    return max(2, min(64, math.ceil(2 * L2_BYTES / max(nbytes, 1))))


def graph_calls(case_args: list, moved: int, calls: int) -> list:
    """The argument tuples of one graph: the copies, cycled to `calls` calls (at most GRAPH_BYTES moved)."""
    n = max(len(case_args), min(calls, GRAPH_BYTES // max(moved, 1)))
    return (case_args * math.ceil(n / len(case_args)))[:n]


def same_size_copy(moved: int, calls: int) -> float:
    """Seconds per copy of moved // 2 bytes (read + written = moved), in graphs like the ops': the faster of
    the COPY_METHODS (Tensor.copy_ and torch.neg), as for the device copy. The size is rounded up to
    4 KiB: on the H200 a graph's memcpy of sizes that are not multiples of 256 bytes ran at 2.5-2.7 TB/s
    (4.2 TB/s rounded, and torch.neg either way)."""
    half = max((moved // 2 + 4095) // 4096 * 4096, 4096)
    srcs = [torch.empty(half // 2, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(copies(half))]
    dst = torch.empty_like(srcs[0])
    lst = graph_calls([(s,) for s in srcs], 2 * half, calls)
    t = min(time_graph(lambda s, copy=copy: copy(s, dst), lst) for copy in COPY_METHODS.values())
    del srcs, dst
    return t * moved / (2 * half)


def ours(op: str):
    from nvfp4_plugin import _cuda_ops as c

    return {
        "nvfp4_dense": lambda x, gs: c.scaled_fp4_quant(x, gs),
        "nvfp4_dense_linear": lambda x, gs: c.scaled_fp4_quant(x, gs, swizzle=False),
        "nvfp4_experts": lambda x, gs, eo, bo: c.scaled_fp4_experts_quant(x, gs, eo, bo),
        "nvfp4_masked_silu": lambda x, gs, mask, out, sf: c.silu_and_mul_scaled_fp4_experts_quant(
            x, gs, mask, output=out, output_scale=sf),
        "fp8_group": lambda x: c.per_token_group_quant_fp8(x),
        "fp8_group_ue8m0": lambda x: c.per_token_group_quant_fp8(x, column_major_scales=True, scale_ue8m0=True),
        "fp8_token": lambda x: c.per_token_quant_fp8(x),
        "fp8_tensor_dynamic": lambda x: c.scaled_fp8_quant(x),
    }[op]


def reference_fn(op: str):
    return {
        "nvfp4_dense": lambda x, gs: ref.scaled_fp4_quant(x, gs),
        "nvfp4_dense_linear": lambda x, gs: ref.scaled_fp4_quant(x, gs, swizzle=False),
        "nvfp4_experts": lambda x, gs, eo, bo: ref.scaled_fp4_experts_quant(x, gs, eo, bo),
        "nvfp4_masked_silu": lambda x, gs, mask, out, sf: ref.silu_and_mul_scaled_fp4_experts_quant(
            x, gs, mask, output=out, output_scale=sf),
        "fp8_group": lambda x: ref.per_token_group_quant_fp8(x),
        "fp8_group_ue8m0": lambda x: ref.per_token_group_quant_fp8(x, column_major_scales=True, scale_ue8m0=True),
        "fp8_token": lambda x: ref.per_token_quant_fp8(x),
        "fp8_tensor_dynamic": lambda x: ref.scaled_fp8_quant(x),
    }[op]


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------

def copy_bandwidth() -> float:
    """Device copy ceiling, bytes read + written per second (benchmarks/common.py)."""
    bw, detail = device_copy_bandwidth()
    print("device copy: " + ", ".join(f"{k} {v / 1e12:.2f} TB/s" for k, v in detail.items()))
    return bw


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------

PEER_FOR = {"fp8_group": ("sgl_kernel.fp8_group", "vllm.fp8_group"), "fp8_group_ue8m0": ("sgl_kernel.fp8_group_ue8m0",),
            "fp8_token": ("sgl_kernel.fp8_token", "vllm.fp8_token"), "fp8_tensor_dynamic": ("vllm.fp8_tensor_dynamic",)}
OPS = ("nvfp4_dense", "nvfp4_dense_linear", "nvfp4_experts", "nvfp4_masked_silu", "fp8_group", "fp8_group_ue8m0",
       "fp8_token", "fp8_tensor_dynamic")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--quick", action="store_true", help="M in {1, 128, 8192}, K in {4096, 7168}")
    ap.add_argument("--ops", nargs="*", default=list(OPS), choices=OPS)
    ap.add_argument("--m-sizes", type=int, nargs="+", help=f"M values (default {M_SIZES}; --quick: 1 128 8192)")
    ap.add_argument("--k-sizes", type=int, nargs="+", help=f"K values (default {K_SIZES}; --quick: 4096 7168)")
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--calls", type=int, default=CALLS,
                    help=f"calls per CUDA graph (default {CALLS}; 0: the input copies only)")
    args = ap.parse_args()
    why = _ext.extension_runs_on(torch.device("cuda"))
    if why is not None:
        print(f"nvfp4_plugin._C does not run here: {why}")
        return 1
    m_sizes = args.m_sizes or ((1, 128, 8192) if args.quick else M_SIZES)
    k_sizes = args.k_sizes or ((4096, 7168) if args.quick else K_SIZES)
    loaded = load_peers()
    peers = loaded["peers"]
    copy_bw = copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    print(f"GPU {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}; device copy "
          f"{copy_bw / 1e12:.2f} TB/s (read + write)")
    print(f"peers: {sorted(peers) or 'none'}; missing: {loaded['missing'] or 'none'}")
    rows = []
    same_copy = {}  # bytes moved -> seconds of a same-size copy
    header = (f"{'op':22s} {'M':>6s} {'K':>5s} {'time us':>9s} {'TB/s':>6s} {'% copy':>7s} {'same-size copy':>14s}  "
              "peers / reference")
    print(header)
    for op in args.ops:
        for m in m_sizes:
            for k in k_sizes:
                case_args, moved, note = make_case(op, m, k, seed=m + k)
                case_args = graph_calls(case_args, moved, args.calls)
                t, how = time_any(ours(op), case_args)
                if moved not in same_copy:
                    same_copy[moved] = same_size_copy(moved, args.calls)
                row = {"op": op, "M": m, "K": k, "bytes": moved, "time_s": t, "timing": how, "calls": len(case_args),
                       "tbps": moved / t / 1e12, "pct_copy": 100 * moved / t / copy_bw, "note": note, "peers": {},
                       "same_size_copy_pct": 100 * moved / same_copy[moved] / copy_bw}
                for name in PEER_FOR.get(op, ()):
                    if name in peers:
                        try:
                            pt, phow = time_any(peers[name], case_args)
                            row["peers"][name] = {"time_s": pt, "timing": phow, "pct_copy": 100 * moved / pt / copy_bw}
                        except Exception as exc:
                            row["peers"][name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                if not args.no_reference and m == 8192 and k == 7168:
                    try:
                        rt = time_eager(reference_fn(op), case_args, iters=2)
                        row["reference"] = {"time_s": rt, "speedup": rt / t}
                    except Exception as exc:  # out of memory on the largest shapes, say
                        row["reference"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                    torch.cuda.empty_cache()
                rows.append(row)
                extra = "  ".join(
                    f"{n.split('.')[0]} {p['pct_copy']:.0f}% ({p['time_s'] * 1e6:.1f} us)" if "pct_copy" in p else
                    f"{n}: {p['error']}" for n, p in row["peers"].items())
                if "reference" in row and "speedup" in row["reference"]:
                    extra += f"  reference x{row['reference']['speedup']:.0f}"
                print(f"{op:22s} {m:6d} {k:5d} {t * 1e6:9.2f} {row['tbps']:6.2f} {row['pct_copy']:6.1f}% "
                      f"{row['same_size_copy_pct']:13.1f}%  {extra}", flush=True)
                del case_args
                torch.cuda.empty_cache()
    write_results(args.out, rows, copy_bw, props, loaded["missing"])
    return 0


def write_results(out: Path, rows, copy_bw, props, missing) -> None:
    out.mkdir(parents=True, exist_ok=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
    except Exception:
        commit = "unknown"
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "gpu": props.name,
            "sms": props.multi_processor_count, "torch": torch.__version__, "commit": commit,
            "copy_tbps": copy_bw / 1e12, "command": " ".join(sys.argv), "missing_peers": missing,
            "pdl": os.environ.get("NVFP4_PLUGIN_PDL", "") != "0"}
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    (out / f"quant-{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Quantization kernels, {props.name} ({meta['date']}, commit {commit}, torch {torch.__version__})", "",
             f"Device copy: {copy_bw / 1e12:.2f} TB/s (bytes read + written). Command: `{meta['command']}`. "
             f"Programmatic dependent launch: {'on' if meta['pdl'] else 'off (NVFP4_PLUGIN_PDL=0)'}. "
             "Calls per CUDA graph: the `calls` column.", "",
             "| op | M | K | time (us) | TB/s | % of copy | same-size copy (% of copy) | calls | peers (% of copy, us) "
             "| reference speedup |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        peers = "; ".join(f"{n} {p['pct_copy']:.0f}% {p['time_s'] * 1e6:.1f}" if "pct_copy" in p else f"{n}: error"
                          for n, p in r["peers"].items())
        refs = f"x{r['reference']['speedup']:.0f}" if "speedup" in r.get("reference", {}) else ""
        lines.append(f"| {r['op']} | {r['M']} | {r['K']} | {r['time_s'] * 1e6:.2f} | {r['tbps']:.2f} | "
                     f"{r['pct_copy']:.1f} | {r['same_size_copy_pct']:.1f} | {r['calls']} | {peers} | {refs} |")
    (out / f"quant-{stamp}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / f'quant-{stamp}.md'} and .json")


if __name__ == "__main__":
    sys.exit(main())
