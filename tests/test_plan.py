"""``lit_moe plan --config X --world-size N`` (issue 5, point 6): layouts validated on fake process
groups without workers or weights; the seed's 8-card table; per-rank bytes from the local shards."""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import torch
import yaml

from lit_moe.model.presets import DEEPSEEK_V3_671B
from lit_moe.strategies.plan import main, plan

ROOT = Path(__file__).resolve().parents[1]
SEED = yaml.safe_load((ROOT / "configs" / "pynative.yaml").read_text())

# seeds/001 §11.4: (tensor_parallel, expert_parallel, data_parallel as the table counts it)
SEED_TABLE = [(2, 1, 4), (4, 1, 2), (8, 1, 1), (1, 2, 4), (2, 2, 2)]


def _write(tmp_path: Path, cfg: dict, name: str = "plan.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(path)


def _seed_cfg(tp: int, ep: int, heads: int = 4, gbs: int = 64) -> dict:
    cfg = copy.deepcopy(SEED)
    cfg["parallelism"].update(tensor_parallel=tp, expert_parallel=ep, data_parallel_shard=-1)
    cfg["training"]["global_batch_size"] = gbs   # the sample's 2 is below data_parallel * local_batch_size
    cfg["model"]["num_attention_heads"] = heads
    return cfg


def _run(path: str, world: int) -> tuple[dict, str]:
    out = io.StringIO()
    result = plan(path, world, out=out)
    return result, out.getvalue()


@pytest.mark.parametrize("tp,ep,table_dp", SEED_TABLE)
def test_seed_table_rows_are_accepted(tmp_path, tp, ep, table_dp):
    # tensor_parallel 8 needs 8 heads; the sample model has 4 (see the next test)
    path = _write(tmp_path, _seed_cfg(tp, ep, heads=8))
    result, text = _run(path, 8)
    dims = result["dims"]
    assert dims.dp == 8 // tp                     # data_parallel = world / (tp * pp * cp)
    assert f"data_parallel {8 // tp} (= world_size / (tp * pp * cp))" in text
    assert result["accumulation"] == 64 // (8 // tp)
    if ep > 1:
        # the table counts ep as a separate factor; plan says which degree it uses and why
        assert table_dp == 8 // (tp * ep)
        assert "carved out of" in text
        assert f"would call this layout data_parallel {table_dp}" in text
        assert f"data_parallel stays {8 // tp}" in text
    else:
        assert table_dp == dims.dp


def test_sample_model_with_four_heads_rejects_tp8(tmp_path, capsys):
    path = _write(tmp_path, _seed_cfg(8, 1, heads=4))
    assert main(["--config", path, "--world-size", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tensor_parallel" in err[0] and "num_attention_heads 4" in err[0]


def test_sample_as_shipped_is_rejected_for_its_batch(tmp_path, capsys):
    """The seed's own 8-card sample (TP=2 → data_parallel 4) has global_batch_size 2 < 4 · 1."""
    assert main(["--config", str(ROOT / "configs" / "pynative.yaml"), "--world-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "global_batch_size" in err and "data_parallel(4)" in err


def _expected_local_values(cfg: dict, dims) -> float:
    """Values rank 0 should hold, from the model's global shapes and the layout rules (experts over
    dp_shard·cp·tp, tensor-parallel weights over fsdp·tp, the rest over fsdp), without parallelize."""
    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM

    tp_sharded = ("q_proj.weight", "q_b_proj.weight", "kv_b_proj.weight", "o_proj.weight", "gate_proj.weight",
                  "up_proj.weight", "down_proj.weight", "embed_tokens.weight", "lm_head.weight")
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg["model"]))
    fsdp = dims.dp_shard * dims.cp
    total = 0.0
    for name, p in model.named_parameters():
        if ".experts." in name:
            ways = fsdp * dims.tp
        elif dims.tp > 1 and name.endswith(tp_sharded):
            ways = fsdp * dims.tp
        else:
            ways = fsdp
        total += p.numel() / ways
    return total


@pytest.mark.parametrize("world,tp,cp,ep,shard", [(8, 2, 1, 2, -1), (16, 2, 2, 4, -1), (16, 1, 1, 4, 4)])
def test_per_rank_bytes_match_the_layout(tmp_path, world, tp, cp, ep, shard):
    cfg = _seed_cfg(tp, ep, heads=8, gbs=256)
    cfg["parallelism"].update(context_parallel=cp, data_parallel_shard=shard)
    result, text = _run(_write(tmp_path, cfg), world)
    mem = result["memory"]
    expected = _expected_local_values(cfg, result["dims"])
    assert abs(mem["params_numel"] - expected) <= 0.10 * expected, (mem["params_numel"], expected)
    assert mem["params"] == 4 * mem["params_numel"]            # fp32 master weights
    assert mem["optimizer"] == 2 * 4 * mem["params_numel"]     # AdamW: two fp32 moments
    assert "optimizer state (AdamW, fp32)" in text


def test_1024_ranks_deepseek_v3_671b(tmp_path):
    cfg = copy.deepcopy(SEED)
    cfg["model"] = dict(DEEPSEEK_V3_671B, seq_length=4096, num_nextn_predict_layers=0)
    cfg["training"].update(global_batch_size=4096, local_batch_size=1)
    cfg["parallelism"].update(tensor_parallel=8, context_parallel=2, expert_parallel=64, data_parallel_shard=32)
    result, text = _run(_write(tmp_path, cfg), 1024)
    dims = result["dims"]
    assert (dims.dp, dims.dp_replicate, dims.dp_shard, dims.efsdp) == (64, 2, 32, 8)
    assert result["accumulation"] == 64
    assert "HSDP (2 replicas x 32-way shards)" in text
    # 671B parameters, 37B active (the published DeepSeek-V3 numbers)
    assert 670e9 < result["total"] < 672e9 and 37e9 < result["active"] < 38e9
    expected = _expected_local_values(cfg, dims)
    assert abs(result["memory"]["params_numel"] - expected) <= 0.10 * expected
    assert "training FLOPs per token" in text


def test_plan_through_the_cli_and_bad_inputs(tmp_path, capsys):
    from lit_moe.cli import main as cli_main

    path = _write(tmp_path, _seed_cfg(2, 2, heads=8))
    assert cli_main(["plan", "--config", path, "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "mesh sparse [dp_replicate=1, efsdp=4, ep=2]" in out
    assert main(["--config", str(tmp_path / "missing.yaml"), "--world-size", "8"]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    tp4 = _write(tmp_path, _seed_cfg(4, 1, heads=8), "tp4.yaml")
    assert main(["--config", tp4, "--world-size", "6"]) == 2
    assert "world_size(6) is not divisible" in capsys.readouterr().err
    bad = _seed_cfg(2, 3, heads=8)
    assert main(["--config", _write(tmp_path, bad, "bad.yaml"), "--world-size", "8"]) == 2
    assert "ep(3)" in capsys.readouterr().err


def test_plan_takes_the_same_dotted_overrides_as_fit(tmp_path, capsys):
    """``--parallelism.expert_parallel 2`` changes one key and keeps the rest of the file (as fit does);
    a misspelled one is refused with a suggestion."""
    path = _write(tmp_path, _seed_cfg(tp=2, ep=1))
    assert main(["--config", path, "--world-size", "8", "--parallelism.expert_parallel", "2",
                 "--model.num_hidden_layers=4", "--training.global_batch_size", "32"]) == 0
    text = capsys.readouterr().out
    assert "expert_parallel 2: borrowed from" in text and "accumulation steps 8 (= 32 // 4)" in text
    plain = plan(path, 8, out=io.StringIO())
    overridden = plan(path, 8, out=io.StringIO(), overrides=[("parallelism.expert_parallel", "2")])
    assert overridden["dims"].ep == 2 and plain["dims"].ep == 1
    # expert parallel borrows the FSDP ranks: the experts' share per rank is unchanged
    assert overridden["memory"]["params_numel"] == plain["memory"]["params_numel"]
    assert main(["--config", path, "--world-size", "8", "--parallelism.expert_paralel", "2"]) == 2
    err = capsys.readouterr().err
    assert "expert_paralel" in err and "did you mean 'expert_parallel'" in err


# ------------------------------------------------------------------------------------------------
# fit's "does not fit" check: the exact bytes of the most loaded rank (issue 13, point 6)
# ------------------------------------------------------------------------------------------------
def _hand_state_bytes(shapes: dict, names, fsdp: int = 1, ep: int = 1, efsdp: int = 1) -> int:
    """fp32 weights + fp32 gradients + two fp32 AdamW moments = 16 bytes per local value. FSDP splits
    dim 0 as torch.chunk does (the first rank gets the ceiling) over ``fsdp`` ranks; the routed experts
    are split over ``ep`` ranks, then their FSDP over ``efsdp`` = dp_shard·cp·tp / ep ranks."""
    total = 0
    for name in names:
        shape = shapes[name]
        rest = 1
        for d in shape[1:]:
            rest *= d
        if ".experts." in name:
            total += -(-(shape[0] // ep) // efsdp) * rest
        else:
            total += -(-shape[0] // fsdp) * rest
    return 16 * total


def test_fit_memory_check_uses_the_exact_bytes_of_the_most_loaded_rank(tmp_path):
    """The per-rank bytes ``fit`` compares with the device memory are the exact ones of the rank that
    holds the most (hand-computed from the one-process model's shapes for FSDP, HSDP, expert and
    pipeline parallel); a limit between the old lower bound (whole model ÷ world) and those bytes is
    now refused, in one line with both numbers and what would make it fit."""
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import tiny_config

    from lit_moe.config import ConfigError, ParallelismConfig
    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM
    from lit_moe.strategies.parallel_dims import ParallelDims
    from lit_moe.strategies.plan import _fmt_bytes, check_fits, most_loaded_rank

    model_config = DeepseekV3Config(**tiny_config(tmp_path)["model"])
    with torch.device("meta"):
        plain = DeepseekV3ForCausalLM(model_config)
    shapes = {n: tuple(p.shape) for n, p in plain.named_parameters()}
    assert model_config.num_hidden_layers == 2 and model_config.num_nextn_predict_layers == 1
    whole = _hand_state_bytes(shapes, shapes)
    stage0 = [n for n in shapes if n.startswith(("embed_tokens.", "layers.0."))]
    stage1 = [n for n in shapes if not n.startswith(("embed_tokens.", "layers.0."))] + ["embed_tokens.weight"]
    cases = [  # (world, parallelism, expected bytes, which rank)
        (4, {}, _hand_state_bytes(shapes, shapes, fsdp=4, efsdp=4), "rank 0"),
        (4, {"data_parallel_shard": 2}, _hand_state_bytes(shapes, shapes, fsdp=2, efsdp=2), "rank 0"),  # HSDP 2×2
        (2, {"expert_parallel": 2}, _hand_state_bytes(shapes, shapes, fsdp=2, ep=2), "rank 0"),
        # MindFormers' stages: layer 0 + embedding; layer 1, norm, head, MTP + the MTP embedding copy
        (2, {"pipeline_parallel": 2}, max(_hand_state_bytes(shapes, stage0), _hand_state_bytes(shapes, stage1)),
         "pipeline rank 1"),
    ]
    refused_only_now = 0
    for world, keys, want, who in cases:
        parallelism = ParallelismConfig(**keys)
        dims = ParallelDims(world_size=world, dp_shard=parallelism.data_parallel_shard, tp=parallelism.tensor_parallel,
                            cp=parallelism.context_parallel, pp=parallelism.pipeline_parallel,
                            ep=parallelism.expert_parallel)
        assert most_loaded_rank(model_config, dims, parallelism) == (want, who), keys
        lower = whole // world
        assert want >= lower
        limit = (lower + want) // 2 if want > lower else want - 1
        refused_only_now += want > lower
        with pytest.raises(ConfigError) as err:
            check_fits(model_config, dims, parallelism, None, None, None, "cpu", 1, memory=(limit, "test limit"))
        line = str(err.value)
        assert "\n" not in line
        assert f"{who} of {world} needs {_fmt_bytes(want)}" in line and f"has {_fmt_bytes(limit)} (test limit)" in line
        for remedy in ("more ranks", "recompute", "training.local_batch_size"):
            assert remedy in line
        check_fits(model_config, dims, parallelism, None, None, None, "cpu", 1, memory=(want, "test limit"))
    assert refused_only_now == 2       # HSDP and the pipeline: the old lower bound let them through
