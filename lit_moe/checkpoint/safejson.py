"""Code-free serialisation of the small, non-tensor-shard part of a checkpoint.

Lightning's checkpoint dictionary (loop progress, LR-scheduler and callback states, the DataModule's
position) and the per-rank RNG states are nested Python values. ``torch.save``/``pickle`` would store
them, but loading a pickle can execute code, so they are written as JSON instead. JSON has no tuples,
tensors, arrays or non-string dict keys, so those are tagged objects ``{"__lm__": kind, ...}``; the
round trip is exact (floats are written with ``repr`` precision, tensors as raw bytes).
Anything else (an arbitrary object) cannot be stored safely and raises :class:`TypeError` naming
its place in the tree, except under hyper-parameter keys, which are informative only and are kept
as their ``repr``.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import torch

TAG = "__lm__"
# Top-level Lightning keys whose values are informative only (never needed to resume).
LENIENT_KEYS = ("hyper_parameters", "hparams_name", "datamodule_hyper_parameters", "datamodule_hparams_name")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def encode(value: Any, path: str = "", lenient: bool = False) -> Any:
    """Turn ``value`` into a JSON-compatible tree (see the module docstring)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, np.generic):
        return encode(value.item(), path, lenient)
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
            raise TypeError(f"{path or 'value'}: a {type(value).__name__} cannot be stored in the checkpoint "
                            "metadata (only plain tensors)")
        t = value.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {TAG: "tensor", "dtype": _dtype_name(t.dtype), "shape": list(t.shape),
                "data": base64.b64encode(raw).decode("ascii")}
    if isinstance(value, np.ndarray):
        a = np.ascontiguousarray(value)
        return {TAG: "ndarray", "dtype": a.dtype.str, "shape": list(a.shape),
                "data": base64.b64encode(a.tobytes()).decode("ascii")}
    if isinstance(value, torch.dtype):
        return {TAG: "dtype", "name": _dtype_name(value)}
    if isinstance(value, bytes):
        return {TAG: "bytes", "data": base64.b64encode(value).decode("ascii")}
    if isinstance(value, tuple):
        return {TAG: "tuple", "items": [encode(v, f"{path}[{i}]", lenient) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{path}[{i}]", lenient) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and TAG not in value:
            return {k: encode(v, f"{path}.{k}" if path else k,
                              lenient or (not path and k in LENIENT_KEYS)) for k, v in value.items()}
        return {TAG: "dict", "items": [[encode(k, f"{path}<key>", lenient), encode(v, f"{path}[{k!r}]", lenient)]
                                       for k, v in value.items()]}
    if lenient:
        return {TAG: "repr", "text": repr(value)}
    raise TypeError(f"{path or 'value'}: a {type(value).__module__}.{type(value).__qualname__} cannot be stored in "
                    "a lit_moe checkpoint (allowed: tensors, arrays, numbers, strings, lists, tuples, dicts)")


def decode(tree: Any) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(tree, list):
        return [decode(v) for v in tree]
    if not isinstance(tree, dict):
        return tree
    kind = tree.get(TAG)
    if kind is None:
        return {k: decode(v) for k, v in tree.items()}
    if kind == "tuple":
        return tuple(decode(v) for v in tree["items"])
    if kind == "dict":
        return {_hashable(decode(k)): decode(v) for k, v in tree["items"]}
    if kind == "tensor":
        dtype = _dtype_from_name(tree["dtype"])
        raw = bytearray(base64.b64decode(tree["data"]))
        if not raw:
            return torch.empty(tree["shape"], dtype=dtype)
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(tree["shape"]).clone()
    if kind == "ndarray":
        raw = base64.b64decode(tree["data"])
        return np.frombuffer(raw, dtype=np.dtype(tree["dtype"])).reshape(tree["shape"]).copy()
    if kind == "dtype":
        return _dtype_from_name(tree["name"])
    if kind == "bytes":
        return base64.b64decode(tree["data"])
    if kind == "repr":
        return tree["text"]
    raise ValueError(f"unknown tagged value {kind!r}")


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def dumps(value: Any, lenient: bool = False) -> str:
    return json.dumps(encode(value, lenient=lenient), allow_nan=True)


def loads(text: str) -> Any:
    return decode(json.loads(text))
