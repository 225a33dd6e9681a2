"""Blackwell fused-MoE backend: FlashInfer's CUTLASS fused MoE ``flashinfer.fused_moe.cutlass_fused_moe``
(expert sort, both FP4 grouped GEMMs, SwiGLU with the NVFP4 quantization of its output, and the top-k
combine in one call), fed by our ``scaled_fp4_quant``. sm_100 / sm_103 (B200 / B300), where FlashInfer
builds this kernel for NVFP4; needs ``flashinfer-python`` (``pip install 'nvfp4-plugin[blackwell]'``) and a
checkpoint with activation scales (W4A4: both GEMMs multiply NVFP4 activations).

The contract, as flashinfer-python 0.6.14 implements it (``fused_moe/core.py`` ``cutlass_fused_moe``;
``data/csrc/fused_moe/cutlass_backend/flashinfer_cutlass_fused_moe_binding.cu`` ``runMoe`` and
``getQuantParams`` (NVFP4 branch); ``cutlass_fused_moe_kernels.cuh`` ``expandInputRowsKernel``,
``doActivationKernel``, ``finalizeMoeRoutingKernel``, ``getOffsetWeightSF``):

- the NVFP4 path is selected by int64 weights: ``fc1_expert_weights`` ``[E, 2I, H/16]`` and
  ``fc2_expert_weights`` ``[E, H, I/16]``, 16 E2M1 codes per int64 (our row-major codes, viewed);
- the SwiGLU takes the *second* half of fc1's rows as the gate: ``silu(h[:, I:]) * h[:, :I]``. Our w13
  is ``[gate; up]``, so the halves swap at load time (vLLM does the same, ``reorder_w1w3_to_w3w1``);
- ``quant_scales`` = [fc1 activation encode scale (fp32, one value or ``[E]``), fc1 weight block
  scales (int32 view of E4M3 bytes, ``[E, round_up(2I,128), round_up(H/16,4)]``, each expert
  128x4-swizzled on its own), fc1 alpha ``[E]`` = 1 / (activation encode scale x weight encode scale),
  fc2 activation encode scale (one or ``[E]``), fc2 weight block scales ``[E, round_up(H,128),
  round_up(I/16,4)]``, fc2 alpha ``[E]``];
- ``input``: NVFP4 codes uint8 ``[M, H/2]`` with ``input_sf`` (our 128x4-swizzled scales), or bf16/fp16
  ``[M, H]`` which the kernel quantizes itself. Pre-quantized input takes one fc1 activation scale
  for all experts (the kernel asserts it, ``expandInputRowsKernel``); per-expert scales need the
  kernel's own quantizer;
- ``token_selected_experts`` int32 ``[M, top_k]``, ``token_final_scales`` fp32 ``[M, top_k]``;
  ``output`` ``[M, H]`` in the activation dtype. The function returns a list (output first), so we
  pass ``output=`` and use that.

Exactness, decided at load time (``prepare``), logged:

- Weights: alpha is one value per expert, and our weights keep an encode global scale per row. An
  expert whose w13 rows (gate and up) or w2 rows carry different global scales cannot be expressed
  exactly (rescaling E4M3 block scales rounds), so such a layer runs the reference backend, with a
  warning that names the expert and the scales. Checkpoints whose shards share their scale (ModelOpt
  exports, ``nvfp4-plugin quantize``) take the FlashInfer path.
- Activations, GEMM1 input: the reference quantizes each routed row with its expert's a13 scale. If all
  experts share one a13 (the usual case for our quantizer's checkpoints), we quantize once with our
  ``scaled_fp4_quant`` and hand FlashInfer our bytes (what the reference makes, bit for bit). If they
  differ (ModelOpt calibrates per expert), FlashInfer quantizes each routed row with its expert's scale
  (``[E]``): the reference's semantics, FlashInfer's quantizer (below).
- Inside the kernel, not ours to choose: the GEMMs multiply exact FP4 x E4M3 products in fp32 and
  scale by alpha (the reference rounds dequantized operands to bf16 first); the GEMM1 output is
  stored in the activation dtype; SiLU is CUTLASS's ``x * 1/(1 + exp(-x))`` with a fast exp; the
  SwiGLU output is rounded to the activation dtype and quantized with the per-expert a2 scale by
  FlashInfer's ``cvt_warp_fp16_to_fp4`` (the NVFP4 recipe of the reference, except that its two
  reciprocals are ``rcp.approx.ftz`` and a block whose E4M3 scale underflows to 0 gets codes of 6
  instead of 0, same value 0); the combine sums ``weight x expert output`` in fp32 (unfused finalize)
  or reduces into the output with atomic adds (fused-finalize GEMM epilogue). So the output is not
  bit-comparable with the reference; tests/test_flashinfer_moe_backend.py bounds each stage.

The masked layout (expert-parallel low-latency dispatch, ``x [E, max_m, H]`` + valid rows per expert;
:meth:`FlashInferCutlassMoe.apply_masked`) runs on the same prepared weights through FlashInfer's CuTe-DSL masked
grouped GEMM ``grouped_gemm_nt_masked`` (:mod:`nvfp4_plugin.cute_bridge`; needs ``nvidia-cutlass-dsl``): our
masked quantization of ``x`` with each expert's a13, GEMM1 on fc1 (its rows are ``[up; gate]``, so its output
halves are swapped back with one copy), our fused SiLU-and-mul masked quantization with each expert's a2, GEMM2
on fc2, then the valid rows into ``out``. No second copy of the weights: fc1 / fc2 and their swizzled scales are
the masked kernel's B operands as they are (K-major codes, per-expert 128x4 swizzle). Alpha per expert as
above; the kernel compiles once per (experts, max_m, N, K) on its first call, which must come before CUDA-graph
capture (the engines' dummy runs do that).

Not run on a Blackwell GPU here: tests check it on the CPU against an emulator of that contract
(tests/emulators/flashinfer_cutlass_moe.py; the masked GEMM against the bridge's contract emulation
``reference_grouped_gemm``), and our bytes handed over against the reference.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ... import numerics as nx
from ...weights import Nvfp4Weight
from .flashinfer_fp4 import FlashInferBackend
from .reference import ReferenceMoe, write_valid_rows

logger = logging.getLogger("nvfp4_plugin")

#: The input paths of :meth:`FlashInferCutlassMoe.apply` (chosen at load time).
PATH_OUR_QUANT = "scaled_fp4_quant"        # one a13 for all experts: our bytes, pre-quantized
PATH_KERNEL_QUANT = "kernel quantizes"     # per-expert a13: FlashInfer quantizes each routed row
PATH_REFERENCE = "reference"               # weights not exact with one alpha per expert

_REFERENCE = ReferenceMoe()


def flashinfer_module():
    """``flashinfer.fused_moe`` if importable with ``cutlass_fused_moe``, else None (tests put an emulator here)."""
    try:
        from flashinfer import fused_moe
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return fused_moe if hasattr(fused_moe, "cutlass_fused_moe") else None


@functools.lru_cache(maxsize=1)
def masked_gemm_missing() -> str | None:
    """Why the masked layout's GEMM (FlashInfer's CuTe-DSL ``grouped_gemm_nt_masked``) cannot run in this
    environment, or None: the DSL and the kernel's class import (once per process; asked at load time, when an
    engine checks whether the layer takes the masked layout)."""
    from ...cute_bridge import MASKED_KERNEL_MODULE

    try:
        import cutlass.cute  # noqa: F401 - nvidia-cutlass-dsl
    except Exception as exc:  # noqa: BLE001 - not installed, or not importable here
        return (f"its GEMM, FlashInfer's CuTe-DSL grouped_gemm_nt_masked, needs nvidia-cutlass-dsl "
                f"(pip install nvidia-cutlass-dsl; {type(exc).__name__}: {exc})")
    try:
        mod = importlib.import_module(MASKED_KERNEL_MODULE)
    except Exception as exc:  # noqa: BLE001
        return f"{MASKED_KERNEL_MODULE} is not importable ({type(exc).__name__}: {exc})"
    if not hasattr(mod, "MaskedBatchedMatmulCuteDSL"):
        return f"{MASKED_KERNEL_MODULE} has no MaskedBatchedMatmulCuteDSL (another FlashInfer version)"
    return None


@dataclass(frozen=True)
class _Meta:
    path: str
    reference_meta: Any = None


def expert_global_scales(name: str, global_scale: torch.Tensor, halves: bool = False):
    """``([E] encode scale per expert, None)`` if every row of each expert shares one, else
    ``(None, why not)`` (load time, on the host). ``halves``: name gate / up in the reason (w13)."""
    gs = global_scale.detach().float().cpu()
    differs = (gs != gs[:, :1]).any(dim=1)
    if not bool(differs.any()):
        return gs[:, 0].to(global_scale.device).contiguous(), None
    e = int(differs.nonzero()[0, 0])
    if halves:
        half = gs.shape[1] // 2
        parts = {"gate": sorted(set(gs[e, :half].tolist())), "up": sorted(set(gs[e, half:].tolist()))}
        what = ", ".join(f"{k} {v[0]:g}" if len(v) == 1 else f"{k} {len(v)} values" for k, v in parts.items())
    else:
        what = f"{len(set(gs[e].tolist()))} values"
    return None, (f"{name}: the rows of {int(differs.sum())} expert(s) carry different encode global scales "
                  f"(expert {e}: {what})")


def _per_expert(name: str, scale: torch.Tensor, num_experts: int) -> torch.Tensor:
    s = scale.detach().float().reshape(-1)
    if s.numel() == 1:
        s = s.expand(num_experts)
    if s.numel() != num_experts:
        raise ValueError(f"{name}: expected one encode scale or one per expert ({num_experts}), got shape "
                         f"{tuple(scale.shape)}")
    return s.contiguous()


def swap_gate_up(t: torch.Tensor, inter: int) -> torch.Tensor:
    """``[E, 2I, ...]`` rows ``[gate; up]`` (ours) -> ``[up; gate]`` (FlashInfer's SwiGLU order)."""
    return torch.cat((t[:, inter:], t[:, :inter]), dim=1).contiguous()


class FlashInferCutlassMoe(FlashInferBackend):
    name = "flashinfer_cutlass_moe"
    family = "flashinfer cutlass_fused_moe"
    entry_point = "fused_moe.cutlass_fused_moe"

    @staticmethod
    def _module():
        return flashinfer_module()

    @classmethod
    def _shape_reason(cls, spec):
        if spec.hidden % 64 or spec.intermediate % 64:
            # K of each GEMM in whole 64-wide scale tiles and 2I a multiple of 128: the gated shapes vLLM 0.26
            # runs through this kernel (it refuses to pad w13), and 16-byte FP4 rows for TMA.
            return (f"cutlass_fused_moe (as used here) needs H % 64 == 0 and I % 64 == 0, got H={spec.hidden} "
                    f"I={spec.intermediate}")
        return None

    @classmethod
    def families(cls, spec, max_tokens, **kw):
        return [(1, max_tokens, cls.family)]

    def prepare(self, spec, w13: Nvfp4Weight, w2: Nvfp4Weight, a13_global_scale, a2_global_scale):
        e, i = spec.num_experts, spec.intermediate
        g13, why = expert_global_scales("w13", w13.global_scale, halves=True)
        g2, why2 = expert_global_scales("w2", w2.global_scale)
        why = why or why2
        if why is not None:
            logger.warning("nvfp4_plugin: moe backend %s cannot run this layer (E=%d H=%d I=%d) exactly: %s; "
                           "FlashInfer's alpha is one value per expert and rescaling block scales is not exact, "
                           "so this layer runs the reference backend", self.name, e, spec.hidden, i, why)
            t, m = _REFERENCE.prepare(spec, w13, w2, a13_global_scale, a2_global_scale)
            return t, _Meta(PATH_REFERENCE, m)
        a13 = _per_expert("a13_global_scale", a13_global_scale, e)
        a2 = _per_expert("a2_global_scale", a2_global_scale, e)
        shared = bool((a13 == a13[0]).all())
        t = {
            "fc1_weight": swap_gate_up(w13.packed, i).view(torch.int64),                          # [E, 2I, H/16]
            "fc1_weight_sf": nx.swizzle_blockscale(swap_gate_up(w13.block_scale, i)).contiguous().view(torch.int32),
            "fc1_alpha": (1.0 / (a13 * g13)).contiguous(),
            "fc1_act_scale": a13[0].clone() if shared else a13,                                   # [] or [E]
            "fc1_act_scale_e": a13,                                             # [E], the masked path's
            "fc2_weight": w2.packed.contiguous().view(torch.int64),                               # [E, H, I/16]
            "fc2_weight_sf": nx.swizzle_blockscale(w2.block_scale.contiguous()).contiguous().view(torch.int32),
            "fc2_alpha": (1.0 / (a2 * g2)).contiguous(),
            "fc2_act_scale": a2,                                                                  # [E]
        }
        path = PATH_OUR_QUANT if shared else PATH_KERNEL_QUANT
        logger.info("nvfp4_plugin: moe backend %s, E=%d H=%d I=%d: %s", self.name, e, spec.hidden, i,
                    "one activation scale for all experts: our scaled_fp4_quant feeds cutlass_fused_moe"
                    if shared else "per-expert activation scales: cutlass_fused_moe quantizes each routed row "
                                   "with its expert's scale (FlashInfer's quantizer)")
        return t, _Meta(path)

    def apply(self, t, meta: _Meta, x, topk_weights, topk_ids):
        if meta.path == PATH_REFERENCE:
            return _REFERENCE.apply(t, meta.reference_meta, x, topk_weights, topk_ids)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if x.shape[0] == 0:
            return out
        x = x.contiguous()
        if meta.path == PATH_OUR_QUANT:
            from ... import ops

            inp, input_sf = ops.scaled_fp4_quant(x, t["fc1_act_scale"], swizzle=True)
        else:
            inp, input_sf = x, None
        quant_scales = [t["fc1_act_scale"], t["fc1_weight_sf"], t["fc1_alpha"],
                        t["fc2_act_scale"], t["fc2_weight_sf"], t["fc2_alpha"]]
        flashinfer_module().cutlass_fused_moe(
            inp, topk_ids.to(torch.int32).contiguous(), topk_weights.to(torch.float32).contiguous(),
            t["fc1_weight"], t["fc2_weight"], x.dtype, quant_scales, input_sf=input_sf, output=out)
        return out

    def masked_unsupported(self, meta: _Meta) -> str | None:
        """Why :meth:`apply_masked` cannot run here, or None."""
        return None if meta.path == PATH_REFERENCE else masked_gemm_missing()

    def apply_masked(self, t, meta: _Meta, x, mask, out):
        """The masked layout (module docstring): ``out[e, r] = W2[e] silu_mul(W13[e] x[e, r])`` for ``r < mask[e]``;
        rows at or past ``mask[e]`` are left as they are. No host synchronization, no routing."""
        if meta.path == PATH_REFERENCE:
            return _REFERENCE.apply_masked(t, meta.reference_meta, x, mask, out)
        from ... import cute_bridge as cb

        max_m = x.shape[1]
        inter = t["fc2_weight"].shape[2] * 16
        mask = mask.clamp(max=max_m)        # the kernel schedules ceil(mask / 128) row tiles: none past max_m
        acts = cb.quantize_masked(x.contiguous(), t["fc1_act_scale_e"], mask)
        h = cb.run_grouped_gemm(_masked_operands(acts, t["fc1_weight"], t["fc1_weight_sf"], t["fc1_alpha"], x.dtype))
        h = torch.cat((h[..., inter:], h[..., :inter]), dim=-1)                      # [up | gate] -> [gate | up]
        acts2 = cb.quantize_masked(h, t["fc2_act_scale"], mask, use_silu_and_mul=True)
        y = cb.run_grouped_gemm(_masked_operands(acts2, t["fc2_weight"], t["fc2_weight_sf"], t["fc2_alpha"], x.dtype))
        write_valid_rows(out, y, mask)

    def warmup_sizes(self, t, meta, max_tokens, **kw):
        # The first call loads FlashInfer's compiled module (builds it where flashinfer-jit-cache has none);
        # no size compiles anything further, so one start-up forward keeps that from a request's path.
        return [] if meta.path == PATH_REFERENCE or max_tokens < 1 else [1]


def _masked_operands(acts, weight_i64: torch.Tensor, weight_sf_i32: torch.Tensor, alpha: torch.Tensor,
                     out_dtype: torch.dtype):
    """The masked kernel's operands (:class:`~nvfp4_plugin.cute_bridge.MaskedGemmOperands`) from our masked
    activations and this backend's prepared fc1 / fc2 (int64 views of row-major codes ``[E, N, K/16]``, int32
    views of per-expert swizzled scales): the same bytes, viewed as the kernel's K-major float4 B and E4M3 SFB."""
    from ... import cute_bridge as cb

    b = cb.as_float4(weight_i64.view(torch.uint8)).permute(1, 2, 0)                # (N, K/2, E)
    ops_ = cb.MaskedGemmOperands(a=cb.as_float4(acts.packed).permute(1, 2, 0), b=b, sfa=acts.scale,
                                 sfb=weight_sf_i32.view(torch.float8_e4m3fn), masked_m=acts.masked_m, alpha=alpha,
                                 out_dtype=out_dtype)
    cb.check_masked_operands(ops_)
    return ops_
