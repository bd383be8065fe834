"""recompute_comm on two processes (gloo, CPU): a real sequence all-gather in front of a
column-parallel matmul (the strategy's ``comm.all_gather`` exposed as a callable attribute) is
re-communicated in backward instead of kept, with gradients bitwise equal to keeping it.

Run by pytest (it starts this file as a script, which spawns the two ranks)."""

import functools
import os
import subprocess
import sys

import torch
from torch import nn

WORLD = 2


class SPAttention(nn.Module):
    """Sequence-parallel in, sequence-parallel out: gather the sequence, column matmul, row matmul,
    reduce-scatter the sequence (Megatron SP), with the collectives as addressable callables."""

    def __init__(self, h, group):
        super().__init__()
        from lit_moe.strategies import comm

        self.q_proj = nn.Linear(h, 2 * h // WORLD, bias=False)  # local column shard
        self.o_proj = nn.Linear(2 * h // WORLD, h, bias=False)  # local row shard
        self.all_gather = functools.partial(comm.all_gather, group=group, dim=1)
        self.reduce_scatter = functools.partial(comm.reduce_scatter, group=group, dim=1)

    def forward(self, x):
        return self.reduce_scatter(self.o_proj(torch.tanh(self.q_proj(self.all_gather(x)))))


class Layer(nn.Module):
    def __init__(self, h, group):
        super().__init__()
        self.self_attention = SPAttention(h, group)

    def forward(self, x):
        return x + self.self_attention(x)


class Model(nn.Module):
    def __init__(self, h, group, n=3):
        super().__init__()
        self.layers = nn.ModuleList(Layer(h, group) for _ in range(n))

    def blocks(self):
        return list(self.layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def worker(rank: int, port: str):
    import torch.distributed as dist

    from lit_moe.strategies.recompute import apply_recompute

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    group = dist.group.WORLD
    calls = {"n": 0}
    real = dist.all_gather_into_tensor

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    dist.all_gather_into_tensor = counting
    b, s_local, h = 2, 8, 16
    x = torch.randn(b, s_local, h, generator=torch.Generator().manual_seed(rank))

    def run(recompute_comm):
        torch.manual_seed(100 + rank)  # different shards on different ranks, same for both runs
        model = Model(h, group)
        apply_recompute(model, None, recompute_comm)
        calls["n"] = 0
        loss = model(x.clone().requires_grad_())
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, calls["n"]

    loss_ref, grads_ref, n_ref = run(None)
    loss, grads, n = run({"enable": True, "select_module": {r"self_attention\.all_gather": ["0-2"]}})
    assert torch.equal(loss, loss_ref)
    for k in grads_ref:
        assert torch.equal(grads[k], grads_ref[k]), k
    # forward gathers once per layer; backward's reduce-scatter of the gather is not an all-gather,
    # but the reduce-scatter's backward is: 3 layers x (gather fwd + gather in reduce_scatter's bwd)
    assert n_ref == 3 + 3, n_ref
    assert n == n_ref + 3, n  # plus one re-gather per layer for q_proj's weight gradient
    dist.destroy_process_group()


def test_comm_recompute_regathers_in_backward_two_ranks():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ranks ok" in r.stdout


if __name__ == "__main__":
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    import lit_moe.strategies.recompute  # noqa: F401  (imported once, inherited by the forked ranks)

    mp.start_processes(worker, args=(port,), nprocs=WORLD, join=True, start_method="fork")
    print("ranks ok")
