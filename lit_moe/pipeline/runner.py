"""Running a pipeline step: torch's schedule over this rank's stages (:class:`PipelineRunner`),
evaluation through the stages (:func:`forward_only`), the stage-spanning gradient norm, MTP's
embedding group, and :class:`PipelineParallel`: what the strategy keeps and answers the step, the
callbacks and the checkpoints with (:class:`lit_moe.step.StepStrategy`)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lit_moe.model.transformer import DeepseekV3ForCausalLM
from lit_moe.pipeline.layout import PipelineLayout, schedule_class
from lit_moe.pipeline.stage import DeepseekV3Stage, is_moe, parallelize_pipeline
from lit_moe.runtime.distributed import local_tensor
from lit_moe.step import MoEStepStats, StepRecord


def stage_hidden_shape(config: Any, rows: int, seq: int, seq_divisor: int) -> tuple[int, ...]:
    """What a stage boundary carries: ``[rows, seq / seq_divisor, hidden]``, or with mHC
    (``enable_hyper_connections``) the residual streams ``[rows, seq / seq_divisor, hc_mult, hidden]``."""
    streams = (config.hc_mult,) if getattr(config, "enable_hyper_connections", False) else ()
    return (rows, seq // seq_divisor, *streams, config.hidden_size)


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
        cls = schedule_class(layout.schedule)
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
        device = local_tensor(next(self.container.parameters())).device
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
            if not p.requires_grad:   # frozen (LoRA, DeepSeek-V3.2's dense warm-up): a zero gradient
                continue              # would let weight decay move it
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(local_tensor(p.grad), group=self.embedding_group)


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
              recompute_comm: Any = None, model_config: Any = None, reduce_in_fp32: bool = True, run: Any = None
              ) -> "PipelineParallel":
        """``run``: the run's resolved :class:`~lit_moe.strategies.run_shape.RunShape`, whose layout applies."""
        config = model_config if model_config is not None else model.config
        layout = run.pipeline if run is not None else PipelineLayout.from_config(parallelism, config.num_hidden_layers)
        container, parts = parallelize_pipeline(model, dims, layout, parallelism, recompute, recompute_comm,
                                                config, reduce_in_fp32, run=run)
        rest = dims.world_size // dims.pp   # the world mesh is [pp, everything else], row-major
        pipelines = [[p * rest + j for p in range(dims.pp)] for j in range(rest)]
        group = embedding_group(layout, pipelines, config.num_nextn_predict_layers > 0, dims.collective_timeout)
        return cls(dims, layout, container, parts, group)

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Run the schedule over the step's micro-batches; ``[loss, aux, mtp]`` means (every rank)."""
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

    def forward_backward_record(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepRecord:
        """:meth:`forward_backward`, and what the training step records of it."""
        A = len(micro_batches)
        losses = self.forward_backward(micro_batches).detach().double().cpu()
        c = self.container.config
        return StepRecord(
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
        out = torch.zeros(len(layers), dtype=torch.float32, device=local_tensor(layers[0].tokens_per_expert).device)
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
        return [i for i, block in zip(self.container.block_ids(), self.container.blocks()) if is_moe(block.mlp)]

    def gather_moe_stats(self, moe: Any, device: torch.device) -> Any:
        """The whole model's :class:`~lit_moe.step.MoEStepStats` from every pipeline rank's ``moe``
        (its own MoE layers; None for a rank without any), rows in :meth:`moe_block_ids` order: what
        one process reports. A collective over the pipeline group (every rank calls it, once per
        step, on the device); the stages hold disjoint layers, so a sum of zero-padded rows is the
        gather. float64: token counts and fp32 biases pass exactly. None for a model without MoE layers."""
        c = self.container.config
        ids = self.moe_block_ids()
        if not ids:
            return None
        E = c.n_routed_experts
        has_aux = float(c.moe_aux_loss_coeff or 0.0) > 0
        # per row: tokens [E], bias [E], aux, dropped, assigned
        table = torch.zeros(len(ids), 2 * E + 3, dtype=torch.float64, device=device)
        if moe is not None:
            rows = [ids.index(i) for i in self.local_moe_block_ids()]
            local = torch.cat([moe.tokens_per_expert.double(), moe.expert_bias.double(),
                               (moe.aux_loss.double() if moe.aux_loss is not None
                                else torch.zeros(len(rows), dtype=torch.float64,
                                                  device=moe.tokens_per_expert.device))[:, None],
                               moe.dropped.double()[:, None], moe.assigned.double()[:, None]], dim=1)
            table[rows] = local.to(device)
        dist.all_reduce(table, group=self.dims.mesh("pp").get_group())
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
        device = local_tensor(next(c.parameters())).device
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


def embedding_group(layout: PipelineLayout, pipelines: Sequence[Sequence[int]], has_mtp: bool,
                    timeout: Optional[timedelta] = None):
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
        group = dist.new_group(pair, timeout=timeout)
        if me in pair:
            mine = group
    return mine
