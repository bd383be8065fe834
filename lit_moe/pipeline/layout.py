"""The pipeline's layout: the schedule table, the layer split, stage placement and what each stage holds.

Stage s holds decoder layers ``ranges[s]`` (global indices); the first stage also holds the
embedding, the last the final norm, head and MTP layers (and DeepSeek-V4's ``hc_head``); with MTP the
last stage holds a copy of the embedding too (:func:`stage_parts`, the one rule the runtime's stage
modules and the planner's per-rank bytes both read).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Iterable, Optional

from lit_moe.strategies.parallel_dims import ParallelismError

SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe", "interleaved_zb", "zbv", "dualpipev")
_MULTI_STAGE = ("interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")                                     # rank r holds stages r and 2P-1-r
SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")            # input and weight gradients apart


class PipelineError(ParallelismError):
    """An impossible pipeline layout; the message names the ``parallelism`` key and the numbers."""


def resolve_schedule(schedule: Optional[str], interleave: int) -> str:
    """The schedule MindFormers would run: ``1f1b`` becomes ``interleaved_1f1b`` with V > 1."""
    name = (schedule or "1f1b").lower()
    if name not in SCHEDULES:
        raise PipelineError(f"parallelism.pipeline_parallel_schedule: {schedule!r} is not one of "
                            f"{', '.join(SCHEDULES)}")
    if name == "1f1b" and interleave > 1:
        name = "interleaved_1f1b"
    if name == "gpipe" and interleave > 1:
        raise PipelineError(f"parallelism.pipeline_parallel_schedule: gpipe runs one stage per rank, but "
                            f"pipeline_parallel_interleave_num is {interleave}; use interleaved_1f1b")
    if name in ("interleaved_1f1b", "interleaved_zb") and interleave < 2:
        raise PipelineError(f"parallelism.pipeline_parallel_schedule: {name} needs "
                            f"pipeline_parallel_interleave_num > 1, got {interleave}; use 1f1b")
    if name in V_SHAPED and interleave != 2:
        raise PipelineError(f"parallelism.pipeline_parallel_schedule: {name} runs exactly 2 stages per rank, "
                            f"but pipeline_parallel_interleave_num is {interleave}")
    return name


def split_layers(spec: Any, num_layers: int, pp: int, interleave: int = 1) -> list[tuple[int, int]]:
    """Half-open layer ranges ``[start, end)`` of the ``pp · interleave`` stages, in stage order.

    ``spec`` is ``pipeline_parallel_layers_per_stage`` as
    :func:`~lit_moe.strategies.parallel_dims.pipeline_stage_layers` reads it (``"auto"``/null: even
    split; else one string per rank of ``interleave`` comma-separated inclusive ranges, chunk c of
    rank r being stage c·P + r; uneven stages allowed). A pipeline also needs every stage to be one
    contiguous run of layers, the stages following each other."""
    from lit_moe.strategies.parallel_dims import pipeline_stage_layers

    knobs = SimpleNamespace(pipeline_parallel=pp, pipeline_parallel_interleave_num=interleave,
                            pipeline_parallel_layers_per_stage=spec)
    ranges: list[list[int]] = [[] for _ in range(pp * interleave)]
    for rank, chunks in enumerate(pipeline_stage_layers(knobs, num_layers)):
        for chunk, ids in enumerate(chunks):
            ranges[chunk * pp + rank] = list(ids)
    expected = 0
    for s, ids in enumerate(ranges):
        if not ids or ids[0] != expected or ids != list(range(ids[0], ids[-1] + 1)):
            raise PipelineError(
                f"parallelism.pipeline_parallel_layers_per_stage: stage {s} holds layers {ids}, expected a contiguous "
                f"run starting at layer {expected} (stage c*pipeline_parallel + r is chunk c of rank r; the stages "
                "follow each other)")
        expected = ids[-1] + 1
    return [(ids[0], ids[-1] + 1) for ids in ranges]


@dataclass(frozen=True)
class PipelineLayout:
    """Which stages exist, which layers each holds and which rank runs it."""

    pp: int
    interleave: int
    schedule: str
    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def from_config(cls, parallelism: Any, num_layers: int) -> "PipelineLayout":
        pp = int(getattr(parallelism, "pipeline_parallel", 1))
        v = int(getattr(parallelism, "pipeline_parallel_interleave_num", 1) or 1)
        if v < 1:
            raise PipelineError(f"parallelism.pipeline_parallel_interleave_num: must be >= 1, got {v}")
        schedule = resolve_schedule(getattr(parallelism, "pipeline_parallel_schedule", "1f1b"), v)
        spec = getattr(parallelism, "pipeline_parallel_layers_per_stage", None)
        return cls(pp, v, schedule, tuple(split_layers(spec, num_layers, pp, v)))

    @property
    def num_stages(self) -> int:
        return self.pp * self.interleave

    @property
    def multi_stage(self) -> bool:
        return self.schedule in _MULTI_STAGE

    def rank_of(self, stage: int) -> int:
        """Looped placement (stage s on rank s mod P); ``zbv``, ``dualpipev``: V shape (rank r holds r
        and 2P-1-r)."""
        chunk, r = divmod(stage, self.pp)
        return self.pp - 1 - r if self.schedule in V_SHAPED and chunk % 2 else r

    def stages_of(self, rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.rank_of(s) == rank]

    def check_microbatches(self, accumulation_steps: int, global_batch_size: Any = None,
                           field: str = "training.global_batch_size") -> None:
        """One line naming ``field`` (the key that sets the global batch) when A cannot fill the schedule."""
        A, P = accumulation_steps, self.pp
        # torch's DualPipeV needs a micro-batch per stage
        need = 1 if self.schedule == "gpipe" else self.num_stages if self.schedule == "dualpipev" else P
        rounds = max(1, A // P)
        ok = A >= need and (not self.multi_stage or A % rounds == 0)
        if not ok:
            gbs = f" {global_batch_size}" if global_batch_size is not None else ""
            rule = f">= {need}" + (f" and a multiple of max(1, A // {P})" if self.multi_stage else "")
            raise PipelineError(
                f"{field}{gbs} gives {A} micro-batches per step (global batch / "
                f"(data_parallel * local_batch_size)), but pipeline schedule {self.schedule} with pipeline_parallel "
                f"{P} needs {rule}: raise {field.rpartition('.')[2]}")

    def describe(self) -> list[str]:
        lines = [f"pipeline_parallel {self.pp} x interleave {self.interleave} = {self.num_stages} stages, "
                 f"schedule {self.schedule}"]
        for s, (a, b) in enumerate(self.ranges):
            extra = (" + embedding" if s == 0 else "") + (" + norm, head, MTP" if s == self.num_stages - 1 else "")
            lines.append(f"  stage {s} (rank {self.rank_of(s)}): layers {a}-{b - 1}{extra}")
        return lines


def check_zero_bubble_reshard(parallelism: Any, schedule: str, stage_ranks: int) -> None:
    """``reshard_after_forward_policy: always`` with a zero-bubble schedule on FSDP stages is refused."""
    if schedule in SPLIT_BACKWARD and stage_ranks > 1 and \
            getattr(parallelism, "reshard_after_forward_policy", "default") == "always":
        # torch's weight-gradient pass (stage_backward_weight) differentiates w.r.t. the stage's
        # registered parameters when it runs, which must be the unsharded ones the forward used
        raise PipelineError(
            f"parallelism.reshard_after_forward_policy: 'always' cannot be used with pipeline_parallel_schedule "
            f"{schedule} and {stage_ranks} ranks per stage (the split weight-gradient pass needs the "
            "parameters the forward gathered); use 'default' or 'never'")


def check_pipeline_run(parallelism: Any, model_config: Any, accumulation_steps: int, global_batch_size: Any,
                       stage_ranks: int = 1, layout: Optional[PipelineLayout] = None) -> PipelineLayout:
    """Before launching: the layout is valid for the model and A micro-batches fill the schedule
    (MindFormers writes A into ``pipeline_parallel_microbatch_size``); ``stage_ranks``: the ranks of
    each stage (world size / pipeline_parallel). Returns the layout (``layout``: the one already built
    from ``parallelism``)."""
    if layout is None:
        layout = PipelineLayout.from_config(parallelism, model_config.num_hidden_layers)
    layout.check_microbatches(accumulation_steps, global_batch_size)
    check_zero_bubble_reshard(parallelism, layout.schedule, stage_ranks)
    mtp = getattr(model_config, "num_nextn_predict_layers", 0) or 0
    check_shared_embedding(layout, mtp, stage_ranks)
    return layout


def check_shared_embedding(layout: "PipelineLayout", mtp: int, stage_ranks: int) -> None:
    """A V-shaped schedule puts the first and the last stage on one rank, whose two stage modules then
    share the embedding (MTP reads it on the last stage): fine with one rank per stage (the two
    gradients add up in one tensor), refused when each stage is its own FSDP root."""
    last = layout.num_stages - 1
    if mtp and last > 0 and stage_ranks > 1 and layout.rank_of(0) == layout.rank_of(last):
        raise PipelineError(f"parallelism.pipeline_parallel_schedule: {layout.schedule} puts the first and the last stage "
                            f"on one rank, whose MTP layers would share the embedding across two FSDP stage roots "
                            f"({stage_ranks} ranks per stage); not supported with model.num_nextn_predict_layers > 0 "
                            "(use interleaved_zb or interleaved_1f1b, or one rank per stage)")



# ----------------------------------------------------------------------------------------------
# stage membership: what a stage holds (runtime and planner)
# ----------------------------------------------------------------------------------------------
EMBEDDING_PREFIXES = ("embed_tokens.", "position_embeddings.")


@dataclass(frozen=True)
class StageParts:
    """What one stage, or a rank's stages together, holds of the model."""

    layers: tuple[int, ...]
    """Decoder layers, by global index."""
    first: bool
    """Holds stage 0: embeds the micro-batch's token ids."""
    last: bool
    """Holds the last stage: ``hc_head`` (mHC), final norm, head and MTP layers."""
    embedding: bool
    """Holds the embedding: the first stage, and the last with MTP (its copy, whose gradient is summed
    with the first stage's)."""

    def holds(self, name: str) -> bool:
        """Whether the parameter (or module) of full-model name ``name`` is part of this."""
        if name.startswith("layers."):
            return int(name.split(".")[1]) in self.layers
        if name.startswith(EMBEDDING_PREFIXES):
            return self.embedding
        return self.last


def stage_parts(layout: "PipelineLayout", stages: Iterable[int], has_mtp: bool) -> StageParts:
    """What ``stages`` hold together (one stage, or a rank's stages: ``layout.stages_of(rank)``)."""
    stages = list(stages)
    first, last = 0 in stages, layout.num_stages - 1 in stages
    layers = tuple(sorted(i for s in stages for i in range(*layout.ranges[s])))
    return StageParts(layers, first, last, embedding=first or (last and has_mtp))


def stages_holding(name: str, layout: "PipelineLayout", has_mtp: bool) -> list[int]:
    """The stages holding the parameter of full-model name ``name``."""
    return [s for s in range(layout.num_stages) if stage_parts(layout, [s], has_mtp).holds(name)]


def schedule_class(name: str):
    """torch's schedule class of a schedule name of :data:`SCHEDULES`."""
    from torch.distributed import pipelining as pl

    return {"1f1b": pl.Schedule1F1B, "gpipe": pl.ScheduleGPipe,
            "interleaved_1f1b": pl.ScheduleInterleaved1F1B,
            "interleaved_zb": pl.ScheduleInterleavedZeroBubble,
            "zbv": pl.ScheduleZBVZeroBubble, "dualpipev": pl.ScheduleDualPipeV}[name]
