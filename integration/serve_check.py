#!/usr/bin/env python3
"""Start an engine server on a checkpoint, wait for health, send OpenAI requests, shut it down.

    python integration/serve_check.py --engine vllm --model DIR [--quantization nvfp4] --out result.json
    python integration/serve_check.py --engine sglang --model DIR --quantization nvfp4 --out result.json
    python integration/serve_check.py --engine vllm --model BAD_DIR --quantization nvfp4 --expect-fail "weight_scale"

Records in the JSON: the completion and chat answers (greedy), per-token prompt logprobs of a fixed
prompt, decode tokens/s of a timed batch-1 request, whether the server log names our method and
backend, and the exit status. Standard library only, so it runs with any engine's Python.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Say hello in three words."}]
LOGPROB_PROMPT = "One, two, three, four, five, six, seven, eight, nine, ten"


def server_command(engine: str, model: str, port: int, quantization: str | None, extra: list[str],
                   mem_fraction: float = 0.5, max_len: int = 1024) -> list[str]:
    """The engine's OpenAI server on ``port``, serving ``model`` as "m" with contexts of ``max_len`` tokens."""
    py = sys.executable
    if engine == "vllm":
        cmd = [py, "-m", "vllm.entrypoints.cli.main", "serve", model, "--port", str(port), "--host", "127.0.0.1",
               "--max-model-len", str(max_len), "--gpu-memory-utilization", str(mem_fraction),
               "--served-model-name", "m"]
        if quantization:
            cmd += ["--quantization", quantization]
    else:
        cmd = [py, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port), "--host", "127.0.0.1",
               "--attention-backend", "triton", "--sampling-backend", "pytorch", "--mem-fraction-static", str(mem_fraction),
               "--served-model-name", "m", "--context-length", str(max_len)]
        if quantization:
            cmd += ["--quantization", quantization]
    return cmd + extra


def post(port: int, path: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def prompt_logprobs(engine: str, port: int) -> list[float]:
    if engine == "vllm":
        r = post(port, "/v1/completions", {"model": "m", "prompt": LOGPROB_PROMPT, "max_tokens": 1, "temperature": 0,
                                            "prompt_logprobs": 0})
        # prompt_logprobs=0: each position's dict holds just the prompt token (the first is None)
        return [next(iter(e.values()))["logprob"] for e in r["choices"][0]["prompt_logprobs"][1:]]
    r = post(port, "/generate", {"text": LOGPROB_PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                                 "return_logprob": True, "logprob_start_len": 0})
    return [t[0] for t in r["meta_info"]["input_token_logprobs"][1:]]


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group (a clean engine shutdown), SIGKILL after 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run(args) -> dict:
    env = dict(os.environ)
    log_path = args.log or f"/tmp/{args.engine}_server_{args.port}.log"
    cmd = server_command(args.engine, args.model, args.port, args.quantization, args.extra, args.mem_fraction)
    result = {"engine": args.engine, "model": args.model, "quantization": args.quantization, "cmd": cmd}
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while not healthy(args.port):
                if proc.poll() is not None:
                    break
                if time.time() - t0 > args.timeout:
                    result["error"] = f"not healthy after {args.timeout} s"
                    break
                time.sleep(2)
            result["startup_s"] = round(time.time() - t0, 1)
            if proc.poll() is None and "error" not in result:
                result["completion"] = post(args.port, "/v1/completions", {
                    "model": "m", "prompt": PROMPT, "max_tokens": 16, "temperature": 0})["choices"][0]["text"]
                result["chat"] = post(args.port, "/v1/chat/completions", {
                    "model": "m", "messages": CHAT, "max_tokens": 16, "temperature": 0})["choices"][0]["message"]["content"]
                result["prompt_logprobs"] = prompt_logprobs(args.engine, args.port)
                post(args.port, "/v1/completions", {"model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
                t1 = time.time()
                r = post(args.port, "/v1/completions", {"model": "m", "prompt": PROMPT, "max_tokens": args.decode_tokens,
                                                         "temperature": 0, "ignore_eos": True})
                dt = time.time() - t1
                result["decode_tokens"] = r["usage"]["completion_tokens"]
                result["decode_text"] = r["choices"][0]["text"]
                result["batch1_tok_per_s"] = round(result["decode_tokens"] / dt, 1)
        finally:
            stop_server(proc)
    result["exit_code"] = proc.returncode
    text = open(log_path, errors="replace").read()
    result["log_tail"] = text[-4000:]
    if args.expect_fail is not None:
        result["log_has_expected_text"] = args.expect_fail in text
    result["log_names_nvfp4_plugin"] = "nvfp4_plugin" in text
    result["log_backend_lines"] = [ln[-300:] for ln in text.splitlines() if "nvfp4_plugin:" in ln][:10]
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--timeout", type=float, default=420)
    ap.add_argument("--mem-fraction", type=float, default=0.5,
                    help="GPU memory share of the server (vLLM --gpu-memory-utilization, SGLang --mem-fraction-static);"
                         " lower it to run two servers side by side")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    ap.add_argument("--log", default=None)
    ap.add_argument("--expect-fail", default=None, metavar="TEXT",
                    help="the server must exit non-zero before becoming healthy, with TEXT in its log")
    ap.add_argument("extra", nargs="*", help="extra server arguments (after --)")
    args = ap.parse_args()
    res = run(args)
    ok = "error" not in res and res.get("exit_code") is not None
    if args.expect_fail is not None:
        ok = "completion" not in res and res["exit_code"] not in (0, None) and res["log_has_expected_text"]
        res["expected_failure_seen"] = ok
    else:
        ok = "completion" in res and (not args.quantization or args.quantization != "nvfp4" or res["log_names_nvfp4_plugin"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    summary = {k: v for k, v in res.items() if k not in ("log_tail", "cmd", "prompt_logprobs")}
    print(json.dumps(summary, indent=1))
    if not ok:
        print(res["log_tail"][-2500:])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
