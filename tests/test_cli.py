"""The ``lit_moe fit`` command line: parsing, overrides and one-line configuration errors."""

from __future__ import annotations

import copy

import pytest
import yaml

from helpers import ROOT, run_cli, tiny_config, write_config
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
    """The seed's 8-card example, committed unchanged, parses; --print_config shows the flat sections."""
    code = None
    with pytest.raises(SystemExit) as exc:
        code = main(["fit", "--config", str(ROOT / "configs" / "pynative.yaml"), "--print_config"])
    assert exc.value.code in (0, None), code
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["lr_scheduler"]["learning_rate"] == pytest.approx(1e-5)
    assert isinstance(printed["optimizer"]["eps"], float)
    assert printed["parallelism"]["tensor_parallel"] == 2
    assert printed["model"]["n_routed_experts"] == 8
    assert printed["recompute"]["full_recompute_layer"] == ["0-3"]


def test_dotted_overrides_and_float_literal(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    path = write_config(tmp_path, cfg)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(path), "--training.steps", "10", "--model.hidden_size", "96",
              "--lr_scheduler.learning_rate", "1e-5", "--print_config"])
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


def test_empty_sections_take_their_defaults(tmp_path, capsys):
    """A section whose keys are all commented out (YAML null) means its defaults, at any depth."""
    path = write_config(tmp_path, tiny_config(tmp_path, steps=1))
    extra = tmp_path / "empty.yaml"
    extra.write_text("profiler:\nrecompute:\nmonitor:\n  tensorboard:\n")
    proc = run_cli(["fit", "--config", str(path), "--config", str(extra),
                    "--monitor.tensorboard.output_dir", str(tmp_path / "tb")], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "step 1/1" in proc.stdout + proc.stderr
