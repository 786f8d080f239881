"""One replica group of one process for tests/test_fault_tolerance.py, started as a user starts one:

    torchrun --standalone --nproc_per_node 1 tests/ft_worker.py --replica 0 --lighthouse http://127.0.0.1:PORT \
        --root DIR --out DIR --steps 80

A small regression model trained with AdamW on 96 samples (batch 4 per replica, shuffled: the global order of
`fault_tolerance`). While `<out>/slow` exists each step sleeps `--pace` seconds (or the seconds the file holds),
so the test can kill, stop and restart replicas while the others train: it holds the others back (1 s a step)
while a process starts, so the run cannot end before the start however loaded the machine, and removes the file
once it is done, and the run goes on at full speed.
The trainer writes its ledger of committed global ranges (`fault_tolerance/samples-rank0.jsonl` in its run
directory, one run directory per start under `--root`); this script adds, in `--out`:
`start-<replica>-<rank>-<pid>.json` (the process's start time, before torch is imported) and, at the end,
`final-<replica>.pt` (the model's and the optimizer's state, the LR scheduler's steps and how many times
`on_train_batch_end` fired in this process).

`--checkpoint-every N` saves a checkpoint every N steps (`ModelCheckpoint`); `--resume PATH` starts from one
(`fit(ckpt_path=PATH)`); `--min-replicas N`: a step commits only with N groups.

`--fail-allreduce-when FILE`: once FILE exists, this replica's cross-group all-reduce of the step running then
reports an error after it ran (the failure torchft's managed work reports when its wait fails): this replica's
vote is no, it drops the step, and it heals from a peer at the next quorum.
"""

from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from dream_trainer import Callback, DreamTrainer, DreamTrainerConfig, ModelCheckpoint  # noqa: E402
from dream_trainer.fault_tolerance import FaultToleranceConfig  # noqa: E402

N_SAMPLES = 96
BATCH = 4


class Samples(Dataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N_SAMPLES, 8, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True).sin()

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.tensor(i), self.x[i], self.y[i]


class BatchEnds(Callback):
    """Counts `on_train_batch_end` in this process (no state: a heal does not change it)."""

    def __init__(self) -> None:
        self.calls = 0

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.calls += 1


class Replica(DreamTrainer):
    def __init__(self, config: DreamTrainerConfig, pace: float, slow: Path) -> None:
        super().__init__(config)
        self.pace = pace
        self.slow = slow

    def configure_models(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        # Steps after each optimizer step: only on a commit (its last_epoch ends at the run's steps).
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0 / (1.0 + 0.001 * step))

    def configure_dataloaders(self) -> Any:
        return DataLoader(Samples(), batch_size=BATCH, shuffle=True), None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        try:
            seconds = self.slow.read_text().strip()
        except FileNotFoundError:
            seconds = None
        if seconds is not None:
            time.sleep(float(seconds) if seconds else self.pace)
        return F.mse_loss(self.model(x), y)


def inject_allreduce_failure(when: Path, trainer: Replica) -> None:
    """From the test: once the file `when` exists, torchft's managed all-reduce of the step running then reports
    an error after it completed (once); `when` with ".done" appended then holds that step."""
    from torchft.manager import Manager

    original = Manager.allreduce
    done = False

    def allreduce(self: Any, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        nonlocal done
        work = original(self, tensor, *args, **kwargs)
        if not done and when.exists():
            done = True
            work.wait()
            step = trainer.global_step + 1
            self.report_error(RuntimeError(f"injected: the all-reduce of step {step} failed"))
            Path(f"{when}.done").write_text(str(step))
        return work

    Manager.allreduce = allreduce  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica", required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--pace", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--fail-allreduce-when", type=Path, default=None)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--checkpoint-every", type=int, default=None)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    start = args.out / f"start-{args.replica}-{os.environ.get('RANK', '0')}-{os.getpid()}.json"
    start.write_text(json.dumps({"started": STARTED}))
    ends = BatchEnds()
    config = DreamTrainerConfig(
        device="cpu",
        max_steps=args.steps,
        root_dir=str(args.root),
        log_every_n_steps=10,
        loggers=[],
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[ends, ModelCheckpoint(every_n_train_steps=args.checkpoint_every, save_top_k=-1)]
        if args.checkpoint_every
        else [ends],
        num_sanity_val_steps=0,
        scheduler_interval="step",
        fault_tolerance=FaultToleranceConfig(
            lighthouse=args.lighthouse,
            replica_id=args.replica,
            timeout_s=args.timeout,
            min_replicas=args.min_replicas,
            quorum_timeout_s=60.0,
            hostname="127.0.0.1",
        ),
    )
    trainer = Replica(config, args.pace, args.out / "slow")
    if args.fail_allreduce_when is not None:
        inject_allreduce_failure(args.fail_allreduce_when, trainer)
    trainer.fit(ckpt_path=args.resume)
    state = {"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
             "global_step": trainer.global_step, "scheduler_steps": trainer.scheduler.last_epoch,
             "batch_end_calls": ends.calls}  # fmt: skip
    rank = "" if trainer.global_rank == 0 else f"-rank{trainer.global_rank}"  # a group of several processes
    torch.save(state, args.out / f"final-{args.replica}{rank}.pt")


if __name__ == "__main__":
    main()
