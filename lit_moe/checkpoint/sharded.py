"""Tensor shards on disk: what each rank writes, and how any layout reads them back.

Every rank writes the local pieces ("chunks") of its tensors into one safetensors file, with the
piece's offsets inside the global tensor and the global shape in the file header. A DTensor's piece
is its local shard (FSDP2, tensor and expert parallel, on any mesh); a plain tensor is a piece that
covers the whole tensor. Reading is layout-independent: for each tensor it wants, a rank computes
its own piece of the global tensor and copies the overlapping regions of the saved pieces into it,
so a checkpoint written by one layout loads into another (dp2 → tp2, ep2 or one process).

Each save also yields, per file, where every piece's bytes lie and a CRC-32 per ``CHUNK_BYTES`` of
them; rank 0 writes these into one index (``index.json``). A resuming rank reads that index and then
only the byte ranges it needs, from the files holding them, checking the checksums of the chunks it
reads (and of the headers of the files it opens): O(1) metadata per rank, like PyTorch DCP's one
metadata file. Checkpoints without the index (written before it existed) are read through the
safetensors headers of every file, as then.

Files are parsed by safetensors or as plain bytes (no pickle): loading never runs code from a file.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save as safetensors_save
from torch.distributed.tensor import DTensor

from lit_moe.checkpoint.comm import Comm
from lit_moe.checkpoint.layout import CheckpointError, file_crc32, write_bytes_durable
from lit_moe.model.names import canonical_name

HEADER_KEY = "lit_moe"  # safetensors header entry holding the chunk geometry (JSON)
CHUNK_BYTES = 1 << 22
"""Granularity of the data checksums in the index (4 MiB): a rank that reads part of a piece checks
the chunks it reads, at most one chunk more than it needs at either end."""


# A tensor's name without wrapper parts (activation checkpointing, FSDP1, ``torch.compile``), so a
# checkpoint saved with recompute on loads with it off and the reverse: the model's one definition.
canonical = canonical_name


# ----------------------------------------------------------------------------------------------
# what a rank holds
# ----------------------------------------------------------------------------------------------
@dataclass
class Piece:
    """The local part of one tensor: ``local`` is ``global[offsets : offsets + local.shape]``."""

    local: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]
    replicated_dims: tuple[int, ...] = ()  # mesh dims the piece is replicated over (DTensor)
    mesh: object = None

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.local.shape)

    @property
    def geometry(self) -> tuple:
        return (self.offsets, self.sizes)


def piece_of(t: torch.Tensor) -> Piece:
    if isinstance(t, DTensor):
        if any(p.is_partial() for p in t.placements):
            raise ValueError("a DTensor with a Partial placement cannot be checkpointed")
        chunks = t.__create_chunk_list__()  # the DCP protocol: offsets of this rank's piece
        if len(chunks) != 1:
            raise ValueError(f"expected one local chunk per DTensor, got {len(chunks)}")
        reps = tuple(i for i, p in enumerate(t.placements) if p.is_replicate())
        return Piece(t._local_tensor, tuple(int(o) for o in chunks[0].offsets), tuple(t.shape), reps, t.device_mesh)
    return Piece(t, (0,) * t.dim(), tuple(t.shape))


def pieces_of(state: Mapping[str, torch.Tensor]) -> dict[str, Piece]:
    """Pieces keyed by canonical name."""
    return {canonical(k): piece_of(v) for k, v in state.items() if isinstance(v, torch.Tensor)}


SMALL_PIECE_BYTES = 1 << 20
"""Pieces below this size (norms, biases, router biases) held by the same ranks are all written by
one of them, so that a resuming rank finds them in one file instead of one file per writer."""


def assign_writers(comm: Comm, pieces: Mapping[str, Piece]) -> set[str]:
    """``remove_redundancy``: the keys this rank writes so that every distinct piece (same tensor,
    same offsets and sizes) is written by exactly one of the ranks holding it, spreading the bytes
    over them (largest pieces first, each to the least-loaded holder; the small pieces of one set of
    holders all to the same holder)."""
    mine = {k: (p.offsets, p.sizes, p.local.numel() * p.local.element_size()) for k, p in pieces.items()}
    everything = comm.gather(mine)
    if comm.rank == 0:
        holders: dict[tuple, list[int]] = defaultdict(list)
        nbytes: dict[tuple, int] = {}
        for rank, held in enumerate(everything):
            for key, (offsets, sizes, size) in held.items():
                ident = (key, tuple(offsets), tuple(sizes))
                holders[ident].append(rank)
                nbytes[ident] = size
        load = [0] * comm.world
        plan: list[set[str]] = [set() for _ in range(comm.world)]
        small_writer: dict[tuple[int, ...], int] = {}
        for ident in sorted(holders, key=lambda i: (-nbytes[i], i[0], i[1])):
            group = tuple(holders[ident])
            writer = min(group, key=lambda r: (load[r], r))
            if nbytes[ident] < SMALL_PIECE_BYTES:
                writer = small_writer.setdefault(group, writer)
            load[writer] += nbytes[ident]
            plan[writer].add(ident[0])
    else:
        plan = None
    return comm.scatter(plan)


# ----------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------
def stage(pieces: Mapping[str, Piece]) -> dict[str, Piece]:
    """CPU copies of the pieces, safe to write while training goes on (asynchronous save). Always a
    copy: even in a sharded state dict offloaded to the CPU, tensors that already lived on the CPU
    (AdamW's ``step`` counters, updated in place) are the live objects."""
    out = {}
    for key, p in pieces.items():
        local = p.local.detach().to("cpu", copy=True).contiguous()
        out[key] = Piece(local, p.offsets, p.global_shape)
    return out


def write_pieces(path: Path, pieces: Mapping[str, Piece], extra: Optional[dict] = None) -> tuple[int, int, dict]:
    """One safetensors file with the pieces and their geometry. Returns (size, crc32, layout): the
    layout (see :func:`byte_layout`) goes into the checkpoint's index."""
    tensors = {}
    geometry = {}
    for key, p in pieces.items():
        if p.local.numel() == 0 and math.prod(p.global_shape) > 0:
            continue  # an empty shard (uneven sharding) carries nothing
        tensors[key] = p.local.detach().to("cpu").contiguous()
        geometry[key] = {"offsets": list(p.offsets), "global_shape": list(p.global_shape)}
    header = {"version": 1, "pieces": geometry, "extra": extra or {}}
    data = safetensors_save(tensors, metadata={HEADER_KEY: json.dumps(header)})
    size, crc = write_bytes_durable(path, data)
    return size, crc, byte_layout(data, geometry, extra or {})


def safetensors_header(head: bytes) -> tuple[int, dict]:
    """(bytes before the data, parsed header) of a safetensors file: an 8-byte little-endian length,
    then that many bytes of JSON."""
    if len(head) < 8:
        raise ValueError("shorter than the 8-byte header length")
    n = int.from_bytes(head[:8], "little")
    if len(head) < 8 + n:
        raise ValueError(f"header of {n} bytes runs past the end")
    return 8 + n, json.loads(head[8: 8 + n])


def chunk_crcs(data: memoryview) -> list[int]:
    return [zlib.crc32(data[i: i + CHUNK_BYTES]) for i in range(0, len(data), CHUNK_BYTES)] or [zlib.crc32(b"")]


def byte_layout(data: bytes, geometry: Mapping[str, dict], extra: dict) -> dict:
    """Where each piece's bytes lie in the file ``data`` and their chunk checksums:
    ``{"header": [bytes, crc32], "extra": ..., "pieces": {key: [offsets, sizes, global_shape, dtype,
    start, end, [crc32 per chunk]]}}`` (``start``/``end``: absolute byte offsets)."""
    view = memoryview(data)
    start, header = safetensors_header(data[: 8 + int.from_bytes(data[:8], "little")])
    out = {}
    for key, g in geometry.items():
        info = header[key]
        lo, hi = (start + int(o) for o in info["data_offsets"])
        out[key] = [list(g["offsets"]), list(info["shape"]), list(g["global_shape"]), info["dtype"], lo, hi,
                    chunk_crcs(view[lo:hi])]
    return {"header": [start, zlib.crc32(view[:start])], "extra": extra, "pieces": out}


# ----------------------------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SavedPiece:
    file: Path
    writer: int  # rank that wrote the file
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: str
    span: Optional[tuple[int, int]] = None  # absolute byte range in the file (indexed checkpoints)
    crcs: tuple[int, ...] = ()  # CRC-32 of each CHUNK_BYTES of the span


class ShardIndex:
    """Where every saved piece of every tensor is, from the headers of a set of files.

    ``files`` maps file path → (writer rank, expected size, expected crc32 or None). Built from a
    checkpoint's index (:meth:`from_index`) it opens nothing until data is read, then only the files
    holding the wanted bytes: their size and header checksum are checked when opened, and the
    checksums of the chunks read. Without an index (older checkpoints) headers are read for every
    file, sizes are checked for every file, and the full CRC-32 of a file is checked the first time
    data is read from it.
    """

    def __init__(self, files: Mapping[Path, tuple[int, Optional[int], Optional[int]]], workers: int = 1,
                 read_headers: bool = True) -> None:
        self.files = dict(files)
        self.workers = max(1, int(workers))
        self.pieces: dict[str, list[SavedPiece]] = defaultdict(list)
        self.extra: dict[Path, dict] = {}
        self.headers: dict[Path, tuple[int, int]] = {}  # indexed: file → (header bytes, header crc32)
        self._verified: set[Path] = set()
        self.chunk_bytes = CHUNK_BYTES
        if read_headers:
            for path, (writer, size, _) in sorted(self.files.items(), key=lambda kv: kv[1][0]):
                self._read_header(path, writer, size)

    @classmethod
    def from_index(cls, files: Mapping[Path, tuple[int, Optional[int], Optional[int]]], layouts: Mapping[Path, dict],
                   chunk_bytes: int = CHUNK_BYTES, workers: int = 1) -> "ShardIndex":
        """From the per-file layouts of a checkpoint index (:func:`byte_layout`); nothing is opened."""
        index = cls(files, workers, read_headers=False)
        index.chunk_bytes = int(chunk_bytes)
        for path in sorted(layouts, key=lambda p: files[p][0]):
            layout, writer = layouts[path], files[path][0]
            index.headers[path] = tuple(layout["header"])
            index.extra[path] = layout.get("extra", {})
            for key, (offsets, sizes, global_shape, dtype, lo, hi, crcs) in layout["pieces"].items():
                index.pieces[key].append(SavedPiece(path, writer, tuple(offsets), tuple(sizes), tuple(global_shape),
                                                    dtype, (int(lo), int(hi)), tuple(crcs)))
        return index

    def _read_header(self, path: Path, writer: int, size: Optional[int]) -> None:
        if not path.is_file():
            raise CheckpointError(f"checkpoint file missing: {path}")
        actual = path.stat().st_size
        if size is not None and actual != size:
            raise CheckpointError(f"checkpoint file truncated or corrupted: {path} has {actual} bytes, "
                                  f"expected {size}")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                header = json.loads(meta[HEADER_KEY])
                geometry = header["pieces"]
                for key in f.keys():
                    sl = f.get_slice(key)
                    g = geometry[key]
                    self.pieces[key].append(SavedPiece(path, writer, tuple(g["offsets"]), tuple(sl.get_shape()),
                                                       tuple(g["global_shape"]), sl.get_dtype()))
                self.extra[path] = header.get("extra", {})
        except CheckpointError:
            raise
        except Exception as err:  # safetensors raises its own error types; name the file
            raise CheckpointError(f"checkpoint file corrupted: {path} ({type(err).__name__}: "
                                  f"{str(err).splitlines()[0] if str(err) else 'unreadable header'})") from None

    def verify(self, paths: Iterable[Path]) -> None:
        todo = [p for p in set(paths) if p not in self._verified and self.files[p][2] is not None]

        def check(path: Path) -> None:
            if file_crc32(path) != self.files[path][2]:
                raise CheckpointError(f"checkpoint file corrupted: {path} fails its CRC-32 check")

        if self.workers > 1 and len(todo) > 1:
            with ThreadPoolExecutor(self.workers) as ex:
                list(ex.map(check, todo))
        else:
            for p in todo:
                check(p)
        self._verified.update(todo)

    def keys(self) -> set[str]:
        return set(self.pieces)

    def global_shape(self, key: str) -> tuple[int, ...]:
        return self.pieces[key][0].global_shape

    # -- planning -------------------------------------------------------------------------------
    def plan(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], prefer: int) -> list[tuple]:
        """Reads that fill the target region ``[offsets, offsets+sizes)`` of tensor ``key``:
        ``(saved piece, source slices, target slices)``. Pieces saved more than once (replicas) are
        read once, preferring the copy written by rank ``prefer``."""
        seen: dict[tuple, SavedPiece] = {}
        for sp in sorted(self.pieces[key], key=lambda s: (s.writer != prefer, s.writer)):
            seen.setdefault((sp.offsets, sp.sizes), sp)
        reads = []
        covered = 0
        for sp in seen.values():
            src, dst, n = [], [], 1
            for o, s, so, ss in zip(offsets, sizes, sp.offsets, sp.sizes):
                lo, hi = max(o, so), min(o + s, so + ss)
                if hi <= lo:
                    n = 0
                    break
                src.append(slice(lo - so, hi - so))
                dst.append(slice(lo - o, hi - o))
                n *= hi - lo
            if n:
                reads.append((sp, tuple(src), tuple(dst)))
                covered += n
        if covered != math.prod(sizes):
            raise CheckpointError(f"checkpoint {self._where(key)} does not cover tensor {key!r} "
                                  f"(offsets {list(offsets)}, sizes {list(sizes)}): missing or overlapping pieces")
        return reads

    def _where(self, key: str) -> str:
        paths = {sp.file.parent for sp in self.pieces.get(key, [])}
        return str(next(iter(paths))) if len(paths) == 1 else "directory"

    # -- reading --------------------------------------------------------------------------------
    def read(self, jobs: list[tuple[str, torch.Tensor, tuple[int, ...], int]]) -> None:
        """``jobs``: (key, target local tensor, target offsets, preferred writer). Fills the targets."""
        per_file: dict[Path, list] = defaultdict(list)
        for key, target, offsets, prefer in jobs:
            if target.dim() > 0 and target.numel() == 0:
                continue
            for sp, src, dst in self.plan(key, offsets, tuple(target.shape), prefer):
                per_file[sp.file].append((key, sp, src, target, dst))
        self.verify(p for p in per_file if p not in self.headers)

        def read_file(path: Path) -> None:
            try:
                if path in self.headers:
                    self._read_ranges(path, per_file[path])
                    return
                with safe_open(str(path), framework="pt") as f:
                    for key, _, src, target, dst in per_file[path]:
                        data = f.get_slice(key)[src] if src else f.get_tensor(key)
                        target[dst].copy_(data)
            except CheckpointError:
                raise
            except Exception as err:
                raise CheckpointError(f"checkpoint file corrupted: {path} ({type(err).__name__}: "
                                      f"{str(err).splitlines()[0] if str(err) else 'unreadable'})") from None

        if self.workers > 1 and len(per_file) > 1:
            with ThreadPoolExecutor(self.workers) as ex:
                list(ex.map(read_file, list(per_file)))
        else:
            for path in per_file:
                read_file(path)

    def _read_ranges(self, path: Path, reads: list) -> None:
        """Indexed read: one open, the file's header checked against its checksum, then for each
        piece the whole chunks covering the rows it needs, each checked against its checksum."""
        _, size, _ = self.files[path]
        with open(path, "rb", buffering=0) as f:
            actual = os.fstat(f.fileno()).st_size
            if size is not None and actual != size:
                raise CheckpointError(f"checkpoint file truncated or corrupted: {path} has {actual} bytes, "
                                      f"expected {size}")
            head_len, head_crc = self.headers[path]
            if zlib.crc32(_pread(f, 0, head_len)) != head_crc:
                raise CheckpointError(f"checkpoint file corrupted: {path}: its header fails its CRC-32 check")
            for _, sp, src, target, dst in reads:
                target[dst].copy_(_read_piece_region(f, path, sp, src, self.chunk_bytes))


def _pread(f, offset: int, n: int) -> bytes:
    f.seek(offset)
    data = f.read(n)
    if len(data) != n:
        raise CheckpointError(f"checkpoint file truncated or corrupted: {f.name} ends before byte {offset + n}")
    return data


def _read_piece_region(f, path: Path, sp: SavedPiece, src: tuple, chunk: int) -> torch.Tensor:
    """``saved piece[src]`` read from ``f``: the rows ``src[0]`` of the piece (contiguous bytes),
    rounded out to whole checksum chunks, each chunk checked."""
    from safetensors.torch import _getdtype  # safetensors' own dtype table

    dtype = _getdtype(sp.dtype)
    item = torch.empty((), dtype=dtype).element_size()
    lo, hi = sp.span
    if sp.sizes:
        rows = src[0] if src else slice(0, sp.sizes[0])
        row_bytes = math.prod(sp.sizes[1:]) * item
        first, last = lo + rows.start * row_bytes, lo + rows.stop * row_bytes
    else:
        first, last = lo, hi
    c0, c1 = (first - lo) // chunk, -(-(last - lo) // chunk)
    base = lo + c0 * chunk
    data = memoryview(_pread(f, base, min(hi, lo + c1 * chunk) - base))
    for c in range(c0, max(c1, c0 + 1)):
        part = data[(c - c0) * chunk: (c - c0 + 1) * chunk]
        if c >= len(sp.crcs) or zlib.crc32(part) != sp.crcs[c]:
            raise CheckpointError(f"checkpoint file corrupted: {path}: bytes {lo + c * chunk}.."
                                  f"{lo + c * chunk + len(part)} fail their CRC-32 check")
    region = data[first - base: last - base]
    if not sp.sizes:
        return torch.frombuffer(bytearray(region), dtype=dtype).reshape(())
    t = torch.frombuffer(bytearray(region), dtype=dtype) if len(region) else torch.empty(0, dtype=dtype)
    t = t.reshape(rows.stop - rows.start, *sp.sizes[1:])
    return t[(slice(None), *src[1:])] if src else t


def check_shapes(index: ShardIndex, targets: Mapping[str, Piece], what: str, where: Path,
                 strict_unexpected: bool = True) -> None:
    """One error naming every missing, unexpected or differently shaped tensor."""
    missing = sorted(k for k in targets if k not in index.pieces)
    unexpected = sorted(k for k in index.pieces if k not in targets) if strict_unexpected else []
    mismatched = [f"{k}: checkpoint {list(index.global_shape(k))} vs model {list(p.global_shape)}"
                  for k, p in sorted(targets.items()) if k in index.pieces and index.global_shape(k) != p.global_shape]
    problems = []
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatch(es): " + "; ".join(mismatched[:8])
                        + (" ..." if len(mismatched) > 8 else ""))
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing from the checkpoint: " + ", ".join(missing[:8])
                        + (" ..." if len(missing) > 8 else ""))
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s) in the checkpoint: " + ", ".join(unexpected[:8])
                        + (" ..." if len(unexpected) > 8 else ""))
    if problems:
        raise CheckpointError(f"{what} in {where} does not match the model: " + " | ".join(problems))


# ----------------------------------------------------------------------------------------------
# load_balanced: one replica reads, the others receive
# ----------------------------------------------------------------------------------------------
def reader_coordinates(key: str, piece: Piece) -> Optional[dict[int, int]]:
    """For a DTensor piece replicated over mesh dims, the coordinate along each of those dims of
    the replica that reads it (spread by a hash of the name). None: every holder reads."""
    if piece.mesh is None or not piece.replicated_dims:
        return None
    h = zlib.crc32(key.encode())
    return {d: h % piece.mesh.size(d) for d in piece.replicated_dims}


def is_reader(piece: Piece, coords: Optional[dict[int, int]]) -> bool:
    if coords is None:
        return True
    mine = piece.mesh.get_coordinate()
    return all(mine[d] == c for d, c in coords.items())


def broadcast_replicas(key: str, piece: Piece, coords: dict[int, int]) -> None:
    """After the chosen replica read ``piece``, copy it to every other replica, one mesh dim at a
    time (after dim k, every rank whose coordinates on the remaining dims match holds the data)."""
    local = piece.local
    buf = local if local.is_contiguous() else local.contiguous()
    for d, c in coords.items():
        group = piece.mesh.get_group(d)
        dist.broadcast(buf, src=dist.get_global_rank(group, c), group=group)
    if buf is not local:
        local.copy_(buf)


def plain_reader(key: str, world: int) -> int:
    return zlib.crc32(key.encode()) % world
