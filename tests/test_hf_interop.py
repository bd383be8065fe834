"""Hugging Face interop: logits parity with transformers' DeepseekV3ForCausalLM on the same weights, the
on-disk DeepSeek-V3 layout (sharding, MTP layers), reading HF-written checkpoints, and clear errors."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import transformers  # the judge: a hard test dependency (pyproject [test])

from helpers import randomize_norms_and_biases
from lit_moe.hf.checkpoint import HFCheckpointError  # noqa: E402
from lit_moe.model import DeepseekV3ForCausalLM  # noqa: E402

CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
           num_attention_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16,
           v_head_dim=24, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
           first_k_dense_replace=1, position_embedding_type="yarn", scaling_factor=8.0, seq_length=32,
           max_position_embeddings=256, mscale=0.9, mscale_all_dim=0.7, compute_dtype="float32",
           initializer_range=0.1)


def ours_model(**overrides):
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM({**CFG, **overrides}).eval()
    randomize_norms_and_biases(m, seed=1)   # a swap of same-shaped norms must show in every comparison
    return m


def hf_load(path):
    model, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        path, attn_implementation="eager", output_loading_info=True)
    return model.eval(), info


def ids(b=2, s=40, seed=2):
    return torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "no_q_lora"])
def test_logits_match_transformers(tmp_path, q_lora):
    m = ours_model(q_lora_rank=48 if q_lora else None, num_nextn_predict_layers=1)
    m.save_pretrained(tmp_path)
    hf, info = hf_load(tmp_path)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    # the only keys transformers does not use are the MTP layer's (model.layers.3.*)
    assert info["unexpected_keys"] and all(k.startswith("model.layers.3.") for k in info["unexpected_keys"])
    x = ids()
    with torch.no_grad():
        ours, theirs = m(x).logits, hf(x).logits
    # measured 2.1e-6 (q_lora) / 2.3e-6; the norms swapped in the key map: ≈ 3
    assert (ours - theirs).abs().max().item() <= 2e-5
    # the biases really steer the routing in this test
    with torch.no_grad():
        for moe in m.moe_layers():
            moe.router.expert_bias.zero_()
        assert (m(x).logits - theirs).abs().max().item() > 1e-3


def test_reads_a_checkpoint_written_by_transformers(tmp_path):
    from lit_moe.hf.checkpoint import hf_config_dict
    from lit_moe.model import DeepseekV3Config

    cfg = hf_config_dict(DeepseekV3Config(**{**CFG, "q_lora_rank": None}))
    cfg.pop("lit_moe")
    torch.manual_seed(3)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**cfg)).eval()
    randomize_norms_and_biases(hf, seed=4)
    hf.save_pretrained(tmp_path)
    ours = DeepseekV3ForCausalLM.from_pretrained(tmp_path, compute_dtype="float32").eval()
    assert ours.config.q_lora_rank is None and ours.config.yarn_original_length == 32
    x = ids(seed=4)
    with torch.no_grad():
        assert (ours(x).logits - hf(x).logits).abs().max().item() <= 1e-5   # measured 1.1e-6


def test_sharded_save_with_index(tmp_path):
    m = ours_model()
    m.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (tmp_path / "model.safetensors").exists()
    sizes = [os.path.getsize(tmp_path / s) for s in shards]
    assert max(sizes) < 200_000
    hf, info = hf_load(tmp_path)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    back = DeepseekV3ForCausalLM.from_pretrained(tmp_path, compute_dtype="float32").eval()
    x = ids()
    with torch.no_grad():
        ref = m(x).logits
        assert torch.equal(back(x).logits, ref)
        assert (hf(x).logits - ref).abs().max().item() <= 3e-5   # measured 3.1e-6


def test_deepseek_layout_with_mtp_layers_round_trips(tmp_path):
    m = ours_model(num_nextn_predict_layers=2)
    m.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert torch.equal(f.get_tensor("model.layers.4.embed_tokens.weight"), m.embed_tokens.weight)
    for L in (3, 4):
        for suffix in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                       "shared_head.head.weight", "embed_tokens.weight", "self_attn.q_a_proj.weight",
                       "mlp.gate.e_score_correction_bias", "mlp.experts.7.down_proj.weight",
                       "post_attention_layernorm.weight"):
            assert f"model.layers.{L}.{suffix}" in keys
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in keys and "model.layers.0.mlp.gate_proj.weight" in keys
    back = DeepseekV3ForCausalLM.from_pretrained(tmp_path, compute_dtype="float32").eval()
    x = ids()
    with torch.no_grad():
        a, b = m(x, labels=x), back(x, labels=x)
    assert torch.equal(a.mtp_loss, b.mtp_loss) and torch.equal(a.logits, b.logits)
    for (n1, t1), (n2, t2) in zip(m.state_dict().items(), back.state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2), n1
    # fewer MTP depths than stored: the extra layers are ignored
    short = DeepseekV3ForCausalLM.from_pretrained(tmp_path, num_nextn_predict_layers=1)
    assert len(short.mtp) == 1


def test_hf_only_config_and_bf16_storage(tmp_path):
    m = ours_model()
    m.save_pretrained(tmp_path, dtype=torch.bfloat16)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["rope_scaling"]["type"] == "yarn"
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert tensors["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16
    cfg.pop("lit_moe")                       # a plain Hugging Face config.json
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    back = DeepseekV3ForCausalLM.from_pretrained(tmp_path, compute_dtype="float32")
    assert back.config.mscale_all_dim == 0.7 and back.config.group_limited
    assert {p.dtype for p in back.parameters()} == {torch.float32}
    torch.testing.assert_close(back.lm_head.weight, m.lm_head.weight.to(torch.bfloat16).float())


def test_reads_transformers_merged_expert_tensors(tmp_path):
    m = ours_model()
    m.save_pretrained(tmp_path)
    t = load_file(str(tmp_path / "model.safetensors"))
    for layer in (1, 2):
        p = f"model.layers.{layer}.mlp.experts."
        gate = [t.pop(f"{p}{j}.gate_proj.weight") for j in range(8)]
        up = [t.pop(f"{p}{j}.up_proj.weight") for j in range(8)]
        down = [t.pop(f"{p}{j}.down_proj.weight") for j in range(8)]
        t[p + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])   # [E, 2I, H]
        t[p + "down_proj"] = torch.stack(down)                                               # [E, H, I]
    save_file(t, str(tmp_path / "model.safetensors"))
    back = DeepseekV3ForCausalLM.from_pretrained(tmp_path, compute_dtype="float32")
    assert torch.equal(back.layers[2].mlp.experts.gate_up_proj, m.layers[2].mlp.experts.gate_up_proj)
    assert torch.equal(back.layers[2].mlp.experts.down_proj, m.layers[2].mlp.experts.down_proj)


def _edit(tmp_path, fn):
    t = load_file(str(tmp_path / "model.safetensors"))
    fn(t)
    save_file(t, str(tmp_path / "model.safetensors"))


def test_clear_errors(tmp_path):
    m = ours_model()
    m.save_pretrained(tmp_path)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())

    for quant in ({"quant_method": "gptq", "bits": 4}, {"quant_method": "fp8", "weight_block_size": [128]}):
        cfg_path.write_text(json.dumps({**cfg, "quantization_config": quant}))
        with pytest.raises(HFCheckpointError, match=rf"quant_method={quant['quant_method']!r}.*dequantize"):
            DeepseekV3ForCausalLM.from_pretrained(tmp_path)
    cfg_path.write_text(json.dumps(cfg))

    _edit(tmp_path, lambda t: t.update({"model.layers.1.self_attn.o_proj.weight_scale_inv": torch.ones(1)}))
    with pytest.raises(HFCheckpointError, match=r"o_proj.weight_scale_inv has shape \[1\], expected \[1, 1\]"):
        DeepseekV3ForCausalLM.from_pretrained(tmp_path)
    _edit(tmp_path, lambda t: t.pop("model.layers.1.self_attn.o_proj.weight_scale_inv"))

    key = "model.layers.1.self_attn.o_proj.weight"
    _edit(tmp_path, lambda t: t.update({key: t[key].to(torch.float8_e4m3fn)}))
    with pytest.raises(HFCheckpointError, match=r"o_proj.weight: torch.float8_e4m3fn"):
        DeepseekV3ForCausalLM.from_pretrained(tmp_path)

    _edit(tmp_path, lambda t: t.pop(key))
    with pytest.raises(HFCheckpointError, match=r"1 tensor\(s\) missing.*self_attn.o_proj.weight"):
        DeepseekV3ForCausalLM.from_pretrained(tmp_path)

    _edit(tmp_path, lambda t: t.update({key: torch.zeros(64, 96), "model.extra.weight": torch.zeros(2)}))
    with pytest.raises(HFCheckpointError, match=r"unexpected tensor\(s\).*model.extra.weight"):
        DeepseekV3ForCausalLM.from_pretrained(tmp_path)
    _edit(tmp_path, lambda t: t.pop("model.extra.weight"))

    cfg_path.write_text(json.dumps({**cfg, "lit_moe": {**cfg["lit_moe"], "v_head_dim": 16}}))
    with pytest.raises(HFCheckpointError, match=r"kv_b_proj.weight: shape \(160, 32\) in the checkpoint.*\(128, 32\)"):
        DeepseekV3ForCausalLM.from_pretrained(tmp_path)

    with pytest.raises(HFCheckpointError, match=r"no model.safetensors"):
        (tmp_path / "model.safetensors").unlink()
        DeepseekV3ForCausalLM.from_pretrained(tmp_path)

    for overrides, field in ((dict(normalization="LayerNorm"), "normalization"),
                             (dict(window_size=(4, 0)), "window_size"),
                             (dict(position_embedding_type="learned_absolute"), "position_embedding_type")):
        with pytest.raises(HFCheckpointError, match=rf"model\.{field}"):
            ours_model(**overrides).save_pretrained(tmp_path / "x")


def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_matches_the_papers_formula(tmp_path, depth):
    """MTP from the DeepSeek-V3 report (deepseek_math.md §5), in plain tensor code on the checkpoint's
    tensors, with transformers' decoder layer as the block: h^0 = the main model's final-norm output,
    h'_k = eh_proj [RMSNorm_e(Emb(t_{i+k})) ; RMSNorm_h(h^{k-1})], h^k = shared_head.norm(Block_k(h'_k)),
    L = λ/D Σ_k masked-mean CE(lm_head(h^k), labels shifted by k). Independent of lit_moe's MTP layer."""
    L, lam = CFG["num_hidden_layers"], 0.3
    m = ours_model(num_nextn_predict_layers=depth, mtp_loss_scaling_factor=lam)
    m.save_pretrained(tmp_path)
    w = load_file(str(tmp_path / "model.safetensors"))
    # the main model and the MTP blocks as transformers' layers: load the MTP layers as extra layers
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", num_hidden_layers=L + depth).eval()
    eps = hf.config.rms_norm_eps
    B, S = 2, 24
    x, labels = ids(B, S, seed=5), ids(B, S, seed=6)
    mask = (torch.rand(B, S, generator=torch.Generator().manual_seed(7)) > 0.2).float()
    pos = torch.arange(S)[None].expand(B, S)
    causal = torch.full((S, S), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        hf.config.num_hidden_layers = L                      # the main model runs its L layers only
        h = hf.model(x).last_hidden_state                    # after the final norm (MindFormers / Megatron)
        total = 0.0
        for k in range(1, depth + 1):
            p = f"model.layers.{L + k - 1}."

            def shift(t):                                    # left by k, zero fill
                return torch.cat([t[:, k:], torch.zeros_like(t[:, :k])], dim=1)

            emb = w["model.embed_tokens.weight"][shift(x)]
            h_in = torch.cat([_rms(emb, w[p + "enorm.weight"], eps), _rms(h, w[p + "hnorm.weight"], eps)], -1)
            h_in = h_in @ w[p + "eh_proj.weight"].T
            block = hf.model.layers[L + k - 1]
            out = block(h_in, attention_mask=causal, position_ids=pos,
                        position_embeddings=hf.model.rotary_emb(h_in, pos))
            h = _rms(out[0] if isinstance(out, tuple) else out, w[p + "shared_head.norm.weight"], eps)
            ce = torch.nn.functional.cross_entropy((h @ w["lm_head.weight"].T).reshape(-1, CFG["vocab_size"]),
                                                   shift(labels).reshape(-1), reduction="none")
            mk = shift(mask).reshape(-1)
            total = total + (ce * mk).sum() / mk.sum()
        ref = total * lam / depth
        ours = m(x, labels=labels, loss_mask=mask).mtp_loss
    # measured |Δ| = 1.2e-7 (depth 1 and 2, fp32)
    assert abs(ours.item() - ref.item()) <= 1e-6, (ours.item(), ref.item())
