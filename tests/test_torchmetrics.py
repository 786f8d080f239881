"""torchmetrics integration: discovery, placement, per-phase reset/compute, the names metrics are logged
under, and that sanity-check and never-updated metrics leave no trace."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from conftest import TinyTrainer, quiet_config
from torchmetrics import MeanAbsoluteError, MeanSquaredError, MetricCollection

from dream_trainer import Callback, MemoryLogger


def _mae(errors: list[torch.Tensor]) -> float:
    return torch.cat(errors).abs().mean().item()


def _mse(errors: list[torch.Tensor]) -> float:
    return torch.cat(errors).pow(2).mean().item()


class MetricsRecorder(Callback):
    """`callback_metrics` right after every real validation and at every train epoch end."""

    def __init__(self) -> None:
        self.after_val: list[tuple[int, dict[str, float]]] = []
        self.after_epoch: list[tuple[int, dict[str, float]]] = []
        self.at_train_start: dict[str, float] | None = None

    def on_train_start(self, trainer):
        self.at_train_start = dict(trainer.callback_metrics)

    def on_validation_end(self, trainer):
        if not trainer.sanity_checking:
            self.after_val.append((trainer.global_step, dict(trainer.callback_metrics)))

    def on_train_epoch_end(self, trainer):
        self.after_epoch.append((trainer.global_step, dict(trainer.callback_metrics)))


class MetricTrainer(TinyTrainer):
    """Records the raw errors each metric saw, per validation run / per train epoch (sanity check apart)."""

    def __init__(self, config, **kwargs):
        kwargs.setdefault("n_train", 16)
        kwargs.setdefault("n_val", 8)
        super().__init__(config, **kwargs)
        self.val_errors: list[list[torch.Tensor]] = []  # one list per real validation run
        self.sanity_errors: list[torch.Tensor] = []
        self.train_errors: list[list[torch.Tensor]] = []  # one list per epoch

    def on_train_epoch_start(self):
        self.train_errors.append([])

    def on_validation_epoch_start(self):
        if not self.sanity_checking:
            self.val_errors.append([])

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.model(x)
        self.train_errors[-1].append((pred.detach() - y).flatten())
        self.train_update(pred.detach(), y)
        return {"loss": F.mse_loss(pred, y)}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        pred = self.model(x)
        if self.sanity_checking:
            self.sanity_errors.append((pred - y).flatten())
        else:
            self.val_errors[-1].append((pred - y).flatten())
        self.val_update(pred, y)
        return {"val_loss": F.mse_loss(pred, y)}

    def train_update(self, pred, y):
        pass

    def val_update(self, pred, y):
        pass


class ValMAETrainer(MetricTrainer):
    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.val_mae = MeanAbsoluteError()

    def val_update(self, pred, y):
        self.val_mae(pred, y)


# --- discovery and placement ----------------------------------------------------------------------------------
class ManyMetricsTrainer(TinyTrainer):
    def __init__(self, config):
        super().__init__(config)
        self.val_mae = MeanAbsoluteError()
        self.train_mse = MeanSquaredError()
        self.val_metrics = MetricCollection({"mae": MeanAbsoluteError()}, prefix="val_")
        self._hidden = MeanAbsoluteError()  # private attributes are not discovered
        self.not_a_metric = torch.nn.ReLU()


def test_named_metrics_discovers_metrics_and_named_models_excludes_them(tmp_path):
    trainer = ManyMetricsTrainer(quiet_config(tmp_path))
    assert [(name, m) for name, m in trainer.named_metrics()] == [
        ("val_mae", trainer.val_mae),
        ("train_mse", trainer.train_mse),
        ("val_metrics", trainer.val_metrics),
    ]
    models = dict(trainer.named_models())
    assert set(models) == {"model", "not_a_metric"}
    assert all(not isinstance(m, (torchmetrics.Metric, MetricCollection)) for m in models.values())


def test_metrics_are_not_optimized_or_wrapped(tmp_path):
    trainer = ManyMetricsTrainer(quiet_config(tmp_path, n_epochs=1))
    metric = trainer.val_mae
    trainer.fit()
    assert trainer.val_mae is metric  # not replaced by a wrapped/compiled module
    assert {name for name, _ in trainer.named_models()} == {"model", "not_a_metric"}


class RecordingMAE(MeanAbsoluteError):
    def __init__(self) -> None:
        super().__init__()
        self.moved_to: list[torch.device] = []

    def to(self, *args, **kwargs):
        device = args[0] if args else kwargs.get("device")
        self.moved_to.append(torch.device(device))
        return super().to(*args, **kwargs)


def test_metrics_are_moved_to_the_trainer_device(tmp_path):
    class T(MetricTrainer):
        def __init__(self, config):
            super().__init__(config)
            self.val_mae = RecordingMAE()
            self.train_mae = RecordingMAE()

    trainer = T(quiet_config(tmp_path, n_epochs=1))
    trainer.fit()
    assert trainer.val_mae.moved_to == [trainer.device]
    assert trainer.train_mae.moved_to == [trainer.device]
    assert trainer.val_mae.device == trainer.device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_metrics_live_on_cuda(tmp_path):
    logger = MemoryLogger()
    trainer = ValMAETrainer(quiet_config(tmp_path, device="cuda", n_epochs=1, loggers=[logger]))
    trainer.fit()
    assert trainer.val_mae.device.type == "cuda"
    assert trainer.val_mae.sum_abs_error.device.type == "cuda"
    ((step, value),) = logger.series("val_mae")
    assert step == 4 and value == pytest.approx(_mae(trainer.val_errors[0]), rel=1e-5)


# --- validation metrics -----------------------------------------------------------------------------------------
def test_validation_metric_is_per_run_not_cumulative(tmp_path):
    logger, rec = MemoryLogger(), MetricsRecorder()
    trainer = ValMAETrainer(quiet_config(tmp_path, n_epochs=3, loggers=[logger], callbacks=[rec]))
    trainer.fit()

    expected = [_mae(errs) for errs in trainer.val_errors]
    assert len(expected) == 3
    cumulative = _mae(trainer.val_errors[0] + trainer.val_errors[1])
    assert cumulative != pytest.approx(expected[1], rel=1e-3)  # the check below can tell them apart

    series = logger.series("val_mae")
    assert [s for s, _ in series] == [4, 8, 12]  # logged at each validation step
    assert [v for _, v in series] == pytest.approx(expected, rel=1e-5)
    assert [(s, m["val_mae"]) for s, m in rec.after_val] == [
        (s, pytest.approx(e, rel=1e-5)) for s, e in zip((4, 8, 12), expected, strict=True)
    ]
    assert trainer.callback_metrics["val_mae"] == pytest.approx(expected[-1], rel=1e-5)
    # logged together with the other validation metrics of that run
    val_rows = [metrics for _, metrics in logger.history if "val_mae" in metrics]
    assert all("val_loss" in metrics for metrics in val_rows)


def test_validation_metric_with_step_based_validation(tmp_path):
    logger = MemoryLogger()
    trainer = ValMAETrainer(quiet_config(tmp_path, n_epochs=1, val_every_n_steps=2, loggers=[logger]))
    trainer.fit()
    expected = [_mae(errs) for errs in trainer.val_errors]
    assert [s for s, _ in logger.series("val_mae")] == [2, 4]
    assert [v for _, v in logger.series("val_mae")] == pytest.approx(expected, rel=1e-5)


def test_sanity_check_updates_do_not_leak_into_the_first_validation(tmp_path):
    logger, rec = MemoryLogger(), MetricsRecorder()
    cfg = quiet_config(tmp_path, n_epochs=1, num_sanity_val_steps=1, loggers=[logger], callbacks=[rec])
    trainer = ValMAETrainer(cfg)
    trainer.fit()
    assert len(trainer.sanity_errors) == 1  # the sanity check ran one batch through the metric
    expected = _mae(trainer.val_errors[0])
    leaked = _mae(trainer.sanity_errors + trainer.val_errors[0])
    assert leaked != pytest.approx(expected, rel=1e-3)

    assert logger.series("val_mae") == [(4, pytest.approx(expected, rel=1e-5))]
    assert rec.at_train_start == {}  # the sanity value is not left in callback_metrics
    assert trainer.callback_metrics["val_mae"] == pytest.approx(expected, rel=1e-5)


def test_metric_collection_logs_its_prefixed_keys(tmp_path):
    class T(MetricTrainer):
        def __init__(self, config):
            super().__init__(config)
            self.val_metrics = MetricCollection({"mae": MeanAbsoluteError(), "mse": MeanSquaredError()}, prefix="val_")
            self.train_metrics = MetricCollection({"mae": MeanAbsoluteError()}, prefix="train_")

        def val_update(self, pred, y):
            self.val_metrics.update(pred, y)

        def train_update(self, pred, y):
            self.train_metrics.update(pred, y)

    logger = MemoryLogger()
    trainer = T(quiet_config(tmp_path, n_epochs=2, loggers=[logger]))
    trainer.fit()
    keys = {k for _, metrics in logger.history for k in metrics}
    assert {"val_mae", "val_mse", "train_mae"} <= keys
    assert not keys & {"val_metrics", "train_metrics", "mae", "mse"}
    assert [v for _, v in logger.series("val_mae")] == pytest.approx([_mae(e) for e in trainer.val_errors], rel=1e-5)
    assert [v for _, v in logger.series("val_mse")] == pytest.approx([_mse(e) for e in trainer.val_errors], rel=1e-5)
    assert [s for s, _ in logger.series("train_mae")] == [4, 8]
    assert [v for _, v in logger.series("train_mae")] == pytest.approx(
        [_mae(e) for e in trainer.train_errors], rel=1e-5
    )


# --- training metrics ----------------------------------------------------------------------------------------
def test_train_metric_is_computed_per_train_epoch(tmp_path):
    class T(MetricTrainer):
        def __init__(self, config):
            super().__init__(config)
            self.train_mae = MeanAbsoluteError()

        def train_update(self, pred, y):
            self.train_mae(pred, y)

    logger, rec = MemoryLogger(), MetricsRecorder()
    trainer = T(quiet_config(tmp_path, n_epochs=3, log_every_n_steps=1, loggers=[logger], callbacks=[rec]))
    trainer.fit()
    expected = [_mae(errs) for errs in trainer.train_errors]
    assert len(expected) == 3
    assert _mae(trainer.train_errors[0] + trainer.train_errors[1]) != pytest.approx(expected[1], rel=1e-3)

    series = logger.series("train_mae")
    assert [s for s, _ in series] == [4, 8, 12]  # once per epoch, not per logging interval
    assert [v for _, v in series] == pytest.approx(expected, rel=1e-5)
    assert [m["train_mae"] for _, m in rec.after_epoch] == pytest.approx(expected, rel=1e-5)
    # not a validation metric: absent from what the validations reported before their epoch ended
    assert "train_mae" not in rec.after_val[0][1]


# --- self.log(name, metric) -----------------------------------------------------------------------------------
def test_self_log_with_a_metric_uses_the_given_name(tmp_path):
    class T(MetricTrainer):
        def __init__(self, config):
            super().__init__(config)
            self.some_metric = MeanAbsoluteError()

        def val_update(self, pred, y):
            self.some_metric(pred, y)
            self.log("val_acc", self.some_metric)

    logger, rec = MemoryLogger(), MetricsRecorder()
    trainer = T(quiet_config(tmp_path, n_epochs=2, loggers=[logger], callbacks=[rec]))
    trainer.fit()
    series = logger.series("val_acc")
    assert [s for s, _ in series] == [4, 8]
    assert [v for _, v in series] == pytest.approx([_mae(e) for e in trainer.val_errors], rel=1e-5)
    assert all("some_metric" not in metrics for _, metrics in logger.history)
    assert "some_metric" not in trainer.callback_metrics
    assert all("some_metric" not in metrics for _, metrics in rec.after_val)


def test_self_log_with_a_metric_in_training_step_is_a_train_epoch_metric(tmp_path):
    class T(MetricTrainer):
        def __init__(self, config):
            super().__init__(config, n_val=0)  # no validation: a val-phase metric would never be computed
            self.fit_metric = MeanAbsoluteError()

        def train_update(self, pred, y):
            self.fit_metric.update(pred, y)
            self.log("epoch_mae", self.fit_metric)

    logger = MemoryLogger()
    trainer = T(quiet_config(tmp_path, n_epochs=2, loggers=[logger]))
    trainer.fit()
    series = logger.series("epoch_mae")
    assert [s for s, _ in series] == [4, 8]
    assert [v for _, v in series] == pytest.approx([_mae(e) for e in trainer.train_errors], rel=1e-5)
    assert all("fit_metric" not in metrics for _, metrics in logger.history)


# --- metrics that were never updated -------------------------------------------------------------------------
def test_metrics_never_updated_are_not_computed(tmp_path):
    class T(ValMAETrainer):
        def __init__(self, config):
            super().__init__(config)
            self.val_unused = MeanAbsoluteError()
            self.train_unused = MeanSquaredError()
            self.unused_collection = MetricCollection({"mae": MeanAbsoluteError()}, prefix="other_")

    logger = MemoryLogger()
    trainer = T(quiet_config(tmp_path, n_epochs=2, num_sanity_val_steps=1, loggers=[logger]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit()
    compute_warnings = [str(w.message) for w in caught if "compute" in str(w.message)]
    assert compute_warnings == []
    keys = {k for _, metrics in logger.history for k in metrics}
    assert "val_mae" in keys
    assert not keys & {"val_unused", "train_unused", "other_mae", "unused_collection"}
    assert not set(trainer.callback_metrics) & {"val_unused", "train_unused", "other_mae"}
