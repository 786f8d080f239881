"""Train a small CNN to tell four shapes apart, on images it draws itself.

    python examples/classifier.py                 # the full run: 10-30 s on 2 CPU cores
    python examples/classifier.py --epochs 2 --n-train 1024

The data are 16x16 grayscale images of a filled square, a disk, a plus-shaped cross or a horizontal
bar, drawn at a random position and size and covered in noise. They are generated from `--seed`, so
every run sees the same images and nothing is downloaded.

What the trainer does for us: seeding, putting the model on the device, the backward/step/zero-grad
calls (here `training_step` just returns the loss), stepping the LR scheduler once per epoch,
validation after every epoch, a progress bar, TensorBoard logs, a checkpoint per epoch, and the
one-line epoch summaries. It ends by printing where the logs and checkpoints are.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig

CLASSES = ("square", "disk", "cross", "bar")
SIZE = 16


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------
def make_shapes(n: int, seed: int, noise: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` images `(n, 1, 16, 16)` and their labels `(n,)`, drawn deterministically from `seed`."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % len(CLASSES)  # balanced classes...
    labels = labels[torch.randperm(n, generator=g)]  # ...in random order

    def uniform(low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(n, 1, 1, generator=g)

    # Every shape is a boolean mask over a pixel grid, computed for all n images at once.
    ys, xs = torch.meshgrid(torch.arange(SIZE).float(), torch.arange(SIZE).float(), indexing="ij")
    cy, cx = uniform(5.0, 10.0), uniform(5.0, 10.0)  # centre
    half = uniform(3.0, 5.5)  # half of the shape's extent
    dy, dx = (ys - cy).abs(), (xs - cx).abs()

    square = (dy <= half) & (dx <= half)
    disk = (ys - cy) ** 2 + (xs - cx) ** 2 <= (half + 0.5) ** 2
    arm = uniform(0.6, 1.1)  # half-thickness of the cross's arms and of the bar
    cross = ((dy <= arm) & (dx <= half + 0.5)) | ((dx <= arm) & (dy <= half + 0.5))
    bar = (dy <= arm) & (dx <= half + 2.0)

    masks = torch.stack([square, disk, cross, bar], dim=1)  # (n, 4, 16, 16)
    image = masks[torch.arange(n), labels].float()
    brightness = uniform(0.6, 1.0)
    image = image * brightness + noise * torch.randn(n, SIZE, SIZE, generator=g)
    return image.unsqueeze(1), labels


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------
class SmallCNN(nn.Module):
    def __init__(self, n_classes: int = len(CLASSES), width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 16 -> 8
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8 -> 4
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * width * 4 * 4, 64), nn.ReLU(), nn.Linear(64, n_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


# --------------------------------------------------------------------------------------------------
# Config and trainer
# --------------------------------------------------------------------------------------------------
@dataclass
class ClassifierConfig(DreamTrainerConfig):
    """The trainer's settings (n_epochs, seed, root_dir, ...) plus this task's own."""

    learning_rate: float = 3e-3
    weight_decay: float = 1e-4
    batch_size: int = 64
    n_train: int = 8192
    n_val: int = 1024
    noise: float = 0.3
    data_seed: int = 0


class ClassifierTrainer(DreamTrainer):
    config: ClassifierConfig

    def configure_models(self) -> None:
        # fit() seeds the RNGs (config.seed) just before this runs: the same initial weights every run.
        # Assigning to self is all it takes: the trainer finds the model by attribute and moves it to
        # the device before configure_optimizers.
        self.model = SmallCNN()

    def configure_optimizers(self) -> None:
        cfg = self.config
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        # Schedulers step once per epoch by default, so T_max is counted in epochs.
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=cfg.n_epochs)

    def configure_dataloaders(self) -> tuple[DataLoader, DataLoader]:
        cfg = self.config
        # Train and validation images come from different seeds: no image is in both.
        train = TensorDataset(*make_shapes(cfg.n_train, seed=cfg.data_seed, noise=cfg.noise))
        val = TensorDataset(*make_shapes(cfg.n_val, seed=cfg.data_seed + 1, noise=cfg.noise))
        return (
            DataLoader(train, batch_size=cfg.batch_size, shuffle=True),
            DataLoader(val, batch_size=256),
        )

    def training_step(self, batch, batch_idx):
        images, labels = batch
        logits = self.model(images)
        loss = F.cross_entropy(logits, labels)
        # Returning "loss" without calling self.backward: the trainer backpropagates and steps.
        # Every entry is logged; the epoch summary shows their epoch means.
        return {"loss": loss, "accuracy": (logits.argmax(1) == labels).float().mean()}

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        logits = self.model(images)
        return {
            "val_loss": F.cross_entropy(logits, labels),
            "val_accuracy": (logits.argmax(1) == labels).float().mean(),
        }


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = ClassifierConfig()
    p = argparse.ArgumentParser(description="Train a small CNN on generated 16x16 images of four shapes.")
    p.add_argument("--epochs", type=int, default=10, help="training epochs (default: %(default)s)")
    p.add_argument("--n-train", type=int, default=defaults.n_train, help="training images (default: %(default)s)")
    p.add_argument("--n-val", type=int, default=defaults.n_val, help="validation images (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="(default: %(default)s)")
    p.add_argument("--lr", type=float, default=defaults.learning_rate, help="peak learning rate (default: %(default)s)")
    p.add_argument("--noise", type=float, default=defaults.noise, help="pixel noise std (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seeds the data and the training run (default: %(default)s)")
    p.add_argument("--root-dir", default="runs/classifier", help="output directory (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no per-epoch summary lines")
    # Splitting ops this small across threads costs more than it saves (and oversubscribes shared CPUs).
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train and return the final metrics (val_accuracy, val_loss, global_step, wall_s, ...)."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    config = ClassifierConfig(
        n_epochs=args.epochs,
        seed=args.seed,
        data_seed=args.seed,
        n_train=args.n_train,
        n_val=args.n_val,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        noise=args.noise,
        root_dir=args.root_dir,
        print_epoch_summary=not args.quiet,
    )
    trainer = ClassifierTrainer(config)

    start = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - start

    # callback_metrics holds the latest value of every logged metric: the last epoch's means.
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    metrics.update(global_step=trainer.global_step, epochs=trainer.current_epoch, wall_s=wall)
    print(
        f"done: val_accuracy {metrics['val_accuracy']:.2%} (chance is {1 / len(CLASSES):.0%}) | "
        f"{trainer.global_step} steps in {trainer.current_epoch} epochs | {wall:.1f}s"
    )
    if not args.quiet:
        print(f"logs:        {trainer.log_dir}")
        print(f"checkpoints: {trainer.checkpoint_dir}  (resume with fit(ckpt_path='last'))")
        print(f"curves:      tensorboard --logdir {trainer.log_dir.parent}")
    return metrics


if __name__ == "__main__":
    main()
