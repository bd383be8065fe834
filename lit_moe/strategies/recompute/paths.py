"""The addressable paths of a layer: module paths and communication-step attributes, matched by regex."""

from __future__ import annotations

import re
from typing import Iterable, Optional

from torch import nn

from lit_moe.model.names import spellings
from lit_moe.strategies.comm import CommStep


# ----------------------------------------------------------------------------------------------
# the addressable paths of a layer
# ----------------------------------------------------------------------------------------------
def _callable_attributes(module: nn.Module) -> Iterable[tuple[str, CommStep]]:
    """Public instance attributes holding a :class:`~lit_moe.strategies.comm.CommStep`: how the
    parallel steps expose their communication ops (output recompute fills the step's ``recompute``
    slot). Other callables (a core attention's ``context_parallel`` layout) are not communication steps."""
    for name, value in vars(module).items():
        if not name.startswith("_") and isinstance(value, CommStep):
            yield name, value


def addressable_paths(layer: nn.Module) -> dict[str, tuple[nn.Module, Optional[str]]]:
    """Every path a regex can select inside ``layer``: ``path -> (module, None)`` for sub-modules
    and ``path -> (owner module, attribute)`` for callable attributes. Ordered by depth, then name."""
    paths: dict[str, tuple[nn.Module, Optional[str]]] = {}
    for prefix, module in layer.named_modules():
        if prefix:
            paths[prefix] = (module, None)
        for attr, _ in _callable_attributes(module):
            paths[f"{prefix}.{attr}" if prefix else attr] = (module, attr)
    return dict(sorted(paths.items(), key=lambda kv: (kv[0].count("."), kv[0])))


def _under(path: str, parents: Iterable[str]) -> bool:
    return any(path.startswith(p + ".") for p in parents)


def _match(patterns: tuple, layer_id: int, paths: Iterable[str], matched: dict[str, bool]) -> list[str]:
    """Paths of ``layer_id`` fully matched by a pattern that lists this layer; ``matched[pattern]``
    records whether the pattern hit anything anywhere."""
    hits: list[str] = []
    for pattern, layers in patterns:
        if layer_id not in layers:
            continue
        rx = re.compile(pattern)
        # any spelling: MindFormers' ``self_attention.linear_qkv`` selects q_a_proj and kv_a_proj_with_mqa
        found = [p for p in paths if any(rx.fullmatch(s) for s in spellings(p, in_layer=True))]
        matched[pattern] = matched.get(pattern, False) or bool(found)
        hits.extend(p for p in found if p not in hits)
    return hits


def _drop_children(paths: list[str], order: list[str]) -> list[str]:
    """Keep the outermost of nested selections (``order`` is depth-then-name)."""
    kept: list[str] = []
    for p in sorted(paths, key=order.index):
        if not _under(p, kept):
            kept.append(p)
    return kept

