"""Expert parallelism with the nvfp4 fused-MoE method in SGLang 0.5.17's FusedMoE, two ranks simulated in
one process (sglang_harness.simulated_tp with ep_size=2), weights loaded through SGLang's own loader.

* ``--tp 2 --ep 2`` without all-to-all: the StandardDispatcher maps other ranks' experts to -1; each rank
  computes its own experts only, bit for bit what TP=1 computes for those pairs.
* ``--moe-a2a-backend deepep``: DeepEP needs deep_ep (NVSHMEM, several GPUs) and does not install here,
  so a stand-in dispatcher does in one process what DeepEP's dispatch and combine do, handing the method
  SGLang's own ``DeepEPLLDispatchOutput`` (masked layout: ``hidden_states [E_local, max_m, H]`` with
  garbage past ``masked_m``) or ``DeepEPNormalDispatchOutput`` (received tokens with local ids). Through
  FusedMoE.forward and, with deep_gemm's flag forced, SGLang's DeepEPMoE. Not runnable with real DeepEP
  on these machines.

SGLang's router needs its CUDA kernels, so routing comes from reference.route_topk."""

import logging
from unittest import mock

import pytest
import torch

from tests._require import require

sglang = require("sglang")

from nvfp4_plugin import reference as ref  # noqa: E402
from nvfp4_plugin.engines import common  # noqa: E402
from nvfp4_plugin.layers import registry  # noqa: E402
from nvfp4_plugin.weights import Nvfp4Weight  # noqa: E402

from .sglang_harness import (MODELOPT, expert_checkpoint, load_experts, simulated_tp, start,  # noqa: E402
                             topk_output, unique_layer)

start()

from sglang.srt.layers.moe.fused_moe_triton import FusedMoE  # noqa: E402
from sglang.srt.layers.moe.token_dispatcher.deepep import (DeepEPLLDispatchOutput,  # noqa: E402
                                                           DeepEPNormalDispatchOutput)
from sglang.srt.layers.moe.utils import MoeA2ABackend, get_flags  # noqa: E402

from nvfp4_plugin.engines.sglang.config import Nvfp4SglangConfig  # noqa: E402

E, H, INTER, T, TOPK, EP = 4, 64, 64, 9, 2, 2
E_LOCAL = E // EP
#: what DeepEP's low-latency buffer holds per local expert (tokens per rank x ranks)
MAX_M = T * EP


def checkpoint(seed=2):
    g = torch.Generator().manual_seed(seed)
    gates = [Nvfp4Weight.quantize(torch.randn(INTER, H, generator=g) * (1 + ex)) for ex in range(E)]
    ups = [Nvfp4Weight.quantize(torch.randn(INTER, H, generator=g) * 0.1) for _ in range(E)]
    downs = [Nvfp4Weight.quantize(torch.randn(H, INTER, generator=g)) for _ in range(E)]
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    tw, ti = ref.route_topk(torch.randn(T, E, generator=g), TOPK)
    return expert_checkpoint("modelopt", gates, ups, downs), x, tw, ti


def make_moe(cls=FusedMoE):
    return cls(num_experts=E, hidden_size=H, intermediate_size=INTER, layer_id=0, top_k=TOPK,
               params_dtype=torch.bfloat16, quant_config=Nvfp4SglangConfig.from_config(MODELOPT),
               prefix=unique_layer())


def owned(ti, rank):
    return (ti >= rank * E_LOCAL) & (ti < (rank + 1) * E_LOCAL)


@pytest.fixture
def tp1(monkeypatch):
    """The TP=1 layer of a checkpoint: (layer, x, tw, ti)."""
    def build(seed, mode):
        monkeypatch.setenv("NVFP4_PLUGIN_ACT_MODE", mode)
        ckpt, x, tw, ti = checkpoint(seed)
        moe = make_moe()
        load_experts(moe, ckpt)
        return moe, ckpt, x, tw, ti
    return build


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_ep_without_all2all_computes_local_experts_only(mode, tp1, caplog, monkeypatch):
    monkeypatch.setattr(common, "_PATHS_LOGGED", set())
    full, ckpt, x, tw, ti = tp1(2, mode)
    with caplog.at_level(logging.INFO, logger="nvfp4_plugin"), \
            mock.patch("sglang.srt.layers.moe.token_dispatcher.standard.get_device", return_value="cpu"):
        for rank in range(EP):
            with simulated_tp(EP, rank, ep_size=EP):
                moe = make_moe()
                load_experts(moe, ckpt)
                seen = []
                real = moe.nvfp4_core
                moe.nvfp4_core = lambda x_, w_, ids, _real=real: seen.append(ids.clone()) or _real(x_, w_, ids)
                y = moe(x, topk_output(tw, ti))
            mine = owned(ti, rank)
            (ids,) = seen
            assert torch.equal(ids, torch.where(mine, ti - rank * E_LOCAL, -1).to(ids.dtype))   # -1: not computed
            assert torch.equal(y, full.nvfp4_core(x, tw, torch.where(mine, ti, -1)))
    assert any("SGLang MoE expert parallel without all-to-all (--ep, StandardDispatcher)" in r.getMessage()
               for r in caplog.records)


class FakeDeepEP:
    """What SGLang's DeepEP dispatcher hands the method and does with what it returns, in one process and
    for one rank of ``EP``: low-latency mode packs the tokens routed to each local expert into
    ``[E_local, MAX_M, H]`` (NaN past ``masked_m``: whatever the buffer held) and combines by weighting
    and summing the expert rows in fp32; normal mode sends each token with a local expert once, with
    local ids (-1 elsewhere), and the combine returns the rows to their tokens."""

    def __init__(self, rank: int, low_latency: bool):
        self.rank, self.low_latency, self.quant_config, self.outputs = rank, low_latency, None, []

    def set_quant_config(self, quant_config):
        self.quant_config = quant_config

    def dispatch(self, hidden_states, topk_output):
        x, tw, ti = hidden_states, topk_output.topk_weights, topk_output.topk_ids
        mine = owned(ti, self.rank)
        local_ids = torch.where(mine, ti - self.rank * E_LOCAL, -1)
        if not self.low_latency:
            self.tokens = mine.any(1).nonzero()[:, 0]
            return DeepEPNormalDispatchOutput(x[self.tokens], None, local_ids[self.tokens], tw[self.tokens],
                                              [int((local_ids == e).sum()) for e in range(E_LOCAL)])
        xm = torch.full((E_LOCAL, MAX_M, H), float("nan"), dtype=x.dtype)
        counts = torch.zeros(E_LOCAL, dtype=torch.int32)
        self.slots = []
        for t, k in mine.nonzero().tolist():
            e = int(local_ids[t, k])
            xm[e, counts[e]] = x[t]
            self.slots.append((t, k, e, int(counts[e])))
            counts[e] += 1
        expected_m = (T * EP * TOPK + E) // E
        return DeepEPLLDispatchOutput(xm, None, ti, tw, counts, expected_m)

    def combine(self, combine_input):
        y, _, tw = combine_input
        self.outputs.append(y.clone())
        if not self.low_latency:
            out = torch.zeros(T, H, dtype=y.dtype)
            out[self.tokens] = y
            return out
        acc = torch.zeros(T, H, dtype=torch.float32)
        for k in range(TOPK):                       # slot order, as our standard combine
            for t, kk, e, row in self.slots:
                if kk == k:
                    acc[t] += y[e, row].float() * tw[t, k].float()
        return acc.to(y.dtype)


def deepep_ranks(ckpt, x, tw, ti, low_latency, cls=FusedMoE):
    """Each rank's layer output and stand-in dispatcher, built and run under --moe-a2a-backend deepep."""
    import sglang.srt.layers.moe.fused_moe_triton.layer as fl

    results = []
    for rank in range(EP):
        fake = FakeDeepEP(rank, low_latency)
        with get_flags().moe.override(a2a_backend=MoeA2ABackend.DEEPEP), simulated_tp(EP, rank, ep_size=EP), \
                mock.patch.object(fl, "create_moe_dispatcher", lambda cfg, _f=fake: _f):
            moe = make_moe(cls)
            load_experts(moe, ckpt)
            results.append((moe, fake, moe(x, topk_output(tw, ti))))
    return results


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_deepep_low_latency_masked_layout(mode, tp1, caplog, monkeypatch):
    """DeepEP's low-latency dispatch output runs the masked path: each expert's valid rows are the TP=1
    standard forward of its tokens bit for bit, garbage rows past masked_m never leak, and each rank's
    combined output is bit for bit TP=1 on that rank's pairs."""
    monkeypatch.setattr(common, "_PATHS_LOGGED", set())
    monkeypatch.setattr(registry, "_MASKED_LOGGED", set())
    full, ckpt, x, tw, ti = tp1(3, mode)
    with caplog.at_level(logging.INFO, logger="nvfp4_plugin"):
        ranks = deepep_ranks(ckpt, x, tw, ti, low_latency=True)
    for rank, (moe, fake, y) in enumerate(ranks):
        assert fake.quant_config == {"dispatcher_output_dtype": "bf16"}     # bf16 dispatch asked for
        (ym,) = fake.outputs
        assert ym.shape == (E_LOCAL, MAX_M, H)
        for t, k, e, row in fake.slots:
            want = full.nvfp4_core(x[t:t + 1], torch.ones(1, 1), ti[t:t + 1, k:k + 1])
            assert torch.equal(ym[e, row:row + 1], want)
        assert not y.isnan().any()
        assert torch.equal(y, full.nvfp4_core(x, tw, torch.where(owned(ti, rank), ti, -1)))
    msgs = [r.getMessage() for r in caplog.records]
    assert any("SGLang MoE expert parallel through DeepEP: low-latency dispatch [E_local, max_m, H] + masked_m "
               "consumed by the masked layout (Nvfp4FusedMoE.forward_masked)" in m for m in msgs), msgs
    assert any(f"fused MoE E={E_LOCAL} H={H} I={INTER} ({mode}): masked layout x[E, max_m={MAX_M}, H]" in m
               for m in msgs), msgs


def test_deepep_normal_standard_path(tp1):
    full, ckpt, x, tw, ti = tp1(4, "w4a16")
    for rank, (moe, fake, y) in enumerate(deepep_ranks(ckpt, x, tw, ti, low_latency=False)):
        assert torch.equal(y, full.nvfp4_core(x, tw, torch.where(owned(ti, rank), ti, -1)))


def test_deepep_moe_class_routes_through_the_method(tp1):
    """Model files build SGLang's DeepEPMoE under --moe-a2a-backend deepep; it sends only the quant
    methods it knows through ``quant_method.apply`` (deprecate_flag), which the method turns on after
    loading. DeepEPMoE's own check for DeepGEMM (a GPU install) is satisfied by hand here."""
    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.layers.moe.ep_moe.layer import DeepEPMoE

    full, ckpt, x, tw, ti = tp1(5, "w4a16")
    with mock.patch.object(deep_gemm_wrapper, "ENABLE_JIT_DEEPGEMM", True):
        ranks = deepep_ranks(ckpt, x, tw, ti, low_latency=True, cls=DeepEPMoE)
    for rank, (moe, fake, y) in enumerate(ranks):
        assert isinstance(moe, DeepEPMoE) and moe.deprecate_flag
        assert torch.equal(y, full.nvfp4_core(x, tw, torch.where(owned(ti, rank), ti, -1)))


def test_quantized_dispatch_and_other_all2all_backends_are_refused(tp1):
    full, ckpt, x, tw, ti = tp1(6, "w4a16")
    fp8 = DeepEPLLDispatchOutput(torch.zeros(E, MAX_M, H, dtype=torch.float8_e4m3fn),
                                 torch.ones(E, MAX_M, H // 128 + 1), ti, tw, torch.zeros(E, dtype=torch.int32), 1)
    with pytest.raises(NotImplementedError, match="takes DeepEP's bf16 dispatch .* got torch.float8_e4m3fn tokens "
                                                  "with scales"):
        full.quant_method.apply(full, fp8)
    for backend in (MoeA2ABackend.MOONCAKE, MoeA2ABackend.NIXL):
        with get_flags().moe.override(a2a_backend=backend):
            with pytest.raises(NotImplementedError, match=rf"--quantization nvfp4 takes --moe-a2a-backend none or "
                                                          rf"deepep \(got '{backend.value}'\)"):
                make_moe()


@pytest.mark.parametrize("deepep_mode", ["auto", "low_latency", "normal"])
def test_deepep_low_latency_needs_a_masked_path_at_load(tp1, monkeypatch, deepep_mode):
    """A layer whose backend cannot take the masked layout (e.g. on Blackwell without nvidia-cutlass-dsl) fails
    at load under DeepEP's low-latency (or auto) mode, naming the reason, not at the first decode step."""
    from sglang.srt.layers.moe.utils import DeepEPMode

    from nvfp4_plugin.layers import Nvfp4FusedMoE

    _, ckpt, x, tw, ti = tp1(5, "w4a16")
    monkeypatch.setattr(Nvfp4FusedMoE, "masked_unsupported_reason", lambda self: "its GEMM needs nvidia-cutlass-dsl")
    fake = FakeDeepEP(0, deepep_mode != "normal")
    import sglang.srt.layers.moe.fused_moe_triton.layer as fl

    with get_flags().moe.override(a2a_backend=MoeA2ABackend.DEEPEP, deepep_mode=DeepEPMode(deepep_mode)), \
            simulated_tp(EP, 0, ep_size=EP), mock.patch.object(fl, "create_moe_dispatcher", lambda cfg: fake):
        moe = make_moe(FusedMoE)
        if deepep_mode == "normal":
            load_experts(moe, ckpt)                                   # normal dispatch only: the standard path
            return
        with pytest.raises(NotImplementedError, match="DeepEP's low-latency dispatch hands the masked layout, and "
                                                      "its GEMM needs nvidia-cutlass-dsl; use --deepep-mode normal"):
            load_experts(moe, ckpt)
