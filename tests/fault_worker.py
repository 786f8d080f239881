"""One training run with large checkpoints, for tests/test_faults.py: the test SIGKILLs it while a
checkpoint is being written, then resumes it with `--resume` and compares with an uninterrupted run.

    python tests/fault_worker.py --root-dir DIR --out final.pt                 # checkpoints every 4 steps
    python tests/fault_worker.py --root-dir DIR --out final.pt --resume        # fit(ckpt_path="last")
    python tests/fault_worker.py --root-dir DIR --out ref.pt --no-checkpoints  # the uninterrupted reference

The model is small but carries a large persistent buffer (`--ballast-mb`), so each checkpoint takes a
while to write while a training step stays cheap. The data loader shuffles from torch's global RNG and
the model has dropout, so an inexact resume would show. The final state goes to `--out`.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig, ModelCheckpoint


class Ballasted(nn.Module):
    def __init__(self, ballast_mb: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
        self.register_buffer("ballast", torch.arange(ballast_mb * (1 << 18), dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class FaultTrainer(DreamTrainer):
    def __init__(self, config: DreamTrainerConfig, ballast_mb: int) -> None:
        super().__init__(config)
        self.ballast_mb = ballast_mb

    def configure_models(self) -> None:
        self.model = Ballasted(self.ballast_mb)  # after fit() seeded the RNGs: the same start every run

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def configure_dataloaders(self) -> Any:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(64, 8, generator=g)
        y = torch.sin(x.sum(1, keepdim=True))
        return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True), None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.mse_loss(self.model(x), y)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--no-checkpoints", action="store_true")
    p.add_argument("--ballast-mb", type=int, default=96)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the same kernels in every process
    callbacks = [] if args.no_checkpoints else [ModelCheckpoint(every_n_train_steps=4, save_top_k=1, save_last=True)]
    config = DreamTrainerConfig(
        seed=0, n_epochs=args.epochs, device="cpu", root_dir=args.root_dir, loggers=[], enable_progress_bar=False,
        print_epoch_summary=False, enable_checkpointing=not args.no_checkpoints, callbacks=callbacks,
    )  # fmt: skip
    trainer = FaultTrainer(config, args.ballast_mb)
    trainer.fit(ckpt_path="last" if args.resume else None)
    opt = {
        f"{i}.{k}": v.clone() for i, s in trainer.optimizer.state_dict()["state"].items() for k, v in s.items()
    }  # fmt: skip
    net = {k: v.clone() for k, v in trainer.model.net.state_dict().items()}
    torch.save(
        {"net": net, "optimizer": opt, "global_step": trainer.global_step, "rng": torch.get_rng_state()}, args.out
    )


if __name__ == "__main__":
    main()
