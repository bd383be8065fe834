"""Rotary position embedding applied to DeepSeek's interleaved pairs.

DeepSeek weights rotate adjacent pairs (x[2i], x[2i+1]) by angle phi_i. We de-interleave
(evens then odds) and apply the rotate-half rotation, exactly as Hugging Face (``rope_interleave``)
and Megatron do, so the output lands in [real parts | imaginary parts] order. q and k get the
same permutation, so q.k is unchanged. The math runs in ``cos.dtype`` (the model's ``rotary_dtype``)
and the result is cast back to the input dtype. On Ascend, torch_npu's fused ``npu_rotary_mul``
does the rotate-half step (``use_fused_rope``).
"""

from __future__ import annotations

import torch

from lit_moe.ops._npu import npu_ops


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 use_fused: bool | None = None) -> torch.Tensor:
    """Rotate ``x [..., d]`` (interleaved pairs) by angles whose cos/sin are ``[..., d/2]`` (broadcastable).

    ``use_fused``: None or True → the fused kernel where the device has one; False → plain torch.
    """
    in_dtype = x.dtype
    x = x.to(cos.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    npu = npu_ops(x) if use_fused is not False else None
    if npu is not None:
        out = npu.npu_rotary_mul(torch.cat([x1, x2], dim=-1), torch.cat([cos, cos], dim=-1),
                                 torch.cat([sin, sin], dim=-1))
    else:
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(in_dtype)
