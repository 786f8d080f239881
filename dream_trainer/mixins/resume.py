"""ResumeMixin: where a run's checkpoints are, which run `fit()` opens and which checkpoint it resumes.

At the start of `fit()` global rank zero decides, and every rank follows (`_open_run`): a new run, this
trainer's own run again, the run `"last"` continues (the newest run with a valid checkpoint, in its own
directory: `_find_last`), or a new run started from a given file. `validate()`/`test()`/`predict()` read
`ckpt_path="last"` the same way (`resolve_checkpoint`). The checkpoint found is read once: its state is
kept for `CheckpointMixin.load_checkpoint` (`_take_preloaded`). The run directory itself, its lock and its
`run.json`, are the trainer's `RunDirectory`'s (`dream_trainer.run_directory`, held by `RunDirectoryMixin`):
the decision is made through its methods, and what it leaves for the fit (the checkpoint read, whether a
second `fit()` continues the trainer's own run) is kept there. Nothing here writes a checkpoint. See
`dream_trainer.mixins.core` for the layers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dream_trainer.errors import CheckpointError
from dream_trainer.mirror import StoreError, pull
from dream_trainer.mixins.logging import LoggingMixin
from dream_trainer.utils.checkpoint_io import find_last
from dream_trainer.utils.run_dirs import CHECKPOINTS, family_of, is_run_dir, remove_partial_files, runs_newest_first
from dream_trainer.utils.warn import warn_user

if TYPE_CHECKING:
    from dream_trainer.callbacks.model_checkpoint import ModelCheckpoint


class ResumeMixin(LoggingMixin):
    """`checkpoint_dir`, and the run (and checkpoint) `fit(ckpt_path=...)` continues.

    It sits above `LoggingMixin`, and so `RunDirectoryMixin` (it claims, continues or takes the run
    through the run directory's methods; a trainer whose loggers are attached already keeps its own run).
    It holds no state: the checkpoint `_find_last` read and whether a second `fit()` continues this trainer's
    run are the run directory's (`_run_directory`: `take_preloaded`, `continues_own_run`).
    """

    # --- where checkpoints are ------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        """Where checkpoints of this run go: the first ModelCheckpoint's `dirpath`, else
        `<run_dir>/checkpoints`."""
        explicit = self._explicit_checkpoint_dir()
        return Path(explicit) if explicit is not None else self.run_dir / CHECKPOINTS

    def _explicit_checkpoint_dir(self) -> Path | None:
        """The first ModelCheckpoint's `dirpath` when the user set one (checkpoints outside the run)."""
        checkpointer = self._model_checkpoint()
        return checkpointer.dirpath if checkpointer is not None else None

    def _model_checkpoint(self) -> ModelCheckpoint | None:
        """The first `ModelCheckpoint` among the callbacks (found by type: other callbacks, such as the
        Profiler, also have a `dirpath`)."""
        from dream_trainer.callbacks.model_checkpoint import ModelCheckpoint

        return next((cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)), None)

    def _take_preloaded(self, path: str | os.PathLike[str]) -> dict[str, Any] | None:
        """The state of the checkpoint at `path` when finding it read it already (`_find_last`), else None;
        forgotten either way, so a later load reads the file again."""
        return self._run_directory.take_preloaded(path)

    # --- which run, resumed from where ------------------------------------------------------------
    def _open_run(self, ckpt_path: str | os.PathLike[str] | None) -> Path | None:
        """Start of `fit()`: decide (on global rank zero) which run this is and which checkpoint it
        loads, tell every rank, and print it in one line. Returns the checkpoint to load.

        - None: a new run directory (or the one this trainer already has).
        - "last": the newest run under `root_dir` (of `run_name`'s family when set; in the first
          ModelCheckpoint's `dirpath` when set) with a valid checkpoint continues, in its own
          directory, from its newest one; nothing there: `<root_dir>/checkpoints` (the layout of earlier
          versions) is read, into a new run; nothing at all: a new run from scratch, with a warning.
        - a path: a new run starts from that checkpoint; the run that wrote it stays as it is.
        """

        def decide() -> tuple[str, str | None]:
            self._pull_from_mirror(with_checkpoint=os.fspath(ckpt_path or "") == "last")
            path = self._choose_run(ckpt_path)
            if self._mirror is not None and self._run_directory.path is not None:
                self._mirror.attach(self._run_directory.path)  # its copy in the store, from here on
            return str(self._run_directory.path), None if path is None else str(path)

        run_dir, path = self._on_rank_zero("open the run directory", decide)
        self._use_run_dir(Path(run_dir))
        return None if path is None else Path(path)

    def _choose_run(self, ckpt_path: str | os.PathLike[str] | None) -> Path | None:
        run = self._run_directory
        run.note_continues_own_run(False)
        if ckpt_path is None:
            if self._open_own_run():
                self._announce_run(f"run directory {run.path}")
            return None
        if os.fspath(ckpt_path) != "last":
            path = Path(ckpt_path)
            self._open_own_run(started_from=str(path))
            self._announce_run(f"run directory {run.path}, starting from {path}")
            return path
        self._heartbeat.mark("load_checkpoint (finding the newest)")
        found = self._find_last()
        if found is None:
            first_start = self._first_start_of_resumable_run()
            if not first_start:
                self._warn_nothing_to_resume()
            if self._open_own_run():
                where = self.where_last_looks()
                note = f'; resume_from="last": nothing to resume yet in {where}' if first_start else ""
                self._announce_run(f"run directory {run.path}{note}")
            return None
        path, state, owner = found
        run.preload(path, state)
        step = (state.get("counters") or {}).get("global_step", "?")
        if owner is not None and owner != run.path and not self._loggers_attached:
            run.abandon()  # a run claimed by reading trainer.run_dir early, and never used
            self._continue_run(owner, path)
            removed = remove_partial_files(owner / CHECKPOINTS) if self.is_global_zero else []
            note = f"; removed {len(removed)} partial file(s) of an interrupted save" if removed else ""
            self._announce_run(f"continuing run {owner} from {path.name} (global step {step}){note}")
        elif owner is not None and owner == run.path:
            self._open_own_run()
            run.note_continues_own_run(self._loggers_attached)
            self._announce_run(f"continuing run {owner} from {path.name} (global step {step})")
        else:  # the old layout, a shared dirpath whose writer is gone, or a trainer already in use
            self._open_own_run(started_from=str(path))
            self._announce_run(f"run directory {run.path}, resuming from {path} (global step {step})")
        return path

    def _pull_from_mirror(self, with_checkpoint: bool) -> None:
        """With `mirror`, on global rank zero before the run is chosen: the runs' records the local `root_dir`
        lacks (a new run never takes a name the store has), and for "last" the newest committed checkpoint and
        its run's files (`dream_trainer.mirror.pull`), so "last" finds it as on the machine that wrote it."""
        mirror = self._mirror
        if mirror is None or self._explicit_checkpoint_dir() is not None:
            return
        family = family_of(self.config.run_name) if self.config.run_name is not None else None
        try:
            key = pull(mirror.store, self._run_directory.root, family, with_checkpoint)
        except StoreError as exc:
            raise CheckpointError(
                f"mirror: cannot read {mirror.config.url} ({exc}); check the store's address and credentials, or "
                "set mirror=None to train without the copy"
            ) from exc
        if key is not None:
            self._announce_run(f"downloaded {key} from {mirror.config.url}: its newest committed checkpoint")

    def _open_own_run(self, **record: Any) -> bool:
        """This trainer's run: a new one (True), or the one it has (locked again for a second `fit()`)."""
        if self._run_directory.path is None:
            self._claim_new_run(**record)
            return True
        self._run_directory.hold(self.is_global_zero)
        return False

    def _find_last(self) -> tuple[Path, dict[str, Any], Path | None] | None:
        """The checkpoint "last" means, and the run directory it belongs to (None: not a run's own).
        Only ever read: nothing here writes or deletes."""
        own = self._run_directory.path
        explicit = self._explicit_checkpoint_dir()
        if explicit is not None:  # the user chose where checkpoints go: look there, as always
            found = find_last(explicit)
            if found is None:
                return None
            writer = found[1].get("dream_trainer", {}).get("run_dir")
            owner = Path(writer) if isinstance(writer, str) and is_run_dir(Path(writer)) else None
            if owner is not None and own is not None and _same_dir(owner, own):
                owner = own
            return found[0], found[1], owner
        if own is not None and self._loggers_attached:  # this trainer's own run comes first
            found = find_last(own / CHECKPOINTS)
            if found is not None:
                return found[0], found[1], own
        root = self._run_directory.root
        for run in runs_newest_first(root, self.config.run_name):
            found = find_last(run / CHECKPOINTS)
            if found is not None:
                return found[0], found[1], run
        found = find_last(root / CHECKPOINTS)  # <root_dir>/checkpoints of earlier versions
        if found is not None:
            return found[0], found[1], None
        return None

    def where_last_looks(self) -> str:
        """Where `ckpt_path="last"` looks, in words for a message: `ModelCheckpoint`'s `dirpath` when it
        has one, else the runs under `root_dir` (of `run_name`, when set)."""
        explicit = self._explicit_checkpoint_dir()
        if explicit is not None:
            return repr(str(explicit))
        family = f" named {self.config.run_name!r}" if self.config.run_name else ""
        root = self._run_directory.root
        return f"any run{family} under {str(root)!r} (nor in {str(root / CHECKPOINTS)!r})"

    def _first_start_of_resumable_run(self) -> bool:
        """Nothing to resume, and that is expected: the config says `resume_from="last"` (a script that
        starts once and continues after every restart or requeue), and this is not a requeued SLURM job
        (which should find the checkpoint its requeue signal wrote). Then the run directory's line says
        so, without a warning."""
        from dream_trainer.utils.slurm import job_id

        if os.fspath(self.config.resume_from or "") != "last":
            return False
        return job_id() is None or int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0

    def _warn_nothing_to_resume(self) -> None:
        where = self.where_last_looks()
        warn_user(f'fit(ckpt_path="last"): no valid checkpoint in {where}; starting from scratch')

    def resolve_checkpoint(self, ckpt_path: str | os.PathLike[str], entry: str = "validate") -> Path:
        """The checkpoint `validate`/`test`/`predict(ckpt_path=...)` (`entry`) loads: `"last"` -> the one
        `fit(ckpt_path="last")` would continue from (read now, and kept for the load that follows); a path
        as given. `CheckpointError` when `"last"` finds none: unlike `fit`, which starts a new run when
        there is nothing to resume, evaluating the untrained weights would report numbers nobody asked for."""
        if os.fspath(ckpt_path) != "last":
            return Path(ckpt_path)
        if self.is_global_zero and not self.is_distributed:
            self._pull_from_mirror(with_checkpoint=True)
        found = self._find_last()
        if found is None:
            raise CheckpointError(
                f'{entry}(ckpt_path="last"): no valid checkpoint in {self.where_last_looks()}; train first '
                f"(fit), or pass the path of a checkpoint, or call {entry}() without ckpt_path to use the "
                "current weights"
            )
        self._run_directory.preload(found[0], found[1])
        return found[0]


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
