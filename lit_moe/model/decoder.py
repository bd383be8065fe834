"""The decoder block shared by the main stack and the MTP depths: x + Attn(norm(x)), then
+ MLP-or-MoE(norm(x)). (The mHC variant on residual streams: ``lit_moe/model/hyper_connections.py``.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lit_moe.model.attention import AttentionContext
from lit_moe.model.compile import compile_enabled, compiled
from lit_moe.model.config import DeepseekV3Config
from lit_moe.model.gqa import build_attention
from lit_moe.model.hooks import ModelHooks
from lit_moe.model.moe import MLP, MoE
from lit_moe.ops import build_norm


def block_norm(config: DeepseekV3Config, dim: int, dtype: torch.dtype | None) -> nn.Module:
    """The configured norm (``normalization``, eps, compute dtype, fused kernel) over ``dim``."""
    return build_norm(config.normalization, dim, config.rms_norm_eps,
                      config.torch_dtype("layernorm_compute_dtype"), config.fused_norm, dtype=dtype)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + Attn(norm(x)), then + MLP-or-MoE(norm(x))."""

    def __init__(self, config: DeepseekV3Config, layer_idx: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = block_norm(config, config.hidden_size, dtype)
        self.self_attention = build_attention(config, layer_idx, dtype=dtype)
        self.pre_mlp_layernorm = block_norm(config, config.hidden_size, dtype)
        if config.is_moe_layer(layer_idx):
            self.mlp: nn.Module = MoE(config, dtype=dtype, hash_routed=config.is_hash_layer(layer_idx))
        else:
            self.mlp = MLP(config, config.intermediate_size, dtype=dtype)
        self.hash_routed = config.is_hash_layer(layer_idx)
        self.hidden_dropout = config.hidden_dropout
        self.torch_compile = config.torch_compile
        self.hooks = ModelHooks()   # the model's, shared by its blocks (what breaks a compiled graph)

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        if not compile_enabled(self.torch_compile, x.device):
            return self._forward(x, ctx)
        # A half with a module that breaks compiled graphs (a MoE layer's experts are an FSDP unit on
        # the expert mesh; expert-parallel dispatch sends rows by host-known split sizes; asynchronous
        # context parallel waits on communication handles; a recompute region of a selected
        # submodule) runs eagerly and the other is compiled
        # alone (TorchTitan also keeps MoE dispatch out of its compiled regions).
        attention_ok = not any(map(self.hooks.breaks_graphs, (self.input_layernorm, self.self_attention,
                                                             self.pre_mlp_layernorm)))
        mlp_ok = not self.hooks.breaks_graphs(self.mlp)
        if attention_ok and mlp_ok:
            return compiled(DecoderLayer._forward)(self, x, ctx)
        attention_half = compiled(DecoderLayer._attention_half) if attention_ok else DecoderLayer._attention_half
        mlp_half = compiled(DecoderLayer._mlp_half) if mlp_ok else DecoderLayer._mlp_half
        x, normed = attention_half(self, x, ctx)
        return mlp_half(self, x, normed, ctx)

    def _forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        x, normed = self._attention_half(x, ctx)
        return self._mlp_half(x, normed, ctx)

    def _mlp_half(self, x: torch.Tensor, normed: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        return x + F.dropout(self.feed_forward(normed, ctx), self.hidden_dropout, self.training)

    def feed_forward(self, normed: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """The MLP or MoE; a hash-routed MoE also reads the token ids."""
        return self.mlp(normed, ctx.input_ids) if self.hash_routed else self.mlp(normed)

    def _attention_half(self, x: torch.Tensor, ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """x + Attn(norm(x)), and its pre-MLP norm."""
        x = x + F.dropout(self.self_attention(self.input_layernorm(x), ctx), self.hidden_dropout, self.training)
        return x, self.pre_mlp_layernorm(x)

