"""A mid-epoch resume logs what the uninterrupted run logged: the logging interval that spans the
checkpoint, the epoch's means and the training torchmetrics continue from the checkpoint."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from conftest import TinyTrainer, quiet_config

from dream_trainer import MemoryLogger
from dream_trainer.callbacks import ModelCheckpoint
from dream_trainer.utils.aggregation import MetricAggregator


class MetricTrainer(TinyTrainer):
    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.train_mae = torchmetrics.MeanAbsoluteError()
        self.train_preds = torchmetrics.CatMetric()  # a list state

    def configure_dataloaders(self):
        train, val = super().configure_dataloaders()
        # shuffled: the resumed epoch must also see the same remaining batches
        loader = torch.utils.data.DataLoader(train.dataset, batch_size=4, shuffle=True)
        return loader, val

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.model(x)
        self.train_mae(pred, y)
        self.train_preds(pred.detach().sum())
        self.log("scaled", 10 * F.l1_loss(pred, y), batch_size=len(x))
        return F.mse_loss(pred, y)

    def on_train_epoch_end(self) -> None:
        self.epoch_end_metrics = dict(self.callback_metrics)


def _run(tmp_path, name, ckpt_path=None):
    memory = MemoryLogger()
    cfg = quiet_config(
        tmp_path / name, seed=3, n_epochs=2, log_every_n_steps=3, loggers=[memory],
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=5, save_top_k=-1)],
    )  # fmt: skip
    trainer = MetricTrainer(cfg, n_train=32, n_val=8)  # 8 steps per epoch
    trainer.fit(ckpt_path=ckpt_path)
    return trainer, memory


def test_logged_values_after_a_mid_epoch_resume_equal_the_uninterrupted_run(tmp_path):
    full, full_log = _run(tmp_path, "full")
    # the step-5 checkpoint is inside the interval of steps 4-6, and inside epoch 0 (steps 1-8)
    resumed, resumed_log = _run(tmp_path, "resumed", ckpt_path=tmp_path / "ckpts" / "epoch=0-step=5.ckpt")
    assert torch.equal(resumed.model.weight, full.model.weight)

    after = [(step, metrics) for step, metrics in full_log.history if step > 5]
    assert [s for s, _ in resumed_log.history] == [s for s, _ in after]
    for (step, expected), (_, got) in zip(after, resumed_log.history, strict=True):
        assert got.keys() == expected.keys(), step
        for key in expected:
            assert got[key] == pytest.approx(expected[key], rel=1e-12, abs=1e-12), (step, key)
    assert {"loss", "scaled", "train_mae"} <= {k for _, m in after for k in m}
    assert resumed.epoch_end_metrics == pytest.approx(full.epoch_end_metrics, rel=1e-12)
    assert resumed.callback_metrics == pytest.approx(full.callback_metrics, rel=1e-12)


class SnapshotAtSave(ModelCheckpoint):
    def on_save_checkpoint(self, trainer, checkpoint):
        self.seen_at = {**getattr(self, "seen_at", {}), trainer.global_step: dict(trainer.callback_metrics)}


def test_callback_metrics_are_back_right_after_loading(tmp_path):
    snap = SnapshotAtSave(dirpath=tmp_path / "ckpts", every_n_train_steps=5, save_top_k=-1)
    cfg = quiet_config(tmp_path / "run", n_epochs=1, log_every_n_steps=1, callbacks=[snap])
    MetricTrainer(cfg, n_train=32, n_val=8).fit()
    seen = snap.seen_at[5]
    assert "loss" in seen and "scaled" in seen
    fresh = MetricTrainer(quiet_config(tmp_path / "fresh", n_epochs=1), n_train=32, n_val=8)
    fresh.load_checkpoint(tmp_path / "ckpts" / "epoch=0-step=5.ckpt")
    assert fresh.callback_metrics == seen


def test_metric_state_round_trip_with_list_states():
    from dream_trainer.mixins.metrics import load_metric_state, metric_state

    def pair():
        return torchmetrics.MetricCollection(
            {"mae": torchmetrics.MeanAbsoluteError(), "mse": torchmetrics.MeanSquaredError()}
        )

    cat, mae, collection = torchmetrics.CatMetric(), torchmetrics.MeanAbsoluteError(), pair()
    for i in range(3):
        cat(torch.tensor([float(i), i + 0.5]))
        mae(torch.tensor([float(i)]), torch.tensor([0.0]))
        collection(torch.tensor([float(i)]), torch.tensor([1.0]))
    copies = (torchmetrics.CatMetric(), torchmetrics.MeanAbsoluteError(), pair())
    for original, copy in zip((cat, mae, collection), copies, strict=True):
        load_metric_state(copy, metric_state(original))
    for original, copy in zip((cat, mae, collection), copies, strict=True):
        a, b = original.compute(), copy.compute()
        if isinstance(a, dict):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        else:
            assert torch.equal(a, b)


def test_aggregator_state_round_trip_continues_the_interval():
    agg = MetricAggregator()
    for v in (1.0, 2.0):
        agg.update({"a": torch.tensor(v)}, weight=2.0)
    agg.compute()
    agg.update({"a": torch.tensor(4.0)})
    agg.update({"a": 5.0})
    restored = MetricAggregator()
    restored.load_state_dict(agg.state_dict())
    restored.update({"a": torch.tensor(6.0)})
    agg.update({"a": torch.tensor(6.0)})
    assert restored.compute() == agg.compute() == {"a": 5.0}
    assert restored.totals() == agg.totals() == {"a": pytest.approx((2 + 4 + 4 + 5 + 6) / 7)}
