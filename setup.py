"""Build script of nvfp4-plugin (metadata lives in pyproject.toml).

The package is pure Python and always installs. The CUDA extension ``nvfp4_plugin._C`` (csrc/) is
built as well when the build environment can import a CUDA build of torch and finds a CUDA
toolkit; otherwise the build says why it skipped it and the ops use their Triton or reference
backends. With pip's default build isolation torch is not importable, so a CUDA build needs
``pip install --no-build-isolation`` or an in-place build:

    NVFP4_PLUGIN_CUDA_ARCHS=9.0a python3 setup.py build_ext --inplace

Environment:
    NVFP4_PLUGIN_CUDA_ARCHS   ";"-separated targets, default "9.0a;10.0a;10.3a" (arch-specific: the
                              kernels use sm_90a / sm_100a / sm_103a instructions).
    NVFP4_PLUGIN_SKIP_CUDA=1  never build the extension.
    NVFP4_PLUGIN_REQUIRE_EXT_BUILD=1  fail instead of skipping it (the serving image's docker/build.sh).
    MAX_JOBS                  parallel compile jobs (torch's BuildExtension, with ninja).
"""

from __future__ import annotations

import os
import re
import sys

from setuptools import setup

DEFAULT_ARCHS = "9.0a;10.0a;10.3a"
CSRC_SOURCES = ["csrc/bindings.cpp", "csrc/quant/nvfp4_quant.cu", "csrc/quant/fp8_quant.cu"]
# Device-code flags: IEEE fp32 (no FMA contraction of the numerics' op sequences, no fast math,
# denormals kept), C++17. Keep in sync with tests/test_csrc_compile.py.
NVCC_FLAGS = ["-O3", "-std=c++17", "-fmad=false", "--expt-relaxed-constexpr"]


def _log(msg: str) -> None:
    print(f"nvfp4-plugin setup: {msg}", file=sys.stderr, flush=True)


def _skip(msg: str):
    """No CUDA extension: say why, or stop where it is required."""
    if os.environ.get("NVFP4_PLUGIN_REQUIRE_EXT_BUILD", "") not in ("", "0"):
        raise SystemExit(f"nvfp4-plugin setup: NVFP4_PLUGIN_REQUIRE_EXT_BUILD is set but {msg}")
    _log(msg)
    return [], {}


def parse_archs(spec: str) -> list[tuple[str, str]]:
    """"9.0a;10.0a" -> [("90a", "sm_90a"), ("100a", "sm_100a")]."""
    out = []
    for item in re.split(r"[;, ]+", spec.strip()):
        if not item:
            continue
        m = re.fullmatch(r"(\d+)\.(\d)([af]?)", item)
        if m is None:
            raise ValueError(f"NVFP4_PLUGIN_CUDA_ARCHS: expected entries like 9.0a or 10.0a, got {item!r}")
        num = f"{m.group(1)}{m.group(2)}{m.group(3)}"
        out.append((num, f"sm_{num}"))
    if not out:
        raise ValueError("NVFP4_PLUGIN_CUDA_ARCHS: no architecture given")
    return out


def cuda_extension():
    """(ext_modules, cmdclass) for the CUDA build, or ([], {}) with the reason logged."""
    if os.environ.get("NVFP4_PLUGIN_SKIP_CUDA", "") not in ("", "0"):
        return _skip("NVFP4_PLUGIN_SKIP_CUDA is set: building without the CUDA extension")
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception as exc:  # no torch in an isolated build environment, or a broken install
        return _skip(f"torch is not importable here ({type(exc).__name__}: {exc}); building without the CUDA "
                     "extension (use --no-build-isolation with a CUDA build of torch to build it)")
    if torch.version.cuda is None:
        return _skip(f"torch {torch.__version__} is a CPU build: building without the CUDA extension")
    if CUDA_HOME is None:
        return _skip("no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH): building without the CUDA extension")
    archs = parse_archs(os.environ.get("NVFP4_PLUGIN_CUDA_ARCHS", DEFAULT_ARCHS))
    # torch's headers need C++20 from torch 2.14 on; C++17 before (the engines' torch 2.11)
    major_minor = tuple(int(v) for v in re.findall(r"\d+", torch.__version__)[:2])
    std = "c++20" if major_minor >= (2, 14) else "c++17"
    gencode = [f"-gencode=arch=compute_{num},code={sm}" for num, sm in archs]
    built = "+".join(sm for _, sm in archs)
    define = f"-DNVFP4_BUILT_ARCHS={built}"  # tokens, stringified in bindings.cpp (no quoting issues)
    root = os.path.dirname(os.path.abspath(__file__))
    _log(f"building nvfp4_plugin._C for {built} with torch {torch.__version__} (CUDA {torch.version.cuda}, "
         f"toolkit {CUDA_HOME})")
    ext = CUDAExtension(
        name="nvfp4_plugin._C",
        sources=CSRC_SOURCES,
        include_dirs=[os.path.join(root, "csrc")],
        extra_compile_args={"cxx": ["-O3", f"-std={std}", define],
                            "nvcc": [f if f != "-std=c++17" else f"-std={std}" for f in NVCC_FLAGS] + gencode},
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = cuda_extension()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
