"""Evaluation during training (``training.eval_interval`` / ``eval_iters``) with the real LitMoE and
the Megatron DataModule, and the Lightning loggers beside TensorBoard (CSV, MLflow file store)."""

from __future__ import annotations

import csv
import math
import os

import lightning as L
import numpy as np
import pytest
import torch

from lit_moe.callbacks import LoggerBridge, StepLogger, build_logger, combine_loggers
from lit_moe.config import ConfigError, MonitorConfig, TrainDatasetConfig
from lit_moe.data import MegatronDataModule
from lit_moe.data.indexed import write_indexed_dataset
from lit_moe.callbacks.evaluation import Evaluation
from test_callbacks import read_tb, scalars
from test_callbacks_module import SEQ, VOCAB, tiny_module
from test_data_support import dataloader_section, make_documents


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval")
    docs = make_documents(120, seed=5, max_len=40, vocab=VOCAB)
    return write_indexed_dataset(os.path.join(str(path), "docs"), docs, np.uint16)


def data(prefix, sizes=(40, 12, 0)):
    section = dataloader_section(SEQ, [prefix], sizes=sizes, split="70,30,0",
                                 columns=["input_ids", "labels", "loss_mask", "position_ids"])
    return TrainDatasetConfig(dataloader=section, num_parallel_workers=0)


class HandPass(L.Callback):
    """After each evaluation: the same no-grad pass written out by hand on the valid split."""

    def __init__(self, evaluation: Evaluation):
        self.evaluation, self.checked = evaluation, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        last = self.evaluation.last
        if last is None or last["step"] in self.checked:
            return
        valid = trainer.datamodule.datasets[1]
        model = pl_module.model
        model.eval()
        losses = []
        with torch.no_grad():
            for k in range(2):   # eval_iters micro-batches of local_batch_size 2, one rank
                rows = [valid[2 * k + i] for i in range(2)]
                batch = {key: torch.as_tensor(np.stack([r[key] for r in rows])) for key in rows[0]}
                logits = model(batch["input_ids"], position_ids=batch["position_ids"]).logits.double()
                ce = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1),
                                                       reduction="none")
                mask = batch["loss_mask"].reshape(-1).double()
                losses.append(float((ce * mask).sum() / mask.sum()))
        model.train()
        self.checked[last["step"]] = (sum(losses) / len(losses), last["val/loss"], last["val/ppl"])


def fit(prefix, tmp_path, strategy, steps=5, evaluation=None, loggers=None):
    module = tiny_module(steps)
    callbacks = [StepLogger(), LoggerBridge(hparams={"training": {"steps": steps}, "model": {"hidden_size": 32}})]
    hand = None
    if evaluation is not None:
        hand = HandPass(evaluation)
        callbacks[:0] = [evaluation, hand]
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy(), max_steps=steps, logger=loggers or False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks)
    torch.manual_seed(0)
    trainer.fit(module, MegatronDataModule(data(prefix), 2, 42, seq_length=SEQ, accumulation_steps=2))
    return module, hand


def test_validation_loss_at_the_right_steps_equals_a_hand_run_pass_and_leaves_training_alone(
        prefix, tmp_path, capsys, monkeypatch, one_process_strategy):
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")   # MLflow 3 keeps its file store behind this switch
    monitor = MonitorConfig()
    monitor.tensorboard.output_dir = str(tmp_path / "tb")
    uri = "file:" + str(tmp_path / "mlruns")
    loggers = combine_loggers(build_logger(monitor), [CSVLogger(str(tmp_path / "csv"), name="run"),
                                                      MLFlowLogger(experiment_name="eco", tracking_uri=uri)])
    ev = Evaluation(eval_interval=2, eval_iters=2, local_batch_size=2)
    module, hand = fit(prefix, tmp_path, one_process_strategy, evaluation=ev, loggers=loggers)
    # evaluations after optimizer steps 2 and 4 of 5, equal to the hand-written pass
    assert sorted(hand.checked) == [2, 4]
    for step, (want, got, ppl) in hand.checked.items():
        assert got == pytest.approx(want, rel=1e-6, abs=1e-6)
        assert ppl == pytest.approx(math.exp(want), rel=1e-6)
    assert hand.checked[2][1] != hand.checked[4][1]          # the model moved in between
    out = capsys.readouterr().out
    assert "validation step 2 | val/loss" in out and "validation step 4 | val/loss" in out
    assert "validation step 3" not in out

    # the same metric names in TensorBoard, the CSV file and MLflow
    acc = read_tb(tmp_path / "tb")
    assert sorted(scalars(acc, "val/loss")) == [2, 4]
    assert scalars(acc, "val/loss")[4] == pytest.approx(hand.checked[4][1])
    assert sorted(scalars(acc, "train/loss")) == [1, 2, 3, 4, 5]
    # the hyperparameters in TensorBoard's HPARAMS plugin, with the loss tags as its metric columns
    from tensorboard.plugins.hparams import plugin_data_pb2

    hp = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(hp["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["training/steps"].number_value == 5 and start.hparams["model/hidden_size"].number_value == 32
    experiment = plugin_data_pb2.HParamsPluginData.FromString(hp["_hparams_/experiment"]).experiment
    assert [m.name.tag for m in experiment.metric_infos] == ["train/loss", "val/loss"]
    rows = list(csv.DictReader(open(tmp_path / "csv" / "run" / "version_0" / "metrics.csv")))
    by_step = {int(r["step"]): r for r in rows}
    assert sorted(by_step) == [1, 2, 3, 4, 5] and len(rows) == 5      # one row per optimizer step
    assert float(by_step[4]["val/loss"]) == pytest.approx(hand.checked[4][1])
    assert by_step[3]["val/loss"] == "" and float(by_step[3]["train/loss"]) == pytest.approx(scalars(acc, "train/loss")[3])
    assert not any(" vs samples" in k for k in rows[0])       # TensorBoard-only variants stay there
    assert (tmp_path / "csv" / "run" / "version_0" / "hparams.yaml").read_text().count("training/steps: 5") == 1

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.search_runs([client.get_experiment_by_name("eco").experiment_id])[0]
    history = client.get_metric_history(run.info.run_id, "val/loss")
    assert [(m.step, round(m.value, 6)) for m in history] == [(s, round(hand.checked[s][1], 6)) for s in (2, 4)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2, 3, 4, 5]
    assert run.data.params["training/steps"] == "5"

    # evaluation changes nothing about training: the same weights as a run without it
    plain, _ = fit(prefix, tmp_path / "plain", one_process_strategy)
    for (n, a), (_, b) in zip(module.model.state_dict().items(), plain.model.state_dict().items()):
        assert torch.equal(a, b), n


def test_eval_settings_and_missing_valid_split(prefix, tmp_path, one_process_strategy):
    with pytest.raises(ConfigError, match=r"training.eval_iters: must be an integer >= 1"):
        Evaluation(eval_interval=2, eval_iters=0, local_batch_size=2)
    with pytest.raises(ConfigError, match=r"training.eval_interval: must be an integer >= 0"):
        Evaluation(eval_interval=-1, eval_iters=1, local_batch_size=2)
    def trainer():
        return L.Trainer(accelerator="cpu", devices=1, strategy=one_process_strategy(), max_steps=2, logger=False,
                         enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Evaluation(eval_interval=1, eval_iters=50, local_batch_size=2)])

    with pytest.raises(ConfigError, match=r"training.eval_iters: 50 micro-batches of 2 samples on 1 data-parallel "
                                          r"rank\(s\) need 100 evaluation samples; the valid split \(train_dataset.dataloader.sizes\[1\] "
                                          r"and split\) holds \d+; lower eval_iters"):
        trainer().fit(tiny_module(2), MegatronDataModule(data(prefix), 2, 42, seq_length=SEQ, accumulation_steps=2))
    with pytest.raises(ConfigError, match=r"holds 0 \(set it, and a split with a valid part"):
        trainer().fit(tiny_module(2), MegatronDataModule(data(prefix, sizes=(40, 0, 0)), 2, 42, seq_length=SEQ, accumulation_steps=2))


def test_eval_dataset_section_is_the_evaluation_data(prefix, tmp_path, one_process_strategy):
    """``eval_dataset`` (shaped like train_dataset): its first split is what is evaluated."""
    from lit_moe.data.loader import build_from_spec, parse_dataloader
    from lit_moe.callbacks.evaluation import build_evaluation
    from lit_moe.config import TrainingConfig

    section = {"dataloader": dataloader_section(SEQ, [prefix], sizes=(8, 0, 0), split="1,0,0",
                                                columns=["input_ids", "labels", "loss_mask", "position_ids"],
                                                seed=7)}
    training = TrainingConfig(steps=2, local_batch_size=2, global_batch_size=4, eval_interval=2, eval_iters=2)
    ev = build_evaluation(training, section, SEQ)
    assert ev is not None and ev.source == "eval_dataset"
    assert build_evaluation(TrainingConfig(eval_interval=0), section, SEQ) is None   # validated, unused
    module, _ = fit(prefix, tmp_path, one_process_strategy, steps=2, evaluation=ev)
    data = build_from_spec(parse_dataloader(section["dataloader"], SEQ))[0]
    model = module.model.eval()
    losses = []
    with torch.no_grad():
        for k in range(2):
            rows = [data[2 * k + i] for i in range(2)]
            batch = {key: torch.as_tensor(np.stack([r[key] for r in rows])) for key in rows[0]}
            logits = model(batch["input_ids"], position_ids=batch["position_ids"]).logits.double()
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1),
                                                   reduction="none")
            mask = batch["loss_mask"].reshape(-1).double()
            losses.append(float((ce * mask).sum() / mask.sum()))
    assert ev.last["step"] == 2 and ev.last["val/loss"] == pytest.approx(sum(losses) / 2, rel=1e-6)
    # not the valid split of the train blend
    assert ev.dataset is not None and len(ev.dataset) == len(data)
