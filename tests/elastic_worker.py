"""A live elastic run (tests/test_elastic.py): the script every node's torchrun starts,

    torchrun --nnodes=1:2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT \
        --max-restarts=5 tests/elastic_worker.py --out DIR

the same at every world size: the per-rank batch is the global batch over the world size, the shuffle a
`GlobalOrderSampler` (an order any number of processes continues), `resume_from="last"` with a checkpoint
every `EVERY` steps. After each step, the ranks gather the ids of the step's samples and rank 0 appends
one line to `DIR/ledger.jsonl`: `{"step", "world", "ids"}` (the sorted ids of the step's global batch). A
step trained again after a restart (it came after the last checkpoint) has a later line: the last line of
each step is the run's. While `DIR/slow` exists, each step sleeps `PACE` seconds, so that the test can
scale the run while it trains; the test removes it once it has, and the run trains on to its end at once.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from dream_trainer import Callback, DreamTrainerConfig
from dream_trainer.callbacks import ModelCheckpoint
from dream_trainer.data import GlobalOrderSampler

sys.path.insert(0, str(Path(__file__).parent))
import world_size_worker as samples  # the same samples, their ids and all

N_SAMPLES = samples.N_SAMPLES

GLOBAL_BATCH = 8
EPOCHS = 100  # 12 steps an epoch, 1,200 in all: the slow steps outlast the restarts, then full speed
EVERY = 10
PACE = 0.1


class Elastic(samples.Run):
    """world_size_worker's model and optimizer; this script's data (an order any world size continues)."""

    def __init__(self, config: DreamTrainerConfig, slow: Path | None = None) -> None:
        super().__init__(config)
        self.slow = slow

    def configure_dataloaders(self) -> Any:
        data = samples.Samples()
        per_rank = GLOBAL_BATCH // self.world_size
        return DataLoader(data, batch_size=per_rank, sampler=GlobalOrderSampler(data, seed=0)), None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        ids, x, y = batch
        self.step_ids = ids.tolist()
        if self.slow is not None and self.slow.exists():
            time.sleep(PACE)
        return F.mse_loss(self.model(x), y)


class Ledger(Callback):
    """Rank 0 appends the step's global batch (its ids over all ranks) to `path`."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        ids = [i for part in trainer.all_gather_object(trainer.step_ids) for i in part]
        if self.path is not None and trainer.is_global_zero:
            line = {"step": trainer.global_step - 1, "world": trainer.world_size, "ids": sorted(ids)}
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")


def config(root: Path, ledger: Path | None, *more: Callback) -> DreamTrainerConfig:
    return DreamTrainerConfig(
        seed=0, device="cpu", n_epochs=EPOCHS, root_dir=str(root), run_name="elastic", resume_from="last",
        enable_progress_bar=False, print_epoch_summary=False, hang_timeout=60.0,
        callbacks=[ModelCheckpoint(every_n_train_steps=EVERY, save_top_k=1), Ledger(ledger), *more],
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    trainer = Elastic(config(args.out / "runs", args.out / "ledger.jsonl"), slow=args.out / "slow")
    trainer.fit()
    if trainer.is_global_zero:
        model = getattr(trainer.model, "module", trainer.model)
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save({"weights": weights, "world_size": trainer.world_size}, args.out / "final.pt")


if __name__ == "__main__":
    main()
