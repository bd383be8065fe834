"""Tensor parallelism with sequence parallelism (Megatron layout) for MLA, dense MLP, shared experts,
embedding and head.

Between the layers' sub-blocks the residual stream is split along the sequence (``[B, S/T, H]``,
"sequence parallel"). Each tensor-parallel block all-gathers the sequence on entry and
reduce-scatters its partial output on exit:

* MLA: ``q_proj``/``q_b_proj`` and ``kv_b_proj`` are column-parallel (heads split), ``o_proj``
  row-parallel; the low-rank ``q_a_proj``/``kv_a_proj_with_mqa`` and their norms are replicated.
  DeepSeek-V3.2's indexer is replicated and computed whole on every rank; its loss's target sums the
  attention over the heads of every rank (``hooks.head_sum``), so its gradient is whole on each rank
  (:func:`tp_indexer`).
  DeepSeek-V4's attention: ``q_b_proj``, the grouped ``o_a_proj`` (whole head groups per rank) and the
  per-head ``sinks`` split by heads, ``o_b_proj`` row-parallel; its one key/value head, compressors
  and indexer are replicated. Its mHC hyper-connections mix the streams of each token: they run on
  the sequence shard with replicated weights, like the norms.
  Grouped-query attention: ``q_proj``/``k_proj``/``v_proj`` (and their biases) column-parallel, each
  rank keeping whole key/value heads with their query groups; the per-head q/k norms are replicated.
* dense MLP and shared experts: ``gate_proj``/``up_proj`` column-parallel, ``down_proj`` row-parallel.
* embedding: vocabulary-parallel rows; each rank looks up its ids, the partial sums are
  reduce-scattered along the sequence.
* head: column-parallel over the vocabulary, on the all-gathered sequence. The loss is computed
  vocabulary-parallel (the model's ``hooks.per_token_loss``, see
  :func:`lit_moe.strategies.comm.vocab_parallel_cross_entropy`).

Decoding (``sequence_parallel=False``, :mod:`lit_moe.tools.predict`): one new token cannot be split along the
sequence, so the same shards run as plain tensor parallel: the blocks' entry gathers pass their input
through, their exit reduce-scatters all-reduce, and the head's vocabulary columns are all-gathered.

Every other parameter outside the routed experts (norms, router, low-rank projections, MTP
projections) becomes a ``Replicate`` DTensor on the tensor-parallel mesh whose gradient is
declared partial (:func:`lit_moe.strategies.hooks.use_local_params`). Parameters are sharded on the
meta device with :func:`distribute_param`, so nothing is allocated.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from lit_moe.strategies import comm
from lit_moe.strategies.hooks import around_forward, direct_dtensor_params, transform_output, use_local_params


def distribute_param(module: nn.Module, name: str, mesh, placements: Sequence) -> None:
    """Replace ``module.<name>`` by a DTensor with ``placements`` on ``mesh`` holding this rank's
    chunk (``torch.chunk`` semantics, as DTensor). Works on the meta device."""
    p = module._parameters[name]
    if p is None or isinstance(p, DTensor):
        return
    local = p.detach()
    coord = mesh.get_coordinate()
    for dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            n = mesh.size(dim)
            local = local.chunk(n, dim=placement.dim)[coord[dim]]
    dt = DTensor.from_local(local.contiguous(), mesh, list(placements),
                            run_check=False, shape=p.shape, stride=p.stride())
    module._parameters[name] = nn.Parameter(dt, requires_grad=p.requires_grad)


def _colwise(linear: nn.Module, mesh) -> None:
    distribute_param(linear, "weight", mesh, [Shard(0)])
    if linear.bias is not None:   # GQA's q/k/v biases follow their output rows
        distribute_param(linear, "bias", mesh, [Shard(0)])
    _shard_adapters(linear, mesh, "colwise")
    use_local_params(linear)


def _rowwise(linear: nn.Module, mesh) -> None:
    distribute_param(linear, "weight", mesh, [Shard(1)])
    _shard_adapters(linear, mesh, "rowwise")
    use_local_params(linear)


def _shard_adapters(linear: nn.Module, mesh, style: str) -> None:
    """LoRA layers (:class:`lit_moe.lora.LoRALinear`) name the adapter that is split with the base
    weight (``lora_b`` rows of a column-parallel layer, ``lora_a`` columns of a row-parallel one);
    the other adapter is replicated like every remaining parameter."""
    for name, dim in getattr(linear, "TP_ADAPTER_SHARDS", {}).get(style, {}).items():
        distribute_param(linear, name, mesh, [Shard(dim)])


def _whole(x):
    return x


def entry_gather(group, sequence_parallel: bool = True):
    """A tensor-parallel block's entry collective: all-gather the sequence shards (training), or
    nothing (decoding: every rank holds the whole sequence)."""
    return comm.CommStep(functools.partial(comm.all_gather, group=group, dim=1) if sequence_parallel else _whole)


def exit_reduce(group, sequence_parallel: bool = True):
    """A tensor-parallel block's exit collective over its partial sums: reduce-scatter along the
    sequence (training), or all-reduce (decoding)."""
    return comm.CommStep(functools.partial(comm.reduce_scatter, group=group, dim=1) if sequence_parallel
                         else functools.partial(comm.all_reduce, group=group))


def _sequence_parallel_block(block: nn.Module, group, sequence_parallel: bool = True) -> None:
    """All-gather the sequence on entry (first positional argument), reduce-scatter the partial
    output. Exposed as ``block.all_gather`` / ``block.reduce_scatter``, the block's communication
    steps that ``recompute_comm`` addresses by name (set here once, never swapped)."""
    block.all_gather = entry_gather(group, sequence_parallel)
    block.reduce_scatter = exit_reduce(group, sequence_parallel)

    def before(mod, args, kwargs):
        return (mod.all_gather(args[0]),) + tuple(args[1:]), kwargs, None

    def after(mod, output, state):
        return mod.reduce_scatter(output)

    around_forward(block, before, after)


# Per attention kind, the linears whose output rows are heads (column-parallel) and the one that sums
# the heads (row-parallel): MLA's, GQA's k/v heads, DeepSeek-V4's grouped output (o_a_proj is
# block-diagonal over o_groups groups of heads, so a rank keeps its heads' groups' rows, then o_b_proj
# sums the groups).
_HEAD_ROWS = ("q_proj", "q_b_proj", "kv_b_proj", "k_proj", "v_proj", "o_a_proj")
_HEAD_SUM = ("o_proj", "o_b_proj")
_PER_HEAD = ("sinks",)   # DeepSeek-V4's per-head sink logits follow the heads


def tp_attention(attn: nn.Module, mesh, sequence_parallel: bool = True) -> None:
    """Heads split over the tensor-parallel ranks; what the heads share (low-rank projections, one
    key/value head, DeepSeek-V4's compressors and indexer, whose selection has no gradient) stays
    replicated (:func:`replicate_remaining`) and is computed on the gathered sequence on every rank."""
    for name in _HEAD_ROWS:
        if hasattr(attn, name):
            _colwise(getattr(attn, name), mesh)
    for name in _HEAD_SUM:
        if hasattr(attn, name):
            _rowwise(getattr(attn, name), mesh)
    for name in _PER_HEAD:
        if name in attn._parameters:
            distribute_param(attn, name, mesh, [Shard(0)])
    _sequence_parallel_block(attn, mesh.get_group(), sequence_parallel)


def tp_indexer(indexer: nn.Module, mesh) -> None:
    """DeepSeek-V3.2's lightning indexer: replicated, and so is its whole computation (detached inputs
    of the gathered sequence, the target summed over every head by ``hooks.head_sum``), so each rank's
    gradient of the indexer loss is already the whole gradient: declared ``Replicate``, not ``Partial``
    (which would add the ranks' copies up, tensor_parallel times the gradient)."""
    for module in indexer.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                distribute_param(module, name, mesh, [Replicate()])
        if direct_dtensor_params(module):
            use_local_params(module, partial_replicated_grads=False)


def _head_sum(total: torch.Tensor, group) -> torch.Tensor:
    """The model's ``hooks.head_sum``: this rank's heads' sum → every head's (no autograd)."""
    total = total.clone()
    dist.all_reduce(total, group=group)
    return total


def tp_mlp(mlp: nn.Module, mesh, own_collectives: bool = True, sequence_parallel: bool = True) -> None:
    """Column/row-parallel MLP; with ``own_collectives`` it gathers and reduces itself (dense MLP),
    otherwise its output stays partial (shared experts inside a MoE layer)."""
    _colwise(mlp.gate_proj, mesh)
    _colwise(mlp.up_proj, mesh)
    _rowwise(mlp.down_proj, mesh)
    if own_collectives:
        _sequence_parallel_block(mlp, mesh.get_group(), sequence_parallel)


def tp_embedding(embedding: nn.Embedding, mesh, sequence_parallel: bool = True) -> None:
    """Vocabulary-parallel embedding whose output is the local sequence shard."""
    distribute_param(embedding, "weight", mesh, [Shard(0)])
    use_local_params(embedding)
    group = mesh.get_group()
    rank, n = mesh.get_local_rank(), mesh.size()
    per_rank = embedding.num_embeddings // n
    start, end = rank * per_rank, (rank + 1) * per_rank
    embedding.reduce_scatter = exit_reduce(group, sequence_parallel)

    def before(mod, args, kwargs):
        ids = args[0]
        inside = (ids >= start) & (ids < end)
        local_ids = torch.where(inside, ids - start, torch.zeros_like(ids))
        return (local_ids,) + tuple(args[1:]), kwargs, inside

    def after(mod, output, inside):
        output = output * inside.unsqueeze(-1).to(output.dtype)
        return mod.reduce_scatter(output)

    around_forward(embedding, before, after)


def tp_head(model: nn.Module, mesh, sequence_parallel: bool = True) -> None:
    """Column-parallel head over the vocabulary on the all-gathered sequence; the loss runs
    vocabulary-parallel on this rank's logit columns (training), or the columns are all-gathered
    (decoding, whose callers read the logits)."""
    head = model.lm_head
    _colwise(head, mesh)
    group = mesh.get_group()
    head.all_gather = entry_gather(group, sequence_parallel)
    around_forward(head, lambda mod, args, kwargs: ((mod.all_gather(args[0]),) + tuple(args[1:]), kwargs, None))
    if not sequence_parallel:
        transform_output(head, functools.partial(comm.all_gather, group=group, dim=-1))
        return
    vocab_start = mesh.get_local_rank() * (head.out_features // mesh.size())

    def vocab_parallel_ce(logits, labels):
        # ``logits`` are this rank's vocabulary columns
        return comm.vocab_parallel_cross_entropy(logits, labels, vocab_start, group)

    model.hooks.per_token_loss = vocab_parallel_ce


def replicate_remaining(model: nn.Module, mesh, skip: Sequence[nn.Module] = ()) -> None:
    """Every parameter not yet a DTensor (outside ``skip`` sub-trees) → ``Replicate`` on ``mesh``,
    computed locally with a partial gradient."""
    skipped = {id(m) for root in skip for m in root.modules()}
    for module in model.modules():
        if id(module) in skipped:
            continue
        names = [n for n, p in module._parameters.items() if p is not None and not isinstance(p, DTensor)]
        for name in names:
            distribute_param(module, name, mesh, [Replicate()])
        if any(isinstance(p, DTensor) for p in module._parameters.values()):
            use_local_params(module)


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool = True) -> None:
    """Shard the model for tensor + sequence parallelism on ``tp_mesh`` (size > 1); with
    ``sequence_parallel=False`` plain tensor parallel for decoding (module docstring)."""
    from lit_moe.model import MLP, MoE
    from lit_moe.model.indexer import LightningIndexer

    tp_embedding(model.embed_tokens, tp_mesh, sequence_parallel)
    experts = []
    for block in model.blocks():
        tp_attention(block.self_attention, tp_mesh, sequence_parallel)
        if isinstance(getattr(block.self_attention, "indexer", None), LightningIndexer):
            tp_indexer(block.self_attention.indexer, tp_mesh)
        mlp = block.mlp
        if isinstance(mlp, MoE):
            # gathered/scattered at the MoE boundary (expert_parallel.apply_moe_sequence_split)
            if mlp.shared_experts is not None:
                tp_mlp(mlp.shared_experts, tp_mesh, own_collectives=False)
            experts.append(mlp.experts)
        elif isinstance(mlp, MLP):
            tp_mlp(mlp, tp_mesh, own_collectives=True, sequence_parallel=sequence_parallel)
        else:  # pragma: no cover - the model contract has only these two
            raise TypeError(f"tensor parallel: unknown MLP type {type(mlp).__name__}")
    tp_head(model, tp_mesh, sequence_parallel)
    model.hooks.head_sum = functools.partial(_head_sum, group=tp_mesh.get_group())
    replicate_remaining(model, tp_mesh, skip=experts)


__all__ = ["apply_tensor_parallel", "distribute_param", "replicate_remaining"]
