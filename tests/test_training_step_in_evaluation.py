"""`self.training_step` inside an evaluation, or inside a training step, is the user's method (issue 36).

Lightning's habit `def validation_step(self, batch, i): return self.training_step(batch, i)` computes the
validation loss with the training code. Once set up, `self.training_step` read from a loop is the full
step (backward, optimizer step, counters), so before, validation ran the full step under `no_grad` and
`fit()` died with torch's "element 0 of tensors does not require grad". Now an evaluation (validation
during fit, the sanity check, `validate()`, `test()`) and a training step that calls `self.training_step`
again get the method as written: the weights are those of a run that never validated.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyTrainer, make_regression_data, quiet_config
from torch.utils.data import DataLoader, TensorDataset

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # bitwise comparisons: the same kernels


class ValidatesWithTrainingStep(TinyTrainer):
    """Lightning's habit: the evaluation steps return the training step's outputs."""

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        return self.training_step(batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        return self.training_step(batch, batch_idx)


def val_mse(model: torch.nn.Module) -> float:
    """The mean of the validation batches' MSE (TinyTrainer's 8 validation samples, 2 batches of 4)."""
    x, y = make_regression_data(24)
    with torch.no_grad():
        return float(sum(F.mse_loss(model(x[i : i + 4]), y[i : i + 4]) for i in (16, 20)) / 2)


def same_weights(a: TinyTrainer, b: TinyTrainer) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))


def test_validation_during_fit_runs_the_users_training_step_and_trains_nothing(tmp_path):
    trainer = ValidatesWithTrainingStep(quiet_config(tmp_path / "a", n_epochs=2))
    reference = TinyTrainer(quiet_config(tmp_path / "b", n_epochs=2, val_every_n_epochs=None))
    trainer.fit()
    reference.fit()
    assert trainer.global_step == reference.global_step == 8  # validation made no step
    assert same_weights(trainer, reference)
    assert len(trainer.train_losses) == 8 + 2 * 2  # 8 training steps, and 2 validation batches per epoch
    assert trainer.validation_metrics["val_loss"] == pytest.approx(val_mse(trainer.model), rel=1e-6)


def test_the_sanity_check_runs_the_users_training_step(tmp_path):
    # Validation only in the sanity check: before, it died there, before the first training step.
    trainer = ValidatesWithTrainingStep(quiet_config(tmp_path / "a", num_sanity_val_steps=2, val_every_n_epochs=None))
    reference = TinyTrainer(quiet_config(tmp_path / "b", val_every_n_epochs=None))
    trainer.fit()
    reference.fit()
    assert trainer.global_step == 4 and same_weights(trainer, reference)
    assert len(trainer.train_losses) == 2 + 4  # the sanity check's 2 batches, then 4 training steps


def test_validate_and_test_run_the_users_training_step_and_leave_the_weights(tmp_path):
    trainer = ValidatesWithTrainingStep(quiet_config(tmp_path))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    results = trainer.validate()
    assert results["val_loss"] == pytest.approx(val_mse(trainer.model), rel=1e-6)
    x, y = make_regression_data(24)
    tested = trainer.test(DataLoader(TensorDataset(x[16:], y[16:]), batch_size=4))
    assert tested["test_loss"] == pytest.approx(results["val_loss"], rel=1e-6)
    assert trainer.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    # Outside an evaluation, the loops still get the full step.
    trainer.fit()
    assert trainer.global_step == 4


class SplitsItsBatches(TinyTrainer):
    """A training step that calls `self.training_step` for each part of a split batch (re-entrant)."""

    def configure_dataloaders(self) -> tuple[list[dict[str, Any]], None]:
        x, y = make_regression_data(16)
        return [
            {"parts": [(x[i : i + 2], y[i : i + 2]), (x[i + 2 : i + 4], y[i + 2 : i + 4])]} for i in (0, 4, 8, 12)
        ], None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if isinstance(batch, dict):
            losses = [self.training_step(part, batch_idx)["loss"] for part in batch["parts"]]
            return {"loss": torch.stack(losses).mean()}
        return super().training_step(batch, batch_idx)


def test_a_training_step_that_calls_itself_gets_its_own_method_inside(tmp_path):
    trainer = SplitsItsBatches(quiet_config(tmp_path, n_epochs=2))
    trainer.fit()
    # The plain loop it ports: one backward and one optimizer step per outer batch.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_regression_data(16)
    for _ in range(2):
        for i in (0, 4, 8, 12):
            losses = [F.mse_loss(model(x[j : j + 2]), y[j : j + 2]) for j in (i, i + 2)]
            torch.stack(losses).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert trainer.global_step == 8  # one step per outer batch: the inner calls made none
    assert len(trainer.train_losses) == 16  # two parts per batch
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), model.parameters(), strict=True))
