"""The tiny trainer and what tests build it with (`tests/conftest.py` re-exports them: import them as
``from conftest import TinyTrainer, make_regression_data, quiet_config``; see conftest's docstring).

Here, not in conftest itself, so that the process that only schedules the tests (xdist's controller), which
imports conftest but runs no test, does not import torch and dream_trainer (~5 s of CPU before the workers
start).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import Callback, DreamTrainer, DreamTrainerConfig
from dream_trainer.callbacks import HOOKS

__all__ = ["RecordingCallback", "TinyTrainer", "make_regression_data", "quiet_config"]


def make_regression_data(n: int = 256, seed: int = 0, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic regression problem: `y = (x @ w + 0.5 + noise) * scale`, `x: (n, 4)`, `y: (n, 1)`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    w = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    y = x @ w + 0.5 + 0.01 * torch.randn(n, 1, generator=g)
    if scale != 1.0:
        y = y * scale
    return x, y


def quiet_config(tmp_path: Any = None, **overrides: Any) -> DreamTrainerConfig:
    """A `DreamTrainerConfig` for tests: cpu, no epoch summary, no sanity check, `root_dir=tmp_path`,
    and none of the defaults that write or print (TensorBoard, progress, checkpointing)."""
    kwargs: dict[str, Any] = {
        "print_epoch_summary": False,
        "device": "cpu",
        "num_sanity_val_steps": 0,
        "loggers": [],
        "enable_progress_bar": False,
        "enable_checkpointing": False,
    }
    if tmp_path is not None:
        kwargs["root_dir"] = str(tmp_path)
    kwargs.update(overrides)
    return DreamTrainerConfig(**kwargs)


class TinyTrainer(DreamTrainer):
    """The smallest complete trainer: a linear regression with SGD.

    `n_train`/`n_val` samples, `batch_size` per batch; `n_val=0` means no validation loader.
    `self.train_losses` collects the detached loss of every `training_step` call, in order.
    """

    def __init__(
        self,
        config: DreamTrainerConfig,
        n_train: int = 16,
        n_val: int = 8,
        batch_size: int = 4,
        lr: float = 0.1,
        data_seed: int = 0,
    ) -> None:
        super().__init__(config)
        torch.manual_seed(0)
        self.model = nn.Linear(4, 1)
        self.lr = lr
        self.n_train = n_train
        self.n_val = n_val
        self.batch_size = batch_size
        self.data_seed = data_seed
        self.train_losses: list[torch.Tensor] = []

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr)

    def configure_dataloaders(self) -> tuple[DataLoader, DataLoader | None]:
        x, y = make_regression_data(self.n_train + self.n_val, seed=self.data_seed)
        train = DataLoader(TensorDataset(x[: self.n_train], y[: self.n_train]), batch_size=self.batch_size)
        val = None
        if self.n_val:
            val = DataLoader(TensorDataset(x[self.n_train :], y[self.n_train :]), batch_size=self.batch_size)
        return train, val

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.train_losses.append(loss.detach().clone())
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y)}


def _make_recorder(hook: str):
    def record(self: RecordingCallback, trainer: DreamTrainer, *args: Any) -> None:
        self.calls.append((hook, args))

    record.__name__ = hook
    return record


class RecordingCallback(Callback):
    """Overrides every hook in `HOOKS`; `calls` is a list of `(hook_name, args_without_trainer)`,
    `names` just the hook names in firing order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


for _hook in HOOKS:
    setattr(RecordingCallback, _hook, _make_recorder(_hook))
del _hook
