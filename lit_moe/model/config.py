"""``DeepseekV3Config``: the ``model:`` section of ``pynative.yaml``, as a dataclass whose field docstrings
are the docs.

``DeepseekV3Config(**model_section)`` accepts the section as written: Hugging Face DeepSeek-V3 names
(canonical attribute names here, plus the ``rope_scaling`` / ``rope_parameters`` dicts), MindFormers /
Megatron names (mapped to the canonical ones, see ``ALIASES``) and the keys accepted without effect
(``lit_moe.config.NO_EFFECT_KEYS``). Any other key is an error with a did-you-mean suggestion. How a
section is read and checked lives in ``lit_moe/model/config_parsing.py``.

Inconsistent values raise :class:`lit_moe.config.ConfigError` (a ``ValueError``) whose message names the
field (``model.<name>``) and the value.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lit_moe.config import ConfigError
from lit_moe.model.families import FAMILY_DEFAULTS, v4_layer_types_from_ratios
from lit_moe.model.config_parsing import (  # noqa: F401  (public names of this module)
    _DTYPES,
    ALIASES,
    DISPATCHER_TYPES,
    DTYPE_FIELDS,
    IGNORED_KEYS,
    LOAD_BALANCING_TYPES,
    POSITION_EMBEDDING_TYPES,
    SCORING_FUNCS,
    TOKEN_DROP_POLICIES,
    TOPK_METHODS,
    check_type,
    normalise,
    resolve_keys,
    validate,
)


@dataclass(init=False)
class DeepseekV3Config:
    """DeepSeek-V3 hyper-parameters. Construct with ``DeepseekV3Config(**model_section)``."""

    # ------------------------------------------------------------------ identity
    model_type: str = "deepseek_v3"
    """The model family: ``deepseek_v3`` (or ``deepseek_mtp``), ``deepseek_v32`` (DeepSeek-V3.2: sparse
    attention), ``deepseek_v4``, ``qwen3_moe`` (Qwen3-MoE) or ``glm4_moe`` (GLM-4-MoE); anything else is an error. A family sets the defaults of the fields its section leaves
    out (``lit_moe.model.families.FAMILY_DEFAULTS``, README "Model families")."""
    architectures: Any = None
    """``DeepseekV3ForCausalLM``, ``Qwen3MoeForCausalLM``, ``Glm4MoeForCausalLM`` or ``DeepseekV4ForCausalLM`` (a string or a
    one-element list); informational."""

    # ------------------------------------------------------------------ sizes
    vocab_size: int = 129280
    """Vocabulary size (rows of the embedding and of the untied output head)."""
    hidden_size: int = 7168
    """Model width h."""
    intermediate_size: int = 18432
    """Width of the dense SwiGLU MLP (layers below ``first_k_dense_replace``)."""
    moe_intermediate_size: int = 2048
    """Width of one routed expert."""
    num_hidden_layers: int = 61
    """Decoder layers (MTP layers come on top)."""
    num_attention_heads: int = 128
    """Attention heads."""
    num_key_value_heads: Optional[int] = None
    """Grouped-query attention (``multi_latent_attention: False``): key/value heads, each shared by
    ``num_attention_heads / num_key_value_heads`` query heads; None: one per query head. Accepted and
    ignored with MLA (Hugging Face compatibility: MLA has no key/value head groups, and HF's DeepSeek-V3
    configs carry a default of 128 whatever the head count)."""
    seq_length: int = 4096
    """Training sequence length (MindFormers); the default YaRN original length."""

    # ------------------------------------------------------------------ MLA
    multi_latent_attention: bool = True
    """True: multi-head latent attention (DeepSeek-V3). False: grouped-query attention
    (``lit_moe/model/gqa.py``; Qwen3-MoE, GLM-4-MoE): ``q_proj``/``k_proj``/``v_proj``/``o_proj`` over
    ``head_dim``-wide heads, ``num_key_value_heads`` key/value heads, per-head RMSNorm of q and k when
    ``qk_layernorm``, biases on q/k/v when ``attention_bias``, rotate-half RoPE on the first
    ``partial_rotary_factor`` of each head; the MLA fields below are then unused."""
    q_lora_rank: Optional[int] = 1536
    """Rank of the query down-projection; None or 0 for a direct ``q_proj``."""
    kv_lora_rank: int = 512
    """Rank of the compressed key/value latent."""
    qk_nope_head_dim: int = 128
    """Per-head query/key dims without position encoding."""
    qk_rope_head_dim: int = 64
    """Per-head query/key dims that carry the rotary encoding (shared rope key); even."""
    v_head_dim: int = 128
    """Per-head value dims; at most ``qk_nope_head_dim + qk_rope_head_dim``."""
    qk_layernorm: bool = True
    """RMSNorm on the q and kv latents (DeepSeek-V3: True). False: identity (not exportable to HF). With
    grouped-query attention: per-head RMSNorm of q and k before the rotary encoding (Qwen3's
    ``q_norm``/``k_norm``; Hugging Face GLM-4-MoE's ``use_qk_norm``). A
    ``pynative.yaml`` section without the key gets MindFormers' default, False (its ``TransformerConfig``)."""
    mla_qkv_concat: bool = True
    """Accepted (a MindFormers weight-layout option); the projections are kept separate here."""
    attention_bias: bool = False
    """Biases in the q/k/v projections (MindFormers: ``add_qkv_bias``): grouped-query attention only
    (GLM-4.5 has them); MLA has none."""
    add_bias_linear: bool = False
    """Biases in linear layers: not supported (DeepSeek-V3 has none)."""
    use_flash_attention: bool = True
    """True: ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient kernels; they
    accumulate the softmax in fp32). False: explicit matmul-softmax-matmul with the softmax computed in
    ``softmax_compute_dtype``."""
    use_eod_attn_mask_compression: bool = False
    """MindFormers' compressed EOD mask: attention stays within the documents whose ends the batch's
    ``actual_seq_len`` column gives (``train_dataset.dataloader.config.create_compressed_eod_mask``),
    so True needs that column: without it ``lit_moe fit`` stops with one line naming the dataset key
    (MindFormers fails at the first step: "TND attention requires actual_seq_len"). As in MindFormers'
    PyNative trainer, data with ``create_compressed_eod_mask: true`` turns it on. (Here the mask is
    built from ``actual_seq_len`` whenever the batch has it, on every kernel and under context
    parallel; MindFormers also requires ``use_flash_attention``, which this does not.)"""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (training only)."""
    hidden_dropout: float = 0.0
    """Dropout on the embedding output and on each residual branch (training only)."""
    window_size: Any = None
    """Sliding-window attention ``(left, right)``: a query attends to keys at most ``left`` positions before
    it (-1: unlimited). The model is causal, so ``right`` must be 0 or -1. YAML ``(10, 0)`` (a string),
    ``[10, 0]`` and ``10`` are accepted. None: no sliding window."""
    window_attn_skip_freq: Any = None
    """Which layers use the window when ``window_size`` is set. int N: every N-th layer (N-1, 2N-1, ...)
    is full attention, the others sliding-window; a list of 0/1 per decoder layer (1 = sliding window,
    0 = full; MTP layers copy the last entry unless the list covers them too). None: all layers slide."""

    # ------------------------------------------------------------------ attention variants (V3.2, V4)
    experimental_attention_variant: Optional[str] = None
    """None or ``mla``: the attention ``multi_latent_attention`` picks (MindFormers' PyNative DeepSeek-V4
    test config trains V4 with MLA). ``dsa``: DeepSeek-V3.2's sparse attention, MLA whose queries each
    attend only to the ``index_topk`` keys a lightning indexer picks (``lit_moe/model/indexer.py``);
    needs ``q_lora_rank``; the ``deepseek_v32`` family sets it, MindFormers turns it on with this key on
    a DeepSeek-V3 model. ``dsv4_hybrid``: DeepSeek-V4's attention (``lit_moe/model/v4_attention.py``,
    Hugging Face ``DeepseekV4Attention``): one shared key=value head of ``head_dim``, low-rank queries
    (``q_lora_rank``), interleaved RoPE on the trailing ``head_dim * partial_rotary_factor`` dims (undone
    on the output), a learned per-head sink, a sliding window of ``sliding_window`` keys, per
    ``layer_types`` compressed keys (CSA with its top-k indexer, HCA) and the grouped output projection
    (``o_groups``, ``o_lora_rank``); the ``deepseek_v4`` family sets it."""
    index_topk: Optional[int] = None
    """The lightning indexer's top-k. DSA: keys each query attends to (MindFormers:
    ``dsa_indexer_topk``), None: 2048. ``dsv4_hybrid`` CSA layers: compressed entries each query keeps,
    None: 512."""
    index_n_heads: Optional[int] = None
    """The lightning indexer's query heads (MindFormers: ``dsa_indexer_n_heads``); None: 64."""
    index_head_dim: Optional[int] = None
    """The lightning indexer's head width; None: 128. DSA: at least ``qk_rope_head_dim`` (its leading
    dims carry the rotary encoding; MindFormers: ``dsa_indexer_head_dim``)."""
    dsa_indexer_loss_coeff: Optional[float] = None
    """DSA: weight of DeepSeek-V3.2's indexer loss, as in MindFormers and Megatron: each indexer adds
    ``coeff * mean_t KL(p_t || softmax(I_t))`` to the training objective, t every query token of the
    micro-batch (padded and loss-masked ones included, as there; a query with no allowed key counts 0),
    p_t the main attention's probabilities on the query's selected keys (its top-k in the sparse stage,
    every allowed key in the dense warm-up stage: ``dsa_indexer_use_sparse_loss``) summed over the heads
    and L1-renormalised (detached), I_t the index scores on those keys. Every indexer counts with
    weight 1, the MTP layers' too. The indexer's inputs are detached: it is trained by this loss only,
    the rest of the model by the language-model loss only. Logged as ``indexer_loss`` (the sum over the
    indexers, coefficient included; MindFormers logs the mean over the layers). None or 0: no indexer
    loss (the indexer gets no gradient)."""
    dsa_indexer_use_sparse_loss: bool = False
    """DSA: MindFormers' training stage. True: the sparse stage (each query attends its ``index_topk``
    keys, the indexer loss over those keys). False (MindFormers' default): the dense warm-up stage, as
    MindFormers' PyNative model runs it: the MLA attends every key the mask allows (training, evaluation
    and generation; the indexer's selection is unused), the model freezes every parameter outside the
    indexers at construction (the MTP layers' indexers train too; the expert biases, buffers, keep their
    load-balancing update as there), and the indexer loss (``dsa_indexer_loss_coeff``, required > 0)
    takes every allowed key of each query: the target is the main attention's probabilities summed over
    the heads and L1-renormalised (detached), compared with the softmax of the index scores over the
    same keys. The ``deepseek_v32`` family sets True."""

    # ------------------------------------------------------------------ grouped-query attention
    head_dim: Optional[int] = None
    """Grouped-query attention: width of each q/k/v head; None: ``hidden_size // num_attention_heads``.
    Accepted and unused with MLA (Hugging Face's DeepSeek-V3 config.json carries qk_rope_head_dim in it)."""
    partial_rotary_factor: float = 1.0
    """Grouped-query attention: the fraction of each q/k head's dims that are rotated (the leading
    ``int(head_dim * factor)`` dims, rotate-half pairs as in Hugging Face; the rest pass unrotated).
    GLM-4-MoE: 0.5; Qwen3-MoE: 1. Unused with MLA (``qk_rope_head_dim`` sets its rotary dims)."""

    # ------------------------------------------------------------------ position encoding
    position_embedding_type: str = "rope"
    """``rope``, ``yarn`` (RoPE with YaRN frequency scaling), ``none`` or ``learned_absolute`` (a trained
    table of ``max_position_embeddings`` rows added to the token embeddings)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    max_position_embeddings: int = 163840
    """Longest supported position (size of the learned table; HF's YaRN target length). A ``pynative.yaml``
    section without the key gets MindFormers' default, 4096."""
    scaling_factor: float = 40.0
    """YaRN scale s (HF ``rope_scaling.factor``); must be >= 1. In a ``pynative.yaml`` write it as
    ``rotary_scaling_factor`` (MindFormers' name, default 40): MindFormers ignores a ``scaling_factor`` key,
    and so does ``lit_moe fit`` (one line when its value differs)."""
    original_max_position_embeddings: Optional[int] = None
    """YaRN original context length L0 (HF ``rope_scaling.original_max_position_embeddings``).
    None: ``seq_length``. A ``pynative.yaml`` section without the key gets ``max_position_embeddings``,
    which MindFormers' PyNative model passes to YaRN as its original length."""
    beta_fast: float = 32.0
    """YaRN: rotations above which dimensions keep the original frequency."""
    beta_slow: float = 1.0
    """YaRN: rotations below which dimensions are fully interpolated."""
    mscale: float = 1.0
    """YaRN magnitude factor of cos/sin: m(s, mscale) / m(s, mscale_all_dim), as Hugging Face. A
    ``pynative.yaml`` section without the key gets MindFormers' default, 0.707."""
    mscale_all_dim: float = 1.0
    """YaRN softmax-scale factor: the scale is (d_qk)^-1/2 * m(s, mscale_all_dim)^2 (0 disables). A
    ``pynative.yaml`` section without the key gets MindFormers' default, 0.707."""
    nope_layer_interval: Optional[int] = None
    """With rope/yarn: N > 0 puts N rotary layers between consecutive layers without position encoding
    (layers N, 2N+1, 3N+2, ... have none). None or 0: every layer uses the rotary encoding."""
    use_fused_rope: Optional[bool] = None
    """Fused rotary kernel (torch_npu ``npu_rotary_mul`` on Ascend). None: wherever available; False: never."""

    # ------------------------------------------------------------------ norms, activation
    normalization: str = "RMSNorm"
    """``RMSNorm`` or ``LayerNorm`` for every norm of the model."""
    fused_norm: bool = True
    """Only fused norms exist (False is an error, as in MindFormers)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every norm."""
    hidden_act: str = "silu"
    """Gated activation of MLPs and experts: ``silu``, ``gelu`` or ``fusedswiglu``."""
    gelu_approximate: str = "none"
    """``gelu`` only: ``none`` (erf) or ``tanh``."""
    silu_inplace: bool = False
    """``silu`` only: apply the activation in place (saves one activation-sized buffer)."""
    use_fused_swiglu: Optional[bool] = None
    """True: ``silu`` uses the fused SwiGLU kernel where the device has one (as ``fusedswiglu`` does)."""
    gated_linear_unit: bool = True
    """Only gated (SwiGLU-style) MLPs are implemented; False is an error."""

    # ------------------------------------------------------------------ MoE
    n_routed_experts: Optional[int] = 256
    """Routed experts per MoE layer; None or 0 makes every layer dense."""
    num_experts_per_tok: int = 8
    """Experts chosen per token (top-K)."""
    n_shared_experts: int = 1
    """Shared experts (one MLP of width ``moe_shared_expert_intermediate_size``) added for every token."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Width of the shared-expert MLP; None: ``n_shared_experts * moe_intermediate_size``."""
    first_k_dense_replace: int = 3
    """The first k decoder layers use the dense MLP, the rest MoE (0 <= k <= num_hidden_layers)."""
    moe_layer_freq: int = 1
    """Beyond the dense prefix, layer i is MoE when ``i % moe_layer_freq == 0``."""
    n_group: Optional[int] = 8
    """Expert groups for group-limited routing (None, 0 or 1: no group limit)."""
    topk_group: Optional[int] = 4
    """Groups kept per token (group score = sum of its two best biased scores)."""
    scoring_func: str = "sigmoid"
    """Router score function: ``sigmoid`` or ``softmax`` (computed in ``router_dense_type``). In a
    ``pynative.yaml`` write it as ``moe_router_score_function`` (default sigmoid): MindFormers deletes a
    ``scoring_func`` key, and so does ``lit_moe fit`` (one line when its value differs)."""
    topk_method: str = "noaux_tc"
    """Accepted for Hugging Face compatibility; routing is defined by the fields here."""
    norm_topk_prob: bool = True
    """Renormalise the chosen experts' scores to sum to 1 before ``routed_scaling_factor``."""
    routed_scaling_factor: float = 2.5
    """Multiplies the routed experts' combine weights."""
    moe_router_enable_expert_bias: bool = True
    """Aux-loss-free balancing: a per-expert bias added to the scores for expert *selection* only,
    updated once per optimizer step (sigmoid routing only)."""
    moe_router_bias_update_rate: float = 1e-3
    """Expert-bias update: ``b += rate * sign(mean(counts) - counts)``."""
    moe_router_load_balancing_type: str = "seq_aux_loss"
    """Auxiliary balancing loss: ``seq_aux_loss`` (per sequence, DeepSeek-V3), ``aux_loss`` (per micro-batch)
    or ``none``. Only computed when ``moe_aux_loss_coeff > 0``. (MindFormers' default, ``sub_seq_aux_loss``,
    is unknown to its own PyNative router; a section relying on the default with the loss on gets one line.)"""
    moe_aux_loss_coeff: float = 0.0
    """Weight alpha of the auxiliary loss."""
    moe_expert_capacity_factor: Optional[float] = None
    """Per-expert capacity C = ceil(T*K/E * factor) for the T tokens of a micro-batch; assignments beyond
    it are dropped. None: dropless."""
    moe_token_drop_policy: str = "probs"
    """With a capacity: keep each expert's highest-probability (``probs``) or earliest (``position``) tokens."""
    use_pad_tokens: bool = True
    """With a capacity: pad every expert to exactly C rows (static shapes; the output is unchanged)."""
    moe_grouped_gemm: bool = True
    """Routed experts through ``torch.nn.functional.grouped_mm`` where it runs; False (or where it does
    not run) an exact per-expert matmul over each expert's contiguous token slice. (MindFormers' default
    False cannot build its PyNative MoE; a section relying on the default gets one line.)"""
    moe_token_dispatcher_type: str = "alltoall"
    """Token exchange under expert parallelism (``alltoall``, ``allgather`` or ``alltoall_deredundancy``,
    see ``parallelism.moe_token_dispatcher_type``); used by the strategy."""
    router_dense_type: str = "float32"
    """dtype of the router GEMM, its scores and the routing decisions."""

    # ------------------------------------------------------------------ MTP
    num_nextn_predict_layers: int = 0
    """Multi-token-prediction depth D (0: none). Depth k predicts token i+1+k. A ``pynative.yaml`` section
    without the key gets MindFormers' DeepSeek-V3 default, 1."""
    mtp_loss_scaling_factor: float = 0.3
    """lambda: the MTP loss is lambda / D * sum of the per-depth masked mean cross-entropies. (MindFormers
    has no default and fails without one once MTP is on; a section relying on 0.3 gets one line.)"""

    # ------------------------------------------------------------------ DeepSeek-V4
    layer_types: Any = None
    """``dsv4_hybrid``: per decoder layer ``sliding_attention``, ``compressed_sparse_attention`` (CSA)
    or ``heavily_compressed_attention`` (HCA). None: Hugging Face's default (2 HCA, then CSA/HCA
    alternating). Hugging Face's older ``compress_ratios`` (0/4/128 per layer) is accepted."""
    compress_rates: Any = None
    """``dsv4_hybrid``: tokens per compressed entry, ``{compressed_sparse_attention: m,
    heavily_compressed_attention: m'}``; None: 4 and 128."""
    compress_rope_theta: float = 160000.0
    """``dsv4_hybrid``: RoPE base of the compressed layers (sliding layers use ``rope_theta``)."""
    sliding_window: int = 128
    """``dsv4_hybrid``: keys a query sees in its local branch (itself and the ``sliding_window - 1``
    before it)."""
    o_groups: int = 8
    """``dsv4_hybrid``: head groups of the grouped output projection."""
    o_lora_rank: int = 1024
    """``dsv4_hybrid``: per-group width of the grouped output projection."""
    enable_hyper_connections: bool = False
    """Manifold-constrained hyper-connections (mHC, DeepSeek-V4; ``lit_moe/model/hyper_connections.py``):
    the residual is ``hc_mult`` streams; before attention and before the MLP a learned projection of the
    normalised streams gives the collapse weights (sigmoid), the output weights (2 sigmoid) and a
    doubly-stochastic stream mixing (Sinkhorn-Knopp); after the last layer the streams collapse
    (``enable_hc_head``) ahead of the final norm."""
    hc_mult: int = 4
    """mHC: residual streams (MindFormers: ``num_residual_streams``)."""
    hc_sinkhorn_iters: int = 20
    """mHC: Sinkhorn-Knopp iterations (row softmax, one column normalisation, then ``iters - 1`` row/column
    rounds; 0 and 1 both give the single column normalisation, as in MindFormers and Hugging Face)."""
    hc_eps: float = 1e-6
    """mHC: the epsilon added to the collapse weights and in the Sinkhorn normalisations (Hugging Face's
    meaning; the streams' RMS norm uses ``rms_norm_eps``)."""
    enable_hc_head: bool = False
    """mHC: True collapses the final streams with a learned head (sigmoid weights from the normalised
    streams; Hugging Face always); False averages them (MindFormers' default)."""
    mhc_init_gating_factor: float = 0.01
    """mHC: the initial gating scales of each hyper-connection (MindFormers' init: collapse bias
    -log 3, output bias 0, mixing bias 5 (I - 1))."""
    num_hash_layers: int = 0
    """Hash routing (DeepSeek-V4): the first N MoE layers choose experts by a fixed token-id table
    ``tid2eid [vocab, top-k]`` (initialised round-robin, ``(id + k) % n_routed_experts``, as MindFormers;
    a checkpoint's table is loaded); the learned gate still weights them. MTP layers never hash."""
    swiglu_limit: Optional[float] = None
    """Clamp inside the gated activation (DeepSeek-V4: 10): gate <= limit, -limit <= up <= limit, for the
    experts and the shared experts. None: no clamp (MindFormers: ``activation_func_clamp_value``)."""

    # ------------------------------------------------------------------ init, dtypes, tokens
    initializer_range: float = 0.02
    """Std of the normal init of every linear, embedding, router and expert weight."""
    tie_word_embeddings: bool = False
    """The output head is untied (True is not supported)."""
    params_dtype: str = "float32"
    """dtype the parameters are created in (master weights)."""
    compute_dtype: str = "bfloat16"
    """dtype of activations and matrix multiplies (weights are cast on the fly). ``auto`` (lit_moe's
    value; ``fit`` and ``plan`` resolve it for the run's device and print what it became, a config
    built in Python resolves it for this machine's default device): ``bfloat16`` where
    bf16 is native (GPUs, Ascend NPUs, CPUs with AMX or AVX512-BF16), ``float32`` elsewhere (CPUs
    with AVX2 only, where torch's bf16 matmuls run many times slower than fp32: benchmarks/README.md). An explicit
    ``bfloat16`` is kept on such a CPU, with one start-up line giving the measured rates."""
    layernorm_compute_dtype: str = "float32"
    """dtype norms compute in (result cast back)."""
    softmax_compute_dtype: str = "float32"
    """dtype of the attention softmax (explicit path; the fused SDPA kernels always use fp32)."""
    rotary_dtype: str = "float32"
    """dtype of the rotary cos/sin and rotation (result cast back)."""
    torch_compile: Optional[bool] = None
    """Compile every decoder layer (MTP layers' included) with ``torch.compile`` (inductor), which
    fuses their element-wise work (norms, rotary, casts, SwiGLU, attention softmax), and the output
    head (norm, fused linear-cross-entropy or head GEMM + loss). ``null`` (default): on for CUDA,
    where compiled layers run faster, off on other devices (on a CPU the compiled step is a little faster
    at the benchmark's size, see benchmarks/README.md, but compiling costs tens of seconds at start-up and needs a C++ compiler).
    With several ranks, parts that would break a compiled graph stay eager: a MoE layer compiles its
    attention half only (its experts are an FSDP unit of their own, expert-parallel dispatch needs
    host split sizes), with asynchronous context parallel the feed-forward half only, and the head
    (norm + lm_head, one FSDP unit) is eager. Compilation happens on the first step; where it
    fails (no compiler, a backend without inductor support) one warning is logged and that part runs
    eagerly."""
    pad_token_id: Optional[int] = None
    """Written to Hugging Face ``config.json``; not used for masking (MindFormers' default 0 also masks
    attention to input ids equal to it when the batch has no attention mask)."""
    bos_token_id: Optional[int] = 0
    """Written to Hugging Face ``config.json``."""
    eos_token_id: Any = 1
    """Written to Hugging Face ``config.json``."""

    # ------------------------------------------------------------------ construction
    def __init__(self, **kwargs: Any):
        qk_head_dim = kwargs.pop("qk_head_dim", None)
        ratios = kwargs.pop("compress_ratios", None)   # Hugging Face's older spelling of layer_types
        if ratios is not None and kwargs.get("layer_types") is None:
            kwargs["layer_types"] = v4_layer_types_from_ratios(ratios)
        values = resolve_keys(kwargs, {f.name for f in dataclasses.fields(self)})
        hints = typing.get_type_hints(type(self))
        family = FAMILY_DEFAULTS.get(values.get("model_type", (None, None))[1], {})
        for f in dataclasses.fields(self):
            if f.name in values:
                value = check_type(values[f.name][0], values[f.name][1], hints[f.name])
            else:
                value = family.get(f.name, f.default)
            object.__setattr__(self, f.name, value)
        normalise(self)
        validate(self)
        if qk_head_dim is not None and qk_head_dim != self.qk_head_dim:
            raise ConfigError(f"model.qk_head_dim: {qk_head_dim!r} must equal qk_nope_head_dim + qk_rope_head_dim "
                              f"({self.qk_head_dim}) (Hugging Face meaning; Megatron's qk_head_dim is "
                              "qk_nope_head_dim here)")

    # ------------------------------------------------------------------ derived
    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width d_qk = nope + rope dims (Hugging Face meaning); ``gqa_head_dim``
        with grouped-query attention."""
        if not self.multi_latent_attention:
            return self.gqa_head_dim
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def gqa_head_dim(self) -> int:
        """Grouped-query attention: the width of one q/k/v head."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        """Grouped-query attention: key/value heads."""
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Rotated dims per q/k head: ``qk_rope_head_dim`` (MLA) or ``int(head_dim * partial_rotary_factor)``."""
        if self.multi_latent_attention:
            return self.qk_rope_head_dim
        return int(self.gqa_head_dim * self.partial_rotary_factor)

    @property
    def sparse_attention(self) -> bool:
        """DeepSeek-V3.2's indexer selects the keys of every MLA (``experimental_attention_variant: dsa``)."""
        return self.experimental_attention_variant == "dsa"

    @property
    def total_layers(self) -> int:
        """Decoder layers plus MTP layers (the layer ids recompute addresses)."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def shared_expert_intermediate_size(self) -> int:
        if self.moe_shared_expert_intermediate_size is not None:
            return self.moe_shared_expert_intermediate_size
        return self.n_shared_experts * self.moe_intermediate_size

    @property
    def yarn_original_length(self) -> int:
        return self.original_max_position_embeddings or self.seq_length

    @property
    def group_limited(self) -> bool:
        return bool(self.n_group) and self.n_group > 1 and self.topk_group < self.n_group

    @property
    def v4_attention(self) -> bool:
        """Whether the layers use DeepSeek-V4's attention (``experimental_attention_variant: dsv4_hybrid``)."""
        return self.experimental_attention_variant == "dsv4_hybrid"

    @property
    def v4_rope_dim(self) -> int:
        """DeepSeek-V4 attention: the rotated (trailing) dims of each head."""
        return int(self.gqa_head_dim * self.partial_rotary_factor)

    def compress_rate(self, layer_type: str) -> int:
        """DeepSeek-V4 attention: source tokens per compressed entry of a CSA / HCA layer."""
        return self.compress_rates[layer_type]

    def is_hash_layer(self, i: int) -> bool:
        """Whether layer ``i`` is a MoE layer routed by the token-id table (``num_hash_layers``)."""
        return i < min(self.num_hash_layers, self.num_hidden_layers) and self.is_moe_layer(i)

    def torch_dtype(self, field_name: str) -> torch.dtype:
        """The ``torch.dtype`` of one of the dtype fields, e.g. ``config.torch_dtype("compute_dtype")``."""
        return _DTYPES[getattr(self, field_name)]

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` (0..total_layers-1; MTP layers copy the last decoder layer) uses MoE."""
        if not self.n_routed_experts:
            return False
        if i >= self.num_hidden_layers:
            i = self.num_hidden_layers - 1
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    def uses_rope(self, i: int) -> bool:
        """Whether layer ``i`` applies the rotary encoding (``nope_layer_interval`` leaves some out)."""
        if self.position_embedding_type not in ("rope", "yarn"):
            return False
        n = self.nope_layer_interval
        return not (n and (i + 1) % (n + 1) == 0)

    def uses_window(self, i: int) -> bool:
        """Whether layer ``i`` uses sliding-window attention."""
        if self.window_size is None:
            return False
        freq = self.window_attn_skip_freq
        if freq is None:
            return True
        if isinstance(freq, int):
            return (i + 1) % freq != 0
        return bool(freq[min(i, len(freq) - 1)])

    def to_dict(self) -> dict[str, Any]:
        """Canonical field → value (round-trips through ``DeepseekV3Config(**d)``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
