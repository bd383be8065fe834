"""The saved-tensor engine behind output recompute (communication steps, selected function
attributes): an op that saves the output (or a view of it) of a wrapped call saves a small handle
instead, and backward re-runs the call from its kept inputs when it needs the value."""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import get_device_states, set_device_states

from lit_moe.strategies.recompute.hooks import _AroundCall


# ----------------------------------------------------------------------------------------------
# wrapper 2: output recompute (communication steps, selected modules of recompute_comm)
# ----------------------------------------------------------------------------------------------
_local = threading.local()


def _scopes() -> list:
    if not hasattr(_local, "scopes"):
        _local.scopes = []
    return _local.scopes


def _storage_key(t: torch.Tensor) -> Optional[tuple]:
    """Identity of the memory a tensor views: (device, storage address), or None when it has no
    plain storage (tensor subclasses other than DTensor, meta tensors)."""
    local = getattr(t, "_local_tensor", None)  # DTensor: its local shard holds the memory
    base = local if isinstance(local, torch.Tensor) else t
    if base.device.type == "meta":
        return None
    try:
        storage = base.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return (base.device, storage.data_ptr()) if storage.data_ptr() else None


def _autocast_state(device_type: str) -> list[dict]:
    states = []
    for dev in dict.fromkeys([device_type, "cpu"]):
        try:
            states.append(dict(device_type=dev, enabled=torch.is_autocast_enabled(dev),
                               dtype=torch.get_autocast_dtype(dev), cache_enabled=torch.is_autocast_cache_enabled()))
        except (RuntimeError, AttributeError):  # device type without autocast support
            pass
    return states


def _contiguous(out: Any) -> Any:
    """Outputs made contiguous, so that what consumers save is a view of them (an op handed a
    non-contiguous input, e.g. an all-gather along the sequence ``movedim``-ed into place, would
    save its own contiguous copy, which cannot be recognised). The copy is one the consumer would
    have made anyway."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.contiguous(), out)


class _Recompute:
    """One call whose outputs were not kept: the callable, its inputs (kept, detached) and the
    autocast state, enough to produce the same outputs again in backward."""

    def __init__(self, fn: Callable, path: str, args: tuple, kwargs: dict, outputs: list[torch.Tensor],
                 rng: Optional[tuple] = None):
        self.fn, self.path = fn, path
        self.inputs = pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), (args, kwargs))
        self.versions = [t._version for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self.meta = [(o.shape, o.dtype, o.stride(), o.storage_offset()) for o in outputs]
        self.autocast = _autocast_state(outputs[0].device.type)
        self.rng = rng  # RNG states from before the call, when the model draws random numbers
        self.cache: Optional[list[torch.Tensor]] = None
        self.pending = 0  # handles not yet unpacked; the recomputed outputs are dropped at 0

    def outputs(self) -> list[torch.Tensor]:
        if self.cache is None:
            leaves = [t for t in pytree.tree_leaves(self.inputs) if isinstance(t, torch.Tensor)]
            if [t._version for t in leaves] != self.versions:
                raise RuntimeError(f"recompute of {self.path!r}: an input was modified in place after the "
                                   "forward call, its output cannot be recomputed")
            _check_not_fsdp(self.fn, self.path)
            args, kwargs = self.inputs
            with torch.no_grad(), _Autocast(self.autocast), _ReplayRNG(self.rng):
                out = _contiguous(self.fn(*args, **kwargs))
            outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
            got = [(o.shape, o.dtype, o.stride(), o.storage_offset()) for o in outs]
            if got != self.meta:
                raise RuntimeError(f"recompute of {self.path!r} produced outputs {got} in backward, "
                                   f"but {self.meta} in forward: the call must be deterministic")
            self.cache = outs
        return self.cache


def _check_not_fsdp(fn: Callable, path: str) -> None:
    """A module sharded by FSDP on its own (the routed experts, the router) has its parameters
    gathered only inside its own backward; a consumer's backward, where an output is recomputed,
    comes before that."""
    module = getattr(fn, "module", None)
    if module is None:
        return
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in module.modules()):
        raise RuntimeError(f"recompute_comm.select_module: {path!r} is or contains a module sharded by FSDP "
                           "on its own, whose output cannot be recomputed before its backward; select its "
                           "communication functions (or use recompute.select_module) instead")


def _rng_states(args: Any) -> tuple:
    """The CPU RNG state and those of the accelerators the inputs live on (before a call)."""
    devices, states = get_device_states(*pytree.tree_leaves(args))
    device_type = next((t.device.type for t in pytree.tree_leaves(args)
                        if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")), None)
    return torch.get_rng_state(), devices, states, device_type


class _ReplayRNG:
    """Inside: the RNG states of the original call (outside, the current ones are kept)."""

    def __init__(self, rng: Optional[tuple]):
        self.rng = rng
        self.fork = None

    def __enter__(self):
        if self.rng is not None:
            cpu, devices, states, device_type = self.rng
            self.fork = torch.random.fork_rng(devices=devices, device_type=device_type or "cpu")  # no accelerator tensors: CPU RNG only
            self.fork.__enter__()
            torch.set_rng_state(cpu)
            if devices:
                set_device_states(devices, states, device_type=device_type)

    def __exit__(self, *exc):
        if self.fork is not None:
            self.fork.__exit__(*exc)


class _Autocast:
    def __init__(self, states: list[dict]):
        self.contexts = [torch.autocast(**s) for s in states]

    def __enter__(self):
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.contexts):
            c.__exit__(*exc)


class _Handle:
    """Saved in place of a tensor that views a recomputable output."""

    __slots__ = ("rec", "index", "size", "stride", "offset", "dtensor")

    def __init__(self, rec: _Recompute, index: int, t: torch.Tensor):
        local = getattr(t, "_local_tensor", None)
        base = local if isinstance(local, torch.Tensor) else t
        self.rec, self.index = rec, index
        self.size, self.stride, self.offset = base.size(), base.stride(), base.storage_offset()
        # a DTensor is rebuilt around the recomputed local memory
        self.dtensor = (t.device_mesh, t.placements, t.shape, t.stride()) if base is not t else None
        rec.pending += 1

    def unpack(self) -> torch.Tensor:
        out = self.rec.outputs()[self.index]
        self.rec.pending -= 1
        if self.rec.pending <= 0:
            self.rec.cache = None  # a second backward through retain_graph recomputes again
        local = getattr(out, "_local_tensor", None)
        base = local if isinstance(local, torch.Tensor) else out
        t = base.as_strided(self.size, self.stride, self.offset)
        if self.dtensor is not None:
            from torch.distributed.tensor import DTensor

            mesh, placements, shape, stride = self.dtensor
            t = DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)
        return t


class _Scope:
    """Alive while one layer's forward runs: the outputs recorded so far, and the saved-tensor
    pack hook that swaps them (or views of them) for handles."""

    def __init__(self):
        self.entries: list[tuple[tuple, torch.Tensor, _Recompute, int]] = []

    def record(self, fn: Callable, path: str, args: tuple, kwargs: dict, out: Any, rng: Optional[tuple]) -> None:
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        if not outs:
            return
        rec = _Recompute(fn, path, args, kwargs, outs, rng)
        for i, o in enumerate(outs):
            key = _storage_key(o)
            if key is not None:
                # holding ``o`` until the layer's forward ends keeps its address from being reused
                self.entries.append((key, o, rec, i))

    def pack(self, t: torch.Tensor) -> Any:
        if self.entries:
            key = _storage_key(t)
            if key is not None:
                for k, o, rec, i in self.entries:
                    if k == key and t.dtype == o.dtype:
                        return _Handle(rec, i, t)
        # detached (the same memory, no grad_fn): keeping the tensor itself would let an op's saved
        # output hold its own grad_fn, a cycle through C++ that gc cannot break; only a backward
        # that frees the graph breaks it, so the split backward of the zero-bubble schedules
        # (retain_graph=True for the input gradients) leaked such graphs (pytorch/pytorch#189025).
        # Autograd re-attaches grad_fn and version counter when it unpacks.
        return t.detach()


def _unpack(saved: Any) -> torch.Tensor:
    return saved.unpack() if isinstance(saved, _Handle) else saved


class _OutputRecomputed(_AroundCall):
    """Around a call (a communication step's function, from the step's ``recompute`` slot, or a module's call, by
    forward hooks): records the call's outputs with the enclosing layer's :class:`_Scope`, so they
    are recomputed in backward by ``call`` instead of kept. Outside a scope (or without grad) it
    changes nothing."""

    def __init__(self, call: Callable, path: str, preserve_rng_state: bool = True):
        super().__init__(call, path)
        self.preserve_rng_state = preserve_rng_state

    def enter(self, args: tuple, kwargs: dict) -> Optional[tuple]:
        if not (_scopes() and torch.is_grad_enabled()):
            return None
        return args, kwargs, _rng_states((args, kwargs)) if self.preserve_rng_state else None

    def exit(self, state: Optional[tuple], output: Any) -> Any:
        if state is None or output is None:
            return output
        args, kwargs, rng = state
        out = _contiguous(output)
        _scopes()[-1].record(self.call, self.path, args, kwargs, out, rng)
        return out


class _LayerScope(_AroundCall):
    """Around a layer's call: opens the :class:`_Scope` its output-recomputed calls report to, and
    installs the scope's pack hook while the layer runs."""

    def enter(self, args: tuple, kwargs: dict) -> Optional[tuple]:
        if not torch.is_grad_enabled():
            return None
        scope = _Scope()
        _scopes().append(scope)
        packing = torch.autograd.graph.saved_tensors_hooks(scope.pack, _unpack)
        packing.__enter__()
        return scope, packing

    def exit(self, state: Optional[tuple], output: Any) -> Any:
        if state is not None:
            scope, packing = state
            packing.__exit__(None, None, None)
            _scopes().pop()
            scope.entries.clear()
        return output
