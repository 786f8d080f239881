"""RunDirectoryMixin: the run directory (`run_dir`), its lock and its `run.json`.

The lowest layer that writes files owns the run directory, through the object it holds
(`dream_trainer.run_directory.RunDirectory`, `_run_directory`: the directory, rank zero's lock on it, what
`run.json` says and when it is written). Here is what the object needs the trainer for: `run_dir` and
`log_dir`, the ranks' agreement on which run this is (`_on_rank_zero`, `_ensure_run_open`), the process
identity each claim, takeover and evaluation entry is given, the line printed on global rank zero
(`_announce_run`), and the calls the rest of the trainer makes (`fit()`: `_check_root_writable`,
`_start_run_training`, `_note_run_end`, `_end_run`; the reaction to a signal: `_record_outcome_now`; the
hang watchdog: `_record_hang`; the bad-batch policy: `_record_in_run`; an evaluation:
`_record_evaluation`). Which run a resume continues is `ResumeMixin`'s decision, made through the object's
methods, which alone write the run's fields; `LoggingMixin` attaches the loggers to the directory. A
checkpoint records the run that wrote it (the "run_dir" of its "dream_trainer" header, the object's
checkpoint entry): what `fit(ckpt_path="last")` continues.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from dream_trainer.errors import DreamTrainerError
from dream_trainer.mirror import RunMirror, check_store
from dream_trainer.mixins.distributed import DistributedMixin
from dream_trainer.run_directory import RunDirectory

_T = TypeVar("_T")


class RunDirectoryMixin(DistributedMixin):
    """Owns `run_dir`: every run writes only into its own directory (see `dream_trainer.utils.run_dirs`)."""

    def _init_run_directory(self) -> None:
        self._run_directory: RunDirectory = RunDirectory(
            self.config, self._loop, self._announce_run, self._state_owners
        )
        """The run this trainer holds (`dream_trainer.run_directory`): its directory, lock and `run.json`,
        and what deciding which run a fit opens leaves for the fit; it registers its checkpoint entry
        ("run_directory") itself."""
        self._mirror: RunMirror | None = None
        """The run directory's copy in an object store (`config.mirror`; `dream_trainer.mirror`), used on
        global rank zero: attached to the run a fit opens, given each checkpoint written, closed at the end."""
        if self.config.mirror is not None:
            check_store(self.config.mirror)  # the store's fsspec package, at construction
            self._mirror = RunMirror(self.config.mirror)

    @property
    def run_dir(self) -> Path:
        """This run's directory, `<root_dir>/<run name>`: its checkpoints, logs, `config.yaml` and
        `run.json`. A new run claims the next free `version_N` (or `run_name`, then `run_name-v1`, ...)
        and no later run writes into it; `fit(ckpt_path="last")` continues the newest run in its own
        directory. Decided when `fit()` starts (printed on stderr); read before that on one process,
        it claims a new run at once. With several processes the ranks agree on it when `fit()` (or
        `validate()`, ...) starts: read earlier, it is the directory a new run would get now, claimed
        by nothing (a property cannot make the ranks agree)."""
        run = self._run_directory
        if run.path is None:
            if self.is_distributed:
                return run.next_free()
            self._claim_new_run()
            self._announce_run(f"run directory {run.path}")
        assert run.path is not None
        return run.path

    @property
    def log_dir(self) -> Path:
        """This run's log directory, shared by every logger and by callbacks that write files: the run
        directory itself (`trainer.run_dir`), as Lightning's `version_N` folder."""
        return self.run_dir

    def _check_root_writable(self) -> None:
        """Before anything is built: fail now if no run directory can be created under `root_dir`."""
        self._run_directory.check_root_writable()

    def _claim_new_run(self, **record: Any) -> None:
        """Create a new run directory (never one that exists), lock it, write `run.json` and `config.yaml`
        (rank zero; a rank on its own only names it)."""
        self._run_directory.claim_new(self.is_global_zero, strategy=self.strategy, world_size=self.world_size, **record)

    def _continue_run(self, path: Path, checkpoint: Path) -> None:
        """Take over the existing run at `path` to resume it from `checkpoint` (`RunDirectory.continue_run`).
        Raises `DreamTrainerError` when another live process holds the run."""
        self._run_directory.continue_run(path, checkpoint, self.is_global_zero, self.strategy)

    def _use_run_dir(self, path: Path) -> None:
        """Every rank: the run directory global rank zero chose (see `ResumeMixin._open_run`)."""
        self._run_directory.use(path)

    def _start_run_training(self) -> None:
        """`fit()`, once its checkpoint is loaded and training starts: the run is "running" again."""
        self._run_directory.start_training()

    def _note_run_end(self, exc: BaseException) -> None:
        """`fit()` is ending by `exc`: the one line `_end_run` writes as run.json's "end_reason"."""
        self._run_directory.note_end(exc)

    def _end_run(self, status: str) -> None:
        """End of fit: record how the run ended in run.json and release its lock (`RunDirectory.end`)."""
        self._run_directory.end(status)

    def _record_outcome_now(self, status: str, reason: str) -> None:
        """run.json says now that the run is ending as `status` (a requeued SLURM job may be ended from
        outside before `fit()` returns: `RunDirectory.record_outcome_now`)."""
        self._run_directory.record_outcome_now(status, reason)

    def _record_hang(self, hang: dict[str, Any]) -> None:
        """The hang watchdog's verdict, from its thread: run.json says "hung" (`RunDirectory.record_hang`)."""
        self._run_directory.record_hang(hang)

    def _record_in_run(self, key: str, value: Any) -> None:
        """Set run.json's `key` to `value` now, while this process holds the run's lock (rare events only)."""
        self._run_directory.record(key, value)

    def _record_evaluation(self, entry: str, checkpoint: Path | None, outcome: str, inside_fit: bool) -> None:
        """End of `validate()`/`test()`/`predict()`: an entry in run.json's "evaluations" (rank zero)."""
        self._run_directory.record_evaluation(entry, checkpoint, outcome, inside_fit, self.is_global_zero)

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
        if self._run_directory.path is not None:
            return

        def claim() -> str:
            self._claim_new_run()
            self._announce_run(f"run directory {self._run_directory.path}")
            return str(self._run_directory.path)

        self._use_run_dir(Path(self._on_rank_zero("open a run directory", claim)))
