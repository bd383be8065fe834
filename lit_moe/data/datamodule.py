"""The LightningDataModule: whole optimizer steps of ``A`` micro-batches of ``local_batch_size`` samples,
sharded by data-parallel rank.

Order. The dataset's global sample order (GPTDataset's own shuffle; with ``shuffle: true`` also a
per-epoch permutation seeded by ``training.seed``) is dealt out to data-parallel ranks as MindSpore's
distributed sampler does it: rank ``d`` of ``D`` reads global samples ``d, d+D, d+2D, …`` and batches
them ``local_batch_size`` at a time. So global micro-batch ``k`` (all ranks together) is global samples
``[k·D·b, (k+1)·D·b)``. Ranks of one tensor/context/expert-parallel group have the same data-parallel
rank and get identical batches. When the dataset is exhausted the next epoch starts again from the top.

Steps. The micro-batches of successive epochs form one stream; each optimizer step takes the next ``A``
of them (:class:`StepSampler`: ``A`` from ``training.global_batch_size``, or with a ramp-up from the
samples consumed before the step), and the loader yields one step at a time: a list of ``A``
micro-batch dicts, which Lightning moves to the device as it moves any batch (one ``training_step``
call is one optimizer step). A Lightning epoch ends after the step that leaves fewer micro-batches in
the data epoch than the next step takes; the next Lightning epoch's first step takes those and goes on
with the next data epoch's first micro-batches (a step straddles the epoch end; in the last epoch,
``max_epochs``, they are not trained on).

Resume. Consumed samples are the sampler's position: every step that reaches the device (Lightning's
``on_after_batch_transfer``) moves it by its samples (``len(micro-batch) · D`` each). ``state_dict()``
holds ``consumed_samples`` and Lightning saves it in checkpoints; after ``load_state_dict`` the next
iterator starts at exactly the next global sample (position ``consumed_samples`` modulo the epoch
length; the data-parallel size may even change between runs). Code that knows better (e.g. a
checkpoint loader) may also set ``datamodule.consumed_samples`` directly.
"""

from __future__ import annotations

import os
import random
import sys
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, DistributedSampler

from lit_moe.config import ConfigError, TrainDatasetConfig
from lit_moe.data.loader import DataloaderSpec, build_from_spec, parse_dataloader

TENSOR_DTYPES = {
    "input_ids": torch.int64,
    "labels": torch.int64,
    "loss_mask": torch.float32,
    "position_ids": torch.int64,
    "attention_mask": torch.bool,
    "actual_seq_len": torch.int32,
}


def step_samples(step: list[dict[str, torch.Tensor]]) -> int:
    """Samples of one rank's step (its micro-batches' batch sizes summed)."""
    return sum(int(next(iter(b.values())).shape[0]) for b in step)


def collate_samples(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Stack samples into ``[B, …]`` tensors with the dtypes of the model's keyword arguments."""
    out = {}
    for key in samples[0]:
        stacked = torch.from_numpy(np.stack([s[key] for s in samples]))
        out[key] = stacked.to(TENSOR_DTYPES.get(key, stacked.dtype))
    return out


class _Position:
    """Shared, mutable count of consumed samples (read by the sampler when an epoch starts)."""

    def __init__(self) -> None:
        self.consumed_samples = 0


class MegatronSampler(DistributedSampler):
    """Indices of one data-parallel rank, starting at the consumed-samples position.

    The training loader reads it through :class:`StepSampler` (whole steps). A ``DistributedSampler``
    subclass only so that Lightning leaves a loader built on it in place instead of injecting its own;
    none of the parent's logic is used."""

    def __init__(self, num_samples: int, num_replicas: int, rank: int, micro_batch_size: int,
                 drop_last: bool, shuffle: bool, seed: int, position: _Position, pad_shards: bool = False) -> None:
        # DistributedSampler.__init__ wants a process group; set the attributes Lightning may read instead.
        self.dataset_size = num_samples
        self.num_replicas = num_replicas
        self.rank = rank
        self.micro_batch_size = micro_batch_size
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = position
        D, b, N = num_replicas, micro_batch_size, num_samples
        # Samples each rank reads per epoch: whole micro-batches only, or ceil(N/D) wrapping around
        # to the first samples (MindSpore pads shards the same way). pad_shards (MindDataset): every
        # rank's shard is padded to ceil(N/D) first and then cut to whole micro-batches, as MindSpore's
        # MindDataset shards (rank d reads d, d+D, ... wrapping) and batches (drop_remainder) them.
        if pad_shards:
            self.per_rank = (-(-N // D) // b) * b if drop_last else -(-N // D)
        else:
            self.per_rank = (N // (D * b)) * b if drop_last else -(-N // D)
        if self.per_rank == 0:
            raise ConfigError(f"train_dataset: {N} samples cannot fill one micro-batch of {b} on each of "
                              f"{D} data-parallel ranks (drop_remainder: true); raise train_dataset.dataloader.sizes[0]")
        self.epoch_length = self.per_rank * D
        self.num_samples = self.per_rank
        self.total_size = self.epoch_length

    def _start(self) -> tuple[int, int]:
        consumed = self.position.consumed_samples
        epoch, within = divmod(consumed, self.epoch_length)
        if within % self.num_replicas:
            raise ValueError(f"consumed_samples {consumed} is not a multiple of the data-parallel size "
                             f"{self.num_replicas}")
        return epoch, within // self.num_replicas

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.dataset_size, dtype=np.int64)
        return np.random.RandomState((self.seed + epoch) % (1 << 32)).permutation(self.dataset_size)

    def __iter__(self) -> Iterator[int]:
        epoch, first = self._start()
        order = self.order(epoch)
        positions = np.arange(first, self.per_rank, dtype=np.int64) * self.num_replicas + self.rank
        return iter(order[positions % self.dataset_size].tolist())

    def __len__(self) -> int:
        return self.per_rank - self._start()[1]

    def set_epoch(self, epoch: int) -> None:
        # The epoch follows from consumed_samples; Lightning's counter is ignored.
        self.epoch = epoch


class StepSampler:
    """A batch sampler of whole optimizer steps: each item is this rank's ``A`` micro-batches of one step
    (lists of sample indices), ``A = accumulation(samples consumed before the step)``; from
    ``constant_from`` consumed samples on, ``A`` no longer changes.

    The micro-batches of one data epoch are this rank's positions from the sampler's start (the first
    epoch) or from 0, cut ``micro_batch_size`` at a time (a short last one dropped with ``drop_last``);
    the epochs form one stream. An iteration starts at the consumed-samples position; its first step
    may run over into the next data epoch, and it ends after the step that leaves fewer micro-batches
    in the data epoch than the next step takes (module docstring)."""

    def __init__(self, sampler: MegatronSampler, accumulation: Callable[[int], int], constant_from: int = 0) -> None:
        self.sampler = sampler
        self.position = sampler.position
        self.accumulation = accumulation
        self.constant_from = constant_from

    def _count(self, first: int) -> int:
        """Micro-batches of an epoch read from rank position ``first``."""
        s = self.sampler
        left = max(s.per_rank - first, 0)
        return left // s.micro_batch_size if s.drop_last else -(-left // s.micro_batch_size)

    def _cut(self, first: int, k: int) -> tuple[int, int]:
        """``[start, stop)`` rank positions of micro-batch ``k`` of an epoch read from ``first``."""
        start = first + k * self.sampler.micro_batch_size
        return start, min(start + self.sampler.micro_batch_size, self.sampler.per_rank)

    def _steps(self) -> Iterator[tuple[list[tuple[int, int, int]], int, int]]:
        """This iteration's steps: (micro-batches as ``(epoch, start, stop)``, micro-batches left in the
        data epoch after it, consumed samples after it)."""
        epoch, first = self.sampler._start()
        consumed = self.position.consumed_samples
        count, k = self._count(first), 0
        while True:
            step = []
            for _ in range(self.accumulation(consumed)):
                if k == count:   # only the first step gets here: it goes on with the next epoch
                    epoch, first, k = epoch + 1, 0, 0
                    count = self._count(0)
                step.append((epoch, *self._cut(first, k)))
                k += 1
            consumed += sum(z - a for _, a, z in step) * self.sampler.num_replicas
            yield step, count - k, consumed
            if count - k < self.accumulation(consumed):
                return

    def __iter__(self) -> Iterator[list[list[int]]]:
        s = self.sampler
        orders: dict[int, np.ndarray] = {}
        for step, _, _ in self._steps():
            micro_batches = []
            for epoch, a, z in step:
                if epoch not in orders:
                    orders[epoch] = s.order(epoch)
                positions = np.arange(a, z, dtype=np.int64) * s.num_replicas + s.rank
                micro_batches.append(orders[epoch][positions % s.dataset_size].tolist())
            yield micro_batches

    def __len__(self) -> int:
        n = 0
        for _, left, consumed in self._steps():
            n += 1
            if consumed >= self.constant_from:   # the same A from here on: the rest by arithmetic
                return n + left // self.accumulation(consumed)
        return n


class _Resumable:
    """Lightning treats a loader with ``state_dict``/``load_state_dict`` as resumable (no mid-epoch
    warning) and saves that state with its loops; it is the sampler's consumed-samples position, the
    DataModule's count."""

    batch_sampler: StepSampler

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.batch_sampler.position.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batch_sampler.position.consumed_samples = int(state.get("consumed_samples", 0))


class MicroBatches:
    """The dataset as a torch DataLoader with a :class:`StepSampler` reads it: item ``indices`` (one
    micro-batch's sample indices) is that micro-batch, collated."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        return collate_samples([self.dataset[i] for i in indices])

    def __len__(self) -> int:
        return len(self.dataset)


def as_step(micro_batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The collate function of a step: its micro-batches, already collated, as a list."""
    return list(micro_batches)


class MegatronDataLoader(_Resumable, DataLoader):
    """``python_multiprocessing: true``: a torch DataLoader with worker processes (each reads whole
    steps) and its own ``generator`` (creating an iterator never draws from the global random
    generators)."""


class ThreadedLoader(_Resumable):
    """``python_multiprocessing: false``: micro-batches are read by a pool of threads (MindSpore's
    multithreaded GeneratorDataset), in order, with up to ``workers · prefetch`` micro-batches in
    flight; yields whole steps."""

    def __init__(self, dataset, batch_sampler: StepSampler, workers: int, prefetch: int, thread_init=None) -> None:
        self.dataset = dataset
        self.batch_sampler = batch_sampler
        self.workers = max(1, workers)
        self.prefetch = max(1, prefetch)
        self.thread_init = thread_init

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def _load(self, batch: list[int]) -> dict[str, torch.Tensor]:
        return collate_samples([self.dataset[i] for i in batch])

    def __iter__(self):
        if self.workers <= 1 and self.thread_init is None:
            for step in self.batch_sampler:
                yield [self._load(b) for b in step]
            return
        pending: deque = deque()
        with ThreadPoolExecutor(self.workers, initializer=self.thread_init) as pool:
            depth = self.workers * self.prefetch
            it = ((k, b) for k, step in enumerate(self.batch_sampler) for b in step)
            for kb in it:
                pending.append((kb[0], pool.submit(self._load, kb[1])))
                if len(pending) >= depth:
                    break
            step: list = []
            while pending:
                k, future = pending.popleft()
                step.append(future.result())
                nxt = next(it, None)
                if nxt is not None:
                    pending.append((nxt[0], pool.submit(self._load, nxt[1])))
                if not pending or pending[0][0] != k:
                    yield step
                    step = []


# ----------------------------------------------------------------------------------------------
# NUMA
# ----------------------------------------------------------------------------------------------
def _parse_cpulist(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_cpus(device: Optional[torch.device], sysfs: str = "/sys") -> tuple[Optional[set[int]], str]:
    """(CPUs of the NUMA node of ``device`` that this process may use, or None with the reason).

    Looks the device's PCI address up in sysfs, as ``torch.numa`` does; a node of −1 (single-node
    machines) is node 0."""
    if not sys.platform.startswith("linux"):
        return None, f"NUMA binding is only done on Linux (this is {sys.platform})"
    if device is None or device.type != "cuda":
        return None, f"cannot find the NUMA node of device {device} (only CUDA devices are looked up)"
    try:
        props = torch.cuda.get_device_properties(device.index or 0)
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        with open(os.path.join(sysfs, "bus/pci/devices", bus, "numa_node")) as f:
            node = max(int(f.read().strip()), 0)
        with open(os.path.join(sysfs, f"devices/system/node/node{node}/cpulist")) as f:
            cpus = _parse_cpulist(f.read())
    except (AttributeError, OSError, ValueError, RuntimeError, AssertionError) as err:
        return None, f"cannot find the NUMA node of {device} ({err})"
    cpus &= os.sched_getaffinity(0)
    if not cpus:
        return None, f"none of the CPUs of NUMA node {node} ({device}) are available to this process"
    return cpus, ""


class _WorkerInit:
    """Seeds a data worker (from ``training.seed``, the rank and the worker id) and binds it to the
    NUMA CPUs; a class, not a closure, so spawned workers can unpickle it."""

    def __init__(self, seed: int, rank: int, cpus: Optional[set[int]]) -> None:
        self.seed, self.rank, self.cpus = seed, rank, cpus

    def __call__(self, worker_id: int = 0) -> None:
        s = (self.seed + 1000 * self.rank + worker_id) % (1 << 32)
        random.seed(s)
        np.random.seed(s)
        torch.manual_seed(s)
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ----------------------------------------------------------------------------------------------
# the DataModule
# ----------------------------------------------------------------------------------------------
class MegatronDataModule(LightningDataModule):
    """Megatron/MindFormers data for Lightning.

    Args:
        train_dataset: the ``train_dataset`` section.
        local_batch_size: samples per micro-batch on each rank (``training.local_batch_size``).
        seed: ``training.seed``: seeds the data workers and the per-epoch order of ``shuffle: true``
            (the GPTDataset shuffle uses ``dataloader.config.seed``, default 1234, as in MindFormers).
        seq_length: ``model.seq_length``; fills or must match ``dataloader.config.seq_length``.
        accumulation_steps: micro-batches per optimizer step on each rank (``A``).
        batch_ramp: ``training.rampup_batch_size`` (:class:`~lit_moe.optim.schedules.BatchRamp`): each step's
            ``A`` from the samples consumed before it; None: ``accumulation_steps`` throughout.

    The data-parallel rank and size come from ``trainer.strategy.distributed_sampler_kwargs`` in
    ``setup()`` (absent or None: one replica).
    """

    def __init__(self, train_dataset: TrainDatasetConfig, local_batch_size: int, seed: int,
                 seq_length: Optional[int] = None, accumulation_steps: int = 1, batch_ramp: Any = None) -> None:
        super().__init__()
        if isinstance(local_batch_size, bool) or not isinstance(local_batch_size, int) or local_batch_size < 1:
            raise ConfigError(f"training.local_batch_size: expected an int >= 1, got {local_batch_size!r}")
        for name in ("num_parallel_workers", "prefetch_size"):
            v = getattr(train_dataset, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"train_dataset.{name}: expected an int >= 0, got {v!r}")
        self.train_config = train_dataset
        self.local_batch_size = local_batch_size
        self.seed = seed
        self.seq_length = seq_length
        self.accumulation_steps = int(accumulation_steps)
        self.batch_ramp = batch_ramp
        # Validate the section now: configuration errors surface before any process starts.
        self.spec: DataloaderSpec = parse_dataloader(train_dataset.dataloader, seq_length)
        self._position = _Position()
        self.dp_rank = 0
        self.dp_size = 1
        self.datasets: Optional[tuple] = None

    # -- state ---------------------------------------------------------------------------------------
    @property
    def consumed_samples(self) -> int:
        """Global samples consumed by training so far (over all data-parallel ranks and epochs)."""
        return self._position.consumed_samples

    @consumed_samples.setter
    def consumed_samples(self, value: int) -> None:
        self._position.consumed_samples = int(value)

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.consumed_samples = int(state_dict.get("consumed_samples", 0))

    def accumulation_at(self, consumed_samples: int) -> int:
        """``A`` of the step that starts after ``consumed_samples`` global samples."""
        if self.batch_ramp is None:
            return self.accumulation_steps
        return self.batch_ramp.accumulation_at(consumed_samples)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """A training step reached the device: the position moves past its samples."""
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.training and isinstance(batch, list):
            self._position.consumed_samples += step_samples(batch) * self.dp_size
        return batch

    # -- setup ---------------------------------------------------------------------------------------
    def _data_parallel(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        kwargs = getattr(getattr(trainer, "strategy", None), "distributed_sampler_kwargs", None) if trainer else None
        if not kwargs:
            return 0, 1
        return int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1))

    def setup(self, stage: Optional[str] = None) -> None:
        self.dp_rank, self.dp_size = self._data_parallel()
        if self.datasets is None:
            self.datasets = build_from_spec(self.spec)

    def _device(self) -> Optional[torch.device]:
        trainer = getattr(self, "trainer", None)
        try:
            return trainer.strategy.root_device if trainer is not None else None
        except Exception:
            return None

    def _worker_setup(self):
        """(number of workers, per-worker init function) honouring num_parallel_workers and numa_enable."""
        cfg = self.train_config
        workers = min(cfg.num_parallel_workers, available_cpus())
        cpus = None
        if cfg.numa_enable:
            cpus, why = numa_cpus(self._device())
            if cpus is None:
                warnings.warn(f"train_dataset.numa_enable: {why}; data workers are not bound", stacklevel=2)
        init = _WorkerInit(self.seed, self.dp_rank, cpus)
        return workers, init, cpus

    def train_dataloader(self):
        if self.datasets is None:
            self.setup("fit")
        train = self.datasets[0]
        if train is None:
            raise ConfigError("train_dataset.dataloader.sizes[0]: the train split is empty (size 0 or no "
                              "train documents in split); nothing to train on")
        sampler = MegatronSampler(len(train), self.dp_size, self.dp_rank, self.local_batch_size,
                                  self.train_config.drop_remainder, self.spec.shuffle, self.seed, self._position,
                                  pad_shards=getattr(self.spec, "pad_shards", False))
        ramp = self.batch_ramp
        steps = StepSampler(sampler, self.accumulation_at, 0 if ramp is None else ramp.rampup_samples + 1)
        workers, init, cpus = self._worker_setup()
        prefetch = max(1, self.train_config.prefetch_size)
        if not self.spec.python_multiprocessing:
            thread_init = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
            return ThreadedLoader(train, steps, workers, prefetch, thread_init)
        return MegatronDataLoader(
            MicroBatches(train), batch_sampler=steps,
            num_workers=workers, collate_fn=as_step, worker_init_fn=init if workers else None,
            prefetch_factor=prefetch if workers else None, persistent_workers=False, pin_memory=False,
            # Its own generator: creating an iterator draws the workers' base seed, and from the global
            # generator a loader without one would shift the run's random draws (dropout) whenever an
            # iterator is created, e.g. right after a resume restored them. The value it draws is
            # overridden in every worker by _WorkerInit.
            generator=torch.Generator().manual_seed(self.seed % (1 << 63)))
