"""The reference and the layer core on CUDA: same bytes as on the CPU, and CUDA-graph capturable."""

import pytest
import torch

from nvfp4_plugin import numerics as nx
from nvfp4_plugin import reference as ref
from nvfp4_plugin.layers import Nvfp4FusedMoE, Nvfp4Linear
from nvfp4_plugin.weights import Nvfp4Weight

pytestmark = pytest.mark.gpu


def same(a, b):
    a, b = a.cpu(), b.cpu()
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b) if not a.is_floating_point() else torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def test_reference_ops_are_device_agnostic():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 7168, generator=g) * 3).to(torch.bfloat16)
    x[0, 5], x[1, :16], x[2, 7] = float("nan"), 0, float("inf")
    gs = nx.tensor_global_scale(x).reshape(1)
    for fn in (lambda t, s: ref.scaled_fp4_quant(t, s), lambda t, s: ref.scaled_fp4_quant(t, s, scale_format="ue8m0"),
               lambda t, s: ref.mxfp4_quantize(t), lambda t, s: ref.mxfp8_quantize(t, "e5m2", scale_recipe="rceil"),
               lambda t, s: ref.per_token_group_quant_fp8(t, column_major_scales=True, scale_ue8m0=True),
               lambda t, s: ref.per_token_quant_fp8(t)):
        for a, b in zip(fn(x, gs), fn(x.cuda(), gs.cuda())):
            assert same(a, b)
    eo = torch.tensor([0, 0, 100, 250, 300], dtype=torch.int32)
    bo = nx.blockscale_offsets_from_expert_offsets(eo)
    egs = torch.tensor([1.0, 50.0, 3.0, 800.0])
    for a, b in zip(ref.scaled_fp4_experts_quant(x, egs, eo, bo),
                    ref.scaled_fp4_experts_quant(x.cuda(), egs.cuda(), eo.cuda(), bo.cuda())):
        assert same(a, b)
    xm = x[:256].reshape(4, 64, 7168)
    mask = torch.tensor([0, 5, 64, 30], dtype=torch.int32)
    for a, b in zip(ref.silu_and_mul_scaled_fp4_experts_quant(xm, egs, mask),
                    ref.silu_and_mul_scaled_fp4_experts_quant(xm.cuda(), egs.cuda(), mask.cuda())):
        assert same(a, b)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_layers_capture_in_cuda_graphs(mode, monkeypatch):
    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", mode)
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    w = Nvfp4Weight.quantize(torch.randn(512, 256, generator=g)).to(dev)
    lin = Nvfp4Linear(w, torch.tensor([300.0], device=dev))
    e, h, inter, t = 8, 256, 128, 16
    moe = Nvfp4FusedMoE(Nvfp4Weight.quantize(torch.randn(e, 2 * inter, h, generator=g)).to(dev),
                        Nvfp4Weight.quantize(torch.randn(e, h, inter, generator=g)).to(dev),
                        torch.full((e,), 500.0, device=dev), torch.full((e,), 900.0, device=dev))
    x = torch.randn(t, 256, device=dev, dtype=torch.bfloat16)
    tw, ti = ref.route_topk(torch.randn(t, e, device=dev), 2)
    eager = (lin(x), moe(x, tw, ti))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture
        lin(x), moe(x, tw, ti)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = (lin(x), moe(x, tw, ti))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], lin(x)) and torch.equal(out[1], moe(x, tw, ti))
    assert not torch.equal(out[0], eager[0])
