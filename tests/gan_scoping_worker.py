"""A GAN whose losses are kept to their optimizers, under DDP and FSDP2, for tests/test_gan_scoping.py.

    torchrun --standalone --nproc_per_node 2 tests/gan_scoping_worker.py --out-dir DIR

The generator steps first (Lightning's GAN example order), so a generator loss that reached the
discriminator's gradients would move the discriminator. Each case trains the same GAN (`build_gan`,
also used by the test for its one-process reference) for 2 epochs of 4 batches of 8 samples per rank
(16 in the one-process reference); rank 0 saves the full weights of each case to `DIR/<case>.pt`. A
case that raises saves the message to `DIR/<case>.error` (the FSDP2 `optimizer=` case must); a crash
writes `DIR/error.<rank>`.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig

CASES = {  # name: (strategy, scope, gradient_accumulation_steps)
    "ddp-toggle": ("ddp", "toggle", 1),
    "ddp-optimizer": ("ddp", "optimizer=", 1),
    "ddp-optimizer-accumulate": ("ddp", "optimizer=", 2),
    "fsdp-toggle": ("fsdp", "toggle", 1),
    "fsdp-toggle-accumulate": ("fsdp", "toggle", 2),
    "fsdp-optimizer": ("fsdp", "optimizer=", 1),
}
N_SAMPLES = 64


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N_SAMPLES, 2, generator=g) * 0.5 + 1.0, torch.randn(N_SAMPLES, 4, generator=g))


class ScopedGAN(DreamTrainer):
    """Generator first; `scope` is "toggle", "optimizer=" or "none" (the leak)."""

    def __init__(self, config: DreamTrainerConfig, scope: str, batch_size: int) -> None:
        super().__init__(config)
        self.scope, self.batch_size = scope, batch_size

    def configure_models(self) -> None:
        torch.manual_seed(1)
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

    def configure_optimizers(self) -> None:
        self.g_optimizer = torch.optim.SGD(self.generator.parameters(), lr=0.1)
        self.d_optimizer = torch.optim.SGD(self.discriminator.parameters(), lr=0.1)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        return DataLoader(data(), batch_size=self.batch_size), None

    def _train(self, optimizer: torch.optim.Optimizer, loss_fn: Any) -> None:
        if self.scope == "toggle":
            with self.toggle_optimizer(optimizer):
                self.backward(loss_fn())
        elif self.scope == "optimizer=":
            self.backward(loss_fn(), optimizer=optimizer)
        else:
            self.backward(loss_fn())
        self.step(optimizer)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, z = batch
        g, d = self.generator, self.discriminator
        self._train(self.g_optimizer, lambda: F.softplus(-d(g(z))).mean())
        self._train(self.d_optimizer, lambda: (F.softplus(-d(real)) + F.softplus(d(g(z).detach()))).mean())


def build_gan(root: Path, strategy: str, scope: str, accumulate: int, batch_size: int) -> ScopedGAN:
    config = DreamTrainerConfig(
        root_dir=str(root),
        device="cpu",
        seed=0,
        strategy=strategy,
        n_epochs=2,
        gradient_accumulation_steps=accumulate,
        loggers=[],
        enable_checkpointing=False,
        enable_progress_bar=False,
        print_epoch_summary=False,
    )
    return ScopedGAN(config, scope, batch_size)


def full_weights(trainer: ScopedGAN) -> dict[str, torch.Tensor]:
    """Every rank calls it (gathering a sharded parameter is a collective)."""
    out = {}
    for prefix, model in (("g", trainer.generator), ("d", trainer.discriminator)):
        for name, value in model.state_dict().items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            out[f"{prefix}.{name.removeprefix('module.')}"] = full.detach().clone()
    return out


def run(out_dir: Path) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    for case, (strategy, scope, accumulate) in CASES.items():
        trainer = build_gan(out_dir / "root" / case, strategy, scope, accumulate, batch_size=N_SAMPLES // 8)
        try:
            trainer.fit()
        except Exception as exc:  # the case that must fail: every rank raises it at the same step
            if rank == 0:
                (out_dir / f"{case}.error").write_text(f"{type(exc).__name__}: {exc}")
            continue
        weights = full_weights(trainer)
        if rank == 0:
            torch.save(weights, out_dir / f"{case}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()
    try:
        run(args.out_dir)
    except Exception:
        (args.out_dir / f"error.{os.environ.get('RANK', '0')}").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    sys.exit(main())
