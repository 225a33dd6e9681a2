"""bench_moe's SGLang peer, the bf16 fused MoE that SGLang's server runs on Hopper (in place, the MoE
runner's default): it resolves in this SGLang, is called with arguments its op takes, on a copy of the
input, and SGLang's path reaches its first kernel outside a server (the benchmark times it on the GPU
machine; the op itself is registered for CUDA only)."""

import pytest
import torch

from tests._require import require

sglang = require("sglang")


def _tiny():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    w13 = torch.randn(2, 64, 64, generator=g).to(torch.bfloat16)
    w2 = torch.randn(2, 64, 32, generator=g).to(torch.bfloat16)
    return x, w13, w2, torch.ones(4, 1), torch.zeros(4, 1, dtype=torch.int32)


def test_sglang_bf16_peer_resolves_with_its_arguments():
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import inplace_fused_experts

    from benchmarks import bench_moe as M

    peer, reason = M._sglang_bf16()
    assert peer is not None, reason
    # a registered torch op: its schema names the arguments (the [gate; up] layout is asked for by name)
    assert {"hidden_states", "w1", "w2", "topk_weights", "topk_ids", "gate_up_interleaved"} <= M._arg_names(
        inplace_fused_experts)


def test_sglang_bf16_peer_runs_on_a_copy_of_its_input(monkeypatch):
    import sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe as F

    from benchmarks import bench_moe as M

    calls = []

    def fake(hidden_states, w1, w2, topk_weights, topk_ids, gate_up_interleaved=True):
        calls.append((hidden_states.data_ptr(), gate_up_interleaved))
        hidden_states.mul_(2)

    monkeypatch.setattr(F, "inplace_fused_experts", fake)
    peer, reason = M._sglang_bf16()
    assert peer is not None, reason
    x, w13, w2, w, ids = _tiny()
    x0 = x.clone()
    out1 = peer(x, w13, w2, w, ids)
    out2 = peer(x, w13, w2, w, ids)
    assert torch.equal(x, x0)                       # the input is never overwritten
    assert torch.equal(out2, x0 * 2)                # each call starts again from the input
    assert out1.data_ptr() == out2.data_ptr() != x.data_ptr()
    assert calls == [(out1.data_ptr(), False)] * 2


def test_sglang_path_reaches_its_first_kernel_outside_a_server(monkeypatch):
    """The server config SGLang's kernels read (published by ``_sglang_default_config`` when no server did)
    and its in-place path up to the first kernel launch, which is replaced here."""
    import sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe as F
    from sglang.srt.runtime_context import get_exec

    from benchmarks import bench_moe as M

    class Reached(Exception):
        pass

    def stop(*args, **kwargs):
        raise Reached

    M._sglang_default_config()
    M._sglang_default_config()                      # a second call keeps the published config
    assert get_exec().deterministic.enable_deterministic_inference is False
    monkeypatch.setattr(F, "moe_align_block_size", stop)
    # its tuned-config lookup names the GPU, which a CPU machine has not got
    import sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config as C
    monkeypatch.setattr(C, "get_device_name", lambda *a, **k: "NVIDIA H200")
    x, w13, w2, w, ids = _tiny()
    with pytest.raises(Reached):
        F.fused_experts_impl(x, w13, w2, w, ids, inplace=True, gate_up_interleaved=False)
