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


def test_layer_host_table_puts_each_peer_beside_ours():
    # GPU rows: each peer's eager / GPU / host µs, a peer that could not be set up named with its reason, and
    # ours' eager time over the fastest peer's
    rows = [{"shape": "llama8b qkv", "n": 6144, "k": 4096, "m": 1024, "backend": "hopper_triton", "eager_us": 120.0,
             "gpu_us": 83.3, "host_us": 95.0, "host_triton_us": 140.0, "op_us": 60.0, "apply_us": 50.0,
             "marlin_eager_us": 190.0, "marlin_gpu_us": 186.9, "marlin_host_us": 30.0,
             "humming_eager_us": 100.0, "humming_gpu_us": 86.9, "humming_host_us": 40.0},
            {"shape": "llama8b qkv", "n": 6144, "k": 4096, "m": 1, "backend": "hopper_triton", "eager_us": 50.0,
             "marlin": "vLLM not importable (ModuleNotFoundError)", "humming": "no GPU"}]
    rows[0].update(fused="gluon bn128 bm128", fused_eager_us=95.5, fused_gpu_us=92.0, fused_host_us=60.25)
    lines = H.table(rows).splitlines()
    assert "Marlin eager / GPU / host µs | Humming eager / GPU / host µs | eager ours / fastest peer |" in lines[0]
    assert "| 95.5 / 92.0 / 60.2 (gluon bn128 bm128) |" in lines[2] and "| 50.0 | - | - | - | - | - | - |" in lines[3]
    assert lines[2].endswith("| 190.0 / 186.9 / 30.0 | 100.0 / 86.9 / 40.0 | 1.20x (humming) |")
    assert lines[3].endswith("| vLLM not importable (ModuleNotFoundError) | no GPU | - |")
    assert all(ln.count("|") == lines[0].count("|") for ln in lines)


def test_layer_host_profile_names_our_functions(tmp_path):
    # --host-profile: after the table, cProfile tables of ours' forward that name the plugin's own functions
    out = tmp_path / "host.md"
    assert H.main(["--out", str(out), "--m", "2", "--reps", "2", "--shapes", "smollm2 o", "--host-profile", "3"]) == 0
    text = out.read_text()
    assert "## Host profile: smollm2 o (576 x 576), 3 tokens, reference" in text
    assert "by own time" in text and "by cumulative time" in text and "nvfp4_plugin/" in text
