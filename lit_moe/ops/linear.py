"""``Linear``: an ``nn.Linear`` (so tensor-parallel plans recognise it) that computes in its input's dtype,
and ``fused_linear``, several of them over one input as one GEMM.

Parameters are kept in ``params_dtype`` (fp32 master weights) while activations flow in
``compute_dtype``; when FSDP2's mixed-precision policy has already cast the weight, the cast is a
no-op. No bias unless asked for (DeepSeek-V3 has none; GLM-4-MoE's q/k/v projections do).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None, device=None,
                 bias: bool = False):
        super().__init__(in_features, out_features, bias=bias, dtype=dtype, device=device)

    def reset_parameters(self) -> None:
        # Real initialisation is the model's init_weights (layout-independent, seeded by name);
        # skipping kaiming here keeps eager construction fast.
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return F.linear(x, self.weight.to(x.dtype))
        return F.linear(x, self.weight.to(x.dtype), self.bias.to(x.dtype))


def _plain(linear: nn.Module) -> bool:
    """A bare ``Linear`` whose weight is a plain tensor: no hooks (tensor parallel swaps in local
    shards, recompute or a user hooks the call) and no ``forward`` replaced on the instance."""
    return (type(linear) is Linear and linear.bias is None and not isinstance(linear.weight, DTensor)
            and not (linear._forward_hooks or linear._forward_pre_hooks) and "forward" not in linear.__dict__)


def fused_linear(x: torch.Tensor, *linears: nn.Module) -> torch.Tensor:
    """``cat([l(x) for l in linears], -1)`` as one GEMM over the concatenated weights.

    The modules and their parameters (names, shapes, checkpoint layout) stay as they are; only the
    call is merged, which reads ``x`` once and launches one kernel instead of several. Where any of
    them is wrapped (a DTensor weight, hooks, a replaced ``forward``), each module is called as
    usual, so parallel plans and recompute keep working."""
    if all(_plain(m) for m in linears):
        return F.linear(x, torch.cat([m.weight.to(x.dtype) for m in linears]))
    return torch.cat([m(x) for m in linears], dim=-1)
