"""Launching (issue 5, points 4–5): ``lit_moe fit`` under torchrun on 2 CPU processes with the
``ascend_fsdp`` strategy, and ``--trainer.devices 2`` (Lightning starts the second process itself)
where one rank dies: the job must end with an error within the process-group timeout, not hang."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lightning.pytorch import Callback

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import ROOT, tiny_config, write_config  # noqa: E402

STEP = re.compile(r"step (\d+)/(\d+) \| loss ([0-9.]+)")


class DieOnRankOne(Callback):
    """At optimizer step ``at`` global rank 1 dies (``exit``: no clean-up, like a crashed host) or
    stops answering (``hang``: sleeps, like a stuck device)."""

    def __init__(self, at: int = 1, how: str = "exit"):
        self.at, self.how = at, how

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step >= self.at:
            if self.how == "hang":
                time.sleep(3600)
            os._exit(13)


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # In-process Trainer tests leave Lightning's MASTER_PORT etc. in os.environ: launches pick their own.
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.timeout(300)
def test_torchrun_two_processes_tensor_and_expert_parallel(tmp_path):
    cfg = tiny_config(tmp_path, steps=2, parallelism={"tensor_parallel": 2, "expert_parallel": 2})
    cfg["model"]["compute_dtype"] = "float32"
    path = write_config(tmp_path, cfg)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "lit_moe.cli", "fit", "--config", str(path), "--trainer.accelerator", "cpu"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    steps = [m.groups() for m in STEP.finditer(log)]
    assert [s[0] for s in steps] == ["1", "2"], log[-3000:]
    # the same run in one process without parallelism (fp32): the same losses
    del cfg["parallelism"]
    single = subprocess.run([sys.executable, "-m", "lit_moe.cli", "fit", "--config",
                             str(write_config(tmp_path, cfg, "single.yaml")), "--trainer.accelerator", "cpu"],
                            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert single.returncode == 0, single.stderr[-4000:]
    ref = [m.groups() for m in STEP.finditer(single.stdout + single.stderr)]
    assert [s[0] for s in ref] == ["1", "2"]
    for (_, _, loss), (_, _, want) in zip(steps, ref):
        assert abs(float(loss) - float(want)) <= 1e-4 * float(want), (steps, ref)
    assert ref[0][2] != ref[1][2]                     # the model trained between the two steps


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["hang"])
def test_devices_two_and_a_stuck_rank_ends_the_job(tmp_path, how):
    """Rank 1 stops answering after step 1; rank 0's next collective times out after
    ``parallelism.process_group_timeout_s`` and the run ends with an error (the default 30-minute
    torch timeout would look like a hang)."""
    timeout_s = 30   # also bounds the start-up rendezvous: room for the second process to import
    cfg = tiny_config(tmp_path, steps=50, parallelism={"expert_parallel": 2, "process_group_timeout_s": timeout_s})
    cfg["callbacks"] = [{"class_path": "test_strategy_launch.DieOnRankOne", "init_args": {"at": 1, "how": how}}]
    path = write_config(tmp_path, cfg)
    cmd = [sys.executable, "-m", "lit_moe.cli", "fit", "--config", str(path), "--trainer.devices", "2",
           "--trainer.accelerator", "cpu"]
    log_path = tmp_path / "run.log"
    with open(log_path, "w") as log_file:
        # Own session: the stuck rank 1 (started by Lightning, not by us) is cleaned up with the group.
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=240)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    log = log_path.read_text()
    # both processes trained step 1 together (Lightning launched the second one) ...
    assert "step 1/50" in log, log[-4000:]
    # ... then rank 1 stopped answering and rank 0 failed with the collective timeout
    assert code != 0, log[-4000:]
    assert f"{timeout_s * 1000}ms" in log, log[-4000:]
    assert "step 50/50" not in log


@pytest.mark.timeout(300)
def test_layer_aux_loss_is_averaged_over_data_parallel_ranks(tmp_path):
    """dp2: the per-layer ``moe.aux_loss`` both ranks log is the mean of the two ranks' own values."""
    import json

    import torch

    cfg = tiny_config(tmp_path, steps=1)
    cfg["model"]["compute_dtype"] = "float32"
    rec = tmp_path / "aux"
    cfg["callbacks"] = [{"class_path": "capture_callbacks.MoEAuxRecorder", "init_args": {"path": str(rec)}}]
    path = write_config(tmp_path, cfg)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "lit_moe.cli", "fit", "--config", str(path), "--trainer.accelerator", "cpu"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [json.loads((tmp_path / f"aux.rank{r}").read_text().splitlines()[0]) for r in (0, 1)]
    own = [sum(torch.tensor(r["micro"], dtype=torch.float64)) / len(r["micro"]) for r in rows]
    assert not torch.allclose(own[0], own[1])          # the ranks saw different data
    want = (own[0] + own[1]) / 2 / rows[0]["coeff"]
    for r in rows:
        torch.testing.assert_close(torch.tensor(r["logged"], dtype=torch.float64), want, rtol=1e-6, atol=0)
