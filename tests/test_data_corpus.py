"""The shipped corpus: real text, stated license, built once on first use, rebuilt when it changes."""

import json
import lzma
import multiprocessing as mp
import os

import numpy as np
import pytest
from tokenizers import Tokenizer

from lit_moe.data import build_datasets
from lit_moe.data.builtin import build_builtin, builtin_documents
from lit_moe.data.catalog import builtin_tokenizer_path
from lit_moe.data.catalog import CORPUS_DIR
from test_data_support import megatron


def _build(cache):
    return build_builtin("austen", cache)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Two processes ask for the corpus at once: one builds it, the other waits and reuses it."""
    cache = os.path.join(str(tmp_path_factory.mktemp("corpus")), "builtin")  # as path_to_cache/builtin
    with mp.get_context("fork").Pool(2) as pool:
        results = pool.map_async(_build, [cache, cache]).get(timeout=300)
    return cache, results


def test_built_once_by_one_process(built):
    cache, results = built
    assert results[0][0] == results[1][0]
    assert sorted(r[1] for r in results) == [False, True]
    assert build_builtin("austen", cache) == (results[0][0], False)


def test_corpus_is_real_text_with_eod_after_each_chapter(built):
    prefix = built[1][0][0]
    ds = megatron().indexed_dataset.IndexedDataset(prefix)  # loads in megatron-core too
    docs = builtin_documents("austen")
    assert len(docs) == len(ds) == 269
    tok = Tokenizer.from_file(builtin_tokenizer_path("austen"))
    assert tok.get_vocab_size() == 4096 and tok.token_to_id("<eod>") == 1
    for i in (0, 100, 268):
        ids = ds[i]
        assert ids[-1] == 1
        assert tok.decode(ids[:-1].tolist()) == docs[i]
    assert docs[50].startswith("PRIDE AND PREJUDICE")  # after the 50 chapters of Sense and Sensibility
    assert "It is a truth universally acknowledged" in docs[50]
    total = sum(len(ds[i]) for i in range(len(ds)))
    assert 900_000 < total < 1_100_000
    assert ds.index.dtype == np.uint16


def test_rebuilt_when_the_inputs_change(tmp_path, monkeypatch):
    import lit_moe.data.builtin as builtin

    monkeypatch.setattr(builtin, "builtin_documents", lambda name: ["A short chapter.", "Another one."])
    prefix, built_now = build_builtin("austen", str(tmp_path))
    assert built_now
    assert build_builtin("austen", str(tmp_path)) == (prefix, False)
    with open(prefix + ".json") as f:
        stamp = json.load(f)
    stamp["tokenizer_md5"] = "0" * 32  # as if the tokenizer file had changed
    with open(prefix + ".json", "w") as f:
        json.dump(stamp, f, sort_keys=True)
    assert build_builtin("austen", str(tmp_path)) == (prefix, True)
    assert build_builtin("austen", str(tmp_path)) == (prefix, False)
    os.remove(prefix + ".bin")  # a missing file is rebuilt too
    assert build_builtin("austen", str(tmp_path)) == (prefix, True)


def test_data_path_builtin_through_build_datasets(built):
    cache = os.path.dirname(built[0])
    section = {"type": "BlendedMegatronDatasetDataLoader", "datasets_type": "GPTDataset", "sizes": [64, 0, 0],
               "config": {"seq_length": 128, "split": "1, 0, 0", "eod": 1, "pad": -1, "create_attention_mask": False,
                          "data_path": ["1", "builtin:austen"], "path_to_cache": cache}}
    train, valid, test = build_datasets(section)
    assert valid is None and test is None and len(train) >= 64
    ids = np.stack([train[i]["input_ids"] for i in range(64)])
    assert ids.min() >= 0 and ids.max() < 4096
    assert os.path.isfile(os.path.join(cache, "builtin", "austen_bpe4096_text_document.bin"))


def test_unknown_builtin_is_a_config_error(tmp_path):
    from lit_moe.config import ConfigError

    section = {"type": "BlendedMegatronDatasetDataLoader", "sizes": [8],
               "config": {"seq_length": 8, "split": "1", "data_path": ["builtin:tolstoy"], "path_to_cache": str(tmp_path)}}
    with pytest.raises(ConfigError, match="unknown built-in corpus builtin:tolstoy"):
        build_datasets(section)


def test_license_and_source_are_stated():
    readme = open(os.path.join(CORPUS_DIR, "README.md")).read()
    license_text = open(os.path.join(CORPUS_DIR, "LICENSE")).read()
    assert "public domain" in readme.lower() and "public domain" in license_text.lower()
    assert "r-cran-janeaustenr" in readme
    size = os.path.getsize(os.path.join(CORPUS_DIR, "austen.jsonl.xz"))
    assert size < 3_000_000
    with lzma.open(os.path.join(CORPUS_DIR, "austen.jsonl.xz"), "rt") as f:
        books = {json.loads(line)["book"] for line in f}
    assert books == {"Sense and Sensibility", "Pride and Prejudice", "Mansfield Park", "Emma",
                     "Northanger Abbey", "Persuasion"}


TINY_TRAIN_DATASET = """
train_dataset:
  dataloader:
    type: BlendedMegatronDatasetDataLoader
    datasets_type: GPTDataset
    sizes: [1600, 0, 0]          # training.steps * training.global_batch_size
    config:
      seed: 1234
      split: "1, 0, 0"
      seq_length: 128
      eod_mask_loss: false
      reset_position_ids: false
      create_attention_mask: false
      reset_attention_mask: false
      create_compressed_eod_mask: false
      eod_pad_length: 128
      eod: 1
      pad: -1
      data_path: ["1", "builtin:austen"]
    column_names: [input_ids, labels, loss_mask, position_ids]
    shuffle: false
    python_multiprocessing: false
  drop_remainder: true
  num_parallel_workers: 2
  prefetch_size: 1
  numa_enable: false
"""


def test_tiny_config_block_gives_batches(built, monkeypatch):
    """The train_dataset block proposed for configs/tiny.yaml (docs/data.md) trains on the corpus."""
    import torch
    import yaml

    from lit_moe.config import TrainDatasetConfig
    from lit_moe.data import MegatronDataModule

    monkeypatch.setenv("LIT_MOE_CACHE", os.path.dirname(built[0]))  # reuse the fixture's build
    section = yaml.safe_load(TINY_TRAIN_DATASET)["train_dataset"]
    dm = MegatronDataModule(TrainDatasetConfig(**section), local_batch_size=4, seed=42, seq_length=128)
    dm.setup("fit")
    assert len(dm.datasets[0]) >= 1600
    batches = [b for _, (b,) in zip(range(3), dm.train_dataloader())]   # steps of one micro-batch
    assert set(batches[0]) == {"input_ids", "labels", "loss_mask", "position_ids"}
    ids = torch.cat([b["input_ids"] for b in batches])
    assert ids.shape == (12, 128) and int(ids.max()) < 4096
    docs_text = "".join(builtin_documents("austen"))
    tok = Tokenizer.from_file(builtin_tokenizer_path("austen"))
    window = tok.decode([t for t in batches[0]["input_ids"][0].tolist() if t != 1])
    assert window[10:60] in docs_text  # real English from the novels
