"""A requeue-ready training script for tests/test_slurm.py, run by the test's Slurm (`srun` or the
sbatch script of docs/unattended.md, which runs `srun python train.py`; the test's train.py calls
`main`).

    python tests/slurm_worker.py --out DIR [--pace SECONDS] [--steps N]

`resume_from="last"` and a `run_name`: the first start trains from scratch, a requeued start continues
the run. The first start (SLURM_RESTART_COUNT unset or 0) sleeps `--pace` seconds after each step
and touches `DIR/started` after its second step, so the test can signal it mid-run; a requeued start
runs at full speed. At the end each rank writes `DIR/final-rank{R}.pt` (the model's state dict) and
`DIR/rank{R}.json` (its rank, world size, run directory, global step); a rank a signal stopped writes its
exit code to `DIR/exit-rank{R}-start{N}` (N: SLURM_RESTART_COUNT) instead, and rank 0 of a stopped start
copies the run's record as the process leaves it (its last exit handler) to `DIR/run-start{N}.json`: what
the next start finds, which a test polling run.json can miss (the window lasts until that start).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import Callback, DreamTrainer, DreamTrainerConfig
from dream_trainer.utils import unwrap

RUN_NAME = "slurm-test"


class Pace(Callback):
    """Slows the first start down and says when it is well under way."""

    def __init__(self, out: Path, pace: float) -> None:
        self.out = out
        self.pace = pace if int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0 else 0.0

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == 2 and trainer.is_global_zero:
            (self.out / "started").touch()
        time.sleep(self.pace)


class Regression(DreamTrainer):
    def configure_models(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(4, 1)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)

    def configure_dataloaders(self) -> tuple[DataLoader, None]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=g)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.5
        return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True), None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.model(x), y)


def config(root: str, steps: int, callbacks: list[Callback]) -> DreamTrainerConfig:
    return DreamTrainerConfig(
        root_dir=root,
        run_name=RUN_NAME,
        resume_from="last",
        max_steps=steps,
        seed=0,
        device="cpu",
        loggers=[],
        enable_progress_bar=False,
        print_epoch_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,  # with several ranks, they agree on a signal at logging points
        callbacks=callbacks,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--root", default="runs")
    p.add_argument("--pace", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=24)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    trainer = Regression(config(args.root, args.steps, [Pace(out, args.pace)]))
    start = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    try:
        trainer.fit()
    except SystemExit as stop:  # a signal stopped the run: the exit code of this rank, for the test
        (out / f"exit-rank{trainer.global_rank}-start{start}").write_text(str(stop.code))
        if trainer.global_rank == 0:  # registered after the trainer's own exit handlers: runs after them
            atexit.register(_copy_record, trainer.run_dir / "run.json", out / f"run-start{start}.json")
        raise
    rank = trainer.global_rank
    torch.save(unwrap(trainer.model).state_dict(), out / f"final-rank{rank}.pt")
    facts = {"rank": rank, "world": trainer.world_size, "run_dir": str(trainer.run_dir), "step": trainer.global_step}
    (out / f"rank{rank}.json").write_text(json.dumps(facts))


def _copy_record(record: Path, copy: Path) -> None:
    data = record.read_bytes()
    tmp = copy.with_name(copy.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(copy)  # whole or absent for the test that waits for it


if __name__ == "__main__":
    main()
