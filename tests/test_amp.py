"""Mixed precision (DESIGN.md: `self.autocast()`, `config.mixed_precision`, the fp16 loss scaler), on CPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import make_regression_data as regression_data
from helpers import plain_config as cfg
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import Callback, DreamTrainer, DreamTrainerConfig


class AmpTrainer(DreamTrainer):
    """Linear regression; records the dtypes seen inside training_step/validation_step and every loss.

    `inf_batches` holds (epoch, batch_idx) pairs whose loss is multiplied by inf.
    """

    def __init__(self, config: DreamTrainerConfig, n: int = 64, batch_size: int = 8, lr: float = 0.05) -> None:
        super().__init__(config)
        torch.manual_seed(0)
        self.model = nn.Linear(4, 1)
        self.lr = lr
        self.n = n
        self.batch_size = batch_size
        self.inf_batches: set[tuple[int, int]] = set()
        self.losses: list[float] = []
        self.train_dtypes: list[torch.dtype] = []
        self.nested_dtypes: list[torch.dtype] = []
        self.val_dtypes: list[torch.dtype] = []

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr)

    def configure_dataloaders(self) -> tuple[DataLoader, DataLoader]:
        x, y = regression_data(self.n + 16)
        train = DataLoader(TensorDataset(x[: self.n], y[: self.n]), batch_size=self.batch_size)
        val = DataLoader(TensorDataset(x[self.n :], y[self.n :]), batch_size=8)
        return train, val

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        out = self.model(x)
        self.train_dtypes.append(out.dtype)
        with self.autocast():  # seed 004 writes this inside training_step; nesting must be harmless
            nested = self.model(x)
        self.nested_dtypes.append(nested.dtype)
        loss = F.mse_loss(out.float(), y)
        self.losses.append(float(loss.detach()))
        if (self.current_epoch, batch_idx) in self.inf_batches:
            loss = loss * float("inf")
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        out = self.model(x)
        self.val_dtypes.append(out.dtype)
        return {"val_loss": F.mse_loss(out.float(), y)}


def epoch_means(losses: list[float], per_epoch: int) -> list[float]:
    return [sum(losses[i : i + per_epoch]) / per_epoch for i in range(0, len(losses), per_epoch)]


def test_bf16_runs_under_autocast_and_learns(tmp_path: Any) -> None:
    t = AmpTrainer(cfg(tmp_path, n_epochs=5, mixed_precision="bf16"))
    t.fit()
    assert t.grad_scaler is None  # bf16 needs no loss scaling
    assert set(t.train_dtypes) == {torch.bfloat16}
    assert set(t.nested_dtypes) == {torch.bfloat16}
    assert t.val_dtypes and set(t.val_dtypes) == {torch.bfloat16}
    assert t.model.weight.dtype == torch.float32  # master weights stay fp32
    means = epoch_means(t.losses, 8)
    assert means[-1] < 0.2 * means[0], means
    with t.autocast():
        assert t.model(torch.randn(2, 4)).dtype == torch.bfloat16


def test_fp32_has_no_scaler_and_no_autocast(tmp_path: Any) -> None:
    t = AmpTrainer(cfg(tmp_path, n_epochs=1))
    t.fit()
    assert t.grad_scaler is None
    assert set(t.train_dtypes) == {torch.float32}
    assert set(t.nested_dtypes) == {torch.float32}
    assert set(t.val_dtypes) == {torch.float32}


class ScaleRecorder(Callback):
    def __init__(self) -> None:
        self.scale_before: dict[tuple[int, int], float] = {}
        self.scale_after: dict[tuple[int, int], float] = {}
        self.weights_before: dict[tuple[int, int], torch.Tensor] = {}
        self.weights_after: dict[tuple[int, int], torch.Tensor] = {}

    def on_train_batch_start(self, trainer: DreamTrainer, batch: Any, batch_idx: int) -> None:
        key = (trainer.current_epoch, batch_idx)
        self.scale_before[key] = trainer.grad_scaler.get_scale()  # type: ignore[union-attr]
        self.weights_before[key] = trainer.model.weight.detach().clone()  # type: ignore[attr-defined]

    def on_train_batch_end(self, trainer: DreamTrainer, outputs: Any, batch: Any, batch_idx: int) -> None:
        key = (trainer.current_epoch, batch_idx)
        self.scale_after[key] = trainer.grad_scaler.get_scale()  # type: ignore[union-attr]
        self.weights_after[key] = trainer.model.weight.detach().clone()  # type: ignore[attr-defined]


def test_fp16_uses_grad_scaler_and_learns(tmp_path: Any) -> None:
    rec = ScaleRecorder()
    t = AmpTrainer(cfg(tmp_path, n_epochs=5, mixed_precision="fp16", callbacks=[rec]))
    assert isinstance(t.grad_scaler, torch.amp.GradScaler)
    t.fit()
    assert set(t.train_dtypes) == {torch.float16}
    assert set(t.nested_dtypes) == {torch.float16}
    assert t.val_dtypes and set(t.val_dtypes) == {torch.float16}
    assert t.model.weight.dtype == torch.float32
    scale = t.grad_scaler.get_scale()  # type: ignore[union-attr]
    assert scale > 0 and scale != float("inf")
    means = epoch_means(t.losses, 8)
    assert means[-1] < 0.2 * means[0], means
    # the scaler works as PyTorch's recipe: a step is skipped exactly when the scale backs off (halves);
    # a few overflows while the initial scale (2**16) calibrates, then every step is taken
    skipped = 0
    for key in rec.weights_before:
        stepped = not torch.equal(rec.weights_before[key], rec.weights_after[key])
        if stepped:
            assert rec.scale_after[key] == rec.scale_before[key], key
        else:
            assert rec.scale_after[key] == rec.scale_before[key] * 0.5, key
            skipped += 1
    assert skipped <= 4


def test_fp16_inf_loss_skips_step_and_halves_scale(tmp_path: Any) -> None:
    rec = ScaleRecorder()
    t = AmpTrainer(cfg(tmp_path, n_epochs=2, mixed_precision="fp16", callbacks=[rec]))
    t.inf_batches = {(1, 3)}  # in the second epoch, once the initial scale has calibrated
    t.fit()
    bad = (1, 3)
    assert rec.scale_after[bad] == pytest.approx(rec.scale_before[bad] * 0.5)
    assert torch.equal(rec.weights_before[bad], rec.weights_after[bad])  # the scaler skipped the step
    # the steps around it were taken and the scale was left alone
    for key in [(1, 2), (1, 4)]:
        assert rec.scale_after[key] == rec.scale_before[key]
        assert not torch.equal(rec.weights_before[key], rec.weights_after[key])
    assert torch.isfinite(t.model.weight).all()


def test_fp16_clipping_sees_unscaled_gradients(tmp_path: Any) -> None:
    """Clipping happens after unscaling: the norm seen before the step is bounded by max_norm in real
    (unscaled) units, and the step is still taken."""

    class NormAtStep(Callback):
        def __init__(self) -> None:
            self.norms: list[float] = []

        def on_before_optimizer_step(self, trainer: DreamTrainer, optimizer: torch.optim.Optimizer) -> None:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            self.norms.append(float(torch.nn.utils.get_total_norm(grads)))

    rec = NormAtStep()
    t = AmpTrainer(cfg(tmp_path, n_epochs=1, mixed_precision="fp16", gradient_clip_val=0.5, callbacks=[rec]))
    w0 = t.model.weight.detach().clone()
    t.fit()
    assert len(rec.norms) == 8
    # overflowed steps (inf/nan while the scale calibrates) are skipped by the scaler; the others
    # are finite, unscaled and clipped
    finite = [n for n in rec.norms if n == n and n != float("inf")]
    assert len(finite) >= 4, rec.norms
    assert all(n <= 0.5 + 1e-4 for n in finite), rec.norms
    assert not torch.equal(w0, t.model.weight)
