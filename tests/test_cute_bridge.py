"""The CuTe-DSL grouped-GEMM bridge (nvfp4_plugin/cute_bridge.py, seed 002): everything up to the GEMM
call on the CPU; with nvidia-cutlass-dsl installed, the DSL's own scale-factor layout and an
ahead-of-time sm_100a compile of the masked kernel; the launches themselves only on a B200 (sm100)."""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import struct
import subprocess
import sys
import types

import pytest
import torch
from torch.overrides import TorchFunctionMode

from nvfp4_plugin import cute_bridge as cb
from nvfp4_plugin import numerics as nx
from nvfp4_plugin import reference
from nvfp4_plugin.weights import Nvfp4Weight

E, N, K = 3, 160, 192  # N not a multiple of 128: padded rows in the weight-side scales


def _weights(seed=0, e=E, n=N, k=K):
    g = torch.Generator().manual_seed(seed)
    return Nvfp4Weight.quantize(torch.randn(e, n, k, generator=g) * 0.05)


def _grouped_input(counts, extra_rows=3, seed=1, k=K):
    """Rows grouped by expert (``counts`` per expert) plus rows that belong to no expert."""
    g = torch.Generator().manual_seed(seed)
    m = sum(counts) + extra_rows
    x = (torch.randn(m, k, generator=g) * 3).bfloat16()
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(torch.tensor(counts), 0)
    gs = torch.tensor([2688.0 / (1.5 + i) for i in range(len(counts))], dtype=torch.float32)
    return x, gs, offsets


# ------------------------------------------------------------------------------------------------
# BF16 -> NVFP4 as torch float4_e2m1fn_x2: our bytes
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(33, 128), (2, 5, 64)])
def test_float4_view_holds_the_reference_quantizers_bytes(shape):
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(3)) * 4).bfloat16()
    q, s, gs = cb.quantize_to_nvfp4(x)
    assert q.dtype == torch.float4_e2m1fn_x2 and tuple(q.shape) == (*shape[:-1], shape[-1] // 2)
    assert torch.equal(gs, nx.tensor_global_scale(x))  # encode scale, 2688 / amax
    p_ref, s_ref = reference.scaled_fp4_quant(x.reshape(-1, shape[-1]), gs, swizzle=False)
    assert torch.equal(q.view(torch.uint8).reshape(p_ref.shape), p_ref)
    assert torch.equal(s.view(torch.uint8).reshape(s_ref.shape), s_ref.view(torch.uint8))


def test_float4_view_is_a_view_with_torchs_nibble_order():
    # element 2i in the low nibble: codes (0.5, 6.0) pack to 0x71
    packed = nx.pack_fp4(torch.tensor([[1, 7, 0xA, 0x3]], dtype=torch.uint8))
    assert packed.tolist() == [[0x71, 0x3A]]
    f4 = cb.as_float4(packed)
    assert f4.dtype == torch.float4_e2m1fn_x2 and f4.data_ptr() == packed.data_ptr()
    assert f4.stride() == packed.stride() and cb.as_packed_bytes(f4).data_ptr() == packed.data_ptr()
    # torch's own definition of the dtype, from the installed headers: val0 in bits 3:0, val1 in 7:4
    hdrs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "include", "**", "Float4_e2m1fn_x2.h"),
                     recursive=True)
    text = "".join(open(h).read() for h in hdrs)
    if "val1 : val0" not in text:
        pytest.skip("this torch build ships no Float4_e2m1fn_x2.h with the bit layout")
    assert "7654 : 3210" in text


def test_e2m1_ties_round_half_to_even():
    """With gs = 1 and a block max of 6 the block scale is exactly 1, so each value is quantized as
    is: every tie goes to the even code (3.5 -> 4, where the seed's half-step table gave 3)."""
    vals = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -3.5, -0.25, 2.25, 3.25, 4.5, 5.5, 0.1, -6.0]
    want = [0x7, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0xE, 0x8, 0x4, 0x5, 0x6, 0x7, 0x0, 0xF]
    x = torch.tensor([vals], dtype=torch.float32)
    q, s, _ = cb.quantize_to_nvfp4(x, torch.tensor(1.0))
    assert s.float().tolist() == [[1.0]]
    assert nx.unpack_fp4(q.view(torch.uint8)).tolist() == [want]
    seed_table = [0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 6, 7, 7]  # the seed's half-step -> code table
    assert seed_table[round(2 * 3.5)] == 5 and want[6] == 6  # 3.0 there, 4.0 here
    for bound, ties_down in nx.E2M1_BOUNDARIES:  # every boundary, through the bridge
        q, _, _ = cb.quantize_to_nvfp4(torch.tensor([[6.0, bound] + [0.0] * 14]), torch.tensor(1.0))
        lo = sum(1 for b, _ in nx.E2M1_BOUNDARIES if b < bound)
        assert nx.unpack_fp4(q.view(torch.uint8))[0, 1].item() == (lo if ties_down else lo + 1), bound


def test_decode_global_scale_is_the_correctly_rounded_reciprocal():
    gs = nx.global_scale_from_amax(torch.tensor([3.0, 0.007, 448.0]))
    d = cb.decode_global_scale(gs)
    assert torch.equal(d, (1.0 / gs.double()).float())


# ------------------------------------------------------------------------------------------------
# Scale assembly: numerics' swizzle, 3D weight side and 2D activation side
# ------------------------------------------------------------------------------------------------

def test_weight_side_scales_are_numerics_swizzle_per_expert():
    w = _weights()
    cw = cb.prepare_weights(w)
    assert tuple(cw.scale.shape) == (E, 256, 12)
    assert torch.equal(cw.scale.view(torch.uint8), nx.swizzle_blockscale(w.block_scale).view(torch.uint8))
    flat = cw.scale_b().view(torch.uint8)
    n_idx, k_idx = torch.meshgrid(torch.arange(N), torch.arange(K // 16), indexing="ij")
    off = nx.swizzled_offset(n_idx, k_idx, K // 16)
    for e in range(E):
        assert torch.equal(flat[e][off], w.block_scale[e].view(torch.uint8))
        pad = torch.ones(flat.shape[1], dtype=torch.bool)
        pad[off.flatten()] = False
        assert not flat[e][pad].any()  # padding bytes are zero
    # K/16 not a multiple of 4: zero columns
    s = torch.rand(2, 40, 5).mul(400).to(torch.float8_e4m3fn)
    sw = cb.swizzle_weight_scales(s)
    assert tuple(sw.shape) == (2, 128, 8)
    assert torch.equal(nx.unswizzle_blockscale(sw, 40, 5).view(torch.uint8), s.view(torch.uint8))


def test_prepare_weights_refuses_rows_with_different_global_scales():
    w = _weights()
    gs = w.global_scale.clone()
    gs[1, 7] *= 2
    with pytest.raises(ValueError, match=r"experts \[1\]"):
        cb.prepare_weights(Nvfp4Weight(w.packed, w.block_scale, gs))


@pytest.mark.parametrize("counts", [[5, 0, 130], [0, 0, 1], [128, 1, 0]])
def test_activation_side_scales_sit_at_the_blockscale_offsets(counts):
    x, gs, eo = _grouped_input(counts)
    acts = cb.quantize_contiguous(x, gs, eo)
    m = x.shape[0]
    bs = nx.blockscale_offsets_from_expert_offsets(eo)
    assert tuple(acts.scale.shape) == (nx.max_blockscale_rows(m, len(counts)), K // 16)
    covered = torch.zeros(acts.scale.shape[0], dtype=torch.bool)
    for e, (a, b) in enumerate(zip(eo[:-1].tolist(), eo[1:].tolist())):
        p, s = reference.scaled_fp4_quant(x[a:b], gs[e], swizzle=False)
        assert torch.equal(acts.packed[a:b], p)
        rows = nx.round_up(b - a, 128)
        block = acts.scale[bs[e]:bs[e] + rows]
        assert torch.equal(block.view(torch.uint8), nx.swizzle_blockscale(s).view(torch.uint8))
        covered[bs[e]:bs[e] + rows] = True
    assert not acts.scale.view(torch.uint8)[~covered].any()
    assert not acts.packed[eo[-1]:].any()  # rows of no expert
    # the 2D side assembled from linear scales: the same bytes
    ex = torch.searchsorted(eo[1:].long(), torch.arange(m), right=True).clamp(max=len(counts) - 1)
    _, lin = reference._nvfp4_quantize(x, gs[ex][:, None])
    assert torch.equal(cb.assemble_activation_scales(lin, eo).view(torch.uint8), acts.scale.view(torch.uint8))
    # the kernel's device-side padded offsets are our block-scale offsets
    offs = cb.kernel_offsets(eo)
    assert offs.dtype == torch.int32 and offs.tolist() == eo[1:].tolist()
    assert torch.equal(cb.kernel_padded_offsets(offs), bs[1:].to(torch.int32))


def test_masked_scales_are_per_expert_swizzles_and_the_6d_atom_view():
    g = torch.Generator().manual_seed(4)
    max_m = 40
    x = torch.randn(E, max_m, K, generator=g).bfloat16()
    mm = torch.tensor([0, 17, 40], dtype=torch.int32)
    gs = torch.tensor([100.0, 200.0, 300.0])
    acts = cb.quantize_masked(x, gs, mm)
    kb = K // 16
    for e in range(E):
        p, s = reference.scaled_fp4_quant(x[e, :mm[e]], gs[e], swizzle=False)
        assert torch.equal(acts.packed[e, :mm[e]], p) and not acts.packed[e, mm[e]:].any()
        lin = torch.zeros(max_m, kb, dtype=torch.uint8)
        lin[:mm[e]] = s.view(torch.uint8)
        assert torch.equal(acts.scale[e].view(torch.uint8), nx.swizzle_blockscale(lin))
    # grouped_gemm_nt_masked's documented SFA: logical (m32, m4, rm, k4, rk, l), physically
    # (l, rm, rk, m32, m4, k4): element (m, kb) of expert e at (m % 32, m // 32 % 4, m // 128, kb % 4, kb // 4, e)
    rm, rk = acts.scale.shape[1] // 128, acts.scale.shape[2] // 4
    six = acts.scale.view(torch.uint8).view(E, rm, rk, 32, 4, 4).permute(3, 4, 1, 5, 2, 0)
    lin = nx.unswizzle_blockscale(acts.scale, max_m, kb).view(torch.uint8)
    for e, m, k in [(1, 0, 0), (1, 16, 11), (2, 39, 5), (2, 33, 7)]:
        assert six[m % 32, m // 32 % 4, m // 128, k % 4, k // 4, e] == lin[e, m, k]


# ------------------------------------------------------------------------------------------------
# Operands: shapes and strides of the kernels' contracts
# ------------------------------------------------------------------------------------------------

def test_contiguous_operands_match_the_kernel_contract():
    w = _weights()
    cw = cb.prepare_weights(w)
    x, gs, eo = _grouped_input([5, 0, 130])
    o = cb.contiguous_operands(cb.quantize_contiguous(x, gs, eo), cw)
    m = x.shape[0]
    assert o.mat_a.dtype == o.mat_b.dtype == torch.float4_e2m1fn_x2
    assert tuple(o.mat_a.shape) == (m, K // 2) and o.mat_a.stride() == (K // 2, 1)
    # B as torch's scaled_grouped_mm takes it, [E, K/2, N] with K contiguous, is our [E, N, K/2] storage
    assert tuple(o.mat_b.shape) == (E, K // 2, N) and o.mat_b.stride() == (N * K // 2, 1, K // 2)
    assert o.mat_b.data_ptr() == cw.packed.data_ptr()
    # ... the same bytes and strides as the seed's make_b_k_major of an N-major stack
    n_major = w.packed.transpose(1, 2).contiguous()
    seed_b = n_major.permute(0, 2, 1).contiguous().permute(0, 2, 1)
    assert seed_b.stride() == o.mat_b.stride() and torch.equal(seed_b, cb.as_packed_bytes(o.mat_b))
    assert tuple(o.scale_b.shape) == (E, 256 * 12) and tuple(o.offs.shape) == (E,)
    assert torch.equal(o.global_scale_a, cb.decode_global_scale(gs))
    assert torch.equal(o.global_scale_b, cb.decode_global_scale(w.global_scale[:, 0]))
    # an N-major B (the seed's input before conversion) is refused, naming it
    bad = cb.ContiguousGemmOperands(o.mat_a, cb.as_float4(n_major), o.scale_a, o.scale_b, o.offs,
                                    o.global_scale_a, o.global_scale_b)
    with pytest.raises(ValueError, match="mat_b"):
        cb.check_contiguous_operands(bad)
    with pytest.raises(ValueError, match="multiples of 64"):
        cb.contiguous_operands(cb.quantize_contiguous(x[:, :80], gs, eo), cb.prepare_weights(_weights(k=80)))


def test_masked_operands_match_the_kernel_contract():
    w = _weights()
    cw = cb.prepare_weights(w)
    max_m = 40
    x = torch.randn(E, max_m, 2 * K, generator=torch.Generator().manual_seed(5)).bfloat16()
    gs = torch.tensor([100.0, 200.0, 300.0])
    acts = cb.quantize_masked(x, gs, torch.tensor([3, 0, 40]), use_silu_and_mul=True)
    o = cb.masked_operands(acts, cw)
    assert tuple(o.a.shape) == (max_m, K // 2, E) and o.a.stride() == (K // 2, 1, max_m * K // 2)
    assert tuple(o.b.shape) == (N, K // 2, E) and o.b.stride() == (K // 2, 1, N * K // 2)
    assert o.b.data_ptr() == cw.packed.data_ptr()
    assert tuple(o.sfa.shape) == (E, 128, 12) and tuple(o.sfb.shape) == (E, 256, 12)
    assert o.masked_m.dtype == torch.int32 and o.masked_m.tolist() == [3, 0, 40]
    assert torch.allclose(o.alpha, 1.0 / (gs * w.global_scale[:, 0]), rtol=2 ** -23, atol=0)
    assert o.out_shape() == (E, max_m, N)
    bad = cb.MaskedGemmOperands(o.a, cb.as_float4(w.packed.permute(1, 2, 0).contiguous()), o.sfa, o.sfb,
                                o.masked_m, o.alpha)
    with pytest.raises(ValueError, match="b: expected strides"):
        cb.check_masked_operands(bad)


def test_kernel_contract_emulation_equals_per_expert_dequantized_matmul():
    """What the operands mean, read back through the contracts (reference_grouped_gemm): the
    dequantized activations of each expert times its dequantized weights."""
    w = _weights()
    cw = cb.prepare_weights(w)
    wd = reference.dequantize_fp4(w.packed, w.block_scale, w.global_scale, swizzled=False, m=N, k=K)
    x, gs, eo = _grouped_input([5, 0, 130])
    out = cb.reference_grouped_gemm(cb.contiguous_operands(cb.quantize_contiguous(x, gs, eo), cw))
    for e, (a, b) in enumerate(zip(eo[:-1].tolist(), eo[1:].tolist())):
        p, s = reference.scaled_fp4_quant(x[a:b], gs[e], swizzle=False)
        xd = reference.dequantize_fp4(p, s, gs[e], swizzled=False, m=b - a, k=K)
        torch.testing.assert_close(out[a:b], xd @ wd[e].T, rtol=1e-5, atol=1e-5)
    assert not out[eo[-1]:].any()
    xm = torch.randn(E, 40, K, generator=torch.Generator().manual_seed(6)).bfloat16()
    mm = torch.tensor([0, 17, 40], dtype=torch.int32)
    gm = torch.tensor([100.0, 200.0, 300.0])
    out = cb.reference_grouped_gemm(cb.masked_operands(cb.quantize_masked(xm, gm, mm), cw))
    for e in range(E):
        p, s = reference.scaled_fp4_quant(xm[e, :mm[e]], gm[e], swizzle=False)
        xd = reference.dequantize_fp4(p, s, gm[e], swizzled=False, m=int(mm[e]), k=K)
        torch.testing.assert_close(out[e, :mm[e]], xd @ wd[e].T, rtol=1e-5, atol=1e-5)
        assert not out[e, mm[e]:].any()


# ------------------------------------------------------------------------------------------------
# Compiled-kernel cache (compile mocked)
# ------------------------------------------------------------------------------------------------

def test_cache_compiles_once_per_key():
    calls = []

    def fake_compile(key, operands):
        calls.append(key)
        return object()

    cache = cb.KernelCache(fake_compile)
    cw = cb.prepare_weights(_weights())
    keys = []
    for counts in ([5, 0, 130], [64, 64, 1]):  # token counts differ, shapes of the kernel do not
        x, gs, eo = _grouped_input(counts)
        keys.append(cb.kernel_key(cb.contiguous_operands(cb.quantize_contiguous(x, gs, eo), cw)))
    assert keys[0] == keys[1] and keys[0].max_m is None
    first = cache.get(keys[0])
    assert cache.get(keys[1]) is first and cache.compiles == 1 and len(calls) == 1
    # the masked kernel is static in max_m: another max_m, another kernel; the same one, no compile
    km = [cb.kernel_key(cb.masked_operands(cb.quantize_masked(torch.zeros(E, m, K), torch.ones(E),
                                                              torch.zeros(E, dtype=torch.int32)), cw))
          for m in (40, 64, 40)]
    a, b, c = (cache.get(k) for k in km)
    assert a is c and a is not b and cache.compiles == 3
    assert km[0] in cache and len(cache) == 3
    other = cb.kernel_key(cb.masked_operands(cb.quantize_masked(torch.zeros(E, 40, K), torch.ones(E),
                                                                torch.zeros(E, dtype=torch.int32)), cw),
                          mma_tiler_mn=(128, 256), arch="sm_103a")
    assert other != km[0]
    cache.clear()
    assert len(cache) == 0


# ------------------------------------------------------------------------------------------------
# No host synchronization up to the GEMM call
# ------------------------------------------------------------------------------------------------

class _NoHostReads(TorchFunctionMode):
    """While active, every way of reading a tensor's values on the host fails, for every tensor
    (the inputs and everything created along the way)."""

    FORBIDDEN = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.FORBIDDEN:
            raise AssertionError(f"host synchronization: Tensor.{name}")
        return func(*args, **(kwargs or {}))


def test_the_forward_path_reads_no_tensor_value_on_the_host():
    with pytest.raises(AssertionError, match="item"), _NoHostReads():
        torch.ones(1).sum().item()
    with pytest.raises(AssertionError, match="__bool__"), _NoHostReads():
        bool(torch.ones(1).any())
    cw = cb.prepare_weights(_weights())  # load time: it reads values (one global scale per expert)
    x, gs, eo = _grouped_input([5, 0, 130])
    ex = torch.searchsorted(eo[1:].long(), torch.arange(x.shape[0]), right=True).clamp(max=E - 1)
    _, lin = reference._nvfp4_quantize(x, gs[ex][:, None])
    xm = torch.randn(E, 40, 2 * K).bfloat16()
    mm = torch.tensor([1, 0, 40], dtype=torch.int32)
    with _NoHostReads():
        o = cb.contiguous_operands(cb.quantize_contiguous(x, gs, eo), cw)
        cb.kernel_key(o)
        cb.assemble_activation_scales(lin, eo)
        om = cb.masked_operands(cb.quantize_masked(xm, torch.ones(E), mm, use_silu_and_mul=True), cw)
        cb.kernel_key(om)
        q, _, _ = cb.quantize_to_nvfp4(x)  # the dynamic global scale stays on the device too
        cache = cb.KernelCache(lambda key, operands: object())
        cache.get(cb.kernel_key(om), om)
    assert q.dtype == torch.float4_e2m1fn_x2 and tuple(o.mat_a.shape) == (x.shape[0], K // 2)


# ------------------------------------------------------------------------------------------------
# With nvidia-cutlass-dsl installed (not in the core environment): the DSL's own layout, AOT compile
# ------------------------------------------------------------------------------------------------

def _cutlass():
    if importlib.util.find_spec("cutlass") is None or importlib.util.find_spec("cutlass.cute") is None:
        pytest.skip("nvidia-cutlass-dsl is not installed here")
    import cutlass

    return cutlass


@pytest.mark.parametrize("m,k,experts", [(256, 320, 2), (128, 64, 3)])
def test_dsl_scale_factor_layout_is_our_swizzle(m, k, experts):
    """cutlass.utils.blockscaled_layout.tile_atom_to_shape_SF, the layout both kernels build over the
    scale pointers, maps (row, K, expert) to the byte where numerics' swizzle puts the scale."""
    _cutlass()
    import cutlass.cute as cute
    import cutlass.utils.blockscaled_layout as bl

    kb = k // 16
    per_expert = m * nx.round_up(kb, 4)
    found = {}

    @cute.jit
    def probe():
        layout = bl.tile_atom_to_shape_SF((m, k, experts), cb.SF_VEC_SIZE)
        found["offsets"] = [[[layout((r, c * cb.SF_VEC_SIZE, e)) for c in range(kb)] for r in range(0, m, 3)]
                            for e in range(experts)]

    cute.compile(probe)
    got = torch.tensor(found["offsets"])
    r, c = torch.meshgrid(torch.arange(0, m, 3), torch.arange(kb), indexing="ij")
    want = torch.stack([e * per_expert + nx.swizzled_offset(r, c, kb) for e in range(experts)])
    assert torch.equal(got, want)


def _masked_kernel_importable():
    """FlashInfer's masked kernel module. FlashInfer's package __init__ queries the GPU when the DSL
    is installed, so on a machine without one the kernel module is loaded under a bare package."""
    try:
        return importlib.import_module(cb.MASKED_KERNEL_MODULE)
    except ImportError as exc:
        pytest.skip(f"FlashInfer's CuTe-DSL masked kernel is not importable here: {exc}")
    except Exception:  # noqa: BLE001 - the package __init__'s GPU probe
        spec = importlib.util.find_spec("flashinfer")
        for name in [n for n in sys.modules if n == "flashinfer" or n.startswith("flashinfer.")]:
            del sys.modules[name]
        pkg = types.ModuleType("flashinfer")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["flashinfer"] = pkg
        return importlib.import_module(cb.MASKED_KERNEL_MODULE)


def _device_elfs(blob: bytes):
    """The CUDA ELF images (e_machine 190) inside a host object."""
    out, i = [], blob.find(b"\x7fELF", 1)
    while i > 0:
        e = blob[i:]
        if e[4] == 2 and struct.unpack_from("<H", e, 0x12)[0] == 190:
            phoff, shoff = struct.unpack_from("<QQ", e, 0x20)
            phsz, phn, shsz, shn = struct.unpack_from("<HHHH", e, 0x36)
            size = max(shoff + shsz * shn, phoff + phsz * phn)
            for s in range(shn):
                typ = struct.unpack_from("<I", e, shoff + s * shsz + 4)[0]
                off, sz = struct.unpack_from("<QQ", e, shoff + s * shsz + 0x18)
                size = max(size, off + sz) if typ != 8 else size
            out.append(e[:size])
            i = blob.find(b"\x7fELF", i + size)
        else:
            i = blob.find(b"\x7fELF", i + 4)
    return out


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
def test_masked_gemm_compiles_ahead_of_time_without_a_gpu(arch, tmp_path):
    _cutlass()
    _masked_kernel_importable()
    fn = cb.compile_masked_gemm_aot(4, 256, 512, 1024, arch=arch)
    elfs = _device_elfs(fn.dump_to_object("nvfp4_masked"))
    assert elfs, "no device code in the compiled object"
    from tests.test_csrc_compile import find_tool

    cuobjdump = find_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump not installed: compiled, SASS not inspected")
    path = tmp_path / "k.cubin"
    path.write_bytes(elfs[0])
    sass = subprocess.run([cuobjdump, "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    assert f"code for {arch}" in sass
    assert "UTCOMMA" in sass and "UTMALDG" in sass  # tcgen05 block-scaled MMA, TMA loads


# ------------------------------------------------------------------------------------------------
# B200 only: the launches
# ------------------------------------------------------------------------------------------------

def _blackwell_case(seed=0, e=4, n=256, k=512):
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(seed)
    w = Nvfp4Weight.quantize((torch.randn(e, n, k, generator=g) * 0.05).to(dev))
    return cb.prepare_weights(w), dev


@pytest.mark.sm100
def test_masked_launch_matches_the_contract_emulation_and_replays_in_a_cuda_graph():
    pytest.importorskip("cutlass")
    _masked_kernel_importable()
    cw, dev = _blackwell_case()
    x = torch.randn(4, 64, 512, device=dev).bfloat16()
    gs = torch.full((4,), 2688.0 / 4.0, device=dev)
    mm = torch.tensor([0, 1, 63, 64], dtype=torch.int32, device=dev)
    o = cb.masked_operands(cb.quantize_masked(x, gs, mm), cw)
    out = cb.run_grouped_gemm(o)
    want = cb.reference_grouped_gemm(o)
    valid = torch.arange(64, device=dev)[None, :] < mm[:, None].long()
    torch.testing.assert_close(out.float()[valid], want[valid], rtol=2e-2, atol=2e-2)
    static_out = torch.empty_like(out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cb.run_grouped_gemm(o, out=static_out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out[valid], out[valid])


@pytest.mark.sm100
def test_contiguous_launch_matches_the_contract_emulation():
    pytest.importorskip("cutlass")
    try:
        cb._import_contiguous_kernel()
    except ImportError as exc:
        pytest.skip(str(exc))
    cw, dev = _blackwell_case()
    counts = [0, 5, 200, 64]
    x, gs, eo = _grouped_input(counts, k=512)
    o = cb.contiguous_operands(cb.quantize_contiguous(x.to(dev), gs.to(dev), eo.to(dev)), cw)
    out = cb.run_grouped_gemm(o)
    want = cb.reference_grouped_gemm(o)
    rows = int(eo[-1])
    torch.testing.assert_close(out.float()[:rows], want[:rows], rtol=2e-2, atol=2e-2)
