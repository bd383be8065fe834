"""The peak memory each rank of a run holds (``lit_moe plan``), and whether it fits a device.

Per rank (per pipeline rank with pipelines; without them every rank holds what rank 0 holds, rank 0
having the larger pieces of an uneven split): the parameters, gradients and optimizer state of its
local shards (:func:`lit_moe.strategies.plan.per_rank_bytes`), the activations autograd keeps for
backward at the schedule's peak (:mod:`lit_moe.strategies.activation_memory`; without pipelines one
micro-batch of the whole model, since each micro-batch's backward frees them before the next forward),
and FSDP's transient buffers: the compute-dtype copies of two decoder layers gathered at once (the
current one and the prefetched next) and the fp32 unsharded gradients of one layer before their
reduce-scatter (ZeRO-1, whose parameters stay gathered: one layer's compute-dtype gradient before it
joins the fp32 sum, and that layer's fp32 reduce-scatter input). The headline is the most loaded rank. On the CPU's math attention path (what
``benchmarks/plan_memory.py`` measures) one layer's fp32 ``S x S`` scores and their gradient are held
next to the saved probabilities for a moment; the fused kernels of GPUs and NPUs have no such term.

Recompute: ``recompute.mode: full`` layers keep only their input; ``select_module`` modules keep their
inputs instead of their saved tensors and ``recompute_comm``'s all-gathers their local shard
(:func:`configured_selection`, :func:`lit_moe.strategies.activation_memory.selected_saved_tensors`);
a recomputed layer or module saves its tensors again while its backward runs. Tensor parallel's
sequence split is counted per saved tensor (:func:`~lit_moe.strategies.activation_memory.layer_saved_tensors`).
The plan also gives every rank's peak with full recompute of every layer, and with bf16 optimizer
moments, which is what it names when the run does not fit (``--device-memory``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from lit_moe.strategies.parallel_dims import is_zero1

GiB = 1024 ** 3

# Device memory by name (``--device-memory H100``): the memory of the usual training part of each name.
DEVICE_MEMORY_GIB = {"H100": 80, "H800": 80, "H200": 141, "A100": 80, "910B": 64}

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4,
          "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3, "t": 1024 ** 4,
          "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4}


def state_parts(mem: dict[str, int], parallelism: Any) -> tuple[int, int, int]:
    """``(parameters, gradients, optimizer state)`` bytes one rank holds during a step. ZeRO-2/3: the
    local shards, with the unsharded gradients kept between micro-batches when
    ``gradient_sync_every_microbatch`` is false. ZeRO-1 (``data_parallel_shard_strategy: optim``): the
    parameters' compute-dtype copy gathered for the whole step beside the sharded fp32 master, and the
    whole fp32 gradients accumulated until the step's last backward; only the optimizer state (and the
    master) is divided by the shard degree."""
    if is_zero1(parallelism):
        return mem["params"] + mem["gathered_params"], mem["unsharded_grads"], mem["optimizer"]
    grads = mem["grads"] if parallelism.gradient_sync_every_microbatch else mem["unsharded_grads"]
    return mem["params"], grads, mem["optimizer"]


def state_bytes(mem: dict[str, int], parallelism: Any) -> int:
    """Parameters, gradients and optimizer state of one rank (:func:`state_parts`)."""
    return sum(state_parts(mem, parallelism))


def parse_device_memory(text: str) -> tuple[int, str]:
    """``(bytes, description)`` of ``--device-memory``: a size (``80GiB``, ``141 GiB``, ``80GB`` = 80e9
    bytes, a plain number of bytes) or a device name of :data:`DEVICE_MEMORY_GIB`; ValueError naming
    the value otherwise."""
    name = str(text).strip()
    for device, gib in DEVICE_MEMORY_GIB.items():
        if name.upper() == device:
            return gib * GiB, f"{device}, {gib} GiB"
    match = _SIZE.match(name)
    if match is None or (match.group(2) or "").lower() not in _UNITS:
        known = ", ".join(DEVICE_MEMORY_GIB)
        raise ValueError(f"--device-memory: expected a size such as 80GiB or a device name ({known}), got {text!r}")
    value = int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
    if value <= 0:
        raise ValueError(f"--device-memory: must be positive, got {text!r}")
    return value, f"{value / GiB:.1f} GiB"


@dataclass
class RankPeak:
    """One rank's bytes at its peak."""

    name: str
    params: int
    grads: int          # fp32 gradients: sharded, or whole between micro-batches (see state_parts)
    optimizer: int
    activations: int    # saved for backward at the schedule's peak
    buffers: int        # FSDP's gathered layers and unsharded gradients in flight

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers


def rank_peaks(mem: dict, activations: list[int], parallelism: Any, buffers: int = 0,
               optimizer_scale: float = 1.0) -> list[RankPeak]:
    """A :class:`RankPeak` per pipeline rank (one, ``rank 0``, without pipelines) from
    :func:`~lit_moe.strategies.plan.per_rank_bytes` and the activations of each pipeline rank;
    ``optimizer_scale`` scales the optimizer state (0.5: AdamW's fp32 moments stored in bf16)."""
    per_rank = mem.get("pipeline_ranks") or [mem]
    names = [f"pipeline rank {r}" for r in range(len(per_rank))] if "pipeline_ranks" in mem else ["rank 0"]
    rows = []
    for name, m, act in zip(names, per_rank, activations):
        params, grads, optimizer = state_parts(m, parallelism)
        rows.append(RankPeak(name, params, grads, int(optimizer * optimizer_scale), act, buffers))
    return rows


def most_loaded(rows: list[RankPeak]) -> RankPeak:
    return max(rows, key=lambda r: r.total)


def _schedule(dims: Any, parallelism: Any) -> Optional[str]:
    """The pipeline schedule's name (None without pipelines)."""
    name = getattr(parallelism, "pipeline_parallel_schedule", None) if dims.pp > 1 else None
    return name.lower() if name else None


def activations_by_rank(model_config: Any, dims: Any, parallelism: Any, accumulation: int, local_batch_size: int,
                        seq_length: int, recompute_layers: frozenset, core_attention: str = "fused",
                        selection: Optional[dict] = None) -> list[int]:
    """The activations each pipeline rank keeps at its schedule's peak (one entry without pipelines):
    ``local_batch_size`` sequences of ``seq_length / cp`` tokens, ``heads / tp`` attention heads, the
    norms and residual stream split over the tensor-parallel ranks (sequence parallel), the
    ``selection`` of selective recompute (:func:`configured_selection`). ``core_attention``: ``fused``
    (GPU/NPU kernels) or ``math`` (torch's CPU path)."""
    from lit_moe.strategies.activation_memory import (head_transient_bytes, model_activation_bytes, not_estimated,
                                                      pipeline_activation_plan)

    if not_estimated(model_config, _schedule(dims, parallelism)):   # said once by print_peaks, not a wrong figure
        return [0] * dims.pp
    seq = seq_length // dims.cp
    kwargs = activation_kwargs(model_config, dims, core_attention)
    tokens = local_batch_size * seq
    selection = selection or {}
    math = 0
    if core_attention == "math":
        # torch's math path holds one layer's fp32 S x S scores next to its probabilities in the forward,
        # and their gradient next to them in the backward: a transient the fused kernels do not have
        math = 2 * local_batch_size * kwargs["heads"] * seq * seq * 4
    head = head_transient_bytes(model_config, tokens, dims.tp)
    if dims.pp == 1:
        saved = model_activation_bytes(model_config, tokens, local_batch_size, seq, recompute_layers=recompute_layers,
                                       selection=selection, **kwargs)
        return [math + max(saved + head, backward_recompute_peak(model_config, tokens, local_batch_size, seq,
                                                                 recompute_layers, selection, saved, **kwargs))]
    from lit_moe.pipeline import PipelineLayout

    # with pipelines the recomputed layer's transient is counted on top of the schedule's peak (an upper bound)
    transient = math + max((recompute_extra_bytes(model_config, i, tokens, local_batch_size, seq, recompute_layers,
                                                  selection, **kwargs)
                            for i in set(recompute_layers) | set(selection)), default=0)
    layout = PipelineLayout.from_config(parallelism, model_config.num_hidden_layers)
    rows = pipeline_activation_plan(model_config, layout, accumulation, local_batch_size, seq,
                                    recompute_layers=recompute_layers, selection=selection, **kwargs)
    last = layout.num_stages - 1
    return [transient + row["bytes"] + (head if last in layout.stages_of(r) else 0) for r, row in enumerate(rows)]


def backward_recompute_peak(model_config: Any, tokens: int, batch: int, seq: int, recompute_layers: frozenset,
                            selection: dict, saved: int, **kwargs: Any) -> int:
    """Without pipelines: the most held while the backward reruns a recomputed layer (or module), the
    backward going from the MTP depths (head, then layer) to the main head and down the decoder layers,
    each freeing its saved tensors: what is still held when layer ``i`` reruns, plus what its rerun
    saves again. ``saved``: the whole forward's saved bytes (:func:`model_activation_bytes`)."""
    from lit_moe.strategies.activation_memory import head_bytes, layer_activation_bytes

    L = model_config.num_hidden_layers
    head = head_bytes(model_config, tokens, kwargs.get("tp", 1))
    order = [("head", L + j) for j in reversed(range(getattr(model_config, "num_nextn_predict_layers", 0) or 0))]
    order = [step for mtp in order for step in (("head", None), ("layer", mtp[1]))]
    order += [("head", None)] + [("layer", i) for i in reversed(range(L))]
    held, peak = saved, 0
    for kind, i in order:
        if kind == "head":
            held -= head
            continue
        extra = recompute_extra_bytes(model_config, i, tokens, batch, seq, recompute_layers, selection, **kwargs)
        if extra:
            peak = max(peak, held + extra)
        ck, out = selection.get(i, ((), ()))
        held -= layer_activation_bytes(model_config, i, tokens, batch, seq, recompute=i in recompute_layers,
                                       checkpointed=ck, output_recomputed=out, **kwargs)
    return peak


def recompute_extra_bytes(model_config: Any, i: int, tokens: int, batch: int, seq: int, recompute_layers: frozenset,
                          selection: dict, **kwargs: Any) -> int:
    """What layer ``i``'s backward saves again when it reruns its forward: a fully recomputed layer its
    activations beyond the input it kept, a selectively recomputed one the largest checkpointed module's
    tensors (0 for a layer without recompute)."""
    from lit_moe.strategies.activation_memory import layer_activation_bytes

    def kept(**recompute: Any) -> int:
        return layer_activation_bytes(model_config, i, tokens, batch, seq, **recompute, **kwargs)

    if i in recompute_layers:
        return kept() - kept(recompute=True)
    checkpointed, output_recomputed = selection.get(i, ((), ()))
    return max((kept(checkpointed=tuple(q for q in checkpointed if q != p), output_recomputed=output_recomputed)
                - kept(checkpointed=checkpointed, output_recomputed=output_recomputed) for p in checkpointed),
               default=0)


def activation_kwargs(model_config: Any, dims: Any, core_attention: str = "fused") -> dict[str, Any]:
    """The layout's arguments of :func:`~lit_moe.strategies.activation_memory.layer_activation_bytes`:
    this rank's heads, the tensor-parallel degree (sequence parallel), and whether FSDP wraps the
    weights (then they are gathered in the compute dtype and each projection is its own GEMM)."""
    fsdp = dims.world_size // dims.pp > 1
    return dict(heads=model_config.num_attention_heads // dims.tp, tp=dims.tp, core_attention=core_attention,
                weight_copies=False if fsdp else None, fused_weights=not fsdp)


def fits_line(need: RankPeak, have: int, what: str, alternatives: list[tuple[str, RankPeak]]) -> str:
    """``fits`` or ``does not fit (X GiB > Y GiB); would fit with: ...`` naming the first alternative
    (in the order given: the cheapest change first) whose most loaded rank fits."""
    if need.total <= have:
        return f"device memory {what}: fits ({need.total / GiB:.1f} GiB <= {have / GiB:.1f} GiB, {need.name})"
    head = f"device memory {what}: does not fit ({need.total / GiB:.1f} GiB > {have / GiB:.1f} GiB, {need.name})"
    for change, peak in alternatives:
        if peak.total <= have:
            return f"{head}; would fit with: {change} ({peak.total / GiB:.1f} GiB, {peak.name})"
    tried = ", ".join(f"{change} {peak.total / GiB:.1f} GiB" for change, peak in alternatives)
    return (f"{head}; would fit with: more ranks for the model state (more pipeline_parallel / expert_parallel / "
            f"data_parallel_shard){' (tried: ' + tried + ')' if tried else ''}")


def print_peaks(out: Any, model_config: Any, dims: Any, parallelism: Any, recompute: Any, recompute_comm: Any,
                optimizer_section: Optional[dict], accumulation: int, local_batch_size: int, seq_length: int,
                mem: dict, device_memory: Optional[str] = None) -> dict[str, Any]:
    """Print the per-rank peak table, its headline and (with ``device_memory``) the fits line; return the
    rows (``peaks``, ``full_recompute``, ``bf16_moments``) and the line (``fits``)."""
    from lit_moe.optim.optimizers import low_precision_moments, validate_optimizer_section

    configured = configured_full_layers(model_config, recompute, recompute_comm)
    selection = configured_selection(model_config, dims, recompute, recompute_comm)
    every_layer = frozenset(range(model_config.total_layers))
    args = (model_config, dims, parallelism, accumulation, local_batch_size, seq_length)
    buffers = mem.get("fsdp_buffers", 0)
    activations = activations_by_rank(*args, configured, selection=selection)
    peaks = rank_peaks(mem, activations, parallelism, buffers)
    full = (peaks if configured == every_layer
            else rank_peaks(mem, activations_by_rank(*args, every_layer), parallelism, buffers))
    settings = validate_optimizer_section(optimizer_section or {"type": "AdamW"})
    can_halve = settings.type == "AdamW" and not low_precision_moments(settings)
    bf16 = rank_peaks(mem, activations, parallelism, buffers, 0.5) if can_halve else None
    both = rank_peaks(mem, activations_by_rank(*args, every_layer), parallelism, buffers, 0.5) if can_halve else None

    recompute_text = (f"full recompute of layers {_ranges(configured)}" if configured else "no full recompute")
    if selection:
        recompute_text += f"; selective recompute in layers {_ranges(frozenset(selection))}"
    split = f", sequence split over tp {dims.tp} between blocks" if dims.tp > 1 else ""
    p = print
    p(f"peak memory per rank ({local_batch_size} x {seq_length // dims.cp} tokens per micro-batch{split}, "
      f"{recompute_text})", file=out)
    for line in _selection_lines(selection):
        p(f"  {line}", file=out)
    from lit_moe.strategies.activation_memory import not_estimated

    gap = not_estimated(model_config, _schedule(dims, parallelism))
    if gap:
        p(f"  {gap}", file=out)
    p(f"  {'':17s}{'params':>11s}{'grads':>11s}{'optimizer':>11s}{'activations':>13s}{'buffers':>10s}"
      f"{'total':>11s}", file=out)
    for r in peaks:
        p(f"  {r.name:17s}" + "".join(f"{v / GiB:{w}.2f}" for v, w in (
            (r.params, 11), (r.grads, 11), (r.optimizer, 11), (r.activations, 13), (r.buffers, 10), (r.total, 11)))
          + " GiB", file=out)
    top = most_loaded(peaks)
    p(f"  most loaded: {top.name}, {top.total / GiB:.2f} GiB (parameters {top.params / GiB:.2f}, gradients "
      f"{top.grads / GiB:.2f}, optimizer {top.optimizer / GiB:.2f}, activations {top.activations / GiB:.2f}, "
      f"FSDP buffers {top.buffers / GiB:.2f})", file=out)
    alternatives = []   # the cheapest change first: bf16 moments cost no compute, full recompute one forward
    if bf16 is not None:
        m = most_loaded(bf16)
        p(f"  with bf16 moments (optimizer.exp_avg_dtype / exp_avg_sq_dtype: bfloat16): {m.total / GiB:.2f} GiB "
          f"({m.name})", file=out)
        alternatives.append(("bf16 moments (optimizer.exp_avg_dtype / exp_avg_sq_dtype: bfloat16)", m))
    if configured != every_layer:
        m = most_loaded(full)
        p(f"  with full recompute of every layer: {m.total / GiB:.2f} GiB ({m.name})", file=out)
        alternatives.append(("full recompute (recompute.mode: full, every layer)", m))
        if bf16 is not None:
            alternatives.append(("full recompute and bf16 moments", most_loaded(both)))
    line = None
    if device_memory is not None:
        have, what = parse_device_memory(device_memory)
        line = fits_line(top, have, what, alternatives)
        p(line, file=out)
    return {"peaks": peaks, "full_recompute": full, "bf16_moments": bf16, "fits": line, "full_layers": configured,
            "selection": selection}


def configured_full_layers(model_config: Any, recompute: Any, recompute_comm: Any) -> frozenset:
    """The layers (decoder and MTP) the recompute sections fully recompute."""
    if recompute is None and recompute_comm is None:
        return frozenset()
    import warnings

    from lit_moe.strategies.recompute import validate_recompute

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return frozenset(validate_recompute(recompute, recompute_comm, model_config.total_layers).full_layers)


def configured_selection(model_config: Any, dims: Any, recompute: Any, recompute_comm: Any) -> dict:
    """``{layer: (checkpointed paths, output-recomputed paths)}`` of selective recompute
    (``recompute.select_module``, ``recompute_comm.select_module``), resolved as the run resolves them
    (:func:`lit_moe.strategies.recompute.apply.layer_selection`) on the model's layers built on the meta
    device, with the communication steps this layout gives them (sequence parallel's gathers under
    tensor parallel, context parallel's exchanges); layers recomputed whole are left out."""
    if recompute is None and recompute_comm is None:
        return {}
    import warnings

    import torch

    from lit_moe.model import DeepseekV3ForCausalLM
    from lit_moe.strategies.recompute import addressable_paths, validate_recompute
    from lit_moe.strategies.recompute.apply import layer_selection

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = validate_recompute(recompute, recompute_comm, model_config.total_layers)
    if not (plan.select or plan.comm):
        return {}
    with torch.device("meta"):
        blocks = list(DeepseekV3ForCausalLM(model_config).blocks())
    out = {}
    for i, block in enumerate(blocks):
        if i in plan.full_layers:
            continue
        paths = {**addressable_paths(block), **_communication_steps(block, dims)}
        paths = dict(sorted(paths.items(), key=lambda kv: (kv[0].count("."), kv[0])))
        checkpointed, output_recomputed = layer_selection(plan, i, paths, {}, {})
        if checkpointed or output_recomputed:
            out[i] = (tuple(checkpointed), tuple(output_recomputed))
    return out


def _selection_lines(selection: dict) -> list[str]:
    """One line per distinct selection: ``layers 3-60: checkpointed ...; output recomputed ...``."""
    by_choice: dict[tuple, list[int]] = {}
    for i, choice in sorted(selection.items()):
        by_choice.setdefault(choice, []).append(i)
    lines = []
    for (checkpointed, output_recomputed), layers in by_choice.items():
        parts = [f"checkpointed {', '.join(checkpointed)}"] if checkpointed else []
        parts += [f"output recomputed {', '.join(output_recomputed)}"] if output_recomputed else []
        lines.append(f"layers {_ranges(frozenset(layers))}: " + "; ".join(parts))
    return lines


def _communication_steps(block: Any, dims: Any) -> dict[str, tuple[None, str]]:
    """The callable attributes the parallel steps add to a layer (``docs/recompute.md``'s table), which
    a layer built without a process group lacks."""
    steps = []
    if dims.tp > 1:
        steps += ["self_attention.all_gather", "self_attention.reduce_scatter", "mlp.reduce_scatter"]
        steps += ["mlp.router.all_gather"] if hasattr(block.mlp, "router") else ["mlp.all_gather"]
    if dims.cp > 1:
        steps += ["self_attention.core_attention.all_gather", "self_attention.core_attention.all_to_all"]
    return {p: (None, p.rsplit(".", 1)[1]) for p in steps}


def _ranges(layers: frozenset) -> str:
    out, run = [], []
    for i in sorted(layers):
        if run and i != run[-1] + 1:
            out.append(run)
            run = []
        run.append(i)
    if run:
        out.append(run)
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in out)
