"""Checked weight loaders, the same in both engines: each checkpoint tensor is validated (dtype, rank,
scalar scale values, full shape) under its checkpoint name before the engine's own loader shards and
copies it, and each linear layer records which shards arrived, so a tensor missing from the
checkpoint fails by name instead of leaving zeros.

Both engines' loaders narrow a too-large tensor to their TP slice, and copy a too-small expert
tensor into the leading rows, without complaint: the full shape is checked here, from the layer's
own sizes (vLLM's and SGLang's layers name them alike).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..checkpoints import CheckpointError, Nvfp4QuantConfig, check_checkpoint_tensor
from ..checkpoints.errors import problem
from .common import TensorNames, layer_prefix

_QKV = {"q": 0, "k": 1, "v": 2}
#: MoE shard ids -> what they hold (checkpoints call them gate/up/down_proj or w1/w3/w2).
EXPERT_SHARDS = {"w1": "gate", "w3": "up", "w2": "down"}


def shard_indices(shard_id, num_shards: int) -> list[int]:
    """Indices of the fused shards one load call fills (None: a checkpoint tensor already fused)."""
    if shard_id is None:
        return list(range(num_shards))
    if isinstance(shard_id, str):
        return [_QKV[shard_id]]
    if isinstance(shard_id, (tuple, list)):
        return [int(s) for s in shard_id]
    return [int(shard_id)]


def shard_module(prefix: str, index: int | None, fused_shards: dict) -> str:
    """Checkpoint module of shard ``index`` of the fused layer ``prefix`` (``...qkv_proj`` -> ``...k_proj``)."""
    proj = prefix.rsplit(".", 1)[-1]
    shards = fused_shards.get(proj)
    if index is None or not isinstance(shards, (list, tuple)) or index >= len(shards):
        return prefix if index is None else f"{prefix}[shard {index}]"
    return prefix[: len(prefix) - len(proj)] + shards[index]


def _full_rows(layer: torch.nn.Module, idx: list[int]) -> int | None:
    """Rows the checkpoint holds for shards ``idx`` of this layer, before TP sharding (None: unknown)."""
    if hasattr(layer, "total_num_kv_heads"):  # QKVParallelLinear (its output_sizes count replicated kv heads)
        kv = layer.total_num_kv_heads
        sizes = [layer.total_num_heads * layer.head_size, kv * layer.head_size,
                 kv * getattr(layer, "v_head_size", layer.head_size)]
    elif hasattr(layer, "output_sizes"):  # MergedColumnParallelLinear
        sizes = list(layer.output_sizes)
    elif hasattr(layer, "org_vocab_size"):  # ParallelLMHead: the checkpoint has the unpadded vocabulary
        sizes = [layer.org_vocab_size]
    elif hasattr(layer, "output_size"):
        sizes = [layer.output_size]
    else:
        return None
    return sum(sizes[i] for i in idx) if max(idx) < len(sizes) else None


def expected_shape(layer: torch.nn.Module, suffix: str, names: TensorNames, idx: list[int]) -> tuple[int, int] | None:
    """[rows, K/2] of a packed weight or [rows, K/16] of block scales, as the checkpoint stores them."""
    if getattr(layer, "use_presharded_weights", False):
        return None
    rows = _full_rows(layer, idx)
    k = getattr(layer, "embedding_dim" if hasattr(layer, "org_vocab_size") else "input_size", None)
    if rows is None or k is None:
        return None
    return (rows, k // 2) if suffix == names.weight else (rows, k // 16) if suffix == names.block_scale else None


def linear_loader(layer: torch.nn.Module, load: Callable, spec: Nvfp4QuantConfig, names: TensorNames,
                  fused_shards: dict, suffix: str, num_shards: int, engine: str) -> Callable:
    """Wrap a linear layer's ``engine`` loader for the parameter named ``suffix``."""
    prefix = layer_prefix(layer)

    def weight_loader(param, loaded_weight: torch.Tensor, *args, **kwargs):
        shard_id = args[0] if args else kwargs.get("loaded_shard_id")
        idx = shard_indices(shard_id, num_shards)
        one_shard = shard_id is not None and len(idx) == 1
        name = f"{shard_module(prefix, idx[0] if one_shard else None, fused_shards)}.{suffix}"
        # scalar values here; block-scale values are checked once per layer after loading (on the device)
        check_checkpoint_tensor(name, loaded_weight, spec, check_values=loaded_weight.numel() == 1)
        want = expected_shape(layer, suffix, names, idx)
        if want is not None and tuple(loaded_weight.shape) != want:
            raise CheckpointError(problem(None, name, f"shape: expected {list(want)} for {engine}'s "
                                                      f"{type(layer).__name__} '{prefix}' (from the model config), "
                                                      f"got {list(loaded_weight.shape)}"))
        load(param, loaded_weight, *args, **kwargs)
        layer.nvfp4_loaded.update((suffix, i) for i in idx)

    return weight_loader


def check_all_loaded(layer: torch.nn.Module, suffixes, num_shards: int, fused_shards: dict) -> None:
    prefix = layer_prefix(layer)
    loaded = getattr(layer, "nvfp4_loaded", set())
    missing = [f"{shard_module(prefix, i if num_shards > 1 else None, fused_shards)}.{s}"
               for s in suffixes for i in range(num_shards) if (s, i) not in loaded]
    if missing:
        raise CheckpointError([problem(None, m, "missing in the checkpoint (never loaded)") for m in missing],
                              f"NVFP4 layer '{prefix}'")


def expert_loader(layer: torch.nn.Module, load: Callable, spec: Nvfp4QuantConfig, names: TensorNames, suffix: str,
                  engine: str, full_sizes: Callable[[], tuple[int, int]],
                  per_shard_views: dict | None = None) -> Callable:
    """Wrap the engine's MoE ``weight_loader`` for the parameter holding ``suffix`` tensors of every expert.

    ``full_sizes()``: the layer's hidden and intermediate sizes before TP sharding.
    ``per_shard_views`` maps a shard id to a view of the parameter that its values go to instead
    (see :func:`~nvfp4_plugin.engines.common.moe_parameters`).
    """
    prefix = layer_prefix(layer)

    def expected(shard_id, loaded_weight) -> tuple[int, int] | None:
        if (getattr(layer, "use_presharded_weights", False) or suffix not in (names.weight, names.block_scale)
                or loaded_weight.dim() != 2):  # 3-D: all experts in one tensor
            return None
        h, inter = full_sizes()
        div = 2 if suffix == names.weight else 16
        return (h, inter // div) if shard_id == "w2" else (inter, h // div)

    def weight_loader(param, loaded_weight: torch.Tensor, weight_name: str, shard_id: str, expert_id=None,
                      *args, **kwargs):
        what = EXPERT_SHARDS.get(shard_id, shard_id)
        name = f"{prefix}.{expert_id}.{shard_id}.{suffix}" if expert_id is not None else f"{prefix}.{suffix}"
        try:
            check_checkpoint_tensor(name, loaded_weight, spec, check_values=loaded_weight.numel() == 1)
            want = expected(shard_id, loaded_weight) if expert_id is not None else None
            if want is not None and tuple(loaded_weight.shape) != want:
                h, inter = full_sizes()
                raise CheckpointError(problem(None, name, f"shape: expected {list(want)} for {engine}'s "
                                                          f"{type(layer).__name__} '{prefix}' (hidden {h}, "
                                                          f"intermediate {inter} from the model config), "
                                                          f"got {list(loaded_weight.shape)}"))
        except CheckpointError as exc:
            raise CheckpointError(exc.problems, f"expert {expert_id} {what} projection") from None
        target = per_shard_views[shard_id] if per_shard_views and shard_id in per_shard_views else param
        if expert_id is None:  # a loader for checkpoints with all experts in one tensor
            return load(target, loaded_weight, weight_name, shard_id, *args, **kwargs)
        return load(target, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)

    return weight_loader
