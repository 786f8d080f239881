"""Tensor parallelism: the user's plan, the checks around it, and norms over sharded gradients.

Which layers split column-wise and which row-wise depends on the model's own code (attention heads,
MLP widths, what consumes which output), so the trainer does not guess: `tensor_parallel=N` calls the
trainer's `apply_tensor_parallel(self, tp_mesh)`, which applies a
`torch.distributed.tensor.parallel.parallelize_module` plan. The default of that hook raises
`tensor_parallel_plan_error`; after the hook, `check_tp_applied` confirms that it sharded something.

Order in setup (as torchtitan): tensor parallel -> activation checkpointing -> compile -> FSDP / replicate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NoReturn

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dream_trainer.errors import MisconfigurationError

__all__ = ["check_tp_applied", "grad_total_norm", "tensor_parallel_plan_error"]

_EXAMPLE = """\
    def apply_tensor_parallel(self, tp_mesh):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        parallelize_module(self.model, tp_mesh, {"mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})"""


def tensor_parallel_plan_error(degree: int) -> NoReturn:
    """Raise the error of the default `apply_tensor_parallel` hook: a degree above 1 with no plan.

    Raises `MisconfigurationError` naming `tensor_parallel=degree`, the hook to override (with an
    example plan), and the alternative (tensor_parallel=1).
    """
    raise MisconfigurationError(
        f"tensor_parallel={degree} needs a tensor-parallel plan, and the trainer has none: override "
        "`apply_tensor_parallel(self, tp_mesh)` in your trainer and apply a `parallelize_module` plan to "
        f"your model's layers there, for example\n{_EXAMPLE}\n"
        "(ColwiseParallel splits a Linear's outputs, RowwiseParallel its inputs and sums the partial results; "
        "pair them so the activations in between stay sharded). Or set tensor_parallel=1."
    )


def check_tp_applied(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Raise `MisconfigurationError` unless some parameter of `model` is a DTensor on `tp_mesh` (or on a
    mesh that contains its dimension, as after FSDP over a 2-D mesh): the `apply_tensor_parallel` hook
    ran but sharded nothing, and every TP rank would train the same full copy while its neighbours
    wait on collectives that never come."""
    tp_names = set(tp_mesh.mesh_dim_names or ())
    for param in model.parameters():
        if not isinstance(param, DTensor):
            continue
        mesh = param.device_mesh
        if mesh == tp_mesh or (tp_names and tp_names <= set(mesh.mesh_dim_names or ())):
            return
    raise MisconfigurationError(
        f"tensor_parallel={tp_mesh.size()} but no parameter of {type(model).__name__} is sharded on the "
        f"tensor-parallel mesh {tp_mesh.mesh_dim_names} after `apply_tensor_parallel(self, tp_mesh)` ran: "
        "call `parallelize_module(model, tp_mesh, plan)` there on the model you return from "
        "configure_models (plan keys are submodule names, e.g. 'layers.0.mlp.fc1'), or set tensor_parallel=1"
    )


def grad_total_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients of `parameters` as if they were whole tensors: a plain (non-DTensor)
    tensor equal on every rank that holds the same parameters.

    Gradients of sharded parameters are DTensors; `torch.nn.utils.get_total_norm` handles them when all
    are on one mesh (its result is a DTensor; `.full_tensor()` reduces the partial norms). After TP + FSDP
    they are not: TP-sharded weights live on the 2-D (dp, tp) mesh and the rest on the 1-D dp mesh, and
    stacking norms of different meshes fails. So the norm is taken per mesh and the results combined.
    The parameters of other pipeline stages are not included: under PP, combine the stages' norms
    yourself (all-reduce of norm**p over the "pp" mesh).
    """
    return total_norm_of_grads([p.grad for p in parameters if p.grad is not None], norm_type)


def total_norm_of_grads(grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """`grad_total_norm` of the gradient tensors themselves."""
    if not grads:
        return torch.tensor(0.0)
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        return norms[0]
    stacked = torch.stack([n.to(norms[0].device) for n in norms])
    if math.isinf(norm_type):
        return stacked.max() if norm_type > 0 else stacked.min()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type)
