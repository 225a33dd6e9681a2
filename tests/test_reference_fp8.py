"""FP8 E4M3 activation quantizers: per-tensor, per-token, per-token-group (fp32 / UE8M0 scales)."""

import math

import pytest
import torch

from nvfp4_plugin import numerics as nx
from nvfp4_plugin import reference as ref

from .helpers import brute_e4m3_byte

ONE_OVER_448 = torch.tensor(1 / 448, dtype=torch.float32).item()


def f32(v):
    return torch.tensor(v, dtype=torch.float32).item()


def test_per_token_group_fp32_scales_loop():
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(5, 384, generator=g) * torch.exp(torch.randn(5, 1, generator=g) * 3)).to(torch.bfloat16)
    x[1, 128:256] = 0  # amax clamps to eps
    q, s = ref.per_token_group_quant_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 3) and s.is_contiguous()
    xf = x.float()
    for r in range(5):
        for gi in range(3):
            grp = xf[r, gi * 128:(gi + 1) * 128]
            a = max(grp.abs().max().item(), 1e-10)
            a = f32(a)
            assert s[r, gi].item() == f32(a * ONE_OVER_448)
            mult = f32(448.0 / a)
            for j in (0, 17, 127):
                assert q[r, gi * 128 + j].view(torch.uint8).item() == brute_e4m3_byte(f32(grp[j].item() * mult))


def test_per_token_group_column_major_and_ue8m0_packing():
    g = torch.Generator().manual_seed(3)
    m, k = 6, 128 * 6
    x = (torch.randn(m, k, generator=g) * 10).to(torch.bfloat16)
    q_rm, s_rm = ref.per_token_group_quant_fp8(x)
    q_cm, s_cm = ref.per_token_group_quant_fp8(x, column_major_scales=True)
    assert torch.equal(q_rm.view(torch.uint8), q_cm.view(torch.uint8)) and torch.equal(s_rm, s_cm)
    assert s_cm.stride() == (1, 8)  # column-major storage, M padded to 4 -> 8
    q_u, s_u = ref.per_token_group_quant_fp8(x, column_major_scales=True, scale_ue8m0=True)
    assert s_u.dtype == torch.int32 and s_u.shape == (6, 2) and s_u.stride() == (1, 8)
    bytes_ = s_u.contiguous().view(torch.uint8).reshape(6, 8)  # little-endian: group g in byte g % 4 of word g // 4
    xf = x.float().reshape(m, 6, 128)
    for r in range(m):
        for gi in range(6):
            a = f32(max(xf[r, gi].abs().max().item(), 1e-10))
            mant, e = math.frexp(f32(a * ONE_OVER_448))
            exp = e - 1 if mant == 0.5 else e
            assert bytes_[r, gi].item() == exp + 127
            v = xf[r, gi, 5].item() * 2.0 ** -exp
            assert q_u[r, gi * 128 + 5].view(torch.uint8).item() == brute_e4m3_byte(v)
    assert (bytes_[:, 6:] == 0).all()
    with pytest.raises(ValueError, match="column_major_scales"):
        ref.per_token_group_quant_fp8(x, scale_ue8m0=True)


def test_per_token_quant():
    x = torch.randn(4, 64, dtype=torch.float16) * 3
    x[2] = 0
    q, s = ref.per_token_quant_fp8(x)
    assert s.shape == (4, 1)
    for r in (0, 1, 3):
        sv = f32(x[r].float().abs().max().item() / 448)
        assert s[r, 0].item() == sv
        inv = f32(1 / sv)
        assert q[r, 9].view(torch.uint8).item() == brute_e4m3_byte(f32(x[r, 9].item() * inv))
    assert s[2, 0] == 0 and (q[2].float() == 0).all()


def test_per_tensor_static_and_dynamic():
    x = torch.randn(8, 32) * 100
    x[0, 0] = 1e6  # saturates under a static scale of 1
    q, s = ref.scaled_fp8_quant(x, torch.tensor([1.0]))
    assert q[0, 0].float().item() == 448.0 and s.item() == 1.0
    qd, sd = ref.scaled_fp8_quant(x)
    assert sd.item() == f32(1e6 / 448)
    assert qd[0, 0].float().item() == 448.0
    assert ((qd.float() * sd - x).abs() <= x.abs() / 16 + sd * 2 ** -9).all()
    qz, sz = ref.scaled_fp8_quant(torch.zeros(2, 16))
    assert sz.item() == 0 and (qz.float() == 0).all()


def test_nan_inf_policy():
    x = torch.randn(2, 128)
    x[0, 3] = math.nan
    x[1, 4] = math.inf
    q, s = ref.per_token_group_quant_fp8(x)
    clean = x.clone()
    clean[0, 3] = 0
    assert s[0, 0] == ref.per_token_group_quant_fp8(clean[:1])[1][0, 0]  # NaN ignored by amax
    assert math.isnan(q[0, 3].float().item())
    # Inf acts like the largest finite value: finite scale, the Inf saturates, the rest round to ~0
    assert s[1, 0].item() == f32(f32(3.4028234663852886e38) * ONE_OVER_448)
    assert q[1, 4].float().item() == 448.0 and not torch.isnan(q[1].float()).any()
    qt, st = ref.per_token_quant_fp8(x[1:].to(torch.bfloat16))
    assert torch.isfinite(st).all() and qt[0, 4].float().item() == 448.0
