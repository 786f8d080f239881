"""LambdaCallback: functions called with the hook's arguments, only the given hooks dispatched,
unknown names rejected with the closest hook suggested."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
from conftest import TinyTrainer, quiet_config

from dream_trainer import Callback, ConfigError
from dream_trainer.callbacks import HOOKS
from dream_trainer.callbacks.lambda_callback import LambdaCallback


def test_functions_receive_the_trainer_and_the_hook_arguments():
    calls: list[tuple[Any, ...]] = []
    cb = LambdaCallback(
        on_fit_start=lambda trainer: calls.append(("fit_start", trainer)),
        on_train_batch_end=lambda trainer, outputs, batch, batch_idx: calls.append(
            ("batch_end", trainer, float(outputs["loss"].detach()), len(batch), batch_idx)
        ),
        setup=lambda trainer, stage: calls.append(("setup", stage)),
        teardown=lambda trainer, stage: calls.append(("teardown", stage)),
    )
    trainer = TinyTrainer(quiet_config(n_epochs=1, callbacks=[cb]), n_train=8, n_val=0)
    trainer.fit()
    assert [c[0] for c in calls] == ["setup", "fit_start", "batch_end", "batch_end", "teardown"]
    assert calls[1][1] is trainer
    assert calls[2][1] is trainer and calls[2][3] == 2 and calls[2][4] == 0  # batch of (x, y); batch_idx 0
    assert calls[2][2] == pytest.approx(float(trainer.train_losses[0]))
    assert calls[3][4] == 1
    assert calls[-1][1] == "fit"


def test_only_the_given_hooks_are_dispatched():
    fit_starts: list[Any] = []
    cb = LambdaCallback(on_fit_start=fit_starts.append)
    trainer = TinyTrainer(quiet_config(callbacks=[cb]))
    trainer._setup_fit()
    assert trainer._bus.on_train_batch_end == ()
    for hook in HOOKS:
        if hook != "on_fit_start":
            assert getattr(trainer._bus, hook) == (), hook
    assert len(trainer._bus.on_fit_start) == 1


def test_the_users_function_is_bound_directly():
    def fn(trainer: Any) -> None:
        pass

    trainer = TinyTrainer(quiet_config(callbacks=[LambdaCallback(on_train_epoch_start=fn)]))
    trainer._setup_fit()
    (dispatched,) = trainer._bus.on_train_epoch_start
    assert dispatched.func is fn  # no wrapper frame on the hot path


def test_two_instances_with_different_hooks_do_not_interfere():
    a_calls: list[str] = []
    b_calls: list[str] = []
    a = LambdaCallback(on_train_start=lambda t: a_calls.append("a"))
    b = LambdaCallback(on_train_end=lambda t: b_calls.append("b"), on_train_start=None)
    c = LambdaCallback(on_train_start=lambda t: a_calls.append("c"))
    trainer = TinyTrainer(quiet_config(n_epochs=1, callbacks=[a, b, c]), n_val=0)
    trainer._setup_fit()
    assert len(trainer._bus.on_train_start) == 2
    assert len(trainer._bus.on_train_end) == 1
    trainer.fit()
    assert a_calls == ["a", "c"] and b_calls == ["b"]
    assert type(a) is type(c) and type(a) is not type(b)  # one class per set of hooks


def test_it_is_a_callback_with_a_stable_state_key():
    cb = LambdaCallback(on_fit_start=print)
    assert isinstance(cb, LambdaCallback) and isinstance(cb, Callback)
    assert cb.state_key == "LambdaCallback"
    assert type(cb).__name__ == "LambdaCallback"
    assert cb.hooks == {"on_fit_start": print}
    assert "on_fit_start=" in repr(cb)


def test_copies_and_pickles_keep_the_hooks():
    cb = LambdaCallback(on_fit_start=print)
    for clone in (copy.deepcopy(cb), pickle.loads(pickle.dumps(cb))):
        assert clone.hooks == {"on_fit_start": print}
        trainer = TinyTrainer(quiet_config(callbacks=[clone]))
        trainer._setup_fit()
        assert len(trainer._bus.on_fit_start) == 1 and trainer._bus.on_fit_end == ()


def test_unknown_hook_suggests_the_closest_name():
    with pytest.raises(ConfigError, match=r"on_train_batch_ends.*did you mean `on_train_batch_end`"):
        LambdaCallback(on_train_batch_ends=lambda trainer, *args: None)
    with pytest.raises(ConfigError, match=r"`state_dict` is not a hook"):
        LambdaCallback(state_dict=lambda: {})


def test_non_callable_is_rejected():
    with pytest.raises(ConfigError, match=r"on_fit_start=3.*expected a function"):
        LambdaCallback(on_fit_start=3)
