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
forward, the aux loss' gradient ``1/A`` injected backward. DeepSeek-V3.2's indexer losses
(``dsa_indexer_loss_coeff``) reach it the same way on every stage (the last too: injected at its
output), so the schedule's output stays ``[loss, aux_loss, mtp_loss]``; each stage records its
indexer losses beside them for the step's log.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lit_moe.strategies.parallel_dims import ParallelismError
from lit_moe.model.indexer import LightningIndexer
from lit_moe.model.transformer import DeepseekV3ForCausalLM

SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe", "interleaved_zb", "zbv", "dualpipev")
_MULTI_STAGE = ("interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")                                     # rank r holds stages r and 2P-1-r
SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")            # input and weight gradients apart


class PipelineError(ParallelismError):
    """An impossible pipeline layout; the message names the ``parallelism`` key and the numbers."""


# ----------------------------------------------------------------------------------------------
# layout: schedule, layer split, stage placement
# ----------------------------------------------------------------------------------------------
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
                       stage_ranks: int = 1) -> None:
    """Before launching: the layout is valid for the model and A micro-batches fill the schedule
    (MindFormers writes A into ``pipeline_parallel_microbatch_size``); ``stage_ranks``: the ranks of
    each stage (world size / pipeline_parallel)."""
    layout = PipelineLayout.from_config(parallelism, model_config.num_hidden_layers)
    layout.check_microbatches(accumulation_steps, global_batch_size)
    check_zero_bubble_reshard(parallelism, layout.schedule, stage_ranks)
    mtp = getattr(model_config, "num_nextn_predict_layers", 0) or 0
    check_shared_embedding(layout, mtp, stage_ranks)


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
# the stage model
# ----------------------------------------------------------------------------------------------
class AuxLossBackward(torch.autograd.Function):
    """Forward: ``hidden`` unchanged. Backward: ``hidden``'s gradient, and ``scale`` for ``aux``, so
    a stage's balancing losses are part of the objective without travelling to the last stage."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        # detach(): the same storage, not a view (the zero-bubble schedules detach the stage output
        # in place, which a view refuses)
        return hidden.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class DeepseekV3Stage(DeepseekV3ForCausalLM):
    """The part of a :class:`DeepseekV3ForCausalLM` that one pipeline stage (or, as a container,
    one rank) holds: decoder layers ``layer_ids`` (names keep their global index:
    ``layers.{i}.…``), the embedding with ``first`` (or with ``last`` and MTP), final norm, head and
    MTP layers with ``last``. Shares the modules of ``model`` (no copy): build it on the meta device.

    ``forward(x, input_ids, labels, …)``: ``x`` is the token ids on the first stage and the hidden
    state elsewhere; the other tensors are the micro-batch's (every stage receives them). A stage
    that is not the last returns the hidden state; the last returns ``[loss, aux_loss, mtp_loss]``.
    """

    holds_part_of_model = True   # checkpoint loading: the other stages' tensors are not unexpected

    def __init__(self, model: DeepseekV3ForCausalLM, layer_ids: Sequence[int], first: bool, last: bool):
        nn.Module.__init__(self)
        self.config, self.compute_dtype = model.config, model.compute_dtype
        # what tensor and context parallelism filled in (loss, MTP shift, input sharding): the same object
        self.hooks = model.hooks
        self.is_first, self.is_last = bool(first), bool(last)
        self.layer_ids = list(layer_ids)
        mtp = self.is_last and len(model.mtp) > 0
        self.embed_tokens = model.embed_tokens if (self.is_first or mtp) else None
        self.position_embeddings = model.position_embeddings if (self.is_first or mtp) else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in self.layer_ids})
        self.hc_head = model.hc_head if self.is_last else None   # mHC: the streams' collapse (or None)
        self.norm = model.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self.mtp = model.mtp if self.is_last else nn.ModuleList()
        self._main_moe = [m for layer in self.layers.values() for m in layer.modules() if _is_moe(m)]
        self._mtp_moe = [m for layer in self.mtp for m in layer.modules() if _is_moe(m)]
        self._indexers = [m for m in self.modules() if isinstance(m, LightningIndexer)]   # this stage's
        self.aux_grad_scale = 1.0   # backward weight of the balancing losses (1/A, set per step)
        self.step_stats: list[torch.Tensor] = []   # per micro-batch [loss, aux, mtp, indexer] (detached)
        self.moe_aux_sum: Optional[torch.Tensor] = None   # per local MoE layer, summed over micro-batches

    def blocks(self) -> list[nn.Module]:
        return [*self.layers.values(), *(m.layer for m in self.mtp)]

    def block_ids(self) -> list[int]:
        """Global layer ids of :meth:`blocks` (MTP layers follow the decoder layers)."""
        L = self.config.num_hidden_layers
        return [*self.layer_ids, *(L + k for k in range(len(self.mtp)))]

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                actual_seq_len: Optional[torch.Tensor] = None) -> torch.Tensor:
        # every stage takes this rank's part of the micro-batch's tensors (context parallel: its
        # zig-zag positions; the hidden state between stages is already [B, S/cp, H]); the first
        # embeds them (``x`` is the same token ids there)
        input_ids, labels, loss_mask, position_ids, ctx = self._inputs(
            input_ids, labels, loss_mask, position_ids, attention_mask, actual_seq_len)
        h = self.streams_in(self.embed(input_ids, position_ids)) if self.is_first else x
        for layer in self.layers.values():
            h = layer(h, ctx)
        self._collect_moe_aux(self._main_moe)
        aux = self._take_aux(self._main_moe)
        if not self.is_last:
            indexer = self._take_indexer_loss()
            if (aux is not None or indexer is not None) and torch.is_grad_enabled():
                zero = h.new_zeros((), dtype=torch.float32)
                self.step_stats.append(torch.stack([zero, zero if aux is None else aux.detach().float(), zero,
                                                    zero if indexer is None else indexer.detach().float()]))
                for term in (aux, indexer):
                    if term is not None:
                        h = AuxLossBackward.apply(h, term, self.aux_grad_scale)
            return h
        if labels is None:
            raise ValueError("the last pipeline stage needs labels")
        h = self.streams_out(h)
        mask = labels != -100
        if loss_mask is not None:
            mask = mask & (loss_mask != 0)
        if self._fused_loss():
            h, loss = self._fused_head(h, labels, mask)
        else:
            h, _, loss = self._head(h, labels, mask)
        mtp = loss.new_zeros((), dtype=torch.float32)
        if len(self.mtp):
            mtp = self._mtp_forward(h, input_ids, labels, mask, position_ids, ctx)
            self._collect_moe_aux(self._mtp_moe)
            mtp_aux = self._take_aux(self._mtp_moe)
            if mtp_aux is not None:
                mtp_aux = mtp_aux / len(self.mtp)
                aux = mtp_aux if aux is None else aux + mtp_aux
        if aux is None:
            aux = loss.new_zeros((), dtype=torch.float32)
        out = torch.stack([loss.float(), aux.float(), mtp.float()])
        indexer = self._take_indexer_loss()   # this stage's decoder and MTP layers'
        self.step_stats.append(torch.cat([out.detach(), (indexer.detach().float() if indexer is not None
                                                         else out.new_zeros(()))[None]]))
        if indexer is not None and torch.is_grad_enabled():
            out = AuxLossBackward.apply(out, indexer, self.aux_grad_scale)
        return out

    def _collect_moe_aux(self, moes: list) -> None:
        if not moes:
            return
        own = self._main_moe + self._mtp_moe
        vals = torch.zeros(len(own), dtype=torch.float32, device=_local(own[0].tokens_per_expert).device)
        for m in moes:
            if "aux_loss" in m.last_stats:
                vals[own.index(m)] = _local(m.last_stats["aux_loss"]).detach().float()
        self.moe_aux_sum = vals if self.moe_aux_sum is None else self.moe_aux_sum + vals


def _is_moe(module: nn.Module) -> bool:
    from lit_moe.model.moe import MoE

    return isinstance(module, MoE)


def _local(t):
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def split_model(model: DeepseekV3ForCausalLM, layout: PipelineLayout, pp_rank: int, stage_ranks: int = 1
                ) -> tuple[DeepseekV3Stage, list[DeepseekV3Stage]]:
    """(this rank's container: every local part under its global names, the per-stage modules).

    The container is what the optimizer, checkpoints and the training step see; the stage modules
    share its sub-modules and are what ``PipelineStage`` runs."""
    stages = layout.stages_of(pp_rank)
    last = layout.num_stages - 1
    check_shared_embedding(layout, len(model.mtp), stage_ranks)
    parts = [DeepseekV3Stage(model, range(*layout.ranges[s]), first=s == 0, last=s == last) for s in stages]
    ids = sorted(i for s in stages for i in range(*layout.ranges[s]))
    container = DeepseekV3Stage(model, ids, first=0 in stages, last=last in stages)
    return container, parts


def parallelize_pipeline(model: DeepseekV3ForCausalLM, dims, layout: PipelineLayout, parallelism: Any = None,
                         recompute: Any = None, recompute_comm: Any = None, model_config: Any = None,
                         reduce_in_fp32: bool = True) -> tuple[DeepseekV3Stage, list[DeepseekV3Stage]]:
    """Tensor, expert and context parallelism and recompute on the whole (meta) model, so layer ids
    and module paths stay global; then this rank's stages, each its own FSDP2 root on the stage's
    dense and expert meshes (when a stage has more than one rank). Returns :func:`split_model`'s (container, stage modules)."""
    from lit_moe.config import ParallelismConfig
    from lit_moe.strategies.expert_parallel import resolve_dispatcher
    from lit_moe.strategies.parallelize import (apply_compile, apply_cp, apply_ep, apply_fsdp, apply_recompute_step,
                                                apply_tp)

    parallelism = parallelism if parallelism is not None else ParallelismConfig()
    config = model_config if model_config is not None else model.config
    dims.validate_model(config)
    dispatcher = resolve_dispatcher(parallelism.moe_token_dispatcher_type,
                                    getattr(config, "moe_token_dispatcher_type", None))
    stage_ranks = dims.world_size // dims.pp
    check_zero_bubble_reshard(parallelism, layout.schedule, stage_ranks)
    zero_bubble_fsdp = layout.schedule in SPLIT_BACKWARD and stage_ranks > 1
    if layout.schedule in SPLIT_BACKWARD and config.torch_compile is not False:
        # torch's input-gradient pass keeps the graph for the weight-gradient pass (retain_graph),
        # which compiled backwards refuse while AOT autograd donates their saved buffers
        torch._functorch.config.donated_buffer = False
    apply_tp(model, dims)
    apply_ep(model, dims, dispatcher)
    apply_cp(model, dims, parallelism)
    plan = apply_recompute_step(model, recompute, recompute_comm, dims)
    container, parts = split_model(model, layout, dims.mesh("pp").get_local_rank(), stage_ranks)
    # One rank per stage shards nothing and reduces nothing: like one process, no FSDP.
    if stage_ranks > 1:
        for part in parts:
            apply_fsdp(part, dims, config, parallelism, reduce_in_fp32, recompute_plan=plan)
            if zero_bubble_fsdp:
                # Zero-bubble schedules split the backward: the input-gradient pass runs first, and
                # the weight-gradient pass (torch's stage_backward_weight) later takes the gradients
                # w.r.t. the parameters registered on the stage at that moment. Resharding after
                # forward would put the sharded parameters back there, so the all-gathered copies
                # the graph used would get the gradients and lose them. Kept gathered from forward
                # to the end of the step (ZeRO-2 for parameters); torch's REDUCE_GRAD action
                # reduce-scatters the gradients and reshards once per step.
                part.set_reshard_after_forward(False)
    apply_compile(container)    # the stages share the model's hooks
    return container, parts


# ----------------------------------------------------------------------------------------------
# planning: per-stage bytes, in-flight micro-batches, bubble
# ----------------------------------------------------------------------------------------------
def stage_of_parameter(name: str, layout: PipelineLayout, num_layers: int) -> list[int]:
    """Stages holding parameter ``name`` (a full-model name): the embedding is on the first stage
    (and the last with MTP, see :func:`plan_stages`), norm/head/MTP on the last."""
    last = layout.num_stages - 1
    if name.startswith("layers."):
        i = int(name.split(".")[1])
        return [s for s, (a, b) in enumerate(layout.ranges) if a <= i < b]
    if name.startswith(("embed_tokens.", "position_embeddings.")):
        return [0]
    return [last]


def in_flight_microbatches(layout: PipelineLayout, rank: int, A: int) -> int:
    """Micro-batch stage chunks whose activations a rank holds at its peak, from the order the schedule
    runs its actions (:func:`lit_moe.strategies.activation_memory.peak_in_flight`: a forward adds a
    chunk, a full backward or a weight-gradient step releases it): GPipe keeps all A; 1F1B keeps P - r
    (its warm-up); interleaved 1F1B (P - r - 1)·2 + (V - 1)·P + 1 (Megatron's warm-up); the
    zero-bubble schedules as torch orders them."""
    from lit_moe.strategies.activation_memory import peak_in_flight

    return peak_in_flight(layout, rank, A, {s: 1 for s in range(layout.num_stages)})[1]


def bubble_fraction(layout: PipelineLayout, A: int) -> float:
    """Idle share of a rank's step with equal forward/backward times: (P-1)/V / (A + (P-1)/V)
    (GPipe and 1F1B with V = 1; Megatron's interleaved bound); zero-bubble schedules fill it with
    weight-gradient work, reported as 0 (ideal: their bound needs F = B = W)."""
    if layout.schedule in SPLIT_BACKWARD:
        return 0.0
    idle = (layout.pp - 1) / layout.interleave
    return idle / (A + idle)


def parameters_of_ranks(layout: PipelineLayout, names: Any, num_layers: int, has_mtp: bool) -> list[set[str]]:
    """The full-model parameter names each pipeline rank holds (its stages' parameters; with MTP
    the embedding is on the first and the last stage)."""
    held: list[set[str]] = [set() for _ in range(layout.pp)]
    for name in names:
        stages = stage_of_parameter(name, layout, num_layers)
        if has_mtp and name.startswith(("embed_tokens.", "position_embeddings.")):
            stages = sorted({0, layout.num_stages - 1})
        for r in {layout.rank_of(s) for s in stages}:
            held[r].add(name)
    return held


def plan_stages(layout: PipelineLayout, local_bytes: dict[str, int], num_layers: int, has_mtp: bool,
                A: int) -> list[str]:
    """``lit_moe plan`` lines for a pipeline: per rank, the bytes of the parameters its stages hold
    (``local_bytes``: parameter name → this layout's local shard bytes), in-flight micro-batches and
    the bubble fraction of the schedule."""
    held = parameters_of_ranks(layout, local_bytes, num_layers, has_mtp)
    per_rank = [sum(local_bytes[n] for n in names) for names in held]
    lines = layout.describe()
    for r in range(layout.pp):
        lines.append(f"  pipeline rank {r}: stages {layout.stages_of(r)}, parameters {per_rank[r]} bytes per rank, "
                     f"in flight {in_flight_microbatches(layout, r, A)} micro-batch stage chunks")
    lines.append(f"  bubble fraction {bubble_fraction(layout, A):.3f} with {A} micro-batches")
    return lines


# ----------------------------------------------------------------------------------------------
# running a step
# ----------------------------------------------------------------------------------------------
def stage_hidden_shape(config: Any, rows: int, seq: int, seq_divisor: int) -> tuple[int, ...]:
    """What a stage boundary carries: ``[rows, seq / seq_divisor, hidden]``, or with mHC
    (``enable_hyper_connections``) the residual streams ``[rows, seq / seq_divisor, hc_mult, hidden]``."""
    streams = (config.hc_mult,) if getattr(config, "enable_hyper_connections", False) else ()
    return (rows, seq // seq_divisor, *streams, config.hidden_size)


def _schedule_class(name: str):
    from torch.distributed import pipelining as pl

    return {"1f1b": pl.Schedule1F1B, "gpipe": pl.ScheduleGPipe,
            "interleaved_1f1b": pl.ScheduleInterleaved1F1B,
            "interleaved_zb": pl.ScheduleInterleavedZeroBubble,
            "zbv": pl.ScheduleZBVZeroBubble, "dualpipev": pl.ScheduleDualPipeV}[name]


class PipelineRunner:
    """This rank's stages and the schedule that runs A micro-batches through them.

    Args:
        container, parts: from :func:`split_model` (after parallelisation and materialisation).
        layout: the stage layout.
        pp_group: the ranks of one pipeline (same position in every other dimension).
        embedding_group: first and last pipeline rank of this pipeline (MTP's embedding copy), or None.
        accumulation_steps: A, micro-batches per optimizer step (MindFormers writes it into
            ``pipeline_parallel_microbatch_size``).
        micro_batch: ``(rows, sequence length)`` of one micro-batch.
        seq_divisor: the hidden state between stages holds ``sequence / seq_divisor`` positions
            (tensor-parallel sequence split · context-parallel chunks).

    The stages' input and output shapes are given to ``PipelineStage`` up front (its static mode):
    its run-time inference would run an extra forward and backward on uninitialised tensors, which
    would count tokens for the expert bias and run every collective of the stage.
    """

    def __init__(self, container: DeepseekV3Stage, parts: list[DeepseekV3Stage], layout: PipelineLayout,
                 pp_group, device: torch.device, accumulation_steps: int, micro_batch: tuple[int, int],
                 seq_divisor: int = 1, embedding_group: Optional[dist.ProcessGroup] = None) -> None:
        from torch.distributed.pipelining import PipelineStage

        layout.check_microbatches(accumulation_steps)
        self.container, self.parts, self.layout = container, parts, layout
        self.pp_group, self.embedding_group = pp_group, embedding_group
        self.accumulation_steps = A = int(accumulation_steps)
        rank = dist.get_rank(pp_group)
        b, S = micro_batch
        cfg = container.config
        meta = torch.device("meta")
        hidden = torch.empty(stage_hidden_shape(cfg, b, S, seq_divisor), dtype=container.compute_dtype,
                             device=meta, requires_grad=True)
        ids = torch.empty(b, S, dtype=torch.long, device=meta)
        losses = torch.empty(3, dtype=torch.float32, device=meta, requires_grad=True)
        stages = [PipelineStage(part, s, layout.num_stages, device, group=pp_group,
                                input_args=ids if s == 0 else hidden,
                                output_args=losses if s == layout.num_stages - 1 else hidden)
                  for part, s in zip(parts, layout.stages_of(rank))]
        for part in parts:
            part.aux_grad_scale = 1.0 / A
        cls = _schedule_class(layout.schedule)
        loss_fn = _objective(A)
        if layout.multi_stage:
            self.schedule = cls(stages, n_microbatches=A, loss_fn=loss_fn, scale_grads=False)
        else:
            self.schedule = cls(stages[0], n_microbatches=A, loss_fn=loss_fn, scale_grads=False)

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward and backward of one optimizer step's ``A`` micro-batches (``batch``: them
        concatenated along dim 0). Returns ``[loss, aux_loss, mtp_loss, indexer_loss]`` of the step (each the mean
        over micro-batches), the same on every pipeline rank (the last stage's loss and MTP, the
        aux losses of all stages); :attr:`micro_losses` then holds the last stage's main loss of
        each micro-batch, also on every pipeline rank."""
        for part in self.parts:
            part.step_stats.clear()
            part.moe_aux_sum = None
        batch = {k: v for k, v in batch.items() if v is not None}
        self.schedule.step(batch["input_ids"], target=batch["input_ids"], **batch)
        self.sync_embedding_grads()
        return self.step_losses()

    def step_losses(self) -> torch.Tensor:
        # one all-reduce over the pipeline: [loss, aux, mtp, indexer] sums, then the per-micro main losses
        A = self.accumulation_steps
        device = _local(next(self.container.parameters())).device
        vec = torch.zeros(4 + A, dtype=torch.float32, device=device)
        for part in self.parts:
            for s in part.step_stats:
                vec[:4] += s.to(device)
            if part.is_last:
                vec[4:] = torch.stack([s[0] for s in part.step_stats]).to(device)
        dist.all_reduce(vec, group=self.pp_group)
        self.micro_losses = vec[4:].cpu()
        return vec[:4] / A

    def sync_embedding_grads(self) -> None:
        """Sum the gradients of the embedding copies of the first and the last stage (MTP)."""
        if self.embedding_group is None:
            return
        c = self.container
        if not (c.is_first or c.is_last) or c.embed_tokens is None:
            return
        for p in _embedding_params(c):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(_local(p.grad), group=self.embedding_group)


@dataclass
class PipelineStepRecord:
    """One step's losses as the training step keeps them (the same on every rank of a pipeline)."""

    losses: torch.Tensor            # [loss, aux_loss, mtp_loss, indexer_loss], each the mean over micro-batches (fp64)
    micro_losses: list[float]       # main loss of each micro-batch / A
    moe_aux: Optional[torch.Tensor]  # this rank's MoE layers: balancing loss summed over micro-batches
    has_aux: bool
    has_mtp: bool
    has_indexer: bool = False


class PipelineParallel:
    """What the strategy keeps for a pipeline run and the training step calls: this rank's stages,
    the schedule (built at the first step, when the micro-batch shape is known), the stage-spanning
    gradient norm and the per-layer balancing losses of the step.

    Built by :meth:`build` from the (meta) model; ``container`` is what the LightningModule holds
    as its model (every local parameter under its global name)."""

    def __init__(self, dims, layout: PipelineLayout, container: DeepseekV3Stage, parts: list[DeepseekV3Stage],
                 embedding_group_: Optional[dist.ProcessGroup]) -> None:
        self.dims, self.layout, self.container, self.parts = dims, layout, container, parts
        self.embedding_group = embedding_group_
        self.runner: Optional[PipelineRunner] = None

    @classmethod
    def build(cls, model: DeepseekV3ForCausalLM, dims, parallelism: Any, recompute: Any = None,
              recompute_comm: Any = None, model_config: Any = None, reduce_in_fp32: bool = True
              ) -> "PipelineParallel":
        config = model_config if model_config is not None else model.config
        layout = PipelineLayout.from_config(parallelism, config.num_hidden_layers)
        container, parts = parallelize_pipeline(model, dims, layout, parallelism, recompute, recompute_comm,
                                                config, reduce_in_fp32)
        rest = dims.world_size // dims.pp   # the world mesh is [pp, everything else], row-major
        pipelines = [[p * rest + j for p in range(dims.pp)] for j in range(rest)]
        group = embedding_group(layout, pipelines, config.num_nextn_predict_layers > 0)
        return cls(dims, layout, container, parts, group)

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Run the schedule over the step's micro-batches; ``[loss, aux, mtp, indexer]`` means (every rank)."""
        A = len(micro_batches)
        first = micro_batches[0]["input_ids"]
        if self.runner is None or self.runner.accumulation_steps != A:
            self.runner = PipelineRunner(self.container, self.parts, self.layout, self.dims.mesh("pp").get_group(),
                                         first.device, A, micro_batch=tuple(first.shape),
                                         seq_divisor=self.dims.tp * self.dims.cp,
                                         embedding_group=self.embedding_group)
        keys = [k for k, v in micro_batches[0].items() if torch.is_tensor(v)]
        batch = {k: torch.cat([b[k] for b in micro_batches]) for k in keys}
        return self.runner.step(batch)

    def forward_backward_record(self, micro_batches: list[dict[str, torch.Tensor]]) -> "PipelineStepRecord":
        """:meth:`forward_backward`, and what the training step records of it."""
        A = len(micro_batches)
        losses = self.forward_backward(micro_batches).detach().double().cpu()
        c = self.container.config
        return PipelineStepRecord(
            losses=losses, micro_losses=[float(x) / A for x in self.runner.micro_losses],
            moe_aux=self.moe_aux_sum(),
            has_aux=any(c.is_moe_layer(i) for i in range(c.num_hidden_layers)),
            has_mtp=c.num_nextn_predict_layers > 0,
            has_indexer=bool(getattr(c, "sparse_attention", False) and getattr(c, "dsa_indexer_loss_coeff", None)))

    def moe_aux_sum(self) -> Optional[torch.Tensor]:
        """This step's balancing loss per MoE layer of the container (summed over micro-batches)."""
        layers = self.container.moe_layers()
        if not layers:
            return None
        out = torch.zeros(len(layers), dtype=torch.float32, device=_local(layers[0].tokens_per_expert).device)
        index = {id(m): i for i, m in enumerate(layers)}
        for part in self.parts:
            if part.moe_aux_sum is None:
                continue
            for m, v in zip(part._main_moe + part._mtp_moe, part.moe_aux_sum):
                out[index[id(m)]] += v.to(out.device)
        return out

    # -- MoE metrics of every stage ---------------------------------------------------------
    def moe_block_ids(self) -> list[int]:
        """Block ids of every MoE layer of the whole model (decoder layers, then MTP layers), in the
        order one process's ``model.moe_layers()`` has them."""
        c = self.container.config
        return [i for i in range(c.total_layers) if c.is_moe_layer(i)]

    def local_moe_block_ids(self) -> list[int]:
        """Block ids of this rank's MoE layers, in ``container.moe_layers()`` order."""
        return [i for i, block in zip(self.container.block_ids(), self.container.blocks()) if _is_moe(block.mlp)]

    def gather_moe_stats(self, moe: Any, device: torch.device) -> Any:
        """The whole model's :class:`~lit_moe.step.MoEStepStats` from every pipeline rank's ``moe``
        (its own MoE layers; None for a rank without any), rows in :meth:`moe_block_ids` order: what
        one process reports. A collective over the pipeline group (every rank calls it, on log steps
        only); the stages hold disjoint layers, so a sum of zero-padded rows is the gather. float64:
        token counts and fp32 biases pass exactly."""
        from lit_moe.step import MoEStepStats

        c = self.container.config
        ids = self.moe_block_ids()
        E = c.n_routed_experts
        has_aux = float(c.moe_aux_loss_coeff or 0.0) > 0
        # per row: tokens [E], bias [E], aux, dropped, assigned
        table = torch.zeros(len(ids), 2 * E + 3, dtype=torch.float64, device=device)
        if moe is not None:
            rows = [ids.index(i) for i in self.local_moe_block_ids()]
            local = torch.cat([moe.tokens_per_expert.double(), moe.expert_bias.double(),
                               (moe.aux_loss.double() if moe.aux_loss is not None
                                else torch.zeros(len(rows), dtype=torch.float64))[:, None],
                               moe.dropped.double()[:, None], moe.assigned.double()[:, None]], dim=1)
            table[rows] = local.to(device)
        dist.all_reduce(table, group=self.dims.mesh("pp").get_group())
        table = table.cpu()
        return MoEStepStats(tokens_per_expert=table[:, :E].float(), aux_loss=table[:, 2 * E] if has_aux else None,
                            expert_bias=table[:, E:2 * E].float(), dropped=table[:, 2 * E + 1].float(),
                            assigned=table[:, 2 * E + 2].float())

    def embedding_grad_norm(self) -> tuple[torch.Tensor, torch.Tensor]:
        """L2 norm of the input-embedding gradient (the first stage's; the last stage's MTP copy
        holds the same summed gradient) and 1.0 when there is one (0.0 for a frozen embedding), as
        device tensors, the same on every rank (no host sync). Every rank calls it: the stages
        without the embedding take part in the all-reduce over the pipeline that hands the value on."""
        from lit_moe.strategies.clip import global_grad_norm

        c = self.container
        device = _local(next(c.parameters())).device
        vec = torch.zeros(2, dtype=torch.float32, device=device)   # [norm², has a gradient]
        weight = c.embed_tokens.weight if c.is_first and c.embed_tokens is not None else None
        if weight is not None and weight.grad is not None:
            vec[0] = global_grad_norm([weight], group=self.dims.mesh("stage").get_group()).pow(2).to(device)
            vec[1] = 1.0
        dist.all_reduce(vec, group=self.dims.mesh("pp").get_group())
        return vec[0].sqrt(), vec[1]

    # -- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Mean main (language-model) loss of ``micro_batches`` through every stage, without
        gradients (fp64 0-d tensor, the same on every pipeline rank); see :func:`forward_only`."""
        return forward_only(self.parts, self.layout, self.dims.mesh("pp").get_group(), micro_batches,
                            seq_divisor=self.dims.tp * self.dims.cp)

    def grad_norm(self, params: Sequence[nn.Parameter]) -> torch.Tensor:
        # looked up now: materialising the container (to_empty) replaced its parameter objects
        duplicates = embedding_duplicates(self.container, self.layout, len(self.container.mtp) > 0)
        return pipeline_grad_norm(params, self.dims.mesh("stage").get_group(), self.dims.mesh("pp").get_group(),
                                  duplicates)


@torch.no_grad()
def forward_only(parts: list[DeepseekV3Stage], layout: PipelineLayout, pp_group, micro_batches: list[dict],
                 seq_divisor: int = 1) -> torch.Tensor:
    """A no-grad forward of ``micro_batches`` through the stages, in eval mode; returns the mean of
    the last stage's main loss over them (fp64, 0-d), the same on every rank of ``pp_group``.

    Not a ``torch.distributed.pipelining`` schedule: its ``eval()`` reuses the training schedule,
    whose micro-batch count is A and whose stage buffers it would re-initialise on each switch
    between training and evaluation. Here every rank runs its stages in stage order, each over all
    micro-batches (GPipe's forward: stage s + 1 starts on a micro-batch as soon as stage s sent
    it), receiving the hidden state from the previous stage's rank and sending its output to the
    next (tag = receiving stage, so the messages of a rank's several stages cannot cross), any
    placement (looped or V). The stages' per-step records (losses, balancing losses) are left as
    the training step made them."""
    me = dist.get_rank(pp_group)
    last = layout.num_stages - 1
    first_ids = micro_batches[0]["input_ids"]
    device = first_ids.device
    total = torch.zeros((), dtype=torch.float64, device=device)
    batches = [{k: v for k, v in b.items() if torch.is_tensor(v)} for b in micro_batches]
    kept = [(part.training, list(part.step_stats), part.moe_aux_sum) for part in parts]
    handed: dict[tuple[int, int], torch.Tensor] = {}   # (stage, micro-batch) -> input from a local stage
    sends = []
    try:
        for part in parts:
            part.eval()
        for s, part in zip(layout.stages_of(me), parts):
            for k, batch in enumerate(batches):
                if s == 0:
                    x = batch["input_ids"]
                elif layout.rank_of(s - 1) == me:
                    x = handed.pop((s, k))
                else:
                    b, S = batch["input_ids"].shape
                    x = torch.empty(stage_hidden_shape(part.config, b, S, seq_divisor), dtype=part.compute_dtype,
                                    device=device)
                    dist.recv(x, group=pp_group, group_src=layout.rank_of(s - 1), tag=s)
                out = part(x, **batch)
                if s == last:
                    total += out[0].double()
                elif layout.rank_of(s + 1) == me:
                    handed[(s + 1, k)] = out
                else:
                    out = out.contiguous()
                    sends.append((dist.isend(out, group=pp_group, group_dst=layout.rank_of(s + 1), tag=s + 1), out))
        for work, _ in sends:
            work.wait()
    finally:
        for part, (training, stats, aux) in zip(parts, kept):
            part.train(training)
            part.step_stats[:] = stats
            part.moe_aux_sum = aux
    # only the last stage's rank holds the sum: the all-reduce hands it to every pipeline rank
    dist.all_reduce(total, group=pp_group)
    return total / len(micro_batches)


def _embedding_params(model: nn.Module) -> list[nn.Parameter]:
    mods = [model.embed_tokens, getattr(model, "position_embeddings", None)]
    return [p for m in mods if m is not None for p in m.parameters()]


def _objective(A: int):
    def loss_fn(output: torch.Tensor, target: Any) -> torch.Tensor:
        return output.sum() / A
    return loss_fn


def embedding_duplicates(container: DeepseekV3Stage, layout: PipelineLayout, has_mtp: bool) -> set[int]:
    """ids of parameters that are a copy of another stage's (the last stage's embedding with MTP):
    left out of the global gradient norm so every value counts once."""
    if not has_mtp or not container.is_last or container.is_first:
        return set()
    return {id(p) for p in _embedding_params(container)}


def pipeline_grad_norm(params: Sequence[nn.Parameter], stage_group, pp_group,
                       duplicates: set[int] = frozenset()) -> torch.Tensor:
    """Global L2 norm over every stage: each stage's norm over its own ranks (``stage_group``:
    the non-pipeline ranks of this stage), squares summed over the pipeline."""
    from lit_moe.strategies.clip import global_grad_norm

    own = [p for p in params if id(p) not in duplicates]
    sq = global_grad_norm(own, group=stage_group).pow(2)
    dist.all_reduce(sq, group=pp_group)
    return sq.sqrt()


def embedding_group(layout: PipelineLayout, pipelines: Sequence[Sequence[int]], has_mtp: bool):
    """With MTP: a group of the ranks holding the first and the last stage, for every pipeline
    (``pipelines``: the global ranks of each, in pipeline-rank order; every rank takes part in
    creating all groups). Returns this rank's group, or None (no MTP, or both stages on one rank,
    where they share one embedding module)."""
    first, last = layout.rank_of(0), layout.rank_of(layout.num_stages - 1)
    if not has_mtp or first == last:
        return None
    mine = None
    me = dist.get_rank()
    for ranks in pipelines:
        pair = [ranks[first], ranks[last]]
        group = dist.new_group(pair)
        if me in pair:
            mine = group
    return mine


__all__ = ["AuxLossBackward", "DeepseekV3Stage", "PipelineError", "PipelineLayout", "PipelineParallel", "PipelineRunner",
           "SCHEDULES", "embedding_duplicates", "embedding_group", "forward_only", "pipeline_grad_norm", "resolve_schedule",
           "split_layers", "split_model"]
