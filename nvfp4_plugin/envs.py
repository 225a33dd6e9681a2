"""Every environment variable of nvfp4_plugin: documented in :data:`VARIABLES`, read only here.

Other modules of the package call the functions below and never touch ``os.environ`` themselves
(tests/test_envs.py checks it; README.md's table lists every entry of :data:`VARIABLES`). A function
reads the variable when it is called; how often that happens is the caller's choice and is part of
each variable's documentation: some are read at every use (an ops backend forced for A/B runs),
some once per process on purpose (``NVFP4_PLUGIN_GEMM_COMPILE_ONLY`` decides at import whether the
GEMM kernels are interpreted or compiled; nothing can change that afterwards).

Three kinds of entries:

* ``plugin``: read by the Python package, through the functions here;
* ``triton``: Triton's own variables, which the package reads or sets on Triton's behalf (also only
  here) and Triton reads as well;
* ``csrc`` / ``setup.py``: read by the compiled kernels (C++ ``std::getenv``, once per process) or
  by the build, not by Python; listed so that one table has them all.

Tests read their own variables (``NVFP4_TEST_*``, see tests/_require.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    #: the values it takes, in words
    values: str
    #: what happens when it is unset
    default: str
    #: "plugin", "triton", "csrc" or "setup.py" (see the module docstring)
    reader: str
    #: what it does, and when it is read
    effect: str


OP_BACKEND = "NVFP4_PLUGIN_OP_BACKEND"
LINEAR_BACKEND = "NVFP4_PLUGIN_LINEAR_BACKEND"
MOE_BACKEND = "NVFP4_PLUGIN_MOE_BACKEND"
ACT_MODE = "NVFP4_PLUGIN_ACT_MODE"
FLASHINFER_MM_BACKEND = "NVFP4_PLUGIN_FLASHINFER_MM_BACKEND"
FLASHINFER_W4A16_BACKEND = "NVFP4_PLUGIN_FLASHINFER_W4A16_BACKEND"
LOG_LEVEL = "NVFP4_PLUGIN_LOG_LEVEL"
GEMM_CONFIG_DIR = "NVFP4_PLUGIN_GEMM_CONFIG_DIR"
GEMM_COMPILE_ONLY = "NVFP4_PLUGIN_GEMM_COMPILE_ONLY"
FAST_LAUNCH = "NVFP4_PLUGIN_FAST_LAUNCH"
TRITON_INTERPRET = "TRITON_INTERPRET"
DISABLE_MMA_V3 = "DISABLE_MMA_V3"

VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar(OP_BACKEND, "a backend name of the public ops: cuda, triton or reference",
           "the first backend that runs on the device (compiled, then Triton, then the reference)", "plugin",
           "forces one backend for every op (debugging, A/B comparisons); an op whose forced backend cannot run "
           "on the device fails with the reasons. Read at every backend selection (ops._registry.select); the "
           "public ops select once per (op, device) and process"),
    EnvVar(LINEAR_BACKEND, "a linear backend name of nvfp4_plugin.layers (hopper_triton, flashinfer_fp4, "
           "sgl_kernel_fp4, flashinfer_w4a16, reference)", "the first backend that supports the GPU and shape", "plugin",
           "forces the GEMM backend of the linear layers; read each time a layer chooses its backend (at "
           "construction) and by `nvfp4-plugin info --capability`"),
    EnvVar(MOE_BACKEND, "a fused-MoE backend name of nvfp4_plugin.layers", "the first backend that supports the "
           "GPU and shape", "plugin", "the same as NVFP4_PLUGIN_LINEAR_BACKEND for the fused-MoE layers"),
    EnvVar(ACT_MODE, "w4a16 or w4a4", "w4a4 on Blackwell (sm_100+), w4a16 elsewhere", "plugin",
           "w4a16: activations stay bf16/fp16; w4a4: activations are quantized to NVFP4 with the checkpoint's "
           "input scales (checkpoints without them run w4a16, with a warning). Read when a layer resolves its "
           "mode (construction)"),
    EnvVar(FLASHINFER_MM_BACKEND, "cutlass or cudnn", "cutlass", "plugin",
           "the backend of FlashInfer's mm_fp4 in the Blackwell linear backend flashinfer_fp4; read when a "
           "layer's weights are prepared and when its kernel families are described"),
    EnvVar(FLASHINFER_W4A16_BACKEND, "cute-dsl or cudnn", "cute-dsl", "plugin",
           "the backend of FlashInfer's mm_bf16_fp4 in the Blackwell weight-only linear backend flashinfer_w4a16 "
           "(cute-dsl needs nvidia-cutlass-dsl, cudnn a cuDNN backend >= 9.23.1); read when a layer's weights are "
           "prepared and when its kernel families are described"),
    EnvVar(LOG_LEVEL, "a logging level name (DEBUG, INFO, WARNING, ...; any case)", "INFO", "plugin",
           "level of the plugin's log lines inside vLLM's processes (in SGLang they follow its --log-level); "
           "read when the vLLM adapter sets up logging (once per process)"),
    EnvVar(GEMM_CONFIG_DIR, "a directory of tuned Hopper GEMM configs (<device>.json, written by "
           "benchmarks/tune_gemm.py)", "the package's nvfp4_plugin/gemm/configs/", "plugin",
           "read when a device's config table is first loaded (then cached for the process)"),
    EnvVar(GEMM_COMPILE_ONLY, "1, or unset", "on a machine without a GPU, the GEMM kernels run in Triton's "
           "interpreter", "plugin",
           "1: on a machine without a GPU, compile the Triton GEMM kernels for sm_90a instead of interpreting "
           "them (ahead-of-time compilation, SASS inspection); the Gluon kernel has no interpreter, so without "
           "it (or without a GPU) its configs run on the Triton kernel. Read once, when nvfp4_plugin.gemm is "
           "imported; `nvfp4-plugin info --capability`, python -m nvfp4_plugin.gemm.inspect_sass and the "
           "compile workers of layers.deploy set it (if unset) before that"),
    EnvVar(FAST_LAUNCH, "0, or anything else", "a kernel launched again with the same specialization skips "
           "Triton's per-call argument binding (nvfp4_plugin.triton.fast_launch)", "plugin",
           "0: every launch of the hot-path Triton and Gluon kernels goes through Triton's kernel[grid](...) "
           "(A/B runs, debugging); read at every launch"),
    EnvVar(TRITON_INTERPRET, "1, or unset", "compiled kernels", "triton",
           "Triton's: 1 runs Triton kernels in its CPU interpreter (how the CPU tests run them). Triton reads "
           "it when kernels are defined; the package reads it once, when nvfp4_plugin.gemm is imported, and "
           "removes it from the environment of the compile workers of layers.deploy"),
    EnvVar(DISABLE_MMA_V3, "1, or unset", "Triton uses wgmma (MMA v3) on sm_90", "triton",
           "Triton's: the package sets it to 1 only while compiling a GEMM config that asks for mma.sync with "
           "token tiles of 16 or more, and restores it after; there is no reason to set it yourself"),
    EnvVar("NVFP4_PLUGIN_PDL", "0, or anything else", "programmatic dependent launch (sm_90 and up)", "csrc",
           "0: the compiled quantizers launch in plain stream order; read once per process"),
    EnvVar("NVFP4_PLUGIN_QUANT_TILING", "rows, groups, chunks or auto", "auto: the measured choice", "csrc",
           "benchmarks and tests only: forces one tiling of the compiled NVFP4 quantizers wherever it applies "
           "(same bytes either way); read once per process"),
    EnvVar("NVFP4_PLUGIN_QUANT_BULK", "0, or anything else", "the bulk-copy input ring where the tile allows it",
           "csrc", "benchmarks and tests only: 0 turns off the cp.async.bulk input ring of the compiled experts "
           "quantizer (same bytes either way); read once per process"),
    EnvVar("NVFP4_PLUGIN_CUDA_ARCHS", "';'-separated targets such as 9.0a;10.0a", "9.0a;10.0a;10.3a", "setup.py",
           "architectures the CUDA extension is built for"),
    EnvVar("NVFP4_PLUGIN_SKIP_CUDA", "any value but empty or 0", "the extension is built where torch has CUDA "
           "and a CUDA toolkit is found", "setup.py", "set: pip install / setup.py never builds the CUDA extension"),
    EnvVar("NVFP4_PLUGIN_REQUIRE_EXT_BUILD", "any value but empty or 0", "a build that cannot compile the extension "
           "goes on without it", "setup.py", "set: such a build fails instead (the serving image's docker/build.sh)"),
)}


def _read(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


# ------------------------------------------------------------------------------------------------
# Read by the package
# ------------------------------------------------------------------------------------------------

def forced_op_backend() -> str | None:
    """``NVFP4_PLUGIN_OP_BACKEND``, or None."""
    return _read(OP_BACKEND)


def forced_layer_backend(var: str) -> str | None:
    """``var`` (``NVFP4_PLUGIN_LINEAR_BACKEND`` or ``NVFP4_PLUGIN_MOE_BACKEND``), or None."""
    if var not in (LINEAR_BACKEND, MOE_BACKEND):
        raise ValueError(f"var: expected {LINEAR_BACKEND} or {MOE_BACKEND}, got {var!r}")
    return _read(var)


def act_mode(default: str) -> str:
    """``NVFP4_PLUGIN_ACT_MODE`` as given (the caller checks it), or ``default`` if unset."""
    return _read(ACT_MODE, default)


def flashinfer_mm_backend() -> str:
    """``NVFP4_PLUGIN_FLASHINFER_MM_BACKEND`` as given (the caller checks it), or ``"cutlass"``."""
    return _read(FLASHINFER_MM_BACKEND, "cutlass")


def flashinfer_w4a16_backend() -> str:
    """``NVFP4_PLUGIN_FLASHINFER_W4A16_BACKEND`` as given (the caller checks it), or ``"cute-dsl"``."""
    return _read(FLASHINFER_W4A16_BACKEND, "cute-dsl")


def log_level() -> str:
    """``NVFP4_PLUGIN_LOG_LEVEL`` in upper case, or ``"INFO"``."""
    return _read(LOG_LEVEL, "INFO").upper()


def gemm_config_dir() -> str | None:
    """``NVFP4_PLUGIN_GEMM_CONFIG_DIR`` (None or empty: the package's configs)."""
    return _read(GEMM_CONFIG_DIR)


def gemm_compile_only() -> bool:
    """``NVFP4_PLUGIN_GEMM_COMPILE_ONLY=1``."""
    return _read(GEMM_COMPILE_ONLY) == "1"


def fast_launch() -> bool:
    """``NVFP4_PLUGIN_FAST_LAUNCH`` is not ``0``."""
    return _read(FAST_LAUNCH) != "0"


def triton_interpret() -> bool:
    """``TRITON_INTERPRET=1`` (Triton's variable)."""
    return _read(TRITON_INTERPRET) == "1"


# ------------------------------------------------------------------------------------------------
# Set by the package (for this process before an import, for child processes, or around a compile)
# ------------------------------------------------------------------------------------------------

def default_gemm_compile_only() -> None:
    """``NVFP4_PLUGIN_GEMM_COMPILE_ONLY=1`` unless already set: call before nvfp4_plugin.gemm is imported,
    to compile kernels for the GPU even on a machine without one."""
    os.environ.setdefault(GEMM_COMPILE_ONLY, "1")


def compile_worker_env() -> dict[str, str]:
    """This process's environment for a child that compiles GEMM kernels for the GPU: with
    ``NVFP4_PLUGIN_GEMM_COMPILE_ONLY=1`` and without ``TRITON_INTERPRET``."""
    env = dict(os.environ, **{GEMM_COMPILE_ONLY: "1"})
    env.pop(TRITON_INTERPRET, None)
    return env


@contextlib.contextmanager
def triton_mma_v2() -> Iterator[None]:
    """Triton's ``DISABLE_MMA_V3=1`` inside the block (mma.sync instead of wgmma for the kernels compiled
    there), its previous value (or absence) restored after."""
    old = os.environ.get(DISABLE_MMA_V3)
    os.environ[DISABLE_MMA_V3] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(DISABLE_MMA_V3, None)
        else:
            os.environ[DISABLE_MMA_V3] = old
