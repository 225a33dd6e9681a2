"""The engine-neutral layers: ``Nvfp4Linear`` and ``Nvfp4FusedMoE`` (see the package docstring).

A layer selects its backend once (``base.select_backend``), keeps the backend's prepared state and
registers itself under a handle tensor (:mod:`.registry`) that its forward op takes.
"""

from __future__ import annotations

import logging
import time

import torch

from ..triton.late_compile import warming_up
from ..weights import Nvfp4Weight
from . import registry
from .backends.flashinfer_fp4 import FlashInferLinear, FlashInferW4A16Linear
from .backends.flashinfer_moe import FlashInferCutlassMoe
from .backends.hopper import HopperLinear, HopperMoe
from .backends.reference import ReferenceLinear, ReferenceMoe
from .backends.sgl_kernel_fp4 import SglKernelLinear
from .base import (ENV_LINEAR_BACKEND, ENV_MOE_BACKEND, Backend, LinearSpec, MoeSpec, resolve_mode,
                   select_backend)

logger = logging.getLogger("nvfp4_plugin")

#: Priority order, fastest first; the reference is always last.
LINEAR_BACKENDS: list[type[Backend]] = [HopperLinear, FlashInferLinear, SglKernelLinear, FlashInferW4A16Linear,
                                         ReferenceLinear]
MOE_BACKENDS: list[type[Backend]] = [HopperMoe, FlashInferCutlassMoe, ReferenceMoe]

#: Layer shapes whose kernels :meth:`_Layer._warm` already compiled in this process.
_WARMED: set = set()


class _Layer:
    """A prepared layer: ``backend``, ``tensors`` (name -> tensor; adapters may swap in their module
    parameters holding the same data, see :meth:`use_tensors`) and static ``meta``."""

    backend: Backend
    spec: LinearSpec | MoeSpec
    tensors: dict
    meta: object
    out_features: int

    def _register(self, out_features: int) -> None:
        self.out_features = out_features
        # (kept by the layer: the registry holds the layer weakly, by the handle's address)
        self.handle = registry.register(self, out_features, self.spec.device)

    @property
    def key(self) -> int:
        """The layer's registry key (its handle's address)."""
        return registry.key_of(self.handle)

    def _warm(self, key: tuple, sizes_fn, make_run) -> None:
        """Once per process and ``key`` (the layer shape): ``run = make_run(max(sizes))``, then ``run(m)``
        for each token count of ``sizes_fn()``; whatever those forwards compile is then ready before the
        engine serves. Layers of an already warmed shape cost nothing here."""
        if key in _WARMED:
            return
        _WARMED.add(key)
        sizes = sizes_fn()
        if not sizes:
            return
        t0 = time.perf_counter()
        with torch.no_grad(), warming_up():
            run = make_run(max(sizes))
            for m in sizes:
                run(m)
        if self.spec.device.type == "cuda":
            torch.cuda.synchronize(self.spec.device)
            torch.cuda.empty_cache()     # the engines size their caches from the memory left after loading
        logger.info("nvfp4_plugin: compiled %s kernels for %s at start-up: %d token counts %s in %.1f s",
                    self.backend.name, key[0], len(sizes), sizes, time.perf_counter() - t0)

    def use_tensors(self, tensors: dict) -> None:
        """Replace the prepared tensors by objects holding the same data (e.g. module parameters)."""
        if set(tensors) != set(self.tensors):
            raise ValueError(f"tensors: expected keys {sorted(self.tensors)}, got {sorted(tensors)}")
        self.tensors = dict(tensors)


class Nvfp4Linear(_Layer):
    """``y = x @ W^T + b`` for one NVFP4 weight (fused shards included), on the selected backend."""

    def __init__(self, weight: Nvfp4Weight, input_global_scale: torch.Tensor | None = None,
                 act_dtype: torch.dtype = torch.bfloat16):
        self.mode = resolve_mode(input_global_scale is not None, weight.packed.device)
        self.spec = spec = LinearSpec(weight.n, weight.k, act_dtype, self.mode, weight.packed.device)
        self.backend = select_backend("linear", LINEAR_BACKENDS, spec, ENV_LINEAR_BACKEND)
        self.tensors, self.meta = self.backend.prepare(spec, weight, input_global_scale)
        self._register(weight.n)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return registry.linear_op(x, bias, self.handle)

    def warmup(self, max_tokens: int, bias: torch.Tensor | None = None) -> None:
        """Compile (or load from Triton's cache) every kernel a forward of 1..``max_tokens`` tokens with
        this ``bias`` can launch, so that no request waits for a compiler. Call after loading."""
        s = self.spec

        def make_run(t: int):
            x = torch.zeros(t, s.k, dtype=s.act_dtype, device=s.device)
            return lambda m: self(x[:m], bias)

        key = (f"linear N={s.n} K={s.k}", s, None if bias is None else bias.dtype, max_tokens)
        self._warm(key, lambda: self.backend.warmup_sizes(self.tensors, self.meta, max_tokens), make_run)


class Nvfp4FusedMoE(_Layer):
    """Routed experts with SiLU-and-mul: ``sum_k w_k * W2[e_k] silu_mul(W13[e_k] x)``.

    Two input layouts, the two that expert-parallel engines hand a MoE layer:

    * standard (``__call__``): tokens ``x [T, H]`` with their top-k ids and weights. Ids outside
      ``[0, E)`` (-1: an expert of another expert-parallel rank) contribute nothing and are never
      computed, on every backend.
    * masked (:meth:`forward_masked`): tokens already dispatched to this rank's experts, ``x [E, max_m, H]``
      with ``mask[E]`` valid rows per expert (vLLM's batched-experts format, DeepEP's low-latency
      dispatch). No routing weights: the engine's combine applies them. Backends that define
      ``apply_masked(tensors, meta, x, mask, out)`` offer it (see :attr:`supports_masked`).
    """

    def __init__(self, w13: Nvfp4Weight, w2: Nvfp4Weight, a13_global_scale: torch.Tensor | None = None,
                 a2_global_scale: torch.Tensor | None = None, act_dtype: torch.dtype = torch.bfloat16):
        if w13.packed.dim() != 3 or w2.packed.dim() != 3:
            raise ValueError(f"w13/w2: expected expert-stacked [E, N, K/2] weights, got {tuple(w13.packed.shape)} "
                             f"and {tuple(w2.packed.shape)}")
        e, two_i, h = w13.lead_shape[0], w13.n, w13.k
        if w2.lead_shape[0] != e or w2.n != h or w2.k * 2 != two_i:
            raise ValueError(f"w2: expected [E={e}, H={h}, I={two_i // 2}], got [{w2.lead_shape[0]}, {w2.n}, {w2.k}]")
        self.mode = resolve_mode(a13_global_scale is not None and a2_global_scale is not None, w13.packed.device)
        self.spec = spec = MoeSpec(e, h, two_i // 2, act_dtype, self.mode, w13.packed.device)
        self.backend = select_backend("moe", MOE_BACKENDS, spec, ENV_MOE_BACKEND)
        self.tensors, self.meta = self.backend.prepare(spec, w13, w2, a13_global_scale, a2_global_scale)
        self._register(h)

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return registry.moe_op(x, topk_weights, topk_ids, self.handle)

    @property
    def supports_masked(self) -> bool:
        """Whether the selected backend computes the masked layout (:meth:`forward_masked`) here."""
        return self.masked_unsupported_reason() is None

    def masked_unsupported_reason(self) -> str | None:
        """Why :meth:`forward_masked` cannot run with the selected backend in this environment, or None."""
        if not callable(getattr(self.backend, "apply_masked", None)):
            return f"fused MoE backend {self.backend.name!r} has no masked-layout path"
        check = getattr(self.backend, "masked_unsupported", None)
        why = check(self.meta) if callable(check) else None
        return None if why is None else f"the masked layout of fused MoE backend {self.backend.name!r}: {why}"

    def forward_masked(self, x: torch.Tensor, mask: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The masked layout of expert-parallel dispatch: for each expert ``e`` and row ``r < mask[e]``,
        ``out[e, r] = W2[e] silu_mul(W13[e] x[e, r])`` (no routing weights).

        x:    ``[E, max_m, H]`` of the layer's activation dtype (``E``: this layer's, i.e. the local experts).
        mask: int32 ``[E]`` on x's device, valid rows per expert (values above ``max_m`` act as ``max_m``);
              never read on the host, so the call is CUDA-graph safe.
        out:  ``[E, max_m, H]`` to write into (e.g. the engine's workspace); rows at or past ``mask[e]``
              are left untouched. Allocated (uninitialized) when not given. Returns ``out``.
        """
        s = self.spec
        why = self.masked_unsupported_reason()
        if why is not None:
            raise NotImplementedError(f"{why} (expert-parallel low-latency dispatch); backends with one: "
                                      "hopper_triton, flashinfer_cutlass_moe (with nvidia-cutlass-dsl), reference")
        if x.dim() != 3 or x.shape[0] != s.num_experts or x.shape[2] != s.hidden:
            raise ValueError(f"x: expected [E={s.num_experts}, max_m, H={s.hidden}], got {tuple(x.shape)}")
        if x.dtype != s.act_dtype:
            raise TypeError(f"x: expected dtype {s.act_dtype} (the layer's activation dtype), got {x.dtype}")
        if mask.dtype != torch.int32 or tuple(mask.shape) != (s.num_experts,) or mask.device != x.device:
            raise ValueError(f"mask: expected int32 [{s.num_experts}] on {x.device}, got {mask.dtype} "
                             f"{list(mask.shape)} on {mask.device}")
        if out is None:
            out = torch.empty_like(x)
        elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
            raise ValueError(f"out: expected {x.dtype} {list(x.shape)} on {x.device}, got {out.dtype} "
                             f"{list(out.shape)} on {out.device}")
        if x.shape[1] > 0:
            registry.moe_masked_op(x, mask, out, self.handle)
        return out

    def warmup(self, max_tokens: int, top_k: int) -> None:
        """Compile every kernel a forward of 1..``max_tokens`` tokens routed to ``top_k`` experts each can
        launch (the kernels depend on the routed row count only). Call after loading."""
        s = self.spec
        if not 1 <= top_k <= s.num_experts:
            raise ValueError(f"top_k: expected 1..{s.num_experts} (the number of experts), got {top_k}")

        def make_run(t: int):
            x = torch.zeros(t, s.hidden, dtype=s.act_dtype, device=s.device)
            ids = (torch.arange(t * top_k, device=s.device) % s.num_experts).to(torch.int32).view(t, top_k)
            w = torch.full((t, top_k), 1.0 / top_k, dtype=torch.float32, device=s.device)
            return lambda m: self(x[:m], w[:m], ids[:m])

        key = (f"fused MoE E={s.num_experts} H={s.hidden} I={s.intermediate} top_k={top_k}", s, max_tokens)
        self._warm(key, lambda: self.backend.warmup_sizes(self.tensors, self.meta, max_tokens, top_k=top_k),
                   make_run)
