"""Per-step console line and TensorBoard scalars (``monitor.tensorboard``), with the optimizer step as
the x-axis.

Scalars written every ``log_interval`` optimizer steps (rank 0, when TensorBoard is on):
``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/consumed_samples``, ``train/skipped_steps``,
and ``train/aux_loss`` / ``train/mtp_loss`` when the model has them; each (except consumed samples)
also as ``"<tag> vs samples"`` against consumed samples (the seed's "vs samples" variants).
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
from lit_moe.callbacks._common import (StepWatcher, add_scalar, check_log_interval, emit, fmt, is_log_step,
                                      tb_writer)


def config_as_markdown(resolved_config: Any) -> str:
    """The config as a YAML block that TensorBoard's text plugin renders verbatim (markdown code
    block = 4-space indent)."""
    data = to_dict(resolved_config)
    try:
        text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    except yaml.YAMLError:  # objects YAML cannot represent: fall back to their str()
        text = json.dumps(data, indent=2, default=str)
    return "\n".join("    " + line for line in text.splitlines())


class StepLogger(Callback, StepWatcher):
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
        m = self.new_step_metrics(pl_module)
        if m is None or not is_log_step(int(m["step"]), self.log_interval):
            return
        if trainer.is_global_zero:
            emit(self.format_line(m))
        writer = tb_writer(trainer)
        if writer is None:
            return
        step, samples = int(m["step"]), m.get("consumed_samples")
        for key in ("loss", "lr", "grad_norm", "aux_loss", "mtp_loss"):
            if m.get(key) is not None:
                add_scalar(writer, f"train/{key}", float(m[key]), step, samples)
        add_scalar(writer, "train/skipped_steps", float(m.get("skipped_steps") or 0), step, samples)
        if samples is not None:
            add_scalar(writer, "train/consumed_samples", float(samples), step)

    def format_line(self, m: dict) -> str:
        step = int(m["step"])
        total = f"/{self.total_steps}" if self.total_steps else ""
        parts = [f"step {step}{total}", f"loss {fmt(m.get('loss'))}"]
        for key in ("aux_loss", "mtp_loss"):
            if m.get(key) is not None:
                parts.append(f"{key} {fmt(m[key])}")
        parts += [f"lr {fmt(m.get('lr'), '.6e')}", f"grad_norm {fmt(m.get('grad_norm'), '.4f')}"]
        if m.get("consumed_samples") is not None:
            parts.append(f"samples {int(m['consumed_samples'])}")
        perf = m.get("perf") or {}
        if m.get("step_time") is not None:
            parts.append(f"step_time {1000 * float(m['step_time']):.0f}ms")
        if perf.get("tokens_per_sec") is not None:
            parts.append(f"tokens/s {perf['tokens_per_sec']:.1f}")
        if perf.get("tflops_per_device") is not None:
            parts.append(f"TFLOP/s/device {perf['tflops_per_device']:.3f}")
        if perf.get("mfu") is not None:
            parts.append(f"mfu {100 * perf['mfu']:.2f}%")
        if m.get("skipped"):
            parts.append("SKIPPED")
        if m.get("skipped_steps"):
            parts.append(f"skipped_steps {int(m['skipped_steps'])}")
        return " | ".join(parts)
