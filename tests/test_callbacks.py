"""Callbacks driven by a real ``lightning.Trainer`` on CPU with a small fake LightningModule that
behaves like ``LitMoE`` (manual optimization, one optimizer step per ``training_step(dataloader_iter)``,
gradient observers and StepGuards asked before clipping, a frozen ``StepMetrics`` after each step).

Expected numbers are computed by hand in the tests (routing counts, load imbalance, MFU), never taken
from the callbacks' own output.
"""

from __future__ import annotations

import copy
import json
import math
import time
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lit_moe.callbacks import (GlobalNormSkipGuard, GradientObserver, MoEMetrics, SkipLimitExceeded, StepGuard,
                               StepLogger, StepMetrics, ThroughputMFU, TrainStateMonitor, build_logger)
from lit_moe.callbacks.heatmap import png_size
from lit_moe.step import MoEStepStats
from lit_moe.config import ConfigError, MonitorConfig

VOCAB, HIDDEN, SEQ, BATCH = 16, 8, 8, 2


# ----------------------------------------------------------------------------------------------
# a fake model and module with the LitMoE contract
# ----------------------------------------------------------------------------------------------
class FakeMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        return self.proj(x)


class Block(nn.Module):
    def __init__(self, moe: bool):
        super().__init__()
        self.mlp = FakeMoE() if moe else nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        return x + torch.tanh(self.mlp(x))


class TinyModel(nn.Module):
    """Stand-in for DeepseekV3ForCausalLM: 3 decoder blocks (0 dense, 1-2 MoE) + 1 MTP block (MoE)."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Block(False), Block(True), Block(True)])
        self.mtp = nn.ModuleList([Block(True)])
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def blocks(self):
        return list(self.layers) + list(self.mtp)

    def moe_layers(self):
        return [b.mlp for b in self.blocks() if isinstance(b.mlp, FakeMoE)]

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for block in self.layers:
            x = block(x)
        return self.lm_head(x)


class FakeLitMoE(L.LightningModule):
    """Manual optimization like LitMoE. ``bad_steps``: {step: factor} multiplies that step's loss
    (huge factor → huge norm, nan → NaN gradients). ``moe_fn(step)`` gives ``step_metrics.moe``."""

    def __init__(self, accumulation_steps=2, steps=4, bad_steps=None, max_norm=1.0, moe_fn=None,
                 step_time=None, capacity=None, marker=False):
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.model = TinyModel()
        self.model_config = SimpleNamespace(moe_expert_capacity_factor=capacity)
        self.accumulation_steps = accumulation_steps
        self.steps = steps
        self.bad_steps = bad_steps or {}
        self.max_norm = max_norm
        self.moe_fn = moe_fn
        self.fixed_step_time = step_time
        self.marker = marker
        self.step_metrics = None
        self._micro_losses = []
        self._done = 0
        self._skipped = 0
        self._t0 = None
        self._micro_index = 0

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return [opt], [sched]

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        n = BATCH * self.accumulation_steps * self.steps
        return DataLoader(TensorDataset(torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)),
                          batch_size=BATCH)

    def training_step(self, dataloader_iter):
        # one optimizer step per call, as LitMoE: the A micro-batches, then observers → guards → update
        if self._t0 is None:
            self._t0 = time.perf_counter()
        opt, sched = self.optimizers(), self.lr_schedulers()
        step = self._done + 1
        for _ in range(self.accumulation_steps):
            batch, _, _ = next(dataloader_iter)
            ids = batch[0].to(self.device)   # dataloader_iter steps get host batches (as LitMoE's do)
            ctx = (torch.profiler.record_function(f"fake_micro_{self._micro_index}") if self.marker
                   else torch.autograd.profiler.record_function("noop"))
            with ctx:
                logits = self.model(ids[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
                scaled = loss / self.accumulation_steps
                if step in self.bad_steps:
                    scaled = scaled * self.bad_steps[step]
                self.manual_backward(scaled)
            self._micro_index += 1
            self._micro_losses.append(float(scaled.detach()))
        params = [p for p in self.parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        for cb in self.trainer.callbacks:
            if isinstance(cb, GradientObserver):
                cb.on_gradients_before_clip(self.trainer, self, norm)
        guards = [cb for cb in self.trainer.callbacks if isinstance(cb, StepGuard)]
        skip = any([g.should_skip(self.trainer, self, norm) for g in guards])  # every guard is asked
        lr = opt.param_groups[0]["lr"]
        if skip:
            opt.zero_grad(set_to_none=True)
            self._skipped += 1
        else:
            if self.max_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, self.max_norm)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        self._done += 1
        step_time = self.fixed_step_time or (time.perf_counter() - self._t0)
        self.step_metrics = StepMetrics(
            step=self._done, loss=sum(self._micro_losses), grad_norm=float(norm), lr=lr, skipped=skip,
            skipped_steps=self._skipped, consumed_samples=self._done * BATCH * self.accumulation_steps,
            tokens=BATCH * self.accumulation_steps * SEQ, step_time=step_time, aux_loss=0.01 * step,
            mtp_loss=None, micro_losses=tuple(self._micro_losses),
            moe=self.moe_fn(self._done) if self.moe_fn else None)
        self._micro_losses = []
        self._t0 = None


def run(module, callbacks, logger=False, accelerator="cpu"):
    trainer = L.Trainer(accelerator=accelerator, devices=1, max_epochs=1,
                        limit_train_batches=module.accumulation_steps * module.steps, logger=logger,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks, num_sanity_val_steps=0)
    trainer.fit(module)
    return trainer


def tb_logger(tmp_path):
    monitor = MonitorConfig()
    monitor.tensorboard.output_dir = str(tmp_path / "tb")
    return build_logger(monitor)


def read_tb(logdir):
    """The events of the latest run under a ``monitor.tensorboard.output_dir`` (its
    ``lit_moe/version_<n>`` directory), or of ``logdir`` itself."""
    from pathlib import Path

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = sorted(Path(logdir).glob("lit_moe/version_*"), key=lambda p: int(p.name.split("_")[1]))
    logdir = runs[-1] if runs else logdir
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc, tag):
    return {e.step: e.value for e in acc.Scalars(tag)}


class Snapshot(L.Callback):
    """Deep copies of parameters, optimizer and scheduler state after every optimizer step."""

    def __init__(self):
        self.states = {}
        self.metrics = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = pl_module.step_metrics
        assert m.step not in self.states   # once per optimizer step
        opt = trainer.optimizers[0]
        self.metrics[m.step] = m
        self.states[m.step] = dict(
            params={k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            optim=copy.deepcopy(opt.state_dict()),
            sched=copy.deepcopy(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
            lightning_steps=trainer.global_step)


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def params_differ(a, b):
    return any(not torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


# ----------------------------------------------------------------------------------------------
# skip protection
# ----------------------------------------------------------------------------------------------
def test_skipped_step_leaves_model_and_optimizer_bit_identical(tmp_path, capsys):
    snap = Snapshot()
    module = FakeLitMoE(steps=4, bad_steps={3: 1e8})       # step 3: norm ~1e8 > 100
    run(module, [GlobalNormSkipGuard(100.0, 10, None), snap, StepLogger()], logger=tb_logger(tmp_path))
    s = snap.states
    assert [s[k]["lightning_steps"] for k in (1, 2, 3, 4)] == [1, 2, 2, 3]  # no optimizer.step at 3
    assert_same(s[2], {**s[3], "lightning_steps": 2})   # params, moments, step counts, schedule
    assert params_differ(s[1], s[2]) and params_differ(s[3], s[4])  # the healthy steps did update
    err = capsys.readouterr().err
    assert "step 3: update skipped" in err and "global_norm_skip_threshold 100" in err
    acc = read_tb(tmp_path / "tb")
    assert scalars(acc, "train/skipped_steps") == {1: 0.0, 2: 0.0, 3: 1.0, 4: 1.0}
    assert scalars(acc, "train/grad_norm")[3] > 1e6


def test_nan_gradients_are_skipped():
    snap = Snapshot()
    module = FakeLitMoE(steps=3, bad_steps={2: float("nan")})
    run(module, [GlobalNormSkipGuard(), snap])
    assert math.isnan(snap.metrics[2].grad_norm) and snap.metrics[2].skipped
    assert_same(snap.states[1]["params"], snap.states[2]["params"])
    assert_same(snap.states[1]["optim"], snap.states[2]["optim"])
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert module.step_metrics.skipped_steps == 1


def test_more_than_skip_time_consecutive_skips_stop_the_run():
    nan = float("nan")
    module = FakeLitMoE(steps=6, bad_steps={2: nan, 3: nan, 4: nan, 5: nan})
    guard = GlobalNormSkipGuard(100.0, 2, None)
    with pytest.raises(SkipLimitExceeded) as info:
        run(module, [guard])
    message = str(info.value)
    assert "\n" not in message and "step 4" in message and "global_norm_skip_time=2" in message
    # the guard decides on the device and reports at the step's end: step 4 went over the limit, so its
    # update was skipped (the state is the last healthy one) and the run stopped when it was reported
    assert module._done == 4 and module._skipped == 3


def test_consecutive_count_resets_after_a_healthy_step():
    nan = float("nan")
    module = FakeLitMoE(steps=6, bad_steps={2: nan, 3: nan, 5: nan, 6: nan})
    guard = GlobalNormSkipGuard(100.0, 2, None)
    run(module, [guard])
    assert module.step_metrics.skipped_steps == 4 and guard.consecutive == 2


def test_embedding_norm_threshold_skips_on_its_own():
    module = FakeLitMoE(steps=2)
    guard = GlobalNormSkipGuard(1e30, 10, embedding_local_norm_threshold=1e-12)
    run(module, [guard])
    assert module.step_metrics.skipped_steps == 2
    module = FakeLitMoE(steps=2)
    run(module, [GlobalNormSkipGuard(1e30, 10, embedding_local_norm_threshold=None)])
    assert module.step_metrics.skipped_steps == 0


def test_guard_uses_pre_clip_norm():
    # max_norm 1 would clip a norm of ~1e3 down to 1; the guard must still see (and skip) 1e3.
    module = FakeLitMoE(steps=2, bad_steps={2: 1e5}, max_norm=1.0)
    run(module, [GlobalNormSkipGuard(50.0, 10, None)])
    assert module.step_metrics.skipped and module.step_metrics.grad_norm > 50


@pytest.mark.parametrize("kwargs, field", [
    (dict(global_norm_skip_threshold=0), "global_norm_skip_threshold"),
    (dict(global_norm_skip_threshold=True), "global_norm_skip_threshold"),
    (dict(global_norm_skip_time=-1), "global_norm_skip_time"),
    (dict(global_norm_skip_time=1.5), "global_norm_skip_time"),
    (dict(embedding_local_norm_threshold=-3.0), "embedding_local_norm_threshold"),
])
def test_guard_rejects_bad_config(kwargs, field):
    with pytest.raises(ConfigError, match=f"monitor.health_checkpoint.{field}"):
        GlobalNormSkipGuard(**kwargs)


# ----------------------------------------------------------------------------------------------
# step logging
# ----------------------------------------------------------------------------------------------
def test_step_scalars_vs_samples_config_text_and_interval(tmp_path, capsys):
    module = FakeLitMoE(steps=4)
    seen = {}

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            m = pl_module.step_metrics
            if m is not None:
                seen[m.step] = m

    config = {"training": {"steps": 4, "global_batch_size": 4}, "model": {"hidden_size": HIDDEN}}
    run(module, [StepLogger(log_interval=2, total_steps=4, resolved_config=config), Record()],
        logger=tb_logger(tmp_path))
    acc = read_tb(tmp_path / "tb")
    loss = scalars(acc, "train/loss")
    assert sorted(loss) == [2, 4]
    for step in (2, 4):
        assert loss[step] == pytest.approx(seen[step].loss, rel=1e-6)
        assert scalars(acc, "train/lr")[step] == pytest.approx(seen[step].lr, rel=1e-6)
        assert scalars(acc, "train/aux_loss")[step] == pytest.approx(0.01 * step, rel=1e-6)
    # the same value against consumed samples (BATCH * A = 4 samples per step)
    assert scalars(acc, "train/loss vs samples") == {8: loss[2], 16: loss[4]}
    assert scalars(acc, "train/consumed_samples") == {2: 8.0, 4: 16.0}
    assert "train/mtp_loss" not in acc.Tags()["scalars"]       # None: not written
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "global_batch_size: 4" in text and "hidden_size: 8" in text
    out = capsys.readouterr().out
    assert "step 2/4 | loss" in out and "step 4/4 | loss" in out and "step 1/4" not in out


def test_device_loss_and_local_loss_lines(capsys):
    module = FakeLitMoE(steps=2)
    run(module, [TrainStateMonitor(device_loss=True, local_loss=True)])
    lines = [json.loads(l) for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
    device = [l for l in lines if "device_loss" in l]
    local = [l for l in lines if "local_loss" in l]
    assert [l["step"] for l in device] == [1, 2]
    assert [(l["step"], l["micro_step"]) for l in local] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    for step in (1, 2):  # the step loss is the sum of the 1/A-scaled micro losses
        micro = sum(l["local_loss"] for l in local if l["step"] == step)
        assert [l["device_loss"] for l in device if l["step"] == step][0] == pytest.approx(micro)


def test_local_norm_and_device_norm_are_per_micro_batch_and_accumulated(capsys):
    # Driven by hand: a micro-batch's local norm is the norm of *its* gradient, not the running sum.
    w = nn.Parameter(torch.zeros(2))
    other = nn.Parameter(torch.zeros(3))
    pl_module = SimpleNamespace(model=nn.ParameterDict({"w": w, "other": other}))
    trainer = SimpleNamespace(is_global_zero=True)
    monitor = TrainStateMonitor(local_norm="w", device_norm=["w", "other"])
    w.grad, other.grad = torch.tensor([3.0, 4.0]), torch.ones(3)          # micro 0: |g0| = 5
    monitor.on_after_backward(trainer, pl_module)
    w.grad, other.grad = torch.tensor([3.0, 4.0]) + torch.tensor([6.0, 8.0]), 2 * torch.ones(3)
    monitor.on_after_backward(trainer, pl_module)                          # micro 1: |g1| = 10
    monitor.on_gradients_before_clip(trainer, pl_module, torch.tensor(1.0))
    pl_module.step_metrics = SimpleNamespace(step=1, loss=0.5, micro_losses=(0.2, 0.3))
    monitor.on_train_batch_end(trainer, pl_module, None, None, 1)
    lines = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert lines[:4] == [{"step": 1, "micro_step": 0}, {"local_norm": "w: 5.0"},
                         {"step": 1, "micro_step": 1}, {"local_norm": "w: 10.0"}]
    assert lines[4] == {"step": 1}
    device = dict(l["device_norm"].split(": ") for l in lines[5:])
    assert device.keys() == {"w", "other"}                 # the accumulated, pre-clip gradients
    assert float(device["w"]) == 15.0 and float(device["other"]) == pytest.approx(2 * math.sqrt(3))


def test_train_state_rejects_bad_filters():
    with pytest.raises(ConfigError, match="monitor.train_state.local_norm"):
        TrainStateMonitor(local_norm=[1, 2])
    with pytest.raises(ConfigError, match="monitor.train_state.device_norm"):
        TrainStateMonitor(device_norm=3.5)


# ----------------------------------------------------------------------------------------------
# MoE metrics
# ----------------------------------------------------------------------------------------------
# A handmade top-2 routing of 4 tokens over 4 experts per MoE layer (rows: blocks 1, 2 and the MTP
# block 3), identical in both micro-batches of a step.
ROUTING = [
    [[0, 1], [0, 1], [0, 2], [0, 3]],   # block 1: per micro [4, 2, 1, 1]
    [[1, 2], [1, 2], [2, 3], [3, 1]],   # block 2: per micro [0, 3, 3, 2]
    [[0, 1], [2, 3], [0, 2], [1, 3]],   # block 3 (MTP): per micro [2, 2, 2, 2]
]


def handmade_moe(step):
    # What the module reports: counts summed over the 2 micro-batches.
    counts = torch.stack([torch.bincount(torch.tensor(r).flatten(), minlength=4) for r in ROUTING]) * 2
    return MoEStepStats(
        tokens_per_expert=counts,
        aux_loss=torch.tensor([0.5, 0.25, 0.125]),
        expert_bias=torch.tensor([[0.1, -0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0], [0.05, 0.05, 0.05, 0.05]]),
        dropped=torch.tensor([2, 0, 1]),
        assigned=torch.tensor([16, 16, 16]),
    )


def test_moe_metrics_match_handmade_routing(tmp_path, capsys):
    module = FakeLitMoE(steps=4, moe_fn=handmade_moe, capacity=1.5)
    heatmaps = tmp_path / "heat"
    run(module, [MoEMetrics(save_tokens_per_expert_interval=2, heatmap_dir=str(heatmaps))],
        logger=tb_logger(tmp_path))
    acc = read_tb(tmp_path / "tb")
    # hand: block 1 counts [8, 4, 2, 2] → max 8 / mean 4 = 2; block 2 [0, 6, 6, 4] → 6/4; MTP even → 1
    expected = {
        "moe/layer1/load_imbalance": 2.0, "moe/layer2/load_imbalance": 1.5,
        "moe/layer3/load_imbalance": 1.0, "moe/max_load_imbalance": 2.0,
        "moe/layer1/aux_loss": 0.5, "moe/layer3/aux_loss": 0.125,
        "moe/layer1/expert_bias_mean": 0.0, "moe/layer1/expert_bias_max_abs": 0.3,
        "moe/layer3/expert_bias_mean": 0.05,
        "moe/layer1/drop_rate": 2 / 16, "moe/layer2/drop_rate": 0.0, "moe/layer3/drop_rate": 1 / 16,
        "moe/drop_rate": 3 / 48,
        "moe/layer1/tokens_per_expert/expert0": 8.0, "moe/layer2/tokens_per_expert/expert0": 0.0,
        "moe/layer2/tokens_per_expert/expert3": 4.0,
    }
    for tag, value in expected.items():
        got = scalars(acc, tag)
        assert got[2] == pytest.approx(value, abs=1e-7), tag
    assert sorted(scalars(acc, "moe/layer1/load_imbalance")) == [1, 2, 3, 4]
    assert sorted(scalars(acc, "moe/layer1/tokens_per_expert/expert0")) == [2, 4]
    assert "moe/layer0/load_imbalance" not in acc.Tags()["scalars"]   # block 0 is dense
    assert "moe/layer1/load_imbalance vs samples" in acc.Tags()["scalars"]
    assert [e.step for e in acc.Images("moe/expert_load")] == [2, 4]
    assert "MoE drop rate step 1: layer1 0.1250, layer2 0.0000, layer3 0.0625" in capsys.readouterr().out

    # the heatmap files are the same pictures as the TensorBoard images (drawing and pixels:
    # tests/test_dashboards.py)
    files = sorted(p.name for p in heatmaps.iterdir())
    assert files == ["expert_load_step00000002.png", "expert_load_step00000004.png"]
    image = acc.Images("moe/expert_load")[0]
    assert (heatmaps / files[0]).read_bytes() == image.encoded_image_string
    assert image.width >= 400 and png_size(image.encoded_image_string) == (image.width, image.height)


def test_moe_target_layers(tmp_path):
    module = FakeLitMoE(steps=1, moe_fn=handmade_moe)
    run(module, [MoEMetrics(target_layers=[1, 3])], logger=tb_logger(tmp_path))
    tags = read_tb(tmp_path / "tb").Tags()["scalars"]
    assert "moe/layer1/aux_loss" in tags and "moe/layer3/aux_loss" in tags
    assert "moe/layer2/aux_loss" not in tags
    assert "moe/layer1/drop_rate" not in tags          # no capacity in the model config
    with pytest.raises(ConfigError, match=r"monitor.moe_monitor.target_layers: layer\(s\) \[0\]"):
        run(FakeLitMoE(steps=1, moe_fn=handmade_moe), [MoEMetrics(target_layers=[0])])
    with pytest.raises(ConfigError, match="monitor.moe_monitor.target_layers"):
        MoEMetrics(target_layers="all")


# ----------------------------------------------------------------------------------------------
# throughput and MFU
# ----------------------------------------------------------------------------------------------
def test_mfu_matches_hand_calculation(tmp_path):
    # 2 micro-batches × 2 samples × 8 tokens = 32 tokens in 0.5 s; 6e6 FLOPs/token; peak 1e12.
    module = FakeLitMoE(steps=2, step_time=0.5)
    run(module, [ThroughputMFU(flops_per_token=6e6, peak_flops=1e12), StepLogger()],
        logger=tb_logger(tmp_path))
    acc = read_tb(tmp_path / "tb")
    assert scalars(acc, "train/tokens_per_sec")[1] == pytest.approx(64.0)
    assert scalars(acc, "train/tokens_per_sec_per_device")[1] == pytest.approx(64.0)
    assert scalars(acc, "train/step_time")[2] == pytest.approx(0.5)
    assert scalars(acc, "train/tflops_per_device")[1] == pytest.approx(3.84e-4, rel=1e-6)  # 6e6·32/0.5
    assert scalars(acc, "train/mfu")[1] == pytest.approx(3.84e-4, rel=1e-6)
    assert scalars(acc, "train/mfu vs samples")[8] == pytest.approx(3.84e-4, rel=1e-6)
    rss = scalars(acc, "train/rss_gib")[1]
    assert 0.01 < rss < 64   # this pytest process: tens of MiB at least


def test_throughput_under_tp_cp_divides_by_world_size():
    from lit_moe.callbacks import throughput_metrics

    # 8 devices (e.g. dp 2 × tp 2 × cp 2), 4096 global tokens in 0.5 s, 1e9 FLOPs/token, peak 1e15.
    out = throughput_metrics(4096, 0.5, 8, flops_per_token=1e9, peak_flops=1e15)
    assert out["tokens_per_sec"] == 8192
    assert out["tokens_per_sec_per_device"] == 1024
    assert out["tflops_per_device"] == pytest.approx(1.024)     # 1e9 · 4096 / 0.5 / 8 / 1e12
    assert out["mfu"] == pytest.approx(1.024e-3)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12),
    ("Ascend910B3", 313e12), ("Tesla T4", None),
])
def test_known_peaks(name, peak):
    from lit_moe.callbacks import known_peak_flops

    assert known_peak_flops(name) == peak


def test_cpu_peak_is_measured_once(monkeypatch):
    from lit_moe.runtime import device_speed
    from lit_moe.callbacks import measure_matmul_peak

    # fp32: this test's time does not depend on whether the CPU has native bf16
    first = measure_matmul_peak("cpu", torch.float32)
    calls = []
    monkeypatch.setattr(device_speed, "matmul_rate", lambda *a: calls.append(a) or 0.0)
    assert measure_matmul_peak("cpu", torch.float32) == first and calls == []   # not measured again
    # plausibility against an independent timing of the same GEMM size
    a = torch.randn(1024, 1024, dtype=torch.float32)
    a @ a
    t = time.perf_counter()
    a @ a
    independent = 2 * 1024 ** 3 / (time.perf_counter() - t)
    assert independent / 20 < first < independent * 20


def test_cpu_peak_is_measured_in_the_compute_dtype(monkeypatch, capsys):
    from lit_moe.callbacks import throughput

    asked = []
    monkeypatch.setattr(throughput, "measure_matmul_peak", lambda device, dtype: asked.append(dtype) or 4e11)
    callback = ThroughputMFU(flops_per_token=1e6, compute_dtype=torch.float32)
    run(FakeLitMoE(steps=1, step_time=0.25), [callback])
    assert asked == [torch.float32] and callback.peak_flops == 4e11
    assert "MFU peak: 400.0 GFLOP/s per device (measured float32 matmul rate on cpu)" in capsys.readouterr().out


def test_throughput_feeds_console_line(capsys):
    run(FakeLitMoE(steps=1, step_time=0.25), [ThroughputMFU(flops_per_token=1e6, peak_flops=1e11),
                                              StepLogger()])
    line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("step 1")][0]
    # 32 tokens / 0.25 s = 128 tokens/s; 1e6·128 = 1.28e8 FLOP/s = 0.128% of 1e11
    assert "tokens/s 128.0" in line and "mfu 0.13%" in line and "step_time 250ms" in line


def test_skip_guard_consecutive_count_survives_a_resume():
    """The guard's counters are callback state (saved in checkpoints): after a resume in the middle of
    a run of skipped steps, the limit counts the skips from before the save too."""
    trainer = SimpleNamespace(is_global_zero=False, global_step=5)
    pl_module = SimpleNamespace(step_metrics=SimpleNamespace(step=5))
    before = GlobalNormSkipGuard(1.0, 2, None)
    # the verdict is a device tensor (no host sync); the checkpoint's state_dict reads it back
    assert bool(before.should_skip(trainer, pl_module, torch.tensor(5.0))) is True
    assert bool(before.should_skip(trainer, pl_module, torch.tensor(5.0))) is True
    after = GlobalNormSkipGuard(1.0, 2, None)
    after.load_state_dict(before.state_dict())
    assert after.state_dict() == {"consecutive": 2, "total_skipped": 2}
    assert bool(after.should_skip(trainer, pl_module, torch.tensor(5.0))) is True   # over the limit: skipped
    with pytest.raises(SkipLimitExceeded):
        after.report()


@pytest.mark.parametrize("make", [lambda: ThroughputMFU(log_interval=0), lambda: StepLogger(log_interval=0),
                                  lambda: MoEMetrics(log_interval=0)])
def test_user_callbacks_reject_a_zero_log_interval(make):
    with pytest.raises(ConfigError, match=r"\w+\.log_interval: must be an int >= 1"):
        make()


def test_tensorboard_event_file_is_opened_once_not_per_scalar(tmp_path, monkeypatch):
    """Without TensorFlow, TensorBoard's gfile stub opened the event file for every record (measured:
    1,000 opens for 1,000 scalars); the run's logger opens it a constant number of times (2: the
    stub's header write, then the kept handle) and every scalar is in the file."""
    import builtins
    import io

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    opened = []
    real_open = io.open

    def counting_open(file, *args, **kwargs):
        if "tfevents" in str(file):
            opened.append(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", counting_open)
    monkeypatch.setattr(builtins, "open", counting_open)
    logger = tb_logger(tmp_path)
    for i in range(1000):
        logger.experiment.add_scalar("x", float(i), i)
    logger.finalize("success")
    monkeypatch.undo()
    assert len(opened) <= 2, opened
    [path] = list(tmp_path.rglob("events.out.tfevents.*"))
    events = EventAccumulator(str(path))
    events.Reload()
    assert [s.value for s in events.Scalars("x")] == [float(i) for i in range(1000)]
