"""bench_gemm's Humming peer: vLLM's NVFP4 Humming linear kernel is set up the way vLLM's NVFP4 schemes hand a
layer to it (checked on the CPU against this vLLM; the kernel itself needs a GPU and vLLM's ``humming`` package,
so the conversion it starts is replaced here and the benchmark times the real one on the GPU machine)."""

import torch

from tests._require import require

vllm = require("vllm")


def test_humming_peer_reaches_hummings_loader_with_vllms_conventions(monkeypatch):
    import vllm.model_executor.kernels.linear.nvfp4.humming as H

    from benchmarks import bench_gemm as G
    from nvfp4_plugin.gemm.layout import unpack

    seen = {}

    def fake_prepare(layer, quant_config):
        seen["config"] = quant_config
        seen["params"] = {k: v.detach().clone() for k, v in layer.named_parameters()}
        seen["attrs"] = (layer.input_size_per_partition, layer.output_partition_sizes, layer.params_dtype,
                         layer.has_bias)

    monkeypatch.setattr(H, "prepare_humming_layer", fake_prepare)
    monkeypatch.setattr(H.HummingNvFp4LinearKernel, "is_supported", classmethod(lambda cls, cc=None: (True, None)))
    n, k = 64, 128
    p = G.random_packed((), n, k, device="cpu", seed=3)
    peer, reason = G.humming_or_reason(p)
    assert peer is not None, reason
    w = unpack(p)
    # humming's compressed-tensors NVFP4 loader, with the checkpoint's tensors under its names
    assert seen["config"]["format"] == "nvfp4-pack-quantized" and seen["config"]["group_size"] == 16
    params = seen["params"]
    assert set(params) == {"weight_packed", "weight_scale", "weight_global_scale"}
    assert torch.equal(params["weight_packed"], w.packed.reshape(n, -1))
    assert torch.equal(params["weight_scale"].view(torch.uint8), w.block_scale.reshape(n, -1).view(torch.uint8))
    # vLLM's schemes hand over the decode scale 1/gs; the kernel gives humming the encode scale gs back
    assert torch.allclose(params["weight_global_scale"], w.global_scale.reshape(-1)[0].float(), rtol=1e-6)
    assert seen["attrs"] == (k, [n], torch.bfloat16, False)
