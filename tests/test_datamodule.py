"""DataModule: the loaders come from it (fit, validate, test, predict), prepare_data once on rank zero
before setup(stage), teardown at the end of fit, its state in checkpoints. A Lightning DataModule body
ports by changing the base class."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from conftest import quiet_config
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split

from dream_trainer import DataModule, DreamTrainer


class Regression(DataModule):
    """Written as a LightningDataModule would be (only the base class differs)."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.calls: list[str] = []
        self.epochs_served = 0

    def prepare_data(self):
        self.calls.append("prepare_data")

    def setup(self, stage):
        self.calls.append(f"setup:{stage}")
        g = torch.Generator().manual_seed(0)
        x = torch.randn(48, 4, generator=g)
        full = TensorDataset(x, x.sum(1, keepdim=True))
        self.train, self.val = random_split(full, [32, 16], generator=torch.Generator().manual_seed(1))
        self.test = TensorDataset(x[:8], x[:8].sum(1, keepdim=True))

    def train_dataloader(self):
        self.epochs_served += 1
        return DataLoader(self.train, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.test, batch_size=4)

    def predict_dataloader(self):
        return DataLoader(self.test, batch_size=4)

    def teardown(self, stage):
        self.calls.append(f"teardown:{stage}")

    def state_dict(self):
        return {"epochs_served": self.epochs_served}

    def load_state_dict(self, state):
        self.epochs_served = state["epochs_served"]


class Model(DreamTrainer):
    def configure_models(self):
        torch.manual_seed(0)
        self.model = nn.Linear(4, 1)

    def configure_optimizers(self):
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y)}

    def test_step(self, batch, batch_idx):
        x, y = batch
        return {"test_loss": F.mse_loss(self.model(x), y)}

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0])


def test_fit_takes_the_loaders_and_calls_the_hooks_in_order(tmp_path):
    dm = Regression()
    trainer = Model(quiet_config(tmp_path, n_epochs=2))
    trainer.fit(datamodule=dm)
    assert trainer.global_step == 2 * 4  # 32 samples / 8 per batch, two epochs
    assert "val_loss" in trainer.callback_metrics
    assert dm.calls == ["prepare_data", "setup:fit", "teardown:fit"]
    assert set(trainer.test()) == {"test_loss"}
    assert dm.calls[-1] == "setup:test"  # test's stage set up on demand, prepare_data not again
    predictions = trainer.predict()
    assert len(predictions) == 2 and predictions[0].shape == (4, 1)
    assert dm.calls.count("prepare_data") == 1


def test_constructor_datamodule_and_the_same_weights_as_configure_dataloaders(tmp_path):
    class Direct(Model):
        def configure_dataloaders(self):
            dm = Regression()
            dm.setup("fit")
            return dm.train_dataloader(), dm.val_dataloader()

    a = Model(quiet_config(tmp_path / "a", n_epochs=2), datamodule=Regression())
    a.fit()
    b = Direct(quiet_config(tmp_path / "b", n_epochs=2))
    b.fit()
    assert torch.equal(a.model.weight, b.model.weight)


def test_datamodule_state_travels_in_checkpoints(tmp_path):
    dm = Regression()
    trainer = Model(quiet_config(tmp_path, n_epochs=1), datamodule=dm)
    trainer.fit()
    dm.epochs_served = 7
    path = tmp_path / "dm.ckpt"
    trainer.save_checkpoint(path)
    fresh = Regression()
    Model(quiet_config(tmp_path), datamodule=fresh).load_checkpoint(path)
    assert fresh.epochs_served == 7


def test_a_datamodule_without_a_train_loader_says_so(tmp_path):
    import pytest

    from dream_trainer import MisconfigurationError

    class Empty(DataModule):
        pass

    with pytest.raises(
        MisconfigurationError, match="the datamodule's train_dataloader\\(\\) returned no training loader"
    ):
        Model(quiet_config(tmp_path)).fit(datamodule=Empty())


def test_a_lightning_body_ports_unchanged_hooks_without_stage_hparams_and_trainer(tmp_path):
    class Ported(DataModule):  # was `class Ported(LightningDataModule)`; nothing else changed
        def __init__(self, batch_size: int = 8, data_dir: str = "unused") -> None:
            super().__init__()
            self.save_hyperparameters(ignore="data_dir")
            self.calls: list[str] = []

        def prepare_data(self):
            self.calls.append("prepare_data")

        def setup(self):  # no `stage`
            self.calls.append("setup")
            x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
            self.data = TensorDataset(x, x.sum(1, keepdim=True))

        def train_dataloader(self):
            assert self.trainer is not None and self.trainer.world_size == 1  # Lightning's self.trainer
            return DataLoader(self.data, batch_size=self.hparams.batch_size)

        def teardown(self):  # no `stage`
            self.calls.append("teardown")

    dm = Ported(batch_size=16)
    assert dict(dm.hparams) == {"batch_size": 16}
    trainer = Model(quiet_config(tmp_path), datamodule=dm)
    trainer.fit()
    assert trainer.global_step == 2  # 32 samples in batches of hparams.batch_size = 16
    assert dm.calls == ["prepare_data", "setup", "teardown"]
    assert dm.trainer is trainer
    assert DataModule().hparams == {}  # without save_hyperparameters: empty, as in Lightning


def test_the_datamodule_wins_over_the_trainers_own_loaders(tmp_path):
    class OwnLoaders(Model):
        def configure_dataloaders(self):
            raise AssertionError("not called when a datamodule is given")

        def configure_test_dataloader(self):
            raise AssertionError("not called when a datamodule is given")

    dm = Regression()
    trainer = OwnLoaders(quiet_config(tmp_path))
    trainer.fit(datamodule=dm)
    assert trainer.global_step == 4
    x = torch.randn(4, 4)
    trainer.test(DataLoader(TensorDataset(x, x), batch_size=4))  # a loader given: the datamodule is not asked
    assert "setup:test" not in dm.calls
    assert set(trainer.test()) == {"test_loss"} and dm.calls[-1] == "setup:test"
