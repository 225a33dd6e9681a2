"""Fork safety of the work the plugin does in an engine's launcher process.

vLLM (``vllm.LLM``, ``vllm serve``) parses the quantization config, and so runs our checkpoint
validation, in the parent process and then starts its engine core by ``fork``. PyTorch's CPU
kernels parallelize with GNU OpenMP, whose worker pool, once started, does not exist in a forked
child: the child's first parallel op then waits forever for it (a futex hang at start-up). Work
that may run in such a parent therefore stays on the calling thread.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def torch_single_threaded():
    """Run the enclosed torch CPU ops on the calling thread only (no OpenMP pool is started)."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
