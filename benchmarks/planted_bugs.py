"""Planted-bug check: do the tests catch the bugs that matter?

Each entry of ``BUGS`` names a file, a piece of text that occurs in it exactly once, the text that
replaces it (one plausible single bug: a swapped norm, a wrong sign, a missing division...) and the
tests that must then fail. The script copies the repository (tracked and untracked files, no ``.git``)
to a temporary directory once, plants one bug at a time there, runs that bug's tests with
``PYTHONPATH`` set to the copy, restores the file and reports which bugs survive (tests pass) or break
the collection (tests error without failing an assertion).

    python benchmarks/planted_bugs.py --check          # every `old` text exists exactly once (fast)
    python benchmarks/planted_bugs.py                  # plant every bug (slow: about half an hour)
    python benchmarks/planted_bugs.py hf_norm_swap mtp_norm_swap   # only these
    python benchmarks/planted_bugs.py --markdown out.md             # also write the report table

It runs on demand, not in CI (it is not a test file); a survivor means a test to strengthen. Keep the
selections small (a file and a ``-k`` filter): each bug costs one pytest start.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Bug:
    name: str
    area: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]          # pytest arguments: node ids, files, "-k", "expr"
    timeout: float = 900.0


BUGS: list[Bug] = [
    # ---------------------------------------------------------------- key maps, norms
    Bug("hf_norm_swap", "key map", "lit_moe/model/names.py",
        '("pre_mlp_layernorm", {"huggingface": "post_attention_layernorm"}),',
        '("input_layernorm", {"huggingface": "post_attention_layernorm"}),\n'
        '    ("pre_mlp_layernorm", {"huggingface": "input_layernorm"}),',
        ("tests/test_hf_interop.py", "tests/test_checkpoint_hf.py", "-k", "logits_match or transformers_logits")),
    Bug("hf_router_bias_dropped", "key map", "lit_moe/model/hf.py",
        'return [(spelled(name, "huggingface", num_hidden_layers), _WHOLE)]',
        'return [(spelled(name, "huggingface", num_hidden_layers),\n'
        '                 (lambda t: t * 0) if name.endswith("expert_bias") else _WHOLE)]',
        ("tests/test_hf_interop.py", "-k", "logits_match")),
    Bug("export_router_stored_bf16", "key map (export dtypes)", "lit_moe/model/hf.py",
        "out_dtype = stored if (dtype is None or keep) else dtype", "out_dtype = dtype or stored",
        ("tests/test_hf_interop.py", "-k", "bf16_storage")),
    Bug("pool_worker_keeps_sigterm_handler", "resilience (preprocess pool)", "lit_moe/data/preprocess.py",
        "        signal.signal(signal.SIGTERM, signal.SIG_DFL)\n", "",
        ("tests/test_preprocess.py", "-k", "whatever_sigterm_handler")),
    Bug("process_groups_released_without_collecting", "resilience (exit)", "lit_moe/runtime/distributed.py",
        "        dist.destroy_process_group()\n    gc.collect()\n", "        dist.destroy_process_group()\n",
        ("tests/test_resilience.py", "-k", "released_process_groups")),
    Bug("mesh_groups_keep_torchs_default_timeout", "resilience (collective timeout)",
        "lit_moe/strategies/parallel_dims.py",
        "            set_group_timeout(timeout, *(mesh.get_group(d) for d in range(mesh.ndim)))\n",
        "            pass\n",
        ("tests/test_strategy.py", "-k", "collective_timeout")),
    Bug("rendezvous_bounded_by_the_collective_timeout", "resilience (start-up)", "lit_moe/strategies/strategy.py",
        "            self._timeout = max(collective, STARTUP_RENDEZVOUS)\n", "            pass\n",
        ("tests/test_strategy_launch.py", "-k", "stuck")),
    Bug("consumed_samples_of_other_data_multiply", "data sampling (consumed samples)", "lit_moe/module.py",
        "        return self._samples_counted or 0\n",
        "        return (self.trainer.global_step * self.accumulation_steps * self.training_config.local_batch_size\n"
        "                * self.step_strategy.parallel_dims.dp)\n",
        ("tests/test_callbacks_module.py", "-k", "consumed_samples")),
    Bug("preemption_left_acting_after_failed_fit", "resilience (signal handlers)", "lit_moe/runtime/preemption.py",
        "        if self not in _ACTIVE:\n", "        if False:\n",
        ("tests/test_resilience.py", "-k", "failed_fit")),
    Bug("v4_indexer_sizes_of_v32", "families (default sizes)", "lit_moe/model/config_parsing.py",
        "topk = 2048 if cfg.sparse_attention else 512", "topk = 2048",
        ("tests/test_family_v4.py", "-k", "defaults_and_rules")),
    Bug("hf_mtp_final_norm", "key map", "lit_moe/model/names.py",
        'rest = "shared_head.norm" + rest[len("final_layernorm"):]',
        'rest = "hnorm" + rest[len("final_layernorm"):]',
        ("tests/test_hf_interop.py", "-k", "mtp_matches or mtp_layers_round_trips")),
    Bug("norm_eps_ignored", "norms", "lit_moe/ops/norm.py",
        "y = F.rms_norm(x, (x.shape[-1],), weight, self.eps)",
        "y = F.rms_norm(x, (x.shape[-1],), weight, 1e-2)",
        ("tests/test_hf_interop.py", "-k", "logits_match")),
    # ---------------------------------------------------------------- MLA, rope, YaRN
    Bug("softmax_scale_no_mscale", "MLA/YaRN", "lit_moe/model/rope.py",
        "        scale = scale * m * m\n", "        scale = scale * m\n",
        ("tests/test_hf_interop.py", "-k", "logits_match")),
    Bug("yarn_ramp_inverted", "YaRN", "lit_moe/model/rope.py",
        "inv_freq = interpolation * (1 - keep) + extrapolation * keep",
        "inv_freq = interpolation * keep + extrapolation * (1 - keep)",
        ("tests/test_model_rope.py",)),
    Bug("rope_rotation_sign", "rope", "lit_moe/ops/rotary.py",
        "out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)",
        "out = torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)",
        ("tests/test_hf_interop.py", "-k", "logits_match")),
    # ---------------------------------------------------------------- router, groups, expert bias
    Bug("gate_weights_biased", "router", "lit_moe/model/moe.py",
        "weights = scores.gather(1, indices)",
        "weights = (scores + self.expert_bias).gather(1, indices)",
        ("tests/test_model_moe.py", "-k", "expert_bias_changes_selection")),
    Bug("group_score_max", "group selection", "lit_moe/model/moe.py",
        "group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)",
        "group_scores = grouped.topk(1, dim=-1).values.sum(dim=-1)",
        ("tests/test_model_moe.py", "-k", "group_limited_selection")),
    Bug("counts_wrong_expert", "expert counts", "lit_moe/model/moe.py",
        "self.tokens_per_expert += kept_counts",
        "self.tokens_per_expert += kept_counts.roll(1)",
        ("tests/test_model_moe.py", "-k", "counts_per_expert")),
    Bug("bias_update_direction", "expert bias", "lit_moe/model/transformer.py",
        "bias += rate * torch.sign(c.mean() - c)",
        "bias += rate * torch.sign(c - c.mean())",
        ("tests/test_model_moe.py", "-k", "sign_rule")),
    Bug("shared_expert_dropped", "experts", "lit_moe/model/moe.py",
        "out = out + self.shared_experts(x)", "out = out + 0 * self.shared_experts(x)",
        ("tests/test_hf_interop.py", "-k", "logits_match")),
    Bug("capacity_floor", "capacity", "lit_moe/model/moe.py",
        "return math.ceil(num_tokens * self.top_k / self.num_experts * self.capacity_factor)",
        "return math.floor(num_tokens * self.top_k / self.num_experts * self.capacity_factor)",
        ("tests/test_model_moe.py", "-k", "capacity")),
    Bug("bf16_grouped_gemm_zeroed", "bf16 experts", "lit_moe/model/moe.py",
        "return _ContiguousGrad.apply(y).index_select(0, dest)",
        "return 0 * _ContiguousGrad.apply(y).index_select(0, dest)",
        ("tests/test_model_dtypes.py", "-k", "per_parameter_group")),
    # ---------------------------------------------------------------- aux losses
    Bug("aux_loss_scale", "aux loss", "lit_moe/model/moe.py",
        "f = counts * (E / (top_k * n))", "f = counts * (E / n)",
        ("tests/test_model_moe.py", "-k", "aux_loss")),
    Bug("mtp_aux_not_divided", "aux loss", "lit_moe/model/transformer.py",
        "mtp_aux = mtp_aux / len(self.mtp)", "mtp_aux = mtp_aux",
        ("tests/test_model_mtp.py", "-k", "aux_loss_scaled")),
    # ---------------------------------------------------------------- MTP
    Bug("mtp_norm_swap", "MTP", "lit_moe/model/mtp.py",
        "torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)",
        "torch.cat([self.hnorm(embedded), self.enorm(hidden)], dim=-1)",
        ("tests/test_hf_interop.py", "-k", "mtp_matches")),
    Bug("mtp_loss_not_divided_by_depth", "MTP", "lit_moe/model/transformer.py",
        "return total * (self.config.mtp_loss_scaling_factor / len(self.mtp))",
        "return total * self.config.mtp_loss_scaling_factor",
        ("tests/test_hf_interop.py", "-k", "mtp_matches")),
    # ---------------------------------------------------------------- loss masking
    Bug("loss_mask_ignored", "loss masking", "lit_moe/model/loss.py",
        "return (ce * mask.reshape(-1)).sum() / mask.sum().clamp_min(1e-8)",
        "return ce.mean()",
        ("tests/test_model_mtp.py", "-k", "hand_shifted")),
    # ---------------------------------------------------------------- accumulation, clipping
    Bug("accumulation_not_scaled", "accumulation", "lit_moe/module.py",
        "self.manual_backward(objective / A)", "self.manual_backward(objective)",
        ("tests/test_training.py", "-k", "accumulation_matches")),
    Bug("clip_coef_cap", "clipping", "lit_moe/strategies/clip.py",
        "coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)",
        "coef = torch.clamp(max_norm / (total_norm + 1e-6), max=2.0)",
        # (AdamW's first step is scale invariant: the hand-computed step cannot see the clip factor)
        ("tests/test_strategy.py", "-k", "clip_grad_norm")),
    # ---------------------------------------------------------------- LR schedule, optimizer
    Bug("cosine_half_period", "LR schedule", "lit_moe/optim/schedules.py",
        "\n    percent = max(0.0, 0.5 * (1.0 + math.cos(math.pi * s.num_cycles * 2.0 * progress)))",
        "\n    percent = max(0.0, 0.5 * (1.0 + math.cos(math.pi * s.num_cycles * progress)))",
        ("tests/test_schedules.py", "-k", "cosine")),
    Bug("warmup_off_by_one", "LR schedule", "lit_moe/optim/schedules.py",
        "return s.warmup_lr_init + (s.learning_rate - s.warmup_lr_init) * t / s.warmup_steps",
        "return s.warmup_lr_init + (s.learning_rate - s.warmup_lr_init) * (t + 1) / s.warmup_steps",
        ("tests/test_schedules.py", "-k", "warmup")),
    # ---------------------------------------------------------------- data sampling
    Bug("documents_not_shuffled", "data sampling", "lit_moe/data/gpt.py",
        "    index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)\n    rng.shuffle(index)\n",
        "    index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)\n    rng.shuffle(index[1:])\n",
        ("tests/test_data_gpt.py", "-k", "megatron")),
    # ---------------------------------------------------------------- context parallel layout
    Bug("cp_zigzag_chunks", "CP", "lit_moe/strategies/context_parallel.py",
        "return rank, 2 * cp - 1 - rank", "return 2 * rank, 2 * rank + 1",
        ("tests/test_context_parallel.py", "-k", "zigzag_balance or block_causal")),
    # ---------------------------------------------------------------- checkpoint
    Bug("reshard_offset", "checkpoint reshard", "lit_moe/checkpoint/sharded.py",
        "src.append(slice(lo - so, hi - so))", "src.append(slice(lo - o, hi - o))",
        ("tests/test_checkpoint_unit.py",)),
    Bug("checkpoint_offsets_dropped", "checkpoint save", "lit_moe/checkpoint/sharded.py",
        'geometry[key] = {"offsets": list(p.offsets), "global_shape": list(p.global_shape)}',
        'geometry[key] = {"offsets": [0] * len(p.offsets), "global_shape": list(p.global_shape)}',
        ("tests/test_checkpoint_unit.py",)),
    Bug("schedule_state_not_loaded", "optimizer/schedule state", "lit_moe/optim/optimizers.py",
        "        super().load_state_dict(state_dict)\n        self._position = None\n",
        "        self._position = None\n",
        ("tests/test_checkpoint_e2e.py", "-k", "exact_resume")),
    Bug("ckpt_index_rows_from_start", "checkpoint index reads", "lit_moe/checkpoint/sharded.py",
        "first, last = lo + rows.start * row_bytes, lo + rows.stop * row_bytes",
        "first, last = lo, lo + (rows.stop - rows.start) * row_bytes",
        ("tests/test_checkpoint_io.py", "-k", "chunks_read")),
    Bug("ckpt_index_chunk_crc_skipped", "checkpoint index reads", "lit_moe/checkpoint/sharded.py",
        "if c >= len(sp.crcs) or zlib.crc32(part) != sp.crcs[c]:", "if c >= len(sp.crcs):",
        ("tests/test_checkpoint_io.py", "-k", "chunks_read")),
    Bug("ckpt_index_whole_file_crc", "checkpoint resume I/O", "lit_moe/checkpoint/sharded.py",
        "self.verify(p for p in per_file if p not in self.headers)", "self.verify(per_file)",
        ("tests/test_checkpoint_io.py", "-k", "o1_files")),
    Bug("ckpt_small_pieces_scattered", "checkpoint resume I/O", "lit_moe/checkpoint/sharded.py",
        "writer = small_writer.setdefault(group, writer)", "small_writer.setdefault(group, writer)",
        ("tests/test_checkpoint_io.py", "-k", "o1_files")),
    Bug("hf_slice_box_not_offset", "HF import slices", "lit_moe/checkpoint/hf_load.py",
        "box.append(slice(sl.start + piece.offsets[b] - geo.start[b], sl.stop + piece.offsets[b] - geo.start[b]))",
        "box.append(slice(sl.start - geo.start[b], sl.stop - geo.start[b]))",
        ("tests/test_hf_io.py", "-k", "its_slices")),
    Bug("hf_narrow_columns_from_0", "HF import slices", "lit_moe/model/safetensors_io.py",
        "parts = [self._pread(base + r * row + c0 * col, (c1 - c0) * col) for r in range(r0, r1)]",
        "parts = [self._pread(base + r * row, (c1 - c0) * col) for r in range(r0, r1)]",
        ("tests/test_hf_io.py", "-k", "rows_and_columns")),
    Bug("fp8_scale_divided", "FP8 dequantization", "lit_moe/model/safetensors_io.py",
        "return weight.to(torch.float32) * scale_inv.to(torch.float32)[r[:, None], c[None, :]]",
        "return weight.to(torch.float32) / scale_inv.to(torch.float32)[r[:, None], c[None, :]]",
        ("tests/test_hf_io.py", "-k", "hand_computed")),
    Bug("fp8_block_size_ignored", "FP8 dequantization", "lit_moe/model/safetensors_io.py",
        'return tuple(quant.get("weight_block_size") or (128, 128))', "return (128, 128)",
        ("tests/test_hf_io.py", "-k", "loads_dequantized")),
    Bug("convert_stream_region_from_0", "convert-hf streaming", "lit_moe/checkpoint/convert_hf.py",
        "index.read([(mapping[e.name], buf, tuple(full), 0)])",
        "index.read([(mapping[e.name], buf, (0,) * len(full), 0)])",
        ("tests/test_hf_io.py", "-k", "bounded_memory")),
    # ---------------------------------------------------------------- recompute
    Bug("recompute_counts_twice", "recompute", "lit_moe/model/moe.py",
        "return self.training and torch.is_grad_enabled() and not in_backward()",
        "return self.training and torch.is_grad_enabled()",
        ("tests/test_model_moe.py", "-k", "counters_only")),
    # ---------------------------------------------------------------- multi-process (slow)
    Bug("ep_rows_not_expert_major", "EP communication", "lit_moe/strategies/expert_parallel.py",
        "return comm.all_to_all(x, d.recv_splits, d.send_splits, group).index_select(0, d.perm)",
        "return comm.all_to_all(x, d.recv_splits, d.send_splits, group)",
        ("tests/test_step_layouts.py", "-k", "dp2_ep2_compile")),
    Bug("sp_moe_rows_overlap", "SP (MoE row split)", "lit_moe/strategies/expert_parallel.py",
        "return (n * index) // parts, (n * (index + 1)) // parts",
        "return (n * index) // parts, min(n, (n * (index + 1)) // parts + 1)",
        ("tests/test_step_layouts.py", "-k", "tp2_a2")),
    # DeepSeek-V4 under tensor parallel: replicated weights used by this rank's heads or tokens only
    Bug("v4_tp_mhc_grad_not_summed", "TP (DeepSeek-V4 mHC)", "lit_moe/strategies/tensor_parallel.py",
        "            use_local_params(module)\n",
        '            use_local_params(module, partial_replicated_grads=type(module).__name__ != "HyperConnection")\n',
        ("tests/test_step_layouts.py", "-k", "v4_cp2_tp2_ep2")),
    Bug("v4_tp_compressor_grad_not_summed", "TP (DeepSeek-V4 attention)", "lit_moe/strategies/tensor_parallel.py",
        "            use_local_params(module)\n",
        '            use_local_params(module, partial_replicated_grads=type(module).__name__ != "Compressor")\n',
        ("tests/test_step_layouts.py", "-k", "v4_cp2_tp2_ep2")),
    # DeepSeek-V4 under context parallel: the attention's keys over the whole sequence, in order, global rows
    Bug("v4_cp_keys_rank_order", "CP (DeepSeek-V4 attention)", "lit_moe/strategies/context_parallel.py",
        "    whole = _in_sequence_order(comm.all_gather(x, group, dim=1), shard.size)",
        "    whole = comm.all_gather(x, group, dim=1)",
        ("tests/test_step_layouts.py", "-k", "v4_cp2_tp2_ep2")),
    Bug("v4_cp_local_keys_only", "CP (DeepSeek-V4 attention)", "lit_moe/model/v4_attention.py",
        "        keys_x, key_positions, mask = self.hooks.whole_sequence(x, position_ids, ctx.full_mask)",
        "        keys_x, key_positions, mask = x, position_ids, None",
        ("tests/test_step_layouts.py", "-k", "v4_cp2_tp2_ep2")),
    # ... under ulysses / hybrid: the group's queries for this rank's heads, their sinks and mask rows
    Bug("v4_ulysses_sinks_of_first_heads", "CP (DeepSeek-V4 attention, ulysses)", "lit_moe/strategies/context_parallel.py",
        "sinks[rank * heads:(rank + 1) * heads]", "sinks[:heads]",
        ("tests/test_step_layouts.py", "-k", "v4_cp2_ulysses")),
    Bug("v4_ulysses_own_mask_rows", "CP (DeepSeek-V4 attention, ulysses)", "lit_moe/strategies/context_parallel.py",
        "_gathered_rows(allowed, group, u, dim=1)", "allowed.repeat(1, u, 1)",
        ("tests/test_step_layouts.py", "-k", "v4_cp2_ulysses")),
    Bug("v4_hybrid_heads_by_group", "CP (DeepSeek-V4 attention, hybrid)", "lit_moe/strategies/context_parallel.py",
        "u=u, rank=rank % u)", "u=u, rank=rank // u)",
        ("tests/test_step_layouts.py", "-k", "v4_cp4_hybrid")),
    # DeepSeek-V3.2's indexer under context parallel: keys of the whole sequence, in order, global rows
    Bug("v32_cp_indexer_keys_not_gathered", "CP (DeepSeek-V3.2 indexer)", "lit_moe/strategies/context_parallel.py",
        "    keys = _in_sequence_order(comm.all_gather(k, group, dim=1), shard.size)",
        "    keys = k.repeat(1, shard.size, 1)",
        ("tests/test_step_layouts.py", "-k", "v32_cp2_tp2")),
    Bug("v32_cp_indexer_keys_rank_order", "CP (DeepSeek-V3.2 indexer)", "lit_moe/strategies/context_parallel.py",
        "    keys = _in_sequence_order(comm.all_gather(k, group, dim=1), shard.size)",
        "    keys = comm.all_gather(k, group, dim=1)",
        ("tests/test_step_layouts.py", "-k", "v32_cp2_tp2")),
    Bug("v32_cp_indexer_local_rows", "CP (DeepSeek-V3.2 indexer)", "lit_moe/strategies/context_parallel.py",
        "for j in rank_chunks(size, rank)], dim=2)", "for j in range(2)], dim=2)",
        ("tests/test_step_layouts.py", "-k", "v32_cp2_tp2")),
    Bug("v32_cp_selection_ignored", "CP (DeepSeek-V3.2 indexer)", "lit_moe/strategies/context_parallel.py",
        "            if selected is not None:   # its rows already hold the causal (window, document) rules\n"
        "                outs.append(",
        "            if False:\n                outs.append(",
        ("tests/test_step_layouts.py", "-k", "v32_cp2_tp2")),
    # ... under ulysses / hybrid: the selection rows of the group's queries, in the queries' order
    Bug("v32_ulysses_topk_over_local_keys", "CP (DeepSeek-V3.2 indexer, ulysses)",
        "lit_moe/strategies/context_parallel.py",
        "    keys = _in_sequence_order(comm.all_gather(k, group, dim=1), shard.size)",
        "    keys = k.repeat(1, shard.size, 1)",
        ("tests/test_step_layouts.py", "-k", "v32_cp2_ulysses")),
    Bug("v32_ulysses_own_rows_for_every_query", "CP (DeepSeek-V3.2 indexer, ulysses)",
        "lit_moe/strategies/context_parallel.py",
        "selected = _gathered_rows(selected, self.ulysses_group, self.u)", "selected = selected.repeat(1, 1, self.u, 1)",
        ("tests/test_step_layouts.py", "-k", "v32_cp2_ulysses")),
    Bug("v32_ulysses_rows_in_rank_order", "CP (DeepSeek-V3.2 indexer, ulysses)",
        "lit_moe/strategies/context_parallel.py",
        "mask = _reorder(selected, self.query_chunks, self.sorted_keys)", "mask = selected",
        ("tests/test_step_layouts.py", "-k", "v32_cp2_ulysses")),
    Bug("v32_ulysses_selection_ignored", "CP (DeepSeek-V3.2 indexer, ulysses)",
        "lit_moe/strategies/context_parallel.py",
        "            if selected is not None:   # its rows already hold the causal (window, document) rules\n"
        "                mask = _reorder(",
        "            if False:\n                mask = _reorder(",
        ("tests/test_step_layouts.py", "-k", "v32_cp2_ulysses")),
    Bug("v32_hybrid_rows_from_ring_group", "CP (DeepSeek-V3.2 indexer, hybrid)",
        "lit_moe/strategies/context_parallel.py",
        "selected = _gathered_rows(selected, self.ulysses_group, self.u)",
        "selected = _gathered_rows(selected, self.ring_group or self.ulysses_group, self.u)",
        ("tests/test_step_layouts.py", "-k", "v32_cp4_hybrid_async")),
    Bug("v32_async_selection_dropped", "CP (DeepSeek-V3.2 indexer, hybrid)", "lit_moe/strategies/context_parallel.py",
        "self._attend(qp, kp, vp, masks, selected)", "self._attend(qp, kp, vp, masks)",
        ("tests/test_step_layouts.py", "-k", "v32_cp4_hybrid_async")),
    # DeepSeek-V4 under pipeline parallel: the last stage collapses the mHC streams with hc_head
    Bug("v4_pp_hc_head_skipped", "PP (DeepSeek-V4 mHC)", "lit_moe/pipeline/stage.py",
        "self.hc_head = model.hc_head if self.is_last else None", "self.hc_head = None",
        ("tests/test_pipeline.py", "-k", "layout_matches and pp2_v4")),
    Bug("cp_loss_share", "CP communication", "lit_moe/strategies/context_parallel.py",
        "return loss * (local / total.clamp_min(1.0) * size).to(loss.dtype)",
        "return loss * (local / total.clamp_min(1.0)).to(loss.dtype)",
        ("tests/test_step_layouts.py", "-k", "cp2_compile")),
    Bug("cp_aux_probs_not_reduced", "CP communication", "lit_moe/strategies/context_parallel.py",
        "return counts, comm.all_reduce(prob_sums, group), tokens * size",
        "return counts, prob_sums, tokens * size",
        ("tests/test_step_layouts.py", "-k", "cp2_compile")),
    Bug("grad_division_dense", "gradient division", "lit_moe/strategies/parallel_dims.py",
        "return float(dense_group * dense_group), float(dims.dp_cp * expert_group)",
        "return float(dense_group), float(dims.dp_cp * expert_group)",
        ("tests/test_gradient_division.py",)),
    Bug("tp_moe_aux_grad_not_scaled", "TP/SP communication", "lit_moe/strategies/expert_parallel.py",
        "mod.aux_loss = scale_grad(mod.aux_loss, 1.0 / parts)", "mod.aux_loss = scale_grad(mod.aux_loss, 1.0)",
        ("tests/test_step_layouts.py",)),
    Bug("allgather_backward_split", "TP/SP communication", "lit_moe/strategies/comm.py",
        "        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None\n\n\nclass _ReduceScatter",
        "        return _split(grad, ctx.group, ctx.dim), None, None\n\n\nclass _ReduceScatter",
        ("tests/test_step_layouts.py",)),
    Bug("expert_grads_x0.8", "gradient division per mesh", "lit_moe/strategies/parallelize.py",
        "experts.set_gradient_divide_factor(expert_factor or float(dims.dp_cp))",
        "experts.set_gradient_divide_factor(expert_factor or float(dims.dp_cp) * 1.25)",
        ("tests/test_step_layouts.py", "-k", "dp2_ep2_compile")),
    Bug("pp_losses_not_averaged", "PP", "lit_moe/pipeline/runner.py",
        "return vec[:4] / A", "return vec[:4] / A * (1 + (A > 1))",
        ("tests/test_pipeline.py", "-k", "layout_matches")),
    # ---------------------------------------------------------------- model hooks (no rebinding)
    Bug("rebinding_returns", "model hooks", "lit_moe/strategies/tensor_parallel.py",
        "    model.hooks.per_token_loss = vocab_parallel_ce\n",
        "    model.hooks.per_token_loss = vocab_parallel_ce\n    model.loss_function = vocab_parallel_ce\n",
        ("tests/test_import_graph.py", "-k", "rebinds")),
    Bug("fsdp_regather_ignored", "model hooks (recompute plan)", "lit_moe/strategies/recompute/apply.py",
        "return True if plan is not None and plan.regathers(layer_id) else default", "return default",
        ("tests/test_recompute.py", "-k", "fsdp_all_gather_virtual_path")),
    # recompute by forward hooks, CP by the core attention's slot (no .forward / core_attention rebinding)
    Bug("recompute_selected_module_not_hooked", "model hooks (recompute regions)", "lit_moe/strategies/recompute/apply.py",
        "            _wrap_call(paths[p][0], make_checkpointed, p, undo)\n", "            pass\n",
        ("tests/test_recompute.py", "-k", "select_wraps_exactly or identical")),
    Bug("recompute_rerun_without_parallel_hooks", "model hooks (recompute regions)", "lit_moe/strategies/recompute/hooks.py",
        "        self.pre = [(hook, hid in module._forward_pre_hooks_with_kwargs)",
        "        self.pre = [] and [(hook, hid in module._forward_pre_hooks_with_kwargs)",
        ("tests/test_recompute.py", "-k", "hooks_present_at_apply_time")),
    Bug("recompute_region_traced_by_compile", "model hooks (recompute regions)", "lit_moe/strategies/recompute/hooks.py",
        "    breaks_compiled_graphs = True\n", "    breaks_compiled_graphs = False\n",
        ("tests/test_bench_kernels.py", "-k", "compiled_layers_head_and_mtp_hold")),
    Bug("cp_core_attention_slot_ignored", "model hooks (CP attention slot)", "lit_moe/model/attention.py",
        "            return self.context_parallel(q, k, v, allowed)", "            return self.attend(q, k, v, allowed)",
        ("tests/test_context_parallel.py", "-k", "matches_single_process and ulysses_mtp")),
    Bug("cp_replaces_core_attention", "model hooks (no rebinding)", "lit_moe/strategies/context_parallel.py",
        "        core.context_parallel = ContextParallelAttention(", "        attn.core_attention = ContextParallelAttention(",
        ("tests/test_import_graph.py", "-k", "rebinds")),
    Bug("tp_loss_not_vocab_parallel", "model hooks (TP loss)", "lit_moe/strategies/tensor_parallel.py",
        "    model.hooks.per_token_loss = vocab_parallel_ce\n", "\n",
        ("tests/test_step_layouts.py", "-k", "tp2_a2")),
    Bug("cp_fused_head_not_shared", "model hooks (CP loss share)", "lit_moe/model/transformer.py",
        "        return h, self._shared(self.lm_head(h, labels, mask), mask)",
        "        return h, self.lm_head(h, labels, mask)",
        # with equal loss-mask counts on every cp rank the share is the local mean itself: only a layout
        # whose cp ranks count unequal loss tokens sees it (cp2_docs_window masks the first 5 positions)
        ("tests/test_parallel_numerics.py", "-k", "cp2_docs_window")),
    Bug("compile_step_ignores_fsdp", "model hooks (compile step)", "lit_moe/strategies/parallelize.py",
        "return own_graph_breaks(module) or any(isinstance(m, FSDPModule) for m in module.modules())",
        "return own_graph_breaks(module)",
        ("tests/test_step_layouts.py", "-k", "dp2_ep2_compile")),
    # ---------------------------------------------------------------- optimizer moments (memplan)
    Bug("bf16_moments_kept_fp32", "optimizer moments", "lit_moe/optim/optimizers.py",
        "state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)",
        "state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)",
        ("tests/test_optim.py", "-k", "bf16_moments_follow")),
    Bug("bf16_moments_fp32_after_resume", "optimizer moments", "lit_moe/optim/optimizers.py",
        "state[key] = state[key].to(dtype)", "state[key] = state[key]",
        ("tests/test_optim.py", "-k", "bf16_moments_save_and_resume")),
    Bug("stored_moments_no_bias_correction", "optimizer moments", "lit_moe/optim/optimizers.py",
        "value=-lr / bias_correction1)", "value=-lr)",
        ("tests/test_optim.py", "-k", "stored_moments_in_float32")),
    # ---------------------------------------------------------------- issue 24 items 4-5 (suite helper)
    Bug("hf_names_norm_swap_lora", "key map (LoRA merge)", "lit_moe/model/names.py",
        '    ("pre_mlp_layernorm", {"huggingface": "post_attention_layernorm"}),\n',
        '    ("input_layernorm", {"huggingface": "post_attention_layernorm"}),\n'
        '    ("pre_mlp_layernorm", {"huggingface": "input_layernorm"}),\n',
        ("tests/test_run_extras.py", "-k", "convert_hf_merges")),
    Bug("eval_cp_ranks_read_apart", "evaluation under CP", "lit_moe/callbacks/evaluation.py",
        "return int(dm.dp_rank), int(dm.dp_size)",
        "return int(trainer.global_rank), int(trainer.world_size)",
        ("tests/test_context_parallel.py", "-k", "test_cli_ulysses")),
    # ---------------------------------------------------------------- LoRA under TP/EP through lit_moe fit
    Bug("lora_tp_b_grad_not_reduced", "LoRA under TP", "lit_moe/strategies/hooks.py",
        "grad_placements = tuple(Partial() if isinstance(pl, Replicate) else pl for pl in p.placements)",
        'grad_placements = tuple(Partial() if isinstance(pl, Replicate) and name != "lora_b" else pl\n'
        "                                            for pl in p.placements)",
        ("tests/test_lora_parallel.py", "-k", "tp2")),
    Bug("lora_ep_expert_grads_not_divided", "LoRA under EP (gradient division)", "lit_moe/strategies/parallelize.py",
        "experts.set_gradient_divide_factor(expert_factor or float(dims.dp_cp))",
        "experts.set_gradient_divide_factor(expert_factor or float(dims.dp_cp // dims.ep))",
        ("tests/test_lora_parallel.py", "-k", "ep2")),
    Bug("lora_sharded_base_left_trainable", "LoRA freezing", "lit_moe/lora.py",
        "        keep = is_adapter_name(name)\n",
        '        keep = is_adapter_name(name) or (name.endswith("o_proj.weight") and hasattr(p, "placements"))\n',
        ("tests/test_lora_parallel.py", "-k", "tp2")),
    Bug("eval_tp_ranks_read_apart", "evaluation under TP", "lit_moe/callbacks/evaluation.py",
        "return int(dm.dp_rank), int(dm.dp_size)",
        "return int(trainer.global_rank), int(trainer.world_size)",
        ("tests/test_lora_parallel.py", "-k", "tp2")),
    # ---------------------------------------------------------------- generation (predict), HF export at the end
    Bug("cache_position_off_by_one", "generation", "lit_moe/model/generate.py",
        "ids, positions = token[:, None], positions[:, -1:] + 1",
        "ids, positions = token[:, None], positions[:, -1:]",
        ("tests/test_predict.py", "-k", "greedy_equals")),
    Bug("left_pad_positions_from_batch_start", "generation", "lit_moe/model/generate.py",
        "    positions = token_positions(valid)\n",
        "    positions = torch.arange(valid.shape[1], device=device).expand_as(valid)\n",
        ("tests/test_predict.py", "-k", "left_padding")),
    Bug("pad_keys_visible", "generation", "lit_moe/model/generate.py",
        "return (((q >= k) & valid[:, None, :]) | (q == k))[:, None]",
        "return (q >= k)[None, None].expand(valid.shape[0], 1, -1, -1)",
        ("tests/test_predict.py", "-k", "greedy_equals")),
    Bug("cached_rope_key_unrotated", "generation (MLA cache)", "lit_moe/model/attention.py",
        "        k_pe = apply_rotary(k_pe, cos[:, :, None], sin[:, :, None], attn.use_fused_rope)\n    latent, k_pe = cache",
        "        pass\n    latent, k_pe = cache",
        ("tests/test_predict.py", "-k", "cache_holds")),
    Bug("top_p_keeps_boundary", "sampling", "lit_moe/model/generate.py",
        "sorted_probs.masked_fill(before >= top_p, 0.0)", "sorted_probs.masked_fill(before > top_p, 0.0)",
        ("tests/test_predict.py", "-k", "top_p_filter")),
    Bug("sampling_unseeded", "sampling", "lit_moe/model/generate.py",
        "generator = torch.Generator(device=device).manual_seed(seed)", "generator = None",
        ("tests/test_predict.py", "-k", "seeded")),
    Bug("tp_attention_heads_not_summed", "generation (tp)", "lit_moe/model/generate.py",
        'return attn.reduce_scatter(out) if hasattr(attn, "reduce_scatter") else out', "return out",
        ("tests/test_predict.py", "-k", "tp_and_ep")),
    Bug("tp_partial_sums_kept", "generation (tp)", "lit_moe/strategies/tensor_parallel.py",
        "            else functools.partial(comm.all_reduce, group=group))",
        "            else _whole)",
        ("tests/test_predict.py", "-k", "tp_and_ep")),
    Bug("tp_head_vocab_not_gathered", "generation (tp)", "lit_moe/strategies/tensor_parallel.py",
        "        transform_output(head, functools.partial(comm.all_gather, group=group, dim=-1))\n",
        "        pass\n",
        ("tests/test_predict.py", "-k", "tp_and_ep")),
    Bug("predict_sharded_checkpoint_not_loaded", "generation (tp/ep)", "lit_moe/tools/predict.py",
        "        load_module(model, IterationReader(find_iteration_dir(checkpoint)))", "        pass",
        ("tests/test_predict.py", "-k", "tp_and_ep")),
    Bug("export_down_proj_not_transposed", "HF export at the end", "lit_moe/model/hf.py",
        'return [(f"{prefix}.{j}.down_proj.weight", lambda t, j=j: t[j].t()) for j in range(E)]',
        'return [(f"{prefix}.{j}.down_proj.weight", lambda t, j=j: t[j]) for j in range(E)]',
        ("tests/test_checkpoint_e2e.py", "-k", "hf_export_at_the_end")),
    Bug("export_without_a_final_checkpoint", "HF export at the end", "lit_moe/checkpoint/callback.py",
        "    if not cfg.enable_save:\n        raise ConfigError(\"checkpoint.save_hf_at_end",
        "    if False:\n        raise ConfigError(\"checkpoint.save_hf_at_end",
        ("tests/test_predict.py", "-k", "save_hf_at_end")),
    Bug("export_an_earlier_iteration", "HF export at the end", "lit_moe/checkpoint/callback.py",
        "iteration_name(step))\n                export_atomically", "iteration_name(step - 1))\n                export_atomically",
        ("tests/test_checkpoint_e2e.py", "-k", "hf_export_at_the_end")),
    # ---------------------------------------------------------------- global batch ramp-up
    Bug("ramp_rounds_the_level", "batch ramp-up", "lit_moe/optim/schedules.py",
        "return min(self.start + self.increment * int(consumed_samples / per), self.global_batch_size)",
        "return min(self.start + self.increment * round(consumed_samples / per), self.global_batch_size)",
        ("tests/test_rampup.py", "-k", "hand_computed_tables or megatron")),
    Bug("ramp_samples_after_one_step_short", "batch ramp-up", "lit_moe/optim/schedules.py",
        "return before + (steps - first) * gbs", "return before + (steps - first - (steps > 3)) * gbs",
        ("tests/test_rampup.py", "-k", "replays")),
    Bug("ramp_never_advances", "batch ramp-up", "lit_moe/data/datamodule.py",
        "return self.batch_ramp.accumulation_at(consumed_samples)",
        "return self.batch_ramp.accumulation_at(0)",
        ("tests/test_rampup.py", "-k", "hand_computed_ones")),
    # a step that straddles an epoch's end reads its batch with the epoch's tail already counted
    Bug("ramp_counts_carried_micro_batches", "batch ramp-up", "lit_moe/data/datamodule.py",
        "            for _ in range(self.accumulation(consumed)):",
        "            tail = (count - k) * self.sampler.micro_batch_size * self.sampler.num_replicas\n"
        "            for _ in range(self.accumulation(consumed + tail * (count - k < self.accumulation(consumed)))):",
        ("tests/test_rampup.py", "-k", "hand_computed_ones")),
    # a resume at an epoch's tail shorter than a step (the step goes on with the next epoch): cut short
    Bug("batch_end_without_a_step_acted_on", "data sampling", "lit_moe/data/datamodule.py",
        "                if k == count:   # only the first step gets here",
        "                if k == count:\n                    break\n                if k == count:   # only the first step gets here",
        ("tests/test_rampup.py", "-k", "resume_in_the_middle")),
    Bug("step_samples_not_times_data_parallel", "data sampling", "lit_moe/data/datamodule.py",
        "self._position.consumed_samples += step_samples(batch) * self.dp_size",
        "self._position.consumed_samples += step_samples(batch)",
        ("tests/test_data_module.py", "-k", "consecutive")),
    Bug("straddling_step_rereads_its_epoch", "data sampling", "lit_moe/data/datamodule.py",
        "epoch, first, k = epoch + 1, 0, 0", "epoch, first, k = epoch, 0, 0",
        ("tests/test_data_module.py", "-k", "consecutive")),
    Bug("step_loader_length_one_long", "data sampling", "lit_moe/data/datamodule.py",
        "return n + left // self.accumulation(consumed)", "return n + left // self.accumulation(consumed) + 1",
        ("tests/test_data_module.py", "-k", "consecutive")),
    # issue 29: common.json said step x global batch (3 with dp 2, local batch 1, global batch 3; the
    # loader's position is 2), and auto-resume refused it ("cannot split evenly")
    Bug("common_json_consumed_is_step_times_global_batch", "data sampling", "lit_moe/checkpoint/callback.py",
        'facts["consumed_samples"] = dm.consumed_samples',
        'facts["consumed_samples"] = trainer.global_step * int(self.global_batch_size)',
        ("tests/test_hostile_inputs.py", "-k", "consumed_samples_are_the_loaders"), timeout=1500.0),
    Bug("step_metrics_consumed_is_step_times_global_batch", "data sampling", "lit_moe/module.py",
        "            return dm.consumed_samples",
        "            return self.trainer.global_step * self.training_config.global_batch_size",
        ("tests/test_hostile_inputs.py", "-k", "consumed_samples_are_the_loaders"), timeout=1500.0),
    # the start-of-run line counted global_batch_size x seq_length tokens a step (5 x 32 with local
    # batch 2 on one rank; a step consumes 4 samples)
    Bug("console_tokens_of_the_configured_global_batch", "data sampling", "lit_moe/callbacks/console.py",
        "samples, seq_length = shape.samples_per_step, shape.seq_length",
        "samples, seq_length = shape.global_batch_size, shape.seq_length",
        ("tests/test_hostile_inputs.py", "-k", "consumed_samples_are_the_loaders"), timeout=1500.0),
    Bug("run_shape_step_is_the_configured_global_batch", "data sampling", "lit_moe/strategies/run_shape.py",
        "return self.accumulation * self.samples_per_micro_batch", "return self.global_batch_size",
        ("tests/test_plan.py", "-k", "run_shape")),
    Bug("ramp_pipeline_keeps_its_first_schedule", "batch ramp-up", "lit_moe/pipeline/runner.py",
        "if self.runner is None or self.runner.accumulation_steps != A:", "if self.runner is None:",
        ("tests/test_rampup.py", "-k", "pp2"), timeout=1500.0),
    Bug("ramp_plan_checks_only_the_last_level", "batch ramp-up", "lit_moe/strategies/plan.py",
        "for level in ramp.levels()[:-1]:", "for level in ramp.levels()[-1:]:",
        ("tests/test_rampup.py", "-k", "plan_prints_the_ramp")),
    Bug("ramp_summary_shows_the_start", "batch ramp-up", "lit_moe/callbacks/console.py",
        "this step {shape.samples_of_step_at(consumed_samples)} ", "this step {shape.ramp.start} ",
        ("tests/test_rampup.py", "-k", "resume")),
    # ---------------------------------------------------------------- MindFormers' parallel keys (issue 31)
    Bug("dedup_weights_dropped", "EP dispatch", "lit_moe/strategies/expert_parallel.py",
        "recv_w.reshape(-1, 1).index_select(0, order).to(weights.dtype))", "None)",
        ("tests/test_parallel_numerics.py", "-k", "ep2_deredundancy")),
    Bug("dedup_round_robin_experts", "EP dispatch", "lit_moe/strategies/expert_parallel.py",
        'dest = torch.div(indices, local_experts, rounding_mode="floor")\n    if keep',
        "dest = indices % ep\n    if keep",
        ("tests/test_mindformers_keys_parallel.py", "-k", "hand_computed")),
    Bug("dedup_bytes_without_ids", "EP dispatch", "lit_moe/strategies/expert_parallel.py",
        "return hidden_bytes + top_k * (4 + 4)", "return hidden_bytes + top_k * 4",
        ("tests/test_mindformers_keys_parallel.py", "-k", "hand_computed")),
    Bug("dualpipev_looped_placement", "PP", "lit_moe/pipeline/layout.py",
        "return self.pp - 1 - r if self.schedule in V_SHAPED and chunk % 2 else r",
        'return self.pp - 1 - r if self.schedule == "zbv" and chunk % 2 else r',
        ("tests/test_pipeline.py", "-k", "test_schedules")),
    Bug("dualpipev_too_few_microbatches", "PP", "lit_moe/pipeline/layout.py",
        'else self.num_stages if self.schedule == "dualpipev" else P', "else P",
        ("tests/test_pipeline.py", "-k", "test_schedules")),
    Bug("dualpipev_runs_zbv", "PP", "lit_moe/pipeline/layout.py",
        '"dualpipev": pl.ScheduleDualPipeV}[name]', '"dualpipev": pl.ScheduleZBVZeroBubble}[name]',
        ("tests/test_pipeline.py", "-k", "layout_matches and dualpipev")),
    Bug("v_shape_mtp_always_refused", "PP", "lit_moe/pipeline/layout.py",
        "if mtp and last > 0 and stage_ranks > 1 and layout.rank_of(0)",
        "if mtp and last > 0 and layout.rank_of(0)",
        ("tests/test_pipeline.py", "-k", "v_shape")),
    Bug("no_effect_note_for_defaults", "config", "lit_moe/config.py",
        "if value is not None and value != default:", "if value is not None and value:",
        ("tests/test_mindformers_keys_parallel.py", "-k", "no_effect_notes")),
    Bug("no_effect_notes_not_printed", "config", "lit_moe/cli.py",
        '"context": build_section(ContextConfig, context, "context")}, cfg):\n        print_note(line)',
        '"context": build_section(ContextConfig, context, "context")}, cfg):\n        pass',
        ("tests/test_mindformers_keys_parallel.py", "-k", "fit_prints")),
    Bug("profile_cpu_ignored", "profiler", "lit_moe/callbacks/profiler.py",
        "return ([cpu] if profile_cpu or device is None else [])", "return ([cpu])",
        ("tests/test_mindformers_keys_parallel.py", "-k", "profile_cpu")),
    # ---------------------------------------------------------------- plan: per-rank peak (memplan)
    Bug("plan_headline_first_rank", "plan memory", "lit_moe/strategies/memory_plan.py",
        "return max(rows, key=lambda r: r.total)", "return rows[0]",
        ("tests/test_memory_plan.py", "-k", "sum_of_its_parts")),
    Bug("plan_recomputed_layer_not_rematerialised", "plan memory", "lit_moe/strategies/memory_plan.py",
        'return [transient + row["bytes"] + (head', 'return [row["bytes"] + (head',
        ("tests/test_memory_plan.py", "-k", "sum_of_its_parts")),
    Bug("plan_gb_is_gib", "plan memory", "lit_moe/strategies/memory_plan.py",
        '"gb": 1000 ** 3', '"gb": 1024 ** 3', ("tests/test_memory_plan.py", "-k", "sizes_and_names")),
    Bug("plan_fits_with_an_alternative_that_does_not", "plan memory", "lit_moe/strategies/memory_plan.py",
        "        if peak.total <= have:\n", "        if peak.total <= 2 * have:\n",
        ("tests/test_memory_plan.py", "-k", "first_change_that_fits")),
    # ---------------------------------------------------------------- Muon keys, QK-clip (issue 31)
    Bug("ns_schedule_first_triple_only", "Muon", "lit_moe/optim/optimizers.py",
        "    for a, b, c in schedule:\n",
        "    for a, b, c in schedule[:1] * len(schedule):\n",
        ("tests/test_muon_clip.py", "-k", "per_step_schedule or schedule_and_matched")),
    Bug("ns_segment_count_ignored", "Muon", "lit_moe/optim/optimizers.py",
        "steps.extend([abc] * count)", "steps.extend([abc])",
        ("tests/test_muon_clip.py", "-k", "ns_coefficients_forms")),
    Bug("matched_adamw_rms_fixed", "Muon", "lit_moe/optim/optimizers.py",
        'return group["matched_adamw_rms"] * max(shape[0], shape[1]) ** 0.5',
        'return 0.2 * max(shape[0], shape[1]) ** 0.5',
        ("tests/test_muon_clip.py", "-k", "schedule_and_matched")),
    Bug("qk_clip_rope_rows_sqrt", "QK-clip", "lit_moe/optim/qk_clip.py",
        "[(nope, 0.5), (rope, 1.0)]", "[(nope, 0.5), (rope, 0.5)]",
        ("tests/test_muon_clip.py", "-k", "clip_to_the_threshold or clips_after")),
    Bug("qk_clip_keys_unscaled", "QK-clip", "lit_moe/optim/qk_clip.py",
        "[(nope, 0.5), (v, 0.0)]", "[(nope, 0.0), (v, 0.0)]",
        ("tests/test_muon_clip.py", "-k", "clip_to_the_threshold or clips_after")),
    Bug("qk_logits_unscaled", "QK-clip", "lit_moe/model/attention.py",
        "k[:, h].float().transpose(-1, -2)) * self.scale", "k[:, h].float().transpose(-1, -2))",
        ("tests/test_muon_clip.py", "-k", "clip_to_the_threshold")),
    Bug("qk_clip_not_applied", "QK-clip", "lit_moe/optim/optimizers.py",
        "            self.qk_clip.apply()\n", "            pass\n",
        ("tests/test_muon_clip.py", "-k", "clips_after")),
    Bug("qk_clip_maxima_not_reduced", "QK-clip", "lit_moe/optim/qk_clip.py",
        "torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX)", "pass",
        ("tests/test_muon_clip.py", "-k", "data_parallel")),
    Bug("qk_clip_tp_not_refused", "QK-clip", "lit_moe/optim/qk_clip.py",
        "if getattr(dims, name, 1) > 1:", "if getattr(dims, name, 1) > 2:",
        ("tests/test_muon_clip.py", "-k", "refused")),
    Bug("chunk_loss_num_silent", "MindFormers keys", "lit_moe/model/config_parsing.py",
        "                    note_loss_and_embedding_key(key, value)\n", "                    pass\n",
        ("tests/test_mindformers_keys.py", "-k", "no_effect or bad_values")),
    Bug("tensorboard_queue_size_dropped", "MindFormers keys", "lit_moe/callbacks/loggers.py",
        "default_hp_metric=False, max_queue=queue)", "default_hp_metric=False, max_queue=1000)",
        ("tests/test_mindformers_keys.py", "-k", "queue_size")),
    # ---------------------------------------------------------------- DeepSeek-V4 (tests/test_family_v4.py)
    Bug("v4_hash_table_ignored", "DeepSeek-V4", "lit_moe/model/moe.py",
        "indices = self.tid2eid[input_ids.reshape(-1)]",
        "indices = self.select(scores.detach())",
        ("tests/test_family_v4.py", "-k", "logits_match")),
    Bug("v4_mhc_comb_not_transposed", "DeepSeek-V4", "lit_moe/model/hyper_connections.py",
        "comb.to(dtype).transpose(-1, -2) @ streams",
        "comb.to(dtype) @ streams",
        ("tests/test_family_v4.py", "-k", "logits_match")),
    Bug("v4_mhc_post_not_doubled", "DeepSeek-V4", "lit_moe/model/hyper_connections.py",
        "post = 2 * torch.sigmoid(post * self.scale[1] + post_b)",
        "post = torch.sigmoid(post * self.scale[1] + post_b)",
        ("tests/test_family_v4.py", "-k", "logits_match")),
    Bug("v4_attention_sink_dropped", "DeepSeek-V4", "lit_moe/model/v4_attention.py",
        "probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]",
        "probs = torch.softmax(logits, dim=-1)",
        ("tests/test_family_v4.py", "-k", "logits_match")),
    Bug("v4_output_rotation_kept", "DeepSeek-V4", "lit_moe/model/v4_attention.py",
        "out = rotate_trailing(out, cos[:, :, None], -sin[:, :, None])",
        "out = out",
        ("tests/test_family_v4.py", "-k", "logits_match")),
    Bug("v4_window_one_too_wide", "DeepSeek-V4", "lit_moe/model/v4_attention.py",
        "(q - k < self.window)",
        "(q - k <= self.window)",
        ("tests/test_family_v4.py", "-k", "logits_match")),
    Bug("v4_compressed_entry_leaks_future", "DeepSeek-V4", "lit_moe/model/v4_attention.py",
        "return w < ((position_ids + 1) // rate)[..., None]",
        "return w <= ((position_ids + 1) // rate)[..., None]",
        ("tests/test_family_v4.py", "-k", "logits_match")),
    Bug("v4_indexer_choice_ignored", "DeepSeek-V4", "lit_moe/model/v4_attention.py",
        "return picked & visible",
        "return visible",
        ("tests/test_family_v4.py", "-k", "logits_match")),
    Bug("v4_swiglu_gate_not_clamped", "DeepSeek-V4", "lit_moe/ops/activation.py",
        "self._act(gate.clamp(max=self.clamp), allow_inplace=False)",
        "self._act(gate, allow_inplace=False)",
        ("tests/test_family_v4.py", "-k", "logits_match")),
    Bug("v4_hf_gate_up_swapped", "DeepSeek-V4", "lit_moe/model/hf_v4.py",
        r'(r"\.(experts\.\d+|shared_experts)\.gate_proj\.", r".\1.w1."),',
        r'(r"\.(experts\.\d+|shared_experts)\.gate_proj\.", r".\1.w3."),',
        ("tests/test_family_v4.py", "-k", "logits_match")),
    # ---------------------------------------------------------------- families (Qwen3-MoE, GLM-4-MoE)
    Bug("gqa_qk_norm_skipped", "families", "lit_moe/model/gqa.py",
        "q = self.q_norm(self.q_proj(x).view(B, S, -1, self.head_dim))",
        "q = self.q_proj(x).view(B, S, -1, self.head_dim)",
        ("tests/test_families.py", "-k", "logits_match")),
    Bug("gqa_kv_heads_tiled", "families", "lit_moe/model/gqa.py",
        "k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)",
        "k, v = k.repeat(1, 1, group, 1), v.repeat(1, 1, group, 1)",
        ("tests/test_families.py", "-k", "logits_match")),
    Bug("softmax_topk_not_renormalised", "families", "lit_moe/model/moe.py",
        "        if self.norm_topk_prob:\n            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)",
        "        if self.norm_topk_prob and self.scoring_func == \"sigmoid\":\n"
        "            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)",
        ("tests/test_families.py", "-k", "logits_match and qwen3")),
    Bug("partial_rotary_wrong_half", "families", "lit_moe/ops/rotary.py",
        "rot, rest = x[..., :2 * half].to(cos.dtype), x[..., 2 * half:]",
        "rot, rest = x[..., x.shape[-1] - 2 * half:].to(cos.dtype), x[..., :x.shape[-1] - 2 * half]",
        ("tests/test_families.py", "-k", "logits_match and glm4")),
    Bug("qkv_bias_ignored", "families", "lit_moe/ops/linear.py",
        "return F.linear(x, self.weight.to(x.dtype), self.bias.to(x.dtype))",
        "return F.linear(x, self.weight.to(x.dtype))",
        ("tests/test_families.py", "-k", "logits_match and glm4")),
    Bug("qwen3_exports_expert_bias", "families", "lit_moe/model/hf_families.py",
        'NO_EXPERT_BIAS = ("qwen3_moe",)', "NO_EXPERT_BIAS = ()",
        ("tests/test_families.py", "-k", "logits_match and qwen3")),
    Bug("glm4_use_qk_norm_unmapped", "families", "lit_moe/model/hf_families.py",
        '_GLM4_KEYS = {"use_qk_norm": "qk_layernorm"}', "_GLM4_KEYS = {}",
        ("tests/test_families.py", "-k", "written_by_transformers")),
    Bug("qwen3_convert_without_qk_norm", "families", "lit_moe/tools/convert_config.py",
        'model["qk_layernorm"] = True', 'model["qk_layernorm"] = False',
        ("tests/test_convert_families.py", "-k", "qwen3")),
    Bug("gbs_aux_loss_per_sequence", "families", "lit_moe/tools/convert_config.py",
        '"gbs_aux_loss": ("aux_loss",', '"gbs_aux_loss": ("seq_aux_loss",',
        ("tests/test_convert_families.py", "-k", "qwen3")),
    Bug("lora_drops_qkv_bias", "families", "lit_moe/lora.py",
        "        new.bias = base.bias   # GQA's q/k/v biases (None elsewhere)\n", "",
        ("tests/test_families.py", "-k", "lora")),
    Bug("family_gets_deepseek_mindformers_defaults", "families", "lit_moe/model/mindformers_defaults.py",
        "    if deepseek:\n        for field in FILLED:", "    if True:\n        for field in FILLED:",
        ("tests/test_convert_families.py", "-k", "qwen3")),
    # ---------------------------------------------------------------- DeepSeek-V3.2 (the lightning indexer)
    # (a missing score scale cannot be planted: a positive factor on every score keeps the top-k ranking)
    Bug("v32_topk_over_queries", "families", "lit_moe/model/indexer.py",
        "chosen = scores.topk(min(self.topk, scores.shape[-1]), dim=-1).indices",
        "chosen = scores.topk(min(self.topk, scores.shape[-1]), dim=-2).indices",
        ("tests/test_deepseek_v32.py", "-k", "logits_match")),
    Bug("v32_relu_dropped", "families", "lit_moe/model/indexer.py",
        "out += weights[:, :, h, None] * F.relu(torch.bmm(q[:, :, h], k_t) * self.scale)",
        "out += weights[:, :, h, None] * (torch.bmm(q[:, :, h], k_t) * self.scale)",
        ("tests/test_deepseek_v32.py", "-k", "logits_match")),
    Bug("v32_head_weights_dropped", "families", "lit_moe/model/indexer.py",
        "out += weights[:, :, h, None] * F.relu(", "out += F.relu(",
        ("tests/test_deepseek_v32.py", "-k", "logits_match")),
    Bug("v32_future_keys_compete", "families", "lit_moe/model/indexer.py",
        '.masked_fill(~allowed[:, 0], float("-inf"))', "",
        ("tests/test_deepseek_v32.py", "-k", "logits_match")),
    Bug("v32_indexer_key_turned_back", "families", "lit_moe/model/indexer.py",
        "k = apply_rotary_half(k, cos, sin, self.use_fused_rope)",
        "k = apply_rotary_half(k, cos, -sin, self.use_fused_rope)",
        ("tests/test_deepseek_v32.py", "-k", "logits_match")),
    Bug("v32_exported_as_v3", "families", "lit_moe/model/hf.py",
        "    if c.sparse_attention:\n        d = hf_families.sparse_mla_config_dict(d, c)",
        "    if False:\n        d = hf_families.sparse_mla_config_dict(d, c)",
        ("tests/test_deepseek_v32.py", "-k", "logits_match")),
    # ulysses / hybrid context parallel: DeepSeek-V3.2 and V4 run them (the layouts below); V4 not async
    Bug("v32_v4_ulysses_refused", "families", "lit_moe/strategies/parallel_dims.py",
        'if degree > 1 and variant == "dsv4_hybrid" and p.context_parallel_async:',
        'if degree > 1 and variant in ("dsa", "dsv4_hybrid"):',
        ("tests/test_deepseek_v32.py", "tests/test_family_v4.py", "-k",
         "context_parallel or family_defaults_and_rules")),
    Bug("v4_async_ulysses_accepted", "families", "lit_moe/strategies/parallel_dims.py",
        'if degree > 1 and variant == "dsv4_hybrid" and p.context_parallel_async:', "if False:",
        ("tests/test_family_v4.py", "-k", "family_defaults_and_rules")),
    Bug("v32_mindformers_indexer_name", "families", "lit_moe/model/names.py",
        '("weights_proj", "linear_weights_proj")', '("weights_proj", "weights_proj")',
        ("tests/test_deepseek_v32.py", "-k", "recompute")),
    Bug("v32_indexer_params_uncounted", "families", "lit_moe/model/sizing.py",
        "return q + kv + n * c.v_head_dim * h + _indexer_params(c)", "return q + kv + n * c.v_head_dim * h",
        ("tests/test_deepseek_v32.py", "-k", "sizing")),
    # DeepSeek-V3.2's indexer loss (dsa_indexer_loss_coeff): the formula, its gradient's reach, the layouts
    Bug("v32_loss_target_not_detached", "families (indexer loss)", "lit_moe/model/indexer.py",
        "    query, key = query.detach(), key.detach()\n", "",
        ("tests/test_deepseek_v32.py", "-k", "trains_the_indexers_only")),
    Bug("v32_loss_indexer_input_not_detached", "families (indexer loss)", "lit_moe/model/attention.py",
        "self.indexer(x.detach(), q_latent.detach(),", "self.indexer(x, q_latent,",
        ("tests/test_deepseek_v32.py", "-k", "trains_the_indexers_only")),
    Bug("v32_loss_softmax_over_all_keys", "families (indexer loss)", "lit_moe/model/indexer.py",
        "torch.log_softmax(scores.masked_fill(~sel, torch.finfo(scores.dtype).min), dim=-1)",
        "torch.log_softmax(scores, dim=-1)",
        ("tests/test_deepseek_v32.py", "-k", "matches_the_formula")),
    Bug("v32_loss_target_not_renormalised", "families (indexer loss)", "lit_moe/model/indexer.py",
        "    return total / total.sum(-1, keepdim=True).clamp_min(1e-30)", "    return total",
        ("tests/test_deepseek_v32.py", "-k", "matches_the_formula")),
    Bug("v32_loss_coefficient_ignored", "families (indexer loss)", "lit_moe/model/attention.py",
        "self.indexer.loss = self.indexer.loss_coeff * indexer_kl_loss(", "self.indexer.loss = indexer_kl_loss(",
        ("tests/test_deepseek_v32.py", "-k", "matches_the_formula")),
    Bug("v32_loss_summed_over_tokens", "families (indexer loss)", "lit_moe/model/indexer.py",
        "    return kl.mean()", "    return kl.sum()",
        ("tests/test_deepseek_v32.py", "-k", "matches_the_formula")),
    Bug("v32_loss_mtp_indexers_left_out", "families (indexer loss)", "lit_moe/model/transformer.py",
        "self._indexers = [m for m in self.modules() if isinstance(m, LightningIndexer)]",
        "self._indexers = [m for m in self.layers.modules() if isinstance(m, LightningIndexer)]",
        ("tests/test_deepseek_v32.py", "-k", "trains_the_indexers_only")),
    Bug("v32_loss_not_logged", "families (indexer loss)", "lit_moe/module.py",
        "                self._has_indexer = True\n", "",
        ("tests/test_deepseek_v32.py", "-k", "training_moves")),
    Bug("v32_loss_not_in_objective", "families (indexer loss)", "lit_moe/module.py",
        "                objective = objective + indexer\n", "",
        ("tests/test_step_layouts.py", "-k", "v32_loss_dp2_ep2")),
    # ... under pipeline parallel: a stage's indexer losses reach the backward (the first's through its
    # output hidden state, the last's at its loss output) and the step's log
    Bug("v32_loss_under_ulysses_accepted", "CP (DeepSeek-V3.2 indexer loss)", "lit_moe/strategies/parallel_dims.py",
        "        if degree > 1 and getattr(model_config, \"dsa_indexer_loss_coeff\", None):",
        "        if False:", ("tests/test_deepseek_v32.py", "-k", "every_context_parallel_method")),
    Bug("v32_pp_first_stage_indexer_loss_dropped", "PP (DeepSeek-V3.2 indexer loss)", "lit_moe/pipeline/stage.py",
        "                for term in (aux, indexer):", "                for term in (aux,):",
        ("tests/test_pipeline.py", "-k", "pp2_v32_loss_mtp")),
    Bug("v32_pp_last_stage_indexer_grad_dropped", "PP (DeepSeek-V3.2 indexer loss)", "lit_moe/pipeline/stage.py",
        "            losses = AuxLossBackward.apply(losses, indexer, self.aux_grad_scale)", "            pass",
        ("tests/test_pipeline.py", "-k", "pp2_v32_loss_mtp")),
    Bug("v32_pp_indexer_loss_not_logged", "PP (DeepSeek-V3.2 indexer loss)", "lit_moe/pipeline/runner.py",
        "                vec[:4] += s.to(device)", "                vec[:3] += s[:3].to(device)",
        ("tests/test_pipeline.py", "-k", "pp2_v32_loss_mtp")),
    # ... under tensor parallel: the target sums every rank's heads; the replicated indexer's gradient is whole
    Bug("v32_loss_tp_target_not_reduced", "TP (DeepSeek-V3.2 indexer loss)", "lit_moe/strategies/tensor_parallel.py",
        "    model.hooks.head_sum = functools.partial(_head_sum, group=tp_mesh.get_group())\n", "",
        ("tests/test_step_layouts.py", "-k", "v32_loss_tp2")),
    Bug("v32_loss_tp_indexer_grads_partial", "TP (DeepSeek-V3.2 indexer loss)", "lit_moe/strategies/tensor_parallel.py",
        "use_local_params(module, partial_replicated_grads=False)", "use_local_params(module)",
        ("tests/test_step_layouts.py", "-k", "v32_loss_tp2")),
    # ... under context parallel: each rank's queries over the gathered keys, the mean over the rows
    Bug("v32_loss_cp_mean_over_keys", "CP (DeepSeek-V3.2 indexer loss)", "lit_moe/model/indexer.py",
        "    return kl.mean()", "    return kl.sum() / (kl.shape[0] * scores.shape[-1])",
        ("tests/test_step_layouts.py", "-k", "v32_loss_cp2")),
    Bug("v32_loss_cp_key_grads_dropped", "CP (DeepSeek-V3.2 indexer loss)", "lit_moe/strategies/context_parallel.py",
        "    keys = _in_sequence_order(comm.all_gather(k, group, dim=1), shard.size)",
        "    keys = _in_sequence_order(comm.all_gather(k.detach(), group, dim=1), shard.size)",
        ("tests/test_step_layouts.py", "-k", "v32_loss_cp2")),
    # ... generation: the indexer's key cache (each new query's top-k among every token's keys)
    Bug("v32_predict_stale_index_key", "predict (DeepSeek-V3.2)", "lit_moe/model/attention.py",
        "            k = torch.cat([self.index_keys[layer], k], dim=1)",
        "            k = torch.cat([self.index_keys[layer], self.index_keys[layer][:, -1:]], dim=1)",
        ("tests/test_predict.py", "-k", "dsa_cache")),
    Bug("v32_predict_selection_dropped", "predict (DeepSeek-V3.2)", "lit_moe/model/attention.py",
        "        allowed = attn.indexer.select(attn.indexer.scores(x, q_latent, cos, sin, index_keys), allowed)",
        "        attn.indexer.select(attn.indexer.scores(x, q_latent, cos, sin, index_keys), allowed)",
        ("tests/test_predict.py", "-k", "dsa_cache")),
    Bug("predict_window_accepted", "predict (refusals)", "lit_moe/tools/predict.py",
        "    if config.window_size is not None:\n", "    if False:\n",
        ("tests/test_predict.py", "-k", "refuses_a_sliding_window")),
    # ... grouped-query attention's key/value cache (Qwen3-MoE, GLM-4-MoE)
    Bug("gqa_predict_cache_written_first", "predict (GQA)", "lit_moe/model/generate.py",
        "    k, v = cache.extend(attn.layer_idx, k, v)                    # [B, T, kv_heads, d]\n",
        "    k, v = (torch.cat([t[:, -S:], t[:, :-S]], dim=1) for t in cache.extend(attn.layer_idx, k, v))\n",
        ("tests/test_predict.py", "-k", "gqa_greedy")),
    Bug("gqa_predict_key_cached_before_qk_norm", "predict (GQA)", "lit_moe/model/generate.py",
        "    k = attn.k_norm(attn.k_proj(x).view(B, S, -1, attn.head_dim))\n"
        "    v = attn.v_proj(x).view(B, S, -1, attn.head_dim)\n"
        "    if attn.use_rope:\n"
        "        q = apply_rotary_half(q, cos[:, :, None], sin[:, :, None], attn.use_fused_rope)\n"
        "        k = apply_rotary_half(k, cos[:, :, None], sin[:, :, None], attn.use_fused_rope)\n"
        "    k, v = cache.extend(attn.layer_idx, k, v)                    # [B, T, kv_heads, d]\n",
        "    k = attn.k_proj(x).view(B, S, -1, attn.head_dim)\n"
        "    v = attn.v_proj(x).view(B, S, -1, attn.head_dim)\n"
        "    if attn.use_rope:\n"
        "        q = apply_rotary_half(q, cos[:, :, None], sin[:, :, None], attn.use_fused_rope)\n"
        "        k = apply_rotary_half(k, cos[:, :, None], sin[:, :, None], attn.use_fused_rope)\n"
        "    k, v = cache.extend(attn.layer_idx, k, v)\n"
        "    k = attn.k_norm(k)\n",
        ("tests/test_predict.py", "-k", "gqa_cache or gqa_greedy")),
    Bug("gqa_predict_rotary_offset_missing", "predict (GQA)", "lit_moe/model/generate.py",
        "        cos, sin = rotary_cos_sin(config, positions)\n",
        "        cos, sin = rotary_cos_sin(config, torch.arange(ids.shape[1], device=ids.device).expand_as(ids))\n",
        ("tests/test_predict.py", "-k", "gqa_cache or gqa_greedy")),
    # ---------------------------------------------------------------- plan: TP's sequence split, selective recompute
    Bug("plan_sequence_split_ignored", "plan memory", "lit_moe/strategies/activation_memory.py",
        '    T, H, Tl = tokens, c.hidden_size, tokens // tp\n    a = _bytes(c.torch_dtype("compute_dtype"))\n'
        '    f = _bytes(c.torch_dtype("layernorm_compute_dtype"))\n',
        '    T, H, Tl = tokens, c.hidden_size, tokens\n    a = _bytes(c.torch_dtype("compute_dtype"))\n'
        '    f = _bytes(c.torch_dtype("layernorm_compute_dtype"))\n',
        ("tests/test_memory_plan.py", "-k", "by_hand")),
    Bug("plan_tp_degree_not_passed", "plan memory", "lit_moe/strategies/memory_plan.py",
        "tp=dims.tp, core_attention=core_attention,", "tp=1, core_attention=core_attention,",
        ("tests/test_memory_plan.py", "-k", "by_hand")),
    Bug("plan_loss_transient_omitted", "plan memory", "lit_moe/strategies/memory_plan.py",
        "head = head_transient_bytes(model_config, tokens, dims.tp)", "head = 0",
        ("tests/test_memory_plan.py", "-k", "by_hand")),
    Bug("plan_selected_module_not_subtracted", "plan memory", "lit_moe/strategies/activation_memory.py",
        "        kept = [row for row in kept if not _under(row[0], path)]\n", "",
        ("tests/test_memory_plan.py", "-k", "selective")),
    Bug("plan_checkpoint_inputs_not_kept", "plan memory", "lit_moe/strategies/activation_memory.py",
        "        kept = [row for row in kept if not _under(row[0], path)]\n        kept += [",
        "        kept = [row for row in kept if not _under(row[0], path)]\n        kept += [] and [",
        ("tests/test_memory_plan.py", "-k", "selective")),
    Bug("plan_selection_not_resolved", "plan memory", "lit_moe/strategies/memory_plan.py",
        "        if checkpointed or output_recomputed:\n            out[i] =",
        "        if False:\n            out[i] =",
        ("tests/test_memory_plan.py", "-k", "tp2_fit")),
    Bug("plan_activations_doubled", "plan memory", "lit_moe/strategies/memory_plan.py",
        "saved = model_activation_bytes(model_config, tokens,", "saved = 2 * model_activation_bytes(model_config, tokens,",
        ("tests/test_memory_plan.py", "-k", "measured_fit")),
    # ---------------------------------------------------------------- plan: every family's layer (issue 30)
    Bug("plan_gqa_counted_as_mla", "plan memory (families)", "lit_moe/strategies/activation_memory.py",
        "    if c.multi_latent_attention:\n        _mla_saved(", "    if True:\n        _mla_saved(",
        ("tests/test_memory_plan.py", "-k", "every_family")),
    Bug("plan_kv_heads_as_attention_heads", "plan memory (families)", "lit_moe/strategies/activation_memory.py",
        "    kv = max(n * c.kv_heads // c.num_attention_heads, 1)\n    att, core =",
        "    kv = n\n    att, core =",
        ("tests/test_memory_plan.py", "-k", "every_family")),
    Bug("plan_indexer_tensors_omitted", "plan memory (families)", "lit_moe/strategies/activation_memory.py",
        "    if c.sparse_attention and (c.dsa_indexer_loss_coeff or 0) > 0:",
        "    if False:",
        ("tests/test_memory_plan.py", "-k", "every_family")),
    Bug("plan_softmax_router_renormalised", "plan memory (families)", "lit_moe/strategies/activation_memory.py",
        "        if c.norm_topk_prob:\n            router +=", "        if True:\n            router +=",
        ("tests/test_memory_plan.py", "-k", "every_family")),
    Bug("plan_gqa_rotary_angles_full_head", "plan memory (families)", "lit_moe/strategies/activation_memory.py",
        "    return 2 * tokens * (config.rotary_dim // 2) *",
        "    return 2 * tokens * (config.qk_rope_head_dim // 2) *",
        ("tests/test_memory_plan.py", "-k", "every_family")),
    Bug("plan_routed_only_input_kept", "plan memory (families)", "lit_moe/strategies/activation_memory.py",
        "or c.n_shared_experts > 0 or rb == a:", "or True:",
        ("tests/test_memory_plan.py", "-k", "every_family")),
    Bug("plan_gqa_math_probabilities_once", "plan memory (families)", "lit_moe/strategies/activation_memory.py",
        '        add(core, "probs_v", batch * n * seq * seq * a)\n', "",
        ("tests/test_memory_plan.py", "-k", "every_family")),
    Bug("plan_gqa_norm_inputs_not_kept", "plan memory (families)", "lit_moe/strategies/activation_memory.py",
        '"self_attention.q_norm": [("q_proj", T * n * d * a)],', '"self_attention.q_norm": [],',
        ("tests/test_memory_plan.py", "-k", "grouped_query")),
    Bug("plan_gqa_weight_grads_as_mla", "plan memory (families)", "lit_moe/strategies/activation_memory.py",
        "    if not c.multi_latent_attention:                      # grouped-query attention\n",
        "    if False:\n",
        ("tests/test_plan.py", "-k", "split_backward and gqa")),
    Bug("plan_v4_counted_as_mla", "plan memory (families)", "lit_moe/strategies/activation_memory.py",
        '    if getattr(config, "v4_attention", False) or getattr(config, "enable_hyper_connections", False):\n'
        "        return (",
        "    if False:\n        return (",
        ("tests/test_memory_plan.py", "-k", "deepseek_v4")),
    # ---------------------------------------------------------------- ZeRO-1 (data_parallel_shard_strategy: optim)
    Bug("zero1_sync_every_microbatch", "ZeRO-1", "lit_moe/strategies/strategy.py",
        "if self.parallelism.gradient_sync_every_microbatch and not zero1:",
        "if self.parallelism.gradient_sync_every_microbatch:",
        ("tests/test_step_layouts.py", "-k", "dp2_a2_zero1")),
    Bug("zero1_reshard_after_backward", "ZeRO-1", "lit_moe/strategies/strategy.py",
        "module.set_reshard_after_backward(enabled, recurse=False)",
        "module.set_reshard_after_backward(True, recurse=False)",
        ("tests/test_step_layouts.py", "-k", "dp2_a2_zero1")),
    Bug("zero1_reshard_after_forward", "ZeRO-1", "lit_moe/strategies/parallel_dims.py",
        'return p.data_parallel_shard_strategy == "optim_grads_params"',
        'return p.data_parallel_shard_strategy != "optim_grads"',
        ("tests/test_step_layouts.py", "-k", "dp2_a2_zero1")),
    Bug("zero1_plan_gradients_sharded", "ZeRO-1", "lit_moe/strategies/memory_plan.py",
        'return mem["params"] + mem["gathered_params"], mem["unsharded_grads"], mem["optimizer"]',
        'return mem["params"] + mem["gathered_params"], mem["grads"], mem["optimizer"]',
        ("tests/test_memory_plan.py", "-k", "zero1")),
    Bug("zero1_plan_optimizer_not_sharded", "ZeRO-1", "lit_moe/strategies/memory_plan.py",
        'return mem["params"] + mem["gathered_params"], mem["unsharded_grads"], mem["optimizer"]',
        'return (mem["params"] + mem["gathered_params"], mem["unsharded_grads"],\n'
        '                mem["optimizer"] * mem["unsharded_grads"] // max(mem["grads"], 1))',
        ("tests/test_memory_plan.py", "-k", "zero1")),
    # ---------------------------------------------------------------- the pipeline behind StepStrategy
    Bug("pp_embedding_norm_wrong_stage", "PP (strategy interface)", "lit_moe/pipeline/runner.py",
        "weight = c.embed_tokens.weight if c.is_first and c.embed_tokens is not None else None",
        "weight = c.embed_tokens.weight if c.is_last and c.embed_tokens is not None else None",
        ("tests/test_pipeline.py", "-k", "layout_matches and pp2_recompute")),
    Bug("pp_embedding_norm_counted_twice", "PP (strategy interface)", "lit_moe/pipeline/runner.py",
        "weight = c.embed_tokens.weight if c.is_first and c.embed_tokens is not None else None",
        "weight = c.embed_tokens.weight if (c.is_first or c.is_last) and c.embed_tokens is not None else None",
        ("tests/test_pipeline.py", "-k", "layout_matches and pp2_mtp and not compile")),
    Bug("pp_moe_stats_not_gathered", "PP (strategy interface)", "lit_moe/strategies/strategy.py",
        "        if self.pipeline is None:\n            return moe\n",
        "        if True:\n            return moe\n",
        ("tests/test_pipeline.py", "-k", "layout_matches and pp4")),
    Bug("pp_eval_on_this_stage_only", "PP (strategy interface)", "lit_moe/strategies/strategy.py",
        "        if self.pipeline is not None:\n            return self.pipeline.evaluate(list(micro_batches))\n",
        "",
        ("tests/test_pipeline.py", "-k", "layout_matches and pp2_mtp and not compile")),
    Bug("pp_rank_claims_whole_model", "PP (strategy interface)", "lit_moe/strategies/strategy.py",
        "        return self.pipeline is None\n", "        return True\n",
        ("tests/test_pipeline.py", "-k", "fit_and_resume"), 2400.0),
    Bug("pp_stage_with_mtp_embeds_its_input", "PP (stage forward)", "lit_moe/pipeline/stage.py",
        "hidden_states=None if self.is_first else x)",
        "hidden_states=None if self.embed_tokens is not None else x)",
        ("tests/test_pipeline.py", "-k", "layout_matches and pp2_mtp and not compile")),
    Bug("model_part_embeds_given_hidden_states", "model (parts)", "lit_moe/model/transformer.py",
        "        if hidden_states is None:\n            if self.embed_tokens is None:",
        "        if hidden_states is None or self.embed_tokens is not None:\n            if self.embed_tokens is None:",
        ("tests/test_pipeline.py", "-k", "runs_in_parts")),
    Bug("model_part_drops_its_aux_loss", "model (parts)", "lit_moe/model/transformer.py",
        "hidden_states=h, aux_loss=self._take_aux(self._main_moe),", "hidden_states=h, aux_loss=None,",
        ("tests/test_pipeline.py", "-k", "runs_in_parts")),
    Bug("pp_last_stage_without_mtp_embedding", "PP (stage membership)", "lit_moe/pipeline/layout.py",
        "embedding=first or (last and has_mtp))", "embedding=first)",
        ("tests/test_pipeline.py", "-k", "layout_matches and pp2_mtp and not compile")),
    Bug("pp_planner_puts_head_on_first_stage", "PP (stage membership)", "lit_moe/pipeline/layout.py",
        "            return self.embedding\n        return self.last\n",
        "            return self.embedding\n        return self.first\n",
        ("tests/test_pipeline.py", "-k", "planner_counts")),
]


def _copy_repo(dest: Path) -> None:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    for rel in listed:
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def check_table(bugs: list[Bug], root: Path = ROOT) -> list[str]:
    """Problems with the table: names twice, `old` text missing or not unique."""
    problems, names = [], set()
    for b in bugs:
        if b.name in names:
            problems.append(f"{b.name}: name used twice")
        names.add(b.name)
        text = (root / b.file).read_text()
        n = text.count(b.old)
        if n != 1:
            problems.append(f"{b.name}: the old text occurs {n} times in {b.file} (must be exactly once)")
    return problems


def plant_and_run(bug: Bug, copy: Path) -> tuple[str, float, str]:
    path = copy / bug.file
    original = path.read_text()
    path.write_text(original.replace(bug.old, bug.new))
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *bug.tests],
                              cwd=copy, env=env, capture_output=True, text=True, timeout=bug.timeout)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()
        outcome = {0: "SURVIVED", 1: "caught"}.get(rc, f"error (pytest exit {rc})")
        failed = [ln for ln in tail if ln.startswith(("FAILED", "ERROR"))]
        detail = failed[0] if failed else (tail[-1] if tail else "")
    except subprocess.TimeoutExpired:
        outcome, detail = "timeout", f"after {bug.timeout:.0f} s"
    finally:
        path.write_text(original)
    return outcome, time.monotonic() - start, detail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="only these bugs (default: all)")
    ap.add_argument("--check", action="store_true", help="only check that every `old` text exists exactly once")
    ap.add_argument("--list", action="store_true", help="list the bugs and exit")
    ap.add_argument("--markdown", type=Path, help="also write the report as a Markdown table here")
    args = ap.parse_args(argv)
    problems = check_table([b for b in BUGS if not args.names or b.name in args.names])   # named: only those
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    if args.check or args.list:
        for b in BUGS if args.list else []:
            print(f"{b.name:32s} {b.area:22s} {b.file}")
        print(f"{len(BUGS)} planted bugs, every old text found exactly once")
        return 0
    unknown = set(args.names) - {b.name for b in BUGS}
    if unknown:
        print(f"unknown bug name(s): {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    chosen = [b for b in BUGS if not args.names or b.name in args.names]
    rows = []
    with tempfile.TemporaryDirectory(prefix="planted_bugs_") as tmp:
        copy = Path(tmp)
        _copy_repo(copy)
        for b in chosen:
            outcome, secs, detail = plant_and_run(b, copy)
            rows.append((b, outcome, secs, detail))
            print(f"{outcome:10s} {secs:6.0f}s  {b.name:32s} {detail}", flush=True)
    survived = [b.name for b, outcome, _, _ in rows if outcome != "caught"]
    missed = f"; not caught: {', '.join(survived)}" if survived else ""
    print(f"\n{len(rows) - len(survived)}/{len(rows)} caught{missed}")
    if args.markdown:
        lines = ["| bug | area | file | outcome | caught by |", "|---|---|---|---|---|"]
        for b, outcome, _, detail in rows:
            lines.append(f"| `{b.name}` | {b.area} | `{b.file}` | {outcome} | {detail.replace('|', '/')} |")
        args.markdown.write_text("\n".join(lines) + "\n")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
