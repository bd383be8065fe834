"""Device-dispatching building blocks: fused norms, gated activations, rotary kernel, casting Linear,
the fused output-layer loss."""

from lit_moe.ops.activation import SUPPORTED_ACTIVATIONS, GatedActivation, check_activation
from lit_moe.ops.cross_entropy import LMHead, linear_cross_entropy
from lit_moe.ops.linear import Linear, fused_linear
from lit_moe.ops.norm import SUPPORTED_NORMS, LayerNorm, RMSNorm, build_norm, check_norm
from lit_moe.ops.rotary import apply_rotary, apply_rotary_half

__all__ = [
    "SUPPORTED_ACTIVATIONS", "SUPPORTED_NORMS", "GatedActivation", "LMHead", "LayerNorm", "Linear", "RMSNorm",
    "apply_rotary", "apply_rotary_half", "build_norm", "check_activation", "check_norm", "fused_linear", "linear_cross_entropy",
]
