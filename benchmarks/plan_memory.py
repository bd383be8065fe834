"""Measured against planned: the peak memory of real ``lit_moe fit`` runs on the CPU and what
``lit_moe plan``'s memory model says for the same config and layout.

Each layout trains 2 steps of a small DeepSeek-V3 (fp32 compute, mock data) in a fresh process
group; a callback on every rank resets the kernel's peak-RSS counter at train start (``echo 5 >
/proc/self/clear_refs``, after the model is built and placed) and reads the peak (``VmHWM``) at train
end. ``MALLOC_MMAP_THRESHOLD_`` makes glibc return large buffers to the system when they are freed, so
the resident size follows the live tensors. The measured increment (peak − resident at train start)
is compared with the plan's per-rank peak minus the parameters (already resident at train start):
gradients, optimizer state, activations at the schedule's peak (evaluated for the CPU's attention
path, ``math``: the softmax probabilities are kept) and FSDP buffers.

    python benchmarks/plan_memory.py                 # every layout
    python benchmarks/plan_memory.py one_process     # only these

Prints one line per layout and rank: measured, planned, ratio. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from lightning.pytorch import Callback

ROOT = Path(__file__).resolve().parents[1]
MiB = 1024 ** 2

MODEL = dict(hidden_size=256, intermediate_size=1024, moe_intermediate_size=256,
             moe_shared_expert_intermediate_size=256, num_hidden_layers=3, first_k_dense_replace=1,
             num_attention_heads=8, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
             v_head_dim=32, vocab_size=4096, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
             num_nextn_predict_layers=1, seq_length=1024, compute_dtype="float32", params_dtype="float32")

BF16_MOMENTS = {"exp_avg_dtype": "bfloat16", "exp_avg_sq_dtype": "bfloat16"}
# name: (ranks, parallelism, recompute, local batch size, optimizer keys)
LAYOUTS = {
    "one_process": (1, {}, {"mode": None}, 2, {}),
    "one_process_bf16_moments": (1, {}, {"mode": None}, 2, BF16_MOMENTS),
    "one_process_full_recompute": (1, {}, {"mode": "full", "full_recompute_layer": [0, 1, 2, 3]}, 2, {}),
    "dp2_fsdp": (2, {}, {"mode": None}, 2, {}),
    "pp2_1f1b": (2, {"pipeline_parallel": 2, "pipeline_parallel_layers_per_stage": ["0-1", "2-2"]}, {"mode": None},
                 1, {}),
    "tp2_sequence_parallel": (2, {"tensor_parallel": 2}, {"mode": None}, 2, {}),
    "one_process_select": (1, {}, {"mode": "select", "select_module": {"self_attention": ["0-3"],
                                                                       r"mlp\.experts": ["1-3"]}}, 2, {}),
    "one_process_partial_full": (1, {}, {"mode": "full", "full_recompute_layer": [0, 1]}, 2, {}),
    # tensor parallel, full recompute of layer 0, selective of the others (tests/test_memory_plan.py)
    "tp2_select_partial_full": (2, {"tensor_parallel": 2}, {
        "mode": "select", "full_recompute_layer": [0],
        "select_module": {"self_attention": ["1-3"], r"mlp\.experts": ["1-2"]}}, 2, {}),
}


class PeakRSSCallback(Callback):
    """Lightning callback: resident bytes at train start and the peak after it, one JSON line per rank."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.start = 0

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"{key} not in /proc/self/status")

    def on_train_start(self, trainer, pl_module) -> None:
        import gc

        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")              # the peak (VmHWM) restarts from the current resident size
        self.start = self._status("VmRSS")

    def on_train_end(self, trainer, pl_module) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"rank": trainer.global_rank, "start": self.start,
                                "peak": self._status("VmHWM")}) + "\n")


def write_config(tmp: Path, layout: str) -> tuple[Path, int]:
    ranks, parallelism, recompute, lbs, optimizer = LAYOUTS[layout]
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["model"].update(MODEL)
    cfg["training"].update(steps=2, local_batch_size=lbs, global_batch_size=lbs * 2 * ranks
                           // (2 if parallelism.get("pipeline_parallel", 1) > 1 else 1))
    cfg["checkpoint"].update(enable_save=False, save_path=str(tmp / "ckpt"))
    cfg["monitor"] = {}
    cfg["parallelism"].update(parallelism)
    cfg["recompute"] = recompute
    cfg["optimizer"].update(optimizer)
    dl = cfg["train_dataset"]["dataloader"]
    dl["config"].update(seq_length=MODEL["seq_length"], mock=True)
    dl["config"].pop("data_path", None)
    dl["sizes"] = [64, 0, 0]
    cfg["train_dataset"]["num_parallel_workers"] = 0
    cfg["callbacks"] = [{"class_path": "plan_memory.PeakRSSCallback", "init_args": {"path": str(tmp / "peak.jsonl")}}]
    path = tmp / f"{layout}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path, ranks


LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
               "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE")


def measure(config: Path, ranks: int, tmp: Path, timeout: float = 900) -> list[dict]:
    # a launch of its own: no launch variables of a caller (an in-process run leaves MASTER_PORT behind,
    # and Lightning's launcher would reuse a port that is still taken)
    inherited = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("TORCHELASTIC_")}
    env = {**inherited, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")]),
           "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    (tmp / "peak.jsonl").unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-m", "lit_moe.cli", "fit", "--config", str(config),
                           "--trainer.devices", str(ranks), "--trainer.enable_progress_bar", "false",
                           "--trainer.enable_model_summary", "false"],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"fit failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (tmp / "peak.jsonl").read_text().splitlines()]
    return sorted(rows, key=lambda r: r["rank"])


def planned(config: Path, ranks: int) -> list[int]:
    """Per pipeline rank (one entry without pipelines): the plan's peak minus the parameters."""
    import io

    from lit_moe.strategies import memory_plan
    from lit_moe.strategies.plan import plan

    run = plan(str(config), ranks, out=io.StringIO())
    acts = memory_plan.activations_by_rank(run["model_config"], run["dims"], run["parallelism"], run["accumulation"],
                                           run["local_batch_size"], run["seq_length"], run["full_layers"],
                                           core_attention="math", selection=run["selection"])
    rows = memory_plan.rank_peaks(run["memory"], acts, run["parallelism"], run["memory"].get("fsdp_buffers", 0))
    return [r.total - r.params for r in rows]


def compare(layout: str) -> list[tuple[int, int, int]]:
    """``[(rank, measured increment, planned increment)]`` of one layout."""
    with tempfile.TemporaryDirectory(prefix="plan_memory_") as tmp:
        tmp = Path(tmp)
        config, ranks = write_config(tmp, layout)
        rows = measure(config, ranks, tmp)
        plan_rows = planned(config, ranks)
    pp = LAYOUTS[layout][1].get("pipeline_parallel", 1)
    out = []
    for row in rows:
        # pipeline rank of a global rank: the pp mesh dimension is the outermost
        index = row["rank"] // (ranks // pp) if pp > 1 else 0
        out.append((row["rank"], row["peak"] - row["start"], plan_rows[index]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("layouts", nargs="*", help=f"default: all of {', '.join(LAYOUTS)}")
    args = ap.parse_args(argv)
    for layout in args.layouts or list(LAYOUTS):
        for rank, measured, plan in compare(layout):
            print(f"{layout:28s} rank {rank}: measured {measured / MiB:8.1f} MiB, planned {plan / MiB:8.1f} MiB, "
                  f"measured/planned {measured / plan:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
