"""Callbacks: Lightning's hook names and order, trainer-defined hooks, typo detection, failures,
the zero-cost bus, `should_stop`, and stateful callbacks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import RecordingCallback, TinyTrainer, quiet_config

from dream_trainer import Callback, CallbackHookError, DreamTrainerConfig, MemoryLogger
from dream_trainer.callbacks import HOOKS

TRAIN_BATCH = [
    "on_train_batch_start",
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
]
VALIDATION_ONE_BATCH = [
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_validation_epoch_end",
    "on_validation_end",
]


def _two_epoch_trainer(*callbacks: Callback, trainer_cls: type[TinyTrainer] = TinyTrainer, **overrides: Any):
    """2 epochs x 2 train batches, 1 val batch, sanity check of 1 batch, validation every epoch."""
    settings: dict[str, Any] = {"num_sanity_val_steps": 1, "n_epochs": 2, "val_every_n_epochs": 1}
    settings.update(overrides)
    return trainer_cls(quiet_config(callbacks=list(callbacks), **settings), n_train=8, n_val=4, batch_size=4)


# --- (1) the hook order ----------------------------------------------------------------------------------
def test_recording_callback_overrides_every_hook():
    for hook in HOOKS:
        assert getattr(RecordingCallback, hook) is not getattr(Callback, hook), hook


def test_full_hook_order_of_a_fit():
    rec = RecordingCallback()
    trainer = _two_epoch_trainer(rec)
    trainer.fit()

    expected = [
        "setup",
        "on_fit_start",
        "on_sanity_check_start",
        "on_validation_start",
        "on_validation_epoch_start",
        "on_validation_batch_start",
        "on_validation_batch_end",
        "on_validation_epoch_end",
        "on_validation_end",
        "on_sanity_check_end",
        "on_train_start",
        # epoch 1
        "on_train_epoch_start",
        "on_train_batch_start",
        "on_before_zero_grad",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_train_batch_end",
        "on_train_batch_start",
        "on_before_zero_grad",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_train_batch_end",
        "on_validation_start",
        "on_validation_epoch_start",
        "on_validation_batch_start",
        "on_validation_batch_end",
        "on_validation_epoch_end",
        "on_validation_end",
        "on_train_epoch_end",
        # epoch 2
        "on_train_epoch_start",
        "on_train_batch_start",
        "on_before_zero_grad",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_train_batch_end",
        "on_train_batch_start",
        "on_before_zero_grad",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_train_batch_end",
        "on_validation_start",
        "on_validation_epoch_start",
        "on_validation_batch_start",
        "on_validation_batch_end",
        "on_validation_epoch_end",
        "on_validation_end",
        "on_train_epoch_end",
        "on_train_end",
        "on_fit_end",
        "teardown",
    ]
    assert rec.names == expected
    # The same thing, built from the pieces (guards the literal list against typos).
    epoch = ["on_train_epoch_start", *TRAIN_BATCH, *TRAIN_BATCH, *VALIDATION_ONE_BATCH, "on_train_epoch_end"]
    assert expected == [
        "setup",
        "on_fit_start",
        "on_sanity_check_start",
        *VALIDATION_ONE_BATCH,
        "on_sanity_check_end",
        "on_train_start",
        *epoch,
        *epoch,
        "on_train_end",
        "on_fit_end",
        "teardown",
    ]
    assert trainer.global_step == 4
    assert trainer.current_epoch == 2


def test_no_sanity_hooks_when_sanity_check_is_off():
    rec = RecordingCallback()
    trainer = _two_epoch_trainer(rec, num_sanity_val_steps=0)
    trainer.fit()
    assert "on_sanity_check_start" not in rec.names
    assert rec.names[:3] == ["setup", "on_fit_start", "on_train_start"]
    assert rec.names.count("on_validation_start") == 2


def test_hook_arguments():
    seen: dict[str, list[Any]] = {}

    class Args(Callback):
        def _add(self, hook, trainer, *args):
            assert isinstance(trainer, TinyTrainer)
            seen.setdefault(hook, []).append(args)

        def setup(self, trainer, stage):
            self._add("setup", trainer, stage)

        def teardown(self, trainer, stage):
            self._add("teardown", trainer, stage)

        def on_train_batch_start(self, trainer, batch, batch_idx):
            self._add("on_train_batch_start", trainer, batch, batch_idx)

        def on_before_zero_grad(self, trainer, optimizer):
            self._add("on_before_zero_grad", trainer, optimizer)

        def on_before_backward(self, trainer, loss):
            self._add("on_before_backward", trainer, loss)

        def on_before_optimizer_step(self, trainer, optimizer):
            self._add("on_before_optimizer_step", trainer, optimizer)

        def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
            self._add("on_train_batch_end", trainer, outputs, batch, batch_idx)

        def on_validation_batch_start(self, trainer, batch, batch_idx):
            self._add("on_validation_batch_start", trainer, batch, batch_idx, trainer.sanity_checking)

        def on_validation_batch_end(self, trainer, outputs, batch, batch_idx):
            self._add("on_validation_batch_end", trainer, outputs, batch, batch_idx)

    trainer = _two_epoch_trainer(Args())
    trainer.fit()

    assert seen["setup"] == [("fit",)]
    assert seen["teardown"] == [("fit",)]
    assert [a[1] for a in seen["on_train_batch_start"]] == [0, 1, 0, 1]
    assert [a[2] for a in seen["on_train_batch_end"]] == [0, 1, 0, 1]
    for (batch, _), (outputs, batch_end, _) in zip(
        seen["on_train_batch_start"], seen["on_train_batch_end"], strict=True
    ):
        assert batch is batch_end
        x, y = batch
        assert x.shape == (4, 4) and y.shape == (4, 1)
        assert isinstance(outputs, dict) and set(outputs) == {"loss"}
    assert all(opt is trainer.optimizer for (opt,) in seen["on_before_zero_grad"])
    assert all(opt is trainer.optimizer for (opt,) in seen["on_before_optimizer_step"])
    assert len(seen["on_before_optimizer_step"]) == 4
    # on_before_backward gets the loss training_step returned (unscaled), in order.
    losses = [loss for (loss,) in seen["on_before_backward"]]
    assert len(losses) == 4
    for loss, recorded in zip(losses, trainer.train_losses, strict=True):
        assert torch.equal(loss.detach(), recorded)
    # Sanity batch first (sanity_checking True), then one batch per epoch.
    assert [(a[1], a[2]) for a in seen["on_validation_batch_start"]] == [(0, True), (0, False), (0, False)]
    assert all(set(a[0]) == {"val_loss"} for a in seen["on_validation_batch_end"])


# --- (2) trainer-defined hooks -----------------------------------------------------------------------------
def test_trainer_hooks_fire_after_callback_hooks():
    log: list[str] = []

    class First(Callback):
        def on_fit_start(self, trainer):
            log.append("first:on_fit_start")

        def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
            log.append(f"first:on_train_batch_end:{batch_idx}")

        def on_train_epoch_end(self, trainer):
            log.append("first:on_train_epoch_end")

        def teardown(self, trainer, stage):
            log.append("first:teardown")

    class Second(Callback):
        def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
            log.append(f"second:on_train_batch_end:{batch_idx}")

    class HookedTrainer(TinyTrainer):
        def on_fit_start(self):
            log.append("trainer:on_fit_start")

        def on_train_batch_end(self, outputs, batch, batch_idx):
            assert set(outputs) == {"loss"}
            log.append(f"trainer:on_train_batch_end:{batch_idx}")

        def on_train_epoch_end(self):
            log.append("trainer:on_train_epoch_end")

        def teardown(self, stage):
            log.append(f"trainer:teardown:{stage}")

    trainer = _two_epoch_trainer(First(), Second(), trainer_cls=HookedTrainer, n_epochs=1)
    trainer.fit()
    assert log == [
        "first:on_fit_start",
        "trainer:on_fit_start",
        "first:on_train_batch_end:0",
        "second:on_train_batch_end:0",
        "trainer:on_train_batch_end:0",
        "first:on_train_batch_end:1",
        "second:on_train_batch_end:1",
        "trainer:on_train_batch_end:1",
        "first:on_train_epoch_end",
        "trainer:on_train_epoch_end",
        "first:teardown",
        "trainer:teardown:fit",
    ]


def test_callback_appended_to_trainer_is_dispatched_after_config_callbacks():
    log: list[str] = []

    class Named(Callback):
        def __init__(self, name):
            self.name = name

        def on_train_start(self, trainer):
            log.append(self.name)

    trainer = _two_epoch_trainer(Named("config"), n_epochs=1)
    trainer.callbacks.append(Named("appended"))
    trainer.fit()
    assert log == ["config", "appended"]


# --- (3) misspelled hooks ------------------------------------------------------------------------------------
class TypoCallback(Callback):
    def on_train_batch_ends(self, trainer, outputs, batch, batch_idx):
        pass


def test_typo_in_callback_fails_in_config():
    with pytest.raises(CallbackHookError) as info:
        DreamTrainerConfig(callbacks=[TypoCallback()])
    message = str(info.value)
    assert "on_train_batch_ends" in message
    assert "`on_train_batch_end`" in message
    assert "TypoCallback" in message


def test_typo_in_callback_fails_on_append():
    trainer = TinyTrainer(quiet_config())
    with pytest.raises(CallbackHookError) as info:
        trainer.callbacks.append(TypoCallback())
    assert "on_train_batch_ends" in str(info.value)
    assert "`on_train_batch_end`" in str(info.value)
    assert len(trainer.callbacks) == 0


def test_typo_in_callback_fails_on_extend_insert_and_setitem():
    trainer = TinyTrainer(quiet_config(callbacks=[RecordingCallback()]))
    with pytest.raises(CallbackHookError):
        trainer.callbacks.extend([TypoCallback()])
    with pytest.raises(CallbackHookError):
        trainer.callbacks.insert(0, TypoCallback())
    with pytest.raises(CallbackHookError):
        trainer.callbacks[0] = TypoCallback()
    with pytest.raises(CallbackHookError):
        trainer.callbacks += [TypoCallback()]
    assert [type(cb) for cb in trainer.callbacks] == [RecordingCallback]


def test_typo_inherited_from_a_base_callback_is_found():
    class Child(TypoCallback):
        def on_train_start(self, trainer):
            pass

    with pytest.raises(CallbackHookError, match="on_train_batch_ends"):
        DreamTrainerConfig(callbacks=[Child()])


def test_helpers_not_named_like_hooks_are_fine():
    class Helper(Callback):
        def compute_something(self):
            return 1

        def on_train_start(self, trainer):
            pass

    DreamTrainerConfig(callbacks=[Helper()])


def test_typo_on_trainer_subclass_fails_at_fit_start():
    ran: list[str] = []

    class TypoTrainer(TinyTrainer):
        def on_validation_epoch_ends(self):
            pass

        def configure_optimizers(self):
            ran.append("configure_optimizers")
            super().configure_optimizers()

    class Setup(Callback):
        def setup(self, trainer, stage):
            ran.append("setup")

    trainer = TypoTrainer(quiet_config(callbacks=[Setup()]))  # constructing is fine
    with pytest.raises(CallbackHookError) as info:
        trainer.fit()
    assert "on_validation_epoch_ends" in str(info.value)
    assert "`on_validation_epoch_end`" in str(info.value)
    assert ran == []  # failed before any setup work
    assert trainer.global_step == 0


# --- (4) exceptions -------------------------------------------------------------------------------------------
class Boom(Exception):
    pass


class FailingTrainer(TinyTrainer):
    """Raises `self.error` in `training_step` at global_step 1."""

    def __init__(self, config):
        super().__init__(config)
        self.error = Boom("training_step failed")

    def training_step(self, batch, batch_idx):
        if self.global_step == 1:
            raise self.error
        return super().training_step(batch, batch_idx)


def test_exception_fires_on_exception_then_teardown_then_propagates_unchanged():
    seen: list[BaseException] = []

    class Catch(Callback):
        def on_exception(self, trainer, exception):
            seen.append(exception)

    rec = RecordingCallback()
    logger = MemoryLogger()
    trainer = FailingTrainer(quiet_config(n_epochs=2, callbacks=[Catch(), rec], loggers=[logger]))
    with pytest.raises(Boom) as info:
        trainer.fit()
    assert info.value is trainer.error
    assert seen == [trainer.error] and seen[0] is trainer.error
    assert rec.calls[-2] == ("on_exception", (trainer.error,))
    assert rec.names[-1] == "teardown"
    assert "on_train_end" not in rec.names and "on_fit_end" not in rec.names
    assert rec.names.count("on_train_batch_end") == 1
    assert logger.status == "failed"


def test_failing_on_exception_and_teardown_hooks_do_not_hide_the_original(capsys):
    calls: list[str] = []

    class BadOnException(Callback):
        def on_exception(self, trainer, exception):
            calls.append("bad.on_exception")
            raise RuntimeError("on_exception broke")

        def teardown(self, trainer, stage):
            calls.append("bad.teardown")
            raise RuntimeError("teardown broke")

    class Good(Callback):
        def on_exception(self, trainer, exception):
            calls.append("good.on_exception")

        def teardown(self, trainer, stage):
            calls.append("good.teardown")

    trainer = FailingTrainer(quiet_config(n_epochs=2, callbacks=[BadOnException(), Good()]))
    with pytest.raises(Boom) as info:
        trainer.fit()
    assert info.value is trainer.error
    assert calls == ["bad.on_exception", "good.on_exception", "bad.teardown", "good.teardown"]


def test_exception_in_trainer_on_exception_hook_does_not_hide_the_original():
    class T(FailingTrainer):
        def on_exception(self, exception):
            raise ValueError("hook broke")

    trainer = T(quiet_config(n_epochs=2))
    with pytest.raises(Boom) as info:
        trainer.fit()
    assert info.value is trainer.error


def test_successful_fit_does_not_fire_on_exception():
    rec = RecordingCallback()
    logger = MemoryLogger()
    TinyTrainer(quiet_config(callbacks=[rec], loggers=[logger])).fit()
    assert "on_exception" not in rec.names
    assert logger.status == "success"


# --- (5) the bus dispatches only overridden hooks ---------------------------------------------------------
class NothingOverridden(Callback):
    pass


class OnlyBatchEnd(Callback):
    def __init__(self):
        self.count = 0

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        self.count += 1


def test_bus_holds_only_overridden_hooks_after_setup():
    only = OnlyBatchEnd()
    trainer = TinyTrainer(quiet_config(callbacks=[NothingOverridden(), only]))
    trainer._setup_fit()
    bus = trainer._bus
    assert len(bus.on_train_batch_end) == 1
    for hook in HOOKS:
        if hook != "on_train_batch_end":
            assert getattr(bus, hook) == (), hook


def test_bus_is_empty_for_callbacks_that_override_nothing():
    trainer = TinyTrainer(quiet_config(callbacks=[NothingOverridden()]))
    trainer.fit()
    assert trainer._bus.on_train_batch_end == ()
    assert all(getattr(trainer._bus, hook) == () for hook in HOOKS)


def test_bus_includes_trainer_hooks_only_when_overridden():
    class T(TinyTrainer):
        def on_train_batch_start(self, batch, batch_idx):
            pass

    trainer = T(quiet_config())
    trainer._setup_fit()
    assert len(trainer._bus.on_train_batch_start) == 1
    assert trainer._bus.on_train_batch_end == ()
    assert trainer._bus.on_before_backward == ()


def test_only_overridden_hook_is_called():
    only = OnlyBatchEnd()
    trainer = TinyTrainer(quiet_config(n_epochs=2, callbacks=[only]))  # 4 batches per epoch
    trainer.fit()
    assert only.count == 8


# --- (6) should_stop -------------------------------------------------------------------------------------------
class StopAtStep(Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.should_stop = True


class StopAfterEpoch(Callback):
    def __init__(self, epoch):
        self.epoch = epoch
        self.epochs_started = 0

    def on_train_epoch_start(self, trainer):
        self.epochs_started += 1

    def on_train_epoch_end(self, trainer):
        if trainer.current_epoch == self.epoch:
            trainer.should_stop = True


def test_should_stop_from_on_train_batch_end_stops_training():
    rec = RecordingCallback()
    trainer = TinyTrainer(quiet_config(n_epochs=5, callbacks=[StopAtStep(3), rec]))  # 4 batches per epoch
    trainer.fit()
    assert trainer.global_step == 3
    assert len(trainer.train_losses) == 3
    assert rec.names.count("on_train_batch_end") == 3
    assert rec.names.count("on_train_epoch_start") == 1
    assert rec.names[-3:] == ["on_train_end", "on_fit_end", "teardown"]


def test_should_stop_from_on_train_batch_end_in_second_epoch():
    trainer = TinyTrainer(quiet_config(n_epochs=5, callbacks=[StopAtStep(6)]))
    trainer.fit()
    assert trainer.global_step == 6
    assert len(trainer.train_losses) == 6


def test_should_stop_from_on_train_epoch_end_stops_after_that_epoch():
    stop = StopAfterEpoch(1)  # the second epoch (0-based current_epoch == 1)
    trainer = TinyTrainer(quiet_config(n_epochs=5, callbacks=[stop]))  # 4 batches per epoch
    trainer.fit()
    assert stop.epochs_started == 2
    assert trainer.global_step == 8
    assert trainer.current_epoch == 2


# --- (7) stateful callbacks -----------------------------------------------------------------------------------
class Counter(Callback):
    def __init__(self, key="Counter"):
        self.key = key
        self.batches = 0
        self.total = torch.zeros(())

    @property
    def state_key(self):
        return self.key

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        self.batches += 1
        self.total = self.total + outputs["loss"].detach()

    def state_dict(self):
        return {"batches": self.batches, "total": self.total.clone()}

    def load_state_dict(self, state_dict):
        self.batches = state_dict["batches"]
        self.total = state_dict["total"].clone()


def test_stateful_callback_round_trips_through_trainer_state_dict():
    counter = Counter()
    trainer = TinyTrainer(quiet_config(callbacks=[counter]))
    trainer.fit()
    assert counter.batches == 4
    state = trainer.state_dict()
    assert state["callbacks"]["Counter"]["batches"] == 4
    assert torch.equal(state["callbacks"]["Counter"]["total"], counter.total)

    fresh = Counter()
    other = TinyTrainer(quiet_config(callbacks=[fresh]))
    other.load_state_dict(state)
    assert fresh.batches == 4
    assert torch.equal(fresh.total, counter.total)


def test_two_callbacks_of_a_kind_keep_separate_state():
    a, b = Counter("a"), Counter("b")
    a.batches, b.batches = 10, 20
    trainer = TinyTrainer(quiet_config(callbacks=[a, b]))
    state = trainer.state_dict()
    assert state["callbacks"]["a"]["batches"] == 10
    assert state["callbacks"]["b"]["batches"] == 20

    a2, b2 = Counter("a"), Counter("b")
    TinyTrainer(quiet_config(callbacks=[b2, a2])).load_state_dict(state)
    assert (a2.batches, b2.batches) == (10, 20)


def test_callback_state_survives_a_checkpoint_file(tmp_path):
    counter = Counter()
    trainer = TinyTrainer(quiet_config(tmp_path, callbacks=[counter]))
    trainer.fit()
    path = trainer.save_checkpoint(tmp_path / "last.ckpt")

    fresh = Counter()
    TinyTrainer(quiet_config(tmp_path, callbacks=[fresh])).load_checkpoint(path)
    assert fresh.batches == 4
    assert torch.equal(fresh.total, counter.total)


def test_sanity_values_are_visible_during_the_sanity_check_and_dropped_after():
    seen: dict[str, object] = {}

    class Spy(Callback):
        def on_validation_end(self, trainer):
            if trainer.sanity_checking:
                seen["during_sanity"] = dict(trainer.callback_metrics)

        def on_train_epoch_end(self, trainer):
            seen.setdefault("after_first_epoch", dict(trainer.callback_metrics))

    cfg = quiet_config(n_epochs=2, num_sanity_val_steps=1, val_every_n_epochs=2, callbacks=[Spy()])
    trainer = TinyTrainer(cfg)
    trainer.fit()
    assert "val_loss" in seen["during_sanity"]  # a callback can read what the sanity run produced
    assert "val_loss" not in seen["after_first_epoch"]  # ... but it is not mistaken for a real validation
    assert "val_loss" in trainer.callback_metrics  # epoch 2 validated for real
