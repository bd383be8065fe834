"""``torch.compile`` for the model's ``torch_compile`` switch, falling back to eager where it fails.

Only plain functions are compiled (``DecoderLayer._forward``, the head-and-loss function), never a
module's ``__call__``: FSDP2's hooks, activation-checkpoint wrappers and expert-parallel hooks stay
outside the compiled region, and parameter names do not change. Where a submodule the function calls
carries hooks itself (a MoE layer's experts are an FSDP unit of their own and expert-parallel
dispatch needs host split sizes; ``[norm, lm_head]`` is one FSDP unit) or otherwise breaks graphs
(the model's ``hooks.breaks_graphs``: :func:`own_graph_breaks`, plus the FSDP2 units that
``parallelize``'s compile step adds), a smaller function is compiled instead (the other half of the
decoder layer) or none (the head), so that no graph breaks. One compiled function serves every
layer (dynamo guards on the layer's structure, so dense and MoE layers get a graph each).

A failure to compile (no C++ compiler for inductor, a backend without inductor support, an
unsupported op) is reported once as a warning and that function runs eagerly from then on.
Errors that are not the compiler's are re-raised unchanged.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

import torch

log = logging.getLogger(__name__)

_COMPILED: dict[Callable, "_MaybeCompiled"] = {}


def _is_compiler_error(err: BaseException) -> bool:
    module = type(err).__module__ or ""
    return module.startswith(("torch._dynamo", "torch._inductor", "torch._subclasses", "torch.fx"))


def _describe(err: BaseException) -> str:
    """The error's type and first line, and the innermost cause's (dynamo wraps the real error)."""
    inner = err
    while (inner.__cause__ or inner.__context__) not in (None, inner):
        inner = inner.__cause__ or inner.__context__
    parts = []
    for e in (err, inner) if inner is not err else (err,):
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        parts.append(f"{type(e).__name__}: {lines[0][:200] if lines else ''}")
    return " <- ".join(parts)


# Whether the autograd engine was running when the current compiled call was entered (see in_backward).
_ENTERED_IN_BACKWARD = False


def _engine_running() -> bool:
    return torch._C._current_graph_task_id() != -1


def in_backward() -> bool:
    """True while the autograd engine runs (activation recompute re-runs forward inside backward).

    Dynamo cannot trace the engine's state (a graph break), so inside a compiled function this is
    the state captured when the function was entered, a module global: dynamo guards on it, so the
    forward and the recompute in backward each get a graph of their own, compiled once."""
    if torch.compiler.is_compiling():
        return _ENTERED_IN_BACKWARD
    return _engine_running()


def compile_enabled(torch_compile: Optional[bool], device: torch.device) -> bool:
    """The model's ``torch_compile`` switch for parameters on ``device``: None means CUDA only."""
    return device.type == "cuda" if torch_compile is None else bool(torch_compile)


def own_graph_breaks(module: torch.nn.Module) -> bool:
    """Whether a compiled function calling ``module`` would break its graph there by the module's own
    account: it or a submodule, or the owner of one of its forward pre-hooks, says so
    (``breaks_compiled_graphs``: expert-parallel dispatch reads split sizes on the host, context
    parallel's asynchronous all-to-alls wait on handles, dropping over capacity cuts rows at a
    host-read count, a recompute region opens in one hook and closes in another). Plain Python hooks
    are traced."""
    return any(getattr(m, "breaks_compiled_graphs", False)
               or any(getattr(getattr(h, "__self__", None), "breaks_compiled_graphs", False)
                      for h in m._forward_pre_hooks.values())
               for m in module.modules())


_WARNED = False


class _MaybeCompiled:
    def __init__(self, fn: Callable):
        self.fn = fn
        self.compiled = torch.compile(fn)
        self.failed = False
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.failed:
            global _ENTERED_IN_BACKWARD
            _ENTERED_IN_BACKWARD = _engine_running()
            try:
                return self.compiled(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - filtered just below
                if not _is_compiler_error(err):
                    raise
                global _WARNED
                self.failed = True
                # one warning (a missing compiler fails every function the same way), the rest at info
                (log.info if _WARNED else log.warning)("torch_compile: compiling %s failed (%s); it runs eagerly",
                                                       getattr(self.fn, "__qualname__", self.fn), _describe(err))
                _WARNED = True
        return self.fn(*args, **kwargs)


def compiled(fn: Callable) -> Callable:
    """``fn`` under ``torch.compile`` (one compiled object per function, shared by all callers)."""
    if fn not in _COMPILED:
        _COMPILED[fn] = _MaybeCompiled(fn)
    return _COMPILED[fn]
