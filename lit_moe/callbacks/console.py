"""A quiet console: one summary line when training starts instead of Lightning's model table, no
third-party tips or accelerator banners, and per-step lines only every log interval.

On a terminal the progress bar (:class:`~lit_moe.callbacks.progress.StepProgressBar`) carries the
live numbers of every step and the log lines are written above it (``tqdm.write``); without a
terminal (a log file, a pipe, a batch job) there is no bar, only one plain line per log interval.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings
from typing import Any, Optional

from lightning.pytorch import Callback

# Lightning's info lines that a lit_moe run does not need on its console: advertising tips, the
# accelerator availability banner (the summary line names the layout), and the one-process
# "distributed" banner. Warnings and errors are never filtered.
_QUIET_PATTERNS = re.compile(
    r"^(💡 Tip:|GPU available:|TPU available:|HPU available:|IPU available:|"
    r"Initializing distributed:|distributed_backend=|All distributed processes registered|-{20,}|"
    r"You are using a CUDA device .* that has Tensor Cores|LOCAL_RANK: \d+ - CUDA_VISIBLE_DEVICES)",
    re.S)

_LIGHTNING_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                      "lightning.pytorch.accelerators.cuda", "lightning.fabric.utilities.distributed",
                      "lightning.pytorch.utilities.distributed", "lightning.pytorch")


class _QuietFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        return not _QUIET_PATTERNS.match(str(record.getMessage()).strip())


_FILTER = _QuietFilter()


def quiet_lightning() -> None:
    """Install the filter on Lightning's loggers (idempotent) and silence a deprecation warning that
    Lightning's own code triggers with this torch version."""
    for name in _LIGHTNING_LOGGERS:
        lg = logging.getLogger(name)
        if _FILTER not in lg.filters:
            lg.addFilter(_FILTER)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")


def console_is_terminal(stream: Any = None) -> bool:
    stream = sys.stdout if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def human(n: float) -> str:
    """12345678 → '12.3M' (k, M, B, T)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}"


def layout_text(dims: Any) -> str:
    """``dp 2 (shard 2) · tp 1 · cp 1 · ep 2 · pp 1`` from a ParallelDims (``1 process`` without)."""
    if dims is None:
        return "1 process"
    dp = f"dp {dims.dp}"
    if dims.dp_replicate > 1:
        dp += f" (replicate {dims.dp_replicate} × shard {dims.dp_shard})"
    return f"{dims.world_size} process{'es' if dims.world_size > 1 else ''}: {dp} · tp {dims.tp} · " \
           f"cp {dims.cp} · ep {dims.ep} · pp {dims.pp}"


def summary_line(model_config: Any, shape: Any, *, trainable: Optional[int] = None, consumed_samples: int = 0) -> str:
    """The line printed when training starts. ``shape``: the run's
    :class:`~lit_moe.strategies.run_shape.RunShape`; a step's tokens are those of the samples it
    consumes (a remainder of ``global_batch_size`` that is no multiple of data parallel × local batch
    is dropped); with a ramp-up, the batch of the first step is read at ``consumed_samples``."""
    from lit_moe.model.sizing import param_counts

    counts = param_counts(model_config)
    parts = [f"model {human(counts.total_with_mtp)} parameters ({human(counts.active + counts.mtp_active)} "
             f"active per token)"]
    if trainable is not None and trainable != counts.total_with_mtp:
        parts.append(f"{human(trainable)} trainable")
    samples, seq_length = shape.samples_per_step, shape.seq_length
    parts.append(f"{samples * seq_length:,} tokens per step ({samples} × {seq_length})")
    parts.append(layout_text(shape.dims))
    parts.append(f"accumulation {shape.accumulation} × micro-batch {shape.local_batch_size}")
    if shape.ramp is not None:
        parts.append(f"{shape.ramp.describe()}; this step {shape.samples_of_step_at(consumed_samples)} "
                     f"(after {consumed_samples:,} samples)")
    return "lit_moe: " + " | ".join(parts)


class RunSummary(Callback):
    """Prints :func:`summary_line` once, on global rank 0, when training starts.

    Args:
        model_config: the model section.
        shape: the run's :class:`~lit_moe.strategies.run_shape.RunShape` (layout and batch of a step).
    """

    def __init__(self, model_config: Any, shape: Any) -> None:
        self.model_config = model_config
        self.shape = shape

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.is_global_zero:
            return
        from lit_moe.callbacks._common import emit

        model = getattr(pl_module, "model", None)
        trainable = None
        if model is not None:
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        emit(summary_line(self.model_config, self.shape, trainable=trainable,
                          consumed_samples=pl_module.consumed_samples if self.shape.ramp is not None else 0))
