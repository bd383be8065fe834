"""All mesh arithmetic of a run in one place: degrees, their validation, and the device meshes.

Notation (MindFormers ``_compute_data_parallel_size`` / ``ParallelDims``): W world size, T tensor
parallel, C context parallel, P pipeline parallel, E expert parallel,
``D = W // (T·P·C)`` the data-parallel degree, ``D = R·S`` with R replicas (``dp_replicate``) of
S-way FSDP shards (``dp_shard``).

Expert parallel does not enter the world-size product: it *borrows* ranks from ``S·C·T`` (the 8-card
table of MindFormers' PyNative configuration guide counts it as a separate factor; MindFormers' code and
its training-features guide do not, and we follow the code). The dense and the expert ("sparse") meshes are two factorisations of the same
ranks, row-major, outermost first::

    batch  [dp_replicate R, dp_shard S, cp C, tp T]      data loading (tp innermost)
    dense  [dp_replicate R, fsdp S·C, tp T]              attention, dense MLP, embedding, head
    sparse [dp_replicate R, efsdp S·C·T/E, ep E]         routed experts
    dp   = flatten(dp_replicate, dp_shard)   size D      which batch a rank reads
    dp_cp = flatten(dp_replicate, dp_shard, cp)          dense-gradient averaging (experts divide by it)
    cp_tp = flatten(cp, tp)                              ranks sharing one sample
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

from lit_moe.config import ConfigError


class ParallelismError(ConfigError):
    """An impossible parallel layout. The message names the ``parallelism`` field and the numbers."""


def _check_degree(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ParallelismError(f"parallelism.{name}: must be an integer >= 1, got {value!r}")
    return value


@dataclass
class ParallelDims:
    """Validated parallel degrees of a run and (after :meth:`build_meshes`) its device meshes.

    Args:
        world_size: number of processes (W).
        dp_shard: ``parallelism.data_parallel_shard``; -1 shards over every data-parallel rank
            (pure FSDP), N > 0 gives HSDP with ``dp_replicate = D / N``.
        tp, cp, pp, ep: tensor, context, pipeline and expert parallel degrees.
    """

    world_size: int
    dp_shard: int = -1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    dp_replicate: int = field(init=False, default=1)
    dp: int = field(init=False, default=1)
    meshes: dict = field(init=False, default_factory=dict, repr=False)
    collective_timeout: Optional[timedelta] = field(init=False, default=None, repr=False)
    """``parallelism.process_group_timeout_s``, given to every group this run creates (build_meshes)."""

    @classmethod
    def from_config(cls, parallelism: Any, world_size: int) -> "ParallelDims":
        """The degrees of the ``parallelism`` section on ``world_size`` ranks."""
        return cls(world_size=world_size, dp_shard=parallelism.data_parallel_shard, tp=parallelism.tensor_parallel,
                   cp=parallelism.context_parallel, pp=parallelism.pipeline_parallel, ep=parallelism.expert_parallel)

    def __post_init__(self) -> None:
        W = self.world_size
        if isinstance(W, bool) or not isinstance(W, int) or W < 1:
            raise ParallelismError(f"world size must be an integer >= 1, got {W!r}")
        T = _check_degree("tensor_parallel", self.tp)
        C = _check_degree("context_parallel", self.cp)
        P = _check_degree("pipeline_parallel", self.pp)
        E = _check_degree("expert_parallel", self.ep)
        if T * P * C > W:
            raise ParallelismError(
                f"tensor_parallel({T}) * pipeline_parallel({P}) * context_parallel({C}) = {T * P * C} "
                f"must be less than or equal to world_size({W})")
        if W % (T * P * C):
            raise ParallelismError(
                f"world_size({W}) is not divisible by tensor_parallel({T}) * pipeline_parallel({P}) * "
                f"context_parallel({C}) = {T * P * C}")
        D = W // (T * P * C)
        S = self.dp_shard
        if isinstance(S, bool) or not isinstance(S, int) or S == 0 or S < -1:
            raise ParallelismError(
                f"parallelism.data_parallel_shard: must be -1 (shard over all {D} data-parallel ranks) "
                f"or a positive divisor of data_parallel {D}, got {S!r}")
        if S == -1:
            S = D
        if S > D or D % S:
            raise ParallelismError(
                f"parallelism.data_parallel_shard: {S} must divide data_parallel {D} "
                f"(= world_size {W} / (tensor_parallel {T} * pipeline_parallel {P} * context_parallel {C})); "
                f"HSDP uses dp_replicate = data_parallel / data_parallel_shard")
        self.dp, self.dp_shard, self.dp_replicate = D, S, D // S
        if (S * C * T) % E:
            raise ParallelismError(
                f"parallelism.expert_parallel: ep({E}) must divide dp_shard({S}) * cp({C}) * tp({T}) = "
                f"{S * C * T}, and thus cannot exceed it (expert parallel borrows ranks from these "
                "dimensions; the world size is unchanged)")

    # ------------------------------------------------------------------------------------------
    # derived sizes
    # ------------------------------------------------------------------------------------------
    @property
    def fsdp(self) -> int:
        """FSDP shard degree of dense parameters: dp_shard · cp."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """FSDP shard degree of routed experts: dp_shard · cp · tp / ep."""
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp

    @property
    def seq_divisor(self) -> int:
        """The sequence length must be a multiple of this (2·cp zig-zag chunks, each rank's split over tp)."""
        return (2 * self.cp if self.cp > 1 else 1) * self.tp

    @property
    def enabled(self) -> bool:
        """More than one process: meshes, FSDP and collectives are in use."""
        return self.world_size > 1

    # ------------------------------------------------------------------------------------------
    # validation against the model and the batch sizes
    # ------------------------------------------------------------------------------------------
    def validate_model(self, model_config: Any, seq_length: Optional[int] = None) -> None:
        """Check that heads, experts, vocabulary, MLP widths and the sequence split evenly."""
        T, C, E = self.tp, self.cp, self.ep
        heads = getattr(model_config, "num_attention_heads", None)
        if heads is not None and heads % T:
            raise ParallelismError(
                f"parallelism.tensor_parallel: {T} must divide model.num_attention_heads {heads} "
                "(tensor parallel shards attention heads)")
        groups = getattr(model_config, "o_groups", None)
        if T > 1 and getattr(model_config, "v4_attention", False) and groups % T:
            raise ParallelismError(
                f"parallelism.tensor_parallel: {T} must divide model.o_groups {groups} (DeepSeek-V4's grouped "
                "output projection; tensor parallel keeps whole head groups on a rank)")
        if T > 1 and getattr(model_config, "multi_latent_attention", True) is False and model_config.kv_heads % T:
            raise ParallelismError(
                f"parallelism.tensor_parallel: {T} must divide the key/value heads of grouped-query attention "
                f"(model.num_key_value_heads {model_config.kv_heads}; tensor parallel shards them)")
        if T > 1:
            # (routed experts are not tensor-parallel: they split tokens, not weights)
            for name in ("vocab_size", "intermediate_size"):
                value = getattr(model_config, name, None)
                if value is not None and value % T:
                    raise ParallelismError(
                        f"parallelism.tensor_parallel: {T} must divide model.{name} {value}")
            shared = _shared_expert_width(model_config)
            if shared and shared % T:
                raise ParallelismError(
                    f"parallelism.tensor_parallel: {T} must divide the shared-expert width {shared} "
                    "(model.moe_shared_expert_intermediate_size or moe_intermediate_size * n_shared_experts)")
        experts = getattr(model_config, "n_routed_experts", None) or 0
        if E > 1:
            if not experts:
                raise ParallelismError(
                    f"parallelism.expert_parallel: {E} needs a MoE model, but model.n_routed_experts is "
                    f"{experts!r}")
            if experts % E:
                raise ParallelismError(
                    f"parallelism.expert_parallel: {E} must divide model.n_routed_experts {experts}")
        if seq_length is not None:
            chunks = 2 * C if C > 1 else 1
            if seq_length % (chunks * T):
                raise ParallelismError(
                    f"sequence length {seq_length} must be divisible by {'2 * ' if C > 1 else ''}"
                    f"context_parallel({C}) * tensor_parallel({T}) = {chunks * T} (the sequence is split "
                    "into 2·cp zig-zag chunks, two per context-parallel rank, each rank's tokens "
                    "sequence-parallel over tp)")
        if T > 1 and getattr(model_config, "position_embedding_type", None) == "learned_absolute":
            raise ParallelismError(
                f"parallelism.tensor_parallel: {T} with model.position_embedding_type 'learned_absolute' is not "
                "supported (the position table is added before the sequence is split)")

    def accumulation_steps(self, global_batch_size: int, local_batch_size: int) -> int:
        """``A = global_batch_size // (data_parallel · local_batch_size)`` (MindFormers' floor division)."""
        per_micro = self.dp * local_batch_size
        if per_micro > global_batch_size:
            # MindFormers' message, with the numbers.
            raise ConfigError(
                "The product of data_parallel and local_batch_size exceeds global_batch_size, please increase "
                "global_batch_size or decrease local_batch_size. (training.global_batch_size "
                f"{global_batch_size} < data_parallel({self.dp}) * local_batch_size({local_batch_size}) = {per_micro})")
        steps = global_batch_size // per_micro
        dropped = global_batch_size - steps * per_micro
        if dropped:
            warnings.warn(
                f"training.global_batch_size {global_batch_size} is not divisible by data_parallel({self.dp}) "
                f"* local_batch_size({local_batch_size}) = {per_micro}: each step uses {steps * per_micro} "
                f"samples ({steps} accumulation steps) and drops {dropped}", stacklevel=2)
        return steps

    # ------------------------------------------------------------------------------------------
    # meshes
    # ------------------------------------------------------------------------------------------
    def build_meshes(self, device_type: str, timeout: Optional[timedelta] = None) -> dict:
        """Create the device meshes (needs an initialised default process group of ``world_size``).

        Every mesh is an ``_unflatten`` of one 1-D world mesh, so all of them share a root and FSDP,
        tensor- and expert-parallel DTensors can be combined. ``timeout``: the collective timeout of
        every mesh's groups (and of the groups CP and the pipeline create later)."""
        from torch.distributed.device_mesh import init_device_mesh

        from lit_moe.runtime.distributed import set_group_timeout

        R, S, C, T, E, P = self.dp_replicate, self.dp_shard, self.cp, self.tp, self.ep, self.pp
        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
        # Pipeline stages are the outermost dimension: every other mesh lies inside one stage.
        outer, outer_names = ((P,), ("pp",)) if P > 1 else ((), ())
        batch = world._unflatten(0, (*outer, R, S, C, T), (*outer_names, "dp_replicate", "dp_shard", "cp", "tp"))
        dense = world._unflatten(0, (*outer, R, S * C, T), (*outer_names, "dp_replicate", "fsdp", "tp"))
        sparse = world._unflatten(0, (*outer, R, self.efsdp, E), (*outer_names, "dp_replicate", "efsdp", "ep"))
        self.meshes = {
            "world": world,
            "batch": batch,
            "dp": batch["dp_replicate", "dp_shard"]._flatten("dp"),
            "dp_cp": batch["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
            "cp_tp": batch["cp", "tp"]._flatten("cp_tp"),
            "cp": batch["cp"],
            "tp": dense["tp"],
            # FSDP meshes: 1-D when there is no replication, [dp_replicate, shard] (HSDP) otherwise.
            "fsdp": dense["dp_replicate", "fsdp"] if R > 1 else dense["fsdp"],
            "efsdp": sparse["dp_replicate", "efsdp"] if R > 1 else sparse["efsdp"],
            "ep": sparse["ep"],
            "dense": dense,
            "sparse": sparse,
        }
        if P > 1:
            self.meshes["pp"] = batch["pp"]
            # the ranks of one stage (everything but pp): gradient norms per stage
            self.meshes["stage"] = batch["dp_replicate", "dp_shard", "cp", "tp"]._flatten("stage")
        self._check_meshes()
        self.collective_timeout = timeout
        for mesh in self.meshes.values():
            set_group_timeout(timeout, *(mesh.get_group(d) for d in range(mesh.ndim)))
        return self.meshes

    def _check_meshes(self) -> None:
        m = self.meshes
        expected = {"dp": self.dp, "dp_cp": self.dp_cp, "cp_tp": self.cp * self.tp, "cp": self.cp,
                    "tp": self.tp, "fsdp": self.dp_replicate * self.fsdp,
                    "efsdp": self.dp_replicate * self.efsdp, "ep": self.ep}
        for name, size in expected.items():
            if m[name].size() != size:  # pragma: no cover - a torch mesh-layout regression
                raise RuntimeError(f"mesh {name!r} has size {m[name].size()}, expected {size}")

    def mesh(self, name: str):
        if not self.meshes:
            raise RuntimeError("ParallelDims.build_meshes() has not been called")
        return self.meshes[name]

    # ------------------------------------------------------------------------------------------
    # reporting
    # ------------------------------------------------------------------------------------------
    def describe(self) -> list[str]:
        """Human-readable lines: degrees and mesh shapes (used by ``lit_moe plan`` and the logs)."""
        R, S, C, T, E = self.dp_replicate, self.dp_shard, self.cp, self.tp, self.ep
        mode = "FSDP" if R == 1 else f"HSDP ({R} replicas x {S}-way shards)"
        return [
            f"world_size {self.world_size} = dp_replicate {R} x dp_shard {S} x cp {C} x tp {T} x pp {self.pp}",
            f"data_parallel {self.dp} (= world_size / (tp * pp * cp)); {mode}",
            f"expert_parallel {E}: borrowed from dp_shard * cp * tp = {S * C * T}; experts FSDP-sharded "
            f"{self.efsdp}-way (efsdp)",
            f"mesh batch  [dp_replicate={R}, dp_shard={S}, cp={C}, tp={T}]",
            f"mesh dense  [dp_replicate={R}, fsdp={S * C}, tp={T}]",
            f"mesh sparse [dp_replicate={R}, efsdp={self.efsdp}, ep={E}]",
            f"mesh grads  dp_cp = {self.dp_cp} ranks (dense-gradient averaging)",
        ]


def _shared_expert_width(cfg: Any) -> int:
    n_shared = getattr(cfg, "n_shared_experts", 0) or 0
    if not n_shared:
        return 0
    width = getattr(cfg, "shared_expert_intermediate_size", None) or getattr(cfg, "moe_shared_expert_intermediate_size", None)
    if width:
        return int(width)
    moe = getattr(cfg, "moe_intermediate_size", None) or 0
    return int(moe) * int(n_shared)



# ----------------------------------------------------------------------------------------------
# the MindFormers parallelism keys that have no mesh of their own
# ----------------------------------------------------------------------------------------------
PIPELINE_SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe", "interleaved_zb", "zbv", "dualpipev")  # the last three: torch's
CONTEXT_PARALLEL_METHODS = ("colossal", "ulysses", "hybrid")
IMPLEMENTED_CP_METHODS = CONTEXT_PARALLEL_METHODS   # lit_moe.strategies.context_parallel does all three
RESHARD_POLICIES = ("always", "never", "default")


def _flag(p: Any, name: str) -> bool:
    value = getattr(p, name)
    if not isinstance(value, bool):
        raise ParallelismError(f"parallelism.{name}: expected true or false, got {value!r}")
    return value


def _choice(p: Any, name: str, choices: tuple, message: Optional[str] = None) -> str:
    value = getattr(p, name)
    if not isinstance(value, str) or value.lower() not in choices:
        raise ParallelismError(f"parallelism.{name}: " + (message or f"{value!r} is not supported; supported: "
                                                           + ", ".join(map(repr, choices))))
    return value.lower()


# Megatron-FSDP's data_parallel_sharding_strategy names (ZeRO-3, -2, -1); its no_shard (plain DDP) is not offered
SHARD_STRATEGIES = {
    "optim_grads_params": "ZeRO-3: parameters resharded after forward",
    "optim_grads": "ZeRO-2: parameters kept gathered until backward",
    "optim": "ZeRO-1: optimizer state sharded; parameters and gradients whole through the step",
}


def is_zero1(p: Any) -> bool:
    """``data_parallel_shard_strategy: optim``: only the optimizer state (with the fp32 master weights) is
    sharded; parameters and gradients stay whole through the step, reduced once at its last backward."""
    return p.data_parallel_shard_strategy == "optim"


def reshard_after_forward(p: Any) -> bool:
    """FSDP ``reshard_after_forward`` of the run: ``reshard_after_forward_policy`` (MindFormers)
    when it is ``always``/``never``, else ``data_parallel_shard_strategy`` (ZeRO-3 reshards)."""
    policy = getattr(p, "reshard_after_forward_policy", "default")
    if policy == "always":
        return True
    if policy == "never":
        return False
    return p.data_parallel_shard_strategy == "optim_grads_params"


def cp_ulysses_degree(p: Any) -> int:
    """MindFormers' ``_validate_cp_method``: the effective Ulysses degree (1 for ``colossal``), with its
    errors for the other methods."""
    method = _choice(p, "context_parallel_method", CONTEXT_PARALLEL_METHODS,
                     f"Unsupported context_parallel_method: {p.context_parallel_method!r}.")
    cp, u = p.context_parallel, p.ulysses_degree_in_cp
    if u is not None and (isinstance(u, bool) or not isinstance(u, int) or u < 1):
        raise ParallelismError(f"parallelism.ulysses_degree_in_cp: must be null or an integer >= 1, got {u!r}")
    if method == "colossal":
        return 1
    if method == "ulysses":
        degree = cp if u is None else u
        if degree != cp:
            raise ParallelismError("parallelism.ulysses_degree_in_cp: Ulysses CP requires ulysses_degree_in_cp == "
                                   f"context_parallel (got {u} and {cp}).")
        return degree
    if u is None:
        raise ParallelismError("parallelism.ulysses_degree_in_cp: Hybrid CP requires ulysses_degree_in_cp to be set.")
    if u <= 1 or u >= cp or cp % u:
        raise ParallelismError("parallelism.ulysses_degree_in_cp: Hybrid CP requires 1 < ulysses_degree_in_cp < "
                               f"context_parallel and divisibility (got {u} with context_parallel {cp}).")
    return u


def pipeline_stage_layers(p: Any, num_layers: int) -> list[list[list[int]]]:
    """``stages[pp_rank][chunk]`` = decoder-layer ids of each virtual stage, from
    ``pipeline_parallel_layers_per_stage`` (null/``auto``: equal contiguous split over
    ``pp * interleave`` stages, chunk ``c`` of rank ``r`` being stage ``c * pp + r``; else one string
    per rank of ``interleave`` comma-separated ``"a-b"`` ranges, or a list of layer-id lists). Every
    decoder layer must belong to exactly one stage. Used by the pipeline engine."""
    P, V = p.pipeline_parallel, p.pipeline_parallel_interleave_num
    spec = p.pipeline_parallel_layers_per_stage
    name = "parallelism.pipeline_parallel_layers_per_stage"
    if spec is None or spec == "auto":
        S = P * V
        if num_layers % S:
            raise ParallelismError(f"{name}: Number of layers ({num_layers}) is not divisible by total stages ({S})."
                                   "Please configure pipeline_parallel_layers_per_stage with explicit ranges.")
        per = num_layers // S
        return [[list(range((c * P + r) * per, (c * P + r + 1) * per)) for c in range(V)] for r in range(P)]
    if isinstance(spec, str) or not isinstance(spec, list) or len(spec) != P:
        raise ParallelismError(f"{name}: expected null, 'auto' or a list of {P} entries (one per pipeline stage), "
                               f"got {spec!r}")
    stages: list[list[list[int]]] = []
    for r, entry in enumerate(spec):
        if isinstance(entry, str):
            chunks = []
            for part in entry.split(","):
                m = _RANGE.match(part)
                if not m:
                    raise ParallelismError(f"{name}[{r}]: {part.strip()!r} is not a layer id or 'a-b' range")
                lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
                if lo > hi:
                    raise ParallelismError(f"{name}[{r}]: range {part.strip()!r} must satisfy a <= b")
                chunks.append(list(range(lo, hi + 1)))
        elif isinstance(entry, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in entry):
            chunks = [list(entry)]
        else:
            raise ParallelismError(f"{name}[{r}]: expected a string of ranges or a list of layer ids, got {entry!r}")
        if len(chunks) != V:
            raise ParallelismError(f"{name}[{r}]: has {len(chunks)} chunk(s); pipeline_parallel_interleave_num is {V}")
        stages.append(chunks)
    seen = sorted(i for chunks in stages for chunk in chunks for i in chunk)
    if seen != list(range(num_layers)):
        raise ParallelismError(f"{name}: the stages must cover decoder layers 0..{num_layers - 1} exactly once, got "
                               f"{spec!r}")
    return stages


import re as _re  # noqa: E402  (used by pipeline_stage_layers only)

_RANGE = _re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def check_parallelism_keys(p: Any) -> None:
    """MindFormers' rules for the ``parallelism`` keys that need no world size, then a one-line "not yet"
    for values that need an engine lit_moe does not have. Runs before anything is launched."""
    tp = _check_degree("tensor_parallel", p.tensor_parallel)
    if p.sequence_parallel is not None:
        _flag(p, "sequence_parallel")
    if tp > 1 and p.sequence_parallel is False:
        raise ParallelismError(
            "parallelism.sequence_parallel: PyNative tensor parallelism requires sequence_parallel=True when "
            f"tensor_parallel > 1, but got tensor_parallel={tp}.")
    policy = getattr(p, "reshard_after_forward_policy")
    if policy not in RESHARD_POLICIES:
        raise ParallelismError(f"parallelism.reshard_after_forward_policy: Invalid reshard_after_forward_policy: "
                               f"{policy!r}. Supported: 'always', 'never', 'default'")
    for name in ("cpu_offload", "disable_gradient_division", "context_parallel_async", "pipeline_parallel_overlap_p2p",
                 "pipeline_parallel_overlap_b_f", "pipeline_parallel_enable_dxdw_split", "enable_mc2",
                 "enable_loss_parallel", "expert_parallel_async_d2h", "expert_parallel_use_safe_tokens"):
        _flag(p, name)
    if p.cpu_offload:
        raise ParallelismError("parallelism.cpu_offload: True needs FSDP CPU offload, which lit_moe does not "
                               "implement yet; set it to false (add ranks or recompute to save memory)")
    k = p.dense_fsdp_shard_size
    if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
        raise ParallelismError(f"parallelism.dense_fsdp_shard_size: must be null or an integer, got {k!r}")
    # context parallel (MindFormers' context_parallel.py rules)
    cp = _check_degree("context_parallel", p.context_parallel)
    if p.context_parallel_mask_type != "causal":
        raise ParallelismError("parallelism.context_parallel_mask_type: Context parallel currently only supports "
                               f"pure causal mask, got {p.context_parallel_mask_type!r}.")
    method = _choice(p, "context_parallel_method", CONTEXT_PARALLEL_METHODS,
                     f"Unsupported context_parallel_method: {p.context_parallel_method!r}.")
    if p.context_parallel_async and method == "colossal" and cp > 1:
        raise ParallelismError("parallelism.context_parallel_async: Async context parallel currently supports "
                               "'ulysses' and 'hybrid' only; set it to false with context_parallel_method 'colossal'.")
    if cp > 1:
        cp_ulysses_degree(p)
        if method not in IMPLEMENTED_CP_METHODS:
            raise ParallelismError(f"parallelism.context_parallel_method: {method!r} with context_parallel {cp} needs "
                                   "Ulysses (head all-to-all) context parallelism, which lit_moe does not implement "
                                   "yet; use 'colossal'")
    elif p.ulysses_degree_in_cp is not None:
        cp_ulysses_degree(p)
    # pipeline keys
    _check_degree("pipeline_parallel", p.pipeline_parallel)
    _check_degree("pipeline_parallel_microbatch_size", p.pipeline_parallel_microbatch_size)
    _check_degree("pipeline_parallel_interleave_num", p.pipeline_parallel_interleave_num)
    _choice(p, "pipeline_parallel_schedule", PIPELINE_SCHEDULES)
    _choice(p, "pipeline_parallel_p2p_transport", ("plain", "auto"))
    spec = p.pipeline_parallel_layers_per_stage
    if spec is not None and spec != "auto" and not isinstance(spec, list):
        raise ParallelismError("parallelism.pipeline_parallel_layers_per_stage: expected null, 'auto' or a list "
                               f"of per-stage layer ranges, got {spec!r}")
    # experts
    _check_degree("npu_nums_per_device", p.npu_nums_per_device)
    if p.moe_token_dispatcher_type == "alltoall_deredundancy":
        if p.expert_parallel < p.npu_nums_per_device:
            raise ParallelismError(
                "parallelism.moe_token_dispatcher_type: expert_parallel must be greater than or equal to "
                "npu_nums_per_device when using 'alltoall_deredundancy', but got expert_parallel="
                f"{p.expert_parallel}, npu_nums_per_device={p.npu_nums_per_device}.")


def check_parallel_layout(p: Any, dims: ParallelDims, model_config: Any) -> None:
    """The ``parallelism`` rules that need the world size or the model (the pipeline's stages, schedule
    and micro-batch count: :func:`lit_moe.pipeline.check_pipeline_run`)."""
    k = p.dense_fsdp_shard_size
    if k is not None:
        F = dims.dp_shard * dims.cp
        if not 1 <= k <= F or F % k:
            raise ParallelismError(f"parallelism.dense_fsdp_shard_size: dense_fsdp_shard_size {k} is invalid. It must "
                                   f"be in range [1, {F}] and evenly divide fsdp (dp_shard * cp = {F}).")
        if k != F:
            raise ParallelismError(f"parallelism.dense_fsdp_shard_size: {k} needs dense weights sharded over fewer "
                                   f"ranks than fsdp ({F}), which lit_moe does not implement yet; set it to null")
    if dims.cp > 1:
        # MindFormers checks this for async ulysses only; every Ulysses exchange splits the heads
        # (those of one tensor-parallel rank)
        degree = cp_ulysses_degree(p)
        heads = getattr(model_config, "num_attention_heads", None)
        if heads is not None and (heads // dims.tp) % degree:
            per_tp = f" ({heads // dims.tp} per tensor-parallel rank)" if dims.tp > 1 else ""
            raise ParallelismError(f"parallelism.ulysses_degree_in_cp: num_attention_heads ({heads}){per_tp} must be "
                                   f"divisible by ulysses_degree ({degree}).")


def gradient_divide_factors(p: Any, dims: ParallelDims) -> tuple[Optional[float], Optional[float]]:
    """FSDP gradient divide factors ``(dense, experts)`` for ``disable_gradient_division``.

    lit_moe's gradients are the mean over data/context-parallel ranks, which is what MindFormers gets
    with its default True (reduce with SUM, the loss carries 1/(W/P)). With False MindFormers' FSDP
    divides by the size of each reduce group on top: the dense mesh (``dp_replicate * fsdp``) and the
    expert mesh (``dp_replicate * efsdp``). ``(None, None)``: keep the default division."""
    if getattr(p, "disable_gradient_division", True) or dims.world_size == 1:
        return None, None
    dense_group = dims.dp_replicate * dims.fsdp
    expert_group = dims.dp_replicate * dims.efsdp
    return float(dense_group * dense_group), float(dims.dp_cp * expert_group)
