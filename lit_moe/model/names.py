"""Parameter names as the model defines them, whatever wraps it, and their spellings in MindFormers'
and Hugging Face's module trees.

Activation checkpointing, FSDP1 and ``torch.compile`` insert a component into parameter names;
initialisation, optimizer rules and checkpoints are written against the model's own names
(:func:`canonical_name`). Config keys that name parameters or modules match any spelling
(:func:`spellings`, the one name map; the Hugging Face export uses it too). A leaf module (the model,
the optimizer and the checkpoints import it).
"""

from __future__ import annotations

import difflib
import functools
import re
from typing import Iterable, Optional

WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """Parameter name without activation-checkpoint / FSDP1 / compile wrapper parts."""
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


# ----------------------------------------------------------------------------------------------
# the other spellings of a name: MindFormers' and Hugging Face's
# ----------------------------------------------------------------------------------------------
# Every config key that names parameters or modules (``optimizer.adamw_include`` /
# ``weight_decay_include`` / ``weight_decay_exclude``, ``lora_config.target_modules`` /
# ``exclude_layers``, ``recompute.select_module``, ``recompute_comm.select_module``,
# ``monitor.train_state.local_norm`` / ``device_norm``) is matched against each name in all the
# spellings below, so a MindFormers config keeps its meaning. Read from MindFormers' module trees
# (mindspore-ai/mindformers): the PyNative DeepSeek-V3 (``mindformers/pynative/base_models/gpt/
# gpt_model.py``: ``embedding.word_embeddings``, ``decoder.layers``, ``decoder.final_layernorm``,
# ``output_layer``, ``mtp.layers.{k}.transformer_layer``; ``transformers/multi_latent_attention.py``
# ``MLASelfAttention``: ``linear_qkv`` = [q down | kv down] in one matrix, ``q_layernorm``,
# ``linear_qb``, ``k_layernorm``, ``linear_kvb``, ``linear_proj``; ``transformers/mlp.py``:
# ``linear_fc1`` = [gate | up], ``linear_fc2``; ``transformers/moe/``: ``router.weight``,
# ``experts.weight1`` / ``weight2``, the expert bias on the MoE layer as ``mlp.expert_bias``),
# its Megatron-style graph tree with separate MLA projections (``parallel_core/training_graph``
# and ``models/deepseek3/utils.py``'s ``weight_mapping``: ``linear_q_proj``,
# ``linear_q_down_proj``, ``linear_q_up_proj``, ``linear_kv_down_proj``, ``kv_layernorm``,
# ``linear_kv_up_proj``) and Hugging Face's DeepSeek-V3 (``lit_moe/hf/checkpoint.py``).
# One lit_moe name has one spelling per tree; several lit_moe names can share one (``linear_qkv``
# holds both ``q_a_proj`` and ``kv_a_proj_with_mqa``; ``linear_fc1`` both ``gate_proj`` and ``up_proj``).
SPELLINGS = ("lit_moe", "mindformers", "mindformers_megatron", "huggingface")

# (lit_moe component(s), {tree: replacement}); a tree not listed keeps lit_moe's spelling. Matched on
# whole dotted components, applied in order, to full names and to paths inside a decoder layer.
_MF_TREES = ("mindformers", "mindformers_megatron")
_LAYER_RULES: tuple[tuple[str, dict[str, str]], ...] = (
    ("self_attention.q_a_proj", {"mindformers": "self_attention.linear_qkv",
                                 "mindformers_megatron": "self_attention.linear_q_down_proj"}),
    ("self_attention.q_proj", {"mindformers": "self_attention.linear_qkv",
                               "mindformers_megatron": "self_attention.linear_q_proj"}),
    ("self_attention.kv_a_proj_with_mqa", {"mindformers": "self_attention.linear_qkv",
                                           "mindformers_megatron": "self_attention.linear_kv_down_proj"}),
    ("self_attention.q_a_layernorm", {"mindformers": "self_attention.q_layernorm",
                                      "mindformers_megatron": "self_attention.q_layernorm"}),
    ("self_attention.q_b_proj", {"mindformers": "self_attention.linear_qb",
                                 "mindformers_megatron": "self_attention.linear_q_up_proj"}),
    ("self_attention.kv_a_layernorm", {"mindformers": "self_attention.k_layernorm",
                                       "mindformers_megatron": "self_attention.kv_layernorm"}),
    ("self_attention.kv_b_proj", {"mindformers": "self_attention.linear_kvb",
                                  "mindformers_megatron": "self_attention.linear_kv_up_proj"}),
    ("self_attention.o_proj", {"mindformers": "self_attention.linear_proj",
                               "mindformers_megatron": "self_attention.linear_proj"}),
    # grouped-query attention (Qwen3-MoE, GLM-4-MoE): MindFormers' GPT attention fuses q/k/v in linear_qkv
    ("self_attention.k_proj", dict.fromkeys(_MF_TREES, "self_attention.linear_qkv")),
    ("self_attention.v_proj", dict.fromkeys(_MF_TREES, "self_attention.linear_qkv")),
    ("self_attention.q_norm", dict.fromkeys(_MF_TREES, "self_attention.q_layernorm")),
    ("self_attention.k_norm", dict.fromkeys(_MF_TREES, "self_attention.k_layernorm")),
    # DeepSeek-V3.2's indexer: MindFormers' DSAIndexer sits in the core attention (gpt_layer_specs.py)
    *((f"self_attention.indexer.{lit}", dict.fromkeys(_MF_TREES, f"self_attention.core_attention.indexer.{mf}"))
      for lit, mf in (("wq_b", "linear_wq_b"), ("wk", "linear_wk"), ("k_norm", "k_norm"),
                      ("weights_proj", "linear_weights_proj"))),
    ("self_attention.indexer", dict.fromkeys(_MF_TREES, "self_attention.core_attention.indexer")),
    ("self_attention", {"huggingface": "self_attn"}),
    ("pre_mlp_layernorm", {"huggingface": "post_attention_layernorm"}),
    ("mlp.router.expert_bias", {"mindformers": "mlp.expert_bias",
                                "huggingface": "mlp.gate.e_score_correction_bias"}),
    ("mlp.router", {"huggingface": "mlp.gate"}),
    ("mlp.experts.gate_up_proj", {"mindformers": "mlp.experts.weight1",
                                  "mindformers_megatron": "mlp.experts.weight1"}),
    ("mlp.experts.down_proj", {"mindformers": "mlp.experts.weight2",
                               "mindformers_megatron": "mlp.experts.weight2"}),
    ("mlp.shared_experts.gate_proj", {"mindformers": "mlp.shared_experts.linear_fc1",
                                      "mindformers_megatron": "mlp.shared_experts.linear_fc1"}),
    ("mlp.shared_experts.up_proj", {"mindformers": "mlp.shared_experts.linear_fc1",
                                    "mindformers_megatron": "mlp.shared_experts.linear_fc1"}),
    ("mlp.shared_experts.down_proj", {"mindformers": "mlp.shared_experts.linear_fc2",
                                      "mindformers_megatron": "mlp.shared_experts.linear_fc2"}),
    ("mlp.gate_proj", {"mindformers": "mlp.linear_fc1", "mindformers_megatron": "mlp.linear_fc1"}),
    ("mlp.up_proj", {"mindformers": "mlp.linear_fc1", "mindformers_megatron": "mlp.linear_fc1"}),
    ("mlp.down_proj", {"mindformers": "mlp.linear_fc2", "mindformers_megatron": "mlp.linear_fc2"}),
)
_MF = ("mindformers", "mindformers_megatron")
# Model-level prefixes (full names only).
_MODEL_RULES: tuple[tuple[str, dict[str, str]], ...] = (
    ("embed_tokens", {**dict.fromkeys(_MF, "embedding.word_embeddings"), "huggingface": "model.embed_tokens"}),
    ("position_embeddings", dict.fromkeys(_MF, "embedding.position_embeddings")),
    ("layers", {**dict.fromkeys(_MF, "decoder.layers"), "huggingface": "model.layers"}),
    ("norm", {**dict.fromkeys(_MF, "decoder.final_layernorm"), "huggingface": "model.norm"}),
    ("lm_head", dict.fromkeys(_MF, "output_layer")),
)
_MTP = re.compile(r"^mtp\.(\d+)\.(.*)$")


def _component_rule(lit: str) -> re.Pattern:
    return re.compile(r"(?:(?<=^)|(?<=\.))" + re.escape(lit) + r"(?=$|\.)")


_LAYER_PATTERNS = tuple((_component_rule(lit), spell) for lit, spell in _LAYER_RULES)


def _layer_spelling(path: str, tree: str) -> str:
    for rx, spell in _LAYER_PATTERNS:
        if tree in spell:
            path = rx.sub(spell[tree], path, count=1)
    return path


def spelled(name: str, tree: str, num_hidden_layers: Optional[int] = None, *, in_layer: bool = False) -> str:
    """``name`` (a lit_moe parameter name or module path; with ``in_layer`` a path inside one decoder
    layer, as ``recompute`` addresses them) spelled as ``tree`` (one of :data:`SPELLINGS`) names it.
    Hugging Face numbers MTP layers after the decoder layers, so MTP names need ``num_hidden_layers``
    for that tree (without it they keep lit_moe's spelling)."""
    if tree == "lit_moe":
        return name
    if in_layer:
        return _layer_spelling(name, tree)
    m = _MTP.match(name)
    if m:
        k, rest = m.groups()
        if tree == "huggingface":
            if num_hidden_layers is None:
                return name
            prefix = f"model.layers.{num_hidden_layers + int(k)}"
            if rest == "final_layernorm" or rest.startswith("final_layernorm."):
                rest = "shared_head.norm" + rest[len("final_layernorm"):]
            elif rest == "layer" or rest.startswith("layer."):
                rest = rest[len("layer."):] if rest != "layer" else ""
            return _layer_spelling(f"{prefix}.{rest}".rstrip("."), tree)
        if rest == "layer" or rest.startswith("layer."):
            rest = "transformer_layer" + rest[len("layer"):]
        return _layer_spelling(f"mtp.layers.{k}.{rest}", tree)
    for lit, spell in _MODEL_RULES:
        if (name == lit or name.startswith(lit + ".")) and tree in spell:
            return _layer_spelling(spell[tree] + name[len(lit):], tree)
    return _layer_spelling(name, tree)


@functools.lru_cache(maxsize=1 << 16)   # matched per parameter and step by the monitor filters
def spellings(name: str, num_hidden_layers: Optional[int] = None, *, in_layer: bool = False) -> tuple[str, ...]:
    """``name`` in every tree of :data:`SPELLINGS` (lit_moe's first, duplicates dropped)."""
    out: list[str] = []
    for tree in SPELLINGS:
        s = spelled(name, tree, num_hidden_layers, in_layer=in_layer)
        if s not in out:
            out.append(s)
    return tuple(out)


def nearest_names(pattern: str, names: Iterable[str], n: int = 3, *, in_layer: bool = False) -> list[str]:
    """The lit_moe ``names`` closest to ``pattern`` (its wildcard and regex characters removed) in any
    spelling, for an error message: ``name`` or ``name (= closest spelling)``. Layer and expert numbers
    are collapsed to 0 so that the suggestions differ."""
    core = re.sub(r"[\\^$*+?()\[\]{}|]", "", pattern).strip(".")
    scored = []
    for name in sorted({re.sub(r"(?<=\.)\d+(?=\.|$)", "0", s) for s in names}):
        best = max(spellings(name, in_layer=in_layer),
                   key=lambda sp: max(difflib.SequenceMatcher(None, core, part).ratio() for part in _suffixes(sp)))
        score = max(difflib.SequenceMatcher(None, core, part).ratio() for part in _suffixes(best))
        scored.append((-score, len(name), name if best == name else f"{name} (= {best})"))
    return [label for *_, label in sorted(scored)[:n]]


def _suffixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))] + parts


def no_match_error(key: str, pattern: str, names: Iterable[str], what: str = "parameter of this model",
                   *, in_layer: bool = False) -> str:
    """The one-line message for a pattern of ``key`` that matches none of the lit_moe ``names`` in
    any spelling."""
    near = ", ".join(nearest_names(pattern, names, in_layer=in_layer))
    return (f"{key}: {pattern!r} matches no {what} (nearest: {near}); names may be spelled as lit_moe, "
            "MindFormers or Hugging Face spell them (README: \"Parameter and module names\")")
