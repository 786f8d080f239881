"""Loss spikes under DDP (docs/bad-batches.md, "Several processes"): 2 processes (gloo), a bad batch on
rank 1 only, `spike_policy` "skip" and "rollback". Every rank drops the same batch index (or rolls back
past it), so the final weights are bit-exact those of the clean run, whose loaders never yield that batch
index on any rank; the skip list (every rank's, the checkpoint's, run.json's) names the batch, the rank
whose loss spiked and each rank's samples; the loggers count it.

The runs are cases of test_distributed.py's `main` launch (`dist_spike_cases.py`): a ReLU MLP, one
epoch of 12 steps of 2 x 4 unshuffled samples (rank r's batch k is samples r + 2 * (4k + j)), batch 5
of rank 1 bad: its inputs x1e4, or one NaN input with `non_finite_grads="skip"`.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from dist_spike_cases import SPIKE_BAD_BATCH
from test_distributed import Launch, assert_equal_weights, main, single  # noqa: F401  (the launch's fixtures)

pytestmark = pytest.mark.slow  # cases of the shared `main` torchrun launch

RANK_SAMPLES = [[40, 42, 44, 46], [41, 43, 45, 47]]  # batch 5 of each rank
ENTRY = {"epoch": 0, "batch_idx": SPIKE_BAD_BATCH, "global_step": SPIKE_BAD_BATCH, "ranks": [1]}


def _assert_names_the_batch(entries: list[dict[str, Any]], reason: str) -> None:
    assert len(entries) == 1, entries
    entry = entries[0]
    assert {k: entry[k] for k in ENTRY} == ENTRY and entry["reason"] == reason
    assert entry["sample_indices_per_rank"] == RANK_SAMPLES
    assert entry["sample_indices"] == RANK_SAMPLES[0] + RANK_SAMPLES[1]


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("spike-skip", "spike"),
        ("spike-rollback", "spike"),
        ("nan-skip", "spike"),
        ("nan-rollback", "non_finite"),  # the NaN gradients dropped the step before the rollback read the spike
    ],
)
def test_a_bad_batch_on_one_rank_is_dropped_on_every_rank_as_if_no_loader_yielded_it(
    main: Launch,  # noqa: F811
    case: str,
    reason: str,
) -> None:
    clean, got = main.result("spike-clean"), main.result(case)
    assert_equal_weights(got["weights"], clean["weights"])
    assert got["global_step"] == (11 if "rollback" in case else 12)  # "skip" counts the dropped step
    _assert_names_the_batch(got["skipped_batches"], reason)
    info = main.info(case)
    assert info[0]["skipped_batches"] == info[1]["skipped_batches"] == got["skipped_batches"]  # every rank agreed
    action = "skipped" if "skip" in case else "rolled back"
    assert got["spikes"] == [{**{k: ENTRY[k] for k in ("epoch", "batch_idx", "global_step")}, "action": action,
                              "ranks": [1]}]  # fmt: skip
    record = json.loads((main.root(case) / "run" / "run.json").read_text())
    assert record["skipped_batches"] == got["skipped_batches"]
    # The loggers count the skipped batches from the step after it on.
    logged = got["skipped_logged"]
    assert logged and logged[-1] == (got["global_step"], 1.0) and {v for _, v in logged} == {1.0}


@pytest.mark.parametrize("policy", ["skip", "rollback"])
def test_a_ddp_run_resumed_from_a_checkpoint_after_the_bad_step_ends_like_the_clean_run(
    main: Launch,  # noqa: F811
    policy: str,
) -> None:
    cut, resumed = main.result(f"spike-{policy}-cut"), main.result(f"spike-{policy}-resumed")
    assert cut["global_step"] == 8 and resumed["start_step"] == 8
    assert_equal_weights(resumed["weights"], main.result("spike-clean")["weights"])
    checkpoint = torch.load(
        main.root(f"spike-{policy}-cut") / "run" / "checkpoints" / "epoch=0-step=8.ckpt", weights_only=True
    )
    _assert_names_the_batch(checkpoint["bad_batches"]["skipped"], "spike")
    assert resumed["skipped_batches"] == checkpoint["bad_batches"]["skipped"]
