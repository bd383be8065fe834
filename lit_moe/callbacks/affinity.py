"""CPU affinity (``context.affinity_config``, MindFormers' training-features guide): bind each rank's main process and its data
workers to the CPUs listed for its device, so that ranks do not fight over cores.

MindFormers' shape (MindSpore ``set_cpu_affinity``)::

    context:
      affinity_config:
        device_0:
          affinity_cpu_list: ["0-3", "8-11"]     # this rank's CPUs
          module_to_cpu_dict:                     # optional: indices into that list
            main: [0, 1]                          #   the training process
            minddata: [6, 7]                      #   its DataLoader workers
        device_1:
          affinity_cpu_list: ["4-7", "12-15"]

``device_X`` is the local rank (``deviceX`` is accepted too). Without ``module_to_cpu_dict`` the
process and its workers share the whole list. ``runtime`` and ``pynative`` (MindSpore's own thread
pools) have no PyTorch counterpart and are accepted but ignored. A list without
``module_to_cpu_dict`` may be given directly: ``device_0: ["0-3"]``. Linux only (elsewhere a
warning). Any invalid spec is a :class:`~lit_moe.config.ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, Optional

from lightning.pytorch import Callback

from lit_moe.config import ConfigError
from lit_moe.callbacks._common import emit

FIELD = "context.affinity_config"
_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")
_MODULES = ("main", "minddata", "runtime", "pynative")


def parse_cpu_list(spec: Any, field: str) -> list[int]:
    """``["0-3", "8-11"]`` (or ints, or one string) → ``[0, 1, 2, 3, 8, 9, 10, 11]``."""
    items = [spec] if isinstance(spec, (str, int)) and not isinstance(spec, bool) else spec
    if not isinstance(items, (list, tuple)) or not items:
        raise ConfigError(f"{field}: expected a non-empty list of CPU ids or 'a-b' ranges, got {spec!r}")
    cpus: list[int] = []
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            lo = hi = item
        elif isinstance(item, str) and _RANGE.match(item):
            m = _RANGE.match(item)
            lo, hi = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
        else:
            raise ConfigError(f"{field}: {item!r} is not a CPU id or an 'a-b' range")
        if lo > hi:
            raise ConfigError(f"{field}: range {item!r} must satisfy a <= b")
        for cpu in range(lo, hi + 1):
            if cpu in cpus:
                raise ConfigError(f"{field}: CPU {cpu} is listed twice")
            cpus.append(cpu)
    return cpus


@dataclasses.dataclass
class AffinityPlan:
    """The CPUs of one rank: its main process and its data workers."""
    main: list[int]
    workers: list[int]
    field: str


def _device_entry(spec: dict, local_rank: int) -> tuple[Optional[Any], str]:
    for key in (f"device_{local_rank}", f"device{local_rank}"):
        if key in spec:
            return spec[key], f"{FIELD}.{key}"
    return None, ""


def plan_affinity(spec: Any, local_rank: int, available: Optional[set[int]] = None) -> Optional[AffinityPlan]:
    """Validate the whole spec and return this rank's plan (None: nothing to bind).

    ``spec`` is MindFormers' mapping, or an object with ``enable`` and ``affinity_cpu_list`` (the
    config dataclass, whose ``affinity_cpu_list`` holds the same ``device_X`` mapping).
    ``available``: the CPUs this process may use (default: its current affinity)."""
    if spec is None:
        return None
    if dataclasses.is_dataclass(spec):
        if not getattr(spec, "enable", True):
            return None
        spec = getattr(spec, "affinity_cpu_list", None) or {}
    if not isinstance(spec, dict):
        raise ConfigError(f"{FIELD}: expected a mapping device_X -> {{affinity_cpu_list, "
                          f"module_to_cpu_dict}}, got {spec!r}")
    spec = {k: v for k, v in spec.items() if k != "enable"}
    if available is None:
        available = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(
            range(os.cpu_count() or 1))
    plans = {}
    for key, entry in spec.items():
        m = re.fullmatch(r"device_?(\d+)", str(key))
        if not m:
            raise ConfigError(f"{FIELD}.{key}: unknown key; expected device_X with X the local rank")
        plans[int(m.group(1))] = _plan_one(entry, f"{FIELD}.{key}", available)
    return plans.get(local_rank)


def _plan_one(entry: Any, field: str, available: set[int]) -> AffinityPlan:
    if isinstance(entry, (list, tuple, str)):
        entry = {"affinity_cpu_list": entry}
    if not isinstance(entry, dict):
        raise ConfigError(f"{field}: expected {{affinity_cpu_list: [...], module_to_cpu_dict: {{...}}}}, "
                          f"got {entry!r}")
    unknown = set(entry) - {"affinity_cpu_list", "module_to_cpu_dict"}
    if unknown:
        raise ConfigError(f"{field}: unknown key(s) {sorted(unknown)}; expected affinity_cpu_list, "
                          "module_to_cpu_dict")
    if entry.get("affinity_cpu_list") is not None:
        cpus = parse_cpu_list(entry["affinity_cpu_list"], f"{field}.affinity_cpu_list")
        outside = [c for c in cpus if c not in available]
        if outside:
            raise ConfigError(f"{field}.affinity_cpu_list: CPU(s) {outside} are not available to this "
                              f"process (available: {sorted(available)})")
    else:  # module indices then address the CPUs this process may already use
        cpus = sorted(available)
    modules = entry.get("module_to_cpu_dict") or {}
    if not isinstance(modules, dict):
        raise ConfigError(f"{field}.module_to_cpu_dict: expected a mapping module -> [indices], got "
                          f"{modules!r}")
    chosen: dict[str, list[int]] = {}
    for module, indices in modules.items():
        mfield = f"{field}.module_to_cpu_dict.{module}"
        if module not in _MODULES:
            raise ConfigError(f"{mfield}: unknown module; expected one of {list(_MODULES)}")
        if not isinstance(indices, (list, tuple)) or not indices or any(
                isinstance(i, bool) or not isinstance(i, int) for i in indices):
            raise ConfigError(f"{mfield}: expected a non-empty list of int indices into "
                              f"affinity_cpu_list, got {indices!r}")
        bad = [i for i in indices if not 0 <= i < len(cpus)]
        if bad:
            raise ConfigError(f"{mfield}: index(es) {bad} out of range; affinity_cpu_list has "
                              f"{len(cpus)} CPUs {cpus}")
        chosen[module] = [cpus[i] for i in indices]
    main = chosen.get("main", cpus)
    return AffinityPlan(main=main, workers=chosen.get("minddata", main), field=field)


def local_rank() -> int:
    for name in ("LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


class WorkerAffinity:
    """A picklable DataLoader ``worker_init_fn``: bind the worker, then run the original init."""

    def __init__(self, cpus: list[int], inner: Optional[Callable[[int], Any]] = None) -> None:
        self.cpus, self.inner = list(cpus), inner

    def __call__(self, worker_id: int) -> None:
        os.sched_setaffinity(0, self.cpus)
        if self.inner is not None:
            self.inner(worker_id)


def bind_dataloader_workers(loaders: Any, cpus: list[int]) -> Any:
    """Give every DataLoader in ``loaders`` (one, or a list/tuple/dict of them) a worker init that
    binds its workers to ``cpus``. Returns ``loaders``."""
    from torch.utils.data import DataLoader

    items = loaders.values() if isinstance(loaders, dict) else (
        loaders if isinstance(loaders, (list, tuple)) else [loaders])
    for dl in items:
        if isinstance(dl, DataLoader) and not isinstance(dl.worker_init_fn, WorkerAffinity):
            dl.worker_init_fn = WorkerAffinity(cpus, dl.worker_init_fn)
    return loaders


class CPUAffinity(Callback):
    """Bind this rank's process (in ``setup``, before data workers start) and its DataLoader workers
    (through their ``worker_init_fn``) to the CPUs of ``context.affinity_config``.

    The spec is validated for all devices at construction, so a bad spec fails before training."""

    def __init__(self, spec: Any, rank: Optional[int] = None) -> None:
        self.rank = local_rank() if rank is None else rank
        self.plan = plan_affinity(spec, self.rank)
        self.supported = hasattr(os, "sched_setaffinity")

    def apply_to_process(self) -> None:
        if self.plan is None:
            return
        if not self.supported:
            emit(f"WARNING: {FIELD}: CPU affinity needs Linux; not applied", error=True)
            return
        os.sched_setaffinity(0, self.plan.main)
        emit(f"cpu affinity: local rank {self.rank}: process -> CPUs {self.plan.main}, "
             f"data workers -> CPUs {self.plan.workers}")

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.apply_to_process()
        if self.plan is None or not self.supported or self.plan.workers == self.plan.main:
            return   # workers inherit the process's affinity when they start
        # The train DataLoader is created (and its workers started) after ``setup``; wrap the hook
        # that creates it so its workers bind themselves first thing.
        owner = trainer.datamodule if getattr(trainer, "datamodule", None) is not None else pl_module
        create = owner.train_dataloader
        cpus = self.plan.workers

        def train_dataloader() -> Any:
            return bind_dataloader_workers(create(), cpus)

        owner.train_dataloader = train_dataloader

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        # Loaders Lightning rebuilt (e.g. to add a sampler) keep the binding for later epochs.
        if self.plan is not None and self.supported and self.plan.workers != self.plan.main:
            bind_dataloader_workers(trainer.train_dataloader, self.plan.workers)
