"""Profiler, CPU affinity, user callbacks from YAML and ``build_callbacks`` wiring."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from lit_moe.callbacks import (CPUAffinity, GlobalNormSkipGuard, LoggerBridge, MoEMetrics, StepLogger, StepProfiler,
                               ThroughputMFU, TrainStateMonitor, build_callbacks, load_callbacks,
                               merge_callbacks, parse_cpu_list, plan_affinity)
from lit_moe.config import (AffinityConfig, ConfigError, ContextConfig, MonitorConfig, ProfilerConfig)

from test_callbacks import FakeLitMoE, run
from helpers import scaled  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------
# profiler
# ----------------------------------------------------------------------------------------------
def test_profiler_traces_exactly_the_requested_steps(tmp_path):
    # A = 2 micro-batches per step, each wrapped in record_function("fake_micro_<i>"): steps 2..3
    # are micro-batches 2, 3, 4, 5.
    module = FakeLitMoE(steps=4, marker=True)
    out = tmp_path / "prof"
    run(module, [StepProfiler(start_step=2, end_step=3, output_path=str(out), with_stack=False)])
    traces = list(out.glob("rank0*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    micro = sorted(int(n.rsplit("_", 1)[1]) for n in names if n.startswith("fake_micro_"))
    assert micro == [2, 3, 4, 5]
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == ["ProfilerStep#2", "ProfilerStep#3"]


def test_profiler_config_errors():
    with pytest.raises(ConfigError, match="profiler.end_step"):
        StepProfiler(start_step=5, end_step=2)
    with pytest.raises(ConfigError, match="profiler.start_step"):
        StepProfiler(start_step=0, end_step=2)
    with pytest.raises(ConfigError, match="profiler.profiler_rank"):
        StepProfiler(profiler_rank="0")


# ----------------------------------------------------------------------------------------------
# CPU affinity
# ----------------------------------------------------------------------------------------------
def test_parse_cpu_list():
    assert parse_cpu_list(["0-3", "8-11"], "f") == [0, 1, 2, 3, 8, 9, 10, 11]
    assert parse_cpu_list([5, "7"], "f") == [5, 7]


@pytest.mark.parametrize("spec, match", [
    ({"device_0": {"affinity_cpu_list": ["0-x"]}}, r"device_0.affinity_cpu_list: '0-x' is not a CPU id"),
    ({"device_0": {"affinity_cpu_list": ["3-1"]}}, r"device_0.affinity_cpu_list: range '3-1'"),
    ({"device_0": {"affinity_cpu_list": ["0-1", "1"]}}, r"CPU 1 is listed twice"),
    ({"device_0": {"affinity_cpu_list": ["0-99"]}}, r"CPU\(s\) \[4, 5.*not available"),
    ({"device_0": {"affinity_cpu_list": ["0-3"], "module_to_cpu_dict": {"main": [4]}}},
     r"module_to_cpu_dict.main: index\(es\) \[4\] out of range"),
    ({"device_0": {"affinity_cpu_list": ["0-3"], "module_to_cpu_dict": {"gpu": [0]}}},
     r"module_to_cpu_dict.gpu: unknown module"),
    ({"device_0": {"cpus": ["0"]}}, r"device_0: unknown key"),
    ({"gpu0": ["0"]}, r"context.affinity_config.gpu0: unknown key"),
    ({"device_1": {"affinity_cpu_list": []}}, r"device_1.affinity_cpu_list: expected a non-empty list"),
])
def test_invalid_affinity_specs_are_one_line_errors(spec, match):
    with pytest.raises(ConfigError, match=match) as info:
        plan_affinity(spec, 0, available={0, 1, 2, 3})
    assert "\n" not in str(info.value)


def test_affinity_plan_follows_the_seed_shape():
    spec = {"device_0": {"affinity_cpu_list": ["0-3", "8-11"],
                         "module_to_cpu_dict": {"main": [0, 1], "minddata": [6, 7]}},
            "device_1": {"affinity_cpu_list": ["4-7"]}}
    avail = set(range(16))
    p0, p1 = plan_affinity(spec, 0, avail), plan_affinity(spec, 1, avail)
    assert (p0.main, p0.workers) == ([0, 1], [10, 11])      # indices into [0..3, 8..11]
    assert (p1.main, p1.workers) == ([4, 5, 6, 7], [4, 5, 6, 7])
    assert plan_affinity(spec, 2, avail) is None             # no entry for local rank 2
    # the config dataclass form (enable flag, ``deviceX`` keys)
    cfg = AffinityConfig(enable=True, affinity_cpu_list={"device0": ["2-3"]})
    assert plan_affinity(cfg, 0, avail).main == [2, 3]
    assert plan_affinity(AffinityConfig(enable=False, affinity_cpu_list={"device0": ["2"]}), 0) is None


AFFINITY_SCRIPT = textwrap.dedent("""
    import os, sys, json
    sys.path.insert(0, {tests!r})
    import torch
    from torch.utils.data import DataLoader, Dataset
    from lit_moe.callbacks import CPUAffinity
    from test_callbacks import FakeLitMoE, run

    class Where(Dataset):
        def __len__(self): return 64
        def __getitem__(self, i): return torch.tensor(sorted(os.sched_getaffinity(0)))

    class Module(FakeLitMoE):
        def train_dataloader(self):
            return DataLoader(Where(), batch_size=1, num_workers=1, multiprocessing_context="fork")
        def training_step(self, dataloader_iter):
            def record():
                for batch, idx, dl in dataloader_iter:
                    self.seen.append(batch[0].tolist())
                    self.main_cpus = sorted(os.sched_getaffinity(0))
                    yield (torch.zeros(2, 9, dtype=torch.long),), idx, dl
            return super().training_step(record())

    m = Module(steps=1)
    m.seen = []
    spec = {{"device_0": {{"affinity_cpu_list": ["0-1"], "module_to_cpu_dict": {{"main": [0], "minddata": [1]}}}}}}
    run(m, [CPUAffinity(spec, rank=0)])
    print(json.dumps({{"main": m.main_cpus, "workers": m.seen}}))
""")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2
                    or not {0, 1} <= os.sched_getaffinity(0), reason="needs Linux and CPUs 0 and 1")
def test_affinity_binds_process_and_data_workers():
    # In a subprocess: binding changes the whole process.
    script = AFFINITY_SCRIPT.format(tests=str(REPO / "tests"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=scaled(120),
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["main"] == [0]
    assert result["workers"] and all(cpus == [1] for cpus in result["workers"])


# ----------------------------------------------------------------------------------------------
# user callbacks from YAML
# ----------------------------------------------------------------------------------------------
USER_MODULE = textwrap.dedent("""
    import lightning as L

    class CountSteps(L.Callback):
        def __init__(self, path, every=1):
            self.path, self.every = path, every

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            m = pl_module.step_metrics            # once per optimizer step
            if m.step % self.every == 0:
                with open(self.path, "a") as f:
                    f.write(f"{m.step} {m.loss:.6f}\\n")
""")


def test_user_callback_from_yaml_class_path_runs(tmp_path):
    (tmp_path / "my_user_callbacks.py").write_text(USER_MODULE)
    log = tmp_path / "steps.txt"
    config = yaml.safe_load(textwrap.dedent(f"""
        callbacks:
          - class_path: my_user_callbacks.CountSteps
            init_args:
              path: {log}
              every: 2
          - class_path: LearningRateMonitor
          - type: lightning.pytorch.callbacks.Timer
            duration: "00:00:10:00"
    """))
    callbacks = load_callbacks(config["callbacks"], base_dir=str(tmp_path))
    assert [type(c).__name__ for c in callbacks] == ["CountSteps", "LearningRateMonitor", "Timer"]
    module = FakeLitMoE(steps=4)
    run(module, callbacks[:1])
    lines = log.read_text().splitlines()
    assert [int(l.split()[0]) for l in lines] == [2, 4]
    assert float(lines[-1].split()[1]) == pytest.approx(module.step_metrics.loss, abs=1e-6)


@pytest.mark.parametrize("spec, match", [
    ([{"class_path": "no_such_module_xyz.Thing"}], r"callbacks\[0\].class_path: cannot import module"),
    ([{"class_path": "lightning.pytorch.callbacks.NoSuch"}], r"has no 'NoSuch'"),
    ([{"class_path": "collections.OrderedDict"}], r"not a lightning.pytorch.Callback subclass"),
    ([{"class_path": "LearningRateMonitor", "init_args": {"bogus": 1}}], r"callbacks\[0\].init_args"),
    ([{"class_path": "Timer", "extra": 1}], r"callbacks\[0\]: unknown key"),
    ([{"init_args": {}}], r"callbacks\[0\]: needs class_path"),
    ([{"class_path": "NoSuchCallbackName"}], r"is not a callback of"),
    ({"class_path": "Timer"}, r"callbacks: expected a list"),
])
def test_bad_user_callbacks_are_config_errors(spec, match):
    with pytest.raises(ConfigError, match=match):
        load_callbacks(spec)


# ----------------------------------------------------------------------------------------------
# build_callbacks
# ----------------------------------------------------------------------------------------------
def test_build_callbacks_wiring(tmp_path):
    monitor = MonitorConfig()
    monitor.tensorboard.output_dir = str(tmp_path / "tb")
    monitor.train_state.device_loss = True
    profiler = ProfilerConfig(enable_profiling=True, start_step=2, end_step=3, output_path=str(tmp_path))
    context = ContextConfig(affinity_config=AffinityConfig(enable=True, affinity_cpu_list={
        "device_0": [str(min(os.sched_getaffinity(0)))]}))
    cbs = build_callbacks(monitor, profiler, context, None, 16, {"training": {"steps": 7}})
    types = [type(c) for c in cbs]
    assert types == [CPUAffinity, StepProfiler, TrainStateMonitor, GlobalNormSkipGuard, ThroughputMFU,
                     MoEMetrics, StepLogger, LoggerBridge]
    guard = cbs[3]
    assert (guard.threshold, guard.max_consecutive, guard.embedding_threshold) == (100.0, 10, 100.0)
    assert cbs[6].total_steps == 7
    # heatmap PNGs go into the TensorBoard run's own directory, found when training starts
    assert cbs[5].heatmap_dir is None and cbs[5].heatmap_in_log_dir
    # a user ThroughputMFU with a peak replaces the built-in and keeps its FLOPs per token
    cbs[4].flops_per_token = 123.0
    user = ThroughputMFU(peak_flops=5e14)
    merged = merge_callbacks(cbs, [user, StepLogger()])
    assert merged[4] is user and user.flops_per_token == 123.0 and user.peak_flops == 5e14
    assert isinstance(merged[6], StepLogger) and merged[6] is not cbs[6] and len(merged) == 8


def test_build_callbacks_rejects_bad_sections():
    monitor = MonitorConfig()
    monitor.tensorboard.log_interval = 0
    with pytest.raises(ConfigError, match="monitor.tensorboard.log_interval"):
        build_callbacks(monitor, ProfilerConfig(), ContextConfig(), None, 16, {})
    monitor = MonitorConfig()
    monitor.moe_monitor.save_tokens_per_expert_interval = True
    with pytest.raises(ConfigError, match="monitor.moe_monitor.save_tokens_per_expert_interval"):
        build_callbacks(monitor, ProfilerConfig(), ContextConfig(), None, 16, {})
    with pytest.raises(ConfigError, match="context.affinity_config.device_0.affinity_cpu_list"):
        build_callbacks(MonitorConfig(), ProfilerConfig(), ContextConfig(affinity_config=AffinityConfig(
            enable=True, affinity_cpu_list={"device_0": ["9999"]})), None, 16, {})


def test_the_documented_custom_callback_runs(tmp_path, capsys):
    import re

    from test_callbacks import handmade_moe

    doc = (REPO / "docs" / "callbacks.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "# my_callbacks.py" in b)
    spec = next(yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", doc, re.S)
                if "my_callbacks.PrintExpertLoad" in b)["callbacks"]
    (tmp_path / "my_callbacks.py").write_text(code)
    callbacks = load_callbacks(spec, base_dir=str(tmp_path))
    callbacks[0].every = 2
    run(FakeLitMoE(steps=4, moe_fn=handmade_moe), callbacks[:1])
    # handmade counts: [8, 4, 2, 2] → expert 0; [0, 6, 6, 4] → 1 (first maximum); [4, 4, 4, 4] → 0
    lines = [l for l in capsys.readouterr().out.splitlines() if l[:1].isdigit()]
    assert lines == ["2 [0, 1, 0]", "4 [0, 1, 0]"]
