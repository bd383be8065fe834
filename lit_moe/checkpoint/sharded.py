"""Tensor shards on disk: what each rank writes, and how any layout reads them back.

Every rank writes the local pieces ("chunks") of its tensors into one safetensors file, with the
piece's offsets inside the global tensor and the global shape in the file header. A DTensor's piece
is its local shard (FSDP2, tensor and expert parallel, on any mesh); a plain tensor is a piece that
covers the whole tensor. Reading is layout-independent: for each tensor it wants, a rank computes
its own piece of the global tensor and copies the overlapping regions of the saved pieces into it,
so a checkpoint written by one layout loads into another (dp2 → tp2, ep2 or one process).

Files are parsed by safetensors only (no pickle): loading never runs code from a file.
"""

from __future__ import annotations

import json
import math
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


def assign_writers(comm: Comm, pieces: Mapping[str, Piece]) -> set[str]:
    """``remove_redundancy``: the keys this rank writes so that every distinct piece (same tensor,
    same offsets and sizes) is written by exactly one of the ranks holding it, spreading the bytes
    over them (largest pieces first, each to the least-loaded holder)."""
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
        for ident in sorted(holders, key=lambda i: (-nbytes[i], i[0], i[1])):
            writer = min(holders[ident], key=lambda r: (load[r], r))
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


def write_pieces(path: Path, pieces: Mapping[str, Piece], extra: Optional[dict] = None) -> tuple[int, int]:
    """One safetensors file with the pieces and their geometry. Returns (size, crc32)."""
    tensors = {}
    geometry = {}
    for key, p in pieces.items():
        if p.local.numel() == 0 and math.prod(p.global_shape) > 0:
            continue  # an empty shard (uneven sharding) carries nothing
        tensors[key] = p.local.detach().to("cpu").contiguous()
        geometry[key] = {"offsets": list(p.offsets), "global_shape": list(p.global_shape)}
    header = {"version": 1, "pieces": geometry, "extra": extra or {}}
    data = safetensors_save(tensors, metadata={HEADER_KEY: json.dumps(header)})
    return write_bytes_durable(path, data)


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


class ShardIndex:
    """Where every saved piece of every tensor is, from the headers of a set of files.

    ``files`` maps file path → (writer rank, expected size, expected crc32 or None). Headers are read
    for every file (cheap); sizes are checked for every file; the full CRC-32 of a file is checked
    the first time data is read from it.
    """

    def __init__(self, files: Mapping[Path, tuple[int, Optional[int], Optional[int]]], workers: int = 1) -> None:
        self.files = dict(files)
        self.workers = max(1, int(workers))
        self.pieces: dict[str, list[SavedPiece]] = defaultdict(list)
        self.extra: dict[Path, dict] = {}
        self._verified: set[Path] = set()
        for path, (writer, size, _) in sorted(self.files.items(), key=lambda kv: kv[1][0]):
            self._read_header(path, writer, size)

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
                per_file[sp.file].append((key, src, target, dst))
        self.verify(per_file)

        def read_file(path: Path) -> None:
            try:
                with safe_open(str(path), framework="pt") as f:
                    for key, src, target, dst in per_file[path]:
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
