"""Layer keys and the forward ops that look layers up by them.

Every forward goes through one torch custom op per layer kind (``torch.ops.nvfp4_layers.linear`` /
``.fused_moe`` / ``.fused_moe_masked``, apart from the compiled kernels' namespace) with a fake implementation, so
torch.compile treats the backend as opaque (config selection, Triton launches) and CUDA graphs
capture whatever it launches. The ops take the layer's key, not its tensors: a graph compiled by
torch.compile (and cached on disk by the engines, whose cache keys know nothing of our backend
choice) then never depends on which backend prepared the layer or on its tensor names.

The registry holds layers weakly: a layer lives as long as its owner (the engine's module, through
``module.nvfp4_core``) and leaves the registry when that is freed. A compiled graph or a captured
CUDA graph belongs to the model that owns the layers, so every key it calls is alive while it runs;
a key that is not raises an error naming it.
"""

from __future__ import annotations

import itertools
import logging
import weakref

import torch

logger = logging.getLogger("nvfp4_plugin")

_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def register(layer) -> int:
    """A new key for ``layer``, held only as long as something else holds the layer."""
    key = next(_KEYS)
    _LAYERS[key] = layer
    return key


def lookup(key: int):
    layer = _LAYERS.get(key)
    if layer is None:
        raise KeyError(f"nvfp4 layer key {key}: no such layer (its module was freed, or the key never existed); "
                       f"{len(_LAYERS)} layer(s) alive")
    return layer


def live_keys() -> list[int]:
    return list(_LAYERS.keys())


@torch.library.custom_op("nvfp4_layers::linear", mutates_args=())
def linear_op(x: torch.Tensor, bias: torch.Tensor | None, key: int) -> torch.Tensor:
    layer = lookup(key)
    return layer.backend.apply(layer.tensors, layer.meta, x, bias)


@linear_op.register_fake
def _(x, bias, key):
    return x.new_empty((*x.shape[:-1], lookup(key).out_features))


@torch.library.custom_op("nvfp4_layers::fused_moe", mutates_args=())
def moe_op(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, key: int) -> torch.Tensor:
    layer = lookup(key)
    return layer.backend.apply(layer.tensors, layer.meta, x, topk_weights, topk_ids)


@moe_op.register_fake
def _(x, topk_weights, topk_ids, key):
    return torch.empty_like(x)


#: (backend, layer shape) pairs whose masked forward has been logged in this process.
_MASKED_LOGGED: set = set()


@torch.library.custom_op("nvfp4_layers::fused_moe_masked", mutates_args=("out",))
def moe_masked_op(x: torch.Tensor, mask: torch.Tensor, out: torch.Tensor, key: int) -> None:
    """The masked layout of expert-parallel dispatch (see ``Nvfp4FusedMoE.forward_masked``): writes the
    rows ``r < mask[e]`` of ``out [E, max_m, H]`` and nothing else, so it mutates ``out`` (an engine's
    buffer) instead of returning a new tensor."""
    layer = lookup(key)
    seen = (layer.backend.name, layer.spec)
    if seen not in _MASKED_LOGGED:       # once per shape, from inside the op: what actually ran
        _MASKED_LOGGED.add(seen)
        s = layer.spec
        logger.info("nvfp4_plugin: fused MoE E=%d H=%d I=%d (%s): masked layout x[E, max_m=%d, H] + mask[E] "
                    "(expert-parallel dispatch) on backend %s", s.num_experts, s.hidden, s.intermediate, s.mode,
                    x.shape[1], layer.backend.name)
    layer.backend.apply_masked(layer.tensors, layer.meta, x, mask, out)


@moe_masked_op.register_fake
def _(x, mask, out, key):
    return None
