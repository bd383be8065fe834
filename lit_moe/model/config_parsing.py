"""Reading the ``model:`` section into :class:`lit_moe.model.config.DeepseekV3Config`: the accepted names
(Hugging Face, MindFormers / Megatron aliases, the keys accepted without effect), value type checks,
normalisation, and every consistency rule. The dataclass (its fields and their docs) lives in
``lit_moe/model/config.py``; nothing here imports it.

Every error is a :class:`lit_moe.config.ConfigError` whose message names ``model.<key>`` and the value.
"""

from __future__ import annotations

import ast
import math
import typing
from typing import Any, Callable, Union

import torch

from lit_moe.config import (GRAPH_MODEL_BLOCK, NO_EFFECT_KEYS, ConfigError, loss_and_embedding_keys_without_effect,
                            note_loss_and_embedding_key, suggest)
from lit_moe.ops.activation import SUPPORTED_ACTIVATIONS, SUPPORTED_GELU_APPROXIMATE
from lit_moe.model.families import (ARCHITECTURES, V4_DEFAULT_COMPRESS_RATES, V4_LAYER_TYPES,
                                    v4_default_layer_types)
from lit_moe.ops.norm import SUPPORTED_NORMS

POSITION_EMBEDDING_TYPES = ("rope", "yarn", "none", "learned_absolute")
SCORING_FUNCS = ("sigmoid", "softmax", "sqrtsoftplus")
ATTENTION_VARIANTS = (None, "mla", "dsa", "dsv4_hybrid")
LOAD_BALANCING_TYPES = ("seq_aux_loss", "aux_loss", "none")
TOKEN_DROP_POLICIES = ("probs", "position")
TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")
DISPATCHER_TYPES = ("alltoall", "allgather", "alltoall_deredundancy")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
DTYPE_FIELDS = ("params_dtype", "compute_dtype", "layernorm_compute_dtype", "softmax_compute_dtype",
                "rotary_dtype", "router_dense_type")

# MindFormers / Megatron / older-HF name → canonical name.
ALIASES = {
    "num_layers": "num_hidden_layers",
    "ffn_hidden_size": "intermediate_size",
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "num_moe_experts": "n_routed_experts",
    "num_local_experts": "n_routed_experts",
    "moe_router_topk": "num_experts_per_tok",
    "moe_router_num_groups": "n_group",
    "moe_router_group_topk": "topk_group",
    "moe_router_topk_scaling_factor": "routed_scaling_factor",
    "moe_router_score_function": "scoring_func",
    "moe_router_dtype": "router_dense_type",
    "shared_expert_num": "n_shared_experts",
    "num_query_groups": "num_key_value_heads",
    "layernorm_epsilon": "rms_norm_eps",
    "init_method_std": "initializer_range",
    "rotary_base": "rope_theta",
    "rotary_scaling_factor": "scaling_factor",
    "qk_pos_emb_head_dim": "qk_rope_head_dim",
    "mtp_num_layers": "num_nextn_predict_layers",
    "num_mtp_layers": "num_nextn_predict_layers",
    "mtp_loss_factor": "mtp_loss_scaling_factor",
    "aux_loss_alpha": "moe_aux_loss_coeff",
    "apply_rope_fusion": "use_fused_rope",
    "add_qkv_bias": "attention_bias",
    "use_gmm": "moe_grouped_gemm",
    "dsa_indexer_topk": "index_topk",
    "dsa_indexer_n_heads": "index_n_heads",
    "dsa_indexer_head_dim": "index_head_dim",
}

# Keys accepted without effect (Hugging Face / DeepSeek config.json bookkeeping and MindFormers
# kernel switches): the ``model.*`` entries of the one documented list, lit_moe.config.NO_EFFECT_KEYS.
IGNORED_KEYS = frozenset(k[len("model."):] for k in NO_EFFECT_KEYS if k.startswith("model."))


def resolve_keys(kwargs: dict[str, Any], field_names: set[str]) -> dict[str, tuple[str, Any]]:
    """``canonical field → (key as written, value)`` of a model section. Aliases map to their field;
    two spellings of one field must agree; keys accepted without effect are dropped; anything else is
    an error naming the key, with a did-you-mean suggestion (a graph-mode ``model_config`` block
    names ``lit_moe convert-config``)."""
    kwargs = expand_rope_dict(dict(kwargs))
    values: dict[str, tuple[str, Any]] = {}
    for key, value in kwargs.items():
        name = ALIASES.get(key, key)
        if name not in field_names:
            if key in IGNORED_KEYS:
                if f"model.{key}" in loss_and_embedding_keys_without_effect():
                    note_loss_and_embedding_key(key, value)
                continue
            if key == "model_config":
                raise ConfigError(GRAPH_MODEL_BLOCK)
            known = field_names | set(ALIASES) | set(IGNORED_KEYS) | {"rope_scaling", "rope_parameters", "qk_head_dim"}
            raise ConfigError(f"model.{key}: unknown key{suggest(str(key), known)}; the model section takes the "
                              "fields listed in the README's model reference, their MindFormers/Hugging Face "
                              "aliases and the keys accepted without effect")
        if name in values and values[name][1] != value:
            raise ConfigError(f"model.{key}: {value!r} conflicts with model.{values[name][0]}: "
                              f"{values[name][1]!r} (both set {name})")
        values[name] = (key, value)
    return values


def normalise(cfg: Any) -> None:
    """Canonical spellings of values (dtypes, window pairs, group defaults, Hugging Face activation names)."""
    set_ = lambda k, v: object.__setattr__(cfg, k, v)  # noqa: E731
    if not cfg.q_lora_rank:
        set_("q_lora_rank", None)
    if isinstance(cfg.architectures, (list, tuple)) and len(cfg.architectures) == 1:
        set_("architectures", cfg.architectures[0])
    for name in DTYPE_FIELDS:
        value = getattr(cfg, name)
        key = str(value).replace("torch.", "").lower()
        if key == "auto" and name == "compute_dtype":
            # a run resolves it for its accelerator first (and prints the line); elsewhere: this machine's
            from lit_moe.runtime.device_speed import available_accelerator, resolve_compute_dtype

            key = resolve_compute_dtype("auto", available_accelerator())[0]
        if key not in _DTYPES:
            raise ConfigError(f"model.{name}: unknown dtype {value!r}; supported: float32, bfloat16, float16"
                              + (", auto" if name == "compute_dtype" else ""))
        set_(name, str(_DTYPES[key]).replace("torch.", ""))
    if cfg.window_size is not None:
        set_("window_size", parse_window(cfg.window_size))
    if cfg.n_routed_experts and not cfg.n_group:
        set_("n_group", 1)
    if cfg.n_routed_experts and not cfg.topk_group:
        set_("topk_group", cfg.n_group)
    if cfg.sparse_attention or cfg.experimental_attention_variant == "dsv4_hybrid":   # the indexer's sizes
        topk = 2048 if cfg.sparse_attention else 512   # DeepSeek-V3.2's keys / V4's compressed entries
        for name, value in (("index_topk", topk), ("index_n_heads", 64), ("index_head_dim", 128)):
            if getattr(cfg, name) is None:
                set_(name, value)
    if cfg.compress_rates is None:
        set_("compress_rates", dict(V4_DEFAULT_COMPRESS_RATES))
    if cfg.experimental_attention_variant == "dsv4_hybrid" and cfg.layer_types is None:
        set_("layer_types", v4_default_layer_types(cfg.num_hidden_layers))
    if cfg.hidden_act in ("gelu_pytorch_tanh", "gelu_tanh"):  # Hugging Face's names
        set_("hidden_act", "gelu")
        set_("gelu_approximate", "tanh")


def validate(cfg: Any) -> None:
    """Every consistency rule of the ``model`` section; the first violation raises :class:`ConfigError`."""
    def fail(name: str, msg: str) -> None:
        raise ConfigError(f"model.{name}: {getattr(cfg, name)!r} {msg}")

    if cfg.model_type not in ARCHITECTURES:
        fail("model_type", "is not supported; supported: " + ", ".join(map(repr, ARCHITECTURES)))
    if cfg.architectures not in (None, ARCHITECTURES[cfg.model_type]):
        fail("architectures", f"is not the architecture of model_type {cfg.model_type!r}: "
             f"{ARCHITECTURES[cfg.model_type]!r}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                 "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                 "v_head_dim", "seq_length", "max_position_embeddings", "num_experts_per_tok"):
        if getattr(cfg, name) < 1:
            fail(name, "must be >= 1")
    if cfg.qk_rope_head_dim < 0 or cfg.qk_rope_head_dim % 2:
        fail("qk_rope_head_dim", "must be a non-negative even number (rotary pairs)")
    if cfg.q_lora_rank is not None and cfg.q_lora_rank < 0:
        fail("q_lora_rank", "must be None, 0 or positive")
    if cfg.experimental_attention_variant not in ATTENTION_VARIANTS:
        fail("experimental_attention_variant", "is not supported; supported: 'mla', 'dsa' (DeepSeek-V3.2), "
             "'dsv4_hybrid' (DeepSeek-V4)")
    if cfg.experimental_attention_variant == "mla" and not cfg.multi_latent_attention:
        fail("experimental_attention_variant", "needs multi_latent_attention: True")
    validate_v4(cfg, fail)
    if cfg.experimental_attention_variant == "dsv4_hybrid":
        pass   # its own fields, checked by validate_v4
    elif cfg.multi_latent_attention:
        if cfg.v_head_dim > cfg.qk_head_dim:
            fail("v_head_dim", f"must not exceed qk_nope_head_dim + qk_rope_head_dim ({cfg.qk_head_dim})")
        if cfg.attention_bias:
            fail("attention_bias", "is not supported with multi-latent attention (its projections have no bias)")
    else:
        validate_gqa(cfg, fail)
    validate_sparse_attention(cfg, fail)
    if cfg.add_bias_linear:
        fail("add_bias_linear", "is not supported: DeepSeek-V3 linear layers have no bias")
    if not cfg.gated_linear_unit:
        fail("gated_linear_unit", "is not supported: only gated (SwiGLU-style) MLPs are implemented")
    if cfg.tie_word_embeddings:
        fail("tie_word_embeddings", "is not supported: the output head is untied")
    for name in ("attention_dropout", "hidden_dropout"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            fail(name, "must be in [0, 1)")
    for name in ("rms_norm_eps", "initializer_range", "rope_theta"):
        if getattr(cfg, name) <= 0:
            fail(name, "must be > 0")
    # norms and activation (the rules of MindFormers' PyNative configuration guide)
    if not cfg.fused_norm:
        fail("fused_norm", "is not supported: only fused normalization layers are supported "
             "(set fused_norm: True)")
    if cfg.normalization not in SUPPORTED_NORMS:
        fail("normalization", "is not supported; supported: " + ", ".join(map(repr, SUPPORTED_NORMS)))
    if cfg.hidden_act not in SUPPORTED_ACTIVATIONS:
        fail("hidden_act", "is not supported; supported: " + ", ".join(map(repr, SUPPORTED_ACTIVATIONS)))
    if cfg.gelu_approximate not in SUPPORTED_GELU_APPROXIMATE:
        fail("gelu_approximate", "is not supported; supported: "
             + ", ".join(map(repr, SUPPORTED_GELU_APPROXIMATE)))
    if cfg.use_fused_swiglu and cfg.hidden_act == "gelu":
        fail("use_fused_swiglu", "needs a SwiGLU activation, but hidden_act is 'gelu'")
    # positions
    if cfg.position_embedding_type not in POSITION_EMBEDDING_TYPES:
        fail("position_embedding_type", "is not supported; supported: "
             + ", ".join(map(repr, POSITION_EMBEDDING_TYPES)))
    if cfg.position_embedding_type == "learned_absolute" and cfg.seq_length and \
            cfg.max_position_embeddings < cfg.seq_length:
        fail("max_position_embeddings", f"rows of the learned position table are fewer than seq_length "
             f"{cfg.seq_length} (position ids go up to seq_length - 1)")
    if cfg.position_embedding_type in ("rope", "yarn") and cfg.multi_latent_attention and cfg.qk_rope_head_dim == 0:
        fail("qk_rope_head_dim", f"must be > 0 with position_embedding_type {cfg.position_embedding_type!r}")
    if cfg.position_embedding_type == "yarn":
        if cfg.scaling_factor < 1:
            fail("scaling_factor", "must be >= 1 for YaRN")
        if cfg.beta_fast <= cfg.beta_slow:
            fail("beta_fast", f"must be greater than beta_slow ({cfg.beta_slow})")
        if cfg.yarn_original_length < 1:
            fail("original_max_position_embeddings", "must be >= 1")
        if cfg.mscale < 0 or cfg.mscale_all_dim < 0:
            fail("mscale" if cfg.mscale < 0 else "mscale_all_dim", "must be >= 0")
    if cfg.nope_layer_interval is not None and cfg.nope_layer_interval < 0:
        fail("nope_layer_interval", "must be None or >= 0")
    # attention windows
    if cfg.window_size is not None:
        if cfg.window_size[1] not in (0, -1):
            fail("window_size", "right size must be 0 or -1: the model is causal, a query never sees "
                 "later tokens")
    freq = cfg.window_attn_skip_freq
    if freq is not None:
        if isinstance(freq, bool) or not isinstance(freq, (int, list)):
            fail("window_attn_skip_freq", "must be an int or a list of 0/1")
        if isinstance(freq, int) and freq < 1:
            fail("window_attn_skip_freq", "must be >= 1")
        if isinstance(freq, list):
            if any(v not in (0, 1) or isinstance(v, float) for v in freq):
                fail("window_attn_skip_freq", "list entries must be 0 (full) or 1 (sliding window)")
            if len(freq) not in (cfg.num_hidden_layers, cfg.total_layers):
                fail("window_attn_skip_freq", f"has {len(freq)} entries; the model has "
                     f"{cfg.num_hidden_layers} decoder layers ({cfg.total_layers} with MTP)")
    # MoE
    E = cfg.n_routed_experts or 0
    if E < 0:
        fail("n_routed_experts", "must be >= 0")
    if not 0 <= cfg.first_k_dense_replace <= cfg.num_hidden_layers:
        fail("first_k_dense_replace", f"must be in [0, num_hidden_layers={cfg.num_hidden_layers}]")
    if cfg.moe_layer_freq < 1:
        fail("moe_layer_freq", "must be >= 1")
    if cfg.n_shared_experts < 0:
        fail("n_shared_experts", "must be >= 0")
    if cfg.moe_shared_expert_intermediate_size is not None:
        if cfg.moe_shared_expert_intermediate_size < 0:
            fail("moe_shared_expert_intermediate_size", "must be >= 0")
        if (cfg.moe_shared_expert_intermediate_size > 0) != (cfg.n_shared_experts > 0):
            fail("moe_shared_expert_intermediate_size",
                 f"is inconsistent with n_shared_experts={cfg.n_shared_experts}")
    if cfg.scoring_func not in SCORING_FUNCS:
        fail("scoring_func", "is not supported; supported: " + ", ".join(map(repr, SCORING_FUNCS)))
    if cfg.topk_method not in TOPK_METHODS:
        fail("topk_method", "is not supported; supported: " + ", ".join(map(repr, TOPK_METHODS)))
    if cfg.moe_router_load_balancing_type not in LOAD_BALANCING_TYPES:
        fail("moe_router_load_balancing_type", "is not supported; supported: "
             + ", ".join(map(repr, LOAD_BALANCING_TYPES)))
    if cfg.moe_token_drop_policy not in TOKEN_DROP_POLICIES:
        fail("moe_token_drop_policy", "is not supported; supported: "
             + ", ".join(map(repr, TOKEN_DROP_POLICIES)))
    if cfg.moe_token_dispatcher_type not in DISPATCHER_TYPES:
        fail("moe_token_dispatcher_type", "is not supported; supported: "
             + ", ".join(map(repr, DISPATCHER_TYPES)))
    if cfg.moe_aux_loss_coeff < 0:
        fail("moe_aux_loss_coeff", "must be >= 0")
    if cfg.moe_router_bias_update_rate < 0:
        fail("moe_router_bias_update_rate", "must be >= 0")
    if cfg.moe_expert_capacity_factor is not None and cfg.moe_expert_capacity_factor <= 0:
        fail("moe_expert_capacity_factor", "must be None (dropless) or > 0")
    if E:
        if cfg.num_experts_per_tok > E:
            fail("num_experts_per_tok", f"must not exceed n_routed_experts ({E})")
        if cfg.n_group < 1:
            fail("n_group", "must be >= 1")
        if E % cfg.n_group:
            fail("n_routed_experts", f"must be divisible by n_group ({cfg.n_group})")
        if not 1 <= cfg.topk_group <= cfg.n_group:
            fail("topk_group", f"must be in [1, n_group={cfg.n_group}]")
        if cfg.group_limited:
            per_group = E // cfg.n_group
            if per_group < 2:
                fail("n_group", f"leaves {per_group} expert per group; group scores sum the top 2, "
                     "so each group needs >= 2 experts")
            if cfg.num_experts_per_tok > cfg.topk_group * per_group:
                fail("num_experts_per_tok", f"cannot be chosen from topk_group={cfg.topk_group} groups "
                     f"of {per_group} experts")
        if cfg.moe_router_enable_expert_bias and cfg.scoring_func == "softmax":
            fail("moe_router_enable_expert_bias", "needs scoring_func 'sigmoid' or 'sqrtsoftplus' (aux-loss-free "
                 "expert bias); set it to False for softmax routing")
    # MTP
    if cfg.num_nextn_predict_layers < 0:
        fail("num_nextn_predict_layers", "must be >= 0")
    if cfg.mtp_loss_scaling_factor < 0:
        fail("mtp_loss_scaling_factor", "must be >= 0")


def validate_sparse_attention(cfg: Any, fail: Callable[[str, str], None]) -> None:
    """The rules of DeepSeek-V3.2's sparse attention (``experimental_attention_variant: dsa``)."""
    if not cfg.sparse_attention:
        if cfg.model_type == "deepseek_v32":
            fail("experimental_attention_variant", "must be 'dsa' for model_type 'deepseek_v32'")
        for name in ("index_topk", "index_n_heads", "index_head_dim"):
            # (a deepseek_v4 section may keep V4's indexer sizes while it runs MLA, as MindFormers' does)
            if getattr(cfg, name) is not None and cfg.model_type != "deepseek_v4":
                fail(name, "needs experimental_attention_variant 'dsa' (DeepSeek-V3.2) or 'dsv4_hybrid' (DeepSeek-V4)")
        return
    if cfg.model_type == "deepseek_v4":
        fail("experimental_attention_variant", "is DeepSeek-V3.2's sparse attention (model_type deepseek_v32 or "
             "deepseek_v3); DeepSeek-V4 uses 'dsv4_hybrid' or 'mla'")
    if not cfg.multi_latent_attention or not cfg.q_lora_rank:
        fail("experimental_attention_variant", "needs multi-latent attention with q_lora_rank (the indexer "
             "reads the normed query latent)")
    for name in ("index_topk", "index_n_heads", "index_head_dim"):
        if getattr(cfg, name) < 1:
            fail(name, "must be >= 1")
    if cfg.index_head_dim < cfg.qk_rope_head_dim:
        fail("index_head_dim", f"must be at least qk_rope_head_dim ({cfg.qk_rope_head_dim}): its leading dims "
             "carry the rotary encoding")
    if cfg.dsa_indexer_loss_coeff is not None and not cfg.dsa_indexer_loss_coeff >= 0:
        fail("dsa_indexer_loss_coeff", "must be >= 0 (0 or null: no indexer loss)")
    if not cfg.dsa_indexer_use_sparse_loss and not (cfg.dsa_indexer_loss_coeff or 0) > 0:
        fail("dsa_indexer_use_sparse_loss", "(MindFormers' default: the dense warm-up stage, which trains the "
             "indexer only, by its loss) needs dsa_indexer_loss_coeff > 0; set it, or set "
             "dsa_indexer_use_sparse_loss: true (the sparse stage: top-k attention)")
def validate_v4(cfg: Any, fail: Callable[[str, str], None]) -> None:
    """The rules of DeepSeek-V4's pieces: its attention, mHC, hash routing, the SwiGLU clamp."""
    if cfg.enable_hyper_connections:
        if cfg.hc_mult < 1:
            fail("hc_mult", "must be >= 1")
        if cfg.hc_sinkhorn_iters < 0:
            fail("hc_sinkhorn_iters", "must be >= 0")
    elif cfg.enable_hc_head:
        fail("enable_hc_head", "needs enable_hyper_connections: True (as in MindFormers)")
    if cfg.num_hash_layers < 0:
        fail("num_hash_layers", "must be >= 0")
    if cfg.num_hash_layers and not cfg.n_routed_experts:
        fail("num_hash_layers", "needs routed experts (n_routed_experts)")
    if cfg.swiglu_limit is not None and cfg.swiglu_limit <= 0:
        fail("swiglu_limit", "must be None (no clamp) or > 0")
    if cfg.experimental_attention_variant != "dsv4_hybrid":
        return
    types = cfg.layer_types
    if not isinstance(types, list) or len(types) != cfg.num_hidden_layers:
        fail("layer_types", f"must list one attention type per decoder layer ({cfg.num_hidden_layers})")
    for t in types:
        if t not in V4_LAYER_TYPES:
            fail("layer_types", f"entry {t!r} is not one of " + ", ".join(map(repr, V4_LAYER_TYPES)))
    rates = cfg.compress_rates
    if not isinstance(rates, dict) or any(not isinstance(rates.get(k), int) or rates[k] < 1
                                          for k in V4_LAYER_TYPES[1:]):
        fail("compress_rates", "must give a positive int for compressed_sparse_attention and "
             "heavily_compressed_attention")
    if not cfg.q_lora_rank:
        fail("q_lora_rank", "must be > 0 with experimental_attention_variant 'dsv4_hybrid' (low-rank queries)")
    for name in ("sliding_window", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk"):
        if getattr(cfg, name) < 1:
            fail(name, "must be >= 1")
    if cfg.num_attention_heads % cfg.o_groups:
        fail("o_groups", f"must divide num_attention_heads ({cfg.num_attention_heads})")
    rope = cfg.v4_rope_dim
    if rope < 2 or rope % 2 or rope > cfg.gqa_head_dim or cfg.index_head_dim < rope:
        fail("partial_rotary_factor", f"rotates {rope} dims of head_dim {cfg.gqa_head_dim}; it must be a positive "
             f"even number, at most index_head_dim ({cfg.index_head_dim})")
    if cfg.position_embedding_type != "rope":
        fail("position_embedding_type", "is not supported with experimental_attention_variant 'dsv4_hybrid' "
             "(plain RoPE only; YaRN on the compressed layers is not implemented)")
    if cfg.use_eod_attn_mask_compression:
        fail("use_eod_attn_mask_compression", "is not supported with experimental_attention_variant "
             "'dsv4_hybrid' (compressed entries span document ends)")


def validate_gqa(cfg: Any, fail: Callable[[str, str], None]) -> None:
    """The rules of grouped-query attention (``multi_latent_attention: False``)."""
    if cfg.num_key_value_heads is not None and (cfg.num_key_value_heads < 1
                                                or cfg.num_attention_heads % cfg.num_key_value_heads):
        fail("num_key_value_heads", f"must be >= 1 and divide num_attention_heads ({cfg.num_attention_heads})")
    if cfg.head_dim is not None and cfg.head_dim < 1:
        fail("head_dim", "must be None or >= 1")
    if not 0.0 < cfg.partial_rotary_factor <= 1.0:
        fail("partial_rotary_factor", "must be in (0, 1]")
    if cfg.position_embedding_type in ("rope", "yarn") and (cfg.rotary_dim < 2 or cfg.rotary_dim % 2):
        fail("partial_rotary_factor", f"rotates {cfg.rotary_dim} dims of head_dim {cfg.gqa_head_dim}; it must "
             "be a positive even number (rotary pairs)")
    if cfg.position_embedding_type == "yarn":
        fail("position_embedding_type", "is not supported with grouped-query attention (YaRN is implemented "
             "with DeepSeek-V3's attention scale); use 'rope'")


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
_ROPE_DICT_KEYS = {
    "factor": "scaling_factor", "original_max_position_embeddings": "original_max_position_embeddings",
    "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim", "rope_theta": "rope_theta",
    "partial_rotary_factor": "partial_rotary_factor",
}


def expand_rope_dict(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face ``rope_scaling`` (v4) / ``rope_parameters`` (v5) dicts → flat canonical fields."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = kwargs.pop(key, None)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ConfigError(f"model.{key}: expected a dict, got {rope!r}")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "yarn":
            kwargs.setdefault("position_embedding_type", "yarn")
        elif kind in ("default", "rope"):
            kwargs.setdefault("position_embedding_type", "rope")
        else:
            raise ConfigError(f"model.{key}.type: {kind!r} is not supported; supported: 'yarn', 'default'")
        for k, v in rope.items():
            if k in ("type", "rope_type", "truncate"):
                if k == "truncate" and v is False:
                    raise ConfigError(f"model.{key}.truncate: False is not supported (YaRN bounds are "
                                      "floored/ceiled as in DeepSeek-V3)")
                continue
            if k not in _ROPE_DICT_KEYS:
                raise ConfigError(f"model.{key}.{k}: unknown key; supported: " + ", ".join(sorted(_ROPE_DICT_KEYS)))
            if v is None:
                continue
            name = _ROPE_DICT_KEYS[k]
            if name in kwargs and kwargs[name] != v:
                raise ConfigError(f"model.{key}.{k}: {v!r} conflicts with model.{name}: {kwargs[name]!r}")
            kwargs[name] = v
    return kwargs


def parse_window(value: Any) -> tuple[int, int]:
    raw = value
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise ConfigError(f"model.window_size: cannot parse {raw!r}; write (left, right), e.g. (10, 0)") from None
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value, 0)
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise ConfigError(f"model.window_size: {raw!r} is not a pair of ints (left, right)")
    left, right = value
    if left < -1 or right < -1:
        raise ConfigError(f"model.window_size: {raw!r}: sizes must be >= 0 or -1 (unlimited)")
    return (left, right)


def check_type(key: str, value: Any, annotation: Any) -> Any:
    """Check ``value`` against a field annotation; ints widen to floats, numeric strings parse as floats
    (PyYAML reads ``1e-6`` as a string)."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return value
    if origin is Union:
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return check_type(key, value, arg)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(value)
            if not math.isnan(value):
                return value
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif annotation is str:
        if isinstance(value, str):
            return value
        if isinstance(value, torch.dtype):
            return str(value).replace("torch.", "")
    else:
        return value
    raise ConfigError(f"model.{key}: expected {annotation.__name__}, got {type(value).__name__} ({value!r})")


def check_document_mask_data(model_config: Any, dataloader: Any, eval_dataset: Any = None) -> None:
    """``model.use_eod_attn_mask_compression`` against the data, as MindFormers' PyNative trainer
    reads it: ``create_compressed_eod_mask: true`` in ``train_dataset.dataloader.config`` turns the
    flag on (``_sync_eod_compression_flag``); with the flag on, every batch must carry
    ``actual_seq_len`` (the document ends the mask is built from): the train data and, when given
    (evaluation on), the ``eval_dataset`` section. Otherwise one line naming the dataset key.
    A ``MindDataset`` provides ``actual_seq_len`` when it is one of its ``column_names`` (MindFormers
    turns the flag on when the MindRecord files have that column)."""
    def provides(loader: Any) -> tuple[bool, str]:
        loader = loader if isinstance(loader, dict) else {}
        if loader.get("type") == "MindDataset":
            columns = loader.get("column_names")
            columns = [columns] if isinstance(columns, str) else list(columns or [])
            if "actual_seq_len" in columns:
                return True, ""
            return False, f"column_names {columns} leaves out 'actual_seq_len'"
        config = loader.get("config") if isinstance(loader.get("config"), dict) else {}
        if not config.get("create_compressed_eod_mask", False):
            return False, "config.create_compressed_eod_mask is false"
        columns = loader.get("column_names")
        columns = [columns] if isinstance(columns, str) else columns
        if columns is not None and "actual_seq_len" not in columns:
            return False, f"column_names {list(columns)} leaves out 'actual_seq_len'"
        return True, ""

    train_has, _ = provides(dataloader)
    if train_has and not model_config.use_eod_attn_mask_compression:
        object.__setattr__(model_config, "use_eod_attn_mask_compression", True)
    if not model_config.use_eod_attn_mask_compression:
        return
    sections = [("train_dataset", dataloader)]
    if eval_dataset is not None:
        section = eval_dataset if isinstance(eval_dataset, dict) else vars(eval_dataset)
        sections.append(("eval_dataset", section.get("dataloader")))
    for name, loader in sections:
        ok, why = provides(loader)
        if not ok:
            raise ConfigError(
                f"model.use_eod_attn_mask_compression: True keeps attention within the documents given by the "
                f"batch's actual_seq_len, but {name}.dataloader.{why}; set {name}.dataloader.config."
                "create_compressed_eod_mask: true (with 'actual_seq_len' in column_names), or "
                "use_eod_attn_mask_compression: false")
