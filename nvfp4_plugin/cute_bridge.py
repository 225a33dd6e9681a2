"""Our NVFP4 bytes as the operands of the CuTe-DSL block-scaled grouped GEMMs on Blackwell (seed 002).

The seed's bridge quantized BF16 with its own rounding and handed the result to a CuTe-DSL grouped
GEMM. This module keeps its shape (quantize, assemble scales, K-major weights, expert offsets, a
compiled-kernel cache, CUDA-graph safe launches) and replaces its numerics with ours: the bytes are
those of :func:`nvfp4_plugin.ops.scaled_fp4_quant` and its expert variants, and the scale layouts
those of :mod:`nvfp4_plugin.numerics`. Where the seed departed from them, we do not follow it:

* its half-step table rounded 3.5 down to 3 (and 2.5 was not a tie of its own making); ours is round
  to nearest, ties to even, so 3.5 -> 4, 2.5 -> 2, 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 5 -> 4;
* its global scale was the decode multiplier ``amax / 2688``; ours is the encode scale
  ``2688 / amax``, and the decode multipliers a kernel's epilogue wants are computed from it here
  (IEEE fp32 reciprocals, on the device).

Two kernels, one operand contract each, in CuTe DSL's MNKL domain (A ``(M, K, L)`` and B ``(N, K, L)``,
both K-major; FP4 tensors are torch ``float4_e2m1fn_x2`` views of our packed bytes, element 2i in
the low nibble, which is torch's definition of that dtype and CUTLASS's sub-byte order):

``contiguous`` ("2Dx3D", ``ScaledGroupedGemmKernel`` of CUTLASS's CuTe-DSL MoE examples, the seed's)
    ``mat_a`` ``[M, K/2]`` rows grouped by expert; ``offs`` int32 ``[E]``, the cumulative *end*
    offsets (``expert_offsets[1:]``); ``mat_b`` ``[E, K/2, N]`` with strides ``(N*K/2, 1, K/2)``,
    a transposed view of our ``[E, N, K/2]`` weights (no copy); ``scale_a`` ``[R, round_up(K/16, 4)]``
    with expert e's swizzled block from row ``blockscale_offsets[e]`` (the kernel recomputes those
    offsets on the device as prefix sums of ``round_up(tokens_e, 128)``; ``R`` is the routing-free
    bound :func:`~nvfp4_plugin.numerics.max_blockscale_rows`); ``scale_b`` ``[E, round_up(N, 128) *
    round_up(K/16, 4)]``, each expert swizzled; ``global_scale_a`` / ``global_scale_b`` fp32 ``[E]``,
    decode multipliers (the epilogue computes ``acc * global_scale_a[e] * global_scale_b[e]``).
``masked`` (FlashInfer's ``grouped_gemm_nt_masked`` kernel, ``MaskedBatchedMatmulCuteDSL``)
    ``a`` ``(max_m, K/2, E)`` view of ``[E, max_m, K/2]``; ``b`` ``(N, K/2, E)`` view of ``[E, N, K/2]``;
    ``sfa`` / ``sfb`` ``[E, round_up(rows, 128), round_up(K/16, 4)]`` swizzled per expert (the
    kernel rebuilds the ``(32, 4, rest, 4, rest_k, E)`` atom layout over the pointer); ``masked_m``
    int32 ``[E]``; ``alpha`` fp32 ``[E]`` = ``1 / (gs_a[e] * gs_w[e])``; ``out`` ``(max_m, N, E)`` view
    of ``[E, max_m, N]``.

Everything up to the GEMM call is plain torch (it runs, and is tested, on the CPU): quantization,
scale assembly, strides, offsets, cache keys. The GEMM call is :func:`run_grouped_gemm`, which
imports ``cutlass`` (``nvidia-cutlass-dsl``) lazily and runs only on sm_100a / sm_103a. It is CUDA
graph safe: no ``.item()``, no host synchronization, and every allocation's size follows from
shapes, never from routing; kernels compile once per :class:`KernelKey` (call
:func:`run_grouped_gemm` once outside capture to warm up: a compile during capture raises).

What is verified where:
    CPU, tests/test_cute_bridge.py: the float4 view's bytes are our reference quantizer's, every E2M1
    tie, the scales equal numerics' swizzle (2D activation side at the block-scale offsets, 3D weight
    side), strides and shapes against the contracts above, the offsets, the cache (one compile per
    key, compile mocked), no host synchronization (tensors that raise on ``.item()``). Where
    ``nvidia-cutlass-dsl`` is installed: the DSL's own scale-factor layout
    (``cutlass.utils.blockscaled_layout.tile_atom_to_shape_SF``) against our swizzle, byte offset by
    byte offset, and FlashInfer's masked kernel compiled ahead of time for sm_100a with no GPU
    (:func:`compile_masked_gemm_aot`; its SASS has the block-scaled ``UTCOMMA`` MMAs).
    CPU, tests/engines/test_cute_bridge_contract.py (installed flashinfer-python): its CPU
    scale-factor helpers (``_unswizzle_sf_128x4``; ``convert_sf_to_mma_layout`` where the DSL is
    installed) read our layouts, and the masked kernel's constructor and launch signature, read from
    its source, take our call.
    B200 only (the ``sm100`` tests): the launches themselves, against the reference, eager and in a
    CUDA graph.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import numerics as nx
from . import ops
from ._checks import check_shape, check_tensor
from .weights import Nvfp4Weight

SF_VEC_SIZE = nx.NVFP4_BLOCK_SIZE
FLOAT4 = torch.float4_e2m1fn_x2
#: Where the contiguous kernel (``ScaledGroupedGemmKernel``) is imported from: CUTLASS ships it with
#: its CuTe-DSL examples (``examples/python/CuTeDSL``, put on ``sys.path``), not in the wheel.
CONTIGUOUS_KERNEL_MODULES = ("blackwell.kernel.moe.torch_scaled_grouped_mm",
                             "cutedsl.kernel.moe.torch_scaled_grouped_mm")
MASKED_KERNEL_MODULE = "flashinfer.gemm.kernels.grouped_gemm_masked_blackwell"
#: The seed's MMA tile K for the contiguous kernel (a multiple of 4 * SF_VEC_SIZE).
CONTIGUOUS_MMA_TILE_K = 256
_ARCHS = {(10, 0): "sm_100a", (10, 3): "sm_103a"}


# ------------------------------------------------------------------------------------------------
# float4_e2m1fn_x2 views of our bytes
# ------------------------------------------------------------------------------------------------

def as_float4(packed: torch.Tensor) -> torch.Tensor:
    """Our packed E2M1 bytes (uint8, element 2i in the low nibble) as torch ``float4_e2m1fn_x2``.

    A view, same shape and strides: torch defines the dtype with ``val0`` in bits 3:0 and ``val1``
    in bits 7:4 of each byte, which is our packing."""
    if packed.dtype == FLOAT4:
        return packed
    check_tensor("packed", packed, dtypes=(torch.uint8,))
    return packed.view(FLOAT4)


def as_packed_bytes(t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`as_float4` (a view)."""
    if t.dtype == torch.uint8:
        return t
    check_tensor("t", t, dtypes=(FLOAT4,))
    return t.view(torch.uint8)


def decode_global_scale(global_scale: torch.Tensor) -> torch.Tensor:
    """Encode global scales (``2688 / amax``, ours) -> the decode multipliers ``1 / gs`` (fp32,
    correctly rounded, on the device)."""
    return nx.fp32_div(1.0, global_scale.float())


def quantize_to_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | None = None):
    """``x[..., K]`` (K a multiple of 16) -> ``(float4 [..., K/2], float8_e4m3fn [..., K/16], gs)``.

    The seed's ``quantize_to_nvfp4`` with our numerics: ``gs`` is the *encode* scale, the tensor's
    dynamic one (computed on the device, no host sync) unless given. Scales are linear; assemble
    them with :func:`swizzle_weight_scales` or :func:`assemble_activation_scales`.
    """
    check_tensor("x", x, min_ndim=1)
    gs = nx.tensor_global_scale(x) if global_scale is None else global_scale
    k = x.shape[-1]
    packed, scales = ops.scaled_fp4_quant(x.reshape(-1, k), gs, swizzle=False)
    lead = tuple(x.shape[:-1])
    return as_float4(packed.reshape(*lead, k // 2)), scales.reshape(*lead, k // SF_VEC_SIZE), gs


# ------------------------------------------------------------------------------------------------
# Weight side (load time): K-major B, per-expert swizzled scales
# ------------------------------------------------------------------------------------------------

def swizzle_weight_scales(block_scale: torch.Tensor) -> torch.Tensor:
    """Linear ``[E, N, K/16]`` -> ``[E, round_up(N, 128), round_up(K/16, 4)]``, each expert swizzled
    (numerics' 128x4 layout, zero padding): the 3D side of the seed's scale assembly."""
    check_tensor("block_scale", block_scale, dtypes=(torch.float8_e4m3fn,), ndim=3)
    return nx.swizzle_blockscale(block_scale)


@dataclass(frozen=True)
class CuteGroupedWeights:
    """Expert weights for both kernels, converted once at load time.

    packed:        uint8 ``[E, N, K/2]``, contiguous: K is the contiguous dim (K-major B).
    scale:         float8_e4m3fn ``[E, round_up(N, 128), round_up(K/16, 4)]``, swizzled per expert.
    global_scale:  fp32 ``[E]``, encode scale of each expert.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor

    def __post_init__(self):
        check_tensor("packed", self.packed, dtypes=(torch.uint8,), ndim=3)
        e, n, k = self.num_experts, self.n, self.k
        if not self.packed.is_contiguous():
            raise ValueError(f"packed: expected a contiguous [E, N, K/2] tensor (K-major), got strides "
                             f"{tuple(self.packed.stride())}")
        check_tensor("scale", self.scale, dtypes=(torch.float8_e4m3fn,), device=self.packed.device)
        check_shape("scale", self.scale, (e, *nx.swizzled_scale_shape(n, k // SF_VEC_SIZE)))
        check_tensor("global_scale", self.global_scale, dtypes=(torch.float32,), device=self.packed.device)
        check_shape("global_scale", self.global_scale, (e,))

    @property
    def num_experts(self) -> int:
        return self.packed.shape[0]

    @property
    def n(self) -> int:
        return self.packed.shape[1]

    @property
    def k(self) -> int:
        return self.packed.shape[2] * 2

    def mat_b(self) -> torch.Tensor:
        """Contiguous kernel's B (torch ``scaled_grouped_mm`` convention): float4 ``[E, K/2, N]``,
        strides ``(N*K/2, 1, K/2)``, a view."""
        return as_float4(self.packed).transpose(1, 2)

    def b_nkl(self) -> torch.Tensor:
        """Masked kernel's B in the MNKL domain: float4 ``(N, K/2, E)``, strides ``(K/2, 1, N*K/2)``."""
        return as_float4(self.packed).permute(1, 2, 0)

    def scale_b(self) -> torch.Tensor:
        """Contiguous kernel's SFB: ``[E, round_up(N, 128) * round_up(K/16, 4)]``, a view."""
        return self.scale.reshape(self.num_experts, -1)

    def decode_global_scale(self) -> torch.Tensor:
        return decode_global_scale(self.global_scale)


def prepare_weights(weight: Nvfp4Weight) -> CuteGroupedWeights:
    """Our internal weight ``[E, N, K]`` -> :class:`CuteGroupedWeights` (load time).

    Both kernels take one global scale per expert: rows of one expert with different global scales
    (fused shards) are refused here, naming the expert; rescale them first. This check reads values
    (a host synchronization), which is fine at load time and never happens in a forward.
    """
    if not isinstance(weight, Nvfp4Weight):
        raise TypeError(f"weight: expected an Nvfp4Weight, got {type(weight).__name__}")
    if len(weight.lead_shape) != 1:
        raise ValueError(f"weight: expected expert weights [E, N, K], got lead shape {weight.lead_shape}")
    gs = weight.global_scale
    per_expert = gs[:, 0].contiguous()
    differs = (gs != per_expert[:, None]).any(dim=1)
    if bool(differs.any()):
        bad = differs.nonzero().flatten().tolist()
        raise ValueError(f"weight.global_scale: the CuTe-DSL grouped GEMMs take one global scale per expert; "
                         f"experts {bad} have rows with different scales (rescale their block scales first)")
    return CuteGroupedWeights(weight.packed.contiguous(), swizzle_weight_scales(weight.block_scale), per_expert)


# ------------------------------------------------------------------------------------------------
# Activation side, contiguous layout: rows grouped by expert (expert offsets)
# ------------------------------------------------------------------------------------------------

def kernel_offsets(expert_offsets: torch.Tensor) -> torch.Tensor:
    """Our ``expert_offsets[E+1]`` (leading 0) -> the kernel's ``offs[E]`` int32 cumulative end
    offsets. Device arithmetic only."""
    check_tensor("expert_offsets", expert_offsets, dtypes=(torch.int32, torch.int64), ndim=1)
    return expert_offsets[1:].to(torch.int32).contiguous()


def kernel_padded_offsets(offs: torch.Tensor) -> torch.Tensor:
    """What the contiguous kernel computes on the device from ``offs``: the end row of each expert's
    scale block, ``cumsum(round_up(tokens_e, 128))``. Ours, ``blockscale_offsets[1:]``, must equal
    it (the tests check that); kept here as the kernel contract in torch."""
    counts = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
    rt = nx.SWIZZLE_ROW_TILE
    return torch.cumsum((counts + rt - 1) // rt * rt, 0).to(torch.int32)


def assemble_activation_scales(linear_scales: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    """Linear ``[M, K/16]`` activation scales of rows grouped by expert -> the 2D side of the scale
    assembly: ``[max_blockscale_rows(M, E), round_up(K/16, 4)]``, expert e's rows swizzled from row
    ``blockscale_offsets[e]``, zero elsewhere.

    The same bytes as the scales of :func:`nvfp4_plugin.ops.scaled_fp4_experts_quant` (which does it
    in one pass); this form is for scales that were computed unswizzled. Routing stays on the
    device: no host sync, and the size depends only on ``M`` and ``E``."""
    check_tensor("linear_scales", linear_scales, dtypes=(torch.float8_e4m3fn,), ndim=2)
    check_tensor("expert_offsets", expert_offsets, dtypes=(torch.int32, torch.int64), ndim=1,
                 device=linear_scales.device)
    m, kb = linear_scales.shape
    e = expert_offsets.shape[0] - 1
    rows = nx.max_blockscale_rows(m, e)
    offsets = expert_offsets.to(torch.int64)
    bs_offsets = nx.blockscale_offsets_from_expert_offsets(offsets)
    row = torch.arange(m, device=linear_scales.device)
    expert = torch.searchsorted(offsets[1:].contiguous(), row, right=True)
    valid = expert < e
    ex = expert.clamp(max=max(e - 1, 0))
    dest = torch.where(valid, bs_offsets[ex] + row - offsets[ex], torch.full_like(row, rows))
    src = torch.zeros((m, nx.round_up(kb, nx.SWIZZLE_COL_TILE)), dtype=torch.uint8, device=linear_scales.device)
    src[:, :kb] = linear_scales.view(torch.uint8)
    lin = torch.zeros((rows + 1, src.shape[1]), dtype=torch.uint8, device=src.device).index_copy_(0, dest, src)
    return nx.swizzle_blockscale(lin[:rows]).view(torch.float8_e4m3fn)


@dataclass(frozen=True)
class ContiguousActivations:
    """packed uint8 ``[M, K/2]``; scale ``[max_blockscale_rows(M, E), round_up(K/16, 4)]`` (2D side);
    expert_offsets ``[E+1]``; global_scale fp32 ``[E]`` (encode)."""

    packed: torch.Tensor
    scale: torch.Tensor
    expert_offsets: torch.Tensor
    global_scale: torch.Tensor


def quantize_contiguous(x: torch.Tensor, global_scale: torch.Tensor,
                        expert_offsets: torch.Tensor) -> ContiguousActivations:
    """Rows of ``x[M, K]`` grouped by expert -> our codes and the kernel's 2D-side scales, in one
    pass of :func:`nvfp4_plugin.ops.scaled_fp4_experts_quant` (expert e with ``global_scale[e]``)."""
    bs = nx.blockscale_offsets_from_expert_offsets(expert_offsets)
    packed, scale = ops.scaled_fp4_experts_quant(x, global_scale, expert_offsets, bs)
    return ContiguousActivations(packed, scale, expert_offsets, global_scale)


# ------------------------------------------------------------------------------------------------
# Activation side, masked layout: [E, max_m, K] with masked_m[E] valid rows
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MaskedActivations:
    """packed uint8 ``[E, max_m, K/2]``; scale ``[E, round_up(max_m, 128), round_up(K/16, 4)]``
    swizzled per expert; masked_m int32 ``[E]``; global_scale fp32 ``[E]`` (encode)."""

    packed: torch.Tensor
    scale: torch.Tensor
    masked_m: torch.Tensor
    global_scale: torch.Tensor


def quantize_masked(x: torch.Tensor, global_scale: torch.Tensor, masked_m: torch.Tensor, *,
                    use_silu_and_mul: bool = False) -> MaskedActivations:
    """``x[E, max_m, K]`` (``[E, max_m, 2I]`` with ``use_silu_and_mul``) -> our masked quantization
    (:func:`nvfp4_plugin.ops.silu_and_mul_scaled_fp4_experts_quant`); rows past ``masked_m[e]`` are zero."""
    packed, scale = ops.silu_and_mul_scaled_fp4_experts_quant(x, global_scale, masked_m,
                                                              use_silu_and_mul=use_silu_and_mul)
    return MaskedActivations(packed, scale, masked_m.to(torch.int32).contiguous(), global_scale)


# ------------------------------------------------------------------------------------------------
# GEMM operands, checked against the kernels' contracts
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ContiguousGemmOperands:
    """The contiguous kernel's arguments (see the module docstring); ``out`` is ``[M, N]``."""

    mat_a: torch.Tensor
    mat_b: torch.Tensor
    scale_a: torch.Tensor
    scale_b: torch.Tensor
    offs: torch.Tensor
    global_scale_a: torch.Tensor
    global_scale_b: torch.Tensor
    out_dtype: torch.dtype = torch.bfloat16

    variant = "contiguous"

    @property
    def shape_mnk(self) -> tuple[int, int, int]:
        return self.mat_a.shape[0], self.mat_b.shape[2], self.mat_a.shape[1] * 2

    @property
    def num_experts(self) -> int:
        return self.mat_b.shape[0]

    def out_shape(self) -> tuple[int, int]:
        m, n, _ = self.shape_mnk
        return (m, n)


@dataclass(frozen=True)
class MaskedGemmOperands:
    """The masked kernel's arguments (see the module docstring); ``out`` is ``[E, max_m, N]``."""

    a: torch.Tensor
    b: torch.Tensor
    sfa: torch.Tensor
    sfb: torch.Tensor
    masked_m: torch.Tensor
    alpha: torch.Tensor
    out_dtype: torch.dtype = torch.bfloat16

    variant = "masked"

    @property
    def shape_mnk(self) -> tuple[int, int, int]:
        return self.a.shape[0], self.b.shape[0], self.a.shape[1] * 2

    @property
    def num_experts(self) -> int:
        return self.a.shape[2]

    def out_shape(self) -> tuple[int, int, int]:
        m, n, _ = self.shape_mnk
        return (self.num_experts, m, n)


def contiguous_operands(acts: ContiguousActivations, weights: CuteGroupedWeights,
                        out_dtype: torch.dtype = torch.bfloat16) -> ContiguousGemmOperands:
    ops_ = ContiguousGemmOperands(
        mat_a=as_float4(acts.packed), mat_b=weights.mat_b(), scale_a=acts.scale, scale_b=weights.scale_b(),
        offs=kernel_offsets(acts.expert_offsets), global_scale_a=decode_global_scale(acts.global_scale),
        global_scale_b=weights.decode_global_scale(), out_dtype=out_dtype)
    check_contiguous_operands(ops_)
    return ops_


def masked_operands(acts: MaskedActivations, weights: CuteGroupedWeights,
                    out_dtype: torch.dtype = torch.bfloat16) -> MaskedGemmOperands:
    alpha = nx.fp32_div(1.0, acts.global_scale.float() * weights.global_scale)
    ops_ = MaskedGemmOperands(a=as_float4(acts.packed).permute(1, 2, 0), b=weights.b_nkl(), sfa=acts.scale,
                              sfb=weights.scale, masked_m=acts.masked_m, alpha=alpha, out_dtype=out_dtype)
    check_masked_operands(ops_)
    return ops_


def _check_strides(name: str, t: torch.Tensor, expected: tuple) -> None:
    if tuple(t.stride()) != tuple(expected):
        raise ValueError(f"{name}: expected strides {tuple(expected)} (K-major), got {tuple(t.stride())} "
                         f"for shape {tuple(t.shape)}")


def _check_scale_block(name: str, t: torch.Tensor) -> None:
    check_tensor(name, t, dtypes=(torch.float8_e4m3fn,))
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())}")


def check_contiguous_operands(o: ContiguousGemmOperands) -> None:
    """Shapes, dtypes and strides the contiguous kernel's contract asks for (metadata only)."""
    check_tensor("mat_a", o.mat_a, dtypes=(FLOAT4,), ndim=2)
    m, k2 = o.mat_a.shape
    k = 2 * k2
    check_tensor("mat_b", o.mat_b, dtypes=(FLOAT4,), ndim=3, device=o.mat_a.device)
    e, kb2, n = o.mat_b.shape
    if kb2 != k2:
        raise ValueError(f"mat_b: expected K/2 = {k2} in dim 1 (shape [E, K/2, N]), got shape {tuple(o.mat_b.shape)}")
    _check_strides("mat_a", o.mat_a, (k2, 1))
    _check_strides("mat_b", o.mat_b, (n * k2, 1, k2))
    kp = nx.round_up(k // SF_VEC_SIZE, nx.SWIZZLE_COL_TILE)
    _check_scale_block("scale_a", o.scale_a)
    check_shape("scale_a", o.scale_a, (nx.max_blockscale_rows(m, e), kp))
    _check_scale_block("scale_b", o.scale_b)
    check_shape("scale_b", o.scale_b, (e, nx.round_up(n, nx.SWIZZLE_ROW_TILE) * kp))
    check_tensor("offs", o.offs, dtypes=(torch.int32,), device=o.mat_a.device)
    check_shape("offs", o.offs, (e,))
    for name in ("global_scale_a", "global_scale_b"):
        t = getattr(o, name)
        check_tensor(name, t, dtypes=(torch.float32,), device=o.mat_a.device)
        check_shape(name, t, (e,))
    if k % (4 * SF_VEC_SIZE):
        raise ValueError(f"K: the CuTe-DSL block-scaled MMA takes K in multiples of {4 * SF_VEC_SIZE}, got {k}")


def check_masked_operands(o: MaskedGemmOperands) -> None:
    """Shapes, dtypes and strides the masked kernel's contract asks for (metadata only)."""
    check_tensor("a", o.a, dtypes=(FLOAT4,), ndim=3)
    m, k2, e = o.a.shape
    k = 2 * k2
    check_tensor("b", o.b, dtypes=(FLOAT4,), ndim=3, device=o.a.device)
    n = o.b.shape[0]
    check_shape("b", o.b, (n, k2, e))
    _check_strides("a", o.a, (k2, 1, m * k2))
    _check_strides("b", o.b, (k2, 1, n * k2))
    kp = nx.round_up(k // SF_VEC_SIZE, nx.SWIZZLE_COL_TILE)
    _check_scale_block("sfa", o.sfa)
    check_shape("sfa", o.sfa, (e, nx.round_up(m, nx.SWIZZLE_ROW_TILE), kp))
    _check_scale_block("sfb", o.sfb)
    check_shape("sfb", o.sfb, (e, nx.round_up(n, nx.SWIZZLE_ROW_TILE), kp))
    check_tensor("masked_m", o.masked_m, dtypes=(torch.int32,), device=o.a.device)
    check_shape("masked_m", o.masked_m, (e,))
    check_tensor("alpha", o.alpha, dtypes=(torch.float32,), device=o.a.device)
    check_shape("alpha", o.alpha, (e,))
    if k % (4 * SF_VEC_SIZE):
        raise ValueError(f"K: the CuTe-DSL block-scaled MMA takes K in multiples of {4 * SF_VEC_SIZE}, got {k}")


# ------------------------------------------------------------------------------------------------
# Compiled-kernel cache
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelKey:
    """What a compiled kernel is specialized on. The contiguous kernel's tensors are marked dynamic,
    so the token count is not part of its key (``max_m`` is None); the masked kernel is compiled for
    static shapes, ``max_m`` included."""

    variant: str
    num_experts: int
    n: int
    k: int
    max_m: int | None
    out_dtype: str
    mma_tiler_mn: tuple[int, int] = (128, 128)
    cluster_shape_mn: tuple[int, int] = (1, 1)
    arch: str = "sm_100a"
    device_index: int | None = None


def kernel_key(operands, *, mma_tiler_mn=(128, 128), cluster_shape_mn=(1, 1), arch: str = "sm_100a",
               device_index: int | None = None) -> KernelKey:
    """The cache key of a launch: shapes and dtypes only (pure Python, no tensor values read)."""
    m, n, k = operands.shape_mnk
    return KernelKey(operands.variant, operands.num_experts, n, k, m if operands.variant == "masked" else None,
                     str(operands.out_dtype).replace("torch.", ""), tuple(mma_tiler_mn), tuple(cluster_shape_mn),
                     arch, device_index)


class KernelCache:
    """One compiled kernel per :class:`KernelKey`: ``compile_fn(key, operands)`` runs once per key
    (under a lock), later calls return the same object."""

    def __init__(self, compile_fn: Callable):
        self._compile_fn = compile_fn
        self._entries: dict[KernelKey, object] = {}
        self._lock = threading.Lock()
        self.compiles = 0

    def get(self, key: KernelKey, operands=None):
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError(f"cute_bridge: no compiled kernel for {key} during CUDA graph capture; "
                                       f"run the same shapes once before capturing (warm-up)")
                entry = self._compile_fn(key, operands)
                self._entries[key] = entry
                self.compiles += 1
        return entry

    def __contains__(self, key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


# ------------------------------------------------------------------------------------------------
# The GEMM launch (Blackwell only; imports cutlass lazily)
# ------------------------------------------------------------------------------------------------

def _import_contiguous_kernel(modules=CONTIGUOUS_KERNEL_MODULES):
    errors = []
    for name in modules:
        try:
            return importlib.import_module(name).ScaledGroupedGemmKernel
        except (ImportError, AttributeError) as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("cute_bridge: the contiguous kernel ScaledGroupedGemmKernel comes with CUTLASS's CuTe-DSL "
                      "examples (put examples/python/CuTeDSL on sys.path); tried " + "; ".join(errors))


def _masked_kernel_module():
    return importlib.import_module(MASKED_KERNEL_MODULE)


def _cute_tensor(t: torch.Tensor):
    from cutlass.cute.runtime import from_dlpack

    leading = next(i for i, s in enumerate(t.stride()) if s == 1) if t.dim() > 1 else 0
    return from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=leading)


def _sm_version(arch: str) -> str:
    return arch.rstrip("a")  # FlashInfer's kernel names the family: "sm_100" / "sm_103"


@dataclass
class _Compiled:
    fn: object
    kernel: object = None
    max_active_clusters: int = 0


def _compile_contiguous(key: KernelKey, o: ContiguousGemmOperands, max_active_clusters: int | None = None):
    import cutlass.cute as cute
    import cutlass.utils as cutils
    from cutlass.cute.runtime import make_fake_stream

    cls = _import_contiguous_kernel()
    kernel = cls(scenario="2Dx3D", sf_vec_size=SF_VEC_SIZE, accumulate_on_output=False, separate_tensormap_init=True,
                 consistent_token_padding=False, mma_tiler_mnk=(*key.mma_tiler_mn, CONTIGUOUS_MMA_TILE_K),
                 cluster_shape_mnk=(*key.cluster_shape_mn, 1))
    if max_active_clusters is None:
        cluster = key.cluster_shape_mn[0] * key.cluster_shape_mn[1]
        max_active_clusters = cutils.HardwareInfo().get_max_active_clusters(cluster)
    out = torch.empty(o.out_shape(), dtype=o.out_dtype, device=o.mat_a.device)
    ws = torch.empty(kernel.get_workspace_size(key.num_experts), dtype=torch.uint8, device=o.mat_a.device)
    fn = cute.compile(kernel, _cute_tensor(o.mat_a), _cute_tensor(o.mat_b), _cute_tensor(o.scale_a),
                      _cute_tensor(o.scale_b), _cute_tensor(out), _cute_tensor(o.offs), _cute_tensor(ws),
                      max_active_clusters, make_fake_stream(), global_scale_a=_cute_tensor(o.global_scale_a),
                      global_scale_b=_cute_tensor(o.global_scale_b), options=f"--gpu-arch {key.arch}")
    return _Compiled(fn, kernel, max_active_clusters)


_CUTLASS_DTYPES = {"bfloat16": "BFloat16", "float16": "Float16", "float32": "Float32"}


@contextlib.contextmanager
def _fixed_max_active_clusters(mod, value: int | None):
    """FlashInfer's masked kernel asks the GPU for its occupancy when constructed; ahead of time
    (no GPU) we tell it instead."""
    if value is None:
        yield
        return
    saved = mod.get_max_active_clusters
    mod.get_max_active_clusters = lambda cluster_size: value
    try:
        yield
    finally:
        mod.get_max_active_clusters = saved


#: The masked kernel's pointer arguments, in the order of its ``__call__`` (then the stream).
MASKED_POINTER_ARGS = ("a_ptr", "b_ptr", "sfa_ptr", "sfb_ptr", "c_ptr", "masked_m_ptr", "dst_signals_ptr", "alpha_ptr",
                       "topk_weights_ptr", "idx_src_info_ptr", "rank_src_info_ptr", "out_ptrs_ptr",
                       "barrier_flag_local_ptr", "barrier_flag_multicast_ptr")


def _masked_kernel_kwargs(key: KernelKey, sm_count: int, cutlass) -> dict:
    """The masked kernel's constructor arguments for ``key`` (``cutlass`` supplies the dtypes)."""
    return dict(m=key.max_m, n=key.n, k=key.k, l=key.num_experts, a_major="k", b_major="k", c_major="n",
                ab_dtype=cutlass.Float4E2M1FN, sf_dtype=cutlass.Float8E4M3FN,
                c_dtype=getattr(cutlass, _CUTLASS_DTYPES[key.out_dtype]), alpha_dtype=cutlass.Float32,
                sf_vec_size=SF_VEC_SIZE, mma_tiler_mn=key.mma_tiler_mn, cluster_shape_mn=key.cluster_shape_mn,
                sm_count=sm_count, sm_version=_sm_version(key.arch))


def _masked_ptr_dtypes(cutlass, key: KernelKey):
    """Element types of :data:`MASKED_POINTER_ARGS`: a, b, sfa, sfb, c, masked_m, (no dst_signals),
    alpha, then the combine-fusion pointers, which we do not use (None)."""
    c = getattr(cutlass, _CUTLASS_DTYPES[key.out_dtype])
    return [cutlass.Float4E2M1FN, cutlass.Float4E2M1FN, cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, c,
            cutlass.Int32, None, cutlass.Float32, None, None, None, None, None, None]


def _compile_masked(key: KernelKey, o=None, sm_count: int | None = None, max_active_clusters: int | None = None):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    mod = _masked_kernel_module()
    if sm_count is None:
        sm_count = torch.cuda.get_device_properties(key.device_index or 0).multi_processor_count
    with _fixed_max_active_clusters(mod, max_active_clusters):
        kernel = mod.MaskedBatchedMatmulCuteDSL(**_masked_kernel_kwargs(key, sm_count, cutlass))
    placeholders = [make_ptr(dt, 16, cute.AddressSpace.gmem, assumed_align=16) if dt is not None else None
                    for dt in _masked_ptr_dtypes(cutlass, key)]
    fn = cute.compile(kernel, *placeholders, make_fake_stream(), options=f"--gpu-arch {key.arch}")
    return _Compiled(fn, kernel)


def compile_kernel(key: KernelKey, operands=None):
    """The default cache's compile function (imports cutlass)."""
    if key.variant == "contiguous":
        return _compile_contiguous(key, operands)
    return _compile_masked(key, operands)


def compile_masked_gemm_aot(num_experts: int, max_m: int, n: int, k: int, *, arch: str = "sm_100a",
                            out_dtype: torch.dtype = torch.bfloat16, mma_tiler_mn=(128, 128), cluster_shape_mn=(1, 1),
                            sm_count: int = 148):
    """Compile the masked kernel for ``arch`` ahead of time, on a machine without a GPU.

    Returns the DSL's compiled function (``.dump_to_object(prefix)`` gives the host object with the
    cubin inside). ``sm_count`` stands in for the GPU's (148 on a B200)."""
    key = KernelKey("masked", num_experts, n, k, max_m, str(out_dtype).replace("torch.", ""), tuple(mma_tiler_mn),
                    tuple(cluster_shape_mn), arch)
    return _compile_masked(key, sm_count=sm_count, max_active_clusters=sm_count).fn


#: The process-wide cache used by :func:`run_grouped_gemm`.
KERNEL_CACHE = KernelCache(compile_kernel)


def device_arch(device: torch.device) -> str:
    cap = torch.cuda.get_device_capability(device)
    if cap not in _ARCHS:
        raise RuntimeError(f"cute_bridge: the CuTe-DSL block-scaled grouped GEMMs run on sm_100a / sm_103a, "
                           f"got compute capability {cap[0]}.{cap[1]}")
    return _ARCHS[cap]


def run_grouped_gemm(operands, *, out: torch.Tensor | None = None, mma_tiler_mn=(128, 128),
                     cluster_shape_mn=(1, 1), cache: KernelCache | None = None) -> torch.Tensor:
    """Launch the grouped GEMM for ``operands`` (:class:`ContiguousGemmOperands` -> ``[M, N]``, or
    :class:`MaskedGemmOperands` -> ``[E, max_m, N]``) on the current stream. Blackwell only.

    CUDA-graph safe once warmed up: the kernel comes from the cache, the output and the contiguous
    kernel's workspace have sizes fixed by shapes, nothing reads a tensor value on the host."""
    import cuda.bindings.driver as cuda_driver

    cache = KERNEL_CACHE if cache is None else cache
    if operands.variant == "contiguous":
        check_contiguous_operands(operands)
        device = operands.mat_a.device
    else:
        check_masked_operands(operands)
        device = operands.a.device
    key = kernel_key(operands, mma_tiler_mn=mma_tiler_mn, cluster_shape_mn=cluster_shape_mn,
                     arch=device_arch(device), device_index=device.index)
    compiled = cache.get(key, operands)
    if out is None:
        out = torch.empty(operands.out_shape(), dtype=operands.out_dtype, device=device)
    check_shape("out", out, operands.out_shape())
    stream = cuda_driver.CUstream(torch.cuda.current_stream(device).cuda_stream)
    if operands.variant == "contiguous":
        ws = torch.full((compiled.kernel.get_workspace_size(key.num_experts),), 255, dtype=torch.uint8, device=device)
        o = operands
        compiled.fn(_cute_tensor(o.mat_a), _cute_tensor(o.mat_b), _cute_tensor(o.scale_a), _cute_tensor(o.scale_b),
                    _cute_tensor(out), _cute_tensor(o.offs), _cute_tensor(ws), stream,
                    global_scale_a=_cute_tensor(o.global_scale_a), global_scale_b=_cute_tensor(o.global_scale_b))
        return out
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    o = operands
    tensors = [o.a, o.b, o.sfa, o.sfb, out, o.masked_m, None, o.alpha] + [None] * 6
    ptrs = [make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=16) if t is not None else None
            for dt, t in zip(_masked_ptr_dtypes(cutlass, key), tensors)]
    compiled.fn(*ptrs, stream)
    return out


def reference_grouped_gemm(operands) -> torch.Tensor:
    """What :func:`run_grouped_gemm` computes, in fp32 on any device (the B200 tests compare with it):
    decode A and B with our reference dequantization, multiply per expert, apply the global scales."""
    if operands.variant == "contiguous":
        o = operands
        m, n, k = o.shape_mnk
        e = o.num_experts
        kb = k // SF_VEC_SIZE
        offs = torch.cat([o.offs.new_zeros(1), o.offs]).to(torch.int64)
        bs = nx.blockscale_offsets_from_expert_offsets(offs)
        rows = torch.arange(m, device=o.mat_a.device)
        expert = torch.searchsorted(offs[1:].contiguous(), rows, right=True)
        ex = expert.clamp(max=e - 1)
        lin = nx.unswizzle_blockscale(o.scale_a, o.scale_a.shape[0], kb)
        src = (bs[ex] + rows - offs[ex]).clamp(max=lin.shape[0] - 1)
        a_scale = lin.view(torch.uint8)[src].view(torch.float8_e4m3fn).float()
        a = nx.e2m1_decode(nx.unpack_fp4(as_packed_bytes(o.mat_a))).unflatten(-1, (kb, SF_VEC_SIZE))
        a = (a * a_scale[..., None]).flatten(-2)
        w_packed = as_packed_bytes(o.mat_b).transpose(1, 2)
        b_scale = nx.unswizzle_blockscale(o.scale_b.reshape(e, -1, nx.round_up(kb, 4)), n, kb)
        b = nx.e2m1_decode(nx.unpack_fp4(w_packed)).unflatten(-1, (kb, SF_VEC_SIZE))
        b = (b * b_scale.float()[..., None]).flatten(-2)
        out = torch.einsum("mk,mnk->mn", a, b[ex]) * (o.global_scale_a[ex] * o.global_scale_b[ex])[:, None]
        return torch.where((expert < e)[:, None], out, torch.zeros_like(out))
    o = operands
    m, n, k = o.shape_mnk
    e = o.num_experts
    kb = k // SF_VEC_SIZE
    a = nx.e2m1_decode(nx.unpack_fp4(as_packed_bytes(o.a).permute(2, 0, 1))).unflatten(-1, (kb, SF_VEC_SIZE))
    a = (a * nx.unswizzle_blockscale(o.sfa, m, kb).float()[..., None]).flatten(-2)
    b = nx.e2m1_decode(nx.unpack_fp4(as_packed_bytes(o.b).permute(2, 0, 1))).unflatten(-1, (kb, SF_VEC_SIZE))
    b = (b * nx.unswizzle_blockscale(o.sfb, n, kb).float()[..., None]).flatten(-2)
    out = torch.einsum("emk,enk->emn", a, b) * o.alpha[:, None, None]
    valid = torch.arange(m, device=a.device)[None, :] < o.masked_m.to(torch.int64)[:, None]
    return torch.where(valid[..., None], out, torch.zeros_like(out))
