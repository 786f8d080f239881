"""`DreamTrainer`: the mixins plus the loop. `fit()` is a template method; change behaviour through
`configure_*`, `training_step`/`validation_step`, hooks, callbacks or `training_loop()`."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from dream_trainer.config import DreamTrainerConfig
from dream_trainer.datamodule import DataModule, call_stage_hook
from dream_trainer.errors import LoggerWriteError, MisconfigurationError, TrainingInterrupted
from dream_trainer.fault_tolerance import FaultTolerance, Rejoined, check_fault_tolerance
from dream_trainer.loop_state import LoopState
from dream_trainer.mixins.amp import AMPMixin
from dream_trainer.mixins.checkpoint import CheckpointMixin
from dream_trainer.mixins.distributed import DistributedMixin
from dream_trainer.mixins.evaluation import EvaluationMixin
from dream_trainer.mixins.hooks import HooksMixin
from dream_trainer.mixins.logging import LoggingMixin
from dream_trainer.mixins.metrics import MetricsMixin
from dream_trainer.mixins.optimization import OptimizationMixin
from dream_trainer.mixins.parallelism import ParallelismMixin
from dream_trainer.mixins.setup import SetupMixin, wrap_load_checkpoint
from dream_trainer.mixins.step import StepMixin, wrap_steps
from dream_trainer.run_state import StateOwner
from dream_trainer.run_watch import Found, RunWatch, process_group_store
from dream_trainer.stop_control import StopControl
from dream_trainer.utils.checkpoint_verify import verify_finite, verify_sections
from dream_trainer.utils.data import release_workers
from dream_trainer.utils.data_resume import capture_epoch_rng, keeps_own_position, resumed_iterator, set_epoch
from dream_trainer.utils.seed import rng_state, set_rng_state
from dream_trainer.utils.warn import warn_user

_END = object()


class DreamTrainer(
    # Most derived first: each mixin inherits those it uses (see dream_trainer.mixins.core).
    EvaluationMixin,
    StepMixin,
    CheckpointMixin,
    SetupMixin,
    LoggingMixin,
    ParallelismMixin,
    OptimizationMixin,
    AMPMixin,
    MetricsMixin,
    DistributedMixin,
    HooksMixin,
):
    """Subclass it, assign models in `__init__`/`configure_models`, optimizers in
    `configure_optimizers`, return loaders from `configure_dataloaders`, write `training_step`
    (and `validation_step`), then call `fit()`.

    Attributes a loop or callback may read: `global_step` (completed training steps), `current_epoch`,
    `batch_idx`, `is_optimizer_step_end` (in `on_train_batch_end`: this micro-batch ended a training
    step), `should_stop` (set it to end training), `sanity_checking`, `callback_metrics`,
    `device`, `world_size`, `global_rank`, `is_global_zero`.
    """

    def __init__(self, config: DreamTrainerConfig, datamodule: DataModule | None = None) -> None:
        # Each `_init_*` creates its mixin's attributes and registers the run state it owns; the order of
        # the registrations is the order a checkpoint restores them in (see dream_trainer.run_state).
        self._init_core(config)  # config, callbacks, loop state, bus, should_stop, the state registry
        self._init_setup(datamodule)
        self._init_process_identity()
        self._init_stop_control()  # the batch boundary and the signals acted on there
        self._init_fault_tolerance()  # the quorum each step commits through, with fault_tolerance set
        self._init_precision()
        self._init_optimization()
        self._init_bad_batches()  # the bad-batch policy: spike detector, skip list, rollback
        self._init_logging()
        self._init_metrics()
        self._init_checkpointing()
        self._init_run_watch()
        self._init_parallelism()
        self._init_evaluation()

    def _init_stop_control(self) -> None:
        """The batch boundary, where a step commits, and the stop a signal asks for there
        (`dream_trainer.stop_control`): given the loop and the trainer's reaction to a signal
        (`CheckpointMixin._stop_on_signal`: save, then raise `TrainingInterrupted`)."""
        self._stop_control: StopControl = StopControl(self.config, self._loop, self._stop_on_signal)

    def _init_fault_tolerance(self) -> None:
        """Per-step fault tolerance across replica groups (`dream_trainer.fault_tolerance`), with the setting on:
        given the loop, the run state as a checkpoint holds it (what a healing replica receives) and run.json's
        writer; its own state (the global sample cursor, the torchft manager's step) is registered here."""
        cfg = self.config.fault_tolerance
        self._fault_tolerance: FaultTolerance | None = None
        if cfg is None:
            return
        check_fault_tolerance()  # torchft installed
        cfg.resolved()  # the lighthouse and this group's id, from the setting or the environment, or a ConfigError
        ft = FaultTolerance(
            cfg, self.config.seed or 0, self._loop, self.state_dict, self._heal_from, self._record_in_run
        )
        self._fault_tolerance = ft
        self._state_owners.register("fault_tolerance", StateOwner(ft.checkpoint_entries, ft.load_checkpoint))

    def _heal_from(self, state: dict[str, Any]) -> None:
        """A live replica's run state, received at a quorum: verified as a checkpoint file is (its sections, finite
        weights), then loaded as one (the loop continues from it)."""
        received = Path("the run state received from a live replica group")
        verify_sections(received, state, with_tensors=True)
        verify_finite(received, state)
        self.load_state_dict(state)
        self._stop_control.reset()

    def _init_run_watch(self) -> None:
        """The hang watchdog of a distributed `fit()` (`dream_trainer.run_watch`), and what the training step
        marks for it (`_step_marks`: nothing while no watchdog reads it)."""
        self._run_watch: RunWatch = RunWatch(
            self.config,
            self._loop,
            find_store=self._watchdog_store,
            local_signal=self._stop_control.signal_now,
            stacks_dir=self._stacks_dir,
            record_hang=self._record_hang,
            end_process=self._end_process,
        )
        self._step_marks = None

    def _watchdog_store(self) -> Found | None:
        """(store, rank, world size) the watchdog talks through: the process group's store, on several
        processes; None on one (nothing to watch)."""
        return process_group_store(self.global_rank, self.world_size) if self.is_distributed else None

    def _stacks_dir(self) -> Path:
        run_dir = self._run_directory.path
        return run_dir if run_dir is not None else Path(os.fspath(self.config.root_dir))

    def _end_process(self, code: int) -> None:
        """How the watchdog ends a hung process: at once, whatever its main thread is doing (blocked in a
        collective, ignoring SIGTERM)."""
        os._exit(code)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Once per subclass, at its creation: its own steps become `StepMethod`s (once set up,
        `self.training_step` is the full step around them), and a `load_checkpoint` override sets the
        trainer up first (the Trainer Guide's touches `self.optimizer`)."""
        super().__init_subclass__(**kwargs)
        wrap_steps(cls)
        wrap_load_checkpoint(cls)

    # --- the loop's position (owned by `self._loop`) ------------------------------------------------
    @property
    def loop(self) -> LoopState:
        """Where the training loop is: epoch, global step, position in the accumulation window, and
        the questions callbacks ask (`loop.step_ended`, `loop.is_logging_step`). Read-only."""
        return self._loop

    @loop.setter
    def loop(self, value: Any) -> None:
        raise AttributeError(
            f"trainer.loop is the trainer's LoopState (read-only); cannot assign {type(value).__name__} to it. "
            "Store your own value under another attribute name."
        )

    @property
    def global_step(self) -> int:
        """Completed training steps (accumulation windows); `loop.global_step`."""
        return self._loop.global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self._loop.move_to(global_step=value)

    @property
    def current_epoch(self) -> int:
        """The epoch being trained (0-based); `loop.epoch`."""
        return self._loop.epoch

    @current_epoch.setter
    def current_epoch(self, value: int) -> None:
        self._loop.move_to(epoch=value)

    @property
    def batch_idx(self) -> int:
        """Index of the current training batch in its epoch; `loop.batch_idx`."""
        return self._loop.batch_idx

    @property
    def num_training_batches(self) -> int | None:
        """Batches in one training epoch after `limit_train_batches`; None when the loader has no
        length, or before `configure_dataloaders` ran (in `fit()`)."""
        return None if self._train_loader_raw is None else self._epoch_length()

    # --- the template method ----------------------------------------------------------------------
    def fit(self, ckpt_path: str | os.PathLike[str] | None = None, datamodule: DataModule | None = None) -> None:
        """Train: setup, optional resume, sanity check, `training_loop()`, teardown.

        `datamodule` (or the one given to the constructor) supplies the loaders instead of
        `configure_dataloaders`.

        The run writes only into its own directory, `run_dir` (printed on stderr at the start).
        `ckpt_path` (default `config.resume_from`) is `"last"`: the newest run under `root_dir` (of
        `run_name`, when set) continues from its newest valid checkpoint, in its own directory (none:
        a new run from scratch); or a checkpoint file: a new run starts from it. On an exception
        `on_exception` fires, `teardown` still runs, and the exception propagates unchanged.
        """
        if datamodule is not None:
            self._use_datamodule(datamodule)
        status = outcome = "failed"
        frozen = self._freeze_preexisting_objects()
        try:
            stop = self._stop_control
            stop.install(self.is_global_zero)  # first: a signal during setup is recorded, never fatal
            self._check_root_writable()  # before any model is built
            problem = self._no_training_step()
            if problem is not None:  # known from the class: before any model is built
                raise MisconfigurationError(problem)
            self._setup_fit()
            self._require_fit_ready()  # no training_step, optimizer or training loader
            self._enter_stage("fit")  # when validate()/test() set the trainer up first
            # Distributed: the hang watchdog (the step marks where it is for it); the ranks agree on a signal
            # through its store.
            watchdog = self._run_watch.start(self._heartbeat)
            self._step_marks = self._heartbeat if watchdog is not None else None
            stop.settle(self.is_distributed, watchdog)
            if ckpt_path is None:
                ckpt_path = self.config.resume_from
            resolved = self._open_run(ckpt_path)
            self._arm_step_output_check()
            stop.reset()
            if resolved is not None:
                self.load_checkpoint(resolved)
            self._attach_loggers(back_to_checkpoint=self._run_directory.continues_own_run)
            bus = self._bus
            bus.fire("on_fit_start")
            self._run_sanity_check()
            self._start_run_training()  # run.json: "running" (a resume that failed before this changes no status)
            self._start_lr_at_step()  # lr_at_step's rate of the first step (LearningRateMonitor logs it next)
            bus.fire("on_train_start")
            loop = self._loop
            if self.config.val_at_start and loop.global_step == 0 and loop.last_val_step != 0:
                self.validation_loop()  # a real validation at step 0, logged (not the sanity check)
            stop.stop_before_training()  # a signal during setup: save and stop, before any step
            with torch.autograd.detect_anomaly() if self.config.detect_anomaly else contextlib.nullcontext():
                if self._fault_tolerance is None:
                    self.training_loop()
                else:
                    self._fault_tolerant_training()
            unfinished = self._unfinished_epoch_means()  # None unless training stopped inside an epoch
            stop.boundary()  # a custom loop's last batch (the default loop ran it already)
            bus.fire("on_train_end")
            if unfinished is not None:  # its line, where the progress display was (it closed in on_train_end)
                self._print_epoch_summary(unfinished, self._val_ran_in_epoch)
            end_line = self._fit_end_line()
            if end_line is not None and self.config.print_epoch_summary and self.is_global_zero:
                print(end_line, flush=True)
            bus.fire("on_fit_end")
            if unfinished is not None:
                self._leave_epoch_unfinished()
            self._quiesce_distributed()
            status = "success"
        except BaseException as exc:
            outcome = exc.outcome if isinstance(exc, TrainingInterrupted) else "failed"  # or "requeued"
            self._note_run_end(exc)  # run.json's one line of how the run ended
            self._bus.fire_safely("on_exception", exc)
            raise
        finally:
            try:
                self._teardown(status, outcome if status == "failed" else status)
            finally:
                if frozen:
                    gc.unfreeze()

    def _fault_tolerant_training(self) -> None:
        """`training_loop()` as a replica group (`fault_tolerance` set): the first quorum first (a replica behind
        the others heals there, as from a checkpoint); a replica that falls behind later heals at a step's quorum
        and the loop starts again from the state it received (`Rejoined`)."""
        ft = self._fault_tolerance
        assert ft is not None
        ft.start(self.global_rank, self.world_size, self.run_dir)
        ft.join()
        while True:
            try:
                self.training_loop()
                return
            except Rejoined:
                self._window.discard()
                continue

    def _teardown(self, status: str, outcome: str) -> None:
        # status ("success"/"failed") goes to the loggers; outcome (also "interrupted") to run.json.
        # The signal handlers stay until the end: a second Ctrl-C while an interrupted run ends waits.
        self._setup_stages.discard("fit")
        self._bus.fire_safely("teardown", "fit")
        if self.datamodule is not None:
            try:
                call_stage_hook(self.datamodule.teardown, "fit")
            except Exception as exc:  # like a failing teardown hook: reported, the run's outcome stands
                print(f"dream_trainer: datamodule.teardown raised {exc!r}", file=sys.stderr)
        try:
            try:
                self._flush_pending_logs()
                self._release_held_logs(False)  # "rollback": a fit that ended inside an epoch's batches
            except LoggerWriteError as exc:
                if status == "success":
                    raise
                print(f"dream_trainer: {exc}", file=sys.stderr)  # the run's own error is the one raised
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
        except BaseException as exc:
            if status == "success":  # a run whose end failed (a log or a background save not written)
                outcome = "failed"
                self._note_run_end(exc)
            raise
        finally:
            try:
                self._finalize_loggers(status)
            except BaseException as exc:
                if status == "success":
                    outcome = "failed"
                    self._note_run_end(exc)
                raise
            finally:
                try:
                    self._run_watch.stop()  # first: a hang verdict cannot overwrite the record below
                    self._step_marks = None
                    if self._fault_tolerance is not None:
                        self._fault_tolerance.close()  # its counts in run.json, before the run's end is written
                    mirror = self._mirror if self._mirror is not None and self._mirror.attached else None
                    deadline = time.monotonic() + (mirror.config.flush_timeout_s if mirror is not None else 0.0)
                    if mirror is not None:  # the checkpoints first (a signal's too), then its counts in run.json
                        mirror.drain(deadline - time.monotonic())
                        self._record_in_run("mirror", mirror.counts())
                    self._end_run(outcome)  # run.json says how it ended; the run's lock is released
                    if mirror is not None:
                        mirror.close(deadline)  # run.json's end and the logs reach the store too
                finally:
                    self._stop_control.restore()

    # --- the default loop -------------------------------------------------------------------------
    def training_loop(self) -> None:
        """Epochs until `n_epochs`, `max_steps` or `should_stop`, whichever comes first; override for
        full control."""
        while not self._training_done():
            before = self._loop.global_step
            # A resumed epoch may have no batch left (a checkpoint written at its last batch): it only ends.
            resumed = self._loop.pending_resume is not None
            self._run_train_epoch()
            if (
                self.config.n_epochs is None
                and not resumed
                and self._loop.global_step == before
                and not self._training_done()
            ):
                # Only max_steps limits the run, and an epoch made no step: the next would not either.
                warn_user(
                    f"max_steps={self.config.max_steps} cannot be reached: epoch {self._loop.epoch} ran no training "
                    "step (an empty training loader, or on_train_batch_start returned -1 at its first batch); "
                    "training ends here. Check the loader, or set n_epochs to bound the run.",
                )
                break

    def _unfinished_epoch_means(self) -> dict[str, float] | None:
        """After `training_loop()`: when training stopped inside an epoch, which has not ended (see
        `_run_train_epoch`), its steps since the last logging point are written now, before any final
        checkpoint (so a continued run does not write them again), and its means so far are returned for
        its summary line. None when training ended at an epoch's end."""
        if not self._loop.epoch_in_progress:
            return None
        return self._unfinished_epoch_metrics()

    def _leave_epoch_unfinished(self) -> None:
        """The end of a `fit()` that stopped inside an epoch: the loop keeps its position as the resume record
        a checkpoint written now would give (see `StateDictMixin._resume_loop`), so a later `fit()` of this
        trainer (after `trainer.should_stop = False`) continues the epoch exactly, as a new process would. An
        accumulation window it stopped in stays open, its gradients on the parameters."""
        state = {"rng": rng_state(), "metrics": self._metrics_checkpoint_state()}
        self._loop.leave_unfinished({**self._data_state(), **state})

    def _training_done(self) -> bool:
        loop, n_epochs = self._loop, self.config.n_epochs
        return self.should_stop or loop.max_steps_reached or (n_epochs is not None and loop.epoch >= n_epochs)

    def _fit_end_line(self) -> str | None:
        """Which limit ended a step-based run (`max_steps` set): printed at the end of `fit()`."""
        cfg, loop = self.config, self._loop
        if cfg.max_steps is None:
            return None  # an epoch-based run: its last epoch summary says it all
        where = f"step {loop.global_step}, epoch {loop.epoch + 1 if loop.epoch_in_progress else loop.epoch}"
        if loop.max_steps_reached:
            return f"training ended: stopped at max_steps={cfg.max_steps} ({where})"
        if cfg.n_epochs is not None and loop.epoch >= cfg.n_epochs:
            return f"training ended: n_epochs={cfg.n_epochs} reached before max_steps={cfg.max_steps} ({where})"
        if self.should_stop:
            return f"training ended: trainer.should_stop was set ({where}; max_steps={cfg.max_steps})"
        return None

    def _run_train_epoch(self) -> None:
        self._train_epoch_start()
        step = self.training_step
        loop, window = self._loop, self._window
        val_every = self.config.val_every_n_steps if self._val_loader_raw is not None else None
        stopped = False
        for batch_idx, batch in self._iter_train_batches(resume_validation=bool(val_every)):
            step(batch, batch_idx)
            if window.pos == 0:  # a window (a training step) just ended
                # (Once per step: a step fault tolerance dropped leaves global_step where its validation ran.)
                if val_every and loop.global_step % val_every == 0 and loop.global_step > max(loop.last_val_step, 0):
                    self.validation_loop()
                if loop.global_step >= loop.max_steps:
                    stopped = True
                    break
            if self.should_stop:
                stopped = True
                break
        if stopped and (loop.epoch_length is None or loop.batches_done < loop.epoch_length):
            # Stopped before the epoch's last batch (an endless loader's epoch has none): no epoch end. No
            # epoch-end validation, on_train_epoch_end or per-epoch scheduler step, and the epoch is not
            # counted: it stays open at its position, so the final checkpoint resumes inside it and a run
            # continued with a larger max_steps is exactly the uninterrupted one (see fit()).
            return
        if not self.should_stop and self.should_validate():
            self.validation_loop()
        self._train_epoch_end()

    def _iter_train_batches(self, resume_validation: bool = False) -> Iterator[tuple[int, Any]]:
        """`(batch_idx, batch)` of one epoch, `limit_train_batches` applied; after a mid-epoch resume,
        the rest of the interrupted epoch, exactly as the uninterrupted run would have seen it.

        `resume_validation` (the default loop, with `val_every_n_steps`): a checkpoint written at a
        validation step before that step's validation ran (in `on_train_batch_end`, or on a signal) runs
        it first, where the uninterrupted run did, so its results reach the loggers."""
        loader = self._train_loader_raw
        assert loader is not None
        loop, marks = self._loop, self._step_marks  # marks: None unless a hang watchdog reads them
        if marks is not None:
            marks.mark("fetching batch")  # a rank whose loader (or a worker of it) is stuck waits here
        resume = loop.take_resume()
        start = 0
        batches: Iterator[Any]
        if resume is not None and resume["epoch"] == loop.epoch:  # a checkpoint of this epoch: its rest
            batches, source, start, epoch_rng = self._resumed_batches(loader, resume, resume_validation)
        else:
            epoch_rng = None if keeps_own_position(loader) else capture_epoch_rng(loader)
            batches = source = iter(loader)
        if not start:  # a window open now (a step that raised, a checkpoint of another epoch) ends with it
            self._window.discard()
        try:
            loop.open_batches(start, epoch_rng)
            if loop.epoch_length is not None:
                batches = itertools.islice(batches, max(0, loop.epoch_length - start))
            if self._rank_batches_unchecked:  # an IterableDataset under data parallelism: once per fit
                first = next(batches, _END)
                self._check_first_batches(None if first is _END else first)
                batches = itertools.chain(() if first is _END else (first,), batches)
            numbered: Iterator[tuple[int, Any]] = enumerate(batches, start)
            bad = self._bad_batches  # the bad-batch policy (docs/bad-batches.md)
            if bad.filters_batches:  # batches to drop, or "rollback"'s kept batches and replays
                numbered = bad.batches(numbered)
            rolls_back = bad.rolls_back
            stop = self._stop_control
            for batch_idx, batch in numbered:
                loop.batch_idx = batch_idx  # in place: the per-batch counters are the hot path's (see LoopState)
                yield batch_idx, batch
                if rolls_back:  # before the boundary's saves: none holds weights a spike reached
                    bad.after_batch(stop.has_work)
                # The batch boundary (saves callbacks asked for, a signal's stop: see StopControl), after the
                # validation this batch's step ran; after the epoch's last batch, `_train_epoch_end` runs it,
                # after the epoch's validation.
                if stop.due and (loop.epoch_length is None or loop.batches_done < loop.epoch_length):
                    stop.boundary()
                if loop.skip_rest_of_epoch:  # an on_train_batch_start returned -1
                    break
                if marks is not None:
                    marks.mark("fetching batch")
        finally:  # also when the epoch was cut (max_steps, should_stop, a limit, an exception)
            release_workers(source)

    def _resumed_batches(
        self, loader: Iterable[Any], resume: dict[str, Any], resume_validation: bool
    ) -> tuple[Iterator[Any], Iterator[Any], int, dict[str, Any] | None]:
        """The rest of the epoch the mid-epoch checkpoint `resume` was written in (`_iter_train_batches`, once
        after a resume): `(batches, the loader's iterator, batches already done, the epoch's RNG)`, with the RNG
        and the epoch's training metrics put back as they were, and the validation its step missed run first
        (`resume_validation`)."""
        epoch_rng = resume["epoch_rng"]
        if epoch_rng is None and not keeps_own_position(loader):  # placed by batches, saved without an RNG
            epoch_rng = capture_epoch_rng(loader)  # (a stateful loader's): later checkpoints replay this one
        source, start = resumed_iterator(loader, resume["batches_done"], epoch_rng, resume["loader_state"])
        first = next(source, _END)  # the sampler draws its permutation here, from the epoch's RNG
        set_rng_state(resume["rng"])  # then the RNG continues as when the checkpoint was written
        if start and resume.get("metrics"):  # after the epoch start reset the training metrics
            self._restore_metrics_checkpoint_state(resume["metrics"])
        if resume_validation and self._step_validation_missed():
            self.validation_loop()  # after the RNG restore: what it draws, training draws after it too
        batches = itertools.chain(() if first is _END else (first,), source)
        return batches, source, start, epoch_rng

    def _step_validation_missed(self) -> bool:
        """At a resume: the checkpoint's step is one of `val_every_n_steps`'s, and its validation had
        not run when the checkpoint was written."""
        every, loop = self.config.val_every_n_steps, self._loop
        step = loop.global_step
        if not every or step == 0 or step % every:
            return False
        return loop.window_pos == 0 and loop.last_val_step != step

    def iter_train_epoch(self) -> Iterator[tuple[int, Any]]:
        """One training epoch as `(batch_idx, batch)`: `on_train_epoch_start` before the first batch,
        `on_train_epoch_end` (and the epoch's bookkeeping) once the loader is exhausted; limits and
        mid-epoch resume applied. `self.train_loader` iterates this; so can a custom `training_loop()`."""
        self._train_epoch_start()
        yield from self._iter_train_batches()
        self._train_epoch_end()

    def _train_epoch_start(self) -> None:
        loop = self._loop
        every = self.config.reload_dataloaders_every_n_epochs
        if every and loop.epoch > 0 and loop.epoch % every == 0 and loop.pending_resume is None:
            self._load_dataloaders()
        set_epoch(self._train_loader_raw, loop.epoch)
        loop.start_epoch(self._epoch_length())
        self._start_epoch_summary()
        self._start_epoch_validations()
        self._reset_metrics("train")
        self._bus.fire("on_train_epoch_start")

    def _train_epoch_end(self) -> None:
        self._stop_control.boundary()  # the last batch's, after the epoch's validation (see _iter_train_batches)
        loop = self._loop
        loop.finish_batches()
        self._close_window()  # a loader without a length ended inside a window: its last batch ends it
        epoch_metrics = self._end_train_epoch_metrics()
        # Before on_train_epoch_end (after this epoch's validation, so ReduceLROnPlateau sees it): a
        # checkpoint written there holds the scheduler already stepped, matching counters that resume
        # at the next epoch. Lightning steps non-plateau schedulers at the last batch, likewise before.
        self._step_epoch_schedulers()
        self._bus.fire("on_train_epoch_end")
        self._print_epoch_summary(epoch_metrics, self._val_ran_in_epoch)
        loop.end_epoch()

    def should_validate(self) -> bool:
        """True when the epoch being finished (or just finished) is due for validation."""
        every, loop = self.config.val_every_n_epochs, self._loop
        if self._val_loader_raw is None or every is None or loop.last_val_step == loop.global_step:
            return False
        epoch = loop.epoch if loop.epoch_in_progress else loop.epoch - 1
        return (epoch + 1) % every == 0
