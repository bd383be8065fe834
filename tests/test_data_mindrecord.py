"""MindRecord data (``train_dataset.dataloader.type: MindDataset``) read without MindSpore.

References, both independent of lit_moe's reader:
* ``tests/data/mindrecord/{one,two,ids,big}``: files written by MindSpore 2.10.0's own ``FileWriter``, and
  ``mindspore_reads.json``: what MindSpore's ``MindDataset(shuffle=False)`` returned for them (whole,
  files in reverse order, and per data-parallel shard), recorded by ``write_with_mindspore.py``;
* ``tests/mindrecord_writer.py``: a small writer from MindSpore's C++ writer source, checked here to
  reproduce MindSpore's files byte for byte, then used for layouts the fixtures do not cover.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import torch

from lit_moe.config import ConfigError, TrainDatasetConfig
from lit_moe.data import MegatronDataModule, build_datasets
from lit_moe.data.datamodule import MegatronSampler, _Position
from lit_moe.data.mindrecord import MindRecordDataset, MindRecordError, mindrecord_files
from mindrecord_writer import SCHEMA, big_rows, fixture_rows, write_mindrecord
from test_data_module import fake_trainer

DATA = Path(__file__).parent / "data" / "mindrecord"
READS = json.loads((DATA / "mindspore_reads.json").read_text())

def as_lists(sample: dict) -> dict:
    return {k: v.tolist() for k, v in sample.items()}


def files_of(name: str) -> list[str]:
    return [str(DATA / name / f) for f in READS[name]["files"]]


def index_rows(db: str) -> tuple:
    con = sqlite3.connect(db)
    try:
        return (con.execute("SELECT sql FROM sqlite_master WHERE type='table' ORDER BY name").fetchall(),
                con.execute("SELECT * FROM INDEXES ORDER BY ROW_ID").fetchall(),
                con.execute("SELECT * FROM SHARD_NAME").fetchall())
    finally:
        con.close()


# ----------------------------------------------------------------------------------------------
# against MindSpore's own files and reads
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["one", "two", "ids"])
def test_reads_what_mindspore_read(name):
    """Every column (int32/int64 arrays compressed, float32 arrays, 2-D arrays, an int64 scalar from the
    MessagePack row), one and two shard files, the files in the order given."""
    files = files_of(name)
    for key, order in (("all", files), ("reversed", files[::-1])):
        ds = MindRecordDataset(order, None, "dataset_files")
        assert [as_lists(ds[i]) for i in range(len(ds))] == READS[name]["reads"][key], key
    first = MindRecordDataset(files, None, "dataset_files")[0]
    assert first["input_ids"].dtype == np.int32
    if name != "ids":
        assert first["big"].dtype == np.int64 and first["idx"].dtype == np.int64
        assert first["weights"].dtype == np.float32 and first["attention_mask"].shape == (4, 4)


@pytest.mark.parametrize("name", ["one", "two"])
@pytest.mark.parametrize("shards,shard", [(2, 0), (2, 1), (3, 2)])
def test_data_parallel_shards_are_mindspores(name, shards, shard):
    """MindDataset(num_shards=D, shard_id=d): rank d reads d, d+D, ... and pads its shard to ceil(N/D)
    by wrapping to the first samples; lit_moe's sampler with pad_shards does the same."""
    ds = MindRecordDataset(files_of(name), None, "dataset_files")
    sampler = MegatronSampler(len(ds), shards, shard, 1, drop_last=False, shuffle=False, seed=0,
                              position=_Position(), pad_shards=True)
    assert [as_lists(ds[i]) for i in sampler] == READS[name]["reads"][f"shard{shard}of{shards}"]


def test_reads_the_multi_page_file_mindspore_wrote():
    ds = MindRecordDataset([str(DATA / "big" / "big.mindrecord")], None, "dataset_files")
    rows = big_rows()
    assert len(ds) == len(rows)
    for i, row in enumerate(rows):
        assert as_lists(ds[i]) == as_lists(row)


def test_the_test_writer_is_mindspores_layout_byte_for_byte(tmp_path):
    rows = fixture_rows()
    cases = [("one", SCHEMA, rows["one"], "test"), ("ids", {"input_ids": SCHEMA["input_ids"]}, rows["ids"], "test"),
             ("big", {k: {"type": "int32", "shape": [-1]} for k in big_rows()[0]}, big_rows(), "big")]
    for name, schema, data, desc in cases:
        reference = DATA / name / ("big.mindrecord" if name == "big" else "data.mindrecord")
        out = tmp_path / name / reference.name
        out.parent.mkdir()
        write_mindrecord(str(out), schema, data, desc=desc)
        assert out.read_bytes() == reference.read_bytes(), name
        assert index_rows(f"{out}.db") == index_rows(f"{reference}.db"), name


# ----------------------------------------------------------------------------------------------
# layouts beyond the fixtures, written by the test writer
# ----------------------------------------------------------------------------------------------
def test_many_pages_and_scalar_columns(tmp_path):
    """Several blob pages and raw pages (page size 32 KiB), integers of every stored width, float64
    arrays, string/float/negative scalars in the MessagePack rows."""
    rng = np.random.RandomState(5)
    schema = {"input_ids": {"type": "int64", "shape": [-1]}, "scores": {"type": "float64", "shape": [-1]},
              "name": {"type": "string"}, "weight": {"type": "float64"}, "offset": {"type": "int64"}}
    rows = []
    for i in range(300):
        n = int(rng.randint(1, 60))
        widths = rng.choice([1 << 6, 1 << 14, 1 << 30, 1 << 62], size=n)
        rows.append({"input_ids": (rng.randint(-1000, 1000, size=n) * (widths // 1000)).astype(np.int64),
                     "scores": rng.randn(n), "name": f"doc{i}", "weight": float(rng.randn()),
                     "offset": int(rng.randint(-(1 << 40), 1 << 40))})
    path = tmp_path / "many.mindrecord"
    write_mindrecord(str(path), schema, rows)
    ds = MindRecordDataset([str(path)], None, "dataset_files")
    assert len(ds) == 300
    for i in (0, 1, 57, 150, 299):
        got = ds[i]
        assert got["input_ids"].tolist() == rows[i]["input_ids"].tolist()
        assert got["scores"].tolist() == rows[i]["scores"].tolist()
        assert str(got["name"]) == rows[i]["name"] and float(got["weight"]) == rows[i]["weight"]
        assert int(got["offset"]) == rows[i]["offset"]
    con = sqlite3.connect(f"{path}.db")
    assert con.execute("SELECT COUNT(DISTINCT PAGE_ID_BLOB), COUNT(DISTINCT PAGE_ID_RAW) FROM INDEXES").fetchone()[0] > 1
    con.close()


def test_file_list_follows_mindformers(tmp_path):
    """A path ending in .mindrecord is that file; a directory gives its *.mindrecord files (os.walk);
    MindSpore's multi-shard names (data.mindrecord0) are not picked up from a directory, as in MindFormers."""
    (tmp_path / "sub").mkdir()
    for name in ("a.mindrecord", "sub/b.mindrecord", "c.mindrecord0", "a.mindrecord.db"):
        (tmp_path / name).write_bytes(b"")
    assert sorted(os.path.relpath(f, tmp_path) for f in mindrecord_files(str(tmp_path), "f")) == \
        ["a.mindrecord", "sub/b.mindrecord"]
    assert mindrecord_files(["x/y.mindrecord"], "f") == ["x/y.mindrecord"]
    with pytest.raises(ConfigError, match=r"f: .*names no \.mindrecord file"):
        mindrecord_files(str(tmp_path / "c.mindrecord0"), "f")


# ----------------------------------------------------------------------------------------------
# the dataloader section and the DataModule
# ----------------------------------------------------------------------------------------------
def mind_section(files, **kw) -> dict:
    section = {"type": "MindDataset", "dataset_files": files,
               "column_names": ["input_ids", "labels", "loss_mask", "position_ids"], "shuffle": False}
    section.update(kw)
    return section


def test_datamodule_batches_are_mindspores_order(tmp_path):
    cfg = TrainDatasetConfig(dataloader=mind_section(str(DATA / "one")), drop_remainder=True, num_parallel_workers=0)
    dm = MegatronDataModule(cfg, 2, 42, seq_length=16)
    dm.trainer = fake_trainer(0, 1)
    dm.setup("fit")
    reads = READS["one"]["reads"]["all"]
    batches = [b for step in dm.train_dataloader() for b in step]   # steps of one micro-batch
    assert len(batches) == 3          # 7 samples, drop_remainder
    for k, batch in enumerate(batches):
        assert set(batch) == {"input_ids", "labels", "loss_mask", "position_ids"}
        assert batch["input_ids"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.float32
        for j in range(2):
            for col in batch:
                assert batch[col][j].tolist() == reads[2 * k + j][col]


def test_datamodule_data_parallel_rank_drops_like_mindspore():
    """Two ranks, batch 2, 7 samples: each shard is padded to 4 and cut to two whole batches
    (MindSpore: shard(ceil(7/2)=4).batch(2, drop_remainder))."""
    cfg = TrainDatasetConfig(dataloader=mind_section(files_of("one")), drop_remainder=True, num_parallel_workers=0)
    dm = MegatronDataModule(cfg, 2, 42, seq_length=16)
    dm.trainer = fake_trainer(1, 2)
    dm.setup("fit")
    reads = READS["one"]["reads"]["shard1of2"]
    got = [row for step in dm.train_dataloader() for batch in step for row in batch["input_ids"].tolist()]
    assert got == [r["input_ids"] for r in reads]


def test_attention_mask_and_actual_seq_len_columns(tmp_path):
    S = 8
    rows = [{"input_ids": np.arange(S, dtype=np.int32) + i, "labels": np.arange(S, dtype=np.int32),
             "loss_mask": np.ones(S, np.int32), "position_ids": np.arange(S, dtype=np.int32),
             "attention_mask": np.triu(np.ones((1, S, S), np.uint8), 1), "actual_seq_len": np.array([3, S], np.int32)}
            for i in range(4)]
    schema = {k: {"type": "bytes" if k == "attention_mask" else "int32", "shape": list(v.shape)}
              for k, v in rows[0].items()}
    write_mindrecord(str(tmp_path / "m.mindrecord"), schema, rows)
    columns = ["input_ids", "labels", "loss_mask", "position_ids", "attention_mask", "actual_seq_len"]
    train = build_datasets(mind_section(str(tmp_path), column_names=columns), seq_length=S)[0]
    assert list(train[2]) == columns
    assert train[2]["attention_mask"].tolist() == rows[2]["attention_mask"].tolist()
    assert train[3]["actual_seq_len"].tolist() == [3, S] and train[1]["input_ids"].tolist() == list(range(1, S + 1))


# ----------------------------------------------------------------------------------------------
# bad input: one line naming the key or the file
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change,message", [
    ({"sampler": {"type": "RandomSampler"}}, r"dataloader\.sampler: not implemented yet for MindDataset"),
    ({"num_samples": 4}, r"dataloader\.num_samples: not implemented yet"),
    ({"columns_list": ["input_ids"]}, r"dataloader\.columns_list: not implemented yet .*write column_names"),
    ({"shufle": False}, r"dataloader\.shufle: unknown MindDataset key"),
    ({"dataset_files": ""}, r"dataloader\.dataset_files: missing"),
    ({"column_names": ["input_ids"]}, r"dataloader\.column_names: \['input_ids'\] leaves out 'labels'"),
    ({"shuffle": "no"}, r"dataloader\.shuffle: expected true or false"),
])
def test_bad_sections(change, message):
    with pytest.raises(ConfigError, match=message):
        build_datasets(mind_section(files_of("one"), **change), seq_length=16)


def test_shuffle_default_warns_that_the_order_is_not_mindspores():
    section = mind_section(files_of("one"))
    del section["shuffle"]
    with pytest.warns(UserWarning, match=r"shuffle: true \(MindSpore's default.*not in MindSpore's random order"):
        train = build_datasets(section, seq_length=16)[0]
    assert len(train) == 7


def test_bad_files(tmp_path):
    good = files_of("one")[0]
    with pytest.raises(ConfigError, match=r"column_names: \['nope'\] not in .*data\.mindrecord"):
        MindRecordDataset([good], ["nope"], "train_dataset.dataloader.dataset_files")
    with pytest.raises(MindRecordError, match=r"row 0 column 'input_ids' has shape \[16\], expected \[8\]"):
        build_datasets(mind_section(good), seq_length=8)[0][0]
    lonely = tmp_path / "x.mindrecord"
    lonely.write_bytes(Path(good).read_bytes())
    with pytest.raises(MindRecordError, match=r"x\.mindrecord: its index .*x\.mindrecord\.db is missing"):
        MindRecordDataset([str(lonely)], None, "f")
    (tmp_path / "x.mindrecord.db").write_bytes(b"not sqlite")
    with pytest.raises(MindRecordError, match=r"x\.mindrecord\.db: not a MindRecord index"):
        MindRecordDataset([str(lonely)], None, "f")
    text = tmp_path / "t.mindrecord"
    text.write_bytes(b"hello world, not a header")
    with pytest.raises(MindRecordError, match=r"t\.mindrecord: header length \d+ is not a MindRecord header"):
        MindRecordDataset([str(text)], None, "f")


@pytest.mark.timeout(600)
def test_fit_trains_on_mindrecord_files(tmp_path):
    """``lit_moe fit`` with ``type: MindDataset``: the shipped tiny config on MindRecord files."""
    import yaml

    from helpers import ROOT, run_cli

    S = 64
    rng = np.random.RandomState(0)
    rows = []
    for _ in range(32):
        ids = rng.randint(0, 256, size=S + 1).astype(np.int32)
        rows.append({"input_ids": ids[:-1], "labels": ids[1:].copy(), "loss_mask": np.ones(S, np.int32),
                     "position_ids": np.arange(S, dtype=np.int32)})
    (tmp_path / "data").mkdir()
    write_mindrecord(str(tmp_path / "data" / "train.mindrecord"), {k: {"type": "int32", "shape": [-1]} for k in rows[0]},
                     rows)
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["train_dataset"]["dataloader"] = {"type": "MindDataset", "dataset_files": str(tmp_path / "data"),
                                          "column_names": ["input_ids", "labels", "loss_mask", "position_ids"],
                                          "shuffle": False}
    cfg["model"]["seq_length"] = S
    cfg["training"]["steps"] = 2
    cfg["checkpoint"] = {"enable_save": False}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    result = run_cli(["fit", "--config", str(tmp_path / "run.yaml")], cwd=tmp_path, timeout=540)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "step 2/2" in result.stdout + result.stderr
