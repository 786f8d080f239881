"""The Trainer Guide's snippets, assembled into one script that runs every one of them.

    python examples/trainer_guide.py                  # every part: ~10 s (compiling is most of it)
    python examples/trainer_guide.py --parts basic checkpoint

Each `# Guide: <section>` block is copied from the guide as written, in the guide's own layout (hence
the `# fmt: off` fences). Around them is only what the guide leaves to the user: a config with the
fields the snippets read, a generated `MyDataset`, the `criterion` and `compute_*` helpers, and the
lines of `training_step` that a snippet elides (marked "supplied").

Several snippets define the same method (three `configure_models`, three `configure_optimizers`, ...),
so each variant is its own small trainer class, built on `MyTrainer`. `main()` fits each one for a
few epochs, checks it did what its section says, and returns a dict of results per part.
"""

# The guide's custom loop names its epoch variable without using it; its text is kept as is.
# ruff: noqa: B007

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from dream_trainer import Callback, DreamTrainer, DreamTrainerConfig, MisconfigurationError


# ==================================================================================================
# Supplied: what the guide's snippets use but leave to the user
# ==================================================================================================
@dataclass
class MyConfig(DreamTrainerConfig):
    """The trainer's config plus every field the guide's snippets read from `self.config`."""

    learning_rate: float = 3e-3
    weight_decay: float = 1e-2
    g_lr: float = 1e-3
    d_lr: float = 1e-2  # a faster discriminator steadies the GAN (two time-scale updates)
    train_batch_size: int = 32
    val_batch_size: int = 128
    num_workers: int = 0
    train_data_dir: str = "data/train"
    val_data_dir: str = "data/val"


SPLIT_SIZES = {"train": 2048, "val": 512}


class MyDataset(Dataset):
    """4 classes of points in 8-D (one Gaussian blob per class).

    A real dataset would read files under `data_dir`; this one generates its samples, deterministically
    from `split`, so the script runs anywhere. Train and val share the class centres, not the samples.
    """

    n_features = 8
    n_classes = 4

    def __init__(self, data_dir: str, split: str) -> None:
        self.data_dir = data_dir
        self.split = split
        centres = 1.2 * torch.randn(self.n_classes, self.n_features, generator=torch.Generator().manual_seed(0))
        g = torch.Generator().manual_seed({"train": 1, "val": 2}[split])
        self.targets = torch.randint(self.n_classes, (SPLIT_SIZES[split],), generator=g)
        self.inputs = centres[self.targets] + torch.randn(len(self.targets), self.n_features, generator=g)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]


# The "Distributed DataLoaders" snippet uses `train_dataset` and `val_dataset` without defining them;
# as module-level names they are in scope for it, as written.
train_dataset = MyDataset(data_dir=MyConfig.train_data_dir, split="train")
val_dataset = MyDataset(data_dir=MyConfig.val_data_dir, split="val")


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(MyDataset.n_features, 64), nn.ReLU(), nn.Linear(64, MyDataset.n_classes))


def per_class_counts(outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """True positives, predicted counts and actual counts per class."""
    n = outputs.shape[-1]
    preds = outputs.argmax(dim=-1)
    tp = torch.bincount(targets[preds == targets], minlength=n).float()
    return tp, torch.bincount(preds, minlength=n).float(), torch.bincount(targets, minlength=n).float()


# ==================================================================================================
# The base trainer: Basic Trainer, Single Model, Basic Optimizer, Basic DataLoaders,
# Training Step, Validation Step
# ==================================================================================================
class MyTrainer(DreamTrainer):
    # Guide: Basic Trainer
    def __init__(self, config: DreamTrainerConfig, model: nn.Module):
        super().__init__(config)
        self.model = model

    # Supplied: the loss and metric helpers the snippets call. `criterion` is a class attribute, so it
    # is not an attribute of the instance and the trainer does not count it as one of its models.
    criterion = nn.CrossEntropyLoss()

    def compute_accuracy(self, outputs, targets):
        return (outputs.argmax(dim=-1) == targets).float().mean()

    def compute_precision(self, outputs, targets):  # macro average over classes
        tp, predicted, _ = per_class_counts(outputs, targets)
        return (tp / predicted.clamp(min=1)).mean()

    def compute_recall(self, outputs, targets):
        tp, _, actual = per_class_counts(outputs, targets)
        return (tp / actual.clamp(min=1)).mean()

    def compute_f1(self, outputs, targets):
        tp, predicted, actual = per_class_counts(outputs, targets)
        return (2 * tp / (predicted + actual).clamp(min=1)).mean()

    # Guide: Model Configuration / Single Model
    # fmt: off
    def configure_models(self):
        """Configure a single model"""
        # Model is automatically moved to device
        # and wrapped with distributed training wrappers
        pass
    # fmt: on

    # Guide: Optimizer Configuration / Basic Optimizer
    # fmt: off
    def configure_optimizers(self):
        """Configure a single optimizer"""
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.config.learning_rate,
            weight_decay=self.config.weight_decay
        )
    # fmt: on

    # Guide: DataLoader Configuration / Basic DataLoaders
    # fmt: off
    def configure_dataloaders(self):
        """Configure basic dataloaders"""
        # Training data
        train_dataset = MyDataset(
            data_dir=self.config.train_data_dir,
            split="train"
        )
        train_loader = DataLoader(
            train_dataset,
            batch_size=self.config.train_batch_size,
            shuffle=True,
            num_workers=self.config.num_workers
        )

        # Validation data
        val_dataset = MyDataset(
            data_dir=self.config.val_data_dir,
            split="val"
        )
        val_loader = DataLoader(
            val_dataset,
            batch_size=self.config.val_batch_size,
            shuffle=False,
            num_workers=self.config.num_workers
        )

        return train_loader, val_loader
    # fmt: on

    # Guide: Training Loop / Training Step
    # fmt: off
    def training_step(self, batch, batch_idx):
        # Unpack batch
        inputs, targets = batch

        # Forward pass
        outputs = self.model(inputs)
        loss = self.criterion(outputs, targets)

        # Backward pass (handled automatically)
        self.backward(loss)

        # Return metrics to log
        return {
            "loss": loss,
            "accuracy": self.compute_accuracy(outputs, targets)
        }
    # fmt: on

    # Guide: Training Loop / Validation Step
    # fmt: off
    def validation_step(self, batch, batch_idx):
        # Unpack batch
        inputs, targets = batch

        # Forward pass
        outputs = self.model(inputs)
        loss = self.criterion(outputs, targets)

        # Return metrics to log
        return {
            "val_loss": loss,
            "val_accuracy": self.compute_accuracy(outputs, targets)
        }
    # fmt: on


# Guide: Advanced Features / Custom Callbacks
# fmt: off
class MyCallback(Callback):
    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        # Custom logic after each training batch
        pass

    def on_validation_batch_end(self, trainer, outputs, batch, batch_idx):
        # Custom logic after each validation batch
        pass
# fmt: on


# ==================================================================================================
# One trainer per variant
# ==================================================================================================
class RequiredMethodsTrainer(MyTrainer):
    """The guide's "Required Methods" skeleton: every method a stub. It cannot train; fit() says why."""

    # Guide: Basic Trainer / Required Methods
    # fmt: off
    def configure_models(self):
        """Configure your model(s) here"""
        pass

    def configure_optimizers(self):
        """Configure optimizer(s)"""
        pass

    def configure_dataloaders(self):
        """Configure train and validation dataloaders"""
        pass

    def training_step(self, batch, batch_idx):
        """Define a single training step"""
        pass

    def validation_step(self, batch, batch_idx):
        """Define a single validation step"""
        pass
    # fmt: on


class CustomLoopTrainer(MyTrainer):
    # Guide: Training Loop / Custom Training Loop
    # fmt: off
    def training_loop(self):
        """Custom training loop"""
        for epoch in range(self.current_epoch, self.config.n_epochs):
            # Training
            self.model.train()
            for batch_idx, batch in enumerate(self.train_loader):
                # Custom training logic
                outputs = self.training_step(batch, batch_idx)

                # Custom logging
                self.log_metrics(outputs)

            # Validation
            if self.should_validate():
                self.validation_loop()
    # fmt: on


class CompiledTrainer(MyTrainer):
    # Guide: Model Configuration / Model Compilation
    # fmt: off
    def configure_models(self):
        """Configure model with compilation"""
        if self.config.compile_model:
            self.model = torch.compile(self.model)
    # fmt: on


class SchedulerTrainer(MyTrainer):
    # Guide: Optimizer Configuration / Learning Rate Schedulers
    # fmt: off
    def configure_optimizers(self):
        """Configure optimizer with scheduler"""
        # Optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.config.learning_rate
        )

        # Scheduler
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            self.optimizer,
            T_max=self.config.n_epochs
        )
    # fmt: on


class DistributedDataTrainer(MyTrainer):
    # Guide: DataLoader Configuration / Distributed DataLoaders
    # fmt: off
    def configure_dataloaders(self):
        """Configure distributed dataloaders"""
        # Training data
        train_sampler = DistributedSampler(
            train_dataset,
            num_replicas=self.world_size,
            rank=self.global_rank
        )
        train_loader = DataLoader(
            train_dataset,
            batch_size=self.config.train_batch_size,
            sampler=train_sampler,
            num_workers=self.config.num_workers
        )

        # Validation data
        val_sampler = DistributedSampler(
            val_dataset,
            num_replicas=self.world_size,
            rank=self.global_rank,
            shuffle=False
        )
        val_loader = DataLoader(
            val_dataset,
            batch_size=self.config.val_batch_size,
            sampler=val_sampler,
            num_workers=self.config.num_workers
        )

        return train_loader, val_loader
    # fmt: on


class MetricsTrainer(MyTrainer):
    # Guide: Advanced Features / Custom Metrics
    # fmt: off
    def compute_metrics(self, outputs, targets):
        """Compute custom metrics"""
        return {
            "accuracy": self.compute_accuracy(outputs, targets),
            "f1_score": self.compute_f1(outputs, targets),
            "precision": self.compute_precision(outputs, targets),
            "recall": self.compute_recall(outputs, targets)
        }
    # fmt: on

    # Supplied: the guide does not say where compute_metrics is called; here, in validation.
    def validation_step(self, batch, batch_idx):
        inputs, targets = batch
        outputs = self.model(inputs)
        metrics = self.compute_metrics(outputs, targets)
        return {"val_loss": self.criterion(outputs, targets), **{f"val_{k}": v for k, v in metrics.items()}}


class ClippingTrainer(MyTrainer):
    # Guide: Advanced Features / Gradient Clipping
    # fmt: off
    def training_step(self, batch, batch_idx):
        # ... training logic ...
        inputs, targets = batch  # supplied (3 lines): the training logic the snippet elides
        loss = self.criterion(self.model(inputs), targets)
        self.backward(loss)

        # Gradient clipping
        if self.config.gradient_clip_val is not None:
            self.clip_gradients(
                self.optimizer,
                max_norm=self.config.gradient_clip_val
            )
    # fmt: on


class MixedPrecisionTrainer(MyTrainer):
    # Guide: Advanced Features / Mixed Precision
    # fmt: off
    def training_step(self, batch, batch_idx):
        inputs, targets = batch  # supplied: the snippet uses `inputs`/`targets` without unpacking `batch`
        # Automatic mixed precision
        with self.autocast():
            outputs = self.model(inputs)
            loss = self.criterion(outputs, targets)

        # Backward pass with scaling
        self.backward(loss)
    # fmt: on


class CheckpointTrainer(MyTrainer):
    # Guide: Advanced Features / Checkpointing
    # fmt: off
    def save_checkpoint(self, path):
        """Save checkpoint"""
        checkpoint = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "epoch": self.current_epoch,
            "config": self.config
        }
        torch.save(checkpoint, path)

    def load_checkpoint(self, path):
        """Load checkpoint"""
        checkpoint = torch.load(path)
        self.model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.current_epoch = checkpoint["epoch"]
    # fmt: on


class GANTrainer(DreamTrainer):
    """Multiple models and optimizers: a tiny GAN learning a 1-D Gaussian N(3, 0.5^2)."""

    # Supplied: the models arrive in __init__, as the Multiple Models snippet expects.
    def __init__(self, config: MyConfig, generator: nn.Module, discriminator: nn.Module):
        super().__init__(config)
        self.generator = generator
        self.discriminator = discriminator

    # Guide: Model Configuration / Multiple Models
    # fmt: off
    def configure_models(self):
        """Configure multiple models"""
        # Generator
        self.generator = self.generator.to(self.device)
        if self.is_distributed:
            self.generator = self.wrap_model(self.generator)

        # Discriminator
        self.discriminator = self.discriminator.to(self.device)
        if self.is_distributed:
            self.discriminator = self.wrap_model(self.discriminator)
    # fmt: on

    # Guide: Optimizer Configuration / Multiple Optimizers
    # fmt: off
    def configure_optimizers(self):
        """Configure multiple optimizers"""
        # Generator optimizer
        self.g_optimizer = torch.optim.AdamW(
            self.generator.parameters(),
            lr=self.config.g_lr
        )

        # Discriminator optimizer
        self.d_optimizer = torch.optim.AdamW(
            self.discriminator.parameters(),
            lr=self.config.d_lr
        )
    # fmt: on

    # Supplied: the guide has no GAN data or training_step.
    def configure_dataloaders(self):
        real = 3.0 + 0.5 * torch.randn(2048, 1, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(real), batch_size=self.config.train_batch_size, shuffle=True), None

    def training_step(self, batch, batch_idx):
        (real,) = batch
        fake = self.generator(torch.randn(len(real), 4, device=self.device))
        is_real = lambda x: torch.ones(len(x), 1, device=self.device)  # noqa: E731
        is_fake = lambda x: torch.zeros(len(x), 1, device=self.device)  # noqa: E731
        bce = F.binary_cross_entropy_with_logits

        d_loss = bce(self.discriminator(real), is_real(real)) + bce(self.discriminator(fake.detach()), is_fake(fake))
        self.backward(d_loss)
        self.step(self.d_optimizer)

        g_loss = bce(self.discriminator(fake), is_real(fake))
        self.backward(g_loss)
        self.step(self.g_optimizer)
        return {"d_loss": d_loss, "g_loss": g_loss}


# ==================================================================================================
# Running every part
# ==================================================================================================
class CountingCallback(MyCallback):
    """MyCallback with a body: counts the batches it saw, to show its hooks fire."""

    def __init__(self) -> None:
        self.train_batches = 0
        self.val_batches = 0

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, outputs, batch, batch_idx)
        self.train_batches += 1

    def on_validation_batch_end(self, trainer, outputs, batch, batch_idx):
        super().on_validation_batch_end(trainer, outputs, batch, batch_idx)
        self.val_batches += 1


class GradNormProbe(Callback):
    """Records the largest total gradient norm seen right before an optimizer step (after clipping)."""

    def __init__(self) -> None:
        self.max_norm = 0.0

    def on_before_optimizer_step(self, trainer, optimizer):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.max_norm = max(self.max_norm, torch.nn.utils.get_total_norm(grads).item())


def n_batches(dataset_size: int, batch_size: int) -> int:
    return -(-dataset_size // batch_size)  # ceil


def fitted(trainer_cls: type[MyTrainer], config: MyConfig) -> MyTrainer:
    torch.manual_seed(0)  # the same initial weights for every part
    trainer = trainer_cls(config, make_model())
    trainer.fit()
    return trainer


def part_required_methods(cfg: MyConfig) -> dict:
    try:
        RequiredMethodsTrainer(cfg, make_model()).fit()
    except MisconfigurationError as exc:  # the stubs assign no optimizer
        return {"ok": True, "error": str(exc)}
    return {"ok": False, "error": "fit() of the stub trainer did not fail"}


def part_basic(cfg: MyConfig) -> dict:
    counter = CountingCallback()
    cfg = dataclasses.replace(cfg, callbacks=[counter])
    trainer = fitted(MyTrainer, cfg)
    train_batches = n_batches(SPLIT_SIZES["train"], cfg.train_batch_size)
    val_batches = n_batches(SPLIT_SIZES["val"], cfg.val_batch_size)
    # The sanity check's batches, plus one validation run per epoch.
    expected_val_batches = min(cfg.num_sanity_val_steps, val_batches) + cfg.n_epochs * val_batches
    acc = trainer.callback_metrics["val_accuracy"]
    return {
        "ok": acc > 0.8
        and counter.train_batches == cfg.n_epochs * train_batches
        and counter.val_batches == expected_val_batches,
        "val_accuracy": acc,
        "models": [name for name, _ in trainer.named_models()],
        "callback_train_batches": counter.train_batches,
        "callback_val_batches": counter.val_batches,
    }


def part_custom_loop(cfg: MyConfig) -> dict:
    trainer = fitted(CustomLoopTrainer, cfg)
    expected = cfg.n_epochs * n_batches(SPLIT_SIZES["train"], cfg.train_batch_size)
    acc = trainer.callback_metrics["val_accuracy"]
    return {
        "ok": trainer.global_step == expected and trainer.current_epoch == cfg.n_epochs and acc > 0.8,
        "global_step": trainer.global_step,
        "val_accuracy": acc,
    }


def part_compile(cfg: MyConfig) -> dict:
    trainer = fitted(CompiledTrainer, dataclasses.replace(cfg, compile_model=True))
    acc = trainer.callback_metrics["val_accuracy"]
    compiled = type(trainer.model).__name__ == "OptimizedModule"
    return {"ok": compiled and acc > 0.8, "compiled": compiled, "val_accuracy": acc}


def part_scheduler(cfg: MyConfig) -> dict:
    trainer = fitted(SchedulerTrainer, cfg)
    lr = trainer.optimizer.param_groups[0]["lr"]
    return {
        # T_max is n_epochs and the scheduler steps once per epoch: the cosine ends at its minimum, 0.
        "ok": trainer.scheduler.last_epoch == cfg.n_epochs and lr < 1e-3 * cfg.learning_rate,
        "scheduler_steps": trainer.scheduler.last_epoch,
        "final_lr": lr,
    }


def part_distributed_data(cfg: MyConfig) -> dict:
    trainer = fitted(DistributedDataTrainer, cfg)
    sampler = trainer.train_loader.sampler
    acc = trainer.callback_metrics["val_accuracy"]
    return {
        # On one process the sampler covers the whole dataset; the trainer calls set_epoch each epoch.
        "ok": isinstance(sampler, DistributedSampler) and sampler.epoch == cfg.n_epochs - 1 and acc > 0.8,
        "sampler_epoch": sampler.epoch,
        "val_accuracy": acc,
    }


def part_metrics(cfg: MyConfig) -> dict:
    trainer = fitted(MetricsTrainer, cfg)
    names = ("val_accuracy", "val_f1_score", "val_precision", "val_recall")
    metrics = {k: trainer.callback_metrics[k] for k in names}
    return {"ok": all(v > 0.8 for v in metrics.values()), **metrics}


def part_clipping(cfg: MyConfig) -> dict:
    probe = GradNormProbe()
    trainer = fitted(ClippingTrainer, dataclasses.replace(cfg, gradient_clip_val=0.1, callbacks=[probe]))
    return {
        "ok": probe.max_norm <= 0.1 + 1e-4 and trainer.global_step > 0,
        "max_norm_at_step": probe.max_norm,
        "last_norm_before_clipping": trainer.grad_norms["optimizer"].item(),
    }


def part_mixed_precision(cfg: MyConfig) -> dict:
    trainer = fitted(MixedPrecisionTrainer, dataclasses.replace(cfg, mixed_precision="bf16"))
    with torch.no_grad(), trainer.autocast():
        dtype = trainer.model(val_dataset.inputs[:4].to(trainer.device)).dtype
    acc = trainer.callback_metrics["val_accuracy"]
    return {"ok": dtype == torch.bfloat16 and acc > 0.8, "autocast_dtype": str(dtype), "val_accuracy": acc}


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def same_optimizer_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    return sa.keys() == sb.keys() and all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sa)


def part_checkpoint(cfg: MyConfig) -> dict:
    trainer = fitted(CheckpointTrainer, cfg)
    path = trainer.run_dir / "guide.ckpt"
    path.parent.mkdir(parents=True, exist_ok=True)  # the snippet's bare torch.save needs the folder
    trainer.save_checkpoint(path)
    saved_config = torch.load(path)["config"]  # the config object comes back from a plain torch.load

    # fit(ckpt_path=...) sets a fresh trainer up, then calls the overridden load_checkpoint.
    resumed = CheckpointTrainer(cfg, make_model())
    resumed.fit(ckpt_path=path)  # restored at epoch n_epochs: nothing left to train

    # load_checkpoint on a fresh trainer, with freshly initialised weights.
    fresh = CheckpointTrainer(cfg, make_model())
    fresh.load_checkpoint(path)
    weights_equal = same_weights(trainer.model, fresh.model)
    optimizer_restored = same_optimizer_state(trainer.optimizer, fresh.optimizer)
    return {
        "ok": weights_equal
        and optimizer_restored
        and fresh.current_epoch == cfg.n_epochs
        and same_weights(trainer.model, resumed.model)
        and saved_config == cfg,
        "weights_equal": weights_equal,
        "optimizer_restored": optimizer_restored,
        "epoch": fresh.current_epoch,
    }


def part_gan(cfg: MyConfig) -> dict:
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
    discriminator = nn.Sequential(nn.Linear(1, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    trainer = GANTrainer(cfg, generator, discriminator)
    z = torch.randn(4096, 4)
    with torch.no_grad():
        before = generator(z).mean().item()
    trainer.fit()
    with torch.no_grad():
        after = trainer.generator(z.to(trainer.device)).mean().item()
    # Setup already placed (and, under a distributed strategy, wrapped) both models; wrap_model is
    # idempotent, so the snippet calling it again changes nothing.
    idempotent = trainer.wrap_model(trainer.generator) is trainer.generator
    return {
        # The real data's mean is 3: the generated mean should have moved most of the way there.
        "ok": abs(after - 3.0) < 0.5 * abs(before - 3.0)
        and trainer.global_step == cfg.n_epochs * 2048 // 32
        and idempotent,
        "wrap_model_idempotent": idempotent,
        "generated_mean_before": before,
        "generated_mean_after": after,
        "global_step": trainer.global_step,
    }


PARTS = {
    "required_methods": part_required_methods,
    "basic": part_basic,
    "custom_loop": part_custom_loop,
    "compile": part_compile,
    "scheduler": part_scheduler,
    "distributed_data": part_distributed_data,
    "metrics": part_metrics,
    "clipping": part_clipping,
    "mixed_precision": part_mixed_precision,
    "checkpoint": part_checkpoint,
    "gan": part_gan,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Run every Trainer Guide snippet.")
    p.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS), help="which parts (default: all)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per part (default: %(default)s)")
    p.add_argument("--root-dir", default="runs/trainer_guide", help="(default: %(default)s)")
    p.add_argument("--verbose", action="store_true", help="print the per-epoch summary lines")
    # Splitting ops this small across threads costs more than it saves (and oversubscribes shared CPUs).
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    """Run the selected parts; return {part: {"ok": bool, ...details}}. A part that raises is recorded
    with ok=False and the error, and the others still run."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = MyConfig(n_epochs=args.epochs, root_dir=args.root_dir, print_epoch_summary=args.verbose)
    results = {}
    for name in args.parts:
        start = time.perf_counter()
        try:
            results[name] = PARTS[name](cfg)
        except Exception as exc:
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        results[name]["wall_s"] = time.perf_counter() - start
        res = results[name]
        details = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items() if k != "ok")
        print(f"{'ok  ' if res['ok'] else 'FAIL'} {name}: {details}", flush=True)
    print(f"done: {sum(r['ok'] for r in results.values())}/{len(results)} parts ok")
    return results


if __name__ == "__main__":
    results = main()
    raise SystemExit(0 if all(r["ok"] for r in results.values()) else 1)
