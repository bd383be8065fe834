"""Global-norm skip protection (``monitor.health_checkpoint``).

Seed 000 §2: ``max_norm`` is the soft protection (scale the gradients and update anyway);
``global_norm_skip_threshold`` is the hard one: when the global gradient norm is too large (or
NaN/Inf) the update of that step is skipped. More than ``global_norm_skip_time`` consecutive skips
are treated as a failure. MindFormers parses these fields but never acts on them; we implement what
the seed documents.

The guard is a :class:`lit_moe.step.StepGuard`: once per optimizer step the module computes the
global pre-clip gradient norm, then asks **every** guard (no short-circuit: guards may keep state)
**before** clipping. When any says True it drops the gradients and steps neither the optimizer nor
the LR schedule, so parameters, optimizer moments and step counters stay exactly as they were.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from lit_moe.config import ConfigError
from lit_moe.callbacks._common import emit, steps_done, to_float
from lit_moe.step import StepGuard
from lit_moe.strategies.clip import global_grad_norm


class SkipLimitExceeded(RuntimeError):
    """Too many consecutive skipped steps. Raised from ``should_skip`` before anything of the bad
    step is applied; the CLI prints the one-line message and exits non-zero. Checkpoint callbacks
    must not save on this exception (the last saved checkpoint is the last healthy state)."""


def _embedding_grad_norm(pl_module: Any, trainer: Any = None) -> Optional[float]:
    """Global L2 norm of the input-embedding gradient, or None when there is none."""
    pipeline = getattr(getattr(trainer, "strategy", None), "pipeline", None)
    if pipeline is not None:   # only some stages hold the embedding: every rank joins its norm's collectives
        norm = pipeline.embedding_grad_norm()
        return None if norm is None else to_float(norm)
    model = getattr(pl_module, "model", None)
    embed = getattr(model, "embed_tokens", None)
    weight = getattr(embed, "weight", None)
    if weight is None or weight.grad is None:
        return None
    return to_float(global_grad_norm([weight]))  # mesh-aware (DTensor placements, mixed meshes)


class GlobalNormSkipGuard(StepGuard):
    """Skip the optimizer update when the global gradient norm exceeds ``global_norm_skip_threshold``
    or is not finite, or when the input-embedding gradient norm exceeds
    ``embedding_local_norm_threshold``; stop training after more than ``global_norm_skip_time``
    consecutive skips.

    Args:
        global_norm_skip_threshold: skip when the global norm is above this. ``.inf`` keeps only
            the NaN/Inf check.
        global_norm_skip_time: allowed consecutive skips; one more raises :class:`SkipLimitExceeded`.
        embedding_local_norm_threshold: skip when the embedding gradient norm alone is above this;
            None disables the embedding check.
    """

    def __init__(self, global_norm_skip_threshold: float = 100.0, global_norm_skip_time: int = 10,
                 embedding_local_norm_threshold: Optional[float] = 100.0) -> None:
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
        self.consecutive = 0
        self.total_skipped = 0

    def _reasons(self, pl_module: Any, grad_norm: torch.Tensor, trainer: Any = None) -> list[str]:
        reasons = []
        norm = to_float(grad_norm)
        if not math.isfinite(norm):
            reasons.append(f"global gradient norm is {norm}")
        elif norm > self.threshold:
            reasons.append(f"global gradient norm {norm:.6g} > global_norm_skip_threshold "
                           f"{self.threshold:g}")
        if self.embedding_threshold is not None:
            # Always computed (when enabled) so that every rank joins the same collectives.
            emb = _embedding_grad_norm(pl_module, trainer)
            if emb is not None and not (emb <= self.embedding_threshold):  # NaN counts as too large
                reasons.append(f"embedding gradient norm {emb:.6g} > embedding_local_norm_threshold "
                               f"{self.embedding_threshold:g}")
        return reasons

    def state_dict(self) -> dict[str, int]:
        # saved with the checkpoint: a resume continues the count of consecutive skips
        return {"consecutive": self.consecutive, "total_skipped": self.total_skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.consecutive = int(state_dict.get("consecutive", 0))
        self.total_skipped = int(state_dict.get("total_skipped", 0))

    def should_skip(self, trainer: Any, pl_module: Any, grad_norm: torch.Tensor) -> bool:
        reasons = self._reasons(pl_module, grad_norm, trainer)
        step = steps_done(trainer, pl_module) + 1
        if not reasons:
            self.consecutive = 0
            return False
        self.consecutive += 1
        if self.consecutive > self.max_consecutive:
            raise SkipLimitExceeded(
                f"step {step}: {self.consecutive} consecutive steps skipped ({'; '.join(reasons)}), "
                f"more than monitor.health_checkpoint.global_norm_skip_time={self.max_consecutive}; "
                "stopping without saving this state")
        self.total_skipped += 1
        if getattr(trainer, "is_global_zero", True):
            emit(f"WARNING: step {step}: update skipped: {'; '.join(reasons)} "
                 f"({self.consecutive} consecutive, limit {self.max_consecutive})", error=True)
        return True
