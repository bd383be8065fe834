"""The recompute plan: the ``recompute`` / ``recompute_comm`` sections validated against the model's layers."""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass
from typing import Any, Optional


from lit_moe.config import ConfigError, RecomputeCommConfig, RecomputeConfig, build_section, parse_layer_specs


log = logging.getLogger(__name__)

FSDP_ALL_GATHER = "fsdp.all_gather"
"""Virtual path of a layer's FSDP parameter all-gather, for ``recompute_comm.select_module``. A layer
whose pattern matches it has its gathered parameters freed after forward and gathered again in
backward (FSDP2 ``reshard_after_forward=True``), also under ``optim_grads`` (ZeRO-2), which would
otherwise keep them. Read by the strategy through :func:`fsdp_reshard_after_forward`."""


class RecomputeWarning(UserWarning):
    """A recompute pattern that selects nothing, or a setting that is ignored."""


# ----------------------------------------------------------------------------------------------
# validation: YAML sections -> a plan of layer ids
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RecomputePlan:
    """The validated ``recompute`` / ``recompute_comm`` sections, with layer specs expanded."""

    full_layers: tuple[int, ...] = ()
    """Layers recomputed whole."""
    select: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """``(regex, layers)`` pairs of ``recompute.select_module`` (empty unless ``mode: select``)."""
    comm: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """``(regex, layers)`` pairs of ``recompute_comm.select_module`` (empty unless enabled)."""

    @property
    def empty(self) -> bool:
        return not (self.full_layers or self.select or self.comm)

    def regathers(self, layer_id: int) -> bool:
        """Whether ``recompute_comm`` selects layer ``layer_id``'s FSDP parameter all-gather
        (:data:`FSDP_ALL_GATHER`): FSDP then reshards that layer after its forward and gathers its
        parameters again for backward, whatever else is recomputed in it."""
        return any(layer_id in layers and re.fullmatch(p, FSDP_ALL_GATHER) for p, layers in self.comm)


def _normalise_mode(mode: Any) -> Optional[str]:
    if mode is None:
        return None
    if isinstance(mode, str) and mode.strip().lower() in ("none", "full", "select"):
        m = mode.strip().lower()
        return None if m == "none" else m
    raise ConfigError(f"recompute.mode: must be None, 'full' or 'select', got {mode!r}")


def _parse_select(select: Any, total_layers: int, name: str, required_because: str) -> tuple:
    """``{regex: layer specs}`` -> ``((regex, (layers...)), ...)``; every regex compiled, every spec checked."""
    if select is None or (isinstance(select, dict) and not select):
        raise ConfigError(f"{name}: {required_because} but select_module is missing or empty")
    if not isinstance(select, dict):
        raise ConfigError(f"{name}: must be a mapping {{regex: layer specs}}, got {select!r}")
    out = []
    for pattern, specs in select.items():
        field = f"{name}[{pattern!r}]"
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"{field}: the key must be a non-empty regular expression string")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"{field}: invalid regular expression: {e}") from None
        layers = parse_layer_specs(specs, total_layers, field)
        if not layers:
            raise ConfigError(f"{field}: names no layers")
        out.append((pattern, tuple(layers)))
    return tuple(out)


def validate_recompute(recompute: RecomputeConfig | dict | None, recompute_comm: RecomputeCommConfig | dict | None,
                       total_layers: int) -> RecomputePlan:
    """Check both sections against a model of ``total_layers`` layers (decoder plus MTP) without
    building anything; raise :class:`ConfigError` naming the field, or return the expanded plan."""
    recompute = build_section(RecomputeConfig, recompute, "recompute")
    recompute_comm = build_section(RecomputeCommConfig, recompute_comm, "recompute_comm")
    full: tuple[int, ...] = ()
    select: tuple = ()
    comm: tuple = ()

    if recompute is not None:
        mode = _normalise_mode(recompute.mode)
        if mode == "full":
            if not recompute.full_recompute_layer:
                raise ConfigError("recompute.full_recompute_layer: mode is 'full' but full_recompute_layer "
                                  "is missing or empty")
            full = tuple(parse_layer_specs(recompute.full_recompute_layer, total_layers,
                                           "recompute.full_recompute_layer"))
            if recompute.select_module:
                warnings.warn("recompute.select_module is ignored because recompute.mode is 'full' "
                              "(it applies only with mode: select)", RecomputeWarning, stacklevel=2)
        elif mode == "select":
            if recompute.full_recompute_layer:
                full = tuple(parse_layer_specs(recompute.full_recompute_layer, total_layers,
                                               "recompute.full_recompute_layer"))
            select = _parse_select(recompute.select_module, total_layers, "recompute.select_module",
                                   "mode is 'select'")
        elif recompute.full_recompute_layer or recompute.select_module:
            warnings.warn("recompute.full_recompute_layer / recompute.select_module are ignored because "
                          "recompute.mode is None (set mode: full or select)", RecomputeWarning, stacklevel=2)

    if recompute_comm is not None:
        if not isinstance(recompute_comm.enable, bool):
            raise ConfigError(f"recompute_comm.enable: expected true or false, got {recompute_comm.enable!r}")
        if recompute_comm.enable:
            comm = _parse_select(recompute_comm.select_module, total_layers, "recompute_comm.select_module",
                                 "recompute_comm.enable is true")
        elif recompute_comm.select_module:
            log.info("recompute_comm.enable is false: recompute_comm.select_module is not applied")

    return RecomputePlan(full_layers=full, select=select, comm=comm)

