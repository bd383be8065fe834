"""The shipped corpus (``lit_moe/data/corpus``), usable as ``data_path: ["1", "builtin:austen"]``.

On first use the text is tokenized into a Megatron indexed dataset in the cache directory, once, by
one process under a file lock (the others wait, then load it). A sidecar JSON records the md5 of the
text and of the tokenizer it was built from; if either changes the dataset is rebuilt."""

from __future__ import annotations

import hashlib
import json
import lzma
import os
from typing import Optional

import numpy as np

from lit_moe.config import ConfigError
from lit_moe.data.cache import atomic_write_text, file_lock
from lit_moe.data.indexed import IndexedDatasetBuilder, exists, optimal_dtype
from lit_moe.data.catalog import CORPUS_DIR, SCHEME, builtin_spec, builtin_tokenizer_path
from lit_moe.data.tokenizer import JsonTokenizer

FORMAT = 1


def builtin_documents(name: str) -> list[str]:
    with lzma.open(os.path.join(CORPUS_DIR, builtin_spec(name)["text"]), "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def default_cache_dir(path_to_cache: Optional[str] = None) -> str:
    if path_to_cache:
        return os.path.join(path_to_cache, "builtin")
    return os.path.join(os.environ.get("LIT_MOE_CACHE", os.path.join("output", "cache")), "builtin")


def _md5(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.md5(f.read()).hexdigest()


def ensure_builtin(name: str, cache_dir: Optional[str] = None) -> str:
    """Build (if needed) and return the indexed-dataset prefix of built-in corpus ``name``."""
    return build_builtin(name, cache_dir)[0]


def build_builtin(name: str, cache_dir: Optional[str] = None) -> tuple[str, bool]:
    """(prefix, whether this call built it)."""
    spec = builtin_spec(name)
    cache_dir = cache_dir or default_cache_dir()
    text_path = os.path.join(CORPUS_DIR, spec["text"])
    tok_path = builtin_tokenizer_path(name)
    stem = os.path.splitext(spec["tokenizer"])[0]
    prefix = os.path.join(cache_dir, f"{stem}_text_document")
    stamp = json.dumps({"format": FORMAT, "text_md5": _md5(text_path), "tokenizer_md5": _md5(tok_path)},
                       sort_keys=True)
    stamp_path = prefix + ".json"

    def fresh() -> bool:
        if not (exists(prefix) and os.path.isfile(stamp_path)):
            return False
        with open(stamp_path) as f:
            return f.read() == stamp

    if fresh():
        return prefix, False
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create {cache_dir} for the built-in corpus {SCHEME}{name} ({err}); "
                          f"set LIT_MOE_CACHE or train_dataset.dataloader.config.path_to_cache") from None
    with file_lock(prefix + ".lock"):
        if fresh():  # another process built it while we waited
            return prefix, False
        tok = JsonTokenizer(tok_path, spec["eod_token"])
        docs = builtin_documents(name)
        ids = tok.encode_batch(docs)
        lengths = np.array([len(x) + 1 for x in ids], dtype=np.int64)
        flat = np.concatenate([np.append(x, tok.eod) for x in ids])
        builder = IndexedDatasetBuilder(prefix, optimal_dtype(tok.vocab_size))
        builder.add_documents(flat, lengths)
        builder.finalize()
        atomic_write_text(stamp_path, stamp)
    return prefix, True


def resolve(prefix: str, cache_dir: Optional[str] = None) -> str:
    """``builtin:NAME`` → the built dataset's prefix; any other prefix unchanged."""
    if isinstance(prefix, str) and prefix.startswith(SCHEME):
        return ensure_builtin(prefix[len(SCHEME):], cache_dir)
    return prefix
