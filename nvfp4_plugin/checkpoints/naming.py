"""Module names of the model families we know: experts, fused groups, routers, embeddings.

Checkpoints use the Hugging Face hub names (one tensor per expert and projection):

==============================  ===========================================  ==========================
family                          experts                                      router / shared experts
==============================  ===========================================  ==========================
Qwen2-MoE, Qwen3-MoE            ``L.mlp.experts.{e}.{gate,up,down}_proj``    ``L.mlp.gate``;
                                                                             ``L.mlp.shared_expert.*``
Mixtral                         ``L.block_sparse_moe.experts.{e}.w1/w3/w2``  ``L.block_sparse_moe.gate``
DeepSeek-V2/V3 (Kimi-K2)        ``L.mlp.experts.{e}.{gate,up,down}_proj``    ``L.mlp.gate`` (+ bias);
                                                                             ``L.mlp.shared_experts.*``
==============================  ===========================================  ==========================

Engines fuse some modules into one parameter, in a fixed shard order: ``q_proj, k_proj, v_proj``
-> ``qkv_proj``; ``gate_proj, up_proj`` -> ``gate_up_proj``; DeepSeek MLA ``q_a_proj,
kv_a_proj_with_mqa`` -> ``fused_qkv_a_proj``; and per expert ``gate (w1), up (w3)`` -> ``w13``
(gate rows first), ``down (w2)`` -> ``w2``.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

EXPERT_RE = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)$")
EXPERT_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
EXPERT_ROLES = ("gate", "up", "down")

#: (fused name, members in shard order). Members must share their parent module.
FUSED_GROUPS = (
    ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("gate_up_proj", ("gate_proj", "up_proj")),
    ("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa")),
)

#: Leaf names that are linear layers in every engine (so an unquantized, non-excluded one is a problem).
LINEAR_LEAVES = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj",
    "w1", "w2", "w3", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "lm_head", "out_proj",
    "fc1", "fc2", "dense", "query_key_value", "dense_h_to_4h", "dense_4h_to_h", "c_attn", "c_proj", "c_fc",
})
EMBEDDING_LEAVES = frozenset({"embed_tokens", "wte", "wpe", "word_embeddings", "embeddings", "embed_positions",
                              "position_embeddings", "token_type_embeddings", "embed_in"})

#: What ``nvfp4-plugin quantize`` leaves in bf16 unless told otherwise: the output head, embeddings,
#: MoE routers (``mlp.gate`` but not ``gate_proj``), norms, and vision towers.
DEFAULT_EXCLUDES = (
    "lm_head", "*embed_tokens", "*embeddings*", "*.wte", "*.wpe", "*embed_in",
    "*.mlp.gate", "*.block_sparse_moe.gate", "*shared_expert_gate", "*router*",
    "*norm*", "*vision_tower*", "*vision_model*", "*visual*", "*multi_modal_projector*",
)

#: Hub name -> transformers 5 module name, where they differ (used to hook modules for calibration).
HUB_TO_TRANSFORMERS_RENAMES = ((".block_sparse_moe.", ".mlp."),)


@dataclass(frozen=True)
class ExpertName:
    prefix: str  # "model.layers.3.mlp.experts"
    expert: int
    role: str    # "gate" | "up" | "down"
    proj: str    # the leaf as written ("gate_proj", "w1", ...)


def parse_expert(module: str) -> ExpertName | None:
    m = EXPERT_RE.match(module)
    if not m:
        return None
    return ExpertName(m["prefix"], int(m["expert"]), EXPERT_ROLE[m["proj"]], m["proj"])


def leaf(module: str) -> str:
    return module.rsplit(".", 1)[-1]


def fused_group(module: str) -> tuple[str, int, tuple[str, ...]] | None:
    """``(group key, index in group, member module names)`` if ``module`` is part of a fused group.

    Experts: gate/up of one expert form the ``w13`` group; ``down`` stands alone (None).
    """
    ex = parse_expert(module)
    if ex is not None:
        if ex.role == "down":
            return None
        base = f"{ex.prefix}.{ex.expert}"
        names = ("w1", "w3") if ex.proj in ("w1", "w3") else ("gate_proj", "up_proj")
        return f"{base}.w13", (0 if ex.role == "gate" else 1), tuple(f"{base}.{n}" for n in names)
    if "." not in module:
        return None
    parent, lf = module.rsplit(".", 1)
    for fused, members in FUSED_GROUPS:
        if lf in members:
            return f"{parent}.{fused}", members.index(lf), tuple(f"{parent}.{m}" for m in members)
    return None


def shared_input_key(module: str) -> str:
    """One name for the modules that read the same input tensor: a fused group's members (q/k/v,
    gate/up, each expert's gate/up, DeepSeek's q_a/kv_a) share their group key; any other module is
    its own. Calibration statistics of the input (GPTQ's Hessian) are kept once per key."""
    g = fused_group(module)
    return g[0] if g is not None else module


def is_embedding(module: str) -> bool:
    return leaf(module) in EMBEDDING_LEAVES


def is_linear_like(module: str) -> bool:
    """True for names that are linear layers in vLLM/SGLang whatever the model family."""
    return leaf(module) in LINEAR_LEAVES or parse_expert(module) is not None


def matches_any(module: str, patterns) -> str | None:
    """First fnmatch-style pattern (full match) that ``module`` matches, else None."""
    for p in patterns:
        if module == p or fnmatch.fnmatchcase(module, p):
            return p
    return None


def hub_to_transformers(name: str) -> str:
    for a, b in HUB_TO_TRANSFORMERS_RENAMES:
        name = name.replace(a, b)
    return name
