"""Where a run starts from: ``checkpoint.load_path`` resolved into a :class:`LoadPlan`.

* empty: a fresh start;
* a ``save_path`` (its tracker is followed) or one iteration directory, with ``no_load_optim: False``:
  full resume. ``LoadPlan.ckpt_path`` goes to ``trainer.fit(ckpt_path=...)``; the strategy's own
  loader hooks (:class:`IterationResume`, mixed into ``AscendFSDPStrategy``) call
  :func:`load_lightning_checkpoint`, which restores weights, optimizer (learning rate included), and
  returns Lightning's state (step, LR schedule, DataModule position, callbacks) with each rank's RNG
  state in it, which the checkpoint callback puts back when training starts;
* the same with ``no_load_optim: True``: weights only (fine-tuning: step 0, fresh optimizer);
  ``LoadPlan.weights_loader(model)`` fills the freshly initialised model;
* a Hugging Face ``save_pretrained`` directory: weights only, and only with ``no_load_optim: True``.

Every problem (missing path, empty tracker, missing or truncated files, another model's shapes) is
one :class:`CheckpointError` line naming the file or the tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from lit_moe.checkpoint.iteration import (
    IterationReader,
    _prefix_map,
    _rank_world,
    _SubIndex,
    load_module,
    load_optimizers,
)
from lit_moe.checkpoint.layout import COMMON, TRACKER, CheckpointError, iteration_name, list_iterations, read_tracker
from lit_moe.checkpoint.sharded import check_shapes
from lit_moe.config import CheckpointConfig, ConfigError
from lit_moe.step import StepStrategy

RESUMED = "lit_moe_resumed_from"  # marks a Lightning checkpoint dict produced by load_lightning_checkpoint
HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"


@dataclass
class LoadPlan:
    """What ``checkpoint.load_path`` asks for. ``kind``: ``none``, ``resume``, ``weights`` or
    ``huggingface``; ``ckpt_path`` for ``trainer.fit`` (resume only); ``weights_loader(model, whole_model=True)``
    for weights-only loads (``whole_model`` False: the model is this rank's part of it); ``step``: the saved step of a lit_moe checkpoint."""

    kind: str = "none"
    path: Optional[Path] = None
    ckpt_path: Optional[str] = None
    weights_loader: Optional[Callable[..., None]] = None
    step: Optional[int] = None


def is_hf_dir(path: Path) -> bool:
    return (path / HF_INDEX).is_file() or (path / HF_SINGLE).is_file()


def find_iteration_dir(path: Path) -> Path:
    """A ``save_path`` (tracker followed) or an iteration directory → the iteration directory."""
    if (path / TRACKER).exists():
        step = read_tracker(path)
        it = path / iteration_name(step)
        if not it.is_dir():
            raise CheckpointError(f"checkpoint.load_path: the tracker {path / TRACKER} names step {step} but "
                                  f"{it} does not exist")
        return it
    if (path / COMMON).exists():
        return path
    steps = list_iterations(path)
    if steps:
        raise CheckpointError(f"checkpoint.load_path: {path} has no {TRACKER} (no save completed); point "
                              f"load_path at an iteration directory such as {path / iteration_name(steps[-1])}")
    if not any(path.iterdir()):
        raise CheckpointError(f"checkpoint.load_path: {path} is an empty directory, not a checkpoint")
    raise CheckpointError(f"checkpoint.load_path: {path} is not a checkpoint (expected a save_path with {TRACKER}, "
                          f"an iteration directory with {COMMON}, or a Hugging Face directory with "
                          f"{HF_SINGLE} or {HF_INDEX})")


def resolve_load(cfg: CheckpointConfig, model_config: Any = None) -> LoadPlan:
    """Check ``checkpoint.load_path`` and the load options and say how to load (see the module docstring)."""
    workers = cfg.load_worker_number
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"checkpoint.load_worker_number: must be a positive integer, got {workers!r}")
    if not cfg.load_path:
        return LoadPlan()
    path = Path(cfg.load_path).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint.load_path: {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint.load_path: {str(path)!r} is a file; expected a save_path, an iteration "
                              "directory or a Hugging Face directory")
    if is_hf_dir(path):
        if not cfg.no_load_optim:
            raise CheckpointError(
                "checkpoint.no_load_optim: Resume training (no_load_optim=False) is not supported for HuggingFace "
                f"checkpoints ({path}); set no_load_optim: True to load its weights for fine-tuning")
        check_hf_dir(path)
        return LoadPlan("huggingface", path, None, HFWeightsLoader(path, model_config, cfg))
    it = find_iteration_dir(path)
    reader = IterationReader(it)
    if not cfg.no_load_optim and not reader.has_optimizer:
        raise CheckpointError(f"checkpoint.no_load_optim: no_load_optim is False but no optimizer checkpoint found "
                              f"in {it} (saved with no_save_optim: True); set no_load_optim: True to fine-tune "
                              "from its weights")
    if model_config is not None:
        check_model_shapes(reader, model_config)
    if cfg.no_load_optim:
        return LoadPlan("weights", it, None, WeightsLoader(it, cfg), reader.step)
    return LoadPlan("resume", it, str(it), None, reader.step)


def check_hf_dir(path: Path) -> None:
    index = path / HF_INDEX
    if not index.is_file():
        return
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint file corrupted: {index} ({type(err).__name__})") from None
    for name in sorted(set(weight_map.values())):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint file missing: {path / name} (listed in {index})")


def check_model_shapes(reader: IterationReader, model_config: Any) -> None:
    """Before anything is allocated: the checkpoint's tensors against the model the config builds
    (on the meta device), naming every mismatch."""
    from lit_moe.model import DeepseekV3ForCausalLM

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(model_config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    index = reader.index("model")
    mapping = _prefix_map(list(shapes), index.keys(), reader.path)
    prefix = next((s[: len(s) - len(k)] for k, s in mapping.items()), "")

    class _Shape:
        def __init__(self, shape):
            self.global_shape = shape

    targets = {mapping[k]: _Shape(s) for k, s in shapes.items()}
    from lit_moe.lora import is_adapter_name

    # a LoRA run's adapters are not in the plain model built here; load_module checks them
    view = _SubIndex(index, {k for k in index.keys() if k.startswith(prefix) and not is_adapter_name(k)})
    check_shapes(view, targets, "the model weights", reader.path)


class WeightsLoader:
    """``weights_loader`` for a lit_moe checkpoint: the model's tensors only (any layout)."""

    def __init__(self, path: Path, cfg: CheckpointConfig) -> None:
        self.path = Path(path)
        self.balanced = cfg.load_balanced
        self.workers = cfg.load_worker_number

    def __call__(self, model: torch.nn.Module, whole_model: bool = True) -> None:
        load_module(model, IterationReader(self.path, workers=self.workers), balanced=self.balanced,
                    whole_model=whole_model)

    def __repr__(self) -> str:
        return f"WeightsLoader({str(self.path)!r})"


class HFWeightsLoader:
    """``weights_loader`` for a Hugging Face ``save_pretrained`` directory."""

    def __init__(self, path: Path, model_config: Any, cfg: CheckpointConfig) -> None:
        self.path = Path(path)
        self.model_config = model_config
        self.workers = cfg.load_worker_number

    def __call__(self, model: torch.nn.Module, whole_model: bool = True) -> None:
        # (the Hugging Face directory's names are mapped onto the model's own: any part of it)
        from lit_moe.hf.load import load_hf_into

        load_hf_into(model, self.path, self.model_config, workers=self.workers)

    def __repr__(self) -> str:
        return f"HFWeightsLoader({str(self.path)!r})"


# ----------------------------------------------------------------------------------------------
# Lightning integration: trainer.fit(ckpt_path=<iteration dir>)
# ----------------------------------------------------------------------------------------------
def is_lit_moe_checkpoint(path: Any) -> bool:
    """An iteration directory (``common.json``) or a save_path (tracker) of ours."""
    try:
        p = Path(path)
    except TypeError:
        return False
    return (p / COMMON).is_file() or (p / TRACKER).is_file()


RNG_STATE = "lit_moe_rng_state"  # this rank's RNG state, in the checkpoint dict Lightning hands around


def holds_whole_model(strategy: Any) -> bool:
    """Whether this rank's model is the whole model (:class:`~lit_moe.step.StepStrategy` says; another
    strategy's model is)."""
    return strategy.holds_whole_model if isinstance(strategy, StepStrategy) else True


def load_lightning_checkpoint(strategy: Any, path: Any, cfg: CheckpointConfig) -> dict:
    """Restore the weights (and, once the optimizers exist, their states) in place and return
    Lightning's checkpoint dict (loops, LR schedulers, callbacks, DataModule) for the Trainer, with
    this rank's RNG state under :data:`RNG_STATE` (None when the checkpoint was written by another
    number of ranks)."""
    reader = IterationReader(find_iteration_dir(Path(path)), workers=cfg.load_worker_number)
    module = strategy.lightning_module
    whole = holds_whole_model(strategy)
    load_module(module, reader, balanced=cfg.load_balanced, whole_model=whole)
    pending = True
    if strategy.optimizers:  # strategies that restore after setup (ModelParallelStrategy)
        load_optimizers(module, strategy.optimizers, reader, balanced=cfg.load_balanced, whole_model=whole)
        pending = False
    rank, world = _rank_world()
    state = reader.trainer_state()
    state[RNG_STATE] = reader.rng_state(rank, world)
    state[RESUMED] = {"path": str(path), "reader": reader, "optimizer_pending": pending}
    state["state_dict"] = {}  # already in the model
    state["optimizer_states"] = []  # already in the optimizers (or loaded by load_optimizer_state_dict)
    return state


class IterationResume:
    """Strategy mixin: ``trainer.fit(ckpt_path=...)`` also accepts lit_moe iteration directories and
    save paths (other paths go to the strategy's own loader).

    Lightning asks the strategy to load ``ckpt_path`` and then to put the model and optimizer states
    in place. For our checkpoints the first hook does the work in place (with resharding); the other
    two have nothing left to do (or, for strategies that load before the optimizers exist, load the
    optimizer states then). Mix it in before the Lightning strategy class, as ``AscendFSDPStrategy``
    does; ``checkpoint_config`` gives ``load_balanced`` and ``load_worker_number``."""

    checkpoint_config: Optional[CheckpointConfig] = None

    def _load_options(self) -> CheckpointConfig:
        return self.checkpoint_config if self.checkpoint_config is not None else CheckpointConfig()

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict:
        if is_lit_moe_checkpoint(checkpoint_path):
            return load_lightning_checkpoint(self, checkpoint_path, self._load_options())
        return super().load_checkpoint(checkpoint_path, *args, **kwargs)

    def load_model_state_dict(self, checkpoint: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(checkpoint, dict) and RESUMED in checkpoint:
            return None
        return super().load_model_state_dict(checkpoint, *args, **kwargs)

    def load_optimizer_state_dict(self, checkpoint: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(checkpoint, dict) and RESUMED in checkpoint:
            info = checkpoint[RESUMED]
            if info["optimizer_pending"]:
                load_optimizers(self.lightning_module, self.optimizers, info["reader"],
                                balanced=self._load_options().load_balanced, whole_model=holds_whole_model(self))
                info["optimizer_pending"] = False
            return None
        return super().load_optimizer_state_dict(checkpoint, *args, **kwargs)
