"""The modules of nvfp4_plugin where an import cycle could hide import first in a fresh interpreter.

An import cycle only fails when a module of the cycle is the first one imported, so each module below
gets its own ``python -c "import <module>"`` (the processes run in parallel). Each costs a torch
import (about 2 s of CPU), so the list holds the modules that can close a cycle rather than all 60:
the packages whose ``__init__`` imports their parts, the op registry and the backend modules it
reads, and the modules that import across packages at start-up (envs, layers, cli, the engine
adapters). A module that needs an optional dependency this environment lacks (vllm, sglang,
flashinfer, triton) is skipped, unless NVFP4_TEST_REQUIRE lists that dependency (tests/_require.py).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests._require import required_here

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL_DEPENDENCIES = ("vllm", "sglang", "flashinfer", "triton")
TIMEOUT_S = 120

MODULES = (
    "nvfp4_plugin",
    "nvfp4_plugin.envs",
    "nvfp4_plugin._checks",
    "nvfp4_plugin.reference",
    "nvfp4_plugin.ops",
    "nvfp4_plugin.ops._registry",
    "nvfp4_plugin._cuda_ops",
    "nvfp4_plugin._cuda_register",
    "nvfp4_plugin.triton",
    "nvfp4_plugin.triton._register",
    "nvfp4_plugin.gemm",
    "nvfp4_plugin.layers",
    "nvfp4_plugin.layers.base",
    "nvfp4_plugin.layers.deploy",
    "nvfp4_plugin.checkpoints",
    "nvfp4_plugin.cli",
    "nvfp4_plugin.engines.vllm",
    "nvfp4_plugin.engines.sglang",
)


def _import_alone(module: str) -> tuple[int, str]:
    try:
        proc = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return -1, f"import {module} took more than {TIMEOUT_S} s"
    return proc.returncode, proc.stderr


@pytest.fixture(scope="module")
def outcomes() -> dict[str, tuple[int, str]]:
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return dict(zip(MODULES, pool.map(_import_alone, MODULES)))


def _missing_optional(stderr: str) -> str | None:
    """The optional dependency whose absence made the import fail, or None."""
    m = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", stderr)
    if m is None:
        return None
    top = m.group(1).split(".")[0]
    if top in OPTIONAL_DEPENDENCIES and importlib.util.find_spec(top) is None:
        return top
    return None


def test_listed_modules_exist():
    for name in MODULES:
        path = ROOT.joinpath(*name.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), name


@pytest.mark.parametrize("module", MODULES)
def test_imports_first_in_a_fresh_interpreter(outcomes, module):
    rc, stderr = outcomes[module]
    if rc == 0:
        return
    dep = _missing_optional(stderr)
    if dep is not None and dep not in required_here():
        pytest.skip(f"{module} needs {dep}, not installed here")
    tail = "\n".join(stderr.strip().splitlines()[-15:])
    pytest.fail(f"import {module} as the first import of a fresh interpreter failed (exit {rc}):\n{tail}",
                pytrace=False)


def test_op_backend_modules_import_nothing_of_ops():
    """nvfp4_plugin.ops imports its backend modules (by name, so no import statement shows it); they must
    not import ops back, or which module comes first decides what is registered."""
    from nvfp4_plugin import ops

    code = ("import sys\n" + "".join(f"import {m}\n" for m in ops.BACKEND_MODULES)
            + "print(sorted(m for m in sys.modules if m == 'nvfp4_plugin.ops' or m.startswith('nvfp4_plugin.ops.')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"{ops.BACKEND_MODULES} import {proc.stdout.strip()}"
