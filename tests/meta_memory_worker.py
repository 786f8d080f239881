"""A ~300 MB model built on the meta device and sharded over 4 CPU processes (gloo), for
tests/test_meta_memory.py.

    torchrun --standalone --nproc_per_node 4 tests/meta_memory_worker.py --out-dir DIR

(The tests run it as the first part of `four_rank_worker.py`'s launch: `run(DIR)`, before anything else
has allocated, so the peak-RSS figures are this model's.)

`init_device="meta"`, `dp_shard=4`, strategy "model_parallel": each rank must allocate only its quarter
of the parameters, and the whole model must never exist in any process. Every rank measures its peak
resident memory (`ru_maxrss`) before the trainer's setup, after it, and after one SGD step, and its
local parameter bytes (the sum of its DTensor shards); rank 0 writes every rank's figures to
`DIR/meta_memory.json` (`DIR/meta_memory.error.<rank>` with the traceback if a rank raises).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig

WIDTH, LAYERS = 3072, 8  # 8 x (3072 x 3072 + 3072) fp32 parameters: 302 MB
BATCH = 8  # global; 2 rows per data-parallel rank


def full_model_bytes() -> int:
    return LAYERS * (WIDTH * WIDTH + WIDTH) * 4


def max_rss_bytes() -> int:
    """The process's peak resident set size so far (`ru_maxrss` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class BigTrainer(DreamTrainer):
    def configure_models(self) -> None:
        # Runs under torch.device("meta") (init_device="meta"): shapes only.
        self.model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)  # no state: params + grads only

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g))
        return DataLoader(data, batch_size=BATCH // self.dp_world_size), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"loss": F.mse_loss(self.model(x), y)}


def warm_up() -> None:
    """Import what the setup imports and join the process group (the trainer keeps a group it finds),
    so the measured growth is the model's: a few tens of MiB of code and buffers otherwise."""
    import torch.distributed as dist
    import torch.distributed.fsdp
    import torch.distributed.tensor.parallel  # noqa: F401

    import dream_trainer.parallel.data_parallel
    import dream_trainer.parallel.meta_init
    import dream_trainer.parallel.model_parallel  # noqa: F401

    if not dist.is_initialized():
        dist.init_process_group("gloo")


def local_param_bytes(model: nn.Module) -> tuple[int, int]:
    """(this rank's bytes: the local shards of the DTensor parameters, the unsharded model's bytes)."""
    local = total = 0
    for p in model.parameters():
        assert isinstance(p, DTensor), type(p)
        local += p.to_local().numel() * p.element_size()
        total += p.numel() * p.element_size()
    return local, total


def run(out_dir: Path) -> None:
    torch.set_num_threads(1)
    config = DreamTrainerConfig(
        root_dir=str(out_dir / "run"),
        device="cpu",
        strategy="model_parallel",
        dp_shard=4,
        init_device="meta",
        max_steps=1,
        n_epochs=1,
        seed=0,
        loggers=[],
        enable_checkpointing=False,
        enable_progress_bar=False,
        print_epoch_summary=False,
        num_sanity_val_steps=0,
    )
    trainer = BigTrainer(config)
    warm_up()  # the modules setup imports, the process group: costs that do not grow with the model
    rss_before = max_rss_bytes()
    start = time.perf_counter()
    trainer._setup_fit()  # process group, meta build, fully_shard, each rank allocates + inits its shards
    setup_s = time.perf_counter() - start
    rss_setup = max_rss_bytes()
    local_setup, total = local_param_bytes(trainer.model)
    finite = all(bool(torch.isfinite(p.to_local()).all()) for p in trainer.model.parameters())

    before = [p.to_local().flatten()[:64].clone() for p in trainer.model.parameters()]  # a sample: no copy
    start = time.perf_counter()
    trainer.fit()  # already set up: one SGD step
    step_s = time.perf_counter() - start
    rss_step = max_rss_bytes()
    local_step, _ = local_param_bytes(trainer.model)
    after = [p.to_local().flatten()[:64] for p in trainer.model.parameters()]
    changed = all(not torch.equal(b, a) for b, a in zip(before, after, strict=True))

    mine = {
        "rank": trainer.global_rank,
        "full_model_bytes": full_model_bytes(),
        "total_param_bytes": total,
        "local_param_bytes_setup": local_setup,
        "local_param_bytes_step": local_step,
        "rss_before": rss_before,
        "rss_after_setup": rss_setup,
        "rss_after_step": rss_step,
        "setup_s": setup_s,
        "step_s": step_s,
        "finite": finite,
        "stepped": trainer.global_step == 1 and changed,
        "mesh": dict(zip(trainer.device_mesh.mesh_dim_names, trainer.device_mesh.shape, strict=True)),
    }
    ranks = trainer.all_gather_object(mine)
    if trainer.global_rank == 0:
        (out_dir / "meta_memory.json").write_text(json.dumps(ranks, indent=2))
        for r in ranks:  # the figures, for the launch log
            print(json.dumps(r), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()
    try:
        run(args.out_dir)
    except Exception:
        (args.out_dir / f"meta_memory.error.{os.environ.get('RANK', '0')}").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    sys.exit(main())
