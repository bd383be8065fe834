"""``torch.compile`` for the model's ``torch_compile`` switch, falling back to eager where it fails.

Only plain functions are compiled (``DecoderLayer._forward``, the head-and-loss function), never a
module's ``__call__``: FSDP2's hooks, activation-checkpoint wrappers and expert-parallel hooks stay
outside the compiled region, and parameter names do not change. One compiled function serves every
layer (dynamo guards on the layer's structure, so dense and MoE layers get a graph each).

A failure to compile (no C++ compiler for inductor, a backend without inductor support, an
unsupported op) is reported once as a warning and that function runs eagerly from then on.
Errors that are not the compiler's are re-raised unchanged.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

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


class _MaybeCompiled:
    def __init__(self, fn: Callable):
        self.fn = fn
        self.compiled = torch.compile(fn)
        self.failed = False
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.failed:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - filtered just below
                if not _is_compiler_error(err):
                    raise
                self.failed = True
                log.warning("torch_compile: compiling %s failed (%s); it runs eagerly",
                            getattr(self.fn, "__qualname__", self.fn), _describe(err))
        return self.fn(*args, **kwargs)


def compiled(fn: Callable) -> Callable:
    """``fn`` under ``torch.compile`` (one compiled object per function, shared by all callers)."""
    if fn not in _COMPILED:
        _COMPILED[fn] = _MaybeCompiled(fn)
    return _COMPILED[fn]
