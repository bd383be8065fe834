"""LoRA under tensor and expert parallel through the real path: ``lit_moe fit`` with a ``lora_config``
section (docs/lora.md) under ``torch.distributed.run`` on 2 gloo ranks, tensor parallel 2 and then
expert parallel 2 (FSDP2 over 2 data-parallel ranks, the routed experts and their adapters split 2
ways) in one launch (this file, launched, runs the CLI's ``main`` for each layout in turn), against
the one-process run of the same YAML in this process: the loss and pre-clip gradient norm of every
step and the validation loss (the DataModule's valid split) at full precision, every adapter tensor
of the saved checkpoint, the frozen base weights (random norm weights) unchanged in every bit by
training and equal in every bit to the one-process run's, no gradient and no optimizer state for
them, and a saved checkpoint that loads into the one-process model."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import launch_pool
from helpers import ROOT, child_env, cli_in_process, scaled, tiny_config, write_config

STEPS = 3
# every linear layer and the routed experts: replicated (q_a_proj, kv_a_proj_with_mqa), column-parallel
# (q_b_proj, kv_b_proj, gate/up_proj), row-parallel (o_proj, down_proj) adapters, MTP's eh_proj
LORA = {"target_modules": ".*", "lora_rank": 4, "lora_alpha": 8, "lora_b_std": 0.02}
# the parallel layouts: command-line overrides of the one YAML (2 data-parallel ranks read eval_iters
# micro-batches each: one each is the one process's two)
LAYOUTS = {"tp2": ["--parallelism.tensor_parallel", "2"],
           "ep2": ["--parallelism.expert_parallel", "2", "--training.eval_iters", "1"]}
CHECKPOINT = f"ckpt/iteration_{STEPS:08d}"


def lora_config(tmp_path: Path) -> Path:
    """The run's YAML, with paths relative to the run's directory (every run reads this one file)."""
    cfg = tiny_config(tmp_path, steps=STEPS)
    cfg["model"]["compute_dtype"] = "float32"
    cfg["lora_config"] = dict(LORA)
    cfg["training"].update(eval_interval=STEPS, eval_iters=2)
    dl = cfg["train_dataset"]["dataloader"]
    dl["sizes"], dl["config"]["split"] = [32, 16, 0], "8, 2, 0"
    cfg["checkpoint"].update(enable_save=True, save_path="ckpt", save_interleaved_steps=STEPS)
    cfg["monitor"]["tensorboard"]["output_dir"] = "tb"
    # frozen norms at 1 + 0.2·N(0,1): a base weight moved to another rank's place shows
    cfg["callbacks"] = [{"class_path": "capture_callbacks.RandomNorms", "init_args": {"seed": 7}},
                        {"class_path": "capture_callbacks.StepRecorder", "init_args": {"path": "steps.jsonl"}},
                        {"class_path": "capture_callbacks.FrozenBaseWatch", "init_args": {"path": "base.json"}}]
    return write_config(tmp_path, cfg, "lora.yaml")


def fit_argv(config: Path, layout: str | None = None) -> list[str]:
    return ["fit", "--config", str(config), "--trainer.enable_progress_bar", "false", *LAYOUTS.get(layout, [])]


def run_layouts(config: Path, names: list[str]) -> None:
    """In each launched process: ``lit_moe fit`` of every layout in turn, each in its own directory."""
    from lit_moe.cli import main

    launch = dict(os.environ)
    for name in names:
        # each fit rendezvouses afresh, as a restart attempt of torchrun does (lit_moe.runtime.elastic): the
        # launch's variables back (the previous fit moved MASTER_PORT to its own store), a run id of its own
        os.environ.clear()
        os.environ.update(launch, TORCHELASTIC_RUN_ID=f"{launch.get('TORCHELASTIC_RUN_ID', '')}-{name}")
        os.chdir(config.parent / name)
        if main(fit_argv(config, name)) != 0:
            raise SystemExit(f"lit_moe fit ({name}) failed")


def checkpoint(run_dir: Path) -> dict[str, torch.Tensor]:
    """The full model tensors of the saved checkpoint, loaded into the one-process adapted model (any
    layout's checkpoint loads there), and the names of the optimizer's saved tensors."""
    from lit_moe.checkpoint.iteration import IterationReader, load_module
    from lit_moe.lora import apply_lora
    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM
    import yaml

    cfg = yaml.safe_load((run_dir.parent / "lora.yaml").read_text())
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**cfg["model"], "compute_dtype": "float32"}))
    apply_lora(model, cfg["lora_config"])
    model.to_empty(device="cpu")
    model.init_weights(0)   # other values than the run's: the load must overwrite every tensor
    reader = IterationReader(run_dir / CHECKPOINT)
    load_module(model, reader)
    return {**{n: p.detach().clone() for n, p in model.named_parameters()},
            "optimizer_keys": sorted(reader.index("opt").keys())}


def run_record(run_dir: Path) -> dict:
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    return {"steps": steps, "val": json.loads((run_dir / "steps.jsonl.val.json").read_text()),
            "base": json.loads((run_dir / "base.json").read_text()), "tensors": checkpoint(run_dir)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_layouts")
    config = lora_config(tmp)
    for name in ["one", *LAYOUTS]:
        (tmp / name).mkdir()
    launch = launch_pool.Ranks(2, [str(Path(__file__).resolve()), "--layouts", str(config), *LAYOUTS], cwd=tmp,
                               env=child_env(ROOT / "tests"))
    # the launch variables the in-process run sets (MASTER_PORT, ...): conftest restores them per test,
    # but this fixture is module-scoped, so it restores them itself (a later launch would reuse the port)
    saved = dict(os.environ)
    try:   # the one-process run meanwhile, in this process (it needs no isolation)
        capfd = _NoCapture()
        one = cli_in_process(fit_argv(config), capfd, cwd=tmp / "one")
        assert one.returncode == 0
        done = launch.wait(scaled(600))
    finally:
        os.environ.clear()
        os.environ.update(saved)
        launch.stop()   # (the ranks, if the one-process run failed)
    assert done.returncode == 0, done.stdout[-6000:]
    return {name: run_record(tmp / name) for name in ["one", *LAYOUTS]}


class _NoCapture:
    """``cli_in_process`` without pytest's capfd (the fixture is module-scoped): output goes to the
    terminal / pytest's own capture."""

    def readouterr(self):
        return "", ""


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_through_the_cli_matches_one_process(name, runs):
    got, ref = runs[name], runs["one"]
    assert [r["step"] for r in got["steps"]] == [r["step"] for r in ref["steps"]] == list(range(1, STEPS + 1))
    # full precision, relative: measured worst 7.1e-8 (loss, MTP loss, pre-clip grad norm; tp2 and ep2)
    for g, r in zip(got["steps"], ref["steps"]):
        for key in ("loss", "mtp_loss", "grad_norm"):
            assert _rel(g[key], r[key]) <= 5e-7, (name, g["step"], key, g[key], r[key])
    assert ref["steps"][0]["loss"] != ref["steps"][-1]["loss"]
    # the validation loss on the same samples: measured 0.0 (tp2, ep2); bound a few fp32 ulps
    assert sorted(got["val"]) == sorted(ref["val"]) == [str(STEPS)]
    assert _rel(got["val"][str(STEPS)], ref["val"][str(STEPS)]) <= 5e-7, (name, got["val"], ref["val"])
    adapters = sorted(n for n in ref["tensors"] if n.endswith(("lora_a", "lora_b")))
    assert len(adapters) > 40
    for run in (got, ref):
        # training moved every adapter and no base weight (in any bit); no base weight had a gradient,
        # requires_grad or optimizer state
        base = run["base"]
        assert base["changed"] == base["with_grad"] == base["trainable"] == base["optimizer"] == adapters, name
        # the saved optimizer state: the adapters' AdamW moments and steps only
        saved = {k.split("/")[1] for k in run["tensors"]["optimizer_keys"]}
        assert saved == {"model." + n for n in adapters}, (name, sorted(saved - {"model." + n for n in adapters}))
    # the saved checkpoint, loaded into the one-process model: base weights equal in every bit to the
    # one process's (layout-independent initialisation, frozen), every adapter close
    gt, rt = got["tensors"], ref["tensors"]
    assert set(gt) == set(rt)
    worst = {}
    for key, want in rt.items():
        if key in adapters:
            worst[key] = float((gt[key] - want).abs().max() / want.abs().max())
        elif key != "optimizer_keys":
            assert torch.equal(gt[key], want), (name, key)
    # worst adapter element relative to its tensor's largest: measured 7.0e-5 (tp2), 7.7e-5 (ep2) after
    # three AdamW steps (whose normalised updates magnify the last bits of tiny gradients)
    assert max(worst.values()) <= 5e-4, (name, sorted(worst.items(), key=lambda kv: -kv[1])[:3])


if __name__ == "__main__" and sys.argv[1:2] == ["--layouts"]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    run_layouts(Path(sys.argv[2]), sys.argv[3:])
