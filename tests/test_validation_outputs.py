"""What `validation_step` / `test_step` return reaches the evaluation's metrics, never a training metric's name
(issue 42, item 5).

Before, `return {"loss": loss}` from `validation_step` was logged as `loss`: the validation value overwrote
training's in `trainer.callback_metrics` (until the epoch's mean overwrote it back), metrics.csv mixed the two
in one column, a `ModelCheckpoint(monitor="val_loss")` found nothing, and a returned tensor was not logged at
all. Now the returned loss (a scalar tensor, a dict's `"loss"`, a Hugging Face-style `ModelOutput`'s `loss`)
is `val_loss` (`test_loss` in `test()`), another returned name that training logs too is `val_<name>`, and a
name the step gives explicitly (a `val_loss` key, `self.log("val_loss", ...)`) keeps its value.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyTrainer, make_regression_data, quiet_config
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer.callbacks import EarlyStopping, ModelCheckpoint
from dream_trainer.loggers import CSVLogger, JSONLinesLogger


@dataclasses.dataclass
class ModelOutput(OrderedDict):
    """A stand-in for transformers' `ModelOutput`: an OrderedDict of the fields that are not None, which are
    also attributes (`out.loss`, `out["loss"]`)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value


class ReturnsLossKey(TinyTrainer):
    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return {"loss": F.mse_loss(self.model(x), y)}

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return {"loss": F.mse_loss(self.model(x), y)}


class ReturnsTensor(TinyTrainer):
    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.mse_loss(self.model(x), y)


class ReturnsModelOutput(TinyTrainer):
    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        prediction = self.model(x)
        return ModelOutput(loss=F.mse_loss(prediction, y), logits=prediction)

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        return self.validation_step(batch, batch_idx)


def csv_rows(logger: CSVLogger) -> list[dict[str, str]]:
    with open(logger.path, newline="") as f:
        return list(csv.DictReader(f))


def jsonl_series(logger: JSONLinesLogger, name: str) -> list[tuple[int, float]]:
    lines = [json.loads(line) for line in Path(logger.path).read_text().splitlines()]
    return [(line["step"], line[name]) for line in lines if name in line]


def val_loader() -> DataLoader[Any]:
    """TinyTrainer's validation samples, in its batches: for `test()`."""
    x, y = make_regression_data(24)
    return DataLoader(TensorDataset(x[16:], y[16:]), batch_size=4)


def val_mse(trainer: TinyTrainer) -> float:
    """The validation loss of the trainer's weights now: TinyTrainer's 8 validation samples, 2 batches of 4."""
    x, y = make_regression_data(24)
    with torch.no_grad():
        return float(sum(F.mse_loss(trainer.model(x[i : i + 4]), y[i : i + 4]) for i in (16, 20)) / 2)


@pytest.mark.parametrize("trainer_class", [ReturnsLossKey, ReturnsTensor, ReturnsModelOutput])
def test_a_returned_loss_is_logged_as_val_loss_exactly_as_a_returned_val_loss(tmp_path, trainer_class):
    # The documented form `{"val_loss": loss}` (TinyTrainer's) is the reference: the same run, the same file.
    reference_csv = CSVLogger()
    reference = TinyTrainer(quiet_config(tmp_path / "reference", n_epochs=2, loggers=[reference_csv]))
    reference.fit()
    logger = CSVLogger()
    trainer = trainer_class(quiet_config(tmp_path / "returns", n_epochs=2, loggers=[logger]))
    trainer.fit()
    assert csv_rows(logger) == csv_rows(reference_csv)
    validations = [(r["step"], float(r["val_loss"])) for r in csv_rows(logger) if r["val_loss"]]
    assert [step for step, _ in validations] == ["4", "8"]
    assert validations[-1][1] == pytest.approx(val_mse(trainer), rel=1e-6)
    assert not [r for r in csv_rows(logger) if r["val_loss"] and r["loss"]]  # one row per logging call
    # callback_metrics: the validation under val_loss, training's epoch mean under loss (the same as the
    # reference run's), and the last validation's results.
    assert trainer.callback_metrics == pytest.approx(reference.callback_metrics)
    assert trainer.callback_metrics["val_loss"] == pytest.approx(val_mse(trainer), rel=1e-6)
    last_epoch = trainer.train_losses[-4:]
    assert trainer.callback_metrics["loss"] == pytest.approx(float(torch.stack(last_epoch).mean()), rel=1e-6)
    assert trainer.validation_metrics == pytest.approx({"val_loss": val_mse(trainer)}, rel=1e-6)


def test_a_model_output_reaches_the_loggers_as_val_loss_and_test_loss(tmp_path):
    logger = JSONLinesLogger()
    trainer = ReturnsModelOutput(quiet_config(tmp_path, n_epochs=2, loggers=[logger]))
    trainer.fit()
    tested = trainer.test(val_loader())
    assert tested == pytest.approx({"test_loss": val_mse(trainer)}, rel=1e-6)  # logits: not a scalar
    assert trainer.callback_metrics["test_loss"] == pytest.approx(tested["test_loss"])
    # metrics.jsonl: every "loss" line is training's (the interval and epoch means at steps 4 and 8).
    training = [float(torch.stack(trainer.train_losses[i : i + 4]).mean()) for i in (0, 4)]
    losses = jsonl_series(logger, "loss")
    assert [s for s, _ in losses] == [4, 8]
    assert [v for _, v in losses] == pytest.approx([training[0], training[1]], rel=1e-6)
    assert [s for s, _ in jsonl_series(logger, "val_loss")] == [4, 8]
    assert jsonl_series(logger, "test_loss") == [(8, pytest.approx(tested["test_loss"]))]
    assert not jsonl_series(logger, "logits")


def test_test_step_returning_loss_leaves_the_training_loss_in_callback_metrics(tmp_path):
    trainer = ReturnsLossKey(quiet_config(tmp_path, n_epochs=1))
    trainer.fit()
    training_loss = trainer.callback_metrics["loss"]
    tested = trainer.test(val_loader())
    assert tested == pytest.approx({"test_loss": val_mse(trainer)}, rel=1e-6)
    assert trainer.callback_metrics["loss"] == training_loss
    assert trainer.callback_metrics["test_loss"] == tested["test_loss"]


def test_model_checkpoint_and_early_stopping_monitor_val_loss_of_a_returned_loss(tmp_path):
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path / "ckpts", monitor="val_loss", mode="min", save_top_k=1, filename="{epoch}-{val_loss:.4f}"
    )
    stopping = EarlyStopping(monitor="val_loss", mode="max", patience=2)  # the loss falls: it stops early
    logger = CSVLogger()
    trainer = ReturnsLossKey(quiet_config(tmp_path, n_epochs=6, loggers=[logger], callbacks=[checkpoint, stopping]))
    trainer.fit()
    assert trainer.global_step == 4 * 3  # epoch 0 is the best "max"; epochs 1 and 2 do not improve on it
    val_losses = [float(r["val_loss"]) for r in csv_rows(logger) if r["val_loss"]]
    assert len(val_losses) == 3 and val_losses == sorted(val_losses, reverse=True)
    assert checkpoint.best_model_score == pytest.approx(val_losses[-1])
    assert Path(checkpoint.best_model_path).name == f"epoch=2-val_loss={val_losses[-1]:.4f}.ckpt"
    assert stopping.best_score == pytest.approx(val_losses[0])


class SharedStep(TinyTrainer):
    """Training and validation share one step that returns `loss` and `acc`, as Lightning code often does."""

    def shared(self, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        prediction = self.model(x)
        return {"loss": F.mse_loss(prediction, y), "acc": ((prediction - y).abs() < 1.0).float().mean()}

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        outputs = self.shared(batch)
        self.train_losses.append(outputs["loss"].detach().clone())
        return outputs

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        return self.shared(batch)

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        return self.shared(batch)


def test_a_returned_name_training_logs_too_is_prefixed_for_the_stage(tmp_path):
    logger = JSONLinesLogger()
    trainer = SharedStep(quiet_config(tmp_path, n_epochs=2, loggers=[logger]))
    trainer.fit()
    assert set(trainer.validation_metrics) == {"val_loss", "val_acc"}
    assert {"loss", "acc", "val_loss", "val_acc"} <= set(trainer.callback_metrics)
    # "acc" holds training's values only: each epoch's interval and epoch mean, at steps 4 and 8.
    assert [s for s, _ in jsonl_series(logger, "acc")] == [4, 8]
    assert [s for s, _ in jsonl_series(logger, "val_acc")] == [4, 8]
    assert trainer.callback_metrics["acc"] == trainer.callback_metrics["acc_epoch"]
    # validate() and test() name them alike.
    assert set(trainer.validate()) == {"val_loss", "val_acc"}
    assert set(trainer.test(val_loader())) == {"test_loss", "test_acc"}


def test_validate_from_a_checkpoint_names_the_results_as_validation_during_fit_did(tmp_path):
    trainer = SharedStep(quiet_config(tmp_path, n_epochs=1))
    trainer.fit()
    path = tmp_path / "after_fit.ckpt"
    trainer.save_checkpoint(path)
    # A new trainer has run no training step: the checkpoint says which names training logs.
    fresh = SharedStep(quiet_config(tmp_path / "fresh"))
    results = fresh.validate(ckpt_path=path)
    assert results == pytest.approx(trainer.validation_metrics)
    assert set(results) == {"val_loss", "val_acc"}


class LogsAndReturns(TinyTrainer):
    """Lightning 1.x's habit: log `val_loss` weighted by its own count, and return the loss too."""

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.log("val_loss", loss * 0 + batch_idx, batch_size=1 + 9 * batch_idx)  # batches 0, 1: weights 1, 10
        return {"loss": loss, "val_loss_sum": loss * len(x)}


def test_a_name_the_step_gives_itself_keeps_its_value(tmp_path):
    trainer = LogsAndReturns(quiet_config(tmp_path, n_epochs=1))
    trainer.fit()
    # self.log's weighted mean of 0 and 1 (weights 1 and 10), not mixed with the returned loss.
    assert trainer.validation_metrics["val_loss"] == pytest.approx(10 / 11)
    assert trainer.callback_metrics["loss"] == pytest.approx(float(torch.stack(trainer.train_losses).mean()))
    assert set(trainer.validation_metrics) == {"val_loss", "val_loss_sum"}


class ReturnsBoth(TinyTrainer):
    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        return {"loss": loss, "val_loss": loss + 100.0}


def test_a_returned_val_loss_wins_over_a_returned_loss(tmp_path):
    trainer = ReturnsBoth(quiet_config(tmp_path, n_epochs=1))
    trainer.fit()
    assert trainer.validation_metrics == pytest.approx({"val_loss": val_mse(trainer) + 100.0}, rel=1e-6)
    assert trainer.callback_metrics["loss"] == pytest.approx(float(torch.stack(trainer.train_losses).mean()))


class LogsTrainingName(TinyTrainer):
    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        self.log("loss", F.mse_loss(self.model(x), y))  # explicitly: kept, and said


def test_self_log_of_a_training_name_in_validation_is_said_once(tmp_path):
    trainer = LogsTrainingName(quiet_config(tmp_path, n_epochs=3))
    with pytest.warns(
        UserWarning, match=r"^LogsTrainingName: 'loss' is logged by training and by validation_step"
    ) as seen:
        trainer.fit()
    said = [w for w in seen if "logged by training" in str(w.message)]
    assert len(said) == 1
    assert "'val_loss'" in str(said[0].message)


class ValidatesFirst(SharedStep):
    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y), "acc": self.shared(batch)["acc"]}


def test_a_name_an_evaluation_logged_before_training_logged_it_is_said(tmp_path):
    # val_at_start: the validation at step 0 runs before training logged "acc"; the epoch's end says so.
    trainer = ValidatesFirst(quiet_config(tmp_path, n_epochs=2, val_at_start=True))
    with pytest.warns(UserWarning, match=r"^ValidatesFirst: 'acc' is logged by training and by validation_step"):
        trainer.fit()
    assert set(trainer.validation_metrics) == {"val_loss", "val_acc"}  # once training logged it: prefixed


def test_a_non_scalar_tensor_is_said_with_its_shape(tmp_path):
    class ReturnsPredictions(TinyTrainer):
        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            return self.model(batch[0])

    trainer = ReturnsPredictions(quiet_config(tmp_path, n_epochs=1))
    with pytest.warns(UserWarning, match=r"returned a tensor of shape \(4, 1\), which is not a scalar"):
        trainer.fit()
    assert trainer.validation_metrics == {}


def test_several_loaders_name_a_returned_loss_per_loader(tmp_path):
    class TwoLoaders(ReturnsTensor):
        def configure_dataloaders(self) -> Any:
            train, val = super().configure_dataloaders()
            return train, [val, val]

    trainer = TwoLoaders(quiet_config(tmp_path, n_epochs=1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say
        trainer.fit()
    assert set(trainer.validation_metrics) == {"val_loss/dataloader_idx_0", "val_loss/dataloader_idx_1"}
    assert "loss" in trainer.callback_metrics
