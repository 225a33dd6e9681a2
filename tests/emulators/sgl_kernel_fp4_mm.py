"""A CPU emulator of ``sgl_kernel.cutlass_scaled_fp4_mm``'s contract (sgl-kernel 0.4.5: the Python wrapper in
``python/sgl_kernel/gemm.py`` and the argument checks of ``csrc/gemm/nvfp4_scaled_mm_kernels.cu``), for testing
callers without a Blackwell GPU.

Written from that contract: ``a`` ``[M, K/2]`` and ``b`` ``[N, K/2]`` uint8, contiguous; the block scales
float8_e4m3fn, contiguous, padded and 128x4-swizzled to ``[round_up(rows, 128), round_up(K/16, 4)]``; ``alpha``
fp32, contiguous; K and N multiples of 32. The swizzle is decoded by the formula of
:mod:`tests.emulators.flashinfer_mm_fp4` (CUTLASS's block-scaled layout), not by nvfp4_plugin's code. Math: exact
dequantized operands, an fp64 product, times ``alpha``, rounded once to ``out_dtype`` (the real kernel
accumulates in fp32 in another order).
"""

from __future__ import annotations

import torch

from .flashinfer_mm_fp4 import _decode_codes, _round_up, _unswizzle

calls: list[dict] = []        # every call's arguments, for tests to inspect

ALIGN = 32


def _check_input(t: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    if not t.is_contiguous():
        raise RuntimeError(f"{what} must be contiguous")
    if t.dtype != dtype:
        raise RuntimeError(f"Inconsistency of Tensor type: {what} (expected {dtype}, got {t.dtype})")


def cutlass_scaled_fp4_mm(a, b, block_scale_a, block_scale_b, alpha, out_dtype):
    if a.ndim != 2 or b.ndim != 2:
        raise AssertionError("a and b must be matrices")
    _check_input(a, torch.uint8, "a")
    _check_input(b, torch.uint8, "b")
    _check_input(block_scale_a, torch.float8_e4m3fn, "scale_a")
    _check_input(block_scale_b, torch.float8_e4m3fn, "scale_b")
    _check_input(alpha, torch.float32, "alpha")
    if alpha.numel() != 1:
        raise RuntimeError("alpha: one value (the kernel reads alpha[0])")
    if a.shape[1] != b.shape[1]:
        raise RuntimeError(f"a and b shapes cannot be multiplied ({tuple(a.shape)} and {tuple(b.shape)})")
    m, n, k = a.shape[0], b.shape[0], a.shape[1] * 2
    if k % ALIGN:
        raise RuntimeError(f"Expected k to be divisible by {ALIGN}, but got k: {k}")
    if n % ALIGN:
        raise RuntimeError(f"Expected n to be divisible by {ALIGN}, but got b shape: {tuple(b.shape)}")
    kb = k // 16
    if block_scale_a.ndim != 2 or block_scale_b.ndim != 2:
        raise RuntimeError("scale_a and scale_b must be matrices")
    if tuple(block_scale_a.shape) != (_round_up(m, 128), _round_up(kb, 4)):
        raise RuntimeError(f"scale_a must be padded and swizzled to a shape {(_round_up(m, 128), _round_up(kb, 4))}, "
                           f"got {tuple(block_scale_a.shape)}")
    if tuple(block_scale_b.shape) != (_round_up(n, 128), _round_up(kb, 4)):
        raise RuntimeError(f"scale_b must be padded and swizzled to a shape {(_round_up(n, 128), _round_up(kb, 4))}, "
                           f"got {tuple(block_scale_b.shape)}")
    if out_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise RuntimeError("Unsupported output data type of nvfp4 mm")
    calls.append(dict(a=a, b=b, block_scale_a=block_scale_a, block_scale_b=block_scale_b, alpha=alpha,
                      out_dtype=out_dtype))
    sa = _unswizzle(block_scale_a, m, kb).view(torch.float8_e4m3fn).float()
    sb = _unswizzle(block_scale_b, n, kb).view(torch.float8_e4m3fn).float()
    xa = (_decode_codes(a.cpu()).reshape(m, kb, 16) * sa[..., None]).reshape(m, k)
    wb = (_decode_codes(b.cpu()).reshape(n, kb, 16) * sb[..., None]).reshape(n, k)
    y = (xa.double() @ wb.double().T) * float(alpha.reshape(()))
    return y.float().to(out_dtype)
