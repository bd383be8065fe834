"""The shape of a run's optimizer step, resolved once from the parsed configuration.

:func:`lit_moe.strategies.plan.check_layout` builds one :class:`RunShape` after every check of the
layout against the model and the batch; ``lit_moe fit`` (``cli.build_run``) and ``lit_moe plan`` read
the data-parallel degree, the accumulation steps ``A`` and the samples of a step from it instead of
deriving them again. The samples of a step are ``A · data_parallel · local_batch_size``: MindFormers
floors ``A = global_batch_size // (data_parallel · local_batch_size)`` and drops the remainder of a
``global_batch_size`` that is no multiple of it, so the configured global batch is not what a step
consumes. The run's consumed-samples count (the DataModule's sampler position, in the step metrics,
common.json and the auto-resume check) advances by exactly this number per step.

It also holds what the layout resolves once for the run: the pipeline's
:class:`~lit_moe.pipeline.PipelineLayout` (stages, layer split, schedule), the
:class:`~lit_moe.strategies.recompute.RecomputePlan` of the ``recompute`` sections and the MoE token
dispatcher. The strategy (``AscendFSDPStrategy(run_shape=...)``), ``parallelize``, the pipeline's
build and ``check_fits`` take them from here instead of deriving them again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class RunShape:
    """The batch and layout of a run's optimizer step.

    Args:
        dims: the run's :class:`~lit_moe.strategies.parallel_dims.ParallelDims`.
        global_batch_size: ``training.global_batch_size`` as configured (after a ramp-up, the final size).
        local_batch_size: ``training.local_batch_size``, samples per micro-batch on one rank.
        accumulation: ``A``, micro-batches per optimizer step on each rank once any ramp-up is over.
        seq_length: tokens per sample.
        ramp: the run's :class:`~lit_moe.optim.schedules.BatchRamp` (None: no ramp-up).
        pipeline: the :class:`~lit_moe.pipeline.PipelineLayout` (None: ``pipeline_parallel`` 1).
        recompute: the :class:`~lit_moe.strategies.recompute.RecomputePlan` of the ``recompute`` and
            ``recompute_comm`` sections (None: neither section given).
        dispatcher: the MoE token dispatcher (``parallelism.`` and ``model.moe_token_dispatcher_type``).
    """

    dims: Any
    global_batch_size: int
    local_batch_size: int
    accumulation: int
    seq_length: int
    ramp: Optional[Any] = None
    pipeline: Optional[Any] = None
    recompute: Optional[Any] = None
    dispatcher: str = "alltoall"

    @property
    def samples_per_micro_batch(self) -> int:
        """``data_parallel · local_batch_size``: global samples of one micro-batch of every rank."""
        return self.dims.dp * self.local_batch_size

    @property
    def samples_per_step(self) -> int:
        """Global samples one optimizer step consumes once any ramp-up is over (``A · dp · lbs``)."""
        return self.accumulation * self.samples_per_micro_batch

    @property
    def dropped(self) -> int:
        """Samples of ``global_batch_size`` no step consumes (MindFormers' floor division drops them)."""
        return self.global_batch_size - self.samples_per_step

    def accumulation_at(self, consumed_samples: int) -> int:
        """``A`` of the step that starts after ``consumed_samples`` global samples."""
        return self.accumulation if self.ramp is None else self.ramp.accumulation_at(consumed_samples)

    def samples_of_step_at(self, consumed_samples: int) -> int:
        """Global samples of the step that starts after ``consumed_samples`` (the ramp-up's value)."""
        return self.accumulation_at(consumed_samples) * self.samples_per_micro_batch
