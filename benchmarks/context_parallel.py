"""Per-rank activation memory and step time of context parallelism at cp 1, 2 and 4 on the tiny config's MoE.

    python benchmarks/context_parallel.py [--config configs/tiny.yaml] [--seq-length 8192]
                                          [--cp 1,2,4] [--methods colossal,ulysses] [--steps 3] [--check]

Targets (issue 17): per-rank peak activation memory at cp2 ≤ 0.6× cp1 and at cp4 ≤ 0.35× cp1.

Each cp > 1 runs as ``cp`` real processes (``torch.distributed.run``, gloo on CPU) through
``parallelize`` (context parallel + FSDP2 over the cp ranks); cp 1 is the plain one-process model
(what ``parallelize`` gives one process). One micro-batch of ``--batch-size`` sequences of
``--seq-length`` tokens; the objective is ``loss + aux_loss + mtp_loss``.

* ``held``: bytes of tensors created by the forward that are alive when it returns: what is kept
  for backward, the peak of activation memory (measured as in ``recompute_memory.py``: on CPU a
  dispatch mode counts every new tensor storage until it is freed; on an accelerator the
  allocator's statistics). The targets are judged on it, for the rank that holds the most.
* ``peak``: the highest live bytes during forward + backward (adds activation gradients).
* ``time``: median wall time of ``--steps`` forward+backward+optimizer-free steps, after one
  warm-up step; on this 2-core machine cp4 runs 4 processes on 2 cores, so its time is not a speed-up
  measure, only memory is.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from recompute_memory import load_model_section, make_batch, measure_memory, objective  # noqa: E402


def build(section: dict, cp: int, method: str):
    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(**section)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    if cp > 1:
        from lit_moe.config import ParallelismConfig
        from lit_moe.strategies import ParallelDims
        from lit_moe.strategies.parallelize import parallelize

        dims = ParallelDims(cp, cp=cp)
        dims.build_meshes("cpu")
        parallelize(model, dims, ParallelismConfig(context_parallel=cp, context_parallel_method=method),
                    model_config=config)
    model.to_empty(device="cpu")
    model.init_weights(0)
    return model.train()


def measure(section: dict, cp: int, method: str, batch: int, seq: int, steps: int) -> dict:
    model = build(section, cp, method)
    data = make_batch(section["vocab_size"], batch, seq, torch.device("cpu"))
    objective(model, data).backward()                      # warm-up: gradient buffers exist from here on
    held, peak = measure_memory(model, data, torch.device("cpu"))
    times = []
    for _ in range(steps):
        if cp > 1:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        objective(model, data).backward()
        times.append(time.perf_counter() - t0)
    return {"held": held, "peak": peak, "time": statistics.median(times)}


def worker(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    section = load_model_section(pathlib.Path(args.config))
    section.update(seq_length=args.seq_length, max_position_embeddings=max(args.seq_length,
                                                                            section.get("max_position_embeddings", 0)))
    result = measure(section, dist.get_world_size(), args.method, args.batch_size, args.seq_length, args.steps)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, result)
    if dist.get_rank() == 0:
        pathlib.Path(args.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def run(args, cp: int, method: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp, "rows.json")
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}",
               __file__, "--worker", "--out", str(out), "--method", method, "--config", args.config,
               "--seq-length", str(args.seq_length), "--batch-size", str(args.batch_size), "--steps", str(args.steps)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            raise SystemExit(f"cp{cp} {method} failed:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "tiny.yaml"))
    p.add_argument("--seq-length", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--cp", default="1,2,4")
    p.add_argument("--methods", default="colossal,ulysses")
    p.add_argument("--method", default="colossal", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--check", action="store_true", help="exit 1 when a memory target is missed")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    torch.set_num_threads(1)
    degrees = [int(c) for c in args.cp.split(",")]
    section = load_model_section(pathlib.Path(args.config))
    section.update(seq_length=args.seq_length,
                   max_position_embeddings=max(args.seq_length, section.get("max_position_embeddings", 0)))
    base = None
    targets = {2: 0.6, 4: 0.35}
    ok = True
    print(f"tiny MoE ({args.config}), batch {args.batch_size} x {args.seq_length} tokens, "
          f"compute {section.get('compute_dtype')}")
    print(f"{'layout':<14} {'held MiB (max rank)':>20} {'peak MiB':>10} {'step s':>8} {'held / cp1':>11}  target")
    for method in args.methods.split(","):
        for cp in degrees:
            if cp == 1 and base is not None:
                continue
            rows = [measure(section, 1, method, args.batch_size, args.seq_length, args.steps)] if cp == 1 \
                else run(args, cp, method)
            held = max(r["held"] for r in rows)
            peak = max(r["peak"] for r in rows)
            step = max(r["time"] for r in rows)
            if cp == 1:
                base = held
            ratio = held / base if base else float("nan")
            target = targets.get(cp)
            verdict = "" if target is None else (f"≤ {target}: " + ("met" if ratio <= target else "MISSED"))
            ok &= target is None or ratio <= target
            name = "cp1" if cp == 1 else f"cp{cp} {method}"
            print(f"{name:<14} {held / 2**20:>20.1f} {peak / 2**20:>10.1f} {step:>8.2f} {ratio:>11.3f}  {verdict}")
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
