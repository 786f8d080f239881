"""A classifier whose validation metrics are torchmetrics objects: accuracy, macro F1, a MetricCollection
of precision and recall, and a confusion matrix.

    python examples/torchmetrics_classifier.py              # ~10 s on 2 CPU cores
    python examples/torchmetrics_classifier.py --epochs 2 --n-train 2048

The data: points in 16-D drawn around two centres per class (5 classes; a class's two centres lie on
opposite sides of the origin, so no linear model separates the classes), generated from `--seed`. The
classes are imbalanced (the most common is 8 times as frequent as the rarest), which is why macro F1
(every class counts the same) is reported next to accuracy (every sample counts the same).

What the trainer does with torchmetrics attributes: it finds every `Metric` / `MetricCollection`
assigned to it, moves it to the device, resets it when its phase starts and computes it when the phase
ends. Names starting with `train` belong to the training epoch, all others to validation. Scalar
results land in `trainer.callback_metrics` (and the loggers) under the attribute name, a collection's
under its own keys. Non-scalar results (the confusion matrix) are not logged, but the metric keeps its
state after `fit()`, so it can be computed and printed at the end.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MetricCollection
from torchmetrics.classification import (
    MulticlassAccuracy,
    MulticlassConfusionMatrix,
    MulticlassF1Score,
    MulticlassPrecision,
    MulticlassRecall,
)

from dream_trainer import DreamTrainer, DreamTrainerConfig

N_CLASSES = 5
N_FEATURES = 16


def make_blobs(n: int, seed: int, spread: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` points `(n, 16)` and labels `(n,)`. Each class is two clusters on opposite sides of the
    origin, so no linear model separates them. The centres come from a fixed seed, so train and
    validation sets (different `seed`s) share them; class k is drawn with probability ~ 0.6**k."""
    centres = torch.randn(N_CLASSES, N_FEATURES, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed)
    freq = 0.6 ** torch.arange(N_CLASSES).float()  # 1, 0.6, 0.36, 0.22, 0.13: imbalanced
    labels = torch.multinomial(freq / freq.sum(), n, replacement=True, generator=g)
    side = torch.randint(0, 2, (n, 1), generator=g) * 2 - 1  # which of the class's two clusters
    x = side * centres[labels] + spread * torch.randn(n, N_FEATURES, generator=g)
    return x, labels


@dataclass
class MetricsConfig(DreamTrainerConfig):
    learning_rate: float = 3e-3
    batch_size: int = 64
    n_train: int = 8192
    n_val: int = 2048
    spread: float = 1.0
    data_seed: int = 0


class MetricsClassifier(DreamTrainer):
    config: MetricsConfig

    def __init__(self, config: MetricsConfig) -> None:
        super().__init__(config)
        # Assigning them is all it takes. `val_*`: computed once per validation run (not per batch,
        # which matters for F1: the mean of per-batch F1 scores is not the F1 score of the whole set).
        self.val_accuracy = MulticlassAccuracy(num_classes=N_CLASSES, average="micro")
        self.val_f1 = MulticlassF1Score(num_classes=N_CLASSES, average="macro")
        # A collection is logged under its own keys: prefix + name -> val_precision, val_recall.
        self.val_pr = MetricCollection(
            {
                "precision": MulticlassPrecision(num_classes=N_CLASSES, average="macro"),
                "recall": MulticlassRecall(num_classes=N_CLASSES, average="macro"),
            },
            prefix="val_",
        )
        # Not a scalar: computed but not logged. Read it yourself after fit().
        self.val_confusion = MulticlassConfusionMatrix(num_classes=N_CLASSES)
        # The name starts with "train": computed over each training epoch (reset at every epoch start).
        self.train_accuracy = MulticlassAccuracy(num_classes=N_CLASSES, average="micro")

    def configure_models(self) -> None:
        self.model = nn.Sequential(nn.Linear(N_FEATURES, 64), nn.ReLU(), nn.Linear(64, N_CLASSES))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.config.learning_rate)

    def configure_dataloaders(self) -> tuple[DataLoader, DataLoader]:
        cfg = self.config
        train = TensorDataset(*make_blobs(cfg.n_train, seed=cfg.data_seed, spread=cfg.spread))
        val = TensorDataset(*make_blobs(cfg.n_val, seed=cfg.data_seed + 1, spread=cfg.spread))
        return DataLoader(train, batch_size=cfg.batch_size, shuffle=True), DataLoader(val, batch_size=512)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        self.train_accuracy.update(logits.detach(), y)  # accumulates on the device: no sync per step
        return {"loss": F.cross_entropy(logits, y)}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        for metric in (self.val_accuracy, self.val_f1, self.val_pr, self.val_confusion):
            metric.update(logits, y)
        return {"val_loss": F.cross_entropy(logits, y)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = MetricsConfig()
    p = argparse.ArgumentParser(description="A 5-class classifier with torchmetrics validation metrics.")
    p.add_argument("--epochs", type=int, default=8, help="(default: %(default)s)")
    p.add_argument("--n-train", type=int, default=defaults.n_train, help="(default: %(default)s)")
    p.add_argument("--n-val", type=int, default=defaults.n_val, help="(default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="(default: %(default)s)")
    p.add_argument("--lr", type=float, default=defaults.learning_rate, help="(default: %(default)s)")
    p.add_argument("--spread", type=float, default=defaults.spread, help="std of the points around their centre")
    p.add_argument("--seed", type=int, default=0, help="seeds the data and the training run (default: %(default)s)")
    p.add_argument("--root-dir", default="runs/torchmetrics_classifier", help="(default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no per-epoch summary lines")
    # Splitting ops this small across threads costs more than it saves (and oversubscribes shared CPUs).
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train; return `callback_metrics` (val_accuracy, val_f1, val_precision, val_recall, train_accuracy,
    loss, val_loss) plus global_step and wall_s."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    config = MetricsConfig(
        n_epochs=args.epochs,
        seed=args.seed,
        data_seed=args.seed,
        n_train=args.n_train,
        n_val=args.n_val,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        spread=args.spread,
        root_dir=args.root_dir,
        print_epoch_summary=not args.quiet,  # the summary shows the torchmetrics values with the others
        enable_progress_bar=not args.quiet,
    )
    trainer = MetricsClassifier(config)
    start = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - start

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    metrics.update(global_step=trainer.global_step, wall_s=wall)
    print(
        f"done: val_accuracy {metrics['val_accuracy']:.2%} | val_f1 (macro) {metrics['val_f1']:.3f} | "
        f"val_precision {metrics['val_precision']:.3f} | val_recall {metrics['val_recall']:.3f} | "
        f"train_accuracy (last epoch) {metrics['train_accuracy']:.2%} | {wall:.1f}s"
    )
    # The last validation's state is still in the metric: rows are true classes, columns predictions.
    confusion = trainer.val_confusion.compute().cpu()
    print("confusion matrix of the last validation (rows: true class, columns: predicted):")
    for k, row in enumerate(confusion.tolist()):
        print(f"  class {k} ({int(sum(row)):4d} samples): " + " ".join(f"{v:5d}" for v in row))
    return metrics


if __name__ == "__main__":
    main()
