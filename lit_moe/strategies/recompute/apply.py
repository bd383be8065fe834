"""Applying a plan to a model in place (parameter names never change), undoing it, and what FSDP
needs to know about recomputed blocks."""

from __future__ import annotations

import logging
import re
import warnings
import weakref
from typing import Any, Callable

from torch import nn
from torch.utils.hooks import RemovableHandle

from lit_moe.config import ConfigError, RecomputeCommConfig, RecomputeConfig
from lit_moe.strategies.comm import CommStep
from lit_moe.model.names import no_match_error
from lit_moe.strategies.recompute.paths import _drop_children, _match, _under, addressable_paths
from lit_moe.strategies.recompute.plan import FSDP_ALL_GATHER, RecomputePlan, RecomputeWarning, validate_recompute
from lit_moe.strategies.recompute.hooks import _Checkpointed, _ModuleCall, _draws_random_numbers, around_call
from lit_moe.strategies.recompute.saved_tensors import _LayerScope, _OutputRecomputed


# ----------------------------------------------------------------------------------------------
# apply
# ----------------------------------------------------------------------------------------------
log = logging.getLogger(__name__)

# what apply_recompute put on each model: (plan, undo list), for idempotence and undo (no flag on the model)
_APPLIED: "weakref.WeakKeyDictionary[nn.Module, tuple[RecomputePlan, list]]" = weakref.WeakKeyDictionary()


def _wrap_call(module: nn.Module, wrapper: Callable, path: str, undo: list) -> None:
    """``wrapper(what re-runs the call, path)`` around ``module``'s call, by forward hooks
    (:func:`around_call`); its ``forward`` and parameter names stay as they are."""
    undo.extend(around_call(module, wrapper(_ModuleCall(module), path)))


def _wrap_step(step: CommStep, path: str, undo: list, wrapper: Callable) -> None:
    """``wrapper(the step's function, path)`` in a communication step's ``recompute`` slot (the step
    consults it at each call; nothing on its module changes)."""
    step.recompute = wrapper(step.fn, path)
    undo.append(step)


def layer_selection(plan: RecomputePlan, layer_id: int, paths: dict, matched_select: dict, matched_comm: dict
                    ) -> tuple[list[str], list[str]]:
    """``(checkpointed, output_recomputed)`` paths of a layer that is not recomputed whole: the outermost
    modules ``recompute.select_module`` selects, and the communication steps it selects plus the
    communication steps of ``recompute_comm`` not already inside a checkpointed region. ``paths``:
    :func:`addressable_paths` of the layer; ``matched_*`` record which patterns hit (``lit_moe plan``
    resolves the same selection for its memory model)."""
    order = list(paths)
    selected = _drop_children(_match(plan.select, layer_id, order, matched_select), order)
    checkpointed = [p for p in selected if paths[p][1] is None]
    # communication steps already inside a recomputed region are recomputed with it
    comm = [p for p in _drop_children(_match(plan.comm, layer_id, order, matched_comm), order)
            if p not in selected and not _under(p, checkpointed)]
    return checkpointed, [p for p in selected if paths[p][1] is not None] + comm


def apply_recompute(model: nn.Module, recompute: RecomputeConfig | dict | None = None,
                    recompute_comm: RecomputeCommConfig | dict | None = None, parallel_dims: Any = None,
                    plan: RecomputePlan | None = None) -> RecomputePlan:
    """Apply ``recompute`` and ``recompute_comm`` to ``model.blocks()`` in place, or the ``plan``
    already validated from them (a run's, :func:`validate_recompute`'s); returns the plan
    (FSDP asks it which layers re-gather their parameters: :func:`fsdp_reshard_after_forward`).

    Call it after tensor/expert/context parallel and before FSDP. Calling it again with the same
    sections is a no-op (Lightning's ``configure_model`` may run more than once); with different
    sections it is an error (call :func:`remove_recompute` first). ``parallel_dims`` is accepted for
    the strategy's convenience; recompute behaves the same on one device and on many.
    """
    blocks = list(model.blocks())
    if plan is None:
        plan = validate_recompute(recompute, recompute_comm, len(blocks))
    applied = _APPLIED.get(model)
    if applied is not None:
        if applied[0] == plan:
            return plan
        raise RuntimeError("apply_recompute: the model already has a different recompute applied; "
                           "call remove_recompute(model) first")
    undo: list = []
    rng = _draws_random_numbers(model)

    def make_checkpointed(call: Callable, path: str) -> _Checkpointed:
        return _Checkpointed(call, path, preserve_rng_state=rng)

    def make_output_recomputed(fn: Callable, path: str) -> _OutputRecomputed:
        return _OutputRecomputed(fn, path, preserve_rng_state=rng)

    matched_select: dict[str, bool] = {p: False for p, _ in plan.select}
    matched_comm: dict[str, bool] = {p: False for p, _ in plan.comm}
    summary: list[str] = []
    fsdp_layers: list[int] = []

    seen_paths: set[str] = set()
    for layer_id, block in enumerate(blocks):
        paths = addressable_paths(block)
        seen_paths.update(paths)
        order = list(paths)
        fsdp = [p for p, layers in plan.comm if layer_id in layers and re.fullmatch(p, FSDP_ALL_GATHER)]
        if fsdp:  # independent of activation recompute: parameters are re-gathered either way (plan.regathers)
            matched_comm.update(dict.fromkeys(fsdp, True))
            fsdp_layers.append(layer_id)
        if layer_id in plan.full_layers:
            _match(plan.select, layer_id, order, matched_select)  # counts as a hit; the layer covers it
            dropped = _match(plan.comm, layer_id, order, matched_comm)
            if dropped:
                log.info("recompute_comm: layer %d is recomputed whole, %s already recomputed", layer_id, dropped)
            _wrap_call(block, make_checkpointed, f"layers[{layer_id}]", undo)
            summary.append(f"{layer_id}: whole layer")
            continue

        checkpointed, output_recomputed = layer_selection(plan, layer_id, paths, matched_select, matched_comm)
        for p in checkpointed:
            _wrap_call(paths[p][0], make_checkpointed, p, undo)
        for p in output_recomputed:
            module, attr = paths[p]
            if attr is None:
                _wrap_call(module, make_output_recomputed, p, undo)
            else:
                _wrap_step(vars(module)[attr], p, undo, make_output_recomputed)
        if output_recomputed:
            _wrap_call(block, _LayerScope, f"layers[{layer_id}]", undo)
        if checkpointed or output_recomputed:
            parts = [f"recompute {checkpointed}"] if checkpointed else []
            parts += [f"recompute output of {output_recomputed}"] if output_recomputed else []
            summary.append(f"{layer_id}: " + ", ".join(parts))

    for pattern, hit in matched_select.items():
        if not hit:  # MindFormers only warns; a selection that recomputes nothing is an error here
            raise ConfigError(no_match_error("recompute.select_module", pattern, sorted(seen_paths),
                                             what="module or function in its layers", in_layer=True))
    for pattern, hit in matched_comm.items():
        if not hit:  # communication steps depend on the layout: one config serves several
            warnings.warn(f"recompute_comm.select_module[{pattern!r}] matches no communication step in its layers "
                          "on this layout; nothing is recomputed for it", RecomputeWarning, stacklevel=2)
    if fsdp_layers:
        summary.append(f"FSDP all-gather recomputed (resharded after forward) in layers {fsdp_layers}")
    if summary:
        log.info("recompute: %s", "; ".join(summary))
    _APPLIED[model] = (plan, undo)
    return plan


def remove_recompute(model: nn.Module) -> None:
    """Undo :func:`apply_recompute` (removes its hooks, empties every communication step's recompute slot)."""
    applied = _APPLIED.pop(model, None)
    if applied is None:
        return
    for entry in reversed(applied[1]):
        if isinstance(entry, RemovableHandle):
            entry.remove()
        else:
            entry.recompute = None


def fsdp_reshard_after_forward(plan: RecomputePlan | None, layer_id: int, default: bool) -> bool:
    """``reshard_after_forward`` for ``fully_shard`` of layer ``layer_id``: True when the recompute
    ``plan`` (None: no recompute) selects its FSDP all-gather (:data:`FSDP_ALL_GATHER`), else ``default``."""
    return True if plan is not None and plan.regathers(layer_id) else default
