"""DeepSeek-V4 MegaMoE input staging in Triton (seed file 004), one launch.

Writes, for ``hidden_states[M, K]`` (``K % 128 == 0``):
  ``x_fp4``  uint8 ``[M, K/2]``: E2M1 codes, element 2i in the low nibble of byte i;
  ``x_sf``   int32 ``[M, K/64]``: UE4M3 block scales (one per 16 values), four per word,
             little-endian: the scale of group g is byte ``g % 4`` of word ``g // 4``;
  ``topk_idx_out`` int64 ``[M, top_k]`` = ``topk_ids``; ``topk_weights_out`` = ``topk_weights``.

Recipe: :data:`nvfp4_plugin.reference.MEGA_MOE_GLOBAL_SCALE` (see there and
:func:`nvfp4_plugin.reference.stage_deepseek_v4_mega_moe_inputs`, the byte-exact twin).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference as ref
from . import _jit_numerics as jn
from . import _runtime as rt


@triton.jit
def _stage_kernel(h_ptr, xq_ptr, xsf_ptr, ids_ptr, w_ptr, ids_out_ptr, w_out_ptr, M, K, TOPK,
                  s_hm, s_hk, s_qm, s_qk, s_sfm, s_sfk, s_im, s_ik, s_wm, s_wk, s_iom, s_iok, s_wom, s_wok,
                  BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_TOPK: tl.constexpr, HW_FP8: tl.constexpr,
                  COMPILED: tl.constexpr, K_FAST: tl.constexpr, WORDS: tl.constexpr, VEC: tl.constexpr):
    NB: tl.constexpr = BLOCK_K // 16
    pid_m, pid_k = jn.tile_ids(K_FAST)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    cols = jn.block_cols(pid_k * BLOCK_K, NB, 2, VEC)
    x = jn.load_block_tile(h_ptr, rows64, row_ok, cols, K, s_hm, s_hk, 2)  # [NB, BM, 2, 8]: block, row, half, element

    # NVFP4 recipe with global scale 1: s = e4m3(vmax * fp32(1/6)), out_scale = 1 / s
    vmax = jn.block_amax(x, COMPILED)  # [NB, BM]; a NaN never raises a scale
    byte, s, out_scale = jn.nvfp4_block_scales(vmax, 1.0, 1.0, False, HW_FP8)
    words = jn.e2m1_words(x * out_scale[:, :, None, None], 0.0, False, COMPILED)
    jn.store_words(xq_ptr, words, rows64, row_ok, pid_k * (BLOCK_K // 8), K, s_qm, s_qk, 2, WORDS)

    # four scale bytes per int32, group g in byte g % 4 (disjoint bit fields: the sum is the OR)
    b4 = tl.reshape(tl.trans(byte), [BLOCK_M, NB // 4, 4])
    word = tl.sum(b4 << (tl.arange(0, 4) * 8).to(tl.uint32)[None, None, :], axis=2)
    wcols = pid_k * (NB // 4) + tl.arange(0, NB // 4)
    wptrs = xsf_ptr + rows64[:, None] * s_sfm + wcols[None, :].to(tl.int64) * s_sfk
    tl.store(wptrs, word.to(tl.int32, bitcast=True), mask=row_ok[:, None] & (wcols < K // 64)[None, :])

    if pid_k == 0:
        t = tl.arange(0, BLOCK_TOPK)
        tmask = row_ok[:, None] & (t < TOPK)[None, :]
        ids = tl.load(ids_ptr + rows64[:, None] * s_im + t[None, :] * s_ik, mask=tmask, other=0).to(tl.int64)
        tl.store(ids_out_ptr + rows64[:, None] * s_iom + t[None, :] * s_iok, ids, mask=tmask)
        w = jn.load_f32(w_ptr + rows64[:, None] * s_wm + t[None, :] * s_wk, tmask)
        jn.store_f32(w_out_ptr + rows64[:, None] * s_wom + t[None, :] * s_wok, w, tmask)


def stage_deepseek_v4_mega_moe_inputs(hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                                      topk_ids: torch.Tensor, x_fp4: torch.Tensor, x_sf: torch.Tensor,
                                      topk_idx_out: torch.Tensor, topk_weights_out: torch.Tensor) -> None:
    """Quantize ``hidden_states`` into ``x_fp4`` / ``x_sf`` and copy the top-k routing, in one launch.

    Same arguments, validation and bytes as :func:`nvfp4_plugin.reference.stage_deepseek_v4_mega_moe_inputs`
    (whose docstring gives the recipe and how it differs from the seed kernel's rounding). Writes the
    outputs in place; ``M == 0`` launches nothing. No host synchronization.
    """
    ref.check_mega_moe_staging_args(hidden_states, topk_weights, topk_ids, x_fp4, x_sf, topk_idx_out,
                                    topk_weights_out)
    for name, t in (("hidden_states", hidden_states), ("topk_weights", topk_weights), ("topk_ids", topk_ids),
                    ("x_fp4", x_fp4), ("x_sf", x_sf), ("topk_idx_out", topk_idx_out),
                    ("topk_weights_out", topk_weights_out)):
        rt.check_device(name, t)
    m, k = hidden_states.shape
    top_k = topk_ids.shape[1]
    if m == 0:
        return
    h, xq = hidden_states, x_fp4
    bm, bk, warps = rt.tile("staging", k, 128, min_block_k=128)
    grid, _, _, k_fast = rt.tile_grid(m, k, bm, bk, "staging")
    _stage_kernel[grid](
        rt.as_kernel_tensor(h), xq, x_sf, topk_ids, rt.as_kernel_tensor(topk_weights),
        topk_idx_out, rt.as_kernel_tensor(topk_weights_out), m, k, top_k,
        h.stride(0), h.stride(1), xq.stride(0), xq.stride(1), x_sf.stride(0), x_sf.stride(1),
        topk_ids.stride(0), topk_ids.stride(1), topk_weights.stride(0), topk_weights.stride(1),
        topk_idx_out.stride(0), topk_idx_out.stride(1), topk_weights_out.stride(0), topk_weights_out.stride(1),
        BLOCK_M=bm, BLOCK_K=bk, BLOCK_TOPK=max(triton.next_power_of_2(max(top_k, 1)), 1),
        HW_FP8=rt.hw_fp8(h.device), COMPILED=not rt.interpreting(), K_FAST=k_fast,
        WORDS=xq.stride(1) == 1 and xq.stride(0) % 4 == 0 and xq.data_ptr() % 4 == 0, VEC=rt.vector_elems(h),
        num_warps=warps,
        **rt.LAUNCH_OPTIONS)
