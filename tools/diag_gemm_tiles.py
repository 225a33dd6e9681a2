"""Every GEMM tile shape (and the default selection) against the reference, in ulps, on the shapes that once
exposed the register-A wgmma race (gemm/NOTES.md). Run from the repository root on a GPU:
python tools/diag_gemm_tiles.py"""
import sys

import torch

sys.path.insert(0, ".")
import tests.gemm_cases as T  # noqa: E402
from nvfp4_plugin.gemm import prepack, w4_linear  # noqa: E402
from nvfp4_plugin.gemm.select import DequantMmConfig, TritonWgmmaConfig, select_config  # noqa: E402
cfgs = {"wg128": TritonWgmmaConfig(bn=128, bm=128, bk=64, num_warps=8, num_stages=4),
        "wg128s3": TritonWgmmaConfig(bn=128, bm=128, bk=64, num_warps=8, num_stages=3),
        "wg64": TritonWgmmaConfig(bn=128, bm=64, bk=64, num_warps=8, num_stages=4),
        "v3_16": T.V3_16, "bn128": T.BN128, "v2_8": T.V2_8, "dq": DequantMmConfig()}
for dtype in (torch.bfloat16, torch.float16):
    for (n, k) in [(4096, 1024), (1024, 2048), (4096, 4096)]:
        w = T.make_weight((), n, k, seed=n)
        p = prepack(w, dtype)
        for m in (128, 256, 1000, 1024, 2048):
            x = T.act((m, k), dtype, seed=k + m)
            y_ref = T.dense_ref(x, w)
            res = {name: round(T.ulp_error(w4_linear(x, p, config=c), y_ref, dtype, "d"), 2) for name, c in cfgs.items()}
            d = select_config("dense", m, n, k, device=x.device)
            res["default"] = round(T.ulp_error(w4_linear(x, p), y_ref, dtype, "d"), 2)
            bad = {k_: v for k_, v in res.items() if v > 2}
            print(str(dtype)[6:], n, k, m, "BAD" if bad else "ok", bad or "", "default:", d)
