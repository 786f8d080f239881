"""The cost per training step of logging every step to an experiment tracker, in one process.

The tiny MLP of `tiny_mlp.py` (Linear 32-32-1, batch 64, SGD) on one fixed batch, as in
`step_overhead.py`, alternating round by round between

- `plain`: the hand-written loop (`zero_grad / forward / mse_loss / backward / step`);
- `dream`: `trainer.training_step` of a bare `DreamTrainer`, `log_every_n_steps=1`, no logger;
- `mlflow`: the same with `MLFlowLogger` against an MLflow tracking server this script starts on
  127.0.0.1 (a child process; SQLite backend in a temporary directory), or `--mlflow-uri`;
- `wandb`: the same with `WandbLogger(mode="offline")` (W&B's `wandb-core` service is a child process).

Each logger's round ends with `logger.flush()`, so nothing it logged is left to slow down the next
case's round. Two figures per case: `loop`, the training thread's time for the steps (what logging
costs the loop while the worker and the backend keep up on other cores), and `loop+flush`, until every
logged value is sent (what the whole run pays when the worker thread, the backend's process and the
training loop share the machine's cores and the GIL: on a busy 2-core machine, the honest figure).
Reports the median time per step of each case and its ratio to `plain` (the median of the per-round
ratios).

    python benchmarks/logging_overhead.py                      # 15 rounds x 1000 steps
    python benchmarks/logging_overhead.py --rounds 2 --steps 100   # smoke run
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from suite import log, ratio_text  # the benchmarks' progress lines and per-round ratios
from tiny_mlp import _model, _optimizer  # the tiny MLP and SGD of every tiny-MLP case

CASES = ("plain", "dream", "mlflow", "wandb")


@contextmanager
def mlflow_server(root: Path) -> Iterator[str]:
    """An MLflow tracking server on a free port of 127.0.0.1, stopped (its process group) on exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts"),
    ]  # fmt: skip
    with open(root / "server.log", "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2):
                    break
            except OSError as exc:
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = (root / "server.log").read_text()[-2000:]
                    raise RuntimeError(f"mlflow server did not start: {tail}") from exc
                time.sleep(0.25)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=1000, help="steps per round and case")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--mlflow-uri", default=None, help="an MLflow tracking URI to use instead of a local server")
    args = p.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="dream-logging-"))
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(root / "wandb"))
    try:
        if args.mlflow_uri is not None:
            return _run(args, root, args.mlflow_uri)
        with mlflow_server(root) as uri:
            return _run(args, root, uri)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(args: argparse.Namespace, root: Path, mlflow_uri: str) -> dict[str, float]:
    import torch
    import torch._dynamo  # the first optimizer step imports it: not part of any round
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from dream_trainer import DreamTrainer, DreamTrainerConfig, Logger
    from dream_trainer.loggers import MLFlowLogger, WandbLogger

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    batch = (x, y)
    steps = args.steps

    class Bench(DreamTrainer):
        def __init__(self, config: DreamTrainerConfig) -> None:
            super().__init__(config)
            self.model = _model()

        def configure_optimizers(self) -> None:
            self.optimizer = _optimizer(self.model.parameters())

        def configure_dataloaders(self) -> Any:
            return DataLoader(TensorDataset(x, y), batch_size=64), None

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            bx, by = batch
            return F.mse_loss(self.model(bx), by)

    def trainer_round(loggers: list[Logger], name: str) -> Callable[[], float]:
        config = DreamTrainerConfig(
            n_epochs=1, seed=None, device="cpu", root_dir=str(root / name), run_name=name, loggers=loggers,
            log_every_n_steps=1, enable_progress_bar=False, enable_checkpointing=False, print_epoch_summary=False,
        )  # fmt: skip
        trainer = Bench(config)
        trainer._setup_fit()  # what fit() does before its loop (as step_overhead.py)
        trainer._attach_loggers()  # ... and what it does next: the loggers get the run and its config
        trainer._train_epoch_start()
        step = trainer.training_step
        for lg in loggers:
            lg.flush()  # the tracker's run is created before the first round

        def one_round() -> tuple[float, float]:
            start = time.perf_counter()
            for i in range(steps):
                step(batch, i)
            loop = time.perf_counter()
            for lg in loggers:
                lg.flush()  # what this round logged is sent before the next case's round
            end = time.perf_counter()
            return (loop - start) / steps * 1e6, (end - start) / steps * 1e6

        return one_round

    plain_model = _model()
    plain_opt = _optimizer(plain_model.parameters())

    def plain() -> tuple[float, float]:
        start = time.perf_counter()
        for _ in range(steps):
            plain_opt.zero_grad(set_to_none=True)
            F.mse_loss(plain_model(x), y).backward()
            plain_opt.step()
        us = (time.perf_counter() - start) / steps * 1e6
        return us, us

    log("starting the trackers' runs")
    trackers: list[Logger] = [MLFlowLogger(tracking_uri=mlflow_uri, experiment_name="logging_overhead"), WandbLogger()]
    rounds = {
        "plain": plain,
        "dream": trainer_round([], "dream"),
        "mlflow": trainer_round([trackers[0]], "mlflow"),
        "wandb": trainer_round([trackers[1]], "wandb"),
    }
    loop: dict[str, list[float]] = {case: [] for case in rounds}
    total: dict[str, list[float]] = {case: [] for case in rounds}
    for fn in rounds.values():
        fn()  # warm-up round
    for r in range(args.rounds):
        log(f"round {r + 1}/{args.rounds}")
        for case, fn in rounds.items():
            loop_us, total_us = fn()
            loop[case].append(loop_us)
            total[case].append(total_us)
    for lg in trackers:
        lg.finalize("success")

    result: dict[str, float] = {}
    command = "python benchmarks/logging_overhead.py" + (
        f" --rounds {args.rounds} --steps {steps}" if (args.rounds, steps) != (15, 1000) else ""
    )
    print(
        f"tiny MLP step on one fixed batch, logging every step; {args.rounds} alternating rounds x {steps} steps, "
        f"{args.threads} torch thread(s); MLflow at {mlflow_uri}, W&B offline; command: `{command}`\n"
    )
    print(
        "| case | loop us/step | loop vs plain | loop+flush us/step | loop+flush vs plain |\n|---|---:|---:|---:|---:|"
    )
    for case in rounds:
        loop_ratio, loop_text = ratio_text(loop[case], loop["plain"])
        total_ratio, total_text = ratio_text(total[case], total["plain"])
        result.update({
            f"{case}_loop_us": statistics.median(loop[case]), f"{case}_loop_ratio": loop_ratio,
            f"{case}_total_us": statistics.median(total[case]), f"{case}_total_ratio": total_ratio,
        })  # fmt: skip
        loop_us, total_us = result[f"{case}_loop_us"], result[f"{case}_total_us"]
        print(f"| {case} | {loop_us:.1f} | {loop_text} | {total_us:.1f} | {total_text} |")
    return result


if __name__ == "__main__":
    main()
