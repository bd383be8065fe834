"""Runs survive relaunch, preemption, crashes and changed settings, through the real ``lit_moe fit``
CLI in fresh processes (CPU, deterministic, tiny model).

One chain of launches on one ``save_path`` (shared by the tests below through a module fixture):

1. the reference: 6 steps straight (another save_path);
2. SIGTERM in the middle of step 3 (micro-batch 1 of 2) → exit 143, a checkpoint of step 3;
3. the same command again: auto-resumes from step 3 ("resuming from …/iteration_00000003, step 3"),
   saves step 4, is SIGKILLed at the start of step 5 (a crash);
4. the same command again: resumes from step 4 and finishes step 6;
5. (on a copy of the finished run, inside the test process) the same command again: "already
   finished", exit 0, no file written or touched (checksums); a changed schedule.

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
    import shutil

    out["snapshot"] = tmp_path_factory.mktemp("snapshot") / "ckpt"  # the finished 6-step run, for copies
    shutil.copytree(root / "ckpt", out["snapshot"])
    return out


def test_sigterm_mid_step_saves_that_step_and_exits_143(chain):
    proc = chain["sigterm"]
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert "received SIGTERM: stopping after the optimizer step in flight" in proc.stderr
    assert "stopped by SIGTERM after step 3" in proc.stderr
    assert chain["tracker_after_sigterm"] == "3"
    assert "iteration_00000003" in chain["after_sigterm"] and "Traceback" not in proc.stderr


def test_sigterm_during_the_peak_probe_stops_at_once_with_143(tmp_path):
    """A SIGTERM that arrives while the run starts (here: as the MFU peak probe begins, after
    Lightning's handlers exist) is obeyed at once: exit 143, nothing saved (Lightning alone would
    have run to the end of the epoch and exited 0)."""
    cfg = config(tmp_path, "startup.yaml", callbacks=[("SignalDuringPeakProbe", {"flops_per_token": 1.0e6})])
    proc = fit(tmp_path, cfg)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert "received SIGTERM while the run starts: stopping now" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not list((tmp_path / "ckpt").glob("iteration_*"))


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


def test_relaunch_of_a_finished_run_writes_nothing(chain, tmp_path, capfd):
    """The finished run's command again, on a copy of its save_path (inside this process: what the run
    does, not a fresh interpreter, is the point)."""
    _copy_run(chain, tmp_path)
    again = config(tmp_path, "run.yaml")
    before = checksums(tmp_path)
    proc = helpers.cli_in_process(["fit", "--config", str(again), *FLAGS], capfd, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "already finished" in proc.stderr and "step 6" in proc.stderr
    assert before == checksums(tmp_path)  # every file under the run's directory; a new one (TensorBoard) too


CHANGED = {"lr_scheduler": {"learning_rate": 6.0e-3, "lr_end": 1.0e-4, "warmup_ratio": 0.0},
           "optimizer": {"betas": [0.8, 0.9], "eps": 1.0e-6, "weight_decay": 0.05}}


def test_changed_schedule_is_an_error_unless_overridden(chain, tmp_path, capfd):
    """The finished 6-step run continued to 8 steps with a new peak, lr_end, warm-up, betas, eps and weight
    decay: without override_schedule one line lists every difference; with it, steps 7 and 8 use the new
    cosine evaluated at the restored step (hand-computed) and the new optimizer hyperparameters. On a
    copy of the finished run, inside this process."""
    import math

    def fit(root: Path, cfg: Path):
        return helpers.cli_in_process(["fit", "--config", str(cfg), *FLAGS], capfd, cwd=root)

    root = tmp_path
    _copy_run(chain, root)
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


# ----------------------------------------------------------------------------------------------
# bad inputs fail at start, each with one line (in-process CLI: the same code path, no launch cost)
# ----------------------------------------------------------------------------------------------
def _one_line(tmp_path: Path, capsys, cfg_path: Path, *extra: str) -> str:
    from lit_moe.cli import main

    code = main(["fit", "--config", str(cfg_path), *FLAGS, *extra])
    err = capsys.readouterr().err.strip().splitlines()
    lines = [ln for ln in err if ln.startswith("lit_moe: error")]
    assert code == 2 and len(lines) == 1, err[-20:]
    return lines[0]


def _copy_run(chain, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(chain["snapshot"], tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _rewrite_common(it: Path, edit) -> None:
    from lit_moe.checkpoint.iteration import dump_common

    common = json.loads((it / "common.json").read_text())
    edit(common)
    (it / "common.json").write_text(dump_common(common))


def test_bad_inputs_each_get_one_line(chain, tmp_path, capsys, monkeypatch):
    from lit_moe.checkpoint import safejson

    (tmp_path / "afile").write_text("x")
    line = _one_line(tmp_path, capsys, config(tmp_path, "a.yaml", checkpoint={"save_path": str(tmp_path / "afile/ck")}))
    assert "checkpoint.save_path" in line and "afile" in line and "not a directory" in line
    cfg = config(tmp_path, "b.yaml")
    line = _one_line(tmp_path, capsys, cfg, "--monitor.tensorboard.output_dir", str(tmp_path / "afile" / "tb"))
    assert "monitor.tensorboard.output_dir" in line and "afile" in line

    save = _copy_run(chain, tmp_path)
    line = _one_line(tmp_path, capsys, config(tmp_path, "c.yaml", checkpoint={"auto_resume": False}))
    assert "checkpoint.auto_resume: False" in line and str(save) in line
    # resuming from step 4 into a save_path that holds step 6 would overwrite it
    line = _one_line(tmp_path, capsys, config(tmp_path, "d.yaml", checkpoint={"load_path": str(save / "iteration_00000004")}))
    assert "iteration_00000006 of an earlier run" in line and "would be overwritten" in line

    it = save / "iteration_00000006"
    original = (it / "common.json").read_text()
    cases = [
        (lambda c: c["files"].update({"../../escape.safetensors": next(iter(c["files"].values()))}),
         "names '../../escape.safetensors', not a file of"),
        (lambda c: c.pop("files"), "has no list of files"),
        (lambda c: c.update(trainer_state=safejson.encode({k: v for k, v in safejson.decode(c["trainer_state"]).items()
                                                         if k != "loops"})),
         "has no training loop state (loops)"),
    ]
    for edit, words in cases:
        _rewrite_common(it, edit)
        line = _one_line(tmp_path, capsys, config(tmp_path, "e.yaml", steps=8))
        assert words in line and str(it / "common.json") in line, line
        (it / "common.json").write_text(original)

    # 8 data-parallel ranks cannot split the 12 samples consumed by step 3 (a global batch of 16 now)
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = config(tmp_path, "f.yaml", checkpoint={"load_path": str(save / "iteration_00000003"), "save_path":
                                                 str(tmp_path / "other")})
    line = _one_line(tmp_path, capsys, cfg, "--training.global_batch_size", "16")
    assert "saved after 12 samples, which 8 data-parallel ranks cannot split evenly" in line
    monkeypatch.delenv("WORLD_SIZE")


def test_hugging_face_config_that_disagrees_is_one_line(tmp_path, capsys):
    from lit_moe.hf.checkpoint import hf_config_dict
    from lit_moe.model import DeepseekV3Config

    cfg = helpers.tiny_config(tmp_path)
    other = DeepseekV3Config(**{**cfg["model"], "hidden_size": 96})
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(hf_config_dict(other)))
    (hf / "model.safetensors").write_bytes(b"")
    line = _one_line(tmp_path, capsys, config(tmp_path, "hf.yaml", checkpoint={"load_path": str(hf),
                                                                               "no_load_optim": True}))
    assert f"{hf / 'config.json'} has hidden_size 96 but model.hidden_size gives 64" in line


def test_interrupted_resave_and_tracker_are_recovered_at_start(chain, tmp_path, capsys):
    from lit_moe.cli import main

    save = _copy_run(chain, tmp_path)
    # killed between moving iteration_6 aside and putting its replacement in place
    os.replace(save / "iteration_00000006", save / ".iteration_00000006.old.4242")
    assert main(["fit", "--config", str(config(tmp_path, "r.yaml")), *FLAGS]) == 0
    err = capsys.readouterr().err
    assert "recovered" in err and "iteration_00000006 from .iteration_00000006.old.4242" in err
    assert "already finished" in err and (save / "iteration_00000006" / "common.json").is_file()
    assert not list(save.glob(".iteration_*"))
    # killed between renaming iteration_6 into place and replacing the tracker
    (save / "latest_checkpointed_iteration.txt").write_text("4\n")
    assert main(["fit", "--config", str(config(tmp_path, "r.yaml")), *FLAGS]) == 0
    err = capsys.readouterr().err
    assert "set to step 6" in err and "already finished" in err and tracker(save) == "6"


# ----------------------------------------------------------------------------------------------
# saves that fail or are killed
# ----------------------------------------------------------------------------------------------
def test_async_write_error_reaches_the_user_and_leaves_no_debris(tmp_path):
    proc = fit(tmp_path, config(tmp_path, "full.yaml", checkpoint={"async_save": True},
                                callbacks=[("FailWrites", {"step": 4})]))
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("lit_moe: error")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "iteration_00000004 failed: rank 0: OSError: [Errno 28] No space left on device" in errors[0]
    save = tmp_path / "ckpt"
    assert tracker(save) == "2" and not list(save.glob(".iteration_*")) and not (save / "iteration_00000004").exists()


def test_kill_during_async_save_then_relaunch_continues(chain, tmp_path):
    import subprocess
    import time

    marker = tmp_path / "stalled.txt"
    cfg = config(tmp_path, "run.yaml", checkpoint={"async_save": True},
                 callbacks=[("StallWrites", {"step": 4, "marker": str(marker)})])
    env = helpers.child_env(TESTS, PYTHONWARNINGS="ignore")
    proc = subprocess.Popen([sys.executable, "-m", "lit_moe.cli", "fit", "--config", str(cfg), *FLAGS],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + helpers.scaled(240)
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:] if proc.poll() else ""
            time.sleep(0.2)
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    save = tmp_path / "ckpt"
    assert tracker(save) == "2" and (save / ".iteration_00000004.tmp").is_dir()
    again = fit(tmp_path, config(tmp_path, "run.yaml", checkpoint={"async_save": True}))
    assert again.returncode == 0 and "iteration_00000002, step 2" in again.stderr, again.stderr[-3000:]
    got, ref = probe(tmp_path), chain["reference"]
    assert sorted(got) == [1, 2, 3, 4, 5, 6]  # steps 3 and 4 ran again after the kill
    for step in ref:
        assert got[step]["loss"] == ref[step]["loss"], step
    assert tracker(save) == "6" and not list(save.glob(".iteration_*"))


def test_slurm_requeue_signal_requeues_after_the_save(tmp_path, monkeypatch):
    """Under SLURM with Lightning's auto-requeue, the requeue signal (SIGUSR1) runs ``scontrol requeue
    <job>`` once the checkpoint is written, as Lightning's own handler does; SIGTERM does not."""
    from types import SimpleNamespace

    from lightning.fabric.plugins.environments import SLURMEnvironment

    from lit_moe.runtime.preemption import _maybe_requeue

    calls = tmp_path / "calls.txt"
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    trainer = SimpleNamespace(is_global_zero=True,
                              _accelerator_connector=SimpleNamespace(cluster_environment=SLURMEnvironment()))
    _maybe_requeue(trainer, signal.SIGTERM)
    assert not calls.exists()
    _maybe_requeue(trainer, signal.SIGUSR1)
    assert calls.read_text().split() == ["requeue", "4242"]
    trainer._accelerator_connector.cluster_environment = SLURMEnvironment(auto_requeue=False)
    _maybe_requeue(trainer, signal.SIGUSR1)
    assert calls.read_text().split() == ["requeue", "4242"]  # auto_requeue off: nothing more


def test_sigterm_while_the_run_starts_stops_at_once(tmp_path):
    """SIGTERM inside the run's first optimizer step (the slowest; a resumed run's first step too):
    nothing new to save, so the run stops at once, with exit status 143, not after the step (whose
    wait could outlast SLURM's KillWait); no checkpoint directory is written."""
    cfg = config(tmp_path, "start.yaml", steps=50, callbacks=[("SignalAt", {"step": 1, "micro": 0})])
    proc = fit(tmp_path, cfg)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "SIGTERM" in ln]
    assert lines == ["lit_moe: received SIGTERM while the run starts: stopping now (nothing new to save); "
                     "exit status 143"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "step 1/50" not in proc.stdout + proc.stderr
    assert not list((tmp_path / "ckpt").glob("iteration_*"))


@pytest.mark.timeout(400)
def test_signal_on_one_rank_stops_both_without_a_collective_per_step(tmp_path):
    """torchrun, 2 ranks; SIGTERM reaches rank 1 only, in step 3: both ranks stop after step 3 (exit
    143, checkpoint of step 3). The flag rides in the step's metrics all-reduce: no step calls a
    collective from lit_moe's preemption code or Lightning's signal handling (before: a gloo MAX
    all-reduce and Lightning's rank-0 broadcast at every step)."""

    cfg = config(tmp_path, "two.yaml", steps=6, callbacks=[("SignalAt", {"step": 3, "micro": 0, "rank": 1}),
                                                          ("SignalCollectives", {"path": str(tmp_path / "calls")})])
    # the same launch checks the per-layer aux loss that both ranks log (folded in: one launch less)
    raw = helpers.yaml.safe_load(cfg.read_text())
    raw["callbacks"].append({"class_path": "capture_callbacks.MoEAuxRecorder", "init_args": {"path": str(tmp_path / "aux")}})
    cfg.write_text(helpers.yaml.safe_dump(raw))
    env = helpers.child_env(TESTS, PYTHONWARNINGS="ignore")
    proc = helpers.torchrun(2, ["-m", "lit_moe.cli", "fit", "--config", str(cfg), *FLAGS, "--trainer.accelerator", "cpu"],
                            cwd=tmp_path, env=env, timeout=360)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "stopped by SIGTERM after step 3" in log, log[-4000:]
    assert (tmp_path / "ckpt" / "iteration_00000003").is_dir()
    for rank in (0, 1):
        rows = [json.loads(line) for line in (tmp_path / f"calls.rank{rank}").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3], rows
        assert all(r["calls"] == [] for r in rows), rows
    _aux_loss_is_averaged_over_data_parallel_ranks(tmp_path / "aux")


def _aux_loss_is_averaged_over_data_parallel_ranks(rec: Path) -> None:
    """dp2: the per-layer ``moe.aux_loss`` both ranks log (step 1) is the mean of the two ranks' own
    values (from test_strategy_launch, where it had a launch of its own)."""
    import torch

    rows = [json.loads(Path(f"{rec}.rank{r}").read_text().splitlines()[0]) for r in (0, 1)]
    own = [sum(torch.tensor(r["micro"], dtype=torch.float64)) / len(r["micro"]) for r in rows]
    assert not torch.allclose(own[0], own[1])          # the ranks saw different data
    want = (own[0] + own[1]) / 2 / rows[0]["coeff"]
    for r in rows:
        torch.testing.assert_close(torch.tensor(r["logged"], dtype=torch.float64), want, rtol=1e-6, atol=0)


@pytest.mark.timeout(400)
def test_a_save_slower_than_the_collective_timeout_completes(tmp_path):
    """torchrun, 2 ranks, ``process_group_timeout_s: 6``; rank 1 takes 1.2× the timeout to write its files (0.6× before each of its two tensor files; 6 s scaled by the load).
    Rank 0 waits for it for the timeout plus the checkpoint's bytes at the granted write rate (here
    1 kB/s, so ~2 MB gives ample time) instead of failing the save after 6 s."""

    # the start-up rendezvous waits longer (STARTUP_RENDEZVOUS); the timeout covers the ranks' skew
    # between two collectives: 6 s on a quiet machine, stretched on a busy one, and the slow writer with
    # it (0.6 of the timeout before each of its two files)
    timeout_s = round(helpers.scaled(6))
    cfg_path = config(tmp_path, "slow.yaml", steps=2,
                      callbacks=[("SlowWriter", {"rank": 1, "seconds": 0.6 * timeout_s, "floor": 1000.0})])
    cfg = helpers.yaml.safe_load(cfg_path.read_text())
    cfg["parallelism"] = {"process_group_timeout_s": timeout_s}
    cfg_path.write_text(helpers.yaml.safe_dump(cfg))
    env = helpers.child_env(TESTS, PYTHONWARNINGS="ignore")
    proc = helpers.torchrun(2, ["-m", "lit_moe.cli", "fit", "--config", str(cfg_path), *FLAGS,
                                "--trainer.accelerator", "cpu"], cwd=tmp_path, env=env, timeout=360)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert tracker(tmp_path / "ckpt") == "2"


def test_a_failed_fit_leaves_the_callers_sigterm_handler_in_charge(tmp_path):
    """A fit that raises must not leave the run's preemption handler acting: Lightning's exception-path
    teardown re-installs the handlers it found (ours) after our teardown restored the caller's. A
    process that goes on (a test session, a notebook, a pool forked from it) then got "stopping now"
    and a SystemExit on SIGTERM: the stop-36 CI hang."""
    import torch
    from lightning.pytorch import LightningModule, Trainer

    from lit_moe.runtime.preemption import Preemption

    class Fails(LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def training_step(self, batch, batch_idx):
            raise RuntimeError("planned failure")

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.zeros(4, 1))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    got = []
    before = signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    try:
        trainer = Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, callbacks=[Preemption()],
                          default_root_dir=tmp_path)
        with pytest.raises(RuntimeError, match="planned failure"):
            trainer.fit(Fails())
        signal.raise_signal(signal.SIGTERM)  # must reach the caller's handler, not stop a finished run
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)


RELEASE_SCRIPT = """
import os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from lit_moe.runtime.distributed import release_process_groups

def threads():
    return len(os.listdir("/proc/self/task"))

torch.ones(2) @ torch.ones(2)      # start torch's own threads first
before = threads()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "ep"))
dist.all_reduce(torch.ones(4), group=mesh.get_group("ep"))
holder = {"mesh": mesh}
holder["self"] = holder            # a reference cycle, as a finished Trainer leaves behind
during = threads()
del mesh, holder
release_process_groups()
print(before, during, threads())
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc (Linux)")
def test_released_process_groups_leave_no_gloo_thread(tmp_path):
    """``release_process_groups`` (run by ``lit_moe fit`` after the fit and at interpreter exit) joins
    every gloo thread, also of groups that only a reference cycle still holds: a gloo thread that
    outlives the interpreter's start of shutdown aborts the process (SIGABRT after a finished run;
    seen in CI as exit -6 of launched ranks). ``destroy_process_group`` alone leaves the threads of
    groups a device mesh in a cycle holds (measured: 1 -> 4 -> 4 threads; with the release 1 -> 4 -> 1)."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", RELEASE_SCRIPT], capture_output=True, text=True,
                          env=helpers.child_env(), timeout=helpers.scaled(120))
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, during, after = map(int, proc.stdout.split()[-3:])
    assert during > before and after == before, (before, during, after)
