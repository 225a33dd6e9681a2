"""Launch plumbing shared by the Triton kernels: device checks, tile choice, seeds.

Tile shapes follow from the memory system, not from measurement: each program handles a
``BLOCK_M x BLOCK_K`` tile (4096 elements by default, 32 per thread with 4 warps), so every thread
issues its loads (16-byte vectors of bf16) before any arithmetic and the H200 keeps enough bytes in
flight (about 30 KB per SM at 4.3 TB/s and ~0.8 us latency: 8 resident programs of 8 KB each).
``BLOCK_K`` is the largest power of two up to 512 that divides K, so no lane is masked on the
usual shapes. :func:`tile_override` lets the benchmark sweep a few alternatives.
"""

from __future__ import annotations

import contextlib

import torch
import triton

#: Launch options for every kernel: no FMA contraction (the numerics spec fixes each fp32 op) and
#: no flush-to-zero in libdevice (fp32 subnormals are values like any other).
LAUNCH_OPTIONS = {"enable_fp_fusion": False, "enable_reflect_ftz": False}

#: Elements per program on a GPU, and under the interpreter (where each program costs Python
#: overhead, but tests still want several programs per launch to exercise the masking).
TILE_ELEMS = 4096
INTERPRET_TILE_ELEMS = 2048
MAX_BLOCK_K = 512
INTERPRET_MAX_BLOCK_K = 128
NUM_WARPS = 4

_override: dict = {}


def _overrides(kernel: str) -> dict:
    """The launch choices set by :func:`tile_override` for ``kernel`` (else for ``"*"``), or {}."""
    return _override.get(kernel) or _override.get("*") or {}


def interpreting() -> bool:
    """True when our kernels were built for Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    from ._jit_numerics import INTERPRETED

    return INTERPRETED


def interpreter_problem() -> str | None:
    """Why the interpreter cannot run our kernels in this process, or None.

    ``TRITON_INTERPRET`` is read when ``@triton.jit`` functions are defined: if ``triton.language``
    was imported before it was set, Triton's own library functions (``tl.max``'s combine, Philox)
    are compiled-mode objects and every interpreted launch fails.
    """
    if not interpreting():
        return None
    from triton.language import standard

    if isinstance(standard._elementwise_max, triton.runtime.JITFunction):
        return ("triton.language was imported before TRITON_INTERPRET=1 was set; set it before the first "
                "import of triton (e.g. in tests/conftest.py)")
    return None


def check_device(name: str, t: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter."""
    if t.is_cuda:
        return
    if t.device.type == "cpu" and interpreting():
        return
    raise ValueError(f"{name}: expected a CUDA tensor (Triton kernel), got device {t.device}"
                     + ("" if t.device.type != "cpu" else "; set TRITON_INTERPRET=1 to run Triton on CPU"))


def hw_fp8(device: torch.device) -> bool:
    """Hardware fp32->FP8 conversion (``cvt.rn.satfinite.e4m3x2.f32``) exists from sm_89 on."""
    if device.type != "cuda" or interpreting():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def as_kernel_tensor(t: torch.Tensor) -> torch.Tensor:
    """Under the interpreter bf16 travels as raw int16 words: its bf16<->fp32 conversions are wrong
    (truncation, subnormals), so the kernels widen and round bf16 with integer ops there."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 and interpreting() else t


def vector_elems(t: torch.Tensor) -> int:
    """Elements of ``t`` in one 16-byte vector (8 of bf16/fp16, 4 of fp32): the per-thread load width
    of the block tiles (``_jit_numerics.block_cols``)."""
    return 16 // t.element_size()


def _pow2_divisor(k: int, cap: int) -> int:
    b = k & -k
    return min(b, cap)


def tile(kernel: str, k: int, block: int, *, min_block_k: int | None = None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps) for a kernel over rows of length ``k`` with scale blocks of ``block``."""
    interp = interpreting()
    elems = INTERPRET_TILE_ELEMS if interp else TILE_ELEMS
    cap = INTERPRET_MAX_BLOCK_K if interp else MAX_BLOCK_K
    ov = _overrides(kernel)
    elems = ov.get("elems", elems)
    cap = ov.get("max_block_k", cap)
    bk = max(_pow2_divisor(k, cap), block, min_block_k or block)
    bm = max(1, elems // bk)
    warps = ov.get("num_warps", NUM_WARPS)
    return bm, bk, warps


@contextlib.contextmanager
def tile_override(kernel: str = "*", **cfg):
    """Temporarily change the launch choices (keys: ``elems``, ``max_block_k``, ``num_warps``, ``order``, and
    ``philox_rounds``, which changes the random stream: a benchmarking knob only)."""
    old = _override.get(kernel)
    _override[kernel] = cfg
    try:
        yield
    finally:
        if old is None:
            _override.pop(kernel, None)
        else:
            _override[kernel] = old


#: Philox rounds of the stochastic rounding; part of the definition of the stream. 7: Philox4x32-7
#: passes TestU01's BigCrush (Salmon et al., SC'11, "Parallel random numbers: as easy as 1, 2, 3",
#: table 2), which is all the rounding needs (independent, unbiased draws); ``tl.rand`` runs 10 as a
#: safety margin. On the H200 the 3 rounds saved are worth 4-7% of a stochastic quantizer's time
#: (``bench_triton_quant.py`` times the 10-round stream as a what-if).
PHILOX_ROUNDS = 7


def philox_rounds() -> int:
    ov = _override.get("*") or {}
    return ov.get("philox_rounds", PHILOX_ROUNDS)


def resolve_seed(seed) -> int:
    """A Philox key from ``seed`` (an int), or a fresh one from torch's CPU generator (no device sync)."""
    if seed is None:
        return int(torch.randint(0, 2**62, (1,)).item())
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int or None, got {type(seed).__name__}")
    return seed & (2**63 - 1)


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D ``[rows, K]`` tensor whose last dim is contiguous (a copy only if it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[1] > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2


def grid2(rows: int, cols: int, bm: int, bk: int) -> tuple[int, int]:
    return (triton.cdiv(rows, bm), triton.cdiv(cols, bk))


#: Order of the programs of a ``row blocks x K tiles`` launch (which of the two goes on grid axis 0,
#: the one the hardware schedules first). ``"m"`` (the measured
#: default): consecutive row blocks of one K tile, so each program's output is a ``BLOCK_K``-wide strip
#: far from its neighbours' (256 packed bytes per row at K tiles of 512). ``"k"``: row-major,
#: consecutive programs walk one row block's K tiles and the resident programs read and write adjacent
#: memory, as a copy kernel does. Both give the same bytes; the benchmark sweeps both
#: (``tile_override(order=...)``) and the faster one becomes the default once measured.
PROGRAM_ORDER = "m"


#: CUDA's limit on grid axes 1 and 2.
MAX_GRID_Y = 65535


def tile_grid(rows: int, cols: int, bm: int, bk: int, kernel: str = "*") -> tuple[tuple[int, int], int, int, bool]:
    """(2-D grid, row blocks, K tiles, K-fastest) for a kernel that finds its tile with
    ``_jit_numerics.tile_ids``. Grid axis 0 (the one the hardware schedules first) is the fast one;
    an order whose slow axis would exceed the 65535 limit of axis 1 takes the other order."""
    n_m, n_k = grid2(rows, cols, bm, bk)
    ov = _overrides(kernel)
    order = ov.get("order", PROGRAM_ORDER)
    if order not in ("k", "m"):
        raise ValueError(f"order: expected 'k' or 'm', got {order!r}")
    k_fast = order == "k" and n_m <= MAX_GRID_Y
    if not k_fast and n_k > MAX_GRID_Y:  # axis 1 cannot hold the K tiles: they go on axis 0
        if n_m > MAX_GRID_Y:
            raise ValueError(f"x: {rows} x {cols} needs {n_m} x {n_k} tiles of {bm} x {bk}, more than a grid holds")
        k_fast = True
    return ((n_k, n_m) if k_fast else (n_m, n_k)), n_m, n_k, k_fast


__all__ = ["LAUNCH_OPTIONS", "interpreting", "interpreter_problem", "check_device", "hw_fp8", "as_kernel_tensor", "tile", "tile_override", "vector_elems",
           "resolve_seed", "rows_view", "grid2", "tile_grid", "PROGRAM_ORDER"]
