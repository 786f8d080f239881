"""A run resumed from a checkpoint written at a `val_every_n_steps` step before that step's validation ran
(`trainer.save_checkpoint` called in `on_train_batch_end`, then a kill before or during the validation) runs
the validation first: its results reach the loggers at that step once, as in the uninterrupted run, and
training continues exactly. A SIGTERM at that step is acted on at the batch boundary, after the validation:
its checkpoint holds it, and the resumed run does not repeat it."""

from __future__ import annotations

import contextlib
import json
import os
import signal

import torch
from conftest import TinyTrainer, quiet_config

from dream_trainer import Callback, TrainingInterrupted
from dream_trainer.loggers import JSONLinesLogger


class TermAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)  # the checkpoint is written at the boundary, after the validation


class Killed(Exception):
    pass


class SaveThenDieAt(Callback):
    """Saves with `trainer.save_checkpoint` (at once) in `on_train_batch_end` of `step`, then dies in its
    validation, as a job killed there would."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.path = None

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.path = trainer.save_checkpoint(trainer.checkpoint_dir / "before-validation.ckpt")

    def on_validation_start(self, trainer):
        if self.path is not None:
            raise Killed


def _run(root, callbacks=(), ckpt_path=None):
    cfg = quiet_config(
        root,
        n_epochs=1,
        val_every_n_steps=4,
        log_every_n_steps=1,
        callbacks=list(callbacks),
        loggers=[JSONLinesLogger()],
    )
    trainer = TinyTrainer(cfg, n_train=32, n_val=8)
    with contextlib.suppress(TrainingInterrupted, Killed):
        trainer.fit(ckpt_path=ckpt_path)
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    return trainer, [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]


def test_a_run_stopped_at_a_validation_step_runs_that_validation_when_resumed(tmp_path):
    full, full_val = _run(tmp_path / "full")
    assert [s for s, _ in full_val] == [4, 8]
    saver = SaveThenDieAt(4)
    _, cut_val = _run(tmp_path / "cut", [saver])
    assert cut_val == []  # killed in the step-4 validation, whose results were never logged
    resumed, resumed_val = _run(tmp_path / "resumed", ckpt_path=saver.path)
    assert resumed_val == full_val  # step 4's validation ran at the resume, once, with the same result
    assert resumed.global_step == full.global_step == 8
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), full.model.parameters(), strict=True))


def test_a_signal_at_a_validation_step_stops_after_that_validation(tmp_path):
    full, full_val = _run(tmp_path / "full")
    _, cut_val = _run(tmp_path / "cut", [TermAt(4)])
    assert cut_val == full_val[:1]  # the step-4 validation ran before the signal's checkpoint
    resumed, resumed_val = _run(tmp_path / "cut", ckpt_path="last")
    assert resumed_val == full_val  # the continued run's log: step 4's validation once, then step 8's
    assert resumed.global_step == full.global_step == 8
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), full.model.parameters(), strict=True))
