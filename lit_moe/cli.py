"""The ``lit_moe`` console script.

``lit_moe fit --config pynative.yaml`` reads the flat MindFormers sections (``checkpoint``, ``training``,
``optimizer``, ``lr_scheduler``, ``parallelism``, ``recompute``, ``recompute_comm``, ``train_dataset``,
``model``, ``monitor``, ``callbacks``, ``profiler``, ``context``; ``trainer:`` is an expert escape hatch),
validates everything before anything large is allocated, then builds the LightningModule, the DataModule,
the strategy and the callbacks and runs ``Trainer.fit``. The files and the ``--SECTION.KEY VALUE``
overrides are merged by :mod:`lit_moe.config_file` into one mapping, which LightningCLI then parses.

The other subcommands (``plan``, ``preprocess``, ``convert-config``, ``convert-hf``, ``predict``) are plain argparse
programs living next to the code they drive.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Optional

from lightning.pytorch.cli import LightningCLI

from lit_moe.config import (
    FIXED_SECTIONS,
    OPEN_SECTIONS,
    CheckpointConfig,
    ConfigError,
    ContextConfig,
    MonitorConfig,
    ParallelismConfig,
    ProfilerConfig,
    RecomputeCommConfig,
    RecomputeConfig,
    SwapConfig,
    TrainDatasetConfig,
    TrainingConfig,
    build_section,
    section_defaults,
    suggest,
    to_dict,
)

# Subcommands that are not Trainer methods, and where they live.
TOOLS = {
    "plan": "lit_moe.strategies.plan",
    "preprocess": "lit_moe.data.preprocess",
    "convert-config": "lit_moe.tools.convert_config",
    "convert-hf": "lit_moe.hf.convert",
    "predict": "lit_moe.tools.predict",
}

def world_size_from(trainer_cfg: dict, explicit: Optional[set] = None) -> int:
    """The number of processes the run will have, known before any of them starts (the launcher's
    world, checked against ``--trainer.devices``/``--trainer.num_nodes``: :mod:`lit_moe.runtime.launch`)."""
    return _launch_world(trainer_cfg, explicit).world_size


def _launch_world(trainer_cfg: dict, explicit: Optional[set] = None):
    from lit_moe.runtime.launch import launch_world

    return launch_world(trainer_cfg, explicit, auto_devices=lambda: _auto_device_count(trainer_cfg))


def _auto_device_count(trainer_cfg: dict) -> int:
    from lightning.pytorch.accelerators import AcceleratorRegistry

    accel = trainer_cfg.get("accelerator", "auto")
    # "auto" is Lightning's pick: the first available accelerator with all of its devices, else the CPU
    # (one device); sizing accumulation for one device on a multi-GPU node would stop the run.
    names = ("cuda", "npu") if accel in (None, "auto") else (accel,)
    for name in names:
        if isinstance(name, str) and name in AcceleratorRegistry:
            cls = AcceleratorRegistry[name]["accelerator"]
            if cls.is_available():
                return cls.auto_device_count()
    return 1


class LitMoECLI(LightningCLI):
    """LightningCLI over the flat ``pynative.yaml`` sections."""

    def __init__(self, args: Optional[list[str]] = None) -> None:
        super().__init__(
            model_class=None,
            datamodule_class=None,
            save_config_callback=None,
            seed_everything_default=False,  # training.seed seeds everything (before_instantiate_classes)
            parser_kwargs={"parser_mode": "yaml", "exit_on_error": False},
            auto_configure_optimizers=False,
            load_from_checkpoint_support=False,
            args=args,
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {"fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"}}

    # -- parser -----------------------------------------------------------------------------
    def add_core_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        for name, cls in FIXED_SECTIONS.items():
            parser.add_argument(f"--{name}", type=cls, default=cls(), help=f"The `{name}` section.")
        for name in OPEN_SECTIONS:
            parser.add_argument(f"--{name}", type=dict[str, Any], default={}, help=f"The `{name}` section (extra keys allowed).")
        parser.add_argument("--callbacks", type=Optional[list[dict[str, Any]]], default=None,
                            help="User callbacks: a list of {class_path, init_args}.")
        parser.add_argument("--gradient_accumulation_steps", type=Optional[int], default=None,
                            help="Graph-mode option: translated into training.global_batch_size.")
        parser.add_argument("--lora_config", type=Optional[dict[str, Any]], default=None,
                            help="MindFormers' LoRA section (lit_moe/lora.py); null: no adapters.")
        parser.add_argument("--eval_dataset", type=Optional[dict[str, Any]], default=None,
                            help="Evaluation data shaped like train_dataset (lit_moe/callbacks/evaluation.py).")
        parser.add_argument("--use_remove_redundant_dataset", type=bool, default=False,
                            help="MindFormers top-level key; accepted, no effect.")

    def _add_instantiators(self) -> None:  # no class_path model/data to instantiate
        pass

    # -- build --------------------------------------------------------------------------------
    def before_instantiate_classes(self) -> None:
        parser = self._parser(self.subcommand)
        _check_section_shapes(self.config[self.subcommand], parser)
        instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
        # Sections become dataclasses; `trainer.callbacks`/plugins given as class_path become objects.
        self.config_init = {self.subcommand: instantiate(self.config[self.subcommand])}
        try:
            self.run = build_run(self.config_init[self.subcommand])
        except ConfigError:
            raise
        except (ValueError, TypeError) as err:
            # Validation of the sections (model config, layout, schedule, ...) raises ValueError
            # naming the field; here it is a configuration error, reported as one line.
            raise ConfigError(str(err)) from None

    def instantiate_classes(self) -> None:
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        self.model = self.run.module
        self.datamodule = self.run.datamodule
        trainer_section = _namespace_to_dict(self.config_init[self.subcommand].get("trainer"))
        try:
            self.trainer = self.run.make_trainer(trainer_section)
        except ConfigError:
            raise
        except (MisconfigurationException, ValueError, TypeError) as err:
            raise ConfigError(f"trainer: {err}") from None

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        return {"model": self.model, "datamodule": self.datamodule, "ckpt_path": self.run.ckpt_path}


class Run:
    """Everything ``lit_moe fit`` builds, resolved from the parsed sections."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.dtype_note: Optional[str] = None   # the compute-dtype line, printed with the trainer

    def make_trainer(self, trainer_cfg: dict[str, Any]):
        from lightning.pytorch import Trainer
        from lightning.pytorch.callbacks import ProgressBar

        from lit_moe.callbacks.console import RunSummary, console_is_terminal, quiet_lightning
        from lit_moe.callbacks.loggers import combine_loggers
        from lit_moe.callbacks.progress import StepProgressBar
        from lit_moe.runtime.device_speed import print_note

        quiet_lightning()
        user_callbacks = list(trainer_cfg.pop("callbacks", None) or [])
        defaults = {
            "max_steps": self.training.steps,
            "max_epochs": -1,
            "precision": "32-true",  # compute dtype comes from the model section via the strategy
            "strategy": self.strategy,
            "logger": combine_loggers(self.logger, None) or False,
            "enable_model_summary": False,  # RunSummary prints one line instead of the table
            "enable_checkpointing": False,  # our checkpoint callback owns the iteration directories
            "num_sanity_val_steps": 0,
            "limit_val_batches": 0,
            "use_distributed_sampler": False,  # the DataModule shards by data-parallel rank itself
            "deterministic": self.training.deterministic,
            "log_every_n_steps": 1,
            "gradient_clip_val": None,
        }
        accelerator = _accelerator_from_context(self.context)
        if accelerator is not None:
            defaults["accelerator"] = accelerator
        if self.launch.launcher != "lightning":   # torchrun, srun: the launcher's processes per node and nodes
            defaults["devices"], defaults["num_nodes"] = self.launch.devices, self.launch.num_nodes
        # The `trainer:` section overrides only what the user actually wrote there.
        explicit = {k: v for k, v in trainer_cfg.items() if k in self.explicit_trainer_keys}
        for key, home in _TRAINER_KEYS_OWNED_BY_SECTIONS.items():
            if explicit.get(key) not in (None, 1 if key == "accumulate_grad_batches" else None):
                raise ConfigError(f"trainer.{key}: {explicit[key]!r} is not used by lit_moe's training step; "
                                  f"set {home}")
        merged = {**defaults, **explicit}
        fast = merged.pop("fast_dev_run", False)
        if fast:  # Lightning's counts micro-batches; here it is optimizer steps, and no logging
            merged.update(max_steps=1 if fast is True else int(fast), logger=False)
            explicit.pop("logger", None)
        if merged.get("strategy") in (None, "auto", type(self.strategy).strategy_name):
            merged["strategy"] = self.strategy
        elif merged["strategy"] is not self.strategy:
            raise ConfigError(f"trainer.strategy: {merged['strategy']!r} cannot run lit_moe's training step; the "
                              "layout comes from the parallelism section (remove trainer.strategy)")
        if "logger" in explicit:  # trainer.logger: extra loggers beside the TensorBoard dashboards
            merged["logger"] = combine_loggers(self.logger, explicit["logger"]) or False
        callbacks = [RunSummary(self.model_config, self.shape)] + self.callbacks + user_callbacks
        if "enable_progress_bar" not in explicit and not console_is_terminal():
            merged["enable_progress_bar"] = False   # no terminal: plain log lines only
        if merged.get("enable_progress_bar", True) is not False and \
                not any(isinstance(cb, ProgressBar) for cb in callbacks):
            callbacks.append(StepProgressBar())
        merged["callbacks"] = callbacks
        trainer = Trainer(**merged)
        from lit_moe.runtime.preemption import Preemption, use_preemption_agreement

        if any(isinstance(cb, Preemption) for cb in callbacks):
            use_preemption_agreement(trainer)
        print_note(self.dtype_note)   # compute_dtype auto, or a slow bfloat16: once everything is valid
        return trainer


# Trainer arguments that the manual optimization step replaces, and the key that does their job.
_TRAINER_KEYS_OWNED_BY_SECTIONS = {
    "gradient_clip_val": "training.max_norm",
    "gradient_clip_algorithm": "training.max_norm (global-norm clipping)",
    "accumulate_grad_batches": "training.global_batch_size (accumulation = global / (local batch x data parallel))",
}


def _check_section_shapes(cfg: Any, parser: Any) -> None:
    """A section (or sub-section) left empty in the YAML (``training:`` with every key commented out)
    takes its defaults; one that is not a mapping at all is a one-line error."""
    from jsonargparse import Namespace

    def walk(value: Any, default: Any, where: str) -> Any:
        if not isinstance(default, Namespace):
            return value
        if value is None:
            return default.clone()
        if not isinstance(value, Namespace):
            raise ConfigError(f"{where}: expected a mapping of keys, got {value!r}")
        for key, sub in vars(default).items():    # direct children only
            value[key] = walk(value.get(key), sub, f"{where}.{key}")
        return value

    defaults = parser.get_defaults()
    for name in (*FIXED_SECTIONS, *OPEN_SECTIONS):
        value, default = cfg.get(name), defaults.get(name)
        if value is None:
            cfg[name] = default.clone() if isinstance(default, Namespace) else default
        elif isinstance(default, Namespace):
            cfg[name] = walk(value, default, name)
        elif isinstance(default, dict) and not isinstance(value, (dict, Namespace)):
            raise ConfigError(f"{name}: expected a mapping of keys, got {value!r}")


def _accelerator_from_context(context: ContextConfig) -> Optional[str]:
    target = (context.device_target or "").strip().lower()
    if not target:
        return None
    table = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "npu": "npu", "ascend": "npu"}
    if target not in table:
        raise ConfigError(f"context.device_target: unknown device {context.device_target!r}; "
                          "supported: cpu, cuda (gpu), npu (Ascend)")
    return table[target]


def _check_accelerator_available(name: str) -> None:
    """``trainer.accelerator`` (or ``context.device_target``) names an accelerator this machine has
    (Lightning itself reports an unknown name)."""
    from lightning.pytorch.accelerators import AcceleratorRegistry

    if name in AcceleratorRegistry and not AcceleratorRegistry[name]["accelerator"].is_available():
        raise ConfigError(f"trainer.accelerator: {name!r} is not available on this machine (no device or its "
                          "library is not installed)")


def build_run(cfg: Any) -> Run:
    """Validate every section and build the run's pieces, before any large allocation."""
    import lightning.pytorch as pl
    import torch

    from lit_moe.data import MegatronDataModule
    from lit_moe.model import DeepseekV3Config
    from lit_moe.model.mindformers_defaults import read_pynative_model_section
    from lit_moe.module import LitMoE
    from lit_moe.name_keys import check_name_keys
    from lit_moe.optim.schedules import build_lr_lambda
    from lit_moe.config import check_not_yet_sections, no_effect_notes
    from lit_moe.runtime.device_speed import available_accelerator, print_note, resolve_model_section
    from lit_moe.strategies import AscendFSDPStrategy
    from lit_moe.strategies.plan import check_layout

    run = Run(cfg)
    training: TrainingConfig = build_section(TrainingConfig, cfg.get("training"), "training")
    parallelism: ParallelismConfig = build_section(ParallelismConfig, cfg.get("parallelism"), "parallelism")
    recompute: RecomputeConfig = build_section(RecomputeConfig, cfg.get("recompute"), "recompute")
    recompute_comm: RecomputeCommConfig = build_section(RecomputeCommConfig, cfg.get("recompute_comm"), "recompute_comm")
    swap: SwapConfig = build_section(SwapConfig, cfg.get("swap"), "swap")
    checkpoint: CheckpointConfig = build_section(CheckpointConfig, cfg.get("checkpoint"), "checkpoint")
    train_dataset: TrainDatasetConfig = build_section(TrainDatasetConfig, cfg.get("train_dataset"), "train_dataset")
    monitor: MonitorConfig = cfg.get("monitor")
    profiler: ProfilerConfig = build_section(ProfilerConfig, cfg.get("profiler"), "profiler")
    context: ContextConfig = cfg.get("context")
    model_section = dict(cfg.get("model") or {})
    optimizer_section = dict(cfg.get("optimizer") or {})
    lr_section = dict(cfg.get("lr_scheduler") or {})
    trainer_section = _namespace_to_dict(cfg.get("trainer"))

    _check_training(training)
    if not model_section:
        raise ConfigError("model: the section is missing or empty")
    accelerator = _accelerator_from_context(context) or str(trainer_section.get("accelerator") or "auto")
    if accelerator == "gpu":
        accelerator = "cuda"
    if accelerator == "auto":
        accelerator = available_accelerator()
    else:
        _check_accelerator_available(accelerator)
    model_section, dtype_note = resolve_model_section(read_pynative_model_section(model_section), accelerator)
    model_config = DeepseekV3Config(**model_section)

    seq_length = _dataset_seq_length(train_dataset, model_config)
    from lit_moe.model.config_parsing import check_document_mask_data

    check_document_mask_data(model_config, train_dataset.dataloader, cfg.get("eval_dataset") if training.eval_interval else None)
    dl_config = (train_dataset.dataloader or {}).get("config")
    if isinstance(dl_config, dict) and "vocab_size" not in dl_config:
        # Mock data (no data_path) draws token ids below the model's vocabulary.
        dl_config["vocab_size"] = model_config.vocab_size

    run.launch = _launch_world(trainer_section, set(_explicit_trainer_keys()))
    world_size = run.launch.world_size
    gas = cfg.get("gradient_accumulation_steps")
    global_batch_of = None
    if gas is not None:
        from lit_moe.tools.convert_config import global_batch_from_accumulation

        def global_batch_of(data_parallel: int) -> int:
            return global_batch_from_accumulation(gas, data_parallel, training.local_batch_size)
    # the run resolved once: layout, batch, pipeline stages, recompute plan, dispatcher
    shape = check_layout(parallelism, training, model_config, seq_length, world_size, recompute, recompute_comm,
                         global_batch_of=global_batch_of)
    if gas is not None:
        print(f"lit_moe: gradient_accumulation_steps={gas} → training.global_batch_size="
              f"{training.global_batch_size} (set global_batch_size in pynative.yaml instead)", file=sys.stderr)
    dims = shape.dims
    check_not_yet_sections(swap, recompute, cfg)
    for line in no_effect_notes({"checkpoint": checkpoint, "parallelism": parallelism, "train_dataset": train_dataset,
                                 "profiler": profiler, "context": build_section(ContextConfig, context, "context")}, cfg):
        print_note(line)

    build_lr_lambda(lr_section, training.steps)  # validates the schedule section
    _check_optimizer(optimizer_section, dims, cfg.get("lora_config"))
    check_name_keys(model_config, optimizer_section, cfg.get("lora_config"), monitor)
    if cfg.get("lora_config") and model_config.sparse_attention and not model_config.dsa_indexer_use_sparse_loss:
        # the warm-up stage trains the indexers alone; LoRA would freeze them with the rest of the base
        raise ConfigError("lora_config: not with DeepSeek-V3.2's dense warm-up stage (model.dsa_indexer_use_sparse_loss: "
                          "false trains the indexers only, which LoRA would freeze); drop one of them")

    from lit_moe.checkpoint import build_checkpoint_callback
    from lit_moe.checkpoint.callback import check_hf_export
    from lit_moe.checkpoint.auto_resume import resolve_start

    # crash recovery, auto-resume, finished run, writable paths, changed schedule (resilience)
    explicit_max = "max_steps" in _explicit_trainer_keys() and trainer_section.get("max_steps") is not None
    start = resolve_start(checkpoint, model_config,
                          max_steps=trainer_section["max_steps"] if explicit_max else training.steps,
                          lr_section=lr_section, optimizer_section=optimizer_section, total_steps=training.steps,
                          tensorboard_dir=monitor.tensorboard.output_dir, data_parallel=dims.dp)
    checkpoint, load = start.checkpoint, start.load
    from lit_moe.runtime.elastic import fresh_rendezvous

    fresh_rendezvous(parallelism.process_group_timeout_s)  # torchrun restarts: no stale rendezvous keys

    from lit_moe.strategies.plan import check_fits

    local_processes = run.launch.devices
    check_fits(model_config, shape, parallelism, optimizer_section, accelerator, local_processes)

    # Everything is valid: seed and build.
    pl.seed_everything(training.seed, workers=True, verbose=False)
    if training.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)

    run.training = training
    run.context = context
    run.model_config = model_config
    run.shape = shape
    run.ckpt_path = load.ckpt_path
    run.module = LitMoE(model_config, optimizer_section, lr_section, training, shape.accumulation_at(0),
                        weights_loader=load.weights_loader, lora=cfg.get("lora_config"))
    run.datamodule = MegatronDataModule(train_dataset, local_batch_size=training.local_batch_size,
                                        seed=training.seed, seq_length=seq_length, accumulation_steps=shape.accumulation,
                                        batch_ramp=shape.ramp)
    # Megatron-style splits know their sample count here (MindRecord files are counted when read)
    split_sizes = getattr(run.datamodule.spec, "sizes", None)
    train_samples = split_sizes[0] if split_sizes else None
    if train_samples is not None and shape.samples_per_step > train_samples:
        raise ConfigError(f"training.global_batch_size: one optimizer step takes {shape.samples_per_step:,} samples "
                          f"(accumulation {shape.accumulation:,} x local batch {training.local_batch_size} x data parallel {dims.dp}), more "
                          f"than the train split's {train_samples:,} (train_dataset.dataloader.sizes[0])")
    fp32_grads = optimizer_section.get("accumulate_allreduce_grads_in_fp32", True)
    if not isinstance(fp32_grads, bool):
        raise ConfigError(f"optimizer.accumulate_allreduce_grads_in_fp32: expected true or false, got {fp32_grads!r}")
    run.strategy = AscendFSDPStrategy(parallelism=parallelism, model_config=model_config,
                                      accumulate_allreduce_grads_in_fp32=fp32_grads, checkpoint=checkpoint,
                                      expected_world_size=world_size, run_shape=shape)

    from lit_moe.callbacks import build_callbacks, build_logger, load_callbacks, merge_callbacks

    resolved = _resolved_config(cfg)
    builtin = list(build_callbacks(monitor, profiler, context, model_config, seq_length, resolved))
    from lit_moe.callbacks.evaluation import build_evaluation

    evaluation = build_evaluation(training, cfg.get("eval_dataset"), seq_length)
    if evaluation is not None:   # after the step's metrics callbacks, before the loggers' bridge
        builtin.insert(len(builtin) - 1, evaluation)
    check_hf_export(checkpoint, model_config)
    ckpt_cb = build_checkpoint_callback(checkpoint, shape.global_batch_size)
    if ckpt_cb is not None:
        builtin.append(ckpt_cb)
    builtin.extend(start.callbacks)  # after the checkpoint callback: preemption relies on its final save
    user = load_callbacks(cfg.get("callbacks"), base_dir=_CONFIG_DIR[0] if _CONFIG_DIR else None)
    run.callbacks = merge_callbacks(builtin, user)
    run.logger = build_logger(monitor)
    run.explicit_trainer_keys = set(_explicit_trainer_keys())
    run.dtype_note = dtype_note
    return run


def _namespace_to_dict(ns: Any) -> dict:
    if ns is None:
        return {}
    if isinstance(ns, dict):
        return ns
    return {k: v for k, v in vars(ns).items()}


def _resolved_config(cfg: Any) -> dict:
    out = {}
    for key in list(FIXED_SECTIONS) + list(OPEN_SECTIONS) + ["callbacks", "lora_config", "eval_dataset"]:
        value = cfg.get(key)
        if hasattr(value, "__dict__") and not isinstance(value, dict):
            value = _namespace_to_dict(value)
        out[key] = to_dict(value)
    return out


def _check_training(t: TrainingConfig) -> None:
    for name in ("steps", "local_batch_size", "global_batch_size"):
        value = getattr(t, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"training.{name}: must be a positive integer, got {value!r}")
    if not math.isfinite(t.max_norm) or t.max_norm < 0:
        raise ConfigError(f"training.max_norm: must be a finite number >= 0 (0 disables clipping), got {t.max_norm!r}")
    if isinstance(t.seed, bool) or not isinstance(t.seed, int) or not 0 <= t.seed < 2 ** 32:
        raise ConfigError(f"training.seed: must be an integer in [0, 2**32), got {t.seed!r}")


def _check_optimizer(section: dict, dims: Any = None, lora: Any = None) -> None:
    from lit_moe.optim.optimizers import validate_optimizer_section
    from lit_moe.optim.qk_clip import check_qk_clip_layout

    settings = validate_optimizer_section(section)
    if settings.type == "Muon" and settings.qk_clip_enabled and dims is not None:
        check_qk_clip_layout(dims, lora)


def _dataset_seq_length(ds: TrainDatasetConfig, model_config) -> int:
    dl = ds.dataloader or {}
    seq = (dl.get("config") or {}).get("seq_length")
    model_seq = getattr(model_config, "seq_length", None)
    if seq is None:
        seq = model_seq
    if seq is None:
        raise ConfigError("train_dataset.dataloader.config.seq_length: missing (and model.seq_length is not set)")
    if model_seq is not None and int(model_seq) != int(seq):
        raise ConfigError(f"train_dataset.dataloader.config.seq_length: {seq} differs from model.seq_length "
                          f"{model_seq}")
    return int(seq)


_EXPLICIT_TRAINER_KEYS: list[str] = []
_CONFIG_DIR: list[str] = []  # directory of the --config file: user callback modules may live there


def _explicit_trainer_keys() -> list[str]:
    return list(_EXPLICIT_TRAINER_KEYS)


def _remember_run_config(cfg: dict, config_paths: list[str]) -> None:
    """Which Trainer arguments the user set (so that our defaults — max_steps from training.steps, our
    strategy, ... — yield only to those), and the directory of the first ``--config`` file."""
    trainer = cfg.get("trainer")
    _EXPLICIT_TRAINER_KEYS[:] = sorted(trainer) if isinstance(trainer, dict) else []
    _CONFIG_DIR[:] = [os.path.dirname(os.path.abspath(config_paths[0]))] if config_paths else []


def check_sections(cfg: Any) -> None:
    """The checks ``fit`` makes of the sections before it builds anything, for ``--print_config``:
    training, model, recompute, lr_scheduler and optimizer values and the keys that name parameters
    (the layout, data and checkpoint checks need the run's devices and files)."""
    from lit_moe.model import DeepseekV3Config
    from lit_moe.model.mindformers_defaults import read_pynative_model_section
    from lit_moe.name_keys import check_name_keys
    from lit_moe.optim.schedules import build_lr_lambda
    from lit_moe.strategies.recompute import validate_recompute

    training = build_section(TrainingConfig, cfg.get("training"), "training")
    _check_training(training)
    model_section = dict(cfg.get("model") or {})
    if not model_section:
        raise ConfigError("model: the section is missing or empty")
    model_config = DeepseekV3Config(**read_pynative_model_section(model_section))
    validate_recompute(build_section(RecomputeConfig, cfg.get("recompute"), "recompute"),
                       build_section(RecomputeCommConfig, cfg.get("recompute_comm"), "recompute_comm"), model_config.total_layers)
    build_lr_lambda(dict(cfg.get("lr_scheduler") or {}), training.steps)
    optimizer_section = dict(cfg.get("optimizer") or {})
    _check_optimizer(optimizer_section)
    check_name_keys(model_config, optimizer_section, cfg.get("lora_config"), cfg.get("monitor"))


def _check_trainer_classes(trainer: Any) -> None:
    """``trainer.logger`` / ``trainer.callbacks`` given by ``class_path``: one line naming the class or
    argument that is wrong, before jsonargparse reports only that no type of its union matched."""
    if not isinstance(trainer, dict):
        return
    from lightning.pytorch import Callback
    from lightning.pytorch.loggers import Logger

    from lit_moe.callbacks.user import check_class_specs

    base_dir = _CONFIG_DIR[0] if _CONFIG_DIR else None
    for key, base in (("logger", Logger), ("callbacks", Callback)):
        check_class_specs(trainer.get(key), f"trainer.{key}", base, base_dir)


def printable_config(cfg: dict) -> dict:
    """The run's configuration as ``--print_config`` prints it: every fixed section with its defaults
    filled in, the open sections as written, and only the ``trainer`` keys the user set (Lightning's
    defaults, such as ``max_steps: -1``, would override ``training.steps`` when the output is loaded
    again)."""
    from lit_moe.config import OTHER_TOP_LEVEL

    out: dict = {}
    for name, cls in FIXED_SECTIONS.items():
        out[name] = section_defaults(cls, cfg.get(name))
    for name in OPEN_SECTIONS:
        out[name] = cfg.get(name) or {}
    for name in OTHER_TOP_LEVEL:
        if cfg.get(name) is not None:
            out[name] = cfg[name]
    return out


SUBCOMMANDS = {
    "fit": "train from a pynative.yaml (lit_moe fit --config FILE [--SECTION.KEY VALUE ...] [--print_config])",
    "plan": "check a parallel layout and print per-rank memory, without devices (lit_moe plan --config FILE -n N)",
    "preprocess": "tokenize JSONL/text into a Megatron .bin/.idx dataset",
    "convert-config": "convert a MindFormers graph-mode graph.yaml into a pynative.yaml",
    "convert-hf": "export a lit_moe checkpoint to the Hugging Face layout",
    "predict": "generate text from a checkpoint (lit_moe predict --config FILE --checkpoint DIR --prompt TEXT)",
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = ["usage: lit_moe SUBCOMMAND [options]   (lit_moe SUBCOMMAND --help for its options)", "",
             "subcommands:"]
    lines += [f"  {name:<{width}}  {text}" for name, text in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(args: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if args is None else args)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] in TOOLS:
        from lit_moe.tools.errors import run_tool

        return run_tool(argv[0], TOOLS[argv[0]], argv[1:])
    if argv[0] != "fit":
        print(f"lit_moe: error: unknown subcommand {argv[0]!r}{suggest(argv[0], SUBCOMMANDS)}; subcommands: "
              + ", ".join(SUBCOMMANDS), file=sys.stderr)
        return 2
    if any(a in ("-h", "--help") for a in argv[1:]):
        try:
            LitMoECLI(args=["fit", "--help"])
        except SystemExit as exit_:
            return int(exit_.code or 0)
        return 0
    from jsonargparse import ArgumentError
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lit_moe.callbacks import SkipLimitExceeded
    from lit_moe.checkpoint.auto_resume import RunFinished
    from lit_moe.runtime.preemption import exit_status
    from lit_moe.config_file import load_run_config
    from lit_moe.tools.errors import one_line

    import warnings

    try:
        cfg, rest, config_paths = load_run_config(argv[1:])
        if any(a.partition("=")[0] == "--print_config" for a in rest):
            import yaml

            check_sections(cfg)   # exits 2 with fit's one-line error on a section fit refuses
            sys.stdout.write(yaml.safe_dump(printable_config(cfg), sort_keys=False))
            return 0
        rest = [a for a in rest if a.partition("=")[0] != "--print_config"]
        if rest:
            raise ConfigError(f"unexpected argument {rest[0]!r}; options are --config FILE and --SECTION.KEY VALUE")
        _remember_run_config(cfg, config_paths)
        _check_trainer_classes(cfg.get("trainer"))
        with warnings.catch_warnings():
            # In-process callers (tests, notebooks) pass args while sys.argv holds their own.
            warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python.*")
            LitMoECLI(args={"subcommand": "fit", "fit": cfg})
        _close_process_group()
    except (ConfigError, ArgumentError, MisconfigurationException) as err:
        # The one handler of a user's configuration errors: lit_moe's own (ConfigError, and the
        # CheckpointError / ParallelismError / PipelineError derived from it), jsonargparse's and
        # Lightning's, wherever they are raised (also inside Trainer.fit's setup)
        print(f"lit_moe: error: {one_line(err)}", file=sys.stderr)
        return 2
    except SkipLimitExceeded as err:
        print(f"lit_moe: error: {one_line(err)}", file=sys.stderr)
        return 1
    except RunFinished as done:
        print(f"lit_moe: {done}", file=sys.stderr)
        return 0
    return exit_status()  # 128 + signal when a preemption signal stopped the run


def _close_process_group() -> None:
    """After a finished fit: every rank waits for the others, then closes its connections and joins
    its communication threads (``release_process_groups``). A rank that exits while a peer's gloo
    thread still finishes the last pipeline transfers tore that peer down ("terminate called without
    an active exception", seen under pipeline_parallel 4)."""
    import torch.distributed as dist

    from lit_moe.runtime.distributed import release_process_groups

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    release_process_groups()


if __name__ == "__main__":
    sys.exit(main())
