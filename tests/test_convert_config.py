"""``lit_moe convert-config``: the graph.yaml → pynative.yaml tables of MindFormers' PyNative
configuration guide, field by field, the warning listing graph-only keys, ``gradient_accumulation_steps``,
and the converted file planning and training."""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path

import pytest
import yaml

from lit_moe.config import (CheckpointConfig, ConfigError, ContextConfig, ParallelismConfig, RecomputeCommConfig, RecomputeConfig,
                            TrainDatasetConfig, TrainingConfig)
from lit_moe.tools.convert_config import (MP_COMM_PATTERN, SELECT_PATTERN, GraphOnlyKeysWarning, convert,
                                    convert_graph_config, global_batch_from_accumulation, main,
                                    translate_gradient_accumulation, warmup_ratio_for)
from lit_moe.optim.schedules import resolve_schedule

GRAPH = Path(__file__).parent / "data" / "graph_deepseek3_tiny.yaml"

# Every key of the fixture with no PyNative meaning (the guide's "Graph 独有配置项" and the parts of mapped
# sections that the tables do not carry over).
EXPECTED_DROPPED = {
    "output_dir", "load_checkpoint", "load_ckpt_format", "src_strategy_path_or_dir", "auto_trans_ckpt",
    "only_save_strategy", "resume_training", "use_parallel", "run_mode", "train_precision_sync", "trainer",
    "runner_config.sink_mode", "runner_config.sink_size", "optimizer.swap",
    "train_dataset.data_loader.config.seed", "train_dataset.data_loader.config.num_dataset_builder_threads",
    "train_dataset_task", "context.mode", "context.device_target", "context.max_device_memory",
    "parallel_config.micro_batch_num", "parallel_config.use_seq_parallel",
    "parallel_config.gradient_aggregation_group", "micro_batch_interleave_num", "parallel", "use_legacy",
    "model.model_config.offset", "model.model_config.pp_interleave_num",
    "model.model_config.use_attn_mask_compression", "model.model_config.apply_rope_fusion",
    "model.model_config.bias_swiglu_fusion", "model.model_config.use_fused_ops_topkrouter",
    "model.model_config.moe_token_drop_policy", "moe_config.use_fused_ops_permute", "callbacks",
    "runner_wrapper.type", "runner_wrapper.scale_sense", "profile", "profile_start_step", "profile_stop_step",
    "init_start_profile", "profile_communication", "profile_memory",
}


def load_graph() -> dict:
    return yaml.safe_load(GRAPH.read_text())


def quiet_convert(graph: dict, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return convert(graph, **kwargs)


# ----------------------------------------------------------------------------------------------
# the fixture, field by field
# ----------------------------------------------------------------------------------------------
def test_fixture_maps_every_field():
    with pytest.warns(GraphOnlyKeysWarning) as record:
        pyn, dropped = convert_graph_config(load_graph())
    t = pyn["training"]
    # steps: total_steps -1 → epochs 1 × sizes[0] 8 // global batch 4; global batch = A 2 × dp 1 × batch 2
    assert t == {"steps": 2, "local_batch_size": 2, "global_batch_size": 4, "max_norm": 1.0, "seed": 1234}
    assert pyn["optimizer"] == {"type": "AdamW", "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}
    # warmup_steps 1 of 2 → ratio 0.5; lr_end / warmup_lr_init are read by CosineWithWarmUpLR
    assert pyn["lr_scheduler"] == {"type": "CosineWithWarmUpLR", "learning_rate": 3e-3, "lr_end": 3e-4,
                                   "warmup_lr_init": 0.0, "warmup_ratio": 0.5}
    assert pyn["parallelism"] == {"data_parallel_shard": -1, "data_parallel_shard_strategy": "optim_grads_params",
                                  "tensor_parallel": 1, "expert_parallel": 1}
    # recompute: True + select_recompute: False → full over all 2 decoder + 1 MTP layers
    assert pyn["recompute"] == {"mode": "full", "full_recompute_layer": ["0-2"]}
    assert pyn["recompute_comm"] == {"enable": True, "select_module": {MP_COMM_PATTERN: ["0-2"]}}

    ds = pyn["train_dataset"]
    dl = ds["dataloader"]
    assert dl["type"] == "BlendedMegatronDatasetDataLoader" and dl["datasets_type"] == "GPTDataset"
    assert dl["sizes"] == [8, 0, 0] and dl["shuffle"] is False and dl["python_multiprocessing"] is False
    assert dl["column_names"] == ["input_ids", "labels", "loss_mask", "position_ids"]  # from input_columns
    assert "seed" not in dl["config"] and "num_dataset_builder_threads" not in dl["config"]
    assert dl["config"]["seq_length"] == 32 and dl["config"]["data_path"][0] == "1"
    assert {k: ds[k] for k in ("drop_remainder", "num_parallel_workers", "prefetch_size", "numa_enable")} == \
        {"drop_remainder": True, "num_parallel_workers": 1, "prefetch_size": 1, "numa_enable": False}

    m = pyn["model"]
    graph_model = load_graph()["model"]["model_config"]
    assert m["architectures"] == "DeepseekV3ForCausalLM"
    assert m["hidden_size"] == graph_model["hidden_size"] and m["mtp_loss_factor"] == 0.3  # flattened
    assert m["use_fused_rope"] is True and m["use_fused_swiglu"] is True
    assert m["moe_grouped_gemm"] is True                      # moe_config.use_gmm
    assert m["moe_expert_capacity_factor"] == 1.5             # moe_config.capacity_factor
    for key in ("offset", "pp_interleave_num", "apply_rope_fusion", "moe_token_drop_policy", "model_config"):
        assert key not in m
    assert pyn["context"] == {"affinity_config": {"enable": True, "affinity_cpu_list": {"device_0": {
        "affinity_cpu_list": ["0-1"], "module_to_cpu_dict": {"main": [0], "minddata": [1]}}}}}

    assert set(dropped) == EXPECTED_DROPPED and len(dropped) == len(EXPECTED_DROPPED)
    assert len(record) == 1
    message = str(record[0].message)
    assert "no PyNative meaning" in message and all(k in message for k in EXPECTED_DROPPED)


def test_converted_sections_fit_the_section_dataclasses():
    """Typed as ``lit_moe fit`` parses them (jsonargparse over the section dataclasses)."""
    from jsonargparse import ArgumentParser

    pyn = quiet_convert(load_graph()).pynative
    fixed = {"training": TrainingConfig, "parallelism": ParallelismConfig, "recompute": RecomputeConfig,
             "recompute_comm": RecomputeCommConfig, "train_dataset": TrainDatasetConfig, "context": ContextConfig,
             "checkpoint": CheckpointConfig}
    assert set(pyn) <= set(fixed) | {"optimizer", "lr_scheduler", "model"}
    parser = ArgumentParser(exit_on_error=False)
    for name, cls in fixed.items():
        parser.add_argument(f"--{name}", type=cls, default=cls())
    parsed = parser.instantiate_classes(parser.parse_object({k: pyn[k] for k in fixed}))
    assert parsed.context.affinity_config.enable is True
    assert parsed.recompute.full_recompute_layer == ["0-2"]
    assert parsed.training.global_batch_size == 4
    # callbacks.CheckpointMonitor (prefix, save_checkpoint_steps, keep_checkpoint_max)
    assert pyn["checkpoint"] == {"prefix": "deepseekv3", "save_interleaved_steps": 5000, "save_max": 1}
    assert parsed.checkpoint.save_interleaved_steps == 5000


def test_notes_explain_the_moe_switches_and_the_derived_steps():
    notes = " | ".join(quiet_convert(load_graph()).notes)
    assert "enable_gmm_safe_tokens" in notes and "callback_moe_droprate" in notes
    assert "training.steps = runner_config.epochs 1" in notes


# ----------------------------------------------------------------------------------------------
# individual table rows
# ----------------------------------------------------------------------------------------------
def small_graph(**sections) -> dict:
    g = {"runner_config": {"batch_size": 2}, "parallel_config": {"data_parallel": 2, "model_parallel": 2},
         "lr_schedule": {"type": "ConstantWarmUpLR", "learning_rate": 1.e-4, "warmup_steps": 29,
                         "total_steps": 100},
         "model": {"model_config": yaml.safe_load(GRAPH.read_text())["model"]["model_config"]}}
    g.update(copy.deepcopy(sections))
    return g


def test_clipping_off_by_default_and_total_steps():
    pyn = quiet_convert(small_graph()).pynative
    assert pyn["training"]["max_norm"] == 0.0  # graph mode's use_clip_grad defaults to False
    assert pyn["training"]["steps"] == 100
    assert pyn["training"]["global_batch_size"] == 1 * 2 * 2
    assert pyn["parallelism"]["tensor_parallel"] == 2
    # 29/100 = 0.29 would give int(100 * 0.29) = 28 warm-up steps; the ratio is chosen to give 29 back
    ratio = pyn["lr_scheduler"]["warmup_ratio"]
    assert resolve_schedule(pyn["lr_scheduler"], 100).warmup_steps == 29 and 0.29 <= ratio < 0.2900001
    assert "lr_end" not in pyn["lr_scheduler"]


def test_warmup_ratio_round_trips_every_step_count():
    for total in range(1, 260):
        for w in range(total + 1):
            r = warmup_ratio_for(w, total)
            assert 0.0 <= r <= 1.0 and int(total * r) == w, (w, total)
    assert warmup_ratio_for(5, 4) is None


def pipeline_graph(pp: int, layers: int, offset=None, interleave=None, scheduler=None, micro: int = 8, **sections):
    g = small_graph(runner_config={"batch_size": 1, "gradient_accumulation_steps": 8},
                    parallel_config={"data_parallel": 2, "model_parallel": 1, "pipeline_stage": pp,
                                     "micro_batch_num": micro}, **sections)
    mc = g["model"]["model_config"]
    mc["num_hidden_layers"] = layers
    if offset is not None:
        mc["offset"] = offset
    if interleave is not None:
        mc["pp_interleave_num"] = interleave
    if scheduler is not None or interleave:
        g["parallel"] = {"parallel_mode": 1, "pipeline_config": {"pipeline_interleave": bool(interleave),
                                                                 "pipeline_scheduler": scheduler or "1f1b"}}
    return g


def test_pipeline_accumulates_micro_batch_num():
    result = quiet_convert(pipeline_graph(4, 8, micro=16))
    # MindFormers' training-features guide: under pipeline parallelism graph mode ignores
    # gradient_accumulation_steps; micro_batch_num micro-batches are accumulated: 16 × dp 2 × batch 1
    assert result.pynative["training"]["global_batch_size"] == 32
    assert "parallel_config.pipeline_stage" not in result.dropped
    assert "parallel_config.micro_batch_num" not in result.dropped
    # 8 layers over 4 stages, offset absent (0): the even split, auto
    par = result.pynative["parallelism"]
    assert par["pipeline_parallel"] == 4 and par["pipeline_parallel_schedule"] == "1f1b"
    assert "pipeline_parallel_layers_per_stage" not in par and "pipeline_parallel_interleave_num" not in par
    assert any("['0-1', '2-3', '4-5', '6-7'] (the even split" in n for n in result.notes)


def _layout(pyn: dict):
    """The stages ``lit_moe fit`` builds from the converted section (lit_moe's own reader)."""
    from lit_moe.config import build_section
    from lit_moe.pipeline import PipelineLayout

    par = build_section(ParallelismConfig, pyn["parallelism"], "parallelism")
    return PipelineLayout.from_config(par, pyn["model"]["num_hidden_layers"])


def test_pipeline_offset_list_moves_layers_between_stages():
    # 10 layers / 4 stages: 2 each, remainder 2 = sum of the offset; stage s gets 2 + offset[s]
    result = quiet_convert(pipeline_graph(4, 10, offset=[1, 0, 0, 1]))
    par = result.pynative["parallelism"]
    assert par["pipeline_parallel_layers_per_stage"] == ["0-2", "3-4", "5-6", "7-9"]
    assert _layout(result.pynative).ranges == ((0, 3), (3, 5), (5, 7), (7, 10))
    assert "model.model_config.offset" not in result.dropped


def test_pipeline_interleaved_offsets_per_chunk():
    # pp 2 x V 2 = 4 stages of 10 layers: 2 each + remainder 2; stage (chunk c, rank r) = c*2 + r gets
    # 2 + offset[c][r]: [[3, 2], [2, 3]] -> stages 0-2 | 3-4 | 5-6 | 7-9; rank 0 holds stages 0 and 2
    result = quiet_convert(pipeline_graph(2, 10, offset=[[1, 0], [0, 1]], interleave=2, micro=4))
    par = result.pynative["parallelism"]
    assert par["pipeline_parallel_interleave_num"] == 2 and par["pipeline_parallel_schedule"] == "1f1b"
    assert par["pipeline_parallel_layers_per_stage"] == ["0-2,5-6", "3-4,7-9"]
    layout = _layout(result.pynative)
    assert layout.schedule == "interleaved_1f1b"          # 1f1b with V > 1, as MindFormers
    assert layout.ranges == ((0, 3), (3, 5), (5, 7), (7, 10))
    assert "parallel" not in result.dropped and "parallel.parallel_mode" in result.dropped
    # one flat offset list is broadcast to both chunks (numpy, as MindFormers): 11 layers, remainder 3,
    # [2, 1] -> [[4, 3], [4, 3]] = 14 > 11: layers are given out in order, the last stage keeps 0 -> refused
    with pytest.raises(ConfigError, match=r"offset: \[2, 1\] leaves pipeline stage 3 .* without decoder layers"):
        quiet_convert(pipeline_graph(2, 11, offset=[2, 1], interleave=2, micro=4))
    # pp_interleave_num without MindSpore's pipeline_interleave switch has no effect in graph mode
    g = pipeline_graph(2, 8, interleave=2, micro=4)
    g["parallel"]["pipeline_config"]["pipeline_interleave"] = False
    result = quiet_convert(g)
    assert "pipeline_parallel_interleave_num" not in result.pynative["parallelism"]
    assert any("pp_interleave_num: 2 has no effect" in n for n in result.notes)


def test_pipeline_zero_bubble_v_reverses_the_second_chunk():
    # zero_bubble_v: chunk 1 runs from rank 1 back to rank 0, so offset[1] (per rank) is reversed into
    # pipeline order: 12 layers, 3 per stage; [[0, 0], [1, -1]] -> chunk 1 in pipeline order: rank 1 (2), rank 0 (4)
    g = pipeline_graph(2, 12, offset=[[0, 0], [1, -1]], interleave=2, scheduler="zero_bubble_v", micro=4)
    g["model"]["model_config"]["num_nextn_predict_layers"] = 0    # zbv puts first and last stage on rank 0
    result = quiet_convert(g)
    par = result.pynative["parallelism"]
    assert par["pipeline_parallel_schedule"] == "zbv"
    layout = _layout(result.pynative)
    assert layout.ranges == ((0, 3), (3, 6), (6, 8), (8, 12))
    assert [layout.rank_of(s) for s in range(4)] == [0, 1, 1, 0]   # rank 0: layers 0-2 and 8-11 = 3 + 4


@pytest.mark.parametrize("offset, interleave, match", [
    ([1, 1, 1, 1], None, r"sum to 4, but MindFormers requires num_layers 10 % \(pipeline_stage 4 x pp_interleave_num 1\) = 2"),
    ([1, 1], None, r"has 2 entries; it needs one per pipeline stage \(parallel_config.pipeline_stage 4\)"),
    ([3, -2, 0, 1], None, r"gives the stages \[\[5, 0, 2, 3\]\] decoder layers .* a stage cannot hold fewer than 0 \(first, last\) or 1"),
    ([[1, 1, 0, 0]], 2, r"must be 2 list\(s\) \(pp_interleave_num\) of 4 integers"),
])
def test_pipeline_invalid_offsets_are_one_line(tmp_path, capsys, offset, interleave, match):
    import re

    with pytest.raises(ConfigError, match=match) as err:
        quiet_convert(pipeline_graph(4, 10, offset=offset, interleave=interleave))
    assert "model.model_config.offset" in str(err.value) and "\n" not in str(err.value)
    path = tmp_path / "graph.yaml"
    path.write_text(yaml.safe_dump(pipeline_graph(4, 10, offset=offset, interleave=interleave)))
    assert main([str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and re.search(match, lines[0])


def test_pipeline_recompute_counts_follow_the_offset_stages():
    # stages 0-2 | 3-4 (offset [1, 0] on 5 layers): the first 2 of stage 0 and the first 1 of stage 1
    result = quiet_convert(pipeline_graph(2, 5, offset=[1, 0], micro=4, recompute_config={"recompute": [2, 1]}))
    assert result.pynative["recompute"]["full_recompute_layer"] == ["0-1", "3-3"]
    # interleaved: rank 0 holds stages 0-2 and 5-6; 3 layers go to its chunks in turn (0, 5, 1);
    # rank 1 (stages 3-4, 7-9): 1 layer -> 3
    g = pipeline_graph(2, 10, offset=[[1, 0], [0, 1]], interleave=2, micro=4, recompute_config={"recompute": [3, 1]})
    assert quiet_convert(g).pynative["recompute"]["full_recompute_layer"] == ["0-1", "3-3", "5-5"]
    with pytest.raises(ConfigError, match=r"recompute: per-stage counts \[1, 1, 1\] need one entry per pipeline stage"):
        quiet_convert(pipeline_graph(2, 4, micro=4, recompute_config={"recompute": [1, 1, 1]}))


def test_pipeline_micro_batches_and_world_size_are_checked():
    with pytest.raises(ConfigError, match="training.global_batch_size 4 gives 2 micro-batches"):
        quiet_convert(pipeline_graph(4, 8, micro=2))
    with pytest.raises(ConfigError, match="not divisible by tensor_parallel × context_parallel × pipeline_parallel = 4"):
        quiet_convert(pipeline_graph(4, 8), world_size=6)
    assert any("data_parallel becomes 4 (graph: 2)" in n for n in quiet_convert(pipeline_graph(4, 8), world_size=16).notes)


def test_gradient_accumulation_steps_sets_global_batch():
    g = small_graph(runner_config={"batch_size": 3, "gradient_accumulation_steps": 4})
    assert quiet_convert(g).pynative["training"]["global_batch_size"] == 4 * 2 * 3


@pytest.mark.parametrize("rc, recompute, comm", [
    ({"recompute": True, "select_recompute": True}, {"mode": "select", "select_module": {SELECT_PATTERN: ["0-2"]}},
     None),
    ({"recompute": 2, "mp_comm_recompute": False}, {"mode": "full", "full_recompute_layer": ["0-1"]},
     {"enable": False}),
    ({"recompute": [1]}, {"mode": "full", "full_recompute_layer": ["0-0"]}, None),
    ({"recompute": False, "select_recompute": False}, None, None),
])
def test_recompute_rows(rc, recompute, comm):
    pyn = quiet_convert(small_graph(recompute_config=rc)).pynative
    assert pyn.get("recompute") == recompute
    assert pyn.get("recompute_comm") == comm


def test_mp_comm_pattern_names_the_tensor_parallel_gathers_only():
    import re

    # the names lit_moe.strategies gives the sequence-parallel / MoE all-gathers, and FSDP's virtual one
    for path in ("self_attention.all_gather", "mlp.all_gather", "mlp.router.all_gather"):
        assert re.fullmatch(MP_COMM_PATTERN, path), path
    for path in ("fsdp.all_gather", "self_attention.reduce_scatter", "self_attention"):
        assert not re.fullmatch(MP_COMM_PATTERN, path), path


def test_legacy_moe_config_names():
    g = small_graph()
    mc = g["model"]["model_config"]
    for key in ("n_routed_experts", "num_experts_per_tok", "moe_router_enable_expert_bias"):
        mc.pop(key)
    g["moe_config"] = {"expert_num": 8, "num_experts_chosen": 2, "balance_via_topk_bias": True,
                       "topk_bias_update_rate": 0.002, "use_gating_sigmoid": True, "capacity_factor": -1,
                       "routing_policy": "TopkRouterV2", "n_group": 2}
    result = quiet_convert(g)
    m = result.pynative["model"]
    assert (m["n_routed_experts"], m["num_experts_per_tok"], m["moe_router_enable_expert_bias"]) == (8, 2, True)
    assert m["moe_router_score_function"] == "sigmoid"  # the key PyNative routes with
    assert m["n_group"] == 4  # model_config wins over moe_config
    assert "moe_expert_capacity_factor" not in m  # capacity_factor <= 0: dropless
    assert "moe_config.routing_policy" in result.dropped
    assert any("moe_config.n_group" in n for n in result.notes)
    # model_config wins for the update rate too (topk_bias_update_rate 0.002 is noted, not applied)
    assert m["moe_router_bias_update_rate"] == 0.001


def test_old_affinity_cpu_list_and_optimizer_family():
    g = small_graph(context={"affinity_cpu_list": {"device0": ["0-3"], "device1": ["4-7"]}},
                    optimizer={"type": "FusedAdamWeightDecay", "weight_decay": 0.1, "learning_rate": 1.e-3})
    result = quiet_convert(g)
    assert result.pynative["context"]["affinity_config"]["affinity_cpu_list"] == {"device0": ["0-3"],
                                                                                  "device1": ["4-7"]}
    assert result.pynative["optimizer"] == {"type": "AdamW", "weight_decay": 0.1}
    assert "optimizer.learning_rate" in result.dropped


@pytest.mark.parametrize("edit, field", [
    (lambda g: g["optimizer"].update(type="Came"), "optimizer.type"),
    (lambda g: g["lr_schedule"].update(type="StepLR"), "lr_schedule.type"),
    (lambda g: g["lr_schedule"].update(total_steps=-1), "--steps"),
    (lambda g: g["runner_config"].update(batch_size=0), "runner_config.batch_size"),
    (lambda g: g["lr_schedule"].update(learning_rate=-1.0), "lr_scheduler.learning_rate"),
    (lambda g: g["recompute_config"].update(recompute="yes"), "recompute_config.recompute"),
])
def test_errors_are_one_line_and_name_the_field(edit, field):
    g = small_graph(optimizer={"type": "AdamW"}, recompute_config={"recompute": True})
    edit(g)
    with pytest.raises(ConfigError) as err:
        quiet_convert(g)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_world_size_checks_the_layout():
    with pytest.raises(ConfigError, match="--world-size: 3 is not divisible by tensor_parallel"):
        quiet_convert(small_graph(), world_size=3)
    notes = quiet_convert(small_graph(), world_size=8).notes
    assert any("data_parallel becomes 4 (graph: 2)" in n for n in notes)


# ----------------------------------------------------------------------------------------------
# gradient_accumulation_steps on the fit command line
# ----------------------------------------------------------------------------------------------
def test_global_batch_from_accumulation():
    assert global_batch_from_accumulation(4, 2, 3) == 24
    with pytest.raises(ConfigError, match="gradient_accumulation_steps: must be a positive integer, got 0"):
        global_batch_from_accumulation(0, 2, 3)


def test_translate_gradient_accumulation(tmp_path, capsys):
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump({"training": {"local_batch_size": 3}}))
    argv = ["--config", str(cfg), "--gradient_accumulation_steps", "4", "--trainer.max_steps=2"]
    out = translate_gradient_accumulation(argv, data_parallel=2)
    assert out == ["--config", str(cfg), "--trainer.max_steps=2", "--training.global_batch_size=24"]
    assert "global_batch_size" in capsys.readouterr().err
    out = translate_gradient_accumulation(["--gradient_accumulation_steps=2", "--training.local_batch_size", "5"], 1)
    assert out[-1] == "--training.global_batch_size=10"
    assert translate_gradient_accumulation(["--config", "x.yaml"], 2) == ["--config", "x.yaml"]


# ----------------------------------------------------------------------------------------------
# the command, then plan and fit on the converted file
# ----------------------------------------------------------------------------------------------
def test_cli_writes_the_file_and_one_warning(tmp_path, capsys):
    out = tmp_path / "pynative.yaml"
    assert main([str(GRAPH), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    warning_lines = [ln for ln in err.splitlines() if "warning:" in ln]
    assert len(warning_lines) == 1 and "callbacks" in warning_lines[0]
    assert yaml.safe_load(out.read_text()) == quiet_convert(load_graph()).pynative


def test_cli_bad_input_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing.yaml" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"optimizer": {"type": "Lamb"}, "lr_schedule": {"type": "ConstantWarmUpLR",
                                                                                  "total_steps": 10}}))
    assert main([str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "optimizer.type" in err


@pytest.mark.timeout(600)
def test_converted_file_plans_and_trains_two_steps(tmp_path, capsys):
    from helpers import run_cli

    out = tmp_path / "pynative.yaml"
    assert main([str(GRAPH), "-o", str(out), "--world-size", "1"]) == 0
    pyn = yaml.safe_load(out.read_text())
    # "given data": the fixture's data_path is a placeholder; train on mock documents instead, and bind
    # to CPUs this machine has
    cfg = pyn["train_dataset"]["dataloader"]["config"]
    cfg.pop("data_path")
    cfg["mock"] = True
    cfg["vocab_size"] = pyn["model"]["vocab_size"]
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    device_0 = pyn["context"]["affinity_config"]["affinity_cpu_list"]["device_0"]
    device_0["affinity_cpu_list"] = [str(c) for c in cpus]
    if len(cpus) < 2:  # the fixture gives the data workers the second CPU
        device_0.pop("module_to_cpu_dict")
    run_cfg = tmp_path / "run.yaml"
    run_cfg.write_text(yaml.safe_dump(pyn, sort_keys=False))

    from lit_moe.strategies.plan import main as plan_main

    assert plan_main(["--config", str(run_cfg), "--world-size", "1"]) == 0
    assert "accumulation steps 2" in capsys.readouterr().out  # 4 // (1 × 2)

    # graph mode's --gradient_accumulation_steps is accepted on fit and becomes the global batch
    # (2 × data_parallel 1 × local batch 2 = 4, what the conversion wrote)
    result = run_cli(["fit", "--config", str(run_cfg), "--gradient_accumulation_steps", "2"], cwd=tmp_path,
                     timeout=540)
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert "step 2/2" in log, log[-3000:]
    assert "global_batch_size=4" in result.stderr
