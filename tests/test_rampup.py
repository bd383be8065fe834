"""Global batch ramp-up (``training.rampup_batch_size: [start, increment, rampup_samples]``).

The rule is MindFormers' (``mindformers/pynative/trainer/dynamic_batch.py``), the one of Megatron-LM's
``RampupBatchsizeNumMicroBatchesCalculator``: before each step the global batch is
``start + increment * int(consumed / (rampup_samples / n))`` (n increments), ``global_batch_size`` once
``consumed > rampup_samples``. Checked against tables computed by hand, against Megatron's calculator
where megatron-core is installed, and through ``lit_moe fit``: per-step samples and micro-batches, a
resume in the middle of the ramp bit-equal to the uninterrupted run, and dp2 / pp2 against one process.
"""

from __future__ import annotations

import copy
import io
import json
import os
import random

import pytest
import yaml

from helpers import ROOT, run_cli, tiny_config, write_config, torchrun
from lit_moe.config import ConfigError, TrainingConfig
from lit_moe.optim.schedules import BatchRamp, batch_ramp

TESTS = str(ROOT / "tests")


# ----------------------------------------------------------------------------------------------
# the schedule
# ----------------------------------------------------------------------------------------------
def test_schedule_matches_the_hand_computed_tables():
    # start 4, +2, over 24 samples to 8 (micro-batch of 2 samples): 2 increments, one every 12 samples.
    #   step:            1  2  3   4   5   6   7
    #   consumed before: 0  4  8  12  18  24  32      (24 is not > 24: int(24 / 12) = 2 → 8)
    #   global batch:    4  4  4   6   6   8   8
    ramp = BatchRamp(4, 2, 24, 8, 2)
    assert (ramp.increments, ramp.samples_per_increment) == (2, 12.0)
    assert [ramp.global_batch_at(c) for c in (0, 4, 8, 11, 12, 18, 23, 24, 25, 32)] == [4, 4, 4, 4, 6, 6, 6, 8, 8, 8]
    assert [ramp.samples_after(s) for s in range(8)] == [0, 4, 8, 12, 18, 24, 32, 40]
    assert [ramp.accumulation_at(ramp.samples_after(s)) for s in range(7)] == [2, 2, 2, 3, 3, 4, 4]
    assert ramp.stretches(7) == [(0, 4, 0), (3, 6, 12), (5, 8, 24)]
    assert ramp.stretches(2) == [(0, 4, 0)]
    assert ramp.levels() == [4, 6, 8]
    # a fractional interval: start 2, +2, 10 samples to 8: 3 increments, one every 10/3 samples
    #   consumed before: 0 → 2 (int(0.6) = 0) → 4 (int(1.2) = 1: 4) → 8 (int(2.4) = 2: 6) → 14 (> 10: 8)
    ramp = BatchRamp(2, 2, 10, 8, 2)
    assert [ramp.global_batch_at(ramp.samples_after(s)) for s in range(6)] == [2, 2, 4, 6, 8, 8]
    assert [ramp.samples_after(s) for s in range(6)] == [0, 2, 4, 8, 14, 22]
    # nothing to ramp: rampup_samples 0, or start = global_batch_size
    assert {BatchRamp(2, 2, 0, 8, 2).global_batch_at(c) for c in range(0, 20)} == {8}
    assert BatchRamp(8, 2, 100, 8, 2).stretches(5) == [(0, 8, 0)]
    assert BatchRamp(8, 2, 100, 8, 2).samples_after(5) == 40


def test_schedule_equals_megatrons_calculator():
    """Megatron-LM's calculator (megatron-core) at every consumed count of random ramps: the same global
    batch and micro-batches per step (Megatron divides by zero without increments or ramp samples,
    where MindFormers, and we, keep global_batch_size)."""
    calc_mod = pytest.importorskip("megatron.core.num_microbatches_calculator")
    rng = random.Random(0)
    for _ in range(200):
        micro, dp = rng.choice([1, 2, 4]), rng.choice([1, 2, 3])
        base = micro * dp
        start, inc, n = base * rng.randint(1, 6), base * rng.randint(1, 4), rng.randint(1, 7)
        top, samples = start + n * inc, rng.randint(1, 500)
        ramp = BatchRamp(start, inc, samples, top, base)
        calc = calc_mod.RampupBatchsizeNumMicroBatchesCalculator(top, micro, dp, False, 1, start, inc, samples)
        consumed = 0
        for _ in range(60):
            calc.update(consumed, consistency_check=True)
            assert ramp.global_batch_at(consumed) == calc.get_current_global_batch_size(), (ramp, consumed)
            assert ramp.accumulation_at(consumed) == calc.get(), (ramp, consumed)
            consumed += calc.get_current_global_batch_size()


def test_samples_after_replays_the_step_rule():
    """``samples_after`` (jumping whole stretches) against the step-by-step recurrence."""
    rng = random.Random(1)
    for _ in range(300):
        base = rng.choice([1, 2, 3])
        start, inc, n = base * rng.randint(1, 5), base * rng.randint(1, 4), rng.randint(0, 6)
        ramp = BatchRamp(start, inc, rng.randint(0, 400), start + n * inc, base)
        consumed = [0]
        for _ in range(150):
            consumed.append(consumed[-1] + ramp.global_batch_at(consumed[-1]))
        assert [ramp.samples_after(s) for s in range(151)] == consumed, ramp


@pytest.mark.parametrize("value,words", [
    ([4, 2], ["training.rampup_batch_size", "list of 3 integers"]),
    ([0, 2, 8], ["training.rampup_batch_size[0]", "> 0"]),
    ([4, 2, -1], ["training.rampup_batch_size[2]", ">= 0"]),
    ([4, 3, 8], ["training.rampup_batch_size[1]", "multiple of increment 3"]),
    ([2, 1, 8], ["batch size 3 is not divisible", "local_batch_size(2) = 2"]),
])
def test_bad_ramps_are_one_line_naming_the_key(value, words):
    with pytest.raises(ConfigError) as err:
        batch_ramp(TrainingConfig(local_batch_size=2, global_batch_size=8, rampup_batch_size=value), 1)
    for word in words:
        assert word in str(err.value)
    assert batch_ramp(TrainingConfig(global_batch_size=8), 1) is None


def test_plan_prints_the_ramp_and_checks_every_level_against_the_pipeline(tmp_path):
    from test_plan import SEED, _tiny_pipeline_model
    from lit_moe.pipeline import PipelineError
    from lit_moe.strategies.plan import plan

    cfg = copy.deepcopy(SEED)
    cfg["model"] = _tiny_pipeline_model()
    cfg["training"].update(global_batch_size=8, local_batch_size=1, steps=10, rampup_batch_size=[2, 2, 12])
    cfg["parallelism"] = {"pipeline_parallel": 2}
    cfg.pop("recompute", None)
    cfg.pop("recompute_comm", None)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    out = io.StringIO()
    plan(str(path), 2, out=out)
    text = out.getvalue()
    # 3 increments, one every 4 samples; consumed before each step: 0, 2 (batch 2) | 4 (4) | 8 (6) | 14 (8)
    assert "global batch ramp-up 2 → 8 by 2 every 4 samples (the first 12); accumulation 2 → 8" in text
    assert ("    from step 1 (after 0 samples): global batch 2, accumulation 2\n"
            "    from step 3 (after 4 samples): global batch 4, accumulation 4\n"
            "    from step 4 (after 8 samples): global batch 6, accumulation 6\n"
            "    from step 5 (after 14 samples): global batch 8, accumulation 8\n") in text
    # a first level of one micro-batch cannot fill the two-stage 1f1b schedule
    cfg["training"]["rampup_batch_size"] = [1, 1, 12]
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    with pytest.raises(PipelineError) as err:
        plan(str(path), 2, out=io.StringIO())
    assert str(err.value).startswith("training.rampup_batch_size 1 gives 1 micro-batches per step")


# ----------------------------------------------------------------------------------------------
# through lit_moe fit
# ----------------------------------------------------------------------------------------------
# Start 4, +2, 20 samples to 8: 2 increments, one every 10 samples.
#   step:            1  2  3   4   5   6   7
#   consumed before: 0  4  8  12  18  24  32      (int(12 / 10) = int(18 / 10) = 1; 24 > 20)
#   global batch:    4  4  4   6   6   8   8
# An epoch of 10 samples (5 micro-batches of 2): steps 3, 5 and 6 straddle an epoch's end (they begin
# with its last micro-batches); the batch of step 5 is read after 18 samples (20 with the epoch's tail
# counted would give 8).
STEPS = 7
RAMP = [4, 2, 20]
SAMPLES = [4, 8, 12, 18, 24, 32, 40]                # consumed after each step
MICRO_BATCHES = [2, 2, 2, 3, 3, 4, 4]               # of 2 samples (one process, local batch 2)
EPOCH_SAMPLES = 10


def _ramp_config(run_dir, rec, **training) -> dict:
    cfg = tiny_config(run_dir, steps=STEPS, mock_data=False)    # the shipped corpus: 11 samples, epochs of 10
    cfg["train_dataset"]["dataloader"]["sizes"] = [EPOCH_SAMPLES, 0, 0]
    cfg["model"]["vocab_size"] = 4096   # the corpus' tokenizer
    cfg["model"]["compute_dtype"] = "float32"
    cfg["training"].update(deterministic=True, local_batch_size=2, global_batch_size=8, rampup_batch_size=RAMP,
                           **training)
    cfg["callbacks"] = [{"class_path": "capture_callbacks.StepRecorder", "init_args": {"path": str(rec)}}]
    return cfg


def _rows(rec) -> list[dict]:
    return [json.loads(line) for line in rec.read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One process, the ramp over 7 steps, a checkpoint after every step."""
    run_dir = tmp_path_factory.mktemp("ramp_one")
    rec = run_dir / "rec.jsonl"
    cfg = _ramp_config(run_dir, rec)
    cfg["checkpoint"].update(enable_save=True, save_interleaved_steps=1, save_max=10)
    proc = run_cli(["fit", "--config", str(write_config(run_dir, cfg))], cwd=run_dir, timeout=600,
                   env={"PYTHONPATH": TESTS})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, _rows(rec), proc.stdout + proc.stderr


@pytest.mark.timeout(900)
def test_cli_ramp_samples_per_step_are_the_hand_computed_ones(uninterrupted):
    run_dir, rows, log = uninterrupted
    assert [r["consumed_samples"] for r in rows] == SAMPLES
    assert [r["micro_batches"] for r in rows] == MICRO_BATCHES
    assert "global batch ramp-up 4 → 8 by 2 every 10 samples (the first 20); accumulation 2 → 4; " \
           "this step 4 (after 0 samples)" in log
    common = json.loads((run_dir / "ckpt" / "iteration_00000004" / "common.json").read_text())
    assert common["consumed_samples"] == 18


@pytest.mark.timeout(900)
@pytest.mark.parametrize("iteration, line", [(3, "this step 6 (after 12 samples)"),
                                             (4, "this step 6 (after 18 samples)")])
def test_cli_resume_in_the_middle_of_the_ramp_is_bit_equal(uninterrupted, tmp_path, iteration, line):
    """From the step-3 checkpoint (12 samples: the batch grows to 6 with the next step; steps 4-7 take
    6, 6, 8, 8, steps 5 and 6 straddle an epoch's end) and from the step-4 one (18 samples: 2 left in the
    epoch, fewer than the next step takes, so the resumed run's first step is that tail and the next
    epoch's first micro-batches) the resumed run trains what the uninterrupted one did, bit for bit, one
    recorded row per step (the DataModule delivers whole steps; before, a call there finished no step
    and crashed the throughput callback on a fresh resume)."""
    run_dir, rows, _ = uninterrupted
    rec = tmp_path / "rec.jsonl"
    cfg = _ramp_config(tmp_path, rec)
    cfg["checkpoint"].update(load_path=str(run_dir / "ckpt" / f"iteration_{iteration:08d}"))
    proc = run_cli(["fit", "--config", str(write_config(tmp_path, cfg))], cwd=tmp_path, timeout=600,
                   env={"PYTHONPATH": TESTS})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert line in proc.stdout + proc.stderr
    keys = ("step", "loss_hex", "consumed_samples", "micro_batches", "lr")
    assert [{k: r[k] for k in keys} for r in _rows(rec)] == [{k: r[k] for k in keys} for r in rows[iteration:]]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_cli_ramp_under_dp2_and_pp2_matches_one_process(uninterrupted, tmp_path, layout):
    """Two processes under torchrun: data parallel (local batch 1, so a micro-batch of both ranks is the
    one process's micro-batch of 2) and a two-stage 1f1b pipeline (its micro-batch count changes with
    the batch); the same samples, micro-batches and losses per step as one process."""
    _, reference, _ = uninterrupted
    rec = tmp_path / "rec.jsonl"
    cfg = _ramp_config(tmp_path, rec)
    if layout == "dp2":
        cfg["training"]["local_batch_size"] = 1
    else:
        cfg["parallelism"].update(pipeline_parallel=2, pipeline_parallel_schedule="1f1b")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), TESTS, os.environ.get("PYTHONPATH", "")]))
    proc = torchrun(2, ["-m", "lit_moe.cli", "fit", "--config", str(write_config(tmp_path, cfg)),
                        "--trainer.accelerator", "cpu"], cwd=tmp_path, env=env, timeout=800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = _rows(rec)
    assert [r["consumed_samples"] for r in rows] == SAMPLES
    assert [r["micro_batches"] for r in rows] == MICRO_BATCHES   # dp2: one sample per rank and micro-batch
    assert [r["first_tokens"] for r in rows] == [r["first_tokens"] for r in reference]
    losses = [r["loss"] for r in rows]
    # float32, reduction orders differ only (measured: relative 8.3e-8 dp2, 1.4e-7 pp2)
    assert losses == pytest.approx([r["loss"] for r in reference], rel=1e-6), losses
