"""Reading parts of safetensors files by byte range, and FP8 block-quantized weights dequantized.

A safetensors file is an 8-byte little-endian header length, a JSON header (per tensor: dtype, shape
and ``data_offsets`` into the data that follows) and the row-major data. :class:`SafetensorsFile`
parses the header itself and reads only the bytes of the rows a caller asks for, so a rank that
holds a slice of a tensor reads that slice, not the tensor; ``bytes_read`` counts what it read.

:class:`WeightDirectory` is a Hugging Face ``save_pretrained`` directory (one ``model.safetensors``
or shards with ``model.safetensors.index.json``). DeepSeek-V3's published weights are FP8: a linear
weight is stored as ``weight`` (``float8_e4m3fn``) with ``weight_scale_inv`` (fp32, one value per
``weight_block_size`` block, 128×128, given by ``quantization_config`` in ``config.json``); the value
is ``weight × weight_scale_inv`` of its block. :meth:`WeightDirectory.read` returns such weights
dequantized (fp32), reading the scale blocks that cover the rows and columns asked for.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional, Sequence

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
SCALE_SUFFIX = "_scale_inv"   # ``x.weight`` + ``x.weight_scale_inv``

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                               "float8_e5m2fnuz") if hasattr(torch, n))
NARROW = 0.5   # a column range below this fraction of a row is read row by row


class SafetensorsError(ValueError):
    """A safetensors file that cannot be read (the message names the file)."""


class SafetensorsFile:
    """One safetensors file: its header parsed on open, rows of its tensors read by byte range."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.bytes_read = 0
        try:
            self._f = open(self.path, "rb", buffering=0)
        except OSError as err:
            raise SafetensorsError(f"{self.path}: cannot open ({err.strerror})") from None
        size = os.fstat(self._f.fileno()).st_size
        try:
            n = int.from_bytes(self._pread(0, 8), "little")
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file")
            header = json.loads(self._pread(8, n))
            self.metadata = header.pop("__metadata__", None) or {}
            self.tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
            for key, info in header.items():
                lo, hi = (8 + n + int(o) for o in info["data_offsets"])
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                if hi > size or hi - lo != math.prod(shape) * dtype.itemsize:
                    raise ValueError(f"{key}: data offsets do not match its shape or run past the end")
                self.tensors[key] = (dtype, shape, lo, hi)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            self._f.close()
            raise SafetensorsError(f"{self.path}: not a readable safetensors file ({type(err).__name__}: "
                                   f"{str(err)[:120]})") from None

    def close(self) -> None:
        self._f.close()

    def _pread(self, offset: int, n: int) -> bytes:
        data = os.pread(self._f.fileno(), n, offset)
        if len(data) != n:
            raise SafetensorsError(f"{self.path}: ends before byte {offset + n} (truncated)")
        self.bytes_read += n
        return data

    def shape(self, key: str) -> tuple[int, ...]:
        return self.tensors[key][1]

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key][0]

    def read(self, key: str, lead: Sequence[int] = (), box: Optional[Sequence[slice]] = None) -> torch.Tensor:
        """``tensor[(*lead, *box)]``: ``lead`` fixes the leading dimensions, ``box`` slices (step 1)
        the others (all of them when None). Reads the rows of the first boxed dimension, and of the
        second only the columns asked for when that is under half a row."""
        dtype, shape, lo, _ = self.tensors[key]
        rest = shape[len(lead):]
        box = tuple(box) if box is not None else tuple(slice(0, s) for s in rest)
        box = tuple(slice(*b.indices(s)[:2]) for b, s in zip(box, rest))
        inner = dtype.itemsize * math.prod(rest)
        lin = 0
        for i, s in zip(lead, shape[: len(lead)]):
            lin = lin * s + i
        base = lo + lin * inner   # tensor[lead] starts here
        if not rest:
            return self._frombuffer(self._pread(base, dtype.itemsize), dtype, ())
        r0, r1 = box[0].start, box[0].stop
        row = inner // rest[0] if rest[0] else 0
        if len(rest) >= 2 and r1 > r0:
            c0, c1 = box[1].start, box[1].stop
            col = row // rest[1] if rest[1] else 0
            if (c1 - c0) < NARROW * rest[1]:   # a narrow column slab: each row's part
                parts = [self._pread(base + r * row + c0 * col, (c1 - c0) * col) for r in range(r0, r1)]
                t = self._frombuffer(b"".join(parts), dtype, (r1 - r0, c1 - c0, *rest[2:]))
                return t[(slice(None), slice(None), *box[2:])]
        t = self._frombuffer(self._pread(base + r0 * row, (r1 - r0) * row), dtype, (r1 - r0, *rest[1:]))
        return t[(slice(None), *box[1:])]

    @staticmethod
    def _frombuffer(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int],
                      rows: slice, cols: slice) -> torch.Tensor:
    """fp32 ``weight × scale_inv`` for a weight region ``[rows, cols]`` and the scale blocks
    ``scale_inv`` that cover it (its first block row/column is the one holding ``rows.start`` /
    ``cols.start``)."""
    br, bc = block
    r = torch.arange(rows.start, rows.stop) // br - rows.start // br
    c = torch.arange(cols.start, cols.stop) // bc - cols.start // bc
    return weight.to(torch.float32) * scale_inv.to(torch.float32)[r[:, None], c[None, :]]


class WeightDirectory:
    """A Hugging Face safetensors directory: which file holds each key (from the index, or the one
    file's header), tensors read by region, FP8 weights dequantized. Files are opened (and their
    headers parsed) on first use; ``bytes_read`` sums what was read."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._open: dict[Path, SafetensorsFile] = {}
        index = self.directory / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self.files = {k: self.directory / v for k, v in weight_map.items()}
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise SafetensorsError(f"{index}: not a readable index ({type(err).__name__})") from None
            for path in set(self.files.values()):
                if not path.is_file():
                    raise SafetensorsError(f"{path}: listed in {INDEX_FILE} but missing")
        elif (self.directory / SINGLE_FILE).exists():
            single = self.directory / SINGLE_FILE
            self.files = {k: single for k in self._file(single).tensors}
        else:
            raise SafetensorsError(f"{self.directory}: no {SINGLE_FILE} or {INDEX_FILE}")
        self.block = self._block_size()

    def _block_size(self) -> tuple[int, int]:
        try:
            config = json.loads((self.directory / CONFIG_FILE).read_text())
        except (OSError, ValueError):
            config = {}
        quant = (config.get("quantization_config") or {}) if isinstance(config, dict) else {}
        return tuple(quant.get("weight_block_size") or (128, 128))

    def _file(self, path: Path) -> SafetensorsFile:
        if path not in self._open:
            self._open[path] = SafetensorsFile(path)
        return self._open[path]

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self._open.values())

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def stored_keys(self) -> set[str]:
        return set(self.files)

    def keys(self) -> set[str]:
        """Tensor keys, without the scales of quantized weights (they are part of their weight)."""
        return {k for k in self.files if not (k.endswith(SCALE_SUFFIX) and k[: -len(SCALE_SUFFIX)] in self.files)}

    def scale_key(self, key: str) -> Optional[str]:
        return key + SCALE_SUFFIX if key + SCALE_SUFFIX in self.files else None

    def shape(self, key: str) -> tuple[int, ...]:
        return self._file(self.files[key]).shape(key)

    def dtype(self, key: str) -> torch.dtype:
        return self._file(self.files[key]).dtype(key)

    def read(self, key: str, lead: Sequence[int] = (), box: Optional[Sequence[slice]] = None) -> torch.Tensor:
        """``key[(*lead, *box)]``, dequantized to fp32 when the weight has a block scale."""
        f = self._file(self.files[key])
        data = f.read(key, lead, box)
        scale = self.scale_key(key)
        if scale is None:
            return data
        shape = f.shape(key)[len(lead):]
        if len(shape) != 2:
            raise SafetensorsError(f"{self.files[key]}: {key} has a block scale but is not a matrix")
        rows, cols = (slice(*b.indices(s)[:2]) for b, s in zip(box or (slice(None),) * 2, shape))
        br, bc = self.block
        blocks = (slice(rows.start // br, -(-rows.stop // br)), slice(cols.start // bc, -(-cols.stop // bc)))
        s = self._file(self.files[scale])
        want = (-(-shape[0] // br), -(-shape[1] // bc))
        if s.shape(scale)[len(lead):] != want:
            raise SafetensorsError(f"{self.files[scale]}: {scale} has shape {list(s.shape(scale))}, expected "
                                   f"{list(want)} for {list(shape)} in {br}x{bc} blocks")
        return dequantize_blocks(data, s.read(scale, lead, blocks), self.block, rows, cols)

    def get(self, key: str) -> torch.Tensor:
        """The whole tensor (dequantized when quantized)."""
        return self.read(key)
