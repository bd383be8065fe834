"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual as ``n = hc_mult`` streams.

A decoder layer's input is ``[B, S, n, H]``. Before the attention (and again before the MLP) a
hyper-connection reads the streams, RMS-normalised together (no weight) and projected by ``fn`` to
``n + n + n*n`` numbers per token, each group scaled by its own learned ``scale`` and offset by
``base``:

- pre  = sigmoid(.) + eps: the weights that collapse the streams into the block's input,
- post = 2 sigmoid(.): how much of the block's output each stream receives,
- comb = Sinkhorn-Knopp(softmax(.) + eps): an n×n (nearly) doubly-stochastic mixing of the streams.

The layer's output streams are ``post ⊗ block(norm(Σ_j pre_j x_j)) + combᵀ x`` (stream k receives
Σ_j comb[j, k] x_j). The embedding enters as n copies; after the last layer the streams collapse into
one: a learned head (sigmoid weights from the normalised streams, Hugging Face's ``hc_head``) or their
mean (MindFormers without ``enable_hc_head``). Everything here computes in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lit_moe.model.attention import AttentionContext
from lit_moe.model.compile import compile_enabled, compiled
from lit_moe.model.config import DeepseekV3Config
from lit_moe.model.decoder import DecoderLayer


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim (fp32 statistics, no weight)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sinkhorn(logits: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """Row softmax + eps, one column normalisation, then ``iterations - 1`` row/column rounds."""
    m = torch.softmax(logits, dim=-1) + eps
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


def _copy_full(p: torch.Tensor, value: torch.Tensor) -> None:
    """``p.copy_(value)`` for a plain or a sharded (DTensor, FSDP) parameter; ``value`` is the full tensor."""
    if hasattr(p, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value.to(p.to_local().device), p.device_mesh, p.placements, src_data_rank=None)
    p.copy_(value)


def expand_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, S, H]`` → ``n`` copies ``[B, S, n, H]``."""
    return x.unsqueeze(2).expand(-1, -1, n, -1).contiguous()


class HyperConnection(nn.Module):
    """The pre / post / comb weights of one block (parameters ``fn``, ``base``, ``scale``: Hugging Face's)."""

    def __init__(self, config: DeepseekV3Config):
        super().__init__()
        n, H = config.hc_mult, config.hidden_size
        self.n = n
        self.iterations = config.hc_sinkhorn_iters
        self.eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.init_gating = config.mhc_init_gating_factor
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * H, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    @torch.no_grad()
    def init_extra(self) -> None:
        """MindFormers' start: gating scales ``mhc_init_gating_factor``; collapse bias -log 3 (weights
        1/4 + eps), output bias 0, mixing bias 5 (I - 1) (nearly the identity)."""
        n = self.n
        self.scale.fill_(self.init_gating)
        mixing = (torch.eye(n) - 1) * 5
        _copy_full(self.base, torch.cat([torch.full((n,), -math.log(3)), torch.zeros(n), mixing.flatten()]))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [B, S, n, H]`` → (post ``[B, S, n]``, comb ``[B, S, n, n]``, collapsed ``[B, S, H]``)."""
        B, S, n, _ = streams.shape
        mixes = F.linear(unweighted_rms_norm(streams.reshape(B, S, -1).float(), self.norm_eps), self.fn.float())
        pre, post, comb = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre * self.scale[0] + pre_b) + self.eps
        post = 2 * torch.sigmoid(post * self.scale[1] + post_b)
        comb = sinkhorn((comb * self.scale[2] + comb_b).view(B, S, n, n), self.iterations, self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed


def mix_streams(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
                ) -> torch.Tensor:
    """post ⊗ block_out + combᵀ streams (stream k receives Σ_j comb[j, k] x_j)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ streams


class HyperHead(nn.Module):
    """The learned final collapse (``enable_hc_head``): sigmoid weights from the normalised streams."""

    def __init__(self, config: DeepseekV3Config):
        super().__init__()
        n, H = config.hc_mult, config.hidden_size
        self.eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * H, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    @torch.no_grad()
    def init_extra(self) -> None:
        """Hugging Face's start: weights sigmoid(0) + eps."""
        self.hc_base.zero_()
        self.hc_scale.fill_(1.0)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        B, S = streams.shape[:2]
        mixes = F.linear(unweighted_rms_norm(streams.reshape(B, S, -1).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale + self.hc_base) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)


class MeanCollapse(nn.Module):
    """The final collapse without a head: the mean of the streams (MindFormers, ``enable_hc_head: False``)."""

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        return streams.mean(dim=2)


def build_collapse(config: DeepseekV3Config) -> nn.Module:
    return HyperHead(config) if config.enable_hc_head else MeanCollapse()


class HyperConnectionDecoderLayer(DecoderLayer):
    """The decoder block on ``[B, S, n, H]`` streams: each of its two halves is read through a
    hyper-connection (``attn_hc``, ``ffn_hc``) and written back by :func:`mix_streams`."""

    def __init__(self, config: DeepseekV3Config, layer_idx: int, dtype: torch.dtype | None = None):
        super().__init__(config, layer_idx, dtype=dtype)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, streams: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        # compiled whole or not at all (the halves' split of DecoderLayer passes one tensor between them)
        if compile_enabled(self.torch_compile, streams.device) and not any(map(self.hooks.breaks_graphs, self.children())):
            return compiled(HyperConnectionDecoderLayer._forward)(self, streams, ctx)
        return self._forward(streams, ctx)

    def _forward(self, streams: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        post, comb, collapsed = self.attn_hc(streams)
        out = self.self_attention(self.input_layernorm(collapsed), ctx)
        streams = mix_streams(streams, F.dropout(out, self.hidden_dropout, self.training), post, comb)
        post, comb, collapsed = self.ffn_hc(streams)
        out = self.feed_forward(self.pre_mlp_layernorm(collapsed), ctx)
        return mix_streams(streams, F.dropout(out, self.hidden_dropout, self.training), post, comb)


def build_decoder_layer(config: DeepseekV3Config, layer_idx: int, dtype: torch.dtype | None = None) -> DecoderLayer:
    """The decoder layer of the configured residual: plain, or on mHC streams."""
    if config.enable_hyper_connections:
        return HyperConnectionDecoderLayer(config, layer_idx, dtype=dtype)
    return DecoderLayer(config, layer_idx, dtype=dtype)
