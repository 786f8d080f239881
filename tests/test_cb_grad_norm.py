"""GradientNormMonitor: logged norms equal the gradient the optimizer applies (after clipping), only on
logging steps, per optimizer and per layer, for any p-norm."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from conftest import TinyTrainer, quiet_config

from dream_trainer import Callback, ConfigError, MemoryLogger
from dream_trainer.callbacks.grad_norm import GradientNormMonitor


class Reference(Callback):
    """Computes, independently, the norms of the gradients each optimizer step applies, by step number."""

    def __init__(self, norm_type: float = 2.0) -> None:
        self.norm_type = norm_type
        self.total: dict[tuple[int, str], float] = {}
        self.layers: dict[tuple[int, str], float] = {}

    def on_before_optimizer_step(self, trainer: Any, optimizer: torch.optim.Optimizer) -> None:
        step = trainer.global_step + 1
        name = {id(o): n for n, o in trainer.named_optimizers()}[id(optimizer)]
        flat = torch.cat([p.grad.flatten() for g in optimizer.param_groups for p in g["params"]])
        self.total[(step, name)] = float(torch.linalg.vector_norm(flat, self.norm_type))
        for model_name, model in trainer.named_models():
            for pn, p in model.named_parameters():
                if p.grad is not None and any(p is q for g in optimizer.param_groups for q in g["params"]):
                    self.layers[(step, f"{model_name}.{pn}")] = float(torch.linalg.vector_norm(p.grad, self.norm_type))


def run(
    monitor: GradientNormMonitor, trainer_cls: type[TinyTrainer] = TinyTrainer, norm_type: float = 2.0, **overrides: Any
) -> tuple[Any, MemoryLogger, Reference]:
    logger, ref = MemoryLogger(), Reference(norm_type)
    settings: dict[str, Any] = {"n_epochs": 2, "callbacks": [monitor, ref], "loggers": [logger]}
    settings.update(overrides)
    trainer = trainer_cls(quiet_config(**settings), n_train=16, n_val=0)  # 4 steps per epoch
    trainer.fit()
    return trainer, logger, ref


def test_logged_norm_equals_the_reference_on_logging_steps():
    _, logger, ref = run(GradientNormMonitor(), log_every_n_steps=2)
    series = logger.series("grad_norm/optimizer")
    assert [s for s, _ in series] == [2, 4, 6, 8]
    for step, value in series:
        assert value == pytest.approx(ref.total[(step, "optimizer")], rel=1e-5)
    assert len({v for _, v in series}) == 4  # really per step, not one value repeated


def test_norm_is_taken_after_clipping():
    _, logger, ref = run(GradientNormMonitor(log_every_n_steps=1), gradient_clip_val=1e-3)
    series = logger.series("grad_norm/optimizer")
    assert len(series) == 8
    assert [v for _, v in series] == pytest.approx([1e-3] * 8, rel=1e-4)
    assert [v for _, v in series] == pytest.approx([ref.total[(s, "optimizer")] for s, _ in series], rel=1e-5)


def test_nothing_is_computed_on_non_logging_steps():
    monitor = GradientNormMonitor(log_every_n_steps=3)
    computed_at: list[int] = []
    original = monitor.compute_norms

    def counting(trainer: Any, optimizer: Any) -> dict[str, torch.Tensor]:
        computed_at.append(trainer.global_step + 1)
        return original(trainer, optimizer)

    monitor.compute_norms = counting  # type: ignore[method-assign]
    _, logger, _ = run(monitor)
    assert computed_at == [3, 6]
    assert [s for s, _ in logger.series("grad_norm/optimizer")] == [3, 6]


def test_default_cadence_is_config_log_every_n_steps_and_windows_count_as_one_step():
    _, logger, ref = run(GradientNormMonitor(), log_every_n_steps=2, gradient_accumulation_steps=2)
    series = logger.series("grad_norm/optimizer")  # 8 batches in windows of 2: 4 steps
    assert [s for s, _ in series] == [2, 4]
    assert [v for _, v in series] == pytest.approx([ref.total[(s, "optimizer")] for s, _ in series], rel=1e-5)


def test_per_layer_norms():
    _, logger, ref = run(GradientNormMonitor(per_layer=True, log_every_n_steps=4))
    step, logged = logger.history[0]
    assert step == 4
    assert set(logged) == {"grad_norm/optimizer", "grad_norm/model.weight", "grad_norm/model.bias"}
    weight, bias = logged["grad_norm/model.weight"], logged["grad_norm/model.bias"]
    assert weight == pytest.approx(ref.layers[(4, "model.weight")], rel=1e-5)
    assert bias == pytest.approx(ref.layers[(4, "model.bias")], rel=1e-5)
    assert logged["grad_norm/optimizer"] == pytest.approx(math.hypot(weight, bias), rel=1e-5)


@pytest.mark.parametrize("norm_type", [1.0, float("inf")])
def test_other_norm_types(norm_type):
    _, logger, ref = run(GradientNormMonitor(norm_type=norm_type, log_every_n_steps=4), norm_type=norm_type)
    series = logger.series("grad_norm/optimizer")
    assert [v for _, v in series] == pytest.approx([ref.total[(s, "optimizer")] for s, _ in series], rel=1e-5)


class TwoOptimizers(TinyTrainer):
    def __init__(self, config: Any, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.head = torch.nn.Linear(4, 1)

    def configure_optimizers(self) -> None:
        self.body_opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.head_opt = torch.optim.SGD(self.head.parameters(), lr=0.05)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"loss": torch.nn.functional.mse_loss(self.model(x) + 3 * self.head(x), y)}


def test_one_key_per_optimizer():
    _, logger, ref = run(GradientNormMonitor(log_every_n_steps=4), trainer_cls=TwoOptimizers)
    for name in ("body_opt", "head_opt"):
        series = logger.series(f"grad_norm/{name}")
        assert [s for s, _ in series] == [4, 8]
        assert [v for _, v in series] == pytest.approx([ref.total[(s, name)] for s, _ in series], rel=1e-5)
    assert logger.series("grad_norm/body_opt") != logger.series("grad_norm/head_opt")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"norm_type": 0}, r"norm_type=0"),
        ({"norm_type": "two"}, r"norm_type='two'"),
        ({"log_every_n_steps": 0}, r"log_every_n_steps=0"),
    ],
)
def test_invalid_arguments_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        GradientNormMonitor(**kwargs)


def test_inf_as_a_string():
    assert GradientNormMonitor(norm_type="inf").norm_type == math.inf
