"""Data is validated before it can hurt: corrupt index entries in the middle of an ``.idx`` are one
line at open, token ids outside the model's vocabulary are one line naming file, document and id
(recorded maximum at start, every sample as it is read), damaged GPTDataset index caches are rebuilt
with a warning. The CLI case runs in a fresh process with a DataLoader worker (the error crosses the
worker boundary and still is one line)."""

from __future__ import annotations

import os
import struct
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lit_moe.data import DatasetError, GPTDataset, GPTDatasetConfig, IndexedDataset  # noqa: E402
from lit_moe.data.indexed import HEADER_SIZE, meta_path, write_indexed_dataset  # noqa: E402


def _docs(n=50, vocab=500, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(5, 40))) for _ in range(n)]


def _poke(path: str, offset: int, fmt: str, value) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, value))


@pytest.mark.parametrize("field", ["pointer", "length", "document"])
def test_corrupt_entry_in_the_middle_is_one_line_at_open(tmp_path, field):
    prefix = write_indexed_dataset(str(tmp_path / "d"), _docs(), dtype=np.uint16)
    n = len(IndexedDataset(prefix))
    idx = prefix + ".idx"
    if field == "pointer":  # sequence 25 points past where sequence 24 ends
        _poke(idx, HEADER_SIZE + 4 * n + 8 * 25, "<q", 10**9)
        match = r"d\.idx: corrupt index: sequence 25 points at byte 1000000000"
    elif field == "length":
        _poke(idx, HEADER_SIZE + 4 * 25, "<i", -3)
        match = r"d\.idx: corrupt index: sequence 25 has length -3"
    else:
        _poke(idx, HEADER_SIZE + 12 * n + 8 * 30, "<q", 2)
        match = r"d\.idx: corrupt index: document entry 30 \(2\) is below the one before it"
    with pytest.raises(DatasetError, match=match) as err:
        IndexedDataset(prefix)
    assert "\n" not in str(err.value)


def _gpt(prefix: str, vocab: int, **cfg) -> GPTDataset:
    low = IndexedDataset(prefix)
    config = GPTDatasetConfig(seq_length=16, vocab_size=vocab, path_to_cache=str(Path(prefix).parent / "cache"), **cfg)
    return GPTDataset(low, prefix, np.arange(len(low)), 40, "train", config)


def test_token_id_outside_the_vocabulary(tmp_path):
    docs = _docs()
    docs[17][3] = 4000
    prefix = write_indexed_dataset(str(tmp_path / "d"), docs, dtype=np.uint16)
    # the builder recorded the largest id: caught at start
    with pytest.raises(DatasetError, match=r"d\.bin: holds token ids up to 4000 .* model\.vocab_size is 512"):
        _gpt(prefix, 512)
    # without the record (another tool wrote the data): caught by the sample that reads it
    os.remove(meta_path(prefix))
    ds = _gpt(prefix, 512)
    messages = []
    for i in range(len(ds)):
        try:
            ds[i]
        except DatasetError as err:
            messages.append(str(err))
    assert messages and all(m.endswith("another vocabulary") and "\n" not in m for m in messages)
    assert all(r"d.bin: document 17 (sequence 17) holds token id 4000, outside [0, 512)" in m for m in messages)
    # a vocabulary that holds every id reads every sample
    ok = _gpt(prefix, 4001)
    assert all(ok[i]["input_ids"].max() <= 4000 for i in range(len(ok)))


def test_damaged_index_cache_is_rebuilt_with_a_warning(tmp_path):
    prefix = write_indexed_dataset(str(tmp_path / "d"), _docs(), dtype=np.uint16)
    fresh = _gpt(prefix, 512)
    assert fresh.built_indices
    expected = [np.array(a) for a in (fresh.document_index, fresh.sample_index, fresh.shuffle_index)]
    shuffle = next((tmp_path / "cache").glob("*-shuffle_index.npy"))
    data = bytearray(shuffle.read_bytes())
    data[-8:] = b"\xff" * 8  # same size, other values: only the checksum sees it
    shuffle.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = _gpt(prefix, 512)
    msgs = [str(w.message) for w in caught if "index cache" in str(w.message)]
    assert len(msgs) == 1 and "shuffle_index.npy fails its CRC-32 check" in msgs[0] and "rebuilding" in msgs[0]
    assert again.built_indices
    for a, b in zip(expected, (again.document_index, again.sample_index, again.shuffle_index)):
        np.testing.assert_array_equal(a, b)
    shuffle.write_bytes(bytes(data[:100]))  # truncated
    with pytest.warns(UserWarning, match="shuffle_index.npy has 100 bytes"):
        _gpt(prefix, 512)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # intact now: loaded without a word
        assert not _gpt(prefix, 512).built_indices


def test_bad_token_through_the_cli_is_one_line(tmp_path):
    import helpers

    docs = _docs(200, vocab=500)
    docs[120][5] = 700
    prefix = write_indexed_dataset(str(tmp_path / "bad"), docs, dtype=np.uint16)
    os.remove(meta_path(prefix))  # found while reading, inside a DataLoader worker
    cfg = helpers.tiny_config(tmp_path, steps=30, mock_data=False)
    dl = cfg["train_dataset"]["dataloader"]
    dl["config"].update(data_path=["1", prefix], eod=1)
    dl["shuffle"] = False
    cfg["train_dataset"]["num_parallel_workers"] = 1
    proc = helpers.run_cli(["fit", "--config", str(helpers.write_config(tmp_path, cfg)),
                            "--trainer.enable_progress_bar", "false"], cwd=tmp_path, timeout=300,
                           env={"PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("lit_moe: error")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "bad.bin: document 120 (sequence 120) holds token id 700, outside [0, 512)" in errors[0]
