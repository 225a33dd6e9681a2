"""Our FP8 quantizers against the peers' kernels on the same inputs (GPU; skips when a peer is absent).

The rule (nvfp4_plugin/numerics.py, measured on the H200 with sgl-kernel 0.4.5 and vLLM 0.26.0): our
element multipliers are correctly rounded (448 / a, 1 / s). sgl-kernel is built with fast-math
(``448 * rcp.approx(a)``, ``rcp.approx(s)``) and vLLM divides x by the scale, so codes may differ by
one e4m3 step on values within an ulp of a rounding midpoint. Scales: per-token-group fp32 and UE8M0
equal sgl-kernel's (UE8M0 codes too); per-token equals vLLM's ``amax / 448`` and differs from
sgl-kernel's ``amax * fp32(1/448)`` by at most one ulp; per-tensor dynamic equals vLLM's, bytes and all.
vLLM's per-token-group scale is ``amax / 448`` (a division), so those differ by at most one ulp.
Degenerate inputs differ on purpose (numerics docstring): NaN stays NaN with us (peers that clamp
with fminf/fmaxf turn it into +-448), +-inf saturates to +-448 (peers: NaN or 0).
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


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest difference between positive fp32 values in units in the last place."""
    a, b = a.float().contiguous(), b.float().contiguous()
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max().item()) if a.numel() else 0


def compare(name, ours, theirs, exact: bool, scales_exact: bool = True):
    (q, s), (pq, ps) = ours, theirs
    s, ps = s.float().reshape(s.shape[0], -1), ps.float().reshape(ps.shape[0], -1)
    assert s.shape[1] <= ps.shape[1], (name, s.shape, ps.shape)
    ps = ps[:, : s.shape[1]]
    q_diff = int((q.view(torch.uint8) != pq.view(torch.uint8)).sum())
    s_diff = int((s != ps).sum())
    dist, s_ulps = code_distance(q, pq), ulp_distance(s, ps)
    print(f"{name}: {q_diff} of {q.numel()} codes differ (max code distance {dist}), {s_diff} of {s.numel()} scales "
          f"(max {s_ulps} ulp)")
    if exact:
        assert q_diff == 0 and s_diff == 0, name
        return
    assert dist <= 1, name
    assert s_diff == 0 if scales_exact else s_ulps <= 1, name


def test_sgl_kernel_per_token_group(env):
    ops, loaded = env
    fn = loaded["peers"].get("sgl_kernel.fp8_group")
    if fn is None:
        pytest.skip(f"sgl_kernel not importable: {loaded['missing'].get('sgl_kernel')}")
    for x in inputs():
        compare(f"sgl group {tuple(x.shape)}", ops.per_token_group_quant_fp8(x), fn(x), exact=False)


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
        compare(f"sgl token {tuple(x.shape)}", ops.per_token_quant_fp8(x), fn(x), exact=False, scales_exact=False)


def test_vllm_fp8_quantizers(env):
    ops, loaded = env
    peers = loaded["peers"]
    if not any(n.startswith("vllm.") for n in peers):
        pytest.skip(f"vllm not importable: {loaded['missing'].get('vllm')}")
    for x in inputs():
        if "vllm.fp8_group" in peers:
            compare(f"vllm group {tuple(x.shape)}", ops.per_token_group_quant_fp8(x), peers["vllm.fp8_group"](x),
                    exact=False, scales_exact=False)
        if "vllm.fp8_token" in peers:
            compare(f"vllm token {tuple(x.shape)}", ops.per_token_quant_fp8(x), peers["vllm.fp8_token"](x), exact=False)
        if "vllm.fp8_tensor_dynamic" in peers:
            compare(f"vllm tensor {tuple(x.shape)}", ops.scaled_fp8_quant(x), peers["vllm.fp8_tensor_dynamic"](x),
                    exact=True)
