"""How fast this device multiplies matrices, measured in a bounded time: the run's compute dtype
(``model.compute_dtype: auto``) and the MFU peak of CPUs and unknown accelerators.

Whether bf16 is the fast dtype depends on the CPU: with AMX or AVX512-BF16 (Intel Cooper Lake,
Sapphire Rapids and later, AMD Zen 4 and later) oneDNN multiplies bf16 faster than fp32;
without them (AVX2-only CPUs: AMD Zen 2/3, older Intel, many laptops) torch emulates bf16 and its
matmuls run many times *slower* than fp32 (measured ratios in benchmarks/README.md). :func:`bf16_check` times one small matmul in each dtype
(a few milliseconds) and cross-checks torch's capability query; accelerators answer from the
query (``torch.cuda.is_bf16_supported``; Ascend NPUs have native bf16).

Every measurement here has a fixed time budget: the first matmul is small (``START_N``) and the
size only grows while the next one fits the time left, so a device 1000x slower than expected
costs the same wall time as a fast one.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch

START_N = 256            # first matmul size of every probe: 33.6 MFLOP, ~0.1 s at 0.3 GFLOP/s
PEAK_BUDGET_S = 1.0      # time the MFU peak probe may take
DTYPE_BUDGET_S = 0.05    # time the bf16 check may take (after three matmuls of each dtype)
NATIVE_RATIO = 0.5       # bf16 counts as native when it runs at >= half the fp32 rate
                         # (the measured ratios are far on either side: benchmarks/README.md)


def _synchronize(device: torch.device) -> None:
    if device.type == "cpu":
        return
    module = getattr(torch, device.type, None)
    if module is not None and hasattr(module, "synchronize"):
        module.synchronize(device)
    else:
        torch.accelerator.synchronize(device)


def _timed_matmul(a: torch.Tensor, b: torch.Tensor) -> float:
    """Seconds of one ``a @ b`` (synchronised)."""
    start = time.perf_counter()
    a @ b
    _synchronize(a.device)
    return time.perf_counter() - start


def matmul_rate(device: torch.device | str, dtype: torch.dtype, budget_s: float,
                max_n: Optional[int] = None, repeats: int = 5) -> float:
    """Best FLOP/s of square matmuls in ``dtype`` on ``device`` within about ``budget_s`` seconds.

    Starts at ``START_N`` (a warm-up matmul, then timed ones) and doubles the size while the next
    size's warm-up and first timed matmul (16x the last one's time) fit the time left, up to
    ``max_n`` (default 2048 on a CPU, 8192 on an accelerator); stops after ``repeats`` timed matmuls
    at the largest size or when the budget is spent. On a device whose speed holds steady the only
    overrun is the first two ``START_N`` matmuls on a device too slow for even those (on a loaded
    machine, the last matmul taking longer than the one before: a few percent, benchmarks/README.md)."""
    device = torch.device(device)
    max_n = max_n or (2048 if device.type == "cpu" else 8192)
    deadline = time.perf_counter() + budget_s
    gen = torch.Generator(device="cpu").manual_seed(0)
    n, best, timed = START_N, 0.0, 0
    a, b = (torch.randn(n, n, generator=gen, device="cpu").to(device=device, dtype=dtype) for _ in range(2))
    _timed_matmul(a, b)   # warm-up: kernel selection, thread-pool start
    while True:
        seconds = _timed_matmul(a, b)
        best, timed = max(best, 2.0 * n ** 3 / max(seconds, 1e-9)), timed + 1
        left = deadline - time.perf_counter()
        if left <= seconds or (n >= max_n and timed >= repeats):
            return best
        if n < max_n and 16 * seconds < left:
            n, timed = n * 2, 0
            a, b = (torch.randn(n, n, generator=gen, device="cpu").to(device=device, dtype=dtype) for _ in range(2))
            _timed_matmul(a, b)


_PEAKS: dict[tuple[str, str], float] = {}


def measure_matmul_peak(device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                        budget_s: float = PEAK_BUDGET_S) -> float:
    """The device's matmul FLOP/s in ``dtype`` (:func:`matmul_rate` within ``budget_s``), measured
    once per (device, dtype) and cached for the process."""
    device = torch.device(device)
    key = (str(device), str(dtype))
    if key not in _PEAKS:
        _PEAKS[key] = matmul_rate(device, dtype, budget_s)
    return _PEAKS[key]


@dataclass(frozen=True)
class Bf16Check:
    """Whether bf16 is native on a device, with the evidence."""
    native: bool
    bf16_flops: Optional[float]     # measured (CPU); None where only the query was asked
    fp32_flops: Optional[float]
    query: Optional[bool]           # torch's capability query; None where torch has none
    device: str

    @property
    def ratio(self) -> Optional[float]:
        """bf16 rate / fp32 rate."""
        if self.bf16_flops is None or not self.fp32_flops:
            return None
        return self.bf16_flops / self.fp32_flops

    def evidence(self) -> str:
        parts = []
        if self.ratio is not None:
            parts.append(f"bf16 matmul {self.bf16_flops / 1e9:.1f} GFLOP/s = {self.ratio:.3g}x the fp32 rate "
                         f"{self.fp32_flops / 1e9:.1f} GFLOP/s")
        if self.query is not None:
            parts.append(f"torch reports bf16 {'supported' if self.query else 'not supported'} natively")
        return "; ".join(parts) or "no measurement"


def bf16_capability(kind: str) -> Optional[bool]:
    """torch's own answer to "is bf16 native on this kind of device?", or None where it has none."""
    if kind == "cpu":
        query = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        if query is None or not torch.backends.mkldnn.is_available():
            return None
        return bool(query())
    if kind == "cuda":
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    return None


_CHECKS: dict[str, Bf16Check] = {}


def _interleaved_rates(device: torch.device, budget_s: float, samples: int = 3) -> tuple[float, float]:
    """(bf16, fp32) best FLOP/s of ``START_N`` matmuls on one thread, taken in turns so that other
    work on the machine slows both alike: at least ``samples`` of each, then more until
    ``budget_s`` is spent."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    # device="cpu" explicitly: the probe may first run inside a meta-device context (a model built there)
    pairs = {dtype: [torch.randn(START_N, START_N, generator=gen, device="cpu").to(device=device, dtype=dtype)
                     for _ in range(2)]
             for dtype in (torch.bfloat16, torch.float32)}
    best = {dtype: 0.0 for dtype in pairs}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # one core: other work on the machine does not stall a thread barrier
    try:
        for dtype, (a, b) in pairs.items():
            _timed_matmul(a, b)   # warm-up
        deadline = time.perf_counter() + budget_s
        taken = 0
        while taken < samples or time.perf_counter() < deadline:
            for dtype, (a, b) in pairs.items():
                best[dtype] = max(best[dtype], 2.0 * START_N ** 3 / max(_timed_matmul(a, b), 1e-9))
            taken += 1
    finally:
        torch.set_num_threads(threads)
    return best[torch.bfloat16], best[torch.float32]


def bf16_check(device: torch.device | str) -> Bf16Check:
    """Is bf16 native on ``device``? Once per process and device type.

    On a CPU: small matmuls in bf16 and fp32 in turns (:func:`_interleaved_rates`, within
    :data:`DTYPE_BUDGET_S`); native when bf16 runs at >= :data:`NATIVE_RATIO` of the fp32 rate.
    The measurement decides (it is what the run will see); when torch's capability query disagrees
    the measurement is repeated for ten times as long (a loaded machine) before it decides.
    Accelerators: the query, and native where torch has none (Ascend, XPU)."""
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if kind not in _CHECKS:   # a kind name, not torch.device: "npu" needs torch_npu imported for that
        query = bf16_capability(kind)
        if kind == "cpu":
            bf16, fp32 = _interleaved_rates(torch.device("cpu"), DTYPE_BUDGET_S)
            if query is not None and (bf16 >= NATIVE_RATIO * fp32) != query:
                bf16, fp32 = _interleaved_rates(torch.device("cpu"), 10 * DTYPE_BUDGET_S)
            _CHECKS[kind] = Bf16Check(bf16 >= NATIVE_RATIO * fp32, bf16, fp32, query, kind)
        else:
            _CHECKS[kind] = Bf16Check(query is not False, None, None, query, kind)
    return _CHECKS[kind]


def resolve_compute_dtype(requested: str, device: torch.device | str) -> tuple[str, Optional[str]]:
    """(the compute dtype the run uses, the line to print or None) for ``model.compute_dtype``.

    ``auto`` becomes ``bfloat16`` where bf16 is native and ``float32`` elsewhere, named in the line.
    An explicit ``bfloat16`` is kept (MindFormers' meaning); where it is slow the line says how slow
    and which key to change. Other values are kept silently."""
    value = str(requested).replace("torch.", "").lower()
    if value not in ("auto", "bfloat16", "bf16"):
        return requested, None
    check = bf16_check(device)
    if value == "auto":
        chosen = "bfloat16" if check.native else "float32"
        return chosen, f"model.compute_dtype auto → {chosen} on {check.device} ({check.evidence()})"
    if check.native:
        return requested, None
    return requested, (f"model.compute_dtype {requested}: bf16 is not native on this {check.device} "
                       f"({check.evidence()}); set model.compute_dtype: auto (or float32) for the fast dtype")


def available_accelerator() -> str:
    """What Lightning's ``accelerator: auto`` picks: an available accelerator, else the CPU."""
    return next((name for name in ("cuda", "npu")
                 if getattr(getattr(torch, name, None), "is_available", lambda: False)()), "cpu")


def resolve_model_section(model_section: dict, accelerator: str) -> tuple[dict, Optional[str]]:
    """(``model_section`` with ``compute_dtype`` resolved for ``accelerator`` (``cpu``, ``cuda``,
    ``npu``, ...), the decision's line or None). The caller prints the line (:func:`print_note`)
    once the whole config is valid, so that a bad config still gets one error line only."""
    requested = model_section.get("compute_dtype")
    if requested is None:
        return model_section, None
    chosen, line = resolve_compute_dtype(requested, accelerator)
    return {**model_section, "compute_dtype": chosen}, line


def print_note(line: Optional[str]) -> None:
    """``lit_moe: <line>`` on stderr, from the first rank only."""
    if line and int(os.environ.get("RANK", "0") or 0) == 0:
        print(f"lit_moe: {line}", file=sys.stderr, flush=True)
