"""Lightning's own LightningModule, ported: `lightning.pytorch.demos.LightningTransformer` trained by
Lightning's `Trainer` and by a `DreamTrainer` holding the same model (`lightning.pytorch.demos.Transformer`,
imported, not copied), the same loss (`nll_loss`) and optimizer (SGD, lr 0.1), on the same seed and data.
The port is the module's body moved into a trainer; only the data is synthetic (WikiText2 cannot be
downloaded here). Final weights are equal (`torch.equal`, fp32, one thread); this prints the time ratio.

    python benchmarks/port_lightning.py [--steps 200] [--rounds 3]

tests/test_port_lightning.py runs `compare()` on a few steps and asserts the weights.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from port_harness import lightning_trainer, main, one_thread, ours_config, same, timed

VOCAB, SEQ, BATCH = 64, 16, 4


def synthetic_tokens(steps: int) -> DataLoader:
    """Random token sequences standing in for WikiText2 (same shapes as the demo's batches)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, VOCAB, (steps * BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (steps * BATCH, SEQ), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def run_lightning(steps: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], float]:
    import lightning as L
    from lightning.pytorch.demos import LightningTransformer

    class OnSyntheticData(LightningTransformer):  # only the data differs from Lightning's demo
        def prepare_data(self) -> None:
            pass

        def train_dataloader(self) -> DataLoader:
            return synthetic_tokens(steps)

    L.seed_everything(seed, verbose=False)
    module = OnSyntheticData(vocab_size=VOCAB)
    trainer = lightning_trainer(steps)
    seconds = timed(lambda: trainer.fit(module))
    return module.model.state_dict(), seconds


class PortedTransformer(DreamTrainer):
    """`LightningTransformer`'s body in a DreamTrainer: the same model, loss and optimizer."""

    steps = 10

    def configure_models(self) -> None:
        from lightning.pytorch.demos import Transformer

        self.model = Transformer(vocab_size=VOCAB)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def configure_dataloaders(self) -> tuple[DataLoader, None]:
        return synthetic_tokens(self.steps), None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, target = batch
        output = self.model(inputs, target)
        return F.nll_loss(output, target.view(-1))


def run_ours(steps: int, root: str, seed: int = 0) -> tuple[dict[str, torch.Tensor], float]:
    trainer = type("Ported", (PortedTransformer,), {"steps": steps})(ours_config(steps, root, seed))
    seconds = timed(trainer.fit)
    return trainer.model.state_dict(), seconds


def compare(steps: int, root: str) -> tuple[bool, float, dict[str, float]]:
    """(weights equal, Lightning's seconds, {"dream_trainer": ours}) for one run of each on one thread."""
    with one_thread():
        theirs, t_lightning = run_lightning(steps)
        ours, t_ours = run_ours(steps, root)
    return same(theirs, ours), t_lightning, {"dream_trainer": t_ours}


if __name__ == "__main__":
    main(__doc__, compare, default_steps=200)
