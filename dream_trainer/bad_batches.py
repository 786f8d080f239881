"""`BadBatchPolicy`: what training does about a bad batch, as one object the trainer holds.

It owns every piece of the bad-batch policy (docs/bad-batches.md): the loss-spike detector
(`dream_trainer.utils.spikes.SpikeDetector`, on when `config.spike_policy` is not "off"), the detections
(`trainer.spikes`), the skip list (`trainer.skipped_batches`: each batch a spike policy or
`non_finite_grads="skip"` dropped, with its sample indices where the sampler can say:
`utils/sample_indices.py`), the batches `config.skip_batches` names, which optimizer step the "skip"
policy drops, and the "rollback" policy's in-memory snapshot, the batches fetched since it and their
replay. It registers its run state itself ("bad_batches": the skip list, the detections and the
detector's statistic in checkpoints; the statistic in a snapshot, so a rollback keeps the skip list).

The trainer (`StepMixin._init_bad_batches`) creates it once and calls it at a few places, each named:

- `check_loss(outputs, batch_idx)`: once per micro-batch, after its backward, only with a spike policy
  (the step holds this bound method or None: a step without a policy pays one `is None` test);
- `drops_step()`: asked by the optimizer step with `spike_policy="skip"` (again a bound method or None);
- `skip_window(reason)`: the optimizer step dropped this window's step (`non_finite_grads="skip"`);
- `batches(numbered)` and `after_batch(boundary_work)`: the training loop's batches without the skip
  list's, with the rollback's kept batches and replays, and the rollback's check after each batch.

Under DDP, "skip" and "rollback" decide together: each rank watches its own loss, and where the policy
reads its decision (`_read_spike`) one all-reduce of one integer finds the first spike on any rank, so
every rank drops (or rolls back past) the same batch index. "rollback" reads at the same points on every
rank (they depend on the step count, the epoch's end and the boundary's work, which a checkpoint save
queues on every rank); every rank restores its own snapshot of the same step and trains again on the same
batch indices without the same one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from dream_trainer.errors import MisconfigurationError
from dream_trainer.run_state import StateOwner, StateRegistry
from dream_trainer.utils.sample_indices import batch_sample_indices
from dream_trainer.utils.spikes import SpikeDetector, Where, pairs, read_skip_list
from dream_trainer.utils.step_outputs import loss_of
from dream_trainer.utils.warn import warn_user

if TYPE_CHECKING:
    from dream_trainer.config import DreamTrainerConfig
    from dream_trainer.loop_state import LoopState
    from dream_trainer.parallel.strategy import Strategy

# "No spike" in the all-reduce (a minimum) that finds the first spike on any rank.
_NO_SPIKE = 1 << 62


class BadBatchPolicy:
    """The bad-batch policy of one trainer (see the module docstring). Read `spikes`, `skipped_batches`
    and the flags anywhere; everything changes through its methods.

    Args:
        config: the trainer's config (`spike_*`, `skip_batches`).
        loop: the trainer's `LoopState` (where the loop is; the policy counts a dropped batch through it).
        strategy: the trainer's strategy object (`trainer.parallel`): processes, collectives, data-parallel size.
        mark: marks the trainer's heartbeat (`Heartbeat.mark`): before the ranks' agreement on a spike, a hang
            watchdog names a rank missing from it.
        registry: the trainer's state registry, where the policy registers its run state ("bad_batches").
        record_in_run: writes a key of run.json (the skip list, when a batch is added).
        train_loader: the training loader as the trainer holds it now (a skipped batch's sample indices).
        snapshot / restore: the trainer's `snapshot()` / `restore(snapshot)` ("rollback").
        reset_boundary: drops the work queued at the batch boundary (a rollback undoes the steps that
            queued it: the replay queues it again).
        release_logs: `release_logs(hold)` sends the loggers what the steps since the last snapshot point
            logged, and holds what comes next back if `hold` ("rollback": while an epoch's batches run, the
            loggers get a step's rows once it is kept, so they never see a step a rollback discards).
    """

    __slots__ = (
        "_detector", "_kept", "_loop", "_mark", "_point", "_policy", "_record_in_run", "_release_logs", "_replay",
        "_reset_boundary",
        "_restore", "_skip_from_config", "_skip_step", "_snapshot", "_strategy", "_threshold", "_train_loader", "agree",
        "rollback_every", "rolls_back", "skipped_batches", "skips", "spikes", "warns",
    )  # fmt: skip

    def __init__(
        self,
        config: DreamTrainerConfig,
        loop: LoopState,
        strategy: Strategy,
        mark: Callable[[str], None],
        registry: StateRegistry,
        *,
        record_in_run: Callable[[str, Any], None],
        train_loader: Callable[[], Iterable[Any] | None],
        snapshot: Callable[[], Any],
        restore: Callable[[Any], None],
        reset_boundary: Callable[[], None],
        release_logs: Callable[[bool], None],
    ) -> None:
        policy = self._policy = config.spike_policy
        # "skip"/"rollback" on several processes: every rank must take the same decision at the same step.
        self.agree: bool = policy in ("skip", "rollback") and strategy.world_size > 1
        if self.agree and strategy.name != "ddp":
            raise MisconfigurationError(
                f"spike_policy={policy!r} runs on one process or under strategy='ddp', not "
                f"strategy={strategy.name!r}: use strategy='ddp', or spike_policy='warn' (or 'off').\n  Under DDP "
                "every rank holds the whole model and optimizer state, so each rank drops the same step, or "
                "restores its own in-memory snapshot, and the replicas stay identical. Sharded or pipelined "
                "state (FSDP, tensor or pipeline parallelism) has not been made to roll back or skip together."
            )
        self._detector: SpikeDetector | None = (
            None if policy == "off" else SpikeDetector(config.spike_threshold, config.spike_window, config.spike_warmup)
        )
        self._threshold: float = config.spike_threshold
        self.skips: bool = policy == "skip"
        self.warns: bool = policy == "warn"
        self.rolls_back: bool = policy == "rollback"
        self.rollback_every: int = config.spike_snapshot_every
        self.spikes: list[dict[str, Any]] = []  # every spike detected: epoch, batch_idx, global_step, action
        self.skipped_batches: list[dict[str, Any]] = []  # every batch dropped: epoch, batch_idx, global_step, reason
        self._skip_from_config: set[tuple[int, int]] = read_skip_list(config.skip_batches)
        self._skip_step: int = -1  # the global_step whose optimizer step the "skip" policy drops
        self._point: Any = None  # "rollback": the snapshot (`trainer.snapshot()`) training rolls back to
        self._kept: list[tuple[int, Any]] = []  # "rollback": the batches fetched since it, in order
        self._replay: list[tuple[int, Any, bool]] = []  # to train on again after a rollback (True: drop it)
        self._loop, self._strategy, self._mark = loop, strategy, mark
        self._record_in_run, self._train_loader = record_in_run, train_loader
        self._snapshot, self._restore, self._reset_boundary = snapshot, restore, reset_boundary
        self._release_logs = release_logs
        registry.register(
            "bad_batches", StateOwner(self.state_dict, self.load_state_dict, self.copy_state, self.put_state)
        )

    @property
    def watches(self) -> bool:
        """A spike policy is on: every training batch's loss is checked (`check_loss`)."""
        return self._detector is not None

    @property
    def filters_batches(self) -> bool:
        """The training loop must take its batches through `batches()` this epoch: "rollback", or batches to
        drop (`config.skip_batches`, the skip list)."""
        return self.rolls_back or bool(self._skip_from_config) or bool(self.skipped_batches)

    # --- run state (see `dream_trainer.run_state`) ----------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        detector = None if self._detector is None else self._detector.state_dict()
        return {
            # Copies: an entry may still gain its ranks (`_record_skipped`) while a background save writes this.
            "bad_batches": {
                "skipped": [dict(e) for e in self.skipped_batches],
                "spikes": [dict(e) for e in self.spikes],
                "detector": detector,
            }
        }

    def load_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        saved = checkpoint.get("bad_batches")
        if not saved:
            return
        self.skipped_batches[:] = [dict(e) for e in saved.get("skipped", [])]
        self.spikes[:] = [dict(e) for e in saved.get("spikes", [])]
        if self._detector is not None and saved.get("detector") is not None:
            self._detector.load_state_dict(saved["detector"])

    # A snapshot puts the statistic back, never the lists: a rollback must not forget the batch it drops.
    def copy_state(self) -> Any:
        return None if self._detector is None else self._detector.copy_state()

    def put_state(self, saved: Any) -> None:
        if self._detector is not None and saved is not None:
            self._detector.put_state(saved)

    # --- the step: the check, once per training batch (only with a spike policy) ----------------------
    def check_loss(self, outputs: Any, batch_idx: int) -> None:
        """Add this batch's loss to the statistic. No sync, except "skip" at a window's end (it must know
        before the optimizer steps; with several processes, one all-reduce of one integer: `_read_spike`)
        and "warn" at a logging step (the metrics are read there anyway; each rank warns of its own)."""
        detector, loop = self._detector, self._loop
        assert detector is not None
        loss = loss_of(outputs)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return  # nothing to watch (a step that returned no loss)
        detector.check(loss, (loop.epoch, batch_idx, loop.global_step))
        if not loop.window_end:
            return
        if self.skips:
            # SYNC: "skip" decides before the optimizer steps (several processes: with one all-reduce)
            spike = self._read_spike()
            if spike is not None:
                where, ranks = spike
                self._skip_step = loop.global_step
                self._note_spike(where, "skipped", ranks)
                # The window's step is dropped: every batch of it is (`ranks` goes on the spiking one's entry).
                window = self._window_batches()
                if where not in window:  # (the window's indices have a gap: a batch the loader dropped)
                    window = sorted([*window, where])
                self._record_skipped("spike", window, ranks, ranks_at=where)
        elif self.warns and (
            (loop.global_step + 1) % loop.log_every_n_steps == 0
            or (loop.epoch_length is not None and batch_idx + 1 >= loop.epoch_length)
        ):
            found = detector.read()  # SYNC, at a logging step or an epoch's end, read back there anyway
            if found is not None:
                self._note_spike(found, "warned", [])

    def drops_step(self) -> bool:
        """The "skip" policy drops this window's optimizer step (decided in `check_loss`; asked by the
        optimizer step, before the unscale)."""
        return self._skip_step == self._loop.global_step

    def skip_window(self, reason: str) -> None:
        """The optimizer step of the window ending now was dropped (`non_finite_grads="skip"`): every batch
        of the window goes on the skip list."""
        self._record_skipped(reason, self._window_batches())

    # --- the spike decision -----------------------------------------------------------------------
    def _read_spike(self) -> tuple[Where, list[int]] | None:
        """The first spike not read yet, with the global ranks whose loss it was (empty on one process);
        None without a detector or a spike. SYNC: one device-to-host read.

        With several processes ("skip", "rollback") every rank calls it at the same point, and one
        all-reduce (a minimum) of one integer, the index of each rank's first spike among the losses
        checked since the last read, makes the first spike on any rank every rank's: all drop or roll back
        past the same batch. Only when there is one, a second small collective says on which ranks."""
        detector = self._detector
        if detector is None:
            return None
        if not self.agree:
            found = detector.read()
            return None if found is None else (found, [])
        strategy = self._strategy
        self._mark("spike decision")  # a rank missing from the all-reduce is named here
        first = strategy.all_reduce(detector.first_index(_NO_SPIKE, strategy.device), "min")
        index = int(first)  # SYNC
        if index == _NO_SPIKE:
            detector.take(None)
            return None
        mine = (detector.first_index(_NO_SPIKE, strategy.device) == index).to(torch.long).reshape(1)
        ranks = torch.cat(strategy.all_gather(mine)).nonzero().flatten().tolist()  # a spike (rare): which ranks
        found = detector.take(index)
        if found is None:
            raise RuntimeError(
                f"spike_policy={self._policy!r}: rank {strategy.global_rank} checked fewer training losses than "
                f"the rank whose loss spiked: every rank's training_step must return a scalar loss for every batch."
            )
        return found, [int(r) for r in ranks]

    def _note_spike(self, where: Where, action: str, ranks: list[int]) -> None:
        epoch, batch_idx, step = where
        entry: dict[str, Any] = {"epoch": epoch, "batch_idx": batch_idx, "global_step": step, "action": action}
        if ranks:
            entry["ranks"] = list(ranks)
        self.spikes.append(entry)
        if self.agree and self._strategy.global_rank != 0:
            return  # every rank took the same decision: rank zero says it once
        on = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else ""
        warn_user(
            f"loss spike at epoch {epoch}, batch {batch_idx} (global_step {step}){on}: {action} "
            f"(spike_policy={self._policy!r}, spike_threshold={self._threshold}). "
            "See trainer.spikes and trainer.skipped_batches; docs/bad-batches.md.",
        )

    # --- the skip list ----------------------------------------------------------------------------
    def _record_skipped(
        self, reason: str, where: list[Where], ranks: list[int] | None = None, ranks_at: Where | None = None
    ) -> None:
        """Add batches to the skip list (each once, with their sample indices where the sampler can say)
        and to run.json; a resume skips them too. `ranks`: the ranks whose loss spiked (several processes),
        on every entry, or only on batch `ranks_at`'s (a spike skip drops its whole window)."""
        known = {(int(e["epoch"]), int(e["batch_idx"])): e for e in self.skipped_batches}
        added = False
        for epoch, batch_idx, step in where:
            spiked = ranks if ranks_at is None or ranks_at[:2] == (epoch, batch_idx) else None
            listed = known.get((epoch, batch_idx))
            if listed is not None:
                if spiked and "ranks" not in listed:  # a non-finite skip, then the rollback its spike asked for
                    listed["ranks"] = list(spiked)
                    added = True
                continue
            entry: dict[str, Any] = {"epoch": epoch, "batch_idx": batch_idx, "global_step": step, "reason": reason}
            if spiked:
                entry["ranks"] = list(spiked)
            entry.update(self._sample_indices(epoch, batch_idx))
            known[(epoch, batch_idx)] = entry
            self.skipped_batches.append(entry)
            added = True
        if added and self._strategy.global_rank == 0:
            self._record_in_run("skipped_batches", list(self.skipped_batches))

    def _sample_indices(self, epoch: int, batch_idx: int) -> dict[str, Any]:
        """A skip entry's sample indices: `sample_indices` (every data-parallel rank's, in rank order) and,
        with several ranks, `sample_indices_per_rank`; nothing where the sampler cannot say. Computed from
        the sampler now (no per-batch record); a shuffling sampler's order from the RNG that drew this
        epoch's (`LoopState.epoch_rng`), which only the running epoch has."""
        loop = self._loop
        epoch_rng = loop.epoch_rng if epoch == loop.epoch else None
        per_rank = batch_sample_indices(
            self._train_loader(), epoch, batch_idx, epoch_rng, int(self._strategy.data_parallel_size)
        )
        if per_rank is None:
            return {}
        found: dict[str, Any] = {"sample_indices": [i for part in per_rank for i in part]}
        if len(per_rank) > 1:
            found["sample_indices_per_rank"] = per_rank
        return found

    def _window_batches(self) -> list[Where]:
        """The batches of the accumulation window ending now (a non-finite or a spike skip drops them all)."""
        loop = self._loop
        last = loop.batch_idx
        return [(loop.epoch, i, loop.global_step) for i in range(last - loop.window_pos + 1, last + 1)]

    def _batches_to_drop(self, epoch: int) -> frozenset[int] | None:
        """Batch indices of `epoch` the loader drops without a step: `config.skip_batches` and the skip list
        (a resume that reaches a skipped batch again skips it again). None when there are none."""
        drop = {b for e, b in self._skip_from_config if e == epoch}
        drop.update(b for e, b in pairs(self.skipped_batches) if e == epoch)
        return frozenset(drop) if drop else None

    # --- the loop's batches, and the rollback ("rollback": a snapshot, the batches since, the replay) ------
    def batches(self, numbered: Iterable[tuple[int, Any]]) -> Iterator[tuple[int, Any]]:
        """`numbered` ((batch_idx, batch) of the epoch) without the batches the skip list names (each is
        fetched, counted as done, and dropped), with the rollback's kept batches and replays."""
        loop = self._loop
        drop = self._batches_to_drop(loop.epoch)
        rolls_back = self.rolls_back
        if rolls_back:
            self._take_point()  # at the start of each epoch's batches
        source = iter(numbered)
        while True:
            if self._replay:
                batch_idx, batch, dropped = self._replay.pop(0)
                if dropped:  # the spike's batch: fetched once already, never trained on again
                    loop.drop_batch()
                    continue
            else:
                item = next(source, None)
                if item is None:
                    if rolls_back:
                        if self.after_batch(False, final=True):
                            continue  # a spike in the epoch's last steps: train on again from the snapshot
                        self._release_logs(False)  # the epoch's steps are all kept
                    return
                batch_idx, batch = item
            if drop is not None and batch_idx in drop:
                loop.drop_batch()  # a resume's position counts it: the loader yielded it
                continue
            if rolls_back:
                self._kept.append((batch_idx, batch))
            yield batch_idx, batch

    def _take_point(self) -> None:
        self._release_logs(True)  # the steps up to here are kept: their rows go out, the next ones wait
        self._point = self._snapshot()  # with the empty list of held rows: a rollback drops what came since
        self._kept.clear()

    def after_batch(self, boundary_work: bool, final: bool = False) -> bool:
        """With `spike_policy="rollback"`, after each training batch, before its boundary's work
        (`boundary_work`: some is queued, and a checkpoint saved there must never hold weights a spike
        reached), and at the epoch's end (`final`): at a snapshot point (every `spike_snapshot_every`
        steps), or before queued work, read the detector; on a spike, roll back (True), else move the
        snapshot here. Nothing inside a window."""
        loop = self._loop
        if loop.window_pos != 0 or self._point is None:
            return False
        if not (final or boundary_work or loop.global_step % self.rollback_every == 0):
            return False
        # SYNC: once per spike_snapshot_every steps (and before a save); with several processes, one
        # all-reduce of one integer, so that every rank rolls back past the same batch
        spike = self._read_spike()
        if spike is None:
            if not final:
                self._take_point()
            return False
        found, ranks = spike
        epoch, batch_idx, _ = found
        self._note_spike(found, "rolled back", ranks)
        self._record_skipped("spike", [found], ranks)
        replay = [(i, batch, loop.epoch == epoch and i == batch_idx) for i, batch in self._kept]
        self._restore(self._point)
        self._reset_boundary()  # what the undone steps asked for there: the replay asks again
        self._replay = replay + self._replay
        self._kept.clear()
        return True
