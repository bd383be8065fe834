"""Shared test helpers: small configs written to a temporary directory, and running ``lit_moe``."""

from __future__ import annotations

import copy
import os
import subprocess
from pathlib import Path
from typing import Any

import launch_pool
import yaml

ROOT = Path(__file__).resolve().parents[1]


def tiny_config(tmp_path: Path, *, steps: int = 2, mock_data: bool = True, **overrides: Any) -> dict:
    """configs/tiny.yaml shrunk for tests: mock data, no checkpoints, TensorBoard under tmp_path.

    ``overrides`` are ``section=dict`` updates merged one level deep (``model={"hidden_size": 64}``).
    """
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["training"].update(steps=steps, local_batch_size=2, global_batch_size=4)
    cfg["checkpoint"].update(enable_save=False, save_path=str(tmp_path / "ckpt"))
    cfg["monitor"] = {"tensorboard": {"output_dir": str(tmp_path / "tb"), "log_interval": 1}}
    cfg["model"].update(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        moe_shared_expert_intermediate_size=32, seq_length=32, vocab_size=512,
                        num_hidden_layers=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16)
    dl = cfg["train_dataset"]["dataloader"]
    dl["config"]["seq_length"] = 32
    dl["sizes"] = [steps * 4 * 4, 0, 0]
    if mock_data:
        dl["config"].pop("data_path", None)
        dl["config"]["mock"] = True
    cfg["train_dataset"]["num_parallel_workers"] = 0
    for section, values in overrides.items():
        if isinstance(values, dict) and isinstance(cfg.get(section), dict):
            cfg[section] = {**cfg[section], **copy.deepcopy(values)}
        else:
            cfg[section] = copy.deepcopy(values)
    return cfg


def write_config(tmp_path: Path, cfg: dict, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")


def child_env(*paths: str | Path, **extra: str) -> dict:
    """The environment for a child interpreter: this one's, unbuffered, one OMP thread, without the
    launch variables an in-process Trainer may have left (a launch picks its own), with ``ROOT``, then
    ``paths``, then the inherited ``PYTHONPATH`` (the suite's start counter lives there)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (ROOT, *paths, os.environ.get("PYTHONPATH")) if p)
    return env


def selected_layouts(request, layouts: dict) -> list[str]:
    """The names of ``layouts`` whose tests (parametrized by ``name``) of the requesting module this
    session runs: a module-scoped fixture launches only those (``-k`` picks a few)."""
    names = {item.callspec.params["name"] for item in request.session.items
             if item.module is request.module and "name" in getattr(getattr(item, "callspec", None), "params", {})}
    return [n for n in layouts if n in names]


def scaled(seconds: float) -> float:
    """``seconds`` measured on a quiet machine, stretched by how busy this one is now: a wait that
    includes interpreter start-up (8-30 s of imports on a loaded 2-core machine) must not fail a
    correct run. The factor is the 1-minute load per core, at least 1 and at most 32 (a 2-core machine
    at load 44 took 161 s to start a second rank: a cap of 8 was too low)."""
    per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    return seconds * min(32.0, max(1.0, per_core))


def wait_for_line(proc: subprocess.Popen, pattern: str, deadline: float, stream=None) -> list[str]:
    """Read ``proc``'s text stream (stdout unless given) until a line contains ``pattern``; return the
    lines read. Fails (AssertionError with the lines so far) when ``deadline`` seconds pass first or the
    stream ends: a reader thread does the blocking reads, so a silent child cannot hold the test."""
    import queue
    import threading
    import time

    stream = stream or proc.stdout
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    end = time.monotonic() + deadline
    while True:
        try:
            line = lines.get(timeout=max(0.0, end - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no line with {pattern!r} within {deadline:.0f} s:\n" + "".join(seen[-40:]))
        if line is None:
            raise AssertionError(f"output ended without {pattern!r}:\n" + "".join(seen[-40:]))
        seen.append(line)
        if pattern in line:
            return seen


def _port_nobody_holds() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def retry_on_port_clash(launch, tries: int = 4) -> list[tuple[int, str]]:
    """``launch(port)`` -> [(exit status, log)] for launchers that need a master port named up front
    (torchrun's static rendezvous, srun's environment). The port is free when picked but another
    process may take it before rank 0 binds it: such a launch is run again on a new port. Where no port
    is needed, use a ``file://`` or in-memory store instead."""
    for _ in range(tries - 1):
        runs = launch(_port_nobody_holds())
        if not any(code != 0 and ("EADDRINUSE" in log or "ddress already in use" in log) for code, log in runs):
            return runs
    return launch(_port_nobody_holds())


def run_cli(args: list[str], cwd: Path, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m lit_moe.cli ARGS`` in a fresh process (what a user's shell does; forked from the
    pre-imported ``launch_pool``). ``timeout`` is for a quiet machine and is ``scaled``; a ``PYTHONPATH``
    in ``env`` is added to the inherited one."""
    env = dict(env or {})
    full_env = child_env(*[p for p in env.pop("PYTHONPATH", "").split(os.pathsep) if p], **env)
    return launch_pool.run(["-m", "lit_moe.cli", *args], env=full_env, cwd=cwd, timeout=scaled(timeout))


def torchrun(world: int, argv: list[str], cwd: Path | str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=WORLD ARGV`` (a script and its arguments, or ``-m``
    module ...), each rank forked from the pre-imported ``launch_pool`` with torchrun's variables:
    ``stdout`` holds every rank's output, ``stderr`` is empty. ``timeout`` is for a quiet machine and is
    ``scaled``. Launches that test torchrun itself (restarts, its agent) run the real command."""
    return launch_pool.run_ranks(world, argv, env=env, cwd=cwd, timeout=scaled(timeout))


def cli_in_process(args: list[str], capfd, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``lit_moe ARGS`` in this process, for tests of what a run does rather than of a fresh
    interpreter (each interpreter start costs 8-12 s of imports): the exit status and what was written
    to stdout/stderr (``capfd``), as ``run_cli`` returns them. A process group the run created is
    destroyed, and ``training.deterministic``'s global switch put back; the launch variables are
    restored by conftest."""
    import torch
    import torch.distributed as dist

    from lit_moe.cli import main

    capfd.readouterr()
    before = os.getcwd()
    deterministic = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        if cwd is not None:
            os.chdir(cwd)
        code = main(list(args))
    finally:
        os.chdir(before)
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        if dist.is_initialized():
            dist.destroy_process_group()
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["lit_moe", *args], code, out, err)


def load_transformers_model(class_name: str, path):
    """transformers' ``class_name`` from the directory ``path`` (eager attention, eval mode), with no
    missing, unexpected or mismatched key: the independent reference of the family tests."""
    import transformers

    cls = getattr(transformers, class_name)
    model, info = cls.from_pretrained(path, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def randomize_norms_and_biases(model, seed: int = 7) -> None:
    """Every RMSNorm weight to ``1 + 0.2·N(0,1)`` and every router expert bias to ``0.3·N(0,1)``.

    Freshly built models have every norm weight at 1.0, so a comparison with an independent model
    cannot see two same-shaped norms swapped (input/post-attention norms in a key map, enorm/hnorm in
    MTP). Works on our model and on transformers' (names ending in ``norm.weight`` and
    ``expert_bias`` / ``e_score_correction_bias``)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("norm.weight"):
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=g))
            elif name.endswith(("expert_bias", "e_score_correction_bias")):
                t.copy_(0.3 * torch.randn(t.shape, generator=g))
