"""Loader worker processes end when the trainer is done with an epoch's iterator, also one left early.

An iterator left before its end (max_steps, should_stop, limit_*_batches) used to keep its workers until
Python's cyclic garbage collector freed it (a StatefulDataLoader keeps its iterator for state_dict(), and a
trainer is freed by that collector): torch's shutdown run from there waits 5 s for every worker before
killing it, so a later `gc.collect()` (or the exit of a distributed run) stalled 10 s per such loader.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_config
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from dream_trainer import Callback, DreamTrainer


class Numbered(Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        x = torch.full((4,), float(i) / 32)
        return i, x, x.sum(0, keepdim=True)


class Run(DreamTrainer):
    def __init__(self, config: Any, loader_class: type = StatefulDataLoader) -> None:
        super().__init__(config)
        torch.manual_seed(0)
        self.model = nn.Linear(4, 1)
        self.loader_class = loader_class
        self.ids: list[int] = []

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def configure_dataloaders(self) -> Any:
        def loader() -> Any:
            return self.loader_class(Numbered(), batch_size=4, num_workers=2)

        return loader(), loader()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, x, y = batch
        self.ids.extend(ids.tolist())
        return F.mse_loss(self.model(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        _, x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y)}


def _children() -> set[int | None]:
    """This process's live child processes started with multiprocessing (loader workers are)."""
    return {p.pid for p in multiprocessing.active_children()}


@pytest.mark.parametrize("loader_class", [StatefulDataLoader, DataLoader], ids=["stateful", "torch"])
def test_no_worker_outlives_an_epoch_cut_by_max_steps_or_a_batch_limit(tmp_path: Path, loader_class: type) -> None:
    before = _children()
    config = quiet_config(tmp_path, n_epochs=None, max_steps=3, limit_val_batches=1, val_every_n_steps=2)
    trainer = Run(config, loader_class)
    trainer.fit()
    assert trainer.ids == list(range(12))
    # The training epoch stopped at batch 3 of 8 and each validation read 1 of its 8 batches: every
    # worker of both loaders was stopped and joined when the trainer left them, not at garbage collection.
    assert _children() == before


class LoaderStateAtEachBatch(Callback):
    def __init__(self) -> None:
        self.states: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.states.append(trainer.train_loader.loader.state_dict())


def test_a_stateful_loader_left_mid_epoch_keeps_its_position(tmp_path: Path) -> None:
    before, seen = _children(), LoaderStateAtEachBatch()
    trainer = Run(quiet_config(tmp_path, n_epochs=None, max_steps=3, limit_val_batches=0, callbacks=[seen]))
    trainer.fit()
    assert _children() == before
    # Its workers are gone, its position is not: what a checkpoint would save is what it was at the last batch.
    assert trainer.train_loader.loader.state_dict() == seen.states[-1]
    resumed = StatefulDataLoader(Numbered(), batch_size=4, num_workers=2)
    resumed.load_state_dict(seen.states[-1])
    assert [int(i) for ids, _, _ in resumed for i in ids] == list(range(12, 32))
