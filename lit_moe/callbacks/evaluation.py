"""Evaluation during training: ``training.eval_interval`` and ``training.eval_iters``.

Every ``eval_interval`` optimizer steps (0 = never) the model runs a no-grad forward over
``eval_iters`` micro-batches of the evaluation data on every data-parallel rank, in eval mode
(no dropout; MoE token counters and expert biases untouched, as for every no-grad forward), and
``val/loss`` (the mean of the micro-batches' masked-mean cross-entropy over micro-batches and
ranks, the definition of ``train/loss``; balancing and MTP losses are not included) and ``val/ppl``
(``exp(val/loss)``) go to the console and to every logger (TensorBoard and the ``trainer.logger``
loggers) at that step.

The evaluation data is the valid split of the train blend (``train_dataset.dataloader.sizes[1]``
samples, documents chosen by ``split``), or, when the config has a top-level ``eval_dataset``
section (shaped like ``train_dataset``; MindFormers' key), the first split of that section's
dataset. Each evaluation reads the same samples: micro-batch ``k`` of data-parallel rank ``r`` is
samples ``[(k·D + r)·b, (k·D + r + 1)·b)`` of the split (``D`` data-parallel ranks, ``b`` =
``local_batch_size``), so successive values are comparable, there is no evaluation position to
checkpoint, and a resumed run evaluates exactly what the uninterrupted run does. Samples are read
by index (no DataLoader, no random state touched; the RNG states are restored after the pass, so
training continues bit-identically with or without evaluation). Ranks of one tensor/context
parallel group read the same samples, like training. The strategy runs the micro-batches through the
whole model (:meth:`lit_moe.step.StepStrategy.eval_loss`; a pipeline through its stages, the last
stage's loss reaching every rank of the pipeline) before the mean over data-parallel ranks.

The pass costs one host synchronisation (the final all-reduce of the loss); steps without an
evaluation cost nothing (the check is integer arithmetic on the step count).
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback

from lit_moe.config import ConfigError
from lit_moe.step import StepStrategy, mean_eval_loss


def check_eval_settings(eval_interval: Any, eval_iters: Any) -> tuple[int, int]:
    for name, value, low in (("eval_interval", eval_interval, 0), ("eval_iters", eval_iters, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"training.{name}: must be an integer >= {low}, got {value!r}")
    return eval_interval, eval_iters


class Evaluation(Callback):
    """Runs the evaluation pass (see the module docstring) after every ``eval_interval``-th
    optimizer step.

    Args:
        eval_interval: optimizer steps between evaluations (0: never).
        eval_iters: micro-batches per data-parallel rank per evaluation.
        eval_spec: the parsed ``eval_dataset.dataloader`` (a ``DataloaderSpec``); None: the valid
            split of the train blend the DataModule built.
        local_batch_size: samples per micro-batch (``training.local_batch_size``).
        log_samples: also write ``"val/* vs samples"`` to TensorBoard.
    """

    def __init__(self, eval_interval: int, eval_iters: int, local_batch_size: int,
                 eval_spec: Any = None, log_samples: bool = True) -> None:
        self.eval_interval, self.eval_iters = check_eval_settings(eval_interval, eval_iters)
        self.local_batch_size = local_batch_size
        self.eval_spec = eval_spec
        self.log_samples = log_samples
        self.dataset: Any = None
        self.last: Optional[dict[str, float]] = None   # the latest result (step, val/loss, val/ppl)
        self._last_step: Optional[int] = None

    @property
    def source(self) -> str:
        return "eval_dataset" if self.eval_spec is not None else "train_dataset.dataloader.sizes[1] (valid split)"

    # -- data ------------------------------------------------------------------------------
    def _data_parallel(self, trainer: Any) -> tuple[int, int]:
        dm = getattr(trainer, "datamodule", None)
        if dm is not None and hasattr(dm, "dp_rank"):
            return int(dm.dp_rank), int(dm.dp_size)
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        return int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1))

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.eval_interval == 0 or self.dataset is not None:
            return
        if self.eval_spec is not None:
            from lit_moe.data.loader import build_from_spec

            self.dataset = build_from_spec(self.eval_spec)[0]
            where = "eval_dataset (its first split)"
        else:
            dm = getattr(trainer, "datamodule", None)
            if dm is None or not hasattr(dm, "datasets"):
                raise ConfigError("training.eval_interval: evaluation needs the run's DataModule (valid split) or "
                                  "an eval_dataset section")
            if dm.datasets is None:
                dm.setup("fit")
            self.dataset = dm.datasets[1]
            where = "the valid split (train_dataset.dataloader.sizes[1] and split)"
        rank, size = self._data_parallel(trainer)
        needed = self.eval_iters * self.local_batch_size * size
        have = 0 if self.dataset is None else len(self.dataset)
        if have < needed:
            raise ConfigError(
                f"training.eval_iters: {self.eval_iters} micro-batches of {self.local_batch_size} samples on "
                f"{size} data-parallel rank(s) need {needed} evaluation samples; {where} holds {have}"
                + (" (set it, and a split with a valid part, or give an eval_dataset section)" if have == 0 else
                   "; lower eval_iters or provide more evaluation samples"))

    def micro_batch(self, k: int, rank: int, size: int) -> dict[str, torch.Tensor]:
        """Micro-batch ``k`` of data-parallel rank ``rank`` (CPU tensors)."""
        from lit_moe.data.datamodule import collate_samples

        b = self.local_batch_size
        start = (k * size + rank) * b
        return collate_samples([self.dataset[i] for i in range(start, start + b)])

    # -- the pass --------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.eval_interval > 0 and step > 0 and step % self.eval_interval == 0

    @torch.no_grad()
    def evaluate(self, trainer: Any, pl_module: Any) -> float:
        """The no-grad pass; returns ``val/loss`` (every rank gets the same value)."""
        model = pl_module.model
        device = trainer.strategy.root_device
        rank, size = self._data_parallel(trainer)
        was_training = model.training
        devices = [device] if device.type == "cuda" else []
        strategy = trainer.strategy
        with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
            model.eval()
            try:
                batches = [{key: v.to(device, non_blocking=True) for key, v in self.micro_batch(k, rank, size).items()}
                           for k in range(self.eval_iters)]
                # the strategy runs them through the whole model (every rank of one model replica
                # gets the value, whatever part of the model it holds)
                total = (strategy.eval_loss(model, batches) if isinstance(strategy, StepStrategy)
                         else mean_eval_loss(model, batches)).to(device)
            finally:
                model.train(was_training)
        if dist.is_available() and dist.is_initialized():
            # every rank holds the loss of its micro-batches (ranks of one tp/cp group and of one
            # pipeline the same value), so the mean over the world is the mean over data-parallel ranks
            dist.all_reduce(total)
            total = total / dist.get_world_size()
        return float(total)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = int(trainer.global_step)
        if not self.due(step) or step == self._last_step:
            return
        self._last_step = step
        start = time.perf_counter()
        loss = self.evaluate(trainer, pl_module)
        seconds = time.perf_counter() - start
        ppl = math.exp(loss) if loss < 700 else math.inf
        self.last = {"step": step, "val/loss": loss, "val/ppl": ppl}
        if not trainer.is_global_zero:
            return
        from lit_moe.callbacks._common import add_scalar, emit, tb_writer

        emit(f"validation step {step} | val/loss {loss:.6f} | val/ppl {ppl:.4f} | "
             f"{self.eval_iters} micro-batches x {self._data_parallel(trainer)[1]} rank(s) | {seconds:.2f}s")
        writer = tb_writer(trainer)
        samples = pl_module.consumed_samples if self.log_samples else None
        add_scalar(writer, "val/loss", loss, step, samples or None)
        add_scalar(writer, "val/ppl", ppl, step, samples or None)


def build_evaluation(training: Any, eval_dataset: Any, seq_length: Optional[int]) -> Optional[Evaluation]:
    """The run's :class:`Evaluation` from ``training.eval_interval`` / ``eval_iters`` and the
    optional ``eval_dataset`` section, or None when ``eval_interval`` is 0 (an ``eval_dataset`` is
    then validated but unused, as MindFormers builds it without using it)."""
    interval, iters = check_eval_settings(training.eval_interval, training.eval_iters)
    spec = None
    if eval_dataset is not None:
        from lit_moe.data.loader import parse_dataloader

        section = eval_dataset if isinstance(eval_dataset, dict) else vars(eval_dataset)
        dataloader = section.get("dataloader")
        if not isinstance(dataloader, dict) or not dataloader:
            raise ConfigError("eval_dataset.dataloader: missing; eval_dataset is shaped like train_dataset "
                              "(dataloader: {type, sizes, config: {data_path, ...}})")
        try:
            spec = parse_dataloader(dataloader, seq_length)
        except ConfigError as err:   # its messages name train_dataset's fields
            raise ConfigError(str(err).replace("train_dataset.", "eval_dataset.")) from None
    if interval == 0:
        return None
    return Evaluation(interval, iters, training.local_batch_size, spec)
