"""Expert parallelism with the nvfp4 fused-MoE method in vLLM 0.26's RoutedExperts, two ranks simulated
in one process (vllm_harness.simulated_ep), weights loaded through vLLM's own loader.

* ``--tensor-parallel-size 2 --enable-expert-parallel`` (no all-to-all: every rank gets every token with
  global ids and its expert_map): each rank computes its own experts only, bit for bit what TP=1 computes
  for those pairs, and the ranks' outputs sum to the TP=1 output.
* The all-to-all formats, with vLLM's communication-free prepare/finalize classes standing in for DeepEP
  and friends (which need deep_ep / nixl_ep and several GPUs): the batched-experts format of vLLM's
  reference ``BatchedPrepareAndFinalize`` runs our masked path (and says so in the log), the standard
  format of ``MoEPrepareAndFinalizeNoDPEPModular`` our standard experts with the expert map.

vLLM's router needs its compiled kernels, so routing comes from reference.route_topk and the routed
experts run through RoutedExperts.forward_modular (what the runner calls)."""

import logging
from unittest import mock

import pytest
import torch

from tests._require import require

vllm = require("vllm")

from nvfp4_plugin import reference as ref  # noqa: E402
from nvfp4_plugin.layers import registry  # noqa: E402
from nvfp4_plugin.weights import Nvfp4Weight  # noqa: E402

from .ckpt_helpers import module_tensors  # noqa: E402
from .test_vllm_linear import MODELOPT  # noqa: E402
from .vllm_harness import simulated_ep, start, unique_layer  # noqa: E402

start()

from vllm.model_executor.layers.fused_moe import FusedMoE  # noqa: E402
from vllm.model_executor.layers.fused_moe.prepare_finalize import (BatchedPrepareAndFinalize,  # noqa: E402
                                                                   MoEPrepareAndFinalizeNoDPEPModular)

from nvfp4_plugin.engines import common  # noqa: E402
from nvfp4_plugin.engines.vllm import experts as ep  # noqa: E402
from nvfp4_plugin.engines.vllm import moe as vllm_moe  # noqa: E402
from nvfp4_plugin.engines.vllm.config import Nvfp4VllmConfig  # noqa: E402

E, H, INTER, T, TOPK, EP = 4, 64, 64, 9, 2, 2
E_LOCAL = E // EP


def checkpoint(seed=2):
    g = torch.Generator().manual_seed(seed)
    ckpt = []
    for ex in range(E):
        for name, scale in (("gate_proj", 1.0 + ex), ("up_proj", 0.1), ("down_proj", 1.0)):
            shape = (H, INTER) if name == "down_proj" else (INTER, H)
            q = Nvfp4Weight.quantize(torch.randn(*shape, generator=g) * scale)
            ckpt += [(f"{ex}.{name}.{k}", v) for k, v in module_tensors("modelopt", q).items()]
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    tw, ti = ref.route_topk(torch.randn(T, E, generator=g), TOPK)
    return ckpt, x, tw, ti


def build(ckpt, tp_size=1):
    moe = FusedMoE(num_experts=E, top_k=TOPK, hidden_size=H, intermediate_size=INTER, params_dtype=torch.bfloat16,
                   quant_config=Nvfp4VllmConfig.from_config(MODELOPT), tp_size=tp_size, prefix=unique_layer())
    experts = moe.routed_experts
    list(experts.load_weights(ckpt))
    experts.quant_method.process_weights_after_loading(experts)
    return experts


class Spy:
    """Records the top-k ids every standard forward of a layer receives."""

    def __init__(self, core):
        self.core, self.ids = core, []

    def __call__(self, x, topk_weights, topk_ids):
        self.ids.append(topk_ids.clone())
        return self.core(x, topk_weights, topk_ids)

    def __getattr__(self, name):
        return getattr(self.core, name)


def ep_rank(rank, ckpt):
    with simulated_ep(EP, rank):
        experts = build(ckpt, tp_size=EP)
    mp = experts.moe_config.moe_parallel_config
    assert mp.use_ep and mp.ep_size == EP and mp.ep_rank == rank and mp.tp_size == 1
    assert experts.local_num_experts == E_LOCAL and experts.nvfp4_core.spec.num_experts == E_LOCAL
    return experts


def owned(ti, rank):
    """Pairs routed to rank ``rank``'s experts (vLLM's linear placement: a contiguous block per rank)."""
    return (ti >= rank * E_LOCAL) & (ti < (rank + 1) * E_LOCAL)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_tp_ep_ranks_compute_their_experts_only_and_sum_to_tp1(mode, monkeypatch, caplog):
    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", mode)
    monkeypatch.setattr(common, "_PATHS_LOGGED", set())
    ckpt, x, tw, ti = checkpoint()
    full = build(ckpt)
    y1 = full.forward_modular(x, tw, ti)
    total, size = torch.zeros(T, H, dtype=torch.float64), y1.double().abs()
    with caplog.at_level(logging.INFO, logger="nvfp4_plugin"):
        for rank in range(EP):
            experts = ep_rank(rank, ckpt)
            assert experts.quant_method.moe_kernel is None          # no all-to-all: the method's own apply
            spy = experts.nvfp4_core = Spy(experts.nvfp4_core)
            y = experts.forward_modular(x, tw, ti)
            (ids,) = spy.ids
            mine = owned(ti, rank)
            # other ranks' experts reach the layer as -1 (never computed), ours as local ids
            assert torch.equal(ids, torch.where(mine, ti - rank * E_LOCAL, -1).to(ids.dtype))
            # bit for bit what TP=1 computes for the same pairs
            assert torch.equal(y, full.nvfp4_core(x, tw, torch.where(mine, ti, -1)))
            total += y.double()
            size += y.double().abs()
    # the TP all-reduce adds partial sums each rounded to bf16 once, TP=1 rounds their sum once: at most
    # half a bf16 ulp of each (the fp32 sums themselves agree: top-2, two terms)
    assert ((total - y1.double()).abs() <= 2 ** -8 * size).all()
    assert any("vLLM MoE expert parallel (TP+EP, no all-to-all): standard format [T, H] + global top-k ids mapped "
               "to local experts through expert_map" in r.getMessage() for r in caplog.records)


def batched_pf(layer):
    rank = layer.moe_config.moe_parallel_config.ep_rank
    return BatchedPrepareAndFinalize(max_num_tokens=T, num_local_experts=layer.local_num_experts,
                                     num_dispatchers=1, rank=rank)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_batched_experts_format_runs_the_masked_path(mode, monkeypatch, caplog):
    """vLLM's BatchedPrepareAndFinalize (the batched-experts format DeepEP low-latency and NIXL EP hand the
    experts, without their communication) in place of the all-to-all prepare/finalize: the method
    builds vLLM's modular kernel with our batched experts, which run forward_masked; each expert's valid
    rows are bit for bit the TP=1 standard forward of its tokens, and the ranks sum to TP=1."""
    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", mode)
    monkeypatch.setattr(common, "_PATHS_LOGGED", set())
    monkeypatch.setattr(registry, "_MASKED_LOGGED", set())
    monkeypatch.setattr(vllm_moe, "all2all_prepare_finalize", lambda moe_config, layer: batched_pf(layer))
    ckpt, x, tw, ti = checkpoint(seed=3)
    full = build(ckpt)
    y1 = full.forward_modular(x, tw, ti)
    total = torch.zeros(T, H, dtype=torch.float64)
    with caplog.at_level(logging.INFO, logger="nvfp4_plugin"):
        for rank in range(EP):
            experts = ep_rank(rank, ckpt)
            kernel = experts.quant_method.moe_kernel
            assert isinstance(kernel.fused_experts, ep.Nvfp4BatchedExperts)
            core = experts.nvfp4_core
            calls = []

            def forward_masked(xm, mask, out=None, _real=core.forward_masked):
                calls.append((xm.clone(), mask.clone()))
                y = _real(xm, mask, out=out)
                calls[-1] += (y.clone(),)
                return y

            with mock.patch.object(core, "forward_masked", forward_masked), \
                    mock.patch.object(type(core), "__call__", side_effect=AssertionError("standard path ran")):
                y = experts.forward_modular(x, tw, ti)
            ((xm, mask, ym),) = calls
            assert xm.shape == (E_LOCAL, T, H) and mask.dtype == torch.int32
            for el in range(E_LOCAL):
                tokens = (ti == rank * E_LOCAL + el).any(1).nonzero()[:, 0]      # the P/F's row order
                n = tokens.numel()
                assert int(mask[el]) == n
                want = full.nvfp4_core(x[tokens], torch.ones(n, 1), torch.full((n, 1), rank * E_LOCAL + el))
                assert torch.equal(ym[el, :n], want)
            total += y.double()
    # vLLM's naive batched combine multiplies and adds in bf16: a few bf16 roundings from TP=1
    assert (total - y1.double()).norm() / y1.double().norm() < 1e-2
    msgs = [r.getMessage() for r in caplog.records]
    assert any("vLLM MoE expert parallel through BatchedPrepareAndFinalize: batched-experts format "
               "[E_local, max_m, H] + expert_num_tokens, consumed by the masked layout (Nvfp4FusedMoE.forward_masked)"
               in m for m in msgs), msgs
    assert any(m.startswith(f"nvfp4_plugin: fused MoE E={E_LOCAL} H={H} I={INTER} ({mode}): masked layout")
               for m in msgs), msgs


def test_standard_all2all_format_maps_global_ids(monkeypatch):
    """A standard-format prepare/finalize (DeepEP high-throughput and the others hand [T, H], global ids and
    the expert map; vLLM's communication-free one stands in): our standard experts keep their experts only."""
    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", "w4a16")
    monkeypatch.setattr(vllm_moe, "all2all_prepare_finalize",
                        lambda moe_config, layer: MoEPrepareAndFinalizeNoDPEPModular())
    ckpt, x, tw, ti = checkpoint(seed=4)
    full = build(ckpt)
    for rank in range(EP):
        experts = ep_rank(rank, ckpt)
        assert isinstance(experts.quant_method.moe_kernel.fused_experts, ep.Nvfp4StandardExperts)
        y = experts.forward_modular(x, tw, ti)
        assert torch.equal(y, full.nvfp4_core(x, tw, torch.where(owned(ti, rank), ti, -1)))


def test_all2all_choice_and_unpadded_hidden_size(monkeypatch):
    """Which prepare/finalize the method asks vLLM for: none without all-to-all kernels or over
    allgather_reducescatter (vLLM's runner gathers for a method like ours), else vLLM's own, with bf16
    dispatch (the unquantized quant config) and the layer's routing tables. Hidden sizes stay unpadded."""
    from types import SimpleNamespace as NS

    from vllm.model_executor.layers.fused_moe import all2all_utils
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

    layer = NS(_expert_routing_tables=lambda: ("tables",))
    seen = []
    monkeypatch.setattr(all2all_utils, "maybe_make_prepare_finalize", lambda *a, **k: seen.append((a, k)) or "pf")
    def cfg(a2a, ag_rs):
        return NS(moe_parallel_config=NS(use_all2all_kernels=a2a, use_ag_rs_all2all_kernels=ag_rs))

    assert vllm_moe.all2all_prepare_finalize(cfg(False, False), layer) is None
    assert vllm_moe.all2all_prepare_finalize(cfg(True, True), layer) is None
    moe_config = cfg(True, False)
    assert vllm_moe.all2all_prepare_finalize(moe_config, layer) == "pf"
    assert seen == [((moe_config, FUSED_MOE_UNQUANTIZED_CONFIG),
                     dict(routing_tables=("tables",), allow_new_interface=True))]
    method = build(checkpoint()[0]).quant_method
    assert method.maybe_roundup_sizes(2000, 96, torch.bfloat16, None) == (2000, 96)


def test_batched_format_needs_a_backend_with_a_masked_path(monkeypatch):
    monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", "w4a16")
    experts = build(checkpoint()[0])
    core = experts.nvfp4_core

    class NoMasked:
        name = "flashinfer_cutlass_moe"

    monkeypatch.setattr(core, "backend", NoMasked())
    with pytest.raises(NotImplementedError, match="BatchedPrepareAndFinalize hands the batched-experts .* backend "
                                                  "'flashinfer_cutlass_moe' has no masked-layout path"):
        ep.make_moe_kernel(batched_pf(experts), core, experts.moe_config)
