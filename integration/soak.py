#!/usr/bin/env python3
"""Serving soak: concurrent clients send a seeded mix of OpenAI requests; failures, latency and memory.

    python integration/soak.py --launch vllm --model DIR --out DIR [options] [-- extra engine args]
    python integration/soak.py --launch sglang --model DIR --out DIR [options] [-- extra engine args]
    python integration/soak.py --url http://127.0.0.1:8000 [--server-pid PID] --out DIR [options]

--launch starts the engine like serve_check.py does (served name "m", `--quantization nvfp4` unless
--quantization says otherwise), waits for /health, and stops the whole process group at the end.
--url soaks a server that is already running (host RSS is then sampled only with --server-pid).

The load: --clients concurrent clients (default 64) send at least --requests requests (default 2000)
and keep going until --min-duration seconds have passed. The mix is drawn from --seed, so the same
seed against the same server sends the same requests: completions and chat, streaming and not,
prompts from a few tokens up to the context limit (token-id prompts fill it exactly, less the tokens the
engine keeps free, CONTEXT_RESERVE or --context-reserve; with --model their
ids are plain-text entries of its tokenizer.json, see PROMPT_TOKEN_CHARS), 1-token, short,
medium and long outputs (long ones with ignore_eos), stop strings, clients that close the connection
after a few stream chunks, and invalid requests that must get a clean 4xx JSON error.

A valid request fails on: a non-200 status, a dropped connection, a timeout, a body or stream that
does not parse, an error event inside a stream, a stream without `data: [DONE]`, a missing finish
reason, more tokens than max_tokens, finish_reason "length" with a token count other than
max_tokens, ignore_eos without a stop string ending before max_tokens, no text at all after >= 8
tokens with no stop hit, more than 128 characters per generated token (text the engine did not
generate), or a requested stop string inside the output.

Memory: GPU memory (nvidia-smi, the GPUs of CUDA_VISIBLE_DEVICES or all, summed) and the host RSS of
the server's process tree (/proc/PID/status VmRSS, the launched server or --server-pid; each process
of the tree is also shown on its own, not judged) are sampled every --sample-interval
seconds; the least-squares slope over the second half of the load (the first half is warm-up) must
be under --max-slope MiB/min. Why 5 MiB/min: over the second half of a 3-minute run one 2 MiB
allocator block appearing mid-window reads as ~2 MiB/min and host RSS jitter of a few MiB as ~1,
so a lower bar fails healthy servers; a per-request leak of 2 KiB at 50 requests/s reads as
~6 MiB/min, and 5 MiB/min is 7 GiB a day, enough to matter for a server.

Writes soak.json, soak.md and requests.jsonl.gz (one line per request) to --out. Exit status: 0 when
every valid request succeeded, every invalid one got a clean 4xx, memory was flat and the server was
healthy afterwards; 1 otherwise; 2 when the soak could not run (server not healthy, no context length).
Standard library only (asyncio streams for the load), so it runs with any engine's Python.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import gzip
import json
import math
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# Share of each request category; valid requests take the rest.
INVALID_SHARE = 0.08
LENIENT_SHARE = 0.03
DISCONNECT_SHARE = 0.05
CHAT_SHARE = 0.35
STREAM_SHARE = 0.5
STOP_SHARE = 0.25
GREEDY_SHARE = 0.6
# (name, weight): max_tokens 1, 2-32, 33-256, --long-tokens (with ignore_eos).
OUTPUT_CLASSES = (("one", 0.20), ("short", 0.40), ("medium", 0.25), ("long", 0.15))
# (name, weight): 1-16, 17-256, 257 up to the limit, exactly the limit (context - max_tokens).
PROMPT_CLASSES = (("tiny", 0.25), ("short", 0.35), ("long", 0.25), ("at-limit", 0.15))
STOP_STRINGS = (".", "\n", ",", " the", "ing", "!")
# Token ids below this are left out of token-id prompts: tokenizers put their special tokens first.
MIN_TOKEN_ID = 16
# Characters a vocabulary entry may hold to be drawn into token-id prompts (with --model): printable
# ASCII, plus the byte-level BPE markers of space and newline and SentencePiece's space. Random ids of
# byte tokens make prompts of broken UTF-8, after which vLLM 0.26's detokenizer (tokenizers 0.22
# DecodeStream primed with the whole prompt) hands back the prompt's text as the first output delta
# for ~6% of such prompts (SmolLM2's vocabulary, ids 16-2000; reproduced on the CPU without an engine):
# an engine bug that says nothing about the quantization under test.
PROMPT_TOKEN_CHARS = frozenset(chr(c) for c in range(0x20, 0x7F)) | {"\u0120", "\u010a", "\u2581"}
# More output characters than this per generated token (+16) is text the engine did not generate.
MAX_CHARS_PER_TOKEN = 128
# No text at all after this many generated tokens is an empty output (fewer may all be special
# tokens or pieces of one UTF-8 character, which detokenize to nothing).
EMPTY_MIN_TOKENS = 8

# Invalid kinds, sent round-robin. Both engines answer each with 400 (vLLM 0.26 and SGLang 0.5.17
# sources: FastAPI validation errors become 400 in both; SamplingParams' checks raise ValueError,
# which both turn into 400; both check the length before a stream starts).
INVALID_KINDS = (
    "malformed_json",           # the body is cut in the middle of the JSON
    "empty_body",               # no body at all
    "wrong_content_type",       # valid JSON sent as text/plain
    "missing_prompt",           # no prompt (completions) / no messages (chat)
    "wrong_type",               # max_tokens is a string
    "negative_max_tokens",
    "max_tokens_over_context",  # max_tokens alone exceeds the context
    "prompt_too_long",          # more prompt tokens than the context
    "negative_temperature",
)
# Kinds an engine may accept or refuse. vLLM and SGLang both accept a missing model (they use the
# served one) and ignore unknown fields (vLLM logs them); vLLM answers an unknown model name with
# 404, SGLang serves it. Accepted ones are checked like valid requests; a refusal must be a clean 4xx.
LENIENT_KINDS = ("missing_model", "unknown_model", "unknown_field")

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no what up out who them some "
    "could him into its then two more time only new may way about over such after first these our very "
    "water light river stone music garden window morning number people country history system market "
    "simple quick silver yellow quiet gentle bright little strong sudden early later never always often "
    "again before under above between among around along across because while until since although"
).split()


# ----------------------------------------------------------------------------------------------
# Configuration and the server under test
# ----------------------------------------------------------------------------------------------

#: Tokens below the context length an engine keeps out of a request's prompt + max_tokens. SGLang 0.5.17
#: (tp_worker.get_worker_info, scheduler): max_req_len = context - 1 and a prompt must be shorter than
#: max_req_len - 5 (400 "Input length ... exceeds the maximum allowed length (context - 6 tokens)"), and it
#: clips max_new_tokens to max_req_len - prompt - 1 (finish_reason "length" two tokens early). vLLM 0.26 serves
#: prompt + max_tokens == max_model_len as asked. Keyed by the owned_by of /v1/models.
CONTEXT_RESERVE = {"sglang": 6}


@dataclass
class SoakConfig:
    clients: int = 64
    requests: int = 2000
    min_duration: float = 180.0
    seed: int = 0
    long_tokens: int = 1024
    request_timeout: float = 600.0
    max_token_id: int = 2000
    token_ids: tuple[int, ...] | None = None   # ids token-id prompts draw from (default: the range)
    chat: str = "auto"                  # auto (probe the endpoint) | on | off
    model_name: str | None = None       # default: the first id of /v1/models
    max_model_len: int | None = None    # used when /v1/models does not report max_model_len
    context_reserve: int | None = None  # tokens kept free below the context (default: CONTEXT_RESERVE[engine])
    sample_interval: float = 2.0
    max_slope: float = 5.0              # MiB/min, GPU memory and host RSS alike
    gpu: str = "auto"                   # auto (when nvidia-smi exists) | off
    invalid_share: float = INVALID_SHARE
    disconnect_share: float = DISCONNECT_SHARE
    progress_interval: float = 10.0


@dataclass
class Target:
    """What the preflight learned about the server; the planner builds requests from it."""
    host: str
    port: int
    model: str
    max_len: int
    engine: str                          # owned_by of /v1/models: vllm, sglang, or whatever it says
    chat: bool
    chat_note: str = ""
    reserve: int = 0                     # tokens the engine keeps out of prompt + max_tokens (CONTEXT_RESERVE)
    # endpoint -> (prompt tokens per word, template/BOS overhead), both upper estimates
    words: dict = field(default_factory=dict)

    def words_for(self, endpoint: str, tokens: int) -> int:
        """How many words make a text prompt of at most `tokens` tokens (at least one word)."""
        per_word, overhead = self.words.get(endpoint, (4.0, 64.0))
        return max(1, int((tokens - overhead) / per_word))


# ----------------------------------------------------------------------------------------------
# The request plan
# ----------------------------------------------------------------------------------------------

@dataclass
class Spec:
    index: int
    category: str                 # valid | disconnect | lenient | invalid
    kind: str
    endpoint: str                 # completions | chat
    body: dict | None
    raw: bytes | None = None      # sent instead of json.dumps(body) (malformed and empty bodies)
    content_type: str = "application/json"
    stream: bool = False
    max_tokens: int = 0
    stop: tuple = ()
    ignore_eos: bool = False
    close_after: int = 0          # disconnect: stream events read before the client closes

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def payload(self) -> bytes:
        return self.raw if self.raw is not None else json.dumps(self.body).encode()


def _weighted(rng: random.Random, table) -> str:
    x = rng.random() * sum(w for _, w in table)
    for name, w in table:
        x -= w
        if x < 0:
            return name
    return table[-1][0]


class Planner:
    """Deterministic request specs: spec(i) for i = 0, 1, 2, ... depends only on the seed and target."""

    def __init__(self, cfg: SoakConfig, target: Target):
        self.cfg, self.t = cfg, target
        self.rng = random.Random(cfg.seed)
        self.n_invalid = 0
        self.n_lenient = 0

    def spec(self, index: int) -> Spec:
        r = self.rng.random()
        c = self.cfg
        if r < c.invalid_share:
            kind = INVALID_KINDS[self.n_invalid % len(INVALID_KINDS)]
            self.n_invalid += 1
            return self._invalid(index, kind)
        if r < c.invalid_share + LENIENT_SHARE:
            kind = LENIENT_KINDS[self.n_lenient % len(LENIENT_KINDS)]
            self.n_lenient += 1
            return self._lenient(index, kind)
        if r < c.invalid_share + LENIENT_SHARE + c.disconnect_share:
            s = self._valid(index, stream=True, out_class=self.rng.choice(("medium", "long")))
            s.category, s.close_after = "disconnect", self.rng.randint(2, 5)
            s.kind = "disconnect/" + s.kind
            return s
        return self._valid(index)

    # -- pieces --------------------------------------------------------------------------------
    def _text(self, n_words: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n_words))

    def _token_ids(self, n: int) -> list[int]:
        if self.cfg.token_ids:
            return [self.rng.choice(self.cfg.token_ids) for _ in range(n)]
        hi = max(MIN_TOKEN_ID + 1, self.cfg.max_token_id)
        return [self.rng.randrange(MIN_TOKEN_ID, hi) for _ in range(n)]

    def _endpoint(self) -> str:
        return "chat" if self.t.chat and self.rng.random() < CHAT_SHARE else "completions"

    def _body(self, endpoint: str, prompt, max_tokens: int, stream: bool, temperature: float) -> dict:
        body = {"model": self.t.model}
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
            body["max_completion_tokens"] = max_tokens
        else:
            body["prompt"] = prompt
            body["max_tokens"] = max_tokens
        body["temperature"] = temperature
        body["stream"] = stream
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def _valid(self, index: int, stream: bool | None = None, out_class: str | None = None) -> Spec:
        rng, t = self.rng, self.t
        endpoint = self._endpoint()
        stream = rng.random() < STREAM_SHARE if stream is None else stream
        out_class = out_class or _weighted(rng, OUTPUT_CLASSES)
        max_tokens = {"one": 1, "short": rng.randint(2, 32), "medium": rng.randint(33, 256),
                      "long": self.cfg.long_tokens}[out_class]
        max_tokens = max(1, min(max_tokens, t.max_len // 2))  # leaves half the context for the prompt
        ignore_eos = out_class == "long"
        stop = ()
        if not ignore_eos and out_class != "one" and rng.random() < STOP_SHARE:
            stop = tuple(rng.sample(STOP_STRINGS, rng.randint(1, 2)))
        prompt_class = _weighted(rng, PROMPT_CLASSES)
        budget = t.max_len - t.reserve - max_tokens  # the longest prompt the engine serves in full
        lo, hi = {"tiny": (1, 16), "short": (17, 256), "long": (257, budget),
                  "at-limit": (budget, budget)}[prompt_class]
        hi = min(hi, budget)
        n_tokens = rng.randint(min(lo, hi), hi)
        if endpoint == "completions" and (prompt_class == "at-limit" or rng.random() < 0.5):
            prompt, form = self._token_ids(n_tokens), "ids"
        else:
            prompt, form = self._text(t.words_for(endpoint, n_tokens)), "text"
        temperature = 0.0 if rng.random() < GREEDY_SHARE else 1.0
        body = self._body(endpoint, prompt, max_tokens, stream, temperature)
        if stop:
            body["stop"] = list(stop)
        if ignore_eos:
            body["ignore_eos"] = True
        kind = f"{endpoint}/{'stream' if stream else 'plain'}/out-{out_class}/prompt-{prompt_class}-{form}"
        return Spec(index, "valid", kind, endpoint, body, stream=stream, max_tokens=max_tokens, stop=stop,
                    ignore_eos=ignore_eos)

    def _lenient(self, index: int, kind: str) -> Spec:
        s = self._valid(index, out_class=self.rng.choice(("one", "short")))
        if kind == "missing_model":
            del s.body["model"]
        elif kind == "unknown_model":
            s.body["model"] = "soak-no-such-model"
        else:
            s.body["soak_unknown_field"] = {"x": 1}
        s.category, s.kind = "lenient", kind
        return s

    def _invalid(self, index: int, kind: str) -> Spec:
        rng, t = self.rng, self.t
        endpoint = self._endpoint()
        stream = rng.random() < STREAM_SHARE
        max_tokens = rng.randint(1, 16)
        prompt = self._text(rng.randint(1, 8)) if endpoint == "chat" or rng.random() < 0.5 else self._token_ids(8)
        body = self._body(endpoint, prompt, max_tokens, stream, 0.0)
        spec = Spec(index, "invalid", kind, endpoint, body, stream=stream, max_tokens=max_tokens)
        limit_key = "max_completion_tokens" if endpoint == "chat" else "max_tokens"
        if kind == "malformed_json":
            text = json.dumps(body)
            spec.raw = text[: rng.randint(1, len(text) - 1)].encode()
        elif kind == "empty_body":
            spec.raw = b""
        elif kind == "wrong_content_type":
            spec.content_type = "text/plain"
        elif kind == "missing_prompt":
            del body["messages" if endpoint == "chat" else "prompt"]
        elif kind == "wrong_type":
            body[limit_key] = "sixteen"
        elif kind == "negative_max_tokens":
            body[limit_key] = -rng.randint(1, 100)
        elif kind == "max_tokens_over_context":
            body[limit_key] = t.max_len + rng.randint(1, 100)
        elif kind == "prompt_too_long":
            over = t.max_len + rng.randint(1, 64)
            if endpoint == "chat":  # every space-separated word is at least one token
                body["messages"][0]["content"] = self._text(over)
            else:
                body["prompt"] = self._token_ids(over)
        elif kind == "negative_temperature":
            body["temperature"] = -1.0
        else:
            raise ValueError(f"invalid kind: expected one of {INVALID_KINDS}, got {kind!r}")
        return spec


# ----------------------------------------------------------------------------------------------
# HTTP/1.1 over asyncio streams (one connection per request)
# ----------------------------------------------------------------------------------------------

class ProtocolError(Exception):
    """The server's bytes are not HTTP/1.1 as expected."""


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict]:
    line = await reader.readline()
    if not line:
        raise asyncio.IncompleteReadError(b"", None)
    parts = line.decode("latin-1").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ProtocolError(f"bad status line {line[:80]!r}")
    headers = {}
    while True:
        h = await reader.readline()
        if not h:
            raise asyncio.IncompleteReadError(b"", None)
        if h in (b"\r\n", b"\n"):
            return int(parts[1]), headers
        k, _, v = h.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()


async def _iter_body(reader: asyncio.StreamReader, headers: dict):
    """The body's bytes as they arrive: chunked, Content-Length or up to EOF."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            line = await reader.readline()
            if not line:
                raise asyncio.IncompleteReadError(b"", None)
            try:
                size = int(line.split(b";")[0].strip(), 16)
            except ValueError:
                raise ProtocolError(f"bad chunk size line {line[:40]!r}") from None
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    elif "content-length" in headers:
        n = int(headers["content-length"])
        if n:
            yield await reader.readexactly(n)
    else:
        while data := await reader.read(65536):
            yield data


async def _read_all(chunks) -> bytes:
    return b"".join([c async for c in chunks])


def _is_clean_error(body: bytes) -> bool:
    """A JSON object naming the error: vLLM {"error": {...}}, SGLang {"object": "error", "message": ...},
    FastAPI {"detail": ...}."""
    try:
        obj = json.loads(body)
    except ValueError:
        return False
    return isinstance(obj, dict) and any(k in obj for k in ("error", "message", "detail"))


# ----------------------------------------------------------------------------------------------
# One request and its checks
# ----------------------------------------------------------------------------------------------

@dataclass
class Record:
    index: int
    category: str
    kind: str
    endpoint: str
    stream: bool
    max_tokens: int
    status: int | None = None
    ok: bool = True
    reason: str = ""
    detail: str = ""
    outcome: str = ""             # completed | disconnected | refused_4xx | clean_4xx | failed
    latency_s: float | None = None
    ttft_s: float | None = None
    itls: list = field(default_factory=list)
    tokens: int | None = None
    text_chars: int = 0
    finish_reason: str | None = None

    def fail(self, reason: str, detail: str = "") -> None:
        if self.ok:  # the first reason is the one reported
            self.ok, self.reason, self.detail, self.outcome = False, reason, detail[:300], "failed"


def _check_output(spec: Spec, rec: Record, text: str, finish, usage, pieces: int | None) -> None:
    rec.finish_reason, rec.text_chars = finish, len(text)
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    rec.tokens = tokens if isinstance(tokens, int) else pieces
    if finish not in ("stop", "length"):
        rec.fail("no_finish_reason" if finish is None else "bad_finish_reason", f"finish_reason={finish!r}")
    if isinstance(tokens, int):
        if tokens > spec.max_tokens:
            rec.fail("too_many_tokens", f"{tokens} tokens for max_tokens={spec.max_tokens}")
        elif finish == "length" and tokens != spec.max_tokens:
            rec.fail("length_mismatch", f"finish_reason length after {tokens} of {spec.max_tokens} tokens")
    if spec.ignore_eos and not spec.stop and finish == "stop":
        rec.fail("stopped_before_max_tokens", f"ignore_eos, no stop string, {tokens} of {spec.max_tokens} tokens")
    if text == "" and finish == "length" and spec.max_tokens >= EMPTY_MIN_TOKENS:
        rec.fail("empty_output", f"no text after {spec.max_tokens} tokens")
    if isinstance(tokens, int) and len(text) > MAX_CHARS_PER_TOKEN * tokens + 16:   # usage's count only
        rec.fail("text_longer_than_tokens", f"{len(text)} characters for {tokens} tokens: {text[:80]!r}")
    hit = [s for s in spec.stop if s in text]
    if hit:
        rec.fail("stop_string_in_output", f"stop {hit!r} in {text[-80:]!r}")
    if rec.ok:
        rec.outcome = "completed"


def _check_plain(spec: Spec, rec: Record, body: bytes) -> None:
    try:
        obj = json.loads(body)
    except ValueError:
        return rec.fail("bad_json_body", body[:200].decode("utf-8", "replace"))
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return rec.fail("bad_response_shape", body[:200].decode("utf-8", "replace"))
    c = choices[0]
    text = c.get("text") if spec.endpoint == "completions" else (c.get("message") or {}).get("content")
    if text is None and spec.endpoint == "chat":
        text = ""
    if not isinstance(text, str):
        return rec.fail("bad_response_shape", f"text is {type(text).__name__}")
    _check_output(spec, rec, text, c.get("finish_reason"), obj.get("usage"), None)


def _sse_data(event: bytes) -> str | None:
    data = [ln[5:].removeprefix(" ") for ln in event.decode("utf-8").split("\n") if ln.startswith("data:")]
    return "\n".join(data) if data else None


async def _check_stream(spec: Spec, rec: Record, headers: dict, chunks, t0: float) -> None:
    if not headers.get("content-type", "").startswith("text/event-stream"):
        return rec.fail("stream_wrong_content_type", headers.get("content-type", ""))
    buf, done, events, pieces, finish, usage, last = b"", False, 0, [], None, None, None
    finished_reading = False
    while True:
        if not finished_reading:
            try:
                data = await chunks.__anext__()
                buf = (buf + data).replace(b"\r\n", b"\n")
            except StopAsyncIteration:
                finished_reading = True
        if b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
        elif finished_reading and buf.strip():
            event, buf = buf, b""   # a last event without its blank line
        elif finished_reading:
            break
        else:
            continue
        try:
            payload = _sse_data(event)
        except UnicodeDecodeError:
            return rec.fail("stream_malformed_chunk", repr(event[:200]))
        if payload is None:
            continue
        if payload.strip() == "[DONE]":
            done = True
            continue
        try:
            obj = json.loads(payload)
        except ValueError:
            return rec.fail("stream_malformed_chunk", payload[:200])
        if not isinstance(obj, dict):
            return rec.fail("stream_malformed_chunk", payload[:200])
        if "error" in obj or obj.get("object") == "error":
            return rec.fail("stream_error_event", payload[:300])
        events += 1
        if isinstance(obj.get("usage"), dict):
            usage = obj["usage"]
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return rec.fail("stream_malformed_chunk", payload[:200])
        for c in choices[:1]:
            piece = c.get("text") if spec.endpoint == "completions" else (c.get("delta") or {}).get("content")
            if piece is None:
                piece = ""   # the role-only first delta of chat, or a finish-only chunk
            if not isinstance(piece, str):
                return rec.fail("stream_malformed_chunk", payload[:200])
            if piece:
                now = time.perf_counter()
                if rec.ttft_s is None:
                    rec.ttft_s = now - t0
                else:
                    rec.itls.append(now - last)
                last = now
                pieces.append(piece)
            if c.get("finish_reason"):
                finish = c["finish_reason"]
        if spec.close_after and events >= spec.close_after and not done:
            rec.outcome = "disconnected"   # the caller closes the connection
            return
    if not done:
        return rec.fail("stream_missing_done", f"{events} events, finish_reason={finish!r}")
    _check_output(spec, rec, "".join(pieces), finish, usage, len(pieces))


async def execute(spec: Spec, host: str, port: int, timeout: float) -> Record:
    rec = Record(spec.index, spec.category, spec.kind, spec.endpoint, spec.stream, spec.max_tokens)
    t0 = time.perf_counter()
    stage = ["connect"]

    async def run() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        stage[0] = "response"
        try:
            payload = spec.payload()
            head = (f"POST {spec.path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {spec.content_type}\r\n"
                    f"Content-Length: {len(payload)}\r\nAccept: */*\r\nConnection: close\r\n\r\n")
            writer.write(head.encode() + payload)
            await writer.drain()
            rec.status, headers = await _read_head(reader)
            chunks = _iter_body(reader, headers)
            if spec.category == "invalid":
                body = await _read_all(chunks)
                if 400 <= rec.status < 500:
                    if _is_clean_error(body):
                        rec.outcome = "clean_4xx"
                    else:
                        rec.fail("invalid_4xx_not_json", body[:200].decode("utf-8", "replace"))
                else:
                    rec.fail(f"invalid_got_{rec.status}", body[:200].decode("utf-8", "replace"))
            elif rec.status != 200:
                body = await _read_all(chunks)
                if spec.category == "lenient" and 400 <= rec.status < 500 and _is_clean_error(body):
                    rec.outcome = "refused_4xx"
                else:
                    rec.fail(f"http_{rec.status}", body[:300].decode("utf-8", "replace"))
            elif spec.stream:
                await _check_stream(spec, rec, headers, chunks, t0)
            else:
                _check_plain(spec, rec, await _read_all(chunks))
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass

    try:
        await asyncio.wait_for(run(), timeout)
    except asyncio.TimeoutError:
        rec.fail("timeout", f"no complete answer after {timeout} s ({stage[0]})")
    except asyncio.IncompleteReadError:
        rec.fail("connection_dropped", f"the server closed the connection ({stage[0]})")
    except ProtocolError as e:
        rec.fail("bad_http", str(e))
    except (ConnectionError, OSError) as e:
        rec.fail("connect_error" if stage[0] == "connect" else "connection_dropped", f"{type(e).__name__}: {e}")
    rec.latency_s = time.perf_counter() - t0
    if spec.category == "invalid" and not rec.ok and not rec.reason.startswith("invalid_"):
        rec.reason = "invalid_" + rec.reason   # a dropped connection or timeout on an invalid request
    return rec


# ----------------------------------------------------------------------------------------------
# Memory sampling
# ----------------------------------------------------------------------------------------------

Sampler = Callable[[], "float | None"]


def process_tree(root: int) -> list[int]:
    """root and all its descendants, from /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def prompt_token_ids(model_dir, hi: int, lo: int = MIN_TOKEN_ID) -> tuple[int, ...] | None:
    """Ids in [lo, hi) of the checkpoint's tokenizer.json whose vocabulary entry is plain text
    (PROMPT_TOKEN_CHARS; no added or special token, no byte-fallback ``<0xNN>``), sorted; None when
    there is no readable tokenizer.json or no such id."""
    try:
        tok = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    vocab = (tok.get("model") or {}).get("vocab") if isinstance(tok, dict) else None
    if isinstance(vocab, dict):
        items = vocab.items()
    elif isinstance(vocab, list):   # unigram: [[piece, score], ...] in id order
        items = ((p[0] if isinstance(p, list) and p else None, i) for i, p in enumerate(vocab))
    else:
        return None
    special = {t.get("id") for t in tok.get("added_tokens") or [] if isinstance(t, dict)}
    ids = sorted(i for piece, i in items
                 if isinstance(i, int) and lo <= i < hi and i not in special and isinstance(piece, str) and piece
                 and set(piece) <= PROMPT_TOKEN_CHARS and not piece.startswith("<0x"))
    return tuple(ids) or None


def config_record(cfg: SoakConfig) -> dict:
    """The configuration as recorded in soak.json (the prompt id list as its size)."""
    rec = dataclasses.asdict(cfg)
    if cfg.token_ids:
        rec["token_ids"] = f"{len(cfg.token_ids)} plain-text ids of the tokenizer below {cfg.max_token_id}"
    return rec


#: Memory series of one process of the server's tree: shown, not judged (the tree's sum is).
PER_PROCESS = "process "


def process_rss_mib(pid: int) -> float | None:
    """VmRSS of one process (MiB), None when it is gone or has no resident set (a zombie)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def tree_rss_mib(root: int) -> float | None:
    """Summed VmRSS of the process tree (shared pages count once per process; the slope is what matters)."""
    rss = [v for v in map(process_rss_mib, process_tree(root)) if v is not None]
    return sum(rss) if rss else None


def visible_gpus() -> str | None:
    """The GPUs this soak's server may use: ``CUDA_VISIBLE_DEVICES`` when it lists indices or UUIDs, else
    None (all). Another job on the machine's other GPU then does not show in this soak's memory slope."""
    ids = os.environ.get("CUDA_VISIBLE_DEVICES", "").replace(" ", "")
    return ids if ids and ids != "-1" else None


def gpu_used_mib(gpus: str | None = None) -> float | None:
    """memory.used of the GPUs ``gpus`` names (nvidia-smi ``--id``; None: every GPU), summed (MiB)."""
    cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    if gpus:
        cmd.append(f"--id={gpus}")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        return float(sum(float(x) for x in out.stdout.split())) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def default_samplers(cfg: SoakConfig, server_pid: int | None) -> dict[str, tuple[str, Sampler]]:
    """name -> (where the numbers come from, sampler)."""
    samplers = {}
    if cfg.gpu != "off" and shutil.which("nvidia-smi"):
        gpus = visible_gpus()
        source = f"nvidia-smi memory.used, {f'GPUs {gpus}' if gpus else 'all GPUs'}"
        if gpus and gpu_used_mib(gpus) is None:   # ids nvidia-smi does not take (MIG, UUID prefixes): every GPU
            source, gpus = f"nvidia-smi memory.used, all GPUs (it did not take --id={gpus})", None
        samplers["gpu_memory"] = (source, lambda gpus=gpus: gpu_used_mib(gpus))
    if server_pid:
        samplers["host_rss"] = (f"VmRSS of process tree {server_pid}", lambda: tree_rss_mib(server_pid))
        # each process of the tree on its own (reported, not judged): which one a slope comes from (an engine's
        # API server holds the requests' Python objects, its engine core our layers)
        for pid in process_tree(server_pid):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            samplers[f"{PER_PROCESS}{pid} {comm}"] = (f"VmRSS of process {pid}", lambda pid=pid: process_rss_mib(pid))
    return samplers


class MemoryMonitor:
    """Calls each sampler every `interval` seconds in a thread; series[name] = [(monotonic s, MiB)]."""

    def __init__(self, samplers: dict[str, tuple[str, Sampler]], interval: float):
        self.samplers, self.interval = samplers, interval
        self.series: dict[str, list] = {name: [] for name in samplers}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            for name, (_, sample) in self.samplers.items():
                try:
                    v = sample()
                except Exception:  # a sampler failing must not end the soak; the gap shows in the count
                    v = None
                if v is not None:
                    self.series[name].append((time.monotonic(), float(v)))
            if self._stop.wait(self.interval):
                return

    def start(self) -> None:
        if self.samplers:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def slope_per_min(points: list) -> float | None:
    """Least-squares slope of (seconds, value) points, per minute."""
    if len(points) < 2:
        return None
    mt = sum(t for t, _ in points) / len(points)
    mv = sum(v for _, v in points) / len(points)
    sxx = sum((t - mt) ** 2 for t, _ in points)
    if sxx == 0:
        return None
    return sum((t - mt) * (v - mv) for t, v in points) / sxx * 60.0


def judge_memory(points: list, load_start: float, load_end: float, max_slope: float, min_points: int = 5) -> dict:
    mid = load_start + (load_end - load_start) / 2
    window = [(t, v) for t, v in points if t >= mid]
    slope = slope_per_min(window) if len(window) >= min_points else None
    res = {"samples": len(points), "window_samples": len(window),
           "window_s": round(window[-1][0] - window[0][0], 1) if window else 0.0,
           "start_mib": round(points[0][1], 1) if points else None,
           "end_mib": round(points[-1][1], 1) if points else None,
           "max_mib": round(max(v for _, v in points), 1) if points else None,
           "slope_mib_per_min": None if slope is None else round(slope, 3),
           "threshold_mib_per_min": max_slope}
    if slope is None:
        res["flat"], res["note"] = None, f"fewer than {min_points} samples in the second half: not judged"
    else:
        res["flat"] = abs(slope) < max_slope
    return res


# ----------------------------------------------------------------------------------------------
# Preflight: models, chat, prompt-length calibration
# ----------------------------------------------------------------------------------------------

def http_json(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int | None, object]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
        return None, str(e)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


def healthy(base: str, timeout: float = 10) -> bool:
    try:
        with urllib.request.urlopen(base + "/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def _calibrate(base: str, model: str, endpoint: str) -> tuple[tuple[float, float], dict]:
    """Prompt tokens of 4 and 64 words (usage.prompt_tokens) -> per-word and overhead upper estimates."""
    counts = {}
    for n in (4, 64):
        text = " ".join(WORDS[i % len(WORDS)] for i in range(n))
        if endpoint == "chat":
            body = {"model": model, "messages": [{"role": "user", "content": text}], "max_completion_tokens": 1}
            path = "/v1/chat/completions"
        else:
            body, path = {"model": model, "prompt": text, "max_tokens": 1}, "/v1/completions"
        status, obj = http_json(base + path, body)
        usage = obj.get("usage") if isinstance(obj, dict) else None
        if status != 200 or not isinstance(usage, dict) or not isinstance(usage.get("prompt_tokens"), int):
            fallback = (4.0, 64.0)
            return fallback, {"error": f"status {status}, no usage.prompt_tokens", "used": fallback}
        counts[n] = usage["prompt_tokens"]
    per_word = max((counts[64] - counts[4]) / 60, 0.5)
    overhead = max(counts[4] - 4 * per_word, 0.0)
    # Margins: words tokenize to different lengths, so a prompt's count scatters around the mean.
    est = (per_word * 1.25 + 0.05, overhead + 8.0)
    return est, {"prompt_tokens": counts, "per_word": round(per_word, 3), "overhead": round(overhead, 1),
                 "used": [round(est[0], 3), round(est[1], 1)]}


def preflight(base: str, cfg: SoakConfig) -> tuple[Target | None, dict]:
    """The target to soak, or None and the reason."""
    info: dict = {"url": base}
    u = urllib.parse.urlsplit(base)
    status, obj = http_json(base + "/v1/models")
    cards = obj.get("data") if isinstance(obj, dict) else None
    if status != 200 or not isinstance(cards, list) or not cards:
        info["error"] = f"GET /v1/models: status {status}, {str(obj)[:200]}"
        return None, info
    card = cards[0]
    model = cfg.model_name or card.get("id")
    max_len = card.get("max_model_len") or cfg.max_model_len
    info.update(model=model, engine=card.get("owned_by", "?"), max_model_len=max_len,
                max_model_len_from="/v1/models" if card.get("max_model_len") else "--max-model-len")
    if not isinstance(max_len, int) or max_len < 8:
        info["error"] = "the server does not report max_model_len in /v1/models: give --max-model-len"
        return None, info
    chat, note = cfg.chat != "off", "off (--chat off)" if cfg.chat == "off" else "on"
    if cfg.chat == "auto":
        probe = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1}
        st, ans = http_json(base + "/v1/chat/completions", probe)
        if st is not None and 400 <= st < 500:
            chat, note = False, f"off: the probe got {st} {str(ans)[:200]}"
        else:
            note = f"on (probe: {st})"
    engine = str(card.get("owned_by", "?"))
    reserve = cfg.context_reserve if cfg.context_reserve is not None else CONTEXT_RESERVE.get(engine, 0)
    if reserve < 0 or max_len - reserve - max_len // 2 < 1:   # (outputs take up to half the context)
        info["error"] = (f"--context-reserve: expected 0 <= reserve < {max_len - max_len // 2} for max_model_len "
                         f"{max_len} (prompts need at least one token), got {reserve}")
        return None, info
    t = Target(u.hostname or "127.0.0.1", u.port or 80, model, max_len, engine, chat, note, reserve=reserve)
    info["chat"] = note
    info["context_reserve"] = reserve
    info["calibration"] = {}
    for ep in ("completions", "chat") if chat else ("completions",):
        t.words[ep], info["calibration"][ep] = _calibrate(base, model, ep)
    return t, info


# ----------------------------------------------------------------------------------------------
# The soak
# ----------------------------------------------------------------------------------------------

def percentiles(xs: list, scale: float = 1.0) -> dict:
    if not xs:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    s = sorted(xs)

    def q(p: float) -> float:
        k = (len(s) - 1) * p / 100
        f = math.floor(k)
        c = min(f + 1, len(s) - 1)
        return s[f] + (s[c] - s[f]) * (k - f)
    return {"n": len(s), "p50": round(q(50) * scale, 3), "p99": round(q(99) * scale, 3), "max": round(s[-1] * scale, 3)}


async def _load(cfg: SoakConfig, target: Target, records: list) -> tuple[float, float]:
    planner = Planner(cfg, target)
    issued = [0]
    start = time.monotonic()

    def next_spec() -> Spec | None:
        if issued[0] >= cfg.requests and time.monotonic() - start >= cfg.min_duration:
            return None
        s = planner.spec(issued[0])
        issued[0] += 1
        return s

    async def client() -> None:
        while (spec := next_spec()) is not None:
            records.append(await execute(spec, target.host, target.port, cfg.request_timeout))

    async def progress() -> None:
        while True:
            await asyncio.sleep(cfg.progress_interval)
            bad = sum(not r.ok for r in records)
            print(f"soak: {time.monotonic() - start:7.1f} s  issued {issued[0]}  done {len(records)}  failed {bad}",
                  flush=True)

    ticker = asyncio.ensure_future(progress())
    try:
        await asyncio.gather(*(client() for _ in range(cfg.clients)))
    finally:
        ticker.cancel()
    return start, time.monotonic()


def summarize(cfg: SoakConfig, info: dict, records: list, start: float, end: float, monitor: MemoryMonitor | None,
              health_after: bool) -> dict:
    duration = end - start
    by_cat = {c: [r for r in records if r.category == c] for c in ("valid", "disconnect", "lenient", "invalid")}
    served = by_cat["valid"] + [r for r in by_cat["lenient"] + by_cat["disconnect"] if r.outcome == "completed"]
    ok_served = [r for r in served if r.ok]

    def reasons(rs: list) -> dict:
        out: dict = {}
        for r in rs:
            if not r.ok:
                out[r.reason] = out.get(r.reason, 0) + 1
        return out

    tokens = sum(r.tokens or 0 for r in ok_served)
    valid_failed = [r for r in by_cat["valid"] + by_cat["disconnect"] + by_cat["lenient"] if not r.ok]
    invalid = {}
    for kind in INVALID_KINDS:
        rs = [r for r in by_cat["invalid"] if r.kind == kind]
        statuses: dict = {}
        for r in rs:
            statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
        invalid[kind] = {"sent": len(rs), "clean_4xx": sum(r.outcome == "clean_4xx" for r in rs),
                         "failed": sum(not r.ok for r in rs), "statuses": statuses, "failures": reasons(rs)}
    lenient = {}
    for kind in LENIENT_KINDS:
        rs = [r for r in by_cat["lenient"] if r.kind == kind]
        lenient[kind] = {"sent": len(rs), "accepted": sum(r.outcome == "completed" for r in rs),
                         "refused_4xx": sum(r.outcome == "refused_4xx" for r in rs),
                         "failed": sum(not r.ok for r in rs), "failures": reasons(rs)}
    classes: dict = {}
    for r in by_cat["valid"]:
        for key in r.kind.split("/"):
            classes[key] = classes.get(key, 0) + 1
    streams = [r for r in ok_served if r.stream]
    memory = {}
    if monitor is not None:
        for name, (source, _) in monitor.samplers.items():
            points = monitor.series[name]
            memory[name] = {"source": source, **judge_memory(points, start, end, cfg.max_slope),
                            "series_s_mib": [[round(t - start, 1), round(v, 1)] for t, v in points]}

    result = {
        "server": info,
        "config": config_record(cfg),
        "load": {"clients": cfg.clients, "requests": len(records), "duration_s": round(duration, 1),
                 "requests_per_s": round(len(records) / duration, 2) if duration else None,
                 "output_tokens": tokens, "output_tokens_per_s": round(tokens / duration, 1) if duration else None},
        "valid": {"sent": len(by_cat["valid"]), "ok": sum(r.ok for r in by_cat["valid"]),
                  "failed": sum(not r.ok for r in by_cat["valid"]), "failures": reasons(by_cat["valid"]),
                  "classes": dict(sorted(classes.items()))},
        "disconnect": {"sent": len(by_cat["disconnect"]),
                       "closed_mid_stream": sum(r.outcome == "disconnected" for r in by_cat["disconnect"]),
                       "completed_first": sum(r.outcome == "completed" for r in by_cat["disconnect"]),
                       "failed": sum(not r.ok for r in by_cat["disconnect"]),
                       "failures": reasons(by_cat["disconnect"])},
        "lenient": lenient,
        "invalid": {"sent": len(by_cat["invalid"]),
                    "clean_4xx": sum(r.outcome == "clean_4xx" for r in by_cat["invalid"]),
                    "failed": sum(not r.ok for r in by_cat["invalid"]), "by_kind": invalid},
        "latency": {"ttft_ms": percentiles([r.ttft_s for r in streams if r.ttft_s is not None], 1e3),
                    "itl_ms": percentiles([x for r in streams for x in r.itls], 1e3),
                    "tpot_ms": percentiles([(r.latency_s - r.ttft_s) / (r.tokens - 1) for r in streams
                                            if r.ttft_s is not None and (r.tokens or 0) > 1], 1e3),
                    "request_s": percentiles([r.latency_s for r in ok_served])},
        "memory": memory,
        "health_after": health_after,
        "failures": [dataclasses.asdict(r) | {"itls": len(r.itls)} for r in records if not r.ok][:50],
    }
    problems = []
    if valid_failed:
        problems.append(f"{len(valid_failed)} valid requests failed: {reasons(valid_failed)}")
    bad_invalid = {k: v["failures"] for k, v in invalid.items() if v["failed"]}
    if bad_invalid:
        problems.append(f"invalid requests without a clean 4xx: {bad_invalid}")
    for name, m in memory.items():
        if name.startswith(PER_PROCESS):     # shown, not judged
            continue
        if m["samples"] == 0:
            problems.append(f"{name}: no samples ({m['source']})")
        if m["flat"] is False:
            problems.append(f"{name} not flat: {m['slope_mib_per_min']} MiB/min over the second half "
                            f"(threshold {cfg.max_slope})")
    if not health_after:
        problems.append("the server was not healthy after the load")
    result["problems"] = problems
    result["passed"] = not problems
    return result


def run_soak(base: str, cfg: SoakConfig, samplers: dict | None = None, server_pid: int | None = None,
             proc: subprocess.Popen | None = None) -> tuple[dict, list]:
    """Preflight, load, summary. samplers: name -> (source, callable returning MiB), default nvidia-smi and
    the server's process-tree RSS. Returns the result and the per-request records."""
    target, info = preflight(base, cfg)
    if target is None:
        return {"server": info, "config": config_record(cfg), "passed": False, "setup_error": info["error"],
                "problems": [info["error"]]}, []
    print(f"soak: {info['engine']} model {target.model!r} max_model_len {target.max_len}, chat {target.chat_note}; "
          f"{cfg.clients} clients, >= {cfg.requests} requests, >= {cfg.min_duration:.0f} s", flush=True)
    monitor = MemoryMonitor(default_samplers(cfg, server_pid) if samplers is None else samplers, cfg.sample_interval)
    records: list = []
    monitor.start()
    try:
        start, end = asyncio.run(_load(cfg, target, records))
    finally:
        monitor.stop()
    alive = proc is None or proc.poll() is None
    result = summarize(cfg, info, records, start, end, monitor, alive and healthy(base))
    records.sort(key=lambda r: r.index)
    return result, records


# ----------------------------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------------------------

def _ms(p: dict) -> str:
    return "-" if p["n"] == 0 else f"{p['p50']} / {p['p99']} (n={p['n']})"


def markdown(result: dict) -> str:
    head = f"# Serving soak: {'PASS' if result['passed'] else 'FAIL'}\n\n"
    if "command" in result:
        head += f"`{result['command']}` ({result.get('date', '')})\n\n"
    s = result["server"]
    head += (f"Server {s.get('engine', '?')} at {s.get('url')}, model `{s.get('model')}`, max_model_len "
             f"{s.get('max_model_len')} (from {s.get('max_model_len_from', '?')})"
             + (f", valid requests within {s['context_reserve']} tokens of it kept free (the engine's limit)"
                if s.get("context_reserve") else "") + f"; chat {s.get('chat', '?')}.\n")
    if "setup_error" in result:
        return head + f"Could not run: {result['setup_error']}\n"
    ld, v, d, inv, lat = result["load"], result["valid"], result["disconnect"], result["invalid"], result["latency"]
    lines = [head, "| | |", "|---|---|",
             f"| load | {ld['clients']} clients, {ld['requests']} requests in {ld['duration_s']} s "
             f"({ld['requests_per_s']} req/s), seed {result['config']['seed']} |",
             f"| valid requests | {v['sent']}: {v['ok']} ok, {v['failed']} failed {v['failures'] or ''} |",
             f"| clients closing mid-stream | {d['sent']}: {d['closed_mid_stream']} closed, {d['completed_first']} "
             f"completed first, {d['failed']} failed |",
             f"| invalid requests | {inv['sent']}: {inv['clean_4xx']} clean 4xx, {inv['failed']} failed |",
             f"| output tokens/s | {ld['output_tokens_per_s']} ({ld['output_tokens']} tokens) |",
             f"| TTFT p50 / p99 ms | {_ms(lat['ttft_ms'])} |",
             f"| inter-token latency p50 / p99 ms | {_ms(lat['itl_ms'])} |",
             f"| time per output token p50 / p99 ms | {_ms(lat['tpot_ms'])} |",
             f"| request latency p50 / p99 s | {_ms(lat['request_s'])} |",
             f"| server healthy after | {'yes' if result['health_after'] else 'NO'} |", "",
             "## Invalid requests (each must get a clean 4xx JSON error)", "",
             "| kind | sent | clean 4xx | statuses | failed |", "|---|---|---|---|---|"]
    for kind, k in inv["by_kind"].items():
        lines.append(f"| {kind} | {k['sent']} | {k['clean_4xx']} | {k['statuses']} | "
                     f"{k['failed']} {k['failures'] or ''} |")
    lines += ["", "## Requests an engine may accept or refuse", "",
              "| kind | sent | accepted (checked as valid) | refused 4xx | failed |", "|---|---|---|---|---|"]
    for kind, k in result["lenient"].items():
        lines.append(f"| {kind} | {k['sent']} | {k['accepted']} | {k['refused_4xx']} | "
                     f"{k['failed']} {k['failures'] or ''} |")
    lines += ["", f"## Memory (slope over the second half of the load; flat below "
                  f"{result['config']['max_slope']} MiB/min)", ""]
    if result["memory"]:
        lines += ["| series | source | start MiB | end MiB | max MiB | slope MiB/min | samples (window) | flat |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, m in result["memory"].items():
            flat = {True: "yes", False: "NO", None: m.get("note", "-")}[m["flat"]]
            if name.startswith(PER_PROCESS):
                flat = f"({'yes' if m['flat'] else 'no' if m['flat'] is False else '-'}: one process, not judged)"
            lines.append(f"| {name} | {m['source']} | {m['start_mib']} | {m['end_mib']} | {m['max_mib']} | "
                         f"{m['slope_mib_per_min']} | {m['samples']} ({m['window_samples']}) | {flat} |")
    else:
        lines.append("Not sampled (no nvidia-smi, no server PID).")
    if result["problems"]:
        lines += ["", "## Problems", ""] + [f"- {p}" for p in result["problems"]]
    if result["failures"]:
        lines += ["", "## Failed requests (first 20)", "", "| # | kind | status | reason | detail |",
                  "|---|---|---|---|---|"]
        for f in result["failures"][:20]:
            detail = f["detail"].replace("|", "\\|").replace("\n", " ")[:160]
            lines.append(f"| {f['index']} | {f['kind']} | {f['status']} | {f['reason']} | {detail} |")
    return "\n".join(lines) + "\n"


def write_reports(result: dict, records: list, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "soak.md").write_text(markdown(result))
    # Tens of thousands of lines on a fast server: compressed, and the inter-token gaps as count and max.
    with gzip.open(out / "requests.jsonl.gz", "wt") as f:
        for r in records:
            d = dataclasses.asdict(r)
            d["itls"] = len(r.itls)
            d["itl_max_s"] = round(max(r.itls), 4) if r.itls else None
            for k in ("latency_s", "ttft_s"):
                d[k] = None if d[k] is None else round(d[k], 4)
            f.write(json.dumps(d) + "\n")


# ----------------------------------------------------------------------------------------------
# Launching a server
# ----------------------------------------------------------------------------------------------

def wait_healthy(base: str, proc: subprocess.Popen, timeout: float, poll: float = 2.0) -> str | None:
    t0 = time.time()
    while not healthy(base, timeout=5):
        if proc.poll() is not None:
            return f"the server exited with {proc.returncode} before /health answered"
        if time.time() - t0 > timeout:
            return f"not healthy after {timeout} s"
        time.sleep(poll)
    return None


def run_launched(cmd: list, base: str, cfg: SoakConfig, log_path: Path, startup_timeout: float,
                 samplers: dict | None = None, poll: float = 2.0) -> tuple[dict, list]:
    """Start cmd in its own process group, soak it once /health answers, then stop the whole group."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from serve_check import stop_server

    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0, startup_s = time.time(), None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            err = wait_healthy(base, proc, startup_timeout, poll)
            startup_s = round(time.time() - t0, 1)
            if err:
                result, records = {"server": {"url": base}, "config": config_record(cfg), "passed": False,
                                   "setup_error": err, "problems": [err]}, []
            else:
                result, records = run_soak(base, cfg, samplers, server_pid=proc.pid, proc=proc)
        finally:
            stop_server(proc)
    result["server"].update(launched=cmd, startup_s=startup_s, log=str(log_path), exit_code=proc.returncode)
    return result, records


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--launch", choices=("vllm", "sglang"), help="start this engine's server on --model")
    where.add_argument("--url", help="soak a running server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", help="checkpoint folder (--launch; with --url optional: its tokenizer.json picks the "
                    "prompt token ids)")
    ap.add_argument("--quantization", default="nvfp4", help="--quantization of the launched server ('none': omit)")
    ap.add_argument("--port", type=int, default=8123, help="port of the launched server")
    ap.add_argument("--mem-fraction", type=float, default=0.5, help="GPU memory share of the launched server")
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--server-pid", type=int, help="--url: the server's PID, for host RSS of its process tree")
    ap.add_argument("--model-name", help="model name in requests (default: the first id of /v1/models)")
    ap.add_argument("--max-model-len", type=int,
                    help="context length when /v1/models does not report it; with --launch also passed to the engine")
    ap.add_argument("--context-reserve", type=int, default=None,
                    help="tokens below the context length that valid requests leave free (default: the engine's, "
                         "CONTEXT_RESERVE: SGLang 6, others 0)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2000, help="at least this many requests")
    ap.add_argument("--min-duration", type=float, default=180,
                    help="keep sending until this many seconds have passed (the memory slopes need minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long-tokens", type=int, default=1024, help="max_tokens of long outputs (capped at context/2)")
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--max-token-id", type=int, default=2000,
                    help="token-id prompts draw ids from [16, this): with --model, only those whose vocabulary "
                    "entry is plain ASCII text")
    ap.add_argument("--chat", choices=("auto", "on", "off"), default="auto",
                    help="auto: chat requests unless a probe gets a 4xx (e.g. a model without a chat template)")
    ap.add_argument("--invalid-share", type=float, default=INVALID_SHARE)
    ap.add_argument("--disconnect-share", type=float, default=DISCONNECT_SHARE)
    ap.add_argument("--sample-interval", type=float, default=2.0, help="seconds between memory samples")
    ap.add_argument("--max-slope", type=float, default=5.0, help="MiB/min under which memory counts as flat")
    ap.add_argument("--gpu", choices=("auto", "off"), default="auto", help="sample nvidia-smi (auto: when present)")
    ap.add_argument("--out", required=True, help="folder for soak.json, soak.md, requests.jsonl.gz (and server.log)")
    ap.add_argument("extra", nargs="*", help="extra engine arguments (after --)")
    args = ap.parse_args(argv)
    cfg = SoakConfig(clients=args.clients, requests=args.requests, min_duration=args.min_duration, seed=args.seed,
                     long_tokens=args.long_tokens, request_timeout=args.request_timeout,
                     max_token_id=args.max_token_id,
                     token_ids=prompt_token_ids(args.model, args.max_token_id) if args.model else None,
                     chat=args.chat, model_name=args.model_name,
                     max_model_len=args.max_model_len, context_reserve=args.context_reserve,
                     sample_interval=args.sample_interval,
                     max_slope=args.max_slope, gpu=args.gpu, invalid_share=args.invalid_share,
                     disconnect_share=args.disconnect_share)
    out = Path(args.out)
    if args.launch:
        if not args.model:
            ap.error("--launch needs --model")
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from serve_check import server_command

        extra = list(args.extra)
        if args.max_model_len:  # after serve_check's 1024: the engines' parsers keep the last value
            extra += ["--max-model-len" if args.launch == "vllm" else "--context-length", str(args.max_model_len)]
        quant = None if args.quantization in ("", "none") else args.quantization
        cmd = server_command(args.launch, args.model, args.port, quant, extra, args.mem_fraction)
        result, records = run_launched(cmd, f"http://127.0.0.1:{args.port}", cfg, out / "server.log",
                                       args.startup_timeout)
        log = (out / "server.log").read_text(errors="replace")
        result["server"]["log_names_nvfp4_plugin"] = "nvfp4_plugin" in log
        if quant == "nvfp4" and "setup_error" not in result and "nvfp4_plugin" not in log:
            result["problems"].append("the server log never names nvfp4_plugin: our method did not serve")
            result["passed"] = False
        if "setup_error" in result:
            result["server"]["log_tail"] = log[-3000:]
    else:
        result, records = run_soak(args.url.rstrip("/"), cfg, server_pid=args.server_pid)
    result["command"] = " ".join([Path(sys.argv[0]).name if argv is None else "soak.py"] +
                                 (sys.argv[1:] if argv is None else list(argv)))
    result["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    write_reports(result, records, out)
    print(markdown(result))
    if "setup_error" in result:
        return 2
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
