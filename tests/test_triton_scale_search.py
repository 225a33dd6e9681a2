"""The Triton twin of the ``mse`` block-scale search, byte for byte against the torch version (CPU:
Triton's interpreter; GPU: the same tests on CUDA, plus a model-sized tensor)."""

import pytest
import torch

from tests._require import require_triton_kernels

require_triton_kernels()

from nvfp4_plugin import numerics as nx  # noqa: E402
from nvfp4_plugin.checkpoints import scale_search as ss  # noqa: E402
from nvfp4_plugin.triton import scale_search as ts  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy inf/nan warnings (interpreter)
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _x(kind, rows=24, k=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    if kind == "outliers":
        x = x * torch.where(torch.rand(rows, k, generator=g) < 0.02, 40.0, 1.0)
    elif kind == "decades":
        x = x * torch.logspace(-5, 1, rows)[:, None]
    x[0, :32] = 0.0
    return x.bfloat16()


@pytest.mark.parametrize("kind", ["gauss", "outliers", "decades"])
@pytest.mark.parametrize("weighted", [False, True])
def test_triton_search_equals_torch(kind, weighted):
    x = _x(kind, seed=len(kind))
    gs = nx.tensor_global_scale(x.float())
    w = torch.rand(x.shape[-1], generator=torch.Generator().manual_seed(9)) * 4 if weighted else None
    ref = ss.search_block_scales(x.float(), gs, col_weight=w)
    got = ts.search_block_scales(x.to(DEV), gs.to(DEV), col_weight=None if w is None else w.to(DEV))
    assert torch.equal(got.cpu().view(torch.uint8), ref.view(torch.uint8))


def test_triton_search_checks_its_input():
    with pytest.raises(ValueError, match="multiple of 16"):
        ts.search_block_scales(torch.zeros(2, 24, device=DEV), torch.ones(()))
    with pytest.raises(ValueError, match="col_weight: expected 32"):
        ts.search_block_scales(torch.zeros(2, 32, device=DEV), torch.ones(()), col_weight=torch.ones(16))


@pytest.mark.gpu
def test_gpu_triton_search_on_a_model_sized_tensor():
    x = _x("outliers", rows=4096, k=4096, seed=3).cuda()
    gs = nx.tensor_global_scale(x.float())
    w = torch.rand(4096, device="cuda")
    got = ts.search_block_scales(x, gs, col_weight=w)
    ref = ss.search_block_scales(x.float(), gs.cuda(), col_weight=w)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
