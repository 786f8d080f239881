"""The `fault_tolerance` setting in one process, no lighthouse: what it takes, what it refuses (naming what to use),
and where; its global order. The replica groups themselves run in tests/test_fault_tolerance.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import TinyTrainer, quiet_config
from torch.utils.data import DataLoader, IterableDataset

from dream_trainer import CheckpointError, ConfigError, DreamTrainerConfig, FaultToleranceConfig, MisconfigurationError
from dream_trainer.data import GlobalOrderSampler
from dream_trainer.fault_tolerance import SampleCursor

FT = FaultToleranceConfig(lighthouse="http://127.0.0.1:1", replica_id="0")


def test_the_setting_takes_a_config_or_a_dict_and_is_saved_as_plain_values() -> None:
    config = DreamTrainerConfig(fault_tolerance={"replica_id": "3", "min_replicas": 2})
    assert config.fault_tolerance == FaultToleranceConfig(replica_id="3", min_replicas=2)
    assert config.to_dict()["fault_tolerance"]["min_replicas"] == 2
    assert DreamTrainerConfig().fault_tolerance is None


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ({"replica": "0"}, "unknown field(s) ['replica']"),
        ({"min_replicas": 0}, "fault_tolerance.min_replicas = 0 is invalid"),
        ({"timeout_s": -1}, "fault_tolerance.timeout_s = -1 is invalid"),
        ({"lighthouse": ""}, "fault_tolerance.lighthouse = '' is invalid"),
        ("yes", "expected None (off), a FaultToleranceConfig or a dict"),
    ],
)
def test_a_bad_setting_is_refused_when_the_config_is_built(value: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=None) as exc:
        DreamTrainerConfig(fault_tolerance=value)
    assert says in str(exc.value)


@pytest.mark.parametrize(
    ("field", "value", "instead"),
    [
        ("strategy", "fsdp", "use strategy='auto', 'single' or 'ddp'"),
        ("gradient_accumulation_steps", 2, "use 1"),
        ("non_finite_grads", "retry", "use 'ignore', 'skip' or 'error'"),
        ("spike_policy", "rollback", "use 'off' or 'warn'"),
        ("limit_train_batches", 4, "use None"),
    ],
)
def test_what_it_does_not_support_is_refused_naming_what_to_use(field: str, value: Any, instead: str) -> None:
    with pytest.raises(ConfigError) as exc:
        DreamTrainerConfig(fault_tolerance=FT, **{field: value})
    line = str(exc.value).splitlines()[0]
    assert f"DreamTrainerConfig.{field} = {value!r} is not supported with fault_tolerance: {instead}" in line
    assert len(line) < 300


class _Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Any:
        return iter(torch.zeros(8, 4))


def test_a_stream_loader_is_refused_at_setup_before_any_lighthouse_is_reached(tmp_path: Any) -> None:
    class StreamTrainer(TinyTrainer):
        def configure_dataloaders(self) -> Any:
            return DataLoader(_Stream(), batch_size=2), None

    trainer = StreamTrainer(quiet_config(tmp_path, fault_tolerance=FT, max_steps=2))
    with pytest.raises(MisconfigurationError, match="a torch DataLoader over a map-style dataset"):
        trainer.fit()


def test_a_closure_optimizer_is_refused_at_setup(tmp_path: Any) -> None:
    class LBFGSTrainer(TinyTrainer):
        def configure_optimizers(self) -> None:
            self.optimizer = torch.optim.LBFGS(self.model.parameters())

    trainer = LBFGSTrainer(quiet_config(tmp_path, fault_tolerance=FT, max_steps=2))
    with pytest.raises(MisconfigurationError, match=r"steps with a closure \(LBFGS\) is not supported with fault_tol"):
        trainer.fit()


def test_without_torchrun_the_fit_says_how_to_start_a_group(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    pytest.importorskip("torchft")
    trainer = TinyTrainer(quiet_config(tmp_path, fault_tolerance=FT, max_steps=2))
    with pytest.raises(MisconfigurationError, match="start each replica group with torchrun"):
        trainer.fit()


def test_the_global_order_is_a_global_order_samplers() -> None:
    """The order the quorum deals out is the one `GlobalOrderSampler` (a DistributedSampler over all ranks) reads,
    for the same seed and epoch: one global order for fault tolerance and for a resume at any world size."""
    data = list(range(50))
    sampler = GlobalOrderSampler(data, seed=7)
    cursor = SampleCursor(seed=7)
    for epoch in (0, 3):
        sampler.set_epoch(epoch)
        cursor.epoch = epoch
        assert cursor.order(50, shuffle=True).tolist() == list(sampler)
    assert cursor.order(5, shuffle=False).tolist() == [0, 1, 2, 3, 4]


class _Shuffled(TinyTrainer):
    """TinyTrainer over 32 samples, batch 4, its loader shuffled by `sampler` ("random": shuffle=True; "global":
    a GlobalOrderSampler of config.seed)."""

    def __init__(self, config: DreamTrainerConfig, sampler: str) -> None:
        super().__init__(config, n_train=32, n_val=0)
        self.sampler = sampler

    def configure_dataloaders(self) -> Any:
        from conftest import make_regression_data
        from torch.utils.data import TensorDataset

        x, y = make_regression_data(32)
        data = TensorDataset(x, y)
        if self.sampler == "random":
            return DataLoader(data, batch_size=4, shuffle=True), None
        return DataLoader(data, batch_size=4, sampler=GlobalOrderSampler(data, seed=self.config.seed or 0)), None


def _mid_epoch_checkpoint(tmp_path: Any, sampler: str) -> str:
    """A run without fault tolerance, 3 steps into an epoch of 8: its checkpoint."""
    trainer = _Shuffled(quiet_config(tmp_path / "plain", max_steps=3), sampler)
    trainer.fit()
    path = str(tmp_path / "mid.ckpt")
    trainer.save_checkpoint(path)
    return path


def test_a_checkpoint_without_it_is_continued_from_its_global_sample_cursor(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torchft")
    path = _mid_epoch_checkpoint(tmp_path, "global")
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # the fit stops where it would join the groups
    trainer = _Shuffled(quiet_config(tmp_path / "ft", fault_tolerance=FT, max_steps=6), "random")
    with pytest.raises(MisconfigurationError, match="start each replica group with torchrun"):
        trainer.fit(ckpt_path=path)
    ft = trainer._fault_tolerance
    assert ft is not None
    assert (ft.cursor.epoch, ft.cursor.position) == (0, 12)  # 3 steps x 4 samples of the same global order
    assert ft.order_key == ("distributed", trainer.config.seed)


def test_a_checkpoint_of_another_order_is_refused_mid_epoch_naming_both(tmp_path: Any) -> None:
    path = _mid_epoch_checkpoint(tmp_path, "random")  # one process's RandomSampler: an order no rank can split
    trainer = _Shuffled(quiet_config(tmp_path / "ft", fault_tolerance=FT, max_steps=6), "random")
    with pytest.raises(CheckpointError) as exc:
        trainer.fit(ckpt_path=path)
    line, details = str(exc.value).split("\n", 1)
    assert "written mid-epoch without fault_tolerance, cannot continue its epoch under it" in line
    assert "GlobalOrderSampler(dataset, seed=config.seed)" in line and len(line) < 300
    assert f"this run's ('distributed', {trainer.config.seed})" in details


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        ("nan", "tensor models.model.weight: it holds NaN or infinite values"),
        ("section", "section 'optimizers': missing"),
    ],
)
def test_a_damaged_state_from_a_peer_is_refused_before_anything_loads(tmp_path: Any, damage: str, says: str) -> None:
    """What a live replica sends a healing one is verified as a checkpoint file is, before it is loaded."""
    trainer = TinyTrainer(quiet_config(tmp_path, fault_tolerance=FT, max_steps=2))
    state = trainer.state_dict()
    before = trainer.model.weight.detach().clone()
    if damage == "nan":
        state["models"]["model"]["weight"] = torch.full_like(before, float("nan"))
    else:
        del state["optimizers"]
    ft = trainer._fault_tolerance
    assert ft is not None
    with pytest.raises(CheckpointError) as exc:
        ft._receive(state)
    assert str(exc.value).startswith("checkpoint 'the run state received from a live replica group' is damaged: ")
    assert says in str(exc.value)
    assert torch.equal(trainer.model.weight, before)


def test_without_a_lighthouse_or_a_group_id_the_trainer_is_refused_when_built(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torchft")
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    with pytest.raises(ConfigError, match=r"fault_tolerance\.lighthouse is not set and TORCHFT_LIGHTHOUSE is empty"):
        TinyTrainer(quiet_config(tmp_path, fault_tolerance=FaultToleranceConfig(replica_id="0")))
    with pytest.raises(ConfigError, match=r"fault_tolerance\.replica_id is not set and REPLICA_GROUP_ID is empty"):
        TinyTrainer(quiet_config(tmp_path, fault_tolerance=FaultToleranceConfig(lighthouse="http://127.0.0.1:1")))
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:1")
    monkeypatch.setenv("REPLICA_GROUP_ID", "2")
    TinyTrainer(quiet_config(tmp_path, fault_tolerance=FaultToleranceConfig()))  # both from the environment


def test_a_manual_optimizer_step_is_refused_naming_what_to_write(tmp_path: Any) -> None:
    trainer = TinyTrainer(quiet_config(tmp_path, fault_tolerance=FT, max_steps=2))
    trainer.state_dict()  # sets the trainer up (models, optimizers), as a fit does
    with pytest.raises(MisconfigurationError, match=r"called self.step\(\), which fault_tolerance does not support"):
        trainer.step(trainer.optimizer)
