"""The options of `self.log(name, value, on_step=..., on_epoch=..., prog_bar=..., logger=...,
sync_dist=..., reduce_fx=...)`, checked once per metric name, and the names the values are logged under.

Lightning's meaning, one naming scheme:

- `on_step` (training default True): the metric's mean over each logging interval
  (`log_every_n_steps`) is logged under `name` at the interval's last step.
- `on_epoch` (training default True, validation always): the epoch's mean. Logged as `name_epoch`
  when the metric is also logged per step, else as `name`; `callback_metrics[name]` holds it once the
  epoch ended (what `ModelCheckpoint(monitor=name)` and early stopping read).
- Lightning logs the per-step series as `name_step`; here it keeps the name you gave, the same as a
  metric returned from `training_step`, so a dashboard shows one series per metric.
"""

from __future__ import annotations

from typing import NamedTuple

from dream_trainer.errors import ConfigError


class LogOptions(NamedTuple):
    """Where one metric goes. Compared as a tuple: the same options on every call cost one lookup."""

    on_step: bool
    on_epoch: bool
    prog_bar: bool
    logger: bool


DEFAULT_OPTIONS = LogOptions(on_step=True, on_epoch=True, prog_bar=False, logger=True)
"""A metric returned from `training_step` or logged with `self.log(name, value)` alone."""

EPOCH_SUFFIX = "_epoch"


def epoch_name(name: str, options: LogOptions) -> str:
    """The name an epoch mean is logged under: `name_epoch` beside a per-step series, else `name`."""
    return name + EPOCH_SUFFIX if options.on_step else name


def check_log_call(
    name: str,
    options: LogOptions,
    previous: LogOptions | None,
    *,
    in_validation: bool,
    reduce_fx: object,
) -> None:
    """Raise, naming the argument and what to write instead, for a call `self.log` cannot honour.

    Runs once per name (and again only when the options change): not on the hot path.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"self.log(name={name!r}, ...): the name must be a non-empty string.")
    if reduce_fx not in ("mean", None):
        raise ConfigError(
            f"self.log({name!r}, ..., reduce_fx={reduce_fx!r}): values are averaged (reduce_fx='mean'). "
            "For a maximum, minimum or sum log a torchmetrics aggregation instead, e.g. "
            f"self.log({name!r}, self.{name}_max) with self.{name}_max = torchmetrics.MaxMetric() "
            "updated in the step."
        )
    if not (options.on_step or options.on_epoch):
        raise ConfigError(
            f"self.log({name!r}, ..., on_step=False, on_epoch=False) logs nothing: set on_step=True (the "
            "mean of each logging interval), on_epoch=True (the epoch's mean), or both."
        )
    if in_validation and options.on_step:
        raise ConfigError(
            f"self.log({name!r}, ..., on_step=True) in validation: validation metrics are the means over "
            "the validation run (on_epoch=True, the default there). For a per-batch series call "
            f"self.log_metrics({{{name!r}: value}}, step=...) with a step of your choice."
        )
    if previous is not None and previous != options:
        raise ConfigError(
            f"self.log({name!r}, ...) was called with {_describe(previous)} before and {_describe(options)} "
            "now: one metric name keeps one set of options. Use another name for the other series."
        )


def _describe(options: LogOptions) -> str:
    return ", ".join(f"{field}={value}" for field, value in options._asdict().items())
