"""``lit_moe plan --config X --world-size N``: check a parallel layout before asking for N devices.

Nothing runs on a device and no weights are allocated: the meshes are built on a fake process
group (``torch.testing._internal.distributed.fake_pg``) and the model is parallelized on the meta
device exactly as a real run of rank 0 would do it, so the printed per-rank bytes come from the
local shards the run would hold. Prints the meshes, the data-parallel degree and accumulation
steps, total and active parameters, per-rank bytes of parameters, gradients and optimizer state,
and the training FLOPs per token.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist

from lit_moe.config import ConfigError, load_yaml, ParallelismConfig, RecomputeCommConfig, RecomputeConfig, TrainingConfig

GiB = 1024 ** 3


def _section(data: dict, name: str, cls: Optional[type] = None) -> Any:
    value = data.get(name)
    if value is None:
        return cls() if cls is not None else {}
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: expected a mapping, got {type(value).__name__}")
    if cls is None:
        return dict(value)
    try:
        return cls(**value)
    except TypeError as err:
        known = ", ".join(f for f in cls.__dataclass_fields__)
        raise ConfigError(f"{name}: {err} (known keys: {known})") from None


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


def local_bytes(model: torch.nn.Module, optimizer_section: Optional[dict] = None) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients (sharded, fp32), optimizer state, and the
    unsharded gradients kept during accumulation without per-micro-batch sync."""
    from torch.distributed.tensor import DTensor

    from lit_moe.optim import uses_muon, validate_optimizer_section

    settings = validate_optimizer_section(optimizer_section or {"type": "AdamW"})
    is_muon = getattr(settings, "type", "AdamW") == "Muon"
    out = {"params": 0, "grads": 0, "optimizer": 0, "unsharded_grads": 0, "params_numel": 0}
    fsdp_sizes = _fsdp_shard_sizes(model)
    for name, p in model.named_parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        n = local.numel()
        out["params_numel"] += n
        out["params"] += n * p.element_size()
        out["grads"] += n * 4
        states = 1 if (is_muon and uses_muon(name, p, settings)) else 2
        out["optimizer"] += n * 4 * states
        out["unsharded_grads"] += n * 4 * fsdp_sizes.get(name, 1)
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
    parser.add_argument("--config", "-c", required=True, help="pynative.yaml")
    parser.add_argument("--world-size", "-n", type=int, required=True, help="number of processes (devices)")
    return parser


def plan(config_path: str, world_size: int, out=None) -> dict[str, Any]:
    """Validate and describe the layout; returns the numbers it printed (for tests)."""
    out = sys.stdout if out is None else out

    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM
    from lit_moe.strategies.parallel_dims import ParallelDims
    from lit_moe.strategies.parallelize import parallelize
    from lit_moe.strategies.strategy import check_parallelism_section

    data = load_yaml(config_path)

    parallelism = _section(data, "parallelism", ParallelismConfig)
    training = _section(data, "training", TrainingConfig)
    recompute = _section(data, "recompute", RecomputeConfig)
    recompute_comm = _section(data, "recompute_comm", RecomputeCommConfig)
    optimizer_section = _section(data, "optimizer") or {"type": "AdamW"}
    model_section = _section(data, "model")
    if not model_section:
        raise ConfigError("model: the section is missing or empty")
    model_config = DeepseekV3Config(**model_section)
    seq_length = _seq_length(data, model_config)

    check_parallelism_section(parallelism)
    dims = ParallelDims(world_size=world_size, dp_shard=parallelism.data_parallel_shard,
                        tp=parallelism.tensor_parallel, cp=parallelism.context_parallel,
                        pp=parallelism.pipeline_parallel, ep=parallelism.expert_parallel)
    dims.validate_model(model_config, seq_length)
    accumulation = dims.accumulation_steps(training.global_batch_size, training.local_batch_size)

    from lit_moe.model import sizing

    counts = sizing.param_counts(model_config)
    flops = sizing.flops_per_token(model_config, seq_length)

    _init_fake_world(world_size)
    try:
        dims.build_meshes("cpu")
        with torch.device("meta"):
            model = DeepseekV3ForCausalLM(model_config)
        model = parallelize(model, dims, parallelism, recompute=recompute, recompute_comm=recompute_comm,
                            model_config=model_config, reduce_in_fp32=True, force_fsdp=True)
        mem = local_bytes(model, optimizer_section)
    finally:
        dist.destroy_process_group()

    total = _count(counts, "total")
    active = _count(counts, "active")
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
            p(f"        (the seed's 8-card table, world = tp x ep x dp, would call this layout data_parallel "
              f"{seed_dp}; lit_moe follows MindFormers' code: data_parallel = world_size / (tp * pp * cp) = "
              f"{dims.dp})", file=out)
    p(f"  sharding strategy {parallelism.data_parallel_shard_strategy} "
      f"({'ZeRO-3: parameters resharded after forward' if parallelism.data_parallel_shard_strategy == 'optim_grads_params' else 'ZeRO-2: parameters kept gathered until backward'})",
      file=out)
    p("batch", file=out)
    per_micro = dims.dp * training.local_batch_size
    p(f"  local_batch_size {training.local_batch_size} x data_parallel {dims.dp} = {per_micro} samples per "
      f"micro-batch; global_batch_size {training.global_batch_size}", file=out)
    p(f"  accumulation steps {accumulation} (= {training.global_batch_size} // {per_micro})"
      + (f"; {training.global_batch_size - accumulation * per_micro} samples of each global batch dropped"
         if training.global_batch_size % per_micro else ""), file=out)
    p(f"  sequence length {seq_length}: {seq_length // dims.cp} tokens per context-parallel rank, "
      f"{seq_length // (dims.cp * dims.tp)} per tensor-parallel rank between layers", file=out)
    p("model", file=out)
    p(f"  parameters: total {_fmt_count(total)} ({total:,}), active per token {_fmt_count(active)} ({active:,})",
      file=out)
    p(f"  training FLOPs per token: {_fmt_count(flops)} (forward + backward, at sequence length {seq_length})",
      file=out)
    p("per-rank memory (rank 0, from its local shards)", file=out)
    p(f"  parameters ({model_config.params_dtype}): {_fmt_bytes(mem['params'])} "
      f"({mem['params_numel']:,} values; {mem['params_numel'] / max(total, 1):.4%} of the model)", file=out)
    p(f"  gradients (fp32, sharded): {_fmt_bytes(mem['grads'])}", file=out)
    if not parallelism.gradient_sync_every_microbatch:
        p(f"  gradients kept unsharded between micro-batches (gradient_sync_every_microbatch: false): "
          f"{_fmt_bytes(mem['unsharded_grads'])}", file=out)
    p(f"  optimizer state ({optimizer_section.get('type', 'AdamW')}, fp32): {_fmt_bytes(mem['optimizer'])}", file=out)
    p(f"  total (without activations): {_fmt_bytes(mem['params'] + mem['grads'] + mem['optimizer'])}", file=out)
    return {"dims": dims, "accumulation": accumulation, "total": total, "active": active, "flops": flops,
            "memory": mem}


def _count(counts: Any, key: str) -> int:
    if isinstance(counts, dict):
        return int(counts[key])
    return int(getattr(counts, key))


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan(args.config, args.world_size)
    except (ConfigError, ValueError) as err:
        print(f"lit_moe plan: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
