"""ParallelDims arithmetic and errors, meshes on fake process groups (8..1024 ranks), the strategy's
Lightning wiring, the NPU accelerator registration and the gradient-norm helper (issue 5)."""

from __future__ import annotations

import re
import warnings
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lit_moe.config import ConfigError, ParallelismConfig
from lit_moe.strategies import ParallelDims, ParallelismError, clip_grads_with_norm_, global_grad_norm

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_world():
    """A fake process group of any size, as rank ``rank`` (no communication happens)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(world_size: int, rank: int = 0):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# arithmetic (hand-computed expectations)
# ----------------------------------------------------------------------------------------------
# world, dp_shard, tp, cp, ep -> dp, dp_replicate, dp_shard, efsdp
CASES = [
    (1, -1, 1, 1, 1, 1, 1, 1, 1),
    (8, -1, 2, 1, 1, 4, 1, 4, 8),       # the guide's 8-card example: TP=2, DP=4
    (8, -1, 1, 1, 2, 8, 1, 8, 4),       # EP borrows: data parallel stays 8
    (8, -1, 2, 1, 2, 4, 1, 4, 4),
    (8, 2, 1, 1, 1, 8, 4, 2, 2),        # HSDP: 4 replicas of 2-way shards
    (16, 4, 2, 2, 4, 4, 1, 4, 4),
    (1024, 32, 8, 2, 64, 64, 2, 32, 8),
]


@pytest.mark.parametrize("world,shard,tp,cp,ep,dp,rep,sh,efsdp", CASES)
def test_degrees(world, shard, tp, cp, ep, dp, rep, sh, efsdp):
    d = ParallelDims(world, dp_shard=shard, tp=tp, cp=cp, ep=ep)
    assert (d.dp, d.dp_replicate, d.dp_shard, d.efsdp) == (dp, rep, sh, efsdp)
    assert d.dp_replicate * d.dp_shard * d.cp * d.tp == world
    assert d.efsdp * d.ep == d.dp_shard * d.cp * d.tp


BAD = [
    (dict(world_size=8, tp=4, cp=4), ["tensor_parallel(4)", "context_parallel(4)", "world_size(8)"]),
    (dict(world_size=6, tp=4), ["world_size(6)", "4"]),
    (dict(world_size=8, ep=3), ["expert_parallel", "ep(3)", "dp_shard(8)", "= 8"]),
    (dict(world_size=8, tp=2, ep=16), ["ep(16)", "= 8"]),
    (dict(world_size=8, dp_shard=3), ["data_parallel_shard", "3", "data_parallel 8"]),
    (dict(world_size=8, dp_shard=16), ["data_parallel_shard", "16", "data_parallel 8"]),
    (dict(world_size=8, dp_shard=0), ["data_parallel_shard", "0"]),
    (dict(world_size=6, pp=4), ["world_size(6)", "pipeline_parallel(4)"]),
    (dict(world_size=8, tp=0), ["tensor_parallel", "0"]),
]


@pytest.mark.parametrize("kwargs,words", BAD)
def test_layout_errors_name_the_numbers(kwargs, words):
    with pytest.raises(ParallelismError) as err:
        ParallelDims(**kwargs)
    assert isinstance(err.value, ValueError)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def _model(**kw):
    base = dict(num_attention_heads=4, n_routed_experts=8, vocab_size=512, intermediate_size=128,
                moe_intermediate_size=32, n_shared_experts=1, shared_expert_intermediate_size=32,
                moe_shared_expert_intermediate_size=32, num_nextn_predict_layers=0,
                position_embedding_type="rope")
    base.update(kw)
    return SimpleNamespace(**base)


MODEL_BAD = [
    (dict(world_size=8, tp=8), _model(), 32, ["tensor_parallel", "8", "num_attention_heads 4"]),
    (dict(world_size=8, ep=4), _model(n_routed_experts=6), 32, ["expert_parallel", "4", "n_routed_experts 6"]),
    (dict(world_size=4, tp=2, cp=2), _model(), 36, ["36", "2 * context_parallel(2)", "tensor_parallel(2)", "8"]),
    (dict(world_size=4, tp=2), _model(vocab_size=511), 32, ["vocab_size 511"]),
    (dict(world_size=4, tp=2), _model(position_embedding_type="learned_absolute"), 32, ["learned_absolute"]),
    (dict(world_size=4, ep=2), _model(n_routed_experts=0), 32, ["expert_parallel", "n_routed_experts"]),
]


@pytest.mark.parametrize("kwargs,cfg,seq,words", MODEL_BAD)
def test_model_checks_name_the_numbers(kwargs, cfg, seq, words):
    d = ParallelDims(**kwargs)
    with pytest.raises(ParallelismError) as err:
        d.validate_model(cfg, seq)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_model_checks_accept_valid_layouts():
    ParallelDims(8, tp=4, ep=2).validate_model(_model(), 32)
    ParallelDims(8, tp=2, cp=2, ep=8).validate_model(_model(), 32)


def test_accumulation_steps_seed_rules():
    # MindFormers' PyNative training-features guide: 8 // (1 * 2) = 4 on one card
    assert ParallelDims(1).accumulation_steps(8, 2) == 4
    assert ParallelDims(8, tp=2).accumulation_steps(64, 2) == 8            # dp = 4
    assert ParallelDims(8, ep=2).accumulation_steps(64, 2) == 4            # ep does not shrink dp (8)
    with pytest.raises(ConfigError) as err:
        ParallelDims(8, tp=2).accumulation_steps(2, 1)                     # the guide's own sample on 8 cards
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    for w in ("global_batch_size", "2", "data_parallel(4)", "local_batch_size(1)", "increase", "decrease"):
        assert w in msg
    with pytest.warns(UserWarning, match=r"drops 2"):
        assert ParallelDims(4).accumulation_steps(10, 2) == 1              # 10 // 8 = 1, 2 samples dropped
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ParallelDims(4).accumulation_steps(16, 2)


# ----------------------------------------------------------------------------------------------
# meshes on fake process groups
# ----------------------------------------------------------------------------------------------
MESH_CASES = [
    (8, -1, 2, 1, 1, 5),
    (8, -1, 1, 1, 2, 3),
    (8, 2, 1, 1, 1, 6),
    (16, -1, 2, 2, 4, 11),
    (64, 8, 4, 1, 16, 37),
    (256, -1, 8, 2, 32, 200),
    (1024, 32, 8, 2, 64, 777),
]


@pytest.mark.parametrize("world,shard,tp,cp,ep,rank", MESH_CASES)
def test_meshes_on_fake_process_group(fake_world, world, shard, tp, cp, ep, rank):
    fake_world(world, rank)
    d = ParallelDims(world, dp_shard=shard, tp=tp, cp=cp, ep=ep)
    m = d.build_meshes("cpu")
    R, S, C, T, E = d.dp_replicate, d.dp_shard, d.cp, d.tp, d.ep
    # rank = ((rep * S + s) * C + c) * T + t, row-major with tp innermost (hand-derived coordinates)
    t = rank % T
    c = (rank // T) % C
    s = (rank // (T * C)) % S
    rep = rank // (T * C * S)
    assert m["tp"].get_local_rank() == t and m["tp"].size() == T
    assert m["cp"].get_local_rank() == c and m["cp"].size() == C
    assert m["dp"].get_local_rank() == rep * S + s and m["dp"].size() == d.dp
    assert m["dp_cp"].size() == d.dp * C
    assert m["cp_tp"].get_local_rank() == c * T + t
    # experts: ep groups are E consecutive ranks inside the S·C·T block of one replica
    inner = rank % (S * C * T)
    assert m["ep"].get_local_rank() == inner % E and m["ep"].size() == E
    assert sorted(m["ep"].mesh.flatten().tolist()) == list(range(rank - inner % E, rank - inner % E + E))
    assert m["fsdp"].size() == R * S * C and m["efsdp"].size() == R * d.efsdp
    assert m["fsdp"].ndim == (2 if R > 1 else 1)
    assert d.mesh("world").size() == world


# ----------------------------------------------------------------------------------------------
# the strategy
# ----------------------------------------------------------------------------------------------
def test_strategy_is_registered_and_validates_its_section():
    from lightning.pytorch.strategies import StrategyRegistry

    from lit_moe.strategies import AscendFSDPStrategy, check_parallelism_section

    assert "ascend_fsdp" in StrategyRegistry
    assert StrategyRegistry["ascend_fsdp"]["strategy"] is AscendFSDPStrategy
    s = AscendFSDPStrategy(parallelism={"tensor_parallel": 2, "process_group_timeout_s": 17})
    assert s.parallelism.tensor_parallel == 2
    assert s._timeout == timedelta(seconds=17)       # a dead rank ends the job after 17 s
    for field, value, word in [("data_parallel_shard_strategy", "zero9", "optim_grads"),
                               ("moe_token_dispatcher_type", "ring", "allgather"),
                               ("process_group_timeout_s", 0, "positive")]:
        with pytest.raises(ConfigError, match=field):
            check_parallelism_section(ParallelismConfig(**{field: value}))
        with pytest.raises(ConfigError, match=word):
            AscendFSDPStrategy(parallelism=ParallelismConfig(**{field: value}))
    # ZeRO-1 keeps the gathered parameters through the step: resharding after every forward contradicts it
    with pytest.raises(ConfigError) as err:
        check_parallelism_section(ParallelismConfig(data_parallel_shard_strategy="optim",
                                                    reshard_after_forward_policy="always"))
    assert str(err.value).startswith("parallelism.reshard_after_forward_policy: 'always' contradicts "
                                     "data_parallel_shard_strategy 'optim'") and "\n" not in str(err.value)
    check_parallelism_section(ParallelismConfig(data_parallel_shard_strategy="optim", pipeline_parallel=2))


def test_strategy_sampler_and_groups_follow_the_dp_mesh(fake_world):
    from lit_moe.strategies import AscendFSDPStrategy

    fake_world(8, rank=5)
    s = AscendFSDPStrategy(parallelism=ParallelismConfig(tensor_parallel=2, expert_parallel=2))
    dims = s._make_parallel_dims(8)
    dims.build_meshes("cpu")
    s._parallel_dims = dims
    # rank 5 = (dp_shard 2, tp 1): tensor-parallel ranks 4 and 5 read the same samples
    assert s.distributed_sampler_kwargs == {"num_replicas": 4, "rank": 2}
    assert dist.get_world_size(s.expert_count_group) == 4
    assert dist.get_rank(s.expert_count_group) == 2
    assert s.batch_replicas == 2  # the two tensor-parallel ranks of each data-parallel rank
    assert s.parallel_dims.ep == 2


def test_expert_counts_are_summed_over_dp_and_cp(fake_world):
    """Context-parallel ranks route their own tokens: counts sum over dp × cp, not over tp."""
    from lit_moe.strategies import AscendFSDPStrategy

    fake_world(8, rank=5)
    s = AscendFSDPStrategy(parallelism=ParallelismConfig(tensor_parallel=2, context_parallel=2))
    dims = s._make_parallel_dims(8)
    dims.build_meshes("cpu")
    s._parallel_dims = dims
    assert dist.get_world_size(s.dp_group) == 2
    assert dist.get_world_size(s.expert_count_group) == 4 == dims.dp * dims.cp


def test_gradient_sync_switch(fake_world):
    """``gradient_sync_every_microbatch: False`` turns FSDP's reduce-scatter off between micro-batches."""
    from torch.distributed.fsdp import FSDPModule

    from lit_moe.strategies import AscendFSDPStrategy

    fake_world(2)

    def build(sync: bool, strategy: str = "optim_grads_params"):
        s = AscendFSDPStrategy(parallelism=ParallelismConfig(gradient_sync_every_microbatch=sync,
                                                             data_parallel_shard_strategy=strategy))
        dims = s._make_parallel_dims(2)
        dims.build_meshes("cpu")
        s._parallel_dims = dims
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        for layer in model:
            fully_shard(layer, mesh=dims.mesh("fsdp"))
        fully_shard(model, mesh=dims.mesh("fsdp"))
        s._parallelized = model
        return s, [m for m in model.modules() if isinstance(m, FSDPModule)]

    def syncing(mods):
        return {g.reduce_grads for m in mods for g in m._get_fsdp_state()._fsdp_param_groups}

    s, mods = build(sync=False)
    s.set_gradient_sync(False)
    assert syncing(mods) == {False}
    s.set_gradient_sync(True)
    assert syncing(mods) == {True}
    s, mods = build(sync=True)
    s.set_gradient_sync(False)          # always sync: the switch is ignored
    assert syncing(mods) == {True}

    def resharding(mods):
        return {g.reshard_after_backward for m in mods for g in m._get_fsdp_state()._fsdp_param_groups}

    assert resharding(mods) == {True}   # ZeRO-3 and ZeRO-2 reshard after every backward
    s, mods = build(sync=True, strategy="optim")
    s.set_gradient_sync(False)          # ZeRO-1: once per step whatever the switch, parameters kept
    assert syncing(mods) == resharding(mods) == {False}
    s.set_gradient_sync(True)           # the step's last micro-batch: reduce, then free the gathered copy
    assert syncing(mods) == resharding(mods) == {True}


# ----------------------------------------------------------------------------------------------
# accelerators
# ----------------------------------------------------------------------------------------------
def test_npu_accelerator_registration(monkeypatch):
    from lightning.pytorch.accelerators import AcceleratorRegistry

    from lit_moe.strategies.accelerators import NPUAccelerator, register_npu_accelerator, torch_npu_available

    assert NPUAccelerator.name() == "npu"
    if torch_npu_available():  # pragma: no cover - only on Ascend machines
        assert "npu" in AcceleratorRegistry
        return
    assert not NPUAccelerator.is_available() and NPUAccelerator.auto_device_count() == 0
    assert "npu" not in AcceleratorRegistry      # nothing registered without torch_npu
    monkeypatch.setenv("LIT_MOE_REGISTER_NPU", "1")
    try:
        assert register_npu_accelerator()
        assert AcceleratorRegistry["npu"]["accelerator"] is NPUAccelerator
    finally:
        AcceleratorRegistry.pop("npu", None)


def test_backends_come_from_the_device_type():
    from lit_moe.strategies.accelerators import default_backend, device_module

    assert default_backend(torch.device("cpu")) == "gloo"
    assert default_backend("cuda") == "nccl"
    assert device_module("cpu") is None and device_module("meta") is None


def test_no_hard_coded_device_type_in_the_strategy_code():
    """CPU, CUDA and NPU share one code path: no string literal names a device type to run on."""
    pattern = re.compile(r"""["'](cuda|npu)(:\d+)?["']""")
    offenders = []
    for path in sorted((ROOT / "lit_moe" / "strategies").glob("*.py")):
        if path.name == "recompute.py":  # not part of the strategy (another module's owner checks it)
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if pattern.search(code) and "name()" not in code:
                offenders.append(f"{path.name}:{i}: {line.strip()}")
    # the NPU accelerator itself must name its device type
    offenders = [o for o in offenders if not o.startswith("accelerators.py")]
    assert not offenders, offenders


# ----------------------------------------------------------------------------------------------
# gradient norm (one process; the multi-mesh cases run in test_parallel_numerics)
# ----------------------------------------------------------------------------------------------
def clip_grad_norm_(params, max_norm):
    """The module's clipping path: the global norm, then the one clipping rule."""
    norm = global_grad_norm(params)
    clip_grads_with_norm_(params, max_norm, norm)
    return norm


@pytest.mark.parametrize("max_norm", [1.0, 100.0], ids=["clips", "below_the_norm"])
def test_clip_grad_norm_matches_torch(max_norm):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)] + [torch.nn.Parameter(torch.randn(4))]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    ref = [p.grad.clone() for p in params]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for rp, g in zip(ref_params, ref):
        rp.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(ref_params, max_norm)
    got = clip_grad_norm_(params, max_norm)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected)
    for p, rp in zip(params, ref_params):
        torch.testing.assert_close(p.grad, rp.grad)
    # max_norm 0 only measures
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm_(params, 0.0)
    torch.testing.assert_close(norm, torch.linalg.vector_norm(torch.cat([b.flatten() for b in before])))
    for p, b in zip(params, before):
        assert torch.equal(p.grad, b)


def test_grad_norm_of_bf16_grads_is_fp32_and_skips_missing():
    p = torch.nn.Parameter(torch.ones(10, dtype=torch.bfloat16))
    p.grad = torch.full((10,), 3.0, dtype=torch.bfloat16)
    q = torch.nn.Parameter(torch.ones(3))     # no grad
    norm = global_grad_norm([p, q])
    assert norm.dtype == torch.float32
    assert abs(float(norm) - 3.0 * 10 ** 0.5) < 1e-5


def test_non_finite_norm_leaves_gradients_alone():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, float("inf"), 2.0])
    norm = clip_grad_norm_([p], 1.0)
    assert not torch.isfinite(norm)
    assert p.grad[0] == 1.0 and p.grad[2] == 2.0


def test_every_mesh_group_gets_the_collective_timeout():
    """torch creates a device mesh's groups with its own default timeout (30 minutes for gloo), not the
    default group's: ``build_meshes`` gives each the run's ``process_group_timeout_s``, so a rank stuck
    in a tensor/expert/context-parallel collective ends the job in that time. Real gloo (one rank)."""
    from datetime import timedelta

    import torch.distributed as dist

    from lit_moe.strategies.parallel_dims import ParallelDims

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=99))
    try:
        meshes = ParallelDims(1).build_meshes("cpu", timeout=timedelta(seconds=42))
        got = {(name, dim): mesh.get_group(dim)._get_backend(torch.device("cpu")).options._timeout
               for name, mesh in meshes.items() for dim in range(mesh.ndim)}
        assert set(got.values()) == {timedelta(seconds=42)}, got
        assert len(got) > 10
    finally:
        dist.destroy_process_group()
