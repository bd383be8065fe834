"""LoRA (MindFormers' ``lora_config``): low-rank adapters on linear layers and routed experts, the
base weights frozen.

``y = x Wᵀ + (alpha / r) · (dropout(x) Aᵀ) Bᵀ`` with ``A = lora_a [r, in]`` and ``B = lora_b [out, r]``
(stored like the base weight, ``[out, in]``), as MindFormers' ``LinearWithLoRA``; ``A`` starts as
N(0, ``lora_a_std``²) and ``B`` as 0 (N(0, ``lora_b_std``²) when that is > 0), so the adapted model
starts equal to the base model. Routed experts (``GroupedExperts``, weights ``x @ W``) get one
adapter per expert and per projection: ``gate_up_proj_lora_a [E, H, r]``, ``gate_up_proj_lora_b
[E, r, 2I]``, ``down_proj_lora_a [E, I, r]``, ``down_proj_lora_b [E, r, H]`` (MindFormers'
``GroupedMLPWithLoRA``: ``x @ W + s · (dropout(x) @ A) @ B``).

Which modules: every linear layer (``lit_moe.ops.Linear``; not the output head, whose fused
cross-entropy has no adapter path) and every routed-expert module whose dotted name (as in
``model.named_modules()``, e.g. ``layers.1.self_attention.q_a_proj``, ``layers.2.mlp.experts``,
``layers.2.mlp.shared_experts.down_proj``, ``mtp.0.eh_proj``), in any of its spellings (MindFormers'
``model.decoder.layers.1.self_attention.linear_qkv`` or Hugging Face's ``model.layers.1.self_attn.q_a_proj``,
``lit_moe.model.names.spellings``), matches the ``target_modules`` regular expression (``re.search``),
unless it or a module above it matches ``exclude_layers``.

Order in a run (MindFormers' order): :func:`apply_lora` on the meta-device model, then the parallel
layout (tensor parallel shards ``lora_b`` of column-parallel and ``lora_a`` of row-parallel layers
with the base weight — see ``TP_ADAPTER_SHARDS`` — expert parallel shards the expert adapters on the
expert dimension, FSDP shards everything), materialisation and initialisation
(:func:`init_adapters` after ``init_weights``; layout-independent, seeded by name), base weights
loaded (adapter tensors are not in a base checkpoint), then :func:`freeze_base`: only adapters keep
``requires_grad``, so the optimizer holds state for them alone. Checkpoints hold base and adapters,
so a resume is exact. :func:`merge_lora` folds the adapters into plain weights (``lit_moe
convert-hf`` does this when the config has a ``lora_config``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lit_moe.config import ConfigError
from lit_moe.model.names import no_match_error, spelled, spellings
from lit_moe.model.moe import GroupedExperts, _local, grouped_mm_row_align, grouped_mm_usable
from lit_moe.ops import Linear
from lit_moe.ops.cross_entropy import LMHead

ADAPTER_SUFFIXES = ("lora_a", "lora_b")


def is_adapter_name(name: str) -> bool:
    """Whether a parameter name (any prefix) is a LoRA adapter tensor."""
    return name.endswith(ADAPTER_SUFFIXES)


@dataclass(frozen=True)
class LoraSettings:
    """The validated ``lora_config`` section."""

    target_modules: str
    exclude_layers: Optional[str] = None
    lora_rank: int = 8
    lora_alpha: float = 16
    lora_dropout: float = 0.0
    lora_a_std: float = 0.01
    lora_b_std: float = 0.0

    @property
    def scaling(self) -> float:
        return float(self.lora_alpha) / float(self.lora_rank)


_FIELDS = ("target_modules", "exclude_layers", "lora_rank", "lora_alpha", "lora_dropout", "lora_a_std",
           "lora_b_std")


def lora_settings(section: Any) -> Optional[LoraSettings]:
    """``lora_config`` (a dict, a dataclass or a namespace; None = no LoRA) → :class:`LoraSettings`,
    with one-line errors naming the field."""
    if section is None:
        return None
    if isinstance(section, LoraSettings):
        return section
    if isinstance(section, dict):
        values = dict(section)
    else:
        values = {k: getattr(section, k) for k in _FIELDS if hasattr(section, k)}
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"lora_config.{unknown[0]}: unknown key; lora_config takes {', '.join(_FIELDS)}")
    values = {k: v for k, v in values.items() if v is not None or k in ("target_modules",)}
    target = values.get("target_modules")
    if not isinstance(target, str) or not target:
        raise ConfigError(f"lora_config.target_modules: a regular expression is required, got {target!r}")
    for key in ("target_modules", "exclude_layers"):
        if values.get(key) is not None:
            if not isinstance(values[key], str):
                raise ConfigError(f"lora_config.{key}: expected a regular expression string, got {values[key]!r}")
            try:
                re.compile(values[key])
            except re.error as err:
                raise ConfigError(f"lora_config.{key}: {values[key]!r} is not a valid regular expression ({err})") from None
    rank = values.get("lora_rank", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"lora_config.lora_rank: must be a positive integer, got {rank!r}")
    for key in ("lora_alpha", "lora_a_std", "lora_b_std"):
        v = values.get(key, getattr(LoraSettings, key))
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ConfigError(f"lora_config.{key}: must be a finite number >= 0, got {v!r}")
    p = values.get("lora_dropout", 0.0)
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        raise ConfigError(f"lora_config.lora_dropout: must be in [0, 1), got {p!r}")
    return LoraSettings(**values)


# ----------------------------------------------------------------------------------------------
# the adapted layers
# ----------------------------------------------------------------------------------------------
class LoRALinear(Linear):
    """A :class:`lit_moe.ops.Linear` (tensor-parallel plans still see an ``nn.Linear`` with its
    ``weight``) plus ``lora_a [r, in]`` and ``lora_b [out, r]``."""

    # Tensor parallel: which adapter is sharded with the base weight, on which dim (the other one
    # is replicated with a partial gradient like every replicated parameter).
    TP_ADAPTER_SHARDS = {"colwise": {"lora_b": 0}, "rowwise": {"lora_a": 1}}

    def __init__(self, in_features: int, out_features: int, settings: LoraSettings,
                 dtype: Optional[torch.dtype] = None, device=None) -> None:
        super().__init__(in_features, out_features, dtype=dtype, device=device)
        r = settings.lora_rank
        self.scaling = settings.scaling
        self.lora_a_std, self.lora_b_std = settings.lora_a_std, settings.lora_b_std
        self.lora_a = nn.Parameter(torch.empty(r, in_features, dtype=dtype, device=device))
        self.lora_b = nn.Parameter(torch.empty(out_features, r, dtype=dtype, device=device))
        self.lora_dropout = nn.Dropout(settings.lora_dropout) if settings.lora_dropout > 0 else nn.Identity()

    @classmethod
    def from_base(cls, base: Linear, settings: LoraSettings) -> "LoRALinear":
        """The adapted layer reusing ``base``'s weight Parameter (same object, so names and
        checkpoints keep working)."""
        w = base.weight
        new = cls(base.in_features, base.out_features, settings, dtype=w.dtype, device=w.device)
        new.weight = w
        new.bias = base.bias   # GQA's q/k/v biases (None elsewhere)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        h = F.linear(self.lora_dropout(x), self.lora_a.to(x.dtype))
        return y + F.linear(h, self.lora_b.to(x.dtype)) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """``scaling · B A`` in fp32, the ``[out, in]`` update :func:`merge_lora` adds."""
        return (self.lora_b.detach().float() @ self.lora_a.detach().float()) * self.scaling

    def extra_repr(self) -> str:
        return super().extra_repr() + f", lora_rank={self.lora_a.shape[0]}, scaling={self.scaling:g}"


def _expert_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, offs: Optional[torch.Tensor],
                   sizes: Optional[list[int]]) -> torch.Tensor:
    """``x [N, K]`` rows grouped by expert times ``w [E, K, M]`` (one GEMM per group)."""
    if offs is not None:
        return F.grouped_mm(x, w, offs=offs)
    outs = [xe @ w[e] for e, xe in enumerate(torch.split(x, sizes))]
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[-1])


class LoRAGroupedExperts(GroupedExperts):
    """Routed experts with one adapter per expert and projection (see the module docstring)."""

    def __init__(self, config: Any, settings: LoraSettings, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(config, dtype=dtype)
        E, H, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        r = settings.lora_rank
        self.scaling = settings.scaling
        self.lora_a_std, self.lora_b_std = settings.lora_a_std, settings.lora_b_std
        self.gate_up_proj_lora_a = nn.Parameter(torch.empty(E, H, r, dtype=dtype))
        self.gate_up_proj_lora_b = nn.Parameter(torch.empty(E, r, 2 * I, dtype=dtype))
        self.down_proj_lora_a = nn.Parameter(torch.empty(E, I, r, dtype=dtype))
        self.down_proj_lora_b = nn.Parameter(torch.empty(E, r, H, dtype=dtype))
        self.lora_dropout = nn.Dropout(settings.lora_dropout) if settings.lora_dropout > 0 else nn.Identity()

    @classmethod
    def from_base(cls, base: GroupedExperts, config: Any, settings: LoraSettings) -> "LoRAGroupedExperts":
        with torch.device(base.gate_up_proj.device):
            new = cls(config, settings, dtype=base.gate_up_proj.dtype)
        new.gate_up_proj = base.gate_up_proj
        new.down_proj = base.down_proj
        new.act = base.act
        new.use_grouped_mm = base.use_grouped_mm
        return new

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                row_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        w1 = _local(self.gate_up_proj).to(x.dtype)
        w2 = _local(self.down_proj).to(x.dtype)
        a1, b1 = _local(self.gate_up_proj_lora_a).to(x.dtype), _local(self.gate_up_proj_lora_b).to(x.dtype)
        a2, b2 = _local(self.down_proj_lora_a).to(x.dtype), _local(self.down_proj_lora_b).to(x.dtype)
        offs = sizes = None
        r = a1.shape[-1]
        # grouped GEMMs where they need no row padding (accelerators) and the rank is aligned;
        # otherwise the exact loop over experts
        if (self.use_grouped_mm and x.shape[0] > 0 and grouped_mm_row_align(x.device) == 1
                and grouped_mm_usable(x, w1, w2) and (r * x.element_size()) % 16 == 0):
            offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        else:
            sizes = num_tokens_per_expert.tolist()

        def mm(t, w):
            return _expert_matmul(t, w, num_tokens_per_expert, offs, sizes)

        h = mm(x, w1) + mm(mm(self.lora_dropout(x), a1), b1) * self.scaling
        a = self._weighted_act(h, None if row_weights is None else row_weights.to(x.dtype))   # as GroupedExperts
        return mm(a, w2) + mm(mm(self.lora_dropout(a), a2), b2) * self.scaling

    def delta_weights(self) -> dict[str, torch.Tensor]:
        """``{"gate_up_proj": s·A₁B₁ [E, H, 2I], "down_proj": s·A₂B₂ [E, I, H]}`` in fp32."""
        return {name: (getattr(self, f"{name}_lora_a").detach().float()
                       @ getattr(self, f"{name}_lora_b").detach().float()) * self.scaling
                for name in ("gate_up_proj", "down_proj")}


# ----------------------------------------------------------------------------------------------
# applying, initialising, freezing, merging
# ----------------------------------------------------------------------------------------------
def apply_lora(model: nn.Module, settings: Any) -> list[str]:
    """Replace the targeted layers of ``model`` (normally on the meta device) by their adapted
    versions, in place; returns the adapted module names. A pattern that matches nothing is a
    :class:`ConfigError` listing some candidate names."""
    settings = lora_settings(settings)
    target = re.compile(settings.target_modules)
    exclude = re.compile(settings.exclude_layers) if settings.exclude_layers else None
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    adapted: list[str] = []
    candidates: list[str] = []

    def names(full: str) -> tuple[str, ...]:
        # MindFormers' LoRA matches cell paths from its top cell, whose child is ``model``
        mf = tuple("model." + spelled(full, tree) for tree in ("mindformers", "mindformers_megatron"))
        return spellings(full, layers) + mf

    def visit(parent: nn.Module, prefix: str) -> None:
        for child_name, child in list(parent.named_children()):
            full = f"{prefix}.{child_name}" if prefix else child_name
            if exclude is not None and any(exclude.search(n) for n in names(full)):
                continue
            if isinstance(child, (LoRALinear, LoRAGroupedExperts)):
                adapted.append(full)
                continue
            if type(child) is Linear or isinstance(child, GroupedExperts):
                candidates.append(full)
                if any(target.search(n) for n in names(full)):
                    if isinstance(child, GroupedExperts):
                        new: nn.Module = LoRAGroupedExperts.from_base(child, config, settings)
                    else:
                        new = LoRALinear.from_base(child, settings)
                    setattr(parent, child_name, new)
                    adapted.append(full)
                continue
            if isinstance(child, LMHead):
                continue
            visit(child, full)

    visit(model, "")
    if not adapted:
        excluded = f" outside exclude_layers {settings.exclude_layers!r}" if settings.exclude_layers else ""
        raise ConfigError(no_match_error("lora_config.target_modules", settings.target_modules,
                                         candidates,
                                         what=f"linear layer or routed experts{excluded}"))
    return adapted


def check_lora_targets(model_config: Any, settings: Any) -> list[str]:
    """Before anything is allocated: the adapted module names of the model ``model_config`` builds
    (on the meta device); a pattern matching nothing is the same one-line error as in the run."""
    from lit_moe.model import DeepseekV3ForCausalLM

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(model_config)
    return apply_lora(model, settings)


def adapter_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (LoRALinear, LoRAGroupedExperts))]


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """``lora_a`` ~ N(0, lora_a_std²), ``lora_b`` = 0 (or N(0, lora_b_std²)), each tensor from a
    generator seeded by ``(seed, name)``: the same values under every layout (DTensor shards keep
    their piece of the full tensor), like ``init_weights``. Call after ``init_weights``."""
    from lit_moe.model.names import canonical_name
    from lit_moe.model.transformer import _normal_by_name, _param_seed

    for mod_name, mod in adapter_modules(model):
        for pname, p in mod.named_parameters(recurse=False):
            if not is_adapter_name(pname):
                continue
            std = mod.lora_a_std if pname.endswith("lora_a") else mod.lora_b_std
            if std > 0:
                name = canonical_name(f"{mod_name}.{pname}")
                _normal_by_name(p, std, _param_seed(seed, "lora/" + name))
            else:
                p.zero_()


def freeze_base(model: nn.Module) -> tuple[int, int]:
    """Only adapter tensors keep ``requires_grad``; returns (trainable, frozen) element counts.
    An adapted model without adapters is a configuration error (as MindFormers)."""
    trainable = frozen = 0
    for name, p in model.named_parameters():
        keep = is_adapter_name(name)
        p.requires_grad_(keep)
        if keep:
            trainable += p.numel()
        else:
            frozen += p.numel()
    if trainable == 0:
        raise ConfigError("lora_config: the model has no LoRA adapters to train")
    return trainable, frozen


@torch.no_grad()
def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its base weight and put plain layers back (in place, unsharded
    model); returns the number of merged modules. The merged model computes what the adapted one
    computes without dropout."""
    merged = 0
    for name, mod in adapter_modules(model):
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        child = name.rsplit(".", 1)[-1]
        if isinstance(mod, LoRALinear):
            plain = Linear(mod.in_features, mod.out_features, dtype=mod.weight.dtype, device=mod.weight.device)
            plain.weight = nn.Parameter((mod.weight.float() + mod.delta_weight()).to(mod.weight.dtype))
        else:
            with torch.device("meta"):
                plain = GroupedExperts(model.config)
            deltas = mod.delta_weights()
            for pname in ("gate_up_proj", "down_proj"):
                w = getattr(mod, pname)
                setattr(plain, pname, nn.Parameter((w.float() + deltas[pname]).to(w.dtype)))
            plain.act = mod.act
            plain.use_grouped_mm = mod.use_grouped_mm
        setattr(parent, child, plain)
        merged += 1
    return merged


def keep_initialised_adapters(live: dict, saved_keys: Any) -> dict:
    """Loading weights: ``live`` (name → tensor) without its adapter tensors when the checkpoint
    (``saved_keys``) holds none, i.e. a base checkpoint loaded into an adapted model; the adapters
    then keep their initialisation. A checkpoint with adapters (a LoRA run's) loads them too."""
    if any(is_adapter_name(k) for k in saved_keys):
        return live
    return {k: v for k, v in live.items() if not is_adapter_name(k)}
