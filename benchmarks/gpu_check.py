"""The GPU check of issue 18, in two parts that ``benchmarks/gpu_check.sh`` runs one after the other.

``python benchmarks/gpu_check.py kernels [--smoke]``
    torch / CUDA / cuDNN versions; the SDPA backend ``lit_moe.ops.sdpa`` picks for MLA heads
    (d_qk 192, d_v 128) and its forward+backward TFLOP/s next to SDPA's own choice; the routed
    experts' grouped GEMMs (``GroupedExperts``) forward+backward TFLOP/s on uniform and skewed
    tokens-per-expert counts.

``python benchmarks/gpu_check.py fit [--smoke] [--out DIR]``
    the real ``lit_moe fit`` (YAML, ``LitMoE``, strategy, mock-data DataModule, built-in callbacks)
    on the ~1B-active proxy below, with :class:`GpuCheck` in the YAML ``callbacks:`` list. It
    prints tokens/s and MFU (median step after warm-up; bf16 datasheet peak), host syncs per
    non-log step (CUDA: ``torch.cuda.set_sync_debug_mode`` warnings; CPU: ``tests/sync_count.py``),
    dynamo graph breaks and graphs compiled after the second step (recompiles), and a kernel-category
    breakdown of two profiled steps (GEMM, grouped GEMM, attention, elementwise, optimizer,
    communication, idle).

``--smoke`` shrinks every size so that both parts run in about a minute on a CPU: every line of the
script runs, the numbers mean nothing. Proxy: 12 layers (first dense), hidden 2048, 16 heads of
d_qk 192 (128 + 64 rope) / d_v 128, q_lora 1536, kv_lora 512, 32 routed experts × 1408 top-6 in
8 groups (top-4 groups), 2 shared (2816), one MTP layer, vocab 32768, seq 4096, global batch 8
(32,768 tokens per optimizer step, micro-batch 2).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
import traceback
import warnings
from typing import Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

PROXY_MODEL = dict(
    vocab_size=32768, hidden_size=2048, intermediate_size=8192, num_hidden_layers=12, first_k_dense_replace=1,
    num_attention_heads=16, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=32, moe_intermediate_size=1408, num_experts_per_tok=6, n_group=8,
    topk_group=4, n_shared_experts=2, moe_shared_expert_intermediate_size=2816, num_nextn_predict_layers=1,
)
PROXY_RUN = dict(seq=4096, micro_batch=2, global_batch=8, steps=14, warmup=4, log_interval=10)
SMOKE_MODEL = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, first_k_dense_replace=1,
    num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, n_routed_experts=8, moe_intermediate_size=32, num_experts_per_tok=2, n_group=4,
    topk_group=2, n_shared_experts=1, moe_shared_expert_intermediate_size=32, num_nextn_predict_layers=1,
)
SMOKE_RUN = dict(seq=128, micro_batch=2, global_batch=4, steps=7, warmup=2, log_interval=5)

# kernel name -> category, first match wins (CUDA kernel names; CPU op names in smoke mode)
CATEGORIES = [
    ("communication", r"nccl|all_?gather|reduce_?scatter|all_?reduce|all_to_all|c10d"),
    ("optimizer", r"adam|multi_tensor|foreach|_fused_adamw"),
    ("grouped GEMM", r"grouped|GroupProblemShape|group_gemm|_grouped_mm"),
    ("attention", r"flash|fmha|sdpa|cudnn.*(attn|attention|mha)|attention|BlockCausalAttention"),
    ("GEMM", r"gemm|nvjet|sm\d+_xmma|cutlass|cublas|aten::(mm|addmm|bmm|baddbmm|matmul|linear)\b"),
]


def line(label: str, value: str) -> None:
    print(f"   {label:<44} {value}", flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, warmup: int, iters: int) -> float:
    """Median seconds of ``fn()``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------
# part 1: versions and kernels
# ------------------------------------------------------------------------------------------------
def versions(device: torch.device) -> None:
    print("== versions", flush=True)
    line("torch", torch.__version__)
    line("CUDA (build) / available", f"{torch.version.cuda} / {torch.cuda.is_available()}")
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    line("cuDNN", str(cudnn))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        line("device", f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}")
    else:
        line("device", f"cpu ({torch.get_num_threads()} threads)")


def attention_bench(device: torch.device, smoke: bool) -> None:
    from lit_moe.ops import sdpa as sdpa_mod

    B, h, S, dq, dv = (1, 2, 256, 24, 16) if smoke else (2, 16, 4096, 192, 128)
    print(f"== attention: MLA heads d_qk {dq} / d_v {dv}, {h} heads, batch {B} x seq {S}, causal, bf16, "
          "forward + backward", flush=True)
    g = torch.Generator(device=device).manual_seed(0)
    q, k = (torch.randn(B, h, S, dq, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    v = torch.randn(B, h, S, dv, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    do = torch.randn(B, h, S, dv, device=device, dtype=torch.bfloat16, generator=g)
    # causal: half the score table; forward 2 GEMMs, backward 5 (2.5x forward)
    flops = 3.5 * 2 * B * h * S * S * (dq + dv) / 2
    scale = dq ** -0.5

    def ours():
        torch.autograd.backward(sdpa_mod.sdpa(q, k, v, None, 0.0, scale), do)

    def default():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        torch.autograd.backward(out, do)

    backend, pad = sdpa_mod._backend_for(q, k, v, None, 0.0)
    line("backend chosen (cuDNN > flash > efficient)", f"{backend or 'SDPA default'}{' (v padded)' if pad else ''}")
    iters = 3 if smoke else 10
    for name, fn in (("lit_moe sdpa", ours), ("torch SDPA default choice", default)):
        try:
            t = _timed(fn, device, 1 if smoke else 3, iters)
            line(f"{name}", f"{t * 1e3:8.2f} ms   {flops / t / 1e12:9.3f} TFLOP/s")
        except RuntimeError as err:   # a backend refusing at run time: report, do not stop the check
            line(f"{name}", f"failed: {str(err).splitlines()[0][:120]}")


def grouped_gemm_bench(device: torch.device, smoke: bool) -> None:
    from lit_moe.model.config import DeepseekV3Config
    from lit_moe.model.moe import GroupedExperts

    cfg = SMOKE_MODEL if smoke else PROXY_MODEL
    E, H, I = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    rows = 256 * cfg["num_experts_per_tok"] if smoke else 8192 * cfg["num_experts_per_tok"]
    print(f"== grouped GEMM: {E} experts, hidden {H}, FFN {I}, {rows} rows, bf16, forward + backward", flush=True)
    config = DeepseekV3Config(**{**cfg, "compute_dtype": "bfloat16"})
    with torch.device(device):
        experts = GroupedExperts(config, dtype=torch.bfloat16)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.02)
    torch.nn.init.normal_(experts.down_proj, std=0.02)
    x = torch.randn(rows, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(rows, 1, device=device, dtype=torch.float32, requires_grad=True)
    dy = torch.randn(rows, H, device=device, dtype=torch.bfloat16)
    flops = 3 * 6 * rows * H * I   # forward 2*rows*H*2I + 2*rows*I*H; backward twice that
    uniform = torch.full((E,), rows // E, dtype=torch.long)
    uniform[: rows - int(uniform.sum())] += 1
    zipf = 1.0 / torch.arange(1, E + 1, dtype=torch.float64)   # expert e gets ~1/(e+1) of the load
    skewed = torch.floor(zipf / zipf.sum() * rows).long()
    skewed[0] += rows - int(skewed.sum())
    for name, counts in (("uniform", uniform), ("skewed (Zipf: top expert %d%%)" % (100 * skewed[0] // rows), skewed)):
        counts = counts.to(device)

        def step():
            torch.autograd.backward(experts(x, counts, w), dy)

        t = _timed(step, device, 1 if smoke else 3, 3 if smoke else 10)
        line(name, f"{t * 1e3:8.2f} ms   {flops / t / 1e12:9.3f} TFLOP/s")


# ------------------------------------------------------------------------------------------------
# part 2: the real fit, observed by a callback
# ------------------------------------------------------------------------------------------------
try:
    from lightning.pytorch import Callback as _Callback
except ImportError:
    _Callback = object


class GpuCheck(_Callback):
    """Times every step; counts host syncs over one non-log step; reads dynamo's counters; profiles two
    steps. Prints its table at the end of training (rank 0)."""

    def __init__(self, warmup: int, log_interval: int, tokens_per_step: int, seq: int):
        self.warmup, self.log_interval = warmup, log_interval
        self.tokens_per_step, self.seq = tokens_per_step, seq
        self.times: list[float] = []
        self.steps: list[int] = []
        self.t0 = 0.0
        self.sync_step: Optional[int] = None
        self.syncs: Optional[list[str]] = None
        self._sync_ctx = None
        self.profile_steps: tuple[int, int] = (0, 0)
        self.prof = None
        self.graphs_after_second: Optional[int] = None
        self._open_step = 0

    # steps are 1-based optimizer steps: the one starting now is trainer.global_step + 1
    def on_train_start(self, trainer, pl_module) -> None:
        trainer.callbacks.remove(self)          # last: other callbacks' batch-end work counts too
        trainer.callbacks.append(self)
        total = trainer.max_steps
        # a non-log step after warm-up (log steps are multiples of log_interval), then two profiled steps;
        # neither counts in the step time
        self.sync_step = next(s for s in range(self.warmup + 1, total + 1) if s % self.log_interval)
        self.profile_steps = (self.sync_step + 1, self.sync_step + 2)
        if self.profile_steps[1] > total:
            raise ValueError(f"GpuCheck: {total} steps leave no room for warm-up {self.warmup} + 3 observed steps")

    # Lightning calls the batch hooks per training_step call; one optimizer step may span several
    # (micro-batches): a step opens at the first batch of a new global step and closes when
    # trainer.global_step reaches it.
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step + 1
        if step == self._open_step:
            return
        self._open_step = step
        _sync(pl_module.device)
        if step == self.profile_steps[0]:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if pl_module.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
        if step == self.sync_step:
            self._sync_ctx = _SyncWatch(pl_module.device)
            self._sync_ctx.__enter__()
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step != self._open_step:   # a micro-batch inside the step
            return
        if self._sync_ctx is not None:
            self._sync_ctx.__exit__(None, None, None)
            self.syncs, self._sync_ctx = self._sync_ctx.calls, None
        _sync(pl_module.device)
        self.times.append(time.perf_counter() - self.t0)
        self.steps.append(step)
        if step == self.profile_steps[1] and self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.profile_wall = sum(self.times[-2:])
        if step == 2:
            self.graphs_after_second = _dynamo_counter("stats", "unique_graphs")

    def on_train_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        from lit_moe.callbacks.throughput import peak_flops_for
        from lit_moe.model.sizing import flops_per_token

        model = pl_module.model
        print("== lit_moe fit (real path) on the proxy", flush=True)
        from lit_moe.model.compile import compile_enabled
        line("torch_compile", f"{model.config.torch_compile} -> "
                              f"{compile_enabled(model.config.torch_compile, pl_module.device)}")
        observed = {self.sync_step, *self.profile_steps}
        measured = [t for s, t in zip(self.steps, self.times) if s > self.warmup and s not in observed]
        t = statistics.median(measured)
        tps = self.tokens_per_step / t / trainer.world_size
        peak, source = peak_flops_for(pl_module.device)
        fpt = flops_per_token(model.config, self.seq)
        line("step time (median / best, after warm-up)", f"{t:.3f} s / {min(measured):.3f} s over {len(measured)} steps")
        line("tokens/s per device", f"{tps:,.0f}")
        line("MFU", f"{100 * fpt * tps / peak:.1f}%  ({fpt / 1e9:.2f} GFLOP/token, peak {peak / 1e12:.1f} TFLOP/s, {source})")
        if self.syncs is not None:
            line(f"host syncs in non-log step {self.sync_step}", str(len(self.syncs)))
            for where in sorted(set(self.syncs))[:12]:
                line("", f"{self.syncs.count(where)}x {where}")
        breaks = _dynamo_counter("graph_break")
        graphs = _dynamo_counter("stats", "unique_graphs")
        line("dynamo graph breaks", str(breaks))
        line("graphs compiled (after step 2 / at end)", f"{self.graphs_after_second} / {graphs}")
        if self.prof is not None:
            kernel_breakdown(self.prof, pl_module.device, self.profile_wall, self.profile_steps)


def _dynamo_counter(group: str, key: Optional[str] = None) -> int:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters[group].get(key, 0)) if key else int(sum(counters[group].values()))


class _SyncWatch:
    """Host syncs inside the block. CUDA: the driver-level sync debug mode (each synchronising call
    warns; compiled graphs unaffected). CPU: tests/sync_count.py's function + dispatch modes."""

    def __init__(self, device: torch.device):
        self.device = device
        self.calls: list[str] = []

    def __enter__(self):
        if self.device.type == "cuda":
            self._warn = warnings.catch_warnings()
            self._warn.__enter__()
            warnings.simplefilter("always")
            warnings.showwarning = self._record   # restored by catch_warnings on exit
            torch.cuda.set_sync_debug_mode("warn")
        else:
            sys.path.insert(0, os.path.join(ROOT, "tests"))
            from sync_count import SyncCounter

            self._counter = SyncCounter().__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
            self._warn.__exit__(*exc)
        else:
            self._counter.__exit__(*exc)
            self.calls = [f"{call} at {os.path.relpath(where.split(' ')[0], ROOT)}"
                          for call, where in self._counter.calls]


    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        # The warning names torch's own synchronising function; the caller that matters is the
        # innermost frame outside torch and this script.
        if "synchroniz" not in str(message):
            return
        torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
        frames = [f for f in traceback.extract_stack()[:-1]
                  if not os.path.abspath(f.filename).startswith(torch_dir)
                  and os.path.abspath(f.filename) != os.path.abspath(__file__)
                  and "warnings" not in os.path.basename(f.filename)]
        where = frames[-1] if frames else None
        self.calls.append(f"{os.path.relpath(filename, ROOT)}:{lineno}" if where is None else
                          f"{os.path.relpath(where.filename, ROOT)}:{where.lineno} ({where.name}) "
                          f"-> {os.path.basename(filename)}:{lineno}")


def _category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return cat
    return "elementwise / other"


def kernel_breakdown(prof, device: torch.device, wall: float, steps: tuple[int, int]) -> None:
    """Device time per category over the profiled steps, and the device's idle share of their wall time.
    CPU (smoke): self time of the aten ops instead of kernels."""
    print(f"== kernel categories, steps {steps[0]}-{steps[1]} ({wall:.3f} s wall)", flush=True)
    per: dict[str, float] = {}
    intervals = []
    if device.type == "cuda":
        for evt in prof.events():
            if evt.device_type == torch.autograd.DeviceType.CUDA and evt.time_range.elapsed_us() > 0:
                per[_category(evt.name)] = per.get(_category(evt.name), 0.0) + evt.time_range.elapsed_us() / 1e6
                intervals.append((evt.time_range.start, evt.time_range.end))
    else:
        for evt in prof.key_averages():
            if evt.key.startswith("aten::") and evt.self_cpu_time_total > 0:
                per[_category(evt.key)] = per.get(_category(evt.key), 0.0) + evt.self_cpu_time_total / 1e6
    busy = _union_seconds(intervals) if intervals else sum(per.values())
    for cat in [c for c, _ in CATEGORIES] + ["elementwise / other"]:
        line(cat, f"{per.get(cat, 0.0) * 1e3:10.1f} ms  {100 * per.get(cat, 0.0) / wall:5.1f}% of wall")
    line("idle (wall - busy)", f"{max(0.0, wall - busy) * 1e3:10.1f} ms  {100 * max(0.0, wall - busy) / wall:5.1f}%")


def _union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals in microseconds, as seconds (streams overlap)."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e6


def fit(args) -> int:
    sys.path.insert(0, HERE)
    from train_throughput import COMMON_MODEL, write_yaml

    from lit_moe.cli import main

    run = SMOKE_RUN if args.smoke else PROXY_RUN
    model = {**COMMON_MODEL, **(SMOKE_MODEL if args.smoke else PROXY_MODEL), "seq_length": run["seq"],
             "max_position_embeddings": run["seq"]}
    if args.torch_compile is not None:
        model["torch_compile"] = args.torch_compile == "true"
    optimizer = {"type": "AdamW", "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}
    if args.fused_optimizer:
        optimizer["fused"] = True
    device_target = "gpu" if args.device == "cuda" else args.device
    tokens = run["global_batch"] * run["seq"]
    cfg = {
        "checkpoint": {"enable_save": False, "save_path": os.path.join(args.out, "ckpt")},
        "training": {"steps": run["steps"], "local_batch_size": run["micro_batch"],
                     "global_batch_size": run["global_batch"], "max_norm": 1.0, "seed": 1234},
        "optimizer": optimizer,
        "lr_scheduler": {"type": "ConstantWarmUpLR", "learning_rate": 1e-4, "warmup_steps": 0},
        "parallelism": {"data_parallel_shard": -1, "expert_parallel": 1, "tensor_parallel": 1},
        "recompute": {"mode": None},
        "monitor": {"tensorboard": {"output_dir": "", "log_interval": run["log_interval"]}},
        "context": {"device_target": device_target},
        "trainer": {"enable_progress_bar": False, "enable_model_summary": False},
        "train_dataset": {
            "dataloader": {
                "type": "BlendedMegatronDatasetDataLoader", "datasets_type": "GPTDataset",
                "sizes": [run["steps"] * run["global_batch"], 0, 0],
                "config": {"split": "1, 0, 0", "seq_length": run["seq"], "eod_mask_loss": False,
                           "reset_position_ids": False, "create_attention_mask": False,
                           "reset_attention_mask": False, "create_compressed_eod_mask": False, "eod": 1, "pad": -1,
                           "mock": True},
                "column_names": ["input_ids", "labels", "loss_mask", "position_ids"],
                "shuffle": False, "python_multiprocessing": False,
            },
            "drop_remainder": True, "num_parallel_workers": 0,
        },
        "model": model,
        "callbacks": [{"class_path": "gpu_check.GpuCheck",
                       "init_args": {"warmup": run["warmup"], "log_interval": run["log_interval"],
                                     "tokens_per_step": tokens, "seq": run["seq"]}}],
    }
    # the attention backend choice and compile fallbacks are logged at INFO: show them
    import logging

    logging.basicConfig(format="%(name)s: %(message)s")
    for name in ("lit_moe.ops.sdpa", "lit_moe.model.compile"):
        logging.getLogger(name).setLevel(logging.INFO)
    if args.device == "cpu":
        # As the sync-count test does: the CPU-only padded expert rows read the CPU tensor of counts
        # (no device sync, but the harness counts it); switched off, the count is what a device sees.
        import lit_moe.model.moe as moe_mod

        moe_mod.grouped_mm_row_align = lambda device: 1
    os.makedirs(args.out, exist_ok=True)
    path = write_yaml(os.path.join(args.out, "gpu_check_proxy.yaml"), cfg)
    print(f"== lit_moe fit --config {path}  ({run['steps']} steps of {tokens:,} tokens)", flush=True)
    return main(["fit", "--config", path])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=["kernels", "fit"])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU): check that everything runs")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/lit_moe_gpu_check"))
    p.add_argument("--torch-compile", choices=["true", "false"], default=None,
                   help="force the model's torch_compile (default: the model default, on for CUDA)")
    p.add_argument("--fused-optimizer", action="store_true",
                   help="optimizer.fused: True (torch's fused AdamW kernel) instead of the default foreach")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.part == "kernels":
        versions(device)
        attention_bench(device, args.smoke)
        grouped_gemm_bench(device, args.smoke)
        return 0
    return fit(args)


if __name__ == "__main__":
    sys.exit(main())
