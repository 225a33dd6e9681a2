"""integration/soak.py against a fake OpenAI-compatible server on 127.0.0.1 (CPU, a few seconds).

The fake streams SSE in HTTP chunks like uvicorn, honours max_tokens, stop and ignore_eos, answers the
invalid kinds with 400 JSON like vLLM and SGLang do, and can misbehave on request: a 500 on some valid
requests, streams without [DONE], a 500 for malformed JSON. Run as a script (``--serve PORT``) it is
the server that the launch test starts in its own process group.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LEN = 256
GEN_WORDS = ("alpha", "beta.", "gamma", "the", "delta,", "sing", "epsilon", "zeta!", "eta", "theta")


def _load_soak():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "integration" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = mod
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------------------------
# The fake server
# ----------------------------------------------------------------------------------------------

class FakeOpenAI(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int = 0, fail_valid_every: int = 0, drop_done: bool = False,
                 malformed_500: bool = False, token_delay: float = 0.0005, sglang_limits: bool = False):
        super().__init__(("127.0.0.1", port), _Handler)
        self.fail_valid_every, self.drop_done, self.malformed_500 = fail_valid_every, drop_done, malformed_500
        # SGLang 0.5.17's length rules (soak.CONTEXT_RESERVE): prompts of context - 6 tokens or more are refused,
        # max_tokens is clipped to context - 2 - prompt; and /v1/models says owned_by "sglang"
        self.sglang_limits = sglang_limits
        self.token_delay = token_delay
        self.n_valid = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()


class _BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _generate(prompt_tokens: int, body: dict, max_tokens: int) -> tuple[list[str], str, int]:
    """Pieces of text, finish reason and completion tokens; deterministic in the request. An EOS token
    comes early unless ignore_eos; a stop string ends the text before it (the stop token counts)."""
    seed = prompt_tokens * 7 + max_tokens
    eos_at = None if body.get("ignore_eos") else 3 + seed % 40
    stops = body.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    pieces: list[str] = []
    for i in range(max_tokens):
        if i == eos_at:
            return pieces, "stop", i + 1
        pieces.append(" " + GEN_WORDS[(seed + i * 3) % len(GEN_WORDS)])
        text = "".join(pieces)
        cuts = [text.find(s) for s in stops if s in text]
        if cuts:
            kept, n = [], min(cuts)
            for p in pieces:
                if n > 0:
                    kept.append(p[:n])
                n -= len(p)
            return kept, "stop", i + 1
    return pieces, "length", max_tokens


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeOpenAI

    def log_message(self, *args):
        pass

    def _json(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": {"message": message, "type": "BadRequestError", "code": status}})

    def do_GET(self):
        if self.path == "/health":
            self._json(200, {})
        elif self.path == "/v1/models":
            owner = "sglang" if self.server.sglang_limits else "fake"
            self._json(200, {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": owner,
                                                         "max_model_len": MAX_LEN}]})
        else:
            self._error(404, "not found")

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        try:
            self._post(raw)
        except _BadRequest as e:
            self._error(e.status, str(e))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client closed mid-stream

    def _post(self, raw: bytes) -> None:
        chat = self.path == "/v1/chat/completions"
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            raise _BadRequest(404, "no such route")
        if self.headers.get("Content-Type", "").split(";")[0] != "application/json":
            raise _BadRequest(400, "Only 'application/json' is allowed")
        try:
            body = json.loads(raw)
        except ValueError:
            if self.server.malformed_500 and raw:
                raise _BadRequest(500, "Internal server error") from None
            raise _BadRequest(400, "malformed JSON") from None
        if not isinstance(body, dict):
            raise _BadRequest(400, "body is not an object")
        if body.get("model", "fake") != "fake":
            raise _BadRequest(404, f"The model `{body['model']}` does not exist.")
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not all(isinstance(m.get("content"), str) for m in msgs):
                raise _BadRequest(400, "messages: field required")
            prompt_tokens = sum(len(m["content"].split()) + 4 for m in msgs) + 2
            max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, str) and prompt:
                prompt_tokens = len(prompt.split())
            elif isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
                prompt_tokens = len(prompt)
            else:
                raise _BadRequest(400, "Either prompt or prompt_embeds must be provided and non-empty.")
            max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise _BadRequest(400, "max_tokens: Input should be a valid integer")
        temperature = body.get("temperature", 1.0)
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise _BadRequest(400, "temperature must be non-negative")
        if max_tokens < 1:
            raise _BadRequest(400, f"max_tokens must be at least 1, got {max_tokens}.")
        if prompt_tokens >= MAX_LEN or prompt_tokens + max_tokens > MAX_LEN:
            raise _BadRequest(400, f"This model's maximum context length is {MAX_LEN} tokens.")
        if self.server.sglang_limits:
            if prompt_tokens >= MAX_LEN - 6:
                raise _BadRequest(400, f"Input length ({prompt_tokens} tokens) exceeds the maximum allowed length "
                                       f"({MAX_LEN - 6} tokens).")
            max_tokens = min(max_tokens, MAX_LEN - 2 - prompt_tokens)
        with self.server.lock:
            self.server.n_valid += 1
            n = self.server.n_valid
        if self.server.fail_valid_every and n % self.server.fail_valid_every == 0:
            raise _BadRequest(500, "Internal server error")
        pieces, finish, tokens = _generate(prompt_tokens, body, max_tokens)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens}
        if not body.get("stream"):
            text = "".join(pieces)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                      if chat else {"index": 0, "text": text, "finish_reason": finish})
            return self._json(200, {"id": "x", "object": "chat.completion" if chat else "text_completion",
                                    "choices": [choice], "usage": usage})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def event(obj) -> None:
            data = ("data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n").encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def choice(piece, fin=None):
            return ({"index": 0, "delta": {"content": piece}, "finish_reason": fin} if chat
                    else {"index": 0, "text": piece, "finish_reason": fin})
        if chat:
            event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        for p in pieces:
            time.sleep(self.server.token_delay)
            event({"choices": [choice(p)]})
        event({"choices": [choice("", finish)]})
        if (body.get("stream_options") or {}).get("include_usage"):
            event({"choices": [], "usage": usage})
        if not self.server.drop_done:
            event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------

def _cfg(soak, **kw):
    base = dict(clients=8, requests=60, min_duration=0, seed=1, request_timeout=20, gpu="off",
                sample_interval=0.05, invalid_share=0.3, disconnect_share=0.1, long_tokens=64)
    base.update(kw)
    return soak.SoakConfig(**base)


def test_soak_passes_against_a_well_behaved_server(tmp_path):
    soak = _load_soak()
    with FakeOpenAI() as srv:
        rc = soak.main(["--url", srv.url, "--out", str(tmp_path), "--clients", "8", "--requests", "60",
                        "--min-duration", "0", "--seed", "1", "--invalid-share", "0.3", "--gpu", "off",
                        "--long-tokens", "64", "--sample-interval", "0.05"])
    res = json.loads((tmp_path / "soak.json").read_text())
    assert rc == 0, res["problems"]
    assert res["passed"] and res["load"]["requests"] >= 60
    assert res["valid"]["failed"] == 0 and res["valid"]["ok"] > 20
    assert res["invalid"]["sent"] >= len(soak.INVALID_KINDS)
    assert all(k["sent"] >= 1 and k["clean_4xx"] == k["sent"] for k in res["invalid"]["by_kind"].values())
    assert res["invalid"]["by_kind"]["malformed_json"]["statuses"] == {"400": res["invalid"]["by_kind"]
                                                                       ["malformed_json"]["sent"]}
    assert res["latency"]["ttft_ms"]["n"] > 0 and res["latency"]["itl_ms"]["n"] > 0
    assert res["load"]["output_tokens"] > 0
    assert res["server"]["chat"].startswith("on") and res["valid"]["classes"].get("chat", 0) > 0
    assert res["memory"] == {}  # --url without --server-pid and --gpu off: nothing sampled
    assert "PASS" in (tmp_path / "soak.md").read_text()
    lines = gzip.open(tmp_path / "requests.jsonl.gz", "rt").read().splitlines()
    assert len(lines) == res["load"]["requests"]


def test_the_plan_is_seeded_and_fills_the_context():
    soak = _load_soak()
    t = soak.Target("127.0.0.1", 1, "m", 512, "x", True, words={"completions": (1.3, 8.0), "chat": (1.3, 20.0)})

    def plan(seed, n=400):
        p = soak.Planner(_cfg(soak, seed=seed, invalid_share=0.1, long_tokens=1024), t)
        return [p.spec(i) for i in range(n)]
    a, b, c = plan(3), plan(3), plan(4)
    assert [s.payload() for s in a] == [s.payload() for s in b]
    assert [s.payload() for s in a] != [s.payload() for s in c]
    kinds = {s.kind for s in a}
    assert set(soak.INVALID_KINDS) <= kinds and set(soak.LENIENT_KINDS) <= kinds
    at_limit = [s for s in a if s.category == "valid" and s.kind.endswith("at-limit-ids")]
    assert at_limit and all(len(s.body["prompt"]) + s.max_tokens == 512 for s in at_limit)
    too_long = [s for s in a if s.kind == "prompt_too_long" and s.endpoint == "completions"]
    assert all(len(s.body["prompt"]) > 512 for s in too_long)
    assert {s.max_tokens for s in a if s.kind.startswith("completions/") and "out-one" in s.kind} == {1}
    # an engine that keeps tokens below its context (SGLang: CONTEXT_RESERVE) gets prompts that fit its limit
    assert soak.CONTEXT_RESERVE == {"sglang": 6}
    sg = soak.Target("127.0.0.1", 1, "m", 512, "sglang", True, words=t.words, reserve=6)
    p = soak.Planner(_cfg(soak, seed=3, invalid_share=0.1, long_tokens=1024), sg)
    sg_limit = [s for s in (p.spec(i) for i in range(400)) if s.category == "valid" and s.kind.endswith("at-limit-ids")]
    assert sg_limit and all(len(s.body["prompt"]) + s.max_tokens == 506 for s in sg_limit)
    # long outputs: --long-tokens 1024 capped at half the context
    assert any(s.body.get("ignore_eos") and s.max_tokens == 256 for s in a if s.category == "valid")
    assert any(s.stream for s in a) and any(not s.stream for s in a) and any(s.stop for s in a)


def test_an_engine_that_keeps_tokens_below_its_context_gets_prompts_it_serves(tmp_path):
    # SGLang refuses or shortens requests that fill the context exactly: the soak leaves CONTEXT_RESERVE free
    # (the engine's owned_by picks it); told to leave nothing, the same server fails those requests
    soak = _load_soak()
    args = ["--clients", "8", "--requests", "80", "--min-duration", "0", "--seed", "2", "--invalid-share", "0.1",
            "--gpu", "off", "--long-tokens", "64", "--sample-interval", "0.05"]
    with FakeOpenAI(sglang_limits=True) as srv:
        assert soak.main(["--url", srv.url, "--out", str(tmp_path / "auto"), *args]) == 0
        assert soak.main(["--url", srv.url, "--out", str(tmp_path / "none"), "--context-reserve", "0", *args]) == 1
    auto = json.loads((tmp_path / "auto" / "soak.json").read_text())
    assert auto["server"]["context_reserve"] == 6 and auto["valid"]["failed"] == 0
    assert "6 tokens of it kept free" in (tmp_path / "auto" / "soak.md").read_text()
    none = json.loads((tmp_path / "none" / "soak.json").read_text())
    assert none["valid"]["failed"] > 0
    with FakeOpenAI() as srv:   # a reserve that leaves no room for a prompt, or a negative one: refused up front
        for bad in ("-1", str(MAX_LEN // 2)):
            assert soak.main(["--url", srv.url, "--out", str(tmp_path / "bad"), "--context-reserve", bad, *args]) == 2
    assert "--context-reserve: expected" in json.loads((tmp_path / "bad" / "soak.json").read_text())["setup_error"]


def test_500_on_valid_requests_fails():
    soak = _load_soak()
    with FakeOpenAI(fail_valid_every=7) as srv:
        res, _ = soak.run_soak(srv.url, _cfg(soak))
    assert not res["passed"]
    assert res["valid"]["failures"].get("http_500", 0) > 0
    assert res["invalid"]["failed"] == 0


def test_stream_without_done_fails():
    soak = _load_soak()
    with FakeOpenAI(drop_done=True) as srv:
        res, _ = soak.run_soak(srv.url, _cfg(soak, disconnect_share=0))
    assert not res["passed"]
    assert set(res["valid"]["failures"]) == {"stream_missing_done"}


def test_500_for_malformed_json_fails():
    soak = _load_soak()
    with FakeOpenAI(malformed_500=True) as srv:
        res, _ = soak.run_soak(srv.url, _cfg(soak))
    assert not res["passed"]
    bad = res["invalid"]["by_kind"]["malformed_json"]
    assert bad["sent"] > 0 and bad["failures"] == {"invalid_got_500": bad["sent"]}
    assert res["valid"]["failed"] == 0
    assert all(k["failed"] == 0 for name, k in res["invalid"]["by_kind"].items() if name != "malformed_json")


def test_growing_memory_fails_and_flat_memory_passes():
    soak = _load_soak()
    t0 = time.monotonic()
    samplers = {"host_rss": ("injected", lambda: 1000 + 50 * (time.monotonic() - t0)),   # 3000 MiB/min
                "gpu_memory": ("injected", lambda: 40000.0)}
    with FakeOpenAI() as srv:
        res, _ = soak.run_soak(srv.url, _cfg(soak, min_duration=1.0), samplers=samplers)
    rss, gpu = res["memory"]["host_rss"], res["memory"]["gpu_memory"]
    assert rss["flat"] is False and rss["slope_mib_per_min"] > 1000
    assert gpu["flat"] is True and gpu["slope_mib_per_min"] == 0
    assert gpu["start_mib"] == gpu["end_mib"] == 40000.0
    assert not res["passed"] and any("host_rss not flat" in p for p in res["problems"])


LEAKER = """
import subprocess, sys, time
if sys.argv[1] == "parent":  # the leak is in a child: the sampler must walk the process tree
    p = subprocess.Popen([sys.executable, __file__, "child"]); p.wait()
else:
    hoard = []
    while True:
        hoard.append(b"x" * (4 << 20)); time.sleep(0.03)
"""


def test_server_pid_rss_of_a_leaking_process_tree(tmp_path):
    soak = _load_soak()
    script = tmp_path / "leak.py"
    script.write_text(LEAKER)
    parent = subprocess.Popen([sys.executable, str(script), "parent"])
    try:
        time.sleep(0.3)
        assert len(soak.process_tree(parent.pid)) == 2
        with FakeOpenAI() as srv:
            res, _ = soak.run_soak(srv.url, _cfg(soak, min_duration=1.0), server_pid=parent.pid)
    finally:
        for pid in reversed(soak.process_tree(parent.pid)):
            os.kill(pid, 9)
        parent.wait()
    rss = res["memory"]["host_rss"]
    assert rss["end_mib"] > rss["start_mib"] + 50 and rss["flat"] is False
    assert res["valid"]["failed"] == 0 and not res["passed"]
    # each process of the tree is shown on its own: the child holds the growth, the parent does not; only
    # the tree's sum is judged
    procs = {k: v for k, v in res["memory"].items() if k.startswith(soak.PER_PROCESS)}
    assert len(procs) == 2 and all(v["source"].startswith("VmRSS of process ") for v in procs.values())
    grew = sorted(procs.values(), key=lambda v: v["end_mib"] - v["start_mib"])
    assert grew[0]["flat"] is True and grew[1]["flat"] is False
    assert [p for p in res["problems"] if "not flat" in p] == [
        f"host_rss not flat: {rss['slope_mib_per_min']} MiB/min over the second half (threshold 5.0)"]
    assert "one process, not judged" in soak.markdown(res)


def test_launch_waits_for_health_and_stops_the_process_group(tmp_path):
    soak = _load_soak()
    with FakeOpenAI() as probe:  # a free port, released before the child binds it
        port = probe.server_address[1]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", str(port)]
    res, records = soak.run_launched(cmd, f"http://127.0.0.1:{port}", _cfg(soak), tmp_path / "server.log",
                                     startup_timeout=30, poll=0.1)
    assert res["passed"], res["problems"]
    assert res["server"]["exit_code"] is not None       # stopped
    assert res["memory"]["host_rss"]["samples"] > 0      # the launched server's tree was sampled
    assert len(records) == res["load"]["requests"]


def test_slope_and_percentiles():
    soak = _load_soak()
    assert soak.slope_per_min([(0, 10.0), (30, 11.0), (60, 12.0)]) == 2.0
    assert soak.slope_per_min([(5, 1.0)]) is None
    p = soak.percentiles([1, 2, 3, 4, 5], scale=1e3)
    assert p["p50"] == 3000 and p["max"] == 5000 and p["n"] == 5
    j = soak.judge_memory([(float(t), 100.0 + t / 60) for t in range(0, 120, 2)], 0, 120, max_slope=5)
    assert j["flat"] is True and abs(j["slope_mib_per_min"] - 1.0) < 1e-6
    short = soak.judge_memory([(0.0, 1.0), (1.0, 2.0)], 0, 1, max_slope=5)
    assert short["flat"] is None


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    srv = FakeOpenAI(port=int(sys.argv[2]))
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        srv.server_close()


def test_gpu_memory_of_the_visible_gpus_only(monkeypatch):
    # a soak on GPU 0 while another job runs on GPU 1: nvidia-smi is asked for GPU 0 only
    soak = _load_soak()
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return soak.subprocess.CompletedProcess(cmd, 0, stdout="100\n" if "--id=0" in cmd else "100\n900\n")

    monkeypatch.setattr(soak.subprocess, "run", fake_run)
    monkeypatch.setattr(soak.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    cfg = soak.SoakConfig()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    source, sample = soak.default_samplers(cfg, None)["gpu_memory"]
    assert source == "nvidia-smi memory.used, GPUs 0" and sample() == 100.0 and "--id=0" in calls[-1]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    source, sample = soak.default_samplers(cfg, None)["gpu_memory"]
    assert source == "nvidia-smi memory.used, all GPUs" and sample() == 1000.0
    assert not any(a.startswith("--id") for a in calls[-1])
    # ids nvidia-smi does not take (a MIG device, a UUID prefix): every GPU, and the source says why
    def picky_run(cmd, **kw):
        calls.append(cmd)
        bad = any(a.startswith("--id=MIG") for a in cmd)
        return soak.subprocess.CompletedProcess(cmd, 6 if bad else 0, stdout="" if bad else "100\n900\n")

    monkeypatch.setattr(soak.subprocess, "run", picky_run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1234")
    source, sample = soak.default_samplers(cfg, None)["gpu_memory"]
    assert source == "nvidia-smi memory.used, all GPUs (it did not take --id=MIG-1234)" and sample() == 1000.0


def test_prompt_token_ids_are_plain_text_entries_of_the_tokenizer(tmp_path):
    soak = _load_soak()
    # byte-level BPE: "\u0120the" is " the"; lone bytes of multi-byte characters, byte fallback and added
    # tokens are left out, and so are ids outside [16, hi)
    vocab = {"!": 3, "a": 16, "\u0120the": 17, "\u010a": 18, "\u00e2": 19, "<0xE2>": 20, "<|im_end|>": 21, "ok": 22,
             "x\u0109": 23, "far": 5000}
    (tmp_path / "tokenizer.json").write_text(json.dumps(
        {"model": {"type": "BPE", "vocab": vocab}, "added_tokens": [{"id": 21, "content": "<|im_end|>"}]}))
    assert soak.prompt_token_ids(tmp_path, 2000) == (16, 17, 18, 22)
    # unigram (SentencePiece): [[piece, score], ...] in id order, "\u2581" is its space
    pieces = [[f"<r{i}>", 0.0] for i in range(16)] + [["\u2581hello", -1.0], ["\u00e9", -2.0], ["ab", -3.0]]
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Unigram", "vocab": pieces}}))
    assert soak.prompt_token_ids(tmp_path, 2000) == (16, 18)
    assert soak.prompt_token_ids(tmp_path / "missing", 2000) is None
    # the plan draws its token-id prompts from them, and soak.json records their number, not the list
    cfg = _cfg(soak, token_ids=(16, 18))
    words = {"completions": (1.3, 8.0), "chat": (1.3, 20.0)}
    plan = soak.Planner(cfg, soak.Target("127.0.0.1", 1, "m", 512, "x", True, words=words))
    ids = {t for i in range(400) for sp in [plan.spec(i)] if sp.body and isinstance(sp.body.get("prompt"), list)
           for t in sp.body["prompt"]}
    assert ids == {16, 18}
    assert soak.config_record(cfg)["token_ids"] == "2 plain-text ids of the tokenizer below 2000"


def test_more_text_than_tokens_can_carry_fails():
    # vLLM 0.26 + tokenizers 0.22 on broken-UTF-8 prompts: one token, the prompt's text as its output
    soak = _load_soak()
    spec = soak.Spec(index=0, category="valid", kind="k", endpoint="completions", body={}, max_tokens=14)
    rec = soak.Record(index=0, category="valid", kind="k", endpoint="completions", stream=True, max_tokens=14)
    soak._check_output(spec, rec, "x" * 765, "stop", {"completion_tokens": 1}, 1)
    assert not rec.ok and rec.reason == "text_longer_than_tokens" and rec.detail.startswith("765 characters for 1")
    rec = soak.Record(index=0, category="valid", kind="k", endpoint="completions", stream=True, max_tokens=14)
    soak._check_output(spec, rec, "x" * 140, "stop", {"completion_tokens": 1}, 1)
    assert rec.ok
    # without usage the count is the stream's chunks, and an engine may merge tokens into one chunk: not judged
    rec = soak.Record(index=0, category="valid", kind="k", endpoint="completions", stream=True, max_tokens=14)
    soak._check_output(spec, rec, "x" * 765, "stop", None, 1)
    assert rec.ok


def test_a_memory_series_without_samples_is_a_problem():
    # a sampler that never answers (nvidia-smi failing) must not pass the soak as "not judged"
    soak = _load_soak()
    samplers = {"gpu_memory": ("injected, failing", lambda: None), "host_rss": ("injected", lambda: 100.0)}
    with FakeOpenAI() as srv:
        res, _ = soak.run_soak(srv.url, _cfg(soak, min_duration=1.0), samplers=samplers)
    assert "gpu_memory: no samples (injected, failing)" in res["problems"] and not res["passed"]
    assert res["memory"]["host_rss"]["flat"] is True
