"""The layer registry: forward ops look layers up by key, and a layer leaves the registry with the
engine module that owns it (an engine that rebuilds or frees a model must not keep every layer)."""

import gc

import pytest
import torch

from nvfp4_plugin.engines.common import register_prepared
from nvfp4_plugin.layers import Nvfp4FusedMoE, Nvfp4Linear, registry
from nvfp4_plugin.weights import Nvfp4Weight


def engine_module(seed=0):
    """What the adapters leave after loading: a module owning the layer (``nvfp4_core``) and its tensors."""
    g = torch.Generator().manual_seed(seed)
    module = torch.nn.Module()
    register_prepared(module, Nvfp4Linear(Nvfp4Weight.quantize(torch.randn(32, 64, generator=g))))
    return module


def test_freed_module_takes_its_layer_out_of_the_registry():
    module, other = engine_module(0), engine_module(1)
    key, other_key = module.nvfp4_core.key, other.nvfp4_core.key
    assert key != other_key and {key, other_key} <= set(registry.live_keys())
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    y = torch.ops.nvfp4_layers.linear(x, None, key)
    assert torch.equal(y, module.nvfp4_core(x))
    del module
    gc.collect()
    assert key not in registry.live_keys() and other_key in registry.live_keys()
    with pytest.raises(KeyError, match=rf"nvfp4 layer key {key}: no such layer \(its module was freed"):
        torch.ops.nvfp4_layers.linear(x, None, key)
    assert other.nvfp4_core(x).shape == (2, 32)


def test_moe_layer_leaves_the_registry_when_freed():
    g = torch.Generator().manual_seed(2)
    layer = Nvfp4FusedMoE(Nvfp4Weight.quantize(torch.randn(2, 32, 32, generator=g)),
                          Nvfp4Weight.quantize(torch.randn(2, 32, 16, generator=g)))
    key = layer.key
    assert registry.lookup(key) is layer
    del layer
    gc.collect()
    assert key not in registry.live_keys()


def test_compiled_graph_calls_the_layer_by_key():
    """torch.compile traces the op through its fake (which looks the layer up for the output width)
    and the compiled graph calls the layer by key while its module is alive."""
    module = engine_module(3)
    core = module.nvfp4_core
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    compiled = torch.compile(lambda t: core(t) * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), core(x) * 2)


def test_a_second_execution_of_the_registry_is_refused_by_name():
    # the ops' kernels look layers up in the registry of the first import: a second copy of the module
    # (importlib.reload, a second load of the file) must not define them again
    import importlib.util

    spec = importlib.util.spec_from_file_location("nvfp4_registry_copy", registry.__file__)
    with pytest.raises(RuntimeError, match="the nvfp4_layers ops are already defined in this process"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    module = engine_module(3)
    assert torch.equal(torch.ops.nvfp4_layers.linear(x, None, module.nvfp4_core.key), module.nvfp4_core(x))
