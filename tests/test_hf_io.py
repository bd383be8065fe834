"""Hugging Face weights at scale (issue 26, item 3): byte-range reads from safetensors headers parsed
by lit_moe itself, each rank reading only what it holds, and DeepSeek-V3's FP8 block-quantized
weights loaded dequantized (checked against a hand-computed block and against transformers' own
dequantization function).

The two-rank scenario runs real gloo processes (``python tests/test_hf_io.py --scenario DIR``):
FSDP2 (``fully_shard``) over the tiny model, ``load_hf_into`` on each rank, the bytes each rank read
and its weights compared with a one-process load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import launch_pool  # noqa: E402  (tests/ is on sys.path)
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
TIMEOUT = 300
CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
           num_attention_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16,
           v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
           first_k_dense_replace=1, seq_length=32, max_position_embeddings=256, compute_dtype="float32",
           initializer_range=0.1)


def tiny_model():
    from lit_moe.model import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(CFG).eval()


def _header_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


# ----------------------------------------------------------------------------------------------
# byte ranges
# ----------------------------------------------------------------------------------------------
def test_reads_only_the_rows_and_columns_asked_for(tmp_path):
    from lit_moe.model.safetensors_io import SafetensorsFile

    t = {"a": torch.randn(64, 48), "e": torch.randn(4, 10, 6).to(torch.bfloat16), "s": torch.tensor(3.5)}
    path = tmp_path / "x.safetensors"
    save_file(t, str(path))
    head = _header_bytes(path)
    f = SafetensorsFile(path)
    assert f.bytes_read == head   # opening reads the header only
    got = f.read("a", box=(slice(10, 20), slice(0, 48)))
    assert torch.equal(got, t["a"][10:20]) and f.bytes_read == head + 10 * 48 * 4
    got = f.read("a", box=(slice(3, 7), slice(5, 9)))   # narrow columns: only those, row by row
    assert torch.equal(got, t["a"][3:7, 5:9]) and f.bytes_read == head + 10 * 48 * 4 + 4 * 4 * 4
    got = f.read("a", box=(slice(3, 7), slice(5, 40)))  # wide: whole rows, sliced in memory
    assert torch.equal(got, t["a"][3:7, 5:40]) and f.bytes_read == head + 10 * 48 * 4 + 16 * 4 + 4 * 48 * 4
    n = f.bytes_read
    assert torch.equal(f.read("e", lead=(2,), box=(slice(1, 4), slice(0, 6))), t["e"][2, 1:4])
    assert f.bytes_read == n + 3 * 6 * 2
    assert torch.equal(f.read("s"), t["s"]) and torch.equal(f.read("e"), t["e"])
    f.close()


# ----------------------------------------------------------------------------------------------
# FP8 block quantization
# ----------------------------------------------------------------------------------------------
def quantize_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's scheme: per 128×128 block, scale_inv = amax / 448 and weight = w / scale_inv in e4m3."""
    rows, cols = w.shape
    br, bc = -(-rows // block), -(-cols // block)
    scale = torch.empty(br, bc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(br):
        for j in range(bc):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            s = blk.abs().max().clamp_min(1e-12) / 448.0
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def test_fp8_block_dequantization_hand_computed_and_against_transformers():
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    from lit_moe.model.safetensors_io import dequantize_blocks

    # 130 x 260: partial blocks in both directions; every value exactly representable in e4m3
    q = torch.full((130, 260), 1.5).to(torch.float8_e4m3fn)
    q[129, 257] = -3.0
    q[0, 0] = 0.5
    scale = torch.tensor([[0.25, 2.0, 8.0], [0.5, 4.0, 1.0 / 16]])
    full = dequantize_blocks(q, scale, (128, 128), slice(0, 130), slice(0, 260))
    # by hand: block (0,0) scale 0.25, block (1,2) scale 1/16, block (0,1) scale 2
    assert full[0, 0].item() == 0.5 * 0.25 and full[129, 257].item() == -3.0 / 16 and full[5, 200].item() == 3.0
    assert full[127, 127].item() == 1.5 * 0.25 and full[128, 128].item() == 1.5 * 4.0
    theirs = _dequantize_fp8_weight(q.clone(), scale, [128, 128], torch.float32)
    assert torch.equal(full, theirs)
    # a region straddling block edges, with only the scale blocks covering it
    part = dequantize_blocks(q[120:130, 250:260], scale[0:2, 1:3], (128, 128), slice(120, 130), slice(250, 260))
    assert torch.equal(part, theirs[120:130, 250:260])


def write_fp8_checkpoint(model, directory: Path) -> dict[str, torch.Tensor]:
    """``model`` saved as DeepSeek's FP8 release is: every projection weight of a decoder layer
    (attention, dense MLP, experts, shared experts) in e4m3 with its block scales, the rest as is.
    Returns transformers' dequantization of each quantized weight (the expected values)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    model.save_pretrained(directory)
    tensors = load_file(str(directory / "model.safetensors"))
    expected = {}
    for key in list(tensors):
        if key.startswith("model.layers.") and key.endswith("proj.weight") and tensors[key].dim() == 2:
            q, scale = quantize_blocks(tensors[key], 16)   # 16×16 blocks: several blocks in a tiny model
            tensors[key], tensors[key + "_scale_inv"] = q, scale
            expected[key] = _dequantize_fp8_weight(q.clone(), scale, [16, 16], torch.float32)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((directory / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [16, 16]}
    (directory / "config.json").write_text(json.dumps(cfg))
    return expected


def test_fp8_deepseek_checkpoint_loads_dequantized(tmp_path):
    from lit_moe.model import DeepseekV3ForCausalLM
    from lit_moe.hf.checkpoint import _Reader

    expected = write_fp8_checkpoint(tiny_model(), tmp_path)
    assert len(expected) > 20
    back = DeepseekV3ForCausalLM.from_pretrained(tmp_path, compute_dtype="float32")
    reader = _Reader(tmp_path)
    assert not any(k.endswith("_scale_inv") for k in reader.keys())
    for key, want in expected.items():
        assert torch.equal(reader.get(key), want), key
    # in the model: an expert's gate (transposed into gate_up_proj) and an attention projection
    e = back.layers[1].mlp.experts.gate_up_proj
    assert torch.equal(e[3, :, :32], expected["model.layers.1.mlp.experts.3.gate_proj.weight"].t())
    q = dict(back.named_parameters())["layers.0.self_attention.o_proj.weight"]
    assert torch.equal(q, expected["model.layers.0.self_attn.o_proj.weight"])


# ----------------------------------------------------------------------------------------------
# each rank reads its slices
# ----------------------------------------------------------------------------------------------
def _child(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lit_moe.hf.load import load_hf_into
    from lit_moe.model import DeepseekV3ForCausalLM

    dist.init_process_group("gloo", init_method=f"file://{root}/rdv", rank=rank, world_size=world)
    from lit_moe.runtime.distributed import release_process_groups_at_exit
    release_process_groups_at_exit()  # no gloo thread outlives the interpreter
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name in ("bf16", "fp8"):
        with torch.device("meta"):
            model = DeepseekV3ForCausalLM(CFG)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        out[name] = load_hf_into(model, Path(root) / name)
        full = {k: v.full_tensor() for k, v in model.state_dict().items() if hasattr(v, "full_tensor")}
        if rank == 0:
            torch.save(full, Path(root) / f"{name}-loaded.pt")
    Path(root, f"bytes-{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def scenario(root: Path) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_child, args=(2, str(root)), nprocs=2, start_method="fork")


def test_each_rank_reads_only_its_slices(tmp_path):
    """FSDP2 on 2 ranks: each rank reads about half of the tensor bytes of the file (its rows of every
    weight, its half of the experts), plus the header; the weights are the one-process load's, for
    bf16 and for FP8 weights (dequantized from the scale blocks covering each rank's rows)."""
    from lit_moe.model import DeepseekV3ForCausalLM

    model = tiny_model()
    for p in model.parameters():   # norms away from 1, so that a misplaced region shows
        p.data.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    model.save_pretrained(tmp_path / "bf16")
    write_fp8_checkpoint(model, tmp_path / "fp8")
    proc = launch_pool.run([str(HERE), "--scenario", str(tmp_path)], timeout=TIMEOUT, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    per_rank = [json.loads((tmp_path / f"bytes-{r}.json").read_text()) for r in range(2)]
    for name in ("bf16", "fp8"):
        path = tmp_path / name / "model.safetensors"
        head = _header_bytes(path)
        data = path.stat().st_size - head
        got = [r[name] - head for r in per_rank]
        print(f"{name}: tensor bytes {data}, read per rank {got} (+ {head} header)")
        # the MTP-less tiny model: every stored tensor is loaded, split by rows between the two ranks;
        # odd sizes and the FP8 scale blocks (read by both ranks where a block straddles the split)
        # make the halves uneven by < 2 %
        assert sum(got) >= data and all(0.45 * data <= g <= 0.55 * data for g in got), (got, data)
        one = DeepseekV3ForCausalLM.from_pretrained(tmp_path / name, compute_dtype="float32").state_dict()
        loaded = torch.load(tmp_path / f"{name}-loaded.pt")
        assert loaded.keys() <= one.keys() and len(loaded) > 20
        for k, v in loaded.items():
            assert torch.equal(v, one[k]), (name, k)


# ----------------------------------------------------------------------------------------------
# convert-hf streams
# ----------------------------------------------------------------------------------------------
BIGGER = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, max_position_embeddings=256,
              num_attention_heads=4, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, v_head_dim=32,
              qk_nope_head_dim=32, moe_intermediate_size=128, n_routed_experts=32, num_experts_per_tok=2,
              n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
              norm_topk_prob=True, scoring_func="sigmoid", moe_router_enable_expert_bias=True,
              num_nextn_predict_layers=0, params_dtype="float32", compute_dtype="float32", seq_length=16,
              qk_layernorm=True)

_PEAK = """
import sys
from lit_moe.hf import convert as convert_hf
from lit_moe.checkpoint.iteration import IterationReader, load_module
from lit_moe.checkpoint.resume import find_iteration_dir
from lit_moe.model import DeepseekV3ForCausalLM
from lit_moe.hf import checkpoint as hf
import torch, os, threading, time
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
before, peak, done = rss(), [0], []
def sample():   # the resident set, every millisecond (ru_maxrss would include the imports' peak)
    while not done:
        peak[0] = max(peak[0], rss())
        time.sleep(0.001)
threading.Thread(target=sample, daemon=True).start()
if sys.argv[1] == "stream":
    convert_hf.main(["--config", sys.argv[2], "--checkpoint", sys.argv[3], "--output", sys.argv[4]])
else:   # what convert-hf did before: the whole model in memory, then save_pretrained
    from lit_moe.model import DeepseekV3Config
    import yaml
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**yaml.safe_load(open(sys.argv[2]))["model"]))
    load_module(model, IterationReader(find_iteration_dir(convert_hf.Path(sys.argv[3]))))
    hf.save_pretrained(model, sys.argv[4])
done.append(1)
time.sleep(0.01)
print(max(peak[0], rss()) - before)
"""


def test_convert_hf_streams_with_bounded_memory(tmp_path):
    """Peak RSS growth of ``convert-hf`` on a 42.4 MiB fp32 model (32 experts × 3 MoE layers): streamed
    12.2 MiB (fixed costs; the largest Hugging Face tensor is 1 MiB); the whole-model path it replaces:
    127 MiB (3× the model). The streamed file equals ``save_pretrained``'s, tensor for tensor."""
    import yaml

    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM

    sys.path.insert(0, str(HERE.parent))
    from test_checkpoint_hf import _save_iteration

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**BIGGER))
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    _save_iteration(model, tmp_path / "ckpt")
    del model
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": BIGGER}))
    grew = {}
    for how in ("stream", "whole"):
        proc = subprocess.run([sys.executable, "-c", _PEAK, how, str(cfg), str(tmp_path / "ckpt"), str(tmp_path / how)],
                              capture_output=True, text=True, timeout=TIMEOUT, cwd=str(REPO),
                              env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        grew[how] = int(proc.stdout.strip().splitlines()[-1])
    print(f"model {model_bytes / 2**20:.1f} MiB; peak RSS growth: streamed {grew['stream'] / 2**20:.1f} MiB, "
          f"whole model {grew['whole'] / 2**20:.1f} MiB")
    assert grew["whole"] > model_bytes
    # streamed: measured 12.2 MiB, the modules the convert path imports and the checkpoint index, not
    # the model (the largest Hugging Face tensor and the largest region read are 1 MiB); whole: 127 MiB
    assert grew["stream"] < 16 * 2**20 and grew["stream"] < grew["whole"] / 5
    a, b = load_file(str(tmp_path / "stream" / "model.safetensors")), load_file(str(tmp_path / "whole" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


if __name__ == "__main__":
    if sys.argv[1] == "--scenario":
        scenario(Path(sys.argv[2]))
