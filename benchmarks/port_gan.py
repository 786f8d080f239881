"""A GAN in Lightning's manual-optimization style, ported: two MLPs learning a ring of 8 Gaussians in 2-D,
the generator stepped first as Lightning's GAN example does (`automatic_optimization = False`,
`self.toggle_optimizer(opt_g)`, `self.manual_backward(g_loss)`, `opt_g.step()`, `opt_g.zero_grad()`,
`self.untoggle_optimizer(opt_g)`, then the same for the discriminator), trained by Lightning's `Trainer`
and by two `DreamTrainer` ports of the same body: (a) `with self.toggle_optimizer(self.g_optimizer):` ...
`self.backward(g_loss)`, then `self.step(self.g_optimizer)`; (b) `self.backward(g_loss,
optimizer=self.g_optimizer)`. Same seed, data, models, losses and optimizers (Adam, lr 2e-4, betas
(0.5, 0.999)); the latent noise is drawn in `training_step` from the global RNG, as in the example.
Both ports end with the weights of both models equal to Lightning's (`torch.equal`, fp32, one thread);
this prints the time ratios.

    python benchmarks/port_gan.py [--steps 200] [--rounds 3]

tests/test_port_gan.py runs `compare()` on a few steps and asserts the weights, and shows that the port
without scoping (`self.backward(g_loss)`) trains the discriminator differently from Lightning.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from port_harness import lightning_trainer, main, one_thread, ours_config, same, timed

LATENT, WIDTH, BATCH = 8, 64, 64
LR, BETAS = 2e-4, (0.5, 0.999)  # Lightning's GAN example


def ring_of_gaussians(steps: int) -> DataLoader:
    """`steps` batches of points from 8 Gaussians on a circle of radius 2 (its own generator: the global
    RNG is left to the models and the latent noise)."""
    g = torch.Generator().manual_seed(5)
    n = steps * BATCH
    angles = torch.randint(8, (n,), generator=g) * (2 * math.pi / 8)
    real = 2.0 * torch.stack([angles.cos(), angles.sin()], dim=1) + 0.05 * torch.randn(n, 2, generator=g)
    return DataLoader(TensorDataset(real), batch_size=BATCH)


def generator() -> nn.Module:
    return nn.Sequential(
        nn.Linear(LATENT, WIDTH), nn.LeakyReLU(0.2), nn.Linear(WIDTH, WIDTH), nn.LeakyReLU(0.2), nn.Linear(WIDTH, 2)
    )


def discriminator() -> nn.Module:
    return nn.Sequential(
        nn.Linear(2, WIDTH), nn.LeakyReLU(0.2), nn.Linear(WIDTH, WIDTH), nn.LeakyReLU(0.2), nn.Linear(WIDTH, 1)
    )


def adversarial_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, target)


def weights(g: nn.Module, d: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{name}.{k}": v for name, m in (("generator", g), ("discriminator", d)) for k, v in m.state_dict().items()}


# --- Lightning: manual optimization, generator first ----------------------------------------------------
def run_lightning(steps: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], float]:
    """Train `steps` batches (`max_steps=2 * steps`); the weights of both models and the seconds."""
    import lightning as L

    class GAN(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.generator = generator()
            self.discriminator = discriminator()

        def forward(self, z: torch.Tensor) -> torch.Tensor:
            return self.generator(z)

        def training_step(self, batch: Any) -> None:
            (real,) = batch
            optimizer_g, optimizer_d = self.optimizers()
            z = torch.randn(real.shape[0], LATENT).type_as(real)

            # train generator
            self.toggle_optimizer(optimizer_g)
            valid = torch.ones(real.size(0), 1).type_as(real)
            g_loss = adversarial_loss(self.discriminator(self(z)), valid)
            self.log("g_loss", g_loss, prog_bar=True)
            self.manual_backward(g_loss)
            optimizer_g.step()
            optimizer_g.zero_grad()
            self.untoggle_optimizer(optimizer_g)

            # train discriminator
            self.toggle_optimizer(optimizer_d)
            real_loss = adversarial_loss(self.discriminator(real), valid)
            fake = torch.zeros(real.size(0), 1).type_as(real)
            fake_loss = adversarial_loss(self.discriminator(self(z).detach()), fake)
            d_loss = (real_loss + fake_loss) / 2
            self.log("d_loss", d_loss, prog_bar=True)
            self.manual_backward(d_loss)
            optimizer_d.step()
            optimizer_d.zero_grad()
            self.untoggle_optimizer(optimizer_d)

        def configure_optimizers(self) -> Any:
            opt_g = torch.optim.Adam(self.generator.parameters(), lr=LR, betas=BETAS)
            opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=LR, betas=BETAS)
            return [opt_g, opt_d], []

        def train_dataloader(self) -> DataLoader:
            return ring_of_gaussians(steps)

    L.seed_everything(seed, verbose=False)
    module = GAN()
    trainer = lightning_trainer(2 * steps)  # Lightning counts optimizer steps: two per batch here
    seconds = timed(lambda: trainer.fit(module))
    return weights(module.generator, module.discriminator), seconds


# --- the ports -------------------------------------------------------------------------------------------
class PortedGAN(DreamTrainer):
    """(a) The example's body with `toggle_optimizer` as a `with` block. No `zero_grad()`: the trainer
    zeroes both optimizers' gradients before every batch (set_to_none, as Lightning's `zero_grad()`), and
    nothing reads a gradient between a step and that zeroing. No `automatic_optimization = False`:
    calling `self.step(...)` is what makes a step manual."""

    def __init__(self, config: DreamTrainerConfig, steps: int) -> None:
        super().__init__(config)
        self.steps = steps

    def configure_models(self) -> None:
        self.generator = generator()
        self.discriminator = discriminator()

    def configure_optimizers(self) -> None:
        self.g_optimizer = torch.optim.Adam(self.generator.parameters(), lr=LR, betas=BETAS)
        self.d_optimizer = torch.optim.Adam(self.discriminator.parameters(), lr=LR, betas=BETAS)

    def configure_dataloaders(self) -> tuple[DataLoader, None]:
        return ring_of_gaussians(self.steps), None

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        z = torch.randn(real.shape[0], LATENT).type_as(real)

        # train generator
        with self.toggle_optimizer(self.g_optimizer):
            valid = torch.ones(real.size(0), 1).type_as(real)
            g_loss = adversarial_loss(self.discriminator(self(z)), valid)
            self.log("g_loss", g_loss, prog_bar=True)
            self.backward(g_loss)
        self.step(self.g_optimizer)

        # train discriminator
        with self.toggle_optimizer(self.d_optimizer):
            real_loss = adversarial_loss(self.discriminator(real), valid)
            fake = torch.zeros(real.size(0), 1).type_as(real)
            fake_loss = adversarial_loss(self.discriminator(self(z).detach()), fake)
            d_loss = (real_loss + fake_loss) / 2
            self.log("d_loss", d_loss, prog_bar=True)
            self.backward(d_loss)
        self.step(self.d_optimizer)


class PortedGANOptimizerScoped(PortedGAN):
    """(b) Each loss backpropagated for its own optimizer's parameters only (`loss.backward(inputs=...)`),
    no `requires_grad` toggling."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        z = torch.randn(real.shape[0], LATENT).type_as(real)

        valid = torch.ones(real.size(0), 1).type_as(real)
        g_loss = adversarial_loss(self.discriminator(self(z)), valid)
        self.log("g_loss", g_loss, prog_bar=True)
        self.backward(g_loss, optimizer=self.g_optimizer)
        self.step(self.g_optimizer)

        real_loss = adversarial_loss(self.discriminator(real), valid)
        fake = torch.zeros(real.size(0), 1).type_as(real)
        fake_loss = adversarial_loss(self.discriminator(self(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        self.log("d_loss", d_loss, prog_bar=True)
        self.backward(d_loss, optimizer=self.d_optimizer)
        self.step(self.d_optimizer)


class UnscopedGAN(PortedGAN):
    """The port without scoping (what one wrote before `toggle_optimizer`/`optimizer=` existed): the
    generator's loss also leaves gradients on the discriminator, which its step, later in the same batch,
    adds to its own loss's (the trainer warns about it at the first step)."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        z = torch.randn(real.shape[0], LATENT).type_as(real)

        valid = torch.ones(real.size(0), 1).type_as(real)
        g_loss = adversarial_loss(self.discriminator(self(z)), valid)
        self.backward(g_loss)
        self.step(self.g_optimizer)

        real_loss = adversarial_loss(self.discriminator(real), valid)
        fake = torch.zeros(real.size(0), 1).type_as(real)
        fake_loss = adversarial_loss(self.discriminator(self(z).detach()), fake)
        self.backward((real_loss + fake_loss) / 2)
        self.step(self.d_optimizer)


PORTS = {"toggle": PortedGAN, "optimizer=": PortedGANOptimizerScoped, "none": UnscopedGAN}


def run_ours(steps: int, root: str, scope: str, seed: int = 0) -> tuple[dict[str, torch.Tensor], float]:
    trainer = PORTS[scope](ours_config(steps, root, seed), steps)
    seconds = timed(trainer.fit)
    return weights(trainer.generator, trainer.discriminator), seconds


def compare(steps: int, root: str) -> tuple[bool, float, dict[str, float]]:
    """(both ports' weights equal to Lightning's, Lightning's seconds, {port: seconds}) for one run of each
    on one thread."""
    with one_thread():
        theirs, t_lightning = run_lightning(steps)
        toggled, t_toggle = run_ours(steps, root, "toggle")
        scoped, t_scoped = run_ours(steps, root, "optimizer=")
    equal = same(theirs, toggled) and same(theirs, scoped)
    return equal, t_lightning, {"dream_trainer toggle_optimizer": t_toggle, "dream_trainer optimizer=": t_scoped}


if __name__ == "__main__":
    main(__doc__, compare, default_steps=200)
