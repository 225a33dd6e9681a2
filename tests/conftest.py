import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when jit functions are defined (its own library included), so the
# CPU interpreter must be chosen before anything imports triton: here, the one place the tests set it
# (pytest loads this file before any test module). Tests that start processes which must compile
# for a GPU remove it from the child's environment themselves.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _has_blackwell() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run make test-gpu on the GPU machine)")
    no_bw = pytest.mark.skip(reason="needs a Blackwell GPU (sm_100a/sm_103a)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "sm100" in item.keywords and not _has_blackwell():
            item.add_marker(no_bw)


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() and os.environ.get("NVFP4_TEST_DEVICE") != "cpu" else "cpu")
