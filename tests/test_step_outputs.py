"""What `training_step` returns is validated once per fit, on the first step: every wrong shape is a
`MisconfigurationError` naming the method, what it received and the accepted forms; later steps pay
nothing for the check. (Before, a string or a dict whose "loss" was no scalar tensor was silently
ignored: nothing was backpropagated and the run "trained" to the end.)"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyTrainer, make_regression_data, quiet_config
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import MisconfigurationError


class Returns(TinyTrainer):
    """`training_step` returns `make(self, loss)`; with `backward=True` it calls `self.backward(loss)` first."""

    def __init__(self, config, make, backward: bool = False, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.make = make
        self.call_backward = backward

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.train_losses.append(loss.detach().clone())
        if self.call_backward:
            self.backward(loss)
        return self.make(self, loss)


BAD = [
    ("a string", lambda t, loss: "done", False, "returned a str ('done')"),
    ("a tuple", lambda t, loss: (loss, loss), False, "returned a tuple ("),
    ("a list", lambda t, loss: [loss], False, "returned a list ("),
    ("a float", lambda t, loss: loss.item(), False, "returned a float ("),
    ("a bool", lambda t, loss: True, False, "returned a bool (True)"),
    ("a non-scalar tensor", lambda t, loss: loss.expand(4), False, "a tensor of shape (4,)"),
    ("a detached loss", lambda t, loss: loss.detach(), False, "a loss that does not require grad"),
    ("a dict with a float loss", lambda t, loss: {"loss": loss.item()}, False, 'a dict whose "loss" is a float'),
    ("a dict with a string loss", lambda t, loss: {"loss": "x"}, False, 'a dict whose "loss" is a str'),
    ("a dict with a non-scalar loss", lambda t, loss: {"loss": loss.expand(2, 2)}, False, "a tensor of shape (2, 2)"),
    ("a dict with a non-scalar loss after backward", lambda t, loss: {"loss": loss.expand(3)}, True, "shape (3,)"),
    ("a dict without loss", lambda t, loss: {"mse": loss}, False, "a dict without a \"loss\" entry (keys ['mse'])"),
]


@pytest.mark.parametrize(("what", "make", "backward", "expected"), BAD, ids=[b[0] for b in BAD])
def test_a_wrong_step_output_is_an_error_naming_method_type_and_accepted_forms(
    tmp_path, what, make, backward, expected
):
    trainer = Returns(quiet_config(tmp_path), make, backward=backward)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(MisconfigurationError) as info:
        trainer.fit()
    message = str(info.value)
    assert message.startswith("Returns.training_step returned "), message
    assert expected in message, message
    for form in ("a scalar loss tensor", 'a dict with a scalar loss tensor under "loss"', "self.backward(loss)"):
        assert form in message, message
    assert trainer.global_step == 0 and len(trainer.train_losses) == 1  # stopped at the first step
    if not backward:
        assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))


GOOD = [
    ("a scalar tensor", lambda t, loss: loss, False),
    ("a one-element tensor", lambda t, loss: loss.reshape(1), False),
    (
        "a dict with loss and metrics",
        lambda t, loss: {"loss": loss, "mae": loss.sqrt(), "logits": torch.ones(4)},
        False,
    ),
    ("None after backward", lambda t, loss: None, True),
    ("metrics after backward", lambda t, loss: {"mse": loss.detach()}, True),
    ("a float loss after backward", lambda t, loss: {"loss": loss.item()}, True),
    ("a detached loss after backward", lambda t, loss: loss.detach(), True),
]


@pytest.mark.parametrize(("what", "make", "backward"), GOOD, ids=[g[0] for g in GOOD])
def test_the_accepted_forms_train(tmp_path, what, make, backward):
    trainer = Returns(quiet_config(tmp_path, n_epochs=2), make, backward=backward)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.fit()
    assert trainer.global_step == 8
    assert not all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))


def test_a_manual_step_may_return_none(tmp_path):
    class Manual(TinyTrainer):
        def training_step(self, batch, batch_idx):
            x, y = batch
            F.mse_loss(self.model(x), y).backward()  # not self.backward: but it steps itself
            self.step(self.optimizer)
            return None

    trainer = Manual(quiet_config(tmp_path))
    with pytest.warns(UserWarning, match=r"loss.backward\(\).*bypasses the accumulation window's loss averaging"):
        trainer.fit()
    assert trainer.global_step == 4


def test_only_the_first_step_of_each_fit_is_checked(tmp_path):
    # Later steps are not checked (they pay nothing): a string at the second step goes by, as before.
    def make(t: Returns, loss: torch.Tensor) -> Any:
        return {"loss": loss} if len(t.train_losses) == 1 else "ignored"

    trainer = Returns(quiet_config(tmp_path), make)
    trainer.fit()
    assert trainer.global_step == 4
    assert not _methods_on_the_instance(trainer)  # nothing shadows a method, during the fit or after

    # The next fit checks its first step again.
    trainer.make = lambda t, loss: "again"
    trainer.config.n_epochs = 2
    with pytest.raises(MisconfigurationError, match=r"returned a str \('again'\)"):
        trainer.fit()
    assert trainer.global_step == 4


def test_a_custom_training_loop_gets_the_check_too(tmp_path):
    class OwnLoop(Returns):
        def training_loop(self):
            for batch_idx, batch in enumerate(self.train_loader):
                self.training_step(batch, batch_idx)

    with pytest.raises(MisconfigurationError, match=r"OwnLoop\.training_step returned a str"):
        OwnLoop(quiet_config(tmp_path), lambda t, loss: "nope").fit()


def test_the_check_runs_before_the_automatic_backward(tmp_path):
    # With gradient accumulation the first step is the first micro-batch of the first window.
    trainer = Returns(quiet_config(tmp_path, gradient_accumulation_steps=2), lambda t, loss: {"loss": [loss]})
    with pytest.raises(MisconfigurationError, match=r'a dict whose "loss" is a list'):
        trainer.fit()
    assert all(p.grad is None for p in trainer.model.parameters())


# --- the step is the class's, never an instance attribute ----------------------------------------------
def _methods_on_the_instance(trainer: Any) -> list[str]:
    """Names the instance holds that are methods of its class: a method replaced on the instance."""
    return sorted(k for k in vars(trainer) if callable(getattr(type(trainer), k, None)))


def _frames_up_to_fit() -> int:
    """Frames between the caller (a training_step) and `fit()`: 1 when fit called it directly."""
    frame, depth = sys._getframe(1), 0
    while frame is not None and frame.f_code.co_name != "fit":
        frame, depth = frame.f_back, depth + 1
    assert frame is not None, "no fit() frame above the training step"
    return depth


class Probed(TinyTrainer):
    """Records, in each training step, the frames up to fit() and the methods shadowed on the instance."""

    def __init__(self, config: Any, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.depths: list[int] = []
        self.shadowed: list[list[str]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.depths.append(_frames_up_to_fit())
        self.shadowed.append(_methods_on_the_instance(self))
        return super().training_step(batch, batch_idx)

    def test_step(self, batch: Any) -> Any:  # without batch_idx: adapted for test(), at the class level
        x, y = batch
        return {"test_loss": F.mse_loss(self.model(x), y)}

    def load_checkpoint(self, path: Any, strict: bool = True) -> None:  # an override: set up first
        self.loaded_with = type(self.optimizer)  # setup ran before this line (the Trainer Guide's override)
        super().load_checkpoint(path, strict)


def test_the_training_step_is_at_most_5_frames_below_fit_and_no_method_is_replaced_on_the_instance(tmp_path):
    trainer = Probed(quiet_config(tmp_path, n_epochs=2))
    trainer.fit()
    assert trainer.global_step == 8
    # fit -> training_loop -> _run_train_epoch -> _full_training_step -> _step_body -> training_step on
    # every step after the first (which runs one frame deeper, under its checks).
    assert trainer.depths[0] == 6 and set(trainer.depths[1:]) == {5}, trainer.depths
    # Not during the first step (its checks watch backward/step), not during later ones, not afterwards.
    assert trainer.shadowed == [[]] * 8
    x, y = make_regression_data(8, seed=1)
    assert "test_loss" in trainer.test(DataLoader(TensorDataset(x, y), batch_size=4))
    path = tmp_path / "probe.ckpt"
    trainer.save_checkpoint(path)
    trainer.load_checkpoint(path)
    assert _methods_on_the_instance(trainer) == []
    fresh = Probed(quiet_config(tmp_path / "fresh"))
    fresh.load_checkpoint(path)  # the override runs after setup: it reads the optimizer setup made
    assert fresh.loaded_with is torch.optim.SGD and fresh.global_step == 8


def test_a_custom_loop_calling_self_training_step_gets_the_full_step(tmp_path):
    # The seed's "Custom Training Loop": `self.training_step(batch, batch_idx)` is the full step (the
    # backward and the optimizer step it automates, the counters), one frame shallower than the default
    # loop's (no `_run_train_epoch`).
    class OwnLoop(Probed):
        def training_loop(self):
            for epoch in range(self.config.n_epochs):
                self.current_epoch = epoch
                for batch_idx, batch in enumerate(self.train_loader):
                    self.training_step(batch, batch_idx)

    trainer = OwnLoop(quiet_config(tmp_path, n_epochs=2))
    ref = TinyTrainer(quiet_config(tmp_path / "ref", n_epochs=2))
    trainer.fit()
    ref.fit()
    assert trainer.global_step == ref.global_step == 8
    assert torch.equal(trainer.model.weight, ref.model.weight)
    assert set(trainer.depths[1:]) == {4}, trainer.depths  # fit -> training_loop -> the full step -> ...


def test_super_training_step_reaches_the_parents_code_not_the_full_step_again(tmp_path):
    calls: list[str] = []

    class Parent(TinyTrainer):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            calls.append("parent")
            return super().training_step(batch, batch_idx)

    class Child(Parent):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            calls.append("child")
            return super().training_step(batch, batch_idx)

    trainer = Child(quiet_config(tmp_path))
    ref = TinyTrainer(quiet_config(tmp_path / "ref"))
    trainer.fit()
    ref.fit()
    # One full step per batch: the window, the counters and the update are those of the plain trainer.
    assert calls == ["child", "parent"] * 4
    assert trainer.global_step == 4 and len(trainer.train_losses) == 4
    assert torch.equal(trainer.model.weight, ref.model.weight)
    assert Child.training_step.__qualname__.endswith("Child.training_step")  # the class holds the user's function


# --- None: a skipped batch, also at the first step of a fit (issue 36) ---------------------------------
class SkipsBatches(TinyTrainer):
    """`training_step` returns None (a skip) for the `(epoch, batch_idx)` pairs in `skip`."""

    def __init__(self, config: Any, skip: set[tuple[int, int]], **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.skip = skip

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if (self.current_epoch, batch_idx) in self.skip:
            return None
        return super().training_step(batch, batch_idx)


def test_a_fresh_fit_whose_first_batch_returns_none_trains_the_rest(tmp_path):
    trainer = SkipsBatches(quiet_config(tmp_path), skip={(0, 0)})
    with pytest.warns(
        UserWarning, match=r"^SkipsBatches\.training_step returned None .* \(batch 0\): that batch"
    ) as seen:
        trainer.fit()
    assert len([w for w in seen if "returned None" in str(w.message)]) == 1
    assert seen[0].filename == __file__  # at the user's training_step
    # The loop it ports: batches 1-3 of the one epoch, one SGD step each.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_regression_data(24)
    for i in (4, 8, 12):
        F.mse_loss(model(x[i : i + 4]), y[i : i + 4]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert len(trainer.train_losses) == 3 and trainer.global_step == 4
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), model.parameters(), strict=True))


def test_a_resumed_fit_whose_first_batch_returns_none_continues_as_the_uninterrupted_run(tmp_path):
    skip = {(1, 0)}  # the first batch of the second epoch: the first step after the resume
    whole = SkipsBatches(quiet_config(tmp_path / "whole", n_epochs=2), skip=skip)
    whole.fit()
    first = SkipsBatches(quiet_config(tmp_path / "first", n_epochs=1), skip=skip)
    first.fit()
    path = tmp_path / "epoch0.ckpt"
    first.save_checkpoint(path)
    resumed = SkipsBatches(quiet_config(tmp_path / "resumed", n_epochs=2), skip=skip)
    with pytest.warns(UserWarning, match=r"returned None without self\.backward\(loss\) at the first step"):
        resumed.fit(ckpt_path=path)
    assert resumed.global_step == whole.global_step == 8
    assert len(resumed.train_losses) == 3  # batches 1-3 of the second epoch
    assert all(torch.equal(p, q) for p, q in zip(resumed.model.parameters(), whole.model.parameters(), strict=True))


def test_a_skipped_first_step_moves_the_check_to_the_next_step(tmp_path):
    # The check still catches what it exists for, one step later: a string returned after the skip.
    def make(t: Returns, loss: torch.Tensor) -> Any:
        return None if len(t.train_losses) == 1 else "done"

    trainer = Returns(quiet_config(tmp_path), make)
    with (
        pytest.warns(UserWarning, match="returned None"),
        pytest.raises(MisconfigurationError, match=r"returned a str"),
    ):
        trainer.fit()
    assert len(trainer.train_losses) == 2


def test_a_step_that_forgot_return_loss_is_said_once_and_trains_nothing(tmp_path):
    # Before, an error at the first step; a None step is a skip, so now one warning naming the fix.
    trainer = Returns(quiet_config(tmp_path, n_epochs=2), lambda t, loss: None)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.warns(UserWarning, match=r"Return the loss if it should have trained") as seen:
        trainer.fit()
    assert len([w for w in seen if "returned None" in str(w.message)]) == 1
    assert len(trainer.train_losses) == 8
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
