"""The kernels behind the CPU training speed (benchmarks/train_throughput.py), against independent
references: the block-causal attention against PyTorch's SDPA math path in fp64, the row-aligned grouped
expert GEMMs against a plain per-expert matmul loop, and the ``torch_compile`` switch against eager."""

import functools
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

import lit_moe.model.attention as attention_mod
import lit_moe.model.compile as compile_mod
import lit_moe.model.moe as moe_mod
from lit_moe.model import DeepseekV3ForCausalLM
from lit_moe.model.config import DeepseekV3Config
from lit_moe.ops.attention import block_causal_attention, use_block_causal

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
            first_k_dense_replace=1, seq_length=16, max_position_embeddings=64, compute_dtype="float32",
            moe_aux_loss_coeff=0.01, initializer_range=0.2)


def _qkv(dtype, B=2, H=3, S=300, d=24, dv=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, S, d, generator=g) * 1.5 for _ in range(2))
    v = torch.randn(B, H, S, dv, generator=g)
    do = torch.randn(B, H, S, dv, generator=g)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)], do.to(dtype)


def _rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("dtype,block,tol", [(torch.float32, 128, 1e-5), (torch.float32, 37, 1e-5),
                                             (torch.bfloat16, 128, 3e-2), (torch.bfloat16, 64, 3e-2)])
def test_block_causal_attention_matches_sdpa_in_fp64(dtype, block, tol):
    (q, k, v), do = _qkv(dtype)
    scale = 0.3
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True, scale=scale)
    ref.backward(do.double())
    out = block_causal_attention(q, k, v, scale, block=block)
    out.backward(do)
    assert out.dtype == dtype and out.shape == ref.shape
    assert _rel(out, ref) < tol
    for ours, theirs in zip((q, k, v), ref_in):
        assert _rel(ours.grad, theirs.grad) < tol
    # the first query only sees the first key: its output is exactly v_0 (up to the dtype)
    torch.testing.assert_close(out[:, :, 0].double(), v[:, :, 0].double(), atol=0, rtol=0)


def test_block_causal_attention_errors_and_dispatch():
    (q, k, v), _ = _qkv(torch.float32, S=8)
    with pytest.raises(ValueError, match="dtypes differ"):
        block_causal_attention(q, k.to(torch.bfloat16), v, 1.0)
    x = torch.zeros(1, 1, 129, 8)
    assert use_block_causal(x.bfloat16()) and not use_block_causal(x)             # fp32 keeps SDPA
    assert not use_block_causal(torch.zeros(1, 1, 128, 8, dtype=torch.bfloat16))   # one block: SDPA


def test_model_attention_uses_block_kernel_on_long_bf16_sequences(monkeypatch):
    # dense layers only: a bf16 rounding cannot flip a routing decision and move a logit by a lot
    cfg = {**TINY, "seq_length": 160, "first_k_dense_replace": 2, "initializer_range": 0.02}
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM({**cfg, "compute_dtype": "bfloat16"}).eval()
    torch.manual_seed(0)
    fp32 = DeepseekV3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 97, (1, 160))
    calls = []
    original = attention_mod.block_causal_attention
    monkeypatch.setattr(attention_mod, "block_causal_attention",
                        lambda *a, **kw: calls.append(a[0].shape) or original(*a, **kw))
    with torch.no_grad():
        ref = fp32(ids).logits
        ours = m(ids).logits
        assert calls == [(1, 2, 160, 16)] * 2
        monkeypatch.setattr(attention_mod, "use_block_causal", lambda q: False)
        sdpa = m(ids).logits
    # as close to the fp32 model as bf16 SDPA is
    assert (ours - ref).abs().max() <= max(1.5 * (sdpa - ref).abs().max().item(), 1e-3)


# ----------------------------------------------------------------------------------------------
# grouped experts with row-aligned groups
# ----------------------------------------------------------------------------------------------
def _experts(dtype):
    torch.manual_seed(0)
    cfg = DeepseekV3Config(**{**TINY, "moe_intermediate_size": 24})
    experts = moe_mod.GroupedExperts(cfg, dtype=torch.float32)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    return experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_with_no_rows_give_zero_gradients(dtype):
    """An expert-parallel rank can receive no tokens at all: forward and backward still run, and every
    expert weight gets a zero gradient (FSDP's gradient reduction needs one on every rank)."""
    experts = _experts(dtype)
    x = torch.zeros(0, 32, dtype=dtype, requires_grad=True)
    y = experts(x, torch.zeros(4, dtype=torch.long))
    assert y.shape == (0, 32)
    (y.sum() + 0 * x.sum()).backward()
    for p in (experts.gate_up_proj, experts.down_proj):
        assert p.grad is not None and p.grad.shape == p.shape and torch.count_nonzero(p.grad) == 0


def test_group_row_buckets_by_hand():
    counts = torch.tensor([0, 1, 16, 17, 100, 128, 129, 1000, 4097])
    # width = max(16, 2^floor(log2 n) / 8): 16 up to n < 256, then 32, 64 (n in [512, 1024)), ... 512
    assert moe_mod.bucketed_group_rows(counts, 16).tolist() == [0, 16, 16, 32, 112, 128, 144, 1024, 4608]
    assert moe_mod.bucketed_group_rows(counts, 1, buckets_per_octave=2).tolist() == \
        [0, 1, 16, 24, 128, 128, 192, 1024, 6144]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_aligned_grouped_experts_match_a_per_expert_loop(dtype, tol, monkeypatch):
    experts = _experts(dtype)
    counts = torch.tensor([5, 0, 33, 16])                         # an empty expert, unaligned counts
    x = torch.randn(int(counts.sum()), 32).to(dtype).requires_grad_()
    dy = torch.randn(x.shape[0], 32).to(dtype)
    assert moe_mod.grouped_mm_row_align(x.device) == 16
    if not moe_mod.grouped_mm_usable(x, experts.gate_up_proj.to(dtype), experts.down_proj.to(dtype)):
        pytest.skip("grouped_mm does not run here")
    offsets = []
    original = F.grouped_mm
    monkeypatch.setattr(moe_mod.F, "grouped_mm",
                        lambda a, b, offs: offsets.append(offs.tolist()) or original(a, b, offs=offs))
    y = experts(x, counts)
    y.backward(dy)
    # groups rounded up to their buckets (16, -, 48, 16 rows); no spare rows when eager
    assert offsets[0] == [16, 16, 64, 80] and offsets[0] == offsets[1]

    ref_x = x.detach().double().requires_grad_()
    w1 = experts.gate_up_proj.detach().to(dtype).double().requires_grad_()
    w2 = experts.down_proj.detach().to(dtype).double().requires_grad_()
    outs = []
    for e, xe in enumerate(torch.split(ref_x, counts.tolist())):
        gate, up = (xe @ w1[e]).chunk(2, dim=-1)
        outs.append((F.silu(gate) * up) @ w2[e])
    ref = torch.cat(outs)
    ref.backward(dy.double())
    assert _rel(y, ref) < tol
    assert _rel(x.grad, ref_x.grad) < tol
    assert _rel(experts.gate_up_proj.grad, w1.grad) < tol
    assert _rel(experts.down_proj.grad, w2.grad) < tol
    assert experts.gate_up_proj.grad[1].abs().max() == 0      # the empty expert gets no gradient


# ----------------------------------------------------------------------------------------------
# torch_compile switch
# ----------------------------------------------------------------------------------------------
def _fwd_bwd(m, ids):
    out = m(ids, labels=ids)
    (out.loss + out.aux_loss + out.mtp_loss).backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    counts = torch.stack([moe.tokens_per_expert.clone() for moe in m.moe_layers()])
    return out, grads, counts


@pytest.fixture
def fresh_compile_cache(monkeypatch):
    monkeypatch.setattr(compile_mod, "_COMPILED", {})
    monkeypatch.setattr(compile_mod, "_WARNED", False)


def _eager_and_compiled(monkeypatch, cfg: dict, backend: str = "aot_eager"):
    """The same model eager and with ``torch_compile: True`` (aot_eager: dynamo's capture and AOT
    autograd's forward/backward split, without a C++ build), one training forward/backward each."""
    monkeypatch.setattr(compile_mod.torch, "compile", functools.partial(torch.compile, backend=backend))
    torch.manual_seed(0)
    eager = DeepseekV3ForCausalLM(cfg).train()
    torch.manual_seed(0)
    comp = DeepseekV3ForCausalLM({**cfg, "torch_compile": True}).train()
    ids = torch.randint(0, 97, (2, 16))
    return eager, comp, ids, _fwd_bwd(eager, ids), _fwd_bwd(comp, ids)


def test_torch_compile_switch_matches_eager(monkeypatch, fresh_compile_cache):
    eager, comp, ids, (a, ga, ca), (b, gb, cb) = _eager_and_compiled(
        monkeypatch, {**TINY, "num_nextn_predict_layers": 1})
    assert set(compile_mod._COMPILED) >= {type(comp.layers[0])._forward}
    assert a.logits is None and b.logits is None          # training: the fused head, not compiled
    with torch.no_grad():                                 # without grad: the compiled norm + head + loss
        la, lb = eager(ids, labels=ids), comp(ids, labels=ids)
    assert type(comp)._head in compile_mod._COMPILED
    assert not any(c.failed for c in compile_mod._COMPILED.values())
    torch.testing.assert_close(lb.logits, la.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lb.loss, la.loss, atol=1e-6, rtol=1e-5)
    for name in ("loss", "aux_loss", "mtp_loss"):
        torch.testing.assert_close(getattr(b, name), getattr(a, name), atol=1e-6, rtol=1e-5)
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], atol=1e-5, rtol=1e-4, msg=n)
    torch.testing.assert_close(cb, ca, atol=0, rtol=0)      # MoE counters move once per forward


def _cpp_compiler():
    return next((c for c in (os.environ.get("CXX"), "g++", "c++", "clang++") if c and shutil.which(c)), None)


@pytest.mark.skipif(_cpp_compiler() is None, reason="inductor on CPU needs a C++ compiler (none found: CXX, g++, "
                                                     "c++, clang++)")
def test_torch_compile_inductor_matches_eager(monkeypatch, fresh_compile_cache):
    """What users run: inductor (the default backend) builds C++ kernels for the decoder layers, MTP and
    the head; one training forward/backward and a no-grad forward against eager, in fp32."""
    cfg = {**TINY, "num_nextn_predict_layers": 1, "compute_dtype": "float32"}
    eager, comp, ids, (a, ga, ca), (b, gb, cb) = _eager_and_compiled(monkeypatch, cfg, backend="inductor")
    assert not any(c.failed for c in compile_mod._COMPILED.values())
    with torch.no_grad():
        la, lb = eager(ids, labels=ids), comp(ids, labels=ids)
    errs = {"logits": float((lb.logits - la.logits).abs().max())}
    for name in ("loss", "aux_loss", "mtp_loss"):
        errs[name] = abs(float(getattr(b, name)) - float(getattr(a, name)))
    errs["grads"] = max(float((gb[n] - ga[n]).abs().max() / ga[n].abs().max().clamp_min(1e-12)) for n in ga)
    # measured: logits 2.7e-6, loss 4.8e-7, aux and MTP losses 0.0, gradients 2.3e-6 of each tensor's
    # largest element; bounds 10x (10 fp32 ulps of the losses where the measured error is 0)
    bounds = {"logits": 2.5e-5, "loss": 4.5e-6, "aux_loss": 1e-6, "mtp_loss": 1e-6, "grads": 2e-5}
    assert all(errs[k] <= bounds[k] for k in bounds), errs
    torch.testing.assert_close(cb, ca, atol=0, rtol=0)      # MoE counters move once per forward


def test_torch_compile_failure_falls_back_to_eager(monkeypatch, fresh_compile_cache, caplog):
    from torch._dynamo.exc import BackendCompilerFailed

    def broken(fn, **kwargs):
        def call(*args, **kw):
            raise BackendCompilerFailed("inductor", RuntimeError("no C++ compiler"), None)
        return call

    monkeypatch.setattr(compile_mod.torch, "compile", broken)
    torch.manual_seed(0)
    eager = DeepseekV3ForCausalLM(TINY).train()
    torch.manual_seed(0)
    comp = DeepseekV3ForCausalLM({**TINY, "torch_compile": True}).train()
    ids = torch.randint(0, 97, (2, 16))
    with caplog.at_level("WARNING", logger="lit_moe.model.compile"):
        a, b = _fwd_bwd(eager, ids), _fwd_bwd(comp, ids)
    assert "runs eagerly" in caplog.text
    assert len(compile_mod._COMPILED) > 1 and all(c.failed for c in compile_mod._COMPILED.values())
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1   # one warning for all of them
    torch.testing.assert_close(b[0].loss, a[0].loss, atol=0, rtol=0)


def test_torch_compile_reraises_errors_that_are_not_the_compilers(monkeypatch, fresh_compile_cache):
    def raising(fn, **kwargs):
        def call(*args, **kw):
            raise KeyError("a bug in user code")
        return call

    monkeypatch.setattr(compile_mod.torch, "compile", raising)
    m = DeepseekV3ForCausalLM({**TINY, "torch_compile": True})
    with pytest.raises(KeyError, match="a bug in user code"):
        m(torch.randint(0, 97, (1, 8)))


def test_compiled_layers_head_and_mtp_hold_across_steps(monkeypatch, fresh_compile_cache):
    """bf16 on CPU: decoder layers, MTP and the head compile with zero graph breaks (dynamo's counters),
    and steps whose tokens per expert differ reuse the graphs (no recompile). Compiled, the experts'
    grouped GEMMs run on the static buffer whose rows past the last group are never computed: nothing
    of them reaches the outputs or gradients. With full-layer recompute the recompute in backward gets
    its own graphs once, and the MoE counters still move once per forward (the autograd state is
    captured where the compiled call is entered, ``compile.in_backward``)."""
    from torch._dynamo.utils import counters

    from lit_moe.strategies.recompute import apply_recompute, remove_recompute

    from torch._dynamo.backends.registry import lookup_backend

    graph_ops = []   # (no instrumentation inside the model: dynamo would guard on it and recompile)

    def recording_aot_eager(gm, example_inputs):
        graph_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return lookup_backend("aot_eager")(gm, example_inputs)

    monkeypatch.setattr(compile_mod.torch, "compile", functools.partial(torch.compile, backend=recording_aot_eager))
    torch._dynamo.reset()
    counters.clear()
    cfg = {**TINY, "compute_dtype": "bfloat16", "moe_intermediate_size": 24, "num_nextn_predict_layers": 1}
    torch.manual_seed(0)
    eager = DeepseekV3ForCausalLM(cfg).train()
    torch.manual_seed(0)
    comp = DeepseekV3ForCausalLM({**cfg, "torch_compile": True}).train()
    graphs, counts = [], []
    for step in range(3):
        ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(step))
        b, gb, c = _fwd_bwd(comp, ids)
        a, ga, ce = _fwd_bwd(eager, ids)
        torch.testing.assert_close(c, ce, atol=0, rtol=0)
        torch.testing.assert_close(b.loss, a.loss, atol=1e-4, rtol=1e-3)
        for n in ga:
            assert torch.isfinite(gb[n]).all(), n
            assert _rel(gb[n], ga[n]) < 2e-2, n
        counts.append(c.clone())
        for m in (comp, eager):
            m.update_expert_bias()
            m.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
    assert not (counts[1] - counts[0]).eq(0).all() and not (counts[2] - counts[1]).eq(0).all()
    compiled_fns = {DeepseekV3ForCausalLM._fused_head, DeepseekV3ForCausalLM._mtp_fused_loss,
                    type(comp.layers[0])._forward}
    assert compiled_fns <= set(compile_mod._COMPILED)
    assert not any(c.failed for c in compile_mod._COMPILED.values())
    assert dict(counters["graph_break"]) == {}
    assert graphs[0] == graphs[1] == graphs[2] > 0
    assert any("grouped_mm" in op for op in graph_ops)   # the compiled experts run the grouped GEMMs

    for m in (comp, eager):
        apply_recompute(m, {"mode": "full", "full_recompute_layer": ["0-2"]}, None)
    for step in range(3, 5):
        ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(step))
        _, _, c = _fwd_bwd(comp, ids)
        _, _, ce = _fwd_bwd(eager, ids)
        torch.testing.assert_close(c, ce, atol=0, rtol=0)       # recompute did not count again
        for m in (comp, eager):
            m.update_expert_bias()
            m.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
    assert dict(counters["graph_break"]) == {}
    assert graphs[3] == graphs[4]                               # the recompute graphs: compiled once

    # selective recompute of submodules: their regions (forward hooks) cannot be traced, so the half
    # that calls them runs eagerly (layer 0: the attention half, layer 1: the MLP half), the other
    # half and the MTP layer stay compiled (a traced region failed: CheckpointError in backward)
    for m in (comp, eager):
        remove_recompute(m)
        apply_recompute(m, {"mode": "select", "select_module": {"self_attention": [0], "mlp": [1]}}, None)
    for step in range(5, 7):
        ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(step))
        b, gb, c = _fwd_bwd(comp, ids)
        a, ga, ce = _fwd_bwd(eager, ids)
        torch.testing.assert_close(c, ce, atol=0, rtol=0)
        torch.testing.assert_close(b.loss, a.loss, atol=1e-4, rtol=1e-3)
        for n in ga:
            assert _rel(gb[n], ga[n]) < 2e-2, n
        for m in (comp, eager):
            m.update_expert_bias()
            m.zero_grad()
    assert {type(comp.layers[0])._attention_half, type(comp.layers[0])._mlp_half} <= set(compile_mod._COMPILED)
    assert not any(c.failed for c in compile_mod._COMPILED.values())
    assert dict(counters["graph_break"]) == {}


def test_torch_compile_default_is_cuda_only():
    assert DeepseekV3Config(**TINY).torch_compile is None
    assert compile_mod.compile_enabled(None, torch.device("cuda", 0))
    assert not compile_mod.compile_enabled(None, torch.device("cpu"))
    assert compile_mod.compile_enabled(True, torch.device("cpu"))
    assert not compile_mod.compile_enabled(False, torch.device("cuda"))
