"""Blending several GPTDatasets into one, as Megatron's ``BlendedMegatronDatasetBuilder`` does.

``data_path: [w1, prefix1, w2, prefix2, …]`` (weights normalised to sum 1) or bare prefixes (weights =
dataset sizes). With weights and a requested size N, dataset ``i`` builds slightly more than its share
(``ceil(N·w_i·1.005)`` samples: Megatron's margin) and sample ``k`` of the blend comes from the
dataset whose count lags its target most: ``argmax_i(w_i·max(k,1) − c_i)``, ties to the lowest
index. All randomness is inside each GPTDataset's own shuffle.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional, Sequence

import numpy as np

from lit_moe.config import ConfigError
from lit_moe.data.cache import cached_arrays, description_hash
from lit_moe.data.gpt import SPLITS, GPTDataset, GPTDatasetConfig, build_gpt_splits, split_matrix
from lit_moe.data.indexed import DatasetError

FIELD = GPTDatasetConfig.FIELD


def parse_blend(entries: Optional[Sequence], field: str) -> Optional[tuple[list[str], Optional[list[float]]]]:
    """``[w, prefix, w, prefix…]`` → (prefixes, weights); ``[prefix, …]`` → (prefixes, None).

    Like Megatron: an even-length list whose every other entry parses as a number is weighted; a list
    where none do is all prefixes; a mix is an error (Megatron's own check of that is broken)."""
    if entries is None or len(entries) == 0:
        return None
    entries = list(entries)

    def as_weight(x) -> Optional[float]:
        if isinstance(x, bool):
            return None
        if isinstance(x, (int, float)):
            return float(x)
        try:
            return float(str(x))
        except ValueError:
            return None

    if len(entries) % 2 == 0:
        weights = [as_weight(x) for x in entries[0::2]]
        prefixes = entries[1::2]
        if all(w is not None for w in weights):
            for w, p in zip(weights, prefixes):
                if not (w > 0 and math.isfinite(w)):
                    raise ConfigError(f"{field}: weight {w!r} of {p!r} must be a positive number")
                if as_weight(p) is not None:
                    raise ConfigError(f"{field}: expected [weight, prefix, …] pairs, but {p!r} is a number")
            return [str(p).strip() for p in prefixes], weights
        if any(w is not None for w in weights):
            raise ConfigError(f"{field}: give a weight for every prefix or for none, got {entries!r}")
    for p in entries:
        if as_weight(p) is not None:
            raise ConfigError(f"{field}: {p!r} looks like a weight but the list {entries!r} does not "
                              f"have [weight, prefix] pairs")
    return [str(p).strip() for p in entries], None


def normalize(weights: Sequence[float]) -> list[float]:
    w = np.asarray(weights, dtype=np.float64)
    return (w / w.sum()).tolist()


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16 [size], dataset_sample_index int64 [size]) by greedy error diffusion.

    Sequential by nature (each choice depends on all earlier ones); a plain loop over Python floats
    does about a million samples per second, done once and cached."""
    w = [float(x) for x in weights]
    n = len(w)
    counts = [0] * n
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    choose = []
    append = choose.append
    if n == 2:  # the common case, unrolled
        w0, w1 = w
        c0 = c1 = 0
        for k in range(size):
            kk = k if k > 1 else 1.0
            if w1 * kk - c1 > w0 * kk - c0:
                append(1)
                c1 += 1
            else:
                append(0)
                c0 += 1
        dataset_index[:] = choose
    else:
        rng_n = range(1, n)
        for k in range(size):
            kk = float(max(k, 1))
            best, best_err = 0, w[0] * kk - counts[0]
            for i in rng_n:
                err = w[i] * kk - counts[i]
                if err > best_err:
                    best, best_err = i, err
            append(best)
            counts[best] += 1
        dataset_index[:] = choose
    # The i-th time dataset d is chosen it serves its sample i.
    for d in range(n):
        picks = dataset_index == d
        sample_index[picks] = np.arange(int(picks.sum()), dtype=np.int64)
    return dataset_index, sample_index


def build_exhaustive_blending_indices(sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Every sample of every dataset exactly once, interleaved in proportion to the sizes."""
    sizes = [int(s) for s in sizes]
    total = sum(sizes)
    w = [s / float(total) for s in sizes]
    counts = [0] * len(sizes)
    unspent = [i for i, s in enumerate(sizes) if s > 0]
    dataset_index = np.empty(total, dtype=np.int16)
    sample_index = np.empty(total, dtype=np.int64)
    for k in range(total):
        kk = float(max(k, 1))
        best, best_err = -1, -math.inf
        for i in unspent:
            err = w[i] * kk - counts[i]
            if err > best_err:
                best, best_err = i, err
        dataset_index[k] = best
        sample_index[k] = counts[best]
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
    return dataset_index, sample_index


class BlendedDataset:
    """Sample ``k`` is sample ``dataset_sample_index[k]`` of ``datasets[dataset_index[k]]``."""

    def __init__(self, datasets: list[GPTDataset], weights: Sequence[float], size: Optional[int],
                 config: GPTDatasetConfig) -> None:
        if not datasets or len(datasets) != len(weights):
            raise DatasetError(f"{FIELD}.data_path: {len(datasets)} datasets but {len(weights)} weights")
        if len(datasets) >= 32767:
            raise DatasetError(f"{FIELD}.data_path: at most 32766 datasets can be blended, got {len(datasets)}")
        self.datasets = datasets
        self.split = datasets[0].split
        self.weights = normalize(weights) if size is not None else [int(w) for w in weights]
        self.size = size
        self.config = config
        desc = {"class": "BlendedDataset", "split": self.split, "weights": self.weights, "size": size,
                "datasets": [d._description() for d in datasets]}
        text, digest = description_hash(desc)
        arrays, _ = cached_arrays(config.path_to_cache, f"{digest}-BlendedDataset-{self.split}",
                                  ["dataset_index", "dataset_sample_index"], text, self._build,
                                  on_warning=lambda m: warnings.warn(m, stacklevel=3))
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]

    def _build(self) -> dict[str, np.ndarray]:
        if self.size is not None:
            di, dsi = build_blending_indices(self.weights, self.size)
        else:
            di, dsi = build_exhaustive_blending_indices(self.weights)
        counts = np.bincount(di, minlength=len(self.datasets))
        for i, (ds, need) in enumerate(zip(self.datasets, counts)):
            if need > len(ds):
                raise DatasetError(
                    f"{FIELD}.data_path: the {self.split} blend needs {need} samples from "
                    f"{ds.dataset_path or 'mock data'} (dataset {i}) but it has only {len(ds)}; raise "
                    f"{FIELD}.mid_level_dataset_surplus")
        return {"dataset_index": di, "dataset_sample_index": dsi}

    def __len__(self) -> int:
        return int(self.dataset_index.shape[0])

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]


def per_dataset_sizes(weights: Sequence[float], sizes: Sequence[Optional[int]], config: GPTDatasetConfig):
    """(samples each dataset builds, samples the blend draws) per split, by ``config.blend_size_rule``."""
    surplus = config.mid_level_dataset_surplus
    build, target = [], []
    for w in weights:
        b, t = [], []
        for size in sizes:
            if size is None:
                b.append(None)
                t.append(None)
            elif config.blend_size_rule == "megatron_core":
                share = int(math.ceil(size * w))
                t.append(share)
                b.append(int(math.ceil(share * (1 + surplus))))
            else:
                share = int(math.ceil(size * w * (1 + surplus)))
                t.append(share)
                b.append(share)
        build.append(b)
        target.append(t)
    return build, target


def _blend_one_distribution(prefixes: list[str], weights: Optional[list[float]], bookends, sizes,
                            config: GPTDatasetConfig, resolve) -> list:
    """The splits of ``bookends`` from one blend (shared by data_path and each *_data_path)."""
    if len(prefixes) == 1 and weights is None:
        return build_gpt_splits(resolve(prefixes[0]), bookends, sizes, config)
    if weights is not None:
        weights = normalize(weights)
        build_sizes, target_sizes = per_dataset_sizes(weights, sizes, config)
    else:
        build_sizes = [[None if s != 0 else 0 for s in sizes] for _ in prefixes]
        target_sizes = None
    per_dataset = [build_gpt_splits(resolve(p), bookends, build_sizes[i], config) for i, p in enumerate(prefixes)]
    out: list = []
    for i in range(len(SPLITS)):
        if bookends[i] is None or sizes[i] == 0:
            out.append(None)
            continue
        parts = [per_dataset[d][i] for d in range(len(prefixes))]
        if weights is not None:
            size = None if sizes[i] is None else sum(t[i] for t in target_sizes)
            if size is None:
                raise ConfigError(f"train_dataset.dataloader.sizes: a weighted blend needs a size for the "
                                  f"{SPLITS[i]} split")
            w = weights
        else:
            w = [len(p) for p in parts]
            size = None if sizes[i] is None else min(sizes[i], sum(w))
        out.append(BlendedDataset(parts, w, size, config))
    return out


def build_blended_splits(config: GPTDatasetConfig, sizes: Sequence[Optional[int]], resolve=lambda p: p) -> list:
    """(train, valid, test) datasets as BlendedMegatronDatasetBuilder builds them. ``resolve`` maps a
    data_path prefix to a file prefix (for ``builtin:`` corpora)."""
    if config.mock:
        bookends = split_matrix(config.split or "1")
        return build_gpt_splits(None, bookends, sizes, config)
    if config.data_path:
        prefixes, weights = parse_blend(config.data_path, f"{FIELD}.data_path")
        return _blend_one_distribution(prefixes, weights, split_matrix(config.split), sizes, config, resolve)
    out = []
    for i, key in enumerate(("train_data_path", "valid_data_path", "test_data_path")):
        blend = parse_blend(getattr(config, key), f"{FIELD}.{key}")
        if blend is None or sizes[i] == 0:
            out.append(None)
            continue
        bookends = [None, None, None]
        bookends[i] = (0.0, 1.0)
        sizes_i = [0, 0, 0]
        sizes_i[i] = sizes[i]
        if len(blend[0]) == 1:  # Megatron ignores a lone per-split weight: a plain GPTDataset
            out.append(build_gpt_splits(resolve(blend[0][0]), bookends, sizes_i, config)[i])
            continue
        out.append(_blend_one_distribution(blend[0], blend[1], bookends, sizes_i, config, resolve)[i])
    return out
