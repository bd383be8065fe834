"""Step time of the pipeline schedules on 4 CPU ranks, and each rank's measured parameter,
gradient and optimizer bytes against the plan's per-stage prediction.

    python benchmarks/pipeline_schedules.py [--steps 4] [--layers 8] [--microbatches 8]

Every schedule runs the same tiny DeepSeek-V3 (MoE, MTP off), pp4, A micro-batches of one sample,
AdamW; step time is the median wall time of ``--steps`` steps after one warm-up step. Schedules:
``gpipe`` and ``1f1b`` (one stage per rank), ``interleaved_1f1b``, ``interleaved_zb`` and ``zbv``
(two stages per rank). Printed: median step time, its ratio to 1f1b, the plan's ideal bubble
fraction and in-flight micro-batch chunks, per rank measured vs planned static bytes
(parameters + gradients + AdamW's two moments, fp32), and per rank the high-water mark of the bytes
autograd saves for backward (a ``saved_tensors_hooks`` counter over one more step: distinct storages,
parameters left out, released when freed; with the zero-bubble schedules also the output gradients
torch's split backward keeps from a micro-batch's input-gradient step to its weight-gradient step)
against the plan's activation model at the schedule's
peak (``lit_moe.strategies.activation_memory`` with the CPU's math attention). The memory target:
within 15% of the plan.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # this checkout's lit_moe, also for the coordinator's plan side
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_zb", 2), ("zbv", 2)]
WORLD = 4


def model_section(layers: int) -> dict:
    return dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                num_hidden_layers=layers, first_k_dense_replace=1, num_attention_heads=4,
                q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                moe_aux_loss_coeff=0.01, moe_router_enable_expert_bias=True, num_nextn_predict_layers=0,
                seq_length=128, max_position_embeddings=256, position_embedding_type="rope",
                params_dtype="float32", compute_dtype="float32")


class SavedTensorBytes:
    """Bytes of the distinct storages autograd saves for backward that are alive now (``live``) and at
    most (``peak``); parameters are not activations and are left out. A storage is counted when first
    packed and released when it is freed (a weak-reference callback on the storage)."""

    def __init__(self, params):
        self.exclude = {p.untyped_storage().data_ptr() for p in params}
        self.alive: set[int] = set()
        self.live = self.peak = 0

    def pack(self, t):
        self.count(t)
        # detached: keeping ``t`` itself would let an op's saved output hold its own grad_fn, a cycle
        # through C++ that gc cannot break and that only a graph-freeing backward breaks; the
        # zero-bubble schedules' input-gradient step retains the graph, so such graphs (and every
        # tensor upstream of them) would never be freed: the counter itself would leak
        # (pytorch/pytorch#189025)
        return t.detach()

    def count(self, t) -> None:
        import weakref

        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.exclude and key not in self.alive and storage.nbytes():
            n = storage.nbytes()
            self.alive.add(key)
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, n)

    def count_weight_grad_inputs(self, backward_input):
        """Wraps torch's ``stage_backward_input`` (the zero-bubble schedules' input-gradient step) to
        also count the output gradients it keeps for the weight-gradient step (``param_groups``)."""

        def wrapped(*args, **kwargs):
            dinputs, param_groups = backward_input(*args, **kwargs)
            for group in param_groups:
                for grads in group.get("grads") or ():
                    for g in grads:
                        if g is not None:
                            self.count(g)
            return dinputs, param_groups

        return wrapped

    @staticmethod
    def unpack(t):
        return t

    def _free(self, key: int, n: int) -> None:
        self.alive.discard(key)
        self.live -= n


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import stage as pipelining_stage

    from lit_moe.config import ParallelismConfig
    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM
    from lit_moe.strategies import ParallelDims
    from lit_moe.pipeline import PipelineParallel, in_flight_microbatches, bubble_fraction, plan_stages

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = DeepseekV3Config(**model_section(args.layers))
    A, S = args.microbatches, cfg.seq_length
    results = {}
    for schedule, v in SCHEDULES:
        dims = ParallelDims(WORLD, pp=WORLD)
        dims.build_meshes("cpu")
        p = ParallelismConfig(pipeline_parallel=WORLD, pipeline_parallel_schedule=schedule,
                              pipeline_parallel_interleave_num=v)
        with torch.device("meta"):
            full = DeepseekV3ForCausalLM(cfg)
        planned = {n: t.numel() * t.element_size() for n, t in full.named_parameters()}
        pipe = PipelineParallel.build(full, dims, p, model_config=cfg)
        model = pipe.container
        model.to_empty(device="cpu")
        model.init_weights(0)
        opt = torch.optim.AdamW(list(model.parameters()), lr=1e-3, foreach=False)
        g = torch.Generator().manual_seed(0)
        times = []
        for step in range(args.steps + 1):
            tok = torch.randint(0, cfg.vocab_size, (A, S + 1), generator=g)
            dist.barrier()
            t0 = time.perf_counter()
            pipe.forward_backward([{"input_ids": tok[i:i + 1, :-1], "labels": tok[i:i + 1, 1:]} for i in range(A)])
            opt.step()
            dist.barrier()
            if step:
                times.append(time.perf_counter() - t0)
            if step < args.steps:
                opt.zero_grad(set_to_none=True)
        # one more step with a saved-tensor counter: the high-water mark of the bytes autograd keeps for
        # backward on this rank (the schedule's in-flight micro-batches), against the plan's model
        counter = SavedTensorBytes(model.parameters())
        tok = torch.randint(0, cfg.vocab_size, (A, S + 1), generator=g)
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        backward_input = pipelining_stage.stage_backward_input
        pipelining_stage.stage_backward_input = counter.count_weight_grad_inputs(backward_input)
        try:
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                pipe.forward_backward([{"input_ids": tok[i:i + 1, :-1], "labels": tok[i:i + 1, 1:]}
                                       for i in range(A)])
        finally:
            pipelining_stage.stage_backward_input = backward_input
        dist.barrier()
        params = sum(t.numel() * t.element_size() for t in model.parameters())
        grads = sum(t.grad.numel() * t.grad.element_size() for t in model.parameters() if t.grad is not None)
        states = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                     if torch.is_tensor(v) and v.dim() > 0)
        # the plan: this rank's stages' parameters, fp32, x4 (parameter, gradient, AdamW's two moments)
        line = [x for x in plan_stages(pipe.layout, planned, cfg.num_hidden_layers, False, A)
                if x.startswith(f"  pipeline rank {rank}:")][0]
        planned_params = int(line.split("parameters ")[1].split(" bytes")[0])
        results[schedule] = dict(time=statistics.median(times), measured=params + grads + states,
                                 planned=4 * planned_params, in_flight=in_flight_microbatches(pipe.layout, rank, A),
                                 bubble=bubble_fraction(pipe.layout, A), saved_peak=counter.peak,
                                 saved_left=counter.live)
    rows = [None] * WORLD
    dist.all_gather_object(rows, results)
    if rank == 0:
        print(json.dumps(rows))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}", __file__,
           "--worker", "--steps", str(args.steps), "--layers", str(args.layers), "--microbatches", str(args.microbatches)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
        return 1
    rows = json.loads([x for x in proc.stdout.splitlines() if x.startswith("[")][-1])
    base = max(r["1f1b"]["time"] for r in rows)
    print(f"pp{WORLD}, {args.layers} layers, A={args.microbatches}, {args.steps} timed steps (median, slowest rank)")
    print(f"{'schedule':18s} {'step s':>8s} {'vs 1f1b':>8s} {'bubble':>7s}  in-flight chunks per rank")
    worst = 0.0
    for schedule, _ in SCHEDULES:
        t = max(r[schedule]["time"] for r in rows)
        print(f"{schedule:18s} {t:8.3f} {t / base:8.2f} {rows[0][schedule]['bubble']:7.3f}  "
              f"{[r[schedule]['in_flight'] for r in rows]}")
        for r in rows:
            worst = max(worst, abs(r[schedule]["measured"] / r[schedule]["planned"] - 1))
    print("static bytes per rank (measured / planned):",
          {s: [f"{r[s]['measured'] / r[s]['planned']:.3f}" for r in rows] for s, _ in SCHEDULES})
    print(f"worst static-memory deviation from the plan: {worst:.1%} (target: within 15%)")
    act_worst = activation_table(rows, args)
    return 0 if worst <= 0.15 and act_worst <= 0.15 else 1


def activation_table(rows: list, args) -> float:
    """Per schedule and rank: the measured high-water mark of saved-tensor bytes, the plan's number
    (``lit_moe plan``'s model with the CPU's math attention and expected padded expert rows),
    their ratio. Returns the worst deviation."""
    from lit_moe.config import ParallelismConfig
    from lit_moe.model import DeepseekV3Config
    from lit_moe.strategies.activation_memory import pipeline_activation_plan
    from lit_moe.pipeline import PipelineLayout

    cfg = DeepseekV3Config(**model_section(args.layers))
    print("activations kept for backward per rank (saved tensors; zero-bubble: + output gradients kept for the "
          "weight-gradient step), MiB: measured peak / plan (ratio)")
    worst = 0.0
    for schedule, v in SCHEDULES:
        layout = PipelineLayout.from_config(ParallelismConfig(pipeline_parallel=WORLD, pipeline_parallel_schedule=schedule,
                                                              pipeline_parallel_interleave_num=v), cfg.num_hidden_layers)
        # the CPU pads each expert's row group to a multiple of 16 (half a multiple per expert expected)
        expert_rows = cfg.seq_length * cfg.num_experts_per_tok + cfg.n_routed_experts * 8
        plan = pipeline_activation_plan(cfg, layout, args.microbatches, 1, cfg.seq_length, core_attention="math",
                                        expert_rows=expert_rows)
        cells = []
        for r, row in enumerate(rows):
            measured, planned = row[schedule]["saved_peak"], plan[r]["bytes"]
            worst = max(worst, abs(measured / planned - 1))
            cells.append(f"{measured / 2**20:6.2f} / {planned / 2**20:6.2f} ({measured / planned:.2f})")
        left = [f"{row[schedule]['saved_left'] / 2**20:.2f}" for row in rows]
        print(f"{schedule:18s} " + "  ".join(cells) + f"   chunks {[p['chunks'] for p in plan]}, "
              f"MiB still held after the step {left}")
    print(f"worst activation-memory deviation from the plan: {worst:.1%} (target: within 15%)")
    return worst


if __name__ == "__main__":
    sys.exit(main())
