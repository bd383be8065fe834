"""Parallelism: meshes (``ParallelDims``), the Lightning strategy (``ascend_fsdp``), the parallelize
steps (TP → EP → CP → recompute → FSDP2), the NPU accelerator and ``lit_moe plan``.

The Lightning pieces are imported on first use (Lightning takes seconds to import, and worker
processes that only parallelize a model do not need it). Importing ``AscendFSDPStrategy`` (or
``lit_moe.strategies.strategy``) registers the ``ascend_fsdp`` strategy with Lightning, and the ``npu``
accelerator when ``torch_npu`` is importable.
"""

import importlib
from typing import Any

from lit_moe.strategies.clip import clip_grads_with_norm_, global_grad_norm
from lit_moe.strategies.parallel_dims import ParallelDims, ParallelismError

_LAZY = {
    "AscendFSDPStrategy": "lit_moe.strategies.strategy",
    "check_parallelism_section": "lit_moe.strategies.strategy",
    "register_strategy": "lit_moe.strategies.strategy",
    "NPUAccelerator": "lit_moe.strategies.accelerators",
    "register_npu_accelerator": "lit_moe.strategies.accelerators",
    "parallelize": "lit_moe.strategies.parallelize",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lit_moe.strategies' has no attribute {name!r}")


__all__ = [
    "AscendFSDPStrategy",
    "NPUAccelerator",
    "ParallelDims",
    "ParallelismError",
    "check_parallelism_section",
    "clip_grads_with_norm_",
    "global_grad_norm",
    "parallelize",
]
