"""Training runs for tests/test_fault_campaign.py: killed at chosen moments, resumed, compared.

    python tests/fault_campaign.py run --root-dir D --out O [--resume] [--kill PHASE@STEP/SIGNAL[/rRANK]] ...
    torchrun --standalone --nproc_per_node 2 tests/fault_campaign.py run --root-dir D --out O ...
    python tests/fault_campaign.py plan PLAN.json             # a campaign: many runs in one interpreter

`run` trains once in this process (or in each rank torchrun starts) and writes the final state to
`O.rank<R>.pt`; `--resume` is `fit(ckpt_path="last")` in the same `--root-dir`.

`plan` is the campaign driver the test uses: one interpreter imports torch once, then runs every run of
the plan in forked children (one per rank; a 2-process DDP run is two children that meet in a gloo
process group through `MASTER_ADDR`/`MASTER_PORT`, as under torchrun), so a kill costs no interpreter
start. Like torchrun's agent, when one rank of a run ends badly the driver sends SIGTERM to the others
and, `KILL_GRACE` seconds later, SIGKILL. The plan (JSON):

    {"ref_dir": DIR, "out_dir": DIR, "trials": [{"name": "t00", "world": 1|2, "variant": {...},
                                                  "runs": [{"kill": KILL | null}, ...]}, ...]}

Each trial trains in `<out_dir>/<name>/root`: its first run fresh, every later one resumed
(`fit(ckpt_path="last")`); the last run of a trial has no kill. After a run that did not succeed on
every rank the root is copied to `<out_dir>/<name>/after<i>` (what the kill left, before the next run
cleans it). The uninterrupted reference of each world size is computed once per `ref_dir` (under a
file lock, shared by concurrent drivers) in `<ref_dir>/world<W>/`. `<out_dir>/results.json` holds, per
trial, each run's exit codes (per rank; -N: killed by signal N), wall time, and whether the driver had
to stop ranks; it is rewritten after every trial.

The run: an MLP with Dropout on 48 generated samples, a shuffling loader (the order drawn from torch's
global RNG on one process, a DistributedSampler under DDP), global batch 4, `gradient_accumulation_steps
=2` (so 6 optimizer steps per epoch, 3 epochs, 18 steps), AdamW, a StepLR per epoch, validation every
`VAL_EVERY` steps and at each epoch end, a sanity check, `ModelCheckpoint(every_n_train_steps=k,
save_last=True)`, CSVLogger and JSONLinesLogger with `log_every_n_steps=1`.

A kill (`KILL`): `{"phase": P, "step": N, "signal": "SIGKILL"|"SIGTERM"|"SIGINT", "rank": R, "nth": J}`
fires once, at the first moment of phase P at or after global step N, on rank R only (default 0), by
`os.kill(own pid, signal)`: SIGKILL is a hard death, SIGTERM/SIGINT go through the trainer's handler
(checkpoint, then exit 128+N). Phases:

- `step`: after step N completed (`on_train_batch_end`, after ModelCheckpoint saved);
- `accum`: inside the accumulation window of step N+1, after its first micro-batch;
- `before_opt`: step N+1's gradients accumulated, its optimizer step not yet taken;
- `val`: during the validation at step N, after its validation batch J;
- `sanity`: during the sanity check at the start of `fit()`;
- `load`: a resumed run loading its checkpoint (`on_load_checkpoint`; only a resume reaches it);
- `end`: training done and saved, `fit()` not yet ended (`on_fit_end`);
- `save:state`: a checkpoint save of step N is building its state (`on_save_checkpoint`; every rank);
- `save:write`: its file is being written (the hidden temporary file partial; rank 0 writes);
- `save:fsync`: the temporary file is complete, not yet durable nor renamed;
- `save:rename`: the temporary file is durable, not yet renamed to its name;
- `save:link`: the file is in place, `last.ckpt` not yet moved to it;
- `save:rotate`: rotation after the save removed the first of the files it drops.

The `save:*` moments are caught by patching, in this script, the names the package looks up when it
writes (`checkpoint_io.DurableFile`, `checkpoint_io._replace`, `model_checkpoint.point_last`,
`model_checkpoint._delete`); with `async` they happen in the background writer thread.

When a kill fires the rank writes `<prefix>.rank<R>.fired` (JSON: phase, global step, time) first, so a
test can tell a signal that arrived from one that was never sent.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dream_trainer.callbacks.model_checkpoint as model_checkpoint
import dream_trainer.utils.checkpoint_io as checkpoint_io
from dream_trainer import Callback, DreamTrainer, DreamTrainerConfig
from dream_trainer.callbacks import ModelCheckpoint
from dream_trainer.loggers import CSVLogger, JSONLinesLogger
from dream_trainer.utils import unwrap

N_FEATURES = 8
N_TRAIN = 48
N_VAL = 16
BATCH = 4  # global: per rank BATCH // world
VAL_BATCH = 8
ACCUM = 2
EPOCHS = 3
VAL_EVERY = 4
STEPS_PER_EPOCH = N_TRAIN // BATCH // ACCUM
TOTAL_STEPS = STEPS_PER_EPOCH * EPOCHS
VAL_BATCHES = N_VAL // VAL_BATCH

PHASES = ("step", "accum", "before_opt", "val", "sanity", "load", "end")
SAVE_PHASES = ("save:state", "save:write", "save:fsync", "save:rename", "save:link", "save:rotate")
SIGNALS = ("SIGKILL", "SIGTERM", "SIGINT")
DEFAULT_VARIANT = {"every": 3, "top_k": -1, "async": False, "csv_flush": 100}
RUN_TIMEOUT = 120.0  # seconds for one run of the plan
KILL_GRACE = 10.0  # after SIGTERM to the ranks left, before SIGKILL (torchrun waits 30 s)
_STEP_RE = re.compile(r"step=(\d+)")


def val_steps() -> list[int]:
    """The global steps after which the run validates: every VAL_EVERY steps and at each epoch end."""
    return sorted({s for s in range(1, TOTAL_STEPS + 1) if s % VAL_EVERY == 0 or s % STEPS_PER_EPOCH == 0})


def save_steps(every: int) -> list[int]:
    """The global steps ModelCheckpoint saves at: every `every` steps, and the last step (on_train_end)."""
    return sorted({s for s in range(every, TOTAL_STEPS + 1, every)} | {TOTAL_STEPS})


# --- the kill ---------------------------------------------------------------------------------------------
class Kill(Callback):
    """Sends `signal` to this process once, at the first moment of `phase` at or after global step `step`
    (see the module docstring). Listed after ModelCheckpoint; "step" fires in on_train_batch_end, before
    that step's save (written at the batch boundary after it)."""

    def __init__(self, spec: dict[str, Any], rank: int, marker: Path | None) -> None:
        self.phase: str = spec["phase"]
        self.step: int = int(spec.get("step", 0))
        self.signum = signal.Signals[spec.get("signal", "SIGKILL")]
        self.nth = int(spec.get("nth", 0))
        self.armed = int(spec.get("rank", 0)) == rank
        self.marker = marker
        self.trainer: Any = None
        self.save_step = -1  # the step of the save whose files are being written (save:* phases)

    def fire(self, where: str) -> None:
        if not self.armed:
            return
        self.armed = False
        if self.marker is not None:
            step = self.trainer.global_step if self.trainer is not None else None
            record = {"phase": self.phase, "where": where, "global_step": step, "time": time.time()}
            self.marker.write_text(json.dumps(record))
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), self.signum)

    # hooks
    def setup(self, trainer: Any, stage: str) -> None:
        self.trainer = trainer

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.loop.step_ended:
            if self.phase == "step" and trainer.global_step >= self.step:
                self.fire("after the step")
        elif self.phase == "accum" and trainer.global_step >= self.step:
            self.fire("inside the accumulation window")

    def on_before_optimizer_step(self, trainer: Any, optimizer: Any) -> None:
        if self.phase == "before_opt" and trainer.global_step >= self.step:
            self.fire("before the optimizer step")

    def on_validation_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.sanity_checking:
            if self.phase == "sanity":
                self.fire("in the sanity check")
        elif self.phase == "val" and trainer.global_step >= self.step and batch_idx >= self.nth:
            self.fire(f"in validation, after batch {batch_idx}")

    def on_save_checkpoint(self, trainer: Any, checkpoint: dict[str, Any]) -> None:
        if self.phase == "save:state" and trainer.global_step >= self.step:
            self.fire("building a checkpoint's state")

    def on_load_checkpoint(self, trainer: Any, checkpoint: dict[str, Any]) -> None:
        if self.phase == "load":
            self.fire("loading the checkpoint a resume starts from")

    def on_fit_end(self, trainer: Any) -> None:
        if self.phase == "end":
            self.fire("after training, before fit() recorded its end")

    def due(self, phase: str, step: int) -> bool:
        return self.armed and self.phase == phase and step >= self.step


KILL: Kill | None = None  # the kill of this process, seen by the patched file functions


def _step_of(path: Any) -> int:
    m = _STEP_RE.search(Path(path).name)
    return int(m.group(1)) if m else -1


class _KillingFile(checkpoint_io.DurableFile):
    """The package's DurableFile, with the save:write and save:fsync moments."""

    def __init__(self, path: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self._step = _step_of(path)
        self._writes = 0

    def write(self, data: Any) -> int:
        self._writes += 1
        if self._writes == 3 and KILL is not None and KILL.due("save:write", self._step):
            KILL.fire("writing a checkpoint file")  # two writes in: the temporary file is partial
        return super().write(data)

    def close(self) -> None:
        if not self.closed and KILL is not None and KILL.due("save:fsync", self._step):
            KILL.fire("before the checkpoint file's fsync")
        super().close()


_real_replace = checkpoint_io._replace
_real_point_last = model_checkpoint.point_last
_real_delete = model_checkpoint._delete


def _replace(new: Path, path: Path) -> None:
    if path.name != checkpoint_io.LAST_NAME and KILL is not None and KILL.due("save:rename", _step_of(path)):
        KILL.fire("before renaming the checkpoint file")
    _real_replace(new, path)


def _point_last(directory: Any, target: Any) -> Path:
    step = _step_of(target)
    if KILL is not None:
        KILL.save_step = step
        if KILL.due("save:link", step):
            KILL.fire("before moving last.ckpt")
    return _real_point_last(directory, target)


def _delete(paths: list[str], directory: Path) -> None:
    if KILL is not None and paths and KILL.due("save:rotate", KILL.save_step):
        _real_delete(paths[:1], directory)
        KILL.fire("in the rotation after a save")
    _real_delete(paths, directory)


def install_kill(kill: Kill | None) -> None:
    global KILL
    KILL = kill
    checkpoint_io.DurableFile = _KillingFile  # type: ignore[misc]
    checkpoint_io._replace = _replace
    model_checkpoint.point_last = _point_last
    model_checkpoint._delete = _delete


def parse_kill(text: str) -> dict[str, Any]:
    """`PHASE@STEP/SIGNAL[/rRANK][/bJ]` -> a kill spec (`val@8/SIGTERM/r1`)."""
    head, *rest = text.split("/")
    phase, _, step = head.partition("@")
    spec: dict[str, Any] = {"phase": phase, "step": int(step or 0), "signal": "SIGKILL"}
    for part in rest:
        if part.startswith("r"):
            spec["rank"] = int(part[1:])
        elif part.startswith("b"):
            spec["nth"] = int(part[1:])
        else:
            spec["signal"] = part
    if phase not in PHASES + SAVE_PHASES or spec["signal"] not in SIGNALS:
        raise SystemExit(f"bad kill {text!r}: phases {PHASES + SAVE_PHASES}, signals {SIGNALS}")
    return spec


# --- the run ----------------------------------------------------------------------------------------------
class Recorder(Callback):
    """The loss of each batch this process trained, by (epoch, batch_idx); the global step and run directory
    when training starts (also written to `start`, JSON, at once: a run killed later still tells them)."""

    def __init__(self, start: Path) -> None:
        self.losses: dict[tuple[int, int], float] = {}
        self.start_step: int | None = None
        self.start = start

    def on_train_start(self, trainer: Any) -> None:
        self.start_step = trainer.global_step
        self.start.write_text(json.dumps({"start_step": trainer.global_step, "run_dir": str(trainer.run_dir)}))

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses[(trainer.current_epoch, batch_idx)] = float(outputs["loss"].detach())


class CampaignTrainer(DreamTrainer):
    def configure_models(self) -> None:
        # Built after fit() seeded the RNGs: every run starts from the same weights.
        self.model = nn.Sequential(
            nn.Linear(N_FEATURES, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.2),
            nn.Linear(32, 1),
        )  # fmt: skip

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.7)

    def configure_dataloaders(self) -> tuple[DataLoader, DataLoader]:
        g = torch.Generator().manual_seed(1234)  # the data's values only: the global RNG is not touched
        x = torch.randn(N_TRAIN + N_VAL, N_FEATURES, generator=g)
        w = torch.randn(N_FEATURES, 1, generator=g)
        y = torch.sin(x @ w) + 0.1 * torch.randn(N_TRAIN + N_VAL, 1, generator=g)
        world = self.world_size
        # shuffle=True, no generator: on one process the order comes from torch's global RNG; under DDP
        # the trainer gives the loader a DistributedSampler (shuffle kept).
        train = DataLoader(TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), batch_size=BATCH // world, shuffle=True)
        val = DataLoader(TensorDataset(x[N_TRAIN:], y[N_TRAIN:]), batch_size=VAL_BATCH // world)
        return train, val

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"loss": F.mse_loss(self.model(x), y)}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y)}


def final_state(trainer: CampaignTrainer, recorder: Recorder) -> dict[str, Any]:
    optimizer = {
        f"{idx}.{key}": value.detach().clone()
        for idx, st in trainer.optimizer.state_dict()["state"].items()
        for key, value in st.items()
        if isinstance(value, torch.Tensor)
    }
    return {
        "model": {k: v.detach().clone() for k, v in unwrap(trainer.model).state_dict().items()},
        "optimizer": optimizer,
        "lr": [group["lr"] for group in trainer.optimizer.param_groups],
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "rng": torch.get_rng_state(),
        "start_step": recorder.start_step,
        "losses": dict(recorder.losses),
        "run_dir": str(trainer.run_dir),
        "world_size": trainer.world_size,
    }


def run_once(root: str, out: str, resume: bool, kill: dict[str, Any] | None, variant: dict[str, Any]) -> None:
    """One `fit()` in this process (one rank of it under DDP); the final state to `<out>.rank<R>.pt`."""
    torch.set_num_threads(1)  # the same kernels in every process, whatever the load
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    v = {**DEFAULT_VARIANT, **variant}
    killer = None if kill is None else Kill(kill, rank, Path(f"{out}.rank{rank}.fired"))
    install_kill(killer)
    recorder = Recorder(Path(f"{out}.rank{rank}.start"))
    checkpointer = ModelCheckpoint(every_n_train_steps=v["every"], save_top_k=v["top_k"], save_last=True)
    callbacks: list[Callback] = [checkpointer, recorder, *([killer] if killer is not None else [])]
    config = DreamTrainerConfig(
        seed=0, n_epochs=EPOCHS, gradient_accumulation_steps=ACCUM, val_every_n_steps=VAL_EVERY,
        num_sanity_val_steps=2, device="cpu", strategy="ddp" if world > 1 else "auto", root_dir=root,
        log_every_n_steps=1, loggers=[CSVLogger(flush_every=v["csv_flush"]), JSONLinesLogger()],
        callbacks=callbacks, enable_progress_bar=False, print_epoch_summary=False,
        async_checkpointing=v["async"], process_group_timeout=60.0, hang_timeout=30.0,
    )  # fmt: skip
    trainer = CampaignTrainer(config)
    trainer.fit(ckpt_path="last" if resume else None)
    state = final_state(trainer, recorder)
    tmp = Path(f"{out}.rank{rank}.pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, f"{out}.rank{rank}.pt")


# --- the driver -------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def _child(rank: int, world: int, port: int, log: Path, args: tuple[Any, ...]) -> int:
    """In a forked child: become rank `rank` of `world`, run, return the exit code."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver's last look at a rank that hangs
    for name in _LAUNCHER_VARS:
        os.environ.pop(name, None)
    if world > 1:
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
            GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
    try:
        run_once(*args)
        return 0
    except SystemExit as exc:  # TrainingInterrupted: 128 + the signal
        traceback.print_exc()
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()


def launch(world: int, log_prefix: Path, args: tuple[Any, ...]) -> dict[str, Any]:
    """Run `run_once(*args)` on `world` forked ranks; stop the others when one fails (as torchrun does).
    A port taken between `free_port()` and the store's bind (another process on this machine) fails the
    process group's creation, before the run touches its directory: then the run starts again."""
    for attempt in range(3):
        result = _launch_once(world, free_port() if world > 1 else 0, log_prefix, args)
        rank0_log = Path(f"{log_prefix}.rank0.log")
        if world == 1 or result["codes"][0] == 0 or "EADDRINUSE" not in rank0_log.read_text():
            break
        result["port_retries"] = attempt + 1
    return result


def _launch_once(world: int, port: int, log_prefix: Path, args: tuple[Any, ...]) -> dict[str, Any]:
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:  # the child never returns into the driver
            code = 1
            try:
                code = _child(rank, world, port, Path(f"{log_prefix}.rank{rank}.log"), args)
            finally:
                os._exit(code)
        pids[pid] = rank
    codes: list[int | None] = [None] * world
    start = time.monotonic()
    failed_at: float | None = None
    stopped: list[str] = []
    while any(c is None for c in codes):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pids[pid]] = os.waitstatus_to_exitcode(status)
            if codes[pids[pid]] != 0 and failed_at is None:
                failed_at = time.monotonic()
            continue
        now = time.monotonic()
        alive = [p for p, r in pids.items() if codes[r] is None]
        if failed_at is not None and "SIGTERM" not in stopped:
            stopped.append("SIGTERM")  # torchrun's agent: a failed worker stops the group
            for p in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGTERM)
        if (failed_at is not None and now - failed_at > KILL_GRACE) or now - start > RUN_TIMEOUT:
            if not any(s.startswith("SIGKILL") for s in stopped):
                stopped.append("SIGKILL" if now - start <= RUN_TIMEOUT else "SIGKILL (timeout)")
                for p in alive:  # each rank left writes its threads' stacks into its log first
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p, signal.SIGUSR1)
                time.sleep(0.5)
            for p in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
        time.sleep(0.005)
    return {"codes": codes, "seconds": round(time.monotonic() - start, 3), "stopped": stopped}


@contextlib.contextmanager
def file_lock(path: Path) -> Any:
    import fcntl

    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def reference(ref_dir: Path, world: int) -> None:
    """The uninterrupted run of `world` ranks, once per `ref_dir`: `<ref_dir>/world<W>/{root,out.rank<R>.pt}`."""
    d = ref_dir / f"world{world}"
    d.mkdir(parents=True, exist_ok=True)
    with file_lock(ref_dir / f"world{world}.lock"):
        if (d / "done.json").exists():
            return
        shutil.rmtree(d / "root", ignore_errors=True)
        result = launch(world, d / "run", (str(d / "root"), str(d / "out"), False, None, {}))
        (d / "done.json").write_text(json.dumps(result))


def _snapshot_copy(src: str, dst: str) -> None:
    """What a kill left, kept for the test: checkpoint files (never changed in place: written under a
    temporary name, then renamed) as hard links, so `last.ckpt` still names the file it named; the rest
    (metrics files are appended to) as copies."""
    if ".ckpt" in os.path.basename(src):
        os.link(src, dst)
    else:
        shutil.copy2(src, dst)


def run_plan(plan_file: Path) -> None:
    plan = json.loads(plan_file.read_text())
    ref_dir, out_dir = Path(plan["ref_dir"]), Path(plan["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for world in sorted({t["world"] for t in plan["trials"]}):
        reference(ref_dir, world)
    for trial in plan["trials"]:
        d = out_dir / trial["name"]
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        runs = []
        for i, run in enumerate(trial["runs"]):
            prefix = d / f"run{i}"
            args = (str(d / "root"), str(prefix), i > 0, run.get("kill"), trial.get("variant", {}))
            result = launch(trial["world"], prefix, args)
            if any(c != 0 for c in result["codes"]):
                shutil.copytree(d / "root", d / f"after{i}", symlinks=True, copy_function=_snapshot_copy)
            runs.append(result)
        results[trial["name"]] = runs
        tmp = out_dir / "results.json.tmp"
        tmp.write_text(json.dumps(results, indent=1))
        os.replace(tmp, out_dir / "results.json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run", help="one fit() in this process (every rank, under torchrun)")
    one.add_argument("--root-dir", required=True)
    one.add_argument("--out", required=True, help="the final state goes to OUT.rank<R>.pt")
    one.add_argument("--resume", action="store_true", help='fit(ckpt_path="last")')
    one.add_argument("--kill", type=parse_kill, help="PHASE@STEP/SIGNAL[/rRANK][/bJ], e.g. save:write@6/SIGKILL")
    one.add_argument("--every", type=int, default=DEFAULT_VARIANT["every"], help="every_n_train_steps")
    one.add_argument("--top-k", type=int, default=DEFAULT_VARIANT["top_k"], help="save_top_k")
    one.add_argument("--async-ckpt", action="store_true", help="async_checkpointing=True")
    one.add_argument("--csv-flush", type=int, default=DEFAULT_VARIANT["csv_flush"], help="CSVLogger(flush_every)")
    many = sub.add_parser("plan", help="run a campaign plan (JSON) in forked children")
    many.add_argument("plan", type=Path)
    args = p.parse_args(argv)
    if args.command == "plan":
        import torch._dynamo  # noqa: F401 - the first optimizer imports it (~3 s): once, before the forks

        run_plan(args.plan)
        return 0
    variant = {"every": args.every, "top_k": args.top_k, "async": args.async_ckpt, "csv_flush": args.csv_flush}
    run_once(args.root_dir, args.out, args.resume, args.kill, variant)
    return 0


if __name__ == "__main__":
    sys.exit(main())
