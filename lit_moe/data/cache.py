"""Build-once caches shared by every rank: one process builds under a file lock, the others wait and
then load what it wrote. Files are written under temporary names and renamed, so a reader never sees
a half-written file, and a lock held by a process that died is released by the operating system."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import time
import uuid
import zlib
from typing import Callable, Optional

import numpy as np

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None


# flock errors of file systems without working locks (NFS without its lock daemon, some FUSE mounts).
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}


@contextlib.contextmanager
def file_lock(path: str, timeout_s: float = 3600.0):
    """Exclusive lock on ``path`` (created if missing) across processes on this machine and on shared
    file systems whose ``flock`` works across hosts. Where ``flock`` is missing or refused, an
    exclusive-create marker file (``O_EXCL``, atomic on NFS v3+ and parallel file systems) is polled
    instead; a marker older than ``timeout_s`` (its holder died) is taken over."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if fcntl is not None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as err:
                if err.errno not in _NO_FLOCK:
                    raise
            else:
                try:
                    yield
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                return
        finally:
            os.close(fd)
    with _marker_lock(path + ".excl", timeout_s):
        yield


@contextlib.contextmanager
def _marker_lock(marker: str, timeout_s: float):
    while True:
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            try:
                if time.time() - os.stat(marker).st_mtime > timeout_s:
                    os.remove(marker)
                    continue
            except FileNotFoundError:
                continue    # released meanwhile
            time.sleep(0.1)
    try:
        yield
    finally:
        os.close(fd)
        os.remove(marker)


def _temp_name(path: str) -> str:
    """A temporary name no other process uses, on any host (pids repeat across nodes)."""
    return f"{path}.tmp{os.getpid()}-{uuid.uuid4().hex[:12]}"


def atomic_save_npy(path: str, array: np.ndarray) -> None:
    tmp = _temp_name(path) + ".npy"
    np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)


def atomic_write_text(path: str, text: str) -> None:
    tmp = _temp_name(path)
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def description_hash(description: dict) -> tuple[str, str]:
    """(JSON text, md5 hex) of a cache description: any change of an input gives a new cache."""
    text = json.dumps(description, indent=2, sort_keys=True, default=str)
    return text, hashlib.md5(text.encode()).hexdigest()


def file_fingerprint(path: str, full_hash_limit: int = 256 << 20) -> dict:
    """Size plus an md5 of the content (of its first and last MiB for files above ``full_hash_limit``):
    a regenerated dataset gets a new cache even when its name is unchanged."""
    size = os.path.getsize(path)
    h = hashlib.md5()
    with open(path, "rb") as f:
        if size <= full_hash_limit:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        else:
            h.update(f.read(1 << 20))
            f.seek(size - (1 << 20))
            h.update(f.read(1 << 20))
            h.update(str(os.stat(path).st_mtime_ns).encode())
    return {"size": size, "md5": h.hexdigest()}


def cached_arrays(
    cache_dir: Optional[str],
    stem: str,
    names: list[str],
    description: str,
    build: Callable[[], dict[str, np.ndarray]],
    on_warning: Callable[[str], None] = lambda msg: None,
) -> tuple[dict[str, np.ndarray], bool]:
    """Load ``{name: array}`` from ``cache_dir/stem-name.npy``, or build them (one process, under a
    lock) and save them. The description file, written last, marks a complete cache.

    Returns (arrays, built_here). Without a ``cache_dir``, or when it cannot be written, the arrays are
    built in memory (the latter with a warning)."""
    if not cache_dir:
        return build(), True
    paths = {n: os.path.join(cache_dir, f"{stem}-{n}.npy") for n in names}
    desc_path = os.path.join(cache_dir, f"{stem}-description.txt")
    sums_path = os.path.join(cache_dir, f"{stem}-checksums.json")
    warned = []

    def complete() -> bool:
        if not (os.path.isfile(desc_path) and all(os.path.isfile(p) for p in paths.values())):
            return False
        with open(desc_path) as f:
            return f.read() == description

    def load() -> Optional[dict[str, np.ndarray]]:
        """The cached arrays, or None (with one warning) when a file is damaged."""
        problem = damage(paths, sums_path)
        arrays = None
        if problem is None:
            try:
                arrays = {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}
            except (OSError, ValueError, EOFError) as err:
                problem = f"{type(err).__name__}: {err}"
        if problem is not None and not warned:
            warned.append(problem)
            on_warning(f"the index cache {os.path.join(cache_dir, stem)}-* is damaged ({problem}); rebuilding it")
        return arrays

    rebuild = False
    if complete():
        arrays = load()
        if arrays is not None:
            return arrays, False
        rebuild = True   # damaged
    lock = file_lock(os.path.join(cache_dir, f"{stem}.lock"))
    try:
        os.makedirs(cache_dir, exist_ok=True)
        lock.__enter__()
    except OSError as err:
        on_warning(f"could not write the index cache in {cache_dir} ({err}); the indices are built in "
                   f"memory on every run. Set train_dataset.dataloader.config.path_to_cache to a "
                   f"writable directory to cache them.")
        return build(), True
    try:
        # Under the lock only the build, or the look that another rank built it meanwhile: the loads
        # (and their CRC checks) run outside it, on every rank in parallel.
        if rebuild or not complete():
            return _build_and_write(build, paths, sums_path, desc_path, description, cache_dir, on_warning), True
    finally:
        lock.__exit__(None, None, None)
    arrays = load()
    if arrays is not None:
        return arrays, False
    return build(), True   # what the other rank wrote is damaged (warned): this rank's own build


def _build_and_write(build, paths, sums_path, desc_path, description, cache_dir, on_warning):
    arrays = build()
    try:
        if os.path.exists(desc_path):
            os.remove(desc_path)  # incomplete until the description is written again
        for n, p in paths.items():
            atomic_save_npy(p, arrays[n])
        atomic_write_text(sums_path, json.dumps({n: _file_digest(p) for n, p in paths.items()}))
        atomic_write_text(desc_path, description)
    except OSError as err:
        on_warning(f"could not write the index cache in {cache_dir} ({err}); the indices are kept "
                   f"in memory only.")
    return arrays


def _file_digest(path: str, block: int = 1 << 24) -> dict:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(block):
            crc = zlib.crc32(chunk, crc)
    return {"size": os.path.getsize(path), "crc32": crc}


def damage(paths: dict[str, str], sums_path: str) -> Optional[str]:
    """What is wrong with cached array files against the sizes and CRC-32s recorded when they were
    written (None: intact). A cache without the record (older lit_moe) counts as damaged: rebuilt once."""
    try:
        with open(sums_path) as f:
            sums = json.load(f)
    except (OSError, ValueError):
        return f"{os.path.basename(sums_path)} is missing or unreadable"
    for name, path in paths.items():
        want = sums.get(name) if isinstance(sums, dict) else None
        if not isinstance(want, dict):
            return f"no checksum for {os.path.basename(path)}"
        size = os.path.getsize(path)
        if size != want.get("size"):
            return f"{os.path.basename(path)} has {size} bytes, {want.get('size')} were written"
        if _file_digest(path)["crc32"] != want.get("crc32"):
            return f"{os.path.basename(path)} fails its CRC-32 check"
    return None
