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


def test_monitors_see_the_suffixed_names_and_a_missing_one_lists_them(tmp_path):
    from dream_trainer import MisconfigurationError
    from dream_trainer.callbacks import EarlyStopping, ModelCheckpoint

    ckpt = ModelCheckpoint(monitor="val_loss/dataloader_idx_1", save_top_k=1)
    logger = MemoryLogger()
    TwoVal(quiet_config(tmp_path / "a", n_epochs=3, callbacks=[ckpt], loggers=[logger])).fit()
    values = [v for _, v in logger.series("val_loss/dataloader_idx_1")]
    assert len(values) == 3 and ckpt.best_model_score == pytest.approx(min(values), rel=1e-6)

    stop = EarlyStopping(monitor="val_loss")  # Lightning's name with one loader; with two it is suffixed
    with pytest.raises(MisconfigurationError, match=r"val_loss/dataloader_idx_0.*val_loss/dataloader_idx_1"):
        TwoVal(quiet_config(tmp_path / "b", callbacks=[stop])).fit()


def test_logged_options_and_torchmetrics_are_per_loader(tmp_path):
    torchmetrics = pytest.importorskip("torchmetrics")
    logger = MemoryLogger()

    class Logged(TwoVal):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.val_idx = torchmetrics.MeanMetric()

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            x, y = batch
            self.val_idx.update(torch.tensor(float(dataloader_idx)))  # 0 on loader 0, 1 on loader 1
            self.log("val_shown", F.mse_loss(self.model(x), y), prog_bar=True)
            self.log("val_hidden", torch.tensor(1.0), logger=False)

    trainer = Logged(quiet_config(tmp_path, loggers=[logger]))
    trainer.fit()
    metrics = trainer.callback_metrics
    # computed and reset per loader: accumulated over both they would be 0.6 (8 + 12 samples)
    assert metrics["val_idx/dataloader_idx_0"] == 0.0
    assert metrics["val_idx/dataloader_idx_1"] == 1.0
    assert set(trainer.progress_bar_metrics) == {"val_shown/dataloader_idx_0", "val_shown/dataloader_idx_1"}
    assert "val_hidden/dataloader_idx_1" in metrics
    logged = {k for _, m in logger.history for k in m}
    assert "val_shown/dataloader_idx_1" in logged
    assert not any(k.startswith("val_hidden") for k in logged)


def test_the_step_signature_is_read_once_at_setup(tmp_path, monkeypatch):
    from dream_trainer.mixins import setup
    from dream_trainer.utils.data import takes_dataloader_idx

    reads = []

    def counting(step):
        reads.append(step)
        return takes_dataloader_idx(step)

    monkeypatch.setattr(setup, "takes_dataloader_idx", counting)
    trainer = TwoVal(quiet_config(tmp_path, n_epochs=3, num_sanity_val_steps=1))
    trainer.fit()  # a sanity check and three validations
    assert len(reads) == 1
    assert trainer.calls[:2] == [(0, 0), (1, 0)]  # the sanity check: one batch of each loader, with its index
