"""Named model sections: the 8-card example of MindFormers' PyNative configuration guide and the published DeepSeek-V3 671B config."""

from __future__ import annotations

# The ``model:`` section of the complete 8-card pynative.yaml example (MindFormers' PyNative configuration guide, section 10), verbatim.
GUIDE_8CARD: dict = {
    "model_type": "deepseek_v3", "architectures": "DeepseekV3ForCausalLM", "vocab_size": 129280,
    "seq_length": 4096, "hidden_size": 1792, "intermediate_size": 3072, "num_hidden_layers": 16,
    "max_position_embeddings": 163840, "hidden_act": "silu", "num_attention_heads": 4,
    "rms_norm_eps": 1.e-6, "add_bias_linear": False, "use_flash_attention": True,
    "multi_latent_attention": True, "mla_qkv_concat": True, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 192, "qk_nope_head_dim": 128, "qk_layernorm": True,
    "attention_dropout": 0.0, "hidden_dropout": 0.0, "params_dtype": "float32",
    "compute_dtype": "bfloat16", "layernorm_compute_dtype": "float32", "softmax_compute_dtype": "float32",
    "rotary_dtype": "float32", "initializer_range": 0.01, "num_nextn_predict_layers": 0,
    "mtp_loss_scaling_factor": 0.3, "position_embedding_type": "yarn", "scaling_factor": 40,
    "beta_fast": 32, "beta_slow": 1, "mscale": 1, "mscale_all_dim": 1, "rope_theta": 10000,
    "router_dense_type": "float32", "gated_linear_unit": True, "moe_intermediate_size": 1024,
    "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "n_routed_experts": 8,
    "num_experts_per_tok": 4, "n_shared_experts": 1, "moe_shared_expert_intermediate_size": 1024,
    "moe_token_dispatcher_type": "alltoall", "moe_grouped_gemm": True,
    "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 0.01,
    "scoring_func": "sigmoid", "norm_topk_prob": True, "moe_token_drop_policy": "probs",
    "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.001, "use_pad_tokens": True,
    "topk_group": 2, "n_group": 4,
}

# deepseek-ai/DeepSeek-V3 config.json (Hugging Face hub), without its fp8 quantization_config.
DEEPSEEK_V3_671B: dict = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_nextn_predict_layers": 1, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "ep_size": 1,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "aux_loss_alpha": 0.001, "seq_aux": True,
    "hidden_act": "silu", "max_position_embeddings": 163840, "initializer_range": 0.02,
    "rms_norm_eps": 1e-06, "use_cache": True, "pad_token_id": None, "bos_token_id": 0,
    "eos_token_id": 1, "pretraining_tp": 1, "tie_word_embeddings": False, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "attention_dropout": 0.0, "torch_dtype": "bfloat16",
}
