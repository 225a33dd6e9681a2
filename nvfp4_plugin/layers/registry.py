"""Layer handles and the forward ops that look layers up by them.

Every forward goes through one torch op per layer kind (``torch.ops.nvfp4_layers.linear`` /
``.fused_moe`` / ``.fused_moe_masked``, apart from the compiled kernels' namespace) with a fake implementation, so
torch.compile treats the backend as opaque (config selection, Triton launches) and CUDA graphs
capture whatever it launches. The ops take the layer's *handle*, not its tensors: a small uint8 tensor
on the layer's device, ``[out_features]`` long, that the layer owns. The op finds the layer by the
handle's address (no read of its contents, so no host sync); the fake implementation reads the output
width from its shape. A handle is a tensor, so torch.compile makes it an input of the graph, as it does a
weight: every decoder layer of a model traces to the same graph code, and vLLM's piecewise compile builds
one graph for all of them (an int key was a constant of the graph, which made each layer's piece a graph
of its own: 12 compilations for a 12-layer model, and twice bf16's cold start). A compiled graph never
depends on which backend prepared the layer or on its tensor names.

The registry holds layers weakly: a layer lives as long as its owner (the engine's module, through
``module.nvfp4_core``) and leaves the registry when that is freed. A compiled graph or a captured
CUDA graph belongs to the model that owns the layers, so every handle it calls is alive while it runs;
a handle whose layer is gone (or a copy of a handle, at another address) raises an error naming it.

The ops are defined on a ``torch.library.Library`` with one CompositeExplicitAutograd kernel, not
with ``torch.library.custom_op``; they have no autograd formula (the engines run inference only: no
gradient flows through a layer). The custom_op wrapper's dispatch costs
~6.5 µs a call against ~2 µs here (CPU, torch 2.11), paid by every linear and MoE layer of a step
that runs outside CUDA graphs (vLLM's mixed prefill steps above its largest captured size).
"""

from __future__ import annotations

import logging
import weakref

import torch

logger = logging.getLogger("nvfp4_plugin")

_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def register(layer, width: int, device) -> torch.Tensor:
    """A new handle for ``layer`` (uint8 ``[width]`` on ``device``; ``width``: the op's output width). The
    layer must keep it: the registry holds the layer only as long as something else does, and the handle's
    address is the layer's key (:func:`key_of`)."""
    if width < 1:
        raise ValueError(f"width: expected >= 1 (the layer's output features), got {width}")
    handle = torch.empty(width, dtype=torch.uint8, device=device)
    key = handle.data_ptr()
    if key == 0 or key in _LAYERS:    # (a device without real storage, e.g. meta: no address to key on)
        raise RuntimeError(f"nvfp4 layer handle on {handle.device}: address {key:#x} cannot key a layer "
                           "(none, or another live layer's)")
    # a static input to torch.compile wherever the graph reaches it (through a module or not): never copied
    # into a CUDA-graph input buffer, whose address would be no layer's
    torch._dynamo.mark_static_address(handle, guard=False)
    _LAYERS[key] = layer
    return handle


def key_of(handle: torch.Tensor) -> int:
    """The registry key of ``handle``: its address."""
    return handle.data_ptr()


def lookup(key: int):
    layer = _LAYERS.get(key)
    if layer is None:
        raise KeyError(f"nvfp4 layer key {key:#x}: no such layer (its module was freed, the handle is a copy of "
                       f"a layer's handle, or it never was one); {len(_LAYERS)} layer(s) alive")
    return layer


def live_keys() -> list[int]:
    return list(_LAYERS.keys())


def _library() -> torch.library.Library:
    try:
        return torch.library.Library("nvfp4_layers", "DEF")
    except RuntimeError as exc:   # the op kernels would look layers up in the first import's registry
        raise RuntimeError("nvfp4_plugin.layers.registry: the nvfp4_layers ops are already defined in this process "
                           "(the module was executed twice, e.g. by importlib.reload); import it once") from exc


_LIB = _library()


def _define(name: str, fn, fake, mutates_args=()):
    """``torch.ops.nvfp4_layers.<name>.default``: the schema inferred from ``fn``'s annotations, ``fn``
    its kernel on every device, ``fake`` its shape function for torch.compile."""
    _LIB.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args),
                tags=(torch.Tag.pt2_compliant_tag,))
    _LIB.impl(name, fn, "CompositeExplicitAutograd")
    torch.library.register_fake(f"nvfp4_layers::{name}", fake, lib=_LIB)
    return getattr(torch.ops.nvfp4_layers, name).default


def _linear(x: torch.Tensor, bias: torch.Tensor | None, handle: torch.Tensor) -> torch.Tensor:
    layer = lookup(key_of(handle))
    return layer.backend.apply(layer.tensors, layer.meta, x, bias)


def _linear_fake(x, bias, handle):
    return x.new_empty((*x.shape[:-1], handle.shape[0]))


def _fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               handle: torch.Tensor) -> torch.Tensor:
    layer = lookup(key_of(handle))
    return layer.backend.apply(layer.tensors, layer.meta, x, topk_weights, topk_ids)


def _fused_moe_fake(x, topk_weights, topk_ids, handle):
    return torch.empty_like(x)


#: (backend, layer shape) pairs whose masked forward has been logged in this process.
_MASKED_LOGGED: set = set()


def _fused_moe_masked(x: torch.Tensor, mask: torch.Tensor, out: torch.Tensor, handle: torch.Tensor) -> None:
    """The masked layout of expert-parallel dispatch (see ``Nvfp4FusedMoE.forward_masked``): writes the
    rows ``r < mask[e]`` of ``out [E, max_m, H]`` and nothing else, so it mutates ``out`` (an engine's
    buffer) instead of returning a new tensor."""
    layer = lookup(key_of(handle))
    seen = (layer.backend.name, layer.spec)
    if seen not in _MASKED_LOGGED:       # once per shape, from inside the op: what actually ran
        _MASKED_LOGGED.add(seen)
        s = layer.spec
        logger.info("nvfp4_plugin: fused MoE E=%d H=%d I=%d (%s): masked layout x[E, max_m=%d, H] + mask[E] "
                    "(expert-parallel dispatch) on backend %s", s.num_experts, s.hidden, s.intermediate, s.mode,
                    x.shape[1], layer.backend.name)
    layer.backend.apply_masked(layer.tensors, layer.meta, x, mask, out)


def _fused_moe_masked_fake(x, mask, out, handle):
    return None


linear_op = _define("linear", _linear, _linear_fake)
moe_op = _define("fused_moe", _fused_moe, _fused_moe_fake)
moe_masked_op = _define("fused_moe_masked", _fused_moe_masked, _fused_moe_masked_fake, mutates_args=("out",))
