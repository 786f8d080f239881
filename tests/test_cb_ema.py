"""EMA callback: the average itself, its cadence, validation with EMA weights, and exact resume."""

from __future__ import annotations

import io

import pytest
import torch
from conftest import TinyTrainer, quiet_config
from torch import nn

from dream_trainer import Callback, ConfigError, MisconfigurationError, ModelCheckpoint
from dream_trainer.callbacks.ema import EMA


class RecordingTrainer(TinyTrainer):
    """Records the live weights after every training step (its hook fires after the callbacks'), and
    what `validation_step` sees."""

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.step_weights: list[dict[str, torch.Tensor]] = []
        self.val_weights: list[torch.Tensor] = []

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.loop.step_ended:
            self.step_weights.append({k: v.detach().clone() for k, v in self.model.state_dict().items()})

    def validation_step(self, batch, batch_idx):
        self.val_weights.append(self.model.weight.detach().clone())
        return super().validation_step(batch, batch_idx)


def reference_ema(weights: list[dict[str, torch.Tensor]], decay: float) -> dict[str, torch.Tensor]:
    """The textbook EMA: starts at the first averaged weights, then `decay * ema + (1 - decay) * w`."""
    ema = {k: v.clone() for k, v in weights[0].items()}
    for w in weights[1:]:
        ema = {k: decay * ema[k] + (1 - decay) * w[k] for k in ema}
    return ema


def fit(tmp_path, cb, n_epochs=2, cls=RecordingTrainer, **cfg):
    trainer = cls(quiet_config(tmp_path, n_epochs=n_epochs, callbacks=[cb], **cfg))
    trainer.fit()
    return trainer


def test_average_matches_a_hand_computed_ema_and_differs_from_the_live_weights(tmp_path):
    cb = EMA(decay=0.7)
    trainer = fit(tmp_path, cb, n_epochs=2)  # 8 steps
    assert len(trainer.step_weights) == 8 and cb.num_updates == 8
    expected = reference_ema(trainer.step_weights, 0.7)
    ema = cb.ema_state_dict()["model"]
    assert set(ema) == {"weight", "bias"}
    for k in expected:
        torch.testing.assert_close(ema[k], expected[k])
        assert not torch.allclose(ema[k], trainer.model.state_dict()[k], atol=1e-4)
    # ema_model() is a separate module of the user's class, holding the same weights, without grads
    ema_model = cb.ema_model("model")
    assert isinstance(ema_model, nn.Linear) and ema_model is not trainer.model
    assert cb.ema_model() is ema_model
    assert torch.equal(ema_model.weight, ema["weight"])
    assert not ema_model.weight.requires_grad


def test_update_cadence_and_start_step(tmp_path):
    cb = EMA(decay=0.5, update_every_n_steps=2, start_step=3)
    trainer = fit(tmp_path, cb, n_epochs=2)  # steps 1..8: updates after steps 4, 6, 8
    assert cb.num_updates == 3
    w = trainer.step_weights
    expected = reference_ema([w[3], w[5], w[7]], 0.5)
    torch.testing.assert_close(cb.ema_state_dict()["model"]["weight"], expected["weight"])


def test_accumulation_updates_once_per_optimizer_step(tmp_path):
    cb = EMA(decay=0.5)
    trainer = fit(tmp_path, cb, n_epochs=2, gradient_accumulation_steps=2)  # 8 batches -> 4 steps
    assert trainer.global_step == 4 and cb.num_updates == 4
    torch.testing.assert_close(
        cb.ema_state_dict()["model"]["weight"], reference_ema(trainer.step_weights, 0.5)["weight"]
    )


class LiveWeightsAroundValidation(Callback):
    """Listed before EMA: sees the training weights at on_validation_start (before the swap)."""

    def __init__(self):
        self.before: list[torch.Tensor] = []

    def on_validation_start(self, trainer):
        self.before.append(trainer.model.weight.detach().clone())


class AfterValidation(TinyTrainer):
    def __init__(self, config, ema: EMA | None = None):
        super().__init__(config)
        self.ema = ema
        self.val_weights: list[torch.Tensor] = []
        self.after: list[torch.Tensor] = []
        self.ema_after: list[torch.Tensor] = []

    def validation_step(self, batch, batch_idx):
        self.val_weights.append(self.model.weight.detach().clone())
        return super().validation_step(batch, batch_idx)

    def on_validation_end(self):  # the trainer's hook fires after the callbacks': EMA has restored
        self.after.append(self.model.weight.detach().clone())
        if self.ema is not None:
            self.ema_after.append(self.ema.ema_model().weight.detach().clone())


def test_validation_sees_ema_weights_and_training_weights_come_back_exactly(tmp_path):
    spy, cb = LiveWeightsAroundValidation(), EMA(decay=0.6)
    trainer = AfterValidation(quiet_config(tmp_path, n_epochs=2, val_every_n_steps=2, callbacks=[spy, cb]), ema=cb)
    trainer.fit()
    # validation after steps 2, 4, 6, 8 (2 batches each); the epoch-end validations coincide
    assert len(spy.before) == 4 and len(trainer.val_weights) == 8
    for i in range(4):
        for seen in trainer.val_weights[2 * i : 2 * i + 2]:
            assert torch.equal(seen, trainer.ema_after[i])  # validation_step ran with the EMA weights
            assert not torch.equal(seen, spy.before[i])
        assert torch.equal(trainer.after[i], spy.before[i])  # bit-exact restore

    # and the training trajectory is exactly the one of a run without EMA
    plain = AfterValidation(quiet_config(tmp_path / "plain", n_epochs=2, val_every_n_steps=2))
    plain.fit()
    assert torch.equal(plain.model.weight, trainer.model.weight)
    assert torch.equal(plain.model.bias, trainer.model.bias)
    assert [float(x) for x in plain.train_losses] == [float(x) for x in trainer.train_losses]


def test_no_swap_when_disabled(tmp_path):
    cb = EMA(decay=0.6, swap_for_validation=False)
    trainer = fit(tmp_path, cb, n_epochs=1)
    live_after = trainer.step_weights[-1]["weight"]
    assert len(trainer.val_weights) == 2
    assert all(torch.equal(w, live_after) for w in trainer.val_weights)
    assert not torch.equal(cb.ema_model().weight, live_after)


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_resume_continues_the_average_exactly(tmp_path):
    straight_cb = EMA(decay=0.8)
    fit(tmp_path / "straight", straight_cb, n_epochs=2)

    first_cb = EMA(decay=0.8)
    first = fit(tmp_path / "run", first_cb, n_epochs=1)
    state = _roundtrip(first.state_dict())
    assert state["callbacks"]["EMA"]["num_updates"] == 4

    resumed_cb = EMA(decay=0.8)
    resumed = RecordingTrainer(quiet_config(tmp_path / "run", n_epochs=2, callbacks=[resumed_cb]))
    resumed.load_state_dict(state)
    assert torch.equal(resumed_cb.ema_model().weight, first_cb.ema_model().weight)
    resumed.fit()
    assert resumed.global_step == 8 and resumed_cb.num_updates == 8
    for k, v in straight_cb.ema_state_dict()["model"].items():
        assert torch.equal(resumed_cb.ema_state_dict()["model"][k], v)


def test_checkpoint_written_by_an_earlier_callback_holds_this_steps_update(tmp_path):
    # ModelCheckpoint is listed first: its on_train_batch_end saves before EMA's hook would update.
    ckpt = ModelCheckpoint(every_n_train_steps=4, save_top_k=-1)
    cb = EMA(decay=0.8)
    trainer = RecordingTrainer(quiet_config(tmp_path, n_epochs=1, callbacks=[ckpt, cb]))
    trainer.fit()
    saved = torch.load(ckpt.last_model_path, weights_only=True)["callbacks"]["EMA"]
    assert saved["num_updates"] == 4
    torch.testing.assert_close(saved["models"]["model"]["weight"], reference_ema(trainer.step_weights, 0.8)["weight"])
    assert cb.num_updates == 4  # and the hook did not update a second time


def test_state_saved_during_validation_keeps_training_and_ema_weights_apart(tmp_path):
    saved: list[dict] = []

    class SaveInValidation(Callback):
        def on_validation_epoch_end(self, trainer):
            saved.append(_roundtrip(trainer.state_dict()))

    cb = EMA(decay=0.8)
    trainer = RecordingTrainer(quiet_config(tmp_path, n_epochs=1, callbacks=[cb, SaveInValidation()]))
    trainer.fit()
    (state,) = saved
    assert torch.equal(state["models"]["model"]["weight"], trainer.step_weights[-1]["weight"])
    assert torch.equal(state["callbacks"]["EMA"]["models"]["model"]["weight"], cb.ema_model().weight)
    assert not torch.equal(trainer.model.weight, cb.ema_model().weight)


class TwoModels(TinyTrainer):
    def __init__(self, config):
        super().__init__(config)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def test_model_selection_and_arguments(tmp_path):
    cb = EMA()
    trainer = TwoModels(quiet_config(tmp_path, n_epochs=1, callbacks=[cb]))
    trainer.fit()
    assert cb.names == ["model"]  # models without trainable parameters are not averaged
    cb2 = EMA(models="frozen")
    TwoModels(quiet_config(tmp_path, n_epochs=1, callbacks=[cb2])).fit()
    assert cb2.names == ["frozen"]
    with pytest.raises(MisconfigurationError, match=r"no model named \['nope'\].*\['frozen', 'model'\]"):
        TwoModels(quiet_config(tmp_path, n_epochs=1, callbacks=[EMA(models=["nope"])])).fit()
    with pytest.raises(KeyError, match="averaged"):
        cb.ema_model("frozen")
    with pytest.raises(RuntimeError, match="fit"):
        EMA().ema_model()
    for kwargs, arg in [
        ({"decay": 1.5}, "decay"),
        ({"update_every_n_steps": 0}, "update_every_n_steps"),
        ({"start_step": -1}, "start_step"),
        ({"models": [3]}, "models"),
        ({"device": "gpu"}, "device"),
    ]:
        with pytest.raises(ConfigError, match=f"EMA\\({arg}="):
            EMA(**kwargs)


def test_training_weights_come_back_when_validation_raises(tmp_path):
    class FailingValidation(RecordingTrainer):
        def validation_step(self, batch, batch_idx):
            raise ValueError("boom")

    cb = EMA(decay=0.6)
    trainer = FailingValidation(quiet_config(tmp_path, n_epochs=1, callbacks=[cb]))
    with pytest.raises(ValueError, match="boom"):
        trainer.fit()
    assert torch.equal(trainer.model.weight, trainer.step_weights[-1]["weight"])
    torch.testing.assert_close(cb.ema_model().weight, reference_ema(trainer.step_weights, 0.6)["weight"])


class BatchNormTrainer(RecordingTrainer):
    def __init__(self, config):
        super().__init__(config)
        self.model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return {"val_loss": torch.nn.functional.mse_loss(self.model(x), y)}


def test_float_buffers_are_averaged_and_counters_copied(tmp_path):
    cb = EMA(decay=0.5)
    trainer = fit(tmp_path, cb, n_epochs=1, cls=BatchNormTrainer)
    ema, expected = cb.ema_state_dict()["model"], reference_ema(trainer.step_weights, 0.5)
    torch.testing.assert_close(ema["1.running_mean"], expected["1.running_mean"])
    torch.testing.assert_close(ema["0.weight"], expected["0.weight"])
    assert int(ema["1.num_batches_tracked"]) == 4  # the live count, not an average of counts


def test_a_callback_reused_by_a_second_trainer_averages_that_run_only(tmp_path):
    cb = EMA(decay=0.5)
    first = fit(tmp_path / "a", cb, n_epochs=2)  # 8 steps
    second = fit(tmp_path / "b", cb, n_epochs=1)  # 4 steps, a new run: a new average
    assert cb.num_updates == 4
    expected = reference_ema(second.step_weights, 0.5)
    torch.testing.assert_close(cb.ema_state_dict()["model"]["weight"], expected["weight"])
    assert not torch.allclose(expected["weight"], reference_ema(first.step_weights, 0.5)["weight"])
