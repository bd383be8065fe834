"""Parallelism: meshes (``ParallelDims``), the Lightning strategy (``ascend_fsdp``), the parallelize
steps (TP → EP → CP → recompute → FSDP2), the NPU accelerator and ``lit_moe plan``.

Importing this package registers the ``ascend_fsdp`` strategy with Lightning, and the ``npu``
accelerator when ``torch_npu`` is importable.
"""

from lit_moe.strategies.accelerators import NPUAccelerator, register_npu_accelerator
from lit_moe.strategies.clip import clip_grad_norm_, global_grad_norm
from lit_moe.strategies.parallel_dims import ParallelDims, ParallelismError
from lit_moe.strategies.strategy import AscendFSDPStrategy, check_parallelism_section, register_strategy

register_strategy()
register_npu_accelerator()

__all__ = [
    "AscendFSDPStrategy",
    "NPUAccelerator",
    "ParallelDims",
    "ParallelismError",
    "check_parallelism_section",
    "clip_grad_norm_",
    "global_grad_norm",
]
