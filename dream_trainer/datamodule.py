"""`DataModule`: the data of a run in one object, as Lightning's `LightningDataModule`.

A trainer given one (`MyTrainer(config, datamodule=dm)` or `trainer.fit(datamodule=dm)`) takes its
loaders from it instead of `configure_dataloaders`: `train_dataloader()` and `val_dataloader()` for
`fit()` and `validate()`, `test_dataloader()` for `test()`, `predict_dataloader()` for `predict()`.
A Lightning DataModule ports by changing its base class.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class DataModule:
    """Prepares, splits and serves the data of a run. Override what you need; every method is optional.

    Order: `prepare_data()` once on global rank zero (download, tokenize: work that writes files), then
    `setup(stage)` on every process (`stage`: "fit", "validate", "test" or "predict"; build datasets,
    split), then the loaders; `teardown(stage)` at the end of `fit()`. `state_dict()` goes into the
    trainer's checkpoints and `load_state_dict()` gets it back on resume (e.g. a curriculum's position).
    """

    def prepare_data(self) -> None:
        """Once per run, on global rank zero only, before `setup`: download or write files here."""

    def setup(self, stage: str) -> None:
        """On every process, before the loaders of `stage` are asked for: build the datasets here."""

    def train_dataloader(self) -> Iterable[Any] | None:
        """The training loader (needed by `fit()`)."""
        return None

    def val_dataloader(self) -> Iterable[Any] | None:
        """The validation loader, or None."""
        return None

    def test_dataloader(self) -> Iterable[Any] | None:
        """The loader `test()` uses, or None."""
        return None

    def predict_dataloader(self) -> Iterable[Any] | None:
        """The loader `predict()` uses, or None."""
        return None

    def teardown(self, stage: str) -> None:
        """At the end of `fit()` (stage "fit"): close files, free memory."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this DataModule (default: nothing)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict()` returned."""
