"""Per-step console line and TensorBoard scalars (``monitor.tensorboard``), with the optimizer step as
the x-axis.

Scalars written every ``log_interval`` optimizer steps and at the run's last step (rank 0, when
TensorBoard is on; other steps read nothing from the device):
``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/consumed_samples``, ``train/skipped_steps``,
and ``train/aux_loss`` / ``train/mtp_loss`` / ``train/indexer_loss`` when the model has them; each (except consumed samples)
also as ``"<tag> vs samples"`` against consumed samples (MindFormers' "vs samples" variants).
Throughput scalars come from :class:`~lit_moe.callbacks.throughput.ThroughputMFU`, MoE scalars from
:class:`~lit_moe.callbacks.moe_metrics.MoEMetrics`. The resolved config is written once as text
(tag ``config``).
"""

from __future__ import annotations

import json
from typing import Any, Optional

import yaml
from lightning.pytorch import Callback

from lit_moe.config import to_dict
from lit_moe.callbacks._common import add_scalar, check_log_interval, emit, fmt, is_log_step, tb_writer
from lit_moe.callbacks.throughput import step_perf
from lit_moe.step import StepMetrics


def config_as_markdown(resolved_config: Any) -> str:
    """The config as a YAML block that TensorBoard's text plugin renders verbatim (markdown code
    block = 4-space indent)."""
    data = to_dict(resolved_config)
    try:
        text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    except yaml.YAMLError:  # objects YAML cannot represent: fall back to their str()
        text = json.dumps(data, indent=2, default=str)
    return "\n".join("    " + line for line in text.splitlines())


class StepLogger(Callback):
    """One console line per logged step and the ``train/*`` TensorBoard scalars.

    Args:
        log_interval: print and write every N optimizer steps.
        total_steps: shown as ``step N/total``.
        resolved_config: written once to TensorBoard as text.
    """

    def __init__(self, log_interval: int = 1, total_steps: Optional[int] = None,
                 resolved_config: Any = None) -> None:
        self.log_interval = check_log_interval(log_interval, "StepLogger.log_interval")
        self.total_steps = total_steps
        self.resolved_config = resolved_config
        self._config_written = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        writer = tb_writer(trainer)
        if writer is not None and self.resolved_config is not None and not self._config_written:
            writer.add_text("config", config_as_markdown(self.resolved_config), global_step=0)
            self._config_written = True

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        m: StepMetrics = pl_module.step_metrics
        # the run's last step is always logged (a run shorter than the interval still shows its result)
        if not (is_log_step(m.step, self.log_interval) or m.step == self.total_steps):
            return
        if trainer.is_global_zero:
            emit(self.format_line(m, step_perf(trainer, m)))
        writer = tb_writer(trainer)
        if writer is None:
            return
        step, samples = m.step, m.consumed_samples
        for key in ("loss", "lr", "grad_norm", "aux_loss", "mtp_loss", "indexer_loss"):
            value = getattr(m, key)
            if value is not None:
                add_scalar(writer, f"train/{key}", float(value), step, samples)
        add_scalar(writer, "train/skipped_steps", float(m.skipped_steps), step, samples)
        add_scalar(writer, "train/consumed_samples", float(samples), step)

    def format_line(self, m: StepMetrics, perf: Optional[dict] = None) -> str:
        """The console line of step ``m``; ``perf``: its throughput numbers (:func:`step_perf`)."""
        perf = perf or {}
        total = f"/{self.total_steps}" if self.total_steps else ""
        parts = [f"step {m.step}{total}", f"loss {fmt(m.loss)}"]
        for key in ("aux_loss", "mtp_loss", "indexer_loss"):
            if getattr(m, key) is not None:
                parts.append(f"{key} {fmt(getattr(m, key))}")
        parts += [f"lr {fmt(m.lr, '.6e')}", f"grad_norm {fmt(m.grad_norm, '.4f')}",
                  f"samples {m.consumed_samples}", f"step_time {1000 * m.step_time:.0f}ms"]
        if perf.get("tokens_per_sec") is not None:
            parts.append(f"tokens/s {perf['tokens_per_sec']:.1f}")
        if perf.get("tflops_per_device") is not None:
            parts.append(f"TFLOP/s/device {perf['tflops_per_device']:.3f}")
        if perf.get("mfu") is not None:
            parts.append(f"mfu {100 * perf['mfu']:.2f}%")
        if m.skipped:
            parts.append("SKIPPED")
        if m.skipped_steps:
            parts.append(f"skipped_steps {m.skipped_steps}")
        return " | ".join(parts)
