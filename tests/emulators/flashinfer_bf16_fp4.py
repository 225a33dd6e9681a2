"""A CPU emulator of ``flashinfer.prepare_bf16_fp4_weights`` and ``flashinfer.mm_bf16_fp4``'s documented contract
(flashinfer-python 0.6.14, ``flashinfer/gemm/gemm_bf16_fp4.py``), for testing callers without a Blackwell GPU.

``prepare_bf16_fp4_weights(b, b_descale, alpha, backend=...)`` takes the canonical form: ``b`` ``(N, K/2)`` uint8
(element 2i in the low nibble), ``b_descale`` the 128x4-swizzled E4M3 scales (1-D or 2-D, at least
``ceil(N/128) * ceil(K/16/4) * 512`` bytes), ``alpha`` ``(1,)`` fp32 or None; it returns the backend's own
layout, which callers must hand back to ``mm_bf16_fp4`` with the same backend. Here the "prepared" tensors are
copies registered with the backend they were prepared for (the real layouts are the kernels' business), so a
caller that mixes backends, or hands ``mm_bf16_fp4`` anything it did not get from ``prepare``, fails.
The cute-dsl backend's prepare refuses N that is not a multiple of 64 (its 16 x 64 repack tiles), as FlashInfer's
does. ``mm_bf16_fp4(a, b, b_descale, alpha, backend=...)``: ``a`` 2-D bf16 (compact rows),
``out = (a @ dequant(b).T) * alpha``, here
with exact operands and an fp64 product rounded once to ``out_dtype`` (the kernels accumulate in fp32). The
128x4 layout is decoded with the emulator of ``mm_fp4`` (its defining formula, independent of our code).
"""

from __future__ import annotations

import torch

from .flashinfer_mm_fp4 import _decode_codes, _unswizzle

BACKENDS = ("cudnn", "cute-dsl")
#: id of a prepared weight -> (that tensor, backend, N, K); the tensor is held so that its id is not reused by
#: another tensor while it is registered (an id-only key made a later, unrelated tensor look prepared)
prepared: dict[int, tuple[torch.Tensor, str, int, int]] = {}
calls: list[dict] = []


def prepare_bf16_fp4_weights(b, b_descale, alpha=None, *, backend, block_size=16):
    if b.dim() != 2:
        raise ValueError(f"b must be 2-D (N, K/2); got shape {tuple(b.shape)}")
    if b.dtype != torch.uint8:
        raise TypeError(f"b must be uint8; got {b.dtype}")
    k = int(b.shape[1]) * 2
    if k % block_size:
        raise ValueError(f"K={k} must be a multiple of block_size={block_size}")
    n = int(b.shape[0])
    need = ((n + 127) // 128) * ((k // block_size + 3) // 4) * 512
    if b_descale.numel() * b_descale.element_size() < need:
        raise ValueError(f"b_descale has {b_descale.numel() * b_descale.element_size()} bytes, the 128x4 layout "
                         f"for N={n}, K_sf={k // block_size} requires {need}")
    if alpha is not None:
        if alpha.dim() != 1 or alpha.shape[0] != 1:
            raise ValueError(f"alpha must be shape (1,); got {tuple(alpha.shape)}")
        if alpha.dtype != torch.float32:
            raise TypeError(f"alpha must be float32; got {alpha.dtype}")
    if backend not in BACKENDS:
        raise ValueError(f"Unknown backend {backend!r}")
    if backend == "cute-dsl":      # its weight repack (_cute_dsl_pack_fp4_weight): 16 x 64 (K x N) tiles
        if k % 16:
            raise ValueError(f"K must be a multiple of 16 (got K={k})")
        if n % 64:
            raise ValueError(f"N must be a multiple of 64 (got N={n})")
    calls.append(dict(fn="prepare", b=b, b_descale=b_descale, alpha=alpha, backend=backend))
    w = b.clone()
    sf = b_descale.clone().view(torch.uint8).reshape(-1)[:need].clone()
    prepared[id(w)] = (w, backend, n, k)
    return w, sf, None if alpha is None else alpha.clone()


def mm_bf16_fp4(a, b, b_descale, alpha=None, *, backend, out_dtype=None, out=None, block_size=16, enable_pdl=True):
    if a.dim() != 2:
        raise ValueError(f"a must be 2-D (M, K); got shape {tuple(a.shape)}")
    if a.dtype != torch.bfloat16:
        raise TypeError(f"a must be bfloat16; got {a.dtype}.  fp16 support is not implemented yet.")
    if out_dtype is not None and out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype must be bfloat16 or float16; got {out_dtype}")
    if block_size != 16:
        raise ValueError("block_size must be 16 for FP4")
    if id(b) not in prepared or prepared[id(b)][0] is not b:
        raise ValueError("b was not returned by prepare_bf16_fp4_weights")
    _, be, n, k = prepared[id(b)]
    if be != backend:
        raise ValueError(f"b was prepared for backend {be!r}, called with {backend!r}")
    if a.shape[1] != k:
        raise ValueError(f"K mismatch: a has {a.shape[1]}, the weight {k}")
    if not a.is_contiguous():
        raise ValueError(f"a must be compact [M, K] (the kernels take its pointer), got strides {a.stride()}")
    if a.shape[0] == 0:
        raise ValueError("a has no rows (undocumented for the kernels: callers must not hand them 0 rows)")
    calls.append(dict(fn="mm", a=a, b=b, alpha=alpha, backend=backend, out_dtype=out_dtype))
    kb = k // 16
    sb = _unswizzle(b_descale.reshape((n + 127) // 128 * 128, -1), n, kb).view(torch.float8_e4m3fn).float()
    wb = (_decode_codes(b.cpu()).reshape(n, kb, 16) * sb[..., None]).reshape(n, k)
    y = a.double() @ wb.double().T
    if alpha is not None:
        y = y * float(alpha.reshape(()))
    y = y.float().to(out_dtype or a.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y
