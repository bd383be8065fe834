"""Optimizer construction from the ``optimizer:`` section: AdamW, or Muon with AdamW for the rest.

Parameters arrive as ``(name, parameter)`` pairs of fp32 master weights: the strategy keeps parameters
in fp32 and casts them to ``compute_dtype`` for the forward (FSDP2 ``MixedPrecisionPolicy``), so the
optimizer always steps fp32 values and no separate master copy is needed here. A low-precision
parameter is therefore an error (``model.params_dtype`` must stay float32).

Weight decay follows MindFormers' ``get_param_groups``: a parameter matched by ``weight_decay_include``
is decayed; otherwise one matched by ``weight_decay_exclude`` is not; otherwise 1-D parameters (norm
weights) and names ending in ``.bias`` are not decayed and everything else is (embedding, head, router
and expert weights included). A rule matches a name when it equals it, is a substring of it, or is an
``fnmatch`` wildcard matching it, in any spelling of the name (lit_moe's, MindFormers' or Hugging
Face's: ``lit_moe.model.names.spellings``); a rule that matches no parameter of the model is an error
(:func:`check_rules`).

Parameter groups are split by (algorithm, decay, plain tensor vs DTensor): torch's foreach and fused
kernels reject a list mixing plain tensors and DTensors, while DTensors on different meshes are fine in
one group (version note in benchmarks/README.md). So the default ``foreach=None`` (torch picks foreach on CUDA/NPU, a loop on CPU)
is always safe; ``fused: True`` asks for the fused kernel.

``type: Muon`` returns a :class:`MuonWithAdamW`, one ``torch.optim.Optimizer`` holding a
:class:`ScheduledMuon` (2-D hidden matrices) and a ``torch.optim.AdamW`` (everything else) that share its
``param_groups`` and ``state``; LR schedulers, Lightning, ``state_dict``/``load_state_dict`` and
``torch.distributed.checkpoint`` see one ordinary optimizer. Its keys mean what they mean in
MindFormers' PyNative Muon (``mindformers/pynative/optimizer/muon.py``): ``ns_coefficients`` is one
``[a, b, c]`` for all ``ns_steps`` steps or a per-step schedule ``[[[a, b, c], count], ...]`` (then
``ns_steps`` is the sum of the counts); the update is scaled by ``lr * matched_adamw_rms *
sqrt(max(rows, cols))``; ``qk_clip_enabled`` (default true, as there) rescales the query/key projections
after each step (:mod:`lit_moe.optim.qk_clip`); ``comm_strategy`` only chooses MindFormers' communication.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Any, Iterable, Optional

import torch
from torch import nn

from lit_moe.config import ConfigError, parse_number
from lit_moe.model.names import canonical_name, no_match_error, spellings

log = logging.getLogger(__name__)

SUPPORTED_OPTIMIZERS = ("AdamW", "Muon")

# Keys read by every optimizer type, by each type, and keys consumed elsewhere or without effect here.
_COMMON_KEYS = ("type", "weight_decay", "weight_decay_include", "weight_decay_exclude", "foreach", "fused",
                "use_fused", "enable_fused_opt", "enable_cpu_offload")
_TYPE_KEYS = {
    "AdamW": ("betas", "eps", "amsgrad", "maximize", "exp_avg_dtype", "exp_avg_sq_dtype"),
    "Muon": ("momentum", "nesterov", "ns_steps", "ns_coefficients", "eps", "adjust_lr_fn", "matched_adamw_rms",
             "adamw_betas", "adamw_eps", "adamw_include", "qk_clip_enabled", "qk_clip_threshold",
             "comm_strategy"),
}
# accumulate_allreduce_grads_in_fp32: read by the strategy (fp32 gradient reduction). The rest are
# MindFormers/Ascend implementation switches with no meaning for torch's optimizers.
_CONSUMED_ELSEWHERE = ("accumulate_allreduce_grads_in_fp32", "use_fused_adamw", "swap")
# MindFormers' Muon comm_strategy values: who runs Newton-Schulz on a sharded 2-D weight (every rank after
# an all-gather, or one assigned rank per weight); the numbers are the same either way.
_COMM_STRATEGIES = ("allgather", "allgather_deredundency")

# MindFormers defaults (OptimizerConfig for AdamW; pynative Muon for Muon).
_DEFAULT_WEIGHT_DECAY = 0.01
_DEFAULT_BETAS = (0.9, 0.95)
_DEFAULT_EPS = 1e-8
# MindFormers' own default (pynative/optimizer/muon.py ``_build_muon_filter``): its names for the
# embedding and the output head, which match ``embed_tokens`` / ``lm_head`` through their spellings.
_DEFAULT_ADAMW_INCLUDE = ("*word_embeddings*", "*output_layer*")
# Megatron-Core's precision-aware optimizer names (MindFormers' PyNative AdamW keeps its moments in the
# parameters' dtype and has no such key): the storage dtype of AdamW's first and second moments.
MOMENT_DTYPES = {"float32": "float32", "fp32": "float32", "torch.float32": "float32",
                 "bfloat16": "bfloat16", "bf16": "bfloat16", "torch.bfloat16": "bfloat16"}


@dataclass
class OptimizerSettings:
    """The validated ``optimizer:`` section."""

    type: str = "AdamW"
    weight_decay: float = _DEFAULT_WEIGHT_DECAY
    weight_decay_include: list[str] = field(default_factory=list)
    weight_decay_exclude: list[str] = field(default_factory=list)
    foreach: Optional[bool] = None
    fused: Optional[bool] = None
    # AdamW (and the AdamW half of Muon, through adamw_betas / adamw_eps)
    betas: tuple[float, float] = _DEFAULT_BETAS
    eps: float = _DEFAULT_EPS
    amsgrad: bool = False
    maximize: bool = False
    exp_avg_dtype: str = "float32"        # a torch dtype name (the settings are recorded as JSON)
    exp_avg_sq_dtype: str = "float32"
    # Muon
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    # one (a, b, c) per Newton-Schulz step (MindFormers' per-step schedule, expanded)
    ns_coefficients: tuple[tuple[float, float, float], ...] = ((3.4445, -4.7750, 2.0315),) * 5
    adjust_lr_fn: str = "match_rms_adamw"
    matched_adamw_rms: float = 0.2
    qk_clip_enabled: bool = False
    qk_clip_threshold: float = 100.0
    comm_strategy: str = "allgather"
    adamw_eps: float = _DEFAULT_EPS
    adamw_include: tuple[str, ...] = _DEFAULT_ADAMW_INCLUDE


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------
def _field(key: str) -> str:
    return f"optimizer.{key}"


def _float(section: dict, key: str, default: float, lo: float = 0.0, hi: Optional[float] = None,
           hi_open: bool = False) -> float:
    if section.get(key) is None:
        return default
    value = parse_number(section[key], _field(key))
    if value < lo or (hi is not None and (value >= hi if hi_open else value > hi)):
        bound = f"[{lo:g}, {hi:g}{')' if hi_open else ']'}" if hi is not None else f">= {lo:g}"
        raise ConfigError(f"{_field(key)}: must be {'in ' if hi is not None else ''}{bound}, got {section[key]!r}")
    return float(value)


def _bool(section: dict, key: str, default: Optional[bool]) -> Optional[bool]:
    if section.get(key) is None:
        return default
    if not isinstance(section[key], bool):
        raise ConfigError(f"{_field(key)}: expected true or false, got {section[key]!r}")
    return section[key]


def _betas(section: dict, key: str, default: tuple[float, float]) -> tuple[float, float]:
    if section.get(key) is None:
        return default
    value = section[key]
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(f"{_field(key)}: expected two numbers [beta1, beta2], got {value!r}")
    out = []
    for i, b in enumerate(value):
        out.append(_float({f"{key}[{i}]": b}, f"{key}[{i}]", 0.0, 0.0, 1.0, hi_open=True))
    return out[0], out[1]


def _rules(section: dict, key: str, default: Iterable[str] = ()) -> list[str]:
    value = section.get(key)
    if value is None:
        return list(default)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(r, str) and r.strip() for r in value):
        raise ConfigError(f"{_field(key)}: expected a list of parameter-name rules (strings), got {value!r}")
    return list(value)


def _moment_dtype(section: dict, key: str) -> str:
    value = section.get(key)
    if value is None:
        return "float32"
    name = str(value).strip().lower() if isinstance(value, (str, torch.dtype)) else None
    if name not in MOMENT_DTYPES:
        raise ConfigError(f"{_field(key)}: expected float32 or bfloat16 (fp32, bf16), got {value!r}")
    return MOMENT_DTYPES[name]


def low_precision_moments(settings: OptimizerSettings) -> bool:
    """Whether AdamW keeps a moment in a dtype other than float32 (then :class:`AdamWStoredMoments`)."""
    return settings.type == "AdamW" and (
        settings.exp_avg_dtype != "float32" or settings.exp_avg_sq_dtype != "float32")


def optimizer_state_bytes(name: str, param: torch.Tensor, settings: OptimizerSettings) -> int:
    """Bytes of optimizer state per value of ``param``: Muon's momentum buffer (fp32), or AdamW's two
    moments in their storage dtypes (``lit_moe plan``)."""
    if settings.type == "Muon":
        return 4 if uses_muon(name, param, settings) else 8
    return (torch.empty((), dtype=getattr(torch, settings.exp_avg_dtype)).element_size()
            + torch.empty((), dtype=getattr(torch, settings.exp_avg_sq_dtype)).element_size())


def ns_schedule(coefficients: Any, ns_steps: int) -> tuple[tuple[float, float, float], ...]:
    """MindFormers' ``ns_coefficients`` as one ``(a, b, c)`` per Newton-Schulz step (its
    ``Muon._normalize_ns_schedule``): a flat ``[a, b, c]`` is used for all ``ns_steps`` steps; a
    segmented ``[[[a, b, c], count], ...]`` repeats each triple ``count`` times (DeepSeek-V4's
    ``[[[3.4445, -4.7750, 2.0315], 8], [[2.0, -1.5, 0.5], 2]]`` is 10 steps) and fixes the step count."""
    key = "optimizer.ns_coefficients"
    if coefficients is None:
        coefficients = (3.4445, -4.7750, 2.0315)

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def triple(v: Any) -> Optional[tuple[float, float, float]]:
        if isinstance(v, (list, tuple)) and len(v) == 3 and all(number(c) for c in v):
            return tuple(float(c) for c in v)
        return None

    if not isinstance(coefficients, (list, tuple)) or not coefficients:
        raise ConfigError(f"{key}: expected [a, b, c] or [[[a, b, c], count], ...], got {coefficients!r}")
    if number(coefficients[0]):
        flat = triple(coefficients)
        if flat is None:
            raise ConfigError(f"{key}: a flat form has three numbers [a, b, c], got {coefficients!r}")
        return (flat,) * ns_steps
    steps: list[tuple[float, float, float]] = []
    for i, segment in enumerate(coefficients):
        ok = isinstance(segment, (list, tuple)) and len(segment) == 2
        abc = triple(segment[0]) if ok else None
        count = segment[1] if ok else None
        if abc is None or isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"{key}[{i}]: expected [[a, b, c], count] with a positive integer count, "
                              f"got {segment!r}")
        steps.extend([abc] * count)
    if len(steps) >= 100:
        raise ConfigError(f"{key}: the schedule has {len(steps)} steps; at most 99")
    return tuple(steps)


def validate_optimizer_section(optimizer_section: Optional[dict]) -> OptimizerSettings:
    """Check ``optimizer:`` and resolve its defaults; one-line :class:`ConfigError` on a bad value.
    Keys this optimizer does not read are named in one warning (the section allows extra keys)."""
    section = dict(optimizer_section or {})
    kind = section.get("type", "AdamW")
    if not isinstance(kind, str) or kind not in SUPPORTED_OPTIMIZERS:
        raise ConfigError(f"optimizer.type: unknown optimizer {kind!r}; supported: {', '.join(SUPPORTED_OPTIMIZERS)}")
    known = set(_COMMON_KEYS) | set(_TYPE_KEYS[kind]) | set(_CONSUMED_ELSEWHERE)
    unused = sorted(k for k in section if k not in known)
    if unused:
        hint = " (Muon's AdamW half reads adamw_betas)" if kind == "Muon" and "betas" in unused else ""
        log.warning("optimizer: %s ignores %s%s", kind, ", ".join(unused), hint)
    if _bool(section, "enable_cpu_offload", False):
        raise ConfigError("optimizer.enable_cpu_offload: not supported (as in MindFormers), got True")

    s = OptimizerSettings(type=kind)
    s.weight_decay = _float(section, "weight_decay", _DEFAULT_WEIGHT_DECAY)
    s.weight_decay_include = _rules(section, "weight_decay_include")
    s.weight_decay_exclude = _rules(section, "weight_decay_exclude")
    s.foreach = _bool(section, "foreach", None)
    fused = [k for k in ("fused", "use_fused", "enable_fused_opt") if section.get(k) is not None]
    s.fused = any(_bool(section, k, False) for k in fused) if fused else None
    if s.fused and s.foreach:
        raise ConfigError(f"optimizer.{fused[0]}: fused and foreach cannot both be true")

    if kind == "AdamW":
        s.betas = _betas(section, "betas", _DEFAULT_BETAS)
        s.eps = _float(section, "eps", _DEFAULT_EPS)
        s.amsgrad = bool(_bool(section, "amsgrad", False))
        s.maximize = bool(_bool(section, "maximize", False))
        s.exp_avg_dtype = _moment_dtype(section, "exp_avg_dtype")
        s.exp_avg_sq_dtype = _moment_dtype(section, "exp_avg_sq_dtype")
        if low_precision_moments(s):
            clash = [k for k in ("amsgrad", "maximize", "foreach", *fused) if _bool(section, k, False)]
            if clash:
                raise ConfigError(f"optimizer.{clash[0]}: not supported with bfloat16 moments "
                                  "(exp_avg_dtype / exp_avg_sq_dtype); torch's fused and foreach kernels keep "
                                  "every state in one dtype")
        return s

    # Muon. MindFormers passes the section's eps to Muon's Newton-Schulz (its default 1e-8) and runs the
    # other parameters with adamw_betas (0.95, 0.95) / adamw_eps (1e-8), ignoring betas.
    s.momentum = _float(section, "momentum", 0.95, 0.0, 1.0, hi_open=True)
    s.nesterov = bool(_bool(section, "nesterov", True))
    ns_steps = section.get("ns_steps", 5)
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 1 <= ns_steps < 100:
        raise ConfigError(f"optimizer.ns_steps: must be an integer in [1, 99], got {ns_steps!r}")
    s.ns_coefficients = ns_schedule(section.get("ns_coefficients"), ns_steps)
    s.ns_steps = len(s.ns_coefficients)
    if section.get("ns_steps") is not None and s.ns_steps != ns_steps:
        log.warning("optimizer.ns_steps: %d is ignored: the per-step ns_coefficients schedule has %d steps "
                    "(as in MindFormers)", ns_steps, s.ns_steps)
    s.eps = _float(section, "eps", _DEFAULT_EPS)
    adjust = section.get("adjust_lr_fn", "match_rms_adamw")
    if adjust not in ("match_rms_adamw", "original"):
        raise ConfigError(f"optimizer.adjust_lr_fn: expected match_rms_adamw or original, got {adjust!r}")
    s.adjust_lr_fn = adjust
    s.matched_adamw_rms = _float(section, "matched_adamw_rms", 0.2)
    if s.matched_adamw_rms <= 0:
        raise ConfigError(f"optimizer.matched_adamw_rms: must be > 0, got {section['matched_adamw_rms']!r}")
    if section.get("matched_adamw_rms") is not None and adjust == "original":
        raise ConfigError("optimizer.matched_adamw_rms: has no effect with adjust_lr_fn: original "
                          "(torch's max(1, rows/cols)^0.5 scale); drop one of them")
    s.betas = _betas(section, "adamw_betas", (0.95, 0.95))
    s.adamw_eps = _float(section, "adamw_eps", _DEFAULT_EPS)
    s.adamw_include = tuple(_rules(section, "adamw_include", _DEFAULT_ADAMW_INCLUDE))
    s.comm_strategy = section.get("comm_strategy", "allgather")
    if s.comm_strategy not in _COMM_STRATEGIES:
        raise ConfigError(f"optimizer.comm_strategy: expected one of {', '.join(_COMM_STRATEGIES)}, "
                          f"got {s.comm_strategy!r}")
    # MindFormers' Muon defaults QK-clip to on with threshold 100 (lit_moe.optim.qk_clip)
    s.qk_clip_enabled = bool(_bool(section, "qk_clip_enabled", True))
    s.qk_clip_threshold = _float(section, "qk_clip_threshold", 100.0)
    if s.qk_clip_enabled and s.qk_clip_threshold <= 0:
        raise ConfigError(f"optimizer.qk_clip_threshold: must be > 0, got {section['qk_clip_threshold']!r}")
    return s


# ----------------------------------------------------------------------------------------------
# parameter classification
# ----------------------------------------------------------------------------------------------

def _rule_matches(rule: str, name: str) -> bool:
    """MindFormers' rule test (equal, substring or ``fnmatch`` wildcard), on every spelling of ``name``."""
    return any(rule == n or rule in n or fnmatch(n, rule) for n in spellings(name))


def _matches(name: str, rules: Iterable[str]) -> Optional[str]:
    for rule in rules:
        if _rule_matches(rule, name):
            return rule
    return None


def _glob_matches(pattern: str, name: str) -> bool:
    return any(fnmatch(n, pattern) for n in spellings(name))


def check_rules(settings: OptimizerSettings, names: Iterable[str]) -> None:
    """Every name rule of the section matches at least one of the model's parameter ``names`` (all
    of them, frozen ones and other pipeline stages' included): one-line :class:`ConfigError` naming
    the key, the rule and the nearest names otherwise."""
    names = list(names)
    keys = [("weight_decay_include", settings.weight_decay_include, _rule_matches),
            ("weight_decay_exclude", settings.weight_decay_exclude, _rule_matches)]
    if settings.type == "Muon":
        keys.append(("adamw_include", settings.adamw_include, _glob_matches))
    for key, rules, test in keys:
        for rule in rules:
            if not any(test(rule, n) for n in names):
                raise ConfigError(no_match_error(f"optimizer.{key}", rule,
                                                 names))


def uses_weight_decay(name: str, param: torch.Tensor, settings: OptimizerSettings) -> bool:
    """include > exclude > MindFormers' defaults (no decay for 1-D parameters and biases)."""
    if _matches(name, settings.weight_decay_include):
        return True
    if _matches(name, settings.weight_decay_exclude):
        return False
    return not (param.ndim == 1 or name.endswith(".bias"))


def uses_muon(name: str, param: torch.Tensor, settings: OptimizerSettings) -> bool:
    """Muon takes 2-D hidden matrices; embedding, head (``adamw_include``) and every other shape go to
    AdamW. (MindFormers also orthogonalises each expert matrix of 3-D expert weights; torch.optim.Muon
    takes 2-D parameters only, so expert weights stay on AdamW here.)"""
    return param.ndim == 2 and not any(_glob_matches(pattern, name) for pattern in settings.adamw_include)


def _is_dtensor(p: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(p, DTensor)


def _trainable(named_parameters: Iterable[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    seen: set[int] = set()
    out = []
    for name, p in named_parameters:
        if not p.requires_grad or id(p) in seen:  # tied/shared parameters appear once
            continue
        seen.add(id(p))
        if p.dtype != torch.float32:
            raise ConfigError(f"model.params_dtype: the optimizer steps fp32 master weights, but parameter "
                              f"{canonical_name(name)!r} is {str(p.dtype).replace('torch.', '')}; keep "
                              "params_dtype float32 (compute_dtype sets the compute precision)")
        out.append((canonical_name(name), p))
    if not out:
        raise ConfigError("optimizer: the model has no trainable parameters")
    return out


def param_groups(named_parameters: Iterable[tuple[str, nn.Parameter]], settings: OptimizerSettings,
                 learning_rate: float) -> list[dict[str, Any]]:
    """Groups keyed by (algorithm, decay[, tensor kind]); each carries ``name`` and ``param_names``
    (cleaned names, for logs) besides ``params``, ``lr`` and ``weight_decay``."""
    params = _trainable(named_parameters)
    kinds = {_is_dtensor(p) for _, p in params}
    groups: dict[str, dict[str, Any]] = {}
    for name, p in params:
        algo = "muon" if settings.type == "Muon" and uses_muon(name, p, settings) else "adamw"
        decay = uses_weight_decay(name, p, settings)
        key = f"{algo}.{'decay' if decay else 'no_decay'}"
        if len(kinds) > 1:  # only when plain tensors and DTensors are mixed
            key += ".dtensor" if _is_dtensor(p) else ".tensor"
        g = groups.setdefault(key, {"name": key, "params": [], "param_names": [], "lr": learning_rate,
                                    "weight_decay": settings.weight_decay if decay else 0.0})
        g["params"].append(p)
        g["param_names"].append(name)
    return [groups[k] for k in sorted(groups)]


# ----------------------------------------------------------------------------------------------
# Muon + AdamW as one optimizer
# ----------------------------------------------------------------------------------------------
def newton_schulz(x: torch.Tensor, schedule: tuple[tuple[float, float, float], ...], eps: float) -> torch.Tensor:
    """MindFormers' ``newton_schulz`` in bf16 (as torch.optim.Muon and MindFormers run it): the wide
    orientation, ``x / (||x||_F + eps)``, then per step ``A = x x^T``, ``x = a x + (b A + c A A) x`` with
    that step's ``(a, b, c)``; returned in the input orientation."""
    x = x.bfloat16()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + eps)
    for a, b, c in schedule:
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class ScheduledMuon(torch.optim.Muon):
    """``torch.optim.Muon`` with MindFormers' per-step Newton-Schulz schedule (``ns_schedule``, one
    ``(a, b, c)`` per step) and any ``matched_adamw_rms``: the update is ``lr · matched_adamw_rms ·
    sqrt(max(rows, cols)) · NS(input)``, as MindFormers' ``_apply_muon_ns`` (``adjust_lr_fn: original``
    keeps torch's scale). Momentum and state are torch's (``momentum_buffer``, an average: MindFormers'
    buffer is a sum, larger by ``1 / (1 - momentum)``, which the normalisation inside NS takes out
    up to ``eps``)."""

    def __init__(self, params: Any, ns_schedule: tuple[tuple[float, float, float], ...],
                 matched_adamw_rms: float = 0.2, **kwargs: Any) -> None:
        super().__init__(params, ns_coefficients=ns_schedule[0], ns_steps=len(ns_schedule), **kwargs)
        for group in self.param_groups:
            group.setdefault("ns_schedule", tuple(ns_schedule))
            group.setdefault("matched_adamw_rms", matched_adamw_rms)

    def _update_scale(self, group: dict, shape: torch.Size) -> float:
        if group["adjust_lr_fn"] == "original":
            return max(1.0, shape[0] / shape[1]) ** 0.5
        return group["matched_adamw_rms"] * max(shape[0], shape[1]) ** 0.5

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            lr, momentum = group["lr"], group["momentum"]
            for p, g, buf in zip(params, grads, bufs):
                buf.lerp_(g, 1 - momentum)
                update = g.lerp(buf, momentum) if group["nesterov"] else buf
                update = newton_schulz(update, group["ns_schedule"], group["eps"])
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * self._update_scale(group, p.shape))
        return loss


class MuonWithAdamW(torch.optim.Optimizer):
    """:class:`ScheduledMuon` on the groups named ``muon.*`` and ``torch.optim.AdamW`` on the others, as one
    optimizer. Both inner optimizers use this object's group dicts and its ``state`` (keyed by parameter,
    so they never collide); after ``load_state_dict`` (which replaces both) they are linked again."""

    def __init__(self, groups: list[dict[str, Any]], muon_kwargs: dict[str, Any], adamw_kwargs: dict[str, Any],
                 qk_clip: Any = None):
        self.qk_clip = qk_clip   # lit_moe.optim.qk_clip.QKClip: after every step (not pickled with the state)
        muon_groups = [g for g in groups if g["name"].startswith("muon.")]
        adamw_groups = [g for g in groups if not g["name"].startswith("muon.")]
        self.muon = ScheduledMuon(muon_groups, **muon_kwargs) if muon_groups else None
        self.adamw = torch.optim.AdamW(adamw_groups, **adamw_kwargs) if adamw_groups else None
        inner_groups = (self.muon.param_groups if self.muon else []) + (self.adamw.param_groups if self.adamw else [])
        super().__init__(inner_groups, defaults={})  # adopts the inner group dicts as they are
        self._link()

    def _link(self) -> None:
        n_muon = sum(1 for g in self.param_groups if g["name"].startswith("muon."))
        if self.muon is not None:
            self.muon.param_groups = self.param_groups[:n_muon]
            self.muon.state = self.state
        if self.adamw is not None:
            self.adamw.param_groups = self.param_groups[n_muon:]
            self.adamw.state = self.state

    def __getstate__(self) -> dict[str, Any]:  # pickling/deepcopy keep the inner optimizers
        return {**super().__getstate__(), "muon": self.muon, "adamw": self.adamw}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "muon" in self.__dict__:  # load_state_dict (and unpickling) replace groups and state
            self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner in (self.muon, self.adamw):
            if inner is not None:
                inner.step()
        if getattr(self, "qk_clip", None) is not None:
            self.qk_clip.apply()
        return loss


# ----------------------------------------------------------------------------------------------
# AdamW with moments stored in bfloat16
# ----------------------------------------------------------------------------------------------
class AdamWStoredMoments(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose moments are stored in ``exp_avg_dtype`` / ``exp_avg_sq_dtype``
    (bfloat16 halves their 8 bytes per parameter), as Megatron-Core's precision-aware optimizer keeps
    them: each step reads one parameter's moments into float32, applies torch's single-tensor AdamW
    update in float32 (the same operations in the same order), and stores them back rounded to the
    nearest storage value. The transient float32 copies are those of one parameter (shard) at a time.
    Parameters stay fp32 masters. No fused or foreach kernel (torch's take one dtype for all states),
    so a guarded skip is decided on the host (:func:`step_on_device`)."""

    def __init__(self, params: Any, *, exp_avg_dtype: torch.dtype, exp_avg_sq_dtype: torch.dtype, **kwargs: Any):
        super().__init__(params, foreach=False, fused=False, **kwargs)
        self.moment_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch casts every floating state to its parameter's dtype (fp32) on load: store them back
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key, dtype in self.moment_dtypes.items():
                if key in state and state[key].dtype != dtype:
                    state[key] = state[key].to(dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        lr, weight_decay, eps = float(group["lr"]), group["weight_decay"], group["eps"]
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key, dtype in self.moment_dtypes.items():
                state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        state["step"] += 1
        step = float(state["step"])
        grad = p.grad
        exp_avg, exp_avg_sq = state["exp_avg"].float(), state["exp_avg_sq"].float()
        if weight_decay != 0:
            p.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
        state["exp_avg"].copy_(exp_avg)       # rounds to the storage dtype (no-op copy when float32)
        state["exp_avg_sq"].copy_(exp_avg_sq)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------
def _fused_ok(groups: list[dict]) -> bool:
    """True when every parameter is a floating tensor (plain or DTensor) on a device with fused AdamW
    kernels."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        devices = set(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - older torch
        return False
    params = [p for g in groups for p in g["params"]]
    # DTensor parameters (FSDP2, tensor and expert parallel) qualify: torch shards the fused kernel like
    # any pointwise op (on each rank's local shard, across several meshes), with the tensor learning
    # rate and ``found_inf`` as plain 0-d tensors (checked against one process by the layout tests).
    return bool(params) and all(p.is_floating_point() and p.device.type in devices for p in params)


def build_optimizer(named_parameters: Iterable[tuple[str, nn.Parameter]], optimizer_section: Optional[dict],
                    learning_rate: float, model: Optional[nn.Module] = None) -> torch.optim.Optimizer:
    """The optimizer of ``optimizer_section`` over the trainable parameters, every group at
    ``learning_rate`` (the schedule's peak; a ``LambdaLR`` scales it per step). ``model``: the lit_moe
    model whose MLA layers Muon's QK-clip rescales after each step (``qk_clip_enabled``, the default);
    without it (an optimizer over bare parameters) there is nothing to clip."""
    settings = validate_optimizer_section(optimizer_section)
    groups = param_groups(named_parameters, settings, learning_rate)
    kernels = {"foreach": settings.foreach, "fused": settings.fused}
    if (settings.type == "AdamW" and settings.fused is None and settings.foreach is None and _fused_ok(groups)
            and not low_precision_moments(settings)):
        # torch's default on CPU is a per-parameter loop; the fused kernel cut the benchmark's step by
        # 7-10% (benchmarks/README.md); it also skips a step on the device (``found_inf``).
        kernels["fused"] = True
    if low_precision_moments(settings):
        optimizer = AdamWStoredMoments(groups, lr=learning_rate, betas=settings.betas, eps=settings.eps,
                                       weight_decay=settings.weight_decay,
                                       exp_avg_dtype=getattr(torch, settings.exp_avg_dtype),
                                       exp_avg_sq_dtype=getattr(torch, settings.exp_avg_sq_dtype))
    elif settings.type == "AdamW":
        optimizer = torch.optim.AdamW(groups, lr=learning_rate, betas=settings.betas, eps=settings.eps,
                                      weight_decay=settings.weight_decay, amsgrad=settings.amsgrad,
                                      maximize=settings.maximize, **kernels)
    else:
        muon_kwargs = dict(lr=learning_rate, weight_decay=settings.weight_decay, momentum=settings.momentum,
                           nesterov=settings.nesterov, ns_schedule=settings.ns_coefficients,
                           matched_adamw_rms=settings.matched_adamw_rms, eps=settings.eps,
                           adjust_lr_fn=settings.adjust_lr_fn)
        adamw_kwargs = dict(lr=learning_rate, betas=settings.betas, eps=settings.adamw_eps,
                            weight_decay=settings.weight_decay, **kernels)
        from lit_moe.optim.qk_clip import build_qk_clip

        optimizer = MuonWithAdamW(groups, muon_kwargs, adamw_kwargs, qk_clip=build_qk_clip(model, settings))
    log.info("optimizer: %s, %s", settings.type,
             "; ".join(f"{g['name']}: {len(g['params'])} tensors, weight_decay {g['weight_decay']:g}"
                       for g in optimizer.param_groups))
    return optimizer


# ----------------------------------------------------------------------------------------------
# the update on the device: learning-rate schedule and skipped steps without host syncs
# ----------------------------------------------------------------------------------------------
@dataclass
class _DevicePosition:
    device: torch.device
    applied: torch.Tensor            # 0-d int64: updates applied so far (LambdaLR's last_epoch)
    bound: int                       # host upper bound of ``applied`` (steps taken since it was known)
    table: Optional[torch.Tensor]    # [rows, groups] float64: base_lr × lr_lambda(k) for k < rows


class DeviceLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """``LambdaLR`` whose position, the number of updates applied, lives on the training device.

    A step whose update a guard skips must not advance the schedule; with the skip decided on the
    device, the host does not know whether it advanced. So the position is a device counter
    (:meth:`advance` adds 1 or 0 on the device) and the learning rate is read from a device table of
    ``base_lr × lr_lambda(k)`` (the same Python expression ``LambdaLR`` evaluates, hence the same
    values) at that position (:meth:`device_lrs`). The host attributes (``last_epoch``, ``_last_lr``
    and the optimizer groups' ``lr``) move on at every :meth:`advance` as if the update was applied
    (no device read), and :meth:`sync_host`, one host read, makes them exact after skips; it runs in
    ``state_dict`` (checkpoints), on the module's log steps and at the end of training. A host
    ``step()`` (LambdaLR's own stepping) still works and moves the device position.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, lr_lambda: Any, last_epoch: int = -1) -> None:
        self._position: Optional[_DevicePosition] = None
        super().__init__(optimizer, lr_lambda, last_epoch)
        # a checkpoint (optimizer state with its groups' lr) always carries the current values
        optimizer.register_state_dict_pre_hook(lambda _opt: self.sync_host())

    # -- device side ------------------------------------------------------------------------
    def _at(self, device: torch.device) -> _DevicePosition:
        pos = self._position
        if pos is None or pos.device != device:
            self.sync_host()
            pos = self._position = _DevicePosition(
                device, torch.full((), self.last_epoch, dtype=torch.int64, device=device), self.last_epoch, None)
        rows = 0 if pos.table is None else pos.table.shape[0]
        if pos.bound >= rows:   # the table must cover every position the counter can have reached
            new_rows = max(pos.bound + 1, 2 * rows, 256)
            extra = torch.tensor([[base * fn(k) for base, fn in zip(self.base_lrs, self.lr_lambdas)]
                                  for k in range(rows, new_rows)], dtype=torch.float64).to(device)
            pos.table = extra if pos.table is None else torch.cat([pos.table, extra])
        return pos

    def device_lrs(self, device: torch.device) -> list[torch.Tensor]:
        """The learning rate of each group for the coming update, as 0-d float64 tensors on ``device``."""
        pos = self._at(torch.device(device))
        return list(torch.index_select(pos.table, 0, pos.applied.view(1))[0].unbind(0))

    def advance(self, applied: Optional[torch.Tensor] = None) -> None:
        """Count the update just made: ``applied`` (0-d bool on the device) says whether it was
        applied; None: it was."""
        pos = self._at(self._position.device if self._position is not None else torch.device("cpu"))
        pos.applied += 1 if applied is None else applied.to(torch.int64)
        pos.bound += 1
        # The host view moves on as if the update was applied, without reading the device, so that
        # callbacks reading the groups' lr every step (Lightning's LearningRateMonitor) see the
        # schedule; after a skip it is one position ahead until the next sync_host (log steps).
        self._move_host(self.last_epoch + 1)

    # -- host side --------------------------------------------------------------------------
    def sync_host(self) -> None:
        """Bring ``last_epoch``, ``_last_lr`` and the groups' ``lr`` up to the device position (a
        host read of one integer)."""
        pos = self._position
        if pos is None:
            return
        k = int(pos.applied)
        pos.bound = k
        self._move_host(k)

    def _move_host(self, k: int) -> None:
        if k != self.last_epoch:
            self._step_count += k - self.last_epoch   # as if step() had been called once per update
            self.last_epoch = k
            values = [base * fn(k) for base, fn in zip(self.base_lrs, self.lr_lambdas)]
            for group, lr in zip(self.optimizer.param_groups, values):
                group["lr"] = lr
            self._last_lr = values

    def step(self, epoch: Optional[int] = None) -> None:
        self.sync_host()
        super().step(epoch)
        self._position = None   # rebuilt from last_epoch (and the current lambdas) when next needed

    def state_dict(self) -> dict[str, Any]:
        self.sync_host()
        state = super().state_dict()
        state.pop("_position", None)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._position = None


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` can be told to skip through ``found_inf`` (torch's GradScaler
    contract, ``_step_supports_amp_scaling``: the fused Adam/AdamW kernels) and takes tensor learning
    rates: then a skipped update costs nothing and needs no host branch."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        g.get("fused") for g in optimizer.param_groups)


def _takes_tensor_lr(optimizer: torch.optim.Optimizer) -> bool:
    return all(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)


def step_on_device(optimizer: torch.optim.Optimizer, lrs: list[torch.Tensor],
                   skip: Optional[torch.Tensor]) -> None:
    """``optimizer.step()`` with learning rates ``lrs`` (0-d device tensors, one per group), or no
    update at all where ``skip`` (0-d bool on the device) is true, without reading either on the host.

    * fused AdamW (the default wherever torch has the kernel): the learning rate goes in as a tensor
      and the skip as ``found_inf``, with which the kernel leaves parameters and moments alone and
      torch takes its step-count increment back (the same values as never stepping);
    * any other optimizer (``foreach`` or per-parameter AdamW, Muon): the skip verdict is read on the
      host and the step is simply not taken (one host sync per step; copying the parameters and
      the whole optimizer state to put them back on the device would cost three times the
      parameters' memory). Optimizers that take no tensor learning rate (``foreach`` AdamW without
      ``capturable``, Muon) also get it as a Python float.

    The groups' ``lr`` entries hold Python floats again afterwards (see :class:`DeviceLambdaLR`).
    ``optimizer`` may be Lightning's wrapper (its ``step`` runs the strategy's hooks); the flags go to
    the torch optimizer inside it."""
    inner = getattr(optimizer, "optimizer", optimizer)   # LightningOptimizer → torch optimizer
    groups = inner.param_groups
    host_lrs = [g["lr"] for g in groups]
    tensor_lr = _takes_tensor_lr(inner)
    for g, lr in zip(groups, lrs):
        # CPU kernels read a float64 learning rate exactly; accelerator kernels take fp32 (what they
        # compute in anyway)
        g["lr"] = (lr if lr.device.type == "cpu" else lr.float()) if tensor_lr else float(lr)
    try:
        if skip is None:
            optimizer.step()
        elif skips_on_device(inner):
            inner.found_inf = skip.to(torch.float32)
            try:
                optimizer.step()
            finally:
                del inner.found_inf
        else:
            _step_or_restore(optimizer, inner, skip)
    finally:
        for g, lr in zip(groups, host_lrs):
            g["lr"] = lr


def _step_or_restore(optimizer: Any, inner: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    # Optimizers without a device-side skip: read the verdict on the host (one sync per step) rather
    # than copy the parameters and the whole optimizer state every step to put them back with
    # torch.where: on a sharded run that copy would be three times the parameters' bytes, transient
    # memory no plan counts. Not stepping leaves parameters and state exactly as they were.
    if not bool(skip):
        optimizer.step()