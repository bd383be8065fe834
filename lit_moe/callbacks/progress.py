"""A progress bar that counts optimizer steps (not micro-batches or epochs), with loss, lr, grad norm
and tokens/s of the last log step."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import _update_n

from lit_moe.callbacks._common import is_log_step
from lit_moe.callbacks.throughput import step_perf


class StepProgressBar(TQDMProgressBar):
    """Lightning's bar counts dataloader batches per epoch; under accumulation and ``max_epochs=-1``
    that reads "Epoch 0/-2, 12/3". This one shows ``step k/steps`` and the step's metrics."""

    def on_train_epoch_start(self, trainer, *_: Any) -> None:
        bar = self.train_progress_bar
        if self._leave:
            bar = self.train_progress_bar = self.init_train_tqdm()
        bar.reset(total=trainer.max_steps if trainer.max_steps > 0 else None)
        _update_n(bar, trainer.global_step)
        bar.set_description("step")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bar = self.train_progress_bar
        if bar is None:
            return
        _update_n(bar, trainer.global_step)
        # the numbers are read from the device on log steps only (other steps do not wait for it)
        if is_log_step(trainer.global_step, self.metrics_interval(trainer)):
            bar.set_postfix(self.get_metrics(trainer, pl_module))

    @staticmethod
    def metrics_interval(trainer) -> int:
        """The run's log interval (its :class:`StepLogger`'s), 1 without one."""
        from lit_moe.callbacks.step_logger import StepLogger

        for cb in trainer.callbacks:
            if isinstance(cb, StepLogger):
                return cb.log_interval
        return 1

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._leave and self.train_progress_bar is not None:
            self.train_progress_bar.close()

    def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
        m = getattr(pl_module, "step_metrics", None)
        if m is None:
            return {}
        out = {"loss": f"{m.loss:.4f}", "lr": f"{m.lr:.2e}", "grad_norm": f"{m.grad_norm:.3f}"}
        perf = step_perf(trainer, m)
        if perf.get("tokens_per_sec") is not None:
            out["tok/s"] = f"{perf['tokens_per_sec']:.0f}"
        return out
