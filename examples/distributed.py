"""One script for one process, DDP or FSDP: launch it with `python` or with `torchrun`, no code change.

    python examples/distributed.py                                                    # one process
    torchrun --standalone --nproc_per_node 2 examples/distributed.py --strategy ddp   # 2 processes, DDP
    torchrun --standalone --nproc_per_node 2 examples/distributed.py --strategy fsdp  # 2 processes, FSDP2
    torchrun --standalone --nproc_per_node gpu examples/distributed.py                # every GPU (auto: DDP)

On a machine without GPUs each process trains on the CPU and the processes talk through gloo; with
GPUs each takes the GPU of its LOCAL_RANK and NCCL (more processes than GPUs are refused at the start:
add `--device cpu` to run them all on the CPU). On 2 CPU cores one process takes ~5 s, DDP ~10 s
and FSDP ~20 s (on CPUs it is the slowest: it gathers each layer's weights for every forward and
backward, which pays off only when a model does not fit on one device).

What changes with several processes, all done by the trainer (see docs/guide.md, section 9):
- the model is wrapped in DistributedDataParallel (`--strategy ddp`, the default under torchrun), or
  sharded with FSDP2 `fully_shard` (`--strategy fsdp`: each Linear of the `nn.Sequential` is its own
  unit, so every process holds only half of each weight);
- the plain DataLoader returned by `configure_dataloaders` gets a DistributedSampler: each process
  trains on its own half of every epoch (`--batch-size` is per process, so the global batch is
  world_size times larger), and validation is split the same way;
- logged metrics are averaged across processes, and only global rank 0 prints, logs and shows progress;
- checkpoints: one file written by rank 0 (single process, DDP), or with FSDP a directory in which
  every rank writes its own shards. `--resume` continues from the newest one (any strategy or number
  of processes can load any of them).

The script itself only decides what rank 0 prints: the strategy, how the model was wrapped, how many
samples each rank trained on (gathered with `trainer.all_gather_object`) and the final validation.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig

N_FEATURES = 16
N_CLASSES = 4


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Points `(n, 16)` labelled by which of 4 fixed random directions they point along most."""
    directions = torch.randn(N_FEATURES, N_CLASSES, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(n, N_FEATURES, generator=torch.Generator().manual_seed(seed))
    return x, (x @ directions).argmax(dim=1)


@dataclass
class DistConfig(DreamTrainerConfig):
    learning_rate: float = 3e-3
    batch_size: int = 32  # per process
    n_train: int = 8192
    n_val: int = 2048
    data_seed: int = 0


class DistributedClassifier(DreamTrainer):
    config: DistConfig

    def configure_models(self) -> None:
        # Every rank builds the same initial weights (fit() seeded all ranks alike); DDP also broadcasts
        # rank 0's weights when it wraps the model.
        self.model = nn.Sequential(
            nn.Linear(N_FEATURES, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, N_CLASSES)
        )
        self.samples_seen = 0  # by this rank

    def configure_optimizers(self) -> None:
        # Built after the model is wrapped / sharded: with FSDP the parameters are now DTensor shards.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.config.learning_rate)

    def configure_dataloaders(self) -> tuple[DataLoader, DataLoader]:
        cfg = self.config
        # Plain loaders, exactly as for one process: the trainer adds the DistributedSampler.
        train = TensorDataset(*make_data(cfg.n_train, cfg.data_seed))
        val = TensorDataset(*make_data(cfg.n_val, cfg.data_seed + 1))
        return DataLoader(train, batch_size=cfg.batch_size, shuffle=True), DataLoader(val, batch_size=256)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.samples_seen += x.shape[0]
        return {"loss": F.cross_entropy(self.model(x), y)}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        return {"val_loss": F.cross_entropy(logits, y), "val_accuracy": (logits.argmax(1) == y).float().mean()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = DistConfig()
    p = argparse.ArgumentParser(description="A classifier that runs on one process or under torchrun (DDP/FSDP).")
    p.add_argument("--strategy", choices=("auto", "ddp", "fsdp"), default="auto", help="(default: %(default)s)")
    p.add_argument("--epochs", type=int, default=3, help="(default: %(default)s)")
    p.add_argument("--n-train", type=int, default=defaults.n_train, help="(default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="per process (default: %(default)s)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="(default: %(default)s)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: a GPU per process if any")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --root-dir")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--root-dir", default="runs/distributed", help="(default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no per-epoch summary lines")
    # Per process: torchrun starts one process per device (or per --nproc_per_node on a CPU machine).
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per process (default: %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Train; return (on every rank) world_size, strategy, the model's wrapper class, samples per rank,
    global_step and the final (cross-rank) val_loss / val_accuracy."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    config = DistConfig(
        strategy=args.strategy,
        n_epochs=args.epochs,
        seed=args.seed,
        data_seed=args.seed,
        n_train=args.n_train,
        batch_size=args.batch_size,
        mixed_precision=None if args.precision == "fp32" else args.precision,
        device=args.device,
        resume_from="last" if args.resume else None,  # also what an elastic restart (--max_restarts) wants
        root_dir=args.root_dir,
        print_epoch_summary=not args.quiet,  # printed by rank 0 only, with metrics averaged over ranks
        enable_progress_bar=not args.quiet,
    )
    trainer = DistributedClassifier(config)
    start = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - start

    # A collective: every rank must call it. (The process group stays up after fit() for this.)
    samples_per_rank = trainer.all_gather_object(trainer.samples_seen)
    metrics = trainer.callback_metrics  # already reduced across ranks: the same on every rank
    results = {
        "world_size": trainer.world_size,
        "strategy": trainer.strategy,
        "wrapper": type(trainer.model).__name__,
        "samples_per_rank": samples_per_rank,
        "global_step": trainer.global_step,
        "val_loss": float(metrics["val_loss"]),
        "val_accuracy": float(metrics["val_accuracy"]),
        "wall_s": wall,
    }
    if trainer.is_global_zero:
        print(
            f"done: {trainer.world_size} process(es) on {trainer.device.type}, strategy {trainer.strategy}, "
            f"model wrapped as {results['wrapper']} | global batch {args.batch_size * trainer.world_size} "
            f"({args.batch_size} per process) | "
            f"samples trained on per rank {samples_per_rank} | {trainer.global_step} steps | "
            f"val_loss {results['val_loss']:.4f} | val_accuracy {results['val_accuracy']:.2%} | {wall:.1f}s"
        )
        print(f"checkpoints: {trainer.checkpoint_dir} (continue with --resume)")
    return results


if __name__ == "__main__":
    main()
