"""Where metrics go: the built-in TensorBoard dashboards plus any Lightning logger named under
``trainer.logger`` (``CSVLogger``, ``WandbLogger(offline=True)``, ``MLFlowLogger`` with a
``file:`` tracking URI, ...), all receiving the same metric names at the same optimizer steps.

* :func:`build_logger` makes the TensorBoard logger of ``monitor.tensorboard``: each run writes into
  its own ``<output_dir>/<name>/version_<n>`` directory (Lightning's layout), so a rerun is a new
  run in TensorBoard instead of events merged into the last one.
* :func:`combine_loggers` puts the ``trainer.logger`` loggers beside it.
* :class:`LoggerBridge` is the callback that makes the callbacks' ``add_scalar`` calls reach every
  logger: :func:`metrics_writer` gives them a writer that forwards to TensorBoard's SummaryWriter and
  collects the scalars of each step, which the bridge hands to the other loggers as one
  ``log_metrics(metrics, step)`` call per step (one CSV row, one MLflow batch). TensorBoard-only
  items (the ``"<tag> vs samples"`` variants, images, text) stay in TensorBoard. It also records the
  resolved configuration as hyperparameters in every logger when training starts.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Optional

from lightning.pytorch import Callback

TENSORBOARD_RUN_NAME = "lit_moe"
"""The run name under ``monitor.tensorboard.output_dir`` (Lightning's ``name``; versions below it)."""

VS_SAMPLES = " vs samples"

HPARAMS_METRICS = ("train/loss", "val/loss")
"""The metric columns of TensorBoard's HPARAMS table (read from the run's scalars)."""


def build_logger(monitor: Any) -> Optional[Any]:
    """The run's TensorBoardLogger under ``monitor.tensorboard.output_dir``, in a new
    ``lit_moe/version_<n>`` directory per run; None when ``output_dir`` is empty. Our callbacks write
    to it with the optimizer step as x-axis."""
    tb = monitor.tensorboard   # (log_interval is checked by build_callbacks, which uses it)
    if not tb.output_dir:
        return None
    queue = tb.queue_size   # an int >= 1, as MindFormers'
    if isinstance(queue, bool) or not isinstance(queue, int) or queue < 1:
        from lit_moe.config import ConfigError

        raise ConfigError(f"monitor.tensorboard.queue_size: must be an int >= 1, got {queue!r}")
    return _tensorboard_logger_class()(save_dir=tb.output_dir, name=TENSORBOARD_RUN_NAME,
                                       default_hp_metric=False, max_queue=queue)


@functools.lru_cache(maxsize=None)
def _tensorboard_logger_class():
    """Lightning's TensorBoardLogger with the event file opened once (defined when first needed:
    importing Lightning's loggers is slow)."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from lightning.pytorch.loggers.logger import rank_zero_experiment

    class OneOpenTensorBoardLogger(TensorBoardLogger):
        """Lightning's TensorBoardLogger whose event file is opened once (:func:`keep_event_file_open`)."""

        @property
        @rank_zero_experiment
        def experiment(self) -> Any:
            writer = super().experiment
            keep_event_file_open(writer)
            return writer

    return OneOpenTensorBoardLogger


class _EventFile:
    """An event file kept open for appending (what TensorFlow's own ``GFile`` does)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "ab")

    def write(self, data: bytes) -> None:
        self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    @property
    def closed(self) -> bool:
        return self._file.closed


def keep_event_file_open(writer: Any) -> None:
    """Without TensorFlow, TensorBoard writes events through its pure-Python ``gfile`` stub, whose
    ``GFile.write`` on a local path opens the file again in append mode for every record (1,000 opens
    for 1,000 scalars: a metadata operation each on a shared file system). The local event file of
    torch's ``SummaryWriter`` is switched to one file handle kept open; other file systems (S3, ...)
    and TensorFlow's own ``GFile`` are left as they are."""
    file_writer = getattr(writer, "file_writer", None)   # torch.utils.tensorboard's; None once closed
    if file_writer is None or getattr(writer, "all_writers", None) is None:
        return
    try:
        from tensorboard.compat.tensorflow_stub.io import gfile as stub
    except ImportError:  # pragma: no cover - tensorboard without its stub
        return
    event_writer = file_writer.event_writer
    async_writer = getattr(event_writer, "_async_writer", None)
    records = getattr(async_writer, "_writer", None)          # tensorboard's RecordWriter
    sink = getattr(records, "_writer", None)
    if not (isinstance(sink, stub.GFile) and isinstance(sink.fs, stub.LocalFileSystem)) or sink.closed:
        return
    event_writer.flush()                       # the queue drained: the writer thread holds no record
    with async_writer._lock:                   # no record enqueued while the file changes
        path = sink.filename.decode() if isinstance(sink.filename, bytes) else sink.filename
        records._writer = _EventFile(path)     # appends after what the GFile wrote (the file header)
        sink.close()


def combine_loggers(builtin: Optional[Any], user: Any) -> list[Any]:
    """The built-in TensorBoard logger (if any) followed by the ``trainer.logger`` value: a logger,
    a list of loggers, or True/False/None (no extra logger). ``trainer.logger: false`` turns off only
    the extra loggers; the dashboards follow ``monitor.tensorboard.output_dir``."""
    from lightning.pytorch.loggers import Logger

    from lit_moe.config import ConfigError

    loggers = [builtin] if builtin is not None else []
    if user is None or isinstance(user, bool):
        return loggers
    extra = list(user) if isinstance(user, Iterable) and not isinstance(user, (str, dict)) else [user]
    for lg in extra:
        if not isinstance(lg, Logger):
            raise ConfigError(f"trainer.logger: {lg!r} is not a Lightning logger; give "
                              "{class_path: lightning.pytorch.loggers.CSVLogger, init_args: {...}} or a list of them")
    return loggers + extra


def tensorboard_logger(trainer: Any) -> Optional[Any]:
    from lightning.pytorch.loggers import TensorBoardLogger

    for lg in getattr(trainer, "loggers", None) or []:
        if isinstance(lg, TensorBoardLogger):
            return lg
    return None


def tensorboard_log_dir(trainer: Any) -> Optional[str]:
    """The TensorBoard run directory (``<output_dir>/<name>/version_<n>``), or None without TensorBoard."""
    lg = tensorboard_logger(trainer)
    return lg.log_dir if lg is not None else None


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


class MetricsWriter:
    """A SummaryWriter look-alike: ``add_scalar`` goes to TensorBoard (when on) and is collected for
    the other loggers; everything else (images, text, the file writer) is TensorBoard's, a no-op
    without it."""

    def __init__(self, tensorboard: Any, bridge: "LoggerBridge") -> None:
        self.tensorboard = tensorboard
        self._bridge = bridge

    def add_scalar(self, tag: str, scalar_value: Any, global_step: Optional[int] = None, **kwargs: Any) -> None:
        if self.tensorboard is not None:
            self.tensorboard.add_scalar(tag, scalar_value, global_step=global_step, **kwargs)
        if not tag.endswith(VS_SAMPLES):
            self._bridge.collect(tag, float(scalar_value), global_step)

    def __getattr__(self, name: str) -> Any:
        if self.tensorboard is None:
            return _noop
        return getattr(self.tensorboard, name)


class LoggerBridge(Callback):
    """Hands the scalars written through :func:`metrics_writer` to every non-TensorBoard logger, one
    ``log_metrics`` call per optimizer step, and logs ``hparams`` (the resolved config) to all
    loggers when training starts.

    Args:
        hparams: the resolved configuration (nested dict); None records nothing.
    """

    def __init__(self, hparams: Optional[dict] = None) -> None:
        self.hparams = hparams
        self._pending: dict[int, dict[str, float]] = {}
        self._others: list[Any] = []
        self._writer: Optional[MetricsWriter] = None

    # -- writing ---------------------------------------------------------------------------
    def writer(self, trainer: Any) -> Optional[MetricsWriter]:
        if not getattr(trainer, "is_global_zero", True):
            return None
        tb = tensorboard_logger(trainer)
        self._others = [lg for lg in getattr(trainer, "loggers", None) or [] if lg is not tb]
        if tb is None and not self._others:
            return None
        experiment = tb.experiment if tb is not None else None
        if self._writer is None or self._writer.tensorboard is not experiment:
            self._writer = MetricsWriter(experiment, self)
        return self._writer

    def collect(self, tag: str, value: float, step: Optional[int]) -> None:
        if not self._others:
            return
        step = int(step or 0)
        for older in [s for s in self._pending if s < step]:   # a later step started: the older is complete
            self._flush_step(older)
        self._pending.setdefault(step, {})[tag] = value

    def _flush_step(self, step: int) -> None:
        metrics = self._pending.pop(step, None)
        if metrics:
            for lg in self._others:
                lg.log_metrics(metrics, step=step)

    def flush(self) -> None:
        for step in sorted(self._pending):
            self._flush_step(step)

    # -- hooks ----------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.hparams is None or not trainer.is_global_zero:
            return
        params = hyperparameters(self.hparams)
        for lg in trainer.loggers:
            lg.log_hyperparams(params)
        tb = tensorboard_logger(trainer)
        if tb is not None:
            # Lightning writes TensorBoard's HPARAMS record only together with a metric value; write it
            # here with the run's own loss tags as its metric columns (their values are the scalars)
            from torch.utils.tensorboard.summary import hparams as hparams_summary

            file_writer = tb.experiment._get_file_writer()
            for summary in hparams_summary(params, {tag: 0.0 for tag in HPARAMS_METRICS}):
                file_writer.add_summary(summary)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.flush()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.flush()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.flush()


def hyperparameters(config: dict) -> dict[str, Any]:
    """The resolved config flattened to ``section/key`` → scalar (lists and other values as their
    string), what every logger's ``log_hyperparams`` accepts."""
    from lit_moe.config import to_dict

    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}" if prefix else str(k), v)
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[prefix] = "null" if value is None else value
        else:
            out[prefix] = str(value)

    walk("", to_dict(config))
    return out


def metrics_writer(trainer: Any) -> Any:
    """What the callbacks write scalars to, on global rank 0 (None elsewhere or with no logger): the
    :class:`LoggerBridge`'s writer when the run has one, else the TensorBoard SummaryWriter."""
    if not getattr(trainer, "is_global_zero", True):
        return None
    for cb in getattr(trainer, "callbacks", None) or []:
        if isinstance(cb, LoggerBridge):
            return cb.writer(trainer)
    tb = tensorboard_logger(trainer)
    return tb.experiment if tb is not None else None
