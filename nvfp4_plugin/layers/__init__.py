"""Engine-neutral NVFP4 layers: ``Nvfp4Linear`` and ``Nvfp4FusedMoE``.

The engine adapters (``nvfp4_plugin.engines.*``) load checkpoint tensors into an
:class:`~nvfp4_plugin.weights.Nvfp4Weight` and build a layer once after loading. A layer holds its
backend's prepared state as ``tensors`` (a flat dict, which the adapters register as parameters of
the engine's module, so the engine's weight handling sees them) and ``meta`` (static, non-tensor). The
forward op takes the layer's handle (:mod:`.registry`), not its tensors. Which kernel runs is the backend's business
(``base.select_backend``, one file per backend in ``backends/``).

Where things are: the layers in :mod:`.api`; the layer handles and the torch ops that look
layers up by them in :mod:`.registry`; the backend interface in :mod:`.base`; deployment planning
(``nvfp4-plugin info``) in :mod:`.deploy`.
"""

from ..weights import Nvfp4Weight
from .api import LINEAR_BACKENDS, MOE_BACKENDS, Nvfp4FusedMoE, Nvfp4Linear

__all__ = ["Nvfp4Linear", "Nvfp4FusedMoE", "LINEAR_BACKENDS", "MOE_BACKENDS", "Nvfp4Weight"]
