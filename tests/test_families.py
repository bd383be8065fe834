"""The Qwen3-MoE and GLM-4-MoE families (grouped-query attention, softmax / sigmoid routers) against
transformers' ``Qwen3MoeForCausalLM`` and ``Glm4MoeForCausalLM`` on the same weights, both directions of the
Hugging Face layout, and the family's config rules."""

import json

import pytest
import torch

import transformers  # the judge

from helpers import load_transformers_model, randomize_norms_and_biases
from lit_moe.config import ConfigError
from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM
from lit_moe.hf.checkpoint import HFCheckpointError, hf_config_dict

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=24, n_routed_experts=8, num_experts_per_tok=3,
            first_k_dense_replace=1, seq_length=32, max_position_embeddings=256, compute_dtype="float32",
            initializer_range=0.1, rope_theta=1e6)
QWEN3 = dict(BASE, model_type="qwen3_moe", norm_topk_prob=True)
GLM4 = dict(BASE, model_type="glm4_moe", n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
            attention_bias=True)
HF_CLASS = {"qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}


def ours_model(cfg):
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM(cfg).eval()
    randomize_norms_and_biases(m, seed=1)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("_proj.bias"):    # q/k/v biases start at 0: make them count
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
        if not m.config.moe_router_enable_expert_bias:   # the buffer is never updated (nor exported) then
            for moe in m.moe_layers():
                moe.router.expert_bias.zero_()
    return m


def hf_load(cfg, path):
    return load_transformers_model(HF_CLASS[cfg["model_type"]], path)


def ids(seed=2):
    return torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(seed))


CASES = {
    "qwen3_renorm": QWEN3,
    "qwen3_plain_topk": dict(QWEN3, norm_topk_prob=False, first_k_dense_replace=0),
    "glm4": GLM4,
    "glm4_qk_norm": dict(GLM4, qk_layernorm=True, attention_bias=False, num_key_value_heads=1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    cfg = CASES[case]
    m = ours_model(cfg)
    m.save_pretrained(tmp_path)
    hf = hf_load(cfg, tmp_path)
    x = ids()
    with torch.no_grad():
        err = (m(x).logits - hf(x).logits).abs().max().item()
    # measured 2.4e-6 (qwen3), 1.8e-6 (glm4); each planted bug of benchmarks/planted_bugs.py: > 1e-2
    assert err <= 2e-5, err


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_reads_a_checkpoint_written_by_transformers(tmp_path, family):
    """transformers' own config.json (no lit_moe block) and weights → our model, same logits."""
    cfg = QWEN3 if family == "qwen3_moe" else GLM4
    hf_cfg = hf_config_dict(DeepseekV3Config(**cfg))
    hf_cfg.pop("lit_moe")
    config_cls = getattr(transformers, HF_CLASS[family].replace("ForCausalLM", "Config"))
    torch.manual_seed(3)
    hf = getattr(transformers, HF_CLASS[family])(config_cls(**hf_cfg)).eval()
    randomize_norms_and_biases(hf, seed=4)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0, 0.3)
    hf.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "lit_moe" not in written and written["model_type"] == family
    ours = DeepseekV3ForCausalLM.from_pretrained(tmp_path, compute_dtype="float32").eval()
    assert ours.config.model_type == family and not ours.config.multi_latent_attention
    assert ours.config.first_k_dense_replace == 1 and ours.config.kv_heads == 2
    x = ids(seed=4)
    with torch.no_grad():
        assert (ours(x).logits - hf(x).logits).abs().max().item() <= 2e-5   # measured 2e-6


def test_family_defaults_and_rules():
    q = DeepseekV3Config(model_type="qwen3_moe", hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    assert (q.scoring_func, q.n_shared_experts, q.qk_layernorm, q.multi_latent_attention) == ("softmax", 0, True, False)
    assert (q.gqa_head_dim, q.rotary_dim, q.qk_head_dim) == (16, 16, 16)
    g = DeepseekV3Config(model_type="glm4_moe", hidden_size=64, num_attention_heads=4, head_dim=32)
    assert (g.scoring_func, g.rotary_dim, g.kv_heads, g.first_k_dense_replace) == ("sigmoid", 16, 4, 1)
    # a field the section gives wins over the family default
    assert DeepseekV3Config(model_type="qwen3_moe", qk_layernorm=False).qk_layernorm is False
    for bad, match in ((dict(num_key_value_heads=3), r"model\.num_key_value_heads: 3 must be >= 1 and divide"),
                       (dict(position_embedding_type="yarn"), r"model\.position_embedding_type: 'yarn' is not supported"),
                       (dict(partial_rotary_factor=0.125), r"model\.partial_rotary_factor: 0\.125 rotates 3 dims"),
                       (dict(architectures="DeepseekV3ForCausalLM"), r"model\.architectures: .* 'Qwen3MoeForCausalLM'")):
        with pytest.raises(ConfigError, match=match):
            DeepseekV3Config(**{**QWEN3, **bad})
    with pytest.raises(ConfigError, match=r"model\.attention_bias: True is not supported with multi-latent"):
        DeepseekV3Config(attention_bias=True)


def test_export_refuses_what_transformers_cannot_hold():
    # MindFormers' Qwen3-30B-A3B config scales the combine weights by 1.5; Hugging Face's Qwen3-MoE cannot
    with pytest.raises(HFCheckpointError, match=r"qwen3_moe checkpoint: model\.routed_scaling_factor: 1\.5"):
        hf_config_dict(DeepseekV3Config(**{**QWEN3, "routed_scaling_factor": 1.5}))
    with pytest.raises(ConfigError, match=r"config\.json: mlp_only_layers=\[1\] is not supported"):
        from lit_moe.hf.checkpoint import config_from_hf
        config_from_hf({**hf_config_dict(DeepseekV3Config(**QWEN3)), "lit_moe": None, "mlp_only_layers": [1]})


# ----------------------------------------------------------------------------------------------
# recompute, checkpoints: the same machinery addresses the grouped-query attention's modules
# ----------------------------------------------------------------------------------------------
GQA_TINY = dict(model_type="glm4_moe", architectures="Glm4MoeForCausalLM", multi_latent_attention=False,
                position_embedding_type="rope", num_key_value_heads=2, attention_bias=True, qk_layernorm=True)


@pytest.mark.filterwarnings("error::lit_moe.strategies.recompute.RecomputeWarning")   # every pattern selects
def test_recompute_addresses_gqa_modules_in_every_spelling():
    import copy

    from test_recompute_model import assert_identical, batch, build, step
    from lit_moe.strategies.recompute import apply_recompute, regions

    base = build(**GQA_TINY)
    assert base.config.num_nextn_predict_layers == 1   # the MTP layer's attention is GQA too
    data = batch(base.config.vocab_size)
    model = copy.deepcopy(base)
    # lit_moe's names, MindFormers' (linear_qkv holds q/k/v, q_layernorm is q_norm) and Hugging Face's
    apply_recompute(model, {"mode": "select", "select_module": {
        r"self_attention\.(q_norm|k_proj)": ["0-3"], r"self_attention\.linear_qkv": [1],
        r"self_attn\.k_norm": [2], "self_attention.core_attention": ["0-3"]}}, None)
    assert regions(model.layers[1].self_attention.v_proj)   # linear_qkv = q_proj, k_proj, v_proj
    assert regions(model.mtp[0].layer.self_attention.q_norm)
    assert_identical(step(base, data), step(model, data))


@pytest.mark.timeout(900)
def test_save_and_resume_gqa_family_through_the_cli(tmp_path, capfd):
    """A GLM-4-MoE model (GQA with q/k/v biases, q/k norms, expert bias, an MTP layer): 4 steps straight
    equal 2 steps, a distributed checkpoint, and 2 resumed steps (one-process runs of the CLI inside
    this process: no interpreter starts)."""
    from test_checkpoint_e2e import _config, _fit, _probe

    straight_probe, first_probe, second_probe = (tmp_path / f"{n}.jsonl" for n in ("straight", "first", "second"))
    save = tmp_path / "ckpt"
    _fit(tmp_path, _config(tmp_path, "straight.yaml", straight_probe, 4, {}, **GQA_TINY), capfd=capfd)
    _fit(tmp_path, _config(tmp_path, "first.yaml", first_probe, 4, {"enable_save": True, "save_path": str(save),
                                                                     "save_interleaved_steps": 100}, **GQA_TINY),
         "--trainer.max_steps", "2", capfd=capfd)
    _fit(tmp_path, _config(tmp_path, "second.yaml", second_probe, 4, {"enable_save": True, "save_path": str(save),
                                                                       "load_path": str(save)}, **GQA_TINY),
         capfd=capfd)
    straight, resumed = _probe(straight_probe), {**_probe(first_probe), **_probe(second_probe)}
    assert sorted(resumed) == [1, 2, 3, 4]
    for s in range(1, 5):
        assert straight[s]["loss"] == resumed[s]["loss"], (s, straight[s]["loss"], resumed[s]["loss"])
    assert len({straight[s]["loss"] for s in straight}) == 4


def test_lora_keeps_the_qkv_biases():
    """LoRA on GLM-4-MoE's biased q/k/v projections: with B = 0 the adapted model is the base model."""
    from lit_moe.lora import apply_lora, init_adapters

    m = ours_model(GLM4)
    x = ids()
    with torch.no_grad():
        before = m(x).logits
    apply_lora(m, {"lora_rank": 4, "target_modules": r".*self_attention\.(q|k|v)_proj"})
    init_adapters(m, 0)   # B = 0
    assert m.layers[0].self_attention.q_proj.bias is not None
    with torch.no_grad():
        assert torch.equal(m(x).logits, before)
