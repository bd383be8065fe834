"""GPTDataset: hand-computed cases, sample-by-sample equality with megatron-core, index caches."""

import multiprocessing as mp
import os
import time
import warnings

import numpy as np
import pytest

from lit_moe.config import ConfigError
from lit_moe.data import DatasetError, GPTDataset, GPTDatasetConfig, IndexedDataset, IndexedDatasetBuilder, build_datasets
from lit_moe.data.gpt import MockLowLevelDataset, build_sample_index, compressed_eod_mask, ltor_masks_and_position_ids
from lit_moe.data.indexed import write_indexed_dataset
from test_data_support import (EOD, assert_same_samples, dataloader_section, make_documents, megatron,
                               megatron_config, megatron_gpt, tmp_prefix, write_with_megatron)


# ------------------------------------------------------------------------------------------------
# hand-computed cases (deepseek_math.md §6.3, §6.4)
# ------------------------------------------------------------------------------------------------
def test_sample_index_worked_example():
    """lengths [5, 3, 7], S = 4, one epoch, documents in order → [(0,0), (0,4), (2,0), (2,4)]."""
    sizes = np.array([5, 3, 7], np.int32)
    idx = build_sample_index(sizes, np.array([0, 1, 2], np.int32), 4, 15, 1)
    assert idx.tolist() == [[0, 0], [0, 4], [2, 0], [2, 4]]


def test_sample_index_skips_empty_documents_and_matches_helpers():
    sizes = np.array([3, 0, 2, 0, 0, 6, 1, 4], np.int32)
    order = np.array([0, 1, 2, 3, 4, 5, 6, 7, 1, 0, 2, 3, 5, 6, 7, 4], np.int32)
    T = int(sizes.sum())
    for S in (2, 3, 5):
        for extra in (0, 1):
            ours = build_sample_index(sizes, order, S, T, 2, True, extra)
            ref = megatron().helpers.build_sample_idx(sizes, order, S, 2, T, True, bool(extra))
            np.testing.assert_array_equal(ours, ref)
            assert ours.dtype == ref.dtype


def test_samples_are_windows_of_the_shuffled_stream(tmp_path):
    """Sample j = F[j·S : j·S + S + 1] of the concatenated documents in shuffled order, and the sample
    order is a RandomState permutation drawn after the document shuffle (an independent restatement)."""
    docs = make_documents(30, seed=7, max_len=25)
    prefix = write_indexed_dataset(tmp_prefix(tmp_path), docs, np.uint16)
    S, seed = 6, 99
    train, _, _ = build_datasets(dataloader_section(S, [prefix], sizes=(20, 0, 0), seed=seed))
    T = sum(len(d) for d in docs)
    assert (20 * S + 1) <= T  # one epoch is enough
    rng = np.random.RandomState(seed)
    order = np.arange(len(docs), dtype=np.int32)
    rng.shuffle(order)
    stream = np.concatenate([docs[i] for i in order])
    n = (T - 1) // S
    perm = np.arange(n, dtype=np.uint32)
    rng.shuffle(perm)
    assert len(train) == n
    for i in range(n):
        window = stream[perm[i] * S: perm[i] * S + S + 1]
        np.testing.assert_array_equal(train[i]["input_ids"], window[:-1])
        np.testing.assert_array_equal(train[i]["labels"], window[1:])


def test_masks_and_positions_by_hand():
    tokens = np.array([5, 1, 6, 7, 1, 8])
    mask, loss, pos = ltor_masks_and_position_ids(tokens, 1, True, True, True, True)
    assert pos.tolist() == [0, 1, 0, 1, 2, 0]
    assert loss.tolist() == [1, 0, 1, 1, 0, 1]
    allowed = np.array([  # row = query, column = key; EOD belongs to the document it ends
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1]], bool)
    assert mask.shape == (1, 6, 6) and mask.dtype == bool
    np.testing.assert_array_equal(mask[0], ~allowed)  # True = blocked
    mask, loss, pos = ltor_masks_and_position_ids(tokens, 1, False, False, False, True)
    np.testing.assert_array_equal(mask[0], ~np.tril(np.ones((6, 6), bool)))
    assert pos.tolist() == list(range(6)) and loss.tolist() == [1] * 6
    assert ltor_masks_and_position_ids(tokens, 1, False, False, False, False)[0] is None


def test_compressed_eod_mask_by_hand():
    assert compressed_eod_mask(np.array([5, 1, 6, 7, 1, 8]), 1, 4).tolist() == [2, 5, 6, 6]
    # an EOD in the last position is not a document end inside the sample
    assert compressed_eod_mask(np.array([5, 1, 6, 1]), 1, 3).tolist() == [2, 4, 4]
    assert compressed_eod_mask(np.array([5, 6, 7]), 1, 2).tolist() == [3, 3]
    with pytest.raises(DatasetError, match="eod_pad_length"):
        compressed_eod_mask(np.array([1, 1, 1, 5]), 1, 2)


def test_sample_columns_and_dtypes(tmp_path):
    prefix = write_indexed_dataset(tmp_prefix(tmp_path), make_documents(40, seed=8), np.uint16)
    section = dataloader_section(16, [prefix], sizes=(10, 0, 0), create_attention_mask=True,
                                 create_compressed_eod_mask=True, eod_pad_length=8)
    train, valid, test = build_datasets(section)
    assert valid is None and test is None
    s = train[0]
    assert list(s) == ["input_ids", "labels", "loss_mask", "position_ids", "actual_seq_len", "attention_mask"]
    assert s["input_ids"].dtype == np.int64 and s["labels"].dtype == np.int64
    assert s["loss_mask"].dtype == np.float32 and s["position_ids"].dtype == np.int64
    assert s["attention_mask"].shape == (1, 16, 16) and s["attention_mask"].dtype == bool
    assert s["actual_seq_len"].shape == (8,) and s["actual_seq_len"].dtype == np.int32
    expected = compressed_eod_mask(s["input_ids"], EOD, 8)
    np.testing.assert_array_equal(s["actual_seq_len"], expected)
    section["column_names"] = ["input_ids", "labels"]
    assert list(build_datasets(section)[0][0]) == ["input_ids", "labels"]


# ------------------------------------------------------------------------------------------------
# megatron-core as the judge
# ------------------------------------------------------------------------------------------------
FLAGS = [
    dict(),
    dict(reset_position_ids=True),
    dict(eod_mask_loss=True),
    dict(reset_attention_mask=True, create_attention_mask=True),
    dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True, create_attention_mask=True),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """200 documents written by megatron-core's own builder."""
    path = tmp_path_factory.mktemp("corpus")
    return write_with_megatron(os.path.join(str(path), "docs"), make_documents(200, seed=11, max_len=50))


def _epoch_sizes(prefix, S):
    """Sample counts needing three epochs: the last shuffled on its own (< 80% of it used) or with
    the others."""
    T = int(IndexedDataset(prefix).sequence_lengths.sum())
    per_epoch = (T - 1) // S
    base = (2 * T - 1) // S
    return [(50, False), (base + per_epoch // 4, True), (base + per_epoch * 9 // 10, False)]


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "+".join(sorted(f)) or "plain")
def test_same_samples_as_megatron(corpus, tmp_path, flags):
    S = 24
    # megatron-core builds reset attention masks in a Python loop: check every 7th sample there
    every = 7 if flags.get("create_attention_mask") else 1
    for (num_samples, _), seed in zip(_epoch_sizes(corpus, S), (1234, 7, 3)):
        ref = megatron_gpt(corpus, num_samples, S, seed=seed, create_attention_mask=flags.get("create_attention_mask", False),
                           **{k: v for k, v in flags.items() if k != "create_attention_mask"})
        section = dataloader_section(S, [corpus], sizes=(num_samples, 0, 0), seed=seed,
                                     path_to_cache=str(tmp_path / "cache"), **flags)
        ours = build_datasets(section)[0]
        assert len(ours) == len(ref)
        assert_same_samples(ours, ref, every=every)


def test_separate_final_epoch_is_exercised(corpus):
    """The cases above: 3 epochs, the final one shuffled separately in exactly one of them."""
    T = int(IndexedDataset(corpus).sequence_lengths.sum())
    per_epoch = (T - 1) // 24
    for num_samples, separate in _epoch_sizes(corpus, 24)[1:]:
        epochs = -(-(num_samples * 24 + 1) // T)
        from_final = num_samples - ((epochs - 1) * T - 1) // 24
        assert epochs == 3
        assert (from_final < int(0.8 * per_epoch)) == separate


def test_splits_and_partial_validation_sample_match_megatron(corpus, tmp_path):
    """split "8,2,0": train and valid document ranges, valid keeping (and padding) its last sample."""
    S = 20
    m = megatron()
    cfg = megatron_config(S, seed=5, blend=([corpus], None), split="8,2,0", cache=str(tmp_path / "mc"),
                          create_attention_mask=True, reset_attention_mask=True,
                          drop_last_partial_validation_sequence=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_train, ref_valid, ref_test = m.builder.BlendedMegatronDatasetBuilder(
            m.gpt_dataset.GPTDataset, [300, 40, 0], lambda: True, cfg).build()
    assert ref_test is None
    section = dataloader_section(S, [corpus], sizes=(300, 40, 0), split="8,2,0", seed=5,
                                 create_attention_mask=True, reset_attention_mask=True,
                                 drop_last_partial_validation_sequence=False)
    train, valid, test = build_datasets(section)
    assert test is None
    assert_same_samples(train, ref_train)
    assert_same_samples(valid, ref_valid)
    # the valid split really ends with a padded sample: pad labels are masked and zeroed
    padded = [i for i in range(len(valid)) if valid[i]["loss_mask"][-1] == 0 and valid[i]["labels"][-1] == 0]
    assert padded


def test_without_extra_token_matches_megatron(corpus):
    ref = megatron_gpt(corpus, 80, 16, add_extra_token_to_sequence=False)
    ours = build_datasets(dataloader_section(16, [corpus], sizes=(80, 0, 0), add_extra_token_to_sequence=False))[0]
    assert len(ours) == len(ref)
    assert_same_samples(ours, ref)


def test_mock_data_matches_megatron_mock():
    m = megatron()
    cfg = megatron_config(64, blend=None, vocab_size=1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        low = m.gpt_dataset.MockGPTLowLevelDataset(cfg.tokenizer)
        ref = m.gpt_dataset.MockGPTDataset(low, None, np.arange(5000, dtype=np.int32), 40, m.Split.train, cfg)
    ours_cfg = GPTDatasetConfig.from_dict({"seq_length": 64, "eod": EOD, "vocab_size": 1000,
                                           "create_attention_mask": True, "mock": True})
    ours = GPTDataset(MockLowLevelDataset(EOD, 1000), None, np.arange(5000), 40, "train", ours_cfg)
    assert len(ours) == len(ref)
    assert_same_samples(ours, ref, count=40)
    # mock: true → mock data through the public entry point
    train = build_datasets(dataloader_section(1024, None, sizes=(40, 0, 0)))[0]
    assert len(train) >= 40 and train[0]["input_ids"].shape == (1024,)


# ------------------------------------------------------------------------------------------------
# index caches
# ------------------------------------------------------------------------------------------------
def _gpt(prefix, cache, num_samples=30, seed=1234):
    cfg = GPTDatasetConfig.from_dict({"seq_length": 8, "seed": seed, "eod": EOD, "path_to_cache": cache,
                                      "create_attention_mask": False})
    return GPTDataset(IndexedDataset(prefix), prefix, np.arange(len(IndexedDataset(prefix))), num_samples, "train", cfg)


def test_cache_written_once_reused_and_rebuilt(tmp_path):
    prefix = write_indexed_dataset(tmp_prefix(tmp_path), make_documents(40, seed=12), np.uint16)
    cache = str(tmp_path / "cache")
    first = _gpt(prefix, cache)
    assert first.built_indices
    files = sorted(os.listdir(cache))
    assert sum(f.endswith(".npy") for f in files) == 3 and any(f.endswith("description.txt") for f in files)
    again = _gpt(prefix, cache)
    assert not again.built_indices
    np.testing.assert_array_equal(first.shuffle_index, again.shuffle_index)
    assert _gpt(prefix, cache, seed=5).built_indices  # another seed: another cache
    assert _gpt(prefix, cache, num_samples=500).built_indices  # other size
    # regenerate the data under the same name: the cache must not be reused
    write_indexed_dataset(prefix, make_documents(40, seed=13), np.uint16)
    rebuilt = _gpt(prefix, cache)
    assert rebuilt.built_indices
    ref = megatron_gpt(prefix, 30, 8)
    assert_same_samples(rebuilt, ref)


def test_default_cache_next_to_the_data(tmp_path):
    prefix = write_indexed_dataset(tmp_prefix(tmp_path), make_documents(40, seed=14), np.uint16)
    build_datasets(dataloader_section(8, [prefix], sizes=(10, 0, 0)))
    assert os.listdir(tmp_path / "cache" / "GPTDataset_indices")


def _build_in_child(args):
    prefix, cache = args
    return _gpt(prefix, cache, num_samples=2000).built_indices


def test_concurrent_builders_build_once(tmp_path):
    prefix = write_indexed_dataset(tmp_prefix(tmp_path), make_documents(300, seed=15), np.uint16)
    cache = str(tmp_path / "cache")
    ctx = mp.get_context("fork")
    with ctx.Pool(3) as pool:
        built = pool.map_async(_build_in_child, [(prefix, cache)] * 3).get(timeout=120)
    assert sum(built) == 1
    assert not _gpt(prefix, cache, num_samples=2000).built_indices


def test_index_build_of_a_million_documents_is_fast(tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 20, 1_000_000)
    builder = IndexedDatasetBuilder(tmp_prefix(tmp_path), np.uint16)
    builder.add_documents(rng.integers(0, 60000, int(lengths.sum())).astype(np.uint16), lengths)
    builder.finalize()
    cfg = GPTDatasetConfig.from_dict({"seq_length": 64, "eod": EOD, "path_to_cache": str(tmp_path / "c"),
                                      "create_attention_mask": False})
    low = IndexedDataset(tmp_prefix(tmp_path))
    t0 = time.process_time()   # this process's CPU time: a busy machine does not inflate it
    ds = GPTDataset(low, tmp_prefix(tmp_path), np.arange(len(low)), 250_000, "train", cfg)
    elapsed = time.process_time() - t0
    assert len(ds) >= 250_000 and ds.built_indices
    assert elapsed < 10.0, f"building the indices of 1M documents took {elapsed:.1f} s"


# ------------------------------------------------------------------------------------------------
# configuration errors
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, message", [
    ({"seq_length": 0}, r"config\.seq_length: must be > 0"),
    ({"seq_length": "4k"}, r"config\.seq_length: expected int"),
    ({"eod_mask_loss": "yes"}, r"config\.eod_mask_loss: expected bool"),
    ({"split": None}, r"config\.split: required with data_path"),
    ({"split": "1,2,3,4"}, r"config\.split: expected 1 to 3"),
    ({"bogus": 1}, r"config: unknown key\(s\) \['bogus'\]"),
    ({"train_data_path": ["x"]}, r"either data_path .* or train/valid/test_data_path"),
    ({"eod_pad_length": -1}, r"config\.eod_pad_length: must be > 0"),
])
def test_config_errors(tmp_path, change, message):
    section = dataloader_section(8, [tmp_prefix(tmp_path)])
    section["config"].update(change)
    with pytest.raises(ConfigError, match=message):
        build_datasets(section)


def test_seq_length_from_the_model_must_agree(tmp_path):
    prefix = write_indexed_dataset(tmp_prefix(tmp_path), make_documents(40, seed=17), np.uint16)
    section = dataloader_section(8, [prefix], sizes=(10, 0, 0))
    with pytest.raises(ConfigError, match=r"seq_length \(8\) differs from model\.seq_length \(16\)"):
        build_datasets(section, seq_length=16)
    del section["config"]["seq_length"]
    assert build_datasets(section, seq_length=16)[0][0]["input_ids"].shape == (16,)


def test_missing_dataset_names_the_file(tmp_path):
    with pytest.raises(DatasetError, match=r"nope\.idx: file not found"):
        build_datasets(dataloader_section(8, [str(tmp_path / "nope")]))


def test_empty_split_is_an_error_not_a_hang(tmp_path):
    prefix = write_indexed_dataset(tmp_prefix(tmp_path), make_documents(3, seed=16), np.uint16)
    with pytest.raises(DatasetError, match=r"valid split, 0 documents\): has 0 tokens"):
        build_datasets(dataloader_section(8, [prefix], sizes=(10, 5, 0), split="99,1,0"))


def test_cache_built_by_another_rank_is_loaded_outside_the_lock(tmp_path, monkeypatch):
    """The ranks that waited while one built the cache check and load it after the lock is released,
    in parallel (under the lock, W ranks' CRC checks of the whole cache ran one after another)."""
    import contextlib

    import lit_moe.data.cache as cache

    real_lock, real_damage = cache.file_lock, cache.damage
    arrays = {"a": np.arange(10)}
    held, checked_under_lock = [], []

    @contextlib.contextmanager
    def another_rank_builds_first(path, *args, **kwargs):
        monkeypatch.setattr(cache, "file_lock", real_lock)
        cache.cached_arrays(str(tmp_path), "s", ["a"], "desc", lambda: arrays)   # first to the lock
        with real_lock(path):
            held.append(path)
            yield
            held.remove(path)

    def damage_spy(*args):
        checked_under_lock.append(bool(held))
        return real_damage(*args)

    monkeypatch.setattr(cache, "file_lock", another_rank_builds_first)
    monkeypatch.setattr(cache, "damage", damage_spy)
    got, built = cache.cached_arrays(str(tmp_path), "s", ["a"], "desc", lambda: pytest.fail("built twice"))
    assert not built and got["a"].tolist() == list(range(10))
    assert checked_under_lock == [False]


def test_cache_where_the_file_system_refuses_flock(tmp_path, monkeypatch):
    """flock failing with ENOLCK (NFS without its lock daemon): an exclusive-create marker file locks
    instead; the cache is built once, then loaded."""
    import errno
    import os

    import lit_moe.data.cache as cache

    def no_flock(fd, op):
        if op != cache.fcntl.LOCK_UN:
            raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(cache.fcntl, "flock", no_flock)
    markers = []

    def build():
        markers.append(os.path.exists(tmp_path / "s.lock.excl"))
        return {"a": np.arange(5)}

    got, built = cache.cached_arrays(str(tmp_path), "s", ["a"], "desc", build)
    assert built and markers == [True] and not (tmp_path / "s.lock.excl").exists()
    got, built = cache.cached_arrays(str(tmp_path), "s", ["a"], "desc", build)
    assert not built and got["a"].tolist() == [0, 1, 2, 3, 4]
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]        # temporary names all renamed
