"""One iteration directory: writing it crash-safely, reading it back into any layout.

Writing (:func:`prepare`, then :func:`write_and_commit` on every rank, possibly in a background
thread) and reading (:class:`IterationReader`, :func:`load_module`, :func:`load_optimizers`) know
nothing about Lightning; :mod:`lit_moe.checkpoint.callback` and :mod:`lit_moe.checkpoint.resume`
connect them to the Trainer.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lit_moe.checkpoint import safejson
from lit_moe.checkpoint.comm import Comm
from lit_moe.checkpoint.layout import (
    COMMON,
    FORMAT,
    FORMAT_VERSION,
    INDEX,
    INDEX_FORMAT,
    CheckpointError,
    atomic_write_text,
    fsync_dir,
    iteration_name,
    shard_name,
    temp_name,
    write_bytes_durable,
    write_tracker,
)
from lit_moe.checkpoint.sharded import (
    Piece,
    ShardIndex,
    broadcast_replicas,
    canonical,
    check_shapes,
    is_reader,
    pieces_of,
    plain_reader,
    reader_coordinates,
    write_pieces,
)
from lit_moe.checkpoint import sharded


# ----------------------------------------------------------------------------------------------
# RNG of this process
# ----------------------------------------------------------------------------------------------
def _accelerator_module():
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if acc is None or acc.type == "cpu" or not torch.accelerator.is_available():
        return None, None
    return acc.type, torch.get_device_module(acc.type)


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and accelerator generators of this process."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    kind, mod = _accelerator_module()
    if mod is not None:
        getter = getattr(mod, "get_rng_state_all", None)
        state["accelerator"] = {"type": kind, "states": getter() if getter else [mod.get_rng_state()]}
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    acc = state.get("accelerator")
    kind, mod = _accelerator_module()
    if acc is not None and mod is not None and acc["type"] == kind:
        setter = getattr(mod, "set_rng_state_all", None)
        if setter is not None and len(acc["states"]) == mod.device_count():
            setter(acc["states"])
        else:
            mod.set_rng_state(acc["states"][0])


# ----------------------------------------------------------------------------------------------
# flattening optimizer states into named tensors
# ----------------------------------------------------------------------------------------------
def fqn_optimizer_state(osd: dict, optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> dict:
    """Key an optimizer state dict by parameter names. ``torch.optim.Optimizer.state_dict`` numbers the
    parameters of its groups in order; DCP's ``get_optimizer_state_dict`` already uses names."""
    groups = osd["param_groups"]
    if all(isinstance(p, str) for g in groups for p in g["params"]):
        return {
            "state": {canonical(k): s for k, s in osd["state"].items()},
            "param_groups": [{**g, "params": [canonical(p) for p in g["params"]]} for g in groups],
        }
    names = {id(p): canonical(n) for n, p in module.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    return {
        "state": {order[i]: s for i, s in osd["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in groups],
    }


def split_optimizer_state(index: int, osd: dict) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``{"{index}/{param}/{state}": tensor}`` and the non-tensor per-parameter states."""
    tensors, other = {}, {}
    for fqn, st in osd["state"].items():
        for name, value in st.items():
            key = f"{index}/{fqn}/{name}"
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            else:
                other[key] = value
    return tensors, other


def param_groups_without_state(osd: dict) -> list[dict]:
    return [dict(g) for g in osd["param_groups"]]


# ----------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------
@dataclass
class SaveJob:
    """Everything one rank writes for one iteration (tensors already staged when asynchronous)."""

    save_path: Path
    step: int
    prefix: Optional[str]
    model: dict[str, Piece]
    optim: Optional[dict[str, Piece]]
    optim_extra: dict[str, Any] = field(default_factory=dict)
    rng_json: str = ""
    common: Optional[dict] = None  # rank 0: the body of common.json, without the file digests
    on_committed: Optional[Callable[[int], None]] = None  # rank 0, after the tracker is replaced
    most_bytes: int = 0   # the tensor bytes of the rank that writes the most (from prepare)

    @property
    def nbytes(self) -> int:
        """The tensor bytes this rank writes."""
        pieces = list(self.model.values()) + list((self.optim or {}).values())
        return sum(p.local.numel() * p.local.element_size() for p in pieces)


SAVE_BYTES_PER_S_FLOOR = 25 * 2 ** 20
"""The slowest write rate a rank is granted for its share of a save (25 MiB/s: one rank's part of a
busy shared file system): the ranks that finish first wait for the rank with the most bytes for
the collective timeout plus that many seconds (8.2 TB over 2,048 ranks: 4 GB each, 160 s more)."""


def save_timeout(collective_timeout: Optional[timedelta], most_bytes: int) -> timedelta:
    """How long a rank waits, after writing its files, for the others: sized from the checkpoint."""
    base = collective_timeout if collective_timeout is not None else timedelta(minutes=30)   # torch's default
    return base + timedelta(seconds=most_bytes / SAVE_BYTES_PER_S_FLOOR)


def prepare(comm: Comm, save_path: Path, step: int, nbytes: int = 0) -> int:
    """Rank 0 creates a fresh temporary directory for ``step`` (removing the debris of a killed
    save); the other ranks wait for it. Returns the most tensor bytes any rank writes (``nbytes``:
    this rank's), exchanged in the same collective."""
    if comm.rank == 0:
        save_path.mkdir(parents=True, exist_ok=True)
        tmp = save_path / temp_name(step)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    return max(comm.all_gather(int(nbytes)))


def write_and_commit(comm: Comm, job: SaveJob) -> Path:
    """Every rank writes its files; rank 0 then writes ``common.json``, renames the directory into
    place and replaces the tracker. Raises on every rank if any rank failed."""
    tmp = job.save_path / temp_name(job.step)
    rank, world = comm.rank, comm.world
    digests: dict[str, Any] = {}
    error = None
    try:
        name = shard_name("model", rank, world, job.prefix)
        digests[name] = {"kind": "model", "rank": rank, **_digest(*write_pieces(tmp / name, job.model))}
        if job.optim is not None:
            name = shard_name("opt", rank, world, job.prefix)
            extra = {"nontensor_state": safejson.encode(job.optim_extra)}
            digests[name] = {"kind": "opt", "rank": rank, **_digest(*write_pieces(tmp / name, job.optim, extra))}
        name = shard_name("rng", rank, world, job.prefix, ext="json")
        digests[name] = {"kind": "rng", "rank": rank, **_digest(*write_bytes_durable(tmp / name, job.rng_json.encode()))}
    except Exception as err:  # report to rank 0 instead of leaving the others hanging in gather
        error = f"rank {rank}: {type(err).__name__}: {err}"
    # The ranks that finished wait for the slowest writer for a time sized from the checkpoint, not
    # for the collective timeout (600 s for an 8.2 TB save would fail every large save).
    comm.wait_for_all(save_timeout(comm.timeout, max(job.most_bytes, job.nbytes)))
    gathered = comm.gather((digests, error))

    status = None
    final = job.save_path / iteration_name(job.step)
    if comm.rank == 0:
        errors = [e for _, e in gathered if e]
        if errors:
            status = "; ".join(errors)
        else:
            try:
                files = {}
                for d, _ in gathered:
                    files.update(d)
                _commit(job, tmp, final, files)
            except Exception as err:
                status = f"rank 0: {type(err).__name__}: {err}"
    status = comm.broadcast(status)
    if status:
        if comm.rank == 0:  # every rank has stopped writing: nothing of this save is left behind
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"saving checkpoint {final} failed: {status}")
    return final


def _digest(size: int, crc: int, layout: Optional[dict] = None) -> dict[str, Any]:
    return {"size": size, "crc32": crc, **({"layout": layout} if layout is not None else {})}


def write_index(tmp: Path, files: dict) -> dict:
    """Move the byte layouts out of the file digests into ``index.json`` (one file any rank reads to
    find the bytes it needs); returns the index's own digest, listed in ``common.json``."""
    layouts = {name: info.pop("layout") for name, info in files.items() if "layout" in info}
    body = {"format": INDEX_FORMAT, "version": 1, "chunk_bytes": sharded.CHUNK_BYTES, "files": layouts}
    size, crc = write_bytes_durable(tmp / INDEX, json.dumps(body, separators=(",", ":")).encode())
    return {"kind": "index", "rank": 0, "size": size, "crc32": crc}


def _commit(job: SaveJob, tmp: Path, final: Path, files: dict) -> None:
    common = dict(job.common or {})
    files[INDEX] = write_index(tmp, files)
    common["files"] = files
    atomic_write_text(tmp / COMMON, dump_common(common))
    fsync_dir(tmp)
    old = None
    if final.exists():  # the same step saved before (an earlier run): swap it out
        old = job.save_path / f".{final.name}.old.{os.getpid()}"
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(job.save_path)
    write_tracker(job.save_path, job.step)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if job.on_committed is not None:
        job.on_committed(job.step)


def _body_crc(body: dict) -> int:
    # json.loads keeps the key order and floats round-trip exactly, so re-serialising what was read
    # reproduces the text that was checksummed
    return zlib.crc32(json.dumps(body, allow_nan=True).encode())


def dump_common(common: dict) -> str:
    """JSON with a CRC-32 of its own body, so a damaged file is detected."""
    body = {k: v for k, v in common.items() if k != "crc32"}
    return json.dumps({**body, "crc32": _body_crc(body)}, indent=1, allow_nan=True)


def make_common(step: int, world: int, prefix: Optional[str], has_optimizer: bool, *, trainer_state: Any = None,
                optimizers: Optional[list] = None, extra: Optional[dict] = None) -> dict:
    import lit_moe

    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "iteration": int(step),
        "global_step": int(step),
        "world_size": int(world),
        "prefix": prefix,
        "has_optimizer": bool(has_optimizer),
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "lit_moe_version": getattr(lit_moe, "__version__", "?"),
        "torch_version": torch.__version__,
        "trainer_state": safejson.encode(trainer_state or {}),
        "optimizers": safejson.encode(optimizers or []),
        **(extra or {}),
    }


# ----------------------------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------------------------
class IterationReader:
    """A complete iteration directory, validated on open (format, ``common.json`` checksum, every
    listed file present with its size)."""

    def __init__(self, path: Path, workers: int = 1) -> None:
        self.path = Path(path)
        self.workers = workers
        common_path = self.path / COMMON
        if not common_path.is_file():
            raise CheckpointError(f"not a lit_moe checkpoint: {common_path} is missing")
        try:
            raw = json.loads(common_path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise CheckpointError(f"checkpoint file corrupted: {common_path} ({type(err).__name__})") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise CheckpointError(f"not a lit_moe checkpoint: {common_path} has no format {FORMAT!r}")
        body = {k: v for k, v in raw.items() if k != "crc32"}
        if raw.get("crc32") != _body_crc(body):
            raise CheckpointError(f"checkpoint file corrupted: {common_path} fails its CRC-32 check")
        if int(raw.get("version", 0)) > FORMAT_VERSION:
            raise CheckpointError(f"checkpoint {self.path} has format version {raw['version']}; this lit_moe reads "
                                  f"up to {FORMAT_VERSION}")
        self.common = raw
        files = raw.get("files")
        if not isinstance(files, dict):
            raise CheckpointError(f"checkpoint file corrupted: {common_path} has no list of files")
        self.files: dict[str, dict] = files
        for name, info in self.files.items():
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..", COMMON):
                raise CheckpointError(f"checkpoint file corrupted: {common_path} names {name!r}, not a file of "
                                      f"{self.path}")
            if not isinstance(info, dict) or not {"kind", "rank", "size", "crc32"} <= set(info):
                raise CheckpointError(f"checkpoint file corrupted: {common_path} has no size/CRC-32 entry for {name}")
        self.indexed = INDEX in self.files   # older checkpoints have no index.json
        self._layouts: Optional[tuple[int, dict]] = None
        if self.indexed:
            return   # files are checked when opened: a rank touches only those it reads
        for name, info in self.files.items():
            p = self.path / name
            if not p.is_file():
                raise CheckpointError(f"checkpoint file missing: {p}")
            if p.stat().st_size != info["size"]:
                raise CheckpointError(f"checkpoint file truncated or corrupted: {p} has {p.stat().st_size} bytes, "
                                      f"expected {info['size']}")

    @property
    def step(self) -> int:
        return int(self.common["iteration"])

    @property
    def world_size(self) -> int:
        return int(self.common["world_size"])

    @property
    def has_optimizer(self) -> bool:
        return bool(self.common["has_optimizer"])

    def _files(self, kind: str) -> dict[Path, tuple[int, int, int]]:
        return {self.path / n: (i["rank"], i["size"], i["crc32"]) for n, i in self.files.items() if i["kind"] == kind}

    def index(self, kind: str) -> ShardIndex:
        if not self.indexed:
            return ShardIndex(self._files(kind), workers=self.workers)
        chunk, layouts = self.layouts()
        files = self._files(kind)
        try:
            mine = {p: layouts[p.name] for p in files}
        except KeyError as err:
            raise CheckpointError(f"checkpoint file corrupted: {self.path / INDEX} has no entry for {err.args[0]}") from None
        return ShardIndex.from_index(files, mine, chunk_bytes=chunk, workers=self.workers)

    def layouts(self) -> tuple[int, dict]:
        """(chunk bytes, file name → byte layout) from ``index.json``, read once and checked whole."""
        if self._layouts is None:
            path = self.path / INDEX
            data = self._read_listed(INDEX)
            try:
                body = json.loads(data)
                if body.get("format") != INDEX_FORMAT:
                    raise ValueError(f"no format {INDEX_FORMAT!r}")
                self._layouts = (int(body["chunk_bytes"]), body["files"])
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise CheckpointError(f"checkpoint file corrupted: {path} ({type(err).__name__}: {err})") from None
        return self._layouts

    def _read_listed(self, name: str) -> bytes:
        """A small file listed in ``common.json``, read whole and checked against its size and CRC-32."""
        path, info = self.path / name, self.files[name]
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file missing: {path}") from None
        except OSError as err:
            raise CheckpointError(f"checkpoint file unreadable: {path} ({err.strerror})") from None
        if len(data) != info["size"]:
            raise CheckpointError(f"checkpoint file truncated or corrupted: {path} has {len(data)} bytes, "
                                  f"expected {info['size']}")
        if zlib.crc32(data) != info["crc32"]:
            raise CheckpointError(f"checkpoint file corrupted: {path} fails its CRC-32 check")
        return data

    def trainer_state(self) -> dict:
        return safejson.decode(self.common.get("trainer_state", {}))

    def optimizer_groups(self) -> list[list[dict]]:
        return safejson.decode(self.common.get("optimizers", []))

    def rng_state(self, rank: int, world: int) -> Optional[dict]:
        """This rank's RNG state if the checkpoint was written by the same number of ranks."""
        if world != self.world_size:
            return None
        for name, info in self.files.items():
            if info["kind"] == "rng" and info["rank"] == rank:
                path = self.path / name
                data = self._read_listed(name)
                try:
                    return safejson.loads(data.decode())
                except ValueError as err:
                    raise CheckpointError(f"checkpoint file corrupted: {path} ({err})") from None
        return None


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def fill(index: ShardIndex, targets: Mapping[str, Piece], balanced: bool = False) -> None:
    """Copy the saved data into the target pieces (in place). ``balanced``: one replica reads each
    replicated piece and broadcasts it to the others (``checkpoint.load_balanced``)."""
    rank, world = _rank_world()
    jobs, fanout = [], []
    for key in sorted(targets):
        p = targets[key]
        if balanced and world > 1:
            if p.mesh is None:  # a plain tensor: the same on every rank
                src = plain_reader(key, world)
                if rank == src:
                    jobs.append((key, p.local, p.offsets, rank))
                fanout.append((key, p, src))
                continue
            coords = reader_coordinates(key, p)
            if coords is not None:
                if is_reader(p, coords):
                    jobs.append((key, p.local, p.offsets, rank))
                fanout.append((key, p, coords))
                continue
        jobs.append((key, p.local, p.offsets, rank))
    index.read(jobs)
    for key, p, how in fanout:
        if isinstance(how, int):
            buf = p.local if p.local.is_contiguous() else p.local.contiguous()
            dist.broadcast(buf, src=how)
            if buf is not p.local:
                p.local.copy_(buf)
        else:
            broadcast_replicas(key, p, how)


def _prefix_map(live_keys: Sequence[str], saved_keys: set[str], where: Path) -> dict[str, str]:
    """live key → saved key. Checkpoints name tensors as the LightningModule does (``model.layers…``);
    a bare model (``layers…``) finds them under the one prefix that matches every key."""
    live = list(live_keys)
    if not live or all(k in saved_keys for k in live):
        return {k: k for k in live}
    first = live[0]
    candidates = {s[: len(s) - len(first)] for s in saved_keys
                  if s.endswith(first) and (len(s) == len(first) or s[len(s) - len(first) - 1] == ".")}
    for prefix in sorted(candidates, key=len):
        if all(prefix + k in saved_keys for k in live):
            return {k: prefix + k for k in live}
    return {k: k for k in live}  # let check_shapes name what is missing


def load_module(module: torch.nn.Module, reader: IterationReader, balanced: bool = False,
                whole_model: bool = True) -> None:
    """Load the model tensors of ``reader`` into ``module`` (any layout; DTensors or plain tensors).
    Every tensor must be present with the same global shape, and the checkpoint (under the module's
    prefix) must hold nothing else, unless ``whole_model`` is False: this rank holds part of the
    model (:attr:`lit_moe.step.StepStrategy.holds_whole_model`), the other tensors are the other
    ranks' to load (the whole checkpoint was checked against the whole model before launching)."""
    from lit_moe.lora import keep_initialised_adapters

    sd = get_model_state_dict(module)
    index = reader.index("model")
    live = keep_initialised_adapters(pieces_of(sd), index.keys())  # canonical names
    mapping = _prefix_map(list(live), index.keys(), reader.path)
    prefix = _common_prefix(mapping)
    targets = {mapping[k]: p for k, p in live.items()}
    view = _SubIndex(index, {k for k in index.keys() if k.startswith(prefix)})
    check_shapes(view, targets, "the model weights", reader.path, strict_unexpected=whole_model)
    fill(index, targets, balanced)
    set_model_state_dict(module, sd)


def _common_prefix(mapping: Mapping[str, str]) -> str:
    for live, saved in mapping.items():
        return saved[: len(saved) - len(live)]
    return ""


class _SubIndex:
    """A read-only view of an index restricted to some keys (for shape checks)."""

    def __init__(self, index: ShardIndex, keys: set[str]) -> None:
        self.pieces = {k: index.pieces[k] for k in keys}

    def global_shape(self, key: str) -> tuple[int, ...]:
        return self.pieces[key][0].global_shape


def load_optimizers(module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], reader: IterationReader,
                    balanced: bool = False, whole_model: bool = True) -> None:
    """Load optimizer states and hyper-parameters (learning rate included) into live optimizers
    (``whole_model``: as :func:`load_module`)."""
    if not reader.has_optimizer:
        raise CheckpointError(f"no_load_optim is False but no optimizer checkpoint found in {reader.path} "
                              "(it was saved with no_save_optim: True); set checkpoint.no_load_optim: True")
    saved_groups = reader.optimizer_groups()
    if len(saved_groups) != len(optimizers):
        raise CheckpointError(f"checkpoint {reader.path} holds {len(saved_groups)} optimizer(s), the run has "
                              f"{len(optimizers)}")
    index = reader.index("opt")
    nontensor: dict[str, Any] = {}
    for extra in index.extra.values():
        nontensor.update(safejson.decode(extra.get("nontensor_state", {})))
    for i, opt in enumerate(optimizers):
        osd = get_optimizer_state_dict(module, opt)  # creates the state of a fresh optimizer
        osd = fqn_optimizer_state(osd, opt, module)  # canonical names (same tensors)
        tensors, _ = split_optimizer_state(i, osd)
        targets = pieces_of(tensors)
        view = _SubIndex(index, {k for k in index.keys() if k.startswith(f"{i}/")})
        check_shapes(view, targets, f"optimizer {i} state", reader.path, strict_unexpected=whole_model)
        fill(index, targets, balanced)
        for fqn, st in osd["state"].items():
            for name in list(st):
                key = f"{i}/{fqn}/{name}"
                if not isinstance(st[name], torch.Tensor) and key in nontensor:
                    st[name] = nontensor[key]
        live_groups = osd["param_groups"]
        saved = saved_groups[i]
        # the live groups may hold a subset of the saved names (part of the model: each rank its own)
        if len(saved) != len(live_groups) or any(not set(g["params"]) <= set(s["params"])
                                                 for s, g in zip(saved, live_groups)):
            raise CheckpointError(f"optimizer {i} in {reader.path} has different parameter groups than the run "
                                  f"({[len(s['params']) for s in saved]} vs {[len(g['params']) for g in live_groups]} "
                                  "parameters per group)")
        osd["param_groups"] = [{**s, "params": g["params"]} for s, g in zip(saved, live_groups)]
        set_optimizer_state_dict(module, opt, osd)


def full_state(reader: IterationReader, kind: str = "model") -> dict[str, torch.Tensor]:
    """Every tensor of ``kind`` assembled whole on the CPU (one process: conversion, inspection)."""
    from safetensors.torch import _getdtype  # safetensors' own dtype table

    index = reader.index(kind)
    out = {}
    jobs = []
    for key in sorted(index.keys()):
        sp = index.pieces[key][0]
        t = torch.empty(sp.global_shape, dtype=_getdtype(sp.dtype))
        out[key] = t
        jobs.append((key, t, (0,) * t.dim(), 0))
    index.read(jobs)
    return out
