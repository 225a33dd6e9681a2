"""Our FP8 quantizers against the peers' kernels on the same inputs (GPU; skips when a peer is absent).

sgl-kernel (0.4.5 recipe, which numerics.py adopts): byte-identical on finite inputs.
vLLM: its per-token-group scale is amax / 448 (a division; ours and sgl-kernel's: amax * fp32(1/448))
and it divides x by the scale (we multiply by 448 / amax); its per-token scale is clamped below at
1 / (448 * 512) and it divides by it. Those differences are reported (counts and the largest code
distance), and asserted to stay within one e4m3 step.
Degenerate inputs differ on purpose (numerics docstring): NaN stays NaN with us (peers that clamp
with fminf/fmaxf turn it into 448), +-inf saturates to +-448 (peers: NaN or 0).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from nvfp4_plugin import _ext

pytestmark = pytest.mark.gpu

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_quant.py"


@pytest.fixture(scope="module")
def env():
    if _ext.extension_runs_on(torch.device("cuda")) is not None:
        pytest.skip("nvfp4_plugin._C does not run here")
    spec = importlib.util.spec_from_file_location("bench_quant", _BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from nvfp4_plugin import _cuda_ops

    return _cuda_ops, bench.load_peers()


def inputs():
    g = torch.Generator(device="cuda").manual_seed(0)
    for m, k in ((1, 7168), (128, 2048), (1000, 7168), (4099, 4096)):
        x = torch.randn(m, k, generator=g, device="cuda") * torch.exp(torch.randn(m, 1, generator=g, device="cuda"))
        yield x.to(torch.bfloat16)
    yield (torch.randn(64, 512, generator=g, device="cuda") * 3).to(torch.float16)


def code_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest difference between e4m3 codes as ordered integers (sign-magnitude)."""
    def ordered(t):
        u = t.view(torch.uint8).to(torch.int32)
        return torch.where(u >= 128, -(u - 128), u)

    return int((ordered(a) - ordered(b)).abs().max().item()) if a.numel() else 0


def compare(name, ours, theirs, exact: bool):
    (q, s), (pq, ps) = ours, theirs
    s, ps = s.float().reshape(s.shape[0], -1), ps.float().reshape(ps.shape[0], -1)
    q_diff = int((q.view(torch.uint8) != pq.view(torch.uint8)).sum())
    s_diff = int((s != ps[:, : s.shape[1]]).sum()) if s.shape[1] <= ps.shape[1] else -1
    dist = code_distance(q, pq)
    print(f"{name}: {q_diff} of {q.numel()} codes differ (max code distance {dist}), {s_diff} of {s.numel()} scales")
    if exact:
        assert q_diff == 0 and s_diff == 0, name
    else:
        assert dist <= 1, name


def test_sgl_kernel_per_token_group(env):
    ops, loaded = env
    fn = loaded["peers"].get("sgl_kernel.fp8_group")
    if fn is None:
        pytest.skip(f"sgl_kernel not importable: {loaded['missing'].get('sgl_kernel')}")
    for x in inputs():
        compare(f"sgl group {tuple(x.shape)}", ops.per_token_group_quant_fp8(x), fn(x), exact=True)


def test_sgl_kernel_per_token_group_ue8m0(env):
    ops, loaded = env
    fn = loaded["peers"].get("sgl_kernel.fp8_group_ue8m0")
    if fn is None:
        pytest.skip("sgl_kernel not importable")
    for x in inputs():
        q, s = ops.per_token_group_quant_fp8(x, column_major_scales=True, scale_ue8m0=True)
        pq, ps = fn(x)
        assert torch.equal(q.view(torch.uint8), pq.view(torch.uint8)), tuple(x.shape)
        assert torch.equal(s, ps), tuple(x.shape)


def test_sgl_kernel_per_token(env):
    ops, loaded = env
    fn = loaded["peers"].get("sgl_kernel.fp8_token")
    if fn is None:
        pytest.skip("sgl_kernel not importable")
    for x in inputs():
        compare(f"sgl token {tuple(x.shape)}", ops.per_token_quant_fp8(x), fn(x), exact=True)


def test_vllm_fp8_quantizers(env):
    ops, loaded = env
    peers = loaded["peers"]
    if not any(n.startswith("vllm.") for n in peers):
        pytest.skip(f"vllm not importable: {loaded['missing'].get('vllm')}")
    for x in inputs():
        if "vllm.fp8_group" in peers:
            compare(f"vllm group {tuple(x.shape)}", ops.per_token_group_quant_fp8(x), peers["vllm.fp8_group"](x),
                    exact=False)
        if "vllm.fp8_token" in peers:
            compare(f"vllm token {tuple(x.shape)}", ops.per_token_quant_fp8(x), peers["vllm.fp8_token"](x), exact=False)
        if "vllm.fp8_tensor_dynamic" in peers:
            compare(f"vllm tensor {tuple(x.shape)}", ops.scaled_fp8_quant(x), peers["vllm.fp8_tensor_dynamic"](x),
                    exact=True)
