"""Block scales chosen by error (``quantize --method mse``) and the perplexity command, on the CPU."""

import math
import subprocess
import sys

import pytest
import torch

from nvfp4_plugin import numerics as nx
from nvfp4_plugin import reference
from nvfp4_plugin.checkpoints import make_model, open_checkpoint, quantize_checkpoint
from nvfp4_plugin.checkpoints import scale_search as ss


def _data(kind: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (96, 512)
    if kind == "gauss":
        x = torch.randn(shape, generator=g)
    elif kind == "heavy":          # Student-t with 2 degrees of freedom: many blocks with one outlier
        x = torch.randn(shape, generator=g) / (torch.randn(shape, generator=g).pow(2)
                                                + torch.randn(shape, generator=g).pow(2)).div(2).sqrt()
    elif kind == "outliers":
        x = torch.randn(shape, generator=g) * torch.where(torch.rand(shape, generator=g) < 0.02, 40.0, 1.0)
    else:                          # rows over six decades: subnormal E4M3 block scales included
        x = torch.randn(shape, generator=g) * torch.logspace(-5, 1, shape[0])[:, None]
    x[:2, :32] = 0.0               # all-zero blocks keep the zero scale
    return x.bfloat16().float()


def _block_err(x, packed, scales, gs, w=None):
    deq = (nx.e2m1_decode(nx.unpack_fp4(packed)).reshape(*x.shape[:-1], -1, 16) * scales.float()[..., None]) / gs
    e = (deq.reshape(x.shape) - x) ** 2
    return (e * w if w is not None else e).reshape(*x.shape[:-1], -1, 16).sum(-1)


@pytest.mark.parametrize("kind", ["gauss", "heavy", "outliers", "decades"])
def test_window_search_equals_brute_force_over_every_e4m3_scale(kind):
    x = _data(kind)
    gs = nx.tensor_global_scale(x)
    fast = ss.search_block_scales(x, gs)
    brute = ss.search_block_scales(x, gs, candidates=ss._e4m3_positive())
    assert torch.equal(fast.view(torch.uint8), brute.view(torch.uint8))


@pytest.mark.parametrize("kind", ["gauss", "heavy", "outliers", "decades"])
def test_mse_never_loses_to_round_to_nearest_per_block(kind):
    x = _data(kind, seed=3)
    gs = nx.tensor_global_scale(x)
    p_rtn, s_rtn = reference.scaled_fp4_quant(x.bfloat16(), gs.reshape(1), swizzle=False)
    p_mse, s_mse = ss.quantize_mse(x, gs)
    e_rtn, e_mse = _block_err(x, p_rtn, s_rtn, gs), _block_err(x, p_mse, s_mse, gs)
    assert (e_mse <= e_rtn).all()
    assert e_mse.sum() < 0.95 * e_rtn.sum()                 # and wins overall (by 8-30% on these)
    zero = s_rtn.float() == 0
    assert torch.equal(s_mse.float()[zero], s_rtn.float()[zero])


def test_codes_follow_the_standard_recipe_for_the_chosen_scale():
    x = _data("gauss", seed=5)
    gs = nx.tensor_global_scale(x)
    p_rtn, s_rtn = reference.scaled_fp4_quant(x.bfloat16(), gs.reshape(1), swizzle=False)
    p, s = ss.quantize_with_scales(x, gs, s_rtn)                     # rtn's own scales -> rtn's bytes
    assert torch.equal(p, p_rtn) and s is s_rtn


def test_column_weights_change_the_choice_toward_heavy_columns():
    x = _data("heavy", seed=7)
    gs = nx.tensor_global_scale(x)
    w = torch.ones(x.shape[-1])
    w[::16] = 100.0                                                   # the first column of every block matters
    p_w, s_w = ss.quantize_with_scales(x, gs, ss.search_block_scales(x, gs, col_weight=w))
    p_u, s_u = ss.quantize_mse(x, gs)
    assert (_block_err(x, p_w, s_w, gs, w) <= _block_err(x, p_u, s_u, gs, w)).all()
    assert not torch.equal(s_w.view(torch.uint8), s_u.view(torch.uint8))
    brute = ss.search_block_scales(x, gs, col_weight=w, candidates=ss._e4m3_positive())
    assert torch.equal(s_w.view(torch.uint8), brute.view(torch.uint8))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("mse")
    make_model(base / "bf16", "llama", "tiny", device="cpu")
    for method in ("rtn", "mse"):
        quantize_checkpoint(base / "bf16", base / method, method=method, calibration=False, progress=False,
                            device="cpu")
    quantize_checkpoint(base / "bf16", base / "mse-w4a4", method="mse", progress=False, device="cpu",
                        calib_samples=2, calib_seq_len=32)
    quantize_checkpoint(base / "bf16", base / "mse-weighted", method="mse", weights_only=True, progress=False,
                        device="cpu", calib_samples=2, calib_seq_len=32)
    return base


def test_weights_only_calibrated_mse_weights_columns_by_their_inputs(tiny):
    with open_checkpoint(tiny / "mse-weighted") as wck, open_checkpoint(tiny / "mse") as uck:
        assert wck.config.quant_algo == "W4A16_NVFP4" and not wck.config.activations_quantized
        differ = 0
        for m in wck.modules:
            a, b = wck.load_linear(m).weight, uck.load_linear(m).weight
            assert torch.equal(a.global_scale, b.global_scale)          # only the block scales are searched
            differ += int(not torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8)))
        assert differ > len(wck.modules) // 2


def test_mse_checkpoint_is_standard_nvfp4_with_smaller_weight_error(tiny):
    errs = {}
    for method in ("rtn", "mse"):
        with open_checkpoint(tiny / method) as ck:        # our loader's full checks, block scales included
            assert ck.config.quant_algo == "W4A16_NVFP4"
            total = 0.0
            from safetensors.torch import load_file
            src = {}
            for f in (tiny / "bf16").glob("*.safetensors"):
                src.update(load_file(f))
            for m in ck.modules:
                w = ck.load_linear(m).weight.dequantize(torch.float32)
                total += ((w - src[m + ".weight"].float()) ** 2).sum().item()
            errs[method] = total
    assert errs["mse"] < 0.9 * errs["rtn"], errs
    with pytest.raises(ValueError, match="method: expected one of"):
        quantize_checkpoint(tiny / "bf16", tiny / "x", method="awq", progress=False, device="cpu")


def test_eval_ppl_cli(tiny, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The river turned the wheel and the wheel turned the stones. " * 40)
    r = subprocess.run([sys.executable, "-m", "nvfp4_plugin.cli", "eval-ppl", str(tiny / "bf16"), str(tiny / "rtn"),
                        str(tiny / "mse-w4a4"), "--text", str(text), "--seq-len", "64"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 3
    assert "unquantized" in lines[0] and "NVFP4 weights only" in lines[1] and "NVFP4 W4A4" in lines[2]
    ppls = [float(t.split("perplexity ")[1].split()[0]) for t in lines]
    assert all(math.isfinite(p) and p > 1 for p in ppls)
    assert len(set(ppls)) == 3                       # quantizing weights, then activations, changes the result
    from nvfp4_plugin.checkpoints.evaluate import perplexity
    same = perplexity(tiny / "mse-w4a4", text.read_text(), seq_len=64, activations="none")
    assert not same.activations_quantized and same.quantized
