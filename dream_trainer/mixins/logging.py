"""LoggingMixin: metric aggregation without per-step syncs, `callback_metrics`, loggers, epoch summary.

It sits above `OptimizationMixin` (it logs the optimizer's `non_finite_counts`, and gives the
`ReduceLROnPlateau` scheduler its metrics through `_latest_metrics`) and `MetricsMixin` (torchmetrics
are computed and logged with the other metrics); see `dream_trainer.mixins.core` for the layers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dream_trainer.loggers.base import Logger
from dream_trainer.loggers.tensorboard import TensorBoardLogger
from dream_trainer.mixins.metrics import MetricsMixin
from dream_trainer.mixins.optimization import OptimizationMixin
from dream_trainer.utils.aggregation import MetricAggregator
from dream_trainer.utils.images import to_uint8_images


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
        self._log_dir: Path | None = None
        self._loggers_attached = False
        loggers = self.config.loggers
        self._loggers: list[Logger] = [TensorBoardLogger()] if loggers is None else list(loggers)
        # Set by EvaluationMixin while an evaluation runs: where `self.log` sends values.
        self._in_validation: bool = False
        self._eval_phase: str = "val"  # the torchmetrics phase of the running evaluation ("val" or "test")
        self._val_batch_size: int = 1
        self._epoch_started_at = time.perf_counter()
        self._val_ran_in_epoch: dict[str, float] = {}

    @property
    def log_dir(self) -> Path:
        """This run's log directory, shared by every logger and by callbacks that write files:
        `<root_dir>/logs/<run_name>`, or the next free `<root_dir>/logs/version_N`."""
        if self._log_dir is None:
            base = Path(os.fspath(self.config.root_dir)) / "logs"
            name = self.config.run_name
            if name is None:
                taken = [int(p.name[8:]) for p in base.glob("version_*") if p.name[8:].isdigit()]
                name = f"version_{max(taken) + 1 if taken else 0}"
            self._log_dir = base / name
        return self._log_dir

    @property
    def loggers(self) -> list[Logger]:
        """The run's loggers: `config.loggers`, or a TensorBoardLogger when that is None."""
        return self._loggers

    def _attach_loggers(self) -> None:
        if self._loggers_attached:  # fit(), validate(), test() may each come first
            return
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
