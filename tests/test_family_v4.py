"""The DeepSeek-V4 family (its attention with sliding / CSA / HCA layers, hash routing, mHC residual
streams, the SwiGLU clamp) against transformers' ``DeepseekV4ForCausalLM`` on the same weights, both
directions of its checkpoint layout, and the family's config rules."""

import json

import pytest
import torch

import transformers  # the judge

from helpers import load_transformers_model, randomize_norms_and_biases, tiny_config, write_config
from lit_moe.config import ConfigError
from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM
from lit_moe.hf.checkpoint import HFCheckpointError, hf_config_dict

# every V4 attention kind (layer 1 and 3: CSA with an indexer that keeps 3 of up to 10 entries,
# layer 2: HCA), two hash-routed layers, three residual streams; 40 tokens span several windows
V4 = dict(model_type="deepseek_v4", vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
          num_attention_heads=4, head_dim=32, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2,
          o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=3, sliding_window=6,
          hc_mult=3, partial_rotary_factor=0.25, num_hash_layers=2, swiglu_limit=0.5,
          layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                       "compressed_sparse_attention"],
          compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
          compute_dtype="float32", initializer_range=0.1, num_nextn_predict_layers=0)


def randomize_v4(model, seed: int) -> None:
    """Random norms (1 + 0.2 N) and expert biases, plus V4's parameters whose starts are constants
    (sinks, compressor position biases, mHC base/scale, hc_head) and a random hash table with distinct
    experts per token; works on our model and on transformers' (names differ, shapes do not)."""
    randomize_norms_and_biases(model, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("sinks", "position_bias", "base", "hc_base"):
                t.copy_(0.5 * torch.randn(t.shape, generator=g))
            elif leaf in ("scale", "hc_scale"):
                t.copy_(1 + 0.5 * torch.randn(t.shape, generator=g))
            elif leaf == "tid2eid":
                E = 8
                t.copy_(torch.stack([torch.randperm(E, generator=g)[:t.shape[1]] for _ in range(t.shape[0])]))


def ours_model(cfg=V4, seed=0):
    torch.manual_seed(seed)
    m = DeepseekV3ForCausalLM(cfg).eval()
    randomize_v4(m, seed=1)
    return m


def hf_load(path):
    return load_transformers_model("DeepseekV4ForCausalLM", path)


def ids(seed=2):
    return torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(seed))


CASES = {
    "v4": V4,
    # sigmoid scores, fewer Sinkhorn rounds, every layer CSA
    "v4_sigmoid_csa": dict(V4, scoring_func="sigmoid", hc_sinkhorn_iters=3, num_hash_layers=1,
                           layer_types=["compressed_sparse_attention"] * 4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    m = ours_model(CASES[case])
    m.save_pretrained(tmp_path)
    hf = hf_load(tmp_path)
    x = ids()
    with torch.no_grad():
        err = (m(x).logits - hf(x).logits).abs().max().item()
    # measured 2.9e-6 (v4) and 2.4e-6 (v4_sigmoid_csa); each planted bug of benchmarks/planted_bugs.py: > 1e-3
    assert err <= 2e-5, err


def test_reads_a_checkpoint_written_by_transformers(tmp_path):
    """transformers' own config.json (no lit_moe block) and weights → our model, same logits; then
    our export of that model reads back bit-equal."""
    hf_cfg = hf_config_dict(DeepseekV3Config(**V4))
    hf_cfg.pop("lit_moe")
    torch.manual_seed(3)
    hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**hf_cfg)).eval()
    randomize_v4(hf, seed=4)
    hf.save_pretrained(tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "lit_moe" not in written and written["model_type"] == "deepseek_v4"
    ours = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", compute_dtype="float32").eval()
    c = ours.config
    assert (c.num_hash_layers, c.hc_mult, c.layer_types, c.enable_hc_head) == (2, 3, V4["layer_types"], True)
    assert (c.compress_rope_theta, c.num_nextn_predict_layers, c.v4_rope_dim) == (160000.0, 0, 8)
    x = ids(seed=4)
    with torch.no_grad():
        assert (ours(x).logits - hf(x).logits).abs().max().item() <= 2e-5   # measured 2e-6
    ours.save_pretrained(tmp_path / "ours")
    back = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "ours", compute_dtype="float32")
    a, b = ours.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_family_defaults_and_rules():
    c = DeepseekV3Config(model_type="deepseek_v4")
    # transformers' DeepseekV4Config defaults
    assert (c.v4_attention, c.enable_hyper_connections, c.enable_hc_head, c.num_hash_layers) == (True, True, True, 3)
    assert (c.scoring_func, c.swiglu_limit, c.v4_rope_dim, c.first_k_dense_replace) == ("sqrtsoftplus", 10.0, 64, 0)
    hf = transformers.DeepseekV4Config()   # the indexer sizes a deepseek_v4 section leaves out are V4's, not V3.2's
    assert (c.index_topk, c.index_n_heads, c.index_head_dim) == (hf.index_topk, hf.index_n_heads, hf.index_head_dim)
    assert c.layer_types[:4] == ["heavily_compressed_attention"] * 2 + ["heavily_compressed_attention",
                                                                        "compressed_sparse_attention"]
    assert DeepseekV3Config(**{**V4, "layer_types": None, "compress_ratios": [0, 4, 128, 4]}).layer_types == \
        ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
         "compressed_sparse_attention"]
    for bad, match in ((dict(layer_types=["sliding_attention"]), r"model\.layer_types: .* one attention type per"),
                       (dict(o_groups=3), r"model\.o_groups: 3 must divide num_attention_heads"),
                       (dict(position_embedding_type="yarn"), r"model\.position_embedding_type: 'yarn' is not"),
                       (dict(experimental_attention_variant="dsa"), r"model\.experimental_attention_variant: 'dsa'"),
                       (dict(enable_hyper_connections=False), r"model\.enable_hc_head: True needs enable_hyper"),
                       (dict(compress_ratios=[0, 4, 64, 4], layer_types=None), r"model\.compress_ratios: 64")):
        with pytest.raises(ConfigError, match=match):
            DeepseekV3Config(**{**V4, **bad})
    # tensor parallel keeps whole head groups of the grouped output projection on a rank
    from lit_moe.strategies.parallel_dims import ParallelDims, ParallelismError

    with pytest.raises(ParallelismError, match=r"^parallelism\.tensor_parallel: 4 must divide model\.o_groups 2 "):
        ParallelDims(world_size=4, tp=4).validate_model(DeepseekV3Config(**V4))
    # every context-parallel method (v4_cp2_tp2_ep2, v4_cp2_ulysses, v4_cp2_ulysses_async and
    # v4_cp4_hybrid_async in test_step_layouts.py), asynchronous ulysses / hybrid too
    from lit_moe.config import ParallelismConfig
    from lit_moe.strategies.parallel_dims import check_parallel_layout

    dims = ParallelDims(world_size=2, cp=2)
    dims.validate_model(DeepseekV3Config(**V4))
    for asynchronous in (False, True):
        check_parallel_layout(ParallelismConfig(context_parallel=2, context_parallel_method="ulysses",
                                                context_parallel_async=asynchronous), dims, DeepseekV3Config(**V4))
        check_parallel_layout(ParallelismConfig(context_parallel=4, context_parallel_method="hybrid",
                                                ulysses_degree_in_cp=2, context_parallel_async=asynchronous),
                              ParallelDims(world_size=4, cp=4), DeepseekV3Config(**V4))
    # asynchronous, its attention waits on the exchanges' handles: a compiled layer leaves it out
    from lit_moe.model.compile import own_graph_breaks
    from lit_moe.model.v4_attention import V4Attention
    from lit_moe.strategies.context_parallel import HeadShards

    attention = V4Attention(DeepseekV3Config(**V4), 0)
    assert not own_graph_breaks(attention)
    for asynchronous in (False, True):
        attention.hooks.head_shards = HeadShards(None, u=2, rank=0, asynchronous=asynchronous)
        assert own_graph_breaks(attention) == asynchronous


def test_export_refuses_what_transformers_cannot_hold():
    # MindFormers' PyNative DeepSeek-V4 trains it with MLA: no transformers DeepSeek-V4 holds that
    mla = dict(V4, experimental_attention_variant="mla", multi_latent_attention=True, kv_lora_rank=16,
               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    with pytest.raises(HFCheckpointError, match=r"deepseek_v4 checkpoint: model\.experimental_attention_variant: "
                                                r"'mla'"):
        hf_config_dict(DeepseekV3Config(**mla))
    # a DeepSeek-V3 with V4's residual streams is no Hugging Face DeepSeek-V3
    with pytest.raises(HFCheckpointError, match=r"DeepSeek-V3 checkpoint: model\.enable_hyper_connections: True"):
        hf_config_dict(DeepseekV3Config(enable_hyper_connections=True))
    with pytest.raises(ConfigError, match=r"config\.json: mlp_layer_types=\['moe', 'hash_moe'\] is not supported"):
        from lit_moe.hf.checkpoint import config_from_hf
        d = hf_config_dict(DeepseekV3Config(**dict(V4, num_hidden_layers=2, layer_types=V4["layer_types"][:2])))
        config_from_hf({**d, "lit_moe": None, "mlp_layer_types": ["moe", "hash_moe"]})


# ----------------------------------------------------------------------------------------------
# MindFormers' PyNative DeepSeek-V4 test config (MLA attention + mHC + hash routing)
# ----------------------------------------------------------------------------------------------
def mindformers_v4(tmp_path, steps):
    """pynative_deepseek4.yaml with its model shrunk (as test_mindformers_keys shrinks pynative_ds3.yaml)."""
    from test_mindformers_keys import DATA, shrunk

    import yaml

    cfg = shrunk("pynative_deepseek4.yaml", tmp_path)
    tiny = tiny_config(tmp_path, steps=steps, mock_data=False)   # the tiny corpus
    cfg["train_dataset"] = tiny["train_dataset"]
    cfg["training"].update(steps=steps)
    return cfg, yaml.safe_load((DATA / "pynative_deepseek4.yaml").read_text())


def test_mindformers_deepseek4_config_refuses_its_layout_then_trains_in_one_process(tmp_path, capsys):
    from lit_moe.cli import main
    from lit_moe.model.mindformers_defaults import read_pynative_model_section

    cfg, original = mindformers_v4(tmp_path, steps=3)
    one_process = dict(data_parallel_shard=1, expert_parallel=1, tensor_parallel=1, pipeline_parallel=1,
                       pipeline_parallel_interleave_num=1)
    # as written, what cannot work is refused in one line naming it: its recompute keys name paths inside a
    # layer with a "layers.*." prefix, which lit_moe's paths do not have
    assert main(["plan", "--config", str(write_config(tmp_path, original, "as_written.yaml")), "-n", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "recompute.select_module: 'layers.*.self_attention.*' matches no module" in err and "\n" not in err
    # with the paths themselves its layout plans: tp2 · pp2 (interleaved, mHC streams between stages) · dp2 · ep2
    original["recompute"]["select_module"] = {"self_attention.*": ["0-3"], "mlp.*": ["0-3"]}
    assert main(["plan", "--config", str(write_config(tmp_path, original, "as_written.yaml")), "-n", "8"]) == 0
    assert "pipeline rank 1: stages [1, 3]" in capsys.readouterr().out
    cfg["recompute"]["select_module"] = {"self_attention.*": ["0-3"], "mlp.*": ["0-3"]}
    # the model means what MindFormers makes of it: MLA attention, 4 mHC streams averaged at the end,
    # 3 hash-routed layers, sigmoid scores with expert bias, SwiGLU clamp 10 (its DeepseekV4Config default)
    c = DeepseekV3Config(**read_pynative_model_section(cfg["model"]))
    assert (c.v4_attention, c.multi_latent_attention, c.enable_hyper_connections, c.hc_mult) == (False, True, True, 4)
    assert (c.enable_hc_head, c.hc_sinkhorn_iters, c.num_hash_layers, c.scoring_func) == (False, 0, 3, "sigmoid")
    assert (c.swiglu_limit, c.num_nextn_predict_layers, c.routed_scaling_factor) == (10.0, 1, 2.5)
    # one process, the tiny corpus, three steps
    cfg["parallelism"].update(one_process)
    cfg["training"].update(global_batch_size=4, rampup_batch_size=None)
    cfg["model"]["vocab_size"] = 4096   # the tiny corpus's tokenizer
    path = write_config(tmp_path, cfg, "one_process.yaml")
    assert main(["fit", "--config", str(path)]) == 2   # bf16 master weights: lit_moe's rule, any family
    err = capsys.readouterr().err.strip()
    assert "model.params_dtype: the optimizer steps fp32 master weights" in err and "\n" not in err
    cfg["model"]["params_dtype"] = "float32"
    path = write_config(tmp_path, cfg, "one_process.yaml")
    assert main(["fit", "--config", str(path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "step 3/3 | loss" in out
