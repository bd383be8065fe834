"""``Linear``: an ``nn.Linear`` (so tensor-parallel plans recognise it) that computes in its input's dtype.

Parameters are kept in ``params_dtype`` (fp32 master weights) while activations flow in
``compute_dtype``; when FSDP2's mixed-precision policy has already cast the weight, the cast is a
no-op. No bias: DeepSeek-V3 has none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None, device=None):
        super().__init__(in_features, out_features, bias=False, dtype=dtype, device=device)

    def reset_parameters(self) -> None:
        # Real initialisation is the model's init_weights (layout-independent, seeded by name);
        # skipping kaiming here keeps eager construction fast.
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))
