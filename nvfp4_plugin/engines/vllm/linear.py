"""vLLM linear method: vLLM's parameter classes and loaders, our engine-neutral Nvfp4Linear."""

from __future__ import annotations

from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.parameter import ModelWeightParameter, PerTensorScaleParameter

from ..methods import Nvfp4LinearMethod


class Nvfp4VllmLinearMethod(Nvfp4LinearMethod, LinearMethodBase):
    weight_param = ModelWeightParameter
    scale_param = PerTensorScaleParameter
