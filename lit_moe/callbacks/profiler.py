"""``profiler``: a torch.profiler trace of optimizer steps ``start_step..end_step`` (torch_npu's
profiler on Ascend).

Recording starts before ``start_step``'s first micro-batch and stops after ``end_step``'s
optimizer update; ``prof.step()`` marks each optimizer-step boundary (``ProfilerStep#k`` spans in the
trace). The trace is written as ``<output_path>/rank{r}.<time>.pt.trace.json`` (TensorBoard
profiler plugin / Perfetto / chrome://tracing); on Ascend torch_npu writes its own layout there.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch import Callback

from lit_moe.config import ConfigError
from lit_moe.callbacks._common import emit, steps_done
from lit_moe.runtime.distributed import global_rank

DEFAULT_OUTPUT_PATH = "output/profile"


def _profiler_backend(device_type: str):
    """The profiler module (``torch.profiler`` or ``torch_npu.profiler``) and the device activity."""
    if device_type == "npu":
        import torch_npu  # Ascend only

        return torch_npu.profiler, torch_npu.profiler.ProfilerActivity.NPU
    prof = torch.profiler
    device_activity = {"cuda": "CUDA", "xpu": "XPU"}.get(device_type)
    return prof, getattr(prof.ProfilerActivity, device_activity) if device_activity else None



def recorded_activities(profile_cpu: bool, cpu: Any, device: Any) -> list:
    """MindFormers' ``profile_cpu``: the device's activity, plus the CPU's when true. Without an
    accelerator (``device`` None) the CPU is the only activity and is recorded either way."""
    return ([cpu] if profile_cpu or device is None else []) + ([device] if device is not None else [])

class StepProfiler(Callback):
    """Profile optimizer steps ``start_step..end_step`` (1-based, inclusive).

    Args:
        start_step, end_step: the profiled optimizer steps.
        output_path: trace directory (default ``output/profile``).
        profiler_rank: global ranks that profile (None: all).
        profile_memory: record tensor allocations.
        with_stack: record Python stacks.
        profile_cpu: record CPU activity (the device activity is always recorded).
        record_shapes: record operator input shapes.
    """

    def __init__(self, start_step: int = 1, end_step: int = 1, output_path: Optional[str] = None,
                 profiler_rank: Optional[list[int]] = None, profile_memory: bool = False,
                 with_stack: bool = True, profile_cpu: bool = True, record_shapes: bool = True) -> None:
        for name, value in (("start_step", start_step), ("end_step", end_step)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"profiler.{name}: must be an int >= 1, got {value!r}")
        if end_step < start_step:
            raise ConfigError(f"profiler.end_step: {end_step} is before profiler.start_step {start_step}")
        if profiler_rank is not None and (not isinstance(profiler_rank, (list, tuple)) or any(
                isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in profiler_rank)):
            raise ConfigError(f"profiler.profiler_rank: expected a list of ranks >= 0, got {profiler_rank!r}")
        self.start_step, self.end_step = start_step, end_step
        self.output_path = output_path or DEFAULT_OUTPUT_PATH
        from lit_moe.checkpoint.auto_resume import check_writable

        check_writable(self.output_path, "profiler.output_path")  # now, not when the trace is written
        self.profiler_rank = None if profiler_rank is None else set(profiler_rank)
        self.profile_memory = profile_memory
        self.with_stack = with_stack
        self.profile_cpu = profile_cpu
        self.record_shapes = record_shapes
        self._prof: Any = None
        self._done = False

    def _start(self, step: int, pl_module: Any) -> None:
        prof, device_activity = _profiler_backend(pl_module.device.type)
        activities = recorded_activities(self.profile_cpu, prof.ProfilerActivity.CPU, device_activity)
        record = prof.ProfilerAction.RECORD
        self._prof = prof.profile(
            activities=activities, record_shapes=self.record_shapes,
            profile_memory=self.profile_memory, with_stack=self.with_stack,
            # A schedule that always records: we start and stop by hand, and a schedule makes the
            # profiler mark each step (ProfilerStep#k spans, k = our optimizer step).
            schedule=lambda _: record,
            on_trace_ready=prof.tensorboard_trace_handler(self.output_path,
                                                          worker_name=f"rank{global_rank()}"))
        self._prof.step_num = step
        self._prof.start()

    def _stop(self) -> None:
        if self._prof is not None:
            self._prof.stop()   # runs on_trace_ready: writes the trace
            self._prof = None
            self._done = True

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._prof is not None or self._done:
            return
        if self.profiler_rank is not None and global_rank() not in self.profiler_rank:
            return
        step = steps_done(trainer, pl_module) + 1
        if self.start_step <= step <= self.end_step:
            self._start(step, pl_module)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._prof is None:
            return
        if pl_module.step_metrics.step < self.end_step:
            self._prof.step()   # closes ProfilerStep#k, opens #k+1
        else:
            self._stop()
            if trainer.is_global_zero:
                emit(f"profiler: steps {self.start_step}-{self.end_step} written to {self.output_path}")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop()   # the run ended inside the window: keep what was recorded

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._stop()
