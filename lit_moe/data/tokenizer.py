"""Tokenizers for preprocessing: a built-in byte-level one and Hugging Face ``tokenizers`` JSON files."""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from lit_moe.config import ConfigError
from lit_moe.data.catalog import builtin_tokenizer_path


# End-of-document tokens looked for, in this order, when a tokenizer file is given without --eod-token.
EOD_CANDIDATES = ("<eod>", "<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>",
                  "<｜end▁of▁sentence｜>", "[SEP]")


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; EOD is 256 (vocabulary 257)."""

    name = "byte"
    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class JsonTokenizer:
    """A Hugging Face ``tokenizers`` JSON file (``tokenizer.json``, or a directory holding one).

    Args:
        path: the file or directory.
        eod_token: the end-of-document token string; default: the first of ``EOD_CANDIDATES`` the
            vocabulary has.
        add_special_tokens: let the tokenizer's post-processor add its special tokens (e.g. BOS).
    """

    def __init__(self, path: str, eod_token: Optional[str] = None, add_special_tokens: bool = False) -> None:
        from tokenizers import Tokenizer

        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ConfigError(f"--tokenizer: {path}: no such tokenizer file (use 'byte' or a tokenizer.json)")
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as err:  # tokenizers raises a bare Exception on bad JSON
            raise ConfigError(f"--tokenizer: {path}: not a tokenizers JSON file ({err})") from None
        self.name = path
        self.path = path
        self.add_special_tokens = add_special_tokens
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        if eod_token is None:
            for cand in EOD_CANDIDATES:
                if self._tok.token_to_id(cand) is not None:
                    eod_token = cand
                    break
            else:
                raise ConfigError(f"--eod-token: {path} has none of {list(EOD_CANDIDATES)}; name its "
                                  f"end-of-document token with --eod-token")
        eod = self._tok.token_to_id(eod_token)
        if eod is None:
            raise ConfigError(f"--eod-token: {eod_token!r} is not in the vocabulary of {path}")
        self.eod_token = eod_token
        self.eod = int(eod)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=self.add_special_tokens).ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(texts, add_special_tokens=self.add_special_tokens)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(spec: str, eod_token: Optional[str] = None, add_special_tokens: bool = False):
    """``"byte"``, ``"builtin:austen"``, a Hugging Face tokenizer directory (with
    ``tokenizer_config.json``) or a path to a tokenizers JSON file / a directory holding one."""
    if spec == "byte":
        if eod_token is not None:
            raise ConfigError("--eod-token: the byte tokenizer's EOD is fixed (256)")
        return ByteTokenizer()
    if spec.startswith("builtin:"):
        spec = builtin_tokenizer_path(spec[len("builtin:"):])
    from lit_moe.hf.tokenizer import HFTokenizer, is_hf_tokenizer_dir

    if is_hf_tokenizer_dir(spec):
        return HFTokenizer(spec, eod_token, add_special_tokens)
    return JsonTokenizer(spec, eod_token, add_special_tokens)
