"""LoRA on the model itself: the adapted forward against hand-written formulas and against
Hugging Face ``peft`` on transformers' DeepseekV3 with the same weights, merging, freezing and the
``lora_config`` checks."""

import copy

import pytest
import torch

from lit_moe.config import ConfigError
from lit_moe.lora import (LoRAGroupedExperts, LoRALinear, apply_lora, freeze_base, init_adapters, is_adapter_name,
                          lora_settings, merge_lora)
from lit_moe.model import DeepseekV3ForCausalLM
from test_hf_interop import CFG, hf_load, ids, ours_model

ALL = dict(target_modules=r".*", lora_rank=4, lora_alpha=8, lora_b_std=0.05)


def adapted(settings=ALL, seed=3, **overrides):
    m = ours_model(**overrides)
    base = copy.deepcopy(m)
    names = apply_lora(m, lora_settings(settings))
    init_adapters(m, seed)
    return base, m.eval(), names


def test_targets_attention_mlp_shared_and_routed_experts_not_the_head():
    _, m, names = adapted(num_nextn_predict_layers=1)
    assert "layers.0.self_attention.q_a_proj" in names and "layers.0.self_attention.o_proj" in names
    assert "layers.0.mlp.gate_proj" in names                       # dense layer
    assert "layers.1.mlp.experts" in names and "layers.1.mlp.shared_experts.down_proj" in names
    assert "mtp.0.eh_proj" in names and "mtp.0.layer.mlp.experts" in names
    assert not any("lm_head" in n or "router" in n for n in names)
    assert isinstance(m.layers[1].mlp.experts, LoRAGroupedExperts)
    # exclude_layers removes a whole sub-tree; target regexes use re.search on the dotted name
    m2 = ours_model()
    names2 = apply_lora(m2, dict(target_modules=r"(q_b_proj|experts)$", exclude_layers=r"^layers\.2\."))
    assert names2 == ["layers.0.self_attention.q_b_proj", "layers.1.self_attention.q_b_proj", "layers.1.mlp.experts"]


def test_zero_b_starts_at_the_base_model_and_adapters_change_it():
    base, m, _ = adapted(dict(ALL, lora_b_std=0.0))
    x = ids()
    with torch.no_grad():
        assert (m(x).logits - base.eval()(x).logits).abs().max() <= 1e-6
        init_adapters(m, 3)  # deterministic: same seed, same values
        for mod in m.modules():
            if isinstance(mod, LoRALinear):
                assert mod.lora_b.abs().max() == 0 and mod.lora_a.std().item() == pytest.approx(0.01, rel=0.5)
    _, m2, _ = adapted()
    with torch.no_grad():
        assert (m2(x).logits - base(x).logits).abs().max() > 1e-3


def test_layers_match_the_lora_formula():
    _, m, _ = adapted()
    lin = m.layers[0].self_attention.q_b_proj
    x = torch.randn(5, lin.in_features)
    s = 8 / 4
    expect = x @ lin.weight.T + s * (x @ lin.lora_a.T) @ lin.lora_b.T
    assert torch.allclose(lin(x), expect, atol=1e-6)

    ex = m.layers[1].mlp.experts
    counts = torch.tensor([3, 0, 2, 1, 0, 4, 1, 2])
    xs = torch.randn(int(counts.sum()), CFG["hidden_size"])
    rows = []
    for e, xe in enumerate(torch.split(xs, counts.tolist())):
        h = xe @ ex.gate_up_proj[e] + s * (xe @ ex.gate_up_proj_lora_a[e]) @ ex.gate_up_proj_lora_b[e]
        g, u = h.chunk(2, dim=-1)
        a = torch.nn.functional.silu(g) * u
        rows.append(a @ ex.down_proj[e] + s * (a @ ex.down_proj_lora_a[e]) @ ex.down_proj_lora_b[e])
    assert torch.allclose(ex(xs, counts), torch.cat(rows), atol=1e-5)


def test_merged_model_matches_the_adapter_model():
    base, m, _ = adapted(num_nextn_predict_layers=1)
    merged = copy.deepcopy(m)
    assert merge_lora(merged) > 0
    assert not any(isinstance(x, (LoRALinear, LoRAGroupedExperts)) for x in merged.modules())
    assert set(merged.state_dict()) == set(base.state_dict())   # plain layout again (convert-hf saves it)
    x = ids()
    with torch.no_grad():
        out_a, out_m = m(x, labels=x), merged.eval()(x, labels=x)
    # measured 3.1e-6 (logits) and 0.0 (MTP loss; bound: 10 fp32 ulps of ~4.5)
    assert (out_a.logits - out_m.logits).abs().max() <= 3e-5
    assert abs(out_a.mtp_loss.item() - out_m.mtp_loss.item()) <= 5e-6


def _hf_name(ours: str) -> str:
    return "model." + ours.replace("self_attention.", "self_attn.")


def test_adapter_model_matches_peft_on_transformers(tmp_path):
    peft = pytest.importorskip("peft")
    # The attention projections. (peft rewrites gate_proj/up_proj/down_proj targets of a
    # DeepSeek-V3 model into its fused-expert parameter targets, whose layout differs from ours, so
    # MLP and expert adapters are checked against the formula above instead.)
    target = r"self_attention\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)$"
    settings = dict(target_modules=target, lora_rank=4, lora_alpha=12, lora_b_std=0.05)
    base, m, names = adapted(settings)
    assert len(names) == 3 * 5                  # 3 layers × 5 attention projections
    base.save_pretrained(tmp_path)
    hf, _ = hf_load(tmp_path)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=12, lora_dropout=0.0,
                                                 target_modules=[_hf_name(n) for n in names]))
    adapted_by_peft = {n[len("base_model.model."):] for n, mod in pm.named_modules() if hasattr(mod, "lora_A")}
    assert adapted_by_peft == {_hf_name(n) for n in names}
    with torch.no_grad():
        for n in names:
            ours = m.get_submodule(n)
            theirs = pm.base_model.model.get_submodule(_hf_name(n))
            theirs.lora_A["default"].weight.copy_(ours.lora_a)
            theirs.lora_B["default"].weight.copy_(ours.lora_b)
        x = ids()
        got, want = m(x).logits, pm.eval()(x).logits
        assert (got - want).abs().max().item() <= 2e-5          # measured 2.4e-6
        assert (base(x).logits - want).abs().max().item() > 1e-3   # the adapters matter here


def test_freeze_base_and_dropout():
    _, m, _ = adapted(dict(ALL, lora_dropout=0.5))
    trainable, frozen = freeze_base(m)
    assert trainable == sum(p.numel() for n, p in m.named_parameters() if is_adapter_name(n)) > 0
    assert all(p.requires_grad == is_adapter_name(n) for n, p in m.named_parameters())
    assert frozen == sum(p.numel() for p in m.parameters() if not p.requires_grad)
    lin = m.layers[0].self_attention.q_b_proj
    x = torch.randn(64, lin.in_features)
    lin.train()
    assert not torch.equal(lin(x), lin(x))          # adapter input dropout is active in training
    lin.eval()
    assert torch.equal(lin(x), lin(x))
    with pytest.raises(ConfigError, match="no LoRA adapters"):
        freeze_base(ours_model())


@pytest.mark.parametrize("section, message", [
    (dict(), r"lora_config.target_modules: a regular expression is required"),
    (dict(target_modules="("), r"lora_config.target_modules: '\(' is not a valid regular expression"),
    (dict(target_modules="q_proj", lora_rank=0), r"lora_config.lora_rank: must be a positive integer"),
    (dict(target_modules="q_proj", lora_dropout=1.0), r"lora_config.lora_dropout: must be in \[0, 1\)"),
    (dict(target_modules="q_proj", lora_alpha=-1), r"lora_config.lora_alpha: must be a finite number >= 0"),
    (dict(target_modules="q_proj", rank=4), r"lora_config.rank: unknown key"),
])
def test_bad_sections(section, message):
    with pytest.raises(ConfigError, match=message):
        lora_settings(section)


def test_pattern_matching_nothing_names_candidates():
    with torch.device("meta"):
        m = DeepseekV3ForCausalLM(CFG)
    with pytest.raises(ConfigError, match=r"matches no linear layer.*layers\.0\.self_attention\.q_a_proj"):
        apply_lora(m, dict(target_modules=r"nonexistent"))
