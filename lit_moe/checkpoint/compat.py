"""Resuming with changed settings: one rule for the learning-rate schedule and the optimizer.

Every checkpoint records the resolved schedule (``lit_moe.optim.schedules.Schedule``: type, peak, warm-up,
``lr_end``, total steps, ...) and the validated optimizer hyperparameters (type, betas, eps, weight
decay, ...) of the run that wrote it, as the state of the :class:`RunSettings` callback. On resume the
config's settings are compared with them before anything is built:

* equal: the run continues the saved schedule and optimizer state;
* different, ``checkpoint.override_schedule: False`` (default): one error line listing every
  difference (restoring the saved learning rates under a new schedule mixes the two: the new
  schedule's shape times the old peak);
* different, ``override_schedule: True``: the config wins, as Megatron's
  ``--override-opt_param-scheduler``: after Lightning restored the optimizer and the scheduler,
  every parameter group takes the hyperparameters of a freshly built optimizer (``lr``,
  ``initial_lr``, betas, eps, weight decay), the scheduler's base learning rates become the new
  peaks and the learning rate is the new schedule evaluated at the restored step. Moments and
  per-parameter step counts are kept. The change is logged once.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any, Optional

from lightning.pytorch import Callback

from lit_moe.checkpoint.layout import CheckpointError

# OptimizerSettings fields that choose an implementation, not the mathematics.
_IMPLEMENTATION_ONLY = ("foreach", "fused")
# Fields added later, recorded only when not at their default (checkpoints written before them resume).
_RECORDED_WHEN_SET = {"exp_avg_dtype": "float32", "exp_avg_sq_dtype": "float32"}


def run_settings(lr_section: dict, optimizer_section: dict, total_steps: int) -> dict[str, dict[str, Any]]:
    """The schedule and optimizer hyperparameters a run uses, as plain JSON values."""
    from lit_moe.optim.optimizers import validate_optimizer_section
    from lit_moe.optim.schedules import resolve_schedule

    schedule = dataclasses.asdict(resolve_schedule(lr_section, total_steps))
    optimizer = {k: v for k, v in dataclasses.asdict(validate_optimizer_section(optimizer_section)).items()
                 if k not in _IMPLEMENTATION_ONLY and _RECORDED_WHEN_SET.get(k, object()) != v}
    return json.loads(json.dumps({"lr_scheduler": schedule, "optimizer": optimizer}))  # tuples → lists


def _field_name(section: str, key: str) -> str:
    return "training.steps" if (section, key) == ("lr_scheduler", "total_steps") else f"{section}.{key}"


def differences(saved: dict, current: dict) -> list[str]:
    """``section.key saved → current`` for every setting that differs."""
    out = []
    for section in ("lr_scheduler", "optimizer"):
        old, new = saved.get(section) or {}, current.get(section) or {}
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                out.append(f"{_field_name(section, key)} {old.get(key)!r} → {new.get(key)!r}")
    return out


def saved_settings(trainer_state: dict) -> Optional[dict]:
    """The settings recorded by :class:`RunSettings` in a checkpoint's Lightning state (None for a
    checkpoint written without it)."""
    callbacks = trainer_state.get("callbacks") or {}
    state = callbacks.get(RunSettings.__qualname__)
    return state if isinstance(state, dict) and "lr_scheduler" in state else None


def check_resume_settings(trainer_state: dict, current: dict, *, override: bool, where: str,
                          step: int) -> list[str]:
    """Raise one :class:`CheckpointError` line when the settings changed and ``override`` is False;
    return the differences (empty when nothing changed or nothing was recorded)."""
    saved = saved_settings(trainer_state)
    if saved is None:
        return []
    diffs = differences(saved, current)
    if diffs and not override:
        raise CheckpointError(
            f"checkpoint.override_schedule: resuming {where} (step {step}) with a changed schedule or optimizer: "
            f"{'; '.join(diffs)}. Restore these settings, or set checkpoint.override_schedule: True to apply "
            "the new ones from the restored step")
    return diffs


class RunSettings(Callback):
    """Records this run's schedule and optimizer settings in every checkpoint and, with
    ``override_schedule``, puts the config's settings in place after a resume (see the module
    docstring)."""

    def __init__(self, settings: dict, override_diffs: Optional[list[str]] = None) -> None:
        self.settings = settings
        self.override_diffs = list(override_diffs or [])
        self._fresh_groups: Optional[list[list[dict]]] = None

    def state_dict(self) -> dict[str, Any]:
        return dict(self.settings)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass  # compared with the config before the run started (check_resume_settings)

    def on_fit_start(self, trainer, pl_module) -> None:
        # The optimizers exist (strategy setup) and the checkpoint is not restored yet: these are the
        # hyperparameters the config gives.
        if self.override_diffs:
            self._fresh_groups = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
                                  for opt in trainer.optimizers]

    def on_train_start(self, trainer, pl_module) -> None:
        if not self.override_diffs or self._fresh_groups is None:
            return
        for opt, fresh in zip(trainer.optimizers, self._fresh_groups):
            for group, new in zip(opt.param_groups, fresh):
                group.update(new)
        lr = None
        for config in trainer.lr_scheduler_configs:
            sched = config.scheduler
            sched.base_lrs = [g["initial_lr"] for g in sched.optimizer.param_groups]
            lambdas = getattr(sched, "lr_lambdas", None)
            if lambdas is None:
                continue
            for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, lambdas):
                group["lr"] = base * fn(sched.last_epoch)
            sched._last_lr = [g["lr"] for g in sched.optimizer.param_groups]
            lr = sched._last_lr[0] if lr is None else lr
        self._fresh_groups = None
        if trainer.is_global_zero:
            print(f"lit_moe: checkpoint.override_schedule: from step {trainer.global_step} the config's settings "
                  f"apply ({'; '.join(self.override_diffs)}); learning rate of the next step {lr:.6e}",
                  file=sys.stderr, flush=True)
