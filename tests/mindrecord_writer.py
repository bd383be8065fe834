"""A small MindRecord writer for the tests, written from MindSpore's C++ writer (not from lit_moe's reader):
one shard, one write call, as ``mindspore.mindrecord.FileWriter`` lays a file out. Sources followed
(mindspore-ai/mindspore, ``mindspore/ccsrc/minddata/mindrecord/``):

* ``io/shard_writer.cc``: ``WriteShardHeader`` (8-byte native-order length + header text at byte 0),
  ``CutRowGroup`` (a first, empty group; a new group whenever the blob or the raw bytes would pass
  ``page_size``), ``NewBlobPage`` (one blob page per group, page ids from 0), ``WriteRawPage`` /
  ``EmptyRawPage`` / ``AppendRawPage`` (raw pages after the blob pages; ``row_group_ids`` entries
  ``(group, offset)``; a new raw page's ``page_type_id`` is the previous raw page's *page id* + 1),
  ``FlushBlobChunk`` / ``FlushRawChunk`` (8-byte little-endian lengths before each blob / raw row),
  ``MergeBlobData`` (several blob columns: 8-byte big-endian length + bytes each), ``FillArray``
  (``json::to_msgpack`` of the scalar columns), ``WriteRawDataPreCheck`` (``{"id": 0}`` when a row has
  no scalar column);
* ``meta/shard_column.cc``: ``CompressBlob`` / ``CompressInt`` (integer arrays: 4-byte big-endian
  count, 2-bit width codes high bits first, little-endian values in the narrowest signed width);
* ``meta/shard_header.cc``: ``SerializeHeader`` (the header's key order; MindSpore 2.10 adds
  ``compression_size`` after ``page_size``);
* ``io/shard_index_generator.cc``: ``CreateDatabase`` (the ``INDEXES`` table, field columns
  ``INC_k`` + ``<name>_0``; table ``SHARD_NAME``), ``GenerateRowData`` / ``AddBlobPageInfo`` (the offsets);
* ``io/shard_writer.cc`` ``SetShardHeader``: index fields = the scalar columns (no shape), schema order.

JSON objects are nlohmann's (keys sorted). The output matches MindSpore 2.10's FileWriter byte for byte
on the committed fixtures (``tests/data/mindrecord``), which the tests check.
"""

from __future__ import annotations

import json
import os
import sqlite3
import struct
from typing import Any

import numpy as np


def msgpack(value: Any) -> bytes:
    """nlohmann::json::to_msgpack for dicts, strings, ints and floats (the narrowest encodings)."""
    if isinstance(value, dict):
        assert len(value) < 16
        out = bytes([0x80 | len(value)])
        for k in sorted(value):
            out += msgpack(k) + msgpack(value[k])
        return out
    if isinstance(value, str):
        raw = value.encode()
        assert len(raw) < 32
        return bytes([0xA0 | len(raw)]) + raw
    if isinstance(value, float):
        return b"\xcb" + struct.pack(">d", value)
    if isinstance(value, (int, np.integer)):
        v = int(value)
        if 0 <= v <= 0x7F:
            return bytes([v])
        if -32 <= v < 0:
            return struct.pack(">b", v)
        if v > 0:
            for code, fmt, top in ((0xCC, ">B", 0xFF), (0xCD, ">H", 0xFFFF), (0xCE, ">I", 0xFFFFFFFF)):
                if v <= top:
                    return bytes([code]) + struct.pack(fmt, v)
            return b"\xcf" + struct.pack(">Q", v)
        for code, fmt, low in ((0xD0, ">b", -128), (0xD1, ">h", -32768), (0xD2, ">i", -(1 << 31))):
            if v >= low:
                return bytes([code]) + struct.pack(fmt, v)
        return b"\xd3" + struct.pack(">q", v)
    raise TypeError(value)


def compress_int(values: np.ndarray) -> bytes:
    n = len(values)
    codes, body = [], b""
    for v in values.tolist():
        for code, fmt, low, high in ((0, "<b", -128, 127), (1, "<h", -32768, 32767),
                                     (2, "<i", -(1 << 31), (1 << 31) - 1), (3, "<q", -(1 << 63), (1 << 63) - 1)):
            if low <= v <= high:
                codes.append(code)
                body += struct.pack(fmt, v)
                break
    bitmap = bytearray((n + 3) // 4)
    for i, code in enumerate(codes):
        bitmap[i // 4] |= code << (2 * (3 - i % 4))
    return struct.pack(">I", n) + bytes(bitmap) + body


_SQL_TYPES = {"string": "TEXT", "int32": "INTEGER", "int64": "INTEGER", "float32": "NUMERIC", "float64": "NUMERIC"}


def write_mindrecord(path: str, schema: dict, rows: list[dict], header_size: int = 1 << 14,
                     page_size: int = 1 << 15, desc: str = "test") -> None:
    columns = sorted(schema)
    blob_fields = [c for c in columns if "shape" in schema[c] or schema[c]["type"] == "bytes"]
    scalars = [c for c in columns if c not in blob_fields]
    compress = any(schema[c]["type"] in ("int32", "int64") and "shape" in schema[c] for c in columns)
    blobs, raws, saved = [], [], 0
    for row in rows:
        parts = []
        for c in blob_fields:
            arr = np.asarray(row[c], dtype={"int32": "<i4", "int64": "<i8", "float32": "<f4", "float64": "<f8",
                                            "bytes": "u1"}[schema[c]["type"]]).reshape(-1)
            data = compress_int(arr) if compress and schema[c]["type"] in ("int32", "int64") else arr.tobytes()
            saved += arr.nbytes - len(data)
            parts.append(data)
        blobs.append(parts[0] if len(parts) == 1 else b"".join(struct.pack(">Q", len(p)) + p for p in parts))
        raws.append(msgpack({c: row[c] for c in scalars} if scalars else {"id": 0}))
    blob_size = [8 + len(b) for b in blobs]
    raw_size = [8 + len(r) for r in raws]
    # CutRowGroup on a fresh file: an empty first group, then a new group when a page would overflow
    groups, start, nb, nr = [(0, 0)], 0, blob_size[0], raw_size[0]
    for i in range(1, len(rows)):
        if nb + blob_size[i] > page_size or nr + raw_size[i] > page_size:
            groups.append((start, i))
            start, nb, nr = i, blob_size[i], raw_size[i]
        else:
            nb, nr = nb + blob_size[i], nr + raw_size[i]
    groups.append((start, len(rows)))
    pages, body = [], {}
    for gid, (a, b) in enumerate(groups[1:]):
        page_id = len(pages)
        body[page_id] = b"".join(struct.pack("<Q", len(blobs[j])) + blobs[j] for j in range(a, b))
        pages.append({"end_row_id": b, "page_id": page_id, "page_size": sum(blob_size[a:b]), "page_type": "BLOB_DATA",
                      "page_type_id": gid, "row_group_ids": [{"id": 0, "offset": 0}], "shard_id": 0,
                      "start_row_id": a})
    raw_page = None
    raw_at = {}
    for gid, (a, b) in enumerate(groups[1:]):
        size = sum(raw_size[a:b])
        if raw_page is None or raw_page["page_size"] + size > page_size:
            type_id = raw_page["page_id"] + 1 if raw_page else 0
            raw_page = {"end_row_id": 0, "page_id": len(pages), "page_size": 0, "page_type": "RAW_DATA",
                        "page_type_id": type_id, "row_group_ids": [], "shard_id": 0, "start_row_id": 0}
            pages.append(raw_page)
            body[raw_page["page_id"]] = b""
        raw_page["row_group_ids"].append({"id": gid, "offset": raw_page["page_size"]})
        for j in range(a, b):
            raw_at[j] = (raw_page["page_id"], raw_page["page_size"])
            body[raw_page["page_id"]] += struct.pack("<Q", len(raws[j])) + raws[j]
            raw_page["page_size"] += raw_size[j]
    index_fields = [{"index_field": c, "schema_id": 0} for c in scalars]
    dump = lambda v: json.dumps(v, separators=(",", ":"), sort_keys=True)  # noqa: E731
    header = ('{"header_size":%d,"index_fields":%s,"page":%s,"page_size":%d,"compression_size":%d,"schema":%s,'
              '"shard_addresses":%s,"shard_id":0,"statistics":null,"version":"3.0"}'
              % (header_size, dump(index_fields) if index_fields else "null", dump(pages), page_size, saved,
                 dump([{"blob_fields": blob_fields, "desc": desc, "schema": schema}]),
                 dump([os.path.basename(path)]))).encode()
    out = bytearray(struct.pack("<Q", len(header)) + header)
    for page_id in sorted(body):
        at = header_size + page_id * page_size
        out.extend(b"\0" * (at - len(out)))
        out[at: at + len(body[page_id])] = body[page_id]
    with open(path, "wb") as f:
        f.write(bytes(out))

    fields_sql = "".join(f",INC_{k} INT, {c}_0 {_SQL_TYPES[schema[c]['type']]}" for k, c in enumerate(scalars))
    con = sqlite3.connect(path + ".db")
    con.execute("CREATE TABLE INDEXES(  ROW_ID               INT  NOT NULL, PAGE_ID_RAW          INT  NOT NULL"
                ", PAGE_OFFSET_RAW      INT  NOT NULL, PAGE_OFFSET_RAW_END  INT  NOT NULL"
                ", ROW_GROUP_ID         INT  NOT NULL, PAGE_ID_BLOB         INT  NOT NULL"
                ", PAGE_OFFSET_BLOB     INT  NOT NULL, PAGE_OFFSET_BLOB_END INT  NOT NULL" + fields_sql
                + ", PRIMARY KEY(ROW_ID" + "".join(f",INC_{k}" for k in range(len(scalars))) + "));")
    con.execute("CREATE TABLE SHARD_NAME(NAME TEXT NOT NULL);")
    con.execute("INSERT INTO SHARD_NAME (NAME) VALUES (?)", (os.path.basename(path),))
    for gid, (a, b) in enumerate(groups[1:]):
        offset = 0
        for j in range(a, b):
            page_raw, off_raw = raw_at[j]
            values = [j, page_raw, off_raw, off_raw + raw_size[j], gid, gid, offset, offset + blob_size[j]]
            offset += blob_size[j]
            for c in scalars:
                value = rows[j][c]
                values += [0, value.item() if isinstance(value, np.generic) else value]
            con.execute(f"INSERT INTO INDEXES VALUES ({','.join('?' * len(values))})", values)
    con.commit()
    con.close()


# ----------------------------------------------------------------------------------------------
# The schema and rows of write_with_mindspore.py (same RandomState draws, in the same order).
SCHEMA = {"input_ids": {"type": "int32", "shape": [-1]}, "labels": {"type": "int32", "shape": [-1]},
          "loss_mask": {"type": "int32", "shape": [-1]}, "position_ids": {"type": "int32", "shape": [-1]},
          "attention_mask": {"type": "int32", "shape": [4, 4]}, "actual_seq_len": {"type": "int32", "shape": [-1]},
          "weights": {"type": "float32", "shape": [-1]}, "big": {"type": "int64", "shape": [2]}, "idx": {"type": "int64"}}


def fixture_rows() -> dict[str, list[dict]]:
    """The rows of ``tests/data/mindrecord/{one,two,ids}`` (``write_with_mindspore.py`` writes these)."""
    rng = np.random.RandomState(0)
    S = 16

    def sample(i):
        ids = rng.randint(0, 129280, size=S + 1).astype(np.int32)
        ids[3], ids[5], ids[6], ids[7], ids[8] = -1, 127, -129, 40000, -40000
        ends = np.array([5, 11, S] if i % 2 else [S], dtype=np.int32)
        return {"input_ids": ids[:-1], "labels": ids[1:].copy(), "loss_mask": (rng.rand(S) > 0.2).astype(np.int32),
                "position_ids": np.arange(S, dtype=np.int32) % 7,
                "attention_mask": np.tril(np.ones((4, 4), dtype=np.int32)) * (i + 1),
                "actual_seq_len": ends, "weights": rng.rand(3).astype(np.float32),
                "big": np.array([2**40 + i, -(2**33)], dtype=np.int64), "idx": i}

    one = [sample(i) for i in range(7)]
    two = [sample(i) for i in range(11)]       # split over two shards by MindSpore at random
    ids = [{"input_ids": sample(i)["input_ids"]} for i in range(5)]
    return {"one": one, "two": two, "ids": ids}


def big_rows() -> list[dict]:
    """The rows of ``tests/data/mindrecord/big`` (several pages)."""
    rng = np.random.RandomState(1)
    S = 300
    return [{"input_ids": rng.randint(-5, 200000, size=S).astype(np.int32),
             "labels": rng.randint(0, 300, size=S).astype(np.int32), "loss_mask": np.ones(S, np.int32),
             "position_ids": np.arange(S, dtype=np.int32)} for _ in range(40)]
