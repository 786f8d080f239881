"""`Trainer.load_from_checkpoint(path, **overrides)`: the trainer and its config rebuilt from the
checkpoint's own plain-data record, its weights loaded, nothing unpickled."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyTrainer, make_regression_data, quiet_config
from helpers import Hostile
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import Callback, CheckpointError, ConfigError, DreamTrainer, DreamTrainerConfig
from dream_trainer.utils.checkpoint_io import atomic_save


@dataclass
class WideConfig(DreamTrainerConfig):
    hidden: int = 8
    lr: float = 0.05


class Wide(DreamTrainer):
    """Hyper-parameters in the config (recorded in checkpoints); `scale` only in `__init__` (not recorded)."""

    def __init__(self, config: WideConfig, scale: float) -> None:
        super().__init__(config)
        self.scale = scale

    def configure_models(self) -> None:
        self.model = nn.Sequential(nn.Linear(4, self.config.hidden), nn.ReLU(), nn.Linear(self.config.hidden, 1))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.config.lr)

    def configure_dataloaders(self) -> tuple[DataLoader, DataLoader]:
        x, y = make_regression_data(64)
        data = TensorDataset(x, y * self.scale)
        return DataLoader(data, batch_size=16, shuffle=True), DataLoader(data, batch_size=32)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y)}


class Counter(Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        self.batches += 1


def _wide_config(tmp_path: Any, **overrides: Any) -> WideConfig:
    base: dict[str, Any] = {
        "device": "cpu",
        "root_dir": str(tmp_path),
        "loggers": [],
        "enable_progress_bar": False,
        "print_epoch_summary": False,
        "num_sanity_val_steps": 0,
        "n_epochs": 2,
        "hidden": 12,
    }
    return WideConfig(**{**base, **overrides})


@pytest.fixture
def trained(tmp_path):
    trainer = Wide(_wide_config(tmp_path, callbacks=[Counter()]), scale=2.0)
    trainer.fit()
    return trainer, tmp_path / "version_0" / "checkpoints" / "last.ckpt"


def test_rebuilds_config_and_weights_from_the_checkpoint_record(trained):
    original, path = trained
    loaded = Wide.load_from_checkpoint(path, scale=2.0)

    assert type(loaded.config) is WideConfig and loaded.config.hidden == 12
    recorded = original.config.to_dict()
    rebuilt = loaded.config.to_dict()
    assert {k: v for k, v in rebuilt.items() if k != "callbacks"} == {
        k: v for k, v in recorded.items() if k != "callbacks"
    }
    assert recorded["callbacks"] == ["Counter"] and loaded.config.callbacks == []  # live objects: not rebuilt
    for a, b in zip(loaded.model.parameters(), original.model.parameters(), strict=True):
        assert torch.equal(a, b)
    # Weights only: training state starts fresh, as after Lightning's load_from_checkpoint.
    assert loaded.global_step == 0 and loaded.current_epoch == 0
    assert loaded.optimizer.state_dict()["state"] == {}
    assert loaded.validate() == pytest.approx(original.validate())


def test_overrides_are_config_fields_or_init_parameters_and_are_validated(trained):
    _, path = trained
    counter = Counter()
    loaded = Wide.load_from_checkpoint(path, scale=2.0, n_epochs=3, lr=0.01, callbacks=[counter])
    assert (loaded.config.n_epochs, loaded.config.lr, loaded.scale) == (3, 0.01, 2.0)
    assert loaded.config.callbacks == [counter]

    with pytest.raises(ConfigError, match=r"'n_epoch' is neither a field of WideConfig.*Did you mean 'n_epochs'"):
        Wide.load_from_checkpoint(path, scale=2.0, n_epoch=3)
    with pytest.raises(ConfigError, match="Did you mean 'scale'"):
        Wide.load_from_checkpoint(path, scal=2.0)
    with pytest.raises(ConfigError, match=r"WideConfig.n_epochs = 0 is invalid.*recorded in"):
        Wide.load_from_checkpoint(path, scale=2.0, n_epochs=0)
    with pytest.raises(ConfigError, match=r"Wide.__init__ needs scale besides the config.*scale=\.\.\."):
        Wide.load_from_checkpoint(path)


def test_fit_after_loading_is_a_new_run_from_the_weights_and_ckpt_path_resumes(trained, tmp_path):
    original, path = trained
    fine_tuned = Wide.load_from_checkpoint(path, scale=2.0, n_epochs=1)
    start = [p.detach().clone() for p in fine_tuned.model.parameters()]
    fine_tuned.fit()
    assert fine_tuned.global_step == 4  # one epoch of 4 batches, counted from zero
    assert fine_tuned.run_dir != original.run_dir
    assert any(not torch.equal(a, b) for a, b in zip(start, fine_tuned.model.parameters(), strict=True))

    resumed = Wide.load_from_checkpoint(path, scale=2.0, n_epochs=3)
    resumed.fit(ckpt_path=path)  # the whole training state: counters, optimizer, RNG
    assert resumed.global_step == 12


def test_last_finds_the_newest_run(trained, tmp_path):
    newer = Wide(_wide_config(tmp_path, hidden=6), scale=1.0)
    newer.fit()
    loaded = Wide.load_from_checkpoint("last", root_dir=str(tmp_path), scale=1.0)
    assert loaded.config.hidden == 6
    for a, b in zip(loaded.model.parameters(), newer.model.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(CheckpointError, match=r"no run under .*nowhere"):
        Wide.load_from_checkpoint("last", root_dir=str(tmp_path / "nowhere"), scale=1.0)


def test_config_class_comes_from_the_trainer_never_from_the_file(trained):
    _, path = trained

    class Unannotated(Wide):
        def __init__(self, config, scale: float = 1.0) -> None:  # no annotation: DreamTrainerConfig
            super().__init__(config, scale)

    with pytest.raises(CheckpointError, match=r"fields \['hidden', 'lr'\] that DreamTrainerConfig lacks.*config_class"):
        Unannotated.load_from_checkpoint(path)

    class Declared(Unannotated):
        config_class = WideConfig

    assert Declared.load_from_checkpoint(path).config.hidden == 12


def test_tiny_trainer_with_init_defaults_and_strict(tmp_path):
    trainer = TinyTrainer(quiet_config(tmp_path, enable_checkpointing=True), batch_size=8)
    trainer.fit()
    path = tmp_path / "version_0" / "checkpoints" / "last.ckpt"
    loaded = TinyTrainer.load_from_checkpoint(path, batch_size=8)
    assert loaded.batch_size == 8 and torch.equal(loaded.model.weight, trainer.model.weight)

    class Bigger(TinyTrainer):
        def configure_models(self) -> None:
            self.head = nn.Linear(1, 1)

    with pytest.raises(CheckpointError, match=r"no models named \['head'\].*strict=False"):
        Bigger.load_from_checkpoint(path)
    assert torch.equal(Bigger.load_from_checkpoint(path, strict=False).model.weight, trainer.model.weight)


def test_a_hostile_config_record_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    trainer = TinyTrainer(quiet_config(tmp_path))
    state = trainer.state_dict()
    state["dream_trainer"]["config"]["seed"] = Hostile(marker)
    atomic_save(state, tmp_path / "evil.ckpt")
    with pytest.raises(CheckpointError, match="refused to load"):
        TinyTrainer.load_from_checkpoint(tmp_path / "evil.ckpt")
    assert not marker.exists()

    (tmp_path / "half.ckpt").mkdir()
    with pytest.raises(CheckpointError, match="directory but not a complete sharded checkpoint"):
        TinyTrainer.load_from_checkpoint(tmp_path / "half.ckpt")
    del state["dream_trainer"]
    state["seed"] = 1
    atomic_save(state, tmp_path / "bare.ckpt")
    with pytest.raises(CheckpointError, match="records no config"):
        TinyTrainer.load_from_checkpoint(tmp_path / "bare.ckpt")


@pytest.mark.slow
def test_sharded_checkpoint_loads_its_models_only(tmp_path):
    """FSDP on one process writes a DCP directory; the config comes from its trainer_state.pt and
    only the models' shards are read."""
    from dream_trainer.utils import unwrap
    from dream_trainer.utils.checkpoint_io import is_sharded_checkpoint

    first = TinyTrainer(quiet_config(tmp_path, strategy="fsdp", enable_checkpointing=True))
    first.fit()
    path = tmp_path / "version_0" / "checkpoints" / "last.ckpt"
    assert is_sharded_checkpoint(path)
    loaded = TinyTrainer.load_from_checkpoint(path, strategy="single")
    assert loaded.config.strategy == "single" and loaded.global_step == 0
    full = unwrap(first.model).state_dict()
    for k, v in loaded.model.state_dict().items():
        assert torch.equal(v, full[k].full_tensor() if hasattr(full[k], "full_tensor") else full[k]), k
