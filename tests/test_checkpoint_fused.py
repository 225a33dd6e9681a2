"""Fused shards with different global scales, MoE stacking, model-family naming, engine-facing API."""

import pytest
import torch

from nvfp4_plugin.checkpoints import (CheckpointError, check_checkpoint_tensor, normalize_input_scale,
                                      normalize_linear, open_checkpoint, parse_quant_config, to_checkpoint_tensors)
from nvfp4_plugin.weights import Nvfp4Weight

from .test_checkpoint_support import (CT, MODELOPT, fixed_point_gs, module_tensors, quant_config, rand_weight,
                                      write_checkpoint)

ATT = "model.layers.0.self_attn"


def _ref_dequant(w, gs):
    return Nvfp4Weight.quantize(w, global_scale=gs).dequantize()


def _qkv():
    # Deliberately different magnitudes, so each shard has its own global scale.
    return {"q": rand_weight(64, 64, 1, 0.02), "k": rand_weight(32, 64, 2, 0.5), "v": rand_weight(32, 64, 3, 0.001)}


@pytest.mark.parametrize("fmt", [MODELOPT, CT])
def test_fused_qkv_with_different_global_scales_is_exact(tmp_path, fmt):
    ws = _qkv()
    gss = {s: fixed_point_gs(w.float().abs().amax()) for s, w in ws.items()}
    assert len({g.item() for g in gss.values()}) == 3
    tensors = {}
    for s, w in ws.items():
        tensors.update(module_tensors(f"{ATT}.{s}_proj", w, fmt, gs=gss[s], input_gs=fixed_point_gs(2.0)))
    d = write_checkpoint(tmp_path, tensors, fmt, exclude=["lm_head"])
    with open_checkpoint(d) as ck:
        fused = ck.load_fused([f"{ATT}.{s}_proj" for s in "qkv"])
    expected = torch.cat([_ref_dequant(ws[s], gss[s]) for s in "qkv"])
    assert torch.equal(fused.weight.dequantize(), expected)
    assert torch.equal(fused.weight.global_scale, torch.cat([gss[s].expand(ws[s].shape[0]) for s in "qkv"]))
    # What the engines' built-in loaders do (one scale: the max decode = the min encode) is not exact.
    single = Nvfp4Weight(fused.weight.packed, fused.weight.block_scale,
                         fused.weight.global_scale.min().expand(128).contiguous())
    assert not torch.equal(single.dequantize(), expected)

    # Engine path: the shards arrive stacked in one parameter plus one stored scale per shard.
    names = [f"{ATT}.{s}_proj" for s in "qkv"]
    spec = parse_quant_config(quant_config(fmt)[1]).spec
    packed = torch.cat([tensors[f"{n}.{spec.suffix('weight')}"] for n in names])
    block = torch.cat([tensors[f"{n}.weight_scale"] for n in names])
    stored = torch.stack([tensors[f"{n}.{spec.suffix('global_scale')}"].reshape(()) for n in names])
    w = normalize_linear(packed, block, stored, format=fmt, shard_sizes=[64, 32, 32], name=f"{ATT}.qkv_proj")
    assert torch.equal(w.dequantize(), expected)
    inp = torch.stack([tensors[f"{n}.{spec.suffix('input_scale')}"].reshape(()) for n in names])
    assert torch.equal(normalize_input_scale(inp, format=fmt, num_shards=3), fixed_point_gs(2.0))


def test_input_scale_of_fused_shards_is_the_safest():
    # Different activation scales per shard (foreign checkpoints): keep the largest amax (smallest encode).
    dec = torch.tensor([1 / 2688, 4 / 2688, 2 / 2688], dtype=torch.float32)  # ModelOpt stores amax/2688
    enc = normalize_input_scale(dec, format=MODELOPT, num_shards=3)
    assert torch.equal(enc, torch.ones(()) / dec[1])
    ct = torch.tensor([[100.0, 50.0], [10.0, 20.0]])  # [E, 2] encode scales, per expert
    assert torch.equal(normalize_input_scale(ct, format=CT, num_shards=2), torch.tensor([50.0, 10.0]))
    with pytest.raises(CheckpointError, match="finite and > 0"):
        normalize_input_scale(torch.tensor([1.0, 0.0]), format=CT, num_shards=2)


@pytest.mark.parametrize("fmt", [MODELOPT, CT])
def test_stacked_experts_with_per_shard_scales(fmt):
    e, i, h = 3, 32, 64
    ws = {(x, r): rand_weight(*((h, i) if r == "down" else (i, h)), seed=10 * x + len(r),
                              scale=0.01 * (x + 1) * (2 if r == "up" else 1))
          for x in range(e) for r in ("gate", "up", "down")}
    gss = {key: fixed_point_gs(w.float().abs().amax()) for key, w in ws.items()}
    spec = parse_quant_config(quant_config(fmt)[1]).spec
    tens = {key: module_tensors("m", w, fmt, gs=gss[key]) for key, w in ws.items()}

    def stored(key):
        return tens[key][f"m.{spec.suffix('global_scale')}"].reshape(())

    def both(x, suffix):
        return torch.cat([tens[(x, "gate")]["m." + suffix], tens[(x, "up")]["m." + suffix]])

    packed = torch.stack([both(x, spec.suffix("weight")) for x in range(e)])
    block = torch.stack([both(x, "weight_scale") for x in range(e)])
    gs = torch.stack([torch.stack([stored((x, "gate")), stored((x, "up"))]) for x in range(e)])  # [E, 2]
    w13 = normalize_linear(packed, block, gs, format=fmt, shard_sizes=[i, i], name="w13")
    assert w13.packed.shape == (e, 2 * i, h // 2) and w13.global_scale.shape == (e, 2 * i)
    expected = torch.stack([torch.cat([_ref_dequant(ws[(x, "gate")], gss[(x, "gate")]),
                                       _ref_dequant(ws[(x, "up")], gss[(x, "up")])]) for x in range(e)])
    assert torch.equal(w13.dequantize(), expected)
    with pytest.raises(CheckpointError, match="one value per shard"):
        normalize_linear(packed, block, gs[:, :1].repeat(1, 3), format=fmt, shard_sizes=[i, i])


def test_normalize_linear_rejects_bad_inputs():
    w = Nvfp4Weight.quantize(rand_weight(32, 64, 0))
    with pytest.raises(CheckpointError, match="dtype: expected float8_e4m3fn"):
        normalize_linear(w.packed, w.block_scale.view(torch.uint8), torch.tensor(1.0), format=CT)
    with pytest.raises(CheckpointError, match="expected \\[..., N, K/16\\] = \\[32, 4\\]"):
        normalize_linear(w.packed, w.block_scale[:, :2], torch.tensor(1.0), format=CT)
    with pytest.raises(CheckpointError, match="shard sizes \\[16, 8\\] sum to 24"):
        normalize_linear(w.packed, w.block_scale, torch.ones(2), format=CT, shard_sizes=[16, 8])
    with pytest.raises(CheckpointError, match="weight_scale_2 must be finite and > 0"):
        normalize_linear(w.packed, w.block_scale, torch.tensor(float("nan")), format=MODELOPT)
    neg = w.block_scale.view(torch.uint8).clone()
    neg[3, 1] = 0xC0
    with pytest.raises(CheckpointError, match="negative \\(first at index \\[3, 1\\]"):
        normalize_linear(w.packed, neg.view(torch.float8_e4m3fn), torch.tensor(1.0), format=CT)


def test_check_checkpoint_tensor():
    cfg = parse_quant_config(quant_config(MODELOPT, "NVFP4", ["lm_head"])[0])
    check_checkpoint_tensor("model.layers.0.mlp.down_proj.weight", torch.zeros(4, 8, dtype=torch.uint8), cfg)
    check_checkpoint_tensor("lm_head.weight", torch.zeros(4, 8, dtype=torch.bfloat16), cfg)  # excluded
    check_checkpoint_tensor("model.norm.weight", torch.ones(8), cfg)
    bad = [("model.layers.0.mlp.down_proj.weight", torch.zeros(4, 16, dtype=torch.bfloat16), "expected uint8"),
           ("model.layers.0.mlp.down_proj.weight_scale", torch.zeros(4, 1, dtype=torch.uint8), "float8_e4m3fn"),
           ("model.layers.0.mlp.down_proj.weight_scale_2", torch.tensor([0.0]), "finite and > 0"),
           ("model.layers.0.mlp.down_proj.weight_scale_2", torch.ones(4), "per-tensor scalar"),
           ("model.layers.0.mlp.down_proj.input_scale", torch.tensor(1.0, dtype=torch.float16), "expected float32"),
           ("model.layers.0.mlp.down_proj.weight_global_scale", torch.tensor([1.0]), "compressed-tensors tensor name"),
           ("model.layers.0.mlp.down_proj.pre_quant_scale", torch.ones(4), "does not support"),
           ("lm_head.weight", torch.zeros(4, 8, dtype=torch.uint8), "config excludes the module")]
    for name, t, needle in bad:
        with pytest.raises(CheckpointError, match=needle) as e:
            check_checkpoint_tensor(name, t, cfg, file="model-00001-of-00002.safetensors")
        assert name in str(e.value) and "model-00001-of-00002.safetensors" in str(e.value)


@pytest.mark.parametrize("fmt", [MODELOPT, CT])
def test_deepseek_v3_naming(tmp_path, fmt):
    h, r = 64, 32
    mods = {f"{p}.{m}": s for p, ms in {
        "model.layers.0.self_attn": {"q_a_proj": (r, h), "kv_a_proj_with_mqa": (r + 16, h), "q_b_proj": (64, r),
                                     "kv_b_proj": (64, r), "o_proj": (h, 64)},
        "model.layers.0.mlp": {"gate_proj": (64, h), "up_proj": (64, h), "down_proj": (h, 64)},
        "model.layers.1.mlp.shared_experts": {"gate_proj": (32, h), "up_proj": (32, h), "down_proj": (h, 32)},
        **{f"model.layers.1.mlp.experts.{e}": {"gate_proj": (32, h), "up_proj": (32, h), "down_proj": (h, 32)}
           for e in range(3)}}.items() for m, s in ms.items()}
    ws, tensors = {}, {}
    for i, (m, (n, k)) in enumerate(sorted(mods.items())):
        ws[m] = rand_weight(n, k, i, 0.01 + 0.003 * i)
        tensors.update(module_tensors(m, ws[m], fmt, input_gs=fixed_point_gs(1.0 + i)))
    tensors["model.layers.1.mlp.gate.weight"] = rand_weight(3, h, 99)
    tensors["model.layers.1.mlp.gate.e_score_correction_bias"] = torch.zeros(3)
    tensors["model.layers.0.self_attn.q_a_layernorm.weight"] = torch.ones(r, dtype=torch.bfloat16)
    d = write_checkpoint(tmp_path, tensors, fmt, exclude=["lm_head", "model.layers.1.mlp.gate"],
                         model_type="deepseek_v3")
    with open_checkpoint(d) as ck:
        assert list(ck.moe_layers) == ["model.layers.1.mlp.experts"]
        assert ck.moe_layers["model.layers.1.mlp.experts"].num_experts == 3
        assert "model.layers.1.mlp.shared_experts.gate_proj" in ck.linears
        router = {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"}
        assert router <= set(ck.passthrough)
        ex = ck.load_experts("model.layers.1.mlp.experts")
        assert ex.w13.packed.shape == (3, 64, 32) and ex.w2.packed.shape == (3, 64, 16)
        for e in range(3):
            p = f"model.layers.1.mlp.experts.{e}"
            gate, up = (_ref_dequant(ws[f"{p}.{x}_proj"], fixed_point_gs(ws[f"{p}.{x}_proj"].float().abs().amax()))
                        for x in ("gate", "up"))
            assert torch.equal(ex.w13.dequantize()[e], torch.cat([gate, up]))  # gate rows first
        # per expert: gate and up share an input; keep the smaller encode scale
        idx = {m: i for i, m in enumerate(sorted(mods))}
        e0 = [fixed_point_gs(1.0 + idx[f"model.layers.1.mlp.experts.0.{x}_proj"]) for x in ("gate", "up")]
        assert torch.equal(ex.w13_input_scale[0], torch.minimum(*e0))
        qa = ck.load_fused(["model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa"])
        assert qa.weight.n == r + r + 16


def test_mixtral_naming(tmp_path):
    h, i = 64, 32
    ws, tensors = {}, {}
    for e in range(2):
        for j, (proj, shape) in enumerate((("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i)))):
            m = f"model.layers.0.block_sparse_moe.experts.{e}.{proj}"
            ws[m] = rand_weight(*shape, seed=10 * e + j, scale=0.01 * (j + 1))
            tensors.update(module_tensors(m, ws[m], MODELOPT, input_gs=fixed_point_gs(3.0)))
    tensors["model.layers.0.block_sparse_moe.gate.weight"] = rand_weight(2, h, 5)
    d = write_checkpoint(tmp_path, tensors, MODELOPT, exclude=["lm_head", "model.layers.0.block_sparse_moe.gate"],
                         model_type="mixtral")
    with open_checkpoint(d) as ck:
        ex = ck.load_experts("model.layers.0.block_sparse_moe.experts")
    for e in range(2):
        p = f"model.layers.0.block_sparse_moe.experts.{e}"
        exp = [_ref_dequant(ws[f"{p}.{x}"], fixed_point_gs(ws[f"{p}.{x}"].float().abs().amax()))
               for x in ("w1", "w3", "w2")]
        assert torch.equal(ex.w13.dequantize()[e], torch.cat(exp[:2]))
        assert torch.equal(ex.w2.dequantize()[e], exp[2])


def test_foreign_modelopt_scale_loads_within_one_ulp(tmp_path):
    # ModelOpt exports weight_scale_2 = amax / 2688, not a round-trip fixed point: fp32(1/ws2) may be
    # 1 ulp from 2688/amax. That is inherent to the format, so it loads without complaint.
    w = rand_weight(32, 64, 7)
    amax = w.float().abs().amax()
    ws2 = amax / torch.tensor(2688.0)
    gs = torch.ones(()) / ws2
    t = module_tensors("model.layers.0.mlp.down_proj", w, MODELOPT, gs=gs, input_gs=fixed_point_gs(1.0))
    t["model.layers.0.mlp.down_proj.weight_scale_2"] = ws2.reshape(())
    d = write_checkpoint(tmp_path, t, MODELOPT)
    with open_checkpoint(d) as ck:
        got = ck.load_linear("model.layers.0.mlp.down_proj")
    naive = torch.tensor(2688.0) / amax
    assert (got.weight.global_scale[0] - naive).abs() <= (torch.nextafter(naive, torch.tensor(1e30)) - naive)


def test_to_checkpoint_tensors_round_trip():
    w = Nvfp4Weight.quantize(rand_weight(32, 64, 3))
    for fmt in (MODELOPT, CT):
        t = to_checkpoint_tensors("x", w, fixed_point_gs(5.0), format=fmt)
        spec = parse_quant_config(quant_config(fmt)[1]).spec
        back = normalize_linear(t["x." + spec.suffix("weight")], t["x.weight_scale"],
                                t["x." + spec.suffix("global_scale")], format=fmt)
        assert torch.equal(back.packed, w.packed) and torch.equal(back.global_scale, w.global_scale)
    with pytest.raises(ValueError, match="one global scale"):
        to_checkpoint_tensors("x", Nvfp4Weight(w.packed, w.block_scale, torch.arange(1, 33, dtype=torch.float32)),
                              format=CT)
