"""Architecture gating and the deployment check (``nvfp4-plugin info --capability X.Y [--compile]``).

All on the CPU: no GPU of any architecture is needed to plan for it or to compile its kernels."""

import logging
import os
import subprocess
import sys

import pytest
import torch

from nvfp4_plugin.layers import LINEAR_BACKENDS, MOE_BACKENDS
from nvfp4_plugin.layers import base
from nvfp4_plugin.layers.backends.hopper import HopperLinear, HopperMoe
from nvfp4_plugin.layers.base import LinearSpec, MoeSpec, choose_backend

CUDA = torch.device("cuda")


def _cli(*args, timeout=900):
    env = dict(os.environ)
    env.pop("NVFP4_PLUGIN_LINEAR_BACKEND", None)
    env.pop("NVFP4_PLUGIN_MOE_BACKEND", None)
    return subprocess.run([sys.executable, "-m", "nvfp4_plugin.cli", "info", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.mark.parametrize("cap", [(10, 0), (10, 3), (12, 0), (8, 9), (8, 0)])
def test_hopper_backend_runs_on_sm90_only(cap):
    for cls in (HopperLinear, HopperMoe):
        reason = cls.unsupported_reason(CUDA, cap)
        assert reason == f"runs on sm_90 only, the GPU is sm_{cap[0]}{cap[1]}"
        assert cls.unsupported_reason(CUDA, (9, 0)) is None
    assert "got a cpu device" in HopperLinear.unsupported_reason(torch.device("cpu"), None)


def test_blackwell_falls_back_to_the_reference_with_the_reason(monkeypatch):
    monkeypatch.delenv(base.ENV_LINEAR_BACKEND, raising=False)
    monkeypatch.delenv(base.ENV_MOE_BACKEND, raising=False)
    spec = LinearSpec(4096, 4096, torch.bfloat16, "w4a16", CUDA)
    cls, skipped = choose_backend("linear", LINEAR_BACKENDS, spec, base.ENV_LINEAR_BACKEND, (10, 0))
    assert cls.name == "reference" and skipped[0] == ("hopper_triton", "runs on sm_90 only, the GPU is sm_100")
    cls, _ = choose_backend("linear", LINEAR_BACKENDS, spec, base.ENV_LINEAR_BACKEND, (9, 0))
    assert cls.name == "hopper_triton"
    mspec = MoeSpec(128, 2048, 768, torch.bfloat16, "w4a16", CUDA)
    cls, skipped = choose_backend("moe", MOE_BACKENDS, mspec, base.ENV_MOE_BACKEND, (10, 3))
    assert cls.name == "reference" and skipped[0][0] == "hopper_triton"
    # forcing the Hopper backend on Blackwell is an error, not a crash in a compiler
    monkeypatch.setenv(base.ENV_LINEAR_BACKEND, "hopper_triton")
    with pytest.raises(RuntimeError, match="runs on sm_90 only, the GPU is sm_100"):
        choose_backend("linear", LINEAR_BACKENDS, spec, base.ENV_LINEAR_BACKEND, (10, 0))


def test_selection_log_names_backend_and_kernel_family(caplog, monkeypatch):
    monkeypatch.delenv(base.ENV_LINEAR_BACKEND, raising=False)
    monkeypatch.setattr(base, "_LOGGED", set())   # logged once per process: earlier tests may have built this shape
    spec = LinearSpec(96, 160, torch.bfloat16, "w4a16", torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="nvfp4_plugin"):
        assert base.select_backend("linear", LINEAR_BACKENDS, spec, base.ENV_LINEAR_BACKEND).name == "reference"
    text = caplog.text
    assert "skipped hopper_triton: runs on CUDA GPUs (sm_90), got a cpu device" in text
    assert "linear N=96 K=160 on reference runs, by token count: 1-16384: dequantize + torch matmul" in text


def test_hopper_kernel_families_per_token_range():
    spec = LinearSpec(6144, 4096, torch.bfloat16, "w4a16", CUDA)
    fams = HopperLinear.families(spec, 16384, dev_key="NVIDIA_H200", sms=132)
    assert fams[0][0] == 1 and fams[-1][1] == 16384
    assert all(a[1] + 1 == b[0] for a, b in zip(fams, fams[1:]))                 # contiguous, no gaps
    assert fams[0][2].startswith("triton mma.sync") and fams[-1][2] == "dequantize + cuBLAS"
    assert any(f.startswith("gluon wgmma") for _, _, f in fams)
    mfams = HopperMoe.families(MoeSpec(128, 2048, 768, torch.bfloat16, "w4a16", CUDA), 4096, top_k=8,
                               dev_key="NVIDIA_H200", sms=132)
    assert mfams[0][2].startswith("up triton mma.sync") and mfams[-1][2] == "up gluon wgmma, down gluon wgmma"


@pytest.mark.parametrize("cap", ["10.0", "10.3"])
def test_info_capability_blackwell_compile(cap):
    r = _cli("--capability", cap, "--compile")
    assert r.returncode == 0, r.stdout + r.stderr
    sm = "sm_" + cap.replace(".", "")
    assert f"backend reference (skipped hopper_triton: runs on sm_90 only, the GPU is {sm})" in r.stdout
    assert "fused MoE E=128 H=2048 I=768 top_k=8: backend reference" in r.stdout
    assert f"compile: nothing to compile for {sm}a" in r.stdout


def test_info_capability_hopper_compiles_every_variant():
    """Small shapes (fast on two cores) whose token range still reaches every Hopper kernel family:
    mma.sync, wgmma, split K, Gluon and dequantize + cuBLAS, dense and grouped."""
    r = _cli("--capability", "9.0", "--compile", "--linear", "256x512", "--moe", "8,256,128,2", "--max-tokens", "600")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "linear N=256 K=512: backend hopper_triton" in out and "fused MoE E=8 H=256 I=128 top_k=2" in out
    for fam in ("triton mma.sync", "triton wgmma", "gluon wgmma", "dequantize + cuBLAS"):
        assert fam in out, fam
    line = next(t for t in out.splitlines() if t.startswith("compile:"))
    n_ok, n_all = (int(v) for v in line.split()[1:4:2])
    assert n_ok == n_all >= 6 and "FAILED" not in out, line


def test_compile_check_reports_kernels_that_cannot_build_for_blackwell():
    """Why the gate exists: the Hopper kernels do not build for sm_100 with this Triton; the check names
    each failure, also where the compiler aborts the process (Gluon's wgmma)."""
    from nvfp4_plugin.gemm import GluonConfig, TritonMmaConfig, TritonWgmmaConfig
    from nvfp4_plugin.layers import deploy

    items = [(("triton", TritonMmaConfig(bn=64, bm=8, bk=128, num_stages=3), False), None, 1),
             (("triton", TritonWgmmaConfig(bn=128, bm=64, bk=128, num_warps=8), False), None, 1),
             (("gluon", GluonConfig(bn=64, bm=128, bk=64, num_warps=4, num_stages=4), False), None, 1),
             (("dequant_mm",), None, 1)]
    res = deploy.compile_isolated(items, (10, 0))
    assert res[0] is None and res[3] is None, res             # mma.sync and the dequantize kernel do build
    assert res[1] and "PassManager" in res[1], res
    assert res[2] and "aborted" in res[2] and "wgmma" in res[2], res
    assert deploy.compile_isolated(items, (9, 0)) == [None] * 4


def test_info_rejects_bad_arguments():
    r = _cli("--capability", "ten")
    assert r.returncode == 2 and "--capability: expected MAJOR.MINOR" in r.stderr
    r = _cli("--compile")
    assert r.returncode == 2 and "need --capability" in r.stderr
    r = _cli("--capability", "9.0", "--linear", "256")
    assert r.returncode == 2 and "--linear: expected 2 positive integers" in r.stderr


def test_default_activation_mode_follows_the_architecture(monkeypatch):
    monkeypatch.delenv(base.ENV_ACT_MODE, raising=False)
    assert base.default_mode((10, 0)) == base.default_mode((10, 3)) == "w4a4"
    assert base.default_mode((9, 0)) == base.default_mode(None) == "w4a16"
    assert base.resolve_mode(True, torch.device("cpu")) == "w4a16"
    monkeypatch.setattr(base, "device_capability", lambda d: (10, 0))
    assert base.resolve_mode(True, CUDA) == "w4a4"
    assert base.resolve_mode(False, CUDA) == "w4a16"          # no input scales: weight-only whatever the GPU
    monkeypatch.setenv(base.ENV_ACT_MODE, "w4a16")
    assert base.resolve_mode(True, CUDA) == "w4a16"


def test_plain_info_on_a_gpu_prints_the_layer_plan(monkeypatch, capsys):
    """``nvfp4-plugin info`` on a GPU machine names the backend and kernel family of each layer shape (the GPU
    is simulated: an H200's capability, name and SM count; nothing runs on it)."""
    import types

    from nvfp4_plugin import cli

    props = types.SimpleNamespace(name="NVIDIA H200", multi_processor_count=132, total_memory=141 * 2**30,
                                  major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(cli, "_gpu_lines", lambda: ["GPU 0: NVIDIA H200 (simulated)"])
    assert cli.info() == 0
    out = capsys.readouterr().out
    plan = out.split("layer plan on this GPU")[1]
    assert "GPU: sm_90a (NVIDIA H200); GEMM configs: tuned table NVIDIA_H200.json" in plan
    assert "linear N=4096 K=4096: backend hopper_triton" in plan
    assert "fused MoE E=128 H=2048 I=768 top_k=8: backend hopper_triton" in plan
    assert "gluon wgmma" in plan and "dequantize + cuBLAS" in plan and "triton mma.sync" in plan
