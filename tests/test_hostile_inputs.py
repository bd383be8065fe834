"""Hostile or edge inputs to ``lit_moe fit`` / ``lit_moe plan`` (issue 27): each ends in one line naming
the key, path or value, exit code 2 and no traceback, or behaves as the README says. In-process calls
of the CLI's ``main``; one resume case runs two data-parallel processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, cli_in_process, run_cli, tiny_config, write_config
from lit_moe.cli import main


def _one_line(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


# -- each case: how to make the config (tmp_path, cfg) -> extra argv; words of the one line --------
def _misspelled_dataloader_config(tmp, cfg):
    dl = cfg["train_dataset"]["dataloader"]
    dl["confg"] = dl.pop("config")
    return []


def _no_data_at_all(tmp, cfg):
    del cfg["train_dataset"]["dataloader"]["config"]["mock"]
    return []


def _profiler_under_a_file(tmp, cfg):
    (tmp / "afile").write_text("x")
    cfg["profiler"] = {"enable_profiling": True, "output_path": str(tmp / "afile" / "prof")}
    return []


def _callback_syntax_error(tmp, cfg):
    (tmp / "broken_cb.py").write_text("def oops(:\n")
    cfg["callbacks"] = [{"class_path": "broken_cb.MyCallback"}]
    return []


def _tracker_is_a_directory(tmp, cfg):
    cfg["checkpoint"].update(enable_save=True, save_path=str(tmp / "ckpt"))
    (tmp / "ckpt" / "latest_checkpointed_iteration.txt").mkdir(parents=True)
    return []


def _short_learned_position_table(tmp, cfg):
    cfg["model"].update(position_embedding_type="learned_absolute", max_position_embeddings=8)
    return []


def _huge_value(tmp, cfg):
    cfg["training"]["steps"] = "x" * 200_000
    return []


def _logger_missing_class(tmp, cfg):
    cfg["trainer"] = {"logger": {"class_path": "lightning.pytorch.loggers.NoSuchLogger"}}
    return []


def _logger_bad_init_arg(tmp, cfg):
    cfg["trainer"] = {"logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                                 "init_args": {"save_dir": str(tmp), "flush_every": 1}}}
    return []


def _fifo_config(tmp, cfg):
    os.mkfifo(tmp / "fifo.yaml")
    return ["--config", str(tmp / "fifo.yaml")]   # the last --config: nobody writes to it


def _huge_batch_fast_dev_run(tmp, cfg):
    cfg["training"]["global_batch_size"] = 10 ** 12
    return ["--trainer.fast_dev_run", "true"]


HOSTILE = {
    "dataloader.confg": (_misspelled_dataloader_config,
                         ["train_dataset.dataloader.confg", "did you mean 'config'"]),
    "no data path, no mock": (_no_data_at_all, ["train_dataset.dataloader.config.data_path", "mock: true"]),
    "trainer.strategy ddp": (lambda tmp, cfg: ["--trainer.strategy", "ddp"], ["trainer.strategy", "'ddp'"]),
    "trainer.accelerator tpu": (lambda tmp, cfg: ["--trainer.accelerator", "tpu"],
                                ["trainer.accelerator", "'tpu'", "not available"]),
    "profiler.output_path under a file": (_profiler_under_a_file, ["profiler.output_path", "afile", "not a directory"]),
    "callback module syntax error": (_callback_syntax_error,
                                     ["callbacks[0].class_path", "broken_cb", "syntax error", "line 1"]),
    "tracker is a directory": (_tracker_is_a_directory,
                               ["checkpoint.save_path", "latest_checkpointed_iteration.txt", "not a file"]),
    "learned position table too short": (_short_learned_position_table,
                                         ["model.max_position_embeddings", "8", "seq_length 32"]),
    "200 kB value": (_huge_value, ["training.steps", "199,900 characters"]),
    "trainer.logger missing class": (_logger_missing_class, ["trainer.logger.class_path", "NoSuchLogger"]),
    "trainer.logger bad init_args": (_logger_bad_init_arg,
                                     ["trainer.logger.init_args.flush_every", "CSVLogger",
                                      "did you mean 'flush_logs_every_n_steps'"]),
    "FIFO as --config": (_fifo_config, ["--config", "fifo.yaml", "not a regular file"]),
    "one step longer than the data": (_huge_batch_fast_dev_run, ["train_dataset", "sizes"]),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_input_is_one_line(tmp_path, capsys, case):
    make, words = HOSTILE[case]
    cfg = tiny_config(tmp_path, steps=4)
    extra = make(tmp_path, cfg)
    line = _one_line(capsys, ["fit", "--config", str(write_config(tmp_path, cfg)), *extra])
    for word in words:
        assert word in line, line
    assert len(line) < 1200, len(line)


def test_plan_refuses_what_fit_refuses(tmp_path, capsys):
    """A zero-bubble schedule on FSDP stages with reshard 'always': plan and fit, the same line."""
    cfg = tiny_config(tmp_path, steps=4)
    cfg["model"].update(num_hidden_layers=4, num_nextn_predict_layers=0)
    cfg["training"].update(local_batch_size=1, global_batch_size=4)
    cfg["parallelism"].update(pipeline_parallel=2, pipeline_parallel_schedule="interleaved_zb",
                              pipeline_parallel_interleave_num=2, reshard_after_forward_policy="always")
    path = str(write_config(tmp_path, cfg))
    planned = _one_line(capsys, ["plan", "--config", path, "-n", "4"])
    fitted = _one_line(capsys, ["fit", "--config", path, "--trainer.devices", "4",
                                "--trainer.accelerator", "cpu"])
    why = "parallelism.reshard_after_forward_policy: 'always' cannot be used with pipeline_parallel_schedule"
    assert why in planned and why in fitted, (planned, fitted)


def test_readme_examples_run_as_written(tmp_path, capsys):
    """``init_args: {peak_flops: 3.76e14}`` (YAML 1.1 would read a string) and MindFormers' form of
    ``context.affinity_config`` (``device_0`` directly under it), copied from the README."""
    readme = (ROOT / "README.md").read_text()
    assert "    init_args: {peak_flops: 3.76e14}\n" in readme and "  affinity_config:\n    device_0:\n" in readme
    cpu = sorted(os.sched_getaffinity(0))[0]
    text = yaml.safe_dump(tiny_config(tmp_path, steps=1), sort_keys=False) + f"""
callbacks:
  - class_path: lit_moe.callbacks.ThroughputMFU
    init_args: {{peak_flops: 3.76e14}}
context:
  affinity_config:
    device_0:
      affinity_cpu_list: ["{cpu}"]
      module_to_cpu_dict:
        main: [0]
"""
    path = tmp_path / "readme.yaml"
    path.write_text(text)
    assert main(["fit", "--config", str(path), "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["callbacks"][0]["init_args"]["peak_flops"] == 3.76e14
    assert printed["context"]["affinity_config"] == {
        "enable": True, "affinity_cpu_list": {"device_0": {"affinity_cpu_list": [str(cpu)],
                                                           "module_to_cpu_dict": {"main": [0]}}}}
    before = os.sched_getaffinity(0)
    try:
        assert main(["fit", "--config", str(path), "--trainer.enable_progress_bar", "false"]) == 0, \
            capsys.readouterr().err[-3000:]
        assert os.sched_getaffinity(0) == {cpu}
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.parametrize("text,value", [("3.76e14", 3.76e14), ("1e-5", 1e-5), ("1.e-8", 1e-8), ("-2E3", -2000.0),
                                        ("7", 7), ("1e5x", "1e5x")])
def test_yaml_numbers_are_read_as_yaml_1_2_reads_them(text, value):
    from lit_moe.config_file import parse_value, parse_yaml

    for read in (parse_yaml(f"k: {text}", "test")["k"], parse_value(text, "--k")):
        assert read == value and type(read) is type(value), (text, read)


def test_consumed_samples_are_the_loaders_and_resume_on_two_ranks(tmp_path, capfd):
    """One consumed-samples number: the samples the loader handed over. global_batch_size 5 with
    local batch 2 on one rank takes 2 micro-batches (4 samples) a step: the step metrics and
    common.json say 4, 8, ... (they said 5, 10), and the console's summary line counts the tokens of
    4 samples a step (it said 5). Its step-1 checkpoint then resumes on 2 data-parallel ranks (4 is
    divisible by 2; 5 was refused). Issue 29's case, dp 2, local batch 1, global batch 3 (one
    micro-batch of 2 samples a step), resumes on the same 2 ranks from its step-1 checkpoint."""
    env = {"PYTHONPATH": str(Path(__file__).parent), "PYTHONWARNINGS": "ignore"}

    def fit(cfg: dict, name: str, *extra: str) -> str:
        args = ["fit", "--config", str(write_config(tmp_path, cfg, name)), "--trainer.enable_progress_bar", "false",
                *extra]
        if "--trainer.devices" in extra and extra[extra.index("--trainer.devices") + 1] == "1":
            proc = cli_in_process(args, capfd, cwd=tmp_path)    # one process: no interpreter start
        else:
            proc = run_cli(args, cwd=tmp_path, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stdout + proc.stderr

    for name, first, then, lbs, gbs, per_step in (("one_rank_gbs5", "1", "2", 2, 5, 4),
                                                  ("dp2_gbs3", "2", "2", 1, 3, 2)):
        cfg = tiny_config(tmp_path, steps=2)
        cfg["training"].update(local_batch_size=lbs, global_batch_size=gbs)
        cfg["checkpoint"].update(enable_save=True, save_path=str(tmp_path / name), save_interleaved_steps=1)
        cfg["monitor"]["tensorboard"]["output_dir"] = str(tmp_path / f"tb_{name}")
        out = fit(cfg, f"{name}.yaml", "--trainer.devices", first, "--trainer.max_steps", "1")
        assert f"{per_step * 32:,} tokens per step ({per_step} × 32)" in out, out[-3000:]   # seq_length 32
        assert f"step 1/2 | " in out and f"| samples {per_step} |" in out, out[-3000:]      # the step metrics
        common = json.loads((tmp_path / name / "iteration_00000001" / "common.json").read_text())
        loader = common["trainer_state"]["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
        assert common["consumed_samples"] == loader["consumed_samples"] == per_step, common
        fit(cfg, f"{name}.yaml", "--trainer.devices", then)      # auto-resume to step 2
        common = json.loads((tmp_path / name / "iteration_00000002" / "common.json").read_text())
        resumed_per_step = 2 * lbs * (gbs // (2 * lbs))        # the second run has 2 data-parallel ranks
        assert common["consumed_samples"] == per_step + resumed_per_step, common


def test_fast_dev_run_is_one_optimizer_step(tmp_path, capsys):
    """Lightning's fast_dev_run counts micro-batches (1 of the step's 2 never made a step, and the
    step callbacks met no step); here it runs one whole optimizer step."""
    path = write_config(tmp_path, tiny_config(tmp_path, steps=4))
    assert main(["fit", "--config", str(path), "--trainer.fast_dev_run", "true",
                 "--trainer.enable_progress_bar", "false"]) == 0, capsys.readouterr().err[-3000:]
    captured = capsys.readouterr()
    assert "step 1/4" in captured.out + captured.err and "step 2/4" not in captured.out + captured.err


def test_plan_and_convert_config_share_the_file_rules_and_the_bounded_line(tmp_path, capsys):
    """The other readers of a config: a FIFO is refused unopened, a 200 kB value is cut."""
    os.mkfifo(tmp_path / "fifo.yaml")
    for argv in (["plan", "--config", str(tmp_path / "fifo.yaml"), "-n", "1"],
                 ["convert-config", str(tmp_path / "fifo.yaml"), "-o", str(tmp_path / "out.yaml")]):
        line = _one_line(capsys, argv)
        assert "fifo.yaml" in line and "not a regular file" in line, line
    cfg = tiny_config(tmp_path)
    cfg["parallelism"]["tensor_parallel"] = "y" * 200_000
    line = _one_line(capsys, ["plan", "--config", str(write_config(tmp_path, cfg)), "-n", "1"])
    assert "tensor_parallel" in line and len(line) < 1200, line[:300]


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_tracker_that_is_not_a_file_is_one_line_at_load(tmp_path, kind):
    from lit_moe.checkpoint.layout import TRACKER, CheckpointError, read_tracker

    (os.mkfifo if kind == "fifo" else os.mkdir)(tmp_path / TRACKER)
    with pytest.raises(CheckpointError, match="tracker .* (not a regular file|Is a directory)"):
        read_tracker(tmp_path)
