"""The step contract: what one optimizer step produces and who may act on it.

``LitMoE.training_step`` runs one optimizer step per call (its batch is the step: the ``A``
micro-batches, then norm → observers → guards → clip → optimizer → schedule → expert bias) and
publishes one read-only :class:`StepMetrics`. Callbacks read it in ``on_train_batch_end`` (every call
finishes a step); nobody writes into it. The step itself never waits for the device (no host sync): losses,
norms, counts, the skip decision, the learning rate and the update all stay on the device, and
:class:`StepMetrics` copies its numbers to the host only when they are read, which the built-in
callbacks do on log steps only. Two kinds of callbacks take part in the step itself:

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
from typing import Any, Iterable, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from torch import nn


@dataclass(frozen=True)
class MoEStepStats:
    """Routing statistics of one step, one row per MoE layer in ``model.moe_layers()`` order (MTP
    layers included), summed over the step's micro-batches and over the data-parallel ranks (the
    tensor-, context- and expert-parallel ranks of one data-parallel rank route the same tokens, so
    they are counted once). Tensors on the training device, as the step left them: reading them is a
    host sync, so readers do it on log steps only (:meth:`cpu` copies all of them at once)."""

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

    def cpu(self) -> "MoEStepStats":
        """The same statistics as CPU tensors (one host sync)."""
        return MoEStepStats(*(None if t is None else t.cpu() for t in
                              (self.tokens_per_expert, self.aux_loss, self.expert_bias, self.dropped,
                               self.assigned)))


# Fields of StepMetrics that may arrive as tensors on the device and are read on the host lazily.
_LAZY_FIELDS = ("loss", "aux_loss", "mtp_loss", "indexer_loss", "grad_norm", "lr", "skipped", "skipped_steps", "tokens",
                "micro_losses")


class StepMetrics:
    """What one optimizer step produced (``LitMoE.step_metrics``, None before the first step).
    Losses, token count, gradient norm and learning rate are the same on every rank (reduced over
    ranks before it is built), and so is ``moe`` (every MoE layer of the model, whatever part of it
    this rank holds); ``micro_losses`` are this rank's. Read-only.

    The step leaves its numbers on the device: reading any of ``loss``, ``aux_loss``, ``mtp_loss``,
    ``grad_norm``, ``lr``, ``skipped``, ``skipped_steps``, ``tokens`` or ``micro_losses`` copies all of
    them to the host at once (one host sync, on the first read; :meth:`materialize` does it
    explicitly) and gives Python numbers. ``step``, ``consumed_samples``, ``step_time`` and ``moe``
    cost nothing. Built-in callbacks read the lazy fields on log steps only, so other steps never
    wait for the device.

    Fields (constructor keywords; the lazy ones take a Python number or a 0-d tensor, ``micro_losses``
    a sequence of numbers / 0-d tensors or a 1-d tensor):

    * ``step``: optimizer steps done, this one included (skipped steps count: ``trainer.global_step``).
    * ``loss``: language-model loss of the global batch (mean over micro-batches and ranks).
    * ``aux_loss``: MoE balancing loss (coefficient included), mean like ``loss``; None for a model
      without it.
    * ``mtp_loss``: multi-token-prediction loss (scaling included), mean like ``loss``; None without MTP.
    * ``indexer_loss``: DeepSeek-V3.2's indexer KL loss (sum over the indexers, coefficient included),
      mean like ``loss``; None without ``dsa_indexer_loss_coeff``.
    * ``grad_norm``: global L2 norm of the accumulated gradients before clipping (fp32, every mesh).
    * ``lr``: learning rate of the first parameter group that this update used.
    * ``skipped``: a :class:`StepGuard` vetoed this update (parameters, optimizer and schedule untouched).
    * ``skipped_steps``: skipped updates so far in the whole run (resumed runs included).
    * ``consumed_samples``: global samples trained on so far (``LitMoE.consumed_samples``: the DataModule's
      count, ``step × accumulation × local_batch_size × data_parallel``; a ``global_batch_size`` that is
      not a multiple of ``local_batch_size × data_parallel`` drops its remainder).
    * ``tokens``: tokens of this step's global batch, each counted once however many ranks worked on it.
    * ``step_time``: wall seconds since the previous step ended (data fetching, every micro-batch and
      the previous step's callbacks included); the first step: since training started. Host time:
      between log steps the host runs ahead of the device, so one step's value is only meaningful
      averaged over a log interval.
    * ``micro_losses``: this rank's ``1/A``-scaled language-model loss of each micro-batch (their sum is
      this rank's step loss).
    * ``moe``: routing statistics (:class:`MoEStepStats`, device tensors); None for a dense model.
    """

    __slots__ = ("step", "consumed_samples", "step_time", "moe", "_raw", "_values")

    def __init__(self, *, step: int, loss: Any, aux_loss: Any, mtp_loss: Any, grad_norm: Any, lr: Any,
                 skipped: Any, skipped_steps: Any, consumed_samples: int, tokens: Any, step_time: float,
                 micro_losses: Any, moe: Optional[MoEStepStats], indexer_loss: Any = None) -> None:
        set_ = object.__setattr__
        set_(self, "step", int(step))
        set_(self, "consumed_samples", int(consumed_samples))
        set_(self, "step_time", float(step_time))
        set_(self, "moe", moe)
        set_(self, "_raw", dict(loss=loss, aux_loss=aux_loss, mtp_loss=mtp_loss, indexer_loss=indexer_loss, grad_norm=grad_norm, lr=lr,
                                skipped=skipped, skipped_steps=skipped_steps, tokens=tokens,
                                micro_losses=micro_losses))
        set_(self, "_values", None)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"StepMetrics is read-only (tried to set {name!r})")

    @property
    def materialized(self) -> bool:
        """Whether the lazy fields were already read (reading them again costs nothing)."""
        return self._values is not None

    def materialize(self) -> "StepMetrics":
        """Copy every lazy field to the host now (one transfer per device holding them)."""
        if self._values is not None:
            return self
        raw = dict(self._raw)
        micro = raw.pop("micro_losses")
        if isinstance(micro, torch.Tensor):
            micro = list(micro.reshape(-1).unbind(0)) if micro.numel() else []
        micro = list(micro)
        items = [(k, v) for k, v in raw.items()] + [(("micro", i), v) for i, v in enumerate(micro)]
        by_device: dict[torch.device, list] = {}
        for key, v in items:
            if isinstance(v, torch.Tensor):
                by_device.setdefault(v.device, []).append((key, v))
        host: dict = {key: v for key, v in items if not isinstance(v, torch.Tensor)}
        for entries in by_device.values():
            # float64 holds every fp32 value, the float64 losses and integer counts below 2**53 exactly
            packed = torch.stack([v.detach().reshape(()).to(torch.float64) for _, v in entries]).cpu()
            for (key, _), value in zip(entries, packed.tolist()):
                host[key] = value
        values = {
            "loss": float(host["loss"]),
            "aux_loss": None if host["aux_loss"] is None else float(host["aux_loss"]),
            "mtp_loss": None if host["mtp_loss"] is None else float(host["mtp_loss"]),
            "indexer_loss": None if host["indexer_loss"] is None else float(host["indexer_loss"]),
            "grad_norm": float(host["grad_norm"]),
            "lr": float(host["lr"]),
            "skipped": bool(host["skipped"]),
            "skipped_steps": int(host["skipped_steps"]),
            "tokens": int(round(host["tokens"])),
            "micro_losses": tuple(float(host[("micro", i)]) for i in range(len(micro))),
        }
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_raw", None)   # the device tensors are no longer needed
        return self

    def _get(self, name: str) -> Any:
        return self.materialize()._values[name]

    loss = property(lambda self: self._get("loss"), doc="Language-model loss of the global batch.")
    aux_loss = property(lambda self: self._get("aux_loss"), doc="MoE balancing loss, or None.")
    mtp_loss = property(lambda self: self._get("mtp_loss"), doc="Multi-token-prediction loss, or None.")
    indexer_loss = property(lambda self: self._get("indexer_loss"), doc="DeepSeek-V3.2's indexer loss, or None.")
    grad_norm = property(lambda self: self._get("grad_norm"), doc="Global pre-clip gradient norm.")
    lr = property(lambda self: self._get("lr"), doc="Learning rate this update used (first group).")
    skipped = property(lambda self: self._get("skipped"), doc="A StepGuard vetoed this update.")
    skipped_steps = property(lambda self: self._get("skipped_steps"), doc="Skipped updates so far.")
    tokens = property(lambda self: self._get("tokens"), doc="Tokens of this step's global batch.")
    micro_losses = property(lambda self: self._get("micro_losses"), doc="1/A-scaled micro-batch losses.")

    def __repr__(self) -> str:
        lazy = ", ".join(f"{k}={self._values[k]!r}" for k in _LAZY_FIELDS) if self.materialized else "not read yet"
        return f"StepMetrics(step={self.step}, consumed_samples={self.consumed_samples}, {lazy})"


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
    since the module acts on it collectively. When any guard says True the update is dropped: the
    optimizer and schedule are not advanced, and parameters, moments, step counts and expert biases
    stay as they were, while the step still counts.

    The answer may be a Python bool or a 0-d bool tensor on the training device. A tensor keeps the
    step free of host syncs: the module acts on it on the device (no host branch), and the guard
    reports what it decided on log steps."""

    def should_skip(self, trainer: Any, pl_module: Any, grad_norm: torch.Tensor) -> Union[bool, torch.Tensor]:
        raise NotImplementedError


@dataclass
class StepRecord:
    """What a strategy that runs a step's micro-batches itself (a pipeline schedule) hands the step:
    the losses as the step keeps them, the same on every rank of one model replica."""

    losses: torch.Tensor             # [loss, aux_loss, mtp_loss, indexer_loss], each the mean over micro-batches
    micro_losses: list[float]        # main loss of each micro-batch / A
    moe_aux: Optional[torch.Tensor]  # this rank's MoE layers: balancing loss summed over micro-batches
    has_aux: bool
    has_mtp: bool
    has_indexer: bool = False


def model_moe_block_ids(model: Any) -> Optional[list[int]]:
    """Block id (decoder layer index, MTP layers after the decoder) of each of ``model.moe_layers()``,
    found by locating each inside ``model.blocks()`` (``model.block_ids()`` names them when the model
    holds some blocks only); None when the model does not expose them."""
    try:
        moe_layers = list(model.moe_layers())
        blocks = list(model.blocks())
    except (AttributeError, TypeError):
        return None
    row_of = {id(m): k for k, m in enumerate(moe_layers)}
    ids: list[Optional[int]] = [None] * len(moe_layers)
    block_ids = list(model.block_ids()) if hasattr(model, "block_ids") else range(len(blocks))
    for block_id, block in zip(block_ids, blocks):
        for sub in block.modules():
            if id(sub) in row_of:
                ids[row_of[id(sub)]] = block_id
    if any(i is None for i in ids):
        return None
    return ids  # type: ignore[return-value]


@torch.no_grad()
def mean_eval_loss(model: nn.Module, micro_batches: Iterable[dict]) -> torch.Tensor:
    """Mean main (language-model) loss of ``micro_batches`` through ``model`` (fp64 0-d tensor)."""
    total, n = None, 0
    for batch in micro_batches:
        loss = model(**batch).loss.detach().to(torch.float64)
        total = loss if total is None else total + loss
        n += 1
    return total / n


class StepStrategy(ABC):
    """What ``LitMoE`` and lit_moe's callbacks need from the strategy. ``AscendFSDPStrategy``
    derives from it (one process too). A nominal base class, not a structural protocol: code that
    also runs under other strategies (the checkpoint callback under a user's plain Lightning
    strategy) asks ``isinstance(strategy, StepStrategy)`` and then uses these members, typed,
    instead of probing attributes; a subclass that misses one cannot be instantiated."""

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
        """How many ranks receive each sample (tensor × context × pipeline parallel: every rank of
        one data-parallel rank's model replica): the global token count is the sum over ranks divided
        by this."""

    @abstractmethod
    def parallel_degrees(self) -> dict[str, int]:
        """The layout's degrees by name (``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, ``ep``,
        ``pp``), as the checkpoint's ``common.json`` records them."""

    @property
    @abstractmethod
    def collective_timeout(self) -> Optional[timedelta]:
        """How long a rank waits for the others in a collective (the run's process-group timeout;
        the checkpoint's own gloo group uses it too, so that a dead rank ends a save with an error)."""

    # -- what the step, the callbacks and the checkpoint code ask, whatever the layout ----------------
    @abstractmethod
    def run_micro_batches(self, micro_batches: list[dict]) -> Optional[StepRecord]:
        """Forward and backward of a step's micro-batches when the strategy schedules them itself
        (pipeline parallel: through every stage), gradients accumulated; returns what the step
        records of them. None: nothing was run, the module runs each micro-batch through its model."""

    @abstractmethod
    def embedding_grad_norm(self, model: nn.Module) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Global L2 norm of the input-embedding gradient and 1.0 when there is one (0.0 else), as
        device tensors, the same on every rank; None when this rank knows there is none. Every rank
        calls it (it may take part in collectives)."""

    @abstractmethod
    def whole_model_moe(self, moe: Optional[MoEStepStats]) -> Optional[MoEStepStats]:
        """The whole model's routing statistics from this rank's (``moe``: its model's MoE layers, None
        without any), rows in :meth:`moe_block_ids` order, on the device; every rank calls it once per step."""

    @abstractmethod
    def moe_block_ids(self, model: nn.Module) -> Optional[list[int]]:
        """Block id of each row of :meth:`whole_model_moe`'s statistics (None: the model does not say)."""

    @abstractmethod
    def eval_loss(self, model: nn.Module, micro_batches: list[dict]) -> torch.Tensor:
        """Mean main loss of ``micro_batches`` through the whole model, no gradients, in eval mode
        (fp64 0-d tensor, the same on every rank of one model replica); every rank calls it."""

    @property
    @abstractmethod
    def holds_whole_model(self) -> bool:
        """Whether this rank's model has every tensor of the model (False: a pipeline stage's part; a
        checkpoint's other tensors are then the other ranks' to load)."""
