"""The DeepSeek-V4 family (its attention with sliding / CSA / HCA layers, hash routing, mHC residual
streams, the SwiGLU clamp) against transformers' ``DeepseekV4ForCausalLM`` on the same weights, both
directions of its checkpoint layout, and the family's config rules."""

import json

import pytest
import torch

import transformers  # the judge

from helpers import randomize_norms_and_biases
from lit_moe.config import ConfigError
from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM
from lit_moe.model.hf import HFCheckpointError, hf_config_dict

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
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                                      output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


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
