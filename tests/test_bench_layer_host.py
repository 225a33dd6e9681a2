"""benchmarks/bench_layer_host.py on the CPU: the smoke run the GPU machine's numbers come from."""

from benchmarks import bench_layer_host as H


def test_layer_host_benchmark_runs_on_the_cpu(tmp_path):
    # the CPU smoke run of benchmarks/bench_layer_host.py (the reference backend): its table, one row per M
    out = tmp_path / "host.md"
    assert H.main(["--out", str(out), "--m", "1", "4", "--reps", "3", "--shapes", "smollm2 o"]) == 0
    text = out.read_text()
    assert text.startswith("# Host cost of one linear forward (CPU (smoke run)")
    rows = [ln for ln in text.splitlines() if ln.startswith("| smollm2 o | 576 x 576 |")]
    assert [r.split(" | ")[2] for r in rows] == ["1", "4"] and all("| reference |" in r for r in rows)
