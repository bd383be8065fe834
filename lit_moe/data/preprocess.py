"""``lit_moe preprocess``: text, JSON lines or Parquet → a Megatron indexed dataset (``.bin`` + ``.idx``).

    lit_moe preprocess --input corpus.jsonl --output-prefix data/my --tokenizer byte
    # writes data/my_text_document.bin/.idx; use data_path: ["1", "data/my_text_document"]

Like Megatron's ``tools/preprocess_data.py``: one document per JSON line (the ``--json-key`` field),
each tokenized and followed by the EOD token, written as one sequence; the output is named
``PREFIX_<key>_document`` and loads in megatron-core unchanged. A Parquet file gives one document per
row of its ``--json-key`` column. Plain-text inputs are one document per file, per line or per
blank-line-separated paragraph (``--text-documents``). Text and JSON lines may be gzip, xz or bzip2
compressed. The tokenizer is the byte tokenizer, a ``tokenizer.json`` or a Hugging Face tokenizer
directory. Work is spread over ``--workers`` processes; a progress bar shows the bytes read and the
tokens per second.
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import json
import lzma
import multiprocessing as mp
import os
import signal
import sys
import time
from typing import Iterator, Optional

import numpy as np

from lit_moe.config import ConfigError
from lit_moe.data.indexed import IndexedDatasetBuilder, bin_path, idx_path, optimal_dtype
from lit_moe.data.tokenizer import load_tokenizer

CHUNK_BYTES = 1 << 20  # input handed to a worker at a time


def _open(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".xz"):
        return lzma.open(path, "rb")
    if path.endswith(".bz2"):
        return bz2.open(path, "rb")
    return open(path, "rb")


def input_format(path: str, fmt: str) -> str:
    """``jsonl``, ``parquet`` or ``text``: ``fmt`` unless it is ``auto``, then from the file name."""
    if fmt != "auto":
        return fmt
    base = path
    for ext in (".gz", ".xz", ".bz2"):
        if base.endswith(ext):
            base = base[: -len(ext)]
    if base.endswith(".parquet"):
        return "parquet"
    return "jsonl" if base.endswith((".jsonl", ".json", ".ndjson")) else "text"


PARQUET_BATCH_ROWS = 1024


def _parquet_chunks(path: str, json_key: str) -> Iterator[tuple]:
    """(``"parquet"``, file, [(row number, text)], bytes) chunks of a Parquet file's ``json_key``
    column; bytes are the file's size spread over its rows (what the progress bar counts)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"--input: {path} is Parquet; reading it needs pyarrow (pip install pyarrow)") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as err:  # pyarrow.ArrowInvalid and friends
        raise ConfigError(f"{path}: not a readable Parquet file ({str(err).splitlines()[0]})") from None
    names = pf.schema_arrow.names
    if json_key not in names:
        raise ConfigError(f"{path}: no column {json_key!r} (columns: {names}; choose the text column with --json-key)")
    rows = max(pf.metadata.num_rows, 1)
    size = os.path.getsize(path)
    row = 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[json_key]):
        texts = batch.column(0).to_pylist()
        docs = [(row + i + 1, t) for i, t in enumerate(texts)]
        start, row = row, row + len(texts)
        yield "parquet", path, docs, size * row // rows - size * start // rows


# ----------------------------------------------------------------------------------------------
# reading: chunks of raw documents, with where they came from (for error messages)
# ----------------------------------------------------------------------------------------------
def read_chunks(paths: list[str], fmt: str, text_documents: str, json_key: str = "text") -> Iterator[tuple]:
    """Yield (kind, file, [(line or row number, raw document)], bytes) chunks of about CHUNK_BYTES."""
    for path in paths:
        kind = input_format(path, fmt)
        if kind == "parquet":
            yield from _parquet_chunks(path, json_key)
            continue
        jsonl = kind == "jsonl"
        with _open(path) as f:
            if not jsonl and text_documents == "file":
                data = f.read()
                yield kind, path, [(1, data)], len(data)
                continue
            docs: list[tuple[int, bytes]] = []
            size = 0
            para: list[bytes] = []
            para_line = 0
            for lineno, line in enumerate(f, start=1):
                if jsonl or text_documents == "line":
                    if not line.strip():
                        continue
                    docs.append((lineno, line.rstrip(b"\r\n") if not jsonl else line))
                    size += len(line)
                elif line.strip():  # paragraphs
                    if not para:
                        para_line = lineno
                    para.append(line)
                    continue
                elif para:
                    doc = b"".join(para).rstrip(b"\r\n")
                    docs.append((para_line, doc))
                    size += len(doc)
                    para = []
                if size >= CHUNK_BYTES:
                    yield kind, path, docs, size
                    docs, size = [], 0
            if para:
                docs.append((para_line, b"".join(para).rstrip(b"\r\n")))
                size += len(docs[-1][1])
            if docs:
                yield kind, path, docs, size


# ----------------------------------------------------------------------------------------------
# tokenizing (in worker processes)
# ----------------------------------------------------------------------------------------------
_WORKER: dict = {}


def _init_worker(tokenizer_spec: str, eod_token: Optional[str], add_special: bool, json_key: str,
                 append_eod: bool, dtype: str, in_pool: bool = False) -> None:
    if in_pool:  # one thread per worker process: the processes are the parallelism
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        # The parent owns Ctrl-C and stops the pool; SIGTERM (Pool.terminate) must end a worker at once,
        # whatever handler a caller's process had installed.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _WORKER.update(tokenizer=load_tokenizer(tokenizer_spec, eod_token, add_special), json_key=json_key,
                   append_eod=append_eod, dtype=np.dtype(dtype))


def _tokenize_chunk(chunk) -> tuple[np.ndarray, np.ndarray, int, int]:
    kind, path, docs, size = chunk
    tok, key = _WORKER["tokenizer"], _WORKER["json_key"]
    texts = []
    for lineno, raw in docs:
        if kind == "parquet":
            text = raw
            if not isinstance(text, str):
                raise ConfigError(f"{path}: row {lineno}: {key!r} is {type(text).__name__}, not a string")
        elif kind == "jsonl":
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}: line {lineno}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict) or key not in record:
                raise ConfigError(f"{path}: line {lineno}: no key {key!r} (choose the text field with --json-key)")
            text = record[key]
            if not isinstance(text, str):
                raise ConfigError(f"{path}: line {lineno}: {key!r} is {type(text).__name__}, not a string")
        else:
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ConfigError(f"{path}: not UTF-8 text near line {lineno} ({err.reason})") from None
        texts.append(text)
    ids = tok.encode_batch(texts)
    extra = 1 if _WORKER["append_eod"] else 0
    # Empty documents stay empty (no EOD), as in Megatron's preprocessing.
    lengths = np.array([len(a) + extra if len(a) else 0 for a in ids], dtype=np.int64)
    flat = np.empty(int(lengths.sum()), dtype=_WORKER["dtype"])
    pos = 0
    for arr in ids:
        n = len(arr)
        if not n:
            continue
        flat[pos:pos + n] = arr
        pos += n
        if extra:
            flat[pos] = tok.eod
            pos += 1
    return flat, lengths, size, len(docs)


# ----------------------------------------------------------------------------------------------
# the command
# ----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lit_moe preprocess", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help="text, JSON-lines (.jsonl/.json/.ndjson) or Parquet (.parquet) files; text and JSON "
                        "lines may be .gz/.xz/.bz2 compressed")
    p.add_argument("--output-prefix", required=True, metavar="PREFIX",
                   help="writes PREFIX_<json-key>_document.bin/.idx")
    p.add_argument("--tokenizer", required=True, metavar="{byte|PATH}",
                   help="'byte' (UTF-8 bytes, EOD 256), a Hugging Face tokenizer directory (with "
                        "tokenizer_config.json; EOD = its eos_token), a tokenizer.json file or a directory "
                        "holding one, or builtin:austen")
    p.add_argument("--json-key", default="text",
                   help="field of each JSON line / column of a Parquet file holding the text (default: text)")
    p.add_argument("--format", choices=["auto", "jsonl", "parquet", "text"], default="auto",
                   help="input format; auto: JSON lines for .jsonl/.json/.ndjson, Parquet for .parquet, else text")
    p.add_argument("--text-documents", choices=["file", "line", "paragraph"], default="file",
                   help="plain text: one document per file (default), per non-empty line, or per "
                        "blank-line-separated paragraph")
    p.add_argument("--eod-token", default=None, help="EOD token string of a tokenizer file (default: guessed)")
    p.add_argument("--no-append-eod", dest="append_eod", action="store_false",
                   help="do not append EOD to each document")
    p.add_argument("--add-special-tokens", action="store_true",
                   help="let the tokenizer add its special tokens (e.g. BOS) to each document")
    p.add_argument("--dtype", choices=["auto", "uint16", "int32", "int64"], default="auto",
                   help="token dtype; auto: uint16 when the vocabulary has < 65500 entries, else int32")
    p.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 8),
                   help="worker processes (default: CPUs, at most 8)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    return p


def preprocess(args: argparse.Namespace) -> dict:
    for path in args.input:
        if not os.path.isfile(path):
            raise ConfigError(f"--input: {path}: no such file")
    if args.workers < 1:
        raise ConfigError(f"--workers: must be >= 1, got {args.workers}")
    tokenizer = load_tokenizer(args.tokenizer, args.eod_token, args.add_special_tokens)
    dtype = optimal_dtype(tokenizer.vocab_size) if args.dtype == "auto" else getattr(np, args.dtype)
    if np.iinfo(dtype).max < tokenizer.vocab_size - 1:
        raise ConfigError(f"--dtype: {np.dtype(dtype).name} cannot hold the {tokenizer.vocab_size} token ids")
    out_prefix = f"{args.output_prefix}_{args.json_key}_document"
    os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
    total_bytes = sum(os.path.getsize(p) for p in args.input)

    init = (args.tokenizer, args.eod_token, args.add_special_tokens, args.json_key, args.append_eod,
            np.dtype(dtype).str)
    chunks = read_chunks(list(args.input), args.format, args.text_documents, args.json_key)
    builder = IndexedDatasetBuilder(out_prefix, dtype)
    pool = None
    t0 = time.perf_counter()
    n_docs = n_tokens = n_bytes = 0
    try:
        from tqdm import tqdm

        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess", disable=args.quiet,
                   file=sys.stderr)
        if args.workers == 1:
            _init_worker(*init)
            results = map(_tokenize_chunk, chunks)
        else:
            # fork, so that a caller's script without a __main__ guard works; the initializer drops the
            # signal handlers a fork inherits (a worker running a caller's SIGTERM handler hung Pool.terminate)
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            pool = ctx.Pool(args.workers, initializer=_init_worker, initargs=init + (True,))
            results = pool.imap(_tokenize_chunk, chunks, chunksize=1)
        for flat, lengths, size, docs in results:
            builder.add_documents(flat, lengths)
            n_docs += docs
            n_tokens += int(flat.size)
            n_bytes += size
            bar.set_postfix_str(f"{n_tokens / max(time.perf_counter() - t0, 1e-9):,.0f} tokens/s", refresh=False)
            bar.update(size)
        bar.close()
        builder.finalize()
        if pool is not None:  # every chunk is back: let the workers exit on their own
            pool.close()
            pool.join()
            pool = None
    except BaseException:
        builder.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    seconds = time.perf_counter() - t0
    stats = {"prefix": out_prefix, "documents": n_docs, "tokens": n_tokens, "bytes": n_bytes,
             "seconds": seconds, "mb_per_s": n_bytes / 1e6 / max(seconds, 1e-9),
             "tokens_per_s": n_tokens / max(seconds, 1e-9),
             "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod, "dtype": np.dtype(dtype).name}
    if not args.quiet:
        print(f"wrote {bin_path(out_prefix)} and {idx_path(out_prefix)}: {n_docs} documents, {n_tokens} "
              f"tokens ({stats['dtype']}), {n_bytes / 1e6:.1f} MB in {seconds:.1f} s "
              f"({stats['mb_per_s']:.1f} MB/s, {stats['tokens_per_s']:,.0f} tokens/s); vocab_size {tokenizer.vocab_size}, eod {tokenizer.eod}\n"
              f"use: data_path: [\"1\", \"{out_prefix}\"]")
    return stats


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        preprocess(args)
    except ConfigError as err:
        from lit_moe.tools.errors import one_line

        print(f"lit_moe preprocess: error: {one_line(err)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
