"""nvfp4-plugin: NVFP4 quantization kernels and layers for vLLM and SGLang.

Where things are:
  numerics      the format definitions (the one place FP4/E4M3/E8M0 rounding is defined)
  reference     pure-torch ground truth for every op
  ops           public ops: validate, allocate, dispatch to CUDA / Triton / reference
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"

logging.getLogger("nvfp4_plugin").addHandler(logging.NullHandler())
