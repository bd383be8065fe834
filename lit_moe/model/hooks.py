"""``ModelHooks``: the few places where a parallelism changes the model's math, one typed field each.

The model owns one instance (``model.hooks``) whose defaults are the single-device math; its MoE
layers share it. Tensor and context parallelism fill fields of it while they shard the model
(:mod:`lit_moe.strategies`), instead of rebinding the model's attributes, so the model's code says
at each point what can differ and a pipeline stage that shares the model's modules shares its hooks
too (one reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from lit_moe.model.compile import own_graph_breaks


def shift_left(x: torch.Tensor) -> torch.Tensor:
    """x[:, i] ← x[:, i+1], the last column filled with 0 (no wrap-around)."""
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)


@dataclass
class ModelHooks:
    """What a parallel layout changes in the model's forward; every default is the one-device math."""

    per_token_loss: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
    """``(logits [T, V_local], labels [T]) -> [T]`` cross-entropy of each token. None: the local
    fp32 cross-entropy, and the head may fuse it with its matmul (training). Tensor parallel: the
    vocabulary-parallel cross-entropy over this rank's vocabulary columns
    (:func:`lit_moe.strategies.comm.vocab_parallel_cross_entropy`)."""

    loss_share: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
    """``(masked mean loss of this rank's tokens, their mask) -> the loss this rank reports``, applied
    to the main head's and every MTP depth's loss. None: the loss itself. Context parallel: the
    shard's share of the sequence's mean, times cp (:mod:`lit_moe.strategies.context_parallel`)."""

    shift_left: Callable[[torch.Tensor], torch.Tensor] = shift_left
    """The MTP input shift ``x[:, i] ← x[:, i+1]`` (zero at the end). Context parallel: the zig-zag
    shard's shift, exchanging the chunk-boundary tokens with the other ranks."""

    shard_inputs: Optional[Callable[[dict[str, Any]], tuple[dict[str, Any], Any]]] = None
    """``(forward's tensors by name) -> (this rank's tensors, the whole sequence's masks)``, run at the
    start of a forward (the model's and a pipeline stage's). None: the inputs as given. Context
    parallel: this rank's zig-zag positions; the masks ride in the attention context."""

    aux_stats_reduce: Optional[Callable] = None
    """``(expert counts, probability sums, tokens) -> the same over the whole sequences``, for the
    balancing loss (:func:`lit_moe.model.moe.load_balancing_loss`). None: this rank's tokens are whole
    sequences. Context parallel: summed over the cp ranks."""

    indexer_keys: Optional[Callable[[torch.Tensor, Any, int], tuple[torch.Tensor, torch.Tensor]]] = None
    """``(this rank's indexer keys [B, S, D], the attention's mask, the layer's window (-1: none)) ->
    (the keys each query picks from [B, S_k, D], the allowed mask of this rank's queries against them
    [B or 1, 1, S, S_k])``, for DeepSeek-V3.2's indexer (:mod:`lit_moe.model.indexer`). None: the keys
    and mask as given. Context parallel: every cp rank's keys all-gathered into sequence order, and the
    exact mask rows of this rank's zig-zag positions (the indexer ranks each query against every key of
    the sequence)."""

    indexer_target_keys: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    """``(this rank's attention keys [B, heads, S, d]) -> the keys the indexer's selection columns
    name [B, heads, S_k, d]`` (no autograd), for the target of DeepSeek-V3.2's indexer loss
    (:func:`lit_moe.model.indexer.attention_target`). None: the keys as given. Context parallel: every cp
    rank's keys all-gathered into sequence order, as the indexer's own keys (``indexer_keys``)."""

    head_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    """``(a sum over this rank's attention heads) -> the sum over every head`` (no autograd), for the
    target of DeepSeek-V3.2's indexer loss. None: this rank has every head. Tensor parallel: summed over
    the tensor-parallel ranks."""

    whole_sequence: Optional[Callable[[torch.Tensor, torch.Tensor, Any],
                                      tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]] = None
    """``(this rank's hidden states [B, S, H], their positions [B, S], the attention's mask) -> (the
    whole sequence's hidden states [B, S_k, H], their positions [B, S_k], the mask rows of this rank's
    queries against them [B or 1, 1, S, S_k] or None: causal)``, for DeepSeek-V4's attention, whose
    keys (sliding window, compressed windows) span the sequence (:mod:`lit_moe.model.v4_attention`).
    None: the tokens are the whole sequence. Context parallel: all-gathered over the cp ranks into
    sequence order (backward: each rank's gradient summed back to its tokens)."""

    head_shards: Optional[Callable[..., torch.Tensor]] = None
    """``(attend, this rank's queries [B, S, h, d], keys [B, S_k, d], their allowed mask [B, S, S_k],
    per-head sinks [h]) -> attend's output for those queries [B, S, h, d]``, for DeepSeek-V4's attention,
    where ``attend(q, k, allowed, sinks)`` is the sink attention of any queries and heads. None:
    ``attend`` on the arguments. Ulysses / hybrid context parallel: the queries of the ulysses group
    and this rank's ``h/u`` heads meet (all-to-all there and back, the mask rows gathered)."""

    breaks_graphs: Callable[[nn.Module], bool] = own_graph_breaks
    """``(module) -> whether a compiled function calling it would break its graph there`` (the
    ``torch_compile`` switch compiles a smaller function then, :mod:`lit_moe.model.compile`). Default:
    the modules' own account. ``parallelize``'s compile step adds the FSDP2 units (their hooks are
    excluded from tracing)."""

    def plain_loss(self) -> bool:
        """Whether the loss is the local masked mean cross-entropy (no collective inside)."""
        return self.per_token_loss is None and self.loss_share is None


__all__ = ["ModelHooks", "shift_left"]
