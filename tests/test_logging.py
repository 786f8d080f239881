"""Logging: interval means to loggers, batch-size-weighted validation, callback_metrics, `self.log`,
`self.log_metrics`, logger lifecycle, no per-step syncs, the epoch summary, and the utilities behind them."""

from __future__ import annotations

import os
import sys
from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyTrainer, make_regression_data, quiet_config
from helpers import LossRecorder
from torch.utils.data import DataLoader, TensorDataset

import dream_trainer
from dream_trainer import Callback, DreamTrainerConfig, MemoryLogger
from dream_trainer.utils import MetricAggregator, aggregation, batch_size_of, map_nested_tensor, move_to_device


def _mean(values):
    return sum(values) / len(values)


# --- training metrics to loggers ------------------------------------------------------------------------
def test_train_metrics_are_logged_every_n_steps_as_interval_means(tmp_path):
    logger, rec = MemoryLogger(), LossRecorder()
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=2, log_every_n_steps=2, loggers=[logger], callbacks=[rec]))
    trainer.fit()  # 4 steps per epoch, 8 in all
    losses = rec.losses
    assert len(losses) == 8
    assert len(set(losses)) == 8  # the model learns: per-step values differ, so a mean is distinguishable

    series = logger.series("loss")
    assert [step for step, _ in series] == [2, 4, 6, 8]
    for (step, value), start in zip(series, (0, 2, 4, 6), strict=True):
        assert value == pytest.approx(_mean(losses[start : start + 2]), rel=1e-6), step


def test_log_interval_longer_than_an_epoch(tmp_path):
    logger, rec = MemoryLogger(), LossRecorder()
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=2, log_every_n_steps=8, loggers=[logger], callbacks=[rec]))
    trainer.fit()
    series = dict(logger.series("loss"))
    assert 8 in series
    assert all(step in (4, 8) for step in series)  # nothing logged per step in between


def test_validation_metrics_reach_loggers_each_validation(tmp_path):
    logger = MemoryLogger()
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=2, log_every_n_steps=2, loggers=[logger]))
    trainer.fit()
    assert [step for step, _ in logger.series("val_loss")] == [4, 8]
    assert logger.series("val_loss")[-1][1] == pytest.approx(trainer.callback_metrics["val_loss"])


# --- validation weighting ---------------------------------------------------------------------------------
class WeightedValTrainer(TinyTrainer):
    """Validation over 10 samples in batches of 4, 4, 2; batch i reports value i + 1 (and 10 * (i + 1) via log)."""

    def __init__(self, config):
        super().__init__(config, n_train=8, n_val=10, batch_size=4)
        self.val_batch_sizes: list[int] = []

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        self.val_batch_sizes.append(x.shape[0])
        self.log("logged_val", torch.tensor(10.0 * (batch_idx + 1)))
        return {"per_batch": torch.tensor(float(batch_idx + 1)), "logits": torch.zeros(x.shape[0], 3)}


def test_validation_metrics_are_batch_size_weighted(tmp_path):
    logger = MemoryLogger()
    trainer = WeightedValTrainer(quiet_config(tmp_path, n_epochs=1, loggers=[logger]))
    trainer.fit()
    assert trainer.val_batch_sizes == [4, 4, 2]
    expected = (4 * 1 + 4 * 2 + 2 * 3) / 10  # 1.8; the unweighted mean would be 2.0
    assert trainer.callback_metrics["per_batch"] == pytest.approx(expected)
    assert trainer.callback_metrics["logged_val"] == pytest.approx(10 * expected)
    ((step, value),) = logger.series("per_batch")
    assert step == 2 and value == pytest.approx(expected)
    assert "logits" not in trainer.callback_metrics  # non-scalars are not metrics


def test_validation_loop_returns_its_metrics(tmp_path):
    trainer = WeightedValTrainer(quiet_config(tmp_path, n_epochs=1))
    trainer.fit()
    results = trainer.validation_loop()
    assert results["per_batch"] == pytest.approx(1.8)


def test_sanity_check_does_not_reach_loggers_or_callback_metrics(tmp_path):
    logger = MemoryLogger()

    class Peek(Callback):
        def on_train_start(self, trainer):
            self.at_train_start = dict(trainer.callback_metrics)

    peek = Peek()
    trainer = WeightedValTrainer(
        quiet_config(tmp_path, n_epochs=1, num_sanity_val_steps=2, loggers=[logger], callbacks=[peek])
    )
    trainer.fit()
    assert peek.at_train_start == {}
    assert len(logger.series("per_batch")) == 1


# --- callback_metrics ----------------------------------------------------------------------------------------
def test_callback_metrics_hold_train_epoch_means_and_val_means(tmp_path):
    rec = LossRecorder()
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=2, log_every_n_steps=3, callbacks=[rec]))
    trainer.fit()
    metrics = trainer.callback_metrics
    assert metrics["loss"] == pytest.approx(_mean(rec.losses[4:]), rel=1e-6)  # the last epoch's mean

    x, y = make_regression_data(16 + 8)
    with torch.no_grad():
        val_mse = F.mse_loss(trainer.model(x[16:]), y[16:]).item()
    assert metrics["val_loss"] == pytest.approx(val_mse, rel=1e-5)


def test_callback_metrics_in_on_train_epoch_end_hold_that_epochs_means(tmp_path):
    seen: list[dict[str, float]] = []

    class Peek(Callback):
        def on_train_epoch_end(self, trainer):
            seen.append(dict(trainer.callback_metrics))

    rec = LossRecorder()
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=2, log_every_n_steps=50, callbacks=[rec, Peek()]))
    trainer.fit()
    assert seen[0]["loss"] == pytest.approx(_mean(rec.losses[:4]), rel=1e-6)
    assert seen[1]["loss"] == pytest.approx(_mean(rec.losses[4:]), rel=1e-6)
    assert "val_loss" in seen[0]  # that epoch's validation ran before on_train_epoch_end


# --- self.log and self.log_metrics ---------------------------------------------------------------------------
class LoggingTrainer(TinyTrainer):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("double_loss", out["loss"].detach() * 2)
        self.log("const", 3.0)
        self.log_metrics({"custom": torch.tensor(float(batch_idx)), "image": torch.zeros(2, 2)}, step=100 + batch_idx)
        self.log_metrics({"at_default_step": float(self.global_step)})
        return out


def test_self_log_in_training_step(tmp_path):
    logger, rec = MemoryLogger(), LossRecorder()
    trainer = LoggingTrainer(quiet_config(tmp_path, n_epochs=1, log_every_n_steps=2, loggers=[logger], callbacks=[rec]))
    trainer.fit()
    double = logger.series("double_loss")
    assert [s for s, _ in double] == [2, 4]
    assert double[0][1] == pytest.approx(2 * _mean(rec.losses[:2]), rel=1e-6)
    assert double[1][1] == pytest.approx(2 * _mean(rec.losses[2:]), rel=1e-6)
    assert logger.series("const") == [(2, 3.0), (4, 3.0)]
    assert trainer.callback_metrics["double_loss"] == pytest.approx(2 * _mean(rec.losses), rel=1e-6)


def test_log_metrics_reaches_loggers_at_the_given_step(tmp_path):
    logger = MemoryLogger()
    trainer = LoggingTrainer(quiet_config(tmp_path, n_epochs=1, log_every_n_steps=50, loggers=[logger]))
    trainer.fit()
    assert logger.series("custom") == [(100, 0.0), (101, 1.0), (102, 2.0), (103, 3.0)]
    # Default step: global_step when log_metrics was called (steps completed before that batch).
    assert logger.series("at_default_step") == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
    assert logger.series("image") == []  # non-scalars are dropped


def test_self_log_in_validation_step_with_explicit_batch_size(tmp_path):
    class T(TinyTrainer):
        def validation_step(self, batch, batch_idx):
            # weights 1 and 3 -> (1 * 1 + 3 * 5) / 4 = 4
            self.log("w", torch.tensor(1.0 if batch_idx == 0 else 5.0), batch_size=1 if batch_idx == 0 else 3)
            return {}

    trainer = T(quiet_config(tmp_path, n_epochs=1), n_val=8)
    trainer.fit()
    assert trainer.callback_metrics["w"] == pytest.approx(4.0)


# --- logger lifecycle ----------------------------------------------------------------------------------------
@dataclass
class LoggedConfig(DreamTrainerConfig):
    learning_rate: float = 0.123


def test_log_hyperparams_gets_the_config_dict_and_finalize_success(tmp_path):
    logger = MemoryLogger()
    cfg = LoggedConfig(print_epoch_summary=False, device="cpu", root_dir=str(tmp_path), loggers=[logger])
    trainer = TinyTrainer(cfg)
    assert logger.status is None
    trainer.fit()
    assert logger.hyperparams == cfg.to_dict()
    assert logger.hyperparams["learning_rate"] == 0.123
    assert logger.hyperparams["loggers"] == ["MemoryLogger"]
    assert logger.status == "success"


def test_finalize_failed_on_exception(tmp_path):
    class Broken(TinyTrainer):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    logger = MemoryLogger()
    with pytest.raises(RuntimeError, match="boom"):
        Broken(quiet_config(tmp_path, loggers=[logger])).fit()
    assert logger.status == "failed"


def test_every_logger_gets_the_same_metrics(tmp_path):
    a, b = MemoryLogger(), MemoryLogger()
    TinyTrainer(quiet_config(tmp_path, n_epochs=1, log_every_n_steps=1, loggers=[a, b])).fit()
    assert a.history == b.history
    assert len(a.series("loss")) == 4


# --- no per-step syncs ---------------------------------------------------------------------------------------
@pytest.fixture
def accelerator_reads(monkeypatch):
    """The read discipline of an accelerator, checked with CPU tensors: every read would be a device
    sync, so nothing is read before `compute()`. (CPU scalars are read at once otherwise: there is no
    device to wait for; `test_cpu_scalars_are_read_at_once_and_give_the_same_means` covers that.)"""
    monkeypatch.setattr(aggregation, "EAGER_CPU_READS", False)


class ReadCounter:
    """Counts host reads of tensor values (`item`, `tolist`, `float()`, `int()`, `bool()`)."""

    METHODS = ("item", "tolist", "__float__", "__int__", "__bool__")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(original))

    def _wrap(self, original):
        def counted(tensor, *args, **kwargs):
            self.count += 1
            return original(tensor, *args, **kwargs)

        return counted


def _reads_during_fit(monkeypatch, tmp_path, n_train, log_every, with_item=False):
    class T(TinyTrainer):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            if with_item:
                out["loss"].item()
            return out

    trainer = T(quiet_config(tmp_path, n_epochs=1, log_every_n_steps=log_every), n_train=n_train, n_val=0)
    trainer._setup_fit()  # one-time setup work is not what is measured
    with monkeypatch.context() as m:
        counter = ReadCounter(m)
        trainer.fit()
    assert trainer.global_step == n_train // 4
    return counter.count


@pytest.mark.usefixtures("accelerator_reads")
def test_read_counter_sees_item_calls(monkeypatch, tmp_path):
    # Control: the instrument does count reads, so the zero-growth check below is meaningful.
    base = _reads_during_fit(monkeypatch, tmp_path, n_train=16, log_every=1000)
    with_item = _reads_during_fit(monkeypatch, tmp_path, n_train=16, log_every=1000, with_item=True)
    assert with_item - base == 4


@pytest.mark.usefixtures("accelerator_reads")
def test_aggregation_does_not_read_values_back_per_step(monkeypatch, tmp_path):
    short = _reads_during_fit(monkeypatch, tmp_path, n_train=16, log_every=1000)  # 4 steps
    long = _reads_during_fit(monkeypatch, tmp_path, n_train=64, log_every=1000)  # 16 steps
    assert long == short  # reads do not grow with the number of steps
    assert short <= 2  # the epoch-end reduction only


@pytest.mark.usefixtures("accelerator_reads")
def test_item_is_never_called_by_the_trainer(monkeypatch, tmp_path):
    # DataLoader itself calls .item() once per epoch (its base seed); count only calls made by dream_trainer.
    package_dir = os.path.dirname(dream_trainer.__file__)
    calls = []
    original = torch.Tensor.item

    def counted(tensor):
        caller = sys._getframe(1).f_code.co_filename
        calls.append(caller)
        return original(tensor)

    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=1, log_every_n_steps=1000), n_train=64, n_val=0)
    trainer._setup_fit()
    monkeypatch.setattr(torch.Tensor, "item", counted)
    trainer.fit()
    monkeypatch.undo()
    assert calls, "the patch saw no call at all (DataLoader's seed read was expected)"
    assert [c for c in calls if c.startswith(package_dir)] == []
    assert trainer.global_step == 16


@pytest.mark.usefixtures("accelerator_reads")
def test_reads_scale_with_logging_frequency_not_steps(monkeypatch, tmp_path):
    every_step = _reads_during_fit(monkeypatch, tmp_path, n_train=64, log_every=1)  # 16 logging points
    rarely = _reads_during_fit(monkeypatch, tmp_path, n_train=64, log_every=1000)
    assert every_step > rarely


# --- epoch summary -------------------------------------------------------------------------------------------
def test_epoch_summary_is_printed_when_enabled(tmp_path, capsys):
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=2, print_epoch_summary=True))
    trainer.fit()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 2
    assert lines[0].startswith("epoch 1/2 | step 4 | ")
    assert lines[1].startswith("epoch 2/2 | step 8 | ")
    metrics = trainer.callback_metrics
    assert f"loss {metrics['loss']:.4g}" in lines[1]
    assert f"val_loss {metrics['val_loss']:.4g}" in lines[1]


def test_epoch_summary_is_silent_when_disabled(tmp_path, capsys):
    TinyTrainer(quiet_config(tmp_path, n_epochs=2, print_epoch_summary=False)).fit()
    captured = capsys.readouterr()
    assert captured.out == ""


# --- MetricAggregator --------------------------------------------------------------------------------------
def test_aggregator_weighted_means():
    agg = MetricAggregator()
    agg.update({"a": torch.tensor(1.0), "b": 10.0}, weight=1.0)
    agg.update({"a": torch.tensor(4.0), "b": 20}, weight=3.0)
    out = agg.compute()
    assert out["a"] == pytest.approx((1 * 1 + 4 * 3) / 4)
    assert out["b"] == pytest.approx((10 * 1 + 20 * 3) / 4)
    assert all(isinstance(v, float) for v in out.values())


def test_aggregator_compute_starts_a_new_interval_and_totals_span_them():
    agg = MetricAggregator()
    agg.update({"a": 1.0}, weight=2.0)
    assert agg.compute() == {"a": 1.0}
    assert agg.compute() == {}  # nothing new since the last compute
    agg.update({"a": torch.tensor(4.0)}, weight=1.0)
    agg.update({"c": 7.0})
    assert agg.compute() == pytest.approx({"a": 4.0, "c": 7.0})
    totals = agg.totals()
    assert totals["a"] == pytest.approx((1 * 2 + 4 * 1) / 3)
    assert totals["c"] == pytest.approx(7.0)


def test_aggregator_totals_include_pending_values():
    agg = MetricAggregator()
    agg.update({"a": 2.0})
    agg.update({"a": 4.0})
    assert agg.totals() == {"a": pytest.approx(3.0)}


def test_aggregator_reset():
    agg = MetricAggregator()
    agg.update({"a": 5.0})
    agg.compute()
    agg.update({"a": 7.0})
    assert agg
    agg.reset()
    assert not agg
    assert agg.compute() == {}
    assert agg.totals() == {}
    agg.update({"a": 1.0})
    assert agg.totals() == {"a": 1.0}


def test_aggregator_ignores_non_scalars():
    agg = MetricAggregator()
    agg.update(
        {
            "loss": torch.tensor(2.0),
            "one_element": torch.tensor([3.0]),
            "logits": torch.zeros(4, 3),
            "empty": torch.zeros(0),
            "name": "resnet",
            "flag": True,
            "none": None,
            "list": [1.0, 2.0],
        }
    )
    assert agg.compute() == {"loss": 2.0, "one_element": 3.0}


def test_aggregator_detaches_and_handles_integer_tensors():
    agg = MetricAggregator()
    w = torch.tensor(3.0, requires_grad=True)
    agg.update({"g": w * 2, "n": torch.tensor(5)})
    out = agg.compute()
    assert out == {"g": 6.0, "n": 5.0}


@pytest.mark.usefixtures("accelerator_reads")
def test_aggregator_update_does_not_read_values(monkeypatch):
    agg = MetricAggregator()
    with monkeypatch.context() as m:
        counter = ReadCounter(m)
        for i in range(50):
            agg.update({"loss": torch.tensor(float(i)), "acc": torch.tensor(0.5)})
        assert counter.count == 0
        out = agg.compute()
        assert counter.count <= 1  # one read for all metrics together
    assert out == {"loss": pytest.approx(24.5), "acc": pytest.approx(0.5)}


def test_cpu_scalars_are_read_at_once_and_give_the_same_means(monkeypatch):
    losses = [torch.tensor(0.1 * i, requires_grad=True) * 3 for i in range(50)]  # steps' losses, with graphs
    eager = MetricAggregator()
    for loss in losses:
        eager.add("loss", loss)
        eager.update({"acc": loss.detach() / 3}, weight=2.0)
    # nothing kept alive: plain floats, so neither the tensors nor their graphs are held until logging
    assert all(type(v) is float for vals in eager._pending.values() for v in vals)
    monkeypatch.setattr(aggregation, "EAGER_CPU_READS", False)
    deferred = MetricAggregator()
    for loss in losses:
        deferred.add("loss", loss)
        deferred.update({"acc": loss.detach() / 3}, weight=2.0)
    assert all(isinstance(v, torch.Tensor) for vals in deferred._pending.values() for v in vals)
    got, expected = eager.compute(), deferred.compute()
    assert got.keys() == expected.keys() == {"loss", "acc"}
    for key in got:
        assert got[key] == pytest.approx(expected[key], rel=1e-12)
    assert eager.totals() == pytest.approx(deferred.totals(), rel=1e-12)


# --- tensor utilities ------------------------------------------------------------------------------------
Pair = namedtuple("Pair", ["x", "y"])


def test_map_nested_tensor_keeps_structure_and_non_tensors():
    t = torch.ones(2)
    data = {
        "a": t,
        "b": [t, (t, 3)],
        "c": "text",
        "d": Pair(t, None),
        "e": OrderedDict(z=t),
    }
    out = map_nested_tensor(lambda x: x * 2, data)
    assert set(out) == set(data)
    assert torch.equal(out["a"], torch.full((2,), 2.0))
    assert isinstance(out["b"], list) and isinstance(out["b"][1], tuple)
    assert torch.equal(out["b"][0], torch.full((2,), 2.0))
    assert torch.equal(out["b"][1][0], torch.full((2,), 2.0))
    assert out["b"][1][1] == 3
    assert out["c"] == "text"
    assert isinstance(out["d"], Pair) and out["d"].y is None
    assert torch.equal(out["d"].x, torch.full((2,), 2.0))
    assert type(out["e"]) is OrderedDict
    assert torch.equal(out["e"]["z"], torch.full((2,), 2.0))
    assert torch.equal(t, torch.ones(2))  # input untouched


def test_map_nested_tensor_on_a_tensor_and_a_plain_value():
    assert torch.equal(map_nested_tensor(lambda x: x + 1, torch.zeros(3)), torch.ones(3))
    assert map_nested_tensor(lambda x: x + 1, 5) == 5


def test_move_to_device():
    class HasTo:
        def __init__(self):
            self.moved_to = None

        def to(self, device):
            self.moved_to = device
            return self

    meta = torch.device("meta")  # a second device that exists on every machine
    thing = HasTo()
    batch = {"x": torch.ones(2, 3), "pair": Pair(torch.zeros(1), [torch.ones(1), "keep"]), "n": 3}
    moved = move_to_device(batch, meta)
    assert moved["x"].device.type == "meta" and moved["x"].shape == (2, 3)
    assert isinstance(moved["pair"], Pair)
    assert moved["pair"].x.device.type == "meta"
    assert moved["pair"].y[0].device.type == "meta"
    assert moved["pair"].y[1] == "keep"
    assert moved["n"] == 3
    assert batch["x"].device.type == "cpu"  # the input is not changed in place

    assert move_to_device(torch.ones(1), meta).device.type == "meta"
    assert move_to_device(thing, meta) is thing and thing.moved_to == meta
    assert move_to_device("text", meta) == "text"


def test_batch_size_of():
    assert batch_size_of(torch.zeros(8, 3)) == 8
    assert batch_size_of(torch.tensor(1.0)) == 1
    assert batch_size_of((torch.zeros(5, 2), torch.zeros(5))) == 5
    assert batch_size_of({"input": torch.zeros(6, 2), "label": torch.zeros(6)}) == 6
    assert batch_size_of(["id", torch.zeros(3, 4)]) == 3
    assert batch_size_of([[torch.zeros(7)]]) == 7
    assert batch_size_of({"meta": {"ids": torch.zeros(4)}}) == 4
    assert batch_size_of("no tensors") == 1
    assert batch_size_of([]) == 1


def test_batch_size_used_for_a_dict_batch_in_validation(tmp_path):
    class DictBatches(TinyTrainer):
        def configure_dataloaders(self):
            x, y = make_regression_data(16 + 10)
            train = DataLoader(TensorDataset(x[:16], y[:16]), batch_size=4)
            val = [
                {"x": x[16:20], "y": y[16:20], "v": torch.tensor(1.0)},
                {"x": x[20:26], "y": y[20:26], "v": torch.tensor(3.0)},
            ]
            return train, val

        def validation_step(self, batch, batch_idx):
            return {"v": batch["v"]}

    trainer = DictBatches(quiet_config(tmp_path, n_epochs=1))
    trainer.fit()
    assert trainer.callback_metrics["v"] == pytest.approx((4 * 1 + 6 * 3) / 10)


def test_validate_and_test_outside_fit_finalize_the_loggers_with_their_outcome(tmp_path):
    class Tested(TinyTrainer):
        def test_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    logger = MemoryLogger()
    trainer = Tested(quiet_config(tmp_path, loggers=[logger]))
    trainer.validate()
    assert logger.status == "success"  # its own entry point: the loggers' run ends with it
    assert "val_loss" in logger.history[-1][1]
    with pytest.raises(RuntimeError, match="boom"):
        trainer.test(trainer.val_loader)
    assert logger.status == "failed"
