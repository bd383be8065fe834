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
    return _rotate(x, x[..., 0::2], x[..., 1::2], cos, sin, use_fused).to(in_dtype)


def apply_rotary_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      use_fused: bool | None = None) -> torch.Tensor:
    """Rotate the leading ``2 * cos.shape[-1]`` dims of ``x [..., d]`` as rotate-half pairs
    ``(x[i], x[i + r/2])`` (Llama / Qwen3 / GLM-4 weights, Hugging Face's ``rotate_half``); the other
    dims (partial rotary) pass unchanged."""
    in_dtype = x.dtype
    half = cos.shape[-1]
    rot, rest = x[..., :2 * half].to(cos.dtype), x[..., 2 * half:]
    out = _rotate(rot, rot[..., :half], rot[..., half:], cos, sin, use_fused).to(in_dtype)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def _rotate(x: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            use_fused: bool | None) -> torch.Tensor:
    """[x1 cos - x2 sin | x2 cos + x1 sin] (rotate-half form; ``x`` picks the device's kernel)."""
    npu = npu_ops(x) if use_fused is not False else None
    if npu is not None:
        out = npu.npu_rotary_mul(torch.cat([x1, x2], dim=-1), torch.cat([cos, cos], dim=-1),
                                 torch.cat([sin, sin], dim=-1))
    else:
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out
