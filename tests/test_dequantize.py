"""``nvfp4-plugin dequantize`` and the integration tools built on it (reference logprobs, comparison).

Expected weights are computed independently of the dequantizer: the stored codes, block scales and
global scales read with ``safetensors.safe_open`` and decoded with a 16-entry E2M1 table.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from nvfp4_plugin import cli
from nvfp4_plugin.checkpoints import CheckpointError, make_model, quantize_checkpoint
from nvfp4_plugin.checkpoints.dequantize import dequantize_checkpoint

from .test_checkpoint_support import CT, MODELOPT

ROOT = Path(__file__).resolve().parents[1]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _tensors(d):
    out = {}
    for p in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(p), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _decode(packed, block_scale, stored_global, fmt):
    """code x block scale / encode global scale (DESIGN.md 3.2), codes low nibble first. ModelOpt stores
    the decode scale (encode = its fp32 reciprocal), compressed-tensors the encode scale. The division
    runs in float64 and is rounded to fp32 once: for fp32 operands that equals an IEEE fp32 division."""
    table = torch.tensor(E2M1 + [-v for v in E2M1])
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    vals = table[codes].double()
    scale = block_scale.double().repeat_interleave(16, dim=1)
    g = stored_global.float().reshape(())
    enc = g if fmt == CT else torch.ones_like(g) / g
    return (vals * scale / enc.double()).float()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("deq")
    out = {}
    for arch in ("llama", "qwen3_moe"):
        make_model(base / arch, arch, "tiny", device="cpu")
        for fmt in (MODELOPT, CT):
            dst = base / f"{arch}-{fmt}"
            quantize_checkpoint(base / arch, dst, format=fmt, calibration=False, progress=False, device="cpu")
            out[arch, fmt] = dst
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("fmt", [MODELOPT, CT])
def test_weights_are_the_exact_dequantization(checkpoints, tmp_path, arch, fmt):
    src = checkpoints[arch, fmt]
    dst = tmp_path / "plain"
    r = dequantize_checkpoint(src, dst)
    q, d = _tensors(src), _tensors(dst)
    gsuffix = "weight_scale_2" if fmt == MODELOPT else "weight_global_scale"
    wsuffix = "weight" if fmt == MODELOPT else "weight_packed"
    modules = [k[: -len(gsuffix) - 1] for k in q if k.endswith(gsuffix)]
    assert r.modules == len(modules) > 0
    for m in modules:
        want = _decode(q[f"{m}.{wsuffix}"], q[f"{m}.weight_scale"], q[f"{m}.{gsuffix}"], fmt)
        got = d[f"{m}.weight"]
        assert got.dtype == torch.float32
        assert torch.equal(got, want), m
    # everything else copied byte for byte; no scale tensors left behind
    quant_names = {k for k in q if any(k.startswith(m + ".") for m in modules)}
    assert set(d) == (set(q) - quant_names) | {f"{m}.weight" for m in modules}
    for k in set(q) - quant_names:
        assert torch.equal(d[k].view(torch.uint8), q[k].view(torch.uint8)), k
    cfg = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in cfg and not (dst / "hf_quant_config.json").exists()
    assert (dst / "tokenizer.json").exists()


def test_both_formats_dequantize_identically(checkpoints, tmp_path):
    a = _tensors(dequantize_checkpoint(checkpoints["qwen3_moe", MODELOPT], tmp_path / "a").dst)
    b = _tensors(dequantize_checkpoint(checkpoints["qwen3_moe", CT], tmp_path / "b").dst)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bfloat16_output_and_transformers_load(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    dst = Path(dequantize_checkpoint(checkpoints["llama", MODELOPT], tmp_path / "bf", dtype="bfloat16").dst)
    f32 = _tensors(dequantize_checkpoint(checkpoints["llama", MODELOPT], tmp_path / "f32").dst)
    bf = _tensors(dst)
    w = "model.layers.0.mlp.down_proj.weight"
    assert bf[w].dtype == torch.bfloat16 and torch.equal(bf[w], f32[w].to(torch.bfloat16))
    model = AutoModelForCausalLM.from_pretrained(dst)
    assert torch.equal(model.state_dict()[w], bf[w])


def test_refusals_and_atomicity(checkpoints, tmp_path, monkeypatch):
    src = checkpoints["llama", MODELOPT]
    dst = tmp_path / "out"
    dst.mkdir()
    with pytest.raises(FileExistsError):
        dequantize_checkpoint(src, dst)
    with pytest.raises(ValueError, match="dtype"):
        dequantize_checkpoint(src, tmp_path / "x", dtype="int8")
    with pytest.raises(CheckpointError):
        dequantize_checkpoint(tmp_path / "out", tmp_path / "y")  # not a checkpoint
    from nvfp4_plugin.weights import Nvfp4Weight

    real, calls = Nvfp4Weight.dequantize, []

    def failing(self, dtype=torch.float32):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, dtype)

    monkeypatch.setattr(Nvfp4Weight, "dequantize", failing)
    with pytest.raises(KeyboardInterrupt):
        dequantize_checkpoint(src, tmp_path / "z")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("z")]


def test_cli(checkpoints, tmp_path, capsys):
    assert cli.main(["dequantize", str(checkpoints["llama", CT]), str(tmp_path / "o"), "--quiet"]) == 0
    assert "modules dequantized to float32" in capsys.readouterr().out
    assert cli.main(["dequantize", str(checkpoints["llama", CT]), str(tmp_path / "o"), "--quiet"]) == 2
    assert "exists" in capsys.readouterr().err


def test_reference_logprobs_and_comparison(checkpoints, tmp_path):
    """The integration tools end to end on a tiny model: the reference of the quantized checkpoint
    equals the reference of its dequantized twin, and the comparison table lines results up."""
    ref = tmp_path / "r"
    ref.mkdir()
    src = checkpoints["llama", MODELOPT]
    twin = dequantize_checkpoint(src, tmp_path / "twin").dst
    for model, name in ((src, "llama-ref"), (twin, "twin")):
        subprocess.run([sys.executable, str(ROOT / "integration/reference_logprobs.py"), "--model", str(model),
                        "--out", str(ref / f"{name}.json")], check=True, capture_output=True)
    a, b = (json.loads((ref / f"{n}.json").read_text()) for n in ("llama-ref", "twin"))
    assert a["quantized"] and not b["quantized"]
    assert a["prompt_logprobs"] == b["prompt_logprobs"] and len(a["prompt_logprobs"]) > 5
    assert all(math.isfinite(x) and x <= 0 for x in a["prompt_logprobs"])
    # fake served results: one equal to the reference, one off by 0.5 at one position
    served = dict(a, engine="vllm", batch1_tok_per_s=12.5)
    (ref / "llama-ours-modelopt.json").write_text(json.dumps(served))
    off = list(a["prompt_logprobs"])
    off[2] -= 0.5
    (ref / "llama-builtin-modelopt.json").write_text(json.dumps(dict(served, prompt_logprobs=off, completion="x")))
    out = subprocess.run([sys.executable, str(ROOT / "integration/compare_logprobs.py"), str(ref)], check=True,
                         capture_output=True, text=True).stdout
    rows = {line.split("|")[3].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in out.splitlines()[2:]}
    assert rows["ours-modelopt"][3] == "0.0000 / 0.0000"
    assert rows["ours-modelopt"][4].startswith("0.5000 / ")
    assert rows["ours-modelopt"][5] == "n/a"          # no bf16 run of the reference: no floor
    assert rows["ours-modelopt"][6] == "yes"
    # the built-in leaves the reference's text at its first character: the reference's first token, its margin
    assert a["completion_margins"] and len(a["completion_margins"]) == len(a["completion_offsets"])
    assert all(m >= 0 for m in a["completion_margins"]) and a["completion_offsets"][-1] == len(a["completion"])
    assert rows["builtin-modelopt"][6] == f"no: token 1, reference margin {a['completion_margins'][0]:.4f}"
    assert rows["builtin-modelopt"][3].startswith("0.5000") and rows["builtin-modelopt"][4] == "n/a"
    assert rows["builtin-modelopt"][5] == "n/a"
    # the bf16 floor (the reference run in bf16) decides "within": 0.5 is outside a floor of 0.25, inside 0.75
    for shift, verdict in ((0.25, "no"), (0.75, "yes")):
        lp = list(a["prompt_logprobs"])
        lp[0] += shift
        (ref / "llama-ref-bf16.json").write_text(json.dumps(dict(a, prompt_logprobs=lp)))
        (ref / "llama-ours-modelopt.json").write_text(json.dumps(dict(served, prompt_logprobs=off)))
        (ref / "llama-builtin-modelopt.json").write_text(json.dumps(served))
        out = subprocess.run([sys.executable, str(ROOT / "integration/compare_logprobs.py"), str(ref)], check=True,
                             capture_output=True, text=True).stdout
        cells = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()[2:]]
        ours = next(c for c in cells if c[2] == "ours-modelopt")
        mean = shift / len(lp)
        assert ours[5] == f"{verdict} ({shift:.4f} / {mean:.4f})", ours


def test_divergence_names_the_reference_token_where_the_texts_part():
    from integration.compare_logprobs import divergence, within_floor

    ref = {"completion": " Paris is big", "completion_offsets": [6, 9, 13], "completion_margins": [2.0, 0.5, 0.05]}
    assert divergence({"completion": " Paris is big"}, ref) == "yes"
    assert divergence({"completion": " Lyon"}, ref) == "no: token 1, reference margin 2.0000"
    assert divergence({"completion": " Paris was"}, ref) == "no: token 2, reference margin 0.5000"     # char 7
    assert divergence({"completion": " Paris-is"}, ref) == "no: token 2, reference margin 0.5000"      # char 6
    assert divergence({"completion": " Paris is bit"}, ref) == "no: token 3, reference margin 0.0500"
    assert divergence({"completion": " Paris"}, ref) == "no: token 2, reference margin 0.5000"         # a prefix
    assert divergence({"completion": " Paris is big!"}, ref) == "no"           # the reference's ends first
    assert divergence({"completion": " Lyon"}, {"completion": " Paris"}) == "no"   # no margins recorded
    assert within_floor((0.05, 0.01), (0.08, 0.02)).startswith("yes")
    assert within_floor((0.05, 0.03), (0.08, 0.02)).startswith("no")           # the mean decides too
    assert within_floor((0.09, 0.01), (0.08, 0.02)).startswith("no")
    assert within_floor(None, (0.08, 0.02)) == "n/a" and within_floor((0.05, 0.01), None) == "n/a"


def test_compare_tp_gates_greedy_text(tmp_path):
    """integration/compare_tp.py: identical greedy texts pass (a late decode difference is reported,
    not gated); a different completion or a server that did not answer fails."""
    base = {"completion": " Paris and", "chat": "Hello there friend", "decode_text": "abcdef",
            "prompt_logprobs": [-1.0, -2.0, -3.0], "batch1_tok_per_s": 100.0}

    def run(a, b):
        pa, pb = tmp_path / "a.json", tmp_path / "b.json"
        pa.write_text(json.dumps(a))
        pb.write_text(json.dumps(b))
        return subprocess.run([sys.executable, str(ROOT / "integration/compare_tp.py"), str(pa), str(pb), "--md",
                               str(tmp_path / "o.md")], capture_output=True, text=True)

    r = run(base, dict(base, decode_text="abcxyz", prompt_logprobs=[-1.0, -2.25, -3.0]))
    assert r.returncode == 0, r.stdout
    assert "MATCH" in r.stdout and "differs at character 3" in r.stdout and "max 0.2500" in r.stdout
    assert run(base, dict(base, completion=" Paris or")).returncode == 1
    r = run(base, {"error": "not healthy after 420 s", "exit_code": -9})
    assert r.returncode == 1 and "did not answer" in r.stdout


def test_cli_sigterm_and_ctrl_c_leave_no_output(checkpoints, tmp_path, monkeypatch, capsys):
    """SIGTERM mid-write is handled like Ctrl-C: exit code 130, a message naming DST, no DST."""
    import os
    import signal

    from nvfp4_plugin.checkpoints import dequantize as dq
    from nvfp4_plugin.weights import Nvfp4Weight

    real = Nvfp4Weight.dequantize

    def terminated(self, dtype=torch.float32):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(self, dtype)

    monkeypatch.setattr(Nvfp4Weight, "dequantize", terminated)
    before = signal.getsignal(signal.SIGTERM)
    dst = tmp_path / "o"
    assert cli.main(["dequantize", str(checkpoints["llama", MODELOPT]), str(dst), "--quiet"]) == 130
    assert f"interrupted; {dst}: it was not written" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is before  # the CLI's handler is gone again
    monkeypatch.setattr(dq, "open_checkpoint", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert cli.main(["dequantize", str(checkpoints["llama", MODELOPT]), str(dst), "--quiet"]) == 130


def test_config_dtype_keys_and_kv_scales(checkpoints, tmp_path):
    """Every dtype key transformers reads says the new dtype; KV-cache scales do not outlive the
    quantization config that gave them meaning."""
    import shutil

    from safetensors.torch import save_file

    src = tmp_path / "src"
    shutil.copytree(checkpoints["llama", MODELOPT], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(dtype="bfloat16", torch_dtype="bfloat16", text_config={"dtype": "bfloat16"})
    (src / "config.json").write_text(json.dumps(cfg))
    t = _tensors(src)
    t["model.layers.0.self_attn.k_proj.k_scale"] = torch.tensor(1.0)
    t["model.layers.0.self_attn.v_proj.v_scale"] = torch.tensor(1.0)
    for p in src.glob("*.safetensors"):
        p.unlink()
    save_file(t, str(src / "model.safetensors"))
    dst = Path(dequantize_checkpoint(src, tmp_path / "out").dst)
    out = json.loads((dst / "config.json").read_text())
    assert out["dtype"] == out["torch_dtype"] == out["text_config"]["dtype"] == "float32"
    assert not [k for k in _tensors(dst) if k.endswith(("k_scale", "v_scale"))]


def test_destination_inside_source_and_equal_to_it(checkpoints, tmp_path, capsys):
    import shutil

    src = tmp_path / "q"
    shutil.copytree(checkpoints["llama", CT], src)
    dequantize_checkpoint(src, src / "plain")
    dequantize_checkpoint(src, src / "plain", overwrite=True)  # must not copy the old output into the new one
    assert sorted(p.name for p in (src / "plain").iterdir() if p.is_dir()) == []
    assert cli.main(["dequantize", str(src), str(src), "--overwrite", "--quiet"]) == 2
    assert "DST must differ from SRC" in capsys.readouterr().err


def test_staged_output_dir_swap_is_all_or_nothing(tmp_path, monkeypatch):
    """An existing DST survives a failed swap; an interrupt after the swap is marked output_complete."""
    import os

    from nvfp4_plugin.checkpoints import safetensors_io as sio

    dst = tmp_path / "d"
    dst.mkdir()
    (dst / "f").write_text("old")
    real_rename, calls = os.rename, []

    def rename(a, b):
        calls.append(1)
        if len(calls) == 2:  # tmp -> dst, after dst was moved aside
            raise KeyboardInterrupt
        return real_rename(a, b)

    monkeypatch.setattr(sio.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt) as ei:
        with sio.staged_output_dir(dst) as tmp:
            (tmp / "f").write_text("new")
    assert not getattr(ei.value, "output_complete", False)
    assert (dst / "f").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    monkeypatch.setattr(sio.os, "rename", real_rename)

    real_rmtree = sio.shutil.rmtree
    interrupted = []

    def rmtree(path, *a, **k):
        if ".old-" in str(path) and not interrupted:
            interrupted.append(path)
            raise KeyboardInterrupt
        return real_rmtree(path, *a, **k)

    monkeypatch.setattr(sio.shutil, "rmtree", rmtree)
    with pytest.raises(KeyboardInterrupt) as ei:
        with sio.staged_output_dir(dst) as tmp:
            (tmp / "f").write_text("new")
    assert ei.value.output_complete and interrupted
    assert (dst / "f").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["d"]
