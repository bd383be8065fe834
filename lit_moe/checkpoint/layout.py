"""Names and atomic file operations of the checkpoint layout.

::

    save_path/
      latest_checkpointed_iteration.txt          the step of the newest complete checkpoint
      iteration_00000100/
        common.json                              step, data position, Lightning state, file digests
        index.json                               where every piece's bytes lie, CRC-32 per chunk
        {prefix}-model-{rank:07d}-{world:07d}.safetensors
        {prefix}-opt-{rank:07d}-{world:07d}.safetensors      (absent with no_save_optim)
        {prefix}-rng-{rank:07d}-{world:07d}.json
      .iteration_00000200.tmp/                   a save in progress (never loaded)

A save writes into the hidden temporary directory, renames it into place once every rank has written
and ``common.json`` lists every file with its size and CRC-32, and only then replaces the tracker
(temporary file + fsync + ``os.replace``). A process killed at any point therefore leaves the
previous checkpoint and the tracker pointing at it untouched.
"""

from __future__ import annotations

import os
import re
import zlib
from pathlib import Path
from typing import Optional

from lit_moe.config import ConfigError

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = "common.json"
INDEX = "index.json"
INDEX_FORMAT = "lit_moe-index"
FORMAT = "lit_moe-checkpoint"
FORMAT_VERSION = 1
ITERATION_RE = re.compile(r"^iteration_(\d{8,})$")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used: missing, truncated, corrupted or of another model.
    The message is one line naming the file (and the tensors, for shape mismatches)."""


def iteration_name(step: int) -> str:
    return f"iteration_{int(step):08d}"


def temp_name(step: int) -> str:
    return f".{iteration_name(step)}.tmp"


def shard_name(kind: str, rank: int, world: int, prefix: Optional[str], ext: str = "safetensors") -> str:
    """``{prefix}-{kind}-{rank:07d}-{world:07d}.{ext}`` (MindFormers' naming; no prefix when null/empty)."""
    stem = f"{kind}-{rank:07d}-{world:07d}.{ext}"
    return f"{prefix}-{stem}" if prefix else stem


def fsync_dir(path: Path) -> None:
    """Make a rename/creation inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes_durable(path: Path, data: bytes) -> tuple[int, int]:
    """Write ``data`` to ``path`` and fsync it. Returns (size, crc32)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data), zlib.crc32(data)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` atomically: temporary file, fsync, ``os.replace``, fsync of the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    write_bytes_durable(tmp, text.encode())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def file_crc32(path: Path, block: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(block)
            if not chunk:
                return crc
            crc = zlib.crc32(chunk, crc)


def read_tracker(save_path: Path) -> int:
    """The step named by ``save_path/latest_checkpointed_iteration.txt``."""
    tracker = Path(save_path) / TRACKER
    if tracker.exists() and not tracker.is_file():  # a FIFO would block the read forever
        raise CheckpointError(f"checkpoint.load_path: the tracker {tracker} is not a regular file")
    try:
        with open(tracker, "rb") as f:
            text = f.read(4096).decode("utf-8").strip()   # a step number; a huge file is not read whole
    except OSError as err:
        raise CheckpointError(f"checkpoint.load_path: cannot read the tracker {tracker}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"checkpoint.load_path: the tracker {tracker} holds bytes that are not text; it "
                              "should hold the step number of the newest checkpoint") from None
    if not text:
        raise CheckpointError(f"checkpoint.load_path: the tracker {tracker} is empty")
    if not text.isdigit():
        raise CheckpointError(f"checkpoint.load_path: the tracker {tracker} does not hold a step number: {text[:40]!r}")
    return int(text)


def write_tracker(save_path: Path, step: int) -> None:
    atomic_write_text(Path(save_path) / TRACKER, f"{int(step)}\n")


def list_iterations(save_path: Path) -> list[int]:
    """Steps of the complete iteration directories under ``save_path`` (temporary ones excluded)."""
    steps = []
    try:
        entries = list(Path(save_path).iterdir())
    except OSError:
        return []
    for entry in entries:
        m = ITERATION_RE.match(entry.name)
        if m and entry.is_dir():
            steps.append(int(m.group(1)))
    return sorted(steps)
