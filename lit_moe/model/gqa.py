"""Grouped-query attention (Qwen3-MoE, GLM-4-MoE): the attention of ``multi_latent_attention: False``.

q, k, v = x W_q (+ b_q), x W_k (+ b_k), x W_v (+ b_v), split into ``head_dim``-wide heads (``num_key_value_heads``
of them for k and v); with ``qk_layernorm`` each q and k head is RMS-normalised (one weight of
``head_dim`` shared by the heads, Qwen3's ``q_norm``/``k_norm``) *before* the rotary encoding, which
turns the leading ``rotary_dim`` dims of each head as rotate-half pairs. Each key/value head serves
``num_attention_heads / num_key_value_heads`` consecutive query heads; the core attention (the MLA
one: masks, kernels, context parallel) runs on the expanded heads, and ``o_proj`` maps back. Head
counts come from tensor shapes, so tensor parallelism can shard q/k/v by heads.
"""

from __future__ import annotations

import torch
from torch import nn

from lit_moe.model.attention import AttentionContext, CoreAttention, MLAttention
from lit_moe.model.config import DeepseekV3Config
from lit_moe.model.rope import softmax_scale
from lit_moe.model.v4_attention import V4Attention
from lit_moe.ops import Linear, apply_rotary_half, build_norm


class GQAttention(nn.Module):
    """Grouped-query attention with optional per-head q/k RMSNorm, q/k/v biases and partial RoPE."""

    def __init__(self, config: DeepseekV3Config, layer_idx: int, dtype: torch.dtype | None = None):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.head_dim = d = c.gqa_head_dim
        self.use_rope = c.uses_rope(layer_idx)
        self.use_window = c.uses_window(layer_idx)
        self.use_fused_rope = c.use_fused_rope
        H, n, kv = c.hidden_size, c.num_attention_heads, c.kv_heads
        self.q_proj = Linear(H, n * d, dtype=dtype, bias=c.attention_bias)
        self.k_proj = Linear(H, kv * d, dtype=dtype, bias=c.attention_bias)
        self.v_proj = Linear(H, kv * d, dtype=dtype, bias=c.attention_bias)
        self.o_proj = Linear(n * d, H, dtype=dtype)
        if c.qk_layernorm:
            ln_dtype = c.torch_dtype("layernorm_compute_dtype")
            self.q_norm = build_norm(c.normalization, d, c.rms_norm_eps, ln_dtype, c.fused_norm, dtype=dtype)
            self.k_norm = build_norm(c.normalization, d, c.rms_norm_eps, ln_dtype, c.fused_norm, dtype=dtype)
        else:
            self.q_norm = self.k_norm = nn.Identity()
        self.core_attention = CoreAttention(softmax_scale(c), c.attention_dropout, c.use_flash_attention,
                                            c.torch_dtype("softmax_compute_dtype"))

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, S, -1, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(B, S, -1, self.head_dim))
        v = self.v_proj(x).view(B, S, -1, self.head_dim)
        if self.use_rope:
            cos, sin = ctx.cos[:, :, None], ctx.sin[:, :, None]
            q = apply_rotary_half(q, cos, sin, self.use_fused_rope)
            k = apply_rotary_half(k, cos, sin, self.use_fused_rope)
        group = q.shape[2] // k.shape[2]    # query heads per key/value head
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        mask = ctx.window_mask if self.use_window else ctx.full_mask
        out = self.core_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


def build_attention(config: DeepseekV3Config, layer_idx: int, dtype: torch.dtype | None = None) -> nn.Module:
    """The attention of a decoder layer: DeepSeek-V4's (``experimental_attention_variant: dsv4_hybrid``),
    MLA, or grouped-query attention (``multi_latent_attention: False``)."""
    if config.v4_attention:
        return V4Attention(config, layer_idx, dtype=dtype)
    if config.multi_latent_attention:
        return MLAttention(config, layer_idx, dtype=dtype)
    return GQAttention(config, layer_idx, dtype=dtype)
