"""The shipped corpora and tokenizers (``lit_moe/data/corpus``): names, files, where they live.

A leaf: the tokenizers (``builtin:<name>`` tokenizer specs) and the built-in datasets
(``data_path: builtin:<name>``) both look names up here.
"""

from __future__ import annotations

import os

from lit_moe.config import ConfigError

CORPUS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
SCHEME = "builtin:"
BUILTINS = {
    "austen": {
        "text": "austen.jsonl.xz",
        "tokenizer": "austen_bpe4096.json",
        "eod_token": "<eod>",
        "about": "Jane Austen's six novels, one document per chapter (public domain)",
    },
}


def builtin_spec(name: str) -> dict:
    """The catalogue entry of a built-in corpus; an unknown name is a one-line ConfigError."""
    if name not in BUILTINS:
        raise ConfigError(f"train_dataset.dataloader.config.data_path: unknown built-in corpus "
                          f"{SCHEME}{name}; available: {[SCHEME + n for n in BUILTINS]}")
    return BUILTINS[name]


def builtin_tokenizer_path(name: str) -> str:
    return os.path.join(CORPUS_DIR, builtin_spec(name)["tokenizer"])
