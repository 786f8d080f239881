"""PredictionWriter / BasePredictionWriter: the files hold exactly what predict() returns, one per batch
and/or one per run, in a directory of their own; several loaders; argument checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TinyTrainer, make_regression_data, quiet_config
from helpers import torchrun_once
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
    batch_files = sorted(out.glob("predictions_rank0_batch*.pt"), key=lambda p: int(p.stem.rsplit("batch", 1)[1]))
    epoch_files = sorted(out.glob("predictions_rank0.pt"))
    assert len(batch_files) == (3 if "batch" in interval else 0)
    assert len(epoch_files) == (1 if "epoch" in interval else 0)
    # nothing else written but the batch indices, for every interval
    assert len(list(out.iterdir())) == len(batch_files) + len(epoch_files) + 1
    assert load(out / "batch_indices_rank0.pt") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    if batch_files:
        assert [p.name for p in batch_files] == [f"predictions_rank0_batch{i}.pt" for i in range(3)]
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
    assert sorted(p.name for p in out.iterdir()) == [
        "batch_indices_rank0.pt",
        "predictions_rank0_batch0.pt",
        "predictions_rank0_batch1.pt",
    ]
    kept = load(out / "predictions_rank0_batch0.pt")
    with pytest.raises(FileExistsError, match=r"predictions_rank0_batch0\.pt exists already"):
        make(tmp_path / "other", PredictionWriter(output_dir=out)).predict(loader(8))
    assert torch.equal(load(out / "predictions_rank0_batch0.pt")["y"], kept["y"])


def test_several_loaders_get_their_index_and_the_nested_structure(tmp_path):
    writer = PredictionWriter(write_interval="batch_and_epoch")
    trainer = make(tmp_path, writer)
    preds = trainer.predict([loader(8), loader(12)])  # 2 and 3 batches
    assert [len(p) for p in preds] == [2, 3]
    out = writer.output_path
    for i in range(2):
        same(load(out / f"predictions_rank0_batch{i}.pt"), preds[0][i])
    for i in range(3):
        same(load(out / f"predictions_rank0_dataloader1_batch{i}.pt"), preds[1][i])
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
    indices = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert rec.batches == [(0, 0, indices[0], 4), (1, 0, indices[1], 4), (2, 0, indices[2], 2)]
    assert rec.epochs == []
    rec = Recording("epoch")
    make(tmp_path / "b", rec).predict(loader(10))
    assert rec.batches == [] and rec.epochs == [(3, indices)]


def test_batch_indices_put_shuffled_predictions_back_in_dataset_order(tmp_path):
    # Lightning's reason for batch_indices: a shuffled (or distributed) loader; the writer's indices say
    # which sample each prediction row belongs to. The step returns its inputs, so the check is exact.
    class Echo(PredTrainer):
        def predict_step(self, batch, batch_idx):
            return batch[0]

    x, y = make_regression_data(10, seed=1)
    shuffled = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    writer = PredictionWriter(write_interval="epoch")
    trainer = Echo(quiet_config(tmp_path, callbacks=[writer]))
    preds = trainer.predict(shuffled)
    indices = load(writer.output_path / "batch_indices_rank0.pt")
    assert sorted(i for batch in indices for i in batch) == list(range(10))
    assert indices != [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # it did shuffle
    rows = torch.cat(preds)
    in_order = torch.empty_like(rows)
    in_order[torch.tensor([i for batch in indices for i in batch])] = rows
    assert torch.equal(in_order, x)
    assert trainer.current_batch_indices is None  # only while predict() runs


def test_batch_indices_are_none_where_the_loader_cannot_tell(tmp_path):
    x, y = make_regression_data(8, seed=1)
    rec = Recording("batch")
    make(tmp_path, rec).predict([(x[:4], y[:4]), (x[4:], y[4:])])  # a list of batches, no sampler
    assert [b[2] for b in rec.batches] == [None, None]


def test_write_interval_is_checked():
    with pytest.raises(ConfigError, match=r"write_interval='step'.*\['batch', 'epoch', 'batch_and_epoch'\]"):
        PredictionWriter(write_interval="step")
    with pytest.raises(ConfigError, match=r"output_dir=3"):
        PredictionWriter(output_dir=3)  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="write_on_batch_end"):
        BasePredictionWriter().write_on_batch_end(None, None, None, None, 0, 0)  # type: ignore[arg-type]


WORKER = Path(__file__).with_name("prediction_writer_worker.py")


@pytest.mark.slow
def test_two_ranks_write_their_own_files_and_cover_the_data_once(tmp_path_factory):
    """torchrun, 2 processes (gloo): 10 samples carrying their index, sharded by a DistributedSampler."""
    out_dir, log = torchrun_once(tmp_path_factory, "prediction-writer", WORKER, 2, timeout=240)
    errors = sorted(out_dir.glob("error.*"))
    assert not errors, errors[0].read_text()
    assert (out_dir / "result.json").exists(), "the worker wrote no result:\n" + log.read_text()
    result = json.loads((out_dir / "result.json").read_text())
    assert result["world_size"] == 2
    first, second = result["output_paths"]
    assert first == second  # the ranks agree on one new directory inside the run directory
    written = Path(first)
    assert written.name == "predictions" and written.parent.parent == out_dir / "root"
    expected_files = {f"predictions_rank{r}_batch{i}.pt" for r in (0, 1) for i in range(3)}
    per_rank = {f"predictions_rank{r}.pt" for r in (0, 1)} | {f"batch_indices_rank{r}.pt" for r in (0, 1)}
    assert {p.name for p in written.iterdir()} == expected_files | per_rank
    ids: list[int] = []
    for rank in (0, 1):
        returned = load(out_dir / f"returned_rank{rank}.pt")
        assert len(returned) == 3  # 5 samples per rank, batches of 2, 2, 1
        for i, expected in enumerate(returned):
            got = load(written / f"predictions_rank{rank}_batch{i}.pt")
            assert torch.equal(got["ids"], expected["ids"]) and torch.equal(got["y"], expected["y"])
            ids.extend(got["ids"].tolist())
        per_run = load(written / f"predictions_rank{rank}.pt")
        assert [torch.equal(a["y"], b["y"]) for a, b in zip(per_run, returned, strict=True)] == [True] * 3
        # the DistributedSampler's share: rank r gets samples r, r + 2, r + 4, ...
        assert [i for p in per_run for i in p["ids"].tolist()] == list(range(rank, 10, 2))
        # the writer's batch indices are the DistributedSampler's: the ids the samples carry
        assert load(written / f"batch_indices_rank{rank}.pt") == [p["ids"].tolist() for p in per_run]
    assert sorted(ids) == list(range(10))  # every sample once, across the ranks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_predictions_of_a_gpu_run_are_written_on_the_cpu(tmp_path):
    """The files load on a machine without the GPU; `predict()` returns the device's tensors, as before."""
    writer = PredictionWriter(write_interval="batch_and_epoch")
    trainer = PredTrainer(quiet_config(tmp_path, callbacks=[writer], device="cuda"))
    preds = trainer.predict(loader())
    assert preds[0]["y"].device.type == "cuda"
    per_batch = load(writer.output_path / "predictions_rank0_batch1.pt")
    per_run = load(writer.output_path / "predictions_rank0.pt")
    for written in (per_batch, per_run[1]):
        assert written["y"].device.type == "cpu" and torch.equal(written["y"], preds[1]["y"].cpu())
