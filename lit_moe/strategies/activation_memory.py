"""What autograd keeps for backward: bytes per decoder layer and micro-batch, and per pipeline rank
at the schedule's peak (``lit_moe plan`` for pipelines).

The per-layer model lists the tensors the layer's ops save (``ctx.save_for_backward`` /
``_saved_*`` of the autograd nodes), counted once per distinct storage, for lit_moe's eager code path
(unfused RMSNorm computed in ``layernorm_compute_dtype``, the fused q_a/kv_a and gate/up GEMMs whose
concatenated weight is a per-forward tensor, rotary angles in ``rotary_dtype``, dropless grouped
experts). ``tests/test_plan.py`` compares it with ``torch.autograd.graph.saved_tensors_hooks`` counting
the bytes one layer's forward saves on the CPU, ``tests/test_memory_plan.py`` for every family: MLA
(DeepSeek-V3; V3.2 adds its lightning indexer's tensors when it trains on its loss), grouped-query
attention (Qwen3-MoE, GLM-4-MoE: q/k norms, key/value heads repeated to the query heads), the
sigmoid, softmax or sqrt-softplus router (the same tensors, sqrt-softplus its logits too; the
renormalisation's only with ``norm_topk_prob``), and DeepSeek-V4's layer (its attention with the
compressed entries, the mHC streams' reads and writes, the SwiGLU clamp). A split backward's kept
gradients are not modelled for V4: :func:`not_estimated` says so under the zero-bubble schedules and
``lit_moe plan`` prints that line instead of a figure. Core attention has two variants:

* ``fused`` (flash / memory-efficient kernels on GPU and NPU): q, k, v, the output and the
  log-sum-exp, O(S);
* ``math`` (torch's SDPA math path, taken on the CPU): the softmax probabilities, O(S^2).

Full recompute of a layer keeps only its input; selective recompute drops what the selected modules saved
and keeps their inputs (each saved tensor has an owner module and a storage name, :func:`layer_saved_tensors`).
Not counted: the gradient buffers of backward, the
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
                           recompute: bool = False, checkpointed: tuple = (), output_recomputed: tuple = (),
                           tp: int = 1, core_attention: str = "fused", expert_rows: Optional[int] = None,
                           weight_copies: Optional[bool] = None, heads: Optional[int] = None,
                           fused_weights: bool = True) -> int:
    """Bytes decoder layer ``layer_idx`` saves for backward for one micro-batch of ``tokens = batch x seq``
    tokens (this rank's share under context parallelism; under tensor parallelism ``tokens`` is the
    whole sequence the attention and MLP blocks see after their all-gather, ``heads`` this rank's).

    ``recompute``: full recompute of the layer (only its input is kept). ``checkpointed`` /
    ``output_recomputed``: the paths selective recompute wraps in this layer (:func:`selected_saved_tensors`).
    ``tp``: tensor-parallel degree; the norms and the residual stream between blocks hold ``tokens / tp``
    (sequence parallel), every block's input is gathered to ``tokens``, its column-parallel halves hold
    ``heads`` and ``intermediate / tp``, the routed experts ``rows / tp``. ``expert_rows``: rows the
    grouped expert GEMMs see (default ``tokens x top_k``, exact on accelerators; the CPU pads each
    expert group to a size bucket, up to 1/8 more). ``weight_copies``: the compute-dtype copies of the
    weights are saved (parameters stored in another dtype and not gathered by FSDP in the compute
    dtype); default: ``params_dtype != compute_dtype``. ``fused_weights``: the q_a/kv_a and gate/up
    GEMMs run as one over a concatenated weight, saved per forward (plain modules only: under FSDP or
    tensor parallel each projection is called on its own, :func:`lit_moe.ops.linear.fused_linear`)."""
    if recompute:
        return tokens // tp * config.hidden_size * _bytes(config.torch_dtype("compute_dtype"))
    saved = layer_saved_tensors(config, layer_idx, tokens, batch, seq, tp=tp, core_attention=core_attention,
                                expert_rows=expert_rows, weight_copies=weight_copies, heads=heads,
                                fused_weights=fused_weights)
    saved = selected_saved_tensors(saved, layer_inputs(config, layer_idx, tokens, tp=tp, heads=heads),
                                   checkpointed, output_recomputed)
    return distinct_bytes(saved)


def distinct_bytes(saved: list[tuple[str, str, int]]) -> int:
    """The bytes of ``(owner, storage, bytes)`` rows, each storage counted once."""
    storages: dict[str, int] = {}
    for _, key, n in saved:
        storages[key] = max(storages.get(key, 0), n)
    return sum(storages.values())


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent + ".")


def selected_saved_tensors(saved: list[tuple[str, str, int]], inputs: dict[str, list[tuple[str, int]]],
                           checkpointed: tuple = (), output_recomputed: tuple = ()) -> list[tuple[str, str, int]]:
    """What a layer keeps under selective recompute (``recompute.select_module`` /
    ``recompute_comm.select_module``, as :func:`lit_moe.strategies.recompute.apply.layer_selection`
    resolves them): a checkpointed module's own tensors are dropped and its inputs kept instead
    (non-reentrant checkpointing saves them); an output-recomputed step's output is dropped wherever
    it was saved and the step's input kept. ``inputs``: path -> ``[(storage, bytes)]``
    (:func:`layer_inputs`); a path it does not know keeps everything (counted as kept)."""
    kept = list(saved)
    for path in checkpointed:
        if path not in inputs:
            continue
        kept = [row for row in kept if not _under(row[0], path)]
        kept += [(path, key, n) for key, n in inputs[path]]
    for path in output_recomputed:
        if path not in inputs or path not in _STEP_OUTPUTS:
            continue
        output = _STEP_OUTPUTS[path]
        kept = [row for row in kept if row[1] != output]
        kept += [(path, key, n) for key, n in inputs[path]]
    return kept


# the storage each communication step returns (sequence parallel's all-gathers): output recompute drops it
_STEP_OUTPUTS = {"self_attention.all_gather": "ln1.gathered", "mlp.all_gather": "ln2.gathered",
                 "mlp.router.all_gather": "ln2.gathered"}


def layer_inputs(config: Any, layer_idx: int, tokens: int, *, tp: int = 1,
                 heads: Optional[int] = None) -> dict[str, list[tuple[str, int]]]:
    """The inputs (storage, bytes) a checkpointed module keeps (or an output-recomputed step reruns
    from), by path inside the layer, in the storage names of :func:`layer_saved_tensors`. Sequence
    parallel's gathers run inside the checkpointed block (their hooks move into the recomputed
    region), so a block keeps its ``tokens / tp`` input."""
    c = config
    T, H, Tl = tokens, c.hidden_size, tokens // tp
    a = _bytes(c.torch_dtype("compute_dtype"))
    n = heads if heads is not None else c.num_attention_heads
    dn, dr, dv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    qr, kr = c.q_lora_rank, c.kv_lora_rank
    latent = ("qkv_a", T * (qr + kr + dr) * a) if qr is not None else ("kv_a", T * (kr + dr) * a)
    inputs = {
        "input_layernorm": [("x", Tl * H * a)], "self_attention": [("ln1", Tl * H * a)],
        "self_attention.all_gather": [("ln1", Tl * H * a)],
        "self_attention.q_a_layernorm": [latent], "self_attention.kv_a_layernorm": [latent],
        "self_attention.q_b_proj": [("q_lat", T * (qr or 0) * a)], "self_attention.kv_b_proj": [("kv_lat", T * kr * a)],
        # query and key in the compute dtype (the kernel's own copies are in the rotary dtype), the value
        # a view of kv_b_proj's whole output
        "self_attention.core_attention": [("query.input", T * n * (dn + dr) * a), ("key.input", T * n * (dn + dr) * a),
                                          ("kv", T * n * (dn + dv) * a)],
        "self_attention.o_proj": [("attn_out", T * n * dv * a)],
        "pre_mlp_layernorm": [("h", Tl * H * a)], "mlp": [("ln2", Tl * H * a)],
        "mlp.all_gather": [("ln2", Tl * H * a)], "mlp.router.all_gather": [("ln2", Tl * H * a)],
    }
    if not c.multi_latent_attention:   # grouped-query attention (:func:`_gqa_saved`'s storages)
        d, kv = c.gqa_head_dim, max(n * c.kv_heads // c.num_attention_heads, 1)
        for key in [k for k in inputs if k.startswith("self_attention.") and k != "self_attention.all_gather"]:
            del inputs[key]
        inputs.update({"self_attention.q_norm": [("q_proj", T * n * d * a)],
                       "self_attention.k_norm": [("k_proj", T * kv * d * a)],
                       "self_attention.core_attention": [("query", T * n * d * a), ("key", T * n * d * a),
                                                         ("value", T * n * d * a)],
                       "self_attention.o_proj": [("out", T * n * d * a)]})
    if c.enable_hyper_connections:   # the norms read the collapsed streams (:func:`_hyper_connection_saved`)
        inputs.update({"input_layernorm": [("attn_hc.collapsed", Tl * H * a)],
                       "pre_mlp_layernorm": [("ffn_hc.collapsed", Tl * H * a)]})
    if c.is_moe_layer(layer_idx):
        K = c.num_experts_per_tok
        inputs.update({"mlp.router": [(_gathered("ln2", tp), T * H * a)],
                       "mlp.shared_experts": [(_gathered("ln2", tp), T * H * a)],
                       "mlp.experts": [("perm_x", T * K * H * a), ("perm_w", T * K * a)]})
        if c.is_hash_layer(layer_idx):   # DeepSeek-V4's hash router also reads the token ids
            for path in ("mlp", "mlp.router"):
                inputs[path] = inputs[path] + [("input_ids", T * INDEX_BYTES)]
    else:
        inputs["mlp.down_proj"] = [("mlp.product", T * (c.intermediate_size // tp) * a)]
    return inputs


def _gathered(key: str, tp: int) -> str:
    # under sequence parallel a block's input is a new, gathered tensor; without it the norm output itself
    return f"{key}.gathered" if tp > 1 else key


def _rotary_bytes(c: Any, layer_idx: int) -> int:
    # q and k in the rotary dtype (the rotated half is upcast, and the concatenation with it)
    if not c.uses_rope(layer_idx):
        return _bytes(c.torch_dtype("compute_dtype"))
    return _bytes(torch.promote_types(c.torch_dtype("compute_dtype"), c.torch_dtype("rotary_dtype")))


def layer_saved_tensors(config: Any, layer_idx: int, tokens: int, batch: int, seq: int, *, tp: int = 1,
                        core_attention: str = "fused", expert_rows: Optional[int] = None,
                        weight_copies: Optional[bool] = None, heads: Optional[int] = None,
                        fused_weights: bool = True) -> list[tuple[str, str, int]]:
    """Every tensor decoder layer ``layer_idx`` saves for backward, as ``(owner, storage, bytes)``: the
    module path whose forward runs the op that saves it, a name for the storage (tensors saved by
    several ops, or views of one storage, share it) and its bytes. Arguments as
    :func:`layer_activation_bytes`. :class:`EstimateUnavailable` for a family not modelled (:func:`not_estimated`)."""
    c = config
    if not_estimated(c):
        raise EstimateUnavailable(not_estimated(c))
    T, H, Tl = tokens, c.hidden_size, tokens // tp
    a = _bytes(c.torch_dtype("compute_dtype"))
    f = _bytes(c.torch_dtype("layernorm_compute_dtype"))
    if weight_copies is None:
        weight_copies = c.torch_dtype("params_dtype") != c.torch_dtype("compute_dtype")
    n = heads if heads is not None else c.num_attention_heads
    rows: list[tuple[str, str, int]] = []

    def add(owner: str, key: str, nbytes: int) -> None:
        rows.append((owner, key, nbytes))

    def norm(owner: str, d: int, t: int, in_key: str, in_bytes: int) -> None:
        # x in the norm dtype (x itself, or its upcast copy), rsqrt, x*rsqrt; the output is its consumer's
        if a == f:
            add(owner, in_key, in_bytes)
        else:
            add(owner, f"{owner}.upcast", t * d * f)
        add(owner, f"{owner}.rsqrt", t * f)
        add(owner, f"{owner}.normed", t * d * f)

    streams = c.enable_hyper_connections
    if streams:   # the layer input is hc_mult residual streams, collapsed ahead of each half
        _hyper_connection_saved(add, c, "attn_hc", Tl, a, "x")
    norm("input_layernorm", H, Tl, *(("attn_hc.collapsed", Tl * H * a) if streams else ("x", Tl * H * a)))
    add("self_attention", _gathered("ln1", tp), T * H * a)     # the first projections' (gathered) input
    if getattr(c, "v4_attention", False):
        _v4_attention_saved(add, norm, c, layer_idx, T, batch, seq, n, a, weight_copies)
    elif c.multi_latent_attention:
        _mla_saved(add, norm, c, layer_idx, T, batch, seq, n, a, core_attention, weight_copies, fused_weights)
    else:
        _gqa_saved(add, norm, c, layer_idx, T, batch, seq, n, a, core_attention, weight_copies)
    if streams:
        _mixed_streams_saved(add, c, "attn_hc", Tl, a)
        _hyper_connection_saved(add, c, "ffn_hc", Tl, a, "attn_hc.mixed")
    # MLP half
    norm("pre_mlp_layernorm", H, Tl, *(("ffn_hc.collapsed", Tl * H * a) if streams else ("h", Tl * H * a)))
    rb = _bytes(c.torch_dtype("router_dense_type"))
    if not c.is_moe_layer(layer_idx) or c.n_shared_experts > 0 or rb == a:
        # the router's / MLP's (gathered) input; a MoE layer without shared experts (Qwen3-MoE) whose
        # router casts it keeps only the cast and the permuted copy
        add("mlp", _gathered("ln2", tp), T * H * a)
    if c.is_moe_layer(layer_idx):
        E, K, I = c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size
        R = (expert_rows if expert_rows is not None else T * K) // tp    # tensor parallel splits the rows
        if rb != a:
            add("mlp.router", "router_in", T * H * rb)         # router input (cast)
        # sigmoid, softmax (Qwen3-MoE) and sqrt-softplus keep their output; the gather its indices; the
        # renormalisation (``norm_topk_prob``, off in Qwen3-MoE) the chosen weights and their sum
        router = [("scores", T * E * rb), ("topk_index", T * K * INDEX_BYTES)]
        if c.scoring_func == "sqrtsoftplus":   # softplus keeps its input too (sqrt its output, the scores)
            router.append(("logits", T * E * rb))
        if c.norm_topk_prob:
            router += [("topk_weights", T * K * rb), ("topk_sum", T * rb)]
        for key, nbytes in router:
            add("mlp.router", key, nbytes)
        add("mlp", "permutation", T * K * INDEX_BYTES)          # permutation, its inverse
        add("mlp", "inverse", T * K * INDEX_BYTES)
        ex = "mlp.experts"
        for key, nbytes in (("assignment", T * K * INDEX_BYTES), ("perm_x", T * K * H * a), ("perm_w", T * K * a),
                            ("offsets", E * 4), ("rows_in", R * H * a), ("gate_up", R * 2 * I * a),
                            ("act_in", R * I * a), ("act", R * I * a), ("act_w", R * I * a), ("row_w", R * a)):
            add(ex, key, nbytes)                                # permuted tokens, grouped rows
        _clamped(add, c, ex, R * I * a)
        if weight_copies:
            add(ex, "w_experts", E * H * 2 * I * a + E * I * H * a)
        if c.n_shared_experts > 0:
            _mlp(add, "mlp.shared_experts", c.shared_expert_intermediate_size // tp, T, H, a, weight_copies,
                 fused_weights, c)
    else:
        _mlp(add, "mlp", c.intermediate_size // tp, T, H, a, weight_copies, fused_weights, c)
    if streams:
        _mixed_streams_saved(add, c, "ffn_hc", Tl, a)
    return rows


def _mla_saved(add: Any, norm: Any, c: Any, layer_idx: int, T: int, batch: int, seq: int, n: int, a: int,
               core_attention: str, weight_copies: bool, fused_weights: bool) -> None:
    """Multi-head latent attention's rows (DeepSeek-V3, V3.2 with its indexer): the latent projections and
    norms, the per-head query/key/value made from them, the core attention and ``o_proj``'s input."""
    H, dn, dr, dv = c.hidden_size, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    qr, kr = c.q_lora_rank, c.kv_lora_rank
    att = "self_attention"
    if qr is not None:
        if fused_weights:
            add(att, "w_qkv_a", (qr + kr + dr) * H * a)           # concatenated q_a/kv_a weight (fused GEMM)
            latent_q = latent_kv = ("qkv_a", T * (qr + kr + dr) * a)
        else:                                                    # two GEMMs, two outputs
            latent_q, latent_kv = ("q_a", T * qr * a), ("kv_a", T * (kr + dr) * a)
        norm(f"{att}.q_a_layernorm", qr, T, *latent_q)
        add(f"{att}.q_b_proj", "q_lat", T * qr * a)
        if weight_copies:
            add(f"{att}.q_b_proj", "w_q_b", qr * n * (dn + dr) * a)
        norm(f"{att}.kv_a_layernorm", kr, T, *latent_kv)
    else:
        if weight_copies:
            add(f"{att}.q_proj", "w_q", H * n * (dn + dr) * a)
            add(f"{att}.kv_a_proj_with_mqa", "w_kv_a", (kr + dr) * H * a)
        norm(f"{att}.kv_a_layernorm", kr, T, "kv_a", T * (kr + dr) * a)
    add(f"{att}.kv_b_proj", "kv_lat", T * kr * a)
    if weight_copies:
        add(f"{att}.kv_b_proj", "w_kv_b", kr * n * (dn + dv) * a)
        add(f"{att}.o_proj", "w_o", n * dv * H * a)
    core = f"{att}.core_attention"
    qb = _rotary_bytes(c, layer_idx)
    add(core, "query", T * n * (dn + dr) * qb)                 # query, key (concatenations)
    add(core, "key", T * n * (dn + dr) * qb)
    if core_attention == "math" and batch == 1 and qb == a:
        # one sequence: the math path's [B*heads, S, d_v] value is a view of the whole kv_b output
        add(core, "kv", T * n * (dn + dv) * a)
    else:
        add(core, "value", T * n * dv * qb)                     # value, made contiguous in the query's dtype
    _core_outputs(add, core, batch, seq, n, dv * T * n * qb, core_attention)
    add(f"{att}.o_proj", "attn_out", T * n * dv * a)
    if c.sparse_attention and (c.dsa_indexer_loss_coeff or 0) > 0:
        _indexer_saved(add, c, T, batch, seq, a)


def _core_outputs(add: Any, core: str, batch: int, seq: int, n: int, out_bytes: int, core_attention: str) -> None:
    # the math path keeps the softmax probabilities (fp32), the fused kernels the output and log-sum-exp
    if core_attention == "math":
        add(core, "probs", batch * n * seq * seq * 4)
    elif core_attention == "fused":
        add(core, "out", out_bytes)
        add(core, "lse", batch * n * seq * 4)
    else:
        raise ValueError(f"core_attention: expected 'fused' or 'math', got {core_attention!r}")


def _gqa_saved(add: Any, norm: Any, c: Any, layer_idx: int, T: int, batch: int, seq: int, n: int, a: int,
               core_attention: str, weight_copies: bool) -> None:
    """Grouped-query attention's rows (Qwen3-MoE, GLM-4-MoE; ``lit_moe/model/gqa.py``): q/k/v projections
    of the block's input (saved once, as ``ln1``), the per-head q/k norms on the projections' outputs,
    the rotary step (its cos/sin only: :func:`per_forward_bytes`; the result is in the compute dtype),
    and the core attention on the key/value heads repeated to the ``n`` query heads. ``n``: this
    rank's query heads, its key/value heads ``n * kv_heads / num_attention_heads``."""
    d = c.gqa_head_dim
    kv = max(n * c.kv_heads // c.num_attention_heads, 1)
    att, core = "self_attention", "self_attention.core_attention"
    H = c.hidden_size
    if weight_copies:
        add(f"{att}.q_proj", "w_q", H * n * d * a)
        add(f"{att}.k_proj", "w_k", H * kv * d * a)
        add(f"{att}.v_proj", "w_v", H * kv * d * a)
        add(f"{att}.o_proj", "w_o", n * d * H * a)
    if c.qk_layernorm:   # on q_proj's / k_proj's outputs, one head_dim-wide norm per head
        norm(f"{att}.q_norm", d, T * n, "q_proj", T * n * d * a)
        norm(f"{att}.k_norm", d, T * kv, "k_proj", T * kv * d * a)
    # query (rotated), key and value repeated to the query heads: all [B, n, S, d] in the compute dtype
    for key in ("query", "key", "value"):
        add(core, key, T * n * d * a)
    _core_outputs(add, core, batch, seq, n, T * n * d * a, core_attention)
    if core_attention == "math":
        # the product's input (the masked probabilities in the compute dtype) and the causal masks
        add(core, "probs_v", batch * n * seq * seq * a)
        add(core, "masks", seq * seq + seq)
    # o_proj's input: the fused kernels write their output token-major, so it is a view of "out";
    # the math path's [B, n, S, d] product is copied by the transpose
    add(f"{att}.o_proj", "out" if core_attention == "fused" else "attn_out", T * n * d * a)


def _indexer_saved(add: Any, c: Any, T: int, batch: int, seq: int, a: int) -> None:
    """DeepSeek-V3.2's lightning indexer in a training forward with its loss (``dsa_indexer_loss_coeff > 0``;
    otherwise it runs without autograd and saves nothing): the key LayerNorm (input in its dtype, mean,
    rstd), the fp32 rotated queries and key, the fp32 head weights, each head's ReLU scores ``[B, S, S]``
    (fp32) and the KL loss's log-softmax, target and two masks. Its projections' inputs are the
    attention's (detached views of the same storages), and no weight copy is saved: the detached inputs
    need no gradient."""
    f = _bytes(c.torch_dtype("layernorm_compute_dtype"))
    nh, D = c.index_n_heads, c.index_head_dim
    ix = "self_attention.indexer"
    add(f"{ix}.k_norm", "indexer.wk" if a == f else "indexer.wk.upcast", T * D * f)
    add(f"{ix}.k_norm", "indexer.mean", T * 4)
    add(f"{ix}.k_norm", "indexer.rstd", T * 4)
    add(ix, "indexer.key", T * D * 4)
    add(ix, "indexer.query", T * nh * D * 4)
    add(ix, "indexer.weights", T * nh * 4)
    add(ix, "indexer.relu", nh * batch * seq * seq * 4)
    add(ix, "indexer.log_q", batch * seq * seq * 4)
    add(ix, "indexer.target", batch * seq * seq * 4)
    add(ix, "indexer.masks", 2 * batch * seq * seq)


class EstimateUnavailable(ValueError):
    """The family's layers are not modelled (:func:`not_estimated`)."""


def not_estimated(config: Any, schedule: Optional[str] = None) -> Optional[str]:
    """Why the activation figure is not available for this model under the pipeline ``schedule`` (None:
    it is): a split backward (zero-bubble schedules) keeps output gradients that
    :func:`layer_weight_grad_bytes` does not model for DeepSeek-V4's attention and hyper-connections."""
    v4 = getattr(config, "v4_attention", False) or getattr(config, "enable_hyper_connections", False)
    if v4 and schedule in SPLIT_BACKWARD_SCHEDULES:
        return (f"activation memory: not available for {config.model_type} with pipeline_parallel_schedule "
                f"{schedule!r} (the split backward's kept gradients of DeepSeek-V4's attention / hyper-connections "
                "are not modelled); the activation column counts 0")
    return None


def _mlp(add: Any, owner: str, F: int, T: int, H: int, a: int, weight_copies: bool, fused_weights: bool,
         config: Any = None) -> None:
    # concatenated gate/up weight, gate|up output, activation, activation x up (down's input)
    if fused_weights:
        add(owner, f"{owner}.w_gate_up", 2 * F * H * a)
    add(owner, f"{owner}.gate_up", T * 2 * F * a)
    add(owner, f"{owner}.act", T * F * a)
    add(f"{owner}.down_proj", f"{owner}.product", T * F * a)
    if weight_copies:
        add(f"{owner}.down_proj", f"{owner}.w_down", F * H * a)
    _clamped(add, config, owner, T * F * a)


def _clamped(add: Any, c: Any, owner: str, nbytes: int) -> None:
    """DeepSeek-V4's SwiGLU limit (``swiglu_limit``): the clamped gate (the activation's input) and the
    clamped up (the product's), ``nbytes`` each, besides the gate|up output the clamps keep."""
    if c is not None and getattr(c, "swiglu_limit", None):
        add(owner, f"{owner}.clamped_gate", nbytes)
        add(owner, f"{owner}.clamped_up", nbytes)


def _hyper_connection_saved(add: Any, c: Any, hc: str, T: int, a: int, streams_key: str) -> None:
    """One mHC read of the ``n = hc_mult`` streams ``[T, n, H]`` (``lit_moe/model/hyper_connections.py``,
    all fp32): the streams normalised together (their fp32 copy, rsqrt; the normalised product is
    ``fn``'s input), ``fn``'s output (the three scaled groups are views of it), the two sigmoids'
    outputs, Sinkhorn's softmax and each of its ``2 iters - 1`` divisions' numerator and denominator,
    the collapse weights (sigmoid + eps) and the streams they weight (``streams_key``, the compute dtype)."""
    n, H = c.hc_mult, c.hidden_size
    divisions = 2 * c.hc_sinkhorn_iters - 1
    add(hc, streams_key, T * n * H * a)
    add(hc, f"{hc}.upcast" if a != 4 else streams_key, T * n * H * 4)
    add(hc, f"{hc}.rsqrt", T * 4)
    add(hc, f"{hc}.normed", T * n * H * 4)
    add(hc, f"{hc}.mixes", T * (2 + n) * n * 4)
    add(hc, f"{hc}.pre_sigmoid", T * n * 4)
    add(hc, f"{hc}.post_sigmoid", T * n * 4)
    add(hc, f"{hc}.sinkhorn", T * n * n * 4 * (1 + divisions) + T * n * 4 * divisions)
    add(hc, f"{hc}.pre", T * n * 4)


def _mixed_streams_saved(add: Any, c: Any, hc: str, T: int, a: int) -> None:
    """:func:`lit_moe.model.hyper_connections.mix_streams` in the compute dtype: the block's output, the
    output weights ``post`` and the mixing ``comb`` (cast; in fp32 the tensors themselves); its output
    (``{hc}.mixed``) is the next read's streams."""
    n, H = c.hc_mult, c.hidden_size
    add(hc, f"{hc}.block_out", T * H * a)
    add(hc, f"{hc}.post", T * n * a)
    add(hc, f"{hc}.comb", T * n * n * a)


def _unweighted_norm(add: Any, owner: str, rows: int, d: int, a: int) -> None:
    # x * rsqrt(mean(x.float()^2) + eps).to(x.dtype): x, the fp32 rsqrt; another dtype also x's fp32
    # copy and the rsqrt's cast
    add(owner, f"{owner}.x", rows * d * a)
    add(owner, f"{owner}.rsqrt", rows * 4)
    if a != 4:
        add(owner, f"{owner}.upcast", rows * d * 4)
        add(owner, f"{owner}.rsqrt_cast", rows * a)


def _compressor_saved(add: Any, c: Any, owner: str, batch: int, seq: int, dim: int, rate: int,
                      overlap: bool, a: int, weight_copies: bool) -> None:
    """A compressor's pooling (its projections read the attention's input, saved once): the fp32 values
    and gate softmax over each window (``2 rate`` slots with CSA's overlap), the fp32 kv_norm of the
    pooled entries, the rotary angles of the windows' first positions."""
    W, width = seq // rate, 2 * dim if overlap else dim
    H = c.hidden_size
    if weight_copies:
        add(owner, f"{owner}.w_kv", width * H * a)
        add(owner, f"{owner}.w_gate", width * H * a)
    slots = 2 * rate if overlap else rate
    add(owner, f"{owner}.values", batch * W * slots * dim * 4)
    add(owner, f"{owner}.softmax", batch * W * slots * dim * 4)
    add(f"{owner}.kv_norm", f"{owner}.pooled", batch * W * dim * 4)
    add(f"{owner}.kv_norm", f"{owner}.rsqrt", batch * W * 4)
    add(f"{owner}.kv_norm", f"{owner}.normed", batch * W * dim * 4)
    add(owner, f"{owner}.angles", 2 * W * (c.v4_rope_dim // 2) * 4)


def _v4_attention_saved(add: Any, norm: Any, c: Any, layer_idx: int, T: int, batch: int, seq: int, n: int, a: int,
                        weight_copies: bool) -> None:
    """DeepSeek-V4's attention (``lit_moe/model/v4_attention.py``): the low-rank query and its norm, the
    per-head unweighted query norm, the one key/value head and its norm, the layer's own rotary
    angles (queries, keys, the output's back-rotation), the compressed entries (CSA, HCA; the lightning
    indexer runs without autograd), the fp32 sink attention over ``seq`` window keys plus the entries
    (query, keys, the mask, the softmax with the sink column) and the grouped output projections.
    ``n``: this rank's heads."""
    H, d, qr, r = c.hidden_size, c.gqa_head_dim, c.q_lora_rank, c.v4_rope_dim
    att = "self_attention"
    layer_type = c.layer_types[min(layer_idx, c.num_hidden_layers - 1)]
    groups = c.o_groups * n // c.num_attention_heads         # this rank's head groups
    if weight_copies:
        add(f"{att}.q_a_proj", "w_q_a", qr * H * a)
        add(f"{att}.q_b_proj", "w_q_b", n * d * qr * a)
        add(f"{att}.kv_proj", "w_kv", d * H * a)
        add(f"{att}.o_a_proj", "w_o_a", n * d * c.o_lora_rank * a)
        add(f"{att}.o_b_proj", "w_o_b", groups * c.o_lora_rank * H * a)
    norm(f"{att}.q_a_norm", qr, T, "q_a", T * qr * a)
    add(f"{att}.q_b_proj", "q_lat", T * qr * a)
    _unweighted_norm(add, f"{att}.q_norm", T * n, d, a)
    norm(f"{att}.kv_norm", d, T, "kv_a", T * d * a)
    add(att, "angles", 5 * T * (r // 2) * 4)                 # cos, sin of queries and keys, -sin
    entries = 0
    if layer_type != "sliding_attention":
        rate = c.compress_rate(layer_type)
        entries = seq // rate
        _compressor_saved(add, c, f"{att}.compressor", batch, seq, d, rate,
                          layer_type == "compressed_sparse_attention", a, weight_copies)
    keys = batch * (seq + entries) * d * 4
    core = f"{att}.sink_attention"
    add(core, "query.fp32", T * n * d * 4)
    add(core, "keys.fp32", keys)
    if a != 4:
        add(core, "keys.fp32.again", keys)                    # k.float() again for the probabilities' product
    add(core, "blocked", T * (seq + entries))                 # ~allowed, one byte per query and key
    add(core, "probs", T * n * (seq + entries + 1) * 4)       # with the sink column
    add(f"{att}.o_a_proj", "attn_out", T * n * d * a)
    add(f"{att}.o_b_proj", "o_a", T * groups * c.o_lora_rank * a)


def per_forward_bytes(config: Any, tokens: int) -> int:
    """Tensors one forward shares between its layers: the rotary cos and sin, ``[T, d_rope / 2]`` each
    (``rotary_dim``: MLA's ``qk_rope_head_dim``, the rotated part of a grouped-query head)."""
    if config.position_embedding_type not in ("rope", "yarn") or getattr(config, "v4_attention", False):
        return 0   # (DeepSeek-V4's attention computes its own angles per layer: its rows)
    return 2 * tokens * (config.rotary_dim // 2) * _bytes(config.torch_dtype("rotary_dtype"))


def head_bytes(config: Any, tokens: int, tp: int = 1) -> int:
    """The final norm and the output-layer loss. One tensor-parallel rank (``tp == 1``): the fused loss
    (``ops/cross_entropy.py``) keeps the logits' gradient ``[T, V]`` (and its input) when that is
    smaller than the two input gradients, else those. Under tensor parallel: the norm on the sequence
    shard, the gathered head input, and the vocabulary-parallel loss's fp32 softmax ``[T, V / tp]``
    with its label index, in-range flags and the loss mask (:func:`lit_moe.strategies.comm.vocab_parallel_cross_entropy`)."""
    c = config
    T, H, V = tokens, c.hidden_size, c.vocab_size
    a = _bytes(c.torch_dtype("compute_dtype"))
    f = _bytes(c.torch_dtype("layernorm_compute_dtype"))
    Tl = T // tp
    norm = 2 * Tl * H * f + Tl * f + T * H * a          # its (gathered) output is the head's input
    norm += collapse_bytes(c, Tl)
    if tp > 1:
        return norm + T * (V // tp) * 4 + T * INDEX_BYTES + T + T * 4
    return norm + (T * V * a if T * V <= H * (T + V) else T * H * a + V * H * a)


def collapse_bytes(config: Any, tokens: int) -> int:
    """DeepSeek-V4's learned collapse of the mHC streams ahead of the final norm (``hc_head``, fp32): the
    streams (compute dtype; their fp32 copy in another), the rsqrt, the normalised product ``hc_fn``
    reads, its output, the sigmoid's output and the weights (+ eps). The mean collapse saves nothing."""
    c = config
    if not (c.enable_hyper_connections and c.enable_hc_head):
        return 0
    T, n, H = tokens, c.hc_mult, c.hidden_size
    a = _bytes(c.torch_dtype("compute_dtype"))
    return T * n * H * a + (T * n * H * 4 if a != 4 else 0) + T * 4 + T * n * H * 4 + 3 * T * n * 4


def head_transient_bytes(config: Any, tokens: int, tp: int = 1) -> int:
    """What the vocabulary-parallel loss holds next to the softmax it keeps, at the end of the forward
    (tensor parallel only; the fused loss of one rank works in chunks): the head's logits ``[T, V / tp]``,
    their fp32 copy (another dtype only), and the shifted logits and their exponentials (fp32)."""
    if tp == 1:
        return 0
    a = _bytes(config.torch_dtype("compute_dtype"))
    return tokens * (config.vocab_size // tp) * (a + (4 if a != 4 else 0) + 8)


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
    if not c.multi_latent_attention:                      # grouped-query attention
        d, kv = c.gqa_head_dim, max(n * c.kv_heads // c.num_attention_heads, 1)
        total += T * n * d * a + 2 * T * kv * d * a       # q, k, v projections
        total += latent_norm * (T * n * d + T * kv * d) * f              # q_norm, k_norm
    elif qr is not None:
        total += T * (qr + kr + dr) * a                   # fused q_a/kv_a GEMM
        total += latent_norm * T * qr * f + T * n * (dn + dr) * a      # q_a_layernorm, q_b_proj
    else:
        total += T * n * (dn + dr) * a + T * (kr + dr) * a             # q_proj, kv_a_proj_with_mqa
    if c.multi_latent_attention:
        total += latent_norm * T * kr * f + T * n * (dn + dv) * a      # kv_a_layernorm, kv_b_proj
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


def _layer_recompute(i: int, recompute_layers: frozenset, selection: Optional[dict]) -> dict[str, Any]:
    """``layer_activation_bytes``'s recompute arguments of layer ``i``: whole, or the paths selective
    recompute wraps (``selection``: layer -> (checkpointed, output-recomputed) paths)."""
    checkpointed, output_recomputed = (selection or {}).get(i, ((), ()))
    return {"recompute": i in recompute_layers, "checkpointed": checkpointed, "output_recomputed": output_recomputed}


def stage_activation_bytes(config: Any, layers: range, tokens: int, batch: int, seq: int, *,
                           recompute_layers: frozenset = frozenset(), selection: Optional[dict] = None,
                           **kwargs) -> int:
    """One micro-batch's saved bytes of a stage holding decoder ``layers`` (+ the rotary angles)."""
    total = per_forward_bytes(config, tokens) if len(layers) else 0
    for i in layers:
        total += layer_activation_bytes(config, i, tokens, batch, seq, **_layer_recompute(i, recompute_layers, selection),
                                        **kwargs)
    return total


def last_stage_extra_bytes(config: Any, tokens: int, batch: int, seq: int, *,
                           recompute_layers: frozenset = frozenset(), selection: Optional[dict] = None,
                           **kwargs) -> int:
    """What the last stage saves besides its decoder layers: the final norm and loss head, and per MTP
    depth its decoder block and its own norms and head."""
    tp = kwargs.get("tp", 1)
    total = head_bytes(config, tokens, tp)
    L = config.num_hidden_layers
    for j in range(getattr(config, "num_nextn_predict_layers", 0) or 0):
        total += layer_activation_bytes(config, L + j, tokens, batch, seq,
                                        **_layer_recompute(L + j, recompute_layers, selection), **kwargs)
        total += head_bytes(config, tokens, tp)
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
