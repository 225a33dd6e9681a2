"""Runs every compiled quantization op once on small shapes, for compute-sanitizer:

    compute-sanitizer --tool memcheck  --error-exitcode 1 python3 tests/cuda_sanitizer_driver.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python3 tests/cuda_sanitizer_driver.py

Covers every kernel family and path: dense (swizzled / linear, e4m3 / UE8M0, bf16 / fp16 / fp32,
padding rows and columns), experts with empty experts and rows past the last offset, masked with
and without SiLU and zero fill, SiLU-and-mul, FP8 static, dynamic (fused and two-pass), per-token
(register and long-row paths), per-token-group in the three scale layouts. Values include NaN/inf.
Prints one line per op and "sanitizer driver: ok" at the end.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nvfp4_plugin import _ext  # noqa: E402
from nvfp4_plugin import numerics as nx  # noqa: E402


def act(m, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    if x.numel() > 8:
        x.view(-1)[::97] = math.nan
        x.view(-1)[5::89] = math.inf
        x.view(-1)[7::83] = 0.0
    return x.to(dtype).cuda()


def main() -> int:
    why = _ext.extension_runs_on(torch.device("cuda"))
    if why is not None:
        print(f"nvfp4_plugin._C does not run here: {why}")
        return 1
    from nvfp4_plugin import _cuda_ops as ops

    done = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for m, k in ((1, 16), (7, 48), (130, 272)):
            x = act(m, k, dtype)
            gs = nx.tensor_global_scale(x).reshape(1)
            for swizzle in (True, False):
                for fmt in ("e4m3", "ue8m0"):
                    ops.scaled_fp4_quant(x, gs, swizzle=swizzle, scale_format=fmt)
    # larger inputs (csrc dense_tiling): 2213 x 2048 takes the one-wave row-block kernel (several row steps per
    # CTA in the grid-wide order), 3 L2 sizes at K=2048 and 6 at K=1040 (padding columns) the tapered chunks
    l2 = torch.cuda.get_device_properties(0).L2_cache_size or 50 << 20
    for k, m in ((2048, 2213), (2048, (3 * l2) // 4096 + 165), (1040, (6 * l2) // 2080 + 165)):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        ops.scaled_fp4_quant(x, nx.tensor_global_scale(x).reshape(1), swizzle=True)
        del x
    done.append("scaled_fp4_quant")

    for dtype in (torch.bfloat16, torch.float16):
        x = act(200, 96, dtype, 1)
        eo = torch.tensor([0, 0, 37, 37, 150, 190], dtype=torch.int32, device="cuda")  # empty experts, 10 tail rows
        bo = nx.blockscale_offsets_from_expert_offsets(eo)
        ops.scaled_fp4_experts_quant(x, torch.rand(5, device="cuda") + 0.1, eo, bo)
    # an input of 6 L2 sizes: the experts chunks kernel (csrc experts_tiling), padding columns
    rows = (6 * l2) // (1040 * 2) + 165
    x = torch.randn(rows, 1040, device="cuda").to(torch.bfloat16)
    cuts = sorted(torch.randint(0, rows - 10, (4,)).tolist())
    eo = torch.tensor([0, 0, *cuts, rows - 10], dtype=torch.int32, device="cuda")  # an empty expert, 10 tail rows
    bo = nx.blockscale_offsets_from_expert_offsets(eo)
    ops.scaled_fp4_experts_quant(x, torch.rand(6, device="cuda") + 0.1, eo, bo)
    # blockscale offsets off the 128-row grid (outside the contract; the reference's bytes all the same)
    bo = bo.clone()
    bo[1:] += 64
    ops.scaled_fp4_experts_quant(x, torch.rand(6, device="cuda") + 0.1, eo, bo)
    del x
    # 4 L2 sizes at K=2048: the chunks kernel with its bulk-copy ring (csrc bulk_ring.cuh), 10 tail rows
    rows = (4 * l2) // 4096 + 165
    x = torch.randn(rows, 2048, device="cuda").to(torch.bfloat16)
    cuts = sorted(torch.randint(0, rows - 10, (4,)).tolist())
    eo = torch.tensor([0, 0, *cuts, rows - 10], dtype=torch.int32, device="cuda")
    ops.scaled_fp4_experts_quant(x, torch.rand(6, device="cuda") + 0.1, eo, nx.blockscale_offsets_from_expert_offsets(eo))
    del x
    done.append("scaled_fp4_experts_quant")

    for dtype in (torch.bfloat16, torch.float32):
        for silu in (True, False):
            width = 2 * 48 if silu else 48
            x = act(6 * 130, width, dtype, 2).reshape(6, 130, width)
            mask = torch.tensor([0, 1, 130, 200, 64, 3], dtype=torch.int32, device="cuda")
            gs = torch.rand(6, device="cuda") + 0.1
            ops.silu_and_mul_scaled_fp4_experts_quant(x, gs, mask, use_silu_and_mul=silu)
            out = torch.zeros((6, 130, 24), dtype=torch.uint8, device="cuda")
            sf = torch.zeros((6, 256, 4), dtype=torch.float8_e4m3fn, device="cuda")
            ops.silu_and_mul_scaled_fp4_experts_quant(x, gs, mask, use_silu_and_mul=silu, output=out, output_scale=sf)
    # an input of 3 L2 sizes, bf16 SiLU table: the row kernel by default; the 8-row-group kernel when run
    # with NVFP4_PLUGIN_QUANT_TILING=groups (csrc masked_uses_groups takes it only from 16 L2 sizes)
    max_m = (3 * l2) // (8 * 2080 * 2) + 37
    x = torch.randn(8, max_m, 2080, device="cuda").to(torch.bfloat16)
    mask = torch.tensor([0, 1, 127, 128, 129, max_m, max_m + 5, max_m // 2], dtype=torch.int32, device="cuda")
    gs = torch.rand(8, device="cuda") + 0.1
    ops.silu_and_mul_scaled_fp4_experts_quant(x, gs, mask)
    out = torch.zeros((8, max_m, 520), dtype=torch.uint8, device="cuda")
    sf = torch.zeros((8, *nx.swizzled_scale_shape(max_m, 65)), dtype=torch.float8_e4m3fn, device="cuda")
    ops.silu_and_mul_scaled_fp4_experts_quant(x, gs, mask, output=out, output_scale=sf)
    del x, out, sf
    done.append("silu_and_mul_scaled_fp4_experts_quant")

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        ops.silu_and_mul(act(33, 2 * 64, dtype, 3))      # 16-value units
        ops.silu_and_mul(act(33, 2 * 24, dtype, 3))      # 8-value units (I % 16 != 0)
    from nvfp4_plugin import _cuda_ops
    x = act(33, 2 * 64, torch.bfloat16, 3)
    _cuda_ops.silu_and_mul_into(x, torch.empty(33, 64, dtype=x.dtype, device="cuda"), 1)   # the bf16 SiLU table
    done.append("silu_and_mul")

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = act(9, 21, dtype, 4)  # odd sizes: vector chunks and a scalar tail
        ops.scaled_fp8_quant(x)
        ops.scaled_fp8_quant(x, torch.tensor([0.5], device="cuda"))
        ops.scaled_fp8_quant(act(300, 512, dtype, 5))  # two-pass dynamic path (memset + atomicMax)
        ops.per_token_quant_fp8(act(5, 64, dtype, 6))
        ops.per_token_quant_fp8(act(2, 70000, dtype, 7))  # rows longer than the register path
        xg = act(7, 640, dtype, 8)
        ops.per_token_group_quant_fp8(xg)
        ops.per_token_group_quant_fp8(xg, column_major_scales=True)
        ops.per_token_group_quant_fp8(xg, column_major_scales=True, scale_ue8m0=True)
        ops.per_token_group_quant_fp8(act(3, 64, dtype, 9), 16)
        # group 128 with a partial last warp (units % 32 == 8), and a large input
        ops.per_token_group_quant_fp8(act(3, 128, dtype, 10))
        ops.per_token_group_quant_fp8(act(4099, 7168, dtype, 11), column_major_scales=True, scale_ue8m0=True)
    done += ["scaled_fp8_quant", "per_token_quant_fp8", "per_token_group_quant_fp8"]

    torch.cuda.synchronize()
    for name in done:
        print(f"ran {name}")
    print("sanitizer driver: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
