"""One training run mirrored to an object store, for tests/test_mirror_s3.py, started as a user starts one:

    python tests/mirror_worker.py --root DIR --url s3://bucket/prefix --run-name NAME --out FILE [--pace S]

`fit(ckpt_path="last")` in `--root` (an empty directory: a fresh machine, which continues from the store) with
`mirror=--url` (the S3 endpoint and credentials from the standard AWS_* environment variables). A small MLP with
Dropout, AdamW, 96 shuffled samples in batches of 4 (24 steps an epoch), `--epochs` epochs; a checkpoint every
4 steps (the 2 newest kept: rotation deletes in the store too), a CSVLogger logging every step. Each step sleeps
`--pace` seconds, so a test can kill the run at chosen moments. At the end it writes `--out`: the model's and the
optimizer's state. `--url none`: no mirror (the uninterrupted reference).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig, MirrorConfig
from dream_trainer.callbacks import ModelCheckpoint
from dream_trainer.loggers import CSVLogger

EPOCHS = 3


class Mirrored(DreamTrainer):
    pace = 0.0

    def configure_models(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def configure_dataloaders(self) -> Any:
        g = torch.Generator().manual_seed(5)
        data = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
        return DataLoader(data, batch_size=4, shuffle=True), None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.pace:
            import time

            time.sleep(self.pace)
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.log("loss", loss)
        return loss


def config(root: str, url: str | None, run_name: str, epochs: int = EPOCHS) -> DreamTrainerConfig:
    mirror = None if url is None else MirrorConfig(url=url, retries=8, backoff_s=0.05, sync_every_s=1.0)
    return DreamTrainerConfig(
        device="cpu", n_epochs=epochs, seed=7, root_dir=root, run_name=run_name, mirror=mirror,
        log_every_n_steps=1, loggers=[CSVLogger()], enable_progress_bar=False, print_epoch_summary=False,
        num_sanity_val_steps=0, callbacks=[ModelCheckpoint(every_n_train_steps=4, save_top_k=2, save_last=True)],
    )  # fmt: skip


def final_state(trainer: Mirrored) -> dict[str, Any]:
    return {"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
            "global_step": trainer.global_step}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--run-name", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--pace", type=float, default=0.0)
    args = parser.parse_args()
    trainer = Mirrored(config(args.root, None if args.url == "none" else args.url, args.run_name, args.epochs))
    trainer.pace = args.pace
    trainer.fit(ckpt_path="last")
    torch.save(final_state(trainer), args.out)


if __name__ == "__main__":
    main()
