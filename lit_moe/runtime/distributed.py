"""Process-group and local-tensor helpers shared by every layer (one home for each).

Bottom layer: imports nothing from ``lit_moe``.
"""

from __future__ import annotations

import atexit
import gc
import warnings
from datetime import timedelta
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


def set_group_timeout(timeout: Optional[timedelta], *groups: Optional[dist.ProcessGroup]) -> None:
    """Give ``groups`` the run's collective timeout (None: leave them as they are).

    torch creates every group after the default one (device-mesh dimensions, ``new_group``) with its
    own default, 30 minutes for gloo and 10 for NCCL, not the default group's timeout: a rank stuck in
    a tensor-, expert- or context-parallel collective would hold its peers that long."""
    if timeout is None:
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    with warnings.catch_warnings():
        # torch sets timeouts of gloo and NCCL groups only; others (HCCL, fake) keep their backend's own
        warnings.filterwarnings("ignore", message="Set timeout is now only supported")
        for group in groups:
            if group is not None:
                _set_pg_timeout(timeout, group)

def release_process_groups() -> None:
    """Destroy torch.distributed's groups and collect what still holds them (device meshes and
    DTensors in reference cycles), so every gloo worker thread is joined while Python still runs.

    A gloo worker drops each finished collective right after the caller's wait returns; when that
    drop frees a Python-owned tensor it needs the GIL. If the interpreter is already shutting down,
    Python ends the thread in C++ code that may not be unwound and the process aborts (SIGABRT,
    "terminate called without an active exception") after a run that finished."""
    if is_distributed():
        dist.destroy_process_group()
    gc.collect()


_RELEASE_AT_EXIT: list[bool] = []


def release_process_groups_at_exit() -> None:
    """Run ``release_process_groups`` when the interpreter exits (registered once per process):
    called wherever a process group is created."""
    if not _RELEASE_AT_EXIT:
        atexit.register(release_process_groups)
        _RELEASE_AT_EXIT.append(True)
