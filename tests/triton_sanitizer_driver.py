"""Runs every Triton quantization kernel once on awkward shapes, for compute-sanitizer:

    compute-sanitizer --tool memcheck  --error-exitcode 1 python3 tests/triton_sanitizer_driver.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python3 tests/triton_sanitizer_driver.py

Covers the block tiles' masking (rows past M, K not a multiple of the tile, a single row), the packed
word stores and the byte stores of strided staging outputs, the swizzled scales' padding, the
coalesced fake-quant stores through shared memory, bf16 / fp16 / fp32 inputs (fp32 takes the
unpacked E2M1 encoder path) and the stochastic paths. Values include NaN and inf. Prints one line
per kernel family and "triton sanitizer driver: ok" at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda_sanitizer_driver import act  # noqa: E402  (same inputs: NaN, inf and zeros mixed in)
from nvfp4_plugin import numerics as nx  # noqa: E402
from nvfp4_plugin.triton import mx, nvfp4, staging  # noqa: E402


def main() -> int:
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for m, k in ((1, 16), (7, 48), (130, 2064), (33, 7168)):
            x = act(m, k, dtype)
            gs = nx.tensor_global_scale(x.cpu()).reshape(1).cuda()
            for swizzle in (True, False):
                nvfp4.scaled_fp4_quant(x, gs, swizzle=swizzle)
            nvfp4.scaled_fp4_quant(x, gs, swizzle=True, scale_format="ue8m0")
            nvfp4.nvfp4_forward(x, gs)
            nvfp4.nvfp4_forward(x)
            nvfp4.nvfp4_forward(x, gs, True, seed=3)
    print("nvfp4: scaled_fp4_quant, nvfp4_forward (given / dynamic / stochastic)")

    for dtype in (torch.bfloat16, torch.float32):
        for m, k in ((1, 32), (7, 96), (130, 2080), (33, 7168)):
            x = act(m, k, dtype, 1)
            for sr in (False, True):
                mx.mxfp4_quantize(x, stochastic_rounding=sr, seed=5)
                mx.mxfp4_forward(x, sr, seed=5)
                for fmt in ("e4m3", "e5m2"):
                    mx.mxfp8_quantize(x, fmt, stochastic_rounding=sr, seed=5)
                    mx.mxfp8_forward(x, fmt, sr, seed=5)
            mx.mxfp4_quantize(x, scale_recipe="rceil")
    print("mx: mxfp4 / mxfp8 quantize and forward, deterministic and stochastic")

    for dtype in (torch.bfloat16, torch.float32):
        for m, k, top_k in ((1, 128, 1), (7, 7168, 8), (130, 384, 6)):
            h = act(m, k, dtype, 2)
            w = torch.rand(m, top_k, device="cuda")
            ids = torch.randint(0, 256, (m, top_k), device="cuda", dtype=torch.int32)
            outs = (torch.empty(m, k // 2, dtype=torch.uint8, device="cuda"),
                    torch.empty(m, k // 64, dtype=torch.int32, device="cuda"),
                    torch.empty(m, top_k, dtype=torch.int64, device="cuda"), torch.empty(m, top_k, device="cuda"))
            staging.stage_deepseek_v4_mega_moe_inputs(h, w, ids, *outs)
            # strided packed output (row stride 2 bytes longer, not a multiple of 4): the byte-store path
            big = torch.empty(m, k // 2 + 2, dtype=torch.uint8, device="cuda")
            staging.stage_deepseek_v4_mega_moe_inputs(h, w, ids, big[:, : k // 2], *outs[1:])
    print("staging: word and byte stores")
    torch.cuda.synchronize()
    print("triton sanitizer driver: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
