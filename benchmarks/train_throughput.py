"""Training throughput: lit_moe's real training path against Hugging Face transformers, side by side.

    python benchmarks/train_throughput.py                        # this CPU: the issue's model, 4 x 512 tokens
    python benchmarks/train_throughput.py --dist dp2,ep2         # + 2-process layouts on gloo: comm share
    python benchmarks/train_throughput.py --device cuda          # one GPU / NPU: the gpu preset (bigger)
    python benchmarks/train_throughput.py --preset tiny --steps 2 --warmup 1   # smoke test (seconds)

What is timed
-------------
* **lit_moe**, one worker per variant (``--lit``; on the CPU preset ``eager``, the defaults, and
  ``compile``, the model section's ``torch_compile: True``): ``lit_moe fit --config <generated yaml>``
  run in-process (``lit_moe.cli.main``): the
  ``LitMoE`` LightningModule (manual optimization: forward, backward, global grad norm, clipping, AdamW,
  LR schedule, expert-bias update, step metrics), the ``AscendFSDPStrategy``, the Megatron mock-data
  DataModule (``num_parallel_workers: 0``: fetching the batch is inside the timed step) and every
  built-in callback (skip guard, throughput, MoE metrics, step logger; TensorBoard off). fp32
  parameters (master weights), ``compute_dtype`` bf16 where the device runs it natively and fp32
  elsewhere (``auto``, resolved once by the coordinator and given to every side), AdamW, ``max_norm: 1.0``. The one addition is a
  user callback (``TurnTaking``, listed in the YAML ``callbacks:`` as users add theirs) that ends a
  timed step at ``on_train_batch_end`` and waits for its turn before the next batch is fetched.
* **transformers**: ``DeepseekV3ForCausalLM`` loaded in fp32 from the same weights (the lit_moe model
  initialised from the run seed, written with ``save_pretrained``), trained by a plain loop:
  ``torch.autocast(bf16)`` forward with ``labels`` (no autocast when the compute dtype is fp32), backward, ``clip_grad_norm_(1.0)``,
  ``torch.optim.AdamW`` (same hyper-parameters, torch's default implementation), ``zero_grad``; the loss
  is read back every step. Attention and experts implementations are transformers' defaults (printed).

Every side runs in its own process (so each one's memory is its own) and they take turns step by
step: the coordinator sends "go" to one, waits for its step, then the next, reversing the order every
round, so a change of load on a shared machine hits all alike. First the coordinator prints the
device's bf16 and fp32 matmul rates (``lit_moe.runtime.device_speed``) and the compute dtype they decide;
after every round it times a GEMM (``n x n @ n x n``) in the compute dtype while the workers wait:
the best of those is this machine's measured GEMM peak. Threads: ``--threads`` (default: all cores) in every worker (``torch.set_num_threads``
and ``OMP_NUM_THREADS``) and in the coordinator.

Reported
--------
* step time (median, best) over the measured rounds; tokens/s = batch tokens / median step time;
* speed-up of each lit_moe variant = median over rounds of t_transformers / t_variant;
* peak memory, from one more (untimed) step of each side: peak *tensor* memory, i.e. what
  ``max_memory_allocated`` reports on an accelerator; on CPU the peak of the running sum of the
  allocator events ``torch.profiler(profile_memory=True)`` records over the step, plus the parameters,
  gradients, buffers and optimizer state alive when it starts. On CPU also the process RSS growth over
  its RSS before the model was built (after imports): peak, at the end, and at the end after glibc's
  ``malloc_trim`` (RSS adds freed heap memory glibc keeps and oneDNN's per-shape kernel caches);
* MFU = training FLOPs per token (``lit_moe.model.sizing.flops_per_token``: Megatron's formula, causal
  attention counted half) x tokens/s / peak: the measured GEMM peak, and on a known accelerator also its
  datasheet bf16 peak (``lit_moe.callbacks.throughput.KNOWN_PEAK_FLOPS``);
* ``--dist dp2,ep2`` (CPU, gloo): ``lit_moe fit`` (``--dist-lit``, default eager) on 2 local processes
  (``--threads`` split between them) with ``data_parallel_shard: 2`` (dp2) or ``expert_parallel: 2``
  (ep2); rank 0 profiles a few steps (``torch.profiler``) and the communication share is the wall time
  its training thread spends inside communication (FSDP all-gather incl. its copy-in / wait and
  copy-out, the post-backward reduce-scatter, all-to-all dispatch/combine and their backward, c10d
  all-reduces) over the profiled steps' wall time.
"""

from __future__ import annotations

import argparse
import json
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
# One GPU / NPU: hidden 2048, 16 experts, sequence 4096 (0.77B parameters; three workers share the device).
GPU_MODEL = dict(
    vocab_size=32768, hidden_size=2048, intermediate_size=5632, num_hidden_layers=6, first_k_dense_replace=1,
    num_attention_heads=16, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=16, moe_intermediate_size=1024, num_experts_per_tok=4, n_shared_experts=1,
    moe_shared_expert_intermediate_size=1024, n_group=4, topk_group=2, num_nextn_predict_layers=0,
)
TINY_MODEL = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, first_k_dense_replace=1,
    num_attention_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, n_routed_experts=4, moe_intermediate_size=32, num_experts_per_tok=2, n_shared_experts=1,
    moe_shared_expert_intermediate_size=32, n_group=2, topk_group=1, num_nextn_predict_layers=0,
)
# What every preset shares: DeepSeek-V3's routing and dtypes (fp32 master weights; compute in bf16 where
# it is native, else fp32: "auto", resolved once in main() so that both sides run the same dtype).
COMMON_MODEL = dict(
    model_type="deepseek_v3", hidden_act="silu", rms_norm_eps=1e-6, use_flash_attention=True,
    multi_latent_attention=True, qk_layernorm=True, add_bias_linear=False,
    params_dtype="float32", compute_dtype="auto", layernorm_compute_dtype="float32",
    softmax_compute_dtype="float32", rotary_dtype="float32", router_dense_type="float32",
    initializer_range=0.02, position_embedding_type="rope", rope_theta=10000, max_position_embeddings=8192,
    scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, moe_grouped_gemm=True,
    moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.0001,
    moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.001, moe_token_dispatcher_type="alltoall",
)
PRESETS = {
    "cpu": dict(model=CPU_MODEL, batch=4, seq=512, steps=10, warmup=2, gemm_n=2048, lit="eager,compile"),
    "gpu": dict(model=GPU_MODEL, batch=2, seq=4096, steps=20, warmup=3, gemm_n=8192, lit="compile,eager"),
    "tiny": dict(model=TINY_MODEL, batch=2, seq=64, steps=3, warmup=1, gemm_n=256, lit="eager"),
}
# lit_moe variants: (model-section keys, optimizer-section keys) on top of the benchmark's YAML.
LIT_VARIANTS = {
    "compile": ({"torch_compile": True}, {}),
    "eager": ({"torch_compile": False}, {}),
    # the optimizer section's defaults already pick torch's fused AdamW kernel on plain tensors
    "eager-unfused": ({"torch_compile": False}, {"fused": False}),
}
# speed-up: issue 18 (the CPU must stay >= 2x transformers); MFU and peak memory <= transformers: the
# first CPU issue's targets (its speed-up bar was 1.5x)
TARGETS = {"speedup": 2.0, "mfu": 0.5}
SEED = 1234
LR = 1e-4
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.01
MAX_NORM = 1.0


def model_section(preset: str, seq: int, overrides: dict) -> dict:
    return {**COMMON_MODEL, **PRESETS[preset]["model"], "seq_length": seq, **overrides}


# ------------------------------------------------------------------------------------------------
# helpers shared by the coordinator and the workers
# ------------------------------------------------------------------------------------------------
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # KiB on Linux


def trimmed_rss_bytes() -> Optional[int]:
    """RSS after glibc's ``malloc_trim(0)`` has handed freed heap memory back (None without glibc)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    return rss_bytes()


def resolve_device(name: str) -> str:
    import torch

    if name != "auto":
        return name
    if hasattr(torch, "accelerator") and torch.accelerator.is_available():
        return torch.accelerator.current_accelerator().type
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)

        if torch.npu.is_available():
            return "npu"
    except ImportError:
        pass
    return "cpu"


def accel_module(device):
    import torch

    return getattr(torch, device.type)


def synchronize(device) -> None:
    if device.type != "cpu":
        accel_module(device).synchronize(device)


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shards)."""
    import torch

    seen: dict[int, int] = {}
    for t in tensors:
        if not torch.is_tensor(t) or t.device.type == "meta":
            continue
        t = getattr(t, "_local_tensor", t)
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def training_state_bytes(model, optimizer) -> int:
    """Parameters, gradients, buffers and optimizer state: what lives from one step to the next."""
    params = list(model.parameters())
    tensors = params + [p.grad for p in params] + list(model.buffers())
    for state in optimizer.state.values():
        tensors += list(state.values())
    return tensor_bytes(tensors)


class StepMemory:
    """Peak tensor memory of one step (see the module docstring)."""

    def __init__(self, device):
        self.device = device
        self.prof = None
        self.state_bytes = 0

    def start(self, state_bytes: int) -> None:
        import torch

        self.state_bytes = state_bytes
        if self.device.type == "cpu":
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                               profile_memory=True)
            self.prof.__enter__()
        else:
            synchronize(self.device)
            accel_module(self.device).reset_peak_memory_stats(self.device)

    def stop(self) -> int:
        synchronize(self.device)
        if self.device.type != "cpu":
            return int(accel_module(self.device).max_memory_allocated(self.device))
        self.prof.__exit__(None, None, None)
        events = sorted((e.start_ns(), e.nbytes()) for e in self.prof.profiler.kineto_results.events()
                        if e.name() == "[memory]" and e.device_type().name == "CPU")
        self.prof = None
        live = peak = 0
        for _, nbytes in events:
            live += nbytes
            peak = max(peak, live)
        return self.state_bytes + peak


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


def write_yaml(path: str, cfg: dict) -> str:
    import yaml

    with open(path, "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    return path


# ------------------------------------------------------------------------------------------------
# lit_moe worker: `lit_moe fit` with a turn-taking user callback
# ------------------------------------------------------------------------------------------------
try:
    from lightning.pytorch import Callback as _Callback
except ImportError:  # the coordinator alone does not need Lightning
    _Callback = object


class TurnTaking(_Callback):
    """Ends a timed step at ``on_train_batch_end`` and waits for the coordinator's "go" before the next
    batch is fetched; on a "go" with ``memory`` it measures that step's peak tensor memory."""

    def __init__(self, fd: int, baseline_rss: int = 0):
        self.fd = fd
        self.baseline_rss = baseline_rss
        self.chan: Optional[Channel] = None
        self.memory: Optional[StepMemory] = None
        self.t0 = 0.0

    def _wait_turn(self, trainer, pl_module) -> None:
        msg = self.chan.recv()
        if msg.get("memory"):
            self.memory = StepMemory(pl_module.device)
            self.memory.start(training_state_bytes(pl_module.model, trainer.optimizers[0]))
        self.t0 = time.perf_counter()

    def on_train_start(self, trainer, pl_module) -> None:
        import torch

        # First in line at batch end: the built-in throughput callback resets the accelerator's
        # peak-memory statistic when it logs.
        trainer.callbacks.remove(self)
        trainer.callbacks.insert(0, self)
        self.chan = Channel.from_fd(self.fd)
        model = pl_module.model
        self.chan.send(event="ready", params=sum(p.numel() for p in model.parameters()),
                       threads=torch.get_num_threads(), strategy=type(trainer.strategy).__name__,
                       fsdp=any(type(m).__name__.startswith("FSDP") for m in model.modules()),
                       torch_compile=bool(getattr(model.config, "torch_compile", False)),
                       optimizer=type(trainer.optimizers[0]).__name__,
                       optimizer_flags={k: trainer.optimizers[0].defaults.get(k) for k in ("foreach", "fused")})
        self._wait_turn(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        synchronize(pl_module.device)
        dt = time.perf_counter() - self.t0
        tensor_peak = None
        if self.memory is not None:
            tensor_peak, self.memory = self.memory.stop(), None
        m = pl_module.step_metrics
        self.chan.send(event="step", time=dt, loss=m.loss, rss=rss_bytes() - self.baseline_rss,
                       tensor_peak=tensor_peak)
        if trainer.global_step < trainer.max_steps:
            self._wait_turn(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.chan.recv()   # "stop"
        peak, now = peak_rss_bytes(), rss_bytes()
        self.chan.send(event="done", peak_rss=peak, baseline_rss=self.baseline_rss, rss_end=now,
                       rss_trimmed=trimmed_rss_bytes())


def lit_config(spec: dict, steps: int, callbacks: list, model_overrides: dict, optimizer_overrides: dict,
               world_size: int = 1, parallelism: Optional[dict] = None) -> dict:
    """The YAML a user would write for this benchmark (mock data, no checkpoints, TensorBoard off)."""
    batch, seq = spec["batch"], spec["seq"]
    device_target = {"cpu": "cpu", "cuda": "gpu", "npu": "npu"}.get(spec["device"], spec["device"])
    optimizer = {"type": "AdamW", "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY,
                 **optimizer_overrides}
    return {
        "checkpoint": {"enable_save": False, "save_path": os.path.join(spec["work_dir"], "ckpt")},
        "training": {"steps": steps, "local_batch_size": batch, "global_batch_size": batch * world_size,
                     "max_norm": MAX_NORM, "seed": SEED, "deterministic": False},
        "optimizer": optimizer,
        "lr_scheduler": {"type": "ConstantWarmUpLR", "learning_rate": LR, "warmup_steps": 0},
        "parallelism": {"data_parallel_shard": -1, "expert_parallel": 1, "tensor_parallel": 1, **(parallelism or {})},
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
                           "eod": 1, "pad": -1, "mock": True},
                "column_names": ["input_ids", "labels", "loss_mask", "position_ids"],
                "shuffle": False, "python_multiprocessing": False,
            },
            "drop_remainder": True, "num_parallel_workers": 0,
        },
        "model": model_section(spec["preset"], seq, model_overrides),
        "callbacks": callbacks,
    }


def _import_fit() -> Any:
    # Import what `fit` imports before the RSS baseline: the RSS growth is what training adds.
    import lightning.pytorch  # noqa: F401

    import lit_moe.callbacks  # noqa: F401
    import lit_moe.checkpoint  # noqa: F401
    import lit_moe.data  # noqa: F401
    import lit_moe.module  # noqa: F401
    import lit_moe.strategies  # noqa: F401
    from lit_moe.cli import main

    return main


def lit_worker(spec: dict, side: str, fd: int) -> int:
    lit_main = _import_fit()
    baseline = rss_bytes()
    callbacks = [{"class_path": "train_throughput.TurnTaking", "init_args": {"fd": fd, "baseline_rss": baseline}}]
    # one step more than the rounds: the untimed memory step
    side_spec = spec["sides"][side]
    cfg = lit_config(spec, spec["rounds"] + 1, callbacks, side_spec["model_overrides"],
                     side_spec["optimizer_overrides"])
    path = write_yaml(os.path.join(spec["work_dir"], f"{side.replace(' ', '_')}.yaml"), cfg)
    return lit_main(["fit", "--config", path])


# ------------------------------------------------------------------------------------------------
# transformers worker: a plain PyTorch loop
# ------------------------------------------------------------------------------------------------
def hf_worker(spec: dict, side: str, fd: int) -> int:
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
    chan.send(event="ready", params=sum(p.numel() for p in model.parameters()), threads=torch.get_num_threads(),
              attn_implementation=model.config._attn_implementation,
              experts_implementation=getattr(model.config, "_experts_implementation", None),
              optimizer_flags={k: opt.defaults.get(k) for k in ("foreach", "fused")})
    step = 0
    while True:
        msg = chan.recv()
        if msg.get("cmd") != "go":
            break
        memory = None
        if msg.get("memory"):
            memory = StepMemory(device)
            memory.start(training_state_bytes(model, opt))
        t0 = time.perf_counter()
        ids = batches[step % len(batches)]
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                            enabled=spec["compute_dtype"] == "bfloat16"):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = float(out.loss.detach())
        synchronize(device)
        dt = time.perf_counter() - t0
        del out
        tensor_peak = memory.stop() if memory is not None else None
        chan.send(event="step", time=dt, loss=loss, rss=rss_bytes() - baseline, tensor_peak=tensor_peak)
        step += 1
    peak, now = peak_rss_bytes(), rss_bytes()
    chan.send(event="done", peak_rss=peak, baseline_rss=baseline, rss_end=now, rss_trimmed=trimmed_rss_bytes())
    return 0


# ------------------------------------------------------------------------------------------------
# distributed worker: one rank of `lit_moe fit` on 2 local processes
# ------------------------------------------------------------------------------------------------
def is_communication(name: str) -> bool:
    """Profiler ranges that are communication (their nested copies and waits included)."""
    n = name.lower()
    if n.startswith("fsdp::"):
        return n.startswith(("fsdp::all_gather", "fsdp::post_backward_reduce", "fsdp::reduce_scatter"))
    return any(k in n for k in ("c10d::", "c10d_functional::", "gloo:", "nccl:", "hccl", "alltoall", "all_to_all",
                                "record_param_comms"))


class DistRecorder(_Callback):
    """Step times on every rank; rank 0 profiles steps ``[profile_from, profile_from + profile_steps)``
    and measures the wall time its training thread spends in communication."""

    def __init__(self, out_path: str, profile_from: int = 2, profile_steps: int = 3):
        self.out_path = out_path
        self.profile_from = profile_from
        self.profile_steps = profile_steps
        self.times: list[float] = []
        self.prof = None
        self.comm: Optional[dict] = None
        self.t0 = self.prof_t0 = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self.t0 = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.is_global_zero and len(self.times) == self.profile_from:
            import torch

            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()
            self.prof_t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        synchronize(pl_module.device)
        now = time.perf_counter()
        self.times.append(now - self.t0)
        self.t0 = now
        if self.prof is not None and len(self.times) == self.profile_from + self.profile_steps:
            wall = now - self.prof_t0
            self.prof.__exit__(None, None, None)
            self.comm = dict(communication_time(self.prof), wall=wall)
            self.prof = None

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            with open(self.out_path, "w") as f:
                json.dump({"times": self.times, "comm": self.comm, "world_size": trainer.world_size,
                           "tokens_per_step": pl_module.step_metrics.tokens}, f)


def communication_time(prof) -> dict:
    """Union of the communication ranges on the busiest thread (the one running the step)."""
    by_thread: dict[int, list] = {}
    for e in prof.events():
        by_thread.setdefault(e.thread, []).append(e)
    thread = max(by_thread, key=lambda t: sum(e.time_range.elapsed_us() for e in by_thread[t]))
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in by_thread[thread]
                   if is_communication(e.name))
    total, end, by_kind = 0.0, float("-inf"), {}
    for start, stop, name in spans:
        if start >= end:                      # a new outermost range
            total += stop - start
            end = stop
            kind = name.split(" (")[0].replace("autograd::engine::evaluate_function: ", "")
            by_kind[kind] = by_kind.get(kind, 0.0) + (stop - start) / 1e6
        elif stop > end:
            total += stop - end
            end = stop
    return {"comm": total / 1e6, "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))}


def dist_worker(spec: dict) -> int:
    lit_main = _import_fit()
    rank = int(os.environ["LOCAL_RANK"])
    callbacks = [{"class_path": "train_throughput.DistRecorder",
                  "init_args": {"out_path": spec["out_path"], "profile_from": spec["profile_from"],
                                "profile_steps": spec["profile_steps"]}}]
    model, optimizer = LIT_VARIANTS[spec["dist_lit"]]
    cfg = lit_config(spec, spec["rounds"], callbacks, {**spec["model_overrides"], **model},
                     {**spec["optimizer_overrides"], **optimizer}, world_size=spec["world_size"],
                     parallelism=spec["parallelism"])
    path = write_yaml(os.path.join(spec["work_dir"], f"{spec['layout']}-rank{rank}.yaml"), cfg)
    return lit_main(["fit", "--config", path])


# ------------------------------------------------------------------------------------------------
# coordinator
# ------------------------------------------------------------------------------------------------
class GemmPeak:
    """Best ``n x n @ n x n`` rate in the compute dtype seen in this run (FLOP/s)."""

    def __init__(self, device: str, n: int, dtype: str = "bfloat16"):
        import torch

        self.device = torch.device(device)
        self.dtype = dtype
        gen = torch.Generator().manual_seed(0)
        self.a = torch.randn(n, n, generator=gen).to(self.device, getattr(torch, dtype))
        self.b = torch.randn(n, n, generator=gen).to(self.device, getattr(torch, dtype))
        self.n = n
        self.samples: list[float] = []

    @property
    def best(self) -> float:
        return max(self.samples)

    def measure(self, repeats: int = 3) -> None:
        self.a @ self.b
        synchronize(self.device)
        for _ in range(repeats):
            t = time.perf_counter()
            self.a @ self.b
            synchronize(self.device)
            self.samples.append(2.0 * self.n ** 3 / (time.perf_counter() - t))


def worker_env(threads: int, extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT), env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra or {})
    return env


def spawn(args: list[str], env: dict, log_path: str, fd: Optional[int] = None) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                pass_fds=(fd,) if fd is not None else ())


def tail(path: str, n: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def write_hf_checkpoint(model_cfg: dict, out_dir: str) -> None:
    """The lit_moe model as `lit_moe fit` initialises it (by name, from the run seed) in the Hugging Face
    layout, for the transformers worker: both sides start from the same weights."""
    import torch

    from lit_moe.model import DeepseekV3ForCausalLM

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(model_cfg)
    model.to_empty(device="cpu")
    model.init_weights(SEED)
    model.save_pretrained(out_dir)


class Worker:
    def __init__(self, name: str, role: str, spec_path: str, env: dict, work: str, timeout: float):
        parent, child = socket.socketpair()
        self.name, self.timeout = name, timeout
        self.chan = Channel(parent)
        self.log = os.path.join(work, f"{name.replace(' ', '_')}.log")
        self.proc = spawn(["--_worker", role, "--_side", name, "--_spec", spec_path, "--_fd", str(child.fileno())],
                          env, self.log, child.fileno())
        child.close()

    def recv(self, event: str) -> dict:
        try:
            msg = self.chan.recv(timeout=self.timeout)
        except (EOFError, socket.timeout, OSError) as e:
            raise RuntimeError(f"{self.name} worker failed ({e!r}); last lines of {self.log}:\n{tail(self.log)}") from None
        if msg.get("event") != event:
            raise RuntimeError(f"{self.name}: expected {event!r}, got {msg}")
        return msg

    def step(self, **flags: Any) -> dict:
        self.chan.send(cmd="go", **flags)
        return self.recv("step")


def run_rounds(args, spec: dict, work: str, gemm: GemmPeak) -> dict:
    """Every side in its own process, one step each per round (order reversed every round), then one
    untimed memory step each; a side that fails is reported and dropped, the others go on."""
    spec_path = os.path.join(work, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = worker_env(args.threads)
    workers = [Worker(name, s["role"], spec_path, env, work, args.timeout) for name, s in spec["sides"].items()]
    res: dict[str, dict] = {w.name: {"times": [], "losses": [], "rss": []} for w in workers}
    failed: dict[str, str] = {}

    def guarded(w: Worker, fn):
        try:
            return fn()
        except RuntimeError as e:
            failed[w.name] = str(e)
            print(f"   !! {w.name}: {str(e).splitlines()[0]}", flush=True)
            if w.proc.poll() is None:
                w.proc.kill()
            return None

    try:
        for w in workers:
            res[w.name]["ready"] = guarded(w, lambda w=w: w.recv("ready"))
        for r in range(spec["rounds"]):
            live = [w for w in workers if w.name not in failed]
            for w in (live if r % 2 == 0 else live[::-1]):
                msg = guarded(w, w.step)
                if msg is not None:
                    res[w.name]["times"].append(msg["time"])
                    res[w.name]["losses"].append(msg.get("loss"))
                    res[w.name]["rss"].append(msg.get("rss"))
            gemm.measure()
            if args.verbose:
                print(f"   round {r}: " + "  ".join(f"{n} {v['times'][-1]:.3f}s" for n, v in res.items()
                                                     if n not in failed and v["times"]), flush=True)
        for w in workers:
            if w.name not in failed:
                msg = guarded(w, lambda w=w: w.step(memory=True))
                if msg is not None:
                    res[w.name]["tensor_peak"] = msg.get("tensor_peak")
        for w in workers:
            if w.name not in failed:
                w.chan.send(cmd="stop")
                res[w.name]["done"] = guarded(w, lambda w=w: w.recv("done"))
        for w in workers:
            if w.name not in failed:
                w.proc.wait(timeout=args.timeout)
                if w.proc.returncode != 0:
                    failed[w.name] = f"exited with {w.proc.returncode}:\n{tail(w.log)}"
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
    for name in failed:
        res[name]["error"] = failed[name]
    return res


def run_dist(args, layout: str, base_spec: dict, work: str) -> dict:
    """`lit_moe fit` on 2 local CPU processes (gloo) with the layout's parallelism; rank 0's numbers."""
    world = 2
    parallelism = {"dp2": {}, "ep2": {"expert_parallel": 2}, "tp2": {"tensor_parallel": 2}}[layout]
    steps = args.dist_steps
    spec = dict(base_spec, device="cpu", world_size=world, parallelism=parallelism, rounds=steps, layout=layout,
                dist_lit=args.dist_lit,
                out_path=os.path.join(work, f"{layout}.json"), profile_from=max(1, steps // 3),
                profile_steps=max(1, min(3, steps - max(1, steps // 3))))
    spec_path = os.path.join(work, f"{layout}-spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = max(1, args.threads // world)
    procs, logs = [], []
    for rank in range(world):
        env = worker_env(threads, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                                   "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0",
                                   "LOCAL_WORLD_SIZE": str(world), "CUDA_VISIBLE_DEVICES": ""})
        logs.append(os.path.join(work, f"{layout}-rank{rank}.log"))
        procs.append(spawn(["--_worker", "dist", "--_spec", spec_path], env, logs[-1]))
    deadline = time.time() + args.timeout * 2
    try:
        for p, log in zip(procs, logs):
            try:
                p.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"--dist {layout}: timed out; {log}:\n{tail(log)}") from None
            if p.returncode != 0:
                raise RuntimeError(f"--dist {layout}: a rank exited with {p.returncode}; {log}:\n{tail(log)}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    with open(spec["out_path"]) as f:
        res = json.load(f)
    res["threads_per_rank"] = threads
    return res


def fmt_bytes(n: Optional[float]) -> str:
    return "n/a" if n is None else f"{n / 2 ** 20:,.0f} MiB"


def report(args, spec: dict, raw: dict, gemm: GemmPeak, fpt: float, acc_peak: Optional[float]) -> dict:
    tokens = spec["batch"] * spec["seq"]
    warmup = spec["warmup"]
    cpu = spec["device"] == "cpu"
    ok = {n: r for n, r in raw.items() if "error" not in r and len(r["times"]) > warmup}
    peak = gemm.best
    print(f"   measured {gemm.dtype} GEMM peak ({gemm.n}^3): {peak / 1e9:,.1f} GFLOP/s (best of {len(gemm.samples)}; "
          f"median {statistics.median(gemm.samples) / 1e9:,.1f})"
          + (f"; datasheet bf16 peak: {acc_peak / 1e12:,.0f} TFLOP/s" if acc_peak else ""))
    header = f"\n   {'':22s}{'median step':>12s}{'best step':>11s}{'tokens/s':>11s}{'MFU':>8s}{'MFU best':>10s}"
    header += f"{'MFU sheet':>11s}" if acc_peak else ""
    header += f"{'peak tensors':>14s}" + (f"{'peak RSS +':>12s}{'end / trimmed RSS +':>22s}" if cpu else "")
    print(header + f"{'last loss':>11s}")
    sides: dict[str, dict] = {}
    for name, r in ok.items():
        ts = r["times"][warmup:]
        med, best = statistics.median(ts), min(ts)
        d = r.get("done") or {}
        base = d.get("baseline_rss")
        out = sides[name] = {
            "median_step_s": med, "best_step_s": best, "tokens_per_s": tokens / med,
            "mfu": fpt * tokens / med / peak, "mfu_best": fpt * tokens / best / peak,
            "mfu_datasheet": fpt * tokens / med / acc_peak if acc_peak else None,
            "peak_tensor_bytes": r.get("tensor_peak"), "step_times_s": r["times"], "losses": r["losses"],
            "rss_growth_after_step_bytes": r["rss"],
            "peak_rss_growth_bytes": d["peak_rss"] - base if base is not None else None,
            "end_rss_growth_bytes": d["rss_end"] - base if base is not None else None,
            "trimmed_rss_growth_bytes": d["rss_trimmed"] - base if base is not None and d.get("rss_trimmed") else None,
            "ready": r.get("ready"),
        }
        line = f"   {name:22s}{med:11.3f}s{best:10.3f}s{tokens / med:11,.0f}{out['mfu']:8.1%}{out['mfu_best']:10.1%}"
        line += f"{out['mfu_datasheet']:11.1%}" if acc_peak else ""
        line += f"{fmt_bytes(out['peak_tensor_bytes']):>14s}"
        if cpu:
            line += f"{fmt_bytes(out['peak_rss_growth_bytes']):>12s}"
            line += f"{fmt_bytes(out['end_rss_growth_bytes']) + ' / ' + fmt_bytes(out['trimmed_rss_growth_bytes']):>22s}"
        losses = [x for x in r["losses"] if x is not None]
        print(line + f"{(losses[-1] if losses else float('nan')):11.4f}")
    for name, r in raw.items():
        if "error" in r:
            print(f"   {name:22s}FAILED: {r['error'].splitlines()[0]}")

    hf = sides.get("transformers")
    if hf is not None:
        print()
        for name, s in sides.items():
            if name == "transformers":
                continue
            lt, ht = raw[name]["times"][warmup:], raw["transformers"]["times"][warmup:]
            ratios = [h / l for h, l in zip(ht, lt)]
            s["speedup"] = statistics.median(ratios)
            s["speedup_of_medians"] = hf["median_step_s"] / s["median_step_s"]
            s["memory_ratio"] = (s["peak_tensor_bytes"] / hf["peak_tensor_bytes"]
                                 if s["peak_tensor_bytes"] and hf["peak_tensor_bytes"] else None)
            s["rss_ratio"] = (s["peak_rss_growth_bytes"] / hf["peak_rss_growth_bytes"]
                              if cpu and s["peak_rss_growth_bytes"] and hf["peak_rss_growth_bytes"] else None)
            print(f"   {name} vs transformers: speed-up {s['speedup']:.2f}x (median of per-round ratios, "
                  f"min {min(ratios):.2f}, max {max(ratios):.2f}; ratio of medians {s['speedup_of_medians']:.2f}x), "
                  f"peak tensor memory x{s['memory_ratio']:.2f}"
                  + (f", peak RSS growth x{s['rss_ratio']:.2f}" if s["rss_ratio"] else ""))
        if cpu and spec["preset"] == "cpu":
            print(f"\n   targets (this CPU): speed-up >= {TARGETS['speedup']}x, MFU >= {TARGETS['mfu']:.0%} "
                  "(median step, measured GEMM peak), peak memory <= transformers (tensors and process RSS)")
            for name, s in sides.items():
                if name == "transformers":
                    continue
                checks = [("speed-up", s["speedup"] >= TARGETS["speedup"]), ("MFU", s["mfu"] >= TARGETS["mfu"]),
                          ("tensor memory", s["memory_ratio"] is not None and s["memory_ratio"] <= 1.0),
                          ("RSS", s["rss_ratio"] is not None and s["rss_ratio"] <= 1.0)]
                print(f"   {name:22s}" + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in checks))
    return sides


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="model and batch (default: cpu on a CPU, gpu on an accelerator)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | npu (default: the accelerator if any)")
    p.add_argument("--steps", type=int, default=None, help="measured rounds (default: the preset's)")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured first rounds (compilation happens there)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads of each worker")
    p.add_argument("--batch", type=int, default=None, help="micro-batch size (default: the preset's)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    p.add_argument("--lit", default=None,
                   help="lit_moe variants, comma-separated: eager (the defaults), compile (model torch_compile: "
                        "True), eager-unfused (optimizer fused: False); default: the preset's "
                        "(cpu: eager,compile; gpu: compile,eager; tiny: eager)")
    p.add_argument("--model", action="append", default=[], metavar="KEY=VALUE",
                   help="set a model-section key of every lit_moe variant (YAML value)")
    p.add_argument("--optimizer", action="append", default=[], metavar="KEY=VALUE",
                   help="set an optimizer-section key of lit_moe, e.g. fused=true")
    p.add_argument("--skip-hf", action="store_true", help="time lit_moe only")
    p.add_argument("--dist", default="", help="2-process CPU layouts to run after, comma-separated: dp2, ep2, tp2")
    p.add_argument("--dist-steps", type=int, default=6, help="steps of each --dist layout")
    p.add_argument("--dist-lit", default="eager", choices=sorted(LIT_VARIANTS), help="lit_moe variant of --dist")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for one worker message")
    p.add_argument("--json", default=None, help="write every number here too")
    p.add_argument("--keep", action="store_true", help="keep the work directory (YAMLs, worker logs)")
    p.add_argument("--work-dir", default=None, help="work directory (default: a new temporary one); implies --keep")
    p.add_argument("--verbose", action="store_true", help="print every round")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_side", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_fd", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args._worker:
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        with open(args._spec) as f:
            spec = json.load(f)
        if args._worker == "lit":
            return lit_worker(spec, args._side, args._fd)
        if args._worker == "hf":
            return hf_worker(spec, args._side, args._fd)
        return dist_worker(spec)

    import torch
    import yaml

    device = resolve_device(args.device)
    preset = args.preset or ("cpu" if device == "cpu" else "gpu")
    steps = args.steps if args.steps is not None else PRESETS[preset]["steps"]
    warmup = args.warmup if args.warmup is not None else PRESETS[preset]["warmup"]
    batch, seq = args.batch or PRESETS[preset]["batch"], args.seq or PRESETS[preset]["seq"]
    model_overrides = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.model)}
    optimizer_overrides = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.optimizer)}
    variants = [v.strip() for v in (args.lit or PRESETS[preset]["lit"]).split(",") if v.strip()]
    unknown = [v for v in variants + [x.strip() for x in args.dist.split(",") if x.strip()]
               if v not in LIT_VARIANTS and v not in ("dp2", "ep2", "tp2")]
    if unknown or not variants:
        p.error(f"unknown --lit variant / --dist layout {unknown}; --lit takes {sorted(LIT_VARIANTS)}, "
                "--dist takes dp2, ep2, tp2")
    torch.set_num_threads(args.threads)

    from lit_moe.callbacks.throughput import known_peak_flops
    from lit_moe.model import DeepseekV3Config
    from lit_moe.model.sizing import flops_per_token, param_counts

    from lit_moe.runtime.device_speed import bf16_check, matmul_rate, resolve_compute_dtype

    # the device's matmul rates, and the compute dtype both sides use (auto: the fast one here)
    rates = {name: matmul_rate(device, getattr(torch, name), 0.5, max_n=512) for name in ("bfloat16", "float32")}
    requested = model_section(preset, seq, model_overrides)["compute_dtype"]
    compute_dtype, dtype_line = resolve_compute_dtype(requested, device)
    # canonical spelling (bf16 → bfloat16): the transformers side and the GEMM peak read it
    compute_dtype = str(DeepseekV3Config(compute_dtype=compute_dtype).torch_dtype("compute_dtype")).replace("torch.", "")
    model_overrides["compute_dtype"] = compute_dtype
    config = DeepseekV3Config(**model_section(preset, seq, model_overrides))
    fpt = flops_per_token(config, seq)
    counts = param_counts(config)
    load0 = os.getloadavg()
    try:
        import transformers
        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
        if not args.skip_hf:
            p.error("transformers is not installed: install it or pass --skip-hf")

    sides: dict[str, dict] = {
        f"lit_moe {v}": {"role": "lit", "model_overrides": {**model_overrides, **LIT_VARIANTS[v][0]},
                         "optimizer_overrides": {**optimizer_overrides, **LIT_VARIANTS[v][1]}}
        for v in variants}
    if not args.skip_hf:
        sides["transformers"] = {"role": "hf"}
    print(f"== train_throughput: preset {preset} on {device}; batch {batch} x {seq} tokens; {warmup} warm-up + "
          f"{steps} measured rounds; {args.threads} threads per worker")
    print(f"   torch {torch.__version__}, transformers {hf_version}, python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")
    print(f"   model: {counts.total / 1e6:.1f}M parameters ({counts.active / 1e6:.1f}M active per token), "
          f"{fpt / 1e6:.1f} MFLOP per token (training); sides: {', '.join(sides)}")
    check = bf16_check(device)
    print(f"   matmul rates (512^3 and below, best within 0.5 s): bf16 {rates['bfloat16'] / 1e9:,.1f} GFLOP/s, fp32 "
          f"{rates['float32'] / 1e9:,.1f} GFLOP/s (bf16/fp32 {rates['bfloat16'] / rates['float32']:.3g}x); bf16 native: "
          f"{check.native} ({check.evidence()}); compute dtype {requested} → {compute_dtype} on both sides"
          + (f"\n   {dtype_line}" if dtype_line and requested != "auto" else ""))
    if set(model_overrides) - {"compute_dtype"} or optimizer_overrides:
        print(f"   lit_moe overrides: model {model_overrides}, optimizer {optimizer_overrides}")

    if args.work_dir:
        os.makedirs(args.work_dir, exist_ok=True)
        args.keep = True
    work = tempfile.mkdtemp(prefix="lit_moe_bench_", dir=args.work_dir)
    results: dict[str, Any] = {"preset": preset, "device": device, "batch": batch, "seq": seq,
                               "compute_dtype": compute_dtype, "matmul_flops": rates,
                               "threads": args.threads, "steps": steps, "warmup": warmup,
                               "flops_per_token": fpt, "torch": torch.__version__, "transformers": hf_version,
                               "model_overrides": model_overrides, "optimizer_overrides": optimizer_overrides}
    spec = None
    try:
        t_start = time.perf_counter()
        # the checkpoint for transformers lives apart from the work directory (large; never kept)
        hf_dir = tempfile.mkdtemp(prefix="lit_moe_bench_hf_")
        spec = {"preset": preset, "device": device, "batch": batch, "seq": seq, "rounds": warmup + steps,
                "compute_dtype": compute_dtype,
                "warmup": warmup, "work_dir": work, "hf_dir": hf_dir, "sides": sides,
                "model_overrides": model_overrides, "optimizer_overrides": optimizer_overrides}
        if not args.skip_hf:
            write_hf_checkpoint(model_section(preset, seq, model_overrides), spec["hf_dir"])
        gemm = GemmPeak(device, PRESETS[preset]["gemm_n"], compute_dtype)
        gemm.measure(5)
        raw = run_rounds(args, spec, work, gemm)
        gemm.measure(5)
        acc_peak = None
        if device != "cpu":
            results["device_name"] = accel_module(torch.device(device)).get_device_name()
            acc_peak = known_peak_flops(results["device_name"])
        ready = {n: r.get("ready") or {} for n, r in raw.items()}
        hf_ready = ready.get("transformers", {})
        print("")
        for n, r in ready.items():
            if n.startswith("lit_moe"):
                print(f"   {n}: {r.get('strategy')} (FSDP-wrapped: {r.get('fsdp')}), torch_compile "
                      f"{r.get('torch_compile')}, {r.get('optimizer')} {r.get('optimizer_flags')}, threads {r.get('threads')}")
        if hf_ready:
            print(f"   transformers: attention {hf_ready.get('attn_implementation')}, experts "
                  f"{hf_ready.get('experts_implementation')}, AdamW {hf_ready.get('optimizer_flags')}, "
                  f"threads {hf_ready.get('threads')}")
        results["sides"] = report(args, spec, raw, gemm, fpt, acc_peak)
        results["errors"] = {n: r["error"] for n, r in raw.items() if "error" in r}
        results["gemm_peak_flops"] = gemm.best
        results["gemm_samples"] = gemm.samples
        results["datasheet_peak_flops"] = acc_peak

        layouts = [x.strip() for x in args.dist.split(",") if x.strip()]
        if layouts:
            results["dist"] = {}
            print(f"\n   two CPU processes on gloo, lit_moe {args.dist_lit}, {max(1, args.threads // 2)} thread(s) each, "
                  f"batch {batch} x {seq} per rank, {args.dist_steps} steps:")
            print(f"   {'layout':8s}{'median step':>12s}{'tokens/s':>11s}{'comm share':>12s}  largest parts")
            for layout in layouts:
                try:
                    res = run_dist(args, layout, spec, work)
                except RuntimeError as e:
                    print(f"   {layout:8s}FAILED: {e}")
                    results["dist"][layout] = {"error": str(e)}
                    continue
                ts = res["times"][1:] or res["times"]
                med = statistics.median(ts)
                tok = res.get("tokens_per_step") or batch * seq * res["world_size"]
                comm = res.get("comm") or {}
                share = comm["comm"] / comm["wall"] if comm.get("wall") else float("nan")
                parts = ", ".join(f"{k} {v / comm['wall']:.1%}" for k, v in list(comm.get("by_kind", {}).items())[:3])
                print(f"   {layout:8s}{med:11.3f}s{tok / med:11,.0f}{share:12.1%}  {parts}")
                results["dist"][layout] = {"median_step_s": med, "tokens_per_s": tok / med, "comm_share": share,
                                           "comm": comm, "step_times_s": res["times"],
                                           "threads_per_rank": res["threads_per_rank"]}
        load1 = os.getloadavg()
        results["load_average"] = {"start": load0, "end": load1}
        print(f"\n   load average at the end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}; wall time "
              f"{time.perf_counter() - t_start:.0f}s; work directory {work if args.keep else '(removed; --keep keeps it)'}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        if spec is not None:
            shutil.rmtree(spec["hf_dir"], ignore_errors=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if results.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
