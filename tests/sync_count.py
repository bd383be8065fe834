"""Count the calls that make the host wait for an accelerator (reusable by tests and benchmarks).

On a GPU a host read of a device value (``item``, ``float(t)``, ``if t:``, ``tolist``, numpy conversion,
a copy to the CPU, ops whose output size depends on values such as ``nonzero``) blocks until the
stream has caught up, which empties the launch queue. On a CPU nothing waits, so those calls are
counted instead: a torch-function mode sees the Python-level methods and a dispatch mode the aten ops
that read values on the host (``_local_scalar_dense`` under ``item``/``float``/``bool``, ``nonzero``,
``bincount``, ``masked_select``, ``unique``, boolean-mask indexing...). ``.cpu()`` and ``.to("cpu")``
are counted whatever the source device (on a CPU run every tensor is a "device" tensor); ``.to(x.device)``
(no copy) and a host tensor moved *to* a device are not.

    with SyncCounter() as syncs:
        ...one training step...
    assert syncs.count == 0, syncs.report()
"""

from __future__ import annotations

import os
import traceback

import torch
from lightning.pytorch import Callback
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_METHODS = frozenset({"item", "__float__", "__int__", "__bool__", "__index__", "tolist", "numpy", "cpu"})
SYNC_ATEN_OPS = frozenset({"aten._local_scalar_dense", "aten.nonzero", "aten.nonzero_static", "aten.bincount",
                           "aten.masked_select", "aten._unique2", "aten.unique_consecutive", "aten.unique_dim",
                           "aten.repeat_interleave"})


def _to_cpu(func, args, kwargs) -> bool:
    """``t.to("cpu")``, or ``t.to(device)`` with a CPU device other than ``t``'s own (``t.to(x.device)``
    with ``x`` beside ``t`` is no copy, so not a sync, wherever the run is)."""
    if getattr(func, "__name__", "") != "to" or not args or not isinstance(args[0], torch.Tensor):
        return False
    for t in list(args[1:]) + [kwargs.get("device")]:
        if isinstance(t, str) and t.startswith("cpu"):
            return True
        if isinstance(t, torch.device) and t.type == "cpu" and args[0].device != t:
            return True
    return False


def _caller() -> str:
    """The innermost frame outside torch and this file (where the sync was written)."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if "/torch/" not in frame.filename and os.path.basename(frame.filename) != "sync_count.py":
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "?"


class _Methods(TorchFunctionMode):
    def __init__(self, sink: list):
        super().__init__()
        self.sink = sink

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in SYNC_METHODS or _to_cpu(func, args, kwargs):
            self.sink.append((name, _caller()))
        return func(*args, **kwargs)


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


class _AtenOps(TorchDispatchMode):
    def __init__(self, sink: list):
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        # repeat_interleave reads its counts on the host only without output_size; indexing with a
        # boolean mask (x[mask], x[mask] = v) sizes its result from the mask's values
        if ((name in SYNC_ATEN_OPS and not (name == "aten.repeat_interleave" and (kwargs or {}).get("output_size")))
                or (name in ("aten.index", "aten.index_put", "aten.index_put_") and _bool_index(args))):
            self.sink.append((name, _caller()))
        return func(*args, **(kwargs or {}))


class SyncCounter:
    """Context manager recording every sync-causing call made inside it: ``.calls`` is a list of
    ``(call, where)``; a Python-level read and the aten op under it are both recorded."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self._modes = [_Methods(self.calls), _AtenOps(self.calls)]

    def __enter__(self) -> "SyncCounter":
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)

    @property
    def count(self) -> int:
        return len(self.calls)

    def report(self, limit: int = 20) -> str:
        lines = [f"{len(self.calls)} sync-causing call(s):"]
        lines += [f"  {call} at {where}" for call, where in self.calls[:limit]]
        return "\n".join(lines)


class StepWindow(Callback):
    """A Lightning callback (put it last) counting the syncs of one whole optimizer step of a fit:
    from the end of step ``after``'s ``on_train_batch_end`` to the end of step ``after + 1``'s, so the
    window holds every hook of one cycle (the loop's bookkeeping, data fetching, ``training_step``
    and every callback's step end) exactly once. ``StepWindow.counts`` maps the step to its
    :class:`SyncCounter` (a class attribute, so that a callback built from YAML can be read back)."""

    counts: dict[int, SyncCounter] = {}

    def __init__(self, after: int = 1) -> None:
        self.after = after
        self._open: SyncCounter | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self._open is not None and step == self.after + 1:
            self._open.__exit__(None, None, None)
            StepWindow.counts[step] = self._open
            self._open = None
        elif step == self.after:
            self._open = SyncCounter().__enter__()

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None
