"""What keeps a long MoE run healthy and visible: skip protection, MoE metrics, throughput/MFU,
step logging (TensorBoard), the profiler and CPU affinity; plus user callbacks from YAML.

The CLI calls :func:`build_logger` and :func:`build_callbacks`, instantiates the YAML ``callbacks:``
with :func:`load_callbacks` and combines them with :func:`merge_callbacks`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch import Callback

from lit_moe.callbacks.affinity import CPUAffinity, parse_cpu_list, plan_affinity
from lit_moe.callbacks.loggers import LoggerBridge, build_logger, combine_loggers
from lit_moe.callbacks.moe_metrics import MoEMetrics, layer_stats
from lit_moe.callbacks.profiler import StepProfiler
from lit_moe.callbacks.progress import StepProgressBar
from lit_moe.callbacks.skip import GlobalNormSkipGuard, SkipLimitExceeded
from lit_moe.callbacks.step_logger import StepLogger, check_log_interval
from lit_moe.callbacks.throughput import (KNOWN_PEAK_FLOPS, ThroughputMFU, known_peak_flops,
                                          measure_matmul_peak, throughput_metrics)
from lit_moe.callbacks.train_state import TrainStateMonitor
from lit_moe.callbacks.user import load_callbacks
from lit_moe.step import GradientObserver, StepGuard, StepMetrics

__all__ = [
    "CPUAffinity", "GlobalNormSkipGuard", "GradientObserver", "StepMetrics", "KNOWN_PEAK_FLOPS", "LoggerBridge",
    "MoEMetrics", "SkipLimitExceeded",
    "StepGuard", "StepLogger", "StepProfiler", "StepProgressBar", "ThroughputMFU", "TrainStateMonitor",
    "build_callbacks", "build_logger", "combine_loggers", "known_peak_flops", "layer_stats", "load_callbacks",
    "measure_matmul_peak", "merge_callbacks", "parse_cpu_list", "plan_affinity", "throughput_metrics",
]


def _flops_per_token(model_config: Any, seq_length: int) -> Optional[float]:
    if model_config is None:
        return None
    from lit_moe.model import flops_per_token

    return float(flops_per_token(model_config, seq_length))


def build_callbacks(monitor: Any, profiler: Any, context: Any, model_config: Any, seq_length: int,
                    resolved_config: Any, peak_flops: Optional[float] = None) -> list[Callback]:
    """The built-in callbacks of a run: affinity, profiler, train-state lines (a gradient
    observer), skip protection, throughput (the owner of tokens/s and MFU, asked by the console
    line), MoE metrics, step logger, and the bridge that hands their scalars to every
    ``trainer.logger`` logger. None of them depends on another's position in the list."""
    log_interval = check_log_interval(monitor.tensorboard.log_interval)
    callbacks: list[Callback] = []

    affinity = CPUAffinity(context.affinity_config)
    if affinity.plan is not None:
        callbacks.append(affinity)

    if profiler.enable_profiling:
        callbacks.append(StepProfiler(
            start_step=profiler.start_step, end_step=profiler.end_step,
            output_path=profiler.output_path, profiler_rank=profiler.profiler_rank,
            profile_memory=profiler.profile_memory, with_stack=profiler.with_stack,
            profile_cpu=profiler.profile_cpu))

    ts = monitor.train_state
    train_state = TrainStateMonitor(device_loss=ts.device_loss, local_loss=ts.local_loss,
                                    local_norm=ts.local_norm, device_norm=ts.device_norm)
    if train_state.enabled:
        callbacks.append(train_state)

    hc = monitor.health_checkpoint
    callbacks.append(GlobalNormSkipGuard(
        global_norm_skip_threshold=hc.global_norm_skip_threshold,
        global_norm_skip_time=hc.global_norm_skip_time,
        embedding_local_norm_threshold=hc.embedding_local_norm_threshold, report_interval=log_interval))

    callbacks.append(ThroughputMFU(flops_per_token=_flops_per_token(model_config, seq_length),
                                   peak_flops=peak_flops, log_interval=log_interval,
                                   compute_dtype=(model_config.torch_dtype("compute_dtype") if model_config is not None
                                                  else torch.bfloat16)))

    mm = monitor.moe_monitor
    output_dir = monitor.tensorboard.output_dir
    callbacks.append(MoEMetrics(
        log_interval=log_interval, save_tokens_per_expert_interval=mm.save_tokens_per_expert_interval,
        target_layers=mm.target_layers,
        heatmap_in_log_dir=bool(output_dir)))

    total_steps = None
    if isinstance(resolved_config, dict):
        total_steps = (resolved_config.get("training") or {}).get("steps")
    else:
        total_steps = getattr(getattr(resolved_config, "training", None), "steps", None)
    callbacks.append(StepLogger(log_interval=log_interval, total_steps=total_steps,
                                resolved_config=resolved_config))
    callbacks.append(LoggerBridge(hparams=resolved_config if isinstance(resolved_config, dict) else None))
    return callbacks


def merge_callbacks(builtin: list[Callback], user: list[Callback]) -> list[Callback]:
    """Built-ins followed by the user's callbacks; a user callback that is an instance of a
    built-in's class replaces that built-in in place (e.g. a ``ThroughputMFU`` with ``peak_flops``;
    its ``flops_per_token``, when not given, is taken from the built-in)."""
    merged = list(builtin)
    extra = []
    for cb in user:
        for i, b in enumerate(merged):
            if isinstance(cb, type(b)) and b in builtin:
                if isinstance(cb, ThroughputMFU) and cb.flops_per_token is None:
                    cb.flops_per_token = b.flops_per_token
                merged[i] = cb
                break
        else:
            extra.append(cb)
    return merged + extra
