"""``monitor.train_state``: extra per-step loss and gradient-norm lines (MindFormers ``MonitorCallback``).

Formats (one JSON object per line, as MindFormers logs them):

- ``device_loss``: ``{"step": N, "device_loss": x}`` — the reduced loss of the global batch.
- ``local_loss``: ``{"step": N, "micro_step": k, "local_loss": x}`` per micro-batch (k from 0), the
  1/A-scaled micro-batch loss of this rank (their sum is this rank's step loss).
- ``local_norm``: a ``{"step": N, "micro_step": k}`` header, then ``{"local_norm": "<param>: <norm>"}``
  per matching parameter: the norm of the gradient contributed by that micro-batch's backward.
- ``device_norm``: a ``{"step": N}`` header, then ``{"device_norm": "<param>: <norm>"}`` per matching
  parameter: the accumulated, pre-clip gradient of the step (also on skipped steps).

``local_norm``/``device_norm`` take True (all parameters), a substring or a list of substrings of
parameter names in any spelling (MindFormers' ``embedding``/``output_layer`` as well as lit_moe's
``embed_tokens``/``lm_head``: ``lit_moe.model.names.spellings``); ``""``/False/``[]`` is off. A
substring found in no parameter name is an error (:func:`check_norm_filters`). ``local_loss``/``local_norm`` are per rank (prefixed
with ``"rank"`` when there are several ranks); ``device_*`` lines are printed by rank 0 only.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

import torch

from lit_moe.callbacks._common import emit, tensor_norm
from lit_moe.runtime.distributed import global_rank, world_size
from lit_moe.config import ConfigError
from lit_moe.model.names import canonical_name, no_match_error, spellings
from lit_moe.step import GradientObserver, StepMetrics

NormFilter = Union[bool, str, list]


def parse_norm_filter(value: NormFilter, field: str) -> Optional[list[str]]:
    """None when off; otherwise the substrings to match (True → ``[""]``, which matches every name)."""
    if value is None or value is False or value == "" or value == []:
        return None
    if value is True:
        return [""]
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        for item in value:
            if not isinstance(item, str) or not item:
                raise ConfigError(f"{field}: list items must be non-empty parameter-name substrings, "
                                  f"got {item!r}")
        return list(value)
    raise ConfigError(f"{field}: expected a bool, a string or a list of strings, got {value!r}")


def _filter_matches(substring: str, name: str) -> bool:
    return any(substring in n for n in spellings(canonical_name(name)))


def check_norm_filters(section: Any, names: list[str]) -> None:
    """Every ``local_norm`` / ``device_norm`` substring is found in some parameter name (any
    spelling); one-line :class:`ConfigError` naming the key, the filter and the nearest names otherwise."""
    for key in ("local_norm", "device_norm"):
        value = section.get(key) if isinstance(section, dict) else getattr(section, key, None)
        field = f"monitor.train_state.{key}"
        for substring in parse_norm_filter(value, field) or []:
            if substring and not any(_filter_matches(substring, n) for n in names):
                raise ConfigError(no_match_error(field, substring, names))


def _named_parameters(pl_module: Any):
    """Parameter names as the user knows them (relative to the model, not ``model.``-prefixed)."""
    model = getattr(pl_module, "model", None)
    source = model if isinstance(model, torch.nn.Module) else pl_module
    return source.named_parameters()


class TrainStateMonitor(GradientObserver):
    """Print the ``monitor.train_state`` lines. A :class:`~lit_moe.step.GradientObserver`: it sees the
    accumulated pre-clip gradients of every step (``device_norm``), skipped ones included."""

    def __init__(self, device_loss: bool = False, local_loss: bool = False,
                 local_norm: NormFilter = "", device_norm: NormFilter = False) -> None:
        self.device_loss = bool(device_loss)
        self.local_loss = bool(local_loss)
        self.local_norm = parse_norm_filter(local_norm, "monitor.train_state.local_norm")
        self.device_norm = parse_norm_filter(device_norm, "monitor.train_state.device_norm")
        self._prev_grads: dict[str, torch.Tensor] = {}   # accumulated grads after the previous micro
        self._local_norms: list[list[tuple[str, float]]] = []
        self._device_norms: list[tuple[str, float]] = []

    @property
    def enabled(self) -> bool:
        return bool(self.device_loss or self.local_loss or self.local_norm or self.device_norm)

    @staticmethod
    def _match(name: str, filters: list[str]) -> bool:
        return any(_filter_matches(f, name) for f in filters)

    # local_norm: the micro-batch's contribution = accumulated grad now − accumulated grad before.
    # (Keeps a copy of the matching gradients between micro-batches; filter to limit memory.)
    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if not self.local_norm:
            return
        norms = []
        for name, p in _named_parameters(pl_module):
            if p.grad is None or not self._match(name, self.local_norm):
                continue
            grad = p.grad.detach()
            prev = self._prev_grads.get(name)
            norms.append((name, tensor_norm(grad if prev is None else grad - prev)))
            self._prev_grads[name] = grad.clone()
        self._local_norms.append(norms)

    def on_gradients_before_clip(self, trainer: Any, pl_module: Any, grad_norm: torch.Tensor) -> None:
        if self.device_norm:
            self._device_norms = [(name, tensor_norm(p.grad)) for name, p in _named_parameters(pl_module)
                                  if p.grad is not None and self._match(name, self.device_norm)]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        metrics: StepMetrics = pl_module.step_metrics
        step = metrics.step
        prefix = {"rank": global_rank()} if world_size() > 1 else {}
        if self.local_loss:
            for k, value in enumerate(metrics.micro_losses):
                emit(json.dumps({**prefix, "step": step, "micro_step": k, "local_loss": float(value)}))
        if self.local_norm:
            for k, norms in enumerate(self._local_norms):
                emit(json.dumps({**prefix, "step": step, "micro_step": k}))
                for name, value in norms:
                    emit(json.dumps({"local_norm": f"{name}: {value}"}))
        if trainer.is_global_zero:
            if self.device_loss:
                emit(json.dumps({"step": step, "device_loss": metrics.loss}))
            if self.device_norm:
                emit(json.dumps({"step": step}))
                for name, value in self._device_norms:
                    emit(json.dumps({"device_norm": f"{name}: {value}"}))
        self._prev_grads.clear()
        self._local_norms = []
        self._device_norms = []
