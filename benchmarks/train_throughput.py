"""Training throughput: lit_moe's real training path against Hugging Face transformers, side by side.

    python benchmarks/train_throughput.py                         # this CPU: the issue's model, 4 x 512 tokens
    python benchmarks/train_throughput.py --preset gpu            # one GPU / NPU: a larger model, 2 x 4096 tokens
    python benchmarks/train_throughput.py --dist dp2,ep2          # + two-process layouts on gloo: comm share
    python benchmarks/train_throughput.py --preset tiny --steps 2 --warmup 1   # smoke test

What is timed
-------------
* **lit_moe**: ``lit_moe fit --config <generated yaml>`` run in-process by a worker (``lit_moe.cli.main``):
  the YAML parser, the ``LitMoE`` LightningModule (manual optimization: forward, backward, global grad
  norm, clipping, AdamW, LR schedule, expert-bias update, step metrics), the ``AscendFSDPStrategy``, the
  Megatron mock-data DataModule (``num_parallel_workers: 0``, so fetching the batch is inside the timed
  step) and every built-in callback (skip guard, throughput, MoE metrics, step logger; TensorBoard off).
  The model section sets fp32 parameters (master weights) and bf16 ``compute_dtype``. The only addition
  is a user callback (``TurnTaking``, given in the YAML ``callbacks:`` list as users add theirs) that
  ends one timed step at ``on_train_batch_end`` and waits for its turn before the next batch is fetched.
* **transformers**: ``DeepseekV3ForCausalLM`` loaded (fp32) from the same weights (the lit_moe model,
  initialised from the run seed, written with ``save_pretrained``) and trained by a plain loop:
  ``torch.autocast(bf16)`` forward with ``labels``, backward, ``clip_grad_norm_(1.0)``, ``torch.optim.AdamW``
  (torch's default implementation for the device), ``zero_grad``; the loss is read back every step.
  Its attention and experts implementations are transformers' defaults (printed).

Both run in their own process (so each one's peak memory is its own) and take turns step by step:
the coordinator sends "go" to one, waits for its step, then the other, swapping the order every round,
so a change of load on a shared machine hits both alike. Between rounds it times a bf16 GEMM
(``n x n @ n x n``) on the same machine: the best of those is the machine's measured bf16 GEMM peak.
Threads: ``--threads`` (default: all cores) in both workers, set with ``torch.set_num_threads`` and
``OMP_NUM_THREADS``; the coordinator's GEMMs use the same number while the workers wait.

Reported
--------
* step time (median and best over the measured rounds), tokens/s = batch tokens / median step time;
* speed-up = median over rounds of t_transformers / t_lit_moe (and the ratio of the medians);
* peak memory: on CPU the worker's peak RSS (``getrusage``) minus its RSS before the model was built
  (after imports); on an accelerator ``max_memory_allocated`` (lit_moe: read before its built-in
  throughput callback resets the peak each step);
* MFU = training FLOPs per token (``lit_moe.model.sizing.flops_per_token``: Megatron's formula, causal
  attention counted half) x tokens/s / peak, against the measured GEMM peak and, on a known accelerator,
  its datasheet peak (``lit_moe.callbacks.throughput.KNOWN_PEAK_FLOPS``);
* ``--dist dp2,ep2``: each layout runs ``lit_moe fit`` on 2 local processes (gloo on CPU; the device's
  backend otherwise) and rank 0 profiles a few steps with ``torch.profiler``: the communication share is
  the wall time the main thread spends inside collective calls (issue + wait of all-gather,
  reduce-scatter, all-reduce, all-to-all, broadcast, barrier) over the profiled steps' wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# ------------------------------------------------------------------------------------------------
# models and presets
# ------------------------------------------------------------------------------------------------
# The model: vocab 8192, hidden 512, 4 layers (first dense, FFN 1024), 8 heads, q_lora 256,
# kv_lora 128, nope 64, rope 32, v 64, 8 routed experts of FFN 256, top-2, 1 shared expert,
# 4 groups / top-2 groups, no MTP.
CPU_MODEL = dict(
    vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, first_k_dense_replace=1,
    num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
    v_head_dim=64, n_routed_experts=8, moe_intermediate_size=256, num_experts_per_tok=2, n_shared_experts=1,
    moe_shared_expert_intermediate_size=256, n_group=4, topk_group=2, num_nextn_predict_layers=0,
)
# A larger model for one GPU / NPU: hidden 2048, 16 experts, sequence 4096 (about 1.3B parameters).
GPU_MODEL = dict(
    vocab_size=32768, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, first_k_dense_replace=1,
    num_attention_heads=16, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=16, moe_intermediate_size=1408, num_experts_per_tok=4, n_shared_experts=1,
    moe_shared_expert_intermediate_size=1408, n_group=4, topk_group=2, num_nextn_predict_layers=0,
)
TINY_MODEL = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, first_k_dense_replace=1,
    num_attention_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, n_routed_experts=4, moe_intermediate_size=32, num_experts_per_tok=2, n_shared_experts=1,
    moe_shared_expert_intermediate_size=32, n_group=2, topk_group=1, num_nextn_predict_layers=0,
)
# What every preset shares: DeepSeek-V3's routing and dtypes (fp32 master weights, bf16 compute).
COMMON_MODEL = dict(
    model_type="deepseek_v3", hidden_act="silu", rms_norm_eps=1e-6, use_flash_attention=True,
    multi_latent_attention=True, qk_layernorm=True, add_bias_linear=False,
    params_dtype="float32", compute_dtype="bfloat16", layernorm_compute_dtype="float32",
    softmax_compute_dtype="float32", rotary_dtype="float32", router_dense_type="float32",
    initializer_range=0.02, position_embedding_type="rope", rope_theta=10000, max_position_embeddings=8192,
    scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, moe_grouped_gemm=True,
    moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.0001,
    moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.001, moe_token_dispatcher_type="alltoall",
)
PRESETS = {
    "cpu": dict(model=CPU_MODEL, batch=4, seq=512, steps=10, warmup=2, gemm_n=2048),
    "gpu": dict(model=GPU_MODEL, batch=2, seq=4096, steps=20, warmup=3, gemm_n=8192),
    "tiny": dict(model=TINY_MODEL, batch=2, seq=64, steps=3, warmup=1, gemm_n=256),
}
SEED = 1234
LR = 1e-4
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.01
MAX_NORM = 1.0


def model_section(preset: dict, seq: int, overrides: dict) -> dict:
    return {**COMMON_MODEL, **preset["model"], "seq_length": seq, **overrides}


# ------------------------------------------------------------------------------------------------
# small helpers shared by the coordinator and the workers
# ------------------------------------------------------------------------------------------------
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # KiB on Linux


def resolve_device(name: str) -> str:
    import torch

    if name != "auto":
        return name
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if acc is not None and torch.accelerator.is_available():
        return acc.type
    try:
        import torch_npu  # noqa: F401
        if torch.npu.is_available():
            return "npu"
    except ImportError:
        pass
    return "cpu"


def synchronize(device) -> None:
    import torch

    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


def accel_module(device):
    import torch

    return getattr(torch, device.type)


class Channel:
    """JSON lines over one end of a socketpair."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.r = sock.makefile("r", encoding="utf-8")
        self.w = sock.makefile("w", encoding="utf-8")

    @classmethod
    def from_fd(cls, fd: int) -> "Channel":
        return cls(socket.socket(fileno=fd))

    def send(self, **msg: Any) -> None:
        self.w.write(json.dumps(msg) + "\n")
        self.w.flush()

    def recv(self, timeout: Optional[float] = None) -> dict:
        self.sock.settimeout(timeout)
        line = self.r.readline()
        if not line:
            raise EOFError("the other side closed the channel")
        return json.loads(line)


# ------------------------------------------------------------------------------------------------
# lit_moe worker: `lit_moe fit` with a turn-taking callback
# ------------------------------------------------------------------------------------------------
try:
    from lightning.pytorch import Callback as _Callback
except ImportError:  # the coordinator does not need Lightning
    _Callback = object


class TurnTaking(_Callback):
    """Ends each timed step at ``on_train_batch_end`` and waits for the coordinator's "go" before the
    next batch is fetched. Registered through the YAML ``callbacks:`` list like any user callback."""

    def __init__(self, fd: int, baseline_rss: int = 0):
        self.fd = fd
        self.baseline_rss = baseline_rss
        self.chan: Optional[Channel] = None
        self.t0 = 0.0
        self.peak_alloc = 0

    def _wait_turn(self) -> None:
        msg = self.chan.recv()
        if msg.get("cmd") == "stop":
            self.stopped = True
        self.t0 = time.perf_counter()

    def on_train_start(self, trainer, pl_module) -> None:
        import torch

        # First in line at batch end: the built-in throughput callback resets the accelerator's peak
        # memory statistic when it logs; read ours before it does.
        trainer.callbacks.remove(self)
        trainer.callbacks.insert(0, self)
        self.chan = Channel.from_fd(self.fd)
        self.stopped = False
        model = pl_module.model
        n_params = sum(p.numel() for p in model.parameters())
        self.chan.send(event="ready", params=n_params, rss=rss_bytes(), baseline_rss=self.baseline_rss,
                       threads=torch.get_num_threads(), world_size=trainer.world_size,
                       strategy=type(trainer.strategy).__name__,
                       fsdp=any(type(m).__name__.startswith("FSDP") for m in model.modules()),
                       compiled=bool(getattr(model.config, "compile_layers", False)))
        self._wait_turn()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        device = pl_module.device
        synchronize(device)
        dt = time.perf_counter() - self.t0
        if device.type != "cpu":
            self.peak_alloc = max(self.peak_alloc, accel_module(device).max_memory_allocated(device))
        m = pl_module.step_metrics
        self.chan.send(event="step", time=dt, loss=m.get("loss"), tokens=m.get("tokens"),
                       grad_norm=m.get("grad_norm"), rss=rss_bytes() - self.baseline_rss)
        self._wait_turn()

    def on_train_end(self, trainer, pl_module) -> None:
        self.chan.send(event="done", peak_rss=peak_rss_bytes(), baseline_rss=self.baseline_rss,
                       peak_alloc=self.peak_alloc)


def lit_config(spec: dict, steps: int, callbacks: list, out_dir: str, world_size: int = 1,
               parallelism: Optional[dict] = None) -> dict:
    batch, seq = spec["batch"], spec["seq"]
    model = model_section(PRESETS[spec["preset"]], seq, spec.get("model_overrides", {}))
    device_target = {"cpu": "cpu", "cuda": "gpu", "npu": "npu"}.get(spec["device"], spec["device"])
    optimizer = {"type": "AdamW", "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY}
    optimizer.update(spec.get("optimizer_overrides", {}))
    return {
        "checkpoint": {"enable_save": False, "save_path": os.path.join(out_dir, "ckpt")},
        "training": {"steps": steps, "local_batch_size": batch, "global_batch_size": batch * world_size,
                     "max_norm": MAX_NORM, "seed": SEED, "deterministic": False},
        "optimizer": optimizer,
        "lr_scheduler": {"type": "ConstantWarmUpLR", "learning_rate": LR, "warmup_steps": 0},
        "parallelism": {"data_parallel_shard": -1, "expert_parallel": 1, "tensor_parallel": 1,
                        **(parallelism or {})},
        "recompute": {"mode": None},
        "monitor": {"tensorboard": {"output_dir": "", "log_interval": 1}},
        "context": {"device_target": device_target},
        "trainer": {"enable_progress_bar": False, "enable_model_summary": False},
        "train_dataset": {
            "dataloader": {
                "type": "BlendedMegatronDatasetDataLoader", "datasets_type": "GPTDataset",
                "sizes": [steps * batch * world_size, 0, 0],
                "config": {"split": "1, 0, 0", "seq_length": seq, "eod_mask_loss": False,
                           "reset_position_ids": False, "create_attention_mask": False,
                           "reset_attention_mask": False, "create_compressed_eod_mask": False,
                           "eod": 1, "pad": -1},
                "column_names": ["input_ids", "labels", "loss_mask", "position_ids"],
                "shuffle": False, "python_multiprocessing": False,
            },
            "drop_remainder": True, "num_parallel_workers": 0,
        },
        "model": model,
        "callbacks": callbacks,
    }


def write_yaml(path: str, cfg: dict) -> str:
    import yaml

    with open(path, "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    return path


def lit_worker(spec: dict, fd: int) -> int:
    # import what `fit` imports before taking the baseline: peak memory is what training adds
    import lightning.pytorch  # noqa: F401

    import lit_moe.callbacks  # noqa: F401
    import lit_moe.checkpoint  # noqa: F401
    import lit_moe.data  # noqa: F401
    import lit_moe.module  # noqa: F401
    import lit_moe.strategies  # noqa: F401
    from lit_moe.cli import main as lit_main

    baseline = rss_bytes()

    cfg = lit_config(spec, spec["rounds"], [{"class_path": "train_throughput.TurnTaking",
                                            "init_args": {"fd": fd, "baseline_rss": baseline}}],
                     spec["work_dir"])
    path = write_yaml(os.path.join(spec["work_dir"], "lit_moe.yaml"), cfg)
    return lit_main(["fit", "--config", path])


# ------------------------------------------------------------------------------------------------
# transformers worker: a plain PyTorch loop
# ------------------------------------------------------------------------------------------------
def hf_worker(spec: dict, fd: int) -> int:
    import torch
    import transformers
    from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: F401

    baseline = rss_bytes()
    chan = Channel.from_fd(fd)
    device = torch.device(spec["device"])
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    gen = torch.Generator().manual_seed(SEED)
    vocab = model.config.vocab_size
    batches = [torch.randint(0, vocab, (spec["batch"], spec["seq"]), generator=gen).to(device) for _ in range(4)]
    chan.send(event="ready", params=sum(p.numel() for p in model.parameters()), rss=rss_bytes(),
              baseline_rss=baseline, threads=torch.get_num_threads(),
              attn_implementation=model.config._attn_implementation,
              experts_implementation=getattr(model.config, "_experts_implementation", None))
    step = 0
    peak_alloc = 0
    while chan.recv().get("cmd") == "go":
        t0 = time.perf_counter()
        ids = batches[step % len(batches)]
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = float(out.loss.detach())
        synchronize(device)
        dt = time.perf_counter() - t0
        if device.type != "cpu":
            peak_alloc = max(peak_alloc, accel_module(device).max_memory_allocated(device))
        chan.send(event="step", time=dt, loss=loss, grad_norm=float(grad_norm), rss=rss_bytes() - baseline)
        step += 1
    chan.send(event="done", peak_rss=peak_rss_bytes(), baseline_rss=baseline, peak_alloc=peak_alloc)
    return 0


# ------------------------------------------------------------------------------------------------
# distributed worker: one rank of `lit_moe fit` on N local processes
# ------------------------------------------------------------------------------------------------
COLLECTIVE_KEYS = ("all_gather", "allgather", "reduce_scatter", "all_reduce", "allreduce", "all_to_all",
                   "alltoall", "broadcast", "barrier", "c10d::wait", "record_param_comms", "gloo:",
                   "nccl:", "hccl")


def _is_collective(name: str) -> bool:
    n = name.lower()
    if n.startswith("fsdp::") and "copy" in n:   # FSDP's copy-in/copy-out are local memory copies
        return False
    return any(k in n for k in COLLECTIVE_KEYS)


class DistRecorder(_Callback):
    """Step times on every rank; rank 0 profiles steps ``[profile_from, profile_from + profile_steps)``
    and sums the wall time of the outermost collective calls on the main thread."""

    def __init__(self, out_path: str, profile_from: int = 2, profile_steps: int = 3):
        self.out_path = out_path
        self.profile_from = profile_from
        self.profile_steps = profile_steps
        self.times: list[float] = []
        self.prof = None
        self.t0 = 0.0
        self.step = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.t0 = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.is_global_zero and self.step == self.profile_from:
            import torch

            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()
            self.prof_t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        synchronize(pl_module.device)
        now = time.perf_counter()
        self.times.append(now - self.t0)
        self.t0 = now
        self.step += 1
        if self.prof is not None and self.step == self.profile_from + self.profile_steps:
            wall = time.perf_counter() - self.prof_t0
            self.prof.__exit__(None, None, None)
            self.comm = self._comm_time(self.prof)
            self.comm["wall"] = wall
            self.prof = None

    @staticmethod
    def _comm_time(prof) -> dict:
        import threading

        events = [e for e in prof.events() if e.device_type.name == "CPU"]
        main = threading.get_ident()
        # outermost collective intervals on the thread that ran the training step
        by_thread: dict[int, list] = {}
        for e in events:
            by_thread.setdefault(e.thread, []).append(e)
        thread = max(by_thread, key=lambda t: sum(ev.cpu_time_range.elapsed_us() for ev in by_thread[t]))
        spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in by_thread[thread]
                       if _is_collective(e.name))
        total, end, names = 0.0, -1.0, {}
        for s, t, name in spans:
            if s >= end:
                total += t - s
                end = t
                names[name] = names.get(name, 0.0) + (t - s) / 1e6
            elif t > end:
                total += t - end
                end = t
        del main
        return {"comm": total / 1e6, "by_op": dict(sorted(names.items(), key=lambda kv: -kv[1])[:8])}

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            with open(self.out_path, "w") as f:
                json.dump({"times": self.times, "comm": getattr(self, "comm", None),
                           "world_size": trainer.world_size, "peak_rss": peak_rss_bytes(),
                           "tokens_per_step": pl_module.step_metrics.get("tokens")}, f)


def dist_worker(spec: dict) -> int:
    from lit_moe.cli import main as lit_main

    rank = int(os.environ["LOCAL_RANK"])
    cfg = lit_config(spec, spec["rounds"],
                     [{"class_path": "train_throughput.DistRecorder",
                       "init_args": {"out_path": spec["out_path"], "profile_from": spec["profile_from"],
                                     "profile_steps": spec["profile_steps"]}}],
                     spec["work_dir"], world_size=spec["world_size"], parallelism=spec["parallelism"])
    path = write_yaml(os.path.join(spec["work_dir"], f"rank{rank}.yaml"), cfg)
    return lit_main(["fit", "--config", path])


# ------------------------------------------------------------------------------------------------
# coordinator
# ------------------------------------------------------------------------------------------------
class GemmPeak:
    """Best bf16 ``n x n @ n x n`` rate seen in this run (FLOP/s)."""

    def __init__(self, device: str, n: int):
        import torch

        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(0)
        self.a = torch.randn(n, n, generator=gen).to(self.device, torch.bfloat16)
        self.b = torch.randn(n, n, generator=gen).to(self.device, torch.bfloat16)
        self.n = n
        self.best = 0.0
        self.samples: list[float] = []

    def measure(self, repeats: int = 3) -> None:
        self.a @ self.b
        synchronize(self.device)
        for _ in range(repeats):
            t = time.perf_counter()
            self.a @ self.b
            synchronize(self.device)
            rate = 2.0 * self.n ** 3 / (time.perf_counter() - t)
            self.samples.append(rate)
            self.best = max(self.best, rate)


def spawn(role: str, spec_path: str, env: dict, log_path: str, fd: Optional[int] = None) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker", role, "--_spec", spec_path]
    if fd is not None:
        cmd += ["--_fd", str(fd)]
    log = open(log_path, "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT),
                            pass_fds=(fd,) if fd is not None else ())


def worker_env(threads: int, extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT), env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra or {})
    return env


def tail(path: str, n: int = 30) -> str:
    try:
        return "".join(open(path, errors="replace").readlines()[-n:])
    except OSError:
        return ""


def write_hf_checkpoint(model_cfg: dict, out_dir: str) -> None:
    """The lit_moe model as `lit_moe fit` initialises it (seeded by name from the run seed), saved in the
    Hugging Face layout for the transformers worker."""
    import torch

    from lit_moe.model import DeepseekV3ForCausalLM

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(model_cfg)
    model.to_empty(device="cpu")
    model.init_weights(SEED)
    model.save_pretrained(out_dir)
    del model


def run_pair(args, spec: dict, work: str, gemm: GemmPeak) -> dict:
    """Interleaved lit_moe / transformers rounds; returns the raw measurements."""
    spec_path = os.path.join(work, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = worker_env(args.threads)
    sides = ["lit_moe", "transformers"] if not args.skip_hf else ["lit_moe"]
    chans, procs, logs = {}, {}, {}
    for side in sides:
        parent, child = socket.socketpair()
        chans[side] = Channel(parent)
        logs[side] = os.path.join(work, f"{side}.log")
        procs[side] = spawn("lit" if side == "lit_moe" else "hf", spec_path, env, logs[side], child.fileno())
        child.close()
    try:
        ready = {}
        for side in sides:
            msg = _recv(chans[side], procs[side], logs[side], args.timeout)
            if msg.get("event") != "ready":
                raise RuntimeError(f"{side}: unexpected message {msg}")
            ready[side] = msg
        times = {s: [] for s in sides}
        losses = {s: [] for s in sides}
        rss = {s: [] for s in sides}
        for r in range(spec["rounds"]):
            order = sides if r % 2 == 0 else sides[::-1]
            for side in order:
                chans[side].send(cmd="go")
                msg = _recv(chans[side], procs[side], logs[side], args.timeout)
                if msg.get("event") != "step":
                    raise RuntimeError(f"{side}: unexpected message {msg}\n{tail(logs[side])}")
                times[side].append(msg["time"])
                rss[side].append(msg.get("rss"))
                losses[side].append(msg.get("loss"))
            gemm.measure()
            if args.verbose:
                print(f"  round {r}: " + "  ".join(f"{s} {times[s][-1]:.3f}s (RSS +{fmt_bytes(rss[s][-1])})"
                                                   for s in sides), flush=True)
        done = {}
        for side in sides:
            chans[side].send(cmd="stop")
            msg = _recv(chans[side], procs[side], logs[side], args.timeout)
            done[side] = msg
        for side in sides:
            procs[side].wait(timeout=args.timeout)
            if procs[side].returncode != 0:
                raise RuntimeError(f"{side} worker exited with {procs[side].returncode}:\n{tail(logs[side])}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    return {"ready": ready, "times": times, "losses": losses, "done": done, "logs": logs}


def _recv(chan: Channel, proc: subprocess.Popen, log: str, timeout: float) -> dict:
    try:
        return chan.recv(timeout=timeout)
    except (EOFError, socket.timeout, OSError) as e:
        raise RuntimeError(f"worker {proc.args[3]} failed ({e!r}); log {log}:\n{tail(log)}") from None


def run_dist(args, layout: str, base_spec: dict, work: str) -> dict:
    """`lit_moe fit` on 2 local processes with the layout's parallelism; rank 0's measurements."""
    import torch

    world = 2
    par = {"dp2": {}, "ep2": {"expert_parallel": 2}, "tp2": {"tensor_parallel": 2}}.get(layout)
    if par is None:
        raise SystemExit(f"--dist: unknown layout {layout!r}; supported: dp2, ep2, tp2")
    spec = dict(base_spec, world_size=world, parallelism=par, rounds=args.dist_steps,
                out_path=os.path.join(work, f"{layout}.json"), profile_from=max(1, args.dist_steps // 3),
                profile_steps=max(1, min(3, args.dist_steps - max(1, args.dist_steps // 3) - 1)))
    spec_path = os.path.join(work, f"{layout}-spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = max(1, args.threads // world) if base_spec["device"] == "cpu" else args.threads
    procs, logs = [], []
    for rank in range(world):
        env = worker_env(threads, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                                   "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0",
                                   "LOCAL_WORLD_SIZE": str(world)})
        log = os.path.join(work, f"{layout}-rank{rank}.log")
        logs.append(log)
        procs.append(spawn("dist", spec_path, env, log))
    deadline = time.time() + args.timeout * 4
    for p, log in zip(procs, logs):
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"--dist {layout}: timed out; {log}:\n{tail(log)}") from None
        if p.returncode != 0:
            for q in procs:
                q.kill()
            raise RuntimeError(f"--dist {layout}: a rank exited with {p.returncode}:\n{tail(log)}")
    with open(spec["out_path"]) as f:
        res = json.load(f)
    res["threads_per_rank"] = threads
    del torch
    return res


def fmt_bytes(n: Optional[float]) -> str:
    return "n/a" if n is None else f"{n / 2 ** 20:,.0f} MiB"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="model and batch (default: cpu on a CPU, gpu on an accelerator)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | npu")
    p.add_argument("--steps", type=int, default=None, help="measured rounds (each: one step of each side)")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured rounds first")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads of each worker")
    p.add_argument("--batch", type=int, default=None, help="micro-batch size (default: the preset's)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    p.add_argument("--model", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model-section key of lit_moe (YAML value), e.g. --model compile_layers=true")
    p.add_argument("--optimizer", action="append", default=[], metavar="KEY=VALUE",
                   help="override an optimizer-section key of lit_moe, e.g. --optimizer fused=true")
    p.add_argument("--skip-hf", action="store_true", help="time lit_moe only")
    p.add_argument("--dist", default="", help="comma-separated 2-process layouts to run after: dp2,ep2,tp2")
    p.add_argument("--dist-steps", type=int, default=6, help="steps of each --dist layout")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for a worker's step")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (configs, logs)")
    p.add_argument("--verbose", action="store_true", help="print every round")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_fd", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args._worker:
        with open(args._spec) as f:
            spec = json.load(f)
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        if args._worker == "lit":
            return lit_worker(spec, args._fd)
        if args._worker == "hf":
            return hf_worker(spec, args._fd)
        return dist_worker(spec)

    import torch
    import yaml

    device = resolve_device(args.device)
    preset_name = args.preset or ("cpu" if device == "cpu" else "gpu")
    preset = PRESETS[preset_name]
    steps = args.steps if args.steps is not None else preset["steps"]
    warmup = args.warmup if args.warmup is not None else preset["warmup"]
    batch = args.batch or preset["batch"]
    seq = args.seq or preset["seq"]
    overrides = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.model)}
    opt_overrides = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.optimizer)}
    torch.set_num_threads(args.threads)

    from lit_moe.callbacks.throughput import known_peak_flops
    from lit_moe.model import DeepseekV3Config
    from lit_moe.model.sizing import flops_per_token, param_counts

    model_cfg = model_section(preset, seq, overrides)
    config = DeepseekV3Config(**model_cfg)
    fpt = flops_per_token(config, seq)
    counts = param_counts(config)
    load0 = os.getloadavg()
    print(f"== train_throughput: preset {preset_name}, device {device}, batch {batch} x {seq} tokens, "
          f"{warmup} warm-up + {steps} measured rounds, {args.threads} threads per worker")
    print(f"   torch {torch.__version__}, python {platform.python_version()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")
    print(f"   model: {counts.total / 1e6:.1f}M parameters ({counts.active / 1e6:.1f}M active), "
          f"{fpt / 1e6:.1f} MFLOP per token (training)")
    if overrides:
        print(f"   lit_moe model overrides: {overrides}")
    if opt_overrides:
        print(f"   lit_moe optimizer overrides: {opt_overrides}")

    work = tempfile.mkdtemp(prefix="lit_moe_bench_")
    try:
        import transformers
        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
        if not args.skip_hf:
            raise SystemExit("transformers is not installed: install it or pass --skip-hf")
    results: dict[str, Any] = {"preset": preset_name, "device": device, "batch": batch, "seq": seq,
                               "threads": args.threads, "flops_per_token": fpt, "steps": steps,
                               "warmup": warmup, "model_overrides": overrides,
                               "optimizer_overrides": opt_overrides, "transformers": hf_version,
                               "torch": torch.__version__}
    try:
        t_prep = time.perf_counter()
        hf_dir = os.path.join(work, "hf")
        if not args.skip_hf:
            write_hf_checkpoint(model_cfg, hf_dir)
        spec = {"preset": preset_name, "device": device, "batch": batch, "seq": seq, "rounds": warmup + steps,
                "hf_dir": hf_dir, "work_dir": work, "model_overrides": overrides,
                "optimizer_overrides": opt_overrides}
        gemm = GemmPeak(device, preset["gemm_n"])
        gemm.measure(5)
        raw = run_pair(args, spec, work, gemm)
        gemm.measure(5)
        wall = time.perf_counter() - t_prep
        load1 = os.getloadavg()
        tokens = batch * seq
        sides = list(raw["times"])
        measured = {s: raw["times"][s][warmup:] for s in sides}
        peak = gemm.best
        acc_peak = None
        if device != "cpu":
            name = accel_module(torch.device(device)).get_device_name()
            acc_peak = known_peak_flops(name)
            results["device_name"] = name
        print(f"\n   transformers {hf_version}: attention {raw['ready'].get('transformers', {}).get('attn_implementation')}, "
              f"experts {raw['ready'].get('transformers', {}).get('experts_implementation')}; "
              f"lit_moe strategy {raw['ready']['lit_moe']['strategy']} (FSDP wrapped: {raw['ready']['lit_moe']['fsdp']}, "
              f"compiled layers: {raw['ready']['lit_moe']['compiled']}), threads "
              + ", ".join(f"{s} {raw['ready'][s]['threads']}" for s in sides))
        print(f"   measured bf16 GEMM peak ({gemm.n}^3): {peak / 1e9:,.1f} GFLOP/s (best of {len(gemm.samples)}; "
              f"median {statistics.median(gemm.samples) / 1e9:,.1f})"
              + (f"; datasheet peak of {results['device_name']}: {acc_peak / 1e12:,.0f} TFLOP/s" if acc_peak else ""))
        header = f"\n   {'':14s}{'median step':>12s}{'best step':>11s}{'tokens/s':>11s}{'MFU':>8s}{'MFU best':>10s}"
        if acc_peak:
            header += f"{'MFU sheet':>11s}"
        header += f"{'peak memory':>14s}{'final loss':>12s}"
        print(header)
        per_side = {}
        for s in sides:
            ts = measured[s]
            med, best = statistics.median(ts), min(ts)
            tps = tokens / med
            mfu = fpt * tps / peak
            mfu_best = fpt * tokens / best / peak
            done, ready = raw["done"][s], raw["ready"][s]
            if device == "cpu":
                mem = done["peak_rss"] - done["baseline_rss"]
            else:
                mem = done["peak_alloc"]
            per_side[s] = {"median_step_s": med, "best_step_s": best, "tokens_per_s": tps, "mfu": mfu,
                           "mfu_best": mfu_best, "peak_memory_bytes": mem, "step_times_s": raw["times"][s],
                           "losses": raw["losses"][s], "params": ready["params"],
                           "mfu_datasheet": fpt * tps / acc_peak if acc_peak else None}
            line = f"   {s:14s}{med:11.3f}s{best:10.3f}s{tps:11,.0f}{mfu:8.1%}{mfu_best:10.1%}"
            if acc_peak:
                line += f"{fpt * tps / acc_peak:11.1%}"
            last = [x for x in raw["losses"][s] if x is not None]
            line += f"{fmt_bytes(mem):>14s}{(last[-1] if last else float('nan')):12.4f}"
            print(line)
        results["sides"] = per_side
        results["gemm_peak_flops"] = peak
        results["datasheet_peak_flops"] = acc_peak
        results["load_average"] = {"start": load0, "end": load1}
        if "transformers" in per_side:
            lt, ht = measured["lit_moe"], measured["transformers"]
            ratios = [h / l for h, l in zip(ht, lt)]
            speedup = statistics.median(ratios)
            mem_ratio = per_side["lit_moe"]["peak_memory_bytes"] / max(per_side["transformers"]["peak_memory_bytes"], 1)
            results["speedup"] = speedup
            results["speedup_of_medians"] = statistics.median(ht) / statistics.median(lt)
            results["memory_ratio"] = mem_ratio
            print(f"\n   speed-up lit_moe vs transformers: {speedup:.2f}x (median of per-round ratios; "
                  f"min {min(ratios):.2f}, max {max(ratios):.2f}; ratio of medians {results['speedup_of_medians']:.2f}x)")
            print(f"   peak memory lit_moe / transformers: {mem_ratio:.2f}")
        print(f"   load average start {load0[0]:.2f}, end {load1[0]:.2f}; wall time {wall:.0f}s; "
              f"logs {'kept in ' + work if args.keep else 'removed (--keep keeps them)'}")

        layouts = [x.strip() for x in args.dist.split(",") if x.strip()]
        if layouts:
            results["dist"] = {}
            print(f"\n   two-process layouts ({'gloo' if device == 'cpu' else 'device backend'}), "
                  f"{args.dist_steps} steps each, batch {batch} x {seq} per rank:")
            print(f"   {'layout':8s}{'median step':>12s}{'tokens/s':>11s}{'comm share':>12s}  top collectives")
            for layout in layouts:
                res = run_dist(args, layout, spec, work)
                ts = res["times"][1:] or res["times"]
                med = statistics.median(ts)
                tok = res.get("tokens_per_step") or batch * seq * res["world_size"]
                comm = res.get("comm") or {}
                share = comm["comm"] / comm["wall"] if comm.get("wall") else float("nan")
                top = ", ".join(f"{k} {v:.2f}s" for k, v in list((comm.get("by_op") or {}).items())[:3])
                print(f"   {layout:8s}{med:11.3f}s{tok / med:11,.0f}{share:12.1%}  {top}")
                results["dist"][layout] = {"median_step_s": med, "tokens_per_s": tok / med, "comm_share": share,
                                           "comm": comm, "step_times_s": res["times"],
                                           "threads_per_rank": res["threads_per_rank"]}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
