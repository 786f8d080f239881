"""`DreamTrainer` on N-D meshes, 4 CPU processes (gloo), for tests/test_model_parallel.py.

    torchrun --standalone --nproc_per_node 4 tests/model_parallel_worker.py --out-dir DIR

(The tests run it as part of `four_rank_worker.py`'s launch: `run(DIR)`, after the other parts.)

Every rank trains the same `Trainer` under several meshes in turn; rank 0 writes, after each one,
`DIR/<case>.pt`: the full (unsharded) weights at the end, and the logged training losses. pytest
compares them with one process training the same model on the same global batches. A case that
raises writes `DIR/<case>.error` (traceback) and the run stops.

Cases (AdamW, gradient clipping and accumulation on in all of them):
- tp_fsdp        dp_shard=2 x tensor_parallel=2
- hsdp           dp_replicate=2 x dp_shard=2
- pp_dp          pipeline_parallel=2 x dp_shard=2 (1F1B)
- tp_pp          tensor_parallel=2 x pipeline_parallel=2 (GPipe)
- meta_fsdp      init_device="meta", dp_shard=4: each rank's parameter bytes vs the whole model's
- resume_2d      dp_shard=2 x tensor_parallel=2: a sharded checkpoint after 3 of 6 steps, resumed by a
                 fresh trainer; its weights must equal the uninterrupted run's exactly
- reshard        the checkpoint of tp_fsdp loaded at dp_shard=4, weights written for comparison
- ema_grad_norm  dp_shard=2 x tensor_parallel=2, no clipping, with EMA and GradientNormMonitor: the
                 averaged weights (unsharded) and the gradient norms logged at every step
- fp16_2d        dp_shard=2 x tensor_parallel=2, mixed_precision="fp16", layers 2 and 4 TP-sharded (the
                 first gradient is on "dp_shard" alone); rank 1 alone sees an inf gradient at step 2:
                 every rank's loss scale, and a checksum of every rank's shards
- dropout_2d     dp_shard=2 x tensor_parallel=2, meta-device init, dropout after the column-wise layer
                 (sharded activation) and after the row-wise one (replicated): a checksum of every
                 dropout mask each rank drew, and of every rank's shards
- dropout_resume dropout_2d killed at step 5 and resumed from its step-3 checkpoint by a fresh trainer
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).parent))
from model_parallel_common import (
    CASES,
    DIM,
    HIDDEN,
    OUT,
    CrashAfter,
    InfGradAt,
    LayerNorms,
    Trainer,
    case_config,
    ema_callbacks,
)

from dream_trainer.callbacks import ModelCheckpoint


class TPTrainer(Trainer):
    def apply_tensor_parallel(self, tp_mesh: Any) -> None:
        # Only the first two layers: the others stay whole on every TP rank, so the gradients live on
        # two meshes ((dp_shard, tp) and dp_shard) and clipping must handle both.
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        parallelize_module(self.model, tp_mesh, plan)


class LateTPTrainer(Trainer):
    def apply_tensor_parallel(self, tp_mesh: Any) -> None:
        # The first layer stays whole: the first gradient the fp16 scaler unscales is on "dp_shard" alone.
        parallelize_module(self.model, tp_mesh, {"2": ColwiseParallel(), "4": RowwiseParallel()})


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().numpy().tobytes())


class DropoutTrainer(TPTrainer):
    """Dropout after layer 0 (column-wise: each TP rank drops from its slice of the hidden units) and
    after layer 2 (row-wise: the activation is replicated over the TP group, whose ranks must drop the
    same units). Records (global_step, dropout layer, checksum of the mask) for every training forward."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.masks: list[tuple[int, int, int]] = []
        self.initial_shards: dict[str, int] = {}

    def configure_models(self) -> None:
        self.model = nn.Sequential(
            nn.Linear(DIM, HIDDEN), nn.Dropout(0.5), nn.Linear(HIDDEN, HIDDEN), nn.Dropout(0.5), nn.Linear(HIDDEN, OUT)
        )
        for i in (1, 3):
            self.model[i].register_forward_hook(self._record)

    def on_train_start(self) -> None:
        # The meta-device init as each rank drew it (before training makes every shard differ anyway).
        self.initial_shards = {n: crc(p.to_local()) for n, p in self.model.named_parameters()}

    def _record(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if module.training:  # validation runs without dropout
            layer = 1 if module is self.model[1] else 3
            self.masks.append((self.global_step, layer, crc(output == 0)))


def local_shards(trainer: Trainer) -> list[dict[str, int]]:
    """Per rank, a checksum of its local part of every parameter (collective)."""
    mine = {n: crc(p.to_local() if isinstance(p, DTensor) else p) for n, p in trainer.model.named_parameters()}
    return trainer.all_gather_object(mine)


def full_weights(trainer: Trainer, state_dict: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Every rank's part of the model (or of `state_dict`, e.g. an EMA's), gathered into one unsharded
    state dict (collective)."""
    mine = {}
    for key, value in (trainer.model.state_dict() if state_dict is None else state_dict).items():
        # Collective over the value's mesh: the ranks of one stage hold the same keys, in one order.
        full = value.full_tensor() if isinstance(value, DTensor) else value
        mine[key] = full.detach().cpu().clone()
    merged: dict[str, torch.Tensor] = {}
    for part in trainer.all_gather_object(mine):  # pipeline stages hold different keys
        merged.update(part)
    return merged


def run_case(name: str, out_dir: Path) -> None:
    overrides = CASES[name]
    cls: type[Trainer] = TPTrainer if overrides.get("tensor_parallel", 1) > 1 else Trainer
    if name.startswith("dropout"):
        cls = DropoutTrainer
    root = out_dir / f"run_{name}"
    if name in ("resume_2d", "dropout_resume"):
        # Checkpoints every 3 steps; the run dies at step 5, mid-epoch and inside no window; a fresh
        # trainer resumes from step 3 (mid-epoch 0) and must end where the uninterrupted run ends.
        callbacks = [ModelCheckpoint(every_n_train_steps=3, save_last=True), CrashAfter(5)]
        first = cls(case_config(root, callbacks=callbacks, **overrides))
        try:
            first.fit()
        except RuntimeError as exc:
            assert "crash at step 5" in str(exc), exc
        ckpt = first.checkpoint_dir / "last.ckpt"
        trainer = cls(case_config(root, **overrides))
        trainer.fit(ckpt_path=ckpt)
    elif name == "reshard":
        trainer = cls(case_config(root, **overrides))
        trainer.load_checkpoint(torch.load(out_dir / "tp_fsdp.pt", weights_only=True)["last_ckpt"])
    elif name == "fp16_2d":
        trainer = LateTPTrainer(case_config(root, callbacks=[InfGradAt(rank=1)], **overrides))
        trainer.fit()
    elif name == "ema_grad_norm":
        trainer = cls(case_config(root, callbacks=ema_callbacks(), **overrides))
        trainer.fit()
    else:
        trainer = cls(case_config(root, **overrides))
        trainer.fit()
    result: dict[str, Any] = {
        "weights": full_weights(trainer),
        "losses": trainer.recorded_losses,
        "val_loss": trainer.callback_metrics.get("val_loss"),
        "last_ckpt": str(trainer.checkpoint_dir / "last.ckpt"),
    }
    if name == "meta_fsdp":
        local = sum(p.to_local().numel() * p.element_size() for p in trainer.model.parameters())
        total = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        result["param_bytes"] = trainer.all_gather_object((local, total))
    if name == "ema_grad_norm":
        ema = next(c for c in trainer.callbacks if type(c).__name__ == "EMA")
        result["ema"] = full_weights(trainer, ema.ema_state_dict()["model"])
        result["grad_norms"] = trainer.recorded_grad_norms
        result["layer_norms"] = next(c for c in trainer.callbacks if isinstance(c, LayerNorms)).norms
    if name == "fp16_2d":
        assert trainer.grad_scaler is not None
        result["scales"] = trainer.all_gather_object(trainer.grad_scaler.get_scale())
    if isinstance(trainer, DropoutTrainer):
        result["masks"] = trainer.all_gather_object(trainer.masks)
        result["initial_shards"] = trainer.all_gather_object(trainer.initial_shards)
    if name in ("fp16_2d", "dropout_2d"):
        result["shards"] = local_shards(trainer)
    result["dp"] = trainer.all_gather_object((trainer.dp_rank, trainer.dp_world_size))
    if dist.get_rank() == 0:
        torch.save(result, out_dir / f"{name}.pt")


def run(out_dir: Path, cases: list[str] | None = None) -> None:
    """The cases in order (all by default); a case that raises writes `DIR/<case>.error.<rank>` and ends the run."""
    for name in cases or list(CASES):
        try:
            run_case(name, out_dir)
        except Exception:
            (out_dir / f"{name}.error.{os.environ['RANK']}").write_text(traceback.format_exc())
            raise


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    run(args.out_dir, args.cases.split(","))


if __name__ == "__main__":
    main()
