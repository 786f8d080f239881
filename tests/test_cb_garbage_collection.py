"""GarbageCollection: collections on the step cadence (window ends only), the generation asked for,
and the automatic collector turned off during training and restored afterwards, also after a failure."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import TinyTrainer, quiet_config
from helpers import nothing_frozen

from dream_trainer import ConfigError
from dream_trainer.callbacks.garbage_collection import GarbageCollection


@pytest.fixture(autouse=True)
def restore_gc() -> Iterator[None]:
    """Each test starts with nothing frozen, as a user's process does (`helpers.nothing_frozen`); whatever it
    does, the worker's collector is enabled again after it."""
    was_enabled = gc.isenabled()
    with nothing_frozen():
        yield
        gc.unfreeze()
    if was_enabled:
        gc.enable()


class GcStateTrainer(TinyTrainer):
    """Records, at every training batch, whether automatic collection is on and the freeze count."""

    def __init__(self, config: Any, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.gc_states: list[tuple[bool, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.gc_states.append((gc.isenabled(), gc.get_freeze_count()))
        return super().training_step(batch, batch_idx)


def record_collections(monkeypatch: pytest.MonkeyPatch, trainer: TinyTrainer) -> list[tuple[int, int]]:
    """Replace gc.collect; returns the list of `(generation, global_step)` of each call."""
    calls: list[tuple[int, int]] = []

    def fake_collect(generation: int = 2) -> int:
        calls.append((generation, trainer.global_step))
        return 0

    monkeypatch.setattr(gc, "collect", fake_collect)
    return calls


def test_collects_every_n_steps(monkeypatch):
    trainer = TinyTrainer(quiet_config(n_epochs=3, callbacks=[GarbageCollection(every_n_steps=3)]), n_val=0)
    calls = record_collections(monkeypatch, trainer)
    trainer.fit()  # 4 steps per epoch: 12 steps
    assert calls == [(2, 3), (2, 6), (2, 9), (2, 12)]


def test_collects_the_given_generation_at_window_ends_only(monkeypatch):
    cb = GarbageCollection(every_n_steps=1, generation=0)
    trainer = TinyTrainer(quiet_config(n_epochs=2, gradient_accumulation_steps=2, callbacks=[cb]), n_val=0)
    calls = record_collections(monkeypatch, trainer)
    trainer.fit()  # 8 batches, 4 steps
    assert calls == [(0, 1), (0, 2), (0, 3), (0, 4)]


def test_every_n_steps_none_never_collects(monkeypatch):
    trainer = TinyTrainer(quiet_config(n_epochs=1, callbacks=[GarbageCollection(every_n_steps=None)]), n_val=0)
    calls = record_collections(monkeypatch, trainer)
    trainer.fit()
    assert calls == []


def test_disable_automatic_turns_gc_off_during_training_and_back_on_after():
    gc.enable()
    assert gc.get_freeze_count() == 0
    trainer = GcStateTrainer(quiet_config(n_epochs=1, callbacks=[GarbageCollection(disable_automatic=True)]), n_val=0)
    trainer.fit()
    assert len(trainer.gc_states) == 4
    assert all(not enabled and frozen > 0 for enabled, frozen in trainer.gc_states)
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_gc_is_restored_after_a_failed_fit():
    class Failing(GcStateTrainer):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            if batch_idx == 1:
                raise RuntimeError("boom")
            return out

    gc.enable()
    trainer = Failing(quiet_config(n_epochs=1, callbacks=[GarbageCollection(disable_automatic=True)]), n_val=0)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit()
    assert trainer.gc_states[-1][0] is False  # it was off while training
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_a_collector_disabled_by_the_user_stays_disabled():
    gc.disable()
    trainer = GcStateTrainer(quiet_config(n_epochs=1, callbacks=[GarbageCollection(disable_automatic=True)]), n_val=0)
    trainer.fit()
    assert not gc.isenabled()


def test_without_disable_automatic_the_collector_is_untouched():
    gc.enable()
    trainer = GcStateTrainer(quiet_config(n_epochs=1, callbacks=[GarbageCollection()]), n_val=0)
    trainer.fit()
    assert all(enabled and frozen == 0 for enabled, frozen in trainer.gc_states)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_n_steps": 0}, r"every_n_steps=0"),
        ({"every_n_steps": 2.5}, r"every_n_steps=2.5"),
        ({"generation": 3}, r"generation=3.*0, 1, 2"),
    ],
)
def test_invalid_arguments_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        GarbageCollection(**kwargs)
