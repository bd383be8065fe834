"""The config keys that name parameters, checked against the model a config builds, before training.

``optimizer.weight_decay_include`` / ``weight_decay_exclude`` / ``adamw_include``,
``lora_config.target_modules`` / ``exclude_layers`` and ``monitor.train_state.local_norm`` /
``device_norm`` are matched against every parameter (or module) of the whole model, on the meta
device, in every spelling of ``lit_moe.model.names.spellings`` (lit_moe's, MindFormers' and Hugging
Face's); a pattern that matches nothing is one :class:`~lit_moe.config.ConfigError` line naming the
key, the pattern and the nearest names. (``recompute.select_module`` paths are checked when recompute
is applied, after the parallel steps have added their communication functions.)
"""

from __future__ import annotations

from typing import Any, Optional

import torch


def _get(section: Any, key: str) -> Any:
    if section is None:
        return None
    return section.get(key) if isinstance(section, dict) else getattr(section, key, None)


def check_name_keys(model_config: Any, optimizer_section: Optional[dict], lora_section: Any,
                    monitor: Any) -> None:
    """Raise :class:`~lit_moe.config.ConfigError` for the first name pattern that matches nothing."""
    from lit_moe.callbacks.train_state import check_norm_filters
    from lit_moe.lora import apply_lora, lora_settings
    from lit_moe.model import DeepseekV3ForCausalLM
    from lit_moe.model.names import canonical_name
    from lit_moe.optim.optimizers import check_rules, validate_optimizer_section

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(model_config)
    lora = lora_settings(lora_section)
    if lora is not None:
        apply_lora(model, lora)   # its own error for target_modules matching nothing
    names = [canonical_name(n) for n, _ in model.named_parameters()]
    check_rules(validate_optimizer_section(optimizer_section), names)
    train_state = _get(monitor, "train_state")
    if train_state is not None:
        check_norm_filters(train_state, names)
