"""benchmarks/bench_moe.py on the CPU: the smoke run of the GPU machine's MoE layer table."""

from benchmarks import bench_moe as M


def test_moe_layer_benchmark_runs_on_the_cpu(tmp_path):
    out = tmp_path / "moe.md"
    assert M.main(["--out", str(out), "--smoke", "--tokens", "1", "8"]) == 0
    text = out.read_text()
    assert text.startswith("# One fused-MoE layer forward (CPU (smoke run)")
    rows = [ln.split(" | ") for ln in text.splitlines() if ln.startswith("| 1 |") or ln.startswith("| 8 |")]
    assert [r[0] for r in rows] == ["| 1", "| 8"]
    for r in rows:   # ours and every stage timed; the peer is absent on the CPU and says why
        assert r[2] == "-" and all(float(v) > 0 for v in [r[1], *r[4:9]]), r
    assert "vLLM bf16: no GPU (smoke run)" in text
