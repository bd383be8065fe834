"""Fault-injection callbacks for the resilience tests, added through a config's ``callbacks:`` list.

``LossProbe`` appends ``{"step", "loss", "lr", "rank", "restart"}`` (and the optimizer's betas, eps
and weight decays after the step) per finished optimizer step to a JSON-lines file (rank 0, or every rank with ``all_ranks``). The others hurt their own process at the
start of micro-batch ``micro`` (0-based) of optimizer step ``step`` (1-based) on global rank
``rank``, in the launch attempt ``restart`` (``TORCHELASTIC_RESTART_COUNT``; -1: every attempt).
"""

from __future__ import annotations

import json
import os
import signal
import time

from lightning.pytorch import Callback

from lit_moe.callbacks import ThroughputMFU


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class LossProbe(Callback):
    def __init__(self, path: str, all_ranks: bool = False) -> None:
        self.path = path
        self.all_ranks = all_ranks
        self.last = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        m = getattr(pl_module, "step_metrics", None)  # a StepMetrics, once per optimizer step
        if m is None or m.step == self.last:
            return
        self.last = m.step
        if trainer.is_global_zero or self.all_ranks:
            with open(self.path, "a") as f:
                groups = trainer.optimizers[0].param_groups
                f.write(json.dumps({"step": m.step, "loss": repr(m.loss), "lr": repr(m.lr),
                                    "rank": trainer.global_rank, "restart": _attempt(),
                                    "betas": list(groups[0].get("betas", ())), "eps": groups[0].get("eps"),
                                    "weight_decay": sorted({g.get("weight_decay") for g in groups})}) + "\n")


class _AtMicroBatch(Callback):
    """Fires before the model's forward of the chosen micro-batch (a forward pre-hook on the
    model, so it lands inside the optimizer step however the step loops over its micro-batches)."""

    def __init__(self, step: int, micro: int = 0, rank: int = 0, restart: int = 0) -> None:
        self.step, self.micro, self.rank, self.restart = step, micro, rank, restart
        self.seen = -1
        self.count = 0
        self.done = False

    def on_train_start(self, trainer, pl_module) -> None:
        pl_module.model.register_forward_pre_hook(lambda module, args: self._forward(trainer))

    def _forward(self, trainer) -> None:
        step = trainer.global_step + 1  # the optimizer step this micro-batch belongs to
        self.count = self.count + 1 if step == self.seen else 0
        self.seen = step
        if self.done or step != self.step or self.count != self.micro or trainer.global_rank != self.rank:
            return
        if self.restart >= 0 and _attempt() != self.restart:
            return
        self.done = True
        self.hit(trainer)

    def hit(self, trainer) -> None:
        raise NotImplementedError


class SignalAt(_AtMicroBatch):
    """Send ``signum`` (default SIGTERM) to this process."""

    def __init__(self, step: int, micro: int = 0, rank: int = 0, restart: int = 0, signum: int = 15) -> None:
        super().__init__(step, micro, rank, restart)
        self.signum = signum

    def hit(self, trainer) -> None:
        os.kill(os.getpid(), self.signum)


class KillAt(_AtMicroBatch):
    """SIGKILL this process (a crash: nothing runs after it)."""

    def __init__(self, step: int, micro: int = 0, rank: int = 0, restart: int = 0, marker: str = "") -> None:
        super().__init__(step, micro, rank, restart)
        self.marker = marker

    def hit(self, trainer) -> None:
        if self.marker:  # when the kill happened, for the test's clock
            with open(self.marker, "w") as f:
                f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)


class StopAt(_AtMicroBatch):
    """SIGSTOP this process (a hung rank: alive, holding its sockets, answering nothing)."""

    def hit(self, trainer) -> None:
        with open(os.environ.get("LIT_MOE_TEST_STOPPED_PID", os.devnull), "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(1)


class _PatchWrites(Callback):
    """Replace the checkpoint writer of this rank for the save of optimizer step ``step``."""

    def __init__(self, step: int, rank: int = 0, marker: str = "") -> None:
        self.step, self.rank, self.marker = step, rank, marker

    def setup(self, trainer, pl_module, stage: str) -> None:
        if trainer.global_rank != self.rank:
            return
        import lit_moe.checkpoint.iteration as iteration

        real, target = iteration.write_pieces, f".iteration_{self.step:08d}.tmp"

        def patched(path, pieces, *args, **kwargs):
            if os.path.basename(os.path.dirname(str(path))) == target:
                return self.instead(path, real, pieces, *args, **kwargs)
            return real(path, pieces, *args, **kwargs)

        iteration.write_pieces = patched

    def instead(self, path, real, pieces, *args, **kwargs):
        raise NotImplementedError


class FailWrites(_PatchWrites):
    """The disk is full while step ``step`` is saved (on rank ``rank``)."""

    def instead(self, path, real, pieces, *args, **kwargs):
        import errno

        raise OSError(errno.ENOSPC, "No space left on device", str(path))


class StallWrites(_PatchWrites):
    """Write the first file of step ``step``'s save, then stall (the test kills the process); the
    path of ``marker`` gets the stalled file's name."""

    def instead(self, path, real, pieces, *args, **kwargs):
        out = real(path, pieces, *args, **kwargs)
        with open(self.marker, "w") as f:
            f.write(str(path))
        time.sleep(600)
        return out


class SignalCollectives(Callback):
    """Per optimizer step, the collectives called from signal handling code (lit_moe's preemption
    module, Lightning's epoch loop and signal connector): one JSON line per step in ``path.rank<R>``."""

    WATCHED = ("all_reduce", "broadcast", "all_gather", "all_gather_object", "broadcast_object_list", "barrier")
    FILES = ("preemption.py", "training_epoch_loop.py", "signal_connector.py")

    def __init__(self, path: str) -> None:
        self.path = path
        self.calls: list[str] = []

    def setup(self, trainer, pl_module, stage) -> None:
        import sys as _sys

        import torch.distributed as dist

        def wrap(name, real):
            def counted(*args, **kwargs):
                caller = os.path.basename(_sys._getframe(1).f_code.co_filename)
                if caller in self.FILES:
                    self.calls.append(f"{caller}:{name}")
                return real(*args, **kwargs)
            return counted

        for name in self.WATCHED:
            setattr(dist, name, wrap(name, getattr(dist, name)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with open(f"{self.path}.rank{trainer.global_rank}", "a") as f:   # the calls since the last step
            f.write(json.dumps({"step": trainer.global_step, "calls": self.calls}) + "\n")
        self.calls = []


class SlowWriter(Callback):
    """Rank ``rank`` sleeps ``seconds`` before writing each checkpoint file (a slow share of a busy
    file system), and every rank grants writers ``floor`` bytes per second (a checkpoint "large"
    for the tiny model's few MB)."""

    def __init__(self, rank: int, seconds: float, floor: float) -> None:
        self.rank, self.seconds, self.floor = rank, seconds, floor

    def setup(self, trainer, pl_module, stage) -> None:
        from lit_moe.checkpoint import iteration

        iteration.SAVE_BYTES_PER_S_FLOOR = self.floor
        if trainer.global_rank == self.rank:
            real, seconds = iteration.write_pieces, self.seconds

            def slow(*args, **kwargs):
                time.sleep(seconds)
                return real(*args, **kwargs)

            iteration.write_pieces = slow


class SignalDuringPeakProbe(ThroughputMFU):
    """The built-in throughput callback (it replaces it in place), sending ``signum`` to this process
    just before its MFU peak probe: a signal during start-up, after Lightning's handlers exist and
    before training starts."""

    def __init__(self, signum: int = 15, **kwargs) -> None:
        super().__init__(**kwargs)
        self.signum = signum

    def on_train_start(self, trainer, pl_module) -> None:
        os.kill(os.getpid(), self.signum)
        super().on_train_start(trainer, pl_module)
