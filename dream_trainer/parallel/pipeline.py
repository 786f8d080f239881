"""Pipeline parallelism in the trainer: this rank's stages, the schedule, and one loss per step.

`pipeline_parallel.py` holds the building blocks (splitting, schedules); this file is the glue the
trainer uses: `Pipeline` remembers this rank's stages, builds the schedule once the stages are wrapped
and on their device, and runs a batch through it (training: forward and backward over micro-batches;
validation: forward only), returning the loss on every rank of the pipeline group.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dream_trainer.errors import MisconfigurationError
from dream_trainer.parallel.pipeline_parallel import build_pipeline_schedule, pipeline_eval, pipeline_step

_STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}


def stages_per_rank(schedule: str) -> int:
    """Stages each rank holds under `schedule` (interleaved schedules hold two)."""
    return _STAGES_PER_RANK[schedule]


def stage_container(stages: list[nn.Module]) -> nn.Sequential:
    """One module holding every child of this rank's stages under its original name, so its parameter
    names (and checkpoint keys) are the whole model's. It is never called: the schedule runs the stages."""
    children: OrderedDict[str, nn.Module] = OrderedDict()
    for stage in stages:
        for name, child in stage.named_children():
            children[name] = child
    return nn.Sequential(children)


class Pipeline:
    """This rank's part of a pipeline-parallel model and the schedule that runs it."""

    def __init__(self, stages: list[nn.Module], indices: list[int], pp_mesh: Any, config: Any) -> None:
        self.stages = stages
        self.indices = indices
        self.pp_mesh = pp_mesh
        self.config = config
        self.num_stages = pp_mesh.size() * len(stages)
        self.is_first = 0 in indices
        self.is_last = self.num_stages - 1 in indices
        self._schedule: Any = None
        self._scale = 1.0
        self._n_microbatches = config.pipeline_microbatches or self.num_stages

    def _build(self, device: torch.device, loss: Callable[[Any, Any], torch.Tensor]) -> Any:
        n = self._n_microbatches

        def loss_fn(output: Any, target: Any) -> torch.Tensor:
            # The schedule backpropagates this itself, so the averages are applied here: over the
            # micro-batches (not by the schedule, which would divide every `.grad` in place, gradients
            # of earlier micro-batches of an accumulation window too) and over the window.
            return loss(output, target) * (self._scale / n)

        return build_pipeline_schedule(
            self.stages,
            self.indices,
            self.num_stages,
            self.pp_mesh,
            device,
            loss_fn,
            n,
            self.config.pipeline_schedule,
            scale_grads=False,
        )

    def run(
        self, inputs: Any, targets: Any, device: torch.device, loss: Callable[[Any, Any], torch.Tensor], scale: float
    ) -> torch.Tensor:
        """Run one batch; training (grad enabled) backpropagates with the loss times `scale`. Returns the
        mean loss over micro-batches (unscaled, detached) on every rank of the pipeline group."""
        if self._schedule is None:
            self._schedule = self._build(device, loss)
        self._scale = scale
        if torch.is_grad_enabled():
            value = pipeline_step(self._schedule, inputs, targets, self.is_first, self.is_last)
        else:
            value = pipeline_eval(self._schedule, inputs, targets, self.is_first, self.is_last)
        # The schedule's losses carry the factors of loss_fn: undo them for the mean loss.
        out = torch.zeros((), device=device) if value is None else value.to(device) * (self._n_microbatches / scale)
        # SYNC: the last stage's loss reaches every stage (one scalar per step), so logging and the
        # step-output checks see the same value everywhere.
        dist.broadcast(out, group=self.pp_mesh.get_group(), group_src=self.pp_mesh.size() - 1)
        return out


def default_split(trainer: Any, pp_mesh: Any) -> tuple[list[nn.Module], list[int]]:
    """Split `trainer.model`, an `nn.Sequential`, into balanced stages for this rank."""
    from dream_trainer.parallel.pipeline_parallel import split_sequential

    model = getattr(trainer, "model", None)
    if not isinstance(model, nn.Sequential):
        raise MisconfigurationError(
            f"pipeline_parallel={pp_mesh.size()}: the default apply_pipeline_parallel splits `self.model` when it "
            f"is an nn.Sequential, but it is {type(model).__name__}. Build the model as an nn.Sequential of "
            "blocks, or override `apply_pipeline_parallel(self, pp_mesh)` and call "
            "`self.set_pipeline(stage_modules, stage_indices)` (see dream_trainer.parallel.pipeline_parallel)."
        )
    return split_sequential(
        model, pp_mesh.get_local_rank(), pp_mesh.size(), stages_per_rank(trainer.config.pipeline_schedule)
    )
