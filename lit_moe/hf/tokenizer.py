"""A Hugging Face tokenizer directory (``save_pretrained`` output: ``tokenizer_config.json`` plus
``tokenizer.json`` or a SentencePiece model) for ``lit_moe preprocess``.

Loaded with ``transformers.AutoTokenizer`` from local files only, so the directory's own settings
apply (its tokenizer class, normaliser, ``eos_token``). The end-of-document id is the directory's
``eos_token`` unless ``--eod-token`` names another.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from lit_moe.config import ConfigError

HF_TOKENIZER_CONFIG = "tokenizer_config.json"


def is_hf_tokenizer_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, HF_TOKENIZER_CONFIG))


class HFTokenizer:
    """``transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)``.

    Args:
        path: the directory.
        eod_token: the end-of-document token string; default: the tokenizer's ``eos_token``.
        add_special_tokens: let the tokenizer add its special tokens (e.g. BOS) to each document.
    """

    def __init__(self, path: str, eod_token: Optional[str] = None, add_special_tokens: bool = False) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigError(f"--tokenizer: {path} is a Hugging Face tokenizer directory; reading it needs "
                              "the transformers package (pip install transformers), or pass its tokenizer.json") from None
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as err:  # transformers raises OSError/ValueError/... with multi-line messages
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(f"--tokenizer: {path}: not a loadable Hugging Face tokenizer directory ({first})") from None
        self.name = self.path = path
        self.add_special_tokens = add_special_tokens
        self.vocab_size = len(self._tok)
        if eod_token is None:
            eod_token = self._tok.eos_token
            if eod_token is None:
                raise ConfigError(f"--eod-token: {path} has no eos_token in {HF_TOKENIZER_CONFIG}; name its "
                                  "end-of-document token with --eod-token")
        eod = self._tok.convert_tokens_to_ids(eod_token)
        if eod is None or (eod == self._tok.unk_token_id and eod_token != self._tok.unk_token):
            raise ConfigError(f"--eod-token: {eod_token!r} is not in the vocabulary of {path}")
        self.eod_token = eod_token
        self.eod = int(eod)

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        ids = self._tok(texts, add_special_tokens=self.add_special_tokens)["input_ids"]
        return [np.asarray(i, dtype=np.int64) for i in ids]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)
