"""Blackwell linear backend on sgl-kernel: our ``scaled_fp4_quant`` (activations to NVFP4, 128x4-swizzled
scales), then sgl-kernel's CUTLASS FP4 tensor-core GEMM ``sgl_kernel.cutlass_scaled_fp4_mm``. It comes after
FlashInfer's ``mm_fp4`` in the linear backends' order (:data:`nvfp4_plugin.layers.LINEAR_BACKENDS`), so it serves
where sgl-kernel is installed and FlashInfer is not. W4A4 checkpoints only (the GEMM multiplies NVFP4
activations); weight-only checkpoints go to FlashInfer's ``mm_bf16_fp4`` or the reference backend.

Which sgl-kernel: the ``sgl-kernel`` package up to 0.3.21 ships this function, its PyPI wheels with sm_100a (and
sm_120a) code and no sm_103a, so this backend claims sm_100 only. Its successor ``sglang-kernel`` (0.4.x, what
SGLang 0.5.17 installs) has no FP4 GEMM any more: SGLang itself calls FlashInfer's ``mm_fp4`` there, and so does
our ``flashinfer_fp4`` backend (FlashInfer comes with SGLang).

What is handed over follows the function's contract (sgl-kernel 0.3.21: ``sgl_kernel/gemm.py`` and the checks of
``csrc/gemm/nvfp4_scaled_mm_kernels.cu``, whose messages its ``sm100/common_ops`` library carries): ``a`` the
activation codes ``[M, K/2]`` uint8 and ``b`` the weight codes ``[N, K/2]`` uint8, both contiguous row-major
(element 2i in the low nibble); ``block_scale_a`` /
``block_scale_b`` float8_e4m3fn, contiguous, 128x4-swizzled, ``[round_up(M, 128), round_up(K/16, 4)]`` and
``[round_up(N, 128), round_up(K/16, 4)]``; ``alpha`` one fp32 value on the device,
``1 / (activation encode scale x weight encode scale)``; K and N multiples of 32; the output ``[M, N]`` in
``out_dtype``.

As in :mod:`.flashinfer_fp4`, each run of weight rows with one encode global scale (fused shards may differ) is
its own GEMM with its own alpha; a run whose row count is not a multiple of 32 is padded at load time with zero
rows (code 0, scale 0), whose output columns are sliced off.

Not run on a Blackwell GPU here: tests/test_sgl_kernel_backend.py checks it on the CPU against an emulator of that
contract, and the bytes handed over against our reference quantizer.
"""

from __future__ import annotations

from ...weights import Nvfp4Weight
from .flashinfer_fp4 import ProviderBackend, join_runs, prepare_w4a4_runs

#: cutlass_scaled_fp4_mm's alignment of N and K (elements)
ALIGN = 32


def sgl_kernel_module():
    """``sgl_kernel`` if importable with ``cutlass_scaled_fp4_mm``, else None (tests put an emulator here)."""
    try:
        import sgl_kernel
    except Exception:  # noqa: BLE001 - any import failure (no package, no CUDA driver) means "not available"
        return None
    return sgl_kernel if hasattr(sgl_kernel, "cutlass_scaled_fp4_mm") else None


class SglKernelLinear(ProviderBackend):
    name = "sgl_kernel_fp4"
    family = "scaled_fp4_quant + sgl-kernel cutlass_scaled_fp4_mm"
    provider = "sgl_kernel"
    archs = ((10, 0),)                  # sgl-kernel's wheels carry no sm_103a code (module docstring)
    entry_point = "cutlass_scaled_fp4_mm"
    install_hint = "pip install 'sgl-kernel<=0.3.21' (sglang-kernel 0.4, SGLang 0.5.17's, has no FP4 GEMM)"

    @staticmethod
    def _module():
        return sgl_kernel_module()

    @classmethod
    def _shape_reason(cls, spec):
        if spec.k % ALIGN:
            return f"cutlass_scaled_fp4_mm needs K % {ALIGN} == 0, got K={spec.k}"
        return None

    def prepare(self, spec, weight: Nvfp4Weight, input_global_scale):
        t, runs = prepare_w4a4_runs(weight, input_global_scale, pad_to=ALIGN)
        return t, (tuple(runs), spec.n, spec.k)

    def apply(self, t, meta, x, bias=None):
        from ... import ops

        runs, n, k = meta
        x2 = x.reshape(-1, k)
        if x2.shape[0] == 0:
            return join_runs([x2.new_empty((0, n))], bias, x.shape[:-1], n)
        sk = sgl_kernel_module()
        q, s = ops.scaled_fp4_quant(x2, t["input_global_scale"], swizzle=True)
        outs = [sk.cutlass_scaled_fp4_mm(q, t[f"w{i}"], s, t[f"sf{i}"], t[f"alpha{i}"], x.dtype)[:, :b - a]
                for i, (a, b) in enumerate(runs)]
        return join_runs(outs, bias, x.shape[:-1], n)
