"""validate(), test(), predict() on their own, their hooks, and the trainer protocol."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import RecordingCallback, TinyTrainer, make_regression_data, quiet_config
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import MemoryLogger, MisconfigurationError, TrainerProtocol


class EvalTrainer(TinyTrainer):
    def test_step(self, batch, batch_idx):
        x, y = batch
        return {"test_loss": F.mse_loss(self.model(x), y)}

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return self.model(x)


def _loader(n=10, batch_size=4):
    x, y = make_regression_data(n, seed=3)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def test_validate_alone_returns_weighted_metrics_and_logs_them():
    logger = MemoryLogger()
    trainer = EvalTrainer(quiet_config(loggers=[logger]))
    metrics = trainer.validate(_loader())
    x, y = make_regression_data(10, seed=3)
    with torch.no_grad():
        expected = F.mse_loss(trainer.model(x), y).item()  # batches 4, 4, 2 weighted = the full mean
    assert metrics["val_loss"] == pytest.approx(expected, rel=1e-6)
    assert logger.series("val_loss") == [(0, metrics["val_loss"])]
    assert trainer.callback_metrics["val_loss"] == metrics["val_loss"]


def test_validate_without_data_says_what_to_do():
    trainer = EvalTrainer(quiet_config(), n_val=0)
    with pytest.raises(MisconfigurationError, match="validation loader"):
        trainer.validate()


def test_test_runs_test_step_with_its_hooks_and_leaves_training_state_alone():
    rec = RecordingCallback()
    trainer = EvalTrainer(quiet_config(callbacks=[rec]))
    trainer.fit()
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    rng = torch.get_rng_state()
    step = trainer.global_step
    metrics = trainer.test(_loader())
    assert set(metrics) == {"test_loss"}
    test_hooks = [n for n in rec.names if n.startswith("on_test")]
    assert test_hooks == [
        "on_test_start",
        "on_test_epoch_start",
        *["on_test_batch_start", "on_test_batch_end"] * 3,
        "on_test_epoch_end",
        "on_test_end",
    ]
    assert trainer.model.training  # eval mode restored
    assert trainer.global_step == step
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, weights[k])


def test_predict_returns_outputs_in_order():
    rec = RecordingCallback()
    trainer = EvalTrainer(quiet_config(callbacks=[rec]))
    preds = trainer.predict(_loader(10, 4))
    assert [p.shape[0] for p in preds] == [4, 4, 2]
    assert [n for n in rec.names if n.startswith("on_")] == [
        "on_predict_start",
        "on_predict_epoch_start",
        *["on_predict_batch_start", "on_predict_batch_end"] * 3,
        "on_predict_epoch_end",
        "on_predict_end",
    ]
    x, _ = make_regression_data(10, seed=3)
    with torch.no_grad():
        assert torch.allclose(torch.cat(preds), trainer.model(x))


def test_test_and_predict_need_their_step_and_data():
    trainer = TinyTrainer(quiet_config())
    with pytest.raises(MisconfigurationError, match="test_step"):
        trainer.test(_loader())
    with pytest.raises(MisconfigurationError, match="configure_predict_dataloader"):
        EvalTrainer(quiet_config()).predict()


def test_test_uses_configure_test_dataloader():
    class WithTestData(EvalTrainer):
        def configure_test_dataloader(self):
            return _loader(6, 3)

    rec = RecordingCallback()
    WithTestData(quiet_config(callbacks=[rec])).test()
    assert rec.names.count("on_test_batch_end") == 2


def test_test_loads_a_checkpoint_first(tmp_path):
    trained = EvalTrainer(quiet_config(tmp_path, n_epochs=2))
    trained.fit()
    path = trained.save_checkpoint(tmp_path / "a.ckpt")
    expected = trained.test(_loader())
    fresh = EvalTrainer(quiet_config(tmp_path))
    assert fresh.test(_loader(), ckpt_path=path) == pytest.approx(expected)


def test_trainers_meet_the_protocol():
    assert isinstance(TinyTrainer(quiet_config()), TrainerProtocol)
    assert not isinstance(object(), TrainerProtocol)


def test_evaluating_last_with_nothing_to_load_is_an_error_not_untrained_numbers(tmp_path):
    from dream_trainer.errors import CheckpointError

    trainer = TinyTrainer(quiet_config(tmp_path))
    with pytest.raises(CheckpointError, match=r'validate\(ckpt_path="last"\): no valid checkpoint in any run under'):
        trainer.validate(ckpt_path="last")


def test_validate_without_validation_step_names_the_method(tmp_path):
    from dream_trainer import DreamTrainer
    from dream_trainer.errors import MisconfigurationError

    class NoVal(TinyTrainer):
        validation_step = DreamTrainer.validation_step

    with pytest.raises(MisconfigurationError, match=r"NoVal\.validate\(\) needs a validation_step"):
        NoVal(quiet_config(tmp_path)).validate()
    assert not any(tmp_path.iterdir())  # checked before a run directory is claimed


class SilentValidation(TinyTrainer):
    """A validation step that computes the loss and neither returns nor logs it."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        F.mse_loss(self.model(x), y)

    def test_step(self, batch, batch_idx):
        x, _ = batch
        return self.model(x)  # a tensor that is not a scalar: not a metric


class LoggedValidation(SilentValidation):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.model(x), y))


def test_a_validation_that_logs_nothing_is_said_once_at_the_users_step(tmp_path):
    # Before, nothing at all: no metric, no line, and an EarlyStopping on "val_loss" found nothing.
    trainer = SilentValidation(quiet_config(tmp_path / "a", n_epochs=2, num_sanity_val_steps=2))
    with pytest.warns(UserWarning, match=r"^SilentValidation\.validation_step returned None, and self\.log") as seen:
        trainer.fit()
        assert trainer.validate() == {}
    said = [w for w in seen if "recorded nothing" in str(w.message)]
    assert len(said) == 1  # the sanity check, two epochs and validate(): said once
    code = SilentValidation.validation_step.__code__
    assert (said[0].filename, said[0].lineno) == (code.co_filename, code.co_firstlineno)
    assert "{'val_loss': loss}" in str(said[0].message)
    with pytest.warns(
        UserWarning, match=r"^SilentValidation\.test_step returned a tensor of shape \(2, 1\), which is not a scalar"
    ):
        assert trainer.test(_loader()) == {}
    # A step that logs through self.log is not warned about.
    logged = LoggedValidation(quiet_config(tmp_path / "b", n_epochs=2, num_sanity_val_steps=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logged.fit()
    assert not [w for w in caught if "recorded nothing" in str(w.message)]
    assert "val_loss" in logged.validation_metrics
