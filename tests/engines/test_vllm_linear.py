"""The nvfp4 linear method inside real vLLM 0.26 linear layers (CPU platform), with simulated TP=2.

Runs where vLLM is installed (CI: make test-vllm, in .venv-engines, where its absence fails); skipped elsewhere.
"""

import pytest
import torch

from tests._require import require

vllm = require("vllm")

from nvfp4_plugin import reference as ref  # noqa: E402

from .ckpt_helpers import (CT, MODELOPT, assert_bad_gate_up_tensors_are_named, canonical,  # noqa: E402,F401
                           checkpoint_tensors, dense_reference, error_bound, load_linear)
from .vllm_harness import simulated_tp, start  # noqa: E402

start()

from vllm.model_executor.layers.linear import (  # noqa: E402
    MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear)

from nvfp4_plugin.engines.vllm.config import Nvfp4VllmConfig  # noqa: E402
from nvfp4_plugin.engines.vllm.linear import Nvfp4VllmLinearMethod  # noqa: E402



load = load_linear
bound = error_bound


@pytest.mark.parametrize("fmt,cfg", [("modelopt", MODELOPT), ("compressed-tensors", CT)])
@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_tp_shards_give_the_reference(fmt, cfg, tp, monkeypatch):
    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", "w4a16")
    g = torch.Generator().manual_seed(0)
    hidden, heads, kv_heads, head_dim = 128, 4, 2, 32
    ws = {"q": torch.randn(heads * head_dim, hidden, generator=g),
          "k": torch.randn(kv_heads * head_dim, hidden, generator=g) * 20,   # deliberately different
          "v": torch.randn(kv_heads * head_dim, hidden, generator=g) * 0.05}  # global scales per shard
    ckpt = {k: checkpoint_tensors(fmt, w, 4.0) for k, w in ws.items()}
    x = torch.randn(3, hidden, generator=g).to(torch.bfloat16)
    quant_config = Nvfp4VllmConfig.from_config(cfg)
    parts = []
    for rank in range(tp):
        with simulated_tp(tp, rank):
            layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=False, quant_config=quant_config,
                                      prefix="model.layers.0.self_attn.qkv_proj", params_dtype=torch.bfloat16)
            assert isinstance(layer.quant_method, Nvfp4VllmLinearMethod)
            load(layer, [(k, ckpt[k]) for k in "qkv"])
            assert layer.nvfp4_core.backend.name == "reference"
            out, _ = layer(x)
        parts.append(out)
    # per rank the output is [q_r, k_r, v_r]; reassemble full q, k, v
    nq, nk = heads * head_dim // tp, kv_heads * head_dim // tp
    q = torch.cat([p[:, :nq] for p in parts], -1)
    k = torch.cat([p[:, nq:nq + nk] for p in parts], -1)
    v = torch.cat([p[:, nq + nk:] for p in parts], -1)
    got = torch.cat([q, k, v], -1)
    expect = dense_reference(fmt, [ckpt[s] for s in "qkv"], x, "w4a16")
    deq = [ref.dequantize_fp4(*canonical(fmt, ckpt[s])[:2], canonical(fmt, ckpt[s])[2], swizzled=False,
                              m=ws[s].shape[0], k=hidden) for s in "qkv"]
    assert ((got.double() - expect.double()).abs() <= bound(x, deq) + 1e-6).all()


@pytest.mark.parametrize("fmt,cfg", [("modelopt", MODELOPT), ("compressed-tensors", CT)])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_gate_up_and_row_parallel_down_tp2(fmt, cfg, mode, monkeypatch):
    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", mode)
    g = torch.Generator().manual_seed(1)
    hidden, inter, tp = 128, 96, 2
    gate, up = torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g) * 3
    down = torch.randn(hidden, inter, generator=g)
    ck_gate, ck_up, ck_down = (checkpoint_tensors(fmt, w, 3.0) for w in (gate, up, down))
    x = torch.randn(4, hidden, generator=g).to(torch.bfloat16)
    quant_config = Nvfp4VllmConfig.from_config(cfg)
    gu_parts, down_sum = [], 0
    xi = torch.randn(4, inter, generator=g).to(torch.bfloat16)
    for rank in range(tp):
        with simulated_tp(tp, rank):
            gu = MergedColumnParallelLinear(hidden, [inter, inter], bias=False, quant_config=quant_config,
                                            prefix="model.layers.0.mlp.gate_up_proj", params_dtype=torch.bfloat16)
            load(gu, [(0, ck_gate), (1, ck_up)])
            gu_parts.append(gu(x)[0])
            dn = RowParallelLinear(inter, hidden, bias=False, quant_config=quant_config, input_is_parallel=True,
                                   prefix="model.layers.0.mlp.down_proj", params_dtype=torch.bfloat16)
            load(dn, [(None, ck_down)])
            shard = inter // tp
            down_sum = down_sum + dn(xi[:, rank * shard:(rank + 1) * shard])[0].double()
    half = inter // tp
    got_gate = torch.cat([p[:, :half] for p in gu_parts], -1)
    got_up = torch.cat([p[:, half:] for p in gu_parts], -1)
    exp_gu = dense_reference(fmt, [ck_gate, ck_up], x, mode)
    err = (torch.cat([got_gate, got_up], -1).double() - exp_gu.double()).norm() / exp_gu.double().norm()
    assert err < (5e-3 if mode == "w4a16" else 3e-2)
    exp_down = dense_reference(fmt, [ck_down], xi, mode).double()
    # w4a4 + row parallel: each rank quantizes its own activation slice with the same global scale,
    # and 16-element blocks never straddle the split (inter/tp is a multiple of 16)
    assert (down_sum - exp_down).norm() / exp_down.norm() < (5e-3 if mode == "w4a16" else 3e-2)


def test_excluded_layers_stay_unquantized():
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    cfg = Nvfp4VllmConfig.from_config({**MODELOPT, "ignore": ["model.layers.0.self_attn*"]})
    layer = QKVParallelLinear(64, 16, 4, 4, bias=False, quant_config=cfg, prefix="model.layers.0.self_attn.qkv_proj",
                              params_dtype=torch.bfloat16)
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)


def test_corrupt_global_scale_names_the_tensor():
    cfg = Nvfp4VllmConfig.from_config(MODELOPT)
    layer = RowParallelLinear(64, 32, bias=False, quant_config=cfg, prefix="model.layers.3.mlp.down_proj",
                              params_dtype=torch.bfloat16)
    t = checkpoint_tensors("modelopt", torch.randn(32, 64), 2.0)
    t["weight_scale_2"] = torch.tensor(float("inf"))
    with pytest.raises(ValueError, match=r"tensor 'model.layers.3.mlp.down_proj.weight_scale_2': weight_scale_2 must be finite and > 0, got inf"):
        load(layer, [(None, t)])


def test_wrong_dtype_and_missing_tensor_name_the_tensor():
    cfg = Nvfp4VllmConfig.from_config(MODELOPT)
    assert_bad_gate_up_tensors_are_named(
        lambda: MergedColumnParallelLinear(64, [32, 32], bias=False, quant_config=cfg,
                                           prefix="model.layers.1.mlp.gate_up_proj", params_dtype=torch.bfloat16),
        "vLLM")


def test_exclusions_keep_the_checkpoint_names_through_the_mapper():
    from vllm.model_executor.models.utils import WeightsMapper

    cfg = Nvfp4VllmConfig.from_config({**MODELOPT, "ignore": ["lm_head", "language_model.model.layers.0.*"]})
    cfg.apply_vllm_mapper(WeightsMapper(orig_to_new_prefix={"language_model.model.": "model.language_model."}))
    assert cfg.spec.exclude_modules == ("lm_head", "language_model.model.layers.0.*", "model.language_model.layers.0.*")
    assert cfg.is_layer_excluded("model.language_model.layers.0.mlp.down_proj")
    assert not cfg.is_layer_excluded("model.language_model.layers.1.mlp.down_proj")
