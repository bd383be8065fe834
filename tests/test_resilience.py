"""Runs survive relaunch, preemption, crashes and changed settings, through the real ``lit_moe fit``
CLI in fresh processes (CPU, deterministic, tiny model).

One chain of launches on one ``save_path`` (shared by the tests below through a module fixture):

1. the reference: 6 steps straight (another save_path);
2. SIGTERM in the middle of step 3 (micro-batch 1 of 2) → exit 143, a checkpoint of step 3;
3. the same command again: auto-resumes from step 3 ("resuming from …/iteration_00000003, step 3"),
   saves step 4, is SIGKILLed at the start of step 5 (a crash);
4. the same command again: resumes from step 4 and finishes step 6;
5. the same command again: "already finished", exit 0, no file written or touched (checksums).

Steps 1..6 of 2-4 together have the reference's losses and learning rates bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

import helpers  # noqa: E402

ENV = {"PYTHONPATH": str(TESTS), "PYTHONWARNINGS": "ignore"}
FLAGS = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def config(tmp_path: Path, name: str, *, steps: int = 6, checkpoint: dict | None = None, callbacks=(),
           lr_scheduler: dict | None = None, optimizer: dict | None = None) -> Path:
    cfg = helpers.tiny_config(tmp_path, steps=steps)
    cfg["training"]["deterministic"] = True
    cfg["model"].update(compute_dtype="float32")
    cfg["checkpoint"] = {**cfg["checkpoint"], "enable_save": True, "save_path": str(tmp_path / "ckpt"),
                         "save_interleaved_steps": 2, **(checkpoint or {})}
    if lr_scheduler:
        cfg["lr_scheduler"] = {**cfg["lr_scheduler"], **lr_scheduler}
    if optimizer:
        cfg["optimizer"] = {**cfg["optimizer"], **optimizer}
    cfg["callbacks"] = [{"class_path": f"fault_callbacks.{cls}", "init_args": args} for cls, args in
                        [("LossProbe", {"path": str(tmp_path / "probe.jsonl")}), *callbacks]]
    return helpers.write_config(tmp_path, cfg, name)


def fit(tmp_path: Path, cfg: Path, *extra: str, timeout: float = 300):
    return helpers.run_cli(["fit", "--config", str(cfg), *FLAGS, *extra], cwd=tmp_path, timeout=timeout, env=ENV)


def probe(tmp_path: Path) -> dict[int, dict]:
    path = tmp_path / "probe.jsonl"
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())} if path.exists() else {}


def checksums(root: Path) -> dict[str, tuple[str, int]]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(root))] = (hashlib.sha1(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
    return out


def tracker(save: Path) -> str:
    return (save / "latest_checkpointed_iteration.txt").read_text().strip()


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    ref_dir = tmp_path_factory.mktemp("reference")
    ref = fit(ref_dir, config(ref_dir, "ref.yaml"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    root = tmp_path_factory.mktemp("chain")
    out = {"reference": probe(ref_dir), "root": root}
    signalled = fit(root, config(root, "run.yaml", callbacks=[("SignalAt", {"step": 3, "micro": 1})]))
    out["sigterm"] = signalled
    out["after_sigterm"] = sorted(os.listdir(root / "ckpt"))
    out["tracker_after_sigterm"] = tracker(root / "ckpt")
    crashed = fit(root, config(root, "run.yaml", callbacks=[("KillAt", {"step": 5})]))
    out["crash"] = crashed
    out["tracker_after_crash"] = tracker(root / "ckpt")
    out["resumed"] = fit(root, config(root, "run.yaml"))
    out["probe"] = probe(root)
    again = config(root, "run.yaml")
    before = checksums(root)
    out["finished"] = fit(root, again)
    out["unchanged"] = before == checksums(root)
    return out


def test_sigterm_mid_step_saves_that_step_and_exits_143(chain):
    proc = chain["sigterm"]
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert "received SIGTERM: stopping after the optimizer step in flight" in proc.stderr
    assert "stopped by SIGTERM after step 3" in proc.stderr
    assert chain["tracker_after_sigterm"] == "3"
    assert "iteration_00000003" in chain["after_sigterm"] and "Traceback" not in proc.stderr


def test_relaunch_auto_resumes_and_continues_bit_for_bit(chain):
    crash, resumed = chain["crash"], chain["resumed"]
    assert "resuming from" in crash.stderr and "iteration_00000003, step 3" in crash.stderr, crash.stderr[-2000:]
    assert crash.returncode == -signal.SIGKILL and chain["tracker_after_crash"] == "4"
    assert "iteration_00000004, step 4" in resumed.stderr and resumed.returncode == 0, resumed.stderr[-3000:]
    ref, got = chain["reference"], chain["probe"]
    assert sorted(ref) == sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in ref:
        assert (got[step]["loss"], got[step]["lr"]) == (ref[step]["loss"], ref[step]["lr"]), step
    assert len({r["loss"] for r in ref.values()}) == 6  # the losses move: equality means something


def test_relaunch_of_a_finished_run_writes_nothing(chain):
    proc = chain["finished"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "already finished" in proc.stderr and "step 6" in proc.stderr
    assert chain["unchanged"]  # every file under the run's directory: checkpoints, tracker, TensorBoard


CHANGED = {"lr_scheduler": {"learning_rate": 6.0e-3, "lr_end": 1.0e-4, "warmup_ratio": 0.0},
           "optimizer": {"betas": [0.8, 0.9], "eps": 1.0e-6, "weight_decay": 0.05}}


def test_changed_schedule_is_an_error_unless_overridden(chain):
    """The finished 6-step run continued to 8 steps with a new peak, lr_end, warm-up, betas, eps and weight
    decay: without override_schedule one line lists every difference; with it, steps 7 and 8 use the new
    cosine evaluated at the restored step (hand-computed) and the new optimizer hyperparameters."""
    import math

    root = chain["root"]
    refused = fit(root, config(root, "longer.yaml", steps=8, **CHANGED))
    assert refused.returncode == 2, refused.stderr[-2000:]
    line = [ln for ln in refused.stderr.splitlines() if "error" in ln]
    assert len(line) == 1 and "Traceback" not in refused.stderr
    for field in ("lr_scheduler.learning_rate 0.003 → 0.006", "lr_scheduler.lr_end 0.0003 → 0.0001",
                  "training.steps 6 → 8", "optimizer.betas",
                  "optimizer.eps", "optimizer.weight_decay 0.01 → 0.05", "override_schedule"):
        assert field in line[0], (field, line[0])
    assert tracker(root / "ckpt") == "6"

    go = fit(root, config(root, "override.yaml", steps=8, checkpoint={"override_schedule": True}, **CHANGED))
    assert go.returncode == 0, go.stderr[-3000:]
    assert go.stderr.count("override_schedule: from step 6") == 1
    got = probe(root)
    assert sorted(s for s in got if s > 6) == [7, 8]
    for step in (7, 8):  # update index step-1 of a cosine without warm-up over 8 steps
        t = step - 1
        expected = 1.0e-4 + (6.0e-3 - 1.0e-4) * 0.5 * (1 + math.cos(math.pi * t / 8))
        assert float(got[step]["lr"]) == pytest.approx(expected, rel=1e-12), step
        assert got[step]["betas"] == [0.8, 0.9] and got[step]["eps"] == 1.0e-6
        assert got[step]["weight_decay"] == [0.0, 0.05]
    assert chain["probe"][6]["betas"] == [0.9, 0.95]  # the saved run really had other settings
