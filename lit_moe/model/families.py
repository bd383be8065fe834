"""Model families: each one a set of defaults for the fields of ``DeepseekV3Config`` that a section of
that ``model_type`` leaves out (the values of the family's Hugging Face config class where a field
means the same). A leaf module (the config imports it).

| family | attention | router | experts |
|---|---|---|---|
| ``deepseek_v3`` | MLA | sigmoid, group-limited, expert bias | shared + routed, dense prefix |
| ``qwen3_moe`` | GQA, per-head q/k RMSNorm, full RoPE | softmax top-k (optionally renormalised) | routed only |
| ``glm4_moe`` | GQA, partial RoPE (0.5), optional q/k norm and q/k/v bias | sigmoid, group-limited, expert bias | shared + routed, dense prefix |
| ``deepseek_v32`` | MLA + lightning indexer (top-k keys per query) | as ``deepseek_v3`` | as ``deepseek_v3`` |
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
}

# model_type -> the Hugging Face architecture of the family
ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_mtp": "DeepseekV3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                 "deepseek_v32": "DeepseekV32ForCausalLM"}
