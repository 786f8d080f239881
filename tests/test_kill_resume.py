"""A run SIGKILLed at any point and resumed from its last checkpoint ends bit-exactly where an
uninterrupted run ends (DESIGN.md, Checkpoints).

Each case runs `kill_resume_worker.py` as a script, each run in a new process (`helpers.run_python_forked`:
forked from a server that has imported torch and dream_trainer and run nothing, so each run costs its
training, not ~3 s of imports):

- A: uninterrupted (computed once per training configuration and shared by the xdist workers);
- B: the same run, killed with SIGKILL at the case's kill point (no handler, no cleanup: returncode -9);
- C: a fresh process in B's directory resuming with `fit(ckpt_path="last")`.

C's final weights, optimizer state, LR, global step and RNG state must be `torch.equal` to A's, and
every batch C trained on must have produced exactly A's loss. C must also really have resumed where
expected (a run that silently started from scratch would match A too).

The worker's run: 64 samples in shuffled batches of 8 (8 batches per epoch, the order drawn from the
global RNG), 3 epochs, Dropout, AdamW, StepLR, a validation loader; with accumulation 3 an epoch has
3 steps (windows of 3, 3 and 2 batches), otherwise 8.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import file_lock, run_python_forked, xdist_shared_dir

WORKER = Path(__file__).with_name("kill_resume_worker.py")
BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "checkpoint.py"
TIMEOUT = 60


@dataclass(frozen=True)
class Case:
    id: str
    training: tuple[str, ...]  # what decides the result (the reference run is keyed by it)
    variant: tuple[str, ...]  # checkpoint cadence and kind, loader workers: must not change the result
    kill: tuple[str, ...]
    resumes_at: tuple[tuple[int, int], ...]  # the (epoch, batch_idx) C may start at


BASE: tuple[str, ...] = ()
ACCUM = ("--accum", "3", "--scheduler", "step")
BF16 = ("--precision", "bf16")
FP16 = ("--precision", "fp16")
VAL_STEPS = ("--val-every-n-steps", "3")

CASES = [
    # checkpoints at steps 3, 6; killed at step 5 -> resumes mid-epoch 0 after batch 2
    Case("mid_epoch", BASE, ("--every-n-steps", "3"), ("--kill-at-step", "5"), ((0, 3),)),
    # killed right after the step-6 checkpoint is written (at the batch boundary, after every
    # on_train_batch_end): as batch 6 starts
    Case(
        "right_after_save",
        BASE,
        ("--every-n-steps", "3"),
        ("--kill-at-batch", "6", "--kill-in", "batch_start"),
        ((0, 6),),
    ),
    # killed in the on_train_batch_end of step 6, whose checkpoint is due at the boundary after it
    Case("before_the_save_at_its_step", BASE, ("--every-n-steps", "3"), ("--kill-at-step", "6"), ((0, 3),)),
    # the step-8 checkpoint is written after the last batch of epoch 0 and its validation, before the
    # epoch ends (its scheduler step is still to come); save_top_k=1 deletes older files
    Case(
        "save_on_last_batch_top_k_1",
        BASE,
        ("--every-n-steps", "4", "--save-top-k", "1"),
        ("--kill-at-step", "10"),
        ((1, 0),),
    ),
    # resume from step 15 (epoch 1, after batch 6), then cross the epoch boundary in the resumed run
    Case("resume_across_epoch_end", BASE, ("--every-n-steps", "5"), ("--kill-at-step", "19"), ((1, 7),)),
    # killed in epoch 2, after two epoch boundaries (two StepLR steps, two reshuffles); resumes at step 20
    Case("epoch_2_after_boundary", BASE, ("--every-n-steps", "4"), ("--kill-at-step", "22"), ((2, 4),)),
    # checkpoints from on_train_epoch_end (ModelCheckpoint's default cadence); resumes at the start of
    # epoch 1, after the sanity check that every fit() runs (iterating a DataLoader draws from the RNG)
    Case("epoch_end_checkpoint", BASE, ("--every-n-epochs", "1"), ("--kill-at-step", "10"), ((1, 0),)),
    # validation every 3 steps, which runs before the step-3 and step-6 checkpoints are written (at the
    # batch boundary after it), so the resumed run does not repeat it
    Case("val_every_n_steps", VAL_STEPS, ("--every-n-steps", "3"), ("--kill-at-step", "5"), ((0, 3),)),
    # killed when batch 13 (epoch 1, batch 5) starts; last checkpoint at step 12; two loader workers
    Case(
        "before_batch_starts_loader_workers",
        BASE,
        ("--every-n-steps", "3", "--num-workers", "2"),
        ("--kill-at-batch", "13", "--kill-in", "batch_start"),
        ((1, 4),),
    ),
    # background writes: the kill may land before the step-6 file is durable, then step 3 is the last
    Case(
        "async_right_after_save",
        BASE,
        ("--every-n-steps", "3", "--async-ckpt"),
        ("--kill-at-batch", "6", "--kill-in", "batch_start"),
        ((0, 6), (0, 3)),
    ),
    # accumulation 3, checkpoints at window ends (steps 2, 4, 6); killed at batch 12 (epoch 1, batch 4),
    # two micro-batches into the window of batches 3-5; per-step scheduler
    Case("inside_accumulation_window", ACCUM, ("--every-n-steps", "2"), ("--kill-at-batch", "12"), ((1, 3),)),
    Case("bf16", BF16, ("--every-n-steps", "3"), ("--kill-at-step", "7"), ((0, 6),)),
    # fp16 with a GradScaler; killed after step 13's backward, before its optimizer step
    Case(
        "fp16_inside_optimizer_step",
        FP16,
        ("--every-n-steps", "3"),
        ("--kill-at-step", "13", "--kill-in", "optimizer_step"),
        ((1, 4),),
    ),
]


def run_worker(*args: str) -> subprocess.CompletedProcess[str]:
    """`python kill_resume_worker.py *args` in a new process (see the module docstring)."""
    return run_python_forked(str(WORKER), *args, timeout=TIMEOUT)


def _describe(proc: subprocess.CompletedProcess[str]) -> str:
    return f"returncode {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="session")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where uninterrupted runs are cached: shared by the xdist workers of this run, never across runs."""
    return xdist_shared_dir(tmp_path_factory, "kill-resume-ref")


def uninterrupted(reference_dir: Path, training: tuple[str, ...]) -> dict[str, Any]:
    """A's final state for this training configuration, computed once per test run."""
    key = "-".join(a.lstrip("-") for a in training) or "base"
    out = reference_dir / f"{key}.pt"
    with file_lock(reference_dir / f"{key}.lock"):
        if not out.exists():
            proc = run_worker("--root-dir", str(reference_dir / key), "--out", str(out), *training)
            assert proc.returncode == 0, "the uninterrupted run failed: " + _describe(proc)
    return torch.load(out, weights_only=True)


def assert_same_end(ref: dict[str, Any], got: dict[str, Any]) -> None:
    """Bit-exact equality of two final states; names the first batch and the tensors that differ."""
    differing_losses = [
        (k, ref["losses"].get(k), v) for k, v in sorted(got["losses"].items()) if ref["losses"].get(k) != v
    ]
    assert not differing_losses, (
        "the resumed run's losses differ from the uninterrupted run's; first (epoch, batch_idx), "
        f"reference, resumed: {differing_losses[:3]}"
    )
    assert got["global_step"] == ref["global_step"]
    assert got["current_epoch"] == ref["current_epoch"]
    bad = [n for n, t in ref["model"].items() if not torch.equal(t, got["model"][n])]
    assert not bad, f"weights differ: {bad}"
    assert sorted(got["model"]) == sorted(ref["model"])
    assert sorted(got["optimizer"]) == sorted(ref["optimizer"])
    bad = [n for n, t in ref["optimizer"].items() if not torch.equal(t, got["optimizer"][n])]
    assert not bad, f"optimizer state differs: {bad}"
    assert got["lr"] == ref["lr"]
    assert got["grad_scale"] == ref["grad_scale"]
    assert torch.equal(got["rng"], ref["rng"]), "torch's global RNG state differs at the end"


@pytest.mark.slow  # 31 runs in new processes, ~1 s each once forked with torch imported
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_sigkill_then_resume_is_bit_exact(case: Case, tmp_path: Path, reference_dir: Path) -> None:
    ref = uninterrupted(reference_dir, case.training)
    root, out = str(tmp_path / "run"), str(tmp_path / "final.pt")
    args = ("--root-dir", root, *case.training, *case.variant)

    killed = run_worker(*args, "--out", str(tmp_path / "never.pt"), *case.kill)
    assert killed.returncode == -9, "the run was not SIGKILLed: " + _describe(killed)
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "version_0" / "checkpoints").glob("*.ckpt"))
    assert checkpoints, "the killed run left no checkpoint"

    resumed = run_worker(*args, "--out", out, "--resume")
    assert resumed.returncode == 0, "the resumed run failed: " + _describe(resumed)
    got = torch.load(out, weights_only=True)

    first = min(got["losses"])
    assert first in case.resumes_at, (
        f"the resumed run started at (epoch, batch_idx) {first}, expected one of {case.resumes_at}; "
        f"checkpoints: {checkpoints}"
    )
    assert_same_end(ref, got)


def test_checkpoint_benchmark_quick(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("checkpoint_benchmark", BENCHMARK)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--quick", "--dir", str(tmp_path)])
    json.dumps(result)  # plain numbers and strings
    for key in ("save_ratio", "load_ratio", "async_block_ratio"):
        assert result[key] > 0
    assert result["file_bytes"] > 0
    assert not list(tmp_path.glob("*.ckpt")), "the benchmark leaves no files behind"
