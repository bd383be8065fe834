"""Text generation with the compressed MLA cache (:class:`lit_moe.model.attention.LatentCache`).

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
same logits and draws the same tokens.
"""

from __future__ import annotations

from typing import Optional

import torch

from lit_moe.model.attention import LatentCache, cached_mla
from lit_moe.model.rope import rotary_cos_sin


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
    allowed = step_mask(valid, ids.shape[1])
    h = model.embed(ids, positions)
    for layer in model.layers:
        attn = layer.self_attention
        out = cached_mla(attn, layer.input_layernorm(h), cos, sin, allowed, cache)
        # cached_mla skips the module's forward, hence its tensor-parallel exit: sum the heads' parts here
        h = h + (attn.reduce_scatter(out) if hasattr(attn, "reduce_scatter") else out)
        h = h + layer.mlp(layer.pre_mlp_layernorm(h))
    return model.lm_head(model.norm(h[:, -1:])).float()[:, 0]


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
    model.eval()
    device = model.lm_head.weight.device
    ids, valid = left_pad(prompts, pad_id, device)
    positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
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
