"""Public op dispatch, backend selection with reasons, and the nvfp4-plugin command."""

import inspect
import subprocess
import sys

import pytest
import torch

from nvfp4_plugin import _checks, cli, ops
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


# ------------------------------------------------------------------------------------------------
# Explicit ops: one validator each, one table per backend
# ------------------------------------------------------------------------------------------------

def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_public_ops_are_documented_functions_with_the_reference_signature():
    assert ops.__all__ == list(ops.PUBLIC_OPS) and len(set(ops.PUBLIC_OPS)) == len(ops.PUBLIC_OPS)
    for op in ops.PUBLIC_OPS:
        fn = getattr(ops, op)
        assert inspect.isfunction(fn) and fn.__module__ == "nvfp4_plugin.ops" and fn.__name__ == op, op
        assert fn.__doc__ and f"reference.{op}" in fn.__doc__, op
        assert inspect.signature(fn) == inspect.signature(getattr(ref, op)), op
        assert _params(getattr(_checks, f"check_{op}")) == _params(fn), op


def test_backend_tables_name_public_ops_with_the_reference_signature():
    from nvfp4_plugin import _cuda_ops, _cuda_register
    from nvfp4_plugin.triton import _register as triton_register

    assert ops.BACKEND_MODULES == ("nvfp4_plugin._cuda_register", "nvfp4_plugin.triton._register")
    assert set(_cuda_register.OPS) <= set(ops.PUBLIC_OPS) and set(triton_register.OPS) <= set(ops.PUBLIC_OPS)
    assert set(_registry.ops()) == set(ops.PUBLIC_OPS)
    for op in _cuda_register.OPS:
        assert _params(getattr(_cuda_ops, op)) == _params(getattr(ref, op)), op
    assert [b.name for b in _registry._OPS["scaled_fp4_quant"]] == ["cuda", "triton", "reference"]
    for op in ops.PUBLIC_OPS:
        assert _registry._OPS[op][-1].name == "reference", op


def test_dispatch_calls_the_backend_without_its_checks():
    # the public op validated already: the reference backend is the implementation behind the check
    x = torch.randn(3, 64)
    for op in ops.PUBLIC_OPS:
        impl = _registry.implementation(op, torch.device("cpu"))
        assert impl is getattr(ref, op).unchecked, op
    q, s = ops.scaled_fp8_quant(x)
    assert torch.equal(q.view(torch.uint8), ref.scaled_fp8_quant(x)[0].view(torch.uint8))


def test_validators_run_before_any_backend():
    from nvfp4_plugin import _cuda_ops

    x = torch.randn(4, 32)
    eo = torch.tensor([0, 2, 4], dtype=torch.int32)
    bad = [
        (lambda f: f.scaled_fp4_quant(x[:, :24], 1.0), ValueError, r"input: last dim \(K\) must be a multiple of 16"),
        (lambda f: f.scaled_fp4_quant(x, torch.ones(1, dtype=torch.float16)), TypeError,
         "input_global_scale: expected dtype float32, got float16"),
        (lambda f: f.scaled_fp4_experts_quant(x, 1.0, eo, eo), ValueError,
         r"input_global_scale: expected shape \(2,\) \(one per expert\), got \(1,\)"),
        (lambda f: f.silu_and_mul_scaled_fp4_experts_quant(x.reshape(2, 2, 32), torch.ones(2), eo[:2],
                                                          output=torch.zeros(2, 2, 8, dtype=torch.int8)),
         TypeError, "output: expected dtype uint8, got int8"),
        (lambda f: f.silu_and_mul(x[:, :5]), ValueError, r"input: last dim \(2\*I\) must be a multiple of 2"),
        (lambda f: f.scaled_fp8_quant(x, torch.ones(2)), ValueError, "scale: expected a single fp32 value"),
        (lambda f: f.per_token_quant_fp8(x[0]), ValueError, "input: expected 2 dims"),
        (lambda f: f.per_token_group_quant_fp8(x, 0), ValueError, "group_size: expected a positive int, got 0"),
    ]
    for call, exc, msg in bad:
        for impl in (ops, ref, _cuda_ops):  # the compiled wrappers check before asking for a CUDA tensor
            with pytest.raises(exc, match=msg):
                call(impl)
    with pytest.raises(ValueError, match="input: expected a CUDA tensor for the compiled kernels, got device cpu"):
        _cuda_ops.scaled_fp4_quant(x, 1.0)


def test_validators_of_the_other_ops():
    packed = torch.zeros(2, 8, 16, dtype=torch.uint8)
    scales = torch.zeros(2, 8, 2, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"global_scale: expected one value, shape \(2,\) \(per leading index\) "
                                         r"or \(2, 8\) \(per row\), got \(3,\)"):
        ops.dequantize_fp4(packed, scales, torch.ones(3), swizzled=False, m=8, k=32)
    for gs in (2.0, torch.ones(2), torch.ones(2, 8)):
        out = ops.dequantize_fp4(packed, scales, gs, swizzled=False, m=8, k=32)
        assert out.shape == (2, 8, 32)
    with pytest.raises(TypeError, match="seed: expected an int or None, got str"):
        ops.fake_quant_nvfp4(torch.randn(2, 16), None, True, seed="7")
    with pytest.raises(ValueError, match="scale_recipe: expected one of"):
        ops.fake_quant_mxfp4(torch.randn(2, 32), scale_recipe="round")
    with pytest.raises(ValueError, match="format: expected one of"):
        ops.mxfp8_quantize(torch.randn(2, 32), "e3m4")
    with pytest.raises(ValueError, match=r"x: last dim \(K\) must be a multiple of 32, got 48"):
        ops.mxfp4_quantize(torch.randn(2, 48))
    h = torch.randn(4, 96)
    ids = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"hidden_states: last dim \(hidden_size\) must be a multiple of 128"):
        ops.stage_deepseek_v4_mega_moe_inputs(h, torch.rand(4, 2), ids, torch.zeros(4, 48, dtype=torch.uint8),
                                              torch.zeros(4, 1, dtype=torch.int32), ids.long(), torch.rand(4, 2))
