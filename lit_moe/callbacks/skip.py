"""Global-norm skip protection (``monitor.health_checkpoint``).

MindFormers' PyNative training-features guide (gradient clipping): ``max_norm`` is the soft protection (scale the gradients and update anyway);
``global_norm_skip_threshold`` is the hard one: when the global gradient norm is too large (or
NaN/Inf) the update of that step is skipped. More than ``global_norm_skip_time`` consecutive skips
are treated as a failure. MindFormers parses these fields but never acts on them; we implement what
the seed documents.

The guard is a :class:`lit_moe.step.StepGuard`: once per optimizer step the module computes the
global pre-clip gradient norm, then asks **every** guard (no short-circuit: guards may keep state)
**before** clipping. When any says True the update is dropped on the device and the LR schedule does
not advance, so parameters, optimizer moments and step counters stay exactly as they were. The
verdict is a device tensor (no host sync); the warnings and the limit are reported on log steps.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from lit_moe.config import ConfigError
from lit_moe.callbacks._common import check_log_interval, emit, is_log_step, steps_done
from lit_moe.step import StepGuard, StepStrategy
from lit_moe.strategies.clip import embedding_grad_norm


class SkipLimitExceeded(RuntimeError):
    """Too many consecutive skipped steps. Raised from ``should_skip`` before anything of the bad
    step is applied; the CLI prints the one-line message and exits non-zero. Checkpoint callbacks
    must not save on this exception (the last saved checkpoint is the last healthy state)."""


def _embedding_grad_norm(pl_module: Any, trainer: Any = None) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Global L2 norm of the input-embedding gradient and whether there is one (device tensors), or
    None when this rank knows there is none. The strategy knows where the embedding lives (every rank
    asks it: it may take part in collectives); another strategy's model holds it whole."""
    strategy = getattr(trainer, "strategy", None)
    model = getattr(pl_module, "model", None)
    if isinstance(strategy, StepStrategy):
        return strategy.embedding_grad_norm(model)
    return embedding_grad_norm(model)


class GlobalNormSkipGuard(StepGuard):
    """Skip the optimizer update when the global gradient norm exceeds ``global_norm_skip_threshold``
    or is not finite, or when the input-embedding gradient norm exceeds
    ``embedding_local_norm_threshold``; stop training after more than ``global_norm_skip_time``
    consecutive skips.

    The decision is made on the device (``should_skip`` returns a 0-d bool tensor) so that a step never
    waits for the host; what was decided is read back every ``report_interval`` steps (the log
    interval in a ``lit_moe fit`` run), at a checkpoint save and at the end of training: then each
    skipped step since the last report gets its warning line, and a run of more than
    ``global_norm_skip_time`` consecutive skips raises :class:`SkipLimitExceeded`. From the step that
    went over the limit until that report every update is skipped, so the state stays the last
    healthy one and no checkpoint of it is written.

    Args:
        global_norm_skip_threshold: skip when the global norm is above this. ``.inf`` keeps only
            the NaN/Inf check.
        global_norm_skip_time: allowed consecutive skips; one more raises :class:`SkipLimitExceeded`.
        embedding_local_norm_threshold: skip when the embedding gradient norm alone is above this;
            None disables the embedding check.
        report_interval: read the decisions back every N optimizer steps (1: every step).
    """

    def __init__(self, global_norm_skip_threshold: float = 100.0, global_norm_skip_time: int = 10,
                 embedding_local_norm_threshold: Optional[float] = 100.0, report_interval: int = 1) -> None:
        field = "monitor.health_checkpoint"
        if isinstance(global_norm_skip_threshold, bool) or not (
                isinstance(global_norm_skip_threshold, (int, float)) and global_norm_skip_threshold > 0):
            raise ConfigError(f"{field}.global_norm_skip_threshold: must be a positive number, got "
                              f"{global_norm_skip_threshold!r}")
        if isinstance(global_norm_skip_time, bool) or not (
                isinstance(global_norm_skip_time, int) and global_norm_skip_time >= 0):
            raise ConfigError(f"{field}.global_norm_skip_time: must be an int >= 0, got "
                              f"{global_norm_skip_time!r}")
        if embedding_local_norm_threshold is not None and (
                isinstance(embedding_local_norm_threshold, bool)
                or not isinstance(embedding_local_norm_threshold, (int, float))
                or embedding_local_norm_threshold <= 0):
            raise ConfigError(f"{field}.embedding_local_norm_threshold: must be a positive number or "
                              f"null, got {embedding_local_norm_threshold!r}")
        self.threshold = float(global_norm_skip_threshold)
        self.max_consecutive = int(global_norm_skip_time)
        self.embedding_threshold = (None if embedding_local_norm_threshold is None
                                    else float(embedding_local_norm_threshold))
        self.report_interval = check_log_interval(report_interval, "GlobalNormSkipGuard.report_interval")
        self._consecutive = 0            # host values as of the last report ...
        self._total_skipped = 0
        self._device: Optional[dict[str, torch.Tensor]] = None   # ... and the device state since
        self._pending: list[tuple[int, torch.Tensor]] = []       # (step, [skip, norm, emb, has emb, consecutive, over])
        self._trainer: Any = None

    # -- host view (reading it reports what the device decided) ---------------------------------
    @property
    def consecutive(self) -> int:
        """Consecutive skipped steps up to the last step (reading it reports pending decisions)."""
        self.report()
        return self._consecutive

    @consecutive.setter
    def consecutive(self, value: int) -> None:
        self.report()
        self._consecutive = int(value)
        self._device = None

    @property
    def total_skipped(self) -> int:
        self.report()
        return self._total_skipped

    def state_dict(self) -> dict[str, int]:
        # saved with the checkpoint: a resume continues the count of consecutive skips. Reporting first
        # means a run that went over the limit raises here instead of saving that state.
        self.report()
        return {"consecutive": self._consecutive, "total_skipped": self._total_skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = []
        self._device = None
        self._consecutive = int(state_dict.get("consecutive", 0))
        self._total_skipped = int(state_dict.get("total_skipped", 0))

    # -- the decision, on the device --------------------------------------------------------------
    def should_skip(self, trainer: Any, pl_module: Any, grad_norm: torch.Tensor) -> torch.Tensor:
        self._trainer = trainer
        norm = grad_norm.detach().float().reshape(())
        device = norm.device
        if self._device is None:
            self._device = {"consecutive": torch.full((), self._consecutive, dtype=torch.int64, device=device),
                            "over": torch.zeros((), dtype=torch.bool, device=device)}
        state = self._device
        bad = ~torch.isfinite(norm) | (norm > self.threshold)
        emb = torch.zeros((), device=device)
        has_emb = torch.zeros((), device=device)
        if self.embedding_threshold is not None:
            # Always computed (when enabled) so that every rank joins the same collectives.
            found = _embedding_grad_norm(pl_module, trainer)
            if found is not None:
                emb = found[0].detach().float().reshape(()).to(device)
                has_emb = found[1].detach().float().reshape(()).to(device)
                bad = bad | ((has_emb > 0) & ~(emb <= self.embedding_threshold))   # NaN counts as too large
        consecutive = torch.where(bad, state["consecutive"] + 1, 0)
        over = state["over"] | (consecutive > self.max_consecutive)
        state["consecutive"], state["over"] = consecutive, over
        step = steps_done(trainer, pl_module) + 1
        self._pending.append((step, torch.stack([bad.float(), norm, emb, has_emb, consecutive.float(),
                                                        over.float()])))
        return bad | over

    # -- reporting, on the host ------------------------------------------------------------------
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._trainer = trainer
        if is_log_step(steps_done(trainer, pl_module), self.report_interval):
            self.report()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._trainer = trainer
        self.report()

    def _reasons(self, norm: float, emb: float, has_emb: float) -> list[str]:
        reasons = []
        if not math.isfinite(norm):
            reasons.append(f"global gradient norm is {norm}")
        elif norm > self.threshold:
            reasons.append(f"global gradient norm {norm:.6g} > global_norm_skip_threshold {self.threshold:g}")
        if self.embedding_threshold is not None and has_emb and not (emb <= self.embedding_threshold):
            reasons.append(f"embedding gradient norm {emb:.6g} > embedding_local_norm_threshold "
                           f"{self.embedding_threshold:g}")
        return reasons

    def report(self) -> None:
        """Read back the decisions since the last report (one host sync): a warning line per skipped
        step, and :class:`SkipLimitExceeded` for a run of too many consecutive skips."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        rows = torch.stack([r for _, r in pending]).cpu().tolist()
        zero = getattr(self._trainer, "is_global_zero", True)
        for (step, _), (bad, norm, emb, has_emb, consecutive, over) in zip(pending, rows):
            consecutive = int(consecutive)
            if over:
                self._device = None
                self._consecutive = consecutive
                raise SkipLimitExceeded(
                    f"step {step}: {consecutive} consecutive steps skipped "
                    f"({'; '.join(self._reasons(norm, emb, has_emb))}), more than "
                    f"monitor.health_checkpoint.global_norm_skip_time={self.max_consecutive}; "
                    "stopping without saving this state")
            self._consecutive = consecutive
            if bad:
                self._total_skipped += 1
                if zero:
                    emit(f"WARNING: step {step}: update skipped: {'; '.join(self._reasons(norm, emb, has_emb))} "
                         f"({consecutive} consecutive, limit {self.max_consecutive})", error=True)
