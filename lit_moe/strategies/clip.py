"""Global gradient norm and clipping over gradients that live on different meshes.

``torch.nn.utils.clip_grad_norm_`` fails when gradients mix meshes (dense FSDP/TP parameters next
to experts on the expert mesh) or mix plain tensors and DTensors. MindFormers'
``_calculate_global_grad_norm`` avoids that with one all-reduce: every rank adds the fp32 sum of
squares of its *local* gradient shards, each weighted so that a value held by several ranks is
counted once, and the world sums those. A DTensor gradient with ``k`` distinct shards (the product of
its ``Shard`` mesh dimensions) exists on ``world / k`` ranks, so its local sum of squares is weighted
``k / world``; a plain gradient of a multi-process run is taken as replicated on every rank.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Partial, Shard

from lit_moe.runtime.distributed import local_tensor, world_size

try:  # FSDP2 over an already sharded dimension (experts: ep Shard(0), then FSDP) gives _StridedShard
    from torch.distributed.tensor.placement_types import _StridedShard
    _SHARDS: tuple = (Shard, _StridedShard)
except ImportError:  # pragma: no cover
    _SHARDS = (Shard,)


def _local_grad(grad: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(local tensor, number of distinct shards it is one of)."""
    if not isinstance(grad, DTensor):
        return grad, 1
    if any(isinstance(p, Partial) for p in grad.placements):
        # Pending reductions (only without FSDP): finish them before measuring.
        grad = grad.redistribute(placements=[Replicate() if isinstance(p, Partial) else p
                                             for p in grad.placements])
    shards = 1
    for dim, placement in enumerate(grad.placements):
        if isinstance(placement, _SHARDS):
            shards *= grad.device_mesh.size(dim)
    return grad._local_tensor, shards


def global_grad_norm(parameters: Iterable[torch.Tensor], group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """L2 norm (fp32) of every gradient of ``parameters`` over all ranks, each value counted once."""
    grads = [p.grad for p in parameters if p.grad is not None]
    world = world_size(group)
    total: Optional[torch.Tensor] = None
    # Group local shards by their weight so each group is one fused norm.
    by_weight: dict[tuple[int, torch.device], list[torch.Tensor]] = {}
    device = None
    for g in grads:
        local, shards = _local_grad(g)
        device = local.device
        by_weight.setdefault((shards, local.device), []).append(local.float() if local.dtype != torch.float32 else local)
    for (shards, dev), tensors in by_weight.items():
        norms = torch._foreach_norm(tensors, 2.0)
        sq = torch.stack([n.to(torch.float32) for n in norms]).pow(2).sum() * (shards / world)
        total = sq if total is None else total + sq.to(total.device)
    if total is None:
        dev = device if device is not None else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float32, device=dev)
    if world > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.sqrt()


def clip_grads_with_norm_(parameters: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients in place by ``min(1, max_norm / (total_norm + 1e-6))`` (MindFormers).

    The one clipping rule of lit_moe: ``max_norm <= 0`` does nothing, and a non-finite norm leaves the
    gradients untouched (the skip guard decides what happens to such a step)."""
    grads = [local_tensor(p.grad) for p in parameters if p.grad is not None]
    if max_norm <= 0 or not grads:
        return
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    coef = torch.where(torch.isfinite(total_norm), coef, torch.ones_like(coef))
    by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault((g.device, g.dtype), []).append(g)
    for (dev, dtype), tensors in by_device.items():
        torch._foreach_mul_(tensors, coef.to(device=dev, dtype=dtype))


def embedding_grad_norm(model: object) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Global L2 norm of ``model.embed_tokens``' weight gradient (mesh-aware) and 1.0, as device
    tensors, or None when the model has no such gradient (a frozen or absent embedding)."""
    weight = getattr(getattr(model, "embed_tokens", None), "weight", None)
    if weight is None or weight.grad is None:
        return None
    norm = global_grad_norm([weight])  # mesh-aware (DTensor placements, mixed meshes)
    return norm, torch.ones((), device=norm.device)
