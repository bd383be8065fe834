"""The step contract: what one optimizer step produces and who may act on it.

``LitMoE.training_step`` runs one optimizer step per call (the ``A`` micro-batches of the step, then
norm → observers → guards → clip → optimizer → schedule → expert bias) and publishes one frozen
:class:`StepMetrics`. Callbacks read it in ``on_train_batch_end``, which fires once per optimizer
step; nobody writes into it. Two kinds of callbacks take part in the step itself:

* a :class:`GradientObserver` sees the accumulated, pre-clip gradients of every step (skipped ones
  included) and cannot change anything;
* a :class:`StepGuard` may veto the update (``should_skip``); every guard is asked, in callback order.

The module talks to the strategy through :class:`StepStrategy` only (``AscendFSDPStrategy``
derives from it, for one process too); the checkpoint callback uses it too.

This module is the bottom of the package: it imports nothing from ``lit_moe``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from torch import nn


@dataclass(frozen=True)
class MoEStepStats:
    """Routing statistics of one step, one row per MoE layer in ``model.moe_layers()`` order (MTP
    layers included), summed over the step's micro-batches and over the data-parallel ranks (the
    tensor-, context- and expert-parallel ranks of one data-parallel rank route the same tokens, so
    they are counted once). CPU tensors."""

    tokens_per_expert: torch.Tensor
    """``[L, E]`` tokens routed to each expert (the counts the expert-bias update used)."""
    aux_loss: Optional[torch.Tensor]
    """``[L]`` load-balancing loss per layer without its coefficient, mean over micro-batches and
    data-parallel ranks; None when ``moe_aux_loss_coeff`` is 0."""
    expert_bias: torch.Tensor
    """``[L, E]`` the aux-loss-free routing bias after this step's update."""
    dropped: torch.Tensor
    """``[L]`` token-expert assignments dropped by the capacity."""
    assigned: torch.Tensor
    """``[L]`` token-expert assignments routed."""


@dataclass(frozen=True)
class StepMetrics:
    """What one optimizer step produced (``LitMoE.step_metrics``, None before the first step).
    The same on every rank (losses and counts are reduced over ranks before it is built)."""

    step: int
    """Optimizer steps done, this one included (skipped steps count: ``trainer.global_step``)."""
    loss: float
    """Language-model loss of the global batch (mean over micro-batches and ranks)."""
    aux_loss: Optional[float]
    """MoE balancing loss (coefficient included), mean like ``loss``; None for a model without it."""
    mtp_loss: Optional[float]
    """Multi-token-prediction loss (scaling included), mean like ``loss``; None without MTP."""
    grad_norm: float
    """Global L2 norm of the accumulated gradients before clipping (fp32, every mesh)."""
    lr: float
    """Learning rate of the first parameter group that this update used."""
    skipped: bool
    """A :class:`StepGuard` vetoed this update (parameters, optimizer and schedule untouched)."""
    skipped_steps: int
    """Skipped updates so far in the whole run (resumed runs included)."""
    consumed_samples: int
    """Global samples trained on so far: ``step × global_batch_size``."""
    tokens: int
    """Tokens of this step's global batch, each counted once however many ranks worked on it."""
    step_time: float
    """Wall seconds since the previous step ended (data fetching, every micro-batch and the
    previous step's callbacks included); the first step: since training started."""
    micro_losses: tuple[float, ...]
    """This rank's ``1/A``-scaled language-model loss of each micro-batch (their sum is this
    rank's step loss)."""
    moe: Optional[MoEStepStats]
    """Routing statistics; None for a dense model."""


class GradientObserver(Callback):
    """A callback that sees every step's accumulated gradients before clipping.

    ``on_gradients_before_clip`` is called once per optimizer step, after the global norm is known
    and before any :class:`StepGuard` is asked (so skipped steps are seen too), with the gradients
    in ``p.grad``. It must not change them. It runs on every rank: collectives are allowed when
    every rank makes the same ones."""

    def on_gradients_before_clip(self, trainer: Any, pl_module: Any, grad_norm: torch.Tensor) -> None:
        raise NotImplementedError


class StepGuard(Callback):
    """A callback the module asks, once per optimizer step, whether to skip the update.

    Called after the observers with the accumulated, pre-clip gradients still in place. Every guard
    is asked (no short-circuit: guards may keep state). The answer must be the same on every rank,
    since the module acts on it collectively. When any guard says True the gradients are dropped and
    the optimizer and schedule are not stepped; parameters, moments and step counts stay as they
    were, while the step still counts."""

    def should_skip(self, trainer: Any, pl_module: Any, grad_norm: torch.Tensor) -> bool:
        raise NotImplementedError


class PipelineStep(Protocol):
    """What the step calls on a pipeline schedule (``lit_moe.strategies.pipeline.PipelineParallel``;
    a typing aid only, never checked at run time)."""

    def forward_backward_record(self, micro_batches: list) -> Any:
        """Run the step's micro-batches through every stage; return the losses as the step keeps them."""


class StepStrategy(ABC):
    """What ``LitMoE`` and lit_moe's callbacks need from the strategy. ``AscendFSDPStrategy``
    derives from it (one process too). A nominal base class, not a structural protocol: code that
    also runs under other strategies (the checkpoint callback under a user's plain Lightning
    strategy) asks ``isinstance(strategy, StepStrategy)`` and then uses these members, typed,
    instead of probing attributes; a subclass that misses one cannot be instantiated."""

    pipeline: Optional[PipelineStep] = None
    """The pipeline schedule with ``pipeline_parallel > 1`` (it runs all micro-batches of a step
    through every stage); None: the module runs the micro-batches itself."""

    @property
    @abstractmethod
    def root_device(self) -> torch.device:
        """This rank's device."""

    @abstractmethod
    def parallelize(self, model: nn.Module) -> nn.Module:
        """Apply the parallel layout to the (meta-device) model."""

    @abstractmethod
    def set_gradient_sync(self, enabled: bool) -> None:
        """Reduce gradients after the coming backward (``enabled``) or keep accumulating them."""

    @abstractmethod
    def grad_norm(self, parameters: list[torch.Tensor]) -> torch.Tensor:
        """Global fp32 L2 norm of the gradients over every mesh, each value counted once."""

    @abstractmethod
    def clip_grads_with_norm_(self, parameters: list[torch.Tensor], max_norm: float,
                              total_norm: torch.Tensor) -> None:
        """Scale the gradients in place so that their norm ``total_norm`` is at most ``max_norm``."""

    @property
    @abstractmethod
    def expert_count_group(self) -> Optional[dist.ProcessGroup]:
        """Ranks over which MoE token counts are summed (data × context parallel); None: one process."""

    @property
    @abstractmethod
    def batch_replicas(self) -> int:
        """How many ranks receive each sample (tensor × context parallel): the global token count
        is the sum over ranks divided by this."""

    @abstractmethod
    def parallel_degrees(self) -> dict[str, int]:
        """The layout's degrees by name (``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, ``ep``,
        ``pp``), as the checkpoint's ``common.json`` records them."""

    @property
    @abstractmethod
    def collective_timeout(self) -> Optional[timedelta]:
        """How long a rank waits for the others in a collective (the run's process-group timeout;
        the checkpoint's own gloo group uses it too, so that a dead rank ends a save with an error)."""
