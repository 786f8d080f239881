"""BadBatchMixin: loss-spike detection at the step and the record of every batch training skipped.

It owns the spike detector (`dream_trainer.utils.spikes.SpikeDetector`, on when `config.spike_policy`
is not "off"), the detections (`trainer.spikes`), the skip list (`trainer.skipped_batches`: each batch a
spike policy or `non_finite_grads="skip"` dropped, and the ones `config.skip_batches` names), and which
step the "skip" policy drops. `OptimizerStepMixin` (above it) reads `_spike_skips_step` in its optimizer
step and reports non-finite skips through `_record_skipped`; the rollback (`mixins/rollback.py`) reads
the detector. The skip list reaches checkpoints through the state registry ("bad_batches"), run.json
when a batch is added, and the loggers as `skipped_batches` (`LoggingMixin._flush_train_metrics`).
Each entry names the batch's sample indices where the sampler can say (`utils/sample_indices.py`).

Under DDP, "skip" and "rollback" decide together: each rank watches its own loss, and where the policy
reads its decision (`_read_spike`) one all-reduce of one integer finds the first spike on any rank, so
every rank drops (or rolls back past) the same batch index. See docs/bad-batches.md and
`dream_trainer.mixins.core` for the layers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dream_trainer.errors import MisconfigurationError
from dream_trainer.mixins.amp import AMPMixin
from dream_trainer.mixins.run_directory import RunDirectoryMixin
from dream_trainer.run_state import StateOwner
from dream_trainer.utils.sample_indices import batch_sample_indices
from dream_trainer.utils.spikes import SpikeDetector, Where, pairs, read_skip_list
from dream_trainer.utils.step_outputs import loss_of
from dream_trainer.utils.warn import warn_user

# "No spike" in the all-reduce (a minimum) that finds the first spike on any rank.
_NO_SPIKE = 1 << 62


class BadBatchMixin(AMPMixin, RunDirectoryMixin):
    """`spikes`, `skipped_batches`; the spike check of each training batch."""

    _train_loader_raw: Iterable[Any] | None  # SetupMixin's: the sample indices of a skipped batch come from it

    def _init_bad_batches(self) -> None:
        cfg = self.config
        self._spike_policy: str = cfg.spike_policy
        # "skip"/"rollback" on several processes: every rank must take the same decision at the same step.
        self._spike_agree: bool = self._spike_policy in ("skip", "rollback") and self.is_distributed
        if self._spike_agree and self.strategy != "ddp":
            raise MisconfigurationError(
                f"spike_policy={self._spike_policy!r} runs on one process or under strategy='ddp', not "
                f"strategy={self.strategy!r}: use strategy='ddp', or spike_policy='warn' (or 'off').\n  Under DDP "
                "every rank holds the whole model and optimizer state, so each rank drops the same step, or "
                "restores its own in-memory snapshot, and the replicas stay identical. Sharded or pipelined "
                "state (FSDP, tensor or pipeline parallelism) has not been made to roll back or skip together."
            )
        self._spikes: SpikeDetector | None = (
            None
            if self._spike_policy == "off"
            else SpikeDetector(cfg.spike_threshold, cfg.spike_window, cfg.spike_warmup)
        )
        self._spike_skip: bool = self._spike_policy == "skip"
        self._spike_warn: bool = self._spike_policy == "warn"
        self._spike_skip_step: int = -1  # the global_step whose optimizer step the "skip" policy drops
        self.spikes: list[dict[str, Any]] = []  # every spike detected: epoch, batch_idx, global_step, loss
        self.skipped_batches: list[dict[str, Any]] = []  # every batch dropped: epoch, batch_idx, global_step, reason
        self._skip_from_config: set[tuple[int, int]] = read_skip_list(cfg.skip_batches)
        self._state_owners.register(
            "bad_batches",
            StateOwner(self._bad_batch_entries, self._load_bad_batches, self._copy_detector, self._put_detector),
        )

    # --- run state (see `dream_trainer.run_state`) ----------------------------------------------------
    def _bad_batch_entries(self) -> dict[str, Any]:
        detector = None if self._spikes is None else self._spikes.state_dict()
        return {
            # Copies: an entry may still gain its ranks (`_record_skipped`) while a background save writes this.
            "bad_batches": {
                "skipped": [dict(e) for e in self.skipped_batches],
                "spikes": [dict(e) for e in self.spikes],
                "detector": detector,
            }
        }

    def _load_bad_batches(self, checkpoint: Mapping[str, Any]) -> None:
        saved = checkpoint.get("bad_batches")
        if not saved:
            return
        self.skipped_batches[:] = [dict(e) for e in saved.get("skipped", [])]
        self.spikes[:] = [dict(e) for e in saved.get("spikes", [])]
        if self._spikes is not None and saved.get("detector") is not None:
            self._spikes.load_state_dict(saved["detector"])

    # A snapshot puts the statistic back, never the lists: a rollback must not forget the batch it drops.
    def _copy_detector(self) -> Any:
        return None if self._spikes is None else self._spikes.copy_state()

    def _put_detector(self, saved: Any) -> None:
        if self._spikes is not None and saved is not None:
            self._spikes.put_state(saved)

    # --- the check, once per training batch (only with a spike policy) ---------------------------------
    def _check_spike(self, outputs: Any, batch_idx: int) -> None:
        """Add this batch's loss to the statistic. No sync, except "skip" at a window's end (it must know
        before the optimizer steps; with several processes, one all-reduce of one integer: `_read_spike`)
        and "warn" at a logging step (the metrics are read there anyway; each rank warns of its own)."""
        detector, loop = self._spikes, self._loop
        assert detector is not None
        loss = loss_of(outputs)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return  # nothing to watch (a step that returned no loss)
        detector.check(loss, (loop.epoch, batch_idx, loop.global_step))
        if not loop.window_end:
            return
        if self._spike_skip:
            # SYNC: "skip" decides before the optimizer steps (several processes: with one all-reduce)
            spike = self._read_spike()
            if spike is not None:
                where, ranks = spike
                self._spike_skip_step = loop.global_step
                self._note_spike(where, "skipped", ranks)
                # The window's step is dropped: every batch of it is (`ranks` goes on the spiking one's entry).
                window = self._window_batches()
                if where not in window:  # (the window's indices have a gap: a batch the loader dropped)
                    window = sorted([*window, where])
                self._record_skipped("spike", window, ranks, ranks_at=where)
        elif self._spike_warn and (
            (loop.global_step + 1) % loop.log_every_n_steps == 0
            or (loop.epoch_length is not None and batch_idx + 1 >= loop.epoch_length)
        ):
            found = detector.read()  # SYNC, at a logging step or an epoch's end, read back there anyway
            if found is not None:
                self._note_spike(found, "warned", [])

    def _spike_skips_step(self) -> bool:
        """The "skip" policy drops this window's optimizer step (read in `_optimizer_step`)."""
        return self._spike_skip_step == self._loop.global_step

    def _read_spike(self) -> tuple[Where, list[int]] | None:
        """The first spike not read yet, with the global ranks whose loss it was (empty on one process);
        None without a detector or a spike. SYNC: one device-to-host read.

        With several processes ("skip", "rollback") every rank calls it at the same point, and one
        all-reduce (a minimum) of one integer, the index of each rank's first spike among the losses
        checked since the last read, makes the first spike on any rank every rank's: all drop or roll back
        past the same batch. Only when there is one, a second small collective says on which ranks."""
        detector = self._spikes
        if detector is None:
            return None
        if not self._spike_agree:
            found = detector.read()
            return None if found is None else (found, [])
        self._heartbeat.mark("spike decision")  # a rank missing from the all-reduce is named here
        first = self.all_reduce(detector.first_index(_NO_SPIKE, self.device), "min")
        index = int(first)  # SYNC
        if index == _NO_SPIKE:
            detector.take(None)
            return None
        mine = (detector.first_index(_NO_SPIKE, self.device) == index).to(torch.long).reshape(1)
        ranks = torch.cat(self.all_gather(mine)).nonzero().flatten().tolist()  # a spike (rare): which ranks
        found = detector.take(index)
        if found is None:
            raise RuntimeError(
                f"spike_policy={self._spike_policy!r}: rank {self.global_rank} checked fewer training losses than "
                f"the rank whose loss spiked: every rank's training_step must return a scalar loss for every batch."
            )
        return found, [int(r) for r in ranks]

    def _note_spike(self, where: Where, action: str, ranks: list[int]) -> None:
        epoch, batch_idx, step = where
        entry: dict[str, Any] = {"epoch": epoch, "batch_idx": batch_idx, "global_step": step, "action": action}
        if ranks:
            entry["ranks"] = list(ranks)
        self.spikes.append(entry)
        if self._spike_agree and not self.is_global_zero:
            return  # every rank took the same decision: rank zero says it once
        on = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else ""
        warn_user(
            f"loss spike at epoch {epoch}, batch {batch_idx} (global_step {step}){on}: {action} "
            f"(spike_policy={self._spike_policy!r}, spike_threshold={self.config.spike_threshold}). "
            "See trainer.spikes and trainer.skipped_batches; docs/bad-batches.md.",
        )

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
        if added and self.is_global_zero:
            self._record_in_run("skipped_batches", list(self.skipped_batches))

    def _sample_indices(self, epoch: int, batch_idx: int) -> dict[str, Any]:
        """A skip entry's sample indices: `sample_indices` (every data-parallel rank's, in rank order) and,
        with several ranks, `sample_indices_per_rank`; nothing where the sampler cannot say. Computed from
        the sampler now (no per-batch record); a shuffling sampler's order from the RNG that drew this
        epoch's (`LoopState.epoch_rng`), which only the running epoch has."""
        loop = self._loop
        epoch_rng = loop.epoch_rng if epoch == loop.epoch else None
        per_rank = batch_sample_indices(
            self._train_loader_raw, epoch, batch_idx, epoch_rng, int(self.parallel.data_parallel_size)
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
