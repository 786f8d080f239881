"""A Hugging Face user's training script and its port, for tests/test_huggingface.py: imported there as a
module, run as a script for the run the test kills.

    python tests/huggingface_worker.py --root-dir DIR --kill-at-batch 13     # dies with -9 (SIGKILL)

The plain loop (`plain_loop`) is written the way the `transformers` docs write one: a `GPT2LMHeadModel`
built from a config (nothing downloaded), a shuffling `DataLoader` of `{"input_ids", "labels"}` batches,
`torch.optim.AdamW`, `get_linear_schedule_with_warmup` sized by the steps computed by hand, accumulation
over `ACCUM` micro-batches (`loss / ACCUM`), `clip_grad_norm_` at 1.0, `lr_scheduler.step()` after every
`optimizer.step()`. GPT-2's dropout is on (the RNG matters); the tokens are generated.

`GPT2Port` is the same training on `DreamTrainer`, as the Hugging Face guide (docs/huggingface.md) ports
it: the scheduler sized by `estimated_stepping_batches`, `return self.model(**batch)` (a `ModelOutput`)
from `training_step` and `validation_step`, `scheduler_interval="step"`. `--kill-at-batch B` SIGKILLs the
run at the end of its B-th micro-batch (counted over the epochs, from 0), after `ModelCheckpoint` (every
training step, `save_last=True`) and before the next checkpoint is written.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

from dream_trainer import Callback, DreamTrainer, DreamTrainerConfig
from dream_trainer.callbacks import ModelCheckpoint

VOCAB, SEQ = 64, 16
N_TRAIN, N_VAL, BATCH = 32, 8, 4  # 8 training batches per epoch
ACCUM, EPOCHS = 4, 3  # 2 optimizer steps per epoch, 6 in all
LR, WARMUP, CLIP = 3e-3, 2, 1.0
SEED = 7
BATCHES_PER_EPOCH = N_TRAIN // BATCH


def gpt2_config() -> GPT2Config:
    """A two-layer GPT-2 (about 40k parameters), dropout on, built offline."""
    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )


def token_samples() -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """Generated training and validation sequences (a noisy counting pattern a model can learn), as the
    `{"input_ids", "labels"}` dicts a tokenized `datasets` split gives; their own generator: the global
    RNG is the run's."""
    g = torch.Generator().manual_seed(3)
    steps = torch.randint(1, 3, (N_TRAIN + N_VAL, SEQ), generator=g)
    tokens = (torch.randint(0, VOCAB, (N_TRAIN + N_VAL, 1), generator=g) + steps.cumsum(1)) % VOCAB
    samples = [{"input_ids": t, "labels": t.clone()} for t in tokens]
    return samples[:N_TRAIN], samples[N_TRAIN:]


TRAIN, VAL = token_samples()


def enable_checkpointing(model: GPT2LMHeadModel) -> None:
    """Gradient checkpointing, as the user's script turns it on: transformers 5.25 names it
    `activation_checkpointing_enable()` (the old name warns that it goes in v6), 4.57 has only
    `gradient_checkpointing_enable()`."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def is_checkpointing(model: GPT2LMHeadModel) -> bool:
    """Whether gradient checkpointing is on (either version's name, as `enable_checkpointing`)."""
    if hasattr(model, "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(model.is_gradient_checkpointing)


def plain_loop(gradient_checkpointing: bool = False) -> tuple[GPT2LMHeadModel, list[float], float]:
    """The user's script: the trained model, every micro-batch's loss, the validation loss at the end."""
    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(gpt2_config())
    if gradient_checkpointing:
        enable_checkpointing(model)
    train_dataloader = DataLoader(TRAIN, batch_size=BATCH, shuffle=True)
    eval_dataloader = DataLoader(VAL, batch_size=BATCH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    num_training_steps = EPOCHS * math.ceil(len(train_dataloader) / ACCUM)  # counted by hand
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=WARMUP, num_training_steps=num_training_steps
    )
    losses = []
    model.train()
    for _ in range(EPOCHS):
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)
            losses.append(float(outputs.loss.detach()))
            loss = outputs.loss / ACCUM
            loss.backward()
            if (step + 1) % ACCUM == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        val_loss = sum(float(model(**batch).loss) for batch in eval_dataloader) / len(eval_dataloader)
    return model, losses, val_loss


@dataclass
class PortConfig(DreamTrainerConfig):
    gradient_checkpointing: bool = False


class GPT2Port(DreamTrainer):
    """The plain loop on the trainer (the guide's port)."""

    config: PortConfig

    def __init__(self, config: PortConfig) -> None:
        super().__init__(config)
        self.stepping_batches: int | None = None  # what configure_optimizers read
        self.trained: list[tuple[int, int]] = []  # (epoch, batch_idx) of every batch this process trained on

    def configure_models(self) -> None:
        self.model = GPT2LMHeadModel(gpt2_config())
        if self.config.gradient_checkpointing:
            enable_checkpointing(self.model)

    def configure_optimizers(self) -> None:
        self.stepping_batches = self.estimated_stepping_batches
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.lr_scheduler = get_linear_schedule_with_warmup(
            self.optimizer, num_warmup_steps=WARMUP, num_training_steps=self.estimated_stepping_batches
        )

    def configure_dataloaders(self) -> tuple[DataLoader[Any], DataLoader[Any]]:
        return DataLoader(TRAIN, batch_size=BATCH, shuffle=True), DataLoader(VAL, batch_size=BATCH)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        self.trained.append((self.current_epoch, batch_idx))
        return self.model(**batch)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        return self.model(**batch)


def port_config(root_dir: str, **overrides: Any) -> PortConfig:
    settings: dict[str, Any] = {
        "seed": SEED,
        "n_epochs": EPOCHS,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clip_val": CLIP,
        "scheduler_interval": "step",  # the loop steps its scheduler after every optimizer step
        "device": "cpu",
        "root_dir": root_dir,
        "num_sanity_val_steps": 0,
        "print_epoch_summary": False,
        "enable_progress_bar": False,
        "loggers": [],
        "enable_checkpointing": False,
    }
    settings.update(overrides)
    return PortConfig(**settings)


def checkpointed_config(root_dir: str, **overrides: Any) -> PortConfig:
    """The killed run's and its resume's: a checkpoint after every training step."""
    checkpoint = ModelCheckpoint(every_n_train_steps=1, save_last=True)
    return port_config(root_dir, callbacks=[checkpoint], enable_checkpointing=True, **overrides)


class KillAt(Callback):
    """SIGKILLs this process at the end of micro-batch `batch` (counted over the epochs): no handler, no
    cleanup, as the OOM killer or a lost node."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch * BATCHES_PER_EPOCH + batch_idx == self.batch:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root-dir", required=True)
    p.add_argument("--kill-at-batch", type=int, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the kernels of the test's process (one thread)
    config = checkpointed_config(args.root_dir)
    config.callbacks.append(KillAt(args.kill_at_batch))  # after ModelCheckpoint
    GPT2Port(config).fit()
    print("the kill point was never reached", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
