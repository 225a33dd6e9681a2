"""GPTQ (``quantize --method gptq``) on the CPU: error against rtn and mse on a layer with a known
Hessian, exact codes, dead columns, an independent slow implementation, and the checkpoint path."""

import time

import pytest
import torch

from nvfp4_plugin import cli
from nvfp4_plugin import numerics as nx
from nvfp4_plugin import reference
from nvfp4_plugin.checkpoints import CheckpointError, make_model, naming, open_checkpoint, quantize_checkpoint
from nvfp4_plugin.checkpoints import gptq as G
from nvfp4_plugin.checkpoints import scale_search as ss

N, K, T = 48, 128, 1024


def _layer(seed=0, dead=()):
    """Weights, correlated inputs (mixed through a random matrix, columns of growing scale) and H = X^T X / T."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(K, K, generator=g) / K ** 0.5 + 0.5 * torch.eye(K)
    x = (torch.randn(T, K, generator=g) @ mix) * torch.linspace(0.2, 3.0, K)
    x[:, list(dead)] = 0.0
    w = torch.randn(N, K, generator=g).bfloat16().float()
    return w, x, x.T @ x / T


def _deq(packed, scales, gs):
    return reference.dequantize_fp4(packed, scales, gs, swizzled=False, m=packed.shape[0], k=packed.shape[1] * 2)


def _out_err(w, wq, x):
    return float((((w - wq) @ x.T) ** 2).sum())


def test_output_error_below_rtn_and_mse():
    w, x, h = _layer()
    gs = nx.tensor_global_scale(w)
    errs = {"rtn": _out_err(w, _deq(*reference.scaled_fp4_quant(w, gs.reshape(1), swizzle=False), gs), x),
            "mse": _out_err(w, _deq(*ss.quantize_mse(w, gs), gs), x),
            "mse+act": _out_err(w, _deq(*ss.quantize_mse(w, gs, col_weight=h.diagonal()), gs), x)}
    for act_order in (False, True):
        settings = G.GptqSettings(act_order=act_order)
        res = G.gptq_quantize(w, gs, G.factor_hessian(h, settings), settings)
        errs[f"gptq act_order={act_order}"] = _out_err(w, res.dequantized, x)
    best_other = min(errs["rtn"], errs["mse"], errs["mse+act"])
    assert errs["gptq act_order=False"] < 0.8 * best_other, errs      # about 0.6x on this layer
    assert errs["gptq act_order=True"] < 0.8 * best_other, errs


@pytest.mark.parametrize("act_order", [False, True])
def test_codes_are_the_exact_encoding_of_what_the_algorithm_compensated(act_order):
    w, _, h = _layer(seed=1)
    gs = nx.tensor_global_scale(w)
    settings = G.GptqSettings(act_order=act_order, block_size=32)
    res = G.gptq_quantize(w, gs, G.factor_hessian(h, settings), settings)
    assert res.packed.dtype == torch.uint8 and res.packed.shape == (N, K // 2)
    assert res.block_scale.dtype == torch.float8_e4m3fn and res.block_scale.shape == (N, K // 16)
    deq = _deq(res.packed, res.block_scale, gs)
    assert torch.equal(deq.view(torch.int32), res.dequantized.view(torch.int32))     # bit for bit, signed zeros too
    # the project's encoder, given the stored scales, writes exactly these codes for Wq
    packed, _ = ss.quantize_with_scales(res.dequantized, gs, res.block_scale)
    assert torch.equal(packed, res.packed)
    if act_order:   # static groups: scales fixed up front by the weighted search on the original weights
        damped = h.diagonal() + settings.damping * h.diagonal().mean()
        expect = ss.search_block_scales(w, gs, col_weight=damped)
        assert torch.equal(res.block_scale.view(torch.uint8), expect.view(torch.uint8))


def test_inverse_cholesky_factor_matches_the_explicit_inverse():
    _, _, h = _layer(seed=2)
    h = h.double() + 0.01 * h.diagonal().mean().double() * torch.eye(K, dtype=torch.float64)
    u = G.inverse_cholesky_upper(h)
    expect = torch.linalg.cholesky(torch.linalg.inv(h), upper=True)
    assert torch.equal(u, u.triu())
    torch.testing.assert_close(u, expect, rtol=1e-9, atol=1e-12)


def _slow_gptq(w, gs, h, damping):
    """Column by column with the explicit inverse Hessian, downdated after each column (the OBS form
    GPTQ's Cholesky factor reorganises); block scales by the same weighted search at each group start."""
    w = w.double().clone()
    hd = h.double().clone()
    hd.diagonal().add_(damping * hd.diagonal().mean())
    col_w = hd.diagonal().float()
    hinv = torch.linalg.inv(hd)
    inv_gs = 1.0 / gs
    out = torch.empty_like(w, dtype=torch.float32)
    for j in range(K):
        if j % 16 == 0:
            s = ss.search_block_scales(w[:, j:j + 16].float(), gs, col_weight=col_w[j:j + 16])[:, 0].float()
        q = (nx.e2m1_decode(ss._encode(w[:, j:j + 1].float(), s, inv_gs)[:, 0]) * s) / gs
        out[:, j] = q
        err = (w[:, j] - q.double()) / hinv[j, j]
        w[:, j + 1:] -= err[:, None] * hinv[j, j + 1:][None, :]
        hinv[j + 1:, j + 1:] -= torch.outer(hinv[j + 1:, j], hinv[j, j + 1:]) / hinv[j, j]
    return out


def test_lazy_blocks_and_cholesky_agree_with_the_slow_form():
    w, x, h = _layer(seed=3)
    gs = nx.tensor_global_scale(w)
    slow = _slow_gptq(w, gs, h, G.DEFAULT_DAMPING)
    for bs in (16, 128):
        settings = G.GptqSettings(block_size=bs)
        fast = G.gptq_quantize(w, gs, G.factor_hessian(h, settings), settings).dequantized
        # same algorithm, other rounding order: a value near a rounding boundary may go the other way
        assert (fast != slow).float().mean() < 0.01
        assert abs(_out_err(w, fast, x) / _out_err(w, slow, x) - 1) < 0.02


def test_dead_columns_keep_their_weight_and_take_no_updates():
    dead = [5, *range(32, 48)]                    # one dead column in a live block, and a whole dead block
    w, x, h = _layer(seed=4, dead=dead)
    assert (h.diagonal()[dead] == 0).all()
    gs = nx.tensor_global_scale(w)
    res = G.gptq_quantize(w, gs, G.factor_hessian(h))
    assert torch.isfinite(res.dequantized).all()
    assert res.dequantized[:, dead].abs().sum() > 0                   # not zeroed
    s = res.block_scale.float()
    for c in dead:                                                     # plain rounding of the original weight
        code = ss._encode(w[:, c:c + 1], s[:, c // 16], 1.0 / gs)[:, 0]
        assert torch.equal(res.dequantized[:, c], (nx.e2m1_decode(code) * s[:, c // 16]) / gs)
    # the dead block was never updated and all its columns weigh the same: the unweighted search's scales
    expect = ss.search_block_scales(w[:, 32:48], gs)
    assert torch.equal(res.block_scale[:, 2:3].view(torch.uint8), expect.view(torch.uint8))
    live = _layer(seed=4)[1]                       # inputs outside calibration still see the dead weights
    assert _out_err(w, res.dequantized, live) < _out_err(w, torch.zeros_like(w), live)
    # nothing seen at all: no update anywhere, so exactly the unweighted mse quantizer
    none = G.gptq_quantize(w, gs, G.factor_hessian(torch.zeros(K, K)))
    packed, scales = ss.quantize_mse(w, gs)
    assert torch.equal(none.packed, packed)
    assert torch.equal(none.block_scale.view(torch.uint8), scales.view(torch.uint8))


def test_settings_are_checked():
    with pytest.raises(ValueError, match=r"block_size \(--gptq-block-size\): expected a positive multiple of 16, "
                                         "got 100"):
        G.GptqSettings(block_size=100)
    with pytest.raises(ValueError, match=r"damping \(--gptq-damping\)"):
        G.GptqSettings(damping=0)


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------

CALIB = dict(calib_samples=2, calib_seq_len=32, progress=False, device="cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("gptq")
    make_model(base / "bf16", "llama", "tiny", device="cpu")
    quantize_checkpoint(base / "bf16", base / "rtn", method="rtn", **CALIB)
    return base


def test_gptq_checkpoint_is_standard_nvfp4_and_stores_what_the_algorithm_computed(tiny, monkeypatch):
    seen = []
    real = G.gptq_quantize

    def recording(w, gs, factor, settings):
        res = real(w, gs, factor, settings)
        seen.append(res)
        return res

    monkeypatch.setattr(G, "gptq_quantize", recording)
    report = quantize_checkpoint(tiny / "bf16", tiny / "gptq", method="gptq", **CALIB)
    assert report.method == "gptq" and report.quant_algo == "NVFP4"
    with open_checkpoint(tiny / "gptq") as ck, open_checkpoint(tiny / "rtn") as rtn:   # full checks, scales too
        assert ck.config.quant_algo == "NVFP4" and ck.config.activations_quantized
        mods = sorted(ck.modules)
        assert mods == sorted(rtn.modules)
        # one column loop per distinct input: q/k/v together, gate/up together, o and down alone
        assert len(seen) == len({naming.shared_input_key(m) for m in mods})
        for m in mods:
            a, b = ck.load_linear(m), rtn.load_linear(m)
            assert torch.equal(a.weight.global_scale, b.weight.global_scale)    # the fused groups' scales
            assert torch.equal(a.input_scale, b.input_scale)
        # each column loop's Wq is what the file dequantizes to, shards in the group's order, bit for bit
        for key in {naming.shared_input_key(m) for m in mods}:
            members = [m for m in mods if naming.shared_input_key(m) == key]
            members.sort(key=lambda m: naming.fused_group(m)[1] if naming.fused_group(m) else 0)
            loaded = torch.cat([ck.load_linear(m).weight.dequantize(torch.float32) for m in members])
            assert sum(torch.equal(loaded, r.dequantized) for r in seen) == 1, key


def test_weights_only_gptq_act_order_per_shard_scales(tiny):
    quantize_checkpoint(tiny / "bf16", tiny / "gptq16", method="gptq", weights_only=True, gptq_act_order=True,
                        gptq_block_size=64, per_shard_global_scales=True, **CALIB)
    with open_checkpoint(tiny / "gptq16") as ck:
        assert ck.config.quant_algo == "W4A16_NVFP4" and not ck.config.activations_quantized
        assert all(ck.load_linear(m).input_scale is None for m in ck.modules)
        q, k = (ck.load_linear(f"model.layers.0.self_attn.{x}_proj").weight for x in "qk")
        assert not torch.equal(q.global_scale[:1], k.global_scale[:1])       # one per tensor


def test_calibration_collects_one_hessian_per_distinct_input(tiny):
    from nvfp4_plugin.checkpoints.calibrate import calibrate_input_amax
    from nvfp4_plugin.checkpoints.safetensors_io import CheckpointFiles

    with open_checkpoint(tiny / "rtn") as ck:
        mods = sorted(ck.modules)
    hessians, moments = {}, {}
    files = CheckpointFiles(tiny / "bf16")
    try:
        calibrate_input_amax(tiny / "bf16", files, mods, device="cpu", samples=2, seq_len=32,
                             second_moments=moments, hessians=hessians)
    finally:
        files.close()
    assert set(hessians) == {naming.shared_input_key(m) for m in mods}
    assert "model.layers.0.self_attn.qkv_proj" in hessians and "model.layers.0.mlp.gate_up_proj" in hessians
    for m in mods:
        h = hessians[naming.shared_input_key(m)]
        assert h.dtype == torch.float32 and h.shape == (moments[m].numel(),) * 2
        torch.testing.assert_close(h, h.T)
        torch.testing.assert_close(h.diagonal(), moments[m], rtol=1e-4, atol=1e-6)   # the same tokens


def test_calibration_hessians_of_routed_experts(tmp_path):
    from nvfp4_plugin.checkpoints.calibrate import calibrate_input_amax
    from nvfp4_plugin.checkpoints.safetensors_io import CheckpointFiles

    make_model(tmp_path / "moe", "qwen3_moe", "tiny", device="cpu")
    files = CheckpointFiles(tmp_path / "moe")
    try:
        mods = [n[:-len(".weight")] for n in files.tensors if ".experts." in n and n.endswith(".weight")]
        hessians = {}
        amax = calibrate_input_amax(tmp_path / "moe", files, mods, device="cpu", samples=2, seq_len=32,
                                    hessians=hessians)
    finally:
        files.close()
    routed = [m for m in mods if m in amax]                      # experts that received tokens
    assert routed and set(hessians) == {naming.shared_input_key(m) for m in routed}
    for m in routed:
        h = hessians[naming.shared_input_key(m)]
        k = files.info(m + ".weight").shape[1]
        assert h.shape == (k, k) and bool(torch.isfinite(h).all()) and float(h.diagonal().min()) >= 0


def test_no_calibration_refuses_gptq(tiny, capsys):
    with pytest.raises(CheckpointError, match="--method gptq needs calibration.*--no-calibration allows --method "
                                              "rtn or mse only"):
        quantize_checkpoint(tiny / "bf16", tiny / "never", method="gptq", calibration=False, progress=False)
    assert not (tiny / "never").exists()
    rc = cli.main(["quantize", str(tiny / "bf16"), str(tiny / "never"), "--method", "gptq", "--no-calibration",
                   "--quiet"])
    assert rc == 2 and "--no-calibration" in capsys.readouterr().err
    rc = cli.main(["quantize", str(tiny / "bf16"), str(tiny / "never"), "--method", "gptq", "--gptq-block-size", "100",
                   "--quiet"])
    assert rc == 2 and "--gptq-block-size): expected a positive multiple of 16, got 100" in capsys.readouterr().err
    assert not (tiny / "never").exists()


def _tensors(folder):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_hessians_in_several_passes_give_the_same_checkpoint(tmp_path, monkeypatch, arch):
    """--gptq-hessian-memory below one input's Hessian: one calibration pass per distinct input, in the order
    the layers are quantized, each Hessian summed exactly as in the single pass, so the files are identical
    (MoE: experts no calibration token reached fall back to mse the same way)."""
    from nvfp4_plugin.checkpoints import calibrate as C

    make_model(tmp_path / "bf16", arch, "tiny", device="cpu")
    passes, closed = [], []
    real_collect, real_close = C.Calibrator.collect, C.Calibrator.close

    def collect(self, **kw):
        passes.append(kw.get("hessian_keys"))
        return real_collect(self, **kw)

    def close(self):
        closed.append(self.model is not None)
        return real_close(self)

    monkeypatch.setattr(C.Calibrator, "collect", collect)
    monkeypatch.setattr(C.Calibrator, "close", close)
    one = quantize_checkpoint(tmp_path / "bf16", tmp_path / "one", method="gptq", **CALIB)
    assert passes == [None] and closed[0]
    passes.clear()
    many = quantize_checkpoint(tmp_path / "bf16", tmp_path / "many", method="gptq", gptq_hessian_memory_gb=1e-9,
                               **CALIB)
    with open_checkpoint(tmp_path / "many") as ck:
        inputs = {naming.shared_input_key(m) for m in ck.modules}
    assert len(passes) == len(inputs) and all(len(p) == 1 for p in passes)
    assert set().union(*passes) == inputs
    assert closed.count(True) == 2                     # the model freed once per run, after its last pass
    a, b = _tensors(tmp_path / "one"), _tensors(tmp_path / "many")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].view(torch.uint8) if a[name].dtype == torch.float8_e4m3fn else a[name],
                           b[name].view(torch.uint8) if b[name].dtype == torch.float8_e4m3fn else b[name]), name
    assert one.quant_algo == many.quant_algo == "NVFP4"
    assert many.seconds_calibration > 0 and many.seconds_quantize > 0


def test_gptq_hessian_memory_must_be_positive(tiny, capsys):
    for bad in ("0", "inf", "nan"):
        rc = cli.main(["quantize", str(tiny / "bf16"), str(tiny / "never"), "--method", "gptq",
                       "--gptq-hessian-memory", bad, "--quiet"])
        err = capsys.readouterr().err
        assert rc == 2 and "--gptq-hessian-memory: expected a positive, finite number of GB, got" in err, (bad, err)
    assert not (tiny / "never").exists()


def test_hessian_stream_out_of_order_and_unseen_keys():
    """A key asked for out of order collects a chunk without the keys already collected; a key its pass never
    saw comes back as None (its module falls back to mse); the model is freed after the last pass."""
    from nvfp4_plugin.checkpoints.quantize import _HessianStream

    class Cal:
        passes, closed, seen = 0, 0, []

        def collect(self, hessians, hessian_keys):
            time.sleep(0.01)
            self.passes += 1
            self.seen.append(set(hessian_keys))
            hessians.update({k: torch.ones(1) for k in hessian_keys if k != "unseen"})

        def close(self):
            self.closed += 1

    order = [(k, 10) for k in ("a", "b", "c", "unseen", "d")]
    cal = Cal()
    st = _HessianStream(cal, order, 25, {"a": torch.ones(1), "b": torch.ones(1)}, {"a", "b"})
    assert st.pop("c") is not None and cal.seen == [{"c", "unseen"}]    # budget 25: two keys of 10
    assert st.pop("b") is not None and st.pop("unseen") is None and cal.passes == 1
    assert st.pop("a") is not None and cal.closed == 0
    assert st.pop("d") is not None and cal.seen[-1] == {"d"} and cal.closed == 1
    assert st.pop("nothing") is None and cal.passes == 2
    assert st.seconds >= 0.02                                            # both passes counted as calibration


def test_an_error_after_calibration_frees_the_model(tiny, monkeypatch):
    from nvfp4_plugin.checkpoints import calibrate as C
    from nvfp4_plugin.checkpoints import quantize as Q

    closed = []
    real_close = C.Calibrator.close
    monkeypatch.setattr(C.Calibrator, "close", lambda self: (closed.append(self.model is not None), real_close(self)))

    def boom(plan, raw):
        raise RuntimeError("injected")

    monkeypatch.setattr(Q, "_input_amax_for", boom)
    with pytest.raises(RuntimeError, match="injected"):
        quantize_checkpoint(tiny / "bf16", tiny / "never", method="gptq", gptq_hessian_memory_gb=1e-9, **CALIB)
    assert closed and closed[0] is True and not (tiny / "never").exists()
