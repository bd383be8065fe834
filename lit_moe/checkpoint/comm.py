"""The few collectives a checkpoint needs, degrading to no-ops in a single process.

Saving and loading exchange small Python objects (file digests, chunk lists, status). They use a
dedicated gloo group so that they work whatever the training backend (nccl, hccl, gloo) and so that
an asynchronous save can run them from its background thread without interleaving with the
training collectives of the main thread.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist


def dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


class Comm:
    def __init__(self, group: Any = None, timeout: Any = None) -> None:
        self.group = group
        self.timeout = timeout   # the group's collective timeout (a timedelta; None: torch's default)
        self.enabled = dist_ready() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if dist_ready() else 0
        self.world = dist.get_world_size() if dist_ready() else 1

    @classmethod
    def create(cls, timeout: Any = None) -> "Comm":
        """A communicator on a new gloo group over all ranks (collective: every rank must call it).
        ``timeout`` (a ``timedelta``): how long a rank waits for the others (the run's collective
        timeout, so that a dead rank ends a save with an error rather than a hang)."""
        if not (dist_ready() and dist.get_world_size() > 1):
            return cls(None)
        return cls(dist.new_group(backend="gloo", timeout=timeout), timeout)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.group)

    def wait_for_all(self, timeout: Any) -> None:
        """A barrier whose wait is ``timeout`` (a ``timedelta``) rather than the group's: gloo's
        monitored barrier, which names the ranks that did not arrive."""
        if self.enabled and self.group is not None:   # (our groups are gloo; monitored_barrier needs it)
            dist.monitored_barrier(group=self.group, timeout=timeout, wait_all_ranks=True)
        else:
            self.barrier()

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: Any) -> Optional[list[Any]]:
        """To rank 0 (returns None elsewhere)."""
        if not self.enabled:
            return [obj]
        out: Optional[list[Any]] = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
        return out

    def scatter(self, objs: Optional[list[Any]]) -> Any:
        """From rank 0: element ``r`` of ``objs`` goes to rank ``r``."""
        if not self.enabled:
            return objs[0]
        out: list[Any] = [None]
        src = dist.get_global_rank(self.group, 0) if self.group else 0
        dist.scatter_object_list(out, objs if self.rank == 0 else None, src=src, group=self.group)
        return out[0]

    def broadcast(self, obj: Any) -> Any:
        """From rank 0."""
        if not self.enabled:
            return obj
        box = [obj]
        src = dist.get_global_rank(self.group, 0) if self.group else 0
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]
