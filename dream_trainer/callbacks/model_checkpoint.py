"""ModelCheckpoint: save on a cadence, keep the best / the latest, point `last.ckpt` at the newest."""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dream_trainer.callbacks.base import Callback
from dream_trainer.errors import ConfigError, MisconfigurationError
from dream_trainer.utils.checkpoint_io import LAST_NAME, SUFFIX, point_last

if TYPE_CHECKING:
    from dream_trainer.protocol import TrainerProtocol

_FIELD_RE = re.compile(r"\{([^{}:]+)(:[^{}]*)?\}")


class ModelCheckpoint(Callback):
    """Save checkpoints during training, with Lightning's arguments and keep-last / keep-every-n rotation.

    Args:
        dirpath: directory for the files (default: `<root_dir>/checkpoints`).
        filename: template; `{epoch}`, `{step}` and any metric, with an optional format:
            `"{epoch}-{val_loss:.3f}"` -> `epoch=3-val_loss=0.123.ckpt`. Default `"{epoch}-{step}"`.
        monitor: metric in `trainer.callback_metrics` that ranks checkpoints (None: newest is best).
        mode: `"min"` or `"max"`: which `monitor` values are better.
        save_top_k: keep the k best files (by `monitor`, else the k newest); -1 keeps all, 0 none.
        save_last: also keep `last.ckpt`, a hard link to the newest file (the default for
            `fit(ckpt_path="last")`); with `save_top_k=0` only `last.ckpt` is written.
        every_n_train_steps / every_n_epochs / train_time_interval: when to save (one of them;
            default: every epoch). `train_time_interval` is a `timedelta` or seconds.
        save_on_exception: save `<name>-exception.ckpt` when `fit()` fails.
        keep_last_n: also keep the n most recent files, whatever their score.
        keep_every_n_steps: also keep every file whose step is a multiple of n.

    Files are written atomically; files dropped by rotation are deleted only after the new one is
    durable, so a crash mid-save never costs the last good checkpoint.
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

    def format_name(self, trainer: TrainerProtocol, metrics: dict[str, float]) -> str:
        """The file name (without directory) for a save now."""
        values: dict[str, Any] = {"epoch": trainer.current_epoch, "step": trainer.global_step, **metrics}

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
        if not trainer.loop.step_ended:  # only between training steps, never inside an accumulation window
            return
        by_steps = self.every_n_train_steps and trainer.global_step % self.every_n_train_steps == 0
        by_time = self.train_time_interval and time.monotonic() - self._last_time >= self.train_time_interval
        if by_steps or by_time:
            self.save(trainer)

    def on_train_epoch_end(self, trainer: TrainerProtocol) -> None:
        if self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.save(trainer)

    def on_exception(self, trainer: TrainerProtocol, exception: BaseException) -> None:
        from dream_trainer.mixins.signals import TrainingInterrupted

        if self.save_on_exception and trainer.is_setup and not isinstance(exception, TrainingInterrupted):
            name = self.format_name(trainer, self._metrics(trainer))[: -len(SUFFIX)] + "-exception" + SUFFIX
            trainer.save_checkpoint(self.resolved_dirpath(trainer) / name)

    # --- saving and rotation ----------------------------------------------------------------------
    @staticmethod
    def _metrics(trainer: TrainerProtocol) -> dict[str, float]:
        return dict(trainer.callback_metrics)

    def save(self, trainer: TrainerProtocol) -> Path | None:
        """Save now (once per training step), rotate, and point `last.ckpt`. Returns the file written."""
        if trainer.global_step == self._last_saved_step or trainer.sanity_checking:
            return None
        metrics = self._metrics(trainer)
        score = self._score(trainer, metrics)
        directory = self.resolved_dirpath(trainer)
        path = directory / LAST_NAME if self.save_top_k == 0 else directory / self.format_name(trainer, metrics)
        self._last_saved_step = trainer.global_step
        self._last_time = time.monotonic()
        doomed: list[str] = []
        if self.save_top_k != 0:
            # Rotate before writing, so the checkpoint holds this callback's state *with* this save.
            self.kept = [r for r in self.kept if r["path"] != str(path)]
            self.kept.append({"path": str(path), "score": score, "step": trainer.global_step})
            doomed = self._rotate()
            if str(path) in doomed and self.save_last and trainer.sharded_checkpoints:
                # last.ckpt will be a symlink to this directory (no hard links for directories):
                # keep it until the next save moves last.ckpt on.
                doomed.remove(str(path))
                self.kept.append({"path": str(path), "score": score, "step": trainer.global_step, "last_only": True})
            if str(path) in doomed and not self.save_last:
                doomed.remove(str(path))  # not among the kept ones and nothing points at it: skip it
                self._delete_later(trainer, doomed)
                return None
        self.last_model_path = str(path)
        trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            if self.save_last and self.save_top_k != 0:
                trainer.after_checkpoint_write(point_last, directory, path)
            # A file rotated away right after writing still backs last.ckpt through the hard link.
            self._delete_later(trainer, doomed)
        return path

    @staticmethod
    def _delete_later(trainer: TrainerProtocol, paths: list[str]) -> None:
        if paths and trainer.is_global_zero:
            trainer.after_checkpoint_write(_delete, paths)

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
            warnings.warn(
                f"ModelCheckpoint(monitor={self.monitor!r}): not available yet; ranking this save as worst",
                stacklevel=2,
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


def _delete(paths: list[str]) -> None:
    for p in map(Path, paths):
        last = p.parent / LAST_NAME
        if last.is_symlink() and last.resolve() == p.resolve():
            continue  # a sharded checkpoint that last.ckpt still points at: rotated out at the next save
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
