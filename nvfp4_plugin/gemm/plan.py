"""What the Hopper GEMMs launch for a layer shape, per token count, without a GPU.

``nvfp4-plugin info --capability X.Y`` and the selection log use it to name the kernel family
each token-count range runs, and ``--compile`` to compile every variant for a target architecture
ahead of time (the deployment check before renting a GPU, and CI's). The variants are the ones
:func:`.api.w4_linear` / :func:`.api.w4_fused_moe` choose at run time: the same selection
(:mod:`.select`, for a named device's tuned table or the heuristics) and the same dispatch helpers.
"""

from __future__ import annotations

import torch

from . import api
from .layout import HopperW4Layout
from .select import DequantMmConfig, _select, merge_runs, size_ranges, tail_config


def _gluon_mod():
    """The Gluon kernel module as a GPU would run it (importable without a GPU; None if this Triton has
    no Gluon). Planning never runs a kernel, so the CPU interpreter's lack of Gluon does not apply."""
    try:
        from . import gluon_w4
    except ImportError:       # pragma: no cover - depends on the installed Triton
        return None
    return gluon_w4


def linear_variants(n: int, k: int, max_tokens: int, *, dev_key: str, sms: int = 132,
                    act_dtype: torch.dtype = torch.bfloat16) -> list[tuple[int, int, tuple]]:
    """``(first, last, variant)`` token ranges of a dense ``N x K`` layer on device ``dev_key``."""
    lay = HopperW4Layout(act_dtype, n, k)
    g = _gluon_mod()
    return size_ranges(lambda m: api._dense_variant(m, lay, _select("dense", m, n, k, 1, dev_key, sms), sms, g),
                       max_tokens)


def fused_moe_variants(e: int, h: int, i: int, top_k: int, max_tokens: int, *, dev_key: str,
                       sms: int = 132) -> list[tuple[int, int, tuple]]:
    """``(first, last, (up variant, down variant))`` token ranges of a fused MoE layer (``top_k``
    experts per token; the GEMMs see ``tokens * top_k`` routed rows)."""
    g = _gluon_mod()

    def variant(t: int) -> tuple:
        rows = t * top_k
        return (api._grouped_variant(rows, e, _select("grouped", rows, 2 * i, h, e, dev_key, sms), g),
                api._grouped_variant(rows, e, _select("grouped", rows, h, i, e, dev_key, sms), g))

    return size_ranges(variant, max_tokens)


def family(variant: tuple) -> str:
    """Readable kernel family of a variant of :func:`linear_variants` / :func:`fused_moe_variants`."""
    if isinstance(variant[0], tuple):
        return f"up {family(variant[0])}, down {family(variant[1])}"
    kind = variant[0]
    if kind == "dequant_mm":
        return DequantMmConfig.LABEL
    return variant[1].label + (" split-K" if kind in ("gluon", "triton") and variant[2] else "")


def families(ranges: list[tuple[int, int, tuple]]) -> list[tuple[int, int, str]]:
    """Merge variant ranges into kernel-family ranges."""
    return merge_runs((lo, hi, family(v)) for lo, hi, v in ranges)


def compile_variant(variant: tuple, capability: tuple[int, int], *, moe_proj: str | None = None,
                    num_experts: int = 1):
    """Compile one variant for ``capability`` (no GPU needed; on a machine without one,
    ``NVFP4_PLUGIN_GEMM_COMPILE_ONLY=1`` must be set before :mod:`nvfp4_plugin.gemm` is imported).
    ``moe_proj``: "up" (rows gathered) or "down" (rows scattered), for grouped variants."""
    from . import inspect_sass as cs

    arch = capability[0] * 10 + capability[1]
    kind = variant[0]
    if kind == "dequant_mm":
        return [cs.compile_dequant(arch=arch)]
    cfg = variant[1]
    if kind == "gluon":
        return [cs.compile_gluon(cfg, split=variant[2], mode=0, arch=arch)]
    if kind == "triton":
        return [cs.compile_config(cfg, mode=0, arch=arch)]
    if kind == "grouped-gluon":
        tail = tail_config(cfg)
        if tail is None:
            return [cs.compile_gluon(cfg, mode=1, arch=arch)]
        return [cs.compile_gluon(cfg, mode=1, arch=arch, tail=1),
                cs.compile_gluon(tail, mode=1, arch=arch, tail=2, bm_main=cfg.bm)]
    compact = variant[2]
    flags = dict(HAS_GATHER=int(moe_proj == "up"), HAS_SCATTER=int(moe_proj == "down"), COMPACT=int(compact),
                 E_P2=1 << (max(num_experts, 1) - 1).bit_length() if compact else 1)
    return [cs.compile_config(cfg, mode=1, arch=arch, **flags)]
