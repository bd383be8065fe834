"""The Megatron .bin/.idx format: round trips against megatron-core, hand-checked bytes, bad files."""

import os
import pickle
import struct

import numpy as np
import pytest

from lit_moe.config import ConfigError
from lit_moe.data import DatasetError, IndexedDataset, IndexedDatasetBuilder
from lit_moe.data.indexed import INDEX_MAGIC, write_indexed_dataset
from test_data_support import make_documents, megatron, tmp_prefix


def test_header_bytes_by_hand(tmp_path):
    prefix = tmp_prefix(tmp_path)
    write_indexed_dataset(prefix, [[5, 6, 7], [8, 9]], dtype=np.uint16)
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17]) == (1,)
    assert raw[17] == 8  # uint16
    assert struct.unpack("<QQ", raw[18:34]) == (2, 3)  # 2 sequences, document index [0, 1, 2]
    assert np.frombuffer(raw[34:42], np.int32).tolist() == [3, 2]
    assert np.frombuffer(raw[42:58], np.int64).tolist() == [0, 6]  # byte offsets: 3 tokens * 2 bytes
    assert np.frombuffer(raw[58:82], np.int64).tolist() == [0, 1, 2]
    assert len(raw) == 82
    assert open(prefix + ".bin", "rb").read() == np.array([5, 6, 7, 8, 9], np.uint16).tobytes()


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_ours_written_megatron_reads(tmp_path, dtype):
    docs = make_documents(50, seed=1, vocab=200)
    prefix = write_indexed_dataset(tmp_prefix(tmp_path), docs, dtype=dtype)
    theirs = megatron().indexed_dataset.IndexedDataset(prefix)
    assert len(theirs) == len(docs)
    assert theirs.index.dtype == dtype
    np.testing.assert_array_equal(theirs.document_indices, np.arange(len(docs) + 1))
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], doc)
        np.testing.assert_array_equal(theirs.get(i, offset=1, length=max(0, len(doc) - 2)), doc[1:len(doc) - 1])


def test_megatron_written_we_read_multi_sequence_documents(tmp_path):
    """Documents of several sequences (megatron-core add_item/end_document), byte-identical files."""
    import torch

    prefix = tmp_prefix(tmp_path, "theirs")
    builder = megatron().indexed_dataset.IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    ours_prefix = tmp_prefix(tmp_path, "ours")
    ours_builder = IndexedDatasetBuilder(ours_prefix, np.int32)
    rng = np.random.default_rng(3)
    expected_docs = []
    for d in range(20):
        seqs = [rng.integers(0, 100_000, int(rng.integers(1, 12))) for _ in range(int(rng.integers(1, 4)))]
        for s in seqs:
            builder.add_item(torch.from_numpy(s))
            ours_builder.add_item(s)
        builder.end_document()
        ours_builder.end_document()
        expected_docs.append(seqs)
    builder.finalize(prefix + ".idx")
    ours_builder.finalize()
    for suffix in (".bin", ".idx"):
        assert open(prefix + suffix, "rb").read() == open(ours_prefix + suffix, "rb").read()
    ds = IndexedDataset(prefix)
    theirs = megatron().indexed_dataset.IndexedDataset(prefix)
    np.testing.assert_array_equal(ds.sequence_lengths, theirs.sequence_lengths)
    np.testing.assert_array_equal(ds.sequence_pointers, theirs.index.sequence_pointers)
    np.testing.assert_array_equal(ds.document_indices, theirs.document_indices)
    for d, seqs in enumerate(expected_docs):
        got = ds.document(d)
        assert len(got) == len(seqs)
        for a, b in zip(got, seqs):
            np.testing.assert_array_equal(a, b)


def test_file_reads_and_pickling(tmp_path):
    docs = make_documents(10, seed=2)
    prefix = write_indexed_dataset(tmp_prefix(tmp_path), docs, dtype=np.uint16)
    by_file = IndexedDataset(prefix, mmap=False)
    clone = pickle.loads(pickle.dumps(IndexedDataset(prefix)))
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(by_file[i], doc)
        np.testing.assert_array_equal(clone[i], doc)


def test_add_index_merges(tmp_path):
    a = write_indexed_dataset(tmp_prefix(tmp_path, "a"), make_documents(5, seed=4), np.uint16)
    b = write_indexed_dataset(tmp_prefix(tmp_path, "b"), make_documents(7, seed=5), np.uint16)
    builder = IndexedDatasetBuilder(tmp_prefix(tmp_path, "ab"), np.uint16)
    builder.add_index(a)
    builder.add_index(b)
    builder.finalize()
    merged = megatron().indexed_dataset.IndexedDataset(tmp_prefix(tmp_path, "ab"))
    expected = make_documents(5, seed=4) + make_documents(7, seed=5)
    assert len(merged) == 12
    for i, doc in enumerate(expected):
        np.testing.assert_array_equal(merged[i], doc)


def test_value_out_of_dtype_range_is_an_error(tmp_path):
    builder = IndexedDatasetBuilder(tmp_prefix(tmp_path), np.uint16)
    with pytest.raises(DatasetError, match="do not fit"):
        builder.add_document([1, 70000])
    builder.abort()


# ------------------------------------------------------------------------------------------------
# bad input: one clear error naming the file
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def good(tmp_path):
    return write_indexed_dataset(tmp_prefix(tmp_path), make_documents(8, seed=6), np.uint16)


def _patch(path, offset, data):
    raw = bytearray(open(path, "rb").read())
    raw[offset:offset + len(data)] = data
    open(path, "wb").write(bytes(raw))


def test_missing_files(good):
    os.remove(good + ".bin")
    with pytest.raises(DatasetError, match=r"docs\.bin: file not found"):
        IndexedDataset(good)
    with pytest.raises(DatasetError, match=r"nothere\.idx: file not found"):
        IndexedDataset(os.path.join(os.path.dirname(good), "nothere"))


def test_wrong_magic(good):
    _patch(good + ".idx", 0, b"NOTMMIDX!")
    with pytest.raises(DatasetError, match=r"docs\.idx: not a Megatron index file"):
        IndexedDataset(good)


def test_wrong_version(good):
    _patch(good + ".idx", 9, struct.pack("<Q", 2))
    with pytest.raises(DatasetError, match=r"docs\.idx: unsupported index version 2"):
        IndexedDataset(good)


def test_unknown_dtype_code(good):
    _patch(good + ".idx", 17, bytes([9]))
    with pytest.raises(DatasetError, match=r"docs\.idx: unknown dtype code 9"):
        IndexedDataset(good)


def test_bin_shorter_than_index(good):
    raw = open(good + ".bin", "rb").read()
    open(good + ".bin", "wb").write(raw[:-3])
    with pytest.raises(DatasetError, match=r"docs\.bin: data file is shorter than its index says"):
        IndexedDataset(good)


def test_truncated_index(good):
    raw = open(good + ".idx", "rb").read()
    open(good + ".idx", "wb").write(raw[:-10])
    with pytest.raises(DatasetError, match=r"docs\.idx: index is truncated"):
        IndexedDataset(good)
    open(good + ".idx", "wb").write(INDEX_MAGIC + b"\x01")
    with pytest.raises(DatasetError, match=r"docs\.idx: index header is truncated"):
        IndexedDataset(good)


def test_errors_are_config_errors(good):
    """The CLI prints ConfigError as one line; dataset errors are ConfigErrors (and ValueErrors)."""
    os.remove(good + ".idx")
    with pytest.raises(ConfigError):
        IndexedDataset(good)
    assert issubclass(DatasetError, ValueError)
