"""Our Blackwell linear backend's calls against the installed flashinfer-python (the version vLLM 0.26.0's
bundle carries): the signature of mm_fp4, and FlashInfer's own argument checks run on exactly what our
backend hands over. CPU only (FlashInfer's Python API imports without a GPU)."""

import inspect
import typing

import pytest
import torch

from tests._require import require

flashinfer = require("flashinfer")

from nvfp4_plugin import numerics as nx  # noqa: E402
from nvfp4_plugin import reference  # noqa: E402
from nvfp4_plugin.layers.backends import flashinfer_fp4 as fb  # noqa: E402
from nvfp4_plugin.layers.base import LinearSpec  # noqa: E402
from nvfp4_plugin.weights import Nvfp4Weight  # noqa: E402

from ..emulators import flashinfer_mm_fp4 as emu  # noqa: E402


def test_mm_fp4_signature_takes_our_call():
    assert flashinfer.__version__ == "0.6.14"
    sig = inspect.signature(flashinfer.mm_fp4)
    names = list(sig.parameters)
    # we pass a, b, a_descale, b_descale, alpha, out_dtype positionally and backend= by name
    assert names[:6] == ["a", "b", "a_descale", "b_descale", "alpha", "out_dtype"]
    allowed = typing.get_args(sig.parameters["backend"].annotation)
    assert set(fb.MM_BACKENDS) <= set(allowed), allowed
    # the emulator takes the same parameters, in the same order
    assert list(inspect.signature(emu.mm_fp4).parameters) == names


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_accepts_what_our_backend_hands_over(monkeypatch, dtype):
    from flashinfer.gemm import gemm_base

    n, k, m = 192, 512, 33
    w = torch.randn(n, k) * 0.02
    gs = nx.tensor_global_scale(w)
    p, s = reference.scaled_fp4_quant(w.bfloat16(), gs.reshape(1), swizzle=False)
    weight = Nvfp4Weight(p, s, gs.reshape(1).expand(n).float().contiguous())
    x = torch.randn(m, k).to(dtype)
    in_gs = nx.tensor_global_scale(x.float()).reshape(())

    class Emu:
        mm_fp4 = staticmethod(emu.mm_fp4)

    monkeypatch.setattr(fb, "flashinfer_module", lambda: Emu)
    emu.calls.clear()
    be = fb.FlashInferLinear()
    t, meta = be.prepare(LinearSpec(n, k, dtype, "w4a4", torch.device("cpu")), weight, in_gs)
    be.apply(t, meta, x)
    (c,) = emu.calls
    assert gemm_base._check_mm_fp4_problem_size(c["a"], c["b"], c["a_descale"], c["b_descale"], c["alpha"],
                                                c["out_dtype"], None, 16, False, c["backend"], True, True)
    # and FlashInfer refuses what the emulator refuses
    with pytest.raises(ValueError):
        gemm_base._check_mm_fp4_problem_size(c["a"], c["b"], c["a_descale"], c["b_descale"],
                                             c["alpha"].double(), c["out_dtype"])
