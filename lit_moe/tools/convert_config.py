"""``lit_moe convert-config graph.yaml -o pynative.yaml``: a MindFormers graph-mode config → ``pynative.yaml``.

The mapping is MindFormers' ("与 Graph 模式对应关系" tables of the PyNative configuration guide, and the
graph-mode feature switches of the training-features guide):

============================================  ==========================================================
graph.yaml                                    pynative.yaml
============================================  ==========================================================
``seed``                                      ``training.seed``
``runner_config.batch_size``                  ``training.local_batch_size``
``runner_config.gradient_accumulation_steps``  ``training.global_batch_size`` = A × data_parallel × batch
                                              (with ``pipeline_stage > 1`` graph mode accumulates
                                              ``micro_batch_num`` micro-batches instead, so A = that)
``lr_schedule.total_steps`` (> 0)             ``training.steps`` (-1: ``epochs × sizes[0] // global batch``)
``lr_schedule.*``                             ``lr_scheduler.*``; ``warmup_steps`` → ``warmup_ratio`` over
                                              the total steps; ``lr_end``/``warmup_lr_init`` kept when the
                                              schedule reads them (lit_moe's schedules do)
``optimizer.*``                               ``optimizer.*`` (``swap`` dropped)
``parallel_config.model_parallel``            ``parallelism.tensor_parallel``
``parallel_config.expert_parallel``           ``parallelism.expert_parallel``
``parallel_config.context_parallel``          ``parallelism.context_parallel``
``parallel_config.pipeline_stage`` (P > 1)    ``parallelism.pipeline_parallel``; with ``model_config.offset`` and
                                              ``pp_interleave_num`` → ``pipeline_parallel_layers_per_stage``
                                              (explicit ranges, MindFormers' ``LayerSetting`` split) and
                                              ``pipeline_parallel_interleave_num``;
                                              ``parallel.pipeline_config.pipeline_scheduler`` →
                                              ``pipeline_parallel_schedule`` (see :func:`graph_stage_ranges`)
``parallel_config.data_parallel``             the layout: ``data_parallel_shard: -1`` (FSDP over the implicit
                                              data-parallel size = world / (tp × cp)), and the global batch
``recompute_config.recompute`` / ``select_recompute``  ``recompute.mode`` full (every layer, or the first
                                              N / per-stage counts given) | select (core attention)
``recompute_config.mp_comm_recompute``        ``recompute_comm.enable`` (+ the tensor-parallel all-gathers)
``runner_wrapper.use_clip_grad`` / ``max_grad_norm``  ``training.max_norm`` (0 when clipping is off,
                                              graph mode's default)
``model.model_config.*``                      ``model.*`` (flattened)
``moe_config.use_gmm``                        ``model.moe_grouped_gemm``
``moe_config.capacity_factor``                ``model.moe_expert_capacity_factor`` (<= 0: dropless)
``moe_config.enable_gmm_safe_tokens``         nothing to set: lit_moe's grouped GEMM takes experts with no
                                              tokens (the error it worked around cannot happen)
``moe_config.callback_moe_droprate``          nothing to set: the MoE metrics callback reports
                                              ``moe/drop_rate`` whenever a capacity is set
``moe_config`` (legacy MoE names)             ``model`` (``expert_num`` → ``n_routed_experts``, …)
``model_config.use_fused_rope``/``use_fused_swiglu``  ``model.*`` (same names)
``context.affinity_config``                   ``context.affinity_config`` (``enable: true``, the per-device
                                              entries under ``affinity_cpu_list``)
``train_dataset.data_loader``                 ``train_dataset.dataloader`` (``config.seed`` and
                                              ``config.num_dataset_builder_threads`` dropped)
============================================  ==========================================================

Every other key (the guide's "Graph 独有配置项": ``output_dir``, ``trainer``, ``runner_config`` beyond the
batch, ``context`` beyond affinity, ``parallel``, ``callbacks``, ``runner_wrapper`` beyond clipping, the
``profile*`` keys, ``model_config.offset`` without pipeline stages, …) has no PyNative meaning and is named
in one warning.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from lit_moe.config import (CheckpointConfig, ConfigError, ContextConfig, MonitorConfig, ParallelismConfig,
                            ProfilerConfig, RecomputeCommConfig, RecomputeConfig, TrainDatasetConfig,
                            TrainingConfig)
from lit_moe.config_file import load_yaml


class GraphOnlyKeysWarning(UserWarning):
    """graph.yaml keys with no PyNative meaning (dropped by the conversion)."""


# ----------------------------------------------------------------------------------------------
# tables
# ----------------------------------------------------------------------------------------------
# Graph-mode optimizers that are AdamW with fp32 states (MindFormers' registry names).
_ADAMW_FAMILY = ("AdamW", "AdamWeightDecay", "FusedAdamWeightDecay", "FP32StateAdamWeightDecay",
                 "AdamWeightDecayX")
# Keys of model.model_config (and of the config.json of pretrained_model_dir) with no meaning for
# training here: dropped, each with a note giving the reason.
_INFERENCE = ("inference only (KV cache, decoding, quantized serving): `lit_moe predict` takes its own "
              "options (--max-new-tokens, --temperature, --top-p)")
_GRAPH = "a MindSpore graph-mode compilation / fused-kernel switch; lit_moe's kernels need no switch"
_LAYOUT = ("how MindSpore fuses weight tensors in its checkpoints; lit_moe keeps the Hugging Face layout "
           "(convert weights with the checkpoint converters)")
_REGISTRATION = "MindFormers class registration; lit_moe builds its model from model_type"
_DROPPED_MODEL_KEYS = {
    **dict.fromkeys(("block_size", "num_blocks", "use_past", "use_past_shard", "is_dynamic", "max_decode_length",
                     "top_k", "top_p", "do_sample", "repetition_penalty", "batch_size", "checkpoint_name_or_path",
                     "quantization_config", "npu_nums_per_device", "pretrain_seqlen", "use_cache"), _INFERENCE),
    **dict.fromkeys(("input_sliced_sig", "use_fused_mla", "bias_swiglu_fusion", "use_fused_ops_topkrouter",
                     "use_attn_mask_compression", "apply_rope_fusion", "moe_router_fusion"), _GRAPH),
    **dict.fromkeys(("qkv_concat", "ffn_concat", "use_contiguous_weight_layout_attention",
                     "use_interleaved_weight_layout_mlp"), _LAYOUT),
    **dict.fromkeys(("auto_register", "type", "auto_map"), _REGISTRATION),
}
# Legacy MindFormers model_config names (research/ and older configs) → lit_moe's model keys.
_LEGACY_MODEL_NAMES = {
    "num_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "param_init_type": "params_dtype",
    "layernorm_compute_type": "layernorm_compute_dtype", "softmax_compute_type": "softmax_compute_dtype",
    "theta": "rope_theta", "hidden_dropout_prob": "hidden_dropout", "attention_dropout_prob": "attention_dropout",
    "num_experts": "n_routed_experts", "router_aux_loss_coef": "moe_aux_loss_coeff", "sigma": "initializer_range",
}
# Keys with a training meaning lit_moe implements only at one value (MindFormers' default): that value
# is dropped with a note, any other is refused by name.
_FIXED_MODEL_KEYS = {
    "ignore_token_id": ((-100,), "the label id the loss ignores is -100"),
    "embed_dropout_prob": ((0, 0.0), "there is no embedding dropout"),
    "fp32_residual_connection": ((False,), "the residual stream stays in compute_dtype"),
    "moe_router_force_expert_balance": ((False,), "tokens are routed by score"),
    "moe_z_loss_coeff": ((None, 0, 0.0), "there is no router z-loss"),
    "mean": ((0, 0.0), "weights are initialised with mean 0"),
    "res_dtype": ((None,), "the residual stream stays in compute_dtype"),
}
# Architectures lit_moe builds (model_type / architectures / legacy model.arch.type).
_BUILT = ("DeepseekV3ForCausalLM", "deepseek_v3", "deepseek_mtp", "DeepseekV3Config", "DeepseekV32ForCausalLM",
          "deepseek_v32", "DeepseekV32Config", "Qwen3MoeForCausalLM",
          "qwen3_moe", "Qwen3MoeConfig", "Glm4MoeForCausalLM", "glm4_moe", "Glm4MoeConfig")
# trainer.model_name of the families lit_moe builds: MindFormers builds that model without an
# architectures / model_type key, so the conversion writes model_type.
_NAMED_FAMILIES = ("qwen3_moe", "glm4_moe")
# Graph-mode model keys MindFormers' graph router (parallel_core/training_graph/transformer/moe/router.py)
# does not read: why they are dropped.
_UNREAD_ROUTER_KEYS = {
    "moe_router_pre_softmax": "MindFormers' graph-mode router does not read it: scores are computed over all "
                              "experts before the top-k choice and norm_topk_prob renormalises the chosen ones, "
                              "as here",
}
# Graph-mode load-balancing types → lit_moe's, with the difference.
_LOAD_BALANCING = {
    "gbs_aux_loss": ("aux_loss", "MindFormers' gbs_aux_loss is the Switch balancing loss over the global batch; "
                                 "lit_moe's aux_loss is the same loss per micro-batch (equal with one micro-batch "
                                 "per step and data_parallel 1)"),
}
# trainer.model_name families of other architectures (MindFormers builds that model without an
# architectures / model_type key).
_OTHER_FAMILIES = ("qwen", "glm", "telechat", "llama", "mixtral", "baichuan", "internlm")

# Keys of model.model_config that place layers on pipeline stages (read by ``parallelism``; dropped
# without pipeline stages, where graph mode ignores them too).
_PIPELINE_MODEL_KEYS = ("offset", "pp_interleave_num")
# parallel.pipeline_config.pipeline_scheduler (MindSpore) → pipeline_parallel_schedule. The sequence-
# chunked schedules (seqpipe, seqvpp, seqsmartvpp) have no counterpart: they reorder the same
# arithmetic, so 1f1b (interleaved with V > 1) stands in, with a note.
_GRAPH_SCHEDULERS = {"1f1b": "1f1b", "gpipe": "gpipe", "zero_bubble_v": "zbv", "seqpipe": "1f1b",
                     "seqvpp": "1f1b", "seqsmartvpp": "1f1b"}
# Model keys MindFormers' PyNative DeepSeek-V3 ignores (lit_moe.model.mindformers_defaults) → the
# keys that carry their meaning there.
_PYNATIVE_IGNORED_MODEL_KEYS = {"scaling_factor": "rotary_scaling_factor", "scoring_func": "moe_router_score_function"}
# Legacy ``moe_config`` names → model keys.
_MOE_CONFIG_TO_MODEL = {
    "expert_num": "n_routed_experts",
    "num_experts_chosen": "num_experts_per_tok",
    "shared_expert_num": "n_shared_experts",
    "routed_scaling_factor": "routed_scaling_factor",
    "norm_topk_prob": "norm_topk_prob",
    "first_k_dense_replace": "first_k_dense_replace",
    "moe_intermediate_size": "moe_intermediate_size",
    "topk_group": "topk_group",
    "n_group": "n_group",
    "router_dense_type": "router_dense_type",
    "aux_loss_factor": "moe_aux_loss_coeff",
    "balance_via_topk_bias": "moe_router_enable_expert_bias",
    "topk_bias_update_rate": "moe_router_bias_update_rate",
    "use_gmm": "moe_grouped_gemm",
    "capacity_factor": "moe_expert_capacity_factor",
    "use_gating_sigmoid": "moe_router_score_function",   # PyNative deletes scoring_func
    "use_pad_tokens": "use_pad_tokens",
}
# Regex for ``recompute_comm.select_module`` standing for graph mode's ``mp_comm_recompute``: the
# tensor/sequence-parallel all-gathers of every layer (not the FSDP parameter gather).
MP_COMM_PATTERN = r"(?!fsdp\.).*all_gather"
# What ``select_recompute: True`` recomputes: the core attention (softmax and its inputs), Megatron's
# "selective activation recompute".
SELECT_PATTERN = r"self_attention\.core_attention"

_PYNATIVE_ORDER = ("checkpoint", "training", "optimizer", "lr_scheduler", "parallelism", "recompute",
                   "recompute_comm", "train_dataset", "model", "monitor", "profiler", "context")
_FIXED_SECTIONS = {"checkpoint": CheckpointConfig, "training": TrainingConfig, "parallelism": ParallelismConfig,
                   "recompute": RecomputeConfig, "recompute_comm": RecomputeCommConfig,
                   "train_dataset": TrainDatasetConfig, "monitor": MonitorConfig, "profiler": ProfilerConfig,
                   "context": ContextConfig}


@dataclass
class Conversion:
    """The result: the ``pynative.yaml`` sections, the dropped graph keys, and notes on the mapping."""

    pynative: dict[str, Any]
    dropped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------
# small pure helpers (also used by ``lit_moe fit``)
# ----------------------------------------------------------------------------------------------
def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
    return value


def global_batch_from_accumulation(steps: int, data_parallel: int, local_batch_size: int) -> int:
    """Graph mode's ``gradient_accumulation_steps`` as PyNative's ``training.global_batch_size``:
    ``steps × data_parallel × local_batch_size`` (so that ``global // (dp × local)`` gives ``steps`` back)."""
    return (_positive_int(steps, "gradient_accumulation_steps") * _positive_int(data_parallel, "data_parallel")
            * _positive_int(local_batch_size, "training.local_batch_size"))


def translate_gradient_accumulation(argv: list[str], data_parallel: int,
                                    local_batch_size: Optional[int] = None) -> list[str]:
    """``lit_moe fit`` arguments with ``--gradient_accumulation_steps N`` replaced by
    ``--training.global_batch_size=N×dp×local`` (a note saying so goes to stderr). ``local_batch_size``
    defaults to the ``--training.local_batch_size`` override, else the ``--config`` file's
    ``training.local_batch_size``, else 1. Arguments without the option come back unchanged."""
    out: list[str] = []
    steps_text: Optional[str] = None
    names = ("--gradient_accumulation_steps", "--gradient-accumulation-steps")
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in names:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{name}: missing value")
                value = argv[i + 1]
                i += 1
            steps_text = value
        else:
            out.append(arg)
        i += 1
    if steps_text is None:
        return list(argv)
    try:
        steps = int(steps_text)
    except ValueError:
        raise ConfigError(f"--gradient_accumulation_steps: expected an integer, got {steps_text!r}") from None
    if local_batch_size is None:
        local_batch_size = _local_batch_from_args(out)
    total = global_batch_from_accumulation(steps, data_parallel, local_batch_size)
    print(f"lit_moe: --gradient_accumulation_steps {steps} is graph mode's option; using "
          f"training.global_batch_size={total} (= {steps} × data_parallel {data_parallel} × local_batch_size "
          f"{local_batch_size}); set training.global_batch_size in pynative.yaml instead", file=sys.stderr)
    return out + [f"--training.global_batch_size={total}"]


def _local_batch_from_args(argv: list[str]) -> int:
    import yaml

    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name == "--training.local_batch_size":
            return int(value if eq else argv[i + 1])
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in ("--config", "-c"):
            path = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
            try:
                with open(path) as f:
                    data = yaml.safe_load(f) or {}
                return int((data.get("training") or {}).get("local_batch_size", 1))
            except (OSError, TypeError, ValueError, AttributeError, yaml.YAMLError):
                return 1
    return 1


def _offset_grid(offset: Any, pp: int, interleave: int, name: str) -> tuple[list[list[int]], int]:
    """``offset`` (int, one int per stage, or one list per interleave chunk) as a V x P grid (numpy's
    broadcasting, as MindFormers does it) and the sum of the entries as written (what its rule checks)."""
    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if offset is None:
        offset = 0
    if is_int(offset):
        return [[offset] * pp for _ in range(interleave)], offset
    if isinstance(offset, (list, tuple)) and all(is_int(v) for v in offset):
        if len(offset) != pp:
            raise ConfigError(f"{name}: {list(offset)} has {len(offset)} entries; it needs one per pipeline stage "
                              f"(parallel_config.pipeline_stage {pp})")
        return [list(offset) for _ in range(interleave)], sum(offset)
    if (isinstance(offset, (list, tuple)) and offset
            and all(isinstance(row, (list, tuple)) and all(is_int(v) for v in row) for row in offset)):
        if len(offset) != interleave or any(len(row) != pp for row in offset):
            raise ConfigError(f"{name}: {[list(r) for r in offset]} must be {interleave} list(s) (pp_interleave_num) "
                              f"of {pp} integers (parallel_config.pipeline_stage)")
        return [list(row) for row in offset], sum(sum(row) for row in offset)
    raise ConfigError(f"{name}: expected an integer, a list of {pp} integers or {interleave} such lists, got {offset!r}")


def graph_stage_ranges(num_layers: int, offset: Any, pp: int, interleave: int = 1, zbv: bool = False,
                       name: str = "model.model_config.offset") -> list[tuple[int, int]]:
    """Half-open decoder-layer ranges of graph mode's ``pp * interleave`` pipeline stages, in pipeline
    order (chunk c, position k → index c·pp + k), as MindFormers' ``LayerSetting`` places them:

    * stage (c, k) gets ``num_layers // (pp·V) + offset[c][k]`` layers, the offset broadcast from an
      int, a per-stage list or per-chunk lists; the entries as written must sum to
      ``num_layers % (pp·V)``;
    * ``zero_bubble_v`` (V-shaped): chunk 1 runs from the last rank back to the first, so its per-rank
      counts are reversed into pipeline order;
    * layers are then given out in order: a stage whose counts run past the last layer (an int or a
      per-stage offset broadcast over several stages adds it more than once) keeps only what is left.

    MindFormers allows an empty first or last stage; lit_moe's stages each need a layer, so any empty
    stage is a one-line :class:`ConfigError`, as are MindFormers' own errors (shape, sum, a middle
    stage below one layer)."""
    stages = pp * interleave
    if stages <= 1:
        return [(0, num_layers)]
    base, remainder = divmod(num_layers, stages)
    grid, total = _offset_grid(offset, pp, interleave, name)
    if total != remainder:
        raise ConfigError(f"{name}: the entries of {offset!r} sum to {total}, but MindFormers requires num_layers "
                          f"{num_layers} % (pipeline_stage {pp} x pp_interleave_num {interleave}) = {remainder}")
    counts = [[base + off for off in row] for row in grid]
    if zbv and interleave > 1:
        counts[1] = counts[1][::-1]
    flat = [n for row in counts for n in row]
    if flat[0] < 0 or flat[-1] < 0 or any(n < 1 for n in flat[1:-1]):
        raise ConfigError(f"{name}: {offset!r} gives the stages {counts} decoder layers ({num_layers} layers, "
                          f"{base} per stage before the offset); a stage cannot hold fewer than 0 (first, last) "
                          "or 1 (the others)")
    ranges, start = [], 0
    for s, n in enumerate(flat):
        end = min(start + n, num_layers)
        if end <= start:
            raise ConfigError(f"{name}: {offset!r} leaves pipeline stage {s} (chunk {s // pp}, position {s % pp}) "
                              f"without decoder layers (counts {counts} for {num_layers} layers); lit_moe's stages "
                              "each need at least one layer: move a layer to it")
        ranges.append((start, end))
        start = end
    if start < num_layers:  # cannot happen after the sum rule; kept so that a layer is never lost silently
        raise ConfigError(f"{name}: {offset!r} places only {start} of {num_layers} decoder layers")
    return ranges


def layers_per_stage_spec(ranges: list[tuple[int, int]], pp: int) -> list[str]:
    """``pipeline_parallel_layers_per_stage``: one string per pipeline position k of its chunks' inclusive
    ranges, chunk c being stage c·pp + k (how :func:`lit_moe.pipeline.split_layers` reads it)."""
    interleave = len(ranges) // pp
    return [",".join(f"{ranges[c * pp + k][0]}-{ranges[c * pp + k][1] - 1}" for c in range(interleave))
            for k in range(pp)]


# ----------------------------------------------------------------------------------------------
# the conversion
# ----------------------------------------------------------------------------------------------
def _section(graph: dict, key: str) -> dict:
    value = graph.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping, got {value!r}")
    return value


def _int(value: Any, name: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return value


def _leftovers(prefix: str, section: dict, used: set[str], out: list[str]) -> None:
    out.extend(f"{prefix}.{k}" for k in section if k not in used)


class _Converter:
    def __init__(self, graph: dict, world_size: Optional[int], steps: Optional[int],
                 pretrained_dir: Optional[str] = None):
        if not isinstance(graph, dict):
            raise ConfigError(f"graph config: expected a mapping of sections, got {type(graph).__name__}")
        self.g = graph
        self.world_size = world_size
        self.steps_override = steps
        self.pretrained_dir = pretrained_dir
        self.predict = graph.get("run_mode") == "predict"
        self.out: dict[str, Any] = {}
        self.dropped: list[str] = []
        self.notes: list[str] = []
        self.used_top: set[str] = set()
        self.pipeline_keys: dict[str, Any] = {}
        # graph mode's stages (decoder-layer ranges in pipeline order); one stage without pipelining
        self.stage_ranges: list[tuple[int, int]] = []
        self.pipeline_shape = (1, 1)   # (pipeline_stage, interleave)
        self.zbv = False

    def section(self, key: str) -> dict:
        self.used_top.add(key)
        return _section(self.g, key)

    # -- pieces ---------------------------------------------------------------------------------
    def run(self) -> Conversion:
        model = self.model()       # first: another architecture is refused before any other key
        self.top_level()
        parallel = self.parallelism(model)
        training = self.training(parallel)
        self.check_pipeline(model, parallel, training)
        self.optimizer()
        self.lr_scheduler(training.get("steps"))
        self.recompute(model)
        self.train_dataset()
        self.context()
        self.callbacks()
        # Whatever is left at the top level has no PyNative meaning.
        self.dropped.extend(k for k in self.g if k not in self.used_top)
        ordered = {k: self.out[k] for k in _PYNATIVE_ORDER if k in self.out}
        return Conversion(ordered, self.dropped, self.notes)

    def top_level(self) -> None:
        """Top-level keys with a training meaning (or a reason worth a note)."""
        g = self.g
        self.used_top.update(k for k in ("run_mode", "remove_redundancy", "load_checkpoint", "layer_scale",
                                         "layer_decay", "lr_scale_factor", "grouped_lr_schedule") if k in g)
        if self.predict:
            self.notes.append("run_mode 'predict': the model is converted and the inference keys are dropped; generate with "
                              "`lit_moe predict --config OUT --checkpoint DIR --prompt TEXT`, or add optimizer, "
                              "lr_scheduler, train_dataset and training.steps to train this model")
        elif "run_mode" in g:
            self.drop("run_mode", f"{g['run_mode']!r}: `lit_moe fit` trains (fine-tuning is checkpoint.no_load_optim)")
        if g.get("grouped_lr_schedule"):
            raise ConfigError("grouped_lr_schedule: per-parameter-group learning-rate schedules are not implemented yet; "
                              "remove it to train every parameter on lr_schedule")
        if g.get("layer_scale"):
            raise ConfigError("layer_scale: True (layer-wise learning-rate decay) is not implemented yet")
        for key in ("layer_scale", "layer_decay", "lr_scale_factor"):
            if key in g:
                self.drop(key, "layer-wise learning-rate scaling, off (layer_scale is false)")
        if "remove_redundancy" in g:
            self.out.setdefault("checkpoint", {})["remove_redundancy"] = bool(g["remove_redundancy"])
        if g.get("load_checkpoint"):
            self.drop("load_checkpoint", f"{g['load_checkpoint']!r} is a MindSpore checkpoint; convert its weights to "
                      "the Hugging Face layout and set checkpoint.load_path")
        elif "load_checkpoint" in g:
            self.dropped.append("load_checkpoint")

    def callbacks(self) -> None:
        """``CheckpointMonitor`` → ``checkpoint`` (prefix, interval, how many kept, async); the other
        callbacks are graph mode's (lit_moe's callbacks are on by their config sections)."""
        callbacks = self.g.get("callbacks")
        if not isinstance(callbacks, list):
            return
        names = {"prefix": "prefix", "save_checkpoint_steps": "save_interleaved_steps",
                 "keep_checkpoint_max": "save_max", "async_save": "async_save"}
        for cb in callbacks:
            if isinstance(cb, dict) and cb.get("type") == "CheckpointMonitor":
                ckpt = self.out.setdefault("checkpoint", {})
                for key, value in cb.items():
                    if key in names:
                        ckpt[names[key]] = value
                    elif key != "type":
                        self.dropped.append(f"callbacks.CheckpointMonitor.{key}")
                self.notes.append("callbacks.CheckpointMonitor → checkpoint." + ", checkpoint.".join(
                    names[k] for k in cb if k in names))

    def drop(self, key: str, reason: str) -> None:
        """A key with no meaning for training here: dropped, with a note saying why."""
        self.dropped.append(key)
        self.notes.append(f"{key}: {reason}; dropped")

    def model(self) -> dict:
        model_graph = self.section("model")
        model_config = model_graph.get("model_config")
        if model_config is None:
            model_config = {}
        if not isinstance(model_config, dict):
            raise ConfigError(f"model.model_config: expected a mapping, got {model_config!r}")
        hf = self.pretrained(model_config)
        named_type = self.check_architecture(model_graph, model_config, hf)
        if "arch" in model_graph:
            self.drop("model.arch", _REGISTRATION)
        _leftovers("model", model_graph, {"model_config", "arch"}, self.dropped)
        model: dict[str, Any] = {}
        for key, value in model_config.items():
            name = f"model.model_config.{key}"
            if key in _UNREAD_ROUTER_KEYS:
                self.drop(name, _UNREAD_ROUTER_KEYS[key])
            elif key == "moe_router_load_balancing_type" and value in _LOAD_BALANCING:
                target, why = _LOAD_BALANCING[value]
                self.notes.append(f"{name}: {value!r} → {target!r} ({why})")
                self.set_model_key(model, key, target, name)
            elif key in _PIPELINE_MODEL_KEYS:
                self.pipeline_keys[key] = value   # read by parallelism(); dropped there without stages
            elif key in _DROPPED_MODEL_KEYS:
                self.drop(name, _DROPPED_MODEL_KEYS[key])
            elif key in _FIXED_MODEL_KEYS:
                allowed, meaning = _FIXED_MODEL_KEYS[key]
                if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
                    raise ConfigError(f"{name}: {value!r} is not implemented yet (in lit_moe {meaning})")
                self.drop(name, f"{value!r} is what lit_moe does ({meaning})")
            elif key == "multiple_of":
                if "intermediate_size" not in model_config and "intermediate_size" not in hf:
                    raise ConfigError(f"{name}: {value!r} sizes the MLP only when intermediate_size is not given; "
                                      "set model.model_config.intermediate_size")
                self.drop(name, "legacy MLP rounding, unused when intermediate_size is given")
            elif key == "moe_token_drop_policy" and not isinstance(value, str):
                # graph configs write False for "no dropping"; PyNative names a policy or leaves it out
                self.dropped.append(name)
            elif key == "extend_method":
                self.extend_method(value, model)
            elif key == "scaling_factor" and isinstance(value, dict):
                self.legacy_yarn(value, model)
            elif key in _LEGACY_MODEL_NAMES:
                self.set_model_key(model, _LEGACY_MODEL_NAMES[key], value, name)
            elif key == "architectures" and isinstance(value, (list, tuple)) and len(value) == 1:
                model[key] = value[0]
            elif key in _PYNATIVE_IGNORED_MODEL_KEYS:   # the graph meaning, under the key PyNative reads
                model[_PYNATIVE_IGNORED_MODEL_KEYS[key]] = value
            else:
                self.set_model_key(model, key, value, name)
        self.moe_config(model)
        self.merge_pretrained(model, hf)
        if named_type is not None:
            model.setdefault("model_type", named_type)
        if model.get("model_type") == "qwen3_moe" and "qk_layernorm" not in model:
            model["qk_layernorm"] = True
            self.notes.append("model.qk_layernorm: True (MindFormers' Qwen3-MoE always builds q/k layernorms, "
                              "models/qwen3_moe/modeling_qwen3_moe_train.py)")
        self.out["model"] = model
        return model

    def set_model_key(self, model: dict, key: str, value: Any, source: str) -> None:
        """``model[key] = value``, refusing two spellings of one key with different values."""
        aliases = _model_aliases()
        canonical = aliases.get(key, key)
        for other, current in model.items():
            if aliases.get(other, other) == canonical and current != value:
                raise ConfigError(f"{source}: {value!r} conflicts with {other}: {current!r} (both set {canonical})")
        model[key] = value

    def extend_method(self, value: Any, model: dict) -> None:
        """Legacy ``extend_method``: the rotary scaling (``YARN`` → ``position_embedding_type: yarn``)."""
        name = "model.model_config.extend_method"
        if value in (None, "None", "NONE"):
            self.drop(name, "no rotary scaling, lit_moe's default")
        elif str(value).upper() == "YARN":
            self.set_model_key(model, "position_embedding_type", "yarn", name)
        else:
            raise ConfigError(f"{name}: {value!r} is not implemented yet; supported: 'YARN', 'None'")

    def legacy_yarn(self, value: dict, model: dict) -> None:
        """Legacy ``scaling_factor: {factor, beta_fast, ...}`` (YaRN parameters) → the flat model keys."""
        keys = {"factor": "scaling_factor", "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale",
                "mscale_all_dim": "mscale_all_dim",
                "original_max_position_embeddings": "original_max_position_embeddings"}
        for k, v in value.items():
            if k not in keys:
                raise ConfigError(f"model.model_config.scaling_factor.{k}: unknown YaRN key; supported: "
                                  + ", ".join(keys))
            self.set_model_key(model, keys[k], v, f"model.model_config.scaling_factor.{k}")

    def pretrained(self, model_config: dict) -> dict:
        """The ``config.json`` of ``pretrained_model_dir`` (or ``--pretrained-model-dir``): MindFormers builds
        the model from it, ``model.model_config`` overriding its keys. A directory without one is refused
        when the YAML does not give the model's dimensions itself."""
        self.used_top.add("pretrained_model_dir")
        path = self.pretrained_dir or self.g.get("pretrained_model_dir")
        if not path:
            return {}
        path = str(path)
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            if all(k in model_config for k in ("hidden_size", "num_attention_heads")) and any(
                    k in model_config for k in ("num_hidden_layers", "num_layers")):
                self.notes.append(f"pretrained_model_dir: {path!r} has no config.json; model.model_config gives the "
                                  "model's dimensions and is used as it is")
                return {}
            if not any(k in model_config for k in ("architectures", "model_type")):
                self.check_model_name()
            raise ConfigError(f"pretrained_model_dir: {path!r} has no config.json, and model.model_config does not give "
                              "the model's dimensions (MindFormers reads them from it); pass --pretrained-model-dir "
                              "DIR, a Hugging Face model directory")
        try:
            with open(config_file, encoding="utf-8") as f:
                hf = json.load(f)
        except (OSError, ValueError) as err:
            raise ConfigError(f"pretrained_model_dir: {config_file} is not readable JSON ({err})") from None
        if not isinstance(hf, dict):
            raise ConfigError(f"pretrained_model_dir: {config_file} is not a JSON object")
        self.notes.append(f"model: {len(hf)} keys from {config_file}, model.model_config overriding them (MindFormers' "
                          "pretrained_model_dir)")
        return hf

    def merge_pretrained(self, model: dict, hf: dict) -> None:
        aliases = _model_aliases()
        given = {aliases.get(k, k) for k in model}
        for key, value in hf.items():
            if key in _DROPPED_MODEL_KEYS:
                self.drop(f"pretrained_model_dir config.json {key}", _DROPPED_MODEL_KEYS[key])
            elif aliases.get(key, key) not in given:
                model[key] = value

    def check_architecture(self, model_graph: dict, model_config: dict, hf: dict) -> Optional[str]:
        """An architecture lit_moe does not build is refused here, by name, before any key; without an
        architecture key, the model_type ``trainer.model_name`` implies (None: DeepSeek-V3)."""
        arch = model_graph.get("arch") if isinstance(model_graph.get("arch"), dict) else {}
        stated = False
        for name, value in (("model.model_config.architectures", model_config.get("architectures")),
                            ("model.model_config.model_type", model_config.get("model_type")),
                            ("model.arch.type", arch.get("type")),
                            ("model.model_config.type", model_config.get("type")),
                            ("pretrained_model_dir config.json architectures", hf.get("architectures")),
                            ("pretrained_model_dir config.json model_type", hf.get("model_type"))):
            values = value if isinstance(value, (list, tuple)) else [value]
            for v in values:
                if v is not None and v not in _BUILT:
                    raise ConfigError(f"{name}: {v!r} is not implemented: lit_moe trains DeepSeek-V3, Qwen3-MoE "
                                      "and GLM-4-MoE architectures only (DeepseekV3ForCausalLM, DeepseekV32ForCausalLM, "
                                      "Qwen3MoeForCausalLM, Glm4MoeForCausalLM)")
                stated = stated or v is not None
        if not stated:
            return self.check_model_name()
        return None

    def check_model_name(self) -> Optional[str]:
        """Without an architecture key MindFormers builds the model ``trainer.model_name`` names: the
        model_type of a family lit_moe builds (None: DeepSeek-V3); another family is refused."""
        trainer = self.g.get("trainer")
        model_name = str(trainer.get("model_name", "")) if isinstance(trainer, dict) else ""
        if model_name.lower() in _NAMED_FAMILIES:
            self.notes.append(f"trainer.model_name: {model_name!r} → model.model_type: {model_name.lower()!r}")
            return model_name.lower()
        if any(family in model_name.lower() for family in _OTHER_FAMILIES):
            raise ConfigError(f"trainer.model_name: {model_name!r} builds MindFormers' {model_name} model, not DeepSeek-V3 "
                              "(no architectures or model_type says otherwise); lit_moe trains DeepSeek-V3-architecture "
                              "models only")

    def moe_config(self, model: dict) -> None:
        moe = self.section("moe_config")
        if not moe:
            return
        aliases = _model_aliases()
        present = {aliases.get(k, k) for k in model}
        for key, value in moe.items():
            target = _MOE_CONFIG_TO_MODEL.get(key)
            if key == "enable_gmm_safe_tokens":
                self.notes.append("moe_config.enable_gmm_safe_tokens: nothing to set; lit_moe's grouped GEMM "
                                  "accepts experts that receive no tokens")
                continue
            if key == "callback_moe_droprate":
                if value:
                    self.notes.append("moe_config.callback_moe_droprate: the MoE metrics callback "
                                      "(monitor.moe_monitor) logs moe/drop_rate whenever a capacity is set")
                continue
            if target is None:
                self.dropped.append(f"moe_config.{key}")
                continue
            if key == "use_gating_sigmoid":
                value = "sigmoid" if value else "softmax"
            if key == "capacity_factor":
                if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0):
                    self.notes.append(f"moe_config.capacity_factor: {value!r} means no capacity (dropless)")
                    continue
            if target in present:
                if model.get(target, value) != value:
                    self.notes.append(f"moe_config.{key}: {value!r} ignored; model.model_config sets "
                                      f"{target} to {model[target]!r}")
                continue
            model[target] = value
            present.add(target)

    def parallelism(self, model: dict) -> dict:
        pc = self.section("parallel_config")
        used = {"data_parallel", "model_parallel", "expert_parallel", "context_parallel", "pipeline_stage"}
        dp = _int(pc.get("data_parallel", 1), "parallel_config.data_parallel", 1)
        tp = _int(pc.get("model_parallel", 1), "parallel_config.model_parallel", 1)
        ep = _int(pc.get("expert_parallel", 1), "parallel_config.expert_parallel", 1)
        cp = _int(pc.get("context_parallel", 1), "parallel_config.context_parallel", 1)
        pp = _int(pc.get("pipeline_stage", 1), "parallel_config.pipeline_stage", 1)
        micro = _int(pc.get("micro_batch_num", 1), "parallel_config.micro_batch_num", 1)
        if pp > 1:
            used.add("micro_batch_num")  # it is graph mode's accumulation count then
        _leftovers("parallel_config", pc, used, self.dropped)

        parallelism = {"data_parallel_shard": -1, "data_parallel_shard_strategy": "optim_grads_params",
                       "tensor_parallel": tp, "expert_parallel": ep}
        if cp > 1:
            parallelism["context_parallel"] = cp
        if pp > 1:
            self.stage_ranges = self.pipeline(model, pp, parallelism)
        else:
            self.dropped.extend(f"model.model_config.{k}" for k in self.pipeline_keys)
            self.stage_ranges = [(0, _decoder_layers(model))]
        self.pipeline_shape = (pp, len(self.stage_ranges) // pp)
        stage_ranges = self.stage_ranges
        self.out["parallelism"] = parallelism
        layout = dp * tp * cp * pp
        self.notes.append(f"layout: data_parallel {dp} × tensor_parallel {tp}"
                          + (f" × context_parallel {cp}" if cp > 1 else "")
                          + (f" × pipeline_parallel {pp}" if pp > 1 else "")
                          + f" = {layout} devices keeps graph mode's data-parallel size (data_parallel_shard: "
                          "-1 shards over all data-parallel ranks)")
        if self.world_size is not None:
            w = _positive_int(self.world_size, "--world-size")
            if w % (tp * cp * pp):
                raise ConfigError(f"--world-size: {w} is not divisible by tensor_parallel × context_parallel × "
                                  f"pipeline_parallel = {tp * cp * pp}")
            if w % ep:
                raise ConfigError(f"--world-size: {w} is not divisible by expert_parallel = {ep}")
            if w != layout:
                self.notes.append(f"--world-size {w}: data_parallel becomes {w // (tp * cp * pp)} (graph: {dp}); "
                                  "the global batch is kept, so the accumulation steps change")
        return {"dp": dp, "tp": tp, "cp": cp, "pp": pp, "micro": micro, "stage_ranges": stage_ranges}

    def pipeline(self, model: dict, pp: int, parallelism: dict) -> list[tuple[int, int]]:
        """``pipeline_stage`` P > 1: the pipeline keys, and the stages' layers as graph mode places them."""
        graph_parallel = _section(self.g, "parallel")
        pipe_cfg = graph_parallel.get("pipeline_config") or {}
        if not isinstance(pipe_cfg, dict):
            raise ConfigError(f"parallel.pipeline_config: expected a mapping, got {pipe_cfg!r}")
        if "pipeline_config" in graph_parallel:
            self.used_top.add("parallel")
            _leftovers("parallel", graph_parallel, {"pipeline_config"}, self.dropped)
            _leftovers("parallel.pipeline_config", pipe_cfg, {"pipeline_interleave", "pipeline_scheduler"},
                       self.dropped)
        scheduler = pipe_cfg.get("pipeline_scheduler", "1f1b")
        if scheduler not in _GRAPH_SCHEDULERS:
            raise ConfigError(f"parallel.pipeline_config.pipeline_scheduler: {scheduler!r} has no PyNative "
                              f"counterpart; supported: {', '.join(_GRAPH_SCHEDULERS)}")
        requested_v = _int(self.pipeline_keys.get("pp_interleave_num", 1) or 1, "model.model_config.pp_interleave_num", 1)
        # MindFormers' LayerSetting reads pp_interleave_num only when MindSpore's pipeline_interleave is on
        interleave = requested_v if pipe_cfg.get("pipeline_interleave", False) else 1
        if requested_v > 1 and interleave == 1:
            self.notes.append(f"model.model_config.pp_interleave_num: {requested_v} has no effect in graph mode without "
                              "parallel.pipeline_config.pipeline_interleave: true; one stage per rank")
        schedule = _GRAPH_SCHEDULERS[scheduler]
        if scheduler.startswith("seq"):
            self.notes.append(f"parallel.pipeline_config.pipeline_scheduler: {scheduler} (sequence-chunked) has no "
                              f"PyNative counterpart; {schedule} runs the same arithmetic"
                              + (" (interleaved with pp_interleave_num > 1)" if interleave > 1 else ""))
        num_layers = _decoder_layers(model)
        offset = self.pipeline_keys.get("offset", 0)
        self.zbv = schedule == "zbv"
        ranges = graph_stage_ranges(num_layers, offset, pp, interleave, zbv=self.zbv)
        parallelism["pipeline_parallel"] = pp
        parallelism["pipeline_parallel_schedule"] = schedule
        if interleave > 1:
            parallelism["pipeline_parallel_interleave_num"] = interleave
        elif "pp_interleave_num" in self.pipeline_keys and requested_v == 1:
            self.dropped.append("model.model_config.pp_interleave_num")   # 1: nothing to carry over
        even = num_layers % (pp * interleave) == 0 and all(b - a == num_layers // (pp * interleave) for a, b in ranges)
        spec = layers_per_stage_spec(ranges, pp)
        if not even:
            parallelism["pipeline_parallel_layers_per_stage"] = spec
        self.notes.append(f"parallel_config.pipeline_stage {pp}" + (f" x pp_interleave_num {interleave}" if interleave > 1
                                                                  else "")
                          + f", offset {offset!r}: decoder layers per stage {spec}"
                          + (" (the even split, pipeline_parallel_layers_per_stage auto)" if even else "")
                          + "; the last stage also holds the MTP layers")
        return ranges

    def check_pipeline(self, model: dict, parallel: dict, training: dict) -> None:
        """The pipeline keys as ``lit_moe fit`` checks them: schedule, stages, micro-batches, MTP."""
        if parallel["pp"] <= 1:
            return
        from lit_moe.config import build_section
        from lit_moe.model import DeepseekV3Config
        from lit_moe.pipeline import check_pipeline_run

        parallelism = build_section(ParallelismConfig, self.out["parallelism"], "parallelism")
        check_pipeline_run(parallelism, DeepseekV3Config(**model), parallel["micro"], training["global_batch_size"],
                           stage_ranks=parallel["dp"] * parallel["tp"] * parallel["cp"])

    def training(self, parallel: dict) -> dict:
        rc = self.section("runner_config")
        _leftovers("runner_config", rc, {"batch_size", "gradient_accumulation_steps", "epochs"}, self.dropped)
        local = _int(rc.get("batch_size", 1), "runner_config.batch_size", 1)
        accumulation = _int(rc.get("gradient_accumulation_steps", 1) or 1,
                            "runner_config.gradient_accumulation_steps", 1)
        if parallel["pp"] > 1:
            if accumulation > 1:
                self.notes.append("runner_config.gradient_accumulation_steps: ignored by graph mode under "
                                  f"pipeline parallelism; parallel_config.micro_batch_num = {parallel['micro']} "
                                  "micro-batches are accumulated instead")
            accumulation = parallel["micro"]
        global_batch = global_batch_from_accumulation(accumulation, parallel["dp"], local)
        steps = self._steps(global_batch, rc)
        training: dict[str, Any] = {"local_batch_size": local, "global_batch_size": global_batch}
        if steps is not None:
            training = {"steps": steps, **training}

        wrapper = self.section("runner_wrapper")
        _leftovers("runner_wrapper", wrapper, {"use_clip_grad", "max_grad_norm"}, self.dropped)
        if wrapper.get("use_clip_grad", False):
            max_norm = wrapper.get("max_grad_norm", 1.0)
            if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or max_norm <= 0:
                raise ConfigError(f"runner_wrapper.max_grad_norm: expected a positive number, got {max_norm!r}")
            training["max_norm"] = float(max_norm)
        else:
            training["max_norm"] = 0.0
            self.notes.append("runner_wrapper.use_clip_grad is off (graph mode's default): training.max_norm 0 "
                              "(no clipping)")
        if "seed" in self.g:
            self.used_top.add("seed")
            training["seed"] = _int(self.g["seed"], "seed")
        self.out["training"] = training
        return training

    def _steps(self, global_batch: int, rc: dict) -> Optional[int]:
        """``lr_schedule.total_steps``, or MindFormers' rule for -1/None (``BaseTrainer.create_lr_scheduler``
        after ``check_runner_config``, mindformers/trainer/base_trainer.py and trainer/utils.py):
        ``epochs × dataset size`` steps, the dataset size being the batches of one epoch (samples //
        global batch with drop_remainder); with ``sink_mode`` and ``sink_size`` s > 0 the epochs are
        first rescaled to ``int(size / s × epochs)`` sinks of s steps."""
        if self.steps_override is not None:
            return _positive_int(self.steps_override, "--steps")
        sched = _section(self.g, "lr_schedule")
        total = sched.get("total_steps")
        if isinstance(total, int) and not isinstance(total, bool) and total > 0:
            return total
        if total not in (None, -1):
            raise ConfigError(f"lr_schedule.total_steps: expected a positive integer, -1 or null, got {total!r}")
        if not sched and self.predict:
            return None   # a predict config: nothing trains, no step count
        samples, why = self._dataset_samples()
        if samples is None:
            raise ConfigError(f"lr_schedule.total_steps: {total!r} means epochs × dataset size (MindFormers), but {why}; "
                              "pass --steps N")
        drop = _section(self.g, "train_dataset").get("drop_remainder", True)
        size = samples // global_batch if drop else -(-samples // global_batch)
        epochs = _int(rc.get("epochs", 1), "runner_config.epochs", 1)
        sink = rc.get("sink_size", -1)
        if rc.get("sink_mode", False) and isinstance(sink, int) and sink > 0:
            steps = int(size / sink * epochs) * sink
        else:
            steps = epochs * size
        if steps <= 0:
            raise ConfigError(f"lr_schedule.total_steps: {total!r} gives {steps} steps ({samples} samples, global batch "
                              f"{global_batch}, runner_config.epochs {epochs}); pass --steps N")
        self.notes.append(f"training.steps = runner_config.epochs {epochs} × dataset size {size} ({samples} samples // "
                          f"global batch {global_batch}) = {steps} (lr_schedule.total_steps is {total!r}; "
                          "MindFormers' rule)")
        return steps

    def _dataset_samples(self) -> tuple[Optional[int], str]:
        """Samples of one epoch of the train data, from the config (Megatron ``sizes[0]``) or the data
        (the rows of MindRecord files); (None, why not) when neither tells."""
        ds = _section(self.g, "train_dataset")
        loader = ds.get("data_loader") if isinstance(ds.get("data_loader"), dict) else {}
        kind = loader.get("type")
        if not loader:
            return None, "there is no train_dataset.data_loader"
        if kind == "MindDataset":
            files = loader.get("dataset_files") or loader.get("dataset_dir")
            try:
                from lit_moe.data.mindrecord import MindRecordDataset, mindrecord_files

                return len(MindRecordDataset(mindrecord_files(files, "dataset_files"), None, "dataset_files")), ""
            except ConfigError as err:
                return None, f"the MindRecord data cannot be counted ({err})"
        if kind == "HFDataLoader":
            return None, "the size of a Hugging Face dataset (HFDataLoader) is known only once it is loaded and processed"
        sizes = loader.get("sizes") or [None]
        if isinstance(sizes, (list, tuple)) and sizes and isinstance(sizes[0], int) and sizes[0] > 0:
            return sizes[0], ""
        return None, "train_dataset.data_loader.sizes[0] does not give the number of samples"

    def optimizer(self) -> None:
        opt = self.section("optimizer")
        if not opt:
            return
        out: dict[str, Any] = {}
        for key, value in opt.items():
            if key in ("swap", "learning_rate"):
                self.dropped.append(f"optimizer.{key}")  # swap: graph-only; the LR comes from lr_schedule
            elif key == "type":
                out[key] = self._optimizer_type(value)
            else:
                out[key] = value
        self.out["optimizer"] = out

    def _optimizer_type(self, kind: Any) -> str:
        if kind in _ADAMW_FAMILY:
            if kind != "AdamW":
                self.notes.append(f"optimizer.type: {kind} → AdamW (torch AdamW with fp32 states)")
            return "AdamW"
        if kind == "Muon":
            return kind
        raise ConfigError(f"optimizer.type: {kind!r} has no PyNative counterpart; supported: AdamW "
                          f"({', '.join(_ADAMW_FAMILY[1:])} map to it), Muon")

    def lr_scheduler(self, steps: int) -> None:
        from lit_moe.optim.schedules import _COMMON_KEYS, _TYPE_KEYS, SUPPORTED_SCHEDULES

        sched = self.section("lr_schedule")
        if not sched:
            return
        kind = sched.get("type")
        if kind not in SUPPORTED_SCHEDULES:
            raise ConfigError(f"lr_schedule.type: {kind!r} has no PyNative counterpart; supported: "
                              f"{', '.join(SUPPORTED_SCHEDULES)}")
        reads = set(_COMMON_KEYS) | set(_TYPE_KEYS[kind])
        out: dict[str, Any] = {}
        for key, value in sched.items():
            if key == "total_steps":
                continue  # → training.steps
            if key == "warmup_steps":
                if sched.get("warmup_ratio") is not None:
                    self.dropped.append("lr_schedule.warmup_steps")  # the ratio wins in MindFormers too
                    continue
                ratio = warmup_ratio_for(_int(value, "lr_schedule.warmup_steps"), steps)
                if ratio is None:
                    out["warmup_steps"] = value
                    self.notes.append(f"lr_schedule.warmup_steps: {value} exceeds training.steps {steps}; kept "
                                      "as warmup_steps (a ratio would be above 1)")
                else:
                    out["warmup_ratio"] = ratio
                continue
            if key not in reads:
                self.dropped.append(f"lr_schedule.{key}")
                continue
            out[key] = value
        self.out["lr_scheduler"] = out

    def recompute(self, model: dict) -> None:
        rc = self.section("recompute_config")
        if not rc:
            return
        _leftovers("recompute_config", rc, {"recompute", "select_recompute", "mp_comm_recompute"}, self.dropped)
        total = _total_layers(model)
        everything = [f"0-{total - 1}"]
        full = rc.get("recompute", False)
        select = rc.get("select_recompute", False)
        if select:
            if not isinstance(select, bool):
                self.notes.append(f"recompute_config.select_recompute: graph operator names {select!r} do not "
                                  "exist in PyNative; the core attention of every layer is recomputed instead")
            self.out["recompute"] = {"mode": "select", "select_module": {SELECT_PATTERN: everything}}
        elif full:
            self.out["recompute"] = {"mode": "full", "full_recompute_layer": self._full_layers(full, total)}
        comm = rc.get("mp_comm_recompute")
        if comm:
            self.out["recompute_comm"] = {"enable": True, "select_module": {MP_COMM_PATTERN: everything}}
        elif comm is not None:
            self.out["recompute_comm"] = {"enable": False}

    def _full_layers(self, spec: Any, total: int) -> list[str]:
        """``True``: every layer; ``N``: the first N; ``[n_0, ..., n_{P-1}]``: the first n_r layers of each
        pipeline rank r, given out over its interleave chunks in turn (MindFormers'
        ``_alloc_recompute_layer``); ``[[...], ...]``: the first n layers of each chunk of each rank.
        The stages are graph mode's (``offset`` applied); ``True``/``False`` entries mean all/none."""
        if spec is True:
            return [f"0-{total - 1}"]
        if isinstance(spec, int) and not isinstance(spec, bool):
            n = min(spec, total)
            return [f"0-{n - 1}"] if n > 0 else []
        name = "recompute_config.recompute"
        if not isinstance(spec, (list, tuple)):
            raise ConfigError(f"{name}: expected true/false, a layer count or per-stage counts, got {spec!r}")
        pp = self.pipeline_shape[0]
        ranges = self.stage_ranges
        V = len(ranges) // pp

        def stage(chunk: int, rank: int) -> int:   # zbv: chunk 1 runs from the last rank back
            return chunk * pp + (pp - 1 - rank if self.zbv and chunk == 1 else rank)

        def count(n: Any, size: int) -> int:
            if isinstance(n, bool):
                return size if n else 0
            if not isinstance(n, int) or n < 0:
                raise ConfigError(f"{name}: per-stage counts must be non-negative integers or booleans, got {spec!r}")
            return min(n, size)

        sizes = [[ranges[stage(c, r)][1] - ranges[stage(c, r)][0] for r in range(pp)] for c in range(V)]
        picked = [[0] * pp for _ in range(V)]
        if all(not isinstance(n, (list, tuple)) for n in spec):
            if len(spec) != pp:
                raise ConfigError(f"{name}: per-stage counts {list(spec)} need one entry per pipeline stage "
                                  f"(parallel_config.pipeline_stage {pp})")
            for r, n in enumerate(spec):
                left = count(n, sum(sizes[c][r] for c in range(V)))
                while left:                       # one layer per chunk in turn (MindFormers)
                    for c in range(V):
                        if left and picked[c][r] < sizes[c][r]:
                            picked[c][r] += 1
                            left -= 1
        else:
            if len(spec) != V or any(not isinstance(row, (list, tuple)) or len(row) != pp for row in spec):
                raise ConfigError(f"{name}: per-chunk counts {spec!r} need {V} list(s) (pp_interleave_num) of {pp} "
                                  "entries (pipeline_stage)")
            picked = [[count(n, sizes[c][r]) for r, n in enumerate(row)] for c, row in enumerate(spec)]
        out = []
        for c in range(V):
            for r in range(pp):
                lo = ranges[stage(c, r)][0]
                if picked[c][r]:
                    out.append(f"{lo}-{lo + picked[c][r] - 1}")
        out.sort(key=lambda x: int(x.split("-")[0]))
        self.notes.append(f"{name}: per-stage counts {list(spec)} → layers {out} (stages {ranges})")
        return out

    def train_dataset(self) -> None:
        ds = self.section("train_dataset")
        if not ds:
            return
        out: dict[str, Any] = {}
        loader = ds.get("data_loader") or {}
        if not isinstance(loader, dict):
            raise ConfigError(f"train_dataset.data_loader: expected a mapping, got {loader!r}")
        dataloader: dict[str, Any] = {}
        kind = loader.get("type")
        for key, value in loader.items():
            if kind == "MindDataset" and key in ("dataset_dir", "dataset_files"):
                if "dataset_files" in dataloader:
                    raise ConfigError("train_dataset.data_loader: dataset_dir and dataset_files both given; keep one")
                dataloader["dataset_files"] = value   # PyNative's MindDataset takes files and directories
            elif key == "config" and isinstance(value, dict):
                cfg = {}
                for ck, cv in value.items():
                    if ck in ("seed", "num_dataset_builder_threads"):
                        self.dropped.append(f"train_dataset.data_loader.config.{ck}")
                    else:
                        cfg[ck] = cv
                dataloader["config"] = cfg
            else:
                dataloader[key] = value
        used = {"data_loader"}
        if "input_columns" in ds and "column_names" not in dataloader:
            dataloader["column_names"] = ds["input_columns"]
            used.add("input_columns")
        if "python_multiprocessing" in ds and "python_multiprocessing" not in dataloader:
            dataloader["python_multiprocessing"] = ds["python_multiprocessing"]
            used.add("python_multiprocessing")
        out["dataloader"] = dataloader
        if kind == "HFDataLoader":
            self.notes.append("train_dataset.data_loader.type: HFDataLoader has no lit_moe loader yet (`lit_moe fit` "
                              "refuses it): tokenize the data with `lit_moe preprocess` into Megatron .bin/.idx "
                              "(BlendedMegatronDatasetDataLoader) or write MindRecord files (MindDataset)")
        elif kind == "MindDataset" and ds.get("input_columns") is None and "column_names" not in dataloader:
            self.notes.append("train_dataset: no input_columns; MindDataset reads every column of the files")
        for key in ("drop_remainder", "num_parallel_workers", "prefetch_size", "numa_enable"):
            if key in ds:
                out[key] = ds[key]
                used.add(key)
        _leftovers("train_dataset", ds, used, self.dropped)
        self.out["train_dataset"] = out

    def context(self) -> None:
        ctx = self.section("context")
        if not ctx:
            return
        affinity = ctx.get("affinity_config")
        used = set()
        source = "context.affinity_config"
        if affinity in ("None", "none"):
            affinity = None   # MindFormers' YAML spelling of "no affinity"
        if affinity is None and ctx.get("affinity_cpu_list") not in (None, "None", "none"):
            affinity, source = ctx["affinity_cpu_list"], "context.affinity_cpu_list"
        if affinity:
            if not isinstance(affinity, dict):
                raise ConfigError(f"{source}: expected a mapping device_X -> CPU list, got {affinity!r}")
            cpus: dict[str, Any] = {}
            for device, entry in affinity.items():
                if isinstance(entry, dict):
                    # the shape in MindFormers' training-features guide: {affinity_cpu_list: [...], module_to_cpu_dict: {main, minddata, ...}}
                    kept = {}
                    for key, value in entry.items():
                        if key in ("affinity_cpu_list", "module_to_cpu_dict"):
                            kept[key] = value
                        else:
                            self.dropped.append(f"{source}.{device}.{key}")
                    if kept.get("affinity_cpu_list") is not None:
                        kept["affinity_cpu_list"] = _cpu_strings(kept["affinity_cpu_list"])
                    if kept:
                        cpus[str(device)] = kept
                elif entry is not None:
                    cpus[str(device)] = _cpu_strings(entry)
            if cpus:
                self.out["context"] = {"affinity_config": {"enable": True, "affinity_cpu_list": cpus}}
        used.update({"affinity_config", "affinity_cpu_list"} & set(ctx))
        if "affinity_config" in ctx and "affinity_cpu_list" in ctx:
            self.dropped.append("context.affinity_cpu_list")  # affinity_config wins (seed)
        _leftovers("context", ctx, used, self.dropped)


def _cpu_strings(entry: Any) -> list[str]:
    return [str(c) for c in (entry if isinstance(entry, (list, tuple)) else [entry])]


def warmup_ratio_for(warmup_steps: int, total_steps: int) -> Optional[float]:
    """The ratio r with ``int(total_steps × r) == warmup_steps`` (how schedules turn it back into steps),
    or None when ``warmup_steps > total_steps``. ``warmup_steps / total_steps`` alone can land just below
    (29/100 × 100 = 28.999…), so it is nudged up to the next float until it round-trips."""
    if warmup_steps > total_steps:
        return None
    ratio = warmup_steps / total_steps
    while int(total_steps * ratio) < warmup_steps:
        ratio = math.nextafter(ratio, math.inf)
    return ratio


def _model_aliases() -> dict[str, str]:
    from lit_moe.model.config import ALIASES

    return dict(ALIASES)


def _decoder_layers(model: dict) -> int:
    from lit_moe.model import DeepseekV3Config

    return DeepseekV3Config(**model).num_hidden_layers


def _total_layers(model: dict) -> int:
    """Decoder plus MTP layers of the converted ``model`` section (what recompute specs address)."""
    from lit_moe.model import DeepseekV3Config

    return DeepseekV3Config(**model).total_layers


def _check_fixed_keys(name: str, value: Any, cls: type) -> None:
    """The converted file may hold only keys the section dataclasses accept."""
    if not isinstance(value, dict):
        return
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, sub in value.items():
        if key not in fields:
            raise AssertionError(f"convert-config produced {name}.{key}, which {cls.__name__} does not accept")
        ftype = fields[key].default_factory if fields[key].default_factory is not dataclasses.MISSING else None
        if ftype is not None and dataclasses.is_dataclass(ftype):
            _check_fixed_keys(f"{name}.{key}", sub, ftype)


def validate_conversion(pynative: dict, predict: bool = False) -> None:
    """Check the converted sections the way ``lit_moe fit`` will (one-line :class:`ConfigError`)."""
    from lit_moe.optim.optimizers import validate_optimizer_section
    from lit_moe.optim.schedules import resolve_schedule

    for name, cls in _FIXED_SECTIONS.items():
        _check_fixed_keys(name, pynative.get(name), cls)
    if not pynative.get("model"):
        raise ConfigError("model.model_config: missing or empty; the PyNative config needs the model section")
    if not pynative.get("lr_scheduler") and not predict:
        raise ConfigError("lr_schedule: missing; the PyNative config needs lr_scheduler.type and learning_rate")
    steps = pynative.get("training", {}).get("steps", TrainingConfig.steps)
    if "lr_scheduler" in pynative:
        resolve_schedule(pynative["lr_scheduler"], steps)
    if "optimizer" in pynative:
        validate_optimizer_section(pynative["optimizer"])
    if "recompute" in pynative or "recompute_comm" in pynative:
        from lit_moe.strategies.recompute import validate_recompute

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            validate_recompute(pynative.get("recompute"), pynative.get("recompute_comm"),
                               _total_layers(pynative.get("model", {})))


def convert(graph: dict, world_size: Optional[int] = None, steps: Optional[int] = None,
            pretrained_model_dir: Optional[str] = None) -> Conversion:
    """The full conversion (sections, dropped keys, notes), validated; see :func:`convert_graph_config`.
    ``pretrained_model_dir`` stands in for the YAML's (a Hugging Face model directory)."""
    converter = _Converter(graph, world_size, steps, pretrained_model_dir)
    result = converter.run()
    validate_conversion(result.pynative, predict=converter.predict)
    return result


def convert_graph_config(graph: dict, world_size: Optional[int] = None) -> tuple[dict, list[str]]:
    """``(pynative sections, dropped graph keys)``. The dropped keys (no PyNative meaning) are also
    reported in one :class:`GraphOnlyKeysWarning`. ``world_size`` (optional) checks the layout and notes
    how the accumulation steps change on that many devices."""
    result = convert(graph, world_size)
    if result.dropped:
        warnings.warn(dropped_message(result.dropped), GraphOnlyKeysWarning, stacklevel=2)
    return result.pynative, result.dropped


def dropped_message(dropped: list[str]) -> str:
    return (f"{len(dropped)} graph.yaml key(s) have no PyNative meaning and were dropped: "
            + ", ".join(dropped))


# ----------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------
def to_yaml(result: Conversion, source: str) -> str:
    import yaml

    lines = [f"# Converted from {source} by `lit_moe convert-config` (MindFormers graph mode -> PyNative).",
             "# Notes:"] + [f"#   - {n}" for n in result.notes]
    if result.dropped:
        lines.append("# Dropped (no PyNative meaning): " + ", ".join(result.dropped))
    body = yaml.safe_dump(result.pynative, sort_keys=False, allow_unicode=True, default_flow_style=False)
    return "\n".join(lines) + "\n\n" + body


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lit_moe convert-config",
        description="Convert a MindFormers graph-mode config (graph.yaml) into a pynative.yaml for lit_moe.")
    parser.add_argument("graph", help="graph-mode YAML (graph.yaml)")
    parser.add_argument("-o", "--output", help="pynative.yaml to write (default: standard output)")
    parser.add_argument("--world-size", "-n", type=int, default=None,
                        help="devices the PyNative run will use (checks the layout)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training.steps, when lr_schedule.total_steps is -1 and the dataset size is unknown")
    parser.add_argument("--pretrained-model-dir", default=None,
                        help="Hugging Face model directory (its config.json) in place of the YAML's pretrained_model_dir")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        repeated: list = []
        graph = load_yaml(args.graph, field="graph.yaml", repeated=repeated)
        result = convert(graph, args.world_size, args.steps, args.pretrained_model_dir)
        result.notes[:0] = [f"graph.yaml: key {key!r} is given twice in one mapping (lines {first} and {line}); "
                            "the last one is used, as MindFormers (PyYAML) reads it" for key, first, line in repeated]
    except ConfigError as err:
        from lit_moe.tools.errors import one_line

        print(f"lit_moe convert-config: error: {one_line(err)}", file=sys.stderr)
        return 2
    text = to_yaml(result, args.graph)
    if result.dropped:
        print(f"lit_moe convert-config: warning: {dropped_message(result.dropped)}", file=sys.stderr)
    for note in result.notes:
        print(f"lit_moe convert-config: note: {note}", file=sys.stderr)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
