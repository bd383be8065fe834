"""The LightningModule: the PyNative training step of MindFormers on top of Lightning.

One dataloader batch is one micro-batch. With ``A`` accumulation steps, micro-batches ``0..A-2`` only run
forward/backward (each objective scaled by ``1/A``); micro-batch ``A-1`` also finishes the optimizer step:
global gradient norm (fp32, every mesh) → skip guards → clipping → optimizer and LR schedule →
expert-bias update from the token counts of the whole step, summed over micro-batches and ranks.
Manual optimization keeps that order explicit and lets a guard skip an update without touching the
optimizer state.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch.distributed.tensor import DTensor

from lit_moe.config import TrainingConfig
from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


class LitMoE(LightningModule):
    """Trains a :class:`DeepseekV3ForCausalLM` with the MindFormers PyNative step semantics.

    Args:
        model_config: the ``model:`` section, validated.
        optimizer: the ``optimizer:`` section (see :func:`lit_moe.optim.build_optimizer`).
        lr_scheduler: the ``lr_scheduler:`` section (see :func:`lit_moe.schedules.build_lr_lambda`).
        training: the ``training:`` section.
        accumulation_steps: micro-batches per optimizer step on each rank (``A``).
        weights_loader: called with the materialised model after initialisation, to load weights
            only (fine-tuning from a checkpoint or a Hugging Face directory).
        lora: the ``lora_config`` section (:func:`lit_moe.lora.lora_settings`); None: no adapters.
    """

    def __init__(
        self,
        model_config: DeepseekV3Config,
        optimizer: dict,
        lr_scheduler: dict,
        training: TrainingConfig,
        accumulation_steps: int = 1,
        weights_loader: Optional[Callable[[torch.nn.Module], None]] = None,
        lora: Any = None,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model_config = model_config
        self.optimizer_section = dict(optimizer)
        self.lr_scheduler_section = dict(lr_scheduler)
        self.training_config = training
        self.accumulation_steps = int(accumulation_steps)
        self.weights_loader = weights_loader
        from lit_moe.lora import check_lora_targets, lora_settings

        self.lora = lora_settings(lora)
        if self.lora is not None:
            check_lora_targets(model_config, self.lora)   # a pattern matching nothing fails here, not on the ranks
        self.model: Optional[DeepseekV3ForCausalLM] = None
        self.step_metrics: dict[str, Any] = {}
        self.skipped_steps = 0
        self._micro_step = 0
        self._window_start_samples: Optional[int] = None   # data position where this accumulation window began
        self._last_step_end: Optional[float] = None         # wall clock of the previous step's end
        self._reset_step_accumulators()

    # ------------------------------------------------------------------------------------------
    # model construction
    # ------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        # Lightning calls this for every fit/validate/test: build once.
        if self.model is not None:
            return
        # Build on the meta device: a 671B config never materialises whole on one rank.
        with torch.device("meta"):
            model = DeepseekV3ForCausalLM(self.model_config)
        if self.lora is not None:   # adapters before the layout, so that it shards them too
            from lit_moe.lora import apply_lora

            apply_lora(model, self.lora)
        strategy = self.trainer.strategy
        if hasattr(strategy, "parallelize"):
            model = strategy.parallelize(model)
        model.to_empty(device=strategy.root_device)
        # Layout-independent init from the run seed; a resumed run overwrites it with the
        # checkpoint afterwards (Lightning restores after configure_model), never the reverse.
        model.init_weights(self.training_config.seed)
        if self.lora is not None:
            from lit_moe.lora import init_adapters

            init_adapters(model, self.training_config.seed)
        if self.weights_loader is not None:
            self.weights_loader(model)
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
        from lit_moe.optim import build_optimizer
        from lit_moe.schedules import build_lr_lambda

        peak_lr, lr_lambda = build_lr_lambda(self.lr_scheduler_section, self.training_config.steps)
        params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        optimizer = build_optimizer(params, self.optimizer_section, peak_lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------------------------------
    # the training step
    # ------------------------------------------------------------------------------------------
    def _consumed_before(self, batch: dict[str, torch.Tensor]) -> Optional[int]:
        """The data module's consumed-samples count before this micro-batch (it counts a batch when
        it is transferred, i.e. already), or None without such a data module."""
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "consumed_samples") or not batch:
            return None
        rows = int(next(iter(batch.values())).shape[0])
        return int(dm.consumed_samples) - rows * int(getattr(dm, "dp_size", 1))

    def discard_unfinished_window(self) -> None:
        """Training stopped between optimizer steps (``max_time``, a callback's ``should_stop``, an
        epoch limit): the micro-batches of the unfinished accumulation window never reached the
        weights. Their gradients and routing counts are dropped and their samples given back to the
        data module, so the final checkpoint resumes with exactly those samples."""
        if self._micro_step == 0:
            return
        dm = getattr(self.trainer, "datamodule", None)
        if dm is not None and self._window_start_samples is not None:
            dm.consumed_samples = self._window_start_samples
        self.model.zero_grad(set_to_none=True)
        for m in self.model.moe_layers():
            m.tokens_per_expert.zero_()
            m.reset_drop_counters()
        self._micro_step = 0

    def on_train_start(self) -> None:
        self._last_step_end = time.perf_counter()

    def _step_wall_time(self) -> float:
        """Wall time since the previous step ended (the first: since training started): data
        fetching, every micro-batch and the previous step's callbacks (saves, logging) included."""
        now = time.perf_counter()
        start = self._last_step_end if self._last_step_end is not None else self._step_start
        self._last_step_end = now
        return now - start

    def _reset_step_accumulators(self) -> None:
        self._loss_sum = torch.zeros(3, dtype=torch.float64)  # loss, aux, mtp (each already / A)
        self._has_aux = False
        self._has_mtp = False
        self._micro_losses: list[float] = []
        self._moe_aux_sum: Optional[torch.Tensor] = None
        self._step_start = time.perf_counter()
        self._tokens = 0

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        A = self.accumulation_steps
        if self._micro_step == 0:
            self._reset_step_accumulators()
            self._window_start_samples = self._consumed_before(batch)
        last = self._micro_step == A - 1
        strategy = self.trainer.strategy
        if hasattr(strategy, "set_gradient_sync") and A > 1:
            # With gradient_sync_every_microbatch False the strategy defers the reduce-scatter to the
            # last micro-batch; otherwise this is a no-op.
            strategy.set_gradient_sync(last)

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
        self.manual_backward(objective / A)

        with torch.no_grad():
            terms = [out.loss, aux if aux is not None else 0.0, mtp if mtp is not None else 0.0]
            self._loss_sum += torch.tensor([float(t.detach() if torch.is_tensor(t) else t) / A for t in terms],
                                           dtype=torch.float64)
        self._micro_losses.append(float(out.loss.detach()) / A)
        self._collect_moe_aux()
        self._tokens += int(batch["input_ids"].numel())

        self._micro_step = 0 if last else self._micro_step + 1
        if last:
            self._finish_optimizer_step()
        return objective.detach()

    def _collect_moe_aux(self) -> None:
        layers = self.model.moe_layers()
        if not layers:
            return
        # kept on the device (no sync per micro-batch); averaged over ranks with the step's counts
        device = _local(layers[0].tokens_per_expert).device
        vals = torch.stack([_local(m.last_stats["aux_loss"]).detach().float().to(device)
                            if "aux_loss" in m.last_stats else torch.zeros((), device=device)
                            for m in layers])
        self._moe_aux_sum = vals if self._moe_aux_sum is None else self._moe_aux_sum + vals

    def _grad_params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.grad is not None]

    def _global_grad_norm(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        strategy = self.trainer.strategy
        if hasattr(strategy, "clip_grad_norm_"):
            return strategy.clip_grad_norm_(params, 0.0)
        from lit_moe.strategies import global_grad_norm

        return global_grad_norm(params)

    def _finish_optimizer_step(self) -> None:
        from lit_moe.callbacks import StepGuard

        trainer = self.trainer
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        params = self._grad_params()
        grad_norm = self._global_grad_norm(params).float()

        skip = False
        for cb in trainer.callbacks:
            if isinstance(cb, StepGuard) and cb.should_skip(trainer, self, grad_norm):
                skip = True
        lr = optimizer.param_groups[0]["lr"]
        if skip:
            # Dropping every gradient turns the optimizer step into a no-op for parameters,
            # moments and per-parameter step counts, while Lightning still counts the step.
            self.skipped_steps += 1
            for p in params:
                p.grad = None
            optimizer.step()
        else:
            max_norm = self.training_config.max_norm
            if max_norm > 0:
                coef = torch.clamp(max_norm / (grad_norm + 1e-6), max=1.0)
                for p in params:
                    _local(p.grad).mul_(coef.to(_local(p.grad).device, _local(p.grad).dtype))
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        moe = self._update_expert_bias(apply=not skip)
        self._record_step_metrics(grad_norm, lr, skip, moe)

    # ------------------------------------------------------------------------------------------
    # expert bias and metrics
    # ------------------------------------------------------------------------------------------
    def _count_group(self):
        # Token counts are summed over data-parallel ranks only: tp/cp/ep ranks of one group route the
        # same tokens (the MoE layer sees the whole sequence), so summing over them would over-count.
        strategy = self.trainer.strategy
        return getattr(strategy, "expert_count_group", getattr(strategy, "loss_reduce_group", None))

    def _update_expert_bias(self, apply: bool) -> Optional[dict[str, torch.Tensor]]:
        layers = self.model.moe_layers()
        if not layers:
            return None
        counts = torch.stack([_local(m.tokens_per_expert).detach().float() for m in layers])
        # Capacity drops of this step: dropped and routed token-expert assignments per layer.
        # Third column: this step's balancing loss per layer (summed over micro-batches), averaged
        # over the same ranks below.
        aux_sum = self._moe_aux_sum if self._moe_aux_sum is not None else counts.new_zeros(len(layers))
        extra = torch.stack([torch.stack([_local(m.dropped_assignments).float(),
                                          _local(m.total_assignments).float()]) for m in layers]).to(counts.device)
        extra = torch.cat([extra, aux_sum.to(extra)[:, None]], dim=1)
        ranks = 1
        if _dist_ready():
            group = self._count_group()
            dist.all_reduce(counts, group=group)
            dist.all_reduce(extra, group=group)
            ranks = dist.get_world_size(group)
        if apply and self.model_config.moe_router_enable_expert_bias:
            self.model.update_expert_bias(counts)
        else:
            for m in layers:
                m.tokens_per_expert.zero_()
        for m in layers:
            m.reset_drop_counters()
        aux = None
        coeff = float(getattr(self.model_config, "moe_aux_loss_coeff", 0.0) or 0.0)
        if self._moe_aux_sum is not None and coeff > 0:
            # Logged per layer without the coefficient, as MindFormers' load_balancing_loss.
            aux = extra[:, 2].double().cpu() / ranks / self.accumulation_steps / coeff
        bias = torch.stack([_local(m.router.expert_bias).detach().float().cpu() for m in layers])
        return {
            "tokens_per_expert": counts.cpu(),
            "aux_loss": aux,
            "expert_bias": bias,
            "dropped": extra[:, 0].cpu(),
            "assigned": extra[:, 1].cpu(),
        }

    def _record_step_metrics(self, grad_norm, lr, skipped, moe) -> None:
        losses = self._loss_sum.clone()
        tokens = torch.tensor([float(self._tokens)], dtype=torch.float64)
        if _dist_ready():
            world = dist.get_world_size()
            vec = torch.cat([losses, tokens]).to(self.trainer.strategy.root_device)
            dist.all_reduce(vec)
            vec = vec.cpu()
            losses = vec[:3] / world
            # Ranks of one tp/cp group receive the same batch (the sequence is split inside the
            # model), so count its tokens once per data-parallel rank.
            dims = getattr(self.trainer.strategy, "parallel_dims", None)
            per_group = (dims.tp * dims.cp) if dims is not None else 1
            tokens_total = int(round(vec[3].item() / per_group))
        else:
            tokens_total = int(tokens.item())
        step = self.trainer.global_step
        self.step_metrics = {
            "step": step,
            "loss": float(losses[0]),
            "aux_loss": float(losses[1]) if self._has_aux else None,
            "mtp_loss": float(losses[2]) if self._has_mtp else None,
            "grad_norm": float(grad_norm),
            "lr": float(lr),
            "skipped": bool(skipped),
            "skipped_steps": self.skipped_steps,
            "consumed_samples": step * self.training_config.global_batch_size,
            "tokens": tokens_total,
            "step_time": self._step_wall_time(),
            "micro_losses": list(self._micro_losses),
            "moe": moe,
        }

    # ------------------------------------------------------------------------------------------
    # checkpoint hooks
    # ------------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["lit_moe"] = {"skipped_steps": self.skipped_steps}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.skipped_steps = int(checkpoint.get("lit_moe", {}).get("skipped_steps", 0))
