"""Shared helpers for the data tests (no tests here): small datasets and megatron-core as the judge.

megatron-core is only a test-time reference; lit_moe.data never imports it."""

from __future__ import annotations

import os
import warnings

import numpy as np

EOD = 1


def make_documents(n_docs: int, seed: int = 0, max_len: int = 60, vocab: int = 500, eod: int = EOD,
                   min_len: int = 1) -> list[np.ndarray]:
    """Random documents ending with EOD (lengths min_len..max_len-1)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        n = int(rng.integers(min_len, max_len))
        body = rng.integers(2, vocab, n - 1) if n > 1 else np.zeros(0, np.int64)
        docs.append(np.append(body, eod).astype(np.int64))
    return docs


def write_with_megatron(prefix: str, docs: list[np.ndarray], dtype=np.uint16) -> str:
    """Write documents with megatron-core's own IndexedDatasetBuilder (the reference writer)."""
    import torch

    IndexedDatasetBuilder = megatron().indexed_dataset.IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        builder.add_item(torch.from_numpy(np.asarray(doc, dtype=np.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


class _Megatron:
    pass


_MODULES = None


def megatron():
    """megatron.core.datasets modules (imported lazily, warnings about missing TE/Apex silenced)."""
    global _MODULES
    if _MODULES is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import blended_megatron_dataset_builder, gpt_dataset, helpers, indexed_dataset
            from megatron.core.datasets.utils import Split
        m = _Megatron()
        m.gpt_dataset, m.indexed_dataset, m.helpers = gpt_dataset, indexed_dataset, helpers
        m.builder = blended_megatron_dataset_builder
        m.Split = Split
        _MODULES = m
    return _MODULES


class JudgeTokenizer:
    """The little of a tokenizer megatron-core's GPTDataset reads: eod, vocab_size, no pad (→ −1)."""

    def __init__(self, eod: int = EOD, vocab_size: int = 500) -> None:
        self.eod = eod
        self.vocab_size = vocab_size
        self.unique_identifiers = {"class": "JudgeTokenizer", "eod": eod, "vocab_size": vocab_size}

    @property
    def pad(self):
        raise AttributeError("no pad token")


def megatron_config(seq_length: int, seed: int = 1234, blend=None, split: str = "1,0,0", eod: int = EOD,
                    vocab_size: int = 500, cache=None, **flags):
    m = megatron()
    flags.setdefault("reset_position_ids", False)
    flags.setdefault("reset_attention_mask", False)
    flags.setdefault("eod_mask_loss", False)
    flags.setdefault("create_attention_mask", False)   # as dataloader_section: both sides make the same columns
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return m.gpt_dataset.GPTDatasetConfig(
            random_seed=seed, sequence_length=seq_length, blend=blend, split=split if blend else None,
            tokenizer=JudgeTokenizer(eod, vocab_size), path_to_cache=cache, **flags)


def megatron_gpt(prefix: str, num_samples, seq_length: int, split_name: str = "train", indices=None,
                 cache=None, **kwargs):
    """megatron-core's GPTDataset over one prefix's documents ``indices`` (default all)."""
    m = megatron()
    cfg = megatron_config(seq_length, blend=([prefix], None), cache=cache, **kwargs)
    low = m.indexed_dataset.IndexedDataset(prefix)
    if indices is None:
        indices = np.arange(len(low), dtype=np.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return m.gpt_dataset.GPTDataset(low, prefix, np.asarray(indices, np.int32), num_samples,
                                        getattr(m.Split, split_name), cfg)


def megatron_sample(sample: dict) -> dict:
    """A megatron-core sample in our column names, as numpy."""
    out = {"input_ids": sample["tokens"].numpy(), "labels": sample["labels"].numpy(),
           "loss_mask": sample["loss_mask"].numpy(), "position_ids": sample["position_ids"].numpy()}
    if "attention_mask" in sample:
        out["attention_mask"] = sample["attention_mask"].numpy()
    return out


def assert_same_samples(ours, theirs, count=None, columns=None, every=1) -> None:
    """Sample-by-sample equality of our dataset and a megatron-core one (first ``count`` samples;
    with ``every`` > 1 only every ``every``-th one, always including the last)."""
    n = len(theirs) if count is None else count
    assert len(ours) >= n
    picks = sorted(set(range(0, n, every)) | ({n - 1} if n else set()))
    for i in picks:
        a, b = ours[i], megatron_sample(theirs[i])
        keys = list(columns or b.keys())
        # every column megatron-core produces (or the caller names) must be ours too: none is skipped
        assert set(keys) <= set(a), f"sample {i}: columns {sorted(set(keys) - set(a))} missing from ours"
        for key in keys:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"sample {i}, column {key}")


def dataloader_section(seq_length: int, data_path=None, sizes=(100, 0, 0), split="1,0,0", columns=None,
                       **config) -> dict:
    cfg = {"seq_length": seq_length, "eod": EOD, "pad": -1, "create_attention_mask": False}
    if data_path is not None:
        cfg["data_path"] = data_path
        cfg["split"] = split
    elif not any(k.endswith("data_path") for k in config):
        cfg["mock"] = True   # no data path: mock data, asked for by name
    cfg.update(config)
    section = {"type": "BlendedMegatronDatasetDataLoader", "datasets_type": "GPTDataset",
               "sizes": list(sizes), "config": cfg}
    if columns is not None:
        section["column_names"] = columns
    return section


def tmp_prefix(tmp_path, name: str = "docs") -> str:
    return os.path.join(str(tmp_path), name)
