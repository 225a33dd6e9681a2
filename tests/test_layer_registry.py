"""The layer registry: forward ops look layers up by their handle, a layer leaves the registry with the
engine module that owns it (an engine that rebuilds or frees a model must not keep every layer), and
under torch.compile every layer's call traces to the same graph code."""

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
    core, other_core = module.nvfp4_core, other.nvfp4_core
    key, other_key = core.key, other_core.key
    assert key != other_key and {key, other_key} <= set(registry.live_keys())
    assert core.handle.dtype == torch.uint8 and core.handle.shape == (32,)      # [out_features]
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    y = torch.ops.nvfp4_layers.linear(x, None, core.handle)
    assert torch.equal(y, core(x))
    handle = core.handle        # outlives its layer here: its address is not reused while it is held
    del module, core
    gc.collect()
    assert key not in registry.live_keys() and other_key in registry.live_keys()
    with pytest.raises(KeyError, match=rf"nvfp4 layer key {key:#x}: no such layer \(its module was freed"):
        torch.ops.nvfp4_layers.linear(x, None, handle)
    assert other_core(x).shape == (2, 32)


def test_a_copy_of_a_handle_is_refused_not_served():
    # the op finds the layer by the handle's address: a copy (another address) is no layer's handle
    module = engine_module(4)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with pytest.raises(KeyError, match="no such layer"):
        torch.ops.nvfp4_layers.linear(x, None, module.nvfp4_core.handle.clone())
    with pytest.raises(ValueError, match="width: expected >= 1"):
        registry.register(object(), 0, "cpu")
    with pytest.raises(RuntimeError, match="address 0x0 cannot key a layer"):
        registry.register(object(), 4, "meta")             # no storage, no address
    # a static input wherever torch.compile reaches it: never copied into a CUDA-graph input buffer
    assert getattr(module.nvfp4_core.handle, "_dynamo_static_input_type", None) == "unguarded"


def test_moe_layer_leaves_the_registry_when_freed():
    g = torch.Generator().manual_seed(2)
    layer = Nvfp4FusedMoE(Nvfp4Weight.quantize(torch.randn(2, 32, 32, generator=g)),
                          Nvfp4Weight.quantize(torch.randn(2, 32, 16, generator=g)))
    key = layer.key
    assert registry.lookup(key) is layer
    del layer
    gc.collect()
    assert key not in registry.live_keys()


def test_compiled_graph_calls_the_layer_by_handle():
    """torch.compile traces the op through its fake (the output width from the handle's shape) and the
    compiled graph calls the layer through its handle while its module is alive."""
    module = engine_module(3)
    core = module.nvfp4_core
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    compiled = torch.compile(lambda t: core(t) * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), core(x) * 2)


def test_every_layer_traces_to_the_same_graph_code():
    """The handle is an input of the traced graph, like a weight: split per layer, the pieces of a stack
    of layers are one and the same code (vLLM compiles each distinct piece of its piecewise graph once;
    with a key baked in as a constant every layer was a piece of its own)."""
    class Block(torch.nn.Module):
        def __init__(self, seed):
            super().__init__()
            self.proj = engine_module(seed)
            self.norm = torch.nn.LayerNorm(32, dtype=torch.bfloat16)
            self.up = torch.nn.Linear(32, 64, dtype=torch.bfloat16)

        def forward(self, x):
            return self.up(self.norm(self.proj.nvfp4_core(x)))

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block(10 + i) for i in range(3))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = Stack()
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    assert torch.equal(torch.compile(model, backend=backend, fullgraph=True)(x), model(x))
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "nvfp4_layers" in str(n.target)]
    assert len(calls) == 3 and all(n.args[2].op == "placeholder" for n in calls)   # the handle: an input
    # one piece per block, from its op call up to the next one (what a split at the op would give)
    order = list(gm.graph.nodes)
    starts = [order.index(n) for n in calls] + [len(order)]
    pieces = []
    for a, b in zip(starts, starts[1:]):
        names = {n: f"v{i}" for i, n in enumerate(order[a:b])}
        pieces.append([(str(n.target), tuple(names.get(x, "in") if isinstance(x, torch.fx.Node) else x
                                             for x in n.args)) for n in order[a:b] if n.op == "call_function"])
    assert pieces[0] == pieces[1] == pieces[2]


def test_a_second_execution_of_the_registry_is_refused_by_name():
    # the ops' kernels look layers up in the registry of the first import: a second copy of the module
    # (importlib.reload, a second load of the file) must not define them again
    import importlib.util

    spec = importlib.util.spec_from_file_location("nvfp4_registry_copy", registry.__file__)
    with pytest.raises(RuntimeError, match="the nvfp4_layers ops are already defined in this process"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    module = engine_module(3)
    assert torch.equal(torch.ops.nvfp4_layers.linear(x, None, module.nvfp4_core.handle), module.nvfp4_core(x))
