"""CheckpointMixin: the trainer's whole state as one dict, and files that hold it.

It sits above `SetupMixin` (saving or loading sets the trainer up first), `StateFormatMixin` and
`SignalMixin` (it writes the checkpoint a signal asks for: `_stop_on_signal`); the accumulation
window's part of the state is the window's own (`dream_trainer.accumulation`, a state owner of its own).
See `dream_trainer.mixins.core` for the layers.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dream_trainer.accumulation import written_in_window
from dream_trainer.errors import CheckpointError, TrainingInterrupted
from dream_trainer.mixins.setup import SetupMixin
from dream_trainer.mixins.signals import SignalMixin
from dream_trainer.mixins.state_format import StateFormatMixin
from dream_trainer.run_state import StateOwner
from dream_trainer.utils.checkpoint_io import (
    NONFINITE_TAG,
    SIGNAL_PREFIX,
    TRAINER_STATE,
    AsyncWriter,
    atomic_save,
    detached_cpu_copy,
    find_last,
    is_sharded_checkpoint,
    model_mismatch,
    move_aside_file,
    point_last,
    read_checkpoint,
    remove_checkpoint,
)
from dream_trainer.utils.data_reshard import as_order, changed_step_size, resharded_position
from dream_trainer.utils.data_resume import global_order, keeps_own_position, order_source, samples_per_step
from dream_trainer.utils.modules import unwrap
from dream_trainer.utils.non_finite import weights_are_finite
from dream_trainer.utils.run_dirs import CHECKPOINTS, is_run_dir, remove_partial_files, runs_newest_first
from dream_trainer.utils.seed import rng_state, set_rng_state
from dream_trainer.utils.step_fence import StepFence
from dream_trainer.utils.warn import warn_user

if TYPE_CHECKING:
    from typing import Self

    from dream_trainer.callbacks.model_checkpoint import ModelCheckpoint

FORMAT_VERSION = 1


class CheckpointMixin(StateFormatMixin, SetupMixin, SignalMixin):
    """`state_dict()` / `load_state_dict()` and `save_checkpoint(path)` / `load_checkpoint(path)`.

    The state holds models (unwrapped), optimizers, schedulers, the loss scaler, counters, RNG states
    and callback states. Files are written atomically (temporary name, fsync, rename) and read with
    `torch.load(weights_only=True)`, so loading never unpickles arbitrary objects. Both file methods
    may be overridden (the Trainer Guide's trainer overrides `load_checkpoint`).
    """

    # --- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the run; fires `on_save_checkpoint(checkpoint)`."""
        return self._build_state(with_tensors=True)

    def _build_state(self, with_tensors: bool) -> dict[str, Any]:
        self._setup_fit()
        state: dict[str, Any] = {
            # What wrote the file (the run directory's owner adds the run: "run_dir").
            "dream_trainer": {
                "format_version": FORMAT_VERSION,
                "trainer_class": type(self).__qualname__,
                "config": self.config.to_dict(),
            },
            # The user's objects by attribute name (models and optimizers below, with the tensors).
            "schedulers": {n: s.state_dict() for n, s in self.named_schedulers()},
        }
        # The trainer's own run state: each owner's entries (see dream_trainer.run_state).
        self._state_owners.state_dict(into=state)
        if with_tensors:
            state["models"] = {n: self._model_state(m) for n, m in self.named_models()}
            state["optimizers"] = {n: self._optimizer_state(o) for n, o in self.named_optimizers()}
        self._bus.fire("on_save_checkpoint", state)
        return state

    # --- the run state this mixin owns (registered in `_init_checkpointing`) -------------------------
    def _loop_entries(self) -> dict[str, Any]:
        """The loop: the counters, and where in the epoch the run is (this rank's, and each rank's)."""
        loop = self._loop
        data = self._data_state()
        return {
            "counters": {
                "global_step": loop.global_step,
                "current_epoch": loop.epoch,
                # The epoch a resumed run starts in: the next one once this epoch's batches are all done
                # (a checkpoint written from on_train_epoch_end must not replay the epoch).
                "resume_epoch": loop.epoch + int(loop.epoch_in_progress and loop.epoch_exhausted),
                "last_val_step": loop.last_val_step,
            },
            "data": data,
            # Each rank's place in its own shard of the data (a StatefulDataLoader's state, the epoch's
            # RNG): restored per rank, like the RNG; another world size is refused mid-epoch.
            "data_per_rank": self.all_gather_object(data) if self.is_distributed else None,
        }

    def _resume_loop(self, checkpoint: Mapping[str, Any]) -> None:
        """Continue the loop where the checkpoint was written: its counters now, and, written in the
        middle of an epoch, the mid-epoch resume record, applied when the loop opens that epoch's
        iterator (see `DreamTrainer._iter_train_batches`). `checkpoint["data"]` is this rank's."""
        # (Checkpoints of development versions also hold counters["cut_at"]; nothing reads it any more.)
        counters = checkpoint.get("counters", {})
        data = checkpoint.get("data") or {}
        epoch = int(counters.get("resume_epoch", counters.get("current_epoch", 0)))
        record = None
        if data.get("batches_done", 0) > 0 and data.get("epoch") == epoch:
            record = {
                **data,
                "rng": self._rank_rng(checkpoint),
                "metrics": self._rank_metrics(checkpoint),
            }
        self._loop.resume(int(counters.get("global_step", 0)), epoch, int(counters.get("last_val_step", -1)), record)

    def _rng_entries(self) -> dict[str, Any]:
        # Each rank's RNG (dropout, augmentation); restored per rank when the world size matches.
        return {
            "rng": rng_state(),
            "rng_per_rank": self.all_gather_object(rng_state()) if self.is_distributed else None,
        }

    def _rank_rng(self, checkpoint: Mapping[str, Any]) -> Any:
        """This rank's RNG state in `checkpoint` (rank 0's when another number of ranks wrote it)."""
        per_rank = checkpoint.get("rng_per_rank")
        if per_rank and len(per_rank) == self.world_size:
            return per_rank[self.global_rank]
        return checkpoint.get("rng")

    def _load_rng(self, checkpoint: Mapping[str, Any]) -> None:
        per_rank = checkpoint.get("rng_per_rank")
        if per_rank and len(per_rank) != self.world_size:
            warn_user(
                f"the checkpoint was written by {len(per_rank)} ranks and is loaded by {self.world_size}: "
                "every rank continues from rank 0's RNG state, so random draws differ from the original run",
            )
        rng = self._rank_rng(checkpoint)
        if rng is not None:
            set_rng_state(rng)

    def _datamodule_entries(self) -> dict[str, Any]:
        return {"datamodule": self.datamodule.state_dict() if self.datamodule is not None else None}

    def _load_datamodule(self, checkpoint: Mapping[str, Any]) -> None:
        if self.datamodule is not None and checkpoint.get("datamodule") is not None:
            self.datamodule.load_state_dict(checkpoint["datamodule"])

    def _copy_datamodule(self) -> dict[str, Any]:
        return copy.deepcopy(self._datamodule_entries())  # load_state_dict may keep what it is handed

    def _put_datamodule(self, saved: Mapping[str, Any]) -> None:
        self._load_datamodule(copy.deepcopy(saved))  # the snapshot stays valid for the next restore

    def _copy_callbacks(self) -> dict[str, Any]:
        return copy.deepcopy(self._callback_entries())

    def _put_callbacks(self, saved: Mapping[str, Any]) -> None:
        self._load_callbacks(copy.deepcopy(saved))

    def _callback_entries(self) -> dict[str, Any]:
        return {"callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks}}

    def _load_callbacks(self, checkpoint: Mapping[str, Any]) -> None:
        saved = checkpoint.get("callbacks", {})
        for cb in self.callbacks:
            if cb.state_key in saved:
                cb.load_state_dict(saved[cb.state_key])

    def _data_state(self) -> dict[str, Any]:
        """Where in the epoch the run is: enough to resume on the next batch it would have seen."""
        loader: Any = self._train_loader_raw  # keeps_own_position(loader): it has state_dict()
        loop = self._loop
        mid_epoch = loop.mid_epoch  # also after fit() returned inside the epoch (`LoopState.epoch_unfinished`)
        order, per_step = global_order(loader), samples_per_step(loader, int(self.parallel.data_parallel_size))
        done = loop.batches_done if mid_epoch else 0
        return {
            "epoch": loop.epoch,
            "world_size": self.world_size,
            "data_parallel_size": int(self.parallel.data_parallel_size),
            # What lets a mid-epoch resume on another number of ranks continue exactly (see
            # `dream_trainer.utils.data_reshard`): the order over all ranks, how many samples one batch of
            # each covers, and the global sample cursor (samples of that order done by all ranks).
            "global_order": order,
            "order_source": order_source(loader),
            "samples_per_step": per_step,
            "samples_done": done * per_step if order is not None and per_step else None,
            "batches_done": done,
            "epoch_rng": loop.epoch_rng if mid_epoch else None,
            "loader_state": loader.state_dict() if mid_epoch and keeps_own_position(loader) else None,
        }

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Restore what `state_dict()` returned; sets the trainer up first if `fit()` has not.

        With `strict=False`, models load with `strict=False` and missing entries are skipped.
        """
        self._restore_state(state, strict, with_tensors=True)

    def _restore_state(self, state: dict[str, Any], strict: bool, with_tensors: bool) -> None:
        self._setup_fit()
        if not isinstance(state, dict) or ("models" not in state and with_tensors):
            raise CheckpointError(
                "this is not a dream_trainer checkpoint (no 'models' entry); it has keys "
                f"{sorted(state) if isinstance(state, dict) else type(state).__name__}"
            )
        self._check_origin(state.get("dream_trainer", {}))
        data = self._rank_data_state(state)  # before anything is loaded: it may refuse the checkpoint
        self._bus.fire("on_load_checkpoint", state)
        if with_tensors:
            self._load_group("models", state, dict(self.named_models()), strict)
            self._load_group("optimizers", state, dict(self.named_optimizers()), strict)
        self._load_group("schedulers", state, dict(self.named_schedulers()), strict)
        # The trainer's own run state, owner by owner in registration order, "data" as this rank resumes it.
        self._state_owners.load_state_dict({**state, "data": data})

    def _rank_data_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's part of the data state: its own entry of `data_per_rank` when the checkpoint was
        written by as many ranks as load it, with the same batch size.

        Otherwise, mid-epoch, each rank's position belongs to a part of the data that no longer exists; the
        trainer continues from the global sample cursor where the order over all ranks does not depend on
        their number, and refuses anything else naming why (`dream_trainer.utils.data_reshard`). On one
        process the training loader first takes the checkpoint's DistributedSampler order (`_keep_data_order`).
        """
        data: dict[str, Any] = state.get("data") or {}
        per_rank = state.get("data_per_rank")
        self._keep_data_order(as_order(data.get("global_order")))
        done = int(data.get("batches_done", 0))
        saved_world = len(per_rank) if per_rank else data.get("world_size")
        saved_dp = data.get("data_parallel_size")
        dp_size = int(self.parallel.data_parallel_size)
        loader = self._train_loader_raw
        # A known order read with another batch size continues from the cursor too (the same ranks or not).
        per_step = samples_per_step(loader, dp_size) if global_order(loader) is not None else None
        other_step = per_step is not None and data.get("samples_per_step") not in (None, per_step)
        resharded = saved_world is not None and (saved_world != self.world_size or saved_dp != dp_size)
        if loader is not None and (resharded or other_step):  # (no training loader: no position to resume)
            saved, now = (saved_world, saved_dp), (self.world_size, dp_size)
            in_window = written_in_window(state)
            position = resharded_position(data, loader, saved, now, in_window) if done else None  # may refuse
            accumulation = int(state.get("dream_trainer", {}).get("config", {}).get("gradient_accumulation_steps", 1))
            note = changed_step_size(data, accumulation, loader, dp_size, self.config.gradient_accumulation_steps)
            if note:
                warn_user(note)
            if position is not None:
                return position
        if per_rank and saved_world == self.world_size and saved_dp in (None, dp_size):
            return dict(per_rank[self.global_rank])
        if done and self.is_distributed and data.get("loader_state") is not None:
            warn_user(
                "this checkpoint holds one data-loader state for all ranks (written before dream_trainer "
                "saved one per rank): every rank resumes from rank 0's place in the data, so ranks whose "
                "position differed replay or skip samples until the epoch ends",
            )
        return data

    def _init_checkpointing(self) -> None:
        self._writer = AsyncWriter()
        self._async_buffer: Any = None  # CPU copy of the last async save, reused by the next one
        self._step_fence = StepFence()  # the next optimizer step waits for a background state copy
        self._preloaded: tuple[Path, dict[str, Any]] | None = None
        # fit(ckpt_path="last") of a trainer that already trained this run (a second fit()): its loggers,
        # attached already, go back to the checkpoint's step (rank zero's decision; only it logs).
        self._continues_own_run: bool = False
        self._force_sync_save: bool = False  # the save a signal asks for is never left to the background
        self._signal_checkpoints: list[Path] = []  # the signal checkpoint this trainer wrote last
        owners = self._state_owners
        # The loop's snapshot is LoopState's own exact copy (the window copies itself: "accumulation").
        loop = self._loop
        owners.register(
            "loop", StateOwner(self._loop_entries, self._resume_loop, loop.state_dict, loop.load_state_dict)
        )
        owners.register("rng", StateOwner(self._rng_entries, self._load_rng, rng_state, set_rng_state))
        # The user's own stateful objects besides models, optimizers and schedulers, loaded last; a
        # snapshot (`trainer.snapshot()`, a spike rollback) copies their checkpoint entries.
        owners.register(
            "datamodule",
            StateOwner(self._datamodule_entries, self._load_datamodule, self._copy_datamodule, self._put_datamodule),
        )
        owners.register(
            "callbacks",
            StateOwner(self._callback_entries, self._load_callbacks, self._copy_callbacks, self._put_callbacks),
        )

    # Settings that legitimately change between a run and its resumption (train longer, log more).
    _RESUMABLE_CHANGES = frozenset(
        {
            "n_epochs", "max_steps", "callbacks", "loggers", "print_epoch_summary", "log_every_n_steps",
            "resume_from", "async_checkpointing", "checkpoint_crc32", "handle_signals", "root_dir", "run_name",
            "enable_progress_bar", "enable_checkpointing", "process_group_timeout", "strategy", "device",
            "non_finite_grads", "max_non_finite_retries", "non_finite_loss", "hang_timeout", "hang_timeout_first_step",
            "spike_policy", "spike_threshold", "spike_window", "spike_warmup", "spike_snapshot_every", "skip_batches",
        }
    )  # fmt: skip

    def _check_origin(self, meta: dict[str, Any]) -> None:
        """Warn, naming each difference, when the checkpoint comes from another trainer class or
        config. Not an error: subclasses and renamed trainers load compatible state; what really
        does not fit (missing or reshaped entries) fails in `_load_group` with the names."""
        diffs = []
        saved_cls = meta.get("trainer_class")
        if saved_cls is not None and saved_cls != type(self).__qualname__:
            diffs.append(f"trainer class: {saved_cls!r} -> {type(self).__qualname__!r}")
        saved_cfg = meta.get("config")
        if isinstance(saved_cfg, dict):
            now = self.config.to_dict()
            diffs += [
                f"{k}: {saved_cfg[k]!r} -> {now[k]!r}"
                for k in sorted(set(saved_cfg) & set(now))
                if saved_cfg[k] != now[k] and k not in self._RESUMABLE_CHANGES
            ]
        if diffs:
            warn_user("loading a checkpoint that differs from this trainer: " + "; ".join(diffs))

    def _load_group(self, group: str, state: dict[str, Any], live: dict[str, Any], strict: bool) -> None:
        saved = state.get(group, {})
        missing = sorted(set(live) - set(saved))
        if missing and strict:
            raise CheckpointError(
                f"the checkpoint has no {group} named {missing} (it has {sorted(saved)}); start a new run "
                "(fit() without ckpt_path), or load the rest with load_checkpoint(path, strict=False)."
            )
        for name, obj in live.items():
            if name not in saved:
                continue
            try:
                if group == "models":
                    self._load_model_state(obj, saved[name], strict)
                elif group == "optimizers":
                    self._load_optimizer_state(obj, saved[name])
                else:
                    obj.load_state_dict(saved[name])
            except (RuntimeError, ValueError, KeyError) as exc:
                raise CheckpointError(self._load_failure(group, name, obj, saved[name], exc)) from exc

    def _load_failure(self, group: str, name: str, obj: Any, saved: Any, exc: BaseException) -> str:
        """The error when `saved` does not load into `obj`: a first line that says what does not fit and
        what to do, each differing entry on a line below it."""
        what = f"the checkpoint's {group[:-1]} {name!r} does not fit this trainer's"
        reason, *below = str(exc).strip().splitlines() or [type(exc).__name__]
        if group == "models" and isinstance(saved, dict):
            summary, reshaped, details = model_mismatch(saved, unwrap(obj).state_dict())
            if summary:
                reason, below = summary, details
                if reshaped:  # strict=False skips missing and extra entries, never a tensor of another size
                    todo = "it is another model (size or architecture): start a new run (fit() without ckpt_path)"
                else:
                    todo = (
                        "start a new run (fit() without ckpt_path), or load the matching weights with "
                        "load_checkpoint(path, strict=False)"
                    )
                return "\n".join([f"{what}: {reason}; {todo}.", *below])
        reason = reason if len(reason) < 150 else reason[:147] + "..."
        todo = "start a new run (fit() without ckpt_path), or resume with the trainer that wrote it"
        return "\n".join([f"{what}: {reason}; {todo}.", *below])

    # --- files ------------------------------------------------------------------------------------
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

    def _weights_finite(self) -> bool:
        """True when every model's parameters and buffers are finite on every rank (collective;
        SYNC: checkpoint saves only)."""
        reduce = self.all_reduce if self.is_distributed else None
        return weights_are_finite((m for _, m in self.named_models()), reduce)

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
        preloaded, self._preloaded = self._preloaded, None
        if is_sharded_checkpoint(path):
            path = Path(path)
            if preloaded is not None and Path(preloaded[0]) == path:
                state = preloaded[1]
            else:
                state = read_checkpoint(path / TRAINER_STATE)
            self._setup_fit()
            self._load_sharded_tensors(path, strict)
            self._restore_state(state, strict, with_tensors=False)
            return
        state = preloaded[1] if preloaded is not None and Path(preloaded[0]) == Path(path) else read_checkpoint(path)
        self.load_state_dict(state, strict=strict)

    def _stop_on_signal(self) -> None:
        # Declared by SignalMixin: at a batch boundary once a signal arrived, save, then leave `fit()`.
        signum = self._signal_received
        assert signum is not None
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
        interrupted = TrainingInterrupted(signum, path, self._requeue_after_save(signum))
        self._announce_run(interrupted.summary(self._loop.global_step))
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
            path = self._choose_run(ckpt_path)
            return str(self._run_dir), None if path is None else str(path)

        run_dir, path = self._on_rank_zero("open the run directory", decide)
        self._use_run_dir(Path(run_dir))
        return None if path is None else Path(path)

    def _choose_run(self, ckpt_path: str | os.PathLike[str] | None) -> Path | None:
        self._continues_own_run = False
        if ckpt_path is None:
            if self._open_own_run():
                self._announce_run(f"run directory {self._run_dir}")
            return None
        if os.fspath(ckpt_path) != "last":
            path = Path(ckpt_path)
            self._open_own_run(started_from=str(path))
            self._announce_run(f"run directory {self._run_dir}, starting from {path}")
            return path
        self._heartbeat.mark("load_checkpoint (finding the newest)")
        found = self._find_last()
        if found is None:
            first_start = self._first_start_of_resumable_run()
            if not first_start:
                self._warn_nothing_to_resume()
            if self._open_own_run():
                where = self._where_last_looked()
                note = f'; resume_from="last": nothing to resume yet in {where}' if first_start else ""
                self._announce_run(f"run directory {self._run_dir}{note}")
            return None
        path, state, owner = found
        self._preloaded = (path, state)
        step = (state.get("counters") or {}).get("global_step", "?")
        if owner is not None and owner != self._run_dir and not self._loggers_attached:
            self._abandon_run()  # a run claimed by reading trainer.run_dir early, and never used
            self._continue_run(owner, path)
            removed = remove_partial_files(owner / CHECKPOINTS) if self.is_global_zero else []
            note = f"; removed {len(removed)} partial file(s) of an interrupted save" if removed else ""
            self._announce_run(f"continuing run {owner} from {path.name} (global step {step}){note}")
        elif owner is not None and owner == self._run_dir:
            self._open_own_run()
            self._continues_own_run = self._loggers_attached
            self._announce_run(f"continuing run {owner} from {path.name} (global step {step})")
        else:  # the old layout, a shared dirpath whose writer is gone, or a trainer already in use
            self._open_own_run(started_from=str(path))
            self._announce_run(f"run directory {self._run_dir}, resuming from {path} (global step {step})")
        return path

    def _open_own_run(self, **record: Any) -> bool:
        """This trainer's run: a new one (True), or the one it has (locked again for a second `fit()`)."""
        if self._run_dir is None:
            self._claim_new_run(**record)
            return True
        if self._run_lock is None:
            self._take_run(self._run_dir)
        return False

    def _find_last(self) -> tuple[Path, dict[str, Any], Path | None] | None:
        """The checkpoint "last" means, and the run directory it belongs to (None: not a run's own).
        Only ever read: nothing here writes or deletes."""
        explicit = self._explicit_checkpoint_dir()
        if explicit is not None:  # the user chose where checkpoints go: look there, as always
            found = find_last(explicit)
            if found is None:
                return None
            writer = found[1].get("dream_trainer", {}).get("run_dir")
            owner = Path(writer) if isinstance(writer, str) and is_run_dir(Path(writer)) else None
            if owner is not None and self._run_dir is not None and _same_dir(owner, self._run_dir):
                owner = self._run_dir
            return found[0], found[1], owner
        if self._run_dir is not None and self._loggers_attached:  # this trainer's own run comes first
            found = find_last(self._run_dir / CHECKPOINTS)
            if found is not None:
                return found[0], found[1], self._run_dir
        for run in runs_newest_first(self._root, self.config.run_name):
            found = find_last(run / CHECKPOINTS)
            if found is not None:
                return found[0], found[1], run
        found = find_last(self._root / CHECKPOINTS)  # <root_dir>/checkpoints of earlier versions
        if found is not None:
            return found[0], found[1], None
        return None

    def _where_last_looked(self) -> str:
        """Where `ckpt_path="last"` looks, for messages: ModelCheckpoint's dirpath, or the runs."""
        explicit = self._explicit_checkpoint_dir()
        if explicit is not None:
            return repr(str(explicit))
        family = f" named {self.config.run_name!r}" if self.config.run_name else ""
        return f"any run{family} under {str(self._root)!r} (nor in {str(self._root / CHECKPOINTS)!r})"

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
        where = self._where_last_looked()
        warn_user(f'fit(ckpt_path="last"): no valid checkpoint in {where}; starting from scratch')

    def _resolve_ckpt_path(self, ckpt_path: str | os.PathLike[str], entry: str) -> Path:
        """For `validate`/`test`/`predict` (`entry`): `"last"` -> the checkpoint `fit(ckpt_path="last")`
        would continue from; a path as given. Unlike `fit`, which starts a new run when there is nothing to
        resume, evaluating the untrained weights would report numbers nobody asked for: an error."""
        if os.fspath(ckpt_path) != "last":
            return Path(ckpt_path)
        found = self._find_last()
        if found is None:
            raise CheckpointError(
                f'{entry}(ckpt_path="last"): no valid checkpoint in {self._where_last_looked()}; train first '
                f"(fit), or pass the path of a checkpoint, or call {entry}() without ckpt_path to use the "
                "current weights"
            )
        self._preloaded = found[0], found[1]
        return found[0]


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
