"""Small module-hook helpers shared by the tensor-, expert- and context-parallel steps.

Parallelism is added around the model's modules with forward hooks, never by editing their
``forward``: the model code stays the single-device math, FSDP2's hooks keep their place (FSDP
registers its pre-forward hook with ``prepend=True``, so it runs first and ours see gathered
parameters; our post-forward hooks were registered before FSDP's, so they run before it reshards),
and recompute puts its region around them (:func:`lit_moe.strategies.recompute.hooks.around_call`).
Nothing is left on the modules: a module's own hooks are its record.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate


class _Around:
    """The hook pair of one :func:`around_forward` (bound methods: a module's hooks hold it, and its
    stack of states, one per forward still open)."""

    def __init__(self, before: Callable, after: Optional[Callable]):
        self.before, self.after = before, after
        self.states: list = []

    def pre(self, mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs, state = self.before(mod, args, kwargs)
        self.states.append(state)
        return args, kwargs

    def post(self, mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        state = self.states.pop()
        if output is None:   # forward raised (e.g. recompute stopping early): only drop the state
            return None
        return self.after(mod, output, state) if self.after is not None else output


def around_forward(module: nn.Module, before: Callable[[nn.Module, tuple, dict], tuple[tuple, dict, Any]],
                   after: Optional[Callable[[nn.Module, Any, Any], Any]] = None) -> _Around:
    """Run ``before(module, args, kwargs) -> (args, kwargs, state)`` ahead of ``module.forward`` and
    ``after(module, output, state) -> output`` behind it. Several wrappers of one module nest: the
    first added is the outermost. States are kept on a stack per wrapper so that repeated calls
    (activation recompute) pair up correctly."""
    around = _Around(before, after)
    module.register_forward_pre_hook(around.pre, with_kwargs=True)
    # prepend: wrappers nest (the last one added is the innermost: it runs last before forward and
    # first after it); FSDP's own post-forward hook, appended later, still runs after all of them.
    # always_call: activation recompute stops a forward early once it has rebuilt what backward
    # needs; the state pushed before it must still be popped.
    module.register_forward_hook(around.post, with_kwargs=True, prepend=True, always_call=True)
    return around


def transform_output(module: nn.Module, fn: Callable[[Any], Any]) -> None:
    """Replace ``module``'s output by ``fn(output)``."""
    module.register_forward_hook(lambda mod, args, output: fn(output))


# ----------------------------------------------------------------------------------------------
# local parameters during forward
# ----------------------------------------------------------------------------------------------
class _LocalParams:
    """The hook pair of :func:`use_local_params` (bound methods: a module's hooks show it has them)."""

    def __init__(self, partial_replicated_grads: bool):
        self.partial_replicated_grads = partial_replicated_grads
        self.saved: list[dict[str, torch.Tensor]] = []

    def pre(self, mod: nn.Module, args: tuple) -> None:
        params = mod._parameters
        swapped = {}
        for name, p in params.items():
            if isinstance(p, DTensor):
                grad_placements = p.placements
                if self.partial_replicated_grads:
                    grad_placements = tuple(Partial() if isinstance(pl, Replicate) else pl for pl in p.placements)
                swapped[name] = p
                # not a Parameter: FSDP2's unsafe_setattr_param writes _parameters the same way
                params[name] = p.to_local(grad_placements=grad_placements)
        self.saved.append(swapped)

    def post(self, mod: nn.Module, args: tuple, output: Any) -> Any:
        for name, p in self.saved.pop().items():
            mod._parameters[name] = p
        return output


def use_local_params(module: nn.Module, partial_replicated_grads: bool = True) -> None:
    """During ``module``'s forward, its DTensor parameters are replaced by their local tensors.

    Tensor-parallel math runs on local shards (Megatron style) while parameters stay DTensors for
    checkpoints, gradient norms and FSDP. A ``Replicate`` parameter inside a tensor-parallel region
    gets only this rank's part of the gradient (its heads, its sequence shard, its slice of tokens),
    so its gradient is declared ``Partial``: FSDP2 then all-reduces it over the tensor-parallel mesh
    before its own reduce-scatter (``FSDPParam._get_grad_inner_tensor`` redistributes to the
    parameter's placement). Once per module (tensor and expert parallel may both ask)."""
    if any(isinstance(getattr(h, "__self__", None), _LocalParams) for h in module._forward_pre_hooks.values()):
        return
    hooks = _LocalParams(partial_replicated_grads)
    module.register_forward_pre_hook(hooks.pre)
    module.register_forward_hook(hooks.post, always_call=True)


def direct_dtensor_params(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module._parameters.values())
