"""Two CPU processes (gloo): AdamW (foreach) and Muon over parameters sharded as FSDP2 shards them
(DTensor, Shard(0)) on two different meshes, against the same optimizer on plain tensors in one process."""

import os

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from lit_moe.optim.optimizers import build_optimizer

SHAPES = {"q_proj.weight": (8, 6), "experts.gate_up_proj": (4, 6, 4), "norm.weight": (6,)}


def _tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _reference(section, steps=2):
    params = [(n, nn.Parameter(t)) for n, t in _tensors(0).items()]
    opt = build_optimizer(params, section, 0.05)
    for k in range(steps):
        for (n, p), g in zip(params, _tensors(k + 1).values()):
            p.grad = g
        opt.step()
    return {n: p.detach() for n, p in params}


SECTIONS = {"adamw-foreach": {"type": "AdamW", "foreach": True, "weight_decay": 0.1},
            "muon": {"type": "Muon", "weight_decay": 0.1}}


def _worker(rank, store_file, out_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    # a file rendezvous: no port to pick (a port picked free can be taken before rank 0 binds it)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    from lit_moe.runtime.distributed import release_process_groups_at_exit
    release_process_groups_at_exit()  # no gloo thread outlives the interpreter
    try:
        dense = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
        experts = init_device_mesh("cpu", (1, 2), mesh_dim_names=("ep", "efsdp"))
        mesh_of = {"experts.gate_up_proj": experts}
        place_of = {"experts.gate_up_proj": [Shard(0), Shard(0)]}

        def shard(name, t):
            return distribute_tensor(t, mesh_of.get(name, dense), place_of.get(name, [Shard(0)]))

        results = {}
        for label, section in SECTIONS.items():
            params = [(n, nn.Parameter(shard(n, t))) for n, t in _tensors(0).items()]
            opt = build_optimizer(params, section, 0.05)
            for k in range(2):
                for (n, p), g in zip(params, _tensors(k + 1).values()):
                    p.grad = shard(n, g)
                opt.step()
            results[label] = {n: p.full_tensor() for n, p in params}
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_sharded_matches_single_process(tmp_path):
    out = tmp_path / "full.pt"
    mp.start_processes(_worker, args=(str(tmp_path / "store"), str(out)), nprocs=2, join=True, start_method="fork")
    got = torch.load(out, weights_only=True)
    for label, section in SECTIONS.items():
        ref = _reference(section)
        for n in SHAPES:
            # Muon's Newton-Schulz runs in bf16; a sharded matmul sums in another order
            tol = dict(rtol=0, atol=2e-3) if section["type"] == "Muon" and len(SHAPES[n]) == 2 else {}
            torch.testing.assert_close(got[label][n], ref[n], msg=f"{label} {n}", **tol)
