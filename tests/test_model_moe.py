"""Router, aux losses, capacity, grouped experts, counters and expert-bias updates (hand-computed cases)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM
from lit_moe.model.moe import GroupedExperts, MoE, Router, capacity_ranks, grouped_mm_usable, load_balancing_loss

BASE = dict(vocab_size=64, hidden_size=8, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=2,
            num_attention_heads=2, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4,
            v_head_dim=4, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
            first_k_dense_replace=1, compute_dtype="float32", initializer_range=0.3)

# A hand-made score table (sigmoid scores) for two tokens over 8 experts in 4 groups of 2.
SCORES = torch.tensor([[0.9, 0.1, 0.5, 0.45, 0.2, 0.3, 0.8, 0.05],
                       [0.2, 0.6, 0.1, 0.15, 0.7, 0.65, 0.3, 0.4]], dtype=torch.float64)


def router_for(scores, **overrides):
    """A router whose logits are exactly logit(scores): hidden = E and W = identity."""
    cfg = DeepseekV3Config(**{**BASE, **overrides})
    r = Router(cfg).double()
    with torch.no_grad():
        r.weight.copy_(torch.eye(8))
        r.expert_bias.zero_()
    r.router_dtype = torch.float64
    return r, torch.logit(scores)


def chosen(indices):
    return [sorted(row) for row in indices.tolist()]


def test_group_limited_selection_on_hand_table():
    r, x = router_for(SCORES)
    w, idx, s = r(x)
    torch.testing.assert_close(s, SCORES)
    # token 0: group sums (top-2) = 1.0, 0.95, 0.5, 0.85 -> groups 0, 1 -> experts 0, 2, 3 (expert 6 is excluded)
    # token 1: group sums = 0.8, 0.25, 1.35, 0.7 -> groups 2, 0 -> experts 4, 5, 1
    assert chosen(idx) == [[0, 2, 3], [1, 4, 5]]
    expected = [[0.9, 0.5, 0.45], [0.6, 0.7, 0.65]]
    for row, (i, e) in enumerate(zip(idx.tolist(), expected)):
        got = {j: w[row, k].item() for k, j in enumerate(i)}
        want = dict(zip(sorted(i), e))
        for j in i:
            assert got[j] == pytest.approx(want[j] / sum(e) * 2.5, rel=1e-12)


def test_expert_bias_changes_selection_not_weights():
    r, x = router_for(SCORES)
    with torch.no_grad():
        r.expert_bias[6] = 0.3        # token 0: group 3 now sums 1.15 -> groups 3, 0 -> experts 6, 0, 1
    w, idx, _ = r(x)
    assert chosen(idx)[0] == [0, 1, 6]
    picked = dict(zip(idx[0].tolist(), w[0].tolist()))
    assert picked[6] == pytest.approx(0.8 / 1.8 * 2.5) and picked[1] == pytest.approx(0.1 / 1.8 * 2.5)
    # a constant added to every bias changes nothing
    with torch.no_grad():
        r.expert_bias += 5.0
    w2, idx2, _ = r(x)
    assert chosen(idx2) == chosen(idx)
    torch.testing.assert_close(w2.sort(-1).values, w.sort(-1).values)


def test_no_group_limit_norm_off_and_scaling():
    r, x = router_for(SCORES, n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=2.0)
    w, idx, _ = r(x)
    assert chosen(idx) == [[0, 2, 6], [1, 4, 5]]
    torch.testing.assert_close(w.sort(-1).values, (SCORES.gather(1, idx) * 2.0).sort(-1).values)


def test_softmax_scoring():
    r, x = router_for(SCORES, scoring_func="softmax", moe_router_enable_expert_bias=False, n_group=1,
                      topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)
    w, idx, s = r(x)
    torch.testing.assert_close(s, torch.softmax(x, -1))
    assert chosen(idx) == [[0, 2, 6], [1, 4, 5]]
    torch.testing.assert_close(w, s.gather(1, idx))


def test_aux_loss_hand_example_and_uniform_value():
    # T=2 tokens, E=4, K=1, alpha=1. p rows (sigmoid normalised): [.4,.3,.2,.1] and [.1,.2,.3,.4]
    scores = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]]) * 2
    loss = load_balancing_loss(scores, 1, 1, "sigmoid", "aux_loss", 1.0)
    # f = E/(K T) * counts = 2 * [1,0,0,1]; P = mean p = [.25,.25,.25,.25] -> sum f P = 2*.25 + 2*.25 = 1.0
    assert loss.item() == pytest.approx(1.0)
    skewed = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.35, 0.3, 0.2, 0.15]])
    # both choose expert 0: f = [4,0,0,0], P_0 = (.4+.35)/2 -> 1.5
    assert load_balancing_loss(skewed, 1, 1, "sigmoid", "aux_loss", 1.0).item() == pytest.approx(1.5)
    uniform = torch.full((12, 8), 0.5)
    for kind in ("aux_loss", "seq_aux_loss"):
        assert load_balancing_loss(uniform, 3, 3, "sigmoid", kind, 1e-2).item() == pytest.approx(1e-2)


def test_seq_aux_loss_is_mean_of_per_sequence_losses():
    torch.manual_seed(0)
    scores = torch.rand(2 * 5, 8)
    seq = load_balancing_loss(scores, 2, 2, "sigmoid", "seq_aux_loss", 0.1)
    per = [load_balancing_loss(scores[b * 5:(b + 1) * 5], 2, 1, "sigmoid", "aux_loss", 0.1) for b in range(2)]
    assert seq.item() == pytest.approx(sum(p.item() for p in per) / 2)
    assert load_balancing_loss(scores, 2, 2, "sigmoid", "aux_loss", 0.1).item() != pytest.approx(seq.item())


def test_capacity_ranks_probs_and_position():
    idx = torch.tensor([[0], [0], [0], [1]])
    w = torch.tensor([[0.1], [0.9], [0.5], [0.3]])
    assert capacity_ranks(idx, w, 2, "probs").flatten().tolist() == [2, 0, 1, 0]
    assert capacity_ranks(idx, w, 2, "position").flatten().tolist() == [0, 1, 2, 0]


def make_moe(**overrides):
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM({**BASE, **overrides})
    return m, m.moe_layers()[0]


def naive_moe(moe: MoE, x: torch.Tensor, keep=None) -> torch.Tensor:
    """Token-by-token reference: sum_k w_k * expert_k(x_t) + shared(x_t)."""
    B, S, H = x.shape
    flat = x.reshape(-1, H)
    w, idx, _ = moe.router(flat)
    I = moe.experts.down_proj.shape[1]
    out = []
    for t in range(flat.shape[0]):
        acc = torch.zeros(H)
        for k in range(idx.shape[1]):
            if keep is not None and not keep[t][k]:
                continue
            e = idx[t, k]
            h = flat[t] @ moe.experts.gate_up_proj[e]
            acc = acc + w[t, k] * ((F.silu(h[:I]) * h[I:]) @ moe.experts.down_proj[e])
        out.append(acc)
    y = torch.stack(out).view(B, S, H)
    return y + moe.shared_experts(x) if moe.shared_experts is not None else y


def test_moe_matches_token_loop_reference():
    _, moe = make_moe()
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), naive_moe(moe, x), atol=1e-5, rtol=1e-5)


def reference_keep(moe: MoE, x: torch.Tensor, capacity: int, policy: str):
    """Which (token, k) assignments survive, computed with plain Python sorting."""
    w, idx, _ = moe.router(x.reshape(-1, x.shape[-1]))
    T, K = idx.shape
    keep = [[False] * K for _ in range(T)]
    for e in range(moe.num_experts):
        mine = [(t, k) for t in range(T) for k in range(K) if idx[t, k] == e]
        if policy == "probs":
            mine.sort(key=lambda tk: -w[tk].item())
        for t, k in mine[:capacity]:
            keep[t][k] = True
    return keep


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_capacity_dropping_matches_reference(policy, pad):
    m, moe = make_moe(moe_expert_capacity_factor=0.5, moe_token_drop_policy=policy, use_pad_tokens=pad)
    m.train()
    x = torch.randn(2, 6, 8)
    T, K, E = 12, 3, 8
    C = math.ceil(T * K / E * 0.5)
    assert moe.capacity(T) == C == 3
    keep = reference_keep(moe, x, C, policy)
    moe.reset_drop_counters()
    y = moe(x)
    torch.testing.assert_close(y, naive_moe(moe, x, keep), atol=1e-5, rtol=1e-5)
    dropped = sum(not v for row in keep for v in row)
    assert dropped > 0
    assert moe.drop_rate() == pytest.approx(dropped / (T * K))
    assert moe.tokens_per_expert.sum().item() == T * K - dropped
    assert moe.tokens_per_expert.max().item() <= C
    # per expert: the kept assignments of the router's own indices, counted by hand
    indices = moe.router(x.reshape(T, 8))[1]
    kept = torch.bincount(indices[torch.tensor(keep)], minlength=E).float()
    assert torch.equal(moe.tokens_per_expert, kept) and torch.equal(moe.last_stats["tokens_per_expert"], kept)


def test_token_dropped_everywhere_keeps_only_shared_expert():
    m, moe = make_moe(moe_expert_capacity_factor=1e-3, use_pad_tokens=False)   # capacity 1 per expert
    x = torch.randn(1, 16, 8)
    with torch.no_grad():
        y = moe(x)
        keep = reference_keep(moe, x, 1, "probs")
        lost = [t for t in range(16) if not any(keep[t])]
        assert lost
        torch.testing.assert_close(y[0, lost], moe.shared_experts(x)[0, lost], atol=1e-6, rtol=0)


@pytest.mark.parametrize("hidden,inter", [(32, 16), (30, 10)])
def test_grouped_experts_paths_agree_with_reference(hidden, inter):
    cfg = DeepseekV3Config(**{**BASE, "hidden_size": hidden, "moe_intermediate_size": inter})
    torch.manual_seed(0)
    experts = GroupedExperts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    counts = torch.tensor([3, 0, 5, 1, 0, 2, 4, 1])
    x = torch.randn(int(counts.sum()), hidden, requires_grad=True)
    assert grouped_mm_usable(x, experts.gate_up_proj, experts.down_proj) == (hidden == 32)
    outs, grads = [], []
    for use in (True, False):
        experts.use_grouped_mm = use
        experts.zero_grad()
        x.grad = None
        y = experts(x, counts)
        y.backward(torch.ones_like(y))
        outs.append(y.detach())
        grads.append((x.grad.clone(), experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()))
    # a row-by-row reference
    e_of_row = torch.repeat_interleave(torch.arange(8), counts)
    ref = torch.stack([(lambda h: (F.silu(h[:inter]) * h[inter:]) @ experts.down_proj[e])(x[r] @ experts.gate_up_proj[e])
                       for r, e in enumerate(e_of_row.tolist())])
    torch.testing.assert_close(outs[0], ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[1], ref.detach(), atol=1e-5, rtol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_counters_only_in_real_training_forward_and_not_in_recompute():
    m, moe = make_moe(moe_aux_loss_coeff=0.01)
    x = torch.randn(2, 4, 8)
    m.eval()
    moe(x)
    m.train()
    with torch.no_grad():
        moe(x)
    assert moe.tokens_per_expert.sum().item() == 0
    moe(x).sum().backward()
    assert moe.tokens_per_expert.sum().item() == 2 * 4 * 3
    aux_plain = moe.aux_loss
    moe.tokens_per_expert.zero_()
    x2 = x.clone().requires_grad_(True)
    y = checkpoint(moe, x2, use_reentrant=False)
    aux_ckpt = moe.aux_loss
    (y.sum() + aux_ckpt).backward()          # backward re-runs the forward
    assert moe.tokens_per_expert.sum().item() == 2 * 4 * 3
    torch.testing.assert_close(aux_ckpt, aux_plain)
    assert moe.last_stats["aux_loss"].item() == pytest.approx(aux_plain.item())


def test_model_aux_loss_sums_layers_and_is_not_double_counted_under_checkpoint():
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM({**BASE, "num_hidden_layers": 3, "moe_aux_loss_coeff": 0.05}).train()
    ids = torch.randint(0, 64, (2, 6))
    out = m(ids, labels=ids)
    per_layer = [moe.last_stats["aux_loss"] for moe in m.moe_layers()]
    assert len(per_layer) == 2
    torch.testing.assert_close(out.aux_loss, sum(per_layer))
    (out.loss + out.aux_loss).backward()
    g_plain = m.layers[1].mlp.router.weight.grad.clone()
    m.zero_grad()
    for layer in m.layers:     # activation checkpointing of every block, as a strategy would do
        layer.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(layer.forward)
    out2 = m(ids, labels=ids)
    torch.testing.assert_close(out2.aux_loss, out.aux_loss)
    (out2.loss + out2.aux_loss).backward()
    torch.testing.assert_close(m.layers[1].mlp.router.weight.grad, g_plain, atol=1e-6, rtol=1e-5)


def test_first_forward_inside_activation_checkpoint(monkeypatch):
    """The one-time grouped_mm probe must not save tensors into a checkpoint region (recompute mismatch)."""
    import lit_moe.model.moe as moe_mod

    monkeypatch.setattr(moe_mod, "_GROUPED_MM_RUNS", {})
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM(BASE).train()
    for layer in m.layers:
        layer.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(layer.forward)
    ids = torch.randint(0, 64, (2, 6))
    m(ids, labels=ids).loss.backward()
    assert moe_mod._GROUPED_MM_RUNS and m.layers[1].mlp.router.weight.grad is not None


def test_expert_bias_update_sign_rule():
    m, _ = make_moe(n_routed_experts=4, num_experts_per_tok=1, n_group=1, topk_group=1, num_hidden_layers=3,
                    moe_router_bias_update_rate=1e-3)
    counts = torch.tensor([[10.0, 0, 5, 5], [9, 0, 0, 0]])
    m.update_expert_bias(counts)
    b = [moe.router.expert_bias for moe in m.moe_layers()]
    torch.testing.assert_close(b[0], torch.tensor([-1e-3, 1e-3, 0, 0]))
    torch.testing.assert_close(b[1], torch.tensor([-1e-3, 1e-3, 1e-3, 1e-3]))
    # local counters are used when none are given, then zeroed
    moe = m.moe_layers()[0]
    moe.tokens_per_expert.copy_(torch.tensor([10.0, 0, 0, 6]))
    m.update_expert_bias()
    torch.testing.assert_close(b[0], torch.tensor([-2e-3, 2e-3, 1e-3, -1e-3]))
    assert moe.tokens_per_expert.sum().item() == 0
    with pytest.raises(ValueError, match="counts has 1 rows"):
        m.update_expert_bias(torch.zeros(1, 4))


def test_counts_per_expert_are_the_routers_choices_and_steer_the_bias():
    """tokens_per_expert of every MoE layer (main and MTP) = a bincount of that router's top-k indices,
    summed over two micro-batches; the bias update then moves each expert by rate·sign(mean - count)."""
    m, _ = make_moe(num_hidden_layers=3, num_nextn_predict_layers=1, moe_router_bias_update_rate=1e-3)
    m.train()
    chosen_by = {}
    for moe in m.moe_layers():
        moe.router.register_forward_hook(
            lambda mod, inp, out, moe=moe: chosen_by.setdefault(moe, []).append(out[1].reshape(-1)))
    for seed in (1, 2):
        ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(seed))
        out = m(ids, labels=ids)
        (out.loss + out.mtp_loss).backward()
    counts = []
    for moe in m.moe_layers():
        expected = torch.bincount(torch.cat(chosen_by[moe]), minlength=8).float()
        assert torch.equal(moe.tokens_per_expert, expected)
        counts.append(expected)
        assert expected.min() < expected.max()          # an unbalanced load: the update has a direction
    before = [moe.router.expert_bias.clone() for moe in m.moe_layers()]
    m.update_expert_bias()
    for moe, b0, c in zip(m.moe_layers(), before, counts):
        torch.testing.assert_close(moe.router.expert_bias - b0, 1e-3 * torch.sign(c.mean() - c), rtol=0, atol=1e-9)


def test_expert_bias_disabled_only_resets_counters():
    m, moe = make_moe(moe_router_enable_expert_bias=False)
    moe.tokens_per_expert.fill_(3.0)
    moe.tokens_per_expert[0] = 9.0
    m.update_expert_bias()
    assert moe.router.expert_bias.abs().sum().item() == 0 and moe.tokens_per_expert.sum().item() == 0


def test_no_python_loop_over_tokens_in_routing():
    """Routing/dispatch cost must not scale with Python-level work per token: count torch calls."""
    calls = []

    class Count(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))

    _, moe = make_moe()
    n = []
    for T in (4, 64):
        calls.clear()
        with torch.no_grad(), Count():
            moe(torch.randn(1, T, 8))
        n.append(len(calls))
    assert n[0] == n[1]


@pytest.mark.parametrize("capacity", [None, "drop", "pad"])
def test_moe_gradients_match_token_loop_reference(capacity):
    """Input, router and expert gradients of the vectorised dispatch (assignment-row gather, slot
    scatter) equal those of the token-by-token reference, dropless and with capacity."""
    extra = {} if capacity is None else dict(moe_expert_capacity_factor=0.5, use_pad_tokens=capacity == "pad")
    _, moe = make_moe(**extra)
    moe.train()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    moe.double()
    keep = None
    if capacity is not None:
        keep = reference_keep(moe, x, moe.capacity(12), "probs")
        assert not all(all(row) for row in keep)
    params = [x.requires_grad_(), moe.router.weight, moe.experts.gate_up_proj, moe.experts.down_proj]
    dy = torch.randn(2, 6, 8, dtype=torch.float64)
    got = torch.autograd.grad((moe(x) * dy).sum(), params)
    want = torch.autograd.grad((naive_moe(moe, x, keep) * dy).sum(), params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)   # the router computes in fp32


@pytest.mark.parametrize("capacity", [None, "pad"])
def test_routing_and_dispatch_make_no_host_sync(monkeypatch, capacity):
    """On an accelerator a host read of a device value stalls the stream: routing, dispatch, combine
    and their backward use none of the ops that do (bincount sizes its output from the largest
    index, boolean-mask indexing runs nonzero, item/tolist read values). The dropping policy
    without padding needs one by design (the kept count) and is not checked."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import lit_moe.model.moe as moe_mod

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(moe_mod, "grouped_mm_row_align", lambda device: 1)   # as on an accelerator
    extra = {} if capacity is None else dict(moe_expert_capacity_factor=0.5, use_pad_tokens=True)
    _, moe = make_moe(moe_intermediate_size=4, **extra)
    moe.train()
    x = torch.randn(2, 6, 8, requires_grad=True)
    assert grouped_mm_usable(x.reshape(12, 8), moe.experts.gate_up_proj, moe.experts.down_proj)
    with Record():
        moe(x).sum().backward()
    syncing = {"aten.bincount", "aten.nonzero", "aten._local_scalar_dense", "aten.item", "aten.masked_select"}
    assert "aten._grouped_mm" in seen
    assert not syncing & set(seen)


def test_assignment_rows_gather_and_gradient():
    from lit_moe.model.moe import _AssignmentRows, inverse_permutation

    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    order = torch.tensor([7, 0, 9, 3, 4, 1, 8])       # some of the 10 assignments of K = 2, shuffled
    g = torch.randn(7, 3, dtype=torch.float64)
    inverse = inverse_permutation(order, 10)
    (got,) = torch.autograd.grad((_AssignmentRows.apply(x, order, inverse, 2) * g).sum(), x)
    (want,) = torch.autograd.grad((x.index_select(0, order // 2) * g).sum(), x)
    assert torch.equal(_AssignmentRows.apply(x, order, inverse, 2), x.index_select(0, order // 2))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_bf16_router_keeps_small_bias_steps():
    """Selection adds the fp32 expert bias in fp32 even when the router computes in bf16: a 1e-3 bias
    step (the default update rate) must break a tie that bf16 would round away (0.5 + 1e-3 -> 0.5)."""
    r, _ = router_for(SCORES)
    r.top_k, r.n_group = 1, 1
    with torch.no_grad():
        r.expert_bias.copy_(torch.tensor([0.0, 1e-3, 0, 0, 0, 0, 0, 0]))
    scores = torch.tensor([[0.5, 0.5, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]], dtype=torch.bfloat16)
    assert r.select(scores).tolist() == [[1]]


def test_combine_stays_in_compute_dtype_without_zero_buffers(monkeypatch):
    """bf16 compute, accelerator layout (no CPU row padding): forward and backward of the routed part
    make no fp32 tensor of T*K*H elements or more, and no zero-filled [T*K, H] buffer written by an
    index scatter; the result stays close to the fp64 token-loop reference."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import lit_moe.model.moe as moe_mod

    monkeypatch.setattr(moe_mod, "grouped_mm_row_align", lambda device: 1)
    _, moe = make_moe(compute_dtype="bfloat16", n_shared_experts=0, hidden_size=16)   # H != E
    moe.train()
    B, S, H, K = 2, 24, 16, moe.top_k
    x = torch.randn(B, S, H)
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    seen.append((str(func.overloadpacket), t.dtype, t.numel(), tuple(t.shape)))
            return out

    xb = x.to(torch.bfloat16).requires_grad_()
    with Record():
        y = moe(xb)
        y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and ("aten._grouped_mm", torch.bfloat16, S * B * K * H, (B * S * K, H)) in seen
    big_fp32 = [s for s in seen if s[1] == torch.float32 and s[2] >= B * S * K * H]
    assert not big_fp32, big_fp32
    scatters = [s for s in seen if s[0] in ("aten.index_copy", "aten.index_add", "aten.index_put", "aten.scatter",
                                            "aten.scatter_add") and s[3][-1:] == (H,)]
    assert not scatters, scatters
    ref = naive_moe(moe.double(), x.double()).float()
    assert (y.float() - ref).abs().max() < 0.05 * ref.abs().max()


def test_row_weights_scale_rows_ahead_of_the_down_projection():
    """GroupedExperts(x, counts, w) = w * GroupedExperts(x, counts) row by row (fp64, exact up to rounding),
    on the grouped-GEMM path (as on a CPU: rows padded to buckets) and the per-expert loop."""
    for grouped in (True, False):
        _, moe = make_moe(moe_grouped_gemm=grouped)
        experts = moe.experts.double()
        x = torch.randn(10, 8, dtype=torch.float64)
        counts = torch.tensor([3, 0, 2, 1, 0, 4, 0, 0])
        w = torch.rand(10, 1, dtype=torch.float64)
        torch.testing.assert_close(experts(x, counts, w), w * experts(x, counts), atol=1e-12, rtol=1e-12)
