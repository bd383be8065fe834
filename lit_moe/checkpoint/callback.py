"""``IterationCheckpoint``: the Lightning callback that writes ``save_path/iteration_XXXXXXXX/``.

It saves after every ``save_interleaved_steps``-th optimizer step and once more at the end of
training (unless that step was just saved), never after an exception. With ``async_save`` the
tensors are copied to CPU memory, the files are written by a background thread while training goes
on, and the tracker is replaced when every rank has finished; the next save (and the end of
training) waits for the previous one first.

Resuming from such a directory (``trainer.fit(ckpt_path=iteration_dir)``) is the strategy's job
(:class:`lit_moe.checkpoint.resume.IterationResume`); the checkpoint dict it returns carries this
rank's RNG state, which this callback restores in ``on_load_checkpoint``.

Exact resume of random draws (dropout) then needs that nothing draws from the global generators
between the restore and the first step. Lightning builds the training data iterator in between, and
a ``torch.utils.data.DataLoader`` iterator draws its workers' base seed from the loader's
``generator``, or from the global generator when it has none: lit_moe's loaders have their own
(``MegatronDataLoader``; the threaded loader draws nothing). ``on_train_start`` checks that the
generators are still where the checkpoint left them and warns, in one line, when a draw came in
between (e.g. a user's DataLoader without a ``generator``): the run goes on, but its random draws
no longer repeat the uninterrupted run's.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch import Callback

from lit_moe.checkpoint import safejson
from lit_moe.checkpoint.comm import Comm
from lit_moe.checkpoint.iteration import (
    SaveJob,
    fqn_optimizer_state,
    make_common,
    prepare,
    rng_state,
    set_rng_state,
    split_optimizer_state,
    write_and_commit,
)
from lit_moe.checkpoint.layout import iteration_name, read_tracker
from lit_moe.checkpoint.resume import RNG_STATE
from lit_moe.checkpoint.sharded import assign_writers, pieces_of, stage
from lit_moe.config import CheckpointConfig, ConfigError
from lit_moe.data import MegatronDataModule
from lit_moe.step import StepStrategy

log = logging.getLogger(__name__)


def check_save_config(cfg: CheckpointConfig) -> None:
    """The ``checkpoint`` fields that saving uses, checked before anything starts."""
    if not cfg.enable_save:
        return
    if not cfg.save_path or not str(cfg.save_path).strip():
        raise ConfigError("checkpoint.save_path: must be set when checkpoint.enable_save is True")
    for name in ("save_interleaved_steps", "save_max"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"checkpoint.{name}: must be a positive integer, got {value!r}")
    if cfg.prefix is not None and (not isinstance(cfg.prefix, str) or "/" in cfg.prefix or "\\" in cfg.prefix):
        raise ConfigError(f"checkpoint.prefix: must be a file-name prefix without path separators, got {cfg.prefix!r}")
    path = Path(cfg.save_path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"checkpoint.save_path: {str(path)!r} exists and is not a directory")


def check_hf_export(cfg: CheckpointConfig, model_config: Any) -> None:
    """``checkpoint.save_hf_at_end``, checked before training rather than after it."""
    if not cfg.save_hf_at_end:
        return
    from lit_moe.hf.checkpoint import HFCheckpointError, _parse_size, export_problems

    if not cfg.enable_save:
        raise ConfigError("checkpoint.save_hf_at_end: needs checkpoint.enable_save: True (the export is made from the "
                          "final iteration directory)")
    out = Path(cfg.save_hf_at_end)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ConfigError(f"checkpoint.save_hf_at_end: {str(out)!r} already exists and is not an empty directory "
                          "(nothing saved is overwritten)")
    try:
        _parse_size(cfg.save_hf_max_shard_size)
    except HFCheckpointError as err:
        raise ConfigError(f"checkpoint.save_hf_{err}") from None
    problems = export_problems(model_config)
    if problems:
        raise ConfigError(f"checkpoint.save_hf_at_end: this model has no Hugging Face DeepSeek-V3 form: {problems[0]}")


def check_shared_directory(comm: Comm, path: Path, field_name: str, wait_s: float = 5.0) -> None:
    """Every rank sees the same ``path`` (one shared file system), found at start-up rather than at the
    first save (step ``save_interleaved_steps``, 1,000 by default): rank 0 writes a token file there,
    every rank looks for it after the broadcast of its name (two small collectives, one file written,
    one stat per rank). A rank that does not see it retries for ``wait_s`` seconds (the attribute
    caches of NFS-like file systems) before the run stops in one line naming the ranks."""
    if not comm.enabled:
        return
    token = None
    if comm.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        for stale in path.glob(".lit_moe_shared_*"):   # left by a run killed during this check
            stale.unlink(missing_ok=True)
        token = f".lit_moe_shared_{uuid.uuid4().hex}"
        (path / token).write_text(token)
    token = comm.broadcast(token)
    marker = path / token
    deadline = time.monotonic() + wait_s
    while not marker.is_file() and time.monotonic() < deadline:
        time.sleep(0.2)
    seen = comm.all_gather(marker.is_file())
    if comm.rank == 0:
        marker.unlink(missing_ok=True)
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        ranks = ", ".join(map(str, blind[:8])) + (f" (and {len(blind) - 8} more)" if len(blind) > 8 else "")
        raise ConfigError(f"{field_name}: {str(path)!r} is not one directory shared by every rank: rank"
                          f"{'s' if len(blind) > 1 else ''} {ranks} do{'es' if len(blind) == 1 else ''} not see "
                          "the file rank 0 wrote there (a node-local disk?); use a directory on a file system "
                          "all nodes share")


class IterationCheckpoint(Callback):
    """Save (and resume from) MindFormers-style iteration directories. See the module docstring."""

    def __init__(self, cfg: CheckpointConfig, global_batch_size: Optional[int] = None) -> None:
        check_save_config(cfg)
        self.cfg = cfg
        self.global_batch_size = global_batch_size  # recorded in common.json (None: not recorded)
        self.save_path = Path(cfg.save_path) if cfg.save_path else None
        self._comm: Optional[Comm] = None
        self._saved_this_run: list[int] = []
        self._last_saved: Optional[int] = None
        self._failed = False
        self._thread: Optional[threading.Thread] = None
        self._thread_error: Optional[BaseException] = None
        self._restored_rng: Optional[str] = None  # the generators as restored (checked at train start)

    # ------------------------------------------------------------------------------------------
    # hooks
    # ------------------------------------------------------------------------------------------
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self.cfg.enable_save and self._comm is None:
            # collective: every rank runs setup
            strategy = trainer.strategy
            self._comm = Comm.create(strategy.collective_timeout if isinstance(strategy, StepStrategy) else None)
            check_shared_directory(self._comm, self.save_path, "checkpoint.save_path")

    def on_load_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(RNG_STATE)  # None: written by another number of ranks (nothing to restore)
        if state is not None:
            set_rng_state(state)
            self._restored_rng = safejson.dumps(rng_state())

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._restored_rng is not None:
            if safejson.dumps(rng_state()) != self._restored_rng:
                warnings.warn(
                    "lit_moe: something drew from the global random generators between restoring the "
                    "checkpoint and the first step (a DataLoader without its own `generator`?): the resumed "
                    "run's random draws (dropout) will not repeat the uninterrupted run's", stacklevel=2)
            self._restored_rng = None
        step = trainer.global_step
        if self.cfg.enable_save and step > 0 and (self.save_path / iteration_name(step)).is_dir():
            self._last_saved = step  # resumed from this very directory: no duplicate final save
        if self.cfg.enable_save and trainer.is_global_zero and self.save_path.is_dir():
            for debris in self.save_path.glob(".iteration_*.tmp"):
                shutil.rmtree(debris, ignore_errors=True)  # a save killed by an earlier run

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self.cfg.enable_save and step % self.cfg.save_interleaved_steps == 0:
            self.save(trainer, step)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.cfg.enable_save and not self._failed and trainer.global_step != self._last_saved:
            self.save(trainer, trainer.global_step)
        self.wait()
        if self.cfg.save_hf_at_end and self.cfg.enable_save and not self._failed and trainer.global_step > 0:
            self.export_hf(pl_module, trainer.global_step)

    def export_hf(self, pl_module: "pl.LightningModule", step: int) -> None:
        """``save_hf_at_end``: rank 0 rebuilds the model from iteration ``step`` (every rank's pieces, any
        layout) and writes the Hugging Face directory; the others wait for its outcome."""
        from lit_moe.hf.convert import export_atomically, model_from_checkpoint

        comm = self._comm or Comm(None)
        comm.barrier()   # every rank's files of the final iteration are committed
        error = None
        if comm.rank == 0:
            try:
                model = model_from_checkpoint(pl_module.model_config, getattr(pl_module, "lora", None),
                                              self.save_path / iteration_name(step))
                export_atomically(model, Path(self.cfg.save_hf_at_end), self.cfg.save_hf_max_shard_size)
            except Exception as err:  # reported on every rank, in one line
                error = f"{type(err).__name__}: {err}"
        error = comm.broadcast(error)
        if error is not None:
            raise ConfigError(f"checkpoint.save_hf_at_end: the export of iteration {step} failed: {error}")

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._failed = True
        try:
            self.wait()  # an asynchronous save already staged still completes
        except Exception as err:  # the run's own exception is the one to report
            log.error("lit_moe: an asynchronous checkpoint save failed: %s", err)

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def state_dict(self) -> dict[str, Any]:
        return {}  # save_max counts the directories of one run only: nothing carries over

    # ------------------------------------------------------------------------------------------
    # saving
    # ------------------------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until the previous asynchronous save has committed; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._thread_error is not None:
            err, self._thread_error = self._thread_error, None
            raise err

    def save(self, trainer: "pl.Trainer", step: int) -> None:
        self.wait()
        comm = self._comm or Comm(None)
        cfg = self.cfg
        module = trainer.lightning_module
        dumped = trainer._checkpoint_connector.dump_checkpoint(weights_only=cfg.no_save_optim)
        model = pieces_of(dumped.pop("state_dict"))
        optim, optim_extra, groups = None, {}, []
        osds = dumped.pop("optimizer_states", None)
        if not cfg.no_save_optim:
            optim = {}
            for i, (osd, opt) in enumerate(zip(osds or [], trainer.optimizers)):
                osd = fqn_optimizer_state(osd, opt, module)
                tensors, other = split_optimizer_state(i, osd)
                optim.update(pieces_of(tensors))
                optim_extra.update(other)
                groups.append([dict(g) for g in osd["param_groups"]])
        if groups and comm.enabled:
            groups = _all_ranks_param_groups(comm.all_gather(groups))
        if cfg.remove_redundancy and comm.enabled:
            keep = assign_writers(comm, model)
            model = {k: v for k, v in model.items() if k in keep}
            if optim is not None:
                keep = assign_writers(comm, optim)
                optim = {k: v for k, v in optim.items() if k in keep}
        if cfg.async_save:
            model = stage(model)
            optim = stage(optim) if optim is not None else None
        common = None
        if comm.rank == 0:
            common = make_common(step, comm.world, cfg.prefix, optim is not None, trainer_state=dumped,
                                 optimizers=groups, extra=self._run_facts(trainer))
        job = SaveJob(self.save_path, step, cfg.prefix, model, optim, optim_extra,
                      rng_json=safejson.dumps(rng_state()), common=common,
                      on_committed=self._prune if comm.rank == 0 else None)
        job.most_bytes = prepare(comm, self.save_path, step, job.nbytes)
        self._last_saved = step
        if cfg.async_save:
            self._thread = threading.Thread(target=self._run_async, args=(comm, job), name=f"lit_moe-save-{step}",
                                            daemon=False)
            self._thread.start()
        else:
            write_and_commit(comm, job)

    def _run_async(self, comm: Comm, job: SaveJob) -> None:
        try:
            write_and_commit(comm, job)
        except BaseException as err:  # re-raised in the training thread by wait()
            self._thread_error = err

    def _prune(self, step: int) -> None:
        """Rank 0, after ``step`` was committed: keep the newest ``save_max`` directories of this run."""
        self._saved_this_run.append(step)
        try:
            current = read_tracker(self.save_path)
        except Exception:
            current = step
        while len(self._saved_this_run) > self.cfg.save_max:
            oldest = self._saved_this_run.pop(0)
            if oldest != current:
                shutil.rmtree(self.save_path / iteration_name(oldest), ignore_errors=True)

    def _run_facts(self, trainer: "pl.Trainer") -> dict:
        """MindFormers' common.json facts (informative; resume uses the Lightning state)."""
        facts: dict[str, Any] = {"epoch_num": trainer.current_epoch}
        if self.global_batch_size is not None:
            facts["global_batch_size"] = int(self.global_batch_size)
        dm = trainer.datamodule
        if isinstance(dm, MegatronDataModule):
            # the loader's position (what the saved loop state resumes from), not step x global batch:
            # a global batch that is no multiple of local batch x data parallel drops its remainder
            facts["consumed_samples"] = dm.consumed_samples
        if isinstance(trainer.strategy, StepStrategy):
            facts["layout"] = trainer.strategy.parallel_degrees()
        return facts


def build_checkpoint_callback(cfg: CheckpointConfig, global_batch_size: Optional[int] = None
                              ) -> Optional[IterationCheckpoint]:
    """The checkpoint callback of a run, or None when it neither saves nor resumes.
    ``global_batch_size`` (``training.global_batch_size``): recorded in common.json."""
    if not cfg.enable_save and not cfg.load_path:
        return None
    return IterationCheckpoint(cfg, global_batch_size)


def _all_ranks_param_groups(per_rank: list[list[list[dict]]]) -> list[list[dict]]:
    """Every rank's parameter names in each group (rank 0's hyper-parameters): pipeline stages
    hold different parameters, and a run under another layout loads the names it holds."""
    merged = [[dict(g) for g in opt_groups] for opt_groups in per_rank[0]]
    for rank_groups in per_rank[1:]:
        for opt, opt_groups in zip(merged, rank_groups):
            for group, other in zip(opt, opt_groups):
                seen = set(group["params"])
                group["params"] = list(group["params"]) + [p for p in other["params"] if p not in seen]
    return merged
