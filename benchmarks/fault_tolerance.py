"""The per-step cost of fault tolerance: 2 replica groups on torchft against a plain 2-rank DDP loop, at a 50 ms step.

Every case trains the same MLP (64-256-256-1, AdamW, batch 32 per process) for `--steps` steps on 2 CPU processes
(gloo, 1 thread each), each step sleeping `--sleep` seconds as a stand-in for the model's compute:

- `plain_ddp`: `torchrun --nproc_per_node 2`, `DDP(model)`, `zero_grad / forward / backward / step`;
- `dream_ddp`: the same through a `DreamTrainer` (`strategy="ddp"`, no loggers, bar or checkpoints);
- `dream_ft`: two replica groups, each `torchrun --nproc_per_node 1` of a `DreamTrainer` with `fault_tolerance`,
  and torchft's lighthouse (`torchft_lighthouse`) on 127.0.0.1: a quorum, the cross-group gradient average and
  the commit vote every step.

Each process stamps the end of every step; a case's figure is the median step time of group/rank 0 after
`--warmup` steps (startup, the first quorum and the heal-free join left out). Cases run in fresh processes,
interleaved round after round; the report gives each case's median over the rounds and the median of the
per-round ratios to `plain_ddp`.

    python benchmarks/fault_tolerance.py                 # 5 rounds, 200 steps, 50 ms
    python benchmarks/fault_tolerance.py --quick         # 1 round, 40 steps
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CASES = ("plain_ddp", "dream_ddp", "dream_ft")
REPO = Path(__file__).resolve().parents[1]


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))


def _data() -> Any:
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def _worker(case: str, steps: int, sleep: float, out: Path) -> None:
    """One process of a case (started by `run_case` through torchrun): trains, writes its step end times."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    stamps: list[float] = []
    rank = int(os.environ.get("RANK", "0"))
    if case == "plain_ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data import DistributedSampler

        dist.init_process_group("gloo")
        model = DDP(_model())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = _data()
        loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, seed=0))
        done = 0
        while done < steps:
            for x, y in loader:
                opt.zero_grad(set_to_none=True)
                time.sleep(sleep)
                F.mse_loss(model(x), y).backward()
                opt.step()
                stamps.append(time.perf_counter())
                done += 1
                if done == steps:
                    break
        dist.destroy_process_group()
    else:
        from dream_trainer import Callback, DreamTrainer, DreamTrainerConfig, FaultToleranceConfig

        class Stamp(Callback):
            def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
                stamps.append(time.perf_counter())

        class Bench(DreamTrainer):
            def configure_models(self) -> None:
                self.model = _model()

            def configure_optimizers(self) -> None:
                self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

            def configure_dataloaders(self) -> Any:
                return DataLoader(_data(), batch_size=32, shuffle=True), None

            def training_step(self, batch: Any, batch_idx: int) -> Any:
                x, y = batch
                time.sleep(sleep)
                return F.mse_loss(self.model(x), y)

        ft = None
        if case == "dream_ft":
            ft = FaultToleranceConfig(min_replicas=2, hostname="127.0.0.1")  # lighthouse, id: the environment
            rank = int(os.environ["REPLICA_GROUP_ID"])
        config = DreamTrainerConfig(
            device="cpu", max_steps=steps, root_dir=str(out / f"runs{rank}"), loggers=[], enable_progress_bar=False,
            enable_checkpointing=False, print_epoch_summary=False, num_sanity_val_steps=0, log_every_n_steps=50,
            callbacks=[Stamp()], fault_tolerance=ft,
        )  # fmt: skip
        Bench(config).fit()
    if rank == 0:
        (out / f"{case}.json").write_text(json.dumps(stamps))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_case(case: str, steps: int, sleep: float, warmup: int) -> float:
    """One fresh run of `case`: group/rank 0's median step time after `warmup` steps, in seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    me = [str(Path(__file__).resolve()), "--worker", case, "--steps", str(steps), "--sleep", str(sleep)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        procs: list[subprocess.Popen[bytes]] = []
        server = None
        try:
            if case == "dream_ft":
                port = _free_port()
                lighthouse = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
                server = subprocess.Popen(
                    [lighthouse or "torchft_lighthouse", "--bind", f"127.0.0.1:{port}", "--min_replicas", "2",
                     "--join_timeout_ms", "1000"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                env = {**env, "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}
                for group in ("0", "1"):
                    cmd = [*run, "--nproc_per_node", "1", *me, "--out", tmp]
                    procs.append(subprocess.Popen(cmd, env={**env, "REPLICA_GROUP_ID": group}))
            else:
                procs.append(subprocess.Popen([*run, "--nproc_per_node", "2", *me, "--out", tmp], env=env))
            for proc in procs:
                if proc.wait(timeout=600) != 0:
                    raise RuntimeError(f"{case}: a process exited with {proc.returncode}")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            if server is not None:
                server.kill()
                server.wait()
        stamps = json.loads((out / f"{case}.json").read_text())
    gaps = [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1 :], strict=False)]
    return statistics.median(gaps)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--quick", action="store_true", help="1 round, 40 steps")
    parser.add_argument("--worker", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.steps, args.sleep, args.out)
        return {}
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 40, 10
    times: dict[str, list[float]] = {c: [] for c in CASES}
    for r in range(args.rounds):
        for case in CASES if r % 2 == 0 else reversed(CASES):
            times[case].append(run_case(case, args.steps, args.sleep, args.warmup))
    result: dict[str, Any] = {}
    print(f"| case | median step ms ({args.rounds} rounds) | vs plain_ddp: median of per-round ratios (range) |")
    print("|---|---:|---|")
    for case in CASES:
        ratios = [t / p for t, p in zip(times[case], times["plain_ddp"], strict=True)]
        result[f"{case}_ms"] = statistics.median(times[case]) * 1000
        result[f"{case}_ratio"] = statistics.median(ratios)
        span = f"({min(ratios):.3f}-{max(ratios):.3f})"
        print(f"| {case} | {result[f'{case}_ms']:.2f} | {result[f'{case}_ratio']:.3f}x {span} |")
    return result


if __name__ == "__main__":
    main()
