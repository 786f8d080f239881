"""The trainer, data and cases shared by tests/test_model_parallel.py and its torchrun worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import Callback, DreamTrainer, DreamTrainerConfig
from dream_trainer.callbacks import EMA, GradientNormMonitor, ModelCheckpoint

DIM, HIDDEN, OUT, SAMPLES, GLOBAL_BATCH = 8, 16, 4, 64, 8

# Every case trains 2 epochs of 8 global batches, 2 per step: 8 steps.
CASES: dict[str, dict[str, Any]] = {
    "tp_fsdp": {"dp_shard": 2, "tensor_parallel": 2},
    "hsdp": {"dp_replicate": 2, "dp_shard": 2},
    "pp_dp": {"pipeline_parallel": 2, "dp_shard": 2, "pipeline_schedule": "1f1b"},
    "tp_pp": {"tensor_parallel": 2, "pipeline_parallel": 2, "dp_shard": 1, "pipeline_schedule": "gpipe"},
    "meta_fsdp": {"dp_shard": 4, "strategy": "fsdp", "init_device": "meta"},
    "resume_2d": {"dp_shard": 2, "tensor_parallel": 2},
    "reshard": {"dp_shard": 4, "strategy": "fsdp"},
    # Callbacks over DTensor parameters: EMA and GradientNormMonitor (no clipping: the norms stay raw).
    "ema_grad_norm": {"dp_shard": 2, "tensor_parallel": 2, "gradient_clip_val": None},
    # fp16 with the gradients on two meshes, the first parameter's on "dp_shard" alone; an inf at step 2.
    "fp16_2d": {"dp_shard": 2, "tensor_parallel": 2, "mixed_precision": "fp16"},
    # Dropout on a sharded and on a replicated activation, meta-device init; then a crash and a resume.
    "dropout_2d": {"dp_shard": 2, "tensor_parallel": 2, "init_device": "meta"},
    "dropout_resume": {"dp_shard": 2, "tensor_parallel": 2, "init_device": "meta"},
}


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(DIM, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, OUT),
    )


def dataset(seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, DIM, generator=g)
    return TensorDataset(x, torch.tanh(x[:, :OUT] * 2.0) + 0.1 * torch.randn(SAMPLES, OUT, generator=g))


class Trainer(DreamTrainer):
    """An MLP as an `nn.Sequential` (so the default pipeline split applies), AdamW, MSE."""

    def __init__(self, config: DreamTrainerConfig) -> None:
        super().__init__(config)
        self.recorded_losses: list[float] = []
        self.recorded_grad_norms: list[tuple[int, str, float]] = []  # (step, key, value) as logged

    def log_metrics(self, metrics: Any, step: int | None = None) -> None:
        super().log_metrics(metrics, step)
        for key, value in metrics.items():
            if key.startswith("grad_norm/"):
                self.recorded_grad_norms.append((self.global_step if step is None else step, key, float(value)))

    def configure_models(self) -> None:
        self.model = build_model()

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], DataLoader[Any]]:
        # Each data-parallel rank reads its slice of every global batch (the automatic sampler).
        batch = GLOBAL_BATCH // self.dp_world_size
        return DataLoader(dataset(), batch_size=batch), DataLoader(dataset(seed=2), batch_size=batch)

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"val_loss": self.pipeline_forward(x, y)}  # forward only under a pipeline, too

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs, targets)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        loss = self.pipeline_forward(x, y)
        self.recorded_losses.append(float(loss.detach()))
        return {"loss": loss}


class CrashAfter(Callback):
    """Raises once `global_step` reaches `step` (every rank at the same point)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.loop.step_ended and trainer.global_step >= self.step:
            raise RuntimeError(f"crash at step {trainer.global_step}")


class LayerNorms(Callback):
    """Every step, GradientNormMonitor(per_layer=True)'s norms (per parameter and total), as floats."""

    def __init__(self) -> None:
        self.monitor = GradientNormMonitor(per_layer=True)
        self.norms: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer: Any, optimizer: Any) -> None:
        self.norms.append({k: float(v) for k, v in self.monitor.compute_norms(trainer, optimizer).items()})


class InfGradAt(Callback):
    """At `step`, fills one rank's (`rank`) part of `model[layer].weight`'s gradient with inf, once the
    gradient exists (under FSDP2, after the window's last backward)."""

    def __init__(self, step: int = 2, rank: int = 1, layer: int = 2) -> None:
        self.step, self.rank, self.layer = step, rank, layer

    def on_after_backward(self, trainer: Any) -> None:
        grad = trainer.model[self.layer].weight.grad
        if trainer.global_step == self.step and trainer.global_rank == self.rank and grad is not None:
            (grad.to_local() if hasattr(grad, "to_local") else grad).fill_(float("inf"))


def ema_callbacks() -> list[Any]:
    """The callbacks of the "ema_grad_norm" case: an EMA (decay 0.8, so 8 steps move it well away from
    both the initial and the final weights), the logged total gradient norm of every step, and the
    per-parameter norms."""
    return [EMA(decay=0.8), GradientNormMonitor(log_every_n_steps=1), LayerNorms()]


def case_config(root: Path, *, callbacks: list[Any] | None = None, **overrides: Any) -> DreamTrainerConfig:
    kwargs: dict[str, Any] = {
        "root_dir": str(root),
        "device": "cpu",
        "n_epochs": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clip_val": 0.5,
        "loggers": [],
        "enable_progress_bar": False,
        "print_epoch_summary": False,
        "num_sanity_val_steps": 0,
        "callbacks": callbacks if callbacks is not None else [ModelCheckpoint(every_n_train_steps=3, save_last=True)],
    }
    kwargs.update(overrides)
    return DreamTrainerConfig(**kwargs)
