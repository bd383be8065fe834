"""Checkpoints: ``save_path/iteration_XXXXXXXX/`` directories that survive crashes, resume exactly and
load into any parallel layout; Hugging Face import (``load_path``) and export (``convert-hf``).

* :func:`build_checkpoint_callback` — the Lightning callback that saves (and lets the Trainer resume);
* :func:`resolve_load` — what ``checkpoint.load_path`` asks for, as a :class:`LoadPlan`;
* ``lit_moe convert-hf`` — :mod:`lit_moe.hf.convert`.

See ``docs/checkpoint.md`` for the layout and the guarantees.
"""

from lit_moe.checkpoint.callback import IterationCheckpoint, build_checkpoint_callback
from lit_moe.checkpoint.layout import CheckpointError
from lit_moe.checkpoint.resume import LoadPlan, resolve_load

__all__ = ["CheckpointError", "IterationCheckpoint", "LoadPlan", "build_checkpoint_callback", "resolve_load"]
