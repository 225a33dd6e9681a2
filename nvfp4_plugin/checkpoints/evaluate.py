"""``nvfp4-plugin eval-ppl``: perplexity of a checkpoint folder on a text, CPU or GPU.

An NVFP4 folder is evaluated through the reference numerics of our layers: every quantized weight
is the exact reference dequantization (``dequantize``'s twin, fp32), and with ``activations="auto"``
on a W4A4 checkpoint every quantized module's input is quantized to NVFP4 and back with the
module's activation encode scale, per 16-value block along K, as a Blackwell FP4 GEMM computes
(``activations="none"`` evaluates the same file weight-only). A bf16/fp16 folder is evaluated as it
is. The model runs in fp32 either way, so the two differ only by the quantization.

Perplexity: the text's tokens (the folder's tokenizer, its default special tokens) cut into
consecutive windows of ``seq_len``; exp of the mean next-token cross entropy over every predicted
token of every window.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import CONFIG_JSON, HF_QUANT_CONFIG
from .errors import MissingDependency

ACTIVATIONS = ("auto", "none")


@dataclass
class PplReport:
    model: str
    quantized: bool
    activations_quantized: bool
    tokens: int
    windows: int
    nll: float
    seconds: float

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    def summary(self) -> str:
        kind = ("NVFP4 " + ("W4A4" if self.activations_quantized else "weights only")) if self.quantized else "unquantized"
        return (f"{self.model}: perplexity {self.ppl:.4f} ({kind}; {self.tokens} predicted tokens in {self.windows} "
                f"windows, {self.seconds:.1f}s)")


def is_nvfp4_folder(path: Path) -> bool:
    cfg = json.loads((path / CONFIG_JSON).read_text())
    return bool(cfg.get("quantization_config")) or (path / HF_QUANT_CONFIG).exists()


def _act_quant_hooks(model, scales: dict[str, torch.Tensor]):
    """Forward pre-hooks quantizing each listed module's input to NVFP4 and back (encode scale per module)."""
    from ..layers.backends.reference import _e2m1_table, fake_quant_rows

    table = _e2m1_table(next(model.parameters()).device)
    handles = []
    mods = dict(model.named_modules())
    for name, gs in scales.items():
        mod = mods.get(name)
        if mod is None:
            raise KeyError(f"{name}: quantized module of the checkpoint not found in the model")

        def hook(_m, args, gs=gs):
            x = args[0]
            return (fake_quant_rows(x, gs.to(x.device).expand(x.shape[:-1]), table), *args[1:])

        handles.append(mod.register_forward_pre_hook(hook))
    return handles


def windowed_nll(model, ids: torch.Tensor, seq_len: int) -> tuple[float, int, int]:
    """Summed next-token cross entropy of a causal LM over consecutive ``seq_len`` windows of ``ids``,
    the number of predicted tokens and of windows (the model's device; no gradients)."""
    device = next(model.parameters()).device
    nll, count, windows = 0.0, 0, 0
    with torch.no_grad():
        for s in range(0, ids.numel() - 1, seq_len):
            chunk = ids[s:s + seq_len].to(device)
            if chunk.numel() < 2:
                break
            logits = model(input_ids=chunk[None]).logits[0, :-1].float()
            nll += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
            count += chunk.numel() - 1
            windows += 1
    return nll, count, windows


def perplexity(model_dir, text: str, *, seq_len: int = 512, device: str = "cpu",
               activations: str = "auto") -> PplReport:
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise MissingDependency("eval-ppl needs transformers (pip install 'nvfp4-plugin[tools]')") from exc
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations: expected one of {ACTIVATIONS}, got {activations!r}")
    if seq_len < 2:
        raise ValueError(f"seq_len: expected at least 2, got {seq_len}")
    t0 = time.time()
    src = Path(model_dir)
    quantized = is_nvfp4_folder(src)
    act_scales: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory(prefix="nvfp4-ppl-") as tmp:
        path = src
        if quantized:
            from .dequantize import dequantize_checkpoint
            from .loader import open_checkpoint

            path = Path(tmp) / "dequantized"
            dequantize_checkpoint(src, path, dtype="float32")
            if activations == "auto":
                with open_checkpoint(src, check_block_scales=False) as ck:
                    if ck.config.activations_quantized:
                        act_scales = {m: ck.load_input_scale(m) for m in ck.modules}
        tok = AutoTokenizer.from_pretrained(src)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    handles = _act_quant_hooks(model, act_scales) if act_scales else []
    ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    try:
        nll, count, windows = windowed_nll(model, ids, seq_len)
    finally:
        for h in handles:
            h.remove()
    if count == 0:
        raise ValueError("text: fewer than 2 tokens")
    return PplReport(str(src), quantized, bool(act_scales), count, windows, nll / count, time.time() - t0)
