"""2-rank DDP on gloo (CPU): a plain PyTorch DDP loop against the same training through DreamTrainer.

Both cases train the same MLP (64-128-128-1, SGD) on the same data, sharded by a shuffling
`DistributedSampler`, for N steps per rank. Plain: `init_process_group("gloo")`, `DDP(model)`,
`zero_grad / forward / backward / step`. Dream: a `DreamTrainer` with `strategy="ddp"` and nothing the
plain loop does not do (no loggers, progress bar, checkpoints or summary line; the training loss is
still aggregated and reduced across ranks every `log_every_n_steps`, and SIGTERM agreement runs at
those points, as in every dream_trainer run).

Each measurement is one `torchrun --standalone --nproc_per_node 2` launch (fresh processes, so no
case inherits the other's warm caches); cases are interleaved (plain, dream, plain, dream, ...) so
drift on the machine hits both alike. Rank 0 reports two times, both taken after the imports (torch,
torch._dynamo, torch.distributed, and dream_trainer for the dream case):

- `loop`: the N training steps (first batch fetched -> last optimizer step done), wall time;
- `loop CPU`: the CPU time rank 0's process (all its threads) spent in those steps: on a machine busy
  with other work the wall time mostly measures the load, this mostly measures the work;
- `total`: process group init + model/optimizer/data setup + the loop (+ dream_trainer's teardown).

The report gives the median and the minimum of each over the rounds, and dream/plain as the median of
the per-round ratios and as the ratio of the minima (the rounds least disturbed by other load).

    python benchmarks/ddp.py                      # 7 rounds, 2000 steps per rank
    python benchmarks/ddp.py --quick              # smoke run: 1 round, 50 steps
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

CASES = ("plain", "dream")
KINDS = ("loop", "cpu", "total")
HIDDEN = 128
FEATURES = 64


def print_case_table(result: dict[str, float]) -> None:
    """The markdown table of each case's loop / loop CPU / total times and the dream/plain ratios
    (shared with benchmarks/model_parallel.py)."""
    print("| case | loop median s | loop min s | loop CPU median s | loop CPU min s | total median s | total min s |")
    print("|---|---|---|---|---|---|---|")
    for c in CASES:
        cells = [f"{result[f'{c}_{k}_{stat}_s']:.3f}" for k in KINDS for stat in ("median", "min")]
        print(f"| {c} | " + " | ".join(cells) + " |")
    ratio_cells = [f"{result[f'{k}_{r}']:.3f}x" for k in KINDS for r in ("ratio", "min_ratio")]
    print("| dream/plain | " + " | ".join(ratio_cells) + " |")


def _dataset(steps: int, batch: int, world_size: int):
    import torch
    from torch.utils.data import TensorDataset

    n = steps * batch * world_size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, FEATURES, generator=g)
    y = x[:, :1] * 0.5 + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def _model():
    from torch import nn

    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1)
    )


def run_plain(steps: int, batch: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    start = time.perf_counter()
    dist.init_process_group("gloo")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(_model())
    dataset = _dataset(steps, batch, world_size)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler.set_epoch(0)
    loop_start, cpu_start = time.perf_counter(), time.process_time()
    n = 0
    for x, y in loader:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        n += 1
    loop, cpu = time.perf_counter() - loop_start, time.process_time() - cpu_start
    assert n == steps, n
    # The process group is left to process exit, as dream_trainer leaves it (see _worker).
    return {"loop": loop, "cpu": cpu, "total": time.perf_counter() - start}


def run_dream(steps: int, batch: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from dream_trainer import DreamTrainer, DreamTrainerConfig

    class Bench(DreamTrainer):
        def configure_models(self) -> None:
            torch.manual_seed(0)
            self.model = _model()

        def configure_optimizers(self) -> None:
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)

        def configure_dataloaders(self):
            # A plain shuffling loader: the trainer swaps in the DistributedSampler (seed from config).
            return DataLoader(_dataset(steps, batch, self.world_size), batch_size=batch, shuffle=True), None

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.model(x), y)

        def on_train_epoch_start(self) -> None:
            self.loop_start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_train_epoch_end(self) -> None:
            self.loop_time, self.cpu = time.perf_counter() - self.loop_start, time.process_time() - self.cpu_start

    start = time.perf_counter()
    config = DreamTrainerConfig(
        n_epochs=1, seed=0, device="cpu", strategy="ddp", loggers=[], enable_progress_bar=False,
        enable_checkpointing=False, print_epoch_summary=False, root_dir=tempfile.mkdtemp(prefix="dream-ddp-"),
    )  # fmt: skip
    trainer = Bench(config)
    trainer.fit()
    total = time.perf_counter() - start
    assert trainer.global_step == steps, trainer.global_step
    return {"loop": trainer.loop_time, "cpu": trainer.cpu, "total": total}


def _worker(case: str, steps: int, batch: int, out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Imports stay out of the timings, on both sides: the first optimizer a process builds imports
    # torch._dynamo (~2 s), which would otherwise land in whichever timed section builds it.
    import torch._dynamo
    import torch.distributed
    import torch.nn.parallel  # noqa: F401

    result = run_plain(steps, batch) if case == "plain" else run_dream(steps, batch)
    if os.environ.get("RANK", "0") == "0":
        Path(out).write_text(json.dumps({"case": case, **result}))
    # Leave without tearing gloo down: destroying a ProcessGroupGloo that a DDP Reducer still holds can
    # deadlock on the GIL (its worker thread frees a Python object while the main thread joins it), and
    # the timings are taken. Both cases exit the same way.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _launch_cmd(case: str, steps: int, batch: int, out: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(Path(__file__).resolve()), "--worker", case, "--steps", str(steps), "--batch", str(batch), "--out", out,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH", "")) if p)
    return env


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=2000, help="training steps per rank")
    p.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round of 50 steps")
    p.add_argument("--worker", choices=CASES, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.steps, args.batch, args.out)
        return {}
    if args.quick:
        args.rounds, args.steps = 1, 50
    times: dict[str, dict[str, list[float]]] = {c: {k: [] for k in KINDS} for c in CASES}
    ratios: dict[str, list[float]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory(prefix="dream-ddp-bench-") as tmp:
        for r in range(args.rounds):
            for case in CASES:
                out = os.path.join(tmp, f"{case}-{r}.json")
                proc = subprocess.run(
                    _launch_cmd(case, args.steps, args.batch, out), capture_output=True, text=True, env=_env()
                )
                if proc.returncode != 0:
                    sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-5000:])
                    raise SystemExit(f"the {case} run failed with exit code {proc.returncode}")
                got = json.loads(Path(out).read_text())
                for kind in KINDS:
                    times[case][kind].append(got[kind])
            for kind in KINDS:
                ratios[kind].append(times["dream"][kind][-1] / times["plain"][kind][-1])
    result: dict[str, float] = {}
    for kind in KINDS:
        for c in CASES:
            result[f"{c}_{kind}_median_s"] = statistics.median(times[c][kind])
            result[f"{c}_{kind}_min_s"] = min(times[c][kind])
        result[f"{kind}_ratio"] = statistics.median(ratios[kind])
        result[f"{kind}_min_ratio"] = result[f"dream_{kind}_min_s"] / result[f"plain_{kind}_min_s"]
    command = "python benchmarks/ddp.py" + (" --quick" if args.quick else "")
    if not args.quick and (args.rounds, args.steps, args.batch) != (7, 2000, 32):
        command += f" --rounds {args.rounds} --steps {args.steps} --batch {args.batch}"
    print(
        f"2-rank DDP (gloo, CPU), MLP {FEATURES}-{HIDDEN}-{HIDDEN}-1, {args.steps} steps x batch {args.batch} "
        f"per rank, {args.rounds} interleaved round(s), each case a fresh `torchrun --standalone "
        f"--nproc_per_node 2` launch; command: `{command}`"
    )
    print()
    print_case_table(result)
    print()
    print(
        "dream/plain: median of the per-round ratios (median columns) and ratio of the best rounds (min "
        "columns); target <= 1.05x"
    )
    print(
        "per round, loop s / total s: "
        + "; ".join(
            f"plain {times['plain']['loop'][r]:.3f}/{times['plain']['total'][r]:.3f} "
            f"dream {times['dream']['loop'][r]:.3f}/{times['dream']['total'][r]:.3f}"
            for r in range(args.rounds)
        )
    )
    return result


if __name__ == "__main__":
    main()
