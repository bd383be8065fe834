"""``scaled_dot_product_attention`` with the fused backend chosen explicitly on CUDA.

Left to itself, PyTorch's SDPA dispatcher tries flash first, which refuses MLA's head dims
(``d_qk`` 192 ≠ ``d_v`` 128), and then lands on the memory-efficient kernel, whose backward is the
slowest of the three. Here the backends are tried in the order

1. cuDNN attention (fastest on Hopper; it takes ``d_qk ≠ d_v``),
2. flash attention with ``v`` zero-padded to ``d_qk`` and the output sliced back to ``d_v``
   (padding columns of ``v`` only add zero columns to the output; their gradient is dropped),
3. memory-efficient attention,

the first one whose ``torch.backends.cuda.can_use_*`` check passes for the call's dtype, shapes,
mask and dropout runs (only that one is enabled, so no silent fallback), and the choice is logged
once per kind of call. Without any of them, and on every other device, SDPA chooses as usual.

The choice is a function of Python values only (dtype, sizes, flags) and is evaluated once per kind
of call; under ``torch.compile`` it is a constant of the graph (no graph break).
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

log = logging.getLogger(__name__)

SDPA_PRIORITY = ("cudnn", "flash", "efficient")
_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}
_CAN_USE = {"cudnn": "can_use_cudnn_attention", "flash": "can_use_flash_attention",
            "efficient": "can_use_efficient_attention"}


def padded_value(v: torch.Tensor, d_qk: int) -> torch.Tensor:
    """``v [..., d_v]`` with zero columns up to ``d_qk`` (flash attention needs equal head dims)."""
    return F.pad(v, (0, d_qk - v.shape[-1])) if v.shape[-1] < d_qk else v


def _can_use(backend: str, q_shape: tuple, v_dim: int, dtype: torch.dtype, device: torch.device,
             has_mask: bool, dropout: float, requires_grad: bool) -> bool:
    """``torch.backends.cuda.can_use_<backend>`` on stand-in tensors of the call's shapes (batch 1)."""
    check = getattr(torch.backends.cuda, _CAN_USE[backend], None)
    if check is None:
        return False
    _, h, s, d = q_shape
    q = torch.empty((1, h, s, d), dtype=dtype, device=device, requires_grad=requires_grad)
    k = torch.empty_like(q)
    v = torch.empty((1, h, s, v_dim), dtype=dtype, device=device, requires_grad=requires_grad)
    mask = torch.ones((1, 1, s, s), dtype=torch.bool, device=device) if has_mask else None
    try:
        return bool(check(torch.backends.cuda.SDPAParams(q, k, v, mask, dropout, not has_mask, False)))
    except (RuntimeError, TypeError):   # an older signature or a backend not built in
        return False


@functools.cache
def _choose(q_shape: tuple, v_dim: int, dtype: torch.dtype, device: torch.device, has_mask: bool,
            dropout: float, requires_grad: bool) -> tuple[Optional[str], bool]:
    d_qk = q_shape[-1]
    for backend in SDPA_PRIORITY:
        pad = backend == "flash" and v_dim < d_qk
        if _can_use(backend, q_shape, d_qk if pad else v_dim, dtype, device, has_mask, dropout, requires_grad):
            log.info("attention: SDPA backend %s%s for heads=%d d_qk=%d d_v=%d %s %s", backend,
                     f" (v padded {v_dim}->{d_qk})" if pad else "", q_shape[1], d_qk, v_dim,
                     str(dtype).replace("torch.", ""), "masked" if has_mask else "causal")
            return backend, pad
    log.info("attention: no fused SDPA backend for heads=%d d_qk=%d d_v=%d %s: SDPA chooses (math)",
             q_shape[1], d_qk, v_dim, dtype)
    return None, False


@torch.compiler.assume_constant_result
def sdpa_backend(q_shape: tuple, v_dim: int, dtype: torch.dtype, device: torch.device, has_mask: bool,
                 dropout: float, requires_grad: bool) -> tuple[Optional[str], bool]:
    """(backend of :data:`SDPA_PRIORITY` or None, whether ``v`` is padded) for one kind of call."""
    return _choose(q_shape, v_dim, dtype, device, has_mask, dropout, requires_grad)


def _backend_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Optional[torch.Tensor],
                 dropout: float) -> tuple[Optional[str], bool]:
    if q.device.type != "cuda":
        return None, False
    return sdpa_backend(tuple(q.shape), v.shape[-1], q.dtype, q.device, allowed is not None, float(dropout),
                        q.requires_grad or k.requires_grad or v.requires_grad)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Optional[torch.Tensor], dropout: float,
         scale: float) -> torch.Tensor:
    """``softmax(scale q k^T + mask) v`` (causal when ``allowed`` is None) for ``[B, h, S, d]`` tensors."""
    backend, pad = _backend_for(q, k, v, allowed, dropout)
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout,
                                              is_causal=allowed is None, scale=scale)
    d_v = v.shape[-1]
    with sdpa_kernel(_BACKENDS[backend]):
        out = F.scaled_dot_product_attention(q, k, padded_value(v, q.shape[-1]) if pad else v, attn_mask=allowed,
                                             dropout_p=dropout, is_causal=allowed is None, scale=scale)
    return out[..., :d_v] if pad else out
