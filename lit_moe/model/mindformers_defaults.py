"""A ``pynative.yaml`` ``model:`` section read with MindFormers' defaults and meanings.

:class:`lit_moe.model.config.DeepseekV3Config` also reads Hugging Face ``config.json`` files (and
lit_moe's own copy of its fields in them), so its dataclass defaults are Hugging Face's DeepSeek-V3
(latent norms on, no MTP layer). A MindFormers config means what MindFormers' code makes of it, so
:func:`read_pynative_model_section` (used by ``lit_moe fit`` and ``--print_config``) fills in the keys
a section leaves out with MindFormers' defaults (:data:`FILLED`; YaRN's original length is
``max_position_embeddings`` there, not ``seq_length``), reads the two keys MindFormers
ignores as it does (``scaling_factor``, ``scoring_func``), and prints one line for every default a
section relies on that lit_moe cannot take from MindFormers (:data:`KEPT`).

MindFormers' defaults are read from mindspore-ai/mindformers: the section goes through
``mindformers/models/deepseek3/configuration_deepseek_v3.py`` (``DeepseekV3Config``: its ``__init__``
defaults, the ``register_mf_model_parameter`` defaults, ``scoring_func`` deleted as useless), then
``config_converter_deepseek_v3.py`` maps Hugging Face names to ``MLATransformerConfig``
(``mindformers/parallel_core/transformer_config.py``, whose defaults fill every other field).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)

# MindFormers' effective defaults where lit_moe's dataclass differs (tests/test_names.py walks every
# field against the whole table, read from the files named above).
MINDFORMERS_DEFAULTS: dict[str, Any] = {
    "num_nextn_predict_layers": 1,        # DeepseekV3Config.__init__
    "max_position_embeddings": 4096,      # DeepseekV3Config.__init__
    "num_key_value_heads": 128,           # DeepseekV3Config.__init__
    "scoring_func": "sigmoid",            # register_mf_model_parameter(moe_router_score_function=...)
    "qk_layernorm": False,                # TransformerConfig
    "scaling_factor": 40.0,               # MLATransformerConfig.rotary_scaling_factor
    # pynative/base_models/gpt/gpt_model.py gives YarnRotaryEmbedding max_position_embeddings as the
    # original length (MLATransformerConfig.original_max_position_embeddings is not read there)
    "original_max_position_embeddings": 4096,
    "mscale": 0.707, "mscale_all_dim": 0.707,  # MLATransformerConfig
    "use_fused_rope": False,              # TransformerConfig.apply_rope_fusion
    "moe_router_load_balancing_type": "sub_seq_aux_loss",  # TransformerConfig
    "moe_grouped_gemm": False,            # TransformerConfig
    "mtp_loss_scaling_factor": None,      # TransformerConfig
    "pad_token_id": 0,                    # TransformerConfig.__post_init__: None -> 0
}

# Absent from a pynative.yaml section: MindFormers' value, not the dataclass's (Hugging Face) one.
FILLED = ("num_nextn_predict_layers", "qk_layernorm", "max_position_embeddings", "mscale", "mscale_all_dim")
# ... and original_max_position_embeddings, absent, is max_position_embeddings (MindFormers' YaRN rule).

# Defaults lit_moe keeps although MindFormers' differ: why, and when a section relies on it (one line).
_Condition = Callable[[dict], bool]
KEPT: dict[str, tuple[str, Optional[_Condition]]] = {
    "num_key_value_heads": ("accepted without effect (MLA has no key/value head groups)", None),
    "use_fused_rope": ("a kernel choice (None: the fused kernel where the device has one), same values", None),
    "moe_router_load_balancing_type": (
        "MindFormers' PyNative router has no 'sub_seq_aux_loss' (it raises 'Unknown aux_loss_type' once the "
        "auxiliary loss is on)", lambda s: float(s.get("moe_aux_loss_coeff", s.get("aux_loss_alpha", 0)) or 0) > 0),
    "moe_grouped_gemm": ("MindFormers' PyNative MoE refuses False (NotImplementedError)", lambda s: True),
    "mtp_loss_scaling_factor": (
        "MindFormers has no default (None fails once MTP is on); 0.3 is DeepSeek-V3's value",
        lambda s: int(s.get("num_nextn_predict_layers", s.get("mtp_num_layers", 1)) or 0) > 0),
    "pad_token_id": ("written to config.json only; MindFormers also masks attention to input ids equal to it "
                     "when the batch has no attention mask", None),
}

# The names a section can give each FILLED / KEPT field (MindFormers' aliases included).
_SPELLINGS = {
    "num_nextn_predict_layers": ("num_nextn_predict_layers", "mtp_num_layers", "num_mtp_layers"),
    "max_position_embeddings": ("max_position_embeddings",),
    "mtp_loss_scaling_factor": ("mtp_loss_scaling_factor", "mtp_loss_factor"),
    "moe_router_load_balancing_type": ("moe_router_load_balancing_type",),
    "moe_grouped_gemm": ("moe_grouped_gemm", "use_gmm"),
    "original_max_position_embeddings": ("original_max_position_embeddings",),
}
_ROPE_DICTS = ("rope_scaling", "rope_parameters")

_WARNED: set[str] = set()


def _note(message: str) -> None:
    if message not in _WARNED:   # the section is read more than once in a run
        _WARNED.add(message)
        log.warning(message)


def _given(section: dict, field: str) -> bool:
    if any(k in section for k in _SPELLINGS.get(field, (field,))):
        return True
    rope_key = {"mscale": "mscale", "mscale_all_dim": "mscale_all_dim",
                "original_max_position_embeddings": "original_max_position_embeddings"}.get(field)
    return rope_key is not None and any(isinstance(section.get(d), dict) and rope_key in section[d]
                                        for d in _ROPE_DICTS)


def _safely(condition: _Condition, section: dict) -> bool:
    try:
        return bool(condition(section))
    except (TypeError, ValueError):   # a bad value: DeepseekV3Config names it in its own error line
        return False


def read_pynative_model_section(section: dict) -> dict:
    """``section`` as MindFormers reads it, ready for ``DeepseekV3Config(**...)``."""
    from lit_moe.model.config import DeepseekV3Config

    out = dict(section)
    defaults = {f: getattr(DeepseekV3Config, f) for f in KEPT}
    # the table is MindFormers' DeepSeek-V3 config's; another family (model_type qwen3_moe, glm4_moe) gets
    # its own defaults (lit_moe.model.families)
    deepseek = out.get("model_type") in (None, "deepseek_v3", "deepseek_mtp")
    if deepseek:
        for field in FILLED:
            if not _given(out, field):
                out[field] = MINDFORMERS_DEFAULTS[field]
        if not _given(out, "original_max_position_embeddings"):   # MindFormers' YaRN original length
            out["original_max_position_embeddings"] = out["max_position_embeddings"]
    # MindFormers ignores scaling_factor (a white-listed key; its YaRN factor is rotary_scaling_factor) and
    # deletes scoring_func (it routes with moe_router_score_function).
    for key, alias in (("scaling_factor", "rotary_scaling_factor"), ("scoring_func", "moe_router_score_function")):
        if key in out:
            value = out.pop(key)
            effective = out.get(alias, MINDFORMERS_DEFAULTS[key])
            if value != effective:
                _note(f"model.{key}: {value!r} has no effect, as in MindFormers (which reads {alias}); "
                      f"{alias} is {effective!r}; write {alias}: {value!r} to use it")
    # (another family without the key has no MTP layers)
    seen = out if deepseek else {"num_nextn_predict_layers": 0, **out}
    for field, (why, relies) in KEPT.items():
        if relies is not None and not _given(out, field) and _safely(relies, seen):
            _note(f"model.{field}: not set; lit_moe uses {defaults[field]!r}, MindFormers' default is "
                  f"{MINDFORMERS_DEFAULTS[field]!r} ({why})")
    return out
