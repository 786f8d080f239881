"""Timer: duration formats, stopping on the step / epoch interval, clock reads only where needed,
elapsed time saved in checkpoints and counted after resume."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from conftest import TinyTrainer, quiet_config

import dream_trainer.callbacks.timer as timer_module
from dream_trainer import ConfigError
from dream_trainer.callbacks.timer import Timer

STEP_SECONDS = 10.0


class FakeTime:
    """Stands in for the `time` module inside timer.py: `monotonic()` returns `now` and counts reads."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.reads = 0

    def monotonic(self) -> float:
        self.reads += 1
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(timer_module, "time", fake)
    return fake


class ClockTrainer(TinyTrainer):
    """Each training batch takes STEP_SECONDS of fake time; 4 batches per epoch (n_train=16)."""

    def __init__(self, config: Any, clock: FakeTime, **kwargs: Any) -> None:
        kwargs.setdefault("n_train", 16)
        kwargs.setdefault("n_val", 0)
        super().__init__(config, **kwargs)
        self.clock = clock

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.clock.now += STEP_SECONDS
        return super().training_step(batch, batch_idx)


def make(clock: FakeTime, timer: Timer, tmp_path: Any = None, **overrides: Any) -> ClockTrainer:
    settings: dict[str, Any] = {"n_epochs": 5, "callbacks": [timer]}
    settings.update(overrides)
    return ClockTrainer(quiet_config(tmp_path, **settings), clock)


# --- durations ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("duration", "seconds"),
    [
        (timedelta(minutes=2), 120.0),
        ({"hours": 1, "minutes": 30}, 5400.0),
        ("01:02:03:04", 93784.0),
        (45, 45.0),
        (0.5, 0.5),
        (None, None),
    ],
)
def test_duration_formats(duration, seconds):
    assert Timer(duration).duration == seconds


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"duration": "1:30"}, "DD:HH:MM:SS"),
        ({"duration": {"hrs": 1}}, r"\{'hours': 1\}"),
        ({"duration": -1}, "negative"),
        ({"duration": [1]}, "timedelta"),
        ({"interval": "batch"}, r"interval='batch'.*'step', 'epoch'"),
    ],
)
def test_invalid_arguments_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Timer(**kwargs)


# --- stopping ----------------------------------------------------------------------------------------------
def test_step_interval_stops_at_the_first_step_past_the_duration(clock, capsys):
    timer = Timer(duration=35)
    trainer = make(clock, timer)
    trainer.fit()
    assert trainer.should_stop
    assert trainer.global_step == 4  # 40 s >= 35 s
    assert timer.time_elapsed() == pytest.approx(40.0)
    assert "Time limit reached" in capsys.readouterr().out


def test_epoch_interval_only_checks_at_epoch_end(clock):
    timer = Timer(duration={"seconds": 15}, interval="epoch", verbose=False)
    trainer = make(clock, timer)
    trainer.fit()
    assert trainer.global_step == 4 and trainer.current_epoch == 1  # the whole first epoch ran


def test_no_duration_never_stops_and_reads_no_clock_per_step(clock):
    timer = Timer()
    trainer = make(clock, timer, n_epochs=2)
    trainer.fit()
    assert not trainer.should_stop and trainer.global_step == 8
    assert clock.reads <= 2  # start and end of training only
    assert timer.time_elapsed() == pytest.approx(80.0)


def test_step_interval_reads_the_clock_once_per_training_step(clock):
    timer = Timer(duration=1e9)
    trainer = make(clock, timer, n_epochs=2, gradient_accumulation_steps=2)  # 8 batches, 4 steps
    trainer.fit()
    assert trainer.global_step == 4
    assert clock.reads == 4 + 2  # one check per step (not per batch), plus start and end


def test_real_clock_with_a_tiny_duration():
    class Slow(TinyTrainer):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            time.sleep(0.003)
            return super().training_step(batch, batch_idx)

    timer = Timer(duration=0.002, verbose=False)
    trainer = Slow(quiet_config(n_epochs=3, callbacks=[timer]), n_val=0)
    trainer.fit()
    assert trainer.global_step == 1
    assert timer.time_elapsed("train") >= 0.003


# --- start / end / elapsed ---------------------------------------------------------------------------------
def test_start_end_and_elapsed_after_fit(clock):
    timer = Timer()
    assert timer.start_time() is None and timer.time_elapsed() == 0.0
    trainer = ClockTrainer(quiet_config(n_epochs=1, callbacks=[timer]), clock, n_val=4)
    trainer.fit()
    assert timer.start_time("train") == 1000.0
    assert timer.end_time("train") == 1040.0
    clock.now += 500  # after fit the elapsed time no longer grows
    assert timer.time_elapsed("train") == pytest.approx(40.0)
    assert timer.start_time("validate") is not None and timer.end_time("validate") is not None
    assert timer.time_remaining() is None
    with pytest.raises(ValueError, match="stage"):
        timer.time_elapsed("test")


def test_clock_stops_at_teardown_after_a_failure(clock):
    class Failing(ClockTrainer):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if batch_idx == 2:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    timer = Timer(duration=1000)
    trainer = Failing(quiet_config(n_epochs=1, callbacks=[timer]), clock)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit()
    clock.now += 500
    assert timer.time_elapsed() == pytest.approx(20.0)
    assert timer.time_remaining() == pytest.approx(980.0)


# --- state and resume --------------------------------------------------------------------------------------
def test_elapsed_time_is_saved_and_counted_after_resume(clock, tmp_path):
    first_timer = Timer(duration=60, verbose=False)
    first = make(clock, first_timer, tmp_path, n_epochs=1)
    first.fit()
    ckpt = first.save_checkpoint(tmp_path / "a.ckpt")
    assert first.state_dict()["callbacks"]["Timer"]["time_elapsed"]["train"] == pytest.approx(40.0)

    timer = Timer(duration=60, verbose=False)
    second = make(clock, timer, tmp_path, n_epochs=5)
    second.fit(ckpt_path=ckpt)
    assert second.global_step == 6  # 40 s before + 2 steps of 10 s reach the 60 s budget
    assert timer.time_elapsed() == pytest.approx(60.0)


def test_resuming_with_a_spent_budget_stops_before_training(clock, tmp_path):
    first = make(clock, Timer(), tmp_path, n_epochs=1)
    first.fit()
    ckpt = first.save_checkpoint(tmp_path / "a.ckpt")

    timer = Timer(duration=30, verbose=False)
    second = make(clock, timer, tmp_path, n_epochs=5)
    second.fit(ckpt_path=ckpt)
    assert second.should_stop
    assert second.global_step == 4  # nothing trained after the resume
    assert second.current_epoch == 1


def test_state_dict_round_trip():
    timer = Timer()
    timer.load_state_dict({"time_elapsed": {"train": 12.5, "validate": 1.0}})
    assert timer.time_elapsed("train") == 12.5
    assert Timer().state_dict() == {"time_elapsed": {"train": 0.0, "validate": 0.0}}
    assert timer.state_dict()["time_elapsed"]["train"] == 12.5
