"""Context parallelism: the ``cp`` ranks of a sample each hold ``S/cp`` of its tokens through the whole
model, and only attention sees the other ranks' tokens.

* **Zig-zag shards.** The sequence is cut into ``2·cp`` chunks of ``c = S/(2·cp)`` tokens; rank ``r``
  holds chunks ``r`` and ``2·cp-1-r`` (a head and a tail chunk). Causal attention work grows with
  the position, so every rank gets the same amount (:func:`attention_work`). (MindFormers slices
  contiguous chunks; the layout is internal, results are the same.) The model's
  ``hooks.shard_inputs``, run at the start of its forward (and of a pipeline stage's), takes those
  positions of ``input_ids``, ``labels``, ``loss_mask`` and ``position_ids`` (``arange(S)`` when
  absent, so rotary angles are the global positions) and keeps ``attention_mask`` /
  ``actual_seq_len``, which describe the whole sequence, to build each attention call's exact mask
  rows (causal in global positions, plus sliding window, blocked pairs and document boundaries).
  That forward's masks (:class:`ShardMasks`) ride in its attention context: a pipeline schedule
  runs several micro-batches' forwards before a backward, and a recomputed layer must meet its own
  micro-batch's masks.
* **Attention** (``parallelism.context_parallel_method``; each attention's ``core_attention`` gets a
  :class:`ContextParallelAttention` in its ``context_parallel`` slot, which runs the core's own math
  on the pieces; the module and its path stay):

  - ``colossal``: keys and values are all-gathered over cp (``core_attention.all_gather``; backward
    reduce-scatters). Each of the rank's two query chunks meets only the keys up to its own end.
  - ``ulysses``: an all-to-all turns the sequence shards of q, k, v into head shards (every rank:
    all S positions, ``heads/cp`` heads), plain attention runs, and the reverse all-to-all brings
    the output back to sequence shards (``core_attention.all_to_all``).
  - ``hybrid``: ulysses inside groups of ``u = ulysses_degree_in_cp`` consecutive cp ranks, then
    keys and values all-gathered across the ``cp/u`` groups; each group's ``2u`` query chunks meet
    the keys up to their ends.
  - ``context_parallel_async`` (ulysses, hybrid): the heads are cut in two groups whose all-to-alls
    are started asynchronously, so one group's exchange runs while the other's attention computes,
    and the output all-to-all of the first group overlaps the second group's attention.
* **Everything else is local.** Norms, the dense MLP and the MoE layers (routing, dispatch, routed
  and shared experts) run on the rank's ``S/cp`` tokens. The balancing loss needs statistics of
  whole sequences: its per-sequence expert counts and probability sums are summed over cp
  (:func:`comm.all_reduce`, whose backward sums every rank's gradient, since every rank's loss uses
  the total: the model's ``hooks.aux_stats_reduce``). The expert-bias token counts are summed over dp × cp by the training step
  (``strategy.expert_count_group``).
* **Loss.** A loss on a shard is the shard's masked mean; the run's loss is the masked mean over
  the sequence. The model's ``hooks.loss_share`` makes rank ``c`` report
  ``cp · sum_c / count_total`` (the count summed over cp): the mean over the cp ranks (what
  data-parallel gradient averaging and loss logging compute) is then exactly the sequence's mean,
  and every gradient is the single-process one. This holds for every MTP depth too.
* **DeepSeek-V3.2's indexer** ranks each query against every key of the sequence: its keys (one
  per token, ``index_head_dim`` wide) are all-gathered over cp and put in sequence order, each
  query's top-k is chosen among the keys its global position allows (:func:`indexer_keys`, the
  model's ``hooks.indexer_keys``): each rank selects for its own queries, with the indexer's
  own heads and weights, before any exchange of the attention's heads. The all-gather
  attention (``colossal``) meets the selection's rows as they are; under ``ulysses`` and
  ``hybrid`` the query rows of the ulysses group are all-gathered over it (a boolean
  ``[B, 1, u·S/cp, S]``), so each rank masks its heads' attention over the group's queries with
  the selection made where each query lives (:func:`_gathered_rows`). Its loss (every method)
  compares each of the rank's queries with the main attention over the gathered keys
  (``hooks.indexer_target_keys``); every rank has as many queries, so the mean of the ranks' means
  is the sequence's, and the keys' gradients go back to their ranks through the gather's backward.
  The target is made in the MLA's forward from the query and key of the rank's own tokens with
  all their heads, before (outside) the ulysses all-to-all, so under ``ulysses`` and ``hybrid`` too
  it sums every head of a query on the query's rank and needs no reduction over the ulysses group
  (under tensor parallel, only over the tp ranks: ``hooks.head_sum``). The price: the keys of all
  heads are gathered once more over cp for it (no autograd, one layer at a time), as under
  ``colossal``, where ulysses' attention itself holds ``heads/u`` of them.
* **DeepSeek-V4's attention** (one key/value head, sliding window, compressed windows that cross the
  chunks): each layer all-gathers the hidden states over cp (backward: reduce-scatter) and computes
  its keys and compressed entries over the whole sequence, its queries on the rank's own tokens,
  with those rows of the sequence's mask (:func:`whole_sequence`, the model's ``hooks.whole_sequence``).
  Under ``ulysses`` / ``hybrid`` its sink attention runs on the ulysses group's queries for this
  rank's ``heads/u`` heads (:class:`HeadShards`, the model's ``hooks.head_shards``: all-to-all of the
  queries and back, the group's mask rows gathered, the keys already whole); with
  ``context_parallel_async`` in two head groups, the second's exchange overlapping the first's attention.
  (MindFormers runs its own all-gather context parallel for V4's attention whatever the method.)
* **MTP.** Depth ``k`` reads the inputs shifted left by ``k``; the last token of each chunk needs the
  first token of the next chunk, which another rank holds. The model's ``hooks.shift_left`` is
  :func:`boundary_shift`, which exchanges those boundary tokens.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lit_moe.ops.attention import block_causal_attention, use_block_causal
from lit_moe.runtime.distributed import set_group_timeout
from lit_moe.strategies import comm
from lit_moe.strategies.parallel_dims import check_parallel_layout, cp_ulysses_degree

# ----------------------------------------------------------------------------------------------
# configuration (MindFormers' rules and messages)
# ----------------------------------------------------------------------------------------------
# ----------------------------------------------------------------------------------------------
# the zig-zag layout
# ----------------------------------------------------------------------------------------------
def rank_chunks(cp: int, rank: int) -> tuple[int, int]:
    """Global chunk ids (of ``2·cp``) held by cp rank ``rank``: a head and a tail chunk."""
    return rank, 2 * cp - 1 - rank


def shard_positions(seq: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions ``[S/cp]`` of rank ``rank``'s tokens, in their local order."""
    c = seq // (2 * cp)
    return torch.cat([torch.arange(j * c, (j + 1) * c, device=device) for j in rank_chunks(cp, rank)])


def _chunks_of(ranks) -> list[int]:
    return [j for r, cp in ranks for j in rank_chunks(cp, r)]


def _reorder(x: torch.Tensor, order: list[int], target: list[int], dim: int = 2) -> torch.Tensor:
    """``x`` holds chunks ``order`` along ``dim`` (equal sizes); return chunks ``target`` (slices + cat:
    the backward is deterministic, no scatter-add)."""
    if order == target:
        return x
    pieces = dict(zip(order, x.chunk(len(order), dim=dim)))
    return torch.cat([pieces[j] for j in target], dim=dim)


def attention_work(seq: int, cp: int, u: int = 1) -> list[dict[str, int]]:
    """Per cp rank and per head it attends for: ``pairs`` (query/key pairs causal attention may
    use, the work a causal kernel does) and ``scores`` (score entries the calls compute). Ulysses
    ranks (``u == cp``) attend all S positions for ``heads/cp`` heads; the others attend the query
    chunks of their ulysses group (their own two when ``u == 1``) for ``heads/u`` heads."""
    c = seq // (2 * cp)
    out = []
    for rank in range(cp):
        group = rank // u
        chunks = _chunks_of((r, cp) for r in range(group * u, (group + 1) * u))
        if u == cp:
            pairs, scores = seq * (seq + 1) // 2, seq * seq
        else:
            pairs = sum(c * j * c + c * (c + 1) // 2 for j in chunks)
            scores = sum(c * (j + 1) * c for j in chunks)
        out.append({"pairs": pairs, "scores": scores})
    return out


class ShardMasks:
    """The masks of one forward (one micro-batch): the whole sequence's ``attention_mask`` /
    ``actual_seq_len`` and the exact rows each attention call needs (built once per forward).

    Under pipeline stages it travels in the forward's :class:`AttentionContext` (as its masks), so
    a layer recomputed in backward, after later micro-batches' forwards, meets its own masks."""

    def __init__(self, size: int, batch: int, seq: int, device, attention_mask, actual_seq_len):
        self.size, self.batch, self.seq, self.device = size, batch, seq, device
        self.attention_mask, self.actual_seq_len = attention_mask, actual_seq_len
        self._masks: dict[tuple, Optional[torch.Tensor]] = {}

    @property
    def chunk(self) -> int:
        return self.seq // (2 * self.size)

    def plain(self, window_left: int) -> bool:
        """Plain causal attention: no blocked pairs, documents or window."""
        return self.attention_mask is None and self.actual_seq_len is None and window_left < 0

    def mask(self, lo: int, hi: int, keys: int, window_left: int) -> Optional[torch.Tensor]:
        """Allowed mask ``[B or 1, 1, hi-lo, keys]`` of queries ``[lo, hi)`` against keys ``[0, keys)``;
        None for a whole plain-causal sequence (the fused causal kernels)."""
        key = (lo, hi, keys, window_left)
        if key not in self._masks:
            from lit_moe.model.attention import allowed_mask

            whole = lo == 0 and hi == keys == self.seq
            self._masks[key] = None if self.plain(window_left) and whole else allowed_mask(
                self.batch, self.seq, self.device, attention_mask=self.attention_mask,
                actual_seq_len=self.actual_seq_len, window_left=window_left, force=True,
                rows=(lo, hi), keys=keys)
        return self._masks[key]


class _Shard:
    """What every layer's context-parallel attention of one model shares: the cp rank, the masks of
    the latest forward and the work counters."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.current: Optional[ShardMasks] = None     # the latest forward's (the model's own forward)
        # counted per attention call (tests compare ranks): causal pairs and computed score entries
        self.work = {"pairs": 0, "scores": 0}
        self.in_flight_max = 0     # async: exchanges still running while attention computed

    def reset(self, batch: int, seq: int, device, attention_mask, actual_seq_len) -> ShardMasks:
        self.current = ShardMasks(self.size, batch, seq, device, attention_mask, actual_seq_len)
        return self.current


# ----------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------
class ContextParallelAttention:
    """A core attention's ``context_parallel`` (:class:`lit_moe.model.attention.CoreAttention`): q, k, v
    of this rank's tokens ``[B, heads, S/cp, d]`` attending over the whole sequence, the core's own
    math (``core.attend``) on the pieces (see the module docstring for the methods). Not a module: the
    core stays the module (its path, its train/eval mode), this is the layout it runs in."""

    def __init__(self, core: nn.Module, shard: _Shard, cp_rank: int, cp: int, u: int,
                 ulysses_group: Optional[dist.ProcessGroup], ring_group: Optional[dist.ProcessGroup],
                 window_left: int, asynchronous: bool):
        self.core = core
        self.shard = shard
        self.u, self.groups = u, cp // u
        self.window_left = window_left
        # waiting on asynchronous all-to-all handles cannot be traced: the decoder layer compiles
        # without its attention half (the core's ``breaks_compiled_graphs``)
        self.asynchronous = asynchronous and u > 1
        self.ulysses_group, self.ring_group = ulysses_group, ring_group
        # the communication steps are the core's attributes, called through it, so that recompute_comm
        # selects them by path ('self_attention.core_attention.all_gather') and can wrap them
        if self.groups > 1:
            core.all_gather = comm.CommStep(functools.partial(comm.all_gather, group=ring_group, dim=2))
        if u > 1:
            core.all_to_all = comm.CommStep(functools.partial(comm.all_to_all_dims, group=ulysses_group))
        first = (cp_rank // u) * u
        # chunk ids along the sequence dim: of the queries after the all-to-all, of the gathered keys
        self.query_chunks = _chunks_of((r, cp) for r in range(first, first + u))
        self.key_chunks = _chunks_of((r, cp) for r in range(cp)) if self.groups > 1 else self.query_chunks
        self.sorted_keys = sorted(self.key_chunks)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Any = None) -> torch.Tensor:
        # ``allowed``: this forward's ShardMasks (pipeline stages put them in the attention
        # context), else the masks are the shard's latest; the exact rows of the whole sequence are
        # built here. A tensor: DeepSeek-V3.2's indexer selection, this rank's queries (local order)
        # against every key of the sequence ([B or 1, 1, S/cp, S], :func:`indexer_keys`), the mask
        # rows themselves (with ulysses: gathered to the rows of the group's queries)
        masks = allowed if isinstance(allowed, ShardMasks) else self.shard.current
        selected = allowed if isinstance(allowed, torch.Tensor) else None
        if selected is not None and self.u > 1:
            # the queries of the whole ulysses group meet their keys here: their selection rows too
            selected = _gathered_rows(selected, self.ulysses_group, self.u)
        if self.asynchronous:
            return self._forward_async(q, k, v, masks, selected)
        if self.u > 1:
            q, k, v = (self.core.all_to_all(t, scatter_dim=1, gather_dim=2) for t in (q, k, v))
        out = self._attend(q, k, v, masks, selected)
        if self.u > 1:
            out = self.core.all_to_all(out, scatter_dim=2, gather_dim=1)
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: ShardMasks,
                selected: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q: this group's query chunks, k/v: this group's (ulysses) or all (gathered) key chunks;
        ``selected``: the allowed keys of each of those queries (the indexer's, module docstring;
        rows in ``query_chunks`` order, every key of the sequence in sequence order)."""
        if self.groups > 1:
            k, v = self.core.all_gather(k), self.core.all_gather(v)
        k = _reorder(k, self.key_chunks, self.sorted_keys)
        v = _reorder(v, self.key_chunks, self.sorted_keys)
        heads = q.shape[1]
        S, c = masks.seq, masks.chunk
        if self.groups == 1:   # every position is here: one call over the whole sequence
            q = _reorder(q, self.query_chunks, self.sorted_keys)
            if selected is not None:   # its rows already hold the causal (window, document) rules
                mask = _reorder(selected, self.query_chunks, self.sorted_keys)
            else:
                mask = masks.mask(0, S, S, self.window_left)
            out = self.core.attend(q, k, v, mask)
            self._count(heads, S * (S + 1) // 2, S * S)
            return _reorder(out, self.sorted_keys, self.query_chunks)
        outs = []
        for i, j in enumerate(self.query_chunks):
            lo, hi = j * c, (j + 1) * c      # a causal query chunk meets the keys up to its end only
            q_j, k_j, v_j = q[:, :, i * c:(i + 1) * c], k[:, :, :hi], v[:, :, :hi]
            if selected is not None:   # its rows already hold the causal (window, document) rules
                outs.append(self.core.attend(q_j, k_j, v_j, selected[:, :, i * c:(i + 1) * c, :hi]))
            elif masks.plain(self.window_left) and self._block_causal(q_j):
                # the CPU causal kernel, for the last rows of a causal problem (skips the masked half)
                outs.append(block_causal_attention(q_j, k_j, v_j, self.core.scale, self.core.softmax_dtype))
            else:
                outs.append(self.core.attend(q_j, k_j, v_j, masks.mask(lo, hi, hi, self.window_left)))
            self._count(heads, c * lo + c * (c + 1) // 2, c * hi)
        return torch.cat(outs, dim=2)

    def _block_causal(self, q: torch.Tensor) -> bool:
        # where CoreAttention itself would take the CPU causal kernel for a plain causal call
        core = self.core
        dropout = core.attention_dropout if core.training else 0.0
        return core.use_flash_attention and dropout == 0.0 and use_block_causal(q)

    def _count(self, heads: int, pairs: int, scores: int) -> None:
        # Eager runs only: inside a compiled layer dynamo would guard on the counter's value and
        # recompile the layer at every call (seen with cp2 and torch_compile)
        if torch.compiler.is_compiling():
            return
        self.shard.work["pairs"] += heads * pairs
        self.shard.work["scores"] += heads * scores

    def _forward_async(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: ShardMasks,
                       selected: Optional[torch.Tensor]) -> torch.Tensor:
        """Two head groups: group g+1's all-to-alls run while group g's attention computes."""
        group = self.ulysses_group
        parts = 2 if q.shape[1] % (2 * self.u) == 0 else 1
        width = q.shape[1] // parts

        def start(p: int):
            handles: list = []
            blocks = [comm.start_all_to_all_dims(t[:, p * width:(p + 1) * width], group, 1, handles)
                      for t in (q, k, v)]
            return blocks, handles

        outs, out_handles = [], []
        upcoming = start(0)
        for p in range(parts):
            blocks, handles = upcoming
            if p + 1 < parts:
                upcoming = start(p + 1)
            for h in handles:
                h.wait()
            in_flight = (len(upcoming[1]) if p + 1 < parts else 0) + len(out_handles)
            self.shard.in_flight_max = max(self.shard.in_flight_max, in_flight)
            qp, kp, vp = (comm.finish_all_to_all_dims(b, 2) for b in blocks)
            outs.append(comm.start_all_to_all_dims(self._attend(qp, kp, vp, masks, selected), group, 2,
                                                     out_handles))
        for h in out_handles:
            h.wait()
        return torch.cat([comm.finish_all_to_all_dims(b, 1) for b in outs], dim=1)

    def __repr__(self) -> str:
        return f"ContextParallelAttention(ulysses={self.u}, all_gather_groups={self.groups}, async={self.asynchronous})"


# ----------------------------------------------------------------------------------------------
# the whole sequence for DeepSeek-V3.2's indexer and DeepSeek-V4's attention
# ----------------------------------------------------------------------------------------------
def _in_sequence_order(t: torch.Tensor, size: int) -> torch.Tensor:
    """``[B, S, ...]`` of every rank's zig-zag chunks in rank order (rank r: chunks r, 2cp-1-r) → sequence order."""
    order = _chunks_of((r, size) for r in range(size))
    return _reorder(t, order, sorted(order), dim=1)


def _concatenated(t: torch.Tensor, group: dist.ProcessGroup, size: int, dim: int) -> torch.Tensor:
    """Every rank's ``t`` concatenated along ``dim`` in rank order (no autograd)."""
    out = torch.empty((size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    comm._all_gather_single(out, t.contiguous(), group)                       # [size·B, ...]
    return torch.cat(list(out.view(size, *t.shape).unbind(0)), dim=dim)


def _gathered(t: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """Every cp rank's ``t [B, S/cp, ...]`` (no autograd), in sequence order ``[B, S, ...]``."""
    return _in_sequence_order(_concatenated(t, group, size, dim=1), size)


def _gathered_rows(rows: torch.Tensor, group: dist.ProcessGroup, u: int, dim: int = 2) -> torch.Tensor:
    """The boolean mask rows (along ``dim``) of this rank's queries, e.g. DeepSeek-V3.2's selection
    ``[B or 1, 1, S/cp, S]`` → those of the ulysses group's queries ``[B or 1, 1, u·S/cp, S]``, in
    rank order (the order of the queries after the all-to-all, ``query_chunks``). Each row was made
    by the rank holding its query, against every key of the sequence: for the indexer, the same
    top-k as in one process."""
    return _concatenated(rows.to(torch.uint8), group, u, dim=dim).bool()   # (gloo gathers no bool)


class HeadShards:
    """The model's ``hooks.head_shards`` (DeepSeek-V4's attention under ulysses / hybrid): this rank's
    queries ``[B, S/cp, h, d]`` (all its heads) → the ulysses group's queries for this rank's
    ``h/u`` heads (all-to-all), attended over the whole sequence's keys ``kv`` (the same on every
    rank) with the group's mask rows and those heads' sinks; the output goes back by the reverse
    all-to-all. ``rank``: this rank's place in the ulysses group (its block of heads).

    ``asynchronous`` (``context_parallel_async``; ``h`` divisible by ``2u``): the heads are cut in
    two groups, each exchanged by its own all-to-all, both started at once: the second group's
    exchange runs while the first group's attention computes, and the first group's output goes
    back while the second's computes (the other families' core attention: ``_forward_async``).
    Each query head meets the same keys, rows and sink as in the one exchange: the same numbers."""

    def __init__(self, group: dist.ProcessGroup, u: int, rank: int, asynchronous: bool):
        self.group, self.u, self.rank = group, u, rank
        # waiting on the handles cannot be traced: the attention reports it (V4Attention.breaks_compiled_graphs)
        self.asynchronous = asynchronous

    def __call__(self, attend, q: torch.Tensor, kv: torch.Tensor, allowed: torch.Tensor,
                 sinks: torch.Tensor) -> torch.Tensor:
        rows = _gathered_rows(allowed, self.group, self.u, dim=1)
        parts = 2 if self.asynchronous and q.shape[2] % (2 * self.u) == 0 else 1
        width = q.shape[2] // parts       # heads of one group, before the exchange
        heads = width // self.u           # this rank's heads of one group, after it

        def attend_group(p: int, q_p: torch.Tensor) -> torch.Tensor:
            """Group ``p``'s queries of the ulysses group ``[B, u·S/cp, heads, d]`` for this rank's heads."""
            first = p * width + self.rank * heads
            return attend(q_p, kv, rows, sinks[first:first + heads])

        if parts == 1:
            q = comm.all_to_all_dims(q, self.group, scatter_dim=2, gather_dim=1)      # [B, u·S/cp, h/u, d]
            return comm.all_to_all_dims(attend_group(0, q), self.group, scatter_dim=1, gather_dim=2)
        started = []
        for q_p in q.split(width, dim=2):           # every group's exchange in flight before any attends
            handles: list = []
            started.append((comm.start_all_to_all_dims(q_p, self.group, 2, handles), handles))
        outs, out_handles = [], []
        for p, (blocks, handles) in enumerate(started):
            for work in handles:
                work.wait()
            q_p = comm.finish_all_to_all_dims(blocks, 1)
            outs.append(comm.start_all_to_all_dims(attend_group(p, q_p), self.group, 1, out_handles))
        for work in out_handles:
            work.wait()
        return torch.cat([comm.finish_all_to_all_dims(b, 2) for b in outs], dim=2)


def _query_rows(masks: ShardMasks, rank: int, size: int, window_left: int) -> torch.Tensor:
    """The exact mask rows of rank ``rank``'s queries (its two chunks, local order) against every key
    of the sequence ``[B or 1, 1, S/cp, S]``: causal in global positions, window, documents."""
    c, S = masks.chunk, masks.seq
    return torch.cat([masks.mask(j * c, (j + 1) * c, S, window_left) for j in rank_chunks(size, rank)], dim=2)


def indexer_keys(k: torch.Tensor, allowed: Any, window_left: int, shard: _Shard, group: dist.ProcessGroup
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's ``hooks.indexer_keys`` (DeepSeek-V3.2): this rank's indexer keys ``[B, S/cp, D]``
    → every rank's in sequence order ``[B, S, D]``, with this rank's query rows of the whole
    sequence's mask. With autograd when ``k`` has it (the indexer loss): every rank's queries score
    every key, so the backward sums each key's gradient from all ranks back to its own rank."""
    masks = allowed if isinstance(allowed, ShardMasks) else shard.current
    keys = _in_sequence_order(comm.all_gather(k, group, dim=1), shard.size)
    return keys, _query_rows(masks, shard.rank, shard.size, window_left)


def indexer_target_keys(key: torch.Tensor, shard: _Shard, group: dist.ProcessGroup) -> torch.Tensor:
    """The model's ``hooks.indexer_target_keys`` (DeepSeek-V3.2's indexer loss): this rank's attention
    keys ``[B, heads, S/cp, d]`` → every rank's in sequence order ``[B, heads, S, d]`` (no autograd: the
    target is detached), the columns of the indexer's selection (:func:`indexer_keys`)."""
    return _gathered(key.transpose(1, 2), group, shard.size).transpose(1, 2)


def whole_sequence(x: torch.Tensor, positions: torch.Tensor, allowed: Any, shard: _Shard,
                   group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's ``hooks.whole_sequence`` (DeepSeek-V4's attention): this rank's hidden states
    ``[B, S/cp, H]`` → the sequence's ``[B, S, H]`` (all-gathered, backward reduce-scatters the
    partial gradients), their global positions, and this rank's query rows of the sequence's mask."""
    masks = allowed if isinstance(allowed, ShardMasks) else shard.current
    whole = _in_sequence_order(comm.all_gather(x, group, dim=1), shard.size)
    return whole, _gathered(positions, group, shard.size), _query_rows(masks, shard.rank, shard.size, -1)


# ----------------------------------------------------------------------------------------------
# MTP boundary tokens, loss share, MoE statistics
# ----------------------------------------------------------------------------------------------
def boundary_shift(x: torch.Tensor, group: dist.ProcessGroup, cp: int, rank: int) -> torch.Tensor:
    """The model's ``shift_left`` (``x[:, i] ← x[:, i+1]``, zero at the sequence end) on a zig-zag
    shard ``[B, S/cp]``: each chunk's last slot takes the first token of the next global chunk,
    exchanged between the ranks (one all-gather of 2·B values)."""
    c = x.shape[1] // 2
    firsts = torch.stack([x[:, 0], x[:, c]]).to(torch.int64)                 # [2, B]
    gathered = torch.empty((cp * 2, firsts.shape[1]), dtype=firsts.dtype, device=x.device)
    comm._all_gather_single(gathered, firsts.contiguous(), group)
    gathered = gathered.view(cp, 2, -1)                                      # [cp, 2, B]

    def first_of(j: int) -> torch.Tensor:
        if j >= 2 * cp:
            return torch.zeros_like(firsts[0])
        return gathered[j, 0] if j < cp else gathered[2 * cp - 1 - j, 1]

    head, tail = rank_chunks(cp, rank)
    fills = [first_of(head + 1).to(x.dtype)[:, None], first_of(tail + 1).to(x.dtype)[:, None]]
    return torch.cat([x[:, 1:c], fills[0], x[:, c + 1:], fills[1]], dim=1)


def _subgroups(dims, u: int):
    """(ulysses group of ``u`` consecutive cp ranks, all-gather group across the ``cp/u`` groups)."""
    cp_mesh = dims.mesh("cp")
    if u == 1:
        return None, cp_mesh.get_group()
    if u == dims.cp:
        return cp_mesh.get_group(), None
    split = cp_mesh._unflatten(0, (dims.cp // u, u), ("cp_ring", "cp_ulysses"))
    ulysses, ring = split["cp_ulysses"].get_group(), split["cp_ring"].get_group()
    set_group_timeout(dims.collective_timeout, ulysses, ring)
    return ulysses, ring


def apply_context_parallel(model: nn.Module, dims, parallelism: Any) -> None:
    config = model.config
    check_parallel_layout(parallelism, dims, config)     # the method keys and the heads per ulysses rank
    u = cp_ulysses_degree(parallelism)
    cp_mesh = dims.mesh("cp")
    group = cp_mesh.get_group()
    rank, size = cp_mesh.get_local_rank(), cp_mesh.size()
    shard = _Shard(rank, size)      # every layer's attention holds it (tests read its work counters)
    ulysses_group, ring_group = _subgroups(dims, u)
    window = int(config.window_size[0]) if getattr(config, "window_size", None) else -1

    for block in model.blocks():
        attn = block.self_attention
        core = getattr(attn, "core_attention", None)
        if core is None:   # DeepSeek-V4's attention: hooks.whole_sequence below
            continue
        core.context_parallel = ContextParallelAttention(
            core, shard, rank, size, u, ulysses_group, ring_group,
            window if getattr(attn, "use_window", False) else -1, parallelism.context_parallel_async)

    def reduce_stats(counts, prob_sums, tokens):
        counts = counts.clone()
        dist.all_reduce(counts, group=group)
        return counts, comm.all_reduce(prob_sums, group), tokens * size

    def share(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """A shard's masked mean → its share of the sequence's mean, times cp (module docstring)."""
        local = mask.sum().to(torch.float32)
        total = local.detach().clone()
        dist.all_reduce(total, group=group)
        return loss * (local / total.clamp_min(1.0) * size).to(loss.dtype)

    def shard_inputs(call: dict[str, Any]) -> tuple[dict[str, Any], ShardMasks]:
        """A forward's arguments (by name) → this rank's: ``input_ids``, ``labels``, ``loss_mask``
        and ``position_ids`` (global positions, ``arange(S)`` when absent) at the zig-zag positions;
        ``attention_mask`` / ``actual_seq_len`` (whole sequence) taken out into the forward's
        :class:`ShardMasks`, which is also returned."""
        ids = call["input_ids"]
        B, S = ids.shape
        if S % (2 * size):
            raise ValueError(f"context parallel: sequence length {S} is not divisible by 2 * context_parallel "
                             f"{size} (two zig-zag chunks per rank)")
        index = shard_positions(S, size, rank, ids.device)
        positions = call.get("position_ids")
        if positions is None:
            positions = torch.arange(S, device=ids.device)
        positions = positions.to(device=ids.device, dtype=torch.long).expand(B, S)
        masks = shard.reset(B, S, ids.device, call.pop("attention_mask", None), call.pop("actual_seq_len", None))
        for name in ("input_ids", "labels", "loss_mask"):
            if call.get(name) is not None:
                call[name] = call[name].index_select(1, index.to(call[name].device))
        call["position_ids"] = positions.index_select(1, index)
        return call, masks

    hooks = model.hooks          # shared by the MoE layers and the pipeline stages
    hooks.aux_stats_reduce = reduce_stats
    hooks.loss_share = share
    hooks.shift_left = functools.partial(boundary_shift, group=group, cp=size, rank=rank)
    hooks.shard_inputs = shard_inputs
    if getattr(config, "sparse_attention", False):
        hooks.indexer_keys = functools.partial(indexer_keys, shard=shard, group=group)
        hooks.indexer_target_keys = functools.partial(indexer_target_keys, shard=shard, group=group)
    if getattr(config, "v4_attention", False):
        hooks.whole_sequence = functools.partial(whole_sequence, shard=shard, group=group)
        if u > 1:
            hooks.head_shards = HeadShards(ulysses_group, u=u, rank=rank % u,
                                           asynchronous=parallelism.context_parallel_async)


__all__ = ["ContextParallelAttention", "HeadShards", "ShardMasks", "apply_context_parallel", "attention_work",
           "boundary_shift", "rank_chunks", "shard_positions"]
