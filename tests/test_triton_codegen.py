"""The GPU code paths of the Triton kernels, compiled for sm_90a on the CPU (no GPU needed).

The interpreter tests run the kernels' interpreter branches; this compiles the branches only a GPU
runs (hardware FP8 conversion, round-toward-zero adds, NaN-ignoring ``max.f32``) through Triton's
real pipeline down to PTX and SASS, and checks the numerics contract on the generated code: no
flush-to-zero, no approximate division, no fused multiply-add contraction by the compiler, IEEE
``div.rn.f32`` where the recipe divides. The one hand-written PTX block (the packed E2M1 encoder of
``_jit_numerics.e2m1_words``) uses ``fma`` on purpose, as single-rounding operations; it is
counted apart. Runs in a subprocess (the kernels must not be built for the
interpreter, which other test modules of the same session switch on).
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests._require import skip_module

# not imported here: the compile checks run in child processes without TRITON_INTERPRET (which
# tests/conftest.py sets for this process before anything imports triton)
if importlib.util.find_spec("triton") is None:
    skip_module("triton", "triton is not installed")

SCRIPT = r'''
import json, re, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction


class _CompileOnlyDriver:  # enough of a CUDA driver for Triton to compile (never to launch)
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


driver.set_active(_CompileOnlyDriver())
compiled = []
_run = JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    compiled.append((self.fn.__name__, kernel))
    return kernel


JITFunction.run = _compile_only
from nvfp4_plugin.triton import _runtime as rt
rt.check_device = lambda name, t: None
rt.hw_fp8 = lambda device: True
from nvfp4_plugin.triton import mx, nvfp4, scale_search, staging
from nvfp4_plugin.gemm import moe_glue


def on_gpu_path(call):  # moe_glue takes its torch fallback for CPU tensors; this takes the kernel path
    def run():
        interpreting, rt.interpreting = rt.interpreting, lambda: True
        try:
            return call()
        finally:
            rt.interpreting = interpreting
    return run


x = torch.zeros(64, 512, dtype=torch.bfloat16)
gs = torch.ones(1)
cases = [
    ("scaled_fp4_quant", lambda: nvfp4.scaled_fp4_quant(x, gs)),
    ("scaled_fp4_quant_ue8m0", lambda: nvfp4.scaled_fp4_quant(x, gs, swizzle=False, scale_format="ue8m0")),
    ("nvfp4_forward", lambda: nvfp4.nvfp4_forward(x, gs)),
    ("nvfp4_forward_dynamic_gs", lambda: nvfp4.nvfp4_forward(x)),   # + the finite-amax pass
    ("nvfp4_forward_sr", lambda: nvfp4.nvfp4_forward(x.float(), gs, True, seed=1)),
    ("mxfp4_quantize_sr", lambda: mx.mxfp4_quantize(x, stochastic_rounding=True, seed=1)),
    ("mxfp4_forward_rceil", lambda: mx.mxfp4_forward(x.half(), scale_recipe="rceil")),
    ("mxfp8_quantize", lambda: mx.mxfp8_quantize(x)),
    ("mxfp8_forward_e5m2_sr", lambda: mx.mxfp8_forward(x, "e5m2", True, seed=1)),
    ("staging", lambda: staging.stage_deepseek_v4_mega_moe_inputs(
        x, torch.zeros(64, 8), torch.zeros(64, 8, dtype=torch.int32), torch.empty(64, 256, dtype=torch.uint8),
        torch.empty(64, 8, dtype=torch.int32), torch.empty(64, 8, dtype=torch.int64), torch.empty(64, 8))),
    ("scale_search", lambda: scale_search.search_block_scales(x.float(), gs)),
    ("scale_search_weighted", lambda: scale_search.search_block_scales(x.float(), gs, col_weight=torch.ones(512))),
    ("moe_routing", on_gpu_path(lambda: moe_glue.moe_routing(torch.zeros(16, 8, dtype=torch.int32), 128))),
    ("moe_routing_blocks", on_gpu_path(lambda: moe_glue.moe_routing(torch.zeros(8192, 8, dtype=torch.int32), 128))),
    ("moe_silu_and_mul", on_gpu_path(lambda: moe_glue.silu_and_mul(x))),
    ("moe_combine", on_gpu_path(lambda: moe_glue.moe_combine(torch.zeros(64 * 8, 512, dtype=torch.bfloat16),
                                                             torch.zeros(64, 8), torch.zeros(64, 8, dtype=torch.int32),
                                                             128))),
]
report = {}
inline = re.compile(r"// begin inline asm(?:(?!// end inline asm).)*?mul\.sat\.f32.*?// end inline asm", re.S)
for name, call in cases:
    compiled.clear()
    call()
    assert compiled, f"{name}: no kernel was compiled"
    fn, kernel = compiled[-1]
    ptx = kernel.asm["ptx"]
    asm = "".join(inline.findall(ptx))
    ptx = inline.sub("", ptx)  # the compiler's own code; the hand-written E2M1 encoder is checked apart
    report[name] = {
        "kernel": fn,
        "kernels": [f for f, _ in compiled],
        "all_cubins": all(len(k.asm["cubin"]) > 0 for _, k in compiled),
        "ftz": ptx.count(".ftz"),
        "approx": ptx.count(".approx"),
        "fma": ptx.count("fma.rn"),
        "div_rn": ptx.count("div.rn.f32"),
        "add_rz": ptx.count("add.rz.f32"),
        "cvt_e4m3": ptx.count("e4m3x2.f32"),
        "cubin_bytes": len(kernel.asm["cubin"]),
        "asm_e2m1": asm.count("mul.sat.f32"),
        "asm_fma_rn": asm.count("fma.rn.f32"),
        "asm_fma_rz": asm.count("fma.rz.f32"),
    }
print(json.dumps(report))
'''


def test_gpu_code_paths_compile_for_sm90_and_keep_ieee_semantics():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    if res.returncode != 0 and ("ptxas" in res.stderr and "not found" in res.stderr):
        pytest.skip("Triton's bundled ptxas is not available")
    assert res.returncode == 0, res.stderr[-4000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    for name, r in report.items():
        assert r["ftz"] == 0 and r["approx"] == 0, (name, r)  # no flush-to-zero, no approximate math
        assert r["fma"] == 0, (name, r)                        # fp fusion off: every op rounds on its own
        assert r["cubin_bytes"] > 0 and r["all_cubins"], name
    assert report["nvfp4_forward_dynamic_gs"]["kernels"] == ["_finite_amax_kernel", "_nvfp4_kernel"]
    for name, kernel in (("moe_routing", "_route_kernel"), ("moe_silu_and_mul", "_silu_mul_kernel"),
                         ("moe_combine", "_combine_kernel"), ("scale_search", "_mse_scale_kernel")):
        assert report[name]["kernels"] == [kernel], (name, report[name]["kernels"])
    assert report["moe_routing_blocks"]["kernels"] == ["_route_hist_kernel", "_route_scan_kernel",
                                                       "_route_block_place_kernel"], report["moe_routing_blocks"]
    for name in ("scaled_fp4_quant", "nvfp4_forward", "staging"):
        assert report[name]["div_rn"] > 0, name                # IEEE 1 / s and s / gs
        assert report[name]["cvt_e4m3"] > 0, name              # hardware E4M3 rounding of the scales
    for name in ("nvfp4_forward_sr", "mxfp8_forward_e5m2_sr"):
        assert report[name]["add_rz"] > 0, name                # exact floor(q + u) of the stochastic rounding
    assert report["mxfp8_quantize"]["cvt_e4m3"] > 0
    # packed E2M1 output goes through the inline-PTX encoder: 8 values per block, each a saturating
    # multiply and three single-rounding candidates (fma.rn; fma.rz + add.rz when stochastic)
    # (the block appears once per word a thread packs)
    for name in ("scaled_fp4_quant", "scaled_fp4_quant_ue8m0", "staging", "mxfp4_quantize_sr"):
        r = report[name]
        assert r["asm_e2m1"] > 0 and r["asm_e2m1"] % 8 == 0, (name, r)
        assert r["asm_fma_rz" if name.endswith("_sr") else "asm_fma_rn"] == 3 * r["asm_e2m1"], (name, r)
    for name in ("nvfp4_forward", "mxfp8_quantize", "mxfp4_forward_rceil"):
        assert report[name]["asm_e2m1"] == 0, name  # no packed E2M1 there
