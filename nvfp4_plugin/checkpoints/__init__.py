"""NVFP4 checkpoints: format detection, validation, normalization, and the offline tools.

Engine adapters (vLLM, SGLang) use:

* :func:`parse_quant_config` / :func:`is_nvfp4_config` on the quantization config dict the engine
  hands over (ModelOpt nested ``hf_quant_config.json``, ModelOpt flat or compressed-tensors
  ``quantization_config``) -> :class:`Nvfp4QuantConfig` (``format``, ``quant_algo``,
  ``activations_quantized``, ``is_excluded(module)``, ``is_fused_excluded(prefix, shards)``,
  ``spec.suffix(role)`` for parameter names).
* :func:`validate_checkpoint` on the model folder while parsing the config (CPU only), so a broken
  file fails before any GPU work.
* :func:`check_checkpoint_tensor` per tensor in their weight loaders, then :func:`normalize_linear`
  (fused and per-expert shards included) and :func:`normalize_input_scale` per layer after loading,
  which give the canonical :class:`~nvfp4_plugin.weights.Nvfp4Weight` and activation encode scales.

Offline tools: :func:`open_checkpoint` (canonical weights per module / MoE layer),
:func:`quantize_checkpoint` (``nvfp4-plugin quantize``), :func:`make_model` (``nvfp4-plugin make-model``).
Format facts and scale conventions: :mod:`.formats`; model-family names: :mod:`.naming`.
"""

from .config import (Nvfp4QuantConfig, compressed_tensors_quantization_config, is_nvfp4_config, load_quant_config,
                     modelopt_hf_quant_config, modelopt_quantization_config, parse_quant_config)
from .errors import CheckpointError, Problem
from .formats import (ALGO_W4A4, ALGO_W4A16, COMPRESSED_TENSORS, FORMATS, MODELOPT, checkpoint_global_from_encode,
                      checkpoint_input_from_encode, encode_from_checkpoint_global, encode_from_checkpoint_input,
                      global_scale_from_amax_exact, reciprocal_fixed_point)
from .loader import (CanonicalExperts, CanonicalLinear, Nvfp4Checkpoint, check_checkpoint_tensor, fuse_rows,
                     normalize_input_scale, normalize_linear, open_checkpoint, split_tensor_name,
                     to_checkpoint_tensors, validate_checkpoint)


def quantize_checkpoint(src, dst, options=None, **kwargs):
    """See :func:`nvfp4_plugin.checkpoints.quantize.quantize_checkpoint`."""
    from .quantize import quantize_checkpoint as _q

    return _q(src, dst, options, **kwargs)


def make_model(out_dir, arch="llama", size="tiny", seed=0, **kwargs):
    """See :func:`nvfp4_plugin.checkpoints.random_model.make_model`."""
    from .random_model import make_model as _m

    return _m(out_dir, arch, size, seed, **kwargs)


__all__ = [
    "ALGO_W4A4", "ALGO_W4A16", "COMPRESSED_TENSORS", "FORMATS", "MODELOPT",
    "CanonicalExperts", "CanonicalLinear", "CheckpointError", "Nvfp4Checkpoint", "Nvfp4QuantConfig", "Problem",
    "check_checkpoint_tensor", "checkpoint_global_from_encode", "checkpoint_input_from_encode",
    "compressed_tensors_quantization_config", "encode_from_checkpoint_global", "encode_from_checkpoint_input",
    "fuse_rows", "global_scale_from_amax_exact", "is_nvfp4_config", "load_quant_config", "make_model",
    "modelopt_hf_quant_config", "modelopt_quantization_config", "normalize_input_scale", "normalize_linear",
    "open_checkpoint", "parse_quant_config", "quantize_checkpoint", "reciprocal_fixed_point", "split_tensor_name",
    "to_checkpoint_tensors", "validate_checkpoint",
]
