"""GPTQ for NVFP4 (``nvfp4-plugin quantize --method gptq``): second-order error compensation with the
block scales of the ``mse`` search, in the standard file format.

Objective. For a linear layer with weights ``W [N, K]`` and calibration inputs ``X [T, K]``, minimise the
output error ``||(W - Wq) X^T||^2`` over NVFP4 weights ``Wq``. Its Hessian in each row of ``W`` is
``H = X^T X`` (collected per distinct module input by :mod:`.calibrate`, averaged over tokens; q/k/v
and gate/up read the same input and share one).

Algorithm (GPTQ, Frantar et al. 2022). Columns are quantized left to right; after column ``j`` is
rounded, the error it made is spread over the columns not yet quantized so that the output error,
given what is fixed, is least. With ``U`` the upper Cholesky factor of ``H^-1`` (``U^T U = H^-1``), the
update for column ``j`` is ``W[:, j+1:] -= ((W[:, j] - Wq[:, j]) / U[j, j]) * U[j, j+1:]``. Updates
are applied within a lazy block of ``block_size`` columns at once and to the rest of the matrix when
the block ends (the same arithmetic, fewer passes over memory).

* Damping: ``H + damping * mean(diag H) * I`` (default 1%), which keeps ``H`` positive definite
  whatever the calibration saw. If the Cholesky factorisation still fails, the damping grows tenfold
  (three times at most, with a warning).
* Dead columns (``H_jj == 0``: an input feature calibration never saw) keep their weight and are
  rounded under their block's scale; their row and column of ``H`` are zero, so with the damping they
  neither receive nor pass on any update (zeroing them, as some implementations do, would drop
  weights that inputs outside the calibration text may use).
* ``U`` is computed in float64 on the quantization device from one Cholesky factorisation and one
  triangular inverse: with ``J`` the reversal permutation and ``J H J = L L^T``, ``U = J L^-1 J``
  (the same factor as Cholesky-factorising the explicit inverse, at about half the cost).
* Block scales: when the column loop reaches the first column of a 16-column group, that group's
  E4M3 scale per row is chosen by the ``mse`` rule (:func:`.scale_search.search_block_scales`: the
  candidates within two octaves of round to nearest, least squared error) on the *error-updated*
  weights, each column's error weighted by the damped ``diag(H)`` (so a dead column still counts a
  little), under the group's fixed global scale (the fused group's, as ``rtn`` and ``mse`` use). The
  updated weights can exceed the original amax the global scale came from: the block scale then
  saturates at 448 and the elements at +-6, as the standard recipe does for any value.
* Codes: each value is encoded with :func:`.scale_search._encode`, the recipe's own ``out_scale`` and
  E2M1 round to nearest even (the same encoder ``rtn`` and ``mse`` use), and the value that feeds
  the error is ``(e2m1(code) * s) / gs``, the dequantization of :func:`nvfp4_plugin.reference.dequantize_fp4`,
  so the file reproduces bit for bit the ``Wq`` the algorithm compensated for.
* Act order (off by default): columns are visited in decreasing ``diag(H)``; block scales must still
  cover 16 consecutive columns of the file, so with act order they are fixed before the loop from the
  original weights ("static groups", the same weighted search) and each column is encoded under its
  group's scale when the loop reaches it.

The inputs are those of the unquantized model (one calibration pass for all layers), not of the
layers quantized before (sequential GPTQ), which would need one forward pass per layer.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from .. import numerics as nx
from .scale_search import _encode, _inverse_or_zero, search_block_scales

logger = logging.getLogger("nvfp4_plugin")

#: Damping as a fraction of the mean diagonal of H.
DEFAULT_DAMPING = 0.01
#: Columns per lazy update block (a multiple of the 16-column scale group).
DEFAULT_BLOCK_SIZE = 128
#: Times the damping is multiplied by 10 when the Cholesky factorisation fails.
MAX_DAMPING_RETRIES = 3


@dataclass(frozen=True)
class GptqSettings:
    damping: float = DEFAULT_DAMPING
    block_size: int = DEFAULT_BLOCK_SIZE
    act_order: bool = False

    def __post_init__(self):
        if not self.damping > 0:
            raise ValueError(f"gptq damping (--gptq-damping): expected a fraction of mean diag(H) > 0, "
                             f"got {self.damping}")
        if self.block_size <= 0 or self.block_size % nx.NVFP4_BLOCK_SIZE:
            raise ValueError(f"gptq block_size (--gptq-block-size): expected a positive multiple of "
                             f"{nx.NVFP4_BLOCK_SIZE}, got {self.block_size}")


@dataclass
class HessianFactor:
    """What the column loop needs from ``H`` (computed once per distinct input)."""

    upper: torch.Tensor       # fp32 [K, K], U^T U = (H + damp I)^-1, in the loop's column order
    col_weight: torch.Tensor  # fp32 [K], damped diag(H) in the original column order (the search's weights)
    perm: torch.Tensor | None  # act order: loop position -> column; None: natural order
    damping: float            # the damping fraction that factorised


def inverse_cholesky_upper(h: torch.Tensor) -> torch.Tensor:
    """Upper-triangular ``U`` with ``U^T U = h^-1`` for symmetric positive definite ``h`` (float64 in and
    out). Raises ``torch.linalg.LinAlgError`` if ``h`` is not positive definite."""
    lower, info = torch.linalg.cholesky_ex(h.flip(0, 1))
    if int(info):
        raise torch.linalg.LinAlgError(f"the damped Hessian is not positive definite (leading minor {int(info)})")
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    return torch.linalg.solve_triangular(lower, eye, upper=False).flip(0, 1)


def factor_hessian(h: torch.Tensor, settings: GptqSettings = GptqSettings(), *, name: str = "") -> HessianFactor:
    """Damp ``h [K, K]`` and factorise it (float64 on ``h``'s device)."""
    h64 = h.to(torch.float64)
    diag = h64.diagonal()
    mean = float(diag.mean()) if diag.numel() else 0.0
    # no token at all (or only zeros): any positive damping gives H = damp * I, plain weighted-uniform rounding
    base = mean if mean > 0 else 1.0
    perm = torch.argsort(diag, descending=True, stable=True) if settings.act_order else None
    damping = settings.damping
    for attempt in range(MAX_DAMPING_RETRIES + 1):
        damped = h64.clone()
        damped.diagonal().add_(damping * base)
        col_weight = damped.diagonal().float().clone()
        ordered = damped if perm is None else damped[perm][:, perm]
        try:
            upper = inverse_cholesky_upper(ordered)
        except torch.linalg.LinAlgError:
            if attempt == MAX_DAMPING_RETRIES:
                raise ValueError(f"gptq: the Hessian of {name or 'a module input'} is not positive definite even "
                                 f"with damping {damping:g} of its mean diagonal; raise --gptq-damping "
                                 f"(it was {settings.damping:g})") from None
            logger.warning("nvfp4_plugin: gptq: Cholesky failed for %s with damping %g; retrying with %g",
                           name or "a module input", damping, damping * 10)
            damping *= 10
            continue
        return HessianFactor(upper.float(), col_weight, perm, damping)
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _one_cpu_thread(device: torch.device):
    """The column loop is thousands of small ops touching N values each: on the CPU, intra-op threads
    cost more in synchronisation than they gain (several times slower with 2 threads on a busy 2-core
    machine, even for the scale searches and block updates), so all of it runs on one."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class GptqResult:
    packed: torch.Tensor       # uint8 [N, K/2]
    block_scale: torch.Tensor  # float8_e4m3fn [N, K/16]
    dequantized: torch.Tensor  # fp32 [N, K]: the Wq the error compensation used (= dequantize(packed, scales))


def gptq_quantize(w: torch.Tensor, global_scale: torch.Tensor, factor: HessianFactor,
                  settings: GptqSettings = GptqSettings()) -> GptqResult:
    """NVFP4 codes and block scales of ``w [N, K]`` by GPTQ under the encode ``global_scale`` (one value)."""
    n, k = w.shape
    g = nx.NVFP4_BLOCK_SIZE
    if k % g:
        raise ValueError(f"gptq: K must be a multiple of {g}, got {k}")
    if tuple(factor.upper.shape) != (k, k):
        raise ValueError(f"gptq: Hessian factor shape {tuple(factor.upper.shape)} does not fit K = {k}")
    with _one_cpu_thread(w.device):
        return _gptq_columns(w, global_scale, factor, settings)


def _gptq_columns(w, global_scale, factor: HessianFactor, settings: GptqSettings) -> GptqResult:
    n, k = w.shape
    g = nx.NVFP4_BLOCK_SIZE
    dev = w.device
    gs = global_scale.float().reshape(()).to(dev)
    inv_gs = _inverse_or_zero(gs)
    col_weight = factor.col_weight.to(dev)
    upper = factor.upper.to(dev)
    weights = w.float().clone()
    nb = k // g
    stored = torch.empty((n, nb), dtype=torch.float8_e4m3fn, device=dev)
    if factor.perm is None:
        perm = None
        col_scale = None
    else:                                        # static groups: scales from the original weights, up front
        perm = factor.perm.to(dev)
        stored = search_block_scales(weights, gs, col_weight=col_weight)
        col_scale = stored.float().repeat_interleave(g, dim=1)[:, perm]
        weights = weights[:, perm]
    codes = torch.empty((n, k), dtype=torch.uint8, device=dev)
    deq = torch.empty((n, k), dtype=torch.float32, device=dev)
    bs = settings.block_size
    s = None
    for i1 in range(0, k, bs):
        i2 = min(i1 + bs, k)
        blk = weights[:, i1:i2].clone()
        errs = torch.empty((n, i2 - i1), dtype=torch.float32, device=dev)
        u_blk = upper[i1:i2, i1:i2]
        for j0 in range(0, i2 - i1, g):
            if perm is None:
                # the group's 16 columns lie inside this lazy block and carry every update so far
                scale = search_block_scales(blk[:, j0:j0 + g], gs, col_weight=col_weight[i1 + j0:i1 + j0 + g])
                stored[:, (i1 + j0) // g] = scale[:, 0]
                s = scale[:, 0].float()
            for j in range(j0, j0 + g):
                c = i1 + j
                if perm is not None:
                    s = col_scale[:, c]
                col = blk[:, j]
                code = _encode(col[:, None], s, inv_gs)[:, 0]
                q = (nx.e2m1_decode(code) * s) / gs
                codes[:, c] = code
                deq[:, c] = q
                err = (col - q) / u_blk[j, j]
                errs[:, j] = err
                if j + 1 < i2 - i1:
                    blk[:, j + 1:].addr_(err, u_blk[j, j + 1:], alpha=-1.0)
        if i2 < k:
            weights[:, i2:].addmm_(errs, upper[i1:i2, i2:], alpha=-1.0)
    if perm is not None:
        inv = torch.argsort(perm)
        codes = codes[:, inv]
        deq = deq[:, inv]
    return GptqResult(nx.pack_fp4(codes), stored, deq)
