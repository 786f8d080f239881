"""`RunDirectory`: the run a trainer holds (its directory, its lock, its `run.json`), one object with one owner.

Everything the trainer knows about its run is here: the directory (`path`, what `trainer.run_dir` returns),
whether this trainer created it or continued one (`claimed`), global rank zero's lock on it while the run
trains, whether training started in this hold of the run (then `run.json`'s status is this process's to
set), how the fit is ending (the line of the exception that ends it; a hang the watchdog recorded), a
`fast_dev_run`'s temporary root, and what deciding which run a fit opens leaves for what follows: the
checkpoint `"last"` read when it was found (`take_preloaded`) and whether a second `fit()` continues the
trainer's own run (`continues_own_run`). Only its own methods write them, and every write of the run's
`run.json` and `config.yaml` is one of them.

A new run claims a new directory (`claim_new`: rank zero creates it, a rank on its own only names it); an
existing one is taken over to continue it (`continue_run`), or given up when claimed early and never used
(`abandon`). `run.json` is written only while this process holds the run's lock. Every entry point leaves a
final status: `fit()` its outcome (`end`: "success", "failed", "interrupted"; "requeued" when a SLURM job's
requeue signal stopped it and the job was requeued, written also before the requeue: `record_outcome_now`;
"hung" when the hang watchdog ended the job: `record_hang`), with its last "global_step" and "end_reason"
(one line of how it ended: `note_end`); `validate()`/`test()`/`predict()` on a run of their own theirs, each
evaluation an entry in "evaluations" naming the checkpoint it read (`record_evaluation`). A resume that fails
before training starts (`start_training`) records its outcome in its "resumes" entry only: a finished run
stays "success". Runs that died without a word are settled ("killed") by the next run in the same `root_dir`
(`dream_trainer.utils.run_dirs.settle_dead_runs`). A run continued without its `run.json` (deleted, lost,
unreadable) gets a new one marked "rebuilt", with a warning naming the directory; a continued run's
temporary files whose writer is gone are removed (`remove_stray_files`). It registers its checkpoint entry
itself ("run_directory": the "run_dir" of the "dream_trainer" header, the run that wrote the checkpoint,
which `fit(ckpt_path="last")` continues); loading a checkpoint restores nothing here (which run continues is
decided before it loads), and a tuning run changes nothing here (no snapshot).

The trainer holds one (`RunDirectoryMixin._run_directory`, created in `_init_run_directory`). `ResumeMixin`
decides on global rank zero which run a fit opens, through these methods; `RunDirectoryMixin` keeps what the
rest of the trainer calls (`_end_run`, `_record_hang`, ...) and what needs the trainer itself: the ranks'
agreement on the run (`_on_rank_zero`) and the process identity, given to each method that depends on it
(`global_zero`, read when the method is called: a trainer's rank may be set after it is constructed). It
knows nothing else of the trainer: the config, the loop (the global step a run ends at), the line it prints
and the state registry are given. Nothing here runs on the per-step path.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dream_trainer.errors import ConfigError, DreamTrainerError
from dream_trainer.run_state import StateOwner, StateRegistry
from dream_trainer.utils.run_dirs import (
    RUN_FILE,
    RunInUseError,
    RunLock,
    abandon_if_unused,
    check_writable,
    claim_run_dir,
    mark_killed,
    new_record,
    next_free_run_dir,
    now,
    read_record,
    rebuilt_record,
    remove_stray_files,
    settle_dead_runs,
    write_config,
    write_record,
)
from dream_trainer.utils.warn import warn_user

if TYPE_CHECKING:
    from dream_trainer.config import DreamTrainerConfig
    from dream_trainer.loop_state import LoopState


class RunDirectory:
    """The run of one trainer (see the module docstring). Read `path`, `claimed` and `continues_own_run`
    anywhere; everything changes through its methods.

    Args:
        config: the trainer's config (`root_dir`, `run_name`, `fast_dev_run`; a new run's `config.yaml`).
        loop: the trainer's `LoopState` (the global step a run ends at).
        announce: prints one line on stderr on global rank zero (`RunDirectoryMixin._announce_run`).
        registry: the trainer's state registry, where it registers its checkpoint entry ("run_directory").
    """

    __slots__ = (
        "__weakref__", "_announce", "_config", "_end_reason", "_hung", "_lock", "_loop", "_preloaded",
        "_scratch_root", "_training", "claimed", "continues_own_run", "path",
    )  # fmt: skip

    def __init__(
        self,
        config: DreamTrainerConfig,
        loop: LoopState,
        announce: Callable[[str], None],
        registry: StateRegistry,
    ) -> None:
        self._config, self._loop, self._announce = config, loop, announce
        self.path: Path | None = None
        """The run's directory, once this trainer claimed or continued one (`trainer.run_dir`)."""
        self.claimed: bool = False
        """This trainer created the run directory (vs continued one): its loggers start afresh."""
        self.continues_own_run: bool = False
        """`fit(ckpt_path="last")` of a trainer that already trained this run (a second `fit()`): its loggers,
        attached already, go back to the checkpoint's step (rank zero's decision; only it logs)."""
        self._lock: RunLock | None = None  # rank zero's lock on the run while it trains
        # Training started in this hold of the run: run.json's status is this process's to set. False
        # while a continued run is only being resumed (a failed resume leaves the status as it was).
        self._training: bool = False
        self._hung: bool = False  # the hang watchdog recorded "hung": the run's final status stays that
        self._end_reason: str | None = None  # how fit() ended, when an exception ended it (note_end)
        self._scratch_root: Path | None = None  # fast_dev_run: a temporary root, deleted afterwards
        self._preloaded: tuple[Path, dict[str, Any]] | None = None  # the checkpoint "last" read, and its state
        # A checkpoint names the run that wrote it; loading one restores nothing here (which run continues
        # is decided before it loads: `ResumeMixin._open_run`). A tuning run claims no run.
        registry.register("run_directory", StateOwner(self.state_dict, _nothing_to_load))

    def state_dict(self) -> dict[str, Any]:
        # The run that wrote it: "last" continues that run when the file is not in a run directory.
        run_dir = os.path.abspath(self.path) if self.path is not None else None
        return {"dream_trainer": {"run_dir": run_dir}}

    # --- where runs are -------------------------------------------------------------------------------
    @property
    def root(self) -> Path:
        """The directory of the runs: `config.root_dir`; a temporary one for `fast_dev_run`."""
        config = self._config
        if config.fast_dev_run:  # nothing of a smoke test is kept: its run lives in a temporary root
            if self._scratch_root is None:
                self._scratch_root = Path(tempfile.mkdtemp(prefix="dream_trainer-fast_dev_run-"))
                weakref.finalize(self, shutil.rmtree, self._scratch_root, True)  # with the trainer holding it
                self._announce(
                    f"fast_dev_run: {config.limit_train_batches} batch(es) of each loop, one epoch; "
                    "nothing is kept (no loggers, no checkpoints, a temporary run directory)"
                )
            return self._scratch_root
        return Path(os.fspath(config.root_dir))

    def next_free(self) -> Path:
        """The directory a new run would get now, claimed by nothing."""
        return next_free_run_dir(self.root, self._config.run_name)

    def _root_error(self, exc: OSError) -> ConfigError:
        return ConfigError(
            f"{type(self._config).__name__}.root_dir = {os.fspath(self._config.root_dir)!r}: cannot create a run "
            f"directory there ({exc.strerror or exc}). Make it writable, or choose another root_dir."
        )

    def check_root_writable(self) -> None:
        """Before anything is built: fail now if no run directory can be created under `root_dir`."""
        if self.path is not None:
            return
        try:
            check_writable(self.root)
        except OSError as exc:
            raise self._root_error(exc) from exc

    # --- which run ------------------------------------------------------------------------------------
    def claim_new(self, global_zero: bool, **record: Any) -> None:
        """Create a new run directory (never one that exists), lock it, write `run.json` (with `record`'s
        fields) and `config.yaml`. A rank other than global rank zero only names it."""
        if not global_zero:  # only rank zero writes: a rank on its own names the run, creates nothing
            self.path = self.next_free()
            self.claimed = True
            return
        try:
            path = claim_run_dir(self.root, self._config.run_name)
            self._take(path, global_zero)
            write_record(path, new_record(path.name, id=uuid.uuid4().hex, **record))
            write_config(path, self._config.to_dict())
        except OSError as exc:
            raise self._root_error(exc) from exc
        self.claimed = True
        self._training = True  # a new run: its status is "running" from the start
        self._settle_dead_runs(path)

    def use(self, path: Path) -> None:
        """Every rank: the run directory global rank zero chose (see `ResumeMixin._open_run`)."""
        self.path = path

    def hold(self, global_zero: bool) -> None:
        """The run this trainer has, held again for a second `fit()` (its lock, unless held already)."""
        assert self.path is not None
        if self._lock is None:
            self._take(self.path, global_zero)

    def abandon(self) -> None:
        """Give up a run this trainer claimed but did not use (another run is continued instead)."""
        if self.path is not None and self.claimed:
            if self._lock is not None:
                self._lock.release()
                self._lock = None
            abandon_if_unused(self.path)
            self.path = None
            self.claimed = False

    def continue_run(self, path: Path, checkpoint: Path, global_zero: bool, strategy: str) -> None:
        """Take over the existing run at `path` (to resume it from `checkpoint`): its lock, and a line in
        its `run.json` (a new one, marked rebuilt, when it has none or an unreadable one); the temporary
        files its dead processes left are removed. Raises `DreamTrainerError` when another live process
        holds the run."""
        self._take(path, global_zero)
        self.claimed = False
        if not global_zero:
            return
        record = read_record(path) or self._rebuilt_record(path)
        mark_killed(record)  # its last process died holding it ("running"): we hold its lock now
        previous = record.get("resumes")
        resumes: list[Any] = previous if isinstance(previous, list) else []
        resumes.append({"time": now(), "checkpoint": str(checkpoint), "pid": os.getpid(), "strategy": strategy})
        record.update(resumes=resumes)  # the status changes when training starts (start_training)
        try:
            write_record(path, record)
        except OSError as exc:
            raise self._root_error(exc) from exc
        strays = remove_stray_files(path)  # under the lock: no process of this run writes them any more
        if strays:
            self._announce(f"run {path}: removed {len(strays)} temporary file(s) of processes that are gone")
        self._settle_dead_runs(path)

    def _take(self, path: Path, global_zero: bool) -> None:
        if not global_zero:  # rank zero holds the lock for the whole job
            self.path = path
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
        if self._lock is not None:
            self._lock.release()
        self._lock = lock
        self.path = path
        self._training = False

    def _rebuilt_record(self, path: Path) -> dict[str, Any]:
        """Rank zero, holding the run's lock: the record of a run continued without a readable `run.json`
        (`rebuilt_record`); an unreadable one is kept beside it, as `run.json.unreadable`."""
        why = "unreadable" if (path / RUN_FILE).exists() else "missing"
        if why == "unreadable":
            try:
                os.replace(path / RUN_FILE, path / f"{RUN_FILE}.unreadable")
            except OSError as exc:
                raise self._root_error(exc) from exc
        warn_user(
            f"run {str(path)!r} has checkpoints but its run.json was {why}: continuing it with a new run.json "
            'marked "rebuilt" (its earlier history is lost). To start afresh instead, call fit() without ckpt_path.'
        )
        return rebuilt_record(path, why)

    def _settle_dead_runs(self, own: Path) -> None:
        """Rank zero, once it holds its run: mark the runs of `root_dir` that died without recording
        it "killed" and remove their partial files (see `settle_dead_runs`)."""
        settled = settle_dead_runs(self.root, skip=own)
        if settled:
            names = ", ".join(settled[:5]) + (f" and {len(settled) - 5} more" if len(settled) > 5 else "")
            self._announce(
                f"marked {len(settled)} run(s) that died without recording it 'killed' in run.json and "
                f"removed their partial checkpoint files: {names}"
            )

    # --- what the decision leaves for the fit ---------------------------------------------------------
    def preload(self, path: Path, state: dict[str, Any]) -> None:
        """The checkpoint "last" found, and the state read from it, kept for the load that follows."""
        self._preloaded = (path, state)

    def take_preloaded(self, path: str | os.PathLike[str]) -> dict[str, Any] | None:
        """The state of the checkpoint at `path` when finding it read it already (`preload`), else None;
        forgotten either way, so a later load reads the file again."""
        preloaded, self._preloaded = self._preloaded, None
        if preloaded is None or Path(preloaded[0]) != Path(path):
            return None
        return preloaded[1]

    def note_continues_own_run(self, continues: bool) -> None:
        """Rank zero's decision for this fit: it continues the trainer's own run, whose loggers are attached."""
        self.continues_own_run = continues

    # --- run.json -------------------------------------------------------------------------------------
    def start_training(self) -> None:
        """`fit()`, once its checkpoint is loaded and training starts: the run is "running" again."""
        self._training = True
        if self._lock is None or self.path is None:
            return
        record = read_record(self.path)
        if record and record.get("status") != "running":
            record.update(status="running")
            record.pop("ended", None)
            try:
                write_record(self.path, record)
            except OSError as exc:
                raise self._root_error(exc) from exc

    def note_end(self, exc: BaseException) -> None:
        """`fit()` is ending by `exc`: the one line `end` writes as run.json's "end_reason" (what
        `dream-trainer runs` shows)."""
        self._end_reason = how_it_ended(exc, self._loop.global_step)

    def end(self, status: str) -> None:
        """End of fit: record how the run ended (its status, last global step and one line: "end_reason")
        and release its lock (rank zero holds it). A resume that failed before training started records
        its outcome in its "resumes" entry only."""
        lock, self._lock = self._lock, None
        reason, self._end_reason = self._end_reason, None
        if lock is None or self.path is None:
            return
        try:
            self._write_outcome(status, reason, ends_resume=True)
        finally:
            lock.release()

    def record_outcome_now(self, status: str, reason: str) -> None:
        """The run is ending as `status` and its process may be ended from outside before `fit()` returns
        (a requeued SLURM job: Slurm sends SIGTERM, then SIGKILL, to the job step seconds after `scontrol
        requeue`, while the trainer ends under torchrun's own timeout): run.json says so now. The end of
        `fit()` writes it again (`end`). Rank zero, which holds the run's lock; nothing elsewhere."""
        if self._lock is not None and self.path is not None:
            self._write_outcome(status, reason, ends_resume=False)

    def _write_outcome(self, status: str, reason: str | None, ends_resume: bool) -> None:
        assert self.path is not None
        try:
            record = read_record(self.path)
            if record:
                resumes = record.get("resumes")
                if ends_resume and isinstance(resumes, list) and resumes and isinstance(resumes[-1], dict):
                    resumes[-1].setdefault("outcome", status)
                if self._training and not self._hung:
                    step = self._loop.global_step
                    reason = reason or f"finished at global step {step}"
                    record.update(status=status, ended=now(), global_step=step, end_reason=reason)
                write_record(self.path, record)
        except OSError as exc:  # a full disk must not hide the run's own outcome
            print(f"dream_trainer: could not update {self.path / 'run.json'}: {exc}", file=sys.stderr)

    def record_hang(self, hang: dict[str, Any]) -> None:
        """The hang watchdog named the stuck rank(s) and is about to end the job (global rank zero, from
        the watchdog's thread): run.json says "hung", its "end_reason" is the verdict's line and "hang"
        the verdict (each stuck rank, where it was, for how long); the status stays so whatever the main
        thread records after (`end`). A resume that had not started training records it in its
        "resumes" entry only."""
        self._hung = True
        if self._lock is None or self.path is None:
            return
        record = read_record(self.path)
        if not record:
            return
        resumes = record.get("resumes")
        if isinstance(resumes, list) and resumes and isinstance(resumes[-1], dict):
            resumes[-1].setdefault("outcome", "hung")
        if self._training:
            step = self._loop.global_step
            record.update(status="hung", ended=now(), global_step=step, end_reason=hang.get("line"))
        record.update(hang=hang)
        write_record(self.path, record)

    def record(self, key: str, value: Any) -> None:
        """Set run.json's `key` to `value` now (the skipped batches; rare events only: one file write),
        while this process holds the run's lock; nothing otherwise (a tuning run, another rank)."""
        if self._lock is None or self.path is None:
            return
        try:
            record = read_record(self.path)
            if record:
                record[key] = value
                write_record(self.path, record)
        except OSError as exc:  # a full disk must not end the run over its record
            print(f"dream_trainer: could not update {self.path / 'run.json'}: {exc}", file=sys.stderr)

    def record_evaluation(
        self, entry: str, checkpoint: Path | None, outcome: str, inside_fit: bool, global_zero: bool
    ) -> None:
        """End of `validate()`/`test()`/`predict()` (rank zero): an entry in run.json's "evaluations"
        naming the checkpoint it read; a run the evaluation opened gets its final status. Outside
        `fit()` the run's lock is taken for the write and released after it."""
        if not global_zero or self.path is None:
            return
        lock = self._lock
        if lock is None:
            lock = RunLock(self.path)
            if not lock.try_acquire():
                return  # another process holds the run: its record is that process's to write
        try:
            record = read_record(self.path)
            if record:
                previous = record.get("evaluations")
                evaluations: list[Any] = previous if isinstance(previous, list) else []
                evaluations.append(
                    {
                        "entry": entry,
                        "checkpoint": None if checkpoint is None else str(checkpoint),
                        "time": now(),
                        "pid": os.getpid(),
                        "outcome": outcome,
                    }
                )
                record.update(evaluations=evaluations)
                if not inside_fit and record.get("status") == "running":  # opened by this evaluation
                    record.update(status=outcome, ended=now())
                write_record(self.path, record)
        except OSError as exc:
            print(f"dream_trainer: could not update {self.path / 'run.json'}: {exc}", file=sys.stderr)
        finally:
            if not inside_fit:
                self._lock = None
                lock.release()


def _nothing_to_load(checkpoint: Mapping[str, Any]) -> None:
    return None


def how_it_ended(exc: BaseException, global_step: int) -> str:
    """One line for run.json: a signal's stop line (what stopped, the checkpoint, requeued or how to
    resume), or the exception's type and first line."""
    summary = getattr(exc, "summary", None)  # TrainingInterrupted's: the line printed when it stopped
    if callable(summary):
        return str(summary(global_step))
    lines = str(exc).strip().splitlines()
    first = f": {lines[0]}" if lines else ""
    return f"{type(exc).__name__}{first} (global step {global_step})"[:300]
