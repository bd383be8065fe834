"""Pipeline parallelism: DeepSeek-V3 split into stages, run by ``torch.distributed.pipelining``.

Keys (MindFormers ``parallelism`` section)::

    pipeline_parallel                    P, pipeline ranks
    pipeline_parallel_interleave_num     V, virtual stages per rank (P·V stages in all)
    pipeline_parallel_schedule           1f1b | interleaved_1f1b | gpipe (+ interleaved_zb, zbv, dualpipev)
    pipeline_parallel_layers_per_stage   "auto" or one string per rank: V comma-separated
                                         inclusive ranges "a-b" (or "a"), chunk c of rank r is
                                         stage c·P + r (MindFormers' PpLayerSetting)
    pipeline_parallel_microbatch_size    overwritten with the accumulation steps A (MindFormers)

``1f1b`` with V > 1 becomes ``interleaved_1f1b`` (MindFormers' ``_infer_schedule_type``). The
zero-bubble schedules of torch (``interleaved_zb``: looped stages, ``zbv``: V-shaped, exactly two
stages per rank) and its ``dualpipev`` (DeepSeek's DualPipeV: the V shape of ``zbv``, one micro-batch's
forward paired with another's backward, split backwards at the ends) are an extension.

Stage s holds decoder layers ``ranges[s]`` (their global indices kept: parameter names, layer ids
of recompute and checkpoints are those of the whole model); the first stage also holds the
embedding, the last the final norm, head and the MTP layers (and DeepSeek-V4's ``hc_head``: with mHC
the stages pass the residual streams ``[B, S, hc_mult, H]``). MTP needs the embedding on the last
stage too: it holds a copy whose gradient is summed with the first stage's after every step
(Megatron's embedding group), so both copies take identical optimizer steps.

Every micro-batch's objective is ``(loss + aux_loss + mtp_loss) / A`` as on one process. The MoE
balancing losses of a stage that is not the last reach the backward through
:class:`AuxLossBackward` (Megatron's ``MoEAuxLossAutoScaler``): identity on the hidden state
forward, the aux loss' gradient ``1/A`` injected backward.

The package: :mod:`~lit_moe.pipeline.layout` (the schedule table, the layer split, stage placement and
:func:`~lit_moe.pipeline.layout.stage_parts`, the one rule of what each stage holds, read by the
runtime and the planner alike), :mod:`~lit_moe.pipeline.stage` (a stage: the model's parts, run by the
model's own forward), :mod:`~lit_moe.pipeline.runner` (the schedule that runs a step, evaluation,
the stage-spanning norms, and :class:`~lit_moe.pipeline.runner.PipelineParallel`, what the strategy
keeps) and :mod:`~lit_moe.pipeline.plan` (what ``lit_moe plan`` prints per pipeline rank). Only the
strategy (:class:`lit_moe.strategies.AscendFSDPStrategy`) uses it at run time: the module, the
callbacks and the checkpoint code ask :class:`lit_moe.step.StepStrategy`.
"""

from lit_moe.pipeline.layout import (SCHEDULES, SPLIT_BACKWARD, V_SHAPED, PipelineError, PipelineLayout, StageParts,
                                     check_pipeline_run, check_shared_embedding, check_zero_bubble_reshard,
                                     resolve_schedule, schedule_class, split_layers, stage_parts, stages_holding)
from lit_moe.pipeline.plan import bubble_fraction, in_flight_microbatches, parameters_of_ranks, plan_stages
from lit_moe.pipeline.runner import (PipelineParallel, PipelineRunner, embedding_duplicates, embedding_group,
                                     forward_only, pipeline_grad_norm, stage_hidden_shape)
from lit_moe.pipeline.stage import AuxLossBackward, DeepseekV3Stage, parallelize_pipeline, split_model

__all__ = ["AuxLossBackward", "DeepseekV3Stage", "PipelineError", "PipelineLayout", "PipelineParallel", "PipelineRunner",
           "SCHEDULES", "SPLIT_BACKWARD", "StageParts", "V_SHAPED", "bubble_fraction", "check_pipeline_run",
           "check_shared_embedding", "check_zero_bubble_reshard", "embedding_duplicates", "embedding_group",
           "forward_only", "in_flight_microbatches", "parallelize_pipeline", "parameters_of_ranks",
           "pipeline_grad_norm", "plan_stages", "resolve_schedule", "schedule_class", "split_layers", "split_model",
           "stage_hidden_shape", "stage_parts", "stages_holding"]
