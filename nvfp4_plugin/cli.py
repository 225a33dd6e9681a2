"""The ``nvfp4-plugin`` command line."""

from __future__ import annotations

import argparse
import platform
import sys

import torch


def _gpu_lines() -> list[str]:
    if not torch.cuda.is_available():
        return ["GPU: none visible to torch (CPU only)"]
    lines = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        lines.append(f"GPU {i}: {p.name}, compute capability {p.major}.{p.minor}, "
                     f"{p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
    return lines


def info(args=None) -> int:
    from . import __version__
    from ._ext import extension_status
    from .ops import _registry

    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = "not installed"
    print(f"nvfp4-plugin {__version__}")
    print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), "
          f"triton {triton_version}")
    for line in _gpu_lines():
        print(line)
    st = extension_status()
    if st.loaded:
        print(f"compiled extension: loaded, built for {', '.join(st.archs) or 'unknown archs'}")
    else:
        print(f"compiled extension: not loaded ({st.error})")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    print(f"op backends on {device}:")
    for op in _registry.ops():
        backend, skipped = _registry.select(op, device)
        why = "".join(f"; skipped {n}: {r}" for n, r in skipped)
        print(f"  {op:40s} {backend.name}{why}")
    return 0


def demo(args) -> int:
    """Quantize a deterministic random matrix to NVFP4 and back, and report the error."""
    from . import numerics as nx
    from . import ops

    info()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    x = torch.randn(args.m, args.k, generator=gen).to(device=device, dtype=torch.bfloat16)
    gs = nx.tensor_global_scale(x).reshape(1)
    packed, scales = ops.scaled_fp4_quant(x, gs)
    back = ops.dequantize_fp4(packed, scales, gs, swizzled=True, m=args.m, k=args.k, dtype=torch.float32)
    err = (back - x.float()).norm() / x.float().norm()
    print(f"\ndemo: x[{args.m}, {args.k}] bf16 -> NVFP4 packed {tuple(packed.shape)} uint8 + "
          f"swizzled scales {tuple(scales.shape)} e4m3, global scale {gs.item():.4g}")
    print(f"demo: {x.numel() * 2} bytes -> {packed.numel() + scales.numel() + 4} bytes; "
          f"relative RMS error after dequantize: {err.item():.4f}")
    print(f"demo: first block codes {nx.unpack_fp4(packed[0, :8]).tolist()}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="nvfp4-plugin", description="NVFP4 quantization plugin for vLLM and SGLang")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="versions, GPU, compiled extension, and which backend each op uses here")
    p = sub.add_parser("demo", help="info, then quantize/dequantize a random matrix")
    p.add_argument("--m", type=int, default=256)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return {"info": info, "demo": demo}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
