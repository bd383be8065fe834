"""Blending: greedy assignment against megatron-core's helpers, whole blends against its builder."""

import math
import os
import warnings

import numpy as np
import pytest

from lit_moe.config import ConfigError
from lit_moe.data import BlendedDataset, DatasetError, build_datasets, parse_blend
from lit_moe.data.blended import build_blending_indices, build_exhaustive_blending_indices
from test_data_support import (assert_same_samples, dataloader_section, make_documents, megatron, megatron_config,
                               megatron_gpt, write_with_megatron)


def test_blending_hand_example():
    """w = [0.3, 0.7], 10 samples → [1, 0, 1, 1, 0, 1, 1, 0, 1, 1] (deepseek_math.md §6.5)."""
    di, dsi = build_blending_indices([0.3, 0.7], 10)
    assert di.tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    assert dsi.tolist() == [0, 0, 1, 2, 1, 3, 4, 2, 5, 6]


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.3, 0.7], [0.2, 0.3, 0.5], [0.1, 0.05, 0.6, 0.25], [1.0]])
def test_blending_indices_match_megatron(weights):
    size = 3001
    ours = build_blending_indices(weights, size)
    di = np.zeros(size, np.int16)
    dsi = np.zeros(size, np.int64)
    megatron().helpers.build_blending_indices(di, dsi, np.array(weights, np.float64), len(weights), size, False)
    np.testing.assert_array_equal(ours[0], di)
    np.testing.assert_array_equal(ours[1], dsi)


def test_exhaustive_blending_matches_megatron():
    sizes = [7, 19, 3, 11]
    ours = build_exhaustive_blending_indices(sizes)
    total = sum(sizes)
    di = np.zeros(total, np.int16)
    dsi = np.zeros(total, np.int64)
    megatron().helpers.build_exhaustive_blending_indices(di, dsi, np.array(sizes, np.int64), len(sizes))
    np.testing.assert_array_equal(ours[0], di)
    np.testing.assert_array_equal(ours[1], dsi)


def test_parse_blend():
    assert parse_blend(["1", "/d/a"], "f") == (["/d/a"], [1.0])
    assert parse_blend([0.3, " a ", 70, "b"], "f") == (["a", "b"], [0.3, 70.0])
    assert parse_blend(["a", "b"], "f") == (["a", "b"], None)
    assert parse_blend(["a", "b", "c"], "f") == (["a", "b", "c"], None)
    assert parse_blend(None, "f") is None
    with pytest.raises(ConfigError, match="a weight for every prefix or for none"):
        parse_blend(["0.3", "a", "b", "c"], "f")
    with pytest.raises(ConfigError, match="must be a positive number"):
        parse_blend(["-1", "a"], "f")
    with pytest.raises(ConfigError, match="looks like a weight"):
        parse_blend(["0.5", "a", "b"], "f")


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("blend"))
    return [write_with_megatron(os.path.join(root, name), make_documents(n, seed=seed, max_len=40))
            for name, n, seed in [("a", 80, 21), ("b", 150, 22), ("c", 60, 23)]]


def _megatron_blend(blend=None, sizes=(500, 0, 0), seq_length=16, split="1,0,0", blend_per_split=None, **kw):
    m = megatron()
    cfg = megatron_config(seq_length, blend=blend, split=split, **kw)
    if blend_per_split is not None:
        cfg = megatron_config(seq_length, blend=None, **kw)
        cfg.blend_per_split, cfg.mock, cfg.split, cfg.split_matrix = blend_per_split, False, None, None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return m.builder.BlendedMegatronDatasetBuilder(m.gpt_dataset.GPTDataset, list(sizes), lambda: True, cfg).build()


def test_weighted_blend_megatron_core_rule(prefixes):
    a, b, _ = prefixes
    ref = _megatron_blend(([a, b], [0.3, 0.7]), sizes=(500, 0, 0))[0]
    ours = build_datasets(dataloader_section(16, ["0.3", a, "0.7", b], sizes=(500, 0, 0),
                                             blend_size_rule="megatron_core"))[0]
    assert len(ours) == len(ref) == 500
    assert_same_samples(ours, ref)


def test_weighted_blend_mindformers_rule(prefixes):
    """MindFormers: dataset i builds ceil(N·w_i·1.005) samples and the blend is their sum; its first N
    samples are megatron-core's, and each part is megatron-core's GPTDataset of that size."""
    a, b, c = prefixes
    N, weights = 700, [2.0, 5.0, 3.0]
    w = [x / sum(weights) for x in weights]
    ours = build_datasets(dataloader_section(16, [2, a, 5, b, 3, c], sizes=(N, 0, 0)))[0]
    per_dataset = [math.ceil(N * wi * 1.005) for wi in w]
    assert per_dataset == [141, 352, 212]  # 700·0.3·1.005 = 211.05
    assert len(ours) == sum(per_dataset)
    for part, prefix, n in zip(ours.dataset.datasets, (a, b, c), per_dataset):
        assert part.num_samples == n
        assert_same_samples(part, megatron_gpt(prefix, n, 16))
    ref = _megatron_blend(([a, b, c], weights), sizes=(N, 0, 0))[0]
    assert len(ref) == N
    assert_same_samples(ours, ref)


def test_single_weighted_prefix_is_a_blend_of_one(prefixes):
    a = prefixes[0]
    ours = build_datasets(dataloader_section(16, ["1", a], sizes=(300, 0, 0)))[0]
    assert isinstance(ours.dataset, BlendedDataset)
    assert len(ours) == math.ceil(300 * 1.005)
    assert_same_samples(ours, _megatron_blend(([a], [1.0]), sizes=(300, 0, 0))[0])


def test_unweighted_prefixes_blend_by_size(prefixes):
    a, b, _ = prefixes
    ref = _megatron_blend(([a, b], None), sizes=(400, 0, 0))[0]
    ours = build_datasets(dataloader_section(16, [a, b], sizes=(400, 0, 0)))[0]
    assert len(ours) == len(ref)
    assert_same_samples(ours, ref)


def test_blend_with_train_and_valid_splits(prefixes, tmp_path):
    a, b, _ = prefixes
    ref_train, ref_valid, _ = _megatron_blend(([a, b], [0.4, 0.6]), sizes=(300, 60, 0), split="9,1,0",
                                              create_attention_mask=True, reset_attention_mask=True,
                                              reset_position_ids=True)
    train, valid, test = build_datasets(dataloader_section(
        16, ["0.4", a, "0.6", b], sizes=(300, 60, 0), split="9,1,0", blend_size_rule="megatron_core",
        create_attention_mask=True, reset_attention_mask=True, reset_position_ids=True,
        path_to_cache=str(tmp_path)))
    assert test is None
    assert_same_samples(train, ref_train, every=5)
    assert_same_samples(valid, ref_valid)


def test_per_split_data_paths(prefixes):
    a, b, c = prefixes
    ref_train, ref_valid, _ = _megatron_blend(
        sizes=(200, 50, 0), blend_per_split=[([a, b], [0.5, 0.5]), ([c], None), None])
    train, valid, test = build_datasets(dataloader_section(
        16, None, sizes=(200, 50, 0), train_data_path=["0.5", a, "0.5", b], valid_data_path=[c],
        blend_size_rule="megatron_core"))
    assert test is None
    assert_same_samples(train, ref_train)
    assert len(valid) == len(ref_valid)
    assert_same_samples(valid, ref_valid)


def test_blend_indices_cached(prefixes, tmp_path):
    a, b, _ = prefixes
    section = dataloader_section(16, ["0.3", a, "0.7", b], sizes=(200, 0, 0), path_to_cache=str(tmp_path))
    first = build_datasets(section)[0]
    assert any("BlendedDataset" in f for f in os.listdir(tmp_path))
    second = build_datasets(section)[0]
    np.testing.assert_array_equal(first.dataset.dataset_index, second.dataset.dataset_index)


def test_oversampling_is_an_error(prefixes):
    a, b, _ = prefixes
    parts = build_datasets(dataloader_section(16, [a, b], sizes=(100, 0, 0)))[0].dataset.datasets
    with pytest.raises(DatasetError, match=r"needs \d+ samples from .*a \(dataset 0\) but it has only"):
        BlendedDataset(parts, [0.99, 0.01], len(parts[0]) * 3, parts[0].config)


def test_blend_errors(prefixes):
    a = prefixes[0]
    with pytest.raises(ConfigError, match=r"data_path: weight -0\.5 of"):
        build_datasets(dataloader_section(16, ["-0.5", a]))
    with pytest.raises(ConfigError, match=r"blend_size_rule: expected"):
        build_datasets(dataloader_section(16, ["1", a], blend_size_rule="other"))
