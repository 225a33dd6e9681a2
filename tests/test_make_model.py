"""make-model: random-init Hugging Face checkpoints with a locally trained tokenizer."""

import json
import math

import pytest
import torch

from nvfp4_plugin import cli
from nvfp4_plugin.checkpoints.random_model import ARCHS, DIMS, make_model, weight_shapes
from nvfp4_plugin.checkpoints.safetensors_io import CheckpointFiles


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("mm")
    return {a: (base / a, make_model(base / a, a, "tiny", device="cpu")) for a in ARCHS}


def test_tokenizer_round_trips_and_has_a_chat_template(tiny):
    from transformers import AutoTokenizer

    d, info = tiny["llama"]
    tok = AutoTokenizer.from_pretrained(d)
    for s in ["Hello world!", "The ferry leaves at 17:30 from pier 4.", "  two  spaces\tand a tab\n",
              "naïve café, 東京, emoji 🙂", "def f(x):\n    return x * 2"]:
        ids = tok(s)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == s
    assert len(tok) == info["vocab"] == json.loads((d / "config.json").read_text())["vocab_size"]
    assert info["vocab"] % 128 == 0
    chat = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                   tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    gen = json.loads((d / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|im_end|>") in gen["eos_token_id"]
    # Every id a random model can sample decodes (reserved padding entries included).
    assert tok.decode([info["vocab"] - 1]).startswith("<|reserved_")


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_every_arch_without_missing_weights(tiny, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, info = tiny[arch]
    model, load = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    assert not any(load.values()), load
    assert sum(p.numel() for p in model.parameters()) == info["params"]
    tok = AutoTokenizer.from_pretrained(d)
    enc = tok("The river", return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == enc["input_ids"].shape[1] + 3
    files = CheckpointFiles(d)
    for name, t in files.tensors.items():
        assert t.dtype == "BF16"
        if len(t.shape) == 2 and not name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
            assert all(s % 128 == 0 for s in t.shape), (name, t.shape)


def test_seed_determinism_and_sharding(tmp_path):
    a = make_model(tmp_path / "a", "qwen3_moe", "tiny", seed=3, device="cpu", max_shard_size="300KB")
    b = make_model(tmp_path / "b", "qwen3_moe", "tiny", seed=3, device="cpu", max_shard_size="300KB")
    c = make_model(tmp_path / "c", "qwen3_moe", "tiny", seed=4, device="cpu", max_shard_size="300KB")
    assert len(a["files"]) > 2 and (tmp_path / "a" / "model.safetensors.index.json").exists()
    for f in a["files"]:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    assert any((tmp_path / "a" / f).read_bytes() != (tmp_path / "c" / f).read_bytes() for f in a["files"])
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "c" / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("arch", ARCHS)
def test_8b_shapes(arch):
    """The 8b-shape sizes (not written here): ~8B parameters, projections multiples of 128."""
    d = DIMS[arch]["8b-shape"]
    shapes = weight_shapes(arch, d, d["vocab"])
    n = sum(math.prod(s) for _, s in shapes)
    assert 7.0e9 < n < 8.6e9, n
    for name, s in shapes:
        if len(s) == 2 and not name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")) \
                and "embed" not in name and "lm_head" not in name:
            assert s[0] % 128 == 0 and s[1] % 128 == 0, (name, s)


def test_big_vocab_tokenizer_pads_with_plain_entries():
    from nvfp4_plugin.checkpoints.random_model import train_tokenizer

    tok = train_tokenizer(128256)
    assert tok.get_vocab_size() == 128256
    first = tok.token_to_id("<|reserved_0|>")
    assert tok.decode([128255]) == f"<|reserved_{128255 - first}|>"


def test_cli_make_model(tmp_path, capsys):
    d = tmp_path / "m"
    assert cli.main(["make-model", str(d), "--arch", "mixtral", "--device", "cpu", "--quiet"]) == 0
    assert "mixtral tiny" in capsys.readouterr().out
    assert cli.main(["make-model", str(d), "--arch", "llama", "--quiet"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert json.loads((d / "config.json").read_text())["model_type"] == "mixtral"


def test_make_model_layers_override(tmp_path, capsys):
    """``--layers``: the size's dimensions with another decoder depth (the MoE benchmark shape at more of
    Qwen3-30B-A3B's 48 layers); a bad value is refused by name before anything is written."""
    d = tmp_path / "moe"
    assert cli.main(["make-model", str(d), "--arch", "qwen3_moe", "--layers", "3", "--device", "cpu", "--quiet"]) == 0
    assert "qwen3_moe tiny, 3 layers" in capsys.readouterr().out
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3 and cfg["model_type"] == "qwen3_moe"
    from safetensors import safe_open

    names = set()
    for f in d.glob("*.safetensors"):
        with safe_open(f, "pt") as sf:
            names |= set(sf.keys())
    assert {n.split(".")[2] for n in names if n.startswith("model.layers.")} == {"0", "1", "2"}
    with pytest.raises(SystemExit):
        cli.main(["make-model", str(tmp_path / "x"), "--layers", "0"])
    assert "--layers: expected a positive integer, got '0'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="layers: expected a positive int, got 0"):
        make_model(tmp_path / "y", "llama", "tiny", layers=0)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
