"""Callbacks that tests load through the YAML ``callbacks:`` list (class_path) to observe a run."""

from __future__ import annotations

import json

import torch
from lightning.pytorch import Callback
from torch.distributed.tensor import DTensor


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu().clone()


class GradCapture(Callback):
    """Saves every gradient (as full tensors) seen right before optimizer step ``at_step``."""

    def __init__(self, path: str, at_step: int = 1) -> None:
        self.path, self.at_step, self._seen = path, at_step, 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._seen += 1
        if self._seen != self.at_step:
            return
        grads = {n: _full(p.grad) for n, p in pl_module.model.named_parameters() if p.grad is not None}
        if trainer.global_rank == 0:
            torch.save(grads, self.path)


class RandomNorms(Callback):
    """Every RMSNorm weight to ``1 + 0.2·N(0,1)`` (seeded) when training starts: a fresh model has every
    norm at 1.0, so a checkpoint of it cannot show two same-shaped norms swapped (a key map that swaps
    input/post-attention norms converts to the same numbers). For frozen norms (LoRA) only: the same
    seed gives the same values at every start, so a resumed run is unchanged."""

    def __init__(self, seed: int = 7) -> None:
        self.seed = seed

    def on_fit_start(self, trainer, pl_module) -> None:
        g = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            for name, p in pl_module.model.named_parameters():
                if name.endswith("norm.weight"):
                    assert not p.requires_grad, f"{name} trains: RandomNorms is for frozen norms"
                    value = 1 + 0.2 * torch.randn(p.shape, generator=g)
                    if isinstance(p, DTensor):
                        value = torch.distributed.tensor.distribute_tensor(value, p.device_mesh, p.placements)
                    p.copy_(value)


class StepRecorder(Callback):
    """Writes ``step_metrics`` (loss, lr, grad norm, ...) of every optimizer step as JSON lines, at full
    precision (the console prints four decimals), and the evaluation losses as ``{path}.val.json``."""

    def __init__(self, path: str) -> None:
        self.path, self.val = path, {}

    def _collect_val(self, trainer) -> None:
        from lit_moe.callbacks.evaluation import Evaluation

        for cb in trainer.callbacks:   # it may run before or after this callback in a step
            if isinstance(cb, Evaluation) and cb.last is not None:
                self.val[int(cb.last["step"])] = float(cb.last["val/loss"])

    def on_train_end(self, trainer, pl_module) -> None:
        self._collect_val(trainer)
        if self.val and trainer.global_rank == 0:
            with open(self.path + ".val.json", "w") as f:
                json.dump(self.val, f)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._collect_val(trainer)
        m = pl_module.step_metrics
        if trainer.global_rank == 0:
            row = {k: getattr(m, k) for k in ("step", "loss", "lr", "grad_norm", "consumed_samples", "aux_loss",
                                              "mtp_loss", "skipped")}
            row["loss_hex"] = float(m.loss).hex()
            row["micro_batches"] = len(m.micro_losses)
            row["first_tokens"] = batch[-1]["input_ids"][0, :8].tolist()   # the step's last micro-batch
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


class MoEAuxRecorder(Callback):
    """Per rank: each micro-batch's per-layer balancing loss as the MoE layers report it, and the
    step's per-layer ``step_metrics.moe.aux_loss``, as JSON lines in ``{path}.rank{r}``."""

    def __init__(self, path: str) -> None:
        self.path, self.micro = path, []

    def on_after_backward(self, trainer, pl_module) -> None:  # once per micro-batch
        self.micro.append([float(m.last_stats["aux_loss"]) for m in pl_module.model.moe_layers()])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # once per step
        row = {"micro": self.micro, "logged": pl_module.step_metrics.moe.aux_loss.tolist(),
               "coeff": pl_module.model_config.moe_aux_loss_coeff}
        self.micro = []
        with open(f"{self.path}.rank{trainer.global_rank}", "a") as f:
            f.write(json.dumps(row) + "\n")


class FrozenBaseWatch(Callback):
    """LoRA: what training did to the parameters, written as JSON to ``path`` by rank 0 when training
    ends: ``changed``, the parameters whose full tensor differs in any bit from the one at the start
    of training; ``trainable``, those with ``requires_grad``; ``with_grad``, those that held a gradient
    before an optimizer step; ``optimizer``, those the optimizer holds state for."""

    def __init__(self, path: str) -> None:
        self.path, self.before, self.with_grad = path, {}, set()

    def on_train_start(self, trainer, pl_module) -> None:
        self.before = {n: _full(p) for n, p in pl_module.model.named_parameters()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.with_grad |= {n for n, p in pl_module.model.named_parameters() if p.grad is not None}

    def on_train_end(self, trainer, pl_module) -> None:
        params = dict(pl_module.model.named_parameters())
        changed = sorted(n for n, p in params.items() if not torch.equal(_full(p), self.before[n]))
        names = {id(p): n for n, p in params.items()}
        held = sorted(names[id(p)] for opt in trainer.optimizers for p, s in opt.state.items() if s)
        if trainer.global_rank == 0:
            with open(self.path, "w") as f:
                json.dump({"changed": changed, "with_grad": sorted(self.with_grad), "optimizer": held,
                           "trainable": sorted(n for n, p in params.items() if p.requires_grad)}, f)
