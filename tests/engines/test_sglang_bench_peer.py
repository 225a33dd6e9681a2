"""bench_moe's SGLang peer, the bf16 fused MoE that SGLang's server runs on Hopper: it resolves in this
SGLang and is called with arguments its op takes (the benchmark times it on the GPU machine)."""

from tests._require import require

sglang = require("sglang")


def test_sglang_bf16_peer_resolves_with_its_arguments():
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import outplace_fused_experts

    from benchmarks import bench_moe as M

    peer, reason = M._sglang_bf16()
    assert peer is not None, reason
    # a registered torch op: its schema names the arguments (the [gate; up] layout is asked for by name)
    assert {"hidden_states", "w1", "w2", "topk_weights", "topk_ids", "gate_up_interleaved"} <= M._arg_names(
        outplace_fused_experts)
