"""Checkpoints through the real ``lit_moe fit`` CLI (``python -m lit_moe.cli fit --config ...``), in
fresh processes (the one-process resumes inside the test process: ``helpers.cli_in_process``), on
CPU/gloo:

* exact resume: 8 steps straight == 4 steps, then a new process resuming to 8 (bit-identical losses,
  the same samples, the same learning rates at every step);
* resharding: a checkpoint saved by 2 data-parallel (FSDP2) ranks resumes under tensor parallel 2,
  expert parallel 2 and in one process, with the same loss on the next step as the run that saved it.

``StepProbe`` (added through the config's ``callbacks:`` list) writes, per optimizer step, the exact
loss, learning rate and a fingerprint of every micro-batch's tokens to a JSON-lines file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from lightning.pytorch import Callback

TESTS = Path(__file__).resolve().parent


def _full(t):
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).cpu().clone()


def training_state(trainer, pl_module) -> dict:
    """Every tensor of the model (parameters and buffers) and of the optimizer's state, as full tensors
    by name (a collective under FSDP/TP/EP: every rank calls it)."""
    model = pl_module.model
    persistent = set(model.state_dict())          # not the per-step counters (never saved)
    out = {f"model.{n}": _full(t) for n, t in [*model.named_parameters(), *model.named_buffers()] if n in persistent}
    state = trainer.optimizers[0].state
    for n, p in model.named_parameters():
        for key, value in state.get(p, {}).items():
            if hasattr(value, "shape"):
                out[f"optimizer.{n}.{key}"] = _full(value)
    return out


class StepProbe(Callback):
    """Records ``{"step", "loss", "lr", "consumed", "batches"}`` per optimizer step (rank 0); with
    ``dump``, also every tensor of the training state (:func:`training_state`) after step
    ``dump_step``, or as restored at train start when ``dump_step`` is 0."""

    def __init__(self, path: str, dump: str = "", dump_step: int = -1, dump_end: str = "") -> None:
        self.path, self.dump, self.dump_step, self.dump_end = path, dump, dump_step, dump_end
        self.batches: list[str] = []

    def on_train_end(self, trainer, pl_module) -> None:
        if self.dump_end:   # the final training state (what checkpoint.save_hf_at_end exports)
            self.dump = self.dump_end
            self._dump(trainer, pl_module)

    def _dump(self, trainer, pl_module) -> None:
        import torch

        state = training_state(trainer, pl_module)
        if trainer.is_global_zero:
            torch.save(state, self.dump)

    def on_train_start(self, trainer, pl_module) -> None:
        if self.dump and self.dump_step == 0:
            self._dump(trainer, pl_module)

        def record(module, args, kwargs):  # every micro-batch's tokens, as the model receives them
            ids = kwargs["input_ids"].detach().cpu().contiguous()
            self.batches.append(hashlib.sha1(ids.numpy().tobytes()).hexdigest()[:16])

        pl_module.model.register_forward_pre_hook(record, with_kwargs=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        m = pl_module.step_metrics  # once per optimizer step
        if trainer.is_global_zero:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": m.step, "loss": repr(m.loss), "lr": repr(m.lr),
                                    "consumed": m.consumed_samples, "batches": self.batches}) + "\n")
        self.batches = []
        if self.dump and m.step == self.dump_step:
            self._dump(trainer, pl_module)


def _helpers():
    import sys

    sys.path.insert(0, str(TESTS))
    import helpers

    return helpers


def _config(tmp_path: Path, name: str, probe: Path, steps: int, checkpoint: dict, dataloader: dict | None = None,
            dump: tuple[Path, int] | None = None, dump_end: Path | None = None, **model) -> Path:
    h = _helpers()
    cfg = h.tiny_config(tmp_path, steps=steps)
    cfg["training"]["deterministic"] = True
    cfg["model"].update(compute_dtype="float32", **model)
    cfg["train_dataset"]["dataloader"].update(dataloader or {})
    cfg["train_dataset"]["dataloader"]["config"]["vocab_size"] = cfg["model"]["vocab_size"]
    cfg["train_dataset"]["dataloader"]["sizes"] = [steps * 4 * 4, 0, 0]
    cfg["checkpoint"] = {**cfg["checkpoint"], "enable_save": False, **checkpoint}
    probe_args = {"path": str(probe)} if dump is None else {"path": str(probe), "dump": str(dump[0]),
                                                            "dump_step": dump[1]}
    if dump_end is not None:
        probe_args["dump_end"] = str(dump_end)
    cfg["callbacks"] = [{"class_path": "test_checkpoint_e2e.StepProbe", "init_args": probe_args}]
    return h.write_config(tmp_path, cfg, name)


def _fit(tmp_path: Path, config: Path, *extra: str, capfd=None) -> None:
    """``lit_moe fit`` in a fresh process; with ``capfd``, a one-process run inside this one (no
    isolation needed, and no interpreter start)."""
    h = _helpers()
    args = ["fit", "--config", str(config), "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", *extra]
    if capfd is not None:
        proc = h.cli_in_process(args, capfd, cwd=tmp_path)
    else:
        proc = h.run_cli(args, cwd=tmp_path, timeout=400, env={"PYTHONPATH": str(TESTS), "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]


def _probe(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_exact_resume_through_the_cli(tmp_path):
    """With attention dropout (random draws every micro-batch) and the torch DataLoader (whose iterator,
    built after the RNG state is restored, must not draw from the global generator)."""
    straight_probe, first_probe, second_probe = (tmp_path / f"{n}.jsonl" for n in ("straight", "first", "second"))
    save = tmp_path / "ckpt"
    random_draws = {"dataloader": {"python_multiprocessing": True}, "attention_dropout": 0.1}
    _fit(tmp_path, _config(tmp_path, "straight.yaml", straight_probe, 8, {}, **random_draws))
    _fit(tmp_path, _config(tmp_path, "first.yaml", first_probe, 8, {"enable_save": True, "save_path": str(save),
                                                                     "save_interleaved_steps": 100}, **random_draws),
         "--trainer.max_steps", "4")
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    _fit(tmp_path, _config(tmp_path, "second.yaml", second_probe, 8, {"enable_save": True, "save_path": str(save),
                                                                       "save_interleaved_steps": 100,
                                                                       "load_path": str(save)}, **random_draws))
    straight, first, second = _probe(straight_probe), _probe(first_probe), _probe(second_probe)
    assert sorted(straight) == list(range(1, 9)) and sorted(first) == [1, 2, 3, 4] and sorted(second) == [5, 6, 7, 8]
    resumed = {**first, **second}
    for step in range(1, 9):
        for key in ("loss", "lr", "consumed", "batches"):
            assert straight[step][key] == resumed[step][key], (step, key, straight[step][key], resumed[step][key])
    assert len({straight[s]["lr"] for s in straight}) > 4  # the schedule moves: matching lrs means something
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "8"


@pytest.mark.parametrize("layout", ["tp2", "ep2", "one_process"])
def test_reshard_dp2_checkpoint_through_the_cli(tmp_path_factory, layout, capfd):
    """Saved by 2 FSDP2 ranks after step 3; resumed in another layout, steps 4 and 5 have the losses of
    the uninterrupted dp2 run (float32 compute; different reduction orders only)."""
    base = _dp2_run(tmp_path_factory)
    tmp_path = tmp_path_factory.mktemp(layout)
    probe = tmp_path / "probe.jsonl"
    ckpt = {"load_path": str(base / "ckpt" / "iteration_00000003")}
    extra = {"tp2": ["--trainer.devices", "2", "--parallelism.tensor_parallel", "2"],
             "ep2": ["--trainer.devices", "2", "--parallelism.expert_parallel", "2"],
             "one_process": ["--trainer.devices", "1"]}[layout]
    _fit(tmp_path, _config(tmp_path, "resume.yaml", probe, 5, ckpt, dump=(tmp_path / "restored.pt", 0)), *extra,
         capfd=capfd if layout == "one_process" else None)
    # every tensor of the model and the optimizer as restored in the new layout: the saved run's, bit for bit
    import torch

    saved, restored = torch.load(base / "saved.pt"), torch.load(tmp_path / "restored.pt")
    assert saved.keys() == restored.keys() and sum(k.startswith("optimizer.") for k in saved) > 20
    assert [k for k in saved if not torch.equal(saved[k], restored[k])] == [], layout
    resumed = _probe(probe)
    straight = _probe(base / "probe.jsonl")
    assert sorted(resumed) == [4, 5]
    # step 4's loss depends on the restored weights, step 5's also on the restored optimizer state
    for step in (4, 5):
        assert resumed[step]["lr"] == straight[step]["lr"]
        assert resumed[step]["consumed"] == straight[step]["consumed"]
        assert float(resumed[step]["loss"]) == pytest.approx(float(straight[step]["loss"]), rel=2e-5, abs=1e-6)
    # not vacuous: the loss moves from step to step by far more than the tolerance
    assert abs(float(straight[4]["loss"]) - float(straight[3]["loss"])) > 1e-3
    assert abs(float(straight[5]["loss"]) - float(straight[4]["loss"])) > 1e-3


_DP2: dict = {}
ZERO1 = ("--parallelism.data_parallel_shard_strategy", "optim", "--training.local_batch_size", "1")


@pytest.mark.parametrize("layout", ["dp2_zero1", "one_process"])
def test_zero1_checkpoint_resumes_exactly(tmp_path_factory, layout, capfd):
    """Saved by 2 ranks under ZeRO-1 (``data_parallel_shard_strategy: optim``, accumulation 2) after
    step 3; resumed under ZeRO-1 on 2 ranks and in one process: every tensor of the model and the
    optimizer restored bit for bit, and steps 4 and 5 with the uninterrupted run's losses (bit-equal in
    the same layout)."""
    import torch

    base = _zero1_run(tmp_path_factory)
    tmp_path = tmp_path_factory.mktemp(layout)
    probe = tmp_path / "probe.jsonl"
    ckpt = {"load_path": str(base / "ckpt" / "iteration_00000003")}
    extra = {"dp2_zero1": ["--trainer.devices", "2", *ZERO1], "one_process": ["--trainer.devices", "1"]}[layout]
    _fit(tmp_path, _config(tmp_path, "resume.yaml", probe, 5, ckpt, dump=(tmp_path / "restored.pt", 0)), *extra,
         capfd=capfd if layout == "one_process" else None)
    saved, restored = torch.load(base / "saved.pt"), torch.load(tmp_path / "restored.pt")
    assert saved.keys() == restored.keys() and sum(k.startswith("optimizer.") for k in saved) > 20
    assert [k for k in saved if not torch.equal(saved[k], restored[k])] == [], layout
    resumed, straight = _probe(probe), _probe(base / "probe.jsonl")
    assert sorted(resumed) == [4, 5]
    for step in (4, 5):
        assert (resumed[step]["lr"], resumed[step]["consumed"]) == (straight[step]["lr"], straight[step]["consumed"])
        if layout == "dp2_zero1":
            assert resumed[step]["loss"] == straight[step]["loss"], step
        else:   # another reduction order: as the resharding test above
            assert float(resumed[step]["loss"]) == pytest.approx(float(straight[step]["loss"]), rel=2e-5, abs=1e-6)
    assert abs(float(straight[5]["loss"]) - float(straight[4]["loss"])) > 1e-3


def _zero1_run(tmp_path_factory) -> Path:
    """One 2-process ZeRO-1 run of 5 steps that saves after step 3 (shared by the ZeRO-1 resume tests)."""
    if "zero1" not in _DP2:
        base = tmp_path_factory.mktemp("dp2_zero1")
        config = _config(base, "dp2_zero1.yaml", base / "probe.jsonl", 5,
                         {"enable_save": True, "save_path": str(base / "ckpt"), "save_interleaved_steps": 3},
                         dump=(base / "saved.pt", 3))
        _fit(base, config, "--trainer.devices", "2", *ZERO1)
        assert sorted(_probe(base / "probe.jsonl")) == [1, 2, 3, 4, 5]
        _DP2["zero1"] = base
    return _DP2["zero1"]


def _dp2_run(tmp_path_factory) -> Path:
    """One 2-process FSDP2 run of 5 steps that saves after step 3 (shared by the resharding tests)."""
    if "path" not in _DP2:
        base = tmp_path_factory.mktemp("dp2")
        config = _config(base, "dp2.yaml", base / "probe.jsonl", 5,
                         {"enable_save": True, "save_path": str(base / "ckpt"), "save_interleaved_steps": 3,
                          "save_hf_at_end": str(base / "hf_end"), "save_hf_max_shard_size": "200KB"},
                         dump=(base / "saved.pt", 3), dump_end=base / "final.pt")
        _fit(base, config, "--trainer.devices", "2")
        assert sorted(_probe(base / "probe.jsonl")) == [1, 2, 3, 4, 5]
        check_hf_export(config, base / "hf_end", base / "final.pt")   # the 2-rank FSDP2 layout's export
        # MindFormers' run facts in common.json, from the strategy's declared degrees and the config
        common = json.loads((base / "ckpt" / "iteration_00000003" / "common.json").read_text())
        assert common["layout"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 1, "pp": 1}
        assert (common["global_batch_size"], common["consumed_samples"]) == (4, 3 * 4)
        _DP2["path"] = base
    return _DP2["path"]


def test_hf_export_then_import_into_expert_parallel(tmp_path_factory, capfd):
    """convert-hf of the dp2 checkpoint, then fine-tuning from that Hugging Face directory under
    expert parallel 2 starts from the same weights as fine-tuning from the iteration directory in one
    process: the same first-step loss."""
    from lit_moe.hf.convert import main as convert_hf

    base = _dp2_run(tmp_path_factory)
    tmp_path = tmp_path_factory.mktemp("hf")
    hf_dir = tmp_path / "hf"
    assert convert_hf(["--config", str(base / "dp2.yaml"), "--checkpoint", str(base / "ckpt" / "iteration_00000003"),
                       "--output", str(hf_dir)]) == 0
    runs = {}
    for name, load_path, extra in [("hf_ep2", hf_dir, ["--trainer.devices", "2", "--parallelism.expert_parallel", "2"]),
                                   ("ours_one", base / "ckpt" / "iteration_00000003", ["--trainer.devices", "1"])]:
        probe = tmp_path / f"{name}.jsonl"
        config = _config(tmp_path, f"{name}.yaml", probe, 5, {"load_path": str(load_path), "no_load_optim": True})
        _fit(tmp_path, config, "--trainer.max_steps", "1", *extra, capfd=capfd if name == "ours_one" else None)
        runs[name] = _probe(probe)
    assert sorted(runs["hf_ep2"]) == [1] and sorted(runs["ours_one"]) == [1]
    assert runs["hf_ep2"][1]["batches"] != [] and runs["hf_ep2"][1]["consumed"] == runs["ours_one"][1]["consumed"]
    assert float(runs["hf_ep2"][1]["loss"]) == pytest.approx(float(runs["ours_one"][1]["loss"]), rel=2e-5)
    # fine-tuning starts over: step 1, and the trained weights give a lower loss than the dp2 run's fresh start
    fresh = _probe(base / "probe.jsonl")[1]
    assert float(runs["ours_one"][1]["loss"]) < float(fresh["loss"]) - 1e-3


def check_hf_export(config: Path, hf_dir: Path, final_state: Path) -> None:
    """``checkpoint.save_hf_at_end``: transformers loads the sharded export, and its logits are our
    model's on the final training state (dumped by ``StepProbe``, independent of the checkpoint files)."""
    import torch
    import transformers
    import yaml

    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM
    from lit_moe.model.mindformers_defaults import read_pynative_model_section

    assert list(hf_dir.parent.glob(f".{hf_dir.name}.tmp-*")) == []   # the temporary directory was renamed
    assert (hf_dir / "model.safetensors.index.json").is_file() and len(list(hf_dir.glob("*.safetensors"))) > 2
    section = yaml.safe_load(config.read_text())["model"]
    ours = DeepseekV3ForCausalLM(DeepseekV3Config(**read_pynative_model_section(section))).eval()
    state = torch.load(final_state)
    ours.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})
    hf, info = transformers.DeepseekV3ForCausalLM.from_pretrained(hf_dir, attn_implementation="eager",
                                                                  output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    x = torch.randint(0, section["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(x).logits - hf.eval()(x).logits).abs().max().item()
    assert diff <= 1.5e-6, diff   # measured 1.8e-7 (one process) / 1.5e-7 (dp2); logits up to 1.1


def test_hf_export_at_the_end_and_predict_in_one_process(tmp_path, capfd):
    """One process: save_hf_at_end writes the final state; ``lit_moe predict`` on the run's save_path
    (an iteration directory) gives transformers' greedy tokens on that export."""
    from lit_moe.cli import main as cli_main
    from lit_moe.model.generate import left_pad

    import transformers

    save, hf_dir = tmp_path / "ckpt", tmp_path / "out" / "hf"
    config = _config(tmp_path, "one.yaml", tmp_path / "probe.jsonl", 3,
                     {"enable_save": True, "save_path": str(save), "save_interleaved_steps": 2,
                      "save_hf_at_end": str(hf_dir), "save_hf_max_shard_size": "200KB"},
                     dump_end=tmp_path / "final.pt")
    _fit(tmp_path, config, "--trainer.devices", "1", capfd=capfd)
    check_hf_export(config, hf_dir, tmp_path / "final.pt")
    prompts = ["It is a truth", "Emma"]
    assert cli_main(["predict", "--config", str(config), "--checkpoint", str(save), "--tokenizer", "byte",
                     "--prompt", prompts[0], "--prompt", prompts[1], "--max-new-tokens", "6"]) == 0
    rows = [json.loads(ln) for ln in capfd.readouterr().out.splitlines() if ln.startswith("{")]
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    ids, valid = left_pad([list(p.encode()) for p in prompts], 256)
    out = hf.generate(input_ids=ids, attention_mask=valid.long(), max_new_tokens=6, do_sample=False,
                      pad_token_id=256, eos_token_id=256)[:, ids.shape[1]:].tolist()
    assert [r["tokens"] for r in rows] == [r[:r.index(256) + 1] if 256 in r else r for r in out]
