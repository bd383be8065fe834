"""Normalization layers (MindFormers ``FusedRMSNorm`` / ``FusedLayerNorm``).

Both cast the input to ``compute_dtype`` (the model's ``layernorm_compute_dtype``), normalise with the
fastest fused kernel of the device (torch_npu's ``npu_rms_norm`` on Ascend, torch's fused
``rms_norm``/``layer_norm`` elsewhere) and cast the result back to the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lit_moe.ops._npu import npu_ops

SUPPORTED_NORMS = ("RMSNorm", "LayerNorm")


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in ``compute_dtype``."""

    def __init__(self, dim: int, eps: float = 1e-5, compute_dtype: torch.dtype = torch.float32,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.eps = eps
        self.compute_dtype = compute_dtype
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x = x.to(self.compute_dtype)
        weight = self.weight.to(self.compute_dtype)
        npu = npu_ops(x)
        if npu is not None:
            y = npu.npu_rms_norm(x, weight, epsilon=self.eps)[0]
        else:
            y = F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return y.to(in_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, compute_dtype={self.compute_dtype}"


class LayerNorm(nn.Module):
    """y = w * (x - mean) / sqrt(var + eps) + b, computed in ``compute_dtype``."""

    def __init__(self, dim: int, eps: float = 1e-5, compute_dtype: torch.dtype = torch.float32,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.eps = eps
        self.compute_dtype = compute_dtype
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x = x.to(self.compute_dtype)
        y = F.layer_norm(x, (x.shape[-1],), self.weight.to(self.compute_dtype),
                         self.bias.to(self.compute_dtype), self.eps)
        return y.to(in_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, compute_dtype={self.compute_dtype}"


def check_norm(normalization: str, fused_norm: bool) -> None:
    """The MindFormers ``get_norm_cls`` rules: only the fused RMSNorm / LayerNorm exist."""
    if not fused_norm:
        raise ValueError(f"model.fused_norm: {fused_norm!r} is not supported: only fused normalization "
                         "layers are supported (set fused_norm: True)")
    if normalization not in SUPPORTED_NORMS:
        raise ValueError(f"model.normalization: {normalization!r} is not supported; supported: "
                         + ", ".join(repr(n) for n in SUPPORTED_NORMS))


def build_norm(normalization: str, dim: int, eps: float, compute_dtype: torch.dtype = torch.float32,
               fused_norm: bool = True, dtype: torch.dtype | None = None, device=None) -> nn.Module:
    """``RMSNorm`` or ``LayerNorm`` of width ``dim`` (``normalization`` / ``fused_norm`` as in the YAML)."""
    check_norm(normalization, fused_norm)
    cls = RMSNorm if normalization == "RMSNorm" else LayerNorm
    return cls(dim, eps=eps, compute_dtype=compute_dtype, dtype=dtype, device=device)
