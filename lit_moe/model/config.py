"""``DeepseekV3Config``: the ``model:`` section of ``pynative.yaml``.

``DeepseekV3Config(**model_section)`` accepts the section as written: Hugging Face DeepSeek-V3 names
(canonical attribute names here, plus the ``rope_scaling`` / ``rope_parameters`` dicts), MindFormers /
Megatron names (mapped to the canonical ones, see ``ALIASES``) and extra keys (the section allows them,
as MindFormers' ``allow_extra``; unknown names are logged once each and otherwise ignored).

Inconsistent values raise :class:`lit_moe.config.ConfigError` (a ``ValueError``) whose message names the
field (``model.<name>``) and the value.
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import math
import typing
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from lit_moe.config import ConfigError
from lit_moe.ops.activation import SUPPORTED_ACTIVATIONS, SUPPORTED_GELU_APPROXIMATE
from lit_moe.ops.norm import SUPPORTED_NORMS

log = logging.getLogger(__name__)

POSITION_EMBEDDING_TYPES = ("rope", "yarn", "none", "learned_absolute")
SCORING_FUNCS = ("sigmoid", "softmax")
LOAD_BALANCING_TYPES = ("seq_aux_loss", "aux_loss", "none")
TOKEN_DROP_POLICIES = ("probs", "position")
TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")
DISPATCHER_TYPES = ("alltoall", "allgather", "alltoall_deredundancy")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
DTYPE_FIELDS = ("params_dtype", "compute_dtype", "layernorm_compute_dtype", "softmax_compute_dtype",
                "rotary_dtype", "router_dense_type")

# MindFormers / Megatron / older-HF name → canonical name.
ALIASES = {
    "num_layers": "num_hidden_layers",
    "ffn_hidden_size": "intermediate_size",
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "num_moe_experts": "n_routed_experts",
    "num_local_experts": "n_routed_experts",
    "moe_router_topk": "num_experts_per_tok",
    "moe_router_num_groups": "n_group",
    "moe_router_group_topk": "topk_group",
    "moe_router_topk_scaling_factor": "routed_scaling_factor",
    "moe_router_score_function": "scoring_func",
    "moe_router_dtype": "router_dense_type",
    "shared_expert_num": "n_shared_experts",
    "num_query_groups": "num_key_value_heads",
    "layernorm_epsilon": "rms_norm_eps",
    "init_method_std": "initializer_range",
    "rotary_base": "rope_theta",
    "rotary_scaling_factor": "scaling_factor",
    "qk_pos_emb_head_dim": "qk_rope_head_dim",
    "mtp_num_layers": "num_nextn_predict_layers",
    "num_mtp_layers": "num_nextn_predict_layers",
    "mtp_loss_factor": "mtp_loss_scaling_factor",
    "aux_loss_alpha": "moe_aux_loss_coeff",
    "apply_rope_fusion": "use_fused_rope",
    "add_qkv_bias": "attention_bias",
    "use_gmm": "moe_grouped_gemm",
}

# Keys of Hugging Face / DeepSeek ``config.json`` files and MindFormers sections that carry nothing
# for training here; accepted silently.
IGNORED_KEYS = frozenset({
    "transformers_version", "torch_dtype", "dtype", "auto_map", "use_cache", "pretraining_tp",
    "output_router_logits", "ep_size", "seq_aux", "_name_or_path", "rope_interleave", "lit_moe",
    "return_dict", "output_hidden_states", "output_attentions", "use_return_dict", "head_dim",
})


@dataclass(init=False)
class DeepseekV3Config:
    """DeepSeek-V3 hyper-parameters. Construct with ``DeepseekV3Config(**model_section)``."""

    # ------------------------------------------------------------------ identity
    model_type: str = "deepseek_v3"
    """``deepseek_v3`` (or ``deepseek_mtp``); anything else is an error."""
    architectures: Any = None
    """``DeepseekV3ForCausalLM`` (a string or a one-element list); informational."""

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
    """Accepted and ignored (Hugging Face compatibility: MLA has no key/value head groups, and HF's
    DeepSeek-V3 configs carry a default of 128 whatever the head count)."""
    seq_length: int = 4096
    """Training sequence length (MindFormers); the default YaRN original length."""

    # ------------------------------------------------------------------ MLA
    multi_latent_attention: bool = True
    """Only multi-head latent attention is implemented; False is an error."""
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
    """RMSNorm on the q and kv latents (DeepSeek-V3: True). False: identity (not exportable to HF)."""
    mla_qkv_concat: bool = True
    """Accepted (a MindFormers weight-layout option); the projections are kept separate here."""
    attention_bias: bool = False
    """Biases in the attention projections: not supported (DeepSeek-V3 has none)."""
    add_bias_linear: bool = False
    """Biases in linear layers: not supported (DeepSeek-V3 has none)."""
    use_flash_attention: bool = True
    """True: ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient kernels; they
    accumulate the softmax in fp32). False: explicit matmul-softmax-matmul with the softmax computed in
    ``softmax_compute_dtype``."""
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

    # ------------------------------------------------------------------ position encoding
    position_embedding_type: str = "rope"
    """``rope``, ``yarn`` (RoPE with YaRN frequency scaling), ``none`` or ``learned_absolute`` (a trained
    table of ``max_position_embeddings`` rows added to the token embeddings)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    max_position_embeddings: int = 163840
    """Longest supported position (size of the learned table; HF's YaRN target length)."""
    scaling_factor: float = 40.0
    """YaRN scale s (HF ``rope_scaling.factor``); must be >= 1."""
    original_max_position_embeddings: Optional[int] = None
    """YaRN original context length L0 (HF ``rope_scaling.original_max_position_embeddings``).
    None: ``seq_length`` (the MindFormers rule)."""
    beta_fast: float = 32.0
    """YaRN: rotations above which dimensions keep the original frequency."""
    beta_slow: float = 1.0
    """YaRN: rotations below which dimensions are fully interpolated."""
    mscale: float = 1.0
    """YaRN magnitude factor of cos/sin: m(s, mscale) / m(s, mscale_all_dim), as Hugging Face."""
    mscale_all_dim: float = 1.0
    """YaRN softmax-scale factor: the scale is (d_qk)^-1/2 * m(s, mscale_all_dim)^2 (0 disables)."""
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
    """Router score function: ``sigmoid`` or ``softmax`` (computed in ``router_dense_type``)."""
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
    or ``none``. Only computed when ``moe_aux_loss_coeff > 0``."""
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
    not run) an exact per-expert matmul over each expert's contiguous token slice."""
    moe_token_dispatcher_type: str = "alltoall"
    """Token exchange under expert parallelism (``alltoall`` or ``allgather``); used by the strategy."""
    router_dense_type: str = "float32"
    """dtype of the router GEMM, its scores and the routing decisions."""

    # ------------------------------------------------------------------ MTP
    num_nextn_predict_layers: int = 0
    """Multi-token-prediction depth D (0: none). Depth k predicts token i+1+k."""
    mtp_loss_scaling_factor: float = 0.3
    """lambda: the MTP loss is lambda / D * sum of the per-depth masked mean cross-entropies."""

    # ------------------------------------------------------------------ init, dtypes, tokens
    initializer_range: float = 0.02
    """Std of the normal init of every linear, embedding, router and expert weight."""
    tie_word_embeddings: bool = False
    """The output head is untied (True is not supported)."""
    params_dtype: str = "float32"
    """dtype the parameters are created in (master weights)."""
    compute_dtype: str = "bfloat16"
    """dtype of activations and matrix multiplies (weights are cast on the fly)."""
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
    where compiled layers run faster, off on other devices (on a CPU compiling takes tens of seconds
    and the eager CPU kernels are tuned already). Compilation happens on the first step; where it
    fails (no compiler, a backend without inductor support) one warning is logged and that part runs
    eagerly."""
    pad_token_id: Optional[int] = None
    """Written to Hugging Face ``config.json``; not used for masking."""
    bos_token_id: Optional[int] = 0
    """Written to Hugging Face ``config.json``."""
    eos_token_id: Any = 1
    """Written to Hugging Face ``config.json``."""

    # ------------------------------------------------------------------ construction
    def __init__(self, **kwargs: Any):
        kwargs = _expand_rope_dict(dict(kwargs))
        qk_head_dim = kwargs.pop("qk_head_dim", None)
        values: dict[str, Any] = {}
        names = {f.name for f in dataclasses.fields(self)}
        unknown = []
        for key, value in kwargs.items():
            name = ALIASES.get(key, key)
            if name not in names:
                if key not in IGNORED_KEYS:
                    unknown.append(key)
                continue
            if name in values and values[name][1] != value:
                raise ConfigError(f"model.{key}: {value!r} conflicts with model.{values[name][0]}: "
                                  f"{values[name][1]!r} (both set {name})")
            values[name] = (key, value)
        _log_unknown(unknown)
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            if f.name in values:
                value = _check_type(values[f.name][0], values[f.name][1], hints[f.name])
            else:
                value = f.default
            object.__setattr__(self, f.name, value)
        self._normalise()
        self._validate()
        if qk_head_dim is not None and qk_head_dim != self.qk_head_dim:
            raise ConfigError(f"model.qk_head_dim: {qk_head_dim!r} must equal qk_nope_head_dim + qk_rope_head_dim "
                              f"({self.qk_head_dim}) (Hugging Face meaning; Megatron's qk_head_dim is "
                              "qk_nope_head_dim here)")

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width d_qk = nope + rope dims (Hugging Face meaning)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

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

    # ------------------------------------------------------------------ checks
    def _normalise(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        if not self.q_lora_rank:
            set_("q_lora_rank", None)
        if isinstance(self.architectures, (list, tuple)) and len(self.architectures) == 1:
            set_("architectures", self.architectures[0])
        for name in DTYPE_FIELDS:
            value = getattr(self, name)
            key = str(value).replace("torch.", "").lower()
            if key not in _DTYPES:
                raise ConfigError(f"model.{name}: unknown dtype {value!r}; supported: float32, bfloat16, float16")
            set_(name, str(_DTYPES[key]).replace("torch.", ""))
        if self.window_size is not None:
            set_("window_size", _parse_window(self.window_size))
        if self.n_routed_experts and not self.n_group:
            set_("n_group", 1)
        if self.n_routed_experts and not self.topk_group:
            set_("topk_group", self.n_group)
        if self.hidden_act in ("gelu_pytorch_tanh", "gelu_tanh"):  # Hugging Face's names
            set_("hidden_act", "gelu")
            set_("gelu_approximate", "tanh")

    def _validate(self) -> None:
        def fail(name: str, msg: str) -> None:
            raise ConfigError(f"model.{name}: {getattr(self, name)!r} {msg}")

        if self.model_type not in ("deepseek_v3", "deepseek_mtp"):
            fail("model_type", "is not supported; supported: 'deepseek_v3', 'deepseek_mtp'")
        if self.architectures not in (None, "DeepseekV3ForCausalLM"):
            fail("architectures", "is not supported; supported: 'DeepseekV3ForCausalLM'")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                     "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                     "v_head_dim", "seq_length", "max_position_embeddings", "num_experts_per_tok"):
            if getattr(self, name) < 1:
                fail(name, "must be >= 1")
        if self.qk_rope_head_dim < 0 or self.qk_rope_head_dim % 2:
            fail("qk_rope_head_dim", "must be a non-negative even number (rotary pairs)")
        if self.q_lora_rank is not None and self.q_lora_rank < 0:
            fail("q_lora_rank", "must be None, 0 or positive")
        if self.v_head_dim > self.qk_head_dim:
            fail("v_head_dim", f"must not exceed qk_nope_head_dim + qk_rope_head_dim ({self.qk_head_dim})")
        if not self.multi_latent_attention:
            fail("multi_latent_attention", "is not supported: only multi-latent attention is implemented")
        if self.attention_bias:
            fail("attention_bias", "is not supported: DeepSeek-V3 projections have no bias")
        if self.add_bias_linear:
            fail("add_bias_linear", "is not supported: DeepSeek-V3 linear layers have no bias")
        if not self.gated_linear_unit:
            fail("gated_linear_unit", "is not supported: only gated (SwiGLU-style) MLPs are implemented")
        if self.tie_word_embeddings:
            fail("tie_word_embeddings", "is not supported: the output head is untied")
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                fail(name, "must be in [0, 1)")
        for name in ("rms_norm_eps", "initializer_range", "rope_theta"):
            if getattr(self, name) <= 0:
                fail(name, "must be > 0")
        # norms and activation (the seed's rules)
        if not self.fused_norm:
            fail("fused_norm", "is not supported: only fused normalization layers are supported "
                 "(set fused_norm: True)")
        if self.normalization not in SUPPORTED_NORMS:
            fail("normalization", "is not supported; supported: " + ", ".join(map(repr, SUPPORTED_NORMS)))
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            fail("hidden_act", "is not supported; supported: " + ", ".join(map(repr, SUPPORTED_ACTIVATIONS)))
        if self.gelu_approximate not in SUPPORTED_GELU_APPROXIMATE:
            fail("gelu_approximate", "is not supported; supported: "
                 + ", ".join(map(repr, SUPPORTED_GELU_APPROXIMATE)))
        if self.use_fused_swiglu and self.hidden_act == "gelu":
            fail("use_fused_swiglu", "needs a SwiGLU activation, but hidden_act is 'gelu'")
        # positions
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            fail("position_embedding_type", "is not supported; supported: "
                 + ", ".join(map(repr, POSITION_EMBEDDING_TYPES)))
        if self.position_embedding_type in ("rope", "yarn") and self.qk_rope_head_dim == 0:
            fail("qk_rope_head_dim", f"must be > 0 with position_embedding_type {self.position_embedding_type!r}")
        if self.position_embedding_type == "yarn":
            if self.scaling_factor < 1:
                fail("scaling_factor", "must be >= 1 for YaRN")
            if self.beta_fast <= self.beta_slow:
                fail("beta_fast", f"must be greater than beta_slow ({self.beta_slow})")
            if self.yarn_original_length < 1:
                fail("original_max_position_embeddings", "must be >= 1")
            if self.mscale < 0 or self.mscale_all_dim < 0:
                fail("mscale" if self.mscale < 0 else "mscale_all_dim", "must be >= 0")
        if self.nope_layer_interval is not None and self.nope_layer_interval < 0:
            fail("nope_layer_interval", "must be None or >= 0")
        # attention windows
        if self.window_size is not None:
            if self.window_size[1] not in (0, -1):
                fail("window_size", "right size must be 0 or -1: the model is causal, a query never sees "
                     "later tokens")
        freq = self.window_attn_skip_freq
        if freq is not None:
            if isinstance(freq, bool) or not isinstance(freq, (int, list)):
                fail("window_attn_skip_freq", "must be an int or a list of 0/1")
            if isinstance(freq, int) and freq < 1:
                fail("window_attn_skip_freq", "must be >= 1")
            if isinstance(freq, list):
                if any(v not in (0, 1) or isinstance(v, float) for v in freq):
                    fail("window_attn_skip_freq", "list entries must be 0 (full) or 1 (sliding window)")
                if len(freq) not in (self.num_hidden_layers, self.total_layers):
                    fail("window_attn_skip_freq", f"has {len(freq)} entries; the model has "
                         f"{self.num_hidden_layers} decoder layers ({self.total_layers} with MTP)")
        # MoE
        E = self.n_routed_experts or 0
        if E < 0:
            fail("n_routed_experts", "must be >= 0")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            fail("first_k_dense_replace", f"must be in [0, num_hidden_layers={self.num_hidden_layers}]")
        if self.moe_layer_freq < 1:
            fail("moe_layer_freq", "must be >= 1")
        if self.n_shared_experts < 0:
            fail("n_shared_experts", "must be >= 0")
        if self.moe_shared_expert_intermediate_size is not None:
            if self.moe_shared_expert_intermediate_size < 0:
                fail("moe_shared_expert_intermediate_size", "must be >= 0")
            if (self.moe_shared_expert_intermediate_size > 0) != (self.n_shared_experts > 0):
                fail("moe_shared_expert_intermediate_size",
                     f"is inconsistent with n_shared_experts={self.n_shared_experts}")
        if self.scoring_func not in SCORING_FUNCS:
            fail("scoring_func", "is not supported; supported: " + ", ".join(map(repr, SCORING_FUNCS)))
        if self.topk_method not in TOPK_METHODS:
            fail("topk_method", "is not supported; supported: " + ", ".join(map(repr, TOPK_METHODS)))
        if self.moe_router_load_balancing_type not in LOAD_BALANCING_TYPES:
            fail("moe_router_load_balancing_type", "is not supported; supported: "
                 + ", ".join(map(repr, LOAD_BALANCING_TYPES)))
        if self.moe_token_drop_policy not in TOKEN_DROP_POLICIES:
            fail("moe_token_drop_policy", "is not supported; supported: "
                 + ", ".join(map(repr, TOKEN_DROP_POLICIES)))
        if self.moe_token_dispatcher_type not in DISPATCHER_TYPES:
            fail("moe_token_dispatcher_type", "is not supported; supported: "
                 + ", ".join(map(repr, DISPATCHER_TYPES)))
        if self.moe_aux_loss_coeff < 0:
            fail("moe_aux_loss_coeff", "must be >= 0")
        if self.moe_router_bias_update_rate < 0:
            fail("moe_router_bias_update_rate", "must be >= 0")
        if self.moe_expert_capacity_factor is not None and self.moe_expert_capacity_factor <= 0:
            fail("moe_expert_capacity_factor", "must be None (dropless) or > 0")
        if E:
            if self.num_experts_per_tok > E:
                fail("num_experts_per_tok", f"must not exceed n_routed_experts ({E})")
            if self.n_group < 1:
                fail("n_group", "must be >= 1")
            if E % self.n_group:
                fail("n_routed_experts", f"must be divisible by n_group ({self.n_group})")
            if not 1 <= self.topk_group <= self.n_group:
                fail("topk_group", f"must be in [1, n_group={self.n_group}]")
            if self.group_limited:
                per_group = E // self.n_group
                if per_group < 2:
                    fail("n_group", f"leaves {per_group} expert per group; group scores sum the top 2, "
                         "so each group needs >= 2 experts")
                if self.num_experts_per_tok > self.topk_group * per_group:
                    fail("num_experts_per_tok", f"cannot be chosen from topk_group={self.topk_group} groups "
                         f"of {per_group} experts")
            if self.moe_router_enable_expert_bias and self.scoring_func != "sigmoid":
                fail("moe_router_enable_expert_bias", "needs scoring_func 'sigmoid' (aux-loss-free expert "
                     "bias); set it to False for softmax routing")
        # MTP
        if self.num_nextn_predict_layers < 0:
            fail("num_nextn_predict_layers", "must be >= 0")
        if self.mtp_loss_scaling_factor < 0:
            fail("mtp_loss_scaling_factor", "must be >= 0")


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
_LOGGED_UNKNOWN: set[str] = set()


def _log_unknown(keys: list[str]) -> None:
    new = [k for k in keys if k not in _LOGGED_UNKNOWN]
    if new:
        _LOGGED_UNKNOWN.update(new)
        log.warning("model: ignoring unknown key(s) %s", ", ".join(sorted(new)))


_ROPE_DICT_KEYS = {
    "factor": "scaling_factor", "original_max_position_embeddings": "original_max_position_embeddings",
    "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim", "rope_theta": "rope_theta",
}


def _expand_rope_dict(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face ``rope_scaling`` (v4) / ``rope_parameters`` (v5) dicts → flat canonical fields."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = kwargs.pop(key, None)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ConfigError(f"model.{key}: expected a dict, got {rope!r}")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "yarn":
            kwargs.setdefault("position_embedding_type", "yarn")
        elif kind in ("default", "rope"):
            kwargs.setdefault("position_embedding_type", "rope")
        else:
            raise ConfigError(f"model.{key}.type: {kind!r} is not supported; supported: 'yarn', 'default'")
        for k, v in rope.items():
            if k in ("type", "rope_type", "truncate"):
                if k == "truncate" and v is False:
                    raise ConfigError(f"model.{key}.truncate: False is not supported (YaRN bounds are "
                                      "floored/ceiled as in DeepSeek-V3)")
                continue
            if k not in _ROPE_DICT_KEYS:
                raise ConfigError(f"model.{key}.{k}: unknown key; supported: " + ", ".join(sorted(_ROPE_DICT_KEYS)))
            if v is None:
                continue
            name = _ROPE_DICT_KEYS[k]
            if name in kwargs and kwargs[name] != v:
                raise ConfigError(f"model.{key}.{k}: {v!r} conflicts with model.{name}: {kwargs[name]!r}")
            kwargs[name] = v
    return kwargs


def _parse_window(value: Any) -> tuple[int, int]:
    raw = value
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise ConfigError(f"model.window_size: cannot parse {raw!r}; write (left, right), e.g. (10, 0)") from None
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value, 0)
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise ConfigError(f"model.window_size: {raw!r} is not a pair of ints (left, right)")
    left, right = value
    if left < -1 or right < -1:
        raise ConfigError(f"model.window_size: {raw!r}: sizes must be >= 0 or -1 (unlimited)")
    return (left, right)


def _check_type(key: str, value: Any, annotation: Any) -> Any:
    """Check ``value`` against a field annotation; ints widen to floats, numeric strings parse as floats
    (PyYAML reads ``1e-6`` as a string)."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return value
    if origin is Union:
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(key, value, arg)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(value)
            if not math.isnan(value):
                return value
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif annotation is str:
        if isinstance(value, str):
            return value
        if isinstance(value, torch.dtype):
            return str(value).replace("torch.", "")
    else:
        return value
    raise ConfigError(f"model.{key}: expected {annotation.__name__}, got {type(value).__name__} ({value!r})")
