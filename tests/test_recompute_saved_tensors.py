"""The saved-tensor engine of output recompute (``lit_moe.strategies.recompute.saved_tensors``), on its
own: a layer whose forward is scoped, with one call inside it whose output is recomputed.

The judge is the same computation without the engine (plain autograd): gradients must be identical,
the wrapped call runs again in backward, and its output is not kept alive between forward and
backward (that is the memory saving).
"""

from __future__ import annotations

import gc
import weakref

import torch
import torch.nn.functional as F

from lit_moe.strategies.recompute.saved_tensors import _OutputRecomputed, _LayerScope


class Gather:
    """Stands in for a communication step (a sequence all-gather): doubles the sequence. Counts its
    calls and keeps a weak reference to its last output."""

    def __init__(self, dropout: float = 0.0):
        self.calls, self.last, self.dropout = 0, None, dropout

    def __call__(self, x):
        self.calls += 1
        out = torch.cat([x, x.flip(1)], dim=1)
        if self.dropout:
            out = F.dropout(out, self.dropout, training=True)
        self.last = weakref.ref(out)
        return out


def layer(gather, w):
    def forward(x):
        return torch.tanh(gather(x) @ w)   # the matmul saves gather's output for backward
    return forward


def run(recompute: bool, dropout: float = 0.0, seed: int = 0):
    torch.manual_seed(seed)
    x = torch.randn(2, 3, 4, requires_grad=True)
    w = torch.randn(4, 5, requires_grad=True)
    gather = Gather(dropout)
    fn = _OutputRecomputed(gather, "gather") if recompute else gather
    forward = _LayerScope(layer(fn, w), "layers[0]") if recompute else layer(fn, w)
    torch.manual_seed(seed + 1)
    y = forward(x)
    gc.collect()
    alive_between = gather.last() is not None
    calls_forward = gather.calls
    (y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
    return dict(y=y.detach(), gx=x.grad, gw=w.grad, alive=alive_between, calls_forward=calls_forward,
                calls=gather.calls)


def test_gradients_are_those_of_plain_autograd_and_the_call_reruns_in_backward():
    plain, ours = run(False), run(True)
    assert torch.equal(plain["y"], ours["y"])
    assert torch.equal(plain["gx"], ours["gx"]) and torch.equal(plain["gw"], ours["gw"])
    assert plain["calls"] == 1
    assert ours["calls_forward"] == 1 and ours["calls"] == 2     # re-run once, in backward


def test_the_output_is_not_kept_between_forward_and_backward():
    assert run(False)["alive"] is True      # plain autograd keeps the gathered activation
    assert run(True)["alive"] is False      # the engine kept a handle instead


def test_random_draws_are_replayed_identically():
    plain, ours = run(False, dropout=0.5), run(True, dropout=0.5)
    assert torch.equal(plain["y"], ours["y"])
    assert torch.equal(plain["gx"], ours["gx"]) and torch.equal(plain["gw"], ours["gw"])
    assert ours["calls"] == 2


def test_outside_a_scope_or_without_grad_it_is_the_plain_call():
    gather = Gather()
    fn = _OutputRecomputed(gather, "gather")
    x = torch.randn(1, 2, 3, requires_grad=True)
    out = fn(x)                                  # no layer scope open: nothing recorded
    out.sum().backward()
    with torch.no_grad():
        _LayerScope(lambda t: fn(t), "layers[0]")(x)
    assert gather.calls == 2 and torch.equal(x.grad, torch.ones_like(x) * 2)


def test_a_scoped_layer_frees_its_graph_after_a_split_backward():
    """The zero-bubble schedules' split backward (torch's ``stage_backward_input``, which retains the
    graph, then ``stage_backward_weight``): everything a scoped layer saved is freed after the weight
    step. A pack hook that keeps the tensor itself would tie an op's saved output to its own grad_fn
    (tanh saves its output), a cycle gc cannot break, and the layer's graph would never be freed."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    saved = []
    m[1].register_forward_hook(lambda mod, i, o: saved.append(weakref.ref(o.untyped_storage())))
    x = torch.randn(4, 16, requires_grad=True)
    out = _LayerScope(m.forward, "m")(x)
    param_groups = stage_backward_input([out], [torch.ones_like(out)], [x], m.parameters())[1]
    stage_backward_weight(m.parameters(), param_groups)
    del out, param_groups
    gc.collect()
    assert saved[0]() is None
    reference = torch.autograd.grad(m(x).sum(), list(m.parameters()))
    assert all(p.grad is not None and torch.equal(p.grad, r) for p, r in zip(m.parameters(), reference))
