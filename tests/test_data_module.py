"""MegatronDataModule: rank sharding, worker modes, resume continuity, shuffle, remainder, errors."""

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lit_moe.config import ConfigError, TrainDatasetConfig
from lit_moe.data import MegatronDataModule, build_datasets
from lit_moe.data.indexed import write_indexed_dataset
from test_data_support import dataloader_section, make_documents


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    path = tmp_path_factory.mktemp("dm")
    return write_indexed_dataset(os.path.join(str(path), "docs"), make_documents(40, seed=31, max_len=30), np.uint16)


def train_config(prefix, sizes=(30, 0, 0), multiprocessing=False, workers=0, shuffle=False, drop=True,
                 columns=("input_ids", "labels", "loss_mask", "position_ids"), **config):
    section = dataloader_section(8, [prefix], sizes=sizes, columns=list(columns), **config)
    section.update(shuffle=shuffle, python_multiprocessing=multiprocessing)
    return TrainDatasetConfig(dataloader=section, drop_remainder=drop, num_parallel_workers=workers, prefetch_size=2)


def fake_trainer(rank=0, replicas=1):
    kwargs = {"num_replicas": replicas, "rank": rank} if replicas else None
    return SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs=kwargs, root_device=torch.device("cpu")),
                           training=True)


def module(cfg, batch=2, rank=0, replicas=1, seed=42, consumed=0):
    dm = MegatronDataModule(cfg, batch, seed)
    dm.trainer = fake_trainer(rank, replicas)
    dm.setup("fit")
    dm.consumed_samples = consumed
    return dm


def take(dm, n, count=True):
    """The micro-batches of the first n steps of a fresh iterator (one micro-batch a step unless the
    DataModule says otherwise), counted as consumed (as Lightning would)."""
    out = []
    for step in dm.train_dataloader():
        if len(out) == n:
            break
        if count:
            dm.on_after_batch_transfer(step, 0)
        out += step
    return out


def global_samples(prefix, **kw):
    train = build_datasets(train_config(prefix, **kw).dataloader)[0]
    return [train[i] for i in range(len(train))]


def test_batches_are_the_strided_shard_of_the_global_order(prefix):
    D, b = 3, 2
    samples = global_samples(prefix)
    for rank in range(D):
        dm = module(train_config(prefix), batch=b, rank=rank, replicas=D)
        batches = take(dm, 4, count=False)
        for k, batch in enumerate(batches):
            for j in range(b):
                expected = samples[(k * b + j) * D + rank]
                for key in batch:
                    np.testing.assert_array_equal(batch[key][j].numpy(), expected[key])


def test_all_ranks_together_read_each_global_micro_batch_once(prefix):
    D, b = 4, 2
    samples = global_samples(prefix)
    per_rank = [take(module(train_config(prefix), b, r, D), 3, count=False) for r in range(D)]
    for k in range(3):
        got = sorted(tuple(x.tolist()) for r in range(D) for x in per_rank[r][k]["input_ids"])
        want = sorted(tuple(samples[i]["input_ids"].tolist()) for i in range(k * D * b, (k + 1) * D * b))
        assert got == want


def test_same_dp_rank_same_batches_in_every_worker_mode(prefix):
    """Ranks of one tp/cp/ep group share a dp rank: identical batches, whether read by threads or processes."""
    runs = [take(module(train_config(prefix, multiprocessing=mp, workers=w), 2, 1, 2), 6, count=False)
            for mp, w in [(False, 0), (False, 2), (True, 2), (True, 0)]]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert a.keys() == b.keys()
            for key in a:
                assert torch.equal(a[key], b[key])


def test_batch_dtypes_and_shapes(prefix):
    cfg = train_config(prefix, columns=("input_ids", "labels", "loss_mask", "position_ids", "actual_seq_len",
                                        "attention_mask"), create_attention_mask=True,
                       create_compressed_eod_mask=True, eod_pad_length=16)
    batch = take(module(cfg, batch=3), 1, count=False)[0]
    assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].shape == (3, 8)
    assert batch["labels"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32
    assert batch["position_ids"].dtype == torch.int64
    assert batch["attention_mask"].dtype == torch.bool and batch["attention_mask"].shape == (3, 1, 8, 8)
    assert batch["actual_seq_len"].dtype == torch.int32 and batch["actual_seq_len"].shape == (3, 16)


def test_resume_continues_with_the_next_sample_across_epochs(prefix):
    D, b = 2, 2
    cfg = train_config(prefix)
    n_batches = 3 * len(global_samples(prefix)) // (D * b)  # about three epochs
    reference = take(module(cfg, b, 1, D), n_batches)
    first = module(cfg, b, 1, D)
    head = take(first, 13)
    state = first.state_dict()
    assert state == {"consumed_samples": 13 * D * b}
    resumed = MegatronDataModule(cfg, b, 42)
    resumed.trainer = fake_trainer(1, D)
    resumed.setup("fit")
    resumed.load_state_dict(state)
    tail = []
    while len(head) + len(tail) < n_batches:  # epochs restart as Lightning restarts the iterator
        tail += take(resumed, n_batches - len(head) - len(tail))
    for a, c in zip(head + tail, reference):
        assert torch.equal(a["input_ids"], c["input_ids"])


def _steps_over_epochs(dm, n_steps):
    """The first ``n_steps`` steps (lists of micro-batches) over as many loader iterations (Lightning
    epochs) as they take, each counted as consumed; also each iteration's length when it began and its
    number of steps."""
    steps, lengths = [], []
    while len(steps) < n_steps:
        loader = dm.train_dataloader()
        before, length = len(steps), len(loader)
        for step in loader:
            if len(steps) == n_steps:
                break
            dm.on_after_batch_transfer(step, 0)
            steps.append(step)
        lengths.append((length, len(steps) - before))
    return steps, lengths


@pytest.mark.parametrize("ramp", [None, (4, 4, 24, 12, 4)], ids=["A=3", "ramp A=1..3"])
def test_steps_are_consecutive_micro_batches_of_the_stream_across_epochs(prefix, ramp):
    """A step is the next A micro-batches of the stream of epochs (A = 3, or a ramp-up 4 → 12 samples
    with A 1, 2, 3 from the samples consumed before each step), however the loader's iterations (Lightning
    epochs) cut it: a step that the epoch's end leaves short opens the next iteration and goes on with
    the next epoch's first micro-batches; each iteration's length is its number of steps; a resume from a
    step in the middle of the stream (a dp-2 rank) continues with the same steps."""
    from lit_moe.optim.schedules import BatchRamp

    D, b = 2, 2
    cfg = train_config(prefix, shuffle=True)     # epochs differ: a step reading the wrong one shows
    ramp = None if ramp is None else BatchRamp(*ramp)
    accumulation = [3] * 30 if ramp is None else [ramp.accumulation_at(ramp.samples_after(k)) for k in range(30)]
    single, _ = _steps_over_epochs(module(cfg, b, 1, D), sum(accumulation))
    stream = [mb for (mb,) in single]                              # one micro-batch a step: the stream
    dm = MegatronDataModule(cfg, b, 42, accumulation_steps=3, batch_ramp=ramp)
    dm.trainer = fake_trainer(1, D)
    dm.setup("fit")
    steps, lengths = _steps_over_epochs(dm, 30)
    assert [len(step) for step in steps] == accumulation
    assert len(lengths) > 3 and all(length == got for length, got in lengths[:-1]), lengths
    flat = [mb for step in steps for mb in step]
    for got, want in zip(flat, stream, strict=True):
        assert torch.equal(got["input_ids"], want["input_ids"])
    per_epoch = len(global_samples(prefix)) // (D * b)              # micro-batches of one epoch
    assert per_epoch % 3 and len(lengths) > 3   # epochs end inside steps: those straddle
    assert dm.consumed_samples == sum(accumulation) * D * b
    resumed = MegatronDataModule(cfg, b, 42, accumulation_steps=3, batch_ramp=ramp)
    resumed.trainer = fake_trainer(1, D)
    resumed.setup("fit")
    resumed.consumed_samples = sum(accumulation[:13]) * D * b
    again, _ = _steps_over_epochs(resumed, 17)
    for got, want in zip([mb for step in again for mb in step], flat[sum(accumulation[:13]):], strict=True):
        assert torch.equal(got["input_ids"], want["input_ids"])


def test_resume_with_another_data_parallel_size_keeps_the_global_order(prefix):
    samples = global_samples(prefix)
    dm = module(train_config(prefix), batch=2, rank=0, replicas=1)
    take(dm, 5)  # 10 samples consumed on one rank
    for rank in range(2):  # now two ranks
        nxt = take(module(train_config(prefix), 1, rank, 2, consumed=dm.consumed_samples), 1, count=False)[0]
        np.testing.assert_array_equal(nxt["input_ids"][0].numpy(), samples[10 + rank]["input_ids"])


def test_resume_through_lightning_checkpoint(prefix, tmp_path):
    import lightning.pytorch as L

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.seen = []

        def training_step(self, batch, batch_idx):
            self.seen.append(batch[0]["input_ids"].clone())
            return (self.w ** 2).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def trainer(steps):
        return L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)

    cfg = train_config(prefix, workers=2, multiprocessing=True)
    steps = len(global_samples(prefix)) // 4 + 5  # crosses an epoch
    ref = Recorder()
    trainer(steps).fit(ref, MegatronDataModule(cfg, 4, 42))
    part1, dm1 = Recorder(), MegatronDataModule(cfg, 4, 42)
    t = trainer(7)
    t.fit(part1, dm1)
    assert dm1.consumed_samples == 28
    t.save_checkpoint(tmp_path / "c.ckpt")
    part2, dm2 = Recorder(), MegatronDataModule(cfg, 4, 42)
    trainer(steps).fit(part2, dm2, ckpt_path=tmp_path / "c.ckpt")
    assert len(part1.seen) + len(part2.seen) == len(ref.seen) == steps
    for a, b in zip(part1.seen + part2.seen, ref.seen):
        assert torch.equal(a, b)
    assert dm2.consumed_samples == steps * 4


def test_drop_remainder_false_pads_shards_like_mindspore(prefix):
    n = len(global_samples(prefix))
    D, b = 3, 4
    per_rank = -(-n // D)
    for rank in range(D):
        dm = module(train_config(prefix, drop=False), b, rank, D)
        got = [row for batch in take(dm, 10 ** 6, count=False) for row in batch["input_ids"]]
        assert len(got) == per_rank
        samples = global_samples(prefix)
        for p, row in enumerate(got):
            np.testing.assert_array_equal(row.numpy(), samples[(p * D + rank) % n]["input_ids"])
    full = module(train_config(prefix, drop=True), b, 0, D)
    assert len(list(full.train_dataloader())) == n // (D * b)


def test_shuffle_reorders_each_epoch_deterministically(prefix):
    samples = global_samples(prefix)
    n = len(samples)
    ids = {tuple(s["input_ids"].tolist()): i for i, s in enumerate(samples)}

    def order(seed, consumed):
        dm = module(train_config(prefix, shuffle=True), 1, 0, 1, seed=seed, consumed=consumed)
        return [ids[tuple(b["input_ids"][0].tolist())] for b in take(dm, n, count=False)]

    epoch0, again, epoch1 = order(42, 0), order(42, 0), order(42, n)
    assert sorted(epoch0) == list(range(n)) and epoch0 != list(range(n))
    assert epoch0 == again
    assert sorted(epoch1) == list(range(n)) and epoch1 != epoch0
    assert order(7, 0) != epoch0


def test_without_a_strategy_one_replica(prefix):
    dm = MegatronDataModule(train_config(prefix), 2, 42)
    dm.trainer = fake_trainer(replicas=None)
    dm.setup("fit")
    assert (dm.dp_rank, dm.dp_size) == (0, 1)


def test_numa_enable_without_a_device_warns(prefix):
    cfg = train_config(prefix)
    cfg.numa_enable = True
    dm = module(cfg)
    with pytest.warns(UserWarning, match="numa_enable"):
        dm.train_dataloader()


def test_configuration_errors(prefix):
    with pytest.raises(ConfigError, match="local_batch_size"):
        MegatronDataModule(train_config(prefix), 0, 42)
    cfg = train_config(prefix)
    cfg.num_parallel_workers = -1
    with pytest.raises(ConfigError, match="num_parallel_workers"):
        MegatronDataModule(cfg, 1, 42)
    cfg = train_config(prefix)
    cfg.dataloader["type"] = "HFDataLoader"
    with pytest.raises(ConfigError, match=r"dataloader\.type: 'HFDataLoader' is not supported"):
        MegatronDataModule(cfg, 1, 42)
    with pytest.raises(ConfigError, match=r"'attention_mask' is not produced \(create_attention_mask is false\)"):
        MegatronDataModule(train_config(prefix, columns=("input_ids", "attention_mask")), 1, 42)
    cfg = train_config(prefix)
    cfg.dataloader["sizes"] = [100, -1]
    with pytest.raises(ConfigError, match=r"sizes\[1\]"):
        MegatronDataModule(cfg, 1, 42)
    with pytest.raises(ConfigError, match="seq_length"):
        MegatronDataModule(train_config(prefix), 1, 42, seq_length=16)
    empty = module(train_config(prefix, sizes=(0, 0, 0)))
    with pytest.raises(ConfigError, match=r"sizes\[0\]"):
        empty.train_dataloader()
    with pytest.raises(ConfigError, match="cannot fill one micro-batch"):
        module(train_config(prefix), batch=1000).train_dataloader()


def _affinity_after_init(init):
    import multiprocessing as mp

    with mp.get_context("fork").Pool(1) as pool:
        return pool.apply_async(_run_init, (init,)).get(timeout=60)


def _run_init(init):
    init(0)
    return sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux CPU affinity API")
def test_numa_lookup_and_worker_binding(prefix, tmp_path, monkeypatch):
    import lit_moe.data.datamodule as datamodule

    # a fake sysfs: the GPU at 0000:1a:00.0 sits on node 1, whose CPUs include one we may use
    allowed = sorted(os.sched_getaffinity(0))
    (tmp_path / "bus/pci/devices/0000:1a:00.0").mkdir(parents=True)
    (tmp_path / "bus/pci/devices/0000:1a:00.0/numa_node").write_text("1\n")
    (tmp_path / "devices/system/node/node1").mkdir(parents=True)
    (tmp_path / "devices/system/node/node1/cpulist").write_text(f"{allowed[0]},{max(allowed) + 1}-{max(allowed) + 8}\n")
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1A, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    cpus, why = datamodule.numa_cpus(torch.device("cuda", 0), sysfs=str(tmp_path))
    assert cpus == {allowed[0]}, why
    assert datamodule.numa_cpus(torch.device("cuda", 0), sysfs=str(tmp_path / "none"))[0] is None
    assert datamodule._parse_cpulist("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}

    monkeypatch.setattr(datamodule, "numa_cpus", lambda device: ({allowed[0]}, ""))
    cfg = train_config(prefix, multiprocessing=True, workers=1)
    cfg.numa_enable = True
    workers, init, bound = module(cfg)._worker_setup()
    assert bound == {allowed[0]}
    assert _affinity_after_init(init) == [allowed[0]]


def test_torch_loader_iterators_leave_the_global_generators_alone(prefix):
    """python_multiprocessing: true uses a torch DataLoader; creating its iterator draws the workers'
    base seed, from the loader's own generator. A resume restores the RNG state before Lightning
    builds the iterator, so a draw from the global generator would shift dropout after a resume."""
    import random

    loader = module(train_config(prefix, multiprocessing=True)).train_dataloader()
    assert loader.generator is not None
    torch.manual_seed(5)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    for _ in range(2):
        next(iter(loader))
    assert torch.equal(torch.get_rng_state(), before[0])
    assert np.array_equal(np.random.get_state()[1], before[1]) and random.getstate() == before[2]
    # the check can fail: a loader without its own generator does draw from the global one
    from torch.utils.data import DataLoader

    iter(DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, collate_fn=loader.collate_fn))
    assert not torch.equal(torch.get_rng_state(), before[0])
