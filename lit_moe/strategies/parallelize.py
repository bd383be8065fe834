"""``parallelize(model, dims, parallelism, ...)``: TP → EP → CP → recompute → FSDP2 → compile, in small
named steps (TorchTitan's order). Each step is a no-op when its degree is 1.

The compile step tells the model's ``torch_compile`` which modules break a compiled graph on this
layout (``model.hooks.breaks_graphs``): the modules' own account plus the FSDP2 units, whose hooks
are excluded from tracing, so the model itself knows nothing of FSDP.

FSDP2 (``fully_shard``) wraps the embedding, every block of ``model.blocks()`` (decoder and MTP
layers), ``[norm, lm_head]`` and the root, on the dense FSDP mesh (``dp_shard·cp``, or
``[dp_replicate, dp_shard·cp]`` for HSDP). Routed experts are wrapped on their own mesh
(``dp_shard·cp·tp/ep``) before their block, with the gradient divided by ``dp·cp`` like every dense
gradient. The mixed-precision policy comes from the model: parameters and optimizer state stay in
``params_dtype`` (fp32 master weights), forward/backward compute in ``compute_dtype``, gradients are
reduced in fp32 (``accumulate_allreduce_grads_in_fp32``); the router keeps ``router_dense_type``.

One process skips FSDP entirely: nothing is sharded and the model casts to ``compute_dtype`` itself
(``ops.Linear`` casts its fp32 weight to the activation dtype, the embedding output is cast), so the
plain module is the cheapest correct path; a one-rank FSDP2 is slower per step on the tiny CPU model
(its all-gather copies and hooks buy nothing there; measured in benchmarks/README.md).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from lit_moe.config import ParallelismConfig, RecomputeCommConfig, RecomputeConfig

log = logging.getLogger(__name__)


def apply_tp(model: nn.Module, dims, sequence_parallel: bool = True) -> None:
    if dims.tp > 1:
        from lit_moe.strategies.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, dims.mesh("tp"), sequence_parallel)


def apply_ep(model: nn.Module, dims, dispatcher: str, sequence_parallel: bool = True) -> None:
    if dims.ep > 1 or dims.tp > 1:
        from lit_moe.strategies.expert_parallel import apply_moe_parallel

        apply_moe_parallel(model, dims, dispatcher, sequence_parallel)


def apply_cp(model: nn.Module, dims, parallelism: ParallelismConfig) -> None:
    if dims.cp > 1:
        from lit_moe.strategies.context_parallel import apply_context_parallel

        apply_context_parallel(model, dims, parallelism)


def resolved_steps(dims, parallelism: ParallelismConfig, config: Any, recompute=None, recompute_comm=None,
                   run: Any = None) -> tuple[str, Any]:
    """``(dispatcher, recompute plan)`` of the parallel steps: a run's, resolved once with its layout
    (``run``: the :class:`~lit_moe.strategies.run_shape.RunShape` ``check_layout`` built), or without
    one (a model parallelized on its own: tests, ``lit_moe plan``'s counts) the layout checked against
    the model here and both derived from the sections. The plan is None without recompute sections."""
    if run is not None:
        return run.dispatcher, run.recompute
    from lit_moe.strategies.expert_parallel import resolve_dispatcher
    from lit_moe.strategies.recompute import validate_recompute

    dims.validate_model(config)
    dispatcher = resolve_dispatcher(parallelism.moe_token_dispatcher_type,
                                    getattr(config, "moe_token_dispatcher_type", None))
    if recompute is None and recompute_comm is None:
        return dispatcher, None
    return dispatcher, validate_recompute(recompute, recompute_comm, config.total_layers)


def apply_recompute_step(model: nn.Module, plan):
    """The recompute ``plan`` applied to ``model`` (nothing when None); FSDP asks it which layers
    re-gather their parameters."""
    if plan is None:
        return None
    from lit_moe.strategies.recompute import apply_recompute

    return apply_recompute(model, plan=plan)


def mixed_precision(config: Any, reduce_in_fp32: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    compute = config.torch_dtype("compute_dtype")
    params = config.torch_dtype("params_dtype")
    reduce = torch.float32 if reduce_in_fp32 else compute
    dense = MixedPrecisionPolicy(param_dtype=compute if compute != params else None,
                                 reduce_dtype=reduce if reduce != params else None)
    router_dtype = config.torch_dtype("router_dense_type")
    router = MixedPrecisionPolicy(param_dtype=router_dtype if router_dtype != params else None,
                                  reduce_dtype=torch.float32 if reduce_in_fp32 else None)
    return dense, router


def apply_fsdp(model: nn.Module, dims, config: Any, parallelism: ParallelismConfig, reduce_in_fp32: bool,
               recompute_plan: Any = None) -> None:
    """FSDP2 units (module docstring); ``recompute_plan`` (:func:`apply_recompute_step`'s) says which
    layers reshard after forward to re-gather for backward."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from lit_moe.model import MoE
    from lit_moe.strategies.parallel_dims import gradient_divide_factors, reshard_after_forward
    from lit_moe.strategies.recompute import fsdp_reshard_after_forward

    dense_mp, router_mp = mixed_precision(config, reduce_in_fp32)
    zero3 = reshard_after_forward(parallelism)
    # disable_gradient_division: False divides once more by each reduce group (MindFormers' FSDP mean)
    dense_factor, expert_factor = gradient_divide_factors(parallelism, dims)
    mesh = dims.mesh("fsdp")
    emesh = dims.mesh("efsdp")
    compute = config.torch_dtype("compute_dtype")
    separate_router = config.torch_dtype("router_dense_type") != compute

    local_experts = (config.n_routed_experts or 0) // dims.ep
    efsdp = dims.efsdp

    def expert_placement(param: nn.Parameter):
        # Fewer local experts than shards: shard dim 1 instead of padding dim 0 (TorchTitan).
        return Shard(1) if local_experts < efsdp else Shard(0)

    from torch.distributed.fsdp import FSDPModule

    # A pipeline stage lacks the parts other stages hold (None); with the V-shaped schedule one rank's
    # first and last stage share the embedding, already wrapped for the first.
    for embedding in (model.embed_tokens, getattr(model, "position_embeddings", None)):
        if embedding is not None and not isinstance(embedding, FSDPModule):
            fully_shard(embedding, mesh=mesh, mp_policy=dense_mp, reshard_after_forward=zero3)
    for block in model.blocks():
        reshard = fsdp_reshard_after_forward(recompute_plan, block.layer_idx, zero3)
        mlp = block.mlp
        if isinstance(mlp, MoE):
            experts = fully_shard(mlp.experts, mesh=emesh, mp_policy=dense_mp, reshard_after_forward=reshard,
                                  shard_placement_fn=expert_placement)
            # Dense gradients are averaged over dp·cp ranks; expert gradients are summed over every rank
            # of the expert mesh, so divide them by the same dp·cp.
            experts.set_gradient_divide_factor(expert_factor or float(dims.dp_cp))
            if dims.efsdp > 1 and _backend(emesh) != "nccl":
                # Only NCCL has PREMUL_SUM; elsewhere reduce with SUM and divide after. (Not with one
                # shard: torch then divides in its copy path and again after; version note in
                # benchmarks/README.md.)
                experts.set_force_sum_reduction_for_comms(True)
            if hasattr(experts, "set_reduce_scatter_unused_params"):
                experts.set_reduce_scatter_unused_params(True, recurse=False)
            if separate_router:
                fully_shard(mlp.router, mesh=mesh, mp_policy=router_mp, reshard_after_forward=reshard)
        fully_shard(block, mesh=mesh, mp_policy=dense_mp, reshard_after_forward=reshard)
    # the head runs right after the last layer and its backward right away: keep it gathered
    if model.lm_head is not None:
        fully_shard([model.norm, model.lm_head], mesh=mesh, mp_policy=dense_mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=dense_mp, reshard_after_forward=zero3)
    if dense_factor is not None and dense_factor > 1:
        _set_dense_divide_factor(model, dense_factor, sum_only=_backend(mesh) != "nccl")


def _set_dense_divide_factor(model: nn.Module, factor: float, sum_only: bool) -> None:
    from torch.distributed.fsdp import FSDPModule

    from lit_moe.model import MoE

    experts = {id(m.experts) for m in model.modules() if isinstance(m, MoE)}
    for module in model.modules():
        if isinstance(module, FSDPModule) and id(module) not in experts:
            module.set_gradient_divide_factor(factor)
            if sum_only:
                module.set_force_sum_reduction_for_comms(True)


def _backend(mesh) -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(mesh.get_group(mesh.ndim - 1))).lower()
    except Exception:
        return "unknown"


def apply_compile(model: nn.Module) -> None:
    """The compile step: the FSDP2 units (a MoE layer's experts, ``[norm, lm_head]``, the blocks)
    break the graphs of the model's compiled functions, which then compile around them
    (:mod:`lit_moe.model.compile`); a no-op without FSDP units."""
    from torch.distributed.fsdp import FSDPModule

    from lit_moe.model.compile import own_graph_breaks

    def breaks_graphs(module: nn.Module) -> bool:
        return own_graph_breaks(module) or any(isinstance(m, FSDPModule) for m in module.modules())

    model.hooks.breaks_graphs = breaks_graphs


def needs_fsdp(dims) -> bool:
    return dims.world_size > 1


def parallelize(
    model: nn.Module,
    dims,
    parallelism: Optional[ParallelismConfig] = None,
    recompute: Optional[RecomputeConfig] = None,
    recompute_comm: Optional[RecomputeCommConfig] = None,
    model_config: Any = None,
    reduce_in_fp32: bool = True,
    force_fsdp: bool = False,
    run: Any = None,
) -> nn.Module:
    """Apply the run's parallelism to ``model`` in place (normally on the meta device) and return it.

    ``dims`` must have its meshes built (:meth:`ParallelDims.build_meshes`) unless ``world_size == 1``
    and nothing but recompute applies. ``run``: the run's resolved
    :class:`~lit_moe.strategies.run_shape.RunShape`, whose dispatcher and recompute plan apply
    (:func:`resolved_steps`; the ``recompute`` sections are then not read)."""
    parallelism = parallelism if parallelism is not None else ParallelismConfig()
    config = model_config if model_config is not None else model.config
    dispatcher, recompute_plan = resolved_steps(dims, parallelism, config, recompute, recompute_comm, run)

    apply_tp(model, dims)
    apply_ep(model, dims, dispatcher)
    apply_cp(model, dims, parallelism)
    plan = apply_recompute_step(model, recompute_plan)
    if force_fsdp or needs_fsdp(dims):
        if not dims.meshes:
            raise RuntimeError("parallelize: FSDP needs device meshes; call ParallelDims.build_meshes() first")
        apply_fsdp(model, dims, config, parallelism, reduce_in_fp32, recompute_plan=plan)
    apply_compile(model)
    return model
