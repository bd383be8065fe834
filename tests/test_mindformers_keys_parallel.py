"""MindFormers' newest parallel keys (issue 31, point 4): ``moe_token_dispatcher_type:
alltoall_deredundancy`` (its byte count, hand-computed here; its results against one process and the
plain all-to-all in tests/test_parallel_numerics.py's ep2 launch), and the keys accepted without
effect (one line each when set) or refused (one line naming why). DualPipeV: tests/test_pipeline.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers import tiny_config, write_config
from lit_moe.cli import main
from lit_moe.config import (CheckpointConfig, ConfigError, NO_EFFECT_KEYS, ParallelismConfig, ProfilerConfig,
                            RecomputeConfig, SwapConfig, TrainDatasetConfig, check_not_yet_sections,
                            no_effect_notes)
from lit_moe.strategies.expert_parallel import destination_ranks, dispatch_row_bytes, resolve_dispatcher
from lit_moe.strategies.parallel_dims import ParallelDims, ParallelismError, check_parallel_layout, \
    check_parallelism_keys


# ----------------------------------------------------------------------------------------------
# alltoall_deredundancy
# ----------------------------------------------------------------------------------------------
def test_deredundancy_bytes_hand_computed():
    """4 experts on 2 ranks (rank 0: experts 0-1, rank 1: 2-3), top-2, hidden 16 in fp32, seen from
    rank 0. Assignments to rank 1: token 1 (expert 2), token 2 (2 and 3), token 3 (3): the plain
    all-to-all sends 4 rows of 64 + 4 bytes = 272 bytes; each token once: 3 rows of 64 + 2·(4 + 4)
    = 240 bytes. With token 2's expert 3 dropped (capacity) token 2 still goes, once."""
    indices = torch.tensor([[0, 1], [0, 2], [2, 3], [3, 1]])
    need = destination_ranks(indices, None, ep=2, local_experts=2)
    assert need.tolist() == [[True, False], [True, True], [False, True], [True, True]]
    plain_rows = int((indices // 2 == 1).sum())
    dedup_rows = int(need[:, 1].sum())
    assert (plain_rows, dedup_rows) == (4, 3)
    assert plain_rows * dispatch_row_bytes(16 * 4, 2, "alltoall") == 272
    assert dedup_rows * dispatch_row_bytes(16 * 4, 2, "alltoall_deredundancy") == 240
    # dropped assignments travel nowhere: without token 3's expert 3 (kept: its expert 1) and both of
    # token 2's, rank 1 gets token 1 only
    keep = torch.tensor([True, True, True, True, False, False, False, True])
    assert destination_ranks(indices, keep, ep=2, local_experts=2).tolist() == \
        [[True, False], [True, True], [False, False], [True, False]]


def test_deredundancy_is_accepted_with_mindformers_rule():
    ok = ParallelismConfig(expert_parallel=2, moe_token_dispatcher_type="alltoall_deredundancy",
                           npu_nums_per_device=2)
    check_parallelism_keys(ok)
    bad = ParallelismConfig(expert_parallel=2, moe_token_dispatcher_type="alltoall_deredundancy")
    with pytest.raises(ParallelismError, match="expert_parallel must be greater than or equal to npu_nums_per_device"):
        check_parallelism_keys(bad)
    # the model section's spelling counts too (it used to fall back to alltoall)
    assert resolve_dispatcher("alltoall", "alltoall_deredundancy") == "alltoall_deredundancy"
    assert resolve_dispatcher("alltoall_deredundancy", None) == "alltoall_deredundancy"


# ----------------------------------------------------------------------------------------------
# keys accepted without effect: one line each when set
# ----------------------------------------------------------------------------------------------
PARALLEL_NO_EFFECT = {   # the keys this file covers, with a non-default value each
    "parallelism.enable_loss_parallel": True,
    "parallelism.expert_parallel_async_d2h": True,
    "parallelism.expert_parallel_use_safe_tokens": False,
    "parallelism.pipeline_parallel_overlap_p2p": True,
    "parallelism.pipeline_parallel_overlap_b_f": True,
    "parallelism.pipeline_parallel_enable_dxdw_split": True,
    "parallelism.pipeline_parallel_p2p_transport": "auto",
    "checkpoint.reshard_worker_num": 4,
    "checkpoint.save_global_layout_cache": False,
    "train_dataset.use_distribute_dataset": True,
}
SECTIONS = {"parallelism": ParallelismConfig, "checkpoint": CheckpointConfig, "train_dataset": TrainDatasetConfig}


def test_no_effect_notes_name_each_key_set():
    assert set(PARALLEL_NO_EFFECT) <= set(NO_EFFECT_KEYS)
    defaults = {name: cls() for name, cls in SECTIONS.items()}
    assert no_effect_notes(defaults, {}) == []
    for key, value in PARALLEL_NO_EFFECT.items():
        section, _, name = key.partition(".")
        lines = no_effect_notes({**defaults, section: SECTIONS[section](**{name: value})}, {})
        assert len(lines) == 1 and lines[0].startswith(f"{key}: {value!r} has no effect in lit_moe: "), (key, lines)
        assert lines[0].endswith(NO_EFFECT_KEYS[key])
    assert no_effect_notes({}, {"use_remove_redundant_dataset": True}) == [
        f"use_remove_redundant_dataset: True has no effect in lit_moe: {NO_EFFECT_KEYS['use_remove_redundant_dataset']}"]


def test_fit_prints_the_notes(tmp_path, capsys):
    """``lit_moe fit`` prints them while validating (here it then stops on a bad optimizer type)."""
    cfg = tiny_config(tmp_path)
    cfg.setdefault("parallelism", {}).update(expert_parallel_async_d2h=True, pipeline_parallel_overlap_b_f=True)
    cfg["optimizer"] = {**cfg.get("optimizer", {}), "type": "NoSuchOptimizer"}
    code = main(["fit", "--config", str(write_config(tmp_path, cfg))])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2
    notes = [ln for ln in lines if "has no effect in lit_moe" in ln]
    assert [ln.split(":")[1].strip() for ln in notes] == ["parallelism.expert_parallel_async_d2h",
                                                          "parallelism.pipeline_parallel_overlap_b_f"], lines
    assert "NoSuchOptimizer" in lines[-1]


def test_pipeline_options_no_longer_refused():
    """MindFormers' schedule options change timing, not gradients: accepted (noted), any schedule."""
    from lit_moe.pipeline import check_pipeline_run

    cfg = SimpleNamespace(num_hidden_layers=4, num_nextn_predict_layers=0)
    for schedule, v in (("1f1b", 1), ("zbv", 2), ("dualpipev", 2)):
        p = ParallelismConfig(pipeline_parallel=2, pipeline_parallel_schedule=schedule,
                              pipeline_parallel_interleave_num=v, pipeline_parallel_overlap_p2p=True,
                              pipeline_parallel_overlap_b_f=True, pipeline_parallel_enable_dxdw_split=True,
                              pipeline_parallel_p2p_transport="auto")
        check_parallelism_keys(p)
        check_pipeline_run(p, cfg, 4, 4)
    with pytest.raises(ParallelismError, match="pipeline_parallel_p2p_transport"):
        check_parallelism_keys(ParallelismConfig(pipeline_parallel_p2p_transport="batch"))


def test_profile_cpu_chooses_the_activities():
    """MindFormers' rule (tools/profiler.py): the device's activity, plus the CPU's with profile_cpu."""
    from lit_moe.callbacks.profiler import recorded_activities

    assert ProfilerConfig().profile_cpu is True
    assert recorded_activities(True, "cpu", "cuda") == ["cpu", "cuda"]
    assert recorded_activities(False, "cpu", "cuda") == ["cuda"]
    # without an accelerator the CPU is the only thing to record
    assert recorded_activities(False, "cpu", None) == recorded_activities(True, "cpu", None) == ["cpu"]


# ----------------------------------------------------------------------------------------------
# refused in one line, naming why
# ----------------------------------------------------------------------------------------------
def test_refused_keys_say_why():
    dims = ParallelDims(4, dp_shard=4)
    check_parallel_layout(ParallelismConfig(dense_fsdp_shard_size=4), dims, SimpleNamespace())
    with pytest.raises(ParallelismError) as err:
        check_parallel_layout(ParallelismConfig(dense_fsdp_shard_size=2), dims, SimpleNamespace())
    msg = str(err.value)
    assert msg.startswith("parallelism.dense_fsdp_shard_size: 2") and "not implement" in msg and "\n" not in msg
    with pytest.raises(ConfigError) as err:
        check_not_yet_sections(SwapConfig(), RecomputeConfig(exclude_op=["matmul"]), {})
    msg = str(err.value)
    assert msg.startswith("recompute.exclude_op: ['matmul']") and "not implement" in msg and "\n" not in msg
    check_not_yet_sections(SwapConfig(), RecomputeConfig(exclude_op=[]), {})
