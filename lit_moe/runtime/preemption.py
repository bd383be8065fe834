"""Preemption: SIGTERM, SIGINT and SIGUSR1 end a run after the optimizer step in flight, with a
checkpoint of that step.

SLURM and Kubernetes send SIGTERM before killing a job (SLURM's ``--signal=USR1@90`` sends SIGUSR1
first); Ctrl-C sends SIGINT. The :class:`Preemption` callback replaces Lightning's handlers while
training runs (Lightning's SIGTERM handler stops after the current *micro-batch*, exits 0 and saves
nothing). Its handler only records the signal; at the end of every optimizer step the ranks agree
(one MAX all-reduce of an integer on a gloo group: a signal that reached a single rank stops them
all at the same step; the flag rides in LitMoE's per-step metrics all-reduce, which every step
already does: :func:`signal_flags` / :func:`agree_on_signal`, so steps without a signal cost no
collective of their own), and on a signal every rank stops: the checkpoint callback's end-of-training
save writes the step just finished (tracker updated), and the process exits with ``128 + signal``
(:func:`exit_status`, returned by ``lit_moe fit``). Relaunching the same command resumes from that
checkpoint (auto-resume) and continues bit for bit.

A signal that arrives while the run starts (from the Trainer's setup until this run's first optimizer
step has finished: building the model, restoring a checkpoint, the first, slowest step) stops the
process at once (a :class:`Preempted` exception, exit status ``128 + signal``): there is nothing new
to save, and waiting for the first step could outlast SLURM's ``KillWait`` (30 s by default).

Under SLURM with Lightning's auto-requeue (the default of its ``SLURMEnvironment``), the requeue
signal (SIGUSR1 unless configured otherwise) also requeues the job (``scontrol requeue``), as
Lightning's own handler does, after the checkpoint is written. A second SIGINT aborts at once.
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

from lit_moe.step import StepStrategy

SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGINT", None),
                            getattr(signal, "SIGUSR1", None)) if s is not None)
_STOPPED_BY: dict[str, Optional[int]] = {"signal": None}
_ACTIVE: list["Preemption"] = []   # the Preemption callback of the run in progress (at most one)


def signal_flags(device: Any = None) -> torch.Tensor:
    """This rank's pending signal, one-hot over :data:`SIGNALS` (float64, all zeros without one), to
    be summed over every rank by the step's own all-reduce and handed to :func:`agree_on_signal`."""
    flags = torch.zeros(len(SIGNALS), dtype=torch.float64, device=device)
    received = _ACTIVE[0]._received if _ACTIVE else None
    if received in SIGNALS:
        flags[SIGNALS.index(received)] = 1.0
    return flags


def agree_on_signal(summed: torch.Tensor) -> None:
    """The world-wide sum of :func:`signal_flags`: the signal every rank stops on after this step
    (the first of SIGTERM, SIGINT, SIGUSR1 that any rank received), for the running callback."""
    if not _ACTIVE:
        return
    counts = summed.tolist()
    _ACTIVE[0]._delivered = next((int(sig) for sig, n in zip(SIGNALS, counts) if n > 0), 0)


def exit_status() -> int:
    """``128 + signal`` when a signal stopped the last run of this process, else 0."""
    sig = _STOPPED_BY["signal"]
    return 128 + int(sig) if sig else 0


class Preempted(SystemExit):
    """A signal before this run's first optimizer step finished: the process exits ``128 + signal``."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + int(signum))
        self.signum = int(signum)


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
        self._outside: dict[int, Any] = {}   # the handlers before this callback's first install, kept
        self._group: Any = None
        self._last_step: Optional[int] = None
        self._stepped = False      # an optimizer step of this run has finished: a signal waits for the next
        self._launcher: Any = None
        self._delivered: Optional[int] = None   # this step's agreed signal, from the step's all-reduce

    # -- handlers ---------------------------------------------------------------------------
    def _handle(self, signum: int, frame: Any) -> None:
        if self not in _ACTIVE:
            # Left installed after the run: when a fit raises, Lightning's teardown puts back the handlers it
            # found (ours) after on_exception restored the caller's. Act as the caller's handler would.
            previous = self._outside.get(signum)
            previous = signal.SIG_DFL if previous is None else previous
            signal.signal(signum, previous)
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signum)
            return
        if self._received is not None and signum == getattr(signal, "SIGINT", None):
            raise KeyboardInterrupt  # a second Ctrl-C: abort now
        if not self._stepped:
            print(f"lit_moe: received {_name(signum)} while the run starts: stopping now (nothing new to save); "
                  f"exit status {128 + signum}", file=sys.stderr, flush=True)
            if self._launcher is not None:   # processes Lightning's launcher started stop too
                self._launcher.kill(signum)
            _STOPPED_BY["signal"] = signum
            raise Preempted(signum)
        if self._received is None:
            self._received = signum
            print(f"lit_moe: received {_name(signum)}: stopping after the optimizer step in flight",
                  file=sys.stderr, flush=True)

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s in SIGNALS:
            previous = signal.signal(s, self._handle)
            self._previous.setdefault(s, previous)   # the handlers before the first install, restored at teardown
            self._outside.setdefault(s, previous)

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            if handler is not None:
                signal.signal(s, handler)
        self._previous = {}

    # -- hooks --------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        _STOPPED_BY["signal"] = None
        self._stepped = False
        self._launcher = getattr(trainer.strategy, "launcher", None)
        _ACTIVE[:] = [self]
        self._install()   # from here on a signal stops the start-up (Lightning composes it into its own)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and self._group is None:
            # collective: every rank runs setup
            strategy = trainer.strategy
            timeout = strategy.collective_timeout if isinstance(strategy, StepStrategy) else None
            self._group = dist.new_group(backend="gloo", timeout=timeout)

    def on_train_start(self, trainer, pl_module) -> None:
        # After Lightning registered its own handlers (Trainer._run), so these replace them.
        self._last_step = trainer.global_step
        self._install()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return  # a micro-batch that did not finish an optimizer step
        self._last_step = step
        self._stepped = True
        agreed, self._delivered = (self._delivered, None) if self._delivered is not None else (self._agree(), None)
        if agreed:
            self._agreed = agreed
            trainer.should_stop = True  # the checkpoint callback saves this step at the end of training

    def _agree(self) -> int:
        """Without the step's all-reduce (a module other than LitMoE): one gloo MAX all-reduce."""
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

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # Lightning calls no teardown hook when a run raises: give the caller's handlers back here.
        self.teardown(trainer, pl_module, trainer.state.stage or "fit")

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._restore()
        if self in _ACTIVE:
            _ACTIVE.remove(self)


def _epoch_loop_class():
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    class EpochLoopWithoutSigtermBroadcast(_TrainingEpochLoop):
        """Lightning's training epoch loop without its per-batch SIGTERM broadcast from rank 0."""

        def _broadcast_sigterm_tensor(self) -> None:
            return None   # the Preemption callback agrees on signals (in the step's own all-reduce)

    return EpochLoopWithoutSigtermBroadcast


def use_preemption_agreement(trainer) -> None:
    """Lightning 2.6's training loop broadcasts a SIGTERM flag from rank 0 before every batch, on the
    default group (a world-wide collective and, on accelerators, a host sync per step). With the
    :class:`Preemption` callback in charge of signals that broadcast has nothing to say: the Trainer's
    epoch loop (which the Trainer itself assigns after building it) is replaced by one without it."""
    old = trainer.fit_loop.epoch_loop
    if not hasattr(old, "_broadcast_sigterm_tensor"):
        return   # a Lightning without the broadcast
    trainer.fit_loop.epoch_loop = _epoch_loop_class()(trainer, min_steps=old.min_steps, max_steps=old.max_steps)


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
