"""Devices: one code path for CPU (gloo), CUDA (nccl) and Ascend NPU (hccl).

Lightning 2.6 ships no NPU accelerator. When ``torch_npu`` is importable, :class:`NPUAccelerator` is
registered as ``npu``; importing ``torch_npu`` itself registers ``torch.npu``, the ``npu`` device
type and the ``hccl`` backend, so ``torch.distributed.Backend.default_device_backend_map`` picks
hccl for NPU tensors exactly as it picks nccl for CUDA and gloo for CPU.

Nothing else in lit_moe names a device type: code asks a tensor for ``.device`` or uses the
helpers below, which go through ``torch.accelerator`` (CUDA and PrivateUse1 backends such as NPU).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Optional, Union

import torch
from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException


def torch_npu_available() -> bool:
    """True when ``torch_npu`` is installed and imports (which also registers the npu device)."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401
    except Exception:  # a broken CANN install: behave as if there were no NPU
        return False
    return hasattr(torch, "npu")


def _npu_count() -> int:
    if not torch_npu_available():
        return 0
    try:
        return int(torch.npu.device_count())
    except Exception:
        return 0


def device_module(device: Union[torch.device, str]) -> Optional[Any]:
    """``torch.cuda`` / ``torch.npu`` / … for an accelerator device, None for CPU and meta."""
    dev_type = torch.device(device).type
    if dev_type in ("cpu", "meta"):
        return None
    return getattr(torch, dev_type, None)


def synchronize(device: Union[torch.device, str]) -> None:
    """Wait for the device's queued work (timing); a no-op on CPU."""
    mod = device_module(device)
    if mod is not None and hasattr(mod, "synchronize"):
        mod.synchronize(torch.device(device))


def default_backend(device: Union[torch.device, str]) -> str:
    """The process-group backend for a device type: gloo (cpu), nccl (cuda), hccl (npu, via torch_npu)."""
    dev_type = torch.device(device).type
    return torch.distributed.Backend.default_device_backend_map.get(dev_type, "gloo")


def _parse_npu_ids(devices: Union[int, str, list[int]]) -> Optional[list[int]]:
    count = _npu_count()
    if isinstance(devices, str):
        text = devices.strip()
        if text in ("auto", "-1"):
            return list(range(count))
        if "," in text:
            ids = [int(x) for x in text.split(",") if x.strip()]
        else:
            n = int(text)
            ids = list(range(n)) if n > 0 else None
    elif isinstance(devices, int):
        if devices == -1:
            return list(range(count))
        ids = list(range(devices)) if devices > 0 else None
    else:
        ids = [int(x) for x in devices]
    if not ids:
        return None
    bad = [i for i in ids if i < 0 or i >= count]
    if bad:
        raise MisconfigurationException(
            f"trainer.devices: NPU ids {bad} requested, but only {count} NPU(s) are visible "
            "(ASCEND_RT_VISIBLE_DEVICES)")
    return ids


class NPUAccelerator(Accelerator):
    """Ascend NPUs through ``torch_npu`` (``torch.npu``; distributed backend hccl)."""

    def setup_device(self, device: torch.device) -> None:
        if device.type != "npu":
            raise MisconfigurationException(f"NPUAccelerator: device should be an NPU, got {device}")
        torch.npu.set_device(device)

    def teardown(self) -> None:
        if torch_npu_available():
            torch.npu.empty_cache()

    @staticmethod
    def parse_devices(devices: Union[int, str, list[int]]) -> Optional[list[int]]:
        return _parse_npu_ids(devices)

    @staticmethod
    def get_parallel_devices(devices: Union[int, str, list[int]]) -> list[torch.device]:
        ids = devices if isinstance(devices, list) else (_parse_npu_ids(devices) or [])
        return [torch.device("npu", i) for i in ids]

    @staticmethod
    def auto_device_count() -> int:
        return _npu_count()

    @staticmethod
    def is_available() -> bool:
        return _npu_count() > 0

    @staticmethod
    def name() -> str:
        return "npu"

    def get_device_stats(self, device: Union[torch.device, str, int]) -> dict[str, Any]:
        return dict(torch.npu.memory_stats(device))

    @classmethod
    def register_accelerators(cls, accelerator_registry) -> None:
        accelerator_registry.register(cls.name(), cls, description=cls.__name__, override=True)


def register_npu_accelerator() -> bool:
    """Register ``npu`` with Lightning's accelerator registry when torch_npu is importable.

    Always registering would let ``trainer.accelerator: npu`` fail late with Lightning's generic
    "can not run on your system"; not registering makes it fail early with the list of names."""
    if "npu" in AcceleratorRegistry:
        return True
    if os.environ.get("LIT_MOE_REGISTER_NPU", "") == "1" or torch_npu_available():
        NPUAccelerator.register_accelerators(AcceleratorRegistry)
        return True
    return False

