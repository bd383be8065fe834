"""How recompute sits on a module without changing it: a pair of forward hooks around every hook the
module has (:func:`around_call`), what a re-run runs (:class:`_ModuleCall`: the module's forward with
those hooks), and the first wrapper: activation checkpointing (whole layer, selected module)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint
from torch.utils.hooks import RemovableHandle


# ----------------------------------------------------------------------------------------------
# the mechanism: forward hooks around the module's call (no attribute of the module is replaced)
# ----------------------------------------------------------------------------------------------
class _AroundCall:
    """A region around a call: ``enter(args, kwargs) -> state`` before it, ``exit(state, output) ->
    output`` after it (``output`` None: the call raised). Put on a module by :func:`around_call`
    (its bound hook methods, so that a deep copy of the module copies the region with it), or
    called directly around ``call`` (a plain callable)."""

    # a region opened in a pre-hook and closed in a post-hook cannot be traced by dynamo (and a
    # recompute runs eagerly): a compiled function of the model leaves a module carrying one out
    # (lit_moe.model.compile.own_graph_breaks), as it leaves out modules with FSDP's hooks
    breaks_compiled_graphs = True

    def __init__(self, call: Callable, path: str):
        self.call = call
        self.path = path
        self._states: list = []   # per open call: nested calls (a recompute inside a backward) pair up

    def enter(self, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def exit(self, state: Any, output: Any) -> Any:
        raise NotImplementedError

    def __call__(self, *args, **kwargs):
        state = self.enter(args, kwargs)
        try:
            output = self.call(*args, **kwargs)
        except BaseException:
            self.exit(state, None)
            raise
        return self.exit(state, output)

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._states.append(self.enter(args, kwargs))

    def post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        return self.exit(self._states.pop(), output)

    def __repr__(self) -> str:
        return f"{type(self).__name__.lstrip('_')}({self.path})"


def around_call(module: nn.Module, region: _AroundCall) -> tuple[RemovableHandle, RemovableHandle]:
    """Open ``region`` before every forward hook ``module`` has now and close it after all of them:
    the pre-hook is prepended and the post-hook appended (always called, also when the forward
    raises). Hooks added later are not re-run by a recompute: FSDP2's, prepended and appended after
    this, stay outside (they gather the parameters before a recompute in backward)."""
    return (module.register_forward_pre_hook(region.pre_hook, with_kwargs=True, prepend=True),
            module.register_forward_hook(region.post_hook, with_kwargs=True, always_call=True))


def regions(module: nn.Module) -> list[_AroundCall]:
    """The recompute regions :func:`around_call` put on ``module``, outermost first."""
    return [getattr(h, "__self__") for h in module._forward_pre_hooks.values()
            if isinstance(getattr(h, "__self__", None), _AroundCall)]


# ----------------------------------------------------------------------------------------------
# what a re-run runs: the module's forward plus the hooks it had when recompute was applied
# ----------------------------------------------------------------------------------------------
class _ModuleCall:
    """A module's ``forward`` together with the forward hooks it had when recompute was applied
    (those of tensor/expert/context parallelism), run in the same order and with the same semantics
    as ``nn.Module.__call__``: a recompute re-runs them with the forward, so a hook that swaps in
    local parameter shards or gathers the sequence runs again before the recomputed forward, as it
    did before the original one. The hooks stay on the module (the forward runs them there); hooks
    added later (FSDP's) are not re-run, as with TorchTitan's checkpoint wrapper applied between
    parallelisation and FSDP."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.pre = [(hook, hid in module._forward_pre_hooks_with_kwargs)
                    for hid, hook in module._forward_pre_hooks.items()]
        self.post = [(hook, hid in module._forward_hooks_with_kwargs, hid in module._forward_hooks_always_called)
                     for hid, hook in module._forward_hooks.items()]

    def __call__(self, *args, **kwargs):
        m = self.module
        for hook, with_kwargs in self.pre:
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
            result = m.forward(*args, **kwargs)
            for i, (hook, with_kwargs, _) in enumerate(self.post):
                called.add(i)
                res = hook(m, args, kwargs, result) if with_kwargs else hook(m, args, result)
                if res is not None:
                    result = res
            return result
        except Exception:
            # like nn.Module.__call__: always-call hooks run on errors too (this includes the
            # checkpoint's early stop of a recompute), their own errors giving way to the first
            for i, (hook, with_kwargs, always) in enumerate(self.post):
                if always and i not in called:
                    try:
                        hook(m, args, kwargs, result) if with_kwargs else hook(m, args, result)
                    except Exception:
                        pass
            raise


# ----------------------------------------------------------------------------------------------
# wrapper 1: checkpoint a module's call (whole layer, selected module)
# ----------------------------------------------------------------------------------------------
_GENERATOR = torch_checkpoint._checkpoint_without_reentrant_generator
# its leading parameters before ``*args`` (``early_stop`` is recent); each gets its default but these
_GENERATOR_HEAD = [p for p in inspect.signature(_GENERATOR).parameters.values()
                   if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]


def _start_checkpoint(fn: Callable, preserve_rng_state: bool, args: tuple, kwargs: dict):
    """``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, ...)`` split at the call:
    the generator it runs around ``fn`` (torch's composable ``checkpoint`` uses it the same way from
    module hooks), advanced to the point where ``fn`` would run."""
    given = {"fn": fn, "preserve_rng_state": preserve_rng_state}
    head = [given.get(p.name, p.default) for p in _GENERATOR_HEAD]
    gen = _GENERATOR(*head, *args, **kwargs)
    next(gen)
    return gen


class _Checkpointed(_AroundCall):
    """Non-reentrant activation checkpointing of a call, exactly as ``torch.utils.checkpoint``'s:
    only the inputs are kept, everything inside is recomputed in backward by ``call`` (a
    :class:`_ModuleCall`). Routing counts and losses written by the model are not repeated by the
    recompute because the model counts only outside the autograd engine."""

    def __init__(self, call: Callable, path: str, preserve_rng_state: bool = True):
        super().__init__(call, path)
        self.preserve_rng_state = preserve_rng_state

    def enter(self, args: tuple, kwargs: dict) -> Optional[Any]:
        if not torch.is_grad_enabled():
            return None
        return _start_checkpoint(self.call, self.preserve_rng_state, args, kwargs)

    def exit(self, gen: Optional[Any], output: Any) -> Any:
        if gen is None:
            return output
        if output is None:   # the call raised: leave the checkpoint's contexts
            gen.close()
            return None
        try:
            next(gen)
        except StopIteration:
            return output
        raise AssertionError("the checkpoint generator yielded more than twice")


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

