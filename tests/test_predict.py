"""Generation (lit_moe/model/generate.py, the MLA latent cache in lit_moe/model/attention.py) and ``lit_moe
predict``: greedy tokens equal to transformers' ``DeepseekV3ForCausalLM.generate`` on the same weights
(left-padded batch, end-of-sequence), hand-computed nucleus filter, seeded sampling, one-line errors."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import transformers  # the judge

from helpers import ROOT, child_env, randomize_norms_and_biases, tiny_config, write_config, torchrun
from lit_moe.cli import main as cli_main
from lit_moe.model.generate import LatentCache, forward_step, generate, left_pad, top_p_filter
from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM
from lit_moe.model.mindformers_defaults import read_pynative_model_section

PROMPTS = [[5, 17, 99, 3, 42, 8, 77], [11, 2, 64], [100, 7, 7, 30, 1]]


def model_section(tmp_path) -> dict:
    """The tests' tiny model section (vocabulary 300: the byte tokenizer's 257 ids fit)."""
    section = tiny_config(tmp_path)["model"]
    # initializer_range 0.1: attention sharp enough that a position off by one changes the greedy tokens
    section.update(compute_dtype="float32", vocab_size=300, max_position_embeddings=64, seq_length=32,
                   initializer_range=0.1)
    return section


def our_model(tmp_path, **overrides) -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    section = {**model_section(tmp_path), **overrides}
    m = DeepseekV3ForCausalLM(DeepseekV3Config(**read_pynative_model_section(section))).eval()
    randomize_norms_and_biases(m, seed=1)
    return m


def hf_generate(path, prompts, new_tokens, pad, eos=None, cls="DeepseekV3ForCausalLM") -> list[list[int]]:
    hf = getattr(transformers, cls).from_pretrained(path, attn_implementation="eager").eval()
    ids, valid = left_pad(prompts, pad)
    out = hf.generate(input_ids=ids, attention_mask=valid.long(), max_new_tokens=new_tokens, do_sample=False,
                      pad_token_id=pad, eos_token_id=eos)
    rows = out[:, ids.shape[1]:].tolist()
    return [r[:r.index(eos) + 1] if eos in r else r for r in rows]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("predict")
    m = our_model(tmp)
    m.save_pretrained(tmp / "hf")
    return tmp, m


def test_greedy_equals_transformers_generate(exported):
    """A left-padded batch of three prompts, 12 new tokens each: token for token transformers'; each
    prompt alone gives its batched tokens (padding shifts no position); an end-of-sequence token
    ends its row (padded after it in transformers)."""
    tmp, m = exported
    ours = generate(m, PROMPTS, 12, pad_id=0)
    assert ours == hf_generate(tmp / "hf", PROMPTS, 12, pad=0)
    assert [generate(m, [p], 12, pad_id=0)[0] for p in PROMPTS] == ours
    assert len({tuple(r) for r in ours}) == 3 and all(len(set(r)) > 2 for r in ours)   # not one repeated token
    k = next(i for i in range(2, 12) if ours[1][i] not in ours[1][:i])
    eos = ours[1][k]   # ends the second row after k + 1 tokens (and any row that meets it)
    ended = generate(m, PROMPTS, 12, pad_id=0, eos_id=eos)
    assert ended == hf_generate(tmp / "hf", PROMPTS, 12, pad=0, eos=eos)
    assert ended[1] == ours[1][:k + 1] and ended != ours


def test_left_padding_keeps_positions_with_learned_position_embeddings(tmp_path):
    """Learned absolute positions (where a position counted from the batch's first column would
    show, rotary angles being relative): the batched tokens are each prompt's alone, decoded without
    the cache by full forwards."""
    m = our_model(tmp_path, position_embedding_type="learned_absolute")
    batched = generate(m, PROMPTS, 6, pad_id=0)
    for prompt, row in zip(PROMPTS, batched):
        text = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                text.append(int(m(torch.tensor([text])).logits[0, -1].argmax()))
        assert row == text[len(prompt):]


def test_cache_holds_the_compressed_latent_and_equals_the_full_forward(exported):
    """The cache holds [B, T, kv_lora_rank] latents and [B, T, 1, rope] keys per layer, and the last
    position's logits after prefill + 3 cached steps equal one uncached forward of the whole text."""
    _, m = exported
    text = torch.tensor([PROMPTS[0] + [9, 4, 250]])
    cache, valid = LatentCache(), torch.ones_like(text, dtype=torch.bool)
    positions = torch.arange(text.shape[1])[None]
    forward_step(m, text[:, :7], positions[:, :7], valid[:, :7], cache)
    for t in range(7, 10):
        logits = forward_step(m, text[:, t:t + 1], positions[:, t:t + 1], valid[:, :t + 1], cache)
    c = m.config
    assert sorted(cache.layers) == list(range(c.num_hidden_layers))
    latent, k_pe = cache.layers[0]
    assert latent.shape == (1, 10, c.kv_lora_rank) and k_pe.shape == (1, 10, 1, c.qk_rope_head_dim)
    with torch.no_grad():
        full = m(text).logits[:, -1]
    assert (logits - full).abs().max().item() <= 1.5e-5   # measured 1.55e-6 (logits up to 2.2)


def cached_steps_against_full_forwards(m, text: torch.Tensor, prefill: int) -> tuple[LatentCache, float]:
    """Prefill ``text [1, T]``'s first tokens, then one cached step per token: the cache and the largest
    difference of a step's logits from an uncached forward of the text so far."""
    cache, valid = LatentCache(), torch.ones_like(text, dtype=torch.bool)
    positions = torch.arange(text.shape[1])[None]
    forward_step(m, text[:, :prefill], positions[:, :prefill], valid[:, :prefill], cache)
    worst = 0.0
    with torch.no_grad():
        for t in range(prefill, text.shape[1]):
            logits = forward_step(m, text[:, t:t + 1], positions[:, t:t + 1], valid[:, :t + 1], cache)
            worst = max(worst, (logits - m(text[:, :t + 1]).logits[:, -1]).abs().max().item())
    return cache, worst


# DeepSeek-V3.2 (MindFormers' spelling): each query attends to the indexer's 4 best keys; no MTP layer
# (transformers' DeepseekV32ForCausalLM has none to load)
DSA = dict(experimental_attention_variant="dsa", dsa_indexer_topk=4, dsa_indexer_n_heads=4, dsa_indexer_head_dim=16,
           dsa_indexer_use_sparse_loss=True, num_nextn_predict_layers=0)


@pytest.fixture(scope="module")
def exported_dsa(tmp_path_factory):
    from test_deepseek_v32 import randomize_norms   # the indexer's LayerNorm bias too

    tmp = tmp_path_factory.mktemp("predict_dsa")
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM(DeepseekV3Config(**read_pynative_model_section({**model_section(tmp), **DSA}))).eval()
    randomize_norms(m, seed=1)
    m.save_pretrained(tmp / "hf")
    return tmp, m


def test_dsa_cache_holds_the_indexer_keys_and_equals_the_full_forward(exported_dsa):
    """DeepSeek-V3.2: the cache also holds each layer's indexer keys [B, T, index_head_dim]; after a
    7-token prefill each cached step's logits equal an uncached forward of the text so far (each new
    query's top-k among every token's keys), and the selection matters (every key allowed: 2.1 away)."""
    _, m = exported_dsa
    text = torch.tensor([PROMPTS[0] + [9, 4, 250, 17, 3]])
    cache, worst = cached_steps_against_full_forwards(m, text, prefill=7)
    with torch.no_grad():
        full = m(text).logits[:, -1]
        indexers = [layer.self_attention.indexer for layer in m.layers]
        for indexer in indexers:
            indexer.topk = text.shape[1]
        dense = m(text).logits[:, -1]
        for indexer in indexers:
            indexer.topk = 4
    assert worst <= 1.5e-5   # measured 1.8e-6 (logits up to 3.3)
    assert (dense - full).abs().max().item() > 0.5
    assert sorted(cache.index_keys) == list(range(m.config.num_hidden_layers))
    assert all(k.shape == (1, text.shape[1], m.config.index_head_dim) for k in cache.index_keys.values())


def test_dsa_greedy_equals_transformers_generate(exported_dsa):
    """DeepSeek-V3.2's greedy tokens are transformers' ``DeepseekV32ForCausalLM.generate``'s (its indexer
    key cache) on the same weights, for the left-padded batch and for each prompt alone, 12 new tokens
    (up to 19 tokens: the top-4 selection is at work); an end-of-sequence token ends its row."""
    tmp, m = exported_dsa
    ours = generate(m, PROMPTS, 12, pad_id=0)   # (eos -1 below: no end token, as here; its config says 1)
    assert ours == hf_generate(tmp / "hf", PROMPTS, 12, pad=0, eos=-1, cls="DeepseekV32ForCausalLM")
    assert len({tuple(r) for r in ours}) == 3 and all(len(set(r)) > 2 for r in ours)
    for prompt in PROMPTS:
        assert generate(m, [prompt], 12, pad_id=0) == hf_generate(tmp / "hf", [prompt], 12, pad=0, eos=-1,
                                                                  cls="DeepseekV32ForCausalLM")
    eos = ours[0][3]
    ended = generate(m, PROMPTS, 12, pad_id=0, eos_id=eos)
    assert ended == hf_generate(tmp / "hf", PROMPTS, 12, pad=0, eos=eos, cls="DeepseekV32ForCausalLM")
    assert ended[0] == ours[0][:4]


# grouped-query attention (pynative.yaml spellings): Qwen3-MoE (softmax router, q/k norms, whole-head rotary) and
# GLM-4-MoE (q/k/v biases, q/k norms, partial rotary: 8 of 16 dims); 2 key/value heads for 4 query heads
GQA = {
    "qwen3_moe": dict(model_type="qwen3_moe", architectures="Qwen3MoeForCausalLM", moe_router_score_function="softmax",
                      scoring_func="softmax", routed_scaling_factor=1.0, n_group=1, topk_group=1, n_shared_experts=0,
                      moe_shared_expert_intermediate_size=None, moe_router_enable_expert_bias=False,
                      norm_topk_prob=True),
    "glm4_moe": dict(model_type="glm4_moe", architectures="Glm4MoeForCausalLM", attention_bias=True,
                     partial_rotary_factor=0.5),
}
HF_CLASS = {"qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}


def gqa_section(tmp, family: str) -> dict:
    return {**model_section(tmp), **GQA[family], "multi_latent_attention": False, "num_key_value_heads": 2,
            "head_dim": 16, "qk_layernorm": True, "position_embedding_type": "rope", "num_nextn_predict_layers": 0}


def gqa_model(tmp, family: str) -> DeepseekV3ForCausalLM:
    """A grouped-query family's model with random norms, router biases (GLM-4) and q/k/v biases (as the
    family tests build it), exported to ``tmp / "hf"``."""
    from test_families import ours_model

    m = ours_model(DeepseekV3Config(**read_pynative_model_section(gqa_section(tmp, family))))
    m.save_pretrained(tmp / "hf")
    return m


@pytest.fixture(scope="module", params=list(GQA))
def exported_gqa(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"predict_{request.param}")
    return tmp, gqa_model(tmp, request.param), request.param


def test_gqa_cache_holds_keys_and_values_and_equals_the_full_forward(exported_gqa):
    """Qwen3-MoE / GLM-4-MoE: the cache holds each layer's keys and values [B, T, kv_heads, head_dim]
    (normed, rotated); after a 7-token prefill each cached step's logits equal an uncached forward of
    the text so far."""
    _, m, _ = exported_gqa
    text = torch.tensor([PROMPTS[0] + [9, 4, 250, 17, 3]])
    cache, worst = cached_steps_against_full_forwards(m, text, prefill=7)
    assert worst <= 1.5e-5   # measured 1.4e-6 (qwen3_moe), 1.6e-6 (glm4_moe); logits up to 3.5
    c = m.config
    assert sorted(cache.layers) == list(range(c.num_hidden_layers))
    assert all(k.shape == v.shape == (1, text.shape[1], 2, 16) for k, v in cache.layers.values())


def test_gqa_greedy_equals_transformers_generate(exported_gqa):
    """Qwen3-MoE / GLM-4-MoE: greedy tokens are transformers' ``Qwen3MoeForCausalLM.generate`` /
    ``Glm4MoeForCausalLM.generate``'s on the same weights, for the left-padded batch and each prompt
    alone (12 new tokens); an end-of-sequence token ends its row."""
    tmp, m, family = exported_gqa
    ours = generate(m, PROMPTS, 12, pad_id=0)
    assert ours == hf_generate(tmp / "hf", PROMPTS, 12, pad=0, eos=-1, cls=HF_CLASS[family])
    assert [generate(m, [p], 12, pad_id=0)[0] for p in PROMPTS] == ours
    assert len({tuple(r) for r in ours}) == 3 and all(len(set(r)) > 2 for r in ours)
    eos = ours[2][3]
    ended = generate(m, PROMPTS, 12, pad_id=0, eos_id=eos)
    assert ended == hf_generate(tmp / "hf", PROMPTS, 12, pad=0, eos=eos, cls=HF_CLASS[family])
    assert ended[2] == ours[2][:ours[2].index(eos) + 1]


# DeepSeek-V4 (the family tests' model: sliding, CSA with its indexer (top 3 entries), HCA layers; 3 mHC streams;
# 2 hash-routed layers) with 8 indexer heads: with 2, a score is often exactly 0 (every head's ReLU), and the
# top-k among tied zeros is the kernel's choice, which a forward of 20 queries and a step of one may make apart
# (transformers' alike)
V4_PROMPTS = [[5, 17, 99, 3, 42, 8, 77], [11, 2, 64], [100, 7, 30]]


@pytest.fixture(scope="module")
def exported_v4(tmp_path_factory):
    from test_family_v4 import V4, ours_model

    tmp = tmp_path_factory.mktemp("predict_v4")
    m = ours_model(dict(V4, index_n_heads=8))
    m.save_pretrained(tmp / "hf")
    return tmp, m


def test_v4_cached_steps_equal_the_full_forward(exported_v4):
    """DeepSeek-V4: after a 3-token prefill (no compressed window complete yet) each cached step's logits
    equal an uncached forward of the text so far, through 24 tokens (CSA entries at 4, 8, ...: the
    indexer choosing 3 of up to 6; HCA entries at 8 and 16; the 6-token sliding window moving on); the
    cache holds each layer's rotated key/values [B, T, head_dim] and its attention inputs [B, T, hidden]."""
    _, m = exported_v4
    text = torch.tensor([V4_PROMPTS[0] + [9, 4, 50, 17, 3, 8, 99, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    cache, worst = cached_steps_against_full_forwards(m, text, prefill=3)
    assert worst <= 3e-5   # measured 3.6e-6 (logits up to 2.6)
    c = m.config
    assert sorted(cache.layers) == list(range(c.num_hidden_layers))
    assert all(kv.shape == (1, 24, c.gqa_head_dim) and x.shape == (1, 24, c.hidden_size)
               for kv, x in cache.layers.values())


def test_v4_greedy_equals_transformers_generate(exported_v4):
    """DeepSeek-V4's greedy tokens (16 new) are transformers' ``DeepseekV4ForCausalLM.generate``'s (its
    sliding-window, compressor and indexer caches) on the same weights: the two 3-token prompts as one
    batch, the 7-token one alone (V4 batches prompts of one length only); an end-of-sequence token ends
    its row."""
    tmp, m = exported_v4
    ours = generate(m, V4_PROMPTS, 16, pad_id=0)
    assert [ours[0]] == hf_generate(tmp / "hf", V4_PROMPTS[:1], 16, pad=0, eos=-1, cls="DeepseekV4ForCausalLM")
    assert ours[1:] == hf_generate(tmp / "hf", V4_PROMPTS[1:], 16, pad=0, eos=-1, cls="DeepseekV4ForCausalLM")
    assert len({tuple(r) for r in ours}) == 3 and all(len(set(r)) > 4 for r in ours)
    eos = ours[2][5]
    ended = generate(m, V4_PROMPTS[1:], 16, pad_id=0, eos_id=eos)
    assert ended == hf_generate(tmp / "hf", V4_PROMPTS[1:], 16, pad=0, eos=eos, cls="DeepseekV4ForCausalLM")
    assert ended[1] == ours[2][:ours[2].index(eos) + 1]


def test_predict_refuses_a_sliding_window():
    """What the cached decoder does not run is refused by name."""
    from lit_moe.config import ConfigError
    from lit_moe.tools.predict import check_model
    from test_parallel_numerics import model_section as layout_section

    with pytest.raises(ConfigError, match=r"^model\.window_size: \(5, 0\): predict has no sliding-window cache"):
        check_model(DeepseekV3Config(**layout_section(0, window=True)))


def test_top_p_filter_hand_computed():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    # sorted 0.5, 0.3, 0.15, 0.05: cumulative before each 0, 0.5, 0.8, 0.95
    assert torch.allclose(top_p_filter(probs, 0.7), torch.tensor([[0.0, 0.625, 0.0, 0.375]]))
    assert torch.allclose(top_p_filter(probs, 0.5), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    assert torch.allclose(top_p_filter(probs, 0.85), torch.tensor([[0.0, 0.5, 0.15, 0.3]]) / 0.95)
    assert torch.equal(top_p_filter(probs, 1.0), probs)


def test_sampling_is_seeded(exported):
    _, m = exported
    a = generate(m, PROMPTS, 8, pad_id=0, temperature=1.5, top_p=0.95, seed=3)
    assert a == generate(m, PROMPTS, 8, pad_id=0, temperature=1.5, top_p=0.95, seed=3)
    assert a != generate(m, PROMPTS, 8, pad_id=0, temperature=1.5, top_p=0.95, seed=4)
    assert a != generate(m, PROMPTS, 8, pad_id=0)
    # a nucleus of one token is greedy decoding
    assert generate(m, PROMPTS, 8, pad_id=0, temperature=1.0, top_p=1e-6, seed=5) == generate(m, PROMPTS, 8, pad_id=0)


def _predict(capsys, *args) -> tuple[int, list[dict], str]:
    rc = cli_main(["predict", *args])
    out, err = capsys.readouterr()
    return rc, [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")], err


def test_predict_cli_on_a_hugging_face_directory(exported, capsys):
    """Two --prompt and a prompts file form one batch, tokenized by the byte tokenizer; the tokens are
    transformers' greedy ones for the same byte ids."""
    tmp, m = exported
    config = write_config(tmp, {"model": model_section(tmp), "run_mode": "predict",
                                "checkpoint": {"load_path": str(tmp / "hf")}}, "predict.yaml")
    (tmp / "prompts.txt").write_text("Emma\n\n  \nPride and\n")
    texts = ["It is a truth", "Mr. D"]
    rc, rows, err = _predict(capsys, "--config", str(config), "--prompt", texts[0], "--prompt", texts[1],
                             "--prompts-file", str(tmp / "prompts.txt"), "--tokenizer", "byte", "--max-new-tokens", "6")
    assert rc == 0, err
    texts += ["Emma", "Pride and"]
    assert [r["prompt"] for r in rows] == texts
    byte_ids = [list(t.encode()) for t in texts]
    expected = hf_generate(tmp / "hf", byte_ids, 6, pad=256, eos=256)
    assert [r["tokens"] for r in rows] == expected


@pytest.mark.parametrize("case", ["missing_checkpoint", "empty_prompt", "too_long", "no_prompt", "pipeline",
                                  "lora_multi_process", "bad_jsonl"])
def test_predict_bad_input_is_one_line(exported, capsys, monkeypatch, case):
    tmp, _ = exported
    config = write_config(tmp, {"model": model_section(tmp)}, "bad.yaml")
    (tmp / "bad.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n')
    args = {"missing_checkpoint": ["--checkpoint", str(tmp / "nowhere"), "--prompt", "a"],
            "empty_prompt": ["--checkpoint", str(tmp / "hf"), "--prompt", "a", "--prompt", ""],
            "too_long": ["--checkpoint", str(tmp / "hf"), "--prompt", "x" * 60, "--max-new-tokens", "5"],
            "no_prompt": ["--checkpoint", str(tmp / "hf")],
            "pipeline": ["--checkpoint", str(tmp / "hf"), "--prompt", "a"],
            "lora_multi_process": ["--checkpoint", str(tmp / "hf"), "--prompt", "a"],
            "bad_jsonl": ["--checkpoint", str(tmp / "hf"), "--prompts-file", str(tmp / "bad.jsonl")]}[case]
    if case in ("pipeline", "lora_multi_process"):   # refused before any process group starts
        extra = {"parallelism": {"pipeline_parallel": 2}} if case == "pipeline" else {"lora_config": {"lora_rank": 4}}
        config = write_config(tmp, {"model": model_section(tmp), **extra}, f"{case}.yaml")
        monkeypatch.setenv("WORLD_SIZE", "2")
    rc, rows, err = _predict(capsys, "--config", str(config), "--tokenizer", "byte", *args)
    lines = err.strip().splitlines()
    assert rc == 2 and rows == [] and len(lines) == 1 and "Traceback" not in err, err
    expected = {"missing_checkpoint": "nowhere", "empty_prompt": "prompt 2", "too_long": "max_position_embeddings 64",
                "no_prompt": "at least one prompt", "pipeline": "parallelism.pipeline_parallel: 2",
                "lora_multi_process": "lora_config: predict merges", "bad_jsonl": "bad.jsonl:2"}[case]
    assert lines[0].startswith("lit_moe predict: error:") and expected in lines[0], lines[0]


LAYOUTS = {"tp2": {"tensor_parallel": 2}, "ep2": {"expert_parallel": 2},
           "tp2_ep2": {"tensor_parallel": 2, "expert_parallel": 2}}
SAMPLING = ["--temperature", "1.5", "--top-p", "0.9", "--seed", "3"]


@pytest.mark.timeout(900)
def test_predict_under_tp_and_ep_equals_one_process(exported):
    """One torchrun launch of 2 ranks generates under tp2, ep2 and tp2·ep2 (each rank loading its pieces
    of the Hugging Face directory, and under tp2·ep2 also of our own checkpoint): rank 0 alone prints,
    greedy tokens are transformers' (as in one process), and seeded sampling draws one process's tokens.
    GLM-4-MoE (grouped-query attention: each rank caches the keys and values of its one key/value head)
    and DeepSeek-V4 (each rank its heads and sinks, the replicated compressors and mHC streams, hash-routed
    experts over the ep ranks) under tp2·ep2 too: transformers' greedy tokens."""

    from test_checkpoint_hf import _save_iteration

    tmp, m = exported
    if not (tmp / "ckpt").exists():
        _save_iteration(m, tmp / "ckpt")
    from test_family_v4 import V4, ours_model

    (tmp / "glm4").mkdir(exist_ok=True)
    gqa_model(tmp / "glm4", "glm4_moe")
    v4 = dict(V4, index_n_heads=8, vocab_size=300)   # the byte tokenizer's ids
    ours_model(v4).save_pretrained(tmp / "v4" / "hf")
    texts = ["It is a truth", "Mr. D", "Emma"]
    configs = [str(write_config(tmp, {"model": model_section(tmp), "parallelism": LAYOUTS[name]}, f"{name}.yaml"))
               for name in LAYOUTS]
    families = [f"{write_config(tmp, {'model': section, 'parallelism': LAYOUTS['tp2_ep2']}, f'{name}_tp2_ep2.yaml')}"
                f"::{tmp / name / 'hf'}" for name, section in (("glm4", gqa_section(tmp, "glm4_moe")), ("v4", v4))]
    proc = torchrun(2, [__file__, "--worker", str(tmp / "hf"), str(tmp / "ckpt"), *families, *configs], cwd=tmp,
                    env=child_env(ROOT / "tests"), timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    runs: dict[str, list[list[int]]] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RUN "):
            key = line.split()[1]
            runs[key] = []
        elif line.startswith("{"):
            runs[key].append(json.loads(line)["tokens"])
    byte_ids = [list(t.encode()) for t in texts]
    greedy = hf_generate(tmp / "hf", byte_ids, 8, pad=256, eos=256)
    sampled = generate(m, byte_ids, 8, pad_id=256, eos_id=256, temperature=1.5, top_p=0.9, seed=3)
    assert sampled != greedy
    expected_runs = [f"{n}_{mode}" for n in LAYOUTS for mode in ("greedy", "sampled")] + [
        "ckpt_tp2_ep2_greedy", "glm4_tp2_ep2_greedy", "v4_tp2_ep2_greedy"]
    assert sorted(runs) == sorted(expected_runs), proc.stdout
    assert runs["ckpt_tp2_ep2_greedy"] == greedy
    glm4_greedy = hf_generate(tmp / "glm4" / "hf", byte_ids, 8, pad=256, eos=256, cls="Glm4MoeForCausalLM")
    assert runs["glm4_tp2_ep2_greedy"] == glm4_greedy and glm4_greedy != greedy
    # V4: each prompt alone (its own length)
    v4_greedy = [hf_generate(tmp / "v4" / "hf", [ids], 8, pad=256, eos=256, cls="DeepseekV4ForCausalLM")[0]
                 for ids in byte_ids]
    assert runs["v4_tp2_ep2_greedy"] == v4_greedy and v4_greedy != greedy
    for name in LAYOUTS:
        assert runs[f"{name}_greedy"] == greedy, name      # three rows each: rank 1 printed nothing
        assert runs[f"{name}_sampled"] == sampled, name


def _worker(hf_dir: str, ckpt_dir: str, configs: list[str]) -> None:
    """Under torchrun: ``lit_moe predict`` on each config, greedy then sampled, the last config on our
    checkpoint, and each ``CONFIG::DIR`` of another family greedy on its directory, in one process group."""
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo")
    from lit_moe.runtime.distributed import release_process_groups_at_exit
    release_process_groups_at_exit()  # no gloo thread outlives the interpreter
    families = [tuple(c.split("::")) for c in configs if "::" in c]
    configs = [c for c in configs if "::" not in c]
    runs = [(config, hf_dir, mode, extra) for config in configs
            for mode, extra in (("greedy", []), ("sampled", SAMPLING))] + [(configs[-1], ckpt_dir, "greedy", [])]
    runs += [(config, directory, "greedy", []) for config, directory in families]
    for config, checkpoint, mode, extra in runs:
        if os.environ["RANK"] == "0":
            source = "ckpt_" if checkpoint == ckpt_dir else ""
            print(f"RUN {source}{os.path.basename(config)[:-5]}_{mode}", flush=True)
        rc = cli_main(["predict", "--config", config, "--checkpoint", checkpoint, "--tokenizer", "byte",
                       "--max-new-tokens", "8", "--prompt", "It is a truth", "--prompt", "Mr. D",
                       "--prompt", "Emma", *extra])
        assert rc == 0
        sys.stdout.flush()
    dist.destroy_process_group()


def test_fit_on_a_predict_config_points_to_predict(tmp_path, capsys):
    config = write_config(tmp_path, {**tiny_config(tmp_path), "run_mode": "predict"}, "p.yaml")
    assert cli_main(["fit", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run_mode: 'predict'" in err[0] and "lit_moe predict" in err[0]


@pytest.mark.parametrize("case", ["no_save", "not_empty", "shard_size"])
def test_save_hf_at_end_is_checked_before_training(tmp_path, capsys, case):
    out = tmp_path / "hf"
    if case == "not_empty":
        out.mkdir()
        (out / "config.json").write_text("{}")
    cfg = tiny_config(tmp_path)
    cfg["checkpoint"].update(enable_save=case != "no_save", save_hf_at_end=str(out),
                             save_hf_max_shard_size="5 parsecs" if case == "shard_size" else "5GB")
    assert cli_main(["fit", "--config", str(write_config(tmp_path, cfg))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    expected = {"no_save": "needs checkpoint.enable_save", "not_empty": "not an empty directory",
                "shard_size": "save_hf_max_shard_size: cannot parse"}[case]
    assert len(err) == 1 and "checkpoint.save_hf_" in err[0] and expected in err[0], err
    assert (out / "config.json").exists() == (case == "not_empty")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3], sys.argv[4:])
