"""BadBatchMixin: loss-spike detection at the step and the record of every batch training skipped.

It owns the spike detector (`dream_trainer.utils.spikes.SpikeDetector`, on when `config.spike_policy`
is not "off"), the detections (`trainer.spikes`), the skip list (`trainer.skipped_batches`: each batch a
spike policy or `non_finite_grads="skip"` dropped, and the ones `config.skip_batches` names), and which
step the "skip" policy drops. `OptimizationMixin` (above it) reads `_spike_skips_step` in its optimizer
step and reports non-finite skips through `_record_skipped`; the rollback (`mixins/rollback.py`) reads
the detector. The skip list reaches checkpoints through the state registry ("bad_batches"), run.json
when a batch is added, and the loggers as `skipped_batches` (`LoggingMixin._flush_train_metrics`).
See docs/bad-batches.md and `dream_trainer.mixins.core` for the layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dream_trainer.errors import MisconfigurationError
from dream_trainer.mixins.amp import AMPMixin
from dream_trainer.mixins.run_directory import RunDirectoryMixin
from dream_trainer.run_state import StateOwner
from dream_trainer.utils.spikes import SpikeDetector, Where, pairs, read_skip_list
from dream_trainer.utils.step_outputs import loss_of
from dream_trainer.utils.warn import warn_user


class BadBatchMixin(AMPMixin, RunDirectoryMixin):
    """`spikes`, `skipped_batches`; the spike check of each training batch."""

    def _init_bad_batches(self) -> None:
        cfg = self.config
        self._spike_policy: str = cfg.spike_policy
        if self._spike_policy in ("skip", "rollback") and self.is_distributed:
            raise MisconfigurationError(
                f"spike_policy={self._spike_policy!r} runs on one process only: write spike_policy='warn' "
                f"(or 'off') with {self.world_size} processes.\n  Each rank sees its own loss, and dropping or "
                "rolling back a step on one rank only would desynchronise the replicas; agreeing would take "
                "a collective every step."
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
            "bad_batches": {"skipped": list(self.skipped_batches), "spikes": list(self.spikes), "detector": detector}
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
        before the optimizer steps) and "warn" at a logging step (the metrics are read there anyway)."""
        detector, loop = self._spikes, self._loop
        assert detector is not None
        loss = loss_of(outputs)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return  # nothing to watch (a step that returned no loss)
        detector.check(loss, (loop.epoch, batch_idx, loop.global_step))
        if not loop.window_end:
            return
        if self._spike_skip:
            found = detector.read()  # SYNC: "skip" decides before the optimizer steps
            if found is not None:
                self._spike_skip_step = loop.global_step
                self._note_spike(found, "skipped")
                self._record_skipped("spike", [found])
        elif self._spike_warn and (
            (loop.global_step + 1) % loop.log_every_n_steps == 0
            or (loop.epoch_length is not None and batch_idx + 1 >= loop.epoch_length)
        ):
            found = detector.read()  # SYNC, at a logging step or an epoch's end, read back there anyway
            if found is not None:
                self._note_spike(found, "warned")

    def _spike_skips_step(self) -> bool:
        """The "skip" policy drops this window's optimizer step (read in `_optimizer_step`)."""
        return self._spike_skip_step == self._loop.global_step

    def _read_spike(self) -> Where | None:
        """The first spike not read yet (SYNC), for the rollback; None without a detector."""
        return None if self._spikes is None else self._spikes.read()

    def _note_spike(self, where: Where, action: str) -> None:
        epoch, batch_idx, step = where
        self.spikes.append({"epoch": epoch, "batch_idx": batch_idx, "global_step": step, "action": action})
        warn_user(
            f"loss spike at epoch {epoch}, batch {batch_idx} (global_step {step}): {action} "
            f"(spike_policy={self._spike_policy!r}, spike_threshold={self.config.spike_threshold}). "
            "See trainer.spikes and trainer.skipped_batches; docs/bad-batches.md.",
        )

    def _record_skipped(self, reason: str, where: list[Where]) -> None:
        """Add batches to the skip list (each once) and to run.json; a resume skips them too."""
        known = pairs(self.skipped_batches)
        added = False
        for epoch, batch_idx, step in where:
            if (epoch, batch_idx) not in known:
                known.add((epoch, batch_idx))
                self.skipped_batches.append(
                    {"epoch": epoch, "batch_idx": batch_idx, "global_step": step, "reason": reason}
                )
                added = True
        if added and self.is_global_zero:
            self._record_in_run("skipped_batches", list(self.skipped_batches))

    def _window_batches(self) -> list[Where]:
        """The batches of the accumulation window ending now (a non-finite skip drops them all)."""
        loop = self._loop
        last = loop.batch_idx
        return [(loop.epoch, i, loop.global_step) for i in range(last - loop.window_pos + 1, last + 1)]

    def _batches_to_drop(self, epoch: int) -> frozenset[int] | None:
        """Batch indices of `epoch` the loader drops without a step: `config.skip_batches` and the skip list
        (a resume that reaches a skipped batch again skips it again). None when there are none."""
        drop = {b for e, b in self._skip_from_config if e == epoch}
        drop.update(b for e, b in pairs(self.skipped_batches) if e == epoch)
        return frozenset(drop) if drop else None
