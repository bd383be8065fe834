"""MindSpore MindRecord files, read without MindSpore: ``train_dataset.dataloader.type: MindDataset``.

A MindRecord data set is one or more shard files, each with an SQLite index beside it (``X.db``). The
layout, as MindSpore's C++ writer produces it (``mindspore/ccsrc/minddata/mindrecord/``):

* shard file: bytes 0-7 hold the header length ``n`` (uint64, native = little-endian byte order), bytes
  8..8+n the header, a JSON object (``ShardHeader::SerializeHeader`` in ``meta/shard_header.cc``;
  ``ShardWriter::WriteShardHeader`` in ``io/shard_writer.cc`` writes the length, then the text). The
  header names ``header_size`` and ``page_size``; page ``p`` starts at byte
  ``header_size + p * page_size`` (``page_size_ * page_id + header_size_`` in every seek of
  ``shard_writer.cc``). ``schema[0].schema`` maps each column to ``{"type", "shape"?}``;
  ``schema[0].blob_fields`` lists the columns kept in blob pages, in that order.
* raw page, one row: per schema an 8-byte little-endian length, then that many bytes of MessagePack
  holding the row's scalar columns (``ShardWriter::FlushRawChunk``; ``json::to_msgpack`` in
  ``FillArray``); one schema per file (``kMaxSchemaCount = 1``). A row without scalar columns gets
  the dummy ``{"id": 0}`` (``kDummyId``).
* blob page, one row: an 8-byte little-endian length, then the row's blob (``FlushBlobChunk``). With
  one blob column the blob is that column's bytes; with several, each is an 8-byte big-endian length
  and the bytes, in ``blob_fields`` order (``ShardWriter::MergeBlobData``).
* integer arrays (int32/int64 columns with a shape) are compressed when the schema has any
  (``ShardColumn::Init``: ``has_compress_blob_``, ``compress_integer`` defaults to true): a 4-byte
  big-endian element count, a bitmap of 2 bits per element (4 per byte, the first element in the
  high bits) naming its stored width (0: 1 byte, 1: 2, 2: 4, 3: 8 bytes), then the elements,
  little-endian, signed, in those widths (``ShardColumn::CompressInt`` / ``UncompressInt``,
  ``BytesLittleToMinIntType`` in ``meta/shard_column.cc``). Other columns are stored as their bytes.
* index ``X.db``: table ``INDEXES`` with one row per sample: ``ROW_ID`` (order within the shard),
  ``PAGE_ID_RAW``, ``PAGE_OFFSET_RAW`` (where the row's length starts), ``PAGE_OFFSET_RAW_END`` (where
  its MessagePack ends: the offset advances by 8 + length per schema), ``PAGE_ID_BLOB``,
  ``PAGE_OFFSET_BLOB`` (where the blob's 8-byte length
  starts), ``PAGE_OFFSET_BLOB_END`` (where the blob ends) (``ShardIndexGenerator::CreateDatabase``,
  ``GenerateRowData`` and ``AddBlobPageInfo`` in ``io/shard_index_generator.cc``).

Order (``shuffle: false``), checked against MindSpore 2.10's ``MindDataset``: the files in the order
given, and in each file its rows by ``ROW_ID``. The file list follows MindFormers'
``_get_mindrecord_files`` (``mindformers/dataset/dataloader/utils.py``): a path ending in ``.mindrecord``
is that file, a directory contributes every ``*.mindrecord`` file below it in ``os.walk`` order.
"""

from __future__ import annotations

import json
import os
import sqlite3
import struct
from typing import Any, Optional, Union

import numpy as np

from lit_moe.config import ConfigError

_NUMPY_TYPES = {"int32": np.int32, "int64": np.int64, "float32": np.float32, "float64": np.float64,
                "bytes": np.uint8}
_SUPPORTED_VERSIONS = ("2.0", "3.0")   # kSupportedVersion in include/common/shard_utils.h
_MAX_HEADER = 1 << 27                  # kMaxHeaderSize: a larger length is not a MindRecord header


def mindrecord_files(dataset_files: Union[str, list, None], field: str) -> list[str]:
    """The shard files MindFormers hands to ``MindDataset`` for ``dataset_files`` (its
    ``_get_mindrecord_files``); a one-line :class:`ConfigError` when there are none."""
    if not dataset_files:
        raise ConfigError(f"{field}: missing; MindDataset needs the .mindrecord file(s) or a directory holding them")
    paths = [dataset_files] if isinstance(dataset_files, str) else dataset_files
    if not isinstance(paths, (list, tuple)) or not all(isinstance(p, str) for p in paths):
        raise ConfigError(f"{field}: expected a path or a list of paths, got {dataset_files!r}")
    files: list[str] = []
    for path in paths:
        if path.endswith(".mindrecord"):
            files.append(path)
        elif os.path.isdir(path):
            for root, _, names in os.walk(path):
                files.extend(os.path.join(root, name) for name in names if name.endswith(".mindrecord"))
    if not files:
        raise ConfigError(f"{field}: {dataset_files!r} names no .mindrecord file (a path ending in .mindrecord, "
                          "or a directory with such files, as MindFormers looks for them; MindFormers skips "
                          "multi-shard names such as data.mindrecord0: rename them to end in .mindrecord)")
    return files


class MindRecordError(ConfigError):
    """A file that is not a readable MindRecord shard (named in the message)."""


class MindRecordShard:
    """One shard file and its index: ``len()`` rows, ``row(i)`` the columns of row ``i`` (by ``ROW_ID``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise MindRecordError(f"{path}: {len(head)} bytes, too short for a MindRecord header")
                (length,) = struct.unpack("<Q", head)
                if length > _MAX_HEADER:
                    raise MindRecordError(f"{path}: header length {length} is not a MindRecord header's")
                text = f.read(length)
        except OSError as err:
            raise MindRecordError(f"{path}: cannot read ({err.strerror or err})") from None
        try:
            header = json.loads(text.decode("utf-8"))
            self.header_size = int(header["header_size"])
            self.page_size = int(header["page_size"])
            schema = header["schema"][0]
            self.columns: dict[str, dict] = dict(schema["schema"])
            self.blob_fields: list[str] = list(schema["blob_fields"])
            version = header.get("version")
        except (UnicodeDecodeError, ValueError, KeyError, IndexError, TypeError):
            raise MindRecordError(f"{path}: the header is not MindRecord's JSON header") from None
        if version not in _SUPPORTED_VERSIONS:
            raise MindRecordError(f"{path}: MindRecord version {version!r}; supported: "
                                  + ", ".join(_SUPPORTED_VERSIONS))
        for name, spec in self.columns.items():
            if spec.get("type") not in _NUMPY_TYPES and spec.get("type") != "string":
                raise MindRecordError(f"{path}: column {name!r} has type {spec.get('type')!r}; MindRecord types are "
                                      "int32, int64, float32, float64, bytes, string")
        # ShardColumn::Init: integer arrays anywhere in the schema switch compression on for all of them
        self.compressed = any(spec.get("type") in ("int32", "int64") and "shape" in spec
                              for spec in self.columns.values())
        self.index = self._read_index(path + ".db")
        self._data = np.memmap(path, dtype=np.uint8, mode="r")

    def _read_index(self, db_path: str) -> np.ndarray:
        if not os.path.isfile(db_path):
            raise MindRecordError(f"{self.path}: its index {db_path} is missing (MindRecord files come with a .db)")
        try:
            con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
            try:
                rows = con.execute("SELECT PAGE_ID_RAW, PAGE_OFFSET_RAW, PAGE_OFFSET_RAW_END, PAGE_ID_BLOB, "
                                   "PAGE_OFFSET_BLOB, PAGE_OFFSET_BLOB_END FROM INDEXES ORDER BY ROW_ID").fetchall()
            finally:
                con.close()
        except sqlite3.Error as err:
            raise MindRecordError(f"{db_path}: not a MindRecord index ({err})") from None
        return np.asarray(rows, dtype=np.int64).reshape(-1, 6)

    def __len__(self) -> int:
        return len(self.index)

    def _page(self, page_id: int) -> int:
        return self.header_size + page_id * self.page_size

    def row(self, i: int, names: Optional[list[str]] = None) -> dict[str, Any]:
        raw_page, raw_at, raw_end, blob_page, blob_at, blob_end = (int(v) for v in self.index[i])
        names = list(self.columns) if names is None else names
        out: dict[str, Any] = {}
        blob = None
        scalars = None
        for name in names:
            if name in self.blob_fields:
                if blob is None:
                    # skip the blob's own 8-byte length (PAGE_OFFSET_BLOB points at it)
                    blob = self._data[self._page(blob_page) + blob_at + 8: self._page(blob_page) + blob_end]
                out[name] = self._blob_column(name, blob)
            else:
                if scalars is None:
                    # the row's 8-byte length, then its MessagePack up to PAGE_OFFSET_RAW_END
                    base = self._page(raw_page)
                    scalars = unpack_msgpack(bytes(self._data[base + raw_at + 8: base + raw_end]), self.path)
                out[name] = self._scalar_column(name, scalars)
        return out

    def _blob_column(self, name: str, blob: np.ndarray) -> np.ndarray:
        spec = self.columns[name]
        if len(self.blob_fields) == 1:
            data = blob
        else:
            at = 0
            for field in self.blob_fields:   # ShardColumn::GetColumnAddressInBlock
                size = int.from_bytes(bytes(blob[at: at + 8]), "big")
                if field == name:
                    data = blob[at + 8: at + 8 + size]
                    break
                at += 8 + size
        kind = spec["type"]
        if kind == "string":
            return np.array(bytes(data).decode("utf-8"))
        if self.compressed and kind in ("int32", "int64"):
            values = uncompress_int(bytes(data), _NUMPY_TYPES[kind], self.path)
        else:
            values = np.frombuffer(bytes(data), dtype=np.dtype(_NUMPY_TYPES[kind]).newbyteorder("<"))
        shape = spec.get("shape")
        return values.reshape(shape) if shape else values

    def _scalar_column(self, name: str, scalars: Any) -> np.ndarray:
        if not isinstance(scalars, dict) or name not in scalars:
            raise MindRecordError(f"{self.path}: column {name!r} is missing from a row")
        kind = self.columns[name]["type"]
        value = scalars[name]
        if kind == "string":
            return np.array(value if isinstance(value, str) else json.dumps(value))
        return np.array(value, dtype=_NUMPY_TYPES[kind])


def uncompress_int(data: bytes, dtype: Any, path: str) -> np.ndarray:
    """``ShardColumn::UncompressInt``: count (4 bytes, big-endian), 2-bit width codes, little-endian values."""
    if len(data) < 4:
        raise MindRecordError(f"{path}: a compressed integer column is truncated")
    count = int.from_bytes(data[:4], "big")
    codes_end = 4 + (count + 3) // 4
    bitmap = np.frombuffer(data[4:codes_end], dtype=np.uint8)
    shifts = (3 - np.arange(count) % 4) * 2          # the first element of a byte in its high bits
    codes = (bitmap[np.arange(count) // 4] >> shifts) & 3
    widths = 1 << codes.astype(np.int64)
    starts = codes_end + np.concatenate([[0], np.cumsum(widths)[:-1]]) if count else np.zeros(0, np.int64)
    if count and starts[-1] + widths[-1] > len(data):
        raise MindRecordError(f"{path}: a compressed integer column is truncated")
    out = np.empty(count, dtype=np.int64)
    buf = np.frombuffer(data, dtype=np.uint8)
    for code, kind in enumerate(("<i1", "<i2", "<i4", "<i8")):
        picked = np.nonzero(codes == code)[0]
        if len(picked):
            width = 1 << code
            byte_at = starts[picked][:, None] + np.arange(width)[None, :]
            out[picked] = buf[byte_at].copy().view(kind).reshape(-1)
    return out.astype(dtype)


def unpack_msgpack(data: bytes, path: str) -> Any:
    """The MessagePack subset nlohmann::json writes (maps, arrays, strings, integers, floats, booleans, null)."""
    def fail() -> None:
        raise MindRecordError(f"{path}: a row's scalar columns are not valid MessagePack")

    def read(at: int) -> tuple[Any, int]:
        if at >= len(data):
            fail()
        b = data[at]
        at += 1
        if b <= 0x7F:
            return b, at
        if b >= 0xE0:
            return b - 0x100, at
        if 0x80 <= b <= 0x8F:
            return read_map(at, b & 0x0F)
        if 0x90 <= b <= 0x9F:
            return read_array(at, b & 0x0F)
        if 0xA0 <= b <= 0xBF:
            return read_str(at, b & 0x1F)
        simple = {0xC0: None, 0xC2: False, 0xC3: True}
        if b in simple:
            return simple[b], at
        fixed = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q",
                 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
        if b in fixed:
            size = struct.calcsize(fixed[b])
            if at + size > len(data):
                fail()
            return struct.unpack(fixed[b], data[at: at + size])[0], at + size
        sized = {0xD9: (1, read_str), 0xDA: (2, read_str), 0xDB: (4, read_str),
                 0xC4: (1, read_bin), 0xC5: (2, read_bin), 0xC6: (4, read_bin),
                 0xDC: (2, read_array), 0xDD: (4, read_array), 0xDE: (2, read_map), 0xDF: (4, read_map)}
        if b in sized:
            width, reader = sized[b]
            return reader(at + width, int.from_bytes(data[at: at + width], "big"))
        fail()

    def read_str(at: int, n: int) -> tuple[str, int]:
        try:
            return data[at: at + n].decode("utf-8"), at + n
        except UnicodeDecodeError:
            fail()

    def read_bin(at: int, n: int) -> tuple[bytes, int]:
        return data[at: at + n], at + n

    def read_array(at: int, n: int) -> tuple[list, int]:
        out = []
        for _ in range(n):
            value, at = read(at)
            out.append(value)
        return out, at

    def read_map(at: int, n: int) -> tuple[dict, int]:
        out = {}
        for _ in range(n):
            key, at = read(at)
            value, at = read(at)
            out[key] = value
        return out, at

    value, _ = read(0)
    return value


# Columns of MindFormers' layouts with one entry per token: they must hold seq_length entries.
_TOKEN_COLUMNS = ("input_ids", "labels", "loss_mask", "position_ids")


class MindRecordDataset:
    """The samples of a MindRecord data set, in MindSpore's ``shuffle=False`` order; items are dicts of
    numpy arrays of ``column_names`` (every column when None). With ``seq_length``, every sample's
    token columns (``input_ids``, ``labels``, ``loss_mask``, ``position_ids``) must have that length and
    ``attention_mask`` must end in ``[S, S]`` (one line naming the file, row and column otherwise)."""

    def __init__(self, files: list[str], column_names: Optional[list[str]], field: str,
                 seq_length: Optional[int] = None) -> None:
        self.shards = [MindRecordShard(f) for f in files]
        first = self.shards[0]
        for shard in self.shards[1:]:
            if shard.columns != first.columns:
                raise MindRecordError(f"{field}: {shard.path} has columns {sorted(shard.columns)}, "
                                      f"{first.path} has {sorted(first.columns)}; one data set has one schema")
        if column_names is None:
            column_names = list(first.columns)
        missing = [c for c in column_names if c not in first.columns]
        if missing:
            raise ConfigError(f"{field.rsplit('.', 1)[0]}.column_names: {missing} not in {first.path} "
                              f"(its columns: {sorted(first.columns)})")
        self.column_names = list(column_names)
        self.seq_length = seq_length
        self.offsets = np.cumsum([0] + [len(s) for s in self.shards])
        if len(self) == 0:
            raise MindRecordError(f"{field}: {files} hold no samples")

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range ({len(self)} samples)")
        shard = int(np.searchsorted(self.offsets, idx, side="right")) - 1
        row = idx - int(self.offsets[shard])
        sample = self.shards[shard].row(row, self.column_names)
        if self.seq_length is not None:
            S = self.seq_length
            for name, value in sample.items():
                bad = ((name in _TOKEN_COLUMNS and value.shape != (S,))
                       or (name == "attention_mask" and value.shape[-2:] != (S, S)))
                if bad:
                    want = f"[{S}]" if name in _TOKEN_COLUMNS else f"[..., {S}, {S}]"
                    raise MindRecordError(f"{self.shards[shard].path}: row {row} column {name!r} has shape "
                                          f"{list(value.shape)}, expected {want} (model.seq_length {S})")
        return sample
