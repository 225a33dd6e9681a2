#!/usr/bin/env python3
"""The CPU reference of a served checkpoint: the same requests as serve_check.py, answered by
transformers in fp32 on the exactly dequantized weights (``nvfp4-plugin dequantize``).

    python integration/reference_logprobs.py --model NVFP4_OR_PLAIN_DIR --out ref.json

Writes ``prompt_logprobs`` (per prompt token after the first, of serve_check.LOGPROB_PROMPT) and the
greedy ``completion`` of serve_check.PROMPT (16 tokens), the keys serve_check.py records, so
compare_logprobs.py can line them up; with the completion, for each generated token, the length of the text
decoded up to it (``completion_offsets``) and how far its logprob was ahead of the runner-up's
(``completion_margins``, nats): where a served completion leaves the reference's, the margin there says
whether the reference itself was at a near tie. This is what the served W4A16 paths compute, without the
engines' bf16 activations: the reference for "ours equals our CPU reference layers". ``--dtype bfloat16``
runs the same model in bf16, which shows how far bf16 compute alone moves the logprobs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve_check import LOGPROB_PROMPT, PROMPT  # noqa: E402


def reference(model_dir: str, threads: int | None = None, dtype: str = "float32") -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nvfp4_plugin.checkpoints.config import HF_QUANT_CONFIG
    from nvfp4_plugin.checkpoints.dequantize import dequantize_checkpoint

    if threads:
        torch.set_num_threads(threads)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    quantized = "quantization_config" in cfg or (Path(model_dir) / HF_QUANT_CONFIG).exists()
    with tempfile.TemporaryDirectory(prefix="nvfp4-ref-") as tmp:
        plain = model_dir
        if quantized:
            plain = os.path.join(tmp, "dequantized")
            dequantize_checkpoint(model_dir, plain, dtype="float32")
        tok = AutoTokenizer.from_pretrained(plain)
        model = AutoModelForCausalLM.from_pretrained(plain, dtype=getattr(torch, dtype)).eval()
        with torch.no_grad():
            ids = tok(LOGPROB_PROMPT, return_tensors="pt").input_ids
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            prompt_logprobs = logp[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist()
            p = tok(PROMPT, return_tensors="pt").input_ids
            out = model.generate(p, max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(p),
                                 output_scores=True, return_dict_in_generate=True)
            gen = out.sequences[0, p.shape[1]:]
            completion = tok.decode(gen, skip_special_tokens=True)
            offsets = [len(tok.decode(gen[: i + 1], skip_special_tokens=True)) for i in range(len(gen))]
            margins = []
            for scores in out.scores:   # the scores greedy decoding picked from, one row per generated token
                top = torch.log_softmax(scores[0].float(), dim=-1).topk(2).values
                margins.append(round(float(top[0] - top[1]), 6))
    return {"engine": f"reference (transformers {dtype}, dequantized weights)", "model": model_dir, "dtype": dtype,
            "quantized": quantized, "prompt_logprobs": prompt_logprobs, "completion": completion,
            "completion_offsets": offsets, "completion_margins": margins}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="bfloat16 measures how far bf16 compute alone moves the logprobs (the tolerance's floor)")
    args = ap.parse_args()
    res = reference(args.model, args.threads, args.dtype)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items()
                      if k not in ("prompt_logprobs", "completion_offsets", "completion_margins")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
