"""`DreamTrainer`: the mixins plus the loop. `fit()` is a template method; change behaviour through
`configure_*`, `training_step`/`validation_step`, hooks, callbacks or `training_loop()`."""

from __future__ import annotations

import gc
import itertools
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dream_trainer.callbacks.bus import CallbackList, empty_bus
from dream_trainer.config import DreamTrainerConfig
from dream_trainer.mixins.amp import AMPMixin
from dream_trainer.mixins.checkpoint import CheckpointMixin
from dream_trainer.mixins.distributed import DistributedMixin
from dream_trainer.mixins.evaluation import EvaluationMixin
from dream_trainer.mixins.hooks import HooksMixin
from dream_trainer.mixins.logging import LoggingMixin
from dream_trainer.mixins.metrics import MetricsMixin
from dream_trainer.mixins.optimization import OptimizationMixin
from dream_trainer.mixins.setup import SetupMixin
from dream_trainer.mixins.signals import SignalMixin
from dream_trainer.mixins.step import StepMixin
from dream_trainer.utils.data_resume import capture_epoch_rng, has_own_state, resumed_iterator
from dream_trainer.utils.seed import set_rng_state

_END = object()


class DreamTrainer(
    SetupMixin,
    DistributedMixin,
    AMPMixin,
    OptimizationMixin,
    StepMixin,
    EvaluationMixin,
    CheckpointMixin,
    SignalMixin,
    LoggingMixin,
    MetricsMixin,
    HooksMixin,
):
    """Subclass it, assign models in `__init__`/`configure_models`, optimizers in
    `configure_optimizers`, return loaders from `configure_dataloaders`, write `training_step`
    (and `validation_step`), then call `fit()`.

    Attributes a loop or callback may read: `global_step` (completed training steps), `current_epoch`,
    `batch_idx`, `should_stop` (set it to end training), `sanity_checking`, `callback_metrics`,
    `device`, `world_size`, `global_rank`, `is_global_zero`.
    """

    def __init__(self, config: DreamTrainerConfig) -> None:
        if not isinstance(config, DreamTrainerConfig):
            raise TypeError(
                f"{type(self).__name__}(config) needs a DreamTrainerConfig (or a dataclass subclass of it); "
                f"got {type(config).__name__}"
            )
        self.config = config
        self.callbacks: CallbackList = CallbackList(config.callbacks)
        self.global_step = 0
        self.current_epoch = 0
        self.batch_idx = 0
        self.should_stop = False
        self.sanity_checking = False
        self._epoch_in_progress = False
        self._epoch_exhausted = False
        self._last_val_step = -1
        self._batches_done = 0  # batches of the current epoch whose step completed
        self._epoch_rng: dict[str, Any] | None = None  # RNG that decided this epoch's order
        self._pending_resume: dict[str, Any] | None = None  # set by load_state_dict mid-epoch
        self._bus = empty_bus()
        self._init_setup()
        self._init_process_identity()
        self._init_precision()
        self._init_optimization()
        self._init_logging()
        self._init_metrics()
        self._init_checkpointing()
        self._init_signals()
        self._max_steps = config.max_steps if config.max_steps is not None else float("inf")
        if type(self).load_checkpoint is not CheckpointMixin.load_checkpoint:
            # An override (the Trainer Guide writes one) may touch self.optimizer etc.: set up first.
            user_load = type(self).load_checkpoint.__get__(self)

            def load_checkpoint(path: Any, *args: Any, **kwargs: Any) -> Any:
                self._setup_fit()
                return user_load(path, *args, **kwargs)

            self.load_checkpoint = load_checkpoint  # type: ignore[method-assign]

    # --- what the user writes ---------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        """Compute the loss of one batch. Either call `self.backward(loss)` (and optionally
        `self.step(optimizer)`), or return the loss (a tensor, or a dict with a `"loss"` entry) and
        the trainer backpropagates and steps for you. Other scalar entries of a returned dict are logged.
        """
        raise NotImplementedError

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        """Compute validation metrics of one batch; return a dict of scalars (e.g. `{"val_loss": loss}`)."""
        raise NotImplementedError

    @property
    def run_dir(self) -> Path:
        """`config.root_dir` as a path: where checkpoints and logs of this run go."""
        return Path(os.fspath(self.config.root_dir))

    # --- the template method ----------------------------------------------------------------------
    def fit(self, ckpt_path: str | os.PathLike[str] | None = None) -> None:
        """Train: setup, optional resume, sanity check, `training_loop()`, teardown.

        `ckpt_path` (default `config.resume_from`) is a checkpoint file or `"last"`, the newest valid
        checkpoint in `checkpoint_dir` (none there: start fresh). On an exception `on_exception`
        fires, `teardown` still runs, and the exception propagates unchanged.
        """
        status = "failed"
        frozen = self._freeze_preexisting_objects()
        try:
            self._setup_fit()
            self._install_signal_handlers()
            if ckpt_path is None:
                ckpt_path = self.config.resume_from
            resolved = self._resolve_ckpt_path(ckpt_path) if ckpt_path is not None else None
            if resolved is not None:
                self.load_checkpoint(resolved)
            self._attach_loggers()
            bus = self._bus
            bus.fire("on_fit_start")
            self._run_sanity_check()
            bus.fire("on_train_start")
            self.training_loop()
            bus.fire("on_train_end")
            bus.fire("on_fit_end")
            self._quiesce_distributed()
            status = "success"
        except BaseException as exc:
            self._fire_safely("on_exception", exc)
            raise
        finally:
            try:
                self._teardown(status)
            finally:
                if frozen:
                    gc.unfreeze()

    def _fire_safely(self, hook: str, *args: Any) -> None:
        # Used on the failure path: one failing hook must neither hide the original error nor stop
        # the other hooks from running.
        for fn in getattr(self._bus, hook):
            try:
                fn(*args)
            except Exception as exc:
                print(f"dream_trainer: {hook} hook {fn!r} raised {exc!r}", file=sys.stderr)

    def _teardown(self, status: str) -> None:
        self._restore_signal_handlers()
        self._fire_safely("teardown", "fit")
        try:
            self._flush_pending_logs()
            try:
                if status == "success":
                    self._writer.close()  # a failed background save fails the run, never silently
                else:
                    try:
                        self._writer.close()
                    except Exception as exc:
                        print(f"dream_trainer: {exc}", file=sys.stderr)
            finally:
                self._step_fence.release()
        finally:
            if self.is_global_zero:
                for lg in self._loggers:
                    lg.finalize(status)

    # --- the default loop -------------------------------------------------------------------------
    def training_loop(self) -> None:
        """Epochs until `n_epochs`, `max_steps` or `should_stop`; override for full control."""
        while not self._training_done():
            self._run_train_epoch()

    def _training_done(self) -> bool:
        n_epochs = self.config.n_epochs
        return (
            self.should_stop
            or self.global_step >= self._max_steps
            or (n_epochs is not None and self.current_epoch >= n_epochs)
        )

    def _run_train_epoch(self) -> None:
        self._train_epoch_start()
        step = self.training_step
        max_steps = self._max_steps
        val_every = self.config.val_every_n_steps if self._val_loader_raw is not None else None
        for batch_idx, batch in self._iter_train_batches():
            step(batch, batch_idx)
            if self._window_pos == 0:  # a window (a training step) just ended
                if val_every and self.global_step % val_every == 0:
                    self.validation_loop()
                if self.global_step >= max_steps:
                    break
            if self.should_stop:
                break
        if not self.should_stop and self.should_validate():
            self.validation_loop()
        self._train_epoch_end()

    def _iter_train_batches(self) -> Iterator[tuple[int, Any]]:
        """`(batch_idx, batch)` of one epoch, `limit_train_batches` applied; after a mid-epoch resume,
        the rest of the interrupted epoch, exactly as the uninterrupted run would have seen it."""
        loader = self._train_loader_raw
        assert loader is not None
        resume, self._pending_resume = self._pending_resume, None
        start = 0
        batches: Any
        if resume is not None and resume["epoch"] == self.current_epoch:
            self._epoch_rng = resume["epoch_rng"]
            batches, start = resumed_iterator(
                loader, resume["batches_done"], resume["epoch_rng"], resume["loader_state"]
            )
            first = next(batches, _END)  # the sampler draws its permutation here, from the epoch's RNG
            set_rng_state(resume["rng"])  # then the RNG continues as when the checkpoint was written
            if start:
                self._restore_window(resume["window"])
                if resume.get("metrics"):  # after the epoch start reset the training metrics
                    self._restore_metrics_checkpoint_state(resume["metrics"])
            batches = itertools.chain(() if first is _END else (first,), batches)
        else:
            self._epoch_rng = None if has_own_state(loader) else capture_epoch_rng(loader)
            batches = iter(loader)
        self._batches_done = start
        if self._epoch_len is not None:
            batches = itertools.islice(batches, max(0, self._epoch_len - start))
        for batch_idx, batch in enumerate(batches, start):
            self.batch_idx = batch_idx
            yield batch_idx, batch

    def _train_epoch_start(self) -> None:
        loader: Any = self._train_loader_raw
        for holder in (loader, getattr(loader, "batch_sampler", None)):
            sampler = getattr(holder, "sampler", None)
            if hasattr(sampler, "set_epoch"):  # DistributedSampler reshuffles per epoch
                sampler.set_epoch(self.current_epoch)
        self._epoch_len = self._epoch_length()
        self._window_pos = 0
        self._epoch_in_progress = True
        self._epoch_exhausted = False
        self._val_ran_in_epoch = {}
        self._epoch_started_at = time.perf_counter()
        self._reset_metrics("train")
        for fn in self._bus.on_train_epoch_start:
            fn()

    def _train_epoch_end(self) -> None:
        self._epoch_exhausted = True
        if self._window_pos:  # a loader without a length ended inside a window: close it
            self._window_end = True
            self._auto_step()
            self._end_window()
        epoch_metrics = self._end_train_epoch_metrics()
        # Before on_train_epoch_end (after this epoch's validation, so ReduceLROnPlateau sees it): a
        # checkpoint written there holds the scheduler already stepped, matching counters that resume
        # at the next epoch. Lightning steps non-plateau schedulers at the last batch, likewise before.
        self._step_epoch_schedulers()
        self._bus.fire("on_train_epoch_end")
        self._print_epoch_summary(epoch_metrics)
        self._epoch_in_progress = False
        self.current_epoch += 1

    def should_validate(self) -> bool:
        """True when the epoch being finished (or just finished) is due for validation."""
        every = self.config.val_every_n_epochs
        if self._val_loader_raw is None or every is None or self._last_val_step == self.global_step:
            return False
        epoch = self.current_epoch if self._epoch_in_progress else self.current_epoch - 1
        return (epoch + 1) % every == 0
