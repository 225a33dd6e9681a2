"""Hopper (sm90) FP4-weight GEMMs: dense, grouped by expert offsets, masked.

Load time::

    packed = prepack(weight, act_dtype=torch.bfloat16)     # Nvfp4Weight -> PackedW4Weight (typed layout)
    unpack(packed) == weight                                # exact, byte for byte

Forward (no host syncs, CUDA-graph capturable)::

    y = w4_linear(x, packed, bias, mode="w4a16")                                  # x [..., K]
    y = w4_grouped(x, packed_experts, expert_offsets, gather_idx=..., scatter_idx=..., row_scale=...)
    y = w4_masked(x, packed_experts, mask)                                        # x [E, max_m, K]
    y = w4_fused_moe(x, packed_w13, packed_w2, topk_weights, topk_ids)            # whole MoE (reference numerics)

Start-up: ``warmup_sizes_linear`` / ``warmup_sizes_fused_moe`` name the token counts whose calls
compile every kernel variant a layer can launch (the layers' ``warmup`` runs them).

Layout and numerics: :mod:`.layout`; kernels: :mod:`.triton_w4`; configs: :mod:`.select`.
"""

from .api import (MODES, moe_routing, w4_dequantize, w4_fused_moe, w4_grouped, w4_linear, w4_masked,
                  warmup_sizes_fused_moe, warmup_sizes_linear)
from .layout import HopperW4Layout, PackedW4Weight, dequantize_packed, prepack, unpack
from .select import DequantMmConfig, GluonConfig, TritonMmaConfig, TritonWgmmaConfig, W4Config, select_config

__all__ = ["MODES", "DequantMmConfig", "GluonConfig", "HopperW4Layout", "PackedW4Weight", "TritonMmaConfig",
           "TritonWgmmaConfig", "W4Config", "dequantize_packed", "moe_routing", "prepack",
           "select_config", "unpack", "w4_dequantize", "w4_fused_moe", "w4_grouped", "w4_linear", "w4_masked",
           "warmup_sizes_fused_moe", "warmup_sizes_linear"]
