"""The PyNative training semantics of ``lit_moe fit``: accumulation, determinism, a falling loss."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from helpers import ROOT, cli_in_process, tiny_config, write_config

TESTS = str(ROOT / "tests")


def _fit(tmp_path, cfg, name, capfd):
    path = write_config(tmp_path, cfg, f"{name}.yaml")
    proc = cli_in_process(["fit", "--config", str(path)], capfd, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _fp32(cfg):
    cfg["model"]["compute_dtype"] = "float32"
    return cfg


def test_accumulation_matches_one_big_batch(tmp_path, capfd):
    """A=4 micro-batches of 2 give the gradients of one batch of 8 (same samples, fp32)."""
    grads = {}
    for name, lbs in (("accum", 2), ("big", 8)):
        cfg = _fp32(tiny_config(tmp_path, steps=1))
        cfg["training"].update(local_batch_size=lbs, global_batch_size=8, max_norm=0.0)
        cfg["callbacks"] = [{"class_path": "capture_callbacks.GradCapture",
                             "init_args": {"path": str(tmp_path / f"{name}.pt")}}]
        _fit(tmp_path, cfg, name, capfd)
        grads[name] = torch.load(tmp_path / f"{name}.pt")
    assert grads["accum"].keys() == grads["big"].keys() and len(grads["big"]) > 10
    for n, g in grads["big"].items():
        torch.testing.assert_close(grads["accum"][n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_deterministic_runs_are_bitwise_identical(tmp_path, capfd):
    runs = []
    for name in ("a", "b"):
        cfg = tiny_config(tmp_path, steps=3)
        cfg["training"]["deterministic"] = True
        rec = tmp_path / f"{name}.jsonl"
        cfg["callbacks"] = [{"class_path": "capture_callbacks.StepRecorder", "init_args": {"path": str(rec)}}]
        _fit(tmp_path, cfg, name, capfd)
        runs.append([json.loads(line) for line in rec.read_text().splitlines()])
    assert len(runs[0]) == 3
    assert [r["loss_hex"] for r in runs[0]] == [r["loss_hex"] for r in runs[1]]
    assert [r["first_tokens"] for r in runs[0]] == [r["first_tokens"] for r in runs[1]]


def test_trainer_batch_limits_count_optimizer_steps(tmp_path, capfd):
    """Lightning's batch limits count optimizer steps (a batch is a whole step), so a stop can no longer
    fall inside an accumulation window: ``limit_train_batches: 3`` with A = 2 trains 3 whole steps,
    and the final checkpoint's data position is the end of the last of them (3 · 4 samples)."""
    cfg = tiny_config(tmp_path, steps=10)           # local batch 2, global 4: A = 2
    cfg["checkpoint"]["enable_save"] = True
    cfg["trainer"] = {"max_epochs": 1, "limit_train_batches": 3}
    proc = cli_in_process(["fit", "--config", str(write_config(tmp_path, cfg))], capfd, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    common = json.loads((tmp_path / "ckpt" / "iteration_00000003" / "common.json").read_text())
    state = common["trainer_state"]
    assert state["global_step"] == 3 and common["consumed_samples"] == 12
    assert state["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"consumed_samples": 12}]


class _CountHooks(L.Callback):
    """Which micro-batches (their first token) each optimizer step trained on, and how often the
    per-step and per-micro-batch hooks fire."""

    def __init__(self):
        self.steps, self.micro, self.backwards, self.batch_ends, self.epochs = [], [], 0, 0, []

    def on_train_start(self, trainer, pl_module):
        pl_module.model.register_forward_pre_hook(
            lambda mod, args, kwargs: self.micro.append(int(kwargs["input_ids"][0, 0])), with_kwargs=True)

    def on_after_backward(self, trainer, pl_module):
        self.backwards += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batch_ends += 1
        assert pl_module.step_metrics.step == trainer.global_step == self.batch_ends
        self.epochs.append(trainer.current_epoch)
        self.steps.append(self.micro)
        self.micro = []


def test_on_train_batch_end_fires_once_per_optimizer_step_and_steps_span_epochs(tmp_path, one_process_strategy):
    """A = 3 micro-batches per step from an epoch of 8: ``training_step`` is one optimizer step, so the
    per-step hook fires once per step (after 3 backward passes), and a step whose epoch ran out goes on
    with the first micro-batches of the next epoch, as micro-batch-per-call training did (the
    DataModule forms the steps)."""
    import numpy as np

    from lit_moe.config import TrainDatasetConfig
    from lit_moe.data import MegatronDataModule
    from test_callbacks_module import SEQ, VOCAB, tiny_module

    module = tiny_module(steps=4)
    ids = np.arange(8)[:, None].repeat(SEQ + 1, axis=1) % VOCAB          # sample k is all token k
    data = MegatronDataModule(TrainDatasetConfig(**tiny_config(tmp_path)["train_dataset"]), local_batch_size=1,
                              seed=42, accumulation_steps=3)
    data.datasets = ([{"input_ids": r[:-1], "labels": r[1:]} for r in ids], None, None)
    hooks = _CountHooks()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=one_process_strategy(), max_steps=4,
                        max_epochs=-1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                        callbacks=[hooks])
    trainer.fit(module, data)
    assert hooks.batch_ends == 4 and hooks.backwards == 12
    assert hooks.steps == [[0, 1, 2], [3, 4, 5], [6, 7, 0], [1, 2, 3]]
    assert hooks.epochs == [0, 0, 1, 1] and data.consumed_samples == 12


def test_one_real_step_is_the_hand_computed_clipped_adamw_update(one_process_strategy):
    """The module's step (A = 2: gradients of objective / A summed, global-norm clipping, AdamW with its
    parameter groups, the LR schedule) against the update written out by hand from plain autograd."""
    from torch.distributed.tensor import DTensor

    from lit_moe.model import DeepseekV3ForCausalLM
    from lit_moe.step import GradientObserver
    from test_callbacks_module import loader, tiny_module

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    peak, max_norm, eps, (b1, b2) = 1e-2, 0.05, 1e-8, (0.9, 0.95)

    class Before(GradientObserver):
        def on_gradients_before_clip(self, trainer, pl_module, grad_norm):
            opt = trainer.optimizers[0]
            group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
            self.state = {n: (full(p), full(p.grad), group_of[id(p)]["weight_decay"], group_of[id(p)]["lr"])
                          for n, p in pl_module.model.named_parameters()}
            self.norm = float(grad_norm)

    module = tiny_module(steps=4)
    module.training_config.max_norm = max_norm
    module.lr_scheduler_section = {"type": "CosineWithWarmUpLR", "learning_rate": peak, "warmup_steps": 0,
                                   "lr_end": 0.0}
    module.optimizer_section = {"type": "AdamW", "betas": [b1, b2], "eps": eps, "weight_decay": 0.1}
    before = Before()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=one_process_strategy(), max_steps=1, max_epochs=-1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                        callbacks=[before])
    data = loader(steps=1)
    trainer.fit(module, data)
    after = {n: full(p) for n, p in module.model.named_parameters()}

    # gradients by plain autograd: the same initial weights, sum over the 2 micro-batches of objective / 2
    ref = DeepseekV3ForCausalLM(module.model_config)
    ref.init_weights(module.training_config.seed)
    for batch in next(iter(data)):
        out = ref(**batch)
        ((out.loss + out.aux_loss + out.mtp_loss) / 2).backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    assert grads.keys() == before.state.keys() and len(grads) > 20
    norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values()))
    assert before.norm == pytest.approx(float(norm), rel=1e-5)
    coef = min(1.0, max_norm / (float(norm) + 1e-6))
    assert coef < 0.5                                                 # clipping really acts
    decays = set()
    for n, (p0, g, wd, lr) in before.state.items():
        torch.testing.assert_close(g, grads[n], rtol=1e-4, atol=1e-7, msg=n)
        assert lr == peak                                             # cosine at step 0, no warm-up
        decays.add(wd)
        g = grads[n].double() * coef
        # AdamW's first step: m̂ = g, v̂ = g², so the update is lr·g/(|g| + eps), after decoupled decay
        expected = p0.double() * (1 - lr * wd) - lr * g / (g.abs() + eps)
        torch.testing.assert_close(after[n].double(), expected, rtol=1e-5, atol=1e-8, msg=n)
    assert decays == {0.0, 0.1}                                       # both parameter groups present
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 1  # the schedule stepped once
