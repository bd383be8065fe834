"""Causal attention for CPUs: query blocks against the keys they can see, GEMMs in the input dtype.

PyTorch's CPU SDPA has two paths for training. Its fused flash kernel needs ``d_qk == d_v``, which
MLA breaks (192 vs 128 in DeepSeek-V3), so MLA lands on the math path, which upcasts q, k, v and the
``[B, h, S, S]`` score table to fp32 and materialises all of it, masked half included: on a CPU
it runs several times slower than this function, and padding v to ``d_qk`` to reach the flash kernel
wins less (its backward is slow; measured in benchmarks/README.md).

Here the queries are cut into blocks of ``block`` rows; block ``i`` (rows ``[s0, s1)``) only meets
keys ``[0, s1)``, so the upper triangle beyond the diagonal blocks is never computed (about 5/8 of
the full table for 4 blocks). Per block:

    s = scale * q_i k_{:s1}^T          (GEMM; in ``score_dtype``: fp32 upcasts q and k first)
    s[diagonal block, j > i] = -inf
    p = softmax(s) in fp32, stored in the input dtype (kept for backward)
    o_i = p v_{:s1}                    (GEMM in the input dtype, as flash kernels do)

and backward:

    dv_{:s1} += p^T do_i,   dp = do_i v_{:s1}^T,   ds = p (dp - rowsum(p dp)) scale  (softmax backward),
    dq_i = ds k_{:s1},      dk_{:s1} += ds^T q_i   (dk, dv accumulated in fp32)

The numbers match SDPA up to the rounding of p (and of s when ``score_dtype`` is the input dtype),
the same roundings a flash kernel makes.
"""

from __future__ import annotations

import torch

# Rows per query block: big enough for efficient GEMMs, small enough to skip most of the masked half.
QUERY_BLOCK = 128


def _bounds(seq: int, block: int) -> list[int]:
    n = max(1, -(-seq // block))
    return [round(seq * i / n) for i in range(n + 1)]


class _BlockCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale: float, score_dtype: torch.dtype, block: int):
        B, H, S, D = q.shape
        Dv, Sk = v.shape[-1], k.shape[-2]
        o = Sk - S          # the queries are the last S rows of an Sk-long causal sequence
        q = q.reshape(B * H, S, D)
        k = k.reshape(B * H, Sk, D)
        v = v.reshape(B * H, Sk, Dv)
        qs, ks = (q, k) if score_dtype == q.dtype else (q.to(score_dtype), k.to(score_dtype))
        bounds = _bounds(S, block)
        outs, probs = [], []
        for s0, s1 in zip(bounds[:-1], bounds[1:]):
            scores = torch.baddbmm(qs.new_empty(()).expand(B * H, s1 - s0, o + s1), qs[:, s0:s1],
                                   ks[:, :o + s1].transpose(1, 2), beta=0.0, alpha=scale)
            above = torch.ones(s1 - s0, s1 - s0, dtype=torch.bool, device=q.device).triu_(1)
            scores[:, :, o + s0:o + s1].masked_fill_(above, float("-inf"))
            p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            outs.append(torch.bmm(p, v[:, :o + s1]))
            probs.append(p)
        out = torch.cat(outs, dim=1)
        ctx.save_for_backward(q, k, v, *probs)
        ctx.bounds, ctx.scale, ctx.shape = bounds, scale, (B, H, S, Sk, D, Dv)
        return out.view(B, H, S, Dv)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, *probs = ctx.saved_tensors
        B, H, S, Sk, D, Dv = ctx.shape
        bounds, scale, o = ctx.bounds, ctx.scale, Sk - S
        do = grad_out.reshape(B * H, S, Dv).to(q.dtype)
        dqs = []
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for (s0, s1), p in zip(zip(bounds[:-1], bounds[1:]), probs):
            do_i = do[:, s0:s1]
            dv[:, :o + s1] += torch.bmm(p.transpose(1, 2), do_i)
            dp = torch.bmm(do_i, v[:, :o + s1].transpose(1, 2))
            # p (dp - rowsum(p dp)) in one fused pass (fp32 accumulation); rowsum(p dp) = do_i . o_i
            ds = torch._softmax_backward_data(dp, p, -1, p.dtype).mul_(scale)
            dqs.append(torch.bmm(ds, k[:, :o + s1]))
            dk[:, :o + s1] += torch.bmm(ds.transpose(1, 2), q[:, s0:s1])
        dq = torch.cat(dqs, dim=1)
        return (dq.view(B, H, S, D), dk.to(k.dtype).view(B, H, Sk, D), dv.to(v.dtype).view(B, H, Sk, Dv),
                None, None, None)


def block_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           score_dtype: torch.dtype = torch.float32, block: int = QUERY_BLOCK) -> torch.Tensor:
    """``softmax(scale * q k^T + causal) v`` for ``q, k [B, h, S, d]``, ``v [B, h, S, d_v]`` -> ``[B, h, S, d_v]``.
    Keys may be longer (``k, v [B, h, S_k, .]``, S_k > S): the queries are then the last S positions of
    an S_k-long causal sequence (a context-parallel chunk against the keys up to its end).

    ``score_dtype``: dtype of the score GEMM and its softmax input (the model's ``softmax_compute_dtype``);
    the softmax itself always accumulates in fp32."""
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"block_causal_attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if score_dtype not in (q.dtype, torch.float32):
        score_dtype = torch.float32
    return _BlockCausalAttention.apply(q, k, v, float(scale), score_dtype, int(block))


def use_block_causal(q: torch.Tensor, block: int = QUERY_BLOCK) -> bool:
    """Where the model uses :func:`block_causal_attention` instead of SDPA for ``q [B, h, S, d]``: bf16/fp16
    on a CPU with at least two query blocks (one block has no masked block to skip; short sequences
    stay on SDPA). fp32 keeps SDPA's math path, the reference the attention tests compare with."""
    return q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-2] > block
