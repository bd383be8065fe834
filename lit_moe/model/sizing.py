"""Parameter counts and FLOPs per token, from the config alone (no model needed).

Parameters (no biases; norm weights counted, LayerNorm counts weight and bias):

- MLA per layer: q (h·r_q + r_q + r_q·n·d_qk, or h·n·d_qk without q_lora) + kv (h·(r_kv + d_r) + r_kv
  + r_kv·n·(d_n + d_v)) + o (n·d_v·h); latent norms only with ``qk_layernorm``. DeepSeek-V3.2's
  indexer adds r_q·n_i·d_i + h·d_i + 2·d_i (its key LayerNorm) + h·n_i.
- dense layer = MLA + 2 norms + 3·h·F; MoE layer = MLA + 2 norms + router E·h + E·3·h·F_e
  + shared 3·h·F_s; *active* counts K of the E routed experts.
- ``total`` / ``active``: the main model (embedding, layers, final norm, head) — what Hugging Face's
  ``DeepseekV3ForCausalLM`` holds (it ignores MTP; expert biases are buffers). ``mtp``: the MTP
  modules on top (each a decoder layer + enorm + hnorm + eh_proj 2h·h + final norm; embedding and
  head shared).

FLOPs per token (Megatron's ``num_floating_point_operations``, MLA branch; 1 multiply-add = 2 FLOPs;
training = 3 × forward, hence the factor 6 = 2 · 3):

- attention projections per layer: 6·[r_q(h + n·d_qk + 1) + r_kv(h + n(d_n + d_v) + 1) + h·d_r + n·d_v·h]
  (without q_lora the q term is h·n·d_qk);
- core attention per layer: 6·(n·d_qk/2 + n·d_v/2)·s_eff, where s_eff = s for causal attention (the /2
  is the causal discount) and, for a sliding-window layer of left size w, s_eff = 2·mean_i min(i+1, w+1)
  (with DeepSeek-V3.2's indexer min(i+1, index_topk): the architecture's count, although lit_moe runs
  the attention dense under the top-k mask; not in its dense warm-up stage, which attends every key);
- DeepSeek-V3.2's indexer per layer, forward only (it gets no gradient): 2·(r_q·n_i·d_i + h·d_i + h·n_i)
  for its projections + 2·n_i·d_i·s/2 for the causal scores;
- MLP: 6·h·3F per dense layer; 6·h·3·F_e·(K + shared multiple) per MoE layer (router GEMM ignored);
- logits: 6·h·V·(1 + D); each MTP depth adds its decoder layer and 6·(3h + 2h²).
``flops_per_token(..., training=False)`` returns the forward-only third.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from lit_moe.model.config import DeepseekV3Config


@dataclass(frozen=True)
class ParamCounts:
    total: int
    """Main model parameters (as Hugging Face counts them)."""
    active: int
    """Main model parameters used per token (K routed experts of each MoE layer)."""
    mtp: int
    """MTP modules' own parameters (embedding and head shared, not included)."""
    mtp_active: int
    """MTP parameters used per token."""
    embedding: int
    """Token embedding (+ learned position table)."""

    @property
    def total_with_mtp(self) -> int:
        """What ``sum(p.numel() for p in model.parameters())`` gives."""
        return self.total + self.mtp


def _as_config(config: Union[DeepseekV3Config, dict]) -> DeepseekV3Config:
    return config if isinstance(config, DeepseekV3Config) else DeepseekV3Config(**config)


def _norm(c: DeepseekV3Config, dim: int) -> int:
    return dim if c.normalization == "RMSNorm" else 2 * dim


def _attention_params(c: DeepseekV3Config) -> int:
    h, n = c.hidden_size, c.num_attention_heads
    if not c.multi_latent_attention:   # grouped-query attention
        d, kv = c.gqa_head_dim, c.kv_heads
        bias = (n + 2 * kv) * d if c.attention_bias else 0
        qk_norms = 2 * _norm(c, d) if c.qk_layernorm else 0
        return h * (n + 2 * kv) * d + bias + qk_norms + n * d * h
    latent_norm = _norm(c, c.kv_lora_rank) if c.qk_layernorm else 0
    if c.q_lora_rank is None:
        q = h * n * c.qk_head_dim
    else:
        q = h * c.q_lora_rank + c.q_lora_rank * n * c.qk_head_dim
        q += _norm(c, c.q_lora_rank) if c.qk_layernorm else 0
    kv = h * (c.kv_lora_rank + c.qk_rope_head_dim) + latent_norm + c.kv_lora_rank * n * (c.qk_nope_head_dim + c.v_head_dim)
    return q + kv + n * c.v_head_dim * h + _indexer_params(c)


def _indexer_params(c: DeepseekV3Config) -> int:
    """DeepSeek-V3.2's indexer: wq_b, wk, the key LayerNorm, weights_proj (0 without one)."""
    if not c.sparse_attention:
        return 0
    hi, di = c.index_n_heads, c.index_head_dim
    return c.q_lora_rank * hi * di + c.hidden_size * di + 2 * di + c.hidden_size * hi


def _layer_params(c: DeepseekV3Config, i: int) -> tuple[int, int]:
    """(total, active) parameters of decoder layer i."""
    h = c.hidden_size
    base = _attention_params(c) + 2 * _norm(c, h)
    if not c.is_moe_layer(i):
        dense = base + 3 * h * c.intermediate_size
        return dense, dense
    E, K, Fe = c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size
    shared = 3 * h * c.shared_expert_intermediate_size
    common = base + E * h + shared
    return common + E * 3 * h * Fe, common + K * 3 * h * Fe


def param_counts(config: Union[DeepseekV3Config, dict]) -> ParamCounts:
    c = _as_config(config)
    h, V = c.hidden_size, c.vocab_size
    embedding = V * h + (c.max_position_embeddings * h if c.position_embedding_type == "learned_absolute" else 0)
    total = active = embedding + _norm(c, h) + V * h
    for i in range(c.num_hidden_layers):
        t, a = _layer_params(c, i)
        total, active = total + t, active + a
    mtp = mtp_active = 0
    for k in range(c.num_nextn_predict_layers):
        t, a = _layer_params(c, c.num_hidden_layers + k)
        extra = 3 * _norm(c, h) + 2 * h * h
        mtp, mtp_active = mtp + t + extra, mtp_active + a + extra
    return ParamCounts(total=total, active=active, mtp=mtp, mtp_active=mtp_active, embedding=embedding)


def _effective_span(c: DeepseekV3Config, layer: int, seq_len: int) -> float:
    """s_eff: twice the mean number of keys a query sees (= seq_len for full causal attention)."""
    # the indexer's top-k keys (the dense warm-up stage attends every key)
    limits = [c.index_topk] if c.sparse_attention and c.dsa_indexer_use_sparse_loss else []
    if c.uses_window(layer) and c.window_size[0] >= 0:
        limits.append(c.window_size[0] + 1)
    w = min(limits, default=seq_len)
    if w >= seq_len:
        return float(seq_len)
    keys = w * (w + 1) / 2 + (seq_len - w) * w      # sum_i min(i+1, w)
    return 2.0 * keys / seq_len


def _layer_flops(c: DeepseekV3Config, i: int, seq_len: int) -> float:
    h, n = c.hidden_size, c.num_attention_heads
    r_kv = c.kv_lora_rank
    if not c.multi_latent_attention:   # grouped-query attention: projections, then scores and values
        d = c.gqa_head_dim
        flops = 6.0 * h * (2 * n + 2 * c.kv_heads) * d + 6.0 * n * d * _effective_span(c, i, seq_len)
        return flops + _ffn_flops(c, i)
    if c.q_lora_rank is None:
        q = h * n * c.qk_head_dim
    else:
        q = c.q_lora_rank * (h + n * c.qk_head_dim + 1)
    kv = r_kv * (h + n * (c.qk_nope_head_dim + c.v_head_dim) + 1) + h * c.qk_rope_head_dim
    flops = 6.0 * (q + kv + n * c.v_head_dim * h)
    flops += 6.0 * (n * c.qk_head_dim / 2 + n * c.v_head_dim / 2) * _effective_span(c, i, seq_len)
    if c.sparse_attention:   # the indexer runs forward only
        hi, di = c.index_n_heads, c.index_head_dim
        flops += 2.0 * (c.q_lora_rank * hi * di + h * di + h * hi) + 2.0 * hi * di * seq_len / 2
    return flops + _ffn_flops(c, i)


def _ffn_flops(c: DeepseekV3Config, i: int) -> float:
    h = c.hidden_size
    if c.is_moe_layer(i):
        return 6.0 * h * 3 * (c.moe_intermediate_size * c.num_experts_per_tok + c.shared_expert_intermediate_size)
    return 6.0 * h * 3 * c.intermediate_size


def flops_per_token(config: Union[DeepseekV3Config, dict], seq_len: int, training: bool = True) -> float:
    """Model FLOPs per token at sequence length ``seq_len`` (training = 3 × forward; see module doc)."""
    c = _as_config(config)
    h, D = c.hidden_size, c.num_nextn_predict_layers
    flops = sum(_layer_flops(c, i, seq_len) for i in range(c.num_hidden_layers))
    flops += 6.0 * h * c.vocab_size * (1 + D)
    for k in range(D):
        flops += _layer_flops(c, c.num_hidden_layers + k, seq_len) + 6.0 * (3 * h + 2 * h * h)
    return flops if training else flops / 3.0
