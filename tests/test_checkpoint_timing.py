"""When a checkpoint requested at a step's end is written: at the batch boundary, after every
`on_train_batch_end` callback and after the validation that step runs, before the next step starts
(issue 36). So a file ranked by a validation metric holds the weights that validation scored, `{val_loss}`
can name the first file, and a resume from any such file is exact whatever callbacks draw from the
global RNG, wherever they are listed. `trainer.is_optimizer_step_end` says which micro-batch ends a step."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyTrainer, quiet_config

from dream_trainer import Callback, ModelCheckpoint, TrainingInterrupted


class DropoutTrainer(TinyTrainer):
    """TinyTrainer whose step draws from the global RNG (dropout on the inputs): a resume that starts
    from another RNG state trains other weights."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"loss": F.mse_loss(self.model(F.dropout(x, p=0.25, training=True)), y)}


class RecordValidations(Callback):
    """`scores[step]`: val_loss of every validation of the run (not the sanity check)."""

    def __init__(self) -> None:
        self.scores: dict[int, float] = {}

    def on_validation_end(self, trainer: Any) -> None:
        if not trainer.sanity_checking:
            self.scores[trainer.global_step] = trainer.callback_metrics["val_loss"]


class Draw(Callback):
    """Samples from the global RNG in `on_train_batch_end` (every micro-batch) at every `every`-th step,
    as a callback that logs sample generations does."""

    def __init__(self, every: int) -> None:
        self.every = every

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step % self.every == 0:
            torch.multinomial(torch.ones(10), 3)


def _params(trainer: TinyTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def _score_of(path: str, root: Path, **config: Any) -> float:
    """val_loss of the weights in the file at `path`, measured by a new trainer."""
    fresh = TinyTrainer(quiet_config(root, **config), n_train=32, batch_size=4)  # the validation data below
    return fresh.validate(ckpt_path=path)["val_loss"]


@pytest.mark.parametrize(
    "cadence",
    [
        pytest.param({"val_every_n_steps": 2}, id="val_every_n_steps"),
        # every 8 steps = each epoch's last batch, validated by the epoch's validation right after it
        pytest.param({"val_every_n_steps": None}, id="epoch_validation"),
    ],
)
def test_best_k_files_hold_the_weights_their_score_was_measured_on(tmp_path: Path, cadence: dict[str, Any]) -> None:
    every = 2 if cadence["val_every_n_steps"] else 8
    ckpt = ModelCheckpoint(monitor="val_loss", save_top_k=2, every_n_train_steps=every)
    record = RecordValidations()
    cfg = quiet_config(tmp_path / "run", n_epochs=3, callbacks=[ckpt, record], **cadence)
    trainer = TinyTrainer(cfg, n_train=32, batch_size=4, lr=0.3)
    trainer.fit()  # 8 steps per epoch, 24 in all

    saved_steps = [s for s in record.scores if s % every == 0]
    best = sorted(saved_steps, key=lambda s: record.scores[s])[:2]
    assert sorted(r["step"] for r in ckpt.kept) == sorted(best)  # the 2 best of all validations
    for r in ckpt.kept:
        assert r["score"] == record.scores[r["step"]]  # ranked by the validation of its own step
        assert _score_of(r["path"], tmp_path / "check", **cadence) == r["score"]  # measured on these weights
    assert ckpt.best_model_score == record.scores[best[0]]
    on_disk = sorted(str(p) for p in trainer.checkpoint_dir.iterdir())
    assert on_disk == sorted(r["path"] for r in ckpt.kept)


def test_val_loss_in_the_filename_names_the_first_save(tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(filename="{step}-{val_loss:.5f}", monitor="val_loss", every_n_train_steps=2, save_top_k=-1)
    record = RecordValidations()
    cfg = quiet_config(tmp_path, n_epochs=1, val_every_n_steps=2, callbacks=[ckpt, record])
    trainer = TinyTrainer(cfg, n_train=16, batch_size=4)  # 4 steps: saves and validations at steps 2 and 4
    trainer.fit()
    names = sorted(p.name for p in trainer.checkpoint_dir.iterdir())
    assert names == [f"step={s}-val_loss={record.scores[s]:.5f}.ckpt" for s in (2, 4)]


def _fit_with_draws(root: Path, placement: str, ckpt_path: Path | None = None) -> DropoutTrainer:
    """Accumulation 2: 8 batches, 4 steps per epoch, 12 in all; checkpoints and draws every 2 steps (Draw
    samples in both micro-batches that see such a global_step), Draw listed `placement` ModelCheckpoint."""
    ckpt = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)
    callbacks = [Draw(2), ckpt] if placement == "before" else [ckpt, Draw(2)]
    cfg = quiet_config(root, n_epochs=3, gradient_accumulation_steps=2, callbacks=callbacks)
    trainer = DropoutTrainer(cfg, n_train=32, batch_size=4)
    trainer.fit(ckpt_path=ckpt_path)
    assert trainer.global_step == 12
    return trainer


def test_resume_from_a_step_checkpoint_is_exact_whatever_callbacks_draw(tmp_path: Path) -> None:
    for placement in ("before", "after"):
        full = _fit_with_draws(tmp_path / placement / "full", placement)
        step_6 = next(full.checkpoint_dir.glob("*step=6.ckpt"))  # mid-epoch 1, as if killed after it
        resumed = _fit_with_draws(tmp_path / placement / "resumed", placement, ckpt_path=step_6)
        for a, b in zip(_params(resumed), _params(full), strict=True):
            assert torch.equal(a, b), f"Draw listed {placement} ModelCheckpoint: the resume is not exact"


class RngAtBatchStart(Callback):
    """The torch RNG state as each training batch starts, by (global_step, batch_idx)."""

    def __init__(self) -> None:
        self.states: dict[tuple[int, int], torch.Tensor] = {}

    def on_train_batch_start(self, trainer: Any, batch: Any, batch_idx: int) -> None:
        self.states[(trainer.global_step, batch_idx)] = torch.get_rng_state()


class SamplingValidation(DropoutTrainer):
    """A validation that draws from the global RNG (nanoGPT samples its evaluation batches)."""

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        torch.randint(0, 10, (4,))
        return super().validation_step(batch, batch_idx)


def test_a_step_checkpoint_holds_the_rng_state_the_next_step_starts_from(tmp_path: Path) -> None:
    # val_restores_rng=False: the step's validation draws from the training RNG, as Draw (listed last) does.
    ckpt = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)
    starts = RngAtBatchStart()
    cfg = quiet_config(
        tmp_path, n_epochs=1, gradient_accumulation_steps=2, val_every_n_steps=2, val_restores_rng=False,
        callbacks=[starts, ckpt, Draw(2)],
    )  # fmt: skip
    trainer = SamplingValidation(cfg, n_train=32, batch_size=4)
    trainer.fit()
    # steps 1..4; the step-2 file is written after batch 3, the step-3 window starts at batch 4
    saved = torch.load(next(trainer.checkpoint_dir.glob("*step=2.ckpt")), weights_only=True)
    assert torch.equal(saved["rng"]["torch"], starts.states[(2, 4)])


class StepEnds(Callback):
    """`trainer.is_optimizer_step_end` as seen by each training hook, by batch index."""

    def __init__(self) -> None:
        self.at_start: list[bool] = []
        self.at_end: list[bool] = []
        self.at_epoch_end: list[bool] = []

    def on_train_batch_start(self, trainer: Any, batch: Any, batch_idx: int) -> None:
        self.at_start.append(trainer.is_optimizer_step_end)

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.at_end.append(trainer.is_optimizer_step_end)

    def on_train_epoch_end(self, trainer: Any) -> None:
        self.at_epoch_end.append(trainer.is_optimizer_step_end)


def test_is_optimizer_step_end_is_true_on_the_micro_batch_that_ends_a_step(tmp_path: Path) -> None:
    seen = StepEnds()
    cfg = quiet_config(tmp_path, n_epochs=2, gradient_accumulation_steps=2, callbacks=[seen])
    trainer = TinyTrainer(cfg, n_train=20, batch_size=4)  # 5 batches: windows of 2, 2 and 1
    trainer.fit()
    assert trainer.global_step == 6
    assert seen.at_end == [False, True, False, True, True] * 2
    assert seen.at_start == [False] * 10
    assert seen.at_epoch_end == [False, False]
    assert trainer.is_optimizer_step_end is False  # outside training


class TermAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.loop.step_ended and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_checkpoint_holds_the_state_of_the_step_checkpoints(tmp_path: Path) -> None:
    # SIGTERM at step 4, a validation step with a ModelCheckpoint save; Draw (listed last) samples there.
    ckpt = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)
    record = RecordValidations()
    cfg = quiet_config(tmp_path, n_epochs=1, val_every_n_steps=2, callbacks=[ckpt, record, TermAt(4), Draw(2)])
    trainer = DropoutTrainer(cfg, n_train=32, batch_size=4)
    with contextlib.suppress(TrainingInterrupted):
        trainer.fit()
    assert trainer.global_step == 4 and sorted(record.scores) == [2, 4]  # step 4's validation ran first
    by_signal = torch.load(next(trainer.checkpoint_dir.glob("signal-*step=4.ckpt")), weights_only=True)
    by_cadence = torch.load(next(trainer.checkpoint_dir.glob("epoch=0-step=4.ckpt")), weights_only=True)
    assert by_signal["counters"]["last_val_step"] == by_cadence["counters"]["last_val_step"] == 4
    assert torch.equal(by_signal["rng"]["torch"], by_cadence["rng"]["torch"])
    for name, tensor in by_cadence["models"]["model"].items():
        assert torch.equal(by_signal["models"]["model"][name], tensor)
