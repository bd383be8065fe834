"""Where torch_npu lives, if it does. One lookup, cached: the fused Ascend kernels are optional."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Optional

import torch


@functools.lru_cache(maxsize=None)
def _torch_npu() -> Optional[ModuleType]:
    try:
        import torch_npu  # noqa: F401  (registers the "npu" device with torch)
    except ImportError:
        return None
    return torch_npu


def npu_ops(x: torch.Tensor) -> Optional[ModuleType]:
    """``torch_npu`` when ``x`` lives on an Ascend device (so its fused kernels apply), else None."""
    if x.device.type != "npu":
        return None
    return _torch_npu()
