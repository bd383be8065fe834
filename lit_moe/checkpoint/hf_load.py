"""Hugging Face weights into an already built (possibly sharded) model: ``load_path`` pointing at a
``save_pretrained`` directory with ``no_load_optim: True``.

The key mapping and orientation are :mod:`lit_moe.model.hf`'s (``hf_keys``); this module
reads each of our tensors whole on the CPU, one at a time, and keeps the piece this rank holds, so
it works for FSDP2 / tensor / expert parallel layouts without building an unsharded model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from lit_moe.checkpoint.layout import CheckpointError
from lit_moe.checkpoint.sharded import canonical, piece_of
from lit_moe.lora import is_adapter_name


def _listing(items: list[str], n: int = 6) -> str:
    return ", ".join(items[:n]) + (" ..." if len(items) > n else "")


def load_hf_into(model: torch.nn.Module, directory: Path, model_config: Any = None, workers: int = 1) -> None:
    """Fill ``model`` (a ``DeepseekV3ForCausalLM``, any layout) from the Hugging Face directory."""
    from lit_moe.model import hf

    directory = Path(directory)
    config = getattr(model, "config", None) or model_config
    try:
        reader = hf._Reader(directory)
    except hf.HFCheckpointError as err:
        raise CheckpointError(f"checkpoint.load_path: {err}") from None
    except Exception as err:
        raise CheckpointError(f"checkpoint file corrupted: {directory} ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''})") from None
    available = reader.keys()
    fp8 = sorted(k for k in available if k.endswith(("weight_scale_inv", "weight_scale")))
    if fp8:
        raise CheckpointError(f"checkpoint.load_path: {directory} holds FP8-quantized weights ({fp8[0]} ...); "
                              "dequantize the checkpoint to bf16 first")

    def read(key: str) -> torch.Tensor:
        try:
            return reader.get(key)
        except Exception as err:
            raise CheckpointError(f"checkpoint file corrupted: {reader.files[key]} ({type(err).__name__} reading "
                                  f"{key})") from None

    sd = get_model_state_dict(model)
    consumed: set[str] = set()
    missing: list[str] = []
    mismatched: list[str] = []
    merged_cache: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name in sorted(sd):
            if is_adapter_name(name):   # LoRA adapters are not in a base checkpoint: they keep their init
                continue
            piece = piece_of(sd[name])
            shape = torch.Size(piece.global_shape)
            full = torch.empty(shape, dtype=piece.local.dtype)
            complete = True
            for hf_key, view in hf.hf_keys(canonical(name), shape, config.num_hidden_layers, config):
                target = view(full)
                if hf_key in available:
                    src = read(hf_key)
                    consumed.add(hf_key)
                else:
                    src = hf._from_merged(hf_key, available, _CheckedReader(read), merged_cache, consumed)
                if src is None:
                    missing.append(hf_key)
                    complete = False
                    continue
                if tuple(src.shape) != tuple(target.shape):
                    mismatched.append(f"{hf_key}: checkpoint {list(src.shape)} vs model {list(target.shape)}")
                    complete = False
                    continue
                if src.dtype in hf._FP8_DTYPES:
                    raise CheckpointError(f"checkpoint.load_path: {hf_key} is {src.dtype}; dequantize the checkpoint "
                                          "to bf16 first")
                target.copy_(src)
            if complete:
                region = tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes))
                piece.local.copy_(full[region] if region else full)
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


class _CheckedReader:
    """``hf._Reader``'s ``get`` with our error for unreadable files."""

    def __init__(self, read):
        self.get = read
