"""Override `training_loop()` to own the loop, and keep everything the trainer does per step.

    python examples/custom_loop.py        # a few seconds on 2 CPU cores
    python examples/custom_loop.py --target-loss 0.02

The task: regress a smooth nonlinear function of 4 inputs with an MLP, on generated data.

The loop below is the Trainer Guide's ("Custom Training Loop"), plus one thing the default loop
does not do: stop as soon as validation loss reaches `--target-loss`. Calling
`self.training_step(batch, batch_idx)` from your own loop still runs the full step (device transfer,
autocast, backward, optimizer step, zero-grad, hooks, `global_step`), and iterating
`self.train_loader` still runs one epoch (epoch hooks, scheduler step, epoch summary, `current_epoch`).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig, MemoryLogger


def make_regression(n: int, seed: int, noise: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """`x: (n, 4)` uniform in [-1, 1], `y: (n, 1)` a smooth nonlinear function of x plus noise."""
    g = torch.Generator().manual_seed(seed)
    x = 2 * torch.rand(n, 4, generator=g) - 1
    y = torch.sin(3 * x[:, 0]) + x[:, 1] * x[:, 2] + 0.5 * x[:, 3] ** 2
    return x, (y + noise * torch.randn(n, generator=g)).unsqueeze(1)


@dataclass
class RegressionConfig(DreamTrainerConfig):
    learning_rate: float = 3e-3
    batch_size: int = 64
    n_train: int = 4096
    n_val: int = 1024
    target_loss: float | None = None
    """Stop once validation loss is at or below this (None: train all n_epochs)."""
    data_seed: int = 0


class RegressionTrainer(DreamTrainer):
    config: RegressionConfig

    def __init__(self, config: RegressionConfig) -> None:
        super().__init__(config)
        self.val_history: list[float] = []  # val_loss after each epoch, filled by training_loop

    def configure_models(self) -> None:
        self.model = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=self.config.learning_rate)

    def configure_dataloaders(self) -> tuple[DataLoader, DataLoader]:
        cfg = self.config
        train = TensorDataset(*make_regression(cfg.n_train, seed=cfg.data_seed))
        val = TensorDataset(*make_regression(cfg.n_val, seed=cfg.data_seed + 1))
        return DataLoader(train, batch_size=cfg.batch_size, shuffle=True), DataLoader(val, batch_size=512)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return {"loss": F.mse_loss(self.model(x), y)}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y)}

    def training_loop(self):
        """The guide's custom loop, with an early stop on a validation-loss target."""
        for epoch in range(self.current_epoch, self.config.n_epochs):
            # Training
            self.model.train()
            for batch_idx, batch in enumerate(self.train_loader):
                outputs = self.training_step(batch, batch_idx)
                # Sent to the loggers as is, at the current global_step: one entry per batch.
                self.log_metrics(outputs)

            # Validation (should_validate follows config.val_every_n_epochs)
            if self.should_validate():
                val_loss = self.validation_loop()["val_loss"]
                self.val_history.append(val_loss)
                target = self.config.target_loss
                if target is not None and val_loss <= target:
                    print(f"val_loss {val_loss:.4f} <= target {target}: stopping after epoch {epoch + 1}")
                    break


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = RegressionConfig()
    p = argparse.ArgumentParser(description="Regression with a custom training_loop().")
    p.add_argument("--epochs", type=int, default=20, help="at most this many epochs (default: %(default)s)")
    p.add_argument("--n-train", type=int, default=defaults.n_train, help="(default: %(default)s)")
    p.add_argument("--target-loss", type=float, default=0.005, help="stop at this val_loss (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--root-dir", default="runs/custom_loop", help="(default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no per-epoch summary lines")
    # Splitting ops this small across threads costs more than it saves (and oversubscribes shared CPUs).
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train; return the baseline and final validation loss, epochs, steps and what was logged."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logger = MemoryLogger()  # keeps every logged dict in memory: logger.history == [(step, {...}), ...]
    config = RegressionConfig(
        n_epochs=args.epochs,
        seed=args.seed,
        data_seed=args.seed,
        n_train=args.n_train,
        target_loss=args.target_loss,
        root_dir=args.root_dir,
        loggers=[logger],
        print_epoch_summary=not args.quiet,
        num_sanity_val_steps=0,
    )
    trainer = RegressionTrainer(config)
    start = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - start

    # Baseline: the loss of always predicting the mean target, i.e. the variance of y.
    _, y_val = make_regression(config.n_val, seed=config.data_seed + 1)
    results = {
        "baseline_val_loss": y_val.var(unbiased=False).item(),
        "first_val_loss": trainer.val_history[0],
        "val_loss": trainer.val_history[-1],
        "epochs": trainer.current_epoch,
        "global_step": trainer.global_step,
        "logged_dicts": len(logger.history),
        "wall_s": wall,
    }
    print(
        f"done: val_loss {results['val_loss']:.4f} (predicting the mean: {results['baseline_val_loss']:.4f}) | "
        f"{trainer.global_step} steps in {trainer.current_epoch} epochs | {wall:.1f}s"
    )
    return results


if __name__ == "__main__":
    main()
