"""SGLang linear method: SGLang's parameter classes and (v2) loaders, our engine-neutral Nvfp4Linear.

Works for every SGLang linear layer (ReplicatedLinear, Column/Row/MergedColumn/QKVParallelLinear)
and for a quantized ParallelLMHead. Fused layers (q/k/v, gate/up) keep one global scale per shard
(Nvfp4Weight per-row scales): shards quantized with different global scales stay exact.
"""

from __future__ import annotations

from sglang.srt.layers.parameter import ModelWeightParameter, PerTensorScaleParameter
from sglang.srt.layers.quantization.base_config import LinearMethodBase

from ..methods import Nvfp4LinearMethod


class Nvfp4SglangLinearMethod(Nvfp4LinearMethod, LinearMethodBase):
    weight_param = ModelWeightParameter
    scale_param = PerTensorScaleParameter
