"""One replica group of a fault-tolerant run: kill a group and the others keep training; restart it and it heals.

Start the torchft lighthouse once, then this script once per group, each under its own torchrun and with its own
REPLICA_GROUP_ID (docs/fault-tolerance.md):

    torchft_lighthouse --bind 127.0.0.1:29510 --min_replicas 1 --join_timeout_ms 1000 --heartbeat_timeout_ms 2000
    export TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510
    REPLICA_GROUP_ID=0 torchrun --standalone --nproc_per_node 1 examples/fault_tolerant.py
    REPLICA_GROUP_ID=1 torchrun --standalone --nproc_per_node 1 examples/fault_tolerant.py

The groups train one model together: each step's global batch is dealt out among the groups taking part, their
gradients are averaged, and the step commits only when all of them finished it. Kill a group (kill -9) and the
others go on after the lighthouse's heartbeat timeout; start it again with the same command and it receives the
whole run state from a live group and continues with them. Each group writes its own run directory
(`runs/replica<id>/version_N`), where `fault_tolerance/samples-rank0.jsonl` lists the global range of samples each
committed step trained.

    ... examples/fault_tolerant.py --steps 400    # more steps (default 200; --pace: seconds a step sleeps, 0.1)
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig, FaultToleranceConfig


class Regression(DreamTrainer):
    def __init__(self, config: DreamTrainerConfig, pace: float) -> None:
        super().__init__(config)
        self.pace = pace

    def configure_models(self) -> None:
        torch.manual_seed(0)  # every group starts from the same weights
        self.model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3)

    def configure_dataloaders(self) -> Any:
        g = torch.Generator().manual_seed(0)  # every group sees the same dataset
        x = torch.randn(1024, 16, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        # shuffle=True: under fault tolerance one seeded order over all groups; each group's part of a step is
        # dealt out by that step's quorum.
        return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True), None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        time.sleep(self.pace)  # a slower step, to watch groups come and go
        loss = F.mse_loss(self.model(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--pace", type=float, default=0.1)
    args = parser.parse_args()
    replica = os.environ.get("REPLICA_GROUP_ID", "0")
    config = DreamTrainerConfig(
        device="cpu",
        max_steps=args.steps,
        log_every_n_steps=20,
        root_dir=f"runs/replica{replica}",  # each group its own run directory
        loggers=[],
        enable_progress_bar=False,
        enable_checkpointing=replica == "0",  # one group writes the checkpoints (the others hold the same state)
        # lighthouse and replica_id from TORCHFT_LIGHTHOUSE and REPLICA_GROUP_ID
        fault_tolerance=FaultToleranceConfig(min_replicas=1, timeout_s=10.0),
    )
    trainer = Regression(config, args.pace)
    trainer.fit()
    print(f"replica group {replica}: {trainer.global_step} steps, final loss {trainer.callback_metrics['loss']:.4f}")


if __name__ == "__main__":
    main()
