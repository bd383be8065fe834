"""MoE routing metrics (``monitor.moe_monitor``) and the drop-rate line of graph mode's
``MoEDropRateCallback`` (MindFormers' training-features guide).

Input: ``step_metrics.moe`` (:class:`lit_moe.step.MoEStepStats`) from the module, already reduced
over micro-batches and data-parallel ranks (device tensors, copied to the host on reported steps only, one row per MoE layer in
``model.moe_layers()`` order, MTP layers included): ``tokens_per_expert [L, E]``, ``aux_loss [L]``
(without the coefficient), ``expert_bias [L, E]`` (after the update), ``dropped [L]`` and
``assigned [L]`` (token-expert assignments dropped by the capacity / routed).

Per reported layer (named by its block id: decoder layers 0..N-1, MTP layers N.., the ids that
``recompute`` uses), every ``log_interval`` steps (the statistics are the whole model's on every
rank, whatever part of it a rank holds: rank 0 reports every layer):
``moe/layer{i}/load_imbalance`` (max/mean tokens per expert), ``moe/layer{i}/aux_loss``,
``moe/layer{i}/expert_bias_mean``, ``moe/layer{i}/expert_bias_max_abs`` and, when a capacity is set,
``moe/layer{i}/drop_rate`` (dropped/assigned); plus ``moe/max_load_imbalance`` (worst layer) and
``moe/drop_rate`` (all layers). The statistics stay on the device on other steps (no host sync). Every ``save_tokens_per_expert_interval`` steps (default 50; the
per-expert series are layers × experts scalars, too many to write every step for a large model):
``moe/layer{i}/tokens_per_expert/expert{e}`` and the expert-load heatmap (image ``moe/expert_load``
and ``<heatmap_dir>/expert_load_step{N:08d}.png``, drawn by :mod:`lit_moe.callbacks.heatmap`; rows =
reported layers, columns = experts, colour = tokens / layer mean). The built-in run puts the PNG
files in the TensorBoard run's own directory (``<output_dir>/<name>/version_<n>/expert_load``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.pytorch import Callback

from lit_moe.config import ConfigError
from lit_moe.callbacks._common import add_png, add_scalar, check_log_interval, emit, is_log_step, tb_writer
from lit_moe.callbacks.heatmap import png_size, render_heatmap
from lit_moe.step import MoEStepStats, StepMetrics, StepStrategy, model_moe_block_ids

DEFAULT_EXPERT_INTERVAL = 50


def layer_stats(moe: MoEStepStats, row: int) -> dict[str, Optional[float]]:
    """The scalar metrics of one MoE layer (row of the ``moe`` tensors)."""
    counts = moe.tokens_per_expert[row].detach().double()
    mean = float(counts.mean())
    out: dict[str, Optional[float]] = {
        "load_imbalance": float(counts.max()) / mean if mean > 0 else None,
    }
    if moe.aux_loss is not None:
        out["aux_loss"] = float(moe.aux_loss[row])
    bias = moe.expert_bias[row].detach().double()
    out["expert_bias_mean"] = float(bias.mean())
    out["expert_bias_max_abs"] = float(bias.abs().max())
    assigned = float(moe.assigned[row])
    out["drop_rate"] = float(moe.dropped[row]) / assigned if assigned > 0 else None
    return out


def moe_block_ids(trainer: Any, pl_module: Any) -> Optional[list[int]]:
    """Block id (decoder layer index, MTP layers after the decoder) of each row of the ``moe``
    tensors: the strategy's answer (:meth:`lit_moe.step.StepStrategy.moe_block_ids`, the whole
    model's, whatever part this rank holds), or the module's model's; None when neither says."""
    strategy = getattr(trainer, "strategy", None)
    model = getattr(pl_module, "model", None)
    if isinstance(strategy, StepStrategy):
        return strategy.moe_block_ids(model)
    return model_moe_block_ids(model)


def capacity_is_set(pl_module: Any) -> bool:
    """Whether the model drops tokens by a capacity (then the drop rate is reported)."""
    for config in (getattr(pl_module, "model_config", None),
                   getattr(getattr(pl_module, "model", None), "config", None)):
        for name in ("moe_expert_capacity_factor", "capacity_factor"):
            if config is not None and getattr(config, name, None) is not None:
                return True
    return False


def _check_interval(value: Any, field: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{field}: must be a positive int or null, got {value!r}")
    return value


class MoEMetrics(Callback):
    """Per-layer MoE scalars, per-expert token counts, the expert-load heatmap and the drop-rate line.

    Args:
        log_interval: per-layer scalars every N optimizer steps.
        save_tokens_per_expert_interval: per-expert counts and heatmap every N steps (None: 50).
        target_layers: None (all MoE layers), an int (the first N MoE layers) or a list of block ids.
        heatmap_dir: where the heatmap PNGs go (None: TensorBoard image only).
        heatmap_in_log_dir: with no ``heatmap_dir``, put the PNGs in ``expert_load`` inside the
            TensorBoard logger's run directory (name/version), found when training starts.
        drop_rate: report drop rates; None decides from the model config (a capacity is set).
    """

    def __init__(self, log_interval: int = 1, save_tokens_per_expert_interval: Optional[int] = None,
                 target_layers: Union[None, int, list[int]] = None,
                 heatmap_dir: Optional[str] = None, drop_rate: Optional[bool] = None,
                 heatmap_in_log_dir: bool = False) -> None:
        field = "monitor.moe_monitor"
        self.log_interval = check_log_interval(log_interval, "MoEMetrics.log_interval")
        self.expert_interval = (_check_interval(save_tokens_per_expert_interval,
                                                f"{field}.save_tokens_per_expert_interval")
                                or DEFAULT_EXPERT_INTERVAL)
        if target_layers is not None:
            bad = (isinstance(target_layers, bool)
                   or (isinstance(target_layers, int) and target_layers < 1)
                   or (isinstance(target_layers, (list, tuple)) and any(
                       isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in target_layers))
                   or not isinstance(target_layers, (int, list, tuple)))
            if bad:
                raise ConfigError(f"{field}.target_layers: expected a positive int (first N MoE "
                                  f"layers) or a list of layer ids >= 0, got {target_layers!r}")
        self.target_layers = target_layers
        self.heatmap_dir = heatmap_dir
        self.heatmap_in_log_dir = heatmap_in_log_dir
        self.drop_rate = drop_rate
        self._rows: Optional[list[int]] = None   # rows of the moe tensors to report
        self._names: Optional[list[str]] = None  # their layer names

    def _select(self, trainer: Any, pl_module: Any, n_rows: int) -> None:
        ids = moe_block_ids(trainer, pl_module)
        if ids is None or len(ids) != n_rows:
            ids = list(range(n_rows))
        if self.target_layers is None:
            rows = list(range(n_rows))
        elif isinstance(self.target_layers, int):
            rows = list(range(min(self.target_layers, n_rows)))
        else:
            missing = [i for i in self.target_layers if i not in ids]
            if missing:
                raise ConfigError(f"monitor.moe_monitor.target_layers: layer(s) {missing} are not MoE "
                                  f"layers; the MoE layers are {ids}")
            rows = [ids.index(i) for i in self.target_layers]
        self._rows = rows
        self._names = [f"layer{ids[r]}" for r in rows]
        if self.drop_rate is None:
            self.drop_rate = capacity_is_set(pl_module)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.heatmap_dir is None and self.heatmap_in_log_dir:
            from lit_moe.callbacks.loggers import tensorboard_log_dir

            log_dir = tensorboard_log_dir(trainer)
            self.heatmap_dir = str(Path(log_dir) / "expert_load") if log_dir else None
        ids = moe_block_ids(trainer, pl_module)
        if ids:
            self._select(trainer, pl_module, len(ids))   # config errors (target_layers) before the first step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        m: StepMetrics = pl_module.step_metrics
        if m.moe is None:
            return
        moe, step = m.moe, m.step
        logged = is_log_step(step, self.log_interval)
        experts_due = is_log_step(step, self.expert_interval)
        if not (logged or experts_due):
            return
        if not trainer.is_global_zero:
            return
        if self._rows is None:
            self._select(trainer, pl_module, moe.tokens_per_expert.shape[0])
        writer = tb_writer(trainer)
        samples = m.consumed_samples
        moe = moe.cpu()   # one host copy of the step's device statistics (log steps only)
        stats = [layer_stats(moe, r) for r in self._rows]
        if logged:
            for name, st in zip(self._names, stats):
                for key, value in st.items():
                    if key != "drop_rate" or self.drop_rate:
                        add_scalar(writer, f"moe/{name}/{key}", value, step, samples)
            imbalances = [st["load_imbalance"] for st in stats if st["load_imbalance"] is not None]
            if imbalances:
                add_scalar(writer, "moe/max_load_imbalance", max(imbalances), step, samples)
            if self.drop_rate:
                dropped = float(moe.dropped[self._rows].sum())
                assigned = float(moe.assigned[self._rows].sum())
                if assigned > 0:
                    add_scalar(writer, "moe/drop_rate", dropped / assigned, step, samples)
                emit(f"MoE drop rate step {step}: " + ", ".join(
                    f"{name} {st['drop_rate']:.4f}" if st.get("drop_rate") is not None else f"{name} n/a"
                    for name, st in zip(self._names, stats)))
        if experts_due and writer is not None:
            tpe = moe.tokens_per_expert
            for name, r in zip(self._names, self._rows):
                for e, count in enumerate(tpe[r].tolist()):
                    writer.add_scalar(f"moe/{name}/tokens_per_expert/expert{e}", float(count),
                                      global_step=step)
        if experts_due and (writer is not None or self.heatmap_dir):
            self.write_heatmap(writer, moe.tokens_per_expert[self._rows], step)

    def write_heatmap(self, writer: Any, tokens_per_expert: torch.Tensor, step: int) -> Optional[Path]:
        png = render_heatmap(tokens_per_expert, self._names, step)
        width, height = png_size(png)
        add_png(writer, "moe/expert_load", png, height, width, step)
        if not self.heatmap_dir:
            return None
        path = Path(self.heatmap_dir) / f"expert_load_step{step:08d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png)
        return path
