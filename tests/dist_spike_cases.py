"""The bad-batch cases of test_distributed.py's `main` launch (2 processes), which tests/test_spikes_ddp.py
checks: `dist_worker.py` runs with `--bad-batch`/`--without-batch` and a spike policy (see its docstring)."""

from __future__ import annotations

from pathlib import Path

# One epoch of 12 steps of 2 x 4 samples, batch 5 bad on rank 1.
SPIKE_BAD_BATCH = 5


def spike_cases(directory: Path) -> list[tuple[str, tuple[str, ...]]]:
    """The bad-batch runs of a 2-process plan (`directory`: the plan's, for the resumed runs' roots): the clean
    run, skip and rollback of inputs x1e4 and of a NaN input, and a run of each policy cut at step 8 (after
    the bad step, checkpointed) then resumed."""
    base = ("--epochs", "1", "--n-train", "96", "--batch-size", "4", "--strategy", "ddp", "--relu")
    bad = (*base, "--bad-batch", str(SPIKE_BAD_BATCH), "--bad-rank", "1")
    nan = (*bad, "--bad-kind", "nan", "--non-finite-grads", "skip")
    cut = ("--max-steps", "8", "--save-every", "4")
    return [
        ("spike-clean", (*base, "--without-batch", str(SPIKE_BAD_BATCH))),
        ("spike-skip", (*bad, "--spike-policy", "skip")),
        ("spike-rollback", (*bad, "--spike-policy", "rollback", "--spike-every", "3")),
        ("nan-skip", (*nan, "--spike-policy", "skip")),
        ("nan-rollback", (*nan, "--spike-policy", "rollback", "--spike-every", "3")),
        ("spike-skip-cut", (*bad, "--spike-policy", "skip", *cut)),
        ("spike-skip-resumed", (*bad, "--spike-policy", "skip", "--root-dir", str(directory / "spike-skip-cut"),
                                "--resume")),
        ("spike-rollback-cut", (*bad, "--spike-policy", "rollback", "--spike-every", "2", *cut)),
        ("spike-rollback-resumed", (*bad, "--spike-policy", "rollback", "--spike-every", "2", "--root-dir",
                                    str(directory / "spike-rollback-cut"), "--resume")),
    ]  # fmt: skip
