"""How long a checkpoint save blocks the training loop, with `mirror` (an S3 store) against a local disk alone.

One process trains an MLP (`--width`: 1024 -> 3 layers of 1024, AdamW: a checkpoint of ~25 MB at the default)
on the CPU, each step sleeping `--compute-ms` as a stand-in for an accelerator's compute (the CPU free meanwhile,
as it is while a GPU computes), and saves a checkpoint every `--every` steps (`ModelCheckpoint(every_n_train_steps,
save_top_k=2)`). The figure is the time `save_checkpoint` blocks the step that calls it (the trainer's own method,
timed around `super().save_checkpoint`), median over the run's saves; the upload that follows runs in the
mirror's background thread while the next steps train, as it does for users. Cases, interleaved round after
round in fresh processes:

- `local`: `mirror=None`, checkpoints on the local disk;
- `file`: `mirror="file://<dir>"`, a directory on the same disk: the mirror's own code without a server, but its
  copy written to the disk the next save fsyncs on (ext4 commits other files' dirty data with an fsync);
- `s3`: `mirror="s3://bench/runs"`, moto's S3 server on 127.0.0.1 (started here, `python -m moto.server`, at
  nice 19 and idle I/O priority, objects kept in memory: a real store is another machine, its CPU and disk not
  the trainer's).

The report gives each case's median blocked time over the rounds and the median of the per-round ratios
s3 / local; it also says how many of the s3 run's checkpoints were committed in the store when it ended.

moto on this machine takes ~2.7 s of both cores to store 100 MB (37 MB/s): saves closer together than an upload
(`--width 2048 --every 10`) measure two uploads and a save sharing 2 cores, not the save's wait.

    python benchmarks/mirror_save.py                 # 5 rounds, 8 saves each, 30 steps (3 s) apart
    python benchmarks/mirror_save.py --quick         # 1 round
    python benchmarks/mirror_save.py --tmpdir /dev/shm --every 20 --saves 12   # without the disk's fsync

On this machine's virtual disk one save's fsync alone varies from 34 to 178 ms within a run (the same process,
the same 25 MB): `--tmpdir /dev/shm` (a tmpfs, where fsync costs nothing) leaves what the mirror could add.
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

REPO = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from dream_trainer import DreamTrainer, DreamTrainerConfig
    from dream_trainer.callbacks import ModelCheckpoint

    torch.set_num_threads(1)
    blocked: list[float] = []

    class Bench(DreamTrainer):
        def configure_models(self) -> None:
            torch.manual_seed(0)
            w = args.width
            self.model = nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 1))

        def configure_optimizers(self) -> None:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

        def configure_dataloaders(self) -> Any:
            data = TensorDataset(torch.randn(64, args.width), torch.randn(64, 1))
            return DataLoader(data, batch_size=8), None

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            time.sleep(args.compute_ms / 1e3)  # the model's compute on an accelerator: the CPU is free meanwhile
            x, y = batch
            return F.mse_loss(self.model(x), y)

        def save_checkpoint(self, path: Any) -> Any:
            start = time.perf_counter()
            out = super().save_checkpoint(path)
            blocked.append(time.perf_counter() - start)
            return out

    mirror = {"local": None, "s3": "s3://bench/runs", "file": f"file://{args.root}-store"}[args.case]
    config = DreamTrainerConfig(
        device="cpu", max_steps=args.every * args.saves, root_dir=args.root, mirror=mirror, loggers=[],
        enable_progress_bar=False, print_epoch_summary=False, num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(every_n_train_steps=args.every, save_top_k=2)],
    )  # fmt: skip
    Bench(config).fit()
    Path(args.out).write_text(json.dumps({"blocked": blocked}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--saves", type=int, default=8)
    parser.add_argument("--every", type=int, default=30)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--compute-ms", type=float, default=100.0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tmpdir", help="where the runs write (default: the system's temporary directory); /dev/shm "
                        "takes the disk's fsync out of the figure")  # fmt: skip
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        child(args)
        return
    if args.quick:
        args.rounds = 1
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    idle_io = ["ionice", "-c", "3"] if shutil.which("ionice") else []  # nor its disk (moto spools objects to disk)
    # moto spools objects over 5 MB to files on this disk; a store is another machine's disk: in memory here, so the
    # server's writes are not entangled with the trainer's fsync (ext4 commits every file's dirty data with it).
    server_env = {**os.environ, "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(1 << 30)}
    moto = subprocess.Popen(
        [*idle_io, sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=server_env,
        preexec_fn=lambda: os.nice(19),  # the store is another machine: its server takes no CPU the trainer wants
    )  # fmt: skip
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint, "OMP_NUM_THREADS": "1"}  # fmt: skip
    try:
        import boto3

        deadline = time.monotonic() + 30
        while True:
            try:
                s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="b", aws_secret_access_key="b",
                                  region_name="us-east-1")  # fmt: skip
                s3.create_bucket(Bucket="bench")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        results: dict[str, list[float]] = {"local": [], "s3": [], "file": []}
        ratios, file_ratios, committed = [], [], 0
        with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
            for r in range(args.rounds):
                medians = {}
                for case in ("local", "s3", "file"):
                    out = Path(tmp) / f"{case}-{r}.json"
                    root = Path(tmp) / f"{case}-{r}"
                    cmd = [sys.executable, __file__, "--case", case, "--root", str(root), "--out", str(out),
                           "--saves", str(args.saves), "--every", str(args.every), "--width", str(args.width),
                           "--compute-ms", str(args.compute_ms)]  # fmt: skip
                    subprocess.run(cmd, env=env, check=True, cwd=REPO)
                    blocked = json.loads(out.read_text())["blocked"]
                    medians[case] = statistics.median(blocked)
                    results[case].append(medians[case])
                ratios.append(medians["s3"] / medians["local"])
                file_ratios.append(medians["file"] / medians["local"])
                listed = s3.list_objects_v2(Bucket="bench", Prefix=f"runs/version_{r}/checkpoints/")
                committed = sum(o["Key"].endswith(".commit") for o in listed.get("Contents", []))
                print(f"round {r}: local {medians['local'] * 1e3:.1f} ms, s3 {medians['s3'] * 1e3:.1f} ms, "
                      f"file {medians['file'] * 1e3:.1f} ms; s3 / local {ratios[-1]:.3f}, file / local "
                      f"{file_ratios[-1]:.3f}; committed in the store at exit: {committed}", flush=True)  # fmt: skip
    finally:
        os.killpg(moto.pid, 9)
        moto.wait()
    print(f"save blocks the step: local {statistics.median(results['local']) * 1e3:.1f} ms, "
          f"s3 mirror {statistics.median(results['s3']) * 1e3:.1f} ms; "
          f"s3 / local (median of {len(ratios)} rounds): {statistics.median(ratios):.3f}x; "
          f"file mirror {statistics.median(results['file']) * 1e3:.1f} ms, file / local "
          f"{statistics.median(file_ratios):.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()
