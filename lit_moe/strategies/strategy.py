"""``AscendFSDPStrategy``: the ``parallelism`` section as device meshes and a sharded model.

A Lightning ``ModelParallelStrategy`` whose ``setup_environment`` builds our meshes
(:class:`~lit_moe.strategies.parallel_dims.ParallelDims`) instead of Lightning's fixed 2-D
(data, tensor) mesh, whose ``distributed_sampler_kwargs`` follow the data-parallel mesh (tensor and
context parallel ranks read the same samples), and whose :meth:`parallelize` applies tensor,
expert and context parallelism, recompute and FSDP2 (``lit_moe.strategies.parallelize``).

It is the one strategy interface ``LitMoE`` talks to (:class:`lit_moe.step.StepStrategy`), and it
resumes from lit_moe iteration directories through its own overrides of Lightning's loader hooks
(:class:`lit_moe.checkpoint.resume.IterationResume`).

The same strategy runs one CPU process (the default of ``lit_moe fit``), N local processes
(``--trainer.devices N``: Lightning re-launches the command), torchrun and SLURM jobs, on CPU
(gloo), CUDA (nccl) and Ascend NPU (hccl).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch import nn

from lit_moe.checkpoint.resume import IterationResume
from lit_moe.config import (CheckpointConfig, ParallelismConfig, RecomputeCommConfig, RecomputeConfig,
                             build_section)
from lit_moe.runtime.distributed import release_process_groups_at_exit, set_group_timeout
from lit_moe.runtime.launch import check_built_world
from lit_moe.step import MoEStepStats, StepRecord, StepStrategy, mean_eval_loss, model_moe_block_ids
from lit_moe.strategies.accelerators import register_npu_accelerator
from lit_moe.strategies.clip import clip_grads_with_norm_ as _clip_grads_with_norm_
from lit_moe.strategies.clip import embedding_grad_norm, global_grad_norm
from lit_moe.strategies.parallel_dims import SHARD_STRATEGIES, ParallelDims, ParallelismError, is_zero1


STARTUP_RENDEZVOUS = timedelta(minutes=10)
"""The least time the start-up rendezvous waits for every rank (``process_group_timeout_s`` when longer)."""


class AscendFSDPStrategy(IterationResume, ModelParallelStrategy, StepStrategy):
    """FSDP2 (+HSDP) with tensor, expert and context parallelism, built from ``parallelism``.

    Args:
        parallelism: the ``parallelism`` section.
        recompute, recompute_comm: the ``recompute`` sections (applied by :meth:`parallelize`).
        model_config: the model's ``DeepseekV3Config``; its dtypes give the mixed-precision policy
            (parameters in ``params_dtype``, compute in ``compute_dtype``) and its sizes are checked
            against the layout at setup.
        accumulate_allreduce_grads_in_fp32: reduce gradients in fp32 (the ``optimizer`` key of the
            same name); False reduces them in ``compute_dtype``.
        checkpoint: the ``checkpoint`` section; a resume reads ``load_balanced`` and
            ``load_worker_number`` from it (None: their defaults).
        expected_world_size: the world ``lit_moe fit`` sized gradient accumulation for; a launch
            that builds another stops at setup with one line (None: not checked).
        run_shape: the run resolved once (:class:`~lit_moe.strategies.run_shape.RunShape`, built by
            ``check_layout``): its ParallelDims, pipeline layout, recompute plan and dispatcher are
            used as they are (``recompute`` / ``recompute_comm`` are then not read). None: derived
            here from the sections (a strategy built on its own).
        lightning_kwargs: passed to ``ModelParallelStrategy`` (``save_distributed_checkpoint``,
            ``process_group_backend``, ``timeout``). ``timeout`` defaults to
            ``parallelism.process_group_timeout_s``.
    """

    strategy_name = "ascend_fsdp"

    def __init__(
        self,
        parallelism: Optional[ParallelismConfig] = None,
        recompute: Optional[RecomputeConfig] = None,
        recompute_comm: Optional[RecomputeCommConfig] = None,
        model_config: Any = None,
        accumulate_allreduce_grads_in_fp32: bool = True,
        checkpoint: Optional[CheckpointConfig] = None,
        expected_world_size: Optional[int] = None,
        run_shape: Any = None,
        **lightning_kwargs: Any,
    ) -> None:
        parallelism = build_section(ParallelismConfig, parallelism, "parallelism")
        check_parallelism_section(parallelism)
        lightning_kwargs.setdefault("timeout", timedelta(seconds=parallelism.process_group_timeout_s))
        lightning_kwargs.pop("data_parallel_size", None)
        lightning_kwargs.pop("tensor_parallel_size", None)
        super().__init__(**lightning_kwargs)
        self.parallelism = parallelism
        self.recompute = recompute
        self.recompute_comm = recompute_comm
        self.model_config = model_config
        self.accumulate_allreduce_grads_in_fp32 = accumulate_allreduce_grads_in_fp32
        self.checkpoint_config = checkpoint
        self.expected_world_size = expected_world_size
        self.run_shape = run_shape
        self._parallel_dims: Optional[ParallelDims] = None
        self._parallelized: Optional[nn.Module] = None
        self._sync_enabled = True
        self.pipeline = None   # PipelineParallel with pipeline_parallel > 1 (lit_moe.pipeline)

    # ------------------------------------------------------------------------------------------
    # environment and meshes
    # ------------------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        # Not super().setup_environment(): that builds Lightning's 2-D (data, tensor) mesh.
        self._setup_distributed()
        check_built_world(self.expected_world_size, self.world_size)
        dims = self._make_parallel_dims(self.world_size)
        dims.build_meshes(self.root_device.type, timeout=self._timeout)
        self._parallel_dims = dims
        self._device_mesh = dims.mesh("batch")
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def _setup_distributed(self) -> None:
        # The rendezvous waits for every rank's start-up (imports from a busy node or a slow shared file
        # system, the nodes of one job starting apart) at least STARTUP_RENDEZVOUS; the collective
        # timeout applies from the first collective on. Only where torch can shorten a group's timeout
        # afterwards (gloo, NCCL): elsewhere the rendezvous keeps the collective timeout.
        collective = self._timeout
        if collective is not None and self._get_process_group_backend() in ("gloo", "nccl"):
            self._timeout = max(collective, STARTUP_RENDEZVOUS)
        try:
            if (self.num_nodes * self.num_processes == 1 and "MASTER_PORT" not in os.environ
                    and not dist.is_initialized()):
                # One process outside a launcher needs no rendezvous: an in-memory store, not the TCP
                # port Lightning would pick free and bind a moment later (another process can take it
                # in between: EADDRINUSE). Lightning's setup below sees the group and keeps it.
                device = self.root_device
                dist.init_process_group(self._get_process_group_backend(), store=dist.HashStore(), rank=0,
                                        world_size=1, timeout=self._timeout,
                                        device_id=device if device.type != "cpu" else None)
            super()._setup_distributed()
        finally:
            self._timeout = collective
        set_group_timeout(collective, dist.group.WORLD)
        release_process_groups_at_exit()

    def _make_parallel_dims(self, world_size: int) -> ParallelDims:
        if self.run_shape is not None:   # validated by check_layout (setup refuses another world size first)
            return self.run_shape.dims
        dims = ParallelDims.from_config(self.parallelism, world_size)
        if self.model_config is not None:
            dims.validate_model(self.model_config)
        return dims

    @property
    def parallel_dims(self) -> ParallelDims:
        """The validated degrees (meshes built once the processes have started)."""
        if self._parallel_dims is None:
            # Before setup: the arithmetic only (world size from the launcher).
            self._parallel_dims = self._make_parallel_dims(max(self.num_nodes * self.num_processes, 1))
        return self._parallel_dims

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp = self.dp_mesh
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    @property
    def dp_mesh(self):
        """Data-parallel mesh (dp_replicate × dp_shard): ranks that read different samples."""
        return self.parallel_dims.mesh("dp")

    @property
    def dp_group(self) -> Optional[dist.ProcessGroup]:
        return self.dp_mesh.get_group() if self._meshes_ready() else None

    @property
    def expert_count_group(self) -> Optional[dist.ProcessGroup]:
        """Ranks whose MoE token counts must be summed: dp × cp. Context-parallel ranks route their own
        shard of the sequence; tensor-parallel ranks route the same tokens (the MoE layer gathers
        the tp shards), so tp is not summed over."""
        return self.parallel_dims.mesh("dp_cp").get_group() if self._meshes_ready() else None

    @property
    def batch_replicas(self) -> int:
        """Ranks that receive each sample: the tensor-, context- and pipeline-parallel ranks of one
        data-parallel rank (the sequence is split inside the model; every stage reads the batch)."""
        return self.parallel_dims.tp * self.parallel_dims.cp * self.parallel_dims.pp

    def parallel_degrees(self) -> dict[str, int]:
        """The degrees of :attr:`parallel_dims` by name (recorded in a checkpoint's ``common.json``)."""
        d = self.parallel_dims
        return {"dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "cp": d.cp, "tp": d.tp, "ep": d.ep,
                "pp": d.pp}

    @property
    def collective_timeout(self) -> Optional[timedelta]:
        """``parallelism.process_group_timeout_s`` (or the ``timeout`` given to Lightning)."""
        return self._timeout

    def _meshes_ready(self) -> bool:
        return self._parallel_dims is not None and bool(self._parallel_dims.meshes)

    # ------------------------------------------------------------------------------------------
    # the model
    # ------------------------------------------------------------------------------------------
    def parallelize(self, model: nn.Module) -> nn.Module:
        """TP → EP → CP → recompute → FSDP2 on ``model`` (normally still on the meta device)."""
        from lit_moe.strategies.parallelize import parallelize

        if self._parallelized is model:  # configure_model may run more than once
            return model
        if self.parallel_dims.pp > 1:
            from lit_moe.pipeline import PipelineParallel

            # the model becomes this rank's stages (every local parameter under its global name)
            self.pipeline = PipelineParallel.build(
                model, self.parallel_dims, self.parallelism, self.recompute, self.recompute_comm,
                self.model_config if self.model_config is not None else getattr(model, "config", None),
                self.accumulate_allreduce_grads_in_fp32, run=self.run_shape)
            self._parallelized = self.pipeline.container
            return self._parallelized
        model = parallelize(
            model,
            self.parallel_dims,
            self.parallelism,
            recompute=self.recompute,
            recompute_comm=self.recompute_comm,
            model_config=self.model_config if self.model_config is not None else getattr(model, "config", None),
            reduce_in_fp32=self.accumulate_allreduce_grads_in_fp32,
            run=self.run_shape,
        )
        self._parallelized = model
        return model

    # ------------------------------------------------------------------------------------------
    # what the step, callbacks and checkpoints ask (a pipeline answers for every stage)
    # ------------------------------------------------------------------------------------------
    def run_micro_batches(self, micro_batches: list[dict]) -> Optional[StepRecord]:
        """A pipeline schedule runs the micro-batches through every stage; else None (the module runs them)."""
        return None if self.pipeline is None else self.pipeline.forward_backward_record(micro_batches)

    def embedding_grad_norm(self, model: nn.Module) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The input embedding's gradient norm (a pipeline: the first stage's, handed to every rank)."""
        if self.pipeline is not None:   # only some stages hold the embedding: every rank joins the collectives
            return self.pipeline.embedding_grad_norm()
        return embedding_grad_norm(model)

    def whole_model_moe(self, moe: Optional[MoEStepStats]) -> Optional[MoEStepStats]:
        """``moe`` itself, or under a pipeline every stage's rows gathered over the pipeline (one
        all-reduce on the device)."""
        if self.pipeline is None:
            return moe
        return self.pipeline.gather_moe_stats(moe, self.root_device)

    def moe_block_ids(self, model: nn.Module) -> Optional[list[int]]:
        """Block ids of the model's MoE layers (a pipeline: of every stage's)."""
        if self.pipeline is not None:
            return self.pipeline.moe_block_ids()
        return model_moe_block_ids(model)

    def eval_loss(self, model: nn.Module, micro_batches: list[dict]) -> torch.Tensor:
        """The model's mean main loss (a pipeline: through every stage, the last stage's value on every rank)."""
        if self.pipeline is not None:
            return self.pipeline.evaluate(list(micro_batches))
        return mean_eval_loss(model, micro_batches)

    @property
    def holds_whole_model(self) -> bool:
        """False under a pipeline (this rank holds its stages' parts)."""
        return self.pipeline is None

    # ------------------------------------------------------------------------------------------
    # gradients
    # ------------------------------------------------------------------------------------------
    def grad_norm(self, parameters: Iterable[torch.Tensor]) -> torch.Tensor:
        """Global L2 norm (fp32) of the gradients over every mesh, each value counted once."""
        if self.pipeline is not None:   # every stage's gradients, the MTP embedding copy once
            return self.pipeline.grad_norm(list(parameters))
        return global_grad_norm(parameters)

    def clip_grads_with_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float,
                              total_norm: torch.Tensor) -> None:
        """Scale the gradients in place so that their norm ``total_norm`` is at most ``max_norm``
        (a non-finite norm leaves them untouched)."""
        _clip_grads_with_norm_(parameters, max_norm, total_norm)

    def set_gradient_sync(self, enabled: bool) -> None:
        """Reduce gradients after this micro-batch (``enabled``) or accumulate them unsharded.

        The module calls it with ``enabled = (last micro-batch of the step)``. Acts when
        ``parallelism.gradient_sync_every_microbatch`` is False, and always under ZeRO-1
        (``data_parallel_shard_strategy: optim``), which also keeps the gathered parameters after every
        backward but the last: the step gathers them once and reduce-scatters the gradients once."""
        zero1 = is_zero1(self.parallelism)
        if self.parallelism.gradient_sync_every_microbatch and not zero1:
            enabled = True
        if enabled == self._sync_enabled:
            return
        from torch.distributed.fsdp import FSDPModule

        model = self._parallelized
        if model is None:
            return
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_requires_gradient_sync(enabled, recurse=False)
                if zero1:
                    module.set_reshard_after_backward(enabled, recurse=False)
        self._sync_enabled = enabled


def check_parallelism_section(p: ParallelismConfig) -> None:
    """Field checks that need no world size (the CLI calls them before launching)."""
    if p.data_parallel_shard_strategy not in SHARD_STRATEGIES:
        raise ParallelismError(
            f"parallelism.data_parallel_shard_strategy: {p.data_parallel_shard_strategy!r} is not supported; use "
            + ", ".join(f"{name!r} ({what.split(':')[0]})" for name, what in SHARD_STRATEGIES.items()))
    if is_zero1(p) and str(p.reshard_after_forward_policy).lower() == "always":
        raise ParallelismError(
            "parallelism.reshard_after_forward_policy: 'always' contradicts data_parallel_shard_strategy 'optim' "
            "(ZeRO-1 keeps the gathered parameters through the step); use 'default' or 'never'")
    if p.moe_token_dispatcher_type not in ("alltoall", "allgather"):
        raise ParallelismError(
            f"parallelism.moe_token_dispatcher_type: {p.moe_token_dispatcher_type!r} is not supported; "
            "use 'alltoall' or 'allgather'")
    if isinstance(p.process_group_timeout_s, bool) or not isinstance(p.process_group_timeout_s, int) \
            or p.process_group_timeout_s <= 0:
        raise ParallelismError(
            f"parallelism.process_group_timeout_s: must be a positive number of seconds, got "
            f"{p.process_group_timeout_s!r}")


def register_strategy() -> None:
    StrategyRegistry.register(
        AscendFSDPStrategy.strategy_name, AscendFSDPStrategy,
        description="FSDP2/HSDP + tensor, expert and context parallelism from the parallelism section",
        override=True,
    )


register_strategy()
register_npu_accelerator()
