"""Text generation with a cache of the past tokens (:class:`lit_moe.model.attention.LatentCache`: per
layer a pair of ``[B, T, ...]`` tensors that grows by the new tokens), by attention kind:

- MLA (DeepSeek-V3, V3.2): the compressed latent and the rotated shared rope key (V3.2: and the
  indexer's keys), :func:`lit_moe.model.attention.cached_mla`;
- grouped-query attention (Qwen3-MoE, GLM-4-MoE): each layer's keys and values ``[B, T, kv_heads, d]``
  as attention reads them, i.e. after the per-head q/k norm and after the rotary encoding at their
  own positions (partial: the leading ``rotary_dim`` dims), :func:`cached_gqa`;
- DeepSeek-V4: each layer's rotated key/value ``[B, T, head_dim]`` (its sliding window is a mask over
  them) and the layer's attention input ``[B, T, hidden]``, from which the compressors pool the
  complete windows again at each step (their entries, CSA's indexer keys included, are a pure
  function of the windows' inputs), :func:`cached_v4`. mHC streams and hash routing are per token:
  the new tokens' streams go through each layer's hyper-connections, and the hash-routed layers read
  the new tokens' ids. A compressed window counts from the first token of the sequence, so a padded
  prompt would pool padding into its entries: V4 prompts are batched only with prompts of their own
  length (:func:`generate` decodes each length's prompts as one batch, each with its own seeded
  generator).

Prompts of different lengths are left-padded into one batch. A token's rotary position counts only
the real tokens before it (``cumsum(valid) - 1``, as transformers does), so a padded prompt gets the
positions it would have alone; keys that are padding are masked out. A padding query sees only
itself, so no attention row is empty (an empty row gives NaN, which the cache would carry to every
later token through ``0 * NaN``).

Decoding is greedy (``temperature <= 0``) or samples from ``softmax(logits / temperature)``
restricted to the top-p nucleus, with a generator seeded by ``seed`` (the same seed, the same text).
A sequence that produced ``eos_id`` is padded with ``pad_id`` afterwards (transformers' ``generate``).

Under tensor parallel (:func:`lit_moe.tools.predict.whole_sequence_on_every_rank`) every rank keeps the
whole residual stream and the whole (replicated) latent cache, expanded into its own heads; the
partial outputs of the row-parallel layers are summed over the ranks, so every rank computes the
same logits and draws the same tokens (each rank computes its own heads of grouped-query attention from the
replicated residual and caches their keys and values).
"""

from __future__ import annotations

from typing import Optional

import torch

from lit_moe.model.attention import AttentionContext, LatentCache, MLAttention, cached_mla
from lit_moe.model.gqa import GQAttention
from lit_moe.model.hyper_connections import HyperConnectionDecoderLayer, mix_streams
from lit_moe.model.rope import rotary_cos_sin
from lit_moe.model.v4_attention import V4Attention, rotary_angles, rotate_trailing, unweighted_head_norm, visible_entries
from lit_moe.ops import apply_rotary_half


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device | str = "cpu"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids [B, P]`` with each prompt flush right, and ``valid [B, P]`` (False on the padding)."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros((len(prompts), P), dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long, device=device)
        valid[i, P - len(p):] = True
    return ids, valid


def token_positions(valid: torch.Tensor) -> torch.Tensor:
    """The position ``[B, T]`` of every token: how many real tokens come before it (padding: 0)."""
    return (valid.long().cumsum(dim=1) - 1).clamp(min=0)


def step_mask(valid: torch.Tensor, new: int) -> torch.Tensor:
    """Allowed ``[B, 1, new, T]`` for the last ``new`` of ``T = valid.shape[1]`` tokens: earlier or
    equal keys that are not padding, and always the query itself."""
    T = valid.shape[1]
    q = torch.arange(T - new, T, device=valid.device)[:, None]
    k = torch.arange(T, device=valid.device)[None, :]
    return (((q >= k) & valid[:, None, :]) | (q == k))[:, None]


@torch.no_grad()
def forward_step(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                 cache: LatentCache) -> torch.Tensor:
    """fp32 logits ``[B, V]`` of the last of the new tokens ``ids [B, S]`` (``valid`` covers every token
    so far, the new ones included); the cache grows by S."""
    config = model.config
    cos = sin = None
    if config.position_embedding_type in ("rope", "yarn"):
        cos, sin = rotary_cos_sin(config, positions)
    # the new tokens' context: their angles, positions and ids (hash routing), their mask rows over every key
    ctx = AttentionContext(cos, sin, step_mask(valid, ids.shape[1]), None, positions)
    ctx.input_ids = ids
    key_positions = token_positions(valid)
    h = model.streams_in(model.embed(ids, positions))
    for layer in model.layers:
        h = cached_layer(layer, h, ctx, key_positions, cache)
    return model.lm_head(model.norm(model.streams_out(h[:, -1:]))).float()[:, 0]


def cached_layer(layer: torch.nn.Module, h: torch.Tensor, ctx: AttentionContext, key_positions: torch.Tensor,
                 cache: LatentCache) -> torch.Tensor:
    """One decoder layer on the new tokens' residual ``h`` (``[B, S, H]``, or mHC's ``[B, S, n, H]``
    streams), its attention reading the cache."""
    def attend(x: torch.Tensor) -> torch.Tensor:
        attn = layer.self_attention
        out = cached_attention(attn, x, ctx, key_positions, cache)
        # the cached attentions skip the module's forward, hence its tensor-parallel exit: sum the heads' parts here
        return attn.reduce_scatter(out) if hasattr(attn, "reduce_scatter") else out

    if isinstance(layer, HyperConnectionDecoderLayer):
        post, comb, collapsed = layer.attn_hc(h)
        h = mix_streams(h, attend(layer.input_layernorm(collapsed)), post, comb)
        post, comb, collapsed = layer.ffn_hc(h)
        return mix_streams(h, layer.feed_forward(layer.pre_mlp_layernorm(collapsed), ctx), post, comb)
    h = h + attend(layer.input_layernorm(h))
    return h + layer.feed_forward(layer.pre_mlp_layernorm(h), ctx)


def cached_attention(attn: torch.nn.Module, x: torch.Tensor, ctx: AttentionContext, key_positions: torch.Tensor,
                     cache: LatentCache) -> torch.Tensor:
    """The attention of the new tokens ``x [B, S, H]`` over the cached tokens and themselves."""
    if isinstance(attn, MLAttention):
        return cached_mla(attn, x, ctx.cos, ctx.sin, ctx.full_mask, cache)
    if isinstance(attn, GQAttention):
        return cached_gqa(attn, x, ctx.cos, ctx.sin, ctx.full_mask, cache)
    if isinstance(attn, V4Attention):
        return cached_v4(attn, x, ctx.position_ids, key_positions, ctx.full_mask, cache)
    raise TypeError(f"generation has no cache for {type(attn).__name__}")


def cached_gqa(attn: GQAttention, x: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
               allowed: torch.Tensor, cache: LatentCache) -> torch.Tensor:
    """Grouped-query attention of the new tokens ``x [B, S, H]``: their keys and values join the cache
    as every later step reads them (q/k-normed, rotated at the new tokens' positions by ``cos``/``sin``
    ``[B, S, rotary_dim/2]``); ``allowed [B, 1, S, T]`` over the ``T = cache.length + S`` keys.
    Under tensor parallel the projections hand this rank's heads (counted from the shapes)."""
    B, S, _ = x.shape
    q = attn.q_norm(attn.q_proj(x).view(B, S, -1, attn.head_dim))
    k = attn.k_norm(attn.k_proj(x).view(B, S, -1, attn.head_dim))
    v = attn.v_proj(x).view(B, S, -1, attn.head_dim)
    if attn.use_rope:
        q = apply_rotary_half(q, cos[:, :, None], sin[:, :, None], attn.use_fused_rope)
        k = apply_rotary_half(k, cos[:, :, None], sin[:, :, None], attn.use_fused_rope)
    k, v = cache.extend(attn.layer_idx, k, v)                    # [B, T, kv_heads, d]
    group = q.shape[2] // k.shape[2]    # query heads per key/value head
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    out = attn.core_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), allowed)
    return attn.o_proj(out.transpose(1, 2).reshape(B, S, -1))


def cached_v4(attn: V4Attention, x: torch.Tensor, positions: torch.Tensor, key_positions: torch.Tensor,
              allowed: torch.Tensor, cache: LatentCache) -> torch.Tensor:
    """DeepSeek-V4's attention of the new tokens ``x [B, S, H]`` at ``positions [B, S]``: keys are the
    cached rotated key/values within the sliding window (``key_positions [B, T]``) and, in compressed
    layers, the entries pooled from the cached layer inputs (their windows complete by now);
    ``allowed [B, 1, S, T]`` (the step's mask rows)."""
    B, S, _ = x.shape
    cos, sin = rotary_angles(positions, attn.rope_dim, attn.theta)
    q_latent = attn.q_a_norm(attn.q_a_proj(x))
    q = unweighted_head_norm(attn.q_b_proj(q_latent).view(B, S, -1, attn.head_dim), attn.eps)
    q = rotate_trailing(q, cos[:, :, None], sin[:, :, None])
    kv, keys_x = cache.extend(attn.layer_idx, rotate_trailing(attn.kv_norm(attn.kv_proj(x)), cos, sin), x)
    allowed = attn._local_mask(positions, key_positions, allowed)                   # [B, S, T]
    if attn.compressor is not None:
        entries = attn.compressor(keys_x)
        if attn.indexer is not None:
            entry_mask = attn.indexer(x, q_latent, positions, keys_x)
        else:
            entry_mask = visible_entries(positions, entries.shape[1], attn.rate)
        kv, allowed = torch.cat([kv, entries.to(kv.dtype)], dim=1), torch.cat([allowed, entry_mask], dim=-1)
    sinks = attn.sinks.to_local() if hasattr(attn.sinks, "to_local") else attn.sinks   # tensor parallel: its heads'
    out = rotate_trailing(attn._attend(q, kv, allowed, sinks), cos[:, :, None], -sin[:, :, None])
    return attn.o_b_proj(attn.o_a_proj(out.reshape(B, S, -1, attn.o_a_proj.in_features)))


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs [B, V]`` with everything outside the nucleus set to 0 and renormalised: the most
    likely tokens whose cumulative probability before them is below ``top_p`` (at least one)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def pick(logits: torch.Tensor, temperature: float, top_p: float, generator: Optional[torch.Generator]
         ) -> torch.Tensor:
    """Next token ``[B]``: argmax, or a draw from the tempered top-p distribution."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = top_p_filter(torch.softmax(logits / temperature, dim=-1), top_p)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, pad_id: int,
             eos_id: Optional[int] = None, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0
             ) -> list[list[int]]:
    """The new tokens of each prompt (at most ``max_new_tokens``; up to and including ``eos_id``)."""
    lengths = sorted({len(p) for p in prompts})
    if getattr(model.config, "v4_attention", False) and len(lengths) > 1:   # no padding under V4's windows
        rows: list[list[int]] = [[] for _ in prompts]
        for n in lengths:
            batch = [i for i, p in enumerate(prompts) if len(p) == n]
            for i, row in zip(batch, generate(model, [prompts[i] for i in batch], max_new_tokens, pad_id, eos_id,
                                              temperature, top_p, seed)):
                rows[i] = row
        return rows
    model.eval()
    device = model.lm_head.weight.device
    ids, valid = left_pad(prompts, pad_id, device)
    positions = token_positions(valid)
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = LatentCache()
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    out: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        token = pick(forward_step(model, ids, positions, valid, cache), temperature, top_p, generator)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        out.append(token)
        if eos_id is not None:
            done = done | (token == eos_id)
        if bool(done.all()):
            break
        ids, positions = token[:, None], positions[:, -1:] + 1
        valid = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=1)
    tokens = torch.stack(out, dim=1).tolist() if out else [[] for _ in prompts]
    return [_until_eos(row, eos_id) for row in tokens]


def _until_eos(row: list[int], eos_id: Optional[int]) -> list[int]:
    return row[:row.index(eos_id) + 1] if eos_id is not None and eos_id in row else row
