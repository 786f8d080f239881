"""The tuner: the learning-rate range test and the batch-size finder, and that both leave the trainer as
they found it (weights, optimizer state, RNG, counters, no files, nothing logged)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import make_regression_data, quiet_config
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig, MemoryLogger, MisconfigurationError
from dream_trainer.tuner import LRFinderResult, Tuner, is_oom_error, lr_find, scale_batch_size


class Regression(DreamTrainer):
    """A small MLP regression with SGD and momentum (optimizer state to restore) and a shuffling loader."""

    def __init__(self, config: DreamTrainerConfig, batch_size: int = 16, oom_above: int | None = None) -> None:
        super().__init__(config)
        self.batch_size = batch_size
        self.oom_above = oom_above  # a forward on more samples raises torch.OutOfMemoryError
        self.seen: list[int] = []  # the batch size of every training step

    def configure_models(self) -> None:
        self.model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)

    def configure_dataloaders(self) -> tuple[DataLoader, DataLoader]:
        x, y = make_regression_data(256)
        data = TensorDataset(x, y)
        return DataLoader(data, batch_size=self.batch_size, shuffle=True), DataLoader(data, batch_size=64)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.seen.append(len(x))
        if self.oom_above is not None and len(x) > self.oom_above:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(x)} rows")
        return F.mse_loss(self.model(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y)}


def _config(tmp_path: Path, **overrides: Any) -> DreamTrainerConfig:
    return quiet_config(tmp_path, enable_checkpointing=True, n_epochs=1, **overrides)


def _state(trainer: DreamTrainer) -> dict[str, Any]:
    """Copies of everything the tuner must put back."""
    return {
        "weights": {k: v.clone() for k, v in trainer.model.state_dict().items()},
        "optimizer": _tensors(trainer.optimizer.state_dict()),
        "lr": [g["lr"] for g in trainer.optimizer.param_groups],
        "rng": torch.get_rng_state(),
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "metrics": dict(trainer.callback_metrics),
        "training": trainer.model.training,
    }


def _tensors(obj: Any) -> list[Any]:
    """Every tensor and number of an optimizer state dict, in order."""
    if isinstance(obj, dict):
        return [x for k in sorted(obj, key=str) for x in [k, *_tensors(obj[k])]]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _tensors(v)]
    return [obj.clone() if isinstance(obj, torch.Tensor) else obj]


def _assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before["weights"].keys() == after["weights"].keys()
    assert all(torch.equal(before["weights"][k], after["weights"][k]) for k in before["weights"])
    assert len(before["optimizer"]) == len(after["optimizer"])
    for a, b in zip(before["optimizer"], after["optimizer"], strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert torch.equal(before["rng"], after["rng"])
    for key in ("lr", "global_step", "epoch", "metrics", "training"):
        assert before[key] == after[key], key


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name != ".lock")


# --- the learning-rate finder --------------------------------------------------------------------------
def test_lr_find_suggests_the_steepest_descent_writes_a_png_and_restores_everything(tmp_path):
    logger = MemoryLogger()
    trainer = Regression(_config(tmp_path / "runs", loggers=[logger]))
    trainer.fit()  # optimizer state, counters, metrics, checkpoints and logs to compare against
    files, logged = _files(tmp_path / "runs"), len(logger.history)
    before = _state(trainer)

    result = Tuner(trainer).lr_find(min_lr=1e-5, max_lr=10.0, num_training=60, plot_path=tmp_path / "lr.png")

    _assert_same(before, _state(trainer))
    assert _files(tmp_path / "runs") == files and len(logger.history) == logged  # nothing written or logged
    # The curve, recomputed here from the raw losses: a bias-corrected moving average (beta 0.98).
    assert isinstance(result, LRFinderResult) and result.mode == "exponential"
    n = len(result.raw_losses)
    assert len(result.lrs) == len(result.losses) == n
    assert result.lrs[0] == pytest.approx(1e-5)
    assert np.allclose(np.diff(np.log(result.lrs)), np.log(10.0 / 1e-5) / 59)
    average, expected = 0.0, []
    for i, loss in enumerate(result.raw_losses):
        average = 0.98 * average + 0.02 * loss
        expected.append(average / (1 - 0.98 ** (i + 1)))
    assert np.allclose(result.losses, expected)
    # lr 10 makes SGD diverge: stopped once the smoothed loss passed 4x its best.
    assert result.stopped_early and n < 60
    assert result.losses[-1] > 4 * min(result.losses[:-1])
    # The suggestion: argmin of the gradient of the smoothed loss, first 10 and last point skipped.
    index = 10 + int(np.argmin(np.gradient(np.array(result.losses[10 : n - 1]))))
    assert result.suggested_index == index
    assert result.suggestion() == result.lrs[index]
    assert result.losses[index] < result.losses[0]  # on the falling part of the curve
    assert 1e-5 < result.suggestion() < result.lrs[int(np.argmin(result.losses))]
    with Image.open(tmp_path / "lr.png") as image:
        assert (image.format, image.size) == ("PNG", (640, 400))
        image.load()  # the whole file decodes
    assert result.plot(tmp_path / "small.png", size=(320, 200)).is_file()


def test_training_after_lr_find_is_the_run_without_it(tmp_path):
    tuned = Regression(_config(tmp_path / "a"))
    lr_find(tuned, num_training=20, mode="linear", min_lr=1e-4, max_lr=0.1)
    assert tuned.global_step == 0 and not (tmp_path / "a").exists()  # no run directory claimed
    tuned.fit()
    plain = Regression(_config(tmp_path / "b"))
    plain.fit()
    assert tuned.global_step == plain.global_step == 16
    for a, b in zip(tuned.model.parameters(), plain.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_lr_find_restores_the_fp16_loss_scaler(tmp_path):
    trainer = Regression(_config(tmp_path, mixed_precision="fp16"))
    trainer.fit()
    scaler = trainer.grad_scaler.state_dict()
    before = _state(trainer)
    lr_find(trainer, num_training=15, max_lr=100.0)  # overflows move the scale while it runs
    _assert_same(before, _state(trainer))
    assert trainer.grad_scaler.state_dict() == scaler


def test_lr_find_linear_schedule_and_accumulation(tmp_path):
    trainer = Regression(_config(tmp_path, gradient_accumulation_steps=2))
    result = lr_find(trainer, min_lr=0.001, max_lr=0.01, num_training=10, mode="linear", early_stop_threshold=None)
    assert result.lrs == pytest.approx([0.001 + i * 0.001 for i in range(10)])
    assert len(trainer.seen) == 20  # two micro-batches per optimizer step
    assert not result.stopped_early and result.suggestion() is None  # 10 points, 10 skipped: nothing to suggest


def test_lr_find_refuses_bad_arguments_and_ambiguous_optimizers(tmp_path):
    trainer = Regression(_config(tmp_path))
    with pytest.raises(ValueError, match=r"mode='cubic'.*'exponential', 'linear'"):
        lr_find(trainer, mode="cubic")
    with pytest.raises(ValueError, match="max_lr=1e-09"):
        lr_find(trainer, max_lr=1e-9)

    class TwoOptimizers(Regression):
        def configure_optimizers(self) -> None:
            super().configure_optimizers()
            self.other = torch.optim.SGD(self.model.parameters(), lr=0.1)

    two = TwoOptimizers(_config(tmp_path))
    with pytest.raises(MisconfigurationError, match=r"2 optimizers.*optimizer='optimizer'"):
        lr_find(two, num_training=5)
    result = lr_find(two, num_training=5, optimizer="other", early_stop_threshold=None)
    assert len(result.lrs) == 5 and two.other.param_groups[0]["lr"] == 0.1


# --- the batch-size finder -----------------------------------------------------------------------------
def test_scale_batch_size_power_finds_the_largest_power_of_two_and_restores(tmp_path):
    trainer = Regression(_config(tmp_path / "runs"), batch_size=16, oom_above=64)
    trainer.fit()
    files = _files(tmp_path / "runs")
    before = _state(trainer)
    trainer.seen.clear()

    found = Tuner(trainer).scale_batch_size(mode="power", init_val=2, steps_per_trial=3)

    assert found == 64 and trainer.batch_size == 64
    assert [trainer.seen[i] for i in range(0, len(trainer.seen), 3)] == [2, 4, 8, 16, 32, 64, 128]
    _assert_same(before, _state(trainer))
    assert _files(tmp_path / "runs") == files
    assert trainer.train_loader.loader.batch_size == 64  # the loaders were built again with it
    trainer.seen.clear()
    trainer.config.n_epochs = 2
    trainer.fit()  # one more epoch, on the found size
    assert set(trainer.seen) == {64} and trainer.global_step == 16 + 4


def test_scale_batch_size_binsearch_finds_the_exact_boundary(tmp_path):
    trainer = Regression(_config(tmp_path / "runs"), oom_above=48)
    found = scale_batch_size(trainer, mode="binsearch", init_val=2, steps_per_trial=2)
    assert found == 48 and trainer.batch_size == 48
    tried = [trainer.seen[0]] + [b for a, b in zip(trainer.seen, trainer.seen[1:], strict=False) if a != b]
    assert tried == [2, 4, 8, 16, 32, 64, 48, 56, 52, 50, 49]
    assert trainer.global_step == 0 and not (tmp_path / "runs").exists()


def test_scale_batch_size_stops_at_the_dataset_size_and_uses_a_config_field(tmp_path):
    from dataclasses import dataclass

    @dataclass
    class Config(DreamTrainerConfig):
        batch_size: int = 8

    class FromConfig(Regression):
        def configure_dataloaders(self) -> tuple[DataLoader, None]:
            x, y = make_regression_data(40)
            return DataLoader(TensorDataset(x, y), batch_size=self.config.batch_size), None

    trainer = FromConfig(Config(device="cpu", root_dir=str(tmp_path), loggers=[], enable_progress_bar=False))
    del trainer.batch_size  # only the config holds it
    assert scale_batch_size(trainer, batch_arg_name="batch_size") == 40
    assert trainer.config.batch_size == 40


def test_scale_batch_size_errors(tmp_path):
    trainer = Regression(_config(tmp_path), oom_above=0)
    with pytest.raises(MisconfigurationError, match="even a batch of 1"):
        scale_batch_size(trainer, init_val=4)
    assert trainer.batch_size == 16  # the original value is back
    with pytest.raises(MisconfigurationError, match=r"neither Regression.bs nor config.bs"):
        scale_batch_size(trainer, batch_arg_name="bs")
    with pytest.raises(ValueError, match=r"mode='linear'.*'power', 'binsearch'"):
        scale_batch_size(trainer, mode="linear")

    class Broken(Regression):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if len(batch[0]) > 4:
                raise RuntimeError("shape mismatch")  # not a memory error: it propagates
            return super().training_step(batch, batch_idx)

    broken = Broken(_config(tmp_path))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        scale_batch_size(broken)
    assert broken.batch_size == 16 and broken.train_loader.loader.batch_size == 16


@pytest.mark.parametrize(
    ("exc", "oom"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"), True),
        (RuntimeError("MPS backend out of memory"), True),
        (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (ValueError("out of memory"), False),
    ],
)
def test_is_oom_error(exc: BaseException, oom: bool) -> None:
    assert is_oom_error(exc) is oom
