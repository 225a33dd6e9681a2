"""The nvfp4 linear method inside real SGLang 0.5.17 linear layers (on the CPU), with simulated TP=2.

Runs where SGLang is installed (CI: make test-sglang, in .venv-engines, where its absence fails); skipped elsewhere.
"""

import pytest
import torch

from tests._require import require

sglang = require("sglang")

from .ckpt_helpers import assert_bad_gate_up_tensors_are_named  # noqa: E402
from .sglang_harness import (FORMATS, MODELOPT, checkpoint_tensors, dense_reference, dequantized,  # noqa: E402
                             error_bound, load_linear, simulated_tp, start)

start()

from sglang.srt.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,  # noqa: E402
                                      ReplicatedLinear, RowParallelLinear)
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod  # noqa: E402

from nvfp4_plugin.engines import common as engines_common  # noqa: E402
from nvfp4_plugin.engines.sglang.config import Nvfp4SglangConfig  # noqa: E402
from nvfp4_plugin.engines.sglang.linear import Nvfp4SglangLinearMethod  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 128, 4, 2, 32


def qkv_case(fmt, seed=0):
    g = torch.Generator().manual_seed(seed)
    ws = {"q": torch.randn(HEADS * HEAD_DIM, HIDDEN, generator=g),
          "k": torch.randn(KV_HEADS * HEAD_DIM, HIDDEN, generator=g) * 20,   # deliberately different
          "v": torch.randn(KV_HEADS * HEAD_DIM, HIDDEN, generator=g) * 0.05}  # global scales per shard
    ckpt = {k: checkpoint_tensors(fmt, w, amax) for (k, w), amax in zip(ws.items(), (4.0, 3.0, 6.0))}
    x = torch.randn(3, HIDDEN, generator=g).to(torch.bfloat16)
    return ckpt, x


def run_qkv(fmt, cfg, tp, ckpt, x):
    """q/k/v through QKVParallelLinear on ``tp`` simulated ranks, reassembled to the full [q, k, v]."""
    quant_config = Nvfp4SglangConfig.from_config(cfg)
    parts = []
    for rank in range(tp):
        with simulated_tp(tp, rank):
            layer = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=False, quant_config=quant_config,
                                      prefix="model.layers.0.self_attn.qkv_proj", params_dtype=torch.bfloat16)
            assert isinstance(layer.quant_method, Nvfp4SglangLinearMethod)
            load_linear(layer, [(s, ckpt[s]) for s in "qkv"])
            assert layer.nvfp4_core.backend.name == "reference"
            assert not hasattr(layer, "weight_scale"), "checkpoint-format parameters must be released"
            parts.append(layer(x)[0])
    nq, nk = HEADS * HEAD_DIM // tp, KV_HEADS * HEAD_DIM // tp
    return torch.cat([torch.cat([p[:, :nq] for p in parts], -1), torch.cat([p[:, nq:nq + nk] for p in parts], -1),
                      torch.cat([p[:, nq + nk:] for p in parts], -1)], -1)


@pytest.mark.parametrize("fmt,cfg", FORMATS)
@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_tp_shards_give_the_reference(fmt, cfg, tp, monkeypatch):
    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", "w4a16")
    ckpt, x = qkv_case(fmt)
    got = run_qkv(fmt, cfg, tp, ckpt, x)
    expect = dense_reference(fmt, [ckpt[s] for s in "qkv"], x, "w4a16")
    bound = error_bound(x, [dequantized(fmt, ckpt[s]) for s in "qkv"])
    assert ((got.double() - expect.double()).abs() <= bound).all()


@pytest.mark.parametrize("fmt,cfg", FORMATS)
def test_max_of_shard_scales_would_fail_these_tests(fmt, cfg, monkeypatch):
    """Mutation check: SGLang's and vLLM's built-in loaders use one global scale per fused layer (the
    max over the shards). Loading that way must break the bound the QKV test asserts."""
    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", "w4a16")
    real_build = engines_common.build_weight

    def build_with_max_of_shards(prefix, fmt_, packed, block_scale, shard_globals, sizes):
        return real_build(prefix, fmt_, packed, block_scale, shard_globals.max().expand(len(sizes)).clone(), sizes)

    monkeypatch.setattr(engines_common, "build_weight", build_with_max_of_shards)
    ckpt, x = qkv_case(fmt)
    got = run_qkv(fmt, cfg, 2, ckpt, x)
    expect = dense_reference(fmt, [ckpt[s] for s in "qkv"], x, "w4a16")
    bound = error_bound(x, [dequantized(fmt, ckpt[s]) for s in "qkv"])
    assert not ((got.double() - expect.double()).abs() <= bound).all()


@pytest.mark.parametrize("fmt,cfg", FORMATS)
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_gate_up_and_row_parallel_down_tp2(fmt, cfg, mode, monkeypatch):
    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", mode)
    g = torch.Generator().manual_seed(1)
    hidden, inter, tp = 128, 96, 2
    gate, up = torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g) * 3
    down = torch.randn(hidden, inter, generator=g)
    # gate and up calibrated with different activation ranges: the fused layer takes the safe (smaller) one
    ck_gate, ck_up, ck_down = (checkpoint_tensors(fmt, w, a) for w, a in ((gate, 3.0), (up, 4.5), (down, 3.0)))
    x = torch.randn(4, hidden, generator=g).to(torch.bfloat16)
    xi = torch.randn(4, inter, generator=g).to(torch.bfloat16)
    quant_config = Nvfp4SglangConfig.from_config(cfg)
    gu_parts, down_sum = [], 0
    for rank in range(tp):
        with simulated_tp(tp, rank):
            gu = MergedColumnParallelLinear(hidden, [inter, inter], bias=False, quant_config=quant_config,
                                            prefix="model.layers.0.mlp.gate_up_proj", params_dtype=torch.bfloat16)
            load_linear(gu, [(0, ck_gate), (1, ck_up)])
            assert gu.nvfp4_core.mode == mode
            gu_parts.append(gu(x)[0])
            dn = RowParallelLinear(inter, hidden, bias=False, quant_config=quant_config, input_is_parallel=True,
                                   prefix="model.layers.0.mlp.down_proj", params_dtype=torch.bfloat16)
            load_linear(dn, [(None, ck_down)])
            shard = inter // tp
            down_sum = down_sum + dn(xi[:, rank * shard:(rank + 1) * shard])[0].double()  # all-reduce
    half = inter // tp
    got_gu = torch.cat([torch.cat([p[:, :half] for p in gu_parts], -1), torch.cat([p[:, half:] for p in gu_parts], -1)],
                       -1)
    exp_gu = dense_reference(fmt, [ck_gate, ck_up], x, mode)
    err = (got_gu.double() - exp_gu.double()).norm() / exp_gu.double().norm()
    assert err < (5e-3 if mode == "w4a16" else 3e-2)
    exp_down = dense_reference(fmt, [ck_down], xi, mode).double()
    # w4a4 + row parallel: each rank quantizes its own activation slice with the same global scale,
    # and 16-element blocks never straddle the split (inter/tp is a multiple of 16)
    assert (down_sum - exp_down).norm() / exp_down.norm() < (5e-3 if mode == "w4a16" else 3e-2)


def test_w4a4_uses_the_smallest_shard_input_scale(monkeypatch):
    """Fused shards with different activation scales share one input: the smallest encode scale
    (largest amax) is the one that never saturates; taking another one would clip."""
    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", "w4a4")
    g = torch.Generator().manual_seed(5)
    ck = [checkpoint_tensors("modelopt", torch.randn(32, 64, generator=g), a) for a in (1.0, 8.0)]
    x = (torch.randn(5, 64, generator=g) * 3).to(torch.bfloat16)
    layer = MergedColumnParallelLinear(64, [32, 32], bias=False, quant_config=Nvfp4SglangConfig.from_config(MODELOPT),
                                       prefix="model.layers.0.mlp.gate_up_proj", params_dtype=torch.bfloat16,
                                       tp_rank=0, tp_size=1)
    load_linear(layer, [(0, ck[0]), (1, ck[1])])
    assert torch.equal(layer.nvfp4_input_global_scale, torch.tensor(2688.0 / 8.0))
    got = layer(x)[0].double()
    expect = dense_reference("modelopt", ck, x, "w4a4").double()
    clipped = dense_reference("modelopt", ck, x, "w4a4", input_scale=torch.tensor(2688.0 / 1.0)).double()
    assert (got - expect).norm() / expect.norm() < 3e-2 < (clipped - expect).norm() / expect.norm()


@pytest.mark.parametrize("fmt,cfg", FORMATS)
def test_fused_in_checkpoint_and_replicated_layers(fmt, cfg, monkeypatch):
    """A checkpoint that stores gate_up_proj already fused (no shard id) and a ReplicatedLinear."""
    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", "w4a16")
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 64, generator=g)
    ck = checkpoint_tensors(fmt, w, 2.0)
    x = torch.randn(2, 64, generator=g).to(torch.bfloat16)
    quant_config = Nvfp4SglangConfig.from_config(cfg)
    fused = MergedColumnParallelLinear(64, [32, 32], bias=False, quant_config=quant_config,
                                       prefix="model.layers.0.mlp.gate_up_proj", params_dtype=torch.bfloat16,
                                       tp_rank=0, tp_size=1)
    load_linear(fused, [(None, ck)])
    rep = ReplicatedLinear(64, 64, bias=False, quant_config=quant_config, prefix="model.layers.0.self_attn.q_a_proj",
                           params_dtype=torch.bfloat16)
    load_linear(rep, [(None, ck)])
    expect = dense_reference(fmt, [ck], x, "w4a16")
    bound = error_bound(x, [dequantized(fmt, ck)])
    for layer in (fused, rep):
        assert ((layer(x)[0].double() - expect.double()).abs() <= bound).all()


def test_bias_is_added_once_per_row_parallel_group(monkeypatch):
    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", "w4a16")
    g = torch.Generator().manual_seed(3)
    ck = checkpoint_tensors("modelopt", torch.randn(32, 64, generator=g), 2.0)
    bias = torch.randn(32, generator=g).to(torch.bfloat16)
    x = torch.randn(2, 64, generator=g).to(torch.bfloat16)
    quant_config = Nvfp4SglangConfig.from_config(MODELOPT)
    total = 0
    for rank in range(2):
        with simulated_tp(2, rank):
            layer = RowParallelLinear(64, 32, bias=True, quant_config=quant_config, prefix="model.layers.0.o_proj",
                                      params_dtype=torch.bfloat16)
            layer.bias.weight_loader(layer.bias, bias)
            load_linear(layer, [(None, ck)])
            total = total + layer(x[:, rank * 32:(rank + 1) * 32])[0].double()
    expect = dense_reference("modelopt", [ck], x, "w4a16").double() + bias.double()
    assert (total - expect).norm() / expect.norm() < 5e-3


def test_excluded_layers_stay_unquantized():
    cfg = Nvfp4SglangConfig.from_config({**MODELOPT, "ignore": ["model.layers.0.self_attn.k_proj"]})
    # one shard excluded but not the others: no engine can load that, say so
    with pytest.raises(ValueError, match="exclude list covers only some shards of a fused layer"):
        QKVParallelLinear(64, 16, 4, 4, bias=False, quant_config=cfg, prefix="model.layers.0.self_attn.qkv_proj",
                          params_dtype=torch.bfloat16, tp_rank=0, tp_size=1)
    cfg = Nvfp4SglangConfig.from_config({**MODELOPT, "ignore": ["model.layers.0.self_attn*", "lm_head"]})
    layer = QKVParallelLinear(64, 16, 4, 4, bias=False, quant_config=cfg, prefix="model.layers.0.self_attn.qkv_proj",
                              params_dtype=torch.bfloat16, tp_rank=0, tp_size=1)
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    assert layer.weight.dtype == torch.bfloat16


def test_corrupt_global_scale_names_the_tensor():
    cfg = Nvfp4SglangConfig.from_config(MODELOPT)
    layer = QKVParallelLinear(64, 16, 4, 4, bias=False, quant_config=cfg, prefix="model.layers.3.self_attn.qkv_proj",
                              params_dtype=torch.bfloat16, tp_rank=0, tp_size=1)
    t = checkpoint_tensors("modelopt", torch.randn(64, 64), 2.0)
    t["weight_scale_2"] = torch.tensor(float("inf"))
    with pytest.raises(ValueError, match=r"tensor 'model.layers.3.self_attn.k_proj.weight_scale_2': weight_scale_2 "
                                         r"must be finite and > 0, got inf"):
        load_linear(layer, [("k", t)])


def test_wrong_dtype_and_missing_tensor_name_the_tensor():
    cfg = Nvfp4SglangConfig.from_config(MODELOPT)
    assert_bad_gate_up_tensors_are_named(
        lambda: MergedColumnParallelLinear(64, [32, 32], bias=False, quant_config=cfg,
                                           prefix="model.layers.1.mlp.gate_up_proj", params_dtype=torch.bfloat16,
                                           tp_rank=0, tp_size=1),
        "SGLang")


@pytest.mark.parametrize("fmt,cfg", FORMATS)
def test_quantized_lm_head_with_vocab_padding_tp2(fmt, cfg, monkeypatch):
    """A quantized ParallelLMHead: the vocab (1000) is padded to 1024 and split over 2 ranks by SGLang's
    embedding loader; padded rows must decode to 0 and the logits path must reach our apply."""
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", "w4a16")
    g = torch.Generator().manual_seed(8)
    vocab, hidden = 1000, 64
    ck = checkpoint_tensors(fmt, torch.randn(vocab, hidden, generator=g), 2.0)
    x = torch.randn(3, hidden, generator=g).to(torch.bfloat16)
    quant_config = Nvfp4SglangConfig.from_config({**cfg, "ignore": []})
    logits = []
    for rank in range(2):
        with simulated_tp(2, rank):
            head = ParallelLMHead(vocab, hidden, params_dtype=torch.bfloat16, quant_config=quant_config,
                                  prefix="lm_head")
            assert isinstance(head.quant_method, Nvfp4SglangLinearMethod)
            load_linear(head, [(None, ck)])
            assert not hasattr(head, "weight")  # so LogitsProcessor calls quant_method.apply
            logits.append(head.quant_method.apply(head, x))
    per_rank = head.num_embeddings_per_partition
    got = torch.cat(logits, -1)
    assert got.shape == (3, 2 * per_rank) and not got[:, vocab:].any()
    expect = dense_reference(fmt, [ck], x, "w4a16")
    assert ((got[:, :vocab].double() - expect.double()).abs() <= error_bound(x, [dequantized(fmt, ck)])).all()
