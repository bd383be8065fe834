"""The LightningModule: the PyNative training step of MindFormers on top of Lightning.

One ``training_step`` call is one optimizer step: the batch is the step, a list of its ``A``
micro-batches, formed by the DataModule (:class:`~lit_moe.data.datamodule.StepSampler`) and moved to
the device by Lightning as any batch. It runs :meth:`LitMoE.forward_backward` over them (each
objective scaled by ``1/A``; a strategy that schedules the micro-batches itself, such as a pipeline,
runs them instead: :meth:`~lit_moe.step.StepStrategy.run_micro_batches`), then finishes the step:
global gradient norm (fp32, every mesh) → gradient observers → skip guards → clipping → optimizer
and LR schedule → expert-bias update from the token counts of the whole step, summed over
micro-batches and data-parallel ranks. It publishes a frozen :class:`~lit_moe.step.StepMetrics`.
So ``on_train_batch_end`` fires once per optimizer step, and a stop (``max_time``, a callback's
``should_stop``) can only happen between steps. Manual optimization keeps that order explicit and
lets a guard skip an update without touching the optimizer state. The strategy is reached through
:class:`~lit_moe.step.StepStrategy` only.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule

from lit_moe.config import TrainingConfig
from lit_moe.runtime.distributed import is_distributed, local_tensor, world_size
from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM
from lit_moe.optim.optimizers import step_on_device
from lit_moe.runtime.preemption import agree_on_signal, signal_flags
from lit_moe.step import GradientObserver, MoEStepStats, StepGuard, StepMetrics, StepStrategy

Batch = dict[str, torch.Tensor]


def _as_float64(t: torch.Tensor) -> torch.Tensor:
    """A detached 0-d loss as float64 on its device (a DTensor: its full value)."""
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.to(torch.float64)


class LitMoE(LightningModule):
    """Trains a :class:`DeepseekV3ForCausalLM` with the MindFormers PyNative step semantics.

    Needs :class:`~lit_moe.strategies.AscendFSDPStrategy` (``strategy="ascend_fsdp"``; it also
    serves one process).

    Args:
        model_config: the ``model:`` section, validated.
        optimizer: the ``optimizer:`` section (see :func:`lit_moe.optim.optimizers.build_optimizer`).
        lr_scheduler: the ``lr_scheduler:`` section (see :func:`lit_moe.optim.schedules.build_lr_lambda`).
        training: the ``training:`` section.
        accumulation_steps: micro-batches per optimizer step on each rank (``A``) until the first step
            arrives; from then on, the micro-batches of the current (or last) step.
        weights_loader: called as ``weights_loader(model, whole_model=...)`` with the materialised model
            after initialisation, to load weights only (fine-tuning from a checkpoint or a Hugging Face
            directory); ``whole_model``: :attr:`~lit_moe.step.StepStrategy.holds_whole_model`.
        lora: the ``lora_config`` section (:func:`lit_moe.lora.lora_settings`); None: no adapters.
    """

    def __init__(
        self,
        model_config: DeepseekV3Config,
        optimizer: dict,
        lr_scheduler: dict,
        training: TrainingConfig,
        accumulation_steps: int = 1,
        weights_loader: Optional[Callable[..., None]] = None,
        lora: Any = None,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model_config = model_config
        self.optimizer_section = dict(optimizer)
        self.lr_scheduler_section = dict(lr_scheduler)
        self.training_config = training
        self.accumulation_steps = int(accumulation_steps)
        self._step_samples = 0   # this rank's samples of the current (or last) step
        self._samples_counted: Optional[int] = None   # global samples so far, without a MegatronDataModule
        self.weights_loader = weights_loader
        from lit_moe.lora import check_lora_targets, lora_settings

        self.lora = lora_settings(lora)
        if self.lora is not None:
            check_lora_targets(model_config, self.lora)   # a pattern matching nothing fails here, not on the ranks
        self.model: Optional[DeepseekV3ForCausalLM] = None
        self.step_metrics: Optional[StepMetrics] = None   # the last finished step
        self.skipped_steps = 0   # host count; the steps' own skips add up on the device (see the property)
        self._last_step_end: Optional[float] = None         # wall clock of the previous step's end
        self._reset_step_accumulators()

    @property
    def step_strategy(self) -> StepStrategy:
        """The strategy, as the step uses it."""
        from lit_moe.strategies import AscendFSDPStrategy

        strategy = self.trainer.strategy
        if not isinstance(strategy, AscendFSDPStrategy):
            raise TypeError(f"LitMoE needs lit_moe's AscendFSDPStrategy (strategy='ascend_fsdp', one process "
                            f"too), got {type(strategy).__name__}")
        return strategy

    # ------------------------------------------------------------------------------------------
    # model construction
    # ------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        # Lightning calls this for every fit/validate/test: build once.
        if self.model is not None:
            return
        strategy = self.step_strategy
        # Build on the meta device: a 671B config never materialises whole on one rank.
        with torch.device("meta"):
            model = DeepseekV3ForCausalLM(self.model_config)
        if self.lora is not None:   # adapters before the layout, so that it shards them too
            from lit_moe.lora import apply_lora

            apply_lora(model, self.lora)
        model = strategy.parallelize(model)
        model.to_empty(device=strategy.root_device)
        # Layout-independent init from the run seed; a resumed run overwrites it with the
        # checkpoint afterwards (Lightning restores after configure_model), never the reverse.
        model.init_weights(self.training_config.seed)
        if self.lora is not None:
            from lit_moe.lora import init_adapters

            init_adapters(model, self.training_config.seed)
        if self.weights_loader is not None:
            self.weights_loader(model, whole_model=strategy.holds_whole_model)
        if self.lora is not None:   # base weights frozen: the optimizer sees the adapters only
            from lit_moe.lora import freeze_base

            freeze_base(model)
        self.model = model

    def forward(self, **batch: torch.Tensor):
        return self.model(**batch)

    # ------------------------------------------------------------------------------------------
    # optimizer
    # ------------------------------------------------------------------------------------------
    def configure_optimizers(self):
        from lit_moe.optim.optimizers import DeviceLambdaLR, build_optimizer
        from lit_moe.optim.schedules import build_lr_lambda

        peak_lr, lr_lambda = build_lr_lambda(self.lr_scheduler_section, self.training_config.steps)
        params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        optimizer = build_optimizer(params, self.optimizer_section, peak_lr, model=self.model)
        # the schedule's position lives on the device: a skipped update does not advance it, and nobody
        # has to read the skip decision on the host to know that
        scheduler = DeviceLambdaLR(optimizer, lr_lambda)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------------------------------
    # the training step
    # ------------------------------------------------------------------------------------------
    def on_train_start(self) -> None:
        self._last_step_end = time.perf_counter()

    def _step_wall_time(self) -> float:
        """Wall time since the previous step ended (the first: since training started): data
        fetching, every micro-batch and the previous step's callbacks (saves, logging) included."""
        now = time.perf_counter()
        start = self._last_step_end if self._last_step_end is not None else self._step_start
        self._last_step_end = now
        return now - start

    @property
    def skipped_steps(self) -> int:
        """Skipped updates so far in the whole run (reading it is a host sync)."""
        if self._skipped_on_device is not None:
            self._skipped_host += int(self._skipped_on_device)
            self._skipped_on_device = None
        return self._skipped_host

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped_host = int(value)
        self._skipped_on_device: Optional[torch.Tensor] = None

    def _reset_step_accumulators(self) -> None:
        # Kept on the device (float64: the sums are those of the host floats they replace, bit for bit);
        # nothing is read on the host until a log step reads the step's metrics.
        self._loss_sum: Any = None   # [4]: loss, aux, mtp, indexer (each already / A)
        self._has_aux = False
        self._has_mtp = False
        self._has_indexer = False
        self._micro_losses: list[Any] = []
        self._moe_aux_sum: Optional[torch.Tensor] = None
        self._step_start = time.perf_counter()
        self._tokens = 0

    @property
    def consumed_samples(self) -> int:
        """Global samples trained on so far: the DataModule's sampler position (what its loader's saved
        state holds and a resume continues after), the run's one consumed-samples number. With other
        data: the samples of this run's steps as they came (micro-batches × their samples × data parallel),
        after the steps before a resume counted at the size of this run's first step."""
        from lit_moe.data import MegatronDataModule

        dm = self.trainer.datamodule
        if isinstance(dm, MegatronDataModule):
            return dm.consumed_samples
        return self._samples_counted or 0

    def training_step(self, batch: list[Batch], batch_idx: int = 0) -> None:
        """One optimizer step; ``batch``: the step's micro-batches on the device."""
        self.accumulation_steps = len(batch)
        self._step_samples = sum(int(b["input_ids"].shape[0]) for b in batch)
        step_samples = self._step_samples * self.step_strategy.parallel_dims.dp
        if self._samples_counted is None:
            self._samples_counted = self.trainer.global_step * step_samples
        self._samples_counted += step_samples
        self._reset_step_accumulators()
        self.forward_backward(batch)
        self._finish_optimizer_step()

    def forward_backward(self, micro_batches: list[Batch]) -> None:
        """Forward and backward of each micro-batch of one step, gradients accumulated in ``p.grad``
        (objectives scaled by ``1/A``); records the losses, balancing losses and token counts.
        With ``gradient_sync_every_microbatch: False`` gradients are reduced only after the last."""
        A = self.accumulation_steps
        strategy = self.step_strategy
        record = strategy.run_micro_batches(micro_batches)
        if record is not None:  # the strategy's schedule ran them (pipeline parallel: through every stage)
            self._micro_losses, self._moe_aux_sum = record.micro_losses, record.moe_aux
            self._loss_sum = record.losses
            self._has_aux, self._has_mtp, self._has_indexer = record.has_aux, record.has_mtp, record.has_indexer
            self._tokens += sum(int(b["input_ids"].numel()) for b in micro_batches)
            return
        for k, batch in enumerate(micro_batches):
            strategy.set_gradient_sync(k == len(micro_batches) - 1)
            out = self.model(**batch)
            objective = out.loss
            aux = out.aux_loss
            mtp = out.mtp_loss
            if aux is not None and self.model.moe_layers():
                objective = objective + aux
                self._has_aux = True
            if mtp is not None and len(self.model.mtp):
                objective = objective + mtp
                self._has_mtp = True
            indexer = out.indexer_loss
            if indexer is not None:   # DeepSeek-V3.2's indexer loss (its gradient reaches the indexers only)
                objective = objective + indexer
                self._has_indexer = True
            self.manual_backward(objective / A)

            with torch.no_grad():
                loss = _as_float64(out.loss)
                terms = torch.stack([loss] + [_as_float64(t) if t is not None else torch.zeros_like(loss)
                                              for t in (aux, mtp, indexer)]) / A
                self._loss_sum = terms if self._loss_sum is None else self._loss_sum + terms
                self._micro_losses.append(loss / A)
            self._collect_moe_aux()
            self._tokens += int(batch["input_ids"].numel())

    def _collect_moe_aux(self) -> None:
        layers = self.model.moe_layers()
        if not layers:
            return
        # kept on the device (no sync per micro-batch); averaged over ranks with the step's counts
        device = local_tensor(layers[0].tokens_per_expert).device
        vals = torch.stack([local_tensor(m.last_stats["aux_loss"]).detach().float().to(device)
                            if "aux_loss" in m.last_stats else torch.zeros((), device=device)
                            for m in layers])
        self._moe_aux_sum = vals if self._moe_aux_sum is None else self._moe_aux_sum + vals

    def _finish_optimizer_step(self) -> None:
        """Norm → observers → guards → clip → update → schedule → expert bias, without a host sync:
        the guards' verdict stays a device tensor and the update, the schedule position and the bias
        update act on it there (see :func:`lit_moe.optim.optimizers.step_on_device`)."""
        trainer = self.trainer
        strategy = self.step_strategy
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = strategy.grad_norm(params).float()

        for cb in trainer.callbacks:
            if isinstance(cb, GradientObserver):
                cb.on_gradients_before_clip(trainer, self, grad_norm)
        skip: Optional[torch.Tensor] = None
        for cb in trainer.callbacks:
            if isinstance(cb, StepGuard):   # every guard is asked (guards may keep state)
                verdict = cb.should_skip(trainer, self, grad_norm)
                if not isinstance(verdict, torch.Tensor):   # a host bool: made a device flag without a copy
                    verdict = torch.full((), bool(verdict), dtype=torch.bool, device=grad_norm.device)
                verdict = verdict.to(device=grad_norm.device, dtype=torch.bool).reshape(())
                skip = verdict if skip is None else skip | verdict
        lrs = scheduler.device_lrs(grad_norm.device)
        # Clipping scales the gradients on the device (a non-finite norm leaves them alone); on a
        # skipped step they are not used.
        strategy.clip_grads_with_norm_(params, self.training_config.max_norm, grad_norm)
        step_on_device(optimizer, lrs, skip)
        scheduler.advance(None if skip is None else ~skip)
        optimizer.zero_grad(set_to_none=True)
        if skip is not None:
            step_skips = skip.to(torch.int64)
            self._skipped_on_device = (step_skips if self._skipped_on_device is None
                                       else self._skipped_on_device + step_skips)
        moe = strategy.whole_model_moe(self._update_expert_bias(skip))
        self.step_metrics = self._step_metrics(grad_norm, lrs[0], skip, moe)

    # ------------------------------------------------------------------------------------------
    # expert bias and metrics
    # ------------------------------------------------------------------------------------------
    def _update_expert_bias(self, skip: Optional[torch.Tensor]) -> Optional[MoEStepStats]:
        layers = self.model.moe_layers()
        if not layers:
            return None
        counts = torch.stack([local_tensor(m.tokens_per_expert).detach().float() for m in layers])
        # Capacity drops of this step: dropped and routed token-expert assignments per layer.
        # Third column: this step's balancing loss per layer (summed over micro-batches), averaged
        # over the same ranks below.
        aux_sum = self._moe_aux_sum if self._moe_aux_sum is not None else counts.new_zeros(len(layers))
        extra = torch.stack([torch.stack([local_tensor(m.dropped_assignments).float(),
                                          local_tensor(m.total_assignments).float()])
                             for m in layers]).to(counts.device)
        extra = torch.cat([extra, aux_sum.to(extra)[:, None]], dim=1)
        ranks = 1
        if is_distributed():
            # Summed over dp × cp (each context-parallel rank routes its own tokens); the tensor/
            # expert-parallel ranks of one group route the same tokens.
            group = self.step_strategy.expert_count_group
            dist.all_reduce(counts, group=group)
            dist.all_reduce(extra, group=group)
            ranks = world_size(group)
        if self.model_config.moe_router_enable_expert_bias:
            # A skipped step updates with all-zero counts: sign(0 - 0) = 0 leaves every bias as it was
            # (no host branch on the skip).
            self.model.update_expert_bias(counts if skip is None else counts * (~skip).to(counts.dtype))
        else:
            for m in layers:
                m.tokens_per_expert.zero_()
        for m in layers:
            m.reset_drop_counters()
        aux = None
        coeff = float(self.model_config.moe_aux_loss_coeff or 0.0)
        if self._moe_aux_sum is not None and coeff > 0:
            # Logged per layer without the coefficient, as MindFormers' load_balancing_loss.
            aux = extra[:, 2].double() / ranks / self.accumulation_steps / coeff
        bias = torch.stack([local_tensor(m.router.expert_bias).detach().float().clone() for m in layers])
        return MoEStepStats(tokens_per_expert=counts, aux_loss=aux, expert_bias=bias,
                            dropped=extra[:, 0], assigned=extra[:, 1])

    def _step_metrics(self, grad_norm, lr, skip, moe) -> StepMetrics:
        losses = self._loss_sum
        if losses is None:   # a step without losses of this rank's own
            losses = torch.zeros(4, dtype=torch.float64, device=grad_norm.device)
        losses = torch.as_tensor(losses, dtype=torch.float64)
        tokens: Any = self._tokens
        if is_distributed():
            world = world_size()
            device = self.step_strategy.root_device
            # With several ranks the preemption flags ride in the same all-reduce (no collective of
            # their own per step; read on the host by agree_on_signal).
            flags = [signal_flags(device)] if world > 1 else []
            vec = torch.cat([losses.to(device),
                             torch.full((1,), float(self._tokens), dtype=torch.float64, device=device), *flags])
            dist.all_reduce(vec)
            if flags:
                agree_on_signal(vec[5:])
            losses = vec[:4] / world
            # Every sample reaches all tensor/context/pipeline-parallel ranks of its data-parallel rank:
            # count its tokens once (rounded when read).
            tokens = vec[4] / self.step_strategy.batch_replicas
        step = self.trainer.global_step
        skipped_steps: Any = self._skipped_host
        if self._skipped_on_device is not None:
            skipped_steps = self._skipped_on_device + self._skipped_host
        return StepMetrics(
            step=step,
            loss=losses[0],
            aux_loss=losses[1] if self._has_aux else None,
            mtp_loss=losses[2] if self._has_mtp else None,
            indexer_loss=losses[3] if self._has_indexer else None,
            grad_norm=grad_norm,
            lr=lr,
            skipped=skip if skip is not None else False,
            skipped_steps=skipped_steps,
            consumed_samples=self.consumed_samples,
            tokens=tokens,
            step_time=self._step_wall_time(),
            micro_losses=tuple(self._micro_losses),
            moe=moe,
        )

    def on_train_end(self) -> None:
        # the schedule's host attributes (and the optimizer groups' lr) at the run's final position
        for config in self.trainer.lr_scheduler_configs:
            sync = getattr(config.scheduler, "sync_host", None)
            if sync is not None:
                sync()

    # ------------------------------------------------------------------------------------------
    # checkpoint hooks
    # ------------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["lit_moe"] = {"skipped_steps": self.skipped_steps}
        step_batch = self._step_samples * self.step_strategy.parallel_dims.dp
        if step_batch and step_batch != self.training_config.global_batch_size:
            # informative (a ramp-up step, a dropped remainder): a resume reads its batch from the
            # consumed samples
            checkpoint["lit_moe"]["global_batch_size"] = step_batch

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.skipped_steps = int(checkpoint.get("lit_moe", {}).get("skipped_steps", 0))
