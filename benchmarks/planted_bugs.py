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
    Bug("hf_norm_swap", "key map", "lit_moe/model/hf.py",
        'if rest == "pre_mlp_layernorm.weight":\n        return [(prefix + "post_attention_layernorm.weight", _WHOLE)]',
        'if rest in ("pre_mlp_layernorm.weight", "input_layernorm.weight"):\n'
        '        return [(prefix + ("input_layernorm.weight" if rest.startswith("pre") else '
        '"post_attention_layernorm.weight"), _WHOLE)]',
        ("tests/test_hf_interop.py", "tests/test_checkpoint_hf.py", "-k", "logits_match or transformers_logits")),
    Bug("hf_router_bias_dropped", "key map", "lit_moe/model/hf.py",
        'return [(prefix + "mlp.gate.e_score_correction_bias", _WHOLE)]',
        'return [(prefix + "mlp.gate.e_score_correction_bias", lambda t: t * 0)]',
        ("tests/test_hf_interop.py", "-k", "logits_match")),
    Bug("hf_mtp_final_norm", "key map", "lit_moe/model/hf.py",
        'return [(prefix + "shared_head.norm.weight", _WHOLE)]',
        'return [(prefix + "hnorm.weight", _WHOLE)]',
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
    Bug("cosine_half_period", "LR schedule", "lit_moe/schedules.py",
        "\n    percent = max(0.0, 0.5 * (1.0 + math.cos(math.pi * s.num_cycles * 2.0 * progress)))",
        "\n    percent = max(0.0, 0.5 * (1.0 + math.cos(math.pi * s.num_cycles * progress)))",
        ("tests/test_schedules.py", "-k", "cosine")),
    Bug("warmup_off_by_one", "LR schedule", "lit_moe/schedules.py",
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
    Bug("schedule_state_not_loaded", "optimizer/schedule state", "lit_moe/optim.py",
        "        super().load_state_dict(state_dict)\n        self._position = None\n",
        "        self._position = None\n",
        ("tests/test_checkpoint_e2e.py", "-k", "exact_resume")),
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
    Bug("pp_losses_not_averaged", "PP", "lit_moe/strategies/pipeline.py",
        "return vec[:3] / A", "return vec[:3] / A * (1 + (A > 1))",
        ("tests/test_pipeline.py", "-k", "layout_matches")),
    # ---------------------------------------------------------------- generation (predict), HF export at the end
    Bug("cache_position_off_by_one", "generation", "lit_moe/generate.py",
        "ids, positions = token[:, None], positions[:, -1:] + 1",
        "ids, positions = token[:, None], positions[:, -1:]",
        ("tests/test_predict.py", "-k", "greedy_equals")),
    Bug("left_pad_positions_from_batch_start", "generation", "lit_moe/generate.py",
        "positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)",
        "positions = torch.arange(valid.shape[1], device=device).expand_as(valid)",
        ("tests/test_predict.py", "-k", "left_padding")),
    Bug("pad_keys_visible", "generation", "lit_moe/generate.py",
        "return (((q >= k) & valid[:, None, :]) | (q == k))[:, None]",
        "return (q >= k)[None, None].expand(valid.shape[0], 1, -1, -1)",
        ("tests/test_predict.py", "-k", "greedy_equals")),
    Bug("cached_rope_key_unrotated", "generation (MLA cache)", "lit_moe/model/attention.py",
        "        k_pe = apply_rotary(k_pe, cos[:, :, None], sin[:, :, None], attn.use_fused_rope)\n    latent, k_pe = cache",
        "        pass\n    latent, k_pe = cache",
        ("tests/test_predict.py", "-k", "cache_holds")),
    Bug("top_p_keeps_boundary", "sampling", "lit_moe/generate.py",
        "sorted_probs.masked_fill(before >= top_p, 0.0)", "sorted_probs.masked_fill(before > top_p, 0.0)",
        ("tests/test_predict.py", "-k", "top_p_filter")),
    Bug("sampling_unseeded", "sampling", "lit_moe/generate.py",
        "generator = torch.Generator(device=device).manual_seed(seed)", "generator = None",
        ("tests/test_predict.py", "-k", "seeded")),
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
    problems = check_table(BUGS)
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
