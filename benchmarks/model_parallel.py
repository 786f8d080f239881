"""4 CPU processes (gloo) on a 2-D mesh, dp_shard=2 x tensor_parallel=2: a hand-written FSDP2 + TP loop
against the same training through DreamTrainer.

Both cases train the same residual MLP (an input Linear, BLOCKS blocks of LayerNorm -> Linear(W, 2W)
-> GELU -> Linear(2W, W) + skip, an output Linear; W = WIDTH) with AdamW and gradient clipping at norm 1,
cross-entropy on the same data (global batch 64, 32 per dp rank), for N steps:

- plain: `init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))`; `parallelize_module` on
  the "tp" sub-mesh (each block's fc1 `ColwiseParallel`, fc2 `RowwiseParallel`); FSDP2 `fully_shard`
  on each child of the `nn.Sequential` then the root, over the "dp_shard" sub-mesh; a DataLoader with a
  shuffling `DistributedSampler` over the 2 dp ranks (the 2 ranks of a TP group read the same batch);
  `zero_grad / forward / loss / backward / clip / step`. The parameters live on two meshes: the TP
  weights and biases on the 2-D (dp_shard, tp) mesh, the LayerNorms and the input and output Linears on
  the 1-D dp_shard mesh. So the clipping norm is taken per mesh and combined
  (`dream_trainer.parallel.tensor_parallel.total_norm_of_grads`; `clip_grad_norm_` cannot stack norms of
  two meshes), and the gradients are scaled one mesh at a time (one foreach op cannot mix them).
- dream: a `DreamTrainer` with `dp_shard=2, tensor_parallel=2, gradient_clip_val=1.0` and the same plan
  in `apply_tensor_parallel(tp_mesh)`; no loggers, progress bar, checkpoints, summary line or sanity
  check. What it still does that the plain loop does not: the training loss is aggregated every step
  and reduced across ranks every `log_every_n_steps` (set to 10 here, 4 times per run, more often than
  the default 50), with the SIGTERM agreement at those points, and the epoch's metrics at its end.

Both must end at the same place: rank 0 reports the last step's loss (averaged over the ranks) and the
sum of squares of the full (unsharded) weights at the end, and the script fails unless every run agrees
(relative tolerance 1e-5; the same ops run in the same order, so they agree to the last bit).

A step is not "a few ms" here: on 2 cores, 4 processes wait on about 30 gloo collectives per step (FSDP
all-gathers and reduce-scatters per block, the TP all-reduces, the norm): 50-65 ms of CPU in rank 0 and
120-200 ms of wall time per step, of which dream's own work (a function call per step, 3 small
collectives every 10 steps) is a small part.

Two ways to run the rounds (`--launch`):

- `shared` (the default): one `torchrun --standalone --nproc_per_node 4` launch runs every round, the
  cases alternating inside the same 4 processes (plain, dream, then dream, plain, ...: the order flips
  each round so neither case always runs first), after one unreported warm-up run of each case (the
  first run in a process pays for lazy initialisation: DTensor's sharding-propagation caches, FSDP's
  lazy init, the allocator). Each run builds its own mesh (new process groups), model, optimizer and
  loader; the default process group is made once, before the rounds.
- `fresh`: as `benchmarks/ddp.py`, one launch per case per round (fresh processes, so no case inherits
  the other's warm caches), interleaved plain, dream, plain, dream, ...

`shared` is the default because it was less noisy: both cases of a round run seconds apart in the same
4 processes, placed the same way on the 2 cores, and the 6-10 s launch is paid once (a `fresh` run takes
about 3.5x as long). Measured on the shared 2-core machine under a load average of 8-17 from other
work: the standard deviation of the per-round loop ratios was 0.08-0.25 over five `shared` runs
(medians 1.007x-1.164x) and 0.15 and 0.39 over two `fresh` runs (medians 0.850x and 1.150x).

Rank 0 reports (all taken after the imports):

- `loop`: the N training steps (first batch fetched -> last optimizer step done), wall time;
- `loop CPU`: the CPU time rank 0's process (all its threads, gloo's included) spent in those steps;
- `total`: mesh (and, with `--launch fresh`, process group) init + model/optimizer/data setup + the
  loop (+ dream_trainer's teardown, which includes an end-of-fit barrier the plain loop does not do).

The report gives the median and the minimum of each over the rounds, dream/plain as the median of the
per-round ratios and as the ratio of the minima (the rounds least disturbed by other load), and the
range of the per-round ratios (how noisy the run was).

    python benchmarks/model_parallel.py                   # 9 rounds of 40 steps in one launch (~2 min)
    python benchmarks/model_parallel.py --launch fresh    # one launch per case and round (~8 min)
    python benchmarks/model_parallel.py --quick           # smoke run: 1 round of 10 steps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp import CASES, KINDS, print_case_table

FEATURES, WIDTH, BLOCKS, CLASSES = 64, 256, 4, 16
LR = 1e-3
CLIP = 1.0
TOLERANCE = 1e-5
WARMUP_STEPS = 10
LOG_EVERY = 10  # dream reduces the loss across ranks every 10 steps: 4 times in a default run


# --- the model, the plan, the data (identical for both cases) ----------------------------------------------
def _model():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.fc1 = nn.Linear(width, 2 * width)
            self.fc2 = nn.Linear(2 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc2(F.gelu(self.fc1(self.norm(x))))

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, WIDTH), *(Block(WIDTH) for _ in range(BLOCKS)), nn.Linear(WIDTH, CLASSES))


def _plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(1, BLOCKS + 1):  # children 1..BLOCKS of the Sequential are the blocks
        plan[f"{i}.fc1"] = ColwiseParallel()
        plan[f"{i}.fc2"] = RowwiseParallel()
    return plan


def _dataset(steps: int, global_batch: int):
    import torch
    from torch.utils.data import TensorDataset

    n = steps * global_batch
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, FEATURES, generator=g)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(n, CLASSES, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def _fingerprint(model: Any, last_loss: Any) -> dict[str, float]:
    """The last step's loss averaged over the ranks, and the sum of squares of the full weights
    (collective: every rank calls it, after the timings)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    loss = last_loss.detach().clone().double()
    dist.all_reduce(loss)
    sq = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        sq += full.detach().double().pow(2).sum()
    return {"loss": float(loss) / dist.get_world_size(), "weights_sq": float(sq)}


def _full_collections() -> int:
    """How many full (generation 2) garbage collections this process has run so far."""
    import gc

    return gc.get_stats()[2]["collections"]


# --- the two cases -------------------------------------------------------------------------------------
def run_plain(steps: int, global_batch: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.utils.data import DataLoader, DistributedSampler

    from dream_trainer.parallel.tensor_parallel import total_norm_of_grads

    start = time.perf_counter()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    dp_mesh, tp_mesh = mesh["dp_shard"], mesh["tp"]
    model = _model()
    parallelize_module(model, tp_mesh, _plan())
    for block in model:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    params = list(model.parameters())
    # Clipping scales the gradients of each mesh separately: one foreach op cannot mix DTensors of two meshes.
    by_mesh: dict[Any, list[Any]] = {}
    for p in params:
        by_mesh.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    opt = torch.optim.AdamW(params, lr=LR)
    dataset = _dataset(steps, global_batch)
    dp_size, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=global_batch // dp_size, sampler=sampler)
    sampler.set_epoch(0)
    gc_start = _full_collections()
    loop_start, cpu_start = time.perf_counter(), time.process_time()
    n, last = 0, None
    for x, y in loader:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        norm = total_norm_of_grads([p.grad for p in params if p.grad is not None])
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, CLIP, norm)
        opt.step()
        last = loss.detach()
        n += 1
    loop, cpu = time.perf_counter() - loop_start, time.process_time() - cpu_start
    gc_full = _full_collections() - gc_start
    total = time.perf_counter() - start
    assert n == steps, n
    return {"loop": loop, "cpu": cpu, "total": total, "gc_full": gc_full, **_fingerprint(model, last)}


def run_dream(steps: int, global_batch: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.utils.data import DataLoader

    from dream_trainer import DreamTrainer, DreamTrainerConfig

    class Bench(DreamTrainer):
        last_loss: Any = None

        def configure_models(self) -> None:
            self.model = _model()

        def apply_tensor_parallel(self, tp_mesh: Any) -> None:
            parallelize_module(self.model, tp_mesh, _plan())

        def configure_optimizers(self) -> None:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)

        def configure_dataloaders(self):
            # A plain shuffling loader: the trainer swaps in the DistributedSampler over the dp ranks.
            batch = global_batch // self.dp_world_size
            return DataLoader(_dataset(steps, global_batch), batch_size=batch, shuffle=True), None

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.model(x), y)
            self.last_loss = loss.detach()
            return loss

        def on_train_epoch_start(self) -> None:
            self.gc_start = _full_collections()
            self.loop_start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_train_epoch_end(self) -> None:
            self.loop_time, self.cpu = time.perf_counter() - self.loop_start, time.process_time() - self.cpu_start
            self.gc_full = _full_collections() - self.gc_start

    start = time.perf_counter()
    config = DreamTrainerConfig(
        n_epochs=1, seed=0, device="cpu", dp_shard=2, tensor_parallel=2, gradient_clip_val=CLIP,
        loggers=[], enable_progress_bar=False, enable_checkpointing=False, print_epoch_summary=False,
        num_sanity_val_steps=0, log_every_n_steps=LOG_EVERY, root_dir=tempfile.mkdtemp(prefix="dream-mp-"),
    )  # fmt: skip
    trainer = Bench(config)
    trainer.fit()
    total = time.perf_counter() - start
    assert trainer.global_step == steps, trainer.global_step
    assert trainer.strategy == "model_parallel", trainer.strategy
    return {
        "loop": trainer.loop_time,
        "cpu": trainer.cpu,
        "total": total,
        "gc_full": trainer.gc_full,
        **_fingerprint(trainer.model, trainer.last_loss),
    }


# --- inside torchrun ------------------------------------------------------------------------------------
def _run(case: str, steps: int, global_batch: int) -> dict[str, float]:
    return (run_plain if case == "plain" else run_dream)(steps, global_batch)


def _worker(cases: list[str], steps: int, global_batch: int, warmup: bool, out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Imports stay out of the timings, on both sides: the first optimizer a process builds imports
    # torch._dynamo (~2 s), which would otherwise land in whichever timed section builds it.
    import torch._dynamo
    import torch.distributed as dist
    import torch.distributed.fsdp
    import torch.distributed.tensor.parallel  # noqa: F401

    import dream_trainer  # noqa: F401  (plain imports total_norm_of_grads from it, too)

    if len(cases) > 1 or warmup:
        # Several runs in one process: make the default group once, outside every timing (dream would
        # otherwise make it in its first run, and init_device_mesh in plain's).
        dist.init_process_group("gloo")
    if warmup:
        for case in CASES:
            _run(case, min(steps, WARMUP_STEPS), global_batch)
    results = []
    for case in cases:
        results.append({"case": case, **_run(case, steps, global_batch)})
        if dist.get_rank() == 0:  # written after every run: a failure later keeps what was measured
            Path(out).write_text(json.dumps(results))
    # Leave without tearing gloo down (as benchmarks/ddp.py): the timings are taken, and both cases
    # exit the same way.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- the parent process ----------------------------------------------------------------------------------
def _launch_cmd(cases: list[str], steps: int, global_batch: int, warmup: bool, out: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
        str(Path(__file__).resolve()), "--worker", ",".join(cases), "--steps", str(steps),
        "--batch", str(global_batch), "--out", out, *(["--warmup"] if warmup else []),
    ]  # fmt: skip


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    env["OMP_NUM_THREADS"] = "1"
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH", "")) if p)
    return env


def _launch(cases: list[str], steps: int, global_batch: int, warmup: bool, out: str) -> list[dict[str, Any]]:
    proc = subprocess.run(
        _launch_cmd(cases, steps, global_batch, warmup, out), capture_output=True, text=True, env=_env()
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-20000:])
        raise SystemExit(f"the {','.join(cases)} launch failed with exit code {proc.returncode}")
    got = json.loads(Path(out).read_text())
    assert [g["case"] for g in got] == cases, got
    return got


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=40, help="training steps (every rank)")
    p.add_argument("--batch", type=int, default=64, help="global batch (each dp rank reads half)")
    p.add_argument(
        "--launch", choices=("shared", "fresh"), default="shared",
        help="shared: every round in one torchrun launch (default); fresh: one launch per case and round",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round of 10 steps")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--warmup", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker.split(","), args.steps, args.batch, args.warmup, args.out)
        return {}
    if args.quick:
        args.rounds, args.steps = 1, 10
    if args.batch % 2:
        p.error(f"--batch {args.batch} must be even (2 dp ranks)")
    runs: list[dict[str, Any]] = []  # in execution order
    wall = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dream-mp-bench-") as tmp:
        if args.launch == "shared":
            order = [c for r in range(args.rounds) for c in (CASES if r % 2 == 0 else CASES[::-1])]
            runs = _launch(order, args.steps, args.batch, True, os.path.join(tmp, "shared.json"))
        else:
            for r in range(args.rounds):
                for case in CASES:
                    runs += _launch([case], args.steps, args.batch, False, os.path.join(tmp, f"{case}-{r}.json"))
    wall = time.perf_counter() - wall
    rounds = [{run["case"]: run for run in runs[2 * r : 2 * r + 2]} for r in range(args.rounds)]
    times = {c: {k: [rd[c][k] for rd in rounds] for k in KINDS} for c in CASES}
    ratios = {k: [rd["dream"][k] / rd["plain"][k] for rd in rounds] for k in KINDS}
    result: dict[str, float] = {}
    for kind in KINDS:
        for c in CASES:
            result[f"{c}_{kind}_median_s"] = statistics.median(times[c][kind])
            result[f"{c}_{kind}_min_s"] = min(times[c][kind])
        result[f"{kind}_ratio"] = statistics.median(ratios[kind])
        result[f"{kind}_min_ratio"] = result[f"dream_{kind}_min_s"] / result[f"plain_{kind}_min_s"]
        result[f"{kind}_ratio_low"], result[f"{kind}_ratio_high"] = min(ratios[kind]), max(ratios[kind])

    command = "python benchmarks/model_parallel.py" + (" --quick" if args.quick else "")
    if args.launch != "shared":
        command += f" --launch {args.launch}"
    if not args.quick and (args.rounds, args.steps, args.batch) != (9, 40, 64):
        command += f" --rounds {args.rounds} --steps {args.steps} --batch {args.batch}"
    how = (
        "all rounds in one `torchrun --standalone --nproc_per_node 4` launch, the order flipping each round, "
        "after a warm-up run of each case"
        if args.launch == "shared"
        else "each case a fresh `torchrun --standalone --nproc_per_node 4` launch"
    )
    print(
        f"4 processes (gloo, CPU), mesh dp_shard=2 x tensor_parallel=2, MLP {FEATURES}-[{BLOCKS} x residual "
        f"{WIDTH}-{2 * WIDTH}-{WIDTH}]-{CLASSES}, AdamW, clip 1.0, {args.steps} steps x global batch "
        f"{args.batch}, {args.rounds} interleaved round(s), {how}; command: `{command}` ({wall:.0f} s)"
    )
    print()
    print_case_table(result)
    print()
    print(
        "dream/plain: median of the per-round ratios (median columns) and ratio of the best rounds (min "
        "columns); target <= 1.05x. Range of the per-round ratios: "
        + ", ".join(f"{k} {result[f'{k}_ratio_low']:.3f}-{result[f'{k}_ratio_high']:.3f}" for k in KINDS)
        + ". Per step (loop median / steps): plain "
        f"{1e3 * result['plain_loop_median_s'] / args.steps:.2f} ms, dream "
        f"{1e3 * result['dream_loop_median_s'] / args.steps:.2f} ms"
    )
    print(
        "per round, loop s / total s (ratio of loops): "
        + "; ".join(
            f"plain {rd['plain']['loop']:.3f}/{rd['plain']['total']:.3f} "
            f"dream {rd['dream']['loop']:.3f}/{rd['dream']['total']:.3f} "
            f"({rd['dream']['loop'] / rd['plain']['loop']:.3f})"
            for rd in rounds
        )
    )
    print(
        "full (generation-2) garbage collections during rank 0's loop, per round: "
        + ", ".join(f"{c} {[rd[c]['gc_full'] for rd in rounds]}" for c in CASES)
        + " (each walks every object alive; dream moves those alive before fit out of its reach, gc.freeze)"
    )
    # The same model, data and seeds must end at the same place, or the comparison is not of the same work.
    bad = []
    for key in ("loss", "weights_sq"):
        values = [run[key] for run in runs]
        ref = values[0]
        if any(abs(v - ref) > TOLERANCE * max(abs(ref), 1e-12) for v in values):
            bad.append(f"{key}: " + ", ".join(f"{run['case']} {run[key]!r}" for run in runs))
        result[f"final_{key}"] = ref
    print(
        f"final loss (last step, mean over ranks): plain {rounds[0]['plain']['loss']:.6f}, dream "
        f"{rounds[0]['dream']['loss']:.6f}; sum of squared weights: plain {rounds[0]['plain']['weights_sq']:.6f}, "
        f"dream {rounds[0]['dream']['weights_sq']:.6f}; "
        + ("every run agrees" if not bad else "MISMATCH")
        + (f" (max relative difference {_max_rel(runs):.1e})" if not bad else "")
    )
    if bad:
        raise SystemExit("the cases did not end at the same loss / weights:\n" + "\n".join(bad))
    return result


def _max_rel(runs: list[dict[str, Any]]) -> float:
    worst = 0.0
    for key in ("loss", "weights_sq"):
        ref = runs[0][key]
        worst = max(worst, *(abs(run[key] - ref) / max(abs(ref), 1e-12) for run in runs))
    return worst


if __name__ == "__main__":
    main()
