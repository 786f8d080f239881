"""N-D parallel building blocks on 4 CPU processes (gloo), for tests/test_parallel_blocks.py.

    torchrun --standalone --nproc_per_node 4 tests/parallel_blocks_worker.py --out-dir DIR

(The tests run it as part of `four_rank_worker.py`'s launch: `run(DIR)` in its process group.)

Every rank runs the same checks in order and writes `DIR/rank<R>.json` after each one (so a failure
keeps the checks before it): `{check: {...figures...}}`, plus `{"error": traceback}` for a check that
raised (the run then stops: the other ranks would wait on collectives that never come).

Each check trains for 3 AdamW steps on one fixed global batch (16 samples), every data-parallel rank
taking its slice (`dp_rank_and_size`), and compares the weights, gathered with `full_tensor()`, to one
process training the same model (same `torch.manual_seed`) on the whole batch:

- tp_fsdp:   dp_shard=2 x tensor_parallel=2: `parallelize_module` on the MLP blocks + `apply_fsdp`;
             also the dp rank of each rank, and grad norms (get_total_norm on TP-sharded grads, and
             `grad_total_norm` over every grad of the 2-D + 1-D sharded model) vs the unsharded norm.
- hsdp:      dp_replicate=2 x dp_shard=2: `apply_fsdp` on the 2-D mesh.
- tp_ddp:    dp_replicate=2 x tensor_parallel=2: TP + `apply_ddp`.
- pp_1f1b:   pipeline_parallel=2 x dp_shard=2: `split_sequential` + FSDP per stage + 1F1B, with the
             training loss and a `pipeline_eval` loss against the reference.
- pp_interleaved: pipeline_parallel=2 x dp_shard=2, 2 stages per rank, interleaved 1F1B.
- meta_fsdp: a model built on the meta device, `apply_fsdp` over dp_shard=4, `materialize`: the
             parameter bytes each rank holds against the full model's; then a NaN in one rank's shard,
             which `check_finite_weights(group=...)` reports on every rank.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dream_trainer.errors import MisconfigurationError
from dream_trainer.parallel.data_parallel import apply_ddp, apply_fsdp
from dream_trainer.parallel.dims import ParallelDims, dp_rank_and_size, fsdp_mesh, submesh
from dream_trainer.parallel.meta_init import check_finite_weights, materialize
from dream_trainer.parallel.pipeline_parallel import (
    build_pipeline_schedule,
    pipeline_eval,
    pipeline_step,
    split_sequential,
)
from dream_trainer.parallel.tensor_parallel import check_tp_applied, grad_total_norm

DIM, HIDDEN, BATCH, STEPS, LR = 8, 16, 16, 3, 1e-2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class MLP(nn.Module):
    """Residual MLP blocks (tensor-parallel: fc1 column-wise, fc2 row-wise) and a replicated head."""

    def __init__(self, n_blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_mlp() -> MLP:
    torch.manual_seed(0)
    return MLP()


def make_sequential() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(4):
        layers += [nn.Linear(DIM if i == 0 else HIDDEN, HIDDEN), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(HIDDEN, 1))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, 1, generator=g)


def tp_plan(model: MLP) -> dict[str, Any]:
    plan: dict[str, Any] = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.fc1"], plan[f"blocks.{i}.fc2"] = ColwiseParallel(), RowwiseParallel()
    return plan


def reference(make: Callable[[], nn.Module]) -> dict[str, Any]:
    """One process, the whole batch: the weights after STEPS steps, the losses and grad norms per step."""
    model, (x, y) = make(), data()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        opt.step()
    with torch.no_grad():
        val_loss = F.mse_loss(model(x * 0.5), y).item()
    return {"weights": model.state_dict(), "losses": losses, "norms": norms, "val_loss": val_loss}


def full_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest difference over `got`'s tensors (a pipeline stage holds some of the reference's)."""
    missing = sorted(set(got) - set(want))
    if missing:
        raise AssertionError(f"parameters not in the reference: {missing}")
    return max((got[k].detach() - want[k]).abs().max().item() for k in got)


def train(model: nn.Module, mesh: Any) -> dict[str, Any]:
    """STEPS AdamW steps on this rank's slice of the global batch."""
    rank, size = dp_rank_and_size(mesh)
    x, y = (t.chunk(size)[rank] for t in data())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return {"dp_rank": rank, "dp_size": size}


# --- the checks -------------------------------------------------------------------------------------
def check_tp_fsdp() -> dict[str, Any]:
    mesh = ParallelDims(dp_shard=2, tensor_parallel=2, world_size=4).build_mesh("cpu")
    ref = reference(make_mlp)
    model = make_mlp()
    parallelize_module(model, mesh["tp"], tp_plan(model))
    check_tp_applied(model, mesh["tp"])

    # Grad norms of the first step on TP alone: get_total_norm over the DTensor grads, then full_tensor.
    rank, size = dp_rank_and_size(mesh)
    x, y = data()  # TP alone: every rank sees the whole batch (no data parallelism yet)
    F.mse_loss(model(x), y).backward()
    tp_grads = [p.grad for p in model.parameters() if isinstance(p.grad, DTensor)]
    tp_norm = torch.nn.utils.get_total_norm(tp_grads).full_tensor().item()
    ref_model = make_mlp()
    F.mse_loss(ref_model(x), y).backward()
    tp_names = {n for n, p in model.named_parameters() if isinstance(p, DTensor)}
    ref_tp_norm = torch.nn.utils.get_total_norm([p.grad for n, p in ref_model.named_parameters() if n in tp_names])
    model.zero_grad(set_to_none=True)

    apply_fsdp(model, fsdp_mesh(mesh))
    out = train(model, mesh)
    # One more backward (not stepped) for the norm over every grad: 2-D (dp, tp) and 1-D (dp) DTensors.
    xs, ys = (t.chunk(size)[rank] for t in data())
    model.zero_grad(set_to_none=True)
    F.mse_loss(model(xs), ys).backward()
    meshes = sorted({str(p.grad.device_mesh.mesh_dim_names) for p in model.parameters()})
    try:
        torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        plain_mixed = "ok"
    except Exception as exc:  # the quirk grad_total_norm exists for
        plain_mixed = f"{type(exc).__name__}: {str(exc)[:200]}"
    all_norm = grad_total_norm(model.parameters()).item()
    ref_model = make_mlp()
    ref_model.load_state_dict(ref["weights"])
    F.mse_loss(ref_model(data()[0]), data()[1]).backward()
    ref_all_norm = torch.nn.utils.get_total_norm([p.grad for p in ref_model.parameters()]).item()
    return {
        **out,
        "tp_rank": mesh["tp"].get_local_rank(),
        "max_diff": max_diff(full_weights(model.state_dict()), ref["weights"]),
        "tp_norm": tp_norm,
        "ref_tp_norm": ref_tp_norm.item(),
        "all_norm": all_norm,
        "ref_all_norm": ref_all_norm,
        "grad_meshes": meshes,
        "get_total_norm_mixed_meshes": plain_mixed,
    }


def check_hsdp() -> dict[str, Any]:
    mesh = ParallelDims(dp_replicate=2, dp_shard=2, world_size=4).build_mesh("cpu")
    model = apply_fsdp(make_mlp(), fsdp_mesh(mesh))
    out = train(model, mesh)
    placements = sorted({str(p.placements) for p in model.parameters()})
    return {
        **out,
        "placements": placements,
        "max_diff": max_diff(full_weights(model.state_dict()), reference(make_mlp)["weights"]),
    }


def check_tp_ddp() -> dict[str, Any]:
    mesh = ParallelDims(dp_replicate=2, dp_shard=1, tensor_parallel=2, world_size=4).build_mesh("cpu")
    model = make_mlp()
    parallelize_module(model, mesh["tp"], tp_plan(model))
    apply_ddp(model, submesh(mesh, "dp_replicate"))
    out = train(model, mesh)
    names = sorted(model.state_dict())
    return {
        **out,
        "state_dict_keys": names,
        "max_diff": max_diff(full_weights(model.state_dict()), reference(make_mlp)["weights"]),
    }


def check_pipeline(schedule: str, stages_per_rank: int) -> dict[str, Any]:
    mesh = ParallelDims(pipeline_parallel=2, dp_shard=2, world_size=4).build_mesh("cpu")
    pp_mesh = mesh["pp"]
    pp_rank, pp_size = pp_mesh.get_local_rank(), pp_mesh.size()
    ref = reference(make_sequential)
    stages, indices = split_sequential(make_sequential(), pp_rank, pp_size, stages_per_rank)
    for stage in stages:
        apply_fsdp(stage, fsdp_mesh(mesh), reshard_after_forward=False)
    num_stages = pp_size * stages_per_rank
    sched = build_pipeline_schedule(
        stages, indices, num_stages, pp_mesh, torch.device("cpu"), F.mse_loss, n_microbatches=2, schedule=schedule
    )
    is_first, is_last = 0 in indices, num_stages - 1 in indices
    rank, size = dp_rank_and_size(mesh)
    x, y = (t.chunk(size)[rank] for t in data())
    opt = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = pipeline_step(sched, x, y, is_first, is_last)
        losses.append(None if loss is None else loss.item())
        opt.step()
    # The pipeline's loss is this dp rank's mean; the reference's is the global batch's: average over dp.
    if is_last:
        t = torch.tensor(losses)
        dist.all_reduce(t, group=submesh(mesh, "dp").get_group())
        losses = (t / size).tolist()
    before = {k: v.full_tensor() for s in stages for k, v in s.state_dict().items()}
    val = pipeline_eval(sched, x * 0.5, y, is_first, is_last)
    if val is not None:
        dist.all_reduce(val, group=submesh(mesh, "dp").get_group())
        val = val / size
    weights = {k: v.full_tensor() for s in stages for k, v in s.state_dict().items()}
    # Training goes on after a validation run (the schedule switches its stages back by itself).
    after_eval = pipeline_step(sched, x, y, is_first, is_last)
    return {
        "pp_rank": pp_rank,
        "stage_indices": indices,
        "stage_keys": sorted(weights),
        "max_diff": max_diff(weights, ref["weights"]),
        "losses": losses if is_last else None,
        "ref_losses": ref["losses"],
        "val_loss": None if val is None else val.item(),
        "ref_val_loss": ref["val_loss"],
        "eval_changed_weights": max_diff(weights, before) != 0.0,
        "loss_after_eval": None if after_eval is None else after_eval.item(),
    }


def check_meta_fsdp() -> dict[str, Any]:
    mesh = ParallelDims(dp_shard=4, world_size=4).build_mesh("cpu")
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(6)), nn.Linear(64, 4))
    apply_fsdp(model, fsdp_mesh(mesh))
    materialize(model, "cpu", group=mesh["dp_shard"].get_group())
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    x = torch.randn(8, 64)
    model(x).sum().backward()  # a materialized sharded model trains
    # A NaN in rank 1's shard only: with the group, every rank raises, naming the parameter.
    if dist.get_rank() == 1:
        with torch.no_grad():
            model[2].weight.to_local()[0, 0] = float("nan")
    try:
        check_finite_weights(model, group=mesh["dp_shard"].get_group())
        nan_error = None
    except MisconfigurationError as exc:
        nan_error = str(exc)
    return {"full_bytes": full, "local_bytes": local, "fraction": local / full, "nan_error": nan_error}


CHECKS: dict[str, Callable[[], dict[str, Any]]] = {
    "tp_fsdp": check_tp_fsdp,
    "hsdp": check_hsdp,
    "tp_ddp": check_tp_ddp,
    "pp_1f1b": lambda: check_pipeline("1f1b", 1),
    "pp_interleaved": lambda: check_pipeline("interleaved_1f1b", 2),
    "meta_fsdp": check_meta_fsdp,
}


def run(out_dir: Path, only: list[str] | None = None) -> None:
    """The checks in order, in a process group of 4 that is already there; `DIR/rank<R>.json` after each."""
    torch.set_num_threads(1)
    out = Path(out_dir) / f"rank{dist.get_rank()}.json"
    results: dict[str, Any] = {}
    for name, check in CHECKS.items():
        if only and name not in only:
            continue
        start = time.perf_counter()
        try:
            results[name] = check()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            raise
        finally:
            results[name]["seconds"] = round(time.perf_counter() - start, 3)
            out.write_text(json.dumps(results, indent=1))
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--only", nargs="*", help="run these checks only")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        run(Path(args.out_dir), args.only)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
