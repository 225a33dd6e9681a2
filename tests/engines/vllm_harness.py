"""Build real vLLM layers on a CPU machine (vLLM's CPU platform, a 1-process gloo group), with
tensor parallelism simulated by patching the TP rank/size that layers and parameters read, and expert
parallelism by vLLM's own flag on top of it."""

from __future__ import annotations

import contextlib
import os
import tempfile
from unittest import mock

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402
import vllm.platforms as _platforms  # noqa: E402

if not torch.cuda.is_available():
    from vllm.platforms.cpu import CpuPlatform

    _platforms._current_platform = CpuPlatform()

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402

_STARTED = False


def start():
    """vLLM config context + distributed state, once per process."""
    global _STARTED
    if _STARTED:
        return
    ctx = set_current_vllm_config(VllmConfig())
    ctx.__enter__()
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"file://{tempfile.mktemp()}", backend="gloo")
    initialize_model_parallel(1, 1)
    from vllm.v1.worker.workspace import init_workspace_manager

    init_workspace_manager(torch.device("cpu"))     # the modular MoE kernels take their buffers from it
    import nvfp4_plugin.engines.vllm as nv

    nv.register()
    _STARTED = True


@contextlib.contextmanager
def simulated_tp(size: int, rank: int):
    """Layers and vLLM parameters built inside see ``size`` ranks and are rank ``rank``."""
    targets = ["vllm.model_executor.layers.linear", "vllm.model_executor.parameter",
               "vllm.model_executor.layers.vocab_parallel_embedding", "vllm.model_executor.layers.fused_moe.config"]
    with contextlib.ExitStack() as st:
        for t in targets:
            mod = __import__(t, fromlist=["_"])
            if hasattr(mod, "get_tensor_model_parallel_world_size"):
                st.enter_context(mock.patch(f"{t}.get_tensor_model_parallel_world_size", return_value=size))
            st.enter_context(mock.patch(f"{t}.get_tensor_model_parallel_rank", return_value=rank))
        yield


@contextlib.contextmanager
def simulated_ep(size: int, rank: int):
    """``--tensor-parallel-size size --enable-expert-parallel`` as rank ``rank``: MoE layers built inside hold
    experts ``[rank * E / size, (rank + 1) * E / size)`` whole (vLLM's linear placement) and get every token
    with global top-k ids and their ``expert_map``; the runner sums the ranks' outputs (the TP all-reduce)."""
    from vllm.config import get_current_vllm_config

    pc = get_current_vllm_config().parallel_config
    saved = pc.enable_expert_parallel
    pc.enable_expert_parallel = True
    try:
        with simulated_tp(size, rank):
            yield
    finally:
        pc.enable_expert_parallel = saved


_COUNTER = iter(range(10**9))


def unique_layer(idx_base: str = "mlp.experts") -> str:
    """vLLM registers every MoE layer by name in the current config: each test layer needs its own."""
    return f"model.layers.{next(_COUNTER)}.{idx_base}"
