"""The masked mean cross-entropy of the model's heads (main head and MTP depths).

One definition for every layout: tensor parallel passes its vocabulary-parallel per-token
cross-entropy as ``per_token`` and keeps the masking and the mean.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def cross_entropy_fp32(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy of ``[T, V]`` logits in fp32."""
    return F.cross_entropy(logits.float(), labels, reduction="none")


def masked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                         per_token: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_fp32,
                         ) -> torch.Tensor:
    """sum(CE * mask) / sum(mask) in fp32 (0 when the mask is empty); ``per_token(logits [T, V],
    labels [T]) -> [T]`` computes the cross-entropy of each token."""
    mask = mask.to(torch.float32)
    labels = torch.where(mask > 0, labels, 0).long()   # masked labels may be pads (-1, -100): never indexed
    ce = per_token(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return (ce * mask.reshape(-1)).sum() / mask.sum().clamp_min(1e-8)
