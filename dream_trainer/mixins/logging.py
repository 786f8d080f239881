"""LoggingMixin: the run directory, metric aggregation without per-step syncs, `callback_metrics`,
loggers, the non-finite loss check, epoch summary.

It sits above `OptimizationMixin` (it logs the optimizer's `non_finite_counts`, and gives the
`ReduceLROnPlateau` scheduler its metrics through `_latest_metrics`) and `MetricsMixin` (torchmetrics
are computed and logged with the other metrics); see `dream_trainer.mixins.core` for the layers.

The run directory (`run_dir`, which `log_dir` is and `checkpoint_dir` lies in) is owned here, the
lowest layer that writes files: this mixin claims a new one or takes over an existing one, holds its
lock and keeps its `run.json`; which run a resume continues is `CheckpointMixin`'s decision.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from dream_trainer.errors import ConfigError, DreamTrainerError, NonFiniteGradientError
from dream_trainer.loggers.base import Logger
from dream_trainer.loggers.tensorboard import TensorBoardLogger
from dream_trainer.mixins.metrics import MetricsMixin
from dream_trainer.mixins.optimization import OptimizationMixin
from dream_trainer.utils.aggregation import MetricAggregator
from dream_trainer.utils.images import to_uint8_images
from dream_trainer.utils.non_finite import SETTINGS_HELP, non_finite_losses, weights_are_finite
from dream_trainer.utils.run_dirs import (
    RunInUseError,
    RunLock,
    check_writable,
    claim_run_dir,
    new_record,
    next_free_run_dir,
    now,
    read_record,
    write_config,
    write_record,
)

_T = TypeVar("_T")


def _fmt(value: float) -> str:
    return f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3e}"


class LoggingMixin(OptimizationMixin, MetricsMixin):
    """Collects metrics from step outputs and `self.log`, reduces them only at log time.

    Training metrics are averaged over each logging interval (`log_every_n_steps`) and over the
    epoch; validation metrics are averaged over the validation run, weighted by batch size. The
    reduced floats go to `trainer.callback_metrics` (what callbacks such as early stopping read)
    and, on global rank zero, to every logger.
    """

    def _init_logging(self) -> None:
        self._train_metrics = MetricAggregator()
        self._val_metrics = MetricAggregator()
        self._metrics: dict[str, float] = {}
        self._pending_logs: list[tuple[int, dict[str, Any]]] = []
        self._loggers_attached = False
        loggers = self.config.loggers
        self._loggers: list[Logger] = [TensorBoardLogger()] if loggers is None else list(loggers)
        # Set by EvaluationMixin while an evaluation runs: where `self.log` sends values.
        self._in_validation: bool = False
        self._eval_phase: str = "val"  # the torchmetrics phase of the running evaluation ("val" or "test")
        self._val_batch_size: int = 1
        self._epoch_started_at = time.perf_counter()
        self._val_ran_in_epoch: dict[str, float] = {}
        # The run directory (see `run_dir`).
        self._run_dir: Path | None = None
        self._run_lock: RunLock | None = None  # rank zero's lock on the run while it trains
        self._run_claimed: bool = False  # this trainer created the run directory (vs continued one)
        # The non-finite loss check at logging points (see `_check_logged_loss`).
        self._watch_loss: bool = self.config.non_finite_loss != "ignore"
        self._interval_start: int = 0  # global_step when the current logging interval began
        self._skipped_at_flush: int = 0  # non_finite_counts["skipped"] at the last logging point
        self._warned_non_finite: bool = False

    # --- the run directory ------------------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        """This run's directory, `<root_dir>/<run name>`: its checkpoints, logs, `config.yaml` and
        `run.json`. A new run claims the next free `version_N` (or `run_name`, then `run_name-v1`, ...)
        and no later run writes into it; `fit(ckpt_path="last")` continues the newest run in its own
        directory. Decided when `fit()` starts (printed on stderr); read before that on one process,
        it claims a new run at once. With several processes the ranks agree on it when `fit()` (or
        `validate()`, ...) starts: read earlier, it is the directory a new run would get now, claimed
        by nothing (a property cannot make the ranks agree)."""
        if self._run_dir is None:
            if self.is_distributed:
                return next_free_run_dir(self._root, self.config.run_name)
            self._claim_new_run()
            self._announce_run(f"run directory {self._run_dir}")
        assert self._run_dir is not None
        return self._run_dir

    @property
    def log_dir(self) -> Path:
        """This run's log directory, shared by every logger and by callbacks that write files: the run
        directory itself (`trainer.run_dir`), as Lightning's `version_N` folder."""
        return self.run_dir

    @property
    def _root(self) -> Path:
        return Path(os.fspath(self.config.root_dir))

    def _root_error(self, exc: OSError) -> ConfigError:
        return ConfigError(
            f"{type(self.config).__name__}.root_dir = {os.fspath(self.config.root_dir)!r}: cannot create a run "
            f"directory there ({exc.strerror or exc}). Make it writable, or choose another root_dir."
        )

    def _check_root_writable(self) -> None:
        """Before anything is built: fail now if no run directory can be created under `root_dir`."""
        if self._run_dir is not None:
            return
        try:
            check_writable(self._root)
        except OSError as exc:
            raise self._root_error(exc) from exc

    def _claim_new_run(self, **record: Any) -> None:
        """Create a new run directory (never one that exists), lock it, write `run.json` and `config.yaml`."""
        if not self.is_global_zero:  # only rank zero writes: a rank on its own names the run, creates nothing
            self._run_dir = next_free_run_dir(self._root, self.config.run_name)
            self._run_claimed = True
            return
        try:
            path = claim_run_dir(self._root, self.config.run_name)
            self._take_run(path)
            write_record(
                path,
                new_record(
                    path.name,
                    id=uuid.uuid4().hex,
                    strategy=self.strategy,
                    world_size=self.world_size,
                    **record,
                ),
            )
            write_config(path, self.config.to_dict())
        except OSError as exc:
            raise self._root_error(exc) from exc
        self._run_claimed = True

    def _continue_run(self, path: Path, checkpoint: Path) -> None:
        """Take over the existing run at `path` (to resume it from `checkpoint`): its lock, and a line in
        its `run.json`. Raises `DreamTrainerError` when another live process holds the run."""
        self._take_run(path)
        self._run_claimed = False
        if not self.is_global_zero:
            return
        record = read_record(path)
        previous = record.get("resumes")
        resumes: list[Any] = previous if isinstance(previous, list) else []
        resumes.append({"time": now(), "checkpoint": str(checkpoint), "pid": os.getpid(), "strategy": self.strategy})
        record.update(resumes=resumes, status="running")
        try:
            write_record(path, record)
        except OSError as exc:
            raise self._root_error(exc) from exc

    def _take_run(self, path: Path) -> None:
        if not self.is_global_zero:  # rank zero holds the lock for the whole job
            self._run_dir = path
            return
        lock = RunLock(path)
        try:
            lock.acquire()
        except RunInUseError as held:
            raise DreamTrainerError(
                f"run {str(path)!r} is in use: {held} holds its lock. Two processes never train one run: "
                "wait for that one to end, start a new run (fit() without ckpt_path), or give this one "
                "another run_name."
            ) from None
        if self._run_lock is not None:
            self._run_lock.release()
        self._run_lock = lock
        self._run_dir = path

    def _abandon_run(self) -> None:
        """Give up a run this trainer claimed but did not use (another run is continued instead)."""
        from dream_trainer.utils.run_dirs import abandon_if_unused

        if self._run_dir is not None and self._run_claimed and not self._loggers_attached:
            if self._run_lock is not None:
                self._run_lock.release()
                self._run_lock = None
            abandon_if_unused(self._run_dir)
            self._run_dir = None
            self._run_claimed = False

    def _end_run(self, status: str) -> None:
        """End of fit: record how the run ended and release its lock (rank zero holds it)."""
        lock, self._run_lock = self._run_lock, None
        if lock is None or self._run_dir is None:
            return
        try:
            record = read_record(self._run_dir)
            if record:
                record.update(status=status, ended=now())
                write_record(self._run_dir, record)
        except OSError as exc:  # a full disk must not hide the run's own outcome
            print(f"dream_trainer: could not update {self._run_dir / 'run.json'}: {exc}", file=sys.stderr)
        finally:
            lock.release()

    def _announce_run(self, line: str) -> None:
        """One line on stderr (global rank zero): where this run's files go, and what it resumed."""
        if self.is_global_zero:
            print(f"dream_trainer: {line}", file=sys.stderr, flush=True)

    def _on_rank_zero(self, what: str, fn: Callable[[], _T]) -> _T:
        """`fn()` on global rank zero, its (picklable) result given to every rank; an error there is
        raised on every rank (the original on rank zero, one naming it elsewhere)."""
        if not self.is_distributed:
            return fn()
        payload: Any = None
        error: Exception | None = None
        if self.is_global_zero:
            try:
                payload = ("ok", fn())
            except Exception as exc:
                error, payload = exc, ("error", f"{type(exc).__name__}: {exc}")
        payload = self.broadcast(payload)
        if error is not None:
            raise error
        if payload[0] == "error":
            raise DreamTrainerError(f"global rank 0 failed to {what}: {payload[1]}")
        result: _T = payload[1]
        return result

    def _ensure_run_open(self) -> None:
        """Every rank calls it at the same point: rank zero claims a new run unless one is open."""
        if self._run_dir is not None:
            return

        def claim() -> str:
            self._claim_new_run()
            self._announce_run(f"run directory {self._run_dir}")
            return str(self._run_dir)

        self._run_dir = Path(self._on_rank_zero("open a run directory", claim))

    @property
    def loggers(self) -> list[Logger]:
        """The run's loggers: `config.loggers`, or a TensorBoardLogger when that is None."""
        return self._loggers

    def _attach_loggers(self) -> None:
        if self._loggers_attached:  # fit(), validate(), test() may each come first
            return
        self._ensure_run_open()
        self._loggers_attached = True
        for lg in self._loggers:
            lg.attach(self.log_dir)
        if self.is_global_zero:
            for lg in self._loggers:
                lg.log_hyperparams(self.config.to_dict())

    def _flush_loggers(self) -> None:
        if self.is_global_zero:
            for lg in self._loggers:
                lg.flush()

    def log_images(self, tag: str, images: torch.Tensor, step: int | None = None) -> None:
        """Send images (`(N, C, H, W)` or `(C, H, W)`, floats in [0, 1] or uint8) to the loggers."""
        if self.is_global_zero and self._loggers:
            batch = to_uint8_images(images)  # SYNC: images are copied to the host now
            for lg in self._loggers:
                lg.log_images(tag, batch, self._loop.global_step if step is None else step)

    def log_histogram(self, tag: str, values: torch.Tensor, step: int | None = None) -> None:
        """Send the distribution of `values` (e.g. a layer's weights) to the loggers."""
        if self.is_global_zero and self._loggers:
            host = values.detach().float().cpu()  # SYNC
            for lg in self._loggers:
                lg.log_histogram(tag, host, self._loop.global_step if step is None else step)

    # --- recording --------------------------------------------------------------------------------
    def log(self, name: str, value: torch.Tensor | float, *, batch_size: int | None = None) -> None:
        """Record a scalar metric from a training or validation step (aggregated, no device sync).

        In validation it is averaged over the run weighted by `batch_size` (default: the batch's).
        A torchmetrics `Metric` is computed at the end of the epoch (or validation) and logged as `name`.
        """
        if not isinstance(value, (torch.Tensor, float, int)) and hasattr(value, "compute"):
            phase = self._eval_phase if self._in_validation else "train"
            self._log_metric_object(name, value, phase)
        elif self._in_validation:
            self._val_metrics.update({name: value}, float(batch_size or self._val_batch_size))
        else:
            self._train_metrics.update({name: value}, float(batch_size or 1))

    def log_dict(self, metrics: Mapping[str, torch.Tensor | float], *, batch_size: int | None = None) -> None:
        """`log` for each entry of `metrics`."""
        for name, value in metrics.items():
            self.log(name, value, batch_size=batch_size)

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Send `metrics` to the loggers as they are, at `step` (default: `global_step`).

        Tensors are kept on the device and read back together at the next logging point, so calling
        this every step costs no sync. Non-scalar entries are ignored.
        """
        detached = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
        self._pending_logs.append((self._loop.global_step if step is None else step, detached))

    @property
    def callback_metrics(self) -> dict[str, float]:
        """The latest reduced value of every metric (train interval/epoch means, validation means)."""
        self._flush_pending_logs()
        return self._metrics

    def _latest_metrics(self) -> Mapping[str, float]:
        # Declared by OptimizationMixin (a ReduceLROnPlateau scheduler monitors one of these).
        return self.callback_metrics

    # --- reduction (sync points) ------------------------------------------------------------------
    def _emit(self, values: Mapping[str, float], step: int) -> None:
        if not values:
            return
        self._metrics.update(values)
        if self.is_global_zero:
            for lg in self._loggers:
                lg.log_metrics(dict(values), step)

    def _flush_pending_logs(self) -> None:
        if not self._pending_logs:
            return
        pending, self._pending_logs = self._pending_logs, []
        for step, metrics in pending:
            agg = MetricAggregator()
            agg.update(metrics)
            self._emit(agg.compute(), step)  # SYNC: one read-back per logged dict

    def _flush_train_metrics(self) -> None:
        """Reduce the current logging interval and write it. SYNC: one device-to-host copy."""
        self._flush_pending_logs()
        values = self._train_metrics.compute()
        counts = self.non_finite_counts
        if counts["skipped"] or counts["retried"]:
            values.update({f"non_finite/{k}": float(v) for k, v in counts.items()})
        self._emit(values, self._loop.global_step)
        if self._watch_loss:
            self._check_logged_loss(values)

    def _check_logged_loss(self, values: Mapping[str, float]) -> None:
        """The non-finite loss check: the interval's means were just read back to be logged, so
        looking at them costs no sync. Only when a loss is NaN/inf (rare) are the weights read: a
        step the skip policy or the fp16 loss scaler dropped leaves them finite (nothing to stop; a
        loss that is bad for another reason is reported once); non-finite weights stop the run
        (`non_finite_loss="raise"`) or are reported once ("warn")."""
        start, self._interval_start = self._interval_start, self._loop.global_step
        skipped_before, self._skipped_at_flush = self._skipped_at_flush, self.non_finite_counts["skipped"]
        bad = non_finite_losses(values)
        if not bad or self._skipped_at_flush > skipped_before:
            return
        reduce = self.all_reduce if self.is_distributed else None  # every rank read the same reduced values
        weights_finite = weights_are_finite((m for _, m in self.named_models()), reduce)  # SYNC: bad path only
        if weights_finite and self.grad_scaler is not None:
            return  # fp16: the loss scaler skipped the overflowing steps, as it should
        end = self._loop.global_step
        steps = f"global step {end}" if end - start <= 1 else f"global steps {start + 1}-{end}"
        shown = ", ".join(f"{k} = {v}" for k, v in bad.items())
        where = f"the mean over {steps}, read at the logging point of step {end}"
        if weights_finite:
            message = (
                f"non-finite training loss: {shown} ({where}), but the model's weights are still finite; "
                "training goes on. Check the loss for NaN/inf inputs or labels."
            )
        else:
            message = (
                f"non-finite training loss: {shown} ({where}), and the model's weights are no longer finite. "
                f"No checkpoint with non-finite weights becomes last.ckpt. {SETTINGS_HELP}"
            )
            if self.config.non_finite_loss == "raise":
                raise NonFiniteGradientError("training stopped: " + message)
        if not self._warned_non_finite:
            self._warned_non_finite = True
            warnings.warn(message + " (reported once per run)", stacklevel=2)

    def _end_train_epoch_metrics(self) -> dict[str, float]:
        """Flush the last interval; return the epoch's means and train torchmetrics (also put into
        `callback_metrics`; the torchmetrics values are logged at this step)."""
        self._flush_train_metrics()
        epoch = self._train_metrics.totals()
        self._train_metrics.reset()
        computed = self._compute_metrics("train")
        self._emit(computed, self._loop.global_step)
        epoch.update(computed)
        self._metrics.update(epoch)
        return epoch

    # --- checkpoints -------------------------------------------------------------------------------
    def _metrics_checkpoint_state(self) -> dict[str, Any]:
        """This rank's training-metric accumulation (the logging interval, the epoch's means, the
        training torchmetrics) and `callback_metrics`. SYNC: reads pending values back."""
        return {
            "aggregator": self._train_metrics.state_dict(),
            "torchmetrics": self._train_metrics_state(),
            "callback_metrics": dict(self._metrics),
        }

    def _restore_metrics_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Continue the accumulation saved mid-epoch: the resumed run logs what the original would have."""
        self._train_metrics.load_state_dict(state["aggregator"])
        self._load_train_metrics_state(state["torchmetrics"])

    def _start_epoch_summary(self) -> None:
        self._epoch_started_at = time.perf_counter()
        self._interval_start = self._loop.global_step  # the epoch's first logging interval starts here
        self._val_ran_in_epoch = {}

    def _print_epoch_summary(self, epoch_metrics: Mapping[str, float]) -> None:
        if not (self.config.print_epoch_summary and self.is_global_zero):
            return
        n_epochs = self.config.n_epochs
        head = f"epoch {self._loop.epoch + 1}" + (f"/{n_epochs}" if n_epochs else "")
        parts = [head, f"step {self._loop.global_step}"]
        parts += [f"{k} {_fmt(v)}" for k, v in epoch_metrics.items()]
        parts += [f"{k} {_fmt(v)}" for k, v in self._val_ran_in_epoch.items()]
        parts.append(f"{time.perf_counter() - self._epoch_started_at:.1f}s")
        print(" | ".join(parts), flush=True)
