"""DeepseekV3Config: seed / Hugging Face / MindFormers names, unknown keys, and every validation error."""

import logging

import pytest
import torch

from lit_moe.config import NO_EFFECT_KEYS, ConfigError
from lit_moe.model import DeepseekV3Config
from lit_moe.model.presets import DEEPSEEK_V3_671B, GUIDE_8CARD

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
             num_attention_heads=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
             v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
             first_k_dense_replace=1)


def test_seed_model_section_is_accepted_as_written(caplog):
    with caplog.at_level(logging.WARNING, logger="lit_moe.model.config"):
        c = DeepseekV3Config(**GUIDE_8CARD)
    assert "unknown" not in caplog.text
    assert c.position_embedding_type == "yarn" and c.scaling_factor == 40.0 and isinstance(c.scaling_factor, float)
    assert c.yarn_original_length == 4096            # seq_length: the MindFormers default for L0
    assert c.shared_expert_intermediate_size == 1024 and c.qk_head_dim == 192
    assert c.torch_dtype("compute_dtype") is torch.bfloat16 and c.torch_dtype("router_dense_type") is torch.float32
    assert [c.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert c.total_layers == 16 and c.group_limited


def test_hugging_face_names_and_rope_scaling_dict():
    c = DeepseekV3Config(**DEEPSEEK_V3_671B)
    assert (c.position_embedding_type, c.scaling_factor, c.original_max_position_embeddings) == ("yarn", 40.0, 4096)
    assert (c.beta_fast, c.beta_slow, c.mscale, c.mscale_all_dim) == (32, 1, 1.0, 1.0)
    assert c.moe_aux_loss_coeff == 0.001            # aux_loss_alpha
    assert c.num_nextn_predict_layers == 1 and c.architectures == "DeepseekV3ForCausalLM"
    # transformers v5 spelling
    c5 = DeepseekV3Config(**SMALL, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e4,
                                                     "original_max_position_embeddings": 128})
    assert (c5.position_embedding_type, c5.scaling_factor, c5.rope_theta, c5.yarn_original_length) == (
        "yarn", 4.0, 5e4, 128)


def test_mindformers_aliases_map_to_canonical_names():
    c = DeepseekV3Config(**{**{k: v for k, v in SMALL.items() if k not in ("num_hidden_layers", "n_routed_experts")},
                            "num_layers": 3, "num_moe_experts": 8, "moe_router_topk": 2,
                            "rotary_scaling_factor": 8, "layernorm_epsilon": 1e-5, "moe_router_dtype": "fp32",
                            "mtp_num_layers": 2, "init_method_std": 0.01, "qk_head_dim": 16})
    assert (c.num_hidden_layers, c.n_routed_experts, c.num_experts_per_tok) == (3, 8, 2)
    assert (c.scaling_factor, c.rms_norm_eps, c.router_dense_type) == (8.0, 1e-5, "float32")
    assert (c.num_nextn_predict_layers, c.initializer_range) == (2, 0.01)
    with pytest.raises(ConfigError, match=r"num_layers: 3 conflicts with model.num_hidden_layers: 4"):
        DeepseekV3Config(**SMALL, num_layers=3)


def test_unknown_keys_are_errors_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"^model\.num_hidden_layer: unknown key \(did you mean "
                                          r"'num_hidden_layers'\?\)"):
        DeepseekV3Config(**SMALL, num_hidden_layer=3)
    with pytest.raises(ConfigError, match=r"^model\.my_extra_key: unknown key;"):
        DeepseekV3Config(**SMALL, my_extra_key=1)
    with pytest.raises(ConfigError, match=r"model\.model_config: .*lit_moe convert-config"):
        DeepseekV3Config(**SMALL, model_config={"num_layers": 2})


def test_keys_accepted_without_effect_come_from_the_one_list():
    """Every ``model.*`` entry of NO_EFFECT_KEYS is accepted and changes nothing; a documented no-effect
    key that is also a field keeps its default meaning."""
    extra = {k[len("model."):] for k in NO_EFFECT_KEYS if k.startswith("model.")}
    fields = set(DeepseekV3Config().to_dict())
    plain = DeepseekV3Config(**SMALL)
    checked = {"chunk_loss_num": 2, "embedding_params_dtype": "float32"}   # values these keys accept
    with_extras = DeepseekV3Config(**SMALL, **{k: checked.get(k, "x") for k in extra - fields})
    assert with_extras == plain
    assert extra & fields == {"mla_qkv_concat", "topk_method", "num_key_value_heads"}


def test_yaml_strings_and_normalisation():
    c = DeepseekV3Config(**{**SMALL, "rms_norm_eps": "1e-6", "window_size": "(10, 0)", "q_lora_rank": 0,
                            "compute_dtype": "bf16", "hidden_act": "gelu_pytorch_tanh"})
    assert c.rms_norm_eps == 1e-6 and c.window_size == (10, 0) and c.q_lora_rank is None
    assert c.compute_dtype == "bfloat16" and (c.hidden_act, c.gelu_approximate) == ("gelu", "tanh")
    assert DeepseekV3Config(**c.to_dict()) == c


def test_layer_patterns():
    c = DeepseekV3Config(**{**SMALL, "num_hidden_layers": 12}, nope_layer_interval=4)
    # four rotary layers between consecutive layers without position encoding (MindFormers' training-features guide)
    assert [i for i in range(12) if not c.uses_rope(i)] == [4, 9]
    c = DeepseekV3Config(**SMALL, window_size=[3, 0], window_attn_skip_freq=2)
    assert [c.uses_window(i) for i in range(4)] == [True, False, True, False]   # (N-1):1 with N=2
    c = DeepseekV3Config(**SMALL, window_size=3, window_attn_skip_freq=[1, 1, 0, 1], num_nextn_predict_layers=1)
    assert [c.uses_window(i) for i in range(5)] == [True, True, False, True, True]
    assert DeepseekV3Config(**SMALL, window_size=(4, -1)).uses_window(2)
    c = DeepseekV3Config(**SMALL, moe_layer_freq=2)
    assert [c.is_moe_layer(i) for i in range(4)] == [False, False, True, False]
    assert DeepseekV3Config(**SMALL, position_embedding_type="none").uses_rope(0) is False


ERRORS = [
    (dict(n_routed_experts=6), r"model\.n_routed_experts: 6 must be divisible by n_group \(4\)"),
    (dict(topk_group=5), r"model\.topk_group: 5 must be in \[1, n_group=4\]"),
    (dict(num_experts_per_tok=9), r"model\.num_experts_per_tok: 9 must not exceed n_routed_experts \(8\)"),
    (dict(num_experts_per_tok=5, topk_group=2), r"model\.num_experts_per_tok: 5 cannot be chosen from topk_group=2"),
    (dict(n_group=8, topk_group=4), r"model\.n_group: 8 leaves 1 expert per group"),
    (dict(v_head_dim=17), r"model\.v_head_dim: 17 must not exceed qk_nope_head_dim \+ qk_rope_head_dim \(16\)"),
    (dict(num_attention_heads=0), r"model\.num_attention_heads: 0 must be >= 1"),
    (dict(first_k_dense_replace=5), r"model\.first_k_dense_replace: 5 must be in \[0, num_hidden_layers=4\]"),
    (dict(first_k_dense_replace=-1), r"model\.first_k_dense_replace: -1"),
    (dict(position_embedding_type="alibi"), r"model\.position_embedding_type: 'alibi' is not supported; "
                                            r"supported: 'rope', 'yarn', 'none', 'learned_absolute'"),
    (dict(hidden_act="relu"), r"model\.hidden_act: 'relu' is not supported; supported: 'gelu', 'silu', 'fusedswiglu'"),
    (dict(normalization="BatchNorm"), r"model\.normalization: 'BatchNorm' is not supported; supported: 'RMSNorm', 'LayerNorm'"),
    (dict(fused_norm=False), r"model\.fused_norm: False .*only fused normalization"),
    (dict(scoring_func="relu"), r"model\.scoring_func: 'relu'"),
    (dict(scoring_func="softmax"), r"model\.moe_router_enable_expert_bias: True needs scoring_func 'sigmoid'"),
    (dict(moe_router_load_balancing_type="sub_seq_aux_loss"), r"model\.moe_router_load_balancing_type: 'sub_seq_aux_loss'"),
    (dict(moe_token_drop_policy="random"), r"model\.moe_token_drop_policy: 'random'"),
    (dict(moe_expert_capacity_factor=0), r"model\.moe_expert_capacity_factor: 0\.0 must be None"),
    (dict(compute_dtype="float8"), r"model\.compute_dtype: unknown dtype 'float8'"),
    (dict(window_size=(4, 2)), r"model\.window_size: \(4, 2\) right size must be 0 or -1"),
    (dict(window_size="(4, x)"), r"model\.window_size: cannot parse '\(4, x\)'"),
    (dict(window_size=(1, 2, 3)), r"model\.window_size: \(1, 2, 3\) is not a pair"),
    (dict(window_size=4, window_attn_skip_freq=[1, 0]), r"model\.window_attn_skip_freq: \[1, 0\] has 2 entries"),
    (dict(window_size=4, window_attn_skip_freq=0), r"model\.window_attn_skip_freq: 0 must be >= 1"),
    (dict(nope_layer_interval=-2), r"model\.nope_layer_interval: -2"),
    (dict(position_embedding_type="yarn", scaling_factor=0.5), r"model\.scaling_factor: 0\.5 must be >= 1"),
    (dict(position_embedding_type="yarn", beta_fast=1, beta_slow=2), r"model\.beta_fast: 1\.0 must be greater than beta_slow"),
    (dict(qk_rope_head_dim=7), r"model\.qk_rope_head_dim: 7 must be a non-negative even number"),
    (dict(hidden_size="wide"), r"model\.hidden_size: expected int, got str \('wide'\)"),
    (dict(norm_topk_prob="yes"), r"model\.norm_topk_prob: expected bool"),
    (dict(tie_word_embeddings=True), r"model\.tie_word_embeddings: True is not supported"),
    (dict(multi_latent_attention=False, num_key_value_heads=3), r"model\.num_key_value_heads: 3 must be >= 1 and divide"),
    (dict(add_bias_linear=True), r"model\.add_bias_linear: True is not supported"),
    (dict(gated_linear_unit=False), r"model\.gated_linear_unit: False is not supported"),
    (dict(rope_scaling={"type": "linear", "factor": 2}), r"model\.rope_scaling\.type: 'linear' is not supported"),
    (dict(rope_scaling={"type": "yarn", "factor": 2, "low_freq_factor": 1}), r"model\.rope_scaling\.low_freq_factor: unknown key"),
    (dict(qk_head_dim=8), r"model\.qk_head_dim: 8 must equal qk_nope_head_dim \+ qk_rope_head_dim \(16\)"),
    (dict(model_type="llama"), r"model\.model_type: 'llama' is not supported"),
    (dict(moe_shared_expert_intermediate_size=16, n_shared_experts=0), r"model\.moe_shared_expert_intermediate_size: 16 is inconsistent"),
    (dict(attention_dropout=1.0), r"model\.attention_dropout: 1\.0 must be in \[0, 1\)"),
    (dict(num_nextn_predict_layers=-1), r"model\.num_nextn_predict_layers: -1 must be >= 0"),
    (dict(hidden_act="gelu", use_fused_swiglu=True), r"model\.use_fused_swiglu: True needs a SwiGLU activation"),
]


@pytest.mark.parametrize("overrides,message", ERRORS, ids=[m.split(":")[0].replace("model\\.", "") for _, m in ERRORS])
def test_inconsistent_values_raise_config_error_naming_field_and_value(overrides, message):
    with pytest.raises(ConfigError, match=message):
        DeepseekV3Config(**{**SMALL, **overrides})


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)
