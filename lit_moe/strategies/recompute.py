"""Activation recompute (``recompute``) and communication recompute (``recompute_comm``).

Three ways a part of a decoder layer can trade compute for memory, all applied in place so that
parameter names (FQNs) never change (checkpoints and the Hugging Face export rely on them):

* **whole layer** (``recompute.full_recompute_layer``): the layer's ``forward`` runs under
  non-reentrant activation checkpointing. Only the layer's inputs are kept; everything inside is
  recomputed in backward.
* **selected module** (``recompute.select_module``, a module path such as ``self_attention``): the
  same, for one sub-module.
* **output recompute** (``recompute.select_module`` matching a function attribute such as
  ``mlp.router.all_gather``, and every path of ``recompute_comm.select_module``): the call runs
  normally, but its *output* is not kept for backward. An op that saves the output (or a view of
  it) saves a small handle instead, and backward re-runs the call from its (kept) inputs when it
  needs the value. This is what "recompute a communication step" means: e.g. the sequence
  all-gather in front of a tensor-parallel matmul is re-done in backward instead of holding the
  gathered activation from forward to backward.

Layer ids address ``model.blocks()``: decoder layers ``0..L-1``, then the MTP layers' decoder
layers ``L..L+M-1``. Paths are dotted module paths inside one such layer (``self_attention``,
``self_attention.q_b_proj``, ``mlp.experts``) or a module path plus the name of a callable instance
attribute (``mlp.router.all_gather``). A regex must match a path fully (``re.fullmatch``).

Order of application (TorchTitan): tensor/expert/context parallel first (so that their
communication functions exist and can be matched), then this, then FSDP. Forward hooks a wrapped
module already has (the parallel steps': parameter shards, sequence gathers) are moved inside the
recomputed region and re-run with it; FSDP's hooks, added later, stay outside (they gather the
parameters before the recompute in backward).
Unlike MindFormers, which ignores these sections on one device, recompute works on one device.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint, get_device_states, set_device_states

from lit_moe.config import ConfigError, RecomputeCommConfig, RecomputeConfig, parse_layer_specs

log = logging.getLogger(__name__)

FSDP_ALL_GATHER = "fsdp.all_gather"
"""Virtual path of a layer's FSDP parameter all-gather, for ``recompute_comm.select_module``. A layer
whose pattern matches it has its gathered parameters freed after forward and gathered again in
backward (FSDP2 ``reshard_after_forward=True``), also under ``optim_grads`` (ZeRO-2), which would
otherwise keep them. Read by the strategy through :func:`fsdp_reshard_after_forward`."""


class RecomputeWarning(UserWarning):
    """A recompute pattern that selects nothing, or a setting that is ignored."""


# ----------------------------------------------------------------------------------------------
# validation: YAML sections -> a plan of layer ids
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RecomputePlan:
    """The validated ``recompute`` / ``recompute_comm`` sections, with layer specs expanded."""

    full_layers: tuple[int, ...] = ()
    """Layers recomputed whole."""
    select: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """``(regex, layers)`` pairs of ``recompute.select_module`` (empty unless ``mode: select``)."""
    comm: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """``(regex, layers)`` pairs of ``recompute_comm.select_module`` (empty unless enabled)."""

    @property
    def empty(self) -> bool:
        return not (self.full_layers or self.select or self.comm)


def _as_section(value: Any, cls: type, name: str) -> Any:
    """Accept the dataclass, a plain dict (``{"mode": "full", ...}``) or None."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, dict):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"{name}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        return cls(**value)
    raise ConfigError(f"{name}: expected a mapping, got {value!r}")


def _normalise_mode(mode: Any) -> Optional[str]:
    if mode is None:
        return None
    if isinstance(mode, str) and mode.strip().lower() in ("none", "full", "select"):
        m = mode.strip().lower()
        return None if m == "none" else m
    raise ConfigError(f"recompute.mode: must be None, 'full' or 'select', got {mode!r}")


def _parse_select(select: Any, total_layers: int, name: str, required_because: str) -> tuple:
    """``{regex: layer specs}`` -> ``((regex, (layers...)), ...)``; every regex compiled, every spec checked."""
    if select is None or (isinstance(select, dict) and not select):
        raise ConfigError(f"{name}: {required_because} but select_module is missing or empty")
    if not isinstance(select, dict):
        raise ConfigError(f"{name}: must be a mapping {{regex: layer specs}}, got {select!r}")
    out = []
    for pattern, specs in select.items():
        field = f"{name}[{pattern!r}]"
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"{field}: the key must be a non-empty regular expression string")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"{field}: invalid regular expression: {e}") from None
        layers = parse_layer_specs(specs, total_layers, field)
        if not layers:
            raise ConfigError(f"{field}: names no layers")
        out.append((pattern, tuple(layers)))
    return tuple(out)


def validate_recompute(recompute: RecomputeConfig | dict | None, recompute_comm: RecomputeCommConfig | dict | None,
                       total_layers: int) -> RecomputePlan:
    """Check both sections against a model of ``total_layers`` layers (decoder plus MTP) without
    building anything; raise :class:`ConfigError` naming the field, or return the expanded plan."""
    recompute = _as_section(recompute, RecomputeConfig, "recompute")
    recompute_comm = _as_section(recompute_comm, RecomputeCommConfig, "recompute_comm")
    full: tuple[int, ...] = ()
    select: tuple = ()
    comm: tuple = ()

    if recompute is not None:
        mode = _normalise_mode(recompute.mode)
        if mode == "full":
            if not recompute.full_recompute_layer:
                raise ConfigError("recompute.full_recompute_layer: mode is 'full' but full_recompute_layer "
                                  "is missing or empty")
            full = tuple(parse_layer_specs(recompute.full_recompute_layer, total_layers,
                                           "recompute.full_recompute_layer"))
            if recompute.select_module:
                warnings.warn("recompute.select_module is ignored because recompute.mode is 'full' "
                              "(it applies only with mode: select)", RecomputeWarning, stacklevel=2)
        elif mode == "select":
            if recompute.full_recompute_layer:
                full = tuple(parse_layer_specs(recompute.full_recompute_layer, total_layers,
                                               "recompute.full_recompute_layer"))
            select = _parse_select(recompute.select_module, total_layers, "recompute.select_module",
                                   "mode is 'select'")
        elif recompute.full_recompute_layer or recompute.select_module:
            warnings.warn("recompute.full_recompute_layer / recompute.select_module are ignored because "
                          "recompute.mode is None (set mode: full or select)", RecomputeWarning, stacklevel=2)

    if recompute_comm is not None:
        if not isinstance(recompute_comm.enable, bool):
            raise ConfigError(f"recompute_comm.enable: expected true or false, got {recompute_comm.enable!r}")
        if recompute_comm.enable:
            comm = _parse_select(recompute_comm.select_module, total_layers, "recompute_comm.select_module",
                                 "recompute_comm.enable is true")
        elif recompute_comm.select_module:
            log.info("recompute_comm.enable is false: recompute_comm.select_module is not applied")

    return RecomputePlan(full_layers=full, select=select, comm=comm)


# ----------------------------------------------------------------------------------------------
# the addressable paths of a layer
# ----------------------------------------------------------------------------------------------
def _callable_attributes(module: nn.Module) -> Iterable[tuple[str, Callable]]:
    """Public instance attributes holding plain callables (functions, partials, bound methods, our
    wrappers): how the parallel steps expose their communication ops. Sub-modules, classes and
    ``forward`` are excluded."""
    for name, value in vars(module).items():
        if name.startswith("_") or name == "forward":
            continue
        if isinstance(value, (nn.Module, type, torch.Tensor)) or not callable(value):
            continue
        yield name, value


def addressable_paths(layer: nn.Module) -> dict[str, tuple[nn.Module, Optional[str]]]:
    """Every path a regex can select inside ``layer``: ``path -> (module, None)`` for sub-modules
    and ``path -> (owner module, attribute)`` for callable attributes. Ordered by depth, then name."""
    paths: dict[str, tuple[nn.Module, Optional[str]]] = {}
    for prefix, module in layer.named_modules():
        if prefix:
            paths[prefix] = (module, None)
        for attr, _ in _callable_attributes(module):
            paths[f"{prefix}.{attr}" if prefix else attr] = (module, attr)
    return dict(sorted(paths.items(), key=lambda kv: (kv[0].count("."), kv[0])))


def _under(path: str, parents: Iterable[str]) -> bool:
    return any(path.startswith(p + ".") for p in parents)


def _match(patterns: tuple, layer_id: int, paths: Iterable[str], matched: dict[str, bool]) -> list[str]:
    """Paths of ``layer_id`` fully matched by a pattern that lists this layer; ``matched[pattern]``
    records whether the pattern hit anything anywhere."""
    hits: list[str] = []
    for pattern, layers in patterns:
        if layer_id not in layers:
            continue
        rx = re.compile(pattern)
        found = [p for p in paths if rx.fullmatch(p)]
        matched[pattern] = matched.get(pattern, False) or bool(found)
        hits.extend(p for p in found if p not in hits)
    return hits


def _drop_children(paths: list[str], order: list[str]) -> list[str]:
    """Keep the outermost of nested selections (``order`` is depth-then-name)."""
    kept: list[str] = []
    for p in sorted(paths, key=order.index):
        if not _under(p, kept):
            kept.append(p)
    return kept


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


# ----------------------------------------------------------------------------------------------
# wrapper 2: output recompute (communication steps, selected function attributes)
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
        return t


def _unpack(saved: Any) -> torch.Tensor:
    return saved.unpack() if isinstance(saved, _Handle) else saved


class _OutputRecomputed:
    """Stands in for a callable (a function attribute, or a module's ``forward``): calls it and
    records its outputs with the enclosing layer's :class:`_Scope`, so they are recomputed in
    backward instead of kept. Outside a scope (or without grad) it is the plain call."""

    def __init__(self, fn: Callable, path: str, preserve_rng_state: bool = True):
        self.fn = fn
        self.path = path
        self.preserve_rng_state = preserve_rng_state

    def __call__(self, *args, **kwargs):
        scopes = _scopes()
        if not (scopes and torch.is_grad_enabled()):
            return self.fn(*args, **kwargs)
        rng = _rng_states((args, kwargs)) if self.preserve_rng_state else None
        out = _contiguous(self.fn(*args, **kwargs))
        scopes[-1].record(self.fn, self.path, args, kwargs, out, rng)
        return out

    def __repr__(self) -> str:
        return f"OutputRecomputed({self.path})"


class _ScopedForward:
    """Stands in for a layer's ``forward``: opens the :class:`_Scope` its output-recomputed calls
    report to, and installs the scope's pack hook for the layer's forward."""

    def __init__(self, call: Callable, path: str):
        self.call = call
        self.path = path

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.call(*args, **kwargs)
        scope = _Scope()
        _scopes().append(scope)
        try:
            with torch.autograd.graph.saved_tensors_hooks(scope.pack, _unpack):
                return self.call(*args, **kwargs)
        finally:
            _scopes().pop()
            scope.entries.clear()

    def __repr__(self) -> str:
        return f"ScopedForward({self.path})"


# ----------------------------------------------------------------------------------------------
# apply
# ----------------------------------------------------------------------------------------------
_APPLIED = "_lit_moe_recompute"  # model attribute: (plan, undo list)


def _wrap_forward(module: nn.Module, wrapper: Callable, path: str, undo: list) -> None:
    undo.append((module, "forward", module.__dict__.get("forward")))
    call = _ModuleCall(module, module.forward)
    undo.append((call, None, None))
    module.forward = wrapper(call, path)


def _wrap_attr(owner: nn.Module, attr: str, path: str, undo: list, wrapper: Callable) -> None:
    fn = getattr(owner, attr)
    undo.append((owner, attr, fn))
    setattr(owner, attr, wrapper(fn, path))


def apply_recompute(model: nn.Module, recompute: RecomputeConfig | dict | None,
                    recompute_comm: RecomputeCommConfig | dict | None, parallel_dims: Any = None) -> None:
    """Apply ``recompute`` and ``recompute_comm`` to ``model.blocks()`` in place.

    Call it after tensor/expert/context parallel and before FSDP. Calling it again with the same
    sections is a no-op (Lightning's ``configure_model`` may run more than once); with different
    sections it is an error (call :func:`remove_recompute` first). ``parallel_dims`` is accepted for
    the strategy's convenience; recompute behaves the same on one device and on many.
    """
    blocks = list(model.blocks())
    plan = validate_recompute(recompute, recompute_comm, len(blocks))
    applied = getattr(model, _APPLIED, None)
    if applied is not None:
        if applied[0] == plan:
            return
        raise RuntimeError("apply_recompute: the model already has a different recompute applied; "
                           "call remove_recompute(model) first")
    undo: list = []
    rng = _draws_random_numbers(model)

    def make_checkpointed(forward: Callable, path: str) -> _CheckpointedForward:
        return _CheckpointedForward(forward, path, preserve_rng_state=rng)

    def make_output_recomputed(fn: Callable, path: str) -> _OutputRecomputed:
        return _OutputRecomputed(fn, path, preserve_rng_state=rng)

    matched_select: dict[str, bool] = {p: False for p, _ in plan.select}
    matched_comm: dict[str, bool] = {p: False for p, _ in plan.comm}
    summary: list[str] = []
    fsdp_layers: list[int] = []

    for layer_id, block in enumerate(blocks):
        paths = addressable_paths(block)
        order = list(paths)
        fsdp = [p for p, layers in plan.comm if layer_id in layers and re.fullmatch(p, FSDP_ALL_GATHER)]
        if fsdp:  # independent of activation recompute: parameters are re-gathered either way
            block._lit_moe_reshard_after_forward = True
            undo.append((block, "_lit_moe_reshard_after_forward", None))
            matched_comm.update(dict.fromkeys(fsdp, True))
            fsdp_layers.append(layer_id)
        if layer_id in plan.full_layers:
            _match(plan.select, layer_id, order, matched_select)  # counts as a hit; the layer covers it
            dropped = _match(plan.comm, layer_id, order, matched_comm)
            if dropped:
                log.info("recompute_comm: layer %d is recomputed whole, %s already recomputed", layer_id, dropped)
            _wrap_forward(block, make_checkpointed, f"layers[{layer_id}]", undo)
            summary.append(f"{layer_id}: whole layer")
            continue

        selected = _drop_children(_match(plan.select, layer_id, order, matched_select), order)
        checkpointed = [p for p in selected if paths[p][1] is None]
        # communication steps already inside a recomputed region are recomputed with it
        comm = [p for p in _drop_children(_match(plan.comm, layer_id, order, matched_comm), order)
                if p not in selected and not _under(p, checkpointed)]

        output_recomputed = [p for p in selected if paths[p][1] is not None] + comm
        for p in checkpointed:
            _wrap_forward(paths[p][0], make_checkpointed, p, undo)
        for p in output_recomputed:
            module, attr = paths[p]
            if attr is None:
                _wrap_forward(module, make_output_recomputed, p, undo)
            else:
                _wrap_attr(module, attr, p, undo, make_output_recomputed)
        if output_recomputed:
            _wrap_forward(block, _ScopedForward, f"layers[{layer_id}]", undo)
        if checkpointed or output_recomputed:
            parts = [f"recompute {checkpointed}"] if checkpointed else []
            parts += [f"recompute output of {output_recomputed}"] if output_recomputed else []
            summary.append(f"{layer_id}: " + ", ".join(parts))

    for section, matched in (("recompute.select_module", matched_select), ("recompute_comm.select_module", matched_comm)):
        for pattern, hit in matched.items():
            if not hit:
                warnings.warn(f"{section}[{pattern!r}] matches no module or function in its layers; "
                              "nothing is recomputed for it", RecomputeWarning, stacklevel=2)
    if fsdp_layers:
        summary.append(f"FSDP all-gather recomputed (resharded after forward) in layers {fsdp_layers}")
    if summary:
        log.info("recompute: %s", "; ".join(summary))
    # a plain attribute (not a sub-module): the list holds references to sub-modules
    object.__setattr__(model, _APPLIED, (plan, undo))


def remove_recompute(model: nn.Module) -> None:
    """Undo :func:`apply_recompute` (restores every wrapped ``forward`` and function attribute)."""
    applied = getattr(model, _APPLIED, None)
    if applied is None:
        return
    for owner, attr, previous in reversed(applied[1]):
        if isinstance(owner, _ModuleCall):
            owner.restore()
        elif previous is None:
            owner.__dict__.pop(attr, None)
        else:
            setattr(owner, attr, previous)
    object.__delattr__(model, _APPLIED)


def fsdp_reshard_after_forward(block: nn.Module, default: bool) -> bool:
    """``reshard_after_forward`` for ``fully_shard(block)``: True when ``recompute_comm`` selected
    this layer's FSDP all-gather (:data:`FSDP_ALL_GATHER`), else ``default``."""
    return True if getattr(block, "_lit_moe_reshard_after_forward", False) else default
