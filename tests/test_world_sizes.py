"""Resume at any world size: a checkpoint written mid-epoch on N processes continues on M (2 -> 1, 2 -> 3,
3 -> 2, 4 -> 2, 1 -> 2), every global batch after the resume holding exactly the samples of the
uninterrupted run's, no sample repeated or skipped, the weights, the optimizer state and the logged epoch
means those of the uninterrupted run.

The runs are the `world_sizes` part of the one four-rank launch (tests/four_rank_worker.py,
tests/world_size_worker.py, which says what each run is).

Across world sizes the weights match to float rounding, not bit for bit: W ranks average W means of
12 / W samples' gradients (an all-reduce), so the sums round differently from the first step on. The
tolerance (rtol 1e-5, atol 1e-6) is about a thousandth of one step's change of these weights (AdamW at lr
0.01); a sample skipped, repeated or moved to another step changes them by far more (the ledger says
which first). The samples, their global batches and the number of steps are compared exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import four_rank_launch

sys.path.insert(0, str(Path(__file__).parent))

import world_size_worker as worker

ROUNDING = {"rtol": 1e-5, "atol": 1e-6}  # across world sizes (module docstring)
STEPS = worker.EPOCHS * worker.N_SAMPLES // worker.GLOBAL_BATCH


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    part, log = four_rank_launch(tmp_path_factory, "world_sizes")
    text = log.read_text()
    assert text.startswith("exit code 0"), text
    return part


def _load(out: Path, name: str) -> dict[str, Any]:
    return torch.load(out / f"{name}.pt", weights_only=False)


def _assert_close(got: Any, expected: Any, what: str) -> None:
    if isinstance(expected, dict):
        assert set(got) == set(expected), what
        for key in expected:
            _assert_close(got[key], expected[key], f"{what}.{key}")
    elif isinstance(expected, torch.Tensor):
        torch.testing.assert_close(got, expected, **ROUNDING, msg=lambda m: f"{what}: {m}")
    else:
        assert got == expected, what


def test_every_world_size_trains_on_the_same_global_batches(out: Path) -> None:
    writers = [(strategy, world) for strategy, world in worker.WRITERS if strategy != "shards"]
    runs = {f"{strategy} on {world}": _load(out, worker.name(strategy, world)) for strategy, world in writers}
    reference = runs["ddp on 1"]["ledger"]
    assert sorted(reference) == list(range(STEPS))
    for epoch in range(worker.EPOCHS):  # every sample once an epoch
        per_epoch = STEPS // worker.EPOCHS
        ids = [i for step in range(epoch * per_epoch, (epoch + 1) * per_epoch) for i in reference[step]]
        assert sorted(ids) == list(range(worker.N_SAMPLES)), f"epoch {epoch}"
    assert all(len(batch) == worker.GLOBAL_BATCH for batch in reference.values())
    for what, run in runs.items():
        assert what.endswith(f" on {run['world_size']}")
        assert run["ledger"] == reference, f"{what} trained on other global batches than one process"
        _assert_close(run["weights"], runs["ddp on 1"]["weights"], f"weights, {what}")


def test_shard_files_give_each_world_size_its_own_global_batches_and_every_sample_once_an_epoch(out: Path) -> None:
    # A step's samples are the next ones of each rank's files: which samples depends on the number of ranks
    # (hence the parts a resume keeps), while each epoch still reads every sample once.
    ledgers = {world: _load(out, worker.name("shards", world))["ledger"] for world in (1, 2, 3, 4)}
    per_epoch = STEPS // worker.EPOCHS
    for world, ledger in ledgers.items():
        assert sorted(ledger) == list(range(STEPS)), world
        assert all(len(batch) == worker.GLOBAL_BATCH for batch in ledger.values()), world
        for epoch in range(worker.EPOCHS):
            ids = [i for step in range(epoch * per_epoch, (epoch + 1) * per_epoch) for i in ledger[step]]
            assert sorted(ids) == list(range(worker.N_SAMPLES)), (world, epoch)
    assert ledgers[1] != ledgers[2] != ledgers[3] != ledgers[4]


@pytest.mark.parametrize(("strategy", "written", "resumed", "accumulation"), worker.RESUMES, ids=lambda v: str(v))
def test_a_mid_epoch_checkpoint_continues_exactly_on_another_number_of_processes(
    out: Path, strategy: str, written: int, resumed: int, accumulation: int
) -> None:
    whole = _load(out, worker.name(strategy, written))
    run = _load(out, worker.name(strategy, written, resumed))
    mid = worker.MID[written]
    assert run["world_size"] == resumed and run["global_step"] == STEPS
    # After the resume: the global batches of the uninterrupted run, step by step; none before it.
    assert sorted(run["ledger"]) == list(range(mid, STEPS))
    assert run["ledger"] == {step: ids for step, ids in whole["ledger"].items() if step >= mid}
    _assert_close(run["weights"], whole["weights"], "weights")
    _assert_close(run["optimizer"], whole["optimizer"], "optimizer state")
    # The epoch's logged mean loss covers its steps before the checkpoint too (the checkpoint's ranks'
    # accumulation, added up): the uninterrupted run's, for the epoch of the resume and the next.
    resumed_epoch = mid // (STEPS // worker.EPOCHS)
    expected_losses = whole["epoch_losses"][resumed_epoch:]
    assert run["epoch_losses"] == pytest.approx(expected_losses, rel=1e-5)
    # The samples per optimizer step were kept (GLOBAL_BATCH // M per rank, or accumulated): no warning.
    assert not [m for m in run["warnings"] if "samples per optimizer step" in m], run["warnings"]
    if written != resumed:  # the RNG state is rank 0's: said once
        assert any("every rank continues from rank 0's RNG state" in m for m in run["warnings"]) == (written > 1)


def test_merged_metric_states_weigh_each_step_as_the_uninterrupted_run_did() -> None:
    from dream_trainer.utils.aggregation import MetricAggregator, merged_state

    # Two ranks, two steps each before the checkpoint: a returned loss (weight 1) and an accuracy logged with
    # the batch size as its weight; one logging point folded the first step into the (reduced) totals.
    ranks = [MetricAggregator(), MetricAggregator()]
    for rank, (loss, acc) in enumerate([(1.0, 0.5), (3.0, 0.25)]):
        ranks[rank].update({"loss": loss})
        ranks[rank].update({"acc": acc}, weight=4)
    totals = {"loss": 4.0, "acc": 3.0}, {"loss": 2.0, "acc": 8.0}  # (sums, weights) over both ranks
    states = [r.state_dict() for r in ranks]
    for state in states:
        state["totals"], state["total_weights"] = dict(totals[0]), dict(totals[1])
    # On one process (scale 1/2: a step records one loss now, two then), the first rank's new aggregator.
    resumed = MetricAggregator()
    resumed.load_state_dict(merged_state(states, scale=0.5))
    resumed.update({"loss": 5.0})  # one step after the resume: its loss and its 8 samples' accuracy
    resumed.update({"acc": 1.0}, weight=8)
    # The uninterrupted run's epoch means: the mean of the 3 steps' mean losses (2, 2, 5), and the
    # sample-weighted accuracy (weighted sums 3, 3 and 8 over 8 samples a step).
    assert resumed.totals() == pytest.approx({"loss": 3.0, "acc": (3.0 + 0.5 * 4 + 0.25 * 4 + 8.0) / 24})
    assert merged_state([]) == {"pending": {}, "totals": {}, "total_weights": {}, "weighted": []}


def test_a_token_stream_read_by_one_loader_worker_continues_mid_pass_from_the_cursor(tmp_path: Path) -> None:
    # One process, a DataLoader with one worker over a TokenDataset: no loader state of its own, yet the
    # resume continues the pass where the checkpoint was (the worker starts at the rank's cursor).
    import numpy as np

    tokens = tmp_path / "tokens.bin"
    np.arange(worker.N_SAMPLES * worker.SEQ_LEN + 1, dtype=np.uint16).tofile(tokens)

    whole, resumed, _ = worker.one_process_resume(tmp_path, tokens=tokens)
    assert [ids for _, ids in resumed.record] == [ids for _, ids in whole.record][5:]
    for name, expected in whole.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], expected), name


def test_a_token_stream_read_by_several_workers_per_rank_is_refused_on_other_ranks_naming_why(
    out: Path, tmp_path: Path
) -> None:
    from dream_trainer.errors import CheckpointError

    trainer = worker.Run(worker.config(tmp_path), tokens=out / "tokens-rank0.bin")
    trainer.num_workers = 2  # (an instance attribute: the checkpoint's trainer class is Run)
    with pytest.raises(CheckpointError) as info:
        trainer.load_checkpoint(out / "stream-a2-mid.ckpt")  # 2 ranks' checkpoint, on one process
    first = str(info.value).splitlines()[0]
    assert len(first) < 300, first
    assert first == (
        "this checkpoint, written mid-epoch by 2 process(es), cannot continue its epoch on 1: each rank reads the "
        "stream (TokenDataset) with 2 loader workers, so a step's samples depend on workers x ranks; read it with "
        "num_workers=0 or 1, or resume on 2 process(es)."
    )
