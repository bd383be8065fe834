"""LoRA under the parallel layouts (FSDP2 over data parallel, tensor parallel, expert parallel): a
few AdamW steps of the adapted tiny MoE model in real gloo processes match the same steps in one
process (loss, pre-clip grad norm, the trained adapters), the base weights stay bit-identical, and
the optimizer holds state for the adapters only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from test_parallel_numerics import model_section, train

LORA = dict(target_modules=r"(q_a_proj|q_b_proj|kv_b_proj|o_proj|gate_proj|up_proj|down_proj|experts)$",
            lora_rank=4, lora_alpha=8, lora_b_std=0.02)
STEPS = 3
LAYOUTS = {"dp2": dict(tp=1, ep=1), "tp2": dict(tp=2, ep=1), "ep2": dict(tp=1, ep=2)}


def adapted(model):
    from lit_moe.lora import apply_lora

    apply_lora(model, LORA)
    return model


def finish(model):
    from lit_moe.lora import freeze_base, init_adapters

    init_adapters(model, 11)
    return freeze_base(model)


def full(t):
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).float()


def summary(model, result) -> dict:
    from lit_moe.lora import is_adapter_name

    adapters = {n: full(p).tolist() for n, p in model.named_parameters() if is_adapter_name(n)}
    base_norm = sum(float(full(p).double().pow(2).sum()) for n, p in model.named_parameters()
                    if not is_adapter_name(n))
    return {"loss": result["loss"], "grad_norm": result["grad_norm"], "adapters": adapters, "base_sq": base_norm,
            "state_bytes": result["optimizer_state_bytes"]}


def reference() -> dict:
    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM

    with torch.device("meta"):
        model = adapted(DeepseekV3ForCausalLM(DeepseekV3Config(**model_section(1))))
    model.to_empty(device="cpu")
    model.init_weights(7)
    finish(model)
    before = summary(model, {"loss": [], "grad_norm": [], "optimizer_state_bytes": 0})
    out = summary(model, train(model, steps=STEPS))
    out["base_sq_before"] = before["base_sq"]
    out["adapter_elements"] = sum(len(torch.tensor(v).flatten()) for v in out["adapters"].values())
    return out


def run_layout(name: str) -> dict:
    import torch.distributed as dist

    from lit_moe.config import ParallelismConfig
    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM
    from lit_moe.strategies import ParallelDims
    from lit_moe.strategies.parallelize import parallelize

    spec = LAYOUTS[name]
    dims = ParallelDims(2, dp_shard=-1, tp=spec["tp"], ep=spec["ep"])
    dims.build_meshes("cpu")
    cfg = DeepseekV3Config(**model_section(1))
    with torch.device("meta"):
        model = adapted(DeepseekV3ForCausalLM(cfg))
    parallel = ParallelismConfig(tensor_parallel=spec["tp"], expert_parallel=spec["ep"])
    model = parallelize(model, dims, parallel, model_config=cfg)
    model.to_empty(device="cpu")
    model.init_weights(7)
    finish(model)
    dp_mesh = dims.mesh("dp")
    result = train(model, dims, dp_rank=dp_mesh.get_local_rank(), dp=dims.dp, count_group=dp_mesh.get_group(),
                   steps=STEPS)
    state = torch.tensor([float(result["optimizer_state_bytes"])])
    dist.all_reduce(state)
    result["optimizer_state_bytes"] = float(state)
    out = summary(model, result)
    out["frozen_with_grad"] = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    return out


def worker_main(out_dir: str, names: list[str]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for name in names:
        result = run_layout(name)
        if dist.get_rank() == 0:
            Path(out_dir, f"{name}.json").write_text(json.dumps(result))
        dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_layouts")
    launch_self(out, list(LAYOUTS))
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


def launch_self(out: Path, names: list[str]) -> None:
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).resolve()), "--worker", str(out), *names]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=str(root))
    if proc.returncode != 0:
        raise AssertionError(f"workers failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_layout_matches_one_process(name, results, ref):
    got = results[name]
    assert got["frozen_with_grad"] == []
    assert torch.allclose(torch.tensor(got["loss"]), torch.tensor(ref["loss"]), rtol=1e-4, atol=1e-6), name
    assert torch.allclose(torch.tensor(got["grad_norm"]), torch.tensor(ref["grad_norm"]), rtol=1e-4, atol=1e-7)
    assert set(got["adapters"]) == set(ref["adapters"])
    for key, value in ref["adapters"].items():
        assert torch.allclose(torch.tensor(got["adapters"][key]), torch.tensor(value), rtol=1e-3, atol=1e-6), key
    # frozen base: unchanged by training, here and in the reference
    assert got["base_sq"] == pytest.approx(ref["base_sq_before"], rel=1e-9)
    assert ref["base_sq"] == ref["base_sq_before"]
    # AdamW moments (exp_avg, exp_avg_sq) exist for the adapters only, summed over both ranks' shards
    # (replicated adapters under tensor parallel are held by both ranks)
    assert ref["state_bytes"] == 2 * 4 * ref["adapter_elements"]
    assert ref["state_bytes"] <= got["state_bytes"] <= 2 * ref["state_bytes"]


if __name__ == "__main__" and "--worker" in sys.argv:
    i = sys.argv.index("--worker")
    worker_main(sys.argv[i + 1], sys.argv[i + 2:])
