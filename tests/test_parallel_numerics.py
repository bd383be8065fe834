"""Multi-process numerics (issue point 7): on CPU/gloo in fp32, a tiny MoE model trained for 4 steps
under each parallel layout matches the same training run in one process without any parallelism
(loss, pre-clip grad norm and expert biases within 1e-4 relative).

The reference is the plain model in this pytest process (no process group, no FSDP, no DTensor);
the layouts run as real ``torch.distributed.run`` subprocesses of this file (``--worker``) with a
timeout. Layouts of one world size share one launch (each builds its own meshes) to keep the wall
time small. The same script is the harness for the memory check (point 8).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
SEQ = 32
GLOBAL_BATCH = 4
VOCAB = 128

# name: (world, dp_shard, tp, cp, ep, dispatcher, sync every micro-batch, mtp layers)
LAYOUTS = {
    "dp2": (2, -1, 1, 1, 1, "alltoall", False, 1),
    "tp2": (2, -1, 2, 1, 1, "alltoall", True, 1),
    "ep2": (2, -1, 1, 1, 2, "alltoall", True, 1),
    "cp2": (2, -1, 1, 2, 1, "alltoall", True, 0),
    "dp2_ep2_allgather": (4, -1, 1, 1, 2, "allgather", True, 1),
    "dp2_ep2": (4, -1, 1, 1, 2, "alltoall", True, 1),
    "hsdp2x2": (4, 2, 1, 1, 1, "alltoall", True, 1),
    "tp2_ep2": (4, -1, 2, 1, 2, "alltoall", True, 1),
}


def model_section(mtp: int) -> dict:
    return dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
        moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="seq_aux_loss",
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3,
        num_nextn_predict_layers=mtp, seq_length=SEQ, max_position_embeddings=256,
        position_embedding_type="rope", params_dtype="float32", compute_dtype="float32",
        initializer_range=0.05,
    )


def batches() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=g)


def train(model, dims=None, dp_rank: int = 0, dp: int = 1, accumulation: int = 1, sync_every_micro=True,
          count_group=None) -> dict:
    """AdamW training of ``model`` for STEPS steps on this rank's share of the fixed batches."""
    import torch.distributed as dist

    from lit_moe.strategies import clip_grad_norm_

    opt = torch.optim.AdamW([p for p in model.parameters()], lr=1e-2, weight_decay=0.01, foreach=False)
    data = batches()
    local = GLOBAL_BATCH // (dp * accumulation)
    out = {"loss": [], "grad_norm": [], "expert_bias": []}
    fsdp_modules = []
    if dims is not None:
        from torch.distributed.fsdp import FSDPModule
        fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for step in range(STEPS):
        total = torch.zeros(())
        for micro in range(accumulation):
            if fsdp_modules and not sync_every_micro:
                last = micro == accumulation - 1
                for m in fsdp_modules:
                    m.set_requires_gradient_sync(last, recurse=False)
            lo = (dp_rank * accumulation + micro) * local
            tok = data[step, lo:lo + local]
            res = model(input_ids=tok[:, :-1], labels=tok[:, 1:])
            objective = (res.loss + res.aux_loss + res.mtp_loss) / accumulation
            objective.backward()
            total += res.loss.detach() / accumulation
        norm = clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        counts = torch.stack([m.tokens_per_expert for m in model.moe_layers()])
        if dims is not None:
            dist.all_reduce(counts, group=count_group)
            dist.all_reduce(total)
            total /= dist.get_world_size()
        model.update_expert_bias(counts)
        out["loss"].append(float(total))
        out["grad_norm"].append(float(norm))
        out["expert_bias"].append(torch.stack([m.router.expert_bias.detach().clone() for m in model.moe_layers()])
                                  .tolist())
    out["optimizer_state_bytes"] = sum(_local(v).numel() * v.element_size() for state in opt.state.values()
                                       for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return out


def _local(t):
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def reference(mtp: int) -> dict:
    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**model_section(mtp)))
    model.to_empty(device="cpu")
    model.init_weights(7)
    return train(model)


# ----------------------------------------------------------------------------------------------
# worker (one process of a layout run)
# ----------------------------------------------------------------------------------------------
def run_layout(name: str) -> dict:
    import torch.distributed as dist

    from lit_moe.config import ParallelismConfig
    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM
    from lit_moe.strategies import ParallelDims
    from lit_moe.strategies.parallelize import parallelize

    world, shard, tp, cp, ep, dispatcher, sync, mtp = LAYOUTS[name]
    assert world == dist.get_world_size()
    dims = ParallelDims(world, dp_shard=shard, tp=tp, cp=cp, ep=ep)
    dims.build_meshes("cpu")
    cfg = DeepseekV3Config(**model_section(mtp))
    parallelism = ParallelismConfig(data_parallel_shard=shard, tensor_parallel=tp, context_parallel=cp,
                                    expert_parallel=ep, moe_token_dispatcher_type=dispatcher,
                                    gradient_sync_every_microbatch=sync)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    model = parallelize(model, dims, parallelism, model_config=cfg)
    model.to_empty(device="cpu")
    model.init_weights(7)
    dp_mesh = dims.mesh("dp")
    accumulation = GLOBAL_BATCH // dims.dp if name == "dp2" else 1
    result = train(model, dims, dp_rank=dp_mesh.get_local_rank(), dp=dims.dp, accumulation=accumulation,
                   sync_every_micro=sync, count_group=dp_mesh.get_group())
    result["memory"] = memory_report(model, dims)
    result["memory"]["optimizer"] = result.pop("optimizer_state_bytes")
    return result


TP_SHARDED = ("q_proj.weight", "q_b_proj.weight", "kv_b_proj.weight", "o_proj.weight", "gate_proj.weight",
              "up_proj.weight", "down_proj.weight", "embed_tokens.weight", "lm_head.weight")


def memory_report(model, dims) -> dict:
    """This rank's parameter bytes (from its local shards) and the bytes the layout should give:
    routed experts split over dp_shard·cp·tp ranks, tensor-parallel weights over dp_shard·cp·tp,
    everything else over dp_shard·cp (replicated over tp)."""
    local = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    expected = 0.0
    for name, p in model.named_parameters():
        fsdp = dims.dp_shard * dims.cp
        if ".experts." in name:
            ways = fsdp * dims.tp
        elif dims.tp > 1 and name.endswith(TP_SHARDED) and ".experts." not in name:
            ways = fsdp * dims.tp
        else:
            ways = fsdp
        expected += p.numel() * p.element_size() / ways
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"local": local, "expected": expected, "total": total}


def worker_main(names: list[str], out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    for name in names:
        result = run_layout(name)
        if rank == 0:
            Path(out_dir, f"{name}.json").write_text(json.dumps(result))
        dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------
def launch(world: int, names: list[str], out_dir: Path, timeout: int = 240) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(Path(__file__).resolve()), "--worker", str(out_dir), *names]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    if proc.returncode != 0:
        raise AssertionError(f"workers failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


@pytest.fixture(scope="module")
def layout_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts")
    for world in (2, 4):
        names = [n for n, spec in LAYOUTS.items() if spec[0] == world]
        launch(world, names, out)
    return {name: json.loads((out / f"{name}.json").read_text()) for name in LAYOUTS}


@pytest.fixture(scope="module")
def references():
    return {mtp: reference(mtp) for mtp in (0, 1)}


def _close(a, b, rel=1e-4, abs_=1e-6):
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return bool(torch.all((a - b).abs() <= rel * b.abs() + abs_))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, layout_results, references):
    got = layout_results[name]
    ref = references[LAYOUTS[name][-1]]
    assert len(got["loss"]) == STEPS
    assert _close(got["loss"], ref["loss"]), (name, got["loss"], ref["loss"])
    assert _close(got["grad_norm"], ref["grad_norm"]), (name, got["grad_norm"], ref["grad_norm"])
    assert _close(got["expert_bias"], ref["expert_bias"], abs_=1e-7), name
    # the run really trained: the biases moved and the loss changed
    assert any(abs(b) > 0 for layer in ref["expert_bias"][-1] for b in layer)
    assert ref["loss"][0] != ref["loss"][-1]




@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [n for n in LAYOUTS if LAYOUTS[n][0] > 1])
def test_sharded_memory(name, layout_results):
    """Issue point 8: per-rank parameter and AdamW-state bytes are within 10% of total / N plus the
    replicated remainder (measured from the local shards of rank 0)."""
    mem = layout_results[name]["memory"]
    assert abs(mem["local"] - mem["expected"]) <= 0.10 * mem["expected"], mem
    # AdamW keeps two fp32 moments per local parameter value
    assert abs(mem["optimizer"] - 2 * mem["local"]) <= 0.10 * 2 * mem["local"], mem
    assert mem["local"] < mem["total"]


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker_main(sys.argv[3:], sys.argv[2])
