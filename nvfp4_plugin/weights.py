"""The one internal representation of an NVFP4 weight, whatever checkpoint format it came from.

Checkpoint loaders (ModelOpt, compressed-tensors) normalize into :class:`Nvfp4Weight`; every GEMM
backend converts it once, at load time, into whatever layout its kernels want (a typed object of
its own, with an exact way back).

Global scales are *encode* scales (``x_hat = e2m1 * s / gs``) and are kept **per output row**:
fused modules (q/k/v, gate/up) whose shards were quantized with different global scales stay exact
without touching the block scales (vLLM and SGLang take the max of the shard scales and only warn).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import numerics as nx
from ._checks import check_shape, check_tensor


@dataclass(frozen=True)
class Nvfp4Weight:
    """NVFP4 weight ``[..., N, K]`` (leading dims: experts).

    packed:        uint8 ``[..., N, K/2]``, E2M1 codes, element 2i in the low nibble.
    block_scale:   float8_e4m3fn ``[..., N, K/16]``, linear (unswizzled) layout.
    global_scale:  float32 ``[..., N]``, encode global scale of each output row.
    """

    packed: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor

    def __post_init__(self):
        check_tensor("packed", self.packed, dtypes=(torch.uint8,), min_ndim=2)
        lead, n, k = self.lead_shape, self.packed.shape[-2], self.packed.shape[-1] * 2
        check_tensor("block_scale", self.block_scale, dtypes=(torch.float8_e4m3fn,), device=self.packed.device)
        check_shape("block_scale", self.block_scale, (*lead, n, k // nx.NVFP4_BLOCK_SIZE))
        check_tensor("global_scale", self.global_scale, dtypes=(torch.float32,), device=self.packed.device)
        check_shape("global_scale", self.global_scale, (*lead, n))

    @property
    def lead_shape(self) -> tuple[int, ...]:
        return tuple(self.packed.shape[:-2])

    @property
    def n(self) -> int:
        return self.packed.shape[-2]

    @property
    def k(self) -> int:
        return self.packed.shape[-1] * 2

    @classmethod
    def from_shards(cls, packed: torch.Tensor, block_scale: torch.Tensor, shard_global_scales,
                    shard_sizes) -> Nvfp4Weight:
        """Build from a fused weight whose row shards (sizes ``shard_sizes``) have one global scale each.

        ``shard_global_scales``: encode scales, one per shard (or one per shard per leading index,
        shape ``[..., num_shards]``).
        """
        gs = torch.as_tensor(shard_global_scales, dtype=torch.float32, device=packed.device)
        sizes = torch.as_tensor(list(shard_sizes), device=packed.device)
        if int(sizes.sum()) != packed.shape[-2]:
            raise ValueError(f"shard_sizes: expected to sum to N={packed.shape[-2]}, got {list(shard_sizes)}")
        if gs.shape[-1] != len(sizes):
            raise ValueError(f"shard_global_scales: expected {len(sizes)} values (one per shard), got shape {tuple(gs.shape)}")
        return cls(packed, block_scale, torch.repeat_interleave(gs, sizes, dim=-1).contiguous())

    @classmethod
    def quantize(cls, w: torch.Tensor, global_scale: torch.Tensor | None = None) -> Nvfp4Weight:
        """Quantize a dense ``[..., N, K]`` weight with the reference recipe (one global scale per
        leading index, the dynamic ``2688/amax`` by default)."""
        from . import reference

        lead, n, k = tuple(w.shape[:-2]), w.shape[-2], w.shape[-1]
        flat = w.reshape(-1, n, k)
        if global_scale is None:
            gs = torch.stack([nx.tensor_global_scale(flat[i]) for i in range(flat.shape[0])])
        else:
            gs = torch.as_tensor(global_scale, dtype=torch.float32, device=w.device).reshape(-1).expand(flat.shape[0])
        parts = [reference.scaled_fp4_quant(flat[i], gs[i:i + 1], swizzle=False) for i in range(flat.shape[0])]
        packed = torch.stack([p for p, _ in parts]).reshape(*lead, n, k // 2)
        scales = torch.stack([s for _, s in parts]).reshape(*lead, n, k // nx.NVFP4_BLOCK_SIZE)
        return cls(packed, scales, gs.reshape(*lead, 1).expand(*lead, n).contiguous())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from . import reference

        return reference.dequantize_fp4(self.packed, self.block_scale, self.global_scale, swizzled=False,
                                        m=self.n, k=self.k, dtype=dtype)

    def to(self, device) -> Nvfp4Weight:
        return Nvfp4Weight(self.packed.to(device), self.block_scale.to(device), self.global_scale.to(device))
