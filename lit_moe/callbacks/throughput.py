"""Throughput, achieved TFLOP/s and MFU, step time and memory.

:class:`ThroughputMFU` is the one owner of these numbers: the console line and the progress bar
ask it (:func:`step_perf`) instead of computing their own.

Counting under tensor/context parallelism: ``step_metrics.tokens`` is the number of tokens of the
global batch (every token once, however many ranks worked on it), and the step's model FLOPs are
``flops_per_token × tokens``. Both are shared by all ``world_size`` devices, so per device they are
divided by the world size — not multiplied by ``tp × cp`` as Lightning's ThroughputMonitor does
(it scales per-rank counts by the world size, which counts a TP/CP-split sample several times).

MFU = achieved FLOP/s per device / the device's peak dense bf16 FLOP/s. Known peaks are vendor
datasheet values (the "with sparsity" figures halved); an unknown accelerator or a CPU gets a
measured GEMM rate in the run's compute dtype instead (timed matmuls within one second, once per
process: :func:`lit_moe.runtime.device_speed.measure_matmul_peak`), and ``peak_flops`` overrides either.
"""

from __future__ import annotations

import os
import resource
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback

from lit_moe.config import ConfigError
from lit_moe.runtime.device_speed import measure_matmul_peak
from lit_moe.callbacks._common import add_scalar, check_log_interval, emit, is_log_step, tb_writer
from lit_moe.runtime.distributed import is_distributed
from lit_moe.step import StepMetrics

# Peak dense bf16 tensor FLOP/s per device, matched as a substring of the device name lower-cased
# with spaces and dashes removed. First match wins, so specific names come first.
KNOWN_PEAK_FLOPS: list[tuple[str, float]] = [
    ("h200nvl", 835e12),   # NVIDIA H200 NVL datasheet: BF16 1,671 TFLOPS with sparsity
    ("h200", 989e12),      # NVIDIA H200 (SXM) datasheet: BF16 1,979 TFLOPS with sparsity
    ("h100nvl", 835e12),   # NVIDIA H100 NVL datasheet: BF16 1,671 TFLOPS with sparsity
    ("h100pcie", 756e12),  # NVIDIA H100 PCIe datasheet: BF16 1,513 TFLOPS with sparsity
    ("h100", 989e12),      # NVIDIA H100 SXM datasheet: BF16 1,979 TFLOPS with sparsity
    ("h800", 989e12),      # H800 SXM: H100 SXM compute, reduced interconnect
    ("a100", 312e12),      # NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS (dense)
    ("a800", 312e12),      # A800: A100 compute, reduced interconnect
    # Huawei publishes no per-variant datasheet figure; public numbers for the 910B family range
    # from ~280 (910B4) to ~376 (910B2) TFLOPS fp16/bf16. 313 TFLOPS is the figure usually quoted
    # for the 910B3 and used as the family default; set ``peak_flops`` for your exact part.
    ("ascend910b", 313e12),
]

def _normalise(name: str) -> str:
    return name.lower().replace(" ", "").replace("-", "").replace("_", "")


def known_peak_flops(device_name: str) -> Optional[float]:
    """Datasheet peak for a device name such as ``"NVIDIA H100 80GB HBM3"`` or ``"Ascend910B3"``."""
    name = _normalise(device_name)
    for key, peak in KNOWN_PEAK_FLOPS:
        if key in name:
            return peak
    return None


def device_name(device: torch.device) -> Optional[str]:
    """The accelerator's marketing name (``torch.cuda``/``torch.npu``/``torch.xpu`` style), or None."""
    module = getattr(torch, device.type, None)
    get_name = getattr(module, "get_device_name", None)
    if device.type == "cpu" or get_name is None:
        return None
    try:
        return get_name(device)
    except Exception:  # a backend without names for this device: fall back to measuring
        return None


def peak_flops_for(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> tuple[float, str]:
    """(peak FLOP/s, where it came from) for one device: datasheet when known, else the measured
    matmul rate in ``dtype`` (the run's compute dtype), within ``device_speed.PEAK_BUDGET_S``."""
    name = device_name(device)
    if name is not None:
        peak = known_peak_flops(name)
        if peak is not None:
            return peak, f"datasheet value for {name}"
    peak = measure_matmul_peak(device, dtype)
    what = name or device.type
    return peak, f"measured {str(dtype).replace('torch.', '')} matmul rate on {what}"


def throughput_metrics(tokens: float, step_time: float, world_size: int,
                       flops_per_token: Optional[float] = None,
                       peak_flops: Optional[float] = None) -> dict[str, float]:
    """The numbers of one step. ``tokens`` is the global batch's token count and ``flops_per_token``
    the training (forward + backward) FLOPs per token."""
    out = {"tokens_per_sec": tokens / step_time,
           "tokens_per_sec_per_device": tokens / step_time / world_size}
    if flops_per_token:
        achieved = flops_per_token * tokens / step_time / world_size
        out["tflops_per_device"] = achieved / 1e12
        if peak_flops:
            out["mfu"] = achieved / peak_flops
    return out


def process_rss_bytes() -> int:
    """Resident set size of this process now (Linux ``/proc``), else the peak from getrusage."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def memory_gib(device: torch.device) -> tuple[str, float]:
    """(tag suffix, GiB): the accelerator's max allocated memory since the last call (the peak is
    reset after reading), or the process RSS on CPU."""
    if device.type == "cpu":
        return "rss_gib", process_rss_bytes() / 2 ** 30
    module = getattr(torch, device.type)
    value = module.max_memory_allocated(device)
    module.reset_peak_memory_stats(device)
    return "max_memory_allocated_gib", value / 2 ** 30


class ThroughputMFU(Callback):
    """Tokens/s (global and per device), achieved TFLOP/s per device, MFU, step time and memory.

    Writes ``train/tokens_per_sec``, ``train/tokens_per_sec_per_device``, ``train/step_time``,
    ``train/tflops_per_device``, ``train/mfu`` and ``train/max_memory_allocated_gib`` (accelerator) or
    ``train/rss_gib`` (CPU), with "vs samples" variants. :meth:`perf` gives a step's numbers to
    whoever shows them (computed once per step, whichever callback asks first). Memory is the
    maximum over ranks.

    Args:
        flops_per_token: training FLOPs per token (``lit_moe.model.flops_per_token``); None: no
            TFLOP/s or MFU.
        peak_flops: peak FLOP/s of one device, overriding the datasheet/measured value.
        log_interval: write every N optimizer steps.
        compute_dtype: the run's compute dtype, in which a CPU's peak is measured.
    """

    def __init__(self, flops_per_token: Optional[float] = None, peak_flops: Optional[float] = None,
                 log_interval: int = 1, compute_dtype: torch.dtype = torch.bfloat16) -> None:
        if peak_flops is not None and not (isinstance(peak_flops, (int, float)) and peak_flops > 0):
            raise ConfigError(f"peak_flops: must be a positive number of FLOP/s, got {peak_flops!r}")
        self.flops_per_token = flops_per_token
        self.peak_flops = float(peak_flops) if peak_flops is not None else None
        self.peak_source = "given" if peak_flops is not None else None
        self.log_interval = check_log_interval(log_interval, "ThroughputMFU.log_interval")
        self.compute_dtype = compute_dtype
        self._perf: Optional[tuple[int, dict[str, float]]] = None   # (step, its numbers)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.flops_per_token and self.peak_flops is None:
            self.peak_flops, self.peak_source = peak_flops_for(pl_module.device, self.compute_dtype)
            if trainer.is_global_zero:
                rate = (f"{self.peak_flops / 1e12:.1f} TFLOP/s" if self.peak_flops >= 1e12
                        else f"{self.peak_flops / 1e9:.1f} GFLOP/s")   # a CPU without native bf16: ~20-100
                emit(f"MFU peak: {rate} per device ({self.peak_source})")

    def perf(self, trainer: Any, m: StepMetrics) -> dict[str, float]:
        """``step_time``, ``tokens_per_sec``, ``tokens_per_sec_per_device`` and, with FLOPs per token,
        ``tflops_per_device`` and (with a peak) ``mfu`` of step ``m``."""
        if self._perf is None or self._perf[0] != m.step:
            perf: dict[str, float] = {"step_time": float(m.step_time)}
            if m.tokens and m.step_time > 0:
                perf.update(throughput_metrics(float(m.tokens), float(m.step_time), trainer.world_size,
                                               self.flops_per_token, self.peak_flops))
            self._perf = (m.step, perf)
        return self._perf[1]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        m: StepMetrics = pl_module.step_metrics
        if not is_log_step(m.step, self.log_interval):
            return
        perf = dict(self.perf(trainer, m))
        mem_tag, mem = memory_gib(pl_module.device)
        if is_distributed():
            t = torch.tensor([mem], dtype=torch.float32, device=pl_module.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            mem = float(t.item())
        perf[mem_tag] = mem
        writer = tb_writer(trainer)
        for key, value in perf.items():
            add_scalar(writer, f"train/{key}", value, m.step, m.consumed_samples)


def step_perf(trainer: Any, m: StepMetrics) -> dict[str, float]:
    """Step ``m``'s throughput numbers from the run's :class:`ThroughputMFU` (empty without one)."""
    for cb in trainer.callbacks:
        if isinstance(cb, ThroughputMFU):
            return cb.perf(trainer, m)
    return {}
