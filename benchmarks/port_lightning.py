"""Lightning's own LightningModule, ported: `lightning.pytorch.demos.LightningTransformer` trained by
Lightning's `Trainer` and by a `DreamTrainer` holding the same model (`lightning.pytorch.demos.Transformer`,
imported, not copied), the same loss (`nll_loss`) and optimizer (SGD, lr 0.1), on the same seed and data.
The port is the module's body moved into a trainer; only the data is synthetic (WikiText2 cannot be
downloaded here). Final weights are equal (`torch.equal`, fp32, one thread); this prints the time ratio.

    python benchmarks/port_lightning.py [--steps 200] [--rounds 3]

tests/test_port_lightning.py runs `compare()` on a few steps and asserts the weights.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig

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
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    start = time.perf_counter()
    trainer.fit(module)
    return module.model.state_dict(), time.perf_counter() - start


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
    config = DreamTrainerConfig(
        seed=seed,
        n_epochs=None,
        max_steps=steps,
        device="cpu",
        root_dir=root,
        loggers=[],
        enable_checkpointing=False,
        enable_progress_bar=False,
        print_epoch_summary=False,
    )
    trainer = type("Ported", (PortedTransformer,), {"steps": steps})(config)
    start = time.perf_counter()
    trainer.fit()
    return trainer.model.state_dict(), time.perf_counter() - start


def compare(steps: int, root: str) -> tuple[bool, float, float]:
    """(weights equal, Lightning's seconds, ours) for one run of each on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        theirs, t_lightning = run_lightning(steps)
        ours, t_ours = run_ours(steps, root)
    finally:
        torch.set_num_threads(threads)
    equal = theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)
    return equal, t_lightning, t_ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ratios = []
    with tempfile.TemporaryDirectory() as root:
        for r in range(args.rounds):
            equal, t_l, t_o = compare(args.steps, root)
            ratio = t_o / t_l
            ratios.append(ratio)
            print(f"round {r}: Lightning {t_l:.3f} s, dream_trainer {t_o:.3f} s, {ratio:.3f}x, weights equal: {equal}")
    median = sorted(ratios)[len(ratios) // 2]
    print(f"median ratio dream_trainer / Lightning: {median:.3f}x ({args.steps} steps, 1 thread)")


if __name__ == "__main__":
    main()
