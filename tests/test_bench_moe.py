"""benchmarks/bench_moe.py's smoke run (the CPU interpreter, or the GPU where there is one): the table's form."""

import torch

from benchmarks import bench_moe as M


def test_moe_layer_benchmark_runs_on_the_cpu(tmp_path):
    out = tmp_path / "moe.md"
    assert M.main(["--out", str(out), "--smoke", "--tokens", "1", "8"]) == 0
    text = out.read_text()
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    assert text.startswith(f"# One fused-MoE layer forward ({where} (smoke run)")
    rows = [ln.split(" | ") for ln in text.splitlines() if ln.startswith("| 1 |") or ln.startswith("| 8 |")]
    assert [r[0] for r in rows] == ["| 1", "| 8"]
    for r in rows:   # ours and every stage timed; the peer is not run in a smoke run, which says so
        assert r[2] == "-" and all(float(v) > 0 for v in [r[1], *r[4:9]]), r
    assert "vLLM bf16: off" in text or "vLLM bf16: not run (no GPU)" in text
