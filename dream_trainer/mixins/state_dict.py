"""StateDictMixin: the trainer's whole state as one dict, `state_dict()` / `load_state_dict()`.

The dict holds a header (format version, trainer class, config), the user's objects by attribute name
(models, optimizers, schedulers; the tensors in `StateFormatMixin`'s strategy-independent format) and
every state owner's entries (`dream_trainer.run_state`), among them those this mixin owns: the loop, the
RNG, the datamodule and the callbacks. Loading checks where the state comes from, resolves this rank's
data position (refusing what cannot resume exactly) and puts every owner back in registration order.
Files that hold the dict are `CheckpointMixin`'s (`dream_trainer.mixins.checkpoint`); the accumulation
window's part of the state is the window's own (`dream_trainer.accumulation`, a state owner of its own).
See `dream_trainer.mixins.core` for the layers.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from dream_trainer.accumulation import written_in_window
from dream_trainer.errors import CheckpointError
from dream_trainer.mixins.setup import SetupMixin
from dream_trainer.mixins.state_format import StateFormatMixin
from dream_trainer.run_state import StateOwner
from dream_trainer.snapshot import RunSnapshot
from dream_trainer.utils.checkpoint_io import model_mismatch
from dream_trainer.utils.data_reshard import (
    as_order,
    changed_step_size,
    global_batch_refusal,
    resharded_position,
    saved_accumulation,
)
from dream_trainer.utils.data_resume import global_order, keeps_own_position, order_source, samples_per_step
from dream_trainer.utils.modules import unwrap
from dream_trainer.utils.seed import rng_state, set_rng_state
from dream_trainer.utils.warn import warn_user

FORMAT_VERSION = 1


class StateDictMixin(StateFormatMixin, SetupMixin):
    """`state_dict()` / `load_state_dict()`: everything needed to continue the run, as one dict.

    The state holds models (unwrapped), optimizers, schedulers, the loss scaler, counters, RNG states
    and callback states; saving or loading sets the trainer up first.
    """

    def _init_state_dict(self) -> None:
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

    # --- in memory: a snapshot is a checkpoint's state without a file (`dream_trainer.snapshot`) --------
    def snapshot(self) -> RunSnapshot:
        """The whole run state now, in memory (weights, gradients, optimizers, schedulers, and every
        registered state owner: loop counters and position, loss scaler, RNG, metrics, callbacks' and
        the datamodule's state); sets the trainer up first. No file, no collective, no hook fires."""
        self._setup_fit()
        return RunSnapshot(self)

    def restore(self, snapshot: RunSnapshot) -> None:
        """Put back the state `snapshot()` captured (the snapshot stays valid for another restore). The
        data iterator is not rewound: the next batch is the one the loop would have fetched anyway."""
        if not isinstance(snapshot, RunSnapshot) or snapshot.trainer_id != id(self):
            raise ValueError(
                f"trainer.restore() takes a snapshot this trainer's snapshot() returned; got {type(snapshot).__name__} "
                "(from another trainer, or not a snapshot)"
            )
        snapshot._put_back(self)

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
        # What the file holds, so a reader can tell a section lost from one never written (verified on
        # every read: dream_trainer.utils.checkpoint_verify); listed after the hook, which may add its own.
        state["dream_trainer"]["sections"] = sorted(state)
        return state

    # --- the run state this mixin owns (registered in `_init_state_dict`) ------------------------------
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
        ft = self._fault_tolerance
        if ft is not None:  # the quorum's cursor, in the same terms (a run without fault tolerance continues it)
            return {**self._position(loop, loader, mid_epoch, done, order, per_step), **ft.data_position(mid_epoch)}
        return self._position(loop, loader, mid_epoch, done, order, per_step)

    def _position(
        self, loop: Any, loader: Any, mid_epoch: bool, done: int, order: tuple[Any, ...] | None, per_step: int | None
    ) -> dict[str, Any]:
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
        if self._fault_tolerance is not None:  # the cursor continues, whoever wrote the checkpoint (or refuses)
            return self._fault_tolerance.resumed_data(dict(per_rank[self.global_rank]) if per_rank else data)
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
        # Written under fault tolerance: its position is the quorum's global sample cursor, on any number of ranks.
        resharded = resharded or bool(data.get("fault_tolerance"))
        if loader is not None and (resharded or other_step):  # (no training loader: no position to resume)
            saved, now = (saved_world, saved_dp), (self.world_size, dp_size)
            steps = (data, saved_accumulation(state), loader, dp_size, self.config.gradient_accumulation_steps)
            # Refused where only the number of ranks changed the samples per step, after the data's own reasons.
            refusal = global_batch_refusal(*steps)
            in_window = written_in_window(state)
            position = resharded_position(data, loader, saved, now, in_window, refusal is None) if done else None
            if refusal is not None:
                raise CheckpointError(refusal)
            note = changed_step_size(*steps)
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

    # Settings that legitimately change between a run and its resumption (train longer, log more).
    _RESUMABLE_CHANGES = frozenset(
        {
            "n_epochs", "max_steps", "callbacks", "loggers", "print_epoch_summary", "log_every_n_steps",
            "resume_from", "async_checkpointing", "checkpoint_crc32", "handle_signals", "root_dir", "run_name",
            "enable_progress_bar", "enable_checkpointing", "process_group_timeout", "strategy", "device",
            "non_finite_grads", "max_non_finite_retries", "non_finite_loss", "hang_timeout", "hang_timeout_first_step",
            "spike_policy", "spike_threshold", "spike_window", "spike_warmup", "spike_snapshot_every", "skip_batches",
            "fault_tolerance", "mirror",
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
