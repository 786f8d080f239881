"""ThroughputMonitor: step time, data-wait time, samples/s (tokens/s, FLOPs/s) over a rolling window."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dream_trainer.callbacks.base import Callback
from dream_trainer.errors import ConfigError
from dream_trainer.utils.tensors import batch_size_of

if TYPE_CHECKING:
    from dream_trainer.protocol import TrainerProtocol

PREFIX = "throughput/"


def _positive_int(name: str, value: Any, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        tail = " or None" if allow_none else ""
        raise ConfigError(f"ThroughputMonitor({name}={value!r}) is invalid: expected a positive integer{tail}")


class ThroughputMonitor(Callback):
    """Measure how fast training runs, and where the time goes, without touching the device per step.

    For each training batch it takes two `time.perf_counter()` readings: `on_train_batch_start` ->
    `on_train_batch_end` is the step time (forward, backward, optimizer), `on_train_batch_end` -> the
    next `on_train_batch_start` the data-wait time (fetching and collating the next batch). Validation
    runs in between are not counted. Every `log_every_n_steps` training steps it logs, over the last
    `window` batches:

    - `throughput/step_time`: mean seconds per batch in the training step;
    - `throughput/data_wait_time`: mean seconds per batch waiting for data;
    - `throughput/samples_per_sec`: samples / wall time (step + data wait), so
      `samples_per_sec == batch_size / (step_time + data_wait_time)`;
    - `throughput/tokens_per_sec` (with `tokens_per_batch_fn`), `throughput/flops_per_sec` (with
      `flops_per_batch`).

    Values are per process; multiply by the world size for the whole job.

    Args:
        batch_size_fn: `fn(batch) -> int` samples in a batch (default: the first dimension of its
            first tensor, `dream_trainer.utils.batch_size_of`).
        tokens_per_batch_fn: `fn(batch) -> int | tensor` tokens in a batch (e.g.
            `lambda b: b["attention_mask"].sum()`); a tensor stays on the device until logged.
        flops_per_batch: floating-point operations of one training batch (forward + backward), e.g.
            from `torch.utils.flop_counter.FlopCounterMode`.
        log_every_n_steps: default `config.log_every_n_steps`.
        window: number of recent batches the logged values average over.

    On CUDA the device is synchronized once per logging step (never otherwise), so the window's wall
    time includes the queued kernels. Work done in other callbacks' `on_train_batch_end` counts as
    step time for callbacks listed before this one and as data wait for those after it: list
    `ThroughputMonitor` last for the cleanest split.
    """

    def __init__(
        self,
        batch_size_fn: Callable[[Any], Any] | None = None,
        tokens_per_batch_fn: Callable[[Any], Any] | None = None,
        flops_per_batch: float | None = None,
        log_every_n_steps: int | None = None,
        window: int = 50,
    ) -> None:
        for name, fn in (("batch_size_fn", batch_size_fn), ("tokens_per_batch_fn", tokens_per_batch_fn)):
            if fn is not None and not callable(fn):
                raise ConfigError(f"ThroughputMonitor({name}={fn!r}) is invalid: expected a function of the batch")
        if flops_per_batch is not None and (
            isinstance(flops_per_batch, bool) or not isinstance(flops_per_batch, (int, float)) or flops_per_batch <= 0
        ):
            raise ConfigError(
                f"ThroughputMonitor(flops_per_batch={flops_per_batch!r}) is invalid: expected a positive number"
            )
        _positive_int("log_every_n_steps", log_every_n_steps, allow_none=True)
        _positive_int("window", window, allow_none=False)
        self.batch_size_fn = batch_size_fn or batch_size_of
        self.tokens_per_batch_fn = tokens_per_batch_fn
        self.flops_per_batch = float(flops_per_batch) if flops_per_batch is not None else None
        self.log_every_n_steps = log_every_n_steps
        self.window = window
        self._every = 1
        self._sync_cuda: torch.device | None = None
        self._reset()

    def _reset(self) -> None:
        self._step_times: deque[float] = deque(maxlen=self.window)
        self._waits: deque[float] = deque(maxlen=self.window)
        self._samples: deque[Any] = deque(maxlen=self.window)
        self._tokens: deque[Any] = deque(maxlen=self.window)
        self._batch_start = 0.0
        self._last_end: float | None = None  # end of the previous batch: the data wait starts here
        self._paused_at: float | None = None

    # --- timing -----------------------------------------------------------------------------------
    def on_train_start(self, trainer: TrainerProtocol) -> None:
        self._reset()
        self._every = self.log_every_n_steps or trainer.config.log_every_n_steps
        self._sync_cuda = trainer.device if trainer.device.type == "cuda" else None

    def on_train_epoch_start(self, trainer: TrainerProtocol) -> None:
        # The first batch's wait includes creating the loader's iterator (worker start-up): real data
        # wait. The end-of-epoch work before it (checkpoints, summaries) is not.
        self._last_end = time.perf_counter()

    def on_train_batch_start(self, trainer: TrainerProtocol, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        self._waits.append(now - self._last_end if self._last_end is not None else 0.0)
        self._batch_start = now

    def on_train_batch_end(self, trainer: TrainerProtocol, outputs: Any, batch: Any, batch_idx: int) -> None:
        log_now = trainer.loop.step_ended_every(self._every)
        if log_now and self._sync_cuda is not None:
            torch.cuda.synchronize(self._sync_cuda)  # SYNC: once per logging step, for an exact window
        now = time.perf_counter()
        self._step_times.append(now - self._batch_start)
        self._samples.append(self.batch_size_fn(batch))
        if self.tokens_per_batch_fn is not None:
            self._tokens.append(self.tokens_per_batch_fn(batch))
        if log_now:
            trainer.log_metrics(self.compute(), step=trainer.global_step)
        self._last_end = time.perf_counter()

    def on_train_epoch_end(self, trainer: TrainerProtocol) -> None:
        self._last_end = None  # the next epoch's first wait is measured from its start

    def on_validation_start(self, trainer: TrainerProtocol) -> None:
        self._paused_at = time.perf_counter()

    def on_validation_end(self, trainer: TrainerProtocol) -> None:
        # Validation between two batches is neither step time nor data wait: shift it out.
        if self._paused_at is not None and self._last_end is not None:
            self._last_end += time.perf_counter() - self._paused_at
        self._paused_at = None

    # --- values -----------------------------------------------------------------------------------
    def compute(self) -> dict[str, Any]:
        """The metrics over the current window (what is logged); empty before the first batch."""
        n = len(self._step_times)
        if n == 0:
            return {}
        step_total = sum(self._step_times)
        wait_total = sum(list(self._waits)[-n:])
        elapsed = max(step_total + wait_total, 1e-12)
        out: dict[str, Any] = {
            PREFIX + "samples_per_sec": _total(self._samples) / elapsed,
            PREFIX + "step_time": step_total / n,
            PREFIX + "data_wait_time": wait_total / n,
        }
        if self.tokens_per_batch_fn is not None:
            out[PREFIX + "tokens_per_sec"] = _total(self._tokens) / elapsed
        if self.flops_per_batch is not None:
            out[PREFIX + "flops_per_sec"] = self.flops_per_batch * n / elapsed
        return out


def _total(values: deque[Any]) -> Any:
    """Sum of ints and/or tensors; tensors stay on their device (read back when logged)."""
    total: Any = 0
    for v in values:
        total = total + (v.detach() if isinstance(v, torch.Tensor) else v)
    if isinstance(total, torch.Tensor) and not total.is_floating_point():
        total = total.double()
    return total
