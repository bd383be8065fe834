"""A pipeline stage: the parts of the model one stage (or, as a container, one rank) holds, run by
the model's own forward, and the split of a parallelized model into this rank's stages.

Every micro-batch's objective is ``(loss + aux_loss + mtp_loss) / A`` as on one process. The MoE
balancing losses of a stage that is not the last reach the backward through
:class:`AuxLossBackward` (Megatron's ``MoEAuxLossAutoScaler``): identity on the hidden state
forward, the aux loss' gradient ``1/A`` injected backward. DeepSeek-V3.2's indexer losses
(``dsa_indexer_loss_coeff``) reach it the same way on every stage (the last too: injected at its
output), so the schedule's output stays ``[loss, aux_loss, mtp_loss]``; each stage records its
indexer losses beside them for the step's log.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lit_moe.model.indexer import LightningIndexer
from lit_moe.model.moe import MoE
from lit_moe.model.transformer import DeepseekV3ForCausalLM
from lit_moe.runtime.distributed import local_tensor
from lit_moe.pipeline.layout import (SPLIT_BACKWARD, PipelineLayout, StageParts, check_shared_embedding,
                                     check_zero_bubble_reshard, stage_parts)


def is_moe(module: nn.Module) -> bool:
    return isinstance(module, MoE)


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
    one rank) holds, as ``parts`` (:func:`~lit_moe.pipeline.layout.stage_parts`) says: its decoder
    layers (names keep their global index: ``layers.{i}.…``), the embedding, and with the last stage
    the final norm, head and MTP layers. Shares the modules of ``model`` (no copy): build it on the
    meta device.

    ``forward(x, input_ids, labels, …)`` (the call torch's ``PipelineStage`` makes) runs the model's
    own forward on the parts the stage holds: ``x`` is the token ids on the first stage and the
    hidden state elsewhere; the other tensors are the micro-batch's (every stage receives them). A
    stage that is not the last returns the hidden state; the last returns ``[loss, aux_loss, mtp_loss]``.
    It keeps the step's records the pipeline reads (per micro-batch losses, per layer balancing losses).
    """

    def __init__(self, model: DeepseekV3ForCausalLM, parts: StageParts):
        nn.Module.__init__(self)
        self.config, self.compute_dtype = model.config, model.compute_dtype
        # what tensor and context parallelism filled in (loss, MTP shift, input sharding): the same object
        self.hooks = model.hooks
        self.is_first, self.is_last = parts.first, parts.last
        self.layer_ids = list(parts.layers)
        self.embed_tokens = model.embed_tokens if parts.embedding else None
        self.position_embeddings = model.position_embeddings if parts.embedding else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in self.layer_ids})
        self.hc_head = model.hc_head if self.is_last else None   # mHC: the streams' collapse (or None)
        self.norm = model.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self.mtp = model.mtp if self.is_last else nn.ModuleList()
        self._main_moe = [m for layer in self.layers.values() for m in layer.modules() if is_moe(m)]
        self._mtp_moe = [m for layer in self.mtp for m in layer.modules() if is_moe(m)]
        self._indexers = [m for m in self.modules() if isinstance(m, LightningIndexer)]
        self.aux_grad_scale = 1.0   # backward weight of the balancing losses (1/A, set per step)
        self.step_stats: list[torch.Tensor] = []   # per micro-batch [loss, aux, mtp, indexer] (detached)
        self.moe_aux_sum: Optional[torch.Tensor] = None   # per local MoE layer, summed over micro-batches

    def block_ids(self) -> list[int]:
        """Global layer ids of :meth:`blocks` (MTP layers follow the decoder layers)."""
        L = self.config.num_hidden_layers
        return [*self.layer_ids, *(L + k for k in range(len(self.mtp)))]

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                actual_seq_len: Optional[torch.Tensor] = None) -> torch.Tensor:
        # torch's PipelineStage calls the stage with its input first (the token ids on the first
        # stage, the previous stage's hidden state elsewhere) and the micro-batch's tensors; the
        # model's own forward runs the parts this stage holds
        if self.is_last and labels is None:
            raise ValueError("the last pipeline stage needs labels")
        out = super().forward(input_ids, labels, loss_mask, position_ids, attention_mask, actual_seq_len,
                              hidden_states=None if self.is_first else x)
        self._collect_moe_aux(self._main_moe + self._mtp_moe)
        aux, indexer = out.aux_loss, out.indexer_loss
        if not self.is_last:
            h = out.hidden_states
            if (aux is not None or indexer is not None) and torch.is_grad_enabled():
                zero = h.new_zeros((), dtype=torch.float32)
                self.step_stats.append(torch.stack([zero, zero if aux is None else aux.detach().float(), zero,
                                                    zero if indexer is None else indexer.detach().float()]))
                for term in (aux, indexer):
                    if term is not None:
                        h = AuxLossBackward.apply(h, term, self.aux_grad_scale)
            return h
        # the schedule's output stays [loss, aux, mtp]; the indexer losses (this stage's decoder and
        # MTP layers') reach the backward at it and the step's log beside it
        losses = torch.stack([out.loss.float(), aux.float(), out.mtp_loss.float()])
        self.step_stats.append(torch.cat([losses.detach(), (indexer.detach().float() if indexer is not None
                                                            else losses.new_zeros(()))[None]]))
        if indexer is not None and torch.is_grad_enabled():
            losses = AuxLossBackward.apply(losses, indexer, self.aux_grad_scale)
        return losses

    def _collect_moe_aux(self, moes: list) -> None:
        if not moes:
            return
        own = self._main_moe + self._mtp_moe
        vals = torch.zeros(len(own), dtype=torch.float32, device=local_tensor(own[0].tokens_per_expert).device)
        for m in moes:
            if "aux_loss" in m.last_stats:
                vals[own.index(m)] = local_tensor(m.last_stats["aux_loss"]).detach().float()
        self.moe_aux_sum = vals if self.moe_aux_sum is None else self.moe_aux_sum + vals


def split_model(model: DeepseekV3ForCausalLM, layout: PipelineLayout, pp_rank: int, stage_ranks: int = 1
                ) -> tuple[DeepseekV3Stage, list[DeepseekV3Stage]]:
    """(this rank's container: every local part under its global names, the per-stage modules).

    The container is what the optimizer, checkpoints and the training step see; the stage modules
    share its sub-modules and are what ``PipelineStage`` runs."""
    stages = layout.stages_of(pp_rank)
    has_mtp = len(model.mtp) > 0
    check_shared_embedding(layout, len(model.mtp), stage_ranks)
    parts = [DeepseekV3Stage(model, stage_parts(layout, [s], has_mtp)) for s in stages]
    container = DeepseekV3Stage(model, stage_parts(layout, stages, has_mtp))
    return container, parts


def parallelize_pipeline(model: DeepseekV3ForCausalLM, dims, layout: PipelineLayout, parallelism: Any = None,
                         recompute: Any = None, recompute_comm: Any = None, model_config: Any = None,
                         reduce_in_fp32: bool = True, run: Any = None) -> tuple[DeepseekV3Stage, list[DeepseekV3Stage]]:
    """Tensor, expert and context parallelism and recompute on the whole (meta) model, so layer ids
    and module paths stay global; then this rank's stages, each its own FSDP2 root on the stage's
    dense and expert meshes (when a stage has more than one rank). Returns :func:`split_model`'s (container, stage modules).
    ``run``: the run's resolved :class:`~lit_moe.strategies.run_shape.RunShape` (as in ``parallelize``)."""
    from lit_moe.config import ParallelismConfig
    from lit_moe.strategies.parallelize import (apply_compile, apply_cp, apply_ep, apply_fsdp, apply_recompute_step,
                                                apply_tp, resolved_steps)

    parallelism = parallelism if parallelism is not None else ParallelismConfig()
    config = model_config if model_config is not None else model.config
    dispatcher, recompute_plan = resolved_steps(dims, parallelism, config, recompute, recompute_comm, run)
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
    plan = apply_recompute_step(model, recompute_plan)
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
