"""``lit_moe fit`` end to end with evaluation, LoRA, a CSV logger beside TensorBoard and the quiet
console: console lines without a terminal and on one (a pseudo-terminal), exact resume of a LoRA
run with evaluation, and ``convert-hf`` merging the adapters (transformers' logits on the export
against the adapter model's)."""

from __future__ import annotations

import csv
import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import ROOT, child_env, run_cli, scaled, tiny_config, write_config

LORA = {"target_modules": r"(q_b_proj|o_proj|experts|shared_experts\.\w+_proj)$", "lora_rank": 4, "lora_alpha": 8,
        "lora_b_std": 0.01}


def config(tmp_path: Path, steps: int = 4, **extra) -> dict:
    cfg = tiny_config(tmp_path, steps=steps)
    cfg["training"].update(eval_interval=2, eval_iters=2)
    dl = cfg["train_dataset"]["dataloader"]
    dl["sizes"] = [64, 16, 0]
    dl["config"]["split"] = "8, 2, 0"
    cfg["model"]["compute_dtype"] = "float32"
    cfg["lora_config"] = dict(LORA)
    cfg["checkpoint"].update(enable_save=True, save_interleaved_steps=2, save_max=5)
    cfg["trainer"] = {"logger": [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                                  "init_args": {"save_dir": str(tmp_path / "csv"), "name": "run"}}]}
    cfg.update(extra)
    return cfg


def model_tensors(iteration: Path) -> dict:
    out = {}
    for f in sorted(iteration.glob("*-model-*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    cfg = config(tmp)
    # Weights & Biases in offline mode beside the CSV logger (no network: it writes a .wandb file)
    cfg["trainer"]["logger"].append({"class_path": "lightning.pytorch.loggers.WandbLogger",
                                     "init_args": {"save_dir": str(tmp / "wandb"), "project": "lit_moe",
                                                   "offline": True}})
    # frozen norms (LoRA) at 1 + 0.2·N(0,1): the convert-hf comparison sees a swap of same-shaped norms
    cfg["callbacks"] = [{"class_path": "capture_callbacks.RandomNorms", "init_args": {"seed": 7}}]
    path = write_config(tmp, cfg)
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp / "wandb"), "WANDB_SILENT": "true",
           "PYTHONPATH": str(ROOT / "tests")}
    (tmp / "wandb").mkdir()
    proc = run_cli(["fit", "--config", str(path)], cwd=tmp, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, proc


def wandb_records(path: Path):
    """The records of an offline W&B run file (``run-*.wandb``): W&B's LevelDB-style log (a 7-byte
    header ``:W&B`` + magic + version, then 32 KiB blocks of chunks, each with a 7-byte header: CRC,
    length, type 1 full / 2 first / 3 middle / 4 last) of ``wandb_internal.Record`` protobufs."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:   # a block's tail too short for a chunk header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += room
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_console_without_a_terminal(full_run):
    tmp, proc = full_run
    lines = proc.stdout.splitlines()
    summary = [ln for ln in lines if ln.startswith("lit_moe: model ")]
    assert len(summary) == 1, proc.stdout
    assert re.search(r"parameters \(.* active per token\) \| .* trainable \| 128 tokens per step \(4 × 32\) \| "
                     r"1 process: dp 1 · tp 1 · cp 1 · ep 1 · pp 1 \| accumulation 2 × micro-batch 2", summary[0])
    assert [int(m.group(1)) for m in re.finditer(r"^step (\d+)/4 \| loss", proc.stdout, re.M)] == [1, 2, 3, 4]
    assert [int(m.group(1)) for m in re.finditer(r"^validation step (\d+) \| val/loss", proc.stdout, re.M)] == [2, 4]
    both = proc.stdout + proc.stderr
    for noise in ("Tip:", "litlogger", "GPU available", "TPU available", "Total params", "┏", "it/s",
                  "distributed_backend", "Traceback"):
        assert noise not in both, noise


def test_csv_logger_beside_tensorboard_and_hparams(full_run):
    tmp, _ = full_run
    rows = list(csv.DictReader(open(tmp / "csv" / "run" / "version_0" / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert [r["val/loss"] != "" for r in rows] == [False, True, False, True]
    assert all(r["train/loss"] and r["moe/max_load_imbalance"] for r in rows)
    hp = (tmp / "csv" / "run" / "version_0" / "hparams.yaml").read_text()
    assert "training/eval_interval: 2" in hp and "lora_config/lora_rank: 4" in hp
    runs = sorted((tmp / "tb" / "lit_moe").iterdir())
    assert [r.name for r in runs] == ["version_0"] and list(runs[0].glob("events.out.tfevents.*"))
    assert (runs[0] / "hparams.yaml").is_file()


def test_wandb_logger_offline_gets_the_csv_loggers_metrics(full_run):
    """``trainer.logger`` with ``WandbLogger`` (offline, ``WANDB_DIR`` in the run's directory): its run
    file holds, at every step, the metric names and values the CSV logger wrote, and the
    hyperparameters."""
    import json

    tmp, _ = full_run
    rows = {int(r["step"]): r for r in csv.DictReader(open(tmp / "csv" / "run" / "version_0" / "metrics.csv"))}
    files = list((tmp / "wandb").rglob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    history: dict[int, dict] = {}
    config_keys: dict[str, object] = {}
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            step = items.pop("trainer/global_step")
            history.setdefault(step, {}).update({k: v for k, v in items.items() if not k.startswith("_")})
        elif kind == "config":
            config_keys.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.config.update})
    assert sorted(history) == sorted(rows) == [1, 2, 3, 4]
    for step, row in rows.items():
        logged = {k: float(v) for k, v in row.items() if k not in ("step", "epoch") and v != ""}
        assert set(history[step]) - {"epoch"} == set(logged), (step, sorted(history[step]), sorted(logged))
        for name, value in logged.items():
            assert history[step][name] == pytest.approx(value, rel=1e-6), (step, name)
    assert "val/loss" in history[2] and "val/loss" not in history[3] and "train/loss" in history[3]
    assert config_keys.get("training/eval_interval") == 2 and config_keys.get("lora_config/lora_rank") == 4


def test_lora_run_with_evaluation_resumes_exactly(full_run, tmp_path):
    tmp, proc = full_run
    saved = tmp / "ckpt"
    cfg = config(tmp_path)
    cfg["checkpoint"].update(load_path=str(saved / "iteration_00000002"), no_load_optim=False)
    proc2 = run_cli(["fit", "--config", str(write_config(tmp_path, cfg))], cwd=tmp_path, timeout=400)
    assert proc2.returncode == 0, proc2.stderr[-3000:]

    def tail(out):
        return [ln.split(" | step_time")[0] for ln in out.splitlines() if re.match(r"step [34]/4 ", ln)] + \
               [ln.split(" | 2 micro")[0] for ln in out.splitlines() if ln.startswith("validation step 4")]

    assert tail(proc2.stdout) == tail(proc.stdout) and len(tail(proc.stdout)) == 3
    a, b = model_tensors(saved / "iteration_00000004"), model_tensors(tmp_path / "ckpt" / "iteration_00000004")
    assert set(a) == set(b) and any(k.endswith("lora_a") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # frozen base: identical to the step-2 checkpoint (the expert biases, buffers of the
    # aux-loss-free balancing rule, keep following the routing); adapters trained
    first = model_tensors(saved / "iteration_00000002")
    assert all(torch.equal(first[k], a[k]) for k in a if not k.endswith(("lora_a", "lora_b", "expert_bias")))
    assert any(not torch.equal(first[k], a[k]) for k in a if k.endswith("lora_b"))


def test_convert_hf_merges_the_adapters(full_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    tmp, _ = full_run
    out = tmp_path / "hf"
    proc = run_cli(["convert-hf", "--config", str(tmp / "config.yaml"), "--checkpoint", str(tmp / "ckpt"),
                    "--output", str(out)], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    import yaml

    from lit_moe.checkpoint.iteration import IterationReader, load_module
    from lit_moe.lora import apply_lora
    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = yaml.safe_load((tmp / "config.yaml").read_text())
    with torch.device("meta"):
        ours = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg["model"]))
    apply_lora(ours, cfg["lora_config"])
    ours.to_empty(device="cpu")
    ours.init_weights(0)
    load_module(ours, IterationReader(tmp / "ckpt" / "iteration_00000004"))
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    x = torch.randint(0, cfg["model"]["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours.eval()(x).logits, hf(x).logits
    assert (a - b).abs().max().item() <= 1e-4
    # and the adapters matter: the same model with the adapters switched off differs
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if n.endswith("lora_b"):
                p.zero_()
        assert (ours(x).logits - b).abs().max().item() > 1e-5
    # a base checkpoint with a lora_config is refused, in one line
    base = tmp_path / "base"
    cfg_plain = config(tmp_path)
    cfg_plain.pop("lora_config")
    cfg_plain["training"]["steps"] = 1
    cfg_plain["training"]["eval_interval"] = 0
    cfg_plain["checkpoint"].update(save_path=str(base), save_interleaved_steps=1)
    cfg_plain["trainer"] = {}
    assert run_cli(["fit", "--config", str(write_config(tmp_path, cfg_plain, "plain.yaml"))],
                   cwd=tmp_path, timeout=300).returncode == 0
    bad = run_cli(["convert-hf", "--config", str(tmp / "config.yaml"), "--checkpoint", str(base),
                   "--output", str(tmp_path / "x")], cwd=tmp_path, timeout=300)
    assert bad.returncode == 2 and "holds no LoRA adapters" in bad.stderr and "Traceback" not in bad.stderr


def test_console_on_a_terminal(tmp_path):
    """Under a pseudo-terminal: the progress bar carries the live numbers, the log lines come
    every log interval above it."""
    cfg = tiny_config(tmp_path, steps=4)
    cfg["monitor"]["tensorboard"]["log_interval"] = 2
    path = write_config(tmp_path, cfg)
    env = child_env(COLUMNS="200")
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))   # a 200-column terminal
    proc = subprocess.Popen([sys.executable, "-m", "lit_moe.cli", "fit", "--config", str(path)], cwd=tmp_path,
                            env=env, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + scaled(300)
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(master)
    screen = b"".join(chunks).decode("utf-8", "replace")
    assert proc.returncode == 0, screen[-3000:]
    assert re.search(r"step: +\d+%.*\d/4.*loss=\d", screen), screen[-2000:]      # the bar, with numbers
    assert [int(s) for s in re.findall(r"\bstep (\d)/4 \| loss", screen)] == [2, 4]  # every log interval
    # each log line is written on a cleared bar line and the bar redrawn below it
    assert re.search(r"\r +\rstep 2/4 \| loss[^\n]*\n\rstep: ", screen.replace("\r\n", "\n"))
    assert "Tip:" not in screen and "GPU available" not in screen and "┏" not in screen
