"""Public op dispatch, backend selection with reasons, and the nvfp4-plugin command."""

import subprocess
import sys

import pytest
import torch

from nvfp4_plugin import cli, ops
from nvfp4_plugin import numerics as nx
from nvfp4_plugin import reference as ref
from nvfp4_plugin.ops import _registry


def test_ops_on_cpu_are_the_reference():
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    gs = nx.tensor_global_scale(x).reshape(1)
    p1, s1 = ops.scaled_fp4_quant(x, gs)
    p2, s2 = ref.scaled_fp4_quant(x, gs)
    assert torch.equal(p1, p2) and torch.equal(s1.view(torch.uint8), s2.view(torch.uint8))
    backend, _ = _registry.select("scaled_fp4_quant", torch.device("cpu"))
    assert backend.name == "reference"
    with pytest.raises(ValueError, match="input: last dim"):
        ops.scaled_fp4_quant(torch.randn(2, 20), gs)


def test_selection_order_reasons_and_forcing(monkeypatch):
    calls = []
    _registry.register("_t_op", _registry.OpBackend("reference", lambda d: None, lambda: lambda: calls.append("ref")))
    _registry.register("_t_op", _registry.OpBackend("fast", lambda d: "needs a GPU" if d.type == "cpu" else None,
                                                    lambda: lambda: calls.append("fast")))
    _registry.register("_t_op", _registry.OpBackend("faster", lambda d: None, lambda: lambda: calls.append("faster")),
                       before="fast")
    assert [b.name for b in _registry._OPS["_t_op"]] == ["faster", "fast", "reference"]
    b, skipped = _registry.select("_t_op", torch.device("cpu"))
    assert b.name == "faster" and skipped == []
    monkeypatch.setenv(_registry.ENV_FORCE_BACKEND, "reference")
    b, skipped = _registry.select("_t_op", torch.device("cpu"))
    assert b.name == "reference"
    assert skipped == [("faster", "NVFP4_PLUGIN_OP_BACKEND=reference"), ("fast", "needs a GPU")]
    _registry.implementation("_t_op", torch.device("cpu"))()
    assert calls == ["ref"]
    monkeypatch.setenv(_registry.ENV_FORCE_BACKEND, "nonexistent")
    _registry._CHOSEN.clear()
    with pytest.raises(RuntimeError, match="_t_op: no backend can run on cpu"):
        _registry.select("_t_op", torch.device("cpu"))
    del _registry._OPS["_t_op"]


def test_info_lists_every_op(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch " + torch.__version__ in out
    assert "compiled extension:" in out
    for op in ops.PUBLIC_OPS:
        assert op in out


def test_demo_runs_as_console_script():
    res = subprocess.run([sys.executable, "-m", "nvfp4_plugin.cli", "demo", "--m", "64", "--k", "256"],
                         capture_output=True, text=True, check=True)
    assert "relative RMS error after dequantize" in res.stdout
    err = float(res.stdout.split("relative RMS error after dequantize: ")[1].split()[0])
    assert 0.05 < err < 0.15
