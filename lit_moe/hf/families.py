"""Hugging Face ``config.json`` of the other families (``qwen3_moe``, ``glm4_moe``): export and import.

The tensor names are DeepSeek-V3's map (``lit_moe.hf.checkpoint``, ``lit_moe.model.names``): grouped-query
attention keeps Hugging Face's own module names (``q_proj``/``k_proj``/``v_proj``/``o_proj``,
``q_norm``/``k_norm`` under ``self_attn``), the router is ``mlp.gate``, experts are per-expert
``gate_proj``/``up_proj``/``down_proj``. Qwen3-MoE has no expert bias (``e_score_correction_bias``):
its routers export none and load with a zero bias.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lit_moe.model.families import ARCHITECTURES

FAMILIES = ("qwen3_moe", "glm4_moe")
# families whose Hugging Face router has no e_score_correction_bias
NO_EXPERT_BIAS = ("qwen3_moe",)


def exports_expert_bias(config: Any) -> bool:
    return config.model_type not in NO_EXPERT_BIAS


def _hf_act(c: Any) -> str:
    if c.hidden_act == "gelu":
        return "gelu_pytorch_tanh" if c.gelu_approximate == "tanh" else "gelu"
    return "silu"


def export_problems(c: Any) -> list[str]:
    """Why ``c`` (a ``qwen3_moe`` / ``glm4_moe`` config) has no Hugging Face equivalent of its family."""
    name = {"qwen3_moe": "Qwen3-MoE", "glm4_moe": "GLM-4-MoE"}[c.model_type]
    p = []

    def need(ok: bool, field: str, why: str) -> None:
        if not ok:
            p.append(f"model.{field}: {getattr(c, field)!r} ({why})")

    need(not c.multi_latent_attention, "multi_latent_attention", f"Hugging Face {name} uses grouped-query attention")
    need(c.normalization == "RMSNorm", "normalization", f"Hugging Face {name} uses RMSNorm")
    need(c.position_embedding_type == "rope", "position_embedding_type", "only plain RoPE is exported")
    need(not c.nope_layer_interval, "nope_layer_interval", "every Hugging Face layer uses RoPE")
    need(c.window_size is None, "window_size", "no sliding windows are exported")
    need(c.moe_layer_freq == 1, "moe_layer_freq", "Hugging Face supports 1")
    if c.model_type == "qwen3_moe":
        need(c.qk_layernorm, "qk_layernorm", "Hugging Face Qwen3-MoE always normalises q and k")
        need(c.partial_rotary_factor == 1.0, "partial_rotary_factor", "Qwen3-MoE rotates whole heads")
        if c.n_routed_experts:
            need(c.scoring_func == "softmax", "scoring_func", "Qwen3-MoE routes with softmax")
            need(not c.moe_router_enable_expert_bias, "moe_router_enable_expert_bias", "Qwen3-MoE has no expert bias")
            need(c.n_shared_experts == 0, "n_shared_experts", "Qwen3-MoE has no shared experts")
            need(c.routed_scaling_factor == 1.0, "routed_scaling_factor",
                 "Hugging Face Qwen3-MoE does not scale the combine weights")
            need(not c.group_limited, "n_group", "Qwen3-MoE routes without expert groups")
    else:
        need(c.scoring_func == "sigmoid" or not c.n_routed_experts, "scoring_func", "GLM-4-MoE routes with sigmoid")
        if c.n_routed_experts and c.shared_expert_intermediate_size != c.n_shared_experts * c.moe_intermediate_size:
            p.append(f"model.moe_shared_expert_intermediate_size: {c.moe_shared_expert_intermediate_size!r} "
                     "(Hugging Face uses n_shared_experts * moe_intermediate_size)")
    return p


def hf_config_dict(c: Any, dtype: Optional[torch.dtype]) -> dict[str, Any]:
    """The ``config.json`` of ``c``'s family (plus our full config under ``lit_moe``); the caller checked
    :func:`export_problems`."""
    d: dict[str, Any] = {
        "architectures": [ARCHITECTURES[c.model_type]], "model_type": c.model_type,
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "moe_intermediate_size": c.moe_intermediate_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.kv_heads,
        "head_dim": c.gqa_head_dim, "num_experts_per_tok": c.num_experts_per_tok,
        "norm_topk_prob": c.norm_topk_prob, "hidden_act": _hf_act(c),
        "max_position_embeddings": c.max_position_embeddings, "initializer_range": c.initializer_range,
        "rms_norm_eps": c.rms_norm_eps, "attention_bias": c.attention_bias,
        "attention_dropout": c.attention_dropout, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id,
        "torch_dtype": str(dtype or c.torch_dtype("params_dtype")).replace("torch.", ""),
    }
    if c.model_type == "qwen3_moe":
        d.update({"num_experts": c.n_routed_experts or 0, "decoder_sparse_step": 1,
                  "mlp_only_layers": list(range(c.first_k_dense_replace)),
                  "router_aux_loss_coef": c.moe_aux_loss_coeff, "use_sliding_window": False})
    else:
        dense_only = not c.n_routed_experts
        d["rope_parameters"]["partial_rotary_factor"] = c.partial_rotary_factor
        d.update({"n_routed_experts": c.n_routed_experts or 1, "n_shared_experts": c.n_shared_experts,
                  "routed_scaling_factor": c.routed_scaling_factor,
                  "n_group": c.n_group if c.group_limited else 1,
                  "topk_group": c.topk_group if c.group_limited else 1,
                  "first_k_dense_replace": c.num_hidden_layers if dense_only else c.first_k_dense_replace,
                  "use_qk_norm": c.qk_layernorm, "num_nextn_predict_layers": c.num_nextn_predict_layers})
    d["lit_moe"] = c.to_dict()
    return d


# Hugging Face keys of these families that are not our field names: key -> (field, value -> value)
_QWEN3_KEYS = {"num_experts": "n_routed_experts", "router_aux_loss_coef": "moe_aux_loss_coeff"}
_GLM4_KEYS = {"use_qk_norm": "qk_layernorm"}
def section_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face ``config.json`` of a family as our model section (errors name the key)."""
    from lit_moe.config import ConfigError

    kind = hf["model_type"]
    out = dict(hf)
    renames = _QWEN3_KEYS if kind == "qwen3_moe" else _GLM4_KEYS
    for key, field in renames.items():
        if key in out:
            out[field] = out.pop(key)
    for key in ("sliding_window", "max_window_layers"):
        out.pop(key, None)
    if kind == "qwen3_moe":
        if out.pop("use_sliding_window", False):
            raise ConfigError("config.json: use_sliding_window=True is not supported for Qwen3-MoE")
        step = out.pop("decoder_sparse_step", 1)
        if step != 1:
            raise ConfigError(f"config.json: decoder_sparse_step={step!r} is not supported (1: every layer MoE)")
        dense = sorted(out.pop("mlp_only_layers", None) or [])
        if dense != list(range(len(dense))):
            raise ConfigError(f"config.json: mlp_only_layers={dense!r} is not supported; only a dense prefix "
                              "[0, 1, ..., k-1] (first_k_dense_replace)")
        out["first_k_dense_replace"] = len(dense)
    return out


# ----------------------------------------------------------------------------------------------
# DeepSeek-V3.2 (transformers' DeepseekV32Config): DeepSeek-V3's config.json and tensors plus the
# lightning indexer's sizes and weights (``self_attn.indexer.{wq_b,wk,k_norm,weights_proj}``, spelled as
# Hugging Face spells them: lit_moe's module names are Hugging Face's)
# ----------------------------------------------------------------------------------------------
SPARSE_MLA = "deepseek_v32"


def sparse_mla_config_dict(d: dict[str, Any], c: Any) -> dict[str, Any]:
    """DeepSeek-V3's ``config.json`` ``d`` of a model with the indexer (``c.sparse_attention``) as DeepSeek-V3.2's."""
    d.update({"architectures": [ARCHITECTURES[SPARSE_MLA]], "model_type": SPARSE_MLA, "index_topk": c.index_topk,
              "index_n_heads": c.index_n_heads, "index_head_dim": c.index_head_dim})
    return d


def sparse_mla_section(hf: dict[str, Any]) -> dict[str, Any]:
    """A DeepSeek-V3.2 ``config.json`` (transformers' keys) as our model section (errors name the key)."""
    from lit_moe.config import ConfigError

    out = {k: v for k, v in hf.items() if k not in ("layer_types", "mlp_layer_types", "mlp_bias")}
    kinds = set(hf.get("layer_types") or ["indexed_attention"])
    if kinds != {"indexed_attention"}:
        raise ConfigError(f"config.json: layer_types={hf['layer_types']!r} is not supported (every layer indexed)")
    if hf.get("mlp_bias"):
        raise ConfigError("config.json: mlp_bias=True is not supported (DeepSeek-V3.2's MLPs have no bias)")
    mlp = hf.get("mlp_layer_types")
    if mlp is not None:
        dense = mlp.count("dense")
        if mlp != ["dense"] * dense + ["sparse"] * (len(mlp) - dense):
            raise ConfigError(f"config.json: mlp_layer_types={mlp!r} is not supported; only a dense prefix "
                              "(first_k_dense_replace)")
        out["first_k_dense_replace"] = dense
    return out
