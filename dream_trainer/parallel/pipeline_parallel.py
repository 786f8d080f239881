"""Pipeline parallelism with `torch.distributed.pipelining`: split a model into stages, build a schedule,
run a training step or a validation forward.

Each rank of the "pp" mesh holds one stage (GPipe, 1F1B) or several (interleaved 1F1B: stages
r, r + pp_size, r + 2 * pp_size, ... on pp rank r, the "loop" placement the interleaved schedule expects).
A step cuts the batch into `n_microbatches` along dim 0, sends activations forward and gradients
backward between neighbouring stages, and computes the loss on the last stage only.

Data parallelism composes: shard each stage module with `apply_fsdp(..., reshard_after_forward=False)`
(on the mesh without "pp") before `build_pipeline_schedule`; the schedule drives FSDP's gradient sync.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dream_trainer.errors import ConfigError

__all__ = [
    "SCHEDULES",
    "build_pipeline_schedule",
    "pipeline_eval",
    "pipeline_step",
    "split_sequential",
    "stage_indices_for_rank",
]

#: schedule name -> (class name in torch.distributed.pipelining, whether it runs several stages per rank)
SCHEDULES: dict[str, tuple[str, bool]] = {
    "gpipe": ("ScheduleGPipe", False),
    "1f1b": ("Schedule1F1B", False),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", True),
}


def stage_indices_for_rank(pp_rank: int, pp_size: int, stages_per_rank: int = 1) -> list[int]:
    """The stages pp rank `pp_rank` holds: `[pp_rank + k * pp_size for k in range(stages_per_rank)]`."""
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


def split_sequential(
    model: nn.Module, pp_rank: int, pp_size: int, stages_per_rank: int = 1
) -> tuple[list[nn.Module], list[int]]:
    """This rank's stage modules and their stage indices, for `build_pipeline_schedule`.

    `nn.Sequential`: its children are cut into `pp_size * stages_per_rank` contiguous stages balanced by
    **parameter count** (the cut that makes the largest stage smallest; parameter-free children such as
    activations stay with the layer before them), each stage at least one child. A stage is an
    `nn.Sequential` of the original children under their original names, so its `state_dict()` keys are
    the full model's ("3.weight"): checkpoints of a pipelined run load into the whole model. No copy is
    made: the stages share the model's modules.

    Any other model that owns an `nn.ModuleList` of blocks (a transformer): the blocks are cut by
    **block count** (blocks are alike), and each stage is a `copy.deepcopy` of the model (build it on
    the meta device, then `materialize` the stages) in which the list keeps only this stage's blocks,
    under their original indices, and the top-level children registered before the list (embeddings)
    are set to None outside the first stage, those after it (norm, head) outside the last. The model's
    `forward` must run `for block in self.layers` and skip children that are None (torchtitan's contract).
    """
    num_stages = pp_size * stages_per_rank
    if pp_size < 1 or stages_per_rank < 1 or not 0 <= pp_rank < pp_size:
        raise ConfigError(
            f"split_sequential got pp_rank={pp_rank}, pp_size={pp_size}, stages_per_rank={stages_per_rank}: "
            "pp_size and stages_per_rank must be positive and 0 <= pp_rank < pp_size"
        )
    indices = stage_indices_for_rank(pp_rank, pp_size, stages_per_rank)
    if isinstance(model, nn.Sequential):
        children = list(model.named_children())
        bounds = _balanced_bounds([_n_params(m) for _, m in children], num_stages, type(model).__name__)
        stages: list[nn.Module] = [nn.Sequential(OrderedDict(children[bounds[i] : bounds[i + 1]])) for i in indices]
        return stages, indices
    list_name = next((n for n, m in model.named_children() if isinstance(m, nn.ModuleList)), None)
    if list_name is None:
        raise ConfigError(
            f"split_sequential cannot split {type(model).__name__}: it is neither an nn.Sequential nor a model "
            "with an nn.ModuleList child of blocks. Build the stage modules yourself and pass them to "
            "build_pipeline_schedule"
        )
    blocks = getattr(model, list_name)
    bounds = _balanced_bounds([1] * len(blocks), num_stages, f"{type(model).__name__}.{list_name}")
    names = [n for n, _ in model.named_children()]
    before, after = names[: names.index(list_name)], names[names.index(list_name) + 1 :]
    stages = []
    for i in indices:
        stage = copy.deepcopy(model)
        kept = nn.ModuleList()
        # Keep the original indices as names, so state_dict keys match the unsplit model.
        kept._modules = OrderedDict((str(j), getattr(stage, list_name)[j]) for j in range(bounds[i], bounds[i + 1]))
        setattr(stage, list_name, kept)
        for name in (before if i > 0 else []) + (after if i < num_stages - 1 else []):
            setattr(stage, name, None)
        stages.append(stage)
    return stages, indices


def _n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _balanced_bounds(weights: list[int], parts: int, what: str) -> list[int]:
    """Cut points `b` (len parts + 1) of `weights` into `parts` non-empty contiguous runs minimizing the
    largest run's sum; ties go to cuts that put zero-weight items after the item before them."""
    n = len(weights)
    if n < parts:
        raise ConfigError(
            f"cannot split {what} of {n} blocks into {parts} pipeline stages (pipeline_parallel x stages per "
            f"rank): lower pipeline_parallel or the stages per rank to at most {n}, or give the model more blocks"
        )
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the smallest largest-run sum cutting the first i items into k runs.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                # `<=` keeps the latest cut among equals: parameter-free items join the run before them.
                if cost <= best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [n], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


def build_pipeline_schedule(
    stage_modules: list[nn.Module],
    stage_indices: list[int],
    num_stages: int,
    pp_mesh: DeviceMesh,
    device: torch.device,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    n_microbatches: int,
    schedule: str = "1f1b",
    *,
    scale_grads: bool = True,
) -> Any:
    """A `torch.distributed.pipelining` schedule running this rank's `stage_modules` (with stage numbers
    `stage_indices`, from `split_sequential`) over the 1-D `pp_mesh`.

    `schedule`: "gpipe" (all forwards, then all backwards: simplest, most activation memory), "1f1b"
    (one forward one backward in the steady state: activations of at most pp_size microbatches live),
    "interleaved_1f1b" (several stages per rank: a smaller pipeline bubble, more communication).
    `loss_fn(output, target)` must return the mean over a microbatch: gradients are divided by
    `n_microbatches`, so a step trains like one batch with the mean loss. With `scale_grads=False`
    they are not: the loss must then carry that factor itself (the schedule's division acts on the
    whole `.grad`, so it would also shrink gradients accumulated by earlier steps of a window).
    """
    from torch.distributed import pipelining

    if schedule not in SCHEDULES:
        valid = ", ".join(repr(s) for s in SCHEDULES)
        raise ConfigError(f"pipeline schedule={schedule!r} is invalid: valid choices are {valid}")
    class_name, multi = SCHEDULES[schedule]
    if len(stage_modules) != len(stage_indices) or not stage_modules:
        raise ConfigError(
            f"build_pipeline_schedule got {len(stage_modules)} stage modules and {len(stage_indices)} stage "
            "indices: pass one index per module (split_sequential returns both)"
        )
    if multi and len(stage_modules) < 2:
        raise ConfigError(
            f"pipeline schedule={schedule!r} runs several stages per rank, but this rank holds "
            f"{len(stage_modules)}: split with stages_per_rank >= 2, or use schedule='1f1b' or 'gpipe'"
        )
    if not multi and len(stage_modules) != 1:
        raise ConfigError(
            f"pipeline schedule={schedule!r} runs one stage per rank, but this rank holds {len(stage_modules)}: "
            "use schedule='interleaved_1f1b', or split with stages_per_rank=1"
        )
    pp_size = pp_mesh.size()
    if num_stages != pp_size * len(stage_modules):
        raise ConfigError(
            f"num_stages={num_stages} but the pp mesh has {pp_size} ranks holding {len(stage_modules)} "
            f"stage(s) each: num_stages must be {pp_size * len(stage_modules)}"
        )
    if n_microbatches < pp_size:
        raise ConfigError(
            f"n_microbatches={n_microbatches} is below pipeline_parallel={pp_size}: the pipeline would never "
            f"fill (and {class_name} refuses it); use at least {pp_size} microbatches, ideally several times more"
        )
    group = pp_mesh.get_group()
    stages = [
        pipelining.PipelineStage(module, index, num_stages, device, group=group)
        for module, index in zip(stage_modules, stage_indices, strict=True)
    ]
    cls = getattr(pipelining, class_name)
    return cls(stages if multi else stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)


def pipeline_step(schedule: Any, inputs: Any, targets: Any, is_first: bool, is_last: bool) -> torch.Tensor | None:
    """One training forward + backward through the pipeline (the optimizer step is yours).

    `inputs` is used on the rank holding the first stage, `targets` on the one holding the last (other
    ranks may pass None). Returns the loss, the mean over microbatches, detached, on the last stage's
    rank; None elsewhere (broadcast it over the "pp" mesh to log it everywhere).
    """
    losses: list[torch.Tensor] | None = [] if is_last else None
    args = (inputs,) if is_first else ()
    schedule.step(*args, target=targets if is_last else None, losses=losses)
    return torch.stack(losses).mean().detach() if losses else None


def pipeline_eval(schedule: Any, inputs: Any, targets: Any, is_first: bool, is_last: bool) -> torch.Tensor | None:
    """One validation forward through the pipeline: no backward, no gradients, parameters untouched.

    Uses `schedule.eval` (every schedule has it on torch 2.13: the same microbatching and loss_fn, forward
    only; the schedule re-prepares its stages when switching between eval and training, so training goes
    on after it). Returns the mean loss over microbatches on the last stage's rank, None elsewhere.
    Modules stay in whatever train/eval mode they are in: call `.eval()` on the stages for dropout-free
    validation, as without a pipeline.
    """
    losses: list[torch.Tensor] | None = [] if is_last else None
    args = (inputs,) if is_first else ()
    with torch.no_grad():
        schedule.eval(*args, target=targets if is_last else None, losses=losses)
    return torch.stack(losses).mean().detach() if losses else None
