"""Dense MLP, router, grouped experts and the MoE layer of DeepSeek-V3.

Routing ("noaux_tc"): scores s = sigmoid(W_g u) (or softmax), computed in ``router_dense_type``;
experts are *chosen* on s + b (b = expert bias, aux-loss-free balancing), optionally limited to the
``topk_group`` groups whose two best biased scores sum highest; the combine weights are the
*unbiased* scores of the chosen experts, renormalised (``norm_topk_prob``) and multiplied by
``routed_scaling_factor``. Tokens are permuted to expert order with one stable argsort and run
through the experts as grouped GEMMs; each row's combine weight scales its activation ahead of the
down projection, so the expert outputs come out already weighted, in the compute dtype. They are
un-permuted with a gather through the inverse permutation and summed over the K choices of each
token: no fp32 ``[T, K, H]`` tensor, no zero buffer, no scatter of rows, no atomics (deterministic).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lit_moe.model.compile import in_backward
from lit_moe.model.config import DeepseekV3Config
from lit_moe.model.hooks import ModelHooks
from lit_moe.ops import GatedActivation, Linear, fused_linear


def _activation(config: DeepseekV3Config) -> GatedActivation:
    return GatedActivation(config.hidden_act, config.gelu_approximate, config.silu_inplace,
                           config.use_fused_swiglu, clamp=config.swiglu_limit)


# ----------------------------------------------------------------------------------------------
# dense MLP (also the shared experts)
# ----------------------------------------------------------------------------------------------
class MLP(nn.Module):
    """down_proj(act(gate_proj x) * up_proj x)."""

    def __init__(self, config: DeepseekV3Config, intermediate_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        H = config.hidden_size
        self.gate_proj = Linear(H, intermediate_size, dtype=dtype)
        self.up_proj = Linear(H, intermediate_size, dtype=dtype)
        self.down_proj = Linear(intermediate_size, H, dtype=dtype)
        self.act = _activation(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one GEMM for gate and up (the two Linear modules and their checkpoint names stay)
        return self.down_proj(self.act.forward_packed(fused_linear(x, self.gate_proj, self.up_proj)))


# ----------------------------------------------------------------------------------------------
# router
# ----------------------------------------------------------------------------------------------
class Router(nn.Module):
    """Top-K router with expert bias and group-limited selection.

    ``forward(x [T, H]) -> (weights [T, K], indices [T, K], scores [T, E])``, all in
    ``router_dense_type``; ``scores`` are the full (unbiased) score table the aux losses use.
    """

    has_expert_bias = True    # the hash router's selection reads none

    def __init__(self, config: DeepseekV3Config, dtype: torch.dtype | None = None):
        super().__init__()
        E = config.n_routed_experts
        self.num_experts = E
        self.top_k = config.num_experts_per_tok
        self.scoring_func = config.scoring_func
        self.n_group = config.n_group if config.group_limited else 1
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.router_dtype = config.torch_dtype("router_dense_type")
        self.weight = nn.Parameter(torch.empty(E, config.hidden_size, dtype=dtype))
        # fp32 whatever the parameter dtype: tiny sign updates of 1e-3 must not round away.
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32), persistent=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = router_scores(F.linear(x.to(self.router_dtype), self.weight.to(self.router_dtype)),
                               self.scoring_func)
        indices = self.select(scores.detach())
        return self.combine_weights(scores, indices), indices, scores

    def combine_weights(self, scores: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The chosen experts' unbiased scores, renormalised (``norm_topk_prob``), times the scaling factor."""
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor

    @torch.no_grad()
    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """Indices ``[T, K]`` of the chosen experts: top-K of s + b within the best groups."""
        # in fp32 at least: a bf16 router (router_dense_type) would round away bias steps of 1e-3
        choice = scores.to(torch.promote_types(scores.dtype, torch.float32)) + self.expert_bias
        if self.n_group > 1:
            T, E = choice.shape
            per_group = E // self.n_group
            grouped = choice.view(T, self.n_group, per_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)            # [T, G]
            best = group_scores.topk(self.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)
        return choice.topk(self.top_k, dim=-1).indices

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, score={self.scoring_func}, "
                f"groups={self.n_group}/{self.topk_group}, dtype={self.router_dtype}")


class HashRouter(Router):
    """DeepSeek-V4's hash routing (``num_hash_layers``): the experts of token id t are the fixed row
    ``tid2eid[t]`` (a buffer: round-robin ``(t + k) % E`` at init, as MindFormers; a checkpoint's table
    is loaded); the learned gate's scores still weight them, as :class:`Router` does. No expert bias.

    ``forward(x [T, H], input_ids [...] with T elements)``. ``expert_bias`` stays 0 and is not saved
    (selection does not read it; the expert-bias update skips these routers)."""

    has_expert_bias = False

    def __init__(self, config: DeepseekV3Config, dtype: torch.dtype | None = None):
        super().__init__(config, dtype=dtype)
        self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32), persistent=False)
        self.register_buffer("tid2eid", torch.empty(config.vocab_size, self.top_k, dtype=torch.long),
                             persistent=True)

    @torch.no_grad()
    def init_extra(self) -> None:
        """The round-robin table (after ``init_weights`` zeroed the buffers)."""
        ids = torch.arange(self.tid2eid.shape[0], device=self.tid2eid.device)
        self.tid2eid.copy_(torch.stack([(ids + k) % self.num_experts for k in range(self.top_k)], dim=1))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = router_scores(F.linear(x.to(self.router_dtype), self.weight.to(self.router_dtype)),
                               self.scoring_func)
        indices = self.tid2eid[input_ids.reshape(-1)]
        return self.combine_weights(scores, indices), indices, scores

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, score={self.scoring_func}, hash table"


def router_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """sigmoid, softmax or sqrt(softplus) (DeepSeek-V4) of the router logits."""
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    if scoring_func == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    return torch.softmax(logits, dim=-1)


def load_balancing_loss(scores: torch.Tensor, top_k: int, batch: int, scoring_func: str,
                        kind: str, coeff: float, reduce_stats: Optional[Callable] = None) -> torch.Tensor:
    """Switch-style balancing loss alpha * sum_e f_e P_e (Megatron's definition).

    p = scores normalised over all experts (sigmoid) or the softmax itself; the indicator is a plain
    top-K of p (no bias, no group limit). ``aux_loss``: one reduction over the micro-batch's T tokens;
    ``seq_aux_loss``: per sequence (T = S), averaged over the B sequences. f_e = E/(K T) * count_e,
    P_e = mean_t p_te, so a perfectly uniform router gives alpha. ``reduce_stats(counts, prob_sums,
    tokens)`` sums the statistics over the ranks holding other shards of the same sequences
    (context parallel) before the formula.
    """
    T, E = scores.shape
    p = scores if scoring_func == "softmax" else scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    with torch.no_grad():
        chosen = torch.zeros_like(p).scatter_(1, p.topk(top_k, dim=-1).indices, 1.0)
    groups = batch if kind == "seq_aux_loss" else 1
    p = p.view(groups, T // groups, E)
    chosen = chosen.view(groups, T // groups, E)
    n = T // groups
    counts, prob_sums = chosen.sum(dim=1), p.sum(dim=1)
    if reduce_stats is not None:
        counts, prob_sums, n = reduce_stats(counts, prob_sums, n)
    f = counts * (E / (top_k * n))
    P = prob_sums / n
    return coeff * (f * P).sum(dim=-1).mean()


def expert_counts(flat_e: torch.Tensor, num_bins: int, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Assignments per expert (``weights`` of 0/1 count only some). A scatter-add of integers rather than
    ``bincount``, which reads the largest index back to the host on accelerators (a device sync)."""
    ones = torch.ones_like(flat_e) if weights is None else weights.to(flat_e.dtype)
    return torch.zeros(num_bins, dtype=flat_e.dtype, device=flat_e.device).scatter_add_(0, flat_e, ones)


def inverse_permutation(order: torch.Tensor, size: int) -> torch.Tensor:
    """``inverse [size]`` with ``inverse[order[i]] = i``; positions missing from ``order`` (dropped
    assignments, when ``len(order) < size``) get ``len(order)``, the index of an appended zero row."""
    n = order.numel()
    positions = torch.arange(n, device=order.device, dtype=order.dtype)
    if n == size:
        return torch.empty_like(order).scatter_(0, order, positions)
    return torch.full((size,), n, device=order.device, dtype=order.dtype).scatter_(0, order, positions)


def _rows_or_zero(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` where ``index`` may hold ``len(x)`` for a zero row."""
    if index.numel() > x.shape[0]:
        x = F.pad(x, (0, 0, 0, 1))
    return x.index_select(0, index)


class _AssignmentRows(torch.autograd.Function):
    """``x[order // K]``: the token row of every assignment in ``order`` (distinct assignments
    ``a = t*K + k``; ``inverse = inverse_permutation(order, T*K)``). Its backward gathers the
    gradients back by assignment and sums each token's K rows, instead of ``index_select``'s
    backward, a scatter-add of duplicate rows into a zero buffer (atomics on accelerators)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return x.index_select(0, torch.div(order, top_k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        by_assignment = _rows_or_zero(grad, inverse)
        return by_assignment.view(-1, ctx.top_k, grad.shape[-1]).sum(dim=1), None, None, None


class _Unpermute(torch.autograd.Function):
    """``y_sorted`` back in assignment order: ``y[a] = y_sorted[inverse[a]]`` (a zero row for an
    assignment missing from ``order``). The backward is the forward gather, ``grad[order]``."""

    @staticmethod
    def forward(ctx, y_sorted: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(order)
        return _rows_or_zero(y_sorted, inverse)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (order,) = ctx.saved_tensors
        return grad.index_select(0, order), None, None


def capacity_ranks(indices: torch.Tensor, weights: torch.Tensor, num_experts: int, policy: str
                   ) -> torch.Tensor:
    """Rank ``[T, K]`` of every assignment among those of its expert: by descending combine weight
    (``probs``) or by token order (``position``). An assignment is kept when its rank < capacity."""
    flat_e = indices.reshape(-1)
    n = flat_e.numel()
    if policy == "probs":
        pre = torch.argsort(weights.reshape(-1), descending=True, stable=True)
    else:
        pre = torch.arange(n, device=flat_e.device)
    order = pre[torch.argsort(flat_e[pre], stable=True)]           # grouped by expert, policy order within
    counts = expert_counts(flat_e, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(flat_e)
    rank[order] = torch.arange(n, device=flat_e.device) - starts[flat_e[order]]
    return rank.view_as(indices)


# ----------------------------------------------------------------------------------------------
# grouped experts
# ----------------------------------------------------------------------------------------------
class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped_mm's backward needs it)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


_GROUPED_MM_RUNS: dict[tuple[str, torch.dtype], bool] = {}


@torch.compiler.assume_constant_result   # probed eagerly, a constant of compiled graphs (no graph break)
def _grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``F.grouped_mm`` (forward and backward) works for this device type and dtype; probed once."""
    key = (device.type, dtype)
    if key not in _GROUPED_MM_RUNS:
        ok = hasattr(F, "grouped_mm") and device.type != "meta"
        if ok:
            try:
                # identity saved-tensor hooks: an activation-checkpoint region around the first call
                # must not see the probe's tensors (the recompute would not save them again)
                with torch.inference_mode(False), torch.enable_grad(), \
                        torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                    a = torch.ones(8, 16, device=device, dtype=dtype, requires_grad=True)
                    b = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
                    offs = torch.tensor([3, 8], device=device, dtype=torch.int32)
                    out = F.grouped_mm(a, b, offs=offs)
                    out.backward(torch.ones_like(out))
                    ok = bool(torch.allclose(out.float(), torch.full_like(out.float(), 16.0)))
            except Exception:  # not implemented for this device/dtype: use the exact fallback
                ok = False
        _GROUPED_MM_RUNS[key] = ok
    return _GROUPED_MM_RUNS[key]


def _grouped_mm_aligned(hidden: int, gate_up: int, down_out: int, element_size: int) -> bool:
    return all(dim * element_size % 16 == 0 for dim in (hidden, gate_up, gate_up // 2, down_out))


def grouped_mm_usable(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """grouped_mm needs 16-byte-aligned strides (on CPU) and a device/dtype it is implemented for;
    under torch.compile only bf16 (its shape function rejects other dtypes; version note in
    benchmarks/README.md)."""
    if not _grouped_mm_aligned(x.shape[-1], w1.shape[-1], w2.shape[-1], x.element_size()):
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False
    return x.is_contiguous() and _grouped_mm_runs(x.device, x.dtype)


# CPU grouped GEMMs run one oneDNN GEMM per group, and oneDNN builds and caches a kernel for every
# shape it meets. Group row counts change every step, so each step built new kernels and the cache
# grew towards its 1024 entries (hundreds of MB of RSS, and build time every step). Every group is
# therefore rounded up to a bucket: a multiple of 1/8 of its power of two, at least 16 rows. That is
# at most 12.5% (or 15 rows) of padding per group and 8 sizes per octave, so the kernels are reused.
CPU_GROUP_ROW_ALIGN = 16
CPU_GROUP_BUCKETS_PER_OCTAVE = 8


def grouped_mm_row_align(device: torch.device) -> int:
    """Smallest row multiple of every expert group in the grouped GEMMs (1: no padding)."""
    return CPU_GROUP_ROW_ALIGN if device.type == "cpu" else 1


def bucketed_group_rows(counts: torch.Tensor, align: int,
                        buckets_per_octave: int = CPU_GROUP_BUCKETS_PER_OCTAVE) -> torch.Tensor:
    """``counts`` rounded up to a multiple of ``max(align, 2^floor(log2 count) / buckets_per_octave)``
    (0 stays 0), on the device (no host sync)."""
    counts = counts.to(torch.int64)
    octave = torch.floor(torch.log2(counts.clamp_min(1).to(torch.float64)))
    width = torch.pow(2.0, octave - math.log2(buckets_per_octave)).to(torch.int64).clamp_min(align)
    return (counts + width - 1) // width * width


def _local(t: torch.Tensor) -> torch.Tensor:
    # Expert-parallel shards are DTensors; the token counts are local, so compute on the local shard.
    # (isinstance, not hasattr: torch.compile traces it.)
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class GroupedExperts(nn.Module):
    """The routed experts, stored stacked: ``gate_up_proj [E, H, 2I]`` (first half gate, second half
    up) and ``down_proj [E, I, H]``. ``forward(x_sorted [N, H], num_tokens_per_expert [E])`` takes
    tokens already sorted by expert (``sum(num_tokens_per_expert) == N``) and returns ``[N, H]``."""

    def __init__(self, config: DeepseekV3Config, dtype: torch.dtype | None = None):
        super().__init__()
        E, H, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * I, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(E, I, H, dtype=dtype))
        self.act = _activation(config)
        self.use_grouped_mm = config.moe_grouped_gemm
        self.compute_dtype = config.torch_dtype("compute_dtype")
        # expert parallel sets it: its dispatch reads the split sizes on the host
        self.dispatch_on_host = False

    @property
    def breaks_compiled_graphs(self) -> bool:
        """Whether a compiled caller would break its graph here (``compile.own_graph_breaks``): expert-
        parallel dispatch and the per-expert fallback loop read group sizes on the host; the grouped
        GEMMs are traced only in bf16, with aligned strides, where they run."""
        if self.dispatch_on_host:
            return True
        dtype = self.compute_dtype
        H, I2 = self.gate_up_proj.shape[1:]
        return not (self.use_grouped_mm and dtype == torch.bfloat16
                    and _grouped_mm_aligned(H, I2, self.down_proj.shape[-1], dtype.itemsize)
                    and _grouped_mm_runs(self.gate_up_proj.device, dtype))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                row_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``row_weights [N, 1]`` (optional): each row's combine weight, applied to its activation
        ahead of the down projection (in the compute dtype)."""
        w1 = _local(self.gate_up_proj).to(x.dtype)
        w2 = _local(self.down_proj).to(x.dtype)
        if row_weights is not None:
            row_weights = row_weights.to(x.dtype)
        # no rows at all (an expert-parallel rank that received no tokens): the loop below, whose
        # empty GEMMs still give every expert weight its (zero) gradient; grouped_mm's backward
        # rejects an empty input
        if self.use_grouped_mm and x.shape[0] > 0 and grouped_mm_usable(x, w1, w2):
            align = grouped_mm_row_align(x.device)
            if align > 1 and num_tokens_per_expert.numel() > 0:
                return self._aligned_grouped_mm(x, num_tokens_per_expert, w1, w2, align, row_weights)
            offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
            h = F.grouped_mm(x, w1, offs=offs)
            y = F.grouped_mm(self._weighted_act(h, row_weights), w2, offs=offs)
            return _ContiguousGrad.apply(y)
        # Exact fallback: one GEMM per expert over its contiguous slice (a loop over experts, not tokens).
        sizes = num_tokens_per_expert.tolist()
        weights = [None] * len(sizes) if row_weights is None else torch.split(row_weights, sizes)
        outs = [self._weighted_act(xe @ w1[e], we) @ w2[e]
                for e, (xe, we) in enumerate(zip(torch.split(x, sizes), weights))]
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-1])

    def _weighted_act(self, h: torch.Tensor, row_weights: Optional[torch.Tensor]) -> torch.Tensor:
        a = self.act.forward_packed(h)
        return a if row_weights is None else a * row_weights

    def _aligned_grouped_mm(self, x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                            align: int, row_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The grouped GEMMs with every group's rows rounded up to its bucket (:func:`bucketed_group_rows`).

        Pad rows are zeros whose outputs are never read (zero gradient everywhere). Eagerly the buffer
        has exactly the padded rows: this path only runs on CPUs, where reading the total is no device
        sync. Under ``torch.compile`` it has the static size ``N + N/8 + align E`` that bounds the
        total (no data-dependent shapes in the graph); rows past the last group are then not computed
        (their values are garbage inside the graph, never read, and their gradient is dropped by the
        ``index_copy`` that placed the real rows)."""
        N, E = x.shape[0], counts.numel()
        counts = counts.to(torch.int64)
        padded = bucketed_group_rows(counts, align)
        if torch.compiler.is_compiling():
            rows = N + N // CPU_GROUP_BUCKETS_PER_OCTAVE + E * align
        else:
            rows = int(padded.sum())
        expert = torch.repeat_interleave(torch.arange(E, device=x.device), counts, output_size=N)
        start = torch.cumsum(counts, 0) - counts
        padded_start = torch.cumsum(padded, 0) - padded
        dest = torch.arange(N, device=x.device) + (padded_start - start)[expert]     # row -> padded slot
        offs = torch.cumsum(padded, 0, dtype=torch.int32)
        x_padded = x.new_zeros(rows, x.shape[1]).index_copy(0, dest, x)
        if row_weights is not None:
            row_weights = row_weights.new_zeros(rows, 1).index_copy(0, dest, row_weights)
        h = F.grouped_mm(x_padded, w1, offs=offs)
        y = F.grouped_mm(self._weighted_act(h, row_weights), w2, offs=offs)
        return _ContiguousGrad.apply(y).index_select(0, dest)

    def extra_repr(self) -> str:
        E, H, I2 = self.gate_up_proj.shape
        return f"experts={E}, hidden={H}, intermediate={I2 // 2}, grouped_mm={self.use_grouped_mm}"


# ----------------------------------------------------------------------------------------------
# MoE layer
# ----------------------------------------------------------------------------------------------
class MoE(nn.Module):
    """Routed experts (+ shared experts) for ``x [B, S, H]``.

    Side outputs of a training forward: ``aux_loss`` (differentiable, already times
    ``moe_aux_loss_coeff``; read and cleared by the model), ``tokens_per_expert`` (kept assignments
    per expert, accumulated until ``DeepseekV3ForCausalLM.update_expert_bias``) and ``last_stats``.
    Counters are not touched during activation recompute or without grad.
    """

    def __init__(self, config: DeepseekV3Config, dtype: torch.dtype | None = None, hash_routed: bool = False):
        super().__init__()
        c = config
        self.num_experts = c.n_routed_experts
        self.top_k = c.num_experts_per_tok
        self.scoring_func = c.scoring_func
        self.aux_type = c.moe_router_load_balancing_type
        self.aux_coeff = c.moe_aux_loss_coeff
        self.capacity_factor = c.moe_expert_capacity_factor
        self.drop_policy = c.moe_token_drop_policy
        self.pad_to_capacity = c.use_pad_tokens
        self.router = HashRouter(c, dtype=dtype) if hash_routed else Router(c, dtype=dtype)
        self.experts = GroupedExperts(c, dtype=dtype)
        if c.n_shared_experts > 0:
            self.shared_experts = MLP(c, c.shared_expert_intermediate_size, dtype=dtype)
        else:
            self.shared_experts = None
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.float32),
                             persistent=False)
        # cumulative dropped / routed assignments (capacity); the metrics callback may reset them
        self.register_buffer("dropped_assignments", torch.zeros((), dtype=torch.float32), persistent=False)
        self.register_buffer("total_assignments", torch.zeros((), dtype=torch.float32), persistent=False)
        self.aux_loss: Optional[torch.Tensor] = None
        self.last_stats: dict[str, torch.Tensor] = {}
        # the model's hooks (shared by every MoE layer of a model): context parallel's
        # ``aux_stats_reduce`` sums the balancing statistics of a sequence over its shards' ranks
        self.hooks = ModelHooks()
        # expert parallel's alltoall_deredundancy sets it (lit_moe.strategies.expert_parallel.
        # DeduplicatedDispatch): ``(flat_x, weights, indices, keep, experts) -> routed [T, H]`` sends
        # token rows, not assignment rows, so it needs the routing itself rather than sorted rows
        self.token_dispatcher: Optional[Callable] = None

    @property
    def breaks_compiled_graphs(self) -> bool:
        # dropping over capacity (without padding) cuts the kept rows at a host-read count
        return self.capacity_factor is not None and not self.pad_to_capacity

    def capacity(self, num_tokens: int) -> Optional[int]:
        """Per-expert capacity C = ceil(T*K/E * capacity_factor), or None when dropless."""
        if self.capacity_factor is None:
            return None
        return math.ceil(num_tokens * self.top_k / self.num_experts * self.capacity_factor)

    def forward(self, x: torch.Tensor, input_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``input_ids`` (``[B, S]``): the token ids a hash-routed layer looks its experts up by."""
        B, S, H = x.shape
        T, K = B * S, self.top_k
        flat_x = x.reshape(T, H)
        weights, indices, scores = self.router(flat_x) if input_ids is None else self.router(flat_x, input_ids)
        routed = self._dispatch_combine(flat_x, weights, indices)
        out = routed.view(B, S, H)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)

        self.aux_loss = None
        if self.training and self.aux_coeff > 0 and self.aux_type != "none":
            self.aux_loss = load_balancing_loss(scores, K, B, self.scoring_func, self.aux_type, self.aux_coeff,
                                                self.hooks.aux_stats_reduce)
            if self._recording():
                self.last_stats["aux_loss"] = self.aux_loss.detach()
        return out

    def _dispatch_combine(self, flat_x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
                          ) -> torch.Tensor:
        T, H = flat_x.shape
        K, E = self.top_k, self.num_experts
        flat_e = indices.reshape(-1)                                   # assignment a = t*K + k
        flat_w = weights.reshape(-1, 1)
        capacity = self.capacity(T)
        keep = rank = None
        if capacity is not None:
            rank = capacity_ranks(indices, weights, E, self.drop_policy).reshape(-1)
            keep = rank < capacity

        if self.token_dispatcher is not None:                          # tokens, not assignments, travel
            self._record(expert_counts(flat_e, E, keep), T * K)
            return self.token_dispatcher(flat_x, weights, indices, keep, self.experts)
        if keep is None:                                               # dropless
            order = torch.argsort(flat_e, stable=True)
            counts = expert_counts(flat_e, E)
            kept_counts = counts
        elif self.pad_to_capacity:                                     # exactly C rows per expert
            # slot of every kept assignment; dropped ones go to a spare last slot that is cut off
            slot = torch.where(keep, flat_e * capacity + rank.clamp(max=capacity - 1), E * capacity)
            assignments = torch.arange(T * K, device=flat_x.device)
            slot_assignment = torch.zeros(E * capacity + 1, dtype=torch.long,   # filler: assignment 0
                                          device=flat_x.device).scatter_(0, slot, assignments)[:-1]
            per_assignment = flat_x.unsqueeze(1).expand(T, K, H).reshape(T * K, H)
            counts = torch.full((E,), capacity, dtype=torch.long, device=flat_x.device)
            y_slots = self.experts(per_assignment.index_select(0, slot_assignment), counts,
                                   flat_w.index_select(0, slot_assignment))
            y = torch.where(keep[:, None], y_slots.index_select(0, slot.clamp(max=E * capacity - 1)), 0.0)
            self._record(expert_counts(flat_e, E, keep), T * K)
            return y.view(T, K, H).sum(dim=1)
        else:                                                          # dropped assignments skip the experts
            masked_e = torch.where(keep, flat_e, E)
            order = torch.argsort(masked_e, stable=True)
            kept_counts = expert_counts(masked_e, E + 1)[:E]
            order = order[: int(kept_counts.sum())]                    # host sync: the kept count is dynamic
            counts = kept_counts

        inverse = inverse_permutation(order, T * K)
        y_sorted = self.experts(_AssignmentRows.apply(flat_x, order, inverse, K), counts,
                                flat_w.index_select(0, order))
        self._record(kept_counts, T * K)
        return _Unpermute.apply(y_sorted, order, inverse).view(T, K, H).sum(dim=1)

    def _recording(self) -> bool:
        # counters move only in a real training forward: not in eval, not without grad, not in recompute
        return self.training and torch.is_grad_enabled() and not in_backward()

    def _record(self, kept_counts: torch.Tensor, assignments: int) -> None:
        if not self._recording():
            return
        with torch.no_grad():
            kept_counts = kept_counts.to(torch.float32)
            kept = kept_counts.sum()
            self.tokens_per_expert += kept_counts
            self.dropped_assignments += assignments - kept
            self.total_assignments += assignments
            self.last_stats = {"tokens_per_expert": kept_counts, "dropped": assignments - kept,
                               "assignments": torch.full((), float(assignments), device=kept.device)}

    def reset_drop_counters(self) -> None:
        self.dropped_assignments.zero_()
        self.total_assignments.zero_()

    def drop_rate(self) -> float:
        """Dropped / routed token-expert assignments since the last reset (0 when dropless)."""
        total = float(self.total_assignments)
        return float(self.dropped_assignments) / total if total else 0.0
