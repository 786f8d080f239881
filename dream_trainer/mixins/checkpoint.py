"""CheckpointMixin: files that hold the trainer's state, written and read back.

`save_checkpoint` writes the dict `StateDictMixin` builds (atomically, or copied to the CPU and written by
a background thread: `_save_in_background`), `load_checkpoint` reads one back and restores it, and
`load_from_checkpoint` rebuilds a trainer from one. It sits above `StateDictMixin` (what a checkpoint
holds), `ResumeMixin` (where checkpoints go, and the checkpoint a fit resumes from, which it may have read
already). It is the trainer's reaction to a signal (`_stop_on_signal`: the checkpoint a signal asks for,
then `TrainingInterrupted`), which `DreamTrainer` gives the stop control (`dream_trainer.stop_control`). See
`dream_trainer.mixins.core` for the layers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dream_trainer.errors import TrainingInterrupted
from dream_trainer.mixins.resume import ResumeMixin
from dream_trainer.mixins.state_dict import StateDictMixin
from dream_trainer.utils.checkpoint_io import (
    NONFINITE_TAG,
    SIGNAL_PREFIX,
    TRAINER_STATE,
    AsyncWriter,
    atomic_save,
    detached_cpu_copy,
    is_sharded_checkpoint,
    move_aside_file,
    point_last,
    read_checkpoint,
    remove_checkpoint,
)
from dream_trainer.utils.non_finite import weights_are_finite
from dream_trainer.utils.step_fence import StepFence

if TYPE_CHECKING:
    from typing import Self

    from dream_trainer.stop_control import RequeueAfterSave


class CheckpointMixin(StateDictMixin, ResumeMixin):
    """`save_checkpoint(path)` / `load_checkpoint(path)`: the state of `state_dict()` in a file.

    Files are written atomically (temporary name, fsync, rename) and read with
    `torch.load(weights_only=True)`, so loading never unpickles arbitrary objects. Both file methods
    may be overridden (the Trainer Guide's trainer overrides `load_checkpoint`).
    """

    def _init_checkpointing(self) -> None:
        self._init_state_dict()  # registers the loop, RNG, datamodule and callbacks state owners
        self._writer = AsyncWriter()
        self._async_buffer: Any = None  # CPU copy of the last async save, reused by the next one
        self._step_fence = StepFence()  # the next optimizer step waits for a background state copy
        self._force_sync_save: bool = False  # the save a signal asks for is never left to the background
        self._signal_checkpoints: list[Path] = []  # the signal checkpoint this trainer wrote last

    # --- files ------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Write `state_dict()` to `path` atomically; only global rank zero writes. Returns the path.

        The state is the one at the call. From `on_train_batch_end` that is before the callbacks listed
        later and before the step's validation (their RNG draws and metrics are not in it); to save the
        state the next step starts from, as ModelCheckpoint does, call it through
        `trainer.at_batch_boundary(trainer.save_checkpoint, path)`.

        With `config.async_checkpointing` the state is copied to the CPU here and written by a
        background thread; the next save, `wait_for_checkpoint()` and the end of `fit()` wait for it.
        """
        path = Path(path)
        self._heartbeat.mark("save_checkpoint")
        self._flush_loggers()  # a run resumed from here misses no logged value
        if self.sharded_checkpoints:
            self._writer.wait()
            state = self._build_state(with_tensors=False)
            from dream_trainer.utils.sharded_checkpoint import save_sharded  # DCP: imported when used

            # A file of that name (a run continued under another strategy) makes way for the directory.
            aside = move_aside_file(path) if self.is_global_zero else None
            self._heartbeat.mark("save_checkpoint (writing)")
            save_sharded(self._sharded_tensors(), state, path, self.is_global_zero)
            if aside is not None:
                aside.unlink()
            if self._mirror is not None and self.is_global_zero:
                self._mirror.publish(path)
            return path
        state = self.state_dict()
        self._heartbeat.mark("save_checkpoint (writing)")
        if self.is_global_zero:
            # An earlier background write lands first; its buffer is then free to reuse (saves are
            # normally far apart, so this rarely waits).
            self.wait_for_checkpoint()
            if self.config.async_checkpointing and not self._force_sync_save:
                self._save_in_background(state, path)
            else:
                atomic_save(state, path, self.config.checkpoint_crc32)
            if self._mirror is not None:  # its upload is queued once the file is complete on disk
                self.after_checkpoint_write(self._mirror.publish, path)
        return path

    def _save_in_background(self, state: dict[str, Any], path: Path) -> None:
        # Only the copy of what the next steps could change blocks the loop. The optimizers'
        # per-parameter state (most of the bytes) changes only in optimizer.step(): the writer
        # thread copies it while the next forward/backward run, and the next step waits for that.
        deferred = {name: opt.pop("state") for name, opt in state.get("optimizers", {}).items() if "state" in opt}
        previous = self._async_buffer if isinstance(self._async_buffer, dict) else {}
        reuse_deferred = {n: o.get("state") for n, o in previous.get("optimizers", {}).items()}
        buffer = self._async_buffer = detached_cpu_copy(state, reuse=previous)
        copied = self._step_fence.arm([opt for _, opt in self.named_optimizers()]) if deferred else None

        def copy_then_write() -> None:
            try:
                for name, per_param in detached_cpu_copy(deferred, reuse=reuse_deferred).items():
                    buffer["optimizers"][name]["state"] = per_param
            finally:
                if copied is not None:
                    copied.set()  # a failed copy must not hold the training loop forever
            atomic_save(buffer, path, self.config.checkpoint_crc32)

        try:
            self._writer.submit(copy_then_write)
        except BaseException:
            if copied is not None:
                copied.set()  # nothing will copy: the next step must not wait for it
            raise

    def wait_for_checkpoint(self) -> None:
        """Block until background checkpoint writes are done; raise if one failed."""
        try:
            self._writer.wait()
        finally:
            self._step_fence.release()

    def after_checkpoint_write(self, fn: Any, *args: Any) -> None:
        """Run `fn(*args)` after the checkpoint being written is on disk (at once when no background
        write is pending): for file work that must follow it in order, such as moving a `last`
        pointer or deleting rotated checkpoints."""
        if self._writer.pending:
            self._writer.then(fn, *args)
        else:
            fn(*args)

    @classmethod
    def load_from_checkpoint(cls, path: str | os.PathLike[str], *, strict: bool = True, **overrides: Any) -> Self:
        """A new trainer of this class, rebuilt from the config the checkpoint records, with its weights.

        The config is read as plain data (`torch.load(weights_only=True)`; for a sharded directory its
        `trainer_state.pt`) and built as this class's config (`config_class`, else the `config`
        annotation of `__init__`), so every value is validated again. Only the models' weights are
        loaded: optimizers, schedulers and counters start fresh, ready for `validate()`, `test()`,
        `predict()`, or `fit()` as a new run from these weights (`fit(ckpt_path=path)` resumes the whole
        training state instead). Callbacks and loggers, recorded by class name only, are not rebuilt.

        Args:
            path: a checkpoint file or sharded checkpoint directory; `"last"`: the newest valid checkpoint
                of the newest run under `root_dir` (of `run_name`; both from `overrides`, else the
                config class's defaults).
            strict: models load with `strict` (False loads matching entries only).
            **overrides: config fields to replace (`n_epochs=5`, `device="cpu"`, `callbacks=[...]`), and
                the `__init__` parameters besides `config`, which checkpoints do not record: pass them
                again. Any other name is a `ConfigError` with the closest match.
        """
        from dream_trainer.lightning.from_checkpoint import build_from_checkpoint  # used rarely: imported then

        trainer, ckpt, state = build_from_checkpoint(cls, path, overrides)
        trainer._load_weights(ckpt, state, strict)
        return trainer

    def _load_weights(self, path: Path, state: dict[str, Any], strict: bool) -> None:
        """`load_from_checkpoint`'s load: set up (`configure_*`), `on_load_checkpoint` sees the state
        first (as with `load_checkpoint`), then the models' weights and nothing else."""
        self._setup_fit()
        self._bus.fire("on_load_checkpoint", state)
        if not is_sharded_checkpoint(path):
            self._load_group("models", state, dict(self.named_models()), strict)
            return
        from dream_trainer.utils.sharded_checkpoint import load_sharded_model_weights  # DCP: imported when used

        load_sharded_model_weights(dict(self.named_models()), path, strict)

    def load_checkpoint(self, path: str | os.PathLike[str], strict: bool = True) -> None:
        """Read a checkpoint written by `save_checkpoint` and restore it (sets the trainer up first).

        Loading uses `torch.load(weights_only=True)`: nothing in the file can run code.
        """
        self._heartbeat.mark("load_checkpoint")
        preloaded = self._take_preloaded(path)  # read already when "last" was looked for (None: read it now)
        if is_sharded_checkpoint(path):
            path = Path(path)
            state = preloaded if preloaded is not None else read_checkpoint(path / TRAINER_STATE)
            self._setup_fit()
            self._load_sharded_tensors(path, strict)
            self._restore_state(state, strict, with_tensors=False)
            return
        state = preloaded if preloaded is not None else read_checkpoint(path)
        self.load_state_dict(state, strict=strict)

    # --- the save a signal asks for -----------------------------------------------------------------
    def _stop_on_signal(self, signum: int, requeue_after_save: RequeueAfterSave) -> None:
        """Given to the stop control (`StopControl`), which calls it at a batch boundary once a signal arrived
        (`signum`): save, then leave `fit()` by raising `TrainingInterrupted`. `requeue_after_save(signum)`,
        asked once the save is complete: whether a SLURM job stopped by its requeue signal goes back in the
        queue."""
        directory = self.checkpoint_dir
        if self.is_global_zero:
            directory.mkdir(parents=True, exist_ok=True)
        finite = self._weights_finite()
        tag = "" if finite else NONFINITE_TAG  # kept for debugging; last.ckpt stays on the newest finite one
        path = directory / f"{SIGNAL_PREFIX}epoch={self._loop.epoch}-step={self._loop.global_step}{tag}.ckpt"
        self._force_sync_save = True  # the grace period is for this save: write it now
        try:
            self.save_checkpoint(path)
        finally:
            self._force_sync_save = False
        if self.is_global_zero and finite:
            point_last(directory, path)
            self._rotate_signal_checkpoints(directory, path)
        # The save is complete: a SLURM job stopped by its requeue signal goes back in the queue now.
        interrupted = TrainingInterrupted(signum, path, requeue_after_save(signum))
        line = interrupted.summary(self._loop.global_step)
        self._announce_run(line)
        # Recorded before the requeue that may follow (the stop control's): Slurm ends the job step seconds
        # after it, and under torchrun a rank may be killed before `fit()` ends and writes run.json.
        self._record_outcome_now(interrupted.outcome, line)
        raise interrupted

    def _rotate_signal_checkpoints(self, directory: Path, newest: Path) -> None:
        """Once `newest` is complete (and `last.ckpt` names it): delete the older `signal-*.ckpt` files
        of this run: all of them in the run's own directory; in a `dirpath` the user chose (which
        other runs may share), those this trainer wrote."""
        own = self._explicit_checkpoint_dir() is None
        for old in directory.glob(f"{SIGNAL_PREFIX}*.ckpt"):
            if old.name == newest.name or NONFINITE_TAG in old.name:
                continue
            if own or old in self._signal_checkpoints:
                remove_checkpoint(old)
        self._signal_checkpoints = [newest]

    def _weights_finite(self) -> bool:
        """True when every model's parameters and buffers are finite on every rank (collective;
        SYNC: checkpoint saves only)."""
        reduce = self.all_reduce if self.is_distributed else None
        return weights_are_finite((m for _, m in self.named_models()), reduce)
