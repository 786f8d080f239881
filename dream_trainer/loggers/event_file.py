"""TensorBoard event files, written in batches from the training thread.

tensorboard's own `EventFileWriter` hands every event to a writer thread through a queue of 20 and
checksums it with a pure-Python CRC: logging every step of a small model then costs more than the
step (a thread wake-up and a GIL hand-off per event, and importing it pulls in tensorboard's
TensorFlow stub: +300 modules, +13 MiB). This writer keeps the records in a list and appends them to
the file in one `write` every `flush_secs` (and on `flush()`): per logged step it costs a tuple and a
clock read; the protos are built, framed and checksummed (CRC-32C in C, by google-crc32c) at
flush time. The file format is tensorboard's (TFRecord framing of `Event` protos from
`tensorboard.compat.proto`), so TensorBoard and its `EventAccumulator` read it like any other event file.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import socket
import struct
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import google_crc32c

from dream_trainer.utils.replace_file import naming

_file_ids = itertools.count()  # tensorboard's naming: several writers of one process get distinct files


def masked_crc32c(data: bytes) -> int:
    """The masked CRC-32C of `data`, as TFRecord framing stores it."""
    # CRC-32C (Castagnoli) in C: a table-driven loop in Python cost 10 us per scalar record and 0.09 s
    # per MiB of image on the training thread. google-crc32c falls back to its own pure-Python code
    # (with a RuntimeWarning) where its C extension cannot load.
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(record: bytes) -> bytes:
    """`record` in TFRecord framing: length, its CRC, the bytes, their CRC."""
    header = struct.pack("<Q", len(record))
    return header + struct.pack("<I", masked_crc32c(header)) + record + struct.pack("<I", masked_crc32c(record))


def read_records(path: Path) -> Iterator[bytes]:
    """The records of a TFRecord file, in order; a record a stopped process left unfinished (short, or
    failing its checksum) ends the file."""
    data = path.read_bytes()
    pos = 0
    while pos + 12 <= len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        end = pos + 12 + length + 4
        if header_crc != masked_crc32c(header) or end > len(data):
            return
        record = data[pos + 12 : pos + 12 + length]
        if struct.unpack("<I", data[end - 4 : end])[0] != masked_crc32c(record):
            return
        yield record
        pos = end


def event_files(log_dir: Path) -> list[Path]:
    """The event files of `log_dir`, in the order TensorBoard reads them (by name: by creation time)."""
    return sorted(p for p in log_dir.glob("*tfevents*") if p.is_file())


def _stamp(path: Path) -> int:
    """The creation time in an event file's name (`events.out.tfevents.<time>.<host>...`); 0 if none."""
    parts = path.name.split(".")
    return int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else 0


def live_events_at(log_dir: Path, step: int) -> list[Any]:
    """The `Event`s with a summary at `step` in `log_dir` that TensorBoard shows: those no later
    `SessionLog.START` at a step <= `step` purged (TensorBoard's restart rule), in file order."""
    from tensorboard.compat.proto import event_pb2

    START = event_pb2.SessionLog.START
    found: list[Any] = []
    for path in event_files(log_dir):
        for record in read_records(path):
            event = event_pb2.Event.FromString(record)
            if event.HasField("session_log") and event.session_log.status == START and event.step <= step:
                found.clear()
            elif event.step == step and event.HasField("summary"):
                found.append(event)
    return found


class EventFile:
    """One `events.out.tfevents.*` file in `log_dir`, appended to in batches.

    Args:
        log_dir: the directory (created if missing).
        flush_secs: pending records are written when one is added this long after the last write.
        max_pending: ... or when this many are pending (bounds the memory and the pause of a write).
        purge_step: a resumed run's first step to log anew: the file starts with TensorBoard's restart
            marker (`SessionLog.START` at this step, as `SummaryWriter(purge_step=...)` writes), so
            TensorBoard hides what earlier files of the directory hold from this step on.
    """

    def __init__(
        self, log_dir: Path, flush_secs: float = 10.0, max_pending: int = 1000, purge_step: int | None = None
    ) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        self._Event, self._Summary = event_pb2.Event, summary_pb2.Summary
        log_dir.mkdir(parents=True, exist_ok=True)
        stamp = int(time.time())
        if purge_step is not None:  # TensorBoard reads a directory's files in name order: this one comes last
            stamp = max([stamp, *(_stamp(p) + 1 for p in event_files(log_dir))])
        name = f"events.out.tfevents.{stamp:010d}.{socket.gethostname()}.{os.getpid()}.{next(_file_ids)}"
        self.path = log_dir / name
        self.flush_secs = flush_secs
        self.max_pending = max_pending
        # bytes: a record ready to frame; tuple: a row of scalars whose protos are built at flush time
        self._pending: list[bytes | tuple[float, int, Mapping[str, float]]] = []
        self._file: IO[bytes] | None = open(self.path, "wb")  # noqa: SIM115 - held open for appends
        self._next_flush = 0.0
        self.add_event(self._Event(wall_time=time.time(), step=purge_step or 0, file_version="brain.Event:2"))
        if purge_step is not None:
            from tensorboard.compat.proto import event_pb2

            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self.add_event(self._Event(wall_time=time.time(), step=purge_step, session_log=start))
        self.flush()
        atexit.register(self.close)  # what is still in memory when the interpreter exits is written

    def add_scalars(self, metrics: Mapping[str, float], step: int) -> None:
        """Queue one event holding every scalar of `metrics` at `step` (the per-step path: no proto yet)."""
        self._pending.append((time.time(), step, metrics))
        self._maybe_flush()

    def add_summary(self, summary: Any, step: int) -> None:
        """Queue a `Summary` proto (images, text, histograms, hparams) at `step`."""
        self.add_event(self._Event(wall_time=time.time(), step=step, summary=summary))

    def add_event(self, event: Any) -> None:
        """Queue an `Event` proto."""
        self.add_record(event.SerializeToString())

    def add_record(self, record: bytes) -> None:
        """Queue a serialized `Event`."""
        self._pending.append(record)
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if len(self._pending) >= self.max_pending or time.monotonic() >= self._next_flush:
            self.flush()

    def flush(self) -> None:
        """Write every pending record to the file (no fsync: the OS writes it out, as tensorboard does)."""
        self._next_flush = time.monotonic() + self.flush_secs
        if not self._pending or self._file is None:
            return
        Event, Summary, Value = self._Event, self._Summary, self._Summary.Value
        chunks = []
        for item in self._pending:
            if isinstance(item, tuple):
                wall_time, step, metrics = item
                values = [Value(tag=k, simple_value=v) for k, v in metrics.items()]
                item = Event(wall_time=wall_time, step=step, summary=Summary(value=values)).SerializeToString()
            chunks.append(frame(item))
        self._pending.clear()
        with naming(self.path):  # a write to an open file names none: name it for the error's first line
            self._file.write(b"".join(chunks))
            self._file.flush()

    def close(self) -> None:
        """Flush and close the file."""
        if self._file is None:
            return
        atexit.unregister(self.close)  # closed now, even when the flush fails: nothing is retried at exit
        try:
            self.flush()
        finally:
            self._pending.clear()
            file, self._file = self._file, None
            with contextlib.suppress(OSError):  # a buffer the disk refused: the flush has said why
                file.close()
