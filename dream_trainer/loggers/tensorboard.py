"""TensorBoardLogger: scalars, hyperparameters, images and histograms in TensorBoard event files."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dream_trainer.loggers.base import Logger
from dream_trainer.utils.images import encode_png


class TensorBoardLogger(Logger):
    """Writes event files with `torch.utils.tensorboard.SummaryWriter` into the run's log directory.

    Open them with `tensorboard --logdir <root_dir>/logs`. The writer (and tensorboard's import) is
    created on first use, so an unused logger costs nothing.

    Args:
        save_dir: directory for the event files (default: the trainer's `log_dir`).
        flush_secs: how often the writer flushes to disk in the background.
    """

    def __init__(self, save_dir: str | os.PathLike[str] | None = None, flush_secs: int = 10) -> None:
        self.log_dir = Path(save_dir) if save_dir is not None else None
        self.flush_secs = flush_secs
        self._writer: Any = None

    @property
    def writer(self) -> Any:
        """The `SummaryWriter` (created on first use)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            if self.log_dir is None:
                raise RuntimeError("TensorBoardLogger has no directory: pass save_dir or attach it to a trainer")
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=self.flush_secs)
        return self._writer

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        flat = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in params.items()}
        # The hparams plugin summaries go into this run's own event file (add_hparams would start
        # a separate run), so the HPARAMS tab lists the run next to its scalars.
        for summary in hparams(flat, {}):
            self.writer.file_writer.add_summary(summary)
        table = "\n".join(f"| {k} | {v} |" for k, v in flat.items())
        self.writer.add_text("config", "| field | value |\n|---|---|\n" + table, 0)
        assert self.log_dir is not None
        (self.log_dir / "hparams.json").write_text(json.dumps(flat, indent=2, default=str))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        # One event holding every scalar of this step: add_scalar per metric builds and queues an
        # event each, which dominated the cost of logging every step.
        values = [Summary.Value(tag=name, simple_value=float(value)) for name, value in metrics.items()]
        self.writer.file_writer.add_summary(Summary(value=values), step)

    def log_images(self, tag: str, images: torch.Tensor, step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = []
        for i, img in enumerate(images):
            h, w, c = img.shape
            png = encode_png(img)
            name = tag if len(images) == 1 else f"{tag}/{i}"
            values.append(
                Summary.Value(tag=name, image=Summary.Image(height=h, width=w, colorspace=c, encoded_image_string=png))
            )
        self.writer.file_writer.add_summary(Summary(value=values), step)

    def log_histogram(self, tag: str, values: torch.Tensor, step: int) -> None:
        self.writer.add_histogram(tag, values.float().numpy(), step)

    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
