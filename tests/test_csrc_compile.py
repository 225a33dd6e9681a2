"""CPU-only checks of the CUDA sources: compile every kernel file for sm_90a, sm_100a and sm_103a,
dump the SASS with cuobjdump and check the instructions the numerics and the speed rely on.

* sm_100a / sm_103a NVFP4 kernels contain the hardware FP4 conversion
  (``F2FP.SATFINITE.E2M1.F32...``, from ``cvt.rn.satfinite.e2m1x2.f32``); sm_90a ones do not
  (software twin).
* FP8 conversions are ``F2FP.SATFINITE.E4M3...`` instructions (seed file 003: not a software routine).
* No quantization kernel contains a ``CALL`` (no division or conversion slow-path subroutines).
* The torch binding compiles against the installed torch headers (syntax check, no CUDA torch needed).

Needs nvcc (skips without it) and cuobjdump + nvdisasm (the nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm wheels of the test extras).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
KERNEL_SOURCES = sorted((CSRC / "quant").glob("*.cu"))
HOST_DRIVER_SOURCE = CSRC / "tests" / "host_numerics.cu"
ARCHS = ("sm_90a", "sm_100a", "sm_103a")
# The flags a torch CUDAExtension build uses for the device code (setup.py's plus torch's own
# COMMON_NVCC_FLAGS), minus -gencode.
NVCC_FLAGS = ["-std=c++17", "-O3", "-fmad=false", "--expt-relaxed-constexpr", "-D__CUDA_NO_HALF_OPERATORS__",
              "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
              "-I", str(CSRC)]


def _wheel_bin(name: str) -> Path | None:
    """A CUDA tool shipped by an nvidia-* wheel (nvidia/cu13/bin or nvidia/cuda_*/bin)."""
    try:
        import nvidia  # namespace package of the NVIDIA wheels
    except ImportError:
        return None
    for base in getattr(nvidia, "__path__", []):
        for cand in sorted(Path(base).glob(f"*/bin/{name}")):
            if os.access(cand, os.X_OK):
                return cand
    return None


@lru_cache(maxsize=None)
def find_tool(name: str) -> str | None:
    env = os.environ.get(name.upper())
    if env and os.access(env, os.X_OK):
        return env
    wheel = _wheel_bin(name)
    if wheel is not None:
        return str(wheel)
    found = shutil.which(name)
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", name), os.X_OK):
            return os.path.join(home, "bin", name)
    return None


def find_nvcc() -> str | None:
    env = os.environ.get("NVCC")
    if env and os.access(env, os.X_OK):
        return env
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return None


def build_host_driver(out_dir: Path) -> Path:
    """Build csrc/tests/host_numerics.cu as a host program (no GPU needed to run it)."""
    exe = out_dir / "host_numerics"
    cmd = [find_nvcc(), "-std=c++17", "-O2", "-arch=sm_90a", "-Xcompiler", "-ffp-contract=off", "-I", str(CSRC),
           "-o", str(exe), str(HOST_DRIVER_SOURCE)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"host driver build failed:\n{' '.join(cmd)}\n{res.stderr[-4000:]}"
    return exe


def parse_sass(text: str) -> dict[str, list[str]]:
    """cuobjdump -sass output -> {mangled function name: [instruction mnemonics with modifiers]}."""
    funcs: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            current = m.group(1)
            funcs[current] = []
            continue
        if current is None:
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            funcs[current].append(m.group(1))
    return funcs


@pytest.fixture(scope="module")
def sass(tmp_path_factory):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (CUDA toolkit needed to compile csrc)")
    cuobjdump, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if cuobjdump is None or nvdisasm is None:
        pytest.fail("cuobjdump and nvdisasm are needed for the SASS checks: "
                    "pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm (the test extras)")
    out = tmp_path_factory.mktemp("cubins")
    jobs = [(src, arch) for src in KERNEL_SOURCES for arch in ARCHS]

    def compile_one(job):
        src, arch = job
        cubin = out / f"{src.stem}.{arch}.cubin"
        cmd = [nvcc, *NVCC_FLAGS, f"-arch={arch}", "-cubin", "-o", str(cubin), str(src)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        return job, cubin, cmd, res

    env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", ""),
               NVDISASM_PATH=os.path.dirname(nvdisasm))
    result: dict[tuple[str, str], dict[str, list[str]]] = {}
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        for (src, arch), cubin, cmd, res in pool.map(compile_one, jobs):
            assert res.returncode == 0, f"nvcc failed:\n{' '.join(cmd)}\n{res.stderr[-4000:]}"
            assert "warning" not in res.stderr.lower(), res.stderr[-4000:]
            dump = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, env=env)
            assert dump.returncode == 0, dump.stderr
            funcs = parse_sass(dump.stdout)
            assert funcs, f"no functions in the SASS of {cubin.name}"
            result[(src.stem, arch)] = funcs
    return result


def _kernels(sass, stem, arch, pattern):
    funcs = {k: v for k, v in sass[(stem, arch)].items() if re.search(pattern, k)}
    assert funcs, f"no kernel matching {pattern!r} in {stem} for {arch}"
    return funcs


def test_sources_exist():
    assert {p.name for p in KERNEL_SOURCES} >= {"nvfp4_quant.cu", "fp8_quant.cu"}


@pytest.mark.parametrize("arch", ARCHS)
def test_no_subroutine_calls(sass, arch):
    for stem in (p.stem for p in KERNEL_SOURCES):
        for name, ins in sass[(stem, arch)].items():
            calls = [i for i in ins if i.startswith("CALL")]
            assert not calls, f"{name} ({arch}) calls a subroutine: {calls[:3]}"


@pytest.mark.parametrize("arch", ARCHS)
def test_nvfp4_kernels_use_the_right_twin(sass, arch):
    kernels = _kernels(sass, "nvfp4_quant", arch, r"nvfp4_(dense|experts|masked)_kernel")
    # dense: 3 dtypes x swizzle x UE8M0, + the row-group tiling of the swizzled ones; + the bf16 SiLU-table
    # variants of the masked kernel (zero_fill off/on)
    assert len(kernels) == 12 + 6 + 3 + 12 + 2
    for name, ins in kernels.items():
        e2m1 = [i for i in ins if i.startswith("F2FP") and "E2M1" in i]
        if arch == "sm_90a":
            assert not e2m1, f"{name}: sm_90a has no FP4 conversion, the software twin must be used"
        else:
            assert any(i.startswith("F2FP.SATFINITE.E2M1.F32") for i in e2m1), \
                f"{name} ({arch}) lacks the hardware FP4 conversion"
        # the e4m3 block scale is the hardware conversion too (UE8M0 dense kernels have no e4m3)
        if not re.search(r"nvfp4_dense_kernelI(?:f|6__half|13__nv_bfloat16)Lb[01]ELb1E", name):
            assert any(i.startswith("F2FP.SATFINITE.E4M3") for i in ins), f"{name} ({arch}): no F2FP e4m3"


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_kernels_convert_with_f2fp(sass, arch):
    kernels = _kernels(sass, "fp8_quant", arch, r"fp8_(group|token|static|dynamic_fused)_kernel")
    for name, ins in kernels.items():
        assert any(i.startswith("F2FP.SATFINITE.E4M3") for i in ins), f"{name} ({arch}): no F2FP e4m3"


# global memory instructions (generic LD / ST / ATOM may address global memory too)
_GLOBAL_MEM = re.compile(r"^(LDG|STG|ATOMG|RED|LDGSTS|UBLKCP|UTMA|LD\.|ST\.|ATOM\.)")


@pytest.mark.parametrize("arch", ARCHS)
def test_kernels_wait_for_their_dependencies_first(sass, arch):
    """Programmatic dependent launch (kernel_utils.cuh, pdl_enter): a kernel launched with the PDL attribute may
    start while the kernel before it still runs, so its griddepcontrol.wait (ACQBULK) must come before its first
    global memory access, and it triggers its dependents (PREEXIT)."""
    for stem in (p.stem for p in KERNEL_SOURCES):
        for name, ins in sass[(stem, arch)].items():
            assert "ACQBULK" in ins, f"{name} ({arch}): no griddepcontrol.wait"
            assert "PREEXIT" in ins, f"{name} ({arch}): no griddepcontrol.launch_dependents"
            first_mem = next((i for i, x in enumerate(ins) if _GLOBAL_MEM.match(x)), len(ins))
            assert ins.index("ACQBULK") < first_mem, \
                f"{name} ({arch}): {ins[first_mem]} before the griddepcontrol.wait"


def test_binding_compiles_against_torch_headers(tmp_path):
    """Syntax-check csrc/bindings.cpp with the installed torch's headers (CPU builds ship them)."""
    torch = pytest.importorskip("torch")
    from torch.utils import cpp_extension

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (its cuda_runtime headers are needed)")
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), str(Path(nvcc).resolve().parents[1]),
             "/usr/local/cuda"]
    cuda_include = next((Path(h) / "include" for h in homes if h and (Path(h) / "include" / "cuda_runtime_api.h").is_file()),
                        None)
    if cuda_include is None:
        pytest.skip("cuda_runtime_api.h not found (set CUDA_HOME)")
    includes = [*cpp_extension.include_paths(), str(cuda_include), str(CSRC)]
    if not any((Path(p) / "c10" / "cuda" / "CUDAStream.h").is_file() for p in includes):
        pytest.skip(f"torch {torch.__version__} ships no c10/cuda headers")
    if not any((Path(p) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").is_file() for p in includes):
        # CPU wheels lack this one generated header; its CUDA-build content is a single define
        stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True)
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes.append(str(tmp_path / "stub"))
    cmd = [cxx, "-std=c++17", "-fsyntax-only", "-DNVFP4_BUILT_ARCHS=sm_90a+sm_100a", "-DTORCH_EXTENSION_NAME=_C",
           f"-I{sys.base_prefix}/include/python{sys.version_info.major}.{sys.version_info.minor}",
           *[f"-I{p}" for p in includes], str(CSRC / "bindings.cpp")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-6000:]
