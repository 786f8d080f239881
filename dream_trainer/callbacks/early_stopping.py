"""EarlyStopping: stop training when a monitored metric stops improving (Lightning's arguments)."""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any

from dream_trainer.callbacks.base import Callback
from dream_trainer.errors import ConfigError, MisconfigurationError
from dream_trainer.utils.warn import warn_user

if TYPE_CHECKING:
    from dream_trainer.protocol import TrainerProtocol

_ORDER = {"min": "<", "max": ">"}


class EarlyStopping(Callback):
    """Stop training when `monitor` has not improved for `patience` checks, or crossed a threshold.

    Args:
        monitor: metric in `trainer.callback_metrics` to watch (a validation metric by default).
        min_delta: smallest change that counts as an improvement: in `"min"` mode a value must be
            below `best - min_delta`, in `"max"` mode above `best + min_delta`.
        patience: number of checks without improvement after which training stops. A check happens
            after every validation run (or every training epoch, see `check_on_train_epoch_end`).
        mode: `"min"` (lower is better, e.g. a loss) or `"max"` (higher is better, e.g. accuracy).
        strict: raise `MisconfigurationError` when `monitor` is not among the metrics at a check;
            with `strict=False` the check is skipped (with a warning when `verbose`).
        check_finite: stop as soon as `monitor` is NaN or infinite.
        stopping_threshold: stop as soon as `monitor` is better than this value (goal reached).
        divergence_threshold: stop as soon as `monitor` is worse than this value (diverged).
        check_on_train_epoch_end: check at the end of each training epoch instead of after each
            validation run. Default (None): after each validation run when there is a validation
            loader, else at the end of each training epoch (monitor a training metric then).
        verbose: print each improvement and the reason for stopping.

    When it stops, `trainer.should_stop` is set, `stopped_epoch` holds the epoch and `stop_reason`
    says why. `wait_count`, `best_score` and `stopped_epoch` are saved in checkpoints, so a resumed run
    keeps counting patience where it left off.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        min_delta: float = 0.0,
        patience: int = 3,
        mode: str = "min",
        strict: bool = True,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        check_on_train_epoch_end: bool | None = None,
        verbose: bool = False,
    ) -> None:
        if mode not in _ORDER:
            raise ConfigError(f"EarlyStopping(mode={mode!r}) is invalid: valid choices are 'min', 'max'")
        if not isinstance(monitor, str) or not monitor:
            raise ConfigError(f"EarlyStopping(monitor={monitor!r}) is invalid: expected a metric name")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ConfigError(f"EarlyStopping(patience={patience!r}) is invalid: expected an integer >= 0")
        if not _is_real(min_delta) or not math.isfinite(min_delta):
            raise ConfigError(f"EarlyStopping(min_delta={min_delta!r}) is invalid: expected a finite number")
        for name, value in (("stopping_threshold", stopping_threshold), ("divergence_threshold", divergence_threshold)):
            if value is not None and not _is_real(value):
                raise ConfigError(f"EarlyStopping({name}={value!r}) is invalid: expected a number or None")
        self.monitor = monitor
        self.min_delta = float(min_delta)
        self.patience = patience
        self.mode = mode
        self.strict = strict
        self.check_finite = check_finite
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.verbose = verbose
        # state (saved in checkpoints)
        self.wait_count = 0
        self.best_score = math.inf if mode == "min" else -math.inf
        self.stopped_epoch = 0
        # not saved
        self.stop_reason: str | None = None
        self._at_epoch_end = bool(check_on_train_epoch_end)

    @property
    def state_key(self) -> str:
        return f"EarlyStopping{{'monitor': {self.monitor!r}, 'mode': {self.mode!r}}}"

    # --- when -------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: TrainerProtocol) -> None:
        if self.check_on_train_epoch_end is None:
            self._at_epoch_end = trainer.val_loader is None
        else:
            self._at_epoch_end = self.check_on_train_epoch_end

    def on_validation_end(self, trainer: TrainerProtocol) -> None:
        if self._at_epoch_end or trainer.sanity_checking:
            return
        self.check(trainer)

    def on_train_epoch_end(self, trainer: TrainerProtocol) -> None:
        if self._at_epoch_end:
            self.check(trainer)

    def on_train_end(self, trainer: TrainerProtocol) -> None:
        if self.verbose and self.stop_reason is not None and trainer.is_global_zero:
            print(f"Epoch {self.stopped_epoch}: early stopping triggered.", flush=True)

    # --- the check --------------------------------------------------------------------------------
    def check(self, trainer: TrainerProtocol) -> bool:
        """Compare the current value of `monitor` with the best so far; set `trainer.should_stop` if
        a stopping criterion is met. Returns True when it asked the trainer to stop."""
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:
            message = (
                f"EarlyStopping(monitor={self.monitor!r}) found no such metric in trainer.callback_metrics; "
                f"available metrics: {sorted(metrics)}. Return or log it from a step, or change monitor."
            )
            if self.strict:
                raise MisconfigurationError(message)
            if self.verbose:
                warn_user(message + " (strict=False: skipping this check)", RuntimeWarning)
            return False
        current = float(metrics[self.monitor])
        should_stop, reason = self._evaluate(current)
        if should_stop:
            trainer.should_stop = True
            self.stopped_epoch = trainer.current_epoch
            self.stop_reason = reason
        if reason is not None and self.verbose and trainer.is_global_zero:
            print(f"EarlyStopping: {reason}", flush=True)
        return should_stop

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def _evaluate(self, current: float) -> tuple[bool, str | None]:
        monitor, order = self.monitor, _ORDER[self.mode]
        if self.check_finite and not math.isfinite(current):
            return True, (
                f"Monitored metric {monitor} = {current} is not finite. "
                f"Previous best value was {self.best_score:.3f}. Signaling Trainer to stop."
            )
        if self.stopping_threshold is not None and self._better(current, self.stopping_threshold):
            return True, (
                f"Stopping threshold reached: {monitor} = {current} {order} {self.stopping_threshold}. "
                "Signaling Trainer to stop."
            )
        if self.divergence_threshold is not None and self._better(self.divergence_threshold, current):
            opposite = _ORDER["max" if self.mode == "min" else "min"]
            return True, (
                f"Divergence threshold reached: {monitor} = {current} {opposite} {self.divergence_threshold}. "
                "Signaling Trainer to stop."
            )
        shift = self.min_delta if self.mode == "min" else -self.min_delta
        if self._better(current + shift, self.best_score):
            if math.isfinite(self.best_score):
                reason = (
                    f"Metric {monitor} improved by {abs(self.best_score - current):.3f} >= "
                    f"min_delta = {abs(self.min_delta)}. New best score: {current:.3f}"
                )
            else:
                reason = f"Metric {monitor} improved. New best score: {current:.3f}"
            self.best_score = current
            self.wait_count = 0
            return False, reason
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return True, (
                f"Monitored metric {monitor} did not improve in the last {self.wait_count} records. "
                f"Best score: {self.best_score:.3f}. Signaling Trainer to stop."
            )
        return False, None

    # --- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"wait_count": self.wait_count, "best_score": self.best_score, "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_count = int(state_dict.get("wait_count", 0))
        self.best_score = float(state_dict.get("best_score", self.best_score))
        self.stopped_epoch = int(state_dict.get("stopped_epoch", 0))


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
