"""QK-clip (Kimi K2's MuonClip, as MindFormers' PyNative Muon runs it: ``qk_clip_enabled``).

During a step every MLA layer keeps the per-head maximum of its scaled attention logits
``softmax_scale · q·k`` over the batch, the query and the allowed key positions (a running maximum from
0 over the step's micro-batches: :meth:`CoreAttention.track_logits`). After the optimizer step the
maxima are reduced (MAX) over the data-parallel ranks and, where some head reached
``qk_clip_threshold`` τ, each head ``h`` with maximum ``m_h >= τ`` gets ``γ_h = τ / m_h``:

* query rows of head ``h`` (``q_b_proj``, or ``q_proj`` without a query LoRA): the ``qk_nope`` rows
  times ``sqrt(γ_h)``, the ``qk_rope`` rows times ``γ_h``;
* key rows of head ``h`` in ``kv_b_proj``: the ``k_nope`` rows times ``sqrt(γ_h)``; the value rows and
  the rope key shared by all heads (``kv_a_proj_with_mqa``) are left alone.

So every logit of head ``h`` is scaled by exactly ``γ_h`` (nope part ``sqrt(γ)·sqrt(γ)``, rope part
``γ·1``): the largest becomes τ. That is MindFormers' ``apply_qk_clip_scaling`` /
``MLASelfAttention.apply_qk_clip_to_weight`` (weights only, on the fp32 master weights), and the maxima
restart from 0 after each step (its ``MaxLogitsMonitor`` reset).

Where it cannot work yet it is refused in one line (:func:`check_qk_clip_layout`): tensor, context and
pipeline parallel (heads, sequence or layers split across ranks) and LoRA (frozen projections).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from lit_moe.config import ConfigError

log = logging.getLogger(__name__)


def check_qk_clip_layout(dims: Any, lora: Any = None) -> None:
    """One-line :class:`ConfigError` where QK-clip cannot run yet (``dims``: ParallelDims-like)."""
    for name, key in (("tp", "tensor_parallel"), ("cp", "context_parallel"), ("pp", "pipeline_stage")):
        if getattr(dims, name, 1) > 1:
            raise ConfigError(f"optimizer.qk_clip_enabled: QK-clip does not run with {key} "
                              f"{getattr(dims, name)} yet (heads, sequence or layers split across ranks); "
                              "set qk_clip_enabled: false")
    if lora:
        raise ConfigError("optimizer.qk_clip_enabled: QK-clip does not run with lora_config (the query/key "
                          "projections are frozen); set qk_clip_enabled: false")


def _row_scale(gamma: torch.Tensor, parts: list[tuple[int, bool]]) -> torch.Tensor:
    """Per-row factor of a head-major projection: each head's rows are ``parts`` in order, each
    ``(rows, exponent)`` scaled by ``γ ** exponent`` (1: γ, 0.5: sqrt(γ), 0: unchanged)."""
    blocks = [gamma[:, None].pow(exp).expand(-1, rows) for rows, exp in parts]
    return torch.cat(blocks, dim=1).reshape(-1)


def _scale_rows(weight: torch.Tensor, factor: torch.Tensor) -> None:
    """``weight[i, :] *= factor[i]`` in place; a DTensor weight is scaled shard by shard."""
    col = factor.to(device=weight.device, dtype=weight.dtype)[:, None]
    try:
        from torch.distributed.tensor import DTensor, distribute_tensor
    except ImportError:  # pragma: no cover - torch built without distributed
        DTensor = None
    if DTensor is not None and isinstance(weight, DTensor):
        # every rank holds the whole factor: no communication, each keeps its own rows
        col = distribute_tensor(col, weight.device_mesh, weight.placements, src_data_rank=None)
    weight.mul_(col)


class QKClip:
    """The model's MLA layers, their logit maxima and the clip after each optimizer step."""

    def __init__(self, model: nn.Module, threshold: float):
        from lit_moe.model.attention import MLAttention

        self.threshold = float(threshold)
        self.layers = [(n, m) for n, m in model.named_modules() if isinstance(m, MLAttention)]
        if not self.layers:
            raise ConfigError("optimizer.qk_clip_enabled: the model has no multi-latent attention layer to clip")
        for _, layer in self.layers:
            layer.core_attention.track_max_logits = True

    def max_logits(self) -> torch.Tensor:
        """``[layers, heads]`` maxima of this step, reduced (MAX) over the data-parallel ranks."""
        rows = []
        for _, layer in self.layers:
            m = layer.core_attention.max_logits
            kv = layer.kv_b_proj.weight
            heads = kv.shape[0] // (layer.qk_nope_head_dim + layer.v_head_dim)
            rows.append(torch.zeros(heads, device=kv.device) if m is None else m.detach().float().to(kv.device))
        stacked = torch.stack(rows)
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            # tensor/context/pipeline parallel are refused: every rank holds every head of every layer
            cpu = torch.distributed.get_backend() == "gloo"
            reduced = stacked.cpu() if cpu else stacked
            torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX)
            stacked = reduced
        return stacked

    @torch.no_grad()
    def apply(self) -> int:
        """Clip where the step's maxima reached the threshold, then restart the maxima; the number of
        clipped heads (one host read per step, as MindFormers' fire check)."""
        maxima = self.max_logits().cpu()
        clipped = int((maxima >= self.threshold).sum())
        if clipped:
            gammas = torch.where(maxima >= self.threshold, self.threshold / maxima.clamp(min=self.threshold),
                                 torch.ones_like(maxima))
            for (name, layer), gamma in zip(self.layers, gammas):
                if bool((gamma < 1).any()):
                    clip_layer(layer, gamma.double())
            log.debug("QK-clip: %d heads clipped (largest logit %.4g, threshold %g)", clipped,
                      float(maxima.max()), self.threshold)
        for _, layer in self.layers:
            layer.core_attention.max_logits = None
        return clipped


def clip_layer(layer: nn.Module, gamma: torch.Tensor) -> None:
    """Scale one MLA layer's query and key rows by the per-head factors ``gamma`` (module docstring)."""
    nope, rope, v = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim
    q = layer.q_proj if layer.q_lora_rank is None else layer.q_b_proj
    _scale_rows(q.weight, _row_scale(gamma, [(nope, 0.5), (rope, 1.0)]))
    _scale_rows(layer.kv_b_proj.weight, _row_scale(gamma, [(nope, 0.5), (v, 0.0)]))


def build_qk_clip(model: Optional[nn.Module], settings: Any) -> Optional[QKClip]:
    """The :class:`QKClip` of a Muon run with ``qk_clip_enabled`` (None otherwise or without a model)."""
    if model is None or settings.type != "Muon" or not settings.qk_clip_enabled:
        return None
    return QKClip(model, settings.qk_clip_threshold)
