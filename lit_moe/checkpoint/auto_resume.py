"""Where a ``lit_moe fit`` starts, decided before anything is built.

:func:`resolve_start` runs on every rank of a launch, before the process group exists:

1. **Recovery** of a ``save_path`` left by a crash (the launch leader repairs, the other ranks wait
   until it is repaired): a re-save of an existing step killed between moving the old directory
   aside (``.iteration_N.old.PID``) and putting the new one in place gets the old directory back; a
   save killed between renaming its directory into place and replacing the tracker gets the tracker
   moved to that (complete, verified) directory.
2. **Auto-resume**: with ``checkpoint.load_path`` empty and checkpoints in ``save_path``, the run
   resumes from the tracker exactly as ``load_path: <save_path>`` would, printing
   ``resuming from …/iteration_N, step N``. ``checkpoint.auto_resume: False`` refuses such a
   ``save_path`` instead.
3. A full resume already at the run's last step raises :class:`RunFinished` (the CLI exits 0,
   nothing is written).
4. Nothing fails late: ``save_path`` and the TensorBoard directory must be writable; a save_path
   holding iteration directories newer than the step the run starts from is refused (the run would
   overwrite them); the checkpoint's schedule and optimizer settings are compared with the config's
   (:mod:`lit_moe.checkpoint.compat`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lit_moe.checkpoint.layout import (
    TRACKER,
    CheckpointError,
    iteration_name,
    list_iterations,
    read_tracker,
    write_tracker,
)
from lit_moe.config import CheckpointConfig, ConfigError

OLD_RE = re.compile(r"^\.(iteration_\d{8,})\.old\.\d+$")
RECOVERY_WAIT_S = 120.0


class RunFinished(Exception):
    """The run's checkpoint is already at its last step: nothing to do (the CLI exits 0)."""


def is_launch_leader() -> bool:
    """The one process of a launch that may repair ``save_path`` (global rank 0 under torchrun,
    SLURM and Lightning's launcher; the only process of a single-process run)."""
    for key in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"):
        if os.environ.get(key, "0").strip() not in ("", "0"):
            return False
    return True


def _say(message: str) -> None:
    if is_launch_leader():
        print(f"lit_moe: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# recovery of an interrupted save
# ----------------------------------------------------------------------------------------------
@dataclass
class Repair:
    """What a crashed save left behind: ``restore`` maps a ``.iteration_N.old.*`` directory to the
    ``iteration_N`` it must become again; ``discard`` lists old copies superseded by a complete new
    directory; ``tracker`` is the step the tracker must name (None: it is right)."""

    restore: dict[Path, Path] = field(default_factory=dict)
    discard: list[Path] = field(default_factory=list)
    tracker: Optional[int] = None

    def __bool__(self) -> bool:
        return bool(self.restore or self.discard or self.tracker is not None)


def _complete(path: Path) -> bool:
    from lit_moe.checkpoint.iteration import IterationReader

    try:
        IterationReader(path)
    except (CheckpointError, OSError, KeyError, TypeError, ValueError):
        return False
    return True


def find_repair(save_path: Path) -> Repair:
    """Inspect ``save_path`` (read only)."""
    repair = Repair()
    try:
        entries = sorted(save_path.iterdir())
    except OSError:
        return repair
    for entry in entries:
        m = OLD_RE.match(entry.name)
        if m and entry.is_dir():
            target = save_path / m.group(1)
            if target.is_dir() and target not in repair.restore.values():
                repair.discard.append(entry)  # the new directory made it into place
            else:
                repair.restore[entry] = target
    steps = set(list_iterations(save_path)) | {int(t.name.split("_")[1]) for t in repair.restore.values()}
    tracked = None
    if (save_path / TRACKER).is_file():
        try:
            tracked = read_tracker(save_path)
        except CheckpointError:
            tracked = None  # resolve_load reports an unreadable tracker
        if tracked is None:
            return repair
    newer = sorted((s for s in steps if tracked is None or s > tracked), reverse=True)
    restored = {t: o for o, t in repair.restore.items()}
    for step in newer:
        where = save_path / iteration_name(step)
        if _complete(restored.get(where, where)):
            repair.tracker = step  # renamed into place, killed before the tracker was replaced
            break
    return repair


def apply_repair(save_path: Path, repair: Repair) -> None:
    for old, target in repair.restore.items():
        os.replace(old, target)
        _say(f"recovered {target} from {old.name} (a re-save of step {target.name[10:].lstrip('0') or 0} was "
             "interrupted)")
    for old in repair.discard:
        shutil.rmtree(old, ignore_errors=True)
    if repair.tracker is not None:
        write_tracker(save_path, repair.tracker)
        _say(f"{save_path / TRACKER} set to step {repair.tracker} (its save was interrupted after "
             f"{iteration_name(repair.tracker)} was complete)")


def recover(save_path: Path) -> None:
    """Repair ``save_path`` (leader) or wait until the leader has (other ranks)."""
    if not save_path.is_dir():
        return
    repair = find_repair(save_path)
    if not repair:
        return
    if is_launch_leader():
        apply_repair(save_path, repair)
        return
    deadline = time.monotonic() + RECOVERY_WAIT_S
    while find_repair(save_path):
        if time.monotonic() > deadline:
            raise CheckpointError(f"checkpoint.save_path: {save_path} still needs the repair of an interrupted "
                                  f"save after {RECOVERY_WAIT_S:.0f} s (rank 0 does it at start)")
        time.sleep(0.2)


# ----------------------------------------------------------------------------------------------
# writable directories
# ----------------------------------------------------------------------------------------------
def check_writable(path: str, field_name: str) -> None:
    """``path`` (or, when it does not exist yet, the directory it would be created in) accepts a new
    file. Creates nothing that stays."""
    p = Path(path).expanduser().absolute()
    probe_dir = p
    while not probe_dir.exists():
        if probe_dir.parent == probe_dir:
            break
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise ConfigError(f"{field_name}: {str(path)!r} cannot be created: {probe_dir} is not a directory")
    probe = probe_dir / f".lit_moe_write_probe.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"{field_name}: {str(path)!r} is not writable ({probe_dir}: {err.strerror})") from None


# ----------------------------------------------------------------------------------------------
# the start of a run
# ----------------------------------------------------------------------------------------------
@dataclass
class Start:
    """``checkpoint``: the section with ``load_path`` filled in by auto-resume; ``load``: the
    :class:`~lit_moe.checkpoint.resume.LoadPlan`; ``callbacks``: what the run adds for resilience
    (settings record/override, preemption, lost-rank diagnosis)."""

    checkpoint: CheckpointConfig
    load: Any
    callbacks: list = field(default_factory=list)
    auto_resumed: bool = False


def _holds_checkpoints(save_path: Path) -> bool:
    return (save_path / TRACKER).exists() or bool(list_iterations(save_path))


def resolve_start(checkpoint: CheckpointConfig, model_config: Any = None, *, max_steps: int,
                  lr_section: Optional[dict] = None, optimizer_section: Optional[dict] = None,
                  total_steps: Optional[int] = None, tensorboard_dir: str = "",
                  data_parallel: Optional[int] = None) -> Start:
    """Recovery, auto-resume, the finished-run check and the start-up checks (module docstring).
    ``max_steps``: the step the run stops at (-1: no limit); ``total_steps``: ``training.steps``;
    ``data_parallel``: the run's data-parallel size (must divide a resumed run's consumed samples)."""
    from lit_moe.checkpoint.compat import RunSettings, check_resume_settings, run_settings
    from lit_moe.checkpoint.resume import resolve_load
    from lit_moe.runtime.peers import PeerWatch
    from lit_moe.runtime.preemption import Preemption

    if not isinstance(checkpoint.auto_resume, bool):
        raise ConfigError(f"checkpoint.auto_resume: expected true or false, got {checkpoint.auto_resume!r}")
    if not isinstance(checkpoint.override_schedule, bool):
        raise ConfigError(f"checkpoint.override_schedule: expected true or false, got "
                          f"{checkpoint.override_schedule!r}")
    save = Path(checkpoint.save_path).expanduser() if checkpoint.enable_save and checkpoint.save_path else None
    auto = False
    if save is not None and (save / TRACKER).exists() and not (save / TRACKER).is_file():
        # every save ends by replacing this file: refused now, not after the first save's shards are written
        raise CheckpointError(f"checkpoint.save_path: {save / TRACKER} is not a file (a directory?); the tracker "
                              "file of the saves cannot be written there. Remove it or use another save_path")
    if save is not None and save.is_dir():
        recover(save)
        if not checkpoint.load_path and _holds_checkpoints(save):
            held = f"{save} already holds checkpoints (steps {', '.join(map(str, list_iterations(save)[-3:]))})"
            if not checkpoint.auto_resume:
                raise CheckpointError(f"checkpoint.auto_resume: False, but checkpoint.save_path {held}; use another "
                                      "save_path, remove them, or set auto_resume: True to resume from them")
            if checkpoint.no_load_optim:
                raise CheckpointError(f"checkpoint.no_load_optim: True (fine-tuning) with an empty load_path, but "
                                      f"checkpoint.save_path {held}; auto-resume continues a run (set "
                                      "no_load_optim: False) or fine-tune into another save_path")
            if not (save / TRACKER).exists():
                raise CheckpointError(f"checkpoint.save_path: {save} holds iteration directories but no {TRACKER} "
                                      "and none of them is complete; remove them or use another save_path")
            checkpoint = dataclasses.replace(checkpoint, load_path=str(save))
            auto = True
    load = resolve_load(checkpoint, model_config)
    if auto:
        _say(f"resuming from {load.path}, step {load.step}")
    resuming = load.kind == "resume"
    if resuming and max_steps is not None and max_steps >= 0 and load.step >= max_steps:
        raise RunFinished(f"the run is already finished: {load.path} is at step {load.step} and the run stops at "
                          f"step {max_steps}; nothing to do")
    if checkpoint.enable_save:
        if not checkpoint.save_path:
            raise ConfigError("checkpoint.save_path: must be set when checkpoint.enable_save is True")
        check_writable(checkpoint.save_path, "checkpoint.save_path")
    if tensorboard_dir:
        check_writable(tensorboard_dir, "monitor.tensorboard.output_dir")
    start_step = load.step if resuming else 0
    if save is not None and save.is_dir():
        newer = [s for s in list_iterations(save) if s > start_step]
        if newer:
            raise CheckpointError(
                f"checkpoint.save_path: {save} holds {iteration_name(newer[-1])} of an earlier run, newer than the "
                f"step this run starts from ({start_step}); it would be overwritten. Resume from it, use another "
                "save_path, or remove it")

    state: dict = {}
    if resuming:
        from lit_moe.checkpoint.iteration import IterationReader

        reader = IterationReader(load.path)
        state = reader.trainer_state()
        if not isinstance(state.get("loops"), dict):
            raise CheckpointError(f"checkpoint file corrupted: {load.path / 'common.json'} has no training loop state "
                                  "(loops); it cannot resume a run")
        consumed = reader.common.get("consumed_samples")
        if data_parallel and isinstance(consumed, int) and consumed % data_parallel:
            raise CheckpointError(f"checkpoint.load_path: {load.path} was saved after {consumed} samples, which "
                                  f"{data_parallel} data-parallel ranks cannot split evenly; resume with a "
                                  f"data-parallel size that divides {consumed}")
    if load.kind == "huggingface" and model_config is not None:
        check_hf_config(Path(load.path), model_config)

    callbacks: list = []
    if lr_section is not None and total_steps is not None:
        settings = run_settings(lr_section, optimizer_section or {}, total_steps)
        diffs: list[str] = []
        if resuming:
            diffs = check_resume_settings(state, settings, override=checkpoint.override_schedule,
                                          where=str(load.path), step=load.step)
        callbacks.append(RunSettings(settings, diffs))
    # PeerWatch first: its on_exception names a lost rank (and exits) while Preemption's handler still
    # holds the SIGTERM torchrun's agent sends every survivor; Preemption's on_exception then lets it go.
    callbacks += [PeerWatch(), Preemption()]
    return Start(checkpoint, load, callbacks, auto)


# Keys of a Hugging Face DeepSeek-V3 config.json that fix the architecture and the tensor shapes.
HF_SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                 "num_hidden_layers", "num_attention_heads", "n_shared_experts", "n_routed_experts", "kv_lora_rank",
                 "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "first_k_dense_replace")


def check_hf_config(directory: Path, model_config: Any) -> None:
    """A Hugging Face ``load_path``'s ``config.json`` describes the model the ``model`` section builds:
    one line naming the first field that differs (before anything is allocated)."""
    import json

    from lit_moe.hf.checkpoint import HFCheckpointError, hf_config_dict

    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"checkpoint.load_path: {path} is missing (a Hugging Face directory needs its "
                              "config.json)")
    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"checkpoint file corrupted: {path} ({type(err).__name__})") from None
    try:
        ours = hf_config_dict(model_config)
    except HFCheckpointError:
        return  # a model Hugging Face cannot describe: the weight loader names the mismatched tensors
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint file corrupted: {path} does not hold a mapping")
    archs = saved.get("architectures")
    if isinstance(archs, list) and archs and "DeepseekV3ForCausalLM" not in archs:
        raise CheckpointError(f"checkpoint.load_path: {path} has architectures {archs}, the model section builds "
                              "DeepseekV3ForCausalLM")
    for key in HF_SHAPE_KEYS:
        if key in saved and saved[key] != ours.get(key):
            field = "model.model_type" if key == "model_type" else f"model.{key}"
            raise CheckpointError(f"checkpoint.load_path: {path} has {key} {saved[key]!r} but {field} gives "
                                  f"{ours.get(key)!r}")
