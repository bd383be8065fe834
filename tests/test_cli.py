"""The ``lit_moe fit`` command line: parsing, overrides and one-line configuration errors."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

from helpers import ROOT, cli_in_process, run_cli, tiny_config, write_config
from lit_moe.cli import main


def _fit_error(tmp_path, capsys, cfg: dict, *extra: str) -> str:
    """Run ``lit_moe fit`` in-process on ``cfg``; it must fail with exit code 2 and one stderr line."""
    path = write_config(tmp_path, cfg)
    code = main(["fit", "--config", str(path), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def _set(cfg: dict, dotted: str, value) -> dict:
    cfg = copy.deepcopy(cfg)
    node = cfg
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return cfg


# (dotted key, bad value, words the one-line error must contain)
BAD_CONFIGS = [
    ("training.bogus", 1, ["training", "bogus"]),
    ("checkpoint.save_every", 5, ["checkpoint", "save_every"]),
    ("parallelism.tensor_paralel", 2, ["parallelism", "tensor_paralel"]),
    ("training.steps", "ten", ["training", "steps"]),
    ("training.local_batch_size", 0, ["local_batch_size"]),
    ("training.global_batch_size", 1, ["global_batch_size"]),
    ("training.max_norm", -1.0, ["max_norm"]),
    ("lr_scheduler.warmup_ratio", 1.5, ["warmup_ratio", "1.5"]),
    ("lr_scheduler.type", "BogusLR", ["lr_scheduler.type", "BogusLR"]),
    ("optimizer.type", "SGD", ["optimizer.type", "SGD", "AdamW"]),
    ("model.n_routed_experts", 6, ["n_group"]),
    ("model.topk_group", 5, ["topk_group", "5"]),
    ("model.num_experts_per_tok", 9, ["num_experts_per_tok", "9"]),
    ("model.position_embedding_type", "alibi", ["position_embedding_type", "alibi"]),
    ("model.hidden_act", "relu", ["hidden_act", "relu"]),
    ("model.normalization", "BatchNorm", ["normalization", "BatchNorm"]),
    ("model.first_k_dense_replace", 99, ["first_k_dense_replace", "99"]),
    ("parallelism.pipeline_parallel", 2, ["pipeline"]),
    ("parallelism.expert_parallel", 3, ["expert_parallel", "3"]),
    ("recompute.mode", "partial", ["recompute.mode", "partial"]),
    ("recompute.full_recompute_layer", ["0-10"], ["full_recompute_layer", "0-10"]),
    ("checkpoint.load_path", "/nonexistent/ckpt", ["load_path", "/nonexistent/ckpt"]),
    ("context.device_target", "tpu", ["device_target", "tpu"]),
    ("train_dataset.dataloader.config.seq_length", 64, ["seq_length", "64"]),
    ("training.max_norm", float("nan"), ["max_norm", "nan"]),
    ("training.seed", -1, ["training.seed", "-1"]),
    ("lr_scheduler.learning_rate", -1.0, ["learning_rate", "> 0"]),
    ("training", 5, ["training", "mapping", "5"]),
    ("checkpoint", [1, 2], ["checkpoint", "mapping"]),
    ("monitor.tensorboard", 3, ["monitor.tensorboard", "mapping"]),
    ("trainer.gradient_clip_val", 1.0, ["trainer.gradient_clip_val", "training.max_norm"]),
    ("trainer.accumulate_grad_batches", 2, ["trainer.accumulate_grad_batches", "training.global_batch_size"]),
    ("trainer.max_steps", -5, ["trainer", "max_steps", "-5"]),
]


@pytest.mark.parametrize("key,value,words", BAD_CONFIGS, ids=[b[0] for b in BAD_CONFIGS])
def test_bad_config_gives_one_line(tmp_path, capsys, key, value, words):
    base = tiny_config(tmp_path)
    if key == "recompute.full_recompute_layer":
        base["recompute"] = {"mode": "full"}
    line = _fit_error(tmp_path, capsys, _set(base, key, value))
    for word in words:
        assert word in line, line


def test_fused_norm_false_gives_the_seed_error(tmp_path, capsys):
    line = _fit_error(tmp_path, capsys, _set(tiny_config(tmp_path), "model.fused_norm", False))
    assert "fused" in line.lower()


def test_accumulation_error_has_the_seed_text(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    cfg["training"].update(local_batch_size=4, global_batch_size=2)
    line = _fit_error(tmp_path, capsys, cfg)
    assert ("The product of data_parallel and local_batch_size exceeds global_batch_size, please increase "
            "global_batch_size or decrease local_batch_size.") in line


def test_seed_example_parses_and_prints(tmp_path, capsys):
    """The 8-card example of MindFormers' PyNative configuration guide, committed unchanged, parses;
    --print_config shows the flat sections."""
    assert main(["fit", "--config", str(ROOT / "configs" / "pynative.yaml"), "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["lr_scheduler"]["learning_rate"] == pytest.approx(1e-5)
    assert isinstance(printed["optimizer"]["eps"], float)
    assert printed["parallelism"]["tensor_parallel"] == 2
    assert printed["model"]["n_routed_experts"] == 8
    assert printed["recompute"]["full_recompute_layer"] == ["0-3"]


def test_dotted_overrides_and_float_literal(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    path = write_config(tmp_path, cfg)
    assert main(["fit", "--config", str(path), "--training.steps", "10", "--model.hidden_size", "96",
                 "--lr_scheduler.learning_rate", "1e-5", "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["training"]["steps"] == 10
    assert printed["model"]["hidden_size"] == 96
    assert isinstance(printed["lr_scheduler"]["learning_rate"], float)
    assert printed["lr_scheduler"]["learning_rate"] == pytest.approx(1e-5)


def test_bad_config_in_a_real_process_exits_2_without_traceback(tmp_path):
    cfg = _set(tiny_config(tmp_path), "training.bogus", 1)
    path = write_config(tmp_path, cfg)
    proc = run_cli(["fit", "--config", str(path)], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "bogus" in lines[0], proc.stderr


def test_empty_sections_take_their_defaults(tmp_path, capfd):
    """A section whose keys are all commented out (YAML null) means its defaults, at any depth."""
    path = write_config(tmp_path, tiny_config(tmp_path, steps=1))
    extra = tmp_path / "empty.yaml"
    extra.write_text("profiler:\nrecompute:\nmonitor:\n  tensorboard:\n")
    proc = cli_in_process(["fit", "--config", str(path), "--config", str(extra),
                           "--monitor.tensorboard.output_dir", str(tmp_path / "tb")], capfd, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "step 1/1" in proc.stdout + proc.stderr


# ----------------------------------------------------------------------------------------------
# MindFormers configs load unchanged (issue 13)
# ----------------------------------------------------------------------------------------------
def mindformers_config(tmp_path) -> dict:
    """The tiny model in the shape of a MindFormers PyNative config, with every key of MindFormers'
    config classes (docs/../reference §1) written out at a value lit_moe runs."""
    cfg = tiny_config(tmp_path)
    cfg["checkpoint"].update(remove_redundancy=False, load_balanced=False, load_worker_number=1,
                             save_global_layout_cache=True, reshard_worker_num=1)
    cfg["training"].update(max_norm=1.0, seed=42, deterministic=True, rampup_batch_size=None)
    cfg["optimizer"].update(weight_decay_include=None, weight_decay_exclude=None)
    cfg["parallelism"] = {
        "data_parallel_shard": -1, "data_parallel_shard_strategy": "optim_grads_params",
        "reshard_after_forward_policy": "default", "cpu_offload": False, "disable_gradient_division": True,
        "dense_fsdp_shard_size": None, "tensor_parallel": 1, "context_parallel": 1,
        "context_parallel_method": "colossal", "context_parallel_async": False, "ulysses_degree_in_cp": None,
        "context_parallel_mask_type": "causal", "pipeline_parallel": 1, "pipeline_parallel_layers_per_stage": None,
        "pipeline_parallel_schedule": "1f1b", "pipeline_parallel_microbatch_size": 1,
        "pipeline_parallel_interleave_num": 1, "pipeline_parallel_overlap_p2p": False,
        "pipeline_parallel_overlap_b_f": False, "pipeline_parallel_enable_dxdw_split": False,
        "pipeline_parallel_p2p_transport": "plain", "sequence_parallel": True, "enable_mc2": False,
        "enable_loss_parallel": False, "expert_parallel": 1, "npu_nums_per_device": 8,
        "moe_token_dispatcher_type": "alltoall", "expert_parallel_async_d2h": False,
        "expert_parallel_use_safe_tokens": True,
    }
    cfg["recompute"] = {"mode": None, "full_recompute_layer": None, "select_module": None, "exclude_op": None}
    cfg["recompute_comm"] = {"enable": False, "select_module": None}
    cfg["swap"] = {"enable": False, "default_prefetch": 1, "layer_swap": None, "op_swap": None}
    cfg["train_dataset"].update(use_distribute_dataset=False)
    cfg["monitor"] = {
        "health_checkpoint": {"embedding_local_norm_threshold": 100.0, "global_norm_skip_threshold": 100.0,
                              "global_norm_skip_time": 10},
        "train_state": {"local_norm": "", "local_loss": False, "device_norm": False, "device_loss": False},
        "tensorboard": {"output_dir": str(tmp_path / "tb"), "log_interval": 1, "queue_size": 1000},
        "moe_monitor": {"save_tokens_per_expert_interval": None, "target_layers": None},
    }
    cfg["profiler"] = {"enable_profiling": False, "start_step": 1, "end_step": 1, "output_path": None,
                       "profiler_rank": None, "profiler_level": 0, "mstx": False, "profile_memory": False,
                       "profile_cpu": True, "with_stack": True}
    cfg["context"] = {"mode": 1, "max_device_memory": "59GB", "device_target": "CPU"}
    cfg["callbacks"] = []
    cfg["lora_config"] = None
    cfg["eval_dataset"] = None
    cfg["use_remove_redundant_dataset"] = False
    cfg["model"].update(mla_qkv_concat=True, moe_router_fusion=True, use_attn_mask_compression=False)
    return cfg


def _printed(capsys, path, *extra) -> dict:
    assert main(["fit", "--config", str(path), *extra, "--print_config"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_mindformers_config_loads_prints_round_trips_and_trains(tmp_path, capfd):
    cfg = mindformers_config(tmp_path)
    printed = _printed(capfd, write_config(tmp_path, cfg))
    assert "trainer" not in printed          # Lightning's max_steps: -1 would beat training.steps
    for section, values in cfg.items():      # every key written comes back with its value
        if isinstance(values, dict):
            for key, value in values.items():
                assert printed[section][key] == value, (section, key)
        else:
            assert printed.get(section) == values or values in (None, [], False), section
    again = _printed(capfd, write_config(tmp_path, printed, "printed.yaml"))
    assert again == printed
    proc = cli_in_process(["fit", "--config", str(tmp_path / "printed.yaml")], capfd, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 2/2" in proc.stdout + proc.stderr and "Traceback" not in proc.stderr


def test_dotted_overrides_keep_siblings_and_parse_yaml(tmp_path, capsys):
    path = write_config(tmp_path, tiny_config(tmp_path, mock_data=False))
    printed = _printed(capsys, path, "--train_dataset.dataloader.config.seq_length", "32",
                       "--train_dataset.dataloader.config.eod_mask_loss", "true",
                       "--monitor.train_state.local_norm=[embed, head]", "--model.window_size", "[4, 0]",
                       "--training.max_norm", "5e-1", "--recompute.full_recompute_layer", "[0-1]")
    dl = printed["train_dataset"]["dataloader"]
    assert dl["config"]["data_path"] == ["1", "builtin:austen"] and dl["config"]["split"] == "1, 0, 0"
    assert dl["config"]["seq_length"] == 32 and dl["config"]["eod_mask_loss"] is True
    assert dl["column_names"] == ["input_ids", "labels", "loss_mask", "position_ids"]
    assert printed["monitor"]["train_state"]["local_norm"] == ["embed", "head"]
    assert printed["monitor"]["tensorboard"]["output_dir"] == str(tmp_path / "tb")   # sibling kept
    assert printed["model"]["window_size"] == [4, 0] and printed["model"]["hidden_size"] == 64
    assert printed["training"]["max_norm"] == 0.5 and printed["recompute"]["full_recompute_layer"] == ["0-1"]


def test_later_config_files_merge_at_every_depth(tmp_path, capsys):
    path = write_config(tmp_path, tiny_config(tmp_path, mock_data=False))
    extra = tmp_path / "extra.yaml"
    extra.write_text("train_dataset:\n  dataloader:\n    config:\n      seq_length: 32\n")
    printed = _printed(capsys, path, "--config", str(extra))
    assert printed["train_dataset"]["dataloader"]["config"]["data_path"] == ["1", "builtin:austen"]


CONFIG_TEXT_ERRORS = [
    ("training:\n  steps: 2\ncheckpoint: {}\ntraining:\n  steps: 3\n", ["'training'", "twice", "lines 1 and 4"]),
    ("model:\n  hidden_size: 64\n  hidden_size: 32\n", ["'hidden_size'", "lines 2 and 3"]),
    ("a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi")),
     ["alias", "1,000,000"]),
    ("training: &t\n  steps: *t\n", ["alias", "refers to the value that contains it"]),
    ("- 1\n- 2\n", ["does not hold a mapping"]),
    ("training: [\n", ["not valid YAML"]),
]


@pytest.mark.parametrize("text,words", CONFIG_TEXT_ERRORS, ids=["dup-section", "dup-key", "alias-bomb",
                                                               "recursive-alias", "list", "broken"])
def test_hostile_or_broken_yaml_is_one_line(tmp_path, capsys, text, words):
    import time
    import tracemalloc

    path = tmp_path / "bad.yaml"
    path.write_text(text)
    tracemalloc.start()
    t0 = time.process_time()   # this process's CPU time: a busy machine does not inflate it
    code = main(["fit", "--config", str(path)])
    seconds = time.process_time() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert str(path) in err
    for word in words:
        assert word in err, err
    assert seconds < 5 and peak < 64 * 1024 ** 2, (seconds, peak)


@pytest.mark.parametrize("content,words", [(b"\x00\x01binary", ["binary"]), (b"model:\n  x: \xe9\n", ["not UTF-8"])],
                         ids=["binary", "latin1"])
def test_binary_or_non_utf8_config_is_one_line(tmp_path, capsys, content, words):
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    for argv in (["fit", "--config", str(path)], ["plan", "--config", str(path), "-n", "1"],
                 ["convert-config", str(path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(path) in err and words[0] in err, err


MISPLACED = [
    ({"model": {"model_config": {"num_layers": 2}}}, ["model.model_config", "lit_moe convert-config"]),
    ({"model": {"num_hidden_layer": 2}}, ["model.num_hidden_layer", "did you mean 'num_hidden_layers'"]),
    ({"trainingg": {"steps": 1}}, ["trainingg", "did you mean 'training'"]),
    ({"runner_config": {"batch_size": 1}}, ["runner_config", "convert-config"]),
    ({"seed_everything": False}, ["seed_everything", "training.seed", "trainer.max_steps: -1"]),
    ({"monitor": {"tensorboard": {"log_intervl": 2}}}, ["monitor.tensorboard.log_intervl", "'log_interval'"]),
    ({"parallelism": {"sequence_paralel": True}}, ["parallelism.sequence_paralel", "'sequence_parallel'"]),
]


@pytest.mark.parametrize("extra,words", MISPLACED, ids=[w[0] for _, w in MISPLACED])
def test_unknown_or_misplaced_keys_are_errors(tmp_path, capsys, extra, words):
    cfg = tiny_config(tmp_path)
    for section, values in extra.items():
        if isinstance(cfg.get(section), dict):
            merged = copy.deepcopy(cfg[section])
            for k, v in values.items():
                if isinstance(v, dict) and isinstance(merged.get(k), dict):
                    merged[k] = {**merged[k], **v}
                else:
                    merged[k] = v
            cfg[section] = merged
        else:
            cfg[section] = values
    line = _fit_error(tmp_path, capsys, cfg)
    for word in words:
        assert word in line, line


def test_unknown_command_line_options(tmp_path, capsys):
    path = write_config(tmp_path, tiny_config(tmp_path))
    assert main(["fit", "--config", str(path), "--trainng.steps", "3"]) == 2
    assert "did you mean 'training'" in capsys.readouterr().err
    assert main(["fti"]) == 2
    assert "did you mean 'fit'" in capsys.readouterr().err


# MindFormers' validation rules and the one-line "not yet" errors, on one process.
RULES = [
    ("parallelism.sequence_parallel", False, {"parallelism.tensor_parallel": 2},
     ["PyNative tensor parallelism requires sequence_parallel=True when tensor_parallel > 1, but got "
      "tensor_parallel=2."]),
    ("parallelism.reshard_after_forward_policy", "sometimes", {}, ["Invalid reshard_after_forward_policy: 'sometimes'"]),
    ("parallelism.cpu_offload", True, {}, ["cpu_offload", "not implement yet"]),
    ("parallelism.context_parallel_method", "ring", {}, ["Unsupported context_parallel_method: 'ring'."]),
    ("parallelism.context_parallel_async", True, {"parallelism.context_parallel": 2}, ["Async context parallel currently supports 'ulysses' and "
                                                       "'hybrid' only"]),
    ("parallelism.context_parallel_mask_type", "full", {}, ["only supports pure causal mask, got 'full'"]),
    ("parallelism.ulysses_degree_in_cp", 2, {"parallelism.context_parallel": 2,
                                             "parallelism.context_parallel_method": "hybrid"},
     ["Hybrid CP requires 1 < ulysses_degree_in_cp < context_parallel and divisibility"]),
    ("parallelism.ulysses_degree_in_cp", 1, {"parallelism.context_parallel": 2,
                                             "parallelism.context_parallel_method": "ulysses"},
     ["Ulysses CP requires ulysses_degree_in_cp == context_parallel"]),
    ("parallelism.pipeline_parallel_schedule", "zb", {}, ["pipeline_parallel_schedule", "'zb'", "'1f1b'"]),
    ("parallelism.pipeline_parallel_interleave_num", 0, {}, ["pipeline_parallel_interleave_num", ">= 1"]),
    ("parallelism.pipeline_parallel", 2, {"parallelism.pipeline_parallel_schedule": "gpipe"},
     ["pipeline_parallel(2)", "world_size(1)"]),
    ("parallelism.pipeline_parallel_p2p_transport", "rdma", {}, ["pipeline_parallel_p2p_transport", "'rdma'"]),
    ("parallelism.moe_token_dispatcher_type", "alltoall_deredundancy", {},
     ["expert_parallel must be greater than or equal to npu_nums_per_device when using 'alltoall_deredundancy'"]),
    ("parallelism.dense_fsdp_shard_size", 2, {}, ["dense_fsdp_shard_size 2 is invalid. It must be in range [1, 1]"]),
    ("training.rampup_batch_size", [2, 0, 8], {}, ["training.rampup_batch_size[1]", "> 0"]),
    ("training.rampup_batch_size", [2, True, 8], {}, ["training.rampup_batch_size[1]", "integer"]),
    ("training.rampup_batch_size", [2, 3, 8], {}, ["training.rampup_batch_size[1]", "multiple of increment 3"]),
    ("training.rampup_batch_size", [2, 1, 8], {}, ["training.rampup_batch_size", "batch size 3 is not divisible",
                                                   "local_batch_size(2) = 2"]),
    ("training.rampup_batch_size", [6, 2, 8], {}, ["training.rampup_batch_size[0]", "start 6 exceeds",
                                                   "global_batch_size 4"]),
    ("swap.enable", True, {}, ["swap.enable", "not implement yet"]),
    ("swap.default_prefetch", 0, {}, ["swap.default_prefetch", ">= 1"]),
    ("recompute.exclude_op", ["matmul"], {}, ["recompute.exclude_op", "not implement yet"]),
    # a pattern matching no module in any spelling (MindFormers' linear_q... match: tests/test_names.py)
    ("lora_config", {"target_modules": ".*linear_qz.*", "lora_rank": 8}, {},
     ["lora_config.target_modules", "matches no linear layer", "layers.0.self_attention"]),
    ("lora_config", {"lora_rank": 8}, {}, ["lora_config.target_modules", "required"]),
    ("lora_config", {"target_modules": "q_b_proj", "lora_rank": 0}, {}, ["lora_config.lora_rank", "positive"]),
    ("eval_dataset", {"dataloader": {"type": "BlendedMegatronDatasetDataLoader"}}, {}, ["eval_dataset.dataloader"]),
    ("training.eval_iters", 0, {"training.eval_interval": 5}, ["training.eval_iters", ">= 1"]),
]


@pytest.mark.parametrize("key,value,also,words", RULES, ids=[f"{r[0]}={r[1]}" for r in RULES])
def test_mindformers_rules_and_not_yet_errors(tmp_path, capsys, key, value, also, words):
    cfg = tiny_config(tmp_path)
    for k, v in also.items():
        cfg = _set(cfg, k, v)
    line = _fit_error(tmp_path, capsys, _set(cfg, key, value))
    for word in words:
        assert word in line, line


def test_sequence_parallel_true_or_unset_is_what_lit_moe_does(tmp_path, capsys):
    """The guide's 8-card example sets tensor_parallel 2 without sequence_parallel: that is accepted (lit_moe
    always uses it); the error above comes only from an explicit false."""
    from lit_moe.config import ParallelismConfig
    from lit_moe.strategies.parallel_dims import check_parallelism_keys

    for sp in (None, True):
        check_parallelism_keys(ParallelismConfig(tensor_parallel=2, sequence_parallel=sp))


def test_model_that_cannot_fit_is_refused_before_allocation(tmp_path, capsys):
    """~16 bytes per parameter (fp32 weights, gradients, Adam moments) of a 2-billion-row embedding:
    far beyond any test machine's RAM; the refusal comes from the meta-device plan, in seconds."""
    import time

    cfg = _set(tiny_config(tmp_path), "model.vocab_size", 2_000_000_000)
    t0 = time.process_time()   # this process's CPU time: a busy machine does not inflate it
    line = _fit_error(tmp_path, capsys, cfg)
    assert time.process_time() - t0 < 60
    assert "does not fit" in line and "lit_moe plan" in line and "available RAM" in line, line
    need, have = [float(x) for x in __import__("re").findall(r"([\d.]+) GiB", line)[:2]]
    assert need > have
    # 2e9 * 64 (embedding) + 2e9 * 64 (head) parameters, 16 bytes each
    assert need == pytest.approx(2 * 2e9 * 64 * 16 / 1024 ** 3, rel=0.01)


def test_multi_rank_fit_is_refused_on_the_exact_bytes_of_its_most_loaded_rank(tmp_path, capsys, monkeypatch):
    """``fit --trainer.devices 4`` with HSDP (2 replicas × 2 shards): each rank holds half the model, twice
    the old lower bound (whole ÷ 4). With RAM for a share between the two, fit refuses before starting
    any process, naming both numbers (the RAM source is the one function fit asks, replaced here)."""
    import lit_moe.strategies.plan as plan_mod
    from test_plan import _hand_state_bytes

    cfg = _set(_set(tiny_config(tmp_path), "parallelism.data_parallel_shard", 2), "training.global_batch_size", 8)
    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM

    with torch.device("meta"):
        plain = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg["model"]))
    shapes = {n: tuple(p.shape) for n, p in plain.named_parameters()}
    exact = _hand_state_bytes(shapes, shapes, fsdp=2, efsdp=2)
    lower = _hand_state_bytes(shapes, shapes) // 4
    share = (lower + exact) // 2
    monkeypatch.setattr(plan_mod, "_available_ram", lambda: 4 * share)   # 4 processes on this machine
    line = _fit_error(tmp_path, capsys, cfg, "--trainer.devices", "4")
    assert f"rank 0 of 4 needs {plan_mod._fmt_bytes(exact)}" in line, line
    assert f"has {plan_mod._fmt_bytes(share)} (available RAM / 4 processes)" in line, line


def test_help_lists_every_subcommand(capsys):
    from lit_moe.cli import TOOLS

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("fit", *TOOLS):
        assert f"  {name} " in out, out


# ----------------------------------------------------------------------------------------------
# subcommands never traceback on a user's paths
# ----------------------------------------------------------------------------------------------
def _tool_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_convert_config_output_paths(tmp_path, capsys):
    graph = ROOT / "tests" / "data" / "graph_deepseek3_tiny.yaml"
    existing = tmp_path / "existing.yaml"
    existing.write_text("keep: me\n")
    assert str(existing) in _tool_error(capsys, ["convert-config", str(graph), "-o", str(existing)])
    assert existing.read_text() == "keep: me\n"
    assert "is a directory" in _tool_error(capsys, ["convert-config", str(graph), "-o", str(tmp_path)])
    missing = tmp_path / "no" / "such" / "out.yaml"
    assert "does not exist" in _tool_error(capsys, ["convert-config", str(graph), "-o", str(missing)])
    under_file = existing / "out.yaml"
    assert "is a file" in _tool_error(capsys, ["convert-config", str(graph), "-o", str(under_file)])


def test_preprocess_truncated_inputs_and_existing_outputs(tmp_path, capsys):
    import gzip
    import lzma
    import os

    text = "".join(f'{{"text": "document {i} {os.urandom(8).hex()}"}}\n' for i in range(3000)).encode()
    for suffix, compress in ((".gz", gzip.compress), (".xz", lzma.compress)):
        blob = compress(text)
        path = tmp_path / f"docs.jsonl{suffix}"
        path.write_bytes(blob[: len(blob) // 2])
        err = _tool_error(capsys, ["preprocess", "--input", str(path), "--output-prefix", str(tmp_path / "o"),
                                   "--tokenizer", "byte", "--workers", "1", "--quiet"])
        assert str(path) in err and "truncated" in err, err
        assert not list(tmp_path.glob("o_text_document*")), "a half-written dataset was left behind"
    good = tmp_path / "docs.jsonl"
    good.write_bytes(text[:2000].rsplit(b"\n", 1)[0] + b"\n")
    argv = ["preprocess", "--input", str(good), "--output-prefix", str(tmp_path / "o"), "--tokenizer", "byte",
            "--workers", "1", "--quiet"]
    assert main(argv) == 0
    capsys.readouterr()
    before = (tmp_path / "o_text_document.bin").read_bytes()
    assert "already exists" in _tool_error(capsys, argv)
    assert (tmp_path / "o_text_document.bin").read_bytes() == before


def test_convert_hf_paths(tmp_path, capsys):
    cfg = write_config(tmp_path, tiny_config(tmp_path))
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    err = _tool_error(capsys, ["convert-hf", "--config", str(cfg), "--checkpoint", str(tmp_path), "--output", str(out)])
    assert str(out) in err and "not empty" in err
    assert "is a file" in _tool_error(capsys, ["convert-hf", "--config", str(cfg), "--checkpoint", str(tmp_path),
                                               "--output", str(cfg)])
    tracker_dir = tmp_path / "ckpt"
    tracker_dir.mkdir()
    (tracker_dir / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe\x00\x01")
    err = _tool_error(capsys, ["convert-hf", "--config", str(cfg), "--checkpoint", str(tracker_dir),
                               "--output", str(tmp_path / "new")])
    assert "latest_checkpointed_iteration.txt" in err, err


@pytest.mark.parametrize("kind", ["tracker-bytes", "file"])
def test_unreadable_load_path_is_one_line(tmp_path, capsys, kind):
    target = tmp_path / "ckpt"
    if kind == "tracker-bytes":
        target.mkdir()
        (target / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\x00\x12abc")
        expect = "latest_checkpointed_iteration.txt"
    else:
        target.write_bytes(b"\x00\x01")
        expect = str(target)
    line = _fit_error(tmp_path, capsys, _set(tiny_config(tmp_path), "checkpoint.load_path", str(target)))
    assert "checkpoint.load_path" in line and expect in line, line


def test_no_effect_list_names_real_keys_and_every_no_effect_field_is_in_it():
    import dataclasses

    import importlib.util

    from lit_moe.config import FIXED_SECTIONS, NO_EFFECT_KEYS, OTHER_TOP_LEVEL

    spec = importlib.util.spec_from_file_location("make_readme", ROOT / "docs" / "make_readme.py")
    make_readme = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_readme)
    field_docs = make_readme._field_docs

    for key in NO_EFFECT_KEYS:
        section, _, name = key.partition(".")
        if not name:
            assert section in OTHER_TOP_LEVEL, key
        elif section != "model":
            assert name in {f.name for f in dataclasses.fields(FIXED_SECTIONS[section])}, key
    for section, cls in FIXED_SECTIONS.items():
        for name, doc in field_docs(cls).items():
            if doc.startswith("Accepted, no effect"):
                assert f"{section}.{name}" in NO_EFFECT_KEYS, (section, name)


def test_pipeline_and_cp_values_are_available_to_the_engines():
    """What the pipeline and context-parallel engines read: validated stage layouts and Ulysses degree."""
    from lit_moe.config import ParallelismConfig
    from lit_moe.strategies.parallel_dims import (ParallelismError, cp_ulysses_degree, pipeline_stage_layers,
                                                  reshard_after_forward)

    auto = ParallelismConfig(pipeline_parallel=2, pipeline_parallel_interleave_num=2)
    assert pipeline_stage_layers(auto, 8) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    explicit = ParallelismConfig(pipeline_parallel=2, pipeline_parallel_layers_per_stage=["0-2", "3"])
    assert pipeline_stage_layers(explicit, 4) == [[[0, 1, 2]], [[3]]]
    lists = ParallelismConfig(pipeline_parallel=2, pipeline_parallel_layers_per_stage=[[0], [1, 2]])
    assert pipeline_stage_layers(lists, 3) == [[[0]], [[1, 2]]]
    with pytest.raises(ParallelismError, match=r"Number of layers \(5\) is not divisible by total stages \(4\)"):
        pipeline_stage_layers(auto, 5)
    with pytest.raises(ParallelismError, match="cover decoder layers 0..3 exactly once"):
        pipeline_stage_layers(ParallelismConfig(pipeline_parallel=2, pipeline_parallel_layers_per_stage=["0-1", "1-3"]), 4)
    with pytest.raises(ParallelismError, match=r"has 1 chunk\(s\); pipeline_parallel_interleave_num is 2"):
        pipeline_stage_layers(ParallelismConfig(pipeline_parallel=2, pipeline_parallel_interleave_num=2,
                                                pipeline_parallel_layers_per_stage=["0-1", "2-3"]), 4)
    assert cp_ulysses_degree(ParallelismConfig(context_parallel=4, context_parallel_method="hybrid",
                                               ulysses_degree_in_cp=2)) == 2
    assert cp_ulysses_degree(ParallelismConfig(context_parallel=4, context_parallel_method="ulysses")) == 4
    assert cp_ulysses_degree(ParallelismConfig(context_parallel=4)) == 1
    assert reshard_after_forward(ParallelismConfig()) is True
    assert reshard_after_forward(ParallelismConfig(data_parallel_shard_strategy="optim_grads")) is False
    assert reshard_after_forward(ParallelismConfig(reshard_after_forward_policy="never")) is False
    assert reshard_after_forward(ParallelismConfig(data_parallel_shard_strategy="optim_grads",
                                                   reshard_after_forward_policy="always")) is True
