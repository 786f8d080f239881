"""`trainer.predict()` with a `PredictionWriter`, for tests/test_cb_prediction_writer.py, under torchrun.

    torchrun --standalone --nproc_per_node 2 tests/prediction_writer_worker.py --out-dir DIR

A linear model predicts N_SAMPLES samples that carry their own index (`TensorDataset(ids, x)`); the
loader is a plain unshuffled `DataLoader`, which the trainer shards with a `DistributedSampler`. The
writer (`write_interval="batch_and_epoch"`, default directory inside the run directory) writes each
rank's files; every rank also saves what `predict()` returned to `DIR/returned_rank<R>.pt`, and rank 0
writes `DIR/result.json` (world size, the writer's directory on each rank). A failing rank writes its
traceback to `DIR/error.<rank>`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig
from dream_trainer.callbacks import PredictionWriter

N_SAMPLES, BATCH_SIZE = 10, 2  # per rank: 5 samples, batches of 2, 2 and 1


def make_loader() -> DataLoader[Any]:
    x = torch.randn(N_SAMPLES, 3, generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(torch.arange(N_SAMPLES), x), batch_size=BATCH_SIZE)


class Predictor(DreamTrainer):
    def configure_models(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(3, 1)

    # predict() sets the trainer up as fit() would: it wants an optimizer and a training loader too.
    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        return make_loader(), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        raise AssertionError("predict() does not train")

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        ids, x = batch
        return {"ids": ids, "y": self.model(x)}


def run(out_dir: Path) -> None:
    torch.set_num_threads(1)
    writer = PredictionWriter(write_interval="batch_and_epoch")
    config = DreamTrainerConfig(
        root_dir=str(out_dir / "root"),
        device="cpu",
        seed=0,
        loggers=[],
        enable_checkpointing=False,
        enable_progress_bar=False,
        print_epoch_summary=False,
        callbacks=[writer],
    )
    trainer = Predictor(config)
    returned = trainer.predict(make_loader())
    torch.save(returned, out_dir / f"returned_rank{trainer.global_rank}.pt")
    dirs = trainer.all_gather_object(str(writer.output_path))
    if trainer.is_global_zero:
        (out_dir / "result.json").write_text(json.dumps({"world_size": trainer.world_size, "output_paths": dirs}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()
    try:
        run(args.out_dir)
    except Exception:
        (args.out_dir / f"error.{os.environ.get('RANK', '0')}").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    sys.exit(main())
