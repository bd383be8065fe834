"""recompute_comm on two processes (gloo, CPU): a real sequence all-gather in front of a
column-parallel matmul (the strategy's ``comm.all_gather`` exposed as a callable attribute) is
re-communicated in backward instead of kept, with gradients bitwise equal to keeping it.

Run by pytest (it starts this file as a script, which spawns the two ranks)."""

import functools
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import scaled  # noqa: E402
import launch_pool  # noqa: E402

WORLD = 2


CALLS = {"n": 0}


def counted(fn, *args, **kwargs):
    CALLS["n"] += 1
    return fn(*args, **kwargs)


class SPAttention(nn.Module):
    """Sequence-parallel in, sequence-parallel out: gather the sequence, column matmul, row matmul,
    reduce-scatter the sequence (Megatron SP), with the collectives as addressable callables."""

    def __init__(self, h, group):
        super().__init__()
        from lit_moe.strategies import comm

        self.q_proj = nn.Linear(h, 2 * h // WORLD, bias=False)  # local column shard
        self.o_proj = nn.Linear(2 * h // WORLD, h, bias=False)  # local row shard
        self.all_gather = comm.CommStep(functools.partial(counted, comm.all_gather, group=group, dim=1))
        self.reduce_scatter = comm.CommStep(functools.partial(comm.reduce_scatter, group=group, dim=1))

    def forward(self, x):
        # gelu saves its input, q_proj's output
        return self.reduce_scatter(self.o_proj(torch.nn.functional.gelu(self.q_proj(self.all_gather(x)))))


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


def worker(rank: int, store_file: str):
    import torch.distributed as dist

    from lit_moe.strategies.recompute import apply_recompute

    # a file rendezvous: no port to pick (a port picked free can be taken before rank 0 binds it)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=WORLD)
    from lit_moe.runtime.distributed import release_process_groups_at_exit
    release_process_groups_at_exit()  # no gloo thread outlives the interpreter
    torch.set_num_threads(1)
    group = dist.group.WORLD
    calls = CALLS  # calls of the gather functions (each call is one collective on the 2 ranks)
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
    assert n_ref == 3, n_ref  # one gather per layer in forward
    assert n == 6, n  # plus one re-gather per layer in backward, for q_proj's weight gradient

    # the same with DTensors: a redistribute Shard(seq) -> Replicate is the all-gather, and the
    # consumer is a DTensor op, so what it saves (and what backward gets back) is a DTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from lit_moe.strategies.comm import CommStep

    mesh = init_device_mesh("cpu", (WORLD,))

    def gather_dt(t):
        calls["n"] += 1  # DTensor redistributes with functional collectives: count the calls here
        return t.redistribute(mesh, [Replicate()])

    class DTLayer(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(7)  # replicated weight: the same on both ranks
            self.w = nn.Parameter(DTensor.from_local(torch.randn(h, h) * 0.3, mesh, [Replicate()]))
            self.all_gather = CommStep(gather_dt)

        def forward(self, t):
            return torch.tanh(self.all_gather(t) @ self.w).redistribute(mesh, [Shard(1)])

    class DTModel(Model):
        def __init__(self):
            nn.Module.__init__(self)
            self.layers = nn.ModuleList(DTLayer() for _ in range(3))

        def forward(self, t):
            for layer in self.layers:
                t = t + layer(t)
            return t.to_local().pow(2).mean()

    def run_dt(recompute_comm):
        model = DTModel()
        apply_recompute(model, None, recompute_comm)
        calls["n"] = 0
        xin = DTensor.from_local(x.clone(), mesh, [Shard(1)]).requires_grad_()
        loss = model(xin)
        loss.backward()
        return loss.detach(), {n: p.grad.to_local() for n, p in model.named_parameters()}, calls["n"]

    loss_ref, grads_ref, n_ref = run_dt(None)
    loss, grads, n = run_dt({"enable": True, "select_module": {"all_gather": ["0-2"]}})
    assert torch.equal(loss, loss_ref)
    for k in grads_ref:
        assert torch.equal(grads[k], grads_ref[k]), k
    assert (n_ref, n) == (3, 6), (n_ref, n)  # the replicated activation is gathered again in backward

    # FSDP2 after recompute (the parallelize order): its hooks stay outside the recomputed region,
    # parameters are gathered again for the recompute in backward, gradients are unchanged
    from torch.distributed.fsdp import fully_shard

    def run_fsdp(recompute, recompute_comm, shard_inner=False):
        torch.manual_seed(100)  # same full weights on both ranks; FSDP shards them
        model = Model(h, group)
        for layer in model.layers:  # plain replicated layers here: no tensor parallel collectives
            layer.self_attention.all_gather = CommStep(lambda t: t)
            layer.self_attention.reduce_scatter = CommStep(lambda t: t)
        apply_recompute(model, recompute, recompute_comm)
        for layer in model.layers:
            if shard_inner:
                fully_shard(layer.self_attention.q_proj, mesh=mesh)
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh)
        loss = model(x.clone().requires_grad_())
        loss.backward()
        return loss.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}

    loss_ref, grads_ref = run_fsdp(None, None)
    for rc, rcc in ((None, {"enable": True, "select_module": {r"self_attention\.all_gather": ["0-2"]}}),
                    ({"mode": "full", "full_recompute_layer": ["0-2"]}, None),
                    ({"mode": "select", "select_module": {"self_attention": ["0-2"]}}, None)):
        loss, grads = run_fsdp(rc, rcc, shard_inner=rc is not None and rc["mode"] == "select")
        assert torch.equal(loss, loss_ref), (rc, rcc)
        for k in grads_ref:
            assert torch.equal(grads[k], grads_ref[k]), (k, rc, rcc)
    try:
        run_fsdp(None, {"enable": True, "select_module": {r"self_attention\.q_proj": ["0-2"]}}, shard_inner=True)
    except RuntimeError as e:
        assert "sharded by FSDP on its own" in str(e), e
    else:
        raise AssertionError("output recompute of an FSDP-sharded module must fail clearly")
    dist.destroy_process_group()


def test_comm_recompute_regathers_in_backward_two_ranks():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    r = launch_pool.run([__file__], env=env, cwd=os.getcwd(), timeout=scaled(180))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ranks ok" in r.stdout


if __name__ == "__main__":
    import tempfile

    import torch.multiprocessing as mp

    import lit_moe.strategies.recompute  # noqa: F401  (imported once, inherited by the forked ranks)

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(os.path.join(tmp, "store"),), nprocs=WORLD, join=True, start_method="fork")
    print("ranks ok")
