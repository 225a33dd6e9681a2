"""Config detection and parsing, exclusion semantics, scale conventions, safetensors streaming I/O."""

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nvfp4_plugin.checkpoints import (CheckpointError, checkpoint_global_from_encode,
                                      compressed_tensors_quantization_config, encode_from_checkpoint_global,
                                      global_scale_from_amax_exact, is_nvfp4_config, load_quant_config,
                                      modelopt_hf_quant_config, modelopt_quantization_config, parse_quant_config,
                                      reciprocal_fixed_point)
from nvfp4_plugin.checkpoints.safetensors_io import (CheckpointFiles, SafetensorsFile, ShardedWriter, TensorSpec,
                                                     parse_size, spec_of)

from .test_checkpoint_support import CT, MODELOPT, fixed_point_gs, quant_config

# -- detection and parsing -------------------------------------------------------------------


def test_modelopt_nested_and_flat_parse_alike():
    nested, flat = quant_config(MODELOPT, "NVFP4", ["lm_head", "model.layers.*.mlp.gate"])
    a, b = parse_quant_config(nested), parse_quant_config(flat)
    for c in (a, b):
        assert (c.format, c.quant_algo, c.group_size, c.activations_quantized) == ("modelopt", "NVFP4", 16, True)
        assert c.exclude_modules == ("lm_head", "model.layers.*.mlp.gate")
    w = parse_quant_config({"quantization": {"quant_algo": "w4a16_nvfp4", "group_size": 16, "exclude_modules": [],
                                             "kv_cache_quant_algo": "FP8"}})
    assert (w.quant_algo, w.activations_quantized, w.kv_cache_quant_algo) == ("W4A16_NVFP4", False, "FP8")


def test_our_written_configs_parse_back():
    for algo in ("NVFP4", "W4A16_NVFP4"):
        ex = ["lm_head", "model.layers.0.mlp.gate"]
        for cfg, fmt in ((modelopt_hf_quant_config(algo, ex), "modelopt"),
                         (modelopt_quantization_config(algo, ex), "modelopt"),
                         (compressed_tensors_quantization_config(algo, ex), "compressed-tensors")):
            c = parse_quant_config(cfg)
            assert (c.format, c.quant_algo, set(c.exclude_modules)) == (fmt, algo, set(ex))
        q = modelopt_hf_quant_config(algo, ex)["quantization"]
        assert {"group_size", "kv_cache_quant_algo", "exclude_modules"} <= set(q)  # fields vLLM requires


def test_compressed_tensors_variants():
    _, w4a4 = quant_config(CT, "NVFP4")
    _, w4a16 = quant_config(CT, "W4A16_NVFP4")
    assert parse_quant_config(w4a4).quant_algo == "NVFP4"
    assert parse_quant_config(w4a16).quant_algo == "W4A16_NVFP4"
    preset = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
              "config_groups": {"NVFP4A16": ["Linear"]}, "ignore": ["lm_head"]}
    assert parse_quant_config(preset).quant_algo == "W4A16_NVFP4"
    mixed = json.loads(json.dumps(w4a4))
    mixed["config_groups"]["group_1"] = dict(w4a16["config_groups"]["group_0"], targets=["re:.*o_proj"])
    with pytest.raises(CheckpointError, match="mixed W4A4/W4A16"):
        parse_quant_config(mixed)
    bad = json.loads(json.dumps(w4a4))
    bad["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    bad["format"] = "float-quantized"
    with pytest.raises(CheckpointError) as e:
        parse_quant_config(bad)
    assert "weights.num_bits: expected 4, got 8" in str(e.value)
    assert "format: expected 'nvfp4-pack-quantized'" in str(e.value)


@pytest.mark.parametrize("cfg,needle", [
    ({"quant_method": "awq", "bits": 4}, "not an NVFP4 config"),
    ({"quantization": {"quant_algo": "FP8"}}, "quant_algo"),
    ({"quantization": {"group_size": 16}}, "'quant_algo' is missing"),
    ({"quantization": {"quant_algo": "NVFP4", "exclude_modules": "lm_head"}}, "exclude_modules"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": "x"}, "group_size"),
    ("not a dict", "expected a JSON object"),
])
def test_bad_configs_name_the_field(cfg, needle):
    with pytest.raises(CheckpointError, match=needle):
        parse_quant_config(cfg)
    assert not is_nvfp4_config(cfg)


def test_load_quant_config_prefers_hf_quant_config_and_checks_agreement(tmp_path):
    nested, flat = quant_config(MODELOPT, "NVFP4", ["lm_head"])
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": flat}))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(nested))
    assert load_quant_config(tmp_path).source == "hf_quant_config.json"
    flat["ignore"] = ["lm_head", "model.layers.0.self_attn.o_proj"]
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": flat}))
    with pytest.raises(CheckpointError, match="exclude_modules vs ignore"):
        load_quant_config(tmp_path)
    (tmp_path / "hf_quant_config.json").unlink()
    assert load_quant_config(tmp_path).source == "config.json:quantization_config"
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no NVFP4 quantization config"):
        load_quant_config(tmp_path)


def test_exclusion_semantics():
    mo = parse_quant_config({"quantization": {"quant_algo": "NVFP4", "exclude_modules": [
        "lm_head", "model.layers.*.mlp.gate", "model.visual*", "mlp.shared_expert_gate", "model.layers.3.self_attn"]}})
    assert mo.is_excluded("lm_head")
    assert mo.is_excluded("model.layers.7.mlp.gate")
    assert not mo.is_excluded("model.layers.7.mlp.gate_proj")            # wildcard is a full match
    assert mo.is_excluded("model.visual") and mo.is_excluded("model.visual.blocks.0.qkv")
    assert mo.is_excluded("model.layers.2.mlp.shared_expert_gate")       # legacy bare leaf path
    assert mo.is_excluded("model.layers.3.self_attn.q_proj")             # whole subtree
    assert not mo.is_excluded("model.layers.30.self_attn.q_proj")        # dotted boundaries only
    assert mo.is_excluded("language_model.lm_head")
    shards = [f"model.layers.3.self_attn.{x}_proj" for x in "qkv"]
    assert mo.is_fused_excluded("model.layers.3.self_attn.qkv_proj", shards)
    part = parse_quant_config({"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["*.q_proj"]}})
    with pytest.raises(CheckpointError, match="only some shards"):
        part.is_fused_excluded("m.qkv_proj", ["m.q_proj", "m.k_proj", "m.v_proj"])
    _, ct = quant_config(CT, "NVFP4", ["lm_head", "re:.*mlp[.]gate$"])
    c = parse_quant_config(ct)
    assert c.is_excluded("lm_head") and c.is_excluded("model.layers.0.mlp.gate")
    assert not c.is_excluded("model.layers.0.mlp.gate_proj")
    targeted = dict(ct, config_groups={"g": dict(ct["config_groups"]["group_0"], targets=["re:.*mlp.*"])})
    c = parse_quant_config(targeted)
    assert c.is_excluded("model.layers.0.self_attn.q_proj") and not c.is_excluded("model.layers.0.mlp.down_proj")


# -- global scales -----------------------------------------------------------------------------


def test_fixed_point_global_scales_round_trip_exactly():
    g = torch.Generator().manual_seed(0)
    amax = (torch.rand(200_000, generator=g) * 40 - 20).exp2()
    gs = global_scale_from_amax_exact(amax)
    assert torch.equal(torch.reciprocal(torch.reciprocal(gs)), gs)
    naive = torch.tensor(2688.0) / amax
    moved = (gs != naive)
    assert moved.any()  # the round trip is not the identity for every value...
    ulp = torch.nextafter(naive, torch.full_like(naive, float("inf"))) - naive
    assert ((gs - naive).abs() <= ulp * 1.001).all()  # ...and the fixed point is at most 1 ulp away
    for a in (1e-3, 0.02, 1.0, 3.7, 448.0, 1e4):
        assert torch.equal(global_scale_from_amax_exact(torch.tensor(a)), fixed_point_gs(a))
    assert global_scale_from_amax_exact(torch.tensor(0.0)).item() == 1.0
    assert global_scale_from_amax_exact(torch.tensor(1e-38)).item() == 2.0 ** 100  # clamped, invertible
    # Both conventions load to the same encode scale.
    for fmt in ("modelopt", "compressed-tensors"):
        stored = checkpoint_global_from_encode(gs[:100], fmt)
        assert torch.equal(encode_from_checkpoint_global(stored, fmt), gs[:100])
    assert torch.equal(reciprocal_fixed_point(gs), gs)


# -- safetensors I/O ------------------------------------------------------------------------------


def test_streaming_writer_files_read_by_safetensors(tmp_path):
    ts = {"a": torch.randn(3, 5).to(torch.bfloat16), "s": torch.tensor(2.5), "one": torch.tensor([7.0]),
          "q": torch.randint(0, 255, (4, 6), dtype=torch.uint8), "f8": torch.randn(4, 2).to(torch.float8_e4m3fn),
          "empty": torch.zeros(0, 4), "i": torch.arange(5, dtype=torch.int64)}
    specs = [spec_of(k, v) for k, v in ts.items()]
    w = ShardedWriter(tmp_path, specs, max_shard_bytes=40)
    for k, v in ts.items():
        w.write(k, v)
    w.close()
    assert len(w.names) > 2 and (tmp_path / "model.safetensors.index.json").exists()
    files = CheckpointFiles(tmp_path)
    for k, v in ts.items():
        got = files.read(k)
        assert got.dtype == v.dtype and got.shape == v.shape
        assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                           v.view(torch.uint8) if v.element_size() == 1 else v)
        with safe_open(str(tmp_path / w.weight_map[k]), "pt") as f:
            lib = f.get_tensor(k)
        assert lib.dtype == v.dtype and lib.shape == v.shape
    # Files written by the safetensors library read back identically.
    save_file(ts, str(tmp_path / "lib.safetensors"))
    f = SafetensorsFile(tmp_path / "lib.safetensors")
    assert torch.equal(f.read("a"), ts["a"]) and f.read("s").shape == () and f.read("empty").shape == (0, 4)
    f.close()


def test_writer_refuses_out_of_plan_tensors(tmp_path):
    w = ShardedWriter(tmp_path, [TensorSpec("a", "F32", (2,))], max_shard_bytes=1 << 20)
    with pytest.raises(RuntimeError, match="expected tensor 'a' next"):
        w.write("b", torch.zeros(2))
    with pytest.raises(RuntimeError, match="planned F32"):
        w.write("a", torch.zeros(3))
    w.abort()


def test_header_problems_name_the_file(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(CheckpointError, match="x.safetensors: corrupt header: header length"):
        SafetensorsFile(p)
    p.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        SafetensorsFile(p)
    hdr = json.dumps({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    p.write_bytes(struct.pack("<Q", len(hdr)) + hdr + bytes(8))
    with pytest.raises(CheckpointError, match="F32 \\[4\\] needs 16 bytes"):
        SafetensorsFile(p)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("4.5GiB") == int(4.5 * 2**30) and parse_size(123) == 123
