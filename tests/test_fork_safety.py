"""What the plugin does in an engine's launcher process must leave a forked child able to run torch.

vLLM validates the checkpoint through our config in the parent (``maybe_update_config``) and then
forks its engine core; a parent whose torch CPU ops had started GNU OpenMP's pool hung the child at
its first parallel op. The vLLM path itself is tested in tests/engines/test_vllm_registration.py.
"""

import subprocess
import sys
import textwrap

import pytest

from nvfp4_plugin.checkpoints.quantize import quantize_checkpoint
from nvfp4_plugin.checkpoints.random_model import make_model

#: Run in a fresh interpreter: ``SETUP`` as the launcher would, then fork a child that runs a
#: parallel torch op (50M elements: far above ATen's grain size) and report whether it finished.
FORK_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    torch.set_num_threads(max(2, torch.get_num_threads()))   # the hazard needs a pool of >= 2 threads
    {setup}
    pid = os.fork()
    if pid == 0:
        ok = float((torch.zeros(50_000_000) + 1).sum()) == 50_000_000
        os._exit(0 if ok else 3)
    deadline = time.time() + 20
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            sys.exit(os.waitstatus_to_exitcode(status))
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    print("forked child hung", flush=True)
    sys.exit(4)
""")


def run_fork_child(setup: str) -> subprocess.CompletedProcess:
    code = FORK_CHILD.format(setup=textwrap.indent(textwrap.dedent(setup), "").strip())
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    """ModelOpt checkpoint of the "small" Llama: block scales of up to 5632 x 64 (parallel-sized ops)."""
    base = tmp_path_factory.mktemp("fork")
    make_model(base / "src", "llama", "small", device="cpu")
    quantize_checkpoint(base / "src", base / "q", calibration=False, method="rtn", device="cpu",
                        progress=False)  # rtn: the fastest; the method does not matter here
    return base / "q"


def test_parallel_work_in_parent_hangs_a_forked_child():
    """The hazard is real on this machine: without it the next test could not fail."""
    res = run_fork_child("(torch.randn(8_000_000).abs() > 3).sum()")
    assert res.returncode == 4, (res.returncode, res.stdout, res.stderr[-2000:])


def test_validate_checkpoint_then_fork(small_checkpoint):
    res = run_fork_child(f"""
        from nvfp4_plugin.checkpoints import validate_checkpoint
        validate_checkpoint({str(small_checkpoint)!r})
    """)
    assert res.returncode == 0, (res.returncode, res.stdout, res.stderr[-2000:])
