"""``lit_moe plan --config X --world-size N``: check a parallel layout before asking for N devices.

Nothing runs on a device and no weights are allocated: the meshes are built on a fake process
group (``torch.testing._internal.distributed.fake_pg``) and the model is parallelized on the meta
device exactly as a real run of rank 0 would do it, so the printed per-rank bytes come from the
local shards the run would hold. Prints the meshes, the data-parallel degree and accumulation
steps, total and active parameters, per-rank bytes of parameters, gradients and optimizer state,
and the training FLOPs per token; for pipelines, per stage the parameter bytes, the bubble fraction
and the activations each rank keeps for backward at its schedule's peak.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lit_moe.config import (ConfigError, ParallelismConfig, RecomputeCommConfig, RecomputeConfig, TrainingConfig,
                            build_section)
from lit_moe.strategies.memory_plan import state_bytes
from lit_moe.strategies.parallel_dims import SHARD_STRATEGIES, is_zero1
from lit_moe.strategies.run_shape import RunShape

GiB = 1024 ** 3


def _section(data: dict, name: str, cls: Optional[type] = None) -> Any:
    value = data.get(name)
    if cls is not None:
        return build_section(cls, value, name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: expected a mapping, got {type(value).__name__}")
    return dict(value)


def _seq_length(data: dict, model_config: Any) -> int:
    ds = data.get("train_dataset") or {}
    seq = ((ds.get("dataloader") or {}).get("config") or {}).get("seq_length")
    return int(seq if seq is not None else model_config.seq_length)


def _fmt_bytes(n: float) -> str:
    return f"{n / GiB:.3f} GiB" if n >= GiB / 100 else f"{n / 1024 ** 2:.3f} MiB"


def _fmt_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3f}{unit}"
    return str(int(n))


def _init_fake_world(world_size: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def local_bytes(model: torch.nn.Module, optimizer_section: Optional[dict] = None,
                names: Optional[set[str]] = None) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients (sharded, fp32), optimizer state, the
    unsharded gradients kept during accumulation without per-micro-batch sync, and the gathered
    compute-dtype parameters of the FSDP-sharded ones (ZeRO-1 keeps them). ``names``: only these
    parameters (a pipeline rank's stages)."""
    from torch.distributed.tensor import DTensor

    from lit_moe.optim.optimizers import optimizer_state_bytes, validate_optimizer_section

    settings = validate_optimizer_section(optimizer_section or {"type": "AdamW"})
    out = {"params": 0, "grads": 0, "optimizer": 0, "unsharded_grads": 0, "gathered_params": 0, "params_numel": 0}
    fsdp_sizes = _fsdp_shard_sizes(model)
    config = getattr(model, "config", None)
    compute = torch.empty((), dtype=config.torch_dtype("compute_dtype")).element_size() if config else 4
    for name, p in model.named_parameters():
        if names is not None and name not in names:
            continue
        local = p._local_tensor if isinstance(p, DTensor) else p
        n = local.numel()
        out["params_numel"] += n
        out["params"] += n * p.element_size()
        out["grads"] += n * 4
        out["optimizer"] += n * optimizer_state_bytes(name, p, settings)
        out["unsharded_grads"] += n * 4 * fsdp_sizes.get(name, 1)
        if fsdp_sizes.get(name, 1) > 1:   # the compute-dtype copy FSDP gathers (held all step under ZeRO-1)
            out["gathered_params"] += n * compute * fsdp_sizes[name]
    return out


def _fsdp_shard_sizes(model: torch.nn.Module) -> dict[str, int]:
    """How many ways FSDP splits each parameter (to undo it for the unsharded-gradient estimate)."""
    from torch.distributed.tensor import DTensor
    from lit_moe.strategies.clip import _SHARDS

    sizes = {}
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        k = 1
        for dim, placement in enumerate(p.placements):
            names = p.device_mesh.mesh_dim_names or ()
            dim_name = names[dim] if dim < len(names) else ""
            if isinstance(placement, _SHARDS) and dim_name in ("fsdp", "efsdp", "dp_replicate"):
                k *= p.device_mesh.size(dim)
        sizes[name] = k
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lit_moe plan",
        description="Validate a parallel layout and print meshes, batch split, parameter counts, per-rank "
                    "memory and FLOPs, without starting workers or allocating the model.")
    parser.add_argument("--config", "-c", required=True, action="append",
                        help="pynative.yaml (repeatable: later files merge into earlier ones)")
    parser.add_argument("--world-size", "-n", type=int, required=True, help="number of processes (devices)")
    parser.add_argument("--device-memory", default=None,
                        help="memory of one device (80GiB, 80GB, or a name: H100, H800, H200, A100, 910B): "
                             "prints whether the most loaded rank fits, and what would make it fit")
    parser.epilog = ("Any --SECTION.KEY VALUE changes one key of the configuration, as with lit_moe fit "
                     "(e.g. --parallelism.expert_parallel 8).")
    return parser


def check_layout(parallelism: ParallelismConfig, training: TrainingConfig, model_config: Any, seq_length: int,
                 world_size: int, recompute: Any = None, recompute_comm: Any = None,
                 global_batch_of: Optional[Callable[[int], int]] = None) -> RunShape:
    """The :class:`RunShape` of a run (its ParallelDims, accumulation steps, samples per step, ramp-up,
    pipeline layout, recompute plan and MoE dispatcher), after every check of the layout against the
    model and the batch: the one validation and the one resolution ``lit_moe fit`` and ``lit_moe plan``
    share, so that plan refuses what fit refuses and both read the same numbers.
    ``global_batch_of``: ``training.global_batch_size`` as a function of the data-parallel degree
    (graph mode's ``gradient_accumulation_steps``: A x data_parallel x local_batch_size)."""
    from lit_moe.strategies.expert_parallel import resolve_dispatcher
    from lit_moe.strategies.parallel_dims import ParallelDims, check_parallel_layout, check_parallelism_keys
    from lit_moe.strategies.recompute import validate_recompute
    from lit_moe.optim.schedules import RAMPUP_KEY, batch_ramp
    from lit_moe.pipeline import check_pipeline_run
    from lit_moe.strategies.strategy import check_parallelism_section

    check_parallelism_keys(parallelism)
    check_parallelism_section(parallelism)
    dims = ParallelDims.from_config(parallelism, world_size)
    if global_batch_of is not None:
        training.global_batch_size = global_batch_of(dims.dp)
    dims.validate_model(model_config, seq_length)
    check_parallel_layout(parallelism, dims, model_config)
    accumulation = dims.accumulation_steps(training.global_batch_size, training.local_batch_size)
    ramp = batch_ramp(training, dims.dp)
    layout = None
    if dims.pp > 1:
        layout = check_pipeline_run(parallelism, model_config, accumulation, training.global_batch_size,
                                    stage_ranks=dims.world_size // dims.pp)
        if ramp is not None:   # every level of the ramp runs the schedule with its own micro-batch count
            for level in ramp.levels()[:-1]:
                layout.check_microbatches(level // ramp.samples_per_micro_batch, level, field=RAMPUP_KEY)
    dispatcher = resolve_dispatcher(parallelism.moe_token_dispatcher_type,
                                    getattr(model_config, "moe_token_dispatcher_type", None))
    recompute_plan = (None if recompute is None and recompute_comm is None
                      else validate_recompute(recompute, recompute_comm, model_config.total_layers))
    return RunShape(dims, training.global_batch_size, training.local_batch_size, accumulation, seq_length, ramp,
                    pipeline=layout, recompute=recompute_plan, dispatcher=dispatcher)


def plan(config_path: Any, world_size: int, out=None, overrides: Optional[list[tuple[str, str]]] = None,
         device_memory: Optional[str] = None) -> dict[str, Any]:
    """Validate and describe the layout; returns the numbers it printed (for tests). ``config_path``
    is one path or a list (merged in order); ``overrides`` are ``(dotted key, YAML value)`` pairs;
    ``device_memory`` (``80GiB`` or a device name) adds the fits / does-not-fit line."""
    from lit_moe.config import check_top_level
    from lit_moe.config_file import resolve

    out = sys.stdout if out is None else out

    from lit_moe.runtime.device_speed import available_accelerator, print_note, resolve_model_section
    from lit_moe.model import DeepseekV3Config
    from lit_moe.model.mindformers_defaults import read_pynative_model_section

    paths = [config_path] if isinstance(config_path, str) else list(config_path)
    data = resolve(paths, overrides or [])
    check_top_level(data)
    config_path = ", ".join(paths)

    parallelism = _section(data, "parallelism", ParallelismConfig)
    training = _section(data, "training", TrainingConfig)
    recompute = _section(data, "recompute", RecomputeConfig)
    recompute_comm = _section(data, "recompute_comm", RecomputeCommConfig)
    optimizer_section = _section(data, "optimizer") or {"type": "AdamW"}
    model_section = _section(data, "model")
    if not model_section:
        raise ConfigError("model: the section is missing or empty")
    # compute_dtype auto: what a run on this machine would use
    model_section, dtype_note = resolve_model_section(read_pynative_model_section(model_section),
                                                      available_accelerator())
    model_config = DeepseekV3Config(**model_section)
    seq_length = _seq_length(data, model_config)

    shape = check_layout(parallelism, training, model_config, seq_length, world_size, recompute, recompute_comm)
    dims, accumulation = shape.dims, shape.accumulation

    from lit_moe.model import sizing

    counts = sizing.param_counts(model_config)
    flops = sizing.flops_per_token(model_config, seq_length)

    mem = per_rank_bytes(model_config, dims, parallelism, recompute, recompute_comm, optimizer_section, shape)

    total = _count(counts, "total")
    active = _count(counts, "active")
    print_note(dtype_note)
    p = print
    p(f"lit_moe plan: {config_path} on {world_size} ranks", file=out)
    p("layout", file=out)
    for line in dims.describe():
        p(f"  {line}", file=out)
    if dims.ep > 1:
        seed_dp = world_size // (dims.tp * dims.ep) if world_size % (dims.tp * dims.ep) == 0 else None
        p(f"  note: expert_parallel {dims.ep} is not a separate factor of the world size: it is carved out of "
          f"the dp_shard * cp * tp = {dims.dp_shard * dims.cp * dims.tp} ranks, and data_parallel stays {dims.dp}",
          file=out)
        if seed_dp is not None:
            p(f"        (the 8-card table of MindFormers' PyNative configuration guide, world = tp x ep x dp, would call this layout data_parallel "
              f"{seed_dp}; lit_moe follows MindFormers' code: data_parallel = world_size / (tp * pp * cp) = "
              f"{dims.dp})", file=out)
    p(f"  sharding strategy {parallelism.data_parallel_shard_strategy} "
      f"({SHARD_STRATEGIES[parallelism.data_parallel_shard_strategy]})", file=out)
    p("batch", file=out)
    per_micro = shape.samples_per_micro_batch
    p(f"  local_batch_size {training.local_batch_size} x data_parallel {dims.dp} = {per_micro} samples per "
      f"micro-batch; global_batch_size {shape.global_batch_size}", file=out)
    p(f"  accumulation steps {accumulation} (= {shape.global_batch_size} // {per_micro})"
      + (f"; {shape.dropped} samples of each global batch dropped" if shape.dropped else ""), file=out)
    if shape.ramp is not None:
        p(f"  {shape.ramp.describe()}", file=out)
        for first, gbs, before in shape.ramp.stretches(training.steps):
            p(f"    from step {first + 1} (after {before:,} samples): global batch {gbs}, accumulation "
              f"{gbs // per_micro}", file=out)
    p(f"  sequence length {seq_length}: {seq_length // dims.cp} tokens per context-parallel rank, "
      f"{seq_length // (dims.cp * dims.tp)} per tensor-parallel rank between layers", file=out)
    p("model", file=out)
    p(f"  parameters: total {_fmt_count(total)} ({total:,}), active per token {_fmt_count(active)} ({active:,})",
      file=out)
    mtp = _count(counts, "mtp")
    if mtp:
        p(f"  with the MTP layers: {_fmt_count(total + mtp)} ({mtp:,} in {model_config.num_nextn_predict_layers} "
          "MTP depth(s); the per-rank bytes below include them)", file=out)
    p(f"  training FLOPs per token: {_fmt_count(flops)} (forward + backward, at sequence length {seq_length})",
      file=out)
    p("per-rank memory (rank 0, from its local shards"
      + ("; of every pipeline stage: a pipeline rank holds its stages' part, in the peak table below)"
         if dims.pp > 1 else ")"), file=out)
    p(f"  parameters ({model_config.params_dtype}): {_fmt_bytes(mem['params'])} "
      f"({mem['params_numel']:,} values; {mem['params_numel'] / max(total, 1):.4%} of the model)", file=out)
    p(f"  gradients (fp32, sharded): {_fmt_bytes(mem['grads'])}", file=out)
    if is_zero1(parallelism):
        p(f"  ZeRO-1 (data_parallel_shard_strategy: optim) holds through the step the gathered parameters "
          f"({model_config.compute_dtype}): {_fmt_bytes(mem['gathered_params'])} and the whole gradients (fp32): "
          f"{_fmt_bytes(mem['unsharded_grads'])}", file=out)
    elif not parallelism.gradient_sync_every_microbatch:
        p(f"  gradients kept unsharded between micro-batches (gradient_sync_every_microbatch: false): "
          f"{_fmt_bytes(mem['unsharded_grads'])}", file=out)
    p(f"  optimizer state ({_optimizer_label(optimizer_section)}): {_fmt_bytes(mem['optimizer'])}", file=out)
    p(f"  total (without activations{', all stages' if dims.pp > 1 else ''}): "
      f"{_fmt_bytes(state_bytes(mem, parallelism))}", file=out)
    if dims.pp > 1:
        from lit_moe.pipeline import plan_stages

        layout = shape.pipeline
        p("pipeline (the memory above is of the whole model; each pipeline rank holds its stages' part)", file=out)
        for line in plan_stages(layout, mem["params_by_name"], model_config.num_hidden_layers,
                                model_config.num_nextn_predict_layers > 0, accumulation):
            p(f"  {line}", file=out)
        activations = pipeline_activations(model_config, layout, dims, accumulation, training.local_batch_size,
                                           seq_length, recompute, recompute_comm)
        p(f"  activations saved for backward at the schedule's peak ({layout.schedule}, {accumulation} micro-batches "
          f"of {training.local_batch_size} x {seq_length} tokens; fused attention kernel"
          + (", recomputed layers keep their input" if any(activations["recompute_layers"]) else "")
          + ("; with the output gradients the split backward keeps until each weight-gradient step"
             if any(row["weight_grad_per_microbatch"] for row in activations["ranks"]) else "") + "):",
          file=out)
        for r, row in enumerate(activations["ranks"]):
            p(f"    pipeline rank {r}: {_fmt_bytes(row['bytes'])} ({row['chunks']} stage chunks in flight x "
              f"{_fmt_bytes(row['per_microbatch'] / max(len(layout.stages_of(r)), 1))} per chunk on average)", file=out)
        mem["activations_by_rank"] = [row["bytes"] for row in activations["ranks"]]
    from lit_moe.strategies.memory_plan import print_peaks

    peaks = print_peaks(out, model_config, dims, parallelism, recompute, recompute_comm, optimizer_section,
                        accumulation, training.local_batch_size, seq_length, mem, device_memory)
    return {"dims": dims, "accumulation": accumulation, "total": total, "active": active, "flops": flops,
            "memory": mem, "total_with_mtp": total + mtp, "model_config": model_config, "parallelism": parallelism,
            "seq_length": seq_length, "local_batch_size": training.local_batch_size, **peaks}


def _optimizer_label(optimizer_section: dict) -> str:
    from lit_moe.optim.optimizers import validate_optimizer_section

    settings = validate_optimizer_section(optimizer_section)
    if settings.type != "AdamW":
        return f"{settings.type}, fp32"
    short = {"float32": "fp32", "bfloat16": "bf16"}
    first, second = short[settings.exp_avg_dtype], short[settings.exp_avg_sq_dtype]
    if first == second:
        return "AdamW, fp32" if first == "fp32" else f"AdamW, {first} moments"
    return f"AdamW, exp_avg {first}, exp_avg_sq {second}"


def pipeline_activations(model_config: Any, layout: Any, dims: Any, accumulation: int, local_batch_size: int,
                         seq_length: int, recompute: Any = None, recompute_comm: Any = None,
                         core_attention: str = "fused") -> dict[str, Any]:
    """Per pipeline rank, the bytes autograd keeps for backward at the schedule's peak
    (:mod:`lit_moe.strategies.activation_memory`): one micro-batch of ``local_batch_size`` sequences,
    ``seq_length / cp`` tokens each, ``heads / tp`` attention heads and the sequence split of tensor
    parallel on a rank. Fully recomputed layers keep only their input, selectively recomputed modules
    their inputs (:func:`lit_moe.strategies.memory_plan.configured_selection`)."""
    from lit_moe.strategies.activation_memory import not_estimated, pipeline_activation_plan
    from lit_moe.strategies.memory_plan import activation_kwargs, configured_full_layers, configured_selection

    full = configured_full_layers(model_config, recompute, recompute_comm)
    if not_estimated(model_config, layout.schedule):    # the peak table says why (memory_plan.print_peaks)
        zero = {"bytes": 0, "chunks": 0, "per_microbatch": 0, "weight_grad_per_microbatch": 0}
        return {"ranks": [dict(zero) for _ in range(layout.pp)], "recompute_layers": full}
    selection = configured_selection(model_config, dims, recompute, recompute_comm)
    rows = pipeline_activation_plan(model_config, layout, accumulation, local_batch_size, seq_length // dims.cp,
                                    recompute_layers=full, selection=selection,
                                    **activation_kwargs(model_config, dims, core_attention))
    return {"ranks": rows, "recompute_layers": full}


def per_rank_bytes(model_config: Any, dims: Any, parallelism: ParallelismConfig, recompute: Any = None,
                   recompute_comm: Any = None, optimizer_section: Optional[dict] = None,
                   run: Optional[RunShape] = None) -> dict[str, int]:
    """:func:`local_bytes` of rank 0 of the run: the model is built on the meta device and, with more
    than one rank, parallelized on a fake process group exactly as the run would do it. With
    pipeline stages, ``pipeline_ranks`` holds :func:`local_bytes` of each pipeline rank's stages
    (the numbers above are of the whole model's layers under this layout). ``run``: the run's
    resolved :class:`RunShape` (its ``dims``; its recompute plan and pipeline layout apply)."""
    from lit_moe.model import DeepseekV3ForCausalLM
    from lit_moe.strategies.parallelize import parallelize

    if dims.world_size == 1:
        with torch.device("meta"):
            model = DeepseekV3ForCausalLM(model_config)
        return local_bytes(model, optimizer_section)
    _init_fake_world(dims.world_size)
    try:
        dims.build_meshes("cpu")
        with torch.device("meta"):
            model = DeepseekV3ForCausalLM(model_config)
        model = parallelize(model, dims, parallelism, recompute=recompute, recompute_comm=recompute_comm,
                            model_config=model_config, reduce_in_fp32=True, force_fsdp=True, run=run)
        out = {**local_bytes(model, optimizer_section), "params_by_name": _param_bytes_by_name(model),
               "fsdp_buffers": _fsdp_buffer_bytes(model, model_config, is_zero1(parallelism))}
        if dims.pp > 1:
            from lit_moe.pipeline import PipelineLayout, parameters_of_ranks

            layout = run.pipeline if run is not None else PipelineLayout.from_config(parallelism,
                                                                                     model_config.num_hidden_layers)
            held = parameters_of_ranks(layout, out["params_by_name"], model_config.num_hidden_layers,
                                       model_config.num_nextn_predict_layers > 0)
            out["pipeline_ranks"] = [local_bytes(model, optimizer_section, names) for names in held]
        return out
    finally:
        dist.destroy_process_group()
        dims.meshes = {}


def _fsdp_buffer_bytes(model: torch.nn.Module, model_config: Any, zero1: bool = False) -> int:
    """FSDP's transient bytes at a layer boundary: two decoder layers gathered in the compute dtype (the
    running one and the prefetched next) and one layer's unsharded fp32 gradients before the
    reduce-scatter, of the largest layer (``lit_moe plan``'s peak). ZeRO-1 gathers nothing then (the
    parameters stay gathered, counted as parameters): one layer's compute-dtype gradient before it is
    added to the fp32 sum, and its fp32 reduce-scatter input at the step's last backward."""
    from torch.distributed.tensor import DTensor

    compute = torch.empty((), dtype=model_config.torch_dtype("compute_dtype")).element_size()
    sizes = _fsdp_shard_sizes(model)
    per_layer: dict[str, int] = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        if parts[0] in ("layers", "mtp") and len(parts) > 1 and sizes.get(name, 1) > 1:
            local = p._local_tensor if isinstance(p, DTensor) else p
            key = ".".join(parts[:2])
            per_layer[key] = per_layer.get(key, 0) + local.numel() * sizes[name]
    largest = max(per_layer.values(), default=0)
    return largest * ((compute + 4) if zero1 else (2 * compute + 4))


def _param_bytes_by_name(model: torch.nn.Module) -> dict[str, int]:
    """Local shard bytes of each parameter (per-stage sums of a pipeline plan)."""
    from torch.distributed.tensor import DTensor

    return {n: (p._local_tensor if isinstance(p, DTensor) else p).numel() * p.element_size()
            for n, p in model.named_parameters()}


def device_memory(accelerator: str, local_processes: int) -> tuple[int, str]:
    """``(bytes, description)`` one rank can use: the accelerator's total memory (``torch.cuda``,
    ``torch.npu``, ...), or on the CPU the available RAM shared by the processes of this machine."""
    import os

    from lit_moe.strategies.accelerators import device_module

    try:
        mod = device_module(accelerator)
    except RuntimeError:  # not a torch device type ("auto", a Lightning alias)
        mod = None
    if mod is not None and mod.is_available() and hasattr(mod, "get_device_properties"):
        index = int(os.environ.get("LOCAL_RANK", 0)) % max(mod.device_count(), 1)
        return int(mod.get_device_properties(index).total_memory), f"{accelerator}:{index} memory"
    available = _available_ram()
    share = available // max(local_processes, 1)
    what = "available RAM" + (f" / {local_processes} processes" if local_processes > 1 else "")
    return share, what


def _available_ram() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil comes with lightning
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return 1 << 62  # pragma: no cover - unknown: do not refuse


def most_loaded_rank(model_config: Any, dims: Any, parallelism: ParallelismConfig, recompute: Any = None,
                     recompute_comm: Any = None, optimizer_section: Optional[dict] = None,
                     run: Optional[RunShape] = None) -> tuple[int, str]:
    """``(bytes, which rank)``: the parameters, gradients and optimizer state (:func:`state_bytes`) of
    the rank that holds the most, from the exact local shards :func:`per_rank_bytes` computes for
    ``lit_moe plan``. Rank 0 holds the most of every sharded dimension (an uneven split gives the
    first ranks the larger pieces); with pipeline stages, the pipeline rank whose stages hold the most."""
    mem = per_rank_bytes(model_config, dims, parallelism, recompute, recompute_comm, optimizer_section, run)
    if "pipeline_ranks" not in mem:
        return state_bytes(mem, parallelism), "rank 0"
    per_stage = [state_bytes(m, parallelism) for m in mem["pipeline_ranks"]]
    r = max(range(len(per_stage)), key=per_stage.__getitem__)
    return per_stage[r], f"pipeline rank {r}"


def _in_forked_child(fn: Any, args: tuple, timeout_s: float = 900.0) -> Any:
    """``fn(*args)`` in a forked child process (nothing it does reaches this process's state); its
    exception is raised here. None when this platform cannot fork, a process group already exists
    here (the child would share it), or the child gives no answer within ``timeout_s``."""
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods() or (dist.is_available() and dist.is_initialized()):
        return None
    import gc

    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    # Objects left for the cycle collector (a destroyed process group's gloo backend) are freed here,
    # where their threads exist: freed in the child, whose fork copied no threads, they wait forever.
    gc.collect()

    def child() -> None:
        gc.disable()   # the child lives for one computation: nothing inherited is freed there
        try:
            send.send(("ok", fn(*args)))
        except BaseException as err:  # handed to the parent, which raises it
            send.send(("error", err))

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    send.close()
    try:
        if not receive.poll(timeout_s):
            return None
        kind, value = receive.recv()
    except EOFError:  # the child died without an answer
        return None
    finally:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if kind == "error":
        raise value
    return value


def check_fits(model_config: Any, run: RunShape, parallelism: ParallelismConfig, optimizer_section: Optional[dict],
               accelerator: str, local_processes: int, memory: Optional[tuple[int, str]] = None) -> None:
    """Refuse, before anything is allocated, a run whose parameters, gradients and optimizer state
    exceed the memory of one rank's device, in one line with both numbers (``run``: the run's
    :class:`RunShape`, whose layout and recompute plan apply). The bytes are those of
    the most loaded rank (:func:`most_loaded_rank`: the exact local shards ``lit_moe plan`` computes,
    model on the meta device, several ranks on a fake process group), the same on every rank, so
    that all ranks refuse together (none is left waiting for the others). Activations are not
    counted. ``memory``: ``(bytes, description)`` instead of :func:`device_memory`.

    Several ranks need a fake process group, which must not touch the process that trains: torch
    keeps DTensor sharding results in process-wide caches that compare meshes without their rank,
    so a real mesh built afterwards would be handed the fake rank-0 mesh (every rank would then
    hold, and save, rank 0's offsets). The several-rank computation therefore runs in a forked
    child process. Where fork is missing, or a process group is already initialised in this
    process, the check falls back to the whole model's bytes divided by the ranks, a lower bound
    of the most loaded rank's share."""
    from lit_moe.strategies.parallel_dims import ParallelDims

    dims = run.dims   # the fake meshes of several ranks are built on it in the forked child only
    args = (model_config, dims, parallelism, None, None, optimizer_section, run)
    exact = True
    if dims.world_size == 1:
        need, who = most_loaded_rank(*args)
    else:
        answer = _in_forked_child(most_loaded_rank, args)
        if answer is not None:
            need, who = answer
        else:
            whole = per_rank_bytes(model_config, ParallelDims(world_size=1), parallelism,
                                   optimizer_section=optimizer_section)
            need, who, exact = state_bytes(whole, parallelism) // dims.world_size, "each rank", False
    have, what = memory if memory is not None else device_memory(accelerator, local_processes)
    if need > have:
        needs = ("needs" if exact else "needs at least")
        raise ConfigError(
            f"model: does not fit: {who} of {dims.world_size} {needs} {_fmt_bytes(need)} for parameters, "
            f"gradients and optimizer state (as lit_moe plan computes it), but has {_fmt_bytes(have)} ({what}); "
            "use more ranks (parallelism.data_parallel_shard / expert_parallel / tensor_parallel / "
            "pipeline_parallel), a smaller model, or for activations recompute and a smaller "
            "training.local_batch_size")


def _count(counts: Any, key: str) -> int:
    if isinstance(counts, dict):
        return int(counts[key])
    return int(getattr(counts, key))


def main(argv: list[str]) -> int:
    from lit_moe.config import TOP_LEVEL_KEYS
    from lit_moe.config_file import split_argv

    args, rest = build_parser().parse_known_args(argv)
    try:
        _, overrides, unknown = split_argv(rest, TOP_LEVEL_KEYS)
        if unknown:
            raise ConfigError(f"unexpected argument {unknown[0]!r}")
        if args.device_memory is not None:
            from lit_moe.strategies.memory_plan import parse_device_memory

            parse_device_memory(args.device_memory)   # a bad value is refused before the model is built
        plan(args.config, args.world_size, overrides=overrides, device_memory=args.device_memory)
    except (ConfigError, ValueError) as err:
        from lit_moe.tools.errors import one_line

        print(f"lit_moe plan: error: {one_line(err)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
