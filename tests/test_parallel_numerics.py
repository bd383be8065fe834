"""Multi-process numerics (issue 5, point 7): on CPU/gloo in fp32, a tiny MoE model trained for 4 steps
under each parallel layout matches the same training run in one process without any parallelism
(loss, pre-clip grad norm and expert biases within 1e-4 relative). Point 8 (sharded memory) is
measured from the same runs' local shards.

The reference is the plain model in this pytest process (no process group, no FSDP, no DTensor);
the layouts run as real ``torch.distributed.run`` subprocesses of this file (``--worker``) with a
timeout. Layouts of one world size share one launch (each builds its own meshes) to keep the wall
time small. The world-2 launch also checks the differentiable collectives and the
vocabulary-parallel cross entropy against plain single-tensor math, and the world-4 launch a
bf16-compute run (fp32 master weights, gradients and optimizer state).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import torchrun  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
SEQ = 32
GLOBAL_BATCH = 4
VOCAB = 128


def _layout(world, *, shard=-1, tp=1, cp=1, ep=1, dispatcher="alltoall", sync=True, mtp=1, accumulation=1,
            zero2=False, skew=False, recompute=False, docs=False):
    return dict(world=world, shard=shard, tp=tp, cp=cp, ep=ep, dispatcher=dispatcher, sync=sync, mtp=mtp,
                accumulation=accumulation, zero2=zero2, skew=skew, recompute=recompute, docs=docs)


LAYOUTS = {
    # dp2 also accumulates 2 micro-batches without gradient sync between them
    "dp2": _layout(2, accumulation=2, sync=False),
    # tp2 also keeps parameters gathered until backward (ZeRO-2) and recomputes attention and the
    # MoE layers' sequence all-gather in backward
    "tp2": _layout(2, tp=2, zero2=True, recompute=True),
    "ep2": _layout(2, ep=2),
    # MindFormers' alltoall_deredundancy: a token crosses to the other rank once, however many of its
    # experts are there (bytes compared with ep2's in test_deredundancy_sends_fewer_bytes)
    "ep2_deredundancy": _layout(2, ep=2, dispatcher="alltoall_deredundancy"),
    # every token routed to rank 0's experts: rank 1's experts receive no rows at all
    "ep2_no_tokens": _layout(2, ep=2, skew=True, dispatcher="allgather"),
    "cp2": _layout(2, cp=2, mtp=0),
    # documents (actual_seq_len) and sliding-window layers: the chunk's mask rows must be exact
    "cp2_docs_window": _layout(2, cp=2, mtp=0, docs=True),
    "dp2_ep2": _layout(4, ep=2, dispatcher="allgather"),
    "hsdp2x2": _layout(4, shard=2),
    "tp2_ep2": _layout(4, tp=2, ep=2),
}


def model_section(mtp: int, compute: str = "float32", window: bool = False) -> dict:
    extra = dict(window_size=[5, 0], window_attn_skip_freq=2) if window else {}
    return dict(**extra,
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
        moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="seq_aux_loss",
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3,
        num_nextn_predict_layers=mtp, seq_length=SEQ, max_position_embeddings=256,
        qk_layernorm=True,   # stated: pynative.yaml's default is MindFormers' False
        position_embedding_type="rope", params_dtype="float32", compute_dtype=compute,
        initializer_range=0.05,
    )


def batches() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=g)


def skew_routing(model) -> None:
    """Bias selection towards experts 0-3 (groups 0 and 1) so experts 4-7 never receive a token."""
    for moe in model.moe_layers():
        moe.router.expert_bias[:4] = 10.0


def _local(t):
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


# document ends (cumulative, per sample) for the ``docs`` layouts: documents cross the cp chunk boundary
DOC_ENDS = [11, 20, 32]
LOSS_MASKED_OUT = 5


def train(model, dims=None, dp_rank: int = 0, dp: int = 1, accumulation: int = 1, sync_every_micro=True,
          count_group=None, steps: int = STEPS, docs: bool = False) -> dict:
    """AdamW training of ``model`` on this rank's share of the fixed batches."""
    import torch.distributed as dist

    from lit_moe.strategies import clip_grads_with_norm_, global_grad_norm

    opt = torch.optim.AdamW([p for p in model.parameters()], lr=3e-3, weight_decay=0.01, foreach=False)
    data = batches()
    local = GLOBAL_BATCH // (dp * accumulation)
    out = {"loss": [], "grad_norm": [], "expert_bias": []}
    fsdp_modules = []
    if dims is not None:
        from torch.distributed.fsdp import FSDPModule
        fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for step in range(steps):
        total = torch.zeros(())
        for micro in range(accumulation):
            if fsdp_modules and not sync_every_micro:
                last = micro == accumulation - 1
                for m in fsdp_modules:
                    m.set_requires_gradient_sync(last, recurse=False)
            lo = (dp_rank * accumulation + micro) * local
            tok = data[step, lo:lo + local]
            extra = {}
            if docs:   # and the first LOSS_MASKED_OUT positions out of the loss: the cp ranks count unequal
                # numbers of loss tokens (the first zig-zag chunk is rank 0's), so the loss share matters
                mask = (torch.arange(tok.shape[1] - 1) >= LOSS_MASKED_OUT).long().expand(tok.shape[0], -1)
                extra = {"actual_seq_len": torch.tensor([DOC_ENDS] * tok.shape[0]), "loss_mask": mask}
            res = model(input_ids=tok[:, :-1], labels=tok[:, 1:], **extra)
            objective = (res.loss + res.aux_loss + res.mtp_loss) / accumulation
            objective.backward()
            total += res.loss.detach().float() / accumulation
        params = [p for p in model.parameters() if p.grad is not None]
        norm = global_grad_norm(params)
        clip_grads_with_norm_(params, 1.0, norm)
        out["grad_dtypes"] = sorted({str(_local(p.grad).dtype) for p in model.parameters() if p.grad is not None})
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
    out["counts_last"] = counts.tolist()
    states = [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    out["optimizer_state_bytes"] = sum(_local(v).numel() * v.element_size() for v in states)
    out["optimizer_state_dtypes"] = sorted({str(v.dtype) for v in states})
    out["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    return out


def reference(mtp: int, skew: bool = False, docs: bool = False) -> dict:
    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**model_section(mtp, window=docs)))
    model.to_empty(device="cpu")
    model.init_weights(7)
    if skew:
        skew_routing(model)
    return train(model, docs=docs)


def ref_key(spec: dict) -> tuple:
    return spec["mtp"], spec["skew"], spec["docs"]


# ----------------------------------------------------------------------------------------------
# worker (one process of a layout run)
# ----------------------------------------------------------------------------------------------
def build(spec: dict, compute: str = "float32"):
    from lit_moe.config import ParallelismConfig
    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM
    from lit_moe.strategies import ParallelDims
    from lit_moe.strategies.parallelize import parallelize

    dims = ParallelDims(spec["world"], dp_shard=spec["shard"], tp=spec["tp"], cp=spec["cp"], ep=spec["ep"])
    dims.build_meshes("cpu")
    cfg = DeepseekV3Config(**model_section(spec["mtp"], compute, window=spec["docs"]))
    parallelism = ParallelismConfig(
        data_parallel_shard=spec["shard"], tensor_parallel=spec["tp"], context_parallel=spec["cp"],
        expert_parallel=spec["ep"], moe_token_dispatcher_type=spec["dispatcher"],
        gradient_sync_every_microbatch=spec["sync"],
        data_parallel_shard_strategy="optim_grads" if spec["zero2"] else "optim_grads_params")
    recompute = recompute_comm = None
    if spec["recompute"]:
        from lit_moe.config import RecomputeCommConfig, RecomputeConfig

        recompute = RecomputeConfig(mode="select", select_module={"self_attention": ["0-1"]})
        recompute_comm = RecomputeCommConfig(enable=True, select_module={"mlp.router.all_gather": ["1-3"]})
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    model = parallelize(model, dims, parallelism, recompute=recompute, recompute_comm=recompute_comm,
                        model_config=cfg)
    model.to_empty(device="cpu")
    model.init_weights(7)
    if spec["skew"]:
        skew_routing(model)
    return model, dims


def run_layout(name: str) -> dict:
    spec = LAYOUTS[name]
    model, dims = build(spec)
    dp_mesh = dims.mesh("dp")
    result = train(model, dims, dp_rank=dp_mesh.get_local_rank(), dp=dims.dp, accumulation=spec["accumulation"],
                   sync_every_micro=spec["sync"], count_group=dims.mesh("dp_cp").get_group(), docs=spec["docs"])
    result["memory"] = memory_report(model, dims)
    result["memory"]["optimizer"] = result.pop("optimizer_state_bytes")
    # the layers whose router all-gather recompute_comm recomputes: the step's recompute slot is filled
    result["comm_recomputed"] = [i for i, b in enumerate(model.blocks())
                                 if getattr(getattr(getattr(b.mlp, "router", None), "all_gather", None),
                                            "recompute", None) is not None]
    if dims.ep > 1:
        import torch.distributed as dist

        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, local_expert_rows(model))
        result["local_expert_rows"] = rows      # per rank, per MoE layer
        sent = torch.tensor(float(sum(m.experts.dispatch_bytes for m in model.moe_layers())))
        dist.all_reduce(sent)
        result["dispatch_bytes"] = int(sent)   # both ranks, every forward of the run
    return result


def local_expert_rows(model) -> list[int]:
    """Rows this rank's experts computed in a forward of the first batch (0 = no tokens)."""
    rows = []

    def record(mod, args):
        rows.append(int(args[0].shape[0]))

    handles = [m.experts.register_forward_pre_hook(record) for m in model.moe_layers()]
    tok = batches()[0, :1]
    with torch.no_grad():
        model(input_ids=tok[:, :-1], labels=tok[:, 1:])
    for h in handles:
        h.remove()
    return rows


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
        if ".experts." in name or (dims.tp > 1 and name.endswith(TP_SHARDED)):
            ways = fsdp * dims.tp
        else:
            ways = fsdp
        expected += p.numel() * p.element_size() / ways
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"local": local, "expected": expected, "total": total}


def run_bf16() -> dict:
    """tp2·ep2 with bf16 compute: one step; dtypes of what is computed and what is kept."""
    spec = LAYOUTS["tp2_ep2"]
    model, dims = build(spec, compute="bfloat16")
    seen = []
    handle = model.layers[0].self_attention.o_proj.register_forward_pre_hook(lambda m, a: seen.append(str(a[0].dtype)))
    dp_mesh = dims.mesh("dp")
    out = train(model, dims, dp_rank=dp_mesh.get_local_rank(), dp=dims.dp, count_group=dp_mesh.get_group(), steps=1)
    handle.remove()
    out["activation_dtypes"] = sorted(set(seen))
    return out


def run_comm_checks() -> dict:
    """Collectives and vocabulary-parallel cross entropy vs. single-tensor math (2 ranks)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from lit_moe.strategies import comm

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 8, 5, generator=g)          # [B, S, H], S split over ranks
    weights = torch.randn(3, 8, 5, generator=g)
    res = {}

    # all_gather(seq) then a rank-dependent loss: the gradient of each shard must sum every rank's use
    shard = full.chunk(world, dim=1)[rank].clone().requires_grad_()
    gathered = comm.all_gather(shard, group, dim=1)
    (gathered * weights * (rank + 1)).sum().backward()
    expected = (weights * sum(r + 1 for r in range(world))).chunk(world, dim=1)[rank]
    res["all_gather"] = bool(torch.allclose(gathered, full) and torch.allclose(shard.grad, expected))

    # reduce_scatter: forward sums the ranks' tensors; backward hands every rank the full gradient slice
    x = (full * (rank + 1)).clone().requires_grad_()
    y = comm.reduce_scatter(x, group, dim=1)
    (y * weights.chunk(world, dim=1)[rank]).sum().backward()
    res["reduce_scatter"] = bool(torch.allclose(y, (full * sum(r + 1 for r in range(world))).chunk(world, dim=1)[rank])
                                 and torch.allclose(x.grad, weights))

    # all_to_all with uneven splits (rank r sends r+1 rows to each peer), and its backward
    rows = torch.arange(world * (rank + 1) * 2, dtype=torch.float32).view(-1, 2) + 100 * rank
    rows.requires_grad_()
    out = comm.all_to_all(rows, [r + 1 for r in range(world)], [rank + 1] * world, group)
    expected_out = torch.cat([torch.arange(world * (r + 1) * 2, dtype=torch.float32).view(-1, 2)[rank * (r + 1):(rank + 1) * (r + 1)]
                              + 100 * r for r in range(world)])
    (out * 3).sum().backward()
    res["all_to_all"] = bool(torch.equal(out, expected_out) and torch.equal(rows.grad, torch.full_like(rows, 3.0)))

    # vocabulary-parallel cross entropy vs F.cross_entropy on the full logits
    logits = torch.randn(6, 10, generator=g) * 3
    labels = torch.tensor([0, 9, 4, 5, 7, 2])
    upstream = torch.rand(6, generator=g)
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, labels, reduction="none")
    (ref * upstream).sum().backward()
    local = logits.chunk(world, dim=1)[rank].clone().requires_grad_()
    ce = comm.vocab_parallel_cross_entropy(local, labels, rank * (10 // world), group)
    (ce * upstream).sum().backward()
    res["vocab_parallel_ce"] = bool(torch.allclose(ce, ref, atol=1e-6)
                                    and torch.allclose(local.grad, ref_logits.grad.chunk(world, dim=1)[rank], atol=1e-6))
    return res


def worker_main(names: list[str], out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    from lit_moe.runtime.distributed import release_process_groups_at_exit
    release_process_groups_at_exit()  # no gloo thread outlives the interpreter
    torch.set_num_threads(1)
    rank = dist.get_rank()
    for name in names:
        if name == "comm":
            result = run_comm_checks()
            flags = [None] * dist.get_world_size()
            dist.all_gather_object(flags, result)
            result = {k: all(f[k] for f in flags) for k in result}
        elif name == "bf16":
            result = run_bf16()
        else:
            result = run_layout(name)
        if rank == 0:
            Path(out_dir, f"{name}.json").write_text(json.dumps(result))
        dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------
def launch(world: int, names: list[str], out_dir: Path, timeout: int = 300, script: Path = Path(__file__)) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    proc = torchrun(world, [str(script.resolve()), "--worker", str(out_dir), *names], cwd=ROOT, env=env,
                    timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"workers failed ({proc.returncode}):\n{proc.stdout[-9000:]}")


EXTRA = {2: ["comm"], 4: ["bf16"]}


@pytest.fixture(scope="module")
def layout_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts")
    for world in (2, 4):
        names = [n for n, spec in LAYOUTS.items() if spec["world"] == world] + EXTRA[world]
        launch(world, names, out)
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


@pytest.fixture(scope="module")
def references():
    return {key: reference(*key) for key in {ref_key(s) for s in LAYOUTS.values()}}


def _close(a, b, rel=1e-4, abs_=1e-6):
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return bool(torch.all((a - b).abs() <= rel * b.abs() + abs_))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, layout_results, references):
    got = layout_results[name]
    spec = LAYOUTS[name]
    ref = references[ref_key(spec)]
    assert len(got["loss"]) == STEPS
    assert _close(got["loss"], ref["loss"]), (name, got["loss"], ref["loss"])
    assert _close(got["grad_norm"], ref["grad_norm"]), (name, got["grad_norm"], ref["grad_norm"])
    assert _close(got["expert_bias"], ref["expert_bias"], abs_=1e-7), name
    # the run really trained: the biases moved and the loss changed
    assert any(abs(b) > 0 for layer in ref["expert_bias"][-1] for b in layer)
    assert ref["loss"][0] != ref["loss"][-1]
    # fp32 master weights, gradients and optimizer state
    assert got["param_dtypes"] == got["grad_dtypes"] == got["optimizer_state_dtypes"] == ["torch.float32"]
    # recompute_comm's router all-gather (tensor parallel's step) in the MoE layers of 1-3
    assert got["comm_recomputed"] == ([1, 2, 3] if spec["recompute"] else []), name


def test_experts_without_tokens(layout_results):
    got = layout_results["ep2_no_tokens"]
    # rank 0 owns experts 0-3, which get every token; rank 1's experts 4-7 get no rows at all, and the
    # run still matched the single-process one (test_layout_matches_single_process[ep2_no_tokens])
    rank0, rank1 = got["local_expert_rows"]
    assert all(rows > 0 for rows in rank0) and all(rows == 0 for rows in rank1)
    assert all(c == 0 for layer in got["counts_last"] for c in layer[4:])


def test_deredundancy_sends_fewer_bytes(layout_results):
    """The same 4 steps (routing equal up to float sums, both matched the single-process run): the
    de-duplicated dispatch sends fewer bytes than the plain all-to-all. Measured: 348,976
    against 435,500 bytes (top-2 of 8 experts, hidden 64 fp32, 4 training steps and one forward)."""
    plain = layout_results["ep2"]["dispatch_bytes"]
    dedup = layout_results["ep2_deredundancy"]["dispatch_bytes"]
    assert 0 < dedup < plain, (dedup, plain)


def test_collectives_and_vocab_parallel_cross_entropy(layout_results):
    assert layout_results["comm"] == {"all_gather": True, "reduce_scatter": True, "all_to_all": True,
                                      "vocab_parallel_ce": True}


def test_bf16_compute_keeps_fp32_state(layout_results, references):
    got = layout_results["bf16"]
    assert got["activation_dtypes"] == ["torch.bfloat16"]
    assert got["param_dtypes"] == got["grad_dtypes"] == got["optimizer_state_dtypes"] == ["torch.float32"]
    ref = references[(1, False, False)]
    # bf16 compute vs the fp32 single-process run: measured 7e-4 (loss) and 4e-3 (pre-clip grad norm)
    # relative; the bounds leave ~4x margin and no room for a wrong layer
    assert abs(got["loss"][0] - ref["loss"][0]) <= 3e-3 * ref["loss"][0]
    assert abs(got["grad_norm"][0] - ref["grad_norm"][0]) <= 2e-2 * ref["grad_norm"][0]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [n for n in LAYOUTS])
def test_sharded_memory(name, layout_results):
    """Point 8: per-rank parameter and AdamW-state bytes are exactly total / N of each sharded tensor
    plus the replicated remainder (measured from the local shards of rank 0; every sharded dimension
    of this model divides evenly, so there is no padding to allow for)."""
    mem = layout_results[name]["memory"]
    assert mem["local"] == mem["expected"], mem
    # AdamW keeps two fp32 moments per local parameter value
    assert mem["optimizer"] == 2 * mem["local"], mem
    assert mem["local"] < mem["total"]


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker_main(sys.argv[3:], sys.argv[2])
