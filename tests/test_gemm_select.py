"""GEMM config selection (gemm/select.py): the tuned tables shipped per device, what the heuristic hands
out for the served shapes, lookups by bucket, and the MAX_SAFE_BM clamp. Host-side only: no kernel
runs here. The config types: one per kernel family.
"""

import json

import pytest
import torch

from nvfp4_plugin.gemm import (DequantMmConfig, GluonConfig, TritonMmaConfig, TritonWgmmaConfig, W4Config,
                               select_config)
from nvfp4_plugin.gemm import layout
from nvfp4_plugin.gemm import select as gsel


def test_config_selection_from_json(tmp_path, monkeypatch):
    table = {"device": "x", "dense": {"N=256,K=512": {"4": {"bm": 8, "v2": True, "split_k": 4},
                                                      "64": {"bm": 64, "bn": 128, "num_warps": 8}}}}
    (tmp_path / f"{gsel.device_key()}.json").write_text(json.dumps(table))
    monkeypatch.setenv(gsel.ENV_CONFIG_DIR, str(tmp_path))
    gsel.clear_cache()
    try:
        assert select_config("dense", 1, 256, 512) == TritonMmaConfig(bm=8, split_k=4)
        assert select_config("dense", 4, 256, 512).split_k == 4
        assert select_config("dense", 5, 256, 512).bm == 64
        # beyond the largest tuned bucket the heuristic decides (a table tuned for decode sizes only
        # must not send prefill through its decode tiles)
        assert select_config("dense", 64, 256, 512).bm == 64
        assert select_config("dense", 65, 256, 512) == gsel.heuristic("dense", 65, 256, 512)
        assert select_config("dense", 5000, 256, 512) == gsel.heuristic("dense", 5000, 256, 512)
        assert select_config("dense", 5, 256, 1024) == gsel.heuristic("dense", 5, 256, 1024)
    finally:
        monkeypatch.delenv(gsel.ENV_CONFIG_DIR)
        gsel.clear_cache()


#: The served models' projections (dense: N, K; experts: E, N, K), as tuned in the shipped tables.
DENSE_SHAPES = [(6144, 4096), (28672, 4096), (4096, 14336), (7168, 2048), (2048, 7168)]
EXPERT_SHAPES = [(128, 1536, 2048), (128, 2048, 768), (256, 4096, 7168), (256, 7168, 2048)]


def test_heuristics_are_valid_for_the_target_shapes():
    """What the heuristic promises (gemm/select.py): dense decode sizes on the Triton kernel with a
    token tile covering all rows and K splits that keep >= 3 K steps each; Gluon between GLUON_MIN_M
    and DEQUANT_MM_MIN_M rows with at most two token tiles; cuBLAS from DEQUANT_MM_MIN_M; experts on
    Gluon from GLUON_MIN_EXPERT_ROWS rows per active expert, never split along K, 256-token tiles from
    GLUON_BM256_EXPERT_ROWS rows per expert (grouped; masked stays at 128). Nothing the
    selection's clamp would change, and every config survives its JSON round trip."""
    kinds_seen = set()
    for m in (1, 4, 5, 16, 33, 64, 65, 128, 256, 511, 512, 1024, 4096, 8192, 16384):
        for n, k in DENSE_SHAPES:
            c = gsel.heuristic("dense", m, n, k)
            if m >= gsel.DEQUANT_MM_MIN_M:
                assert c == DequantMmConfig(), (m, n, k, c)
                kinds_seen.add("dequant_mm")
            elif m > gsel.GLUON_MIN_M:
                assert c.gluon and -(-m // c.bm) <= 2 and c.prefetch == 4, (m, n, k, c)
                steps = -(-k // c.bk)
                assert c.split_k in (1, 2, 4, 8) and (c.split_k == 1 or steps // c.split_k >= 8), (m, n, k, c)
                kinds_seen.add("gluon")
            else:
                assert not (c.gluon or c.dequant_mm) and c.bm >= m and c.v2 == (c.bm == 8), (m, n, k, c)
                assert k % c.bk == 0 and c.split_k in gsel.SPLIT_CHOICES, (m, n, k, c)
                assert c.split_k == 1 or -(-k // c.bk) >= 3 * c.split_k, (m, n, k, c)
                kinds_seen.add("triton")
            assert gsel.safe(c) == c and W4Config.from_json(c.to_json()) == c
        for e, n, k in EXPERT_SHAPES:
            for kind, rows_total in (("grouped", m * 8), ("masked", min(m, 256))):
                c = gsel.heuristic(kind, rows_total, n, k, e)
                rows = -(-rows_total // max(1, min(e, rows_total))) if kind == "grouped" else rows_total
                assert not c.dequant_mm and c.split_k == 1, (kind, m, e, n, k, c)
                assert c.gluon == (rows >= gsel.GLUON_MIN_EXPERT_ROWS), (kind, m, e, n, k, c)
                assert c.gluon or c.bm >= min(rows, 128), (kind, m, e, n, k, c)
                if c.gluon:
                    tall = kind == "grouped" and rows >= gsel.GLUON_BM256_EXPERT_ROWS
                    assert c.bm == (256 if tall else 128), (kind, m, e, n, k, c)
                assert gsel.safe(c) == c and W4Config.from_json(c.to_json()) == c
    assert kinds_seen == {"triton", "gluon", "dequant_mm"}
    # on a machine with no tuned table (this one unless it has an H200) selection is the heuristic
    if not gsel.load_table(gsel.device_key()):
        for n, k in DENSE_SHAPES:
            assert select_config("dense", 3, n, k) == gsel.heuristic("dense", 3, n, k)


def test_shipped_config_files_parse(monkeypatch):
    """Every shipped table (gemm/configs/<device>.json): named for its device, only known kinds and
    well-formed shape keys, valid configs that the selection's clamp leaves alone, no options the
    kernel kind ignores (split K or cuBLAS over experts), 256-wide tiles only where they divide the
    padded N; and selection hands out each tuned entry for every size of its bucket, the heuristic
    beyond the largest one."""
    monkeypatch.delenv(gsel.ENV_CONFIG_DIR, raising=False)
    gsel.clear_cache()
    paths = sorted(gsel.CONFIG_DIR.glob("*.json"))
    assert paths, f"no tuned GEMM tables in {gsel.CONFIG_DIR}"
    for path in paths:
        raw = json.loads(path.read_text())
        assert raw["device"].replace(" ", "_").replace("/", "_") == path.stem, path.name
        assert set(raw) - set(gsel.KINDS) <= {"device", "triton", "torch"}, (path.name, sorted(raw))
        table = gsel.load_table(path.stem)
        assert table and any(table.values()), path.name
        for kind, shapes in table.items():
            for shape, buckets in shapes.items():
                dims = {d: int(v) for d, v in (part.split("=") for part in shape.split(","))}
                e, n, k = dims.get("E", 1), dims["N"], dims["K"]
                assert shape == gsel.shape_key(kind, n, k, e) and k % 16 == 0, (path.name, kind, shape)
                assert buckets and min(buckets) >= 1, (path.name, kind, shape)
                lower = 0
                for b in sorted(buckets):
                    c, where = buckets[b], (path.name, kind, shape, b)
                    assert gsel.safe(c) == c, where
                    assert kind == "dense" or not (c.dequant_mm or c.split_k > 1), where
                    assert kind != "dense" or c.m_split == 0, where
                    assert c.bn != 256 or -(-n // layout.N_PAD_MULTIPLE) * layout.N_PAD_MULTIPLE % 256 == 0, where
                    for size in {lower + 1, (lower + 1 + b) // 2, b}:
                        assert gsel._select(kind, size, n, k, e, path.stem, 132) == c, (where, size)
                    lower = b
                beyond = gsel._select(kind, lower + 1, n, k, e, path.stem, 132)
                assert beyond == gsel.safe(gsel.heuristic(kind, lower + 1, n, k, e, 132)), (path.name, kind, shape)
    gsel.clear_cache()


def test_h200_table_hands_prefill_chunks_to_256_row_tiles(monkeypatch):
    """On the H200 the Qwen3-30B-A3B grouped GEMMs take the tuned 128-row Gluon tiles up to 2048 tokens and the
    heuristic's 256-row tiles with split-off tails from 3072 (results/moe_h200.md, "256-row tiles from 192
    rows"): 64-row tails where the mean leaves few rows past whole tiles, 128-row ones at 6144 tokens."""
    monkeypatch.delenv(gsel.ENV_CONFIG_DIR, raising=False)
    gsel.clear_cache()
    for n, k in ((1536, 2048), (2048, 768)):
        def pick(tokens):
            c = gsel._select("grouped", tokens * 8, n, k, 128, "NVIDIA_H200", 132)
            return (c.FAMILY, c.bm, c.tail_bm if c.gluon else None)
        assert pick(2048) == ("gluon", 128, 0), (n, k)
        assert pick(3072) == pick(4096) == pick(8192) == pick(16384) == ("gluon", 256, gsel.GLUON_TAIL_BM), (n, k)
        assert pick(6144) == ("gluon", 256, 128), (n, k)
    gsel.clear_cache()


def test_selection_stays_within_max_safe_bm(monkeypatch):
    for kind, m, n, k, e in (("dense", 1000, 4096, 1024, 1), ("dense", 4096, 28672, 4096, 1),
                             ("grouped", 32768, 4096, 7168, 256), ("masked", 256, 4096, 7168, 256)):
        cfg = select_config(kind, m, n, k, e, device=torch.device("cpu"))
        assert cfg.dequant_mm or cfg.bm <= gsel.MAX_SAFE_BM, (kind, m, n, k, cfg)
    assert gsel.safe(TritonWgmmaConfig(bm=256)).bm == min(256, gsel.MAX_SAFE_BM)
    monkeypatch.setattr(gsel, "MAX_SAFE_BM", 64)  # the clamp, should a Triton upgrade bring the race back
    assert gsel.safe(TritonWgmmaConfig(bm=128)).bm == 64
    assert gsel.safe(DequantMmConfig()).dequant_mm
    assert gsel.safe(TritonWgmmaConfig(bm=128, ss=True)).bm == 128  # shared-memory operands: no register race


def test_one_config_type_per_kernel_family():
    """Each kernel family has its own config type with its own checks; the launch code reads the family from
    the type; the tables name it; tables written with the old flags still read the same."""
    with pytest.raises(TypeError, match="base of the kernel families"):
        W4Config(bm=8)
    cases = [(TritonMmaConfig(bm=8, split_k=4), "triton-mma", "triton mma.sync", dict(bm=8, split_k=4, v2=True)),
             (TritonWgmmaConfig(bk=256), "triton-wgmma", "triton wgmma", dict(bk=256)),
             (TritonWgmmaConfig(bn=128, bm=64, num_warps=8, ss=True), "triton-wgmma", "triton wgmma (smem operands)",
              dict(bn=128, bm=64, num_warps=8, ss=True)),
             (GluonConfig(bm=128, prefetch=4), "gluon", "gluon wgmma", dict(bm=128, gluon=True, prefetch=4)),
             (DequantMmConfig(), "dequant-mm", "dequantize + cuBLAS", dict(dequant_mm=True))]
    for cfg, family, label, legacy in cases:
        j = cfg.to_json()
        assert j["family"] == family and cfg.label == label
        assert W4Config.from_json(j) == cfg == W4Config.from_json(legacy)
        flags = (cfg.v2, cfg.gluon, cfg.dequant_mm)
        assert sum(flags) <= 1 and flags == (family == "triton-mma", family == "gluon", family == "dequant-mm")
    assert TritonMmaConfig(bm=16) != TritonWgmmaConfig(bm=16)          # same fields, different kernels
    # old tables could name another family's fields at their defaults
    assert W4Config.from_json({"v2": True, "bm": 8, "prefetch": 2, "ss": False}) == TritonMmaConfig(bm=8)
    assert W4Config.from_json({"dequant_mm": True, "split_tail": False}) == DequantMmConfig()
    with pytest.raises(ValueError, match="TritonMmaConfig: unknown keys \\['prefetch'\\]"):
        W4Config.from_json({"v2": True, "bm": 8, "prefetch": 4})
    with pytest.raises(ValueError, match="unknown family 'cutlass'"):
        W4Config.from_json({"family": "cutlass"})
    with pytest.raises(ValueError, match="TritonMmaConfig: unknown keys \\['ss'\\]"):
        W4Config.from_json({"family": "triton-mma", "ss": True})
    with pytest.raises(ValueError, match="with family 'gluon'"):
        W4Config.from_json({"family": "gluon", "v2": True})
    # the shipped table: every entry names its family
    table = json.loads((gsel.CONFIG_DIR / "NVIDIA_H200.json").read_text())
    entries = [c for kind in gsel.KINDS for shape in table.get(kind, {}).values() for c in shape.values()]
    assert entries and all(c["family"] in gsel.FAMILIES for c in entries)
    assert {W4Config.from_json(c).FAMILY for c in entries} == set(gsel.FAMILIES)
