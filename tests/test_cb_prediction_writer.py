"""PredictionWriter / BasePredictionWriter: the files hold exactly what predict() returns, one per batch
and/or one per run, in a directory of their own; several loaders; argument checks."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyTrainer, make_regression_data, quiet_config
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import ConfigError
from dream_trainer.callbacks import BasePredictionWriter, PredictionWriter


class PredTrainer(TinyTrainer):
    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return {"y": self.model(x), "batch_idx": batch_idx}


def loader(n=10, batch_size=4):
    x, y = make_regression_data(n, seed=1)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def make(tmp_path, writer):
    return PredTrainer(quiet_config(tmp_path, callbacks=[writer]))


def load(path):
    return torch.load(path, weights_only=True)


def same(a, b):
    assert a.keys() == b.keys() and a["batch_idx"] == b["batch_idx"] and torch.equal(a["y"], b["y"])


@pytest.mark.parametrize("interval", ["batch", "epoch", "batch_and_epoch"])
def test_files_hold_what_predict_returns(tmp_path, interval):
    writer = PredictionWriter(write_interval=interval)
    trainer = make(tmp_path, writer)
    preds = trainer.predict(loader())  # 3 batches
    out = writer.output_path
    assert out == trainer.run_dir / "predictions"
    batch_files = sorted(out.glob("batch_*.pt"))
    epoch_files = sorted(out.glob("predictions_*.pt"))
    assert len(batch_files) == (3 if "batch" in interval else 0)
    assert len(epoch_files) == (1 if "epoch" in interval else 0)
    if batch_files:
        assert [p.name for p in batch_files] == [f"batch_rank0_dl0_{i:06d}.pt" for i in range(3)]
        for p, expected in zip(batch_files, preds, strict=True):
            same(load(p), expected)
    if epoch_files:
        assert epoch_files[0].name == "predictions_rank0.pt"
        written = load(epoch_files[0])
        assert len(written) == len(preds) == 3
        for a, b in zip(written, preds, strict=True):
            same(a, b)


def test_a_second_predict_gets_a_new_directory_and_nothing_is_overwritten(tmp_path):
    writer = PredictionWriter(write_interval="epoch")
    trainer = make(tmp_path, writer)
    trainer.predict(loader(8))
    first = writer.output_path
    before = load(first / "predictions_rank0.pt")
    trainer.predict(loader(4))
    assert writer.output_path == trainer.run_dir / "predictions_1" and first == trainer.run_dir / "predictions"
    assert len(load(first / "predictions_rank0.pt")) == len(before) == 2
    assert len(load(writer.output_path / "predictions_rank0.pt")) == 1


def test_a_given_directory_is_used_but_existing_files_are_not_overwritten(tmp_path):
    out = tmp_path / "preds"
    writer = PredictionWriter(output_dir=out, write_interval="batch")
    trainer = make(tmp_path, writer)
    trainer.predict(loader(8))
    assert sorted(p.name for p in out.iterdir()) == ["batch_rank0_dl0_000000.pt", "batch_rank0_dl0_000001.pt"]
    kept = load(out / "batch_rank0_dl0_000000.pt")
    with pytest.raises(FileExistsError, match=r"batch_rank0_dl0_000000\.pt exists already"):
        make(tmp_path / "other", PredictionWriter(output_dir=out)).predict(loader(8))
    assert torch.equal(load(out / "batch_rank0_dl0_000000.pt")["y"], kept["y"])


def test_several_loaders_get_their_index_and_the_nested_structure(tmp_path):
    writer = PredictionWriter(write_interval="batch_and_epoch")
    trainer = make(tmp_path, writer)
    preds = trainer.predict([loader(8), loader(12)])  # 2 and 3 batches
    assert [len(p) for p in preds] == [2, 3]
    out = writer.output_path
    for dl, n in ((0, 2), (1, 3)):
        for i in range(n):
            same(load(out / f"batch_rank0_dl{dl}_{i:06d}.pt"), preds[dl][i])
    written = load(out / "predictions_rank0.pt")
    assert [len(p) for p in written] == [2, 3]
    same(written[1][2], preds[1][2])


class Recording(BasePredictionWriter):
    def __init__(self, write_interval):
        super().__init__(write_interval)
        self.batches: list[tuple] = []
        self.epochs: list[tuple] = []

    def write_on_batch_end(self, trainer, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.batches.append((batch_idx, dataloader_idx, batch_indices, len(batch[0])))

    def write_on_epoch_end(self, trainer, predictions, batch_indices):
        self.epochs.append((len(predictions), batch_indices))


def test_base_class_hooks_follow_the_interval(tmp_path):
    rec = Recording("batch")
    make(tmp_path / "a", rec).predict(loader(10))
    assert rec.batches == [(0, 0, None, 4), (1, 0, None, 4), (2, 0, None, 2)] and rec.epochs == []
    rec = Recording("epoch")
    make(tmp_path / "b", rec).predict(loader(10))
    assert rec.batches == [] and rec.epochs == [(3, None)]


def test_write_interval_is_checked():
    with pytest.raises(ConfigError, match=r"write_interval='step'.*\['batch', 'epoch', 'batch_and_epoch'\]"):
        PredictionWriter(write_interval="step")
    with pytest.raises(ConfigError, match=r"output_dir=3"):
        PredictionWriter(output_dir=3)  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="write_on_batch_end"):
        BasePredictionWriter().write_on_batch_end(None, None, None, None, 0, 0)  # type: ignore[arg-type]
