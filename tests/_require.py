"""Optional test dependencies that a given environment must have.

``require("vllm")`` imports and returns the module. Where it is missing the test module is skipped,
unless the module's top-level name is listed in ``NVFP4_TEST_REQUIRE`` (comma-separated): the
environments built to run those tests (make test-engines, make test-core) list what they install,
so there a broken install fails the run instead of skipping its tests.
"""

from __future__ import annotations

import importlib
import os

import pytest


def required_here() -> set[str]:
    return {m.strip() for m in os.environ.get("NVFP4_TEST_REQUIRE", "").split(",") if m.strip()}


def require(name: str):
    if name.split(".")[0] in required_here():
        return importlib.import_module(name)  # an ImportError here fails the run, with its traceback
    return pytest.importorskip(name)


def skip_module(name: str, reason: str) -> None:
    """Skip the calling test module for ``reason``, or fail it where ``name`` is required here."""
    if name in required_here():
        pytest.fail(f"{name} is required in this environment (NVFP4_TEST_REQUIRE) but unusable: {reason}",
                    pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_triton_kernels() -> None:
    """The preamble of the Triton kernel test modules: Triton required (or the module skipped, see
    require), and skipped or failed where this Triton's interpreter cannot run the kernels (tests/conftest.py
    chooses the interpreter where there is no GPU)."""
    import torch

    require("triton")
    from nvfp4_plugin.triton import _runtime as rt

    if not torch.cuda.is_available() and rt.interpreter_problem():
        skip_module("triton", rt.interpreter_problem())
