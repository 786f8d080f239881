"""BasePredictionWriter and PredictionWriter: write what `trainer.predict()` computes, per batch or per run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dream_trainer.callbacks.base import Callback
from dream_trainer.errors import ConfigError
from dream_trainer.utils.tensors import move_to_device

if TYPE_CHECKING:
    from dream_trainer.protocol import TrainerProtocol

_INTERVALS = ("batch", "epoch", "batch_and_epoch")
_CPU = torch.device("cpu")


class BasePredictionWriter(Callback):
    """Base class for callbacks that write predictions (Lightning's `BasePredictionWriter`).

    Override `write_on_batch_end` (called after every `predict_step` when `write_interval` is `"batch"`
    or `"batch_and_epoch"`) and/or `write_on_epoch_end` (called once at the end of a `predict()` run,
    with every prediction, when it is `"epoch"` or `"batch_and_epoch"`).

    What the hooks get: `prediction` is what `predict_step` returned for the batch; `predictions` has
    the structure `predict()` returns (a list of outputs, or one list per loader when `predict()` was
    given several loaders); `dataloader_idx` counts the loaders of the run (a loader's batch indices
    restart at 0, which is how the next loader is recognized: an empty loader is not counted).
    `batch_indices` are the dataset indices of the batch's samples (`trainer.current_batch_indices`,
    read from the loader's sampler as Lightning does), so predictions made under a shuffling or
    distributed sampler can be put back in dataset order; for `write_on_epoch_end` they have the
    structure of `predictions` (a list of lists of indices, one list per batch). They are None when the
    loader is not a plain `torch.utils.data.DataLoader` over a map-style dataset (an `IterableDataset`,
    a DataLoader subclass, any other iterable): then write the ids your batches carry.

    Args:
        write_interval: `"batch"`, `"epoch"` or `"batch_and_epoch"`.
    """

    def __init__(self, write_interval: str = "batch") -> None:
        if write_interval not in _INTERVALS:
            raise ConfigError(
                f"{type(self).__name__}(write_interval={write_interval!r}) is invalid: expected one of "
                f"{list(_INTERVALS)}"
            )
        self.write_interval = write_interval
        self._on_batch = write_interval in ("batch", "batch_and_epoch")
        self._on_epoch = write_interval in ("epoch", "batch_and_epoch")
        self._dataloader_idx = 0
        self._last_batch_idx = -1
        self._collected: list[list[Any]] = []
        self._collected_indices: list[list[list[int] | None]] = []

    # --- what subclasses implement ----------------------------------------------------------------
    def write_on_batch_end(
        self,
        trainer: TrainerProtocol,
        prediction: Any,
        batch_indices: list[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """Write the prediction of one batch."""
        raise NotImplementedError(f"{type(self).__name__} must implement write_on_batch_end")

    def write_on_epoch_end(self, trainer: TrainerProtocol, predictions: list[Any], batch_indices: Any) -> None:
        """Write every prediction of the run."""
        raise NotImplementedError(f"{type(self).__name__} must implement write_on_epoch_end")

    # --- hooks ------------------------------------------------------------------------------------
    def on_predict_epoch_start(self, trainer: TrainerProtocol) -> None:
        self._dataloader_idx = 0
        self._last_batch_idx = -1
        self._collected = [[]]
        self._collected_indices = [[]]

    def on_predict_batch_end(self, trainer: TrainerProtocol, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx <= self._last_batch_idx:  # the batch indices restarted: the next loader
            self._dataloader_idx += 1
            self._collected.append([])
            self._collected_indices.append([])
        self._last_batch_idx = batch_idx
        indices = trainer.current_batch_indices
        self._collected_indices[-1].append(indices)  # a few ints per batch: kept for every interval
        if self._on_batch:
            self.write_on_batch_end(trainer, outputs, indices, batch, batch_idx, self._dataloader_idx)
        if self._on_epoch:
            self._collected[-1].append(outputs)

    @property
    def batch_indices(self) -> list[Any]:
        """The dataset indices of each batch of the current (or last) `predict()` run: a list per batch,
        or one such list per loader when `predict()` was given several (None where unknown)."""
        indices = self._collected_indices
        return indices[0] if len(indices) == 1 else indices

    def on_predict_epoch_end(self, trainer: TrainerProtocol) -> None:
        if self._on_epoch:
            collected, self._collected = self._collected, [[]]
            predictions = collected[0] if len(collected) == 1 else collected
            self.write_on_epoch_end(trainer, predictions, self.batch_indices)


class PredictionWriter(BasePredictionWriter):
    """Write predictions with `torch.save`: one file per batch and/or one per `predict()` run, per rank.

    Files (`R`: the global rank, `B`: the batch index, `D`: the loader's index):

    - per batch: `predictions_rankR_batchB.pt` (`predictions_rankR_dataloaderD_batchB.pt` for the second
      and later loaders of a `predict()` given several), holding what `predict_step` returned;
    - per run: `predictions_rankR.pt`, holding this rank's share of what `predict()` returns;
    - per run, whatever the interval: `batch_indices_rankR.pt`, the dataset indices of each batch (the
      structure of `predict()`'s return; None entries where the loader cannot tell, see
      `BasePredictionWriter`), so every prediction can be matched to its sample.

    Tensors are written on the CPU, so the files load on any machine. Each process writes its own files (no
    collective but the one that agrees on the directory), so under a `DistributedSampler` the ranks' files
    together hold every sample once (the sampler pads the last ranks with repeats when the dataset does not
    divide evenly, as `predict()` itself does).

    Args:
        output_dir: where the files go. Default: a new directory inside the run directory,
            `<run_dir>/predictions` for the first `predict()` of the run, `predictions_1`, `predictions_2`,
            ... for the next ones, so a run never writes over earlier predictions. A given directory is
            shared, but an existing file is never overwritten (`FileExistsError`).
        write_interval: `"batch"`, `"epoch"` or `"batch_and_epoch"`.

    `output_path` is the directory of the current (or last) `predict()` run.
    """

    def __init__(self, output_dir: str | os.PathLike[str] | None = None, write_interval: str = "batch") -> None:
        super().__init__(write_interval)
        if output_dir is not None and not isinstance(output_dir, (str, os.PathLike)):
            raise ConfigError(
                f"PredictionWriter(output_dir={output_dir!r}) is invalid: expected None (a directory inside the "
                "run directory) or a path"
            )
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.output_path: Path | None = None

    def on_predict_start(self, trainer: TrainerProtocol) -> None:
        if self.output_dir is not None:
            path = self.output_dir
        else:
            chosen = None
            if trainer.is_global_zero:  # one rank picks the next free name, the others follow it
                base = trainer.run_dir
                n = 0
                while True:
                    candidate = base / ("predictions" if n == 0 else f"predictions_{n}")
                    try:
                        candidate.mkdir(parents=True)
                        break
                    except FileExistsError:
                        n += 1
                chosen = str(candidate)
            path = Path(trainer.broadcast(chosen))
        path.mkdir(parents=True, exist_ok=True)
        self.output_path = path

    def _save(self, obj: Any, name: str) -> None:
        assert self.output_path is not None
        path = self.output_path / name
        try:
            with open(path, "xb") as f:  # exclusive: never overwrite another run's file
                # CPU tensors: the file loads on a machine without this one's GPU (torch.save copies to the
                # host anyway, and records the device it must load onto).
                torch.save(move_to_device(obj, _CPU), f)
        except FileExistsError:
            raise FileExistsError(
                f"PredictionWriter: {path} exists already (another run's predictions?); it is not overwritten. "
                "Use another output_dir, or leave it unset for a new directory inside the run directory."
            ) from None

    def write_on_batch_end(
        self,
        trainer: TrainerProtocol,
        prediction: Any,
        batch_indices: list[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        loader = f"_dataloader{dataloader_idx}" if dataloader_idx else ""
        self._save(prediction, f"predictions_rank{trainer.global_rank}{loader}_batch{batch_idx}.pt")

    def write_on_epoch_end(self, trainer: TrainerProtocol, predictions: list[Any], batch_indices: Any) -> None:
        self._save(predictions, f"predictions_rank{trainer.global_rank}.pt")

    def on_predict_epoch_end(self, trainer: TrainerProtocol) -> None:
        super().on_predict_epoch_end(trainer)
        self._save(self.batch_indices, f"batch_indices_rank{trainer.global_rank}.pt")
