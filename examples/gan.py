"""A GAN that learns a ring of 8 Gaussians in 2-D, with two models and two optimizers stepped by hand.

    python examples/gan.py                # 10-30 s on 2 CPU cores
    python examples/gan.py --epochs 2

`training_step` updates the discriminator, then the generator, calling `self.backward` and
`self.step(optimizer)` itself (the Trainer Guide's multi-model style). Each loss is backpropagated for
its own optimizer (`self.backward(loss, optimizer=...)`), so the generator loss that flows back through
the discriminator never reaches the discriminator's update, in either order (Lightning's
`toggle_optimizer`, `with self.toggle_optimizer(opt):`, does the same). The trainer zeroes both
optimizers' gradients at the start of every step and advances `global_step` once per batch, not once
per optimizer.

Quality measure: the mean distance of generated points to the nearest of the 8 modes, before and after
training. An untrained generator puts its points in a blob near the origin, far from the ring.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig

N_MODES = 8
RADIUS = 2.0


def ring_modes() -> torch.Tensor:
    """The 8 centres `(8, 2)`, evenly spaced on a circle."""
    angles = torch.arange(N_MODES) * (2 * math.pi / N_MODES)
    return RADIUS * torch.stack([angles.cos(), angles.sin()], dim=1)


def sample_ring(n: int, seed: int, std: float = 0.05) -> torch.Tensor:
    """`n` points `(n, 2)` from the mixture of 8 Gaussians, deterministic in `seed`."""
    g = torch.Generator().manual_seed(seed)
    which = torch.randint(N_MODES, (n,), generator=g)
    return ring_modes()[which] + std * torch.randn(n, 2, generator=g)


def mode_stats(points: torch.Tensor) -> dict[str, float]:
    """Mean distance to the nearest mode, and how many modes get at least 2% of the points
    (within 4 * 0.05 of a centre)."""
    dist = torch.cdist(points, ring_modes())  # (n, 8)
    nearest, which = dist.min(dim=1)
    close = nearest < 0.2
    counts = torch.bincount(which[close], minlength=N_MODES)
    return {
        "mode_distance": nearest.mean().item(),
        "modes_covered": int((counts >= 0.02 * len(points)).sum()),
        "high_quality_fraction": close.float().mean().item(),
    }


def mlp(n_in: int, n_out: int, width: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(n_in, width),
        nn.LeakyReLU(0.2),
        nn.Linear(width, width),
        nn.LeakyReLU(0.2),
        nn.Linear(width, n_out),
    )


@dataclass
class GANConfig(DreamTrainerConfig):
    g_lr: float = 1e-3
    d_lr: float = 1e-3
    latent_dim: int = 2
    width: int = 128
    batch_size: int = 128
    n_train: int = 16384
    data_seed: int = 0


class GANTrainer(DreamTrainer):
    config: GANConfig

    def __init__(self, config: GANConfig) -> None:
        super().__init__(config)
        self.quality_before: dict[str, float] = {}

    def configure_models(self) -> None:
        # Built here rather than in __init__: fit() seeds the RNGs (config.seed) just before this runs,
        # so the initial weights are the same on every run. Both models are found by attribute name.
        cfg = self.config
        self.generator = mlp(cfg.latent_dim, 2, cfg.width)
        self.discriminator = mlp(2, 1, cfg.width)

    def configure_optimizers(self) -> None:
        cfg = self.config
        # beta1 = 0.5 is the usual choice for GANs: less momentum, steadier adversarial updates.
        self.g_optimizer = torch.optim.Adam(self.generator.parameters(), lr=cfg.g_lr, betas=(0.5, 0.999))
        self.d_optimizer = torch.optim.Adam(self.discriminator.parameters(), lr=cfg.d_lr, betas=(0.5, 0.999))

    def configure_dataloaders(self) -> tuple[DataLoader, None]:
        real = sample_ring(self.config.n_train, seed=self.config.data_seed)
        # drop_last: every step sees a full batch; an epoch is n_train // batch_size steps.
        return DataLoader(TensorDataset(real), batch_size=self.config.batch_size, shuffle=True, drop_last=True), None

    def sample(self, n: int) -> torch.Tensor:
        z = torch.randn(n, self.config.latent_dim, device=self.device)
        return self.generator(z)

    def evaluate(self, n: int = 4096, seed: int = 1234) -> dict[str, float]:
        """Quality of `n` generated points, from fixed latent noise (comparable across calls)."""
        z = torch.randn(n, self.config.latent_dim, generator=torch.Generator().manual_seed(seed))
        was_training = self.generator.training
        self.generator.eval()
        with torch.no_grad():
            points = self.generator(z.to(self.device)).cpu()
        self.generator.train(was_training)
        return mode_stats(points)

    def on_fit_start(self) -> None:
        # A trainer hook: runs once models are built and placed, before any training.
        self.quality_before = self.evaluate()

    def training_step(self, batch, batch_idx):
        (real,) = batch
        n = real.shape[0]
        ones = torch.ones(n, 1, device=self.device)
        zeros = torch.zeros(n, 1, device=self.device)
        fake = self.sample(n)

        # 1) Discriminator: real -> 1, fake -> 0. `detach` keeps this loss out of the generator.
        d_real = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
        d_fake = F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros)
        d_loss = d_real + d_fake
        self.backward(d_loss, optimizer=self.d_optimizer)
        self.step(self.d_optimizer)

        # 2) Generator: make the (just updated) discriminator call the fakes real. The loss flows back
        #    through the discriminator; `optimizer=` computes gradients for the generator's parameters only.
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        self.backward(g_loss, optimizer=self.g_optimizer)
        self.step(self.g_optimizer)

        # Both losses were backpropagated above, so the trainer adds no backward or step; it logs these.
        return {"d_loss": d_loss, "g_loss": g_loss}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = GANConfig()
    p = argparse.ArgumentParser(description="Train a GAN on a ring of 8 Gaussians.")
    p.add_argument("--epochs", type=int, default=30, help="(default: %(default)s)")
    p.add_argument("--n-train", type=int, default=defaults.n_train, help="real points per epoch (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--root-dir", default="runs/gan", help="(default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no per-epoch summary lines")
    # Splitting ops this small across threads costs more than it saves (and oversubscribes shared CPUs).
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train; return the quality before/after, the last losses, global_step and batches seen."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    config = GANConfig(
        n_epochs=args.epochs,
        seed=args.seed,
        data_seed=args.seed,
        n_train=args.n_train,
        batch_size=args.batch_size,
        root_dir=args.root_dir,
        print_epoch_summary=not args.quiet,
    )
    trainer = GANTrainer(config)

    start = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - start

    before, after = trainer.quality_before, trainer.evaluate()
    batches_per_epoch = config.n_train // config.batch_size
    results = {
        "mode_distance_before": before["mode_distance"],
        "mode_distance": after["mode_distance"],
        "modes_covered": after["modes_covered"],
        "high_quality_fraction": after["high_quality_fraction"],
        "global_step": trainer.global_step,
        "batches": batches_per_epoch * config.n_epochs,
        "wall_s": wall,
        **{k: float(v) for k, v in trainer.callback_metrics.items()},
    }
    print(
        f"done: mean distance to nearest mode {before['mode_distance']:.3f} -> {after['mode_distance']:.3f} | "
        f"{after['modes_covered']}/{N_MODES} modes covered | {after['high_quality_fraction']:.0%} of samples "
        f"near a mode | {trainer.global_step} steps | {wall:.1f}s"
    )
    return results


if __name__ == "__main__":
    main()
