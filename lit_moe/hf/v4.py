"""Hugging Face DeepSeek-V4 checkpoints (``model_type: deepseek_v4``): ``config.json`` and tensor names.

The tensors are named as transformers' ``DeepseekV4ForCausalLM.save_pretrained`` writes them (the
DeepSeek-V4 release's names, which transformers renames on loading): our Hugging Face DeepSeek-V3
spelling (``lit_moe.model.names``, per-expert ``gate_proj``/``up_proj``/``down_proj``), then

| DeepSeek-V3 spelling | DeepSeek-V4 |
|---|---|
| ``lm_head.weight``, ``hc_head.*`` | ``head.weight``, ``model.hc_head.*`` |
| ``self_attn.``, ``mlp.`` | ``attn.``, ``ffn.`` |
| ``input_layernorm``, ``post_attention_layernorm`` | ``attn_norm``, ``ffn_norm`` |
| ``attn_hc.fn`` / ``ffn_hc.base`` ... | ``hc_attn_fn`` / ``hc_ffn_base`` ... |
| ``gate.e_score_correction_bias`` | ``gate.bias`` (``gate.tid2eid``: the hash table) |
| experts' and shared experts' ``gate_proj`` / ``up_proj`` / ``down_proj`` | ``w1`` / ``w3`` / ``w2`` |
| ``q_a_proj``, ``q_a_norm``, ``q_b_proj``, ``kv_proj``, ``kv_norm`` | ``wq_a``, ``q_norm``, ``wq_b``, ``wkv``, ``norm`` |
| ``o_a_proj``, ``o_b_proj``, ``sinks`` | ``wo_a``, ``wo_b``, ``attn_sink`` |
| compressors' ``gate_proj``, ``position_bias`` | ``wgate``, ``ape`` |

(``attn.compressor.*``, ``attn.indexer.compressor.*``, ``attn.indexer.wq_b``, ``attn.indexer.weights_proj``
are our module paths already.) transformers builds no MTP layers, so a V4 export has none and an import
builds none.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from lit_moe.model.families import ARCHITECTURES

# ordered: the experts' gate_proj before the compressors'
_RENAMES = tuple((re.compile(a), b) for a, b in (
    (r"^lm_head\.weight$", "head.weight"),
    (r"^hc_head\.", "model.hc_head."),
    (r"\.self_attn\.", ".attn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.mlp\.", ".ffn."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.(experts\.\d+|shared_experts)\.gate_proj\.", r".\1.w1."),
    (r"\.(experts\.\d+|shared_experts)\.up_proj\.", r".\1.w3."),
    (r"\.(experts\.\d+|shared_experts)\.down_proj\.", r".\1.w2."),
    (r"\.sinks$", ".attn_sink"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.kv_norm\.", ".norm."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.position_bias$", ".ape"),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
))


def release_name(v3_spelling: str) -> str:
    """A tensor's DeepSeek-V3 Hugging Face spelling as transformers' DeepSeek-V4 writes it."""
    for rx, new in _RENAMES:
        v3_spelling = rx.sub(new, v3_spelling)
    return v3_spelling


def pieces_problems(c: Any) -> list[str]:
    """DeepSeek-V4 pieces that another family's Hugging Face config cannot hold."""
    p = []
    for field, off in (("experimental_attention_variant", c.experimental_attention_variant != "dsv4_hybrid"),
                       ("enable_hyper_connections", not c.enable_hyper_connections),
                       ("num_hash_layers", not c.num_hash_layers), ("swiglu_limit", c.swiglu_limit is None)):
        if not off:
            p.append(f"model.{field}: {getattr(c, field)!r} (a DeepSeek-V4 piece; model_type "
                     f"{c.model_type!r} has no Hugging Face equivalent of it)")
    return p


def export_problems(c: Any) -> list[str]:
    """Why ``c`` (``deepseek_v4``) has no transformers ``DeepseekV4ForCausalLM`` equivalent."""
    p = []

    def need(ok: bool, field: str, why: str) -> None:
        if not ok:
            p.append(f"model.{field}: {getattr(c, field)!r} ({why})")

    need(c.v4_attention, "experimental_attention_variant", "Hugging Face DeepSeek-V4 uses 'dsv4_hybrid'")
    need(c.enable_hyper_connections, "enable_hyper_connections", "Hugging Face DeepSeek-V4 always uses mHC")
    need(c.enable_hc_head, "enable_hc_head", "Hugging Face DeepSeek-V4 collapses the streams with its hc_head")
    need(bool(c.n_routed_experts), "n_routed_experts", "every Hugging Face DeepSeek-V4 layer is MoE")
    need(c.first_k_dense_replace == 0, "first_k_dense_replace", "every Hugging Face DeepSeek-V4 layer is MoE")
    need(c.moe_layer_freq == 1, "moe_layer_freq", "every Hugging Face DeepSeek-V4 layer is MoE")
    need(c.n_shared_experts == 1 and c.shared_expert_intermediate_size == c.moe_intermediate_size,
         "n_shared_experts", "Hugging Face DeepSeek-V4 has one shared expert of moe_intermediate_size")
    need(c.scoring_func in ("sqrtsoftplus", "sigmoid"), "scoring_func", "exported: sqrtsoftplus, sigmoid")
    need(c.norm_topk_prob, "norm_topk_prob", "Hugging Face DeepSeek-V4 always renormalises")
    need(not c.group_limited, "n_group", "Hugging Face DeepSeek-V4 routes without expert groups")
    need(c.swiglu_limit is not None, "swiglu_limit", "Hugging Face DeepSeek-V4 always clamps")
    need(c.hidden_act in ("silu", "fusedswiglu"), "hidden_act", "Hugging Face DeepSeek-V4 uses SwiGLU")
    need(c.normalization == "RMSNorm", "normalization", "Hugging Face DeepSeek-V4 uses RMSNorm")
    need(c.num_nextn_predict_layers == 0, "num_nextn_predict_layers",
         "transformers' DeepSeek-V4 builds no MTP layers")
    return p


def hf_config_dict(c: Any, dtype: Optional[torch.dtype]) -> dict[str, Any]:
    """transformers' ``DeepseekV4Config`` of ``c`` (plus our full config under ``lit_moe``); the caller
    checked :func:`export_problems`."""
    rope = {"rope_type": "default", "partial_rotary_factor": c.partial_rotary_factor}
    L = c.num_hidden_layers
    return {
        "architectures": [ARCHITECTURES["deepseek_v4"]], "model_type": "deepseek_v4",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "moe_intermediate_size": c.moe_intermediate_size,
        "num_hidden_layers": L, "num_attention_heads": c.num_attention_heads, "num_key_value_heads": 1,
        "head_dim": c.gqa_head_dim, "q_lora_rank": c.q_lora_rank, "num_experts_per_tok": c.num_experts_per_tok,
        "n_routed_experts": c.n_routed_experts, "n_shared_experts": 1, "scoring_func": c.scoring_func,
        "norm_topk_prob": True, "routed_scaling_factor": c.routed_scaling_factor,
        "max_position_embeddings": c.max_position_embeddings, "rope_theta": c.rope_theta,
        "partial_rotary_factor": c.partial_rotary_factor,
        "rope_parameters": {"main": {**rope, "rope_theta": c.rope_theta},
                            "compress": {**rope, "rope_theta": c.compress_rope_theta}},
        "layer_types": list(c.layer_types), "compress_rates": dict(c.compress_rates),
        "compress_rope_theta": c.compress_rope_theta, "hc_mult": c.hc_mult,
        "hc_sinkhorn_iters": c.hc_sinkhorn_iters, "hc_eps": c.hc_eps,
        "mlp_layer_types": ["hash_moe" if c.is_hash_layer(i) else "moe" for i in range(L)],
        "swiglu_limit": c.swiglu_limit, "sliding_window": c.sliding_window, "o_groups": c.o_groups,
        "o_lora_rank": c.o_lora_rank, "index_n_heads": c.index_n_heads, "index_head_dim": c.index_head_dim,
        "index_topk": c.index_topk, "num_nextn_predict_layers": 0, "hidden_act": "silu",
        "initializer_range": c.initializer_range, "rms_norm_eps": c.rms_norm_eps, "attention_bias": False,
        "mlp_bias": False, "attention_dropout": c.attention_dropout, "tie_word_embeddings": False,
        "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id,
        "torch_dtype": str(dtype or c.torch_dtype("params_dtype")).replace("torch.", ""),
        "lit_moe": c.to_dict(),
    }


# Hugging Face keys that are derived, informational, or inference-only
_DROPPED = ("qk_rope_head_dim", "router_aux_loss_coef", "router_jitter_noise", "expert_dtype",
            "num_nextn_predict_layers", "mlp_bias")


def section_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """transformers' DeepSeek-V4 ``config.json`` as our model section (errors name the key)."""
    from lit_moe.config import ConfigError

    out = dict(hf)
    if out.get("mlp_bias"):
        raise ConfigError("config.json: mlp_bias=True is not supported (DeepSeek-V4 MLPs have no bias)")
    for key in _DROPPED:
        out.pop(key, None)
    types = out.pop("mlp_layer_types", None)
    if types is not None:
        hashed = [t == "hash_moe" for t in types]
        n = sum(hashed)
        if hashed != [True] * n + [False] * (len(types) - n):
            raise ConfigError(f"config.json: mlp_layer_types={types!r} is not supported; only a hash_moe prefix "
                              "(num_hash_layers)")
        out["num_hash_layers"] = n
    rope = out.pop("rope_parameters", None) or {}
    for label, field in (("main", "rope_theta"), ("compress", "compress_rope_theta")):
        sub = rope.get(label) or {}
        if sub.get("rope_type", "default") != "default":
            raise ConfigError(f"config.json: rope_parameters.{label}.rope_type={sub['rope_type']!r} is not supported "
                              "(plain RoPE only)")
        if "rope_theta" in sub:
            out[field] = sub["rope_theta"]
    out["num_nextn_predict_layers"] = 0   # transformers' V4 checkpoints carry no MTP weights
    return out
