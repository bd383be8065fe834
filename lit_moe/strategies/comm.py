"""Differentiable collectives on plain (local) tensors, Megatron style.

Tensor, sequence, context and expert parallelism move activations with these; parameters stay
DTensors (so checkpoints and gradient norms see their global layout) but the math runs on local
tensors. Each function is the forward of an ``autograd.Function`` whose backward is the adjoint
collective: all-gather ↔ reduce-scatter, all-to-all ↔ the reverse all-to-all.

They are exposed to modules as :class:`CommStep` attributes so that ``recompute_comm`` can address
them by name, e.g. ``mlp.router.all_gather``, and recompute their output through the step's own slot.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist


# newer torch renamed the tensor collectives (the old names warn; version note in benchmarks/README.md)
def _all_gather_single(out: torch.Tensor, src: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, src, group=group)


def _reduce_scatter_single(out: torch.Tensor, src: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, src, op=dist.ReduceOp.SUM, group=group)


class CommStep:
    """A parallel step's communication function as a module attribute (``block.all_gather``,
    ``mlp.router.all_gather``, ``core_attention.all_to_all``): set once by the parallel step, called as
    ``module.all_gather(x)``, selected by its path in ``recompute_comm`` / ``recompute.select_module``.

    ``recompute`` is the slot recompute fills with the call's output recompute (a wrapper of
    :attr:`fn`); None: :attr:`fn` runs as it is. Nothing on the module is replaced."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.recompute: Optional[Callable[..., Any]] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.recompute is not None:
            return self.recompute(*args, **kwargs)
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"CommStep({self.fn!r}" + (f", recompute={self.recompute!r})" if self.recompute is not None else ")")


def _size(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def _gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    src = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * src.shape[0],) + tuple(src.shape[1:]), dtype=src.dtype, device=src.device)
    _all_gather_single(out, src, group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    src = x.movedim(dim, 0).contiguous()
    if src.shape[0] % n:
        raise ValueError(f"reduce-scatter: size {src.shape[0]} of dim {dim} is not divisible by the group size {n}")
    out = torch.empty((src.shape[0] // n,) + tuple(src.shape[1:]), dtype=src.dtype, device=src.device)
    _reduce_scatter_single(out, src, group)
    return out.movedim(0, dim).contiguous()


def _split(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"split: size {x.shape[dim]} of dim {dim} is not divisible by the group size {n}")
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim), None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim), None, None


def all_gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Concatenate the ranks' ``x`` along ``dim``; backward reduce-scatters (sums partial gradients)."""
    return _AllGather.apply(x, group, dim) if _size(group) > 1 else x


def reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Sum the ranks' ``x`` and keep this rank's chunk of ``dim``; backward all-gathers."""
    return _ReduceScatter.apply(x, group, dim) if _size(group) > 1 else x


def split(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """This rank's chunk of ``dim`` (``x`` identical on all ranks); backward all-gathers."""
    return _Split.apply(x, group, dim) if _size(group) > 1 else x



class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=output_splits,
                               input_split_sizes=input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.input_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=ctx.input_splits,
                               input_split_sizes=ctx.output_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    """Variable-size all-to-all along dim 0 (``input_splits[r]`` rows go to rank r); backward reverses it."""
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)


class _AllReduce(torch.autograd.Function):
    """Sum over the group; every rank's result feeds that rank's loss, so the gradient of each
    input is the sum of all ranks' gradients (backward all-reduces too)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum of the ranks' ``x`` on every rank; backward sums the ranks' gradients."""
    return _AllReduce.apply(x, group) if _size(group) > 1 else x


def _to_blocks(x: torch.Tensor, n: int, scatter_dim: int) -> torch.Tensor:
    """``[..., S, ...]`` → ``[n, ..., S/n, ...]``: block j of ``scatter_dim`` leads (goes to rank j)."""
    if x.shape[scatter_dim] % n:
        raise ValueError(f"all-to-all: size {x.shape[scatter_dim]} of dim {scatter_dim} is not divisible by "
                         f"the group size {n}")
    return x.unflatten(scatter_dim, (n, x.shape[scatter_dim] // n)).movedim(scatter_dim, 0).contiguous()


def _from_blocks(x: torch.Tensor, gather_dim: int) -> torch.Tensor:
    """``[n, ...]`` (block j from rank j) → concatenated along ``gather_dim`` in rank order."""
    return x.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _BlockAllToAll(torch.autograd.Function):
    """Equal-split all-to-all of ``[n, ...]`` blocks (block j to rank j). It is its own adjoint.
    With ``pending`` (a list) the forward only starts the exchange and appends its work handle:
    the caller waits on it before reading the output (communication overlapped with compute)."""

    @staticmethod
    def forward(ctx, x, group, pending):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        work = dist.all_to_all_single(out, x, group=group, async_op=pending is not None)
        if pending is not None:
            pending.append(work)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)    # (of a permuted grad, empty_like would copy its strides)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None, None


def all_to_all_dims(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``scatter_dim`` over the ranks and concatenate ``gather_dim`` from them (Ulysses: sequence
    shards ↔ head shards). Backward is the reverse exchange."""
    n = _size(group)
    if n == 1:
        return x
    return _from_blocks(_BlockAllToAll.apply(_to_blocks(x, n, scatter_dim), group, None), gather_dim)


def start_all_to_all_dims(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, pending: list):
    """Asynchronous :func:`all_to_all_dims`: returns the raw blocks; call ``finish_all_to_all_dims``
    after waiting on the handle appended to ``pending``."""
    return _BlockAllToAll.apply(_to_blocks(x, _size(group), scatter_dim), group, pending)


def finish_all_to_all_dims(blocks: torch.Tensor, gather_dim: int) -> torch.Tensor:
    return _from_blocks(blocks, gather_dim)


# ----------------------------------------------------------------------------------------------
# vocabulary-parallel cross entropy
# ----------------------------------------------------------------------------------------------
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token ``-log softmax(logits)[label]`` with the vocabulary split across ``group``: the
    full logits never exist on one rank. ``vocab_start`` is this rank's first vocabulary id."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group):
        logits = logits.float()
        local_v = logits.shape[-1]
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        local_label = labels - vocab_start
        in_range = (local_label >= 0) & (local_label < local_v)
        idx = torch.where(in_range, local_label, torch.zeros_like(local_label))
        target = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * in_range
        dist.all_reduce(target, op=dist.ReduceOp.SUM, group=group)
        loss = sum_exp.log() - target
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, idx, in_range)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, in_range = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, idx.unsqueeze(-1), -in_range.to(grad.dtype).unsqueeze(-1))
        grad = grad * grad_loss.unsqueeze(-1)
        return grad, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                                 group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Token-wise cross entropy (fp32, shape of ``labels``) from vocabulary-sharded logits."""
    return _VocabParallelCrossEntropy.apply(local_logits, labels, vocab_start, group)
