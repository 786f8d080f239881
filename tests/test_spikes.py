"""Bad batches and loss spikes (docs/bad-batches.md): `trainer.snapshot()`/`restore()`, the spike
policies, the skip list (checkpoint, run.json, the sample indices of each entry) and `config.skip_batches`.
Under DDP (a bad batch on one rank): tests/test_spikes_ddp.py.

The runs: an MLP, SGD with momentum, 12 batches of 4 samples in a fixed order; batch 5 is bad (inputs
x1e4: a finite spike; or one NaN input). The reference is the clean run whose loader never yields batch 5.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_config
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig
from dream_trainer.data import GlobalOrderSampler
from dream_trainer.errors import MisconfigurationError

BAD = 5


def _data(bad: str | None, without_bad: bool) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.5
    rows = slice(BAD * 4, BAD * 4 + 4)
    if bad == "spike":
        x[rows] = x[rows] * 1e4
    elif bad == "nan":
        x[BAD * 4, 0] = float("nan")
    if without_bad:
        keep = [i for i in range(48) if not (BAD * 4 <= i < BAD * 4 + 4)]
        x, y = x[keep], y[keep]
    return TensorDataset(x, y)


class MLP(DreamTrainer):
    def __init__(
        self, config: DreamTrainerConfig, bad: str | None = None, without_bad: bool = False, dropout: float = 0.0
    ) -> None:
        super().__init__(config)
        self.bad, self.without_bad = bad, without_bad
        torch.manual_seed(0)
        # (No dropout in the spike runs: "skip" runs the bad batch's forward, which would draw from the RNG.)
        self.model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 1))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def configure_dataloaders(self) -> tuple[Any, Any]:
        return DataLoader(_data(self.bad, self.without_bad), batch_size=4), None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.mse_loss(self.model(x), y)


def _config(tmp_path: Path, **kw: Any) -> DreamTrainerConfig:
    return quiet_config(tmp_path, **{"n_epochs": 1, **kw})


def _weights(trainer: DreamTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def _assert_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> list[torch.Tensor]:
    """Weights after the clean run: the loader never yields batch 5 (11 batches)."""
    trainer = MLP(_config(tmp_path_factory.mktemp("clean")), without_bad=True)
    trainer.fit()
    return _weights(trainer)


# --- trainer.snapshot() / restore() (issue 37) ------------------------------------------------------------
def test_restore_then_training_again_is_training_once_from_the_snapshot(tmp_path: Path) -> None:
    trainer = MLP(_config(tmp_path), dropout=0.1)
    trainer.snapshot()  # sets the trainer up
    batches = list(trainer.train_loader)  # (iterating a DataLoader draws from the RNG: before the snapshot)
    snap = trainer.snapshot()  # the model has dropout: the RNG is in the snapshot
    for i, batch in enumerate(batches[:3]):
        trainer.training_step(batch, i)
    once = _weights(trainer)
    momentum = trainer.optimizer.state_dict()["state"][0]["momentum_buffer"].clone()
    trainer.restore(snap)
    assert trainer.global_step == 0 and "momentum_buffer" not in trainer.optimizer.state_dict()["state"].get(0, {})
    for i, batch in enumerate(batches[:3]):
        trainer.training_step(batch, i)
    _assert_equal(_weights(trainer), once)
    assert torch.equal(trainer.optimizer.state_dict()["state"][0]["momentum_buffer"], momentum)
    assert trainer.global_step == 3
    with pytest.raises(ValueError, match="snapshot"):
        MLP(_config(tmp_path)).restore(snap)


# --- spike policies ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["spike", "nan"])
@pytest.mark.parametrize("policy", ["warn", "skip", "rollback"])
def test_each_policy_detects_the_bad_batch_at_its_step(
    tmp_path: Path, clean: list[torch.Tensor], bad: str, policy: str
) -> None:
    # ("warn" trains on the bad batch: its weights go NaN, which the logged-loss check would stop.)
    trainer = MLP(_config(tmp_path, spike_policy=policy, spike_snapshot_every=3, non_finite_loss="ignore"), bad=bad)
    with pytest.warns(UserWarning, match="loss spike at epoch 0, batch 5"):
        trainer.fit()
    assert trainer.spikes[0]["epoch"] == 0 and trainer.spikes[0]["batch_idx"] == BAD
    assert trainer.spikes[0]["global_step"] == BAD  # the bad batch's own step, not a later one
    if policy == "warn":
        assert trainer.skipped_batches == []
        return
    assert [(e["epoch"], e["batch_idx"], e["reason"]) for e in trainer.skipped_batches] == [(0, BAD, "spike")]
    assert trainer.skipped_batches[0]["sample_indices"] == [20, 21, 22, 23]  # batch 5 of 4, in order
    _assert_equal(_weights(trainer), clean)  # as if the loader had never yielded batch 5
    assert trainer.state_dict()["bad_batches"]["skipped"] == trainer.skipped_batches
    record = json.loads((trainer.run_dir / "run.json").read_text())
    assert [(e["epoch"], e["batch_idx"], e["sample_indices"]) for e in record["skipped_batches"]] == [
        (0, BAD, [20, 21, 22, 23])
    ]


@pytest.mark.parametrize("policy", ["skip", "rollback"])
def test_a_resume_after_the_bad_step_ends_like_the_clean_run(
    tmp_path: Path, clean: list[torch.Tensor], policy: str
) -> None:
    first = MLP(_config(tmp_path / "a", spike_policy=policy, spike_snapshot_every=2, max_steps=8), bad="spike")
    with pytest.warns(UserWarning, match="loss spike"):
        first.fit()
    path = tmp_path / "after_bad.ckpt"
    first.save_checkpoint(path)
    resumed = MLP(_config(tmp_path / "b", spike_policy=policy, spike_snapshot_every=2), bad="spike")
    resumed.fit(ckpt_path=path)
    _assert_equal(_weights(resumed), clean)
    assert [(e["epoch"], e["batch_idx"]) for e in resumed.skipped_batches] == [(0, BAD)]


def test_non_finite_skip_records_the_batch(tmp_path: Path, clean: list[torch.Tensor]) -> None:
    trainer = MLP(_config(tmp_path, non_finite_grads="skip"), bad="nan")
    trainer.fit()
    _assert_equal(_weights(trainer), clean)
    assert [(e["epoch"], e["batch_idx"], e["reason"]) for e in trainer.skipped_batches] == [(0, BAD, "non_finite")]


def test_a_user_skip_list_means_the_loader_never_yields_those_batches(
    tmp_path: Path, clean: list[torch.Tensor]
) -> None:
    trainer = MLP(_config(tmp_path, skip_batches=[[0, BAD]]), bad="spike")
    trainer.fit()
    _assert_equal(_weights(trainer), clean)
    # A previous run's run.json works as the list too.
    (tmp_path / "prev.json").write_text(json.dumps({"skipped_batches": [{"epoch": 0, "batch_idx": BAD}]}))
    again = MLP(_config(tmp_path, skip_batches=str(tmp_path / "prev.json")), bad="nan")
    again.fit()
    _assert_equal(_weights(again), clean)


# --- the sample indices of a skipped batch ---------------------------------------------------------------
class Indexed(MLP):
    """MLP over 2 epochs of 12 batches whose samples carry their dataset index (recorded per batch in
    `seen`), read in `order`; sample `nan_at` has a NaN input (non_finite_grads="skip" drops its step).
    Each step draws from the global RNG (`draws`), as dropout would."""

    def __init__(self, config: DreamTrainerConfig, order: str, nan_at: int | None = None) -> None:
        super().__init__(config)
        self.order, self.nan_at = order, nan_at
        self.seen: dict[tuple[int, int], list[int]] = {}
        self.draws: list[float] = []

    def configure_dataloaders(self) -> tuple[Any, Any]:
        data = _data(None, False)
        x = data.tensors[0].clone()
        if self.nan_at is not None:
            x[self.nan_at, 0] = float("nan")
        ds = TensorDataset(x, data.tensors[1], torch.arange(48))
        if self.order == "sequential":
            return DataLoader(ds, batch_size=4), None
        if self.order == "shuffle":  # a RandomSampler drawing from the global RNG
            return DataLoader(ds, batch_size=4, shuffle=True), None
        if self.order == "generator":  # ... from the loader's own generator
            return DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7)), None
        return DataLoader(ds, batch_size=4, sampler=GlobalOrderSampler(ds, seed=3)), None  # a DistributedSampler

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y, index = batch
        self.seen[(self.current_epoch, batch_idx)] = index.tolist()
        self.draws.append(float(torch.rand(())))
        return F.mse_loss(self.model(x), y)


@pytest.mark.parametrize("order", ["sequential", "shuffle", "generator", "global"])
def test_the_skip_list_names_the_sample_indices_of_the_skipped_batch(tmp_path: Path, order: str) -> None:
    reference = Indexed(_config(tmp_path / "ref", n_epochs=2), order)
    reference.fit()
    bad = reference.seen[(0, 8)][1]  # a sample of epoch 0's batch 8 in this order
    # The batches holding it, epoch 0's batch 8 and one of epoch 1's, with their samples.
    expected = [(e, b, samples) for (e, b), samples in sorted(reference.seen.items()) if bad in samples]
    assert len(expected) == 2 and expected[0][:2] == (0, 8)
    trainer = Indexed(_config(tmp_path / "run", n_epochs=2, non_finite_grads="skip"), order, nan_at=bad)
    trainer.fit()
    assert [(e["epoch"], e["batch_idx"], e["sample_indices"]) for e in trainer.skipped_batches] == expected
    record = json.loads((trainer.run_dir / "run.json").read_text())
    assert [e["sample_indices"] for e in record["skipped_batches"]] == [samples for _, _, samples in expected]
    # Working the indices out replayed the epoch's order from its RNG, then put the RNG back: every later
    # batch (the next epoch's order) and every draw is the one of the run without a bad sample.
    assert trainer.seen == reference.seen and trainer.draws == reference.draws
    # A run resumed mid-epoch (at step 4, before the bad batch) names the same samples.
    first = Indexed(_config(tmp_path / "a", non_finite_grads="skip", max_steps=4), order, nan_at=bad)
    first.fit()
    first.save_checkpoint(tmp_path / "step4.ckpt")
    resumed = Indexed(_config(tmp_path / "b", n_epochs=2, non_finite_grads="skip"), order, nan_at=bad)
    resumed.fit(ckpt_path=tmp_path / "step4.ckpt")
    assert [(e["epoch"], e["batch_idx"], e["sample_indices"]) for e in resumed.skipped_batches] == expected
    assert resumed.state_dict()["bad_batches"]["skipped"] == resumed.skipped_batches


def test_skip_and_rollback_run_under_ddp_and_are_refused_under_fsdp_naming_ddp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    for policy in ("skip", "rollback"):
        MLP(_config(tmp_path, spike_policy=policy, strategy="ddp"))  # constructed (fit() would join the group)
        refused = rf"^spike_policy='{policy}' runs on one process or under strategy='ddp', not strategy='fsdp'"
        with pytest.raises(MisconfigurationError, match=refused):
            MLP(_config(tmp_path, spike_policy=policy, strategy="fsdp"))


def test_the_loggers_get_how_many_batches_were_dropped_and_which(tmp_path: Path) -> None:
    from dream_trainer.loggers import MemoryLogger

    memory = MemoryLogger()
    trainer = MLP(_config(tmp_path, spike_policy="skip", log_every_n_steps=2, loggers=[memory]), bad="spike")
    with pytest.warns(UserWarning, match="loss spike at epoch 0, batch 5"):
        trainer.fit()
    # Batch 5 is step 6's: the logging points from step 6 on carry it.
    assert memory.series("skipped_batches") == [(6, 1.0), (8, 1.0), (10, 1.0), (12, 1.0)]
    assert memory.series("skipped_batches/last_epoch") == [(6, 0.0), (8, 0.0), (10, 0.0), (12, 0.0)]
    assert memory.series("skipped_batches/last_batch_idx") == [(6, 5.0), (8, 5.0), (10, 5.0), (12, 5.0)]


@pytest.mark.parametrize("bad", ["spike", "nan"])
def test_a_rollback_never_sends_the_loggers_a_step_it_discards(tmp_path: Path, bad: str) -> None:
    # The steps after the snapshot that reach the spike are trained again without it: what they logged
    # the first time is never sent (it waits until the snapshot point after it, or the epoch's end). The
    # loggers get the rows of the run whose loader never yielded the bad batch, each step once, in order.
    # The logging points between the spike and the rollback read a NaN/inf loss: with the default
    # non_finite_loss="raise" the run goes on, as the rollback undoes those steps.
    from dream_trainer.loggers import MemoryLogger

    rolled, clean = MemoryLogger(), MemoryLogger()
    config = {"log_every_n_steps": 1}
    rollback = {"spike_policy": "rollback", "spike_snapshot_every": 4}
    trainer = MLP(_config(tmp_path / "a", loggers=[rolled], **rollback, **config), bad=bad)
    with pytest.warns(UserWarning, match="loss spike at epoch 0, batch 5"):
        trainer.fit()
    MLP(_config(tmp_path / "b", skip_batches=[[0, BAD]], loggers=[clean], **config), bad=bad).fit()
    steps = [step for step, _ in rolled.series("loss")]
    assert steps == list(range(1, 12))  # 11 steps, each logged once
    assert rolled.series("loss") == clean.series("loss")
    assert rolled.series("loss_epoch") == clean.series("loss_epoch")
    assert rolled.status == "success"
