"""The Hopper FP4-weight layout: what the kernels in :mod:`.triton_w4` read, and the exact way back.

A :class:`Nvfp4Weight` (canonical: packed E2M1 ``[..., N, K/2]``, linear E4M3 block scales
``[..., N, K/16]``, per-row encode global scales ``[..., N]``) is converted once, at load time, into a
:class:`PackedW4Weight` whose :class:`HopperW4Layout` says how the bytes are arranged. Why each
choice (all three are invisible to callers; :func:`unpack` restores the canonical bytes exactly):

Tiles matching the tensor-core register fragment ("swap AB")
    The kernels compute ``y^T = W @ x^T``: the decoded weight is the *A* operand of the Hopper
    tensor-core instruction and stays in registers (no shared-memory round trip for decoded bf16).
    Weight rows are grouped in atoms of 64 rows x 64 K. Thread ``(w, g, c)`` of a 4-warp group owns,
    for every 16-wide K step ``j``, rows ``16w+g`` and ``16w+g+8`` at K offsets ``2c, 2c+1, 2c+8,
    2c+9`` -- the mma/wgmma A fragment. Those 8 codes are stored in ONE 32-bit word, and the 4 words
    of ``j = 0..3`` are adjacent: one 16-byte vector load per thread per atom, rows coalesced.
    Storage: int32 ``words[E, N_pad/2, K_pad/4]``; row ``i = 32*(n//64) + 8*((n%64)//16) + n%8``
    holds the row pair ``(n, n+8)``; column ``16*(k//64) + 4*c + j``.

Bit-interleaved codes (decode = a few shifts and masks per 8 values)
    E2M1 is a float (sign, 2-bit exponent with bias 1, 1-bit mantissa): moving its bits to the
    sign / exponent-LSB / mantissa-MSB positions of a bf16 (fp16) gives ``e2m1 * 2**-126``
    (``e2m1 * 2**-14``); the missing power of two is folded into the block scale. Within a word
    the 8 codes are scattered so that the four bf16x2 (fp16x2) registers come out of 9 (11)
    shift/mask instructions (:data:`BIT_PLANS`, found by exhaustive search; each output register
    is the OR of ``rotr(word, r) & mask`` over its pieces).

Block scales re-encoded to one byte that expands with one integer multiply-add
    ``u = ((e + 21) << 3) | m`` for ``s = 2**e * (1 + m/8)`` (E4M3 subnormals normalized; 0 for a
    zero scale). ``(u << 4) + 0x7000`` is the bf16 bit pattern of ``s * 2**118`` and ``u << 7``
    the fp16 pattern of ``s * 2**6``. So each decoded weight is ``e2m1 * s * 2**-8`` exactly
    (<= 6 significant bits, inside the normal range of both types; fp16 subnormals are exact too),
    and the tensor core forms exact products with bf16/fp16 activations, accumulated in fp32.
    Scales are stored in pairs (rows ``n``, ``n+8``) as 16-bit ``scales[E, N_pad/2, ks]``,
    element ``(i, 4*(k//64) + j)``, rows padded to 16 bytes.

Global scale folded into a per-output-row fp32 epilogue multiplier
    ``alpha[n] = 2**8 / gs[n]`` (fp32 ``[E, N_pad]``; exact per-shard handling for fused modules,
    since the canonical form already carries one encode scale per row). The canonical
    ``global_scale`` is kept too, so :func:`unpack` is exact.

Zero block scales
    With the bf16 plan a zero scale expands to ``2**97`` (the constant cannot vanish), so blocks
    with a zero scale get their codes zeroed (their value is 0 either way); the original codes of
    such blocks are kept in a small side table so :func:`unpack` stays exact.

Block scales must be finite and non-negative (what every quantizer writes); :func:`prepack` says so
otherwise.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

import torch

from .. import numerics as nx
from ..weights import Nvfp4Weight

#: Rows per weight atom (one warpgroup's wgmma M) and K per atom.
ATOM_N = 64
ATOM_K = 64
#: N is padded to this (the widest weight tile every shape can use; ``bn=256`` shared-memory tiles
#: apply only where the padded N is a multiple of 256, checked at launch), K to :data:`ATOM_K`.
N_PAD_MULTIPLE = 128
#: The decoded weight is ``e2m1 * s * 2**-SCALE_SHIFT``; the epilogue multiplies by ``2**SCALE_SHIFT / gs``.
SCALE_SHIFT = 8
#: bf16 bit pattern of the expanded scale: ``(u << 4) + BF16_SCALE_BIAS`` (exponent field + 224).
BF16_SCALE_BIAS = 0x7000
SCALE_CODE_EXP_BIAS = 21

#: Per activation dtype: (magnitude bit positions b0,b1,b2 inside a 16-bit half, sign position,
#: outputs). Output register o_k (k = h + 2*kh: row offset h*8, K offset kh*8) is
#: ``OR over pieces (rotr(word, r) & mask)``; half e (low/high 16 bits) holds K offset +e.
BIT_PLANS = {
    torch.bfloat16: ((6, 7, 8), 15, (
        ((0, 0x81C081C0),),
        ((4, 0x81C081C0),),
        ((10, 0x81C081C0),),
        ((30, 0x80C080C0), (6, 0x01000100)),
    )),
    torch.float16: ((9, 10, 11), 15, (
        ((0, 0x8E008E00),),
        ((2, 0x04000400), (5, 0x8A008A00)),
        ((2, 0x08000800), (9, 0x86008600)),
        ((2, 0x80008000), (12, 0x0E000E00)),
    )),
}

ACT_DTYPES = tuple(BIT_PLANS)


def _source_bits(act_dtype: torch.dtype) -> list[list[list[int]]]:
    """``src[k][e][b]``: word bit holding code bit ``b`` (0..2 magnitude, 3 sign) of output k, half e."""
    mag, sign, outputs = BIT_PLANS[act_dtype]
    src = []
    for pieces in outputs:
        per_half = []
        for e in range(2):
            bits = []
            for target in (*mag, sign):
                p = target + 16 * e
                rs = [r for r, m in pieces if (m >> p) & 1]
                if len(rs) != 1:
                    raise AssertionError(f"bit plan for {act_dtype}: output bit {p} covered {len(rs)} times")
                bits.append((p + rs[0]) % 32)
            per_half.append(bits)
        src.append(per_half)
    flat = sorted(b for o in src for h in o for b in h)
    if flat != list(range(32)):
        raise AssertionError(f"bit plan for {act_dtype} does not use each word bit exactly once")
    return src


@dataclass(frozen=True)
class HopperW4Layout:
    """Static description of a :class:`PackedW4Weight` (hashable: usable as layer metadata)."""

    act_dtype: torch.dtype        # bf16 or fp16: which bit plan the words use
    n: int                        # logical output features
    k: int                        # logical input features (multiple of 16)
    lead_shape: tuple = ()        # e.g. (E,) for MoE experts
    name: str = "hopper_w4_swapab_v1"
    #: ``alpha`` of every row when a dense weight has one global scale (else None), read once at pack
    #: time: the cuBLAS large-M path applies it as the GEMM's host-side alpha, without a sync per call.
    alpha_const: float | None = None

    @property
    def n_pad(self) -> int:
        return nx.round_up(max(self.n, 1), N_PAD_MULTIPLE)

    @property
    def k_pad(self) -> int:
        return nx.round_up(max(self.k, 1), ATOM_K)

    @property
    def num_experts(self) -> int:
        return math.prod(self.lead_shape)

    @property
    def word_cols(self) -> int:
        return self.k_pad // 4

    @property
    def scale_cols(self) -> int:
        """uint16 scale pairs per row pair, padded so each row starts on 16 bytes."""
        return nx.round_up(self.k_pad // nx.NVFP4_BLOCK_SIZE, 8)


@dataclass
class PackedW4Weight:
    """NVFP4 weight in the Hopper kernel layout (see the module docstring).

    words:        int32   ``[E, N_pad/2, K_pad/4]``
    scales:       int16   ``[E, N_pad/2, scale_cols]``: two re-encoded block scales per element,
                  low byte row ``n``, high byte row ``n+8`` (bit patterns; the kernels read them unsigned)
    alpha:        float32 ``[E, N_pad]`` = ``2**8 / global_scale`` (0 in padding rows)
    global_scale: float32 ``[E, N]``, the canonical encode scales (kept for an exact unpack)
    zero_blocks:  int64 ``[Z]`` flat indices into ``[E, N, K/16]`` of zero-scale blocks whose codes
                  were not all zero, and zero_codes uint8 ``[Z, 8]`` their original packed bytes.
    """

    layout: HopperW4Layout
    words: torch.Tensor
    scales: torch.Tensor
    alpha: torch.Tensor
    global_scale: torch.Tensor
    zero_blocks: torch.Tensor
    zero_codes: torch.Tensor = field(repr=False)

    @property
    def device(self) -> torch.device:
        return self.words.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """The device tensors by name (to register as layer buffers); rebuild with :meth:`from_tensors`."""
        return {"words": self.words, "scales": self.scales, "alpha": self.alpha, "global_scale": self.global_scale,
                "zero_blocks": self.zero_blocks, "zero_codes": self.zero_codes}

    @classmethod
    def from_tensors(cls, layout: HopperW4Layout, tensors: dict[str, torch.Tensor]) -> PackedW4Weight:
        return cls(layout, **{k: tensors[k] for k in ("words", "scales", "alpha", "global_scale", "zero_blocks",
                                                      "zero_codes")})

    def to(self, device) -> PackedW4Weight:
        return PackedW4Weight(self.layout, *(t.to(device) for t in (self.words, self.scales, self.alpha,
                                                                    self.global_scale, self.zero_blocks,
                                                                    self.zero_codes)))

    def expert(self, e: int) -> PackedW4Weight:
        """One expert as a 2-D weight (views; the zero-block side table is filtered)."""
        lay = self.layout
        per = lay.n * (lay.k // nx.NVFP4_BLOCK_SIZE)
        sel = (self.zero_blocks // per) == e
        return PackedW4Weight(HopperW4Layout(lay.act_dtype, lay.n, lay.k, (), lay.name), self.words[e:e + 1],
                              self.scales[e:e + 1], self.alpha[e:e + 1], self.global_scale[e:e + 1],
                              self.zero_blocks[sel] - e * per, self.zero_codes[sel])


# ----------------------------------------------------------------------------------------------
# Scale re-encoding
# ----------------------------------------------------------------------------------------------

def encode_scale_codes(block_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales -> uint8 codes ``((e + 21) << 3) | m`` (0 for a zero scale)."""
    s = block_scale.float()
    bad = ~torch.isfinite(s) | (s < 0) | torch.signbit(s)
    if bool(bad.any()):  # load time only
        raise ValueError("block_scale: NVFP4 block scales must be finite and non-negative (+0 allowed); "
                         f"got {int(bad.sum())} negative, -0, NaN or Inf values")
    mant, ex = torch.frexp(s)                       # s = mant * 2**ex, 0.5 <= mant < 1
    e = (ex - 1).to(torch.int32)
    m = ((mant * 2 - 1) * 8).round().to(torch.int32)
    code = ((e + SCALE_CODE_EXP_BIAS) << 3) | m
    return torch.where(s == 0, torch.zeros_like(code), code).to(torch.uint8)


def decode_scale_codes(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_scale_codes`: uint8 codes -> float8_e4m3fn scales (exact)."""
    c = codes.to(torch.int32)
    val = torch.ldexp(1 + (c & 7).float() / 8, (c >> 3) - SCALE_CODE_EXP_BIAS)
    return torch.where(c == 0, torch.zeros_like(val), val).to(torch.float8_e4m3fn)


def expand_scale_code(codes: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
    """What the kernel computes from a code: ``s * 2**118`` (bf16) or ``s * 2**6`` (fp16) (tests)."""
    c = codes.to(torch.int32)
    if act_dtype == torch.bfloat16:
        bits = (c << 4) + BF16_SCALE_BIAS
    else:
        bits = c << 7
    return bits.to(torch.int16).view(act_dtype)


# ----------------------------------------------------------------------------------------------
# Prepack / unpack
# ----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _slot_words(act_dtype: torch.dtype) -> torch.Tensor:
    """int64 ``[8 * 16]``: entry ``16 * (4h + 2kh + e) + code`` is the word bits that ``code`` sets in
    slot ``(h, kh, e)`` of a word (the slots' bits are disjoint, so a word is the sum of its 8 slots)."""
    src = _source_bits(act_dtype)
    tab = [sum(((code >> b) & 1) << pos for b, pos in enumerate(src[h + 2 * kh][e]))
           for h in range(2) for kh in range(2) for e in range(2) for code in range(16)]
    return torch.tensor(tab, dtype=torch.int64)


def _codes_to_words(codes: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
    """codes uint8 ``[E, N_pad, K_pad]`` -> int32 words ``[E, N_pad/2, K_pad/4]``."""
    e_, n_pad, k_pad = codes.shape
    # n = 64*na + 16*w + 8*h + g ; k = 64*ka + 16*j + 8*kh + 2*c + e
    c = codes.reshape(e_, n_pad // 64, 4, 2, 8, k_pad // 64, 4, 2, 4, 2)
    #                  0   1          2  3  4  5           6  7  8  9
    #                  E   na         w  h  g  ka          j  kh c  e
    c = c.permute(0, 1, 2, 4, 5, 8, 6, 3, 7, 9).to(torch.int64)  # E na w g ka c j | h kh e
    slot = torch.arange(0, 8 * 16, 16, dtype=torch.int64, device=codes.device).view(2, 2, 2)
    word = _slot_words(act_dtype).to(codes.device)[c + slot].sum(dim=(-3, -2, -1))
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return word.reshape(e_, n_pad // 2, k_pad // 4)


def _words_to_codes(words: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`_codes_to_words`."""
    e_, half_n, kw = words.shape
    n_pad, k_pad = half_n * 2, kw * 4
    src = _source_bits(act_dtype)
    w = words.to(torch.int64) & 0xFFFFFFFF
    w = w.reshape(e_, n_pad // 64, 4, 8, k_pad // 64, 4, 4)      # E na w g ka c j
    out = torch.zeros((*w.shape, 2, 2, 2), dtype=torch.uint8, device=words.device)  # ... h kh e
    for h in range(2):
        for kh in range(2):
            for e in range(2):
                code = torch.zeros_like(w)
                for b, pos in enumerate(src[h + 2 * kh][e]):
                    code |= ((w >> pos) & 1) << b
                out[..., h, kh, e] = code.to(torch.uint8)
    # E na w g ka c j h kh e -> E na w h g ka j kh c e
    out = out.permute(0, 1, 2, 7, 3, 4, 6, 8, 5, 9)
    return out.reshape(e_, n_pad, k_pad)


#: Codes converted per step of :func:`prepack` (a step's temporaries are ~20 bytes per code): experts
#: go in groups of at most this many codes, so that a layer of 128 experts is a few dozen steps, not
#: hundreds of small ones, while its temporaries stay under ~400 MB.
PREPACK_CHUNK_CODES = 1 << 24


def prepack(weight: Nvfp4Weight, act_dtype: torch.dtype = torch.bfloat16) -> PackedW4Weight:
    """Canonical :class:`Nvfp4Weight` -> :class:`PackedW4Weight` for activations of ``act_dtype``.

    Load time only (reads values to validate the scales); works on any device, a group of experts
    (:data:`PREPACK_CHUNK_CODES`) at a time.
    """
    if act_dtype not in BIT_PLANS:
        raise ValueError(f"act_dtype: expected torch.bfloat16 or torch.float16, got {act_dtype}")
    lay = HopperW4Layout(act_dtype, weight.n, weight.k, weight.lead_shape)
    n, k, n_pad, k_pad = lay.n, lay.k, lay.n_pad, lay.k_pad
    kb = k // nx.NVFP4_BLOCK_SIZE
    dev = weight.packed.device
    num_e = max(lay.num_experts, 1)
    packed = weight.packed.reshape(num_e, n, k // 2)
    bscale = weight.block_scale.reshape(num_e, n, kb)
    gs = weight.global_scale.reshape(num_e, n).float()

    words = torch.empty((num_e, n_pad // 2, k_pad // 4), dtype=torch.int32, device=dev)
    scales = torch.zeros((num_e, n_pad // 2, lay.scale_cols), dtype=torch.int16, device=dev)
    zero_blocks, zero_codes = [], []
    step = max(1, PREPACK_CHUNK_CODES // (n_pad * k_pad))
    for e0 in range(0, num_e, step):
        e1 = min(num_e, e0 + step)
        c = e1 - e0
        sc = encode_scale_codes(bscale[e0:e1])                    # [c, N, KB]
        codes = nx.unpack_fp4(packed[e0:e1])                       # [c, N, K]
        zero = sc == 0
        zb = zero[..., None].expand(c, n, kb, nx.NVFP4_BLOCK_SIZE).reshape(c, n, k)
        blocks_nz = (codes.reshape(c, n, kb, nx.NVFP4_BLOCK_SIZE) != 0).any(-1) & zero
        if bool(blocks_nz.any()):
            idx = torch.nonzero(blocks_nz.reshape(-1)).reshape(-1)
            zero_blocks.append(idx + e0 * n * kb)
            zero_codes.append(packed[e0:e1].reshape(c * n * kb, 8)[idx])
        full = torch.zeros((c, n_pad, k_pad), dtype=torch.uint8, device=dev)
        full[:, :n, :k] = torch.where(zb, torch.zeros_like(codes), codes)
        words[e0:e1] = _codes_to_words(full, act_dtype)
        scp = torch.zeros((c, n_pad, k_pad // nx.NVFP4_BLOCK_SIZE), dtype=torch.int32, device=dev)
        scp[:, :n, :kb] = sc.to(torch.int32)
        scp = scp.reshape(c, n_pad // 64, 4, 2, 8, -1)             # c na w h g kb
        pair = scp[:, :, :, 0] | (scp[:, :, :, 1] << 8)            # c na w g kb
        pair = pair.reshape(c, n_pad // 2, -1)
        scales[e0:e1, :, :pair.shape[2]] = torch.where(pair >= 2**15, pair - 2**16, pair).to(torch.int16)
    alpha = torch.zeros((num_e, n_pad), dtype=torch.float32, device=dev)
    alpha[:, :n] = float(2 ** SCALE_SHIFT) / gs
    if not lay.lead_shape and bool((gs == gs[0, 0]).all()):
        lay = replace(lay, alpha_const=float(alpha[0, 0]))
    zb_t = torch.cat(zero_blocks) if zero_blocks else torch.zeros(0, dtype=torch.int64, device=dev)
    zc_t = torch.cat(zero_codes) if zero_codes else torch.zeros((0, 8), dtype=torch.uint8, device=dev)
    return PackedW4Weight(lay, words, scales, alpha, gs.contiguous(), zb_t, zc_t)


def unpack(p: PackedW4Weight) -> Nvfp4Weight:
    """Exact inverse of :func:`prepack`: the canonical weight, byte for byte."""
    lay = p.layout
    n, k = lay.n, lay.k
    kb = k // nx.NVFP4_BLOCK_SIZE
    num_e = p.words.shape[0]
    codes = _words_to_codes(p.words, lay.act_dtype)[:, :n, :k]
    packed = nx.pack_fp4(codes).reshape(num_e * n * kb, 8)
    if p.zero_blocks.numel():
        packed[p.zero_blocks] = p.zero_codes
    packed = packed.reshape(*lay.lead_shape, n, k // 2)
    pair = p.scales.view(torch.int16).to(torch.int32) & 0xFFFF    # [E, N_pad/2, cols]
    pair = pair[:, :, :lay.k_pad // nx.NVFP4_BLOCK_SIZE]
    pair = pair.reshape(num_e, lay.n_pad // 64, 4, 8, -1)         # E na w g kb
    both = torch.stack((pair & 0xFF, pair >> 8), dim=3)            # E na w h g kb
    sc = both.reshape(num_e, lay.n_pad, -1)[:, :n, :kb]
    block_scale = decode_scale_codes(sc).reshape(*lay.lead_shape, n, kb)
    gs = p.global_scale.reshape(*lay.lead_shape, n).clone()
    return Nvfp4Weight(packed.contiguous(), block_scale.contiguous(), gs)


def dequantize_packed(p: PackedW4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense ``[..., N, K]`` weight from the packed form (through :func:`unpack`; tests and fallbacks)."""
    return unpack(p).dequantize(dtype)
