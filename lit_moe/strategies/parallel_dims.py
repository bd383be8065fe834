"""All mesh arithmetic of a run in one place: degrees, their validation, and the device meshes.

Notation (MindFormers ``_compute_data_parallel_size`` / ``ParallelDims``): W world size, T tensor
parallel, C context parallel, P pipeline parallel, E expert parallel,
``D = W // (T·P·C)`` the data-parallel degree, ``D = R·S`` with R replicas (``dp_replicate``) of
S-way FSDP shards (``dp_shard``).

Expert parallel does not enter the world-size product: it *borrows* ranks from ``S·C·T`` (the seed's
own 8-card table counts it as a separate factor; MindFormers' code and ``000_…txt`` do not, and we
follow the code). The dense and the expert ("sparse") meshes are two factorisations of the same
ranks, row-major, outermost first::

    batch  [dp_replicate R, dp_shard S, cp C, tp T]      data loading (tp innermost)
    dense  [dp_replicate R, fsdp S·C, tp T]              attention, dense MLP, embedding, head
    sparse [dp_replicate R, efsdp S·C·T/E, ep E]         routed experts
    dp   = flatten(dp_replicate, dp_shard)   size D      which batch a rank reads
    dp_cp = flatten(dp_replicate, dp_shard, cp)          loss averaging, MoE token counts
    cp_tp = flatten(cp, tp)                              ranks sharing one sample
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
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

    def __post_init__(self) -> None:
        W = self.world_size
        if isinstance(W, bool) or not isinstance(W, int) or W < 1:
            raise ParallelismError(f"world size must be an integer >= 1, got {W!r}")
        T = _check_degree("tensor_parallel", self.tp)
        C = _check_degree("context_parallel", self.cp)
        P = _check_degree("pipeline_parallel", self.pp)
        E = _check_degree("expert_parallel", self.ep)
        if P > 1:
            raise ParallelismError(
                f"parallelism.pipeline_parallel: {P} is not supported yet (only 1); use data, tensor, "
                "context and expert parallelism instead")
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
            # The seed's (MindFormers') message, with the numbers.
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
    def build_meshes(self, device_type: str) -> dict:
        """Create the device meshes (needs an initialised default process group of ``world_size``).

        Every mesh is an ``_unflatten`` of one 1-D world mesh, so all of them share a root and FSDP,
        tensor- and expert-parallel DTensors can be combined."""
        from torch.distributed.device_mesh import init_device_mesh

        R, S, C, T, E = self.dp_replicate, self.dp_shard, self.cp, self.tp, self.ep
        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
        batch = world._unflatten(0, (R, S, C, T), ("dp_replicate", "dp_shard", "cp", "tp"))
        dense = world._unflatten(0, (R, S * C, T), ("dp_replicate", "fsdp", "tp"))
        sparse = world._unflatten(0, (R, self.efsdp, E), ("dp_replicate", "efsdp", "ep"))
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
        self._check_meshes()
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
            f"mesh loss   dp_cp = {self.dp_cp} ranks (loss averaging, MoE token counts)",
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

