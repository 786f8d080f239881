"""`self.log(name, value, on_step=..., on_epoch=..., prog_bar=..., logger=..., sync_dist=...)` with
Lightning's meaning, and epoch means reaching every logger under `name_epoch` with the numbers the
console's epoch summary prints."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyTrainer, quiet_config
from helpers import LossRecorder

from dream_trainer import Callback, MemoryLogger
from dream_trainer.errors import ConfigError


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


class OptionsTrainer(TinyTrainer):
    """Logs `loss` (returned) and `abs_err` with the options under test; `seen` keeps every value."""

    log_kwargs: dict[str, Any] = {}  # noqa: RUF012  (set per test on a subclass)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        pred = self.model(x)
        err = (pred - y).abs().mean()
        self.seen.append(float(err.detach()))
        self.log("abs_err", err, **self.log_kwargs)
        return {"loss": F.mse_loss(pred, y)}


def _run(tmp_path, log_kwargs: dict[str, Any], **config: Any) -> tuple[OptionsTrainer, MemoryLogger, LossRecorder]:
    trainer_cls = type("T", (OptionsTrainer,), {"log_kwargs": log_kwargs})
    logger, rec = MemoryLogger(), LossRecorder()
    config = {"n_epochs": 2, "log_every_n_steps": 2, **config}
    trainer = trainer_cls(quiet_config(tmp_path, loggers=[logger], callbacks=[rec], **config), n_val=0)
    trainer.fit()  # 4 steps per epoch
    return trainer, logger, rec


def test_epoch_means_reach_every_logger_as_name_epoch_equal_to_the_summary(tmp_path, capsys):
    trainer, logger, rec = _run(tmp_path, {}, print_epoch_summary=True)
    losses = rec.losses
    # The per-interval series keeps its name; the epoch mean is logged at the epoch's last step.
    assert [s for s, _ in logger.series("loss")] == [2, 4, 6, 8]
    epoch_series = logger.series("loss_epoch")
    assert [s for s, _ in epoch_series] == [4, 8]
    for (_, value), start in zip(epoch_series, (0, 4), strict=True):
        assert value == pytest.approx(_mean(losses[start : start + 4]), rel=1e-6)
    # The console's epoch line shows the same number the loggers got.
    summary = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch ")]
    assert len(summary) == 2
    for line, (_, value) in zip(summary, epoch_series, strict=True):
        printed = float(re.search(r"\| loss ([0-9.e+-]+)", line).group(1))
        assert printed == pytest.approx(value, rel=1e-3)
    # callback_metrics: the epoch mean under the name (what monitors read) and as name_epoch.
    assert trainer.callback_metrics["loss"] == trainer.callback_metrics["loss_epoch"] == epoch_series[-1][1]
    # A plain self.log behaves like a returned metric.
    assert [s for s, _ in logger.series("abs_err_epoch")] == [4, 8]


def test_on_step_false_logs_only_the_epoch_mean_under_the_name(tmp_path):
    trainer, logger, _ = _run(tmp_path, {"on_step": False, "on_epoch": True})
    series = logger.series("abs_err")
    assert [s for s, _ in series] == [4, 8]  # never at the interval steps 2 and 6
    assert series[0][1] == pytest.approx(_mean(trainer.seen[:4]), rel=1e-6)
    assert series[1][1] == pytest.approx(_mean(trainer.seen[4:]), rel=1e-6)
    assert logger.series("abs_err_epoch") == []
    assert trainer.callback_metrics["abs_err"] == series[1][1]


def test_on_epoch_false_logs_no_epoch_mean(tmp_path):
    trainer, logger, _ = _run(tmp_path, {"on_step": True, "on_epoch": False})
    series = logger.series("abs_err")
    assert [s for s, _ in series] == [2, 4, 6, 8]
    assert series[-1][1] == pytest.approx(_mean(trainer.seen[6:]), rel=1e-6)
    assert logger.series("abs_err_epoch") == []
    # callback_metrics keeps the last interval's mean (no epoch mean replaces it).
    assert trainer.callback_metrics["abs_err"] == series[-1][1]


def test_logger_false_reaches_callback_metrics_only(tmp_path):
    trainer, logger, _ = _run(tmp_path, {"logger": False})
    assert all("abs_err" not in m and "abs_err_epoch" not in m for _, m in logger.history)
    assert trainer.callback_metrics["abs_err"] == pytest.approx(_mean(trainer.seen[4:]), rel=1e-6)


def test_prog_bar_selects_what_the_display_shows(tmp_path):
    trainer, _, _ = _run(tmp_path, {"prog_bar": True, "sync_dist": True})
    assert set(trainer.progress_bar_metrics) == {"abs_err"}
    plain, _, _ = _run(tmp_path, {})
    assert {"loss", "abs_err"} <= set(plain.progress_bar_metrics)
    assert not any(k.endswith("_epoch") for k in plain.progress_bar_metrics)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"reduce_fx": "max"}, ["reduce_fx='max'", "torchmetrics", "MaxMetric"]),
        ({"on_step": False, "on_epoch": False}, ["logs nothing", "on_step=True", "on_epoch=True"]),
    ],
)
def test_unsupported_calls_fail_at_the_first_call_naming_what_to_write(tmp_path, kwargs, words):
    with pytest.raises(ConfigError) as info:
        _run(tmp_path, kwargs)
    for word in words:
        assert word in str(info.value)


def test_changing_a_metrics_options_is_an_error(tmp_path):
    class Flip(OptionsTrainer):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("x", 1.0, on_epoch=batch_idx == 0)
            return super().training_step(batch, batch_idx)

    trainer = Flip(quiet_config(tmp_path, n_epochs=1), n_val=0)
    with pytest.raises(ConfigError, match="one metric name keeps one set of options"):
        trainer.fit()


def test_on_step_in_validation_is_an_error_naming_log_metrics(tmp_path):
    class ValStep(TinyTrainer):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_x", 1.0, on_step=True)

    trainer = ValStep(quiet_config(tmp_path, n_epochs=1))
    with pytest.raises(ConfigError, match=r"self\.log_metrics"):
        trainer.fit()


def test_validation_prog_bar_and_logger_options(tmp_path):
    logger = MemoryLogger()

    class Val(TinyTrainer):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_mse", F.mse_loss(self.model(x), y), prog_bar=True)
            self.log("val_hidden", 2.0, logger=False)

    trainer = Val(quiet_config(tmp_path, n_epochs=1, loggers=[logger]))
    trainer.fit()
    assert [s for s, _ in logger.series("val_mse")] == [4]
    assert logger.series("val_hidden") == []
    assert trainer.callback_metrics["val_hidden"] == 2.0
    assert set(trainer.progress_bar_metrics) == {"val_mse"}


def test_epoch_only_metric_survives_a_mid_epoch_resume(tmp_path):
    """The options travel in the checkpoint: a run resumed mid-epoch logs the same epoch mean."""
    _, full_logger, _ = _run(tmp_path / "a", {"on_step": False}, n_epochs=1)

    class SaveAt(Callback):
        def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 3:  # the epoch's last batch: the resumed run calls no training_step
                trainer.save_checkpoint(trainer.checkpoint_dir / "mid.ckpt")

    trainer_cls = type("T", (OptionsTrainer,), {"log_kwargs": {"on_step": False}})
    cfg = dict(n_epochs=1, log_every_n_steps=2)
    first = trainer_cls(quiet_config(tmp_path / "b", callbacks=[SaveAt()], **cfg), n_val=0)
    first.fit()
    logger = MemoryLogger()
    second = trainer_cls(quiet_config(tmp_path / "b", loggers=[logger], **cfg), n_val=0)
    second.fit(ckpt_path=first.checkpoint_dir / "mid.ckpt")
    assert logger.series("abs_err") == full_logger.series("abs_err")


def test_log_dict_takes_logs_options(tmp_path):
    logger = MemoryLogger()

    class Val(TinyTrainer):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            mse = F.mse_loss(self.model(x), y)
            self.log_dict({"val_mse": mse, "val_mae": (self.model(x) - y).abs().mean()}, prog_bar=True)
            self.log_dict({"val_hidden": 2.0}, logger=False)

    trainer = Val(quiet_config(tmp_path, n_epochs=1, loggers=[logger]))
    trainer.fit()
    assert set(trainer.progress_bar_metrics) == {"val_mse", "val_mae"}
    assert logger.series("val_hidden") == [] and trainer.callback_metrics["val_hidden"] == 2.0
    assert [s for s, _ in logger.series("val_mae")] == [4]
