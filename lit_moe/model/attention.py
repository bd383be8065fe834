"""Multi-head latent attention (MLA), the core attention and its masks.

Mask conventions. The model's ``attention_mask`` input follows Megatron: True/1 = *blocked*
(``[B, 1, S, S]``, ``[B, S, S]`` or ``[S, S]``). Internally masks are SDPA-style *allowed* masks
(True = may attend), ``[B or 1, 1, S, S]``; ``None`` means plain causal. Whatever is given, the
causal constraint always applies. ``actual_seq_len`` (MindFormers' compressed EOD mask) holds the
cumulative end offset of each document, per sample ``[B, L]`` (values in [0, S], padded with S or the
last value) or flattened over the micro-batch ``[B*L]`` (offsets over B*S tokens); a query then only
sees earlier tokens of its own document.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lit_moe.model.config import DeepseekV3Config
from lit_moe.model.indexer import LightningIndexer, attention_target, indexer_kl_loss, tied_to_loss
from lit_moe.model.rope import rotary_cos_sin, softmax_scale
from lit_moe.ops import Linear, apply_rotary, build_norm, fused_linear
from lit_moe.ops.attention import block_causal_attention, use_block_causal
from lit_moe.ops.sdpa import sdpa


# ----------------------------------------------------------------------------------------------
# per-forward context
# ----------------------------------------------------------------------------------------------
class AttentionContext:
    """What every layer of one forward shares: rotary cos/sin and the allowed masks.

    A plain class on purpose: FSDP2's forward-input casting and pytree utilities do not descend into
    it, so cos/sin stay in ``rotary_dtype`` when parameters are cast to bf16.
    """

    def __init__(self, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
                 full_mask: Optional[torch.Tensor], window_mask: Optional[torch.Tensor],
                 position_ids: Optional[torch.Tensor] = None):
        self.cos, self.sin = cos, sin
        self.full_mask = full_mask        # None: plain causal
        self.window_mask = window_mask    # used by sliding-window layers
        self.position_ids = position_ids  # [B, S] (DeepSeek-V4's attention computes its own rotary angles)
        self.input_ids: Optional[torch.Tensor] = None   # [B, S], set by the model (hash-routed MoE layers)

    @classmethod
    def build(cls, config: DeepseekV3Config, position_ids: torch.Tensor,
              attention_mask: Optional[torch.Tensor] = None,
              actual_seq_len: Optional[torch.Tensor] = None,
              input_ids: Optional[torch.Tensor] = None) -> "AttentionContext":
        B, S = position_ids.shape
        device = position_ids.device
        cos = sin = None
        if config.position_embedding_type in ("rope", "yarn"):
            cos, sin = rotary_cos_sin(config, position_ids)
        full = allowed_mask(B, S, device, attention_mask=attention_mask, actual_seq_len=actual_seq_len)
        window = None
        if any(config.uses_window(i) for i in range(config.total_layers)):
            window = allowed_mask(B, S, device, attention_mask=attention_mask,
                                  actual_seq_len=actual_seq_len, window_left=config.window_size[0],
                                  force=True)
        ctx = cls(cos, sin, full, window, position_ids)
        ctx.input_ids = input_ids
        return ctx

    def with_positions(self, config: DeepseekV3Config, position_ids: torch.Tensor) -> "AttentionContext":
        """The same masks with rotary angles of other positions (MTP depths)."""
        cos = sin = None
        if self.cos is not None:
            cos, sin = rotary_cos_sin(config, position_ids)
        return AttentionContext(cos, sin, self.full_mask, self.window_mask, position_ids)


def document_ids(actual_seq_len: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """Document index ``[B, S]`` of every token from cumulative document end offsets."""
    ends = actual_seq_len.to(torch.int64)
    if ends.dim() == 1:   # flattened over the micro-batch: offsets over B*S positions
        pos = torch.arange(batch * seq, device=ends.device)
        return torch.searchsorted(ends.contiguous(), pos, right=True).view(batch, seq)
    if ends.dim() != 2 or ends.shape[0] != batch:
        raise ValueError(f"actual_seq_len: expected shape [B, L] or [B*L] with B={batch}, "
                         f"got {tuple(actual_seq_len.shape)}")
    pos = torch.arange(seq, device=ends.device).expand(batch, seq).contiguous()
    return torch.searchsorted(ends.contiguous(), pos, right=True)


def allowed_mask(batch: int, seq: int, device: torch.device, attention_mask: Optional[torch.Tensor] = None,
                 actual_seq_len: Optional[torch.Tensor] = None, window_left: int = -1,
                 force: bool = False, rows: Optional[tuple[int, int]] = None,
                 keys: Optional[int] = None) -> Optional[torch.Tensor]:
    """SDPA-style allowed mask ``[B or 1, 1, S, S]`` = causal ∧ ¬blocked ∧ same-document ∧ window;
    None when that is plain causal (and ``force`` is False). ``rows=(lo, hi)`` and ``keys=K`` give
    only query rows ``[lo, hi)`` against keys ``[0, K)`` of the sequence (context parallel)."""
    if attention_mask is None and actual_seq_len is None and window_left < 0 and not force:
        return None
    lo, hi = rows if rows is not None else (0, seq)
    K = seq if keys is None else keys
    q = torch.arange(lo, hi, device=device)[:, None]
    k = torch.arange(K, device=device)[None, :]
    allowed = (q >= k)[None, None]                                  # [1, 1, hi-lo, K]
    if window_left >= 0:
        allowed = allowed & (q - k <= window_left)[None, None]
    if attention_mask is not None:
        blocked = attention_mask.to(device)
        if blocked.dtype != torch.bool:
            blocked = blocked > 0.5
        if blocked.dim() == 2:
            blocked = blocked[None, None]
        elif blocked.dim() == 3:
            blocked = blocked[:, None]
        if blocked.dim() != 4 or blocked.shape[-2:] != (seq, seq) or blocked.shape[1] != 1:
            raise ValueError(f"attention_mask: expected [B, 1, S, S], [B, S, S] or [S, S] with S={seq}, "
                             f"got {tuple(attention_mask.shape)}")
        allowed = allowed & ~blocked[:, :, lo:hi, :K]
    if actual_seq_len is not None:
        doc = document_ids(actual_seq_len.to(device), batch, seq)
        allowed = allowed & (doc[:, lo:hi, None] == doc[:, None, :K])[:, None]
    return allowed


# ----------------------------------------------------------------------------------------------
# core attention
# ----------------------------------------------------------------------------------------------
class CoreAttention(nn.Module):
    """softmax(scale * q k^T + mask) v on ``[B, heads, S, d]`` tensors (d_v may differ from d_qk).

    Context parallelism fills :attr:`context_parallel` (and the communication steps it names, for
    ``recompute_comm``); the module stays where it is, so its path selects the same attention with or
    without it (``recompute.select_module``: ``self_attention.core_attention``).
    """

    def __init__(self, scale: float, attention_dropout: float = 0.0, use_flash_attention: bool = True,
                 softmax_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.scale = scale
        self.attention_dropout = attention_dropout
        self.use_flash_attention = use_flash_attention
        self.softmax_dtype = softmax_dtype
        # QK-clip (lit_moe.optim.qk_clip): per-head running maximum of the scaled logits while training
        self.track_max_logits = False
        self.max_logits: Optional[torch.Tensor] = None
        # context parallelism (lit_moe.strategies.context_parallel.ContextParallelAttention):
        # ``(q, k, v, allowed)`` of this rank's tokens -> their attention over the whole sequence,
        # calling :meth:`attend` on the pieces; None: the tokens are the whole sequence
        self.context_parallel: Optional[Callable[..., torch.Tensor]] = None
        # its communication steps, set by it and called through this module (recompute_comm paths
        # ``self_attention.core_attention.all_gather`` / ``.all_to_all``); None: not used
        self.all_gather: Optional[Callable[..., torch.Tensor]] = None
        self.all_to_all: Optional[Callable[..., torch.Tensor]] = None

    @property
    def breaks_compiled_graphs(self) -> bool:
        """Context parallel's asynchronous all-to-alls wait on handles (:mod:`lit_moe.model.compile`)."""
        return bool(getattr(self.context_parallel, "asynchronous", False))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Any = None) -> torch.Tensor:
        if self.context_parallel is not None:
            return self.context_parallel(q, k, v, allowed)
        return self.attend(q, k, v, allowed)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               allowed: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The attention of ``q`` over ``k``, ``v`` (``allowed``: the mask, None: causal)."""
        if self.track_max_logits and self.training:
            self.track_logits(q, k, allowed)
        dropout = self.attention_dropout if self.training else 0.0
        if self.use_flash_attention and allowed is None and dropout == 0.0 and use_block_causal(q):
            # plain causal on a CPU: skip the masked half and stay in the GEMM dtype (ops/attention.py)
            return block_causal_attention(q, k, v, self.scale, self.softmax_dtype)
        if self.use_flash_attention:   # fused SDPA; on CUDA cuDNN -> flash -> memory-efficient (ops/sdpa.py)
            return sdpa(q, k, v, allowed, dropout, self.scale)
        scores = torch.matmul(q, k.transpose(-1, -2)).to(self.softmax_dtype) * self.scale
        if allowed is None:
            S = q.shape[-2]
            allowed = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        # a row with nothing allowed gives NaN; it attends to nothing (as the fused kernels do)
        probs = torch.where(allowed.any(-1, keepdim=True), probs, 0.0)
        probs = F.dropout(probs, p=dropout)
        return torch.matmul(probs.to(v.dtype), v)

    @torch.no_grad()
    def track_logits(self, q: torch.Tensor, k: torch.Tensor, allowed: Optional[torch.Tensor]) -> None:
        """Fold this forward's per-head maximum of ``scale · q·k`` over the batch and the allowed
        (query, key) pairs into :attr:`max_logits` (a running maximum from 0, as MindFormers'
        ``max_logits_val``). One head at a time: ``[B, S, S]`` fp32 at most, besides the attention."""
        S, K = q.shape[-2], k.shape[-2]
        if allowed is None:
            allowed = torch.ones(S, K, dtype=torch.bool, device=q.device).tril()
        heads = []
        for h in range(q.shape[1]):
            logits = torch.matmul(q[:, h].float(), k[:, h].float().transpose(-1, -2)) * self.scale
            heads.append(logits.masked_fill(~allowed[:, 0] if allowed.dim() == 4 else ~allowed,
                                            float("-inf")).amax())
        step_max = torch.stack(heads).clamp(min=0.0)
        self.max_logits = step_max if self.max_logits is None else torch.maximum(self.max_logits, step_max)

    def extra_repr(self) -> str:
        return f"scale={self.scale:.6g}, flash={self.use_flash_attention}, softmax_dtype={self.softmax_dtype}"


# ----------------------------------------------------------------------------------------------
# MLA
# ----------------------------------------------------------------------------------------------
class MLAttention(nn.Module):
    """DeepSeek-V3 multi-head latent attention.

    q = W_qb RMSNorm(W_qa x) (or q_proj x), kv latent c = RMSNorm(W_kva x)[:r_kv], shared rope key
    k_pe = W_kva x [r_kv:]; [k_nope | v] per head = W_kvb c; q_pe and k_pe rotated; scores over
    [q_nope | q_pe] . [k_nope | k_pe]. Head counts come from tensor shapes, so tensor parallelism can
    shard the head dimension of q_b_proj / kv_b_proj / o_proj.
    """

    def __init__(self, config: DeepseekV3Config, layer_idx: int, dtype: torch.dtype | None = None):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.q_lora_rank = c.q_lora_rank
        self.kv_lora_rank = c.kv_lora_rank
        self.qk_nope_head_dim = c.qk_nope_head_dim
        self.qk_rope_head_dim = c.qk_rope_head_dim
        self.qk_head_dim = c.qk_head_dim
        self.v_head_dim = c.v_head_dim
        self.use_rope = c.uses_rope(layer_idx)
        self.use_window = c.uses_window(layer_idx)
        self.use_fused_rope = c.use_fused_rope
        H, n = c.hidden_size, c.num_attention_heads
        ln_dtype = c.torch_dtype("layernorm_compute_dtype")

        def latent_norm(dim: int) -> nn.Module:
            if not c.qk_layernorm:
                return nn.Identity()
            return build_norm(c.normalization, dim, c.rms_norm_eps, ln_dtype, c.fused_norm, dtype=dtype)

        if self.q_lora_rank is None:
            self.q_proj = Linear(H, n * self.qk_head_dim, dtype=dtype)
        else:
            self.q_a_proj = Linear(H, self.q_lora_rank, dtype=dtype)
            self.q_a_layernorm = latent_norm(self.q_lora_rank)
            self.q_b_proj = Linear(self.q_lora_rank, n * self.qk_head_dim, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(H, self.kv_lora_rank + self.qk_rope_head_dim, dtype=dtype)
        self.kv_a_layernorm = latent_norm(self.kv_lora_rank)
        self.kv_b_proj = Linear(self.kv_lora_rank, n * (self.qk_nope_head_dim + self.v_head_dim), dtype=dtype)
        self.o_proj = Linear(n * self.v_head_dim, H, dtype=dtype)
        self.core_attention = CoreAttention(softmax_scale(c), c.attention_dropout, c.use_flash_attention,
                                            c.torch_dtype("softmax_compute_dtype"))
        # DeepSeek-V3.2's sparse attention: the keys each query sees are the indexer's top-k
        self.indexer = LightningIndexer(c, layer_idx, dtype=dtype) if c.sparse_attention else None

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        B, S, _ = x.shape
        q_latent = None
        if self.q_lora_rank is None:
            q = self.q_proj(x)
            latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        else:
            # the two down projections of x as one GEMM (q_a_proj and kv_a_proj_with_mqa stay separate modules)
            q_latent, latent, k_pe = fused_linear(x, self.q_a_proj, self.kv_a_proj_with_mqa).split(
                [self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
            q_latent = self.q_a_layernorm(q_latent)
            q = self.q_b_proj(q_latent)
        q = q.view(B, S, -1, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, S, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_pe = k_pe.view(B, S, 1, self.qk_rope_head_dim)   # one rope key shared by all heads

        if self.use_rope:
            cos, sin = ctx.cos[:, :, None], ctx.sin[:, :, None]
            q_pe = apply_rotary(q_pe, cos, sin, self.use_fused_rope)
            k_pe = apply_rotary(k_pe, cos, sin, self.use_fused_rope)

        heads = q.shape[2]
        query = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)
        key = torch.cat([k_nope, k_pe.expand(B, S, heads, self.qk_rope_head_dim)], dim=-1).transpose(1, 2)
        value = v.transpose(1, 2)
        mask = ctx.window_mask if self.use_window else ctx.full_mask
        train_indexer = False
        if self.indexer is not None:
            self.indexer.loss = None
            train_indexer = self.training and self.indexer.loss_coeff > 0 and torch.is_grad_enabled()
            # selected: each query's keys for the indexer loss (its top-k; in the dense warm-up stage
            # every allowed key); only the sparse stage narrows the attention to them
            if train_indexer:   # the indexer's inputs leave the main model's graph: it learns from its loss only
                selected, scores = self.indexer(x.detach(), q_latent.detach(), ctx.cos, ctx.sin, mask, with_grad=True)
            elif self.indexer.sparse:
                selected, _ = self.indexer(x, q_latent, ctx.cos, ctx.sin, mask)
            if self.indexer.sparse:
                mask = selected
        out = self.core_attention(query, key, value, mask)          # [B, heads, S, d_v]
        if train_indexer:
            target = attention_target(query, key, self.core_attention.scale, selected, self.indexer.hooks)
            self.indexer.loss = self.indexer.loss_coeff * indexer_kl_loss(scores, target, selected)
            if not self.indexer.sparse:
                out = tied_to_loss(out, self.indexer.loss)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


# ----------------------------------------------------------------------------------------------
# generation: MLA with DeepSeek-V3's compressed KV cache
# ----------------------------------------------------------------------------------------------
class LatentCache:
    """What MLA keeps of past tokens while generating, as DeepSeek-V3 does: per layer the normed kv
    latent ``[B, T, kv_lora_rank]`` and the rotated shared rope key ``[B, T, qk_rope_head_dim]``, not
    the per-head keys and values (``kv_b_proj`` expands the latent again at every step). With
    DeepSeek-V3.2's indexer also its rotated keys ``[B, T, index_head_dim]`` per layer (``index_keys``):
    each new query picks its top-k among every token's."""

    def __init__(self) -> None:
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.index_keys: dict[int, torch.Tensor] = {}

    def extend_index_keys(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """Append this step's indexer keys of ``layer``; return every key so far ``[B, T, D]``."""
        if layer in self.index_keys:
            k = torch.cat([self.index_keys[layer], k], dim=1)
        self.index_keys[layer] = k
        return k

    def extend(self, layer: int, latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's entries of ``layer``; return every entry so far."""
        if layer in self.layers:
            old_latent, old_k_pe = self.layers[layer]
            latent, k_pe = torch.cat([old_latent, latent], dim=1), torch.cat([old_k_pe, k_pe], dim=1)
        self.layers[layer] = (latent, k_pe)
        return latent, k_pe

    @property
    def length(self) -> int:
        """Tokens held (0 before the prompt)."""
        return next(iter(self.layers.values()))[0].shape[1] if self.layers else 0


def cached_mla(attn: MLAttention, x: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
               allowed: torch.Tensor, cache: LatentCache) -> torch.Tensor:
    """``attn`` on the new tokens ``x [B, S, H]`` against the cached ones and themselves.

    ``cos``/``sin [B, S, d/2]``: the rotary angles of the new tokens' positions; ``allowed
    [B, 1, S, T]``: which of the ``T = cache.length + S`` keys each new token sees (DeepSeek-V3.2: narrowed
    to each new token's top-k by the indexer, over the cached indexer keys and its own).

    Under tensor parallel the projections are called as modules, so their hooks hand them this rank's
    weights: ``q_b_proj``/``kv_b_proj`` give this rank's heads (``heads`` is counted from ``q``), the
    cached latent and rope key are the same on every rank, and ``o_proj`` returns a partial sum that the
    caller adds up over the ranks (:func:`lit_moe.model.generate.forward_step`)."""
    B, S, _ = x.shape
    q_latent = None
    if attn.q_lora_rank is None:
        q = attn.q_proj(x)
    else:
        q_latent = attn.q_a_layernorm(attn.q_a_proj(x))
        q = attn.q_b_proj(q_latent)
    q_nope, q_pe = q.view(B, S, -1, attn.qk_head_dim).split([attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    latent, k_pe = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    latent, k_pe = attn.kv_a_layernorm(latent), k_pe.view(B, S, 1, attn.qk_rope_head_dim)
    if attn.use_rope:
        q_pe = apply_rotary(q_pe, cos[:, :, None], sin[:, :, None], attn.use_fused_rope)
        k_pe = apply_rotary(k_pe, cos[:, :, None], sin[:, :, None], attn.use_fused_rope)
    latent, k_pe = cache.extend(attn.layer_idx, latent, k_pe)       # [B, T, r], [B, T, 1, d_rope]
    T, heads = latent.shape[1], q.shape[-1] // attn.qk_head_dim
    k_nope, v = attn.kv_b_proj(latent).view(B, T, heads, -1).split([attn.qk_nope_head_dim, attn.v_head_dim], dim=-1)
    query = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)
    key = torch.cat([k_nope, k_pe.expand(B, T, heads, attn.qk_rope_head_dim)], dim=-1).transpose(1, 2)
    if attn.indexer is not None and attn.indexer.sparse:   # DeepSeek-V3.2: the new queries' top-k among every
        # token's indexer keys (the dense warm-up stage attends every allowed key, as its forward)
        index_keys = cache.extend_index_keys(attn.layer_idx, attn.indexer.keys(x, cos, sin))
        allowed = attn.indexer.select(attn.indexer.scores(x, q_latent, cos, sin, index_keys), allowed)
    out = attn.core_attention(query, key, v.transpose(1, 2), allowed)   # [B, heads, S, d_v]
    return attn.o_proj(out.transpose(1, 2).reshape(B, S, -1))
