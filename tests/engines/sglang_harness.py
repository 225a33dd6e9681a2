"""Build real SGLang 0.5.17 layers on a CPU machine, and the checkpoint tensors to load into them.

SGLang layers read their topology from ``get_parallel()`` and the published ``ServerArgs``; their
forwards call into the TP group. ``start()`` publishes the server args of a tiny model folder (device
cpu), sets up a 1-process gloo group and registers the plugin; ``simulated_tp`` then makes the
layers built inside see ``size`` ranks through SGLang's own test override of the topology.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import json
import logging
import os
import shutil
import sys
import tempfile
import types

import torch


os.environ.setdefault("SGLANG_LOGGING_LEVEL", "WARNING")

from .ckpt_helpers import CT, MODELOPT  # noqa: E402
FORMATS = [("modelopt", MODELOPT), ("compressed-tensors", CT)]

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
              "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 1000, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}

_STARTED = False


def start():
    """Server args + distributed state + plugin registration, once per process."""
    global _STARTED
    if _STARTED:
        return
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs

    d = tempfile.mkdtemp(prefix="nvfp4_sglang_harness_")
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)
    server_args = ServerArgs(model_path=d, skip_tokenizer_init=True, device="cpu")
    get_context().set_server_args(server_args)
    initialize_moe_config(server_args)
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"file://{tempfile.mktemp()}", backend="gloo")
    initialize_model_parallel(1)
    initialize_dp_attention(server_args, ModelConfig.from_server_args(server_args))
    import nvfp4_plugin.engines.sglang as ns

    ns.register()
    logging.getLogger("nvfp4_plugin").setLevel(logging.INFO)
    _STARTED = True


@contextlib.contextmanager
def simulated_tp(size: int, rank: int, ep_size: int = 1):
    """Layers built inside see ``size`` TP ranks and are rank ``rank``; MoE layers split their
    experts over ``ep_size`` of them and their intermediate size over the rest (SGLang's rule:
    moe_tp_size = tp_size / moe_ep_size)."""
    from sglang.srt.runtime_context import get_parallel

    moe_tp = size // ep_size
    with get_parallel().override(tp_size=size, tp_rank=rank, attn_tp_size=size, attn_tp_rank=rank,
                                 moe_ep_size=ep_size, moe_ep_rank=rank // moe_tp, moe_tp_size=moe_tp,
                                 moe_tp_rank=rank % moe_tp):
        yield


_COUNTER = iter(range(10**9))


def unique_layer(base: str = "mlp.experts") -> str:
    return f"model.layers.{next(_COUNTER)}.{base}"


# ------------------------------------------------------------------------------------------------
# Checkpoint tensors and the reference they must reproduce
# ------------------------------------------------------------------------------------------------

from .ckpt_helpers import (canonical, checkpoint_tensors, dense_reference, dequantized, error_bound,  # noqa: E402,F401
                           expert_checkpoint, input_encode_scale, load_linear, module_tensors)


def load_experts(moe, ckpt, ckpt_names=("gate_proj", "up_proj", "down_proj")):
    """Load ``[(f"{e}.{proj}.{suffix}", tensor)]`` through FusedMoE's weight loader with the expert
    mapping the SGLang model files use (``experts.{e}.{proj}.`` -> ``experts.w13_`` / ``experts.w2_``)."""
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

    num_experts = 1 + max(int(k.split(".")[0]) for k, _ in ckpt)
    mapping = FusedMoE.make_expert_params_mapping(*ckpt_names[0:1], ckpt_names[2], ckpt_names[1],
                                                  num_experts=num_experts)
    params = dict(moe.named_parameters(prefix="experts"))
    loaded = set()
    for key, tensor in ckpt:
        name = "experts." + key
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name in name:
                mapped = name.replace(weight_name, param_name)
                param = params[mapped]
                param.weight_loader(param, tensor, mapped, shard_id=shard_id, expert_id=expert_id)
                loaded.add(mapped)
                break
        else:
            raise KeyError(f"{name}: no expert mapping")
    moe.quant_method.process_weights_after_loading(moe)
    return loaded


def topk_output(topk_weights, topk_ids):
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    return StandardTopKOutput(topk_weights=topk_weights, topk_ids=topk_ids, router_logits=None)


# ------------------------------------------------------------------------------------------------
# Real checkpoints: `nvfp4-plugin make-model` + `nvfp4-plugin quantize`, and SGLang's model loader
# ------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def quantized_checkpoint(arch: str, fmt: str) -> str:
    """A tiny random ``arch`` model quantized by our quantizer into ``fmt`` (built once per session)."""
    from nvfp4_plugin.checkpoints import make_model, quantize_checkpoint

    root = _checkpoint_root()
    src, dst = os.path.join(root, f"{arch}_src"), os.path.join(root, f"{arch}_{fmt}")
    if not os.path.exists(os.path.join(src, "config.json")):
        make_model(src, arch=arch, size="tiny", seed=3, device="cpu")
    # per-shard global scales: q/k/v and gate/up shards keep their own scale, which only an exact
    # loader gets right; a short calibration keeps the W4A4 input scales real and the test fast
    quantize_checkpoint(src, dst, format=fmt, device="cpu", per_shard_global_scales=True, calib_samples=2,
                        calib_seq_len=64, calib_batch_size=2, progress=False)
    return dst


@functools.lru_cache(maxsize=None)
def _checkpoint_root() -> str:
    root = tempfile.mkdtemp(prefix="nvfp4_sglang_ckpt_")
    # removed when the test process exits: CI shares its disk with whatever else the machine holds
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@contextlib.contextmanager
def _cpu_rotary_stub():
    """SGLang's RotaryEmbedding binds a vLLM CUDA op on non-CUDA, non-CPU-engine platforms when it is
    built; the tests never run attention, so a stub that refuses to run is enough to build models."""
    try:
        importlib.import_module("vllm._custom_ops")
    except ImportError:
        pass
    else:
        yield
        return

    def rotary_embedding(*args, **kwargs):
        raise RuntimeError("rotary embedding stub: attention does not run in these CPU tests")

    pkg, ops = types.ModuleType("vllm"), types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding, pkg._custom_ops = rotary_embedding, ops
    saved = {k: sys.modules.get(k) for k in ("vllm", "vllm._custom_ops")}
    sys.modules.update({"vllm": pkg, "vllm._custom_ops": ops})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def load_model(path: str, quantization: str | None = "nvfp4"):
    """What a scheduler does: ModelConfig from server args, SGLang's model loader, weights loaded
    and processed (on the CPU). Returns (model, model_config)."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import get_model_loader
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=path, quantization=quantization, skip_tokenizer_init=True, device="cpu")
    model_config = ModelConfig.from_server_args(server_args)
    default_dtype = torch.get_default_dtype()
    try:
        with _cpu_rotary_stub():
            loader = get_model_loader(LoadConfig(), model_config)
            model = loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))
    finally:
        torch.set_default_dtype(default_dtype)  # SGLang's set_default_torch_dtype does not restore it on errors
    return model, model_config
