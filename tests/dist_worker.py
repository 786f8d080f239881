"""Training runs for tests/test_distributed.py, launched with `python` (one process) or `torchrun`.

    python tests/dist_worker.py --root-dir D --out w.pt --batch-size 8                 # one process
    torchrun --standalone --nproc_per_node 2 tests/dist_worker.py --root-dir D --out w.pt --batch-size 4
    torchrun ... tests/dist_worker.py ... --strategy fsdp                                # FSDP2
    torchrun ... tests/dist_worker.py ... --kill-rank 1 --kill-at-step 5 --kill-how sigkill
    torchrun ... tests/dist_worker.py ... --resume                                       # fit(ckpt_path="last")
    torchrun ... tests/dist_worker.py --plan plan.json                                   # several runs in turn

A plan (a JSON list of `[name, [arguments]]`) runs one fresh trainer per entry, in order, in the same
processes (one launch, one process group: its timeout is the first run's `--timeout`). Before each run
rank 0 prints `plan: <name>` to stderr; a run that raises writes its traceback to
`<plan file's directory>/<name>.error.rank<R>` and ends the plan (a restarted attempt, which runs
the plan again, removes it when it starts that run).

The run: a Tanh MLP (8-16-1, an `nn.Sequential`, so FSDP2 shards each Linear and the root) built
after `torch.manual_seed(0)`, SGD with momentum (optimizer state to checkpoint), MSE regression on a
fixed data set of `--n-train` samples and `--n-val` validation samples. `--batch-size` is the *per
rank* batch size; a plain `DataLoader` is returned and the trainer shards it (DistributedSampler).

With the default (unshuffled) order, the DistributedSampler gives rank r the samples r, r+W, r+2W,
..., so the union of the W ranks' k-th batches of size b is samples [kWb, (k+1)Wb): exactly the k-th
batch of a single process with batch W*b. DDP averages the gradients of the ranks' mean losses,
which is the mean loss of the combined batch: 2 ranks at batch 4 train like 1 process at batch 8.

What comes out:
- `--out` (global rank 0): `torch.save` of a dict with `weights` (the full, unsharded state dict at
  the end), `loaded_weights` (the same when training started, after any checkpoint was loaded),
  `saved_weights` (`{step: weights}` at every `--save-every` checkpoint), `start_step` (global_step
  then), `global_step`, `current_epoch`, `val_loss` and `loss`
  (`[(step, value)]` as logged, i.e. reduced across ranks), `world_size`, `restart_count`
  (TORCHELASTIC_RESTART_COUNT), `allreduce_calls` (`--count-allreduce`) and `stepping_batches` (what
  `estimated_stepping_batches` gave in `configure_optimizers`).
- `--info-dir` (every rank): `rank<R>.json` written in `teardown` (so also after a failure or a
  signal): the rank's `global_step`, `current_epoch`, `start_step`, `exception`, `restart_count`,
  `allreduce_calls`.

Failure injection, from the trainer's own `on_train_batch_end` (which fires after the callbacks', so
after `ModelCheckpoint` saved at that step): `--kill-rank R --kill-at-step S` ends rank R when
`global_step == S`, with `--kill-how sigkill` (`os.kill(self, SIGKILL)`: no handler, no cleanup) or
`exit` (`os._exit(1)`), or `hang` (stays alive, out of the collectives), or `sigterm` (sends itself
SIGTERM and trains on: a pre-emption signal that reaches one rank); with `--kill-first-attempt-only`
only while TORCHELASTIC_RESTART_COUNT is 0 (torchrun sets it; a restarted worker group then trains
on). Just before, the rank writes the time (`time.time()`) to `--info-dir`/`rank<R>.failed_at`.
`--kill-how hang-in-step` hangs instead inside `training_step` while `global_step == S` (in
`stuck_in_training_step`, its SIGTERM handler left as the trainer installed it: a rank that ignores
SIGTERM), for the hang watchdog (`--hang-timeout`) to find; `--kill-how hang-in-c` likewise, but in C code
that holds the GIL (`stuck_in_c`: no Python thread of the rank runs again). `--interrupted-ok`: a run a signal stopped
(`TrainingInterrupted`) does not end the plan.

`--stdout-dir DIR`: during the run, each rank's standard output (file descriptor 1) goes to
`DIR/rank<R>.stdout`, so a test can see which rank printed what.

Bad batches (tests/test_spikes_ddp.py): `--bad-batch K --bad-rank R` makes rank R's batch K bad (its inputs
x1e4, or with `--bad-kind nan` one NaN input) and `--without-batch K` leaves out the samples of every
rank's batch K (the clean run whose loaders never yield it); both assume the unshuffled order (rank r's
batch k is samples `r + W*(k*b + j)`). `--spike-policy`, `--spike-every` (spike_snapshot_every) and
`--non-finite-grads` set the config (`--relu`: a ReLU MLP, which Tanh's saturation would not let
inputs x1e4 reach the loss); the result adds `skipped_batches`, `spikes` and the logged
`skipped_batches` series, and every rank's `rank<R>.json` its `skipped_batches`.

`--save-mid-window-at S` (with `--accum` > 1): at step S, from the trainer's `on_train_batch_end` of the
window's first micro-batch, every rank calls `save_checkpoint(ROOT/mid-window.ckpt)`: a checkpoint written
inside an accumulation window, where each rank holds gradients of its own not yet synchronised.

Signals: `--wait-for-signal-rank R --wait-for-signal-at-step S` makes rank R, at step S, touch
`--ready-file` and wait (at most 30 s) until a SIGTERM/SIGINT arrives; the other ranks train on and
block in the next collective, so they get the signal late and must learn of it from rank R (the
trainer's agreement at logging points).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig, TrainingInterrupted
from dream_trainer.callbacks import ModelCheckpoint
from dream_trainer.loggers import CSVLogger, JSONLinesLogger, MemoryLogger
from dream_trainer.utils import unwrap

N_FEATURES = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root-dir", required=True, help="config.root_dir (checkpoints in ROOT/run/checkpoints)")
    p.add_argument("--per-rank-root", action="store_true", help="root_dir = ROOT/rank<R> (to see who writes)")
    p.add_argument("--out", help="rank 0 writes the final weights and logged metrics here")
    p.add_argument("--info-dir", help="every rank writes rank<R>.json here in teardown")
    p.add_argument("--strategy", choices=("auto", "ddp", "fsdp"), default="auto")
    p.add_argument("--batch-size", type=int, default=8, help="per-rank batch size (train and val)")
    p.add_argument("--accum", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--shuffle", action="store_true", help="DataLoader(shuffle=True)")
    p.add_argument(
        "--ddp-order",
        action="store_true",
        help="one process: read the data in the order 2-rank DDP reads it with --shuffle "
        "(a DistributedSampler with num_replicas=1 draws the same permutation)",
    )
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int)
    p.add_argument("--n-train", type=int, default=32)
    p.add_argument("--n-val", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log-every", type=int, default=1, help="log_every_n_steps")
    p.add_argument("--timeout", type=float, default=120.0, help="process_group_timeout (seconds)")
    p.add_argument("--save-every", type=int, help="ModelCheckpoint(every_n_train_steps=N, save_top_k=-1)")
    p.add_argument(
        "--fsdp-full-checkpoints", action="store_true", help="fsdp_sharded_checkpoints=False (one gathered file)"
    )
    p.add_argument("--file-loggers", action="store_true", help="CSVLogger + JSONLinesLogger (+ MemoryLogger)")
    p.add_argument("--verbose", action="store_true", help="progress bar and epoch summary on")
    p.add_argument("--resume", action="store_true", help='fit(ckpt_path="last")')
    p.add_argument("--ckpt", help="fit(ckpt_path=CKPT)")
    p.add_argument("--resume-from", help="config.resume_from")
    p.add_argument("--count-allreduce", action="store_true", help="count DDP gradient all-reduces (comm hook)")
    p.add_argument("--kill-rank", type=int)
    p.add_argument("--kill-at-step", type=int)
    p.add_argument(
        "--kill-how", choices=("sigkill", "exit", "hang", "sigterm", "hang-in-step", "hang-in-c"), default="sigkill"
    )
    p.add_argument("--interrupted-ok", action="store_true", help="a TrainingInterrupted run does not end the plan")
    p.add_argument("--hang-timeout", type=float, help="config.hang_timeout (default: None, not watched)")
    p.add_argument("--hang-timeout-first-step", type=float, help="config.hang_timeout_first_step")
    p.add_argument("--kill-first-attempt-only", action="store_true")
    p.add_argument("--wait-for-signal-rank", type=int)
    p.add_argument("--wait-for-signal-at-step", type=int)
    p.add_argument("--ready-file")
    p.add_argument("--sleep-per-step", type=float, default=0.0)
    p.add_argument("--save-mid-window-at", type=int, help="save ROOT/mid-window.ckpt inside step S's window")
    p.add_argument("--rank-metric", action="store_true", help="rank 1 also logs `rank1_step` = its global_step")
    p.add_argument("--stdout-dir", help="each rank's stdout (fd 1) during the run goes to DIR/rank<R>.stdout")
    p.add_argument("--spike-policy", help="config.spike_policy (default: the config's)")
    p.add_argument("--spike-every", type=int, help="config.spike_snapshot_every (default: the config's)")
    p.add_argument("--non-finite-grads", help="config.non_finite_grads (default: the config's)")
    p.add_argument("--relu", action="store_true", help="ReLU for Tanh (inputs x1e4 then make the loss spike)")
    p.add_argument("--bad-batch", type=int, help="this batch index is bad on --bad-rank only")
    p.add_argument("--bad-rank", type=int, default=1)
    p.add_argument("--bad-kind", choices=("spike", "nan"), default="spike", help="inputs x1e4, or one NaN input")
    p.add_argument("--without-batch", type=int, help="no rank's loader yields this batch index (the clean run)")
    return p.parse_args(argv)


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_FEATURES, generator=g)
    w = torch.linspace(-1.0, 1.0, N_FEATURES).unsqueeze(1)
    y = torch.tanh(x @ w) + 0.5 + 0.05 * torch.randn(n, 1, generator=g)
    return x, y


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on the CPU. Under FSDP2 this is a collective (every rank calls it)."""
    out = {}
    for k, v in unwrap(model).state_dict().items():
        if hasattr(v, "full_tensor"):  # a DTensor (FSDP2 shard)
            v = v.full_tensor()
        out[k] = v.detach().to("cpu", copy=True)
    return out


class DistTrainer(DreamTrainer):
    def __init__(self, config: DreamTrainerConfig, args: argparse.Namespace) -> None:
        super().__init__(config)
        self.args = args
        self.memory = next(lg for lg in config.loggers or [] if isinstance(lg, MemoryLogger))
        self.gc_frozen_in_fit = -1
        self.start_step: int | None = None
        self.loaded_weights: dict[str, torch.Tensor] | None = None
        self.final_weights: dict[str, torch.Tensor] | None = None
        self.saved_weights: dict[int, dict[str, torch.Tensor]] = {}
        self.allreduce_calls = 0
        self.signal_seen = threading.Event()
        self.exception: BaseException | None = None
        self.stepping_batches: int | None = None

    def configure_models(self) -> None:
        torch.manual_seed(0)
        act = nn.ReLU() if self.args.relu else nn.Tanh()
        self.model = nn.Sequential(nn.Linear(N_FEATURES, 16), act, nn.Linear(16, 1))

    def configure_optimizers(self) -> None:
        if self.args.count_allreduce:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counting_hook(state, bucket):  # unannotated: DDP checks the annotations' types
                self.allreduce_calls += 1
                return allreduce_hook(state, bucket)

            assert hasattr(self.model, "register_comm_hook"), f"not a DDP model: {type(self.model)}"
            self.model.register_comm_hook(None, counting_hook)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.args.lr, momentum=self.args.momentum)
        self.stepping_batches = self.estimated_stepping_batches  # as a scheduler sized by it reads it

    def configure_dataloaders(self) -> tuple[DataLoader, DataLoader]:
        a = self.args
        x, y = make_data(a.n_train + a.n_val, seed=0)
        x, y = x.clone(), y.clone()
        w, b = self.world_size, a.batch_size  # unshuffled: rank r's batch k is samples r + w * (k * b + j)
        if a.bad_batch is not None:
            rows = [a.bad_rank + w * (a.bad_batch * b + j) for j in range(b)]
            if a.bad_kind == "spike":
                x[rows] = x[rows] * 1e4
            else:
                x[rows[0], 0] = float("nan")
        n_train = a.n_train
        if a.without_batch is not None:
            keep = [i for i in range(len(x)) if not w * a.without_batch * b <= i < w * (a.without_batch + 1) * b]
            x, y = x[keep], y[keep]
            n_train -= w * b
        train_ds = TensorDataset(x[:n_train], y[:n_train])
        val_ds = TensorDataset(x[n_train:], y[n_train:])
        if a.ddp_order:
            sampler = DistributedSampler(train_ds, num_replicas=1, rank=0, shuffle=True, seed=self.config.seed)
            train = DataLoader(train_ds, batch_size=a.batch_size, sampler=sampler)
        else:
            train = DataLoader(train_ds, batch_size=a.batch_size, shuffle=a.shuffle)
        return train, DataLoader(val_ds, batch_size=a.batch_size)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        a = self.args
        if a.kill_how.startswith("hang-in-") and a.kill_rank == self.global_rank and a.kill_at_step == self.global_step:
            self.note_failure()
            stuck_in_c() if a.kill_how == "hang-in-c" else stuck_in_training_step()
        x, y = batch
        if self.args.rank_metric and self.global_rank == 1:
            self.log("rank1_step", float(self.global_step))  # a name only one rank logs
        return {"loss": F.mse_loss(self.model(x), y)}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y)}

    # --- hooks ------------------------------------------------------------------------------------
    def on_train_start(self) -> None:
        self.start_step = self.global_step
        self.gc_frozen_in_fit = gc.get_freeze_count()
        self.loaded_weights = full_weights(self.model)
        if self.args.wait_for_signal_rank is not None:
            # Chain onto the trainer's handler (installed in fit()) to know when the signal is here.
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous = signal.getsignal(sig)

                def handler(signum: int, frame: Any, previous: Any = previous) -> None:
                    self.signal_seen.set()
                    if callable(previous):
                        previous(signum, frame)

                signal.signal(sig, handler)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        a = self.args
        if not self.loop.step_ended:  # inside an accumulation window
            if a.save_mid_window_at == self.global_step and self.loop.micro_batch == 1:
                self.save_checkpoint(Path(self.config.root_dir) / "mid-window.ckpt")
            return
        if a.save_every and self.global_step % a.save_every == 0:
            # What ModelCheckpoint (a callback: it fired before this hook) just saved.
            self.saved_weights[self.global_step] = full_weights(self.model)
        if a.sleep_per_step:
            time.sleep(a.sleep_per_step)
        if a.kill_rank == self.global_rank and a.kill_at_step == self.global_step:
            first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if (first or not a.kill_first_attempt_only) and not a.kill_how.startswith("hang-in-"):
                self.note_failure()
                sys.stdout.flush()
                sys.stderr.flush()
                if a.kill_how == "sigterm":  # the handler records it; training goes on to the agreed step
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
                if a.kill_how == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if a.kill_how == "hang":  # alive but gone from the collectives (a stuck rank)
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun's SIGTERM ends it at once
                    while True:
                        time.sleep(1)
                os._exit(1)
        if a.wait_for_signal_rank == self.global_rank and a.wait_for_signal_at_step == self.global_step:
            if a.ready_file:
                Path(a.ready_file).write_text(str(self.global_step))
            if not self.signal_seen.wait(30):
                raise RuntimeError("no signal arrived within 30 s")

    def note_failure(self) -> None:
        if self.args.info_dir:
            Path(self.args.info_dir).mkdir(parents=True, exist_ok=True)
            (Path(self.args.info_dir) / f"rank{self.global_rank}.failed_at").write_text(repr(time.time()))

    def on_fit_end(self) -> None:
        # Before teardown destroys the process group (full_weights is a collective under FSDP).
        self.final_weights = full_weights(self.model)

    def on_exception(self, exception: BaseException) -> None:
        self.exception = exception

    def teardown(self, stage: str) -> None:
        if self.args.info_dir:
            exc = self.exception
            info = {
                "rank": self.global_rank,
                "local_rank": self.local_rank,
                "group_rank": os.environ.get("GROUP_RANK"),
                "world_size": self.world_size,
                "global_step": self.global_step,
                "current_epoch": self.current_epoch,
                "start_step": self.start_step,
                "exception": None if exc is None else type(exc).__name__,
                "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
                "allreduce_calls": self.allreduce_calls,
                "skipped_batches": self.skipped_batches,
            }
            Path(self.args.info_dir).mkdir(parents=True, exist_ok=True)
            (Path(self.args.info_dir) / f"rank{self.global_rank}.json").write_text(json.dumps(info))


def stuck_in_training_step() -> None:
    """A rank that never finishes its step (a deadlock in the user's code); the hang watchdog names it."""
    while True:
        time.sleep(0.5)


def stuck_in_c() -> None:
    """A rank stuck in C code that holds the GIL: libc's sleep called through `ctypes.PyDLL`, which keeps it
    (a signal cuts a sleep short: it sleeps again, as a deadlocked C call would still be stuck)."""
    import ctypes

    while True:
        ctypes.PyDLL(None).sleep(600)


def build(args: argparse.Namespace) -> DistTrainer:
    rank = int(os.environ.get("RANK", "0"))
    root = Path(args.root_dir) / f"rank{rank}" if args.per_rank_root else Path(args.root_dir)
    loggers: list[Any] = [MemoryLogger()]
    if args.file_loggers:
        loggers += [CSVLogger(), JSONLinesLogger()]
    bad_batch_settings = {
        "spike_policy": args.spike_policy,
        "spike_snapshot_every": args.spike_every,
        "non_finite_grads": args.non_finite_grads,
    }
    callbacks: list[Any] = []
    if args.save_every:
        callbacks.append(ModelCheckpoint(every_n_train_steps=args.save_every, save_top_k=-1, save_last=True))
    config = DreamTrainerConfig(
        seed=args.seed,
        n_epochs=args.epochs,
        max_steps=args.max_steps,
        gradient_accumulation_steps=args.accum,
        device="cpu",
        strategy=args.strategy,
        fsdp_sharded_checkpoints=not args.fsdp_full_checkpoints,
        process_group_timeout=args.timeout,
        # None unless given: the config's 600 s exceeds these runs' --timeout, which the config refuses.
        hang_timeout=args.hang_timeout,
        **{k: getattr(args, k) for k in ("hang_timeout_first_step",) if getattr(args, k) is not None},
        root_dir=str(root),
        run_name="run",
        resume_from=args.resume_from,
        log_every_n_steps=args.log_every,
        loggers=loggers,
        callbacks=callbacks,
        enable_progress_bar=args.verbose,
        print_epoch_summary=args.verbose,
        enable_checkpointing=bool(args.save_every) or args.verbose,
        **{k: v for k, v in bad_batch_settings.items() if v is not None},
    )
    return DistTrainer(config, args)


@contextlib.contextmanager
def stdout_to(path: Path) -> Iterator[None]:
    """File descriptor 1 (so `print`, and anything else writing to stdout) goes to `path` for a while."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(path, "wb") as f:
        os.dup2(f.fileno(), 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run(args: argparse.Namespace) -> None:
    """One fit; rank 0 writes the result to `--out`."""
    trainer = build(args)
    ckpt: str | None = "last" if args.resume else args.ckpt
    if args.stdout_dir:
        Path(args.stdout_dir).mkdir(parents=True, exist_ok=True)
        capture: contextlib.AbstractContextManager[Any] = stdout_to(
            Path(args.stdout_dir) / f"rank{os.environ.get('RANK', '0')}.stdout"
        )
    else:
        capture = contextlib.nullcontext()
    with capture:
        try:
            trainer.fit(ckpt_path=ckpt)
        except TrainingInterrupted:
            if not args.interrupted_ok:
                raise
            return
    if args.out and trainer.global_rank == 0:
        result = {
            "weights": trainer.final_weights,
            "loaded_weights": trainer.loaded_weights,
            "saved_weights": trainer.saved_weights,
            "start_step": trainer.start_step,
            "global_step": trainer.global_step,
            "current_epoch": trainer.current_epoch,
            "val_loss": trainer.memory.series("val_loss"),
            "loss": trainer.memory.series("loss"),
            "rank1_step": trainer.memory.series("rank1_step"),
            "world_size": trainer.world_size,
            "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
            "allreduce_calls": trainer.allreduce_calls,
            "gc_frozen_in_fit": trainer.gc_frozen_in_fit,
            "gc_frozen_after_fit": gc.get_freeze_count(),
            "skipped_batches": trainer.skipped_batches,
            "spikes": trainer.spikes,
            "skipped_logged": trainer.memory.series("skipped_batches"),
            "stepping_batches": trainer.stepping_batches,
        }
        tmp = Path(args.out).with_suffix(".tmp")
        torch.save(result, tmp)
        os.replace(tmp, args.out)


def run_plan(plan_file: Path) -> None:
    """The plan's runs in order (see the module docstring)."""
    rank = os.environ.get("RANK", "0")
    for name, argv in json.loads(plan_file.read_text()):
        if rank == "0":
            print(f"plan: {name}", file=sys.stderr, flush=True)
        error = plan_file.parent / f"{name}.error.rank{rank}"
        error.unlink(missing_ok=True)  # an earlier attempt's (torchrun --max-restarts runs the plan again)
        try:
            run(parse_args(argv))
        except BaseException:
            error.write_text(traceback.format_exc())
            raise


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--plan"]:
        run_plan(Path(argv[1]))
    else:
        run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
