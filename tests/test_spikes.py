"""Bad batches and loss spikes (docs/bad-batches.md): `trainer.snapshot()`/`restore()`, the spike
policies, the skip list (checkpoint, run.json) and `config.skip_batches`.

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
    return quiet_config(tmp_path, n_epochs=1, **kw)


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
    _assert_equal(_weights(trainer), clean)  # as if the loader had never yielded batch 5
    assert trainer.state_dict()["bad_batches"]["skipped"] == trainer.skipped_batches
    record = json.loads((trainer.run_dir / "run.json").read_text())
    assert [(e["epoch"], e["batch_idx"]) for e in record["skipped_batches"]] == [(0, BAD)]


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
