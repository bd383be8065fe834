"""The accelerator paths of the callbacks (CUDA here; the code itself is device-agnostic): the
datasheet peak, device memory, and device kernels in the profiler trace. Skipped without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from lit_moe.callbacks import StepLogger, StepProfiler, ThroughputMFU, known_peak_flops, measure_matmul_peak
from lit_moe.callbacks.throughput import peak_flops_for

from test_callbacks import FakeLitMoE, read_tb, run, scalars, tb_logger

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_peak_is_the_datasheet_value_and_measured_gemm_is_below_it():
    device = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(device)
    peak, source = peak_flops_for(device)
    measured = measure_matmul_peak(device)
    print(f"\n{name}: peak {peak / 1e12:.0f} TFLOP/s ({source}); measured bf16 GEMM "
          f"{measured / 1e12:.0f} TFLOP/s")
    assert known_peak_flops(name) is not None, f"add {name!r} to KNOWN_PEAK_FLOPS"
    assert peak == known_peak_flops(name) and "datasheet" in source
    assert 0.2 * peak < measured < 1.05 * peak


def test_mfu_and_device_memory_on_the_accelerator(tmp_path):
    module = FakeLitMoE(steps=2, step_time=0.5)
    run(module, [ThroughputMFU(flops_per_token=6e6), StepLogger()], logger=tb_logger(tmp_path),
        accelerator="gpu")
    acc = read_tb(tmp_path / "tb")
    peak = known_peak_flops(torch.cuda.get_device_name(0))
    # 32 tokens per step in 0.5 s at 6e6 FLOPs per token, one device
    assert scalars(acc, "train/mfu")[1] == pytest.approx(6e6 * 32 / 0.5 / peak, rel=1e-5)
    mem = scalars(acc, "train/max_memory_allocated_gib")
    total = torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    assert 0 < mem[1] < total and "train/rss_gib" not in acc.Tags()["scalars"]


def test_profiler_records_device_kernels(tmp_path):
    module = FakeLitMoE(steps=3, marker=True)
    run(module, [StepProfiler(start_step=2, end_step=2, output_path=str(tmp_path), with_stack=False)],
        accelerator="gpu")
    trace = json.loads(next(tmp_path.glob("rank0*.pt.trace.json")).read_text())
    cats = {e.get("cat") for e in trace["traceEvents"]}
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert "kernel" in cats
    assert sorted(n for n in names if n.startswith("fake_micro_")) == ["fake_micro_2", "fake_micro_3"]
