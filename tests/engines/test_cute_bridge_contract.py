"""The CuTe-DSL bridge (nvfp4_plugin/cute_bridge.py) against the installed flashinfer-python, on the CPU:
FlashInfer's own scale-factor helpers read the scales we hand its masked grouped GEMM, and that kernel's
constructor and launch signature take our call (read from its source: the module itself needs
nvidia-cutlass-dsl, which this environment leaves out)."""

import ast
import importlib.util

import pytest
import torch

from tests._require import require

flashinfer = require("flashinfer")

from nvfp4_plugin import cute_bridge as cb  # noqa: E402
from nvfp4_plugin import numerics as nx  # noqa: E402
from nvfp4_plugin.weights import Nvfp4Weight  # noqa: E402

E, N, K = 3, 160, 192


def _kernel_class_source():
    spec = importlib.util.find_spec(cb.MASKED_KERNEL_MODULE)
    assert spec is not None, f"{cb.MASKED_KERNEL_MODULE} not in flashinfer {flashinfer.__version__}"
    tree = ast.parse(open(spec.origin).read())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MaskedBatchedMatmulCuteDSL")


def _params(cls: ast.ClassDef, method: str) -> list[str]:
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == method)
    return [a.arg for a in fn.args.args + fn.args.kwonlyargs][1:]


def test_masked_kernel_signature_takes_our_call():
    assert flashinfer.__version__ == "0.6.14"
    cls = _kernel_class_source()
    names = ("Float4E2M1FN", "Float8E4M3FN", "Float32", "BFloat16", "Float16", "Int32")
    dtypes = type("Dtypes", (), {n: n for n in names})  # stands in for the cutlass module
    key = cb.KernelKey("masked", E, N, K, 64, "bfloat16")
    ours = cb._masked_kernel_kwargs(key, 148, dtypes)
    init = _params(cls, "__init__")
    assert set(ours) <= set(init), set(ours) - set(init)
    assert ours["sm_version"] == "sm_100" and cb._masked_kernel_kwargs(
        cb.KernelKey("masked", E, N, K, 64, "bfloat16", arch="sm_103a"), 148, dtypes)["sm_version"] == "sm_103"
    # the launch: 14 pointers in our order, then the stream
    assert _params(cls, "__call__") == [*cb.MASKED_POINTER_ARGS, "current_stream"]
    assert len(cb._masked_ptr_dtypes(dtypes, key)) == len(cb.MASKED_POINTER_ARGS)


def test_flashinfers_unswizzle_reads_our_scales():
    from flashinfer.gemm.gemm_bf16_fp4 import _unswizzle_sf_128x4

    g = torch.Generator().manual_seed(0)
    w = Nvfp4Weight.quantize(torch.randn(E, N, K, generator=g) * 0.05)
    cw = cb.prepare_weights(w)
    kb = K // 16
    for e in range(E):  # 3D weight side
        got = _unswizzle_sf_128x4(cw.scale[e], N, kb).reshape(N, kb)
        assert torch.equal(got, w.block_scale[e].view(torch.uint8))
    # masked activations, expert by expert
    x = torch.randn(E, 40, K, generator=g).bfloat16()
    mm = torch.tensor([0, 17, 40], dtype=torch.int32)
    acts = cb.quantize_masked(x, torch.tensor([100.0, 200.0, 300.0]), mm)
    ours = nx.unswizzle_blockscale(acts.scale, 40, kb).view(torch.uint8)
    for e in range(E):
        assert torch.equal(_unswizzle_sf_128x4(acts.scale[e], 40, kb).reshape(40, kb), ours[e])
    # the contiguous layout's 2D side: each expert's block from its block-scale offset
    counts = [5, 0, 130]
    eo = torch.tensor([0, 5, 5, 135], dtype=torch.int32)
    xc = torch.randn(138, K, generator=g).bfloat16()
    ca = cb.quantize_contiguous(xc, torch.tensor([10.0, 20.0, 30.0]), eo)
    bs = nx.blockscale_offsets_from_expert_offsets(eo)
    for e, c in enumerate(counts):
        if c == 0:
            continue
        block = ca.scale[bs[e]:bs[e] + nx.round_up(c, 128)]
        _, lin, _ = cb.quantize_to_nvfp4(xc[eo[e]:eo[e + 1]], torch.tensor([10.0, 20.0, 30.0])[e])
        assert torch.equal(_unswizzle_sf_128x4(block, c, kb).reshape(c, kb), lin.view(torch.uint8))


def test_flashinfers_mma_layout_helper_gives_our_6d_view():
    """FlashInfer's convert_sf_to_mma_layout (the SFA/SFB layout of its CuTe-DSL kernels) over our
    per-expert swizzled scales: the element (m, kb) of expert e is our linear scale."""
    if importlib.util.find_spec("cutlass") is None:
        pytest.skip("flashinfer.cute_dsl.utils needs nvidia-cutlass-dsl")
    from flashinfer.cute_dsl.utils import convert_sf_to_mma_layout

    x = torch.randn(E, 200, K, generator=torch.Generator().manual_seed(1)).bfloat16()
    acts = cb.quantize_masked(x, torch.ones(E), torch.tensor([200, 3, 129], dtype=torch.int32))
    six = convert_sf_to_mma_layout(acts.scale.view(torch.uint8), 200, K, num_groups=E)
    lin = nx.unswizzle_blockscale(acts.scale, 200, K // 16).view(torch.uint8)
    for e, m, k in [(0, 199, 11), (1, 2, 0), (2, 128, 4), (0, 37, 6)]:
        assert six[m % 32, m // 32 % 4, m // 128, k % 4, k // 4, e] == lin[e, m, k]
