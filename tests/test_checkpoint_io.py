"""Checkpoint I/O at scale, measured on small tensors: the files a resuming rank opens and the bytes
it reads (issue 26, item 3).

A save writes one index (``index.json``: per piece the file, byte range and a CRC-32 per chunk); a
resuming rank opens ``common.json``, the index, its own RNG file and only the shard files holding
bytes it needs, and checks checksums only over the chunks it reads. Checkpoints written before the
index existed still load through every file's header (the "before" numbers below).

The multi-rank scenario runs real gloo processes (``python tests/test_checkpoint_io.py --scenario
DIR``): FSDP-style ``Shard(0)`` DTensors plus replicated ones, saved by 2 and 4 ranks and resumed
2→2, 4→4 and 2→4, every rank comparing what it loaded with the global tensors.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import launch_pool  # noqa: E402  (tests/ is on sys.path)

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
TIMEOUT = 300
CHUNK = 256  # bytes per checksum chunk in the scenario, so that small tensors span several chunks

SHAPES = {"w1": ((64, 48), torch.float32), "w2": ((33, 16), torch.bfloat16), "e": ((8, 24, 16), torch.float32)}
REPLICATED = {"norm": ((48,), torch.float32), "step": ((), torch.float32)}


def _truth(name: str, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return (torch.randn(shape, generator=g) if shape else torch.randn((), generator=g)).to(dtype)


# ==============================================================================================
# the gloo scenario (children)
# ==============================================================================================
def _state(mesh, prefix: str) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = {}
    for name, (shape, dtype) in SHAPES.items():
        out[prefix + name] = distribute_tensor(_truth(prefix + name, shape, dtype), mesh, [Shard(0)])
    for name, (shape, dtype) in REPLICATED.items():
        full = _truth(prefix + name, shape, dtype)
        out[prefix + name] = distribute_tensor(full, mesh, [Replicate()]) if shape else full
    return out


def _empty_like_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in state.items():
        if isinstance(v, DTensor):
            out[k] = DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements, run_check=False,
                                        shape=v.shape, stride=v.stride())
        else:
            out[k] = torch.zeros_like(v)
    return out


def _child(rank: int, world: int, root: str, tag: str, action: str, path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lit_moe.checkpoint import safejson, sharded
    from lit_moe.checkpoint.comm import Comm
    from lit_moe.checkpoint.iteration import (IterationReader, SaveJob, fill, make_common, prepare, rng_state,
                                              write_and_commit)
    from lit_moe.checkpoint.sharded import assign_writers, pieces_of

    sharded.CHUNK_BYTES = CHUNK
    dist.init_process_group("gloo", init_method=f"file://{root}/rdv-{tag}", rank=rank, world_size=world)
    from lit_moe.runtime.distributed import release_process_groups_at_exit
    release_process_groups_at_exit()  # no gloo thread outlives the interpreter
    mesh = init_device_mesh("cpu", (world,))
    model, optim = _state(mesh, "model."), _state(mesh, "0/")
    result: dict = {}
    if action == "save":
        comm = Comm.create()
        mp, op = pieces_of(model), pieces_of(optim)
        keep_m, keep_o = assign_writers(comm, mp), assign_writers(comm, op)   # remove_redundancy
        job = SaveJob(Path(path), 1, "ckpt", {k: v for k, v in mp.items() if k in keep_m},
                      {k: v for k, v in op.items() if k in keep_o}, rng_json=safejson.dumps(rng_state()),
                      common=make_common(1, world, "ckpt", True) if rank == 0 else None)
        job.most_bytes = prepare(comm, Path(path), 1, job.nbytes)
        write_and_commit(comm, job)
    else:
        opened: list[str] = []
        read_bytes = [0]
        ckpt = os.path.realpath(path)

        def audit(event, args):
            if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
                p = os.path.realpath(os.fsdecode(args[0]))
                if p.startswith(ckpt):
                    opened.append(os.path.basename(p))

        real_safe_open, real_pread = sharded.safe_open, sharded._pread

        def counting_safe_open(p, *a, **k):   # Rust opens: not seen by the audit hook
            opened.append(os.path.basename(str(p)))
            return real_safe_open(p, *a, **k)

        def counting_pread(f, offset, n):
            read_bytes[0] += n
            return real_pread(f, offset, n)

        sharded.safe_open, sharded._pread = counting_safe_open, counting_pread
        targets_m, targets_o = _empty_like_state(model), _empty_like_state(optim)
        sys.addaudithook(audit)
        # what load_lightning_checkpoint does on every rank
        reader = IterationReader(Path(path))
        fill(reader.index("model"), pieces_of(targets_m))
        fill(reader.index("opt"), pieces_of(targets_o))
        rng = reader.rng_state(rank, world)
        n_opened = len(opened)
        sharded.safe_open, sharded._pread = real_safe_open, real_pread
        for want, got in ((model, targets_m), (optim, targets_o)):
            for k in want:
                a, b = want[k], got[k]
                if isinstance(a, DTensor):
                    a, b = a.full_tensor(), b.full_tensor()
                assert torch.equal(a, b), (k, tag, rank)
        local_bytes = sum(p.local.numel() * p.local.element_size()
                          for p in list(pieces_of(targets_m).values()) + list(pieces_of(targets_o).values()))
        result = {"opened": n_opened, "distinct": len(set(opened)), "files": sorted(set(opened)),
                  "read_bytes": read_bytes[0], "local_bytes": local_bytes, "rng_restored": rng is not None}
    Path(root, f"result-{tag}-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _launch(root: Path, world: int, tag: str, action: str, path: Path) -> list[dict]:
    import torch.multiprocessing as mp

    mp.start_processes(_child, args=(world, str(root), tag, action, str(path)), nprocs=world, start_method="fork")
    return [json.loads((root / f"result-{tag}-{r}.json").read_text()) for r in range(world)]


def _as_old_checkpoint(src: Path, dst: Path) -> None:
    """A copy of ``src`` as written before the index existed: no index.json listed in common.json."""
    import shutil

    from lit_moe.checkpoint.iteration import dump_common

    shutil.copytree(src, dst)
    common = json.loads((dst / "common.json").read_text())
    del common["files"]["index.json"]
    (dst / "index.json").unlink()
    (dst / "common.json").write_text(dump_common(common))


def scenario(root: Path) -> dict:
    out = {}
    for world in (2, 4):
        _launch(root, world, f"save{world}", "save", root / f"w{world}")
    it = lambda w: root / f"w{w}" / "iteration_00000001"   # noqa: E731
    _as_old_checkpoint(it(2), root / "old2")
    for saved, loaded, path in ((2, 2, it(2)), (4, 4, it(4)), (2, 4, it(2)), (2, 2, root / "old2")):
        tag = f"{'old' if 'old' in str(path) else 'new'}{saved}to{loaded}"
        out[tag] = _launch(root, loaded, tag, "load", path)
    return out


# ==============================================================================================
# tests
# ==============================================================================================
def test_resume_opens_o1_files_and_reads_only_its_bytes(tmp_path):
    """Files opened per rank on resume (common.json, index.json, own RNG file, shard files), measured:
    2→2: 7 and 5, 4→4: 7, 7, 7 and 5, 2→4: 6, 6, 4 and 4 (at most 7 whatever the world: its own
    model and optimizer files and those of the one rank that wrote the small replicated tensors).
    Before the index (the same 2-rank checkpoint without index.json): 14 and 10, growing with the
    world (every file's header, then every needed file twice: CRC-32 of the whole file, then data).
    Bytes read per rank: its own pieces (the replicated tensors included), the headers of the files
    it opens and at most a chunk of rounding at each end of a piece; a rank of 4 resuming from 2
    reads about half what a rank of 2 does, not whole files."""
    proc = launch_pool.run([str(HERE), "--scenario", str(tmp_path)], timeout=TIMEOUT, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    opened = {tag: [r["opened"] for r in ranks] for tag, ranks in got.items()}
    print("files opened per rank:", opened)
    print("bytes read per rank:", {tag: [r["read_bytes"] for r in ranks] for tag, ranks in got.items()})
    assert opened["new2to2"] == [7, 5] and opened["new4to4"] == [7, 7, 7, 5] and opened["new2to4"] == [6, 6, 4, 4]
    assert opened["old2to2"] == [14, 10]
    for tag in ("new2to2", "new4to4", "new2to4"):
        for r in got[tag]:
            assert r["opened"] == r["distinct"]   # no file opened twice
            assert "index.json" in r["files"] and "common.json" in r["files"]
            # checksums over what is read: the rank's bytes, one chunk of rounding at each end of each
            # of the 10 tensors and the headers (< 800 bytes each) of the files it opens
            assert r["local_bytes"] <= r["read_bytes"] <= r["local_bytes"] + 2 * 10 * CHUNK + 6 * 800
    assert all(r["rng_restored"] for r in got["new2to2"]) and not any(r["rng_restored"] for r in got["new2to4"])
    # a rank of 4 reads about half what a rank of 2 does
    assert max(r["read_bytes"] for r in got["new2to4"]) < 0.75 * min(r["read_bytes"] for r in got["new2to2"])


def test_index_reads_check_only_the_chunks_read(tmp_path, monkeypatch):
    """A damaged byte in the second half of a piece: reading the first half succeeds (its chunks are
    intact), reading the second half names the file and the bytes; a damaged index is one line."""
    from lit_moe.checkpoint import CheckpointError, sharded
    from lit_moe.checkpoint.sharded import Piece, ShardIndex, write_pieces

    monkeypatch.setattr(sharded, "CHUNK_BYTES", 64)
    full = torch.arange(64, dtype=torch.float32).reshape(16, 4)   # 256 bytes: 4 chunks
    path = tmp_path / "m.safetensors"
    size, crc, layout = write_pieces(path, {"w": Piece(full.clone(), (0, 0), (16, 4))})
    lo, hi = layout["pieces"]["w"][4:6]
    assert hi - lo == 256 and len(layout["pieces"]["w"][6]) == 4
    data = bytearray(path.read_bytes())
    data[lo + 200] ^= 0xFF   # chunk 3 (rows 12-15)
    path.write_bytes(bytes(data))
    index = ShardIndex.from_index({path: (0, size, crc)}, {path: layout}, chunk_bytes=64)
    top = torch.zeros(8, 4)
    index.read([("w", top, (0, 0), 0)])
    assert torch.equal(top, full[:8])
    mid = torch.zeros(3, 2)
    index.read([("w", mid, (5, 1), 0)])   # a block inside one chunk's rows, columns 1-2
    assert torch.equal(mid, full[5:8, 1:3])
    with pytest.raises(CheckpointError, match=rf"{path}: bytes {lo + 192}\.\.{lo + 256} fail their CRC-32"):
        index.read([("w", torch.zeros(8, 4), (8, 0), 0)])


def test_damaged_index_is_one_line(tmp_path):
    from lit_moe.checkpoint import CheckpointError
    from lit_moe.checkpoint.iteration import IterationReader

    _launch_single_save(tmp_path)
    it = tmp_path / "ck" / "iteration_00000001"
    text = (it / "index.json").read_text()
    (it / "index.json").write_text(text.replace('"chunk_bytes"', '"chunk_bytez"'))
    with pytest.raises(CheckpointError, match=rf"corrupted: {it / 'index.json'} fails its CRC-32"):
        IterationReader(it).index("model")
    (it / "index.json").unlink()
    with pytest.raises(CheckpointError, match=rf"missing: {it / 'index.json'}"):
        IterationReader(it).index("model")


def _launch_single_save(tmp_path: Path) -> None:
    from lit_moe.checkpoint import safejson
    from lit_moe.checkpoint.comm import Comm
    from lit_moe.checkpoint.iteration import SaveJob, make_common, prepare, rng_state, write_and_commit
    from lit_moe.checkpoint.sharded import pieces_of

    comm = Comm(None)
    model = pieces_of({"w": _truth("w", (4, 3), torch.float32)})
    job = SaveJob(tmp_path / "ck", 1, None, model, None, rng_json=safejson.dumps(rng_state()),
                  common=make_common(1, 1, None, False))
    prepare(comm, tmp_path / "ck", 1)
    write_and_commit(comm, job)


if __name__ == "__main__":
    if sys.argv[1] == "--scenario":
        print(json.dumps(scenario(Path(sys.argv[2]))))
