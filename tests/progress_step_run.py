"""A small step-based run for the progress tests (run as a script, in a pseudo-terminal or piped).

    python tests/progress_step_run.py --max-steps 24 --val-every 8            # one epoch of 40 batches, cut at 24
    python tests/progress_step_run.py --stop-at 30 --epochs 3 --max-steps 90  # saves mid-epoch and stops
    python tests/progress_step_run.py --resume PATH ...                        # continues from that checkpoint

Each training batch sleeps `--batch-seconds`, so that the display has time to draw.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import Callback, DreamTrainer, DreamTrainerConfig
from dream_trainer.callbacks import TextProgress


class Regression(DreamTrainer):
    def __init__(self, config: DreamTrainerConfig, batches: int, batch_seconds: float) -> None:
        super().__init__(config)
        self.batches = batches
        self.batch_seconds = batch_seconds
        self.model = torch.nn.Linear(4, 1)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)

    def configure_dataloaders(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.batches * 4, 4, generator=g)
        data = TensorDataset(x, x.sum(1, keepdim=True))
        return DataLoader(data, batch_size=4, shuffle=True), DataLoader(data, batch_size=16)

    def training_step(self, batch, batch_idx):
        time.sleep(self.batch_seconds)
        x, y = batch
        return {"loss": F.mse_loss(self.model(x), y)}

    def validation_step(self, batch, batch_idx):
        time.sleep(self.batch_seconds)
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y)}


class SaveAndStop(Callback):
    """At step `at`: write a checkpoint to `path`, then end the process as a crash would."""

    def __init__(self, at: int, path: str) -> None:
        self.at, self.path = at, path

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            trainer.save_checkpoint(self.path)
            raise SystemExit(3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, default=40, help="training batches per epoch")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--val-every", type=int, default=None)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--batch-seconds", type=float, default=0.02)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--text-every", type=int, default=None, help="attach TextProgress(every_n_batches=N)")
    p.add_argument("--root-dir", default="runs")
    args = p.parse_args()
    callbacks: list[Callback] = [SaveAndStop(args.stop_at, "mid.ckpt")] if args.stop_at else []
    if args.text_every:
        callbacks.append(TextProgress(every_n_batches=args.text_every, every_n_seconds=None))
    config = DreamTrainerConfig(
        n_epochs=args.epochs,
        max_steps=args.max_steps,
        val_every_n_steps=args.val_every,
        log_every_n_steps=args.log_every,
        num_sanity_val_steps=0,
        loggers=[],
        enable_checkpointing=False,
        root_dir=args.root_dir,
        device="cpu",
        callbacks=callbacks,
    )
    torch.set_num_threads(1)
    Regression(config, args.batches, args.batch_seconds).fit(ckpt_path=args.resume)


if __name__ == "__main__":
    main()
