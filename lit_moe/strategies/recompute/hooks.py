"""What a wrapper runs (a module's forward plus the forward hooks it had when recompute was applied),
and the first wrapper: activation checkpointing of a forward (whole layer, selected module)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


# ----------------------------------------------------------------------------------------------
# what a wrapper runs: the module's forward plus the hooks it had when recompute was applied
# ----------------------------------------------------------------------------------------------
class _ModuleCall:
    """A module's original ``forward`` together with the forward hooks it had when recompute was
    applied (those of tensor/expert/context parallelism), which are moved off the module and run
    here, in the same order and with the same semantics as ``nn.Module.__call__``. So they are
    inside the recomputed region and a recompute re-runs them with the forward: a hook that swaps
    in local parameter shards or gathers the sequence runs again before the recomputed forward,
    as it did before the original one. Hooks added later (FSDP's) stay on the module, outside,
    as with TorchTitan's checkpoint wrapper applied between parallelisation and FSDP."""

    def __init__(self, module: nn.Module, forward: Callable):
        self.module, self.forward = module, forward
        self.pre = [(hid, hook, hid in module._forward_pre_hooks_with_kwargs)
                    for hid, hook in module._forward_pre_hooks.items()]
        self.post = [(hid, hook, hid in module._forward_hooks_with_kwargs, hid in module._forward_hooks_always_called)
                     for hid, hook in module._forward_hooks.items()]
        for hid, *_ in self.pre:
            module._forward_pre_hooks.pop(hid)
            module._forward_pre_hooks_with_kwargs.pop(hid, None)
        for hid, *_ in self.post:
            module._forward_hooks.pop(hid)
            module._forward_hooks_with_kwargs.pop(hid, None)
            module._forward_hooks_always_called.pop(hid, None)

    def restore(self) -> None:
        """Put the hooks back on the module, ahead of any added since (dicts mutated in place, so
        that the hooks' removable handles keep working)."""
        m = self.module
        for hooks, mine in ((m._forward_pre_hooks, [(hid, hook) for hid, hook, _ in self.pre]),
                            (m._forward_hooks, [(hid, hook) for hid, hook, _, _ in self.post])):
            later = list(hooks.items())
            hooks.clear()
            hooks.update(mine + later)
        m._forward_pre_hooks_with_kwargs.update({hid: True for hid, _, kw in self.pre if kw})
        m._forward_hooks_with_kwargs.update({hid: True for hid, _, kw, _ in self.post if kw})
        m._forward_hooks_always_called.update({hid: True for hid, _, _, always in self.post if always})

    def __call__(self, *args, **kwargs):
        m = self.module
        for _, hook, with_kwargs in self.pre:
            if with_kwargs:
                res = hook(m, args, kwargs)
                if res is not None:
                    args, kwargs = res
            else:
                res = hook(m, args)
                if res is not None:
                    args = res if isinstance(res, tuple) else (res,)
        result, called = None, set()
        try:
            result = self.forward(*args, **kwargs)
            for hid, hook, with_kwargs, _ in self.post:
                called.add(hid)
                res = hook(m, args, kwargs, result) if with_kwargs else hook(m, args, result)
                if res is not None:
                    result = res
            return result
        except Exception:
            # like nn.Module.__call__: always-call hooks run on errors too (this includes the
            # checkpoint's early stop of a recompute), their own errors giving way to the first
            for hid, hook, with_kwargs, always in self.post:
                if always and hid not in called:
                    try:
                        hook(m, args, kwargs, result) if with_kwargs else hook(m, args, result)
                    except Exception:
                        pass
            raise


# ----------------------------------------------------------------------------------------------
# wrapper 1: checkpoint a forward (whole layer, selected module)
# ----------------------------------------------------------------------------------------------
class _CheckpointedForward:
    """Stands in for ``module.forward`` (an instance attribute shadows the class method, so the
    module and its parameter names stay as they are): runs the :class:`_ModuleCall` under
    non-reentrant activation checkpointing. Routing counts and losses written by the model are
    not repeated by the recompute because the model counts only outside the autograd engine."""

    def __init__(self, call: Callable, path: str, preserve_rng_state: bool = True):
        self.call = call
        self.path = path
        self.preserve_rng_state = preserve_rng_state

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.call(*args, **kwargs)
        return checkpoint(self.call, *args, use_reentrant=False,
                          preserve_rng_state=self.preserve_rng_state, **kwargs)

    def __repr__(self) -> str:
        return f"CheckpointedForward({self.path})"


def _draws_random_numbers(model: nn.Module) -> bool:
    """Whether a forward can draw random numbers (dropout), so that a recompute must replay the RNG
    state of the forward. Saving and restoring it costs time at every checkpoint, so it is skipped
    only when the model says it has no dropout; a model without ``config`` is assumed to have some."""
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    if config is None:
        return True
    return any((getattr(config, name, 0) or 0) > 0 for name in ("attention_dropout", "hidden_dropout"))

