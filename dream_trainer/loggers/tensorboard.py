"""TensorBoardLogger: scalars, hyperparameters, images and histograms in TensorBoard event files."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dream_trainer.loggers import tb_summaries
from dream_trainer.loggers.base import Logger
from dream_trainer.loggers.event_file import EventFile


class TensorBoardLogger(Logger):
    """Writes TensorBoard event files into the run's log directory.

    Open them with `tensorboard --logdir <root_dir>/logs`. Records are kept in memory and appended
    to the event file every `flush_secs` seconds, at each checkpoint and at the end of the run, so
    logging every step costs next to nothing (see `dream_trainer.loggers.event_file`).

    For anything else TensorBoard can show (figures, graphs, embeddings, ...) `experiment` is a
    `torch.utils.tensorboard.SummaryWriter` on the same directory, created on first use.

    Args:
        save_dir: directory for the event files (default: the trainer's `log_dir`).
        flush_secs: the longest a logged value waits in memory before it is written to the file.
    """

    def __init__(self, save_dir: str | os.PathLike[str] | None = None, flush_secs: float = 10) -> None:
        self.log_dir = Path(save_dir) if save_dir is not None else None
        self.flush_secs = flush_secs
        self._events: EventFile | None = None
        self._writer: Any = None
        self._hparams_logged = False

    @property
    def events(self) -> EventFile:
        """The run's event file (created on first use)."""
        if self._events is None:
            if self.log_dir is None:
                raise RuntimeError("TensorBoardLogger has no directory: pass save_dir or attach it to a trainer")
            self._events = EventFile(self.log_dir, flush_secs=self.flush_secs)
        return self._events

    @property
    def experiment(self) -> Any:
        """A `torch.utils.tensorboard.SummaryWriter` on the log directory, for the rest of TensorBoard's API
        (`add_figure`, `add_graph`, ...). It writes its own event file next to the logger's."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            if self.log_dir is None:
                raise RuntimeError("TensorBoardLogger has no directory: pass save_dir or attach it to a trainer")
            self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=int(self.flush_secs))
        return self._writer

    writer = experiment  # the name this property had in 0.1.0

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        flat = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in params.items()}
        # In the run's own event file (SummaryWriter.add_hparams would start a separate run), so the
        # HPARAMS tab lists the run next to its scalars; the TEXT tab shows the config as a table.
        self.events.add_summary(tb_summaries.hparams_start(flat), 0)
        self._hparams_logged = True
        table = "\n".join(f"| {k} | {v} |" for k, v in flat.items())
        self.events.add_summary(tb_summaries.text("config", "| field | value |\n|---|---|\n" + table), 0)
        assert self.log_dir is not None
        (self.log_dir / "hparams.json").write_text(json.dumps(flat, indent=2, default=str))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.events.add_scalars(metrics, step)

    def log_images(self, tag: str, images: torch.Tensor, step: int) -> None:
        self.events.add_summary(tb_summaries.images(tag, images), step)

    def log_histogram(self, tag: str, values: torch.Tensor, step: int) -> None:
        self.events.add_summary(tb_summaries.histogram(tag, values), step)

    def flush(self) -> None:
        if self._events is not None:
            self._events.flush()
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str) -> None:
        if self._events is not None:
            if self._hparams_logged:
                self._events.add_summary(tb_summaries.hparams_end(status), 0)
            self._events.close()
            self._events = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
