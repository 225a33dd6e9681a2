"""vLLM discovers the plugin through its entry point, and --quantization nvfp4 sticks for both formats."""

import json
import subprocess
import sys

import pytest
import torch

from tests._require import require

vllm = require("vllm")

from .vllm_harness import start  # noqa: E402

start()

from vllm.config import ModelConfig  # noqa: E402

from .test_vllm_linear import CT, MODELOPT  # noqa: E402


def test_entry_point_discovery_in_a_fresh_process():
    code = ("from vllm.plugins import load_general_plugins; load_general_plugins(); load_general_plugins();"
            "from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config;"
            "assert QUANTIZATION_METHODS.count('nvfp4') == 1, QUANTIZATION_METHODS;"
            "print(get_quantization_config('nvfp4').__module__)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "nvfp4_plugin.engines.vllm.config" in res.stdout


def model_dir(tmp_path, quant_cfg):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
           "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
           "vocab_size": 1000, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
           "quantization_config": quant_cfg}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("quant_cfg,builtin", [(MODELOPT, "modelopt_fp4"), (CT, "compressed-tensors")])
def test_quantization_nvfp4_is_not_overridden(tmp_path, quant_cfg, builtin):
    d = model_dir(tmp_path, quant_cfg)
    assert ModelConfig(model=d, quantization="nvfp4", skip_tokenizer_init=True).quantization == "nvfp4"
    # without the flag vLLM keeps its own path: we only take over when asked
    assert ModelConfig(model=d, skip_tokenizer_init=True).quantization == builtin


def test_non_nvfp4_checkpoint_is_refused_with_a_clear_message(tmp_path):
    d = model_dir(tmp_path, {"quant_method": "modelopt", "quant_algo": "FP8"})
    with pytest.raises(ValueError, match="--quantization nvfp4: the checkpoint is not an NVFP4 checkpoint .*'quant_algo': expected one of .*got 'FP8'"):
        ModelConfig(model=d, quantization="nvfp4", skip_tokenizer_init=True)


def test_default_fork_start_survives_config_parsing(tmp_path):
    """vLLM parses (and we validate) the checkpoint in the launcher, then forks the engine core; the
    child must still run parallel torch work (it hung at its first one when our validation had
    started the OpenMP pool in the parent)."""
    from nvfp4_plugin.checkpoints.quantize import quantize_checkpoint
    from nvfp4_plugin.checkpoints.random_model import make_model

    from ..test_fork_safety import run_fork_child

    make_model(tmp_path / "src", "llama", "small", device="cpu")
    quantize_checkpoint(tmp_path / "src", tmp_path / "q", calibration=False, device="cpu", progress=False)
    res = run_fork_child(f"""
        import vllm.platforms as platforms
        from vllm.platforms.cpu import CpuPlatform
        platforms._current_platform = CpuPlatform()
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.config import LoadConfig, ModelConfig, VllmConfig
        mc = ModelConfig(model={str(tmp_path / "q")!r}, quantization="nvfp4", skip_tokenizer_init=True)
        assert type(VllmConfig.get_quantization_config(mc, LoadConfig())).__name__ == "Nvfp4VllmConfig"
    """)
    assert res.returncode == 0, (res.returncode, res.stdout, res.stderr[-3000:])


def test_corrupt_checkpoint_fails_before_loading_naming_file_and_tensor(tmp_path):
    """The same check SGLang runs when it reads the config: every header and scalar scale of a local
    folder, once per folder, before any layer is built."""
    from safetensors.torch import load_file, save_file

    from nvfp4_plugin.checkpoints.quantize import quantize_checkpoint
    from nvfp4_plugin.checkpoints.random_model import make_model
    from nvfp4_plugin.engines.vllm.config import Nvfp4VllmConfig

    make_model(tmp_path / "src", "llama", "tiny", device="cpu")
    d = tmp_path / "q"
    quantize_checkpoint(tmp_path / "src", d, format="compressed-tensors", calibration=False, device="cpu",
                        progress=False)
    name = "model.layers.1.self_attn.k_proj.weight_global_scale"
    f = next(f for f in sorted(d.glob("*.safetensors")) if name in load_file(str(f)))
    tensors = load_file(str(f))
    tensors[name] = torch.tensor([float("nan")])
    save_file(tensors, str(f), metadata={"format": "pt"})
    cfg = Nvfp4VllmConfig.from_config(json.loads((d / "config.json").read_text())["quantization_config"])
    with pytest.raises(ValueError, match=rf"{f.name}: tensor '{name}': weight_global_scale must be finite and > 0"):
        cfg.maybe_update_config(str(d))
