"""Optimizers that step with a closure (`torch.optim.LBFGS`), proven against a hand-written loop.

A sequence model (an LSTM, and a GRU for manual optimization) trained with LBFGS on generated waves,
one thread, fp32, fixed seed: the port that returns the loss (the trainer builds the closure), the
port that calls `self.step(opt, closure=...)`, and a run resumed from a checkpoint written between two
LBFGS steps all end with weights `torch.equal` to the plain PyTorch loop. The settings a closure cannot
combine with are refused at setup, and the first step's advice names the closure forms.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_config
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import Callback, DreamTrainer, DreamTrainerConfig
from dream_trainer.errors import MisconfigurationError
from dream_trainer.loggers import MemoryLogger

SEED = 7
EPOCHS = 2
LBFGS_ARGS: dict[str, Any] = {"lr": 0.5, "max_iter": 4, "history_size": 6}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # bitwise comparisons: the same kernels


def waves() -> TensorDataset:
    """48 noisy sine waves of 20 steps (from their own generator): predict each next value."""
    g = torch.Generator().manual_seed(0)
    t = torch.linspace(0, 6, 21)
    phase = torch.rand(48, 1, 1, generator=g) * 6.28
    x = torch.sin(t[None, :, None] + phase) + 0.05 * torch.randn(48, 21, 1, generator=g)
    return TensorDataset(x[:, :-1], x[:, 1:])


def loader() -> DataLoader:
    return DataLoader(waves(), batch_size=16, shuffle=True)  # 3 batches per epoch, order from the global RNG


class SeqModel(nn.Module):
    def __init__(self, cell: type[nn.Module] = nn.LSTM) -> None:
        super().__init__()
        self.rnn = cell(1, 12, batch_first=True)
        self.head = nn.Linear(12, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def hand_loop(cell: type[nn.Module] = nn.LSTM) -> tuple[nn.Module, list[float]]:
    """The plain PyTorch program: LBFGS with a closure, `loss = optimizer.step(closure)` per batch."""
    torch.manual_seed(SEED)
    model = SeqModel(cell)
    optimizer = torch.optim.LBFGS(model.parameters(), **LBFGS_ARGS)
    data = loader()
    losses = []
    for _ in range(EPOCHS):
        for x, y in data:

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                optimizer.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                return loss

            losses.append(float(optimizer.step(closure).detach()))
    return model, losses


def config(tmp_path: Path, **overrides: Any) -> DreamTrainerConfig:
    # quiet_config, with the sanity check the default config runs
    settings: dict[str, Any] = {"seed": SEED, "n_epochs": EPOCHS, "log_every_n_steps": 1, "num_sanity_val_steps": 2}
    return quiet_config(tmp_path, **{**settings, **overrides})


class LBFGSPort(DreamTrainer):
    """The port: the closure's body is `training_step`, returning the loss."""

    cell: type[nn.Module] = nn.LSTM

    def configure_models(self) -> None:
        self.model = SeqModel(self.cell)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.LBFGS(self.model.parameters(), **LBFGS_ARGS)

    def configure_dataloaders(self) -> tuple[DataLoader, None]:
        return loader(), None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.log("logged", loss)
        return loss


class ManualLBFGSPort(LBFGSPort):
    """The port in manual form: the closure written out, stepped through `self.step`."""

    cell = nn.GRU

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch

        def closure() -> torch.Tensor:
            loss = F.mse_loss(self.model(x), y)
            self.backward(loss)
            return loss

        return {"loss": self.step(self.optimizer, closure=closure)}


class Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.events: list[str] = []

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))
        self.events.append("end")

    def on_before_zero_grad(self, trainer: Any, optimizer: Any) -> None:
        self.events.append("zero")

    def on_before_backward(self, trainer: Any, loss: Any) -> None:
        self.events.append("backward")

    def on_before_optimizer_step(self, trainer: Any, optimizer: Any) -> None:
        self.events.append("step")


def weights_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# --- the proofs -------------------------------------------------------------------------------------------------
def test_returned_loss_with_lbfgs_equals_the_hand_written_closure_loop(tmp_path: Path) -> None:
    expected, losses = hand_loop()
    record, memory = Record(), MemoryLogger()
    trainer = LBFGSPort(config(tmp_path, callbacks=[record], loggers=[memory]))
    trainer.fit()
    assert weights_equal(trainer.model, expected)
    # The batch's outputs and metrics are the closure's first evaluation: what optimizer.step(closure) returns.
    assert record.losses == losses
    assert [v for _, v in memory.series("logged")] == pytest.approx(losses, rel=1e-6)
    # Each batch: zero_grad and backward per evaluation, on_before_optimizer_step once, after the first.
    first_batch = record.events[: record.events.index("end") + 1]
    assert first_batch[:3] == ["zero", "backward", "step"] and first_batch[-1] == "end"
    assert first_batch.count("step") == 1 and first_batch.count("zero") == first_batch.count("backward") > 1


def test_manual_step_with_closure_equals_the_hand_written_loop(tmp_path: Path) -> None:
    expected, losses = hand_loop(nn.GRU)
    record = Record()
    trainer = ManualLBFGSPort(config(tmp_path, callbacks=[record]))
    trainer.fit()
    assert weights_equal(trainer.model, expected)
    assert record.losses == losses  # self.step(opt, closure=...) returns what optimizer.step(closure) returns


class SaveAt(Callback):
    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def test_resume_between_lbfgs_steps_is_exact(tmp_path: Path) -> None:
    expected, _ = hand_loop()
    path = tmp_path / "mid.ckpt"
    first = LBFGSPort(config(tmp_path, callbacks=[SaveAt(4, path)]))  # mid-epoch 2: LBFGS has a history
    first.fit()
    assert weights_equal(first.model, expected)
    saved = torch.load(path, weights_only=True)
    lbfgs_state = next(iter(saved["optimizers"]["optimizer"]["state"].values()))
    assert lbfgs_state["n_iter"] > 0 and len(lbfgs_state["old_dirs"]) > 0
    resumed = LBFGSPort(config(tmp_path))
    resumed.fit(ckpt_path=path)
    assert resumed.global_step == 6
    assert weights_equal(resumed.model, expected)


# --- what cannot combine with a closure ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "write"),
    [
        ({"mixed_precision": "fp16"}, "write mixed_precision='bf16' or None"),
        ({"gradient_accumulation_steps": 2}, "write gradient_accumulation_steps=1"),
        ({"non_finite_grads": "retry"}, "write non_finite_grads='raise'"),
        ({"non_finite_grads": "skip"}, "write non_finite_grads='raise'"),
        ({"spike_policy": "warn"}, "write spike_policy='off'"),
        ({"spike_policy": "rollback"}, "write spike_policy='off'"),
    ],
)
def test_settings_a_closure_cannot_combine_with_are_refused_at_setup(
    tmp_path: Path, overrides: dict[str, Any], write: str
) -> None:
    trainer = LBFGSPort(config(tmp_path, **overrides))
    with pytest.raises(MisconfigurationError) as info:
        trainer.fit()
    first = str(info.value).splitlines()[0]
    assert first.startswith("self.optimizer (LBFGS) steps with a closure") and write in first, first
    assert len(first) < 300 and trainer.global_step == 0


class BackwardNoStep(LBFGSPort):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        self.backward(F.mse_loss(self.model(x), y))


def test_backward_without_step_names_the_two_closure_forms(tmp_path: Path) -> None:
    with pytest.raises(MisconfigurationError) as info:
        BackwardNoStep(config(tmp_path)).fit()
    first = str(info.value).splitlines()[0]
    assert "return the loss instead, or call self.step(self.optimizer, closure=closure)" in first
    assert len(first) < 300


class RawClosureStep(LBFGSPort):
    """A step that calls optimizer.step(closure) itself with a closure calling self.backward."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch

        def closure() -> torch.Tensor:
            self.optimizer.zero_grad()
            loss = F.mse_loss(self.model(x), y)
            self.backward(loss)
            return loss

        self.optimizer.step(closure)


def test_raw_optimizer_step_with_closure_is_told_the_closure_form(tmp_path: Path) -> None:
    with pytest.raises(MisconfigurationError) as info:
        RawClosureStep(config(tmp_path)).fit()
    assert "Call self.step(optimizer, closure=closure) instead of optimizer.step(closure)" in str(info.value)


class RawEverything(LBFGSPort):
    """The hand loop pasted into training_step: trains as written, with advice that fits LBFGS."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch

        def closure() -> torch.Tensor:
            self.optimizer.zero_grad()
            loss = F.mse_loss(self.model(x), y)
            loss.backward()
            return loss

        self.optimizer.step(closure)


def test_pasted_hand_loop_warns_with_advice_that_works_for_lbfgs(tmp_path: Path) -> None:
    expected, _ = hand_loop()
    trainer = RawEverything(config(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit()
    texts = [str(w.message) for w in caught if "optimizer.step(closure) itself" in str(w.message)]
    assert len(texts) == 1, [str(w.message) for w in caught]
    assert "return the loss (the trainer builds the closure" in texts[0]
    assert "self.step(optimizer, closure=closure)" in texts[0] and "self.step(optimizer) " not in texts[0]
    assert weights_equal(trainer.model, expected)


class TwoOptimizers(LBFGSPort):
    def configure_models(self) -> None:
        self.model = SeqModel()
        self.extra = nn.Linear(1, 1)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.LBFGS(self.model.parameters(), **LBFGS_ARGS)
        self.extra_optimizer = torch.optim.SGD(self.extra.parameters(), lr=0.1)


def test_returned_loss_with_a_closure_optimizer_among_several_is_refused(tmp_path: Path) -> None:
    with pytest.raises(MisconfigurationError, match=re.escape("self.step(opt, closure=closure) for that one")):
        TwoOptimizers(config(tmp_path)).fit()


class ClosureOnAdam(LBFGSPort):
    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        calls = []

        def closure() -> torch.Tensor:
            calls.append(1)
            loss = F.mse_loss(self.model(x), y)
            self.backward(loss)
            return loss

        loss = self.step(self.optimizer, closure=closure)
        assert len(calls) == 1 and self.grad_norms["optimizer"] is not None
        return {"loss": loss}


def test_any_optimizer_takes_self_step_with_closure_and_it_clips(tmp_path: Path) -> None:
    torch.manual_seed(SEED)
    model = SeqModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = loader()
    for _ in range(EPOCHS):
        for x, y in data:
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
    trainer = ClosureOnAdam(config(tmp_path, gradient_clip_val=0.5))
    trainer.fit()
    assert weights_equal(trainer.model, model)
