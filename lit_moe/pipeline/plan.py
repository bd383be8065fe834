"""What ``lit_moe plan`` prints for a pipeline: per-rank parameter bytes (by :func:`stage_parts`,
the rule the runtime's stages follow), in-flight micro-batches and the bubble fraction."""

from __future__ import annotations

from typing import Any

from lit_moe.pipeline.layout import SPLIT_BACKWARD, PipelineLayout, stage_parts


def in_flight_microbatches(layout: PipelineLayout, rank: int, A: int) -> int:
    """Micro-batch stage chunks whose activations a rank holds at its peak, from the order the schedule
    runs its actions (:func:`lit_moe.strategies.activation_memory.peak_in_flight`: a forward adds a
    chunk, a full backward or a weight-gradient step releases it): GPipe keeps all A; 1F1B keeps P - r
    (its warm-up); interleaved 1F1B (P - r - 1)·2 + (V - 1)·P + 1 (Megatron's warm-up); the
    zero-bubble schedules as torch orders them."""
    from lit_moe.strategies.activation_memory import peak_in_flight

    return peak_in_flight(layout, rank, A, {s: 1 for s in range(layout.num_stages)})[1]


def bubble_fraction(layout: PipelineLayout, A: int) -> float:
    """Idle share of a rank's step with equal forward/backward times: (P-1)/V / (A + (P-1)/V)
    (GPipe and 1F1B with V = 1; Megatron's interleaved bound); zero-bubble schedules fill it with
    weight-gradient work, reported as 0 (ideal: their bound needs F = B = W)."""
    if layout.schedule in SPLIT_BACKWARD:
        return 0.0
    idle = (layout.pp - 1) / layout.interleave
    return idle / (A + idle)


def parameters_of_ranks(layout: PipelineLayout, names: Any, num_layers: int, has_mtp: bool) -> list[set[str]]:
    """The full-model parameter names each pipeline rank holds (its stages' parts: :func:`stage_parts`,
    as the run builds them)."""
    held = [stage_parts(layout, layout.stages_of(r), has_mtp) for r in range(layout.pp)]
    return [{name for name in names if parts.holds(name)} for parts in held]


def plan_stages(layout: PipelineLayout, local_bytes: dict[str, int], num_layers: int, has_mtp: bool,
                A: int) -> list[str]:
    """``lit_moe plan`` lines for a pipeline: per rank, the bytes of the parameters its stages hold
    (``local_bytes``: parameter name → this layout's local shard bytes), in-flight micro-batches and
    the bubble fraction of the schedule."""
    held = parameters_of_ranks(layout, local_bytes, num_layers, has_mtp)
    per_rank = [sum(local_bytes[n] for n in names) for names in held]
    lines = layout.describe()
    for r in range(layout.pp):
        lines.append(f"  pipeline rank {r}: stages {layout.stages_of(r)}, parameters {per_rank[r]} bytes per rank, "
                     f"in flight {in_flight_microbatches(layout, r, A)} micro-batch stage chunks")
    lines.append(f"  bubble fraction {bubble_fraction(layout, A):.3f} with {A} micro-batches")
    return lines
