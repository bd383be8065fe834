"""Parameter names as the model defines them, whatever wraps it.

Activation checkpointing, FSDP1 and ``torch.compile`` insert a component into parameter names;
initialisation, optimizer rules and checkpoints are written against the model's own names. A leaf
module (the model, the optimizer and the checkpoints import it).
"""

from __future__ import annotations

WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """Parameter name without activation-checkpoint / FSDP1 / compile wrapper parts."""
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    return name
