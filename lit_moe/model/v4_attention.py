"""DeepSeek-V4's attention (``experimental_attention_variant: dsv4_hybrid``; Hugging Face
``DeepseekV4Attention``).

Per layer, with d = ``head_dim`` and r = the rotated dims (``head_dim * partial_rotary_factor``):

- queries: q = RMS(W_qb · norm(W_qa x)) per head (the per-head norm has no weight); one key/value
  head: kv = norm(W_kv x), read as both key and value (multi-query);
- RoPE on the *trailing* r dims of q and kv, rotating interleaved pairs (x[2i], x[2i+1]) in place,
  base ``rope_theta`` (sliding layers) or ``compress_rope_theta`` (compressed layers);
- keys = the ``sliding_window`` latest tokens, plus in compressed layers the compressed entries:
  every ``m`` tokens are pooled into one entry by a softmax gate over the window (``kv_proj``,
  ``gate_proj``, ``position_bias``, ``kv_norm``; rotated at the window's first position). A query at
  position t sees the entries whose window has ended (entry w when w < (t+1) // m). HCA
  (``heavily_compressed_attention``) pools non-overlapping windows and attends to every visible
  entry; CSA (``compressed_sparse_attention``) pools two series over overlapping windows of 2m (entry
  w: the first half of window w-1's features with the second half of window w's), and a lightning
  indexer (its own compressor at ``index_head_dim``, queries from the low-rank q) keeps the
  ``index_topk`` best visible entries per query;
- softmax over the keys and a learned per-head sink logit (which takes probability mass, no value);
- the output's rope slice is rotated back by -angle of the query position (k = v carried the key's
  rotation), then the grouped output projection: ``o_groups`` head groups each mapped to
  ``o_lora_rank`` (``o_a_proj``), then ``o_b_proj`` to the model width.

Plain tensor code with the explicit softmax (the sink is not an SDPA option); norms and the
compressor's pooling compute in fp32.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lit_moe.model.attention import AttentionContext
from lit_moe.model.config import DeepseekV3Config
from lit_moe.model.hooks import ModelHooks
from lit_moe.ops import Linear, RMSNorm


# ----------------------------------------------------------------------------------------------
# rotary encoding on interleaved pairs of the trailing dims
# ----------------------------------------------------------------------------------------------
def rotary_angles(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[..., dim/2]`` (fp32) of ``positions`` for pair i at frequency theta^(-2i/dim)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    angles = positions[..., None].float() * inv_freq
    return angles.cos(), angles.sin()


def rotate_trailing(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last ``2 * cos.shape[-1]`` dims of ``x`` as pairs (x[2i], x[2i+1]), kept in place;
    the leading dims pass. cos/sin broadcast against ``x[..., 0::2]`` of that slice."""
    r = 2 * cos.shape[-1]
    rest, rope = x[..., :-r], x[..., -r:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
    return torch.cat([rest, rotated.to(x.dtype)], dim=-1)


def unweighted_head_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# compressors
# ----------------------------------------------------------------------------------------------
class Compressor(nn.Module):
    """Pools every ``rate`` tokens into one entry of width ``dim``: softmax over the window of the
    gate (plus a learned per-slot ``position_bias``) weighting the projected values, then RMSNorm and
    RoPE at the window's first position. ``overlap`` (CSA): two series of ``dim`` features per token;
    entry w pools the first series of window w-1 with the second series of window w (2·rate slots)."""

    def __init__(self, config: DeepseekV3Config, dim: int, rate: int, overlap: bool,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = 2 * dim if overlap else dim
        self.kv_proj = Linear(config.hidden_size, width, dtype=dtype)
        self.gate_proj = Linear(config.hidden_size, width, dtype=dtype)
        self.position_bias = nn.Parameter(torch.empty(rate, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, config.rms_norm_eps, dtype=torch.float32)
        self.rope_dim = config.v4_rope_dim
        self.theta = config.compress_rope_theta

    @torch.no_grad()
    def init_extra(self) -> None:
        self.position_bias.zero_()   # as Hugging Face: the gate alone decides at the start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, S, hidden]`` → entries ``[B, S // rate, dim]`` (windows not yet complete are left out)."""
        B, S, _ = x.shape
        m = self.rate
        W = S // m
        if W == 0:   # no window complete yet (a short prompt): no entry
            return x.new_zeros(B, 0, self.dim)
        kv = self.kv_proj(x[:, :W * m]).float().view(B, W, m, -1)
        gate = self.gate_proj(x[:, :W * m]).float().view(B, W, m, -1) + self.position_bias
        if self.overlap:
            kv, gate = self._overlapping_windows(kv, gate)
        pooled = (kv * gate.softmax(dim=2)).sum(dim=2)
        entries = self.kv_norm(pooled).to(x.dtype)
        positions = torch.arange(W, device=x.device) * m
        cos, sin = rotary_angles(positions, self.rope_dim, self.theta)
        return rotate_trailing(entries, cos, sin)

    def _overlapping_windows(self, kv: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, W, m, 2d]`` → ``[B, W, 2m, d]``: slots [0, m) the first series of the previous window
        (none for window 0: gate -inf), slots [m, 2m) the second series of this window."""
        d = self.dim
        prev_kv = F.pad(kv[:, :-1, :, :d], (0, 0, 0, 0, 1, 0))
        prev_gate = F.pad(gate[:, :-1, :, :d], (0, 0, 0, 0, 1, 0), value=float("-inf"))
        return torch.cat([prev_kv, kv[..., d:]], dim=2), torch.cat([prev_gate, gate[..., d:]], dim=2)


def visible_entries(position_ids: torch.Tensor, entries: int, rate: int) -> torch.Tensor:
    """``[B, S, entries]``: entry w is visible to the query at position t once its window ended, w < (t+1) // m."""
    w = torch.arange(entries, device=position_ids.device)
    return w < ((position_ids + 1) // rate)[..., None]


class Indexer(nn.Module):
    """CSA's lightning indexer: score(t, w) = Σ_h weight_{t,h} · ReLU(q_{t,h} · k_w) / sqrt(d_I)
    (weights from ``weights_proj`` / sqrt(n_h)); keeps the ``index_topk`` best visible entries."""

    def __init__(self, config: DeepseekV3Config, rate: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.heads, self.dim, self.topk, self.rate = config.index_n_heads, config.index_head_dim, config.index_topk, rate
        self.compressor = Compressor(config, self.dim, rate, overlap=True, dtype=dtype)
        self.q_b_proj = Linear(config.q_lora_rank, self.heads * self.dim, dtype=dtype)
        self.weights_proj = Linear(config.hidden_size, self.heads, dtype=dtype)
        self.rope_dim = config.v4_rope_dim
        self.theta = config.compress_rope_theta

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, position_ids: torch.Tensor,
                keys_x: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The allowed mask ``[B, S, W]`` over the compressed entries: the chosen ones that are visible.
        ``keys_x``: the hidden states the entries pool (default ``x``; context parallel: the whole sequence's)."""
        B, S, _ = x.shape
        keys = self.compressor(x if keys_x is None else keys_x).float()              # [B, W, d_I]
        q = self.q_b_proj(q_latent).view(B, S, self.heads, self.dim)
        cos, sin = rotary_angles(position_ids, self.rope_dim, self.theta)
        q = rotate_trailing(q, cos[:, :, None], sin[:, :, None]).float()
        per_head = F.relu(torch.einsum("bshd,bwd->bshw", q, keys)) * self.dim ** -0.5
        weights = self.weights_proj(x).float() * self.heads ** -0.5                  # [B, S, n_h]
        scores = (per_head * weights[..., None]).sum(dim=2)                          # [B, S, W]
        visible = visible_entries(position_ids, keys.shape[1], self.rate)
        scores = scores.masked_fill(~visible, float("-inf"))
        chosen = scores.topk(min(self.topk, keys.shape[1]), dim=-1).indices
        picked = torch.zeros_like(visible).scatter_(-1, chosen, True)
        return picked & visible


# ----------------------------------------------------------------------------------------------
# the attention
# ----------------------------------------------------------------------------------------------
class GroupedLinear(Linear):
    """The block-diagonal output projection ``o_a_proj``: ``[B, S, g, in]`` → ``[B, S, g * rank]``,
    group g through its own rows ``[g*rank, (g+1)*rank)``. The group count is read from the input, so
    a tensor-parallel rank holding whole groups (its heads, their rows) runs the same code."""

    def forward(self, grouped: torch.Tensor) -> torch.Tensor:
        groups = grouped.shape[-2]
        w = self.weight.to(grouped.dtype).view(groups, -1, grouped.shape[-1])        # [g, rank, in]
        return torch.einsum("bsgi,gri->bsgr", grouped, w).flatten(2)


def sink_attention(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor,
                   scale: float, dropout: float, training: bool) -> torch.Tensor:
    """softmax over [q·k * scale (masked) | sink_h] without the sink's column, times k (k = v).
    ``q [B, h, S, d]``, ``k [B, N, d]`` (one head), ``allowed [B, S, N]``."""
    logits = torch.einsum("bhsd,bnd->bhsn", q.float(), k.float()) * scale
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    sink = sinks.float()[None, :, None, None].expand(*logits.shape[:-1], 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    probs = F.dropout(probs, dropout, training)
    return torch.einsum("bhsn,bnd->bhsd", probs, k.float()).to(q.dtype)


class V4Attention(nn.Module):
    """DeepSeek-V4's attention of one layer (module names as Hugging Face's ``self_attn``)."""

    def __init__(self, config: DeepseekV3Config, layer_idx: int, dtype: torch.dtype | None = None):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.layer_type = c.layer_types[min(layer_idx, c.num_hidden_layers - 1)]   # MTP: the last layer's
        self.heads, self.head_dim, self.groups = c.num_attention_heads, c.gqa_head_dim, c.o_groups
        self.window = c.sliding_window
        self.eps = c.rms_norm_eps
        self.rope_dim = c.v4_rope_dim
        self.theta = c.rope_theta if self.layer_type == "sliding_attention" else c.compress_rope_theta
        self.scale = self.head_dim ** -0.5
        self.attention_dropout = c.attention_dropout
        ln = c.torch_dtype("layernorm_compute_dtype")
        self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, dtype=dtype)
        self.q_a_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, ln, dtype=dtype)
        self.q_b_proj = Linear(c.q_lora_rank, self.heads * self.head_dim, dtype=dtype)
        self.kv_proj = Linear(c.hidden_size, self.head_dim, dtype=dtype)
        self.kv_norm = RMSNorm(self.head_dim, c.rms_norm_eps, ln, dtype=dtype)
        group_in = self.heads * self.head_dim // self.groups
        # block-diagonal: group g maps its heads' [group_in] to rows [g*rank, (g+1)*rank)
        self.o_a_proj = GroupedLinear(group_in, self.groups * c.o_lora_rank, dtype=dtype)
        self.o_b_proj = Linear(self.groups * c.o_lora_rank, c.hidden_size, dtype=dtype)
        self.sinks = nn.Parameter(torch.empty(self.heads, dtype=torch.float32))
        self.hooks = ModelHooks()   # the model's (context parallel hands over the whole sequence's keys)
        # compressed layers: the pooled keys; CSA also its indexer (HCA attends to every visible entry)
        self.compressor = self.indexer = None
        if self.layer_type != "sliding_attention":
            self.rate = c.compress_rate(self.layer_type)
            sparse = self.layer_type == "compressed_sparse_attention"
            self.compressor = Compressor(c, self.head_dim, self.rate, overlap=sparse, dtype=dtype)
            self.indexer = Indexer(c, self.rate, dtype=dtype) if sparse else None

    @torch.no_grad()
    def init_extra(self) -> None:
        self.sinks.zero_()   # as Hugging Face

    @property
    def breaks_compiled_graphs(self) -> bool:
        """Asynchronous context parallel waits on its all-to-alls' handles (:mod:`lit_moe.model.compile`)."""
        return bool(getattr(self.hooks.head_shards, "asynchronous", False))

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        B, S, _ = x.shape
        position_ids = ctx.position_ids
        cos, sin = rotary_angles(position_ids, self.rope_dim, self.theta)            # [B, S, r/2]
        q_latent = self.q_a_norm(self.q_a_proj(x))
        # heads counted from q: a tensor-parallel rank holds its own (q_b_proj's rows, sinks, o_a_proj's groups)
        q = unweighted_head_norm(self.q_b_proj(q_latent).view(B, S, -1, self.head_dim), self.eps)
        q = rotate_trailing(q, cos[:, :, None], sin[:, :, None])
        # the keys (window, compressed entries) come from the whole sequence (context parallel: gathered)
        keys_x, key_positions, mask = x, position_ids, ctx.full_mask
        if self.hooks.whole_sequence is not None:
            keys_x, key_positions, mask = self.hooks.whole_sequence(x, position_ids, ctx.full_mask)
        key_cos, key_sin = rotary_angles(key_positions, self.rope_dim, self.theta)
        kv = rotate_trailing(self.kv_norm(self.kv_proj(keys_x)), key_cos, key_sin)  # [B, S_k, d]
        allowed = self._local_mask(position_ids, key_positions, mask)
        if self.compressor is not None:
            entries = self.compressor(keys_x)
            if self.indexer is not None:
                with torch.no_grad():   # a boolean choice: no gradient reaches it, nothing to save for one
                    entry_mask = self.indexer(x, q_latent, position_ids, keys_x)
            else:
                entry_mask = visible_entries(position_ids, entries.shape[1], self.rate)
            kv = torch.cat([kv, entries.to(kv.dtype)], dim=1)
            allowed = torch.cat([allowed, entry_mask], dim=-1)
        if self.hooks.head_shards is not None:   # ulysses context parallel: heads split over the cp ranks
            out = self.hooks.head_shards(self._attend, q, kv, allowed, self.sinks)
        else:
            out = self._attend(q, kv, allowed, self.sinks)                              # [B, S, h, d]
        out = rotate_trailing(out, cos[:, :, None], -sin[:, :, None])
        return self.o_b_proj(self.o_a_proj(out.reshape(B, S, -1, self.o_a_proj.in_features)))

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        """:func:`sink_attention` of queries ``[B, S, h, d]`` (any of them, any heads with their ``sinks``)."""
        return sink_attention(q.transpose(1, 2), kv, allowed, sinks, self.scale, self.attention_dropout,
                              self.training).transpose(1, 2)

    def _local_mask(self, position_ids: torch.Tensor, key_positions: torch.Tensor,
                    full_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """``[B, S, S_k]``: causal within the last ``sliding_window`` positions (and the model's mask)."""
        q, k = position_ids[:, :, None], key_positions[:, None, :]
        allowed = (k <= q) & (q - k < self.window)
        if full_mask is not None:
            allowed = allowed & full_mask[:, 0]
        return allowed
