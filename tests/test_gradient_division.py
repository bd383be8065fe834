"""``parallelism.disable_gradient_division`` as MindFormers defines it (issue 13).

MindFormers reduces FSDP gradients with SUM when the key is True (its default) and scales the loss by
``1/(world/pp)``, so the update uses the mean gradient over data/context-parallel ranks; with False its
FSDP averages on top, dividing each gradient once more by the size of its reduce group. Here two real
gloo processes (``torch.distributed.run``, this file as ``--worker``) compute one backward under
``dp2`` (experts FSDP-sharded over 2 ranks) and ``ep2`` (experts split, one expert shard), with the key
True and False; the reference is the same model in this pytest process on the whole batch, without
any process group.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import torchrun  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB, SEQ, WORLD = 96, 16, 2
LAYOUTS = {"dp2": dict(ep=1), "ep2": dict(ep=2)}


def model_section() -> dict:
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=16,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                num_experts_per_tok=2, n_group=2, topk_group=2, n_shared_experts=1, moe_aux_loss_coeff=0.0,
                num_nextn_predict_layers=0, seq_length=SEQ, max_position_embeddings=64,
                qk_layernorm=True,   # stated: pynative.yaml's default is MindFormers' False
                position_embedding_type="rope", params_dtype="float32", compute_dtype="float32",
                initializer_range=0.05)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (WORLD, SEQ + 1), generator=torch.Generator().manual_seed(5))


def _model(cfg):
    from lit_moe.model import DeepseekV3ForCausalLM

    with torch.device("meta"):
        return DeepseekV3ForCausalLM(cfg)


def reference_grads() -> dict[str, torch.Tensor]:
    from lit_moe.model import DeepseekV3Config

    model = _model(DeepseekV3Config(**model_section()))
    model.to_empty(device="cpu")
    model.init_weights(3)
    tok = tokens()
    model(input_ids=tok[:, :-1], labels=tok[:, 1:]).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def worker_main(out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from lit_moe.config import ParallelismConfig
    from lit_moe.model import DeepseekV3Config
    from lit_moe.strategies import ParallelDims
    from lit_moe.strategies.parallelize import parallelize

    dist.init_process_group("gloo")
    from lit_moe.runtime.distributed import release_process_groups_at_exit
    release_process_groups_at_exit()  # no gloo thread outlives the interpreter
    torch.set_num_threads(1)
    rank = dist.get_rank()
    tok = tokens()[rank:rank + 1]
    for name, spec in LAYOUTS.items():
        for division in (True, False):
            dims = ParallelDims(WORLD, ep=spec["ep"])
            dims.build_meshes("cpu")
            cfg = DeepseekV3Config(**model_section())
            parallelism = ParallelismConfig(expert_parallel=spec["ep"], disable_gradient_division=division)
            model = parallelize(_model(cfg), dims, parallelism, model_config=cfg)
            model.to_empty(device="cpu")
            model.init_weights(3)
            model(input_ids=tok[:, :-1], labels=tok[:, 1:]).loss.backward()
            grads = {}
            for n, p in model.named_parameters():
                if p.grad is not None:
                    g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    grads[n] = g.detach().clone()
            if rank == 0:
                torch.save(grads, Path(out_dir) / f"{name}_{division}.pt")
            dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def layout_grads(tmp_path_factory):
    out = tmp_path_factory.mktemp("division")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = torchrun(WORLD, [str(Path(__file__).resolve()), "--worker", str(out)], cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return {p.stem: torch.load(p) for p in out.glob("*.pt")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gradient_division(layout_grads, layout):
    ref = reference_grads()
    summed, averaged = layout_grads[f"{layout}_True"], layout_grads[f"{layout}_False"]
    assert set(summed) == set(ref) == set(averaged)
    # expert reduce group: dp_replicate * efsdp = 2 ranks under dp2, 1 under ep2
    expert_group = 2 if layout == "dp2" else 1
    for name, g in ref.items():
        # True (MindFormers' default): the mean gradient of the whole batch, as one process computes it
        torch.testing.assert_close(summed[name], g, rtol=1e-4, atol=1e-6, msg=name)
        # False: divided once more by the reduce group (dense: data_parallel 2)
        group = expert_group if ".experts." in name else 2
        torch.testing.assert_close(averaged[name], g / group, rtol=1e-4, atol=1e-6, msg=name)
    assert any(".experts." in n for n in ref)


if __name__ == "__main__" and "--worker" in sys.argv:
    worker_main(sys.argv[sys.argv.index("--worker") + 1])
