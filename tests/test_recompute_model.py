"""Recompute on the real DeepSeek-V3 model (the tiny config's shape, shortened): losses, routing
counts, expert-bias updates and every gradient are bitwise identical to the same model without
recompute, on CPU; the recomputed regions really run again; parameter names do not change."""

import copy
import pathlib

import pytest
import torch
import yaml

from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM
from lit_moe.strategies.recompute import apply_recompute, regions

# every pattern used here must select something
pytestmark = pytest.mark.filterwarnings("error::lit_moe.strategies.recompute.RecomputeWarning")

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())["model"]


def build(compute_dtype="float32", **overrides):
    section = dict(TINY, compute_dtype=compute_dtype, **overrides)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**section))
    model.init_weights(1234)
    return model.train()


def batch(vocab, b=2, s=32, seed=5):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, vocab, (b, s + 1), generator=g)
    mask = torch.ones(b, s)
    mask[0, -3:] = 0
    return dict(input_ids=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=mask)


def step(model, data):
    model.zero_grad(set_to_none=True)
    out = model(**data)
    (out.loss + out.aux_loss + out.mtp_loss).backward()
    res = dict(n_params=sum(1 for _ in model.parameters()), loss=out.loss.detach(), aux=out.aux_loss.detach(),
               mtp=out.mtp_loss.detach(),
               grads={n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
               counts=torch.stack([m.tokens_per_expert.clone() for m in model.moe_layers()]),
               assignments=[float(m.total_assignments) for m in model.moe_layers()],
               stats=[{k: v.clone() for k, v in m.last_stats.items()} for m in model.moe_layers()])
    model.update_expert_bias()  # the counts above feed the bias update: it must match too
    res["bias"] = torch.stack([m.router.expert_bias.clone() for m in model.moe_layers()])
    return res


def assert_identical(ref, got):
    for key in ("loss", "aux", "mtp", "counts", "bias"):
        assert torch.equal(ref[key], got[key]), key
    assert ref["assignments"] == got["assignments"]
    assert ref["grads"].keys() == got["grads"].keys() and len(ref["grads"]) == ref["n_params"]
    for name in ref["grads"]:
        assert torch.equal(ref["grads"][name], got["grads"][name]), name
    for a, b in zip(ref["stats"], got["stats"]):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


def call_counts(model):
    calls = {}
    for name, mod in model.named_modules():
        if name:
            mod.register_forward_hook(lambda m, i, o, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    return calls


CASES = {
    "full, every layer incl. MTP": ({"mode": "full", "full_recompute_layer": ["0-3"]}, None),
    "select": ({"mode": "select", "full_recompute_layer": [1],
                "select_module": {"self_attention": [0, 2], r"mlp\.(experts|router)": ["2-3"],
                                  r"self_attention\.(q_b_proj|kv_b_proj|(q|kv)_a_layernorm)": ["0-3"]}}, None),
    "output recompute of modules": (None, {"enable": True, "select_module": {
        "input_layernorm": ["0-3"], r"mlp\.shared_experts\.act": ["1-3"], "self_attention.q_a_layernorm": [0]}}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_identical_with_and_without_recompute(case):
    recompute, recompute_comm = CASES[case]
    base = build()
    data = batch(base.config.vocab_size)
    model = copy.deepcopy(base)
    names = list(model.state_dict())
    apply_recompute(model, recompute, recompute_comm)
    assert list(model.state_dict()) == names
    ref = step(base, data)
    assert ref["counts"].sum() > 0 and ref["aux"] > 0 and ref["mtp"] > 0
    got = step(model, data)
    assert_identical(ref, got)
    if case.startswith("full, every"):
        # a second step, after the bias update: still identical, counters not doubled
        data2 = batch(base.config.vocab_size, seed=6)
        assert_identical(step(base, data2), step(model, data2))


def test_recompute_of_one_fused_projection():
    """q_a_proj and kv_a_proj_with_mqa run as one GEMM (``fused_linear``); selecting one of them for
    recompute makes them run as their own modules (so the selected one's wrapper runs). The layer's
    input gradient is then a sum of two GEMMs instead of one: equal up to rounding, not bitwise."""
    base = build()
    data = batch(base.config.vocab_size)
    model = copy.deepcopy(base)
    apply_recompute(model, {"mode": "select", "select_module": {r"self_attention\.q_a_proj": ["0-3"]}}, None)
    assert regions(model.layers[0].self_attention.q_a_proj)
    ref, got = step(base, data), step(model, data)
    assert torch.equal(ref["loss"], got["loss"]) and torch.equal(ref["counts"], got["counts"])
    for name in ref["grads"]:
        torch.testing.assert_close(got["grads"][name], ref["grads"][name], atol=1e-7, rtol=1e-5, msg=name)


def test_bf16_compute_full_recompute_identical():
    base = build("bfloat16")
    data = batch(base.config.vocab_size)
    model = copy.deepcopy(base)
    apply_recompute(model, {"mode": "full", "full_recompute_layer": ["0-3"]}, None)
    assert_identical(step(base, data), step(model, data))


def test_recompute_runs_the_router_again_but_counts_once():
    base = build()
    data = batch(base.config.vocab_size)
    model = copy.deepcopy(base)
    base_calls = call_counts(base)
    ref = step(base, data)
    apply_recompute(model, {"mode": "full", "full_recompute_layer": ["0-3"]}, None)
    calls = call_counts(model)
    got = step(model, data)
    for name in ("layers.1.mlp.router", "layers.2.mlp.router", "mtp.0.layer.mlp.router",
                 "layers.0.self_attention.q_a_proj", "mtp.0.layer.input_layernorm"):
        assert calls[name] == 2 * base_calls[name], name
    for name in ("layers.0", "mtp.0.layer", "lm_head", "mtp.0.eh_proj", "embed_tokens"):
        assert calls[name] == base_calls[name], name
    assert torch.equal(ref["counts"], got["counts"])


def test_mtp_layer_is_addressed_after_the_decoder_layers():
    model = build()
    apply_recompute(model, {"mode": "select", "select_module": {"mlp": [3]}}, None)
    wrapped = [n for n, m in model.named_modules() if regions(m)]
    assert wrapped == ["mtp.0.layer.mlp"]


def test_full_recompute_holds_less_after_forward():
    import importlib.util

    spec = importlib.util.spec_from_file_location("recompute_memory", ROOT / "benchmarks" / "recompute_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    base = build()
    data = batch(base.config.vocab_size, b=2, s=64)
    model = copy.deepcopy(base)
    apply_recompute(model, {"mode": "full", "full_recompute_layer": ["0-3"]}, None)
    held = {}
    for name, m in (("none", base), ("full", model)):
        with bench.LiveMemory() as mem:
            out = m(**data)
            held[name] = mem.live
            (out.loss + out.aux_loss + out.mtp_loss).backward()
    assert held["full"] < 0.8 * held["none"], held


def test_dropout_is_replayed_exactly():
    """With dropout the recompute must draw the same masks as the forward (RNG state replayed)."""
    base = build(hidden_dropout=0.2, attention_dropout=0.2)
    data = batch(base.config.vocab_size)
    model = copy.deepcopy(base)
    apply_recompute(model, {"mode": "full", "full_recompute_layer": ["0-3"]}, None)
    assert regions(model.layers[0])[0].preserve_rng_state
    torch.manual_seed(7)
    ref = step(base, data)
    torch.manual_seed(7)
    assert_identical(ref, step(model, data))


def test_no_rng_replay_without_dropout():
    model = build()
    apply_recompute(model, {"mode": "select", "select_module": {"mlp": ["0-3"]}}, None)
    assert not regions(model.layers[0].mlp)[0].preserve_rng_state
