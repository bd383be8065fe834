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
from helpers import ROOT, child_env, cli_in_process, retry_on_port_clash, scaled, tiny_config, write_config  # noqa: E402

STEP = re.compile(r"step (\d+)/(\d+) \| loss ([0-9.]+)")


class DieOnRankOne(Callback):
    """At optimizer step ``at`` global rank 1 dies (``exit``: no clean-up, like a crashed host) or
    stops answering (``hang``: sleeps, like a stuck device); ``late_s``: rank 1 starts that much later
    (built while the configuration is read, before the rendezvous)."""

    def __init__(self, at: int = 1, how: str = "exit", late_s: float = 0.0):
        self.at, self.how = at, how
        if os.environ.get("LOCAL_RANK") == "1":
            time.sleep(late_s)   # rank 1 reaches the rendezvous ``late_s`` after its start-up

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step >= self.at:
            if self.how == "hang":
                time.sleep(3600)
            os._exit(13)


def _env() -> dict:
    return child_env(ROOT / "tests")


def _launch_all(cmds: list[tuple[list[str], dict]], cwd: Path | list[Path], timeout: float = 240
                ) -> list[tuple[int, str]]:
    """Start every (command, extra environment) at once (in ``cwd``, or ``cwd[i]``), wait for all:
    [(exit status, log)]."""
    dirs = cwd if isinstance(cwd, list) else [cwd] * len(cmds)
    procs = [subprocess.Popen(cmd, cwd=where, env={**_env(), **extra}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for (cmd, extra), where in zip(cmds, dirs)]
    out = []
    try:
        for p in procs:
            log, _ = p.communicate(timeout=scaled(timeout))
            out.append((p.returncode, log))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


def srun_env(rank: int, ntasks: int, nodes: int, port: int) -> dict:
    """What ``srun --nodes=NODES --ntasks-per-node=NTASKS/NODES`` sets for task ``rank`` (on one host)."""
    per_node = ntasks // nodes
    return {"SLURM_NTASKS": str(ntasks), "SLURM_NNODES": str(nodes), "SLURM_NTASKS_PER_NODE": str(per_node),
            "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % per_node), "SLURM_NODEID": str(rank // per_node),
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "lit_moe", "SLURM_NODELIST": "127.0.0.1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


@pytest.mark.timeout(600)
def test_two_node_torchrun_and_srun_launches_train_like_one_process(tmp_path, capfd):
    """tp2·ep2 on two torchrun "nodes" (``--nnodes 2 --node_rank``, static rendezvous, one process each,
    no ``--trainer.num_nodes``) and under srun's environment (1 node × 2 tasks, no ``--trainer.devices``:
    Lightning's device list had one entry, local rank 1 died with IndexError) log the losses of one
    process. ``global_batch_size 4 · local_batch_size 2``: accumulation 1 at dp 2, 2 in one process; a
    world size taken wrongly (1) would accumulate 2 micro-batches per rank and change the losses."""
    cfg = tiny_config(tmp_path, steps=2, parallelism={"tensor_parallel": 2, "expert_parallel": 2})
    cfg["model"]["compute_dtype"] = "float32"
    path = write_config(tmp_path, cfg)
    fit = ["-m", "lit_moe.cli", "fit", "--config", str(path), "--trainer.accelerator", "cpu"]
    def torchrun(port):
        return [([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                  "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port), *fit], {})
                for node in (0, 1)]

    def srun(port):
        return [([sys.executable, *fit], srun_env(rank, 2, 1, port)) for rank in (0, 1)]
    del cfg["parallelism"]
    # the one-process reference inside this process (no interpreter start)
    single = cli_in_process(["fit", "--config", str(write_config(tmp_path, cfg, "single.yaml")),
                             "--trainer.accelerator", "cpu"], capfd, cwd=tmp_path)
    assert single.returncode == 0, single.stderr[-4000:]
    results = {"single": [m.groups() for m in STEP.finditer(single.stdout + single.stderr)]}
    assert [s[0] for s in results["single"]] == ["1", "2"], single.stdout[-3000:] + single.stderr[-3000:]
    for name, cmds in (("torchrun", torchrun), ("srun", srun)):
        runs = retry_on_port_clash(lambda port: _launch_all(cmds(port), tmp_path))
        for code, log in runs:
            assert code == 0, (name, log[-4000:])
        results[name] = [m.groups() for m in STEP.finditer(runs[0][1])]
        assert [s[0] for s in results[name]] == ["1", "2"], (name, runs[0][1][-3000:])
    ref = results["single"]
    for name in ("torchrun", "srun"):
        for (_, _, loss), (_, _, want) in zip(results[name], ref):
            assert abs(float(loss) - float(want)) <= 1e-4 * float(want), (name, results[name], ref)
    assert ref[0][2] != ref[1][2]                     # the model trained between the two steps


@pytest.mark.timeout(300)
def test_save_path_not_shared_by_the_ranks_stops_at_start_up(tmp_path):
    """srun's 2 tasks in two working directories with a relative ``save_path`` (each rank its own
    disk): the run stops before step 1 in one line naming rank 1, not at the first save."""
    cfg = tiny_config(tmp_path, steps=2)
    cfg["checkpoint"].update(enable_save=True, save_path="ckpt", save_interleaved_steps=1000)
    path = write_config(tmp_path, cfg)
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    for d in dirs:
        d.mkdir()
    runs = retry_on_port_clash(lambda port: _launch_all(
        [([sys.executable, "-m", "lit_moe.cli", "fit", "--config", str(path), "--trainer.accelerator", "cpu"],
          srun_env(rank, 2, 1, port)) for rank in (0, 1)], dirs))
    for code, log in runs:
        assert code == 2, log[-3000:]
        errors = [ln for ln in log.splitlines() if ln.startswith("lit_moe: error:")]
        assert len(errors) == 1 and "checkpoint.save_path" in errors[0] and "rank 1 does not see" in errors[0], log
        assert "Traceback" not in log and "step 1/2" not in log, log[-3000:]
    assert not list((dirs[0] / "ckpt").glob(".lit_moe_shared_*"))     # rank 0 removed its token


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["hang"])
def test_devices_two_and_a_stuck_rank_ends_the_job(tmp_path, how):
    """Rank 1 starts late (longer than the collective timeout: the rendezvous waits for it) and stops
    answering after step 1; rank 0's next collective times out after ``parallelism.process_group_timeout_s``
    and the run ends with an error (the default 30-minute torch timeout would look like a hang)."""
    # Shorter than the second process's start-up (about 7 s of imports on a quiet machine): the
    # rendezvous waits at least STARTUP_RENDEZVOUS for it, the collectives after it this timeout (room
    # for the ranks' skew between two collectives, stretched by the load; each second here is waited for)
    timeout_s = round(scaled(5))
    cfg = tiny_config(tmp_path, steps=50, parallelism={"expert_parallel": 2, "process_group_timeout_s": timeout_s})
    # rank 1 also reaches the rendezvous later than the collective timeout: the start-up waits for it
    cfg["callbacks"] = [{"class_path": "test_strategy_launch.DieOnRankOne",
                         "init_args": {"at": 1, "how": how, "late_s": timeout_s + 3}}]
    path = write_config(tmp_path, cfg)
    cmd = [sys.executable, "-m", "lit_moe.cli", "fit", "--config", str(path), "--trainer.devices", "2",
           "--trainer.accelerator", "cpu"]
    log_path = tmp_path / "run.log"
    with open(log_path, "w") as log_file:
        # Own session: the stuck rank 1 (started by Lightning, not by us) is cleaned up with the group.
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=scaled(240))
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


_SRUN_4_ON_2 = {"SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "3"}
_TORCHRUN_4_ON_2 = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "RANK": "3"}


@pytest.mark.parametrize("env,trainer,want", [
    # the run: srun 2 nodes × 2 tasks with --trainer.devices 2 and no num_nodes (was sized for 2)
    (_SRUN_4_ON_2, {"devices": 2}, (4, 2, 2, "srun")),
    (_SRUN_4_ON_2, {}, (4, 2, 2, "srun")),                          # neither set: the launcher's values
    ({**_SRUN_4_ON_2, "SLURM_JOB_NAME": "interactive"}, {}, (1, 1, 1, "lightning")),   # Lightning ignores SLURM
    (_TORCHRUN_4_ON_2, {}, (4, 2, 2, "torchrun")),
    (_TORCHRUN_4_ON_2, {"num_nodes": 2, "devices": 2}, (4, 2, 2, "torchrun")),
    ({}, {"devices": 3, "num_nodes": 2}, (6, 3, 2, "lightning")),
    ({"SLURM_NTASKS": "1"}, {}, (1, 1, 1, "srun")),
])
def test_launch_world_follows_the_launcher(env, trainer, want):
    from lit_moe.runtime.launch import launch_world

    got = launch_world(trainer, set(trainer), env=env)
    assert (got.world_size, got.devices, got.num_nodes, got.launcher) == want


@pytest.mark.parametrize("env,trainer,words", [
    (_SRUN_4_ON_2, {"devices": 4}, ["--trainer.devices 4", "SLURM_NTASKS_PER_NODE=2"]),
    (_SRUN_4_ON_2, {"num_nodes": 1}, ["--trainer.num_nodes 1", "SLURM_NNODES=2"]),
    ({"SLURM_NTASKS": "4"}, {}, ["SLURM_NTASKS=4", "SLURM_NTASKS_PER_NODE"]),
    ({"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1"}, {},
     ["SLURM_NTASKS=4", "--trainer.num_nodes 1", "--trainer.num_nodes 2"]),
    (_TORCHRUN_4_ON_2, {"num_nodes": 1}, ["WORLD_SIZE=4", "--trainer.num_nodes 1", "--trainer.num_nodes 2"]),
    (_TORCHRUN_4_ON_2, {"devices": 1}, ["--trainer.devices 1", "LOCAL_WORLD_SIZE"]),
])
def test_launch_world_disagreement_is_one_line_naming_the_keys(env, trainer, words):
    from lit_moe.config import ConfigError
    from lit_moe.runtime.launch import launch_world

    with pytest.raises(ConfigError) as err:
        launch_world(trainer, set(trainer), env=env)
    text = str(err.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_a_built_world_other_than_the_sized_one_stops():
    from lit_moe.config import ConfigError
    from lit_moe.runtime.launch import check_built_world

    check_built_world(4, 4)
    with pytest.raises(ConfigError, match="built 8 processes but the run was sized for 4"):
        check_built_world(4, 8)


@pytest.mark.parametrize("accelerator,want", [("auto", 4), (None, 4), ("cuda", 4), ("cpu", 1)])
def test_auto_devices_are_lightnings_pick(monkeypatch, accelerator, want):
    """``devices: auto`` under Lightning's own launcher counts every device of the accelerator
    Lightning picks (four GPUs here, faked), so accumulation is sized for the world it will build."""
    from lightning.pytorch.accelerators import CUDAAccelerator

    from lit_moe.cli import _auto_device_count

    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: True))
    monkeypatch.setattr(CUDAAccelerator, "auto_device_count", staticmethod(lambda: 4))
    assert _auto_device_count({} if accelerator is None else {"accelerator": accelerator}) == want
