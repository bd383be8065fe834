"""DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention, DSA): which keys each query of the MLA
attends to (``experimental_attention_variant: dsa``).

For a query token s and a key token t the index score is

    I[s, t] = sum_h  w[s, h] * ReLU(scale * q[s, h] . k[t]),    w = weights_proj(x) / sqrt(index_n_heads)

with ``index_n_heads`` query heads ``q = wq_b(q_latent)`` (the MLA's normed query latent, so the indexer
needs ``q_lora_rank``), one key ``k = LayerNorm(wk(x))`` shared by the heads, both ``index_head_dim``
wide with the rotary encoding on their *leading* ``qk_rope_head_dim`` dims as rotate-half pairs (the MLA
itself rotates interleaved pairs at the end of its heads), and ``scale = index_head_dim^-1/2``. Each
query keeps the ``index_topk`` best keys among those the attention mask allows; the MLA then attends
only to those (the mask is AND-ed with the selection). Where fewer keys are allowed than ``index_topk``
every allowed key is kept, so a sequence no longer than ``index_topk`` is plain causal attention.

The index scores follow transformers' ``DeepseekV32Indexer`` (the reference the logits are checked
against). The top-k choice is not differentiable, so the language-model loss gives the indexer no
gradient. With ``dsa_indexer_loss_coeff > 0`` (the sparse stage, ``dsa_indexer_use_sparse_loss: true``)
a training forward also computes DeepSeek-V3.2's indexer loss (:func:`indexer_kl_loss`): for each query
t with selected keys S_t,

    L_I = coeff * mean_t KL( p[t, S_t] || softmax(I[t, S_t]) ),
    p[t, S_t] = sum over heads of the main attention's probabilities on S_t, L1-renormalised,

with the target detached and the indexer's inputs detached from the main model, so the indexer is
trained by L_I only and the rest of the model by the language-model loss only.

MindFormers' dense warm-up stage (``dsa_indexer_use_sparse_loss: false``, its default) comes before
the sparse stage: the MLA attends every key the mask allows (no top-k narrowing, in training,
evaluation and generation alike), and L_I takes S_t = every allowed key of query t (p the heads' full
attention probabilities summed and L1-renormalised, the KL against the index scores' softmax over the
same keys). As in MindFormers' ``GPTModel`` (``freeze_for_dsa_indexer_warmup``) the model freezes every
parameter outside the indexers at construction (:func:`freeze_all_but_indexers`), so the stage trains
the indexers only; it needs ``dsa_indexer_loss_coeff > 0``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lit_moe.model.hooks import ModelHooks
from lit_moe.ops import LayerNorm, Linear, apply_rotary_half

INDEX_KEY_NORM_EPS = 1e-6   # DeepSeek-V3.2's indexer key LayerNorm (fixed there, not rms_norm_eps)


class LightningIndexer(nn.Module):
    """The per-layer DSA indexer: index scores and the top-k selection mask (Hugging Face's module
    names: ``wq_b``, ``wk``, ``k_norm``, ``weights_proj``)."""

    def __init__(self, config, layer_idx: int, dtype: Optional[torch.dtype] = None):
        super().__init__()
        c = config
        self.n_heads, self.head_dim, self.topk = c.index_n_heads, c.index_head_dim, c.index_topk
        self.rope_dim = c.qk_rope_head_dim
        self.use_rope = c.uses_rope(layer_idx)
        self.use_fused_rope = c.use_fused_rope
        self.scale = self.head_dim ** -0.5
        self.wq_b = Linear(c.q_lora_rank, self.n_heads * self.head_dim, dtype=dtype)
        self.wk = Linear(c.hidden_size, self.head_dim, dtype=dtype)
        self.k_norm = LayerNorm(self.head_dim, INDEX_KEY_NORM_EPS, c.torch_dtype("layernorm_compute_dtype"), dtype=dtype)
        self.weights_proj = Linear(c.hidden_size, self.n_heads, dtype=dtype)
        # the sliding window of this layer's attention (-1: none), which the keys' mask rows follow
        self.window_left = int(c.window_size[0]) if c.uses_window(layer_idx) else -1
        self.hooks = ModelHooks()   # the model's (context parallel gathers the keys)
        # DeepSeek-V3.2's indexer loss: its weight, and this forward's loss (coefficient included; read
        # and cleared by the model, like the MoE balancing loss)
        self.loss_coeff = float(c.dsa_indexer_loss_coeff or 0.0)
        self.loss: Optional[torch.Tensor] = None
        # False: MindFormers' dense warm-up stage (module docstring): the attention is dense and the
        # loss runs over every allowed key
        self.sparse = bool(c.dsa_indexer_use_sparse_loss)

    def keys(self, x: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor]) -> torch.Tensor:
        """One key per token ``[B, S, D]``, rotated at the tokens' positions."""
        k = self.k_norm(self.wk(x))
        if self.use_rope:   # cos/sin [B, S, rope_dim/2]: the leading rope_dim dims turn, the rest pass
            k = apply_rotary_half(k, cos, sin, self.use_fused_rope)
        return k

    def scores(self, x: torch.Tensor, q_latent: torch.Tensor, cos: Optional[torch.Tensor],
               sin: Optional[torch.Tensor], k: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Index scores ``[B, S, S_k]`` (fp32) of every query (rows) against every key ``k`` (columns;
        default: the keys of ``x``)."""
        B, S, _ = x.shape
        q = self.wq_b(q_latent).view(B, S, self.n_heads, self.head_dim)
        if k is None:
            k = self.keys(x, cos, sin)
        if self.use_rope:
            q = apply_rotary_half(q, cos[:, :, None], sin[:, :, None], self.use_fused_rope)
        q, k_t = q.float(), k.float().transpose(1, 2)                          # [B, S, heads, D], [B, D, S_k]
        weights = self.weights_proj(x).float() * self.n_heads ** -0.5       # [B, S, heads]
        # one head at a time: [B, S, S_k] at most besides the result (all heads at once would be heads x that)
        out = torch.zeros(B, S, k_t.shape[-1], dtype=torch.float32, device=x.device)
        for h in range(self.n_heads):
            out += weights[:, :, h, None] * F.relu(torch.bmm(q[:, :, h], k_t) * self.scale)
        return out

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, cos: Optional[torch.Tensor],
                sin: Optional[torch.Tensor], allowed: Any, with_grad: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(selected, scores)``: ``allowed`` (``[B or 1, 1, S, S]``, None: causal) narrowed to each
        query's top-k keys (the dense warm-up stage: not narrowed), and the index scores ``[B, S, S_k]``
        (fp32; with autograd when ``with_grad``, for the indexer loss). With ``hooks.indexer_keys``
        (context parallel) the keys are the whole sequence's and ``selected`` ``[B or 1, 1, S, S_k]``
        has a column per key of the whole sequence."""
        B, S, _ = x.shape
        with torch.set_grad_enabled(with_grad and torch.is_grad_enabled()):
            k = self.keys(x, cos, sin)
            if self.hooks.indexer_keys is not None:
                k, allowed = self.hooks.indexer_keys(k, allowed, self.window_left)
            elif allowed is None:
                allowed = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()[None, None]
            index_scores = self.scores(x, q_latent, cos, sin, k)
        return (self.select(index_scores, allowed) if self.sparse else allowed), index_scores

    @torch.no_grad()
    def select(self, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """``allowed [B or 1, 1, S, S_k]`` narrowed to each query's ``index_topk`` best allowed keys by the
        index ``scores [B, S, S_k]`` (all of them where fewer are allowed)."""
        scores = scores.detach().masked_fill(~allowed[:, 0], float("-inf"))
        chosen = scores.topk(min(self.topk, scores.shape[-1]), dim=-1).indices   # [B, S, k] key positions
        selected = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, chosen, True)
        return allowed & selected[:, None]


def attention_target(query: torch.Tensor, key: torch.Tensor, scale: float, selected: torch.Tensor,
                     hooks: Optional[ModelHooks] = None) -> torch.Tensor:
    """The indexer loss's target ``[B, S, S_k]`` (fp32, detached: the loss must not train the attention):
    the main attention's probabilities ``softmax(scale q.k)`` over each query's selected keys (``selected
    [B or 1, 1, S, S_k]``), summed over the heads of ``query [B, heads, S, d]`` / ``key [B, heads, S_k, d]``
    and L1-renormalised; 0 on a row with no key. One head at a time: ``[B, S, S_k]`` at most besides
    the result. ``hooks`` (the model's): ``indexer_target_keys`` turns this rank's ``key`` into the
    selection's columns (context parallel: the whole sequence's), ``head_sum`` adds the other ranks'
    heads (tensor parallel) before the renormalisation."""
    hooks = hooks or ModelHooks()
    query, key = query.detach(), key.detach()
    if hooks.indexer_target_keys is not None:
        key = hooks.indexer_target_keys(key)
    sel = selected[:, 0]
    total = torch.zeros(query.shape[0], query.shape[2], key.shape[2], dtype=torch.float32, device=query.device)
    for h in range(query.shape[1]):
        logits = torch.matmul(query[:, h].float(), key[:, h].float().transpose(-1, -2)) * scale
        total += torch.softmax(logits.masked_fill(~sel, float("-inf")), dim=-1).nan_to_num(0.0)
    if hooks.head_sum is not None:
        total = hooks.head_sum(total)
    return total / total.sum(-1, keepdim=True).clamp_min(1e-30)


def indexer_kl_loss(scores: torch.Tensor, target: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """``mean_t KL(target[t] || softmax(scores[t] over S_t))`` over every query row of ``scores
    [B, S, S_k]`` (a row with no selected key counts 0), S_t the keys ``selected [B or 1, 1, S, S_k]``
    marks; ``target`` (:func:`attention_target`) is 0 off S_t. The mean is over this rank's query rows:
    context parallel gives every rank as many rows (two zig-zag chunks), so the mean over the ranks
    (what gradient averaging and loss logging compute) is the sequence's mean."""
    sel = selected[:, 0]
    # a finite floor (not -inf) off S_t: a row with nothing selected stays finite in the backward too
    log_q = torch.log_softmax(scores.masked_fill(~sel, torch.finfo(scores.dtype).min), dim=-1)
    log_p = target.clamp_min(torch.finfo(target.dtype).tiny).log()
    kl = (target * (log_p - log_q)).masked_fill(~sel, 0.0).sum(-1)
    return kl.mean()


class _TiedToLoss(torch.autograd.Function):
    """Forward: ``out`` unchanged (the same storage). Backward: ``out``'s gradient, none for ``loss``."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        return out.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def tied_to_loss(out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """The dense warm-up stage: the attention output ``out``, made part of autograd through the indexer
    ``loss`` (no gradient reaches the loss this way: the objective adds it). Every other weight being
    frozen, nothing else would make the layer's output require grad, and a layout's backward hooks on
    it would not run: FSDP's re-gather of the layer's weights (the indexer's among them) before its
    backward. MindFormers ties the loss to the attention output the same way
    (``_IndexerLossAutoScaler``). The cost: the backward runs through the frozen layers' activations."""
    return _TiedToLoss.apply(out, loss)


def freeze_all_but_indexers(model: nn.Module) -> int:
    """MindFormers' dense warm-up stage: ``requires_grad`` off for every parameter of ``model`` outside
    its :class:`LightningIndexer` modules (the MTP layers' indexers train too), so the optimizer holds
    the indexers alone; returns the number of frozen tensors. Buffers (the MoE expert biases) are not
    parameters: their load-balancing update goes on, as in MindFormers."""
    trained = {id(p) for m in model.modules() if isinstance(m, LightningIndexer) for p in m.parameters()}
    frozen = [p for p in model.parameters() if id(p) not in trained]
    for p in frozen:
        p.requires_grad_(False)
    return len(frozen)
