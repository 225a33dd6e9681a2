"""Engine-neutral NVFP4 layers: ``Nvfp4Linear`` and ``Nvfp4FusedMoE``.

The engine adapters (``nvfp4_plugin.engines.*``) load checkpoint tensors into an
:class:`~nvfp4_plugin.weights.Nvfp4Weight` and build a layer once after loading. A layer holds its
backend's prepared state as ``tensors`` (a flat dict, which the adapters register as parameters of
the engine's module, as torch.compile and CUDA graphs expect) and ``meta`` (static, non-tensor).
The forward passes the tensors back in. Which kernel runs is the backend's business
(``base.select_backend``).

Every forward goes through one torch custom op per layer kind (``torch.ops.nvfp4_layers.linear`` /
``.fused_moe``, apart from the compiled kernels' namespace) with a fake implementation, so torch.compile treats the backend as opaque (config
selection, Triton launches) and CUDA graphs capture whatever it launches.
"""

from __future__ import annotations

import itertools

import torch

from ..weights import Nvfp4Weight
from .backends.hopper import HopperLinear, HopperMoe
from .backends.reference import ReferenceLinear, ReferenceMoe
from .base import (ENV_LINEAR_BACKEND, ENV_MOE_BACKEND, Backend, LinearSpec, MoeSpec, resolve_mode,
                   select_backend)


class _Layer:
    """A prepared layer: ``backend``, ``tensors`` (name -> tensor; adapters may swap in their module
    parameters holding the same data, see :meth:`use_tensors`) and static ``meta``."""

    backend: Backend
    tensors: dict
    meta: object
    out_features: int

    def _register(self, out_features: int) -> None:
        self.out_features = out_features
        self.key = next(_KEYS)
        _LAYERS[self.key] = self

    def use_tensors(self, tensors: dict) -> None:
        """Replace the prepared tensors by objects holding the same data (e.g. module parameters)."""
        if set(tensors) != set(self.tensors):
            raise ValueError(f"tensors: expected keys {sorted(self.tensors)}, got {sorted(tensors)}")
        self.tensors = dict(tensors)

#: Priority order, fastest first; the reference is always last.
LINEAR_BACKENDS: list[type[Backend]] = [HopperLinear, ReferenceLinear]
MOE_BACKENDS: list[type[Backend]] = [HopperMoe, ReferenceMoe]

# layer key -> the layer object. The custom ops take the key, not the tensors: a graph compiled by
# torch.compile (and cached on disk by the engines, whose cache keys know nothing of our backend
# choice) then never depends on which backend prepared the layer or on its tensor names.
_LAYERS: dict[int, _Layer] = {}
_KEYS = itertools.count()


@torch.library.custom_op("nvfp4_layers::linear", mutates_args=())
def _linear_op(x: torch.Tensor, bias: torch.Tensor | None, key: int) -> torch.Tensor:
    layer = _LAYERS[key]
    return layer.backend.apply(layer.tensors, layer.meta, x, bias)


@_linear_op.register_fake
def _(x, bias, key):
    return x.new_empty((*x.shape[:-1], _LAYERS[key].out_features))


@torch.library.custom_op("nvfp4_layers::fused_moe", mutates_args=())
def _moe_op(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, key: int) -> torch.Tensor:
    layer = _LAYERS[key]
    return layer.backend.apply(layer.tensors, layer.meta, x, topk_weights, topk_ids)


@_moe_op.register_fake
def _(x, topk_weights, topk_ids, key):
    return torch.empty_like(x)


class Nvfp4Linear(_Layer):
    """``y = x @ W^T + b`` for one NVFP4 weight (fused shards included), on the selected backend."""

    def __init__(self, weight: Nvfp4Weight, input_global_scale: torch.Tensor | None = None,
                 act_dtype: torch.dtype = torch.bfloat16):
        self.mode = resolve_mode(input_global_scale is not None)
        spec = LinearSpec(weight.n, weight.k, act_dtype, self.mode, weight.packed.device)
        self.backend = select_backend("linear", LINEAR_BACKENDS, spec, ENV_LINEAR_BACKEND)
        self.tensors, self.meta = self.backend.prepare(spec, weight, input_global_scale)
        self._register(weight.n)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _linear_op(x, bias, self.key)


class Nvfp4FusedMoE(_Layer):
    """Routed experts with SiLU-and-mul: ``sum_k w_k * W2[e_k] silu_mul(W13[e_k] x)``."""

    def __init__(self, w13: Nvfp4Weight, w2: Nvfp4Weight, a13_global_scale: torch.Tensor | None = None,
                 a2_global_scale: torch.Tensor | None = None, act_dtype: torch.dtype = torch.bfloat16):
        if w13.packed.dim() != 3 or w2.packed.dim() != 3:
            raise ValueError(f"w13/w2: expected expert-stacked [E, N, K/2] weights, got {tuple(w13.packed.shape)} "
                             f"and {tuple(w2.packed.shape)}")
        e, two_i, h = w13.lead_shape[0], w13.n, w13.k
        if w2.lead_shape[0] != e or w2.n != h or w2.k * 2 != two_i:
            raise ValueError(f"w2: expected [E={e}, H={h}, I={two_i // 2}], got [{w2.lead_shape[0]}, {w2.n}, {w2.k}]")
        self.mode = resolve_mode(a13_global_scale is not None and a2_global_scale is not None)
        spec = MoeSpec(e, h, two_i // 2, act_dtype, self.mode, w13.packed.device)
        self.backend = select_backend("moe", MOE_BACKENDS, spec, ENV_MOE_BACKEND)
        self.tensors, self.meta = self.backend.prepare(spec, w13, w2, a13_global_scale, a2_global_scale)
        self._register(h)

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return _moe_op(x, topk_weights, topk_ids, self.key)


__all__ = ["Nvfp4Linear", "Nvfp4FusedMoE", "LINEAR_BACKENDS", "MOE_BACKENDS", "Nvfp4Weight"]
