"""Corrupted checkpoints: every case fails during validation (CPU, before any device work) with a
CheckpointError naming the tensor (or config field) and the problem; none crashes or loads garbage."""

import json
import struct

import pytest
import torch

from nvfp4_plugin.checkpoints import CheckpointError, open_checkpoint

from .test_checkpoint_support import CT, MODELOPT, SMALL_EXCLUDE, small_model, write_checkpoint

Q = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.0.mlp.down_proj"
EXPERT1 = "model.layers.1.mlp.experts.1"


def _set(name, value):
    def f(t, cfg):
        t[name] = value(t[name]) if callable(value) else value
    return f


def _drop(name):
    def f(t, cfg):
        del t[name]
    return f


def _flip_byte(name, index, byte):
    def f(t, cfg):
        b = t[name].view(torch.uint8).clone()
        b.view(-1)[index] = byte
        t[name] = b.view(torch.float8_e4m3fn)
    return f


def _config(key, value):
    def f(t, cfg):
        cfg["nested"]["quantization"][key] = value
    return f


# (id, format, mutation of (tensors, configs), post-write file corruption, expected substrings)
CASES = [
    ("missing_block_scale", MODELOPT, _drop(f"{Q}.weight_scale"), None, [f"{Q}.weight", "missing block scales"]),
    ("missing_global_scale", MODELOPT, _drop(f"{Q}.weight_scale_2"), None,
     [f"{Q}.weight", "missing weight global scale", "weight_scale_2"]),
    ("missing_input_scale_w4a4", MODELOPT, _drop(f"{DOWN}.input_scale"), None,
     [f"{DOWN}.weight", "missing activation (input) scale"]),
    ("extra_scale_on_bf16_router", MODELOPT,
     _set("model.layers.1.mlp.gate.weight_scale", torch.ones(2, 4, dtype=torch.float8_e4m3fn)), None,
     ["model.layers.1.mlp.gate.weight_scale", "extra scale tensor", "not packed"]),
    ("orphan_scale_without_weight", MODELOPT,
     _set("model.layers.0.mlp.ghost_proj.weight_scale_2", torch.tensor(1.0)), None,
     ["model.layers.0.mlp.ghost_proj.weight_scale_2", "extra scale tensor: no weight tensor"]),
    ("block_scale_as_uint8", MODELOPT, _set(f"{Q}.weight_scale", lambda x: x.view(torch.uint8)), None,
     [f"{Q}.weight_scale", "expected F8_E4M3", "got U8"]),
    ("block_scale_as_float32", MODELOPT, _set(f"{Q}.weight_scale", lambda x: x.float()), None,
     [f"{Q}.weight_scale", "expected F8_E4M3", "got F32"]),
    ("packed_weight_as_int8", MODELOPT, _set(f"{Q}.weight", lambda x: x.view(torch.int8)), None,
     [f"{Q}.weight", "expected U8", "got I8"]),
    ("k16_mismatch", MODELOPT, _set(f"{Q}.weight_scale", lambda x: x[:, :-1].contiguous()), None,
     [f"{Q}.weight_scale", "K/16 mismatch", "[64, 4]", "[64, 3]"]),
    ("block_scale_row_mismatch", MODELOPT, _set(f"{Q}.weight_scale", lambda x: x[:-1].contiguous()), None,
     [f"{Q}.weight_scale", "expected [N, K/16] = [64, 4]", "[63, 4]"]),
    ("k_not_multiple_of_16", MODELOPT, _set(f"{Q}.weight", lambda x: x[:, :3].contiguous()), None,
     [f"{Q}.weight", "K = 6", "not a multiple of 16"]),
    ("global_scale_zero", MODELOPT, _set(f"{Q}.weight_scale_2", torch.tensor(0.0)), None,
     [f"{Q}.weight_scale_2", "finite and > 0", "0.0"]),
    ("global_scale_negative", MODELOPT, _set(f"{Q}.weight_scale_2", torch.tensor(-1e-3)), None,
     [f"{Q}.weight_scale_2", "finite and > 0"]),
    ("global_scale_nan", MODELOPT, _set(f"{Q}.weight_scale_2", torch.tensor(float("nan"))), None,
     [f"{Q}.weight_scale_2", "finite and > 0", "nan"]),
    ("global_scale_inf", MODELOPT, _set(f"{Q}.weight_scale_2", torch.tensor(float("inf"))), None,
     [f"{Q}.weight_scale_2", "finite and > 0", "inf"]),
    ("global_scale_reciprocal_overflows", MODELOPT, _set(f"{Q}.weight_scale_2", torch.tensor(1e-45)), None,
     [f"{Q}.weight_scale_2", "reciprocal", "overflows"]),
    ("global_scale_per_row_shape", MODELOPT, _set(f"{Q}.weight_scale_2", torch.ones(64)), None,
     [f"{Q}.weight_scale_2", "per-tensor scalar", "[64]"]),
    ("global_scale_bf16", MODELOPT, _set(f"{Q}.weight_scale_2", lambda x: x.to(torch.bfloat16)), None,
     [f"{Q}.weight_scale_2", "expected F32", "got BF16"]),
    ("negative_block_scale", MODELOPT, _flip_byte(f"{Q}.weight_scale", 5, 0xB8), None,
     [f"{Q}.weight_scale", "negative", "index [1, 1]"]),
    ("nan_block_scale", MODELOPT, _flip_byte(f"{DOWN}.weight_scale", 0, 0x7F), None,
     [f"{DOWN}.weight_scale", "NaN"]),
    ("input_scale_zero", MODELOPT, _set(f"{DOWN}.input_scale", torch.tensor(0.0)), None,
     [f"{DOWN}.input_scale", "finite and > 0"]),
    ("excluded_but_quantized", MODELOPT,
     lambda t, cfg: (_config("exclude_modules", list(SMALL_EXCLUDE) + ["*.o_proj"])(t, cfg),
                     cfg["flat"].__setitem__("ignore", list(SMALL_EXCLUDE) + ["*.o_proj"])), None,
     ["model.layers.0.self_attn.o_proj.weight", "excludes the module", "*.o_proj"]),
    ("linear_unquantized_not_excluded", MODELOPT,
     lambda t, cfg: [t.pop(k) for k in [k for k in t if k.startswith("model.layers.0.self_attn.o_proj.")]]
     and t.__setitem__("model.layers.0.self_attn.o_proj.weight", torch.zeros(64, 64, dtype=torch.bfloat16)),
     None, ["model.layers.0.self_attn.o_proj.weight", "stored unquantized", "does not exclude"]),
    ("fused_mixes_quantized_and_bf16", MODELOPT,
     lambda t, cfg: ([t.pop(k) for k in [k for k in t if k.startswith("model.layers.0.self_attn.k_proj.")]],
                     t.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(32, 64, dtype=torch.bfloat16)),
                     cfg["nested"]["quantization"]["exclude_modules"].append("model.layers.0.self_attn.k_proj"),
                     cfg["flat"]["ignore"].append("model.layers.0.self_attn.k_proj")),
     None, ["model.layers.0.self_attn.qkv_proj", "mixes NVFP4 shards"]),
    ("missing_expert", MODELOPT,
     lambda t, cfg: [t.pop(k) for k in [k for k in t if k.startswith("model.layers.1.mlp.experts.0.")]], None,
     ["model.layers.1.mlp.experts.0", "experts [0] are missing"]),
    ("expert_lacks_projection", MODELOPT,
     lambda t, cfg: [t.pop(k) for k in [k for k in t if k.startswith(f"{EXPERT1}.up_proj.")]], None,
     [EXPERT1, "lacks its ['up'] projection"]),
    ("expert_shape_mismatch", MODELOPT,
     lambda t, cfg: (t.__setitem__(f"{EXPERT1}.down_proj.weight", t[f"{EXPERT1}.down_proj.weight"][:, :8].contiguous()),
                     t.__setitem__(f"{EXPERT1}.down_proj.weight_scale",
                                   t[f"{EXPERT1}.down_proj.weight_scale"][:, :1].contiguous())), None,
     [f"{EXPERT1}.down_proj.weight", "expert shape", "[64, 16]"]),
    ("unsupported_awq_tensor", MODELOPT, _set(f"{Q}.pre_quant_scale", torch.ones(64)), None,
     [f"{Q}.pre_quant_scale", "does not support"]),
    ("config_unsupported_algo", MODELOPT, _config("quant_algo", "NVFP4_AWQ"), None,
     ["hf_quant_config.json", "quant_algo", "NVFP4_AWQ"]),
    ("config_group_size_32", MODELOPT, _config("group_size", 32), None, ["group_size", "expected 16", "32"]),
    ("config_files_disagree", MODELOPT, lambda t, cfg: cfg["flat"].__setitem__("quant_algo", "W4A16_NVFP4"), None,
     ["hf_quant_config.json", "disagrees with config.json", "quant_algo"]),
    ("truncated_file", MODELOPT, None, lambda d: _truncate(d / "model.safetensors", 100),
     ["model.safetensors", "truncated"]),
    ("corrupt_header", MODELOPT, None, lambda d: _corrupt_header(d / "model.safetensors"),
     ["model.safetensors", "corrupt header", "JSON"]),
    ("index_references_missing_shard", MODELOPT, None, lambda d: _index_with_missing_shard(d),
     ["model.safetensors.index.json", "references missing file model-00002-of-00002.safetensors"]),
    ("ct_missing_global_scale", CT, _drop(f"{Q}.weight_global_scale"), None,
     [f"{Q}.weight_packed", "missing weight global scale", "weight_global_scale"]),
    ("ct_modelopt_name_in_ct_file", CT, _set(f"{Q}.weight_scale_2", torch.tensor(1.0)), None,
     [f"{Q}.weight_scale_2", "is a modelopt tensor name", "compressed-tensors"]),
    ("ct_global_scale_negative", CT, _set(f"{DOWN}.weight_global_scale", torch.tensor([-5.0])), None,
     [f"{DOWN}.weight_global_scale", "finite and > 0"]),
    ("ct_wrong_strategy", CT, lambda t, cfg: cfg["flat"]["config_groups"]["group_0"]["weights"].__setitem__(
        "strategy", "group"), None, ["config_groups.group_0.weights.strategy", "tensor_group", "'group'"]),
    ("ct_not_compressed", CT, lambda t, cfg: cfg["flat"].__setitem__("quantization_status", "frozen"), None,
     ["quantization_status", "compressed", "frozen"]),
]


def _truncate(path, nbytes):
    data = path.read_bytes()
    path.write_bytes(data[:-nbytes])


def _corrupt_header(path):
    data = bytearray(path.read_bytes())
    (hlen,) = struct.unpack("<Q", data[:8])
    data[8:12] = b"\x00\xff{]"
    path.write_bytes(bytes(data))


def _index_with_missing_shard(d):
    from safetensors import safe_open
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    wm = {k: "model.safetensors" for k in keys}
    wm["extra.weight"] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))


def _build(tmp_path, fmt, mutate, post):
    tensors, _ = small_model(fmt)
    from .test_checkpoint_support import quant_config
    nested, flat = quant_config(fmt, "NVFP4", SMALL_EXCLUDE)
    cfg = {"nested": nested, "flat": flat}
    if mutate is not None:
        mutate(tensors, cfg)
    d = write_checkpoint(tmp_path / "ckpt", tensors, fmt, exclude=SMALL_EXCLUDE, nested=cfg["nested"], flat=cfg["flat"])
    if post is not None:
        post(d)
    return d


def test_the_uncorrupted_models_load(tmp_path):
    for fmt in (MODELOPT, CT):
        d = _build(tmp_path / fmt, fmt, None, None)
        with open_checkpoint(d) as ck:
            parts = list(ck.iter_canonical())
        assert len(parts) == 12  # 11 linears + 1 MoE layer


def test_suite_is_large_enough():
    assert len({c[0] for c in CASES}) == len(CASES) >= 15


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_corruption_is_rejected_before_device_work(tmp_path, case):
    _id, fmt, mutate, post, expected = case
    d = _build(tmp_path, fmt, mutate, post)
    # Loading onto "cuda" on purpose: on a CPU-only machine any device work would raise a different
    # error, so a CheckpointError proves validation ran (and failed) first.
    with pytest.raises(CheckpointError) as exc_info:
        with open_checkpoint(d) as ck:
            for _ in ck.iter_canonical(device="cuda"):
                pass
    msg = str(exc_info.value)
    for s in expected:
        assert s in msg, f"{s!r} not in error message:\n{msg}"
