"""Context parallelism: each of the ``cp`` ranks of a sample runs the model on one contiguous chunk
of the sequence (MindFormers' layout: chunk ``c`` holds positions ``[c·S/cp, (c+1)·S/cp)``, no
zig-zag load balancing).

* **Inputs.** A forward pre-hook on the model slices ``input_ids``, ``labels``, ``loss_mask`` and
  ``position_ids`` (``arange(S)`` when absent, so rotary angles stay the global positions) and takes
  ``attention_mask`` / ``actual_seq_len`` out of the call: they describe the whole sequence and are
  turned into this chunk's attention mask here.
* **Attention.** Each MLA's ``core_attention`` gets the keys and values of all chunks up to its own
  (all-gather over cp, ``self_attention.core_attention.all_gather``; its backward reduce-scatters
  the partial gradients) and the exact mask rows of its queries: causal in global positions, plus
  sliding window, blocked pairs and document boundaries when the batch has them. Later chunks are
  never attended (causal), so they are not used.
* **Loss.** The model's loss on a chunk is a masked mean over the chunk; the run's loss is the
  masked mean over the sequence. Rank ``c`` therefore reports ``cp · sum_c / count_total``: the mean
  over the cp ranks (what data-parallel gradient averaging and loss logging compute) is then exactly
  the sequence's masked mean, and every gradient is the single-process one.
* MoE layers see the whole sequence (``expert_parallel.apply_moe_sequence_split``).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Optional

import torch
from torch import nn

from lit_moe.strategies import comm
from lit_moe.strategies.hooks import around_forward

_FORWARD_ARGS = ("input_ids", "labels", "loss_mask", "position_ids", "attention_mask", "actual_seq_len")


class _ChunkState:
    """Per-forward facts every layer's context-parallel attention needs."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.batch = self.seq = 0
        self.device: Optional[torch.device] = None
        self.attention_mask: Optional[torch.Tensor] = None
        self.actual_seq_len: Optional[torch.Tensor] = None
        self._masks: dict[int, torch.Tensor] = {}

    @property
    def chunk(self) -> int:
        return self.seq // self.size

    @property
    def keys(self) -> int:
        """Keys a causal chunk can see: every position up to the end of its own chunk."""
        return (self.rank + 1) * self.chunk

    def reset(self, batch: int, seq: int, device, attention_mask, actual_seq_len) -> None:
        self.batch, self.seq, self.device = batch, seq, device
        self.attention_mask, self.actual_seq_len = attention_mask, actual_seq_len
        self._masks = {}

    def mask(self, window_left: int = -1) -> torch.Tensor:
        """Allowed mask ``[B or 1, 1, chunk, keys]`` of this rank's queries against keys ``[0, keys)``."""
        if window_left not in self._masks:
            lo, hi = self.rank * self.chunk, (self.rank + 1) * self.chunk
            if self.attention_mask is None and self.actual_seq_len is None:
                q = torch.arange(lo, hi, device=self.device)[:, None]
                k = torch.arange(self.keys, device=self.device)[None, :]
                allowed = k <= q
                if window_left >= 0:
                    allowed = allowed & (q - k <= window_left)
                allowed = allowed[None, None]
            else:
                from lit_moe.model.attention import allowed_mask

                full = allowed_mask(self.batch, self.seq, self.device, attention_mask=self.attention_mask,
                                    actual_seq_len=self.actual_seq_len, window_left=window_left, force=True)
                allowed = full[:, :, lo:hi, : self.keys]
            self._masks[window_left] = allowed
        return self._masks[window_left]


def _bind(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    sig = inspect.signature(model.forward)
    bound = sig.bind_partial(*args, **kwargs)
    return dict(bound.arguments)


def apply_context_parallel(model: nn.Module, cp_mesh) -> None:
    group = cp_mesh.get_group()
    rank, size = cp_mesh.get_local_rank(), cp_mesh.size()
    state = _ChunkState(rank, size)
    config = model.config
    window_left = int(config.window_size[0]) if getattr(config, "window_size", None) else -1

    # ---- attention: keys/values of all chunks up to this one, exact mask rows ----------------
    for block in model.blocks():
        attn = block.self_attention
        core = attn.core_attention
        core.all_gather = functools.partial(comm.all_gather, group=group, dim=2)
        left = window_left if getattr(attn, "use_window", False) else -1

        def before(mod, args, kwargs, left=left):
            q, k, v = args[0], args[1], args[2]
            keys = state.keys
            k = mod.all_gather(k)[:, :, :keys]
            v = mod.all_gather(v)[:, :, :keys]
            return (q, k, v, state.mask(left)), {}, None

        around_forward(core, before)

    # ---- inputs: this rank's chunk; loss: the chunk's share of the sequence mean -------------
    def slice_inputs(mod, args, kwargs):
        call = _bind(mod, args, kwargs)
        ids = call["input_ids"]
        B, S = ids.shape
        if S % size:
            raise ValueError(f"context parallel: sequence length {S} is not divisible by context_parallel {size}")
        lo, hi = rank * (S // size), (rank + 1) * (S // size)
        positions = call.get("position_ids")
        if positions is None:
            positions = torch.arange(S, device=ids.device)
        positions = positions.to(device=ids.device, dtype=torch.long).expand(B, S)
        state.reset(B, S, ids.device, call.pop("attention_mask", None), call.pop("actual_seq_len", None))
        labels = call.get("labels")
        counts = None
        if labels is not None:
            # the loss tokens exactly as DeepseekV3ForCausalLM.forward selects them
            mask = labels != -100
            if call.get("loss_mask") is not None:
                mask = mask & (call["loss_mask"] != 0)
            counts = (mask[:, lo:hi].sum().float(), mask.sum().float())
        for name in ("input_ids", "labels", "loss_mask"):
            if call.get(name) is not None:
                call[name] = call[name][:, lo:hi]
        call["position_ids"] = positions[:, lo:hi]
        return (), call, counts

    def rescale_loss(mod, out, counts):
        if counts is not None and getattr(out, "loss", None) is not None:
            local, total = counts
            # chunk mean × its share of the sequence's loss tokens × cp (see the module docstring)
            out.loss = out.loss * (local / total.clamp_min(1.0) * size).to(out.loss.dtype)
        return out

    around_forward(model, slice_inputs, rescale_loss)

