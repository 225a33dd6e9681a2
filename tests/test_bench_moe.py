"""benchmarks/bench_moe.py's smoke run (the CPU interpreter, or the GPU where there is one): the table's form."""

import pytest
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


class _Range:
    def __init__(self, start, end):
        self.start, self.end = start, end

    def elapsed_us(self):
        return self.end - self.start


class _Ev:
    def __init__(self, name, kind, start, end):
        self.name, self.time_range = name, _Range(start, end)
        self.device_type = type("D", (), {"name": kind})()
        self.device_time_total = end - start if kind == "CUDA" else 0


def test_trace_summary_splits_kernel_time_idle_gaps_and_host_syncs():
    """The profile reading of --trace: kernel µs per layer call by name, the GPU's idle time between kernels
    (the gaps, largest first, with their neighbours) and the CUDA runtime calls that can hold the host."""
    ev = [_Ev("route", "CUDA", 0, 10), _Ev("gemm", "CUDA", 40, 140), _Ev("gemm", "CUDA", 140, 240),
          _Ev("copy", "CUDA", 100, 120),                              # overlaps the first gemm: no gap after it
          _Ev("combine", "CUDA", 245, 265), _Ev("cudaLaunchKernel", "CPU", 0, 5),
          _Ev("cudaStreamSynchronize", "CPU", 5, 35), _Ev("cudaMalloc", "CPU", 36, 38),
          _Ev("cudaEventSynchronize", "CPU", 50, 60), _Ev("cudaEventSynchronize", "CPU", 270, 300)]
    s = M.trace_summary(ev, wall_us=600.0, calls=2)
    assert s["per_kernel"] == {"route": 5.0, "gemm": 100.0, "copy": 10.0, "combine": 10.0}
    assert s["kernel_us"] == 125.0 and s["wall_us"] == 300.0
    assert s["idle_us"] == 17.5                                   # (30 + 5) / 2 calls
    assert s["top_gaps"] == [(30, "route", "gemm"), (5, "gemm", "combine")]
    # the harness's final wait (the last cudaEventSynchronize) is left out, an earlier one is not
    assert s["runtime"] == {"cudaStreamSynchronize": (1, 30), "cudaMalloc": (1, 2), "cudaEventSynchronize": (1, 10)}


def test_trace_and_sustained_take_a_real_shape_on_a_gpu(capsys):
    assert M.main(["--out", "unused.md", "--trace", "64", "--smoke"]) == 2
    assert M.main(["--out", "unused.md", "--sustained", "64", "--smoke"]) == 2
    assert M.main(["--out", "unused.md", "--glue-shapes", "--smoke"]) == 2
    assert capsys.readouterr().out.count("not with --smoke") == 3
    if not torch.cuda.is_available():
        assert M.main(["--out", "unused.md", "--trace", "64"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().out


def test_glue_shapes_times_every_shape_and_checks_its_output(monkeypatch):
    # the timer stubbed (do_bench needs CUDA): on the CPU the kernels run through the interpreter, so each
    # shape's output check runs; a few shapes of each kernel keep it short
    import triton.testing

    calls = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, warmup, rep: calls.append(fn()) or 1.0)
    monkeypatch.setattr(M, "GATHER_SHAPES", M.GATHER_SHAPES[:2] + ((8, 1024, 4),))
    monkeypatch.setattr(M, "SILU_SHAPES", M.SILU_SHAPES[:2])
    monkeypatch.setattr(M, "SPREAD_SHAPES", M.SPREAD_SHAPES[:1] + ((2, 2048, 4),))
    monkeypatch.setattr(M, "ROUTE_BLOCKS", (64, 256))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    md = M.glue_shapes(dict(E=4, top_k=2, H=96, I=40), [3], device=dev)
    compiled = 3 if dev == "cuda" else 0        # the compiled SiLU-mul's rows need the extension on a GPU
    assert len(calls) == 1 + 3 + 2 + 1 + 2 + compiled + 1           # routing rows take time_calls
    assert "| 3 | routing | blocks of 64 pairs (CUDA graph) |" in md and "| 3 | routing | one program (selected)" in md
    assert "| 3 | gather | BR=8 BH=1024 num_warps=4 (gather_rows) | 1000.0 |" in md
    assert "| 3 | spread | BT=2 BH=2048 num_warps=4 (selected) |" in md
    assert md.count("| 3 | silu_mul |") == 3 + compiled and "| 3 | copy |" in md


@pytest.mark.gpu
def test_gpu_trace_names_our_kernels_and_sustained_timer(tmp_path):
    out = tmp_path / "trace.md"
    assert M.main(["--out", str(out), "--trace", "256", "--no-vllm"]) == 0
    text = out.read_text()
    assert "### ours" in text and "`w4_" in text and "GPU idle between kernels" in text
    from benchmarks.common import time_sustained
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    sus, burst = time_sustained(lambda: a @ a, warm_s=0.2, meas_s=0.2)
    assert 0 < burst and 0.3 * burst < sus < 5 * burst, (sus, burst)


def test_host_profile_names_our_functions(tmp_path):
    """--host-profile: host µs per call both ways and the cProfile tables, which name our own code."""
    out = tmp_path / "host.md"
    assert M.main(["--out", str(out), "--smoke", "--host-profile", "4"]) == 0
    text = out.read_text()
    assert text.startswith("Host time per eager layer call at 4 tokens: ")
    assert "with direct kernel launches" in text and "through Triton's launch path" in text
    assert text.count("```") == 4 and "benchmarks/bench_moe.py" in text    # the calls themselves, cumulative
    if torch.cuda.is_available():     # on the CPU the interpreter's frames fill the tables
        assert "w4_fused_moe" in text and "moe_routing" in text


def test_gluon_tail_switch_reselects_and_restores():
    """--sustained times the layer with the short last tiles left in the 256-row launch: inside the switch the
    selection hands out no tail, after it the selected tail again (the lookup cache cleared both ways)."""
    from nvfp4_plugin.gemm import select as S

    def big():
        return S.select_config("grouped", 65536, 1536, 2048, 128)

    before = S.GLUON_TAIL_BM
    assert big().tail_bm == before != 0
    with M.gluon_tail(0):
        assert big().tail_bm == 0
    assert S.GLUON_TAIL_BM == before and big().tail_bm == before
    assert {c.tail_bm for c in M.SUSTAINED_CONFIGS.values()} >= {0, 64, 128}
