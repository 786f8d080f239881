"""A fault campaign: runs killed at random moments, resumed, and held to a run never interrupted.

A seeded random plan of trials (`make_plan`). A trial trains `fault_campaign.py`'s run (one process, or
two under DDP: global batch 4, gradient accumulation 2, 18 optimizer steps over 3 epochs, Dropout, a
shuffling loader, validation every 4 steps and at epoch ends, checkpoints every k steps, CSV and JSONL
loggers logging every step), kills it at a moment the plan drew, resumes it with `fit(ckpt_path="last")`
in the same `root_dir` (three trials in ten kill the resumed run too), and lets the last run finish.

The moments (see `fault_campaign.py`): after a step; inside an accumulation window; before an optimizer
step; during a validation; during the sanity check; while a resume loads its checkpoint; after training,
before `fit()` recorded its end; during a checkpoint save: building its state, writing its temporary
file, before its fsync, before its rename, before `last.ckpt` moves to it, in the rotation after it.
The signal: SIGKILL, or SIGTERM/SIGINT (the trainer's handler saves, then exits 128+N). Under DDP one
rank only is signalled. Checkpoint cadence, `save_top_k`, async saves and the CSV logger's flush
interval are drawn too: they must not change the result, so one uninterrupted reference per world size
serves every trial.

Each trial is two tests:
- `test_killed_runs_resume_exactly`: the exit codes; after each kill, every listed checkpoint loads (no
  torn file under a real name), a kill inside a write left its partial file, a signal left its
  checkpoint under `last.ckpt`, and the next run started from the newest complete checkpoint, in its
  run's directory; at the end, weights, optimizer state, LR, step and RNG `torch.equal` to the
  reference's on every rank, no partial file left anywhere, every `run.json` final (none "running",
  no resume without an outcome), the last one "success";
- `test_killed_runs_log_every_step_once`: the final run's metrics.csv and metrics.jsonl hold each
  training step 1..18 exactly once, and every metric at every step once, with the reference's values.

    python -m pytest tests/test_fault_campaign.py                                   # 5 trials (CI)
    DREAM_FAULT_TRIALS=60 python -m pytest tests/test_fault_campaign.py -n auto     # a long campaign
    DREAM_FAULT_SEED=7 DREAM_FAULT_TRIALS=30 python -m pytest tests/test_fault_campaign.py -n auto -rxX

The runs happen in `fault_campaign.py plan` drivers, one per chunk of 5 trials (the default plan is one):
an interpreter that imports torch once and forks a child per rank and run, so a kill costs no
interpreter start. Each chunk runs once per test run, started by whichever xdist worker asks first;
the references are computed once per test run. Each run's logs, what each kill left (`after<i>/`) and
the final root are in `fault-campaign-<seed>-<trials>[-<xdist run id>]/<chunk>/out/<trial>/`, in (or,
under xdist, beside) pytest's basetemp: give `--basetemp DIR` to find and keep them.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fault_campaign as fc
import pytest
import torch
from helpers import REPO, csv_series, file_lock, jsonl_series, launcher_free_env, python, xdist_shared_dir

from dream_trainer.utils.checkpoint_io import read_checkpoint
from dream_trainer.utils.run_dirs import is_run_dir, read_record

pytestmark = pytest.mark.slow  # one driver process, ~15 forked runs: ~10 s for the default plan

TRIALS = int(os.environ.get("DREAM_FAULT_TRIALS", "5"))
SEED = int(os.environ.get("DREAM_FAULT_SEED", "0"))
CHUNK = 5  # trials per driver launch: the default plan is one launch, longer ones run in parallel chunks
DRIVER = Path(fc.__file__)
FINAL_STATUSES = {"success", "failed", "interrupted", "killed"}

# The moments a kill is drawn from, by kind, with weights. Rank 0 alone writes files: the file moments are
# its own. A resumed run alone loads a checkpoint: "load" is never the first run's kill.
KINDS = {
    "save": {"save:state": 1.0, "save:write": 2.0, "save:fsync": 1.0, "save:rename": 1.0, "save:link": 1.5,
             "save:rotate": 1.0},
    "window": {"accum": 2.0, "before_opt": 1.0},
    "validation": {"val": 1.0},
    "other": {"step": 3.0, "sanity": 0.5, "end": 0.5, "load": 2.0},
}  # fmt: skip
WRITER_PHASES = {"save:write", "save:fsync", "save:rename", "save:link", "save:rotate"}
GRACEFUL = ("SIGTERM", "SIGINT")


# --- the plan -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Trial:
    name: str
    world: int
    variant: tuple[tuple[str, Any], ...]
    kills: tuple[tuple[tuple[str, Any], ...], ...]  # one per killed run; a last run without a kill follows
    chunk: str

    @property
    def kill_specs(self) -> list[dict[str, Any]]:
        return [dict(k) for k in self.kills]

    @property
    def id(self) -> str:
        v = dict(self.variant)
        parts = [self.name, "ddp" if self.world > 1 else "single", f"k{v['every']}"]
        parts += [f"top{v['top_k']}"] if v["top_k"] > 0 else []
        parts += ["async"] if v["async"] else []
        for k in self.kill_specs:
            where = k["phase"] + (f"@{k['step']}" if k["phase"] not in ("sanity", "load", "end") else "")
            where += f"b{k['nth']}" if k["phase"] == "val" else ""
            parts.append(where + f"-{k['signal']}" + (f"-r{k['rank']}" if self.world > 1 else ""))
        return "-".join(parts)


def draw_kill(rng: random.Random, world: int, variant: dict[str, Any], kind: str | None, sig: str) -> dict[str, Any]:
    """A kill of `kind` (None: any, "load" included) that the first run is sure to reach. A resumed run may
    start past it: then it fires at the phase's first moment after the resume, if there is one."""
    phases = {p: w for k, ps in KINDS.items() if kind in (None, k) for p, w in ps.items()}
    if kind is not None:
        phases.pop("load", None)
    phase = rng.choices(list(phases), list(phases.values()))[0]
    rank = 0 if phase in WRITER_PHASES else rng.randrange(world)
    nth = 0
    if phase == "step":
        step = rng.randint(1, fc.TOTAL_STEPS)
    elif phase in ("accum", "before_opt"):
        step = rng.randint(0, fc.TOTAL_STEPS - 1)  # inside the window of step N+1
    elif phase == "val":
        step, nth = rng.choice(fc.val_steps()), rng.randrange(fc.VAL_BATCHES)
    elif phase in ("sanity", "load", "end"):
        step = 0
    else:
        if phase == "save:rotate" and variant["top_k"] < 1:
            variant["top_k"] = rng.choice([1, 2])  # something to rotate away
        saves = fc.save_steps(variant["every"])
        step = rng.choice(saves[variant["top_k"] :] if phase == "save:rotate" else saves)
    return {"phase": phase, "step": step, "signal": sig, "rank": rank, "nth": nth}


def make_plan(seed: int, n: int) -> list[Trial]:
    """`n` trials: every fifth one (and the last of 2 to 4) 2-process DDP, the others one process.
    The first kill of each trial takes the kinds of moment in turn (in a checkpoint save, inside an
    accumulation window, in a validation, elsewhere), SIGKILL twice, then SIGTERM or SIGINT, so that a
    few trials cover them all; three trials in ten are killed again in the resumed run, anywhere."""
    rng = random.Random(seed)
    kinds, offset = list(KINDS), rng.randrange(len(KINDS))
    trials = []
    for i in range(n):
        world = 2 if i % 5 == 4 or (2 <= n < 5 and i == n - 1) else 1
        variant = {
            "every": rng.choice([2, 3, 4, 5]),
            "top_k": rng.choice([-1, -1, 1, 2]),
            "async": rng.random() < 0.3,
            "csv_flush": rng.choice([1, 5, 100]),
        }
        sig = "SIGKILL" if i % 3 != 2 else rng.choice(GRACEFUL)
        kills = [draw_kill(rng, world, variant, kinds[(offset + i) % len(kinds)], sig)]
        if rng.random() < 0.3:
            kills.append(draw_kill(rng, world, variant, None, rng.choice(["SIGKILL", "SIGKILL", *GRACEFUL])))
        chunk = f"chunk{i // CHUNK}"
        variant_items = tuple(sorted(variant.items()))
        trials.append(Trial(f"t{i:02d}", world, variant_items, tuple(tuple(sorted(k.items())) for k in kills), chunk))
    return trials


PLAN = make_plan(SEED, TRIALS)


# --- launching -------------------------------------------------------------------------------------------
@dataclass
class Chunk:
    out: Path
    ref: Path
    log: str

    def results(self, trial: Trial) -> list[dict[str, Any]]:
        path = self.out / "results.json"
        results = json.loads(path.read_text()) if path.exists() else {}
        assert trial.name in results, f"the driver did not finish trial {trial.name}:\n{self.log}"
        return results[trial.name]

    def reference(self, world: int, rank: int) -> dict[str, Any]:
        """The uninterrupted run's final state on `rank` (its run directory: `<ref>/world<W>/root/version_0`)."""
        d = self.ref / f"world{world}"
        done = read_json(d / "done.json")
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(d.glob("run.rank*.log")))
        assert done is not None and done["codes"] == [0] * world, f"the reference run failed: {done}\n{logs}"
        return torch.load(d / f"out.rank{rank}.pt", weights_only=True)

    def describe(self, trial: Trial, i: int) -> str:
        logs = sorted((self.out / trial.name).glob(f"run{i}.rank*.log"))
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs)


@pytest.fixture(scope="session")
def campaign(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shared by the xdist workers of this test run (never across runs)."""
    return xdist_shared_dir(tmp_path_factory, f"fault-campaign-{SEED}-{TRIALS}")


def chunk_plan(campaign: Path, name: str) -> dict[str, Any]:
    """The driver's plan for chunk `name`: its trials, each with its kills and a last run without one."""
    trials = [
        {"name": t.name, "world": t.world, "variant": dict(t.variant), "runs": [{"kill": k} for k in t.kill_specs]}
        for t in PLAN
        if t.chunk == name
    ]
    for t in trials:
        t["runs"].append({"kill": None})
    return {"ref_dir": str(campaign / "reference"), "out_dir": str(campaign / name / "out"), "trials": trials}


def launch_chunk(campaign: Path, name: str) -> Chunk:
    """Run chunk `name` of the plan once per test run (whichever worker asks first; the others wait)."""
    d = campaign / name
    d.mkdir(exist_ok=True)
    log = d / "driver.log"
    with file_lock(d / "lock"):
        if not log.exists():
            plan = chunk_plan(campaign, name)
            (d / "plan.json").write_text(json.dumps(plan, indent=1))
            env = {**launcher_free_env(), "OMP_NUM_THREADS": "1"}
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
            cmd = [python(), str(DRIVER), "plan", str(d / "plan.json")]
            start = time.monotonic()
            try:
                proc = subprocess.run(
                    cmd, capture_output=True, text=True, env=env, timeout=120 + 60 * len(plan["trials"])
                )
                text = (
                    f"exit code {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
                )
            except subprocess.TimeoutExpired as exc:
                text = f"timed out after {exc.timeout} s"
            log.write_text(f"driver of {name}, {time.monotonic() - start:.1f} s: {text}")
    return Chunk(d / "out", campaign / "reference", log.read_text())


# --- reading what runs left -----------------------------------------------------------------------------
def run_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and is_run_dir(p)) if root.is_dir() else []


def listed_checkpoints(run_dir: Path) -> list[Path]:
    """What a reader of the checkpoints directory may pick: every entry whose name is not hidden."""
    d = run_dir / "checkpoints"
    return sorted(p for p in d.iterdir() if not p.name.startswith(".")) if d.is_dir() else []


def hidden_entries(run_dir: Path) -> list[str]:
    """Hidden files in a run directory and its checkpoints (the run's lock file aside)."""
    names = [p.name for p in run_dir.iterdir() if p.name.startswith(".") and p.name != ".lock"]
    d = run_dir / "checkpoints"
    if d.is_dir():
        names += [f"checkpoints/{p.name}" for p in d.iterdir() if p.name.startswith(".")]
    return sorted(names)


def loadable_steps(root: Path) -> dict[str, int]:
    """`{run/checkpoints/name: global_step}` of every listed checkpoint under `root`; each must load
    (a listed file is never torn)."""
    steps = {}
    for run in run_dirs(root):
        for path in listed_checkpoints(run):
            state = read_checkpoint(path)  # raises CheckpointError on a torn or foreign file
            steps[f"{run.name}/checkpoints/{path.name}"] = int(state["counters"]["global_step"])
    return steps


def read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def assert_same_end(ref: dict[str, Any], got: dict[str, Any], where: str) -> None:
    differing = [(k, ref["losses"].get(k), v) for k, v in sorted(got["losses"].items()) if ref["losses"].get(k) != v]
    assert not differing, (
        f"{where}: losses differ from the uninterrupted run's; (epoch, batch), ref, got: {differing[:3]}"
    )
    assert (got["global_step"], got["current_epoch"]) == (ref["global_step"], ref["current_epoch"]), where
    assert sorted(got["model"]) == sorted(ref["model"]), where
    bad = [k for k, t in ref["model"].items() if not torch.equal(t, got["model"][k])]
    assert not bad, f"{where}: weights differ: {bad}"
    assert sorted(got["optimizer"]) == sorted(ref["optimizer"]), where
    bad = [k for k, t in ref["optimizer"].items() if not torch.equal(t, got["optimizer"][k])]
    assert not bad, f"{where}: optimizer state differs: {bad}"
    assert got["lr"] == ref["lr"], where
    assert torch.equal(got["rng"], ref["rng"]), f"{where}: torch's RNG state differs at the end"


# --- the checks -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("trial", PLAN, ids=[t.id for t in PLAN])
def test_killed_runs_resume_exactly(trial: Trial, campaign: Path) -> None:
    chunk = launch_chunk(campaign, trial.chunk)
    results = chunk.results(trial)
    kills = trial.kill_specs
    d = chunk.out / trial.name
    assert len(results) == len(kills) + 1
    for i, kill in enumerate(kills):
        codes, rank = results[i]["codes"], kill["rank"]
        fired = read_json(d / f"run{i}.rank{rank}.fired")
        what = f"run {i} ({kill}) ended with {codes}, driver: {results[i]['stopped']}\n{chunk.describe(trial, i)}"
        assert "SIGKILL (timeout)" not in results[i]["stopped"], "a rank hung: " + what
        if fired is None:  # a resumed run may start past every moment of its phase
            assert i > 0, "the first run never reached its kill: " + what
            assert codes == [0] * trial.world, what
            continue
        signum = signal.Signals[kill["signal"]]
        if signum == signal.SIGKILL:
            assert codes[rank] == -signal.SIGKILL, what
        elif codes != [0] * trial.world:  # 0 everywhere: the signal came after the last step
            # The trainer's handler: every rank stops at the same step, a checkpoint, exit 128 + N. The first
            # rank to exit makes the driver (as torchrun) send SIGTERM to the others: one that has already
            # put the default handler back on its way out dies of it, harmlessly.
            late = {-signal.SIGTERM} if "SIGTERM" in results[i]["stopped"] else set()
            assert 128 + signum in codes and set(codes) <= {128 + signum} | late, what
        after = d / f"after{i}"
        if not after.exists():
            continue  # the signal came after the last step: the run finished
        steps = loadable_steps(after)  # no listed file is torn, whatever the kill interrupted
        runs = run_dirs(after)
        if signum != signal.SIGKILL:
            (run,) = [r for r in runs if read_record(r).get("status") == "interrupted"]
            signal_files = [p for p in listed_checkpoints(run) if p.name.startswith("signal-")]
            assert len(signal_files) == 1 and os.path.samefile(run / "checkpoints" / "last.ckpt", signal_files[0])
        elif kill["phase"] in ("save:write", "save:fsync", "save:rename"):  # the kill landed inside the save
            partial = [n for r in runs for n in hidden_entries(r) if ".ckpt.tmp-" in n]
            assert partial, f"the kill in a save left no partial file: {[hidden_entries(r) for r in runs]}"
        # The next run continues the newest complete checkpoint, in its run's directory (or, when there is
        # none, starts afresh in a new run directory).
        started = read_json(d / f"run{i + 1}.rank0.start")
        if started is not None:
            newest = max(steps, key=steps.__getitem__, default=None)
            expected = (0, None) if newest is None else (steps[newest], newest.split("/")[0])
            got = (started["start_step"], Path(started["run_dir"]).name)
            assert got[0] == expected[0], f"run {i + 1} resumed at {started}; checkpoints: {steps}"
            if newest is None:
                assert got[1] not in {r.name for r in runs}, f"run {i + 1} did not start a new run: {started}"
            else:
                assert got[1] == expected[1], f"run {i + 1} resumed in {started}; checkpoints: {steps}"

    last = len(kills)
    codes = results[last]["codes"]
    assert codes == [0] * trial.world, f"the last run failed: {codes}\n{chunk.describe(trial, last)}"
    final_run = None
    for rank in range(trial.world):
        ref = chunk.reference(trial.world, rank)
        got = torch.load(d / f"run{last}.rank{rank}.pt", weights_only=True)
        assert_same_end(ref, got, f"rank {rank}")
        final_run = Path(got["run_dir"])
    assert final_run is not None

    root = d / "root"
    loadable_steps(root)
    for run in run_dirs(root):
        assert hidden_entries(run) == [], f"{run.name}: partial files left behind"
        record = read_record(run)
        assert record.get("status") in FINAL_STATUSES, f"{run.name}: run.json says {record.get('status')!r}"
        open_resumes = [r for r in record.get("resumes", []) if "outcome" not in r]
        assert not open_resumes, f"{run.name}: resumes without an outcome: {open_resumes}"
    assert read_record(final_run)["status"] == "success"


@pytest.mark.parametrize("trial", PLAN, ids=[t.id for t in PLAN])
def test_killed_runs_log_every_step_once(trial: Trial, campaign: Path) -> None:
    chunk = launch_chunk(campaign, trial.chunk)
    results = chunk.results(trial)
    last = len(trial.kills)
    assert results[last]["codes"] == [0] * trial.world, chunk.describe(trial, last)
    final_run = Path(torch.load(chunk.out / trial.name / f"run{last}.rank0.pt", weights_only=True)["run_dir"])
    chunk.reference(trial.world, 0)
    ref_run = chunk.ref / f"world{trial.world}" / "root" / "version_0"
    for read in (csv_series, jsonl_series):
        expected, got = read(ref_run), read(final_run)
        assert [s for s, _ in expected["loss"]] == list(range(1, fc.TOTAL_STEPS + 1))
        steps = [s for s, _ in got.get("loss", [])]
        assert steps == list(range(1, fc.TOTAL_STEPS + 1)), f"{read.__name__}: training steps logged {steps}"
        # Also a validation the killed run never wrote (killed during it, stopped by a signal before it):
        # the resumed run runs it first.
        assert sorted(got) == sorted(expected), read.__name__
        for key, points in expected.items():
            assert [s for s, _ in got[key]] == [s for s, _ in points], (read.__name__, key)  # each step once
            assert got[key] == points, (read.__name__, key)
