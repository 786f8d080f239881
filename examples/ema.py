"""Train with an exponential moving average (EMA) of the weights, and see what it buys on the validation set.

    python examples/ema.py                    # ~5 s on 2 CPU cores
    python examples/ema.py --decay 0.999 --epochs 20

The task: a small MLP regresses a smooth function of 8 inputs from noisy targets, with plain SGD at a
constant, rather high learning rate and small batches. The weights then never settle: every step moves
them by the noise of its batch, and they jitter around a good solution. The `EMA` callback keeps
`ema = decay * ema + (1 - decay) * weights` after every step, an average over roughly the last
`1 / (1 - decay)` steps, in which that jitter cancels out.

`EMA(swap_for_validation=True)` (the default) puts the averaged weights into the model for every
validation run and the training weights back afterwards, bit for bit, so `val_loss` in the epoch
summary and in `callback_metrics` is the EMA's. To compare, this example also evaluates the live
(training) weights and the average itself at the end of every epoch, prints both, and saves the
averaged weights to `<root-dir>/ema_weights.pt` (`model.load_state_dict` reads them).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig
from dream_trainer.callbacks import EMA

N_FEATURES = 8


def make_data(n: int, seed: int, noise: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`x: (n, 8)`, `y: (n, 1)`: `sin(x @ a) + 0.5 cos(x @ b)` (a, b fixed) plus Gaussian noise."""
    fixed = torch.Generator().manual_seed(1234)
    a, b = torch.randn(2, N_FEATURES, 1, generator=fixed) / N_FEATURES**0.5
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_FEATURES, generator=g)
    y = torch.sin(2 * x @ a) + 0.5 * torch.cos(2 * x @ b)
    return x, y + noise * torch.randn(n, 1, generator=g)


@dataclass
class EMAConfig(DreamTrainerConfig):
    learning_rate: float = 0.1
    batch_size: int = 16
    n_train: int = 4096
    n_val: int = 2048
    noise: float = 0.5
    data_seed: int = 0


class RegressionTrainer(DreamTrainer):
    config: EMAConfig

    def __init__(self, config: EMAConfig) -> None:
        super().__init__(config)
        self.history: list[dict[str, float]] = []

    def configure_models(self) -> None:
        self.model = nn.Sequential(nn.Linear(N_FEATURES, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))

    def configure_optimizers(self) -> None:
        # Constant LR and no momentum: the weights keep jittering to the end. (A decaying LR also quiets
        # them, more slowly; an EMA gives the benefit at every point of the run.)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.config.learning_rate)

    def configure_dataloaders(self) -> tuple[DataLoader, DataLoader]:
        cfg = self.config
        train = TensorDataset(*make_data(cfg.n_train, seed=cfg.data_seed, noise=cfg.noise))
        # Validation targets without noise: val_loss measures the error of the learned function itself.
        self.val_data = make_data(cfg.n_val, seed=cfg.data_seed + 1, noise=0.0)
        return DataLoader(train, batch_size=cfg.batch_size, shuffle=True), DataLoader(
            TensorDataset(*self.val_data), batch_size=512
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return {"loss": F.mse_loss(self.model(x), y)}

    def validation_step(self, batch, batch_idx):
        # The EMA callback has swapped the averaged weights into self.model for this run.
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y)}

    @torch.no_grad()
    def val_mse(self, model: nn.Module) -> float:
        x, y = self.val_data
        return F.mse_loss(model(x.to(self.device)), y.to(self.device)).item()

    def on_train_epoch_end(self) -> None:
        # Trainer hooks fire after the callbacks', and the validation of this epoch is over: self.model
        # holds the live (training) weights again, the EMA callback holds the average.
        ema = self.ema_callback()
        row = {
            "epoch": self.current_epoch + 1,
            "live": self.val_mse(self.model),
            "ema": self.val_mse(ema.ema_model("model")),
            "val_loss": self.callback_metrics["val_loss"],  # what validation measured: the EMA weights
        }
        self.history.append(row)

    def ema_callback(self) -> EMA:
        return next(cb for cb in self.callbacks if isinstance(cb, EMA))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = EMAConfig()
    p = argparse.ArgumentParser(description="SGD with an EMA of the weights: the averaged vs the live weights.")
    p.add_argument("--epochs", type=int, default=10, help="(default: %(default)s)")
    p.add_argument("--decay", type=float, default=0.995, help="EMA decay per step (default: %(default)s)")
    p.add_argument("--n-train", type=int, default=defaults.n_train, help="(default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="(default: %(default)s)")
    p.add_argument("--lr", type=float, default=defaults.learning_rate, help="constant SGD LR (default: %(default)s)")
    p.add_argument("--noise", type=float, default=defaults.noise, help="std of the target noise (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seeds the data and the training run (default: %(default)s)")
    p.add_argument("--root-dir", default="runs/ema", help="(default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="print only the final comparison")
    # Splitting ops this small across threads costs more than it saves (and oversubscribes shared CPUs).
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train; return the final val MSE of the live and the EMA weights, the first epoch's, the loss of
    predicting the mean, and `max_weight_diff` (largest |live - ema| over all parameters)."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    # Updated after every step, for every model with trainable parameters; swapped in for validation.
    ema = EMA(decay=args.decay)
    config = EMAConfig(
        n_epochs=args.epochs,
        seed=args.seed,
        data_seed=args.seed,
        n_train=args.n_train,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        noise=args.noise,
        root_dir=args.root_dir,
        callbacks=[ema],
        print_epoch_summary=False,  # the table below has the numbers that matter here
        enable_progress_bar=not args.quiet,
    )
    trainer = RegressionTrainer(config)
    start = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - start

    if not args.quiet:
        print(f"val MSE per epoch (noise-free targets), EMA decay {args.decay}, {ema.num_updates} updates:")
        print("  epoch   live weights   EMA weights   val_loss (validation ran with the EMA)")
        for row in trainer.history:
            print(f"  {row['epoch']:5d}   {row['live']:12.5f}   {row['ema']:11.5f}   {row['val_loss']:.5f}")

    live_sd = trainer.model.state_dict()
    ema_sd = ema.ema_state_dict()["model"]  # ready for model.load_state_dict
    max_diff = max((live_sd[k] - ema_sd[k]).abs().max().item() for k in live_sd)
    path = Path(args.root_dir) / "ema_weights.pt"
    torch.save(ema_sd, path)

    _, y_val = trainer.val_data
    last, first = trainer.history[-1], trainer.history[0]
    results = {
        "live_val_loss": last["live"],
        "ema_val_loss": last["ema"],
        "val_loss": last["val_loss"],
        "first_epoch_live_val_loss": first["live"],
        "mean_baseline_val_loss": y_val.var(unbiased=False).item(),  # predicting the mean everywhere
        "max_weight_diff": max_diff,
        "ema_updates": ema.num_updates,
        "global_step": trainer.global_step,
        "wall_s": wall,
    }
    change = last["ema"] / last["live"] - 1
    # Early in a run the average lags behind weights that are still improving fast: it can be worse.
    verdict = f"{-change:.0%} lower" if change < 0 else f"{change:.0%} higher: the average still lags behind"
    print(
        f"done: val MSE live weights {last['live']:.5f} | EMA weights {last['ema']:.5f} "
        f"({verdict}) | predicting the mean: "
        f"{results['mean_baseline_val_loss']:.4f} | largest |live - ema| weight difference {max_diff:.4f} | "
        f"{trainer.global_step} steps in {wall:.1f}s"
    )
    print(f"EMA weights saved to {path}")
    return results


if __name__ == "__main__":
    main()
