"""The loop: a Trainer Guide style custom `training_loop()`, validation cadence and sanity check, eval mode,
setup errors, attribute discovery, `wrap_model` and `compile_model`."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import make_regression_data as regression_data
from helpers import plain_config as cfg
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import Callback, DreamTrainer, DreamTrainerConfig, MemoryLogger, MisconfigurationError


class Trainer(DreamTrainer):
    """Linear regression, SGD; `n_train`/`batch_size` train batches, `n_val` validation samples in
    batches of 4 (0: no validation loader). Records train/eval mode seen in each step."""

    def __init__(
        self, config: DreamTrainerConfig, n_train: int = 32, n_val: int = 8, batch_size: int = 8, lr: float = 0.05
    ) -> None:
        super().__init__(config)
        torch.manual_seed(0)
        self.model = nn.Linear(4, 1)
        self.lr = lr
        self.n_train = n_train
        self.n_val = n_val
        self.batch_size = batch_size
        self.losses: list[float] = []
        self.train_modes: list[bool] = []
        self.val_modes: list[bool] = []
        self.val_grad_enabled: list[bool] = []

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr)

    def configure_dataloaders(self) -> tuple[DataLoader, DataLoader | None]:
        x, y = regression_data(self.n_train + self.n_val)
        train = DataLoader(TensorDataset(x[: self.n_train], y[: self.n_train]), batch_size=self.batch_size)
        val = None
        if self.n_val:
            val = DataLoader(TensorDataset(x[self.n_train :], y[self.n_train :]), batch_size=4)
        return train, val

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        self.train_modes.append(self.model.training)
        loss = F.mse_loss(self.model(x), y)
        self.losses.append(float(loss.detach()))
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        self.val_modes.append(self.model.training)
        self.val_grad_enabled.append(torch.is_grad_enabled())
        return {"val_loss": F.mse_loss(self.model(x), y)}


class ValidationRecorder(Callback):
    """Global steps of real (non-sanity) validation runs, and validation batches run while sanity checking."""

    def __init__(self) -> None:
        self.val_steps: list[int] = []
        self.sanity_starts = 0
        self.sanity_batches = 0
        self.epoch_starts = 0
        self.epoch_ends = 0
        self.train_batches = 0

    def on_validation_start(self, trainer: DreamTrainer) -> None:
        if not trainer.sanity_checking:
            self.val_steps.append(trainer.global_step)

    def on_sanity_check_start(self, trainer: DreamTrainer) -> None:
        self.sanity_starts += 1

    def on_validation_batch_start(self, trainer: DreamTrainer, batch: Any, batch_idx: int) -> None:
        if trainer.sanity_checking:
            self.sanity_batches += 1

    def on_train_epoch_start(self, trainer: DreamTrainer) -> None:
        self.epoch_starts += 1

    def on_train_epoch_end(self, trainer: DreamTrainer) -> None:
        self.epoch_ends += 1

    def on_train_batch_start(self, trainer: DreamTrainer, batch: Any, batch_idx: int) -> None:
        self.train_batches += 1


# --- a custom training_loop (seed 004) ------------------------------------------------------------


class CustomLoopTrainer(Trainer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.val_results: list[dict[str, float]] = []
        self.step_outputs: list[Any] = []

    def training_loop(self) -> None:
        """Custom training loop, exactly as the Trainer Guide writes it."""
        for _epoch in range(self.current_epoch, self.config.n_epochs):
            # Training
            self.model.train()
            for batch_idx, batch in enumerate(self.train_loader):
                # Custom training logic
                outputs = self.training_step(batch, batch_idx)
                self.step_outputs.append(outputs)

                # Custom logging
                self.log_metrics(outputs)

            # Validation
            if self.should_validate():
                self.val_results.append(self.validation_loop())


def test_custom_training_loop_learns_and_keeps_counters(tmp_path: Any) -> None:
    rec = ValidationRecorder()
    logger = MemoryLogger()
    t = CustomLoopTrainer(cfg(tmp_path, n_epochs=6, callbacks=[rec], loggers=[logger]))
    w0 = t.model.weight.detach().clone()
    t.fit()
    # the full step ran: backward + optimizer step on every batch
    assert not torch.equal(w0, t.model.weight)
    assert t.global_step == 6 * 4
    assert t.current_epoch == 6
    assert rec.epoch_starts == rec.epoch_ends == 6
    assert rec.train_batches == 24
    first, last = sum(t.losses[:4]) / 4, sum(t.losses[-4:]) / 4
    assert last < 0.2 * first, (first, last)
    # validation every epoch, each returning the metrics
    assert len(t.val_results) == 6
    assert all(set(r) == {"val_loss"} and isinstance(r["val_loss"], float) for r in t.val_results)
    assert t.val_results[-1]["val_loss"] < t.val_results[0]["val_loss"]
    assert rec.val_steps == [4, 8, 12, 16, 20, 24]
    # log_metrics(outputs) reached the logger at each training step with that step's loss
    logged: dict[int, list[float]] = {}
    for step, metrics in logger.history:
        if "loss" in metrics:
            logged.setdefault(step, []).append(metrics["loss"])
    for k, loss in enumerate(t.losses, start=1):
        assert any(v == pytest.approx(loss, rel=1e-5) for v in logged.get(k, [])), k


def test_custom_training_loop_with_validation_every_two_epochs(tmp_path: Any) -> None:
    rec = ValidationRecorder()
    t = CustomLoopTrainer(cfg(tmp_path, n_epochs=4, val_every_n_epochs=2, callbacks=[rec]))
    t.fit()
    assert rec.val_steps == [8, 16]
    assert len(t.val_results) == 2


def test_custom_training_loop_with_accumulation(tmp_path: Any) -> None:
    t = CustomLoopTrainer(cfg(tmp_path, n_epochs=2, gradient_accumulation_steps=2))
    t.fit()
    assert t.global_step == 4  # 2 windows of 2 batches per epoch
    assert t.current_epoch == 2


# --- validation cadence and sanity check ----------------------------------------------------------


def test_val_every_n_epochs(tmp_path: Any) -> None:
    rec = ValidationRecorder()
    Trainer(cfg(tmp_path, n_epochs=4, val_every_n_epochs=2, callbacks=[rec])).fit()
    assert rec.val_steps == [8, 16]


def test_val_every_n_steps_only(tmp_path: Any) -> None:
    rec = ValidationRecorder()
    Trainer(cfg(tmp_path, n_epochs=2, val_every_n_epochs=None, val_every_n_steps=3, callbacks=[rec])).fit()
    assert rec.val_steps == [3, 6]


def test_val_every_n_steps_and_epochs_do_not_validate_twice(tmp_path: Any) -> None:
    rec = ValidationRecorder()
    Trainer(cfg(tmp_path, n_epochs=2, val_every_n_epochs=1, val_every_n_steps=2, callbacks=[rec])).fit()
    assert rec.val_steps == [2, 4, 6, 8]


def test_val_every_n_steps_counts_windows(tmp_path: Any) -> None:
    rec = ValidationRecorder()
    config = cfg(tmp_path, n_epochs=2, val_every_n_epochs=None, val_every_n_steps=1, gradient_accumulation_steps=2)
    config.callbacks.append(rec)
    Trainer(config).fit()
    assert rec.val_steps == [1, 2, 3, 4]


@pytest.mark.parametrize(("setting", "starts", "batches"), [(0, 0, 0), (1, 1, 1), (2, 1, 2), (-1, 1, 5)])
def test_num_sanity_val_steps(tmp_path: Any, setting: int, starts: int, batches: int) -> None:
    rec = ValidationRecorder()
    t = Trainer(cfg(tmp_path, n_epochs=1, num_sanity_val_steps=setting, callbacks=[rec]), n_val=20)  # 5 val batches
    t.fit()
    assert rec.sanity_starts == starts
    assert rec.sanity_batches == batches
    assert rec.val_steps == [4]  # the sanity run is not a real validation


def test_sanity_check_does_not_train_or_count(tmp_path: Any) -> None:
    class SeesSanity(Callback):
        def on_sanity_check_end(self, trainer: DreamTrainer) -> None:
            self.step_after = trainer.global_step
            self.weight_after = trainer.model.weight.detach().clone()  # type: ignore[attr-defined]

    cb = SeesSanity()
    logger = MemoryLogger()
    t = Trainer(cfg(tmp_path, n_epochs=1, num_sanity_val_steps=-1, callbacks=[cb], loggers=[logger]))
    w0 = t.model.weight.detach().clone()
    t.fit()
    assert cb.step_after == 0
    assert torch.equal(cb.weight_after, w0)
    # the sanity run is not logged: val_loss is written once, by the end-of-epoch validation
    assert [s for s, _ in logger.series("val_loss")] == [4]
    assert not torch.equal(w0, t.model.weight)


def test_validation_uses_eval_mode_no_grad_and_restores_train_mode(tmp_path: Any) -> None:
    t = Trainer(cfg(tmp_path, n_epochs=2, num_sanity_val_steps=2))
    t.fit()
    assert t.val_modes and not any(t.val_modes)
    assert not any(t.val_grad_enabled)
    assert t.train_modes and all(t.train_modes)  # training after each validation ran in train mode
    assert t.model.training


def test_validation_restores_a_frozen_models_eval_mode(tmp_path: Any) -> None:
    class WithTeacher(Trainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.teacher = nn.Linear(4, 1).eval()
            self.teacher.requires_grad_(False)

    t = WithTeacher(cfg(tmp_path, n_epochs=1, num_sanity_val_steps=1))
    t.fit()
    assert not t.teacher.training
    assert t.model.training


def test_validation_loop_can_be_called_directly_and_returns_means(tmp_path: Any) -> None:
    t = Trainer(cfg(tmp_path, n_epochs=1), n_val=12)  # 3 batches of 4
    t.fit()
    result = t.validation_loop()
    x, y = regression_data(44)
    with torch.no_grad():
        expected = F.mse_loss(t.model(x[32:]), y[32:]).item()
    assert set(result) == {"val_loss"}
    assert result["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert t.model.training


# --- setup errors ---------------------------------------------------------------------------------


def test_missing_training_step_is_a_misconfiguration(tmp_path: Any) -> None:
    class NoStep(DreamTrainer):
        def __init__(self, config: DreamTrainerConfig) -> None:
            super().__init__(config)
            self.model = nn.Linear(4, 1)

        def configure_optimizers(self) -> None:
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

        def configure_dataloaders(self) -> Any:
            return DataLoader(TensorDataset(*regression_data(8)), batch_size=4), None

    with pytest.raises(MisconfigurationError, match=r"def training_step\(self, batch, batch_idx\)"):
        NoStep(cfg(tmp_path)).fit()


def test_missing_optimizer_is_a_misconfiguration(tmp_path: Any) -> None:
    class NoOptimizer(Trainer):
        def configure_optimizers(self) -> None:
            pass

    with pytest.raises(MisconfigurationError, match="configure_optimizers") as info:
        NoOptimizer(cfg(tmp_path)).fit()
    assert "self.optimizer = " in str(info.value)


def test_val_loader_without_validation_step_is_a_misconfiguration(tmp_path: Any) -> None:
    class NoValStep(Trainer):
        validation_step = DreamTrainer.validation_step

    with pytest.raises(MisconfigurationError, match=r"def validation_step\(self, batch, batch_idx\)"):
        NoValStep(cfg(tmp_path)).fit()
    # without a validation loader the same trainer trains fine
    t = NoValStep(cfg(tmp_path), n_val=0)
    t.fit()
    assert t.global_step == 4


def test_misconfiguration_fires_on_exception_and_teardown(tmp_path: Any) -> None:
    class Seen(Callback):
        def __init__(self) -> None:
            self.hooks: list[str] = []

        def on_exception(self, trainer: DreamTrainer, exception: BaseException) -> None:
            self.hooks.append("on_exception")

        def teardown(self, trainer: DreamTrainer, stage: str) -> None:
            self.hooks.append("teardown")

    class NoOptimizer(Trainer):
        def configure_optimizers(self) -> None:
            pass

    cb = Seen()
    with pytest.raises(MisconfigurationError):
        NoOptimizer(cfg(tmp_path, callbacks=[cb])).fit()
    assert cb.hooks == ["on_exception", "teardown"]


# --- discovery, wrap_model, compile ---------------------------------------------------------------


class GANLike(DreamTrainer):
    def __init__(self, config: DreamTrainerConfig) -> None:
        super().__init__(config)
        self.generator = nn.Linear(2, 2)
        self.not_a_model = torch.zeros(3)
        self.lr = 0.1

    def configure_models(self) -> None:
        self.discriminator = nn.Linear(2, 1)

    def configure_optimizers(self) -> None:
        self.g_optimizer = torch.optim.SGD(self.generator.parameters(), lr=self.lr)
        self.d_optimizer = torch.optim.SGD(self.discriminator.parameters(), lr=self.lr)
        self.g_scheduler = torch.optim.lr_scheduler.StepLR(self.g_optimizer, step_size=1)
        self.d_scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(self.d_optimizer)

    def configure_dataloaders(self) -> Any:
        return DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4), None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        (z,) = batch
        return {"loss": self.discriminator(self.generator(z)).mean()}


def test_named_models_optimizers_schedulers(tmp_path: Any) -> None:
    t = GANLike(cfg(tmp_path, scheduler_monitor="loss"))
    assert [n for n, _ in t.named_models()] == ["generator"]
    t.fit()
    assert [n for n, _ in t.named_models()] == ["generator", "discriminator"]
    assert dict(t.named_models())["discriminator"] is t.discriminator
    assert [n for n, _ in t.named_optimizers()] == ["g_optimizer", "d_optimizer"]
    assert dict(t.named_optimizers())["d_optimizer"] is t.d_optimizer
    assert [n for n, _ in t.named_schedulers()] == ["g_scheduler", "d_scheduler"]
    assert dict(t.named_schedulers())["d_scheduler"] is t.d_scheduler


def test_wrap_model_is_idempotent(tmp_path: Any) -> None:
    t = Trainer(cfg(tmp_path))
    m = nn.Linear(2, 2)
    once = t.wrap_model(m)
    assert t.wrap_model(once) is once
    assert next(once.parameters()).device == t.device


def test_wrap_model_by_hand_in_configure_models_is_not_wrapped_twice(tmp_path: Any) -> None:
    """Seed 004's multi-model example calls wrap_model itself; setup wraps the same models again."""

    class WrapsItself(Trainer):
        def configure_models(self) -> None:
            self.model = self.wrap_model(self.model)
            self.wrapped_in_configure = self.model

    t = WrapsItself(cfg(tmp_path))
    t.fit()
    assert t.model is t.wrapped_in_configure
    assert t.global_step == 4


@pytest.mark.slow  # torch.compile on CPU: about 1 s with aot_eager (inductor: 3 s warm, 10-25 s cold)
def test_compile_model_compiles_and_wrap_model_stays_idempotent(tmp_path: Any, monkeypatch: Any) -> None:
    class CompiledTrainer(Trainer):
        def configure_models(self) -> None:
            self.wrapped_in_configure = self.wrap_model(self.model)
            self.model = self.wrapped_in_configure

    # The trainer's torch.compile call, with the aot_eager backend: dynamo captures the model and
    # AOTAutograd splits forward and backward as with inductor, without generating and compiling C++
    # kernels (inductor's own part, run by the slow examples test of the Trainer Guide's compile part).
    compile_calls: list[Any] = []
    real_compile = torch.compile

    def compile_aot_eager(model: Any, **kwargs: Any) -> Any:
        compile_calls.append(model)
        return real_compile(model, **{"backend": "aot_eager", **kwargs})

    monkeypatch.setattr(torch, "compile", compile_aot_eager)
    t = CompiledTrainer(cfg(tmp_path, n_epochs=2, compile_model=True), n_val=0)
    original = t.model
    t.fit()
    assert compile_calls == [original]  # the trainer compiled the model, once
    assert isinstance(t.model, torch._dynamo.eval_frame.OptimizedModule)
    assert t.model is t.wrapped_in_configure  # compiled once, not a compile of a compile
    assert t.model._orig_mod is original
    assert not torch.equal(t.model._orig_mod.weight, torch.zeros_like(original.weight))
    assert t.global_step == 8
    assert sum(t.losses[-4:]) < sum(t.losses[:4])
    assert t.wrap_model(t.model) is t.model
