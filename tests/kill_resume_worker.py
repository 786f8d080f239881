"""One training run for tests/test_kill_resume.py: optionally SIGKILLed at a chosen point, optionally
resumed from the newest checkpoint in its directory.

    python tests/kill_resume_worker.py --root-dir DIR --out final.pt                      # uninterrupted
    python tests/kill_resume_worker.py --root-dir DIR --out x.pt --kill-at-step 5         # dies with -9
    python tests/kill_resume_worker.py --root-dir DIR --out final.pt --resume             # fit(ckpt_path="last")

The run has everything that makes an exact resume hard: a shuffling DataLoader without a generator
(its order comes from torch's global RNG), Dropout, AdamW (with state), an LR scheduler (per epoch or
per step), optional bf16/fp16 autocast (fp16 adds a GradScaler), gradient accumulation, a validation
loader, and `ModelCheckpoint(every_n_train_steps=k, save_last=True)`.

The kill is `os.kill(os.getpid(), SIGKILL)` from a callback placed after ModelCheckpoint: no handler,
no cleanup, no flush, exactly like the OOM killer or a pre-empted node. A run that was asked to be
killed but finishes exits with code 3.

The final state goes to `--out` (torch.save): the model's state dict, the optimizer's state tensors,
the LR, the counters, torch's RNG state, and `losses`: `{(epoch, batch_idx): loss}` of the batches this
process trained on (for locating the first divergence when a comparison fails).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import Callback, DreamTrainer, DreamTrainerConfig
from dream_trainer.callbacks import ModelCheckpoint

N_FEATURES = 8
KILL_HOOKS = ("batch_end", "batch_start", "optimizer_step")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root-dir", required=True, help="config.root_dir (checkpoints go to ROOT/version_0/checkpoints)")
    p.add_argument("--out", required=True, help="where the final state is written")
    kill = p.add_mutually_exclusive_group()
    kill.add_argument("--kill-at-step", type=int, help="SIGKILL when global_step == N (see --kill-in)")
    kill.add_argument(
        "--kill-at-batch", type=int, help="SIGKILL at the B-th training batch, counted from 0 over all epochs"
    )
    p.add_argument(
        "--kill-in",
        choices=KILL_HOOKS,
        default="batch_end",
        help="batch_end: in on_train_batch_end, after ModelCheckpoint saved (default); batch_start: before "
        "the batch runs; optimizer_step: in on_before_optimizer_step (gradients done, weights not yet updated)",
    )
    p.add_argument("--resume", action="store_true", help='fit(ckpt_path="last")')
    p.add_argument("--accum", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--scheduler", choices=("epoch", "step"), default="epoch", help="config.scheduler_interval")
    p.add_argument("--every-n-steps", type=int, default=3, help="ModelCheckpoint(every_n_train_steps=...)")
    p.add_argument(
        "--every-n-epochs", type=int, help="ModelCheckpoint(every_n_epochs=...) instead of every_n_train_steps"
    )
    p.add_argument("--save-top-k", type=int, default=-1)
    p.add_argument("--async-ckpt", action="store_true", help="config.async_checkpointing=True")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--sanity-steps", type=int, default=2, help="config.num_sanity_val_steps")
    p.add_argument("--val-every-n-steps", type=int, help="config.val_every_n_steps (default: validate per epoch)")
    p.add_argument("--n-train", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-workers", type=int, default=0, help="training DataLoader workers")
    return p.parse_args(argv)


class KillAt(Callback):
    """SIGKILLs this process at one point of the run (a hard kill: nothing after it runs)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.step = args.kill_at_step
        self.batch = args.kill_at_batch
        self.where = args.kill_in
        self.batches_per_epoch = -(-args.n_train // args.batch_size)

    def _due(self, trainer: Any) -> bool:
        if self.step is not None:
            return trainer.global_step == self.step
        return trainer.current_epoch * self.batches_per_epoch + trainer.batch_idx == self.batch

    @staticmethod
    def _die() -> None:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_start(self, trainer: Any, batch: Any, batch_idx: int) -> None:
        if self.where == "batch_start" and self._due(trainer):
            self._die()

    def on_before_optimizer_step(self, trainer: Any, optimizer: Any) -> None:
        if self.where == "optimizer_step" and self._due(trainer):
            self._die()

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.where == "batch_end" and self._due(trainer):
            if self.step is not None and not trainer.loop.step_ended:
                return  # "at step N" means once step N is complete
            self._die()


class KillResumeTrainer(DreamTrainer):
    def __init__(self, config: DreamTrainerConfig, args: argparse.Namespace) -> None:
        super().__init__(config)
        self.args = args
        self.losses: dict[tuple[int, int], float] = {}

    def configure_models(self) -> None:
        # Built after setup seeded the RNGs, so every process starts from the same weights.
        self.model = nn.Sequential(
            nn.Linear(N_FEATURES, 32),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Linear(32, 32),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Linear(32, 1),
        )

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.05)
        if self.args.scheduler == "step":
            self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.8)
        else:
            self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)

    def configure_dataloaders(self) -> tuple[DataLoader, DataLoader]:
        g = torch.Generator().manual_seed(1234)  # data values only; the global RNG is not touched
        n_train, n_val = self.args.n_train, 16
        x = torch.randn(n_train + n_val, N_FEATURES, generator=g)
        w = torch.randn(N_FEATURES, 1, generator=g)
        y = torch.sin(x @ w) + 0.1 * torch.randn(n_train + n_val, 1, generator=g)
        # shuffle=True and no generator: each epoch's order is drawn from torch's global RNG.
        train = DataLoader(
            TensorDataset(x[:n_train], y[:n_train]),
            batch_size=self.args.batch_size,
            shuffle=True,
            num_workers=self.args.num_workers,
        )
        val = DataLoader(TensorDataset(x[n_train:], y[n_train:]), batch_size=8)
        return train, val

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        loss = F.mse_loss(self.model(x).float(), y)
        self.losses[(self.current_epoch, batch_idx)] = float(loss.detach())
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x).float(), y)}


def final_state(trainer: KillResumeTrainer) -> dict[str, Any]:
    opt_state = {
        f"{idx}.{key}": value.detach().clone()
        for idx, st in trainer.optimizer.state_dict()["state"].items()
        for key, value in st.items()
        if isinstance(value, torch.Tensor)
    }
    return {
        "model": {name: p.detach().clone() for name, p in trainer.model.state_dict().items()},
        "optimizer": opt_state,
        "lr": [group["lr"] for group in trainer.optimizer.param_groups],
        "grad_scale": trainer.grad_scaler.get_scale() if trainer.grad_scaler is not None else None,
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "rng": torch.get_rng_state(),
        "losses": dict(trainer.losses),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the same kernels in every process, whatever the machine's load
    cadence = (
        {"every_n_epochs": args.every_n_epochs}
        if args.every_n_epochs is not None
        else {"every_n_train_steps": args.every_n_steps}
    )
    callbacks: list[Callback] = [ModelCheckpoint(save_last=True, save_top_k=args.save_top_k, **cadence)]
    if args.kill_at_step is not None or args.kill_at_batch is not None:
        # After ModelCheckpoint; "at step N" (on_train_batch_end) kills before step N's save, which is
        # written at the batch boundary: "--kill-in batch_start" of the next batch kills right after it.
        callbacks.append(KillAt(args))
    config = DreamTrainerConfig(
        seed=0,
        n_epochs=args.epochs,
        gradient_accumulation_steps=args.accum,
        mixed_precision=None if args.precision == "fp32" else args.precision,
        scheduler_interval=args.scheduler,
        async_checkpointing=args.async_ckpt,
        device="cpu",
        root_dir=args.root_dir,
        print_epoch_summary=False,
        num_sanity_val_steps=args.sanity_steps,
        val_every_n_steps=args.val_every_n_steps,
        callbacks=callbacks,
    )
    trainer = KillResumeTrainer(config, args)
    trainer.fit(ckpt_path="last" if args.resume else None)
    state = final_state(trainer)
    torch.save(state, args.out)
    if len(callbacks) > 1:
        print("kill point never reached", file=sys.stderr)
        sys.exit(3)
    return state


if __name__ == "__main__":
    main()
