"""RunDirectoryMixin: the run directory (`run_dir`), its lock and its `run.json`.

The lowest layer that writes files owns the run directory: this mixin claims a new one (rank zero
creates it, every rank agrees on its name) or takes over an existing one to continue it, holds its
lock while the run trains and records in `run.json` how the run ended. Which run a resume continues is
`ResumeMixin`'s decision (made through the methods here, which alone write the run's fields);
`LoggingMixin` attaches the loggers to the directory. A checkpoint records the run that wrote it (the
"run_dir" of its "dream_trainer" header): what `fit(ckpt_path="last")` continues.

`run.json` is written only while this process holds the run's lock. Every entry point leaves a final
status: `fit()` its outcome ("success", "failed", "interrupted"; "requeued" when a SLURM job's requeue
signal stopped it and the job was requeued; "hung" when the hang watchdog ended the job:
`_record_hang`), with its last "global_step" and "end_reason" (one line of how it ended);
`validate()`/`test()`/`predict()` on a run of their own theirs, each evaluation an entry in
"evaluations" naming the checkpoint it read. A resume that fails before training starts ("resumes"
entry, outcome "failed") leaves the run's status as it was: a finished run stays "success". Runs that
died without a word are settled ("killed") by the next run in the same `root_dir`
(`dream_trainer.utils.run_dirs.settle_dead_runs`). A run continued without its `run.json` (deleted,
lost, unreadable) gets a new one marked "rebuilt", with a warning naming the directory; a continued
run's temporary files whose writer is gone are removed (`remove_stray_files`).
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
from typing import Any, TypeVar

from dream_trainer.errors import ConfigError, DreamTrainerError
from dream_trainer.mixins.distributed import DistributedMixin
from dream_trainer.run_state import StateOwner
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

_T = TypeVar("_T")


class RunDirectoryMixin(DistributedMixin):
    """Owns `run_dir`: every run writes only into its own directory (see `dream_trainer.utils.run_dirs`)."""

    def _init_run_directory(self) -> None:
        self._run_dir: Path | None = None
        self._run_lock: RunLock | None = None  # rank zero's lock on the run while it trains
        self._run_claimed: bool = False  # this trainer created the run directory (vs continued one)
        # Training started in this hold of the run: run.json's status is this process's to set. False
        # while a continued run is only being resumed (a failed resume leaves the status as it was).
        self._run_training: bool = False
        self._scratch_root: Path | None = None  # fast_dev_run: a temporary root, deleted afterwards
        self._run_hung: bool = False  # the hang watchdog recorded "hung": the run's final status stays that
        self._run_end_reason: str | None = None  # how fit() ended, when an exception ended it (_note_run_end)
        # A checkpoint names the run that wrote it; loading one restores nothing here (which run continues
        # is decided before it loads: `ResumeMixin._open_run`). A tuning run claims no run.
        self._state_owners.register("run_directory", StateOwner(self._run_dir_state, _nothing_to_load))

    def _run_dir_state(self) -> dict[str, Any]:
        # The run that wrote it: "last" continues that run when the file is not in a run directory.
        run_dir = os.path.abspath(self._run_dir) if self._run_dir is not None else None
        return {"dream_trainer": {"run_dir": run_dir}}

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
        if self.config.fast_dev_run:  # nothing of a smoke test is kept: its run lives in a temporary root
            if self._scratch_root is None:
                self._scratch_root = Path(tempfile.mkdtemp(prefix="dream_trainer-fast_dev_run-"))
                weakref.finalize(self, shutil.rmtree, self._scratch_root, True)
                self._announce_run(
                    f"fast_dev_run: {self.config.limit_train_batches} batch(es) of each loop, one epoch; "
                    "nothing is kept (no loggers, no checkpoints, a temporary run directory)"
                )
            return self._scratch_root
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
        self._run_training = True  # a new run: its status is "running" from the start
        self._settle_dead_runs(path)

    def _use_run_dir(self, path: Path) -> None:
        """Every rank: the run directory global rank zero chose (see `ResumeMixin._open_run`)."""
        self._run_dir = path

    def _abandon_run(self) -> None:
        """Give up a run this trainer claimed but did not use (another run is continued instead)."""
        if self._run_dir is not None and self._run_claimed:
            if self._run_lock is not None:
                self._run_lock.release()
                self._run_lock = None
            abandon_if_unused(self._run_dir)
            self._run_dir = None
            self._run_claimed = False

    def _continue_run(self, path: Path, checkpoint: Path) -> None:
        """Take over the existing run at `path` (to resume it from `checkpoint`): its lock, and a line in
        its `run.json` (a new one, marked rebuilt, when it has none or an unreadable one); the temporary
        files its dead processes left are removed. Raises `DreamTrainerError` when another live process
        holds the run."""
        self._take_run(path)
        self._run_claimed = False
        if not self.is_global_zero:
            return
        record = read_record(path) or self._rebuilt_record(path)
        mark_killed(record)  # its last process died holding it ("running"): we hold its lock now
        previous = record.get("resumes")
        resumes: list[Any] = previous if isinstance(previous, list) else []
        resumes.append({"time": now(), "checkpoint": str(checkpoint), "pid": os.getpid(), "strategy": self.strategy})
        record.update(resumes=resumes)  # the status changes when training starts (_start_run_training)
        try:
            write_record(path, record)
        except OSError as exc:
            raise self._root_error(exc) from exc
        strays = remove_stray_files(path)  # under the lock: no process of this run writes them any more
        if strays:
            self._announce_run(f"run {path}: removed {len(strays)} temporary file(s) of processes that are gone")
        self._settle_dead_runs(path)

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
        settled = settle_dead_runs(self._root, skip=own)
        if settled:
            names = ", ".join(settled[:5]) + (f" and {len(settled) - 5} more" if len(settled) > 5 else "")
            self._announce_run(
                f"marked {len(settled)} run(s) that died without recording it 'killed' in run.json and "
                f"removed their partial checkpoint files: {names}"
            )

    def _start_run_training(self) -> None:
        """`fit()`, once its checkpoint is loaded and training starts: the run is "running" again."""
        self._run_training = True
        if self._run_lock is None or self._run_dir is None:
            return
        record = read_record(self._run_dir)
        if record and record.get("status") != "running":
            record.update(status="running")
            record.pop("ended", None)
            try:
                write_record(self._run_dir, record)
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
        self._run_training = False

    def _note_run_end(self, exc: BaseException) -> None:
        """`fit()` is ending by `exc`: the one line `_end_run` writes as run.json's "end_reason" (what
        `dream-trainer runs` shows)."""
        self._run_end_reason = how_it_ended(exc, self._loop.global_step)

    def _end_run(self, status: str) -> None:
        """End of fit: record how the run ended (its status, last global step and one line: "end_reason")
        and release its lock (rank zero holds it). A resume that failed before training started records
        its outcome in its "resumes" entry only."""
        lock, self._run_lock = self._run_lock, None
        reason, self._run_end_reason = self._run_end_reason, None
        if lock is None or self._run_dir is None:
            return
        try:
            self._write_outcome(status, reason, ends_resume=True)
        finally:
            lock.release()

    def _record_outcome_now(self, status: str, reason: str) -> None:
        """The run is ending as `status` and its process may be ended from outside before `fit()` returns
        (a requeued SLURM job: Slurm sends SIGTERM, then SIGKILL, to the job step seconds after `scontrol
        requeue`, while the trainer ends under torchrun's own timeout): run.json says so now. The end of
        `fit()` writes it again (`_end_run`). Rank zero, which holds the run's lock; nothing elsewhere."""
        if self._run_lock is not None and self._run_dir is not None:
            self._write_outcome(status, reason, ends_resume=False)

    def _write_outcome(self, status: str, reason: str | None, ends_resume: bool) -> None:
        assert self._run_dir is not None
        try:
            record = read_record(self._run_dir)
            if record:
                resumes = record.get("resumes")
                if ends_resume and isinstance(resumes, list) and resumes and isinstance(resumes[-1], dict):
                    resumes[-1].setdefault("outcome", status)
                if self._run_training and not self._run_hung:
                    step = self._loop.global_step
                    reason = reason or f"finished at global step {step}"
                    record.update(status=status, ended=now(), global_step=step, end_reason=reason)
                write_record(self._run_dir, record)
        except OSError as exc:  # a full disk must not hide the run's own outcome
            print(f"dream_trainer: could not update {self._run_dir / 'run.json'}: {exc}", file=sys.stderr)

    def _record_hang(self, hang: dict[str, Any]) -> None:
        """The hang watchdog named the stuck rank(s) and is about to end the job (global rank zero, from
        the watchdog's thread): run.json says "hung", its "end_reason" is the verdict's line and "hang"
        the verdict (each stuck rank, where it was, for how long); the status stays so whatever the main
        thread records after (`_end_run`). A resume that had not started training records it in its
        "resumes" entry only."""
        self._run_hung = True
        if self._run_lock is None or self._run_dir is None:
            return
        record = read_record(self._run_dir)
        if not record:
            return
        resumes = record.get("resumes")
        if isinstance(resumes, list) and resumes and isinstance(resumes[-1], dict):
            resumes[-1].setdefault("outcome", "hung")
        if self._run_training:
            step = self._loop.global_step
            record.update(status="hung", ended=now(), global_step=step, end_reason=hang.get("line"))
        record.update(hang=hang)
        write_record(self._run_dir, record)

    def _record_in_run(self, key: str, value: Any) -> None:
        """Set run.json's `key` to `value` now (the skipped batches; rare events only: one file write),
        while this process holds the run's lock; nothing otherwise (a tuning run, another rank)."""
        if self._run_lock is None or self._run_dir is None:
            return
        try:
            record = read_record(self._run_dir)
            if record:
                record[key] = value
                write_record(self._run_dir, record)
        except OSError as exc:  # a full disk must not end the run over its record
            print(f"dream_trainer: could not update {self._run_dir / 'run.json'}: {exc}", file=sys.stderr)

    def _record_evaluation(self, entry: str, checkpoint: Path | None, outcome: str, inside_fit: bool) -> None:
        """End of `validate()`/`test()`/`predict()` (rank zero): an entry in run.json's "evaluations"
        naming the checkpoint it read; a run the evaluation opened gets its final status. Outside
        `fit()` the run's lock is taken for the write and released after it."""
        if not self.is_global_zero or self._run_dir is None:
            return
        lock = self._run_lock
        if lock is None:
            lock = RunLock(self._run_dir)
            if not lock.try_acquire():
                return  # another process holds the run: its record is that process's to write
        try:
            record = read_record(self._run_dir)
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
                write_record(self._run_dir, record)
        except OSError as exc:
            print(f"dream_trainer: could not update {self._run_dir / 'run.json'}: {exc}", file=sys.stderr)
        finally:
            if not inside_fit:
                self._run_lock = None
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
