"""Public entry points of the Hopper FP4-weight GEMMs: validate, allocate, pick a config, launch.

All three take a :class:`~.layout.PackedW4Weight` (from :func:`~.layout.prepack`, once at load time)
and activations of the dtype it was packed for (bf16 or fp16); math is the exact product of the
operands accumulated in fp32 (``w4a16``), or of NVFP4-quantized activations (``w4a4``: quantized
with :func:`nvfp4_plugin.ops.scaled_fp4_quant` and friends exactly as the Blackwell path does).
Nothing here reads device memory on the host: no synchronization, CUDA-graph capturable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging

import torch

from .. import envs
from .. import numerics as nx
from .._checks import check_choice, check_shape, check_tensor
from ..triton.fast_launch import fast
from . import triton_w4 as tk
from .layout import PackedW4Weight
from . import moe_glue
from .moe_glue import moe_combine, moe_routing, silu_and_mul
from .select import TritonWgmmaConfig, W4Config, _num_sms, config_fn, first_sizes, select_config, tail_config

MODES = ("w4a16", "w4a4")
logger = logging.getLogger("nvfp4_plugin")


@functools.lru_cache(maxsize=1)
def _gluon():
    """The Gluon kernel module, or None where it cannot run (interpreter, a Triton without Gluon)."""
    if tk.INTERPRET:
        return None
    try:
        from . import gluon_w4
    except ImportError as exc:      # pragma: no cover - depends on the installed Triton
        logger.info("nvfp4_plugin: Gluon GEMM kernel unavailable (%s); using the Triton kernel", exc)
        return None
    return gluon_w4


def _tma_ok(x2: torch.Tensor) -> bool:
    """A 2-D activation TMA can read: 16-byte aligned base and row stride, unit column stride."""
    return x2.stride(1) == 1 and x2.data_ptr() % 16 == 0 and (x2.stride(0) * x2.element_size()) % 16 == 0


def _tma_ready(x2: torch.Tensor) -> torch.Tensor:
    """``x2``, or a contiguous copy of it (a fresh allocation: aligned) where TMA cannot read it."""
    return x2 if _tma_ok(x2) else x2.clone(memory_format=torch.contiguous_format)


def _unit_stride(v: torch.Tensor | None) -> torch.Tensor | None:
    """``v``, or a contiguous copy of a strided view of a vector (every other entry...): the kernels index
    offsets, indices, row scales and masks as contiguous vectors."""
    return None if v is None else v.contiguous()       # (contiguous() returns v itself when it already is)


def _without_gluon(cfg: W4Config) -> TritonWgmmaConfig:
    """The Triton-kernel config that stands in for a gluon one where Gluon cannot run."""
    return TritonWgmmaConfig(bn=128, bm=min(max(cfg.bm, 16), 128), bk=cfg.bk, split_k=1, num_warps=8,
                             num_stages=max(cfg.num_stages, 3), m_split=cfg.m_split, group_m=cfg.group_m)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def _check_weight(name: str, w: PackedW4Weight, x: torch.Tensor, experts: bool):
    if not isinstance(w, PackedW4Weight):
        raise TypeError(f"{name}: expected a PackedW4Weight (nvfp4_plugin.gemm.prepack), got {type(w).__name__}")
    lay = w.layout
    if experts and len(lay.lead_shape) != 1:
        raise ValueError(f"{name}: expected expert weights [E, N, K], got lead shape {lay.lead_shape}")
    if not experts and lay.lead_shape not in ((), (1,)):
        raise ValueError(f"{name}: expected a 2-D weight [N, K], got lead shape {lay.lead_shape}")
    if x.dtype != lay.act_dtype:
        raise TypeError(f"x: expected dtype {lay.act_dtype} (the weight was packed for it), got {x.dtype}")
    if x.device != w.device:
        raise ValueError(f"x: expected device {w.device} (same as the weight), got {x.device}")
    if x.shape[-1] != lay.k:
        raise ValueError(f"x: expected last dim K={lay.k}, got {x.shape[-1]}")


@contextlib.contextmanager
def _mma_v2_env(cfg: W4Config):
    """mma.sync for token tiles >= 16 needs Triton's DISABLE_MMA_V3 while the kernel compiles."""
    if not (cfg.v2 and cfg.bm >= 16) or tk.INTERPRET:
        yield
        return
    with envs.triton_mma_v2():
        yield


_COUNTERS: dict = {}
#: buffers a larger one replaced: CUDA graphs captured before the growth still hold their addresses
_RETIRED_COUNTERS: list = []


def _counters(device: torch.device, size: int) -> torch.Tensor:
    """Split-K semaphores (int32, zero between calls: the last program of a tile resets its slot).

    One buffer per (device, stream): kernels on one stream run in order, so calls never share a
    slot concurrently; a buffer first needed during CUDA-graph capture lives in the graph's pool. A
    buffer outgrown by a larger call is kept alive, not freed: graphs captured with it replay into it."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < size:
        if buf is not None:
            _RETIRED_COUNTERS.append(buf)
        buf = torch.zeros(max(size, 8192), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


_DUMMIES: dict = {}


def _dummy(device) -> torch.Tensor:
    """Placeholder for pointer arguments a kernel variant never dereferences (cached per device)."""
    key = (device.type, device.index)
    t = _DUMMIES.get(key)
    if t is None:
        t = _DUMMIES[key] = torch.zeros(16, dtype=torch.int32, device=device)
    return t


def _launch(kind_mode: int, x, w: PackedW4Weight, y, cfg: W4Config, m: int, grid, *, aux=None, gather=None,
            scatter=None, row_scale=None, act_scale=None, act_scale_mode: int = 0, bias=None, ws=None, cnt=None,
            stride_xm=0, stride_xe=0, stride_ym=0, stride_ye=0, compact_experts: int = 0):
    lay = w.layout
    if lay.n_pad % cfg.bn:
        # the weight, scale and alpha loads of a tile are unmasked along N: they stay in bounds only
        # when the tile width divides the padded N (layout.N_PAD_MULTIPLE; bn=256 needs N % 256 padding)
        raise ValueError(f"config: bn={cfg.bn} needs the padded N ({lay.n_pad}) to be a multiple of it; "
                         f"use bn <= {lay.n_pad & -lay.n_pad} for N={lay.n}")
    d = _dummy(x.device)
    k = lay.k
    with _mma_v2_env(cfg):
        fast(tk.w4_gemm_kernel)[grid](
            x, w.words, w.scales, w.alpha, bias if bias is not None else d, y,
            aux if aux is not None else d, gather if gather is not None else d,
            scatter if scatter is not None else d, row_scale if row_scale is not None else d,
            act_scale if act_scale is not None else d, ws if ws is not None else d, cnt if cnt is not None else d,
            m, lay.n, k, lay.k_pad, max(compact_experts, 1),
            stride_xm, stride_xe, w.words.stride(0), w.words.stride(1), w.scales.stride(0), w.scales.stride(1),
            w.alpha.stride(0), stride_ym, stride_ye,
            cfg.split_k if kind_mode == 0 else 1, max(cfg.m_split, 1), cfg.group_m,
            MODE=kind_mode, DT=0 if lay.act_dtype == torch.bfloat16 else 1, BN=cfg.bn, BM=cfg.bm, BK=cfg.bk,
            IS_SPLIT=int(kind_mode == 0 and cfg.split_k > 1), V2=int(cfg.v2), USE_ASM=int(not tk.INTERPRET),
            EVEN_K=int(k % cfg.bk == 0), HAS_BIAS=int(bias is not None),
            HAS_GATHER=int(gather is not None), HAS_SCATTER=int(scatter is not None),
            HAS_ROWSCALE=int(row_scale is not None), ACT_SCALE=act_scale_mode, SS=int(cfg.ss),
            COMPACT=int(compact_experts > 0), E_P2=1 << (max(compact_experts, 1) - 1).bit_length(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _fp4_act_decode(q: torch.Tensor, s: torch.Tensor, rows: int, k: int, dtype, *, swizzled: bool,
                    srow: torch.Tensor | None = None) -> torch.Tensor:
    """NVFP4 activations (codes ``[rows, K/2]``, E4M3 scales) -> ``e2m1 * s`` in ``dtype`` (exact)."""
    out = torch.empty((rows, k), dtype=dtype, device=q.device)
    if rows == 0:
        return out
    kb = k // nx.NVFP4_BLOCK_SIZE
    br, bkb = 16, 8
    grid = (triton_cdiv(rows, br), triton_cdiv(kb, bkb))
    fast(tk.fp4_act_decode_kernel)[grid](
        q, s.view(torch.uint8), srow if srow is not None else _dummy(q.device), out, rows, k, q.stride(0),
        s.stride(-2) if not swizzled else 0, out.stride(0), nx.ceil_div(kb, 4),
        SWIZZLED=int(swizzled), HAS_SROW=int(srow is not None), BR=br, BKB=bkb, num_warps=4)
    return out


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _act_scale_inv(gs: torch.Tensor) -> torch.Tensor:
    return (1.0 / gs.float()).reshape(-1).contiguous()


def w4_dequantize(weight: PackedW4Weight, *, apply_alpha: bool = False, act_scale: torch.Tensor | None = None,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[E, N, K]`` (or ``[N, K]``) weight values from the packed form.

    Default: ``e2m1 * s * 2**-8`` in the packed activation dtype, exact (multiply row n by
    ``weight.alpha[..., n] = 2**8 / gs[n]`` to get the weight). ``apply_alpha``: the dequantized
    weight ``e2m1 * s / gs`` itself (times ``act_scale[0]`` if given), rounded once to ``dtype``.
    """
    lay = weight.layout
    num_e = weight.words.shape[0]
    out = torch.empty((num_e, lay.n, lay.k), dtype=dtype or lay.act_dtype, device=weight.device)
    bn, bk = 64, 128
    grid = (triton_cdiv(lay.n, bn), triton_cdiv(lay.k, bk), num_e)
    fast(tk.w4_dequant_kernel)[grid](weight.words, weight.scales, out, weight.alpha,
                                     act_scale if act_scale is not None else _dummy(weight.device), lay.n, lay.k,
                                     weight.words.stride(0), weight.words.stride(1), weight.scales.stride(0),
                                     weight.scales.stride(1), out.stride(0), out.stride(1), weight.alpha.stride(0),
                                     BN=bn, BK=bk, DT=0 if lay.act_dtype == torch.bfloat16 else 1,
                                     USE_ASM=int(not tk.INTERPRET), APPLY_ALPHA=int(apply_alpha),
                                     ACT_SCALE=int(act_scale is not None), num_warps=4)
    return out if lay.lead_shape else out[0]


def _dequant_mm(x2: torch.Tensor, weight: PackedW4Weight, bias, act_scale) -> torch.Tensor:
    """Large-M path: dequantize the exactly representable part of the weight once
    (``e2m1 * s * 2**-8``, no rounding), let cuBLAS accumulate the product in fp32, apply the
    per-row ``2**8 / gs`` (and the activation scale) and the bias, and round once, like the fused kernels.

    One global scale (``layout.alpha_const``) and a bias of the activation dtype: all of it in one
    cuBLAS call (``alpha * acc + bias`` in its fp32 epilogue). Otherwise the fp32 product is scaled and
    rounded by one more pass, never through an fp32 copy per step (the output is 4 bytes per element).
    """
    lay = weight.layout
    w = w4_dequantize(weight).reshape(lay.n, lay.k)
    if not x2.is_cuda:
        y = x2.float() @ w.float().t() * weight.alpha.reshape(-1)[: lay.n]
        if act_scale is not None:
            y = y * act_scale[0]
        return (y + bias.float() if bias is not None else y).to(x2.dtype)
    alpha = lay.alpha_const
    if alpha is not None and act_scale is None and (bias is None or bias.dtype == x2.dtype):
        if bias is None:
            y = torch.empty((x2.shape[0], lay.n), dtype=x2.dtype, device=x2.device)
            return torch.addmm(y, x2, w.t(), beta=0, alpha=alpha, out=y)
        return torch.addmm(bias, x2, w.t(), alpha=alpha)
    y = torch.mm(x2, w.t(), out_dtype=torch.float32)
    row = weight.alpha.reshape(-1)[: lay.n]
    if act_scale is not None:
        y.mul_(row).mul_(act_scale[0])          # the fused kernels' order: (acc * alpha) * act_scale
        row = None
    out = torch.empty(y.shape, dtype=x2.dtype, device=x2.device)
    if bias is None:
        return torch.mul(y, row, out=out) if row is not None else out.copy_(y)
    if row is None:
        return torch.add(y, bias.float(), out=out)
    return torch.addcmul(bias.float(), y, row, out=out)


# ----------------------------------------------------------------------------------------------
# dense
# ----------------------------------------------------------------------------------------------

def w4_linear(x: torch.Tensor, weight: PackedW4Weight, bias: torch.Tensor | None = None, *, mode: str = "w4a16",
              input_global_scale: torch.Tensor | None = None, config: W4Config | None = None) -> torch.Tensor:
    """``y[..., N] = x[..., K] @ dequant(W)^T (+ bias)``.

    ``w4a4``: x is first quantized to NVFP4 with ``input_global_scale`` (encode scale, one fp32 value)
    exactly as :func:`nvfp4_plugin.reference.nvfp4_linear` does. ``config``: force a launch config.
    """
    check_choice("mode", mode, MODES)
    check_tensor("x", x, dtypes=(torch.bfloat16, torch.float16), min_ndim=1)
    _check_weight("weight", weight, x, experts=False)
    lay = weight.layout
    n, k = lay.n, lay.k
    if bias is not None:
        check_tensor("bias", bias, dtypes=(torch.bfloat16, torch.float16, torch.float32), device=x.device)
        check_shape("bias", bias, (n,))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        return torch.empty((*lead, n), dtype=x.dtype, device=x.device)
    act_scale, act_mode = None, 0
    if mode == "w4a4":
        if input_global_scale is None:
            raise ValueError("input_global_scale: required for mode='w4a4'")
        from .. import ops
        q, s = ops.scaled_fp4_quant(x2, input_global_scale, swizzle=False)
        x2 = _fp4_act_decode(q, s, m, k, x.dtype, swizzled=False)
        act_scale, act_mode = _act_scale_inv(input_global_scale), 1
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    cfg = config or select_config("dense", m, n, k, device=x.device)
    if cfg.dequant_mm:      # allocates its own output
        return _dequant_mm(x2, weight, bias, act_scale).reshape(*lead, n)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if cfg.gluon:
        g = _gluon()
        if g is not None:
            g.launch_dense(_tma_ready(x2), weight, y, cfg, _dummy(x.device), bias=bias, act_scale=act_scale,
                           sms=_num_sms(x.device.index), counters=_counters)
            return y.reshape(*lead, n)
        cfg = _without_gluon(cfg)
    n_tiles = triton_cdiv(n, cfg.bn)
    m_tiles = triton_cdiv(m, cfg.bm)
    split = cfg.split_k
    ws = cnt = None
    if split > 1:
        if m_tiles * n_tiles > 1 << 20:
            split = 1
        else:
            ws = torch.empty((split, m, n_tiles * cfg.bn), dtype=torch.float32, device=x.device)
            cnt = _counters(x.device, m_tiles * n_tiles)
    if split != cfg.split_k:
        cfg = dataclasses.replace(cfg, split_k=split)
    grid = (n_tiles * m_tiles * split,)
    _launch(0, x2, weight, y, cfg, m, grid, bias=bias, ws=ws, cnt=cnt, act_scale=act_scale, act_scale_mode=act_mode,
            stride_xm=x2.stride(0), stride_ym=y.stride(0))
    return y.reshape(*lead, n)


def _dense_variant(m: int, lay, cfg: W4Config, sms: int, gluon_mod=False) -> tuple:
    """What :func:`w4_linear` compiles and launches for ``m`` rows under ``cfg`` (its kernel
    variants: configs and compile-time switches; sizes are not specialized on). ``gluon_mod``: the
    Gluon module to plan with (default: the one this process can run, see :func:`_gluon`)."""
    if cfg.dequant_mm:
        return ("dequant_mm",)
    g = (_gluon() if gluon_mod is False else gluon_mod) if cfg.gluon else None
    if g is not None:
        return ("gluon", cfg, g.dense_plan(m, lay, cfg, sms)[0] > 1)
    cfg = _without_gluon(cfg) if cfg.gluon else cfg
    return ("triton", cfg, cfg.split_k > 1)


def _grouped_variant(rows: int, num_e: int, cfg: W4Config, gluon_mod=False) -> tuple:
    """What :func:`w4_grouped` compiles and launches for ``rows`` routed rows over ``num_e`` experts under
    ``cfg`` (``compact``: decode's one slot per possibly active expert). ``gluon_mod`` as in
    :func:`_dense_variant`."""
    compact = _compact_experts(rows, num_e)
    g = (_gluon() if gluon_mod is False else gluon_mod) if cfg.gluon else None
    if g is not None and not compact:
        return ("grouped-gluon", cfg)
    return ("grouped-triton", _without_gluon(cfg) if cfg.gluon else cfg, compact > 0)


def warmup_sizes_linear(weight: PackedW4Weight, max_tokens: int) -> list[int]:
    """Token counts (ascending) whose :func:`w4_linear` calls together launch every kernel variant that
    any count in ``1..max_tokens`` can launch: run them once at start-up and no later call compiles."""
    lay = weight.layout
    sel = config_fn("dense", lay.n, lay.k, device=weight.device)
    sms = _num_sms(weight.device.index if weight.device.type == "cuda" else None)
    return first_sizes(lambda m: _dense_variant(m, lay, sel(m), sms), max_tokens)


def warmup_sizes_fused_moe(w13: PackedW4Weight, w2: PackedW4Weight, top_k: int, max_tokens: int) -> list[int]:
    """Token counts (ascending) whose :func:`w4_fused_moe` calls (``top_k`` experts per token)
    together launch every kernel variant that any count in ``1..max_tokens`` can launch."""
    num_e = w13.layout.lead_shape[0]
    sel13 = config_fn("grouped", w13.layout.n, w13.layout.k, num_e, device=w13.device)
    sel2 = config_fn("grouped", w2.layout.n, w2.layout.k, num_e, device=w2.device)

    def variant(t: int) -> tuple:
        rows = t * top_k
        return (moe_glue.route_class(rows),                 # routing: one program, or per-block kernels
                _grouped_variant(rows, num_e, sel13(rows)), _grouped_variant(rows, num_e, sel2(rows)))

    return first_sizes(variant, max_tokens)


# ----------------------------------------------------------------------------------------------
# grouped by expert offsets
# ----------------------------------------------------------------------------------------------

def _compact_experts(rows: int, num_e: int) -> int:
    """Fewer rows than experts (decode): launch one slot per possibly active expert, each finding its
    expert from the offsets on the device (no host sync); 0 otherwise."""
    return num_e if rows < num_e <= 1024 else 0


def _check_expert_input_scales(input_global_scale, num_e: int, device) -> None:
    """mode='w4a4' of the grouped and masked GEMMs: one fp32 activation encode scale per expert."""
    if input_global_scale is None:
        raise ValueError("input_global_scale: required for mode='w4a4' (one fp32 value per expert)")
    check_tensor("input_global_scale", input_global_scale, dtypes=(torch.float32,), device=device)
    check_shape("input_global_scale", input_global_scale, (num_e,))


def _masked_m_split(cfg: W4Config, max_m: int) -> int:
    return cfg.m_split or max(1, min(16, triton_cdiv(max_m, cfg.bm * 2)))


def _m_split(cfg: W4Config, rows: int, experts: int) -> int:
    if cfg.m_split:
        return cfg.m_split
    per = triton_cdiv(rows, max(1, experts))
    return max(1, min(16, triton_cdiv(2 * per, cfg.bm)))


def w4_grouped(x: torch.Tensor, weight: PackedW4Weight, expert_offsets: torch.Tensor, *,
               gather_idx: torch.Tensor | None = None, scatter_idx: torch.Tensor | None = None,
               gather_pos: torch.Tensor | None = None,
               row_scale: torch.Tensor | None = None, num_out_rows: int | None = None,
               out: torch.Tensor | None = None, mode: str = "w4a16", input_global_scale: torch.Tensor | None = None,
               config: W4Config | None = None) -> torch.Tensor:
    """Grouped GEMM over experts: rows ``r`` in ``[expert_offsets[e], expert_offsets[e+1])`` use ``W[e]``.

    x:              ``[T, K]``; logical row r reads ``x[gather_idx[r]]`` if given, else ``x[r]``.
    weight:         packed ``[E, N, K]``.
    expert_offsets: int32 ``[E+1]`` cumulative row offsets on the device (``expert_offsets[0] == 0``;
                    rows past ``expert_offsets[E]`` are ignored). Never read on the host.
    scatter_idx:    int32 ``[R]``: row r is written to ``out[scatter_idx[r]]`` (else ``out[r]``).
    gather_pos:     with ``gather_idx`` from routing (``R = T * top_k``, row r reads token
                    ``gather_idx[r]``), its inverse: pair ``p = t * top_k + j`` (token t) is row
                    ``gather_pos[p]`` (routing's ``pair_pos``). Where the kernel needs the rows copied
                    into expert order first, the copy then reads each token's row once instead of
                    once per pair (:func:`.moe_glue.spread_rows`).
    row_scale:      fp32 ``[num_out_rows]``: output row d is multiplied by ``row_scale[d]`` (in fp32,
                    before rounding), e.g. the flattened top-k weights with ``scatter_idx = pair id``.
    num_out_rows:   rows of the output (default R, the number of logical rows = len(gather_idx) or T).
    w4a4:           ``input_global_scale`` fp32 ``[E]``, rows quantized with their expert's scale.
    Returns ``out`` ``[num_out_rows, N]`` (allocated if not given; with ``scatter_idx`` rows that no
    logical row targets are zero).
    """
    check_choice("mode", mode, MODES)
    check_tensor("x", x, dtypes=(torch.bfloat16, torch.float16), ndim=2)
    _check_weight("weight", weight, x, experts=True)
    lay = weight.layout
    num_e, n, k = lay.lead_shape[0], lay.n, lay.k
    check_tensor("expert_offsets", expert_offsets, dtypes=(torch.int32,), ndim=1, device=x.device)
    check_shape("expert_offsets", expert_offsets, (num_e + 1,))
    rows = x.shape[0]
    if gather_idx is not None:
        check_tensor("gather_idx", gather_idx, dtypes=(torch.int32,), ndim=1, device=x.device)
        rows = gather_idx.shape[0]
    if scatter_idx is not None:
        check_tensor("scatter_idx", scatter_idx, dtypes=(torch.int32,), device=x.device)
        check_shape("scatter_idx", scatter_idx, (rows,))
    if gather_pos is not None:
        if gather_idx is None:
            raise ValueError("gather_pos: given without gather_idx (it is gather_idx's inverse)")
        check_tensor("gather_pos", gather_pos, dtypes=(torch.int32,), ndim=1, device=x.device)
        check_shape("gather_pos", gather_pos, (rows,))
        if rows and (x.shape[0] == 0 or rows % x.shape[0]):
            raise ValueError(f"gather_pos: expected tokens x top_k rows, a multiple of x's {x.shape[0]} rows, "
                             f"got {rows}")
    n_out = rows if num_out_rows is None else int(num_out_rows)
    if row_scale is not None:
        check_tensor("row_scale", row_scale, dtypes=(torch.float32,), device=x.device)
        check_shape("row_scale", row_scale, (n_out,))
    expert_offsets, gather_idx, scatter_idx, row_scale = map(_unit_stride, (expert_offsets, gather_idx, scatter_idx,
                                                                            row_scale))
    if out is None:
        alloc = torch.zeros if scatter_idx is not None else torch.empty
        out = alloc((n_out, n), dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, dtypes=(x.dtype,), device=x.device)
        check_shape("out", out, (n_out, n))
        if out.stride(1) != 1:
            raise ValueError("out: expected a row-major (stride(1) == 1) tensor")
    if rows == 0 or n_out == 0:
        return out
    act_scale, act_mode = None, 0
    if mode == "w4a4":
        _check_expert_input_scales(input_global_scale, num_e, x.device)
        from .. import ops
        xs = x[gather_idx.long()] if gather_idx is not None else x
        gather_idx = None
        bso = nx.blockscale_offsets_from_expert_offsets(expert_offsets)
        q, s = ops.scaled_fp4_experts_quant(xs, input_global_scale, expert_offsets, bso)
        r_idx = torch.arange(rows, device=x.device, dtype=torch.int64)
        ex = torch.searchsorted(expert_offsets[1:].to(torch.int64).contiguous(), r_idx, right=True).clamp(max=num_e - 1)
        srow = (bso.to(torch.int64)[ex] + r_idx - expert_offsets.to(torch.int64)[ex]).to(torch.int32)
        x = _fp4_act_decode(q, s, rows, k, x.dtype, swizzled=True, srow=srow)
        act_scale, act_mode = _act_scale_inv(input_global_scale), 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = config or select_config("grouped", rows, n, k, num_e, device=x.device)
    ms = _m_split(cfg, rows, num_e)
    compact = _compact_experts(rows, num_e)
    if cfg.gluon:
        g = _gluon()
        if g is not None and not compact:
            if gather_idx is not None:
                # TMA cannot gather rows: copy them into expert order first (at the row counts the Gluon
                # configs are tuned for, the copy costs far less than the Triton kernel's gather loads)
                x = (moe_glue.gather_rows(x, gather_idx) if gather_pos is None
                     else moe_glue.spread_rows(x, gather_pos))
            g.launch_grouped(1, _tma_ready(x), weight, out, cfg, expert_offsets, _dummy(x.device), m=rows, m_split=ms,
                             scatter=scatter_idx, row_scale=row_scale, act_scale=act_scale,
                             tail_cfg=tail_config(cfg))
            return out
        cfg = _without_gluon(cfg)
        ms = _m_split(cfg, rows, num_e)
    grid = (triton_cdiv(n, cfg.bn), (rows if compact else num_e) * ms)
    cfg = dataclasses.replace(cfg, m_split=ms, split_k=1)
    _launch(1, x, weight, out, cfg, rows, grid, aux=expert_offsets, gather=gather_idx, scatter=scatter_idx,
            row_scale=row_scale, act_scale=act_scale, act_scale_mode=act_mode, stride_xm=x.stride(0),
            stride_ym=out.stride(0), compact_experts=compact)
    return out


# ----------------------------------------------------------------------------------------------
# masked
# ----------------------------------------------------------------------------------------------

def w4_masked(x: torch.Tensor, weight: PackedW4Weight, mask: torch.Tensor, *, out: torch.Tensor | None = None,
              mode: str = "w4a16", input_global_scale: torch.Tensor | None = None,
              config: W4Config | None = None) -> torch.Tensor:
    """Masked grouped GEMM (DeepEP low-latency layout): ``y[e, :mask[e]] = x[e, :mask[e]] @ dequant(W[e])^T``.

    x: ``[E, max_m, K]``; mask: int32 ``[E]`` (values above max_m act as max_m). Rows at or past
    ``mask[e]`` of the output are left as they are (uninitialized when ``out`` is not given).
    w4a4: ``input_global_scale`` fp32 ``[E]``.
    """
    check_choice("mode", mode, MODES)
    check_tensor("x", x, dtypes=(torch.bfloat16, torch.float16), ndim=3)
    _check_weight("weight", weight, x, experts=True)
    lay = weight.layout
    num_e, n, k = lay.lead_shape[0], lay.n, lay.k
    check_shape("x", x, (num_e, None, k))
    max_m = x.shape[1]
    check_tensor("mask", mask, dtypes=(torch.int32,), device=x.device)
    check_shape("mask", mask, (num_e,))
    mask = _unit_stride(mask)
    if out is None:
        out = torch.empty((num_e, max_m, n), dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, dtypes=(x.dtype,), device=x.device)
        check_shape("out", out, (num_e, max_m, n))
        if out.stride(2) != 1:
            raise ValueError("out: expected stride(2) == 1")
    if max_m == 0:
        return out
    act_scale, act_mode = None, 0
    if mode == "w4a4":
        _check_expert_input_scales(input_global_scale, num_e, x.device)
        from .. import ops
        q, s = ops.silu_and_mul_scaled_fp4_experts_quant(x, input_global_scale, mask, use_silu_and_mul=False)
        mp = s.shape[1]
        r = torch.arange(num_e * max_m, device=x.device, dtype=torch.int64)
        srow = ((r // max_m) * mp + r % max_m).to(torch.int32)
        x = _fp4_act_decode(q.reshape(num_e * max_m, k // 2), s.reshape(num_e * mp, -1), num_e * max_m, k, x.dtype,
                            swizzled=True, srow=srow).reshape(num_e, max_m, k)
        act_scale, act_mode = _act_scale_inv(input_global_scale), 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = config or select_config("masked", max_m, n, k, num_e, device=x.device)
    ms = _masked_m_split(cfg, max_m)
    if cfg.gluon:
        g = _gluon()
        # x and out as [E * max_m, .] row-major views (TMA rows; one row stride for all experts)
        if (g is not None and x.stride(0) == max_m * x.stride(1) and out.stride(0) == max_m * out.stride(1)
                and _tma_ok(x.view(num_e * max_m, k))):
            g.launch_grouped(2, x.view(num_e * max_m, k), weight, out.view(num_e * max_m, n), cfg, mask,
                             _dummy(x.device), m=max_m, m_split=ms, act_scale=act_scale)
            return out
        cfg = _without_gluon(cfg)
        ms = _masked_m_split(cfg, max_m)
    cfg = dataclasses.replace(cfg, m_split=ms, split_k=1)
    grid = (triton_cdiv(n, cfg.bn), num_e * ms)
    _launch(2, x, weight, out, cfg, max_m, grid, aux=mask, act_scale=act_scale, act_scale_mode=act_mode,
            stride_xm=x.stride(1), stride_xe=x.stride(0), stride_ym=out.stride(1), stride_ye=out.stride(0))
    return out


# ----------------------------------------------------------------------------------------------
# fused MoE built from the grouped GEMM (routing sort, gather, SiLU-and-mul, scatter, combine)
# ----------------------------------------------------------------------------------------------

def w4_fused_moe(x: torch.Tensor, w13: PackedW4Weight, w2: PackedW4Weight, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, *, mode: str = "w4a16", a13_global_scale: torch.Tensor | None = None,
                 a2_global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """NVFP4 MoE with SiLU-and-mul, the numerics of :func:`nvfp4_plugin.reference.nvfp4_fused_moe`.

    ``w13``: packed ``[E, 2I, H]`` (gate rows, then up), ``w2``: packed ``[E, H, I]``; ``topk_ids``
    ``[T, k]``; ``topk_weights`` ``[T, k]``. The up projection reads tokens through the gather index,
    the down projection writes each (token, slot) row in place (scatter), so there are no permute
    copies; the top-k combine is an fp32 sum of the rounded expert outputs in slot order. Routing,
    SiLU-and-mul and the combine are one kernel each (:mod:`.moe_glue`).
    """
    check_tensor("x", x, dtypes=(torch.bfloat16, torch.float16), ndim=2)
    t, h = x.shape
    num_e = w13.layout.lead_shape[0] if w13.layout.lead_shape else 1
    top_k = topk_ids.shape[1]
    check_shape("topk_weights", topk_weights, tuple(topk_ids.shape))
    if topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids: expected {t} rows (one per token), got {topk_ids.shape[0]}")
    if w2.layout.n != h or w2.layout.k * 2 != w13.layout.n:
        raise ValueError(f"w2: expected [E, {h}, {w13.layout.n // 2}], got N={w2.layout.n}, K={w2.layout.k}")
    r = moe_routing(topk_ids, num_e)
    kw13 = dict(mode=mode, input_global_scale=a13_global_scale) if mode == "w4a4" else {}
    hmid = w4_grouped(x, w13, r["expert_offsets"], gather_idx=r["gather_idx"], gather_pos=r["pair_pos"], **kw13)
    act = silu_and_mul(hmid)
    kw2 = dict(mode=mode, input_global_scale=a2_global_scale) if mode == "w4a4" else {}
    # every (token, slot) row is written once (pairs routed outside [0, E) excepted, which the
    # combine skips): no zero fill
    y = torch.empty((t * top_k, h), dtype=x.dtype, device=x.device)
    w4_grouped(act, w2, r["expert_offsets"], scatter_idx=r["scatter_idx"], out=y, **kw2)
    return moe_combine(y, topk_weights, topk_ids, num_e)
