"""Model families: each one a set of defaults for the fields of ``DeepseekV3Config`` that a section of
that ``model_type`` leaves out (the values of the family's Hugging Face config class where a field
means the same). A leaf module (the config imports it).

| family | attention | router | experts |
|---|---|---|---|
| ``deepseek_v3`` | MLA | sigmoid, group-limited, expert bias | shared + routed, dense prefix |
| ``qwen3_moe`` | GQA, per-head q/k RMSNorm, full RoPE | softmax top-k (optionally renormalised) | routed only |
| ``glm4_moe`` | GQA, partial RoPE (0.5), optional q/k norm and q/k/v bias | sigmoid, group-limited, expert bias | shared + routed, dense prefix |
| ``deepseek_v32`` | MLA + lightning indexer (top-k keys per query) | as ``deepseek_v3`` | as ``deepseek_v3`` |
| ``deepseek_v4`` | V4 (sliding + CSA/HCA compressed keys, sinks), or MLA | sqrt-softplus + expert bias; hash-routed first layers | shared + routed, SwiGLU clamp; mHC residual |
"""

from __future__ import annotations

from typing import Any

FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    # transformers' Qwen3MoeConfig: no shared experts, softmax routing without bias or groups, every layer MoE
    "qwen3_moe": {
        "architectures": "Qwen3MoeForCausalLM", "multi_latent_attention": False, "qk_layernorm": True,
        "n_shared_experts": 0, "scoring_func": "softmax", "moe_router_enable_expert_bias": False,
        "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "first_k_dense_replace": 0,
        "norm_topk_prob": False, "moe_router_load_balancing_type": "aux_loss",
    },
    # transformers' Glm4MoeConfig: DeepSeek-V3's router and shared experts under GQA with half-rotary heads
    "glm4_moe": {
        "architectures": "Glm4MoeForCausalLM", "multi_latent_attention": False, "qk_layernorm": False,
        "partial_rotary_factor": 0.5, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1, "rms_norm_eps": 1e-5,
    },
    # transformers' DeepseekV32Config: DeepSeek-V3 with the lightning indexer on every MLA (sparse stage)
    "deepseek_v32": {
        "architectures": "DeepseekV32ForCausalLM", "experimental_attention_variant": "dsa", "index_topk": 2048,
        "index_n_heads": 64, "index_head_dim": 128, "dsa_indexer_use_sparse_loss": True,
    },
    # transformers' DeepseekV4Config: V4 attention, mHC residual streams, hash-routed first layers, all MoE
    "deepseek_v4": {
        "architectures": "DeepseekV4ForCausalLM", "experimental_attention_variant": "dsv4_hybrid",
        "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43, "num_attention_heads": 64,
        "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024, "partial_rotary_factor": 64 / 512,
        "num_experts_per_tok": 6, "n_routed_experts": 256, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0,
        "max_position_embeddings": 1048576, "enable_hyper_connections": True, "enable_hc_head": True,
        "num_hash_layers": 3, "swiglu_limit": 10.0, "position_embedding_type": "rope",
    },
}

V4_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
V4_DEFAULT_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def v4_layer_types_from_ratios(ratios: list) -> list:
    """Hugging Face's older per-layer ``compress_ratios`` (0 / 4 / 128) as ``layer_types``."""
    by_ratio = {0: V4_LAYER_TYPES[0], 4: V4_LAYER_TYPES[1], 128: V4_LAYER_TYPES[2]}
    from lit_moe.config import ConfigError

    bad = [r for r in ratios if r not in by_ratio]
    if bad:
        raise ConfigError(f"model.compress_ratios: {bad[0]!r} is not supported; supported: 0, 4, 128")
    return [by_ratio[r] for r in ratios]


def v4_default_layer_types(n: int) -> list:
    """Hugging Face's default V4 schedule: two HCA layers, then CSA and HCA alternating."""
    rest = [V4_LAYER_TYPES[1] if i % 2 else V4_LAYER_TYPES[2] for i in range(max(n - 2, 0))]
    return [V4_LAYER_TYPES[2]] * min(n, 2) + rest

# model_type -> the Hugging Face architecture of the family
ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_mtp": "DeepseekV3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                 "deepseek_v32": "DeepseekV32ForCausalLM", "deepseek_v4": "DeepseekV4ForCausalLM"}
