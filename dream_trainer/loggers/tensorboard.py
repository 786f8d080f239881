"""TensorBoardLogger: scalars, hyperparameters, images and histograms in TensorBoard event files."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dream_trainer.loggers import tb_summaries
from dream_trainer.loggers.base import Logger
from dream_trainer.loggers.event_file import EventFile, live_events_at
from dream_trainer.loggers.resume import ResumeBoundary

# What a resumed logger holds at the resume step: a serialized event read back, or a call to replay.
_Row = tuple[str, Any, int]  # ("record", bytes, step) | ("scalars", metrics, step) | ("summary", Summary, step)


class TensorBoardLogger(Logger):
    """Writes TensorBoard event files into the run's log directory.

    Open them with `tensorboard --logdir <root_dir>` (every run) or `--logdir <run_dir>` (this
    one). Records are kept in memory and appended
    to the event file every `flush_secs` seconds, at each checkpoint and at the end of the run, so
    logging every step costs next to nothing (see `dream_trainer.loggers.event_file`).

    For anything else TensorBoard can show (figures, graphs, embeddings, ...) `experiment` is a
    `torch.utils.tensorboard.SummaryWriter` on the same directory, created on first use.

    A resumed run appends a new event file to the directory. It starts with TensorBoard's restart marker
    at the checkpoint's step (`SessionLog.START`, what `SummaryWriter(purge_step=...)` writes), so
    TensorBoard hides every point the stopped process logged from that step on; the points of that
    step the resumed run does not log again are copied into the new file (see
    `dream_trainer.loggers.resume`). Each step then shows once. (A `SummaryWriter` of your own on a
    resumed run must not be given `purge_step`: its marker would hide this logger's points.)

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
        self._purge_step: int | None = None  # set by `resume`: the new file's restart marker
        self._boundary: ResumeBoundary[_Row] | None = None

    @property
    def events(self) -> EventFile:
        """The run's event file (created on first use)."""
        if self._events is None:
            if self.log_dir is None:
                raise RuntimeError("TensorBoardLogger has no directory: pass save_dir or attach it to a trainer")
            self._events = EventFile(self.log_dir, flush_secs=self.flush_secs, purge_step=self._purge_step)
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

    def resume(self, step: int) -> None:
        if self.log_dir is None:
            return
        held = live_events_at(self.log_dir, step)
        self._boundary = ResumeBoundary(
            step, [(frozenset(v.tag for v in e.summary.value), ("record", e.SerializeToString(), step)) for e in held]
        )
        if self._events is not None:  # already open (values logged before fit): the marker goes into it
            self._events.add_event(self._restart_marker(step))
        else:
            self._purge_step = step
        # The session of the hyperparameters plugin was started by the run's first process; the
        # resumed one records its end (the config text is not written a second time).
        self._hparams_logged = True

    @staticmethod
    def _restart_marker(step: int) -> Any:
        from tensorboard.compat.proto import event_pb2

        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        return event_pb2.Event(wall_time=time.time(), step=step, session_log=start)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        flat = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in params.items()}
        if self._boundary is not None or self._purge_step is not None:  # resumed: see `resume`
            self.events  # noqa: B018 - the new file with its restart marker, at once
            assert self.log_dir is not None
            (self.log_dir / "hparams.json").write_text(json.dumps(flat, indent=2, default=str))
            return
        # In the run's own event file (SummaryWriter.add_hparams would start a separate run), so the
        # HPARAMS tab lists the run next to its scalars; the TEXT tab shows the config as a table.
        self.events.add_summary(tb_summaries.hparams_start(flat), 0)
        self._hparams_logged = True
        table = "\n".join(f"| {k} | {v} |" for k, v in flat.items())
        self.events.add_summary(tb_summaries.text("config", "| field | value |\n|---|---|\n" + table), 0)
        assert self.log_dir is not None
        (self.log_dir / "hparams.json").write_text(json.dumps(flat, indent=2, default=str))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self._boundary is None:
            self.events.add_scalars(metrics, step)
        else:
            self._replay(self._boundary.add(frozenset(metrics), ("scalars", metrics, step), step))

    def log_images(self, tag: str, images: torch.Tensor, step: int) -> None:
        self._add_summary(tb_summaries.images(tag, images), step)

    def log_histogram(self, tag: str, values: torch.Tensor, step: int) -> None:
        self._add_summary(tb_summaries.histogram(tag, values), step)

    def _add_summary(self, summary: Any, step: int) -> None:
        if self._boundary is None:
            self.events.add_summary(summary, step)
        else:
            names = frozenset(v.tag for v in summary.value)
            self._replay(self._boundary.add(names, ("summary", summary, step), step))

    def _replay(self, rows: list[_Row]) -> None:
        if not rows:
            return
        self._boundary = None
        events = self.events
        for kind, value, step in rows:
            if kind == "record":
                events.add_record(value)
            elif kind == "scalars":
                events.add_scalars(value, step)
            else:
                events.add_summary(value, step)

    def flush(self) -> None:
        if self._boundary is not None:
            self._replay(self._boundary.release())
            self._boundary = None
        if self._events is not None:
            self._events.flush()
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str) -> None:
        if self._boundary is not None:
            self._replay(self._boundary.release())
            self._boundary = None
        self._purge_step = None
        if self._events is not None:
            if self._hparams_logged:
                self._events.add_summary(tb_summaries.hparams_end(status), 0)
            self._events.close()
            self._events = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
