#!/usr/bin/env python3
"""Host cost of one NVFP4 linear forward outside CUDA graphs: ours against vLLM's Marlin and Humming FP4 GEMMs.

    python3 -m benchmarks.bench_layer_host --out FILE.md           # GPU machine (vLLM bundle: Marlin too)
    python3 -m benchmarks.bench_layer_host --out FILE.md --m 1 2048 --reps 200
    python3 -m benchmarks.bench_layer_host --out FILE.md --shapes "llama8b qkv" --m 1024 --host-profile 1024
    nvfp4-plugin bench layer-host --out FILE.md

vLLM runs a step inside its CUDA graphs only up to its largest captured batch (512 tokens by default);
longer mixed prefill steps run the compiled model eagerly, and every linear layer then pays its Python
and dispatch path on the host. On a small model (SmolLM2-135M: K = 576) the GPU work of a projection is
a few microseconds, so that host path decides the step time. Per layer shape and token count:

* ``eager µs``: wall time per call of back-to-back calls (``--reps`` of them, one sync at the end);
  equal to the GPU time when the GPU is the bottleneck, above it when the host is;
* ``GPU µs``: device time per call in a CUDA graph (no host path), the :func:`common.time_calls` timer;
* ``host µs``: the host's time per call with the GPU kept busy by a spin kernel queued first
  (:func:`common.host_us_per_call`), with the plugin's direct launches of compiled kernels and with every
  launch through Triton's ``kernel[grid]`` (``NVFP4_PLUGIN_FAST_LAUNCH=0``);
* for ours also ``op µs`` / ``apply µs``: the host time of the ``nvfp4_layers::linear`` op and of the
  backend's ``apply`` alone with every kernel launch of the GEMM package stubbed out (pure Python and
  dispatch cost; what ``eager`` minus launches is made of);
* for each peer (vLLM's Marlin and Humming NVFP4 GEMMs, where the vLLM bundle is importable, set up as
  ``bench_gemm`` does): eager, GPU and host µs, the same three timers;
* where ours selects dequantize + cuBLAS (two launches), the same three timers for ours with the fused Gluon
  kernel instead (``select.gluon_heuristic``): whether one launch wins where the step is host-bound.

Without a GPU it times the reference backend on the CPU (a smoke run: the table's form, not numbers
to quote).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (cprofile_calls, host_us_per_call, launch_paths_us, time_calls,  # noqa: E402
                               wall_us_per_call)

#: (name, N, K): SmolLM2-135M's projections (q/k/v fused, o, gate/up fused, down), two Llama-3-8B ones and
#: Qwen3-30B-A3B's attention projections (the dense layers of the MoE model)
SHAPES = (("smollm2 qkv", 960, 576), ("smollm2 o", 576, 576), ("smollm2 gate_up", 3072, 576),
          ("smollm2 down", 576, 1536), ("llama8b qkv", 6144, 4096), ("llama8b down", 4096, 14336),
          ("qwen3moe qkv", 5120, 2048), ("qwen3moe o", 2048, 4096))
DEFAULT_M = (1, 64, 512, 2048)


def _host_us(fn, reps: int, cuda: bool) -> float:
    """Wall µs per call of ``reps`` back-to-back calls, the median of three such loops."""
    return wall_us_per_call(lambda i: fn(), reps, cuda)


@contextlib.contextmanager
def _no_gemm_launches():
    """The GEMM package's kernel launches replaced by allocations of the output: what is left is host code."""
    from nvfp4_plugin.gemm import api as G

    def dequant_mm(x2, weight, bias, act_scale):
        return torch.empty((x2.shape[0], weight.layout.n), dtype=x2.dtype, device=x2.device)

    with mock.patch.object(G, "_launch", lambda *a, **k: None), mock.patch.object(G, "_dequant_mm", dequant_mm), \
            mock.patch.object(G, "_gluon", lambda: None):
        yield


#: the engines' own FP4 GEMMs timed beside ours: bench_gemm's peers ``<name>_or_reason`` (a callable, or None
#: and why not)
PEER_NAMES = ("marlin", "humming")


def _peers():
    from benchmarks import bench_gemm
    return [(name, getattr(bench_gemm, f"{name}_or_reason")) for name in PEER_NAMES]


def _timers(prefix: str, fn, reps: int) -> dict:
    """Eager, CUDA-graph and host µs per call of ``fn()`` (GPU only), keyed ``<prefix>_eager_us`` and so on."""
    return {f"{prefix}_eager_us": _host_us(fn, reps, True), f"{prefix}_gpu_us": time_calls([fn]) * 1e6,
            # few enough calls that their launches never fill the GPU's queue behind the spin kernel
            f"{prefix}_host_us": host_us_per_call(lambda i: fn(), min(reps, 50), True)}


def _fused_alternative(packed, m: int, n: int, k: int, device):
    """Where the selection runs dequantize + cuBLAS (two launches and a weight-sized buffer): the fused Gluon
    kernel of :func:`~nvfp4_plugin.gemm.select.gluon_heuristic` on the same call, ``(label, fn(x))``; else None.
    In host-bound eager steps one launch may beat the pair that is faster on the GPU."""
    from nvfp4_plugin.gemm import select as S
    from nvfp4_plugin.gemm import w4_linear

    if not S.select_config("dense", m, n, k, device=device).dequant_mm:
        return None
    cfg = S.gluon_heuristic(m, n, k, S._num_sms(device.index))
    return cfg.label, lambda x: w4_linear(x, packed, config=cfg)


def measure(shapes, ms, reps: int) -> list[dict]:
    from nvfp4_plugin.gemm import prepack
    from nvfp4_plugin.layers import Nvfp4Linear
    from nvfp4_plugin.weights import Nvfp4Weight

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    rows = []
    for name, n, k in shapes:
        w = Nvfp4Weight.quantize(torch.randn(n, k, device=dev))
        layer = Nvfp4Linear(w)
        packed = prepack(w) if cuda else None     # the peers read it (unpack), never change it
        peers = {name: make(packed) if cuda else (None, "no GPU") for name, make in _peers()}
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            row = {"shape": name, "n": n, "k": k, "m": m, "backend": layer.backend.name,
                   "eager_us": _host_us(lambda: layer(x), reps, cuda)}
            if cuda:
                row["gpu_us"] = time_calls([lambda: layer(x)]) * 1e6
                # few enough calls that their launches never fill the GPU's queue behind the spin kernel
                row["host_us"], row["host_triton_us"] = launch_paths_us(lambda i: layer(x), min(reps, 50), cuda)
                with _no_gemm_launches():
                    row["op_us"] = _host_us(lambda: layer(x), reps, False)
                    row["apply_us"] = _host_us(lambda: layer.backend.apply(layer.tensors, layer.meta, x), reps, False)
                for peer, (fn, why) in peers.items():
                    if fn is None:
                        row[peer] = why
                        continue
                    row.update(_timers(peer, lambda: fn(x), reps))
                alt = _fused_alternative(packed, m, n, k, x.device)
                if alt is not None:
                    row["fused"] = alt[0]
                    row.update(_timers("fused", lambda: alt[1](x), reps))
            else:
                row["op_us"] = row["eager_us"]
                row["apply_us"] = _host_us(lambda: layer.backend.apply(layer.tensors, layer.meta, x), reps, False)
            rows.append(row)
            print(row, flush=True)
    return rows


def host_profiles(shapes, m: int, calls: int = 50, top: int = 20) -> list[str]:
    """cProfile of ours' forward at ``m`` tokens for each shape (the GPU kept busy by a spin kernel): where the
    host time of a projection goes, function by function."""
    from nvfp4_plugin.layers import Nvfp4Linear
    from nvfp4_plugin.weights import Nvfp4Weight

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    md = []
    for name, n, k in shapes:
        layer = Nvfp4Linear(Nvfp4Weight.quantize(torch.randn(n, k, device=dev)))
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        md += [f"## Host profile: {name} ({n} x {k}), {m} tokens, {layer.backend.name}", ""]
        md += cprofile_calls(lambda i: layer(x), calls, cuda, top)
    return md


def table(rows: list[dict]) -> str:
    def f(v):
        return "-" if v is None else f"{v:.1f}"

    peer_cols = [f"{p.capitalize()} eager / GPU / host µs" for p in PEER_NAMES]
    md = ["| shape | N x K | M | backend | eager µs | GPU µs | host µs | host µs, Triton launches | "
          "op µs (no launches) | apply µs (no launches) | ours with the fused kernel instead of dequantize + cuBLAS: "
          "eager / GPU / host µs | " + " | ".join(peer_cols) + " | eager ours / fastest peer |",
          "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|" + "---:|" * (len(PEER_NAMES) + 1)]
    for r in rows:
        cells, eager = [], {}
        for p in PEER_NAMES:
            if f"{p}_eager_us" in r:
                eager[p] = r[f"{p}_eager_us"]
                cells.append(f"{f(r[f'{p}_eager_us'])} / {f(r.get(f'{p}_gpu_us'))} / {f(r.get(f'{p}_host_us'))}")
            else:
                cells.append(r.get(p, "-"))
        best = min(eager, key=eager.get) if eager else None
        ratio = f"{r['eager_us'] / eager[best]:.2f}x ({best})" if best else "-"
        fused = (f"{f(r['fused_eager_us'])} / {f(r.get('fused_gpu_us'))} / {f(r.get('fused_host_us'))} ({r['fused']})"
                 if "fused_eager_us" in r else "-")
        md.append(f"| {r['shape']} | {r['n']} x {r['k']} | {r['m']} | {r['backend']} | {f(r['eager_us'])} | "
                  f"{f(r.get('gpu_us'))} | {f(r.get('host_us'))} | {f(r.get('host_triton_us'))} | "
                  f"{f(r.get('op_us'))} | {f(r.get('apply_us'))} | {fused} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(md)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="markdown file for the table (printed either way)")
    ap.add_argument("--m", type=int, nargs="+", default=list(DEFAULT_M), help="token counts")
    ap.add_argument("--reps", type=int, default=500, help="back-to-back calls per timing loop")
    ap.add_argument("--shapes", nargs="+", default=None, help="subset of the shape names (e.g. 'smollm2 qkv')")
    ap.add_argument("--host-profile", type=int, metavar="TOKENS",
                    help="after the table, a cProfile of ours' forward at TOKENS tokens for each shape")
    a = ap.parse_args(argv)
    shapes = [s for s in SHAPES if a.shapes is None or s[0] in a.shapes]
    with torch.no_grad():
        rows = measure(shapes, a.m, a.reps)
        profiles = host_profiles(shapes, a.host_profile) if a.host_profile else []
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (smoke run)"
    text = (f"# Host cost of one linear forward ({gpu}, {time.strftime('%Y-%m-%d')}, torch {torch.__version__})\n\n"
            f"`python3 benchmarks/bench_layer_host.py {' '.join(sys.argv[1:] if argv is None else argv)}`\n\n"
            + table(rows) + "\n" + ("\n" + "\n".join(profiles) if profiles else ""))
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
