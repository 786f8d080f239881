"""LoggingMixin: metric aggregation without per-step syncs, `self.log` and its options,
`callback_metrics`, the loggers, the non-finite loss check, the epoch summary.

It sits above `OptimizationMixin` (it logs the optimizer's `non_finite_counts`, and gives the
`ReduceLROnPlateau` scheduler its metrics through `_latest_metrics`), `MetricsMixin` (torchmetrics
are computed and logged with the other metrics) and `RunDirectoryMixin` (the loggers write into the
run directory); see `dream_trainer.mixins.core` for the layers.
"""

from __future__ import annotations

import contextlib
import copy
import shutil
import sys
import time
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import torch

from dream_trainer.errors import LoggerWriteError, NonFiniteGradientError
from dream_trainer.loggers.base import Logger, writing_to
from dream_trainer.loggers.tensorboard import TensorBoardLogger
from dream_trainer.mixins.metrics import MetricsMixin
from dream_trainer.mixins.optimization import OptimizationMixin
from dream_trainer.mixins.run_directory import RunDirectoryMixin
from dream_trainer.run_state import StateOwner
from dream_trainer.utils.aggregation import MetricAggregator, merged_state
from dream_trainer.utils.data_reshard import saved_accumulation
from dream_trainer.utils.images import to_uint8_images
from dream_trainer.utils.log_options import DEFAULT_OPTIONS, LogOptions, check_log_call, epoch_name
from dream_trainer.utils.non_finite import SETTINGS_HELP, non_finite_losses, weights_are_finite
from dream_trainer.utils.numbers import format_metric, join_to_width
from dream_trainer.utils.step_outputs import EvalMetricNames, name_clash_note
from dream_trainer.utils.warn import warn_user


class LoggingMixin(OptimizationMixin, MetricsMixin, RunDirectoryMixin):
    """Collects metrics from step outputs and `self.log`, reduces them only at log time.

    Training metrics are averaged over each logging interval (`log_every_n_steps`) and over the
    epoch; validation metrics are averaged over the validation run, weighted by batch size. The
    reduced floats go to `trainer.callback_metrics` (what callbacks such as early stopping read)
    and, on global rank zero, to every logger.
    """

    # Where `self.log` sends a value while an evaluation runs: created and set by EvaluationMixin (the
    # layer above, which runs the evaluations), read here.
    _in_validation: bool
    _eval_phase: str  # the torchmetrics phase of the running evaluation ("val" or "test")
    _val_batch_size: int  # the running evaluation batch's size: the default weight of a logged value

    def _init_logging(self) -> None:
        self._train_metrics = MetricAggregator()
        self._val_metrics = MetricAggregator()
        self._metrics: dict[str, float] = {}
        self._pending_logs: list[tuple[int, dict[str, Any]]] = []
        # spike_policy="rollback", while an epoch's batches run: what the loggers are sent waits here until the
        # steps it comes from are kept (`_release_held_logs`); a rollback drops it with them. None: sent at once.
        self._held_logs: list[tuple[dict[str, float], int]] | None = None
        self._loggers_attached = False
        loggers = self.config.loggers
        self._loggers: list[Logger] = [TensorBoardLogger()] if loggers is None else list(loggers)
        self._epoch_started_at = time.perf_counter()
        self._init_run_directory()
        # `self.log` options per metric name (see `dream_trainer.utils.log_options`): names absent
        # here (returned dicts, plain `self.log`) are logged per interval and as epoch means.
        self._log_options: dict[str, LogOptions] = {}
        self._unlogged: set[str] = set()  # logged with logger=False: callback_metrics only
        self._prog_bar: set[str] = set()  # logged with prog_bar=True
        self._epoch_only: set[str] = set()  # on_step=False
        self._step_only: set[str] = set()  # on_epoch=False
        self._epoch_names: set[str] = set()  # the `name_epoch` copies of epoch means
        # The names of training metrics of the epochs that ended (and of a checkpoint's run): with those
        # training records now (`_training_metric_names`), what an evaluation step's return may not be named.
        self._train_names: set[str] = set()
        self._eval_logged: set[str] = set()  # the names `self.log` recorded in the running evaluation
        self._eval_logged_as: dict[str, str] = {}  # name -> phase, of every evaluation logged (the clash check)
        self._clashes_said: set[str] = set()
        # The non-finite loss check at logging points (see `_check_logged_loss`).
        self._watch_loss: bool = self.config.non_finite_loss != "ignore"
        self._interval_start: int = 0  # global_step when the current logging interval began
        self._skipped_at_flush: int = 0  # non_finite_counts["skipped"] at the last logging point
        self._warned_non_finite: bool = False
        self._state_owners.register(
            "metrics",
            StateOwner(self._metrics_entries, self._load_callback_metrics, self._copy_metrics, self._put_metrics),
        )

    @property
    def loggers(self) -> list[Logger]:
        """The run's loggers: `config.loggers`, or a TensorBoardLogger when that is None."""
        return self._loggers

    @property
    def logger(self) -> Logger | None:
        """The first of `loggers` (None when there is none): Lightning's `self.logger`."""
        return self._loggers[0] if self._loggers else None

    def _attach_loggers(self, back_to_checkpoint: bool = False) -> None:
        """Attach the loggers to the run (once: fit(), validate(), test() may each come first).
        `back_to_checkpoint`: a second `fit()` of this trainer continues its run from a checkpoint
        behind what the loggers hold, so they go back to its step."""
        if self._loggers_attached:
            if back_to_checkpoint:
                self._resume_loggers()
            return
        self._ensure_run_open()
        self._loggers_attached = True
        for lg in self._loggers:
            lg.attach(self.log_dir)
        if self.is_global_zero:
            if not self._run_directory.claimed:  # fit() continues this run (not a new one) from its checkpoint
                self._resume_loggers()
            for lg in self._loggers:
                with writing_to(lg):
                    lg.log_hyperparams(self.config.to_dict())

    def _finalize_loggers(self, status: str) -> None:
        """The end of an entry point (`fit()`, or `validate()`/`test()`/`predict()` outside a fit):
        rank 0's loggers write what they hold and close their run with `status` ("success" or
        "failed"); a later call logs to them again (an MLflow run is marked running again)."""
        if not self.is_global_zero:
            return
        failure: LoggerWriteError | None = None
        for lg in self._loggers:  # every logger closes, whichever failed first
            try:
                with writing_to(lg):
                    lg.finalize(status)
            except LoggerWriteError as exc:
                if status != "success":  # the run failed already: its own error is the one raised
                    print(f"dream_trainer: {exc}", file=sys.stderr)
                else:
                    failure = failure or exc
        if failure is not None:
            raise failure

    def _resume_loggers(self) -> None:
        """Each logger continues its history from the checkpoint's step (`Logger.resume`): what was
        logged after it is logged again by the resumed run, and kept once."""
        step = self._loop.global_step
        if self.is_global_zero and step > 0:
            for lg in self._loggers:
                lg.resume(step)

    @contextlib.contextmanager
    def _loggers_muted(self) -> Iterator[None]:
        """The loggers get nothing inside the block: a tuning run."""
        loggers, self._loggers = self._loggers, []
        try:
            yield
        finally:
            self._loggers = loggers

    @contextlib.contextmanager
    def _training_metrics_dropped(self) -> Iterator[None]:
        """What `self.log` records for training inside the block is dropped (a closure's later evaluations)."""
        kept, self._train_metrics = self._train_metrics, MetricAggregator()
        try:
            yield
        finally:
            self._train_metrics = kept

    def _flush_loggers(self) -> None:
        if self.is_global_zero:
            for lg in self._loggers:
                with writing_to(lg):
                    lg.flush()

    def log_images(self, tag: str, images: torch.Tensor, step: int | None = None) -> None:
        """Send images (`(N, C, H, W)` or `(C, H, W)`, floats in [0, 1] or uint8) to the loggers."""
        if self.is_global_zero and self._loggers:
            batch = to_uint8_images(images)  # SYNC: images are copied to the host now
            for lg in self._loggers:
                with writing_to(lg):
                    lg.log_images(tag, batch, self._loop.global_step if step is None else step)

    def log_histogram(self, tag: str, values: torch.Tensor, step: int | None = None) -> None:
        """Send the distribution of `values` (e.g. a layer's weights) to the loggers."""
        if self.is_global_zero and self._loggers:
            host = values.detach().float().cpu()  # SYNC
            for lg in self._loggers:
                with writing_to(lg):
                    lg.log_histogram(tag, host, self._loop.global_step if step is None else step)

    # --- recording --------------------------------------------------------------------------------
    def log(
        self,
        name: str,
        value: Any,
        *,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        prog_bar: bool = False,
        logger: bool = True,
        sync_dist: bool = False,
        reduce_fx: str = "mean",
        batch_size: int | None = None,
    ) -> None:
        """Record a scalar metric from a training or validation step, with Lightning's options.

        Nothing is read from the device here: values are reduced at the next logging point.

        Args:
            name: the metric's name.
            value: a scalar tensor or number, or a torchmetrics `Metric` (computed at the end of the
                epoch or validation run and logged as `name`).
            on_step: training: log the mean of each logging interval (`log_every_n_steps`) under
                `name`. Default True in training; validation metrics are per run (True is an error there).
            on_epoch: log the epoch's mean: `name_epoch` beside a per-step series, else `name`;
                `callback_metrics[name]` holds it once the epoch ended. Default True.
            prog_bar: show it in the progress display. When no metric asks for it, the display shows them all.
            logger: False keeps it out of the loggers (it still reaches `callback_metrics`).
            sync_dist: accepted for Lightning code. Metrics are always averaged over the processes,
                in one collective per logging point (never per step), so every rank reads the same value.
            reduce_fx: "mean" (the only reduction; for max/min/sum log a torchmetrics aggregation).
            batch_size: the weight of this value in validation means (default: the batch's size).
        """
        if self._in_validation:
            if on_step or on_epoch is False or prog_bar or not logger or reduce_fx != "mean":
                self._register_eval_options(name, bool(on_step), on_epoch is not False, prog_bar, logger, reduce_fx)
            self._eval_logged.add(name)  # an explicit name: a returned value named alike gives way to it
            if not isinstance(value, (torch.Tensor, float, int)) and hasattr(value, "compute"):
                self._log_metric_object(name, value, self._eval_phase)
            else:
                self._val_metrics.update({name: value}, float(batch_size or self._val_batch_size))
            return
        if on_step is None and on_epoch is None and not prog_bar and logger:
            options = DEFAULT_OPTIONS
        else:
            options = LogOptions(on_step is not False, on_epoch is not False, prog_bar, logger)
        if self._log_options.get(name) != options:  # the first call for `name`: check it once
            self._register_log_options(name, options, reduce_fx)
        if not isinstance(value, (torch.Tensor, float, int)) and hasattr(value, "compute"):
            self._log_metric_object(name, value, "train")
        else:
            self._train_metrics.update({name: value}, float(batch_size or 1))

    def _register_log_options(self, name: str, options: LogOptions, reduce_fx: object) -> None:
        check_log_call(name, options, self._log_options.get(name), in_validation=False, reduce_fx=reduce_fx)
        self._log_options[name] = options
        self._note_display_options(name, options.prog_bar, options.logger)
        if not options.logger:
            self._unlogged.add(epoch_name(name, options))
        if not options.on_step:
            self._epoch_only.add(name)
        if not options.on_epoch:
            self._step_only.add(name)

    def _register_eval_options(
        self, name: str, on_step: bool, on_epoch: bool, prog_bar: bool, logger: bool, reduce_fx: object
    ) -> None:
        check_log_call(
            name, LogOptions(on_step, on_epoch, prog_bar, logger), None, in_validation=True, reduce_fx=reduce_fx
        )
        self._note_display_options(name, prog_bar, logger)

    def _note_display_options(self, name: str, prog_bar: bool, logger: bool) -> None:
        if prog_bar:
            self._prog_bar.add(name)
        if not logger:
            self._unlogged.add(name)

    def log_dict(
        self,
        metrics: Mapping[str, torch.Tensor | float],
        *,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        prog_bar: bool = False,
        logger: bool = True,
        sync_dist: bool = False,
        reduce_fx: str = "mean",
        batch_size: int | None = None,
    ) -> None:
        """`log` for each entry of `metrics`, with the same options (Lightning's `log_dict`)."""
        for name, value in metrics.items():
            self.log(
                name,
                value,
                on_step=on_step,
                on_epoch=on_epoch,
                prog_bar=prog_bar,
                logger=logger,
                sync_dist=sync_dist,
                reduce_fx=reduce_fx,
                batch_size=batch_size,
            )

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Send `metrics` to the loggers as they are, at `step` (default: `global_step`).

        Tensors are kept on the device and read back together at the next logging point, so calling
        this every step costs no sync. Non-scalar entries are ignored.
        """
        detached = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
        self._pending_logs.append((self._loop.global_step if step is None else step, detached))

    @property
    def callback_metrics(self) -> dict[str, float]:
        """The latest reduced value of every metric: training interval means (epoch means once the
        epoch ended, under the metric's name and as `name_epoch`), validation means."""
        self._flush_pending_logs()
        return self._metrics

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        """What the progress display shows: the metrics logged with `prog_bar=True`, or, when none
        was, every metric of `callback_metrics` but the `name_epoch` copies of epoch means."""
        metrics = self.callback_metrics
        if self._prog_bar:
            return {k: v for k, v in metrics.items() if k in self._prog_bar}
        return {k: v for k, v in metrics.items() if k not in self._epoch_names}

    def _latest_metrics(self) -> Mapping[str, float]:
        # Declared by SchedulerMixin (a ReduceLROnPlateau scheduler monitors one of these).
        return self.callback_metrics

    # --- evaluation names ---------------------------------------------------------------------------
    def _training_metric_names(self) -> set[str]:
        """Every name training has logged in this run: the ended epochs' (and a checkpoint's), the running
        epoch's (recorded or reduced, read without a read-back), `self.log`'s, the training torchmetrics'."""
        names = set(self._train_names)
        names.update(self._train_metrics.names())  # the keys only: nothing is read from the device
        names.update(self._log_options, self._phase_metrics["train"])
        return names

    def _eval_metric_names(self, phase: str) -> EvalMetricNames:
        """An evaluation of `phase` ("val", "test") starts: how what its step returns is named (see
        `EvalMetricNames`), against the names training has logged so far. Once per evaluation run."""
        self._eval_logged.clear()
        return EvalMetricNames(phase, self._training_metric_names(), self._eval_logged)

    def _note_eval_results(self, results: Mapping[str, float], phase: str, training: Collection[str]) -> None:
        """An evaluation's results are logged (not the sanity check's): a name training logs too (one the
        user chose with `self.log`, or a torchmetrics attribute's) is said once; the names are kept to say a
        training metric that takes one of them later (`_end_train_epoch_metrics`)."""
        for name in results:
            self._eval_logged_as.setdefault(name, phase)
        self._say_clashes({name: phase for name in results if name in training})

    def _say_clashes(self, clashes: Mapping[str, str]) -> None:
        new = {name: phase for name, phase in clashes.items() if name not in self._clashes_said}
        if new:
            self._clashes_said.update(new)
            warn_user(name_clash_note(type(self).__name__, new))

    # --- reduction (sync points) ------------------------------------------------------------------
    def _emit(self, values: Mapping[str, float], step: int) -> None:
        if not values:
            return
        self._metrics.update(values)
        if self.is_global_zero and self._loggers:
            logged = {k: v for k, v in values.items() if k not in self._unlogged} if self._unlogged else dict(values)
            if not logged:
                return
            if self._held_logs is not None:
                self._held_logs.append((logged, step))
                return
            self._send_to_loggers(logged, step)

    def _send_to_loggers(self, logged: dict[str, float], step: int) -> None:
        for lg in self._loggers:
            with writing_to(lg):
                lg.log_metrics(dict(logged), step)

    def _release_held_logs(self, hold: bool) -> None:
        """spike_policy="rollback" (the bad-batch policy calls it): the steps since the last snapshot point
        are kept (a new point, the epoch's batches ended; the fit's end): what they logged goes to the
        loggers now, in order; with `hold`, what comes next waits again. The snapshot taken at a point holds
        the empty list: a rollback puts it back, so the loggers never see a step the rollback discards."""
        held, self._held_logs = self._held_logs, [] if hold else None
        for logged, step in held or ():
            self._send_to_loggers(logged, step)

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
        if self._epoch_only:  # self.log(..., on_step=False): only in the epoch's mean
            values = {k: v for k, v in values.items() if k not in self._epoch_only}
        counts = self.non_finite_counts
        # The counters join a logging point's values; an empty interval (the epoch's end just after a logging
        # step) writes nothing, so no step of theirs is logged twice.
        if values and (counts["skipped"] or counts["retried"]):
            values.update({f"non_finite/{k}": float(v) for k, v in counts.items()})
        # The skip list (`trainer.skipped_batches`, the bad-batch policy's): spikes and non-finite steps dropped.
        if values and (skipped := self._bad_batches.skipped_batches):
            last = skipped[-1]
            values["skipped_batches"] = float(len(skipped))
            values["skipped_batches/last_epoch"] = float(last["epoch"])  # which batch, in numbers loggers take
            values["skipped_batches/last_batch_idx"] = float(last["batch_idx"])
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
        if self._held_logs is not None:  # spike_policy="rollback": a NaN/inf loss is a spike, rolled back at
            return  # the next snapshot point with the rows that show it (held until then), never trained on
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
            warn_user(message + " (reported once per run)")

    def _end_train_epoch_metrics(self) -> dict[str, float]:
        """Flush the last interval; return the epoch's means and train torchmetrics (also put into
        `callback_metrics`; the torchmetrics values are logged at this step)."""
        self._flush_train_metrics()
        epoch = self._train_metrics.totals()
        self._train_metrics.reset()
        self._train_names.update(epoch)
        if self._step_only:  # self.log(..., on_epoch=False): no epoch mean
            epoch = {k: v for k, v in epoch.items() if k not in self._step_only}
        # Every logger gets the epoch means the summary prints, at the epoch's last step.
        named = {epoch_name(k, self._log_options.get(k, DEFAULT_OPTIONS)): v for k, v in epoch.items()}
        self._epoch_names.update(n for n in named if n not in epoch)
        self._emit(named, self._loop.global_step)
        computed = self._compute_metrics("train")
        self._emit(computed, self._loop.global_step)
        epoch.update(computed)
        self._metrics.update(epoch)
        self._train_names.update(named)
        self._train_names.update(computed)
        if self._eval_logged_as:  # an evaluation logged a name before training did (one at step 0, say)
            self._say_clashes({n: p for n, p in self._eval_logged_as.items() if n in self._train_names})
        return epoch

    def _unfinished_epoch_metrics(self) -> dict[str, float]:
        """Training stopped inside an epoch, which has not ended: flush the last interval (the steps since
        the last logging point) and return the epoch's means so far, for its summary line. Nothing is reset
        or logged as the epoch's: a run continuing this one ends the epoch, with the means over all of it.
        Inside an accumulation window the interval waits for its step (a checkpoint keeps it)."""
        if self._loop.window_pos == 0:
            self._flush_train_metrics()
        epoch = self._train_metrics.totals()  # nothing pending now: the means, the accumulation unchanged
        return {k: v for k, v in epoch.items() if k not in self._step_only}

    # --- run state (see `dream_trainer.run_state`) ----------------------------------------------------
    def _metrics_entries(self) -> dict[str, Any]:
        metrics = self._metrics_checkpoint_state()
        # Each rank accumulates its own values until they are reduced at a logging point.
        return {
            "metrics": metrics,
            "metrics_per_rank": self.all_gather_object(metrics) if self.is_distributed else None,
        }

    def _load_callback_metrics(self, checkpoint: Mapping[str, Any]) -> None:
        # The accumulation itself belongs to the loop's mid-epoch resume record (see `_rank_metrics`),
        # restored when the loop opens that epoch (after the epoch start reset the training metrics).
        metrics = checkpoint.get("metrics")
        if metrics:
            self._metrics.update(metrics.get("callback_metrics", {}))
            self._train_names.update(metrics.get("train_names", ()))  # absent in older checkpoints

    def _rank_metrics(self, checkpoint: Mapping[str, Any]) -> dict[str, Any] | None:
        """This rank's training-metric accumulation in `checkpoint` (what a mid-epoch resume continues).

        Written by another number of data-parallel ranks (or with another accumulation): rank 0 continues
        all of theirs together, the others none, so the epoch's means are the uninterrupted run's (see
        `merged_state`; the ranks' sums are added at every logging point). The training torchmetrics' states
        cannot be added up in general: they start fresh, with a warning."""
        metrics: dict[str, Any] | None = checkpoint.get("metrics")
        per_rank = checkpoint.get("metrics_per_rank") or ([metrics] if metrics else None)
        data = checkpoint.get("data") or {}
        saved_dp = int(data.get("data_parallel_size") or len(per_rank or ()) or 1)
        saved_steps = saved_accumulation(checkpoint)
        dp, accumulation = int(self.parallel.data_parallel_size), int(self.config.gradient_accumulation_steps)
        if not per_rank or (len(per_rank) == self.world_size and (saved_dp, saved_steps) == (dp, accumulation)):
            return per_rank[self.global_rank] if per_rank else metrics
        names = sorted({name for rank in per_rank for name in (rank.get("torchmetrics") or {})})
        if names:
            warn_user(
                f"the checkpoint was written by {len(per_rank)} ranks and is loaded by {self.world_size}: the "
                f"training torchmetrics {names} start this epoch's accumulation afresh (their per-rank states "
                "cannot be split over other ranks); the logged values of the trainer's own means continue"
            )
        scale = (dp * accumulation) / (saved_dp * saved_steps)
        states = [rank.get("aggregator") or {} for rank in per_rank] if self.global_rank == 0 else []
        return {**per_rank[0], "aggregator": merged_state(states, scale), "torchmetrics": {}}

    def _copy_metrics(self) -> dict[str, Any]:
        return {
            "aggregator": self._train_metrics.state_dict(),
            "torchmetrics": copy.deepcopy(self._train_metrics_state()),
            "callback_metrics": dict(self._metrics),
            "pending_logs": list(self._pending_logs),
            "held_logs": None if self._held_logs is None else list(self._held_logs),
            "train_names": set(self._train_names),
        }

    def _put_metrics(self, saved: dict[str, Any]) -> None:
        self._train_metrics.load_state_dict(saved["aggregator"])
        self._load_train_metrics_state(copy.deepcopy(saved["torchmetrics"]))
        self._metrics.clear()
        self._metrics.update(saved["callback_metrics"])
        self._pending_logs[:] = saved["pending_logs"]
        held = saved["held_logs"]  # a copy: the same snapshot may be put back again (a second rollback to it)
        self._held_logs = None if held is None else list(held)
        self._train_names.clear()
        self._train_names.update(saved["train_names"])

    # --- checkpoints -------------------------------------------------------------------------------
    def _metrics_checkpoint_state(self) -> dict[str, Any]:
        """This rank's training-metric accumulation (the logging interval, the epoch's means, the
        training torchmetrics), `callback_metrics`, and the names training has logged (an evaluation's
        returned values are named apart from them). SYNC: reads pending values back."""
        return {
            "aggregator": self._train_metrics.state_dict(),
            "torchmetrics": self._train_metrics_state(),
            "callback_metrics": dict(self._metrics),
            "log_options": {name: list(options) for name, options in self._log_options.items()},
            "train_names": sorted(self._train_names),
        }

    def _restore_metrics_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Continue the accumulation saved mid-epoch: the resumed run logs what the original would have."""
        self._train_metrics.load_state_dict(state["aggregator"])
        self._load_train_metrics_state(state["torchmetrics"])
        for name, options in state.get("log_options", {}).items():  # absent in checkpoints before 0.2
            self._register_log_options(name, LogOptions(*options), "mean")

    def _start_epoch_summary(self) -> None:
        self._epoch_started_at = time.perf_counter()
        self._interval_start = self._loop.global_step  # the epoch's first logging interval starts here

    def _print_epoch_summary(self, epoch_metrics: Mapping[str, float], validation: Mapping[str, float]) -> None:
        """The epoch's line: its training means, then `validation`'s results when one ran in it."""
        if not (self.config.print_epoch_summary and self.is_global_zero):
            return
        n_epochs = self.config.n_epochs
        head = f"epoch {self._loop.epoch + 1}" + (f"/{n_epochs}" if n_epochs else "")
        parts = [head, f"step {self._loop.global_step}"]
        parts += [f"{k} {format_metric(v)}" for k, v in epoch_metrics.items()]
        parts += [f"{k} {format_metric(v)}" for k, v in validation.items()]
        parts.append(f"{time.perf_counter() - self._epoch_started_at:.1f}s")
        # In a terminal, break between metrics rather than let the terminal cut a name in two.
        width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
        print(join_to_width(parts, width), flush=True)
