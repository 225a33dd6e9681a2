"""A CPU emulator of ``flashinfer.mm_fp4``'s documented contract (flashinfer-python 0.6.14,
``flashinfer/gemm/gemm_base.py``: ``mm_fp4`` and ``_check_mm_fp4_problem_size``), for testing callers
without a Blackwell GPU.

Written from that contract, independently of nvfp4_plugin's own layout code: the 128x4 scale swizzle
is decoded here from its defining formula (CUTLASS's / cuBLAS's block-scaled layout: a 512-byte tile
per 128 rows x 4 scale columns, row r at ``(r % 32) * 16 + ((r % 128) // 32) * 4``, column at
``c % 4``). Math: exact dequantized operands, an fp32 product, times ``alpha``, rounded once to
``out_dtype`` (the real kernels accumulate in fp32 in another order).
"""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

calls: list[dict] = []        # every call's arguments, for tests to inspect


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _unswizzle(sw: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[rows_pad, cols_pad] swizzled bytes (as stored in memory, row-major) -> [rows, cols] linear bytes."""
    flat = sw.contiguous().view(torch.uint8).reshape(-1)
    col_tiles = sw.shape[1] // 4
    r = torch.arange(rows)[:, None]
    c = torch.arange(cols)[None, :]
    off = ((r // 128) * col_tiles + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    return flat[off]


def _decode_codes(packed: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1, dtype=torch.float32)
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((table[lo.long()], table[hi.long()]), dim=-1).flatten(-2)


def mm_fp4(a, b, a_descale, b_descale, alpha=None, out_dtype=torch.bfloat16, out=None, block_size=16,
           use_8x4_sf_layout=False, backend="auto", use_nvfp4=True, enable_pdl=True):
    # the documented checks
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"mm_fp4 accepts 2d tensors, got {a.shape} and {b.shape}")
    if a.shape[1] != b.shape[0]:
        raise ValueError("K dimension mismatch in mm_fp4")
    if a.dtype != torch.uint8 or b.dtype != torch.uint8:
        raise ValueError(f"a and b must be fp4 packed into uint8, got {a.dtype} and {b.dtype}")
    if a_descale.dtype not in (torch.float8_e4m3fn, torch.uint8) or b_descale.dtype not in (torch.float8_e4m3fn,
                                                                                            torch.uint8):
        raise ValueError("descales must be float8_e4m3fn or uint8")
    if alpha is not None and (alpha.dtype != torch.float32 or alpha.numel() != 1):
        raise ValueError("alpha must be one float32 value")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"Unsupported output dtype: {out_dtype}")
    if not use_nvfp4 or block_size != 16 or use_8x4_sf_layout:
        raise ValueError("emulated: NVFP4 with the 128x4 scale layout only")
    if backend not in ("cutlass", "cudnn", "auto"):
        raise ValueError(f"emulated backends: cutlass, cudnn, auto; got {backend}")
    # layouts: a row-major [M, K/2]; b column-major [K/2, N] (a transposed row-major [N, K/2]);
    # a_descale [round_up(M,128), round_up(K/16,4)] row-major; b_descale its transposed counterpart
    m, kh = a.shape
    n = b.shape[1]
    k = 2 * kh
    kb = k // 16
    if a.stride(1) != 1:
        raise ValueError("a must be row-major (K contiguous)")
    if b.stride(0) != 1:
        raise ValueError("b must be column-major: pass the .T of a row-major [N, K/2] tensor")
    if tuple(a_descale.shape) != (_round_up(m, 128), _round_up(kb, 4)) or a_descale.stride(1) != 1:
        raise ValueError(f"a_descale: expected row-major {(_round_up(m, 128), _round_up(kb, 4))}, got "
                         f"{tuple(a_descale.shape)} strides {a_descale.stride()}")
    if tuple(b_descale.shape) != (_round_up(kb, 4), _round_up(n, 128)) or b_descale.stride(0) != 1:
        raise ValueError(f"b_descale: expected the .T of a row-major {(_round_up(n, 128), _round_up(kb, 4))}, got "
                         f"{tuple(b_descale.shape)} strides {b_descale.stride()}")
    calls.append(dict(a=a, b=b, a_descale=a_descale, b_descale=b_descale, alpha=alpha, out_dtype=out_dtype,
                      backend=backend))
    sa = _unswizzle(a_descale, m, kb).view(torch.float8_e4m3fn).float()
    sb = _unswizzle(b_descale.T, n, kb).view(torch.float8_e4m3fn).float()
    xa = (_decode_codes(a.cpu()).reshape(m, kb, 16) * sa[..., None]).reshape(m, k)
    wb = (_decode_codes(b.T.cpu()).reshape(n, kb, 16) * sb[..., None]).reshape(n, k)
    y = xa.double() @ wb.double().T
    if alpha is not None:
        y = y * float(alpha.reshape(()))
    y = y.float().to(out_dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y
