"""Megatron's GPTDataset: fixed-length samples cut from the shuffled, concatenated token stream.

For the same documents, seed and sizes this gives the same samples in the same order as
megatron-core's (and MindFormers') GPTDataset. Three index arrays describe the dataset:

- **document index**: the split's documents repeated for the needed number of epochs, shuffled as
  one array by ``numpy.random.RandomState(seed)`` (the last epoch separately when it would be used for
  less than 80% of its samples);
- **sample index** ``[num_samples + 1, 2]``: (position in the document index, token offset) where each
  sample starts. Sample ``j`` covers tokens ``j*S : j*S + S + 1`` of the concatenated stream (one
  extra token so that inputs and labels are both ``S`` long), so consecutive samples share a token;
- **shuffle index**: a permutation of the samples drawn from the same RandomState.

Megatron builds the sample index with a C++ loop (``helpers.cpp``); here it is a ``searchsorted`` over
the token prefix sums, which gives the same array (1M documents in well under a second).
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from lit_moe.config import ConfigError
from lit_moe.data.cache import cached_arrays, description_hash, file_fingerprint
from lit_moe.data.indexed import DatasetError, IndexedDataset, idx_path

SPLITS = ("train", "valid", "test")
CACHE_FORMAT = 1  # bump when the cached arrays change meaning


# ----------------------------------------------------------------------------------------------
# configuration: train_dataset.dataloader.config
# ----------------------------------------------------------------------------------------------
@dataclass
class GPTDatasetConfig:
    """``train_dataset.dataloader.config``: the GPTDataset keys of a MindFormers YAML."""

    seq_length: int
    """Tokens per sample (inputs and labels are both this long)."""
    seed: int = 1234
    """Seed of the document and sample shuffles (Megatron's ``--seed``; MindFormers' default 1234)."""
    split: Optional[str] = None
    """Train/valid/test proportions of each dataset's documents, e.g. ``"969, 30, 1"`` or ``"1, 0, 0"``.
    Required with ``data_path``."""
    data_path: Optional[list] = None
    """``[weight, prefix, weight, prefix, …]`` or ``[prefix, …]``: the indexed datasets to blend. A prefix
    ``builtin:austen`` is the shipped corpus. One of ``data_path``, ``train_data_path``/… or ``mock`` is
    required."""
    train_data_path: Optional[list] = None
    """Blend for the train split only (with ``valid_data_path``/``test_data_path`` instead of
    ``data_path`` + ``split``)."""
    valid_data_path: Optional[list] = None
    """Blend for the valid split only."""
    test_data_path: Optional[list] = None
    """Blend for the test split only."""
    eod: int = -1
    """Token id of the end-of-document token."""
    pad: int = -1
    """Token id used to pad a short last sample (−1, the default, never occurs in data). Positions whose
    label is ``pad`` get loss mask 0, and ``pad`` ids are replaced by 0 in inputs and labels."""
    eod_mask_loss: bool = False
    """Loss mask 0 where the *input* token is EOD (do not learn to predict across documents)."""
    reset_position_ids: bool = False
    """Positions restart at 0 after every EOD (the EOD keeps its document's position)."""
    create_attention_mask: bool = True
    """Return ``attention_mask`` ``[1, S, S]`` bool, True = blocked (causal unless reset below)."""
    reset_attention_mask: bool = False
    """Tokens after an EOD cannot attend to tokens up to and including it (block-diagonal causal)."""
    create_compressed_eod_mask: bool = False
    """Return ``actual_seq_len``: the end offsets of the documents in the sample (EOD index + 1, not
    counting an EOD at the last position), right-padded with ``seq_length`` to ``eod_pad_length``."""
    eod_pad_length: int = 128
    """Length of ``actual_seq_len`` (alias ``compressed_eod_mask_length``). More EODs in a sample is an error."""
    path_to_cache: Optional[str] = None
    """Directory of the cached index arrays. Default: ``cache/GPTDataset_indices`` next to each dataset."""
    mmap_bin_files: bool = True
    """Memory-map the ``.bin`` files (False: read them with file reads)."""
    add_extra_token_to_sequence: bool = True
    """Read ``seq_length + 1`` tokens per sample; False reads ``seq_length`` and pads the last label."""
    drop_last_partial_validation_sequence: bool = True
    """Drop the last, partial validation sample (True) or pad it (False)."""
    num_dataset_builder_threads: int = 1
    """Accepted for compatibility; indices are built by one process under a lock."""
    mid_level_dataset_surplus: float = 0.005
    """Extra fraction of samples built per blended dataset (Megatron's margin)."""
    blend_size_rule: str = "mindformers"
    """How a weighted blend is sized. ``mindformers`` (MindFormers and Megatron ≤ 0.11): each dataset
    builds ``ceil(size·w·(1+surplus))`` samples and the blend is the sum of those. ``megatron_core``
    (megatron-core ≥ 0.12): each dataset builds ``ceil(ceil(size·w)·(1+surplus))`` and the blend is
    ``Σ ceil(size·w)`` long. The two agree on most sizes."""
    mock: bool = False
    """Train on synthetic documents (megatron-core's mock data, for benchmarks and smoke tests) instead
    of ``data_path``. Must be asked for by name: a config without any data path is an error, so a
    misspelled key never trains on mock data."""
    vocab_size: Optional[int] = None
    """The model's vocabulary (``lit_moe fit`` fills in ``model.vocab_size``). Indexed data: a token id
    outside ``[0, vocab_size)`` is an error naming the file, document and id (checked for every sample
    as it is read, and at start against the largest id ``lit_moe preprocess`` recorded). Mock data:
    token ids are taken modulo this (as megatron-core's mock data does)."""

    FIELD = "train_dataset.dataloader.config"

    @classmethod
    def from_dict(cls, section: dict, seq_length: Optional[int] = None) -> "GPTDatasetConfig":
        """Validate the YAML mapping. ``seq_length`` (from ``model.seq_length``) fills a missing
        ``seq_length`` and must agree with a given one."""
        F = cls.FIELD
        if section is None:
            section = {}
        if not isinstance(section, dict):
            raise ConfigError(f"{F}: expected a mapping of GPTDataset options, got {section!r}")
        section = dict(section)
        if "compressed_eod_mask_length" in section:
            alias = section.pop("compressed_eod_mask_length")
            section.setdefault("eod_pad_length", alias)
        if "s3_cache_path" in section:
            if section.pop("s3_cache_path") is not None:
                raise ConfigError(f"{F}.s3_cache_path: S3 data loading is not supported")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(section) - names)
        if unknown:
            raise ConfigError(f"{F}: unknown key(s) {unknown}; known keys: {sorted(names)}")
        if seq_length is not None:
            given = section.get("seq_length")
            if given is not None and given != seq_length:
                raise ConfigError(f"{F}.seq_length ({given}) differs from model.seq_length ({seq_length})")
            section["seq_length"] = seq_length
        if section.get("seq_length") is None:
            raise ConfigError(f"{F}.seq_length: required (a positive int)")

        def check(name, kind, positive=False, optional=False):
            if name not in section:
                return
            v = section[name]
            if v is None and optional:
                return
            ok = isinstance(v, bool) if kind is bool else (
                isinstance(v, kind) and not isinstance(v, bool))
            if not ok:
                raise ConfigError(f"{F}.{name}: expected {kind.__name__}, got {v!r}")
            if positive and v <= 0:
                raise ConfigError(f"{F}.{name}: must be > 0, got {v!r}")

        check("seq_length", int, positive=True)
        check("seed", int)
        check("eod", int)
        check("pad", int)
        check("eod_pad_length", int, positive=True)
        check("num_dataset_builder_threads", int)
        check("vocab_size", int, positive=True, optional=True)
        for b in ("eod_mask_loss", "reset_position_ids", "create_attention_mask", "reset_attention_mask",
                  "create_compressed_eod_mask", "mmap_bin_files", "add_extra_token_to_sequence",
                  "drop_last_partial_validation_sequence"):
            if section.get(b, False) is None:  # MindFormers writes `mmap_bin_files: null`
                section.pop(b)
            check(b, bool)
        if "mid_level_dataset_surplus" in section:
            v = section["mid_level_dataset_surplus"]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ConfigError(f"{F}.mid_level_dataset_surplus: expected a float >= 0, got {v!r}")
        if section.get("blend_size_rule", "mindformers") not in ("mindformers", "megatron_core"):
            raise ConfigError(f"{F}.blend_size_rule: expected 'mindformers' or 'megatron_core', "
                              f"got {section['blend_size_rule']!r}")
        if section.get("path_to_cache") is not None and not isinstance(section["path_to_cache"], str):
            raise ConfigError(f"{F}.path_to_cache: expected a directory path, got {section['path_to_cache']!r}")
        for key in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
            v = section.get(key)
            if v is not None and not isinstance(v, (list, tuple, str)):
                raise ConfigError(f"{F}.{key}: expected a list [weight, prefix, …] or [prefix, …], got {v!r}")
            if isinstance(v, str):
                section[key] = [v]
            elif v is not None and len(v) == 0:
                raise ConfigError(f"{F}.{key}: empty list; give data paths, or remove it and set mock: true")
        split = section.get("split")
        if split is not None:
            if isinstance(split, (list, tuple)):
                section["split"] = ",".join(str(x) for x in split)
            elif not isinstance(split, str):
                raise ConfigError(f"{F}.split: expected a string like \"1, 0, 0\", got {split!r}")
            parse_split(section["split"])  # validate now
        per_split = any(section.get(k) for k in ("train_data_path", "valid_data_path", "test_data_path"))
        if per_split and section.get("data_path"):
            raise ConfigError(f"{F}: give either data_path (with split) or train/valid/test_data_path, not both")
        if per_split and section.get("split") is not None:
            raise ConfigError(f"{F}.split: not used with train/valid/test_data_path; remove it")
        if section.get("mock") is not None:
            check("mock", bool)
        if section.get("mock") and (section.get("data_path") or per_split):
            raise ConfigError(f"{F}.mock: true together with a data path; give one of them")
        if section.get("data_path") and section.get("split") is None:
            raise ConfigError(f"{F}.split: required with data_path (e.g. \"1, 0, 0\")")
        cfg = cls(**section)
        uses_eod = [k for k in ("eod_mask_loss", "reset_position_ids", "reset_attention_mask",
                                "create_compressed_eod_mask") if getattr(cfg, k)]
        if uses_eod and cfg.eod < 0:
            warnings.warn(f"{F}.eod is {cfg.eod}: no token ends a document, so {', '.join(uses_eod)} "
                          f"have no effect; set eod to the tokenizer's end-of-document id", stacklevel=3)
        if cfg.pad >= 0 and cfg.pad == cfg.eod:
            warnings.warn(f"{F}.pad equals eod ({cfg.eod}): every EOD label would be masked from the loss "
                          f"and replaced by 0; use pad: -1", stacklevel=3)
        return cfg

    def check_has_data(self) -> None:
        """A dataset section names its data: a data path, or ``mock: true``."""
        if not (self.mock or self.data_path or self.train_data_path or self.valid_data_path or self.test_data_path):
            raise ConfigError(f"{self.FIELD}.data_path: no data given; set data_path (with split), "
                              "train/valid/test_data_path, or mock: true for synthetic documents")

    def columns(self) -> list[str]:
        """The columns a sample has with these flags, in MindFormers' order."""
        cols = ["input_ids", "labels", "loss_mask", "position_ids"]
        if self.create_compressed_eod_mask:
            cols.append("actual_seq_len")
        if self.create_attention_mask:
            cols.append("attention_mask")
        return cols


def parse_split(split: str) -> list[float]:
    """``"969, 30, 1"`` → normalised ``[0.969, 0.03, 0.001]`` (missing trailing entries are 0)."""
    values = [float(x) for x in re.findall(r"[.0-9]+", split)]
    if not values or len(values) > 3:
        raise ConfigError(f"{GPTDatasetConfig.FIELD}.split: expected 1 to 3 non-negative numbers, got {split!r}")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    if total <= 0:
        raise ConfigError(f"{GPTDatasetConfig.FIELD}.split: proportions must not all be 0, got {split!r}")
    return (np.array(values, dtype=np.float64) / total).tolist()


def split_matrix(split: str) -> list[Optional[tuple[float, float]]]:
    """Book-ends ``[(0, a), (a, a+b), (a+b, 1)]`` of each split; None for an empty split."""
    bounds = [0.0]
    for v in parse_split(split):
        bounds.append(bounds[-1] + v)
    return [(lo, hi) if hi > lo else None for lo, hi in zip(bounds[:-1], bounds[1:])]


def split_document_range(bookends: tuple[float, float], num_documents: int) -> np.ndarray:
    lo = int(round(bookends[0] * float(num_documents)))
    hi = int(round(bookends[1] * float(num_documents)))
    return np.arange(lo, hi, dtype=np.int32)


# ----------------------------------------------------------------------------------------------
# index construction (pure numpy)
# ----------------------------------------------------------------------------------------------
def num_epochs_needed(tokens_per_epoch: int, num_samples: Optional[int], seq_length: int, extra: int) -> int:
    """Smallest n with ``n · tokens_per_epoch ≥ num_samples · seq_length + extra`` (1 when unsized)."""
    if num_samples is None:
        return 1
    need = num_samples * seq_length + extra
    return max(1, -(-need // tokens_per_epoch))


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """Documents tiled ``num_epochs`` times and shuffled as one int32 array (the final epoch on its
    own when ``separate_final_epoch``)."""
    if separate_final_epoch and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        last = build_document_index(documents, 1, rng, False)
        return np.concatenate([first, last])
    index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int,
                       tokens_per_epoch: int, num_epochs: int, drop_last_partial: bool = True,
                       extra: int = 1) -> np.ndarray:
    """``[num_samples + 1, 2]`` (document-index position, offset) of every sample start.

    Sample ``j`` starts at token ``j·S`` of the concatenated stream; its entry names the document
    holding its *last* token (``j·S + S + extra − 1``), so an offset can equal that document's length
    minus ``extra`` but never points past it, and empty documents are skipped."""
    total = num_epochs * tokens_per_epoch
    if drop_last_partial:
        num_samples = (total - extra) // seq_length
    else:
        # helpers.cpp divides in single precision; do the same so the counts agree on big datasets.
        num_samples = int(np.ceil(np.float32(total - extra) / np.float32(seq_length)))
    lengths = np.asarray(sizes)[document_index].astype(np.int64)
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    j = np.arange(1, num_samples + 1, dtype=np.int64)
    last_token = j * seq_length + extra - 1
    doc = np.searchsorted(starts, last_token, side="right") - 1
    offset = j * seq_length - starts[np.minimum(doc, len(lengths) - 1)]
    past_end = last_token >= total  # only a padded last sample (drop_last_partial False)
    if past_end.any():
        doc[past_end] = len(document_index) - 1
        offset[past_end] = int(sizes[document_index[-1]]) - extra
    biggest = max(len(document_index), int(np.max(sizes)) if len(sizes) else 0)
    dtype = np.int32 if biggest <= np.iinfo(np.int32).max else np.int64
    out = np.zeros((num_samples + 1, 2), dtype=dtype)
    out[1:, 0] = doc
    out[1:, 1] = offset
    return out


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of ``[0, num_samples)`` followed by one of ``[num_samples, total_size)``."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


# ----------------------------------------------------------------------------------------------
# masks and positions
# ----------------------------------------------------------------------------------------------
def document_starts(tokens: np.ndarray, eod: int) -> np.ndarray:
    """For each position, the index where its document starts (the position after the last EOD
    strictly before it)."""
    S = tokens.shape[0]
    after_eod = np.zeros(S, dtype=np.int64)
    eods = np.flatnonzero(tokens[:-1] == eod) + 1
    after_eod[eods] = eods
    return np.maximum.accumulate(after_eod)


def ltor_masks_and_position_ids(tokens: np.ndarray, eod: int, reset_position_ids: bool,
                                reset_attention_mask: bool, eod_mask_loss: bool,
                                create_attention_mask: bool):
    """(attention_mask [1,S,S] bool True = blocked or None, loss_mask [S] float32, position_ids [S] int64)."""
    S = tokens.shape[0]
    loss_mask = np.ones(S, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    positions = np.arange(S, dtype=np.int64)
    starts = document_starts(tokens, eod) if (reset_position_ids or reset_attention_mask) else None
    if reset_position_ids:
        positions = positions - starts
    attention_mask = None
    if create_attention_mask:
        q = np.arange(S)[:, None]
        k = np.arange(S)[None, :]
        allowed = k <= q
        if reset_attention_mask:
            allowed &= k >= starts[:, None]
        attention_mask = ~allowed[None]
    return attention_mask, loss_mask, positions


def compressed_eod_mask(tokens: np.ndarray, eod: int, length: int) -> np.ndarray:
    """``actual_seq_len``: EOD index + 1 for each EOD except one in the last position, padded with S."""
    S = tokens.shape[0]
    ends = np.flatnonzero(tokens == eod) + 1
    if S and tokens[-1] == eod:
        ends = ends[:-1]
    if len(ends) > length:
        raise DatasetError(f"{GPTDatasetConfig.FIELD}.eod_pad_length: a sample has {len(ends)} document ends, "
                           f"more than eod_pad_length = {length}; raise eod_pad_length")
    out = np.full(length, S, dtype=np.int32)
    out[: len(ends)] = ends
    return out


# ----------------------------------------------------------------------------------------------
# mock documents
# ----------------------------------------------------------------------------------------------
class MockLowLevelDataset:
    """Synthetic documents for benchmarks without data, as Megatron and MindFormers make them:
    100,000 documents of 1..4095 tokens (lengths from ``numpy.random.default_rng(0)``), document ``i``
    being ``1, 2, …, len−1`` (mod ``vocab_size`` when given) followed by EOD."""

    size = 100_000
    max_sequence_length = 4096

    def __init__(self, eod: int, vocab_size: Optional[int] = None) -> None:
        self.eod = eod
        self.vocab_size = vocab_size
        rng = np.random.default_rng(seed=0)
        self.sequence_lengths = rng.integers(1, self.max_sequence_length, size=self.size, dtype=np.int32)
        self.prefix = None

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        n = int(self.sequence_lengths[i])
        body = np.arange(1, n, dtype=np.int64)
        if self.vocab_size:
            body %= self.vocab_size
        return np.concatenate([body, [self.eod]]).astype(np.int64)

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        if length is None:
            length = int(self.sequence_lengths[i]) - offset
        return self[i][offset: offset + length]


# ----------------------------------------------------------------------------------------------
# the dataset
# ----------------------------------------------------------------------------------------------
class GPTDataset:
    """Samples of ``seq_length`` tokens from one low-level dataset's split.

    Args:
        low_level: an :class:`IndexedDataset` (or :class:`MockLowLevelDataset`).
        dataset_path: its prefix (None for mock data), for the cache description and messages.
        indices: the sequence ids of this split.
        num_samples: samples wanted (more epochs are built when one epoch is not enough); None for one epoch.
        split: ``"train"``, ``"valid"`` or ``"test"``.
        config: the :class:`GPTDatasetConfig`.

    ``ds[i]`` is a dict of numpy arrays: ``input_ids``, ``labels`` (int64 [S]), ``loss_mask``
    (float32 [S]), ``position_ids`` (int64 [S]), plus ``attention_mask`` (bool [1,S,S]) and/or
    ``actual_seq_len`` (int32 [eod_pad_length]) as configured.
    """

    def __init__(self, low_level, dataset_path: Optional[str], indices: np.ndarray,
                 num_samples: Optional[int], split: str, config: GPTDatasetConfig) -> None:
        self.dataset = low_level
        self.dataset_path = dataset_path
        self.indices = np.asarray(indices, dtype=np.int32)
        self.num_samples = num_samples
        self.split = split
        self.config = config
        self.built_indices = False
        self._check_recorded_vocabulary()
        self.document_index, self.sample_index, self.shuffle_index = self._indices()

    def _check_recorded_vocabulary(self) -> None:
        top, vocab = getattr(self.dataset, "max_token_id", None), self.config.vocab_size
        if top is not None and vocab is not None and not top < vocab:
            raise DatasetError(f"{self.dataset_path}.bin: holds token ids up to {top} (recorded by its builder in "
                               f"{self.dataset_path}.meta.json) but model.vocab_size is {vocab}: the data was "
                               "tokenized for another vocabulary")

    # -- index building ---------------------------------------------------------------------------
    def _description(self) -> dict:
        cfg = self.config
        desc = {
            "class": "GPTDataset", "format": CACHE_FORMAT,
            "dataset_path": os.path.abspath(self.dataset_path) if self.dataset_path else "mock",
            "split": self.split, "documents": [int(self.indices[0]), int(self.indices[-1]) + 1]
            if len(self.indices) else [0, 0],
            "num_samples": self.num_samples, "seed": cfg.seed, "seq_length": cfg.seq_length,
            "add_extra_token_to_sequence": cfg.add_extra_token_to_sequence,
        }
        if self.split == "valid":
            desc["drop_last_partial_validation_sequence"] = cfg.drop_last_partial_validation_sequence
        if self.dataset_path:
            desc["idx"] = file_fingerprint(idx_path(self.dataset_path))
            desc["bin_size"] = os.path.getsize(self.dataset_path + ".bin")
        else:
            desc["mock"] = {"eod": cfg.eod, "vocab_size": cfg.vocab_size}
        return desc

    def _cache_dir(self) -> Optional[str]:
        if self.config.path_to_cache:
            return self.config.path_to_cache
        if self.dataset_path is None:
            return None  # mock data is rebuilt in memory, as in Megatron
        return os.path.join(os.path.dirname(os.path.abspath(self.dataset_path)), "cache", "GPTDataset_indices")

    def _indices(self):
        text, digest = description_hash(self._description())
        arrays, built = cached_arrays(
            self._cache_dir(), f"{digest}-GPTDataset-{self.split}",
            ["document_index", "sample_index", "shuffle_index"], text, self._build_indices,
            on_warning=lambda msg: warnings.warn(msg, stacklevel=3))
        self.built_indices = built
        return arrays["document_index"], arrays["sample_index"], arrays["shuffle_index"]

    def _build_indices(self) -> dict[str, np.ndarray]:
        cfg = self.config
        S, extra = cfg.seq_length, int(cfg.add_extra_token_to_sequence)
        sizes = self.dataset.sequence_lengths
        tokens_per_epoch = int(np.sum(sizes[self.indices], dtype=np.int64))
        where = f"{self.dataset_path or 'mock data'} ({self.split} split, {len(self.indices)} documents)"
        if tokens_per_epoch <= extra:
            raise DatasetError(f"{where}: has {tokens_per_epoch} tokens, too few for any sample; "
                               f"check {GPTDatasetConfig.FIELD}.split and the data")
        num_epochs = num_epochs_needed(tokens_per_epoch, self.num_samples, S, extra)
        separate_final_epoch = False
        n_sans_final = None
        if num_epochs > 1:
            n_sans_final = ((num_epochs - 1) * tokens_per_epoch - extra) // S
            from_final = self.num_samples - n_sans_final
            per_epoch = (tokens_per_epoch - extra) // S
            assert 0 <= from_final <= per_epoch + 1
            separate_final_epoch = from_final < int(0.80 * per_epoch)
        rng = np.random.RandomState(cfg.seed)
        document_index = build_document_index(self.indices, num_epochs, rng, separate_final_epoch)
        drop_last = True if self.split != "valid" else cfg.drop_last_partial_validation_sequence
        sample_index = build_sample_index(sizes, document_index, S, tokens_per_epoch, num_epochs,
                                          drop_last, extra)
        total = sample_index.shape[0] - 1
        shuffle_index = build_shuffle_index(n_sans_final if separate_final_epoch else total, total, rng)
        return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}

    # -- samples ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def tokens(self, idx: int) -> np.ndarray:
        """The ``seq_length + extra`` token ids of sample ``idx`` (after the shuffle), int64, padded
        with ``pad`` when the data ran out."""
        cfg = self.config
        extra = int(cfg.add_extra_token_to_sequence)
        j = int(self.shuffle_index[idx])
        d0, o0 = (int(x) for x in self.sample_index[j])
        d1, o1 = (int(x) for x in self.sample_index[j + 1])
        doc = self.document_index
        if d0 == d1:
            parts = [self.dataset.get(int(doc[d0]), offset=o0, length=o1 - o0 + extra)]
        else:
            parts = [self.dataset.get(int(doc[d0]), offset=o0)]
            parts += [self.dataset.get(int(doc[d])) for d in range(d0 + 1, d1)]
            parts.append(self.dataset.get(int(doc[d1]), offset=0, length=o1 + extra))
        if cfg.vocab_size is not None and self.dataset_path is not None:
            self._check_token_ids(parts, [int(doc[d]) for d in range(d0, d1 + 1)])
        want = cfg.seq_length + extra
        have = sum(len(p) for p in parts)
        if have < want:
            parts.append(np.full(want - have, cfg.pad, dtype=np.int64))
        return np.concatenate(parts).astype(np.int64, copy=False)

    def _check_token_ids(self, parts: list[np.ndarray], sequences: list[int]) -> None:
        vocab = self.config.vocab_size
        for part, seq in zip(parts, sequences):
            if part.size and (int(part.max()) >= vocab or int(part.min()) < 0):
                bad = int(part[(part >= vocab) | (part < 0)][0])
                document = self.dataset.document_of(seq) if hasattr(self.dataset, "document_of") else seq
                raise DatasetError(f"{self.dataset_path}.bin: document {document} (sequence {seq}) holds token id "
                                   f"{bad}, outside [0, {vocab}) of model.vocab_size: the data was tokenized for "
                                   "another vocabulary")

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        cfg = self.config
        text = self.tokens(idx)
        if cfg.add_extra_token_to_sequence:
            tokens, labels = text[:-1].copy(), text[1:].copy()
        else:
            tokens = text.copy()
            labels = np.roll(text, -1)
            labels[-1] = cfg.pad
        attention_mask, loss_mask, position_ids = ltor_masks_and_position_ids(
            tokens, cfg.eod, cfg.reset_position_ids, cfg.reset_attention_mask, cfg.eod_mask_loss,
            cfg.create_attention_mask)
        actual_seq_len = (compressed_eod_mask(tokens, cfg.eod, cfg.eod_pad_length)
                          if cfg.create_compressed_eod_mask else None)
        loss_mask[labels == cfg.pad] = 0.0
        tokens[tokens == cfg.pad] = 0
        labels[labels == cfg.pad] = 0
        sample = {"input_ids": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        if actual_seq_len is not None:
            sample["actual_seq_len"] = actual_seq_len
        if attention_mask is not None:
            sample["attention_mask"] = attention_mask
        return sample


def build_low_level_dataset(prefix: Optional[str], config: GPTDatasetConfig):
    if prefix is None:
        return MockLowLevelDataset(config.eod, config.vocab_size)
    return IndexedDataset(prefix, mmap=config.mmap_bin_files)


def build_gpt_splits(prefix: Optional[str], bookends: Sequence[Optional[tuple[float, float]]],
                     sizes: Sequence[Optional[int]], config: GPTDatasetConfig,
                     low_level: Any = None) -> list[Optional[GPTDataset]]:
    """One low-level dataset cut into its train/valid/test GPTDatasets (None where the split is
    empty or its size is 0)."""
    low_level = low_level if low_level is not None else build_low_level_dataset(prefix, config)
    n = len(low_level.sequence_lengths)
    out: list[Optional[GPTDataset]] = []
    for i, name in enumerate(SPLITS):
        if bookends[i] is None or sizes[i] == 0:
            out.append(None)
            continue
        out.append(GPTDataset(low_level, prefix, split_document_range(bookends[i], n), sizes[i], name, config))
    return out
