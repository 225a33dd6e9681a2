"""benchmarks/bench_e2e.py on the CPU: its verdicts, tables, trace and stream parsing (the engine runs
themselves need the GPU machine)."""

import gzip
import json
import os
import threading
import time
import types

import pytest

from benchmarks import bench_e2e as E


@pytest.fixture(autouse=True)
def _no_gpu_check(monkeypatch):
    """``run --gpus`` starts the GPU check's processes first; here they are recorded, not started (the test of
    the check itself takes the real function back)."""
    calls = []
    real = E.gpu_check
    monkeypatch.setattr(E, "gpu_check", lambda out, gpus, env, **kw: calls.append(list(gpus)))
    return types.SimpleNamespace(calls=calls, real=real)


def _result(config, decode, prefill=None, model="dense", engine="vllm", **kw):
    r = {"engine": engine, "model": model, "config": config, "startup_s": 80.0, "date": "2026-11-26 00:00:00",
         "gpu": "NVIDIA H200",
         "decode": {str(b): {"tok_s": v, "first_tok_s": kw.get("first", {}).get(b, v), "ms_per_step": 1.0}
                    for b, v in decode.items()}}
    if prefill:
        r["prefill"] = {"tok_s": prefill, "first_tok_s": prefill}
    r.update({k: v for k, v in kw.items() if k != "first"})
    return r


def _offline_run(monkeypatch, env=None):
    """``run`` without checkpoints or a report: fake model paths, ``env`` (copied when the run starts) as the
    plugin environment."""
    monkeypatch.setattr(E, "build_models", lambda d, models, *_: {m: {"bf16": d / "b", "nvfp4": d / "q"}
                                                                   for m in models})
    monkeypatch.setattr(E, "plugin_env", lambda: dict(env or {}))
    monkeypatch.setattr(E, "report", lambda out: "")


def test_checks_pass_and_miss():
    rs = [_result("bf16", {1: 200, 8: 1600}, 40000), _result("marlin", {1: 300, 8: 2200}, 20000),
          _result("humming", {1: 310, 8: 2300}, 38000),
          _result("ours", {1: 700, 8: 2000}, 39000, first={8: 1000}, start_method="fork")]
    lines = E.checks(rs, "vllm", "dense")
    assert lines[0].startswith("decode batch 1: ours 700 vs best built-in 310 (2.26x), bf16 200 (3.50x): PASS")
    assert lines[1].endswith("MISS") and "best built-in 2300" in lines[1]
    assert lines[2] == "prefill: ours 39000 vs bf16 40000 (0.97x, floor 0.95x): PASS"
    assert lines[3].endswith("PASS")
    assert lines[4] == ("first run of each shape within 5% of the second: MISS at batch 8 "
                        "(first / measured: bf16 1.00, humming 1.00, marlin 1.00, ours 0.50)")
    assert lines[5] == "start method: fork"
    # MoE prefill floor is bf16 itself; a drop of more than 5% to the next batch is flagged
    rs = [_result("bf16", {1: 400, 2: 800}, 230000, model="moe"),
          _result("ours", {1: 900, 2: 800}, 220000, model="moe")]
    lines = E.checks(rs, "vllm", "moe")
    assert "floor 1.0x): MISS" in lines[2] and lines[3].endswith("MISS at 1->2")
    assert E.checks([], "vllm", "moe") == ["ours: no result (not run)"]
    # the engine's first request of every configuration that recorded one, beside the shapes' first runs
    rs[0]["engine_first_request"] = {"prompt_len": 16, "first_s": 2.5, "again_s": 0.04}
    rs[1]["engine_first_request"] = {"prompt_len": 16, "first_s": 0.61, "again_s": 0.031}
    assert E.checks(rs, "vllm", "moe")[5] == ("the engine's first request (16-token prompt, 8 tokens), s, "
                                              "first / again: bf16 2.50 / 0.04, ours 0.61 / 0.03")
    # a built-in that never served (SGLang's Marlin JIT inside the start-up timeout) is named, not counted as 0
    rs = [_result("bf16", {1: 200}, 40000, engine="sglang"), _result("ours", {1: 300}, 39000, engine="sglang"),
          {"engine": "sglang", "model": "dense", "config": "builtin", "error": "timed out after 420.0 s"}]
    lines = E.checks(rs, "sglang", "dense")
    assert lines[0] == "decode batch 1: ours 300 vs no built-in result, bf16 200 (1.50x): PASS"
    assert lines[1] == "built-in builtin: no result (timed out after 420.0 s)"


def test_best_builtin_and_report(tmp_path):
    rs = [_result("bf16", {1: 200, 8: 1600}, 40000), _result("marlin", {1: 300, 8: 2200}, 20000),
          _result("humming", {1: 310, 8: 2300}, 38000), _result("ours", {1: 700, 8: 2000}, 39000),
          {"engine": "vllm", "model": "moe", "config": "ours", "error": "timed out after 1200 s"}]
    rs[3]["profile"] = {"8": {"steps": 16, "gpu_us_per_step": 4000.0, "gpu_busy": 0.9,
                              "graph_launches_per_step": 1.0, "kernel_launches_per_step": 3.0,
                              "kernels": [{"name": "w4_gemm_kernel", "us_per_step": 3000.0, "share": 0.75,
                                           "calls_per_step": 128.0}]}}
    for r in rs:
        (tmp_path / f"{r['engine']}-{r['model']}-{r['config']}.json").write_text(json.dumps(r))
    assert E.best_builtin(rs, "vllm", "dense") == "humming"
    assert E.best_builtin(rs, "vllm", "moe") is None
    text = E.report(tmp_path)
    assert "| config | run | start s | b=1 | b=8 | prefill |" in text
    assert "| ours |  | 80.0 | 700 | 2000 | 39000 |" in text
    assert "| ours |  | - | error: timed out after 1200 s |" in text
    assert "| `w4_gemm_kernel` | 3000.0 | 75.0% | 128.0 |" in text
    assert "| ours | 8 | 4000 | 1.0 | 90% | 1.0 | 3.0 | - | - |" in text           # fields older results lack
    assert (tmp_path / "e2e.md").read_text() == text
    assert "Host, µs per step" not in text
    rs[3]["profile"]["8"]["host_top"] = [["cudaGraphLaunch", 812.5], ["aten::copy_", 40.0]]
    (tmp_path / "vllm-moe-ours.json").write_text(json.dumps(rs[3]))
    want = "Host, µs per step (nested ops counted in each): `cudaGraphLaunch` 812; `aten::copy_` 40"
    assert want in E.report(tmp_path)


def test_kernel_table_from_a_trace(tmp_path):
    events = [{"ph": "X", "cat": "kernel", "name": "a", "ts": 100.0, "dur": 30.0},
              {"ph": "X", "cat": "kernel", "name": "a", "ts": 140.0, "dur": 10},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 160.0, "dur": 20.0},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 999.0},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 90.0, "dur": 5.0},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 95.0, "dur": 5.0},
              {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "ts": 96.0, "dur": 2.0},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 97.0, "dur": 50.0}]
    path = tmp_path / "b8_dp0_pp0_tp0.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    t = E.kernel_table(str(path), steps=2)
    assert t["gpu_us_per_step"] == 30.0
    assert t["kernels"][0] == {"name": "a", "us_per_step": 20.0, "share": pytest.approx(40 / 60), "calls_per_step": 1.0}
    assert [k["name"] for k in t["kernels"]] == ["a", "Memcpy HtoD"]
    assert t["graph_launches_per_step"] == 1.0 and t["kernel_launches_per_step"] == 0.5
    assert t["kernels_per_step"] == 1.0 and t["graph_launch_us_per_step"] == 5.0   # 2 kernels, 10 µs launching
    assert t["host_top"] == [["aten::mm", 499.5], ["cudaStreamSynchronize", 25.0], ["cudaGraphLaunch", 5.0],
                             ["cuLaunchKernel", 1.0]]
    assert t["gpu_busy"] == pytest.approx(60 / 80)          # 60 µs of work between 100 and 180 µs


def test_latency_stats():
    rs = [{"chunk_times": [0.1, 0.11, 0.12], "tokens": 3}, {"chunk_times": [0.3, 0.32], "tokens": 2}]
    s = E.latency_stats(rs, wall=1.0)
    assert s["tok_s"] == 5.0 and s["requests"] == 2
    assert s["ttft_ms_p50"] == pytest.approx(200.0) and s["itl_ms_p50"] == pytest.approx(10.0)
    assert s["request_ms_p50"] == pytest.approx(220.0)
    assert E.first_request(rs[0]) == {"ttft_ms": 100.0, "request_ms": 120.0, "tokens": 3}


def test_served_first_request_verdict_and_table(tmp_path):
    def served(engine, config, first_ms, p50_ms):
        return {"engine": engine, "model": "moe", "config": config, "startup_s": 90.0,
                "first_request": {"ttft_ms": 20.0, "request_ms": first_ms, "tokens": 256},
                "concurrency": {"1": {"tok_s": 800.0, "requests": 2, "ttft_ms_p50": 15.0, "ttft_ms_p99": 16.0,
                                      "itl_ms_p50": 1.2, "itl_ms_p99": 1.5, "request_ms_p50": p50_ms}}}
    ok, slow = served("sglang", "ours", 330.0, 320.0), served("sglang", "builtin", 1500.0, 380.0)
    assert E.served_first_line(ok)[0].endswith("(0.97 of its speed): PASS")
    assert E.served_first_line(slow)[0].startswith("sglang moe builtin: first request after ready 1500.0 ms (TTFT 20.0 ms)")
    assert E.served_first_line(slow)[0].endswith("MISS")
    assert E.served_first_line({"config": "ours", "concurrency": {}}) == []      # older results: no line
    for r in (ok, slow):
        (tmp_path / f"serve-sglang-moe-{r['config']}.json").write_text(json.dumps(r))
    text = E.report(tmp_path)
    assert "| sglang | moe | ours | 1 | 800 | 15.0 / 16.0 | 1.2 / 1.5 | 320.0 |" in text
    assert "- sglang moe ours: first request after ready 330.0 ms" in text


def test_serve_runs_each_engines_server_with_its_context_flag(tmp_path, monkeypatch):
    """--serve starts each engine's own server (ours and that engine's best built-in), the context length
    under the engine's own flag; a server that exits before it is healthy is a result with an error."""
    import sys
    import types

    from integration.serve_check import server_command

    served = []
    _offline_run(monkeypatch)
    monkeypatch.setattr(E, "SglangPrebuild", lambda env, out, marlin: E._Ready())
    monkeypatch.setattr(E.subprocess, "run", lambda cmd, **kw: None)
    monkeypatch.setattr(E, "serve_bench", lambda a, engine, model, config, path, env, port=None:
                        served.append((engine, model, config, path.name)) or {"engine": engine, "config": config})
    (tmp_path / "sglang-moe-builtin.json").write_text(json.dumps(_result("builtin", {1: 600}, engine="sglang",
                                                                         model="moe")))
    E.main(["run", "--out", str(tmp_path), "--engines", "sglang", "--models", "moe", "--configs", "ours",
            "--serve"])
    assert served == [("sglang", "moe", "ours", "q"), ("sglang", "moe", "builtin", "q")]
    assert sorted(p.name for p in tmp_path.glob("serve-*.json")) == ["serve-sglang-moe-builtin.json",
                                                                   "serve-sglang-moe-ours.json"]
    # the command: SGLang's server with the run's context length; it exits at once -> an error result
    monkeypatch.undo()
    cmds = []

    class Dead:
        def __init__(self, cmd, **kw):
            cmds.append(cmd)

        def poll(self):
            return 1

    monkeypatch.setattr(E.subprocess, "Popen", Dead)
    monkeypatch.setitem(sys.modules, "serve_check", types.SimpleNamespace(
        healthy=lambda port: False, stop_server=lambda proc: None, server_command=server_command))
    a = E.parser().parse_args(["run", "--out", str(tmp_path), "--engines", "sglang", "--max-model-len", "1536"])
    res = E.serve_bench(a, "sglang", "moe", "ours", tmp_path, {})
    assert res["error"].startswith("server not healthy (exit 1)")
    cmd = cmds[0]
    assert "sglang.launch_server" in cmd and cmd[cmd.index("--context-length") + 1] == "1536"
    assert cmd[cmd.index("--quantization") + 1] == "nvfp4"
    vllm = server_command("vllm", "M", 8000, None, [], 0.5, 1536)
    assert vllm[vllm.index("--max-model-len") + 1] == "1536" and "--quantization" not in vllm


def test_prompts_are_fresh_and_inside_the_vocabulary(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1, "c": 57}},
                                                         "added_tokens": [{"id": 63, "content": "<|eos|>"}]}))
    assert E.tokenizer_vocab(tmp_path) == 64
    p = E.Prompts(64)
    a, b = p(3, 50), p(3, 50)
    assert a != b and all(10 <= t < 64 for row in a + b for t in row) and len(a[0]) == 50


def test_run_sweep_reports_the_median_after_a_warmup(tmp_path):
    import argparse
    times = iter([3.0, 0.25,               # the engine's first request, then the same again
                  2.0, 1.0, 4.0, 2.0,      # batch 1: warm-up, then three runs (256 tokens each)
                  9.0, 1.0, 1.0, 1.0,        # prefill: warm-up + three
                  0.5, 0.02, 0.03, 0.01])    # prefill shape 4x100: warm-up + three
    a = argparse.Namespace(batches=[1], prompt_len=4, gen_len=256, prefill=[2, 8], repeats=3, prefill_repeats=3,
                           engine="vllm", model="dense", config="ours", prefill_shapes=["4x100"],
                           out=str(tmp_path / "vllm-dense-ours.json"))
    res = {"config": "ours"}
    shapes = []
    E.run_sweep(res, lambda n, length, gen: (shapes.append((n, length)), (n * gen, next(times)))[1], a)
    # the sweep is on disk, marked, before the profiles: an engine that dies there leaves it
    partial = json.loads((tmp_path / "vllm-dense-ours.json").read_text())
    assert partial["incomplete"] == "the engine process ended after the sweep" and "incomplete" not in res
    assert partial["decode"] == res["decode"] and partial["prefill"]["tok_s"] == 16.0
    assert shapes[-4:] == [(4, 100)] * 4
    assert shapes[:2] == [(1, E.ENGINE_FIRST_PROMPT)] * 2 and E.ENGINE_FIRST_PROMPT not in (4, 8, 100)
    assert res["engine_first_request"] == {"prompt_len": E.ENGINE_FIRST_PROMPT, "gen_len": E.ENGINE_FIRST_GEN,
                                           "first_s": 3.0, "again_s": 0.25}
    assert res["prefill_shapes"] == {"4x100": {"ms_per_run": 20.0, "first_ms": 500.0, "tok_s": 20000.0}}
    assert E.prefill_shape_summary([dict(res, config="ours"), {"config": "bf16"}])[2:5] == [
        "| config | 4x100 |", "|---|---:|", "| ours | 20.0 (500.0) |"]
    d = res["decode"]["1"]
    assert d["first_tok_s"] == 128.0 and d["runs_tok_s"] == [256.0, 64.0, 128.0] and d["tok_s"] == 128.0
    assert d["ms_per_step"] == pytest.approx(1e3 / 128.0, abs=1e-3)
    # the host CPU of the engine's process tree over the measured runs (here: this process), per decode step
    assert d["wall_ms_per_step"] >= 0 and d["host_cpu_ms_per_step"]
    assert all(k.endswith("]") and v >= 0 for k, v in d["host_cpu_ms_per_step"].items())
    assert res["prefill"]["first_tok_s"] == pytest.approx(16 / 9.0, abs=0.1) and res["prefill"]["tok_s"] == 16.0
    # prefill runs counted apart from decode runs: one decode run, five prefill runs of each shape
    a.repeats, a.prefill_repeats = 1, 5
    shapes.clear()
    times = iter([1.0, 1.0, 2.0, 1.0] + [1.0] * 6 + [0.01] * 6)
    E.run_sweep(res, lambda n, length, gen: (shapes.append((n, length)), (n * gen, next(times)))[1], a)
    assert shapes == [(1, E.ENGINE_FIRST_PROMPT)] * 2 + [(1, 4)] * 2 + [(2, 8)] * 6 + [(4, 100)] * 6
    assert len(res["decode"]["1"]["runs_tok_s"]) == 1 and len(res["prefill"]["runs_tok_s"]) == 5


def test_run_sweep_records_prompt_logprobs_or_their_error(tmp_path):
    import argparse
    a = argparse.Namespace(batches=[1], prompt_len=4, gen_len=8, prefill=[2, 8], repeats=1, prefill_repeats=1,
                           engine="vllm", model="dense", config="ours", prefill_shapes=[],
                           out=str(tmp_path / "r.json"))
    res = {}
    E.run_sweep(res, lambda n, length, gen: (n * gen, 0.5), a, lambda: [[-1.23456789, -2.0], [-3.0, -4.0]])
    assert res["prompt_logprobs"] == [[-1.234568, -2.0], [-3.0, -4.0]] and "prompt_logprobs_error" not in res
    assert json.loads((tmp_path / "r.json").read_text())["prompt_logprobs"] == res["prompt_logprobs"]

    def broken():
        raise RuntimeError("no logprobs")
    res = {}
    E.run_sweep(res, lambda n, length, gen: (n * gen, 0.5), a, broken)
    assert res["prompt_logprobs_error"] == "RuntimeError: no logprobs" and res["decode"]["1"]["tok_s"] == 16.0


def test_run_sweep_records_what_the_allocator_did_in_each_first_run(tmp_path):
    """vLLM's worker counters read around each batch's first run (not the engine's first request, which comes
    before): the ones that moved are recorded, and the report names them beside a slow first run."""
    import argparse
    a = argparse.Namespace(batches=[1, 8, 64], prompt_len=4, gen_len=8, prefill=[2, 8], repeats=1,
                           prefill_repeats=1, engine="vllm", model="moe", config="ours", prefill_shapes=[],
                           out=str(tmp_path / "r.json"))
    state = {"num_device_alloc": 10, "num_alloc_retries": 0, "num_device_free": 0, "num_sync_all_streams": 0,
             "num_ooms": 0}
    reads = []

    def timed(n, length, gen):
        if n == 64 and not reads[-1][1]:      # the first run at batch 64 allocates twice
            state["num_device_alloc"] += 2
            reads[-1][1] = True
        return n * gen, 0.5

    def counters():
        reads.append([dict(state), False])
        return dict(state)
    res = {}
    E.run_sweep(res, timed, a, None, counters)
    assert len(reads) == 6                          # around each batch's first run
    assert "first_allocs" not in res["decode"]["1"] and "first_allocs" not in res["decode"]["8"]
    assert res["decode"]["64"]["first_allocs"] == {"num_device_alloc": 2}
    E.run_sweep({}, timed, a, None, lambda: 1 / 0)   # a counter that fails is left out, the sweep goes on
    slow = _result("ours", {1: 100.0, 64: 1000.0}, 90.0, model="moe", first={64: 900.0})
    slow["decode"]["64"]["first_allocs"] = {"num_device_alloc": 2}
    line = [ln for ln in E.checks([slow], "vllm", "moe") if ln.startswith("first run")][0]
    assert line.endswith("MISS at batch 64 (first / measured: ours 0.90; allocator counters that moved in the "
                         "first run: ours num_device_alloc 2)")


def test_prompt_logprobs_from_each_engines_outputs():
    """The same prompt ids in every process; vLLM's per-position dicts and SGLang's (logprob, id, text)
    tuples read as positions 1.. of each prompt; SGLang's ids must be the prompt's."""
    ids = E.logprob_prompts(1000)
    assert ids == E.logprob_prompts(1000) and len(ids) == E.LOGPROB_PROMPTS[0]
    assert all(len(p) == E.LOGPROB_PROMPTS[1] and all(10 <= t < 999 for t in p) for p in ids)   # < vocab - 1
    assert ids != E.Prompts(1000)(*E.LOGPROB_PROMPTS)                 # not the sweep's prompts
    lp = types.SimpleNamespace
    outs = [lp(prompt_logprobs=[None] + [{t: lp(logprob=-0.5 * i - j)} for j, t in enumerate(p[1:])])
            for i, p in enumerate(ids[:2])]
    assert E.vllm_prompt_logprobs(outs, ids[:2]) == [[-float(j) for j in range(63)],
                                                     [-0.5 - j for j in range(63)]]
    sg = [{"meta_info": {"input_token_logprobs": [(None, p[0], None)] + [(-1.0 * j, t, None)
                                                                         for j, t in enumerate(p[1:])]}}
          for p in ids[:1]]
    assert E.sglang_prompt_logprobs(sg, ids[:1]) == [[-1.0 * j for j in range(63)]]
    with pytest.raises(ValueError, match="not the prompt's"):
        E.sglang_prompt_logprobs(sg, ids[1:2])


def test_logprob_lines_compare_ours_with_the_builtins_own_difference():
    base = [[-10.0, -11.0, -12.0], [-9.0, -8.0, -7.0]]

    def moved(*d):            # per position (row-major) offsets from base
        it = iter(d)
        return [[v + next(it) for v in row] for row in base]
    humming = moved(0.02, 0.0, 0.0, 0.01, 0.0, 0.0)              # from marlin: max 0.02, mean 0.005
    rows = [dict(_result("marlin", {1: 1.0}), prompt_logprobs=base),
            dict(_result("humming", {1: 1.0}), prompt_logprobs=humming),
            dict(_result("bf16", {1: 1.0}), prompt_logprobs=moved(*[0.2] * 6)),
            dict(_result("ours", {1: 1.0}), prompt_logprobs=moved(0.0, 0.012, 0.0, 0.0, 0.0, 0.0))]
    line = E.logprob_lines(rows, "vllm")[-1]
    assert line.startswith("prompt logprobs (2 prompts x 4 tokens, the same ids in every process), max / mean "
                           "|ours - X|: marlin 0.0120 / 0.0020; humming 0.0200 / 0.0070; bf16 0.2000 / 0.1980")
    # tolerance 1.5x marlin - humming: max 0.03, mean 0.0075 (worst of ours: 0.02 / 0.007)
    assert line.endswith("marlin - humming 0.0200 / 0.0050: ours within 1.5x the built-ins' own difference "
                         "(max and mean): PASS")
    rows[3]["prompt_logprobs"] = moved(0.0, 0.031, 0.0, 0.0, 0.0, 0.0)     # one position past 1.5 x max
    assert E.logprob_lines(rows, "vllm")[-1].endswith(": MISS")
    rows[3]["prompt_logprobs"] = moved(*[0.0085] * 6)                     # the mean past 1.5 x 0.005 from marlin
    assert E.logprob_lines(rows, "vllm")[-1].endswith(": MISS")
    rows[3]["prompt_logprobs"] = moved(*[0.007] * 6)                      # from humming 0.013 / 0.0057: inside
    assert E.logprob_lines(rows, "vllm")[-1].endswith(": PASS")
    # built-ins that agree exactly: the floor (0.01 / 0.001) is the tolerance, not zero
    rows[1]["prompt_logprobs"] = base
    rows[3]["prompt_logprobs"] = moved(0.0005, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert E.logprob_lines(rows, "vllm")[-1].endswith(": PASS")
    rows[3]["prompt_logprobs"] = moved(0.011, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert E.logprob_lines(rows, "vllm")[-1].endswith(": MISS")
    # positions without a value (None) are left out, not compared
    rows[3]["prompt_logprobs"] = [[None, -11.0, -12.0], [-9.0, -8.0, -7.0]]
    assert "marlin 0.0000 / 0.0000" in E.logprob_lines(rows, "vllm")[-1]
    # SGLang: one built-in, the numbers without a verdict; other prompts or a missing ours: nothing to compare
    rows[3]["prompt_logprobs"] = moved(*[0.02] * 6)
    sg = [dict(r, engine="sglang", config={"marlin": "builtin"}.get(r["config"], r["config"])) for r in rows
          if r["config"] != "humming"]
    assert E.logprob_lines(sg, "sglang")[-1].endswith("builtin 0.0200 / 0.0200; bf16 0.1800 / 0.1800")
    rows[0]["prompt_logprobs"] = base[:1]
    assert "marlin" not in E.logprob_lines(rows, "vllm")[-1]
    rows[1]["prompt_logprobs_error"] = "ValueError: x"
    assert E.logprob_lines(rows[:3], "vllm") == ["prompt logprobs of humming: ValueError: x"]


def test_checks_give_no_verdict_without_a_comparison():
    # a run of ours alone (no built-in, no bf16) has nothing to pass against: no "bf16 0 (0.00x): PASS"
    lines = E.checks([_result("ours", {1: 300, 8: 2000})], "vllm", "dense")
    assert lines[:2] == ["decode batch 1: ours 300; no built-in or bf16 result in this run",
                         "decode batch 8: ours 2000; no built-in or bf16 result in this run"]
    lines = E.checks([_result("ours", {1: 300}), _result("bf16", {1: 320})], "vllm", "dense")
    assert lines[0] == "decode batch 1: ours 300 vs no built-in result, bf16 320 (0.94x): MISS"


def test_prefill_shapes_parse_and_refuse_bad_ones(tmp_path, capsys):
    assert E.parse_shape("16x1024") == (16, 1024) and E.parse_shape("8X64") == (8, 64)
    for bad in ("16", "x1024", "0x8", "ax3"):
        with pytest.raises(ValueError, match="--prefill-shapes"):
            E.parse_shape(bad)
    # refused when the command line is read, and a prompt that cannot fit the context before any model is built
    with pytest.raises(SystemExit):
        E.main(["run", "--out", str(tmp_path), "--prefill-shapes", "16x"])
    assert "--prefill-shapes: expected PROMPTSxLEN" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="shorter than --max-model-len 2048"):
        E.main(["run", "--out", str(tmp_path), "--prefill-shapes", "4x2048"])
    assert not any(tmp_path.iterdir())


def test_prebuild_sglang_jit_imports_first_then_builds_each(tmp_path, monkeypatch):
    """Each builder is imported on the calling thread (imports from the build threads deadlocked on the H200),
    called with its dtype resolved, and a module that is missing is reported, not raised."""
    import sys
    import threading

    pkg = tmp_path / "fakejit"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mods.py").write_text("import threading\nIMPORTED_ON = threading.current_thread().name\nCALLS = []\n"
                                 "def build(*args):\n    CALLS.append(args)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(E, "SGLANG_FIRST_USE_JIT", (("fakejit.mods", "build", ("int64",)),))
    monkeypatch.setattr(E, "SGLANG_MARLIN_JIT", (("fakejit.mods", "build", ("bfloat16", False)),
                                                 ("fakejit.missing", "build", ())))
    lines = E.prebuild_sglang_jit()
    import torch
    mods = sys.modules["fakejit.mods"]
    assert mods.IMPORTED_ON == threading.current_thread().name
    assert sorted(mods.CALLS, key=str) == [(torch.bfloat16, False), (torch.int64,)]
    assert "ready after" in lines[0] and "ready after" in lines[1]
    assert lines[2].startswith("fakejit.missing.build(): not built (ModuleNotFoundError")
    # without the built-in configuration: only the modules every configuration's first request needs
    mods.CALLS.clear()
    assert len(E.prebuild_sglang_jit(marlin=False)) == 1 and mods.CALLS == [(torch.int64,)]


def test_allocator_counters_around_a_prefill_run(tmp_path):
    before = [dict.fromkeys(E.ALLOCATOR_COUNTERS, 3) | {"reserved_bytes": 1}, {}]
    after = [dict.fromkeys(E.ALLOCATOR_COUNTERS, 3) | {"num_alloc_retries": 15, "num_device_alloc": 40,
                                                      "reserved_bytes": 71_500_000_000}, {}]
    d = E.allocator_delta(before, after)
    assert d == {"num_alloc_retries": 12, "num_device_alloc": 37, "num_device_free": 0, "num_sync_all_streams": 0,
                 "num_ooms": 0, "reserved_gb": 71.5}
    rs = [_result("bf16", {1: 200}, 40000, prefill_allocator=dict(E.allocator_delta(before, before), tok_s=40100.0)),
          _result("ours", {1: 300}, 39000, prefill_allocator=dict(d, tok_s=39100.0)),
          _result("marlin", {1: 250}, 20000, prefill_allocator={"error": "RuntimeError: no pickling"})]
    lines = E.allocator_summary(rs)
    assert lines[2] == ("| config | prefill tok/s | num_alloc_retries | num_device_alloc | num_device_free | "
                        "num_sync_all_streams | num_ooms | reserved GB |")
    assert lines[4] == "| bf16 | 40100.0 | 0 | 0 | 0 | 0 | 0 | 0.0 |"
    assert lines[5] == "| ours | 39100.0 | 12 | 37 | 0 | 0 | 0 | 71.5 |"
    assert len(lines) == 7 and lines[6] == ""          # the failed diagnostic is left out, not a row of dashes
    assert E.allocator_summary([_result("ours", {1: 1})]) == []
    assert E._worker_allocator_counters(None).keys() == set(E.ALLOCATOR_COUNTERS) | {"reserved_bytes"}


def test_parallel_arguments_and_a_report_per_parallelism(tmp_path):
    # one GPU: nothing added; tensor / expert parallel: NCCL all-reduce (no multicast on these machines)
    assert E.parallel_kwargs("vllm", 1, False) == {}
    kw = E.parallel_kwargs("vllm", 2, True)
    assert kw["tensor_parallel_size"] == 2 and kw["enable_expert_parallel"] is True
    assert kw["disable_custom_all_reduce"] is True
    assert kw["compilation_config"] == {"pass_config": {"fuse_allreduce_rms": False}}
    assert "enable_expert_parallel" not in E.parallel_kwargs("vllm", 2, False)
    assert E.parallel_kwargs("sglang", 2, True) == {"tp_size": 2, "ep_size": 2, "disable_custom_all_reduce": True,
                                                    "enforce_disable_flashinfer_allreduce_fusion": True}
    with pytest.raises(ValueError, match="--tp must be >= 1 and >= 2 with --ep, got tp=1, ep=True"):
        E.parallel_kwargs("vllm", 1, True)
    assert [E.parallel_tag(1, False), E.parallel_tag(2, False), E.parallel_tag(2, True)] == ["tp1", "tp2", "tp2-ep"]
    # the worker command carries the parallelism; results of each parallelism get their own table and verdicts
    rs = [_result("marlin", {8: 3000}, model="moe"), _result("ours", {8: 4000}, model="moe"),
          _result("marlin", {8: 2000}, model="moe", parallel="tp2-ep"),
          _result("ours", {8: 1500}, model="moe", parallel="tp2-ep")]
    for r in rs:
        suffix = "" if r.get("parallel", "tp1") == "tp1" else "-" + r["parallel"]
        (tmp_path / f"vllm-moe-{r['config']}{suffix}.json").write_text(json.dumps(r))
    text = E.report(tmp_path)
    one, ep = text.split("## vllm, moe (Qwen3-30B-A3B shape, 12 layers), tp2-ep")
    assert "decode batch 8: ours 4000 vs best built-in 3000 (1.33x)" in one and "ours 1500" not in one
    assert "decode batch 8: ours 1500 vs best built-in 2000 (0.75x), no bf16 result: MISS" in ep
    # the serve phase picks its built-in from one-GPU results only
    assert E.best_builtin(rs[2:], "vllm", "moe") is None


def test_run_refuses_bad_parallelism_before_building_models(tmp_path, monkeypatch):
    monkeypatch.setattr(E, "build_models", lambda *a: pytest.fail("models built"))
    with pytest.raises(ValueError, match="got tp=1, ep=True"):
        E.main(["run", "--out", str(tmp_path / "o"), "--ep"])
    with pytest.raises(SystemExit, match="--serve runs on one GPU"):
        E.main(["run", "--out", str(tmp_path / "o"), "--tp", "2", "--serve"])


def test_run_hands_the_parallelism_to_each_worker(tmp_path, monkeypatch):
    cmds = []
    _offline_run(monkeypatch)
    monkeypatch.setattr(E.subprocess, "run", lambda cmd, **kw: cmds.append(cmd))
    E.main(["run", "--out", str(tmp_path), "--models", "moe", "--configs", "ours", "marlin", "--tp", "2", "--ep"])
    assert len(cmds) == 2 and all(c[c.index("--tp") + 1] == "2" and "--ep" in c for c in cmds)
    assert sorted(p.name for p in tmp_path.glob("*.log")) == ["vllm-moe-marlin-tp2-ep.log", "vllm-moe-ours-tp2-ep.log"]
    assert all(c[c.index("--out") + 1].endswith("-tp2-ep.json") for c in cmds)
    n = len(E.PREFILL_SHAPES)
    assert all(c[c.index("--prefill-shapes") + 1:c.index("--prefill-shapes") + 1 + n] == list(E.PREFILL_SHAPES)
               and c[c.index("--prefill-shapes") + 1 + n].startswith("--") for c in cmds)
    assert all(c[c.index("--repeats") + 1] == "3" and c[c.index("--prefill-repeats") + 1] == "7" for c in cmds)



def test_a_b_configuration_runs_only_when_named_and_with_its_environment(tmp_path, monkeypatch):
    """``ours-triton-launch``: ours with NVFP4_PLUGIN_FAST_LAUNCH=0 in its engine process (the served effect
    of the direct kernel launches, in one run); a run without --configs leaves it out."""
    runs = []
    _offline_run(monkeypatch, env={"PATH": "/bin"})
    monkeypatch.setattr(E.subprocess, "run", lambda cmd, **kw: runs.append((cmd[cmd.index("--config") + 1],
                                                                           kw["env"])))
    E.main(["run", "--out", str(tmp_path / "a"), "--models", "moe"])
    assert [c for c, _ in runs] == ["bf16", "marlin", "humming", "ours"]
    assert all("NVFP4_PLUGIN_FAST_LAUNCH" not in env for _, env in runs)
    runs.clear()
    E.main(["run", "--out", str(tmp_path / "b"), "--models", "moe", "--configs", "ours", "ours-triton-launch"])
    assert runs == [("ours", {"PATH": "/bin"}),
                    ("ours-triton-launch", {"PATH": "/bin", "NVFP4_PLUGIN_FAST_LAUNCH": "0"})]
    assert E.CONFIGS["sglang"]["ours-triton-launch"] == E.CONFIGS["sglang"]["ours"]


def test_gpu_clock_sampler_summarises_nvidia_smi_lines():
    import sys

    from benchmarks.common import GpuClockSampler, clock_summary, smi_command
    assert smi_command(3)[-1] == "--id=3" and "clocks.sm,power.draw,clocks_throttle_reasons.active" in smi_command(3)[1]
    lines = ["1980, 120.5, 0x0000000000000000", "1485, 695.0, 0x0000000000000004", "1170, 690.0, 0x0000000000000004",
             "[N/A], 3.0, 0x0", "garbage"]
    s = clock_summary(lines)
    assert s == {"samples": 3, "sm_mhz_median": 1485.0, "sm_mhz_min": 1170.0, "power_w_median": 690.0,
                 "power_capped_share": 0.67}
    assert clock_summary([]) == {"samples": 0}
    fake = [sys.executable, "-c", "import time; print('1500, 650.0, 0x4', flush=True); time.sleep(30)"]
    with GpuClockSampler(command=fake) as c:
        import time
        time.sleep(1.0)
    assert c.summary["samples"] == 1 and c.summary["power_capped_share"] == 1.0
    with GpuClockSampler(command=["/nonexistent/nvidia-smi"]) as c:
        pass
    assert "error" in c.summary
    bad = [sys.executable, "-c", "import sys; sys.stderr.write('Field \"x\" is not a valid field to query.\\n'); "
                                 "sys.exit(2)"]
    with GpuClockSampler(command=bad) as c:
        time.sleep(0.5)
    assert c.summary == {"samples": 0, "error": 'Field "x" is not a valid field to query.'}
    assert GpuClockSampler(gpu="GPU-1234").command[-1] == "--id=GPU-1234"
    rows = [_result("bf16", {1: 1.0}, 100.0), _result("ours", {1: 1.0}, 90.0)]
    rows[1]["prefill"]["clocks"] = s
    md = E.clock_table(rows)
    assert md[4:5] == ["| ours | 90.0 | 1485 | 1170 | 690.0 | 67% |"] and len(md) == 6
    assert E.clock_table(rows[:1]) == []
    rows[0]["prefill"]["clocks"] = c.summary
    assert E.clock_table(rows)[4] == '| bf16 | 100.0 | no samples: Field "x" is not a valid field to query. | | | |'


def test_idle_gaps_name_what_the_host_did_meanwhile(tmp_path):
    """A profile window over several one-step runs: the GPU's idle stretches of 1 ms or more, and the host
    events that overlapped the longest (here our MoE op's host path, then a sync)."""
    events = [{"ph": "X", "cat": "kernel", "name": "k", "ts": 0.0, "dur": 1000.0},
              {"ph": "X", "cat": "kernel", "name": "k", "ts": 1500.0, "dur": 100.0},      # a 0.5 ms gap: ignored
              {"ph": "X", "cat": "kernel", "name": "k", "ts": 5600.0, "dur": 100.0},      # a 4 ms gap
              {"ph": "X", "cat": "kernel", "name": "k", "ts": 7700.0, "dur": 100.0},      # a 2 ms gap
              {"ph": "X", "cat": "cpu_op", "name": "nvfp4_layers::fused_moe", "ts": 1700.0, "dur": 3000.0},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 4700.0, "dur": 900.0},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 100.0, "dur": 50.0}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(events))
    g = E.kernel_table(str(path), steps=2)["idle_gaps"]
    assert g["count"] == 2 and g["total_us"] == 6000.0 and g["max_us"] == 4000.0
    assert g["host_during_max"] == [["nvfp4_layers::fused_moe", 3000.0], ["cudaStreamSynchronize", 900.0]]
    line = E.idle_gap_line(g, 2)
    assert line[0].startswith("GPU idle for 1 ms or more: 2 times over 2 steps, 6.0 ms in all, the longest 4.0 ms")
    assert "`nvfp4_layers::fused_moe` 3.0 ms" in line[0]
    assert E.idle_gap_line({"count": 0, "total_us": 0.0}, 2) == [] and E.idle_gap_line(None, 1) == []


def test_rounds_run_each_configuration_again_and_report_the_median(tmp_path, monkeypatch):
    """--rounds 3: every configuration three times, a round after the other, each in its own engine process,
    profiled in the first round only; the report reads one result per configuration with the median of the
    rounds (per-round values kept, first-run checks against the first round's own runs)."""
    cmds = []
    _offline_run(monkeypatch)
    monkeypatch.setattr(E.subprocess, "run", lambda cmd, **kw: cmds.append(cmd))
    E.main(["run", "--out", str(tmp_path), "--models", "moe", "--configs", "ours", "bf16", "--rounds", "3"])
    outs = [c[c.index("--out") + 1].rsplit("/", 1)[1] for c in cmds]
    # each round in its own order (rotated by one place a round)
    assert outs == ["vllm-moe-ours.json", "vllm-moe-bf16.json", "vllm-moe-bf16.round1.json",
                    "vllm-moe-ours.round1.json", "vllm-moe-ours.round2.json", "vllm-moe-bf16.round2.json"]
    assert ["--profile-batches" in c for c in cmds] == [True, True, False, False, False, False]
    with pytest.raises(SystemExit):
        E.main(["run", "--out", str(tmp_path), "--rounds", "0"])
    for i, (b1, pre) in enumerate([(500.0, 240.0), (650.0, 250.0), (600.0, 230.0)]):
        r = _result("ours", {1: b1, 8: 3000.0 + i}, pre, model="moe", first={1: 480.0})
        (tmp_path / f"vllm-moe-ours{'.round%d' % i if i else ''}.json").write_text(json.dumps(r))
    (tmp_path / "vllm-moe-bf16.json").write_text(json.dumps(_result("bf16", {1: 700.0, 8: 2900.0}, 260.0, model="moe")))
    res = {r["config"]: r for r in E.load_results(tmp_path)}
    assert set(res) == {"ours", "bf16"} and res["ours"]["rounds"] == 3 and "rounds" not in res["bf16"]
    d = res["ours"]["decode"]["1"]
    assert d["tok_s"] == 600.0 and d["rounds_tok_s"] == [500.0, 650.0, 600.0] and d["round0_tok_s"] == 500.0
    assert res["ours"]["prefill"]["tok_s"] == 240.0
    lines = E.checks(list(res.values()), "vllm", "moe")
    assert any(ln.startswith("first run of each shape within 5% of the second: PASS") for ln in lines)  # 480 vs 500
    assert "ours: the median of 3 rounds (fresh engine processes); tokens/s per round: b=1 500 / 650 / 600; " \
           "b=8 3000 / 3001 / 3002; prefill 240 / 250 / 230" in lines
    # rounds merge in their numeric order; a first round run again removes the later rounds of the earlier run
    for i in range(3, 11):
        (tmp_path / f"vllm-moe-ours.round{i}.json").write_text(json.dumps(_result("ours", {1: float(i)}, 1.0)))
    assert [v for v in E.load_results(tmp_path) if v["config"] == "ours"][0]["decode"]["1"]["rounds_tok_s"] == \
        [500.0, 650.0, 600.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    cmds.clear()
    E.main(["run", "--out", str(tmp_path), "--models", "moe", "--configs", "ours", "--overwrite"])
    assert len(cmds) == 1 and not list(tmp_path.glob("vllm-moe-ours.round*.json"))


def test_gpus_run_engines_side_by_side_round_after_round(tmp_path, monkeypatch):
    """--gpus 0 1: two engine processes at a time, each on its own GPU (CUDA_VISIBLE_DEVICES), each GPU taking
    the next configuration when its last one ends; a round starts after all of the previous one ended."""
    runs, lock = [], threading.Lock()
    together = threading.Barrier(2, timeout=20)      # the first two engines must be running at the same time

    def fake_run(cmd, **kw):
        name = cmd[cmd.index("--out") + 1].rsplit("/", 1)[1]
        side = cmd[cmd.index("--side-by-side") + 1] if "--side-by-side" in cmd else None
        with lock:
            runs.append(("start", name, kw["env"].get("CUDA_VISIBLE_DEVICES"), side))
            first_two = len(runs) <= 2
        if first_two:
            together.wait()
        time.sleep(0.05)
        with lock:
            runs.append(("end", name, None, None))

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    built = []
    monkeypatch.setattr(E, "build_models", lambda d, models, *_: built.append(models) or
                        {m: {"bf16": d / "b", "nvfp4": d / "q"} for m in models})
    monkeypatch.setattr(E, "plugin_env", lambda: {"PATH": "/bin"})
    monkeypatch.setattr(E, "report", lambda out: "")
    monkeypatch.setattr(E.subprocess, "run", fake_run)
    E.main(["run", "--out", str(tmp_path), "--models", "moe", "--gpus", "0", "1", "--rounds", "2"])
    starts = [(name, gpu, side) for what, name, gpu, side in runs if what == "start"]
    assert len(starts) == 8 and {g for _, g, _ in starts} == {"0", "1"}
    assert all(side == gpu for _, gpu, side in starts)                  # the worker is told where it ran
    # taken in the round's order: the first two at once, the next two as those end
    assert {n for n, _, _ in starts[:2]} == {"vllm-moe-bf16.json", "vllm-moe-marlin.json"}
    assert {n for n, _, _ in starts[2:4]} == {"vllm-moe-humming.json", "vllm-moe-ours.json"}
    # round 1 (rotated order) starts only after every process of round 0 ended
    last_end_0 = max(i for i, (what, name, _, _) in enumerate(runs) if what == "end" and ".round" not in name)
    first_start_1 = min(i for i, (what, name, _, _) in enumerate(runs) if what == "start" and ".round1" in name)
    assert last_end_0 < first_start_1
    # engines of --tp GPUs each, numbered within this process's CUDA_VISIBLE_DEVICES; a name given twice once
    runs.clear()
    together.reset()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    E.main(["run", "--out", str(tmp_path / "tp"), "--models", "moe", "--configs", "ours", "marlin", "ours",
            "--tp", "2", "--gpus", "0", "1", "2", "3"])
    assert sorted(g for what, _, g, _ in runs if what == "start") == ["4,5", "6,7"]
    # bad --gpus refused before any model is built
    built.clear()
    for bad, tp in ((["0", "0"], "1"), (["0", "1", "2"], "2"), (["4"], "1"), (["x"], "1")):
        with pytest.raises(SystemExit, match="--gpus"):
            E.main(["run", "--out", str(tmp_path / "bad"), "--tp", tp, "--gpus", *bad])
    assert not built
    # without --gpus: one at a time, CUDA_VISIBLE_DEVICES left as it is, the worker not told of a neighbour
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    runs.clear()
    monkeypatch.setattr(E.subprocess, "run", lambda cmd, **kw: runs.append(
        ("start", "", kw["env"].get("CUDA_VISIBLE_DEVICES"), "--side-by-side" in cmd)))
    E.main(["run", "--out", str(tmp_path / "one"), "--models", "moe", "--configs", "ours", "bf16"])
    assert [(g, side) for _, _, g, side in runs] == [(None, False), (None, False)]


def test_side_by_side_stops_at_the_first_error_and_raises_it():
    """An engine job that raises in any slot: no slot takes another job, the running ones end, the error is
    raised (a lost configuration must not pass for a finished run)."""
    done, lock = [], threading.Lock()

    def job(i, slot):
        if i == 1:
            raise RuntimeError("worker could not start")
        time.sleep(0.2 if i == 0 else 0.0)
        with lock:
            done.append((i, slot))

    with pytest.raises(RuntimeError, match="could not start"):
        E.run_side_by_side([(i,) for i in range(6)], ["a", "b"], job)
    assert [i for i, _ in done] == [0]        # job 0 ended; jobs 2-5 never started
    done.clear()
    E.run_side_by_side([(i,) for i in (0, 2, 3)], ["a", "b"], job)
    assert sorted(i for i, _ in done) == [0, 2, 3]
    done.clear()
    E.run_side_by_side([(i,) for i in (2, 3)], [None], job)
    assert done == [(2, None), (3, None)]


def test_a_timed_out_worker_keeps_its_sweep_and_an_unfinished_result_runs_again(tmp_path, monkeypatch):
    _offline_run(monkeypatch)
    partial = dict(_result("ours", {1: 500.0}, 240.0, model="moe"), incomplete="the engine process ended after the sweep")

    def hangs_after_the_sweep(cmd, **kw):
        Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps(partial))
        raise E.subprocess.TimeoutExpired(cmd, 1)

    from pathlib import Path
    monkeypatch.setattr(E.subprocess, "run", hangs_after_the_sweep)
    E.main(["run", "--out", str(tmp_path), "--models", "moe", "--configs", "ours", "bf16"])
    ours = json.loads((tmp_path / "vllm-moe-ours.json").read_text())
    assert ours["decode"]["1"]["tok_s"] == 500.0 and ours["error"].startswith("timed out after")
    assert ours["incomplete"]
    # a run without --overwrite runs the unfinished configurations again, not the finished ones
    (tmp_path / "vllm-moe-bf16.json").write_text(json.dumps(_result("bf16", {1: 400.0}, 230.0, model="moe")))
    cmds = []
    monkeypatch.setattr(E.subprocess, "run", lambda cmd, **kw: cmds.append(cmd[cmd.index("--config") + 1]))
    E.main(["run", "--out", str(tmp_path), "--models", "moe", "--configs", "ours", "bf16"])
    assert cmds == ["ours"]


def test_report_names_incomplete_results_and_gpus_side_by_side(tmp_path):
    rows = [dict(_result("bf16", {1: 100.0}, 90.0, model="moe"), gpus="0"),
            dict(_result("ours", {1: 120.0}, 95.0, model="moe"), gpus="1",
                 incomplete="the engine process ended after the sweep")]
    for r in rows:
        (tmp_path / f"vllm-moe-{r['config']}.json").write_text(json.dumps(r))
    md = E.report(tmp_path)
    assert "- ours: the engine process ended after the sweep (no profiles; its sweep above stands)" in md
    assert "- side by side, one engine per GPU group (`--gpus`): bf16 on 0; ours on 1 (the engines shared" in md
    assert "| ours |  | 80.0 | 120 | 95 |" in md
    # one GPU: no side-by-side line, no incomplete line for a finished result
    rows[1].update(gpus="0")
    del rows[1]["incomplete"]
    (tmp_path / "vllm-moe-ours.json").write_text(json.dumps(rows[1]))
    md = E.report(tmp_path)
    assert "side by side" not in md and "no profiles" not in md


def test_tree_cpu_meter_counts_a_busy_child_and_names_it():
    """The engine runs its host loop in a child process (vLLM's EngineCore): the meter takes the CPU time of
    the whole tree and tells which process spent it."""
    import subprocess
    import sys as _sys

    from benchmarks.common import TreeCpuMeter, process_tree

    child = subprocess.Popen([_sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    try:
        time.sleep(0.3)
        assert child.pid in process_tree()
        with TreeCpuMeter() as m:
            time.sleep(0.8)
        busy = [(k, v) for k, v in m.cpu_s.items() if k.endswith(f"[{child.pid}]")]
        assert busy and busy[0][1] > 0.3, m.cpu_s          # ~0.8 s of CPU in 0.8 s of wall
        assert m.busiest(1)[0][0].endswith(f"[{child.pid}]") and m.wall_s >= 0.8
        assert f"[{child.pid}]" in "".join(m.cpus)
        # the whole machine was at least as busy as the child, and stole at most the block's CPU time
        assert m.machine_busy_s >= 0.3 and 0 <= m.steal_s <= m.wall_s * os.cpu_count()
    finally:
        child.kill()
        child.wait()


def test_report_names_the_host_loop_per_round():
    d0 = {"tok_s": 500.0, "first_tok_s": 500.0, "ms_per_step": 2.0, "host_cpu_ms_per_step": {"EngineCore[12]": 1.9,
                                                                                         "python3[10]": 0.4},
          "wall_ms_per_step": 2.0}
    d1 = dict(d0, tok_s=700.0, host_cpu_ms_per_step={"EngineCore[40]": 1.3}, wall_ms_per_step=1.4)
    assert E.host_cpu_summary(d0) == "EngineCore 1.90 / 2.00 ms" and E.host_cpu_summary({"tok_s": 1.0}) is None
    first = {"config": "ours", "engine": "vllm", "model": "moe", "decode": {"1": d0}}
    merged = E.merge_rounds(first, [{"decode": {"1": d1}}])
    assert merged["decode"]["1"]["rounds_host_cpu"] == ["EngineCore 1.90 / 2.00 ms", "EngineCore 1.30 / 1.40 ms"]
    bf16 = {"config": "bf16", "engine": "vllm", "model": "moe", "decode": {"1": dict(d0, tok_s=650.0)}}
    lines = E.checks([merged, bf16], "vllm", "moe")
    assert ("host CPU per decode step at batch 1 (busiest process of the engine, CPU / wall): bf16 EngineCore "
            "1.90 / 2.00 ms, ours EngineCore 1.90 / 2.00 ms; EngineCore 1.30 / 1.40 ms") in lines
    assert not any(x.startswith("CPUs busy outside") for x in lines)     # results from before the field


def test_report_names_other_work_and_steal_of_every_round():
    """The most CPUs busy outside the engine's tree and stolen by the hypervisor over a config's decode runs,
    its later rounds included: a host-bound run that slowed shows whether the machine was shared."""
    d0 = {"tok_s": 500.0, "first_tok_s": 500.0, "ms_per_step": 2.0,
          "host_cpus": {"tree": 1.2, "machine": 1.5, "steal": 0.01}}
    d1 = dict(d0, tok_s=300.0, host_cpus={"tree": 1.1, "machine": 3.6, "steal": 0.4})
    first = {"config": "ours", "engine": "vllm", "model": "moe", "decode": {"1": d0, "2": dict(d0, tok_s=900.0)}}
    merged = E.merge_rounds(first, [{"decode": {"1": d1, "2": dict(d0, tok_s=900.0)}}])
    assert merged["decode"]["1"]["rounds_host_cpus"] == [d0["host_cpus"], d1["host_cpus"]]
    bf16 = {"config": "bf16", "engine": "vllm", "model": "moe",
            "decode": {"1": dict(d0, tok_s=400.0), "2": dict(d0, tok_s=800.0, host_cpus={"tree": 1.0})}}
    lines = E.checks([merged, bf16], "vllm", "moe")
    assert ("CPUs busy outside the engine's processes / stolen by the hypervisor during the decode runs (the most "
            "of any batch or round, each maximum on its own): bf16 0.30 / 0.01, ours 2.50 / 0.40") in lines


def test_host_cpus_of_a_meter():
    m = types.SimpleNamespace(wall_s=2.0, cpu_s={"a[1]": 1.0, "b[2]": 0.5}, machine_busy_s=4.0, steal_s=0.1)
    assert E.host_cpus(m) == {"tree": 0.75, "machine": 2.0, "steal": 0.05}
    m.machine_busy_s = None                                          # no /proc/stat
    assert E.host_cpus(m) == {"tree": 0.75}
    m.wall_s = 0.0                                                   # nothing measured: no NaN in the JSON
    assert E.host_cpus(m) == {}


class _FakeSglangEngine:
    """SGLang's Engine as bench_e2e's profiler code uses it, with its scheduler's by-stage contract
    (scheduler_components/profiler_manager.py, 0.5.17): a trace starts at a stage's first step, a decode
    step flushes an open prefill (EXTEND) trace, and a stage's trace is written once its count passes
    ``num_steps``; ``stop_profile`` with nothing open raises."""

    def __init__(self, chunk=8192, real_chunk=None):
        self.server_args = type("SA", (), {"chunked_prefill_size": chunk})()
        self.real_chunk = real_chunk or chunk
        self.kw, self.open, self.calls = None, None, []

    def start_profile(self, **kw):
        self.calls.append(("start", kw))
        self.kw, self.ct = kw, {"EXTEND": 0, "DECODE": 0}

    def _write(self, suffix):
        stage, events = self.open
        name = f"{self.kw['profile_id']}-TP-0{suffix}.trace.json.gz"
        with gzip.open(f"{self.kw['output_dir']}/{name}", "wt") as f:
            json.dump({"traceEvents": events}, f)
        self.open = None

    def stop_profile(self):
        self.calls.append(("stop", {}))
        if self.open is None:
            raise RuntimeError("Profiling is not in progress. Call /start_profile first.")
        self._write("")

    def step(self, stage, us):
        if self.kw is None:                     # no profile asked for yet
            return
        if self.ct[stage] == 0:
            if self.open is not None:
                self._write("-" + self.open[0])
            self.open = (stage, [])
        self.ct[stage] += 1
        if self.ct[stage] > self.kw["num_steps"]:
            if self.open is not None and self.open[0] == stage:
                self._write("-" + stage)
            return
        if self.open is not None:
            self.open[1].append({"ph": "X", "cat": "kernel", "name": stage.lower(), "ts": 10.0 * len(self.open[1]),
                                 "dur": us})

    def run(self, n, length, gen):
        for _ in range(-(-n * length // self.real_chunk)):
            self.step("EXTEND", 100.0)
        for _ in range(gen - 1):
            self.step("DECODE", 7.0)


def test_sglang_profiles_by_stage(tmp_path):
    import types
    eng = _FakeSglangEngine()
    a = types.SimpleNamespace(out=str(tmp_path / "r.json"), profile_steps=4, profile_batches=[1, 8], prompt_len=128,
                              prefill=[64, 896], engine="sglang", model="moe", config="ours")
    runs = []

    def timed(n, length, gen):
        runs.append((n, length, gen))
        eng.run(n, length, gen)
        return n * gen, 1.0

    result = {}
    E._sglang_profiles(eng, a, timed, result)
    prof = result["profile"]
    assert set(prof) == {"1", "8", "prefill"}
    assert prof["8"]["gpu_us_per_step"] == 7.0 and prof["8"]["trace"].endswith("-DECODE.trace.json.gz")
    assert prof["prefill"]["gpu_us_per_step"] == 100.0 and prof["prefill"]["tokens_per_step"] == 8192
    # enough prompts of the prefill length for the profiled steps plus two full chunks
    assert runs[-1] == (-(-6 * 8192 // 896), 896, 1)
    starts = [kw for op, kw in eng.calls if op == "start"]
    assert all(kw["profile_by_stage"] and kw["num_steps"] == 4 and kw["with_stack"] is False for kw in starts)
    assert not [op for op, _ in eng.calls if op == "stop"]      # every stage closed itself


def test_sglang_profile_of_a_short_run_is_closed_and_skipped(tmp_path):
    import types
    eng = _FakeSglangEngine(chunk=512, real_chunk=1 << 20)   # the whole prefill in one step: fewer than asked
    a = types.SimpleNamespace(out=str(tmp_path / "r.json"), profile_steps=4, profile_batches=[], prompt_len=128,
                              prefill=[64, 896], engine="sglang", model="moe", config="ours")
    result = {}
    E._sglang_profiles(eng, a, lambda n, length, gen: (eng.run(n, length, gen), (n, 1.0))[1], result)
    assert result["profile"] == {}
    assert [op for op, _ in eng.calls] == ["start", "stop"] and eng.open is None


def test_moe_depth_builds_its_own_checkpoints_and_names_itself(tmp_path, monkeypatch):
    """``--moe-layers``: the MoE checkpoints at another depth are built beside the default ones (make-model
    ``--layers``), the worker records the depth it served, and the report's section and plot say it."""
    cmds = []
    monkeypatch.setattr(E.subprocess, "run", lambda cmd, **kw: cmds.append(cmd))
    paths = E.build_models(tmp_path, ["moe", "dense"], 24)
    assert paths["moe"] == {"bf16": tmp_path / "moe-L24-bf16", "nvfp4": tmp_path / "moe-L24-nvfp4"}
    assert paths["dense"]["bf16"] == tmp_path / "dense-bf16"
    mk = [c for c in cmds if "make-model" in c]
    assert mk[0][mk[0].index("make-model") + 1:] == [str(tmp_path / "moe-L24-bf16"), "--arch", "qwen3_moe", "--size",
                                                     "8b-shape", "--layers", "24"]
    assert "--layers" not in mk[1]                                    # dense keeps its shape
    cmds.clear()
    assert E.build_models(tmp_path, ["moe"])["moe"]["bf16"] == tmp_path / "moe-bf16"
    assert "--layers" not in cmds[0]
    with pytest.raises(SystemExit):
        E.main(["models", "--moe-layers", "0"])
    # the worker reads the depth from the checkpoint it serves
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({"num_hidden_layers": 24}))
    monkeypatch.setattr(E, "_vllm_worker",
                        lambda a, result: result.update(decode={"1": {"tok_s": 1.0, "first_tok_s": 1.0}}))
    monkeypatch.setattr(E.os, "_exit", lambda rc: exits.append(rc))   # the worker ends its process
    exits = []
    out = tmp_path / "res" / "vllm-moe-ours.json"
    out.parent.mkdir()
    E.main(["worker", "--engine", "vllm", "--model", "moe", "--config", "ours", "--model-path", str(ck),
            "--out", str(out)])
    assert exits == [0]
    r = json.loads(out.read_text())
    assert r["layers"] == 24 and "error" not in r
    assert "## vllm, moe (Qwen3-30B-A3B shape, 24 layers)" in E.report(out.parent)
    assert E.model_label("moe") == "Qwen3-30B-A3B shape, 12 layers" == E.MODELS["moe"][1]
    assert E.model_label("dense", 32) == E.MODELS["dense"][1]
    # one depth per --out folder: a run at another depth than the results already there is refused, before
    # anything is built or run (the result files do not name the depth; finished configurations are skipped)
    monkeypatch.setattr(E, "build_models", lambda *a: pytest.fail("models built"))
    with pytest.raises(SystemExit, match=r"--moe-layers 12, but vllm-moe-ours.json .* at 24 layers"):
        E.main(["run", "--out", str(out.parent), "--models", "moe"])
    (out.parent / "vllm-moe-bf16.json").write_text(json.dumps(_result("bf16", {1: 1.0}, model="moe")))
    with pytest.raises(SystemExit, match=r"--moe-layers 24, but vllm-moe-bf16.json .* at 12 layers"):
        E.main(["run", "--out", str(out.parent), "--models", "moe", "--moe-layers", "24"])
    (out.parent / "vllm-moe-bf16.json").unlink()
    E.check_depth(out.parent, 24)                                     # the same depth: fine
    # served results name the depth too
    serve = {"engine": "vllm", "model": "moe", "config": "ours", "layers": 24,
             "concurrency": {"1": {"tok_s": 10.0, "ttft_ms_p50": 1, "ttft_ms_p99": 2, "itl_ms_p50": 3,
                                   "itl_ms_p99": 4}}}
    (out.parent / "serve-vllm-moe-ours.json").write_text(json.dumps(serve))
    assert "| vllm | moe, 24 layers | ours | 1 | 10 |" in E.report(out.parent)


def test_served_models_are_built_too(tmp_path, monkeypatch):
    """``--serve --serve-models moe`` with ``--models dense``: the MoE checkpoints are built as well (the
    servers need them), and only when something is served."""
    built = []

    def fake_build(d, models, layers):
        built.append((list(models), layers))
        return {m: {"bf16": d / "b", "nvfp4": d / "q"} for m in models}

    monkeypatch.setattr(E, "build_models", fake_build)
    monkeypatch.setattr(E, "plugin_env", lambda: {})
    monkeypatch.setattr(E, "report", lambda out: "")
    monkeypatch.setattr(E.subprocess, "run", lambda cmd, **kw: None)
    monkeypatch.setattr(E, "serve_bench", lambda a, engine, model, config, path, env, port=None: {"engine": engine,
                                                                                                "model": model})
    E.main(["run", "--out", str(tmp_path / "a"), "--models", "dense", "--configs", "ours", "--serve",
            "--serve-models", "moe", "--moe-layers", "20"])
    E.main(["run", "--out", str(tmp_path / "b"), "--models", "dense", "--configs", "ours", "--serve-models", "moe"])
    assert built == [(["dense", "moe"], 20), (["dense"], 12)]


def test_engine_env_puts_each_engines_site_first_and_the_others_off(tmp_path):
    vsite, ssite = tmp_path / "site", tmp_path / "site_sg"
    for d in (vsite / "bin", ssite / "bin", ssite / "ninja" / "data" / "bin"):
        d.mkdir(parents=True)
    env = {"PYTHONPATH": os.pathsep.join([str(vsite), "/ep", "/repo"]),
           "PATH": os.pathsep.join([str(vsite / "ninja" / "data" / "bin"), str(vsite / "bin"), "/usr/bin"]),
           "X": "1"}
    sites = {"vllm": str(vsite), "sglang": str(ssite)}
    sg = E.engine_env(env, "sglang", sites)
    assert sg["PYTHONPATH"].split(os.pathsep) == [str(ssite), "/ep", "/repo"]
    assert sg["PATH"].split(os.pathsep) == [str(ssite / "bin"), str(ssite / "ninja" / "data" / "bin"),
                                            str(vsite / "ninja" / "data" / "bin"), "/usr/bin"]   # a ninja stays
    assert sg["X"] == "1"
    vl = E.engine_env(env, "vllm", sites)
    assert vl["PYTHONPATH"].split(os.pathsep) == [str(vsite), "/ep", "/repo"]     # its own once, first
    assert vl["PATH"].split(os.pathsep) == [str(vsite / "bin"), str(vsite / "ninja" / "data" / "bin"), "/usr/bin"]
    assert E.engine_env(env, "vllm", {}) is env                                   # no --site: as it was
    with pytest.raises(SystemExit):
        E.parser().parse_args(["run", "--out", "o", "--site", f"tgi={vsite}"])
    with pytest.raises(SystemExit):
        E.parser().parse_args(["run", "--out", "o", "--site", f"vllm={tmp_path / 'missing'}"])
    with pytest.raises(SystemExit, match="an engine named twice"):
        E.main(["run", "--out", str(tmp_path / "o"), "--site", f"vllm={vsite}", "--site", f"vllm={ssite}"])


def test_one_run_takes_both_engines_side_by_side_and_serves_side_by_side(tmp_path, monkeypatch):
    """--engines vllm sglang --site ... --gpus 0 1 2 3 --serve: each engine's processes import only its own
    bundle; SGLang's JIT prebuild runs in SGLang's environment while vLLM's configurations run, and SGLang's
    wait for it; the servers run side by side too, each on its slot's GPU and its own port."""
    vsite, ssite = tmp_path / "site", tmp_path / "site_sg"
    vsite.mkdir()
    ssite.mkdir()
    events, lock = [], threading.Lock()
    tok = {"marlin": 100.0, "humming": 120.0, "builtin": 90.0, "ours": 130.0, "bf16": 80.0}

    class FakePrebuild:           # the SGLang JIT prebuild's process: 0.3 s
        def __init__(self, cmd, **kw):
            assert "prebuild-sglang-jit" in cmd
            self.py = kw["env"]["PYTHONPATH"].split(os.pathsep)[0]
            self.rc = None
            with lock:
                events.append(("prebuild start", self.py, None))

        def wait(self, timeout=None):
            time.sleep(0.3)
            with lock:
                events.append(("prebuild end", self.py, None))
            self.rc = 0
            return 0

        def poll(self):
            return self.rc

    def fake_run(cmd, **kw):
        py = kw["env"]["PYTHONPATH"].split(os.pathsep)[0]
        out = cmd[cmd.index("--out") + 1]
        engine, config = cmd[cmd.index("--engine") + 1], cmd[cmd.index("--config") + 1]
        with lock:
            events.append(("start", f"{engine}-{config}", py))
        time.sleep(0.05)
        with open(out, "w") as f:
            json.dump(_result(config, {1: tok[config]}, engine=engine, model="dense"), f)

    served = []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(vsite))
    _offline_run(monkeypatch, env=os.environ)
    monkeypatch.setattr(E.subprocess, "run", fake_run)
    monkeypatch.setattr(E.subprocess, "Popen", FakePrebuild)
    monkeypatch.setattr(E, "checkpoint_layers", lambda path: None)

    def fake_serve(a, engine, model, config, path, env, port=None, turns=None):
        gate, who = turns
        assert who == ("ours" if config == "ours" else "best")
        with lock:
            served.append((engine, config, env["CUDA_VISIBLE_DEVICES"], port, env["PYTHONPATH"].split(os.pathsep)[0]))
            events.append(("serve", f"serve {engine}-{config}", None))
        time.sleep(0.05)
        gate.leave(who)
        return {"engine": engine, "model": model, "config": config}

    monkeypatch.setattr(E, "serve_bench", fake_serve)
    E.main(["run", "--out", str(tmp_path / "o"), "--engines", "vllm", "sglang", "--models", "dense",
            "--site", f"vllm={vsite}", "--site", f"sglang={ssite}", "--gpus", "0", "1", "2", "3", "--serve",
            "--port", "9000"])
    starts = [(name, py) for what, name, py in events if what == "start"]
    assert sorted(n for n, _ in starts) == sorted(["vllm-bf16", "vllm-marlin", "vllm-humming", "vllm-ours",
                                                   "sglang-bf16", "sglang-builtin", "sglang-ours"])
    assert all(py == str(vsite if n.startswith("vllm") else ssite) for n, py in starts)
    assert ("prebuild start", str(ssite), None) in events
    end = events.index(("prebuild end", str(ssite), None))
    first_sglang = min(i for i, e in enumerate(events) if e[0] == "start" and e[1].startswith("sglang"))
    first_vllm = min(i for i, e in enumerate(events) if e[0] == "start" and e[1].startswith("vllm"))
    assert first_vllm < end < first_sglang
    # servers: ours and each engine's best built-in, one per slot at once, port = --port + the slot's place
    assert sorted((e, c) for e, c, *_ in served) == [("sglang", "builtin"), ("sglang", "ours"), ("vllm", "humming"),
                                                     ("vllm", "ours")]
    assert all(port == 9000 + int(gpu) for _, _, gpu, port, _ in served)        # --port + the slot's place
    # vLLM's servers after vLLM's sweeps, beside SGLang's (not after every sweep of the run)
    at = {name: i for i, (what, name, _) in enumerate(events) if what in ("start", "serve")}
    vllm_served = min(at["serve vllm-ours"], at["serve vllm-humming"])
    assert max(at[f"vllm-{c}"] for c in tok if c != "builtin") < vllm_served
    assert vllm_served < max(at[f"sglang-{c}"] for c in ("bf16", "builtin", "ours"))
    assert all(py == str(vsite if e == "vllm" else ssite) for e, _, _, _, py in served)
    assert sorted(p.name for p in (tmp_path / "o").glob("serve-*.json")) == [
        "serve-sglang-dense-builtin.json", "serve-sglang-dense-ours.json", "serve-vllm-dense-humming.json",
        "serve-vllm-dense-ours.json"]
    # --serve-engines: only vLLM's servers; an engine not run is refused
    served.clear()
    E.main(["run", "--out", str(tmp_path / "v"), "--engines", "vllm", "sglang", "--models", "dense",
            "--site", f"vllm={vsite}", "--site", f"sglang={ssite}", "--gpus", "0", "1", "--serve",
            "--serve-engines", "vllm"])
    assert sorted((e, c) for e, c, *_ in served) == [("vllm", "humming"), ("vllm", "ours")]
    with pytest.raises(SystemExit, match="--serve-engines sglang: not among --engines vllm"):
        E.main(["run", "--out", str(tmp_path / "w"), "--engines", "vllm", "--serve", "--serve-engines", "sglang"])


def test_no_server_starts_after_a_sweep_failed(tmp_path, monkeypatch):
    """A sweep that raises while another slot's serve job waits for it: the server is not started (the run
    is ending), and the error is raised."""
    def fake_run(cmd, **kw):
        config = cmd[cmd.index("--config") + 1]
        if config == "marlin":
            time.sleep(0.2)
            raise RuntimeError("marlin's worker could not start")
        with open(cmd[cmd.index("--out") + 1], "w") as f:
            json.dump(_result(config, {1: 100.0}), f)

    served = []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _offline_run(monkeypatch)
    monkeypatch.setattr(E.subprocess, "run", fake_run)
    monkeypatch.setattr(E, "serve_bench", lambda *args, **kw: served.append(args) or {})
    with pytest.raises(RuntimeError, match="marlin's worker"):
        E.main(["run", "--out", str(tmp_path), "--models", "dense", "--configs", "ours", "marlin", "--gpus", "0", "1",
                "--serve"])
    assert served == []


def test_sglang_prebuild_is_killed_after_its_timeout_and_when_stopped(tmp_path, monkeypatch):
    class Proc:
        killed = 0

        def __init__(self, cmd, **kw):
            self.cmd, self.rc = cmd, None

        def wait(self, timeout=None):
            if timeout is not None and self.rc is None:
                raise E.subprocess.TimeoutExpired(self.cmd, timeout)
            return self.rc

        def poll(self):
            return self.rc

        def kill(self):
            Proc.killed += 1
            self.rc = -9

    monkeypatch.setattr(E.subprocess, "Popen", Proc)
    pb = E.SglangPrebuild({}, tmp_path, marlin=False)
    assert pb.done.wait(5)           # the timeout ends it: SGLang's configurations go on, building what they miss
    assert Proc.killed == 1 and pb.proc.cmd[-1] == "--no-marlin"
    pb.stop()                        # already ended: nothing more to kill
    assert Proc.killed == 1

    class Running(Proc):
        def wait(self, timeout=None):
            while self.rc is None:
                time.sleep(0.01)
            return self.rc

    monkeypatch.setattr(E.subprocess, "Popen", Running)
    pb = E.SglangPrebuild({}, tmp_path, marlin=True)
    while pb.proc is None:
        time.sleep(0.01)
    assert not pb.done.is_set()
    pb.stop()                        # the run ended first: the nvcc process goes with it
    assert pb.done.wait(5) and Proc.killed == 2


def test_profile_configs_names_the_configurations_profiled(tmp_path, monkeypatch):
    cmds = []
    _offline_run(monkeypatch)
    monkeypatch.setattr(E.subprocess, "run", lambda cmd, **kw: cmds.append(cmd))
    E.main(["run", "--out", str(tmp_path / "a"), "--models", "dense", "--profile-batches", "1", "8",
            "--profile-configs", "vllm:ours", "humming"])
    prof = {c[c.index("--config") + 1]: c[c.index("--profile-batches") + 1:c.index("--profile-batches") + 3]
            for c in cmds if "--profile-batches" in c}
    assert prof == {"ours": ["1", "8"], "humming": ["1", "8"]} and len(cmds) == 4
    cmds.clear()
    E.main(["run", "--out", str(tmp_path / "b"), "--models", "dense", "--configs", "ours", "bf16"])
    assert all("--profile-batches" in c for c in cmds) and len(cmds) == 2        # default: every one
    with pytest.raises(SystemExit, match="--profile-configs sglang:humming: no such configuration"):
        E.main(["run", "--out", str(tmp_path / "c"), "--profile-configs", "sglang:humming"])


def test_serve_turns_run_each_phase_once_every_server_is_up_in_member_order():
    """The two servers of an engine and model: no phase before both are up, then ours' phase k, the built-in's
    phase k, ours' phase k + 1, ... whatever each thread's own pace."""
    gate = E.ServeTurns(["ours", "best"])
    log, lock = [], threading.Lock()

    def member(who, start_s, phase_s):
        time.sleep(start_s)
        with lock:
            log.append((who, "up"))
        gate.ready(who)
        for k in range(3):
            with gate.turn(who):
                with lock:
                    log.append((who, k))
                time.sleep(phase_s)
        gate.leave(who)

    threads = [threading.Thread(target=member, args=("ours", 0.0, 0.01)),
               threading.Thread(target=member, args=("best", 0.15, 0.03))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert log[:2] == [("ours", "up"), ("best", "up")]
    assert log[2:] == [("ours", 0), ("best", 0), ("ours", 1), ("best", 1), ("ours", 2), ("best", 2)]


def test_serve_turns_stop_waiting_for_a_member_that_left_or_a_run_that_failed():
    gate = E.ServeTurns(["ours", "best"])
    gate.leave("best")                     # its server never came up (or no built-in to serve)
    gate.ready("ours")
    for _ in range(3):
        with gate.turn("ours"):
            pass
    failed = threading.Event()
    gate = E.ServeTurns(["ours", "best"], abort=failed.is_set)
    done = threading.Event()

    def ours():
        gate.ready("ours")                 # "best" never starts: the run is ending
        done.set()

    t = threading.Thread(target=ours)
    t.start()
    assert not done.wait(0.3)
    failed.set()
    assert done.wait(5)
    t.join()


def test_side_by_side_servers_of_one_model_measure_in_turn(tmp_path, monkeypatch):
    """--gpus with --serve: ours' and the best built-in's servers start side by side, and each measured phase
    (first request, every concurrency's warm-up and measurement) runs while the other server waits."""
    import sys
    import types

    phases, lock = [], threading.Lock()

    class Proc:
        def __init__(self, cmd, **kw):
            self.port = int(cmd[cmd.index("--port") + 1])

        def poll(self):
            return None

    up_at = {}

    def healthy(port):
        up_at.setdefault(port, time.time() + (0.0 if port == 9000 else 0.3))   # ours' server is up first
        return time.time() >= up_at[port]

    def fake_stream(port, prompt, gen):
        with lock:
            phases.append(port)
        time.sleep(0.01)
        return {"chunk_times": [0.01, 0.02], "tokens": 2}

    monkeypatch.setitem(sys.modules, "serve_check", types.SimpleNamespace(
        healthy=healthy, stop_server=lambda proc: None, server_command=lambda *a, **k: ["srv", "--port", str(a[2])]))
    monkeypatch.setattr(E.subprocess, "Popen", Proc)
    monkeypatch.setattr(E, "stream_completion", fake_stream)
    monkeypatch.setattr(E, "tokenizer_vocab", lambda path: 64)
    monkeypatch.setattr(E, "checkpoint_layers", lambda path: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _offline_run(monkeypatch)

    def fake_run(cmd, **kw):
        config = cmd[cmd.index("--config") + 1]
        with open(cmd[cmd.index("--out") + 1], "w") as f:
            json.dump(_result(config, {1: {"ours": 130.0, "marlin": 100.0}[config]}), f)

    monkeypatch.setattr(E.subprocess, "run", fake_run)
    E.main(["run", "--out", str(tmp_path), "--models", "dense", "--configs", "ours", "marlin", "--gpus", "0", "1",
            "--serve", "--port", "9000", "--concurrency", "1", "2", "--requests-per-client", "1"])
    ports = sorted(set(phases))
    assert len(ports) == 2
    # runs of one server's requests, in order: first request, then warm-up and measurement of concurrency 1 and 2
    runs = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]
    sizes = [1, 1, 1, 2, 2]                              # requests per phase
    assert runs == [runs[0], runs[1]] * len(sizes)
    for config in ("ours", "marlin"):
        res = json.loads((tmp_path / f"serve-vllm-dense-{config}.json").read_text())
        assert "error" not in res and res["concurrency"]["2"]["requests"] == 2


def test_gpu_check_runs_once_on_every_gpu_before_the_engines_and_is_reported(tmp_path, monkeypatch, _no_gpu_check):
    """run --gpus: the GEMM loop on each GPU of the slots, at once, before the first engine process; not with one
    slot, not with --no-gpu-check. The report's table names each GPU's TFLOP/s and the spread, and a failed GPU."""
    order = []
    _offline_run(monkeypatch, {"PATH": "/bin"})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(E, "gpu_check", lambda out, gpus, env, **kw: order.append(("check", list(gpus))))
    monkeypatch.setattr(E.subprocess, "run", lambda cmd, **kw: order.append(("engine", cmd[cmd.index("--config") + 1])))
    E.main(["run", "--out", str(tmp_path / "a"), "--models", "moe", "--configs", "ours", "bf16", "--gpus", "0", "1"])
    assert order[0] == ("check", ["0", "1"]) and sorted(order[1:]) == [("engine", "bf16"), ("engine", "ours")]
    for argv in (["--gpus", "0", "1", "--no-gpu-check"], ["--gpus", "0"], []):
        order.clear()
        E.main(["run", "--out", str(tmp_path / "b"), "--models", "moe", "--configs", "ours", "--overwrite", *argv])
        assert [what for what, _ in order] == ["engine"], argv
    # the check itself: one process per GPU, each on its own GPU, a hung one reported as such
    cmds = []

    def fake_run(cmd, **kw):
        gpu = kw["env"]["CUDA_VISIBLE_DEVICES"]
        cmds.append((cmd[cmd.index("gpu-check"):cmd.index("--out")], gpu))
        if gpu == "3":
            raise E.subprocess.TimeoutExpired(cmd, kw["timeout"])
        out = cmd[cmd.index("--out") + 1]
        tf = {"0": 668.0, "2": 701.4}[gpu]
        (tmp_path / "c" / out.rsplit("/", 1)[1]).write_text(json.dumps(
            {"gpu": gpu, "tflops": tf, "clocks": {"samples": 90, "sm_mhz_median": 1470.0, "power_w_median": 691.5,
                                                  "power_capped_share": 0.97}}))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "gpu-check-7.json").write_text(json.dumps({"gpu": "7", "tflops": 1.0}))   # an earlier run's
    monkeypatch.setattr(E.subprocess, "run", fake_run)
    _no_gpu_check.real(tmp_path / "c", ["0", "2", "3"], {"PATH": "/bin"})
    assert sorted(g for _, g in cmds) == ["0", "2", "3"] and all(c == ["gpu-check"] for c, _ in cmds)
    table = "\n".join(E.gpu_check_table(tmp_path / "c"))
    assert "| 0 | 668.0 | 1470.0 | 691.5 | 97% |" in table and "| 2 | 701.4 |" in table
    assert "| 3 | failed: timed out after 180 s |" in table and "| 7 |" not in table
    assert "Fastest over slowest GPU: 1.050x." in table
    assert E.gpu_check_table(tmp_path / "a") == []          # no check, no section


def test_gpu_check_worker_records_why_it_could_not_measure(tmp_path, monkeypatch):
    """On a machine without a GPU (this one) the worker writes the error and exits 1; the run goes on."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("measures for real on a GPU")
    rc = E.main(["gpu-check", "--out", str(tmp_path / "g.json"), "--warm", "0", "--seconds", "0.1"])
    got = json.loads((tmp_path / "g.json").read_text())
    assert rc == 1 and "tflops" not in got and got["error"]
