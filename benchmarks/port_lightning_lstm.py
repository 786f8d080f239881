"""Lightning's own LightningModule, ported: `lightning.pytorch.demos.lstm.LightningLSTM` trained by
Lightning's `Trainer` and by a `DreamTrainer` holding the same model (`SimpleLSTM`, 4 layers of 512,
imported, not copied), the same loss (`nll_loss`), optimizer (SGD, lr 20) and hidden state carried from
step to step (detached each step, reset at each epoch's end), on the same seed and data. Only the data
hooks differ from the demo: synthetic tokens in a `WikiText2` whose text is not downloaded, batched by
the demo's own `SequenceSampler` (20 sequences of 35 tokens). An epoch is 5 batches, so the hidden
state's reset at the epoch's end is crossed. Final weights are equal (`torch.equal`, fp32, one thread);
this prints the time ratio.

    python benchmarks/port_lightning_lstm.py [--steps 30] [--rounds 3]

tests/test_port_lightning_lstm.py runs `compare()` on a few steps and asserts the weights.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from dream_trainer import DreamTrainer, DreamTrainerConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from port_harness import lightning_trainer, main, one_thread, ours_config, same, timed

# The demo's batch (SequenceSampler(batch_size=20)) and block (WikiText2(block_size=35)); a vocabulary
# smaller than WikiText2's 33,278 words keeps the decoder cheap (the LSTM is the demo's own size).
VOCAB, BLOCK, BATCH = 1000, 35, 20
EPOCH_BATCHES = 5


def synthetic_wikitext() -> Dataset:
    """The demo's `WikiText2` (its `__len__`/`__getitem__`: inputs and next-token targets of 35 tokens)
    over random tokens instead of the downloaded text, long enough for `EPOCH_BATCHES` batches."""
    from lightning.pytorch.demos.transformer import WikiText2

    class SyntheticWikiText2(WikiText2):
        def __init__(self) -> None:  # no download, no tokenizing: the demo's class otherwise
            Dataset.__init__(self)
            g = torch.Generator().manual_seed(5)
            self.data = torch.randint(0, VOCAB, ((EPOCH_BATCHES * BATCH + 1) * BLOCK,), generator=g)
            self.block_size = BLOCK

    return SyntheticWikiText2()


def synthetic_loader() -> DataLoader:
    """The demo's `train_dataloader`, over the synthetic text."""
    from lightning.pytorch.demos.lstm import SequenceSampler

    dataset = synthetic_wikitext()
    return DataLoader(dataset, batch_sampler=SequenceSampler(dataset, batch_size=BATCH))


def run_lightning(steps: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], float]:
    import lightning as L
    from lightning.pytorch.demos.lstm import LightningLSTM

    class OnSyntheticData(LightningLSTM):  # only the data differs from Lightning's demo
        def prepare_data(self) -> None:
            pass

        def train_dataloader(self) -> DataLoader:
            return synthetic_loader()

    L.seed_everything(seed, verbose=False)
    module = OnSyntheticData(vocab_size=VOCAB)
    trainer = lightning_trainer(steps)
    seconds = timed(lambda: trainer.fit(module))
    return module.model.state_dict(), seconds


class PortedLSTM(DreamTrainer):
    """`LightningLSTM`'s body in a DreamTrainer: the same model, hidden state, loss and optimizer."""

    def __init__(self, config: DreamTrainerConfig) -> None:
        super().__init__(config)
        self.hidden: tuple[torch.Tensor, torch.Tensor] | None = None

    def configure_models(self) -> None:
        from lightning.pytorch.demos.lstm import SimpleLSTM

        self.model = SimpleLSTM(vocab_size=VOCAB)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=20.0)  # the demo's `self.parameters()`

    def configure_dataloaders(self) -> tuple[DataLoader, None]:
        return synthetic_loader(), None

    def on_train_epoch_end(self) -> None:
        self.hidden = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input, target = batch
        if self.hidden is None:
            self.hidden = self.model.init_hidden(input.size(0))
        self.hidden = (self.hidden[0].detach(), self.hidden[1].detach())
        output, self.hidden = self.model(input, self.hidden)
        loss = F.nll_loss(output, target.view(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss


def run_ours(steps: int, root: str, seed: int = 0) -> tuple[dict[str, torch.Tensor], float]:
    trainer = PortedLSTM(ours_config(steps, root, seed))
    seconds = timed(trainer.fit)
    return trainer.model.state_dict(), seconds


def compare(steps: int, root: str) -> tuple[bool, float, dict[str, float]]:
    """(weights equal, Lightning's seconds, {"dream_trainer": ours}) for one run of each on one thread."""
    with one_thread():
        theirs, t_lightning = run_lightning(steps)
        ours, t_ours = run_ours(steps, root)
    return same(theirs, ours), t_lightning, {"dream_trainer": t_ours}


if __name__ == "__main__":
    main(__doc__, compare, default_steps=30)
