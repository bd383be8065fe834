"""Gated activations of the MLPs and experts: ``act(gate) * up`` (MindFormers ``ACTIVATION_MAP``).

``hidden_act``: ``gelu`` (``approximate`` none | tanh), ``silu`` (``inplace``) or ``fusedswiglu``
(silu(gate) * up through torch_npu's fused ``npu_swiglu`` on Ascend, the same math elsewhere).
``use_fused_swiglu: True`` (the graph-mode name) makes ``silu`` take the fused path too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lit_moe.ops._npu import npu_ops

SUPPORTED_ACTIVATIONS = ("gelu", "silu", "fusedswiglu")
SUPPORTED_GELU_APPROXIMATE = ("none", "tanh")


def check_activation(hidden_act: str, approximate: str = "none", use_fused_swiglu: bool | None = None) -> None:
    if hidden_act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"model.hidden_act: activation {hidden_act!r} is not supported; supported: "
                         + ", ".join(repr(a) for a in SUPPORTED_ACTIVATIONS))
    if approximate not in SUPPORTED_GELU_APPROXIMATE:
        raise ValueError(f"model.gelu_approximate: {approximate!r} is not supported; supported: "
                         + ", ".join(repr(a) for a in SUPPORTED_GELU_APPROXIMATE))
    if use_fused_swiglu and hidden_act == "gelu":
        raise ValueError("model.use_fused_swiglu: True needs a SwiGLU activation, but hidden_act is 'gelu'")


class GatedActivation(nn.Module):
    """``act(gate) * up``; ``forward_packed`` takes ``[gate | up]`` concatenated on the last dim."""

    def __init__(self, hidden_act: str = "silu", approximate: str = "none", inplace: bool = False,
                 use_fused_swiglu: bool | None = None, clamp: float | None = None):
        super().__init__()
        # DeepSeek-V4's SwiGLU limit: gate <= clamp and |up| <= clamp ahead of the activation
        self.clamp = clamp
        check_activation(hidden_act, approximate, use_fused_swiglu)
        self.hidden_act = hidden_act
        self.approximate = approximate
        self.inplace = inplace
        # fusedswiglu always asks for the fused kernel; silu only when use_fused_swiglu says so.
        self.fused_swiglu = hidden_act == "fusedswiglu" or (hidden_act == "silu" and bool(use_fused_swiglu))

    def _act(self, gate: torch.Tensor, allow_inplace: bool = True) -> torch.Tensor:
        if self.hidden_act == "gelu":
            return F.gelu(gate, approximate=self.approximate)
        # silu(inplace) overwrites the gate projection's output, which nothing else keeps.
        return F.silu(gate, inplace=allow_inplace and self.inplace and self.hidden_act == "silu")

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.clamp is not None:
            return self._act(gate.clamp(max=self.clamp), allow_inplace=False) * up.clamp(-self.clamp, self.clamp)
        if self.fused_swiglu:
            npu = npu_ops(gate)
            if npu is not None:
                return npu.npu_swiglu(torch.cat([gate, up], dim=-1), dim=-1)
        return self._act(gate) * up

    def forward_packed(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.clamp is not None:
            return self.forward(*gate_up.chunk(2, dim=-1))
        if self.fused_swiglu:
            npu = npu_ops(gate_up)
            if npu is not None:
                return npu.npu_swiglu(gate_up, dim=-1)
        gate, up = gate_up.chunk(2, dim=-1)
        return self._act(gate, allow_inplace=False) * up   # views of one buffer: never in place

    def extra_repr(self) -> str:
        return f"{self.hidden_act}, fused_swiglu={self.fused_swiglu}" + (f", clamp={self.clamp}" if self.clamp else "")
