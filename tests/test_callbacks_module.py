"""The callbacks with the real ``LitMoE`` and a tiny DeepSeek-V3 model (CPU, a few steps)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from torch.utils.data import DataLoader

from lit_moe.callbacks import GlobalNormSkipGuard, MoEMetrics, StepLogger, ThroughputMFU, build_logger
from lit_moe.config import MonitorConfig, TrainingConfig
from lit_moe.model import DeepseekV3Config
from lit_moe.module import LitMoE

from test_callbacks import Snapshot, assert_same, params_differ, read_tb, scalars

ROOT = Path(__file__).resolve().parents[1]
SEQ, VOCAB = 16, 64


def tiny_module(steps: int) -> LitMoE:
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    model = dict(cfg["model"], hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                 moe_shared_expert_intermediate_size=16, seq_length=SEQ, vocab_size=VOCAB,
                 num_hidden_layers=2, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
                 qk_rope_head_dim=4, v_head_dim=8, num_attention_heads=2)
    training = TrainingConfig(steps=steps, local_batch_size=2, global_batch_size=4, max_norm=1.0)
    return LitMoE(DeepseekV3Config(**model), cfg["optimizer"], cfg["lr_scheduler"], training,
                  accumulation_steps=2)


def loader(steps: int) -> DataLoader:
    """``steps`` optimizer steps of 2 micro-batches of 2 samples (each item: one step's micro-batches)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (steps, 2, 2, SEQ + 1), generator=g)
    return DataLoader([[{"input_ids": mb[:, :-1], "labels": mb[:, 1:]} for mb in step] for step in ids],
                      batch_size=None)


class SkipStep(L.Callback):
    """Make the guard's threshold tiny for one step only (a norm spike, seen by the real guard)."""

    def __init__(self, guard: GlobalNormSkipGuard, step: int):
        self.guard, self.step, self.normal = guard, step, guard.threshold

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        done = pl_module.step_metrics.step if pl_module.step_metrics is not None else 0
        self.guard.threshold = 1e-12 if done + 1 == self.step else self.normal


@pytest.mark.parametrize("accelerator", [
    "cpu", pytest.param("gpu", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))])
def test_real_module_skipped_step_is_bit_identical_and_moe_counts_add_up(tmp_path, accelerator,
                                                                        one_process_strategy):
    steps = 3
    guard = GlobalNormSkipGuard(100.0, 10, None)
    snap = Snapshot()
    monitor = MonitorConfig()
    monitor.tensorboard.output_dir = str(tmp_path / "tb")
    module = tiny_module(steps)
    trainer = L.Trainer(accelerator=accelerator, devices=1, strategy=one_process_strategy(), max_epochs=1,
                        limit_train_batches=steps,
                        logger=build_logger(monitor), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[SkipStep(guard, 2), guard, ThroughputMFU(), MoEMetrics(),
                                   StepLogger(), snap])
    trainer.fit(module, loader(steps))
    s = snap.states
    assert [snap.metrics[k].skipped for k in (1, 2, 3)] == [False, True, False]
    # parameters, expert biases, AdamW moments and step counts, and the LR schedule: untouched
    assert_same(s[1]["params"], s[2]["params"])
    assert_same(s[1]["optim"], s[2]["optim"])
    assert_same(s[1]["sched"], s[2]["sched"])
    assert params_differ(s[2], s[3])

    acc = read_tb(tmp_path / "tb")
    assert scalars(acc, "train/skipped_steps") == {1: 0.0, 2: 1.0, 3: 1.0}
    # every token picks num_experts_per_tok = 2 experts in each MoE layer (decoder layer 1 and the
    # MTP layer, block 2): per step 2 micro-batches × 2 samples × 16 tokens × 2 = 128 assignments
    for step in (1, 2, 3):
        moe = snap.metrics[step].moe
        assert moe.tokens_per_expert.sum(dim=1).tolist() == [128.0, 128.0]
    tags = acc.Tags()["scalars"]
    assert "moe/layer1/load_imbalance" in tags and "moe/layer2/load_imbalance" in tags
    counts = moe.tokens_per_expert
    assert scalars(acc, "moe/layer2/load_imbalance")[3] == pytest.approx(
        float(counts[1].max() / counts[1].mean()), rel=1e-6)


USER_CALLBACK = '''
import lightning as L

class RecordSteps(L.Callback):
    def __init__(self, path):
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = pl_module.step_metrics            # once per optimizer step
        with open(self.path, "a") as f:
            f.write(f"{m.step} {m.skipped}\\n")
'''


def test_cli_skip_limit_stops_with_one_line_and_no_checkpoint_of_the_bad_step(tmp_path):
    from helpers import run_cli, tiny_config, write_config

    (tmp_path / "run_callbacks.py").write_text(USER_CALLBACK)
    record = tmp_path / "steps.txt"
    cfg = tiny_config(tmp_path, steps=4,
                      monitor={"health_checkpoint": {"global_norm_skip_threshold": 1.0e-9,
                                                     "global_norm_skip_time": 1}},
                      checkpoint={"enable_save": True, "save_interleaved_steps": 1},
                      model={"vocab_size": 4096})
    cfg["callbacks"] = [{"class_path": "run_callbacks.RecordSteps", "init_args": {"path": str(record)}}]
    path = write_config(tmp_path / "", cfg)
    proc = run_cli(["fit", "--config", str(path)], cwd=tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = [l for l in proc.stderr.splitlines() if l.startswith("lit_moe: error:")]
    assert len(err) == 1 and "step 2: 2 consecutive steps skipped" in err[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "WARNING: step 1: update skipped" in proc.stderr
    # the user callback from the YAML class_path ran for step 1; step 2 never completed
    assert record.read_text().split() == ["1", "True"]
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir()) if (tmp_path / "ckpt").exists() else []
    assert "iteration_00000002" not in saved and not any(n.startswith(".iteration_00000002") for n in saved)


class SlowDataAndRecordAux(L.Callback):
    """Sleeps before every step (as slow data loading would) and records each micro-batch's
    per-layer balancing loss as the MoE layers report it."""

    def __init__(self, pause: float):
        self.pause, self.aux = pause, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        import time
        time.sleep(self.pause)

    def on_after_backward(self, trainer, pl_module):
        self.aux.append([float(m.last_stats["aux_loss"]) for m in pl_module.model.moe_layers()])


def test_step_time_is_wall_time_and_layer_aux_is_the_step_mean(tmp_path, one_process_strategy):
    """``step_time`` covers data fetching and callbacks (0.4 s of sleep before every step),
    and the per-layer ``moe.aux_loss`` is the mean over the step's micro-batches without the
    coefficient."""
    steps, pause = 2, 0.4
    module = tiny_module(steps)
    rec, snap = SlowDataAndRecordAux(pause), Snapshot()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=one_process_strategy(), max_epochs=1,
                        limit_train_batches=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[rec, snap])
    trainer.fit(module, loader(steps))
    coeff = module.model_config.moe_aux_loss_coeff
    for step in (1, 2):
        m = snap.metrics[step]
        assert m.step_time >= pause
        micro = torch.tensor(rec.aux[2 * (step - 1): 2 * step], dtype=torch.float64)   # [2, layers]
        torch.testing.assert_close(m.moe.aux_loss, micro.mean(0) / coeff, rtol=1e-6, atol=0)


def test_consumed_samples_of_other_data_are_the_steps_as_they_came(one_process_strategy):
    """Without lit_moe's DataModule, each step's consumed samples add the samples that step trained on
    (micro-batches x their samples): steps of 2, 1 and 3 micro-batches of 2 samples give 4, 6, 12
    (not steps x the last step's size: 4, 4, 18)."""
    g = torch.Generator().manual_seed(0)
    steps = [torch.randint(0, VOCAB, (n, 2, SEQ + 1), generator=g) for n in (2, 1, 3)]
    data = DataLoader([[{"input_ids": mb[:, :-1], "labels": mb[:, 1:]} for mb in step] for step in steps],
                      batch_size=None)
    snap = Snapshot()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=one_process_strategy(), max_epochs=1,
                        limit_train_batches=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        use_distributed_sampler=False, callbacks=[snap])   # the steps in this order
    trainer.fit(tiny_module(3), data)
    assert [snap.metrics[k].consumed_samples for k in (1, 2, 3)] == [4, 6, 12]
