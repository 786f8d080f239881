"""Kill a training run with SIGKILL in the middle of an epoch, resume it, and get bit-identical weights.

    python examples/resume_after_kill.py                  # ~10 s on 2 CPU cores
    python examples/resume_after_kill.py --kill-at-step 150 --every-n-steps 40

What it does:

1. trains the reference run, uninterrupted, in this process (`<root-dir>/uninterrupted`);
2. starts the same run as a child process (`python examples/resume_after_kill.py --child ...`, in
   `<root-dir>/interrupted`), with `ModelCheckpoint(every_n_train_steps=N)`, and SIGKILLs it once it
   reports step `--kill-at-step`: no signal handler, no cleanup, no flush, as when the OOM killer or a
   lost node ends a job. (The child stalls after reporting that step, so the kill lands at a known
   point; any other point works the same, see tests/test_kill_resume.py);
3. resumes in a fresh trainer with `fit(ckpt_path="last")`: the newest valid checkpoint of the killed
   run (`<root-dir>/interrupted/version_0/checkpoints`), written some steps before the kill, mid-epoch;
4. compares every final weight tensor of the resumed run with the reference's (`torch.equal`).

The run has what makes exact resumption hard: a shuffling DataLoader (its order comes from torch's
global RNG), Dropout, AdamW (its moment estimates are state), a per-step LR schedule with warmup, and a
validation loader with a sanity check. The checkpoint holds all of it: weights, optimizer, scheduler,
counters, every RNG and the position inside the epoch; the resumed run redraws the interrupted epoch's
order and skips the batches already done, so the remaining steps see exactly the same data and dropout
masks. The script exits with 1 if the weights differ. Both run directories are emptied first.
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import Callback, DreamTrainer, DreamTrainerConfig, ModelCheckpoint


@dataclass
class ResumeConfig(DreamTrainerConfig):
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    batch_size: int = 32
    n_train: int = 2048
    n_val: int = 512
    data_seed: int = 0


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A 3-class problem in 10-D: the class is which of three fixed random projections is largest."""
    w = torch.randn(10, 3, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(n, 10, generator=torch.Generator().manual_seed(seed))
    return x, (x @ w).argmax(dim=1)


class ResumableTrainer(DreamTrainer):
    config: ResumeConfig

    def configure_models(self) -> None:
        self.model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 3))

    def configure_optimizers(self) -> None:
        cfg = self.config
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.learning_rate)
        total = cfg.n_epochs * math.ceil(cfg.n_train / cfg.batch_size)

        def warmup_cosine(step: int) -> float:
            if step < cfg.warmup_steps:
                return (step + 1) / cfg.warmup_steps
            return 0.5 * (1 + math.cos(math.pi * (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)))

        # Stepped after every optimizer step: make_trainer sets scheduler_interval="step".
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_cosine)

    def configure_dataloaders(self) -> tuple[DataLoader, DataLoader]:
        cfg = self.config
        train = TensorDataset(*make_data(cfg.n_train, cfg.data_seed))
        val = TensorDataset(*make_data(cfg.n_val, cfg.data_seed + 1))
        return DataLoader(train, batch_size=cfg.batch_size, shuffle=True), DataLoader(val, batch_size=256)

    def on_fit_start(self) -> None:
        # Runs after a checkpoint given to fit() is loaded: where this run starts.
        self.start_step, self.start_epoch = self.global_step, self.current_epoch

    def training_step(self, batch, batch_idx):
        x, y = batch
        return {"loss": F.cross_entropy(self.model(x), y)}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        return {"val_loss": F.cross_entropy(logits, y), "val_accuracy": (logits.argmax(1) == y).float().mean()}


class ReportSteps(Callback):
    """In the child: print every completed step, and stall after `stall_at` until killed."""

    def __init__(self, stall_at: int) -> None:
        self.stall_at = stall_at

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx) -> None:
        # A checkpoint due at this step is written at the batch boundary, after every on_train_batch_end:
        # killed while stalled here, the run leaves the checkpoint before it.
        print(f"step {trainer.global_step} epoch {trainer.current_epoch} batch {batch_idx}", flush=True)
        if trainer.global_step == self.stall_at:
            time.sleep(120)  # the parent kills us now; the sleep only bounds a parent that died


def make_trainer(args: argparse.Namespace, root_dir: Path, extra_callbacks: list[Callback]) -> ResumableTrainer:
    config = ResumeConfig(
        n_epochs=args.epochs,
        seed=args.seed,
        data_seed=args.seed,
        n_train=args.n_train,
        batch_size=args.batch_size,
        root_dir=str(root_dir),
        scheduler_interval="step",
        callbacks=[ModelCheckpoint(every_n_train_steps=args.every_n_steps, save_last=True), *extra_callbacks],
        loggers=[],  # this example is about checkpoints: no log files
        enable_progress_bar=False,
        print_epoch_summary=False,
    )
    return ResumableTrainer(config)


def run_and_kill(args: argparse.Namespace, run_dir: Path) -> tuple[int, str]:
    """Start the child, SIGKILL it after it reports `--kill-at-step`; return (returncode, last line)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--root-dir", str(run_dir)]
    for flag in ("epochs", "n_train", "batch_size", "every_n_steps", "kill_at_step", "seed", "threads"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    last = ""
    for line in child.stdout:
        last = line.strip()
        if last.startswith(f"step {args.kill_at_step} "):
            child.kill()  # SIGKILL
            break
    child.stdout.close()
    returncode = child.wait()
    if returncode != -9:
        raise RuntimeError(f"the child was to be killed at step {args.kill_at_step}; it ended with {returncode}")
    return returncode, last


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="SIGKILL a run mid-epoch, resume it, compare with an uninterrupted run.")
    p.add_argument("--epochs", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--n-train", type=int, default=2048, help="(default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="(default: %(default)s)")
    p.add_argument("--every-n-steps", type=int, default=25, help="checkpoint every n steps (default: %(default)s)")
    p.add_argument("--kill-at-step", type=int, default=90, help="SIGKILL the child here (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--root-dir", default="runs/resume_after_kill", help="(default: %(default)s)")
    p.add_argument("--child", action="store_true", help="internal: be the run that gets killed")
    # Splitting ops this small across threads costs more than it saves (and oversubscribes shared CPUs).
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Run the three steps; return `equal` (every final weight torch.equal to the reference's), the
    child's returncode, the step it was killed at and the step the resumed run started from."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    root = Path(args.root_dir)
    if args.child:  # step 2, in the child: train until killed
        make_trainer(args, root, [ReportSteps(stall_at=args.kill_at_step)]).fit()
        return {}

    steps_per_epoch = math.ceil(args.n_train / args.batch_size)
    total = args.epochs * steps_per_epoch
    if not 0 < args.kill_at_step < total:
        raise ValueError(f"--kill-at-step must be in [1, {total - 1}]: the run has {total} steps")
    ref_dir, run_dir = root / "uninterrupted", root / "interrupted"
    for d in (ref_dir, run_dir):  # a checkpoint left by an earlier run must not be resumed from
        shutil.rmtree(d, ignore_errors=True)

    start = time.perf_counter()
    reference = make_trainer(args, ref_dir, [])
    reference.fit()
    print(f"1. uninterrupted run: {reference.global_step} steps, val_loss {reference.callback_metrics['val_loss']:.4f}")

    returncode, last_line = run_and_kill(args, run_dir)
    files = sorted(p.name for p in (run_dir / "version_0" / "checkpoints").iterdir() if not p.name.startswith("."))
    print(f"2. child killed with SIGKILL (returncode {returncode}) after '{last_line}'; on disk: {', '.join(files)}")

    resumed = make_trainer(args, run_dir, [])
    resumed.fit(ckpt_path="last")
    batch = resumed.start_step - resumed.start_epoch * steps_per_epoch
    print(
        f"3. resumed from step {resumed.start_step} (epoch {resumed.start_epoch}, {batch} of its {steps_per_epoch} "
        f"batches done): {args.kill_at_step - resumed.start_step} steps lost in the kill were redone, "
        f"ended at step {resumed.global_step}, val_loss {resumed.callback_metrics['val_loss']:.4f}"
    )

    print("4. final weights, resumed vs uninterrupted:")
    ref_sd, res_sd = reference.model.state_dict(), resumed.model.state_dict()
    equal = True
    for name, ref in ref_sd.items():
        same = torch.equal(ref, res_sd[name])
        equal &= same
        diff = (ref - res_sd[name]).abs().max().item()
        print(f"   {name:10s} {tuple(ref.shape)!s:10s} torch.equal: {same}  max |difference|: {diff:.3g}")
    wall = time.perf_counter() - start
    print(f"done: resumed weights {'EQUAL' if equal else 'DIFFERENT'} to the uninterrupted run's | {wall:.1f}s")
    return {
        "equal": equal,
        "child_returncode": returncode,
        "killed_at_step": args.kill_at_step,
        "resumed_from_step": resumed.start_step,
        "global_step": resumed.global_step,
        "reference_global_step": reference.global_step,
        "wall_s": wall,
    }


if __name__ == "__main__":
    results = main()
    sys.exit(0 if results.get("equal", True) else 1)
