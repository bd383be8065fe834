"""Process-group and local-tensor helpers shared by every layer (one home for each).

Bottom layer: imports nothing from ``lit_moe``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def is_distributed() -> bool:
    """A default process group exists (a launched multi-process run, or one process that Lightning
    initialised)."""
    return dist.is_available() and dist.is_initialized()


def world_size(group: Optional[dist.ProcessGroup] = None) -> int:
    """Ranks in ``group`` (the default group when None); 1 without torch.distributed."""
    return dist.get_world_size(group) if is_distributed() else 1


def global_rank() -> int:
    """This process's rank in the default group; 0 without torch.distributed."""
    return dist.get_rank() if is_distributed() else 0


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds: a DTensor's local tensor, any other tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t
