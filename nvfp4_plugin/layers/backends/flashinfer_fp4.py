"""Blackwell linear backend: our ``scaled_fp4_quant`` (activations to NVFP4, 128x4-swizzled scales), then
FlashInfer's FP4 tensor-core GEMM ``flashinfer.mm_fp4`` (CUTLASS by default, cuDNN by
``NVFP4_PLUGIN_FLASHINFER_MM_BACKEND``). sm_100 / sm_103 (B200 / B300), where FlashInfer ships
these kernels; needs ``flashinfer-python`` (``pip install 'nvfp4-plugin[blackwell]'``) and a checkpoint
with activation scales (W4A4: the GEMM multiplies NVFP4 activations).

What is handed to ``mm_fp4`` follows its documented contract (flashinfer-python 0.6.14,
``flashinfer/gemm/gemm_base.py``): ``a`` the activation codes ``[M, K/2]`` uint8 (element 2i in the
low nibble), ``b`` the weight codes as the transposed view ``[K/2, N]`` of a row-major ``[N, K/2]``
tensor (column-major, as its docstring asks), ``a_descale`` / ``b_descale`` the 128x4-swizzled E4M3
block scales ``[round_up(rows, 128), round_up(K/16, 4)]`` (``b``'s transposed like ``b``),
``alpha = 1 / (activation encode scale x weight encode scale)`` as one fp32 value on the device.

Weights are converted once at load time. Our weights carry one encode global scale per output row
(fused q/k/v or gate/up shards may differ); ``mm_fp4`` takes one ``alpha``, so each run of rows with
the same scale is its own GEMM with its own alpha (exact; one GEMM for the usual checkpoint whose
fused shards share their scale, as ModelOpt exports and ``nvfp4-plugin quantize`` writes by default).

Weight-only checkpoints (W4A16) take :class:`FlashInferW4A16Linear` instead: bf16 activations straight into
FlashInfer's BF16 x FP4 GEMM ``flashinfer.mm_bf16_fp4`` (``flashinfer/gemm/gemm_bf16_fp4.py``), whose weights
``prepare_bf16_fp4_weights`` converts once at load from the same canonical form (codes ``[N, K/2]`` uint8,
128x4-swizzled E4M3 scales, ``alpha`` (1,) fp32 = the weight's decode scale) into its backend's layout
(``cute-dsl`` by default, ``cudnn`` by ``NVFP4_PLUGIN_FLASHINFER_W4A16_BACKEND``); one GEMM per run of rows with
one global scale, as above. Its activations must be bf16 (FlashInfer: "fp16 support is not implemented yet").

Not run on a Blackwell GPU here: tests/test_flashinfer_backend.py checks both on the CPU against emulators of
those contracts, and the bytes handed over against our reference quantizer.
"""

from __future__ import annotations

import torch

from ... import envs
from ... import numerics as nx
from ...weights import Nvfp4Weight
from ..base import Backend

ENV_MM_BACKEND = envs.FLASHINFER_MM_BACKEND
MM_BACKENDS = ("cutlass", "cudnn")
ENV_W4A16_BACKEND = envs.FLASHINFER_W4A16_BACKEND
W4A16_BACKENDS = ("cute-dsl", "cudnn")


def flashinfer_module():
    """``flashinfer`` if importable with ``mm_fp4``, else None (tests put an emulator here)."""
    try:
        import flashinfer
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return flashinfer if hasattr(flashinfer, "mm_fp4") else None


def flashinfer_w4a16_module():
    """``flashinfer`` if importable with ``mm_bf16_fp4`` and ``prepare_bf16_fp4_weights``, else None."""
    fi = flashinfer_module()
    return fi if fi is not None and all(hasattr(fi, f) for f in ("mm_bf16_fp4", "prepare_bf16_fp4_weights")) else None


#: mm_bf16_fp4's cute-dsl kernel: N in tiles of 64 (prepare refuses other N; we pad), K in tiles of 64 or 128
CUTE_DSL_N = 64
CUTE_DSL_K = 64
#: the first cuDNN backend version with the BF16 x FP4 GEMM (FlashInfer's _CUDNN_BF16_FP4_MIN_BACKEND_VERSION)
CUDNN_BF16_FP4_MIN_VERSION = 92301


def w4a16_backend_missing(be: str) -> str | None:
    """Why ``mm_bf16_fp4``'s backend ``be`` cannot run in this environment, or None (checked at selection, so
    a layer never lands on a backend whose every forward would fail)."""
    import importlib.util

    if be == "cute-dsl":
        if importlib.util.find_spec("cutlass") is None:
            return (f"mm_bf16_fp4's cute-dsl backend needs nvidia-cutlass-dsl (pip install nvidia-cutlass-dsl), or "
                    f"set {ENV_W4A16_BACKEND}=cudnn")
        return None
    try:
        import cudnn

        version = cudnn.backend_version()
    except Exception as exc:  # noqa: BLE001 - not installed, or no usable libcudnn
        return f"mm_bf16_fp4's cudnn backend needs cuDNN's Python frontend and library ({type(exc).__name__}: {exc})"
    if version < CUDNN_BF16_FP4_MIN_VERSION:
        return f"mm_bf16_fp4's cudnn backend needs a cuDNN backend >= 9.23.1, found {version}"
    return None


def w4a16_backend() -> str:
    be = envs.flashinfer_w4a16_backend()
    if be not in W4A16_BACKENDS:
        raise ValueError(f"{ENV_W4A16_BACKEND}={be!r}: expected one of {W4A16_BACKENDS}")
    return be


def mm_backend() -> str:
    be = envs.flashinfer_mm_backend()
    if be not in MM_BACKENDS:
        raise ValueError(f"{ENV_MM_BACKEND}={be!r}: expected one of {MM_BACKENDS}")
    return be


def row_runs(global_scale: torch.Tensor) -> list[tuple[int, int]]:
    """``[(first row, end row)]`` of the runs of equal encode global scale (load time, on the host)."""
    gs = global_scale.detach().float().cpu().tolist()
    runs, start = [], 0
    for i in range(1, len(gs) + 1):
        if i == len(gs) or gs[i] != gs[start]:
            runs.append((start, i))
            start = i
    return runs


def pad_rows(codes: torch.Tensor, scales: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A run's codes ``[n, K/2]`` and block scales ``[n, K/16]`` with zero rows (code 0, scale 0) appended up to a
    multiple of ``multiple`` rows, for kernels that tile N; their output columns are sliced off (load time)."""
    pad = -codes.shape[0] % multiple
    if not pad:
        return codes, scales
    return (torch.cat([codes, codes.new_zeros(pad, codes.shape[1])]),
            torch.cat([scales, scales.new_zeros(pad, scales.shape[1])]))


def prepare_w4a4_runs(weight: Nvfp4Weight, input_global_scale: torch.Tensor, pad_to: int = 1) -> tuple[dict, list]:
    """Load time, for the W4A4 GEMMs that take one alpha per call (``mm_fp4``, ``cutlass_scaled_fp4_mm``): per run
    of rows with one encode global scale, its codes ``w{i}`` ``[n, K/2]`` and 128x4-swizzled block scales
    ``sf{i}`` (rows padded with zeros to a multiple of ``pad_to``) and ``alpha{i}`` = 1 / (input encode scale x
    weight encode scale); plus ``input_global_scale`` (1,). Returns the tensors and the runs."""
    in_gs = input_global_scale.reshape(()).float()
    t = {"input_global_scale": in_gs.reshape(1).contiguous()}
    runs = row_runs(weight.global_scale)
    for i, (a, b) in enumerate(runs):
        codes, scales = pad_rows(weight.packed[a:b].contiguous(), weight.block_scale[a:b].contiguous(), pad_to)
        t[f"w{i}"] = codes                                                             # [n_pad, K/2] row-major
        t[f"sf{i}"] = nx.swizzle_blockscale(scales).contiguous()                       # [round_up(n_pad, 128), ..]
        t[f"alpha{i}"] = (1.0 / (in_gs * weight.global_scale[a].float())).reshape(1).contiguous()
    return t, runs


def join_runs(outs: list[torch.Tensor], bias, lead, n: int) -> torch.Tensor:
    """The GEMM outputs of the runs of rows side by side (one compact ``[M, N]``), plus the bias, shaped
    ``[*lead, N]`` like the layer's input."""
    y = outs[0].contiguous() if len(outs) == 1 else torch.cat(outs, dim=1)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*lead, n)


def _row_bytes_reason(entry_point: str, spec) -> str | None:
    """The FlashInfer FP4 GEMMs read 16-byte rows of FP4 codes."""
    if spec.k % 32 or spec.n % 8:
        return f"{entry_point} needs K % 32 == 0 and N % 8 == 0 (16-byte rows), got N={spec.n} K={spec.k}"
    return None


class ProviderBackend(Backend):
    """What the Blackwell backends that call another package's FP4 kernels share (FlashInfer, sgl-kernel): the
    GPUs those packages ship the kernels for, the package importable with the entry point the backend calls,
    NVFP4 activations (W4A4) from bf16 / fp16."""

    archs = ((10, 0), (10, 3))
    #: the package as imported, the function the backend calls, how to install it (named in refusals)
    provider = ""
    entry_point = ""
    install_hint = ""

    @staticmethod
    def _module():
        """The provider's module if importable with :attr:`entry_point`, else None (tests put emulators here)."""
        raise NotImplementedError

    @classmethod
    def unsupported_reason(cls, device, capability=None):
        reason = super().unsupported_reason(device, capability)
        if reason is None and cls._module() is None:
            reason = f"{cls.provider} (with {cls.entry_point}) is not importable: {cls.install_hint}"
        return reason

    @classmethod
    def cannot_implement(cls, spec):
        if spec.act_dtype not in (torch.bfloat16, torch.float16):
            return f"activations must be bf16 or fp16, got {spec.act_dtype}"
        if spec.mode != "w4a4":
            return (f"a weight-only checkpoint (no activation scales): {cls.entry_point.rsplit('.', 1)[-1]} "
                    "multiplies NVFP4 activations; use a calibrated checkpoint")
        return cls._shape_reason(spec)

    @classmethod
    def _shape_reason(cls, spec) -> str | None:
        """Why the provider's kernel cannot take this layer shape, or None."""
        return None


class FlashInferBackend(ProviderBackend):
    """The FlashInfer-backed Blackwell backends."""

    provider = "flashinfer"
    install_hint = "pip install 'nvfp4-plugin[blackwell]'"


class FlashInferLinear(FlashInferBackend):
    name = "flashinfer_fp4"
    family = "scaled_fp4_quant + flashinfer mm_fp4"
    entry_point = "mm_fp4"

    @staticmethod
    def _module():
        return flashinfer_module()

    @classmethod
    def _shape_reason(cls, spec):
        return _row_bytes_reason(cls.entry_point, spec)

    @classmethod
    def families(cls, spec, max_tokens, **kw):
        return [(1, max_tokens, f"{cls.family} ({mm_backend()})")]

    def prepare(self, spec, weight: Nvfp4Weight, input_global_scale):
        t, runs = prepare_w4a4_runs(weight, input_global_scale)
        return t, (tuple(runs), spec.n, spec.k, mm_backend())

    def apply(self, t, meta, x, bias=None):
        from ... import ops

        runs, n, k, be = meta
        fi = flashinfer_module()
        x2 = x.reshape(-1, k)
        q, s = ops.scaled_fp4_quant(x2, t["input_global_scale"], swizzle=True)
        outs = [fi.mm_fp4(q, t[f"w{i}"].T, s, t[f"sf{i}"].T, t[f"alpha{i}"], x.dtype, backend=be)
                for i in range(len(runs))]
        return join_runs(outs, bias, x.shape[:-1], n)


class FlashInferW4A16Linear(FlashInferBackend):
    """Weight-only checkpoints on Blackwell: ``mm_bf16_fp4`` on weights prepared at load (module docstring)."""

    name = "flashinfer_w4a16"
    family = "flashinfer mm_bf16_fp4"
    entry_point = "mm_bf16_fp4"

    @staticmethod
    def _module():
        return flashinfer_w4a16_module()

    @classmethod
    def unsupported_reason(cls, device, capability=None):
        reason = super().unsupported_reason(device, capability)
        return reason if reason is not None else w4a16_backend_missing(w4a16_backend())

    @classmethod
    def cannot_implement(cls, spec):
        if spec.mode != "w4a16":
            return "a checkpoint with activation scales (W4A4): flashinfer_fp4 serves it"
        if spec.act_dtype != torch.bfloat16:
            return f"mm_bf16_fp4 takes bf16 activations only (FlashInfer has no fp16 path yet), got {spec.act_dtype}"
        if w4a16_backend() == "cute-dsl" and spec.k % CUTE_DSL_K:
            return f"mm_bf16_fp4's cute-dsl kernel tiles K by {CUTE_DSL_K}, got K={spec.k}"
        return _row_bytes_reason(cls.entry_point, spec)

    @classmethod
    def families(cls, spec, max_tokens, **kw):
        return [(1, max_tokens, f"{cls.family} ({w4a16_backend()})")]

    def prepare(self, spec, weight: Nvfp4Weight, input_global_scale):
        fi = flashinfer_w4a16_module()
        be = w4a16_backend()
        t = {}
        runs = row_runs(weight.global_scale)
        has_alpha = []
        for i, (a, b) in enumerate(runs):
            alpha = (1.0 / weight.global_scale[a].float()).reshape(1).contiguous()        # the decode scale
            codes, scales = weight.packed[a:b].contiguous(), weight.block_scale[a:b].contiguous()
            if be == "cute-dsl":        # the cute-dsl kernel tiles N by 64
                codes, scales = pad_rows(codes, scales, CUTE_DSL_N)
            w, sf, al = fi.prepare_bf16_fp4_weights(codes, nx.swizzle_blockscale(scales), alpha, backend=be)
            t[f"w{i}"], t[f"sf{i}"] = w, sf
            if al is not None:
                t[f"alpha{i}"] = al
            has_alpha.append(al is not None)
        return t, (tuple(runs), tuple(has_alpha), spec.n, spec.k, be)

    def apply(self, t, meta, x, bias=None):
        runs, has_alpha, n, k, be = meta
        fi = flashinfer_w4a16_module()
        x2 = x.reshape(-1, k)
        if x2.shape[0] == 0:
            return join_runs([x2.new_empty((0, n))], bias, x.shape[:-1], n)
        if not x2.is_contiguous():      # both kernels take a compact [M, K] (cuDNN is handed the pointer alone)
            x2 = x2.contiguous()
        outs = [fi.mm_bf16_fp4(x2, t[f"w{i}"], t[f"sf{i}"], t[f"alpha{i}"] if has_alpha[i] else None,
                               backend=be, out_dtype=x.dtype)[:, :b - a]
                for i, (a, b) in enumerate(runs)]
        return join_runs(outs, bias, x.shape[:-1], n)
