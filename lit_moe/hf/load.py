"""Hugging Face weights into an already built (possibly sharded) model: ``load_path`` pointing at a
``save_pretrained`` directory with ``no_load_optim: True``.

The key mapping and orientation are :mod:`lit_moe.hf.checkpoint`'s (``hf_keys``: for each of our tensors,
the Hugging Face keys and the view of our tensor each one fills). Each rank reads only the part of
each Hugging Face tensor that lands in the piece it holds: the view's strides (taken on the meta
device) say which of our dimensions each Hugging Face dimension runs along and where it starts, the
intersection with the rank's piece is a box in the Hugging Face tensor, and that box is read by
byte range from the safetensors file (:mod:`lit_moe.model.safetensors_io`, which parses the headers
itself). No rank builds a global tensor: at 671B a node no longer holds every expert of a layer on
the host. FP8 block-quantized weights are dequantized with the scale blocks covering the box.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from lit_moe.checkpoint.layout import CheckpointError
from lit_moe.checkpoint.sharded import Piece, canonical, piece_of
from lit_moe.lora import is_adapter_name


def _listing(items: list[str], n: int = 6) -> str:
    return ", ".join(items[:n]) + (" ..." if len(items) > n else "")


# ----------------------------------------------------------------------------------------------
# which region of a Hugging Face tensor lands in a piece
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ViewGeometry:
    """A view of our (contiguous) global tensor as a box with permuted axes: view dim ``d`` runs
    along our dim ``dims[d]`` (None: a size-1 axis of its own) and our dim ``b`` starts at
    ``start[b]`` (fixed there when no view dim runs along it)."""

    shape: tuple[int, ...]
    dims: tuple[Optional[int], ...]
    start: tuple[int, ...]


def view_geometry(view, global_shape: tuple[int, ...]) -> ViewGeometry:
    base = torch.empty(global_shape, device="meta")
    v = view(base)
    strides, offset = base.stride(), v.storage_offset()
    start = tuple((offset // st) % n if n > 1 else 0 for st, n in zip(strides, global_shape))
    used: set[int] = set()
    dims: list[Optional[int]] = []
    for size, stride in zip(v.shape, v.stride()):
        match = [b for b, (n, st) in enumerate(zip(global_shape, strides))
                 if b not in used and st == stride and (n > 1 or size == 1) and size <= n]
        if size > 1 and len(match) != 1:
            raise ValueError(f"a view of shape {tuple(v.shape)} is not a box of the tensor {global_shape}")
        b = match[0] if match else None
        if b is not None:
            used.add(b)
        dims.append(b)
    return ViewGeometry(tuple(v.shape), tuple(dims), start)


def region(geo: ViewGeometry, piece: Piece) -> Optional[tuple[tuple[slice, ...], torch.Tensor]]:
    """(box of the Hugging Face tensor, the matching view of ``piece.local``), or None when the
    piece holds none of it."""
    box: list[slice] = []
    mapped = {b: d for d, b in enumerate(geo.dims) if b is not None}
    index: list[Any] = []
    for b, (o, s) in enumerate(zip(piece.offsets, piece.sizes)):
        c = geo.start[b]
        if b in mapped:
            lo, hi = max(o, c), min(o + s, c + geo.shape[mapped[b]])
            if hi <= lo:
                return None
            index.append(slice(lo - o, hi - o))
        else:
            if not o <= c < o + s:
                return None
            index.append(c - o)
    for d, b in enumerate(geo.dims):
        if b is None:
            box.append(slice(0, 1))
        else:
            sl = index[b]
            box.append(slice(sl.start + piece.offsets[b] - geo.start[b], sl.stop + piece.offsets[b] - geo.start[b]))
    local = piece.local[tuple(index)] if index else piece.local
    order = sorted(b for b in geo.dims if b is not None)   # the dims left in ``local``, in our order
    local = local.permute([order.index(b) for b in geo.dims if b is not None]) if order else local
    for d, b in enumerate(geo.dims):
        if b is None:
            local = local.unsqueeze(d)
    return tuple(box), local


# ----------------------------------------------------------------------------------------------
# where a Hugging Face key is stored
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """A Hugging Face tensor as stored: ``key[(*lead, rows + row_offset, ...)]`` (transformers'
    merged expert tensors hold expert ``j``'s gate and up projections at rows ``[0, I)`` and
    ``[I, 2I)`` of ``[j]``); ``shape`` is the tensor's own shape."""

    key: str
    lead: tuple[int, ...]
    row_offset: int
    shape: tuple[int, ...]


def locate(hf_key: str, reader) -> Optional[Source]:
    from lit_moe.hf import checkpoint as hf

    if hf_key in reader.files:
        return Source(hf_key, (), 0, reader.shape(hf_key))
    parsed = hf._merged_expert_key(hf_key)
    if parsed is None or parsed[0] not in reader.files:
        return None
    merged, j, part = parsed
    shape = reader.shape(merged)[1:]
    if part == "down_proj":
        return Source(merged, (j,), 0, shape)
    half = shape[0] // 2
    return Source(merged, (j,), half if part == "up_proj" else 0, (half, *shape[1:]))


def read_region(reader, src: Source, box: tuple[slice, ...]) -> torch.Tensor:
    if src.row_offset and box:
        box = (slice(box[0].start + src.row_offset, box[0].stop + src.row_offset), *box[1:])
    return reader.read(src.key, src.lead, box)


# ----------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------
def load_hf_into(model: torch.nn.Module, directory: Path, model_config: Any = None, workers: int = 1) -> int:
    """Fill ``model`` (a ``DeepseekV3ForCausalLM``, any layout) from the Hugging Face directory, each
    rank reading only the regions it holds. Returns the bytes this rank read."""
    from lit_moe.hf import checkpoint as hf

    directory = Path(directory)
    config = getattr(model, "config", None) or model_config
    try:
        reader = hf._Reader(directory)
    except hf.HFCheckpointError as err:
        raise CheckpointError(f"checkpoint.load_path: {err}") from None
    try:
        return _fill(model, reader, directory, config)
    except hf.HFCheckpointError as err:
        raise CheckpointError(f"checkpoint file corrupted: {err}") from None
    finally:
        reader.close()


def _fill(model: torch.nn.Module, reader, directory: Path, config: Any) -> int:
    from lit_moe.hf import checkpoint as hf

    available = reader.keys()
    sd = get_model_state_dict(model)
    consumed: set[str] = set()
    missing: list[str] = []
    mismatched: list[str] = []
    with torch.no_grad():
        for name in sorted(sd):
            if is_adapter_name(name):   # LoRA adapters are not in a base checkpoint: they keep their init
                continue
            piece = piece_of(sd[name])
            shape = tuple(piece.global_shape)
            for hf_key, view in hf.hf_keys(canonical(name), torch.Size(shape), config.num_hidden_layers, config):
                src = locate(hf_key, reader)
                if src is None:
                    missing.append(hf_key)
                    continue
                consumed.add(src.key)
                geo = view_geometry(view, shape)
                if src.shape != geo.shape:
                    mismatched.append(f"{hf_key}: checkpoint {list(src.shape)} vs model {list(geo.shape)}")
                    continue
                if reader.dtype(src.key) in hf.FP8_DTYPES and reader.scale_key(src.key) is None:
                    raise CheckpointError(f"checkpoint.load_path: {hf_key} is {reader.dtype(src.key)} without "
                                          f"{src.key}_scale_inv; dequantize the checkpoint to bf16 first")
                found = region(geo, piece)
                if found is not None:
                    box, target = found
                    target.copy_(read_region(reader, src, box))
    problems = []
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatch(es): {'; '.join(mismatched[:6])}"
                        + (" ..." if len(mismatched) > 6 else ""))
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing: {_listing(missing)}")
    unexpected = sorted(k for k in available - consumed if not hf._ignorable(k, config))
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {_listing(unexpected)}")
    if problems:
        raise CheckpointError(f"the Hugging Face checkpoint {directory} does not match the model: "
                              + " | ".join(problems))
    set_model_state_dict(model, sd)
    return reader.bytes_read
