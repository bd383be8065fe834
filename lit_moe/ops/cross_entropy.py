"""The output layer's loss without ``[tokens, vocab]`` fp32 tables: linear + cross-entropy in one function.

The plain path (logits ``z = h W^T`` in the compute dtype, upcast to fp32, ``log_softmax``, NLL, and
autograd's backward through each) makes six ``[T, V]`` tables per step, four of them fp32, and keeps
the log-probabilities alive until backward. On a CPU each such table is a fresh ``mmap`` (glibc
serves allocations over 32 MiB that way and unmaps them on free), so every step pays page faults for
all of them: on the CPU benchmark (T = 2048, V = 8192) that was ~88k faults and ~0.1 s per step.

Here the forward pass computes the loss and both input gradients at once (training needs nothing
else from the head):

    z = h W^T                                     one GEMM in the compute dtype (as the plain path)
    per block of rows, in fp32 (cache-sized):     loss_t = logsumexp(z_t) - z_t[label_t]
                                                  g_t = (softmax(z_t) - onehot(label_t)) * mask_t / sum(mask)
                                                  written back over z in the compute dtype
    dh = g W,   dW = g^T h                        two GEMMs (fp32 accumulation inside, as autograd's)

and backward only scales ``dh`` and ``dW`` by the incoming gradient. (When the ``[T, V]`` table is
smaller than ``dh`` and ``dW`` together, as for short micro-batches with a large hidden size, it is
kept instead and the two GEMMs run in backward.) One ``[T, V]`` table in the compute dtype remains.
Under ``torch.compile`` the blocks give way to one out-of-place pass over the table, which inductor
fuses itself.

Numerics: the same rounded logits and the same fp32 softmax and loss as the plain path, up to
summation order. The input gradients differ in one rounding: the plain path multiplies the logits'
fp32 gradient by the incoming gradient (``1/A`` of accumulation, the MTP weight, ...) before rounding
it to the compute dtype, this function rounds the unscaled gradient and scales afterwards. With an
incoming gradient of 1 or a power of two the results are the plain path's; otherwise a few values
differ in their last bit of the compute dtype (bf16: about 4e-3 relative), the size of the bf16
rounding every other gradient of the model carries. Backward with ``create_graph=True`` is an error:
the gradients have no graph of their own.
"""

from __future__ import annotations

from typing import Optional

import torch

from lit_moe.ops.linear import Linear

# fp32 bytes of one block of rows. CPU: small enough to stay in cache and under glibc's mmap
# threshold. Accelerators: large, so that the per-block kernels stay few (each one is a launch).
CPU_ROW_BLOCK_BYTES = 2 << 20
ACCELERATOR_ROW_BLOCK_BYTES = 256 << 20


def row_block_bytes(device: torch.device) -> int:
    return CPU_ROW_BLOCK_BYTES if device.type == "cpu" else ACCELERATOR_ROW_BLOCK_BYTES


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                block_bytes: int) -> torch.Tensor:
        T, H = h.shape
        V = weight.shape[0]
        mask = mask.to(torch.float32)
        labels = torch.where(mask > 0, labels, 0).long()[:, None]   # masked labels may be pads: never indexed
        denom = mask.sum().clamp_min(1e-8)
        want_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        row_scale = (mask / denom)[:, None]
        z = torch.mm(h, weight.t())                                     # [T, V], compute dtype
        if torch.compiler.is_compiling():
            ce, z = _compiled_table(z, labels, row_scale, want_grad)
        else:
            ce = _blocked_table(z, labels, row_scale, want_grad, block_bytes)
        loss = (ce * mask).sum() / denom
        # Keep whichever is smaller until backward: the logits' gradient [T, V] (GEMMs in backward)
        # or the two input gradients [T, H] + [V, H] (GEMMs now, the [T, V] table freed at once).
        ctx.gemms_in_backward = want_grad and T * V <= H * (T + V)
        if ctx.gemms_in_backward:
            ctx.save_for_backward(z, h, weight)
        else:
            grad_h = torch.mm(z, weight) if ctx.needs_input_grad[0] else None
            grad_w = torch.mm(z.t(), h) if ctx.needs_input_grad[1] else None
            ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if torch.is_grad_enabled():   # create_graph=True: the gradients above have no graph of their own
            raise RuntimeError("linear_cross_entropy (the fused output-layer loss) has no second derivative; "
                               "double backward through it would silently miss its part")
        if ctx.gemms_in_backward:
            g, h, weight = ctx.saved_tensors
            grad_h = torch.mm(g, weight) if ctx.needs_input_grad[0] else None
            grad_w = torch.mm(g.t(), h) if ctx.needs_input_grad[1] else None
        else:
            grad_h, grad_w = ctx.saved_tensors
        grad_h = grad_h * grad_loss if grad_h is not None else None
        grad_w = grad_w * grad_loss if grad_w is not None else None
        return grad_h, grad_w, None, None, None


def _blocked_table(z: torch.Tensor, labels: torch.Tensor, row_scale: torch.Tensor, want_grad: bool,
                   block_bytes: int) -> torch.Tensor:
    """Eager: per block of rows in fp32, the rows' losses; with ``want_grad`` the logits' gradient
    written back over ``z`` in place."""
    T, V = z.shape
    ce = torch.empty(T, dtype=torch.float32, device=z.device)
    minus_one = torch.full((1, 1), -1.0, device=z.device).expand(T, 1)
    rows = max(1, block_bytes // (4 * V))
    for s in range(0, T, rows):
        e = min(T, s + rows)
        zc = z[s:e].float()
        target = zc.gather(1, labels[s:e])
        top = zc.amax(dim=1, keepdim=True)
        total = zc.sub_(top).exp_().sum(dim=1, keepdim=True)
        ce[s:e] = (total.log() + top - target).squeeze(1)
        if want_grad:
            zc.div_(total).scatter_add_(1, labels[s:e], minus_one[s:e]).mul_(row_scale[s:e])
            z[s:e].copy_(zc)
    return ce


def _compiled_table(z: torch.Tensor, labels: torch.Tensor, row_scale: torch.Tensor, want_grad: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Under torch.compile: the same values in one pass over the whole table, out of place, which
    inductor fuses into a few kernels. The block loop instead unrolled into dozens of small kernels and
    slice copies (on the CPU benchmark the compiled head took 0.27 s against 0.09 s eagerly)."""
    zf = z.float()
    top = zf.amax(dim=1, keepdim=True)
    p = (zf - top).exp()
    total = p.sum(dim=1, keepdim=True)
    ce = (total.log() + top - zf.gather(1, labels)).squeeze(1)
    if want_grad:
        minus_one = torch.full((1, 1), -1.0, device=z.device).expand(z.shape[0], 1)
        z = ((p / total).scatter_add(1, labels, minus_one) * row_scale).to(z.dtype)
    return ce, z


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                         block_bytes: Optional[int] = None) -> torch.Tensor:
    """``sum(CE(h W^T, labels) * mask) / sum(mask)`` (0 when the mask is empty) for ``h [T, H]``,
    ``weight [V, H]`` (same dtype), ``labels [T]``, ``mask [T]`` (bool or float); logits never leave it.
    ``block_bytes``: fp32 size of one block of rows (default: :func:`row_block_bytes` of the device;
    eager only: compiled, the table is one fused expression)."""
    if h.dtype != weight.dtype:
        raise ValueError(f"linear_cross_entropy: h and weight dtypes differ ({h.dtype}, {weight.dtype})")
    if not torch.is_grad_enabled():   # no gradient wanted: the forward must not compute any
        h, weight = h.detach(), weight.detach()
    block = row_block_bytes(h.device) if block_bytes is None else int(block_bytes)
    return _LinearCrossEntropy.apply(h, weight, labels, mask, block)


class LMHead(Linear):
    """The output layer: ``forward(h)`` gives logits (as ``Linear``); ``forward(h, labels, mask)`` gives
    the masked mean cross-entropy through :func:`linear_cross_entropy` (the logits never exist whole).
    Going through the module's ``__call__`` either way keeps FSDP2's hooks on it."""

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if labels is None:
            return super().forward(x)
        if mask is None:
            mask = labels != -100
        return linear_cross_entropy(x.reshape(-1, x.shape[-1]), self.weight.to(x.dtype),
                                    labels.reshape(-1), mask.reshape(-1))
