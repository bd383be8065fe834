"""The MindFormers learning-rate schedules, as plain functions of the update index.

``lr_scheduler:`` names a schedule (``type``) and its peak ``learning_rate``; every other key is a
parameter of that schedule. The total number of steps is always ``training.steps`` (MindFormers injects
it the same way). Update ``k`` (0-based) uses ``lr(k)``, as the MindFormers optimizer does (it reads the
schedule at its step counter before incrementing it), so

    peak, fn = build_lr_lambda(section, total_steps)
    torch.optim.lr_scheduler.LambdaLR(optimizer, fn)   # optimizer built with lr=peak

reproduces MindFormers' values when ``scheduler.step()`` follows each ``optimizer.step()``.

Formulas (t = update index, T = total steps, W = warm-up steps, η = peak ``learning_rate``,
η₀ = ``warmup_lr_init``). Every schedule warms up the same way: while ``W > 0 and t < W``,
``lr = η₀ + (η − η₀)·t/W``. After the warm-up:

- ``ConstantWarmUpLR``: ``η``.
- ``LinearWithWarmUpLR``: ``η·max(0, (T − t)/max(1, T − W))``.
- ``CosineWithWarmUpLR`` (``lr_end`` 0, ``num_cycles`` 0.5, ``decay_steps`` T or ``decay_ratio``·T):
  ``lr_end`` once ``t ≥ decay_steps`` (checked before the warm-up); else with
  ``p = (t − W)/max(1, T − W)``: ``lr_end + (η − lr_end)·max(0, ½(1 + cos(2π·num_cycles·p)))``.
- ``CosineWithRestartsAndWarmUpLR`` (``lr_end`` 0, ``num_cycles`` 1, ``decay_steps`` T): like the cosine
  but ``½(1 + cos(π·((num_cycles·p) mod 1)))``, and 0 once ``p ≥ 1``.
- ``PolynomialWithWarmUpLR`` (``lr_end`` 1e-7, ``power`` 1, ``decay_steps`` max(1, T − W); needs
  ``η > lr_end``): ``lr_end`` once ``t > T``; else ``(η − lr_end)·(1 − (t − W)/decay_steps)^power + lr_end``.
- ``WarmUpStableDecayLR`` (``lr_end`` 1e-7, decay start D = ``decay_start_steps`` or
  ``decay_start_ratio``·T, required; needs ``η > lr_end``): ``η`` while ``t < D``, then
  ``η − (η − lr_end)·(t − D)/(T − D)``.
- ``ConstantWithCoolDownLR`` (``keep_steps`` K 0, ``decay_steps`` S (T or ``decay_ratio``·T),
  ``num_cycles`` 0.5, ``lr_end1`` 0, ``final_steps`` F 0, ``lr_end2`` = ``lr_end1``): ``η`` until W + K;
  cosine from η to ``lr_end1`` over S steps; ``lr_end1`` for F steps; then ``lr_end2``.

Warm-up length: ``warmup_ratio`` (in [0, 1]; W = int(T·ratio), it wins over ``warmup_steps`` as in
MindFormers) or ``warmup_steps`` (int ≥ 0). Differences from MindFormers, all documented in docs/optim.md:
neither given means no warm-up (MindFormers raises ``TypeError``); ``learning_rate`` must be > 0;
the polynomial base and the WSD decay fraction are clamped to [0, 1] so that a ``decay_steps`` shorter
than the run ends at ``lr_end`` instead of going below it (MindFormers: below ``lr_end``, or NaN for a
fractional power); WSD's stable phase at t = 0 with no warm-up gives η (MindFormers: 0/0 = NaN); an
explicit ``lr_end2: 0`` is honoured (MindFormers' ``lr_end2 or lr_end1`` turns it into ``lr_end1``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from lit_moe.config import ConfigError, parse_number

log = logging.getLogger(__name__)

# Keys every schedule reads, then the extra keys of each schedule type.
_COMMON_KEYS = ("type", "learning_rate", "warmup_steps", "warmup_ratio", "warmup_lr_init", "total_steps")
_TYPE_KEYS: dict[str, tuple[str, ...]] = {
    "ConstantWarmUpLR": (),
    "LinearWithWarmUpLR": (),
    "CosineWithWarmUpLR": ("lr_end", "num_cycles", "decay_steps", "decay_ratio"),
    "CosineWithRestartsAndWarmUpLR": ("lr_end", "num_cycles", "decay_steps"),
    "PolynomialWithWarmUpLR": ("lr_end", "power", "decay_steps"),
    "WarmUpStableDecayLR": ("lr_end", "decay_start_steps", "decay_start_ratio"),
    "ConstantWithCoolDownLR": ("keep_steps", "decay_steps", "decay_ratio", "num_cycles", "lr_end1",
                               "final_steps", "lr_end2"),
}
SUPPORTED_SCHEDULES = tuple(_TYPE_KEYS)

# MindFormers' default learning rate (LrSchedulerConfig.learning_rate).
DEFAULT_LEARNING_RATE = 1e-5


# ----------------------------------------------------------------------------------------------
# reading the section
# ----------------------------------------------------------------------------------------------
def _field(key: str) -> str:
    return f"lr_scheduler.{key}"


def _number(section: dict, key: str, default: Optional[float], *, minimum: Optional[float] = 0.0) -> Optional[float]:
    """A float (ints accepted, bools not). A numeric string such as ``"1e-5"`` (what PyYAML makes of
    an exponent without a dot) is read as the number it spells."""
    if key not in section or section[key] is None:
        return default
    value = parse_number(section[key], _field(key))
    if minimum is not None and value < minimum:
        raise ConfigError(f"{_field(key)}: must be >= {minimum:g}, got {section[key]!r}")
    return float(value)


def _count(section: dict, key: str, default: Optional[int]) -> Optional[int]:
    """A number of steps: an int >= 0 (bools and floats are errors, as in MindFormers)."""
    if key not in section or section[key] is None:
        return default
    value = section[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{_field(key)}: expected an integer number of steps, got {value!r}")
    if value < 0:
        raise ConfigError(f"{_field(key)}: must be >= 0, got {value!r}")
    return value


def _ratio_steps(section: dict, steps_key: str, ratio_key: str, total_steps: int,
                 default: Optional[int]) -> Optional[int]:
    """``ratio_key`` (in [0, 1], steps = int(T·ratio)) wins over ``steps_key``, as in MindFormers."""
    ratio = _number(section, ratio_key, None, minimum=None)
    if ratio is None:
        return _count(section, steps_key, default)
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"{_field(ratio_key)}: must be in [0, 1], got {section[ratio_key]!r}")
    if section.get(steps_key) is not None:
        log.warning("%s and %s are both set; %s=%s wins (as in MindFormers)", _field(ratio_key),
                    _field(steps_key), _field(ratio_key), section[ratio_key])
    return int(total_steps * ratio)


@dataclass(frozen=True)
class Schedule:
    """A resolved schedule: every length in steps, every rate absolute."""

    type: str
    learning_rate: float
    total_steps: int
    warmup_steps: int
    warmup_lr_init: float
    lr_end: float = 0.0
    num_cycles: float = 0.5
    decay_steps: int = 1
    power: float = 1.0
    decay_start_steps: int = 0
    keep_steps: int = 0
    final_steps: int = 0
    lr_end1: float = 0.0
    lr_end2: float = 0.0

    def __call__(self, step: int) -> float:
        """The learning rate of update ``step`` (0-based)."""
        return _FORMULAS[self.type](self, float(step))


def resolve_schedule(lr_section: dict, total_steps: int) -> Schedule:
    """Validate ``lr_scheduler:`` and resolve every length and rate. ``total_steps`` = ``training.steps``."""
    section = dict(lr_section or {})
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps <= 0:
        raise ConfigError(f"training.steps: must be a positive integer (the schedule's total steps), got {total_steps!r}")
    kind = section.get("type")
    if kind is None:
        raise ConfigError(f"lr_scheduler.type: missing; supported: {', '.join(SUPPORTED_SCHEDULES)}")
    if not isinstance(kind, str) or kind not in _TYPE_KEYS:
        raise ConfigError(f"lr_scheduler.type: unknown schedule {kind!r}; supported: {', '.join(SUPPORTED_SCHEDULES)}")
    _warn_unused_keys(section, kind, total_steps)

    peak = _number(section, "learning_rate", DEFAULT_LEARNING_RATE, minimum=None)
    if not peak > 0:
        raise ConfigError(f"{_field('learning_rate')}: must be > 0, got {section['learning_rate']!r}")
    T = total_steps
    common = dict(type=kind, learning_rate=peak, total_steps=T,
                  warmup_steps=_ratio_steps(section, "warmup_steps", "warmup_ratio", T, 0),
                  warmup_lr_init=_number(section, "warmup_lr_init", 0.0))
    W = common["warmup_steps"]

    if kind in ("ConstantWarmUpLR", "LinearWithWarmUpLR"):
        return Schedule(**common)
    if kind == "CosineWithWarmUpLR":
        decay = _ratio_steps(section, "decay_steps", "decay_ratio", T, None)
        return Schedule(**common, lr_end=_number(section, "lr_end", 0.0),
                        num_cycles=_number(section, "num_cycles", 0.5),
                        # MindFormers: max(1, decay_steps) for an explicit count; the ratio is taken as is.
                        decay_steps=(max(1, T) if decay is None else
                                     decay if section.get("decay_ratio") is not None else max(1, decay)))
    if kind == "CosineWithRestartsAndWarmUpLR":
        decay = _count(section, "decay_steps", None)
        return Schedule(**common, lr_end=_number(section, "lr_end", 0.0),
                        num_cycles=_number(section, "num_cycles", 1.0),
                        decay_steps=max(1, T if decay is None else decay))
    if kind == "PolynomialWithWarmUpLR":
        lr_end = _number(section, "lr_end", 1e-7)
        _check_end_below_peak(section, lr_end, peak, "lr_end")
        decay = _count(section, "decay_steps", None)
        return Schedule(**common, lr_end=lr_end, power=_number(section, "power", 1.0),
                        decay_steps=max(1, T - W if decay is None else decay))
    if kind == "WarmUpStableDecayLR":
        lr_end = _number(section, "lr_end", 1e-7)
        _check_end_below_peak(section, lr_end, peak, "lr_end")
        start = _ratio_steps(section, "decay_start_steps", "decay_start_ratio", T, None)
        if start is None:
            raise ConfigError("lr_scheduler.decay_start_steps: WarmUpStableDecayLR needs decay_start_steps "
                              "or decay_start_ratio (the step where the linear decay begins)")
        return Schedule(**common, lr_end=lr_end, decay_start_steps=start)
    # ConstantWithCoolDownLR
    decay = _ratio_steps(section, "decay_steps", "decay_ratio", T, None)
    lr_end1 = _number(section, "lr_end1", 0.0)
    lr_end2 = _number(section, "lr_end2", None)
    return Schedule(**common, keep_steps=_count(section, "keep_steps", 0),
                    decay_steps=(max(1, T) if decay is None else
                                 decay if section.get("decay_ratio") is not None else max(1, decay)),
                    num_cycles=_number(section, "num_cycles", 0.5),
                    lr_end1=lr_end1, final_steps=_count(section, "final_steps", 0),
                    lr_end2=lr_end1 if lr_end2 is None else lr_end2)


def _check_end_below_peak(section: dict, lr_end: float, peak: float, key: str) -> None:
    if not peak > lr_end:
        raise ConfigError(f"{_field(key)}: must be smaller than lr_scheduler.learning_rate ({peak:g}), "
                          f"got {section.get(key, lr_end)!r}")


def _warn_unused_keys(section: dict, kind: str, total_steps: int) -> None:
    """The section accepts extra keys (MindFormers passes them as ``**kwargs`` and ignores them);
    we say which ones this schedule ignores instead of dropping them silently."""
    used = set(_COMMON_KEYS) | set(_TYPE_KEYS[kind])
    unused = sorted(k for k in section if k not in used)
    if unused:
        log.warning("lr_scheduler: %s ignores %s", kind, ", ".join(unused))
    given = section.get("total_steps")
    if given is not None and given != total_steps:
        log.warning("lr_scheduler.total_steps=%r is replaced by training.steps=%d", given, total_steps)


# ----------------------------------------------------------------------------------------------
# the formulas (s = resolved schedule, t = update index as float)
# ----------------------------------------------------------------------------------------------
def _in_warmup(s: Schedule, t: float) -> bool:
    return s.warmup_steps != 0 and t < s.warmup_steps


def _warmup(s: Schedule, t: float) -> float:
    return s.warmup_lr_init + (s.learning_rate - s.warmup_lr_init) * t / s.warmup_steps


def _constant(s: Schedule, t: float) -> float:
    return _warmup(s, t) if _in_warmup(s, t) else s.learning_rate


def _linear(s: Schedule, t: float) -> float:
    if _in_warmup(s, t):
        return _warmup(s, t)
    linear_steps = max(1, s.total_steps - s.warmup_steps)
    return s.learning_rate * max(0.0, (s.total_steps - t) / linear_steps)


def _cosine(s: Schedule, t: float) -> float:
    if t >= s.decay_steps:
        return s.lr_end
    if _in_warmup(s, t):
        return _warmup(s, t)
    progress = (t - s.warmup_steps) / max(1, s.total_steps - s.warmup_steps)
    percent = max(0.0, 0.5 * (1.0 + math.cos(math.pi * s.num_cycles * 2.0 * progress)))
    return s.lr_end + (s.learning_rate - s.lr_end) * percent


def _cosine_restarts(s: Schedule, t: float) -> float:
    if t >= s.decay_steps:
        return s.lr_end
    if _in_warmup(s, t):
        return _warmup(s, t)
    progress = (t - s.warmup_steps) / max(1, s.total_steps - s.warmup_steps)
    if progress >= 1.0:
        return 0.0
    percent = max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((s.num_cycles * progress) % 1.0))))
    return s.lr_end + (s.learning_rate - s.lr_end) * percent


def _polynomial(s: Schedule, t: float) -> float:
    if _in_warmup(s, t):
        return _warmup(s, t)
    if t > s.total_steps:
        return s.lr_end
    remaining = min(1.0, max(0.0, 1.0 - (t - s.warmup_steps) / s.decay_steps))
    return (s.learning_rate - s.lr_end) * remaining ** s.power + s.lr_end


def _warmup_stable_decay(s: Schedule, t: float) -> float:
    if _in_warmup(s, t):
        return _warmup(s, t)
    if t < s.decay_start_steps:
        return s.learning_rate
    decay_steps = s.total_steps - s.decay_start_steps
    done = 1.0 if decay_steps <= 0 else min(1.0, (t - s.decay_start_steps) / decay_steps)
    return s.learning_rate - (s.learning_rate - s.lr_end) * done


def _constant_with_cooldown(s: Schedule, t: float) -> float:
    W, K, S, F = s.warmup_steps, s.keep_steps, s.decay_steps, s.final_steps
    if _in_warmup(s, t):
        return _warmup(s, t)
    if t < W + K:
        return s.learning_rate
    if t < W + K + S:
        progress = (t - K - W) / S
        percent = max(0.0, 0.5 * (1.0 + math.cos(math.pi * s.num_cycles * 2.0 * progress)))
        return s.lr_end1 + (s.learning_rate - s.lr_end1) * percent
    if t < W + K + S + F:
        return s.lr_end1
    return s.lr_end2


_FORMULAS: dict[str, Callable[[Schedule, float], float]] = {
    "ConstantWarmUpLR": _constant,
    "LinearWithWarmUpLR": _linear,
    "CosineWithWarmUpLR": _cosine,
    "CosineWithRestartsAndWarmUpLR": _cosine_restarts,
    "PolynomialWithWarmUpLR": _polynomial,
    "WarmUpStableDecayLR": _warmup_stable_decay,
    "ConstantWithCoolDownLR": _constant_with_cooldown,
}


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------
def build_lr_lambda(lr_section: dict, total_steps: int) -> tuple[float, Callable[[int], float]]:
    """``(peak_lr, fn)`` with ``fn(k) = lr(k) / peak_lr`` for ``torch.optim.lr_scheduler.LambdaLR``.
    Raises :class:`ConfigError` (naming ``lr_scheduler.<key>`` and the value) for a bad section."""
    schedule = resolve_schedule(lr_section, total_steps)
    peak = schedule.learning_rate

    def lr_multiplier(step: int) -> float:
        return schedule(step) / peak

    return peak, lr_multiplier


def learning_rate_at(lr_section: dict, total_steps: int, step: int) -> float:
    """The learning rate MindFormers uses for update ``step`` (0-based)."""
    return resolve_schedule(lr_section, total_steps)(step)


def describe(lr_section: dict[str, Any], total_steps: int) -> str:
    """One line for logs: the resolved schedule."""
    s = resolve_schedule(lr_section, total_steps)
    return (f"{s.type}: peak {s.learning_rate:g}, warm-up {s.warmup_steps} of {s.total_steps} steps "
            f"from {s.warmup_lr_init:g}")


# ----------------------------------------------------------------------------------------------
# global batch ramp-up (training.rampup_batch_size)
# ----------------------------------------------------------------------------------------------
RAMPUP_KEY = "training.rampup_batch_size"


@dataclass(frozen=True)
class BatchRamp:
    """MindFormers' dynamic global batch (``training.rampup_batch_size: [start, increment, rampup_samples]``),
    the rule of Megatron-LM's ``RampupBatchsizeNumMicroBatchesCalculator``.

    Before each optimizer step the global batch is read from the samples consumed by the steps before it:
    ``start + increment·floor(consumed / (rampup_samples / n))`` with ``n = (global_batch_size − start) /
    increment`` increments, and ``global_batch_size`` once ``consumed > rampup_samples`` (or when there is
    nothing to ramp: ``n = 0`` or ``rampup_samples = 0``). The micro-batch (``local_batch_size``) and the
    data-parallel size stay fixed; the accumulation steps grow with the batch,
    ``A = global batch / (data_parallel · local_batch_size)``. The learning-rate schedule keeps counting
    optimizer steps (MindFormers builds it over ``training.steps`` and steps it once per update; Megatron
    counts samples instead)."""

    start: int
    increment: int
    rampup_samples: int
    global_batch_size: int
    samples_per_micro_batch: int   # data_parallel * local_batch_size

    @property
    def increments(self) -> int:
        if self.start >= self.global_batch_size:
            return 0
        return (self.global_batch_size - self.start) // self.increment

    @property
    def samples_per_increment(self) -> float:
        """Consumed samples between two increments (a float, as in MindFormers; 0: no ramp)."""
        n = self.increments
        return self.rampup_samples / n if n > 0 and self.rampup_samples > 0 else 0.0

    def global_batch_at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after ``consumed_samples`` samples."""
        per = self.samples_per_increment
        if consumed_samples > self.rampup_samples or per <= 0:
            return self.global_batch_size
        return min(self.start + self.increment * int(consumed_samples / per), self.global_batch_size)

    def accumulation_at(self, consumed_samples: int) -> int:
        """Micro-batches per rank of the step that starts after ``consumed_samples`` samples."""
        return self.global_batch_at(consumed_samples) // self.samples_per_micro_batch

    def levels(self) -> list[int]:
        """Every global batch the ramp can take, ascending (the last is ``global_batch_size``)."""
        return list(range(self.start, self.global_batch_size, self.increment)) + [self.global_batch_size]

    def stretches(self, total_steps: int) -> list[tuple[int, int, int]]:
        """``(first step, global batch, samples consumed before that step)`` of each run of steps with
        one global batch, over ``total_steps`` optimizer steps (steps 0-based)."""
        out: list[tuple[int, int, int]] = []
        step, consumed = 0, 0
        while step < total_steps:
            gbs = self.global_batch_at(consumed)
            out.append((step, gbs, consumed))
            if gbs == self.global_batch_size:   # the batch never decreases: the rest is one stretch
                break
            n = self._steps_at_level(consumed, gbs)
            step, consumed = step + n, consumed + n * gbs
        return out

    def _steps_at_level(self, consumed: int, gbs: int) -> int:
        """Steps of ``gbs`` samples from ``consumed`` until the batch changes: estimated from the next
        level's boundary, then corrected against :meth:`global_batch_at` (the float division decides)."""
        per = self.samples_per_increment
        boundary = (int(consumed / per) + 1) * per
        n = max(1, math.ceil((boundary - consumed) / gbs))
        while n > 1 and self.global_batch_at(consumed + (n - 1) * gbs) != gbs:
            n -= 1
        while self.global_batch_at(consumed + n * gbs) == gbs:
            n += 1
        return n

    def samples_after(self, steps: int) -> int:
        """Samples consumed by the first ``steps`` optimizer steps (the inverse of the step rule:
        ``consumed(s + 1) = consumed(s) + global_batch_at(consumed(s))``)."""
        if steps <= 0:
            return 0
        first, gbs, before = self.stretches(steps)[-1]
        return before + (steps - first) * gbs

    def describe(self) -> str:
        """One line for the console and ``lit_moe plan``."""
        b = self.samples_per_micro_batch
        if self.samples_per_increment <= 0:
            return f"global batch ramp-up: none (global_batch_size {self.global_batch_size} from the first step)"
        return (f"global batch ramp-up {self.start} → {self.global_batch_size} by {self.increment} every "
                f"{self.samples_per_increment:g} samples (the first {self.rampup_samples:,}); accumulation "
                f"{self.start // b} → {self.global_batch_size // b}")


def batch_ramp(training: Any, data_parallel: int) -> Optional[BatchRamp]:
    """The run's :class:`BatchRamp` from ``training.rampup_batch_size`` (None: null), after MindFormers'
    checks: three integers, ``start > 0``, ``increment > 0``, ``rampup_samples >= 0``,
    ``start <= global_batch_size``, ``global_batch_size − start`` a multiple of ``increment``, and every
    level a multiple of ``data_parallel · local_batch_size``."""
    value = training.rampup_batch_size
    if value is None:
        return None
    name = RAMPUP_KEY
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ConfigError(f"{name}: must be a list of 3 integers [start, increment, rampup_samples], got {value!r}")
    for i, (v, lo) in enumerate(zip(value, (1, 1, 0))):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{name}[{i}]: must be an integer, got {v!r}")
        if v < lo:
            raise ConfigError(f"{name}[{i}]: must be {'> 0' if lo else '>= 0'}, got {v}")
    start, inc, samples = value
    base = data_parallel * training.local_batch_size
    top = training.global_batch_size
    if start > top:
        raise ConfigError(f"{name}[0]: start {start} exceeds training.global_batch_size {top} (the final size)")
    if (top - start) % inc:
        raise ConfigError(f"{name}[1]: global_batch_size {top} - start {start} is not a multiple of increment {inc}")
    ramp = BatchRamp(start, inc, samples, top, base)
    for level in ramp.levels():
        if level % base:
            raise ConfigError(f"{name}: batch size {level} is not divisible by data_parallel({data_parallel}) * "
                              f"local_batch_size({training.local_batch_size}) = {base}")
    return ramp
