"""A run resumed from a checkpoint written at a `val_every_n_steps` step before that step's validation ran
(a SIGTERM at that step, a kill during the validation) runs the validation first: its results reach the
loggers at that step once, as in the uninterrupted run, and training continues exactly."""

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
            os.kill(os.getpid(), signal.SIGTERM)  # the checkpoint is written at this step, before its validation


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
    with contextlib.suppress(TrainingInterrupted):
        trainer.fit(ckpt_path=ckpt_path)
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    return trainer, [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]


def test_a_run_stopped_at_a_validation_step_runs_that_validation_when_resumed(tmp_path):
    full, full_val = _run(tmp_path / "full")
    assert [s for s, _ in full_val] == [4, 8]
    _, cut_val = _run(tmp_path / "cut", [TermAt(4)])
    assert cut_val == []  # stopped before the step-4 validation
    resumed, resumed_val = _run(tmp_path / "cut", ckpt_path="last")
    assert resumed_val == full_val  # step 4's validation ran at the resume, once, with the same result
    assert resumed.global_step == full.global_step == 8
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), full.model.parameters(), strict=True))
