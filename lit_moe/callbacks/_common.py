"""Small helpers shared by the callbacks: steps done, printing, DTensor-aware norms and TensorBoard
writing.

The LightningModule (``lit_moe/module.py``) runs one optimizer step per ``training_step`` and then
sets ``pl_module.step_metrics`` (a frozen :class:`lit_moe.step.StepMetrics`); callbacks read it in
``on_train_batch_end``, which fires once per optimizer step.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Optional

import torch

from lit_moe.config import ConfigError


# ----------------------------------------------------------------------------------------------
# step metrics
# ----------------------------------------------------------------------------------------------
def steps_done(trainer: Any, pl_module: Any) -> int:
    """Optimizer steps completed so far, skipped steps included: the module's last
    ``step_metrics.step``, or before the first step of this run ``trainer.global_step`` (which
    Lightning restores on resume)."""
    metrics = getattr(pl_module, "step_metrics", None)
    if metrics is not None:
        return int(metrics.step)
    return int(getattr(trainer, "global_step", 0) or 0)


def is_log_step(step: int, interval: int) -> bool:
    return interval > 0 and step % interval == 0


# ----------------------------------------------------------------------------------------------
# ranks and printing
# ----------------------------------------------------------------------------------------------
def emit(line: str, *, error: bool = False) -> None:
    """Print one line (stdout, or stderr for warnings) and flush, so that lines of concurrent
    ranks are not interleaved mid-line. Through ``tqdm.write``: on a terminal the line appears above
    the progress bar instead of through it."""
    from tqdm import tqdm

    stream = sys.stderr if error else sys.stdout
    tqdm.write(line, file=stream)
    stream.flush()


def fmt(value: Optional[float], spec: str = ".6f") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


# ----------------------------------------------------------------------------------------------
# norms
# ----------------------------------------------------------------------------------------------
def tensor_norm(t: torch.Tensor) -> float:
    """L2 norm of a (possibly DTensor) tensor, in fp32, over the whole logical tensor.

    For a sharded DTensor, ``vector_norm`` gives a partial result on each rank and
    ``full_tensor()`` reduces it over the mesh (a collective: every rank of that mesh must call)."""
    t = t.detach()
    norm = torch.linalg.vector_norm(t.float())
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def to_float(value: Any) -> Optional[float]:
    """A float from a Python number, a 0-d (D)Tensor or None."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        return float(value.detach().float().cpu())
    return float(value)


# ----------------------------------------------------------------------------------------------
# TensorBoard
# ----------------------------------------------------------------------------------------------
def tb_writer(trainer: Any) -> Any:
    """What callbacks write to, on global rank 0 only (None elsewhere or with no logger at all):
    TensorBoard's SummaryWriter, behind :func:`lit_moe.callbacks.loggers.metrics_writer` so that
    scalars also reach the ``trainer.logger`` loggers."""
    from lit_moe.callbacks.loggers import metrics_writer

    return metrics_writer(trainer)


def add_scalar(writer: Any, tag: str, value: Optional[float], step: int,
               samples: Optional[int] = None) -> None:
    """Write ``tag`` against the optimizer step and, when ``samples`` is given, the same value as
    ``"<tag> vs samples"`` against consumed samples (the MindFormers convention)."""
    if writer is None or value is None:
        return
    writer.add_scalar(tag, value, global_step=step)
    if samples is not None:
        writer.add_scalar(f"{tag} vs samples", value, global_step=int(samples))


def add_png(writer: Any, tag: str, png: bytes, height: int, width: int, step: int) -> None:
    """Write an already PNG-encoded RGB image (no PIL needed)."""
    if writer is None:
        return
    if type(writer).__module__.startswith("tensorboardX"):
        from tensorboardX.proto.summary_pb2 import Summary
    else:
        from tensorboard.compat.proto.summary_pb2 import Summary
    file_writer = writer._get_file_writer()
    if file_writer is None:   # scalars-only loggers: images stay in TensorBoard
        return
    image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=png)
    summary = Summary(value=[Summary.Value(tag=tag, image=image)])
    file_writer.add_summary(summary, step)


def check_log_interval(value: Any, field: str = "monitor.tensorboard.log_interval") -> int:
    """A logging interval: an int >= 1 (``field`` names it in the error)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{field}: must be an int >= 1, got {value!r}")
    return value
