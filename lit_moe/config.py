"""The sections of a MindFormers ``pynative.yaml``, as dataclasses whose field docstrings are the docs.

Every key of MindFormers' PyNative config classes is a field here: implemented with MindFormers'
meaning, refused with a one-line "not yet" error when its value needs an engine lit_moe lacks, or
accepted without effect and listed, with the reason, in :data:`NO_EFFECT_KEYS` (the one list; the
README's table and the ``model`` section read it).

Fixed sections (``FIXED_SECTIONS``) reject unknown keys with a did-you-mean suggestion.
``optimizer``, ``lr_scheduler`` and ``train_dataset.dataloader`` accept extra keys, as in MindFormers
(``allow_extra``), and are kept as plain dicts; their consumers validate them. ``model`` is read by
``lit_moe.model.DeepseekV3Config``, which refuses keys it does not know. Reading YAML files and
command-line overrides lives in :mod:`lit_moe.config_file`.

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
    save_hf_at_end: str = ""
    """At the end of training, also write the final weights in the Hugging Face DeepSeek-V3 layout
    (``config.json``, safetensors, ``model.safetensors.index.json`` when sharded) into this directory,
    as ``lit_moe convert-hf`` would (TorchTitan's ``last_save_in_hf``). Any layout: rank 0 rebuilds
    the model from the final iteration directory (every rank's pieces; LoRA adapters merged) and writes
    a temporary sibling directory, renamed when complete. Needs ``enable_save``; the directory must be
    absent or empty at start. Empty: no export."""
    save_hf_max_shard_size: str = "5GB"
    """Largest safetensors file of the ``save_hf_at_end`` export (e.g. ``5GB``, ``500MB``, bytes)."""
    save_global_layout_cache: bool = True
    """Accepted, no effect (see "Keys accepted without effect")."""
    reshard_worker_num: int = 1
    """Accepted, no effect (see "Keys accepted without effect")."""


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
    rampup_batch_size: Optional[list] = None
    """``[start, increment, rampup_samples]``: MindFormers' dynamic global batch size. The global batch
    starts at ``start`` and grows by ``increment`` every ``rampup_samples / ((global_batch_size - start) /
    increment)`` consumed samples until it reaches ``global_batch_size`` (after ``rampup_samples``); the
    micro-batch and data-parallel size stay fixed, so the accumulation steps (and a pipeline's
    micro-batches) grow with it. Every level must be divisible by ``data_parallel * local_batch_size``.
    ``training.steps`` and the learning-rate schedule count optimizer steps, as in MindFormers. A resume
    continues the ramp from the checkpoint's consumed samples. null: ``global_batch_size`` throughout.
    See "Global batch ramp-up"."""
    eval_interval: int = 0
    """Optimizer steps between evaluations (0: never): a no-grad pass over the valid split of the train
    blend (``train_dataset.dataloader.sizes[1]``) or over the ``eval_dataset`` section, logged as
    ``val/loss`` and ``val/ppl`` (see ``lit_moe/callbacks/evaluation.py``)."""
    eval_iters: int = 10
    """Micro-batches (of ``local_batch_size``) per data-parallel rank in each evaluation; the same
    samples every time."""


# ----------------------------------------------------------------------------------------------
# parallelism
# ----------------------------------------------------------------------------------------------
@dataclass
class ParallelismConfig:
    data_parallel_shard: int = -1
    """FSDP shard degree. -1: shard over all data-parallel ranks (pure FSDP). N > 0: HSDP with
    ``dp_replicate = data_parallel // N`` replicas of N-way shards."""
    data_parallel_shard_strategy: str = "optim_grads_params"
    """Megatron-FSDP's names: ``optim_grads_params`` (ZeRO-3: parameters resharded after forward),
    ``optim_grads`` (ZeRO-2: gathered parameters kept between forward and backward) or ``optim``
    (ZeRO-1: optimizer state and the fp32 master weights sharded over the data-parallel shard ranks;
    parameters, gathered once by the step's first forward, and gradients, accumulated unsharded in fp32,
    stay whole until the last micro-batch's backward, which reduce-scatters the gradients once per step;
    ``gradient_sync_every_microbatch`` has no effect then). Unlike Megatron's ``optim``, the gathered
    parameters are freed after the step's last backward (FSDP2 keeps no whole copy between steps), so the
    next step gathers them again: one all-gather and one reduce-scatter per FSDP unit per step.
    With pipelines each stage's FSDP units behave the same (torch's schedule reduces once per step).
    An explicit ``reshard_after_forward_policy`` (``always``/``never``) takes precedence (``always``
    with ``optim`` is refused); layers whose ``fsdp.all_gather`` is recomputed (``recompute_comm``)
    gather again in each backward."""
    reshard_after_forward_policy: str = "default"
    """FSDP ``reshard_after_forward`` (MindFormers): ``always`` (reshard: ZeRO-3), ``never`` (keep the
    gathered parameters until backward: ZeRO-2), ``default`` (follow ``data_parallel_shard_strategy``,
    whose default is ZeRO-3, MindFormers' ``default`` without pipeline parallelism)."""
    cpu_offload: bool = False
    """FSDP CPU offload of parameters, gradients and optimizer state: not implemented yet (True is an
    error)."""
    disable_gradient_division: bool = True
    """True (MindFormers' default): gradients are summed over data/context-parallel ranks and the loss
    carries ``1/data_parallel`` (per context-parallel rank), so the update uses the mean gradient. False:
    MindFormers' FSDP mean on top of that, i.e. every gradient is divided once more by the size of its
    FSDP reduce group (``data_parallel * context_parallel`` for dense weights, ``dp_replicate * efsdp``
    for routed experts). No effect on one process (no FSDP)."""
    dense_fsdp_shard_size: Optional[int] = None
    """Shard dense weights over only k of the ``dp_shard * cp`` ranks and replicate them over the
    F/k groups (MindFormers' reduced dense FSDP mesh; routed experts keep theirs). Validated (k in
    [1, F] dividing F = dp_shard * cp); k = F is the default sharding; k < F is refused in one line:
    it needs a dense mesh apart from the one the experts' mesh is folded from, not implemented yet.
    null: shard over all."""
    tensor_parallel: int = 1
    """Tensor-parallel degree (with sequence parallelism) for attention, dense MLP, shared experts,
    embedding and head."""
    sequence_parallel: Optional[bool] = None
    """Sequence parallelism between tensor-parallel layers. lit_moe always uses it with
    ``tensor_parallel > 1``; null or true mean that; false with ``tensor_parallel > 1`` is MindFormers'
    error."""
    context_parallel: int = 1
    """Context-parallel degree: the sequence is split across this many ranks (zig-zag: 2·cp chunks,
    rank r holds chunks r and 2·cp-1-r, so causal attention work is equal on every rank)."""
    context_parallel_method: str = "colossal"
    """How attention sees the other ranks' tokens: ``colossal`` (all-gather keys and values),
    ``ulysses`` (all-to-all from sequence shards to head shards and back; the heads per
    tensor-parallel rank must divide by context_parallel) or ``hybrid`` (ulysses inside groups of
    ``ulysses_degree_in_cp`` ranks, all-gather across the groups)."""
    context_parallel_async: bool = False
    """Overlap the ulysses all-to-alls with attention (head groups pipelined). MindFormers allows it
    for ``ulysses`` and ``hybrid`` only."""
    ulysses_degree_in_cp: Optional[int] = None
    """Ulysses degree u: ``ulysses`` needs it unset or equal to context_parallel; ``hybrid`` needs
    1 < u < context_parallel with context_parallel % u == 0."""
    context_parallel_mask_type: str = "causal"
    """Only ``causal`` (MindFormers' only value)."""
    pipeline_parallel: int = 1
    """Pipeline-parallel degree: decoder layers split over this many stages (torch.distributed.pipelining)."""
    pipeline_parallel_schedule: str = "1f1b"
    """``1f1b``, ``interleaved_1f1b`` or ``gpipe`` (``1f1b`` becomes ``interleaved_1f1b`` with
    ``pipeline_parallel_interleave_num > 1``, as in MindFormers); also torch's zero-bubble ``interleaved_zb``
    and ``zbv`` and DeepSeek's ``dualpipev`` (V-shaped like ``zbv``: 2 stages per rank, one micro-batch's
    forward paired with another's backward; at least 2·pipeline_parallel micro-batches). Used when
    ``pipeline_parallel > 1``."""
    pipeline_parallel_microbatch_size: int = 1
    """Accepted, no effect (see "Keys accepted without effect")."""
    pipeline_parallel_interleave_num: int = 1
    """Virtual pipeline stages (model chunks) per pipeline rank; >= 1."""
    pipeline_parallel_layers_per_stage: Optional[Union[str, list]] = None
    """Decoder layers of each pipeline stage: null or ``auto`` (equal split; the layer count must divide
    ``pipeline_parallel * pipeline_parallel_interleave_num``) or one string per stage of
    ``interleave_num`` comma-separated ``"a-b"`` ranges, or a list of layer-id lists."""
    pipeline_parallel_overlap_p2p: bool = False
    """Accepted, no effect (see "Keys accepted without effect")."""
    pipeline_parallel_overlap_b_f: bool = False
    """Accepted, no effect (see "Keys accepted without effect")."""
    pipeline_parallel_enable_dxdw_split: bool = False
    """Accepted, no effect (see "Keys accepted without effect"); the split itself is what the
    ``interleaved_zb``, ``zbv`` and ``dualpipev`` schedules do."""
    pipeline_parallel_p2p_transport: str = "plain"
    """``plain`` or ``auto`` (MindFormers' choices, validated). Accepted, no effect (see "Keys
    accepted without effect")."""
    enable_mc2: bool = False
    """Accepted, no effect (see "Keys accepted without effect")."""
    enable_loss_parallel: bool = False
    """Accepted, no effect (see "Keys accepted without effect")."""
    expert_parallel: int = 1
    """Expert-parallel degree; must divide ``data_parallel_shard * context_parallel * tensor_parallel``
    and ``n_routed_experts``. Experts borrow ranks from those dimensions (world size is unchanged)."""
    npu_nums_per_device: int = 8
    """Accepted, no effect (see "Keys accepted without effect")."""
    moe_token_dispatcher_type: str = "alltoall"
    """How tokens reach their experts under expert parallelism: ``alltoall`` (one row per token-expert
    assignment), ``allgather`` or ``alltoall_deredundancy`` (MindFormers: a token crosses to another
    rank once, however many of its experts sit there, and is fanned out to them on arrival; the same
    results with fewer bytes; needs ``expert_parallel >= npu_nums_per_device``, MindFormers' rule)."""
    expert_parallel_async_d2h: bool = False
    """Accepted, no effect (see "Keys accepted without effect")."""
    expert_parallel_use_safe_tokens: bool = True
    """Accepted, no effect (see "Keys accepted without effect")."""
    gradient_sync_every_microbatch: bool = True
    """True: reduce-scatter gradients after every micro-batch (least memory). False: accumulate
    unsharded gradients locally and synchronise once per optimizer step (less communication). No
    effect with ``data_parallel_shard_strategy: optim`` (always once per step)."""
    process_group_timeout_s: int = 600
    """Collective timeout in seconds: a dead or stuck rank ends the job with an error instead of a
    hang. It applies to every group of the run: the default one, each device-mesh dimension (tp, ep,
    cp, fsdp, ...), context parallel's and the pipeline's groups (torch would give those its own
    default, 30 minutes for gloo and 10 for NCCL). The start-up rendezvous is no collective: it waits
    for every rank's start-up at least 10 minutes (this timeout when longer). Both on gloo and NCCL; on
    other backends (Ascend's HCCL) the rendezvous uses this timeout and the groups after the default one
    keep the backend's own default."""


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
    exclude_op: Optional[list[str]] = None
    """Op names whose outputs MindFormers saves instead of recomputing inside recomputed modules (a
    selective-checkpoint policy: an op whose MindSpore primitive name contains an entry, case-
    insensitively, is kept). Validated (non-empty strings), then refused when non-empty: MindSpore's
    primitive names (``MatMul``, ``AllGather``) are not torch's op names, and saving the outputs of
    lit_moe's collectives inside a checkpoint is not implemented yet."""


@dataclass
class RecomputeCommConfig:
    enable: bool = False
    """Recompute the outputs of matched communication steps in backward instead of keeping them."""
    select_module: Optional[dict[str, list[LayerSpec]]] = None
    """``{regex: layer specs}`` naming communication steps, e.g. ``'mlp.router.all_gather': [0-3]``."""


@dataclass
class SwapConfig:
    enable: bool = False
    """Swap activations to host memory (MindFormers ``swap``): not implemented yet (true is an error)."""
    default_prefetch: int = 1
    """Layers prefetched ahead when swapping; in [1, layers - 1]."""
    layer_swap: Optional[Any] = None
    """Layers whose activations are swapped (``[{layers: [...]}]``)."""
    op_swap: Optional[Any] = None
    """Ops whose outputs are swapped (``[{op_name: regex, layers: [...]}]``)."""


# ----------------------------------------------------------------------------------------------
# train_dataset
# ----------------------------------------------------------------------------------------------
@dataclass
class TrainDatasetConfig:
    dataloader: dict[str, Any] = field(default_factory=dict)
    """The dataset: ``type: BlendedMegatronDatasetDataLoader``, ``datasets_type: GPTDataset``,
    ``sizes``, ``config`` (GPTDataset keys), ``column_names``, ``shuffle``, ``python_multiprocessing``.
    Extra keys are allowed. Or ``type: MindDataset`` with ``dataset_files`` (MindRecord files or
    directories), ``column_names``, ``shuffle``, ``python_multiprocessing`` (see "MindRecord data")."""
    drop_remainder: bool = True
    """Drop the last incomplete micro-batch."""
    num_parallel_workers: int = 8
    """DataLoader worker processes per rank (capped at the CPUs available)."""
    prefetch_size: int = 1
    """Batches prefetched per worker."""
    numa_enable: bool = False
    """Bind data workers to the NUMA node of the rank's device (best effort, Linux only)."""
    use_distribute_dataset: bool = False
    """Accepted, no effect (see "Keys accepted without effect")."""


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
    log_interval: int = 10
    """Print the step line and write scalars every N optimizer steps. Default 10 (MindFormers: 1): the
    step's numbers stay on the device and only log steps wait for them, so a smaller interval costs
    speed on an accelerator. Also the interval of the skip guard's warnings and of the MoE scalars."""
    queue_size: int = 1000
    """Events the TensorBoard writer holds before writing them out (``SummaryWriter(max_queue=...)``, as
    MindFormers' monitor passes it). A larger queue writes less often; a crash loses at most the
    queued events."""


@dataclass
class MoEMonitorConfig:
    save_tokens_per_expert_interval: Optional[int] = None
    """Log per-expert token counts and the expert-load heatmap every N steps (None: 50; MindFormers
    accepts the key without effect). The per-layer MoE scalars follow ``tensorboard.log_interval``."""
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
    """Record CPU activity next to the device's (MindFormers: CPU added to the NPU activities). On a
    machine without an accelerator the CPU is the only activity and is recorded either way."""
    profiler_level: int = 0
    """Accepted, no effect (see "Keys accepted without effect")."""
    mstx: bool = False
    """Accepted, no effect (see "Keys accepted without effect")."""


@dataclass
class AffinityConfig:
    enable: bool = False
    """Bind processes to CPUs."""
    affinity_cpu_list: Optional[dict[str, Any]] = None
    """``{"device0": ["0-7"], ...}`` or MindFormers' ``{"device0": {"affinity_cpu_list": [...],
    "module_to_cpu_dict": {...}}}``: CPUs for each local rank's main process and its data workers.
    MindFormers' own form, ``device_X`` keys directly under ``affinity_config`` (no ``enable``), means
    the same with ``enable: true``."""


@dataclass
class ContextConfig:
    mode: int = 1
    """Accepted, no effect (see "Keys accepted without effect")."""
    device_target: Optional[str] = None
    """Accelerator: ``cpu``, ``cuda``/``gpu``, ``npu``/``Ascend``; None picks the best available."""
    max_device_memory: Optional[str] = None
    """Accepted, no effect (see "Keys accepted without effect")."""
    affinity_config: AffinityConfig = field(default_factory=AffinityConfig)
    """CPU affinity of each rank's processes."""


# ----------------------------------------------------------------------------------------------
# keys accepted without effect: the one list (the README's table and the model section read it)
# ----------------------------------------------------------------------------------------------
NO_EFFECT_KEYS: dict[str, str] = {
    "checkpoint.save_global_layout_cache":
        "MindFormers caches the sharded-tensor layout between saves to save time; lit_moe writes the "
        "layout with every save and the files are the same either way",
    "checkpoint.reshard_worker_num":
        "threads of MindFormers' Hugging Face loader; lit_moe reads Hugging Face directories on the "
        "main thread (load_worker_number sets the reader threads of its own checkpoints)",
    "parallelism.pipeline_parallel_microbatch_size":
        "MindFormers overwrites it with the accumulation steps (global_batch_size // (data_parallel * "
        "local_batch_size)); the number of micro-batches comes from those keys here too",
    "parallelism.enable_mc2":
        "Ascend's fused matmul + communication kernels for tensor parallelism; the result is the same "
        "without them",
    "parallelism.enable_loss_parallel":
        "MindFormers keeps the head's logits vocabulary-sharded over tensor-parallel ranks and computes "
        "the cross-entropy on the shards; lit_moe's tensor-parallel head always does (no effect "
        "without tensor parallelism), and the loss is exact either way",
    "parallelism.npu_nums_per_device":
        "read only by moe_token_dispatcher_type alltoall_deredundancy (checked with MindFormers' rule, "
        "expert_parallel >= npu_nums_per_device): MindFormers de-duplicates tokens per node of that many "
        "ranks, lit_moe per destination rank, which sends each token only where it has experts",
    "parallelism.expert_parallel_async_d2h":
        "overlaps MindFormers' device-to-host copy of the per-expert token counts on a side stream; "
        "bit-identical results (MindFormers' words), timing only",
    # pipeline schedule options of MindFormers' (hyper_parallel's) schedules: same gradients, other timing
    "parallelism.pipeline_parallel_overlap_p2p":
        "MindFormers posts the stage sends/receives asynchronously and waits late; torch.distributed."
        "pipelining's schedules already post them as non-blocking operations; same results",
    "parallelism.pipeline_parallel_overlap_b_f":
        "MindFormers runs one micro-batch's backward next to another's forward to hide the expert "
        "all-to-alls (it forces it off without MoE layers); the gradients are the same; lit_moe's "
        "dualpipev schedule pairs forwards with backwards this way",
    "parallelism.pipeline_parallel_enable_dxdw_split":
        "MindFormers splits the overlapped backward (pipeline_parallel_overlap_b_f, forced off without "
        "it) into input- and weight-gradient parts; the gradients are the same; lit_moe's "
        "interleaved_zb, zbv and dualpipev schedules split them (choose one of those for the split)",
    "parallelism.pipeline_parallel_p2p_transport":
        "how MindFormers issues the stage sends/receives (plain or batched); torch's schedules batch "
        "them themselves; same results",
    "parallelism.expert_parallel_use_safe_tokens":
        "MindFormers prepends one zero-valued, zero-probability token per expert so that no expert "
        "gets zero rows (a kernel requirement); it changes no output or gradient, and lit_moe's expert "
        "kernels take empty experts",
    "train_dataset.use_distribute_dataset":
        "MindFormers reads a tensor/context-parallel group's batch on one rank and broadcasts it; "
        "lit_moe's ranks of such a group read the same samples themselves, so every rank gets the same "
        "batch either way",
    "profiler.profiler_level":
        "MindSpore profiler detail level; torch.profiler has no levels (with_stack, profile_memory and "
        "profile_cpu choose what is recorded)",
    "profiler.mstx":
        "MindSpore Tools Extension range markers (Ascend); the trace records lit_moe's steps itself",
    "context.mode":
        "MindSpore execution mode (1 = PyNative); lit_moe always runs eagerly, which is PyNative",
    "context.max_device_memory":
        "MindSpore's memory-pool cap; PyTorch's allocator has no such cap (lit_moe refuses a model "
        "whose parameters, gradients and optimizer state cannot fit before allocating it)",
    "use_remove_redundant_dataset":
        "top-level MindFormers key; its PyNative trainer falls back to normal iteration, as lit_moe does",
    "model.mla_qkv_concat":
        "a MindFormers weight layout (q/kv down-projections in one matrix); the projections are kept "
        "separate here, which computes the same function",
    "model.topk_method":
        "Hugging Face's name of the routing method; routing is defined by n_group, topk_group, "
        "scoring_func and moe_router_enable_expert_bias",
    "model.num_key_value_heads":
        "with multi-latent attention only (grouped-query attention uses it): MLA has no key/value head groups "
        "(Hugging Face's DeepSeek-V3 configs carry 128 whatever the head "
        "count; MindFormers passes it on as num_query_groups, unused by MLA)",
    "model.use_attn_mask_compression":
        "selects the compressed causal mask of Ascend's flash-attention kernel (sparse_mode 2: one 2048x2048 "
        "triangle stands for the causal mask of any length); the mask is the same plain causal one, which "
        "lit_moe's attention applies exactly either way (document masks are use_eod_attn_mask_compression's)",
    "model.moe_router_fusion":
        "Ascend's fused router kernel; same scores and routing",
    "model.moe_permute_fusion":
        "Ascend's fused token-permute kernel; same permutation",
    "model.transformers_version": "Hugging Face config.json bookkeeping",
    "model.torch_dtype": "Hugging Face config.json: the dtype the checkpoint was saved in (params_dtype "
                         "and compute_dtype set the training dtypes)",
    "model.dtype": "Hugging Face config.json (transformers v5 spelling of torch_dtype)",
    "model.auto_map": "Hugging Face config.json: remote-code class names",
    "model.use_cache": "Hugging Face: key/value cache for generation; training does not generate",
    "model.pretraining_tp": "Hugging Face config.json; no effect in DeepSeek-V3",
    "model.output_router_logits": "Hugging Face: return router logits from forward",
    "model.ep_size": "DeepSeek's original config.json; parallelism.expert_parallel sets expert parallelism",
    "model.qk_clip":
        "no MindFormers code reads a model.qk_clip (its QK-clip is optimizer.qk_clip_enabled, which lit_moe "
        "reads too)",
    "model.moe_router_pre_softmax":
        "MindFormers' PyNative router does not read it (only its config check does); lit_moe's router "
        "scores every expert before the top-k (pre-softmax) and renormalises the chosen ones with "
        "norm_topk_prob, which equals a softmax after the top-k",
    "model.seq_aux": "DeepSeek's original config.json: sequence-wise aux loss, set by "
                     "moe_router_load_balancing_type",
    "model._name_or_path": "Hugging Face config.json bookkeeping",
    "model.rope_interleave": "Hugging Face DeepSeek-V3: rotary pairs de-interleaved, which lit_moe always does",
    "model.lit_moe": "lit_moe's own bookkeeping in exported config.json files",
    "model.return_dict": "Hugging Face forward-output option",
    "model.output_hidden_states": "Hugging Face forward-output option",
    "model.output_attentions": "Hugging Face forward-output option",
    "model.use_return_dict": "Hugging Face forward-output option",
    "model.chunk_size_feed_forward": "Hugging Face PretrainedConfig attribute; unused by DeepSeek-V3",
    "model.id2label": "Hugging Face PretrainedConfig attribute (classification heads)",
    "model.label2id": "Hugging Face PretrainedConfig attribute (classification heads)",
    "model.is_encoder_decoder": "Hugging Face PretrainedConfig attribute; DeepSeek-V3 is decoder-only",
    "model.problem_type": "Hugging Face PretrainedConfig attribute (classification heads)",
}


def no_effect_notes(sections: dict[str, Any], top: Any = None) -> list[str]:
    """One line per key of :data:`NO_EFFECT_KEYS` set to a value other than its default: the key, the
    value and why it changes nothing. ``sections``: ``{"parallelism": ParallelismConfig, ...}``;
    ``top``: the whole config (its ``get`` reads the top-level keys, whose default is false).
    ``model.*`` keys are noted where the model section is read (:mod:`lit_moe.model.mindformers_defaults`)."""
    lines = []
    for key, why in NO_EFFECT_KEYS.items():
        section, _, name = key.partition(".")
        if section == "model":
            continue
        if not name:                                    # a top-level key
            value, default = (top.get(section, False) if top is not None else False), False
        else:
            obj = sections.get(section)
            if obj is None or not dataclasses.is_dataclass(obj):
                continue
            value = getattr(obj, name)
            default = next(f.default for f in dataclasses.fields(obj) if f.name == name)
        if value is not None and value != default:
            lines.append(f"{key}: {value!r} has no effect in lit_moe: {why}")
    return lines



def loss_and_embedding_keys_without_effect() -> dict[str, str]:
    """MindFormers' newest ``model`` keys of the loss and the embedding that lit_moe accepts without
    effect (issue 31), with why; each prints one line when a section sets it
    (:func:`note_loss_and_embedding_key`)."""
    return {
        "model.chunk_loss_num":
            "MindFormers splits the cross-entropy over the sequence into that many chunks to hold fewer "
            "fp32 [tokens, vocab] buffers (same loss and gradients); lit_moe's output-layer loss is computed "
            "in cache-sized row blocks already (lit_moe/ops/cross_entropy.py: one [tokens, vocab] table in "
            "the compute dtype, no fp32 tables), so no chunk count lowers its peak further",
        "model.embedding_params_dtype":
            "MindFormers' storage dtype of the word-embedding table, float32 by default so that its gradient "
            "accumulates in fp32; lit_moe stores every parameter in params_dtype (float32, the optimizer's "
            "master weights), the embedding included, so float32 is what it does (its gradient is summed in "
            "fp32 on one process and in compute_dtype under FSDP); other values are refused",
    }


def note_loss_and_embedding_key(key: str, value: Any) -> None:
    """Check a value of :func:`loss_and_embedding_keys_without_effect`'s keys and say, in one line,
    that it has no effect."""
    import logging

    if key == "chunk_loss_num" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(f"model.chunk_loss_num: must be an integer >= 0, got {value!r}")
    if key == "embedding_params_dtype" and str(value).replace("torch.", "") not in ("float32", "fp32"):
        raise ConfigError(f"model.embedding_params_dtype: only float32 (MindFormers' default): parameters "
                          f"are stored in params_dtype float32 here, got {value!r}")
    logging.getLogger("lit_moe.config").info("model.%s: %r has no effect in lit_moe (%s)", key, value,
                                             loss_and_embedding_keys_without_effect()[f"model.{key}"])


NO_EFFECT_KEYS.update(loss_and_embedding_keys_without_effect())


def suggest(name: str, candidates: Any) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``candidates``, or an empty string."""
    import difflib

    close = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def not_yet(field: str, value: Any, what: str, remedy: str) -> ConfigError:
    """The one-line error of a key whose value needs something lit_moe does not implement yet."""
    return ConfigError(f"{field}: {value!r} needs {what}, which lit_moe does not implement yet; {remedy}")


def check_not_yet_sections(swap: "SwapConfig", recompute: RecomputeConfig, top: dict[str, Any]) -> None:
    """Keys whose non-default values need engines lit_moe does not have yet: one line each."""
    if not isinstance(swap.default_prefetch, int) or isinstance(swap.default_prefetch, bool) \
            or swap.default_prefetch < 1:
        raise ConfigError(f"swap.default_prefetch: must be an integer >= 1, got {swap.default_prefetch!r}")
    if swap.enable:
        raise not_yet("swap.enable", True, "activation swapping to host memory",
                      "set swap.enable: false, or use recompute to save activation memory")
    ops = recompute.exclude_op
    if ops is not None:
        if not isinstance(ops, (list, tuple)) or not all(isinstance(o, str) and o.strip() for o in ops):
            raise ConfigError(f"recompute.exclude_op: must be a list of non-empty op-name strings, got {ops!r}")
        if ops:
            raise not_yet("recompute.exclude_op", list(ops), "saving chosen ops' outputs inside recomputed "
                          "layers", "remove the key, or select modules with recompute.select_module")
    for key in ("lora_config", "eval_dataset"):   # their keys: lit_moe.lora.lora_settings, lit_moe.callbacks.evaluation
        value = top.get(key)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of keys or null, got {value!r}")
    flag = top.get("use_remove_redundant_dataset", False)
    if not isinstance(flag, bool):
        raise ConfigError(f"use_remove_redundant_dataset: expected true or false, got {flag!r}")


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


def build_section(cls: type, value: Any, where: str) -> Any:
    """``cls`` built from a YAML mapping: unknown keys are errors with a did-you-mean suggestion, nested
    dataclass fields are built the same way, null (a section whose keys are all commented out) means
    the defaults."""
    if value is None:
        return cls()
    if dataclasses.is_dataclass(value):
        return value
    if hasattr(value, "__dict__") and not isinstance(value, dict):
        # a section LightningCLI already parsed (a jsonargparse Namespace): its public keys
        value = {k: v for k, v in vars(value).items() if not k.startswith("_")}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {value!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, item in value.items():
        if key not in fields:
            raise ConfigError(f"{where}.{key}: unknown key{suggest(str(key), fields)}; known keys: "
                              + ", ".join(fields))
        f = fields[key]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]
        if dataclasses.is_dataclass(default):
            item = build_section(type(default), item, f"{where}.{key}")
        kwargs[key] = item
    return cls(**kwargs)


def section_defaults(cls: type, value: Any) -> dict:
    """A section as plain data with every default filled in (what ``--print_config`` prints)."""
    return to_dict(build_section(cls, value, cls.__name__))


# ----------------------------------------------------------------------------------------------
# the top level of a pynative.yaml
# ----------------------------------------------------------------------------------------------
# Sections with fixed keys (unknown keys are errors) and their dataclasses, in print order.
FIXED_SECTIONS: dict[str, type] = {
    "checkpoint": CheckpointConfig,
    "training": TrainingConfig,
    "parallelism": ParallelismConfig,
    "recompute": RecomputeConfig,
    "recompute_comm": RecomputeCommConfig,
    "swap": SwapConfig,
    "train_dataset": TrainDatasetConfig,
    "monitor": MonitorConfig,
    "profiler": ProfilerConfig,
    "context": ContextConfig,
}
# Sections that accept extra keys (MindFormers ``allow_extra``): kept as dicts, validated by consumers.
OPEN_SECTIONS = ("model", "optimizer", "lr_scheduler")
# Other top-level keys: the Trainer escape hatch, user callbacks, graph mode's accumulation option,
# and MindFormers' optional sections (``check_not_yet_sections``).
OTHER_TOP_LEVEL = ("trainer", "callbacks", "gradient_accumulation_steps", "lora_config", "eval_dataset",
                   "use_remove_redundant_dataset")
TOP_LEVEL_KEYS = (*FIXED_SECTIONS, *OPEN_SECTIONS, *OTHER_TOP_LEVEL)
GRAPH_MODEL_BLOCK = ("model.model_config: a graph-mode (graph.yaml) model block; PyNative puts the model keys "
                     "directly under model:. Convert the file with `lit_moe convert-config graph.yaml -o "
                     "pynative.yaml`")
# Keys of MindFormers' graph-mode YAML (graph.yaml) that never appear in a pynative.yaml.
GRAPH_MODE_KEYS = frozenset({"run_mode", "use_parallel", "runner_config", "parallel_config", "parallel",
                             "runner_wrapper", "moe_config", "recompute_config", "output_dir", "trainer_config",
                             "micro_batch_interleave_num", "load_checkpoint", "src_strategy_path_or_dir",
                             "auto_trans_ckpt", "only_save_strategy", "resume_training", "use_legacy"})


def _affinity_mindformers_form(cfg: dict) -> None:
    """``context.affinity_config: {device_0: {...}, ...}`` (MindFormers' form, binding on when devices are
    listed) rewritten in place as ``{enable: true, affinity_cpu_list: {device_0: {...}, ...}}``."""
    import re

    context = cfg.get("context")
    affinity = context.get("affinity_config") if isinstance(context, dict) else None
    if not isinstance(affinity, dict):
        return
    devices = {k: v for k, v in affinity.items() if re.fullmatch(r"device_?\d+", str(k))}
    if not devices:
        return
    if affinity.get("affinity_cpu_list") is not None:
        raise ConfigError(f"context.affinity_config.{next(iter(devices))}: give the devices either directly under "
                          "affinity_config (MindFormers' form) or under affinity_cpu_list, not both")
    rest = {k: v for k, v in affinity.items() if k not in devices}
    context["affinity_config"] = {"enable": True, **rest, "affinity_cpu_list": devices}


def check_top_level(cfg: dict) -> None:
    """Unknown or misplaced keys of a whole configuration, each a one-line error (MindFormers' form of
    ``context.affinity_config`` is rewritten as the typed section's first)."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"the configuration must be a mapping of sections, got {type(cfg).__name__}")
    _affinity_mindformers_form(cfg)
    model = cfg.get("model")
    if isinstance(model, dict) and "model_config" in model:
        raise ConfigError(GRAPH_MODEL_BLOCK)
    if cfg.get("run_mode") == "predict":   # MindFormers' inference run: a subcommand of its own here
        raise ConfigError("run_mode: 'predict': generation is `lit_moe predict --config FILE --prompt TEXT` (weights from "
                          "checkpoint.load_path or --checkpoint); `lit_moe fit` trains")
    graph = sorted(k for k in cfg if k in GRAPH_MODE_KEYS)
    if graph:
        raise ConfigError(f"{graph[0]}: a graph-mode (graph.yaml) key, not a pynative.yaml section; convert the "
                          "file with `lit_moe convert-config graph.yaml -o pynative.yaml`")
    if "seed_everything" in cfg:
        raise ConfigError("seed_everything: Lightning's seed key; lit_moe seeds everything from training.seed. "
                          "Remove it (an older --print_config output also carries trainer.max_steps: -1, which "
                          "would override training.steps: remove that too)")
    for key in cfg:
        if key not in TOP_LEVEL_KEYS:
            raise ConfigError(f"{key}: unknown top-level key{suggest(str(key), TOP_LEVEL_KEYS)}; sections are "
                              + ", ".join(TOP_LEVEL_KEYS))
    for name, cls in FIXED_SECTIONS.items():
        build_section(cls, cfg.get(name), name)
    for name in OPEN_SECTIONS:
        if cfg.get(name) is not None and not isinstance(cfg[name], dict):
            raise ConfigError(f"{name}: expected a mapping of keys, got {cfg[name]!r}")
