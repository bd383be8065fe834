"""lit_moe.strategies.hooks.around_forward: states pair up with calls, also when activation recompute
stops a forward early (non-reentrant checkpoint's early stop never reaches the post-forward hooks)."""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lit_moe.strategies.hooks import around_forward


def test_states_do_not_pile_up_under_recompute_early_stop():
    lin = nn.Linear(4, 4)
    calls = []
    stack = around_forward(lin, lambda m, a, k: (a, k, "state"), lambda m, out, state: calls.append(state) or out).states

    def block(x):
        # nothing after the linear saves a tensor, so the recompute stops inside it
        return lin(torch.tanh(x)) * 2.0

    x = torch.randn(3, 4, requires_grad=True)
    for _ in range(3):
        checkpoint(block, x, use_reentrant=False).sum().backward()
        assert stack == []
    assert calls == ["state"] * 3            # the real forwards ran ``after``; the stopped recompute not
    torch.testing.assert_close(x.grad, 3 * torch.autograd.grad(block(x).sum(), x)[0])
