"""The DeepSeek-V3.2 family (MLA + the lightning indexer's top-k sparse attention) against transformers'
``DeepseekV32ForCausalLM`` on the same weights, both directions of the Hugging Face layout, a
MindFormers-style section, and the refusals."""

import json

import pytest
import torch

import transformers  # the judge

from helpers import load_transformers_model, randomize_norms_and_biases
from lit_moe.config import ConfigError
from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM
from lit_moe.hf.checkpoint import hf_config_dict
from lit_moe.model.mindformers_defaults import read_pynative_model_section

SEQ = 40
# index_topk 6 < SEQ: from the 7th token on each query attends to 6 of its keys
V32 = dict(model_type="deepseek_v32", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
           num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
           first_k_dense_replace=1, index_topk=6, index_n_heads=4, index_head_dim=16, seq_length=SEQ,
           max_position_embeddings=256, compute_dtype="float32", initializer_range=0.1)


def randomize_norms(model, seed):
    """Norm weights 1 + 0.2·N (the indexer's k_norm too), expert biases, and the indexer's LayerNorm bias
    (it starts at 0) 0.3·N, on our model or transformers'."""
    randomize_norms_and_biases(model, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("indexer.k_norm.bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))


def ours_model(cfg=V32):
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM(cfg).eval()
    randomize_norms(m, seed=1)
    return m


def hf_load(path):
    return load_transformers_model("DeepseekV32ForCausalLM", path)


def ids(seed=2):
    return torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def test_logits_match_transformers(tmp_path):
    m = ours_model()
    m.save_pretrained(tmp_path)
    hf = hf_load(tmp_path)
    x = ids()
    with torch.no_grad():
        ours, theirs = m(x).logits, hf(x).logits
        dense = DeepseekV3ForCausalLM({**V32, "index_topk": SEQ})
        dense.load_state_dict(m.state_dict())
        dense_err = (dense.eval()(x).logits - theirs).abs().max().item()
    err = (ours - theirs).abs().max().item()
    # measured 2.4e-6 (dense: 4.5); each planted indexer bug of benchmarks/planted_bugs.py fails it
    assert err <= 2e-5, err
    assert dense_err > 1e-2, dense_err   # the sparsity matters: every key allowed is far from transformers


def test_reads_a_checkpoint_written_by_transformers(tmp_path):
    """transformers' own config.json (no lit_moe block: layer_types, mlp_layer_types) and weights → our
    model, same logits."""
    hf_cfg = hf_config_dict(DeepseekV3Config(**V32))
    hf_cfg.pop("lit_moe")
    torch.manual_seed(3)
    hf = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**hf_cfg)).eval()
    randomize_norms(hf, seed=4)
    hf.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "lit_moe" not in written and written["model_type"] == "deepseek_v32" and "mlp_layer_types" in written
    ours = DeepseekV3ForCausalLM.from_pretrained(tmp_path, compute_dtype="float32").eval()
    c = ours.config
    assert (c.model_type, c.sparse_attention, c.index_topk, c.index_n_heads, c.index_head_dim,
            c.first_k_dense_replace) == ("deepseek_v32", True, 6, 4, 16, 1)
    x = ids(seed=4)
    with torch.no_grad():
        assert (ours(x).logits - hf(x).logits).abs().max().item() <= 9e-6   # measured 9.5e-7
    # and back: our export of it loads in transformers with the same tensors
    ours.save_pretrained(tmp_path / "again")
    again = hf_load(tmp_path / "again")
    theirs = hf.state_dict()
    for k, v in again.state_dict().items():
        assert torch.equal(v, theirs[k]), k


def test_mindformers_section_with_the_dsa_keys():
    """MindFormers has no DeepSeek-V3.2 yaml; its DeepSeek-V3 model takes the variant with these keys
    (parallel_core/transformer_config.py: experimental_attention_variant, dsa_indexer_*)."""
    section = {k: v for k, v in V32.items() if k not in ("model_type", "index_topk", "index_n_heads",
                                                          "index_head_dim")}
    section.update(qk_layernorm=True, experimental_attention_variant="dsa", dsa_indexer_topk=6, dsa_indexer_n_heads=4,
                   dsa_indexer_head_dim=16, dsa_indexer_loss_coeff=0.0, dsa_indexer_use_sparse_loss=True)
    c = DeepseekV3Config(**read_pynative_model_section(section))
    assert (c.model_type, c.sparse_attention, c.index_topk, c.index_n_heads, c.index_head_dim) == (
        "deepseek_v3", True, 6, 4, 16)
    with torch.device("meta"):
        m = DeepseekV3ForCausalLM(c)
    assert tuple(m.layers[0].self_attention.indexer.wq_b.weight.shape) == (4 * 16, 32)
    assert hf_config_dict(c)["model_type"] == "deepseek_v32"    # exported as the family it is
    # MindFormers' default stage is the dense warm-up (dsa_indexer_use_sparse_loss False), which trains the
    # indexer only: without its loss (coefficient 0) refused by name, with it accepted
    without = {k: v for k, v in section.items() if k != "dsa_indexer_use_sparse_loss"}
    with pytest.raises(ConfigError, match=r"^model\.dsa_indexer_use_sparse_loss: False .*dense warm-up.* needs "
                                          r"dsa_indexer_loss_coeff > 0"):
        DeepseekV3Config(**read_pynative_model_section(without))
    warm = DeepseekV3Config(**read_pynative_model_section({**without, "dsa_indexer_loss_coeff": 0.5}))
    assert (warm.sparse_attention, warm.dsa_indexer_use_sparse_loss) == (True, False)


@pytest.mark.parametrize("changes,message", [
    (dict(dsa_indexer_loss_coeff=-0.1), r"model\.dsa_indexer_loss_coeff: -0\.1 must be >= 0"),
    (dict(q_lora_rank=0), r"model\.experimental_attention_variant: 'dsa' needs multi-latent attention with q_lora"),
    (dict(index_head_dim=4), r"model\.index_head_dim: 4 must be at least qk_rope_head_dim \(8\)"),
    (dict(experimental_attention_variant=None), r"model\.experimental_attention_variant: None must be 'dsa'"),
    (dict(model_type="deepseek_v3"), r"model\.index_topk: 6 needs experimental_attention_variant 'dsa'"),
])
def test_refused_by_name(changes, message):
    with pytest.raises(ConfigError, match=message):
        DeepseekV3Config(**{**V32, **changes})


def test_every_context_parallel_method_accepted_and_predict_accepted():
    from lit_moe.config import ParallelismConfig
    from lit_moe.tools.predict import check_model
    from lit_moe.strategies.parallel_dims import ParallelDims, check_parallel_layout

    c = DeepseekV3Config(**V32)
    dims = ParallelDims(world_size=2, cp=2)
    dims.validate_model(c, SEQ)
    # every method runs: v32_cp2_tp2, v32_cp2_ulysses and v32_cp4_hybrid_async in test_step_layouts.py
    check_parallel_layout(ParallelismConfig(context_parallel=2), dims, c)
    check_parallel_layout(ParallelismConfig(context_parallel=2, context_parallel_method="ulysses"), dims, c)
    check_parallel_layout(ParallelismConfig(context_parallel=4, context_parallel_method="hybrid", ulysses_degree_in_cp=2),
                          ParallelDims(world_size=4, cp=4), c)
    # the indexer loss: every layout (v32_loss_* in test_step_layouts.py, pp2_v32_loss_mtp in test_pipeline.py)
    lossy = DeepseekV3Config(**{**V32, "dsa_indexer_loss_coeff": 0.1})
    for layout, sizes in ((dict(data_parallel_shard=2), dict(dp_shard=2)), (dict(context_parallel=2), dict(cp=2)),
                          (dict(context_parallel=2, context_parallel_method="ulysses"), dict(cp=2)),
                          (dict(tensor_parallel=2), dict(tp=2)),
                          (dict(pipeline_parallel=2, pipeline_parallel_layers_per_stage=["0-1", "2-2"]), dict(pp=2))):
        check_parallel_layout(ParallelismConfig(**layout), ParallelDims(world_size=2, **sizes), lossy)
    check_parallel_layout(ParallelismConfig(context_parallel=4, context_parallel_method="hybrid", ulysses_degree_in_cp=2),
                          ParallelDims(world_size=4, cp=4), lossy)
    check_model(c)   # predict caches the indexer's keys (tests/test_predict.py)


def test_indexer_gets_no_gradient_and_recompute_addresses_it():
    """Without the indexer loss (dsa_indexer_loss_coeff unset) the language-model loss reaches every weight
    but the indexer's (its top-k choice is not differentiable). Recompute patterns address the indexer by
    its module name."""
    import copy

    from test_recompute_model import batch, build, step
    from lit_moe.strategies.recompute import apply_recompute, regions

    m = ours_model()
    x = ids()
    m.train()
    out = m(x, labels=x)
    out.loss.backward()
    grads = {n: p.grad for n, p in m.named_parameters()}
    assert all(g is None for n, g in grads.items() if ".indexer." in n)
    assert all(g is not None for n, g in grads.items() if ".indexer." not in n and "expert_bias" not in n)
    base = build(architectures="DeepseekV32ForCausalLM",
                 **{k: V32[k] for k in ("model_type", "index_topk", "index_n_heads", "index_head_dim")})
    data = batch(base.config.vocab_size)
    model = copy.deepcopy(base)
    # lit_moe's names, Hugging Face's and MindFormers' (its DSAIndexer lives in the core attention)
    apply_recompute(model, {"mode": "select", "select_module": {
        r"self_attention\.indexer": [0, 2], r"self_attn\.indexer\.wk": [1],
        r"self_attention\.core_attention\.indexer\.linear_weights_proj": [1]}}, None)
    assert regions(model.layers[0].self_attention.indexer)
    assert regions(model.layers[1].self_attention.indexer.wk)
    assert regions(model.layers[1].self_attention.indexer.weights_proj)
    assert "forward" not in vars(model.layers[1].self_attention.indexer.wq_b)
    ref, got = step(base, data), step(model, data)
    assert torch.equal(ref["loss"], got["loss"]) and ref["grads"].keys() == got["grads"].keys()
    assert all(torch.equal(ref["grads"][n], got["grads"][n]) for n in ref["grads"])


def test_graph_config_with_the_dsa_keys_converts(tmp_path, capsys):
    """``lit_moe convert-config`` of a graph-mode DeepSeek-V3 config (the mcore fixture) with the DSA keys of
    MindFormers' TransformerConfig: they carry over and build the sparse attention; without
    dsa_indexer_use_sparse_loss (MindFormers' default False: the dense warm-up, which needs the indexer
    loss, here 0) one line names it."""
    from test_convert_families import family
    from lit_moe.tools.convert_config import main

    keys = {"experimental_attention_variant": "dsa", "dsa_indexer_topk": 8, "dsa_indexer_n_heads": 2,
            "dsa_indexer_head_dim": 16, "dsa_indexer_loss_coeff": 0.0, "dsa_indexer_use_sparse_loss": True}
    path = family(tmp_path, "pretrain_mcore", **{f"model.model_config.{k}": v for k, v in keys.items()})
    assert main([str(path), "-o", str(tmp_path / "out.yaml")]) == 0, capsys.readouterr().err
    import yaml

    model = yaml.safe_load((tmp_path / "out.yaml").read_text())["model"]
    assert {k: model[k] for k in keys} == keys
    c = DeepseekV3Config(**read_pynative_model_section(model))
    assert (c.sparse_attention, c.index_topk, c.index_n_heads, c.index_head_dim) == (True, 8, 2, 16)
    capsys.readouterr()
    path = family(tmp_path, "pretrain_mcore", **{f"model.model_config.{k}": v for k, v in keys.items()
                                                 if k != "dsa_indexer_use_sparse_loss"})
    assert main([str(path), "-o", str(tmp_path / "x.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.dsa_indexer_use_sparse_loss: False" in err[0], err


def test_sizing_counts_the_indexer():
    """param_counts equals the built model's parameters; flops_per_token by hand: per layer the indexer's
    projections 2·(32·4·16 + 64·16 + 64·4) = 6656 and causal scores 2·4·16·40/2 = 2560 (forward only),
    and the core attention 6·(4·24/2 + 4·16/2) = 480 per key span, which top-6 of 40 cuts from 40 to
    2·(6·7/2 + 34·6)/40 = 11.25: 3 layers · (6656 + 2560 - 480·28.75) = -13752 against dense MLA."""
    from lit_moe.model import flops_per_token, param_counts

    c = DeepseekV3Config(**V32)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(c)
    assert param_counts(c).total_with_mtp == sum(p.numel() for p in model.parameters())
    dense = DeepseekV3Config(**{k: v for k, v in V32.items() if not k.startswith("index_") and k != "model_type"})
    assert flops_per_token(c, SEQ) - flops_per_token(dense, SEQ) == pytest.approx(-13752, abs=1e-6)
    # the dense warm-up stage attends every key: only the indexer's 3 · (6656 + 2560) more
    warm = DeepseekV3Config(**{**V32, **WARM_UP})
    assert flops_per_token(warm, SEQ) - flops_per_token(dense, SEQ) == pytest.approx(27648, abs=1e-6)


# ----------------------------------------------------------------------------------------------
# DeepSeek-V3.2's indexer loss (dsa_indexer_loss_coeff, the sparse stage)
# ----------------------------------------------------------------------------------------------
# one MLA layer with its indexer, no rotary encoding (learned absolute positions: the hand reference
# below needs no rotation convention), no MoE, no MTP
# (8 indexer heads and these tokens: no two index scores tie at a top-k boundary, which ReLU's zeros
# make likely with 4 heads; the reference asserts it)
ONE_LAYER = {**V32, "num_hidden_layers": 1, "position_embedding_type": "learned_absolute", "index_n_heads": 8,
             "dsa_indexer_loss_coeff": 0.7}


def reference_indexer_loss(attn, x, coeff, dense=False, indexer_weights=None):
    """DeepSeek-V3.2's indexer loss from the formula, in plain torch on the weights of ``attn`` (its input
    ``x [B, S, H]``): S_t = the top-k causal keys of the index scores I (``dense``, the warm-up stage: every
    causal key); p = the heads' attention probabilities restricted to S_t, summed, L1-renormalised;
    coeff * mean_t KL(p || softmax(I over S_t)). ``indexer_weights``: the indexer's parameters by name
    (fp64, for autograd); default: its own."""
    B, S, _ = x.shape
    W = lambda lin: lin.weight.double()                                      # noqa: E731
    rms = lambda t, w, eps: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w.double()   # noqa: E731
    x = x.double()
    c = attn.core_attention
    n, dn, dr, dv = 4, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
    q_lat = rms(x @ W(attn.q_a_proj).T, attn.q_a_layernorm.weight, attn.q_a_layernorm.eps)
    q = (q_lat @ W(attn.q_b_proj).T).view(B, S, n, dn + dr)
    kv_a = x @ W(attn.kv_a_proj_with_mqa).T
    latent = rms(kv_a[..., :attn.kv_lora_rank], attn.kv_a_layernorm.weight, attn.kv_a_layernorm.eps)
    kv = (latent @ W(attn.kv_b_proj).T).view(B, S, n, dn + dv)
    k = torch.cat([kv[..., :dn], kv_a[..., None, attn.kv_lora_rank:].expand(B, S, n, dr)], -1)
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k) * c.scale                 # [B, n, S, S]
    ix = attn.indexer
    h, D = ix.n_heads, ix.head_dim
    P = indexer_weights or {n: p.detach().double() for n, p in ix.named_parameters()}
    qi = (q_lat @ P["wq_b.weight"].T).view(B, S, h, D)
    ki = torch.nn.functional.layer_norm(x @ P["wk.weight"].T, (D,), P["k_norm.weight"], P["k_norm.bias"], 1e-6)
    w = (x @ P["weights_proj.weight"].T) * h ** -0.5
    I = (w[..., None] * torch.relu(torch.einsum("bqhd,bkd->bqhk", qi, ki) * D ** -0.5)).sum(2)   # [B, S, S]
    total = 0.0
    for b in range(B):
        for t in range(S):
            ranked = I[b, t, :t + 1].sort(descending=True)
            keys = torch.arange(t + 1) if dense else ranked.indices[:ix.topk]   # S_t among the causal keys
            assert dense or t < ix.topk or ranked.values[ix.topk - 1] - ranked.values[ix.topk] > 1e-4   # no tie
            p = torch.softmax(logits[b, :, t, keys], -1).sum(0)
            p = p / p.sum()
            log_q = torch.log_softmax(I[b, t, keys], -1)
            total = total + (p * (p.log() - log_q)).sum()
    return coeff * total / (B * S)


def test_indexer_loss_matches_the_formula():
    m = ours_model(ONE_LAYER).train()
    attn = m.layers[0].self_attention
    seen = {}
    attn.register_forward_pre_hook(lambda mod, args: seen.update(x=args[0].detach()))
    x = ids(3)
    out = m(x, labels=x)
    ref = reference_indexer_loss(attn, seen["x"], 0.7)
    # measured 7.2e-7 relative (fp32 against fp64)
    assert abs(out.indexer_loss.item() - ref.item()) <= 5e-6 * abs(ref.item()), (out.indexer_loss.item(), ref)
    # evaluation (and coefficient 0) computes none
    assert m.eval()(x, labels=x).indexer_loss is None


def test_indexer_loss_trains_the_indexers_only():
    """The gradient of the indexer loss reaches every indexer's weights (the MTP layer's too) and nothing
    else: the other weights' gradients with coefficient 0 and 1 are the same; recomputing every block
    gives the same gradients."""
    from lit_moe.strategies.recompute import apply_recompute

    cfg = {**V32, "num_nextn_predict_layers": 1}
    grads = {}
    for coeff in (0.0, 1.0, "recompute"):
        m = ours_model({**cfg, "dsa_indexer_loss_coeff": 1.0 if coeff == "recompute" else coeff}).train()
        if coeff == "recompute":
            apply_recompute(m, {"mode": "full", "full_recompute_layer": [0, 1, 2, 3]}, None)
        x = ids()
        out = m(x, labels=x)
        objective = out.loss + out.aux_loss + out.mtp_loss + (out.indexer_loss if coeff else 0.0)
        objective.backward()
        grads[coeff] = {n: p.grad for n, p in m.named_parameters()}
    indexer = [n for n in grads[1.0] if ".indexer." in n]
    assert {n.split(".indexer.")[0] for n in indexer} == {"layers.0.self_attention", "layers.1.self_attention",
                                                         "layers.2.self_attention", "mtp.0.layer.self_attention"}
    assert all(grads[0.0][n] is None and grads[1.0][n].abs().sum() > 0 for n in indexer)
    others = [n for n in grads[1.0] if ".indexer." not in n and grads[0.0][n] is not None]
    assert len(others) > 20
    # measured 0 (the indexer's inputs and the target leave the main model's graph)
    assert all(torch.equal(grads[0.0][n], grads[1.0][n]) for n in others)
    assert all(torch.equal(grads["recompute"][n], g) for n, g in grads[1.0].items() if g is not None)   # measured 0


def test_training_moves_the_indexer_and_logs_its_loss(tmp_path, capsys):
    """A few optimizer steps on the objective change the indexers' weights and lower their loss; a
    ``lit_moe fit`` run adds it to the objective and logs it."""
    from helpers import tiny_config, write_config
    from lit_moe.cli import main

    m = ours_model({**ONE_LAYER, "dsa_indexer_loss_coeff": 1.0}).train()
    before = {n: p.detach().clone() for n, p in m.named_parameters() if ".indexer." in n}
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.0)
    x = ids()
    losses = []
    for _ in range(6):
        out = m(x, labels=x)
        (out.loss + out.indexer_loss).backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.indexer_loss.item())
    after = dict(m.named_parameters())
    assert all(not torch.equal(before[n], after[n]) for n in before)
    assert losses[-1] < 0.8 * losses[0], losses
    cfg = tiny_config(tmp_path, steps=2)
    cfg["model"].update(experimental_attention_variant="dsa", index_topk=6,
                        index_n_heads=2, index_head_dim=16, dsa_indexer_loss_coeff=0.5,
                        dsa_indexer_use_sparse_loss=True)
    assert main(["fit", "--config", str(write_config(tmp_path, cfg))]) == 0, capsys.readouterr().err
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step 2/2")]
    assert lines and "indexer_loss" in lines[0], lines


# ----------------------------------------------------------------------------------------------
# DeepSeek-V3.2's dense warm-up stage (dsa_indexer_use_sparse_loss: false, MindFormers' default)
# ----------------------------------------------------------------------------------------------
WARM_UP = {"dsa_indexer_use_sparse_loss": False, "dsa_indexer_loss_coeff": 0.7}


def test_dense_warm_up_loss_and_indexer_gradient_match_the_formula():
    """The dense stage's indexer loss (every causal key of each query, the heads' full attention as the
    target) and its gradient on each indexer weight against the hand reference in fp64 autograd."""
    m = ours_model({**ONE_LAYER, **WARM_UP}).train()
    attn = m.layers[0].self_attention
    seen = {}
    attn.register_forward_pre_hook(lambda mod, args: seen.update(x=args[0].detach()))
    x = ids(3)
    out = m(x, labels=x)
    out.indexer_loss.backward()
    weights = {n: p.detach().double().requires_grad_() for n, p in attn.indexer.named_parameters()}
    ref = reference_indexer_loss(attn, seen["x"], 0.7, dense=True, indexer_weights=weights)
    ref_grads = dict(zip(weights, torch.autograd.grad(ref, list(weights.values()))))
    # measured 6.9e-7 relative (fp32 against fp64)
    assert abs(out.indexer_loss.item() - ref.item()) <= 5e-6 * abs(ref.item()), (out.indexer_loss.item(), ref)
    sparse = reference_indexer_loss(attn, seen["x"], 0.7)            # the top-k stage's: 0.011 against 0.029
    assert abs(sparse.item() - ref.item()) > 0.1 * abs(ref.item())
    worst = 0.0
    for name, p in attn.indexer.named_parameters():
        g, r = p.grad.double(), ref_grads[name]
        worst = max(worst, ((g - r).norm() / r.norm()).item())
    assert worst <= 5e-6, worst   # measured 7.2e-7 (relative norm, the worst of the five weights)


def test_dense_warm_up_attends_every_key_and_trains_the_indexers_only(tmp_path):
    """The dense stage: the MLA attends every key (training and evaluation forwards and cached generation
    equal transformers' DeepseekV32 with index_topk = the sequence length on the same weights); every
    parameter but the indexers' (the MTP layer's too) is frozen at construction and gets no gradient."""
    from lit_moe.model.generate import LatentCache, forward_step

    x = ids()
    with_mtp = ours_model({**V32, **WARM_UP, "num_nextn_predict_layers": 1})
    trainable = {n for n, p in with_mtp.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in with_mtp.named_parameters() if ".indexer." in n}
    assert {n.split(".indexer.")[0] for n in trainable} == {"layers.0.self_attention", "layers.1.self_attention",
                                                            "layers.2.self_attention", "mtp.0.layer.self_attention"}
    out = with_mtp.train()(x, labels=x)
    (out.loss + out.aux_loss + out.mtp_loss + out.indexer_loss).backward()
    assert all((p.grad is not None) == (n in trainable) for n, p in with_mtp.named_parameters())
    m = ours_model({**V32, **WARM_UP})     # (transformers' DeepseekV32ForCausalLM loads no MTP layer)
    outputs = {}
    m.layers[2].self_attention.register_forward_hook(lambda mod, args, out: outputs.update({mod.training: out}))
    m.train()(x, labels=x)
    with torch.no_grad():
        ours = m.eval()(x).logits
    assert torch.equal(outputs[True], outputs[False])     # the training forward attends as the evaluation one
    m.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "index_topk": SEQ}))
    with torch.no_grad():
        dense = hf_load(tmp_path)(x).logits
        sparse = ours_model(V32)(x).logits   # the same weights, top-6
    # measured 2.6e-6 (logits up to 3.4); the top-6 selection moves them by 4.5
    assert (ours - dense).abs().max().item() <= 2e-5
    assert (sparse - dense).abs().max().item() > 0.5
    # generation: a cached step attends every cached key too
    cache, valid = LatentCache(), torch.ones_like(x[:1], dtype=torch.bool)
    positions = torch.arange(SEQ)[None]
    with torch.no_grad():
        forward_step(m, x[:1, :SEQ - 1], positions[:, :SEQ - 1], valid[:, :SEQ - 1], cache)
        step = forward_step(m, x[:1, SEQ - 1:], positions[:, SEQ - 1:], valid, cache)
    assert (step - ours[:1, -1]).abs().max().item() <= 1e-5   # measured 1.3e-6


def test_dense_warm_up_with_lora_is_one_line(tmp_path, capsys):
    """LoRA freezes every base weight, the indexers too: with the warm-up stage (which trains the indexers
    only) nothing the stage trains would move. One line naming both keys, no run."""
    from helpers import tiny_config, write_config

    from lit_moe.cli import main

    cfg = tiny_config(tmp_path, steps=1)
    cfg["model"] = {**V32, **WARM_UP, "model_type": "deepseek_v32", "experimental_attention_variant": "dsa",
                    "seq_length": cfg["model"]["seq_length"]}
    cfg["lora_config"] = {"target_modules": "o_proj", "lora_rank": 2}
    code = main(["fit", "--config", str(write_config(tmp_path, cfg)), "--trainer.accelerator", "cpu"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1, err
    assert "lora_config" in err[0] and "dsa_indexer_use_sparse_loss" in err[0], err
