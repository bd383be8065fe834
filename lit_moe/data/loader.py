"""``train_dataset.dataloader`` → (train, valid, test) datasets: MindFormers' BlendedMegatronDatasetDataLoader,
or MindSpore's MindDataset (MindRecord files, read by :mod:`lit_moe.data.mindrecord`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from lit_moe.config import ConfigError
from lit_moe.data import builtin
from lit_moe.data.blended import build_blended_splits
from lit_moe.data.gpt import GPTDatasetConfig

FIELD = "train_dataset.dataloader"
KNOWN_KEYS = {"type", "datasets_type", "sizes", "config", "column_names", "shuffle", "python_multiprocessing"}
# Keys MindFormers passes to the loader that have no meaning here (sharding comes from the strategy).
IGNORED_KEYS = {"num_shards", "shard_id", "phase", "tokenizer"}


@dataclass
class DataloaderSpec:
    """The validated ``train_dataset.dataloader`` mapping."""

    sizes: list[Optional[int]]
    """Samples of the train, valid and test splits (0: not built)."""
    config: GPTDatasetConfig
    """The GPTDataset options (``config:``)."""
    column_names: list[str]
    """Columns of every sample, in order."""
    shuffle: bool = False
    """Shuffle the sample order again each epoch (GPTDataset already shuffles once)."""
    python_multiprocessing: bool = False
    """Load with worker processes (True) or worker threads (False)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """MindFormers' keys without meaning here (``IGNORED_KEYS``)."""


@dataclass
class MindDatasetSpec:
    """The validated ``train_dataset.dataloader`` mapping of ``type: MindDataset``."""

    dataset_files: Any
    """``dataset_files`` as written: .mindrecord files and/or directories holding them."""
    column_names: Optional[list[str]]
    """Columns of every sample (MindSpore's ``columns_list``); None: every column of the files."""
    seq_length: Optional[int]
    """The sequence length every 1-D column must have (``model.seq_length``)."""
    shuffle: bool = True
    """Shuffle each epoch (MindSpore's default); lit_moe's permutation seeded by ``training.seed``."""
    python_multiprocessing: bool = False
    """Load with worker processes (True) or worker threads (False)."""
    pad_shards: bool = True
    """MindSpore pads every data-parallel shard to ``ceil(N / D)`` samples before batching."""


# MindSpore's MindDataset arguments that MindFormers sets itself (num_shards/shard_id from the layout,
# num_parallel_workers from train_dataset) and the ones lit_moe does not implement.
_MIND_DATASET_SET_BY_MINDFORMERS = {"num_shards", "shard_id", "num_parallel_workers"}
_MIND_DATASET_NOT_IMPLEMENTED = {"sampler", "padded_sample", "num_padded", "num_samples", "cache", "columns_list"}
_MIND_DATASET_KEYS = {"type", "dataset_files", "column_names", "shuffle", "python_multiprocessing"}


def parse_mind_dataset(section: dict, seq_length: Optional[int]) -> MindDatasetSpec:
    for key in section:
        if key in _MIND_DATASET_NOT_IMPLEMENTED:
            hint = "; write column_names (MindFormers passes it on as columns_list)" if key == "columns_list" else ""
            raise ConfigError(f"{FIELD}.{key}: not implemented yet for MindDataset{hint}")
        if key not in _MIND_DATASET_KEYS | _MIND_DATASET_SET_BY_MINDFORMERS:
            raise ConfigError(f"{FIELD}.{key}: unknown MindDataset key; supported: "
                              + ", ".join(sorted(_MIND_DATASET_KEYS)))
    if section.get("dataset_files") in (None, "", []):
        raise ConfigError(f"{FIELD}.dataset_files: missing; MindDataset needs the .mindrecord file(s) or a directory")
    columns = section.get("column_names")
    if isinstance(columns, str):
        columns = [columns]
    if columns is not None:
        if not isinstance(columns, (list, tuple)) or not all(isinstance(c, str) for c in columns):
            raise ConfigError(f"{FIELD}.column_names: expected a list of column names, got {columns!r}")
        if len(set(columns)) != len(columns):
            raise ConfigError(f"{FIELD}.column_names: duplicate names in {list(columns)}")
        for needed in ("input_ids", "labels"):
            if needed not in columns:
                raise ConfigError(f"{FIELD}.column_names: {list(columns)} leaves out {needed!r}; training needs "
                                  "input_ids and labels")
    for key in ("shuffle", "python_multiprocessing"):
        if not isinstance(section.get(key, False), bool):
            raise ConfigError(f"{FIELD}.{key}: expected true or false, got {section[key]!r}")
    shuffle = section.get("shuffle", True)
    if shuffle:
        warnings.warn(f"{FIELD}.shuffle: true (MindSpore's default when not given) shuffles with lit_moe's "
                      "permutation seeded by training.seed, not in MindSpore's random order; shuffle: false reads "
                      "the samples in MindSpore's order", stacklevel=3)
    return MindDatasetSpec(dataset_files=section["dataset_files"],
                           column_names=None if columns is None else list(columns), seq_length=seq_length, shuffle=shuffle,
                           python_multiprocessing=section.get("python_multiprocessing", False))


def build_mind_dataset(spec: MindDatasetSpec):
    from lit_moe.data.mindrecord import MindRecordDataset, mindrecord_files

    files = mindrecord_files(spec.dataset_files, f"{FIELD}.dataset_files")
    return MindRecordDataset(files, spec.column_names, f"{FIELD}.dataset_files", spec.seq_length)


def parse_dataloader(section: dict, seq_length: Optional[int] = None) -> Union[DataloaderSpec, MindDatasetSpec]:
    if not isinstance(section, dict):
        raise ConfigError(f"{FIELD}: expected a mapping, got {section!r}")
    kind = section.get("type")
    if kind == "MindDataset":
        return parse_mind_dataset(section, seq_length)
    if kind != "BlendedMegatronDatasetDataLoader":
        raise ConfigError(f"{FIELD}.type: {kind!r} is not supported; use BlendedMegatronDatasetDataLoader or "
                          "MindDataset")
    dtype = section.get("datasets_type", "GPTDataset")
    if dtype != "GPTDataset":
        raise ConfigError(f"{FIELD}.datasets_type: {dtype!r} is not supported; use GPTDataset")
    extra = {k: v for k, v in section.items() if k not in KNOWN_KEYS}
    unknown = sorted(set(extra) - IGNORED_KEYS, key=str)
    if unknown:
        from lit_moe.config_file import known_keys_error

        raise known_keys_error(FIELD, unknown[0], KNOWN_KEYS | IGNORED_KEYS)

    sizes = section.get("sizes")
    if not isinstance(sizes, (list, tuple)) or not 1 <= len(sizes) <= 3:
        raise ConfigError(f"{FIELD}.sizes: expected [train, valid, test] sample counts, got {sizes!r}")
    sizes = list(sizes) + [0] * (3 - len(sizes))
    for i, s in enumerate(sizes):
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
            raise ConfigError(f"{FIELD}.sizes[{i}]: expected an int >= 0, got {s!r}")

    config = GPTDatasetConfig.from_dict(section.get("config") or {}, seq_length=seq_length)
    config.check_has_data()
    produced = config.columns()
    columns = section.get("column_names")
    if columns is None:
        columns = produced
    if isinstance(columns, str):
        columns = [columns]
    if not isinstance(columns, (list, tuple)) or not all(isinstance(c, str) for c in columns):
        raise ConfigError(f"{FIELD}.column_names: expected a list of column names, got {columns!r}")
    if len(set(columns)) != len(columns):
        raise ConfigError(f"{FIELD}.column_names: duplicate names in {list(columns)}")
    for c in columns:
        if c not in produced:
            why = {"attention_mask": "create_attention_mask is false",
                   "actual_seq_len": "create_compressed_eod_mask is false"}.get(c, "no such column")
            raise ConfigError(f"{FIELD}.column_names: {c!r} is not produced ({why}); with this config a "
                              f"sample has {produced}")
    for key in ("shuffle", "python_multiprocessing"):
        if not isinstance(section.get(key, False), bool):
            raise ConfigError(f"{FIELD}.{key}: expected true or false, got {section[key]!r}")
    return DataloaderSpec(sizes=sizes, config=config, column_names=list(columns),
                          shuffle=section.get("shuffle", False),
                          python_multiprocessing=section.get("python_multiprocessing", False), extra=extra)


class ColumnDataset:
    """A GPT or blended dataset whose items are dicts of the configured ``column_names`` only."""

    def __init__(self, dataset, column_names: list[str]) -> None:
        self.dataset = dataset
        self.column_names = list(column_names)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < len(self.dataset):
            raise IndexError(f"sample {idx} out of range ({len(self.dataset)} samples)")
        sample = self.dataset[idx]
        return {c: sample[c] for c in self.column_names}


def build_from_spec(spec: Union[DataloaderSpec, MindDatasetSpec]) -> tuple:
    if isinstance(spec, MindDatasetSpec):
        return build_mind_dataset(spec), None, None
    cache_dir = builtin.default_cache_dir(spec.config.path_to_cache)
    splits = build_blended_splits(spec.config, spec.sizes, resolve=lambda p: builtin.resolve(p, cache_dir))
    return tuple(None if ds is None else ColumnDataset(ds, spec.column_names) for ds in splits)


def build_datasets(dataloader_section: dict, seq_length: Optional[int] = None) -> tuple:
    """(train, valid, test) from the ``train_dataset.dataloader`` mapping as written in YAML; None for
    a split of size 0 or without documents. Items are dicts of numpy arrays keyed by ``column_names``.

    ``seq_length`` (e.g. ``model.seq_length``) fills a missing ``config.seq_length`` and must equal a
    given one."""
    return build_from_spec(parse_dataloader(dataloader_section, seq_length))
