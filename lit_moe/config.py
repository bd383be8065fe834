"""The sections of a MindFormers ``pynative.yaml``, as dataclasses whose field docstrings are the docs.

Fixed sections (``checkpoint``, ``training``, ``parallelism``, ``recompute``, ``recompute_comm``,
``train_dataset``, ``monitor``, ``profiler``, ``context``) reject unknown keys. ``model``,
``optimizer``, ``lr_scheduler`` and ``train_dataset.dataloader`` accept extra keys, as in MindFormers
(``allow_extra``), and are kept as plain dicts here; their consumers validate them.

Every validation error is a :class:`ConfigError` whose message names the field (``section.key``)
and the offending value; the CLI prints it as one line and exits with code 2.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union


class ConfigError(ValueError):
    """A bad value in the user's configuration. The message names the field and the value."""


# ----------------------------------------------------------------------------------------------
# checkpoint
# ----------------------------------------------------------------------------------------------
@dataclass
class CheckpointConfig:
    enable_save: bool = True
    """Save checkpoints at all. False: nothing is written, not even the final checkpoint."""
    save_path: str = "output/checkpoints"
    """Root directory of checkpoints: ``save_path/iteration_XXXXXXXX/`` plus the tracker file
    ``latest_checkpointed_iteration.txt``. (MindFormers defaults to "" and then refuses to start.)"""
    save_max: int = 5
    """Keep at most this many iteration directories saved by this run; the oldest of this run goes
    first. Directories of earlier runs are never deleted."""
    save_interleaved_steps: int = 1000
    """Save when ``global_step % save_interleaved_steps == 0`` (global_step counts optimizer steps from 1)."""
    no_save_optim: bool = False
    """Do not write optimizer state (smaller files; such a checkpoint can only be used for fine-tuning)."""
    async_save: bool = False
    """Write files in the background while training goes on; the tracker is updated once all ranks finish."""
    prefix: Optional[str] = "checkpoint"
    """File-name prefix of the tensor files inside an iteration directory; null for none."""
    remove_redundancy: bool = False
    """Write tensors replicated across data-parallel ranks once (by one rank) instead of by every replica."""
    load_path: str = ""
    """Checkpoint to start from: a ``save_path`` (its tracker is followed), one iteration directory, or a
    Hugging Face ``save_pretrained`` directory (needs ``no_load_optim: True``). Empty: fresh start, or
    the checkpoints already in ``save_path`` (``auto_resume``).
    A path that does not exist is an error (MindFormers warns and starts fresh)."""
    load_balanced: bool = False
    """Spread the reading of replicated tensors over ranks (each reads a part, then they are broadcast)."""
    no_load_optim: bool = False
    """True: load weights only (fine-tuning: step 0, fresh optimizer and schedule). False: resume
    everything (weights, optimizer, schedule, step, expert biases, RNG, data position)."""
    load_worker_number: int = 1
    """Reader threads per rank when loading."""
    auto_resume: bool = True
    """With ``load_path`` empty and a tracker in ``save_path``: resume from it, exactly as
    ``load_path: <save_path>`` would (a relaunch of the same command continues where it stopped; one
    already at its last step exits 0 and writes nothing). False: refuse to start on a ``save_path``
    that already holds checkpoints."""
    override_schedule: bool = False
    """On resume, the learning-rate schedule (type, learning_rate, lr_end, warm-up, training.steps, ...)
    and optimizer hyperparameters (type, betas, eps, weight_decay, ...) recorded in the checkpoint
    must equal the config's: a difference is an error listing them. True: the config wins (Megatron's
    ``--override-opt_param-scheduler``): its schedule is evaluated at the restored step and its
    optimizer hyperparameters replace the saved ones (moments and step counts are kept)."""


# ----------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------
@dataclass
class TrainingConfig:
    steps: int = 1000
    """Number of optimizer steps; also the total steps of the learning-rate schedule."""
    local_batch_size: int = 1
    """Samples per micro-batch on each rank."""
    global_batch_size: int = 1
    """Samples per optimizer step over all ranks. Accumulation steps
    ``A = global_batch_size // (data_parallel * local_batch_size)``."""
    max_norm: float = 1.0
    """Clip gradients to this global L2 norm (computed in fp32 over every gradient). 0 disables clipping
    (MindFormers would zero all gradients instead)."""
    seed: int = 42
    """Seeds Python, NumPy and torch RNGs on every rank, and the data workers."""
    deterministic: bool = False
    """Use deterministic algorithms: two runs give bitwise identical losses on CPU."""


# ----------------------------------------------------------------------------------------------
# parallelism
# ----------------------------------------------------------------------------------------------
@dataclass
class ParallelismConfig:
    data_parallel_shard: int = -1
    """FSDP shard degree. -1: shard over all data-parallel ranks (pure FSDP). N > 0: HSDP with
    ``dp_replicate = data_parallel // N`` replicas of N-way shards."""
    data_parallel_shard_strategy: str = "optim_grads_params"
    """``optim_grads_params`` (ZeRO-3: parameters resharded after forward) or ``optim_grads``
    (ZeRO-2: gathered parameters kept between forward and backward)."""
    tensor_parallel: int = 1
    """Tensor-parallel degree (with sequence parallelism) for attention, dense MLP, shared experts,
    embedding and head."""
    context_parallel: int = 1
    """Context-parallel degree: the sequence is split across this many ranks."""
    pipeline_parallel: int = 1
    """Pipeline-parallel degree. Only 1 is supported for now."""
    expert_parallel: int = 1
    """Expert-parallel degree; must divide ``data_parallel_shard * context_parallel * tensor_parallel``
    and ``n_routed_experts``. Experts borrow ranks from those dimensions (world size is unchanged)."""
    moe_token_dispatcher_type: str = "alltoall"
    """How tokens reach their experts under expert parallelism: ``alltoall`` or ``allgather``."""
    gradient_sync_every_microbatch: bool = True
    """True: reduce-scatter gradients after every micro-batch (least memory). False: accumulate
    unsharded gradients locally and synchronise once per optimizer step (less communication)."""
    process_group_timeout_s: int = 600
    """Collective timeout in seconds: a dead rank ends the job with an error instead of a hang."""


# ----------------------------------------------------------------------------------------------
# recompute / recompute_comm
# ----------------------------------------------------------------------------------------------
LayerSpec = Union[int, str]


@dataclass
class RecomputeConfig:
    mode: Optional[str] = None
    """``None`` (off), ``full`` (whole layers listed in ``full_recompute_layer``) or ``select``
    (modules matched by ``select_module``). Works on one device too."""
    full_recompute_layer: Optional[list[LayerSpec]] = None
    """Layers recomputed whole: ints or ``"a-b"`` ranges (YAML ``[0-3]`` is the string ``"0-3"``).
    Decoder layers are 0..L-1, MTP layers follow at L..L+M-1."""
    select_module: Optional[dict[str, list[LayerSpec]]] = None
    """``{regex: layer specs}``: dotted module paths inside those layers that fully match the regex
    are recomputed (a child is dropped when its parent is selected)."""


@dataclass
class RecomputeCommConfig:
    enable: bool = False
    """Recompute the outputs of matched communication steps in backward instead of keeping them."""
    select_module: Optional[dict[str, list[LayerSpec]]] = None
    """``{regex: layer specs}`` naming communication steps, e.g. ``'mlp.router.all_gather': [0-3]``."""


# ----------------------------------------------------------------------------------------------
# train_dataset
# ----------------------------------------------------------------------------------------------
@dataclass
class TrainDatasetConfig:
    dataloader: dict[str, Any] = field(default_factory=dict)
    """The dataset: ``type: BlendedMegatronDatasetDataLoader``, ``datasets_type: GPTDataset``,
    ``sizes``, ``config`` (GPTDataset keys), ``column_names``, ``shuffle``, ``python_multiprocessing``.
    Extra keys are allowed."""
    drop_remainder: bool = True
    """Drop the last incomplete micro-batch."""
    num_parallel_workers: int = 8
    """DataLoader worker processes per rank (capped at the CPUs available)."""
    prefetch_size: int = 1
    """Batches prefetched per worker."""
    numa_enable: bool = False
    """Bind data workers to the NUMA node of the rank's device (best effort, Linux only)."""


# ----------------------------------------------------------------------------------------------
# monitor
# ----------------------------------------------------------------------------------------------
@dataclass
class HealthCheckpointConfig:
    global_norm_skip_threshold: float = 100.0
    """Skip the optimizer update when the global gradient norm exceeds this (or is NaN/Inf)."""
    global_norm_skip_time: int = 10
    """Stop training when more than this many consecutive steps were skipped."""
    embedding_local_norm_threshold: float = 100.0
    """Skip the update when the embedding gradient norm alone exceeds this."""


@dataclass
class TrainStateConfig:
    device_loss: bool = False
    """Print the reduced step loss as a JSON line per step."""
    local_loss: bool = False
    """Log each micro-batch's (1/A-scaled) loss."""
    local_norm: Union[bool, str, list[str]] = ""
    """Per-parameter gradient norm of each micro-batch: True for all, or substring filters."""
    device_norm: Union[bool, str, list[str]] = False
    """Per-parameter gradient norm after accumulation: True for all, or substring filters."""


@dataclass
class TensorBoardConfig:
    output_dir: str = "output/tensorboard"
    """TensorBoard log directory; empty disables TensorBoard."""
    log_interval: int = 1
    """Write scalars every N optimizer steps."""
    queue_size: int = 1000
    """Writer queue size."""


@dataclass
class MoEMonitorConfig:
    save_tokens_per_expert_interval: Optional[int] = None
    """Log per-expert token counts and the expert-load heatmap every N steps (None: every log step for
    scalars, heatmap every 50)."""
    target_layers: Optional[Union[int, list[int]]] = None
    """Which MoE layers to report: an int for the first N, or a list of layer ids."""


@dataclass
class MonitorConfig:
    health_checkpoint: HealthCheckpointConfig = field(default_factory=HealthCheckpointConfig)
    """Global-norm skip protection."""
    train_state: TrainStateConfig = field(default_factory=TrainStateConfig)
    """Extra per-step loss/norm printing."""
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    """TensorBoard logging."""
    moe_monitor: MoEMonitorConfig = field(default_factory=MoEMonitorConfig)
    """MoE routing metrics."""


# ----------------------------------------------------------------------------------------------
# profiler / context
# ----------------------------------------------------------------------------------------------
@dataclass
class ProfilerConfig:
    enable_profiling: bool = False
    """Record a torch.profiler trace (torch_npu's profiler on Ascend) of steps start_step..end_step."""
    start_step: int = 1
    """First profiled optimizer step (1-based)."""
    end_step: int = 1
    """Last profiled optimizer step (inclusive)."""
    output_path: Optional[str] = None
    """Trace directory (default ``output/profile``)."""
    profiler_rank: Optional[list[int]] = None
    """Ranks that profile (default all)."""
    profile_memory: bool = False
    """Record tensor allocations."""
    with_stack: bool = True
    """Record Python stacks."""
    profile_cpu: bool = True
    """Record CPU activity."""


@dataclass
class AffinityConfig:
    enable: bool = False
    """Bind processes to CPUs."""
    affinity_cpu_list: Optional[dict[str, Any]] = None
    """``{"device0": ["0-7"], ...}`` or the seed's ``{"device0": {"affinity_cpu_list": [...],
    "module_to_cpu_dict": {...}}}``: CPUs for each local rank's main process and its data workers."""


@dataclass
class ContextConfig:
    mode: int = 1
    """Accepted for compatibility (1 = PyNative)."""
    device_target: Optional[str] = None
    """Accelerator: ``cpu``, ``cuda``/``gpu``, ``npu``/``Ascend``; None picks the best available."""
    max_device_memory: Optional[str] = None
    """Accepted for compatibility; not enforced."""
    affinity_config: AffinityConfig = field(default_factory=AffinityConfig)
    """CPU affinity of each rank's processes."""


# ----------------------------------------------------------------------------------------------
# layer specs (shared by recompute and the MTP/decoder addressing)
# ----------------------------------------------------------------------------------------------
_SPEC = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_layer_specs(specs: Any, num_layers: int, name: str) -> list[int]:
    """Expand ``[0, "2-4"]`` into ``[0, 2, 3, 4]``; specs must be ascending and non-overlapping and
    every layer below ``num_layers``. ``name`` is the field reported in errors."""
    if isinstance(specs, (int, str)):
        specs = [specs]
    if not isinstance(specs, (list, tuple)):
        raise ConfigError(f"{name}: expected a list of layer ids or 'a-b' ranges, got {specs!r}")
    layers: list[int] = []
    for spec in specs:
        if isinstance(spec, bool):
            raise ConfigError(f"{name}: layer spec {spec!r} is not an int or 'a-b' range")
        if isinstance(spec, int):
            lo = hi = spec
        elif isinstance(spec, str) and _SPEC.match(spec):
            m = _SPEC.match(spec)
            lo = int(m.group(1))
            hi = int(m.group(2)) if m.group(2) is not None else lo
        else:
            raise ConfigError(f"{name}: layer spec {spec!r} is not an int or 'a-b' range")
        if lo < 0 or lo > hi:
            raise ConfigError(f"{name}: layer range {spec!r} must satisfy 0 <= a <= b")
        if hi >= num_layers:
            raise ConfigError(
                f"{name}: layer {hi} in {spec!r} is out of range; the model has {num_layers} layers "
                "(decoder plus MTP)")
        if layers and lo <= layers[-1]:
            raise ConfigError(f"{name}: layer specs must be ascending and non-overlapping, got {spec!r} "
                              f"after layer {layers[-1]}")
        layers.extend(range(lo, hi + 1))
    return layers


def to_dict(obj: Any) -> Any:
    """Dataclass tree → plain dicts (for printing and TensorBoard)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def load_yaml(path: str, field: str = "--config") -> dict:
    """Read a YAML file holding a mapping (a pynative.yaml or graph.yaml). Unreadable files, invalid YAML
    and non-mappings are one-line :class:`ConfigError`s naming ``field`` and the file."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as err:
        raise ConfigError(f"{field}: cannot read {path!r} ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{field}: {path!r} is not valid YAML ({' '.join(str(err).split())})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{field}: {path!r} does not hold a mapping of sections")
    return data


def parse_number(value: Any, field: str) -> float:
    """A finite float from a config value: ints accepted, bools not, and a numeric string such as
    ``"1e-5"`` (what PyYAML makes of an exponent without a dot) read as the number it spells."""
    raw = value
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{field}: expected a number, got {raw!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{field}: expected a finite number, got {raw!r}")
    return float(value)
