"""A trainer made to be driven by the `dream-trainer` command and a YAML config.

    dream-trainer fit examples/cli_trainer.py:RegressionTrainer --config examples/configs/regression.yaml
    dream-trainer fit --config examples/configs/regression.yaml --n_epochs 3 --optimizer.lr 0.05
    dream-trainer validate --config examples/configs/regression.yaml --ckpt_path last
    dream-trainer fit examples/cli_trainer.py:RegressionTrainer --help     # every flag, documented
    python examples/cli_trainer.py --config examples/configs/regression.yaml   # the same as `fit`

The config's fields (`RegressionConfig`: the trainer's settings plus `batch_size`, `n_train`, ...)
are flags and YAML keys. `model`, `optimizer` and `scheduler` are `__init__` parameters annotated
`dict`, so the trainer receives them as raw `{type: ...}` configs and builds them itself through the
registries when it needs them: the model in `configure_models` (after `fit()` has seeded the RNGs,
so its initial weights are reproducible), the optimizer once the model's parameters exist.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig
from dream_trainer.registry import MODELS, OPTIMIZERS, SCHEDULERS


@MODELS.register()
class MLP(nn.Module):
    """A small multi-layer perceptron: `in_features -> hidden (x depth) -> out_features`."""

    def __init__(self, in_features: int = 4, hidden: int = 32, depth: int = 1, out_features: int = 1) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, out_features))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`y = x @ w + 0.5 + noise` with `x: (n, 4)`: a problem an MLP learns in a few epochs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    w = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    return x, x @ w + 0.5 + 0.05 * torch.randn(n, 1, generator=g)


@dataclass
class RegressionConfig(DreamTrainerConfig):
    """The trainer's settings plus this task's data settings."""

    batch_size: int = 32
    """Samples per batch."""
    n_train: int = 1024
    """Training samples."""
    n_val: int = 256
    """Validation samples (drawn from the same distribution)."""
    data_seed: int = 0
    """Seed of the generated data (independent of `seed`, which seeds the model and shuffling)."""


class RegressionTrainer(DreamTrainer):
    config: RegressionConfig

    def __init__(
        self,
        config: RegressionConfig,
        model: dict[str, Any] | None = None,
        optimizer: dict[str, Any] | None = None,
        scheduler: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(config)
        self.model_cfg = model or {"type": "MLP"}
        self.optimizer_cfg = optimizer or {"type": "AdamW", "lr": 1e-2}
        self.scheduler_cfg = scheduler

    def configure_models(self) -> None:
        self.model = MODELS.build(self.model_cfg)

    def configure_optimizers(self) -> None:
        self.optimizer = OPTIMIZERS.build(self.optimizer_cfg, params=self.model.parameters())
        if self.scheduler_cfg is not None:
            self.scheduler = SCHEDULERS.build(self.scheduler_cfg, optimizer=self.optimizer)

    def configure_dataloaders(self) -> tuple[DataLoader, DataLoader]:
        cfg = self.config
        x, y = make_data(cfg.n_train + cfg.n_val, seed=cfg.data_seed)
        train = TensorDataset(x[: cfg.n_train], y[: cfg.n_train])
        val = TensorDataset(x[cfg.n_train :], y[cfg.n_train :])
        return DataLoader(train, batch_size=cfg.batch_size, shuffle=True), DataLoader(val, batch_size=256)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"loss": F.mse_loss(self.model(x), y)}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y)}


if __name__ == "__main__":
    from dream_trainer.cli import main

    # `python examples/cli_trainer.py [flags]` is `dream-trainer fit examples/cli_trainer.py:RegressionTrainer [flags]`.
    sys.exit(main(["fit", f"{__file__}:RegressionTrainer", *sys.argv[1:]]))
