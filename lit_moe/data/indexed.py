"""Megatron's indexed dataset: a ``.bin`` of raw token ids and an ``.idx`` that says where each sequence is.

``.bin``: the token ids of every sequence, concatenated, little-endian, no header.

``.idx`` (little-endian)::

    offset      size  field
    0           9     magic b"MMIDIDX\\x00\\x00"
    9           8     version, u64 = 1
    17          1     dtype code, u8 (see DTYPE_CODES)
    18          8     sequence count N, u64
    26          8     document count M, u64 (entries of the document index = documents + 1)
    34          4N    sequence lengths, int32 (tokens)
    34+4N       8N    sequence pointers, int64 (byte offsets into .bin: prefix sums of length * itemsize)
    34+12N      8M    document index, int64: 0, then the number of sequences at each document end

Files written by megatron-core's ``IndexedDatasetBuilder`` (or ``tools/preprocess_data.py``) load here
unchanged and the other way round. The reader memory-maps both files; a problem with either is one
:class:`DatasetError` naming the file and what is wrong with it.
"""

from __future__ import annotations

import os
import struct
from typing import Iterable, Optional, Union

import numpy as np

from lit_moe.config import ConfigError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_SIZE = 34

DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
"""Megatron's dtype codes (``DType`` in megatron-core). 6/7 follow Megatron, not legacy fairseq."""


class DatasetError(ConfigError):
    """A dataset file (or the configuration that points at it) that cannot be used; the message names
    the file and the problem."""

    def __init__(self, message: str = "") -> None:
        # A DataLoader worker's error comes back as DatasetError("Caught DatasetError in DataLoader
        # worker process 0.\nOriginal Traceback ...\n...DatasetError: <message>\n"): keep the message.
        text = str(message)
        if text.startswith("Caught DatasetError") and "DatasetError: " in text:
            text = text.rstrip().rsplit("DatasetError: ", 1)[1].strip()
        super().__init__(text)


VALIDATE_CHUNK = 1 << 24  # index entries checked per vectorised block (bounded memory on huge indices)


def dtype_code(dtype) -> int:
    dtype = np.dtype(dtype)
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise DatasetError(f"dtype {dtype} has no Megatron dtype code (known: "
                       f"{', '.join(np.dtype(t).name for t in DTYPE_CODES.values())})")


def optimal_dtype(vocab_size: Optional[int]) -> type:
    """The token dtype Megatron's preprocessing picks for a vocabulary: uint16 below 65500, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def exists(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


class IndexedDataset:
    """Read-only, memory-mapped view of ``prefix.bin`` / ``prefix.idx``.

    ``ds[i]`` is sequence ``i`` (a numpy view into the mapped ``.bin``); ``ds.get(i, offset, length)``
    reads part of it. ``sequence_lengths``, ``sequence_pointers`` and ``document_indices`` are the
    arrays of the index. Pickling re-opens the files (so DataLoader workers map them themselves).

    Args:
        prefix: path without the ``.bin``/``.idx`` suffix.
        mmap: memory-map the ``.bin`` (True) or read it with file reads (False; for file systems
            where mmap is slow). The index is always mapped.
    """

    def __init__(self, prefix: str, mmap: bool = True) -> None:
        self._open(prefix, mmap)

    # -- opening and validation ------------------------------------------------------------------
    def _open(self, prefix: str, mmap: bool) -> None:
        self.prefix = prefix
        self.mmap = mmap
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        for path in (ipath, bpath):
            if not os.path.isfile(path):
                hint = " (give the prefix without .bin/.idx)" if prefix.endswith((".bin", ".idx")) else ""
                raise DatasetError(f"{path}: file not found (indexed dataset prefix {prefix!r} needs "
                                   f"both {os.path.basename(ipath)} and {os.path.basename(bpath)}){hint}")
        idx_size = os.path.getsize(ipath)
        with open(ipath, "rb") as f:
            header = f.read(HEADER_SIZE)
        if len(header) < 9 or header[:9] != INDEX_MAGIC:
            raise DatasetError(f"{ipath}: not a Megatron index file (magic {header[:9]!r}, "
                               f"expected {INDEX_MAGIC!r})")
        if len(header) < HEADER_SIZE:
            raise DatasetError(f"{ipath}: index header is truncated ({len(header)} of {HEADER_SIZE} bytes)")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != INDEX_VERSION:
            raise DatasetError(f"{ipath}: unsupported index version {version} (expected {INDEX_VERSION})")
        code = header[17]
        if code not in DTYPE_CODES:
            raise DatasetError(f"{ipath}: unknown dtype code {code} (known codes: "
                               + ", ".join(f"{c} {np.dtype(t).name}" for c, t in DTYPE_CODES.items()) + ")")
        self.dtype = np.dtype(DTYPE_CODES[code])
        n_seq, n_doc = struct.unpack("<QQ", header[18:34])
        need = HEADER_SIZE + 12 * n_seq + 8 * n_doc
        if idx_size < need:
            raise DatasetError(f"{ipath}: index is truncated: {n_seq} sequences and {n_doc} document "
                               f"entries need {need} bytes, the file has {idx_size}")
        self.sequence_count = int(n_seq)
        self.document_count = int(n_doc)

        idx = np.memmap(ipath, mode="r", dtype=np.uint8) if idx_size else np.zeros(0, np.uint8)
        self._idx_map = idx
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(idx, dtype=np.int32, count=n_seq, offset=off)
        off += 4 * n_seq
        self.sequence_pointers = np.frombuffer(idx, dtype=np.int64, count=n_seq, offset=off)
        off += 8 * n_seq
        self.document_indices = np.frombuffer(idx, dtype=np.int64, count=n_doc, offset=off)

        if n_doc == 0 or self.document_indices[-1] != n_seq:
            last = self.document_indices[-1] if n_doc else "none"
            raise DatasetError(f"{ipath}: corrupt index: the document index must end with the sequence "
                               f"count {n_seq}, found {last}")
        bin_size = os.path.getsize(bpath)
        if n_seq:
            need_bin = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
        else:
            need_bin = 0
        if bin_size < need_bin:
            raise DatasetError(f"{bpath}: data file is shorter than its index says: {bin_size} bytes, the "
                               f"index needs {need_bin} ({need_bin // self.dtype.itemsize} {self.dtype.name} tokens)")
        validate_index(ipath, self.sequence_lengths, self.sequence_pointers, self.document_indices,
                       self.dtype.itemsize, bin_size)
        self.bin_size = bin_size
        self.max_token_id = read_max_token_id(prefix, idx_size, bin_size)
        if mmap:
            self._bin = np.memmap(bpath, mode="r", dtype=np.uint8) if bin_size else np.zeros(0, np.uint8)
        else:
            self._bin = None

    def __getstate__(self):
        return {"prefix": self.prefix, "mmap": self.mmap}

    def __setstate__(self, state):
        self._open(state["prefix"], state["mmap"])

    # -- access -----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.sequence_count

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def _read(self, byte_offset: int, count: int) -> np.ndarray:
        if self._bin is not None:
            return np.frombuffer(self._bin, dtype=self.dtype, count=count, offset=byte_offset)
        out = np.empty(count, dtype=self.dtype)
        with open(bin_path(self.prefix), "rb", buffering=0) as f:
            f.seek(byte_offset)
            f.readinto(out)
        return out

    def __getitem__(self, i: int) -> np.ndarray:
        if not -self.sequence_count <= i < self.sequence_count:
            raise IndexError(f"sequence {i} out of range for {self.prefix} ({self.sequence_count} sequences)")
        i = int(i) % self.sequence_count
        return self._read(int(self.sequence_pointers[i]), int(self.sequence_lengths[i]))

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``i`` (to its end when ``length`` is None)."""
        seq_len = int(self.sequence_lengths[i])
        if length is None:
            length = seq_len - offset
        return self._read(int(self.sequence_pointers[i]) + int(offset) * self.dtype.itemsize, int(length))

    def document_of(self, sequence: int) -> int:
        """The document that sequence ``sequence`` belongs to."""
        return int(np.searchsorted(self.document_indices, sequence, side="right")) - 1

    def document(self, d: int) -> list[np.ndarray]:
        """The sequences of document ``d``."""
        lo, hi = int(self.document_indices[d]), int(self.document_indices[d + 1])
        return [self[i] for i in range(lo, hi)]


class IndexedDatasetBuilder:
    """Writes ``prefix.bin`` and ``prefix.idx`` incrementally.

    ``add_document(tokens)`` appends one document made of one sequence (what ``preprocess`` writes);
    ``add_item(tokens)`` + ``end_document()`` builds documents of several sequences. ``finalize()``
    writes the index. Both files are written under temporary names and renamed at ``finalize`` so a
    reader never sees half a dataset.
    """

    def __init__(self, prefix: str, dtype=np.int32) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self._tmp_bin = bin_path(prefix) + f".tmp{os.getpid()}"
        self._bin = open(self._tmp_bin, "wb")
        self._lengths: list[np.ndarray] = []
        self._n_seq = 0
        self._doc_ends: list[int] = [0]
        self._max_id: Optional[int] = None

    def _write(self, tokens) -> int:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        if arr.size and arr.dtype != self.dtype:
            if np.issubdtype(arr.dtype, np.integer) and np.issubdtype(self.dtype, np.integer):
                info = np.iinfo(self.dtype)
                if arr.min() < info.min or arr.max() > info.max:
                    raise DatasetError(f"{self.prefix}: token ids {int(arr.min())}..{int(arr.max())} do not fit "
                                       f"the dataset dtype {self.dtype.name}")
            arr = arr.astype(self.dtype)
        if arr.size:
            top = int(arr.max())
            self._max_id = top if self._max_id is None else max(self._max_id, top)
        self._bin.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes())
        return int(arr.size)

    def add_item(self, tokens) -> None:
        """Append one sequence to the current document."""
        self._lengths.append(np.array([self._write(tokens)], dtype=np.int32))
        self._n_seq += 1

    def end_document(self) -> None:
        self._doc_ends.append(self._n_seq)

    def add_document(self, tokens, lengths: Optional[Iterable[int]] = None) -> None:
        """Append one document: ``tokens`` holds its sequences back to back, ``lengths`` their sizes
        (default: one sequence)."""
        n = self._write(tokens)
        lengths = np.array([n] if lengths is None else list(lengths), dtype=np.int32)
        if int(lengths.sum()) != n:
            raise DatasetError(f"{self.prefix}: document lengths sum to {int(lengths.sum())} but {n} tokens were given")
        self._lengths.append(lengths)
        self._n_seq += len(lengths)
        self._doc_ends.append(self._n_seq)

    def add_documents(self, flat_tokens: np.ndarray, doc_lengths: np.ndarray) -> None:
        """Append many documents at once (the preprocessing fast path): ``flat_tokens`` holds them back
        to back, ``doc_lengths`` their sizes. A document of length 0 gets no sequence (as Megatron's
        preprocessing writes an empty document), so document ``i`` stays input document ``i``."""
        doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
        n = self._write(flat_tokens)
        if int(doc_lengths.sum()) != n:
            raise DatasetError(f"{self.prefix}: document lengths sum to {int(doc_lengths.sum())} but {n} tokens were given")
        nonempty = doc_lengths > 0
        self._lengths.append(doc_lengths[nonempty].astype(np.int32))
        ends = self._n_seq + np.cumsum(nonempty)
        self._n_seq += int(nonempty.sum())
        self._doc_ends.extend(ends.tolist())

    def add_index(self, other_prefix: str) -> None:
        """Append every document of another indexed dataset (same dtype)."""
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise DatasetError(f"{idx_path(other_prefix)}: dtype {other.dtype.name} differs from {self.dtype.name}")
        with open(bin_path(other_prefix), "rb") as f:
            while chunk := f.read(1 << 24):
                self._bin.write(chunk)
        top = other.max_token_id
        if top is None and other.num_tokens:  # no record: scan its tokens (memory-mapped)
            top = int(other._read(0, other.num_tokens).max())
        if top is not None:
            self._max_id = top if self._max_id is None else max(self._max_id, top)
        self._lengths.append(np.array(other.sequence_lengths, dtype=np.int32))
        base = self._n_seq
        self._n_seq += len(other)
        self._doc_ends.extend((other.document_indices[1:] + base).tolist())

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        tmp_idx = idx_path(self.prefix) + f".tmp{os.getpid()}"
        write_index(tmp_idx, self.dtype, lengths, np.asarray(self._doc_ends, dtype=np.int64))
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(tmp_idx, idx_path(self.prefix))
        self._write_meta()

    def _write_meta(self) -> None:
        import json

        meta = {"max_token_id": self._max_id, "idx_size": os.path.getsize(idx_path(self.prefix)),
                "bin_size": os.path.getsize(bin_path(self.prefix)), "dtype": self.dtype.name}
        tmp = meta_path(self.prefix) + f".tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(meta, f)
        os.replace(tmp, meta_path(self.prefix))

    def abort(self) -> None:
        """Drop what was written (used when preprocessing fails)."""
        try:
            self._bin.close()
        finally:
            if os.path.exists(self._tmp_bin):
                os.remove(self._tmp_bin)


def validate_index(ipath: str, lengths: np.ndarray, pointers: np.ndarray, documents: np.ndarray, itemsize: int,
                   bin_size: int) -> None:
    """Every entry of an index, in vectorised blocks of ``VALIDATE_CHUNK``: lengths >= 0; each pointer
    where the previous sequence ends (Megatron writes the sequences back to back from offset 0), so
    every sequence lies inside the ``.bin``; the document index starts at 0 and never decreases. The
    first bad entry is one :class:`DatasetError` naming the file, the entry and its value."""
    n = len(lengths)
    expected_next = 0  # byte offset where the next sequence must start
    for lo in range(0, n, VALIDATE_CHUNK):
        hi = min(n, lo + VALIDATE_CHUNK)
        length = lengths[lo:hi]
        bad = np.flatnonzero(length < 0)
        if bad.size:
            i = lo + int(bad[0])
            raise DatasetError(f"{ipath}: corrupt index: sequence {i} has length {int(lengths[i])}")
        ends = np.cumsum(length, dtype=np.int64) * itemsize + expected_next
        starts = np.empty_like(ends)
        starts[0] = expected_next
        starts[1:] = ends[:-1]
        bad = np.flatnonzero(pointers[lo:hi] != starts)
        if bad.size:
            i = lo + int(bad[0])
            raise DatasetError(f"{ipath}: corrupt index: sequence {i} points at byte {int(pointers[i])} of the .bin, "
                               f"but the sequences before it end at byte {int(starts[bad[0]])}")
        expected_next = int(ends[-1])
    if expected_next > bin_size:
        raise DatasetError(f"{bin_path(ipath[:-4])}: data file is shorter than its index says: {bin_size} bytes, "
                           f"the index needs {expected_next}")
    if len(documents) and documents[0] != 0:
        raise DatasetError(f"{ipath}: corrupt index: the document index must start at 0, found {int(documents[0])}")
    for lo in range(0, max(len(documents) - 1, 0), VALIDATE_CHUNK):
        hi = min(len(documents), lo + VALIDATE_CHUNK + 1)
        bad = np.flatnonzero(np.diff(documents[lo:hi]) < 0)
        if bad.size:
            d = lo + int(bad[0]) + 1
            raise DatasetError(f"{ipath}: corrupt index: document entry {d} ({int(documents[d])}) is below the "
                               f"one before it ({int(documents[d - 1])})")


def meta_path(prefix: str) -> str:
    """``prefix.meta.json``: facts the builder knows about the data (the largest token id), with the
    sizes of the ``.idx``/``.bin`` it describes (a file rewritten by another tool makes it stale)."""
    return prefix + ".meta.json"


def read_max_token_id(prefix: str, idx_size: int, bin_size: int) -> Optional[int]:
    """The largest token id recorded by the builder, or None (no record, or one for other files)."""
    import json

    try:
        with open(meta_path(prefix)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("idx_size") != idx_size or meta.get("bin_size") != bin_size:
        return None
    value = meta.get("max_token_id")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def write_index(path: str, dtype, sequence_lengths: np.ndarray, document_indices: np.ndarray) -> None:
    """Write an ``.idx`` for sequences of ``sequence_lengths`` tokens of ``dtype`` stored back to back."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    doc_index = np.asarray(document_indices, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(INDEX_MAGIC)
        f.write(struct.pack("<Q", INDEX_VERSION))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_index)))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(doc_index.astype("<i8").tobytes())


def write_indexed_dataset(prefix: str, documents: Iterable[Union[np.ndarray, list]], dtype=np.int32) -> str:
    """Write a list of documents (one sequence each) in one call; returns ``prefix``."""
    builder = IndexedDatasetBuilder(prefix, dtype)
    for doc in documents:
        builder.add_document(doc)
    builder.finalize()
    return prefix
