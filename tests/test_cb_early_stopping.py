"""EarlyStopping: patience, min_delta, modes, thresholds, non-finite values, strictness, when it checks,
state round-trip and resume, and that training really stops."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from conftest import TinyTrainer, quiet_config

from dream_trainer import ConfigError, MisconfigurationError
from dream_trainer.callbacks.early_stopping import EarlyStopping

STEPS_PER_EPOCH = 2  # n_train=8, batch_size=4


class ScriptedTrainer(TinyTrainer):
    """Validation reports `script[i]` as `val_loss` on its i-th real run (NaN during the sanity check)."""

    def __init__(self, config: Any, script: list[float], **kwargs: Any) -> None:
        super().__init__(config, n_train=8, n_val=4, batch_size=4, **kwargs)
        self.script = script
        self.val_runs = 0

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        if self.sanity_checking:
            return {"val_loss": torch.tensor(float("nan"))}
        value = self.script[self.val_runs]
        self.val_runs += 1
        return {"val_loss": torch.tensor(value)}


def fit(script: list[float], es: EarlyStopping, n_epochs: int = 10, **overrides: Any) -> ScriptedTrainer:
    trainer = ScriptedTrainer(quiet_config(callbacks=[es], n_epochs=n_epochs, **overrides), script)
    trainer.fit()
    return trainer


def assert_stopped_at(trainer: ScriptedTrainer, es: EarlyStopping, epoch: int) -> None:
    assert trainer.should_stop
    assert es.stopped_epoch == epoch
    assert es.stop_reason
    # training really ended there: no further epoch, no further step, no further validation
    assert trainer.current_epoch == epoch + 1
    assert trainer.global_step == (epoch + 1) * STEPS_PER_EPOCH
    assert trainer.val_runs == epoch + 1


# --- stopping rules ----------------------------------------------------------------------------------------
def test_stops_after_patience_checks_without_improvement():
    es = EarlyStopping(patience=2)
    trainer = fit([5.0, 4.0, 4.5, 4.2, 3.0, 2.0], es)
    assert_stopped_at(trainer, es, 3)  # best 4.0 at epoch 1; epochs 2 and 3 do not improve
    assert es.best_score == pytest.approx(4.0)
    assert es.wait_count == 2
    assert "did not improve" in es.stop_reason


def test_an_improvement_resets_the_patience_count():
    es = EarlyStopping(patience=2)
    trainer = fit([5.0, 5.1, 4.0, 4.1, 3.0, 3.1, 3.2], es)
    assert_stopped_at(trainer, es, 6)
    assert es.best_score == pytest.approx(3.0)


@pytest.mark.parametrize(("min_delta", "stop_epoch"), [(0.2, 2), (0.0, None)])
def test_min_delta_ignores_small_improvements(min_delta, stop_epoch):
    es = EarlyStopping(patience=2, min_delta=min_delta)
    trainer = fit([5.0, 4.9, 4.85, 4.8], es, n_epochs=4)
    if stop_epoch is None:  # every step down counts: it trains to the end
        assert not trainer.should_stop and trainer.current_epoch == 4
        assert es.best_score == pytest.approx(4.8)
    else:
        assert_stopped_at(trainer, es, stop_epoch)
        assert es.best_score == pytest.approx(5.0)


def test_mode_max_treats_higher_as_better():
    script = [0.1, 0.5, 0.4, 0.45, 0.3]
    es_max = EarlyStopping(patience=2, mode="max")
    assert_stopped_at(fit(script, es_max), es_max, 3)
    assert es_max.best_score == pytest.approx(0.5)
    es_min = EarlyStopping(patience=2, mode="min")  # same values: now only the first is best
    assert_stopped_at(fit(script, es_min), es_min, 2)


def test_stopping_threshold_stops_once_the_goal_is_reached():
    es = EarlyStopping(patience=100, stopping_threshold=2.0)
    trainer = fit([5.0, 3.0, 1.5, 1.0, 0.5], es)
    assert_stopped_at(trainer, es, 2)
    assert "Stopping threshold" in es.stop_reason


def test_divergence_threshold_stops_a_diverging_run():
    es = EarlyStopping(patience=100, divergence_threshold=10.0, mode="min")
    trainer = fit([5.0, 4.0, 12.0, 1.0], es)
    assert_stopped_at(trainer, es, 2)
    assert "Divergence" in es.stop_reason


@pytest.mark.parametrize("check_finite", [True, False])
def test_check_finite_stops_on_nan(check_finite):
    es = EarlyStopping(patience=100, check_finite=check_finite)
    trainer = fit([5.0, float("nan"), 4.0, 3.0], es, n_epochs=4)
    if check_finite:
        assert_stopped_at(trainer, es, 1)
        assert "not finite" in es.stop_reason
    else:
        assert not trainer.should_stop and trainer.current_epoch == 4
        assert es.best_score == pytest.approx(3.0)


# --- configuration and strictness --------------------------------------------------------------------------
def test_strict_missing_monitor_names_available_metrics():
    with pytest.raises(MisconfigurationError, match=r"val_acc.*val_loss"):
        fit([5.0, 4.0], EarlyStopping(monitor="val_acc"))


def test_non_strict_missing_monitor_is_skipped():
    es = EarlyStopping(monitor="val_acc", strict=False, patience=0)
    trainer = fit([5.0, 4.0, 3.0], es, n_epochs=3)
    assert not trainer.should_stop and trainer.current_epoch == 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "maximum"}, r"mode='maximum'.*'min', 'max'"),
        ({"patience": -1}, r"patience=-1"),
        ({"min_delta": "0.1"}, r"min_delta='0.1'"),
        ({"stopping_threshold": "low"}, r"stopping_threshold='low'"),
    ],
)
def test_invalid_arguments_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EarlyStopping(**kwargs)


# --- when the check happens --------------------------------------------------------------------------------
def test_sanity_check_values_are_ignored():
    es = EarlyStopping(patience=1)  # the sanity run reports NaN, which would stop a real check
    trainer = fit([5.0, 4.0, 3.0], es, n_epochs=3, num_sanity_val_steps=1)
    assert not trainer.should_stop and trainer.current_epoch == 3


def test_mid_epoch_validation_stops_the_epoch_early():
    es = EarlyStopping(patience=1)
    trainer = ScriptedTrainer(
        quiet_config(callbacks=[es], n_epochs=5, val_every_n_steps=1, val_every_n_epochs=None),
        [5.0, 4.0, 4.5, 3.0, 2.0, 1.0],
    )
    trainer.n_train = 16  # 4 steps per epoch; validation after every step
    trainer.fit()
    assert trainer.should_stop
    assert trainer.global_step == 3  # the third validation did not improve: no fourth step
    assert trainer.val_runs == 3
    assert es.stopped_epoch == 0


class NoValTrainer(TinyTrainer):
    """No validation loader; training reports `score = script[current_epoch]`."""

    def __init__(self, config: Any, script: list[float]) -> None:
        super().__init__(config, n_train=8, n_val=0, batch_size=4)
        self.script = script

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        out = super().training_step(batch, batch_idx)
        out["score"] = torch.tensor(self.script[self.current_epoch])
        return out


def test_without_validation_it_checks_at_train_epoch_end():
    es = EarlyStopping(monitor="score", patience=1)
    trainer = NoValTrainer(quiet_config(callbacks=[es], n_epochs=10), [3.0, 2.0, 2.5, 1.0])
    trainer.fit()
    assert trainer.should_stop and es.stopped_epoch == 2
    assert trainer.current_epoch == 3 and trainer.global_step == 3 * STEPS_PER_EPOCH


def test_check_on_train_epoch_end_checks_once_per_epoch():
    es = EarlyStopping(patience=1, check_on_train_epoch_end=True)
    checks: list[int] = []
    original = es.check

    def counting(trainer):
        checks.append(trainer.current_epoch)
        return original(trainer)

    es.check = counting  # type: ignore[method-assign]
    trainer = ScriptedTrainer(
        quiet_config(callbacks=[es], n_epochs=3, val_every_n_steps=1, val_every_n_epochs=None),
        [9.0, 8.0, 7.0, 6.0, 5.0, 4.0],
    )
    trainer.fit()
    assert checks == [0, 1, 2]  # not after each of the six validation runs
    assert es.best_score == pytest.approx(4.0)  # the latest validation value at each epoch end


# --- state -------------------------------------------------------------------------------------------------
def test_state_dict_round_trips():
    es = EarlyStopping(patience=5)
    fit([5.0, 4.0, 4.5, 4.6], es, n_epochs=4)
    state = es.state_dict()
    assert state == {"wait_count": 2, "best_score": pytest.approx(4.0), "stopped_epoch": 0}
    other = EarlyStopping(patience=5)
    other.load_state_dict(state)
    assert (other.wait_count, other.best_score, other.stopped_epoch) == (2, pytest.approx(4.0), 0)


def test_resumed_run_keeps_counting_patience(tmp_path):
    es = EarlyStopping(patience=3)
    first = ScriptedTrainer(quiet_config(tmp_path, callbacks=[es], n_epochs=3), [5.0, 4.0, 4.5])
    first.fit()
    ckpt = first.save_checkpoint(tmp_path / "a.ckpt")
    assert es.state_key in first.state_dict()["callbacks"]

    resumed_es = EarlyStopping(patience=3)
    second = ScriptedTrainer(quiet_config(tmp_path, callbacks=[resumed_es], n_epochs=10), [4.4, 4.3, 1.0])
    second.fit(ckpt_path=ckpt)
    # one miss before the checkpoint + two after = patience 3: stops at epoch 4 (epochs 3 and 4 ran)
    assert resumed_es.stopped_epoch == 4
    assert resumed_es.best_score == pytest.approx(4.0)
    assert second.current_epoch == 5 and second.val_runs == 2
    assert math.isclose(es.best_score, 4.0, rel_tol=1e-6)
