"""Kernel configurations: tuned per device in ``configs/<device>.json``, heuristics otherwise.

Chosen in Python from static shapes only (M or the routed row count, N, K, E: all known on the host
without reading device memory), so selection never synchronizes and is CUDA-graph safe. Lookups
are cached per shape.

JSON layout (written by ``benchmarks/tune_gemm.py``)::

    {"device": "NVIDIA H200", "triton": "3.6.0",
     "dense":   {"N=6144,K=4096":       {"1": {config}, "4": {...}, ...}},
     "grouped": {"E=128,N=1536,K=2048": {"8": {...}, ...}},     # bucket = routed rows (tokens*top_k)
     "masked":  {"E=128,N=1536,K=2048": {"8": {...}, ...}}}     # bucket = max_m

A bucket entry applies to sizes up to its key (the nearest tuned bucket at or above the size). Sizes
beyond a shape's largest tuned bucket, and shapes with no entry, use :func:`heuristic`: a table tuned
only for small sizes must not hand its small-size tiles to prefill-sized calls.
"""

from __future__ import annotations


import functools
import json
import logging
from dataclasses import dataclass, fields, replace
from typing import ClassVar
from pathlib import Path

import torch

from .. import envs

logger = logging.getLogger("nvfp4_plugin")

CONFIG_DIR = Path(__file__).parent / "configs"
#: Override the config directory (e.g. to try freshly tuned files).
ENV_CONFIG_DIR = envs.GEMM_CONFIG_DIR
KINDS = ("dense", "grouped", "masked")


@dataclass(frozen=True)
class W4Config:
    """Launch configuration of the Hopper FP4-weight GEMMs; one subclass per kernel family
    (:class:`TritonMmaConfig`, :class:`TritonWgmmaConfig`, :class:`GluonConfig`,
    :class:`DequantMmConfig`), each validating its own fields. The launch code reads the family
    from the class switches ``v2`` / ``gluon`` / ``dequant_mm`` / ``ss``.

    Shared fields: bn weight rows per program, bm token rows per program, bk K per pipeline stage (64, 128
    or 256), split_k programs sharing one output tile along K (dense only), num_warps, num_stages
    (pipeline depth), m_split programs per (expert, N tile) in grouped/masked modes (0: heuristic),
    group_m M tiles per raster group (dense, L2 reuse of the weight tiles). The defaults are the same in
    every family (the tuned JSON tables store only the fields that differ from them).
    """

    bn: int = 64
    bm: int = 16
    bk: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    m_split: int = 0
    group_m: int = 8

    #: the family's name in the JSON tables, and how logs and ``info`` name it
    FAMILY: ClassVar[str] = ""
    LABEL: ClassVar[str] = ""
    v2: ClassVar[bool] = False          # the Triton kernel on mma.sync
    gluon: ClassVar[bool] = False       # the Gluon kernel
    dequant_mm: ClassVar[bool] = False  # dequantize + torch.mm (cuBLAS)
    ss: ClassVar[bool] = False          # wgmma with both operands in shared memory (TritonWgmmaConfig field)
    prefetch: ClassVar[int] = 2         # GluonConfig field
    tail_bm: ClassVar[int] = 0          # GluonConfig field
    split_tail: ClassVar[bool] = False  # GluonConfig field
    fixup: ClassVar[bool] = False       # GluonConfig field

    def __post_init__(self):
        if type(self) is W4Config:
            raise TypeError("W4Config is the base of the kernel families: construct a TritonMmaConfig, "
                            "TritonWgmmaConfig, GluonConfig or DequantMmConfig")
        name = type(self).__name__
        if self.bk not in (64, 128, 256):
            raise ValueError(f"{name}.bk: expected 64, 128 or 256, got {self.bk}")
        if self.bm not in (8, 16, 32, 64, 128, 256):
            raise ValueError(f"{name}.bm: expected one of 8..256 (powers of two), got {self.bm}")
        if self.split_k < 1 or self.num_stages < 1 or self.m_split < 0 or self.group_m < 1:
            raise ValueError(f"{name}: invalid {self}")
        self._check()

    @property
    def label(self) -> str:
        return self.LABEL

    def _check(self) -> None:
        """The family's own constraints."""

    def _check_warps(self) -> None:
        name = type(self).__name__
        if self.num_warps not in (2, 4, 8):
            raise ValueError(f"{name}.num_warps: expected 2, 4 or 8, got {self.num_warps}")
        if self.bn < 16 * self.num_warps:
            raise ValueError(f"{name}: bn={self.bn} is fewer rows than num_warps={self.num_warps} warps x 16")

    def to_json(self) -> dict:
        return {"family": self.FAMILY, **{f.name: getattr(self, f.name) for f in fields(self)
                                          if getattr(self, f.name) != f.default}}

    @classmethod
    def from_json(cls, d: dict) -> W4Config:
        """A table entry: ``{"family": ..., fields}``; entries without a family (tables written before the
        families were split) name it by the flags ``v2`` / ``gluon`` / ``dequant_mm`` (else Triton wgmma)."""
        d = dict(d)
        family = d.pop("family", None)
        legacy = {k: d.pop(k) for k in ("v2", "gluon", "dequant_mm") if k in d}
        if sum(bool(v) for v in legacy.values()) > 1:
            raise ValueError(f"W4Config: at most one of v2 / gluon / dequant_mm, got {legacy}")
        if family is None:
            family = ("gluon" if legacy.get("gluon") else "triton-mma" if legacy.get("v2")
                      else "dequant-mm" if legacy.get("dequant_mm") else "triton-wgmma")
            # the old single type took every family's fields; at their defaults they said nothing
            own = {f.name for f in fields(FAMILIES[family])}
            d = {k: v for k, v in d.items() if k in own or _FIELD_DEFAULTS.get(k, _NO_DEFAULT) != v}
        elif any(legacy.values()):
            raise ValueError(f"W4Config: {sorted(k for k, v in legacy.items() if v)} with family {family!r}")
        if family not in FAMILIES:
            raise ValueError(f"W4Config: unknown family {family!r}, expected one of {sorted(FAMILIES)}")
        kind = FAMILIES[family]
        unknown = set(d) - {f.name for f in fields(kind)}
        if unknown:
            raise ValueError(f"{kind.__name__}: unknown keys {sorted(unknown)}")
        return kind(**d)


_NO_DEFAULT = object()


@dataclass(frozen=True)
class TritonMmaConfig(W4Config):
    """:func:`~.triton_w4.w4_gemm_kernel` on mma.sync (``V2``): decode tiles, bm 8-256, bn 32 (2 warps), 64
    or 128, 2-8 warps."""

    FAMILY: ClassVar[str] = "triton-mma"
    LABEL: ClassVar[str] = "triton mma.sync"
    v2: ClassVar[bool] = True

    def _check(self) -> None:
        if self.bn not in (32, 64, 128):
            raise ValueError(f"TritonMmaConfig.bn: expected 32, 64 or 128, got {self.bn}")
        self._check_warps()


@dataclass(frozen=True)
class TritonWgmmaConfig(W4Config):
    """:func:`~.triton_w4.w4_gemm_kernel` on wgmma: bn 64 or 128 (256 with ``ss``), bm 16-256, one or two
    warpgroups. ``ss``: both operands in shared memory (tokens as wgmma's M side, the decoded weight tile
    stored to shared memory; bm >= 64)."""

    ss: bool = False

    FAMILY: ClassVar[str] = "triton-wgmma"
    LABEL: ClassVar[str] = "triton wgmma"

    @property
    def label(self) -> str:
        return "triton wgmma (smem operands)" if self.ss else self.LABEL

    def _check(self) -> None:
        if self.bn not in (64, 128) and not (self.ss and self.bn == 256):
            raise ValueError(f"TritonWgmmaConfig.bn: expected 64 or 128 (256 with ss), got {self.bn}")
        if self.bm < 16:
            raise ValueError(f"TritonWgmmaConfig.bm: wgmma needs bm >= 16 (bm=8 runs on mma.sync: TritonMmaConfig), "
                             f"got {self.bm}")
        if self.num_warps not in (4, 8):
            raise ValueError(f"TritonWgmmaConfig.num_warps: a warpgroup or two (4 or 8), got {self.num_warps}")
        self._check_warps()
        if self.ss and self.bm < 64:
            raise ValueError(f"TritonWgmmaConfig: ss (shared-memory wgmma, tokens as M) needs bm >= 64, got "
                             f"bm={self.bm}")


@dataclass(frozen=True)
class GluonConfig(W4Config):
    """The explicitly pipelined kernel of :mod:`.gluon_w4`: bn 64 or 128 with bn/16 warps, bm 8-256 (the
    wgmma's N: swap AB puts the weight rows on its M side; the heuristic hands out 64 and up, the tuner also
    offers 16 and 32; 8 compiles clean but spends ~33 instructions per weight word in its K loop against the
    mma.sync decode kernel's ~25, so it is not offered), bk 64 or 128, x by TMA in ``num_stages`` buffers
    (dense, grouped without a gather index, masked; compiled GPUs only, otherwise the Triton kernel runs
    instead). ``prefetch``: K steps ahead the weight words and scales are loaded into registers (2 or 4);
    ``split_tail``: dense with split_k > 1 only, compute the whole waves of tiles (one per SM) over all of K
    and split only the tiles left over; ``fixup``: dense with split_k > 1 only, the last program of each split
    tile to arrive sums the partials (in split order, as the reduce kernel does) instead of a reduce launch;
    ``tail_bm``: grouped only (0: off), each expert's last at most bm/2 rows go to a second launch with tiles
    of tail_bm rows (a tile computes all its rows, the expert's or not: a short last tile of bm rows costs a
    full one)."""

    prefetch: int = 2
    split_tail: bool = False
    tail_bm: int = 0
    fixup: bool = False

    FAMILY: ClassVar[str] = "gluon"
    LABEL: ClassVar[str] = "gluon wgmma"
    gluon: ClassVar[bool] = True

    def _check(self) -> None:
        if self.bn not in (64, 128) or self.num_warps != self.bn // 16:
            raise ValueError(f"GluonConfig: needs bn 64 or 128 with bn/16 warps, got bn={self.bn}, "
                             f"num_warps={self.num_warps}")
        if self.bk > 128 or self.num_stages < 2:
            raise ValueError(f"GluonConfig: needs bk <= 128, num_stages >= 2, got bk={self.bk}, "
                             f"num_stages={self.num_stages}")
        if self.prefetch not in (2, 4):
            raise ValueError(f"GluonConfig.prefetch: expected 2 or 4 (K steps), got {self.prefetch}")
        if self.num_stages * self.bm * self.bk * 2 > 160 * 1024:
            raise ValueError(f"GluonConfig: x ring of {self.num_stages} x {self.bm} x {self.bk} does not fit "
                             "in shared memory (160 KB)")
        if self.tail_bm and (self.tail_bm not in (64, 128) or 2 * self.tail_bm > self.bm):
            raise ValueError(f"GluonConfig.tail_bm: expected 0 or 64 / 128 rows, at most bm/2, got "
                             f"tail_bm={self.tail_bm} with bm={self.bm}")
        if self.split_tail and self.split_k < 2:
            raise ValueError(f"GluonConfig.split_tail: splits the last wave's tiles along K, needs split_k >= 2, "
                             f"got split_k={self.split_k}")
        if self.fixup and self.split_k < 2:
            raise ValueError(f"GluonConfig.fixup: sums split-K partials in the kernel, needs split_k >= 2, "
                             f"got split_k={self.split_k}")


@dataclass(frozen=True)
class DequantMmConfig(W4Config):
    """Dense only, large M: dequantize the weight and call ``torch.mm`` (cuBLAS); the tile fields are unused."""

    FAMILY: ClassVar[str] = "dequant-mm"
    LABEL: ClassVar[str] = "dequantize + cuBLAS"
    dequant_mm: ClassVar[bool] = True


FAMILIES = {c.FAMILY: c for c in (TritonMmaConfig, TritonWgmmaConfig, GluonConfig, DequantMmConfig)}
#: every family's field defaults (one value per name: the shared fields default alike in every family)
_FIELD_DEFAULTS = {f.name: f.default for c in FAMILIES.values() for f in fields(c)}


DENSE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def device_key(device: torch.device | None = None) -> str:
    if not torch.cuda.is_available():
        return "cpu"
    idx = device.index if device is not None and device.type == "cuda" and device.index is not None else None
    return _device_key(torch.cuda.current_device() if idx is None else idx)


@functools.lru_cache(maxsize=None)
def _device_key(index: int) -> str:
    return torch.cuda.get_device_name(index).replace(" ", "_").replace("/", "_")


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int | None) -> int:
    if not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device_index or 0).multi_processor_count


@functools.lru_cache(maxsize=None)
def load_table(dev_key: str, config_dir: str | None = None) -> dict:
    path = Path(config_dir or envs.gemm_config_dir() or CONFIG_DIR) / f"{dev_key}.json"
    if not path.exists():
        logger.info("nvfp4_plugin: no tuned GEMM configs for %s (%s); using heuristics", dev_key, path)
        return {}
    with open(path) as f:
        table = json.load(f)
    out = {}
    for kind in KINDS:
        out[kind] = {shape: {int(b): W4Config.from_json(c) for b, c in buckets.items()}
                     for shape, buckets in table.get(kind, {}).items()}
    return out


def shape_key(kind: str, n: int, k: int, e: int = 1) -> str:
    return f"N={n},K={k}" if kind == "dense" else f"E={e},N={n},K={k}"


def _lookup(buckets: dict[int, W4Config], size: int) -> W4Config | None:
    """The tuned config of the smallest bucket at or above ``size``; None beyond the largest one."""
    for b in sorted(buckets):
        if size <= b:
            return buckets[b]
    return None


SPLIT_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16)


def _split_k(n_tiles: int, k: int, bk: int, sms: int, target: float = 3.0, min_iters: int = 3) -> int:
    """Split K so that about ``target`` programs per SM stream weights (enough bytes in flight to
    cover DRAM latency), keeping at least ``min_iters`` K steps per program."""
    iters = -(-k // bk)
    best, best_d = 1, None
    for s in SPLIT_CHOICES:
        if s > 1 and iters < min_iters * s:
            break
        d = abs((n_tiles * s) / (target * sms) - 1.0)
        if n_tiles * s > target * sms * 1.5 and s > 1:
            break
        if best_d is None or d < best_d:
            best, best_d = s, d
    return best


#: Dense rows from which dequantize-then-cuBLAS is the default: it beat the fused kernels on every tuned
#: H200 shape (nvfp4_plugin/gemm/NOTES.md, "Why dequantize + cuBLAS from 512 rows").
DEQUANT_MM_MIN_M = 512


#: Dense rows above which the explicitly pipelined Gluon kernel is the default (below DEQUANT_MM_MIN_M);
#: why: nvfp4_plugin/gemm/NOTES.md, "Why Gluon for 64-1024 rows".
GLUON_MIN_M = 64


#: Rows per active expert (grouped) or max_m (masked) from which the Gluon kernel is the default (1.3-1.7x
#: the Triton configs at 256 on the H200; NOTES.md, "Which kernel family runs where").
GLUON_MIN_EXPERT_ROWS = 128
#: Rows per active expert from which grouped Gluon tiles are 256 tokens tall instead of 128: each decoded
#: weight tile then serves twice the rows, half the decode work per FLOP. On the H200 at 1024 rows per
#: expert (Qwen3-30B-A3B, 16384 tokens) the up projection took 1615 against 1739 µs and the down 948 against
#: 994 µs under sustained load, where the GPU runs at its power cap (~1.5 GHz), 1420 against 1566 µs (up)
#: in a short burst (``bench_moe --sustained 16384``; results/moe_h200.md, "Power"). With each expert's short
#: last rows split off (``GLUON_TAIL_BM``) they win from 192 rows per expert: up / down 380 / 226 against
#: 432 / 247 µs at 3072 tokens, 496 / 295 against 534 / 309 at 4096, 687 / 406 against 742 / 429 at 6144;
#: level at 128 (2048 tokens: 317 / 181 against 319 / 184; results/moe_h200.md, "256-row tiles from 192 rows").
GLUON_BM256_EXPERT_ROWS = 192

#: Rows of the second launch's tiles that take each expert's last at most 128 rows off the 256-row tiles
#: where experts leave few rows past whole tiles (``grouped_tail_bm`` picks 128-row tails elsewhere;
#: ``GluonConfig.tail_bm``; 0: one launch, the last tile computed whole however few rows it holds). A tile
#: computes all its rows, so with about 512 rows per expert a quarter of the 256-row tiles' work was rows
#: no expert has. On the H200 (Qwen3-30B-A3B layer, sustained load, the same bytes out) 64-row tail tiles
#: took the layer from 1692-1696 to 1612-1615 µs at 8192 tokens and 3088-3089 to 3011-3014 at 16384
#: (128-row tails: 1637 / 3031-3033; results/moe_h200.md, "Short last tiles").
GLUON_TAIL_BM = 64


def grouped_tail_bm(rows: int) -> int:
    """Tail tile height for 256-row grouped tiles at ``rows`` (mean) rows per expert; 0 with the tails off.

    A tile decodes its weight tile whatever its height and its MMAs grow with it, so an expert's leftover
    rows past its whole 256-row tiles cost least in one 64-row tile up to 64 rows and in one 128-row tile
    from 65 to 128 (two 64-row tiles decode the weights twice). Experts' row counts spread a few dozen rows
    around the mean, so the mean's remainder picks the height: 128 where it is 49-160 (most experts leave
    65-128 rows, or enough to keep in the main tile), ``GLUON_TAIL_BM`` otherwise (a remainder near 0: the
    experts above the mean leave a few rows). H200, up / down µs sustained (``bench_moe --sustained``): 6144
    tokens (384 rows, remainder 128) 687 / 406 with 128-row tails against 743 / 434 with 64; 2048 (128) 317 /
    181 against 373 / 213; 4096 (256, remainder 0) 510 / 302 against 496 / 295; 8192 (512) 862 / 510 against
    848 / 503."""
    if not GLUON_TAIL_BM:
        return 0
    return 128 if 48 < rows % 256 <= 160 else GLUON_TAIL_BM


def gluon_stages(bm: int, bk: int) -> int:
    """x buffers of a Gluon config: as many as fit beside the other operands (96-128 KB of ring; tiles of
    64 tokens or fewer keep 4 buffers, enough to cover a load's latency)."""
    return {(8, 64): 4, (8, 128): 4, (16, 64): 4, (16, 128): 4, (32, 64): 4, (32, 128): 4,
            (64, 64): 4, (64, 128): 4, (128, 64): 4, (256, 64): 3, (128, 128): 3, (256, 128): 2}[(bm, bk)]


def gluon_config(bn: int, bm: int, bk: int, **kw) -> GluonConfig:
    """A Gluon config with the warps (one warp per 16 weight rows) and x buffers (gluon_stages) its tile takes."""
    return GluonConfig(bn=bn, bm=bm, bk=bk, num_warps=bn // 16, num_stages=gluon_stages(bm, bk), **kw)


@functools.lru_cache(maxsize=None)
def tail_config(cfg: GluonConfig) -> GluonConfig | None:
    """The config of the second launch that takes each expert's short last rows off ``cfg``'s grouped tiles
    (``cfg.tail_bm``-row tiles, the same weight tile and K step), or None where ``cfg`` has no tail; built once
    per config (the launch path asks on every call)."""
    return gluon_config(cfg.bn, cfg.tail_bm, cfg.bk, prefetch=cfg.prefetch) if cfg.tail_bm else None


def gluon_heuristic(m: int, n: int, k: int, sms: int = 132) -> W4Config:
    """One warpgroup per 64 weight rows, weights loaded 4 K steps ahead (NOTES.md, "Why Gluon for 64-1024
    rows"); split K until about two programs per SM (at least 8 K steps each): the narrow shapes
    (N = 2048-4096 with long K) have only 16-64 output tiles."""
    bm = 128 if m <= 128 else 256
    cfg = gluon_config(64, bm, 64, prefetch=4)
    tiles = -(-m // bm) * -(-n // 64)
    steps = -(-k // 64)
    split = 1
    while split < 8 and tiles * split * 2 <= 2 * sms and steps // (split * 2) >= 8:
        split *= 2
    return replace(cfg, split_k=split)


def heuristic(kind: str, m: int, n: int, k: int, e: int = 1, sms: int = 132) -> W4Config:
    """Reasoned defaults for H100/H200-class GPUs. ``m``: dense rows, routed rows (grouped) or max_m (masked).

    Few rows per weight tile (decode) is a weight-streaming problem: 8-token mma.sync tiles, long K
    steps, deep pipelines, and enough programs (split-K, narrower tiles) to keep ~3 per SM pulling
    bytes. Many rows is a tensor-core problem: 64-128-token wgmma tiles, 2 warpgroups.
    """
    if kind == "dense" and m >= DEQUANT_MM_MIN_M:
        return DequantMmConfig()
    if kind == "dense" and m > GLUON_MIN_M:
        return gluon_heuristic(m, n, k, sms)
    bk = 256 if k % 256 == 0 else (128 if k % 128 == 0 else 64)
    if kind == "grouped":
        active = max(1, min(e, m))
        rows = -(-m // active)
    else:
        active = e if kind == "masked" else 1
        rows = m
    if kind != "dense" and rows >= GLUON_MIN_EXPERT_ROWS:
        if kind == "grouped" and rows >= GLUON_BM256_EXPERT_ROWS:
            return gluon_config(64, 256, 64, tail_bm=grouped_tail_bm(rows))
        return gluon_config(64, 128, 64)
    if rows <= 8:
        cfg = TritonMmaConfig(bn=64, bm=8, bk=bk, num_warps=4, num_stages=4 if bk == 256 else 5)
    elif rows <= 16:
        cfg = TritonWgmmaConfig(bn=64, bm=16, bk=bk, num_warps=4, num_stages=3)
    elif rows <= 32:
        cfg = TritonWgmmaConfig(bn=64, bm=32, bk=min(bk, 128), num_warps=4, num_stages=4)
    elif rows <= 64:
        cfg = TritonWgmmaConfig(bn=128, bm=64, bk=min(bk, 128), num_warps=8, num_stages=3)
    else:
        cfg = TritonWgmmaConfig(bn=128, bm=128, bk=64, num_warps=8, num_stages=4)
    n_tiles = -(-n // cfg.bn)
    if kind == "dense":
        if m <= 64:
            n_tiles *= -(-m // cfg.bm)
            cfg = replace(cfg, split_k=_split_k(n_tiles, k, cfg.bk, sms, target=3.0 if m <= 16 else 1.5))
    elif cfg.v2 and active * n_tiles < 2 * sms:
        cfg = replace(cfg, bn=32, num_warps=2)       # more, narrower programs over few experts
    return cfg


#: Largest token tile selection may hand out: Triton 3.6's register-A wgmma race (triton-lang/triton#9433;
#: NOTES.md, "The register-A wgmma race") is worked around and checked in SASS by tests/test_gemm_sass.py;
#: lower this should a Triton upgrade bring it back.
MAX_SAFE_BM = 256


def safe(cfg: W4Config) -> W4Config:
    """Clamp the token tile of register-A wgmma configs to MAX_SAFE_BM (``ss`` and ``dequant_mm`` have
    no register operand to race on; ``gluon`` keeps two A register sets, checked in SASS by
    tests/test_gemm_sass.py)."""
    if cfg.dequant_mm or cfg.ss or cfg.gluon or cfg.bm <= MAX_SAFE_BM:
        return cfg
    return replace(cfg, bm=MAX_SAFE_BM)


def _select(kind: str, m: int, n: int, k: int, e: int, dev_key: str, sms: int) -> W4Config:
    table = load_table(dev_key).get(kind, {})
    cfg = _lookup(table.get(shape_key(kind, n, k, e), {}), m)
    return safe(cfg if cfg is not None else heuristic(kind, m, n, k, e, sms))


_select_cached = functools.lru_cache(maxsize=4096)(_select)


def _device_args(device: torch.device | None) -> tuple[str, int]:
    idx = device.index if device is not None and device.type == "cuda" else None
    return device_key(device), _num_sms(idx)


def select_config(kind: str, m: int, n: int, k: int, e: int = 1, device: torch.device | None = None) -> W4Config:
    """The config for a ``kind`` (dense / grouped / masked) GEMM of this static shape."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    return _select_cached(kind, int(m), int(n), int(k), int(e), *_device_args(device))


def first_sizes(key, max_size: int) -> list[int]:
    """The smallest size in ``1..max_size`` for each distinct ``key(size)``, ascending.

    Warm-up picks its token counts with it: ``key`` maps a size to whatever decides which kernels
    run and how Triton specializes them (configs, variants), so running one size per key compiles
    everything sizes up to ``max_size`` can launch."""
    seen, out = set(), []
    for size in range(1, max(1, int(max_size)) + 1):
        kk = key(size)
        if kk not in seen:
            seen.add(kk)
            out.append(size)
    return out


def merge_runs(runs) -> list[tuple[int, int, object]]:
    """Join adjacent ``(first, last, key)`` runs of equal key."""
    out: list[tuple[int, int, object]] = []
    for lo, hi, kk in runs:
        if out and out[-1][2] == kk:
            out[-1] = (out[-1][0], hi, kk)
        else:
            out.append((lo, hi, kk))
    return out


def size_ranges(key, max_size: int) -> list[tuple[int, int, object]]:
    """``(first, last, key)`` runs of equal ``key(size)`` over ``1..max_size``, ascending."""
    return merge_runs((size, size, key(size)) for size in range(1, max(1, int(max_size)) + 1))


def config_fn(kind: str, n: int, k: int, e: int = 1, device: torch.device | None = None):
    """``size -> select_config(kind, size, n, k, e)`` without filling the per-shape lookup cache (for
    scans over every size, see :func:`first_sizes`)."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    dev = _device_args(device)
    return lambda size: _select(kind, int(size), int(n), int(k), int(e), *dev)


def clear_cache() -> None:
    load_table.cache_clear()
    _select_cached.cache_clear()
