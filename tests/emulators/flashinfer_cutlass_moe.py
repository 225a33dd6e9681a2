"""A CPU emulator of ``flashinfer.fused_moe.cutlass_fused_moe`` on its NVFP4 path (flashinfer-python 0.6.14),
for testing callers without a Blackwell GPU.

Written from FlashInfer's source, independently of nvfp4_plugin's own code (the 128x4 scale decode and
E2M1 decode are shared with the mm_fp4 emulator only):

- checks: ``flashinfer_cutlass_fused_moe_binding.cu`` ``runMoe`` (dtypes, ranks, gated fc1 = 2 x fc2
  inter size, TMA alignment ``128 / (8 x min(act bytes, weight bytes))``) and ``getQuantParams`` (the six
  NVFP4 quant scales: dtypes, ranks, shapes with ``alignToSfDim``);
- expansion: ``expandInputRowsKernel`` copies pre-quantized rows and their swizzled scales (one fc1
  activation scale only: it asserts against per-expert scales there) or quantizes bf16/fp16 rows with
  ``fc1_act_global[expert]`` (``[E]``) or ``[0]`` (scalar);
- GEMM1: exact FP4 x E4M3 products (in fp64, standing in for the kernel's fp32 accumulation in another
  order), the fp32 result times ``fc1 alpha[expert]``, stored in the output dtype;
- ``doActivationKernel`` (SwiGLU): gate = second half of the GEMM1 row, linear = first half;
  ``gate * (1 / (1 + exp(-gate))) * linear`` in fp32 (CUTLASS ``SiLu`` / ``Sigmoid``; the kernel's exp is
  a fast approximation, torch's here), cast to the output dtype, quantized with ``fc2_act_global``;
- the quantizer is ``cvt_warp_fp16_to_fp4`` (quantization_utils.cuh, default fast-math path):
  ``sf = e4m3_satfinite(gs * (vmax * rcp(6)))``, ``out_scale = vmax != 0 ? rcp(fp32(sf) * rcp(gs)) : 0``,
  codes ``cvt.rn.satfinite.e2m1x2.f32(x * out_scale)``. The kernel's ``rcp.approx.ftz`` is taken here as
  the correctly rounded reciprocal (only a B200 shows where it is not). A block with ``vmax != 0`` whose
  scale rounds to 0 gets ``out_scale = inf``: its codes saturate to +-6 (0 stays 0 and NaN maps to 0
  here), all with value 0 under the zero scale;
- GEMM2 likewise with ``fc2 alpha``, stored in the output dtype; the combine is
  ``finalizeMoeRoutingKernel`` (the unfused finalize): ``sum_k scale[t, k] * row`` in fp32, k ascending,
  cast to the output dtype. Tokens routed to an expert outside ``[0, E)`` contribute nothing.

Only what our backend uses is emulated (Swiglu, no biases, no swiglu_alpha/beta/limit, tp = ep = 1);
anything else raises NotImplementedError. Like the real function, it returns a list, output first.
"""

from __future__ import annotations

import torch

from .flashinfer_mm_fp4 import _unswizzle

calls: list[dict] = []        # every call's arguments and intermediates, for tests to inspect

SWIGLU = 3                    # flashinfer.tllm_enums.ActivationType.Swiglu
NVFP4_VEC = 16
MIN_N_ALIGN = 128             # MinNDimAlignmentNVFP4 (rows of an SF tile)
MIN_K_ALIGN = 64              # MinKDimAlignmentNVFP4 (16 x 4: columns of an SF tile, in elements)
RCP6 = torch.tensor(1.0 / 6.0, dtype=torch.float32)


def _align(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """``cvt.rn.satfinite.e2m1x2.f32`` per element: nearest of 0, .5, 1, 1.5, 2, 3, 4, 6 (ties to the even
    code), saturating; the sign bit of the input (also for zero); NaN -> 0 here."""
    a = y.abs()
    mag = torch.zeros_like(a, dtype=torch.uint8)
    # boundaries with the even neighbour winning ties: codes 0,2,4,6 are even
    for lo_incl, bound, code in ((False, 0.25, 1), (True, 0.75, 2), (False, 1.25, 3), (True, 1.75, 4),
                                 (False, 2.5, 5), (True, 3.5, 6), (False, 5.0, 7)):
        above = a >= bound if lo_incl else a > bound
        mag = torch.where(above, torch.full_like(mag, code), mag)
    sign = torch.signbit(y).to(torch.uint8) << 3
    codes = mag | sign
    return torch.where(torch.isnan(y), torch.zeros_like(codes), codes)


def quantize_rows(x: torch.Tensor, gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's NVFP4 quantizer on rows ``x [R, K]`` (bf16/fp16 values), encode scale ``gs [R]``:
    (codes uint8 ``[R, K]``, one per element, E4M3 scales ``[R, K/16]``)."""
    r, k = x.shape
    v = x.float().reshape(r, k // NVFP4_VEC, NVFP4_VEC)
    vmax = v.abs().amax(dim=-1)
    g = gs.float().reshape(r, 1)
    sf = (g * (vmax * RCP6)).clamp(max=448.0).to(torch.float8_e4m3fn)
    sfv = sf.float()
    out_scale = torch.where(vmax != 0, 1.0 / (sfv * (1.0 / g)), torch.zeros_like(vmax))
    codes = _e2m1_codes(v * out_scale[..., None])
    return codes.reshape(r, k), sf


def _dequant(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes ``[R, K]`` (one per element) and E4M3 scales ``[R, K/16]`` -> fp64 values."""
    table = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0),
                         dtype=torch.float64)
    r, k = codes.shape
    vals = table[codes.long()].reshape(r, k // NVFP4_VEC, NVFP4_VEC)
    return (vals * scales.double()[..., None]).reshape(r, k)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K/2]`` -> codes ``[..., K]`` (element 2i in the low nibble)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def _weight(w: torch.Tensor, sf: torch.Tensor, rows: int, k: int):
    """int64 ``[E, rows, K/16]`` codes and int32 swizzled scales -> per-expert (codes ``[E, rows, K]``,
    E4M3 scales ``[E, rows, K/16]``)."""
    e = w.shape[0]
    codes = _unpack(w.contiguous().view(torch.uint8).reshape(e, rows, k // 2))
    sfb = sf.contiguous().view(torch.uint8)
    scales = torch.stack([_unswizzle(sfb[i], rows, k // NVFP4_VEC) for i in range(e)]).view(torch.float8_e4m3fn)
    return codes, scales


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def cutlass_fused_moe(input, token_selected_experts, token_final_scales, fc1_expert_weights, fc2_expert_weights,
                      output_dtype, quant_scales, fc1_expert_biases=None, fc2_expert_biases=None, input_sf=None,
                      swiglu_alpha=None, swiglu_beta=None, swiglu_limit=None, tp_size=1, tp_rank=0, ep_size=1,
                      ep_rank=0, cluster_size=1, cluster_rank=0, output=None, enable_alltoall=False,
                      use_deepseek_fp8_block_scale=False, use_w4_group_scaling=False, use_mxfp8_act_scaling=False,
                      min_latency_mode=False, use_packed_weights=False, tune_max_num_tokens=8192, enable_pdl=None,
                      activation_type=SWIGLU, swizzled_input_sf=True):
    if (fc1_expert_biases is not None or fc2_expert_biases is not None or swiglu_alpha is not None
            or swiglu_beta is not None or swiglu_limit is not None
            or (tp_size, tp_rank, ep_size, ep_rank) != (1, 0, 1, 0)
            or (cluster_size, cluster_rank) != (1, 0) or enable_alltoall or use_deepseek_fp8_block_scale
            or use_w4_group_scaling or use_mxfp8_act_scaling or min_latency_mode or use_packed_weights
            or int(activation_type) != SWIGLU):
        raise NotImplementedError("emulated: NVFP4 Swiglu without biases, swiglu parameters or parallelism only")
    # runMoe
    _check(fc1_expert_weights.dtype == torch.int64 and fc2_expert_weights.dtype == torch.int64,
           f"NVFP4 weights must be int64 (16 codes each), got {fc1_expert_weights.dtype}, {fc2_expert_weights.dtype}")
    _check(input.dim() == 2 and token_selected_experts.dim() == 2, "input and token_selected_experts must be 2-D")
    _check(fc1_expert_weights.dim() == 3 and fc2_expert_weights.dim() == 3, "expert weights must be 3-D")
    _check(token_selected_experts.dtype == torch.int32, f"token_selected_experts must be int32, got "
           f"{token_selected_experts.dtype}")
    _check(token_final_scales.dtype == torch.float32 and token_final_scales.shape == token_selected_experts.shape,
           "token_final_scales must be fp32 with token_selected_experts' shape")
    _check(input.shape[0] == token_selected_experts.shape[0], "input and token_selected_experts must have the same "
           "num tokens")
    num_experts = fc2_expert_weights.shape[0]
    _check(fc1_expert_weights.shape[0] == num_experts, "fc1 and fc2 must have the same number of experts")
    hidden = fc2_expert_weights.shape[1]
    inter = fc2_expert_weights.shape[2] * NVFP4_VEC
    _check(fc1_expert_weights.shape[1] == 2 * inter, "fc1_expert_weights inter size must be 2 times "
           "fc2_expert_weights inter size")
    _check(fc1_expert_weights.shape[2] * NVFP4_VEC == hidden, "fc1 K must be fc2's hidden size")
    prequant = input.dtype == torch.uint8
    _check(prequant or input.dtype in (torch.bfloat16, torch.float16),
           f"emulated inputs: NVFP4 codes (uint8) or bf16/fp16, got {input.dtype}")
    # the kernel reads hidden_size from fc2 and never checks the input's width: a mismatch reads out of bounds
    _check(input.shape[1] == (hidden // 2 if prequant else hidden), f"input width {input.shape[1]} does not match "
           f"hidden_size {hidden}")
    act_bytes = 1 if prequant else 2
    min_alignment = 128 // (8 * min(act_bytes, 8))
    _check(hidden % min_alignment == 0 and inter % min_alignment == 0,
           f"hidden_size {hidden} and inter_size {inter} must be divisible by {min_alignment}")
    _check(output_dtype in (torch.bfloat16, torch.float16), f"Invalid output type {output_dtype}")
    m = input.shape[0]
    if output is not None:
        _check(tuple(output.shape) == (m, hidden) and output.dtype == output_dtype,
               f"output: expected {(m, hidden)} {output_dtype}, got {tuple(output.shape)} {output.dtype}")
    # getQuantParams, NVFP4
    _check(quant_scales is not None and len(quant_scales) == 6, "Expecting 6 quant scales for nvfp4 quantization")
    fc1_act, fc1_sf, fc1_alpha, fc2_act, fc2_sf, fc2_alpha = quant_scales
    for name, t, dt in (("fc1 act global", fc1_act, torch.float32), ("fc1 weight block", fc1_sf, torch.int32),
                        ("fc1 global", fc1_alpha, torch.float32), ("fc2 act global", fc2_act, torch.float32),
                        ("fc2 weight block", fc2_sf, torch.int32), ("fc2 global", fc2_alpha, torch.float32)):
        _check(t.dtype == dt, f"{name}: expected {dt}, got {t.dtype}")
    for name, t in (("fc1 act global", fc1_act), ("fc2 act global", fc2_act)):
        _check(t.dim() == 0 or (t.dim() == 1 and t.shape[0] == num_experts),
               f"{name} must be scalar or (num_experts_on_rank,), got {tuple(t.shape)}")
    _check(tuple(fc1_sf.shape) == (num_experts, _align(inter, MIN_K_ALIGN) * 2, _align(hidden, MIN_K_ALIGN) // 64),
           f"fc1 weight block size must be (num_experts_on_rank, inter_size * 2, hidden_size // 4 // 16), got "
           f"{tuple(fc1_sf.shape)}")
    _check(tuple(fc2_sf.shape) == (num_experts, _align(hidden, MIN_N_ALIGN), _align(inter, MIN_K_ALIGN) // 64),
           f"fc2 weight block size must be (num_experts_on_rank, hidden_size, inter_size // 4 // 16), got "
           f"{tuple(fc2_sf.shape)}")
    _check(tuple(fc1_alpha.shape) == (num_experts,) and tuple(fc2_alpha.shape) == (num_experts,),
           "fc1/fc2 global size must be (num_experts_on_rank,)")
    if prequant:
        _check(input_sf is not None, "pre-quantized (uint8) input needs input_sf")
        _check(fc1_act.dim() == 0, "Cannot use per-expert act scale for pre-quantized activations")
    calls.append(dict(input=input, token_selected_experts=token_selected_experts,
                      token_final_scales=token_final_scales, fc1_expert_weights=fc1_expert_weights,
                      fc2_expert_weights=fc2_expert_weights, output_dtype=output_dtype, quant_scales=quant_scales,
                      input_sf=input_sf, swizzled_input_sf=swizzled_input_sf, output=output))
    rec = calls[-1]

    w1_codes, w1_sf = _weight(fc1_expert_weights, fc1_sf, 2 * inter, hidden)
    w2_codes, w2_sf = _weight(fc2_expert_weights, fc2_sf, hidden, inter)
    top_k = token_selected_experts.shape[1]
    expert = token_selected_experts.reshape(-1).long()            # expanded row r = t * top_k + k
    token = torch.arange(m * top_k) // top_k
    valid = (expert >= 0) & (expert < num_experts)
    e_idx = expert.clamp(0, num_experts - 1)
    per_expert = lambda s: s.reshape(1).expand(m * top_k) if s.dim() == 0 else s[e_idx]  # noqa: E731

    # expandInputRowsKernel
    if prequant:
        codes = _unpack(input)[token]
        sfb = input_sf.contiguous().view(torch.uint8)
        if swizzled_input_sf:
            lin = _unswizzle(sfb.reshape(_align(m, 128), -1), m, hidden // NVFP4_VEC)
        else:
            lin = sfb.reshape(m, hidden // NVFP4_VEC)
        x_codes, x_sf = codes, lin.view(torch.float8_e4m3fn)[token]
    else:
        x_codes, x_sf = quantize_rows(input[token], per_expert(fc1_act))
    rows = m * top_k
    h1 = torch.zeros(rows, 2 * inter, dtype=output_dtype)
    x_deq = _dequant(x_codes, x_sf)
    for e in range(num_experts):
        sel = (expert == e).nonzero().flatten()
        if sel.numel():
            acc = x_deq[sel] @ _dequant(w1_codes[e], w1_sf[e]).T
            h1[sel] = (acc.float() * fc1_alpha[e]).to(output_dtype)
    # doActivationKernel: linear = first half, gate = second half
    linear, gate = h1[:, :inter].float(), h1[:, inter:].float()
    act = ((gate * (1.0 / (1.0 + torch.exp(-gate)))) * linear).to(output_dtype)
    a_codes, a_sf = quantize_rows(act, per_expert(fc2_act))
    a_deq = _dequant(a_codes, a_sf)
    h2 = torch.zeros(rows, hidden, dtype=output_dtype)
    for e in range(num_experts):
        sel = (expert == e).nonzero().flatten()
        if sel.numel():
            acc = a_deq[sel] @ _dequant(w2_codes[e], w2_sf[e]).T
            h2[sel] = (acc.float() * fc2_alpha[e]).to(output_dtype)
    # finalizeMoeRoutingKernel
    out = torch.zeros(m, hidden, dtype=torch.float32)
    scales = token_final_scales.float()
    for k in range(top_k):
        r = torch.arange(m) * top_k + k
        term = scales[:, k:k + 1] * h2[r].float()
        out = out + torch.where(valid[r][:, None], term, torch.zeros_like(term))
    out = out.to(output_dtype)
    rec.update(expert=expert, fc1_input_codes=x_codes, fc1_input_scales=x_sf, gemm1_out=h1, act=act,
               fc2_input_codes=a_codes, fc2_input_scales=a_sf, gemm2_out=h2)
    if output is None:
        output = out
    else:
        output.copy_(out)
    return [output]
