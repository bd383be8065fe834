"""What autograd keeps for backward: bytes per decoder layer and micro-batch, and per pipeline rank
at the schedule's peak (``lit_moe plan`` for pipelines).

The per-layer model lists the tensors the layer's ops save (``ctx.save_for_backward`` /
``_saved_*`` of the autograd nodes), counted once per distinct storage, for lit_moe's eager code path
(unfused RMSNorm computed in ``layernorm_compute_dtype``, the fused q_a/kv_a and gate/up GEMMs whose
concatenated weight is a per-forward tensor, rotary angles in ``rotary_dtype``, dropless grouped
experts). ``tests/test_plan.py`` compares it with ``torch.autograd.graph.saved_tensors_hooks`` counting
the bytes one layer's forward saves on the CPU. Core attention has two variants:

* ``fused`` (flash / memory-efficient kernels on GPU and NPU): q, k, v, the output and the
  log-sum-exp, O(S);
* ``math`` (torch's SDPA math path, taken on the CPU): the softmax probabilities, O(S^2).

Full recompute of a layer keeps only its input. Not counted: the gradient buffers of backward, the
stage's output kept by the pipeline schedule (it is not saved by an op), the embedding's token ids.
The last stage adds the final norm and the fused loss head (:func:`head_bytes`), once per MTP depth too.

Zero-bubble schedules (``interleaved_zb``, ``zbv``) split a stage's backward in two (torch's
``pipelining/_backward.py``; version note in benchmarks/README.md): the input-gradient step ``I`` runs ``autograd.grad`` to the stage input
with ``retain_graph=True``, so every tensor the chunk saved stays until its weight-gradient step ``W``
(all of the chunk's saved tensors; measured in benchmarks/README.md), and it keeps, per micro-batch, the gradient of each op's
output where the input path meets a weight (the ``param_groups`` "intermediates": each GEMM's and norm's
output gradient, :func:`layer_weight_grad_bytes`) until ``W`` runs ``autograd.grad`` from them to the
weights. ``W`` frees both. The first stage has no input gradient: torch skips its ``I`` and runs the
whole backward at ``W``. ``tests/test_plan.py`` checks this against a split backward run by torch's own
functions.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import torch

INDEX_BYTES = 8  # int64 indices of the MoE permutation


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def layer_activation_bytes(config: Any, layer_idx: int, tokens: int, batch: int, seq: int, *,
                           recompute: bool = False, core_attention: str = "fused",
                           expert_rows: Optional[int] = None, weight_copies: Optional[bool] = None,
                           heads: Optional[int] = None) -> int:
    """Bytes decoder layer ``layer_idx`` saves for backward for one micro-batch of ``tokens = batch x seq``
    tokens (this rank's share under tensor/context parallelism: pass its tokens and ``heads``).

    ``recompute``: full recompute of the layer (only its input is kept). ``expert_rows``: rows the
    grouped expert GEMMs see (default ``tokens x top_k``, exact on accelerators; the CPU pads each
    expert group to a size bucket, up to 1/8 more). ``weight_copies``: the compute-dtype copies of the
    weights are saved (parameters stored in another dtype and not gathered by FSDP in the compute
    dtype); default: ``params_dtype != compute_dtype``."""
    c = config
    T, H = tokens, c.hidden_size
    a = _bytes(c.torch_dtype("compute_dtype"))
    f = _bytes(c.torch_dtype("layernorm_compute_dtype"))
    if recompute:
        return T * H * a
    if weight_copies is None:
        weight_copies = c.torch_dtype("params_dtype") != c.torch_dtype("compute_dtype")
    n = heads if heads is not None else c.num_attention_heads
    dn, dr, dv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    qr, kr = c.q_lora_rank, c.kv_lora_rank

    def norm(d: int, input_saved_elsewhere: bool = False) -> int:
        # x in the norm dtype (x itself, or its upcast copy), rsqrt, x*rsqrt, and the output
        upcast = 0 if (input_saved_elsewhere and a == f) else T * d * f
        return upcast + T * f + T * d * f + T * d * a

    total = norm(H)                                      # input_layernorm
    # attention: projections
    if qr is not None:
        total += (qr + kr + dr) * H * a                  # concatenated q_a/kv_a weight (fused GEMM)
        if a == f:
            total += T * (qr + kr + dr) * a              # its output, saved by the latent norms
        total += norm(qr, True) + norm(kr, True)
        if weight_copies:
            total += qr * n * (dn + dr) * a
    else:
        total += 0 if not weight_copies else H * n * (dn + dr) * a
        total += norm(kr, True) + (T * (kr + dr) * a if a == f else 0) + (kr + dr) * H * a * weight_copies
    if weight_copies:
        total += kr * n * (dn + dv) * a + n * dv * H * a   # kv_b, o_proj
    # q and k in the rotary dtype (the rotated half is upcast, and the concatenation with it)
    use_rope = c.uses_rope(layer_idx)
    qb = _bytes(torch.promote_types(c.torch_dtype("compute_dtype"), c.torch_dtype("rotary_dtype"))) if use_rope else a
    total += 2 * T * n * (dn + dr) * qb                  # query, key (concatenations)
    if core_attention == "math" and batch == 1 and qb == a:
        # one sequence: the math path's [B*heads, S, d_v] value is a view of the whole kv_b output
        total += T * n * (dn + dv) * a
    else:
        total += T * n * dv * qb                         # value, made contiguous in the query's dtype
    if core_attention == "math":
        total += batch * n * seq * seq * 4               # softmax probabilities (fp32)
    elif core_attention == "fused":
        total += T * n * dv * qb + batch * n * seq * 4   # output, log-sum-exp
    else:
        raise ValueError(f"core_attention: expected 'fused' or 'math', got {core_attention!r}")
    total += T * n * dv * a                              # o_proj input
    # MLP half
    total += norm(H)                                     # pre_mlp_layernorm
    if c.is_moe_layer(layer_idx):
        E, K, I = c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size
        R = expert_rows if expert_rows is not None else T * K
        rb = _bytes(c.torch_dtype("router_dense_type"))
        total += (T * H * rb if rb != a else 0) + T * E * rb         # router input (cast), scores
        total += T * K * INDEX_BYTES + T * K * rb + T * rb           # gather index, top-k weights, their sum
        total += 3 * T * K * INDEX_BYTES                             # permutation, its inverse, assignment
        total += T * K * H * a + T * K * a + E * 4                   # permuted tokens and weights, group offsets
        total += R * H * a + R * 2 * I * a + 3 * R * I * a + R * a   # grouped rows: in, gate|up, act, x w, weights
        if weight_copies:
            total += E * H * 2 * I * a + E * I * H * a
        if c.n_shared_experts > 0:
            total += _mlp(c.shared_expert_intermediate_size, T, H, a, weight_copies)
    else:
        total += _mlp(c.intermediate_size, T, H, a, weight_copies)
    return total


def _mlp(F: int, T: int, H: int, a: int, weight_copies: bool) -> int:
    # concatenated gate/up weight, gate|up output, activation, activation x up (down's input)
    return 2 * F * H * a + T * 2 * F * a + 2 * T * F * a + (F * H * a if weight_copies else 0)


def per_forward_bytes(config: Any, tokens: int) -> int:
    """Tensors one forward shares between its layers: the rotary cos and sin, ``[T, d_rope / 2]`` each."""
    if config.position_embedding_type not in ("rope", "yarn"):
        return 0
    return 2 * tokens * (config.qk_rope_head_dim // 2) * _bytes(config.torch_dtype("rotary_dtype"))


def head_bytes(config: Any, tokens: int) -> int:
    """The final norm and the fused output-layer loss (``ops/cross_entropy.py``): it keeps the logits'
    gradient ``[T, V]`` (and its input) when that is smaller than the two input gradients, else those."""
    c = config
    T, H, V = tokens, c.hidden_size, c.vocab_size
    a = _bytes(c.torch_dtype("compute_dtype"))
    f = _bytes(c.torch_dtype("layernorm_compute_dtype"))
    norm = 2 * T * H * f + T * f + T * H * a            # its output is the head's input
    return norm + (T * V * a if T * V <= H * (T + V) else T * H * a + V * H * a)


def layer_weight_grad_bytes(config: Any, layer_idx: int, tokens: int, *, expert_rows: Optional[int] = None,
                            heads: Optional[int] = None) -> int:
    """Bytes a split backward (zero-bubble schedules) keeps between a micro-batch's input-gradient and
    weight-gradient steps for decoder layer ``layer_idx``: the gradient of every op output where the
    input path meets a weight (torch's ``param_groups`` intermediates), i.e. each norm's and each
    GEMM's output gradient, one distinct tensor each. Same arguments as :func:`layer_activation_bytes`."""
    c = config
    T, H = tokens, c.hidden_size
    a = _bytes(c.torch_dtype("compute_dtype"))
    f = _bytes(c.torch_dtype("layernorm_compute_dtype"))
    n = heads if heads is not None else c.num_attention_heads
    dn, dr, dv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    qr, kr = c.q_lora_rank, c.kv_lora_rank
    latent_norm = 1 if getattr(c, "qk_layernorm", True) else 0
    total = T * H * f                                     # input_layernorm's weight product
    if qr is not None:
        total += T * (qr + kr + dr) * a                   # fused q_a/kv_a GEMM
        total += latent_norm * T * qr * f + T * n * (dn + dr) * a      # q_a_layernorm, q_b_proj
    else:
        total += T * n * (dn + dr) * a + T * (kr + dr) * a             # q_proj, kv_a_proj_with_mqa
    total += latent_norm * T * kr * f + T * n * (dn + dv) * a          # kv_a_layernorm, kv_b_proj
    total += T * H * a                                    # o_proj
    total += T * H * f                                    # pre_mlp_layernorm
    if c.is_moe_layer(layer_idx):
        E, K, I = c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size
        R = expert_rows if expert_rows is not None else T * K
        total += T * E * _bytes(c.torch_dtype("router_dense_type"))    # router GEMM
        total += R * 2 * I * a + R * H * a                # grouped gate|up and down GEMMs
        if c.n_shared_experts > 0:
            total += T * 2 * c.shared_expert_intermediate_size * a + T * H * a
    else:
        total += T * 2 * c.intermediate_size * a + T * H * a
    return total


def head_weight_grad_bytes(config: Any, tokens: int) -> int:
    """:func:`layer_weight_grad_bytes` of the last stage's final norm and fused loss head (its output
    gradient is a scalar)."""
    return tokens * config.hidden_size * _bytes(config.torch_dtype("layernorm_compute_dtype")) + 4


def mtp_weight_grad_bytes(config: Any, tokens: int) -> int:
    """One MTP depth besides its decoder layer: the concatenation of the two normed inputs (the
    embedding side, which does not depend on the stage input, meets it there), ``eh_proj``, ``hnorm``,
    ``final_layernorm`` and its own head."""
    T, H = tokens, config.hidden_size
    a = _bytes(config.torch_dtype("compute_dtype"))
    f = _bytes(config.torch_dtype("layernorm_compute_dtype"))
    return T * 2 * H * a + T * H * a + T * H * f + T * H * f + head_weight_grad_bytes(config, tokens)


def stage_activation_bytes(config: Any, layers: range, tokens: int, batch: int, seq: int, *,
                           recompute_layers: frozenset = frozenset(), **kwargs) -> int:
    """One micro-batch's saved bytes of a stage holding decoder ``layers`` (+ the rotary angles)."""
    total = per_forward_bytes(config, tokens) if len(layers) else 0
    for i in layers:
        total += layer_activation_bytes(config, i, tokens, batch, seq, recompute=i in recompute_layers, **kwargs)
    return total


def last_stage_extra_bytes(config: Any, tokens: int, batch: int, seq: int, *,
                           recompute_layers: frozenset = frozenset(), **kwargs) -> int:
    """What the last stage saves besides its decoder layers: the final norm and loss head, and per MTP
    depth its decoder block and its own norms and head."""
    total = head_bytes(config, tokens)
    L = config.num_hidden_layers
    for j in range(getattr(config, "num_nextn_predict_layers", 0) or 0):
        total += layer_activation_bytes(config, L + j, tokens, batch, seq, recompute=(L + j) in recompute_layers,
                                        **kwargs)
        total += head_bytes(config, tokens)
    return total


def model_activation_bytes(config: Any, tokens: int, batch: int, seq: int, *,
                           recompute_layers: frozenset = frozenset(), **kwargs) -> int:
    """Without pipelines: one micro-batch's saved bytes of the whole model (the peak, reached at the end
    of its forward; the next micro-batch's forward starts after this backward has freed them)."""
    return (stage_activation_bytes(config, range(config.num_hidden_layers), tokens, batch, seq,
                                   recompute_layers=recompute_layers, **kwargs)
            + last_stage_extra_bytes(config, tokens, batch, seq, recompute_layers=recompute_layers, **kwargs))


# ----------------------------------------------------------------------------------------------
# the schedule's peak: which stage chunks a rank holds at once
# ----------------------------------------------------------------------------------------------
def schedule_actions(layout: Any, rank: int, microbatches: int) -> list[tuple[str, int, int]]:
    """``(kind, stage, micro-batch)`` in the order rank ``rank`` runs them, kind ``F`` (forward), ``B``
    (full backward), ``I`` (input gradient) or ``W`` (weight gradient). Multi-stage schedules come from
    torch's own schedule (its ``pipeline_order``, computed without a process group: the stage objects
    it reads are stand-ins); GPipe and 1F1B from their definitions (all forwards then all backwards;
    P - r warm-up forwards, then one forward one backward)."""
    P, A = layout.pp, microbatches
    if layout.schedule == "gpipe":
        return [("F", rank, m) for m in range(A)] + [("B", rank, m) for m in range(A)]
    if layout.schedule == "1f1b":
        warm = min(P - rank, A)
        ops = [("F", rank, m) for m in range(warm)]
        for m in range(A):
            ops.append(("B", rank, m))
            if warm + m < A:
                ops.append(("F", rank, warm + m))
        return ops
    from torch import nn
    from torch.distributed import pipelining as pl

    # torch's classes of the multi-stage schedules (pipeline.py runs the same ones)
    cls = {"interleaved_1f1b": pl.ScheduleInterleaved1F1B, "interleaved_zb": pl.ScheduleInterleavedZeroBubble,
           "zbv": pl.ScheduleZBVZeroBubble, "dualpipev": pl.ScheduleDualPipeV}[layout.schedule]
    stages = [SimpleNamespace(group_size=P, group_rank=rank, num_stages=layout.num_stages, stage_index=s,
                              is_first=s == 0, is_last=s == layout.num_stages - 1, submod=nn.Module())
              for s in layout.stages_of(rank)]
    schedule = cls(stages, n_microbatches=A, scale_grads=False)
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    out = []
    for action in schedule.pipeline_order[rank]:
        if action is None:
            continue
        for sub in action.sub_actions or ():           # DualPipeV's overlapped forward and backward
            out.append((kinds[sub.computation_type.name], sub.stage_index, sub.microbatch_index))
        kind = kinds.get(getattr(action.computation_type, "name", str(action.computation_type)))
        if kind is not None:
            out.append((kind, action.stage_index, action.microbatch_index))
    return out


def peak_in_flight(layout: Any, rank: int, microbatches: int, chunk_bytes: dict[int, int],
                   held_bytes: Optional[dict[int, int]] = None) -> tuple[int, int]:
    """``(peak bytes, stage chunks alive at that peak)`` on ``rank``: a forward of stage s adds
    ``chunk_bytes[s]``; a full backward releases it; the input-gradient step of a split backward adds
    ``held_bytes[s]`` (the output gradients kept for the weight gradients) and keeps the chunk; the
    weight-gradient step releases both."""
    held_bytes = held_bytes or {}
    live = peak = count = peak_count = 0
    for kind, stage, _ in schedule_actions(layout, rank, microbatches):
        if kind == "F":
            live += chunk_bytes[stage]
            count += 1
        elif kind == "I":
            live += held_bytes.get(stage, 0)
        elif kind == "B":
            live -= chunk_bytes[stage]
            count -= 1
        elif kind == "W":
            live -= chunk_bytes[stage] + held_bytes.get(stage, 0)
            count -= 1
        if live > peak:
            peak, peak_count = live, count
    return peak, peak_count


SPLIT_BACKWARD_SCHEDULES = ("interleaved_zb", "zbv", "dualpipev")


def pipeline_activation_plan(config: Any, layout: Any, microbatches: int, batch: int, seq: int, *,
                             recompute_layers: frozenset = frozenset(), **kwargs) -> list[dict[str, int]]:
    """Per pipeline rank: ``bytes`` kept for backward at the schedule's peak (saved tensors, plus the
    output gradients a split backward keeps between its input- and weight-gradient steps), ``chunks``
    of micro-batches alive then, ``per_microbatch`` (saved bytes of the rank's stages, one micro-batch
    each) and ``weight_grad_per_microbatch`` (the kept gradients of the same, 0 without a split
    backward)."""
    tokens = batch * seq
    chunk = {s: stage_activation_bytes(config, range(a, b), tokens, batch, seq,
                                       recompute_layers=recompute_layers, **kwargs)
             for s, (a, b) in enumerate(layout.ranges)}
    last = layout.num_stages - 1
    chunk[last] += last_stage_extra_bytes(config, tokens, batch, seq, recompute_layers=recompute_layers, **kwargs)
    L = config.num_hidden_layers
    depths = getattr(config, "num_nextn_predict_layers", 0) or 0
    held = {s: 0 for s in chunk}
    if layout.schedule in SPLIT_BACKWARD_SCHEDULES:
        grad_kwargs = {k: v for k, v in kwargs.items() if k in ("expert_rows", "heads")}
        for s, (a, b) in enumerate(layout.ranges):
            if s == 0:
                continue   # torch runs the first stage's whole backward at its weight-gradient step
            held[s] = sum(layer_weight_grad_bytes(config, i, tokens, **grad_kwargs) for i in range(a, b))
        if last > 0:
            held[last] += head_weight_grad_bytes(config, tokens)
            for j in range(depths):
                held[last] += layer_weight_grad_bytes(config, L + j, tokens, **grad_kwargs)
                held[last] += mtp_weight_grad_bytes(config, tokens)
    rows = []
    for r in range(layout.pp):
        peak, chunks = peak_in_flight(layout, r, microbatches, chunk, held)
        rows.append({"bytes": peak, "chunks": chunks, "per_microbatch": sum(chunk[s] for s in layout.stages_of(r)),
                     "weight_grad_per_microbatch": sum(held[s] for s in layout.stages_of(r))})
    return rows
