"""MindFormers' own DeepSeek-V3 PyNative test configs (tests/data/mindformers_pynative/, copied from its
repository as data) load, plan and train their shrunk model in lit_moe; MindFormers' newest model and
monitor keys mean what they mean there or say why they have no effect."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import yaml

from helpers import tiny_config, write_config
from lit_moe.cli import main

DATA = Path(__file__).parent / "data" / "mindformers_pynative"
# (pynative_deepseek4.yaml: tests/test_family_v4.py, which refuses its tp2·pp2 layout and trains in one process)
FIXTURES = sorted(p.name for p in DATA.glob("*.yaml") if p.name != "pynative_deepseek4.yaml")

# pynative_ds3.yaml's model at a size a CPU test trains (its other keys are kept as written)
DS3_SHRINK = dict(vocab_size=512, seq_length=32, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=2, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
                  qk_nope_head_dim=16, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                  max_position_embeddings=64)


def shrunk(name: str, tmp_path: Path) -> dict:
    """The fixture with a CPU-sized model, mock data for one step and outputs under ``tmp_path``."""
    cfg = yaml.safe_load((DATA / name).read_text())
    if cfg["model"]["hidden_size"] > 64:
        cfg["model"].update(DS3_SHRINK)
    seq = cfg["model"]["seq_length"]
    tiny = tiny_config(tmp_path, steps=1)
    cfg["train_dataset"] = tiny["train_dataset"]           # MindDataset "train_dataset" is not shipped
    cfg["train_dataset"]["dataloader"]["config"]["seq_length"] = seq
    cfg["training"].update(steps=1)
    cfg["checkpoint"].update(save_path=str(tmp_path / "ckpt"))
    cfg["monitor"] = {**cfg.get("monitor", {}), "tensorboard": {"output_dir": str(tmp_path / "tb")}}
    if "profiler" in cfg:
        cfg["profiler"].update(output_path=str(tmp_path / "profile"), start_step=1, end_step=1)
    return cfg


@pytest.mark.parametrize("name", FIXTURES)
def test_mindformers_pynative_config_plans_and_trains(name, tmp_path, capsys):
    assert {"pynative_ds3.yaml", "monitor_test.yaml", "profiler_test.yaml"} <= set(FIXTURES)
    text = (DATA / name).read_text()
    assert text.startswith("# Test data: MindFormers' own PyNative test config") and "Source: mindspore-ai" in text
    path = write_config(tmp_path, shrunk(name, tmp_path))
    assert main(["plan", "--config", str(path), "-n", "1"]) == 0, capsys.readouterr().err
    assert main(["fit", "--config", str(path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "step 1/1 | loss" in out


# ----------------------------------------------------------------------------------------------
# model.chunk_loss_num, model.embedding_params_dtype, monitor.tensorboard.queue_size
# ----------------------------------------------------------------------------------------------
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=2, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
             v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, seq_length=32,
             n_group=1, topk_group=1, moe_grouped_gemm=True, mtp_loss_scaling_factor=0.3)


@pytest.mark.parametrize("key, value", [("chunk_loss_num", 4), ("embedding_params_dtype", "float32")])
def test_loss_and_embedding_keys_have_no_effect_and_say_so(key, value, caplog):
    from lit_moe.config import NO_EFFECT_KEYS
    from lit_moe.model import DeepseekV3Config
    from lit_moe.model.mindformers_defaults import read_pynative_model_section

    assert f"model.{key}" in NO_EFFECT_KEYS   # the README's table and the model section read this list
    plain = DeepseekV3Config(**read_pynative_model_section(dict(SMALL)))
    with caplog.at_level(logging.INFO, logger="lit_moe.config"):
        with_key = DeepseekV3Config(**read_pynative_model_section({**SMALL, key: value}))
    assert with_key == plain
    lines = [r.getMessage() for r in caplog.records if r.name == "lit_moe.config"]
    assert len(lines) == 1 and lines[0].startswith(f"model.{key}: {value!r} has no effect in lit_moe (")


@pytest.mark.parametrize("key, value, shown", [
    ("chunk_loss_num", -1, "model.chunk_loss_num: must be an integer >= 0, got -1"),
    ("chunk_loss_num", "4", "model.chunk_loss_num: must be an integer >= 0, got '4'"),
    ("embedding_params_dtype", "bfloat16", "model.embedding_params_dtype: only float32"),
])
def test_loss_and_embedding_keys_bad_values(key, value, shown):
    from lit_moe.config import ConfigError
    from lit_moe.model import DeepseekV3Config
    from lit_moe.model.mindformers_defaults import read_pynative_model_section

    with pytest.raises(ConfigError) as err:
        DeepseekV3Config(**read_pynative_model_section({**SMALL, key: value}))
    assert str(err.value).startswith(shown) and "\n" not in str(err.value)


def test_tensorboard_queue_size_reaches_the_writer(tmp_path):
    from lit_moe.callbacks.loggers import build_logger
    from lit_moe.config import ConfigError, MonitorConfig, TensorBoardConfig

    monitor = MonitorConfig(tensorboard=TensorBoardConfig(output_dir=str(tmp_path), queue_size=7))
    writer = build_logger(monitor).experiment
    assert writer.max_queue == 7   # SummaryWriter(max_queue=...), as MindFormers' monitor
    monitor.tensorboard.queue_size = 0
    with pytest.raises(ConfigError, match=r"^monitor.tensorboard.queue_size: must be an int >= 1, got 0$"):
        build_logger(monitor)
