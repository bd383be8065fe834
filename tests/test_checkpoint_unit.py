"""Unit checks of the checkpoint building blocks (no Trainer): the code-free metadata encoding, the
piece index that reassembles any region of a tensor from the pieces ranks wrote, and the tracker."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from lit_moe.checkpoint import CheckpointError
from lit_moe.checkpoint import safejson
from lit_moe.checkpoint.layout import read_tracker, write_tracker
from lit_moe.checkpoint.sharded import Piece, ShardIndex, write_pieces


def test_safejson_round_trip_is_exact():
    value = {
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1}}, "state_dict": {}}},
        "python_rng": (3, tuple(range(5)), None),
        "int_keys": {0: "a", 7: (1.5, float("inf"))},
        "floats": [0.1, 1 / 3, -0.0, 1e-300, float("nan")],
        "tensors": [torch.tensor(2.5), torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) / 7,
                    torch.empty(0, 4), torch.tensor([True, False])],
        "array": np.arange(5, dtype=np.uint32) * 1000003,
        "dtype": torch.float16,
        "bytes": b"\x00\xff",
        "np_scalar": np.float32(0.25),
    }
    back = safejson.loads(safejson.dumps(value))
    assert back["loops"] == value["loops"]
    assert back["python_rng"] == value["python_rng"] and isinstance(back["python_rng"], tuple)
    assert back["int_keys"] == {0: "a", 7: (1.5, float("inf"))}
    assert back["floats"][:4] == value["floats"][:4] and math.isnan(back["floats"][4])
    assert str(back["floats"][2]) == "-0.0"
    for a, b in zip(back["tensors"], value["tensors"]):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert back["array"].dtype == np.uint32 and np.array_equal(back["array"], value["array"])
    assert back["dtype"] is torch.float16 and back["bytes"] == b"\x00\xff" and back["np_scalar"] == 0.25


def test_safejson_refuses_objects_but_keeps_hparams_readable():
    class Opaque:
        def __repr__(self):
            return "Opaque()"

    with pytest.raises(TypeError, match=r"callbacks\.Probe\.thing: a .*Opaque cannot be stored"):
        safejson.dumps({"callbacks": {"Probe": {"thing": Opaque()}}})
    back = safejson.loads(safejson.dumps({"hyper_parameters": {"cfg": Opaque()}}))
    assert back == {"hyper_parameters": {"cfg": "Opaque()"}}


def _write(path: Path, writer: int, pieces: dict[str, Piece]) -> tuple:
    size, crc, _ = write_pieces(path, pieces)
    return path, (writer, size, crc)


def test_index_reassembles_any_region_from_row_and_column_pieces(tmp_path):
    full = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    # four ranks of a 2x2 (rows x cols) sharding wrote one piece each; a fifth holds a replica of
    # rank 0's piece
    pieces = {(0, 0): full[0:3, 0:4], (0, 4): full[0:3, 4:8], (3, 0): full[3:6, 0:4], (3, 4): full[3:6, 4:8]}
    files = {}
    for rank, ((r, c), t) in enumerate(pieces.items()):
        files.update([_write(tmp_path / f"m{rank}.safetensors", rank, {"w": Piece(t.clone(), (r, c), (6, 8))})])
    files.update([_write(tmp_path / "m4.safetensors", 4, {"w": Piece(full[0:3, 0:4].clone(), (0, 0), (6, 8))})])
    index = ShardIndex(files)
    assert index.global_shape("w") == (6, 8)
    target = torch.zeros(4, 5)
    index.read([("w", target, (1, 2), 4)])  # rows 1-4, cols 2-6: touches all four pieces
    assert torch.equal(target, full[1:5, 2:7])
    whole = torch.zeros(6, 8)
    index.read([("w", whole, (0, 0), 0)])
    assert torch.equal(whole, full)


def test_index_reports_gaps_and_bad_files(tmp_path):
    full = torch.arange(12.0).reshape(4, 3)
    files = dict([_write(tmp_path / "a.safetensors", 0, {"w": Piece(full[0:2].clone(), (0, 0), (4, 3))})])
    index = ShardIndex(files)
    with pytest.raises(CheckpointError, match=r"does not cover tensor 'w'"):
        index.read([("w", torch.zeros(4, 3), (0, 0), 0)])

    path, (writer, size, crc) = next(iter(files.items()))
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    index = ShardIndex(files)  # the header is intact
    with pytest.raises(CheckpointError, match=rf"{path}.*CRC-32"):
        index.read([("w", torch.zeros(2, 3), (0, 0), 0)])
    path.write_bytes(bytes(data[:20]))
    with pytest.raises(CheckpointError, match=rf"truncated or corrupted: {path}"):
        ShardIndex(files)
    with pytest.raises(CheckpointError, match=r"corrupted: .*a.safetensors"):
        ShardIndex({path: (0, None, None)})  # no size to compare: the header itself is unreadable


def test_tracker_is_replaced_atomically(tmp_path):
    write_tracker(tmp_path, 12)
    assert read_tracker(tmp_path) == 12
    assert [p.name for p in tmp_path.iterdir()] == ["latest_checkpointed_iteration.txt"]
    (tmp_path / ".latest_checkpointed_iteration.txt.tmp.999").write_text("99")  # a killed writer's leftover
    assert read_tracker(tmp_path) == 12
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("abc")
    with pytest.raises(CheckpointError, match="does not hold a step number"):
        read_tracker(tmp_path)


def test_common_json_is_checksummed(tmp_path):
    from lit_moe.checkpoint.iteration import IterationReader, dump_common, make_common

    common = make_common(3, 1, "p", False, trainer_state={"loops": {"x": 1.25}})
    common["files"] = {}
    (tmp_path / "common.json").write_text(dump_common(common))
    assert IterationReader(tmp_path).step == 3
    raw = json.loads((tmp_path / "common.json").read_text())
    raw["trainer_state"]["loops"]["x"] = 1.5
    (tmp_path / "common.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="common.json fails its CRC-32 check"):
        IterationReader(tmp_path)


def test_save_wait_is_sized_from_the_checkpoint():
    """The wait for the slowest writer: the collective timeout plus the most bytes any rank writes at
    25 MiB/s (hand: DeepSeek-V3's 8.2 TB over 2,048 ranks, 4.0e9 bytes each → 600 s + 152 s)."""
    from datetime import timedelta

    from lit_moe.checkpoint.iteration import save_timeout

    assert save_timeout(timedelta(seconds=600), 0) == timedelta(seconds=600)
    got = save_timeout(timedelta(seconds=600), int(8.2e12 / 2048)).total_seconds()
    assert abs(got - (600 + 8.2e12 / 2048 / (25 * 2 ** 20))) < 1e-3 and 751 < got < 753
    assert save_timeout(None, 0) == timedelta(minutes=30)
