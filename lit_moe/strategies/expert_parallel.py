"""MoE layers under tensor, context and expert parallelism.

**Whole tensor-parallel shard in the router.** Under tensor (sequence) parallelism a rank holds
``1/tp`` of its tokens between the layers, but routing is done once per token. So a MoE layer
all-gathers its input over the ``tp`` ranks (``mlp.router.all_gather``, MindFormers' name), routes
every token on every one of those ranks (identical results), and reduce-scatters its output back.
The work is not duplicated: the expert-sorted token rows are split evenly over the tp ranks, each
rank runs the experts on its slice only, and the partial outputs are summed by the reduce-scatter.
The shared experts are tensor-parallel (partial over tp); the balancing loss, computed identically
on the tp ranks, has its gradient scaled by 1/tp.

Context parallel ranks run the MoE layer on their own tokens only (routing, dispatch, experts and
shared experts); the statistics of the balancing loss are summed over the cp ranks of a sequence
(``context_parallel``), and the expert-bias token counts over dp × cp (the strategy's
``expert_count_group``).

**Expert parallel** (TorchTitan's ``ExpertParallel``): the stacked expert weights are ``Shard(0)``
DTensors on the ``ep`` mesh, and ``GroupedExperts.forward(x_sorted, num_tokens_per_expert)`` is
wrapped: before it, the rows are sent to the rank owning their expert (``alltoall``: one
variable-size all-to-all; ``allgather``: every rank gathers all rows and keeps its experts'), and
re-ordered expert-major; after it, the inverse. Experts (or whole ranks) that receive no rows run
on empty tensors.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from lit_moe.strategies import comm
from lit_moe.strategies.hooks import around_forward, transform_output
from lit_moe.strategies.tensor_parallel import distribute_param


# ----------------------------------------------------------------------------------------------
# gradient scaling
# ----------------------------------------------------------------------------------------------
class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity in forward; multiplies the gradient by ``scale``."""
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)


# ----------------------------------------------------------------------------------------------
# whole sequence in the MoE layer, token rows split over the cp·tp ranks
# ----------------------------------------------------------------------------------------------
def _slice_bounds(n: int, index: int, parts: int) -> tuple[int, int]:
    return (n * index) // parts, (n * (index + 1)) // parts


def _slice_counts(counts: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows per expert inside rows ``[start, end)`` of an expert-sorted table."""
    hi = torch.cumsum(counts, 0)
    lo = hi - counts
    return (torch.clamp(torch.minimum(hi, torch.full_like(hi, end)) - torch.maximum(lo, torch.full_like(lo, start)),
                        min=0)).to(counts.dtype)


def apply_moe_sequence_split(moe: nn.Module, tp_group: dist.ProcessGroup, sequence_parallel: bool = True) -> None:
    """Gather the tensor-parallel sequence shards into the MoE layer and split its expert rows
    (``sequence_parallel=False``, decoding: the whole sequence is there; the partial outputs are
    all-reduced)."""
    from lit_moe.strategies.tensor_parallel import entry_gather, exit_reduce

    parts = dist.get_world_size(tp_group)
    index = dist.get_rank(tp_group)
    moe.router.all_gather = entry_gather(tp_group, sequence_parallel)
    moe.reduce_scatter = exit_reduce(tp_group, sequence_parallel)

    def before(mod, args, kwargs):
        return (mod.router.all_gather(args[0]),) + tuple(args[1:]), kwargs, None

    def after(mod, output, state):
        if mod.aux_loss is not None:
            mod.aux_loss = scale_grad(mod.aux_loss, 1.0 / parts)
        return mod.reduce_scatter(output)

    around_forward(moe, before, after)

    experts = moe.experts

    def slice_before(mod, args, kwargs):
        x, counts = args[0], args[1]
        n = x.shape[0]
        start, end = _slice_bounds(n, index, parts)
        row_weights = tuple(w[start:end] for w in args[2:])      # GroupedExperts' row_weights, if given
        return (x[start:end], _slice_counts(counts, start, end)) + row_weights, kwargs, (n, start, end)

    def slice_after(mod, y, state):
        n, start, end = state
        return torch.nn.functional.pad(y, (0, 0, start, n - end))

    around_forward(experts, slice_before, slice_after)


# ----------------------------------------------------------------------------------------------
# expert parallel dispatch
# ----------------------------------------------------------------------------------------------
def _expert_major(recv_counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows arrive source-major ``(src, expert)``; return the permutation to expert-major order
    and the rows per local expert. ``recv_counts``: ``[sources, local_experts]``; ``total``: their
    sum, known on the host (so ``repeat_interleave`` needs no device sync)."""
    sources, local = recv_counts.shape
    device = recv_counts.device
    key = (torch.arange(local, device=device)[None, :] * sources + torch.arange(sources, device=device)[:, None])
    key = torch.repeat_interleave(key.reshape(-1), recv_counts.reshape(-1).to(torch.long), output_size=total)
    perm = torch.argsort(key, stable=True)
    return perm, recv_counts.sum(dim=0)


class _Dispatch:
    """What ``combine`` needs from ``dispatch`` (kept per call)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _alltoall_dispatch(x: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup, local_experts: int):
    ep = dist.get_world_size(group)
    counts = counts.to(torch.long)
    send_counts = counts.view(ep, local_experts)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=group)
    # Host copies of the split sizes: the all-to-all of the rows needs them (one sync per layer).
    send_splits, recv_splits = torch.stack([send_counts.sum(dim=1), recv_counts.sum(dim=1)]).tolist()
    perm, local_counts = _expert_major(recv_counts, sum(recv_splits))
    d = _Dispatch(perm=perm, send_splits=send_splits, recv_splits=recv_splits)
    return _alltoall_rows(x, d, group), local_counts, d


def _alltoall_rows(x: torch.Tensor, d: _Dispatch, group: dist.ProcessGroup) -> torch.Tensor:
    """Rows aligned with the dispatched ones (the rows themselves, their combine weights) to their owners."""
    return comm.all_to_all(x, d.recv_splits, d.send_splits, group).index_select(0, d.perm)


def _alltoall_combine(y: torch.Tensor, d: _Dispatch, group: dist.ProcessGroup) -> torch.Tensor:
    inverse = torch.argsort(d.perm)
    y = y.index_select(0, inverse)
    return comm.all_to_all(y, d.send_splits, d.recv_splits, group)


def _allgather_dispatch(x: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup, local_experts: int):
    ep = dist.get_world_size(group)
    me = dist.get_rank(group)
    counts = counts.to(torch.long)
    all_counts = torch.empty(ep * counts.numel(), dtype=counts.dtype, device=counts.device)
    comm._all_gather_single(all_counts, counts.contiguous(), group)
    all_counts = all_counts.view(ep, counts.numel())                           # [ep, E]
    # rows of my experts inside each source's expert-sorted block, source-major
    first = me * local_experts
    mine = all_counts[:, first:first + local_experts]                           # [ep, local]
    # one host copy (one sync per layer): the largest source block, and where my rows sit in each
    sizes, before_mine, take = torch.stack([all_counts.sum(dim=1), all_counts[:, :first].sum(dim=1),
                                            mine.sum(dim=1)]).tolist()
    n_max = max(sizes)
    n = x.shape[0]
    index = torch.cat([torch.arange(src * n_max + before_mine[src], src * n_max + before_mine[src] + take[src],
                                    device=counts.device) for src in range(ep)])
    perm, local_counts = _expert_major(mine, sum(take))
    d = _Dispatch(perm=perm, index=index, n=n, n_max=n_max, ep=ep)
    return _allgather_rows(x, d, group), local_counts, d


def _allgather_rows(x: torch.Tensor, d: _Dispatch, group: dist.ProcessGroup) -> torch.Tensor:
    """Rows aligned with the dispatched ones (the rows themselves, their combine weights): gathered, mine kept."""
    padded = torch.nn.functional.pad(x, (0, 0, 0, d.n_max - d.n))
    gathered = comm.all_gather(padded.unsqueeze(0), group, dim=0).reshape(d.ep * d.n_max, x.shape[-1])
    return gathered.index_select(0, d.index).index_select(0, d.perm)


def _allgather_combine(y: torch.Tensor, d: _Dispatch, group: dist.ProcessGroup) -> torch.Tensor:
    inverse = torch.argsort(d.perm)
    y = y.index_select(0, inverse)
    full = y.new_zeros(d.ep * d.n_max, y.shape[-1]).index_copy(0, d.index, y)
    out = comm.reduce_scatter(full.view(d.ep, d.n_max, y.shape[-1]), group, dim=0)
    return out.reshape(d.n_max, y.shape[-1])[: d.n]


# ----------------------------------------------------------------------------------------------
# alltoall_deredundancy: each token sent once per destination rank, fanned out there
# ----------------------------------------------------------------------------------------------
def destination_ranks(indices: torch.Tensor, keep: Optional[torch.Tensor], ep: int, local_experts: int
                      ) -> torch.Tensor:
    """``need [T, ep]``: whether token t has at least one kept assignment on rank r (rank r owns
    experts ``r*local_experts .. (r+1)*local_experts - 1``)."""
    T = indices.shape[0]
    dest = torch.div(indices, local_experts, rounding_mode="floor")
    if keep is not None:                               # a dropped assignment goes to a spare column
        dest = torch.where(keep.view(T, -1), dest, ep)
    need = torch.zeros(T, ep + 1, dtype=torch.int8, device=indices.device).scatter_(1, dest, 1)
    return need[:, :ep].bool()


def dispatch_row_bytes(hidden_bytes: int, top_k: int, dispatcher: str) -> int:
    """Bytes one dispatched row carries: ``alltoall`` sends a hidden row and its fp32 combine weight
    per assignment; ``alltoall_deredundancy`` a hidden row per (token, rank) with the token's K expert
    ids local to that rank (int32, -1: not there) and its K fp32 weights. The combine sends the same
    number of hidden rows back."""
    if dispatcher == "alltoall_deredundancy":
        return hidden_bytes + top_k * (4 + 4)
    return hidden_bytes + 4


class DeduplicatedDispatch:
    """MindFormers' ``alltoall_deredundancy`` (``DeredundancyExpertParallel``): a token whose K experts
    sit on the same remote rank crosses the network once, not once per expert.

    Dispatch: every token goes once to each rank owning at least one of its (kept) experts, with its
    K expert ids local to that rank (-1 elsewhere) and its K combine weights; that rank fans it out
    to its experts, applies the weights, and sums the token's expert outputs. Combine: one summed row
    per (token, rank) comes back and the source adds the ranks' rows. The same function as
    ``alltoall`` (sums in another order).

    MindFormers de-duplicates per node of ``npu_nums_per_device`` ranks (all-gather over nodes, then
    an all-to-all of assignment rows inside the node); lit_moe per rank, which sends each token only
    where it has experts. ``dispatch_bytes`` on the experts module counts what left this rank for other
    ranks (every forward, recomputed ones included), as the ``alltoall`` dispatch does."""

    def __init__(self, group: dist.ProcessGroup, local_experts: int):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.local_experts = local_experts

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                 keep: Optional[torch.Tensor], experts: nn.Module) -> torch.Tensor:
        T, H = x.shape
        K = indices.shape[1]
        L = self.local_experts
        need = destination_ranks(indices, keep, self.ep, L)
        dest, tokens = need.t().nonzero(as_tuple=True)              # rank-major, token order within
        send_counts = need.sum(dim=0).to(torch.long)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits, recv_splits = torch.stack([send_counts, recv_counts]).tolist()   # one host sync
        # the token's experts on its destination rank, as local ids (-1: elsewhere or dropped)
        mine = torch.div(indices[tokens], L, rounding_mode="floor") == dest[:, None]
        if keep is not None:
            mine &= keep.view(T, K)[tokens]
        local_ids = torch.where(mine, indices[tokens] - dest[:, None] * L, -1).to(torch.int32)
        recv_x = comm.all_to_all(x.index_select(0, tokens), recv_splits, send_splits, self.group)
        recv_w = comm.all_to_all(weights.index_select(0, tokens).float(), recv_splits, send_splits, self.group)
        recv_ids = comm.all_to_all(local_ids, recv_splits, send_splits, self.group).reshape(-1)
        others = sum(send_splits) - send_splits[self.rank]
        experts.dispatch_bytes += others * dispatch_row_bytes(H * x.element_size(), K, "alltoall_deredundancy")
        # fan out: the received tokens' assignments to this rank's experts, expert-major
        key = torch.where(recv_ids >= 0, recv_ids.long(), L)
        counts = torch.zeros(L + 1, dtype=torch.long, device=x.device).scatter_add_(0, key, torch.ones_like(key))
        order = torch.argsort(key, stable=True)[: int(counts[:L].sum())]          # host sync: rows received
        row_token = torch.div(order, K, rounding_mode="floor")
        y = experts(recv_x.index_select(0, row_token), counts[:L],
                    recv_w.reshape(-1, 1).index_select(0, order).to(weights.dtype))
        per_token = y.new_zeros(recv_x.shape[0], y.shape[-1]).index_add(0, row_token, y)
        back = comm.all_to_all(per_token, send_splits, recv_splits, self.group)
        return back.new_zeros(T, back.shape[-1]).index_add(0, tokens, back)


def apply_expert_parallel(experts: nn.Module, ep_mesh, dispatcher: str = "alltoall") -> None:
    """Shard ``experts`` (``GroupedExperts``) over ``ep_mesh`` and route rows to their owners."""
    group = ep_mesh.get_group()
    ep = ep_mesh.size()
    for name, p in list(experts.named_parameters(recurse=False)):
        if p.shape[0] % ep:
            raise ValueError(f"expert parallel: {p.shape[0]} experts of {name} are not divisible by ep {ep}")
        distribute_param(experts, name, ep_mesh, [Shard(0)])
    local_experts = experts.gate_up_proj.shape[0] // ep
    experts.dispatch_bytes = 0
    # the dispatch reads the split sizes on the host: a compiled decoder layer leaves this MoE eager
    # (lit_moe.model.compile.own_graph_breaks)
    experts.dispatch_on_host = True
    if dispatcher == "alltoall_deredundancy":
        return      # the MoE layer hands its routing to DeduplicatedDispatch (apply_moe_parallel)
    if dispatcher == "allgather":
        dispatch, dispatch_rows, combine = _allgather_dispatch, _allgather_rows, _allgather_combine
    else:
        dispatch, dispatch_rows, combine = _alltoall_dispatch, _alltoall_rows, _alltoall_combine

    def before(mod, args, kwargs):
        x, counts = args[0], args[1]
        rows, local_counts, state = dispatch(x, counts, group, local_experts)
        if dispatcher == "alltoall":
            me = dist.get_rank(group)
            others = sum(state.send_splits) - state.send_splits[me]
            mod.dispatch_bytes += others * dispatch_row_bytes(x.shape[-1] * x.element_size(), 0, dispatcher)
        # GroupedExperts' row_weights travel with their rows
        row_weights = tuple(dispatch_rows(w, state, group) for w in args[2:])
        return (rows, local_counts) + row_weights, kwargs, state

    def after(mod, y, state):
        return combine(y, state, group)

    around_forward(experts, before, after)


def apply_moe_parallel(model: nn.Module, dims, dispatcher: str = "alltoall", sequence_parallel: bool = True
                       ) -> list[nn.Module]:
    """The MoE part of parallelize: sequence gather + row split over tp, then expert parallel.
    Returns the routed-expert modules (FSDP shards them on their own mesh). ``sequence_parallel``:
    see :func:`lit_moe.strategies.tensor_parallel.apply_tensor_parallel`."""
    experts = []
    moes = model.moe_layers()
    if not moes:
        return experts
    for moe in moes:
        if dims.tp > 1:
            apply_moe_sequence_split(moe, dims.mesh("tp").get_group(), sequence_parallel)
        if dims.ep > 1:
            apply_expert_parallel(moe.experts, dims.mesh("ep"), dispatcher)
            if dispatcher == "alltoall_deredundancy":
                moe.token_dispatcher = DeduplicatedDispatch(dims.mesh("ep").get_group(),
                                                            moe.num_experts // dims.ep)
        experts.append(moe.experts)
    return experts


def resolve_dispatcher(parallelism_value: str, model_value: Optional[str]) -> str:
    """``parallelism.moe_token_dispatcher_type`` and ``model.moe_token_dispatcher_type`` may both be
    given; a non-default value wins, two different non-defaults are an error."""
    from lit_moe.config import ConfigError

    model_value = "alltoall" if model_value is None else model_value
    if parallelism_value != "alltoall" and model_value != "alltoall" and parallelism_value != model_value:
        raise ConfigError(
            f"parallelism.moe_token_dispatcher_type: {parallelism_value!r} conflicts with "
            f"model.moe_token_dispatcher_type: {model_value!r}")
    return parallelism_value if parallelism_value != "alltoall" else model_value
