"""param_counts / flops_per_token against deepseek_math.md §7 and against transformers' own parameter count."""

import time

import pytest
import torch

from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM, MoE, flops_per_token, param_counts
from lit_moe.model.presets import DEEPSEEK_V3_671B, GUIDE_8CARD


def test_seed_config_builds_on_meta_quickly_and_counts_like_hugging_face():
    start = time.process_time()   # this process's CPU time: a busy machine does not inflate it
    with torch.device("meta"):
        m = DeepseekV3ForCausalLM(GUIDE_8CARD)
    assert time.process_time() - start < 30
    assert sum(p.numel() for p in m.parameters()) == 1_335_275_264
    assert param_counts(GUIDE_8CARD).total == 1_335_275_264


def test_hugging_face_counts_the_seed_config_the_same():
    import transformers  # the judge: a hard test dependency (pyproject [test])
    from lit_moe.hf.checkpoint import hf_config_dict

    cfg = hf_config_dict(DeepseekV3Config(**GUIDE_8CARD))
    cfg.pop("lit_moe")
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**cfg))
    assert sum(p.numel() for p in hf.parameters()) == 1_335_275_264


def test_deepseek_v3_671b_counts_and_flops():
    c = param_counts(DEEPSEEK_V3_671B)
    assert c.total == 671_026_404_352 and f"{c.total / 1e9:.1f}B" == "671.0B"
    assert c.active == 37_552_282_624 and f"{c.active / 1e9:.1f}B" == "37.6B"
    assert c.mtp == 11_610_067_968
    no_mtp = {**DEEPSEEK_V3_671B, "num_nextn_predict_layers": 0}
    assert flops_per_token(no_mtp, 4096) / 1e9 == pytest.approx(249.81, abs=0.005)
    assert flops_per_token(DEEPSEEK_V3_671B, 4096) / 1e9 == pytest.approx(259.99, abs=0.005)
    assert flops_per_token(no_mtp, 4096, training=False) * 3 == pytest.approx(flops_per_token(no_mtp, 4096))


TINY = dict(vocab_size=50, hidden_size=16, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=3,
            num_attention_heads=2, kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=4,
            v_head_dim=6, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
            first_k_dense_replace=1, max_position_embeddings=32)


@pytest.mark.parametrize("variant", [
    {}, {"q_lora_rank": None}, {"normalization": "LayerNorm"},
    {"position_embedding_type": "learned_absolute", "seq_length": 32},   # a table as long as the sequence
    {"num_nextn_predict_layers": 2}, {"n_shared_experts": 0}, {"n_routed_experts": 0},
    {"moe_layer_freq": 2}, {"qk_layernorm": False}, {"moe_shared_expert_intermediate_size": 12},
], ids=lambda v: ",".join(v) or "base")
def test_counts_match_the_built_model(variant):
    cfg = {**TINY, **variant}
    with torch.device("meta"):
        m = DeepseekV3ForCausalLM(cfg)
    c = param_counts(cfg)
    assert c.total_with_mtp == sum(p.numel() for p in m.parameters())
    main_moes = [layer.mlp for layer in m.layers if isinstance(layer.mlp, MoE)]
    experts = sum(moe.experts.gate_up_proj.numel() + moe.experts.down_proj.numel() for moe in main_moes)
    assert c.active == c.total - experts // 2          # K=2 of E=4 experts are used per token


def test_sliding_window_flops_hand_case():
    cfg = {**TINY, "num_hidden_layers": 1, "first_k_dense_replace": 1, "n_routed_experts": 0}
    full = flops_per_token(cfg, 8)
    win = flops_per_token({**cfg, "window_size": (1, 0)}, 8)
    # keys per query with a left window of 1: 1,2,2,2,2,2,2,2 -> s_eff = 2*15/8 = 3.75 instead of 8
    per_key = 6 * (2 * 8 / 2 + 2 * 6 / 2)
    assert full - win == pytest.approx(per_key * (8 - 3.75))
