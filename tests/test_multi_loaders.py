"""Several validation / test / predict loaders: `dataloader_idx` when the step takes it, metrics named
`<name>/dataloader_idx_<i>` (Lightning's scheme), one validation run around all of them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyTrainer, quiet_config
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import Callback, MemoryLogger


def _loader(n: int, seed: int) -> DataLoader:
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


class TwoVal(TinyTrainer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[int, int]] = []

    def configure_dataloaders(self):
        train, _ = super().configure_dataloaders()
        return train, [_loader(8, 1), _loader(12, 2)]

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.calls.append((dataloader_idx, batch_idx))
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y)}

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        return {"test_loss": F.mse_loss(self.model(x), y) + dataloader_idx}

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0])


def _mse(trainer: TinyTrainer, loader: DataLoader) -> float:
    with torch.no_grad():
        total = sum(F.mse_loss(trainer.model(x), y, reduction="sum").item() for x, y in loader)
    return total / len(loader.dataset)


def test_each_validation_loader_is_named_and_gets_its_index(tmp_path):
    logger = MemoryLogger()

    class Ends(Callback):
        seen: list[set[str]] = []  # noqa: RUF012

        def on_validation_end(self, trainer):
            self.seen.append({k for k in trainer.callback_metrics if k.startswith("val_loss")})

    ends = Ends()
    trainer = TwoVal(quiet_config(tmp_path, n_epochs=1, loggers=[logger], callbacks=[ends]))
    trainer.fit()
    assert trainer.calls == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]  # loader 0 then loader 1
    metrics = trainer.callback_metrics
    assert metrics["val_loss/dataloader_idx_0"] == pytest.approx(_mse(trainer, _loader(8, 1)), rel=1e-5)
    assert metrics["val_loss/dataloader_idx_1"] == pytest.approx(_mse(trainer, _loader(12, 2)), rel=1e-5)
    assert "val_loss" not in metrics
    # one validation run: callbacks see both loaders' metrics when it ends
    assert ends.seen == [{"val_loss/dataloader_idx_0", "val_loss/dataloader_idx_1"}]
    assert [s for s, _ in logger.series("val_loss/dataloader_idx_1")] == [trainer.global_step]


def test_a_step_without_dataloader_idx_still_runs_every_loader(tmp_path):
    class NoIdx(TwoVal):
        def validation_step(self, batch, batch_idx):
            x, y = batch
            return {"val_loss": F.mse_loss(self.model(x), y)}

    trainer = NoIdx(quiet_config(tmp_path))
    trainer.fit()
    assert {"val_loss/dataloader_idx_0", "val_loss/dataloader_idx_1"} <= set(trainer.callback_metrics)


def test_several_test_and_predict_loaders(tmp_path):
    trainer = TwoVal(quiet_config(tmp_path))
    results = trainer.test([_loader(8, 1), _loader(8, 1)])
    assert results["test_loss/dataloader_idx_1"] == pytest.approx(results["test_loss/dataloader_idx_0"] + 1, rel=1e-6)
    predictions = trainer.predict([_loader(8, 1), _loader(12, 2)])
    assert [len(p) for p in predictions] == [2, 3]  # one list of outputs per loader
    single = trainer.predict(_loader(8, 1))
    assert len(single) == 2 and isinstance(single[0], torch.Tensor)  # one loader: a flat list, as before


def test_a_list_of_batches_is_one_loader(tmp_path):
    x = torch.randn(8, 4)
    batches = [(x[:4], x[:4].sum(1, keepdim=True)), (x[4:], x[4:].sum(1, keepdim=True))]
    trainer = TwoVal(quiet_config(tmp_path))
    assert set(trainer.test(batches)) == {"test_loss"}
