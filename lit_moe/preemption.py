"""Preemption: SIGTERM, SIGINT and SIGUSR1 end a run after the optimizer step in flight, with a
checkpoint of that step.

SLURM and Kubernetes send SIGTERM before killing a job (SLURM's ``--signal=USR1@90`` sends SIGUSR1
first); Ctrl-C sends SIGINT. The :class:`Preemption` callback replaces Lightning's handlers while
training runs (Lightning's SIGTERM handler stops after the current *micro-batch*, exits 0 and saves
nothing). Its handler only records the signal; at the end of every optimizer step the ranks agree
(one MAX all-reduce of an integer on a gloo group: a signal that reached a single rank stops them
all at the same step), and on a signal every rank stops: the checkpoint callback's end-of-training
save writes the step just finished (tracker updated), and the process exits with ``128 + signal``
(:func:`exit_status`, returned by ``lit_moe fit``). Relaunching the same command resumes from that
checkpoint (auto-resume) and continues bit for bit.

Under SLURM with Lightning's auto-requeue (the default of its ``SLURMEnvironment``), the requeue
signal (SIGUSR1 unless configured otherwise) also requeues the job (``scontrol requeue``), as
Lightning's own handler does, after the checkpoint is written. A second SIGINT aborts at once.

A signal during start-up is obeyed as promptly: before Lightning's handlers exist it ends the
process (the default action); between them and the start of training (set-up, the MFU peak probe,
at most a second) Lightning records it and the callback takes it over, so the run stops after its
first step.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback

SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGINT", None),
                            getattr(signal, "SIGUSR1", None)) if s is not None)
_STOPPED_BY: dict[str, Optional[int]] = {"signal": None}


def exit_status() -> int:
    """``128 + signal`` when a signal stopped the last run of this process, else 0."""
    sig = _STOPPED_BY["signal"]
    return 128 + int(sig) if sig else 0


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Preemption(Callback):
    """Stop after the optimizer step in flight on SIGTERM/SIGINT/SIGUSR1 (see the module docstring)."""

    def __init__(self) -> None:
        self._received: Optional[int] = None
        self._agreed: Optional[int] = None
        self._previous: dict[int, Any] = {}
        self._group: Any = None
        self._last_step: Optional[int] = None

    # -- handlers ---------------------------------------------------------------------------
    def _handle(self, signum: int, frame: Any) -> None:
        if self._received is not None and signum == getattr(signal, "SIGINT", None):
            raise KeyboardInterrupt  # a second Ctrl-C: abort now
        if self._received is None:
            self._received = signum
            print(f"lit_moe: received {_name(signum)}: stopping after the optimizer step in flight",
                  file=sys.stderr, flush=True)

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            if handler is not None:
                signal.signal(s, handler)
        self._previous = {}

    # -- hooks --------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        _STOPPED_BY["signal"] = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and self._group is None:
            # collective: every rank runs setup
            self._group = dist.new_group(backend="gloo", timeout=getattr(trainer.strategy, "_timeout", None))

    def on_train_start(self, trainer, pl_module) -> None:
        # After Lightning registered its own handlers (Trainer._run), so these replace them.
        self._last_step = trainer.global_step
        self._install()
        connector = getattr(trainer, "_signal_connector", None)
        if getattr(connector, "received_sigterm", False):
            # SIGTERM during start-up (model set-up, the MFU peak probe) reached Lightning's handler,
            # which would act on it only at the end of the epoch, with exit status 0: it is ours now
            # (stop after the first step, with its checkpoint, exit status 143)
            connector.received_sigterm = False
            self._handle(signal.SIGTERM, None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return  # a micro-batch that did not finish an optimizer step
        self._last_step = step
        agreed = self._agree()
        if agreed:
            self._agreed = agreed
            trainer.should_stop = True  # the checkpoint callback saves this step at the end of training

    def _agree(self) -> int:
        mine = int(self._received or 0)
        if self._group is None:
            return mine
        flag = torch.tensor([mine], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(flag.item())

    def on_train_end(self, trainer, pl_module) -> None:
        if not self._agreed:
            return
        sig = self._agreed
        _STOPPED_BY["signal"] = sig
        saved = _checkpoint_of(trainer)
        if trainer.is_global_zero:
            where = f"checkpoint of step {trainer.global_step} in {saved}" if saved else \
                "no checkpoint written (checkpoint.enable_save is False)"
            print(f"lit_moe: stopped by {_name(sig)} after step {trainer.global_step}; {where}; exit status "
                  f"{128 + sig}", file=sys.stderr, flush=True)
        _maybe_requeue(trainer, sig)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._restore()


def _checkpoint_of(trainer) -> Optional[str]:
    for cb in trainer.callbacks:
        cfg = getattr(cb, "cfg", None)
        if getattr(cfg, "enable_save", False) and getattr(cb, "save_path", None) is not None:
            return str(cb.save_path)
    return None


def _maybe_requeue(trainer, sig: int) -> None:
    """Lightning's SLURM auto-requeue, for its requeue signal (after the checkpoint is written)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    env = trainer._accelerator_connector.cluster_environment
    if not (isinstance(env, SLURMEnvironment) and env.auto_requeue and sig == env.requeue_signal):
        return
    if not trainer.is_global_zero:
        return
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job):
        print(f"lit_moe: cannot requeue: SLURM job id {job!r} not understood", file=sys.stderr, flush=True)
        return
    try:
        result = subprocess.call(["scontrol", "requeue", job])
    except FileNotFoundError:
        result = -1
    print(f"lit_moe: SLURM job {job} " + ("requeued" if result == 0 else f"could not be requeued ({result})"),
          file=sys.stderr, flush=True)
