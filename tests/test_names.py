"""MindFormers' parameter names in every pattern key, MindFormers' model and optimizer defaults, the keys
MindFormers reads differently, and ``--print_config`` refusing what ``fit`` refuses.

The references are tables written here from MindFormers' code (mindspore-ai/mindformers, the files named
in each comment), not lit_moe's output.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
import yaml

from lit_moe.config import ConfigError
from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM
from lit_moe.hf.checkpoint import hf_keys
from lit_moe.model.mindformers_defaults import KEPT, read_pynative_model_section
from lit_moe.model.names import spelled

ROOT = Path(__file__).resolve().parents[1]
TINY = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())["model"]


def tiny_model() -> DeepseekV3ForCausalLM:
    with torch.device("meta"):
        return DeepseekV3ForCausalLM(DeepseekV3Config(**TINY))


# ------------------------------------------------------------------------------------------------
# the name map
# ------------------------------------------------------------------------------------------------
# mindformers/models/deepseek3/utils.py DeepseekV3PreTrainedModel.weight_mapping: Hugging Face name
# parts → MindFormers' (Megatron-style tree), applied in order with str.replace (its MTP entries name
# the graph tree's single MTP layer and are left out).
MF_WEIGHT_MAPPING = [
    ('model.embed_tokens.', 'embedding.word_embeddings.'),
    ('.self_attn.q_a_proj.', '.self_attention.linear_q_down_proj.'),
    ('.self_attn.q_a_layernorm.', '.self_attention.q_layernorm.'),
    ('.self_attn.q_b_proj.', '.self_attention.linear_q_up_proj.'),
    ('.self_attn.kv_a_proj_with_mqa.', '.self_attention.linear_kv_down_proj.'),
    ('.self_attn.kv_a_layernorm.', '.self_attention.kv_layernorm.'),
    ('.self_attn.kv_b_proj.', '.self_attention.linear_kv_up_proj.'),
    ('.self_attn.o_proj.', '.self_attention.linear_proj.'),
    ('.gate.weight', '.router.weight'),
    ('.gate.e_score_correction_bias', '.router.expert_bias'),
    ('.post_attention_layernorm.', '.pre_mlp_layernorm.'),
    ('model.norm.', 'decoder.final_layernorm.'),
    ('lm_head.', 'output_layer.'),
    ('model.layers.', 'decoder.layers.'),
]


def _mindformers_name(hf_name: str) -> str:
    for old, new in MF_WEIGHT_MAPPING:
        hf_name = hf_name.replace(old, new)
    return hf_name


def test_spellings_agree_with_mindformers_weight_mapping_and_hugging_face_keys():
    model = tiny_model()
    L = model.config.num_hidden_layers
    checked = 0
    for name, p in model.named_parameters():
        hf = [k for k, _ in hf_keys(name, p.shape, L)]
        if len(hf) == 1:   # one Hugging Face tensor (experts are split per expert there)
            assert spelled(name, "huggingface", L) == hf[0], name
            if not name.startswith("mtp.") and ".mlp." not in name.replace(".mlp.router.", ""):
                assert spelled(name, "mindformers_megatron") == _mindformers_name(hf[0]), name
                checked += 1
    assert checked >= 20, checked   # embedding, head, final norm, every attention tensor and router


def test_spellings_follow_mindformers_pynative_module_tree():
    # mindformers/pynative: gpt_model.py (embedding.word_embeddings, decoder.layers, decoder.final_layernorm,
    # output_layer, mtp.layers[k].transformer_layer), multi_latent_attention.py MLASelfAttention (linear_qkv =
    # [q down | kv down], q_layernorm, linear_qb, k_layernorm, linear_kvb, linear_proj), mlp.py (linear_fc1 =
    # [gate | up], linear_fc2), moe/moe_layer.py (router, experts.weight1/weight2, expert_bias on the layer)
    expected = {
        "embed_tokens.weight": "embedding.word_embeddings.weight",
        "layers.0.self_attention.q_a_proj.weight": "decoder.layers.0.self_attention.linear_qkv.weight",
        "layers.0.self_attention.kv_a_proj_with_mqa.weight": "decoder.layers.0.self_attention.linear_qkv.weight",
        "layers.0.self_attention.q_a_layernorm.weight": "decoder.layers.0.self_attention.q_layernorm.weight",
        "layers.0.self_attention.q_b_proj.weight": "decoder.layers.0.self_attention.linear_qb.weight",
        "layers.0.self_attention.kv_a_layernorm.weight": "decoder.layers.0.self_attention.k_layernorm.weight",
        "layers.0.self_attention.kv_b_proj.weight": "decoder.layers.0.self_attention.linear_kvb.weight",
        "layers.0.self_attention.o_proj.weight": "decoder.layers.0.self_attention.linear_proj.weight",
        "layers.0.mlp.gate_proj.weight": "decoder.layers.0.mlp.linear_fc1.weight",
        "layers.0.mlp.up_proj.weight": "decoder.layers.0.mlp.linear_fc1.weight",
        "layers.0.mlp.down_proj.weight": "decoder.layers.0.mlp.linear_fc2.weight",
        "layers.1.mlp.router.weight": "decoder.layers.1.mlp.router.weight",
        "layers.1.mlp.router.expert_bias": "decoder.layers.1.mlp.expert_bias",
        "layers.1.mlp.experts.gate_up_proj": "decoder.layers.1.mlp.experts.weight1",
        "layers.1.mlp.experts.down_proj": "decoder.layers.1.mlp.experts.weight2",
        "layers.1.mlp.shared_experts.up_proj.weight": "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
        "layers.1.mlp.shared_experts.down_proj.weight": "decoder.layers.1.mlp.shared_experts.linear_fc2.weight",
        "layers.1.pre_mlp_layernorm.weight": "decoder.layers.1.pre_mlp_layernorm.weight",
        "norm.weight": "decoder.final_layernorm.weight",
        "lm_head.weight": "output_layer.weight",
        "mtp.0.eh_proj.weight": "mtp.layers.0.eh_proj.weight",
        "mtp.0.layer.self_attention.o_proj.weight": "mtp.layers.0.transformer_layer.self_attention.linear_proj.weight",
    }
    assert {n: spelled(n, "mindformers") for n in expected} == expected


# ------------------------------------------------------------------------------------------------
# optimizer rules
# ------------------------------------------------------------------------------------------------
def _groups(section: dict) -> dict[str, set[str]]:
    from lit_moe.optim.optimizers import param_groups, validate_optimizer_section

    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**TINY, "num_hidden_layers": 2}))
    groups = param_groups(model.named_parameters(), validate_optimizer_section(section), 1e-3)
    return {g["name"]: set(g["param_names"]) for g in groups}


def test_muon_adamw_include_in_mindformers_names_sends_embedding_and_head_to_adamw():
    # the silently wrong case of issue 31: MindFormers' DeepSeek-V4 test config writes these globs
    for section in ({"type": "Muon", "adamw_include": ["*word_embeddings*", "*output_layer*"]}, {"type": "Muon"}):
        groups = _groups(section)
        adamw = set().union(*(v for k, v in groups.items() if k.startswith("adamw.")))
        muon = set().union(*(v for k, v in groups.items() if k.startswith("muon.")))
        assert {"embed_tokens.weight", "lm_head.weight"} <= adamw, section
        assert "layers.0.self_attention.q_a_proj.weight" in muon
    # MindFormers' fused q/kv down-projection name selects both lit_moe matrices
    groups = _groups({"type": "Muon", "adamw_include": ["*linear_qkv*", "*output_layer*", "*word_embeddings*"]})
    muon = set().union(*(v for k, v in groups.items() if k.startswith("muon.")))
    assert not any("q_a_proj" in n or "kv_a_proj_with_mqa" in n for n in muon)
    assert "layers.0.self_attention.q_b_proj.weight" in muon


def test_weight_decay_rules_take_mindformers_names():
    groups = _groups({"weight_decay_exclude": ["word_embeddings"], "weight_decay_include": ["*layernorm*"]})
    assert "embed_tokens.weight" in groups["adamw.no_decay"]
    assert "layers.0.self_attention.q_a_layernorm.weight" in groups["adamw.decay"]   # MF: q_layernorm
    assert "norm.weight" in groups["adamw.decay"]   # MF: decoder.final_layernorm


@pytest.mark.parametrize("section, key", [
    ({"weight_decay_exclude": ["word_embedingz"]}, "optimizer.weight_decay_exclude"),
    ({"weight_decay_include": ["*.bias"]}, "optimizer.weight_decay_include"),   # DeepSeek-V3 has no biases
    ({"type": "Muon", "adamw_include": ["*embeddings_typo*"]}, "optimizer.adamw_include"),
])
def test_a_rule_matching_no_parameter_is_one_line_naming_key_rule_and_nearest(section, key):
    from lit_moe.optim.optimizers import check_rules, validate_optimizer_section

    names = [n for n, _ in tiny_model().named_parameters()]
    with pytest.raises(ConfigError) as err:
        check_rules(validate_optimizer_section(section), names)
    msg = str(err.value)
    rule = next(iter(v for k, v in section.items() if k != "type"))[0]
    assert msg.startswith(f"{key}: {rule!r} matches no parameter") and "nearest:" in msg and "\n" not in msg, msg


def test_name_rules_are_checked_before_training_and_by_print_config(tmp_path, capsys):
    from lit_moe.cli import main

    def run(*extra: str) -> tuple[int, str]:
        code = main(["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), *extra, "--print_config"])
        return code, capsys.readouterr().err.strip().splitlines()[-1] if code else ""

    assert run("--monitor.train_state.local_norm", "embedding")[0] == 0   # MindFormers' filter
    code, line = run("--monitor.train_state.local_norm", "embeddingz")
    assert code == 2 and line.startswith("lit_moe: error: monitor.train_state.local_norm: 'embeddingz'"), line
    assert "embed_tokens.weight (= embedding.word_embeddings.weight)" in line


# ------------------------------------------------------------------------------------------------
# --print_config validates the sections fit validates
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, key", [
    (("--model.hidden_size", "-3"), "model.hidden_size"),
    (("--optimizer.type", "Adam"), "optimizer.type"),
    (("--optimizer.betas", "[0.9, 1.5]"), "optimizer.betas"),
    (("--lr_scheduler.type", "Nope"), "lr_scheduler.type"),
    (("--lr_scheduler.warmup_ratio", "2.0"), "lr_scheduler.warmup_ratio"),
    (("--training.steps", "0"), "training.steps"),
])
def test_print_config_exits_with_fits_one_line_error(capsys, override, key):
    from lit_moe.cli import main

    code = main(["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), *override, "--print_config"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(f"lit_moe: error: {key}"), err
    assert capsys.readouterr().out == ""


# ------------------------------------------------------------------------------------------------
# LoRA, recompute and monitor patterns
# ------------------------------------------------------------------------------------------------
def test_lora_patterns_take_mindformers_and_hugging_face_names():
    from lit_moe.lora import apply_lora

    adapted = apply_lora(tiny_model(), {"target_modules": r"linear_qkv|linear_kvb", "exclude_layers": r"mtp\."})
    assert sorted(adapted) == sorted(f"layers.{i}.self_attention.{m}" for i in range(3)
                                     for m in ("q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj"))
    # MindFormers matches cell paths from its top cell (``model.decoder...``); Hugging Face's self_attn
    assert apply_lora(tiny_model(), {"target_modules": r"^model\.decoder\.layers\.0\.self_attention\.linear_qb$"}) \
        == ["layers.0.self_attention.q_b_proj"]
    assert apply_lora(tiny_model(), {"target_modules": r"model\.layers\.3\.self_attn\.o_proj"}) \
        == ["mtp.0.layer.self_attention.o_proj"]
    with pytest.raises(ConfigError, match=r"lora_config.target_modules: 'linear_qkvz' matches no linear .*nearest"):
        apply_lora(tiny_model(), {"target_modules": "linear_qkvz"})


def test_recompute_select_module_takes_mindformers_names():
    from lit_moe.strategies.recompute import apply_recompute, regions

    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**TINY, "num_hidden_layers": 2}))
    apply_recompute(model, {"mode": "select", "select_module": {r"self_attention\.linear_kvb": [0],
                                                               r"mlp\.linear_fc1": [0]}}, None)
    wrapped = {f"{i}.{n}" for i, b in enumerate(model.blocks()) for n, m in b.named_modules() if regions(m)}
    assert wrapped == {"0.self_attention.kv_b_proj", "0.mlp.gate_proj", "0.mlp.up_proj"}
    with pytest.raises(ConfigError, match=r"recompute.select_module: 'self_attention\\\\.linear_kvbz' matches no module .*nearest: "
                                          r"self_attention\.kv_b_proj \(= self_attention\.linear_kvb\)"):
        apply_recompute(DeepseekV3ForCausalLM(DeepseekV3Config(**TINY)),
                        {"mode": "select", "select_module": {r"self_attention\.linear_kvbz": [0]}}, None)


def test_train_state_filter_takes_mindformers_names():
    from lit_moe.callbacks.train_state import TrainStateMonitor

    mon = TrainStateMonitor(local_norm=["embedding", "output_layer"])
    assert mon._match("embed_tokens.weight", mon.local_norm) and mon._match("lm_head.weight", mon.local_norm)
    assert not mon._match("layers.0.input_layernorm.weight", mon.local_norm)


# ------------------------------------------------------------------------------------------------
# model defaults: every field against MindFormers'
# ------------------------------------------------------------------------------------------------
# MindFormers' effective default of every field for a PyNative DeepSeek-V3 model section. Sources:
#   D = mindformers/models/deepseek3/configuration_deepseek_v3.py DeepseekV3Config.__init__
#   R = the same class's register_mf_model_parameter(...) defaults
#   T = mindformers/parallel_core/transformer_config.py TransformerConfig / MLATransformerConfig
#       (reached through config_converter_deepseek_v3.py's mapping of the Hugging Face names)
#   G = mindformers/pynative/base_models/gpt/gpt_model.py (what the PyNative model reads)
MINDFORMERS = {
    "model_type": "deepseek_v3",                   # D (model_type)
    "architectures": None,                         # pynative/config/config.py ModelConfig
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128,                        # D
    "num_key_value_heads": 128,                    # D
    "seq_length": 4096,                            # R
    "multi_latent_attention": True,                # R
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128,                             # D
    "qk_layernorm": False,                         # T (gpt_layer_specs: IdentityOp latent norms)
    "mla_qkv_concat": True,                        # T
    "attention_bias": False,                       # D
    "add_bias_linear": False,                      # R
    "use_flash_attention": True,                   # R
    "use_eod_attn_mask_compression": False,        # T
    "attention_dropout": 0.0,                      # D
    "hidden_dropout": 0.0,                         # R
    "window_size": None, "window_attn_skip_freq": None,                         # T
    "position_embedding_type": "rope",             # T
    "rope_theta": 10000.0,                         # D
    "max_position_embeddings": 4096,               # D
    "scaling_factor": 40.0,                        # T rotary_scaling_factor
    "original_max_position_embeddings": 4096,      # G: YaRN's original length is max_position_embeddings
    "beta_fast": 32.0, "beta_slow": 1.0,           # T
    "mscale": 0.707, "mscale_all_dim": 0.707,      # T
    "nope_layer_interval": None,                   # T
    "use_fused_rope": False,                       # T apply_rope_fusion
    "normalization": "RMSNorm",                    # R
    "fused_norm": True,                            # T
    "rms_norm_eps": 1e-6,                          # D
    "hidden_act": "silu",                          # D
    "gated_linear_unit": True,                     # R
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,   # D
    "moe_shared_expert_intermediate_size": None,   # T
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4,   # D
    "scoring_func": "sigmoid",                     # R moe_router_score_function (D's scoring_func is deleted)
    "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 2.5,  # D
    "moe_router_enable_expert_bias": True,         # R
    "moe_router_bias_update_rate": 1e-3,           # T
    "moe_router_load_balancing_type": "sub_seq_aux_loss",   # T
    "moe_aux_loss_coeff": 0.0, "moe_expert_capacity_factor": None, "moe_token_drop_policy": "probs",
    "use_pad_tokens": True,                        # T
    "moe_grouped_gemm": False,                     # T
    "moe_token_dispatcher_type": "alltoall",       # T
    "router_dense_type": "float32",                # T moe_router_dtype
    "num_nextn_predict_layers": 1,                 # D
    "mtp_loss_scaling_factor": None,               # T
    "initializer_range": 0.02,                     # D
    "tie_word_embeddings": False,                  # D
    "params_dtype": "float32",                     # T
    "compute_dtype": "bfloat16", "layernorm_compute_dtype": "float32", "rotary_dtype": "float32",   # R
    "softmax_compute_dtype": "float32",            # T
    "pad_token_id": 0,                             # T __post_init__ (None -> 0)
    "bos_token_id": 0, "eos_token_id": 1,          # D
    "head_dim": None,                              # T kv_channels (None -> hidden_size // heads)
    "partial_rotary_factor": 1.0,                  # T
    # T: experimental_attention_variant and its dsa_indexer_{topk,n_heads,head_dim,loss_coeff,use_sparse_loss}
    "experimental_attention_variant": None, "index_topk": None, "index_n_heads": None, "index_head_dim": None,
    "dsa_indexer_loss_coeff": None, "dsa_indexer_use_sparse_loss": False,
}
# lit_moe switches MindFormers has no key for.
LIT_MOE_ONLY = {"gelu_approximate", "silu_inplace", "use_fused_swiglu", "torch_compile"}
# DeepSeek-V4 (TransformerConfig defaults: mHC off, 4 streams, 20 Sinkhorn rounds, gating 0.01, no hash
# layers, no SwiGLU clamp, no attention variant; enable_hc_head None there, read as False)
MINDFORMERS.update(experimental_attention_variant=None, enable_hyper_connections=False, hc_mult=4,
                   hc_sinkhorn_iters=20, hc_eps=1e-6, enable_hc_head=False, mhc_init_gating_factor=0.01,
                   num_hash_layers=0, swiglu_limit=None)
# the fields of DeepSeek-V4's own attention (experimental_attention_variant: dsv4_hybrid), unused otherwise
LIT_MOE_ONLY |= {"layer_types", "compress_rates", "compress_rope_theta", "sliding_window", "o_groups", "o_lora_rank",
                 "index_n_heads", "index_head_dim", "index_topk"}


def test_every_model_default_is_mindformers_or_a_documented_exception(caplog, monkeypatch):
    import lit_moe.model.mindformers_defaults as mf

    monkeypatch.setattr(mf, "_WARNED", set())
    fields = {f.name for f in dataclasses.fields(DeepseekV3Config)}
    assert fields == set(MINDFORMERS) | LIT_MOE_ONLY, fields ^ (set(MINDFORMERS) | LIT_MOE_ONLY)
    with caplog.at_level(logging.WARNING):
        built = DeepseekV3Config(**read_pynative_model_section({}))   # a section relying on every default
    differing = {f for f in MINDFORMERS if getattr(built, f) != MINDFORMERS[f]}
    assert differing == set(KEPT), differing ^ set(KEPT)
    # a kept default the section relies on is one line naming the key and both values
    assert any(r.getMessage().startswith("model.moe_grouped_gemm: not set; lit_moe uses True, MindFormers' "
                                         "default is False") for r in caplog.records)
    assert any(r.getMessage().startswith("model.mtp_loss_scaling_factor: not set; lit_moe uses 0.3")
               for r in caplog.records)


def test_mindformers_monitor_config_builds_mindformers_model():
    # monitor_test.yaml / profiler_test.yaml leave out MTP depth and the latent norms: MindFormers builds
    # one MTP layer and no q/kv latent norms
    section = {k: v for k, v in TINY.items() if k not in ("num_nextn_predict_layers", "qk_layernorm")}
    c = DeepseekV3Config(**read_pynative_model_section(section))
    assert (c.num_nextn_predict_layers, c.qk_layernorm) == (1, False)
    with torch.device("meta"):
        names = [n for n, _ in DeepseekV3ForCausalLM(c).named_parameters()]
    assert any(n.startswith("mtp.0.") for n in names) and not any("a_layernorm" in n for n in names)


def test_keys_mindformers_ignores_have_no_effect_with_one_line(caplog, monkeypatch):
    import lit_moe.model.mindformers_defaults as mf

    monkeypatch.setattr(mf, "_WARNED", set())
    yarn = {"position_embedding_type": "yarn"}
    with caplog.at_level(logging.WARNING):
        c = DeepseekV3Config(**read_pynative_model_section({**yarn, "scaling_factor": 4}))
    assert c.scaling_factor == 40.0   # MindFormers' rotary_scaling_factor default
    assert any("model.scaling_factor: 4 has no effect" in r.getMessage() for r in caplog.records)
    assert DeepseekV3Config(**read_pynative_model_section({**yarn, "rotary_scaling_factor": 4})).scaling_factor == 4
    softmax = {"moe_router_enable_expert_bias": False}
    assert DeepseekV3Config(**read_pynative_model_section({**softmax, "scoring_func": "softmax"})).scoring_func \
        == "sigmoid"
    assert DeepseekV3Config(**read_pynative_model_section(
        {**softmax, "moe_router_score_function": "softmax"})).scoring_func == "softmax"
    # YaRN's original length: max_position_embeddings, as MindFormers' PyNative GPTModel passes it
    c = DeepseekV3Config(**read_pynative_model_section({**yarn, "max_position_embeddings": 163840}))
    assert c.yarn_original_length == 163840
    # Hugging Face config.json keeps Hugging Face's meaning (the dataclass itself)
    assert DeepseekV3Config(scaling_factor=4.0).scaling_factor == 4.0


# ------------------------------------------------------------------------------------------------
# optimizer defaults
# ------------------------------------------------------------------------------------------------
# mindformers/pynative/config/config.py OptimizerConfig (type AdamW, betas [0.9, 0.95], eps 1e-8,
# weight_decay 0.01; trainer/utils.py _build_optimizer passes the whole section, these included, to the
# optimizer) and pynative/optimizer/muon.py Muon.__init__ for the Muon-only keys.
MINDFORMERS_OPTIMIZER = {
    "type": "AdamW", "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01,
    "weight_decay_include": [], "weight_decay_exclude": [], "amsgrad": False, "maximize": False,
}
MINDFORMERS_MUON = {
    "momentum": 0.95, "nesterov": True, "ns_steps": 5, "ns_coefficients": ((3.4445, -4.7750, 2.0315),) * 5,
    "betas": (0.95, 0.95),   # adamw_betas
    "adamw_eps": 1e-8, "eps": 1e-8, "weight_decay": 0.01, "adjust_lr_fn": "match_rms_adamw",  # matched_adamw_rms 0.2
    "adamw_include": ("*word_embeddings*", "*output_layer*"), "matched_adamw_rms": 0.2,
    "qk_clip_enabled": True, "qk_clip_threshold": 100.0, "comm_strategy": "allgather",
}


def test_optimizer_defaults_are_mindformers(caplog, monkeypatch):
    from lit_moe.optim.optimizers import validate_optimizer_section

    adamw = dataclasses.asdict(validate_optimizer_section({}))
    assert {k: adamw[k] for k in MINDFORMERS_OPTIMIZER} == MINDFORMERS_OPTIMIZER
    with caplog.at_level(logging.WARNING):
        muon = dataclasses.asdict(validate_optimizer_section({"type": "Muon"}))
    assert {k: muon[k] for k in MINDFORMERS_MUON} == MINDFORMERS_MUON
    # QK-clip: on by default, as in MindFormers (tests/test_muon_clip.py)
    assert not caplog.records
