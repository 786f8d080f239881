"""ModelCheckpoint: save on a cadence, keep the best / the latest, point `last.ckpt` at the newest."""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dream_trainer.callbacks.base import Callback
from dream_trainer.errors import ConfigError, MisconfigurationError, NonFiniteGradientError, TrainingInterrupted
from dream_trainer.utils.checkpoint_io import EXCEPTION_TAG, LAST_NAME, NONFINITE_TAG, SUFFIX, point_last
from dream_trainer.utils.non_finite import SETTINGS_HELP, weights_are_finite
from dream_trainer.utils.warn import warn_user

if TYPE_CHECKING:
    from dream_trainer.protocol import TrainerProtocol

_FIELD_RE = re.compile(r"\{([^{}:]+)(:[^{}]*)?\}")


class ModelCheckpoint(Callback):
    """Save checkpoints during training, with Lightning's arguments and keep-last / keep-every-n rotation.

    Args:
        dirpath: directory for the files (default: `<run_dir>/checkpoints`, the run's own).
        filename: template; `{epoch}`, `{step}` and any metric, with an optional format:
            `"{epoch}-{val_loss:.3f}"` -> `epoch=3-val_loss=0.123.ckpt`. Default `"{epoch}-{step}"`.
        monitor: metric in `trainer.callback_metrics` that ranks checkpoints (None: newest is best).
        mode: `"min"` or `"max"`: which `monitor` values are better.
        save_top_k: keep the k best files (by `monitor`, else the k newest); -1 keeps all, 0 none.
        save_last: also keep `last.ckpt`, a hard link to the newest file (the default for
            `fit(ckpt_path="last")`); with `save_top_k=0` only `last.ckpt` is written. Without it, a
            `last.ckpt` that exists (the save on a signal makes one) still moves to every new file.
        every_n_train_steps / every_n_epochs / train_time_interval: when to save (one of them;
            default: every epoch). `train_time_interval` is a `timedelta` or seconds.
        save_on_exception: save `<name>-exception.ckpt` when `fit()` fails.
        keep_last_n: also keep the n most recent files, whatever their score.
        keep_every_n_steps: also keep every file whose step is a multiple of n.

    Files are written atomically; files dropped by rotation are deleted only after the new one is
    durable, so a crash mid-save never costs the last good checkpoint. Rotation only ever deletes
    files this run wrote: records of another run (a checkpoint loaded from elsewhere) are forgotten,
    never acted on, and in a `dirpath` shared with other runs a name that is taken gets a `-v1`,
    `-v2`, ... suffix instead of replacing the other run's file. A save whose weights are NaN/inf is
    written as `<name>-nonfinite.ckpt` (the first one of the run only), never ranked and never
    `last.ckpt`; then the run stops (`non_finite_loss="raise"`, the default) or warns once.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
        save_last: bool | None = None,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        train_time_interval: timedelta | float | None = None,
        save_on_exception: bool = False,
        keep_last_n: int | None = None,
        keep_every_n_steps: int | None = None,
    ) -> None:
        if mode not in ("min", "max"):
            raise ConfigError(f"ModelCheckpoint(mode={mode!r}) is invalid: valid choices are 'min', 'max'")
        if not isinstance(save_top_k, int) or save_top_k < -1:
            raise ConfigError(f"ModelCheckpoint(save_top_k={save_top_k!r}) is invalid: expected -1 (all), 0 or more")
        for name, value in (
            ("every_n_train_steps", every_n_train_steps),
            ("every_n_epochs", every_n_epochs),
            ("keep_last_n", keep_last_n),
            ("keep_every_n_steps", keep_every_n_steps),
        ):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"ModelCheckpoint({name}={value!r}) is invalid: expected a positive integer or None")
        if isinstance(train_time_interval, timedelta):
            train_time_interval = train_time_interval.total_seconds()
        if train_time_interval is not None and not train_time_interval > 0:
            raise ConfigError(
                f"ModelCheckpoint(train_time_interval={train_time_interval!r}) is invalid: expected a positive duration"
            )
        cadences = [c for c in (every_n_train_steps, every_n_epochs, train_time_interval) if c is not None]
        if len(cadences) > 1:
            raise ConfigError(
                "ModelCheckpoint: set only one of every_n_train_steps, every_n_epochs and train_time_interval"
            )
        if not cadences:
            every_n_epochs = 1
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.filename = filename or "{epoch}-{step}"
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.save_last = bool(save_last) or save_top_k == 0
        self.every_n_train_steps = every_n_train_steps
        self.every_n_epochs = every_n_epochs
        self.train_time_interval = train_time_interval
        self.save_on_exception = save_on_exception
        self.keep_last_n = keep_last_n
        self.keep_every_n_steps = keep_every_n_steps
        # state (saved in checkpoints)
        self.kept: list[dict[str, Any]] = []  # {"path", "score", "step"} of files this callback keeps
        self.best_model_path: str = ""
        self.best_model_score: float | None = None
        self.last_model_path: str = ""
        self._last_saved_step = -1
        self._last_time = time.monotonic()
        self._warned_missing = False
        self._non_finite_saved = False  # one "-nonfinite" file per run is enough to debug with

    @property
    def state_key(self) -> str:
        """Distinct per configuration, so two ModelCheckpoints in one run keep separate records."""
        cadence = self.every_n_train_steps, self.every_n_epochs, self.train_time_interval
        where = str(self.dirpath) if self.dirpath is not None else None
        return f"ModelCheckpoint{{monitor={self.monitor},mode={self.mode},every={cadence},dirpath={where}}}"

    # --- where and what ---------------------------------------------------------------------------
    def resolved_dirpath(self, trainer: TrainerProtocol) -> Path:
        """The directory this callback writes to."""
        return self.dirpath if self.dirpath is not None else trainer.run_dir / "checkpoints"

    def format_name(self, trainer: TrainerProtocol, metrics: dict[str, float], epoch: int | None = None) -> str:
        """The file name (without directory) for a save now (of `epoch`, default the current one)."""
        epoch = trainer.current_epoch if epoch is None else epoch
        values: dict[str, Any] = {"epoch": epoch, "step": trainer.global_step, **metrics}

        def fill(match: re.Match[str]) -> str:
            key, spec = match.group(1), match.group(2) or ""
            if key not in values:
                raise MisconfigurationError(
                    f"ModelCheckpoint(filename={self.filename!r}) uses {{{key}}}, which is not a metric; "
                    f"available: {sorted(values)}"
                )
            return f"{key}={format(values[key], spec[1:])}"

        return _FIELD_RE.sub(fill, self.filename).replace(os.sep, "_") + SUFFIX

    # --- when -------------------------------------------------------------------------------------
    def on_train_start(self, trainer: TrainerProtocol) -> None:
        self._last_time = time.monotonic()

    def on_train_batch_end(self, trainer: TrainerProtocol, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not trainer.is_optimizer_step_end:  # only between training steps, never inside an accumulation window
            return
        by_steps = self.every_n_train_steps and trainer.global_step % self.every_n_train_steps == 0
        by_time = self.train_time_interval and time.monotonic() - self._last_time >= self.train_time_interval
        if by_steps or by_time:
            # Written at the batch boundary, after every on_train_batch_end and this step's validation: the
            # file holds the weights that validation scored (its rank, `{val_loss}` in its name) and the RNG
            # state the next step starts from, whatever the callbacks listed after this one draw.
            trainer.at_batch_boundary(self.save, trainer)

    def on_train_epoch_end(self, trainer: TrainerProtocol) -> None:
        if self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.save(trainer)

    def on_train_end(self, trainer: TrainerProtocol) -> None:
        # A run that ends between two saves of the cadence (every_n_train_steps=10, ending at step 12)
        # saves once more, so its final weights are kept (and `last.ckpt` holds them), ranked like any save.
        if trainer.global_step > max(self._last_saved_step, 0):
            loop = trainer.loop  # named after the epoch its last step trained in, as an epoch-end save is
            self.save(
                trainer, epoch=trainer.current_epoch - int(trainer.current_epoch > 0 and not loop.epoch_in_progress)
            )

    def on_exception(self, trainer: TrainerProtocol, exception: BaseException) -> None:
        if self.save_on_exception and trainer.is_setup and not isinstance(exception, TrainingInterrupted):
            tag = EXCEPTION_TAG + ("" if self._weights_ok(trainer) else NONFINITE_TAG)
            name = self.format_name(trainer, self._metrics(trainer))[: -len(SUFFIX)] + tag + SUFFIX
            directory = self.resolved_dirpath(trainer)
            if trainer.is_global_zero:
                directory.mkdir(parents=True, exist_ok=True)
            trainer.save_checkpoint(directory / name)

    # --- saving and rotation ----------------------------------------------------------------------
    @staticmethod
    def _metrics(trainer: TrainerProtocol) -> dict[str, float]:
        return dict(trainer.callback_metrics)

    def save(self, trainer: TrainerProtocol, epoch: int | None = None) -> Path | None:
        """Save now (once per training step), rotate, and point `last.ckpt`. Returns the file written.
        `epoch` names the file (default: the current epoch)."""
        if trainer.global_step == self._last_saved_step or trainer.sanity_checking:
            return None
        metrics = self._metrics(trainer)
        directory = self.resolved_dirpath(trainer)
        if trainer.is_global_zero:  # an overridden save_checkpoint (a bare torch.save) needs the folder
            directory.mkdir(parents=True, exist_ok=True)
        self._last_saved_step = trainer.global_step
        self._last_time = time.monotonic()
        if not self._weights_ok(trainer):
            return self._save_non_finite(trainer, directory, metrics)
        score = self._score(trainer, metrics)
        run = os.path.abspath(trainer.run_dir)
        path = directory / LAST_NAME if self.save_top_k == 0 else directory / self.format_name(trainer, metrics, epoch)
        if self.dirpath is not None and self.save_top_k != 0:
            path = self._free_name(path, run)
        before = [dict(r) for r in self.kept], self.best_model_path, self.best_model_score, self.last_model_path
        doomed: list[str] = []
        if self.save_top_k != 0:
            # Records of another run (this state was loaded from its checkpoint) are forgotten here,
            # never deleted: rotation only ever removes files this run wrote.
            self.kept = [r for r in self.kept if r.get("run") == run and r["path"] != str(path)]
            # Rotate before writing, so the checkpoint holds this callback's state *with* this save.
            self.kept.append({"path": str(path), "score": score, "step": trainer.global_step, "run": run})
            doomed = self._rotate()
            if str(path) in doomed and self.save_last and trainer.sharded_checkpoints:
                # last.ckpt will be a symlink to this directory (no hard links for directories):
                # keep it until the next save moves last.ckpt on.
                doomed.remove(str(path))
                self.kept.append(
                    {"path": str(path), "score": score, "step": trainer.global_step, "run": run, "last_only": True}
                )
            if str(path) in doomed and not self.save_last:
                doomed.remove(str(path))  # not among the kept ones and nothing points at it: skip it
                self._delete_later(trainer, doomed, directory)
                return None
        self.last_model_path = str(path)
        try:
            trainer.save_checkpoint(path)
        except BaseException:
            # The file is not there (atomic write): the records go back to what is on disk.
            self.kept, self.best_model_path, self.best_model_score, self.last_model_path = before
            raise
        if trainer.is_global_zero:
            # last.ckpt is the newest checkpoint written or does not exist: one a signal's save made (without
            # save_last) moves on with this save, so a person who loads it by hand never gets an old state.
            keeps_last = self.save_last or (directory / LAST_NAME).exists()
            if keeps_last and self.save_top_k != 0:
                trainer.after_checkpoint_write(point_last, directory, path)
            # A file rotated away right after writing still backs last.ckpt through the hard link.
            self._delete_later(trainer, doomed, directory)
        return path

    def _free_name(self, path: Path, run: str) -> Path:
        """In a `dirpath` shared with other runs: `path`, or `<name>-v1.ckpt`, `-v2`, ... when another
        run's file (one this run does not keep) has that name."""
        ours = {r["path"] for r in self.kept if r.get("run") == run}
        stem, k = path.name[: -len(SUFFIX)], 0
        candidate = path
        while (candidate.exists() or candidate.is_symlink()) and str(candidate) not in ours:
            k += 1
            candidate = path.with_name(f"{stem}-v{k}{SUFFIX}")
        return candidate

    @staticmethod
    def _weights_ok(trainer: TrainerProtocol) -> bool:
        reduce = trainer.all_reduce if trainer.is_distributed else None
        return weights_are_finite((m for _, m in trainer.named_models()), reduce)

    def _save_non_finite(self, trainer: TrainerProtocol, directory: Path, metrics: dict[str, float]) -> Path | None:
        """The weights are NaN/inf: keep the state beside the good checkpoints under a name that says so
        (the first time), leave `last.ckpt` and the ranking alone, then apply `non_finite_loss`."""
        if self._non_finite_saved:
            return None  # said once; the run keeps its first non-finite state only
        path = directory / (self.format_name(trainer, metrics)[: -len(SUFFIX)] + NONFINITE_TAG + SUFFIX)
        trainer.save_checkpoint(path)
        self._non_finite_saved = True
        # Said from what is checked: "last" verifies every file's weights as it reads it and skips those
        # that are not finite (dream_trainer.utils.checkpoint_verify), whatever last.ckpt names.
        message = (
            f"the model's weights are not finite at global step {trainer.global_step}: saved as "
            f'{str(path)!r} for debugging, never chosen by fit(ckpt_path="last"), which resumes from the newest '
            f"checkpoint in {str(directory)!r} whose weights it verifies finite. {SETTINGS_HELP}"
        )
        if trainer.config.non_finite_loss == "raise":
            raise NonFiniteGradientError("training stopped: " + message)
        warn_user(message + " Later saves with non-finite weights are skipped.")
        return path

    @staticmethod
    def _delete_later(trainer: TrainerProtocol, paths: list[str], directory: Path) -> None:
        if paths and trainer.is_global_zero:
            trainer.after_checkpoint_write(_delete, paths, directory)

    def _score(self, trainer: TrainerProtocol, metrics: dict[str, float]) -> float | None:
        if self.monitor is None:
            return None
        if self.monitor in metrics:
            return float(metrics[self.monitor])
        if trainer.loop.last_val_step >= 0:
            raise MisconfigurationError(
                f"ModelCheckpoint(monitor={self.monitor!r}) found no such metric in trainer.callback_metrics, "
                f"which holds {sorted(metrics)}; return or log it from a step, or change monitor."
            )
        if not self._warned_missing:  # before the first validation a validation metric cannot exist yet
            warn_user(
                f"ModelCheckpoint(monitor={self.monitor!r}): not available yet; ranking this save as worst",
            )
            self._warned_missing = True
        return None

    def _ranked(self) -> list[dict[str, Any]]:
        """Kept records, best first (newest first when there is no monitor)."""
        kept = [r for r in self.kept if not r.get("last_only")]
        if self.monitor is None:
            return sorted(kept, key=lambda r: r["step"], reverse=True)
        sign = 1.0 if self.mode == "min" else -1.0

        def key(r: dict[str, Any]) -> tuple[float, int]:
            s = r["score"]
            bad = s is None or math.isnan(s)
            return (math.inf if bad else sign * s, -r["step"])

        return sorted(kept, key=key)

    def _rotate(self) -> list[str]:
        # Directories kept only for last.ckpt go once a newer save exists.
        stale = [r["path"] for r in self.kept if r.get("last_only") and r["step"] < self._last_saved_step]
        self.kept = [r for r in self.kept if r["path"] not in stale]
        ranked = self._ranked()
        keep = ranked if self.save_top_k == -1 else ranked[: self.save_top_k]
        keep_paths = {r["path"] for r in keep}
        if self.keep_last_n:
            newest = sorted(self.kept, key=lambda r: r["step"], reverse=True)[: self.keep_last_n]
            keep_paths |= {r["path"] for r in newest}
        if self.keep_every_n_steps:
            keep_paths |= {r["path"] for r in self.kept if r["step"] % self.keep_every_n_steps == 0}
        keep_paths |= {r["path"] for r in self.kept if r.get("last_only")}
        doomed = stale + [r["path"] for r in self.kept if r["path"] not in keep_paths]
        self.kept = [r for r in self.kept if r["path"] in keep_paths]
        if ranked:
            self.best_model_path = ranked[0]["path"]
            self.best_model_score = ranked[0]["score"]
        return doomed

    # --- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "kept": [dict(r) for r in self.kept],
            "best_model_path": self.best_model_path,
            "best_model_score": self.best_model_score,
            "last_model_path": self.last_model_path,
            "last_saved_step": self._last_saved_step,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.kept = [dict(r) for r in state_dict.get("kept", [])]
        self.best_model_path = state_dict.get("best_model_path", "")
        self.best_model_score = state_dict.get("best_model_score")
        self.last_model_path = state_dict.get("last_model_path", "")
        self._last_saved_step = state_dict.get("last_saved_step", -1)


def _delete(paths: list[str], directory: Path) -> None:
    for p in map(Path, paths):
        if os.path.abspath(p.parent) != os.path.abspath(directory):
            continue  # only ever delete in the directory this callback writes to
        last = p.parent / LAST_NAME
        if last.is_symlink() and last.resolve() == p.resolve():
            continue  # a sharded checkpoint that last.ckpt still points at: rotated out at the next save
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
