"""nvfp4_plugin.triton.fast_launch: a cached compiled kernel is launched directly only where Triton would
pick that same kernel, with the arguments in the kernel's order; everything else takes Triton's path.
CPU: a stand-in kernel records which path each launch took. GPU: the real layers give the same bytes
with and without it, eagerly and inside a CUDA graph."""

import pytest
import torch

from nvfp4_plugin.triton import fast_launch as F


class _Param:
    def __init__(self, default):
        self.default = default

    @property
    def has_default(self):
        return self.default is not _NO


_NO = object()


class _Compiled:
    """What ``kernel[grid](...)`` returns on a GPU: the launcher and its handles."""

    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn", "meta"

    def run(self, g0, g1, g2, stream, function, packed, launch_meta, enter, exit_, *args):
        self.log.append(("direct", (g0, g1, g2), args))


class _Kernel:
    """A stand-in @triton.jit kernel ``k(x_ptr, n, scale, BLOCK: constexpr, FLAG: constexpr = 0)``."""
    arg_names = ["x_ptr", "n", "scale", "BLOCK", "FLAG"]
    constexprs = [3, 4]
    params = [_Param(_NO), _Param(_NO), _Param(_NO), _Param(_NO), _Param(0)]

    def __init__(self):
        self.log, self.compiled = [], 0
        self.__name__ = "k"

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            self.compiled += 1
            return _Compiled(self.log)
        return launch


@pytest.fixture
def gpu_free(monkeypatch):
    """Run the direct path without a GPU: device 0, stream 7, compiled (not interpreted) kernels."""
    monkeypatch.setattr(F, "interpreting", lambda: False)
    monkeypatch.setattr(F, "_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 7, raising=False)
    monkeypatch.delenv("NVFP4_PLUGIN_FAST_LAUNCH", raising=False)


def _x(offset_elems=0, dtype=torch.float32):
    buf = torch.zeros(64, dtype=dtype)
    return buf[offset_elems:]


def test_second_launch_of_a_key_is_direct_with_the_arguments_in_kernel_order(gpu_free):
    k = _Kernel()
    fl = F.FastLaunch(k)
    x = _x()
    fl[(4, 2)](x, 32, 1.5, BLOCK=128)
    fl[(4, 2)](x, 32, 2.5, BLOCK=128)
    assert [e[0] for e in k.log] == ["triton", "direct"]
    # every parameter in order (a tensor as its address), the constexpr default filled in; the grid padded to 3-D
    assert k.log[1][1] == (4, 2, 1) and k.log[1][2] == (x.data_ptr(), 32, 2.5, 128, 0)
    assert k.compiled == 1


@pytest.mark.parametrize("change", ["alignment", "dtype", "int_one", "int_div16", "int_width", "constexpr",
                                    "constexpr_type", "option", "device"])
def test_anything_triton_specializes_on_takes_triton_s_path_again(gpu_free, monkeypatch, change):
    k = _Kernel()
    fl = F.FastLaunch(k)
    x, n, block, opts = _x(), 32, 128, {"num_warps": 4}
    fl[(1,)](x, n, 1.0, BLOCK=block, **opts)
    if change == "alignment":
        x = _x(1)                                        # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        x = _x(dtype=torch.float16)
    elif change == "int_one":
        n = 1
    elif change == "int_div16":
        n = 33
    elif change == "int_width":
        n = 1 << 32 + 4                                  # i64 instead of i32, still divisible by 16
    elif change == "constexpr":
        block = 64
    elif change == "constexpr_type":
        block = 128.0                                    # Triton keys constexprs by their text: another kernel
    elif change == "option":
        opts = {"num_warps": 8}
    elif change == "device":
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    fl[(1,)](x, n, 1.0, BLOCK=block, **opts)
    assert [e[0] for e in k.log] == ["triton", "triton"], change
    fl[(1,)](x, n, 1.0, BLOCK=block, **opts)             # and that key is cached in its turn
    assert k.log[-1][0] == "direct"


def test_a_compile_outside_the_warm_up_is_logged(gpu_free, monkeypatch, caplog):
    """A first launch that takes LATE_COMPILE_S or longer (a compile) is a warning naming the kernel, unless it
    runs inside a layer's warm-up; quick first launches (Triton's caches) and direct launches are not."""
    from nvfp4_plugin.triton import late_compile as LC
    clock = iter(range(0, 1000, 1))                      # every perf_counter() call: one more second
    monkeypatch.setattr(F.time, "perf_counter", lambda: float(next(clock)))
    k = _Kernel()
    fl = F.FastLaunch(k)
    with caplog.at_level("WARNING", logger="nvfp4_plugin"):
        with LC.warming_up(), LC.warming_up():           # nested: still warming after the inner one ends
            fl[(1,)](_x(), 32, 1.0, BLOCK=128)
        assert not caplog.records
        with LC.warming_up():
            pass
        fl[(1,)](_x(), 32, 1.0, BLOCK=64)               # another constexpr: a first launch, 1 s long
        fl[(1,)](_x(), 32, 1.0, BLOCK=64)               # direct
        assert [e[0] for e in k.log] == ["triton", "triton", "direct"]
        assert len(caplog.records) == 1 and "kernel k compiled outside the start-up warm-up (1.00 s" \
            in caplog.records[0].getMessage()
    assert not LC.note_first_launch(k, LC.LATE_COMPILE_S / 2)
    assert LC._warming == 0


def test_values_triton_does_not_specialize_on_share_the_kernel(gpu_free):
    k = _Kernel()
    fl = F.FastLaunch(k)
    fl[(1,)](_x(), 32, 1.0, BLOCK=128)
    fl[(2,)](_x(4), 64, -3.0, BLOCK=128)                 # 16 bytes further, another multiple of 16, a float
    assert [e[0] for e in k.log] == ["triton", "direct"]


@pytest.mark.parametrize("why", ["env", "interpreter", "hook", "no_cuda", "debug", "instrumentation", "tuple"])
def test_triton_s_path_when_turned_off_interpreted_or_hooked(gpu_free, monkeypatch, why):
    from triton import knobs

    k = _Kernel()
    fl = F.FastLaunch(k)
    if why == "env":
        monkeypatch.setenv("NVFP4_PLUGIN_FAST_LAUNCH", "0")
    elif why == "interpreter":
        monkeypatch.setattr(F, "interpreting", lambda: True)
    elif why == "no_cuda":
        monkeypatch.setattr(F, "_cuda", lambda: False)
    elif why == "debug":
        monkeypatch.setattr(knobs.runtime, "debug", True)
    elif why == "instrumentation":
        monkeypatch.setattr(knobs.compilation, "instrumentation_mode", "consan")
    else:
        chain = knobs.HookChain()
        chain.add(lambda *a: None)
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", chain)
    for _ in range(3):
        fl[(1,)](_x(), (1, 2) if why == "tuple" else 32, 1.0, BLOCK=128)
    assert [e[0] for e in k.log] == ["triton"] * 3


def test_missing_argument_is_named(gpu_free):
    fl = F.FastLaunch(_Kernel())
    fl[(1,)](_x(), 32, 1.0, BLOCK=128)
    with pytest.raises(TypeError, match="'BLOCK'"):
        fl[(1,)](_x(), 32, 1.0)


def test_fast_returns_one_wrapper_per_kernel():
    a, b = _Kernel(), _Kernel()
    assert F.fast(a) is F.fast(a) and F.fast(a) is not F.fast(b)


def test_arg_key_of_a_plain_triton_descriptor_and_of_cpu_tensors():
    from triton.tools.tensor_descriptor import TensorDescriptor

    d = TensorDescriptor.from_tensor(torch.zeros(64, 64), [16, 16])
    assert F.arg_key(d)[0] == "desc" and F.arg_key(d)[4] is None    # no layout on Triton's own descriptor
    assert F.arg_key(_x())[2] is False                               # a CPU tensor never shares a CUDA key
    assert F.arg_key(1 << 64) != F.arg_key(1 << 63)


def test_arg_key_tells_apart_what_triton_does():
    assert F.arg_key(1) != F.arg_key(17) != F.arg_key(16)
    assert F.arg_key(16) == F.arg_key(32) and F.arg_key(3) == F.arg_key(5)
    assert F.arg_key(16) != F.arg_key(1 << 36)
    assert F.arg_key(True) != F.arg_key(False) and F.arg_key(None) is None
    assert F.arg_key(_x()) != F.arg_key(_x(1)) and F.arg_key(_x()) == F.arg_key(_x(4))


# ------------------------------------------------------------------------------------------------
# GPU: the real layers, with and without direct launches
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 700, 4096])
def test_gpu_layers_same_bytes_with_direct_launches_eager_and_in_a_graph(monkeypatch, tokens):
    from nvfp4_plugin.gemm import gluon_w4 as gw
    from nvfp4_plugin.gemm import moe_glue as G
    from nvfp4_plugin.gemm import triton_w4 as tk
    from nvfp4_plugin.layers import Nvfp4FusedMoE, Nvfp4Linear
    from nvfp4_plugin.weights import Nvfp4Weight

    torch.manual_seed(tokens)
    dev = "cuda"
    lin = Nvfp4Linear(Nvfp4Weight.quantize(torch.randn(384, 256, device=dev)))
    e, h, i, top_k = 16, 256, 128, 4
    moe = Nvfp4FusedMoE(Nvfp4Weight.quantize(torch.randn(e, 2 * i, h, device=dev)),
                        Nvfp4Weight.quantize(torch.randn(e, h, i, device=dev)))
    x = torch.randn(tokens, 256, device=dev, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device=dev)[:top_k] for _ in range(tokens)]).to(torch.int32)
    w = torch.rand(tokens, top_k, device=dev)

    def fwd():
        return lin(x), moe(x, w, ids)

    monkeypatch.setenv("NVFP4_PLUGIN_FAST_LAUNCH", "0")
    want = fwd()
    monkeypatch.delenv("NVFP4_PLUGIN_FAST_LAUNCH")
    got = fwd()                                           # may go through Triton once per new key
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # from now on no launch of the MoE glue or the GEMMs goes through Triton's JITFunction.run
    through_triton = []
    for k in (G._silu_mul_kernel, G._combine_kernel, G._gather_rows_kernel, tk.w4_gemm_kernel, gw.w4_wgmma_kernel,
              tk.w4_dequant_kernel):
        monkeypatch.setattr(k, "run", lambda *a, _k=k, _run=k.run, **kw: through_triton.append(_k) or _run(*a, **kw))
    for _ in range(2):
        got = fwd()
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not through_triton, [getattr(k, "__name__", k) for k in through_triton]
    assert F.fast(G._silu_mul_kernel).cache and F.fast(G._combine_kernel).cache
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fwd()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = fwd()
    x.normal_()
    monkeypatch.setenv("NVFP4_PLUGIN_FAST_LAUNCH", "0")
    want = fwd()
    g.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, want))


def test_benchmarks_time_both_launch_paths_alternately_and_restore_the_setting(monkeypatch):
    import os

    from benchmarks import common

    monkeypatch.setenv("NVFP4_PLUGIN_FAST_LAUNCH", "7")
    seen = []
    direct, triton_path = common.launch_paths_us(lambda i: seen.append(os.environ.get("NVFP4_PLUGIN_FAST_LAUNCH")),
                                                 2, False, rounds=2)
    # per round: the direct path (variable unset) then Triton's (0), each a warm-up call and three loops of 2
    assert seen == ([None] * 7 + ["0"] * 7) * 2
    assert direct > 0 and triton_path > 0 and os.environ["NVFP4_PLUGIN_FAST_LAUNCH"] == "7"
