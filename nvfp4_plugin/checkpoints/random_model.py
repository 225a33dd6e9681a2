"""``nvfp4-plugin make-model``: a randomly initialised Hugging Face checkpoint with a working tokenizer.

For tests, demos and benchmarks on machines that cannot reach a model hub. The folder has
``config.json`` (a real transformers config), ``generation_config.json``, bf16 safetensors with the
hub's tensor names (one tensor per expert for MoE models, sharded with an index above
``--max-shard-size``), and a byte-level BPE tokenizer trained locally on the built-in text
(``tokenizer.json`` + ``tokenizer_config.json`` with a ChatML chat template) that transformers'
``AutoTokenizer`` loads. Every projection dimension is a multiple of 128 (the tokenizer is padded
with reserved tokens to the model's vocabulary), except MoE routers (hidden -> num_experts).

Tensors are generated one at a time and streamed into the shards, so the 8B shape (~16 GB) needs
about one tensor of host memory; with a GPU the random numbers are drawn there (much faster).
The same seed, device type and library versions give the same files.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from . import corpus
from .errors import require
from .safetensors_io import ShardedWriter, TensorSpec, parse_size

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
SIZES = ("tiny", "small", "8b-shape")

_DENSE = {
    "tiny": dict(hidden=128, intermediate=256, layers=2, heads=2, kv_heads=1, head_dim=128),
    "small": dict(hidden=1024, intermediate=2816, layers=4, heads=16, kv_heads=8, head_dim=64),
}
#: Per-arch dimensions. The 8b-shape rows are the public models' shapes (Llama-3-8B, Qwen2.5-7B,
#: Qwen3-8B), Qwen3-30B-A3B with 12 of its 48 layers, and Mixtral-8x7B with 5 of its 32 layers
#: (~8B parameters each, ~16 GB in bf16).
DIMS = {
    "llama": {**_DENSE, "8b-shape": dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                                         head_dim=128, vocab=128256, rope_theta=500000.0)},
    "qwen2": {**_DENSE, "8b-shape": dict(hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4,
                                         head_dim=128, vocab=152064, rope_theta=1000000.0)},
    "qwen3": {**_DENSE, "8b-shape": dict(hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8,
                                         head_dim=128, vocab=151936, rope_theta=1000000.0)},
    "qwen3_moe": {
        "tiny": dict(hidden=128, intermediate=256, layers=2, heads=2, kv_heads=1, head_dim=128, experts=8, top_k=2,
                     moe_intermediate=128),
        "small": dict(hidden=1024, intermediate=3072, layers=4, heads=16, kv_heads=8, head_dim=64, experts=8,
                      top_k=2, moe_intermediate=768),
        "8b-shape": dict(hidden=2048, intermediate=6144, layers=12, heads=32, kv_heads=4, head_dim=128, experts=128,
                         top_k=8, moe_intermediate=768, vocab=151936, rope_theta=1000000.0),
    },
    "mixtral": {
        "tiny": dict(hidden=128, intermediate=128, layers=2, heads=2, kv_heads=1, head_dim=128, experts=4, top_k=2),
        "small": dict(hidden=1024, intermediate=1024, layers=4, heads=16, kv_heads=8, head_dim=64, experts=8, top_k=2),
        "8b-shape": dict(hidden=4096, intermediate=14336, layers=5, heads=32, kv_heads=8, head_dim=128, experts=8,
                         top_k=2, vocab=32000, rope_theta=1000000.0),
    },
}

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>")
# ("<|endoftext|>" too: transformers gives Qwen2 folders a Qwen2Tokenizer, which adds it as unk_token.)
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
BPE_TARGET_VOCAB = 4096
INIT_STD = 0.02


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------

def train_tokenizer(model_vocab: int | None = None):
    """Byte-level BPE trained on the built-in text; padded with ``<|reserved_i|>`` vocabulary entries to
    ``model_vocab`` (default: the next multiple of 128), so tokenizer and model vocab sizes agree and
    every id a random model samples decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_TARGET_VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus.lines(), trainer=trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                                       special_tokens=[("<|bos|>", bos)])
    n = tok.get_vocab_size()
    target = model_vocab or math.ceil(n / 128) * 128
    if target < n:
        raise ValueError(f"model vocab {target} is smaller than the trained tokenizer ({n} tokens)")
    if target > n:
        # Plain vocabulary entries (not added tokens): loading stays fast even for 100k+ of them.
        data = json.loads(tok.to_str())
        vocab = data["model"]["vocab"]
        for i in range(target - n):
            vocab[f"<|reserved_{i}|>"] = n + i
        tok = Tokenizer.from_str(json.dumps(data))
    assert tok.get_vocab_size() == target
    return tok


def write_tokenizer(tok, out: Path, max_len: int) -> dict:
    tok.save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
           "pad_token": "<|pad|>", "model_max_length": max_len, "clean_up_tokenization_spaces": False,
           "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({k: cfg[k] for k in ("bos_token", "eos_token", "pad_token")}, indent=2) + "\n")
    return {k: tok.token_to_id(f"<|{k}|>") for k in ("pad", "bos", "eos", "im_end")}


# ----------------------------------------------------------------------------------------------
# Config and tensors
# ----------------------------------------------------------------------------------------------

def make_config(arch: str, d: dict, vocab: int, ids: dict):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=d["hidden"], intermediate_size=d["intermediate"],
                  num_hidden_layers=d["layers"], num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"],
                  head_dim=d["head_dim"], hidden_act="silu", max_position_embeddings=4096,
                  initializer_range=INIT_STD, tie_word_embeddings=False, bos_token_id=ids["bos"],
                  eos_token_id=ids["eos"], pad_token_id=ids["pad"], dtype="bfloat16",
                  rope_parameters={"rope_type": "default", "rope_theta": d.get("rope_theta", 10000.0)})
    if arch == "llama":
        cfg = transformers.LlamaConfig(rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False, **common)
        cfg.architectures = ["LlamaForCausalLM"]
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(rms_norm_eps=1e-6, use_sliding_window=False, **common)
        cfg.architectures = ["Qwen2ForCausalLM"]
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(rms_norm_eps=1e-6, attention_bias=False, use_sliding_window=False, **common)
        cfg.architectures = ["Qwen3ForCausalLM"]
    elif arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(rms_norm_eps=1e-6, num_experts=d["experts"], num_experts_per_tok=d["top_k"],
                                          moe_intermediate_size=d["moe_intermediate"], decoder_sparse_step=1,
                                          mlp_only_layers=[], norm_topk_prob=True, attention_bias=False,
                                          use_sliding_window=False, **common)
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    elif arch == "mixtral":
        common.pop("head_dim")
        cfg = transformers.MixtralConfig(rms_norm_eps=1e-5, num_local_experts=d["experts"],
                                         num_experts_per_tok=d["top_k"], head_dim=d["head_dim"], **common)
        cfg.architectures = ["MixtralForCausalLM"]
    else:
        raise ValueError(f"arch: expected one of {ARCHS}, got {arch!r}")
    return cfg


def weight_shapes(arch: str, d: dict, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Hub tensor names and shapes, layer by layer (so each shard holds whole layers)."""
    h, hd = d["hidden"], d["head_dim"]
    q, kv = d["heads"] * hd, d["kv_heads"] * hd
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h))]
        if arch == "qwen2":
            out += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                    (p + "self_attn.v_proj.bias", (kv,))]
        if arch in ("qwen3", "qwen3_moe"):
            out += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        out += [(p + "self_attn.o_proj.weight", (h, q)), (p + "post_attention_layernorm.weight", (h,))]
        if arch == "qwen3_moe":
            m = d["moe_intermediate"]
            out.append((p + "mlp.gate.weight", (d["experts"], h)))
            for e in range(d["experts"]):
                x = f"{p}mlp.experts.{e}."
                out += [(x + "gate_proj.weight", (m, h)), (x + "up_proj.weight", (m, h)),
                        (x + "down_proj.weight", (h, m))]
        elif arch == "mixtral":
            m = d["intermediate"]
            out.append((p + "block_sparse_moe.gate.weight", (d["experts"], h)))
            for e in range(d["experts"]):
                x = f"{p}block_sparse_moe.experts.{e}."
                out += [(x + "w1.weight", (m, h)), (x + "w3.weight", (m, h)), (x + "w2.weight", (h, m))]
        else:
            m = d["intermediate"]
            out += [(p + "mlp.gate_proj.weight", (m, h)), (p + "mlp.up_proj.weight", (m, h)),
                    (p + "mlp.down_proj.weight", (h, m))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return out


def _random_tensor(name: str, shape, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)  # RMSNorm weights start at 1
    t = torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, INIT_STD, generator=gen)
    return t.to(torch.bfloat16).cpu()


def make_model(out_dir, arch: str = "llama", size: str = "tiny", seed: int = 0, device: str = "auto",
               max_shard_size="4.5GB", progress: bool = False, layers: int | None = None) -> dict:
    """Write the checkpoint; returns a small summary (params, files, seconds). ``layers``: the number of
    decoder layers instead of the size's (e.g. more of Qwen3-30B-A3B's 48 than the 8b-shape's 12)."""
    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {ARCHS}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size: expected one of {SIZES}, got {size!r}")
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
        raise ValueError(f"layers: expected a positive int, got {layers!r}")
    require("tokenizers", "make-model")
    require("transformers", "make-model")
    t0 = time.time()
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    d = DIMS[arch][size] if layers is None else dict(DIMS[arch][size], layers=layers)

    tok = train_tokenizer(d.get("vocab"))
    vocab = tok.get_vocab_size()
    ids = write_tokenizer(tok, out, 4096)
    cfg = make_config(arch, d, vocab, ids)
    cfg.save_pretrained(out)
    gen_cfg = {"bos_token_id": ids["bos"], "eos_token_id": [ids["eos"], ids["im_end"]], "pad_token_id": ids["pad"],
               "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")

    shapes = weight_shapes(arch, d, vocab)
    specs = [TensorSpec(n, "BF16", s) for n, s in shapes]
    writer = ShardedWriter(out, specs, parse_size(max_shard_size))
    gen = torch.Generator(device=dev).manual_seed(seed)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(s.nbytes for s in specs), unit="B", unit_scale=True, desc="make-model")
    try:
        for name, shape in shapes:
            t = _random_tensor(name, shape, gen, dev)
            writer.write(name, t)
            if bar is not None:
                bar.update(t.numel() * 2)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    n_params = sum(math.prod(s) for _, s in shapes)
    return {"dir": str(out), "arch": arch, "size": size, "layers": d["layers"], "params": n_params, "vocab": vocab,
            "files": writer.names, "bytes": writer.total_bytes, "seconds": time.time() - t0, "device": str(dev)}
