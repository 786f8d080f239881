"""LearningRateMonitor: logged rates follow the scheduler, at the step where they apply, on the cadence
chosen; keys for several optimizers / param groups; momentum and weight decay."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import TinyTrainer, quiet_config

from dream_trainer import Callback, ConfigError, MemoryLogger
from dream_trainer.callbacks.lr_monitor import LearningRateMonitor


def halving(step: int) -> float:
    return 0.5**step


class ScheduledTrainer(TinyTrainer):
    """TinyTrainer (4 steps per epoch with n_train=16) with a LambdaLR halving the rate each scheduler step."""

    def configure_optimizers(self) -> None:
        super().configure_optimizers()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, halving)


class LrUsed(Callback):
    """Records the learning rate each optimizer step really uses, by the step it belongs to."""

    def __init__(self) -> None:
        self.used: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer: Any, optimizer: torch.optim.Optimizer) -> None:
        self.used[trainer.global_step] = optimizer.param_groups[0]["lr"]


def scheduler_sequence(n: int, lr: float = 0.1) -> list[float]:
    """What the scheduler itself produces: the rate before any step, then after each of `n` steps."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, halving)
    out = [sched.get_last_lr()[0]]
    for _ in range(n):
        opt.step()
        sched.step()
        out.append(sched.get_last_lr()[0])
    return out


def run(trainer_cls: type[TinyTrainer], monitor: LearningRateMonitor, **overrides: Any) -> tuple[Any, MemoryLogger]:
    logger = MemoryLogger()
    used = LrUsed()
    settings: dict[str, Any] = {"n_epochs": 2, "callbacks": [monitor, used], "loggers": [logger]}
    settings.update(overrides)
    trainer = trainer_cls(quiet_config(**settings), n_train=16, n_val=0)
    trainer.fit()
    trainer.lr_used = used.used
    return trainer, logger


def test_step_interval_logs_the_scheduler_sequence_at_the_step_it_applies():
    monitor = LearningRateMonitor(logging_interval="step")
    trainer, logger = run(ScheduledTrainer, monitor, scheduler_interval="step", log_every_n_steps=1)
    series = logger.series("lr-optimizer")
    expected = scheduler_sequence(8)
    assert [s for s, _ in series] == list(range(9))
    assert [v for _, v in series] == pytest.approx(expected)
    # the value logged at step k is the rate optimizer step k used
    for step, lr in trainer.lr_used.items():
        assert dict(series)[step] == pytest.approx(lr)
    assert monitor.lrs["lr-optimizer"] == pytest.approx(expected)
    assert trainer.callback_metrics["lr-optimizer"] == pytest.approx(expected[-1])


def test_step_interval_follows_log_every_n_steps_and_accumulation():
    monitor = LearningRateMonitor(logging_interval="step")
    _, logger = run(
        ScheduledTrainer,
        monitor,
        scheduler_interval="step",
        log_every_n_steps=3,
        gradient_accumulation_steps=2,
        n_epochs=3,
    )  # 2 steps per epoch (4 batches, windows of 2): 6 steps
    series = logger.series("lr-optimizer")
    expected = scheduler_sequence(6)
    assert series == [(0, pytest.approx(expected[0])), (3, pytest.approx(expected[3])), (6, pytest.approx(expected[6]))]


def test_epoch_interval_follows_an_epoch_scheduler():
    monitor = LearningRateMonitor()  # None: the scheduled optimizer follows config.scheduler_interval="epoch"
    trainer, logger = run(ScheduledTrainer, monitor, n_epochs=3, log_every_n_steps=1)
    series = logger.series("lr-optimizer")
    expected = scheduler_sequence(2)
    assert series == [(0, pytest.approx(expected[0])), (4, pytest.approx(expected[1])), (8, pytest.approx(expected[2]))]
    assert trainer.lr_used[4] == pytest.approx(expected[1])  # the first step of epoch 1 used it


class ReturnedStepScheduler(TinyTrainer):
    """The scheduler comes back in Lightning's dict with its own interval, against the config's "epoch"."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, halving)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_none_interval_follows_a_returned_schedulers_own_interval():
    monitor = LearningRateMonitor()
    trainer, logger = run(ReturnedStepScheduler, monitor, log_every_n_steps=1)  # config: scheduler_interval="epoch"
    assert trainer.scheduler_interval(trainer.lr_scheduler) == "step"
    series = logger.series("lr-optimizer")
    assert [s for s, _ in series] == list(range(9))  # logged per step, as the scheduler steps
    assert [v for _, v in series] == pytest.approx(scheduler_sequence(8))


def test_none_interval_logs_unscheduled_optimizers_per_step():
    _, logger = run(TinyTrainer, LearningRateMonitor(), n_epochs=1, log_every_n_steps=2)
    assert logger.series("lr-optimizer") == [(0, 0.1), (2, 0.1), (4, 0.1)]


def test_forced_epoch_interval_never_logs_per_step():
    _, logger = run(ScheduledTrainer, LearningRateMonitor("epoch"), scheduler_interval="step", log_every_n_steps=1)
    assert [s for s, _ in logger.series("lr-optimizer")] == [0, 4]
    assert [v for _, v in logger.series("lr-optimizer")] == pytest.approx([0.1, 0.1 * 0.5**4])


class GroupsTrainer(TinyTrainer):
    """Two optimizers: SGD with two param groups (one named), Adam with one."""

    def __init__(self, config: Any, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.other = torch.nn.Linear(4, 1)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(
            [
                {"params": [self.model.weight], "lr": 0.1},
                {"params": [self.model.bias], "lr": 0.01, "momentum": 0.5, "weight_decay": 0.2},
            ],
            lr=0.1,
        )
        self.adam = torch.optim.Adam(self.other.parameters(), lr=0.003, betas=(0.8, 0.99))

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.model(x) + self.other(x), y)
        return {"loss": loss}


def test_param_groups_momentum_and_weight_decay_keys():
    monitor = LearningRateMonitor("step", log_momentum=True, log_weight_decay=True)
    _, logger = run(GroupsTrainer, monitor, n_epochs=1, log_every_n_steps=4)
    step, first = logger.history[0]
    assert step == 0
    assert first["lr-optimizer/pg1"] == pytest.approx(0.1)
    assert first["lr-optimizer/pg2"] == pytest.approx(0.01)
    assert first["lr-optimizer/pg1-momentum"] == 0.0
    assert first["lr-optimizer/pg2-momentum"] == pytest.approx(0.5)
    assert first["lr-optimizer/pg2-weight_decay"] == pytest.approx(0.2)
    assert first["lr-adam"] == pytest.approx(0.003)
    assert first["lr-adam-momentum"] == pytest.approx(0.8)  # betas[0]
    assert first["lr-adam-weight_decay"] == 0.0
    assert [s for s, _ in logger.series("lr-adam")] == [0, 4]


class AdagradTrainer(TinyTrainer):
    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.Adagrad([{"params": self.model.parameters(), "name": "body"}], lr=0.05)


def test_named_group_and_missing_momentum_warning():
    monitor = LearningRateMonitor("step", log_momentum=True)
    with pytest.warns(RuntimeWarning, match=r"\['optimizer'\] have no momentum"):
        _, logger = run(AdagradTrainer, monitor, n_epochs=1, log_every_n_steps=4)
    assert logger.history[0] == (0, {"lr-optimizer/body": 0.05, "lr-optimizer/body-momentum": 0.0})


def test_invalid_interval_is_a_config_error():
    with pytest.raises(ConfigError, match=r"logging_interval='steps'.*None, 'step', 'epoch'"):
        LearningRateMonitor(logging_interval="steps")
