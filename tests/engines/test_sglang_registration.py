"""SGLang discovers the plugin through its entry point, the CLI accepts --quantization nvfp4, and it
sticks (SGLang's ModelOpt override would turn it into modelopt_fp4) for ModelOpt checkpoints with a
flat quantization_config or only hf_quant_config.json, and for compressed-tensors checkpoints."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tests._require import require

sglang = require("sglang")

from .sglang_harness import quantized_checkpoint, start  # noqa: E402

start()

from safetensors.torch import load_file, save_file  # noqa: E402
from sglang.srt.configs.load_config import LoadConfig  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.layers import linear as sgl_linear  # noqa: E402
from sglang.srt.layers.quantization import QUANTIZATION_METHODS  # noqa: E402
from sglang.srt.model_loader.weight_utils import get_quant_config  # noqa: E402
from sglang.srt.server_args import QUANTIZATION_CHOICES, ServerArgs, prepare_server_args  # noqa: E402

import nvfp4_plugin.engines.sglang as ns  # noqa: E402
from nvfp4_plugin.engines.sglang.config import Nvfp4SglangConfig  # noqa: E402

DISCOVERY = """
import importlib.metadata as md
eps = [e for e in md.entry_points(group="sglang.srt.plugins") if e.name == "nvfp4"]
assert [e.value for e in eps] == ["nvfp4_plugin.engines.sglang:register"], (
    "entry point sglang.srt.plugins:nvfp4 is not installed; run `pip install --no-deps -e .`", eps)
from sglang.srt.plugins import load_plugins
load_plugins(); load_plugins()
from sglang.srt.layers.linear import WEIGHT_LOADER_V2_SUPPORTED
from sglang.srt.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
from sglang.srt.server_args import QUANTIZATION_CHOICES
assert next(iter(QUANTIZATION_METHODS)) == "nvfp4", list(QUANTIZATION_METHODS)
assert QUANTIZATION_CHOICES.count("nvfp4") == 1, QUANTIZATION_CHOICES
assert WEIGHT_LOADER_V2_SUPPORTED.count("Nvfp4SglangLinearMethod") == 1
print(get_quantization_config("nvfp4").__module__)
"""


def test_entry_point_discovery_in_a_fresh_process():
    res = subprocess.run([sys.executable, "-c", DISCOVERY], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "nvfp4_plugin.engines.sglang.config" in res.stdout


def test_register_is_reentrant_and_keeps_nvfp4_first():
    # another plugin registering after us must not push us behind ModelOpt's override
    items = list(QUANTIZATION_METHODS.items())
    QUANTIZATION_METHODS.clear()
    QUANTIZATION_METHODS.update([("someone_else", object), *items])
    try:
        ns.register()
        ns.register()
        assert list(QUANTIZATION_METHODS)[:2] == ["nvfp4", "someone_else"]
        assert list(QUANTIZATION_METHODS).count("nvfp4") == 1
        assert QUANTIZATION_METHODS["nvfp4"] is Nvfp4SglangConfig
        assert QUANTIZATION_CHOICES.count("nvfp4") == 1
        assert sgl_linear.WEIGHT_LOADER_V2_SUPPORTED.count("Nvfp4SglangLinearMethod") == 1
    finally:
        QUANTIZATION_METHODS.pop("someone_else")


def test_cli_accepts_quantization_nvfp4():
    path = quantized_checkpoint("llama", "modelopt")
    args = prepare_server_args(["--model-path", path, "--quantization", "nvfp4", "--device", "cpu",
                                "--skip-tokenizer-init", "--attention-backend", "triton",
                                "--sampling-backend", "pytorch"])
    assert args.quantization == "nvfp4"
    with pytest.raises(SystemExit):
        prepare_server_args(["--model-path", path, "--quantization", "nvfp5", "--device", "cpu"])


def nested_only(tmp_path):
    """The ModelOpt layout of older exports: hf_quant_config.json only, no quantization_config."""
    d = tmp_path / "nested"
    shutil.copytree(quantized_checkpoint("qwen3_moe", "modelopt"), d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def model_config(path, quantization):
    return ModelConfig.from_server_args(ServerArgs(model_path=path, quantization=quantization, device="cpu",
                                                   skip_tokenizer_init=True))


@pytest.mark.parametrize("layout,builtin", [("modelopt", "modelopt_fp4"), ("nested", "modelopt_fp4"),
                                            ("compressed-tensors", "compressed-tensors")])
def test_quantization_nvfp4_is_not_overridden(tmp_path, layout, builtin):
    path = nested_only(tmp_path) if layout == "nested" else quantized_checkpoint("qwen3_moe", layout)
    mc = model_config(path, "nvfp4")
    assert mc.quantization == "nvfp4"
    # what the scheduler builds from it: our config, parsed from the file SGLang picked
    qc = get_quant_config(mc, LoadConfig(), {"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    assert isinstance(qc, Nvfp4SglangConfig)
    assert qc.spec.format == ("compressed-tensors" if layout == "compressed-tensors" else "modelopt")
    assert qc.spec.quant_algo == "NVFP4" and qc.spec.is_excluded("lm_head")
    assert qc.get_min_capability() == 90
    assert qc.fused_shards()["gate_up_proj"] == ["gate_proj", "up_proj"]
    # without the flag SGLang keeps its own path: we only take over when asked
    assert model_config(path, None).quantization == builtin


def write_config(tmp_path, quant_cfg):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
           "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
           "vocab_size": 1000, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}
    if quant_cfg is not None:
        cfg["quantization_config"] = quant_cfg
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_non_nvfp4_checkpoint_is_refused_with_a_clear_message(tmp_path):
    d = write_config(tmp_path, {"quant_method": "modelopt", "quant_algo": "FP8"})
    with pytest.raises(ValueError, match="--quantization nvfp4: the checkpoint is not an NVFP4 checkpoint .*"
                                         "'quant_algo': expected one of .*got 'FP8'"):
        model_config(d, "nvfp4")


def test_unquantized_checkpoint_fails_when_the_config_is_read(tmp_path):
    # SGLang asks the registered configs only when the checkpoint has a quantization config, so an
    # unquantized folder gets through ModelConfig and fails in get_quant_config (documented)
    mc = model_config(write_config(tmp_path, None), "nvfp4")
    with pytest.raises(ValueError, match="Cannot find the config file for nvfp4"):
        get_quant_config(mc, LoadConfig(), {})


def test_corrupt_checkpoint_fails_before_loading_naming_file_and_tensor(tmp_path):
    d = tmp_path / "corrupt"
    shutil.copytree(quantized_checkpoint("llama", "compressed-tensors"), d)
    files = sorted(d.glob("*.safetensors"))
    name = "model.layers.1.self_attn.k_proj.weight_global_scale"
    for f in files:
        tensors = load_file(str(f))
        if name in tensors:
            tensors[name] = torch.tensor([float("nan")])
            save_file(tensors, str(f), metadata={"format": "pt"})
            break
    else:
        raise AssertionError(f"{name} not in {files}")
    mc = model_config(str(d), "nvfp4")
    with pytest.raises(ValueError, match=rf"{f.name}: tensor '{name}': weight_global_scale must be finite and > 0"):
        get_quant_config(mc, LoadConfig(), {})
