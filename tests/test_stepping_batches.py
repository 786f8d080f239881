"""`trainer.estimated_stepping_batches`: the training steps a run takes, known in `configure_optimizers`
(issue 47), where every `transformers` scheduler needs it (`num_training_steps`) and Lightning users read
`self.trainer.estimated_stepping_batches`.

It must equal the steps the run then takes (`global_step` at its end) for `max_steps` and epoch runs,
with accumulation (an epoch's short last window is a step), `limit_train_batches` (a count or a
fraction), both limits; a scheduler that refuses to step past its length (`OneCycleLR`) sized by it
runs to its end exactly. Read before setup loads the loaders, it loads them then, once
(`configure_dataloaders` and the datamodule's `setup("fit")` are not called twice). A run resumed from a
checkpoint sizes its scheduler as the first run did, and ends with its weights. Several processes:
tests/test_distributed.py (`test_estimated_stepping_batches_counts_the_steps_each_rank_takes`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_config
from helpers import ckpt_dir
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import Callback, DataModule, DreamTrainer
from dream_trainer.callbacks import ModelCheckpoint
from dream_trainer.errors import MisconfigurationError

N_SAMPLES, BATCH = 40, 4  # 10 batches an epoch


def samples() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, 3, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


class Counted(DreamTrainer):
    """Reads `estimated_stepping_batches` in `configure_optimizers`, as a scheduler sized by it does."""

    def __init__(self, config: Any, datamodule: DataModule | None = None) -> None:
        super().__init__(config, datamodule)
        self.loader_calls = 0
        self.read_in_configure_optimizers: int | None = None

    def configure_models(self) -> None:
        self.model = nn.Linear(3, 1)

    def configure_optimizers(self) -> Any:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.read_in_configure_optimizers = self.estimated_stepping_batches

    def configure_dataloaders(self) -> tuple[Any, Any]:
        self.loader_calls += 1
        return DataLoader(samples(), batch_size=BATCH, shuffle=True), None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.mse_loss(self.model(x), y)


@pytest.mark.parametrize(
    ("settings", "steps"),
    [
        ({"n_epochs": 3}, 30),
        ({"n_epochs": 3, "gradient_accumulation_steps": 4}, 9),  # windows of 4, 4 and 2 each epoch
        ({"n_epochs": 2, "gradient_accumulation_steps": 5}, 4),
        ({"n_epochs": 3, "limit_train_batches": 5, "gradient_accumulation_steps": 4}, 6),
        ({"n_epochs": 2, "limit_train_batches": 0.5}, 10),
        ({"max_steps": 7}, 7),  # no epoch limit: the loader is not needed
        ({"max_steps": 13, "gradient_accumulation_steps": 2}, 13),
        ({"n_epochs": 3, "max_steps": 7}, 7),  # whichever ends the run first
        ({"n_epochs": 2, "max_steps": 100}, 20),
        ({"fast_dev_run": 3}, 3),
    ],
    ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else str(v),
)
def test_it_is_the_steps_the_run_takes(tmp_path: Path, settings: dict[str, Any], steps: int) -> None:
    trainer = Counted(quiet_config(tmp_path, **settings))
    trainer.fit()
    assert trainer.read_in_configure_optimizers == trainer.global_step == steps
    assert trainer.estimated_stepping_batches == steps  # the same after the run
    assert trainer.loader_calls == 1  # loaded early for it, not again by setup


class OneCycle(Counted):
    """Lightning's docstring example, as written: `OneCycleLR(total_steps=...)` stepped every step. It
    raises when stepped once past `total_steps`."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=0.1, total_steps=self.trainer.estimated_stepping_batches
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_a_one_cycle_schedule_sized_by_it_ends_exactly_at_the_runs_end(tmp_path: Path) -> None:
    trainer = OneCycle(quiet_config(tmp_path, n_epochs=3, gradient_accumulation_steps=3, limit_train_batches=8))
    trainer.fit()  # OneCycleLR raises "Tried to step 10 times" if it counted fewer steps
    scheduler = trainer.lr_schedulers()
    assert trainer.global_step == 9 == scheduler.total_steps == scheduler.last_epoch


class FromDataModule(Counted):
    def configure_dataloaders(self) -> tuple[Any, Any]:  # the datamodule's are used instead
        raise AssertionError("not called with a datamodule")


class Data(DataModule):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def setup(self, stage: str) -> None:
        self.calls.append(f"setup:{stage}")

    def train_dataloader(self) -> DataLoader[Any]:
        self.calls.append("train_dataloader")
        return DataLoader(samples(), batch_size=BATCH)

    def val_dataloader(self) -> None:
        return None


def test_a_datamodule_is_set_up_and_asked_for_its_loader_once(tmp_path: Path) -> None:
    data = Data()
    trainer = FromDataModule(quiet_config(tmp_path, n_epochs=2, gradient_accumulation_steps=3), datamodule=data)
    trainer.fit()
    assert trainer.read_in_configure_optimizers == trainer.global_step == 8
    assert data.calls == ["setup:fit", "train_dataloader"]


def endless() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    data = samples()
    while True:
        for i in range(0, N_SAMPLES, BATCH):
            yield data[i : i + BATCH]


class Streaming(Counted):
    def configure_dataloaders(self) -> tuple[Any, Any]:
        return endless(), None


def test_a_loader_without_length_needs_max_steps(tmp_path: Path) -> None:
    trainer = Streaming(quiet_config(tmp_path, max_steps=6, n_epochs=2))
    trainer.fit()
    assert trainer.read_in_configure_optimizers == 6
    with pytest.raises(MisconfigurationError, match=r"no length .* set config\.max_steps"):
        Streaming(quiet_config(tmp_path, n_epochs=2)).fit()


def test_before_fit_an_epoch_run_says_where_to_read_it(tmp_path: Path) -> None:
    trainer = Counted(quiet_config(tmp_path, n_epochs=2))
    with pytest.raises(MisconfigurationError, match="read it in configure_optimizers or later"):
        trainer.estimated_stepping_batches  # noqa: B018 - the read is the test
    assert Counted(quiet_config(tmp_path, max_steps=5)).estimated_stepping_batches == 5  # known from the config


def test_without_a_training_loader_it_says_what_to_return(tmp_path: Path) -> None:
    class NoData(Counted):
        def configure_dataloaders(self) -> tuple[Any, Any]:
            return None, None

    with pytest.raises(MisconfigurationError, match="returned no training loader"):
        NoData(quiet_config(tmp_path, n_epochs=2)).fit()


def test_callbacks_read_it(tmp_path: Path) -> None:
    # Not a member of TrainerProtocol: Python 3.11's isinstance() against a runtime protocol reads every
    # property, and this one raises before fit() for an epoch run.
    class Reads(Callback):
        seen: int | None = None

        def on_train_start(self, trainer: Any) -> None:
            self.seen = trainer.estimated_stepping_batches

    reads = Reads()
    trainer = Counted(quiet_config(tmp_path, n_epochs=2, gradient_accumulation_steps=4, callbacks=[reads]))
    trainer.fit()
    assert reads.seen == trainer.global_step == 6


class Linear(Counted):
    """A linear decay to zero over the run, as `transformers`' `get_linear_schedule_with_warmup` (no
    warmup), sized by `estimated_stepping_batches`: a resume that counted only what is left would decay
    on another slope."""

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        total = self.read_in_configure_optimizers = self.estimated_stepping_batches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: max(0.0, 1 - step / total))


def test_a_resumed_run_sizes_its_scheduler_as_the_first_did(tmp_path: Path) -> None:
    settings = {"n_epochs": 3, "gradient_accumulation_steps": 3, "scheduler_interval": "step", "seed": 5}
    whole = Linear(quiet_config(tmp_path / "whole", **settings))
    whole.fit()
    saving = Linear(
        quiet_config(
            tmp_path / "saving",
            **settings,
            enable_checkpointing=True,
            callbacks=[ModelCheckpoint(every_n_train_steps=5, save_top_k=-1)],
        )
    )
    saving.fit()
    resumed = Linear(quiet_config(tmp_path / "resumed", **settings))
    resumed.fit(ckpt_path=ckpt_dir(tmp_path / "saving") / "epoch=1-step=5.ckpt")  # in the middle of epoch 1
    assert resumed.read_in_configure_optimizers == whole.read_in_configure_optimizers == 12
    assert resumed.global_step == whole.global_step == 12
    expected, got = whole.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
