"""Multi-token prediction (DeepSeek-V3 MTP), depth k = 1..D.

Depth k sees the previous depth's (normalised) hidden state h^{k-1}_i and the embedding of token
t_{i+k}: h' = eh_proj([enorm(emb) | hnorm(h^{k-1})]) → one decoder layer → final_layernorm, and
the shared head predicts t_{i+1+k}. h^0 is the main model's output after its final norm (as
MindFormers/Megatron). The embedding and the head are the main model's (shared).
"""

from __future__ import annotations

import torch
from torch import nn

from lit_moe.model.attention import AttentionContext
from lit_moe.model.config import DeepseekV3Config
from lit_moe.model.decoder import block_norm
from lit_moe.model.hyper_connections import build_collapse, build_decoder_layer, expand_streams
from lit_moe.ops import Linear


class MTPLayer(nn.Module):
    def __init__(self, config: DeepseekV3Config, layer_idx: int, dtype: torch.dtype | None = None):
        super().__init__()
        H = config.hidden_size

        def norm() -> nn.Module:
            return block_norm(config, H, dtype)

        self.enorm = norm()
        self.hnorm = norm()
        self.eh_proj = Linear(2 * H, H, dtype=dtype)
        self.layer = build_decoder_layer(config, layer_idx, dtype=dtype)
        # mHC: the layer runs on streams, expanded from h' and collapsed again (as MindFormers' MTP)
        self.hc_mult = config.hc_mult if config.enable_hyper_connections else 0
        self.hc_head = build_collapse(config) if self.hc_mult else None
        self.final_layernorm = norm()

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """``hidden``: h^{k-1} ``[B, S, H]``; ``embedded``: embeddings of the inputs shifted left by k."""
        h = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        if self.hc_head is None:
            return self.final_layernorm(self.layer(h, ctx))
        return self.final_layernorm(self.hc_head(self.layer(expand_streams(h, self.hc_mult), ctx)))
